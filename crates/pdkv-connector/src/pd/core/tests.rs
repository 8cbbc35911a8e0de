//! The core's unit tests: engine calls and driver events on a core with a
//! registered KV cache of real memory.

use super::*;
use std::sync::Arc;
use std::time::Instant;

use pdkv_engine::connector::{Allocated, ConnectorRequest, Ended, ExternalMatch, KvCacheSpec};
use pdkv_engine::FinishReason;
use pdkv_transfer::{Registration, Registry};

use crate::config::KvTransferConfig;
use crate::params;
use crate::ranks::RankReg;
use crate::wire::{Destination, FailCode, Failure, Message, Pull, PullRank};
use pdkv_transfer::RegistryOptions;
use pdkv_vmem::{Pool, PoolOptions, Tag};

const BS: usize = pdkv_model::BLOCK_SIZE;
const BLOCKS: usize = 8;

/// A core of `role` with a registered KV cache of real memory.
fn core(role: &str) -> (PdCore, Pool) {
    core_in(role, "write")
}

fn core_in(role: &str, mode: &str) -> (PdCore, Pool) {
    let cfg = KvTransferConfig::parse(&format!(
        r#"{{"kv_connector":"pdkv","kv_role":"{role}","transfer_mode":"{mode}"}}"#
    ))
    .unwrap();
    let pool = Pool::new(PoolOptions {
        chunk_size: 4096,
        single_allocation: false,
    });
    let region = pool.allocate(Tag::KvCache, BLOCKS * 4096).unwrap();
    let registry = Arc::new(Registry::new(RegistryOptions::default()));
    let dest = Destination::Tcp {
        addr: "127.0.0.1:10".into(),
    };
    let mut c = PdCore::new(cfg, "e0", "127.0.0.1:9".into(), dest, registry);
    let spec = KvCacheSpec::single(region, BLOCKS, 4096, BS, "l");
    c.register_kv_caches(&spec).unwrap();
    (c, pool)
}

/// An engine's request `id` of `toks` with `params`, unsalted.
fn creq<'a>(
    id: &'a Arc<str>,
    toks: &'a [u32],
    params: &'a pdkv_engine::connector::KvTransferParams,
) -> ConnectorRequest<'a> {
    ConnectorRequest {
        cache_salt: None,
        id,
        prompt_tokens: toks,
        kv_transfer_params: Some(params),
    }
}

/// D's params to load transfer `tid` from the producer "p0".
fn from_p0(tid: &str) -> pdkv_engine::connector::KvTransferParams {
    params::for_decode(tid, Some("p0"), Some("127.0.0.1:20"))
}

fn prompt() -> Vec<u32> {
    (0..3 * BS as u32 + 1).collect()
}

/// D decides and starts the load of request "r1" (transfer "t1", the
/// whole prompt's KV into blocks 1, 2, 3); returns the request id.
fn start_load(c: &mut PdCore, now: Instant) -> Arc<str> {
    let id: Arc<str> = Arc::from("r1");
    let toks = prompt();
    let params = from_p0("t1");
    let req = || creq(&id, &toks, &params);
    c.get_num_new_matched_tokens(now, req(), 0);
    c.update_state_after_alloc(req(), Allocated::new(&[1, 2, 3], 0, 3 * BS));
    let loads = c.take_new_loads();
    c.start_load_kv(now, loads);
    id
}

#[test]
fn d_loads_only_the_blocks_past_its_local_prefix_and_a_release_waits_for_the_load() {
    let t0 = Instant::now();
    let (mut c, _pool) = core("kv_both");
    let id: Arc<str> = Arc::from("r1");
    let toks = prompt();
    let params = from_p0("t1");
    let req = || creq(&id, &toks, &params);
    // One block is in D's prefix cache: P's KV of the other two comes.
    let m = c.get_num_new_matched_tokens(t0, req(), BS);
    assert_eq!(
        m,
        ExternalMatch {
            num_tokens: 2 * BS,
            load_async: true
        }
    );
    c.update_state_after_alloc(req(), Allocated::new(&[4, 5, 6, 7], BS, 2 * BS));
    assert_eq!(c.take_new_loads(), vec![id.clone()]);
    let load = c.recv_machine().load_of("r1").expect("decided");
    let spec = c.recv_machine().spec(load).unwrap();
    assert_eq!((spec.first_block, &spec.dst_blocks[..]), (1, &[5, 6][..]));
    assert_eq!(c.num_held_blocks(), 2);
    // Asked again in a later step: decided already.
    assert_eq!(
        c.get_num_new_matched_tokens(t0, req(), BS),
        ExternalMatch::default()
    );
    // A started load may write into the blocks: no release meanwhile.
    c.start_load_kv(t0, vec![id.clone()]);
    let busy = c.begin_release(t0).unwrap_err();
    assert_eq!(
        busy,
        InFlight {
            ready_blocks: 0,
            writes: 0,
            loads: 1
        }
    );
    assert!(!busy.is_idle());
    assert!(
        busy.to_string().contains("1 loads writing into them"),
        "{busy}"
    );
    assert!(!c.is_asleep());
    // Cut short before its pull left: nothing can write, it ends at once.
    c.abort_transfers(t0);
    assert_eq!(c.in_flight(), InFlight::default());
    assert!(c.begin_release(t0).unwrap().is_some());
}

#[test]
fn a_release_marks_the_core_asleep_until_it_is_restored() {
    let t0 = Instant::now();
    let (mut c, _pool) = core("kv_both");
    assert!(c.in_flight().is_idle() && !c.is_asleep());
    let reg = c.begin_release(t0).unwrap().expect("registered");
    assert_eq!(reg, c.kv().unwrap().regs());
    assert!(c.is_asleep());
    assert_eq!(c.begin_release(t0).unwrap(), None, "released already");
    // A load started while asleep ends at once: nothing may write.
    let id = start_load(&mut c, t0);
    let f = c.get_finished();
    assert_eq!(f.recving, vec![id.clone()]);
    c.restore().unwrap();
    assert!(!c.is_asleep());
    assert_ne!(c.kv().unwrap().generation(), reg[0].epoch, "a new epoch");
}

fn drops_unpulled(c: &mut PdCore) -> Vec<String> {
    std::iter::from_fn(|| c.poll_io())
        .filter_map(|io| match io {
            Io::Send(SendIo {
                op: Op::DropUnpulled { transfer_id },
                ..
            }) => Some(transfer_id),
            _ => None,
        })
        .collect()
}

#[test]
fn a_request_that_ends_before_its_load_is_decided_or_started_tells_p_and_holds_nothing() {
    let t0 = Instant::now();
    let toks = prompt();
    let (mut d, _pool) = core("kv_consumer");
    let (r1, r2, r3): (Arc<str>, Arc<str>, Arc<str>) =
        (Arc::from("r1"), Arc::from("r2"), Arc::from("r3"));
    let pa = from_p0("t1");
    let pb = from_p0("t2");
    let pc = from_p0("t3");
    let req = |id, params| creq(id, &toks, params);
    // r1 ends before D decided its load: P is told to drop t1 now.
    d.get_num_new_matched_tokens(t0, req(&r1, &pa), 0);
    assert_eq!(
        d.request_finished(t0, req(&r1, &pa), Ended::new(&[], FinishReason::Abort)),
        (false, None)
    );
    assert_eq!(drops_unpulled(&mut d), vec!["t1".to_string()]);
    // r2 and r3 decided; r2 ends before the step started its load.
    for (id, params, blocks) in [(&r2, &pb, [1, 2, 3]), (&r3, &pc, [4, 5, 6])] {
        d.get_num_new_matched_tokens(t0, req(id, params), 0);
        d.update_state_after_alloc(req(id, params), Allocated::new(&blocks, 0, 3 * BS));
    }
    let (freed, _) = d.request_finished(
        t0,
        req(&r2, &pb),
        Ended::new(&[1, 2, 3], FinishReason::Abort),
    );
    assert!(!freed, "a load never started holds nothing");
    assert_eq!(d.take_new_loads(), vec![r3.clone()]);
    assert_eq!(drops_unpulled(&mut d), vec!["t2".to_string()]);
    assert_eq!(d.recv_machine().load_of("r2"), None);
    // A producer's request with decode params is not D's: nothing to drop.
    let (mut p, _pool2) = core("kv_producer");
    p.get_num_new_matched_tokens(t0, req(&r1, &pa), 0);
    assert_eq!(
        p.request_finished(t0, req(&r1, &pa), Ended::new(&[], FinishReason::Abort)),
        (false, None)
    );
    assert_eq!(drops_unpulled(&mut p), Vec::<String>::new());
    // A consumer's request with prefill params holds nothing for D.
    let pp = params::for_prefill("t9");
    assert_eq!(
        d.request_finished(t0, req(&r1, &pp), Ended::new(&[7, 8], FinishReason::Stop)),
        (false, None)
    );
    assert_eq!(d.send_machine().phase("t9"), None);
}

#[test]
fn read_mode_p_returns_the_leased_blocks_and_its_generation_or_no_params() {
    let t0 = Instant::now();
    let (mut p, _pool) = core_in("kv_producer", "read");
    let epoch = p.kv().unwrap().generation();
    let finish = |p: &mut PdCore, tid: &str, toks: &[u32], blocks: &[u32], reason| {
        let id: Arc<str> = Arc::from(format!("r-{tid}"));
        let params = params::for_prefill(tid);
        let req = || creq(&id, toks, &params);
        p.request_added(t0, req());
        p.request_finished(t0, req(), Ended::new(blocks, reason))
    };
    let toks = prompt(); // 3 blocks of KV
    let (held, out) = finish(&mut p, "t1", &toks, &[4, 5, 6], FinishReason::Stop);
    let out = out.expect("params for D");
    assert!(held);
    assert_eq!(out[params::REMOTE_BLOCK_IDS], serde_json::json!([4, 5, 6]));
    assert_eq!(
        out[params::REMOTE_REGISTRATION_GENERATION],
        serde_json::json!(epoch)
    );
    assert_eq!(out[params::TRANSFER_ID], serde_json::json!("t1"));
    // Fewer blocks than the KV needs: nothing to lease, D computes.
    assert_eq!(
        finish(&mut p, "t2", &toks, &[7, 8], FinishReason::Length).1,
        None
    );
    // An aborted prefill holds nothing for D.
    assert_eq!(
        finish(&mut p, "t3", &toks, &[1, 2, 3], FinishReason::Abort).1,
        None
    );
    // A one-token prompt has no KV to read: params without blocks.
    let (_, out) = finish(&mut p, "t4", &[7], &[], FinishReason::Stop);
    assert_eq!(
        out.expect("params")[params::REMOTE_BLOCK_IDS],
        serde_json::json!([])
    );
}

fn replies(c: &mut PdCore) -> Vec<Message> {
    std::iter::from_fn(|| c.poll_io())
        .filter_map(|io| match io {
            Io::Reply { msg, .. } => Some(msg),
            _ => None,
        })
        .collect()
}

#[test]
fn control_messages_are_answered_by_role_and_counted() {
    let t0 = Instant::now();
    let (mut p, _pool) = core_in("kv_producer", "read");
    let reg = p.kv().unwrap().regs();
    p.on_control(t0, 1, Message::Handshake);
    assert!(
        matches!(&replies(&mut p)[..], [Message::HandshakeOk(h)] if h.ranks.as_ref().map(|r| r.iter().map(|r| r.reg).collect::<Vec<_>>()) == Some(reg.clone()) && h.engine_id == "e0")
    );
    p.on_control(
        t0,
        2,
        Message::Drop {
            transfer_id: "t1".into(),
            code: FailCode::Dropped,
        },
    );
    assert_eq!(replies(&mut p), vec![Message::DropOk { known: false }]);
    p.on_control(
        t0,
        3,
        Message::ReadDone {
            transfer_id: "t9".into(),
        },
    );
    assert!(matches!(
        &replies(&mut p)[..],
        [Message::ReadDoneErr { .. }]
    ));
    let c = p.counters();
    assert_eq!((c.drops_received, c.reads_late, c.reads_done), (1, 1, 0));
    // Asleep: the handshake names no registration.
    p.begin_release(t0).unwrap();
    p.on_control(t0, 4, Message::Handshake);
    assert!(matches!(&replies(&mut p)[..], [Message::HandshakeOk(h)] if h.ranks.is_none()));
    // A decode engine sends no KV.
    let (mut d, _pool2) = core("kv_consumer");
    let pull = Pull {
        transfer_id: "t1".into(),
        engine_id: "d9".into(),
        first_block: 0,
        num_tokens: 3 * BS,
        dst: Destination::Tcp {
            addr: "127.0.0.1:11".into(),
        },
        ranks: vec![PullRank {
            rank: RankReg {
                heads: (0, 1),
                reg: Registration {
                    segment: 1,
                    key: 2,
                    epoch: 1,
                    len: 4096 * 3,
                },
            },
            grant_key: None,
        }],
        blocks: vec![0, 1, 2],
        weights_version: None,
    };
    for msg in [
        Message::Pull(pull),
        Message::Drop {
            transfer_id: "t1".into(),
            code: FailCode::Dropped,
        },
        Message::ReadDone {
            transfer_id: "t1".into(),
        },
    ] {
        d.on_control(t0, 5, msg);
        assert!(
            matches!(&replies(&mut d)[..], [Message::Error { reason }] if reason.contains("sends no KV"))
        );
    }
    assert_eq!(d.counters().drops_received, 0);
}

#[test]
fn a_failed_exchange_ends_the_load_at_once_not_at_its_deadline() {
    let t0 = Instant::now();
    let (mut d, _pool) = core("kv_consumer");
    let id = start_load(&mut d, t0);
    let op = std::iter::from_fn(|| d.poll_io())
        .find_map(|io| match io {
            Io::Send(SendIo {
                op: op @ Op::Bootstrap { .. },
                ..
            }) => Some(op),
            _ => None,
        })
        .expect("a bootstrap");
    // Nobody listens at P's address.
    d.on_exchange_failed(
        t0,
        op,
        Failure::new(FailCode::PeerLost, "connection refused"),
        false,
    );
    assert_eq!(d.get_finished().recving, vec![id.clone()]);
    let errors = d.get_block_ids_with_load_errors();
    assert_eq!(
        errors.iter().map(|(b, _)| *b).collect::<Vec<_>>(),
        vec![1, 2, 3]
    );
    assert!(
        errors[0].1.message.contains("connection refused"),
        "{:?}",
        errors[0].1
    );
    assert_eq!(d.recv_machine().num_loads(), 0);
}

#[test]
fn each_role_takes_only_its_own_params() {
    let t0 = Instant::now();
    let id: Arc<str> = Arc::from("r1");
    let toks = prompt();
    let for_d = from_p0("t1");
    let for_p = params::for_prefill("t2");
    // A producer loads nothing.
    let (mut p, _pool) = core("kv_producer");
    let req = creq(&id, &toks, &for_d);
    assert_eq!(
        p.get_num_new_matched_tokens(t0, req, 0),
        ExternalMatch::default()
    );
    // A consumer keeps nothing for a decode engine, a producer does —
    // from whichever call comes first.
    let (mut d, _pool2) = core("kv_consumer");
    let req = || creq(&id, &toks, &for_p);
    d.request_added(t0, req());
    assert_eq!(
        d.get_num_new_matched_tokens(t0, req(), 0),
        ExternalMatch::default()
    );
    assert_eq!(d.send_machine().phase("t2"), None);
    p.request_added(t0, req());
    assert!(p.send_machine().phase("t2").is_some());
    let (mut p2, _pool3) = core("kv_producer");
    assert_eq!(
        p2.get_num_new_matched_tokens(t0, req(), 0),
        ExternalMatch::default()
    );
    assert!(p2.send_machine().phase("t2").is_some());
}
