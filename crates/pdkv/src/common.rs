//! What the server commands share (`serve`, `proxy`, `up`, the benches and
//! the lifecycle harness): the address to listen on, the deployment's KV
//! secret from its flag, and waiting for a shutdown signal.

use std::net::SocketAddr;

use anyhow::Context;

/// The address `--host` and `--port` name (`host` an IP address or a name
/// to resolve).
pub(crate) fn resolve_addr(host: &str, port: u16) -> anyhow::Result<SocketAddr> {
    format!("{host}:{port}")
        .parse()
        .or_else(|_| {
            use std::net::ToSocketAddrs;
            (host, port)
                .to_socket_addrs()?
                .next()
                .ok_or_else(|| std::io::Error::other("no address"))
        })
        .with_context(|| format!("resolving --host {host}"))
}

/// The KV secret given by `--kv-secret` / `PDKV_KV_SECRET` (open when unset).
pub(crate) fn kv_secret(given: Option<&str>) -> anyhow::Result<pdkv_connector::KvSecret> {
    match given {
        None => Ok(pdkv_connector::KvSecret::open()),
        Some(s) => pdkv_connector::KvSecret::new(s)
            .map_err(|e| anyhow::anyhow!("--kv-secret (or PDKV_KV_SECRET): {e}")),
    }
}

/// Resolves on Ctrl-C or SIGTERM (pending forever when neither can be
/// listened for).
pub async fn wait_for_signal() {
    use tokio::signal::unix::{signal, SignalKind};
    let term = async {
        match signal(SignalKind::terminate()) {
            Ok(mut s) => {
                s.recv().await;
            }
            Err(e) => {
                tracing::warn!("cannot listen for SIGTERM: {e}");
                std::future::pending::<()>().await;
            }
        }
    };
    let int = async {
        if let Err(e) = tokio::signal::ctrl_c().await {
            tracing::warn!("cannot listen for Ctrl-C: {e}");
            std::future::pending::<()>().await;
        }
    };
    tokio::select! {
        _ = term => {}
        _ = int => {}
    }
}
