//! `pdkv bench serve`: sustained load through the P/D proxy, and what a
//! serving team needs from it — requests by outcome and failures by cause,
//! throughput, TTFT and inter-token latency percentiles, memory over time
//! and its drift, and whether every KV block is free once the load stops.
//!
//! Target: `--url` drives an existing proxy (memory is then read only from
//! the engines given with `--engine`); without it the bench starts its own
//! 1P1D deployment on loopback exactly as `pdkv up` does (the same
//! [`crate::up::start`]), with the children's logs in files (`--log-dir`),
//! and stops it at the end.
//!
//! Load: `--concurrency` workers, each sending one streamed
//! `/v1/completions` request after another (distinct prompts, greedy, EOS
//! ignored, so each must generate exactly `--max-tokens` tokens) for
//! `--duration-s` or `--requests`. A `--disconnect-share` of requests,
//! chosen from `--seed` and the request's index, drop the connection after
//! a few tokens on purpose. Beside it, `--idle-flood` idle connections on
//! the proxy's port (and `--idle-flood-kv` on each KV port of P and D) are
//! held open, and re-opened as the servers close them.
//!
//! Every `--sample-s` a progress line on stderr (counts, tok/s, RSS of each
//! child, device memory of each engine). After the load: a bounded wait for
//! the engines to go quiet, the check that every KV block is free, a table
//! on stdout and a JSON line last. The exit status is nonzero when a
//! request failed unintentionally or blocks were not all free (the reasons
//! on stderr), so the bench can be a check.
//!
//! `--chaos` (own deployment only) runs 1P2D with
//! `kv_load_failure_policy: recompute` and kills an engine with SIGKILL
//! every `--chaos-interval-s` (the decode engines and the prefill engine in
//! turn, or only those `--chaos-kill` names), starting it again at once on
//! its ports ([`chaos`]): the report says which died and when each served
//! again, and a request that failed is a problem as ever.
//!
//! Every wait is bounded: start-up (`--startup-timeout`), each request
//! (`--request-timeout-s`), the quiet wait (`--quiet-timeout-s`), the flood's
//! and the children's stop.

mod chaos;
mod flood;
mod load;
mod memory;
mod report;
mod verify;

use std::path::PathBuf;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use clap::Args;
use serde_json::{json, Value};

use crate::fetch;
use crate::proxy_cmd::wait_for_signal;
use crate::up::{self, ChildLogs, DeploymentArgs, Proc, UpArgs};

/// The name on this command's notices.
const WHO: &str = "bench serve";
const MIB: f64 = 1024.0 * 1024.0;
/// Bound on one `/metrics` scrape (and `/kv_transfer/info`).
const SCRAPE_TIMEOUT: Duration = Duration::from_secs(5);
/// A scrape this slow is shown beside the progress line.
const SLOW_SCRAPE: Duration = Duration::from_secs(1);

#[derive(Args, Debug)]
pub struct ServeBenchArgs {
    /// Drive the proxy at this URL instead of starting a deployment.
    #[arg(long)]
    pub url: Option<String>,
    /// With `--url`: an engine whose `/metrics` are sampled and whose KV
    /// blocks are checked at the end (repeat for each engine).
    #[arg(long = "engine", requires = "url")]
    pub engines: Vec<String>,
    #[command(flatten)]
    pub deployment: DeploymentArgs,
    /// KV cache size of P and D, in blocks of 16 tokens (default: the
    /// server's).
    #[arg(long, conflicts_with = "url")]
    pub num_kv_blocks: Option<usize>,
    /// Where the children's logs go (default: a new temporary directory).
    #[arg(long, conflicts_with = "url")]
    pub log_dir: Option<PathBuf>,
    /// Bound on the deployment's start-up (model loading included), in seconds.
    #[arg(long, default_value_t = 300, conflicts_with = "url")]
    pub startup_timeout: u64,
    /// Client workers, each with one request in flight.
    #[arg(long, default_value_t = 64)]
    pub concurrency: usize,
    /// Approximate prompt length in words.
    #[arg(long, default_value_t = 100)]
    pub prompt_words: usize,
    /// Tokens generated per request (EOS ignored).
    #[arg(long, default_value_t = 32)]
    pub max_tokens: u32,
    /// How long the load runs, in seconds.
    #[arg(long, default_value_t = 600)]
    pub duration_s: u64,
    /// Send this many requests in all instead of running for `--duration-s`.
    #[arg(long)]
    pub requests: Option<u64>,
    /// The first seconds, excluded from the latency and throughput figures
    /// and the memory baseline.
    #[arg(long, default_value_t = 30)]
    pub warmup_s: u64,
    /// Share of requests whose connection the client drops on purpose after
    /// the first few tokens.
    #[arg(long, default_value_t = 0.05)]
    pub disconnect_share: f64,
    /// Seed of the prompts and of which requests disconnect.
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// Deadline of each request, in seconds.
    #[arg(long, default_value_t = 120)]
    pub request_timeout_s: u64,
    /// A new connection per request instead of kept-alive ones (for servers
    /// that close a kept-alive connection just as a client reuses it).
    #[arg(long)]
    pub fresh_connections: bool,
    /// Every request's output constrained by a JSON schema (nested
    /// objects, arrays, enums) that no answer completes within
    /// `--max-tokens`, so the token counts stay those of unconstrained
    /// requests: run with and without it for the ratio (`pdkv bench
    /// structured` measures it on one engine in one run).
    #[arg(long)]
    pub structured: bool,
    /// Idle TCP connections held open on the proxy's HTTP port.
    #[arg(long, default_value_t = 0)]
    pub idle_flood: usize,
    /// Idle TCP connections held open on each KV port of each engine (from
    /// its `/kv_transfer/info`: `bootstrap_addr`, `transfer_addr`).
    #[arg(long, default_value_t = 0)]
    pub idle_flood_kv: usize,
    /// Seconds between memory samples (and progress lines).
    #[arg(long, default_value_t = 10)]
    pub sample_s: u64,
    /// Bound on the wait for the engines to go quiet after the load, in seconds.
    #[arg(long, default_value_t = 30)]
    pub quiet_timeout_s: u64,
    /// Kill engines (SIGKILL) on a schedule while the load runs and start
    /// them again at once (own deployment only: 1P2D, failed KV loads
    /// recomputed).
    #[arg(long, conflicts_with = "url")]
    pub chaos: bool,
    /// With `--chaos`: seconds between two kills.
    #[arg(long, default_value_t = 10, requires = "chaos")]
    pub chaos_interval_s: u64,
    /// After the load, send every request that ended well again, at rest,
    /// and check its tokens equal those its stream carried (greedy: they
    /// must; under `--chaos`, resumed and recomputed requests included).
    #[arg(long)]
    pub verify_outputs: bool,
    /// With `--chaos`: which engines are killed, in turn.
    #[arg(long, value_enum, default_value = "both", requires = "chaos")]
    pub chaos_kill: chaos::Victims,
    /// The decode servers' speculative decoding (own deployment only; see
    /// `pdkv serve --speculative-config`).
    #[arg(long, conflicts_with = "url")]
    pub speculative_config: Option<String>,
    /// Last, as its heading would stay for the flags after it. The
    /// deployment's HTTP bounds: its servers' `--max-connections` and
    /// `--header-timeout-s`, as `pdkv up` takes them (refused with `--url`:
    /// see [`refuse_beside_url`]).
    #[command(
        flatten,
        next_help_heading = "HTTP bounds of the deployment it starts (not with --url)"
    )]
    pub http: crate::http_args::HttpArgs,
}

/// The flags of `bench serve` that shape the deployment it starts, which
/// a flag of its own struct cannot mark (they are shared with `pdkv up`,
/// `serve` and `proxy`, which have no `--url`): refused beside `--url`,
/// whose servers have their own, instead of being dropped unsaid.
pub fn refuse_beside_url(cmd: clap::Command) -> clap::Command {
    [
        "model",
        "transport",
        "transfer_mode",
        "max_connections",
        "header_timeout_s",
    ]
    .into_iter()
    .fold(cmd, |c, id| c.mut_arg(id, |a| a.conflicts_with("url")))
}

fn validate(args: &ServeBenchArgs) -> anyhow::Result<()> {
    anyhow::ensure!(args.concurrency >= 1, "--concurrency must be at least 1");
    anyhow::ensure!(args.max_tokens >= 1, "--max-tokens must be at least 1");
    anyhow::ensure!(args.sample_s >= 1, "--sample-s must be at least 1");
    anyhow::ensure!(
        args.request_timeout_s >= 1,
        "--request-timeout-s must be at least 1"
    );
    anyhow::ensure!(
        (0.0..=1.0).contains(&args.disconnect_share),
        "--disconnect-share must be within 0..=1"
    );
    if args.requests.is_none() {
        anyhow::ensure!(
            args.warmup_s < args.duration_s,
            "--warmup-s ({}) must be shorter than --duration-s ({}): nothing would be measured",
            args.warmup_s,
            args.duration_s
        );
    }
    anyhow::ensure!(args.requests != Some(0), "--requests must be at least 1");
    anyhow::ensure!(
        args.chaos_interval_s >= 1,
        "--chaos-interval-s must be at least 1"
    );
    Ok(())
}

/// Raises this process's descriptor limit (the children inherit it) to at
/// least `need`, or fails saying how to get there.
fn raise_nofile(need: u64) -> anyhow::Result<()> {
    let mut lim = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: plain syscalls on a local struct.
    unsafe {
        if libc::getrlimit(libc::RLIMIT_NOFILE, &mut lim) != 0 {
            bail!(
                "getrlimit(RLIMIT_NOFILE): {}",
                std::io::Error::last_os_error()
            );
        }
        if lim.rlim_cur >= need {
            return Ok(());
        }
        if lim.rlim_max < need {
            bail!(
                "this run needs about {need} open files (connections of the load and the idle flood), but the hard \
                 limit is {}: raise it (`ulimit -Hn {need}` as root, or `nofile` in /etc/security/limits.conf) or \
                 lower --concurrency / --idle-flood / --idle-flood-kv",
                lim.rlim_max
            );
        }
        lim.rlim_cur = need;
        if libc::setrlimit(libc::RLIMIT_NOFILE, &lim) != 0 {
            bail!(
                "setrlimit(RLIMIT_NOFILE, {need}): {}",
                std::io::Error::last_os_error()
            );
        }
    }
    Ok(())
}

/// What the load runs against.
struct Target {
    proxy: String,
    engines: Vec<memory::Engine>,
    /// The children (none with `--url`), for RSS; their names.
    pids: Vec<u32>,
    names: Vec<String>,
    log_dir: Option<PathBuf>,
    /// With `--chaos`: the kill schedule.
    chaos: Option<chaos::Chaos>,
}

/// Starts the 1P1D deployment (children pushed onto `procs`).
async fn start_deployment(args: &ServeBenchArgs, procs: &mut Vec<Proc>) -> anyhow::Result<Target> {
    let model = match args.deployment.model.clone() {
        Some(p) => p,
        None => fetch::default_model_path()?,
    };
    let log_dir = match &args.log_dir {
        Some(d) => {
            std::fs::create_dir_all(d)
                .with_context(|| format!("creating --log-dir {}", d.display()))?;
            d.clone()
        }
        None => tempfile::Builder::new()
            .prefix("pdkv-bench-serve-")
            .tempdir()
            .context("creating a log directory")?
            .keep(),
    };
    eprintln!("{WHO}: the servers' logs are in {}", log_dir.display());
    let up_args = UpArgs {
        deployment: DeploymentArgs {
            model: Some(model.clone()),
            ..args.deployment.clone()
        },
        prefill: 1,
        decode: if args.chaos { 2 } else { 1 },
        // A prefill engine killed mid-transfer: D computes the prompt.
        kv_load_failure_policy: args.chaos.then_some(pdkv_deploy::FailurePolicy::Recompute),
        port: 0,
        prefill_port: None,
        decode_port: None,
        kv_port: None,
        admin_token: None,
        dev_mode: false,
        kv_secret: None,
        api_key: None,
        num_kv_blocks: args.num_kv_blocks,
        kv_cache_dtype: pdkv_model::KvDtype::AUTO,
        speculative_config: args.speculative_config.clone(),
        enable_auto_tool_choice: false,
        tool_call_parser: None,
        tensor_parallel_size: 1,
        prefill_tensor_parallel_size: None,
        decode_tensor_parallel_size: None,
        weight_format: pdkv_model::WeightFormat::AsStored,
        startup_timeout: args.startup_timeout,
        http: args.http.clone(),
    };
    let ports = up::Ports::choose(&up_args)?;
    let logs = ChildLogs {
        who: WHO,
        dir: Some(log_dir.clone()),
    };
    let signal = wait_for_signal();
    let started = tokio::select! {
        r = up::start(&up_args, &model, &ports, procs, &logs) => r?,
        _ = signal => bail!("interrupted during start-up"),
    };
    let engines = started
        .engines
        .iter()
        .map(|e| memory::Engine {
            name: e.name.clone(),
            url: e.url.clone(),
        })
        .collect();
    let chaos = match args.chaos {
        true => Some(chaos::Chaos::new(
            started.engines.clone(),
            args.chaos_kill,
            logs.logs(),
            Duration::from_secs(args.startup_timeout),
        )?),
        false => None,
    };
    eprintln!(
        "{WHO}: 1P{}D ready (transport {}, transfer mode {}), proxy {}",
        started.decode.len(),
        args.deployment.transport.as_str(),
        args.deployment.transfer_mode.as_str(),
        started.proxy
    );
    Ok(Target {
        proxy: started.proxy,
        engines,
        pids: procs.iter().map(Proc::pid).collect(),
        names: procs.iter().map(|p| p.name.clone()).collect(),
        log_dir: Some(log_dir),
        chaos,
    })
}

/// `--url` and `--engine`s, each engine named by its KV role when it has one.
async fn existing(args: &ServeBenchArgs, url: &str, client: &reqwest::Client) -> Target {
    let mut engines = Vec::new();
    // Numbered within each role: prefill 0, prefill 1, decode 0, ...
    let mut seen = std::collections::HashMap::<&str, usize>::new();
    for e in &args.engines {
        let e = e.trim_end_matches('/').to_string();
        let role = kv_info(client, &e)
            .await
            .and_then(|v| v["kv_role"].as_str().map(str::to_string));
        let role = match role.as_deref() {
            Some("kv_producer") => "prefill",
            Some("kv_consumer") => "decode",
            _ => "engine",
        };
        let n = seen.entry(role).or_default();
        engines.push(memory::Engine {
            name: format!("{role} {n}"),
            url: e,
        });
        *n += 1;
    }
    let proxy = url.trim_end_matches('/').to_string();
    Target {
        proxy,
        engines,
        pids: Vec::new(),
        names: Vec::new(),
        log_dir: None,
        chaos: None,
    }
}

async fn kv_info(client: &reqwest::Client, engine: &str) -> Option<Value> {
    let resp = client
        .get(format!("{engine}/kv_transfer/info"))
        .send()
        .await
        .ok()?;
    if !resp.status().is_success() {
        return None;
    }
    resp.json().await.ok()
}

/// The flood's targets: the proxy's HTTP port, and each engine's KV ports
/// that accept connections.
async fn flood_targets(
    args: &ServeBenchArgs,
    t: &Target,
    client: &reqwest::Client,
) -> anyhow::Result<Vec<flood::Target>> {
    let mut out = Vec::new();
    if args.idle_flood > 0 {
        let u = reqwest::Url::parse(&t.proxy)
            .with_context(|| format!("parsing the proxy URL {}", t.proxy))?;
        let host = u.host_str().context("the proxy URL has no host")?;
        let port = u
            .port_or_known_default()
            .context("the proxy URL has no port")?;
        out.push(flood::Target {
            label: "proxy http".to_string(),
            addr: format!("{host}:{port}"),
            size: args.idle_flood,
        });
    }
    if args.idle_flood_kv == 0 {
        return Ok(out);
    }
    for e in &t.engines {
        let Some(info) = kv_info(client, &e.url).await else {
            eprintln!(
                "{WHO}: {} has no /kv_transfer/info; no KV flood on it",
                e.name
            );
            continue;
        };
        for field in ["bootstrap_addr", "transfer_addr"] {
            let Some(addr) = info[field].as_str() else {
                continue;
            };
            if out.iter().any(|o: &flood::Target| o.addr == addr) {
                continue;
            }
            if addr.starts_with('/') {
                eprintln!(
                    "{WHO}: {} {field} {addr} is a Unix socket (shm), not TCP; no KV flood on it",
                    e.name
                );
                continue;
            }
            match flood::listening(addr).await {
                Ok(()) => out.push(flood::Target {
                    label: format!("{} {field}", e.name),
                    addr: addr.to_string(),
                    size: args.idle_flood_kv,
                }),
                Err(why) => eprintln!(
                    "{WHO}: {} {field} {addr} takes no connection ({why}); no KV flood on it",
                    e.name
                ),
            }
        }
    }
    Ok(out)
}

/// One sample of every engine and child.
async fn sample(
    client: &reqwest::Client,
    t: &Target,
    t0: Instant,
    c: &load::Counters,
) -> memory::Sample {
    let (mut engines, mut scrapes) = (
        Vec::with_capacity(t.engines.len()),
        Vec::with_capacity(t.engines.len()),
    );
    for e in &t.engines {
        let asked = Instant::now();
        let r = memory::scrape(client, &e.url).await;
        scrapes.push(r.as_ref().map(|_| asked.elapsed()).map_err(Clone::clone));
        engines.push(r.ok());
    }
    memory::Sample {
        elapsed: t0.elapsed(),
        engines,
        scrapes,
        rss: t.pids.iter().map(|&p| memory::rss_bytes(p)).collect(),
        ok: c.ok.load(Ordering::Relaxed),
        failed: c.failed.load(Ordering::Relaxed),
        disconnected: c.disconnected.load(Ordering::Relaxed),
        tokens: c.tokens.load(Ordering::Relaxed),
    }
}

fn progress_line(
    s: &memory::Sample,
    prev: Option<&memory::Sample>,
    t: &Target,
    flood_open: u64,
) -> String {
    let (dt, dtok) = match prev {
        Some(p) => ((s.elapsed - p.elapsed).as_secs_f64(), s.tokens - p.tokens),
        None => (s.elapsed.as_secs_f64(), s.tokens),
    };
    let rate = if dt > 0.0 { dtok as f64 / dt } else { 0.0 };
    let mut line = format!(
        "{WHO}: {:>5.0}s  ok {} failed {} disconnected {}  {rate:.1} tok/s",
        s.elapsed.as_secs_f64(),
        s.ok,
        s.failed,
        s.disconnected
    );
    let mib = |b: Option<f64>| b.map_or("?".to_string(), |b| format!("{:.1}", b / MIB));
    if !t.names.is_empty() {
        let rss: Vec<String> = t
            .names
            .iter()
            .zip(&s.rss)
            .map(|(n, r)| format!("{n} {}", mib(r.map(|r| r as f64))))
            .collect();
        line.push_str(&format!("  rss MiB {}", rss.join(" ")));
    }
    if !t.engines.is_empty() {
        // One `name value` piece per engine, `?` where its scrape failed.
        let each = |f: &dyn Fn(&memory::EngineSample) -> String| -> String {
            let v: Vec<String> = t
                .engines
                .iter()
                .zip(&s.engines)
                .map(|(e, x)| format!("{} {}", e.name, x.as_ref().map_or("?".to_string(), f)))
                .collect();
            v.join(" ")
        };
        let n = |v: Option<f64>| v.map_or("?".to_string(), |v| format!("{v}"));
        line.push_str(&format!("  device MiB {}", each(&|x| mib(x.device_bytes))));
        line.push_str(&format!(
            "  free blocks {}",
            each(&|x| format!("{}/{}", n(x.blocks_free), n(x.blocks_total)))
        ));
        line.push_str(&format!(
            "  running/waiting {}",
            each(&|x| format!("{}/{}", n(x.running), n(x.waiting)))
        ));
    }
    if flood_open > 0 {
        line.push_str(&format!("  idle conns {flood_open}"));
    }
    for (e, r) in t.engines.iter().zip(&s.scrapes) {
        match r {
            Err(why) => line.push_str(&format!("\n{WHO}:   {} /metrics failed: {why}", e.name)),
            Ok(d) if *d >= SLOW_SCRAPE => line.push_str(&format!(
                "\n{WHO}:   {} /metrics took {:.1}s",
                e.name,
                d.as_secs_f64()
            )),
            Ok(_) => {}
        }
    }
    line
}

/// What the run produced.
struct Run {
    cfg: Arc<load::LoadConfig>,
    records: Vec<load::Record>,
    samples: Vec<memory::Sample>,
    t0: Instant,
    /// When the load stopped starting requests (or the last one ended).
    stopped: Instant,
    interrupted: bool,
    counters: Arc<load::Counters>,
}

/// Runs the load and the sampler until the duration passes, the requests
/// are done, or a signal; fails when a child exits.
async fn drive(
    args: &ServeBenchArgs,
    t: &mut Target,
    procs: &mut [Proc],
    client: &reqwest::Client,
    flood: &flood::Flood,
) -> anyhow::Result<Run> {
    let cfg = Arc::new(load::LoadConfig {
        url: t.proxy.clone(),
        concurrency: args.concurrency,
        max_tokens: args.max_tokens,
        prompt_words: args.prompt_words,
        disconnect_share: args.disconnect_share,
        seed: args.seed,
        request_timeout: Duration::from_secs(args.request_timeout_s),
        requests: args.requests,
        fresh_connections: args.fresh_connections,
        structured: args.structured,
    });
    let counters = Arc::new(load::Counters::default());
    let t0 = Instant::now();
    let mut load = tokio::spawn(load::run(cfg.clone(), counters.clone()));
    let timed = args.requests.is_none();
    let end = tokio::time::sleep_until((t0 + Duration::from_secs(args.duration_s)).into());
    let signal = wait_for_signal();
    tokio::pin!(end, signal);
    let mut tick = tokio::time::interval(Duration::from_secs(args.sample_s));
    let every = Duration::from_secs(args.chaos_interval_s);
    let mut chaos_tick = tokio::time::interval_at((t0 + every).into(), every);
    let (mut samples, mut stopped, mut interrupted) = (Vec::<memory::Sample>::new(), None, false);
    let records = loop {
        tokio::select! {
            r = &mut load => break r.context("the load task")??,
            _ = tick.tick() => {
                let s = sample(client, t, t0, &counters).await;
                eprintln!("{}", progress_line(&s, samples.last(), t, flood.open_now()));
                samples.push(s);
                if let Err(e) = up::check_children(procs) {
                    load.abort();
                    return Err(e);
                }
            }
            _ = chaos_tick.tick(), if t.chaos.is_some() && stopped.is_none() => {
                let chaos = t.chaos.as_mut().expect("checked");
                match chaos.kill_next(procs, client).await {
                    Ok((i, pid)) => t.pids[i] = pid,
                    Err(e) => {
                        load.abort();
                        return Err(e);
                    }
                }
            }
            _ = &mut end, if timed && stopped.is_none() => {
                eprintln!("{WHO}: {}s passed; letting the requests in flight finish", args.duration_s);
                counters.stop.store(true, Ordering::Relaxed);
                stopped = Some(Instant::now());
            }
            _ = &mut signal, if stopped.is_none() => {
                eprintln!("{WHO}: interrupted; letting the requests in flight finish");
                counters.stop.store(true, Ordering::Relaxed);
                (stopped, interrupted) = (Some(Instant::now()), true);
            }
        }
    };
    Ok(Run {
        cfg,
        records,
        samples,
        t0,
        stopped: stopped.unwrap_or_else(Instant::now),
        interrupted,
        counters,
    })
}

/// The whole bench but the children's stop: start or reach the target,
/// flood, load, quiet wait, final sample.
async fn bench(args: &ServeBenchArgs, procs: &mut Vec<Proc>) -> anyhow::Result<Value> {
    // Idle pooled connections are dropped before the servers' idle timeout
    // closes them under a scrape.
    let client = reqwest::Client::builder()
        .timeout(SCRAPE_TIMEOUT)
        .pool_idle_timeout(pdkv_server::proxy::UPSTREAM_IDLE)
        .build()
        .context("building the HTTP client")?;
    let mut t = match &args.url {
        Some(url) => existing(args, url, &client).await,
        None => start_deployment(args, procs).await?,
    };
    let flood = flood::Flood::start(flood_targets(args, &t, &client).await?);
    eprintln!(
        "{WHO}: {} workers, {} tokens per request, prompts of ~{} words, {}",
        args.concurrency,
        args.max_tokens,
        args.prompt_words,
        match args.requests {
            Some(n) => format!("{n} requests"),
            None => format!("{}s (warm-up {}s)", args.duration_s, args.warmup_s),
        }
    );
    let run = drive(args, &mut t, procs, &client, &flood).await?;
    let flood = flood.stop().await;
    let quiet = memory::wait_quiet(
        &client,
        &t.engines,
        Duration::from_secs(args.quiet_timeout_s),
    )
    .await;
    let mut end = sample(&client, &t, run.t0, &run.counters).await;
    end.engines.clone_from(&quiet.engines);

    let warmup = Duration::from_secs(args.warmup_s);
    let window = report::Window {
        from: run.t0 + warmup,
        to: run.stopped,
    };
    let engine_names: Vec<String> = t.engines.iter().map(|e| e.name.clone()).collect();
    let summary = report::Summary {
        requests: report::requests(&run.records),
        throughput: report::throughput(&run.records, &window),
        drift: report::drift(&run.samples, warmup, &end, &t.names, &engine_names),
        blocks: t
            .engines
            .iter()
            .zip(&quiet.engines)
            .map(|(e, s)| report::Blocks {
                engine: e.name.clone(),
                at_end: *s,
            })
            .collect(),
        quiet_wait: quiet.waited,
        flood: flood.iter().map(flood::TargetReport::json).collect(),
        scrapes: report::scrapes(&run.samples, &engine_names),
    };
    print!("{}", summary.table());
    if let Some(c) = &t.chaos {
        println!("{}", c.line());
    }
    if let Some(d) = &t.log_dir {
        println!("servers' logs: {}", d.display());
    }
    let mut out = summary.json();
    if let (Value::Object(o), Value::Object(x)) = (&mut out, run_json(args, &t, &run)) {
        o.extend(x);
    }
    if args.verify_outputs {
        eprintln!(
            "{WHO}: sending every request that ended well again, at rest, to compare its tokens"
        );
        let v = verify::verify(run.cfg.clone(), &run.records).await?;
        println!("{}", v.line());
        out["verify_outputs"] = v.json();
        if let Some(p) = out["problems"].as_array_mut() {
            p.extend(v.problems().into_iter().map(Value::from));
        }
    }
    if let Some(c) = &t.chaos {
        out["chaos"] = c.json(Duration::from_secs(args.chaos_interval_s));
        out["chaos"]["proxy"] = chaos::proxy_counters(&client, &t.proxy).await;
        println!("proxy: {}", out["chaos"]["proxy"]);
    }
    Ok(out)
}

/// The JSON fields that say what ran: the target, the knobs, the samples.
fn run_json(args: &ServeBenchArgs, t: &Target, run: &Run) -> Value {
    let own = args.url.is_none();
    json!({
        "bench": "serve",
        "url": t.proxy,
        "own_deployment": own,
        "transport": own.then(|| args.deployment.transport.as_str()),
        "transfer_mode": own.then(|| args.deployment.transfer_mode.as_str()),
        "concurrency": args.concurrency,
        "max_tokens": args.max_tokens,
        "prompt_words": args.prompt_words,
        "duration_s": args.requests.is_none().then_some(args.duration_s),
        "requests_asked": args.requests,
        "warmup_s": args.warmup_s,
        "disconnect_share": args.disconnect_share,
        "seed": args.seed,
        "interrupted": run.interrupted,
        "log_dir": t.log_dir.as_ref().map(|d| d.display().to_string()),
        "engines": t.engines.iter().map(|e| json!({"name": e.name, "url": e.url})).collect::<Vec<_>>(),
        "samples": run.samples.iter().map(|s| sample_json(s, t)).collect::<Vec<_>>(),
    })
}

fn sample_json(s: &memory::Sample, t: &Target) -> Value {
    let engines: Vec<Value> = t
        .engines
        .iter()
        .zip(&s.engines)
        .map(|(e, x)| {
            let x = x.unwrap_or_default();
            json!({"engine": e.name, "device_bytes": x.device_bytes, "blocks_free": x.blocks_free,
                   "blocks_total": x.blocks_total, "blocks_held": x.blocks_held,
                   "running": x.running, "waiting": x.waiting})
        })
        .collect();
    let rss: Vec<Value> = t
        .names
        .iter()
        .zip(&s.rss)
        .map(|(n, r)| json!({"process": n, "rss_bytes": r}))
        .collect();
    let scrapes: Vec<Value> = t
        .engines
        .iter()
        .zip(&s.scrapes)
        .map(|(e, r)| match r {
            Ok(d) => json!({"engine": e.name, "ms": d.as_secs_f64() * 1e3}),
            Err(why) => json!({"engine": e.name, "error": why}),
        })
        .collect();
    json!({"elapsed_s": s.elapsed.as_secs_f64(), "ok": s.ok, "failed": s.failed, "disconnected": s.disconnected,
           "tokens": s.tokens, "engines": engines, "rss": rss, "metrics_scrapes": scrapes})
}

pub fn run_serve_bench(args: ServeBenchArgs) -> anyhow::Result<()> {
    validate(&args)?;
    // Per request a client and an upstream socket on each side, plus the
    // flood's sockets at both ends (the children inherit the limit).
    let flood = args.idle_flood as u64 + 4 * args.idle_flood_kv as u64;
    raise_nofile(1024 + 6 * args.concurrency as u64 + 2 * flood)?;
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .context("starting the async runtime")?;
    let result = runtime.block_on(async {
        let mut procs: Vec<Proc> = Vec::new();
        let result = bench(&args, &mut procs).await;
        up::stop_all(&mut procs, WHO).await;
        result
    })?;
    let problems: Vec<String> = result["problems"]
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(|p| p.as_str().map(str::to_string))
        .collect();
    println!("{result}");
    if !problems.is_empty() {
        for p in &problems {
            eprintln!("{WHO}: {p}");
        }
        bail!("{} problem(s), listed above", problems.len());
    }
    Ok(())
}
