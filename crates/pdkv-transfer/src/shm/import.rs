//! The importing side: maps another agent's registrations and copies
//! batches into and out of them on worker threads.

use std::collections::HashMap;
use std::io::{self, Write};
use std::os::fd::OwnedFd;
use std::os::unix::net::UnixStream;
use std::path::Path;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{mpsc, Arc, Mutex, RwLock};
use std::time::{Duration, Instant};

use crate::auth::{self, KvSecret, Port};
use crate::error::AccessError;
use crate::frame::{Header, Limits, RemoteError, Target};
use crate::proto::{
    check_batch, Direction, LocalRange, StartError, Stats, Transfer, TransferError,
};
use crate::registry::Registration;
use crate::tcp::{BatchError, LocalSlice};

use super::layout::{Assembly, Imported};
use super::{read_header, BadMap, ShmError, HANDSHAKE_TIMEOUT, WRITE_TIMEOUT};

/// One mapping of a segment, for its whole life: an unmap, or a new map
/// of the segment, empties it (under its write lock, so after the copy in
/// progress) and a later map gets a slot of its own. A batch holds the slot
/// it checked, so it can never go on into a later mapping.
type Slot = Arc<RwLock<Option<Imported>>>;
/// Carries one message: the reader answers a map once, taking its waiter
/// out of `waiting` (so a channel of one never makes the reader wait).
type MapReply = mpsc::SyncSender<Result<(), ShmError>>;

/// A `map` call waiting for its reply, and the reply as it arrives.
struct MapWaiter {
    reg: Registration,
    reply: MapReply,
    /// Set by the reply's head, filled by its parts.
    assembly: Option<Assembly>,
}

/// Carries one message: the reader answers a notification once, taking its
/// sender out of `notifying`.
type NotifyReply = mpsc::SyncSender<Result<(), RemoteError>>;

/// How an importer runs batches.
#[derive(Clone, Debug)]
pub struct ShmImporterConfig {
    /// Worker threads copying batches; batches beyond them wait their turn
    /// (their deadlines keep running).
    pub workers: usize,
    /// Batches started and not yet ended; more are refused at start.
    pub max_batches: usize,
    /// Largest copy done between two cancellation/deadline checks.
    pub max_slice: u64,
    /// Called on the worker before each slice's checks, with the number of
    /// slices the batch has copied so far. A seam for deterministic tests of
    /// what happens between two slices (cancel, deadline, unmap); `None` in
    /// production.
    pub before_slice: Option<SliceHook>,
    /// The deployment's KV secret, proven to the exporter on connect.
    pub secret: KvSecret,
}

/// See [`ShmImporterConfig::before_slice`].
#[derive(Clone)]
pub struct SliceHook(pub Arc<dyn Fn(u64) + Send + Sync>);

impl std::fmt::Debug for SliceHook {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("SliceHook")
    }
}

impl Default for ShmImporterConfig {
    fn default() -> Self {
        ShmImporterConfig {
            workers: 2,
            max_batches: 1024,
            max_slice: 1 << 20,
            before_slice: None,
            secret: KvSecret::open(),
        }
    }
}

struct ImpInner {
    limits: Limits,
    cfg: ShmImporterConfig,
    maps: Mutex<HashMap<u64, Slot>>,
    /// Maps asked for and not yet answered, by op id; one per `map` call in flight.
    waiting: Mutex<HashMap<u64, MapWaiter>>,
    /// Notifications sent and not yet acknowledged, by op id.
    notifying: Mutex<HashMap<u64, NotifyReply>>,
    writer: Mutex<UnixStream>,
    unmapped: AtomicU64,
    /// Set when the connection to the exporter is lost (before the waiters
    /// are dropped): a call made afterwards fails at once with `PeerLost`
    /// instead of waiting out its deadline.
    lost: AtomicBool,
    next_op: AtomicU64,
    /// Batches started and not yet ended.
    live_batches: AtomicU64,
    stats: Mutex<Stats>,
}

/// One batch handed to a worker.
struct Job {
    dir: Direction,
    transfers: Vec<Transfer<LocalSlice>>,
    /// Per transfer, the mapping of its segment when the batch started: the
    /// batch runs on that mapping or fails, never on a later one.
    slots: Vec<Option<Slot>>,
    notify: Option<Vec<u8>>,
    deadline: Instant,
    cancel: Arc<AtomicBool>,
    done: tokio::sync::oneshot::Sender<Result<(), TransferError>>,
}

/// A peer's view of another agent's registrations on this host.
pub struct ShmImporter {
    inner: Arc<ImpInner>,
    jobs: Mutex<Option<mpsc::Sender<Job>>>,
}

/// A running shared-memory batch: wait for it, or cancel it. Dropping an
/// unfinished handle cancels the batch.
pub struct ShmBatchHandle {
    cancel: Arc<AtomicBool>,
    rx: Option<tokio::sync::oneshot::Receiver<Result<(), TransferError>>>,
}

impl ShmBatchHandle {
    /// Asks the batch to stop: no slice starts after this, and the batch
    /// ends with `Cancelled` unless it already ended.
    pub fn cancel(&self) {
        self.cancel.store(true, Ordering::Release);
    }

    /// A function that cancels the batch, for whoever must stop it while
    /// another task waits for it.
    pub fn canceller(&self) -> impl Fn() + Send + Sync + 'static {
        let cancel = self.cancel.clone();
        move || cancel.store(true, Ordering::Release)
    }

    /// Waits for the batch to end (by its deadline at the latest, plus at
    /// most the slice in progress).
    pub async fn wait(mut self) -> Result<(), TransferError> {
        let rx = self.rx.take().expect("wait consumes the handle");
        rx.await.unwrap_or(Err(TransferError::PeerLost))
    }

    /// [`ShmBatchHandle::wait`] for callers outside an async runtime.
    pub fn wait_blocking(mut self) -> Result<(), TransferError> {
        let rx = self.rx.take().expect("wait consumes the handle");
        rx.blocking_recv().unwrap_or(Err(TransferError::PeerLost))
    }
}

impl Drop for ShmBatchHandle {
    fn drop(&mut self) {
        if self.rx.is_some() {
            self.cancel();
        }
    }
}

impl ShmImporter {
    pub fn connect(path: &Path, limits: Limits) -> io::Result<ShmImporter> {
        ShmImporter::connect_with(path, limits, ShmImporterConfig::default())
    }

    pub fn connect_with(
        path: &Path,
        limits: Limits,
        cfg: ShmImporterConfig,
    ) -> io::Result<ShmImporter> {
        let mut stream = UnixStream::connect(path)?;
        stream.set_read_timeout(Some(HANDSHAKE_TIMEOUT))?;
        stream.set_write_timeout(Some(HANDSHAKE_TIMEOUT))?;
        auth::connect_blocking(&mut stream, &cfg.secret, Port::Shm, HANDSHAKE_TIMEOUT).map_err(
            |e| io::Error::new(io::ErrorKind::PermissionDenied, format!("handshake: {e}")),
        )?;
        stream.set_read_timeout(None)?;
        let writer = stream.try_clone()?;
        writer.set_write_timeout(Some(WRITE_TIMEOUT))?;
        let workers = cfg.workers.max(1);
        let inner = Arc::new(ImpInner {
            limits,
            cfg,
            maps: Mutex::new(HashMap::new()),
            waiting: Mutex::new(HashMap::new()),
            notifying: Mutex::new(HashMap::new()),
            writer: Mutex::new(writer),
            unmapped: AtomicU64::new(0),
            lost: AtomicBool::new(false),
            next_op: AtomicU64::new(1),
            live_batches: AtomicU64::new(0),
            stats: Mutex::new(Stats::default()),
        });
        let r = inner.clone();
        std::thread::Builder::new()
            .name("pdkv-shm-import".into())
            .spawn(move || import_reader(r, stream))?;
        // Unbounded, and bounded by `max_batches`: `start` queues a job only
        // once `live_batches` counted it under that limit, and a job leaves
        // the queue before its batch stops counting. (`start` must not block,
        // so it never waits for room.)
        let (tx, rx) = mpsc::channel::<Job>();
        let rx = Arc::new(Mutex::new(rx));
        for _ in 0..workers {
            let (inner, rx) = (inner.clone(), rx.clone());
            std::thread::Builder::new()
                .name("pdkv-shm-copy".into())
                .spawn(move || loop {
                    // The lock is held only while taking a job; the loop ends
                    // when the importer drops its sender.
                    let job = rx.lock().unwrap().recv();
                    let Ok(job) = job else { return };
                    let result = run_batch(&inner, &job);
                    {
                        let mut st = inner.stats.lock().unwrap();
                        match &result {
                            Ok(()) => st.batches_ok += 1,
                            Err(e) => st.failures[e.reason_index()] += 1,
                        }
                    }
                    inner.live_batches.fetch_sub(1, Ordering::AcqRel);
                    // The batch's local slices pin registered chunks: they go
                    // before the waiter hears, so a caller that releases its
                    // memory once the write is done finds nothing pinned.
                    let Job {
                        dir,
                        transfers,
                        slots,
                        notify,
                        deadline,
                        cancel,
                        done,
                    } = job;
                    drop((dir, transfers, slots, notify, deadline, cancel));
                    let _ = done.send(result);
                })?;
        }
        Ok(ShmImporter {
            inner,
            jobs: Mutex::new(Some(tx)),
        })
    }

    /// This importer's counters: bytes and slices moved, batches ended by outcome.
    pub fn stats(&self) -> Stats {
        self.inner.stats.lock().unwrap().clone()
    }

    /// Starts a batch on a worker: `Write` copies each local range into its
    /// remote range, `Read` the other way. The batch is bound to the
    /// mappings present now: one unmapped (or replaced by a new map) before
    /// or while it runs fails it with `NotRegistered`, even if the segment
    /// is mapped again meanwhile. Every remote range is checked against its
    /// mapped registration (segment mapped, key, epoch, bounds) before the
    /// first byte moves; a refusal fails the batch with
    /// `Remote(..)` and touches no memory. Copies go slice by slice
    /// (`max_slice`); between slices the worker checks cancellation and the
    /// deadline and starts no slice after either. `notify` is sent to the
    /// exporter after the last slice, and the batch succeeds once the
    /// exporter queued it.
    pub fn start(
        &self,
        dir: Direction,
        transfers: Vec<Transfer<LocalSlice>>,
        notify: Option<Vec<u8>>,
        deadline: Instant,
    ) -> Result<ShmBatchHandle, StartError> {
        let max_notify = self.inner.limits.max_notify as usize;
        check_batch(&transfers, notify.as_deref(), max_notify)?;
        let max = self.inner.cfg.max_batches as u64;
        if self.inner.live_batches.fetch_add(1, Ordering::AcqRel) >= max {
            self.inner.live_batches.fetch_sub(1, Ordering::AcqRel);
            return Err(StartError::TooManyBatches(max as usize));
        }
        let cancel = Arc::new(AtomicBool::new(false));
        let (done, rx) = tokio::sync::oneshot::channel();
        let slots = {
            let maps = self.inner.maps.lock().unwrap();
            transfers
                .iter()
                .map(|t| maps.get(&t.remote.segment).cloned())
                .collect()
        };
        let job = Job {
            dir,
            transfers,
            slots,
            notify,
            deadline,
            cancel: cancel.clone(),
            done,
        };
        let sent = self.jobs.lock().unwrap().as_ref().map(|tx| tx.send(job));
        if !matches!(sent, Some(Ok(()))) {
            // Workers gone: the batch ends at once (its sender dropped).
            self.inner.live_batches.fetch_sub(1, Ordering::AcqRel);
        }
        Ok(ShmBatchHandle {
            cancel,
            rx: Some(rx),
        })
    }

    /// Writes local ranges to remote ranges and waits for the batch.
    pub async fn write_batch(
        &self,
        transfers: Vec<Transfer<LocalSlice>>,
        notify: Option<Vec<u8>>,
        timeout: Duration,
    ) -> Result<(), BatchError> {
        let h = self.start(
            Direction::Write,
            transfers,
            notify,
            Instant::now() + timeout,
        )?;
        Ok(h.wait().await?)
    }

    /// Reads remote ranges into local ranges and waits for the batch.
    pub async fn read_batch(
        &self,
        transfers: Vec<Transfer<LocalSlice>>,
        timeout: Duration,
    ) -> Result<(), BatchError> {
        let h = self.start(Direction::Read, transfers, None, Instant::now() + timeout)?;
        Ok(h.wait().await?)
    }

    /// Maps the whole registration `reg` of the exporter, waiting at most
    /// `timeout`. The memfds come in batches, each mapped as it arrives and
    /// closed at once, so no more than [`super::MAX_FDS`] are open here at
    /// a time whatever the registration's size. Mapping a segment again
    /// retires the earlier mapping (batches on it fail with
    /// `NotRegistered`). A registration of more chunks than
    /// `Limits::max_map_chunks` (here or at the exporter) is refused with
    /// [`ShmError::TooManyChunks`]; a reply that contradicts itself with
    /// [`ShmError::BadMap`], leaving nothing mapped.
    pub fn map(&self, reg: &Registration, timeout: Duration) -> Result<(), ShmError> {
        let op = self.inner.next_op.fetch_add(1, Ordering::Relaxed);
        let (tx, rx) = mpsc::sync_channel(1);
        self.inner.waiting.lock().unwrap().insert(
            op,
            MapWaiter {
                reg: *reg,
                reply: tx,
                assembly: None,
            },
        );
        let target = reg.whole();
        let sent = self
            .inner
            .writer
            .lock()
            .unwrap()
            .write_all(&Header::MapReq { op, target }.encode());
        let res = match sent {
            _ if self.inner.lost.load(Ordering::Acquire) => Err(ShmError::PeerLost),
            Err(_) => Err(ShmError::PeerLost),
            Ok(()) => rx.recv_timeout(timeout).unwrap_or_else(|e| match e {
                mpsc::RecvTimeoutError::Timeout => Err(ShmError::Timeout),
                mpsc::RecvTimeoutError::Disconnected => Err(ShmError::PeerLost),
            }),
        };
        self.inner.waiting.lock().unwrap().remove(&op);
        res
    }

    /// Whether the exporter's connection is gone. Mappings made before stay
    /// readable (they hold their pages), but a caller that must not go on
    /// without a live exporter checks this between copies.
    pub fn peer_lost(&self) -> bool {
        self.inner.lost.load(Ordering::Acquire)
    }

    /// How many unmap requests this importer has honoured.
    pub fn unmapped(&self) -> u64 {
        self.inner.unmapped.load(Ordering::Relaxed)
    }

    /// The epoch of the registration of `segment` mapped here now, if any:
    /// `None` after an unmap (a deregistration or a fence), so a caller
    /// knows it must map again before its next batch.
    pub fn mapped_epoch(&self, segment: u64) -> Option<u64> {
        let slot = self.inner.maps.lock().unwrap().get(&segment).cloned()?;
        let guard = slot.read().unwrap();
        guard.as_ref().map(|imp| imp.reg.epoch)
    }

    fn with<T>(
        &self,
        segment: u64,
        epoch: u64,
        offset: u64,
        len: usize,
        f: impl FnOnce(*mut u8) -> T,
    ) -> Result<T, ShmError> {
        let slot = self
            .inner
            .maps
            .lock()
            .unwrap()
            .get(&segment)
            .cloned()
            .ok_or(ShmError::NotMapped(segment))?;
        let guard = slot.read().unwrap();
        let imp = guard.as_ref().ok_or(ShmError::NotMapped(segment))?;
        if imp.reg.epoch != epoch {
            return Err(RemoteError::from(AccessError::StaleEpoch {
                have: epoch,
                want: imp.reg.epoch,
            })
            .into());
        }
        match offset.checked_add(len as u64) {
            // SAFETY: bounds checked against the imported registration; the
            // read lock keeps the mapping alive until the copy ends.
            Some(end) if end <= imp.reg.len => Ok(f(unsafe {
                imp.mapping.base().add(imp.skew + offset as usize)
            })),
            _ => Err(RemoteError::from(AccessError::OutOfBounds {
                offset,
                len: len as u64,
                registered: imp.reg.len,
            })
            .into()),
        }
    }

    /// Copies `src` into the imported registration at `offset`, at once on
    /// the calling thread (no batch, no deadline, no notification).
    pub fn write(&self, segment: u64, epoch: u64, offset: u64, src: &[u8]) -> Result<(), ShmError> {
        // SAFETY: `with` checked the range.
        self.with(segment, epoch, offset, src.len(), |p| unsafe {
            std::ptr::copy_nonoverlapping(src.as_ptr(), p, src.len())
        })
    }

    /// Copies from the imported registration at `offset` into `dst`.
    pub fn read(
        &self,
        segment: u64,
        epoch: u64,
        offset: u64,
        dst: &mut [u8],
    ) -> Result<(), ShmError> {
        let n = dst.len();
        // SAFETY: `with` checked the range.
        self.with(segment, epoch, offset, n, |p| unsafe {
            std::ptr::copy_nonoverlapping(p, dst.as_mut_ptr(), n)
        })
    }
}

impl Drop for ShmImporter {
    fn drop(&mut self) {
        // Workers finish the batches already queued (each bounded by its
        // deadline), then exit.
        self.jobs.lock().unwrap().take();
        // No mapping outlives the connection: the exporter takes the
        // connection's end for this peer's unmap.
        unmap_all(&self.inner);
        let _ = self
            .inner
            .writer
            .lock()
            .unwrap()
            .shutdown(std::net::Shutdown::Both);
    }
}

fn import_reader(inner: Arc<ImpInner>, stream: UnixStream) {
    loop {
        let mut fds = Vec::new();
        let Ok((header, data)) = read_header(&stream, &inner.limits, &mut fds) else {
            break;
        };
        // Descriptors that came with any other frame are closed here.
        if !on_frame(&inner, header, &data, fds) {
            break;
        }
    }
    // Lost: pending maps and notifications fail (their senders drop), later
    // ones at once. The mappings go before the connection closes (the
    // exporter takes its end for this peer's unmap); a batch in progress
    // fails at its next slice.
    inner.lost.store(true, Ordering::Release);
    unmap_all(&inner);
    let _ = inner
        .writer
        .lock()
        .unwrap()
        .shutdown(std::net::Shutdown::Both);
    inner.waiting.lock().unwrap().clear();
    inner.notifying.lock().unwrap().clear();
}

/// Handles one frame from the exporter; `false` closes the connection.
fn on_frame(inner: &ImpInner, header: Header, data: &[u8], fds: Vec<OwnedFd>) -> bool {
    match header {
        Header::MapResp { op, .. } => on_map_head(inner, op, data),
        Header::MapPart { op, .. } => on_map_part(inner, op, data, fds),
        Header::Error { op, error } => {
            let map_waiter = inner.waiting.lock().unwrap().remove(&op);
            if let Some(w) = map_waiter {
                let _ = w.reply.send(Err(error.into()));
            } else if let Some(tx) = inner.notifying.lock().unwrap().remove(&op) {
                let _ = tx.send(Err(error));
            }
        }
        Header::NotifyAck { op } => {
            if let Some(tx) = inner.notifying.lock().unwrap().remove(&op) {
                let _ = tx.send(Ok(()));
            }
        }
        Header::Unmap { op, segment } => {
            unmap(inner, segment);
            return inner
                .writer
                .lock()
                .unwrap()
                .write_all(&Header::UnmapAck { op, segment }.encode())
                .is_ok();
        }
        _ => return false,
    }
    true
}

/// Ends a map call with `result`.
fn answer(w: MapWaiter, result: Result<(), ShmError>) {
    let _ = w.reply.send(result);
}

/// The head of a map reply: reserve what it announces. A head nobody waits
/// for (the call timed out) is dropped.
fn on_map_head(inner: &ImpInner, op: u64, data: &[u8]) {
    let mut waiting = inner.waiting.lock().unwrap();
    let Some(w) = waiting.get_mut(&op) else {
        return;
    };
    let started = match w.assembly {
        Some(_) => Err(BadMap::SecondHead.into()),
        None => Assembly::start(w.reg, data, &inner.limits).map(|a| w.assembly = Some(a)),
    };
    if let Err(e) = started {
        let w = waiting.remove(&op);
        drop(waiting);
        if let Some(w) = w {
            answer(w, Err(e));
        }
    }
}

/// One part of a map reply: map it and close its descriptors; the last one
/// installs the mapping.
fn on_map_part(inner: &ImpInner, op: u64, data: &[u8], fds: Vec<OwnedFd>) {
    let mut waiting = inner.waiting.lock().unwrap();
    let Some(w) = waiting.get_mut(&op) else {
        return;
    };
    let added = match w.assembly.as_mut() {
        Some(a) => a.add(data, fds),
        None => Err(BadMap::NoHead.into()),
    };
    match added {
        Ok(false) => {}
        Ok(true) => {
            let Some(mut w) = waiting.remove(&op) else {
                return;
            };
            drop(waiting);
            if let Some(a) = w.assembly.take() {
                install(inner, a.finish());
            }
            answer(w, Ok(()));
        }
        Err(e) => {
            let w = waiting.remove(&op);
            drop(waiting);
            if let Some(w) = w {
                answer(w, Err(e));
            }
        }
    }
}

/// Makes `imp` the mapping of its segment, retiring any earlier one.
fn install(inner: &ImpInner, imp: Imported) {
    let segment = imp.reg.segment;
    let old = inner
        .maps
        .lock()
        .unwrap()
        .insert(segment, Arc::new(RwLock::new(Some(imp))));
    if let Some(old) = old {
        // The write lock waits for a copy in progress on the old mapping.
        old.write().unwrap().take();
    }
}

/// Drops the mapping of `segment` once no copy is in progress on it. A map
/// of it still being put together came before the request on the wire (an
/// exporter that interleaves them): it is abandoned too.
/// Drops every mapping, each after the slice in progress on it: from here
/// on no batch touches the exporter's memory.
fn unmap_all(inner: &ImpInner) {
    let slots: Vec<Slot> = inner.maps.lock().unwrap().drain().map(|(_, s)| s).collect();
    for slot in slots {
        slot.write().unwrap().take();
    }
}

fn unmap(inner: &ImpInner, segment: u64) {
    let slot = inner.maps.lock().unwrap().remove(&segment);
    if let Some(slot) = slot {
        // The write lock waits for copies in flight; then the mapping goes.
        slot.write().unwrap().take();
    }
    let abandoned: Vec<MapWaiter> = {
        let mut waiting = inner.waiting.lock().unwrap();
        let ops: Vec<u64> = waiting
            .iter()
            .filter(|(_, w)| w.assembly.as_ref().is_some_and(|a| a.segment() == segment))
            .map(|(op, _)| *op)
            .collect();
        ops.iter().filter_map(|op| waiting.remove(op)).collect()
    };
    for w in abandoned {
        answer(w, Err(ShmError::NotMapped(segment)));
    }
    inner.unmapped.fetch_add(1, Ordering::Relaxed);
}

/// A remote range checked against an imported registration.
struct Checked {
    slot: Slot,
    /// Offset of the range's first byte from the mapping's base.
    at: usize,
    len: usize,
}

/// Checks `t` against the mapping its batch started with: the segment is
/// still mapped by it, and key, epoch and bounds match the imported
/// registration.
fn check(t: &Target, slot: &Option<Slot>) -> Result<Checked, TransferError> {
    let refuse = |e: AccessError| TransferError::Remote(RemoteError::Access(e));
    let not_mapped = || refuse(AccessError::NotRegistered { segment: t.segment });
    let slot = slot.clone().ok_or_else(not_mapped)?;
    let guard = slot.read().unwrap();
    let imp = guard.as_ref().ok_or_else(not_mapped)?;
    if t.epoch != imp.reg.epoch {
        return Err(refuse(AccessError::StaleEpoch {
            have: t.epoch,
            want: imp.reg.epoch,
        }));
    }
    if t.key != imp.reg.key {
        return Err(refuse(AccessError::BadKey { segment: t.segment }));
    }
    match t.offset.checked_add(t.len) {
        Some(end) if end <= imp.reg.len => {
            let at = imp.skew + t.offset as usize;
            drop(guard);
            Ok(Checked {
                slot,
                at,
                len: t.len as usize,
            })
        }
        _ => Err(refuse(AccessError::OutOfBounds {
            offset: t.offset,
            len: t.len,
            registered: imp.reg.len,
        })),
    }
}

/// Runs one batch on a worker thread; see [`ShmImporter::start`].
fn run_batch(inner: &ImpInner, job: &Job) -> Result<(), TransferError> {
    let stop = || {
        if job.cancel.load(Ordering::Acquire) {
            Err(TransferError::Cancelled)
        } else if Instant::now() >= job.deadline {
            Err(TransferError::Timeout)
        } else {
            Ok(())
        }
    };
    stop()?;
    // Every range is checked before any byte moves.
    let checked = job
        .transfers
        .iter()
        .zip(&job.slots)
        .map(|(t, s)| check(&t.remote, s))
        .collect::<Result<Vec<_>, _>>()?;
    let max_slice = inner.cfg.max_slice.max(1) as usize;
    let mut slices = 0u64;
    for (t, c) in job.transfers.iter().zip(&checked) {
        let mut off = 0;
        while off < c.len {
            if let Some(hook) = &inner.cfg.before_slice {
                (hook.0)(slices);
            }
            slices += 1;
            stop()?;
            let n = max_slice.min(c.len - off);
            copy_slice(job.dir, t, c, off, n)?;
            let mut st = inner.stats.lock().unwrap();
            st.ops_done += 1;
            match job.dir {
                Direction::Write => st.bytes_written += n as u64,
                Direction::Read => st.bytes_read += n as u64,
            }
            drop(st);
            off += n;
        }
    }
    let Some(payload) = &job.notify else {
        return Ok(());
    };
    stop()?;
    send_notification(inner, payload, job.deadline)
}

/// Copies `n` bytes at `off` of one checked transfer, on the mapping it
/// was checked against; fails if that mapping was unmapped or replaced.
fn copy_slice(
    dir: Direction,
    t: &Transfer<LocalSlice>,
    c: &Checked,
    off: usize,
    n: usize,
) -> Result<(), TransferError> {
    // The read lock keeps the mapping alive for this slice; an unmap (or a
    // new map of the segment) waits for it, then empties the slot, and the
    // next slice finds it empty.
    let guard = c.slot.read().unwrap();
    let Some(imp) = guard.as_ref() else {
        return Err(TransferError::Remote(RemoteError::Access(
            AccessError::NotRegistered {
                segment: t.remote.segment,
            },
        )));
    };
    let local = t.local.slice(off as u64, n as u64);
    // SAFETY: the range was checked against this very mapping (the slot
    // holds one import for its whole life), and the guard keeps it mapped;
    // the batch protocol schedules no other access to the local range while
    // this batch runs.
    unsafe {
        let remote = imp.mapping.base().add(c.at + off);
        match dir {
            Direction::Write => std::ptr::copy_nonoverlapping(local.bytes().as_ptr(), remote, n),
            Direction::Read => {
                std::ptr::copy_nonoverlapping(remote, local.bytes_mut().as_mut_ptr(), n)
            }
        }
    }
    Ok(())
}

/// Sends a batch's notification after its last copy and waits (by the
/// batch's deadline) for the exporter to queue it.
fn send_notification(
    inner: &ImpInner,
    payload: &[u8],
    deadline: Instant,
) -> Result<(), TransferError> {
    // Order every store of the batch before the notification leaves.
    std::sync::atomic::fence(Ordering::SeqCst);
    let op = inner.next_op.fetch_add(1, Ordering::Relaxed);
    let (tx, rx) = mpsc::sync_channel(1);
    inner.notifying.lock().unwrap().insert(op, tx);
    let mut bytes = Header::Notify {
        op,
        len: payload.len() as u32,
    }
    .encode()
    .to_vec();
    bytes.extend_from_slice(payload);
    let sent = inner.writer.lock().unwrap().write_all(&bytes);
    let res = match sent {
        _ if inner.lost.load(Ordering::Acquire) => Err(TransferError::PeerLost),
        Err(_) => Err(TransferError::PeerLost),
        Ok(()) => match rx.recv_timeout(deadline.saturating_duration_since(Instant::now())) {
            Ok(r) => r.map_err(TransferError::Remote),
            Err(mpsc::RecvTimeoutError::Timeout) => Err(TransferError::Timeout),
            Err(mpsc::RecvTimeoutError::Disconnected) => Err(TransferError::PeerLost),
        },
    };
    inner.notifying.lock().unwrap().remove(&op);
    res
}
