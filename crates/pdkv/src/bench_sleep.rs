//! `pdkv bench sleep`: what sleep mode costs and what it frees, per level.
//!
//! For each level (0, 1, 2) and each cycle: sleep (mode abort), wake every
//! tag, and after level 2 reload the weights from the checkpoint the engine
//! started with. Measured: the latency of each step, the device bytes (live
//! physical bytes of the pool, all tags) awake and asleep, and the host
//! memory holding backups while asleep.
//!
//! Correctness is checked, not assumed: a greedy probe (a few prompts decoded
//! together) before any sleep is the reference, and the same probe after
//! every wake must give the same tokens; the device bytes after every wake
//! must equal those before the first sleep (no drift). The command prints a
//! table, a pass/fail line and, as the last line of stdout, a JSON summary;
//! it exits non-zero when a check fails.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use clap::Args;
use pdkv_engine::{
    Engine, EngineConfig, EngineHandle, EngineRequest, PauseMode, SamplingParams, SleepLevel,
};
use pdkv_vmem::Pool;
use serde_json::json;

use crate::progress;

/// Deadline of each sleep (the engine is idle then, so it is never reached
/// unless something is wrong).
const SLEEP_TIMEOUT: Duration = Duration::from_secs(120);

/// Prompts of the greedy probe.
const PROBE_PROMPTS: &[&str] = &[
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a small village by the sea,",
    "The three primary colours are",
];

#[derive(Args, Debug)]
pub struct SleepArgs {
    /// A `.gguf` file or Hugging Face directory (default: the cached SmolLM2).
    #[arg(long)]
    pub model: Option<PathBuf>,
    /// KV cache size in blocks of 16 tokens.
    #[arg(long, default_value_t = 512)]
    pub num_kv_blocks: usize,
    /// Sleep/wake cycles per level.
    #[arg(long, default_value_t = 3)]
    pub cycles: usize,
    /// Tokens each probe prompt decodes (greedy).
    #[arg(long, default_value_t = 16)]
    pub probe_tokens: u32,
}

/// One level's measurements over all its cycles.
#[derive(Default)]
struct LevelResult {
    sleep_ms: Vec<f64>,
    wake_ms: Vec<f64>,
    reload_ms: Vec<f64>,
    awake_bytes: u64,
    /// The most seen asleep over the cycles.
    asleep_bytes: u64,
    host_backup_bytes: u64,
    probes_matched: usize,
    probes_run: usize,
}

/// The middle value of `v` (the mean of the two middle ones; NaN if empty).
pub(crate) fn median(v: &[f64]) -> f64 {
    if v.is_empty() {
        return f64::NAN;
    }
    let mut s = v.to_vec();
    s.sort_by(f64::total_cmp);
    let n = s.len();
    if n % 2 == 1 {
        s[n / 2]
    } else {
        (s[n / 2 - 1] + s[n / 2]) / 2.0
    }
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1e3
}

/// Decodes every probe prompt greedily, all at once; returns the token ids.
fn probe(engine: &EngineHandle, round: usize, max_tokens: u32) -> anyhow::Result<Vec<Vec<u32>>> {
    let mut streams = Vec::with_capacity(PROBE_PROMPTS.len());
    for (i, prompt) in PROBE_PROMPTS.iter().enumerate() {
        let prompt_tokens = engine
            .tokenizer()
            .encode(prompt, true)
            .context("tokenizing a probe prompt")?;
        let params = SamplingParams {
            temperature: 0.0,
            max_tokens,
            ignore_eos: true,
            ..SamplingParams::default()
        };
        let req = EngineRequest::new(format!("probe-{round}-{i}"), prompt_tokens, params);
        streams.push(
            engine
                .add_request(req)
                .with_context(|| format!("probe {round}: adding prompt {i}"))?,
        );
    }
    let mut out = Vec::with_capacity(streams.len());
    for (i, mut s) in streams.into_iter().enumerate() {
        let mut tokens = Vec::new();
        let mut finish = None;
        while let Some(o) = s.blocking_next() {
            tokens.extend(o.token_ids);
            finish = o.finish_reason;
        }
        match finish {
            Some(r) if r != pdkv_engine::FinishReason::Abort => {}
            other => bail!(
                "probe {round}: prompt {i} ended with {other:?} after {} tokens",
                tokens.len()
            ),
        }
        out.push(tokens);
    }
    Ok(out)
}

/// Fails unless the engine is awake, unpaused and has its weights.
fn check_serving(engine: &EngineHandle, what: &str) -> anyhow::Result<()> {
    let st = engine.lifecycle_status();
    if st.sleeping.is_some()
        || st.paused.is_some()
        || st.weights_discarded
        || !st.asleep_tags.is_empty()
    {
        bail!("after {what} the engine is not serving: {st:?}");
    }
    Ok(())
}

pub fn run_sleep(args: SleepArgs) -> anyhow::Result<()> {
    anyhow::ensure!(args.cycles > 0, "--cycles must be at least 1");
    anyhow::ensure!(args.num_kv_blocks > 0, "--num-kv-blocks must be at least 1");
    anyhow::ensure!(args.probe_tokens > 0, "--probe-tokens must be at least 1");
    let pool = Pool::default();
    let (path, loaded) = progress::load_model(args.model, &pool)?;
    let name = loaded.name.clone();
    let config = EngineConfig {
        num_kv_blocks: args.num_kv_blocks,
        ..EngineConfig::default()
    };
    let engine = Engine::start(loaded, pool, config).context("starting the engine")?;
    let result = measure(&engine, &path, args.cycles, args.probe_tokens);
    engine.shutdown();
    let (levels, baseline) = result?;

    println!("model: {name} ({})", path.display());
    println!(
        "{} KV blocks, {} cycles per level, {} probe prompts x {} greedy tokens",
        args.num_kv_blocks,
        args.cycles,
        PROBE_PROMPTS.len(),
        args.probe_tokens
    );
    println!(
        "{:>5} {:>10} {:>10} {:>10} {:>12} {:>12} {:>9} {:>12} {:>8}",
        "level",
        "sleep ms",
        "wake ms",
        "reload ms",
        "awake MiB",
        "asleep MiB",
        "asleep %",
        "host MiB",
        "probes"
    );
    let mib = |b: u64| b as f64 / (1024.0 * 1024.0);
    let mut summary = BTreeMap::new();
    let mut all_match = true;
    for (level, r) in &levels {
        let fraction = r.asleep_bytes as f64 / r.awake_bytes.max(1) as f64;
        let reload = median(&r.reload_ms);
        println!(
            "{:>5} {:>10.2} {:>10.2} {:>10} {:>12.1} {:>12.1} {:>8.2}% {:>12.1} {:>8}",
            level,
            median(&r.sleep_ms),
            median(&r.wake_ms),
            if reload.is_nan() {
                "-".to_string()
            } else {
                format!("{reload:.2}")
            },
            mib(r.awake_bytes),
            mib(r.asleep_bytes),
            100.0 * fraction,
            mib(r.host_backup_bytes),
            format!("{}/{}", r.probes_matched, r.probes_run),
        );
        all_match &= r.probes_matched == r.probes_run;
        let mut v = json!({
            "sleep_ms": median(&r.sleep_ms),
            "wake_ms": median(&r.wake_ms),
            "awake_bytes": r.awake_bytes,
            "asleep_bytes": r.asleep_bytes,
            "asleep_fraction": fraction,
            "host_backup_bytes": r.host_backup_bytes,
            "probes_matched": r.probes_matched,
            "probes_run": r.probes_run,
        });
        if !reload.is_nan() {
            v["reload_ms"] = json!(reload);
        }
        summary.insert(level.to_string(), v);
    }
    println!(
        "greedy probes after every wake equal the awake run: {}",
        if all_match { "PASS" } else { "FAIL" }
    );
    println!("device bytes before the first sleep: {baseline}, the same after every wake");
    println!(
        "{}",
        json!({"levels": summary, "probes_match": all_match, "cycles": args.cycles})
    );
    if !all_match {
        bail!("greedy output after a wake differs from the awake run");
    }
    Ok(())
}

/// Runs every level's cycles; returns the results and the awake device bytes.
fn measure(
    engine: &EngineHandle,
    path: &Path,
    cycles: usize,
    probe_tokens: u32,
) -> anyhow::Result<(Vec<(u32, LevelResult)>, u64)> {
    let pool = engine.pool().clone();
    check_serving(engine, "start-up")?;
    let reference = probe(engine, 0, probe_tokens)?;
    let baseline = pool.device_bytes().total();
    let mut round = 1;
    let mut levels = Vec::new();
    for level in [SleepLevel::L0, SleepLevel::L1, SleepLevel::L2] {
        let n = level.as_u32();
        let mut r = LevelResult {
            awake_bytes: baseline,
            ..LevelResult::default()
        };
        for cycle in 0..cycles {
            eprintln!("level {n}, cycle {}/{cycles}", cycle + 1);
            let t = Instant::now();
            engine
                .sleep(level, PauseMode::Abort, SLEEP_TIMEOUT)
                .with_context(|| format!("sleep level {n}"))?;
            r.sleep_ms.push(ms(t.elapsed()));
            r.asleep_bytes = r.asleep_bytes.max(pool.device_bytes().total());
            r.host_backup_bytes = r.host_backup_bytes.max(pool.host_backup_bytes());

            let t = Instant::now();
            engine
                .wake_up(None)
                .with_context(|| format!("wake after level {n}"))?;
            r.wake_ms.push(ms(t.elapsed()));
            if level == SleepLevel::L2 {
                let t = Instant::now();
                engine
                    .update_weights(path, Some(format!("bench-sleep-{cycle}")))
                    .with_context(|| {
                        format!("reloading weights from {} after level 2", path.display())
                    })?;
                r.reload_ms.push(ms(t.elapsed()));
            }
            check_serving(engine, &format!("waking from level {n}"))?;
            let awake = pool.device_bytes().total();
            if awake != baseline {
                bail!("device bytes drifted: {awake} after waking from level {n} (cycle {cycle}), {baseline} before");
            }
            let got = probe(engine, round, probe_tokens)?;
            round += 1;
            r.probes_run += got.len();
            r.probes_matched += got.iter().zip(&reference).filter(|(a, b)| a == b).count();
            for (i, (a, b)) in got.iter().zip(&reference).enumerate() {
                if a != b {
                    eprintln!("level {n} cycle {cycle}: probe {i} differs: {a:?} vs awake {b:?}");
                }
            }
        }
        levels.push((n, r));
    }
    Ok((levels, baseline))
}

#[cfg(test)]
mod tests {
    use super::median;

    #[test]
    fn medians() {
        assert!(median(&[]).is_nan());
        assert_eq!(median(&[3.0]), 3.0);
        assert_eq!(median(&[5.0, 1.0, 3.0]), 3.0);
        assert_eq!(median(&[4.0, 1.0, 3.0, 2.0]), 2.5);
    }
}
