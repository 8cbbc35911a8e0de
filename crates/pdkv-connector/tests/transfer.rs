//! The connector pair driven through the `KvConnector` calls an engine
//! makes, on real registered KV regions and real sockets (TCP and shared
//! memory), plus garbage on the control socket.

use std::io::{Read, Write};
use std::net::TcpStream;
use std::sync::mpsc;
use std::sync::Arc;
use std::time::{Duration, Instant};

use pdkv_engine::connector::{ConnectorRequest, FinishedTransfers, KvCacheSpec};
use pdkv_engine::{FinishReason, KvConnector};
use pdkv_vmem::{Pool, PoolOptions, Region, Tag};
use serde_json::{json, Value};

const BLOCKS: usize = 32;
const BB: usize = 1024;
const WAIT: Duration = Duration::from_secs(10);

struct Side {
    c: Box<dyn KvConnector>,
    region: Arc<Region>,
    woke: mpsc::Receiver<()>,
    _pool: Pool,
}

fn side(role: &str, transport: &str, id: &str, extra: &str) -> Side {
    let cfg = format!(r#"{{"kv_connector":"pdkv","kv_role":"{role}","transport":"{transport}"{extra}}}"#);
    let mut c = pdkv_connector::build(&cfg, id).unwrap();
    let pool = Pool::new(PoolOptions { chunk_size: 8 << 10, single_allocation: false });
    let region = pool.allocate(Tag::KvCache, BLOCKS * BB).unwrap();
    let (tx, woke) = mpsc::channel();
    let tx = std::sync::Mutex::new(tx);
    c.set_waker(Arc::new(move || {
        let _ = tx.lock().unwrap().send(());
    }));
    let spec = KvCacheSpec { region: region.clone(), num_blocks: BLOCKS, block_bytes: BB, block_size: 16, layout: "test-layout".into() };
    c.register_kv_caches(&spec).unwrap();
    Side { c, region, woke, _pool: pool }
}

impl Side {
    /// Polls `get_finished` (after each wake) until `pred` holds.
    fn wait_finished(&mut self, mut pred: impl FnMut(&FinishedTransfers) -> bool) -> FinishedTransfers {
        let deadline = Instant::now() + WAIT;
        let mut all = FinishedTransfers::default();
        loop {
            let f = self.c.get_finished();
            all.sending.extend(f.sending);
            all.recving.extend(f.recving);
            if pred(&all) {
                return all;
            }
            let left = deadline.saturating_duration_since(Instant::now());
            assert!(!left.is_zero(), "timed out waiting; got {all:?}");
            let _ = self.woke.recv_timeout(left);
        }
    }

    fn block(&self, b: u32) -> Vec<u8> {
        let mut v = vec![0; BB];
        self.region.read_bytes(b as usize * BB, &mut v).unwrap();
        v
    }
}

fn pattern(block: u32) -> Vec<u8> {
    (0..BB).map(|i| (i as u32).wrapping_mul(31).wrapping_add(block * 7) as u8).collect()
}

fn req<'a>(id: &'a Arc<str>, prompt: &'a [u32], params: &'a Value) -> ConnectorRequest<'a> {
    ConnectorRequest { id, prompt_tokens: prompt, kv_transfer_params: Some(params) }
}

/// P computes a prompt of `len` tokens into blocks `p_blocks` and finishes.
fn prefill(p: &mut Side, rid: &str, tid: &str, len: usize, p_blocks: &[u32]) -> Value {
    for &b in p_blocks {
        p.region.write_bytes(b as usize * BB, &pattern(b)).unwrap();
    }
    let id: Arc<str> = Arc::from(rid);
    let prompt = vec![1u32; len];
    let params = json!({"do_remote_decode": true, "transfer_id": tid});
    assert_eq!(p.c.get_num_new_matched_tokens(req(&id, &prompt, &params), 0).num_tokens, 0);
    p.c.update_state_after_alloc(req(&id, &prompt, &params), p_blocks, 0, 0);
    let (held, out) = p.c.request_finished(req(&id, &prompt, &params), p_blocks, FinishReason::Length);
    assert!(held, "P holds the blocks for D");
    let out = out.unwrap();
    assert_eq!(out["do_remote_prefill"], true);
    assert_eq!(out["remote_num_tokens"], len);
    assert_eq!(out["transfer_id"], tid);
    out
}

/// D admits the request with `computed` local tokens and starts the load.
fn start_load(d: &mut Side, rid: &str, len: usize, computed: usize, d_blocks: &[u32], params: &Value) -> usize {
    let id: Arc<str> = Arc::from(rid);
    let prompt = vec![1u32; len];
    let m = d.c.get_num_new_matched_tokens(req(&id, &prompt, params), computed);
    assert!(m.load_async);
    assert_eq!(m.num_tokens, len - 1 - computed);
    d.c.update_state_after_alloc(req(&id, &prompt, params), d_blocks, computed, m.num_tokens);
    let meta = d.c.build_connector_meta();
    d.c.start_load_kv(meta);
    m.num_tokens
}

fn transfer(transport: &str) {
    let mut p = side("kv_producer", transport, "p1", "");
    let mut d = side("kv_consumer", transport, "d1", "");
    // 40-token prompt: 39 tokens to send = blocks 0..3 of the request; D
    // has the first block (16 tokens) locally.
    let p_blocks = [5, 9, 2, 30];
    let params = prefill(&mut p, "rp", "t1", 40, &p_blocks);
    assert_eq!(p.c.num_held_blocks(), 4);
    let d_blocks = [7, 3, 20, 11];
    start_load(&mut d, "rd", 40, 16, &d_blocks, &params);
    assert!(d.c.num_held_blocks() > 0);
    let f = d.wait_finished(|f| !f.recving.is_empty());
    assert_eq!(f.recving, vec![Arc::from("rd")]);
    assert_eq!(d.c.get_block_ids_with_load_errors(), vec![]);
    assert_eq!(d.block(3), pattern(9));
    assert_eq!(d.block(20), pattern(2));
    assert_eq!(d.block(7), vec![0; BB], "the locally cached block is not written");
    assert_eq!(d.block(11), vec![0; BB], "the block beyond the 39 tokens is not written");
    let f = p.wait_finished(|f| !f.sending.is_empty());
    assert_eq!(f.sending, vec![Arc::from("rp")]);
    assert_eq!((p.c.num_held_blocks(), d.c.num_held_blocks()), (0, 0));
    // D's request ends normally: nothing to delay.
    let id: Arc<str> = Arc::from("rd");
    let prompt = vec![1u32; 40];
    assert_eq!(d.c.request_finished(req(&id, &prompt, &params), &d_blocks, FinishReason::Length), (false, None));
}

#[test]
fn blocks_move_over_tcp() {
    transfer("tcp");
}

#[test]
fn blocks_move_over_shared_memory() {
    transfer("shm");
}

#[test]
fn load_failures_name_the_problem_and_other_loads_go_on() {
    let mut p = side("kv_producer", "tcp", "p1", r#","abort_timeout_s":2,"arrival_timeout_s":0.2"#);
    let mut d = side("kv_consumer", "tcp", "d1", "");
    let good = prefill(&mut p, "rp", "t1", 20, &[1, 2]);
    let boot = good["remote_bootstrap_addr"].clone();
    let mut wrong_engine = good.clone();
    wrong_engine["remote_engine_id"] = json!("p9");
    wrong_engine["transfer_id"] = json!("t2");
    let bogus = json!({"do_remote_prefill": true, "remote_engine_id": "p1", "remote_bootstrap_addr": boot, "transfer_id": "nope"});
    start_load(&mut d, "bad-engine", 20, 0, &[4, 5], &wrong_engine);
    start_load(&mut d, "bogus", 20, 0, &[6, 8], &bogus);
    start_load(&mut d, "len", 30, 0, &[10, 12], &good); // wrong prompt length, same transfer
    let f = d.wait_finished(|f| f.recving.len() == 3);
    let errs = d.c.get_block_ids_with_load_errors();
    let reason = |b: u32| errs.iter().find(|e| e.0 == b).map(|e| e.1.clone()).unwrap_or_else(|| panic!("block {b}: {errs:?}"));
    assert!(reason(4).contains("remote_engine_id mismatch") && reason(4).contains("p9"), "{}", reason(4));
    assert!(reason(6).contains("unknown to the prefill engine"), "{}", reason(6));
    assert!(reason(10).contains("prompt length mismatch") && reason(10).contains("29") && reason(10).contains("19"), "{}", reason(10));
    assert_eq!(errs.len(), 6);
    assert_eq!(f.recving.len(), 3);
    // The refused pull ended P's send; a good request afterwards goes through.
    p.wait_finished(|f| f.sending.len() == 1);
    let ok = prefill(&mut p, "rp2", "t3", 20, &[3, 4]);
    start_load(&mut d, "ok", 20, 0, &[14, 15], &ok);
    d.wait_finished(|f| f.recving.len() == 1);
    assert_eq!(d.c.get_block_ids_with_load_errors(), vec![]);
    assert_eq!(d.block(14), pattern(3));
    p.wait_finished(|f| f.sending.len() == 1);
    assert_eq!((p.c.num_held_blocks(), d.c.num_held_blocks()), (0, 0));
}

#[test]
fn an_aborted_prefill_fails_the_waiting_load_at_once() {
    let mut p = side("kv_producer", "tcp", "p1", "");
    let mut d = side("kv_consumer", "tcp", "d1", "");
    let boot = p.c.info()["bootstrap_addr"].clone();
    // P admits the request; D's pull arrives while it runs.
    let id: Arc<str> = Arc::from("rp");
    let prompt = vec![1u32; 40];
    let pp = json!({"do_remote_decode": true, "transfer_id": "t1"});
    p.c.get_num_new_matched_tokens(req(&id, &prompt, &pp), 0);
    let dp = json!({"do_remote_prefill": true, "remote_engine_id": "p1", "remote_bootstrap_addr": boot, "transfer_id": "t1"});
    start_load(&mut d, "rd", 40, 0, &[1, 2, 3], &dp);
    // Wait until D's pull is parked on P (P's pending-pulls gauge).
    let metrics = p.c.metrics_reader().expect("metrics");
    let pending = || metrics().into_iter().find(|m| m.0 == "pulls_pending").unwrap().2;
    let t0 = Instant::now();
    while pending() < 1.0 {
        assert!(t0.elapsed() < WAIT, "D's pull never reached P");
        std::thread::yield_now();
    }
    let t_abort = Instant::now();
    let (held, out) = p.c.request_finished(req(&id, &prompt, &pp), &[1, 2, 3], FinishReason::Abort);
    assert_eq!((held, out), (false, None));
    d.wait_finished(|f| f.recving.len() == 1);
    let took = t_abort.elapsed();
    assert!(took < Duration::from_secs(1), "D learned of the abort after {took:?}");
    let errs = d.c.get_block_ids_with_load_errors();
    assert_eq!(errs.len(), 3);
    assert!(errs[0].1.contains("aborted"), "{}", errs[0].1);
}

#[test]
fn a_decode_request_ended_mid_load_frees_only_after_p_answered() {
    let mut p = side("kv_producer", "tcp", "p1", "");
    let mut d = side("kv_consumer", "tcp", "d1", "");
    let boot = p.c.info()["bootstrap_addr"].clone();
    let id: Arc<str> = Arc::from("rp");
    let prompt = vec![1u32; 40];
    let pp = json!({"do_remote_decode": true, "transfer_id": "t1"});
    p.c.get_num_new_matched_tokens(req(&id, &prompt, &pp), 0);
    let dp = json!({"do_remote_prefill": true, "remote_engine_id": "p1", "remote_bootstrap_addr": boot, "transfer_id": "t1"});
    start_load(&mut d, "rd", 40, 0, &[1, 2, 3], &dp);
    let did: Arc<str> = Arc::from("rd");
    let (delay, params) = d.c.request_finished(req(&did, &prompt, &dp), &[1, 2, 3], FinishReason::Abort);
    assert_eq!((delay, params), (true, None), "D keeps the blocks until P answered");
    let f = d.wait_finished(|f| f.recving.len() == 1);
    assert_eq!(f.recving, vec![did.clone()]);
    assert_eq!(d.c.get_block_ids_with_load_errors(), vec![], "a finished request gets no load errors");
    assert_eq!(d.c.num_held_blocks(), 0);
    // P finishes afterwards: the transfer was released, nothing is held.
    let (held, _) = p.c.request_finished(req(&id, &prompt, &pp), &[1, 2, 3], FinishReason::Length);
    assert!(!held);
    assert_eq!(p.c.num_held_blocks(), 0);
}

#[test]
fn a_dead_producer_fails_the_load_by_the_deadline() {
    let mut d = side("kv_consumer", "tcp", "d1", r#","abort_timeout_s":0.3,"load_timeout_s":0.6"#);
    // An address nobody serves: bind then drop a listener.
    let addr = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().to_string();
    let dp = json!({"do_remote_prefill": true, "remote_engine_id": "p1", "remote_bootstrap_addr": addr, "transfer_id": "t1"});
    let t0 = Instant::now();
    start_load(&mut d, "rd", 40, 0, &[1, 2, 3], &dp);
    d.wait_finished(|f| f.recving.len() == 1);
    assert!(t0.elapsed() < Duration::from_secs(2));
    let errs = d.c.get_block_ids_with_load_errors();
    assert_eq!(errs.len(), 3);
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
        u32::MAX.to_be_bytes().to_vec(),                           // huge length prefix
        [&8u32.to_be_bytes()[..], b"{\"ty"].concat(),              // truncated body
        [&5u32.to_be_bytes()[..], b"hello"].concat(),              // not JSON
        [&17u32.to_be_bytes()[..], b"{\"type\":\"pull\"} "].concat(), // missing fields
        vec![0, 0],                                                // truncated prefix
    ];
    for bytes in inputs {
        let mut s = TcpStream::connect(&boot).unwrap();
        s.set_read_timeout(Some(WAIT)).unwrap();
        let _ = s.write_all(&bytes);
        let _ = s.shutdown(std::net::Shutdown::Write);
        // The server closes (possibly after an error answer); it never hangs.
        let mut rest = Vec::new();
        let _ = s.read_to_end(&mut rest);
        if rest.len() >= 4 {
            let n = u32::from_be_bytes(rest[..4].try_into().unwrap()) as usize;
            let m = pdkv_connector::wire::decode_body(&rest[4..4 + n]).unwrap();
            assert!(matches!(m, pdkv_connector::wire::Message::Error { .. }), "{m:?}");
        }
    }
    // The listener still serves a good bootstrap.
    let mut s = TcpStream::connect(&boot).unwrap();
    s.set_read_timeout(Some(WAIT)).unwrap();
    s.write_all(&pdkv_connector::wire::encode(&pdkv_connector::wire::Message::Bootstrap).unwrap()).unwrap();
    let mut n = [0u8; 4];
    s.read_exact(&mut n).unwrap();
    let mut body = vec![0; u32::from_be_bytes(n) as usize];
    s.read_exact(&mut body).unwrap();
    assert_eq!(
        pdkv_connector::wire::decode_body(&body).unwrap(),
        pdkv_connector::wire::Message::BootstrapOk { engine_id: "p1".into(), layout: "test-layout".into(), block_bytes: BB as u64 }
    );
}
