//! The proxy's shared state (one per proxy, behind an `Arc`).

use std::sync::{Arc, Mutex};

use pdkv_relay::plan::Role;

use super::backends::{pool, Backend, BackendSnapshot, Pool};
use super::config::{ProxyConfig, ProxyError, UPSTREAM_IDLE};
use super::metrics::ProxyMetrics;

/// The fan-out chosen at `init_weight_transfer_engine` (see
/// [`super::weight_fanout`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Fanout {
    Direct,
    Relay,
}

/// What the proxy's handlers, health checks and relays share: the
/// configuration, the HTTP client, the backends and the counters. The
/// public [`super::Proxy`] is a handle on it; the rooms below the proxy
/// take it rather than the handle, so none reaches back into its parent.
pub(super) struct Shared {
    pub(super) config: ProxyConfig,
    pub(super) client: reqwest::Client,
    pub(super) prefill: Pool,
    pub(super) decode: Pool,
    pub(super) metrics: Arc<ProxyMetrics>,
    ids: crate::ids::IdSource,
    /// How the last `init_weight_transfer_engine` fans weight syncs out.
    pub(super) weight_fanout: Mutex<Fanout>,
}

impl Shared {
    /// The state of a proxy over the configured backends. Every backend
    /// counts as unhealthy until a health check has seen it answer.
    pub(super) fn new(config: ProxyConfig) -> Result<Shared, ProxyError> {
        if config.admin_token.as_deref() == Some("") {
            return Err(ProxyError::EmptyAdminToken);
        }
        let prefill = pool(Role::Prefill, &config.prefill)?;
        let decode = pool(Role::Decode, &config.decode)?;
        // Pooled connections to the engines are given up after a short idle
        // time, below any engine's header timeout (which closes idle
        // keep-alive connections): otherwise a request sent on one just as
        // the engine closes it fails as "connection closed before message
        // completed".
        let client = reqwest::Client::builder()
            .connect_timeout(config.connect_timeout)
            .pool_idle_timeout(UPSTREAM_IDLE)
            .build()?;
        Ok(Shared {
            config,
            client,
            prefill,
            decode,
            metrics: Arc::new(ProxyMetrics::default()),
            ids: crate::ids::IdSource::default(),
            weight_fanout: Mutex::new(Fanout::Direct),
        })
    }

    /// Every backend, prefill servers first, as last checked.
    pub(super) fn snapshots(&self) -> Vec<BackendSnapshot> {
        self.all_backends().map(|b| b.snapshot()).collect()
    }

    pub(super) fn all_backends(&self) -> impl Iterator<Item = &Arc<Backend>> {
        self.prefill.backends.iter().chain(&self.decode.backends)
    }

    /// The backends of `role`.
    pub(super) fn backends(&self, role: Role) -> &[Arc<Backend>] {
        match role {
            Role::Prefill => &self.prefill.backends,
            Role::Decode => &self.decode.backends,
        }
    }

    /// Whether at least one prefill and one decode server are healthy.
    pub(super) fn is_ready(&self) -> bool {
        self.prefill.any_healthy() && self.decode.any_healthy()
    }

    /// A fresh transfer id: 128 random bits as 32 hex digits (no client
    /// can guess the next one and claim it at P first).
    pub(super) fn new_transfer_id(&self) -> String {
        self.ids.next_hex()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn transfer_ids_are_unique_128_bit_hex() {
        let proxy = Shared::new(ProxyConfig::new(vec!["a:1".into()], vec!["b:2".into()])).unwrap();
        let a = proxy.new_transfer_id();
        let b = proxy.new_transfer_id();
        assert_ne!(a, b);
        assert_eq!(a.len(), 32);
        assert!(a.chars().all(|c| c.is_ascii_hexdigit()));
    }
}
