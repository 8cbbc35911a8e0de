//! P/D across tensor parallelism, on real engines: each rank of an engine
//! has its own KV cache region and its own registration, and a transfer
//! moves every rank's heads — P TP2 → D TP2 rank to rank, P TP2 → D TP1
//! gathered into D's one block, P TP1 → D TP2 split over D's ranks. D's
//! greedy tokens and logits bits equal a colocated single-rank engine's.
//! The lifecycle acts on every rank or none: a rank whose registration
//! release times out, or whose restore fails, leaves every rank as it was,
//! the error names the rank, and a retry succeeds.

use std::sync::Arc;
use std::time::Duration;

use crate::common::{
    assert_matches_colocated, colocated, config, consumer, engine_with, idle_and_free, metric, pd,
    producer, prompt, remote_prefill, run, Started, WAIT,
};
use pdkv_connector::config::KvTransferConfig;
use pdkv_connector::pd::{PdConnector, Shared};
use pdkv_engine::{EngineConfig, EngineHandle, PauseMode, SleepLevel};
use pdkv_transfer::auth::{self, KvSecret, Port};
use pdkv_transfer::frame::{Header, Limits, HEADER_LEN};
use pdkv_transfer::shm::recv_with_fds;
use pdkv_transfer::Registration;

/// An engine of `tp` ranks with a P/D connector from `json`; its
/// connector's shared core stays reachable (registrations, faults).
fn tp_engine(json: &str, id: &str, tp: usize, sleep: bool) -> (Started, Arc<Shared>) {
    let config = EngineConfig {
        tensor_parallel_size: tp,
        enable_sleep_mode: sleep,
        ..config()
    };
    tp_engine_with(json, id, config)
}

fn tp_engine_with(json: &str, id: &str, config: EngineConfig) -> (Started, Arc<Shared>) {
    let cfg = KvTransferConfig::parse(json).unwrap();
    let c = PdConnector::new(cfg, id).unwrap();
    let shared = c.shared().clone();
    (engine_with(Some(Box::new(c)), config), shared)
}

/// Every rank's current registration.
fn regs(s: &Shared) -> Vec<Registration> {
    s.inspect(|c| c.kv().expect("registered").regs())
}

/// Prompts with shared prefixes (D has local prefix hits for some) and
/// lengths that end inside a block, on a block edge and below one block.
fn prompts() -> Vec<Vec<u32>> {
    let mut prompts = crate::common::prefix_prompts();
    prompts.extend([prompt(5, 33), prompt(6, 64)]);
    prompts
}

/// Runs [`prompts`] through P (TP `p_tp`) and D (TP `d_tp`) over
/// `transport` in `mode`; every answer must equal the colocated engine's.
/// Returns the KV bytes P sent and D read.
fn pair_matches_colocated(p_tp: usize, d_tp: usize, transport: &str, mode: &str) -> (f64, f64) {
    let what = format!("P TP{p_tp} -> D TP{d_tp} over {transport} in {mode} mode");
    let t = format!(r#","transport":"{transport}","transfer_mode":"{mode}""#);
    // Engine ids name the shared-memory sockets: unique per pair, since the
    // tests of this file run at once in one process.
    let id = format!("{p_tp}{d_tp}-{transport}-{mode}");
    let (p, ps) = tp_engine(&producer(&t), &format!("p{id}"), p_tp, false);
    let (d, ds) = tp_engine(&consumer(&t), &format!("d{id}"), d_tp, false);
    for (s, tp) in [(&ps, p_tp), (&ds, d_tp)] {
        assert_eq!(regs(s).len(), tp, "{what}: a registration per rank");
    }
    let colo = colocated();
    let prompts = prompts();
    for (i, pr) in prompts.iter().enumerate() {
        let out = pd(&p.handle, &d.handle, &format!("x{i}"), pr, 6)
            .unwrap_or_else(|e| panic!("{what}: prompt {i}: {e}"));
        assert_matches_colocated(&colo.handle, &out, pr, 6, &format!("{what}: prompt {i}"));
    }
    idle_and_free(&p.handle);
    idle_and_free(&d.handle);
    // Every prompt longer than its local prefix hit was loaded, none failed.
    assert_eq!(
        metric(&d.handle, "loads_ok_total"),
        prompts.len() as f64,
        "{what}"
    );
    assert_eq!(metric(&d.handle, "loads_failed_total"), 0.0, "{what}");
    (
        metric(&p.handle, "bytes_sent_total"),
        metric(&d.handle, "bytes_read_total"),
    )
}

#[test]
fn every_split_of_p_and_d_over_tcp_decodes_as_a_colocated_engine() {
    let base = pair_matches_colocated(1, 1, "tcp", "write");
    assert!(base.0 > 0.0);
    for (p, d) in [(2, 2), (2, 1), (1, 2)] {
        let bytes = pair_matches_colocated(p, d, "tcp", "write");
        // Each rank moves its own heads: together, exactly the whole blocks.
        assert_eq!(bytes, base, "P TP{p} -> D TP{d}: bytes moved");
    }
}

#[test]
fn every_split_of_p_and_d_over_shared_memory_decodes_as_a_colocated_engine() {
    let base = pair_matches_colocated(1, 1, "shm", "write");
    for (p, d) in [(2, 2), (2, 1), (1, 2)] {
        assert_eq!(pair_matches_colocated(p, d, "shm", "write"), base);
    }
}

#[test]
fn every_split_of_p_and_d_in_read_mode_decodes_as_a_colocated_engine() {
    let base = pair_matches_colocated(1, 1, "tcp", "read");
    assert!(base.1 > 0.0);
    for (p, d) in [(2, 2), (2, 1), (1, 2)] {
        assert_eq!(pair_matches_colocated(p, d, "tcp", "read"), base);
    }
    for (p, d) in [(2, 2), (1, 2)] {
        pair_matches_colocated(p, d, "shm", "read");
    }
}

/// Both engines sleep (level 1) and wake `cycles` times; after every wake
/// D's answers equal the colocated engine's and no transfer failed.
#[test]
fn tp2_engines_keep_serving_fresh_kv_after_every_sleep_and_wake() {
    let (p, _) = tp_engine(&producer(""), "p-sleep", 2, true);
    let (d, _) = tp_engine(&consumer(""), "d-sleep", 2, true);
    let colo = colocated();
    for cycle in 0..4 {
        for (i, pr) in [prompt(100 + cycle, 40), prompt(200 + cycle, 21)]
            .iter()
            .enumerate()
        {
            let out = pd(&p.handle, &d.handle, &format!("c{cycle}-{i}"), pr, 4)
                .unwrap_or_else(|e| panic!("cycle {cycle}, prompt {i}: {e}"));
            assert_matches_colocated(&colo.handle, &out, pr, 4, &format!("cycle {cycle}"));
        }
        for e in [&p.handle, &d.handle] {
            e.sleep(SleepLevel::L1, PauseMode::Abort, WAIT)
                .expect("sleep");
            let asleep = e.pool().device_bytes();
            assert_eq!(
                asleep.total(),
                0,
                "cycle {cycle}: asleep, every rank frees all: {asleep:?}"
            );
            e.wake_up(None).expect("wake");
        }
    }
    assert_eq!(metric(&d.handle, "loads_failed_total"), 0.0);
    assert_eq!(metric(&p.handle, "pulls_failed_total"), 0.0);
    assert_eq!(metric(&d.handle, "loads_ok_total"), 8.0);
}

/// Over shared memory D's exporter waits for every peer that mapped a
/// segment to acknowledge its unmap before the release goes on. A peer
/// written by hand maps rank 1's segment and does not answer; returns its
/// socket and the memfds.
fn silent_peer(
    path: &str,
    reg: &Registration,
) -> (std::os::unix::net::UnixStream, Vec<std::os::fd::OwnedFd>) {
    let dl = Duration::from_secs(10);
    let mut raw = std::os::unix::net::UnixStream::connect(path).unwrap();
    raw.set_read_timeout(Some(dl)).unwrap();
    auth::connect_blocking(&mut raw, &KvSecret::open(), Port::Shm, dl).expect("handshake");
    let target = reg.whole();
    std::io::Write::write_all(&mut &raw, &Header::MapReq { op: 1, target }.encode()).unwrap();
    let mut fds = Vec::new();
    let frame = |fds: &mut Vec<std::os::fd::OwnedFd>| read_frame(&raw, fds).unwrap();
    assert!(
        matches!(frame(&mut fds), Header::MapResp { .. }),
        "the exporter answers a map with its head"
    );
    // The engine's pools map 2 MiB chunks; the parts carry one memfd each.
    let chunks = reg.len.div_ceil(2 << 20) as usize;
    while fds.len() < chunks {
        assert!(matches!(frame(&mut fds), Header::MapPart { .. }));
    }
    (raw, fds)
}

/// One frame on a hand-written peer's socket, collecting its memfds.
fn read_frame(
    raw: &std::os::unix::net::UnixStream,
    fds: &mut Vec<std::os::fd::OwnedFd>,
) -> std::io::Result<Header> {
    let mut h = [0u8; HEADER_LEN];
    recv_with_fds(raw, &mut h, fds)?;
    let header = Header::decode(&h, &Limits::default())
        .map_err(|e| std::io::Error::new(std::io::ErrorKind::InvalidData, e.to_string()))?;
    let mut data = vec![0; header.data_len()];
    recv_with_fds(raw, &mut data, fds)?;
    Ok(header)
}

fn transport_addr(e: &EngineHandle) -> String {
    e.kv_connector_info().unwrap()["transfer_addr"]
        .as_str()
        .unwrap()
        .to_string()
}

/// A TP2 producer `p_id` and a TP2 sleep-mode consumer `d_id` over shared
/// memory, the consumer's releases bounded by a second.
fn shm_fault_engines(p_id: &str, d_id: &str) -> (Started, Started, Arc<Shared>) {
    let t = r#","transport":"shm""#;
    let (p, _) = tp_engine(&producer(t), p_id, 2, true);
    let (d, ds) = tp_engine_with(
        &consumer(t),
        d_id,
        EngineConfig {
            tensor_parallel_size: 2,
            enable_sleep_mode: true,
            kv_release_timeout: Duration::from_secs(1),
            ..config()
        },
    );
    (p, d, ds)
}

/// `tag` goes P → D on `pr` for 4 tokens and matches the colocated engine.
fn check_pd(p: &Started, d: &Started, colo: &Started, tag: &str, pr: Vec<u32>) {
    let out = pd(&p.handle, &d.handle, tag, &pr, 4).unwrap_or_else(|e| panic!("{tag}: {e}"));
    assert_matches_colocated(&colo.handle, &out, &pr, 4, tag);
}

#[test]
fn a_rank_whose_release_times_out_or_whose_restore_fails_rolls_every_rank_back() {
    let (p, d, ds) = shm_fault_engines("p-fault", "d-fault");
    let colo = colocated();
    let check = |tag: &str| check_pd(&p, &d, &colo, tag, prompt(tag.len() as u64 * 31, 37));
    check("before");

    // Rank 1's release times out: a peer mapped its segment and is silent.
    let before = regs(&ds);
    assert_eq!(before.len(), 2);
    let (peer, fds) = silent_peer(&transport_addr(&d.handle), &before[1]);
    let e = d
        .handle
        .sleep(SleepLevel::L1, PauseMode::Abort, WAIT)
        .expect_err("a rank's release timed out")
        .to_string();
    assert!(e.contains("rank 1:"), "the error names the rank: {e}");
    assert!(
        e.contains("rank 0 had been released"),
        "and what was done: {e}"
    );
    // Every rank rolled back: registered again (a new epoch each), the
    // engine awake and serving, every rank's KV cache mapped.
    let after = regs(&ds);
    let live = ds.inspect(|c| c.registry().live());
    for (r, (a, b)) in after.iter().zip(&before).enumerate() {
        assert_eq!(a.segment, b.segment, "rank {r}: the same segment");
        assert!(a.epoch > b.epoch, "rank {r}: a new epoch");
        assert!(live.contains(a), "rank {r}: registered");
    }
    let st = d.handle.lifecycle_status();
    assert!(
        st.sleeping.is_none() && st.asleep_tags.is_empty() && st.paused.is_none(),
        "{st:?}"
    );
    assert!(!ds.inspect(|c| c.is_asleep()));
    check("after a failed release");

    // The peer answers now: it unmaps and acknowledges every unmap request
    // (the failed release's, then the retry's), and the retry sleeps every
    // rank. (Closing the socket instead would race the retry: the exporter
    // may ask the peer before it saw the close.)
    let acks = {
        let raw = peer.try_clone().unwrap();
        std::thread::spawn(move || {
            let mut fds = fds;
            let mut acked = 0;
            while let Ok(h) = read_frame(&raw, &mut fds) {
                if let Header::Unmap { op, segment } = h {
                    fds.clear();
                    let ack = Header::UnmapAck { op, segment }.encode();
                    if std::io::Write::write_all(&mut &raw, &ack).is_err() {
                        break;
                    }
                    acked += 1;
                }
            }
            acked
        })
    };
    d.handle
        .sleep(SleepLevel::L1, PauseMode::Abort, WAIT)
        .expect("the retry");
    peer.shutdown(std::net::Shutdown::Both).unwrap();
    assert!(acks.join().unwrap() >= 1, "the peer acknowledged the unmap");
    assert!(ds.inspect(|c| c.registry().live()).is_empty());
    assert_eq!(d.handle.pool().device_bytes().total(), 0);

    // Rank 1's restore fails: rank 0 registered first is released again,
    // the engine stays asleep.
    ds.inspect(|c| c.registry().fail_register_after(1));
    let e = d
        .handle
        .wake_up(None)
        .expect_err("a rank's restore failed")
        .to_string();
    assert!(
        e.contains("rank 1") && e.contains("rank 0 was deregistered again"),
        "{e}"
    );
    assert!(
        ds.inspect(|c| c.registry().live()).is_empty(),
        "no rank registered"
    );
    assert!(ds.inspect(|c| c.is_asleep()));
    let st = d.handle.lifecycle_status();
    assert!(st.asleep_tags.contains(&pdkv_vmem::Tag::KvCache), "{st:?}");
    assert_eq!(
        d.handle.pool().device_bytes().total(),
        0,
        "what the failed wake mapped went back to sleep on every rank"
    );
    d.handle.wake_up(None).expect("the retry");
    assert_eq!(ds.inspect(|c| c.registry().live()).len(), 2);
    check("after a failed restore");

    // A load started right now goes through both ranks as before.
    let params = remote_prefill(&p.handle, "last-p", &prompt(77, 50), "last");
    let out = run(&d.handle, "last-d", prompt(77, 50), 3, Some(params));
    assert_matches_colocated(&colo.handle, &out, &prompt(77, 50), 3, "last");
    assert_eq!(metric(&d.handle, "loads_failed_total"), 0.0);
}

#[test]
fn a_release_whose_rollback_fails_too_leaves_no_rank_half_registered() {
    let (p, d, ds) = shm_fault_engines("p-fault2", "d-fault2");
    let colo = colocated();
    let check = |tag: &str| check_pd(&p, &d, &colo, tag, prompt(tag.len() as u64 * 17, 41));
    check("before");

    // Rank 0's release times out (a silent peer maps it), and registering
    // every rank again then fails on rank 0: the connector gives up rank 1
    // too rather than leave it registered under the old epoch, and the
    // engine, which stays awake, registers every rank once more.
    let before = regs(&ds);
    let (peer, _fds) = silent_peer(&transport_addr(&d.handle), &before[0]);
    ds.inspect(|c| c.registry().fail_register_after(0));
    let e = d
        .handle
        .sleep(SleepLevel::L1, PauseMode::Abort, WAIT)
        .expect_err("a rank's release and its rollback failed")
        .to_string();
    assert!(e.contains("rank 0:"), "the error names the rank: {e}");
    assert!(
        e.contains("registering every rank again failed too")
            && e.contains("rank 1 was deregistered without waiting"),
        "and what the rollback did: {e}"
    );
    let after = regs(&ds);
    let live = ds.inspect(|c| c.registry().live());
    assert_eq!(live.len(), 2, "every rank registered again: {live:?}");
    for (r, (a, b)) in after.iter().zip(&before).enumerate() {
        assert!(a.epoch > b.epoch, "rank {r}: a new epoch");
        assert!(
            live.contains(a),
            "rank {r}: registered as the connector names"
        );
    }
    assert!(!ds.inspect(|c| c.is_asleep()));
    let st = d.handle.lifecycle_status();
    assert!(st.asleep_tags.is_empty() && st.paused.is_none(), "{st:?}");
    check("after a failed release and rollback");
    drop(peer);
    assert_eq!(metric(&d.handle, "loads_failed_total"), 0.0);
}
