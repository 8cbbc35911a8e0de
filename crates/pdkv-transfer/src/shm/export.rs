//! The exporting side: shares registrations with peers on this host.

use std::collections::HashMap;
use std::io::{self, Write};
use std::os::fd::RawFd;
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{mpsc, Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

use crate::auth::{self, KvSecret, Port};
use crate::error::AccessError;
use crate::frame::{Header, Limits, RemoteError, Target};
use crate::registry::{Access, Registration, Registry};

use super::layout::{encode_part, MapHead};
use super::{
    check_shareable, read_header, send_with_fds, ShmError, HANDSHAKE_TIMEOUT, MAX_FDS,
    WRITE_TIMEOUT,
};

struct ExpPeer {
    writer: Mutex<UnixStream>,
    /// Segments this peer mapped, each with the generation of its latest
    /// map. Changed only while `writer` is held, so generations follow the
    /// order in which map replies and unmap requests leave.
    mapped: Mutex<HashMap<u64, u64>>,
}

/// An unmap request sent and not yet acknowledged.
struct PendingUnmap {
    peer: u64,
    segment: u64,
    /// The generation of the peer's map the request follows on the wire.
    generation: u64,
}

struct ExpInner {
    registry: Arc<Registry>,
    limits: Limits,
    secret: KvSecret,
    max_peers: usize,
    /// Peer threads alive (handshaking or served).
    threads: AtomicUsize,
    /// Connections refused: their handshake failed, or `max_peers` were served.
    refused: AtomicU64,
    peers: Mutex<HashMap<u64, Arc<ExpPeer>>>,
    /// By op id. Entries go on ack or when their waiter's deadline passes.
    pending: Mutex<HashMap<u64, PendingUnmap>>,
    acked: Condvar,
    next_op: AtomicU64,
    next_generation: AtomicU64,
    stop: AtomicBool,
    /// Held while a map is granted, recorded and sent, and while a
    /// deregistration refuses new maps and collects the holders: no map
    /// slips between.
    grant: Mutex<()>,
    /// Notifications delivered by peers, bounded; a full queue refuses with `Busy`.
    notify_tx: mpsc::SyncSender<ShmNotification>,
}

/// Notifications an exporter queues by default before refusing more.
pub const DEFAULT_NOTIFY_QUEUE: usize = 256;

/// Peers (each served by a thread of its own) an exporter serves at once by default.
pub const DEFAULT_MAX_PEERS: usize = 64;

/// How an exporter serves its peers.
#[derive(Clone, Debug)]
pub struct ExportOptions {
    /// Notifications waiting for [`ShmExporter::recv_notification`]; more are refused with `Busy`.
    pub notify_queue: usize,
    /// Peers served at once (a thread each); more are closed on accept.
    pub max_peers: usize,
    /// The deployment's KV secret, which every peer proves on connect.
    pub secret: KvSecret,
}

impl Default for ExportOptions {
    fn default() -> Self {
        ExportOptions {
            notify_queue: DEFAULT_NOTIFY_QUEUE,
            max_peers: DEFAULT_MAX_PEERS,
            secret: KvSecret::open(),
        }
    }
}

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
    pub fn bind_with_queue(
        path: &Path,
        registry: Arc<Registry>,
        limits: Limits,
        notify_queue: usize,
    ) -> io::Result<ShmExporter> {
        ShmExporter::bind_with(
            path,
            registry,
            limits,
            ExportOptions {
                notify_queue,
                ..ExportOptions::default()
            },
        )
    }

    /// Listens on `path` (a socket only its owner may open) with `opts`.
    pub fn bind_with(
        path: &Path,
        registry: Arc<Registry>,
        limits: Limits,
        opts: ExportOptions,
    ) -> io::Result<ShmExporter> {
        use std::os::unix::fs::PermissionsExt;
        let listener = UnixListener::bind(path)?;
        std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o600))?;
        let (notify_tx, notify_rx) = mpsc::sync_channel(opts.notify_queue.max(1));
        let inner = Arc::new(ExpInner {
            registry,
            limits,
            secret: opts.secret,
            max_peers: opts.max_peers.max(1),
            threads: AtomicUsize::new(0),
            refused: AtomicU64::new(0),
            peers: Mutex::new(HashMap::new()),
            pending: Mutex::new(HashMap::new()),
            acked: Condvar::new(),
            next_op: AtomicU64::new(1),
            next_generation: AtomicU64::new(1),
            stop: AtomicBool::new(false),
            grant: Mutex::new(()),
            notify_tx,
        });
        let acc = inner.clone();
        std::thread::Builder::new()
            .name("pdkv-shm-accept".into())
            .spawn(move || accept_loop(acc, listener))?;
        Ok(ShmExporter {
            inner,
            path: path.to_path_buf(),
            notify_rx: Mutex::new(notify_rx),
        })
    }

    /// The next notification a peer delivered, waiting at most `timeout`.
    /// A notification is queued only after every copy of its batch ended.
    pub fn recv_notification(&self, timeout: Duration) -> Option<ShmNotification> {
        self.notify_rx.lock().unwrap().recv_timeout(timeout).ok()
    }

    /// Peers connected now.
    /// Connections refused so far: a failed handshake, or `max_peers` served.
    pub fn refused(&self) -> u64 {
        self.inner.refused.load(Ordering::Relaxed)
    }

    pub fn peers(&self) -> usize {
        self.inner.peers.lock().unwrap().len()
    }

    /// Whether `reg`, live now, can be shared under this exporter's limits
    /// (the check a map request passes; see [`super::check_shareable`]).
    pub fn check_shareable(&self, reg: &Registration) -> Result<(), ShmError> {
        let a = self
            .inner
            .registry
            .access_whole(reg.segment, reg.key, reg.epoch)?;
        check_shareable(a.pinned().layout().0.len(), &self.inner.limits)
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
        let holders = self.inner.holders(segment);
        drop(grant);
        let n = holders.len();
        self.inner.unmap_and_wait(segment, holders, deadline)?;
        tracing::debug!(
            segment,
            registry_had,
            peers = n,
            "deregistered after unmap acks"
        );
        Ok(())
    }

    /// The fence for shared memory: asks every peer that mapped `segment`
    /// to unmap it and waits up to `timeout` for all their acks, keeping the
    /// registration (a peer may map it again later). A peer acknowledges
    /// only after the copy in progress on the mapping ended and the mapping
    /// is gone, and a batch holds the very mapping it checked, so from the
    /// ack on no copy of a batch started before it touches the segment —
    /// even if the peer maps the segment again meanwhile. Late peers are
    /// named in `UnmapTimeout`; their mappings may still be written.
    pub fn fence(&self, segment: u64, timeout: Duration) -> Result<(), ShmError> {
        let deadline = Instant::now() + timeout;
        let holders = {
            let _grant = self.inner.grant.lock().unwrap();
            self.inner.holders(segment)
        };
        let n = holders.len();
        self.inner.unmap_and_wait(segment, holders, deadline)?;
        tracing::debug!(segment, peers = n, "fenced");
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

impl ExpInner {
    /// The peers that mapped `segment` now.
    fn holders(&self, segment: u64) -> Vec<(u64, Arc<ExpPeer>)> {
        self.peers
            .lock()
            .unwrap()
            .iter()
            .filter(|(_, p)| p.mapped.lock().unwrap().contains_key(&segment))
            .map(|(id, p)| (*id, p.clone()))
            .collect()
    }

    /// Sends `Unmap` to each holder (recording which of its maps the
    /// request follows) and waits until every one is acknowledged or the
    /// deadline passes.
    fn unmap_and_wait(
        &self,
        segment: u64,
        holders: Vec<(u64, Arc<ExpPeer>)>,
        deadline: Instant,
    ) -> Result<(), ShmError> {
        let mut ops = Vec::with_capacity(holders.len());
        for (id, peer) in &holders {
            let mut w = peer.writer.lock().unwrap();
            let Some(generation) = peer.mapped.lock().unwrap().get(&segment).copied() else {
                continue; // acknowledged an earlier request meanwhile
            };
            let op = self.next_op.fetch_add(1, Ordering::Relaxed);
            self.pending.lock().unwrap().insert(
                op,
                PendingUnmap {
                    peer: *id,
                    segment,
                    generation,
                },
            );
            if w.write_all(&Header::Unmap { op, segment }.encode())
                .is_err()
            {
                tracing::warn!(peer = id, segment, "unmap request could not be sent");
            }
            drop(w);
            // The peer's connection may have ended after `holders` saw it
            // and before the insert above, its `peer_gone` then finding
            // nothing to complete: a peer no longer registered maps nothing.
            // (`peer_gone` runs after the peer leaves `peers`, so one of the
            // two sees the other.)
            if !self.peers.lock().unwrap().contains_key(id) {
                self.pending.lock().unwrap().remove(&op);
                continue;
            }
            ops.push(op);
        }
        self.wait_acks(segment, &ops, deadline)
    }

    fn wait_acks(&self, segment: u64, ops: &[u64], deadline: Instant) -> Result<(), ShmError> {
        let mut pending = self.pending.lock().unwrap();
        loop {
            if !ops.iter().any(|op| pending.contains_key(op)) {
                return Ok(());
            }
            let now = Instant::now();
            if now >= deadline {
                let mut peers: Vec<u64> = ops
                    .iter()
                    .filter_map(|op| pending.remove(op))
                    .map(|p| p.peer)
                    .collect();
                peers.sort_unstable();
                peers.dedup();
                return Err(ShmError::UnmapTimeout { segment, peers });
            }
            pending = self.acked.wait_timeout(pending, deadline - now).unwrap().0;
        }
    }

    /// The connection of peer `id` ended: its unmaps in waiting are done. An
    /// importer drops its mappings before its connection closes, and a
    /// process that died maps nothing.
    fn peer_gone(&self, id: u64) {
        let mut pending = self.pending.lock().unwrap();
        let before = pending.len();
        pending.retain(|_, p| p.peer != id);
        let ended = before - pending.len();
        drop(pending);
        if ended > 0 {
            tracing::debug!(peer = id, unmaps = ended, "peer gone; its unmaps are done");
            self.acked.notify_all();
        }
    }

    /// A peer acknowledged the unmap `op`: it no longer maps the segment,
    /// unless it mapped it again after the request (a later generation).
    fn on_unmap_ack(&self, id: u64, peer: &ExpPeer, op: u64) {
        let mut pending = self.pending.lock().unwrap();
        if pending.get(&op).is_none_or(|p| p.peer != id) {
            return; // not ours to acknowledge, or given up on
        }
        let Some(p) = pending.remove(&op) else { return };
        drop(pending);
        let mut mapped = peer.mapped.lock().unwrap();
        if mapped.get(&p.segment) == Some(&p.generation) {
            mapped.remove(&p.segment);
        }
        drop(mapped);
        self.acked.notify_all();
    }

    /// Answers a map request: the registration's layout and memfds, after
    /// the same checks as any remote access (and the registration's own
    /// key: a grant does not open a whole mapping).
    fn on_map_req(&self, peer: &ExpPeer, op: u64, target: &Target) -> bool {
        let _grant = self.grant.lock().unwrap();
        let reply = match self
            .registry
            .access_whole(target.segment, target.key, target.epoch)
        {
            Err(e) => Err(RemoteError::from(e)),
            Ok(a) if a.registration().len != target.len => {
                Err(RemoteError::from(AccessError::OutOfBounds {
                    offset: 0,
                    len: target.len,
                    registered: a.registration().len,
                }))
            }
            Ok(a) => Ok(a),
        };
        match reply {
            Ok(a) => self.send_map(peer, op, &a),
            Err(error) => send_plain(peer, Header::Error { op, error }),
        }
    }

    /// Sends a `MapResp` and its `MapPart`s, all under the peer's writer
    /// lock, so no unmap request can come between them.
    fn send_map(&self, peer: &ExpPeer, op: u64, a: &Access) -> bool {
        let (parts, skew) = a.pinned().layout();
        if let Err(ShmError::TooManyChunks { chunks, limit }) =
            check_shareable(parts.len(), &self.limits)
        {
            return send_plain(
                peer,
                Header::Error {
                    op,
                    error: RemoteError::TooManyChunks { chunks, limit },
                },
            );
        }
        let reg = a.registration();
        let bytes = parts.iter().map(|p| p.1 as u64).sum();
        let head = MapHead {
            skew: skew as u64,
            len: reg.len,
            chunks: parts.len() as u64,
            bytes,
        }
        .encode();
        let w = peer.writer.lock().unwrap();
        // Record the holder before it can map, so an unmap racing with this
        // map waits for it.
        let generation = self.next_generation.fetch_add(1, Ordering::Relaxed);
        peer.mapped.lock().unwrap().insert(reg.segment, generation);
        if !write_frame(
            &w,
            Header::MapResp {
                op,
                len: head.len() as u32,
            },
            &head,
            &[],
        ) {
            return false;
        }
        for (i, batch) in parts.chunks(MAX_FDS).enumerate() {
            let lens: Vec<u64> = batch.iter().map(|p| p.1 as u64).collect();
            let data = encode_part((i * MAX_FDS) as u64, &lens);
            let fds: Vec<RawFd> = batch.iter().map(|p| p.0).collect();
            if !write_frame(
                &w,
                Header::MapPart {
                    op,
                    len: data.len() as u32,
                },
                &data,
                &fds,
            ) {
                return false;
            }
        }
        true
    }

    fn on_notify(&self, id: u64, peer: &ExpPeer, op: u64, payload: Vec<u8>) -> bool {
        // The importer sends this only after its batch's last copy; the
        // socket orders it after those stores.
        let reply = match self
            .notify_tx
            .try_send(ShmNotification { peer: id, payload })
        {
            Ok(()) => Header::NotifyAck { op },
            Err(_) => Header::Error {
                op,
                error: RemoteError::Busy,
            },
        };
        send_plain(peer, reply)
    }
}

fn accept_loop(inner: Arc<ExpInner>, listener: UnixListener) {
    let mut next_peer = 1u64;
    for stream in listener.incoming() {
        if inner.stop.load(Ordering::Acquire) {
            return;
        }
        let stream = match stream {
            Ok(s) => s,
            Err(e) => {
                // Out of descriptors, say: back off instead of spinning.
                tracing::warn!("shared-memory accept failed: {e}");
                std::thread::sleep(Duration::from_millis(100));
                continue;
            }
        };
        if inner.threads.fetch_add(1, Ordering::AcqRel) >= inner.max_peers {
            inner.threads.fetch_sub(1, Ordering::AcqRel);
            inner.refused.fetch_add(1, Ordering::Relaxed);
            tracing::warn!(
                "shared-memory connection refused: {} peers served already",
                inner.max_peers
            );
            continue;
        }
        let id = next_peer;
        next_peer += 1;
        let inner2 = inner.clone();
        let spawned = std::thread::Builder::new()
            .name("pdkv-shm-peer".into())
            .spawn(move || {
                serve_peer(&inner2, id, stream);
                inner2.threads.fetch_sub(1, Ordering::AcqRel);
            });
        if spawned.is_err() {
            inner.threads.fetch_sub(1, Ordering::AcqRel);
        }
    }
}

/// Proves the connection (within [`HANDSHAKE_TIMEOUT`]), then serves it.
fn serve_peer(inner: &Arc<ExpInner>, id: u64, mut stream: UnixStream) {
    let shaken = stream
        .set_read_timeout(Some(HANDSHAKE_TIMEOUT))
        .and_then(|()| stream.set_write_timeout(Some(HANDSHAKE_TIMEOUT)))
        .map_err(|e| e.to_string())
        .and_then(|()| {
            auth::accept_blocking(&mut stream, &inner.secret, Port::Shm, HANDSHAKE_TIMEOUT)
                .map_err(|e| e.to_string())
        })
        .and_then(|()| stream.set_read_timeout(None).map_err(|e| e.to_string()));
    if let Err(e) = shaken {
        inner.refused.fetch_add(1, Ordering::Relaxed);
        tracing::debug!("shared-memory connection refused: {e}");
        return;
    }
    let Ok(writer) = stream.try_clone() else {
        return;
    };
    if writer.set_write_timeout(Some(WRITE_TIMEOUT)).is_err() {
        return;
    }
    let peer = Arc::new(ExpPeer {
        writer: Mutex::new(writer),
        mapped: Mutex::new(HashMap::new()),
    });
    inner.peers.lock().unwrap().insert(id, peer.clone());
    let mut junk = Vec::new();
    while let Ok((header, data)) = read_header(&stream, &inner.limits, &mut junk) {
        junk.clear(); // a peer has no business sending memfds; they are closed
        let ok = match header {
            Header::MapReq { op, target } => inner.on_map_req(&peer, op, &target),
            Header::Notify { op, .. } => inner.on_notify(id, &peer, op, data),
            Header::UnmapAck { op, .. } => {
                inner.on_unmap_ack(id, &peer, op);
                true
            }
            _ => false,
        };
        if !ok {
            break;
        }
    }
    let _ = stream.shutdown(std::net::Shutdown::Both);
    inner.peers.lock().unwrap().remove(&id);
    inner.peer_gone(id);
}

fn write_frame(w: &UnixStream, h: Header, data: &[u8], fds: &[RawFd]) -> bool {
    let mut bytes = h.encode().to_vec();
    bytes.extend_from_slice(data);
    send_with_fds(w, &bytes, fds).is_ok()
}

fn send_plain(peer: &ExpPeer, h: Header) -> bool {
    peer.writer.lock().unwrap().write_all(&h.encode()).is_ok()
}
