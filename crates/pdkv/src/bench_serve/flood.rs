//! The idle flood of `pdkv bench serve`: connections that send nothing,
//! held open beside the load on the proxy's HTTP port and on the engines'
//! KV ports. A server closes idle connections (HTTP after its header
//! timeout); each closed one is counted and opened again, so the flood
//! keeps its size for the whole run.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use serde_json::{json, Value};
use tokio::io::AsyncReadExt;
use tokio::net::TcpStream;
use tokio::sync::watch;

/// Bound on one connect.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(5);
/// Pause before a connection whose connect failed tries again (a rate
/// limit on a refusing server, not a synchronisation).
const RETRY_PAUSE: Duration = Duration::from_millis(500);

/// Where connections are held, and how many.
#[derive(Clone, Debug)]
pub struct Target {
    /// What the port is (`proxy http`, `prefill bootstrap_addr`, ...).
    pub label: String,
    pub addr: String,
    pub size: usize,
}

#[derive(Default)]
struct Counts {
    opened: AtomicU64,
    closed_by_server: AtomicU64,
    connect_errors: AtomicU64,
    open_now: AtomicU64,
}

pub struct Flood {
    stop: watch::Sender<bool>,
    tasks: tokio::task::JoinSet<()>,
    targets: Vec<(Target, Arc<Counts>)>,
}

/// A target's counts at the end.
pub struct TargetReport {
    pub target: Target,
    pub opened: u64,
    pub closed_by_server: u64,
    pub connect_errors: u64,
}

impl TargetReport {
    pub fn json(&self) -> Value {
        json!({
            "label": self.target.label, "addr": self.target.addr, "size": self.target.size,
            "opened": self.opened, "closed_by_server": self.closed_by_server, "connect_errors": self.connect_errors,
        })
    }
}

/// Whether something listens at `addr` (a KV port may not, in some modes).
pub async fn listening(addr: &str) -> Result<(), String> {
    match tokio::time::timeout(CONNECT_TIMEOUT, TcpStream::connect(addr)).await {
        Ok(Ok(_)) => Ok(()),
        Ok(Err(e)) => Err(e.to_string()),
        Err(_) => Err(format!(
            "no connection within {}s",
            CONNECT_TIMEOUT.as_secs()
        )),
    }
}

impl Flood {
    pub fn start(targets: Vec<Target>) -> Flood {
        let (stop, rx) = watch::channel(false);
        let mut tasks = tokio::task::JoinSet::new();
        let targets: Vec<(Target, Arc<Counts>)> =
            targets.into_iter().map(|t| (t, Arc::default())).collect();
        for (t, counts) in &targets {
            for _ in 0..t.size {
                tasks.spawn(hold(t.addr.clone(), counts.clone(), rx.clone()));
            }
        }
        Flood {
            stop,
            tasks,
            targets,
        }
    }

    /// Connections open now, over every target.
    pub fn open_now(&self) -> u64 {
        self.targets
            .iter()
            .map(|(_, c)| c.open_now.load(Ordering::Relaxed))
            .sum()
    }

    /// Closes every connection (bounded: each task returns on the stop
    /// signal) and reports the counts.
    pub async fn stop(mut self) -> Vec<TargetReport> {
        let _ = self.stop.send(true);
        let bound = tokio::time::sleep(Duration::from_secs(10));
        tokio::pin!(bound);
        loop {
            tokio::select! {
                r = self.tasks.join_next() => if r.is_none() { break },
                _ = &mut bound => {
                    self.tasks.abort_all();
                    break;
                }
            }
        }
        self.targets
            .into_iter()
            .map(|(target, c)| TargetReport {
                target,
                opened: c.opened.load(Ordering::Relaxed),
                closed_by_server: c.closed_by_server.load(Ordering::Relaxed),
                connect_errors: c.connect_errors.load(Ordering::Relaxed),
            })
            .collect()
    }
}

/// One connection slot: connect, wait for the server to close it, count,
/// connect again; until `stop`.
async fn hold(addr: String, counts: Arc<Counts>, mut stop: watch::Receiver<bool>) {
    let mut buf = [0u8; 512];
    while !*stop.borrow() {
        let conn = tokio::select! {
            r = tokio::time::timeout(CONNECT_TIMEOUT, TcpStream::connect(&addr)) => r,
            _ = stop.changed() => return,
        };
        let Ok(Ok(mut conn)) = conn else {
            counts.connect_errors.fetch_add(1, Ordering::Relaxed);
            tokio::select! {
                _ = tokio::time::sleep(RETRY_PAUSE) => continue,
                _ = stop.changed() => return,
            }
        };
        counts.opened.fetch_add(1, Ordering::Relaxed);
        counts.open_now.fetch_add(1, Ordering::Relaxed);
        let stopped = loop {
            tokio::select! {
                r = conn.read(&mut buf) => match r {
                    // Whatever the server says before it closes, then EOF.
                    Ok(0) | Err(_) => break false,
                    Ok(_) => {}
                },
                _ = stop.changed() => break true,
            }
        };
        counts.open_now.fetch_sub(1, Ordering::Relaxed);
        if stopped {
            return;
        }
        counts.closed_by_server.fetch_add(1, Ordering::Relaxed);
    }
}
