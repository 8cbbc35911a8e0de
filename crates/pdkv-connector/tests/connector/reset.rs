//! A prefix-cache reset while a P/D pair works: `reset_running_requests`
//! preempts the running requests (they recompute and go on exactly) and the
//! reset succeeds although transfers still hold blocks; those transfers are
//! not cut, and no block cached before the reset is matched after it. The
//! running requests are frozen by a keep-pause around the resets, as a
//! trainer does, so that they hold their blocks whatever the machine's
//! speed (a fast decode could otherwise finish one first).

use pdkv_engine::PauseMode;

use crate::common::{
    collect, colocated, d_engine, fingerprint, idle_and_free, last, metric, p_engine, prompt,
    remote_prefill, run, start, WAIT,
};

/// Tokens of the long requests: most of the tiny model's 1,024 positions.
const LONG: u32 = 900;

#[test]
fn a_reset_with_running_requests_succeeds_under_load_and_loses_nothing() {
    let p = p_engine("", "p-reset");
    let d = d_engine("", "d-reset");
    let colo = colocated();
    let (ph, dh) = (&p.handle, &d.handle);

    // P holds the KV of a prompt no D has pulled yet.
    let held = prompt(31, 40);
    let params = remote_prefill(ph, "held-p", &held, "held");
    assert!(
        ph.wait_stats(WAIT, |s| s.kv_blocks_held > 0).is_some(),
        "P holds the transfer's blocks"
    );
    // A prompt in P's prefix cache before the reset.
    let cached = prompt(32, 48);
    run(ph, "cache-1", cached.clone(), 1, None);
    assert_eq!(
        last(&run(ph, "cache-2", cached.clone(), 1, None)).num_cached_tokens,
        32,
        "the prompt's full blocks are cached before the reset"
    );

    // A long request runs on each engine in turn (started just before its
    // engine's resets, and long: it cannot finish between the wait and the
    // pause).
    let long = prompt(33, 20);
    let mut streams = Vec::new();
    for (e, name) in [(ph, "P"), (dh, "D")] {
        streams.push(start(e, &format!("long-{name}"), long.clone(), LONG, None));
        assert!(
            e.wait_stats(WAIT, |s| s.num_running == 1).is_some(),
            "{name}: the long request runs"
        );
        // Frozen where it is (a trainer's keep-pause before it resets):
        // the request holds its blocks however fast the engine decodes.
        e.pause(PauseMode::Keep, false, WAIT).unwrap();
        assert!(
            !e.reset_prefix_cache_with(false, false),
            "{name}: without reset_running_requests a reset refuses while blocks are in use"
        );
        assert!(
            e.reset_prefix_cache_with(true, false),
            "{name}: with reset_running_requests the reset succeeds with a request running"
        );
        e.resume().unwrap();
    }
    let [on_p, on_d]: [_; 2] = streams.try_into().ok().expect("two streams");
    for (e, name) in [(ph, "P"), (dh, "D")] {
        assert!(
            e.wait_stats(WAIT, |s| s.num_preemptions == 1).is_some(),
            "{name}: the running request was preempted"
        );
    }

    // The preempted requests go on exactly.
    let want = fingerprint(&run(&colo.handle, "long-c", long, LONG, None));
    assert_eq!(fingerprint(&collect(on_p)), want, "P's preempted request");
    assert_eq!(fingerprint(&collect(on_d)), want, "D's preempted request");

    // The held transfer was not cut: D loads it and equals a colocated run.
    let loads_before = metric(dh, "loads_ok_total");
    let dout = run(dh, "held-d", held.clone(), 8, Some(params));
    assert_eq!(
        fingerprint(&dout),
        fingerprint(&run(&colo.handle, "held-c", held, 8, None))
    );
    assert_eq!(metric(dh, "loads_ok_total"), loads_before + 1.0);

    // Nothing cached before the reset is matched after it.
    assert_eq!(
        last(&run(ph, "cache-3", cached, 1, None)).num_cached_tokens,
        0,
        "no prefix-cache hit on a block cached before the reset"
    );
    idle_and_free(ph);
    idle_and_free(dh);
}
