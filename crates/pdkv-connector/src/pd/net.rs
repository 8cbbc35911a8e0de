//! The production driver of the P/D connector: the control listener, the
//! control exchanges, the TCP agent's writes and reads, the shared-memory
//! exporter and importers, the fences, and the core's timer, on the
//! connector's tokio runtime. It decides nothing: every message and result
//! goes to [`PdCore`] through [`Shared::event`], and it carries out the
//! [`Io`] the core queues.

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::Context;
use pdkv_transfer::auth::{self, KvSecret, Port};
use pdkv_transfer::conns::{ConnSlots, Slot};
use pdkv_transfer::frame::{Limits, RemoteError, Target};
use pdkv_transfer::proto::{Direction, Transfer, TransferError};
use pdkv_transfer::shm::{ExportOptions, ShmError, ShmExporter, ShmImporter, ShmImporterConfig};
use pdkv_transfer::tcp::{Agent, AgentConfig, BatchError, LocalSlice};
use pdkv_transfer::{Registration, Registry, RegistryOptions, RemoteDescriptor};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{mpsc, Notify};

use super::bootstrap;
use super::core::{ConnId, Io, PdCore, ReadIo, SendIo, WriteIo, CONTROL_IO};
use super::{Driver, Shared};
use crate::config::{KvTransferConfig, TransferMode, Transport};
use crate::recv::LoadId;
use crate::wire::{self, Destination, FailCode, Failure, Message};

/// How long a fence waits for accesses in flight (or peers' unmap acks).
const FENCE_WAIT: Duration = Duration::from_secs(5);

/// Binds the listener, the agent and (when a peer maps this engine's
/// memory) the shared-memory exporter, and starts the accept loop and the
/// core's timer on `runtime`.
pub fn start(
    runtime: &tokio::runtime::Runtime,
    cfg: KvTransferConfig,
    engine_id: &str,
) -> anyhow::Result<Arc<Shared>> {
    let registry = Arc::new(Registry::new(RegistryOptions::default()));
    let ip = cfg.kv_ip.clone();
    let (agent, listener) = runtime.block_on(async {
        let agent_cfg = AgentConfig {
            secret: cfg.kv_secret.clone(),
            unproven_timeout: cfg.unproven_timeout,
            ..AgentConfig::default()
        };
        let agent = Agent::bind(&format!("{ip}:0"), registry.clone(), agent_cfg)
            .await
            .with_context(|| format!("binding the KV transfer agent on {ip}"))?;
        let listener = pdkv_transfer::listen::bind((ip.as_str(), cfg.kv_port))
            .await
            .with_context(|| format!("binding the KV control listener on {ip}:{}", cfg.kv_port))?;
        anyhow::Ok((agent, listener))
    })?;
    let control_addr = listener.local_addr()?;
    // The exporter serves the side whose memory the peer copies to or
    // from: D's in write mode, P's in read mode.
    let exports = match cfg.transfer_mode {
        TransferMode::Write => cfg.kv_role.consumes(),
        TransferMode::Read => cfg.kv_role.produces(),
    };
    let (dest, exporter) = if exports && cfg.transport == Transport::Shm {
        let stale = remove_stale_sockets(&cfg.shm_dir, STALE_SOCKET_AGE);
        if stale > 0 {
            tracing::info!(
                stale,
                dir = %cfg.shm_dir.display(),
                "removed shared-memory sockets that killed pdkv processes left (nothing listens on them)"
            );
        }
        let path = cfg
            .shm_dir
            .join(format!("pdkv-{engine_id}-{}.sock", std::process::id()));
        let _ = std::fs::remove_file(&path);
        let opts = ExportOptions {
            secret: cfg.kv_secret.clone(),
            ..ExportOptions::default()
        };
        let exp = ShmExporter::bind_with(&path, registry.clone(), Limits::default(), opts)
            .with_context(|| format!("binding the shared-memory exporter at {}", path.display()))?;
        (
            Destination::Shm {
                path: path.display().to_string(),
            },
            Some(exp),
        )
    } else {
        (
            Destination::Tcp {
                addr: agent.local_addr().to_string(),
            },
            None,
        )
    };
    if cfg.kv_secret.is_open() {
        tracing::warn!(
            "no KV secret (--kv-secret / PDKV_KV_SECRET): any process that reaches the KV ports and speaks pdkv's handshake can use them"
        );
    }
    let secret = cfg.kv_secret.clone();
    let unproven = cfg.unproven_timeout.min(CONTROL_IO);
    let core = PdCore::new(
        cfg,
        engine_id,
        control_addr.to_string(),
        dest,
        registry.clone(),
    );
    let inner = Arc::new(Net {
        handle: runtime.handle().clone(),
        secret,
        unproven,
        auth_refused: AtomicU64::new(0),
        registry,
        agent,
        exporter,
        replies: Mutex::new(HashMap::new()),
        reads: Mutex::new(HashMap::new()),
        importers: Mutex::new(HashMap::new()),
        mapping: tokio::sync::Mutex::new(()),
        timer: Arc::new(Notify::new()),
        next_conn: AtomicU64::new(1),
        unwritten: Mutex::new(0),
        written: std::sync::Condvar::new(),
    });
    let shared = Shared::new(core, Box::new(NetDriver(inner.clone())));
    runtime.spawn(accept_loop(shared.clone(), inner.clone(), listener));
    runtime.spawn(core_timer(shared.clone(), inner.timer.clone()));
    Ok(shared)
}

/// The replies a connection waits for (P side).
type ReplyTx = mpsc::UnboundedSender<(Message, bool)>;

struct NetDriver(Arc<Net>);

/// The driver's state, shared with its tasks.
struct Net {
    handle: tokio::runtime::Handle,
    /// The deployment's KV secret, for the control port and its exchanges.
    secret: KvSecret,
    /// How long a control connection may take to prove itself (its
    /// handshake and first message): `kv_unproven_timeout_s`, at most
    /// `CONTROL_IO`.
    unproven: Duration,
    /// Control connections whose handshake failed.
    auth_refused: AtomicU64,
    registry: Arc<Registry>,
    agent: Agent,
    /// This engine's shared-memory exporter, alive as long as the connector
    /// (its drop removes the socket file).
    exporter: Option<ShmExporter>,
    replies: Mutex<HashMap<ConnId, ReplyTx>>,
    /// Cancels a read in flight, by load.
    reads: Mutex<HashMap<LoadId, Box<dyn Fn() + Send>>>,
    /// Shared-memory peers this engine copies to or from, by socket path.
    importers: Mutex<HashMap<String, Arc<ShmImporter>>>,
    /// Held while connecting to a peer or mapping its KV cache: two
    /// transfers that find it unmapped at once must not both map it, as
    /// the second map retires the first mapping under the first transfer's
    /// batch (which then fails with `NotRegistered`).
    mapping: tokio::sync::Mutex<()>,
    timer: Arc<Notify>,
    next_conn: AtomicU64,
    /// Final answers handed to a connection and not yet written, so a
    /// shutdown can deliver them (bounded) before the runtime stops.
    unwritten: Mutex<usize>,
    written: std::sync::Condvar,
}

impl Driver for NetDriver {
    fn now(&self) -> Instant {
        Instant::now()
    }

    fn execute(&self, shared: &Arc<Shared>, io: Io) {
        let d = &self.0;
        match io {
            Io::Reply { conn, msg, last } => {
                let tx = if last {
                    d.replies.lock().unwrap().remove(&conn)
                } else {
                    d.replies.lock().unwrap().get(&conn).cloned()
                };
                if let Some(tx) = tx {
                    if last {
                        *d.unwritten.lock().unwrap() += 1;
                    }
                    if tx.send((msg, last)).is_err() && last {
                        d.final_written();
                    }
                }
            }
            Io::Write(write) => {
                let (s, n) = (shared.clone(), d.clone());
                d.handle.spawn(async move {
                    let res = write_blocks(&n, &write).await;
                    let bytes = write.copies.iter().map(|c| c.len).sum();
                    s.event(|c, now| c.on_write_done(now, write.conn, res, bytes));
                });
            }
            Io::Send(send) => {
                let (s, secret) = (shared.clone(), d.secret.clone());
                d.handle
                    .spawn(async move { exchange(&s, &secret, send).await });
            }
            Io::Read(read) => {
                let (s, n) = (shared.clone(), d.clone());
                d.handle.spawn(async move {
                    let load = read.load;
                    let res = read_blocks(&n, &read).await;
                    n.reads.lock().unwrap().remove(&load);
                    s.event(|c, now| c.on_read_result(now, load, res));
                });
            }
            Io::CancelRead { load } => {
                if let Some(cancel) = d.reads.lock().unwrap().get(&load) {
                    cancel();
                }
            }
            Io::Fence { load, ranks } => {
                let (s, n) = (shared.clone(), d.clone());
                d.handle.spawn(async move {
                    let res = tokio::task::spawn_blocking(move || {
                        ranks
                            .iter()
                            .try_for_each(|&(segment, grant)| n.fence(segment, grant))
                    })
                    .await
                    .unwrap_or_else(|e| {
                        Err(Failure::new(
                            FailCode::Protocol,
                            format!("the fence task failed: {e}"),
                        ))
                    });
                    s.event(|c, now| c.on_fenced(now, load, res));
                });
            }
        }
    }

    fn deregister(&self, segment: u64, timeout: Duration) -> anyhow::Result<()> {
        match &self.0.exporter {
            Some(exp) => exp.deregister(segment, timeout).map_err(|e| {
                anyhow::anyhow!(
                    "shared-memory peers did not unmap the KV cache (segment {segment}): {e}"
                )
            }),
            None => {
                self.0.registry.deregister(segment);
                Ok(())
            }
        }
    }

    fn timer_changed(&self, _shared: &Arc<Shared>) {
        self.0.timer.notify_one();
    }

    /// Over shared memory (the side a peer maps): whether the peer may map
    /// the registration's memfds at all.
    fn check_registration(&self, reg: &Registration) -> anyhow::Result<()> {
        match &self.0.exporter {
            Some(exp) => check_shareable(exp, reg),
            None => Ok(()),
        }
    }

    fn counters(&self) -> Vec<(&'static str, &'static str, f64)> {
        let n = &self.0;
        let serve = n.agent.serve_stats();
        let f = |a: &AtomicU64| a.load(Ordering::Relaxed) as f64;
        vec![
            (
                "handshakes_refused_total",
                "KV transfer, shared-memory and control connections whose handshake failed (not one, too slow, or without the KV secret)",
                f(&serve.auth_refused) + f(&n.auth_refused) + n.exporter.as_ref().map_or(0.0, |e| e.refused() as f64),
            ),
            (
                "unproven_closed_total",
                "Unproven KV transfer connections closed to make room for a newcomer",
                f(&serve.evicted),
            ),
            ("malformed_frames_total", "Malformed frames on the KV transfer port (each closed its connection)", f(&serve.malformed)),
        ]
    }

    /// Waits (at most `timeout`) until every final answer the core gave a
    /// connection was written: an engine that aborts its requests as it
    /// stops tells the decode engines so, instead of vanishing.
    fn flush(&self, timeout: Duration) {
        let deadline = Instant::now() + timeout;
        let mut n = self.0.unwritten.lock().unwrap();
        while *n > 0 {
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                tracing::warn!(
                    answers = *n,
                    "stopping with control answers not yet written"
                );
                return;
            }
            n = self.0.written.wait_timeout(n, left).unwrap().0;
        }
    }
}

/// Whether `exp` can share `reg` with its peers (see
/// [`ShmExporter::check_shareable`]); the error keeps the typed
/// [`pdkv_transfer::shm::ShmError`] as its source.
fn check_shareable(exp: &ShmExporter, reg: &Registration) -> anyhow::Result<()> {
    exp.check_shareable(reg).with_context(|| {
        format!(
            "the shared-memory transport cannot share the KV cache registration (segment {}, {} bytes) with its peers; \
             use \"transport\":\"tcp\" or a KV cache in fewer memory chunks",
            reg.segment, reg.len
        )
    })
}

impl Net {
    fn final_written(&self) {
        let mut n = self.unwritten.lock().unwrap();
        *n = n.saturating_sub(1);
        self.written.notify_all();
    }

    /// Nothing of the load can land any more: its grant revoked (a TCP
    /// write holding it finishes first) and, over shared memory, every
    /// peer's mapping of the segment gone.
    fn fence(&self, segment: u64, grant: Option<u64>) -> Result<(), Failure> {
        let lost = |e: String| Failure::new(FailCode::Timeout, e);
        if let Some(key) = grant {
            self.registry
                .revoke(segment, key, FENCE_WAIT)
                .map_err(|e| lost(format!("revoking the load's grant: {e}")))?;
        }
        if let Some(exp) = &self.exporter {
            exp.fence(segment, FENCE_WAIT)
                .map_err(|e| lost(format!("peers did not unmap the KV cache: {e}")))?;
        }
        Ok(())
    }
}

/// Runs the core's timer: deadlines, heartbeats, leases, tombstones, fence
/// retries.
async fn core_timer(shared: Arc<Shared>, changed: Arc<Notify>) {
    loop {
        let next = shared.inspect(|c| c.poll_timeout());
        match next {
            Some(t) => {
                tokio::select! {
                    _ = tokio::time::sleep_until(tokio::time::Instant::from_std(t)) => {
                        shared.event(|c, now| c.handle_timeout(now));
                    }
                    _ = changed.notified() => {}
                }
            }
            None => changed.notified().await,
        }
    }
}

/// Control connections served at once. One that has not yet sent a
/// well-formed message is unproven (it must within `Net::unproven`), and at
/// the cap the oldest unproven one is closed for a newcomer
/// ([`pdkv_transfer::conns`]), so clients that connect and idle or send
/// garbage cannot keep D's exchanges out.
const MAX_CONTROL_CONNS: usize = 1024;
/// Unproven control connections one source address may hold at once.
const MAX_UNPROVEN_PER_SOURCE: usize = 128;

async fn accept_loop(shared: Arc<Shared>, d: Arc<Net>, listener: TcpListener) {
    let slots = ConnSlots::new(MAX_CONTROL_CONNS, MAX_UNPROVEN_PER_SOURCE);
    loop {
        let (stream, from) = match listener.accept().await {
            Ok(c) => c,
            Err(e) => {
                // Out of descriptors, say: back off instead of spinning.
                tracing::warn!("control accept failed: {e}");
                tokio::time::sleep(Duration::from_millis(100)).await;
                continue;
            }
        };
        let Some((slot, how)) = slots.admit(from.ip()).await else {
            tracing::warn!(%from, "control connection refused: {MAX_CONTROL_CONNS} exchanges in flight");
            continue;
        };
        if how != pdkv_transfer::conns::Admitted::Free {
            tokio::time::sleep(pdkv_transfer::conns::EVICT_BACKOFF).await;
        }
        let id = slot.id();
        let (shared, d) = (shared.clone(), d.clone());
        let task = tokio::spawn(async move {
            if let Err(e) = serve_control(&shared, &d, stream, &slot).await {
                tracing::debug!(%from, "control connection closed: {e}");
            }
        });
        slots.attach(id, task.abort_handle());
    }
}

/// Serves one control exchange: the request goes to the core, its replies
/// (progress frames, then the final answer) back to the peer.
async fn serve_control(
    shared: &Arc<Shared>,
    d: &Net,
    mut s: TcpStream,
    slot: &Slot,
) -> Result<(), wire::WireError> {
    let _ = s.set_nodelay(true);
    let prefix = wire::read_prefix(&mut s, d.unproven).await?;
    if &prefix == b"GET " {
        // A router's bootstrap query. No message is this long (the prefix
        // would announce over 1 GB), so the two cannot be confused.
        return bootstrap::serve(shared, s).await;
    }
    if let Err(e) = auth::accept_after(&mut s, &prefix, &d.secret, Port::Control, d.unproven).await
    {
        d.auth_refused.fetch_add(1, Ordering::Relaxed);
        if matches!(
            e,
            auth::AuthError::BadProof | auth::AuthError::WrongPort { .. }
        ) {
            tracing::info!("KV control connection refused: {e}");
        }
        return Err(e.into());
    }
    let msg = wire::read_message(&mut s, d.unproven).await?;
    // Authentic and well formed: from here on the exchange is bounded by
    // the core's deadlines, and it is not closed for a newcomer.
    slot.prove();
    let conn = d.next_conn.fetch_add(1, Ordering::Relaxed);
    // Unbounded because the core's I/O is carried out without awaiting (no
    // room to wait for); bounded by the exchange: the core sends one final
    // answer and, for a pull, one `PullProgress` when it is queued and one
    // per `heartbeat_s` while it waits for P's KV. The exchange ends by
    // `limit` below (then the receiver is dropped and `replies` forgets the
    // sender), so it queues at most `limit / heartbeat + 2` small frames,
    // and the control listener serves a bounded number of exchanges.
    let (tx, mut rx) = mpsc::unbounded_channel();
    d.replies.lock().unwrap().insert(conn, tx);
    shared.event(|c, now| c.on_control(now, conn, msg));
    // The core answers every exchange by its deadlines (a pull: at most the
    // prefill timeout plus a write); the bound only guards a lost answer.
    let limit = shared.inspect(|c| {
        let cfg = c.config();
        cfg.prefill_timeout + cfg.abort_timeout + cfg.arrival_timeout + CONTROL_IO
    });
    let until = tokio::time::Instant::now() + limit;
    loop {
        match tokio::time::timeout_at(until, rx.recv()).await {
            Ok(Some((msg, last))) => {
                let r = wire::write_message(&mut s, &msg, CONTROL_IO).await;
                if last {
                    d.final_written();
                    return r;
                }
                r?;
            }
            _ => {
                d.replies.lock().unwrap().remove(&conn);
                let msg = Message::Error {
                    reason: "the engine lost the exchange".into(),
                };
                return wire::write_message(&mut s, &msg, CONTROL_IO).await;
            }
        }
    }
}

/// D's side of one exchange: every frame of the answer goes to the core.
async fn exchange(shared: &Arc<Shared>, secret: &KvSecret, send: SendIo) {
    let SendIo {
        op,
        addr,
        msg,
        deadline,
    } = send;
    let (addr, msg) = (addr.as_str(), &msg);
    let failed = |f: Failure, sent: bool| {
        shared.event(|c, now| c.on_exchange_failed(now, op.clone(), f, sent))
    };
    let mut s = match wire::open(addr, secret, CONTROL_IO).await {
        Ok(s) => s,
        Err(e) => {
            return failed(
                Failure::new(FailCode::PeerLost, format!("connecting to {addr}: {e}")),
                false,
            )
        }
    };
    if let Err(e) = wire::write_message(&mut s, msg, CONTROL_IO).await {
        return failed(
            Failure::new(FailCode::PeerLost, format!("sending to {addr}: {e}")),
            true,
        );
    }
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        match wire::read_message(&mut s, left).await {
            Ok(m) => {
                let last = m != Message::PullProgress;
                shared.event(|c, now| c.on_reply(now, op.clone(), m));
                if last {
                    return;
                }
            }
            Err(wire::WireError::Timeout { .. }) => {
                return failed(
                    Failure::new(
                        FailCode::Timeout,
                        format!(
                            "no answer from {addr} within load_timeout_s of last hearing from it"
                        ),
                    ),
                    true,
                )
            }
            Err(e) => {
                return failed(
                    Failure::new(
                        FailCode::PeerLost,
                        format!("the exchange with {addr} broke: {e}"),
                    ),
                    true,
                )
            }
        }
    }
}

/// P writes its blocks into D's blocks named by `dst`, by `deadline`: one
/// batch of every copy, each from its rank's registration into D's rank's.
async fn write_blocks(d: &Net, write: &WriteIo) -> Result<(), Failure> {
    let (local, copies, dst, deadline) = (&write.local, &write.copies, &write.dst, write.deadline);
    let failed = |e: String| wire::write_failure(false, e);
    let mut slices = Vec::with_capacity(copies.len());
    for c in copies {
        let (Some(reg), Some(to)) = (local.get(c.local), dst.ranks.get(c.remote)) else {
            return Err(failed(format!(
                "a copy names rank {} of {} here, rank {} of {} at the decode engine",
                c.local,
                local.len(),
                c.remote,
                dst.ranks.len()
            )));
        };
        let l = LocalSlice::grant(&d.registry, reg, c.local_offset, c.len).map_err(|e| {
            failed(format!(
                "local rank {} at {}+{}: {e}",
                c.local, c.local_offset, c.len
            ))
        })?;
        slices.push((l, to, c));
    }
    let left = deadline.saturating_duration_since(Instant::now());
    if left.is_zero() {
        return Err(failed(
            "the pull deadline passed before the write started".into(),
        ));
    }
    match &dst.dst {
        Destination::Tcp { addr } => {
            // The grants open exactly D's blocks; D revokes them as its fence.
            let transfers = slices
                .into_iter()
                .map(|(l, to, c)| {
                    let r = RemoteDescriptor {
                        agent_addr: addr.clone(),
                        segment: to.rank.reg.segment,
                        key: to.write_key(),
                        epoch: to.rank.reg.epoch,
                        offset: c.remote_offset,
                        len: c.len,
                    };
                    (l, r)
                })
                .collect();
            d.agent.write(transfers, None, left).await.map_err(|e| {
                let refused = matches!(
                    &e,
                    BatchError::Transfer(TransferError::Remote(RemoteError::Access(_)))
                );
                wire::write_failure(refused, e)
            })
        }
        Destination::Shm { path } => {
            let mut imp = None;
            for to in &dst.ranks {
                let i = importer(d, path, &to.rank.reg, left)
                    .await
                    .map_err(|e| wire::write_failure(e.refused, e.message))?;
                imp = Some(i);
            }
            let Some(imp) = imp else {
                return Err(failed("the pull names no rank".into()));
            };
            let transfers = slices
                .into_iter()
                .map(|(local, to, c)| Transfer {
                    local,
                    remote: Target {
                        segment: to.rank.reg.segment,
                        key: to.rank.reg.key,
                        epoch: to.rank.reg.epoch,
                        offset: c.remote_offset,
                        len: c.len,
                    },
                })
                .collect();
            let res = match imp.start(Direction::Write, transfers, None, deadline) {
                Ok(h) => h.wait().await.map_err(|e| {
                    let refused = matches!(&e, TransferError::Remote(RemoteError::Access(_)));
                    wire::write_failure(refused, e)
                }),
                Err(e) => Err(failed(e.to_string())),
            };
            // A refusal is D withdrawing the destination: the connection
            // is sound and stays for the next pull.
            if res.as_ref().is_err_and(|f| f.code != FailCode::Dropped) {
                d.importers.lock().unwrap().remove(path);
            }
            res
        }
    }
}

/// Shared-memory peers (a socket, a reader and copy threads each) one
/// engine maps at most.
const MAX_SHM_PEERS: usize = 64;

/// Why a peer's registration could not be mapped here.
struct ImportError {
    /// The peer's registry refused the registration named (released, or
    /// renewed at a later epoch): the peer withdrew it.
    refused: bool,
    message: String,
}

impl ImportError {
    fn failed(message: String) -> ImportError {
        ImportError {
            refused: false,
            message,
        }
    }
}

/// The importer for the peer's socket `path`, connected, with `reg` (at its
/// epoch) mapped.
async fn importer(
    d: &Net,
    path: &str,
    reg: &Registration,
    left: Duration,
) -> Result<Arc<ShmImporter>, ImportError> {
    let mapped = || {
        let cached = d.importers.lock().unwrap().get(path).cloned();
        cached.filter(|i| i.mapped_epoch(reg.segment) == Some(reg.epoch))
    };
    if let Some(i) = mapped() {
        return Ok(i);
    }
    // One transfer connects and maps at a time; the others find it done.
    let _mapping = tokio::time::timeout(left, d.mapping.lock())
        .await
        .map_err(|_| {
            ImportError::failed(format!(
                "mapping the peer's KV cache at {path}: another map did not end in time"
            ))
        })?;
    if let Some(i) = mapped() {
        return Ok(i);
    }
    let cached = d.importers.lock().unwrap().get(path).cloned();
    let imp = match cached {
        Some(i) => i,
        None => {
            let p = PathBuf::from(path);
            if d.importers.lock().unwrap().len() >= MAX_SHM_PEERS {
                return Err(ImportError::failed(format!("connecting to {path}: this engine maps {MAX_SHM_PEERS} shared-memory peers already")));
            }
            let cfg = ShmImporterConfig {
                secret: d.secret.clone(),
                ..ShmImporterConfig::default()
            };
            let i = tokio::task::spawn_blocking(move || {
                ShmImporter::connect_with(&p, Limits::default(), cfg)
            })
            .await
            .map_err(|e| ImportError::failed(e.to_string()))?
            .map_err(|e| ImportError::failed(format!("connecting to {path}: {e}")))?;
            let i = Arc::new(i);
            d.importers
                .lock()
                .unwrap()
                .insert(path.to_string(), i.clone());
            i
        }
    };
    if imp.mapped_epoch(reg.segment) != Some(reg.epoch) {
        let (i, r) = (imp.clone(), *reg);
        let mapped = tokio::task::spawn_blocking(move || i.map(&r, left))
            .await
            .map_err(|e| ImportError::failed(e.to_string()))?;
        if let Err(e) = mapped {
            // The peer's registry refused the registration named: it was
            // released or renewed since the pull named it. The connection
            // is sound then; anything else drops it.
            let refused = matches!(&e, ShmError::Remote(RemoteError::Access(_)));
            if !refused {
                d.importers.lock().unwrap().remove(path);
            }
            return Err(ImportError {
                refused,
                message: format!(
                    "mapping the peer's KV cache (segment {}, epoch {}): {e}",
                    reg.segment, reg.epoch
                ),
            });
        }
    }
    Ok(imp)
}

/// D reads P's blocks into its own, by `deadline`: one batch of every copy,
/// each from P's rank's registration into this engine's rank's;
/// cancellable through the driver's `reads` table.
async fn read_blocks(d: &Net, read: &ReadIo) -> Result<(), Failure> {
    let (local, remote, copies) = (&read.local, &read.remote, &read.copies);
    let generation = remote.first().map_or(0, |r| r.epoch);
    let what = |code: FailCode, e: String| {
        Failure::new(
            code,
            format!(
                "reading {} pieces of blocks (generation {generation}): {e}",
                copies.len()
            ),
        )
    };
    let mut slices = Vec::with_capacity(copies.len());
    for c in copies {
        let (Some(reg), Some(from)) = (local.get(c.local), remote.get(c.remote)) else {
            return Err(what(
                FailCode::Protocol,
                format!(
                    "a copy names rank {} here, rank {} at the prefill engine",
                    c.local, c.remote
                ),
            ));
        };
        let l = LocalSlice::grant(&d.registry, reg, c.local_offset, c.len).map_err(|e| {
            what(
                FailCode::Protocol,
                format!(
                    "local rank {} at {}+{}: {e}",
                    c.local, c.local_offset, c.len
                ),
            )
        })?;
        slices.push((
            l,
            Target {
                segment: from.segment,
                key: from.key,
                epoch: from.epoch,
                offset: c.remote_offset,
                len: c.len,
            },
        ));
    }
    let left = read.deadline.saturating_duration_since(Instant::now());
    match &read.transfer {
        Destination::Tcp { addr } => {
            let transfers = slices
                .into_iter()
                .map(|(l, t)| {
                    let r = RemoteDescriptor {
                        agent_addr: addr.clone(),
                        segment: t.segment,
                        key: t.key,
                        epoch: t.epoch,
                        offset: t.offset,
                        len: t.len,
                    };
                    (l, r)
                })
                .collect();
            let h = d
                .agent
                .start(Direction::Read, transfers, None, left)
                .await
                .map_err(|e| what(FailCode::TransferFailed, e.to_string()))?;
            let cancel = h.canceller();
            d.reads.lock().unwrap().insert(read.load, Box::new(cancel));
            h.wait()
                .await
                .map_err(|e| what(FailCode::TransferFailed, e.to_string()))
        }
        Destination::Shm { path } => {
            let mut imp = None;
            for reg in remote {
                let i = importer(d, path, reg, left)
                    .await
                    .map_err(|e| what(FailCode::TransferFailed, e.message))?;
                imp = Some(i);
            }
            let Some(imp) = imp else {
                return Err(what(FailCode::Protocol, "no rank to read".into()));
            };
            let transfers = slices
                .into_iter()
                .map(|(local, remote)| Transfer { local, remote })
                .collect();
            let h = imp
                .start(Direction::Read, transfers, None, read.deadline)
                .map_err(|e| what(FailCode::TransferFailed, e.to_string()))?;
            let cancel = h.canceller();
            d.reads.lock().unwrap().insert(read.load, Box::new(cancel));
            let res = h
                .wait()
                .await
                .map_err(|e| what(FailCode::TransferFailed, e.to_string()));
            if res.is_err() {
                d.importers.lock().unwrap().remove(path);
            }
            res
        }
    }
}

/// How old a socket file with no listener must be before an engine takes
/// it for a dead process's: a socket just bound by an engine starting
/// beside this one refuses connections until it listens, microseconds
/// later.
const STALE_SOCKET_AGE: Duration = Duration::from_secs(60);

/// Removes the sockets that killed pdkv processes left in `dir` (named
/// `pdkv-…-N.sock`, nothing listening on them, unchanged for `older_than`:
/// a process killed before it could remove its own); returns how many.
/// Liveness is asked of the socket itself (a refused connection), not of
/// a pid, which another PID namespace sharing the directory would not show.
fn remove_stale_sockets(dir: &std::path::Path, older_than: Duration) -> usize {
    use std::os::unix::fs::FileTypeExt;
    let Ok(entries) = std::fs::read_dir(dir) else {
        return 0;
    };
    let ours = |name: &str| {
        let tail = name
            .strip_prefix("pdkv-")
            .and_then(|n| n.strip_suffix(".sock"))
            .and_then(|n| n.rsplit_once('-'))
            .map(|(_, n)| n);
        tail.is_some_and(|n| !n.is_empty() && n.bytes().all(|b| b.is_ascii_digit()))
    };
    let unchanged = |e: &std::fs::DirEntry| {
        e.metadata()
            .and_then(|m| m.modified())
            .is_ok_and(|t| t.elapsed().is_ok_and(|age| age >= older_than))
    };
    entries
        .flatten()
        .filter(|e| e.file_name().to_str().is_some_and(ours))
        .filter(|e| e.file_type().is_ok_and(|t| t.is_socket()) && unchanged(e))
        .filter(|e| {
            std::os::unix::net::UnixStream::connect(e.path())
                .is_err_and(|err| err.kind() == std::io::ErrorKind::ConnectionRefused)
        })
        .filter(|e| std::fs::remove_file(e.path()).is_ok())
        .count()
}

#[cfg(test)]
mod tests {
    use super::*;
    use pdkv_vmem::{Pool, PoolOptions, Tag};

    /// A registration of 16 memfds of 4 KiB, and an exporter for it
    /// allowing at most `max_map_chunks` per shared registration.
    /// Only pdkv's sockets that nothing listens on go, and only once they
    /// are old enough: a live one, a plain file and other names stay.
    #[test]
    fn stale_sockets_are_removed_and_nothing_else() {
        use std::os::unix::net::UnixListener;
        let dir = tempfile::tempdir().unwrap();
        let at = |name: &str| dir.path().join(name);
        let dead = ["pdkv-d0-4000001.sock", "pdkv-publish-4000002-0.sock"];
        let others = ["pdkv-d0-x.sock", "other-4000004.sock", "pdkv-d0-4000005"];
        for name in dead.iter().chain(&others) {
            drop(UnixListener::bind(at(name)).unwrap());
        }
        std::fs::write(at("pdkv-d0-4000006.sock"), b"not a socket").unwrap();
        let _live = UnixListener::bind(at("pdkv-d0-4000003.sock")).unwrap();
        let hour = Duration::from_secs(3600);
        assert_eq!(remove_stale_sockets(dir.path(), hour), 0, "all too fresh");
        assert_eq!(remove_stale_sockets(dir.path(), Duration::ZERO), 2);
        for gone in dead {
            assert!(!at(gone).exists(), "{gone} went");
        }
        for kept in others
            .iter()
            .chain(&["pdkv-d0-4000003.sock", "pdkv-d0-4000006.sock"])
        {
            assert!(at(kept).exists(), "{kept} stays");
        }
        assert_eq!(remove_stale_sockets(dir.path(), Duration::ZERO), 0);
        assert_eq!(remove_stale_sockets(&at("absent"), Duration::ZERO), 0);
    }

    fn exporter(dir: &std::path::Path, max_map_chunks: u32) -> (ShmExporter, Registration, Pool) {
        let pool = Pool::new(PoolOptions {
            chunk_size: 4 << 10,
            single_allocation: false,
        });
        let region = pool.allocate(Tag::KvCache, 16 << 12).unwrap();
        let registry = Arc::new(Registry::new(RegistryOptions::default()));
        let reg = registry.register(&region, 0, region.len()).unwrap();
        let limits = Limits {
            max_map_chunks,
            ..Limits::default()
        };
        let exp = ShmExporter::bind(
            &dir.join(format!("x{max_map_chunks}.sock")),
            registry,
            limits,
        )
        .unwrap();
        (exp, reg, pool)
    }

    #[test]
    fn a_registration_of_more_memfds_than_the_limit_is_refused_with_the_typed_reason() {
        let dir = tempfile::tempdir().unwrap();
        let (exp, reg, _pool) = exporter(dir.path(), 15);
        let err = check_shareable(&exp, &reg).expect_err("16 memfds over a limit of 15");
        match err.downcast_ref::<ShmError>() {
            Some(ShmError::TooManyChunks {
                chunks: 16,
                limit: 15,
            }) => {}
            other => panic!("refused as {other:?}: {err:#}"),
        }
        let msg = format!("{err:#}");
        assert!(
            msg.contains("16 memfds") && msg.contains("at most 15") && msg.contains("tcp"),
            "{msg}"
        );
        // At the limit it is shared.
        let (exp, reg, _pool) = exporter(dir.path(), 16);
        check_shareable(&exp, &reg).expect("16 memfds within a limit of 16");
    }
}
