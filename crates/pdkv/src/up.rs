//! `pdkv up`: a whole P/D deployment on loopback in one command — N prefill
//! servers, M decode servers (one of each by default) and the proxy, each a
//! child process running this same executable (`pdkv serve ...`,
//! `pdkv proxy ...`). With `--admin-token` every engine runs with the admin
//! API and sleep mode, and the proxy fans each lifecycle call out to all of
//! them, so one `/pause`, `/sleep`, `/wake_up`, `/resume` on the proxy's
//! address drives the whole deployment.
//!
//! Lifecycle: the children start (P and D load the model side by side), `up`
//! waits until each answers `GET /health` (bounded, progress on stderr),
//! prints the proxy's URL and a curl example on stdout, and then watches
//! them. Ctrl-C or SIGTERM stops all three: SIGTERM to each (the proxy
//! first, so no request reaches a stopping server), a bounded wait, then
//! SIGKILL for any that did not exit. If a child exits on its own, the
//! others are stopped the same way and `up` fails with the child's last log
//! lines.
//!
//! Invariant: every child is reaped before `up` returns, on every path (a
//! child is also asked to exit by the kernel if `up` itself dies, through
//! `PR_SET_PDEATHSIG`).

use std::collections::VecDeque;
use std::io::{BufRead, BufReader, Write};
use std::os::unix::process::CommandExt;
use std::path::PathBuf;
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use clap::{Args, ValueEnum};

use crate::fetch;
use crate::proxy_cmd::wait_for_signal;

#[derive(Clone, Copy, Debug, ValueEnum)]
pub enum Transport {
    Tcp,
    Shm,
}

impl Transport {
    pub(crate) fn as_str(self) -> &'static str {
        match self {
            Transport::Tcp => "tcp",
            Transport::Shm => "shm",
        }
    }
}

#[derive(Clone, Copy, Debug, ValueEnum)]
pub enum TransferMode {
    /// P writes into D's blocks (D pulls).
    Write,
    /// D reads P's leased blocks.
    Read,
}

impl TransferMode {
    pub(crate) fn as_str(self) -> &'static str {
        match self {
            TransferMode::Write => "write",
            TransferMode::Read => "read",
        }
    }
}

#[derive(Args, Debug)]
pub struct UpArgs {
    /// A `.gguf` file or a checkpoint directory (default: SmolLM2-135M-Instruct
    /// from the model cache, fetched if missing).
    #[arg(long)]
    pub model: Option<PathBuf>,
    /// How many prefill servers.
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u16).range(1..=64))]
    pub prefill: u16,
    /// How many decode servers.
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u16).range(1..=64))]
    pub decode: u16,
    /// How KV moves from the prefill to the decode servers.
    #[arg(long, value_enum, default_value = "tcp")]
    pub transport: Transport,
    /// Who moves the KV bytes.
    #[arg(long, value_enum, default_value = "write")]
    pub transfer_mode: TransferMode,
    /// The proxy's port (the one clients use); 0 picks a free one (the
    /// ready lines name it).
    #[arg(long, default_value_t = 8000)]
    pub port: u16,
    /// The first prefill server's port; the others follow it (default:
    /// each binds a free one).
    #[arg(long)]
    pub prefill_port: Option<u16>,
    /// The first decode server's port; the others follow it (default:
    /// each binds a free one).
    #[arg(long)]
    pub decode_port: Option<u16>,
    /// The first prefill server's KV control (bootstrap) port, which
    /// write-mode routers query; the others follow it (default: each binds
    /// a free one).
    #[arg(long)]
    pub kv_port: Option<u16>,
    /// Enables the lifecycle admin API on every engine (with sleep mode) and
    /// on the proxy, which fans each call out to all of them; every route
    /// needs `Authorization: Bearer TOKEN`.
    #[arg(long, env = "PDKV_ADMIN_TOKEN", hide_env_values = true)]
    pub admin_token: Option<String>,
    /// The deployment's KV secret, which every KV connection and weight
    /// sync proves (made fresh for the deployment when not given; give it
    /// to share it with a trainer's `pdkv weights publish`).
    #[arg(long, env = "PDKV_KV_SECRET", hide_env_values = true)]
    pub kv_secret: Option<String>,
    /// Every engine's OpenAI routes need `Authorization: Bearer KEY`; the
    /// proxy passes the client's header on.
    #[arg(long, env = "PDKV_API_KEY", hide_env_values = true)]
    pub api_key: Option<String>,
    /// KV cache size of each server, in blocks of 16 tokens.
    #[arg(long)]
    pub num_kv_blocks: Option<usize>,
    /// Ranks each server splits the model over (tensor parallelism); each
    /// rank moves its own KV heads.
    #[arg(long, short = 't', default_value_t = 1, value_parser = clap::value_parser!(u16).range(1..=64))]
    pub tensor_parallel_size: u16,
    /// Ranks of each prefill server, when they differ from the decode
    /// servers' (heterogeneous TP: D gathers or splits the heads).
    #[arg(long, value_parser = clap::value_parser!(u16).range(1..=64))]
    pub prefill_tensor_parallel_size: Option<u16>,
    /// Ranks of each decode server, when they differ from the prefill
    /// servers'.
    #[arg(long, value_parser = clap::value_parser!(u16).range(1..=64))]
    pub decode_tensor_parallel_size: Option<u16>,
    /// Bound on the start-up (model loading included), in seconds.
    #[arg(long, default_value_t = 300)]
    pub startup_timeout: u64,
}

/// How long stopped children get to exit before SIGKILL.
const STOP_GRACE: Duration = Duration::from_secs(15);
/// Log lines of a child kept for an error report.
const TAIL_LINES: usize = 30;
/// Interval of health polls and child-exit checks.
const POLL: Duration = Duration::from_millis(200);
const HOST: &str = "127.0.0.1";

/// A child process with its stderr forwarded (prefixed) to ours, or
/// written to a log file.
pub(crate) struct Proc {
    pub(crate) name: String,
    child: Child,
    /// Its URL; empty until its `listening on` line when it chose its port.
    base: String,
    /// The address of its first `listening on http://ADDR` log line.
    listening: Arc<Mutex<Option<String>>>,
    tail: Arc<Mutex<VecDeque<String>>>,
}

/// `RUST_LOG` for a child whose `listening on` line (at `info`) we read:
/// the operator's filter, with the info lines of the two modules that print
/// it kept (only those two: a wider directive would hide other debug lines
/// the operator asked for).
fn child_log_filter() -> String {
    match std::env::var("RUST_LOG") {
        Ok(f) if !f.trim().is_empty() => format!("{f},pdkv::serve=info,pdkv::proxy_cmd=info"),
        _ => "info".to_string(),
    }
}

/// Where children's log lines go, and the name that starts this process's
/// notices about them (`pdkv up`).
#[derive(Clone, Debug)]
pub(crate) struct ChildLogs {
    pub(crate) who: &'static str,
    /// A log file per child in this directory (`prefill.log`, ...); `None`:
    /// our stderr, each line prefixed with the child's name.
    pub(crate) dir: Option<PathBuf>,
}

/// `pdkv ARGS` (this executable) as a child: stdin and stdout closed,
/// stderr piped, and SIGTERM sent to it if this process dies.
pub(crate) fn child_command(args: &[String]) -> anyhow::Result<(PathBuf, Command)> {
    let exe = std::env::current_exe().context("finding the pdkv executable")?;
    let mut cmd = Command::new(&exe);
    cmd.args(args)
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::piped());
    // SAFETY: prctl is async-signal-safe; the closure touches nothing else.
    unsafe {
        cmd.pre_exec(|| {
            if libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGTERM) != 0 {
                return Err(std::io::Error::last_os_error());
            }
            Ok(())
        });
    }
    Ok((exe, cmd))
}

impl Proc {
    /// `secrets`: environment variables set (or removed when `None`) for
    /// the child; secrets go by environment, not argv (which `ps` shows).
    /// `port` 0: the child binds a free port itself and its URL is learned
    /// from its `listening on` line (a port chosen here and bound there
    /// could be taken by another process in between).
    fn spawn(
        name: String,
        port: u16,
        args: &[String],
        secrets: &[(&str, Option<&str>)],
        logs: &ChildLogs,
    ) -> anyhow::Result<Proc> {
        let (exe, mut cmd) = child_command(args)?;
        cmd.env("RUST_LOG", child_log_filter());
        for (k, v) in secrets {
            match v {
                Some(v) => cmd.env(k, v),
                None => cmd.env_remove(k),
            };
        }
        let mut file = match &logs.dir {
            Some(dir) => {
                let path = dir.join(format!("{}.log", name.replace(' ', "-")));
                let f = std::fs::File::create(&path)
                    .with_context(|| format!("creating {}", path.display()))?;
                Some(std::io::BufWriter::new(f))
            }
            None => None,
        };
        let mut child = cmd
            .spawn()
            .with_context(|| format!("starting the {name} ({})", exe.display()))?;
        let on = match port {
            0 => "a port of its choosing".to_string(),
            p => format!("port {p}"),
        };
        eprintln!(
            "{}: started the {name} (pid {}) on {on}",
            logs.who,
            child.id()
        );
        let tail = Arc::new(Mutex::new(VecDeque::with_capacity(TAIL_LINES)));
        let listening = Arc::new(Mutex::new(None));
        if let Some(stderr) = child.stderr.take() {
            let (tail, listening) = (tail.clone(), listening.clone());
            let name = name.clone();
            std::thread::spawn(move || {
                for line in BufReader::new(stderr).lines() {
                    let Ok(line) = line else { break };
                    if let Some(addr) = listening_addr(&line) {
                        let mut l = listening.lock().unwrap_or_else(|e| e.into_inner());
                        l.get_or_insert(addr);
                    }
                    match file.as_mut() {
                        // Flushed per line: the file is read while the child runs.
                        Some(f) => {
                            let _ = writeln!(f, "{line}").and_then(|()| f.flush());
                        }
                        None => {
                            let _ = writeln!(std::io::stderr().lock(), "[{name}] {line}");
                        }
                    }
                    let mut t = tail.lock().unwrap_or_else(|e| e.into_inner());
                    if t.len() == TAIL_LINES {
                        t.pop_front();
                    }
                    t.push_back(line);
                }
            });
        }
        Ok(Proc {
            name,
            child,
            base: match port {
                0 => String::new(),
                p => format!("http://{HOST}:{p}"),
            },
            listening,
            tail,
        })
    }

    /// Its URL, once known.
    fn url(&mut self) -> Option<&str> {
        if self.base.is_empty() {
            let l = self.listening.lock().unwrap_or_else(|e| e.into_inner());
            self.base = l.clone().unwrap_or_default();
        }
        Some(self.base.as_str()).filter(|b| !b.is_empty())
    }

    pub(crate) fn pid(&self) -> u32 {
        self.child.id()
    }

    fn exited(&mut self) -> Option<ExitStatus> {
        self.child.try_wait().ok().flatten()
    }

    fn tail(&self) -> String {
        self.tail
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .iter()
            .cloned()
            .collect::<Vec<_>>()
            .join("\n")
    }

    fn terminate(&mut self) {
        if self.exited().is_none() {
            let pid = self.child.id() as libc::pid_t;
            // SAFETY: a plain syscall on our own child, not yet reaped.
            unsafe { libc::kill(pid, libc::SIGTERM) };
        }
    }
}

/// The URL of a `listening on http://ADDR` log line.
pub(crate) fn listening_addr(line: &str) -> Option<String> {
    let rest = line.split("listening on ").nth(1)?;
    let addr = rest.split_whitespace().next()?;
    addr.starts_with("http://").then(|| addr.to_string())
}

/// The ports of a deployment: the proxy's, then each server's HTTP port
/// and each prefill server's KV control port.
pub(crate) struct Ports {
    proxy: u16,
    prefill: Vec<u16>,
    decode: Vec<u16>,
    kv: Vec<u16>,
}

/// `n` ports from `first` on, or `n` zeros (each server binds a free one).
fn ports(first: Option<u16>, n: u16, what: &str) -> anyhow::Result<Vec<u16>> {
    match first {
        Some(p) => (0..n)
            .map(|i| {
                p.checked_add(i)
                    .with_context(|| format!("{what} ports from {p} run past 65535"))
            })
            .collect(),
        None => Ok(vec![0; usize::from(n)]),
    }
}

impl Ports {
    pub(crate) fn choose(args: &UpArgs) -> anyhow::Result<Ports> {
        let p = Ports {
            proxy: args.port,
            prefill: ports(args.prefill_port, args.prefill, "prefill")?,
            decode: ports(args.decode_port, args.decode, "decode")?,
            kv: ports(args.kv_port, args.prefill, "KV")?,
        };
        let mut all: Vec<u16> = [p.proxy]
            .into_iter()
            .chain(p.prefill.iter().copied())
            .chain(p.decode.iter().copied())
            .chain(p.kv.iter().copied())
            .filter(|&port| port != 0)
            .collect();
        all.sort_unstable();
        if let Some(w) = all.windows(2).find(|w| w[0] == w[1]) {
            bail!(
                "port {} would be used twice (proxy {}, prefill {:?}, decode {:?}, KV {:?})",
                w[0],
                p.proxy,
                p.prefill,
                p.decode,
                p.kv
            );
        }
        Ok(p)
    }
}

pub fn run(args: UpArgs) -> anyhow::Result<()> {
    anyhow::ensure!(
        args.admin_token.as_deref() != Some(""),
        "--admin-token must not be empty"
    );
    anyhow::ensure!(
        args.api_key.as_deref() != Some(""),
        "--api-key must not be empty"
    );
    // Resolve (and fetch) the model once, before the servers load it.
    let model = match args.model.clone() {
        Some(p) => p,
        None => fetch::default_model_path()?,
    };
    let ports = Ports::choose(&args)?;
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .context("starting the async runtime")?;
    runtime.block_on(async move {
        let mut procs: Vec<Proc> = Vec::new();
        let result = supervise(&args, &model, &ports, &mut procs).await;
        stop_all(&mut procs, "pdkv up").await;
        result
    })
}

fn serve_args(
    args: &UpArgs,
    model: &std::path::Path,
    port: u16,
    role: &str,
    kv_port: u16,
    engine_id: &str,
) -> Vec<String> {
    let config = serde_json::json!({
        "kv_connector": "pdkv",
        "kv_role": role,
        "transport": args.transport.as_str(),
        "transfer_mode": args.transfer_mode.as_str(),
        "kv_port": kv_port,
    });
    let mut v = vec![
        "serve".to_string(),
        "--model".to_string(),
        model.display().to_string(),
        "--host".to_string(),
        HOST.to_string(),
        "--port".to_string(),
        port.to_string(),
        "--kv-transfer-config".to_string(),
        config.to_string(),
        "--engine-id".to_string(),
        engine_id.to_string(),
    ];
    if let Some(n) = args.num_kv_blocks {
        v.extend(["--num-kv-blocks".to_string(), n.to_string()]);
    }
    let tp = match role {
        "kv_producer" => args.prefill_tensor_parallel_size,
        _ => args.decode_tensor_parallel_size,
    }
    .unwrap_or(args.tensor_parallel_size);
    if tp > 1 {
        v.extend(["--tensor-parallel-size".to_string(), tp.to_string()]);
    }
    if args.admin_token.is_some() {
        // The admin API is for sleeping between rollouts: sleep mode with it.
        v.push("--enable-sleep-mode".to_string());
    }
    v
}

/// The URLs of a started deployment.
pub(crate) struct Started {
    pub(crate) prefill: Vec<String>,
    pub(crate) decode: Vec<String>,
    pub(crate) proxy: String,
    /// Each prefill server's KV bootstrap port.
    pub(crate) kv: Vec<u16>,
}

/// The KV bootstrap port a prefill server at `url` listens on.
async fn bootstrap_port(client: &reqwest::Client, url: &str) -> anyhow::Result<u16> {
    let info: serde_json::Value = client
        .get(format!("{url}/kv_transfer/info"))
        .send()
        .await
        .and_then(|r| r.error_for_status())
        .with_context(|| format!("asking {url} for its KV bootstrap address"))?
        .json()
        .await
        .with_context(|| format!("reading {url}'s /kv_transfer/info"))?;
    info["bootstrap_addr"]
        .as_str()
        .and_then(|a| a.rsplit(':').next())
        .and_then(|p| p.parse().ok())
        .with_context(|| format!("{url}'s /kv_transfer/info names no bootstrap port: {info}"))
}

/// Starts the children (pushed onto `procs`: the prefill servers, the
/// decode servers, then the proxy) and waits until all are healthy, bounded
/// by `--startup-timeout`; fails when a child exits first.
pub(crate) async fn start(
    args: &UpArgs,
    model: &std::path::Path,
    ports: &Ports,
    procs: &mut Vec<Proc>,
    logs: &ChildLogs,
) -> anyhow::Result<Started> {
    let id = std::process::id();
    let token = args.admin_token.as_deref();
    // The deployment's KV secret: the one given, else made fresh for it
    // (children only learn it by environment).
    let secret = match args.kv_secret.clone() {
        Some(s) => {
            crate::serve::kv_secret(Some(&s))?;
            s
        }
        None => {
            pdkv_connector::KvSecret::generate().context("making the deployment's KV secret")?
        }
    };
    let secret = Some(secret.as_str());
    let engine_env = [
        ("PDKV_ADMIN_TOKEN", token),
        ("PDKV_API_KEY", args.api_key.as_deref()),
        ("PDKV_KV_SECRET", secret),
    ];
    let proxy_env = [
        ("PDKV_ADMIN_TOKEN", token),
        ("PDKV_API_KEY", None),
        ("PDKV_KV_SECRET", secret),
    ];
    let (np, nd) = (ports.prefill.len(), ports.decode.len());
    let name = |role: &str, i: usize, n: usize| {
        if n == 1 {
            role.to_string()
        } else {
            format!("{role} {i}")
        }
    };
    for (i, (&port, &kv)) in ports.prefill.iter().zip(&ports.kv).enumerate() {
        let a = serve_args(
            args,
            model,
            port,
            "kv_producer",
            kv,
            &format!("up-{id}-prefill-{i}"),
        );
        procs.push(Proc::spawn(
            name("prefill", i, np),
            port,
            &a,
            &engine_env,
            logs,
        )?);
    }
    for (i, &port) in ports.decode.iter().enumerate() {
        let a = serve_args(
            args,
            model,
            port,
            "kv_consumer",
            0,
            &format!("up-{id}-decode-{i}"),
        );
        procs.push(Proc::spawn(
            name("decode", i, nd),
            port,
            &a,
            &engine_env,
            logs,
        )?);
    }
    let client = reqwest::Client::builder()
        .timeout(Duration::from_secs(2))
        .build()
        .context("building the HTTP client")?;
    let deadline = Instant::now() + Duration::from_secs(args.startup_timeout);
    wait_healthy(&client, procs, deadline, logs.who).await?;
    let p_urls: Vec<String> = procs[..np].iter().map(|p| p.base.clone()).collect();
    let d_urls: Vec<String> = procs[np..].iter().map(|p| p.base.clone()).collect();
    let proxy_args = vec![
        "proxy".to_string(),
        "--prefill".to_string(),
        p_urls.join(","),
        "--decode".to_string(),
        d_urls.join(","),
        "--host".to_string(),
        HOST.to_string(),
        "--port".to_string(),
        ports.proxy.to_string(),
    ];
    procs.push(Proc::spawn(
        "proxy".to_string(),
        ports.proxy,
        &proxy_args,
        &proxy_env,
        logs,
    )?);
    wait_healthy(&client, procs, deadline, logs.who).await?;
    let mut kv = Vec::with_capacity(np);
    for url in &p_urls {
        kv.push(bootstrap_port(&client, url).await?);
    }
    Ok(Started {
        prefill: p_urls,
        decode: d_urls,
        proxy: procs.last().map(|p| p.base.clone()).unwrap_or_default(),
        kv,
    })
}

/// Starts the children (pushed onto `procs`), reports readiness, and runs
/// until a signal (`Ok`) or a child's exit (`Err`).
async fn supervise(
    args: &UpArgs,
    model: &std::path::Path,
    ports: &Ports,
    procs: &mut Vec<Proc>,
) -> anyhow::Result<()> {
    let signal = wait_for_signal();
    tokio::pin!(signal);
    let token = args.admin_token.as_deref();
    let logs = ChildLogs {
        who: "pdkv up",
        dir: None,
    };
    let started = tokio::select! {
        r = start(args, model, ports, procs, &logs) => r?,
        _ = &mut signal => {
            eprintln!("pdkv up: interrupted during start-up");
            return Ok(());
        }
    };
    let Started {
        prefill: p_urls,
        decode: d_urls,
        proxy: url,
        kv: kv_ports,
    } = started;
    let (np, nd) = (p_urls.len(), d_urls.len());
    // Written whole, errors ignored: a reader that went away must not stop
    // the deployment.
    let mut ready = format!(
        "pdkv up: ready ({np} prefill, {nd} decode; transport {}, transfer mode {}; admin API {})\n",
        args.transport.as_str(),
        args.transfer_mode.as_str(),
        if token.is_some() { "on" } else { "off" }
    );
    for (i, (u, kv)) in p_urls.iter().zip(&kv_ports).enumerate() {
        ready.push_str(&format!("prefill {i}: {u} (KV bootstrap port {kv})\n"));
    }
    for (i, u) in d_urls.iter().enumerate() {
        ready.push_str(&format!("decode {i}: {u}\n"));
    }
    ready.push_str(&format!("proxy: {url}\ntry:\n"));
    ready.push_str(&format!(
        "  curl -s {url}/v1/chat/completions -H 'Content-Type: application/json' \\\n    -d '{{\"messages\":[{{\"role\":\"user\",\"content\":\"Name the capital city of France.\"}}],\"max_tokens\":32}}'\n"
    ));
    let _ = std::io::stdout().lock().write_all(ready.as_bytes());
    let _ = std::io::stdout().flush();

    let mut tick = tokio::time::interval(POLL);
    loop {
        tokio::select! {
            _ = &mut signal => {
                eprintln!("pdkv up: stopping");
                return Ok(());
            }
            _ = tick.tick() => check_children(procs)?,
        }
    }
}

/// Fails when a child has exited, with its last log lines.
pub(crate) fn check_children(procs: &mut [Proc]) -> anyhow::Result<()> {
    for p in procs.iter_mut() {
        if let Some(status) = p.exited() {
            bail!(
                "the {} exited early ({status}); its last log lines:\n{}",
                p.name,
                p.tail()
            );
        }
    }
    Ok(())
}

/// Waits until every child answers `GET /health` with 200, or fails at the
/// deadline or when a child exits.
async fn wait_healthy(
    client: &reqwest::Client,
    procs: &mut [Proc],
    deadline: Instant,
    who: &str,
) -> anyhow::Result<()> {
    let started = Instant::now();
    let mut last_report = Instant::now();
    loop {
        check_children(procs)?;
        let mut waiting = Vec::new();
        for p in procs.iter_mut() {
            let ok = match p.url() {
                Some(base) => client
                    .get(format!("{base}/health"))
                    .send()
                    .await
                    .is_ok_and(|r| r.status().is_success()),
                None => false,
            };
            if !ok {
                waiting.push(p.name.clone());
            }
        }
        if waiting.is_empty() {
            return Ok(());
        }
        if Instant::now() >= deadline {
            bail!(
                "not healthy within the start-up timeout: {}",
                waiting.join(", ")
            );
        }
        if last_report.elapsed() >= Duration::from_secs(5) {
            last_report = Instant::now();
            eprintln!(
                "{who}: waiting for {} ({}s)",
                waiting.join(", "),
                started.elapsed().as_secs()
            );
        }
        tokio::time::sleep(POLL).await;
    }
}

/// SIGTERM to every child (the proxy first), a bounded wait, then SIGKILL;
/// every child is reaped.
pub(crate) async fn stop_all(procs: &mut [Proc], who: &str) {
    for p in procs.iter_mut().rev() {
        p.terminate();
    }
    let deadline = Instant::now() + STOP_GRACE;
    while Instant::now() < deadline && procs.iter_mut().any(|p| p.exited().is_none()) {
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    for p in procs.iter_mut() {
        match p.exited() {
            Some(status) if status.success() => {}
            Some(status) => eprintln!("{who}: the {} exited with {status}", p.name),
            None => {
                eprintln!(
                    "{who}: the {} did not stop within {}s; killing it",
                    p.name,
                    STOP_GRACE.as_secs()
                );
                let _ = p.child.kill();
                let _ = p.child.wait();
            }
        }
    }
}
