//! The TCP driver: a thin tokio layer around [`crate::proto`] and
//! [`crate::frame`].
//!
//! An [`Agent`] listens on an address and serves one-sided reads and writes
//! against its [`Registry`]; as an initiator it opens `conns_per_peer`
//! connections to each peer it addresses and runs batches over them. Data
//! moves straight between sockets and registered memory: a write's data is
//! sent from the local registration and received into the remote one, a
//! read's data likewise, with no staging buffer.
//!
//! Every connection opens with the handshake of [`crate::auth`]: the
//! initiator and the server prove they hold the deployment's KV secret
//! (`AgentConfig::secret`) within `connect_timeout` / `unproven_timeout`,
//! or the connection is closed before any frame is read.
//!
//! Serving side, per connection and in order: read a header (bounded by the
//! idle timeout, or the shorter unproven timeout until the connection made an
//! access the registry accepted), check it,
//! check the access against the registry, move the data (bounded by the I/O
//! timeout), answer. A refused access is answered with its reason and its
//! data drained; a malformed frame closes that connection and nothing else.
//!
//! Connections are capped (`max_conns`), and unproven ones per source
//! address (`max_unproven_per_source`). A connection is *proven* once it
//! completed the handshake with a secret set, or (with none) once it
//! made an access the registry accepted (it knew a live key, which only a
//! peer told over the control channel has); until then it may wait at most
//! `unproven_timeout` for each frame, and at the cap the oldest unproven
//! connection is closed to make room. So clients that connect and idle, or
//! send garbage or stale keys, cannot keep a working peer out, and a proven
//! connection is never closed for a newcomer. Only when every slot is held
//! by proven connections is a new one refused.
//!
//! Initiating side, per peer: one writer and one reader task per connection
//! and one timer task, all sharing the peer's [`Initiator`] behind a mutex
//! that is never held across an await.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::tcp::{OwnedReadHalf, OwnedWriteHalf};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{mpsc, oneshot, Notify};
use tokio::task::JoinHandle;

use crate::auth::{self, KvSecret, Port};
use crate::conns::{Admitted, ConnSlots, Slot};
use crate::error::AccessError;
use crate::frame::{Header, Limits, RemoteError, Target, HEADER_LEN};
use crate::proto::{
    BatchId, ConnId, Direction, Initiator, InitiatorConfig, LocalRange, Request, Response,
    StartError, Stats, Transfer, TransferError,
};
use crate::registry::{Access, Registration, Registry};
use crate::RemoteDescriptor;

#[derive(Clone, Debug)]
pub struct AgentConfig {
    pub conns_per_peer: usize,
    pub limits: Limits,
    pub initiator: InitiatorConfig,
    /// Notifications received and not yet taken by [`Agent::recv_notification`].
    pub notify_queue: usize,
    /// Connections served at once; more are closed on accept.
    pub max_conns: usize,
    /// Unproven connections one source address may hold at once.
    pub max_unproven_per_source: usize,
    /// Peers this agent initiates to at once (each with `conns_per_peer`
    /// connections and their tasks).
    pub max_peers: usize,
    /// The deployment's KV secret, proven by both ends of every connection.
    pub secret: KvSecret,
    /// How long a served connection may sit between frames.
    pub idle_timeout: Duration,
    /// How long a connection not yet proven (no access accepted) may wait
    /// for each frame.
    pub unproven_timeout: Duration,
    /// How long moving one frame's data may take.
    pub io_timeout: Duration,
    /// How long connecting to a peer may take.
    pub connect_timeout: Duration,
}

impl Default for AgentConfig {
    fn default() -> Self {
        AgentConfig {
            conns_per_peer: 2,
            limits: Limits::default(),
            initiator: InitiatorConfig::default(),
            notify_queue: 256,
            max_conns: 256,
            max_unproven_per_source: 64,
            max_peers: 256,
            secret: KvSecret::open(),
            idle_timeout: Duration::from_secs(300),
            unproven_timeout: Duration::from_secs(10),
            io_timeout: Duration::from_secs(30),
            connect_timeout: Duration::from_secs(5),
        }
    }
}

/// A notification delivered by a peer after all data of its batch landed.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Notification {
    pub from: SocketAddr,
    pub payload: Vec<u8>,
}

/// Serving-side counters.
#[derive(Debug, Default)]
pub struct ServeStats {
    pub bytes_in: AtomicU64,
    pub bytes_out: AtomicU64,
    pub ops_served: AtomicU64,
    /// Refused accesses by reason: unknown segment, not registered, bad key
    /// (a revoked grant's included), stale epoch, out of bounds, busy, too
    /// many chunks (shared memory only, never counted here), outside the
    /// grant's ranges.
    pub refused: [AtomicU64; 8],
    pub malformed: AtomicU64,
    /// Connections whose handshake failed (not one, another port, a wrong
    /// secret, too slow).
    pub auth_refused: AtomicU64,
    /// Unproven connections closed to make room for a newcomer at the cap.
    pub evicted: AtomicU64,
    /// Signalled after every operation served (tests wait on progress).
    pub progress: Notify,
}

impl ServeStats {
    pub fn refused_total(&self) -> u64 {
        self.refused.iter().map(|a| a.load(Ordering::Relaxed)).sum()
    }
}

fn refusal_index(e: &RemoteError) -> usize {
    match e {
        RemoteError::Access(AccessError::UnknownSegment { .. }) => 0,
        RemoteError::Access(AccessError::NotRegistered { .. }) => 1,
        RemoteError::Access(AccessError::BadKey { .. }) => 2,
        RemoteError::Access(AccessError::StaleEpoch { .. }) => 3,
        RemoteError::Access(AccessError::OutOfBounds { .. }) => 4,
        RemoteError::Busy => 5,
        RemoteError::TooManyChunks { .. } => 6,
        RemoteError::Access(AccessError::OutsideGrant { .. }) => 7,
    }
}

/// A local range for a batch: a checked grant on a local registration,
/// held for the whole batch (its pages stay mapped until the batch ends).
#[derive(Clone)]
pub struct LocalSlice {
    access: Arc<Access>,
    offset: u64,
    len: u64,
}

impl LocalSlice {
    /// A checked grant on `[offset, offset+len)` of the local registration
    /// `reg` of `registry` (the same check every remote access passes).
    pub fn grant(
        registry: &Registry,
        reg: &Registration,
        offset: u64,
        len: u64,
    ) -> Result<LocalSlice, AccessError> {
        let access = registry.local(reg, offset, len)?;
        Ok(LocalSlice {
            access: Arc::new(access),
            offset: 0,
            len,
        })
    }

    /// # Safety
    /// See [`Access::as_slice`].
    pub(crate) unsafe fn bytes(&self) -> &[u8] {
        // SAFETY: the caller keeps the promise of `Access::as_slice` for this
        // part of the access (see # Safety).
        let all = unsafe { self.access.as_slice() };
        &all[self.offset as usize..(self.offset + self.len) as usize]
    }

    /// # Safety
    /// See [`Access::as_mut_slice`].
    #[allow(clippy::mut_from_ref)]
    pub(crate) unsafe fn bytes_mut(&self) -> &mut [u8] {
        // SAFETY: the caller keeps the promise of `Access::as_mut_slice` for
        // this part of the access (see # Safety).
        let all = unsafe { self.access.as_mut_slice() };
        &mut all[self.offset as usize..(self.offset + self.len) as usize]
    }
}

impl LocalRange for LocalSlice {
    fn len(&self) -> u64 {
        self.len
    }
    fn slice(&self, offset: u64, len: u64) -> LocalSlice {
        assert!(offset + len <= self.len, "LocalSlice::slice out of range");
        LocalSlice {
            access: self.access.clone(),
            offset: self.offset + offset,
            len,
        }
    }
}

/// Why a batch could not run.
#[derive(Debug, thiserror::Error)]
pub enum BatchError {
    #[error(transparent)]
    Transfer(#[from] TransferError),
    #[error(transparent)]
    Start(#[from] StartError),
    #[error("local range refused: {0}")]
    Local(AccessError),
    #[error("a batch addresses one agent; got {0} and {1}")]
    MixedPeers(String, String),
    #[error("connecting to {addr}: {reason}")]
    Connect { addr: String, reason: String },
}

struct PeerState {
    init: Initiator<LocalSlice>,
    waiters: HashMap<BatchId, oneshot::Sender<Result<(), TransferError>>>,
}

struct PeerShared {
    state: Mutex<PeerState>,
    writer_wake: Vec<Notify>,
    timer_wake: Notify,
    limits: Limits,
}

impl PeerShared {
    /// Hands out completions and wakes everyone who may have work now.
    fn dispatch(&self, st: &mut PeerState) {
        while let Some(c) = st.init.poll_event() {
            if let Some(tx) = st.waiters.remove(&c.batch) {
                let _ = tx.send(c.result);
            }
        }
        for w in &self.writer_wake {
            w.notify_one();
        }
        self.timer_wake.notify_one();
    }

    fn lost(&self, conn: ConnId) {
        let mut st = self.state.lock().unwrap();
        st.init.conn_lost(conn);
        self.dispatch(&mut st);
    }
}

struct Peer {
    shared: Arc<PeerShared>,
    tasks: Vec<JoinHandle<()>>,
}

impl Drop for Peer {
    fn drop(&mut self) {
        for t in &self.tasks {
            t.abort();
        }
    }
}

impl Peer {
    async fn connect(addr: &str, cfg: &AgentConfig) -> Result<Peer, BatchError> {
        let connect_err = |reason: String| BatchError::Connect {
            addr: addr.to_string(),
            reason,
        };
        let mut streams = Vec::with_capacity(cfg.conns_per_peer);
        for _ in 0..cfg.conns_per_peer.max(1) {
            let mut s = tokio::time::timeout(cfg.connect_timeout, TcpStream::connect(addr))
                .await
                .map_err(|_| connect_err("timed out".into()))?
                .map_err(|e| connect_err(e.to_string()))?;
            s.set_nodelay(true)
                .map_err(|e| connect_err(e.to_string()))?;
            auth::connect(&mut s, &cfg.secret, Port::Transfer, cfg.connect_timeout)
                .await
                .map_err(|e| connect_err(format!("handshake: {e}")))?;
            streams.push(s);
        }
        let mut init = Initiator::new(cfg.initiator.clone());
        let ids: Vec<ConnId> = streams.iter().map(|_| init.add_conn()).collect();
        let shared = Arc::new(PeerShared {
            state: Mutex::new(PeerState {
                init,
                waiters: HashMap::new(),
            }),
            writer_wake: streams.iter().map(|_| Notify::new()).collect(),
            timer_wake: Notify::new(),
            limits: cfg.limits,
        });
        let mut tasks = Vec::new();
        for (id, s) in ids.into_iter().zip(streams) {
            let (r, w) = s.into_split();
            tasks.push(tokio::spawn(conn_writer(shared.clone(), id, w)));
            tasks.push(tokio::spawn(conn_reader(shared.clone(), id, r)));
        }
        tasks.push(tokio::spawn(peer_timer(shared.clone())));
        Ok(Peer { shared, tasks })
    }
}

async fn conn_writer(shared: Arc<PeerShared>, id: ConnId, mut w: OwnedWriteHalf) {
    loop {
        let req = {
            let mut st = shared.state.lock().unwrap();
            if !st.init.conn_live(id) {
                return; // dropping the half shuts the socket's write side
            }
            st.init.poll_transmit(id)
        };
        let Some(req) = req else {
            shared.writer_wake[id].notified().await;
            continue;
        };
        let res = match &req {
            Request::Write { op, target, local } => {
                let h = Header::WriteReq {
                    op: *op,
                    target: *target,
                }
                .encode();
                match w.write_all(&h).await {
                    // SAFETY: the batch protocol schedules no write into a range it sends from.
                    Ok(()) => w.write_all(unsafe { local.bytes() }).await,
                    Err(e) => Err(e),
                }
            }
            Request::Read { op, target } => {
                w.write_all(
                    &Header::ReadReq {
                        op: *op,
                        target: *target,
                    }
                    .encode(),
                )
                .await
            }
            Request::Notify { op, payload } => {
                let h = Header::Notify {
                    op: *op,
                    len: payload.len() as u32,
                }
                .encode();
                match w.write_all(&h).await {
                    Ok(()) => w.write_all(payload).await,
                    Err(e) => Err(e),
                }
            }
        };
        if res.is_err() {
            shared.lost(id);
            return;
        }
    }
}

async fn conn_reader(shared: Arc<PeerShared>, id: ConnId, mut r: OwnedReadHalf) {
    let mut scratch = Vec::new();
    loop {
        let mut h = [0u8; HEADER_LEN];
        if r.read_exact(&mut h).await.is_err() {
            break;
        }
        let Ok(header) = Header::decode(&h, &shared.limits) else {
            break;
        };
        let (op, resp) = match header {
            Header::WriteAck { op } => (op, Response::WriteAck),
            Header::NotifyAck { op } => (op, Response::NotifyAck),
            Header::Error { op, error } => (op, Response::Error(error)),
            Header::ReadResp { op, len } => {
                let target = shared.state.lock().unwrap().init.read_target(op);
                let ok = match target {
                    Some(local) if local.len() == len as u64 => {
                        // SAFETY: the read's local range is written by this read only.
                        r.read_exact(unsafe { local.bytes_mut() }).await.is_ok()
                    }
                    Some(_) => false,
                    None => drain(&mut r, len as u64, &mut scratch).await.is_ok(),
                };
                if !ok {
                    break;
                }
                (op, Response::ReadDone { len: len as u64 })
            }
            _ => break,
        };
        let mut st = shared.state.lock().unwrap();
        let res = st.init.on_response(id, op, resp);
        shared.dispatch(&mut st);
        if let Err(v) = res {
            tracing::warn!("{v}");
            break;
        }
    }
    shared.lost(id);
}

async fn peer_timer(shared: Arc<PeerShared>) {
    loop {
        let next = shared.state.lock().unwrap().init.poll_timeout();
        match next {
            Some(t) => {
                tokio::select! {
                    _ = tokio::time::sleep_until(tokio::time::Instant::from_std(t)) => {
                        let mut st = shared.state.lock().unwrap();
                        st.init.handle_timeout(Instant::now());
                        shared.dispatch(&mut st);
                    }
                    _ = shared.timer_wake.notified() => {}
                }
            }
            None => shared.timer_wake.notified().await,
        }
    }
}

async fn drain(r: &mut OwnedReadHalf, mut n: u64, scratch: &mut Vec<u8>) -> std::io::Result<()> {
    scratch.resize(64 << 10, 0);
    while n > 0 {
        let k = (n as usize).min(scratch.len());
        r.read_exact(&mut scratch[..k]).await?;
        n -= k as u64;
    }
    Ok(())
}

/// A running batch: await it, or cancel it. Dropping an unfinished handle
/// cancels the batch.
pub struct BatchHandle {
    shared: Arc<PeerShared>,
    batch: BatchId,
    rx: Option<oneshot::Receiver<Result<(), TransferError>>>,
}

fn cancel_batch(shared: &PeerShared, batch: BatchId) {
    let mut st = shared.state.lock().unwrap();
    st.init.cancel(batch);
    shared.dispatch(&mut st);
}

impl BatchHandle {
    pub fn id(&self) -> BatchId {
        self.batch
    }

    /// Ends the batch with `Cancelled` unless it already ended.
    pub fn cancel(&self) {
        cancel_batch(&self.shared, self.batch);
    }

    /// A function that cancels the batch, for whoever must stop it while
    /// another task waits for it.
    pub fn canceller(&self) -> impl Fn() + Send + Sync + 'static {
        let (shared, batch) = (self.shared.clone(), self.batch);
        move || cancel_batch(&shared, batch)
    }

    /// Waits for the batch to end (by its deadline at the latest).
    pub async fn wait(mut self) -> Result<(), TransferError> {
        let rx = self.rx.take().expect("wait consumes the handle");
        // The sender lives until the batch ends; if the peer's tasks are gone
        // it is dropped and the peer counts as lost.
        rx.await.unwrap_or(Err(TransferError::PeerLost))
    }
}

impl Drop for BatchHandle {
    fn drop(&mut self) {
        if self.rx.is_some() {
            self.cancel();
        }
    }
}

/// One transfer endpoint: serves its registrations and initiates batches.
pub struct Agent {
    registry: Arc<Registry>,
    cfg: AgentConfig,
    addr: SocketAddr,
    peers: tokio::sync::Mutex<HashMap<String, Arc<Peer>>>,
    notify_rx: tokio::sync::Mutex<mpsc::Receiver<Notification>>,
    stats: Arc<ServeStats>,
    accept: JoinHandle<()>,
}

impl Drop for Agent {
    fn drop(&mut self) {
        self.accept.abort();
    }
}

impl Agent {
    /// Listens on `addr` (e.g. "127.0.0.1:0") and starts serving.
    pub async fn bind(
        addr: &str,
        registry: Arc<Registry>,
        cfg: AgentConfig,
    ) -> std::io::Result<Agent> {
        let listener = crate::listen::bind(addr).await?;
        let addr = listener.local_addr()?;
        let (notify_tx, notify_rx) = mpsc::channel(cfg.notify_queue.max(1));
        let stats = Arc::new(ServeStats::default());
        let accept = tokio::spawn(accept_loop(
            listener,
            registry.clone(),
            cfg.clone(),
            notify_tx,
            stats.clone(),
        ));
        Ok(Agent {
            registry,
            cfg,
            addr,
            peers: tokio::sync::Mutex::new(HashMap::new()),
            notify_rx: tokio::sync::Mutex::new(notify_rx),
            stats,
            accept,
        })
    }

    pub fn local_addr(&self) -> SocketAddr {
        self.addr
    }

    pub fn registry(&self) -> &Arc<Registry> {
        &self.registry
    }

    pub fn serve_stats(&self) -> &Arc<ServeStats> {
        &self.stats
    }

    /// Describes `[offset, offset+len)` of a local registration for a peer.
    pub fn describe(&self, reg: &Registration, offset: u64, len: u64) -> RemoteDescriptor {
        RemoteDescriptor::new(self.addr.to_string(), reg, offset, len)
    }

    /// Describes `[offset, offset+len)` of a local registration for a peer,
    /// through `grant`: the peer's accesses are confined to the grant's
    /// ranges and end when it is revoked.
    pub fn describe_grant(&self, grant: &crate::Grant, offset: u64, len: u64) -> RemoteDescriptor {
        RemoteDescriptor::granted(self.addr.to_string(), grant, offset, len)
    }

    /// A checked local range for a batch.
    pub fn local(
        &self,
        reg: &Registration,
        offset: u64,
        len: u64,
    ) -> Result<LocalSlice, BatchError> {
        LocalSlice::grant(&self.registry, reg, offset, len).map_err(BatchError::Local)
    }

    /// Per-peer initiator counters.
    pub async fn peer_stats(&self) -> Vec<(String, Stats)> {
        let peers = self.peers.lock().await;
        peers
            .iter()
            .map(|(a, p)| {
                (
                    a.clone(),
                    p.shared.state.lock().unwrap().init.stats().clone(),
                )
            })
            .collect()
    }

    /// The next notification a peer delivered, waiting at most `timeout`.
    pub async fn recv_notification(&self, timeout: Duration) -> Option<Notification> {
        let mut rx = self.notify_rx.lock().await;
        tokio::time::timeout(timeout, rx.recv())
            .await
            .ok()
            .flatten()
    }

    async fn peer(&self, addr: &str) -> Result<Arc<Peer>, BatchError> {
        let mut peers = self.peers.lock().await;
        if let Some(p) = peers.get(addr) {
            if p.shared.state.lock().unwrap().init.live_conns() > 0 {
                return Ok(p.clone());
            }
        }
        // Peers whose connections all broke are forgotten before a new one
        // is counted against the bound.
        peers.retain(|_, p| p.shared.state.lock().unwrap().init.live_conns() > 0);
        if peers.len() >= self.cfg.max_peers {
            return Err(BatchError::Connect {
                addr: addr.to_string(),
                reason: format!(
                    "this agent is connected to {} peers already, the most it keeps",
                    self.cfg.max_peers
                ),
            });
        }
        let p = Arc::new(Peer::connect(addr, &self.cfg).await?);
        peers.insert(addr.to_string(), p.clone());
        Ok(p)
    }

    /// Starts a batch: `Write` sends each local range to its remote range,
    /// `Read` fetches each remote range into its local range. All remotes
    /// must belong to one agent. `notify` is delivered to that agent after
    /// all the batch's data landed. The batch ends by `timeout` at the latest.
    pub async fn start(
        &self,
        dir: Direction,
        transfers: Vec<(LocalSlice, RemoteDescriptor)>,
        notify: Option<Vec<u8>>,
        timeout: Duration,
    ) -> Result<BatchHandle, BatchError> {
        let deadline = Instant::now() + timeout;
        let Some(first) = transfers.first().map(|t| t.1.agent_addr.clone()) else {
            return Err(BatchError::Start(StartError::TooManyOps(0)));
        };
        if let Some(t) = transfers.iter().find(|t| t.1.agent_addr != first) {
            return Err(BatchError::MixedPeers(first, t.1.agent_addr.clone()));
        }
        let peer = tokio::time::timeout(timeout, self.peer(&first))
            .await
            .map_err(|_| TransferError::Timeout)??;
        let transfers = transfers
            .into_iter()
            .map(|(local, d)| Transfer {
                local,
                remote: crate::frame::Target {
                    segment: d.segment,
                    key: d.key,
                    epoch: d.epoch,
                    offset: d.offset,
                    len: d.len,
                },
            })
            .collect();
        let (tx, rx) = oneshot::channel();
        let shared = peer.shared.clone();
        let mut st = shared.state.lock().unwrap();
        let batch = st
            .init
            .start(Instant::now(), dir, transfers, notify, deadline)?;
        st.waiters.insert(batch, tx);
        shared.dispatch(&mut st);
        drop(st);
        Ok(BatchHandle {
            shared,
            batch,
            rx: Some(rx),
        })
    }

    /// Writes local ranges to remote ranges and waits for the batch.
    pub async fn write(
        &self,
        transfers: Vec<(LocalSlice, RemoteDescriptor)>,
        notify: Option<Vec<u8>>,
        timeout: Duration,
    ) -> Result<(), BatchError> {
        Ok(self
            .start(Direction::Write, transfers, notify, timeout)
            .await?
            .wait()
            .await?)
    }

    /// Reads remote ranges into local ranges and waits for the batch.
    pub async fn read(
        &self,
        transfers: Vec<(RemoteDescriptor, LocalSlice)>,
        timeout: Duration,
    ) -> Result<(), BatchError> {
        let t = transfers.into_iter().map(|(r, l)| (l, r)).collect();
        Ok(self
            .start(Direction::Read, t, None, timeout)
            .await?
            .wait()
            .await?)
    }
}

/// Pause after a failed accept (out of descriptors, say).
const ACCEPT_BACKOFF: Duration = Duration::from_millis(100);

async fn accept_loop(
    listener: TcpListener,
    registry: Arc<Registry>,
    cfg: AgentConfig,
    notify_tx: mpsc::Sender<Notification>,
    stats: Arc<ServeStats>,
) {
    let slots = ConnSlots::new(cfg.max_conns, cfg.max_unproven_per_source);
    loop {
        let (stream, from) = match listener.accept().await {
            Ok(c) => c,
            Err(e) => {
                tracing::warn!("transfer accept failed: {e}; retrying in {ACCEPT_BACKOFF:?}");
                tokio::time::sleep(ACCEPT_BACKOFF).await;
                continue;
            }
        };
        let slot = match slots.admit(from.ip()).await {
            Some((slot, how)) => {
                if how != Admitted::Free {
                    stats.evicted.fetch_add(1, Ordering::Relaxed);
                    tokio::time::sleep(crate::conns::EVICT_BACKOFF).await;
                }
                slot
            }
            None => {
                tracing::warn!(%from, "connection refused: {} served already, all proven", cfg.max_conns);
                continue;
            }
        };
        let _ = stream.set_nodelay(true);
        let id = slot.id();
        let (registry, cfg, notify_tx, stats) = (
            registry.clone(),
            cfg.clone(),
            notify_tx.clone(),
            stats.clone(),
        );
        let task = tokio::spawn(async move {
            if let Err(why) =
                serve_conn(stream, from, &registry, &cfg, &notify_tx, &stats, &slot).await
            {
                tracing::debug!(%from, "connection closed: {why}");
            }
        });
        slots.attach(id, task.abort_handle());
    }
}

/// Runs one I/O step with a deadline.
async fn timed<T>(
    limit: Duration,
    f: impl std::future::Future<Output = std::io::Result<T>>,
    what: &str,
) -> Result<T, String> {
    match tokio::time::timeout(limit, f).await {
        Ok(Ok(v)) => Ok(v),
        Ok(Err(e)) => Err(format!("{what}: {e}")),
        Err(_) => Err(format!("{what}: timed out")),
    }
}

/// Serves one connection until it closes or misbehaves.
async fn serve_conn(
    stream: TcpStream,
    from: SocketAddr,
    registry: &Registry,
    cfg: &AgentConfig,
    notify_tx: &mpsc::Sender<Notification>,
    stats: &ServeStats,
    slot: &Slot,
) -> Result<(), String> {
    let conn = Served {
        from,
        registry,
        cfg,
        notify_tx,
        stats,
        slot,
    };
    let mut stream = stream;
    conn.handshake(&mut stream).await?;
    let (mut r, mut w) = stream.into_split();
    let mut scratch = Vec::new();
    loop {
        let Some(h) = conn.next_header(&mut r).await? else {
            return Ok(());
        };
        let header = Header::decode(&h, &cfg.limits).map_err(|e| {
            stats.malformed.fetch_add(1, Ordering::Relaxed);
            format!("malformed frame: {e}")
        })?;
        let t = cfg.io_timeout;
        let reply = match header {
            Header::Hello { .. } => Header::Hello { agent: 0 },
            Header::WriteReq { op, target } => conn.write(op, target, &mut r, &mut scratch).await?,
            Header::ReadReq { op, target } => match conn.read(op, target, &mut w).await? {
                Some(reply) => reply,
                // Answered with the data, and counted.
                None => continue,
            },
            Header::Notify { op, len } => conn.notify(op, len, &mut r).await?,
            other => {
                stats.malformed.fetch_add(1, Ordering::Relaxed);
                return Err(format!("unexpected frame {other:?}"));
            }
        };
        if let Header::Error { error, .. } = &reply {
            stats.refused[refusal_index(error)].fetch_add(1, Ordering::Relaxed);
        }
        timed(t, w.write_all(&reply.encode()), "reply").await?;
        stats.ops_served.fetch_add(1, Ordering::Relaxed);
        stats.progress.notify_waiters();
    }
}

/// What serving one connection uses besides its stream: one step each for
/// the handshake, the next header, and each request a peer may send.
struct Served<'a> {
    from: SocketAddr,
    registry: &'a Registry,
    cfg: &'a AgentConfig,
    notify_tx: &'a mpsc::Sender<Notification>,
    stats: &'a ServeStats,
    slot: &'a Slot,
}

impl Served<'_> {
    /// The peer proves it holds the deployment's secret (an open secret
    /// proves the connection at once).
    async fn handshake(&self, stream: &mut TcpStream) -> Result<(), String> {
        let (from, cfg, stats) = (self.from, self.cfg, self.stats);
        if let Err(e) =
            auth::accept(stream, &cfg.secret, Port::Transfer, cfg.unproven_timeout).await
        {
            stats.auth_refused.fetch_add(1, Ordering::Relaxed);
            stats.progress.notify_waiters();
            if matches!(
                e,
                auth::AuthError::BadProof | auth::AuthError::WrongPort { .. }
            ) {
                tracing::info!(%from, "KV transfer connection refused: {e}");
            }
            return Err(format!("handshake: {e}"));
        }
        if !cfg.secret.is_open() {
            self.slot.prove();
        }
        Ok(())
    }

    /// The next frame's header, within the unproven or the idle timeout;
    /// `None` when the peer closed the connection.
    async fn next_header(&self, r: &mut OwnedReadHalf) -> Result<Option<[u8; HEADER_LEN]>, String> {
        let cfg = self.cfg;
        let mut h = [0u8; HEADER_LEN];
        let unproven = !self.slot.is_proven();
        let wait = if unproven {
            cfg.unproven_timeout
        } else {
            cfg.idle_timeout
        };
        match tokio::time::timeout(wait, r.read_exact(&mut h)).await {
            Err(_) if unproven => return Err("no accepted access in time".into()),
            Err(_) => return Err("idle timeout".into()),
            Ok(Err(e)) if e.kind() == std::io::ErrorKind::UnexpectedEof => return Ok(None),
            Ok(Err(e)) => return Err(e.to_string()),
            Ok(Ok(_)) => {}
        }
        Ok(Some(h))
    }

    /// The registration range `target` names, if its key and epoch hold:
    /// an accepted access proves the connection.
    fn access(&self, target: &Target) -> Result<Access, AccessError> {
        let Target {
            segment,
            key,
            epoch,
            offset,
            len,
        } = *target;
        let a = self.registry.access(segment, key, epoch, offset, len)?;
        self.slot.prove();
        Ok(a)
    }

    /// A write: its data lands in the registration, or is drained when the
    /// access is refused.
    async fn write(
        &self,
        op: u64,
        target: Target,
        r: &mut OwnedReadHalf,
        scratch: &mut Vec<u8>,
    ) -> Result<Header, String> {
        let t = self.cfg.io_timeout;
        let reply = match self.access(&target) {
            Ok(a) => {
                // SAFETY: a write's target range is written by this write only.
                timed(t, r.read_exact(unsafe { a.as_mut_slice() }), "write data").await?;
                self.stats.bytes_in.fetch_add(target.len, Ordering::Relaxed);
                Header::WriteAck { op }
            }
            Err(e) => {
                timed(t, drain(r, target.len, scratch), "drain").await?;
                Header::Error {
                    op,
                    error: e.into(),
                }
            }
        };
        Ok(reply)
    }

    /// A read: answered here with the data (and counted: `None`), or the
    /// refusal to send.
    async fn read(
        &self,
        op: u64,
        target: Target,
        w: &mut OwnedWriteHalf,
    ) -> Result<Option<Header>, String> {
        let (t, stats) = (self.cfg.io_timeout, self.stats);
        match self.access(&target) {
            Ok(a) => {
                let head = Header::ReadResp {
                    op,
                    len: target.len as u32,
                }
                .encode();
                timed(t, w.write_all(&head), "read resp").await?;
                // SAFETY: no write is scheduled into a range being read.
                timed(t, w.write_all(unsafe { a.as_slice() }), "read data").await?;
                stats.bytes_out.fetch_add(target.len, Ordering::Relaxed);
                stats.ops_served.fetch_add(1, Ordering::Relaxed);
                stats.progress.notify_waiters();
                Ok(None)
            }
            Err(e) => Ok(Some(Header::Error {
                op,
                error: e.into(),
            })),
        }
    }

    /// A notification: queued for the agent, or refused while the queue is
    /// full.
    async fn notify(&self, op: u64, len: u32, r: &mut OwnedReadHalf) -> Result<Header, String> {
        let mut payload = vec![0u8; len as usize];
        timed(self.cfg.io_timeout, r.read_exact(&mut payload), "notify").await?;
        let from = self.from;
        Ok(
            match self.notify_tx.try_send(Notification { from, payload }) {
                Ok(()) => Header::NotifyAck { op },
                Err(_) => Header::Error {
                    op,
                    error: RemoteError::Busy,
                },
            },
        )
    }
}
