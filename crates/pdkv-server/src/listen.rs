//! The HTTP accept loop of engines and the proxy, with the bounds a server
//! facing untrusted clients needs: at most [`HttpLimits::max_connections`]
//! connections at once (at the cap the loop stops accepting, so further
//! clients wait in the listen backlog instead of exhausting descriptors),
//! and a connection that does not send a whole request head within
//! [`HttpLimits::header_timeout`] — the first request, or the next one on
//! an idle keep-alive connection — is closed. Accept errors (out of
//! descriptors, say) back off instead of spinning. HTTP/1.1 only.
//!
//! Shutdown: when `shutdown` resolves the loop stops accepting, every open
//! connection is asked to finish its request in flight and close, and the
//! call returns once all have.

use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use axum::Router;
use hyper_util::rt::{TokioIo, TokioTimer};
use hyper_util::server::graceful::GracefulShutdown;
use hyper_util::service::TowerToHyperService;
use tokio::net::TcpListener;
use tokio::sync::Semaphore;

/// How many connections a server holds and how long it waits for a head.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct HttpLimits {
    pub max_connections: usize,
    pub header_timeout: Duration,
}

impl Default for HttpLimits {
    /// 4096 connections, 10 s for a request head.
    fn default() -> HttpLimits {
        HttpLimits { max_connections: 4096, header_timeout: Duration::from_secs(10) }
    }
}

/// Pause after a failed accept.
const ACCEPT_BACKOFF: Duration = Duration::from_millis(100);

/// Serves `app` on `listener` within `limits` until `shutdown` resolves.
pub async fn serve(
    listener: TcpListener,
    app: Router,
    limits: HttpLimits,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> std::io::Result<()> {
    if limits.max_connections == 0 || limits.header_timeout.is_zero() {
        return Err(std::io::Error::other("the HTTP connection cap and header timeout must be positive"));
    }
    let permits = Arc::new(Semaphore::new(limits.max_connections));
    let graceful = GracefulShutdown::new();
    let mut http = hyper::server::conn::http1::Builder::new();
    http.timer(TokioTimer::new()).header_read_timeout(limits.header_timeout).keep_alive(true);
    tokio::pin!(shutdown);
    let mut at_cap_logged = false;
    loop {
        let permit = match permits.clone().try_acquire_owned() {
            Ok(p) => {
                at_cap_logged = false;
                p
            }
            Err(_) => {
                if !at_cap_logged {
                    tracing::warn!(max = limits.max_connections, "HTTP connection cap reached; new clients wait");
                    at_cap_logged = true;
                }
                tokio::select! {
                    p = permits.clone().acquire_owned() => p.map_err(|_| std::io::Error::other("connection permits closed"))?,
                    _ = &mut shutdown => break,
                }
            }
        };
        let stream = tokio::select! {
            r = listener.accept() => match r {
                Ok((s, _)) => s,
                Err(e) => {
                    tracing::warn!("HTTP accept failed: {e}; retrying in {ACCEPT_BACKOFF:?}");
                    tokio::time::sleep(ACCEPT_BACKOFF).await;
                    continue;
                }
            },
            _ = &mut shutdown => break,
        };
        let _ = stream.set_nodelay(true);
        let conn = http.serve_connection(TokioIo::new(stream), TowerToHyperService::new(app.clone()));
        let conn = graceful.watch(conn);
        tokio::spawn(async move {
            if let Err(e) = conn.await {
                tracing::debug!("HTTP connection ended: {e}");
            }
            drop(permit);
        });
    }
    drop(listener);
    graceful.shutdown().await;
    Ok(())
}
