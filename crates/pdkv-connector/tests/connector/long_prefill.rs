//! Long prefills: P computes a prompt for longer than D's `load_timeout_s`
//! and P's own `abort_timeout_s`, and the transfer still succeeds.
//!
//! Deadlines count from when P's KV is ready, not from when D's pull
//! arrived: while P computes, the pull stays parked at P and D hears from P
//! every `heartbeat_s`, so D's load timeout (counted from the last word of
//! P) never fires. Only `prefill_timeout_s` bounds the wait.
//!
//! A slow prefill is made deterministic by holding P's request in its queue:
//! P is paused in `keep` mode before the request arrives, so the request is
//! admitted (its transfer is WAITING in P's send machine from the moment it
//! is queued) and runs only once P resumes. For the engines, and for the
//! connectors, that is a prefill that takes as long as the test wants.
//! Nothing sleeps: the tests wait on the engines' stats and the connectors'
//! gauges, with deadlines.

use std::time::{Duration, Instant};

use crate::common::{
    all_idle, assert_finished, assert_matches_colocated, collect, colocated, d_engine,
    decode_params, error_of, metric, p_engine, prompt, pull_params, start, wait_metric, WAIT,
};
use pdkv_engine::{EngineHandle, FinishReason, PauseMode};

/// Much shorter than the time P holds the request (see [`HOLD`]).
const TIMEOUTS: &str = r#","abort_timeout_s":0.3,"load_timeout_s":0.6,"heartbeat_s":0.1"#;
/// How long P keeps the request queued: well past both timeouts.
const HOLD: Duration = Duration::from_millis(1500);

/// P paused in `keep` mode with the request `p-{tid}` (for transfer `tid`)
/// queued; returns its stream (kept by the caller: dropping it aborts).
fn queue_at_paused_p(p: &EngineHandle, tid: &str, tokens: &[u32]) -> pdkv_engine::RequestStream {
    p.pause(PauseMode::Keep, false, Duration::from_secs(10))
        .expect("P pauses (keep)");
    let s = start(
        p,
        &format!("p-{tid}"),
        tokens.to_vec(),
        1,
        Some(decode_params(tid)),
    );
    // The core published the stats of the turn that queued it, so the
    // connector has seen the request (its transfer is WAITING).
    let queued = p.wait_stats(WAIT, |s| s.num_waiting == 1 && s.num_running == 0);
    assert!(
        queued.is_some(),
        "P's request is not queued: {:?}",
        p.stats()
    );
    s
}

/// D's load, started while P holds the request, is still waiting after
/// [`HOLD`]: neither side gave up.
fn assert_still_loading(p: &EngineHandle, d: &EngineHandle, what: &str) {
    let gave_up = d.wait_stats(HOLD, |s| s.num_waiting_for_remote_kv == 0);
    assert!(
        gave_up.is_none(),
        "{what}: D stopped waiting for its KV within {HOLD:?}: {:?}",
        d.stats()
    );
    assert_eq!(
        metric(p, "pulls_pending"),
        1.0,
        "{what}: the pull is no longer parked at P"
    );
    assert_eq!(
        metric(d, "loads_abandoned_total"),
        0.0,
        "{what}: D gave the load up"
    );
    assert_eq!(metric(d, "loads_failed_total"), 0.0, "{what}");
    assert_eq!(metric(p, "pulls_failed_total"), 0.0, "{what}");
}

/// Catches the old behaviour in which a pull's deadline was `abort_timeout`
/// from its receipt (P answered the parked pull with a deadline error after
/// 0.3 s) and D gave up `load_timeout` after it sent the pull (0.6 s): the
/// load failed, and under `fail` so did the request.
fn long_prefill(transport: &str) {
    let cfg = format!(r#"{TIMEOUTS},"transport":"{transport}""#);
    let p = p_engine(&cfg, "p-long");
    let d = d_engine(&cfg, &format!("d-long-{transport}"));
    let colo = colocated();
    let (ph, dh) = (&p.handle, &d.handle);
    let pr = prompt(90, 120);

    let ps = queue_at_paused_p(ph, "long", &pr);
    let ds = start(dh, "d-long", pr.clone(), 5, Some(pull_params(ph, "long")));
    assert!(
        dh.wait_stats(WAIT, |s| s.num_waiting_for_remote_kv == 1)
            .is_some(),
        "D is not loading: {:?}",
        dh.stats()
    );
    wait_metric(ph, "pulls_pending", 1.0, "D's pull parked at P");
    let t0 = Instant::now();
    assert_still_loading(ph, dh, transport);
    assert!(t0.elapsed() >= HOLD);

    // P computes the prompt now; the parked pull gets it.
    ph.resume().expect("P resumes");
    assert_finished(&collect(ps), FinishReason::Length, "P's request");
    let out = collect(ds);
    assert_matches_colocated(
        &colo.handle,
        &out,
        &pr,
        5,
        &format!("D after a long prefill over {transport}"),
    );
    assert_eq!(metric(dh, "loads_ok_total"), 1.0);
    assert_eq!(metric(ph, "pulls_ok_total"), 1.0);
    for (e, name) in [
        (dh, "loads_failed_total"),
        (dh, "loads_abandoned_total"),
        (ph, "pulls_failed_total"),
    ] {
        assert_eq!(metric(e, name), 0.0, "{name}");
    }
    all_idle(&[(ph, "P"), (dh, "D"), (&colo.handle, "colocated")]);
}

#[test]
fn a_prefill_longer_than_the_load_and_abort_timeouts_transfers_over_tcp() {
    long_prefill("tcp");
}

#[test]
fn a_prefill_longer_than_the_load_and_abort_timeouts_transfers_over_shm() {
    long_prefill("shm");
}

/// The wait has a bound all the same: a pull whose prefill has not
/// finished within `prefill_timeout_s` is answered with that reason at
/// that moment (not after D's load timeout, which the heartbeats keep
/// pushing back), and under `fail` D's request ends with it.
#[test]
fn a_prefill_past_prefill_timeout_fails_the_load_at_that_deadline() {
    let cfg = format!(r#"{TIMEOUTS},"prefill_timeout_s":1"#);
    let p = p_engine(&cfg, "p-bound");
    let d = d_engine(&cfg, "d-bound");
    let (ph, dh) = (&p.handle, &d.handle);
    let pr = prompt(91, 60);

    let ps = queue_at_paused_p(ph, "bound", &pr);
    let t0 = Instant::now();
    let out = collect(start(
        dh,
        "d-bound",
        pr.clone(),
        3,
        Some(pull_params(ph, "bound")),
    ));
    let took = t0.elapsed();
    let why = error_of(&out, "D's request past the prefill timeout");
    assert!(why.contains("prefill_timeout_s"), "{why}");
    assert!(
        took >= Duration::from_millis(900) && took < Duration::from_secs(3),
        "the load ended {took:?} after it started (prefill_timeout_s is 1 s)"
    );
    assert_eq!(metric(dh, "loads_failed_total"), 1.0);
    assert_eq!(
        metric(dh, "loads_abandoned_total"),
        0.0,
        "D did not give up on its own"
    );

    // P's request runs once resumed; its transfer was never pulled, so it
    // is held for D until its 0.3 s lease ends.
    ph.resume().expect("P resumes");
    assert_finished(&collect(ps), FinishReason::Length, "P's request");
    all_idle(&[(ph, "P"), (dh, "D")]);
}
