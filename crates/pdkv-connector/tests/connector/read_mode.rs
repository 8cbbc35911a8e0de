//! Read mode (`"transfer_mode":"read"`) end to end on real engines with the
//! tiny random model: P leases a finished prompt's blocks and D reads them
//! one-sided, over TCP and shared memory.
//!
//! Checked here: D's greedy tokens and logits bits equal a colocated
//! engine's (also with local prefix hits on D); D's `read_done` ends P's
//! lease at once; an unread lease expires and a read after it is void; P's
//! sleep and wake publish a new registration generation that D picks up with
//! one handshake before reading; params from before the sleep can never read
//! the new pages (the read is refused, and as P's sleep ended that lease on
//! purpose, D computes the prompt itself); bad params fail only their own
//! request.

use std::time::Duration;

use crate::common::{
    config, fingerprint, idle_and_free, metric, prompt, run, Fingerprint, Started, WAIT,
};
use pdkv_engine::{
    EngineConfig, EngineHandle, EngineRequest, FinishReason, PauseMode, SamplingParams, SleepLevel,
};
use serde_json::{json, Value};

/// An engine on the tiny random llama; with a connector, sleep mode is on.
fn engine(connector: Option<(&str, &str)>) -> Started {
    crate::common::engine(
        connector,
        EngineConfig {
            enable_sleep_mode: connector.is_some(),
            ..config()
        },
    )
}

/// A P (producer) and D (consumer) in read mode, plus a colocated engine.
/// `name` keeps the engine ids (and so P's shared-memory socket) apart
/// between tests running at once.
fn trio(name: &str, transport: &str, producer_extra: &str) -> (Started, Started, Started) {
    let pc = format!(
        r#"{{"kv_connector":"pdkv","kv_role":"kv_producer","transport":"{transport}","transfer_mode":"read"{producer_extra}}}"#
    );
    let dc = format!(
        r#"{{"kv_connector":"pdkv","kv_role":"kv_consumer","transport":"{transport}","transfer_mode":"read"}}"#
    );
    (
        engine(Some((&pc, &format!("p-{name}-{transport}")))),
        engine(Some((&dc, &format!("d-{name}-{transport}")))),
        engine(None),
    )
}

/// P's part of a transfer: the params it returns (its blocks stay leased).
fn prefill(p: &EngineHandle, tid: &str, pr: &[u32]) -> Value {
    let out = run(
        p,
        &format!("{tid}-p"),
        pr.to_vec(),
        1,
        Some(json!({"do_remote_decode": true, "transfer_id": tid})),
    );
    let last = out.last().unwrap();
    assert_eq!(
        last.finish_reason,
        Some(FinishReason::Length),
        "{:?}",
        last.error
    );
    last.kv_transfer_params
        .clone()
        .expect("P returns transfer params")
}

/// D's part: its output, or the error that ended the request (then no token
/// was produced).
fn decode(d: &EngineHandle, id: &str, pr: &[u32], params: Value) -> Result<Fingerprint, String> {
    let out = run(d, id, pr.to_vec(), 5, Some(params));
    let last = out.last().unwrap();
    if last.finish_reason == Some(FinishReason::Length) {
        return Ok(fingerprint(&out));
    }
    assert!(
        out.iter().all(|o| o.token_ids.is_empty()),
        "a failed load produced tokens: {out:?}"
    );
    Err(format!(
        "{:?}: {}",
        last.finish_reason,
        last.error.clone().unwrap_or_default()
    ))
}

fn colocated(c: &EngineHandle, id: &str, pr: &[u32]) -> Fingerprint {
    fingerprint(&run(c, id, pr.to_vec(), 5, None))
}

/// Asserts D's result equals the colocated output (without dumping logits).
fn assert_same(got: Result<Fingerprint, String>, want: Fingerprint, what: &str) {
    match got {
        Ok(g) => {
            assert_eq!(g.0, want.0, "{what}: tokens differ");
            assert!(g.1 == want.1, "{what}: logits differ");
        }
        Err(e) => panic!("{what}: D failed: {e}"),
    }
}

/// Waits until P's stats show `n` blocks held for transfers (the stats
/// snapshot may lag the request's output, so a lease is first seen held).
fn wait_held(p: &EngineHandle, n: usize, within: Duration) -> bool {
    p.wait_stats(within, |s| s.kv_blocks_held == n).is_some()
}

fn generation(params: &Value) -> u64 {
    params["remote_registration_generation"]
        .as_u64()
        .expect("read-mode params carry the generation")
}

fn matches_colocated(transport: &str) {
    // A lease far longer than the test: blocks coming back early can only
    // be the read_done's doing.
    let (p, d, colo) = trio("same", transport, r#","abort_timeout_s":120"#);
    for (i, pr) in crate::common::prefix_prompts().iter().enumerate() {
        let tid = format!("r{i}");
        let params = prefill(&p.handle, &tid, pr);
        let ids = params["remote_block_ids"]
            .as_array()
            .expect("read-mode params name P's blocks");
        assert_eq!(
            ids.len(),
            (pr.len() - 1).div_ceil(16),
            "prompt {i}: {params}"
        );
        assert_eq!(generation(&params), 1, "P has registered its KV cache once");
        assert_eq!(
            metric(&p.handle, "send_held_blocks"),
            ids.len() as f64,
            "prompt {i}: P leases the blocks"
        );
        assert!(
            wait_held(&p.handle, ids.len(), WAIT),
            "prompt {i}: {:?}",
            p.handle.stats()
        );
        let got = decode(&d.handle, &format!("d{i}"), pr, params);
        assert_same(
            got,
            colocated(&colo.handle, &format!("c{i}"), pr),
            &format!("prompt {i} over {transport}"),
        );
        assert!(
            wait_held(&p.handle, 0, Duration::from_secs(20)),
            "P still leases blocks after the read: {:?}",
            p.handle.stats()
        );
    }
    idle_and_free(&p.handle);
    idle_and_free(&d.handle);
    assert_eq!(metric(&d.handle, "loads_ok_total"), 4.0);
    assert_eq!(metric(&d.handle, "loads_failed_total"), 0.0);
    assert_eq!(
        metric(&d.handle, "handshakes_total"),
        1.0,
        "one handshake per prefill engine"
    );
    assert!(metric(&d.handle, "bytes_read_total") > 0.0);
    assert_eq!(metric(&p.handle, "reads_done_total"), 4.0);
    assert_eq!(
        metric(&p.handle, "pulls_ok_total"),
        0.0,
        "nothing was pulled"
    );
}

#[test]
fn read_mode_equals_colocated_and_read_done_ends_the_lease_over_tcp() {
    matches_colocated("tcp");
}

#[test]
fn read_mode_equals_colocated_and_read_done_ends_the_lease_over_shm() {
    matches_colocated("shm");
}

#[test]
fn an_unread_lease_expires_and_a_late_read_is_void_and_recomputed() {
    let (p, d, colo) = trio("late", "tcp", r#","abort_timeout_s":0.3"#);
    let pr = prompt(7, 37);
    let params = prefill(&p.handle, "late", &pr);
    assert_eq!(metric(&p.handle, "send_held_blocks"), 3.0);
    // Nobody reads: the lease gives the blocks back by itself, and the
    // connector no longer holds them.
    let back = p.handle.wait_stats(WAIT, |s| {
        s.kv_blocks_held == 0 && metric(&p.handle, "send_held_blocks") == 0.0
    });
    assert!(
        back.is_some(),
        "the expired lease kept its blocks: {:?}",
        p.handle.stats()
    );
    assert!(wait_held(&p.handle, 0, WAIT));
    // The read comes too late: P's read_done answer says the lease expired,
    // so D drops what it read and computes the prompt itself (P reclaimed
    // the KV on purpose: not a failed transfer).
    let got = decode(&d.handle, "late-d", &pr, params);
    assert_same(
        got,
        colocated(&colo.handle, "c-late", &pr),
        "D after the lease expired",
    );
    assert_eq!(metric(&p.handle, "reads_late_total"), 1.0);
    assert_eq!(metric(&d.handle, "loads_failed_total"), 0.0);
    assert_eq!(metric(&d.handle, "loads_released_total"), 0.0);
    assert_eq!(metric(&d.handle, "loads_lease_expired_total"), 1.0);
    assert_eq!(metric(&p.handle, "leases_expired_total"), 1.0);
    // The pair still works.
    let params = prefill(&p.handle, "fresh", &pr);
    assert_same(
        decode(&d.handle, "fresh-d", &pr, params),
        colocated(&colo.handle, "c", &pr),
        "D vs colocated",
    );
    idle_and_free(&p.handle);
    idle_and_free(&d.handle);
}

fn sleep_and_wake(e: &EngineHandle) {
    e.sleep(SleepLevel::L1, PauseMode::Abort, WAIT)
        .expect("sleep");
    e.wake_up(None).expect("wake");
}

fn survives_p_sleep(transport: &str) {
    let (p, d, colo) = trio("sleep", transport, "");
    let pr = prompt(11, 45);
    let first = prefill(&p.handle, "s0", &pr);
    let g0 = generation(&first);
    assert_same(
        decode(&d.handle, "s0-d", &pr, first),
        colocated(&colo.handle, "c0", &pr),
        "D vs colocated",
    );
    assert_eq!(metric(&d.handle, "handshakes_total"), 1.0);
    // Leased when P sleeps: the sleep ends the lease; these params are stale.
    let stale = prefill(&p.handle, "old", &prompt(12, 30));
    for round in 1..=2u64 {
        sleep_and_wake(&p.handle);
        let pr = prompt(11 + 10 * round, 28 + round as usize);
        let params = prefill(&p.handle, &format!("s{round}"), &pr);
        assert_eq!(
            generation(&params),
            g0 + round,
            "round {round}: the wake's generation is published"
        );
        let got = decode(&d.handle, &format!("s{round}-d"), &pr, params);
        assert_same(
            got,
            colocated(&colo.handle, &format!("c{round}"), &pr),
            &format!("{transport}: after P woke ({round})"),
        );
        assert_eq!(
            metric(&d.handle, "handshakes_total"),
            1.0 + round as f64,
            "one handshake, before the read"
        );
        assert_eq!(
            metric(&d.handle, "loads_failed_total"),
            0.0,
            "no failed first read after a wake"
        );
    }
    // D holds P's current generation now: params of an older one are
    // refused before any read (the sleep ended that lease on purpose), and
    // D computes the prompt itself.
    let read_before = metric(&d.handle, "bytes_read_total");
    let got = decode(&d.handle, "old-d", &prompt(12, 30), stale);
    assert_same(
        got,
        colocated(&colo.handle, "c-old", &prompt(12, 30)),
        "D with params from before P's sleep",
    );
    assert_eq!(
        metric(&d.handle, "bytes_read_total"),
        read_before,
        "nothing was read"
    );
    assert_eq!(
        (
            metric(&d.handle, "loads_failed_total"),
            metric(&d.handle, "loads_released_total")
        ),
        (0.0, 1.0)
    );
    idle_and_free(&p.handle);
    idle_and_free(&d.handle);
}

#[test]
fn p_sleeps_and_wakes_and_d_rehandshakes_before_reading_over_tcp() {
    survives_p_sleep("tcp");
}

#[test]
fn p_sleeps_and_wakes_and_d_rehandshakes_before_reading_over_shm() {
    survives_p_sleep("shm");
}

#[test]
fn params_from_before_a_sleep_never_read_the_new_pages() {
    for transport in ["tcp", "shm"] {
        let (p, d, colo) = trio("stale", transport, "");
        let pr = prompt(31, 40);
        let first = prefill(&p.handle, "a", &pr);
        assert_same(
            decode(&d.handle, "a-d", &pr, first),
            colocated(&colo.handle, "ca", &pr),
            "D vs colocated",
        );
        // The same prompt again, leased with the pre-sleep generation; after
        // the wake P's new pages hold other KV (or none).
        let stale = prefill(&p.handle, "b", &pr);
        sleep_and_wake(&p.handle);
        // D still holds the old generation, as the params do: no handshake,
        // the transfer layer refuses the access (stale epoch), nothing is
        // read, and P's read_done answer says the sleep ended the lease: D
        // computes the prompt itself.
        let read_before = metric(&d.handle, "bytes_read_total");
        let got = decode(&d.handle, "b-d", &pr, stale);
        assert_same(
            got,
            colocated(&colo.handle, "cb", &pr),
            &format!("{transport}: D with stale params"),
        );
        assert_eq!(metric(&d.handle, "handshakes_total"), 1.0, "{transport}");
        assert_eq!(
            metric(&d.handle, "bytes_read_total"),
            read_before,
            "{transport}: nothing was read"
        );
        assert_eq!(metric(&d.handle, "loads_failed_total"), 0.0, "{transport}");
        // A fresh request after the wake reads the new pages correctly.
        let params = prefill(&p.handle, "c", &pr);
        assert_eq!(
            decode(&d.handle, "c-d", &pr, params),
            Ok(colocated(&colo.handle, "cc", &pr)),
            "{transport}"
        );
        idle_and_free(&p.handle);
        idle_and_free(&d.handle);
    }
}

#[test]
fn bad_read_params_fail_only_their_request() {
    let (p, d, colo) = trio("bad", "tcp", "");
    let pr = prompt(41, 50);
    let params = prefill(&p.handle, "bad", &pr);
    let want = colocated(&colo.handle, "c", &pr);

    // One block short: both numbers named; the read is not attempted.
    let mut short = params.clone();
    short["remote_block_ids"].as_array_mut().unwrap().pop();
    let err = decode(&d.handle, "short", &pr, short).unwrap_err();
    assert!(
        err.contains("block count mismatch")
            && err.contains("names 3 blocks")
            && err.contains("fills 4 blocks"),
        "{err}"
    );

    // An engine id that is not P's.
    let other = prefill(&p.handle, "other", &pr);
    let mut wrong = other.clone();
    wrong["remote_engine_id"] = json!("nope");
    let err = decode(&d.handle, "wrong", &pr, wrong).unwrap_err();
    assert!(
        err.contains("remote_engine_id mismatch")
            && err.contains("nope")
            && err.contains("p-bad-tcp"),
        "{err}"
    );
    // Malformed params are refused at admission.
    let mut junk = other.clone();
    junk["remote_block_ids"] = json!(["x"]);
    let sp = SamplingParams {
        max_tokens: 1,
        ..SamplingParams::default()
    };
    let e = d
        .handle
        .add_request(EngineRequest::new("junk", pr.clone(), sp).with_kv_transfer_params(Some(junk)))
        .err()
        .expect("malformed read params refused");
    assert!(format!("{e}").contains("remote_block_ids"), "{e}");

    // The transfer whose engine id was wrong is still leased: the right
    // params read it, and D's other requests are unaffected.
    assert_same(
        decode(&d.handle, "right", &pr, other),
        want.clone(),
        "D vs colocated",
    );
    let params = prefill(&p.handle, "good", &pr);
    assert_same(
        decode(&d.handle, "good-d", &pr, params),
        want,
        "D vs colocated",
    );
    assert_eq!(metric(&d.handle, "loads_failed_total"), 2.0);
    assert_eq!(metric(&d.handle, "loads_ok_total"), 2.0);
    idle_and_free(&p.handle);
    idle_and_free(&d.handle);
}
