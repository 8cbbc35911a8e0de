//! A whole run of the matrix: the deployment, the baseline, every selected
//! case `cycles` times, and the report.

use std::time::{Duration, Instant};

use crate::bounds::{CONNECT_TIMEOUT, MIB};
use crate::cases::{select_cases, Role};
use crate::cluster::{Cluster, Deployment, WHO};
use crate::context::{Baseline, Runner};
use crate::error::LifecycleError;
use crate::options::Options;
use crate::probes::run_probes;
use crate::prompts::probe_prompts;
use crate::report::MatrixReport;

/// Process-wide unique enough id for request ids of one run.
fn run_id() -> u32 {
    std::process::id()
}

/// A fresh admin token for the deployment.
fn admin_token() -> String {
    use std::hash::{BuildHasher, Hasher};
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    h.write_u32(std::process::id());
    h.write_u128(
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos()),
    );
    format!("lc-{:016x}", h.finish())
}

/// Runs the matrix `options` describe: starts P, D and the proxy (stopped
/// again on every path, also when the returned future is dropped), takes
/// the baseline, and runs every selected case `cycles` times under load.
/// A case that fails is in the report; an error is a run that could not
/// go on (a child exited, a baseline or a measurement failed).
pub async fn run_matrix(mut options: Options) -> Result<MatrixReport, LifecycleError> {
    options.validate()?;
    let cases = select_cases(&options.cases)?;
    let model = std::fs::canonicalize(&options.model).map_err(|source| LifecycleError::Model {
        path: options.model.clone(),
        source,
    })?;
    let mut on_case = options.on_case.take();
    let o = &options;
    let client = reqwest::Client::builder()
        .connect_timeout(CONNECT_TIMEOUT)
        .pool_max_idle_per_host(0)
        .build()
        .map_err(LifecycleError::Client)?;
    let token = admin_token();
    let mut dep = Deployment::new();
    let started = dep.start(o, &model, &token).await?;
    let c = Cluster::new(
        client,
        &token,
        &started,
        Duration::from_secs(o.op_timeout),
        &model,
    );
    let base = baseline(&c, o).await?;
    let runner = Runner {
        c,
        o,
        base,
        run_id: run_id(),
    };
    let mut results = Vec::new();
    for cycle in 1..=o.cycles {
        for case in &cases {
            dep.check_alive()?;
            let started = Instant::now();
            let mut r = runner
                .run_case(case, cycle)
                .await
                .map_err(|e| LifecycleError::Case {
                    name: case.name.clone(),
                    cycle,
                    source: Box::new(e),
                })?;
            r.wall_s = started.elapsed().as_secs_f64();
            if let Some(f) = on_case.as_mut() {
                f(&r);
            }
            results.push(r);
        }
    }
    dep.check_alive()?;
    Ok(MatrixReport {
        transport: o.transport,
        transfer_mode: o.transfer_mode,
        kv_load_failure_policy: o.kv_load_failure_policy,
        cases: cases.len(),
        cycles: o.cycles,
        results,
    })
}

/// The baseline, with nothing else running: the probe set's texts, and
/// the device bytes of P and D awake (in all and rank by rank).
async fn baseline(c: &Cluster, o: &Options) -> Result<Baseline, LifecycleError> {
    let prompts = probe_prompts(o.probes);
    let mut texts = Vec::with_capacity(prompts.len());
    for (index, r) in run_probes(c, &prompts, o.probe_tokens)
        .await
        .into_iter()
        .enumerate()
    {
        texts.push(r.map_err(|e| LifecycleError::BaselineProbe {
            index,
            reason: e.to_string(),
        })?);
    }
    for role in [Role::P, Role::D] {
        if let Some(slow) = c.wait_quiescent(role).await? {
            eprintln!("{WHO}: baseline: {slow}");
        }
    }
    let p_awake = c.device_bytes(Role::P).await?;
    let d_awake = c.device_bytes(Role::D).await?;
    let p_ranks = c.rank_bytes(Role::P).await?;
    let d_ranks = c.rank_bytes(Role::D).await?;
    let ranks = |v: &[u64]| {
        v.iter()
            .map(|b| format!("{:.1}", *b as f64 / MIB))
            .collect::<Vec<_>>()
            .join(" + ")
    };
    eprintln!(
        "{WHO}: baseline: {} probes, P {:.1} MiB ({} ranks: {}), D {:.1} MiB ({} ranks: {}) awake",
        prompts.len(),
        p_awake as f64 / MIB,
        p_ranks.len(),
        ranks(&p_ranks),
        d_awake as f64 / MIB,
        d_ranks.len(),
        ranks(&d_ranks)
    );
    Ok(Baseline {
        prompts,
        texts,
        p_awake,
        d_awake,
        p_ranks,
        d_ranks,
    })
}
