//! Starting a whole deployment: N prefill servers, M decode servers and the
//! proxy in front of them, each a child process, bounded by the start-up
//! timeout and failing as soon as a child exits.

use std::path::PathBuf;
use std::time::{Duration, Instant};

use crate::child::{check_children, Logs, Proc};
use crate::error::DeployError;
use crate::ports::Ports;
use crate::wiring::{proxy_args, serve_args, EngineRole, EngineWiring};

/// Interval of health polls.
const POLL: Duration = Duration::from_millis(200);
/// Bound on one health poll or `/kv_transfer/info` request.
const HTTP_TIMEOUT: Duration = Duration::from_secs(2);
/// How often a slow start-up says what it waits for.
const REPORT_EVERY: Duration = Duration::from_secs(5);

/// A whole deployment, as it is to be started.
#[derive(Clone, Debug)]
pub struct Spec {
    /// The `pdkv` executable every child runs.
    pub exe: PathBuf,
    pub model: PathBuf,
    pub wiring: EngineWiring,
    pub ports: Ports,
    /// Bound on the start-up, model loading included.
    pub startup_timeout: Duration,
    /// Every engine's and the proxy's admin token.
    pub admin_token: Option<String>,
    /// The deployment's KV secret (already checked); `None`: made fresh
    /// for the deployment.
    pub kv_secret: Option<String>,
    /// Every engine's API key (not the proxy's: it passes the client's on).
    pub api_key: Option<String>,
    /// Engine ids are `{prefix}-prefill-{i}` and `{prefix}-decode-{i}`.
    pub engine_id_prefix: String,
    /// The proxy's health checks' interval (`None`: its default).
    pub proxy_health_interval_ms: Option<u64>,
    /// Every engine and the proxy in dev mode (`PDKV_SERVER_DEV_MODE=1`:
    /// the admin API open without a token).
    pub dev_mode: bool,
}

/// The URLs of a started deployment.
#[derive(Clone, Debug)]
pub struct Started {
    pub prefill: Vec<String>,
    pub decode: Vec<String>,
    pub proxy: String,
    /// Each prefill server's KV bootstrap port.
    pub kv: Vec<u16>,
    /// How each engine was launched (the prefill servers, then the decode
    /// servers), to start one again on its ports after it died.
    pub engines: Vec<EngineLaunch>,
}

/// An engine's command line, environment and ports as the deployment
/// started it, its ports now fixed to those it listens on: a supervisor
/// (`pdkv bench serve --chaos`) starts it again with [`EngineLaunch::respawn`]
/// and the proxy finds it at the same URL.
#[derive(Clone)]
pub struct EngineLaunch {
    pub name: String,
    pub role: EngineRole,
    pub url: String,
    exe: PathBuf,
    port: u16,
    args: Vec<String>,
    /// Secrets included: never printed (see the `Debug` impl).
    env: Vec<(&'static str, Option<String>)>,
}

impl std::fmt::Debug for EngineLaunch {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("EngineLaunch")
            .field("name", &self.name)
            .field("url", &self.url)
            .finish_non_exhaustive()
    }
}

impl EngineLaunch {
    /// Starts the engine again, its `restart`th time (its log under the
    /// name `{name} restart {restart}`, so the last one's stays); it is
    /// healthy once `GET /health` answers 200 at [`EngineLaunch::url`] (see
    /// [`wait_healthy`]).
    pub fn respawn(&self, restart: u32, logs: &Logs) -> Result<Proc, DeployError> {
        let env: Vec<(&str, Option<&str>)> =
            self.env.iter().map(|(k, v)| (*k, v.as_deref())).collect();
        let name = format!("{} restart {restart}", self.name);
        Proc::spawn(&self.exe, name, self.port, &self.args, &env, logs)
    }
}

/// The environment of the engines and of the proxy (secrets by
/// environment, never argv).
struct Env {
    token: Option<String>,
    api_key: Option<String>,
    secret: String,
    dev_mode: bool,
}

impl Env {
    fn engine(&self) -> [(&'static str, Option<&str>); 4] {
        [
            ("PDKV_ADMIN_TOKEN", self.token.as_deref()),
            ("PDKV_API_KEY", self.api_key.as_deref()),
            ("PDKV_KV_SECRET", Some(&self.secret)),
            ("PDKV_SERVER_DEV_MODE", self.dev_mode.then_some("1")),
        ]
    }

    fn proxy(&self) -> [(&'static str, Option<&str>); 4] {
        [
            ("PDKV_ADMIN_TOKEN", self.token.as_deref()),
            ("PDKV_API_KEY", None),
            ("PDKV_KV_SECRET", Some(&self.secret)),
            ("PDKV_SERVER_DEV_MODE", self.dev_mode.then_some("1")),
        ]
    }
}

/// A child's name: its role, numbered when there are several.
fn child_name(role: &str, i: usize, n: usize) -> String {
    if n == 1 {
        role.to_string()
    } else {
        format!("{role} {i}")
    }
}

/// Spawns the prefill and then the decode servers (pushed onto `procs`).
fn spawn_engines(
    spec: &Spec,
    env: &Env,
    procs: &mut Vec<Proc>,
    logs: &Logs,
) -> Result<(), DeployError> {
    let (ports, prefix) = (&spec.ports, &spec.engine_id_prefix);
    let (np, nd) = (ports.prefill.len(), ports.decode.len());
    let engines = ports
        .prefill
        .iter()
        .zip(&ports.kv)
        .enumerate()
        .map(|(i, (&port, &kv))| (EngineRole::Prefill, "prefill", i, np, port, kv))
        .chain(
            ports
                .decode
                .iter()
                .enumerate()
                .map(|(i, &port)| (EngineRole::Decode, "decode", i, nd, port, 0)),
        );
    for (role, what, i, n, port, kv) in engines {
        let id = format!("{prefix}-{what}-{i}");
        let a = serve_args(&spec.wiring, &spec.model, role, port, kv, &id);
        let name = child_name(what, i, n);
        procs.push(Proc::spawn(&spec.exe, name, port, &a, &env.engine(), logs)?);
    }
    Ok(())
}

/// Starts the children (pushed onto `procs`: the prefill servers, the
/// decode servers, then the proxy) and waits until all are healthy, bounded
/// by the start-up timeout; fails when a child exits first. The caller
/// stops whatever is in `procs` on every path.
pub async fn start(
    spec: &Spec,
    procs: &mut Vec<Proc>,
    logs: &Logs,
) -> Result<Started, DeployError> {
    // The deployment's KV secret: the one given, else made fresh for it
    // (children only learn it by environment).
    let secret = match spec.kv_secret.clone() {
        Some(s) => s,
        None => pdkv_connector::KvSecret::generate().map_err(DeployError::Secret)?,
    };
    let env = Env {
        token: spec.admin_token.clone(),
        api_key: spec.api_key.clone(),
        secret,
        dev_mode: spec.dev_mode,
    };
    let np = spec.ports.prefill.len();
    spawn_engines(spec, &env, procs, logs)?;
    let client = reqwest::Client::builder()
        .timeout(HTTP_TIMEOUT)
        .build()
        .map_err(DeployError::Client)?;
    let deadline = Instant::now() + spec.startup_timeout;
    wait_healthy(&client, procs, deadline, logs.who).await?;
    let p_urls: Vec<String> = procs[..np].iter_mut().map(base).collect();
    let d_urls: Vec<String> = procs[np..].iter_mut().map(base).collect();
    let proxy_port = spec.ports.proxy;
    let a = proxy_args(
        &p_urls,
        &d_urls,
        proxy_port,
        spec.proxy_health_interval_ms,
        spec.wiring.http,
    );
    let proxy = Proc::spawn(
        &spec.exe,
        "proxy".to_string(),
        proxy_port,
        &a,
        &env.proxy(),
        logs,
    )?;
    procs.push(proxy);
    wait_healthy(&client, procs, deadline, logs.who).await?;
    let mut kv = Vec::with_capacity(np);
    for url in &p_urls {
        kv.push(bootstrap_port(&client, url).await?);
    }
    let engines = launches(spec, &env, procs, &p_urls, &d_urls, &kv);
    Ok(Started {
        prefill: p_urls,
        decode: d_urls,
        proxy: procs.last_mut().map(base).unwrap_or_default(),
        kv,
        engines,
    })
}

/// Each engine's launch with the ports it ended up on.
fn launches(
    spec: &Spec,
    env: &Env,
    procs: &[Proc],
    p_urls: &[String],
    d_urls: &[String],
    kv: &[u16],
) -> Vec<EngineLaunch> {
    let engine_env: Vec<(&'static str, Option<String>)> = env
        .engine()
        .iter()
        .map(|(k, v)| (*k, v.map(str::to_string)))
        .collect();
    let port_of = |url: &str| {
        url.rsplit(':')
            .next()
            .and_then(|p| p.trim_end_matches('/').parse().ok())
            .unwrap_or(0)
    };
    let prefills = p_urls
        .iter()
        .zip(kv)
        .enumerate()
        .map(|(i, (u, &k))| (EngineRole::Prefill, "prefill", i, u, k));
    let decodes = d_urls
        .iter()
        .enumerate()
        .map(|(i, u)| (EngineRole::Decode, "decode", i, u, 0));
    prefills
        .chain(decodes)
        .zip(procs)
        .map(|((role, what, i, url, kv), p)| {
            let port = port_of(url);
            let id = format!("{}-{what}-{i}", spec.engine_id_prefix);
            EngineLaunch {
                name: p.name.clone(),
                role,
                url: url.clone(),
                exe: spec.exe.clone(),
                port,
                args: serve_args(&spec.wiring, &spec.model, role, port, kv, &id),
                env: engine_env.clone(),
            }
        })
        .collect()
}

/// A healthy child's URL.
fn base(p: &mut Proc) -> String {
    p.url().unwrap_or_default().to_string()
}

/// The KV bootstrap port a prefill server at `url` listens on.
async fn bootstrap_port(client: &reqwest::Client, url: &str) -> Result<u16, DeployError> {
    let info: serde_json::Value = client
        .get(format!("{url}/kv_transfer/info"))
        .send()
        .await
        .and_then(|r| r.error_for_status())
        .map_err(|source| DeployError::BootstrapAsk {
            url: url.to_string(),
            source,
        })?
        .json()
        .await
        .map_err(|source| DeployError::BootstrapBody {
            url: url.to_string(),
            source,
        })?;
    info["bootstrap_addr"]
        .as_str()
        .and_then(|a| a.rsplit(':').next())
        .and_then(|p| p.parse().ok())
        .ok_or_else(|| DeployError::NoBootstrapPort {
            url: url.to_string(),
            info: info.clone(),
        })
}

/// Waits until every child answers `GET /health` with 200, or fails at the
/// deadline or when a child exits; `who` starts the progress notices.
pub async fn wait_healthy(
    client: &reqwest::Client,
    procs: &mut [Proc],
    deadline: Instant,
    who: &str,
) -> Result<(), DeployError> {
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
            return Err(DeployError::NotHealthy { waiting });
        }
        if last_report.elapsed() >= REPORT_EVERY {
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
