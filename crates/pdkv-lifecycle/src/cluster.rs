//! The deployment under test and how a case reaches it: P, D and the proxy
//! started through `pdkv-deploy` (stopped on drop), and [`Cluster`], the
//! admin, metrics and completion calls on P and D.

use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, Instant};

use pdkv_deploy::{EngineWiring, LogSink, Logs, Ports, Proc, Spec, Started};
use serde_json::{json, Value};

use crate::bounds::{
    GAUGE_POLL, METRICS_TIMEOUT, POLL, PROXY_HEALTH_INTERVAL_MS, QUIESCE_DEADLINE,
    REQUEST_DEADLINE, SLOW_PHASE_S,
};
use crate::cases::{Role, Target};
use crate::error::{CallError, LifecycleError, Problem};
use crate::metrics::{busy, metric, metric_sum, quiescent, rank_sums, TransferCounts};
use crate::options::Options;

/// The name on this harness's notices.
pub(crate) const WHO: &str = "pdkv lifecycle";

/// P, D and the proxy (`pdkv-deploy`'s children); stopped on drop, so on
/// every path (an error, an interrupted run dropping its future).
pub(crate) struct Deployment {
    procs: Vec<Proc>,
}

impl Drop for Deployment {
    fn drop(&mut self) {
        pdkv_deploy::stop_all_blocking(&mut self.procs, WHO);
    }
}

impl Deployment {
    pub(crate) fn new() -> Deployment {
        Deployment { procs: Vec::new() }
    }

    /// Fails when a child has exited, with its last log lines.
    pub(crate) fn check_alive(&mut self) -> Result<(), LifecycleError> {
        Ok(pdkv_deploy::check_children(&mut self.procs)?)
    }

    /// Starts P, D (sleep mode, the admin API with `token`) and the proxy,
    /// every child on a port of its choosing, as `pdkv up` does.
    pub(crate) async fn start(
        &mut self,
        o: &Options,
        model: &Path,
        token: &str,
    ) -> Result<Started, LifecycleError> {
        let mut wiring = EngineWiring::new(o.transport, o.transfer_mode);
        wiring.kv_load_failure_policy = Some(o.kv_load_failure_policy);
        wiring.abort_timeout_s = o.kv_abort_timeout_s;
        wiring.num_kv_blocks = Some(o.num_kv_blocks);
        wiring.prefill_tensor_parallel_size = Some(o.prefill_tensor_parallel_size);
        wiring.decode_tensor_parallel_size = Some(o.decode_tensor_parallel_size);
        wiring.sleep_mode = true;
        let spec = Spec {
            exe: o.exe.clone(),
            model: model.to_path_buf(),
            wiring,
            ports: Ports::any(1, 1),
            startup_timeout: Duration::from_secs(o.startup_timeout),
            admin_token: Some(token.to_string()),
            kv_secret: None,
            api_key: None,
            engine_id_prefix: "lc".to_string(),
            proxy_health_interval_ms: Some(PROXY_HEALTH_INTERVAL_MS),
            dev_mode: false,
        };
        let logs = Logs {
            who: WHO,
            sink: if o.show_logs {
                LogSink::Stderr
            } else {
                LogSink::Discard
            },
        };
        let started = pdkv_deploy::start(&spec, &mut self.procs, &logs).await?;
        eprintln!(
            "{WHO}: ready (prefill {}, decode {}, proxy {})",
            started.prefill[0], started.decode[0], started.proxy
        );
        Ok(started)
    }
}

/// Everything a case needs to reach P, D and the proxy.
#[derive(Clone)]
pub(crate) struct Cluster {
    pub(crate) client: reqwest::Client,
    token: Arc<str>,
    p: Arc<str>,
    d: Arc<str>,
    pub(crate) proxy: Arc<str>,
    op_timeout: Duration,
    pub(crate) model: Arc<Path>,
}

/// A 200 with a JSON body, or why not; `what` names the call.
async fn json_answer(what: &str, resp: reqwest::Response) -> Result<Value, CallError> {
    let status = resp.status();
    let text = resp.text().await.map_err(|cause| CallError::Body {
        what: what.to_string(),
        cause,
    })?;
    if status != reqwest::StatusCode::OK {
        return Err(CallError::Status {
            what: what.to_string(),
            status,
            body: text.trim().to_string(),
        });
    }
    serde_json::from_str(&text).map_err(|cause| CallError::NotJson {
        what: what.to_string(),
        cause,
        text,
    })
}

impl Cluster {
    pub(crate) fn new(
        client: reqwest::Client,
        token: &str,
        started: &Started,
        op_timeout: Duration,
        model: &Path,
    ) -> Cluster {
        Cluster {
            client,
            token: token.into(),
            p: started.prefill[0].as_str().into(),
            d: started.decode[0].as_str().into(),
            proxy: started.proxy.as_str().into(),
            op_timeout,
            model: model.into(),
        }
    }

    fn base(&self, role: Role) -> &str {
        match role {
            Role::P => &self.p,
            Role::D => &self.d,
        }
    }

    /// An admin call that must answer 200; returns its JSON body, or why not.
    pub(crate) async fn admin(
        &self,
        role: Role,
        post: bool,
        path: &str,
        body: Option<Value>,
    ) -> Result<Value, CallError> {
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
        match req.send().await {
            Ok(resp) => json_answer(&what, resp).await,
            Err(cause) => Err(CallError::Send { what, cause }),
        }
    }

    /// An admin call on every engine of `target`, concurrently; the first error.
    pub(crate) async fn on_all(
        &self,
        target: Target,
        post: bool,
        path: &str,
        body: Option<Value>,
    ) -> Result<(), CallError> {
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
            let r = t.await.map_err(CallError::Task).and_then(|r| r);
            if let (Err(e), true) = (r, first.is_ok()) {
                first = Err(e);
            }
        }
        first
    }

    /// `GET /is_paused` and `/is_sleeping` on `role` must both say false.
    pub(crate) async fn check_serving(&self, role: Role) -> Result<(), Problem> {
        let paused = self.admin(role, false, "/is_paused", None).await?;
        let sleeping = self.admin(role, false, "/is_sleeping", None).await?;
        if paused["is_paused"] != json!(false) || sleeping["is_sleeping"] != json!(false) {
            return Err(Problem::Unexpected(format!(
                "{} is not serving after the restore: {paused} {sleeping}",
                role.name()
            )));
        }
        Ok(())
    }

    pub(crate) async fn metrics(&self, role: Role) -> Result<String, CallError> {
        let url = format!("{}/metrics", self.base(role));
        let sent = self.client.get(&url).timeout(METRICS_TIMEOUT).send().await;
        let resp = sent.map_err(|cause| CallError::Send {
            what: url.clone(),
            cause,
        })?;
        if !resp.status().is_success() {
            return Err(CallError::Refused {
                what: url,
                status: resp.status(),
            });
        }
        resp.text()
            .await
            .map_err(|cause| CallError::Send { what: url, cause })
    }

    pub(crate) async fn device_bytes(&self, role: Role) -> Result<u64, CallError> {
        let text = self.metrics(role).await?;
        let metric = "pdkv_device_memory_bytes";
        let v = metric_sum(&text, metric).ok_or_else(|| CallError::NoMetric {
            role: role.name(),
            metric: metric.to_string(),
        })?;
        Ok(v as u64)
    }

    /// `role`'s device bytes rank by rank (every tag summed).
    pub(crate) async fn rank_bytes(&self, role: Role) -> Result<Vec<u64>, CallError> {
        let text = self.metrics(role).await?;
        let metric = "pdkv_rank_device_memory_bytes";
        let v = rank_sums(&text, metric);
        if v.is_empty() {
            return Err(CallError::NoMetric {
                role: role.name(),
                metric: metric.to_string(),
            });
        }
        Ok(v)
    }

    /// The unlabelled metric `name` of `role` now.
    pub(crate) async fn gauge(&self, role: Role, name: &str) -> Result<f64, CallError> {
        let text = self.metrics(role).await?;
        metric(&text, name).ok_or_else(|| CallError::NoMetric {
            role: role.name(),
            metric: name.to_string(),
        })
    }

    /// Waits (polling, until `deadline`) until `role`'s metric `name` is at
    /// least `min`; its value then, or why not.
    pub(crate) async fn wait_gauge(
        &self,
        role: Role,
        name: &str,
        min: f64,
        deadline: Instant,
    ) -> Result<f64, Problem> {
        loop {
            let v = self.gauge(role, name).await?;
            if v >= min {
                return Ok(v);
            }
            if Instant::now() >= deadline {
                return Err(Problem::Unexpected(format!(
                    "{} {name} stayed {v} (at least {min} needed)",
                    role.name()
                )));
            }
            tokio::time::sleep(GAUGE_POLL).await;
        }
    }

    /// A completion sent straight to `role` (not through the proxy) as
    /// request `id`; its JSON body when it answered 200.
    pub(crate) async fn completion(
        &self,
        role: Role,
        body: Value,
        id: &str,
    ) -> Result<Value, CallError> {
        let url = format!("{}/v1/completions", self.base(role));
        let what = format!("{} POST /v1/completions ({id})", role.name());
        let sent = self
            .client
            .post(&url)
            .header("x-request-id", id)
            .json(&body)
            .timeout(REQUEST_DEADLINE)
            .send()
            .await;
        match sent {
            Ok(resp) => json_answer(&what, resp).await,
            Err(cause) => Err(CallError::Send { what, cause }),
        }
    }

    /// `POST /reset_prefix_cache?reset_running_requests=R` on `role` must
    /// answer `success: want`.
    pub(crate) async fn expect_reset(
        &self,
        role: Role,
        reset_running: bool,
        want: bool,
        when: &str,
    ) -> Result<(), Problem> {
        let path = format!("/reset_prefix_cache?reset_running_requests={reset_running}");
        let v = self.admin(role, true, &path, None).await?;
        if v["success"] != json!(want) {
            return Err(Problem::Unexpected(format!(
                "{} {path} {when} answered {v} (expected success {want})",
                role.name()
            )));
        }
        Ok(())
    }

    /// Waits until `role` is idle with every KV block free. Returns what
    /// was still busy a few seconds in, if it took that long.
    pub(crate) async fn wait_quiescent(&self, role: Role) -> Result<Option<String>, Problem> {
        let started = Instant::now();
        let mut slow = None;
        loop {
            let text = self.metrics(role).await?;
            if quiescent(&text) {
                return Ok(slow);
            }
            let waited = started.elapsed();
            if waited >= QUIESCE_DEADLINE {
                return Err(Problem::Unexpected(format!(
                    "{} not quiescent after {}s: {}",
                    role.name(),
                    waited.as_secs(),
                    busy(&text)
                )));
            }
            if slow.is_none() && waited.as_secs_f64() > SLOW_PHASE_S {
                slow = Some(format!(
                    "{} busy after {:.0}s: {}",
                    role.name(),
                    SLOW_PHASE_S,
                    busy(&text)
                ));
            }
            tokio::time::sleep(POLL).await;
        }
    }

    /// The transfer counters of P and D now.
    pub(crate) async fn counters(&self) -> Result<TransferCounts, CallError> {
        let p = self.metrics(Role::P).await?;
        let d = self.metrics(Role::D).await?;
        TransferCounts::read(&p, &d)
    }
}
