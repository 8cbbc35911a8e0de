//! Shared memory between agents on one host.
//!
//! A [`ShmExporter`] listens on a Unix socket. A peer ([`ShmImporter`])
//! asks it for a registration (`MapReq` naming segment, key and epoch); the
//! exporter checks the request against its [`Registry`] like any remote
//! access and answers with the registration's memfds (SCM_RIGHTS) and their
//! layout. The importer maps them and from then on copies directly, checking
//! each copy against the epoch and bounds it imported.
//!
//! A peer's mapping pins pages just as a registration does, so
//! [`ShmExporter::deregister`] first sends `Unmap` to every peer that mapped
//! the segment and waits (up to a deadline) for each `UnmapAck`; the
//! importer acknowledges only after its copies in flight ended and its
//! mapping is gone. Only then is the registration dropped, so the memory is
//! accounted free only once no one can reach it.
//!
//! Batches ([`ShmImporter::start`]) take the TCP path's descriptions
//! ([`Transfer`] of a [`LocalSlice`] and a remote [`Target`]) and end with
//! its [`TransferError`]. A worker thread checks every remote range against
//! the imported registration (key, epoch, bounds) before the first byte
//! moves, then copies slice by slice; between slices it checks cancellation
//! and the deadline and never starts a slice after either. The notification
//! goes over the socket after the last slice, and the exporter queues it
//! (bounded; full → `Busy`) only on receipt, so it follows all the data. An
//! unmap takes the mapping's write lock: it waits for the slice in
//! progress, and the batch's next slice finds the mapping gone and fails
//! with `NotRegistered`.
//!
//! Control frames are the [`crate::frame`] headers; blocking sockets with
//! timeouts, one reader thread per connection.
//!
//! Bounds: at most [`MAX_FDS`] memfds per registration (the kernel's
//! SCM_RIGHTS limit), the layout within `Limits::max_notify`, every wait
//! with a deadline.

use std::collections::{HashMap, HashSet};
use std::io::{self, Write};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{mpsc, Arc, Condvar, Mutex, RwLock};
use std::time::{Duration, Instant};

use crate::frame::{Header, Limits, RemoteError, Target, HEADER_LEN};
use crate::proto::{Direction, LocalRange, StartError, Stats, Transfer, TransferError};
use crate::registry::{AccessError, Mapping, Registration, Registry};
use crate::tcp::{BatchError, LocalSlice};

/// Most memfds one registration may span to be shared (SCM_MAX_FD).
pub const MAX_FDS: usize = 253;

/// How long one control write may block on a peer that does not read.
const WRITE_TIMEOUT: Duration = Duration::from_secs(5);

#[derive(Debug, thiserror::Error)]
pub enum ShmError {
    #[error(transparent)]
    Remote(#[from] RemoteError),
    #[error("segment {0} is not mapped here")]
    NotMapped(u64),
    #[error("deadline passed")]
    Timeout,
    #[error("the peer was lost")]
    PeerLost,
    #[error("peers {peers:?} did not acknowledge unmapping segment {segment} in time; their mappings still pin its pages")]
    UnmapTimeout { segment: u64, peers: Vec<u64> },
    #[error("protocol: {0}")]
    Protocol(String),
    #[error("registration spans {0} memfds; at most {MAX_FDS} can be shared")]
    TooManyChunks(usize),
    #[error(transparent)]
    Io(#[from] io::Error),
}

/// Sends `bytes` with `fds` attached (SCM_RIGHTS) on a Unix stream socket.
pub fn send_with_fds(sock: &UnixStream, bytes: &[u8], fds: &[RawFd]) -> io::Result<()> {
    let mut iov = libc::iovec { iov_base: bytes.as_ptr() as *mut libc::c_void, iov_len: bytes.len() };
    let fd_bytes = std::mem::size_of_val(fds);
    // SAFETY: CMSG_SPACE is a pure size computation.
    let space = unsafe { libc::CMSG_SPACE(fd_bytes as u32) } as usize;
    let mut cbuf = vec![0u64; space.div_ceil(8)];
    // SAFETY: msghdr is plain data; zero is a valid "empty" value.
    let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
    msg.msg_iov = &mut iov;
    msg.msg_iovlen = 1;
    if !fds.is_empty() {
        msg.msg_control = cbuf.as_mut_ptr() as *mut libc::c_void;
        msg.msg_controllen = space as _;
        // SAFETY: the control buffer holds one header and fd_bytes of data.
        unsafe {
            let c = libc::CMSG_FIRSTHDR(&msg);
            (*c).cmsg_level = libc::SOL_SOCKET;
            (*c).cmsg_type = libc::SCM_RIGHTS;
            (*c).cmsg_len = libc::CMSG_LEN(fd_bytes as u32) as _;
            std::ptr::copy_nonoverlapping(fds.as_ptr() as *const u8, libc::CMSG_DATA(c), fd_bytes);
        }
    }
    // SAFETY: msg points at live buffers for the duration of the call.
    let n = unsafe { libc::sendmsg(sock.as_raw_fd(), &msg, libc::MSG_NOSIGNAL) };
    if n < 0 {
        return Err(io::Error::last_os_error());
    }
    (&*sock).write_all(&bytes[n as usize..])
}

/// Reads exactly `buf.len()` bytes, collecting any descriptors that arrive with them.
pub fn recv_with_fds(sock: &UnixStream, buf: &mut [u8], fds: &mut Vec<OwnedFd>) -> io::Result<()> {
    let mut got = 0;
    while got < buf.len() {
        let mut iov = libc::iovec { iov_base: buf[got..].as_mut_ptr() as *mut libc::c_void, iov_len: buf.len() - got };
        // SAFETY: a pure size computation.
        let space = unsafe { libc::CMSG_SPACE((MAX_FDS * std::mem::size_of::<RawFd>()) as u32) } as usize;
        let mut cbuf = vec![0u64; space.div_ceil(8)];
        // SAFETY: as in send_with_fds.
        let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
        msg.msg_iov = &mut iov;
        msg.msg_iovlen = 1;
        msg.msg_control = cbuf.as_mut_ptr() as *mut libc::c_void;
        msg.msg_controllen = space as _;
        // SAFETY: msg points at live buffers for the duration of the call.
        let n = unsafe { libc::recvmsg(sock.as_raw_fd(), &mut msg, libc::MSG_CMSG_CLOEXEC) };
        if n < 0 {
            let e = io::Error::last_os_error();
            if e.kind() == io::ErrorKind::Interrupted {
                continue;
            }
            return Err(e);
        }
        // SAFETY: walking the control messages the kernel just wrote.
        unsafe {
            let mut c = libc::CMSG_FIRSTHDR(&msg);
            while !c.is_null() {
                if (*c).cmsg_level == libc::SOL_SOCKET && (*c).cmsg_type == libc::SCM_RIGHTS {
                    let data = libc::CMSG_DATA(c);
                    let count = ((*c).cmsg_len as usize - libc::CMSG_LEN(0) as usize) / std::mem::size_of::<RawFd>();
                    for i in 0..count {
                        let fd = std::ptr::read_unaligned((data as *const RawFd).add(i));
                        fds.push(OwnedFd::from_raw_fd(fd));
                    }
                }
                c = libc::CMSG_NXTHDR(&msg, c);
            }
        }
        if msg.msg_flags & libc::MSG_CTRUNC != 0 {
            return Err(io::Error::new(io::ErrorKind::InvalidData, "memfds truncated"));
        }
        if n == 0 {
            return Err(io::ErrorKind::UnexpectedEof.into());
        }
        got += n as usize;
    }
    Ok(())
}

fn read_header(sock: &UnixStream, limits: &Limits, fds: &mut Vec<OwnedFd>) -> Result<(Header, Vec<u8>), ShmError> {
    let mut h = [0u8; HEADER_LEN];
    recv_with_fds(sock, &mut h, fds)?;
    let header = Header::decode(&h, limits).map_err(|e| ShmError::Protocol(e.to_string()))?;
    let mut data = vec![0u8; header.data_len()];
    recv_with_fds(sock, &mut data, fds)?;
    Ok((header, data))
}

fn encode_layout(parts: &[(RawFd, usize)], skew: usize, len: u64) -> Vec<u8> {
    let mut out = Vec::with_capacity(24 + 8 * parts.len());
    for v in [skew as u64, len, parts.len() as u64].into_iter().chain(parts.iter().map(|p| p.1 as u64)) {
        out.extend_from_slice(&v.to_le_bytes());
    }
    out
}

/// (skew, registration length, chunk lengths); checked, never panics.
fn decode_layout(b: &[u8]) -> Option<(usize, u64, Vec<usize>)> {
    let words: Vec<u64> = b.chunks_exact(8).map(|c| u64::from_le_bytes(c.try_into().unwrap_or([0; 8]))).collect();
    if !b.len().is_multiple_of(8) || words.len() < 3 || words[2].checked_add(3) != Some(words.len() as u64) {
        return None;
    }
    let lens: Vec<usize> = words[3..].iter().map(|&l| l as usize).collect();
    let total: usize = lens.iter().try_fold(0usize, |a, &l| a.checked_add(l))?;
    let (skew, len) = (words[0] as usize, words[1]);
    (skew.checked_add(len as usize)? <= total).then_some((skew, len, lens))
}

struct ExpPeer {
    writer: Mutex<UnixStream>,
    mapped: Mutex<HashSet<u64>>,
}

struct ExpInner {
    registry: Arc<Registry>,
    limits: Limits,
    peers: Mutex<HashMap<u64, Arc<ExpPeer>>>,
    /// (peer, segment) unmaps asked for and not yet acknowledged.
    pending: Mutex<HashSet<(u64, u64)>>,
    acked: Condvar,
    next_op: AtomicU64,
    stop: AtomicBool,
    /// Held while a map is granted and recorded, and while a deregistration
    /// refuses new maps and collects the holders: no map slips between.
    grant: Mutex<()>,
    /// Notifications delivered by peers, bounded; a full queue refuses with `Busy`.
    notify_tx: mpsc::SyncSender<ShmNotification>,
}

/// Notifications an exporter queues by default before refusing more.
pub const DEFAULT_NOTIFY_QUEUE: usize = 256;

/// A notification a peer sent after all data of its batch landed.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ShmNotification {
    /// The exporter's id for the connection it came on.
    pub peer: u64,
    pub payload: Vec<u8>,
}

/// Shares registrations with peers on this host.
pub struct ShmExporter {
    inner: Arc<ExpInner>,
    path: PathBuf,
    notify_rx: Mutex<mpsc::Receiver<ShmNotification>>,
}

impl ShmExporter {
    /// Listens on `path`, with a notification queue of [`DEFAULT_NOTIFY_QUEUE`].
    pub fn bind(path: &Path, registry: Arc<Registry>, limits: Limits) -> io::Result<ShmExporter> {
        ShmExporter::bind_with_queue(path, registry, limits, DEFAULT_NOTIFY_QUEUE)
    }

    /// Listens on `path`; at most `notify_queue` notifications wait for
    /// [`ShmExporter::recv_notification`], more are refused with `Busy`.
    pub fn bind_with_queue(path: &Path, registry: Arc<Registry>, limits: Limits, notify_queue: usize) -> io::Result<ShmExporter> {
        let listener = UnixListener::bind(path)?;
        let (notify_tx, notify_rx) = mpsc::sync_channel(notify_queue.max(1));
        let inner = Arc::new(ExpInner {
            registry,
            limits,
            peers: Mutex::new(HashMap::new()),
            pending: Mutex::new(HashSet::new()),
            acked: Condvar::new(),
            next_op: AtomicU64::new(1),
            stop: AtomicBool::new(false),
            grant: Mutex::new(()),
            notify_tx,
        });
        let acc = inner.clone();
        std::thread::Builder::new().name("pdkv-shm-accept".into()).spawn(move || {
            let mut next_peer = 1u64;
            for stream in listener.incoming() {
                if acc.stop.load(Ordering::Acquire) {
                    return;
                }
                let Ok(stream) = stream else { continue };
                let Ok(writer) = stream.try_clone() else { continue };
                if writer.set_write_timeout(Some(WRITE_TIMEOUT)).is_err() {
                    continue;
                }
                let id = next_peer;
                next_peer += 1;
                let peer = Arc::new(ExpPeer { writer: Mutex::new(writer), mapped: Mutex::new(HashSet::new()) });
                acc.peers.lock().unwrap().insert(id, peer.clone());
                let inner = acc.clone();
                let _ = std::thread::Builder::new()
                    .name("pdkv-shm-peer".into())
                    .spawn(move || serve_peer(inner, id, peer, stream));
            }
        })?;
        Ok(ShmExporter { inner, path: path.to_path_buf(), notify_rx: Mutex::new(notify_rx) })
    }

    /// The next notification a peer delivered, waiting at most `timeout`.
    /// A notification is queued only after every copy of its batch ended.
    pub fn recv_notification(&self, timeout: Duration) -> Option<ShmNotification> {
        self.notify_rx.lock().unwrap().recv_timeout(timeout).ok()
    }

    /// Peers connected now.
    pub fn peers(&self) -> usize {
        self.inner.peers.lock().unwrap().len()
    }

    /// Asks every peer that mapped `segment` to unmap it, waits up to
    /// `timeout` for all their acks, then deregisters it. The registration is
    /// dropped in any case (no new access is granted); if some peer did not
    /// ack in time its mapping still pins the pages, and this says which.
    pub fn deregister(&self, segment: u64, timeout: Duration) -> Result<(), ShmError> {
        let deadline = Instant::now() + timeout;
        // Refuse new maps of the segment first, then ask the holders.
        let grant = self.inner.grant.lock().unwrap();
        let registry_had = self.inner.registry.deregister(segment);
        let holders: Vec<(u64, Arc<ExpPeer>)> = self
            .inner
            .peers
            .lock()
            .unwrap()
            .iter()
            .filter(|(_, p)| p.mapped.lock().unwrap().contains(&segment))
            .map(|(id, p)| (*id, p.clone()))
            .collect();
        drop(grant);
        let mut pending = self.inner.pending.lock().unwrap();
        for (id, peer) in &holders {
            pending.insert((*id, segment));
            let op = self.inner.next_op.fetch_add(1, Ordering::Relaxed);
            let h = Header::Unmap { op, segment }.encode();
            if peer.writer.lock().unwrap().write_all(&h).is_err() {
                tracing::warn!(peer = id, segment, "unmap request could not be sent");
            }
        }
        while holders.iter().any(|(id, _)| pending.contains(&(*id, segment))) {
            let now = Instant::now();
            if now >= deadline {
                let late: Vec<u64> = holders.iter().map(|h| h.0).filter(|id| pending.contains(&(*id, segment))).collect();
                for id in &late {
                    pending.remove(&(*id, segment));
                }
                return Err(ShmError::UnmapTimeout { segment, peers: late });
            }
            pending = self.inner.acked.wait_timeout(pending, deadline - now).unwrap().0;
        }
        tracing::debug!(segment, registry_had, peers = holders.len(), "deregistered after unmap acks");
        Ok(())
    }
}

impl Drop for ShmExporter {
    fn drop(&mut self) {
        self.inner.stop.store(true, Ordering::Release);
        let _ = UnixStream::connect(&self.path); // wakes the accept loop
        for p in self.inner.peers.lock().unwrap().values() {
            let _ = p.writer.lock().unwrap().shutdown(std::net::Shutdown::Both);
        }
        let _ = std::fs::remove_file(&self.path);
    }
}

fn serve_peer(inner: Arc<ExpInner>, id: u64, peer: Arc<ExpPeer>, stream: UnixStream) {
    let mut junk = Vec::new();
    while let Ok((header, data)) = read_header(&stream, &inner.limits, &mut junk) {
        junk.clear(); // a peer has no business sending memfds; they are closed
        match header {
            Header::MapReq { op, target } => {
                let grant = inner.grant.lock().unwrap();
                let reply = match inner.registry.access(target.segment, target.key, target.epoch, 0, target.len) {
                    Err(e) => Err(RemoteError::from(e)),
                    Ok(a) if a.registration().len != target.len => Err(RemoteError::from(AccessError::OutOfBounds {
                        offset: 0,
                        len: target.len,
                        registered: a.registration().len,
                    })),
                    Ok(a) => Ok(a),
                };
                let sent = match reply {
                    Ok(a) => {
                        let (parts, skew) = a.pinned().layout();
                        if parts.len() > MAX_FDS {
                            send_plain(&peer, Header::Error { op, error: AccessError::OutOfBounds { offset: 0, len: target.len, registered: target.len }.into() })
                        } else {
                            // Record the holder before it can map, so a
                            // deregistration racing with this map waits for it.
                            peer.mapped.lock().unwrap().insert(target.segment);
                            let layout = encode_layout(&parts, skew, a.registration().len);
                            let mut bytes = Header::MapResp { op, len: layout.len() as u32 }.encode().to_vec();
                            bytes.extend_from_slice(&layout);
                            let fds: Vec<RawFd> = parts.iter().map(|p| p.0).collect();
                            let w = peer.writer.lock().unwrap();
                            send_with_fds(&w, &bytes, &fds).is_ok()
                        }
                    }
                    Err(error) => send_plain(&peer, Header::Error { op, error }),
                };
                drop(grant);
                if !sent {
                    break;
                }
            }
            Header::Notify { op, .. } => {
                // The importer sends this only after its batch's last copy;
                // the socket orders it after those stores.
                let reply = match inner.notify_tx.try_send(ShmNotification { peer: id, payload: data }) {
                    Ok(()) => Header::NotifyAck { op },
                    Err(_) => Header::Error { op, error: RemoteError::Busy },
                };
                if !send_plain(&peer, reply) {
                    break;
                }
            }
            Header::UnmapAck { segment, .. } => {
                peer.mapped.lock().unwrap().remove(&segment);
                inner.pending.lock().unwrap().remove(&(id, segment));
                inner.acked.notify_all();
            }
            _ => break,
        }
    }
    let _ = stream.shutdown(std::net::Shutdown::Both);
    inner.peers.lock().unwrap().remove(&id);
}

fn send_plain(peer: &ExpPeer, h: Header) -> bool {
    peer.writer.lock().unwrap().write_all(&h.encode()).is_ok()
}

/// One imported registration.
struct Imported {
    reg: Registration,
    mapping: Mapping,
    skew: usize,
}

type Slot = Arc<RwLock<Option<Imported>>>;
type MapReply = mpsc::Sender<Result<(), ShmError>>;

type NotifyReply = mpsc::Sender<Result<(), RemoteError>>;

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
        ShmImporterConfig { workers: 2, max_batches: 1024, max_slice: 1 << 20, before_slice: None }
    }
}

struct ImpInner {
    limits: Limits,
    cfg: ShmImporterConfig,
    maps: Mutex<HashMap<u64, Slot>>,
    waiting: Mutex<HashMap<u64, (Registration, MapReply)>>,
    /// Notifications sent and not yet acknowledged, by op id.
    notifying: Mutex<HashMap<u64, NotifyReply>>,
    writer: Mutex<UnixStream>,
    unmapped: AtomicU64,
    next_op: AtomicU64,
    /// Batches started and not yet ended.
    live_batches: AtomicU64,
    stats: Mutex<Stats>,
}

/// One batch handed to a worker.
struct Job {
    dir: Direction,
    transfers: Vec<Transfer<LocalSlice>>,
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

    pub fn connect_with(path: &Path, limits: Limits, cfg: ShmImporterConfig) -> io::Result<ShmImporter> {
        let stream = UnixStream::connect(path)?;
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
            next_op: AtomicU64::new(1),
            live_batches: AtomicU64::new(0),
            stats: Mutex::new(Stats::default()),
        });
        let r = inner.clone();
        std::thread::Builder::new().name("pdkv-shm-import".into()).spawn(move || import_reader(r, stream))?;
        let (tx, rx) = mpsc::channel::<Job>();
        let rx = Arc::new(Mutex::new(rx));
        for _ in 0..workers {
            let (inner, rx) = (inner.clone(), rx.clone());
            std::thread::Builder::new().name("pdkv-shm-copy".into()).spawn(move || loop {
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
                let _ = job.done.send(result);
            })?;
        }
        Ok(ShmImporter { inner, jobs: Mutex::new(Some(tx)) })
    }

    /// This importer's counters: bytes and slices moved, batches ended by outcome.
    pub fn stats(&self) -> Stats {
        self.inner.stats.lock().unwrap().clone()
    }

    /// Starts a batch on a worker: `Write` copies each local range into its
    /// remote range, `Read` the other way. Every remote range is checked
    /// against the mapped registration (segment mapped, key, epoch, bounds)
    /// before the first byte moves; a refusal fails the batch with
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
        if let Some(n) = &notify {
            let limit = self.inner.limits.max_notify as usize;
            if n.len() > limit {
                return Err(StartError::NotifyTooLarge { len: n.len(), limit });
            }
        }
        for (index, t) in transfers.iter().enumerate() {
            if t.local.len() != t.remote.len {
                return Err(StartError::LengthMismatch { index, local: t.local.len(), remote: t.remote.len });
            }
        }
        let max = self.inner.cfg.max_batches as u64;
        if self.inner.live_batches.fetch_add(1, Ordering::AcqRel) >= max {
            self.inner.live_batches.fetch_sub(1, Ordering::AcqRel);
            return Err(StartError::TooManyBatches(max as usize));
        }
        let cancel = Arc::new(AtomicBool::new(false));
        let (done, rx) = tokio::sync::oneshot::channel();
        let job = Job { dir, transfers, notify, deadline, cancel: cancel.clone(), done };
        let sent = self.jobs.lock().unwrap().as_ref().map(|tx| tx.send(job));
        if !matches!(sent, Some(Ok(()))) {
            // Workers gone: the batch ends at once (its sender dropped).
            self.inner.live_batches.fetch_sub(1, Ordering::AcqRel);
        }
        Ok(ShmBatchHandle { cancel, rx: Some(rx) })
    }

    /// Writes local ranges to remote ranges and waits for the batch.
    pub async fn write_batch(
        &self,
        transfers: Vec<Transfer<LocalSlice>>,
        notify: Option<Vec<u8>>,
        timeout: Duration,
    ) -> Result<(), BatchError> {
        let h = self.start(Direction::Write, transfers, notify, Instant::now() + timeout)?;
        Ok(h.wait().await?)
    }

    /// Reads remote ranges into local ranges and waits for the batch.
    pub async fn read_batch(&self, transfers: Vec<Transfer<LocalSlice>>, timeout: Duration) -> Result<(), BatchError> {
        let h = self.start(Direction::Read, transfers, None, Instant::now() + timeout)?;
        Ok(h.wait().await?)
    }

    /// Maps the whole registration `reg` of the exporter, waiting at most `timeout`.
    pub fn map(&self, reg: &Registration, timeout: Duration) -> Result<(), ShmError> {
        let op = self.inner.next_op.fetch_add(1, Ordering::Relaxed);
        let (tx, rx) = mpsc::channel();
        self.inner.waiting.lock().unwrap().insert(op, (*reg, tx));
        let target = Target { segment: reg.segment, key: reg.key, epoch: reg.epoch, offset: 0, len: reg.len };
        let sent = self.inner.writer.lock().unwrap().write_all(&Header::MapReq { op, target }.encode());
        let res = match sent {
            Err(_) => Err(ShmError::PeerLost),
            Ok(()) => rx.recv_timeout(timeout).unwrap_or_else(|e| match e {
                mpsc::RecvTimeoutError::Timeout => Err(ShmError::Timeout),
                mpsc::RecvTimeoutError::Disconnected => Err(ShmError::PeerLost),
            }),
        };
        self.inner.waiting.lock().unwrap().remove(&op);
        res
    }

    /// How many unmap requests this importer has honoured.
    pub fn unmapped(&self) -> u64 {
        self.inner.unmapped.load(Ordering::Relaxed)
    }

    fn with<T>(&self, segment: u64, epoch: u64, offset: u64, len: usize, f: impl FnOnce(*mut u8) -> T) -> Result<T, ShmError> {
        let slot = self.inner.maps.lock().unwrap().get(&segment).cloned().ok_or(ShmError::NotMapped(segment))?;
        let guard = slot.read().unwrap();
        let imp = guard.as_ref().ok_or(ShmError::NotMapped(segment))?;
        if imp.reg.epoch != epoch {
            return Err(RemoteError::from(AccessError::StaleEpoch { have: epoch, want: imp.reg.epoch }).into());
        }
        match offset.checked_add(len as u64) {
            // SAFETY: bounds checked against the imported registration; the
            // read lock keeps the mapping alive until the copy ends.
            Some(end) if end <= imp.reg.len => Ok(f(unsafe { imp.mapping.base().add(imp.skew + offset as usize) })),
            _ => Err(RemoteError::from(AccessError::OutOfBounds { offset, len: len as u64, registered: imp.reg.len }).into()),
        }
    }

    /// Copies `src` into the imported registration at `offset`, at once on
    /// the calling thread (no batch, no deadline, no notification).
    pub fn write(&self, segment: u64, epoch: u64, offset: u64, src: &[u8]) -> Result<(), ShmError> {
        // SAFETY: `with` checked the range.
        self.with(segment, epoch, offset, src.len(), |p| unsafe { std::ptr::copy_nonoverlapping(src.as_ptr(), p, src.len()) })
    }

    /// Copies from the imported registration at `offset` into `dst`.
    pub fn read(&self, segment: u64, epoch: u64, offset: u64, dst: &mut [u8]) -> Result<(), ShmError> {
        let n = dst.len();
        // SAFETY: `with` checked the range.
        self.with(segment, epoch, offset, n, |p| unsafe { std::ptr::copy_nonoverlapping(p, dst.as_mut_ptr(), n) })
    }
}

impl Drop for ShmImporter {
    fn drop(&mut self) {
        // Workers finish the batches already queued (each bounded by its
        // deadline), then exit.
        self.jobs.lock().unwrap().take();
        let _ = self.inner.writer.lock().unwrap().shutdown(std::net::Shutdown::Both);
    }
}

fn import_reader(inner: Arc<ImpInner>, stream: UnixStream) {
    loop {
        let mut fds = Vec::new();
        let Ok((header, data)) = read_header(&stream, &inner.limits, &mut fds) else { break };
        match header {
            Header::MapResp { op, .. } => {
                let waiter = inner.waiting.lock().unwrap().remove(&op);
                if let Some((reg, tx)) = waiter {
                    let _ = tx.send(import(&inner, reg, &data, fds));
                }
            }
            Header::Error { op, error } => {
                let map_waiter = inner.waiting.lock().unwrap().remove(&op);
                if let Some((_, tx)) = map_waiter {
                    let _ = tx.send(Err(error.into()));
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
                let slot = inner.maps.lock().unwrap().remove(&segment);
                if let Some(slot) = slot {
                    // The write lock waits for copies in flight; then the mapping goes.
                    slot.write().unwrap().take();
                }
                inner.unmapped.fetch_add(1, Ordering::Relaxed);
                if inner.writer.lock().unwrap().write_all(&Header::UnmapAck { op, segment }.encode()).is_err() {
                    break;
                }
            }
            _ => break,
        }
    }
    // Lost: pending maps and notifications fail (their senders drop),
    // mappings stay until the importer drops.
    inner.waiting.lock().unwrap().clear();
    inner.notifying.lock().unwrap().clear();
}

/// A remote range checked against an imported registration.
struct Checked {
    slot: Slot,
    /// Offset of the range's first byte from the mapping's base.
    at: usize,
    len: usize,
}

/// Checks `t` against what this importer mapped: the segment is mapped, and
/// key, epoch and bounds match the imported registration.
fn check(inner: &ImpInner, t: &Target) -> Result<Checked, TransferError> {
    let refuse = |e: AccessError| TransferError::Remote(RemoteError::Access(e));
    let not_mapped = || refuse(AccessError::NotRegistered { segment: t.segment });
    let slot = inner.maps.lock().unwrap().get(&t.segment).cloned().ok_or_else(not_mapped)?;
    let guard = slot.read().unwrap();
    let imp = guard.as_ref().ok_or_else(not_mapped)?;
    if t.epoch != imp.reg.epoch {
        return Err(refuse(AccessError::StaleEpoch { have: t.epoch, want: imp.reg.epoch }));
    }
    if t.key != imp.reg.key {
        return Err(refuse(AccessError::BadKey { segment: t.segment }));
    }
    match t.offset.checked_add(t.len) {
        Some(end) if end <= imp.reg.len => {
            let at = imp.skew + t.offset as usize;
            drop(guard);
            Ok(Checked { slot, at, len: t.len as usize })
        }
        _ => Err(refuse(AccessError::OutOfBounds { offset: t.offset, len: t.len, registered: imp.reg.len })),
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
    let checked = job.transfers.iter().map(|t| check(inner, &t.remote)).collect::<Result<Vec<_>, _>>()?;
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
            {
                // The read lock keeps the mapping alive for this slice; an
                // unmap waits for it, then takes the mapping, and the next
                // slice finds it gone.
                let guard = c.slot.read().unwrap();
                let Some(imp) = guard.as_ref() else {
                    return Err(TransferError::Remote(RemoteError::Access(AccessError::NotRegistered {
                        segment: t.remote.segment,
                    })));
                };
                let local = t.local.slice(off as u64, n as u64);
                // SAFETY: the range was checked against this very mapping
                // (the slot holds one import for its whole life), and the
                // guard keeps it mapped; the batch protocol schedules no
                // other access to the local range while this batch runs.
                unsafe {
                    let remote = imp.mapping.base().add(c.at + off);
                    match job.dir {
                        Direction::Write => std::ptr::copy_nonoverlapping(local.bytes().as_ptr(), remote, n),
                        Direction::Read => std::ptr::copy_nonoverlapping(remote, local.bytes_mut().as_mut_ptr(), n),
                    }
                }
            }
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
    let Some(payload) = &job.notify else { return Ok(()) };
    stop()?;
    // Order every store above before the notification leaves.
    std::sync::atomic::fence(Ordering::SeqCst);
    let op = inner.next_op.fetch_add(1, Ordering::Relaxed);
    let (tx, rx) = mpsc::channel();
    inner.notifying.lock().unwrap().insert(op, tx);
    let mut bytes = Header::Notify { op, len: payload.len() as u32 }.encode().to_vec();
    bytes.extend_from_slice(payload);
    let sent = inner.writer.lock().unwrap().write_all(&bytes);
    let res = match sent {
        Err(_) => Err(TransferError::PeerLost),
        Ok(()) => match rx.recv_timeout(job.deadline.saturating_duration_since(Instant::now())) {
            Ok(r) => r.map_err(TransferError::Remote),
            Err(mpsc::RecvTimeoutError::Timeout) => Err(TransferError::Timeout),
            Err(mpsc::RecvTimeoutError::Disconnected) => Err(TransferError::PeerLost),
        },
    };
    inner.notifying.lock().unwrap().remove(&op);
    res
}

fn import(inner: &ImpInner, reg: Registration, layout: &[u8], fds: Vec<OwnedFd>) -> Result<(), ShmError> {
    let (skew, len, lens) = decode_layout(layout).ok_or_else(|| ShmError::Protocol("bad layout".into()))?;
    if lens.len() != fds.len() || len != reg.len {
        return Err(ShmError::Protocol(format!("{} memfds for {} chunks, {len} bytes for {}", fds.len(), lens.len(), reg.len)));
    }
    let parts: Vec<(RawFd, usize)> = fds.iter().map(|f| f.as_raw_fd()).zip(lens).collect();
    let mapping = Mapping::map(&parts)?;
    drop(fds); // the mapping keeps the pages; the descriptors are not needed
    let slot = Arc::new(RwLock::new(Some(Imported { reg, mapping, skew })));
    inner.maps.lock().unwrap().insert(reg.segment, slot);
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::registry::splitmix64;

    #[test]
    fn layouts_round_trip_and_arbitrary_ones_never_panic() {
        let parts = [(0, 4096), (0, 8192)];
        let b = encode_layout(&parts, 100, 12_000);
        assert_eq!(decode_layout(&b), Some((100, 12_000, vec![4096, 8192])));
        assert_eq!(decode_layout(&encode_layout(&parts, 100, 12_189)), None, "range past the chunks");
        let mut seed = 3;
        for _ in 0..10_000 {
            let n = (splitmix64(&mut seed) % 64) as usize;
            let mut v: Vec<u8> = (0..n).map(|_| splitmix64(&mut seed) as u8).collect();
            if n >= 24 && splitmix64(&mut seed).is_multiple_of(2) {
                v[16..24].copy_from_slice(&((n as u64 - 24) / 8).to_le_bytes());
            }
            if let Some((skew, len, lens)) = decode_layout(&v) {
                assert!(skew as u64 + len <= lens.iter().map(|&l| l as u64).sum());
            }
        }
    }
}
