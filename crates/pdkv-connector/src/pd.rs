//! The P/D connector. Write mode: the prefill engine (P) writes a finished
//! prompt's KV blocks into the decode engine's (D) blocks when D pulls them.
//! Read mode (`"transfer_mode":"read"`): P *leases* the blocks and D reads
//! them one-sided.
//!
//! Threads: the engine calls every [`KvConnector`] method on its core
//! thread, and none of them blocks on I/O. All I/O runs on the connector's
//! own tokio runtime (two worker threads named `pdkv-kv`): the control
//! listener, P's writes, D's loads and drops, and P's timer. State shared
//! between the core thread and those tasks sits behind mutexes that are never
//! held across an await; the engine's [`Waker`] is called whenever
//! `get_finished` or the load errors have news.
//!
//! P's sending logic is the sans-IO [`SendMachine`]; this module only feeds
//! it events and carries out its actions. D's side, per request:
//! `get_num_new_matched_tokens` notes the remote prefill,
//! `update_state_after_alloc` decides the load (D's destination blocks),
//! `build_connector_meta` hands new loads to `start_load_kv`, which spawns
//! them. A load ends once P answered its pull and, if D asked P to drop the
//! transfer, the drop too (or D's `load_timeout` passed): only then is the
//! request reported in `get_finished().recving`, so nothing writes its
//! blocks after the engine learns of it.
//!
//! Sleep mode. A registration pins the pages it covers (see
//! `pdkv_transfer::registry`), so before the KV cache is unmapped the
//! engine calls `release_kv_caches`: it waits (bounded) until no READY block
//! waits for D and no write reads or writes our blocks, then deregisters,
//! over shared memory only after every peer that mapped the segment
//! acknowledged the unmap. From the moment the release stops waiting until
//! `restore_kv_caches` the connector is *asleep*: P answers every pull at
//! once with an error and D fails every load at once, so nothing reaches the
//! region while it has no pages. Restore registers the same range again:
//! same segment, next epoch, new key. D's pulls always carry its current
//! registration, and an access naming an older epoch is refused by the
//! registry (TCP) or by the importer's epoch check (shared memory, which
//! maps the newer epoch on the first pull that names it), so stale pages
//! are never served. `abort_transfers` (before a cache reset) stops P
//! holding KV for D and ends D's loads, reported as load errors with
//! [`CUT_SHORT`] so the engine recomputes them.
//!
//! Read mode. A finished `do_remote_decode` request on P becomes READY with
//! a lease (`abort_timeout` from the finish) and its params name P's blocks
//! (`remote_block_ids`) and P's registration epoch
//! (`remote_registration_generation`). D handshakes with P once per address
//! (the answer carries P's transfer address and registration) and again
//! *before* reading whenever the params name a newer generation than the one
//! it holds, so the first read after P woke needs no failed attempt. D reads
//! with the params' generation: if P's registration moved on (P slept) or is
//! gone, the transfer layer refuses the access (stale epoch, not registered)
//! and no byte is read. After the read D sends `read_done`; P ends the lease
//! at once and answers whether the lease still held the blocks, and D keeps
//! the data only then (a read that outlived the lease fails the load: its
//! blocks may have been reused). Over shared memory P runs the exporter and
//! D maps P's segment; P's release waits (bounded) for leased blocks to be
//! read or expire and deregisters only after D's importer acknowledged the
//! unmap. `abort_transfers` ends leases at once.

use std::collections::{HashMap, HashSet};
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

use anyhow::Context;
use pdkv_engine::connector::{
    ConnectorMeta, ConnectorRequest, ExternalMatch, FinishedTransfers, KvCacheSpec, KvTransferParams, MetricsReader,
    ParamsValidator, Waker,
};
use pdkv_engine::{FinishReason, KvConnector, LoadFailurePolicy};
use pdkv_transfer::frame::{Limits, Target};
use pdkv_transfer::proto::{Direction, Transfer};
use pdkv_transfer::shm::{ShmExporter, ShmImporter};
use pdkv_transfer::tcp::{Agent, AgentConfig, LocalSlice};
use pdkv_transfer::{Registration, Registry, RegistryOptions, RemoteDescriptor};
use serde_json::json;
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{oneshot, Notify};

use crate::config::{KvRole, KvTransferConfig, TransferMode, Transport};
use crate::params::{self, PdParams, ReadParams};
use crate::send::{Action, DropId, PullId, PullSpec, SendConfig, SendMachine, ASLEEP};
use crate::wire::{self, Destination, HandshakeInfo, Message, Pull};

/// Bounds one control socket operation (connect, one read, one write).
const CONTROL_IO: Duration = Duration::from_secs(5);

/// The load error of a D load that [`KvConnector::abort_transfers`] ended
/// (the engine recomputes the request).
pub const CUT_SHORT: &str = "load cut short by a cache reset";

/// Why D starts no load while its KV cache registration is released.
pub const D_ASLEEP: &str = "the decode engine's KV cache is released (asleep); the load was not started";

/// The least time [`KvConnector::release_kv_caches`] gives shared-memory
/// peers to acknowledge an unmap, even when waiting for transfers used up
/// the caller's timeout (never more than that timeout).
const MIN_UNMAP_WAIT: Duration = Duration::from_secs(1);

/// This engine's KV cache, once registered.
#[derive(Clone)]
struct KvInfo {
    /// The current registration (released while the connector is asleep;
    /// `restore_kv_caches` replaces it with the next epoch).
    reg: Registration,
    /// The region and length registered, to register them again.
    region: Arc<pdkv_vmem::Region>,
    len: usize,
    block_bytes: u64,
    block_size: usize,
    layout: String,
}

/// P's answer to a bootstrap, cached per address.
#[derive(Clone, Debug)]
struct BootInfo {
    engine_id: String,
    layout: String,
    block_bytes: u64,
}

/// P's answer to a read-mode handshake, cached per address.
#[derive(Clone, Debug)]
struct PeerInfo {
    engine_id: String,
    layout: String,
    block_bytes: u64,
    transfer: Destination,
    registration: Option<Registration>,
}

/// P's sending side: the machine plus the answers its actions go to.
struct SendSide {
    machine: SendMachine,
    pull_tx: HashMap<PullId, (oneshot::Sender<Result<(), String>>, Pull)>,
    drop_tx: HashMap<DropId, oneshot::Sender<bool>>,
    /// Requests whose blocks may be freed, for `get_finished`.
    finished: Vec<Arc<str>>,
}

/// A load D decided, for `start_load_kv`.
#[derive(Clone, Debug)]
struct LoadSpec {
    req: Arc<str>,
    transfer_id: String,
    remote_engine_id: String,
    addr: String,
    prompt_len: usize,
    first_block: usize,
    dst_blocks: Vec<u32>,
    /// Read mode: P's blocks and generation, from the params.
    read: Option<ReadParams>,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum DropPhase {
    None,
    Pending,
    Done,
}

struct LoadState {
    spec: LoadSpec,
    started: bool,
    pull_result: Option<Result<(), String>>,
    drop: DropPhase,
    /// The engine finished the request (its blocks wait for `recving`).
    request_gone: bool,
    /// `abort_transfers` ended the load: its blocks are reported with
    /// [`CUT_SHORT`] whatever P answered.
    cut_short: bool,
    deadline: Option<Instant>,
}

/// D's loads, from decision to report.
#[derive(Default)]
struct LoadTable {
    loads: HashMap<Arc<str>, LoadState>,
    recving: Vec<Arc<str>>,
    /// Failed blocks of the loads in `recving` (pushed with them).
    errors: Vec<(u32, String)>,
    /// Failed blocks of loads `get_finished` reported already.
    reported_errors: Vec<(u32, String)>,
}

/// A generation counter bumped whenever a send or a load changes state, so
/// a blocking caller ([`KvConnector::release_kv_caches`]) waits for a
/// condition on them without polling.
#[derive(Default)]
struct Progress {
    generation: Mutex<u64>,
    changed: Condvar,
}

impl Progress {
    fn bump(&self) {
        *self.generation.lock().unwrap() += 1;
        self.changed.notify_all();
    }

    fn current(&self) -> u64 {
        *self.generation.lock().unwrap()
    }

    /// Waits until the generation moved past `seen`, or `until`.
    fn wait_past(&self, seen: u64, until: Instant) {
        let mut g = self.generation.lock().unwrap();
        while *g == seen {
            let now = Instant::now();
            if now >= until {
                return;
            }
            g = self.changed.wait_timeout(g, until - now).unwrap().0;
        }
    }
}

/// What still used the KV cache registration when a release stopped waiting.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
struct InFlight {
    /// P: blocks of READY transfers D has not pulled.
    ready_blocks: usize,
    /// P: writes reading this engine's blocks.
    writes: usize,
    /// D: loads writing into this engine's blocks.
    loads: usize,
}

impl InFlight {
    fn is_idle(&self) -> bool {
        *self == InFlight::default()
    }
}

/// A shared-memory peer this engine copies to or from (P writing into D's
/// segment in write mode, D reading P's in read mode), and what it mapped
/// (segment → epoch).
struct Imported {
    importer: ShmImporter,
    mapped: Mutex<HashMap<u64, u64>>,
}

struct Ctx {
    cfg: KvTransferConfig,
    engine_id: String,
    handle: tokio::runtime::Handle,
    registry: Arc<Registry>,
    agent: Agent,
    control_addr: SocketAddr,
    shm_path: Option<PathBuf>,
    /// D's shared-memory exporter, alive as long as the connector (its
    /// drop removes the socket file).
    _exporter: Option<ShmExporter>,
    kv: Mutex<Option<KvInfo>>,
    send: Mutex<SendSide>,
    send_changed: Notify,
    loads: Mutex<LoadTable>,
    importers: Mutex<HashMap<String, Arc<Imported>>>,
    boots: Mutex<HashMap<String, BootInfo>>,
    /// D, read mode: P's handshake answers, by bootstrap address.
    peers: Mutex<HashMap<String, PeerInfo>>,
    waker: Mutex<Option<Waker>>,
    next_id: AtomicU64,
    counters: Counters,
    /// The KV cache registration is released (between `release_kv_caches`
    /// and `restore_kv_caches`). Set with the send and load locks held, and
    /// read under them, so no pull or load starts after the release decided.
    asleep: AtomicBool,
    /// A `release_kv_caches` waits for transfers now (a gauge).
    releasing: AtomicBool,
    progress: Progress,
}

impl Ctx {
    fn wake(&self) {
        let w = self.waker.lock().unwrap().clone();
        if let Some(w) = w {
            w();
        }
    }

    fn next_id(&self) -> u64 {
        self.next_id.fetch_add(1, Ordering::Relaxed)
    }

    /// Carries out the machine's actions; wakes the engine when sends ended.
    fn drive(self: &Arc<Self>, st: &mut SendSide) {
        while let Some(a) = st.machine.poll_action() {
            match a {
                Action::Answer { pull, result } => {
                    let counter = match &result {
                        Ok(()) => &self.counters.pulls_ok,
                        Err(why) if why == crate::send::RELEASED => &self.counters.pulls_cancelled,
                        Err(why) if is_lifecycle_release(why) => &self.counters.pulls_released,
                        Err(_) => &self.counters.pulls_failed,
                    };
                    counter.fetch_add(1, Ordering::Relaxed);
                    if let Some((tx, _)) = st.pull_tx.remove(&pull) {
                        let _ = tx.send(result);
                    }
                }
                Action::DropAnswer { drop, known } => {
                    if let Some(tx) = st.drop_tx.remove(&drop) {
                        let _ = tx.send(known);
                    }
                }
                Action::StartWrite { pull, src_blocks, deadline } => {
                    // The destination stays in `pull_tx` until the answer.
                    let dst = st.pull_tx.get(&pull).map(|(_, p)| p.clone());
                    let ctx = self.clone();
                    self.handle.spawn(async move {
                        let res = match dst {
                            Some(dst) => write_blocks(&ctx, &dst, &src_blocks, deadline).await,
                            None => Err("the pull's destination is gone".to_string()),
                        };
                        if res.is_ok() {
                            let bytes = ctx.kv.lock().unwrap().as_ref().map_or(0, |k| k.block_bytes) * src_blocks.len() as u64;
                            ctx.counters.bytes_sent.fetch_add(bytes, Ordering::Relaxed);
                        }
                        let mut st = ctx.send.lock().unwrap();
                        st.machine.on_write_done(Instant::now(), pull, res);
                        ctx.drive(&mut st);
                    });
                }
            }
        }
        let done = st.machine.take_finished();
        if !done.is_empty() {
            st.finished.extend(done);
            self.wake();
        }
        self.send_changed.notify_one();
        self.progress.bump();
    }

    /// Applies `f` to a load and reports it once it ended.
    fn load_event(&self, req: &Arc<str>, f: impl FnOnce(&mut LoadState)) {
        let mut t = self.loads.lock().unwrap();
        let Some(l) = t.loads.get_mut(req) else { return };
        f(l);
        let deadline_passed = l.deadline.is_some_and(|d| Instant::now() >= d);
        let ended = l.pull_result.is_some() && (l.drop != DropPhase::Pending || deadline_passed);
        if !ended {
            return;
        }
        let l = t.loads.remove(req).expect("present");
        self.finish_load(&mut t, l);
        drop(t);
        self.progress.bump();
        self.wake();
    }

    /// Reports an ended load (taken out of the table) in `recving`, with its
    /// blocks as load errors when it failed or was cut short.
    fn finish_load(&self, t: &mut LoadTable, l: LoadState) {
        let counter = if l.cut_short {
            &self.counters.loads_cut_short
        } else if l.request_gone {
            &self.counters.loads_cancelled
        } else if matches!(&l.pull_result, Some(Err(why)) if is_lifecycle_release(why)) {
            &self.counters.loads_released
        } else if matches!(l.pull_result, Some(Ok(()))) {
            &self.counters.loads_ok
        } else {
            &self.counters.loads_failed
        };
        counter.fetch_add(1, Ordering::Relaxed);
        let req = &l.spec.req;
        if !l.request_gone {
            let why = match &l.pull_result {
                _ if l.cut_short => Some(CUT_SHORT.to_string()),
                Some(Err(why)) => {
                    tracing::warn!(request = %req, "KV load failed: {why}");
                    Some(why.clone())
                }
                _ => None,
            };
            if let Some(why) = why {
                t.errors.extend(l.spec.dst_blocks.iter().map(|&b| (b, why.clone())));
            }
        }
        t.recving.push(req.clone());
    }

    /// Tells P to drop a transfer this engine will never pull, so P frees
    /// its blocks now rather than when the lease expires. Best effort and
    /// bounded; P answers a drop for a transfer it has not seen yet with a
    /// tombstone that frees the blocks when the request finishes.
    fn drop_unpulled(self: &Arc<Self>, addr: String, transfer_id: String) {
        self.counters.drops_unpulled.fetch_add(1, Ordering::Relaxed);
        self.handle.spawn(async move {
            let msg = Message::Drop { transfer_id: transfer_id.clone(), code: wire::FailCode::Dropped };
            match wire::exchange(&addr, &msg, CONTROL_IO, CONTROL_IO).await {
                Ok(Message::DropOk { .. }) => tracing::debug!(%transfer_id, "dropped a transfer this engine does not pull"),
                Ok(other) => tracing::warn!(%transfer_id, "drop answered with {other:?}"),
                Err(e) => tracing::warn!(%transfer_id, "drop to {addr} failed: {e}"),
            }
        });
    }

    /// Asks P to drop the load's transfer (once); the load ends after P answered.
    fn start_drop(self: &Arc<Self>, l: &mut LoadState) {
        if l.drop != DropPhase::None {
            return;
        }
        l.drop = DropPhase::Pending;
        let ctx = self.clone();
        let (req, addr, tid) = (l.spec.req.clone(), l.spec.addr.clone(), l.spec.transfer_id.clone());
        let deadline = l.deadline.unwrap_or_else(|| Instant::now() + self.cfg.load_timeout);
        self.handle.spawn(async move {
            let left = deadline.saturating_duration_since(Instant::now());
            let msg = Message::Drop { transfer_id: tid.clone(), code: wire::FailCode::Dropped };
            match wire::exchange(&addr, &msg, CONTROL_IO.min(left), left).await {
                Ok(Message::DropOk { .. }) => {}
                Ok(other) => tracing::warn!(transfer_id = %tid, "drop answered with {other:?}"),
                Err(e) => tracing::warn!(transfer_id = %tid, "drop to {addr} failed: {e}"),
            }
            ctx.load_event(&req, |l| l.drop = DropPhase::Done);
        });
    }
}

/// Whether a transfer ended because P's lifecycle released the KV on
/// purpose (a cache reset or a sleep), as opposed to a failure.
fn is_lifecycle_release(why: &str) -> bool {
    why.contains(crate::send::CACHE_RESET) || why.contains(crate::send::ASLEEP)
}

/// The P/D connector; see the module docs.
pub struct PdConnector {
    ctx: Arc<Ctx>,
    runtime: Option<tokio::runtime::Runtime>,
    /// D: remote prefills noted at admission, by request.
    pending: HashMap<Arc<str>, (PdParams, usize)>,
    /// D: loads decided and not yet handed to the worker side.
    new_loads: Vec<Arc<str>>,
    /// D: requests whose load was decided (a later admission loads nothing).
    decided: HashSet<Arc<str>>,
}

impl Drop for PdConnector {
    fn drop(&mut self) {
        if let Some(rt) = self.runtime.take() {
            rt.shutdown_background();
        }
    }
}

impl PdConnector {
    /// Read mode: the leased blocks and P's registration epoch for the
    /// params of a finished request (no blocks for a one-token prompt,
    /// which has nothing to send). `None` when the blocks are not leased
    /// (the send ended, e.g. by a cache reset): the request then gets no
    /// params, so D computes the prompt itself instead of reading blocks no
    /// lease holds.
    fn read_params(&self, held: bool, block_ids: &[u32], prompt_len: usize) -> Option<ReadParams> {
        let kv = self.ctx.kv.lock().unwrap();
        let bs = kv.as_ref().map_or(pdkv_model::BLOCK_SIZE, |k| k.block_size);
        let needed = prompt_len.saturating_sub(1).div_ceil(bs);
        if needed > 0 && (!held || block_ids.len() < needed) {
            return None;
        }
        let generation = kv.as_ref().map(|k| k.reg.epoch)?;
        Some(ReadParams { block_ids: block_ids[..needed].to_vec(), generation })
    }

    /// Starts the runtime, binds the control listener and the transfer
    /// agent (and, for a shared-memory consumer, the exporter).
    pub fn new(cfg: KvTransferConfig, engine_id: &str) -> anyhow::Result<PdConnector> {
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .thread_name("pdkv-kv")
            .enable_all()
            .build()
            .context("starting the KV connector's runtime")?;
        let registry = Arc::new(Registry::new(RegistryOptions::default()));
        let ip = cfg.kv_ip.clone();
        let (agent, listener) = runtime.block_on(async {
            let agent = Agent::bind(&format!("{ip}:0"), registry.clone(), AgentConfig::default())
                .await
                .with_context(|| format!("binding the KV transfer agent on {ip}"))?;
            let listener = TcpListener::bind((ip.as_str(), cfg.kv_port))
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
        let (shm_path, exporter) = if exports && cfg.transport == Transport::Shm {
            let path = cfg.shm_dir.join(format!("pdkv-{engine_id}-{}.sock", std::process::id()));
            let _ = std::fs::remove_file(&path);
            let exp = ShmExporter::bind(&path, registry.clone(), Limits::default())
                .with_context(|| format!("binding the shared-memory exporter at {}", path.display()))?;
            (Some(path), Some(exp))
        } else {
            (None, None)
        };
        let machine = SendMachine::new(send_config(&cfg, pdkv_model::BLOCK_SIZE));
        let ctx = Arc::new(Ctx {
            cfg,
            engine_id: engine_id.to_string(),
            handle: runtime.handle().clone(),
            registry,
            agent,
            control_addr,
            shm_path,
            _exporter: exporter,
            kv: Mutex::new(None),
            send: Mutex::new(SendSide { machine, pull_tx: HashMap::new(), drop_tx: HashMap::new(), finished: Vec::new() }),
            send_changed: Notify::new(),
            loads: Mutex::new(LoadTable::default()),
            importers: Mutex::new(HashMap::new()),
            boots: Mutex::new(HashMap::new()),
            peers: Mutex::new(HashMap::new()),
            waker: Mutex::new(None),
            next_id: AtomicU64::new(1),
            counters: Counters::default(),
            asleep: AtomicBool::new(false),
            releasing: AtomicBool::new(false),
            progress: Progress::default(),
        });
        runtime.spawn(accept_loop(ctx.clone(), listener));
        runtime.spawn(send_timer(ctx.clone()));
        Ok(PdConnector {
            ctx,
            runtime: Some(runtime),
            pending: HashMap::new(),
            new_loads: Vec::new(),
            decided: HashSet::new(),
        })
    }

    /// Where P's control listener is (the `remote_bootstrap_addr` D uses).
    pub fn bootstrap_addr(&self) -> SocketAddr {
        self.ctx.control_addr
    }
}

fn send_config(cfg: &KvTransferConfig, block_size: usize) -> SendConfig {
    SendConfig {
        abort_timeout: cfg.abort_timeout,
        arrival_timeout: cfg.arrival_timeout,
        num_workers: cfg.num_workers,
        block_size,
    }
}

/// Runs P's machine timer: deadlines, lease expiry, tombstones.
async fn send_timer(ctx: Arc<Ctx>) {
    loop {
        let next = ctx.send.lock().unwrap().machine.poll_timeout();
        match next {
            Some(t) => {
                tokio::select! {
                    _ = tokio::time::sleep_until(tokio::time::Instant::from_std(t)) => {
                        let mut st = ctx.send.lock().unwrap();
                        st.machine.handle_timeout(Instant::now());
                        ctx.drive(&mut st);
                    }
                    _ = ctx.send_changed.notified() => {}
                }
            }
            None => ctx.send_changed.notified().await,
        }
    }
}

async fn accept_loop(ctx: Arc<Ctx>, listener: TcpListener) {
    loop {
        let Ok((stream, from)) = listener.accept().await else { continue };
        let ctx = ctx.clone();
        tokio::spawn(async move {
            if let Err(e) = serve_control(&ctx, stream).await {
                tracing::debug!(%from, "control connection closed: {e}");
            }
        });
    }
}

/// Serves one control exchange.
async fn serve_control(ctx: &Arc<Ctx>, mut s: TcpStream) -> Result<(), wire::WireError> {
    let _ = s.set_nodelay(true);
    let msg = wire::read_message(&mut s, CONTROL_IO).await?;
    let answer = match msg {
        Message::Bootstrap => {
            let kv = ctx.kv.lock().unwrap().clone();
            match kv {
                Some(kv) => Message::BootstrapOk { engine_id: ctx.engine_id.clone(), layout: kv.layout, block_bytes: kv.block_bytes },
                None => Message::Error { reason: format!("engine {} has not registered its KV cache yet", ctx.engine_id) },
            }
        }
        Message::Handshake => {
            // The registration and the asleep flag are read together under
            // the send lock (the release decides to sleep holding it; the
            // restore swaps both under the kv lock): the answer names P's
            // live registration, or none while P is asleep.
            let (kv, asleep) = {
                let _st = ctx.send.lock().unwrap();
                let kv = ctx.kv.lock().unwrap().clone();
                (kv, ctx.asleep.load(Ordering::Acquire))
            };
            match kv {
                Some(kv) => {
                    let transfer = match (&ctx.shm_path, ctx.cfg.transport) {
                        (Some(p), Transport::Shm) => Destination::Shm { path: p.display().to_string() },
                        _ => Destination::Tcp { addr: ctx.agent.local_addr().to_string() },
                    };
                    let registration = (!asleep).then_some(kv.reg);
                    Message::HandshakeOk(HandshakeInfo {
                        engine_id: ctx.engine_id.clone(),
                        layout: kv.layout,
                        block_bytes: kv.block_bytes,
                        transfer,
                        registration,
                    })
                }
                None => Message::Error { reason: format!("engine {} has not registered its KV cache yet", ctx.engine_id) },
            }
        }
        Message::ReadDone { transfer_id } if ctx.cfg.kv_role.produces() => {
            let res = {
                let mut st = ctx.send.lock().unwrap();
                let r = st.machine.on_read_done(Instant::now(), &transfer_id);
                ctx.drive(&mut st);
                r
            };
            match res {
                Ok(()) => {
                    ctx.counters.reads_done.fetch_add(1, Ordering::Relaxed);
                    Message::ReadDoneOk
                }
                Err(reason) => {
                    ctx.counters.reads_late.fetch_add(1, Ordering::Relaxed);
                    Message::ReadDoneErr { reason }
                }
            }
        }
        Message::Pull(p) if ctx.cfg.kv_role.produces() => {
            let id = ctx.next_id();
            let (tx, rx) = oneshot::channel();
            {
                let mut st = ctx.send.lock().unwrap();
                if ctx.asleep.load(Ordering::Acquire) {
                    drop(st);
                    ctx.counters.pulls_released.fetch_add(1, Ordering::Relaxed);
                    let answer = Message::PullErr { reason: ASLEEP.into() };
                    return wire::write_message(&mut s, &answer, CONTROL_IO).await;
                }
                let spec = PullSpec {
                    transfer_id: p.transfer_id.clone(),
                    first_block: p.first_block,
                    num_tokens: p.num_tokens,
                    num_blocks: p.block_offsets.len(),
                };
                st.pull_tx.insert(id, (tx, p));
                st.machine.on_pull(Instant::now(), id, spec);
                ctx.drive(&mut st);
            }
            // The machine answers every pull by its deadline (plus the write
            // in flight); the bound here only guards against a lost answer.
            let limit = ctx.cfg.abort_timeout + ctx.cfg.arrival_timeout + CONTROL_IO;
            match tokio::time::timeout(limit, rx).await {
                Ok(Ok(Ok(()))) => Message::PullOk,
                Ok(Ok(Err(reason))) => Message::PullErr { reason },
                _ => Message::PullErr { reason: "the prefill engine lost the pull".into() },
            }
        }
        Message::Drop { transfer_id, .. } if ctx.cfg.kv_role.produces() => {
            let id = ctx.next_id();
            let (tx, rx) = oneshot::channel();
            {
                let mut st = ctx.send.lock().unwrap();
                st.drop_tx.insert(id, tx);
                st.machine.on_drop(Instant::now(), &transfer_id, id);
                ctx.drive(&mut st);
            }
            let limit = ctx.cfg.abort_timeout + CONTROL_IO;
            match tokio::time::timeout(limit, rx).await {
                Ok(Ok(known)) => Message::DropOk { known },
                _ => Message::Error { reason: "the prefill engine lost the drop".into() },
            }
        }
        Message::Pull(_) | Message::Drop { .. } | Message::ReadDone { .. } => {
            Message::Error { reason: format!("engine {} is a {} and sends no KV", ctx.engine_id, ctx.cfg.kv_role.as_str()) }
        }
        other => Message::Error { reason: format!("unexpected message {other:?}") },
    };
    wire::write_message(&mut s, &answer, CONTROL_IO).await
}

/// P writes its blocks `src` into D's blocks named by `dst`, by `deadline`.
async fn write_blocks(ctx: &Arc<Ctx>, dst: &Pull, src: &[u32], deadline: Instant) -> Result<(), String> {
    let kv = ctx.kv.lock().unwrap().clone().ok_or("the KV cache is not registered")?;
    let bb = kv.block_bytes;
    let mut pairs = Vec::with_capacity(src.len());
    for (&b, &off) in src.iter().zip(&dst.block_offsets) {
        let local = LocalSlice::grant(&ctx.registry, &kv.reg, b as u64 * bb, bb).map_err(|e| format!("local block {b}: {e}"))?;
        pairs.push((local, off));
    }
    let left = deadline.saturating_duration_since(Instant::now());
    if left.is_zero() {
        return Err("the pull deadline passed before the write started".into());
    }
    match &dst.dst {
        Destination::Tcp { addr } => {
            let transfers = pairs
                .into_iter()
                .map(|(l, off)| {
                    let d = RemoteDescriptor {
                        agent_addr: addr.clone(),
                        segment: dst.segment,
                        key: dst.key,
                        epoch: dst.epoch,
                        offset: off,
                        len: bb,
                    };
                    (l, d)
                })
                .collect();
            ctx.agent.write(transfers, None, left).await.map_err(|e| e.to_string())
        }
        Destination::Shm { path } => {
            let reg = Registration { segment: dst.segment, key: dst.key, epoch: dst.epoch, len: dst.region_len };
            let imp = importer(ctx, path, &reg, left).await;
            let imp = match imp {
                Ok(i) => i,
                Err(e) => {
                    ctx.importers.lock().unwrap().remove(path);
                    return Err(e);
                }
            };
            let transfers = pairs
                .into_iter()
                .map(|(local, off)| Transfer {
                    local,
                    remote: Target { segment: dst.segment, key: dst.key, epoch: dst.epoch, offset: off, len: bb },
                })
                .collect();
            let res = match imp.importer.start(Direction::Write, transfers, None, deadline) {
                Ok(h) => h.wait().await.map_err(|e| e.to_string()),
                Err(e) => Err(e.to_string()),
            };
            if res.is_err() {
                ctx.importers.lock().unwrap().remove(path);
            }
            res
        }
    }
}

/// The importer for the peer's socket `path`, connected and with the peer's
/// registration `reg` (at its epoch) mapped.
async fn importer(ctx: &Arc<Ctx>, path: &str, reg: &Registration, left: Duration) -> Result<Arc<Imported>, String> {
    let cached = ctx.importers.lock().unwrap().get(path).cloned();
    let imp = match cached {
        Some(i) => i,
        None => {
            let p = PathBuf::from(path);
            let i = tokio::task::spawn_blocking(move || ShmImporter::connect(&p, Limits::default()))
                .await
                .map_err(|e| e.to_string())?
                .map_err(|e| format!("connecting to {path}: {e}"))?;
            let i = Arc::new(Imported { importer: i, mapped: Mutex::new(HashMap::new()) });
            ctx.importers.lock().unwrap().insert(path.to_string(), i.clone());
            i
        }
    };
    let have = imp.mapped.lock().unwrap().get(&reg.segment).copied();
    if have != Some(reg.epoch) {
        let (i, r) = (imp.clone(), *reg);
        tokio::task::spawn_blocking(move || i.importer.map(&r, left))
            .await
            .map_err(|e| e.to_string())?
            .map_err(|e| format!("mapping the peer's KV cache (segment {}, epoch {}): {e}", reg.segment, reg.epoch))?;
        imp.mapped.lock().unwrap().insert(reg.segment, reg.epoch);
    }
    Ok(imp)
}

/// D's bootstrap with P at `addr` (cached; fetched again when `refresh`).
async fn bootstrap(ctx: &Arc<Ctx>, addr: &str, refresh: bool) -> Result<BootInfo, String> {
    if !refresh {
        if let Some(b) = ctx.boots.lock().unwrap().get(addr) {
            return Ok(b.clone());
        }
    }
    match wire::exchange(addr, &Message::Bootstrap, CONTROL_IO, CONTROL_IO).await {
        Ok(Message::BootstrapOk { engine_id, layout, block_bytes }) => {
            let b = BootInfo { engine_id, layout, block_bytes };
            ctx.boots.lock().unwrap().insert(addr.to_string(), b.clone());
            Ok(b)
        }
        Ok(Message::Error { reason }) => Err(format!("bootstrap with {addr} refused: {reason}")),
        Ok(other) => Err(format!("bootstrap with {addr}: unexpected answer {other:?}")),
        Err(e) => Err(format!("bootstrap with {addr} failed: {e}")),
    }
}

/// D's read-mode handshake with P at `addr` (cached; made again when `refresh`).
async fn handshake(ctx: &Arc<Ctx>, addr: &str, refresh: bool) -> Result<PeerInfo, String> {
    if !refresh {
        if let Some(p) = ctx.peers.lock().unwrap().get(addr) {
            return Ok(p.clone());
        }
    }
    match wire::exchange(addr, &Message::Handshake, CONTROL_IO, CONTROL_IO).await {
        Ok(Message::HandshakeOk(h)) => {
            ctx.counters.handshakes.fetch_add(1, Ordering::Relaxed);
            let p = PeerInfo {
                engine_id: h.engine_id,
                layout: h.layout,
                block_bytes: h.block_bytes,
                transfer: h.transfer,
                registration: h.registration,
            };
            tracing::debug!(addr, engine_id = %p.engine_id, epoch = ?p.registration.map(|r| r.epoch), "handshake");
            ctx.peers.lock().unwrap().insert(addr.to_string(), p.clone());
            Ok(p)
        }
        Ok(Message::Error { reason }) => Err(format!("handshake with {addr} refused: {reason}")),
        Ok(other) => Err(format!("handshake with {addr}: unexpected answer {other:?}")),
        Err(e) => Err(format!("handshake with {addr} failed: {e}")),
    }
}

/// D's read-mode load: handshake (again first when the params name a newer
/// generation than the one held), checks, the one-sided read of P's leased
/// blocks at the params' generation, then `read_done`; `Ok` only when P
/// confirms its lease held the blocks until the read ended.
async fn run_read(ctx: &Arc<Ctx>, spec: &LoadSpec, rp: &ReadParams) -> Result<(), String> {
    let kv = ctx.kv.lock().unwrap().clone().ok_or("the KV cache is not registered")?;
    let mut peer = handshake(ctx, &spec.addr, false).await?;
    let behind = peer.registration.is_none_or(|r| r.epoch < rp.generation);
    if peer.engine_id != spec.remote_engine_id || behind {
        peer = handshake(ctx, &spec.addr, true).await?;
    }
    if peer.engine_id != spec.remote_engine_id {
        return Err(format!(
            "remote_engine_id mismatch: the request names {:?}, the prefill engine at {} is {:?}",
            spec.remote_engine_id, spec.addr, peer.engine_id
        ));
    }
    let res = read_blocks(ctx, spec, rp, &kv, &peer).await;
    if let Err(e) = &res {
        // The next load starts from a fresh handshake and mapping.
        ctx.peers.lock().unwrap().remove(&spec.addr);
        if let Destination::Shm { path } = &peer.transfer {
            ctx.importers.lock().unwrap().remove(path);
        }
        tracing::warn!(transfer_id = %spec.transfer_id, "read failed: {e}");
    }
    // Ends the lease either way; after a successful read P's answer says
    // whether the data is valid.
    let done = wire::exchange(&spec.addr, &Message::ReadDone { transfer_id: spec.transfer_id.clone() }, CONTROL_IO, CONTROL_IO).await;
    res?;
    match done {
        Ok(Message::ReadDoneOk) => {
            let bytes = kv.block_bytes * spec.dst_blocks.len() as u64;
            ctx.counters.bytes_read.fetch_add(bytes, Ordering::Relaxed);
            Ok(())
        }
        Ok(Message::ReadDoneErr { reason }) => Err(format!(
            "the KV read of transfer {:?} is void: the prefill engine {:?} no longer held the blocks when the read ended: {reason}",
            spec.transfer_id, peer.engine_id
        )),
        Ok(other) => Err(format!("read_done for transfer {:?}: unexpected answer {other:?}", spec.transfer_id)),
        Err(e) => Err(format!("read_done for transfer {:?} to {} failed, the read is unconfirmed: {e}", spec.transfer_id, spec.addr)),
    }
}

/// Checks the params against P's handshake and this engine, then reads P's
/// blocks `rp.block_ids[first..]` into D's `dst_blocks` (same indices).
async fn read_blocks(ctx: &Arc<Ctx>, spec: &LoadSpec, rp: &ReadParams, kv: &KvInfo, peer: &PeerInfo) -> Result<(), String> {
    if peer.layout != kv.layout || peer.block_bytes != kv.block_bytes {
        return Err(format!(
            "KV layout mismatch: the prefill engine {:?} has {:?} ({} bytes per block), this engine has {:?} ({} bytes per block)",
            peer.engine_id, peer.layout, peer.block_bytes, kv.layout, kv.block_bytes
        ));
    }
    let tokens = spec.prompt_len.saturating_sub(1);
    let needed = tokens.div_ceil(kv.block_size);
    if rp.block_ids.len() != needed {
        return Err(format!(
            "block count mismatch: kv_transfer_params.remote_block_ids names {} blocks, the KV of {} tokens fills {} blocks of {} tokens",
            rp.block_ids.len(),
            tokens,
            needed,
            kv.block_size
        ));
    }
    let end = spec.first_block + spec.dst_blocks.len();
    let Some(src) = rp.block_ids.get(spec.first_block..end).filter(|s| !s.is_empty()) else {
        return Err(format!(
            "no blocks to read: blocks {}..{end} of the {} in kv_transfer_params.remote_block_ids",
            spec.first_block, needed
        ));
    };
    let Some(reg) = peer.registration else {
        return Err(format!(
            "the prefill engine {:?} has released its KV cache (asleep): generation {} cannot be read",
            peer.engine_id, rp.generation
        ));
    };
    let bb = kv.block_bytes;
    let mut pairs = Vec::with_capacity(src.len());
    for (&s, &d) in src.iter().zip(&spec.dst_blocks) {
        let local = LocalSlice::grant(&ctx.registry, &kv.reg, d as u64 * bb, bb).map_err(|e| format!("local block {d}: {e}"))?;
        // The params' generation, not the handshake's: a registration that
        // moved on since P leased the blocks refuses the access.
        pairs.push((local, Target { segment: reg.segment, key: reg.key, epoch: rp.generation, offset: s as u64 * bb, len: bb }));
    }
    let limit = ctx.cfg.load_timeout;
    let n = src.len();
    let what = |e: String| {
        format!(
            "reading {n} blocks of transfer {:?} (generation {}) from the prefill engine {:?}: {e}",
            spec.transfer_id,
            rp.generation,
            peer.engine_id
        )
    };
    match &peer.transfer {
        Destination::Tcp { addr } => {
            let transfers = pairs
                .into_iter()
                .map(|(local, t)| {
                    let d = RemoteDescriptor {
                        agent_addr: addr.clone(),
                        segment: t.segment,
                        key: t.key,
                        epoch: t.epoch,
                        offset: t.offset,
                        len: t.len,
                    };
                    (d, local)
                })
                .collect();
            ctx.agent.read(transfers, limit).await.map_err(|e| what(e.to_string()))
        }
        Destination::Shm { path } => {
            let imp = importer(ctx, path, &reg, limit).await.map_err(what)?;
            let transfers = pairs.into_iter().map(|(local, remote)| Transfer { local, remote }).collect();
            match imp.importer.start(Direction::Read, transfers, None, Instant::now() + limit) {
                Ok(h) => h.wait().await.map_err(|e| what(e.to_string())),
                Err(e) => Err(what(e.to_string())),
            }
        }
    }
}

/// D's load: bootstrap, checks, pull; `Ok` once P wrote every block.
async fn run_load(ctx: &Arc<Ctx>, spec: &LoadSpec) -> Result<(), String> {
    if let Some(rp) = &spec.read {
        return run_read(ctx, spec, rp).await;
    }
    let kv = ctx.kv.lock().unwrap().clone().ok_or("the KV cache is not registered")?;
    let mut boot = bootstrap(ctx, &spec.addr, false).await?;
    if boot.engine_id != spec.remote_engine_id {
        boot = bootstrap(ctx, &spec.addr, true).await?;
    }
    if boot.engine_id != spec.remote_engine_id {
        return Err(format!(
            "remote_engine_id mismatch: the request names {:?}, the prefill engine at {} is {:?}",
            spec.remote_engine_id, spec.addr, boot.engine_id
        ));
    }
    if boot.layout != kv.layout || boot.block_bytes != kv.block_bytes {
        return Err(format!(
            "KV layout mismatch: the prefill engine {:?} has {:?} ({} bytes per block), this engine has {:?} ({} bytes per block)",
            boot.engine_id, boot.layout, boot.block_bytes, kv.layout, kv.block_bytes
        ));
    }
    let dst = match &ctx.shm_path {
        Some(p) if ctx.cfg.transport == Transport::Shm => Destination::Shm { path: p.display().to_string() },
        _ => Destination::Tcp { addr: ctx.agent.local_addr().to_string() },
    };
    let pull = Pull {
        transfer_id: spec.transfer_id.clone(),
        engine_id: ctx.engine_id.clone(),
        first_block: spec.first_block,
        num_tokens: spec.prompt_len - 1,
        dst,
        segment: kv.reg.segment,
        key: kv.reg.key,
        epoch: kv.reg.epoch,
        region_len: kv.reg.len,
        block_offsets: spec.dst_blocks.iter().map(|&b| b as u64 * kv.block_bytes).collect(),
    };
    // P answers by its pull deadline; D's own wait is bounded by the caller.
    match wire::exchange(&spec.addr, &Message::Pull(pull), CONTROL_IO, ctx.cfg.load_timeout).await {
        Ok(Message::PullOk) => Ok(()),
        Ok(Message::PullErr { reason }) => Err(format!("the prefill engine {:?} refused the pull: {reason}", boot.engine_id)),
        Ok(other) => Err(format!("pull: unexpected answer {other:?}")),
        Err(e) => Err(format!("pull from {} failed: {e}", spec.addr)),
    }
}

/// Checks a request's params against this engine's role.
fn validate(role: KvRole, params: Option<&KvTransferParams>) -> Result<(), String> {
    match PdParams::parse(params)? {
        Some(PdParams::RemoteDecode { .. }) if !role.produces() => {
            Err(format!("kv_transfer_params.do_remote_decode: this engine is a {} and sends no KV", role.as_str()))
        }
        Some(PdParams::RemotePrefill { .. }) if !role.consumes() => {
            Err(format!("kv_transfer_params.do_remote_prefill: this engine is a {} and receives no KV", role.as_str()))
        }
        _ => Ok(()),
    }
}

/// Transfer counters, for metrics.
#[derive(Default)]
struct Counters {
    pulls_ok: AtomicU64,
    pulls_failed: AtomicU64,
    loads_ok: AtomicU64,
    loads_failed: AtomicU64,
    loads_cut_short: AtomicU64,
    /// P: pulls ended because D dropped the transfer (its request ended).
    pulls_cancelled: AtomicU64,
    /// D: loads ended because their request ended first (client gone, abort).
    loads_cancelled: AtomicU64,
    /// P: pulls refused because P's own lifecycle released the KV (a cache
    /// reset or a sleep ended the transfer on purpose).
    pulls_released: AtomicU64,
    /// D: loads that failed because P released the KV on purpose.
    loads_released: AtomicU64,
    /// D: transfers D will never pull (nothing left to load, or the request
    /// ended before its load started), dropped at P so it frees the blocks.
    drops_unpulled: AtomicU64,
    bytes_sent: AtomicU64,
    /// D: read-mode handshakes with prefill engines.
    handshakes: AtomicU64,
    /// D: KV bytes read from prefill engines (read mode).
    bytes_read: AtomicU64,
    /// P: leases a decode engine's `read_done` ended while they held.
    reads_done: AtomicU64,
    /// P: `read_done` reports that came after the lease had ended.
    reads_late: AtomicU64,
}

impl KvConnector for PdConnector {
    fn name(&self) -> &str {
        "pdkv"
    }

    fn supports_sleep_mode(&self) -> bool {
        true
    }

    fn info(&self) -> serde_json::Value {
        let c = &self.ctx.cfg;
        json!({
            "engine_id": self.ctx.engine_id,
            "kv_role": c.kv_role.as_str(),
            "transport": c.transport.as_str(),
            "transfer_mode": c.transfer_mode.as_str(),
            "bootstrap_addr": self.ctx.control_addr.to_string(),
            "transfer_addr": match &self.ctx.shm_path {
                Some(p) => p.display().to_string(),
                None => self.ctx.agent.local_addr().to_string(),
            },
            "supports_sleep_mode": true,
            "registration_epoch": self.ctx.kv.lock().unwrap().as_ref().map(|k| k.reg.epoch),
            "kv_released": self.ctx.asleep.load(Ordering::Acquire),
        })
    }

    fn validate_params(&self, params: Option<&KvTransferParams>) -> Result<(), String> {
        validate(self.ctx.cfg.kv_role, params)
    }

    fn params_validator(&self) -> ParamsValidator {
        let role = self.ctx.cfg.kv_role;
        Arc::new(move |p| validate(role, p))
    }

    fn metrics_reader(&self) -> Option<MetricsReader> {
        let ctx = self.ctx.clone();
        Some(Arc::new(move || {
            let c = &ctx.counters;
            let get = |a: &AtomicU64| a.load(Ordering::Relaxed) as f64;
            let get_flag = |a: &AtomicBool| if a.load(Ordering::Acquire) { 1.0 } else { 0.0 };
            let (held, pulls) = {
                let st = ctx.send.lock().unwrap();
                (st.machine.held_blocks() as f64, st.machine.live_pulls() as f64)
            };
            vec![
                ("pulls_ok_total", "Pulls this prefill engine served successfully", get(&c.pulls_ok)),
                ("pulls_failed_total", "Pulls this prefill engine answered with an error", get(&c.pulls_failed)),
                ("loads_ok_total", "KV loads this decode engine completed", get(&c.loads_ok)),
                ("loads_failed_total", "KV loads this decode engine failed", get(&c.loads_failed)),
                ("loads_cut_short_total", "KV loads this decode engine ended early for a cache reset", get(&c.loads_cut_short)),
                ("pulls_cancelled_total", "Pulls ended because the decode engine dropped the transfer", get(&c.pulls_cancelled)),
                ("loads_cancelled_total", "KV loads ended because their request ended first", get(&c.loads_cancelled)),
                ("pulls_released_total", "Pulls refused because this prefill engine released the KV (cache reset, sleep)", get(&c.pulls_released)),
                ("loads_released_total", "KV loads refused because the prefill engine released the KV (cache reset, sleep)", get(&c.loads_released)),
                ("drops_unpulled_total", "Transfers this decode engine dropped without pulling", get(&c.drops_unpulled)),
                ("bytes_sent_total", "KV bytes this prefill engine wrote to decode engines", get(&c.bytes_sent)),
                ("handshakes_total", "Read-mode handshakes this decode engine made with prefill engines", get(&c.handshakes)),
                ("bytes_read_total", "KV bytes this decode engine read from prefill engines", get(&c.bytes_read)),
                ("reads_done_total", "Leases ended by a decode engine's read_done while they held", get(&c.reads_done)),
                ("reads_late_total", "read_done reports that came after the lease had ended", get(&c.reads_late)),
                ("send_held_blocks", "KV blocks held for decode engines now", held),
                ("pulls_pending", "Pulls received and not yet answered (or still writing)", pulls),
                ("release_waiting", "1 while a KV cache release waits for transfers in flight", get_flag(&ctx.releasing)),
                ("kv_released", "1 while the KV cache registration is released (asleep)", get_flag(&ctx.asleep)),
            ]
        }))
    }

    fn set_waker(&mut self, waker: Waker) {
        *self.ctx.waker.lock().unwrap() = Some(waker);
    }

    fn load_failure_policy(&self) -> LoadFailurePolicy {
        self.ctx.cfg.kv_load_failure_policy
    }

    fn request_added(&mut self, req: ConnectorRequest<'_>) {
        if let Ok(Some(PdParams::RemoteDecode { transfer_id })) = PdParams::parse(req.kv_transfer_params) {
            if self.ctx.cfg.kv_role.produces() {
                let mut st = self.ctx.send.lock().unwrap();
                st.machine.on_request_running(&transfer_id, req.id);
                // A pull parked as unknown now waits for the request instead.
                self.ctx.drive(&mut st);
            }
        }
    }

    fn get_num_new_matched_tokens(&mut self, req: ConnectorRequest<'_>, num_computed_tokens: usize) -> ExternalMatch {
        match PdParams::parse(req.kv_transfer_params) {
            Ok(Some(PdParams::RemoteDecode { transfer_id })) if self.ctx.cfg.kv_role.produces() => {
                let mut st = self.ctx.send.lock().unwrap();
                st.machine.on_request_running(&transfer_id, req.id);
                ExternalMatch::default()
            }
            Ok(Some(p @ PdParams::RemotePrefill { .. })) if self.ctx.cfg.kv_role.consumes() => {
                if self.decided.contains(req.id) {
                    return ExternalMatch::default();
                }
                let n = req.prompt_tokens.len().saturating_sub(1).saturating_sub(num_computed_tokens);
                if n == 0 {
                    // Everything is in the local cache: P need not keep it.
                    self.decided.insert(req.id.clone());
                    if let PdParams::RemotePrefill { transfer_id, remote_bootstrap_addr, .. } = p {
                        self.ctx.drop_unpulled(remote_bootstrap_addr, transfer_id);
                    }
                    return ExternalMatch::default();
                }
                self.pending.insert(req.id.clone(), (p, req.prompt_tokens.len()));
                ExternalMatch { num_tokens: n, load_async: true }
            }
            _ => ExternalMatch::default(),
        }
    }

    fn update_state_after_alloc(
        &mut self,
        req: ConnectorRequest<'_>,
        block_ids: &[u32],
        num_computed_tokens: usize,
        num_external_tokens: usize,
    ) {
        let Some((params, prompt_len)) = self.pending.remove(req.id) else { return };
        if num_external_tokens == 0 {
            return;
        }
        let PdParams::RemotePrefill { transfer_id, remote_engine_id, remote_bootstrap_addr, read } = params else { return };
        let bs = self.ctx.kv.lock().unwrap().as_ref().map_or(pdkv_model::BLOCK_SIZE, |k| k.block_size);
        let first = num_computed_tokens / bs;
        let last = (num_computed_tokens + num_external_tokens).div_ceil(bs).min(block_ids.len());
        let spec = LoadSpec {
            req: req.id.clone(),
            transfer_id,
            remote_engine_id,
            addr: remote_bootstrap_addr,
            prompt_len,
            first_block: first,
            dst_blocks: block_ids.get(first..last).unwrap_or(&[]).to_vec(),
            read,
        };
        self.decided.insert(req.id.clone());
        self.ctx.loads.lock().unwrap().loads.insert(
            req.id.clone(),
            LoadState {
                spec,
                started: false,
                pull_result: None,
                drop: DropPhase::None,
                request_gone: false,
                cut_short: false,
                deadline: None,
            },
        );
        self.new_loads.push(req.id.clone());
    }

    fn build_connector_meta(&mut self) -> ConnectorMeta {
        ConnectorMeta(Box::new(std::mem::take(&mut self.new_loads)))
    }

    fn request_finished(
        &mut self,
        req: ConnectorRequest<'_>,
        block_ids: &[u32],
        reason: FinishReason,
    ) -> (bool, Option<KvTransferParams>) {
        self.pending.remove(req.id);
        let decided = self.decided.remove(req.id);
        match PdParams::parse(req.kv_transfer_params) {
            Ok(Some(PdParams::RemoteDecode { transfer_id })) if self.ctx.cfg.kv_role.produces() => {
                let completed = matches!(reason, FinishReason::Stop | FinishReason::Length);
                let prompt_len = req.prompt_tokens.len();
                let held = {
                    let mut st = self.ctx.send.lock().unwrap();
                    let held = st.machine.on_request_finished(Instant::now(), &transfer_id, req.id, block_ids, prompt_len, completed);
                    self.ctx.drive(&mut st);
                    held
                };
                let bootstrap = self.ctx.control_addr.to_string();
                let params = if !completed {
                    None
                } else if self.ctx.cfg.transfer_mode == TransferMode::Read {
                    self.read_params(held, block_ids, prompt_len).map(|r| {
                        params::returned_by_prefill(&transfer_id, &self.ctx.engine_id, &bootstrap, prompt_len, Some(&r))
                    })
                } else {
                    Some(params::returned_by_prefill(&transfer_id, &self.ctx.engine_id, &bootstrap, prompt_len, None))
                };
                (held, params)
            }
            Ok(Some(PdParams::RemotePrefill { .. })) => {
                let mut t = self.ctx.loads.lock().unwrap();
                if t.recving.iter().any(|r| r == req.id) {
                    // Ended, not yet reported: the engine frees the blocks then.
                    t.errors.retain(|(b, _)| !block_ids.contains(b));
                    return (true, None);
                }
                let unpulled = |ctx: &Arc<Ctx>| {
                    if let Ok(Some(PdParams::RemotePrefill { transfer_id, remote_bootstrap_addr, .. })) =
                        PdParams::parse(req.kv_transfer_params)
                    {
                        ctx.drop_unpulled(remote_bootstrap_addr, transfer_id);
                    }
                };
                let Some(l) = t.loads.get_mut(req.id) else {
                    // Ended before its load was decided: P would hold the
                    // blocks until its lease expired.
                    if !decided && self.ctx.cfg.kv_role.consumes() {
                        unpulled(&self.ctx);
                    }
                    return (false, None);
                };
                if !l.started {
                    t.loads.remove(req.id);
                    self.new_loads.retain(|r| r != req.id);
                    unpulled(&self.ctx);
                    return (false, None);
                }
                l.request_gone = true;
                self.ctx.start_drop(l);
                (true, None)
            }
            _ => (false, None),
        }
    }

    /// P: stops holding KV for D (see [`SendMachine::abort_all`]). D: ends
    /// every load: one not started yet ends now, one in flight asks P to
    /// drop its transfer and ends once P answered (or by D's deadline); all
    /// are reported with [`CUT_SHORT`] so the engine recomputes them.
    fn abort_transfers(&mut self) {
        {
            let mut st = self.ctx.send.lock().unwrap();
            st.machine.abort_all(Instant::now());
            self.ctx.drive(&mut st);
        }
        let mut t = self.ctx.loads.lock().unwrap();
        let unstarted: Vec<Arc<str>> = t.loads.iter().filter(|(_, l)| !l.started).map(|(r, _)| r.clone()).collect();
        for req in &unstarted {
            let mut l = t.loads.remove(req).expect("listed above");
            l.cut_short = true;
            self.ctx.finish_load(&mut t, l);
        }
        self.new_loads.retain(|r| !unstarted.contains(r));
        for l in t.loads.values_mut() {
            l.cut_short = true;
            self.ctx.start_drop(l);
        }
        drop(t);
        if !unstarted.is_empty() {
            self.ctx.progress.bump();
            self.ctx.wake();
        }
    }

    fn num_held_blocks(&self) -> usize {
        let sending = self.ctx.send.lock().unwrap().machine.held_blocks();
        let t = self.ctx.loads.lock().unwrap();
        sending + t.loads.values().map(|l| l.spec.dst_blocks.len()).sum::<usize>()
    }

    fn register_kv_caches(&mut self, spec: &KvCacheSpec) -> anyhow::Result<()> {
        let len = spec.num_blocks * spec.block_bytes;
        let reg = self
            .ctx
            .registry
            .register(&spec.region, 0, len)
            .with_context(|| format!("registering the KV cache ({len} bytes) for transfers"))?;
        *self.ctx.kv.lock().unwrap() = Some(KvInfo {
            reg,
            region: spec.region.clone(),
            len,
            block_bytes: spec.block_bytes as u64,
            block_size: spec.block_size,
            layout: spec.layout.clone(),
        });
        let mut st = self.ctx.send.lock().unwrap();
        st.machine = SendMachine::new(send_config(&self.ctx.cfg, spec.block_size));
        Ok(())
    }

    fn start_load_kv(&mut self, meta: ConnectorMeta) {
        let Ok(reqs) = meta.0.downcast::<Vec<Arc<str>>>() else { return };
        let now = Instant::now();
        let mut t = self.ctx.loads.lock().unwrap();
        let asleep = self.ctx.asleep.load(Ordering::Acquire);
        let mut refused = false;
        for req in *reqs {
            let Some(l) = t.loads.get_mut(&req) else { continue };
            if l.started {
                continue;
            }
            if asleep {
                // Nothing may write into the released region: fail at once.
                let mut l = t.loads.remove(&req).expect("present");
                l.pull_result = Some(Err(D_ASLEEP.into()));
                self.ctx.finish_load(&mut t, l);
                refused = true;
                continue;
            }
            l.started = true;
            let deadline = now + self.ctx.cfg.load_timeout;
            l.deadline = Some(deadline);
            let spec = l.spec.clone();
            let ctx = self.ctx.clone();
            self.ctx.handle.spawn(async move {
                let res = if spec.dst_blocks.is_empty() {
                    Err("no destination blocks for the load".to_string())
                } else {
                    match tokio::time::timeout_at(tokio::time::Instant::from_std(deadline), run_load(&ctx, &spec)).await {
                        Ok(r) => r,
                        Err(_) => Err(format!(
                            "no answer from the prefill engine at {} within load_timeout_s ({:?})",
                            spec.addr, ctx.cfg.load_timeout
                        )),
                    }
                };
                ctx.load_event(&spec.req, |l| l.pull_result = Some(res));
            });
        }
        drop(t);
        if refused {
            self.ctx.progress.bump();
            self.ctx.wake();
        }
    }

    fn get_finished(&mut self) -> FinishedTransfers {
        let sending = std::mem::take(&mut self.ctx.send.lock().unwrap().finished);
        let recving = {
            let mut t = self.ctx.loads.lock().unwrap();
            let errors = std::mem::take(&mut t.errors);
            t.reported_errors.extend(errors);
            std::mem::take(&mut t.recving)
        };
        FinishedTransfers { sending, recving }
    }

    fn get_block_ids_with_load_errors(&mut self) -> Vec<(u32, String)> {
        std::mem::take(&mut self.ctx.loads.lock().unwrap().reported_errors)
    }

    /// Waits (at most `timeout`) until no READY block waits for D and no
    /// transfer writes from or into this engine's blocks, then deregisters
    /// the KV cache: over shared memory after every peer that mapped it
    /// acknowledged the unmap (waiting for the acks at most the time left,
    /// and at least [`MIN_UNMAP_WAIT`] capped by `timeout`), over TCP at
    /// once. From the moment it stops waiting, pulls and loads are refused at
    /// once and READY transfers end with [`ASLEEP`]. The registration is
    /// gone even when the wait timed out; the `Err` then says what was still
    /// in flight. Idempotent.
    fn release_kv_caches(&mut self, timeout: Duration) -> anyhow::Result<()> {
        let ctx = &self.ctx;
        let Some(kv) = ctx.kv.lock().unwrap().clone() else { return Ok(()) };
        if ctx.asleep.load(Ordering::Acquire) {
            return Ok(());
        }
        let t0 = Instant::now();
        let deadline = t0 + timeout;
        ctx.releasing.store(true, Ordering::Release);
        let left_over = loop {
            let seen = ctx.progress.current();
            {
                let mut st = ctx.send.lock().unwrap();
                let t = ctx.loads.lock().unwrap();
                let busy = InFlight {
                    ready_blocks: st.machine.ready_blocks(),
                    writes: st.machine.writes_in_flight(),
                    loads: t.loads.values().filter(|l| l.started).count(),
                };
                if busy.is_idle() || Instant::now() >= deadline {
                    ctx.asleep.store(true, Ordering::Release);
                    drop(t);
                    st.machine.end_ready(Instant::now(), ASLEEP);
                    ctx.drive(&mut st);
                    break busy;
                }
            }
            ctx.progress.wait_past(seen, deadline);
        };
        ctx.releasing.store(false, Ordering::Release);
        let segment = kv.reg.segment;
        let unmapped = match &ctx._exporter {
            Some(exp) => {
                let ack_wait = deadline.saturating_duration_since(Instant::now()).max(MIN_UNMAP_WAIT.min(timeout));
                exp.deregister(segment, ack_wait)
                    .map_err(|e| anyhow::anyhow!("shared-memory peers did not unmap the KV cache (segment {segment}): {e}"))
            }
            None => {
                ctx.registry.deregister(segment);
                Ok(())
            }
        };
        tracing::info!(segment, epoch = kv.reg.epoch, waited = ?t0.elapsed(), ?left_over, "KV cache registration released");
        if !left_over.is_idle() {
            anyhow::bail!(
                "connector {}: released the KV cache registration after waiting {timeout:?} with transfers still in flight: \
                 {} blocks held for decode engines, {} writes reading this engine's blocks, {} loads writing into them",
                self.name(),
                left_over.ready_blocks,
                left_over.writes,
                left_over.loads
            );
        }
        unmapped
    }

    /// Registers the KV cache again: the same segment with a new epoch and
    /// key. D's next pulls carry them, so P writes to the new pages at once;
    /// an access naming the old epoch is refused. Idempotent.
    fn restore_kv_caches(&mut self) -> anyhow::Result<()> {
        let mut kv = self.ctx.kv.lock().unwrap();
        let Some(k) = kv.as_mut() else { return Ok(()) };
        if !self.ctx.asleep.load(Ordering::Acquire) {
            return Ok(());
        }
        let reg = self
            .ctx
            .registry
            .register(&k.region, 0, k.len)
            .with_context(|| format!("registering the KV cache ({} bytes) again after a wake", k.len))?;
        tracing::info!(segment = reg.segment, epoch = reg.epoch, "KV cache registered again");
        k.reg = reg;
        self.ctx.asleep.store(false, Ordering::Release);
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn progress_counts_bumps_and_wakes_a_waiter() {
        let p = Arc::new(Progress::default());
        assert_eq!(p.current(), 0);
        p.bump();
        p.bump();
        assert_eq!(p.current(), 2);

        // Nothing changes: the wait lasts until its deadline, not less.
        let t0 = Instant::now();
        p.wait_past(2, t0 + Duration::from_millis(30));
        assert!(t0.elapsed() >= Duration::from_millis(30));
        // Already past: no wait at all, whatever the deadline.
        let t0 = Instant::now();
        p.wait_past(1, t0 + Duration::from_secs(600));
        assert!(t0.elapsed() < Duration::from_secs(600));

        // A bump from another thread ends the wait (the deadline is far).
        let (tx, rx) = std::sync::mpsc::channel();
        let waiter = {
            let p = p.clone();
            std::thread::spawn(move || {
                tx.send(()).unwrap();
                p.wait_past(2, Instant::now() + Duration::from_secs(600));
                p.current()
            })
        };
        rx.recv().unwrap();
        p.bump();
        assert_eq!(waiter.join().unwrap(), 3);
    }

    #[test]
    fn in_flight_is_idle_only_when_nothing_is() {
        assert!(InFlight::default().is_idle());
        for busy in [
            InFlight { ready_blocks: 1, ..InFlight::default() },
            InFlight { writes: 1, ..InFlight::default() },
            InFlight { loads: 1, ..InFlight::default() },
        ] {
            assert!(!busy.is_idle(), "{busy:?}");
        }
    }

    #[test]
    fn lifecycle_releases_are_told_from_failures() {
        assert!(is_lifecycle_release(&format!("transfer ended: {}", crate::send::CACHE_RESET)));
        assert!(is_lifecycle_release(&format!("transfer ended: {}", crate::send::ASLEEP)));
        assert!(!is_lifecycle_release("connection reset by peer"));
    }
}
