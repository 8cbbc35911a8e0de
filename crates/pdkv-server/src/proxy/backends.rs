//! The backends behind the proxy as the health checks see them, and the
//! round-robin choice among those of one role.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

use pdkv_relay::plan::{Mode, Role};
use serde::Deserialize;

use super::config::{normalize_url, ProxyError};

/// What a server's `GET /kv_transfer/info` reports about its KV connector.
#[derive(Clone, Debug, Deserialize, PartialEq, Eq)]
pub struct KvTransferInfo {
    pub engine_id: String,
    #[serde(default)]
    pub kv_role: Option<String>,
    #[serde(default)]
    pub transport: Option<String>,
    #[serde(default)]
    pub transfer_mode: Option<String>,
    #[serde(default)]
    pub bootstrap_addr: Option<String>,
    #[serde(default)]
    pub transfer_addr: Option<String>,
}

/// A backend as the last health check saw it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct BackendSnapshot {
    pub role: Role,
    pub url: String,
    pub healthy: bool,
    /// Why a healthy backend refuses new requests for now (paused, asleep).
    pub refusing: Option<String>,
    /// The connector info of a prefill server (`None` for a server without a
    /// KV connector, and for decode servers, which are not asked).
    pub kv_info: Option<KvTransferInfo>,
    /// Why the last check failed, while unhealthy.
    pub last_error: Option<String>,
}

#[derive(Clone, Debug, Default)]
pub(super) struct BackendStatus {
    pub(super) healthy: bool,
    /// Up, but refusing new requests for now (its `/health` answered a 503
    /// with `Retry-After`: paused, asleep): picked only when no backend of
    /// its role serves. A refusing P then answers its 503 and D computes
    /// the prompt itself; a refusing D passes its retryable 503 on.
    pub(super) refusing: Option<String>,
    pub(super) kv_info: Option<KvTransferInfo>,
    pub(super) last_error: Option<String>,
}

pub(super) struct Backend {
    pub(super) role: Role,
    /// Base URL without a trailing slash.
    pub(super) url: String,
    status: Mutex<BackendStatus>,
}

impl Backend {
    pub(super) fn status(&self) -> BackendStatus {
        self.status
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
    }

    /// Records a check's result, logging changes of health.
    pub(super) fn set_status(&self, new: BackendStatus) {
        let mut st = self.status.lock().unwrap_or_else(|e| e.into_inner());
        match (st.healthy, new.healthy) {
            (false, true) => {
                tracing::info!(role = %self.role, url = %self.url, "backend is healthy")
            }
            (true, false) => tracing::warn!(
                role = %self.role,
                url = %self.url,
                reason = new.last_error.as_deref().unwrap_or("unknown"),
                "backend is unhealthy; skipping it"
            ),
            _ => {}
        }
        match (&st.refusing, &new.refusing) {
            (None, Some(why)) if new.healthy => tracing::info!(
                role = %self.role,
                url = %self.url,
                reason = %why,
                "backend is up but not serving; preferring others"
            ),
            (Some(_), None) if new.healthy => {
                tracing::info!(role = %self.role, url = %self.url, "backend serves again")
            }
            _ => {}
        }
        if st.kv_info != new.kv_info {
            match &new.kv_info {
                Some(i) => tracing::info!(
                    url = %self.url,
                    engine_id = %i.engine_id,
                    bootstrap_addr = i.bootstrap_addr.as_deref().unwrap_or("-"),
                    "prefill server's KV connector"
                ),
                None if new.healthy => tracing::warn!(
                    url = %self.url,
                    "prefill server reports no KV connector; decode servers will get no bootstrap address"
                ),
                None => {}
            }
        }
        *st = new;
    }

    /// Marks the backend unhealthy after a failed call, until the next check.
    pub(super) fn mark_unhealthy(&self, reason: String) {
        let mut new = self.status();
        new.healthy = false;
        new.last_error = Some(reason);
        self.set_status(new);
    }

    pub(super) fn snapshot(&self) -> BackendSnapshot {
        let st = self.status();
        BackendSnapshot {
            role: self.role,
            url: self.url.clone(),
            healthy: st.healthy,
            refusing: st.refusing,
            kv_info: st.kv_info,
            last_error: st.last_error,
        }
    }
}

/// The backends of one role with the round-robin cursor.
pub(super) struct Pool {
    pub(super) backends: Vec<Arc<Backend>>,
    next: AtomicUsize,
}

impl Pool {
    /// The next healthy backend in round-robin order, with its status: one
    /// that serves, else one that is up but refusing for now.
    pub(super) fn pick(&self) -> Option<(Arc<Backend>, BackendStatus)> {
        let up: Vec<(&Arc<Backend>, BackendStatus)> = self
            .backends
            .iter()
            .map(|b| (b, b.status()))
            .filter(|(_, st)| st.healthy)
            .collect();
        let serving: Vec<_> = up
            .iter()
            .filter(|(_, st)| st.refusing.is_none())
            .cloned()
            .collect();
        let healthy = if serving.is_empty() { up } else { serving };
        if healthy.is_empty() {
            return None;
        }
        let i = self.next.fetch_add(1, Ordering::Relaxed) % healthy.len();
        let (b, st) = &healthy[i];
        Some(((*b).clone(), st.clone()))
    }

    pub(super) fn any_healthy(&self) -> bool {
        self.backends.iter().any(|b| b.status().healthy)
    }
}

pub(super) fn pool(role: Role, urls: &[String]) -> Result<Pool, ProxyError> {
    if urls.is_empty() {
        return Err(ProxyError::NoBackend(role));
    }
    let mut backends: Vec<Arc<Backend>> = Vec::new();
    for raw in urls {
        let url = normalize_url(role, raw)?;
        if backends.iter().any(|b| b.url == url) {
            return Err(ProxyError::Duplicate { role, url });
        }
        backends.push(Arc::new(Backend {
            role,
            url,
            status: Mutex::new(BackendStatus::default()),
        }));
    }
    Ok(Pool {
        backends,
        next: AtomicUsize::new(0),
    })
}

/// The plan's mode for a P as its `/kv_transfer/info` described it: read
/// mode when it says so, else write mode naming P (as far as it is known).
pub(super) fn plan_mode(info: Option<&KvTransferInfo>) -> Mode {
    Mode::for_prefill(
        info.and_then(|i| i.transfer_mode.as_deref()),
        info.map(|i| i.engine_id.as_str()),
        info.and_then(|i| i.bootstrap_addr.as_deref()),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn write_mode_names_the_prefill_server_and_read_mode_follows_its_info() {
        let mut info = KvTransferInfo {
            engine_id: "p0".into(),
            kv_role: Some("kv_producer".into()),
            transport: Some("tcp".into()),
            transfer_mode: Some("write".into()),
            bootstrap_addr: Some("127.0.0.1:7000".into()),
            transfer_addr: Some("127.0.0.1:7001".into()),
        };
        let write = Mode::Write {
            remote_engine_id: Some("p0".into()),
            remote_bootstrap_addr: Some("127.0.0.1:7000".into()),
        };
        assert_eq!(plan_mode(Some(&info)), write);
        assert_eq!(
            plan_mode(None),
            Mode::Write {
                remote_engine_id: None,
                remote_bootstrap_addr: None
            }
        );
        info.transfer_mode = Some("read".into());
        assert_eq!(plan_mode(Some(&info)), Mode::Read);
    }
}
