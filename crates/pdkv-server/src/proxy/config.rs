//! What the proxy is configured with, and the configurations it refuses.

use std::time::Duration;

use pdkv_relay::plan::Role;

/// Where the proxy sends requests and how long it waits.
#[derive(Clone, Debug)]
pub struct ProxyConfig {
    /// Base URLs of the prefill servers (`http://host:port`).
    pub prefill: Vec<String>,
    /// Base URLs of the decode servers.
    pub decode: Vec<String>,
    /// Time between two rounds of health checks.
    pub health_interval: Duration,
    /// Bound on one health or info request.
    pub health_timeout: Duration,
    /// Bound on opening a connection to a backend.
    pub connect_timeout: Duration,
    /// Bound on a whole upstream generation request, streamed body included
    /// (and on each engine's answer to a fanned-out admin call).
    pub request_timeout: Duration,
    /// Enables the deployment's lifecycle admin API ([`fanout`]), behind
    /// `Authorization: Bearer <token>`; the proxy calls the engines with the
    /// same token.
    pub admin_token: Option<String>,
    /// Mounts that API without a token when none is given (the engines run
    /// in dev mode too), as vLLM's `VLLM_SERVER_DEV_MODE=1`.
    pub dev_mode: bool,
    /// How long a generation request a decode engine refused on purpose
    /// (paused or asleep: a retryable 503) waits for a decode engine that
    /// serves before it is sent again, as an engine holds a request until
    /// `/resume`; zero passes the 503 on at once.
    pub pause_wait: Duration,
    /// The deployment's KV secret, proven to a prefill engine's control
    /// port when the proxy asks it to drop a transfer.
    pub kv_secret: pdkv_connector::KvSecret,
    /// The bounds on client connections.
    pub http: crate::listen::HttpLimits,
    /// How many times one streamed request may move to another decode
    /// engine after losing its own mid-stream (0: never; the stream then
    /// ends with an error event).
    pub max_resumes: u32,
    /// How long a request that lost its decode engine waits for one that
    /// serves (another, or the same restarted) before its stream fails.
    pub resume_wait: Duration,
}

impl ProxyConfig {
    /// The given backends with the default timings (health every 2 s,
    /// 1 s health timeout, 5 s connect timeout, 600 s request timeout).
    pub fn new(prefill: Vec<String>, decode: Vec<String>) -> ProxyConfig {
        ProxyConfig {
            prefill,
            decode,
            health_interval: Duration::from_secs(2),
            health_timeout: Duration::from_secs(1),
            connect_timeout: Duration::from_secs(5),
            request_timeout: Duration::from_secs(600),
            admin_token: None,
            dev_mode: false,
            pause_wait: Duration::from_secs(600),
            kv_secret: pdkv_connector::KvSecret::open(),
            http: crate::listen::HttpLimits::default(),
            max_resumes: 3,
            resume_wait: Duration::from_secs(30),
        }
    }
}

/// How long a pooled connection to an engine may sit idle before the proxy
/// drops it; engines' `--header-timeout-s` must be longer (default 10 s).
pub const UPSTREAM_IDLE: Duration = Duration::from_secs(2);

/// A configuration the proxy cannot start with.
#[derive(Debug, thiserror::Error)]
pub enum ProxyError {
    #[error("no {0} server given")]
    NoBackend(Role),
    #[error("invalid {role} server URL `{url}`: {reason}")]
    BadUrl {
        role: Role,
        url: String,
        reason: String,
    },
    #[error("{role} server `{url}` is listed twice")]
    Duplicate { role: Role, url: String },
    #[error("building the HTTP client: {0}")]
    Client(#[from] reqwest::Error),
    #[error("the admin token must not be empty")]
    EmptyAdminToken,
}

/// `http://host:port` from what a user typed (`host:port` gets `http://`).
pub(super) fn normalize_url(role: Role, raw: &str) -> Result<String, ProxyError> {
    let raw = raw.trim();
    let with_scheme = if raw.contains("://") {
        raw.to_string()
    } else {
        format!("http://{raw}")
    };
    let bad = |reason: String| ProxyError::BadUrl {
        role,
        url: raw.to_string(),
        reason,
    };
    let url = reqwest::Url::parse(&with_scheme).map_err(|e| bad(e.to_string()))?;
    if url.scheme() != "http" {
        return Err(bad(format!(
            "scheme `{}` is not supported (only http)",
            url.scheme()
        )));
    }
    if url.host_str().is_none() {
        return Err(bad("no host".to_string()));
    }
    if url.query().is_some() || url.fragment().is_some() {
        return Err(bad("a base URL takes no query or fragment".to_string()));
    }
    Ok(with_scheme.trim_end_matches('/').to_string())
}
