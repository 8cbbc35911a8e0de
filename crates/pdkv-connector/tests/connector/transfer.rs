//! The connector pair driven through the `KvConnector` calls an engine
//! makes, on real registered KV regions and real sockets (TCP and shared
//! memory), plus garbage on the control socket.

use std::io::{Read, Write};
use std::net::TcpStream;
use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::common::{
    admit, d_params, decide_load, decode_params, failed_load, finish_with, pattern, recv_msg, req,
    send_msg, side, side_with, start_loads, start_pull, transfer_ok, wait_parked, wait_until,
    Geometry, Side, BB, SIDE_WAIT as WAIT,
};
use pdkv_connector::wire::Message;
use pdkv_engine::connector::{Allocated, Ended};
use pdkv_engine::FinishReason;
use serde_json::{json, Value};

/// P computes a prompt of `len` tokens into blocks `p_blocks` and finishes;
/// returns the params its final output carries for D.
fn prefill_output(p: &mut Side, rid: &str, tid: &str, len: usize, p_blocks: &[u32]) -> Value {
    admit(p, rid, tid, len);
    let id: Arc<str> = Arc::from(rid);
    let prompt = vec![1u32; len];
    p.c.update_state_after_alloc(
        req(&id, &prompt, &decode_params(tid)),
        Allocated::new(p_blocks, 0, 0),
    );
    let (held, out) = finish_with(p, rid, tid, len, p_blocks, FinishReason::Length);
    assert!(held, "P holds the blocks for D");
    let out = out.expect("P's final output carries params for D");
    assert_eq!(out["do_remote_prefill"], true);
    assert_eq!(out["remote_num_tokens"], len);
    assert_eq!(out["transfer_id"], tid);
    out
}

/// P's blocks of the 40-token prompt "rp" and D's blocks for it ("rd").
const P_BLOCKS: [u32; 4] = [5, 9, 2, 30];
const D_BLOCKS: [u32; 4] = [7, 3, 20, 11];

/// D loads "rd" from P's `params`, its first `local` tokens cached locally:
/// the load ends without errors, and P's blocks 9 and 2 land in D's 3 and 20.
fn load_lands(d: &mut Side, params: &Value, local: usize) {
    decide_load(d, "rd", 40, local, &D_BLOCKS, params);
    start_loads(d);
    let f = d.wait_finished(|f| !f.recving.is_empty());
    assert_eq!(f.recving, vec![Arc::from("rd")]);
    assert_eq!(crate::common::load_errors(d), Vec::<(u32, String)>::new());
    assert_eq!(d.block(3), pattern(9));
    assert_eq!(d.block(20), pattern(2));
}

fn transfer(transport: &str) {
    let mut p = side("kv_producer", transport, "p1", "");
    let mut d = side("kv_consumer", transport, "d1", "");
    // 40-token prompt: 39 tokens to send = blocks 0..3 of the request; D
    // has the first block (16 tokens) locally.
    let params = prefill_output(&mut p, "rp", "t1", 40, &P_BLOCKS);
    assert_eq!(p.c.num_held_blocks(), 4);
    // (Whether D still holds the blocks here races with the transfer,
    // which may already be done on loopback: not asserted.)
    load_lands(&mut d, &params, 16);
    assert_eq!(
        d.block(7),
        vec![0; BB],
        "the locally cached block is not written"
    );
    assert_eq!(
        d.block(11),
        vec![0; BB],
        "the block beyond the 39 tokens is not written"
    );
    let f = p.wait_finished(|f| !f.sending.is_empty());
    assert_eq!(f.sending, vec![Arc::from("rp")]);
    assert_eq!((p.c.num_held_blocks(), d.c.num_held_blocks()), (0, 0));
    // D's request ends normally: nothing to delay.
    let id: Arc<str> = Arc::from("rd");
    let prompt = vec![1u32; 40];
    assert_eq!(
        d.c.request_finished(
            req(&id, &prompt, &params),
            Ended::new(&D_BLOCKS, FinishReason::Length)
        ),
        (false, None)
    );
}

#[test]
fn blocks_move_over_tcp() {
    transfer("tcp");
}

#[test]
fn blocks_move_over_shared_memory() {
    transfer("shm");
}

/// D's KV cache spans 768 memfds (3 MiB in 4 KiB chunks), three times
/// what one shared-memory message can carry (253): P maps it in parts and
/// writes blocks that lie in the first, a middle and the last part, before
/// and after a release and restore of D's registration (which P must map
/// again, in parts, under the new epoch). Catches a transport that refused
/// (or could not map) a registration of more than one message's memfds.
#[test]
fn a_kv_cache_of_more_memfds_than_one_message_carries_moves_over_shared_memory() {
    const D_BLOCKS: usize = 3072;
    let many = Geometry {
        blocks: D_BLOCKS,
        chunk_size: 4 << 10,
    };
    assert!(D_BLOCKS * BB / many.chunk_size > 3 * 253);
    // Engine ids of their own: a socket path is per engine id and process.
    let mut p = side("kv_producer", "shm", "p-many", "");
    let mut d = side_with("kv_consumer", "shm", "d-many", "", many)
        .expect("D registers a KV cache of 768 memfds");
    transfer_ok(
        &mut p,
        &mut d,
        "t1",
        [5, 9, 2],
        [3, 1500, D_BLOCKS as u32 - 1],
    );
    transfer_ok(&mut p, &mut d, "t2", [1, 4, 6], [1013, 7, 2040]);

    d.c.release_kv_caches(Duration::from_secs(5))
        .expect("P acknowledges the unmap of every part");
    d.pool.discard(&[pdkv_vmem::Tag::KvCache]).unwrap();
    assert_eq!(
        (d.kv_device_bytes(), d.pool.pinned_bytes()),
        (0, 0),
        "no mapping of P pins D's pages"
    );
    d.pool.wake(&[pdkv_vmem::Tag::KvCache]).unwrap();
    d.c.restore_kv_caches().unwrap();
    transfer_ok(&mut p, &mut d, "t3", [7, 8, 10], [2900, 260, 0]);
}

#[test]
fn load_failures_name_the_problem_and_other_loads_go_on() {
    let mut p = side(
        "kv_producer",
        "tcp",
        "p1",
        r#","abort_timeout_s":2,"arrival_timeout_s":0.2"#,
    );
    let mut d = side("kv_consumer", "tcp", "d1", "");
    let good = prefill_output(&mut p, "rp", "t1", 20, &[1, 2]);
    let mut wrong_engine = good.clone();
    wrong_engine["remote_engine_id"] = json!("p9");
    wrong_engine["transfer_id"] = json!("t2");
    let bogus = d_params(&p, "nope");
    decide_load(&mut d, "bad-engine", 20, 0, &[4, 5], &wrong_engine);
    start_loads(&mut d);
    decide_load(&mut d, "bogus", 20, 0, &[6, 8], &bogus);
    start_loads(&mut d);
    decide_load(&mut d, "len", 30, 0, &[10, 12], &good); // wrong prompt length, same transfer
    start_loads(&mut d);
    let f = d.wait_finished(|f| f.recving.len() == 3);
    let errs = crate::common::load_errors(&mut d);
    let reason = |b: u32| {
        errs.iter()
            .find(|e| e.0 == b)
            .map(|e| e.1.clone())
            .unwrap_or_else(|| panic!("block {b}: {errs:?}"))
    };
    assert!(
        reason(4).contains("remote_engine_id mismatch") && reason(4).contains("p9"),
        "{}",
        reason(4)
    );
    assert!(
        reason(6).contains("unknown to the prefill engine"),
        "{}",
        reason(6)
    );
    assert!(
        reason(10).contains("prompt length mismatch")
            && reason(10).contains("29")
            && reason(10).contains("19"),
        "{}",
        reason(10)
    );
    assert_eq!(errs.len(), 6);
    assert_eq!(f.recving.len(), 3);
    // The refused pull ended P's send; a good request afterwards goes through.
    p.wait_finished(|f| f.sending.len() == 1);
    let ok = prefill_output(&mut p, "rp2", "t3", 20, &[3, 4]);
    decide_load(&mut d, "ok", 20, 0, &[14, 15], &ok);
    start_loads(&mut d);
    d.wait_finished(|f| f.recving.len() == 1);
    assert_eq!(
        crate::common::load_errors(&mut d),
        Vec::<(u32, String)>::new()
    );
    assert_eq!(d.block(14), pattern(3));
    p.wait_finished(|f| f.sending.len() == 1);
    assert_eq!((p.c.num_held_blocks(), d.c.num_held_blocks()), (0, 0));
}

#[test]
fn an_aborted_prefill_ends_the_waiting_load_at_once_for_recompute() {
    let mut p = side("kv_producer", "tcp", "p1", "");
    let mut d = side("kv_consumer", "tcp", "d1", "");
    // P's request runs; D's pull is parked on it.
    start_pull(&mut p, &mut d, "rp", "t1", "rd", &[1, 2, 3]);
    wait_parked(&p);
    let t_abort = Instant::now();
    assert_eq!(
        finish_with(&mut p, "rp", "t1", 40, &[1, 2, 3], FinishReason::Abort),
        (false, None)
    );
    d.wait_finished(|f| f.recving.len() == 1);
    let took = t_abort.elapsed();
    assert!(
        took < Duration::from_secs(1),
        "D learned of the abort after {took:?}"
    );
    let errs = d.c.get_block_ids_with_load_errors();
    assert_eq!(errs.len(), 3);
    assert!(errs[0].1.message.contains("aborted"), "{:?}", errs[0].1);
    assert!(
        errs.iter().all(|(_, e)| e.recompute),
        "an abort on P is on purpose: D recomputes whatever its policy"
    );
}

#[test]
fn a_decode_request_ended_mid_load_frees_once_fenced_and_p_releases_the_transfer() {
    let mut p = side("kv_producer", "tcp", "p1", "");
    let mut d = side("kv_consumer", "tcp", "d1", "");
    // D's pull may or may not have reached P when D's request ends.
    let dp = start_pull(&mut p, &mut d, "rp", "t1", "rd", &[1, 2, 3]);
    let prompt = vec![1u32; 40];
    let did: Arc<str> = Arc::from("rd");
    let (delay, params) = d.c.request_finished(
        req(&did, &prompt, &dp),
        Ended::new(&[1, 2, 3], FinishReason::Abort),
    );
    assert_eq!(
        (delay, params),
        (true, None),
        "D keeps the blocks until the load is fenced"
    );
    let f = d.wait_finished(|f| f.recving.len() == 1);
    assert_eq!(f.recving, vec![did.clone()]);
    assert_eq!(
        crate::common::load_errors(&mut d),
        Vec::<(u32, String)>::new(),
        "a finished request gets no load errors"
    );
    assert_eq!(d.c.num_held_blocks(), 0);
    // D's drop reaches P (with or without a pull before it); P finishes
    // afterwards and holds nothing.
    wait_until("P learns of D's drop", || {
        p.gauge("drops_received_total") == 1.0
    });
    assert!(!finish_with(&mut p, "rp", "t1", 40, &[1, 2, 3], FinishReason::Length).0);
    assert_eq!(p.c.num_held_blocks(), 0);
}

#[test]
fn a_dead_producer_fails_the_load_by_the_deadline() {
    let mut d = side(
        "kv_consumer",
        "tcp",
        "d1",
        r#","abort_timeout_s":0.3,"load_timeout_s":0.6"#,
    );
    // An address nobody serves: bind then drop a listener.
    let addr = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .to_string();
    let dp = json!({"do_remote_prefill": true, "remote_engine_id": "p1", "remote_bootstrap_addr": addr, "transfer_id": "t1"});
    let (errs, took) = failed_load(&mut d, "rd", &[1, 2, 3], &dp);
    assert!(took < Duration::from_secs(2), "{took:?}");
    assert!(errs[0].1.contains(&addr), "{}", errs[0].1);
}

#[test]
fn garbage_on_the_control_socket_closes_that_connection_only() {
    let p = side("kv_producer", "tcp", "p1", "");
    let boot = p.c.info()["bootstrap_addr"].as_str().unwrap().to_string();
    let mut seed = 0x1234_5678_u64;
    let mut junk = |n: usize| -> Vec<u8> {
        (0..n)
            .map(|_| {
                seed ^= seed << 13;
                seed ^= seed >> 7;
                seed ^= seed << 17;
                seed as u8
            })
            .collect()
    };
    let inputs: Vec<Vec<u8>> = vec![
        junk(64),
        junk(4096),
        u32::MAX.to_be_bytes().to_vec(), // huge length prefix
        [&8u32.to_be_bytes()[..], b"{\"ty"].concat(), // truncated body
        [&5u32.to_be_bytes()[..], b"hello"].concat(), // not JSON
        [&17u32.to_be_bytes()[..], b"{\"type\":\"pull\"} "].concat(), // missing fields
        vec![0, 0],                      // truncated prefix
    ];
    for bytes in inputs {
        // Before the handshake: refused, with a denial at most.
        let mut s = TcpStream::connect(&boot).unwrap();
        s.set_read_timeout(Some(WAIT)).unwrap();
        let _ = s.write_all(&bytes);
        let _ = s.shutdown(std::net::Shutdown::Write);
        let mut rest = Vec::new();
        let _ = s.read_to_end(&mut rest);
        assert!(rest.is_empty() || rest.starts_with(b"PDKVDENY"), "{rest:?}");
        // After it: the server closes (possibly after an error answer); it
        // never hangs.
        let mut s = crate::common::control(&boot);
        s.set_read_timeout(Some(WAIT)).unwrap();
        let _ = s.write_all(&bytes);
        let _ = s.shutdown(std::net::Shutdown::Write);
        let mut rest = Vec::new();
        let _ = s.read_to_end(&mut rest);
        if rest.len() >= 4 {
            let n = u32::from_be_bytes(rest[..4].try_into().unwrap()) as usize;
            let m = pdkv_connector::wire::decode_body(&rest[4..4 + n]).unwrap();
            assert!(matches!(m, Message::Error { .. }), "{m:?}");
        }
    }
    // The listener still serves a good bootstrap.
    let mut s = crate::common::control(&boot);
    s.set_read_timeout(Some(WAIT)).unwrap();
    send_msg(&mut s, &Message::Bootstrap);
    assert_eq!(recv_msg(&mut s), crate::common::bootstrap_ok("p1"));
}

/// 300 clients that connect and idle on D's transfer port (past its cap of
/// 256) and 300 on P's control port, plus garbage on both: the real P and
/// D still move a prompt's KV, and the idle connections are closed within
/// `kv_unproven_timeout_s` (1 s here), well before the default 10 s.
#[test]
fn idle_connections_on_both_kv_ports_do_not_break_a_transfer() {
    let unproven = r#","kv_unproven_timeout_s":1"#;
    let mut p = side("kv_producer", "tcp", "p1", unproven);
    let mut d = side("kv_consumer", "tcp", "d1", unproven);
    let opened = Instant::now();
    let (p_info, d_info) = (p.c.info(), d.c.info());
    let control = p_info["bootstrap_addr"].as_str().unwrap().to_string();
    let transfer_port = d_info["transfer_addr"].as_str().unwrap().to_string();
    let mut idle = Vec::new();
    for addr in [&transfer_port, &control] {
        for _ in 0..300 {
            idle.push(TcpStream::connect(addr).unwrap());
        }
        let mut garbage = TcpStream::connect(addr).unwrap();
        garbage.write_all(&[0xab; 64]).unwrap();
        idle.push(garbage);
    }
    let params = prefill_output(&mut p, "rp", "t1", 40, &P_BLOCKS);
    load_lands(&mut d, &params, 0);
    // The servers close what never proved itself (the control port within
    // its I/O bound, the transfer port within its unproven timeout).
    let deadline = Instant::now() + Duration::from_secs(60);
    for (i, c) in idle.iter_mut().enumerate() {
        c.set_read_timeout(Some(
            deadline
                .saturating_duration_since(Instant::now())
                .max(Duration::from_millis(1)),
        ))
        .unwrap();
        // A garbage sender hears a denial of its "handshake" first.
        let mut buf = [0u8; 128];
        let closed = loop {
            match c.read(&mut buf) {
                Ok(0) => break true,
                Err(e) => {
                    break !matches!(
                        e.kind(),
                        std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
                    )
                }
                Ok(_) => {}
            }
        };
        assert!(closed, "idle connection {i} was not closed by the deadline");
    }
    // Closed by the 1 s setting, not by the default 10 s: the last close
    // came well before the default would have closed anything.
    let took = opened.elapsed();
    assert!(
        took < Duration::from_secs(9),
        "the idle connections took {took:?} to be closed"
    );
}
