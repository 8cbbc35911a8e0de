//! Shared memory between an exporter and importers over a Unix socket.

use std::sync::Arc;
use std::time::{Duration, Instant};

use pdkv_transfer::auth::{self, KvSecret, Port};
use pdkv_transfer::frame::{Header, Limits, Target, HEADER_LEN};
use pdkv_transfer::shm::{recv_with_fds, ShmError, ShmExporter, ShmImporter};
use pdkv_transfer::{AccessError, Registry, RegistryOptions};
use pdkv_vmem::{Pool, PoolOptions, Tag};

const DL: Duration = Duration::from_secs(10);
/// How long after its submission a batch's deadline passes in the
/// mid-batch deadline test: ample for a worker to start its first slice.
const MID_BATCH: Duration = Duration::from_secs(1);

fn sock_path(name: &str) -> std::path::PathBuf {
    let p = std::env::temp_dir().join(format!("pdkv-shm-{}-{name}.sock", std::process::id()));
    let _ = std::fs::remove_file(&p);
    p
}

/// A registry of eight segments whose keys come from `seed`.
fn seeded_registry(seed: u64) -> Registry {
    Registry::new(RegistryOptions {
        max_segments: 8,
        key_seed: Some(seed),
        ..Default::default()
    })
}

/// A pool of `chunk`-sized chunks and one region of `len` bytes in it.
fn pool_region(chunk: usize, len: usize) -> (Pool, Arc<pdkv_vmem::Region>) {
    let pool = Pool::new(PoolOptions {
        chunk_size: chunk,
        single_allocation: false,
    });
    let region = pool.allocate(Tag::KvCache, len).unwrap();
    (pool, region)
}

/// The whole of `reg` as a remote target, or `len` bytes of it from `off`.
fn target(reg: &Registration, off: u64, len: u64) -> Target {
    Target {
        segment: reg.segment,
        key: reg.key,
        epoch: reg.epoch,
        offset: off,
        len,
    }
}

/// One exporter at its own socket, sharing a 128 KiB region (64 KiB
/// chunks) registered whole.
struct Exported {
    _pool: Pool,
    _region: Arc<pdkv_vmem::Region>,
    registry: Arc<Registry>,
    reg: Registration,
    path: std::path::PathBuf,
    exp: ShmExporter,
}

fn exported(name: &str, seed: u64) -> Exported {
    let (pool, region) = pool_region(64 << 10, 128 << 10);
    let registry = Arc::new(seeded_registry(seed));
    let reg = registry.register(&region, 0, 128 << 10).unwrap();
    let path = sock_path(name);
    let exp = ShmExporter::bind(&path, registry.clone(), Limits::default()).unwrap();
    Exported {
        _pool: pool,
        _region: region,
        registry,
        reg,
        path,
        exp,
    }
}

/// A deregistration or fence that named the one silent peer once its
/// deadline (200 ms, started at `t0`) passed, and not much later.
fn assert_unmap_timeout(err: ShmError, segment: u64, t0: Instant) {
    let took = t0.elapsed();
    assert!(
        matches!(err, ShmError::UnmapTimeout { segment: s, ref peers } if s == segment && peers.len() == 1),
        "{err:?}"
    );
    assert!(
        took >= Duration::from_millis(200) && took < Duration::from_secs(2),
        "{took:?}"
    );
}

#[test]
fn an_importer_copies_directly_and_every_check_holds() {
    let (_pool, region) = pool_region(64 << 10, 512 << 10);
    let registry = Arc::new(seeded_registry(1));
    // A range starting mid-chunk: the importer must honour the skew.
    let off = (64 << 10) + 4096;
    let reg = registry.register(&region, off, 256 << 10).unwrap();
    let path = sock_path("copies");
    let exp = ShmExporter::bind(&path, registry.clone(), Limits::default()).unwrap();
    let imp = ShmImporter::connect(&path, Limits::default()).unwrap();

    let bad = pdkv_transfer::Registration {
        key: reg.key ^ 1,
        ..reg
    };
    assert!(matches!(
        imp.map(&bad, DL),
        Err(ShmError::Remote(e)) if e == AccessError::BadKey { segment: reg.segment }.into()
    ));
    let unknown = pdkv_transfer::Registration { segment: 77, ..reg };
    assert!(matches!(imp.map(&unknown, DL), Err(ShmError::Remote(_))));
    imp.map(&reg, DL).unwrap();

    let data: Vec<u8> = (0..100_000u32).map(|i| (i * 7) as u8).collect();
    imp.write(reg.segment, reg.epoch, 1000, &data).unwrap();
    let mut back = vec![0; data.len()];
    region.read_bytes(off + 1000, &mut back).unwrap();
    assert!(
        back == data,
        "the importer's write landed in the exporter's region"
    );
    region.write_bytes(off, &[5; 64]).unwrap();
    let mut small = [0; 64];
    imp.read(reg.segment, reg.epoch, 0, &mut small).unwrap();
    assert_eq!(small, [5; 64]);

    assert!(matches!(
        imp.read(reg.segment, reg.epoch, reg.len - 10, &mut small),
        Err(ShmError::Remote(e)) if matches!(e, pdkv_transfer::frame::RemoteError::Access(AccessError::OutOfBounds { .. }))
    ));
    assert!(matches!(
        imp.write(reg.segment, reg.epoch + 1, 0, &[1]),
        Err(ShmError::Remote(_))
    ));
    assert!(matches!(
        imp.read(reg.segment + 1, reg.epoch, 0, &mut small),
        Err(ShmError::NotMapped(_))
    ));
    region
        .read_bytes(off + reg.len as usize - 10, &mut small[..10])
        .unwrap();
    assert_eq!(exp.peers(), 1);

    // Deregistration asks the importer to unmap and waits for its ack.
    exp.deregister(reg.segment, DL).unwrap();
    assert_eq!(imp.unmapped(), 1);
    assert!(matches!(
        imp.read(reg.segment, reg.epoch, 0, &mut small),
        Err(ShmError::NotMapped(_))
    ));
    assert!(matches!(
        imp.map(&reg, DL),
        Err(ShmError::Remote(e)) if e == AccessError::NotRegistered { segment: reg.segment }.into()
    ));
    // Re-registered: a new epoch, mapped again.
    let again = registry.register(&region, off, 256 << 10).unwrap();
    imp.map(&again, DL).unwrap();
    imp.read(again.segment, again.epoch, 0, &mut small).unwrap();
    assert_eq!(small, [5; 64]);
    assert!(
        matches!(
            imp.read(again.segment, reg.epoch, 0, &mut small),
            Err(ShmError::Remote(_))
        ),
        "old epoch refused"
    );
}

/// Reads one frame on a hand-written peer's socket, collecting its memfds.
fn raw_frame(
    raw: &std::os::unix::net::UnixStream,
    fds: &mut Vec<std::os::fd::OwnedFd>,
) -> (Header, Vec<u8>) {
    let mut h = [0u8; HEADER_LEN];
    recv_with_fds(raw, &mut h, fds).unwrap();
    let header = Header::decode(&h, &Limits::default()).unwrap();
    let mut data = vec![0; header.data_len()];
    recv_with_fds(raw, &mut data, fds).unwrap();
    (header, data)
}

#[test]
fn a_peer_that_never_acks_bounds_the_deregistration_by_its_deadline() {
    let e = exported("noack", 2);
    let (registry, reg, path, exp) = (&e.registry, e.reg, &e.path, &e.exp);

    // A hand-written peer: asks for the memfds, keeps them, never answers.
    let raw = shaken(path);
    let target = target(&reg, 0, reg.len);
    std::io::Write::write_all(&mut &raw, &Header::MapReq { op: 1, target }.encode()).unwrap();
    let mut fds = Vec::new();
    let (header, _) = raw_frame(&raw, &mut fds);
    assert!(matches!(header, Header::MapResp { op: 1, .. }));
    assert!(fds.is_empty(), "the head carries no memfd");
    let (header, _) = raw_frame(&raw, &mut fds);
    assert!(matches!(header, Header::MapPart { op: 1, .. }));
    assert_eq!(fds.len(), 2, "one memfd per 64 KiB chunk");

    let t0 = Instant::now();
    let err = exp
        .deregister(reg.segment, Duration::from_millis(200))
        .unwrap_err();
    assert_unmap_timeout(err, reg.segment, t0);
    assert!(
        registry.get(reg.segment).is_none(),
        "no new access is granted either way"
    );
    drop(fds);
}

// ---- Batches: one-sided writes and reads on workers, with deadlines,
// cancellation and notifications after all data.

use pdkv_transfer::frame::RemoteError;
use pdkv_transfer::proto::{Direction, Transfer, TransferError};
use pdkv_transfer::shm::{ShmBatchHandle, ShmImporterConfig};
use pdkv_transfer::tcp::LocalSlice;
use pdkv_transfer::Registration;

/// An exporter with one registered region and an importer that mapped it,
/// plus a local registered region on the importer's side.
struct Pair {
    _pool: Pool,
    remote: Arc<pdkv_vmem::Region>,
    remote_reg: Registration,
    registry: Arc<Registry>,
    local: Arc<pdkv_vmem::Region>,
    local_reg: Registration,
    local_registry: Registry,
    exp: ShmExporter,
    imp: ShmImporter,
}

fn pair(name: &str, len: usize, cfg: ShmImporterConfig) -> Pair {
    let (pool, remote) = pool_region(1 << 20, len);
    let local = pool.allocate(Tag::KvCache, len).unwrap();
    let registry = Arc::new(seeded_registry(11));
    let remote_reg = registry.register(&remote, 0, len).unwrap();
    let local_registry = seeded_registry(12);
    let local_reg = local_registry.register(&local, 0, len).unwrap();
    let path = sock_path(name);
    let exp = ShmExporter::bind_with_queue(&path, registry.clone(), Limits::default(), 64).unwrap();
    let imp = ShmImporter::connect_with(&path, Limits::default(), cfg).unwrap();
    imp.map(&remote_reg, DL).unwrap();
    Pair {
        _pool: pool,
        remote,
        remote_reg,
        registry,
        local,
        local_reg,
        local_registry,
        exp,
        imp,
    }
}

impl Pair {
    fn slice(&self, off: u64, len: u64) -> LocalSlice {
        LocalSlice::grant(&self.local_registry, &self.local_reg, off, len).unwrap()
    }
    fn target(&self, reg: &Registration, off: u64, len: u64) -> Target {
        target(reg, off, len)
    }
    /// The same `len` bytes from `off` locally and in the mapped remote.
    fn transfer(&self, off: u64, len: u64) -> Transfer<LocalSlice> {
        Transfer {
            local: self.slice(off, len),
            remote: self.target(&self.remote_reg, off, len),
        }
    }
    fn write_one(
        &self,
        off: u64,
        len: u64,
        notify: Option<Vec<u8>>,
        deadline: Instant,
    ) -> ShmBatchHandle {
        self.imp
            .start(
                Direction::Write,
                vec![self.transfer(off, len)],
                notify,
                deadline,
            )
            .unwrap()
    }
}

/// A pair of `len` bytes whose one worker is held by a gate after its
/// first 4 KiB slice; the remote holds `pattern(len, seeds.0)` (old) and
/// the local `pattern(len, seeds.1)` (new).
fn gated_pair(name: &str, len: usize, seeds: (u8, u8)) -> (Pair, Gate, Vec<u8>, Vec<u8>) {
    let (cfg, gate) = gated(1, 4096);
    let p = pair(name, len, cfg);
    let (old, new) = (pattern(len, seeds.0), pattern(len, seeds.1));
    p.remote.write_bytes(0, &old).unwrap();
    p.local.write_bytes(0, &new).unwrap();
    (p, gate, old, new)
}

/// What a batch bound to an unmapped `segment` ends with.
fn unregistered(segment: u64) -> Result<(), TransferError> {
    Err(TransferError::Remote(
        AccessError::NotRegistered { segment }.into(),
    ))
}

fn pattern(len: usize, seed: u8) -> Vec<u8> {
    (0..len)
        .map(|i| (i as u8).wrapping_mul(31).wrapping_add(seed) ^ (i >> 12) as u8)
        .collect()
}

fn remote_bytes(p: &Pair, off: usize, len: usize) -> Vec<u8> {
    let mut b = vec![0; len];
    p.remote.read_bytes(off, &mut b).unwrap();
    b
}

fn local_bytes(p: &Pair, off: usize, len: usize) -> Vec<u8> {
    let mut b = vec![0; len];
    p.local.read_bytes(off, &mut b).unwrap();
    b
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_batches_land_and_notifications_follow_their_data() {
    const TASKS: usize = 8;
    const PER: usize = 3 * (64 << 10) + 1000; // several slices, not slice-aligned
    let cfg = ShmImporterConfig {
        workers: 2,
        max_slice: 64 << 10,
        ..Default::default()
    };
    let p = Arc::new(pair("batches", 4 << 20, cfg));
    for i in 0..TASKS {
        p.local
            .write_bytes(i * PER, &pattern(PER, i as u8))
            .unwrap();
    }
    // The exporter's side checks, as each notification arrives, that the
    // whole range of its batch already holds the batch's data.
    let checker = {
        let p = p.clone();
        std::thread::spawn(move || {
            let mut seen = Vec::new();
            while seen.len() < TASKS {
                let n = p
                    .exp
                    .recv_notification(DL)
                    .expect("a notification per batch");
                let i = n.payload[0] as usize;
                assert!(
                    remote_bytes(&p, i * PER, PER) == pattern(PER, i as u8),
                    "batch {i}: data landed before its notification"
                );
                seen.push(i);
            }
            seen.sort_unstable();
            seen
        })
    };
    let tasks: Vec<_> = (0..TASKS)
        .map(|i| {
            let p = p.clone();
            tokio::spawn(async move {
                // Two transfers per batch: the range in two unequal parts.
                let (off, cut) = ((i * PER) as u64, 70_000u64);
                let transfers = vec![
                    Transfer {
                        local: p.slice(off, cut),
                        remote: p.target(&p.remote_reg, off, cut),
                    },
                    Transfer {
                        local: p.slice(off + cut, PER as u64 - cut),
                        remote: p.target(&p.remote_reg, off + cut, PER as u64 - cut),
                    },
                ];
                p.imp
                    .write_batch(transfers, Some(vec![i as u8]), DL)
                    .await
                    .unwrap();
            })
        })
        .collect();
    for t in tasks {
        t.await.unwrap();
    }
    let seen = tokio::task::spawn_blocking(move || checker.join().unwrap())
        .await
        .unwrap();
    assert_eq!(seen, (0..TASKS).collect::<Vec<_>>());

    // Reads: fetch every range back into a cleared local region, concurrently.
    p.local.write_bytes(0, &vec![0; TASKS * PER]).unwrap();
    let reads: Vec<_> = (0..TASKS)
        .map(|i| {
            let p = p.clone();
            tokio::spawn(async move {
                let off = (i * PER) as u64;
                p.imp
                    .read_batch(vec![p.transfer(off, PER as u64)], DL)
                    .await
                    .unwrap();
            })
        })
        .collect();
    for t in reads {
        t.await.unwrap();
    }
    for i in 0..TASKS {
        assert!(
            local_bytes(&p, i * PER, PER) == pattern(PER, i as u8),
            "read {i} brought the remote bytes"
        );
    }
    let st = p.imp.stats();
    assert_eq!(
        (st.bytes_written, st.bytes_read),
        ((TASKS * PER) as u64, (TASKS * PER) as u64)
    );
    assert_eq!((st.batches_ok, st.failures), (2 * TASKS as u64, [0; 4]));
}

/// Holds a batch between its first and second slice: the worker reports
/// that it got there and waits for `release` (bounded), so a test acts
/// "mid-batch" deterministically, whatever the machine's speed.
struct Gate {
    reached: std::sync::mpsc::Receiver<()>,
    release: std::sync::mpsc::Sender<()>,
}

fn gated(workers: usize, max_slice: u64) -> (ShmImporterConfig, Gate) {
    use pdkv_transfer::shm::SliceHook;
    let (reached_tx, reached) = std::sync::mpsc::channel();
    let (release, release_rx) = std::sync::mpsc::channel::<()>();
    let release_rx = std::sync::Mutex::new(release_rx);
    let hook = SliceHook(Arc::new(move |done| {
        if done == 1 {
            reached_tx.send(()).unwrap();
            release_rx
                .lock()
                .unwrap()
                .recv_timeout(DL)
                .expect("the test releases the batch");
        }
    }));
    (
        ShmImporterConfig {
            workers,
            max_slice,
            before_slice: Some(hook),
            ..Default::default()
        },
        Gate { reached, release },
    )
}

impl Gate {
    /// Waits until the batch copied its first slice and stands before the next.
    fn wait_reached(&self) {
        self.reached
            .recv_timeout(DL)
            .expect("the batch reaches its second slice");
    }

    fn release(&self) {
        self.release.send(()).unwrap();
    }
}

/// The first `bytes` of the range hold `new`, the rest `old`: a batch that
/// stopped did so between slices, and nothing past its progress moved.
fn prefix_landed(p: &Pair, len: usize, new: &[u8], old: &[u8], bytes: usize) {
    let now = remote_bytes(p, 0, len);
    assert!(
        now[..bytes] == new[..bytes],
        "the slices copied hold the batch's data"
    );
    assert!(
        now[bytes..] == old[bytes..],
        "nothing past the stop was touched"
    );
}

/// A gated batch stopped after its first 4 KiB slice (`why` says how that
/// shows): that slice holds `new`, the rest `old`, and no notification
/// went out. Returns the importer's stats.
fn stopped_after_first_slice(
    p: &Pair,
    len: usize,
    new: &[u8],
    old: &[u8],
    why: &str,
) -> pdkv_transfer::proto::Stats {
    let st = p.imp.stats();
    assert_eq!(st.bytes_written, 4096, "{why}: {st:?}");
    prefix_landed(p, len, new, old, st.bytes_written as usize);
    assert_eq!(
        p.exp.recv_notification(Duration::from_millis(50)),
        None,
        "no notification for a batch that stopped"
    );
    st
}

#[test]
fn cancelling_mid_batch_stops_between_slices_and_sends_no_notification() {
    const LEN: usize = 64 << 20;
    let (p, gate, old, new) = gated_pair("cancel", LEN, (1, 2));
    let h = p.write_one(0, LEN as u64, Some(b"done".to_vec()), Instant::now() + DL);
    gate.wait_reached();
    h.cancel();
    gate.release();
    assert_eq!(h.wait_blocking(), Err(TransferError::Cancelled));
    let st = stopped_after_first_slice(&p, LEN, &new, &old, "exactly the first slice landed");
    assert_eq!(st.failures[TransferError::Cancelled.reason_index()], 1);
}

#[test]
fn a_deadline_in_the_past_or_expiring_mid_batch_fails_with_timeout() {
    const LEN: usize = 64 << 20;
    let (p, gate, old, new) = gated_pair("deadline", LEN, (3, 4));

    // Already past: nothing moves.
    let h = p.write_one(0, LEN as u64, Some(b"x".to_vec()), Instant::now());
    assert_eq!(h.wait_blocking(), Err(TransferError::Timeout));
    assert_eq!(p.imp.stats().bytes_written, 0);
    assert!(remote_bytes(&p, 0, LEN) == old, "memory untouched");

    // Expiring mid-batch: the batch is held after its first slice until
    // the deadline has passed, then must stop before the next slice. The
    // deadline must still be ahead when the worker starts the first slice:
    // a second, where 5 ms was once too short on a loaded machine (the
    // batch then failed before its first slice and never reached the gate).
    let deadline = Instant::now() + MID_BATCH;
    let h = p.write_one(0, LEN as u64, Some(b"x".to_vec()), deadline);
    gate.wait_reached();
    while Instant::now() < deadline {
        std::hint::spin_loop();
    }
    gate.release();
    assert_eq!(h.wait_blocking(), Err(TransferError::Timeout));
    let st = stopped_after_first_slice(
        &p,
        LEN,
        &new,
        &old,
        "only the slice before the deadline landed",
    );
    assert_eq!(st.failures[TransferError::Timeout.reason_index()], 2);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_refused_range_fails_the_batch_before_any_byte_moves() {
    const LEN: usize = 1 << 20;
    let p = pair("refused", LEN, ShmImporterConfig::default());
    let old = pattern(LEN, 5);
    p.remote.write_bytes(0, &old).unwrap();
    p.local.write_bytes(0, &pattern(LEN, 6)).unwrap();

    // Deregistered through the exporter, registered again: a new epoch.
    let stale = p.remote_reg;
    p.exp.deregister(stale.segment, DL).unwrap();
    let fresh = p.registry.register(&p.remote, 0, LEN).unwrap();
    assert_eq!(fresh.epoch, stale.epoch + 1);
    p.imp.map(&fresh, DL).unwrap();

    let good = |off: u64| Transfer {
        local: p.slice(off, 4096),
        remote: p.target(&fresh, off, 4096),
    };
    let cases: Vec<(Target, AccessError)> = vec![
        (
            p.target(&stale, 8192, 4096),
            AccessError::StaleEpoch {
                have: stale.epoch,
                want: fresh.epoch,
            },
        ),
        (
            Target {
                key: fresh.key ^ 1,
                ..p.target(&fresh, 8192, 4096)
            },
            AccessError::BadKey {
                segment: fresh.segment,
            },
        ),
        (
            p.target(&fresh, LEN as u64 - 100, 4096),
            AccessError::OutOfBounds {
                offset: LEN as u64 - 100,
                len: 4096,
                registered: LEN as u64,
            },
        ),
        (
            Target {
                segment: fresh.segment + 5,
                ..p.target(&fresh, 0, 4096)
            },
            AccessError::NotRegistered {
                segment: fresh.segment + 5,
            },
        ),
    ];
    for (bad, why) in cases {
        // A valid transfer first: it must not run either.
        let transfers = vec![
            good(0),
            Transfer {
                local: p.slice(LEN as u64 - 4096, 4096),
                remote: bad,
            },
        ];
        let err = p
            .imp
            .write_batch(transfers, Some(b"n".to_vec()), DL)
            .await
            .unwrap_err();
        assert!(
            matches!(err, pdkv_transfer::tcp::BatchError::Transfer(TransferError::Remote(RemoteError::Access(ref e))) if *e == why),
            "{err:?}"
        );
        assert!(
            remote_bytes(&p, 0, LEN) == old,
            "memory untouched after {why:?}"
        );
    }
    // Reads are checked the same way, and the local range stays as it was.
    let before = local_bytes(&p, 0, 4096);
    let t = Transfer {
        local: p.slice(0, 4096),
        remote: p.target(&stale, 0, 4096),
    };
    assert!(p.imp.read_batch(vec![t], DL).await.is_err());
    assert_eq!(before, local_bytes(&p, 0, 4096));
    assert_eq!(
        p.imp.stats().failures[TransferError::Remote(RemoteError::Busy).reason_index()],
        5
    );
    assert_eq!(p.exp.recv_notification(Duration::from_millis(50)), None);
    // The fresh epoch works.
    p.imp.write_batch(vec![good(0)], None, DL).await.unwrap();
    assert!(remote_bytes(&p, 0, 4096) == pattern(LEN, 6)[..4096]);
}

#[test]
fn deregistering_during_a_batch_ends_it_cleanly() {
    const LEN: usize = 64 << 20;
    let (p, gate, old, new) = gated_pair("dereg", LEN, (7, 8));
    let h = p.write_one(0, LEN as u64, Some(b"n".to_vec()), Instant::now() + DL);
    gate.wait_reached();
    let t0 = Instant::now();
    p.exp.deregister(p.remote_reg.segment, DL).unwrap();
    assert_eq!(
        p.imp.unmapped(),
        1,
        "the peer unmapped between two slices and acked"
    );
    gate.release();
    let res = h.wait_blocking();
    assert!(t0.elapsed() < DL);
    assert_eq!(res, unregistered(p.remote_reg.segment));
    stopped_after_first_slice(&p, LEN, &new, &old, "no slice after the unmap");
    assert!(p.registry.get(p.remote_reg.segment).is_none());
}

// ---- Map replies in batches: limits, and exporters that lie.

use pdkv_transfer::shm::{check_shareable, send_with_fds, BadMap};
use std::os::fd::RawFd;

#[test]
fn too_many_chunks_is_refused_with_its_own_reason_on_either_side() {
    let (_pool, region) = pool_region(4096, 200 * 4096);
    let registry = Arc::new(Registry::new(RegistryOptions {
        key_seed: Some(31),
        ..Default::default()
    }));
    let reg = registry.register(&region, 0, region.len()).unwrap();
    let small = Limits {
        max_map_chunks: 100,
        ..Limits::default()
    };
    let want = |e: &ShmError| {
        matches!(
            e,
            ShmError::TooManyChunks {
                chunks: 200,
                limit: 100
            }
        )
    };
    assert!(matches!(check_shareable(200, &small), Err(ref e) if want(e)));
    check_shareable(100, &small).unwrap();

    // The exporter's limit: refused before any memfd is sent.
    let path = sock_path("limit-exp");
    let exp = ShmExporter::bind(&path, registry.clone(), small).unwrap();
    assert!(matches!(exp.check_shareable(&reg), Err(ref e) if want(e)));
    let imp = ShmImporter::connect(&path, Limits::default()).unwrap();
    assert!(matches!(imp.map(&reg, DL), Err(ref e) if want(e)));
    assert_eq!(imp.mapped_epoch(reg.segment), None);
    drop((imp, exp));

    // The importer's limit, against an exporter that would send them all.
    let path = sock_path("limit-imp");
    let exp = ShmExporter::bind(&path, registry.clone(), Limits::default()).unwrap();
    exp.check_shareable(&reg).unwrap();
    let imp = ShmImporter::connect(&path, small).unwrap();
    assert!(matches!(imp.map(&reg, DL), Err(ref e) if want(e)));
    assert_eq!(imp.mapped_epoch(reg.segment), None);
    let roomy = ShmImporter::connect(&path, Limits::default()).unwrap();
    roomy.map(&reg, DL).unwrap();
    assert_eq!(roomy.mapped_epoch(reg.segment), Some(reg.epoch));
}

/// What a map call must fail with.
type Expect<'a> = &'a dyn Fn(&ShmError) -> bool;

/// What a hand-written exporter sends in answer to one map request.
enum Say {
    Head(Vec<u8>),
    Part(Vec<u8>, Vec<RawFd>),
    /// A part for the previous request (one the importer gave up on).
    StalePart(Vec<u8>, Vec<RawFd>),
    /// A header with a bad magic.
    Garbage,
}

fn words(w: &[u64]) -> Vec<u8> {
    w.iter().flat_map(|v| v.to_le_bytes()).collect()
}

/// An exporter that reads map requests and answers each with its script.
fn lying_exporter(path: &std::path::Path, script: Vec<Vec<Say>>) -> std::thread::JoinHandle<()> {
    let listener = std::os::unix::net::UnixListener::bind(path).unwrap();
    let path = path.to_path_buf();
    std::thread::spawn(move || {
        let (mut s, _) = listener.accept().unwrap();
        // One connection is all it serves: the socket's file goes now, so
        // the test leaves nothing in the temporary directory.
        drop(listener);
        std::fs::remove_file(&path).expect("the liar's socket file");
        auth::accept_blocking(&mut s, &KvSecret::open(), Port::Shm, DL)
            .expect("the importer's handshake");
        let mut last_op = 0;
        for answer in script {
            let mut fds = Vec::new();
            let (h, _) = raw_frame(&s, &mut fds);
            let Header::MapReq { op, .. } = h else {
                panic!("a map request, got {h:?}")
            };
            for say in answer {
                let frame = |h: Header, d: &[u8]| [&h.encode()[..], d].concat();
                let (bytes, fds) = match say {
                    Say::Head(d) => (
                        frame(
                            Header::MapResp {
                                op,
                                len: d.len() as u32,
                            },
                            &d,
                        ),
                        vec![],
                    ),
                    Say::Part(d, f) => (
                        frame(
                            Header::MapPart {
                                op,
                                len: d.len() as u32,
                            },
                            &d,
                        ),
                        f,
                    ),
                    Say::StalePart(d, f) => (
                        frame(
                            Header::MapPart {
                                op: last_op,
                                len: d.len() as u32,
                            },
                            &d,
                        ),
                        f,
                    ),
                    Say::Garbage => (vec![b'X'; HEADER_LEN], vec![]),
                };
                let _ = send_with_fds(&s, &bytes, &fds);
            }
            last_op = op;
        }
    })
}

#[test]
fn an_exporter_that_lies_in_its_map_reply_is_refused_with_the_reason_and_nothing_stays_mapped() {
    const C: u64 = 64 << 10;
    let (_pool, region) = pool_region(C as usize, 2 * C as usize);
    let chunks = region.chunks();
    let (f0, f1) = (chunks[0].chunk.raw_fd(), chunks[1].chunk.raw_fd());
    let reg = Registration {
        segment: 1,
        key: 2,
        epoch: 3,
        len: 100_000,
    };
    let head = words(&[4096, 100_000, 2, 2 * C]);
    let part = |first: u64, lens: &[u64]| words(&[&[first][..], lens].concat());
    use Say::*;
    let cases: Vec<(Vec<Say>, Expect)> = vec![
        (vec![Head(words(&[4096, 99_999, 2, 2 * C]))], &|e| {
            matches!(e, ShmError::BadMap(BadMap::Head))
        }),
        (vec![Part(part(0, &[C]), vec![f0])], &|e| {
            matches!(e, ShmError::BadMap(BadMap::NoHead))
        }),
        (vec![Head(head.clone()), Head(head.clone())], &|e| {
            matches!(e, ShmError::BadMap(BadMap::SecondHead))
        }),
        (
            vec![Head(head.clone()), Part(part(1, &[C]), vec![f1])],
            &|e| matches!(e, ShmError::BadMap(BadMap::OutOfOrder { want: 0, got: 1 })),
        ),
        (
            vec![Head(head.clone()), Part(part(0, &[C, C]), vec![f0])],
            &|e| matches!(e, ShmError::BadMap(BadMap::FdCount { lens: 2, fds: 1 })),
        ),
        (
            vec![
                Head(words(&[4096, 100_000, 1, 2 * C])),
                Part(part(0, &[C, C]), vec![f0, f1]),
            ],
            &|e| matches!(e, ShmError::BadMap(BadMap::PastEnd { chunks: 1, .. })),
        ),
        (
            vec![
                Head(words(&[4096, 100_000, 2, 3 * C])),
                Part(part(0, &[C, C]), vec![f0, f1]),
            ],
            &|e| matches!(e, ShmError::BadMap(BadMap::ShortTotal { want, got }) if *want == 3 * C && *got == 2 * C),
        ),
        (
            vec![Head(words(&[4096, 100_000, 1 << 40, 2 * C]))],
            &|e| matches!(e, ShmError::TooManyChunks { chunks, limit } if *chunks == 1 << 40 && *limit == Limits::default().max_map_chunks as u64),
        ),
        (
            vec![Head(words(&[0, 100_000, 1, 1 << 60]))],
            &|e| matches!(e, ShmError::Io(_)), // an address range that cannot be reserved
        ),
        (
            vec![
                Head(words(&[0, 100_000, 2, 100_000 + 4096])),
                Part(part(0, &[100_000, 4096]), vec![f0, f1]),
            ],
            &|e| matches!(e, ShmError::Io(ref io) if io.kind() == std::io::ErrorKind::InvalidInput), // not whole pages
        ),
        (
            vec![
                Head(words(&[0, 100_000, 1, 4 * C])),
                Part(part(0, &[4 * C]), vec![f0]),
            ],
            &|e| matches!(e, ShmError::Io(ref io) if io.kind() == std::io::ErrorKind::InvalidInput), // longer than the memfd
        ),
        // Half a reply, then silence: the call ends by its deadline.
        (
            vec![Head(head.clone()), Part(part(0, &[C]), vec![f0])],
            &|e| matches!(e, ShmError::Timeout),
        ),
    ];
    let n = cases.len();
    let (mut script, checks): (Vec<Vec<Say>>, Vec<_>) = cases.into_iter().unzip();
    // Then: the rest of the abandoned reply (ignored), a valid reply, and garbage.
    script.push(vec![
        StalePart(part(1, &[C]), vec![f1]),
        Head(head.clone()),
        Part(part(0, &[C]), vec![f0]),
        Part(part(1, &[C]), vec![f1]),
    ]);
    script.push(vec![Garbage]);
    let path = sock_path("liar");
    let liar = lying_exporter(&path, script);
    let imp = ShmImporter::connect(&path, Limits::default()).unwrap();
    for (i, check) in checks.iter().enumerate() {
        let timeout = if i == n - 1 {
            Duration::from_millis(200)
        } else {
            DL
        };
        let err = imp.map(&reg, timeout).unwrap_err();
        assert!(check(&err), "case {i}: {err:?}");
        assert_eq!(
            imp.mapped_epoch(reg.segment),
            None,
            "case {i}: nothing mapped"
        );
    }
    // The connection survived every lie: a true reply maps, and writes land.
    imp.map(&reg, DL).unwrap();
    assert_eq!(imp.mapped_epoch(reg.segment), Some(reg.epoch));
    imp.write(reg.segment, reg.epoch, 0, &[7; 100]).unwrap();
    let mut back = [0; 100];
    region.read_bytes(4096, &mut back).unwrap();
    assert_eq!(back, [7; 100], "the skew was honoured");
    // A malformed frame closes the connection: the call fails, never hangs.
    assert!(matches!(imp.map(&reg, DL), Err(ShmError::PeerLost)));
    liar.join().unwrap();
}

// ---- The fence: unmap everywhere, keep the registration.

#[test]
fn a_fence_stops_a_batch_in_flight_even_across_a_new_map_and_the_new_mapping_works() {
    const LEN: usize = 8 << 20;
    let (p, gate, old, new) = gated_pair("fence", LEN, (9, 10));
    let seg = p.remote_reg.segment;
    let h = p.write_one(0, LEN as u64, Some(b"late".to_vec()), Instant::now() + DL);
    gate.wait_reached();

    p.exp.fence(seg, DL).unwrap();
    assert_eq!(
        p.imp.unmapped(),
        1,
        "the peer unmapped between two slices and acked"
    );
    assert_eq!(
        p.imp.mapped_epoch(seg),
        None,
        "the caller can tell it must map again"
    );
    assert_eq!(
        p.registry.get(seg),
        Some(p.remote_reg),
        "the registration stays"
    );
    // The peer maps the segment again before the old batch's next slice.
    p.imp.map(&p.remote_reg, DL).unwrap();
    assert_eq!(p.imp.mapped_epoch(seg), Some(p.remote_reg.epoch));
    gate.release();
    assert_eq!(h.wait_blocking(), unregistered(seg));
    stopped_after_first_slice(
        &p,
        LEN,
        &new,
        &old,
        "the old batch never reached the new mapping",
    );

    // A batch on the new mapping lands (one slice: the gate is not involved).
    let at = 1 << 20;
    p.write_one(at, 4096, None, Instant::now() + DL)
        .wait_blocking()
        .unwrap();
    assert!(remote_bytes(&p, at as usize, 4096) == new[at as usize..at as usize + 4096]);
    // The exporter knows about the new mapping: deregistering asks again.
    p.exp.deregister(seg, DL).unwrap();
    assert_eq!(p.imp.unmapped(), 2);
}

#[test]
fn a_batch_queued_before_a_fence_never_runs_on_the_mapping_after_it() {
    const LEN: usize = 8 << 20;
    let (p, gate, old, new) = gated_pair("fence-queued", LEN, (13, 14));
    let seg = p.remote_reg.segment;
    // The only worker is held inside batch A; batch B waits in the queue.
    let a = p.write_one(0, 1 << 20, None, Instant::now() + DL);
    gate.wait_reached();
    let b_range = (4u64 << 20, 4096u64);
    let b = p.write_one(b_range.0, b_range.1, None, Instant::now() + DL);
    p.exp.fence(seg, DL).unwrap();
    p.imp.map(&p.remote_reg, DL).unwrap();
    gate.release();
    let gone = unregistered(seg);
    assert_eq!(a.wait_blocking(), gone);
    assert_eq!(
        b.wait_blocking(),
        gone,
        "started before the fence: bound to the mapping it unmapped"
    );
    prefix_landed(&p, LEN, &new, &old, 4096);
    // Started after the re-map: runs.
    p.write_one(b_range.0, b_range.1, None, Instant::now() + DL)
        .wait_blocking()
        .unwrap();
    let at = b_range.0 as usize;
    assert!(remote_bytes(&p, at, 4096) == new[at..at + 4096]);
}

#[test]
fn mapping_a_segment_again_retires_the_old_mapping_under_a_batch() {
    const LEN: usize = 8 << 20;
    let (p, gate, old, new) = gated_pair("remap", LEN, (11, 12));
    let h = p.write_one(0, LEN as u64, None, Instant::now() + DL);
    gate.wait_reached();
    p.imp.map(&p.remote_reg, DL).unwrap();
    gate.release();
    let seg = p.remote_reg.segment;
    assert_eq!(h.wait_blocking(), unregistered(seg));
    prefix_landed(&p, LEN, &new, &old, 4096);
    assert_eq!(
        p.imp.mapped_epoch(seg),
        Some(p.remote_reg.epoch),
        "the new mapping serves"
    );
    p.imp.write(seg, p.remote_reg.epoch, 0, &[1; 8]).unwrap();
}

/// A peer whose connection ends while its unmap is asked (it dropped its
/// importer, which unmaps first, or its process died) no longer maps the
/// segment: the deregistration completes without waiting out its deadline.
#[test]
fn a_peer_that_disconnects_while_asked_to_unmap_counts_as_unmapped() {
    let e = exported("gone", 43);
    let (reg, path, exp) = (e.reg, &e.path, &e.exp);
    let (raw, fds) = raw_mapper(path, &reg, 1);
    std::thread::scope(|s| {
        let peer = s.spawn(move || {
            let mut junk = Vec::new();
            let (header, _) = raw_frame(&raw, &mut junk);
            assert!(
                matches!(header, Header::Unmap { segment, .. } if segment == reg.segment),
                "{header:?}"
            );
            // Gone without an ack: its mappings and its socket close.
            drop(fds);
            drop(raw);
        });
        // A deadline far past the peer's end: only an ack or the end of
        // the peer's connection completes this in time.
        exp.deregister(reg.segment, Duration::from_secs(60))
            .expect("the peer's end counts as its unmap");
        peer.join().unwrap();
    });
}

/// An importer dropped while it maps a segment unmaps it before its
/// connection closes; a deregistration that follows finds no holder.
#[test]
fn a_dropped_importer_holds_no_mapping() {
    let e = exported("dropped", 44);
    let (reg, path, exp) = (e.reg, &e.path, &e.exp);
    let imp = ShmImporter::connect(path, Limits::default()).unwrap();
    imp.map(&reg, DL).unwrap();
    let other = ShmImporter::connect(path, Limits::default()).unwrap();
    other.map(&reg, DL).unwrap();
    drop(imp);
    exp.deregister(reg.segment, Duration::from_secs(60))
        .unwrap();
    assert_eq!(other.unmapped(), 1, "the live peer acked its unmap");
    assert_eq!(other.mapped_epoch(reg.segment), None);
}

#[test]
fn a_fence_with_no_holder_returns_at_once_and_a_silent_one_is_named_by_the_deadline() {
    let e = exported("fence-silent", 41);
    let (registry, reg, path, exp) = (&e.registry, e.reg, &e.path, &e.exp);
    exp.fence(reg.segment, Duration::ZERO).unwrap();

    let raw = raw_mapper(path, &reg, 1);
    let t0 = Instant::now();
    let err = exp
        .fence(reg.segment, Duration::from_millis(200))
        .unwrap_err();
    assert_unmap_timeout(err, reg.segment, t0);
    assert_eq!(
        registry.get(reg.segment),
        Some(reg),
        "a fence keeps the registration"
    );
    // Others still map it.
    let imp = ShmImporter::connect(path, Limits::default()).unwrap();
    imp.map(&reg, DL).unwrap();
    drop(raw);
}

/// A raw connection to the exporter at `path`, through the handshake (no
/// secret), ready for frames.
fn shaken(path: &std::path::Path) -> std::os::unix::net::UnixStream {
    let mut raw = std::os::unix::net::UnixStream::connect(path).unwrap();
    raw.set_read_timeout(Some(DL)).unwrap();
    auth::connect_blocking(&mut raw, &KvSecret::open(), Port::Shm, DL).expect("handshake");
    raw.set_read_timeout(None).unwrap();
    raw
}

/// A hand-written importer that mapped `reg` (and keeps the memfds).
fn raw_mapper(
    path: &std::path::Path,
    reg: &Registration,
    op: u64,
) -> (std::os::unix::net::UnixStream, Vec<std::os::fd::OwnedFd>) {
    let raw = shaken(path);
    raw.set_read_timeout(Some(DL)).unwrap();
    let mut fds = Vec::new();
    raw_map(&raw, reg, op, &mut fds);
    (raw, fds)
}

/// Sends a map request on `raw` and reads the whole reply.
fn raw_map(
    raw: &std::os::unix::net::UnixStream,
    reg: &Registration,
    op: u64,
    fds: &mut Vec<std::os::fd::OwnedFd>,
) {
    let target = target(reg, 0, reg.len);
    std::io::Write::write_all(&mut &*raw, &Header::MapReq { op, target }.encode()).unwrap();
    assert!(matches!(raw_frame(raw, fds).0, Header::MapResp { .. }));
    let n = registry_chunks(reg);
    let mut got = 0;
    while got < n {
        let before = fds.len();
        assert!(matches!(raw_frame(raw, fds).0, Header::MapPart { .. }));
        got += fds.len() - before;
    }
}

/// Chunks of the registrations these tests make: 64 KiB each.
fn registry_chunks(reg: &Registration) -> usize {
    (reg.len as usize).div_ceil(64 << 10)
}

#[test]
fn an_unmap_acked_after_a_new_map_went_out_leaves_that_map_known() {
    let e = exported("fence-gen", 42);
    let (reg, path) = (e.reg, &e.path);
    let exp = Arc::new(e.exp);
    let (raw, mut fds) = raw_mapper(path, &reg, 1);

    // The fence's unmap request reaches the peer; before acking it, the
    // peer maps the segment again, so that map's reply follows the request.
    let fence = {
        let exp = exp.clone();
        std::thread::spawn(move || exp.fence(reg.segment, DL))
    };
    let Header::Unmap {
        op: unmap_op,
        segment,
    } = raw_frame(&raw, &mut fds).0
    else {
        panic!("an unmap request")
    };
    assert_eq!(segment, reg.segment);
    raw_map(&raw, &reg, 2, &mut fds);
    std::io::Write::write_all(
        &mut &raw,
        &Header::UnmapAck {
            op: unmap_op,
            segment,
        }
        .encode(),
    )
    .unwrap();
    fence.join().unwrap().unwrap();

    // The ack answered the request, not the later map: deregistering must
    // still ask this peer (were it forgotten, this read would time out).
    let dereg = {
        let exp = exp.clone();
        std::thread::spawn(move || exp.deregister(reg.segment, DL))
    };
    let Header::Unmap { op, segment } = raw_frame(&raw, &mut fds).0 else {
        panic!("a second unmap request")
    };
    fds.clear();
    std::io::Write::write_all(&mut &raw, &Header::UnmapAck { op, segment }.encode()).unwrap();
    dereg.join().unwrap().unwrap();
}
