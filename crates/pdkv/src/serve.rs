//! `pdkv serve`: load a model, start the engine and the HTTP server, and shut
//! both down on Ctrl-C or SIGTERM.
//!
//! Shutdown order: the signal stops the engine first (running requests end
//! with finish reason `abort`, so open streams close promptly), then the
//! server stops accepting and waits for the open connections.

use std::net::SocketAddr;
use std::path::PathBuf;

use anyhow::Context;
use clap::Args;
use pdkv_engine::{Engine, EngineConfig, EngineHandle, KvConnector};
use pdkv_server::AppState;
use pdkv_vmem::Pool;

use crate::progress;

/// Kept at its old path for the commands that still name it here.
pub(crate) use crate::common::kv_secret;

#[derive(Args, Debug)]
pub struct ServeArgs {
    /// A `.gguf` file or a Hugging Face checkpoint directory (default:
    /// SmolLM2-135M-Instruct from the model cache, fetched if missing).
    #[arg(long)]
    pub model: Option<PathBuf>,
    /// Address to listen on (`0.0.0.0`: every interface).
    #[arg(long, default_value = "127.0.0.1")]
    pub host: String,
    /// TCP port; 0 picks a free one (the log shows which).
    #[arg(long, default_value_t = 8000)]
    pub port: u16,
    /// Most sequences in one engine step.
    #[arg(long, default_value_t = 32)]
    pub max_num_seqs: usize,
    /// Most tokens computed in one engine step.
    #[arg(long, default_value_t = 512)]
    pub max_num_batched_tokens: usize,
    /// KV cache size in blocks of 16 tokens (512 blocks = 8192 tokens).
    #[arg(long, default_value_t = 512)]
    pub num_kv_blocks: usize,
    /// The KV cache's element type: `f16` or `bf16` keeps half the bytes a
    /// token (memory, and every P/D transfer), `q8_0` 34 bytes per 32
    /// values (about a quarter of f32's), `f32` the activations' precision;
    /// `auto` is f16. P and D must agree (D refuses P's blocks of another
    /// layout, naming both).
    #[arg(long, default_value = "auto")]
    pub kv_cache_dtype: pdkv_model::KvDtype,
    /// Longest prompt + output in tokens (default: the model's context).
    #[arg(long)]
    pub max_model_len: Option<usize>,
    /// The model name clients use (default: the checkpoint's name).
    #[arg(long)]
    pub served_model_name: Option<String>,
    /// Turns the prefix cache off: every request computes its whole
    /// prompt, and finished requests' KV blocks are not kept for reuse.
    #[arg(long)]
    pub no_prefix_caching: bool,
    /// Enables the lifecycle admin API (/pause, /sleep, /wake_up,
    /// /update_weights, ...), each route requiring `Authorization: Bearer
    /// TOKEN`. Without it those routes do not exist.
    #[arg(long, env = "PDKV_ADMIN_TOKEN", hide_env_values = true)]
    pub admin_token: Option<String>,
    /// Dev mode, as vLLM's `VLLM_SERVER_DEV_MODE=1`: the lifecycle and
    /// weight routes are mounted (with sleep mode) even without
    /// `--admin-token`, open to anyone who reaches the port. For RL
    /// frameworks that call them without credentials (SkyRL, AReaL).
    #[arg(long, env = "PDKV_SERVER_DEV_MODE", value_parser = clap::builder::BoolishValueParser::new())]
    pub dev_mode: bool,
    /// Requires `Authorization: Bearer KEY` on the OpenAI routes (/v1/*,
    /// /tokenize, /detokenize), as vLLM's --api-key; /health, /metrics and
    /// /version stay open.
    #[arg(long, env = "PDKV_API_KEY", hide_env_values = true)]
    pub api_key: Option<String>,
    /// KV connector configuration (JSON) for prefill/decode disaggregation,
    /// e.g. `{"kv_connector":"pdkv","kv_role":"kv_producer","transport":"tcp"}`.
    #[arg(long)]
    pub kv_transfer_config: Option<String>,
    /// The deployment's KV secret (at least 16 bytes; every P, D and proxy
    /// of a deployment gets the same): each KV connection opens with a
    /// handshake in which both ends prove they hold it. Without one the KV
    /// ports admit any process that speaks the handshake. Give it by
    /// environment rather than on the command line, which `ps` shows.
    #[arg(long, env = "PDKV_KV_SECRET", hide_env_values = true)]
    pub kv_secret: Option<String>,
    /// This engine's id, which peers check during the KV handshake
    /// (default: a random one).
    #[arg(long)]
    pub engine_id: Option<String>,
    /// Allows sleep and KV release with a KV connector; a connector that
    /// cannot release and restore its registrations is refused at start-up.
    /// On whenever `--admin-token` is given and the connector supports it.
    #[arg(long)]
    pub enable_sleep_mode: bool,
    /// How long, in seconds, a new request waits for `/resume` while the
    /// engine is paused (in any mode, asleep included), as vLLM holds
    /// requests during a pause; past it the request gets a retryable 503.
    /// 0 refuses such requests at once.
    #[arg(long, default_value_t = 600.0)]
    pub pause_wait_timeout_s: f64,
    /// Bound, in seconds, on reading a checkpoint for `/update_weights`
    /// (off the engine's thread: it serves its current weights meanwhile);
    /// a read that stalls past it is a 504 and the weights stay.
    #[arg(long, default_value_t = 300.0)]
    pub checkpoint_read_timeout_s: f64,
    /// Bound, in seconds, on releasing KV held by transfers before a cache
    /// reset and on the connector's release of its registrations.
    #[arg(long, default_value_t = 5.0)]
    pub kv_release_timeout_s: f64,
    /// Ranks the model is split over (tensor parallelism), each with its
    /// own share of the weights and KV heads, its own memory pool and its
    /// own math threads (the machine's cores divided among them). The
    /// model needs at least as many KV heads as ranks. With
    /// `--kv-transfer-config` each rank moves its own heads' KV, and prefill
    /// and decode servers may have different numbers of ranks.
    #[arg(long, short = 't', default_value_t = 1)]
    pub tensor_parallel_size: usize,
    /// Speculative decoding, as vLLM spells it: `{"method": "ngram",
    /// "num_speculative_tokens": k, "prompt_lookup_max": n,
    /// "prompt_lookup_min": m}` (n-gram lookup in the sequence itself; max
    /// defaults to 5 (or min), min to 2 (or max if smaller)). Each decoding
    /// sequence proposes up to k tokens a step and keeps those the model
    /// confirms: the output is the output without it, greedy or seeded.
    #[arg(long)]
    pub speculative_config: Option<pdkv_engine::SpeculativeConfig>,
    /// Lets chat requests use `tool_choice: "auto"`: the model writes calls
    /// in its own format and `--tool-call-parser` reads them (both flags
    /// together, as vLLM spells them).
    #[arg(long, requires = "tool_call_parser")]
    pub enable_auto_tool_choice: bool,
    /// How calls are read with `--enable-auto-tool-choice`: `hermes`
    /// (`<tool_call>{..}</tool_call>`, Qwen2.5/Qwen3/Hermes) or
    /// `llama3_json` (a bare `{"name", "parameters"}` object, Llama 3.1+).
    #[arg(long, requires = "enable_auto_tool_choice")]
    pub tool_call_parser: Option<pdkv_server::tools::Parser>,
    /// The format the model's matrices are served in: `auto` keeps the
    /// checkpoint's (a GGUF file's blocks, a Hugging Face checkpoint's
    /// BF16/F16); otherwise one of f32, f16, bf16, q8_0, q4_0, q4_1, q5_0,
    /// q5_1, q4_k, q5_k, q6_k, converted on load as a reload of a Hugging
    /// Face checkpoint into a model of that format converts it. Norms stay
    /// f32; the LM head and rows that are not whole blocks follow
    /// llama.cpp's choices for a model quantised to one type.
    #[arg(long, default_value = "auto")]
    pub weight_format: pdkv_model::WeightFormat,
    #[command(flatten)]
    pub http: crate::http_args::HttpArgs,
}

pub fn run(args: ServeArgs) -> anyhow::Result<()> {
    let mut config = engine_config(&args)?;
    let addr = crate::common::resolve_addr(&args.host, args.port)?;
    // The connector is built (and a bad configuration refused) before the
    // model loads.
    let connector = build_connector(&args, &mut config)?;
    let started = std::time::Instant::now();
    let pool = Pool::default();
    let (_, model) = progress::load_model_as(args.model.clone(), args.weight_format, &pool)?;
    let weights = pool.device_bytes().get(pdkv_vmem::Tag::Weights);
    let huge = model.model.weights().region.huge_page_bytes();
    tracing::info!(
        name = %model.name,
        weights_mib = weights / (1024 * 1024),
        huge_pages_mib = huge / (1024 * 1024),
        secs = format!("{:.2}", started.elapsed().as_secs_f64()),
        "model loaded"
    );
    let served_name = args
        .served_model_name
        .clone()
        .unwrap_or_else(|| model.name.clone());
    let engine = Engine::start_with_connector(model, pool, config, connector)
        .context("starting the engine")?;
    tracing::info!(
        kv_blocks = engine.config().num_kv_blocks,
        max_model_len = engine.max_model_len(),
        "engine started"
    );

    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .context("starting the async runtime")?;
    let limits = args.http.limits()?;
    let secret = kv_secret(args.kv_secret.as_deref())?;
    let result = runtime.block_on(serve(
        addr,
        engine.clone(),
        served_name,
        (args.admin_token, args.api_key, args.dev_mode),
        (
            std::time::Duration::from_secs_f64(args.pause_wait_timeout_s),
            std::time::Duration::from_secs_f64(args.checkpoint_read_timeout_s),
        ),
        secret,
        (limits, args.tool_call_parser),
    ));
    engine.shutdown();
    result
}

/// The engine's configuration from the flags, checked.
fn engine_config(args: &ServeArgs) -> anyhow::Result<EngineConfig> {
    let config = EngineConfig {
        max_num_seqs: args.max_num_seqs,
        max_num_batched_tokens: args.max_num_batched_tokens,
        num_kv_blocks: args.num_kv_blocks,
        kv_cache_dtype: args.kv_cache_dtype,
        enable_prefix_caching: !args.no_prefix_caching,
        max_model_len: args.max_model_len,
        enable_sleep_mode: args.enable_sleep_mode,
        kv_release_timeout: std::time::Duration::from_secs_f64(args.kv_release_timeout_s),
        tensor_parallel_size: args.tensor_parallel_size,
        speculative: args.speculative_config,
    };
    anyhow::ensure!(
        args.kv_release_timeout_s.is_finite() && args.kv_release_timeout_s > 0.0,
        "--kv-release-timeout-s must be a positive number of seconds"
    );
    anyhow::ensure!(
        args.pause_wait_timeout_s.is_finite()
            && (0.0..=86_400.0).contains(&args.pause_wait_timeout_s),
        "--pause-wait-timeout-s must be a number of seconds from 0 to 86400"
    );
    anyhow::ensure!(
        args.checkpoint_read_timeout_s.is_finite()
            && args.checkpoint_read_timeout_s > 0.0
            && args.checkpoint_read_timeout_s <= 86_400.0,
        "--checkpoint-read-timeout-s must be a positive number of seconds up to 86400"
    );
    anyhow::ensure!(config.max_num_seqs > 0, "--max-num-seqs must be at least 1");
    anyhow::ensure!(
        config.max_num_batched_tokens > 0,
        "--max-num-batched-tokens must be at least 1"
    );
    anyhow::ensure!(
        config.num_kv_blocks > 0,
        "--num-kv-blocks must be at least 1"
    );
    anyhow::ensure!(
        config.tensor_parallel_size > 0,
        "--tensor-parallel-size must be at least 1"
    );
    if args.admin_token.as_deref() == Some("") {
        anyhow::bail!(
            "--admin-token (or PDKV_ADMIN_TOKEN) is empty; give a secret or leave it unset"
        );
    }
    if args.api_key.as_deref() == Some("") {
        anyhow::bail!("--api-key (or PDKV_API_KEY) is empty; give a key or leave it unset");
    }
    Ok(config)
}

/// The KV connector `--kv-transfer-config` describes (`None` without one);
/// `config` gets the sleep mode that goes with it.
fn build_connector(
    args: &ServeArgs,
    config: &mut EngineConfig,
) -> anyhow::Result<Option<Box<dyn KvConnector>>> {
    let connector = match &args.kv_transfer_config {
        Some(json) => {
            let engine_id = args.engine_id.clone().unwrap_or_else(random_engine_id);
            let secret = kv_secret(args.kv_secret.as_deref())?;
            let c = pdkv_connector::build_with_secret(json, &engine_id, &secret)
                .context("--kv-transfer-config")?;
            if args.enable_sleep_mode && !c.supports_sleep_mode() {
                anyhow::bail!(
                    "--enable-sleep-mode: KV connector {} does not support sleep mode (it cannot release and restore its KV cache registrations)",
                    c.name()
                );
            }
            if (args.admin_token.is_some() || args.dev_mode) && !args.enable_sleep_mode {
                if c.supports_sleep_mode() {
                    // The admin API is there to sleep between rollouts.
                    config.enable_sleep_mode = true;
                    tracing::info!("sleep mode on (the admin API is)");
                } else {
                    tracing::warn!(
                        connector = c.name(),
                        "the KV connector cannot release its registrations: /sleep and KV release are refused"
                    );
                }
            }
            tracing::info!(info = %c.info(), "KV connector ready");
            Some(c)
        }
        None => {
            if args.engine_id.is_some() {
                tracing::warn!("--engine-id has no effect without --kv-transfer-config");
            }
            None
        }
    };
    Ok(connector)
}

fn random_engine_id() -> String {
    use std::hash::{BuildHasher, Hasher};
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    h.write_u128(
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos()),
    );
    h.write_u32(std::process::id());
    format!("engine-{:016x}", h.finish())
}

async fn serve(
    addr: SocketAddr,
    engine: EngineHandle,
    served_name: String,
    (admin_token, api_key, dev_mode): (Option<String>, Option<String>, bool),
    (pause_wait, checkpoint_read): (std::time::Duration, std::time::Duration),
    secret: pdkv_connector::KvSecret,
    (limits, tool_parser): (
        pdkv_server::listen::HttpLimits,
        Option<pdkv_server::tools::Parser>,
    ),
) -> anyhow::Result<()> {
    // Weight syncs prove the deployment's KV secret to the publisher.
    let mut state = AppState::new(engine.clone(), served_name.clone())
        .with_kv_secret(secret, &addr.ip().to_string());
    if let Some(token) = admin_token {
        state = state.with_admin_token(token)?;
    }
    if let Some(key) = api_key {
        state = state.with_api_key(key)?;
    }
    state = state
        .with_dev_mode(dev_mode)
        .with_pause_wait(pause_wait)
        .with_checkpoint_read_timeout(checkpoint_read)
        .with_tool_parser(tool_parser);
    let listener = pdkv_transfer::listen::bind(addr)
        .await
        .with_context(|| format!("binding {addr}"))?;
    let local = listener.local_addr().context("reading the bound address")?;
    tracing::info!(model = %served_name, admin_api = state.admin_enabled(), "listening on http://{local}");
    let on_shutdown = state.clone();
    let shutdown = async move {
        crate::common::wait_for_signal().await;
        tracing::info!("shutting down");
        on_shutdown.cancel_checkpoint_reads("shutdown");
        // Ends running requests so streaming responses finish and the
        // graceful shutdown does not wait for them.
        let _ = tokio::task::spawn_blocking(move || engine.shutdown()).await;
    };
    pdkv_server::serve_with(listener, state, limits, shutdown)
        .await
        .context("serving HTTP")?;
    tracing::info!("stopped");
    Ok(())
}
