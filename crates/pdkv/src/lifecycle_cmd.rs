//! `pdkv lifecycle`: the lifecycle matrix under load, across a prefill server
//! (P), a decode server (D) and the P/D proxy, each a child process of this
//! executable on loopback.
//!
//! What one run does:
//! 1. Starts P and D (`pdkv serve` with the `pdkv` KV connector, sleep mode
//!    and the admin API) and then `pdkv proxy` in front of them; every child
//!    listens on port 0 and its address is read from its `listening on
//!    http://ADDR` log line. Start-up is bounded and reported on stderr.
//! 2. Baseline, with nothing else running: the greedy probe set through the
//!    proxy (the reference texts), and the device bytes of P and D awake
//!    (the sum over tags of `pdkv_device_memory_bytes`).
//! 3. Per case and cycle: background load through the proxy (workers looping
//!    requests of varied lengths, streaming and not; every
//!    `--disconnect-every`-th request leaves after its first event), the
//!    case's admin calls on P, D or both, restoring both to serving, letting
//!    the load run on until it has completed requests again, stopping it
//!    (each worker finishes its request, bounded), waiting until P and D are
//!    quiescent, and the probe set again.
//!
//! A case passes when every admin call answered as expected, every probe
//! equals the baseline (each probe's KV loaded from P), no load request was
//! lost, no transfer failed, P and D are quiescent, the device bytes after
//! the wake equal the awake baseline, and a sleeping engine (level 1 or 2)
//! held at most 2% of its awake bytes while asleep.
//!
//! A load request is *lost* unless it got: a 200 with a complete body (JSON
//! with a finish reason, or events ending with a finish reason and
//! `[DONE]`); a 503 carrying `Retry-After` (D not serving, passed on by the
//! proxy); a finish reason `abort` in a case that aborts D's requests on
//! purpose (an abort pause of D; for `abort_requests` only the requests D
//! reported as aborted); or the client's own deliberate disconnect. A P that
//! stops on purpose (paused, asleep, aborting) never reaches the client: the
//! proxy lets D compute the prompt, so an abort pause of P alone aborts
//! nothing a client sees. An error the proxy reports (`upstream_error`,
//! `upstream_timeout`, an error event ending a stream) is lost. Every kind
//! is counted.
//!
//! No case tolerates a failed transfer: the deltas of P's
//! `pdkv_kv_pulls_failed_total` and D's `pdkv_kv_loads_failed_total` must be
//! 0. A transfer that a lifecycle operation or a refusal ends on purpose is
//! not a failure and is counted apart, and reported: on P
//! `pdkv_kv_pulls_released_total` (its cache reset or sleep, a refused or
//! aborted prefill, other weights) and `pdkv_kv_pulls_cancelled_total` (D
//! dropped the transfer); on D `pdkv_kv_loads_released_total` (P ended it on
//! purpose; D recomputes), `pdkv_kv_loads_cut_short_total` (D's own cache
//! reset) and `pdkv_kv_loads_cancelled_total` (its request ended first). D's
//! `--kv-load-failure-policy` is `fail` by default, the strict setting (a
//! failed load would also fail its request); the matrix passes under
//! `recompute` too.
//!
//! Sleeps use mode `keep` (running requests are frozen and, when the KV
//! cache is released, recompute after the wake), the mode in which no
//! request may be lost. Level 2 follows a trainer's sequence: pause (keep),
//! sleep, wake, reload the weights from the checkpoint the servers started
//! with, resume. `trainer_sequence_{p,both}` are the calls an RL trainer
//! makes: `/pause?mode=keep`, `/sleep?level=1` without a mode (it keeps the
//! pause's mode), `/wake_up` (the explicit pause stays), `/resume`.
//!
//! Moments a case needs are arranged, not waited for by luck:
//! - `p_sleeps_while_d_pulls` sleeps P only while a transfer waits at P, and
//!   fails if none ever does. Write mode: P is paused (`keep`) first, so D's
//!   pulls park at P (P's `pdkv_kv_pulls_pending` >= 1, and it stays so while
//!   P computes nothing); read mode: D is paused (`keep`) first and a
//!   prompt is computed at P for a D that does not read it, so P holds its
//!   blocks (`pdkv_kv_send_held_blocks` >= 1); D asks for it after the wake
//!   and computes it itself.
//! - `reset_prefix_cache_{p,d}` must answer `true` idle and `false` while a
//!   transfer holds blocks, which the case holds on purpose under load: on
//!   P a `do_remote_decode` request whose transfer no D has pulled yet
//!   (READY for its lease), on D a load whose first control exchange goes to
//!   a listener of this command that never answers (in flight, holding its
//!   blocks, for the connector's 5 s control bound). Both are released
//!   right after the reset (a D request loads P's transfer; D's request is
//!   aborted), and once the load stopped the reset answers `true` again.
//!
//! Invariants: every wait is bounded; every child is killed and reaped when
//! the run ends, fails or is interrupted (and gets SIGTERM from the kernel
//! if this process dies, through `PR_SET_PDEATHSIG`).

use std::collections::{BTreeMap, HashMap, HashSet};
use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::{anyhow, bail, Context};
use clap::Args;
use pdkv_deploy::{
    EngineWiring, FailurePolicy, LogSink, Logs, Ports, Proc, Spec, Started, TransferMode, Transport,
};
use serde_json::{json, Value};

use crate::fetch;
use crate::proxy_cmd::wait_for_signal;

/// Bound on one load or probe request (connection to the end of its body).
const REQUEST_DEADLINE: Duration = Duration::from_secs(120);
/// Bound on waiting for P and D to become quiescent after the load stopped.
const QUIESCE_DEADLINE: Duration = Duration::from_secs(90);
/// Bound on waiting for the load to make progress (warm-up, after restore).
const PROGRESS_DEADLINE: Duration = Duration::from_secs(90);
/// How long a worker waits after a 503 before its next request.
const RETRY_BACKOFF: Duration = Duration::from_millis(100);
/// Interval of metric and health polls.
const POLL: Duration = Duration::from_millis(20);
/// Most device bytes a sleeping engine may keep, as a fraction of awake.
const ASLEEP_MAX_FRACTION: f64 = 0.02;
const MIB: f64 = 1024.0 * 1024.0;

#[derive(Args, Debug)]
pub struct LifecycleArgs {
    /// A `.gguf` file or a checkpoint directory (default: SmolLM2-135M-Instruct
    /// from the model cache, fetched if missing).
    #[arg(long)]
    pub model: Option<PathBuf>,
    /// How KV moves from P to D.
    #[arg(long, value_enum, default_value = "tcp")]
    pub transport: Transport,
    /// Who moves the bytes: P writes into D's blocks, or D reads P's.
    #[arg(long, value_enum, default_value = "write")]
    pub transfer_mode: TransferMode,
    /// D's policy for a KV load that failed (a load that P ended on purpose
    /// recomputes under either).
    #[arg(long, value_enum, default_value = "fail")]
    pub kv_load_failure_policy: FailurePolicy,
    /// P's bound on holding KV for a pull and answering it, in seconds
    /// (the connector's `abort_timeout_s`; default: the connector's).
    #[arg(long)]
    pub kv_abort_timeout_s: Option<f64>,
    /// `all`, or case names separated by commas (`--list` shows them).
    #[arg(long, default_value = "all")]
    pub cases: String,
    /// Times each case runs.
    #[arg(long, default_value_t = 1)]
    pub cycles: usize,
    /// Load workers, each looping one request at a time.
    #[arg(long, default_value_t = 8)]
    pub load_concurrency: usize,
    /// Every N-th load request leaves after its first event (0: never).
    #[arg(long, default_value_t = 4)]
    pub disconnect_every: usize,
    /// Greedy probe prompts compared with the baseline after every case.
    #[arg(long, default_value_t = 30)]
    pub probes: usize,
    /// Tokens each probe generates.
    #[arg(long, default_value_t = 8)]
    pub probe_tokens: u32,
    /// KV cache size of P and D, in blocks of 16 tokens.
    #[arg(long, default_value_t = 256)]
    pub num_kv_blocks: usize,
    /// Ranks P splits the model over (tensor parallelism).
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u16).range(1..=64))]
    pub prefill_tensor_parallel_size: u16,
    /// Ranks D splits the model over.
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u16).range(1..=64))]
    pub decode_tensor_parallel_size: u16,
    /// How long a pause or sleep is held under load, in milliseconds.
    #[arg(long, default_value_t = 300)]
    pub hold_ms: u64,
    /// Bound on each admin call, in seconds.
    #[arg(long, default_value_t = 120)]
    pub op_timeout: u64,
    /// Bound on the start-up (model loading included), in seconds.
    #[arg(long, default_value_t = 300)]
    pub startup_timeout: u64,
    /// Forward the children's logs to stderr.
    #[arg(long)]
    pub show_logs: bool,
    /// Print the case names and exit.
    #[arg(long)]
    pub list: bool,
}

// ---------------------------------------------------------------------------
// Cases

/// Which engine(s) a case operates on.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Target {
    P,
    D,
    Both,
}

impl Target {
    fn suffix(self) -> &'static str {
        match self {
            Target::P => "p",
            Target::D => "d",
            Target::Both => "both",
        }
    }

    fn has(self, role: Role) -> bool {
        matches!(
            (self, role),
            (Target::Both, _) | (Target::P, Role::P) | (Target::D, Role::D)
        )
    }
}

/// The lifecycle operation a case drives.
#[derive(Clone, Copy, Debug)]
enum Op {
    /// `/pause?mode=..&clear_cache=..`, hold, `/resume`.
    Pause { mode: &'static str, clear: bool },
    /// `/sleep?level=..&mode=keep`, hold, `/wake_up` (level 2: inside an
    /// explicit keep pause, with a weight reload before `/resume`).
    Sleep { level: u32 },
    /// Level-1 sleep of D, then `/wake_up` for one tag and the other.
    SelectiveWake { weights_first: bool },
    /// `/abort_requests` on D with ids of load requests in flight.
    AbortRequests,
    /// `/reset_prefix_cache?reset_running_requests=true`, idle then under load.
    ResetPrefixCache,
    /// Pause (keep), `/release_kv_cache_memory`, `/resume`.
    ReleaseKv,
    /// Pause (keep), `/update_weights` with the same checkpoint, `/resume`.
    WeightReload,
    /// Level-1 sleep (keep) of P while a transfer waits at P (see the
    /// module docs), then wake.
    PSleepsWhileDPulls,
    /// The RL trainer's calls: `/pause?mode=keep`, `/sleep?level=1` (no
    /// mode), `/wake_up`, `/resume`.
    TrainerSequence,
}

#[derive(Clone, Debug)]
struct Case {
    name: String,
    op: Op,
    target: Target,
}

impl Case {
    fn new(name: impl Into<String>, op: Op, target: Target) -> Case {
        Case {
            name: name.into(),
            op,
            target,
        }
    }

    /// Whether any load request may end with finish reason `abort`: D
    /// aborts its requests. (P's aborted requests never reach a client: D
    /// computes their prompts.)
    fn aborts_all(&self) -> bool {
        matches!(self.op, Op::Pause { mode: "abort", .. }) && self.target.has(Role::D)
    }

    /// The engines whose memory must drop to at most 2% while asleep.
    fn sleeping(&self) -> Option<Target> {
        match self.op {
            Op::Sleep { level } if level >= 1 => Some(self.target),
            Op::SelectiveWake { .. } => Some(Target::D),
            Op::PSleepsWhileDPulls => Some(Target::P),
            Op::TrainerSequence => Some(self.target),
            _ => None,
        }
    }
}

/// Every case, in a stable order.
fn all_cases() -> Vec<Case> {
    let targets = [Target::P, Target::D, Target::Both];
    let mut v = Vec::new();
    for mode in ["abort", "wait", "keep"] {
        for clear in [false, true] {
            for t in targets {
                let name = format!(
                    "pause_{mode}{}_{}",
                    if clear { "_clear" } else { "" },
                    t.suffix()
                );
                v.push(Case::new(name, Op::Pause { mode, clear }, t));
            }
        }
    }
    for level in [0, 1, 2] {
        for t in targets {
            v.push(Case::new(
                format!("sleep_l{level}_{}", t.suffix()),
                Op::Sleep { level },
                t,
            ));
        }
    }
    v.push(Case::new(
        "wake_weights_first_d",
        Op::SelectiveWake {
            weights_first: true,
        },
        Target::D,
    ));
    v.push(Case::new(
        "wake_kv_first_d",
        Op::SelectiveWake {
            weights_first: false,
        },
        Target::D,
    ));
    v.push(Case::new("abort_requests", Op::AbortRequests, Target::D));
    for t in [Target::P, Target::D] {
        v.push(Case::new(
            format!("reset_prefix_cache_{}", t.suffix()),
            Op::ResetPrefixCache,
            t,
        ));
    }
    for t in targets {
        v.push(Case::new(
            format!("release_kv_cache_memory_{}", t.suffix()),
            Op::ReleaseKv,
            t,
        ));
    }
    for t in [Target::P, Target::D] {
        v.push(Case::new(
            format!("weight_reload_{}", t.suffix()),
            Op::WeightReload,
            t,
        ));
    }
    v.push(Case::new(
        "p_sleeps_while_d_pulls",
        Op::PSleepsWhileDPulls,
        Target::P,
    ));
    for t in [Target::P, Target::Both] {
        v.push(Case::new(
            format!("trainer_sequence_{}", t.suffix()),
            Op::TrainerSequence,
            t,
        ));
    }
    v
}

/// The cases `spec` names (`all`, or names separated by commas).
fn select_cases(spec: &str) -> anyhow::Result<Vec<Case>> {
    let all = all_cases();
    if spec.trim() == "all" {
        return Ok(all);
    }
    let mut out = Vec::new();
    for name in spec.split(',').map(str::trim).filter(|s| !s.is_empty()) {
        let case = all.iter().find(|c| c.name == name).ok_or_else(|| {
            anyhow!("unknown case `{name}` (`pdkv lifecycle --list` shows the cases)")
        })?;
        out.push(case.clone());
    }
    anyhow::ensure!(!out.is_empty(), "--cases names no case");
    Ok(out)
}

// ---------------------------------------------------------------------------
// Child processes

/// P, D and the proxy (`pdkv_deploy`'s children); stopped on drop.
struct Deployment {
    procs: Vec<Proc>,
}

impl Drop for Deployment {
    fn drop(&mut self) {
        pdkv_deploy::stop_all_blocking(&mut self.procs, "pdkv lifecycle");
    }
}

impl Deployment {
    /// Fails when a child has exited, with its last log lines.
    fn check_alive(&mut self) -> anyhow::Result<()> {
        Ok(pdkv_deploy::check_children(&mut self.procs)?)
    }
}

/// Starts P, D (sleep mode, the admin API with `token`) and the proxy into
/// `dep`, every child on a port of its choosing, as `pdkv up` does.
async fn deploy(
    args: &LifecycleArgs,
    model: &Path,
    token: &str,
    dep: &mut Deployment,
) -> anyhow::Result<Started> {
    let mut wiring = EngineWiring::new(args.transport, args.transfer_mode);
    wiring.kv_load_failure_policy = Some(args.kv_load_failure_policy);
    wiring.abort_timeout_s = args.kv_abort_timeout_s;
    wiring.num_kv_blocks = Some(args.num_kv_blocks);
    wiring.prefill_tensor_parallel_size = Some(args.prefill_tensor_parallel_size);
    wiring.decode_tensor_parallel_size = Some(args.decode_tensor_parallel_size);
    wiring.sleep_mode = true;
    let spec = Spec {
        exe: std::env::current_exe().context("finding the pdkv executable")?,
        model: model.to_path_buf(),
        wiring,
        ports: Ports::any(1, 1),
        startup_timeout: Duration::from_secs(args.startup_timeout),
        admin_token: Some(token.to_string()),
        kv_secret: None,
        api_key: None,
        engine_id_prefix: "lc".to_string(),
        proxy_health_interval_ms: Some(200),
    };
    let logs = Logs {
        who: "pdkv lifecycle",
        sink: if args.show_logs {
            LogSink::Stderr
        } else {
            LogSink::Discard
        },
    };
    let started = pdkv_deploy::start(&spec, &mut dep.procs, &logs).await?;
    eprintln!(
        "pdkv lifecycle: ready (prefill {}, decode {}, proxy {})",
        started.prefill[0], started.decode[0], started.proxy
    );
    Ok(started)
}

// ---------------------------------------------------------------------------
// HTTP: admin calls, metrics, completions

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
enum Role {
    P,
    D,
}

impl Role {
    fn name(self) -> &'static str {
        match self {
            Role::P => "P",
            Role::D => "D",
        }
    }
}

/// Everything a case needs to reach P, D and the proxy.
#[derive(Clone)]
struct Cluster {
    client: reqwest::Client,
    token: Arc<str>,
    p: Arc<str>,
    d: Arc<str>,
    proxy: Arc<str>,
    op_timeout: Duration,
    model: Arc<Path>,
}

impl Cluster {
    fn base(&self, role: Role) -> &str {
        match role {
            Role::P => &self.p,
            Role::D => &self.d,
        }
    }

    /// An admin call that must answer 200; returns its JSON body, or why not.
    async fn admin(
        &self,
        role: Role,
        post: bool,
        path: &str,
        body: Option<Value>,
    ) -> Result<Value, String> {
        let url = format!("{}{path}", self.base(role));
        let req = if post {
            self.client.post(&url)
        } else {
            self.client.get(&url)
        };
        let mut req = req.bearer_auth(&*self.token).timeout(self.op_timeout);
        if let Some(b) = body {
            req = req.json(&b);
        }
        let what = format!(
            "{} {} {path}",
            role.name(),
            if post { "POST" } else { "GET" }
        );
        let resp = req.send().await.map_err(|e| format!("{what}: {e}"))?;
        let status = resp.status();
        let text = resp
            .text()
            .await
            .map_err(|e| format!("{what}: reading the body: {e}"))?;
        if status != reqwest::StatusCode::OK {
            return Err(format!("{what} answered {status}: {}", text.trim()));
        }
        serde_json::from_str(&text).map_err(|e| format!("{what}: not JSON ({e}): {text}"))
    }

    /// An admin call on every engine of `target`, concurrently; the first error.
    async fn on_all(
        &self,
        target: Target,
        post: bool,
        path: &str,
        body: Option<Value>,
    ) -> Result<(), String> {
        let mut tasks = Vec::new();
        for role in [Role::P, Role::D] {
            if target.has(role) {
                let (c, path, body) = (self.clone(), path.to_string(), body.clone());
                tasks.push(tokio::spawn(async move {
                    c.admin(role, post, &path, body).await
                }));
            }
        }
        let mut first = Ok(());
        for t in tasks {
            let r = t
                .await
                .map_err(|e| format!("admin task: {e}"))
                .and_then(|r| r);
            if let (Err(e), true) = (r, first.is_ok()) {
                first = Err(e);
            }
        }
        first
    }

    /// `GET /is_paused` and `/is_sleeping` on `role` must both say false.
    async fn check_serving(&self, role: Role) -> Result<(), String> {
        let paused = self.admin(role, false, "/is_paused", None).await?;
        let sleeping = self.admin(role, false, "/is_sleeping", None).await?;
        if paused["is_paused"] != json!(false) || sleeping["is_sleeping"] != json!(false) {
            return Err(format!(
                "{} is not serving after the restore: {paused} {sleeping}",
                role.name()
            ));
        }
        Ok(())
    }

    async fn metrics(&self, role: Role) -> anyhow::Result<String> {
        let url = format!("{}/metrics", self.base(role));
        let resp = self
            .client
            .get(&url)
            .timeout(Duration::from_secs(10))
            .send()
            .await
            .with_context(|| url.clone())?;
        anyhow::ensure!(
            resp.status().is_success(),
            "{url} answered {}",
            resp.status()
        );
        resp.text().await.with_context(|| url.clone())
    }

    async fn device_bytes(&self, role: Role) -> anyhow::Result<u64> {
        let text = self.metrics(role).await?;
        let v = metric_sum(&text, "pdkv_device_memory_bytes")
            .ok_or_else(|| anyhow!("{} exports no pdkv_device_memory_bytes", role.name()))?;
        Ok(v as u64)
    }

    /// `role`'s device bytes rank by rank (every tag summed).
    async fn rank_bytes(&self, role: Role) -> anyhow::Result<Vec<u64>> {
        let text = self.metrics(role).await?;
        let v = rank_sums(&text, "pdkv_rank_device_memory_bytes");
        anyhow::ensure!(
            !v.is_empty(),
            "{} exports no pdkv_rank_device_memory_bytes",
            role.name()
        );
        Ok(v)
    }

    /// The unlabelled metric `name` of `role` now.
    async fn gauge(&self, role: Role, name: &str) -> Result<f64, String> {
        let text = self.metrics(role).await.map_err(|e| format!("{e:#}"))?;
        metric(&text, name).ok_or_else(|| format!("{} exports no {name}", role.name()))
    }

    /// Waits (polling, until `deadline`) until `role`'s metric `name` is at
    /// least `min`; its value then, or why not.
    async fn wait_gauge(
        &self,
        role: Role,
        name: &str,
        min: f64,
        deadline: Instant,
    ) -> Result<f64, String> {
        loop {
            let v = self.gauge(role, name).await?;
            if v >= min {
                return Ok(v);
            }
            if Instant::now() >= deadline {
                return Err(format!(
                    "{} {name} stayed {v} (at least {min} needed)",
                    role.name()
                ));
            }
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    }

    /// A completion sent straight to `role` (not through the proxy) as
    /// request `id`; its JSON body when it answered 200.
    async fn completion(&self, role: Role, body: Value, id: &str) -> Result<Value, String> {
        let url = format!("{}/v1/completions", self.base(role));
        let what = format!("{} POST /v1/completions ({id})", role.name());
        let resp = self
            .client
            .post(&url)
            .header("x-request-id", id)
            .json(&body)
            .timeout(REQUEST_DEADLINE)
            .send()
            .await
            .map_err(|e| format!("{what}: {e}"))?;
        let status = resp.status();
        let text = resp
            .text()
            .await
            .map_err(|e| format!("{what}: reading the body: {e}"))?;
        if status != reqwest::StatusCode::OK {
            return Err(format!("{what} answered {status}: {}", text.trim()));
        }
        serde_json::from_str(&text).map_err(|e| format!("{what}: not JSON ({e}): {text}"))
    }

    /// `POST /reset_prefix_cache?reset_running_requests=true` on `role`
    /// must answer `success: want`.
    async fn expect_reset(&self, role: Role, want: bool, when: &str) -> Result<(), String> {
        let v = self
            .admin(
                role,
                true,
                "/reset_prefix_cache?reset_running_requests=true",
                None,
            )
            .await?;
        if v["success"] != json!(want) {
            return Err(format!(
                "{} /reset_prefix_cache {when} answered {v} (expected success {want})",
                role.name()
            ));
        }
        Ok(())
    }

    /// Waits until `role` is idle with every KV block free. Returns what
    /// was still busy a few seconds in, if it took that long.
    async fn wait_quiescent(&self, role: Role) -> Result<Option<String>, String> {
        let started = Instant::now();
        let mut slow = None;
        loop {
            let text = self.metrics(role).await.map_err(|e| format!("{e:#}"))?;
            if quiescent(&text) {
                return Ok(slow);
            }
            let waited = started.elapsed();
            if waited >= QUIESCE_DEADLINE {
                return Err(format!(
                    "{} not quiescent after {}s: {}",
                    role.name(),
                    waited.as_secs(),
                    busy(&text)
                ));
            }
            if slow.is_none() && waited.as_secs_f64() > PhaseClock::SLOW {
                slow = Some(format!(
                    "{} busy after {:.0}s: {}",
                    role.name(),
                    PhaseClock::SLOW,
                    busy(&text)
                ));
            }
            tokio::time::sleep(POLL).await;
        }
    }
}

/// One unlabelled sample of a Prometheus exposition.
fn metric(text: &str, name: &str) -> Option<f64> {
    text.lines()
        .filter(|l| !l.starts_with('#'))
        .find_map(|l| l.strip_prefix(name).and_then(|r| r.strip_prefix(' ')))
        .and_then(|v| v.trim().parse().ok())
}

/// The sum of the samples of `name` per value of its `rank` label, by rank.
fn rank_sums(text: &str, name: &str) -> Vec<u64> {
    let mut by_rank: BTreeMap<usize, f64> = BTreeMap::new();
    for l in text.lines().filter(|l| !l.starts_with('#')) {
        let Some(rest) = l.strip_prefix(name).and_then(|r| r.strip_prefix('{')) else {
            continue;
        };
        let Some((labels, v)) = rest.rsplit_once(' ') else {
            continue;
        };
        let rank = labels
            .split(',')
            .find_map(|kv| kv.strip_prefix("rank=\""))
            .and_then(|r| r.split('"').next())
            .and_then(|r| r.parse().ok());
        if let (Some(rank), Ok(v)) = (rank, v.trim().parse::<f64>()) {
            *by_rank.entry(rank).or_default() += v;
        }
    }
    by_rank.values().map(|&v| v as u64).collect()
}

/// The sum of every labelled sample of `name`.
fn metric_sum(text: &str, name: &str) -> Option<f64> {
    let samples: Vec<f64> = text
        .lines()
        .filter(|l| !l.starts_with('#'))
        .filter_map(|l| l.strip_prefix(name).and_then(|r| r.strip_prefix('{')))
        .filter_map(|r| r.rsplit_once(' ').and_then(|(_, v)| v.trim().parse().ok()))
        .collect();
    (!samples.is_empty()).then(|| samples.iter().sum())
}

/// The gauges that say why an engine is not quiescent.
fn busy(text: &str) -> String {
    let show = |n: &str| metric(text, n).map_or("-".to_string(), |v| v.to_string());
    format!(
        "running {}, waiting {}, waiting for remote KV {}, held {}, free {}/{}, send held {}, pulls pending {}",
        show("pdkv_num_requests_running"),
        show("pdkv_num_requests_waiting"),
        show("pdkv_num_requests_waiting_for_remote_kv"),
        show("pdkv_kv_blocks_held"),
        show("pdkv_kv_blocks_free"),
        show("pdkv_kv_blocks_total"),
        show("pdkv_kv_send_held_blocks"),
        show("pdkv_kv_pulls_pending"),
    )
}

/// Idle, with every KV block free (none held for transfers).
fn quiescent(text: &str) -> bool {
    metric(text, "pdkv_num_requests_running") == Some(0.0)
        && metric(text, "pdkv_num_requests_waiting") == Some(0.0)
        && metric(text, "pdkv_kv_blocks_held") == Some(0.0)
        && metric(text, "pdkv_kv_blocks_free").is_some()
        && metric(text, "pdkv_kv_blocks_free") == metric(text, "pdkv_kv_blocks_total")
}

/// How one completion request ended, as the client saw it.
#[derive(Debug, Default)]
struct Reply {
    status: u16,
    retry_after: bool,
    text: String,
    finish: Option<String>,
    /// The error object of an error body or an SSE error event.
    error: Option<Value>,
    /// The answer was an event stream.
    streamed: bool,
    /// Streams: `[DONE]` arrived.
    done: bool,
    /// The client left after the first event, as asked.
    disconnected: bool,
    /// No usable answer (transport error, malformed body), with why.
    broken: Option<String>,
}

/// Posts a completion; with `leave_early`, a stream is dropped after its
/// first event.
async fn complete(
    client: &reqwest::Client,
    url: &str,
    body: &Value,
    id: Option<&str>,
    leave_early: bool,
) -> Reply {
    let mut req = client.post(url).json(body).timeout(REQUEST_DEADLINE);
    if let Some(id) = id {
        req = req.header("x-request-id", id);
    }
    let mut resp = match req.send().await {
        Ok(r) => r,
        Err(e) => {
            return Reply {
                broken: Some(format!("sending: {e}")),
                ..Reply::default()
            }
        }
    };
    let mut reply = Reply {
        status: resp.status().as_u16(),
        retry_after: resp.headers().contains_key(reqwest::header::RETRY_AFTER),
        ..Reply::default()
    };
    let streaming = body["stream"].as_bool() == Some(true);
    if reply.status != 200 || !streaming {
        let text = match resp.text().await {
            Ok(t) => t,
            Err(e) => {
                reply.broken = Some(format!("reading the body: {e}"));
                return reply;
            }
        };
        match serde_json::from_str::<Value>(&text) {
            Ok(v) if v.get("error").is_some() => reply.error = Some(v["error"].clone()),
            Ok(v) => {
                reply.text = v["choices"][0]["text"]
                    .as_str()
                    .unwrap_or_default()
                    .to_string();
                reply.finish = v["choices"][0]["finish_reason"]
                    .as_str()
                    .map(str::to_string);
            }
            Err(_) => reply.broken = Some(format!("a body that is not JSON: {}", text.trim())),
        }
        return reply;
    }
    reply.streamed = true;
    let mut buf = String::new();
    loop {
        let chunk = match resp.chunk().await {
            Ok(Some(c)) => c,
            Ok(None) => break,
            Err(e) => {
                reply.broken = Some(format!("the stream broke: {e}"));
                return reply;
            }
        };
        buf.push_str(&String::from_utf8_lossy(&chunk));
        while let Some(end) = buf.find("\n\n") {
            let event: String = buf.drain(..end + 2).collect();
            let Some(data) = event.trim_end().strip_prefix("data: ") else {
                reply.broken = Some(format!("a malformed event {event:?}"));
                return reply;
            };
            if data == "[DONE]" {
                reply.done = true;
                continue;
            }
            let v: Value = match serde_json::from_str(data) {
                Ok(v) => v,
                Err(e) => {
                    reply.broken = Some(format!("an event that is not JSON ({e}): {data}"));
                    return reply;
                }
            };
            if let Some(err) = v.get("error") {
                reply.error = Some(err.clone());
                continue;
            }
            if let Some(choice) = v["choices"].get(0) {
                reply
                    .text
                    .push_str(choice["text"].as_str().unwrap_or_default());
                if let Some(f) = choice["finish_reason"].as_str() {
                    reply.finish = Some(f.to_string());
                }
            }
            if leave_early {
                reply.disconnected = true;
                return reply;
            }
        }
    }
    if !buf.trim().is_empty() {
        reply.broken = Some(format!("the stream ended inside an event: {buf:?}"));
    }
    reply
}

/// A control listener that accepts connections and never answers: a D load
/// whose first control exchange (bootstrap or handshake) goes here stays in
/// flight, holding its blocks, until the connector's bound on that exchange.
/// Stops (closing what it holds) on drop.
struct Unanswering {
    addr: std::net::SocketAddr,
    accepted: tokio::sync::watch::Receiver<usize>,
    task: tokio::task::JoinHandle<()>,
}

impl Unanswering {
    /// Connections held at most; later ones are closed at once.
    const MAX_HELD: usize = 16;

    async fn bind() -> anyhow::Result<Unanswering> {
        let listener = tokio::net::TcpListener::bind((pdkv_deploy::HOST, 0))
            .await
            .context("binding an unanswering listener")?;
        let addr = listener.local_addr()?;
        let (tx, accepted) = tokio::sync::watch::channel(0);
        let task = tokio::spawn(async move {
            let mut held = Vec::new();
            while let Ok((stream, _)) = listener.accept().await {
                if held.len() < Self::MAX_HELD {
                    held.push(stream);
                }
                tx.send_modify(|n| *n += 1);
            }
        });
        Ok(Unanswering {
            addr,
            accepted,
            task,
        })
    }

    /// Waits (until `deadline`) for a first connection.
    async fn wait_accepted(&mut self, deadline: Instant) -> bool {
        let wait = self.accepted.wait_for(|n| *n >= 1);
        matches!(
            tokio::time::timeout_at(tokio::time::Instant::from_std(deadline), wait).await,
            Ok(Ok(_))
        )
    }
}

impl Drop for Unanswering {
    fn drop(&mut self) {
        self.task.abort();
    }
}

// ---------------------------------------------------------------------------
// Probes

const PREFIXES: [&str; 6] = [
    "The library opens at nine and closes at five on weekdays, and on Saturdays it opens at ten.",
    "The river flows through the old town, passes under seven bridges and reaches the sea at the docks.",
    "To bake bread you need flour, water, salt and yeast, then patience while the dough rises twice.",
    "The server rack in room four has twelve machines, two switches and a backup battery unit.",
    "A young fox lived at the edge of a forest and every morning watched the farmer feed his hens.",
    "The train left the station at noon, crossed the valley and climbed slowly towards the mountains.",
];

const QUESTIONS: [&str; 5] = [
    " Question: what is this about? Answer:",
    " In five words:",
    " The key detail is",
    " Next,",
    " A title for it:",
];

/// `n` distinct prompts, groups of which share a prefix.
fn probe_prompts(n: usize) -> Vec<String> {
    let per_round = PREFIXES.len() * QUESTIONS.len();
    (0..n)
        .map(|i| {
            let p = PREFIXES[i % PREFIXES.len()];
            let q = QUESTIONS[(i / PREFIXES.len()) % QUESTIONS.len()];
            match i / per_round {
                0 => format!("{p}{q}"),
                round => format!("{p} (variant {round}){q}"),
            }
        })
        .collect()
}

/// Runs the probe set through the proxy, 8 at a time, odd ones streamed;
/// the texts in order, or why a probe gave none.
async fn run_probes(c: &Cluster, prompts: &[String], tokens: u32) -> Vec<Result<String, String>> {
    let url = format!("{}/v1/completions", c.proxy);
    let mut out: Vec<Result<String, String>> = Vec::with_capacity(prompts.len());
    for batch in prompts.chunks(8).enumerate() {
        let (b, chunk) = batch;
        let mut tasks = Vec::new();
        for (j, prompt) in chunk.iter().enumerate() {
            let i = b * 8 + j;
            let body = json!({"prompt": prompt, "max_tokens": tokens, "temperature": 0, "ignore_eos": true, "stream": i % 2 == 1});
            let (client, url) = (c.client.clone(), url.clone());
            tasks.push(tokio::spawn(async move {
                complete(&client, &url, &body, None, false).await
            }));
        }
        for t in tasks {
            let r = match t.await {
                Err(e) => Err(format!("probe task: {e}")),
                Ok(r) if r.status == 200 && r.broken.is_none() && r.error.is_none() => {
                    match r.finish.as_deref() {
                        Some("length" | "stop") => Ok(r.text),
                        other => Err(format!("finished with {other:?}")),
                    }
                }
                Ok(r) => Err(format!("status {} {:?} {:?}", r.status, r.broken, r.error)),
            };
            out.push(r);
        }
    }
    out
}

// ---------------------------------------------------------------------------
// Load

/// A load request's outcome as it ended, before the case classifies it.
#[derive(Debug)]
enum RawOutcome {
    Complete,
    Retryable,
    /// Finish reason `abort` (D aborted the request).
    Aborted,
    Disconnected,
    /// A 503 without `Retry-After`: lost (a client cannot tell that it
    /// clears by itself), counted apart.
    Bare503(String),
    Lost(String),
}

/// The background load's shared state.
struct Load {
    stop: AtomicBool,
    next: AtomicU64,
    completed: AtomicU64,
    inflight: Mutex<HashSet<String>>,
    outcomes: Mutex<Vec<(String, RawOutcome)>>,
    run_id: u32,
    cycle_tag: String,
    disconnect_every: usize,
    url: String,
    client: reqwest::Client,
}

/// The load's request `i`: varied prompt length, output length and shape.
fn load_body(i: u64, disconnect_every: usize) -> (Value, bool) {
    let leave = disconnect_every > 0 && i % disconnect_every as u64 == disconnect_every as u64 - 1;
    let stream = leave || i % 2 == 1;
    let repeat = 1 + (i % 4) as usize;
    let prompt = format!(
        "{} Request {i}:{}",
        PREFIXES[(i as usize / 3) % PREFIXES.len()].repeat(repeat),
        QUESTIONS[i as usize % QUESTIONS.len()]
    );
    let max_tokens = [4, 12, 24, 8, 16][(i % 5) as usize];
    (
        json!({"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": true, "stream": stream}),
        leave,
    )
}

fn raw_outcome(r: Reply) -> RawOutcome {
    if r.disconnected {
        return RawOutcome::Disconnected;
    }
    if let Some(why) = r.broken {
        return RawOutcome::Lost(format!("status {}: {why}", r.status));
    }
    if r.status == 503 {
        return if r.retry_after {
            RawOutcome::Retryable
        } else {
            RawOutcome::Bare503(format!(
                "503 without Retry-After: {}",
                r.error.unwrap_or_default()
            ))
        };
    }
    if r.status != 200 {
        return RawOutcome::Lost(format!(
            "status {}: {}",
            r.status,
            r.error.unwrap_or_default()
        ));
    }
    // The proxy's own errors (`upstream_error`, `upstream_timeout`, an error
    // event ending a stream D broke) are all failures.
    if let Some(err) = r.error {
        return RawOutcome::Lost(format!("an error in the body: {err}"));
    }
    if r.streamed && !r.done {
        return RawOutcome::Lost(format!(
            "the stream ended without [DONE] (finish {:?})",
            r.finish
        ));
    }
    match r.finish.as_deref() {
        Some("stop" | "length") => RawOutcome::Complete,
        Some("abort") => RawOutcome::Aborted,
        other => RawOutcome::Lost(format!("finished with {other:?}")),
    }
}

async fn load_worker(load: Arc<Load>) {
    while !load.stop.load(Ordering::Acquire) {
        let i = load.next.fetch_add(1, Ordering::Relaxed);
        let id = format!("lc-{}-{}-{i}", load.run_id, load.cycle_tag);
        let (body, leave) = load_body(i, load.disconnect_every);
        load.inflight
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .insert(id.clone());
        let reply = tokio::time::timeout(
            REQUEST_DEADLINE,
            complete(&load.client, &load.url, &body, Some(&id), leave),
        )
        .await;
        load.inflight
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .remove(&id);
        let mut outcome = match reply {
            Ok(r) => raw_outcome(r),
            Err(_) => RawOutcome::Lost(format!("no answer within {}s", REQUEST_DEADLINE.as_secs())),
        };
        // Anything but a finished request waits a little before the next
        // one, so a refusing engine is not flooded.
        let backoff = !matches!(outcome, RawOutcome::Complete | RawOutcome::Disconnected);
        if let RawOutcome::Complete = outcome {
            load.completed.fetch_add(1, Ordering::Relaxed);
        }
        if let RawOutcome::Lost(why) | RawOutcome::Bare503(why) = &mut outcome {
            *why = format!("{id}: {why}");
        }
        load.outcomes
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .push((id, outcome));
        if backoff {
            tokio::time::sleep(RETRY_BACKOFF).await;
        }
    }
}

/// Counts of the load's outcomes in one case.
#[derive(Debug, Default)]
struct LoadCounts {
    sent: usize,
    complete: usize,
    retryable: usize,
    aborted: usize,
    disconnected: usize,
    /// Every lost request, with why.
    lost: Vec<String>,
    /// Of `lost`: 503s without `Retry-After`.
    bare_503: usize,
}

// ---------------------------------------------------------------------------
// Running the matrix

/// The result of one case run.
#[derive(Debug, Default)]
struct CaseResult {
    name: String,
    cycle: usize,
    reasons: Vec<String>,
    notes: Vec<String>,
    load: LoadCounts,
    /// Transfer counter deltas over the case (before the probes).
    t: Counters,
    p_awake: u64,
    d_awake: u64,
    p_asleep: Option<u64>,
    d_asleep: Option<u64>,
    probes_equal: usize,
    probes_run: usize,
    /// Seconds each phase took.
    phases: Vec<(&'static str, f64)>,
}

/// Times the phases of a case.
struct PhaseClock {
    last: Instant,
    laps: Vec<(&'static str, f64)>,
}

impl PhaseClock {
    /// A phase slower than this is named in the case's notes.
    const SLOW: f64 = 5.0;

    fn new() -> PhaseClock {
        PhaseClock {
            last: Instant::now(),
            laps: Vec::new(),
        }
    }

    fn lap(&mut self, name: &'static str) {
        let now = Instant::now();
        self.laps.push((name, (now - self.last).as_secs_f64()));
        self.last = now;
    }

    fn slow(&self) -> Vec<String> {
        self.laps
            .iter()
            .filter(|(_, s)| *s > Self::SLOW)
            .map(|(n, s)| format!("slow: {n} {s:.1}s"))
            .collect()
    }
}

impl CaseResult {
    fn passed(&self) -> bool {
        self.reasons.is_empty()
    }

    fn line(&self) -> String {
        let mib = |b: u64| format!("{:.1}", b as f64 / MIB);
        let asleep = |b: Option<u64>| b.map_or("-".to_string(), mib);
        let t = &self.t;
        let mut s = format!(
            "{} {} {}  transfers {}/{} ended on purpose P {} D {}  lost {}{}  P {}/{} MiB  D {}/{} MiB  probes {}/{}  load ok {} 503 {} abort {} disc {}",
            if self.passed() { "PASS" } else { "FAIL" },
            self.name,
            self.cycle,
            t.pulls_ok + t.loads_ok,
            t.pulls_failed + t.loads_failed,
            t.on_purpose().0,
            t.on_purpose().1,
            self.load.lost.len(),
            if self.load.bare_503 > 0 { format!(" ({} 503s without Retry-After)", self.load.bare_503) } else { String::new() },
            mib(self.p_awake),
            asleep(self.p_asleep),
            mib(self.d_awake),
            asleep(self.d_asleep),
            self.probes_equal,
            self.probes_run,
            self.load.complete,
            self.load.retryable,
            self.load.aborted,
            self.load.disconnected,
        );
        let extra: Vec<&String> = self.reasons.iter().chain(&self.notes).collect();
        if !extra.is_empty() {
            s.push_str("  [");
            s.push_str(
                &extra
                    .iter()
                    .map(|s| s.as_str())
                    .collect::<Vec<_>>()
                    .join("; "),
            );
            s.push(']');
        }
        s
    }

    fn json(&self) -> Value {
        json!({
            "name": self.name, "cycle": self.cycle, "pass": self.passed(),
            "reasons": self.reasons, "notes": self.notes,
            "transfers": {"pulls_ok": self.t.pulls_ok, "pulls_failed": self.t.pulls_failed,
                          "pulls_released": self.t.pulls_released, "pulls_cancelled": self.t.pulls_cancelled,
                          "loads_ok": self.t.loads_ok, "loads_failed": self.t.loads_failed,
                          "loads_released": self.t.loads_released, "loads_cut_short": self.t.loads_cut_short,
                          "loads_cancelled": self.t.loads_cancelled},
            "load": {"sent": self.load.sent, "complete": self.load.complete, "retry_503": self.load.retryable,
                     "aborted": self.load.aborted, "disconnected": self.load.disconnected,
                     "lost": self.load.lost.len(), "lost_503_without_retry_after": self.load.bare_503},
            "p_awake_bytes": self.p_awake, "p_asleep_bytes": self.p_asleep,
            "d_awake_bytes": self.d_awake, "d_asleep_bytes": self.d_asleep,
            "probes_equal": self.probes_equal, "probes_run": self.probes_run,
            "phase_s": self.phases.iter().map(|(n, s)| (n.to_string(), json!(s))).collect::<serde_json::Map<_, _>>(),
        })
    }
}

/// Transfer counters of P and D at one moment (or their change over a case).
#[derive(Clone, Copy, Debug, Default)]
struct Counters {
    /// P: pulls served, or (read mode) reads D confirmed.
    pulls_ok: f64,
    pulls_failed: f64,
    /// P: pulls refused because P ended the transfer on purpose.
    pulls_released: f64,
    /// P: pulls ended because D dropped the transfer.
    pulls_cancelled: f64,
    loads_ok: f64,
    loads_failed: f64,
    /// D: loads P ended on purpose (recomputed).
    loads_released: f64,
    /// D: loads its own cache reset ended (recomputed).
    loads_cut_short: f64,
    /// D: loads whose request ended first.
    loads_cancelled: f64,
}

impl Counters {
    fn minus(&self, b: &Counters) -> Counters {
        Counters {
            pulls_ok: self.pulls_ok - b.pulls_ok,
            pulls_failed: self.pulls_failed - b.pulls_failed,
            pulls_released: self.pulls_released - b.pulls_released,
            pulls_cancelled: self.pulls_cancelled - b.pulls_cancelled,
            loads_ok: self.loads_ok - b.loads_ok,
            loads_failed: self.loads_failed - b.loads_failed,
            loads_released: self.loads_released - b.loads_released,
            loads_cut_short: self.loads_cut_short - b.loads_cut_short,
            loads_cancelled: self.loads_cancelled - b.loads_cancelled,
        }
    }

    /// Transfers ended on purpose, as P and as D counted them (one transfer
    /// may count on both sides).
    fn on_purpose(&self) -> (f64, f64) {
        (
            self.pulls_released + self.pulls_cancelled,
            self.loads_released + self.loads_cut_short + self.loads_cancelled,
        )
    }

    /// The non-zero on-purpose counters, for a case's notes.
    fn on_purpose_note(&self) -> Option<String> {
        let parts: Vec<String> = [
            ("P pulls released", self.pulls_released),
            ("P pulls cancelled by D", self.pulls_cancelled),
            ("D loads released by P", self.loads_released),
            ("D loads cut short", self.loads_cut_short),
            ("D loads cancelled", self.loads_cancelled),
        ]
        .iter()
        .filter(|(_, v)| *v > 0.0)
        .map(|(n, v)| format!("{v} {n}"))
        .collect();
        (!parts.is_empty()).then(|| format!("ended on purpose: {}", parts.join(", ")))
    }
}

async fn counters(c: &Cluster) -> anyhow::Result<Counters> {
    let p = c.metrics(Role::P).await?;
    let d = c.metrics(Role::D).await?;
    let get = |t: &str, n: &str| metric(t, n).ok_or_else(|| anyhow!("no {n} in the metrics"));
    // In read mode P serves no pulls: D reads, then tells P it is done.
    let served =
        get(&p, "pdkv_kv_pulls_ok_total")? + metric(&p, "pdkv_kv_reads_done_total").unwrap_or(0.0);
    Ok(Counters {
        pulls_ok: served,
        pulls_failed: get(&p, "pdkv_kv_pulls_failed_total")?,
        pulls_released: get(&p, "pdkv_kv_pulls_released_total")?,
        pulls_cancelled: get(&p, "pdkv_kv_pulls_cancelled_total")?,
        loads_ok: get(&d, "pdkv_kv_loads_ok_total")?,
        loads_failed: get(&d, "pdkv_kv_loads_failed_total")?,
        loads_released: get(&d, "pdkv_kv_loads_released_total")?,
        loads_cut_short: get(&d, "pdkv_kv_loads_cut_short_total")?,
        loads_cancelled: get(&d, "pdkv_kv_loads_cancelled_total")?,
    })
}

/// What a case's operations observed.
#[derive(Default)]
struct OpReport {
    errors: Vec<String>,
    notes: Vec<String>,
    asleep: HashMap<Role, u64>,
    /// The same, rank by rank.
    asleep_ranks: HashMap<Role, Vec<u64>>,
    /// `abort_requests`: the ids D reported as aborted.
    aborted_ids: HashSet<String>,
}

impl OpReport {
    fn check(&mut self, r: Result<(), String>) {
        if let Err(e) = r {
            self.errors.push(e);
        }
    }
}

/// The baseline every case is compared with.
struct Baseline {
    prompts: Vec<String>,
    texts: Vec<String>,
    p_awake: u64,
    d_awake: u64,
    /// Each engine's awake device bytes rank by rank.
    p_ranks: Vec<u64>,
    d_ranks: Vec<u64>,
}

struct Runner<'a> {
    c: Cluster,
    args: &'a LifecycleArgs,
    base: Baseline,
    run_id: u32,
}

/// Waits until `load` completed `n` more requests than `from`, bounded.
async fn wait_progress(load: &Load, from: u64, n: u64) -> bool {
    let deadline = Instant::now() + PROGRESS_DEADLINE;
    while load.completed.load(Ordering::Relaxed) < from + n {
        if Instant::now() >= deadline {
            return false;
        }
        tokio::time::sleep(POLL).await;
    }
    true
}

impl Runner<'_> {
    fn hold(&self) -> Duration {
        Duration::from_millis(self.args.hold_ms)
    }

    async fn record_asleep(&self, rep: &mut OpReport, target: Target) {
        for role in [Role::P, Role::D] {
            if target.has(role) {
                match self.c.device_bytes(role).await {
                    Ok(b) => {
                        rep.asleep.insert(role, b);
                    }
                    Err(e) => rep.errors.push(format!("{e:#}")),
                }
                match self.c.rank_bytes(role).await {
                    Ok(b) => {
                        rep.asleep_ranks.insert(role, b);
                    }
                    Err(e) => rep.errors.push(format!("{e:#}")),
                }
            }
        }
    }

    /// Reloads the weights the servers started with on `target`. P and D
    /// must serve one weights version (a decode engine refuses KV computed
    /// with other weights, and recomputes): both get `fresh`, a single
    /// engine the version the other one serves (the checkpoint is the same).
    async fn reload(&self, target: Target, fresh: &str) -> Result<(), String> {
        let version = match target {
            Target::Both => json!(fresh),
            Target::P => {
                self.c.admin(Role::D, false, "/weight_info", None).await?["version"].clone()
            }
            Target::D => {
                self.c.admin(Role::P, false, "/weight_info", None).await?["version"].clone()
            }
        };
        let body = json!({"path": self.c.model.display().to_string(), "version": version});
        self.c
            .on_all(target, true, "/update_weights", Some(body))
            .await?;
        for role in [Role::P, Role::D] {
            if target.has(role) {
                let info = self.c.admin(role, false, "/weight_info", None).await?;
                if info["version"] != version {
                    return Err(format!(
                        "{} reports weights {info} after loading version {version}",
                        role.name()
                    ));
                }
            }
        }
        Ok(())
    }

    /// A prompt computed at P for a D (`do_remote_decode`) that no D has
    /// read yet: P holds its blocks READY until a D loads them or its lease
    /// ends. Returns the prompt, P's `kv_transfer_params` and the id for D's
    /// request.
    async fn hold_a_send_at_p(&self, tag: &str) -> Result<(String, Value, String), String> {
        let tid = format!("lc-held-{tag}");
        let prompt = format!("{} A transfer P sleeps under: {tid}.", PREFIXES[1]);
        let body = json!({"prompt": prompt, "max_tokens": 1, "temperature": 0, "stream": false,
                          "kv_transfer_params": pdkv_connector::params::for_prefill(&tid)});
        let out = self
            .c
            .completion(Role::P, body, &format!("{tid}-p"))
            .await?;
        let params = out
            .get("kv_transfer_params")
            .filter(|v| v.is_object())
            .cloned()
            .ok_or_else(|| format!("P returned no kv_transfer_params for {tid}: {out}"))?;
        Ok((prompt, params, format!("{tid}-d")))
    }

    /// `reset_prefix_cache_p` under load: P computes a prompt for a D
    /// (`do_remote_decode`) and holds its blocks READY, as no D pulled them
    /// yet; the reset must refuse. Then D loads them (which releases them).
    async fn reset_while_p_holds_a_send(&self, tag: &str) -> Result<String, String> {
        let c = &self.c;
        let tid = format!("lc-hold-{tag}");
        let prompt = format!("{} A transfer held on purpose: {tid}.", PREFIXES[1]);
        let body = json!({"prompt": prompt, "max_tokens": 1, "temperature": 0, "stream": false,
                          "kv_transfer_params": pdkv_connector::params::for_prefill(&tid)});
        let out = c.completion(Role::P, body, &format!("{tid}-p")).await?;
        let params = out
            .get("kv_transfer_params")
            .filter(|v| v.is_object())
            .cloned()
            .ok_or_else(|| format!("P returned no kv_transfer_params for {tid}: {out}"))?;
        let held = c.gauge(Role::P, "pdkv_kv_send_held_blocks").await;
        let reset = c
            .expect_reset(Role::P, false, "while a transfer holds blocks")
            .await;
        // Released whatever the reset said.
        let body = json!({"prompt": prompt, "max_tokens": 2, "temperature": 0, "ignore_eos": true, "stream": false,
                          "kv_transfer_params": params});
        let loaded = c.completion(Role::D, body, &format!("{tid}-d")).await;
        let held = held?;
        if held < 1.0 {
            return Err(format!("P held no blocks for {tid} ({held})"));
        }
        reset?;
        match loaded?["choices"][0]["finish_reason"].as_str() {
            Some("length") => Ok(format!(
                "under load: false while P held {held} blocks for a transfer, which D then loaded"
            )),
            other => Err(format!(
                "D's load of the held transfer {tid} finished with {other:?}"
            )),
        }
    }

    /// `reset_prefix_cache_d` under load: a D request whose first control
    /// exchange goes to a listener that never answers is a load in flight
    /// holding its blocks; the reset must refuse. Then the request is
    /// aborted (which ends the load).
    async fn reset_while_d_holds_a_load(&self, tag: &str) -> Result<String, String> {
        let c = &self.c;
        let mut fake = Unanswering::bind().await.map_err(|e| format!("{e:#}"))?;
        let tid = format!("lc-hold-{tag}");
        let mut params = pdkv_connector::params::for_decode(
            &tid,
            Some("lc-unanswering"),
            Some(&fake.addr.to_string()),
        );
        if let TransferMode::Read = self.args.transfer_mode {
            // Never checked: the handshake that would is never answered.
            params[pdkv_connector::params::REMOTE_BLOCK_IDS] = json!([0]);
            params[pdkv_connector::params::REMOTE_REGISTRATION_GENERATION] = json!(1);
        }
        let prompt = format!("{} A load held on purpose: {tid}.", PREFIXES[2]);
        let body = json!({"prompt": prompt, "max_tokens": 2, "temperature": 0, "stream": false,
                          "kv_transfer_params": params});
        let id = format!("{tid}-d");
        let request = {
            let (c, id) = (c.clone(), id.clone());
            tokio::spawn(async move { c.completion(Role::D, body, &id).await })
        };
        let reached = fake.wait_accepted(Instant::now() + PROGRESS_DEADLINE).await;
        let reset = c
            .expect_reset(Role::D, false, "while a load holds blocks")
            .await;
        let aborted = c
            .admin(
                Role::D,
                true,
                "/abort_requests",
                Some(json!({"request_ids": [id]})),
            )
            .await;
        let out = tokio::time::timeout(REQUEST_DEADLINE, request).await;
        if !reached {
            return Err("D's held load never reached the unanswering listener".into());
        }
        reset?;
        if aborted?["aborted"] != json!([id]) {
            return Err(format!("D did not abort the held request {id}"));
        }
        match out {
            Ok(Ok(Ok(v))) if v["choices"][0]["finish_reason"] == json!("abort") => Ok(
                "under load: false while a load was in flight, whose request was then aborted"
                    .into(),
            ),
            Ok(Ok(r)) => Err(format!(
                "the held request {id} ended with {r:?}, not aborted"
            )),
            Ok(Err(e)) => Err(format!("the held request's task: {e}")),
            Err(_) => Err(format!("the held request {id} did not end after its abort")),
        }
    }

    /// Runs the case's lifecycle operations (the load is running).
    async fn operate(&self, case: &Case, cycle: usize, load: &Load) -> OpReport {
        let mut rep = OpReport::default();
        let c = &self.c;
        let t = case.target;
        let timeout = self.args.op_timeout;
        match case.op {
            Op::Pause { mode, clear } => {
                rep.check(
                    c.on_all(
                        t,
                        true,
                        &format!("/pause?mode={mode}&clear_cache={clear}&timeout={timeout}"),
                        None,
                    )
                    .await,
                );
                for role in [Role::P, Role::D] {
                    if t.has(role) {
                        match c.admin(role, false, "/is_paused", None).await {
                            Ok(v) if v["is_paused"] == json!(true) => {}
                            Ok(v) => rep
                                .errors
                                .push(format!("{} after /pause: {v}", role.name())),
                            Err(e) => rep.errors.push(e),
                        }
                    }
                }
                tokio::time::sleep(self.hold()).await;
                rep.check(c.on_all(t, true, "/resume", None).await);
            }
            Op::Sleep { level } => {
                if level == 2 {
                    rep.check(
                        c.on_all(
                            t,
                            true,
                            &format!("/pause?mode=keep&timeout={timeout}"),
                            None,
                        )
                        .await,
                    );
                }
                rep.check(
                    c.on_all(
                        t,
                        true,
                        &format!("/sleep?level={level}&mode=keep&timeout={timeout}"),
                        None,
                    )
                    .await,
                );
                self.record_asleep(&mut rep, t).await;
                tokio::time::sleep(self.hold()).await;
                rep.check(c.on_all(t, true, "/wake_up", None).await);
                if level == 2 {
                    rep.check(self.reload(t, &format!("lc-{}-{cycle}", case.name)).await);
                    rep.check(c.on_all(t, true, "/resume", None).await);
                }
            }
            Op::SelectiveWake { weights_first } => {
                rep.check(
                    c.on_all(
                        t,
                        true,
                        &format!("/sleep?level=1&mode=keep&timeout={timeout}"),
                        None,
                    )
                    .await,
                );
                self.record_asleep(&mut rep, t).await;
                tokio::time::sleep(self.hold()).await;
                let (first, second) = if weights_first {
                    ("weights", "kv_cache")
                } else {
                    ("kv_cache", "weights")
                };
                match c
                    .admin(Role::D, true, &format!("/wake_up?tags={first}"), None)
                    .await
                {
                    Ok(v)
                        if v["is_sleeping"] == json!(true)
                            && v["asleep_tags"] == json!([second]) => {}
                    Ok(v) => rep.errors.push(format!(
                        "D after waking {first}: {v} (expected {second} still asleep)"
                    )),
                    Err(e) => rep.errors.push(e),
                }
                match c
                    .admin(Role::D, true, &format!("/wake_up?tags={second}"), None)
                    .await
                {
                    Ok(v) if v["is_sleeping"] == json!(false) => {}
                    Ok(v) => rep
                        .errors
                        .push(format!("D after waking {second}: {v} (expected awake)")),
                    Err(e) => rep.errors.push(e),
                }
            }
            Op::AbortRequests => {
                // Ids of load requests in flight; retried until D had some live.
                let deadline = Instant::now() + PROGRESS_DEADLINE;
                loop {
                    let ids: Vec<String> = load
                        .inflight
                        .lock()
                        .unwrap_or_else(|e| e.into_inner())
                        .iter()
                        .cloned()
                        .collect();
                    if !ids.is_empty() {
                        match c
                            .admin(
                                Role::D,
                                true,
                                "/abort_requests",
                                Some(json!({"request_ids": ids})),
                            )
                            .await
                        {
                            Ok(v) => {
                                let aborted: Vec<String> = v["aborted"]
                                    .as_array()
                                    .map(|a| {
                                        a.iter()
                                            .filter_map(|x| x.as_str().map(str::to_string))
                                            .collect()
                                    })
                                    .unwrap_or_default();
                                if !aborted.is_empty() {
                                    rep.notes.push(format!(
                                        "aborted {} of {} ids",
                                        aborted.len(),
                                        ids.len()
                                    ));
                                    rep.aborted_ids.extend(aborted);
                                    break;
                                }
                            }
                            Err(e) => {
                                rep.errors.push(e);
                                break;
                            }
                        }
                    }
                    if Instant::now() >= deadline {
                        rep.errors
                            .push("D never had a live load request to abort".into());
                        break;
                    }
                    tokio::time::sleep(POLL).await;
                }
            }
            Op::ResetPrefixCache => {
                let tag = format!("{}-{}-{cycle}", self.run_id, case.name);
                let r = match t {
                    Target::P => self.reset_while_p_holds_a_send(&tag).await,
                    _ => self.reset_while_d_holds_a_load(&tag).await,
                };
                match r {
                    Ok(note) => rep.notes.push(note),
                    Err(e) => rep.errors.push(e),
                }
            }
            Op::ReleaseKv => {
                rep.check(
                    c.on_all(
                        t,
                        true,
                        &format!("/pause?mode=keep&timeout={timeout}"),
                        None,
                    )
                    .await,
                );
                rep.check(c.on_all(t, true, "/release_kv_cache_memory", None).await);
                self.record_asleep(&mut rep, t).await;
                tokio::time::sleep(self.hold()).await;
                rep.check(c.on_all(t, true, "/resume", None).await);
            }
            Op::WeightReload => {
                rep.check(
                    c.on_all(
                        t,
                        true,
                        &format!("/pause?mode=keep&timeout={timeout}"),
                        None,
                    )
                    .await,
                );
                rep.check(self.reload(t, &format!("lc-{}-{cycle}", case.name)).await);
                rep.check(c.on_all(t, true, "/resume", None).await);
            }
            Op::PSleepsWhileDPulls => {
                // Hold the transfers at P: write mode pauses P (D's pulls park
                // there), read mode pauses D (the blocks P leased stay held).
                let (paused, gauge) = match self.args.transfer_mode {
                    TransferMode::Write => (Target::P, "pdkv_kv_pulls_pending"),
                    TransferMode::Read => (Target::D, "pdkv_kv_send_held_blocks"),
                };
                rep.check(
                    c.on_all(
                        paused,
                        true,
                        &format!("/pause?mode=keep&timeout={timeout}"),
                        None,
                    )
                    .await,
                );
                // Read mode: a transfer caught between P and D when D paused
                // is luck (the proxy starts none while D is paused), so one
                // is made on purpose: a prompt computed at P for a D that has
                // not read it. D asks for it after the wake (P's sleep ended
                // it, so D computes the prompt itself).
                let held = match self.args.transfer_mode {
                    TransferMode::Read => {
                        match self
                            .hold_a_send_at_p(&format!("{}-{cycle}", case.name))
                            .await
                        {
                            Ok(h) => Some(h),
                            Err(e) => {
                                rep.errors.push(e);
                                None
                            }
                        }
                    }
                    TransferMode::Write => None,
                };
                match c
                    .wait_gauge(Role::P, gauge, 1.0, Instant::now() + PROGRESS_DEADLINE)
                    .await
                {
                    Ok(n) => rep.notes.push(format!("P slept with {gauge} {n}")),
                    Err(e) => rep
                        .errors
                        .push(format!("no transfer waited at P to sleep it under: {e}")),
                }
                rep.check(
                    c.on_all(
                        Target::P,
                        true,
                        &format!("/sleep?level=1&mode=keep&timeout={timeout}"),
                        None,
                    )
                    .await,
                );
                // Release, then reset: the sleep ended every transfer first.
                match c.gauge(Role::P, "pdkv_kv_send_held_blocks").await {
                    Ok(0.0) => {}
                    Ok(v) => rep
                        .errors
                        .push(format!("P holds {v} blocks for transfers while asleep")),
                    Err(e) => rep.errors.push(e),
                }
                self.record_asleep(&mut rep, Target::P).await;
                tokio::time::sleep(self.hold()).await;
                rep.check(c.on_all(Target::P, true, "/wake_up", None).await);
                rep.check(c.on_all(paused, true, "/resume", None).await);
                if let Some((prompt, params, id)) = held {
                    let body = json!({"prompt": prompt, "max_tokens": 2, "temperature": 0,
                                      "ignore_eos": true, "stream": false,
                                      "kv_transfer_params": params});
                    match c.completion(Role::D, body, &id).await {
                        Ok(v) if v["choices"][0]["finish_reason"] == "length" => {}
                        Ok(v) => rep
                            .errors
                            .push(format!("D's request for the transfer P's sleep ended: {v}")),
                        Err(e) => rep.errors.push(e),
                    }
                }
            }
            Op::TrainerSequence => {
                rep.check(
                    c.on_all(
                        t,
                        true,
                        &format!("/pause?mode=keep&timeout={timeout}"),
                        None,
                    )
                    .await,
                );
                // No mode: the sleep keeps the pause's (keep), aborting nothing.
                rep.check(
                    c.on_all(t, true, &format!("/sleep?level=1&timeout={timeout}"), None)
                        .await,
                );
                self.record_asleep(&mut rep, t).await;
                tokio::time::sleep(self.hold()).await;
                rep.check(c.on_all(t, true, "/wake_up", None).await);
                for role in [Role::P, Role::D] {
                    if !t.has(role) {
                        continue;
                    }
                    let paused = c.admin(role, false, "/is_paused", None).await;
                    let sleeping = c.admin(role, false, "/is_sleeping", None).await;
                    match (paused, sleeping) {
                        (Ok(p), Ok(s)) if p["is_paused"] == json!(true) && s["is_sleeping"] == json!(false) => {}
                        (Ok(p), Ok(s)) => rep.errors.push(format!(
                            "{} after /wake_up: {p} {s} (expected awake and still paused until /resume)",
                            role.name()
                        )),
                        (Err(e), _) | (_, Err(e)) => rep.errors.push(e),
                    }
                }
                rep.check(c.on_all(t, true, "/resume", None).await);
            }
        }
        rep
    }

    async fn run_case(&self, case: &Case, cycle: usize) -> anyhow::Result<CaseResult> {
        let c = &self.c;
        let mut res = CaseResult {
            name: case.name.clone(),
            cycle,
            p_awake: self.base.p_awake,
            d_awake: self.base.d_awake,
            ..CaseResult::default()
        };
        let before = counters(c).await?;

        if let Op::ResetPrefixCache = case.op {
            // Idle, the reset must succeed.
            let role = if case.target == Target::P {
                Role::P
            } else {
                Role::D
            };
            match c.wait_quiescent(role).await {
                Ok(slow) => res.notes.extend(slow),
                Err(e) => res.reasons.push(e),
            }
            if let Err(e) = c.expect_reset(role, true, "idle").await {
                res.reasons.push(e);
            }
        }

        let load = Arc::new(Load {
            stop: AtomicBool::new(false),
            next: AtomicU64::new(0),
            completed: AtomicU64::new(0),
            inflight: Mutex::new(HashSet::new()),
            outcomes: Mutex::new(Vec::new()),
            run_id: self.run_id,
            cycle_tag: format!("{}-{cycle}", case.name),
            disconnect_every: self.args.disconnect_every,
            url: format!("{}/v1/completions", c.proxy),
            client: c.client.clone(),
        });
        let workers: Vec<_> = (0..self.args.load_concurrency)
            .map(|_| tokio::spawn(load_worker(load.clone())))
            .collect();
        let n = self.args.load_concurrency as u64;
        let mut clock = PhaseClock::new();
        if !wait_progress(&load, 0, n).await {
            res.reasons.push(format!(
                "the load completed no {n} requests before the operations"
            ));
        }

        clock.lap("warm-up");
        let rep = self.operate(case, cycle, &load).await;
        clock.lap("operations");
        res.reasons.extend(rep.errors);
        res.notes.extend(rep.notes);
        res.p_asleep = rep.asleep.get(&Role::P).copied();
        res.d_asleep = rep.asleep.get(&Role::D).copied();
        let rep_ranks = rep.asleep_ranks.clone();

        // Serving again under load, then the load stops.
        let done = load.completed.load(Ordering::Relaxed);
        if !wait_progress(&load, done, n).await {
            res.reasons.push(format!(
                "the load completed no {n} requests after the restore"
            ));
        }
        clock.lap("load after restore");
        load.stop.store(true, Ordering::Release);
        for w in workers {
            if tokio::time::timeout(REQUEST_DEADLINE + Duration::from_secs(10), w)
                .await
                .is_err()
            {
                res.reasons
                    .push("a load worker did not stop in time".into());
            }
        }
        clock.lap("stopping the load");
        let outcomes =
            std::mem::take(&mut *load.outcomes.lock().unwrap_or_else(|e| e.into_inner()));
        res.load.sent = outcomes.len();
        for (id, o) in outcomes {
            match o {
                RawOutcome::Complete => res.load.complete += 1,
                RawOutcome::Retryable => res.load.retryable += 1,
                RawOutcome::Disconnected => res.load.disconnected += 1,
                RawOutcome::Aborted if case.aborts_all() || rep.aborted_ids.contains(&id) => {
                    res.load.aborted += 1
                }
                RawOutcome::Aborted => res
                    .load
                    .lost
                    .push(format!("{id}: aborted outside an abort")),
                RawOutcome::Bare503(why) => {
                    res.load.bare_503 += 1;
                    res.load.lost.push(why);
                }
                RawOutcome::Lost(why) => res.load.lost.push(why),
            }
        }
        if !res.load.lost.is_empty() {
            // Other kinds first: they are rarer and say more.
            let mut shown: Vec<&str> = res
                .load
                .lost
                .iter()
                .filter(|w| !w.contains("503 without Retry-After"))
                .take(3)
                .map(String::as_str)
                .collect();
            if shown.is_empty() {
                shown.push(&res.load.lost[0]);
            }
            res.reasons.push(format!(
                "{} lost ({} of them 503s without Retry-After): {}",
                res.load.lost.len(),
                res.load.bare_503,
                shown.join(" | ")
            ));
        }

        // Quiescent, serving, no memory drift.
        for role in [Role::P, Role::D] {
            match c.wait_quiescent(role).await {
                Ok(slow) => res.notes.extend(slow),
                Err(e) => res.reasons.push(e),
            }
            if let Err(e) = c.check_serving(role).await {
                res.reasons.push(e);
            }
            let awake = c.device_bytes(role).await?;
            let base = if role == Role::P {
                self.base.p_awake
            } else {
                self.base.d_awake
            };
            if awake != base {
                res.reasons.push(format!(
                    "{} device bytes {awake} after the case, {base} at the baseline",
                    role.name()
                ));
            }
            // No drift on any rank either (a rank that grew while another
            // shrank would cancel out in the sum).
            let ranks = c.rank_bytes(role).await?;
            let base_ranks = if role == Role::P {
                &self.base.p_ranks
            } else {
                &self.base.d_ranks
            };
            if &ranks != base_ranks {
                res.reasons.push(format!(
                    "{} device bytes by rank {ranks:?} after the case, {base_ranks:?} at the baseline",
                    role.name()
                ));
            }
        }
        if let Op::ResetPrefixCache = case.op {
            // Idle again, with the held transfer released: it succeeds.
            let role = if case.target == Target::P {
                Role::P
            } else {
                Role::D
            };
            if let Err(e) = c.expect_reset(role, true, "idle after the load").await {
                res.reasons.push(e);
            }
        }
        clock.lap("quiescence");
        if let Some(t) = case.sleeping() {
            for (role, awake, asleep) in [
                (Role::P, res.p_awake, res.p_asleep),
                (Role::D, res.d_awake, res.d_asleep),
            ] {
                if !t.has(role) {
                    continue;
                }
                match asleep {
                    Some(a) if a as f64 <= ASLEEP_MAX_FRACTION * awake as f64 => {}
                    Some(a) => res.reasons.push(format!(
                        "{} kept {:.1}% of its device bytes asleep ({a} of {awake})",
                        role.name(),
                        100.0 * a as f64 / awake.max(1) as f64
                    )),
                    None => res
                        .reasons
                        .push(format!("{} device bytes asleep not measured", role.name())),
                }
                // Every rank, not only their sum.
                let base_ranks = if role == Role::P {
                    &self.base.p_ranks
                } else {
                    &self.base.d_ranks
                };
                if let Some(asleep) = rep_ranks.get(&role) {
                    for (r, (a, awake)) in asleep.iter().zip(base_ranks).enumerate() {
                        if *a as f64 > ASLEEP_MAX_FRACTION * *awake as f64 {
                            res.reasons.push(format!(
                                "{} rank {r} kept {:.1}% of its device bytes asleep ({a} of {awake})",
                                role.name(),
                                100.0 * *a as f64 / (*awake).max(1) as f64
                            ));
                        }
                    }
                }
            }
        }

        res.t = counters(c).await?.minus(&before);
        res.notes.extend(res.t.on_purpose_note());
        if res.t.pulls_failed > 0.0 || res.t.loads_failed > 0.0 {
            res.reasons.push(format!(
                "failed transfers: {} pulls on P, {} loads on D (a transfer ended on purpose is counted apart)",
                res.t.pulls_failed, res.t.loads_failed
            ));
        }

        // The probes run alone: each must load its KV from P, so transfers
        // work again after the restore (D recomputing would hide it).
        let before_probes = counters(c).await?;
        let got = run_probes(c, &self.base.prompts, self.args.probe_tokens).await;
        let after_probes = counters(c).await?;
        let (loads, pulls) = (
            after_probes.loads_ok - before_probes.loads_ok,
            after_probes.pulls_ok - before_probes.pulls_ok,
        );
        if loads != got.len() as f64 || pulls != got.len() as f64 {
            res.reasons.push(format!(
                "the {} probes after the restore loaded {loads} KV transfers on D ({} failed), P served {pulls} pulls or reads",
                got.len(),
                after_probes.loads_failed - before_probes.loads_failed
            ));
        }
        res.probes_run = got.len();
        let mut diffs = Vec::new();
        for (i, (g, want)) in got.iter().zip(&self.base.texts).enumerate() {
            match g {
                Ok(text) if text == want => res.probes_equal += 1,
                Ok(text) => diffs.push(format!("probe {i}: {text:?} != {want:?}")),
                Err(e) => diffs.push(format!("probe {i}: {e}")),
            }
        }
        if !diffs.is_empty() {
            res.reasons
                .push(format!("{} probes differ ({})", diffs.len(), diffs[0]));
        }
        clock.lap("probes");
        res.notes.extend(clock.slow());
        res.phases = clock.laps;
        Ok(res)
    }
}

/// Process-wide unique enough id for request ids of one run.
fn run_id() -> u32 {
    std::process::id()
}

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

pub fn run(args: LifecycleArgs) -> anyhow::Result<()> {
    if args.list {
        for c in all_cases() {
            println!("{}", c.name);
        }
        return Ok(());
    }
    let cases = select_cases(&args.cases)?;
    anyhow::ensure!(args.cycles > 0, "--cycles must be at least 1");
    anyhow::ensure!(
        args.load_concurrency > 0,
        "--load-concurrency must be at least 1"
    );
    anyhow::ensure!(args.probes > 0, "--probes must be at least 1");
    anyhow::ensure!(args.probe_tokens > 0, "--probe-tokens must be at least 1");
    anyhow::ensure!(
        args.op_timeout > 0,
        "--op-timeout must be at least 1 second"
    );
    let model = match args.model.clone() {
        Some(p) => p,
        None => fetch::default_model_path()?,
    };
    let model =
        std::fs::canonicalize(&model).with_context(|| format!("finding {}", model.display()))?;
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .context("starting the async runtime")?;
    let results = runtime.block_on(async {
        tokio::select! {
            r = run_matrix(&args, &model, &cases) => r,
            _ = wait_for_signal() => Err(anyhow!("interrupted")),
        }
    })?;
    let failed: Vec<&CaseResult> = results.iter().filter(|r| !r.passed()).collect();
    println!(
        "summary: {}/{} case runs passed ({} cases x {} cycles, transport {:?}, transfer mode {:?}, kv_load_failure_policy {:?})",
        results.len() - failed.len(),
        results.len(),
        cases.len(),
        args.cycles,
        args.transport,
        args.transfer_mode,
        args.kv_load_failure_policy
    );
    for f in &failed {
        println!(
            "failed: {} cycle {}: {}",
            f.name,
            f.cycle,
            f.reasons.join("; ")
        );
    }
    let summary = json!({
        "transport": format!("{:?}", args.transport).to_lowercase(),
        "transfer_mode": format!("{:?}", args.transfer_mode).to_lowercase(),
        "kv_load_failure_policy": format!("{:?}", args.kv_load_failure_policy).to_lowercase(),
        "passed": results.len() - failed.len(),
        "failed": failed.len(),
        "cases": results.iter().map(CaseResult::json).collect::<Vec<_>>(),
    });
    println!("{summary}");
    if !failed.is_empty() {
        bail!("{} of {} case runs failed", failed.len(), results.len());
    }
    Ok(())
}

async fn run_matrix(
    args: &LifecycleArgs,
    model: &Path,
    cases: &[Case],
) -> anyhow::Result<Vec<CaseResult>> {
    let client = reqwest::Client::builder()
        .connect_timeout(Duration::from_secs(5))
        .pool_max_idle_per_host(0)
        .build()
        .context("building the HTTP client")?;
    let token = admin_token();
    let mut dep = Deployment { procs: Vec::new() };
    let started = deploy(args, model, &token, &mut dep).await?;
    let c = Cluster {
        client,
        token: token.into(),
        p: started.prefill[0].as_str().into(),
        d: started.decode[0].as_str().into(),
        proxy: started.proxy.as_str().into(),
        op_timeout: Duration::from_secs(args.op_timeout),
        model: model.into(),
    };

    let prompts = probe_prompts(args.probes);
    let mut texts = Vec::with_capacity(prompts.len());
    for (i, r) in run_probes(&c, &prompts, args.probe_tokens)
        .await
        .into_iter()
        .enumerate()
    {
        texts.push(r.map_err(|e| anyhow!("baseline probe {i}: {e}"))?);
    }
    for role in [Role::P, Role::D] {
        if let Some(slow) = c.wait_quiescent(role).await.map_err(|e| anyhow!(e))? {
            eprintln!("pdkv lifecycle: baseline: {slow}");
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
        "pdkv lifecycle: baseline: {} probes, P {:.1} MiB ({} ranks: {}), D {:.1} MiB ({} ranks: {}) awake",
        prompts.len(),
        p_awake as f64 / MIB,
        p_ranks.len(),
        ranks(&p_ranks),
        d_awake as f64 / MIB,
        d_ranks.len(),
        ranks(&d_ranks)
    );
    let runner = Runner {
        c,
        args,
        base: Baseline {
            prompts,
            texts,
            p_awake,
            d_awake,
            p_ranks,
            d_ranks,
        },
        run_id: run_id(),
    };

    let mut results = Vec::new();
    for cycle in 1..=args.cycles {
        for case in cases {
            dep.check_alive()?;
            let started = Instant::now();
            let r = runner
                .run_case(case, cycle)
                .await
                .with_context(|| format!("case {} cycle {cycle}", case.name))?;
            println!("{}  ({:.1}s)", r.line(), started.elapsed().as_secs_f64());
            let _ = std::io::stdout().flush();
            results.push(r);
        }
    }
    dep.check_alive()?;
    Ok(results)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn case_names_are_unique_and_complete() {
        let cases = all_cases();
        let names: HashSet<&str> = cases.iter().map(|c| c.name.as_str()).collect();
        assert_eq!(names.len(), cases.len());
        assert_eq!(
            cases
                .iter()
                .filter(|c| c.name.starts_with("pause_"))
                .count(),
            18
        );
        assert_eq!(
            cases
                .iter()
                .filter(|c| c.name.starts_with("sleep_l"))
                .count(),
            9
        );
        assert_eq!(cases.len(), 40);
        for n in [
            "pause_keep_clear_both",
            "sleep_l2_d",
            "wake_kv_first_d",
            "abort_requests",
            "p_sleeps_while_d_pulls",
            "trainer_sequence_p",
            "trainer_sequence_both",
        ] {
            assert!(names.contains(n), "{n}");
        }
        assert_eq!(select_cases("sleep_l1_p, abort_requests").unwrap().len(), 2);
        assert!(select_cases("sleep_l3_p").is_err());
        assert!(select_cases(",").is_err());
    }

    #[test]
    fn metrics_parse_with_and_without_labels() {
        let text = "# HELP x y\npdkv_kv_blocks_free 10\npdkv_kv_blocks_free_x 3\n\
                    pdkv_device_memory_bytes{tag=\"weights\"} 100\npdkv_device_memory_bytes{tag=\"kv_cache\"} 20\n";
        assert_eq!(metric(text, "pdkv_kv_blocks_free"), Some(10.0));
        assert_eq!(metric(text, "pdkv_kv_blocks_total"), None);
        assert_eq!(metric_sum(text, "pdkv_device_memory_bytes"), Some(120.0));
        assert_eq!(metric_sum(text, "pdkv_kv_blocks_free"), None);
    }

    #[test]
    fn outcomes_are_classified() {
        let ok = Reply {
            status: 200,
            streamed: true,
            finish: Some("length".into()),
            done: true,
            ..Reply::default()
        };
        assert!(matches!(raw_outcome(ok), RawOutcome::Complete));
        let retry = Reply {
            status: 503,
            retry_after: true,
            ..Reply::default()
        };
        assert!(matches!(raw_outcome(retry), RawOutcome::Retryable));
        let bare = Reply {
            status: 503,
            ..Reply::default()
        };
        assert!(matches!(raw_outcome(bare), RawOutcome::Bare503(_)));
        let abort = Reply {
            status: 200,
            finish: Some("abort".into()),
            ..Reply::default()
        };
        assert!(matches!(raw_outcome(abort), RawOutcome::Aborted));
        // The proxy has no error event for an aborted prefill (D computes
        // the prompt): every error event is a failure.
        let event = Reply {
            status: 200,
            streamed: true,
            done: true,
            error: Some(json!({"code": "upstream_error"})),
            ..Reply::default()
        };
        assert!(matches!(raw_outcome(event), RawOutcome::Lost(_)));
        let timeout = Reply {
            status: 504,
            error: Some(json!({"code": "upstream_timeout"})),
            ..Reply::default()
        };
        assert!(matches!(raw_outcome(timeout), RawOutcome::Lost(_)));
        let unfinished = Reply {
            status: 200,
            ..Reply::default()
        };
        assert!(matches!(raw_outcome(unfinished), RawOutcome::Lost(_)));
        let no_done = Reply {
            status: 200,
            streamed: true,
            finish: Some("stop".into()),
            ..Reply::default()
        };
        assert!(matches!(raw_outcome(no_done), RawOutcome::Lost(_)));
        let left = Reply {
            status: 200,
            streamed: true,
            disconnected: true,
            ..Reply::default()
        };
        assert!(matches!(raw_outcome(left), RawOutcome::Disconnected));
        let failed = Reply {
            status: 200,
            error: Some(json!({"code": "kv_transfer_failed"})),
            ..Reply::default()
        };
        assert!(matches!(raw_outcome(failed), RawOutcome::Lost(_)));
    }

    #[test]
    fn probe_prompts_are_distinct_and_share_prefixes() {
        let p = probe_prompts(70);
        assert_eq!(p.iter().collect::<HashSet<_>>().len(), 70);
        assert!(p[0].starts_with(PREFIXES[0]) && p[PREFIXES.len()].starts_with(PREFIXES[0]));
    }
}
