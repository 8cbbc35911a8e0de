//! P/D failure handling on real engines (a tiny random llama): a prefill
//! engine (P) with a producer connector and decode engines (D) with consumer
//! connectors, in one process.
//!
//! Every test ends with every engine still running idle: all KV blocks free,
//! none held for a transfer, nothing running or waiting. Nothing sleeps to
//! synchronise: the tests wait on request streams and on the engines' stats
//! (republished by each core at least once per idle turn), with deadlines.
//!
//! Several tests need a P whose request for a transfer is admitted (so its
//! transfer is WAITING in P's send machine) but can never finish, while D's
//! pull is parked at P. [`block_prefill`] arranges that without timing
//! assumptions: a first P request ("hold") finishes and its transfer keeps
//! most of P's small cache held for D, so the next P request stays queued
//! (registered with the connector, its transfer WAITING, from P's next
//! scheduling pass on) and gets no blocks until "hold" is pulled. A pull that
//! reaches P before that pass is parked as for an unknown transfer, which
//! these tests treat the same way.

use std::time::{Duration, Instant};

use crate::common::{
    all_idle, assert_finished, assert_idle, assert_matches_colocated, collect, colocated, config,
    consumer, d_engine, decode_params, engine, error_of, fingerprint, last, metric, p_engine, pd,
    producer, prompt, pull_params, remote_prefill, request, run, start, wait_metric, Started, WAIT,
};
use pdkv_engine::{
    AddRequestError, EngineConfig, EngineHandle, FinishReason, PauseMode, RequestStream,
};
use serde_json::{json, Value};

/// The prefill engine's id in every test (D requests name it).
const P_ID: &str = "p1";

/// A blocked P's cache, in blocks of 16 tokens.
const BLOCKED_P_BLOCKS: usize = 16;
/// The prompt of the transfer that keeps a blocked P's cache held (13 blocks).
const HOLD_LEN: usize = 200;
/// Prompts of the P requests that stay queued behind it (7 blocks each).
const TARGET_LEN: usize = 100;

/// [`config`] with a cache of `num_kv_blocks` blocks.
fn blocks(num_kv_blocks: usize) -> EngineConfig {
    EngineConfig {
        num_kv_blocks,
        ..config()
    }
}

/// A P whose cache is held by a finished transfer: see the module docs.
struct Blocked {
    p: Started,
    hold_prompt: Vec<u32>,
    hold_params: Value,
}

/// Starts a P with a small cache and fills it with the held transfer "hold"
/// (which P does not give back for new prompts: `reclaim_held_kv` off).
fn block_prefill(extra: &str) -> Blocked {
    let extra = format!(r#"{extra},"reclaim_held_kv":false"#);
    let p = engine(Some((&producer(&extra), P_ID)), blocks(BLOCKED_P_BLOCKS));
    let hold_prompt = prompt(77, HOLD_LEN);
    let hold_params = remote_prefill(&p.handle, "hold", &hold_prompt, "hold");
    let s = p
        .handle
        .wait_stats(WAIT, |s| s.num_running == 0 && s.num_waiting == 0)
        .unwrap();
    let need = TARGET_LEN.div_ceil(pdkv_model::BLOCK_SIZE);
    assert!(
        s.kv_blocks_held > 0 && s.kv_blocks_free < need,
        "P is not blocked: {s:?}"
    );
    Blocked {
        p,
        hold_prompt,
        hold_params,
    }
}

impl Blocked {
    /// A P request for `transfer_id` that stays queued (its stream is kept
    /// by the caller: dropping it would abort the request).
    fn queue(&self, id: &str, seed: u64, transfer_id: &str) -> (RequestStream, Vec<u32>) {
        let pr = prompt(seed, TARGET_LEN);
        (
            start(
                &self.p.handle,
                id,
                pr.clone(),
                1,
                Some(decode_params(transfer_id)),
            ),
            pr,
        )
    }

    /// D pulls "hold", which unblocks P; D's tokens equal a colocated run.
    fn release(&self, d: &EngineHandle, colo: &EngineHandle) {
        let out = run(
            d,
            "d-hold",
            self.hold_prompt.clone(),
            3,
            Some(self.hold_params.clone()),
        );
        assert_matches_colocated(colo, &out, &self.hold_prompt, 3, "D after pulling hold");
    }
}

/// Waits until D's request is waiting for its KV and its pull is parked at P
/// (`pulls` pulls pending there in all).
fn wait_parked(p: &EngineHandle, d: &EngineHandle, pulls: f64) {
    assert!(
        d.wait_stats(WAIT, |s| s.num_waiting_for_remote_kv == 1)
            .is_some(),
        "D is not loading: {:?}",
        d.stats()
    );
    wait_metric(p, "pulls_pending", pulls, "the pull parked at P");
}

/// P's request is aborted while D waits for its KV: D's request ends at
/// once — with the abort as its error under `fail`, and with the colocated
/// tokens under `recompute`.
#[test]
fn an_aborted_prefill_makes_the_waiting_decode_recompute_at_once_under_either_policy() {
    let b = block_prefill(r#","arrival_timeout_s":20"#);
    let p = &b.p.handle;
    let d = d_engine("", "d1-fail");
    let dr = d_engine(r#","kv_load_failure_policy":"recompute""#, "d1-rec");
    let colo = colocated();

    for (i, (dh, policy)) in [(&d.handle, "fail"), (&dr.handle, "recompute")]
        .into_iter()
        .enumerate()
    {
        let tid = format!("t-{policy}");
        let (ps, pr) = b.queue(&format!("p-{policy}"), 10 + i as u64, &tid);
        let ds = start(dh, "d", pr.clone(), 4, Some(pull_params(p, &tid)));
        wait_parked(p, dh, 1.0);
        // Stats are republished after each core turn; wait for the turn
        // that saw the queue as it is now.
        let queued = p.wait_stats(WAIT, |s| s.num_waiting == 1 && s.num_running == 0);
        assert!(
            queued.is_some(),
            "P's request is not queued: {:?}",
            p.stats()
        );

        let t0 = Instant::now();
        assert!(p.abort(&format!("p-{policy}")));
        let out = collect(ds);
        let took = t0.elapsed();
        assert!(
            took < Duration::from_secs(1),
            "{policy}: D ended {took:?} after P's abort"
        );
        assert_finished(&collect(ps), FinishReason::Abort, "P's request");
        // Aborted on purpose at P: not a failed transfer; D computes the
        // prompt itself under either policy.
        assert_matches_colocated(&colo.handle, &out, &pr, 4, &format!("D under {policy}"));
        wait_metric(p, "pulls_pending", 0.0, "P after the abort");
    }
    for dh in [&d.handle, &dr.handle] {
        assert_eq!(metric(dh, "loads_failed_total"), 0.0);
        assert_eq!(metric(dh, "loads_released_total"), 1.0);
    }
    assert_eq!(metric(p, "pulls_failed_total"), 0.0);
    assert_eq!(metric(p, "pulls_released_total"), 2.0);

    b.release(&d.handle, &colo.handle);
    all_idle(&[
        (p, "P"),
        (&d.handle, "D fail"),
        (&dr.handle, "D recompute"),
        (&colo.handle, "colocated"),
    ]);
}

/// D's request is aborted while its load waits at P: D keeps the
/// request's blocks until the load is fenced (the pull's grant revoked, or
/// P's answer to the drop), then frees them; P, whose transfer D released,
/// answers the parked pull and frees its request's blocks as soon as that
/// request finishes — well before the 30 s lease.
#[test]
fn an_aborted_decode_releases_the_transfer_on_both_sides() {
    let b = block_prefill(r#","abort_timeout_s":30,"arrival_timeout_s":20"#);
    let p = &b.p.handle;
    let d = d_engine("", "d2");
    let colo = colocated();

    let (ps, pr) = b.queue("p-t", 20, "t");
    let ds = start(&d.handle, "d-t", pr.clone(), 4, Some(pull_params(p, "t")));
    wait_parked(p, &d.handle, 1.0);
    assert!(
        d.handle.stats().kv_blocks_free < d.handle.stats().kv_blocks_total,
        "D holds the load's blocks"
    );

    assert!(d.handle.abort("d-t"));
    assert_finished(&collect(ds), FinishReason::Abort, "D's aborted request");
    // D's blocks come back once the load is fenced; D counts the load as
    // cancelled (its request ended first), not as a failed transfer, and P
    // answers the parked pull as released by D.
    assert_idle(&d.handle, Duration::from_secs(2), "D after its abort");
    wait_metric(p, "pulls_cancelled_total", 1.0, "P after D's drop");
    assert_eq!(metric(p, "pulls_failed_total"), 0.0);
    assert_eq!(metric(p, "pulls_pending"), 0.0);
    assert_eq!(
        metric(&d.handle, "loads_cancelled_total"),
        1.0,
        "the load ended before D freed the blocks"
    );
    assert_eq!(metric(&d.handle, "loads_failed_total"), 0.0);
    assert_eq!(metric(&d.handle, "loads_ok_total"), 0.0);

    // Unblock P: its request runs and finishes; the transfer is released
    // already, so nothing is held for it.
    b.release(&d.handle, &colo.handle);
    let pout = collect(ps);
    assert_finished(&pout, FinishReason::Length, "P's request after the release");
    let t1 = Instant::now();
    assert_idle(
        p,
        Duration::from_secs(2),
        "P after its released request finished",
    );
    assert!(t1.elapsed() < Duration::from_secs(2));
    assert_eq!(metric(p, "send_held_blocks"), 0.0);

    // A late pull of the released transfer learns why it is gone.
    let late = last(&pout)
        .kv_transfer_params
        .clone()
        .expect("P returns params for a completed request");
    let out = run(&d.handle, "d-late", pr.clone(), 2, Some(late));
    let why = error_of(&out, "a pull of the released transfer");
    assert!(why.contains(pdkv_connector::send::RELEASED), "{why}");
    all_idle(&[(p, "P"), (&d.handle, "D"), (&colo.handle, "colocated")]);
}

/// Bad `kv_transfer_params` fail only their own request while a good P/D
/// request runs at the same time; malformed ones are refused at once.
#[test]
fn bad_transfer_params_fail_only_their_request() {
    let p = p_engine(r#","arrival_timeout_s":0.5"#, P_ID);
    let d = d_engine("", "d3");
    let colo = colocated();
    let (ph, dh) = (&p.handle, &d.handle);

    // Two finished transfers on P: one pulled properly, one by a D prompt one
    // block longer than P's.
    let good = prompt(30, 40);
    let good_params = remote_prefill(ph, "p-good", &good, "good");
    let short = prompt(31, 40);
    let short_params = remote_prefill(ph, "p-short", &short, "short");
    let long = [&short[..], &prompt(32, pdkv_model::BLOCK_SIZE)[..]].concat();

    let mut other_engine = pull_params(ph, "x-engine");
    other_engine["remote_engine_id"] = json!("p-elsewhere");
    let bogus = pull_params(ph, "no-such-transfer");

    let results = std::thread::scope(|s| {
        let good_run = s.spawn(|| run(dh, "d-good", good.clone(), 6, Some(good_params)));
        let engine_run = s.spawn(|| run(dh, "d-engine", prompt(33, 40), 6, Some(other_engine)));
        let bogus_run = s.spawn(|| run(dh, "d-bogus", prompt(34, 40), 6, Some(bogus)));
        let long_run = s.spawn(|| run(dh, "d-long", long.clone(), 6, Some(short_params)));
        [good_run, engine_run, bogus_run, long_run].map(|h| h.join().unwrap())
    });
    let [good_out, engine_out, bogus_out, long_out] = results;
    assert_matches_colocated(&colo.handle, &good_out, &good, 6, "the good request");

    let why = error_of(&engine_out, "unknown remote_engine_id");
    assert!(
        why.contains("p-elsewhere") && why.contains(&format!("{P_ID:?}")),
        "{why}"
    );
    let why = error_of(&bogus_out, "bogus transfer_id");
    assert!(
        why.contains("no-such-transfer") && why.contains("unknown to the prefill engine"),
        "{why}"
    );
    let why = error_of(&long_out, "prompt one block longer");
    let (asked, computed) = (long.len() - 1, short.len() - 1);
    assert!(
        why.contains(&format!("{asked} tokens")) && why.contains(&format!("computed {computed}")),
        "{why}"
    );

    // Malformed params are refused by add_request, naming the field.
    let invalid = |e: &EngineHandle, params: Value, field: &str| match e.add_request(request(
        "bad",
        prompt(35, 20),
        2,
        Some(params),
    )) {
        Err(AddRequestError::Invalid(msg)) => {
            assert!(msg.contains(field), "{msg} does not name {field}")
        }
        Err(other) => panic!("{field}: refused as {other:?}, not Invalid"),
        Ok(_) => panic!("{field}: malformed params accepted"),
    };
    let mut numeric_id = pull_params(ph, "x");
    numeric_id["transfer_id"] = json!(5);
    invalid(dh, numeric_id, "transfer_id");
    let mut no_addr = pull_params(ph, "x");
    no_addr
        .as_object_mut()
        .unwrap()
        .remove("remote_bootstrap_addr");
    invalid(dh, no_addr, "remote_bootstrap_addr");
    let mut bad_addr = pull_params(ph, "x");
    bad_addr["remote_bootstrap_addr"] = json!("not-an-address");
    invalid(dh, bad_addr, "remote_bootstrap_addr");
    invalid(
        ph,
        json!({"do_remote_decode": true, "transfer_id": 5}),
        "transfer_id",
    );
    invalid(
        ph,
        json!({"do_remote_decode": "yes", "transfer_id": "x"}),
        "do_remote_decode",
    );
    invalid(dh, decode_params("x"), "do_remote_decode");

    assert_eq!(metric(dh, "loads_ok_total"), 1.0);
    assert_eq!(metric(dh, "loads_failed_total"), 3.0);
    assert_eq!(metric(ph, "pulls_ok_total"), 1.0);
    all_idle(&[(ph, "P"), (dh, "D"), (&colo.handle, "colocated")]);
}

/// A pull refused for a mismatch is answered once, with its own reason; the
/// transfer's tombstone gives a later pull the "refused an earlier pull"
/// reason.
#[test]
fn a_mismatched_pull_is_answered_once_with_its_own_reason() {
    let p = p_engine("", P_ID);
    let d = d_engine("", "d3m");
    let colo = colocated();
    let (ph, dh) = (&p.handle, &d.handle);
    let pr = prompt(36, 40);
    let params = remote_prefill(ph, "p-m", &pr, "m");
    let long = [&pr[..], &prompt(37, pdkv_model::BLOCK_SIZE)[..]].concat();

    let why = error_of(
        &run(dh, "d-long", long.clone(), 2, Some(params.clone())),
        "the mismatched pull",
    );
    assert!(
        why.contains("prompt length mismatch")
            && why.contains("55 tokens")
            && why.contains("computed 39"),
        "{why}"
    );
    assert!(
        !why.contains("earlier pull"),
        "the refused pull is told that an earlier pull was refused: {why}"
    );
    assert_eq!(
        metric(ph, "pulls_failed_total"),
        1.0,
        "one refused pull is counted (answered) once"
    );
    assert_idle(ph, WAIT, "P after the refused pull");

    // The transfer ended with the refusal: a matching pull now learns why.
    let why = error_of(
        &run(dh, "d-again", pr.clone(), 2, Some(params)),
        "a pull after the refusal",
    );
    assert!(
        why.contains("refused an earlier pull") && why.contains("prompt length mismatch"),
        "{why}"
    );
    assert_eq!(metric(ph, "pulls_failed_total"), 2.0);
    assert_eq!(metric(dh, "loads_failed_total"), 2.0);
    all_idle(&[(ph, "P"), (dh, "D"), (&colo.handle, "colocated")]);
}

/// P shuts down (paused, its requests frozen) while D waits for a WAITING
/// transfer: the shutdown aborts P's requests and P delivers that answer to
/// the parked pulls before its connector stops, so under either policy D
/// recomputes at once (well within its 2 s `load_timeout_s`) and yields the
/// colocated tokens.
#[test]
fn a_prefill_engine_shut_down_mid_transfer_tells_d_which_recomputes() {
    let b = block_prefill(r#","arrival_timeout_s":20"#);
    let p = &b.p.handle;
    let timeouts = r#","abort_timeout_s":1,"load_timeout_s":2"#;
    let d = d_engine(timeouts, "d4-fail");
    let dr = d_engine(
        &format!(r#"{timeouts},"kv_load_failure_policy":"recompute""#),
        "d4-rec",
    );
    let colo = colocated();

    let (psf, prf) = b.queue("p-fail", 40, "t-fail");
    let (psr, prr) = b.queue("p-rec", 41, "t-rec");
    let dsf = start(
        &d.handle,
        "d-fail",
        prf.clone(),
        4,
        Some(pull_params(p, "t-fail")),
    );
    let dsr = start(
        &dr.handle,
        "d-rec",
        prr.clone(),
        4,
        Some(pull_params(p, "t-rec")),
    );
    assert!(d
        .handle
        .wait_stats(WAIT, |s| s.num_waiting_for_remote_kv == 1)
        .is_some());
    wait_parked(p, &dr.handle, 2.0);
    p.pause(PauseMode::Keep, false, Duration::from_secs(10))
        .unwrap();

    let t0 = Instant::now();
    p.shutdown();
    let fail_out = collect(dsf);
    let fail_took = t0.elapsed();
    let rec_out = collect(dsr);
    let rec_took = t0.elapsed();
    assert!(
        fail_took < Duration::from_secs(3),
        "D under fail ended {fail_took:?} after P's shutdown"
    );
    assert!(
        rec_took < Duration::from_secs(3),
        "D under recompute ended {rec_took:?} after P's shutdown"
    );
    // P aborted its requests as it stopped and told the decode engines so
    // before going: ended on purpose, recomputed under either policy.
    assert_matches_colocated(&colo.handle, &fail_out, &prf, 4, "D under fail");
    assert_matches_colocated(&colo.handle, &rec_out, &prr, 4, "D under recompute");
    for s in [psf, psr] {
        assert_finished(&collect(s), FinishReason::Abort, "P's request at shutdown");
    }
    assert!(p.is_stopped());
    let s = p.stats();
    assert_eq!((s.num_running, s.num_waiting), (0, 0), "{s:?}");
    for dh in [&d.handle, &dr.handle] {
        assert_eq!(metric(dh, "loads_failed_total"), 0.0);
        assert_eq!(metric(dh, "loads_released_total"), 1.0);
    }
    all_idle(&[
        (&d.handle, "D fail"),
        (&dr.handle, "D recompute"),
        (&colo.handle, "colocated"),
    ]);
}

/// Many P/D pairs at once, with shared prefixes and more requests than
/// `max_num_seqs`: every D output equals the colocated one.
fn many_concurrent(transport: &str, tag: &str) {
    const N: usize = 24;
    let t = format!(r#","transport":"{transport}""#);
    let p = engine(Some((&producer(&t), P_ID)), blocks(256));
    let d = engine(Some((&consumer(&t), &format!("d5-{tag}"))), blocks(256));
    let colo = engine(None, blocks(256));
    let base = prompt(50, 64);
    let prompts: Vec<Vec<u32>> = (0..N)
        .map(|i| {
            let shared = [0, 16, 24, 32, 48, 64][i % 6];
            [
                &base[..shared],
                &prompt(60 + i as u64, 2 + (i * 7) % 29)[..],
            ]
            .concat()
        })
        .collect();
    let (ph, dh, ch) = (&p.handle, &d.handle, &colo.handle);
    // One pair first, so that D's prefix cache holds the shared prefix when
    // the others arrive: their loads start past D's local hit.
    let warm = [&base[..], &prompt(59, 5)[..]].concat();
    let dout = pd(ph, dh, "x-warm", &warm, 5)
        .unwrap_or_else(|e| panic!("the first pair over {transport}: {e}"));
    assert_matches_colocated(
        ch,
        &dout,
        &warm,
        5,
        &format!("the first pair over {transport}"),
    );
    assert!(
        dh.wait_stats(WAIT, |s| s.num_running == 0 && s.num_waiting == 0)
            .unwrap()
            .prefix_cache_hits
            == 0
    );
    let (pd_outs, colo_outs) = std::thread::scope(|s| {
        let pd: Vec<_> = prompts
            .iter()
            .enumerate()
            .map(|(i, pr)| s.spawn(move || pd(ph, dh, &format!("x{i}"), pr, 5)))
            .collect();
        let colo: Vec<_> = prompts
            .iter()
            .enumerate()
            .map(|(i, pr)| s.spawn(move || run(ch, &format!("c{i}"), pr.clone(), 5, None)))
            .collect();
        (
            pd.into_iter()
                .map(|h| h.join().unwrap())
                .collect::<Vec<_>>(),
            colo.into_iter()
                .map(|h| h.join().unwrap())
                .collect::<Vec<_>>(),
        )
    });
    for (i, (dout, cout)) in pd_outs.iter().zip(&colo_outs).enumerate() {
        let dout = dout
            .as_ref()
            .unwrap_or_else(|e| panic!("P/D request {i} over {transport}: {e}"));
        assert_finished(cout, FinishReason::Length, "colocated");
        assert!(
            fingerprint(dout) == fingerprint(cout),
            "request {i} over {transport} differs from colocated"
        );
    }
    assert_eq!(metric(dh, "loads_ok_total"), (N + 1) as f64);
    assert_eq!(metric(dh, "loads_failed_total"), 0.0);
    assert_eq!(metric(ph, "pulls_ok_total"), (N + 1) as f64);
    assert_eq!(metric(ph, "pulls_failed_total"), 0.0);
    all_idle(&[(ph, "P"), (dh, "D"), (ch, "colocated")]);
    assert!(
        dh.stats().prefix_cache_hits > 0,
        "no D request reused the shared prefix"
    );
}

#[test]
fn many_concurrent_pairs_equal_colocated_over_tcp() {
    many_concurrent("tcp", "tcp");
}

#[test]
fn many_concurrent_pairs_equal_colocated_over_shm() {
    many_concurrent("shm", "shm");
}

/// D finds every token it needs in its own prefix cache, so it pulls
/// nothing: it tells P to drop the transfer, and P frees the blocks at once
/// rather than when the 30 s lease expires.
#[test]
fn a_transfer_d_does_not_need_is_dropped_at_p_at_once() {
    let p = p_engine(r#","abort_timeout_s":30"#, P_ID);
    let d = d_engine("", "d1");
    // 33 tokens: D's first request loads 2 full blocks and caches them.
    let pr = prompt(77, 33);
    pd(&p.handle, &d.handle, "first", &pr, 2).expect("first request");
    assert_idle(&p.handle, WAIT, "P after the first transfer");
    // The same prompt again: tokens 0..32 are in D's cache, so nothing loads.
    let out = pd(&p.handle, &d.handle, "second", &pr, 2).expect("second request");
    assert_finished(&out, FinishReason::Length, "the second request");
    let t0 = Instant::now();
    assert_idle(
        &p.handle,
        Duration::from_secs(2),
        "P after a transfer D did not pull",
    );
    assert!(t0.elapsed() < Duration::from_secs(2));
    assert_eq!(metric(&d.handle, "drops_unpulled_total"), 1.0);
    assert_eq!(metric(&d.handle, "loads_ok_total"), 1.0);
    assert_eq!(metric(&p.handle, "pulls_ok_total"), 1.0);
    assert_idle(&d.handle, WAIT, "D");
}
