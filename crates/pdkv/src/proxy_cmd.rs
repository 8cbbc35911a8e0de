//! `pdkv proxy`: the P/D proxy ([`pdkv_server::proxy`]) in front of prefill
//! and decode servers, until Ctrl-C or SIGTERM.

use std::time::Duration;

use anyhow::Context;
use clap::Args;
use pdkv_server::proxy::{Proxy, ProxyConfig};

/// Kept at its old path for the commands that still name it here.
pub(crate) use crate::common::wait_for_signal;

#[derive(Args, Debug)]
pub struct ProxyArgs {
    /// Prefill server base URLs, comma-separated (`http://127.0.0.1:8100`).
    #[arg(long, value_delimiter = ',', required = true)]
    pub prefill: Vec<String>,
    /// Decode server base URLs, comma-separated.
    #[arg(long, value_delimiter = ',', required = true)]
    pub decode: Vec<String>,
    /// Address to listen on (`0.0.0.0`: every interface).
    #[arg(long, default_value = "127.0.0.1")]
    pub host: String,
    /// TCP port; 0 picks a free one (the log shows which).
    #[arg(long, default_value_t = 8000)]
    pub port: u16,
    /// Bound on a whole upstream generation request, in seconds.
    #[arg(long, default_value_t = 600)]
    pub request_timeout: u64,
    /// Time between health checks of the backends, in milliseconds.
    #[arg(long, default_value_t = 2000)]
    pub health_interval_ms: u64,
    /// Enables the deployment's lifecycle admin API (`/pause`, `/sleep`,
    /// `/wake_up`, `/update_weights`, ... fanned out to every engine behind
    /// the proxy), each route requiring `Authorization: Bearer TOKEN`; the
    /// engines must have been started with the same token.
    #[arg(long, env = "PDKV_ADMIN_TOKEN", hide_env_values = true)]
    pub admin_token: Option<String>,
    /// Dev mode, as vLLM's `VLLM_SERVER_DEV_MODE=1`: the deployment's
    /// lifecycle and weight routes are mounted without `--admin-token`,
    /// open to anyone who reaches the port (the engines must run in dev
    /// mode too).
    #[arg(long, env = "PDKV_SERVER_DEV_MODE", value_parser = clap::builder::BoolishValueParser::new())]
    pub dev_mode: bool,
    /// How long, in seconds, a request a decode engine refused because it
    /// is paused or asleep waits for one that serves before it is sent
    /// again (as an engine holds requests until `/resume`); 0 passes the
    /// retryable 503 on at once.
    #[arg(long, default_value_t = 600.0)]
    pub pause_wait_timeout_s: f64,
    /// How many times one streamed request moves to another decode engine
    /// (or the same, restarted) after losing its own mid-stream: the new
    /// one computes the prompt and the tokens the client already has and
    /// continues the stream. 0 ends such a stream with an error event.
    #[arg(long, default_value_t = 3)]
    pub max_resumes: u32,
    /// How long, in seconds, a stream that lost its decode engine waits for
    /// one that serves before it fails.
    #[arg(long, default_value_t = 30.0)]
    pub resume_wait_s: f64,
    /// The deployment's KV secret (as the engines' `--kv-secret`): the proxy
    /// proves it when it asks a prefill engine to drop a transfer.
    #[arg(long, env = "PDKV_KV_SECRET", hide_env_values = true)]
    pub kv_secret: Option<String>,
    #[command(flatten)]
    pub http: crate::http_args::HttpArgs,
}

pub fn run(args: ProxyArgs) -> anyhow::Result<()> {
    anyhow::ensure!(
        args.request_timeout > 0,
        "--request-timeout must be at least 1 second"
    );
    anyhow::ensure!(
        args.health_interval_ms > 0,
        "--health-interval-ms must be at least 1"
    );
    let mut config = ProxyConfig::new(args.prefill, args.decode);
    config.request_timeout = Duration::from_secs(args.request_timeout);
    config.health_interval = Duration::from_millis(args.health_interval_ms);
    config.admin_token = args.admin_token;
    config.dev_mode = args.dev_mode;
    anyhow::ensure!(
        args.pause_wait_timeout_s.is_finite()
            && (0.0..=86_400.0).contains(&args.pause_wait_timeout_s),
        "--pause-wait-timeout-s must be a number of seconds from 0 to 86400"
    );
    config.pause_wait = Duration::from_secs_f64(args.pause_wait_timeout_s);
    anyhow::ensure!(
        args.resume_wait_s.is_finite() && (0.0..=3_600.0).contains(&args.resume_wait_s),
        "--resume-wait-s must be a number of seconds from 0 to 3600"
    );
    config.resume_wait = Duration::from_secs_f64(args.resume_wait_s);
    config.max_resumes = args.max_resumes;
    config.kv_secret = crate::common::kv_secret(args.kv_secret.as_deref())?;
    config.http = args.http.limits()?;
    let proxy = Proxy::new(config)?;
    let addr = crate::common::resolve_addr(&args.host, args.port)?;
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .context("starting the async runtime")?;
    runtime.block_on(async move {
        let listener = pdkv_transfer::listen::bind(addr)
            .await
            .with_context(|| format!("binding {addr}"))?;
        let local = listener.local_addr().context("reading the bound address")?;
        for b in proxy.backends() {
            tracing::info!(role = %b.role, url = %b.url, "backend");
        }
        tracing::info!("proxy listening on http://{local}");
        proxy
            .serve(listener, async {
                wait_for_signal().await;
                tracing::info!("shutting down");
            })
            .await
            .context("serving HTTP")?;
        tracing::info!("stopped");
        Ok(())
    })
}
