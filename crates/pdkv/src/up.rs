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

use std::io::Write;
use std::path::PathBuf;
use std::time::Duration;

use anyhow::Context;
use clap::Args;
use pdkv_deploy::{EngineWiring, LogSink, Logs, PortPlan, Spec};

use crate::fetch;
use crate::proxy_cmd::wait_for_signal;

pub use pdkv_deploy::{stop_all, Proc, Started, TransferMode, Transport};

/// What a P/D deployment serves and how its KV moves: the flags `up`,
/// `bench serve` and `lifecycle` share.
#[derive(Args, Clone, Debug)]
pub struct DeploymentArgs {
    /// A `.gguf` file or a checkpoint directory (default: SmolLM2-135M-Instruct
    /// from the model cache, fetched if missing).
    #[arg(long)]
    pub model: Option<PathBuf>,
    /// How KV moves from the prefill to the decode servers.
    #[arg(long, value_enum, default_value = "tcp")]
    pub transport: Transport,
    /// Who moves the KV bytes: P writes into D's blocks, or D reads P's.
    #[arg(long, value_enum, default_value = "write")]
    pub transfer_mode: TransferMode,
}

#[derive(Args, Debug)]
pub struct UpArgs {
    #[command(flatten)]
    pub deployment: DeploymentArgs,
    /// How many prefill servers.
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u16).range(1..=64))]
    pub prefill: u16,
    /// How many decode servers.
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u16).range(1..=64))]
    pub decode: u16,
    /// What a decode server does with a request whose KV load failed:
    /// `recompute` its prompt, or `fail` it (a 5xx naming the cause); a
    /// load P ended on purpose recomputes under either (default: the
    /// connector's).
    #[arg(long, value_enum)]
    pub kv_load_failure_policy: Option<pdkv_deploy::FailurePolicy>,
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
    /// Dev mode, as vLLM's `VLLM_SERVER_DEV_MODE=1`: every engine and the
    /// proxy mount the lifecycle and weight routes (with sleep mode) even
    /// without `--admin-token`, open to anyone who reaches the ports. For
    /// RL frameworks that call them without credentials (SkyRL, AReaL).
    #[arg(long, env = "PDKV_SERVER_DEV_MODE", value_parser = clap::builder::BoolishValueParser::new())]
    pub dev_mode: bool,
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
    /// Every server's KV cache element type (see `pdkv serve
    /// --kv-cache-dtype`).
    #[arg(long, default_value = "auto")]
    pub kv_cache_dtype: pdkv_model::KvDtype,
    /// The decode servers' speculative decoding (see `pdkv serve
    /// --speculative-config`).
    #[arg(long)]
    pub speculative_config: Option<String>,
    /// Lets chat requests use `tool_choice: "auto"` on every server (see
    /// `pdkv serve --enable-auto-tool-choice`).
    #[arg(long, requires = "tool_call_parser")]
    pub enable_auto_tool_choice: bool,
    /// How the servers read calls with `--enable-auto-tool-choice`
    /// (`hermes` or `llama3_json`).
    #[arg(long, requires = "enable_auto_tool_choice")]
    pub tool_call_parser: Option<pdkv_server::tools::Parser>,
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
    /// The format every server serves the model's matrices in (see
    /// `pdkv serve --weight-format`).
    #[arg(long, default_value = "auto")]
    pub weight_format: pdkv_model::WeightFormat,
    /// Bound on the start-up (model loading included), in seconds.
    #[arg(long, default_value_t = 300)]
    pub startup_timeout: u64,
    /// Every server's HTTP bounds (the proxy's and the engines').
    #[command(flatten)]
    pub http: crate::http_args::HttpArgs,
}

/// Interval of child-exit checks once the deployment is up.
const POLL: Duration = Duration::from_millis(200);

/// Where children's log lines go, and the name that starts this process's
/// notices about them (`pdkv up`).
#[derive(Clone, Debug)]
pub(crate) struct ChildLogs {
    pub(crate) who: &'static str,
    /// A log file per child in this directory (`prefill.log`, ...); `None`:
    /// our stderr, each line prefixed with the child's name.
    pub(crate) dir: Option<PathBuf>,
}

impl ChildLogs {
    pub(crate) fn logs(&self) -> Logs {
        Logs {
            who: self.who,
            sink: match &self.dir {
                Some(d) => LogSink::Dir(d.clone()),
                None => LogSink::Stderr,
            },
        }
    }
}

/// The ports of `up`'s deployment, from its arguments.
pub(crate) struct Ports(pdkv_deploy::Ports);

impl Ports {
    pub(crate) fn choose(args: &UpArgs) -> anyhow::Result<Ports> {
        Ok(Ports(pdkv_deploy::Ports::choose(&PortPlan {
            proxy: args.port,
            prefill: args.prefill,
            decode: args.decode,
            prefill_port: args.prefill_port,
            decode_port: args.decode_port,
            kv_port: args.kv_port,
        })?))
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
    let ports = Ports::choose(&args)?;
    // A taken port fails now, not after every engine loaded the model.
    ports.0.check_free()?;
    // Resolve (and fetch) the model once, before the servers load it.
    let model = match args.deployment.model.clone() {
        Some(p) => p,
        None => fetch::default_model_path()?,
    };
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

/// The deployment `args` describe, with this executable in every child.
fn spec(args: &UpArgs, model: &std::path::Path, ports: &Ports) -> anyhow::Result<Spec> {
    // A given KV secret is checked here, as `pdkv serve` checks it.
    if let Some(s) = &args.kv_secret {
        crate::serve::kv_secret(Some(s))?;
    }
    let mut wiring = EngineWiring::new(args.deployment.transport, args.deployment.transfer_mode);
    wiring.kv_load_failure_policy = args.kv_load_failure_policy;
    wiring.num_kv_blocks = args.num_kv_blocks;
    wiring.kv_cache_dtype =
        (args.kv_cache_dtype != pdkv_model::KvDtype::AUTO).then(|| args.kv_cache_dtype.to_string());
    wiring.tensor_parallel_size = args.tensor_parallel_size;
    wiring.prefill_tensor_parallel_size = args.prefill_tensor_parallel_size;
    wiring.decode_tensor_parallel_size = args.decode_tensor_parallel_size;
    wiring.sleep_mode = args.admin_token.is_some() || args.dev_mode;
    wiring.weight_format = (args.weight_format != pdkv_model::WeightFormat::AsStored)
        .then(|| args.weight_format.to_string());
    if let Some(c) = &args.speculative_config {
        // Checked here, as `pdkv serve` checks it.
        c.parse::<pdkv_engine::SpeculativeConfig>()
            .map_err(|e| anyhow::anyhow!(e))?;
        wiring.speculative_config = Some(c.clone());
    }
    wiring.tool_call_parser = args.tool_call_parser.map(|p| p.to_string());
    // Checked here, as `pdkv serve` and `pdkv proxy` check them.
    args.http.limits()?;
    wiring.http = Some(pdkv_deploy::HttpBounds {
        max_connections: args.http.max_connections,
        header_timeout_s: args.http.header_timeout_s,
    });
    Ok(Spec {
        exe: std::env::current_exe().context("finding the pdkv executable")?,
        model: model.to_path_buf(),
        wiring,
        ports: ports.0.clone(),
        startup_timeout: Duration::from_secs(args.startup_timeout),
        admin_token: args.admin_token.clone(),
        kv_secret: args.kv_secret.clone(),
        api_key: args.api_key.clone(),
        engine_id_prefix: format!("up-{}", std::process::id()),
        proxy_health_interval_ms: None,
        dev_mode: args.dev_mode,
    })
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
    let spec = spec(args, model, ports)?;
    Ok(pdkv_deploy::start(&spec, procs, &logs.logs()).await?)
}

/// The name clients send as `model`, from the proxy's `/v1/models`
/// (`"?"` when it does not answer in time: the deployment still runs).
async fn served_model_name(url: &str) -> String {
    let ask = async {
        let v: serde_json::Value = reqwest::get(format!("{url}/v1/models"))
            .await
            .ok()?
            .json()
            .await
            .ok()?;
        v["data"][0]["id"].as_str().map(str::to_string)
    };
    tokio::time::timeout(Duration::from_secs(5), ask)
        .await
        .ok()
        .flatten()
        .unwrap_or_else(|| "?".into())
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
        ..
    } = started;
    let (np, nd) = (p_urls.len(), d_urls.len());
    let model_name = served_model_name(&url).await;
    // Written whole, errors ignored: a reader that went away must not stop
    // the deployment.
    let mut ready = format!(
        "pdkv up: ready ({np} prefill, {nd} decode; transport {}, transfer mode {}; admin API {})\n",
        args.deployment.transport.as_str(),
        args.deployment.transfer_mode.as_str(),
        match (token.is_some(), args.dev_mode) {
            (true, _) => "on",
            (false, true) => "on, open (dev mode)",
            (false, false) => "off",
        }
    );
    for (i, (u, kv)) in p_urls.iter().zip(&kv_ports).enumerate() {
        ready.push_str(&format!("prefill {i}: {u} (KV bootstrap port {kv})\n"));
    }
    for (i, u) in d_urls.iter().enumerate() {
        ready.push_str(&format!("decode {i}: {u}\n"));
    }
    ready.push_str(&format!("proxy: {url}\nmodel: {model_name}\ntry:\n"));
    ready.push_str(&format!(
        "  curl -s {url}/v1/chat/completions -H 'Content-Type: application/json' \\\n    -d '{{\"model\":\"{model_name}\",\"messages\":[{{\"role\":\"user\",\"content\":\"Name the capital city of France.\"}}],\"max_tokens\":32}}'\n"
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
    Ok(pdkv_deploy::check_children(procs)?)
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;

    #[derive(Parser)]
    struct Cli {
        #[command(flatten)]
        up: UpArgs,
    }

    /// `--kv-load-failure-policy` reaches every engine's
    /// `--kv-transfer-config`; without it the connector's default stands.
    #[test]
    fn the_failure_policy_reaches_the_engines() {
        let dir = std::path::Path::new("/m");
        let config = |argv: &[&str]| {
            let args = Cli::parse_from([&["up"][..], argv].concat()).up;
            let ports = Ports::choose(&args).unwrap();
            let s = spec(&args, dir, &ports).unwrap();
            let serve = pdkv_deploy::serve_args(
                &s.wiring,
                dir,
                pdkv_deploy::EngineRole::Decode,
                0,
                0,
                "d0",
            );
            let i = serve
                .iter()
                .position(|a| a == "--kv-transfer-config")
                .unwrap();
            serde_json::from_str::<serde_json::Value>(&serve[i + 1]).unwrap()
        };
        assert_eq!(
            config(&["--kv-load-failure-policy", "fail"])["kv_load_failure_policy"],
            "fail"
        );
        assert_eq!(
            config(&["--kv-load-failure-policy", "recompute"])["kv_load_failure_policy"],
            "recompute"
        );
        assert!(config(&[]).get("kv_load_failure_policy").is_none());
    }

    /// `--max-connections` and `--header-timeout-s` reach every engine and
    /// the proxy; a value a server would refuse is refused before anything
    /// starts, naming the flag.
    #[test]
    fn the_http_bounds_reach_every_server() {
        use pdkv_deploy::EngineRole;
        let dir = std::path::Path::new("/m");
        let argv = [
            "up",
            "--max-connections",
            "100",
            "--header-timeout-s",
            "2.5",
        ];
        let args = Cli::parse_from(argv).up;
        let ports = Ports::choose(&args).unwrap();
        let s = spec(&args, dir, &ports).unwrap();
        let flags = |v: &[String]| {
            let at = |n: &str| v.iter().position(|a| a == n).map(|i| v[i + 1].clone());
            (at("--max-connections"), at("--header-timeout-s"))
        };
        let want = (Some("100".to_string()), Some("2.5".to_string()));
        for role in [
            EngineRole::Prefill,
            EngineRole::Decode,
            EngineRole::Colocated,
        ] {
            let serve = pdkv_deploy::serve_args(&s.wiring, dir, role, 0, 0, "e0");
            assert_eq!(flags(&serve), want, "{role:?}");
        }
        let urls = ["http://127.0.0.1:1".to_string()];
        let proxy = pdkv_deploy::proxy_args(&urls, &urls, 0, None, s.wiring.http);
        assert_eq!(flags(&proxy), want);
        for bad in [["--header-timeout-s", "0"], ["--max-connections", "0"]] {
            let a = Cli::parse_from([&["up"][..], &bad[..]].concat()).up;
            let err = spec(&a, dir, &ports).unwrap_err().to_string();
            assert!(err.contains(bad[0]), "{err}");
        }
    }

    /// `--speculative-config` reaches the decode servers, checked, and not
    /// the prefill servers (they sample one token).
    #[test]
    fn the_speculative_config_reaches_the_decode_servers_only() {
        let dir = std::path::Path::new("/m");
        let json = r#"{"method":"ngram","num_speculative_tokens":3}"#;
        let args = Cli::parse_from(["up", "--speculative-config", json]).up;
        let ports = Ports::choose(&args).unwrap();
        let s = spec(&args, dir, &ports).unwrap();
        let flag = |role| {
            let serve = pdkv_deploy::serve_args(&s.wiring, dir, role, 0, 0, "e0");
            serve
                .iter()
                .position(|a| a == "--speculative-config")
                .map(|i| serve[i + 1].clone())
        };
        assert_eq!(flag(pdkv_deploy::EngineRole::Decode).as_deref(), Some(json));
        assert_eq!(flag(pdkv_deploy::EngineRole::Prefill), None);
        let bad = Cli::parse_from(["up", "--speculative-config", r#"{"method":"eagle"}"#]).up;
        let err = spec(&bad, dir, &ports).unwrap_err().to_string();
        assert!(err.contains("\"eagle\" is not supported"), "{err}");
    }

    /// The tool call parser reaches every server, prefill ones too (they
    /// read the same chat requests), with the flag that enables it.
    #[test]
    fn the_tool_call_parser_reaches_every_server() {
        let dir = std::path::Path::new("/m");
        let args = Cli::parse_from([
            "up",
            "--enable-auto-tool-choice",
            "--tool-call-parser",
            "hermes",
        ])
        .up;
        let ports = Ports::choose(&args).unwrap();
        let s = spec(&args, dir, &ports).unwrap();
        for role in [
            pdkv_deploy::EngineRole::Prefill,
            pdkv_deploy::EngineRole::Decode,
        ] {
            let serve = pdkv_deploy::serve_args(&s.wiring, dir, role, 0, 0, "e0");
            let at = serve
                .iter()
                .position(|a| a == "--tool-call-parser")
                .expect("the parser");
            assert_eq!(serve[at + 1], "hermes");
            assert!(serve.contains(&"--enable-auto-tool-choice".to_string()));
        }
        assert!(
            Cli::try_parse_from(["up", "--tool-call-parser", "hermes"]).is_err(),
            "both flags or none"
        );
    }
}
