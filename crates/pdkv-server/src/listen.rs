//! The HTTP accept loop of engines and the proxy, with the bounds a server
//! facing untrusted clients needs: at most [`HttpLimits::max_connections`]
//! connections at once, and a connection that does not send a whole
//! request head within [`HttpLimits::header_timeout`] — the first request,
//! or the next one on an idle keep-alive connection — is closed. Accept
//! errors (out of descriptors, say) back off instead of spinning. HTTP/1.1
//! only.
//!
//! A request body must keep coming: a gap of more than the header timeout
//! between its bytes fails the request (400) and frees the connection.
//!
//! A body the router refuses as too large (413) is read on and discarded
//! before the answer goes out — at most [`DRAIN_MAX`] bytes, for at most
//! [`DRAIN_TIME`] — and the connection then closes: a client still
//! writing its body when the server closed would meet a reset (or a broken
//! pipe) instead of the 413.
//!
//! At the cap, the oldest *idle* connection (no request in flight: one
//! that has sent nothing yet, or a keep-alive connection between requests)
//! is closed to make room for the newcomer, so clients that connect and
//! idle cannot keep `/health`, `/metrics` or a real request out. A request
//! is in flight from its head until its response body (a stream included)
//! has been sent or dropped. Only when every connection carries a request
//! does the loop stop accepting, and further clients wait in the listen
//! backlog (back-pressure) instead of exhausting descriptors.
//!
//! Shutdown: when `shutdown` resolves the loop stops accepting, every open
//! connection is asked to finish its request in flight and close, and the
//! call returns once all have.

use std::collections::BTreeMap;
use std::future::Future;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::Duration;

use axum::body::{Body, Bytes, HttpBody};
use axum::http::{header, HeaderValue, StatusCode};
use axum::Router;
use hyper_util::rt::{TokioIo, TokioTimer};
use hyper_util::service::TowerToHyperService;
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{watch, Notify, OwnedSemaphorePermit, Semaphore};
use tower::ServiceExt;

/// How many connections a server holds and how long it waits for a head.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct HttpLimits {
    pub max_connections: usize,
    pub header_timeout: Duration,
}

impl Default for HttpLimits {
    /// 4096 connections, 10 s for a request head.
    fn default() -> HttpLimits {
        HttpLimits {
            max_connections: 4096,
            header_timeout: Duration::from_secs(10),
        }
    }
}

/// Pause after a failed accept.
const ACCEPT_BACKOFF: Duration = Duration::from_millis(100);

/// The most of a refused (413) body's rest read and discarded before the
/// answer: beyond it (or [`DRAIN_TIME`]) the connection closes with the
/// rest unread.
pub const DRAIN_MAX: usize = 64 * 1024 * 1024;
/// The longest the drain of a refused body may take ([`DRAIN_MAX`]).
pub const DRAIN_TIME: Duration = Duration::from_secs(10);

/// One open connection, as the loop sees it.
struct Conn {
    /// Requests in flight on it.
    busy: Arc<AtomicUsize>,
    /// Set when it is asked to close (for a newcomer, or at shutdown).
    closing: Arc<AtomicBool>,
    close: Arc<Notify>,
}

/// The open connections, oldest first.
#[derive(Default)]
struct Conns {
    next: u64,
    open: BTreeMap<u64, Conn>,
}

impl Conns {
    /// Asks the oldest idle connection to close; whether there was one.
    fn close_oldest_idle(&mut self) -> bool {
        let idle = self
            .open
            .values()
            .find(|c| c.busy.load(Ordering::Acquire) == 0 && !c.closing.load(Ordering::Acquire));
        match idle {
            Some(c) => {
                c.closing.store(true, Ordering::Release);
                c.close.notify_one();
                true
            }
            None => false,
        }
    }

    /// Registers a new connection: its id, and the handles it shares with
    /// the registry (requests in flight, whether it is asked to close).
    fn register(&mut self) -> (u64, Arc<AtomicUsize>, Arc<Notify>) {
        let busy = Arc::new(AtomicUsize::new(0));
        let closing = Arc::new(AtomicBool::new(false));
        let close = Arc::new(Notify::new());
        let id = self.next;
        self.next += 1;
        self.open.insert(
            id,
            Conn {
                busy: busy.clone(),
                closing,
                close: close.clone(),
            },
        );
        (id, busy, close)
    }
}

/// Counts a request in flight (on its connection and in the stats) until
/// its response body is done.
struct InFlight(Arc<AtomicUsize>, Arc<HttpStats>);

impl Drop for InFlight {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::AcqRel);
        self.1.in_flight.fetch_sub(1, Ordering::AcqRel);
    }
}

/// A response body that keeps its request counted in flight.
struct TrackedBody {
    inner: Body,
    _in_flight: InFlight,
}

impl HttpBody for TrackedBody {
    type Data = Bytes;
    type Error = axum::Error;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<http_body::Frame<Bytes>, axum::Error>>> {
        Pin::new(&mut self.inner).poll_frame(cx)
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> http_body::SizeHint {
        self.inner.size_hint()
    }
}

/// A request body that fails once `limit` passes without a byte of it
/// (the header timeout applied between a body's frames): a client that
/// sends a head and then trickles, or stops, cannot hold its connection.
struct TimedBody {
    inner: hyper::body::Incoming,
    limit: Duration,
    idle: Pin<Box<tokio::time::Sleep>>,
}

impl HttpBody for TimedBody {
    type Data = Bytes;
    type Error = axum::Error;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<http_body::Frame<Bytes>, axum::Error>>> {
        match Pin::new(&mut self.inner).poll_frame(cx) {
            Poll::Ready(frame) => {
                let next = tokio::time::Instant::now() + self.limit;
                self.idle.as_mut().reset(next);
                Poll::Ready(frame.map(|f| f.map_err(axum::Error::new)))
            }
            Poll::Pending => match self.idle.as_mut().poll(cx) {
                Poll::Ready(()) => Poll::Ready(Some(Err(axum::Error::new(std::io::Error::new(
                    std::io::ErrorKind::TimedOut,
                    format!(
                        "no byte of the request body within {:?} (the header timeout)",
                        self.limit
                    ),
                ))))),
                Poll::Pending => Poll::Pending,
            },
        }
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> http_body::SizeHint {
        self.inner.size_hint()
    }
}

/// A request body the router reads through, which the loop can still
/// reach once the router has let it go: the rest of a refused body is
/// drained ([`drain_refused`]).
struct SharedBody(Arc<Mutex<Option<TimedBody>>>);

impl HttpBody for SharedBody {
    type Data = Bytes;
    type Error = axum::Error;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<http_body::Frame<Bytes>, axum::Error>>> {
        match self.0.lock().unwrap().as_mut() {
            Some(body) => Pin::new(body).poll_frame(cx),
            None => Poll::Ready(None),
        }
    }

    fn is_end_stream(&self) -> bool {
        self.0
            .lock()
            .unwrap()
            .as_ref()
            .is_none_or(|b| b.is_end_stream())
    }

    fn size_hint(&self) -> http_body::SizeHint {
        match self.0.lock().unwrap().as_ref() {
            Some(b) => b.size_hint(),
            None => http_body::SizeHint::with_exact(0),
        }
    }
}

/// Reads and discards what is left of a refused request body, up to
/// [`DRAIN_MAX`] bytes within [`DRAIN_TIME`] (each gap also bounded by
/// the body's own idle limit); the bytes read.
async fn drain_refused(body: &Mutex<Option<TimedBody>>) -> usize {
    let Some(mut body) = body.lock().unwrap().take() else {
        return 0;
    };
    let deadline = tokio::time::Instant::now() + DRAIN_TIME;
    let mut read = 0;
    while read < DRAIN_MAX && !body.is_end_stream() {
        let frame = std::future::poll_fn(|cx| Pin::new(&mut body).poll_frame(cx));
        match tokio::time::timeout_at(deadline, frame).await {
            Ok(Some(Ok(f))) => read += f.data_ref().map_or(0, |d| d.len()),
            _ => break,
        }
    }
    read
}

/// The address a request's connection came from (a request extension on
/// everything [`serve`] hands the router).
#[derive(Clone, Copy, Debug)]
pub struct PeerAddr(pub SocketAddr);

/// What the accept loop holds, for metrics and tests.
#[derive(Debug, Default)]
pub struct HttpStats {
    /// Connections open.
    pub open: AtomicUsize,
    /// Requests in flight (head read, response body not yet done).
    pub in_flight: AtomicUsize,
    /// Idle connections closed to make room for a newcomer at the cap.
    pub closed_for_newcomers: AtomicU64,
}

/// Serves `app` on `listener` within `limits` until `shutdown` resolves.
pub async fn serve(
    listener: TcpListener,
    app: Router,
    limits: HttpLimits,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> std::io::Result<()> {
    serve_counted(
        listener,
        app,
        limits,
        Arc::new(HttpStats::default()),
        shutdown,
    )
    .await
}

/// Where connections come in: accepted within the cap.
struct Gate<'a> {
    listener: &'a TcpListener,
    permits: &'a Arc<Semaphore>,
    conns: &'a Mutex<Conns>,
    stats: &'a HttpStats,
    max_connections: usize,
    /// The cap's warning went out since the last connection came in below
    /// it.
    at_cap_logged: bool,
}

impl Gate<'_> {
    /// The next connection with its permit; `None` once `shutdown`
    /// resolves. A newcomer at the cap closes an idle connection, else
    /// waits for a permit.
    async fn next(
        &mut self,
        mut shutdown: Pin<&mut impl Future<Output = ()>>,
    ) -> std::io::Result<Option<(TcpStream, SocketAddr, OwnedSemaphorePermit)>> {
        let (stream, peer) = loop {
            tokio::select! {
                r = self.listener.accept() => match r {
                    Ok(accepted) => break accepted,
                    Err(e) => {
                        tracing::warn!("HTTP accept failed: {e}; retrying in {ACCEPT_BACKOFF:?}");
                        tokio::time::sleep(ACCEPT_BACKOFF).await;
                    }
                },
                _ = shutdown.as_mut() => return Ok(None),
            }
        };
        let permit = match self.permits.clone().try_acquire_owned() {
            Ok(p) => {
                self.at_cap_logged = false;
                p
            }
            Err(_) => {
                // A newcomer at the cap: close an idle connection for it;
                // with none, it (and everyone behind it in the backlog) waits.
                if self.conns.lock().unwrap().close_oldest_idle() {
                    self.stats
                        .closed_for_newcomers
                        .fetch_add(1, Ordering::Relaxed);
                } else if !self.at_cap_logged {
                    tracing::warn!(
                        max = self.max_connections,
                        "HTTP connection cap reached, every connection with a request in flight; new clients wait"
                    );
                    self.at_cap_logged = true;
                }
                tokio::select! {
                    p = self.permits.clone().acquire_owned() => p.map_err(|_| std::io::Error::other("connection permits closed"))?,
                    _ = shutdown.as_mut() => return Ok(None),
                }
            }
        };
        Ok(Some((stream, peer, permit)))
    }
}

/// [`serve`], keeping `stats` up to date.
pub async fn serve_counted(
    listener: TcpListener,
    app: Router,
    limits: HttpLimits,
    stats: Arc<HttpStats>,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> std::io::Result<()> {
    if limits.max_connections == 0 || limits.header_timeout.is_zero() {
        return Err(std::io::Error::other(
            "the HTTP connection cap and header timeout must be positive",
        ));
    }
    let permits = Arc::new(Semaphore::new(limits.max_connections));
    let conns = Arc::new(Mutex::new(Conns::default()));
    let (stop_tx, stop_rx) = watch::channel(false);
    let mut http = hyper::server::conn::http1::Builder::new();
    http.timer(TokioTimer::new())
        .header_read_timeout(limits.header_timeout)
        .keep_alive(true);
    tokio::pin!(shutdown);
    let mut gate = Gate {
        listener: &listener,
        permits: &permits,
        conns: &conns,
        stats: &stats,
        max_connections: limits.max_connections,
        at_cap_logged: false,
    };
    loop {
        let Some((stream, peer, permit)) = gate.next(shutdown.as_mut()).await? else {
            break;
        };
        let _ = stream.set_nodelay(true);
        let (id, busy, close) = conns.lock().unwrap().register();
        let app = app.clone();
        let counter = busy.clone();
        let req_stats = stats.clone();
        let limit = limits.header_timeout;
        let svc = tower::service_fn(move |req: hyper::Request<hyper::body::Incoming>| {
            let (parts, inner) = req.into_parts();
            let body = Arc::new(Mutex::new(Some(TimedBody {
                inner,
                limit,
                idle: Box::pin(tokio::time::sleep(limit)),
            })));
            let mut req = hyper::Request::from_parts(parts, Body::new(SharedBody(body.clone())));
            req.extensions_mut().insert(PeerAddr(peer));
            counter.fetch_add(1, Ordering::AcqRel);
            req_stats.in_flight.fetch_add(1, Ordering::AcqRel);
            let in_flight = InFlight(counter.clone(), req_stats.clone());
            let app = app.clone();
            async move {
                let mut resp = app.oneshot(req).await?;
                if resp.status() == StatusCode::PAYLOAD_TOO_LARGE {
                    let drained = drain_refused(&body).await;
                    tracing::debug!(
                        drained,
                        "the rest of a refused request body read before its 413"
                    );
                    resp.headers_mut()
                        .insert(header::CONNECTION, HeaderValue::from_static("close"));
                }
                Ok::<_, std::convert::Infallible>(resp.map(|b| {
                    Body::new(TrackedBody {
                        inner: b,
                        _in_flight: in_flight,
                    })
                }))
            }
        });
        let conn = http.serve_connection(TokioIo::new(stream), TowerToHyperService::new(svc));
        let (conns, mut stop_rx, conn_stats) = (conns.clone(), stop_rx.clone(), stats.clone());
        conn_stats.open.fetch_add(1, Ordering::AcqRel);
        tokio::spawn(async move {
            tokio::pin!(conn);
            let result = tokio::select! {
                r = conn.as_mut() => Some(r),
                _ = close.notified() => None,
                _ = stop_rx.wait_for(|s| *s) => None,
            };
            let result = match result {
                Some(r) => r,
                None => {
                    // Finish the request in flight (none, when idle) and close.
                    conn.as_mut().graceful_shutdown();
                    conn.await
                }
            };
            if let Err(e) = result {
                tracing::debug!("HTTP connection ended: {e}");
            }
            conns.lock().unwrap().open.remove(&id);
            conn_stats.open.fetch_sub(1, Ordering::AcqRel);
            drop(permit);
        });
    }
    drop(listener);
    // Every connection finishes its request in flight and closes; the
    // permits all come back once they have.
    let _ = stop_tx.send(true);
    let _ = permits.acquire_many(limits.max_connections as u32).await;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use axum::routing::get;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    use tokio::net::TcpStream;

    const DL: Duration = Duration::from_secs(30);

    /// A server whose `/slow` answers only when the test lets it.
    async fn start(
        max_connections: usize,
    ) -> (
        String,
        Arc<HttpStats>,
        Arc<Semaphore>,
        tokio::sync::oneshot::Sender<()>,
    ) {
        let gate = Arc::new(Semaphore::new(0));
        let g = gate.clone();
        let app = Router::new()
            .route("/health", get(|| async { "ok" }))
            .route(
                "/slow",
                get(move || {
                    let g = g.clone();
                    async move {
                        g.acquire().await.unwrap().forget();
                        "slow"
                    }
                }),
            );
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap().to_string();
        let stats = Arc::new(HttpStats::default());
        let (tx, rx) = tokio::sync::oneshot::channel();
        let limits = HttpLimits {
            max_connections,
            header_timeout: Duration::from_secs(600),
        };
        tokio::spawn(serve_counted(
            listener,
            app,
            limits,
            stats.clone(),
            async move {
                let _ = rx.await;
            },
        ));
        (addr, stats, gate, tx)
    }

    /// One `GET path` on a connection of its own; the status line.
    async fn get_once(addr: &str, path: &str) -> String {
        let mut c = TcpStream::connect(addr).await.unwrap();
        c.write_all(
            format!("GET {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n").as_bytes(),
        )
        .await
        .unwrap();
        let mut out = Vec::new();
        c.read_to_end(&mut out).await.unwrap();
        String::from_utf8_lossy(&out)
            .lines()
            .next()
            .unwrap_or_default()
            .to_string()
    }

    /// Waits (bounded) until `f` holds of the stats.
    async fn until(stats: &HttpStats, what: &str, f: impl Fn(&HttpStats) -> bool) {
        let deadline = tokio::time::Instant::now() + DL;
        while !f(stats) {
            assert!(
                tokio::time::Instant::now() < deadline,
                "timed out waiting for {what}: {stats:?}"
            );
            tokio::task::yield_now().await;
        }
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn at_the_cap_an_idle_connection_gives_way_and_a_busy_one_never() {
        let (addr, stats, gate, _stop) = start(2).await;
        // One request in flight, one connection that sends nothing.
        let slow = tokio::spawn({
            let addr = addr.clone();
            async move { get_once(&addr, "/slow").await }
        });
        until(&stats, "the slow request in flight", |s| {
            s.in_flight.load(Ordering::Acquire) == 1
        })
        .await;
        let mut idle = TcpStream::connect(&addr).await.unwrap();
        until(&stats, "two connections open", |s| {
            s.open.load(Ordering::Acquire) == 2
        })
        .await;
        // A newcomer at the cap: the idle one is closed for it, at once.
        let got = tokio::time::timeout(DL, get_once(&addr, "/health"))
            .await
            .expect("served at the cap");
        assert_eq!(got, "HTTP/1.1 200 OK");
        assert_eq!(stats.closed_for_newcomers.load(Ordering::Relaxed), 1);
        let mut b = [0u8; 8];
        assert!(
            matches!(
                tokio::time::timeout(DL, idle.read(&mut b)).await,
                Ok(Ok(0)) | Ok(Err(_))
            ),
            "the idle one closed"
        );
        // Two requests in flight: a newcomer waits (never refused), and is
        // served once one of them ends.
        let slow2 = tokio::spawn({
            let addr = addr.clone();
            async move { get_once(&addr, "/slow").await }
        });
        until(&stats, "two slow requests in flight", |s| {
            s.in_flight.load(Ordering::Acquire) == 2
        })
        .await;
        let mut third = Box::pin(get_once(&addr, "/health"));
        assert!(
            tokio::time::timeout(Duration::from_millis(300), &mut third)
                .await
                .is_err(),
            "served beyond the cap"
        );
        assert_eq!(
            stats.closed_for_newcomers.load(Ordering::Relaxed),
            1,
            "no busy connection was closed"
        );
        gate.add_permits(1);
        assert_eq!(
            tokio::time::timeout(DL, third)
                .await
                .expect("served once a slot freed"),
            "HTTP/1.1 200 OK"
        );
        gate.add_permits(1);
        for t in [slow, slow2] {
            assert_eq!(
                t.await.unwrap(),
                "HTTP/1.1 200 OK",
                "a request in flight is never cut"
            );
        }
    }

    /// A body far over the router's limit, sent whole before the client
    /// reads: the server reads on to its end (within the drain bounds) and
    /// answers 413, closing, where it had closed with most of it unread and
    /// the client's write met a reset or a broken pipe.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_body_far_over_the_limit_gets_its_413_not_a_reset() {
        const LIMIT: usize = 1024 * 1024;
        // Well beyond what loopback's socket buffers hold, within DRAIN_MAX.
        const SENT: usize = 32 * 1024 * 1024;
        const { assert!(SENT < DRAIN_MAX) };
        let app = Router::new()
            .route(
                "/echo",
                axum::routing::post(|b: Bytes| async move { b.len().to_string() }),
            )
            .layer(axum::extract::DefaultBodyLimit::max(LIMIT));
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let (_stop, rx) = tokio::sync::oneshot::channel::<()>();
        tokio::spawn(serve(listener, app, HttpLimits::default(), async move {
            let _ = rx.await;
        }));
        let exchange = async {
            let mut c = TcpStream::connect(addr).await?;
            let head = format!("POST /echo HTTP/1.1\r\nHost: x\r\nContent-Length: {SENT}\r\n\r\n");
            c.write_all(head.as_bytes()).await?;
            let chunk = vec![b'x'; 1024 * 1024];
            for _ in 0..SENT / chunk.len() {
                c.write_all(&chunk).await?;
            }
            let mut out = Vec::new();
            c.read_to_end(&mut out).await?;
            Ok::<_, std::io::Error>(String::from_utf8_lossy(&out).to_string())
        };
        let answer = tokio::time::timeout(DL, exchange)
            .await
            .expect("answered in time")
            .expect("the whole body written and the answer read, no reset");
        assert!(answer.starts_with("HTTP/1.1 413"), "{answer}");
        assert!(
            answer.to_ascii_lowercase().contains("connection: close"),
            "{answer}"
        );
    }
}
