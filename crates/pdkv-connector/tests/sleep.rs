//! Sleep mode on the P/D connector, on real registered KV regions, real
//! sockets and real memory release: `release_kv_caches` deregisters when no
//! transfer is in flight (and refuses, changing nothing, when one is), the
//! region sleeps and wakes
//! (`Pool::discard` / `Pool::wake`), `restore_kv_caches` registers it again
//! at a new epoch, and `abort_transfers` ends what a cache reset must end.
//!
//! What "freed" means here: the pool's live memfd bytes for the KV tag
//! (`Pool::device_bytes`), chunks alive but no longer in any region
//! (`Pool::pinned_bytes`), and mappings of the old memfds anywhere in this
//! process (`/proc/self/maps`, by inode), which is where a shared-memory
//! peer's mapping would pin them.

// Its own binary (it reads its process's mappings and descriptors); the
// helpers of the connector tests.
#[path = "connector/common/mod.rs"]
mod common;

use std::net::TcpListener;
use std::os::unix::fs::MetadataExt;
use std::sync::Arc;
use std::time::{Duration, Instant};

use common::{
    d_params, decide_load, failed_load, finish, pattern, prefill, recv_msg, req, send_msg, side,
    start_loads, start_pull, transfer_ok, wait_parked, wait_until, Side, BB, BLOCKS,
    SIDE_WAIT as WAIT,
};
use pdkv_connector::send::{ASLEEP, CACHE_RESET};
use pdkv_connector::wire::{Destination, Message, Pull};
use pdkv_transfer::frame::Limits;
use pdkv_transfer::shm::ShmImporter;
use pdkv_transfer::tcp::{Agent, AgentConfig, LocalSlice};
use pdkv_transfer::{Registration, Registry, RegistryOptions, RemoteDescriptor};
use pdkv_vmem::{Pool, PoolOptions, Region, Tag};
use serde_json::{json, Value};

// ---- a stand-in prefill engine that records what D's pull names ----

/// A stand-in prefill engine's side of a control connection it accepted:
/// the handshake, then one message, read and returned; a bootstrap is
/// answered as the engine `engine_id`.
fn serve_one(s: &mut std::net::TcpStream, engine_id: &str) -> Message {
    s.set_read_timeout(Some(WAIT)).unwrap();
    common::accept_control(s);
    let m = recv_msg(s);
    if matches!(m, Message::Bootstrap) {
        send_msg(s, &common::bootstrap_ok(engine_id));
    }
    m
}

/// Has D load `rid` from a control server that answers the bootstrap, keeps
/// the pull (D's destination: segment, key, epoch, offsets) and refuses it.
fn capture_pull(d: &mut Side, rid: &str, d_blocks: &[u32]) -> Pull {
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = listener.local_addr().unwrap().to_string();
    let server = std::thread::spawn(move || loop {
        let (mut s, _) = listener.accept().unwrap();
        match serve_one(&mut s, "recorder") {
            Message::Bootstrap => {}
            Message::Pull(p) => {
                send_msg(
                    &mut s,
                    &Message::PullErr {
                        code: pdkv_connector::wire::FailCode::TransferFailed,
                        reason: "recorded".into(),
                    },
                );
                return p;
            }
            other => panic!("unexpected {other:?}"),
        }
    });
    let params = json!({"do_remote_prefill": true, "remote_engine_id": "recorder", "remote_bootstrap_addr": addr, "transfer_id": rid});
    decide_load(d, rid, 40, 0, d_blocks, &params);
    start_loads(d);
    let pull = server.join().unwrap();
    d.wait_finished(|f| f.recving.iter().any(|r| &**r == rid));
    let errs = common::load_errors(d);
    assert!(
        !errs.is_empty() && errs.iter().all(|e| e.1.contains("recorded")),
        "{errs:?}"
    );
    pull
}

/// Writes `bytes` into D's first destination block of `pull`, as P would,
/// addressing D's registration exactly as the pull names it (a fresh
/// initiator, so nothing cached helps or hides a stale descriptor).
fn write_as_pulled(pull: &Pull, bytes: &[u8]) -> Result<(), String> {
    let offset = pull.blocks[0] as u64 * BB as u64;
    match &pull.dst {
        Destination::Tcp { addr } => {
            let rt = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .unwrap();
            let pool = Pool::new(PoolOptions {
                chunk_size: 8 << 10,
                single_allocation: false,
            });
            let src = pool.allocate(Tag::KvCache, BB).unwrap();
            src.write_bytes(0, bytes).unwrap();
            let registry = Arc::new(Registry::new(RegistryOptions::default()));
            let reg = registry.register(&src, 0, BB).unwrap();
            rt.block_on(async {
                let agent = Agent::bind("127.0.0.1:0", registry.clone(), AgentConfig::default())
                    .await
                    .unwrap();
                let local = LocalSlice::grant(&registry, &reg, 0, BB as u64).unwrap();
                let remote = RemoteDescriptor {
                    agent_addr: addr.clone(),
                    segment: pull.ranks[0].rank.reg.segment,
                    key: pull.ranks[0].rank.reg.key,
                    epoch: pull.ranks[0].rank.reg.epoch,
                    offset,
                    len: BB as u64,
                };
                agent
                    .write(vec![(local, remote)], None, WAIT)
                    .await
                    .map_err(|e| e.to_string())
            })
        }
        Destination::Shm { path } => {
            let imp = ShmImporter::connect(std::path::Path::new(path), Limits::default())
                .map_err(|e| e.to_string())?;
            imp.map(&registration(pull), WAIT)
                .map_err(|e| e.to_string())?;
            imp.write(
                pull.ranks[0].rank.reg.segment,
                pull.ranks[0].rank.reg.epoch,
                offset,
                bytes,
            )
            .map_err(|e| e.to_string())
        }
    }
}

fn registration(pull: &Pull) -> Registration {
    Registration {
        segment: pull.ranks[0].rank.reg.segment,
        key: pull.ranks[0].rank.reg.key,
        epoch: pull.ranks[0].rank.reg.epoch,
        len: pull.ranks[0].rank.reg.len,
    }
}

/// Inodes of the memfds backing `region` now.
fn inodes(region: &Region) -> Vec<u64> {
    region
        .chunks()
        .iter()
        .map(|m| {
            std::fs::metadata(format!("/proc/self/fd/{}", m.chunk.raw_fd()))
                .unwrap()
                .ino()
        })
        .collect()
}

/// Mappings in this process of a memfd with one of `inos`.
fn mappings_of(inos: &[u64]) -> usize {
    std::fs::read_to_string("/proc/self/maps")
        .unwrap()
        .lines()
        .filter(|l| l.contains("memfd:"))
        .filter(|l| {
            l.split_whitespace()
                .nth(4)
                .and_then(|i| i.parse::<u64>().ok())
                .is_some_and(|i| inos.contains(&i))
        })
        .count()
}

/// A pair over TCP where P's request `p_rid` (transfer "t1", 40 tokens) still
/// runs and D's pull for it (`d_rid`, into D's blocks 7, 3, 20) is parked on
/// P.
fn parked(p_rid: &str, d_rid: &str) -> (Side, Side) {
    let mut p = side("kv_producer", "tcp", "p1", "");
    let mut d = side("kv_consumer", "tcp", "d1", "");
    start_pull(&mut p, &mut d, p_rid, "t1", d_rid, &[7, 3, 20]);
    wait_parked(&p);
    (p, d)
}

/// A stand-in prefill engine at a fresh address that answers the bootstrap,
/// hands D's pull to the test and never answers it, nor any drop: only D's
/// own fence can end D's load. Returns the address and the pulls it gets.
fn silent_prefill() -> (String, std::sync::mpsc::Receiver<Pull>) {
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = listener.local_addr().unwrap().to_string();
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let mut held = Vec::new();
        while let Ok((mut s, _)) = listener.accept() {
            match serve_one(&mut s, "silent") {
                Message::Bootstrap => {}
                Message::Pull(p) => {
                    held.push(s);
                    if tx.send(p).is_err() {
                        return;
                    }
                }
                Message::Drop { .. } => held.push(s),
                other => panic!("unexpected {other:?}"),
            }
        }
    });
    (addr, rx)
}

/// Writes `bytes` into D's first destination block of `pull` with the key
/// P would use over TCP (the pull's grant when it has one).
fn write_as_p_would(pull: &Pull, bytes: &[u8]) -> Result<(), String> {
    let mut with_grant = pull.clone();
    with_grant.ranks[0].rank.reg.key = pull.ranks[0].write_key();
    write_as_pulled(&with_grant, bytes)
}

// ---- release / restore ----

#[test]
fn release_and_restore_are_immediate_when_idle_and_idempotent() {
    let mut p = side("kv_producer", "tcp", "p1", "");
    let mut d = side("kv_consumer", "tcp", "d1", "");
    for s in [&p, &d] {
        assert!(s.c.supports_sleep_mode());
        assert_eq!(
            (s.c.info()["supports_sleep_mode"].as_bool(), s.epoch()),
            (Some(true), 1)
        );
    }
    for s in [&mut p, &mut d] {
        let t0 = Instant::now();
        s.c.release_kv_caches(Duration::from_secs(5)).unwrap();
        assert!(
            t0.elapsed() < Duration::from_millis(200),
            "idle release took {:?}",
            t0.elapsed()
        );
        s.c.release_kv_caches(Duration::from_secs(5)).unwrap();
        assert_eq!(s.c.info()["kv_released"], true);
        assert_eq!(s.gauge("kv_released"), 1.0);
        s.c.restore_kv_caches().unwrap();
        s.c.restore_kv_caches().unwrap();
        assert_eq!(
            (s.epoch(), s.gauge("kv_released")),
            (2, 0.0),
            "one new epoch per release/restore cycle"
        );
    }
    transfer_ok(&mut p, &mut d, "t1", [5, 9, 2], [7, 3, 20]);
}

#[test]
fn a_release_with_a_ready_send_refuses_and_changes_nothing() {
    let mut p = side("kv_producer", "tcp", "p1", "");
    let mut d = side("kv_consumer", "tcp", "d1", "");
    let params = prefill(&mut p, "rp", "t1", 40, &[5, 9, 2]);
    let t0 = Instant::now();
    let e = format!(
        "{:#}",
        p.c.release_kv_caches(Duration::from_secs(8)).unwrap_err()
    );
    assert!(
        t0.elapsed() < Duration::from_millis(200),
        "a busy release answers at once: {:?}",
        t0.elapsed()
    );
    assert!(
        e.contains("3 blocks held for decode engines") && e.contains("nothing was released"),
        "{e}"
    );
    assert_eq!(
        (p.epoch(), p.gauge("kv_released")),
        (1, 0.0),
        "the registration is as it was"
    );
    // D's pull is served from the same registration.
    decide_load(&mut d, "rd", 40, 0, &[7, 3, 20], &params);
    start_loads(&mut d);
    d.wait_finished(|f| f.recving.len() == 1);
    assert_eq!(common::load_errors(&mut d), Vec::<(u32, String)>::new());
    assert_eq!((d.block(3), d.block(20)), (pattern(9), pattern(2)));
    p.wait_finished(|f| f.sending == vec![Arc::from("rp")]);
    // Nothing in flight now: the retry releases.
    p.c.release_kv_caches(Duration::from_secs(8)).unwrap();
    assert_eq!(p.gauge("kv_released"), 1.0);
}

#[test]
fn a_release_after_the_transfers_ended_frees_the_pages_and_pulls_are_refused_at_once() {
    let mut p = side("kv_producer", "tcp", "p1", "");
    let mut d = side("kv_consumer", "tcp", "d1", "");
    let params = prefill(&mut p, "rp", "t1", 40, &[5, 9, 2]);
    // What the engine does first (release, then reset): the send ends and
    // P gives the blocks back.
    p.c.abort_transfers();
    p.wait_finished(|f| f.sending == vec![Arc::from("rp")]);
    assert_eq!(p.c.num_held_blocks(), 0);
    p.c.release_kv_caches(Duration::from_secs(1)).unwrap();
    // The registration is gone: the region's pages are freed when it sleeps.
    p.pool.discard(&[Tag::KvCache]).unwrap();
    assert_eq!((p.kv_device_bytes(), p.pool.pinned_bytes()), (0, 0));
    // A pull arriving while P is asleep is answered at once.
    let (errs, took) = failed_load(&mut d, "rd", &[7, 3, 20], &params);
    assert!(took < Duration::from_secs(1), "answered after {took:?}");
    assert!(
        errs[0].1.contains(CACHE_RESET) || errs[0].1.contains(ASLEEP),
        "{}",
        errs[0].1
    );
    // So is a pull for a transfer P has not seen (no waiting for its arrival).
    let (errs, took) = failed_load(&mut d, "rd9", &[8, 10, 12], &d_params(&p, "t9"));
    assert!(took < Duration::from_secs(1), "answered after {took:?}");
    assert!(errs[0].1.contains(ASLEEP), "{errs:?}");
    // Wake and restore: P serves again.
    p.pool.wake(&[Tag::KvCache]).unwrap();
    p.c.restore_kv_caches().unwrap();
    transfer_ok(&mut p, &mut d, "t2", [1, 4, 6], [8, 10, 12]);
}

#[test]
fn a_release_on_d_with_a_load_in_flight_refuses_and_the_load_completes() {
    let (mut p, mut d) = parked("rp", "rd");
    let e = format!(
        "{:#}",
        d.c.release_kv_caches(Duration::from_secs(8)).unwrap_err()
    );
    assert!(e.contains("1 loads writing into them"), "{e}");
    assert!(finish(&mut p, "rp", "t1", 40, &[5, 9, 2]));
    d.wait_finished(|f| f.recving.len() == 1);
    assert_eq!(common::load_errors(&mut d), Vec::<(u32, String)>::new());
    assert_eq!(
        (d.block(7), d.block(3)),
        (pattern(5), pattern(9)),
        "the load completed"
    );
    d.c.release_kv_caches(Duration::from_secs(8)).unwrap();
    // While D is asleep it starts no load.
    let params = prefill(&mut p, "rp2", "t2", 40, &[1, 4, 6]);
    let (errs, took) = failed_load(&mut d, "rd2", &[8, 10, 12], &params);
    assert!(took < Duration::from_millis(200), "answered after {took:?}");
    assert!(
        errs[0].1.contains("decode engine's KV cache is released"),
        "{}",
        errs[0].1
    );
}

/// The hole a fixed margin between D's and P's timeouts left open: D gives
/// a load up at its own deadline while P (here: silent, never answering
/// the pull nor D's drop) may still write. D tells the engine at once
/// (`abandoned`), but hands the blocks back only after its fence — the
/// pull's grant revoked — so a write that arrives late is refused and never
/// lands in blocks the engine may have reused.
#[test]
fn a_load_given_up_at_its_deadline_is_fenced_and_a_late_write_never_lands() {
    let mut d = side(
        "kv_consumer",
        "tcp",
        "d1",
        r#","abort_timeout_s":0.2,"load_timeout_s":0.5,"heartbeat_s":0.1"#,
    );
    let (addr, pulls) = silent_prefill();
    let params = json!({"do_remote_prefill": true, "remote_engine_id": "silent", "remote_bootstrap_addr": addr, "transfer_id": "t"});
    decide_load(&mut d, "rd", 40, 0, &[7, 3, 20], &params);
    start_loads(&mut d);
    let pull = pulls.recv_timeout(WAIT).expect("D's pull reaches P");
    assert!(
        pull.ranks[0]
            .grant_key
            .is_some_and(|k| k != pull.ranks[0].rank.reg.key),
        "the pull names a grant, not the registration's key"
    );
    // While D waits, P's write lands.
    write_as_p_would(&pull, &pattern(1)).unwrap();
    assert_eq!(d.block(7), pattern(1));
    // D's deadline passes: abandoned at once, then fenced.
    let f = d.wait_finished(|f| f.recving.iter().any(|r| &**r == "rd"));
    assert!(f.abandoned.iter().any(|r| &**r == "rd") || d.gauge("loads_abandoned_total") == 1.0);
    assert_eq!(d.gauge("loads_abandoned_total"), 1.0);
    // P's late write is refused: the grant is revoked.
    let e = write_as_p_would(&pull, &pattern(2)).unwrap_err();
    assert!(e.contains("key"), "{e}");
    assert_eq!(d.block(7), pattern(1), "no byte of the late write landed");
    assert_eq!(d.c.num_held_blocks(), 0);
}

/// Sleep and wake both engines around transfers: the KV memory is freed
/// while asleep, a transfer after the wake lands in the new pages, and D's
/// old registration is refused, never served.
fn sleep_cycle(transport: &str) {
    let mut p = side("kv_producer", transport, "p1", "");
    let mut d = side("kv_consumer", transport, "d1", "");
    transfer_ok(&mut p, &mut d, "t1", [5, 9, 2], [7, 3, 20]);
    let old = capture_pull(&mut d, "cap1", &[24, 25, 26]);
    assert_eq!(old.ranks[0].rank.reg.epoch, 1);
    let old_inodes = inodes(&d.region);
    assert!(mappings_of(&old_inodes) > 0);

    for s in [&mut p, &mut d] {
        s.c.release_kv_caches(Duration::from_secs(5)).unwrap();
        s.pool.discard(&[Tag::KvCache]).unwrap();
        assert_eq!(
            (s.kv_device_bytes(), s.pool.pinned_bytes()),
            (0, 0),
            "asleep: the KV pages are freed"
        );
    }
    assert_eq!(
        mappings_of(&old_inodes),
        0,
        "no mapping (P's included) keeps D's old pages"
    );
    let e = write_as_pulled(&old, &[0xEE; BB]).expect_err("D is asleep");
    assert!(e.contains("not registered"), "{e}");

    for s in [&mut p, &mut d] {
        s.pool.wake(&[Tag::KvCache]).unwrap();
        s.c.restore_kv_caches().unwrap();
        assert_eq!(s.epoch(), 2);
        assert!(s.kv_device_bytes() > 0);
    }
    // A write addressed to the old registration is refused; nothing lands.
    let e = write_as_pulled(&old, &[0xEE; BB]).expect_err("stale epoch");
    assert!(e.contains("stale epoch"), "{e}");
    assert_eq!(d.block(24), vec![0; BB]);
    // The same write addressed as D pulls now lands in the new pages.
    let new = capture_pull(&mut d, "cap2", &[24, 25, 26]);
    assert_eq!(
        (new.ranks[0].rank.reg.segment, new.ranks[0].rank.reg.epoch),
        (old.ranks[0].rank.reg.segment, 2),
        "same segment, next epoch"
    );
    assert_ne!(new.ranks[0].rank.reg.key, old.ranks[0].rank.reg.key);
    write_as_pulled(&new, &[0xEE; BB]).unwrap();
    assert_eq!(d.block(24), vec![0xEE; BB]);
    // P's first transfer after the wake succeeds without a retry, into the
    // new pages (fresh pages read zero, so the pattern proves the write).
    transfer_ok(&mut p, &mut d, "t2", [1, 4, 6], [8, 10, 12]);
    assert_eq!(p.gauge("pulls_failed_total"), 0.0);
}

#[test]
fn a_sleep_cycle_over_tcp_frees_the_kv_and_refuses_the_old_epoch() {
    sleep_cycle("tcp");
}

#[test]
fn a_sleep_cycle_over_shared_memory_frees_the_kv_and_refuses_the_old_epoch() {
    sleep_cycle("shm");
}

#[test]
fn without_a_release_the_registration_and_the_peer_mapping_pin_the_old_pages() {
    let mut p = side("kv_producer", "shm", "p1", "");
    let mut d = side("kv_consumer", "shm", "d1", "");
    transfer_ok(&mut p, &mut d, "t1", [5, 9, 2], [7, 3, 20]);
    let old_inodes = inodes(&d.region);
    // A peer mapped D's segment before the sleep (P did too, for t1).
    let pull = capture_pull(&mut d, "cap1", &[24, 25, 26]);
    let Destination::Shm { path } = &pull.dst else {
        panic!("{:?}", pull.dst)
    };
    let peer = ShmImporter::connect(std::path::Path::new(path), Limits::default()).unwrap();
    peer.map(&registration(&pull), WAIT).unwrap();

    // The seeds' bug: the region sleeps, its pages do not.
    d.pool.discard(&[Tag::KvCache]).unwrap();
    let region_bytes = (BLOCKS * BB) as u64;
    assert_eq!(
        d.kv_device_bytes(),
        region_bytes,
        "the registration pins every page"
    );
    assert_eq!(d.pool.pinned_bytes(), region_bytes);
    assert!(
        mappings_of(&old_inodes) >= 2,
        "the registration's and the peers' mappings"
    );
    peer.write(
        pull.ranks[0].rank.reg.segment,
        pull.ranks[0].rank.reg.epoch,
        pull.blocks[0] as u64 * BB as u64,
        &[1; BB],
    )
    .expect("the stale mapping still reaches the old pages");

    // Releasing now makes every peer unmap (acks awaited) and drops the pins.
    d.c.release_kv_caches(Duration::from_secs(5)).unwrap();
    assert_eq!(
        (
            d.kv_device_bytes(),
            d.pool.pinned_bytes(),
            mappings_of(&old_inodes)
        ),
        (0, 0, 0)
    );
    assert!(peer.unmapped() >= 1);
    let e = peer
        .write(
            pull.ranks[0].rank.reg.segment,
            pull.ranks[0].rank.reg.epoch,
            pull.blocks[0] as u64 * BB as u64,
            &[1; BB],
        )
        .expect_err("unmapped")
        .to_string();
    assert!(e.contains("not mapped"), "{e}");

    d.pool.wake(&[Tag::KvCache]).unwrap();
    d.c.restore_kv_caches().unwrap();
    transfer_ok(&mut p, &mut d, "t2", [1, 4, 6], [8, 10, 12]);
}

// ---- abort_transfers ----

/// A pair over TCP where "rp1" (transfer "t1") runs on P with D's pull for
/// it ("rd1") parked on it (see [`parked`]), and "t2" is READY on P (blocks
/// 5, 9, 2), not pulled; returns the pair and D's params for "t2".
fn parked_and_ready() -> (Side, Side, Value) {
    let (mut p, d) = parked("rp1", "rd1");
    let t2 = prefill(&mut p, "rp2", "t2", 40, &[5, 9, 2]);
    (p, d, t2)
}

#[test]
fn abort_on_p_answers_pulls_at_once_and_gives_the_blocks_back() {
    let (mut p, mut d, t2) = parked_and_ready();
    assert_eq!(p.c.num_held_blocks(), 3);

    let t0 = Instant::now();
    p.c.abort_transfers();
    p.c.abort_transfers();
    let f = p.wait_finished(|f| !f.sending.is_empty());
    assert_eq!(f.sending, vec![Arc::from("rp2")]);
    assert_eq!(p.c.num_held_blocks(), 0);
    d.wait_finished(|f| f.recving.len() == 1);
    let took = t0.elapsed();
    assert!(
        took < Duration::from_secs(1),
        "the parked pull was answered after {took:?}"
    );
    let errs = common::load_errors(&mut d);
    assert_eq!(errs.len(), 3);
    assert!(errs[0].1.contains(CACHE_RESET), "{}", errs[0].1);
    // Ended on purpose by P's lifecycle: released, not failed.
    assert_eq!(
        (
            p.gauge("pulls_released_total"),
            p.gauge("pulls_failed_total")
        ),
        (1.0, 0.0)
    );
    assert_eq!(
        (
            d.gauge("loads_released_total"),
            d.gauge("loads_failed_total")
        ),
        (1.0, 0.0)
    );
    // The running request ends without holding its blocks for D.
    assert!(!finish(&mut p, "rp1", "t1", 40, &[11, 12, 13]));
    // A pull for the released READY transfer learns why at once.
    let (errs, _) = failed_load(&mut d, "rd2", &[8, 10, 12], &t2);
    assert!(errs[0].1.contains(CACHE_RESET), "{errs:?}");
    // New transfers work normally.
    transfer_ok(&mut p, &mut d, "t3", [1, 4, 6], [14, 15, 16]);
}

#[test]
fn abort_on_d_ends_a_load_not_started_at_once_and_wakes_the_engine() {
    let mut p = side("kv_producer", "tcp", "p1", "");
    let mut d = side("kv_consumer", "tcp", "d1", "");
    let params = prefill(&mut p, "rp", "t1", 40, &[5, 9, 2]);
    decide_load(&mut d, "rd", 40, 0, &[7, 3, 20], &params);
    d.drain_wakes();
    d.c.abort_transfers();
    assert!(d.drain_wakes(), "the abort woke the engine");
    assert_eq!(d.c.get_finished().recving, vec![Arc::from("rd")]);
    assert_eq!(common::load_errors(&mut d).len(), 3);
    // The step's metadata no longer names the load.
    let meta = d.c.build_connector_meta();
    let loads = meta
        .0
        .downcast::<Vec<Arc<str>>>()
        .expect("the pdkv connector's metadata");
    assert!(loads.is_empty(), "{loads:?}");
    // P's READY send is untouched: a new load of it works.
    decide_load(&mut d, "rd2", 40, 0, &[8, 10, 12], &params);
    start_loads(&mut d);
    d.wait_finished(|f| f.recving.len() == 1);
    assert_eq!(common::load_errors(&mut d), Vec::<(u32, String)>::new());
    assert_eq!(d.block(8), pattern(5));
}

#[test]
fn abort_on_d_cuts_loads_short_after_p_answered() {
    let (mut p, mut d, t2) = parked_and_ready();
    // "rd1" is in flight; "rd2" is decided, not started.
    decide_load(&mut d, "rd2", 40, 0, &[8, 10, 12], &t2);
    assert_eq!(d.c.num_held_blocks(), 6);

    d.c.abort_transfers();
    d.c.abort_transfers();
    let f = d.wait_finished(|f| f.recving.len() == 2);
    let mut got: Vec<&str> = f.recving.iter().map(|r| &**r).collect();
    got.sort();
    assert_eq!(got, ["rd1", "rd2"]);
    assert_eq!(d.c.num_held_blocks(), 0);
    let mut errs = common::load_errors(&mut d);
    errs.sort();
    let want: Vec<(u32, String)> = [3, 7, 8, 10, 12, 20]
        .into_iter()
        .map(|b| (b, pdkv_connector::pd::CUT_SHORT.to_string()))
        .collect();
    assert_eq!(errs, want);
    // The meta built before the abort starts nothing now.
    let meta = d.c.build_connector_meta();
    d.c.start_load_kv(meta);
    // D's own fence ended rd1; its drop reaches P too, which answers the
    // parked pull as dropped; then P's request ends without holding blocks.
    wait_until("P learns of D's drop", || {
        p.gauge("pulls_cancelled_total") == 1.0
    });
    assert!(!finish(&mut p, "rp1", "t1", 40, &[11, 12, 13]));
    assert!(d.c.get_finished().is_empty());
    // The cut-short requests recompute locally: no external tokens again.
    let id: Arc<str> = Arc::from("rd1");
    let prompt = vec![1u32; 40];
    assert_eq!(
        d.c.get_num_new_matched_tokens(req(&id, &prompt, &d_params(&p, "t1")), 0)
            .num_tokens,
        0
    );
    // t2 is still READY on P (D never pulled it); a new load of it works.
    decide_load(&mut d, "rd3", 40, 0, &[14, 15, 16], &t2);
    start_loads(&mut d);
    d.wait_finished(|f| f.recving.len() == 1);
    assert_eq!(common::load_errors(&mut d), Vec::<(u32, String)>::new());
    assert_eq!(d.block(14), pattern(5));
}
