//! A decode engine that cannot admit a request yet claims its transfer from
//! the prefill engine for as long as it waits, so P's lease (here half a
//! second) never expires under it: the KV P computed is loaded, not thrown
//! away and recomputed.

use pdkv_engine::{EngineConfig, FinishReason, PauseMode};

use crate::common::{
    assert_finished, colocated, config, consumer, engine, fingerprint, idle_and_free, metric,
    producer, prompt, remote_prefill, run, start, wait_metric, WAIT,
};

#[test]
fn a_queued_request_keeps_ps_lease_alive_by_claiming_it() {
    let lease = r#","abort_timeout_s":0.5,"load_timeout_s":5"#;
    let p = engine(Some((&producer(lease), "p-claim")), config());
    // One sequence at a time: a request behind another waits in D's queue.
    let one = EngineConfig {
        max_num_seqs: 1,
        ..config()
    };
    let d = engine(Some((&consumer(lease), "d-claim")), one);
    let colo = colocated();
    let (ph, dh) = (&p.handle, &d.handle);

    // P's prefill first (well inside its lease), so that between the hog
    // running and the pause there is only the queued request's admission.
    let tokens = prompt(41, 40);
    let params = remote_prefill(ph, "q-p", &tokens, "q");
    let hog = start(dh, "hog", prompt(40, 8), 1000, None);
    assert!(dh.wait_stats(WAIT, |s| s.num_running == 1).is_some());
    let queued = start(dh, "q-d", tokens.clone(), 6, Some(params));
    // Both frozen where they are: the request stays queued on D.
    // (The hog's thousand tokens take far longer than these two calls.)
    dh.pause(PauseMode::Keep, false, WAIT).unwrap();
    assert!(
        dh.wait_stats(WAIT, |s| s.paused
            && s.num_running == 1
            && s.num_waiting == 1)
            .is_some(),
        "the hog runs and the P/D request waits behind it: {:?}",
        dh.stats()
    );
    // Wait (on P's count, not a clock) for six claims: the first goes out
    // an eighth of a second after D queued the request, then one every
    // third of the lease, so the request has waited well past the lease.
    assert!(
        ph.wait_stats(WAIT, |_| metric(ph, "claims_received_total") >= 6.0)
            .is_some(),
        "D claims the transfer while its request waits"
    );
    assert_eq!(metric(ph, "leases_expired_total"), 0.0);
    assert_eq!(metric(ph, "claimed_leases_expired_total"), 0.0);
    assert_eq!(metric(dh, "claimed_transfers"), 1.0);

    dh.resume().unwrap();
    dh.abort_requests(&["hog".to_string()]);
    drop(hog);
    let out = crate::common::collect(queued);
    assert_finished(&out, FinishReason::Length, "the queued request");
    assert_eq!(
        fingerprint(&out),
        fingerprint(&run(&colo.handle, "c", tokens, 6, None))
    );
    wait_metric(dh, "loads_ok_total", 1.0, "D loaded P's KV");
    assert_eq!(metric(dh, "loads_lease_expired_total"), 0.0);
    assert_eq!(
        metric(dh, "claimed_transfers"),
        0.0,
        "admitted: no more claims"
    );
    assert_eq!(metric(ph, "claimed_leases_expired_total"), 0.0);
    idle_and_free(ph);
    idle_and_free(dh);
}

/// A prefill engine whose every block is held for transfers no D took yet
/// gives some back for a new prompt at once (its lease here is a minute,
/// far longer than the test): the new prompt runs, and the D whose
/// transfer was reclaimed recomputes it and equals a colocated run.
#[test]
fn a_full_prefill_engine_reclaims_held_blocks_for_a_new_prompt() {
    let lease = r#","abort_timeout_s":60,"load_timeout_s":90"#;
    // 12 blocks: four 40-token prompts (3 blocks each) fill it.
    let small = EngineConfig {
        num_kv_blocks: 12,
        ..config()
    };
    let p = engine(Some((&producer(lease), "p-full")), small);
    let d = engine(Some((&consumer(lease), "d-full")), config());
    let colo = colocated();
    let (ph, dh) = (&p.handle, &d.handle);
    let prompts: Vec<Vec<u32>> = (0..5).map(|i| prompt(60 + i, 40)).collect();
    let mut params = Vec::new();
    for (i, pr) in prompts.iter().enumerate() {
        // The fifth needs blocks only reclaiming can give.
        params.push(remote_prefill(ph, &format!("f{i}-p"), pr, &format!("f{i}")));
    }
    assert_eq!(
        metric(ph, "leases_reclaimed_total"),
        1.0,
        "the oldest unclaimed one"
    );
    assert_eq!(metric(ph, "leases_expired_total"), 0.0);
    // Every D request equals a colocated run: four loaded, the reclaimed
    // one (the first) recomputed.
    for (i, (pr, pa)) in prompts.iter().zip(params).enumerate() {
        let out = run(dh, &format!("f{i}-d"), pr.clone(), 4, Some(pa));
        assert_eq!(
            fingerprint(&out),
            fingerprint(&run(&colo.handle, &format!("c{i}"), pr.clone(), 4, None)),
            "prompt {i}"
        );
    }
    wait_metric(dh, "loads_ok_total", 4.0, "D loaded the four P kept");
    assert_eq!(
        metric(dh, "loads_released_total"),
        1.0,
        "and recomputed one"
    );
    idle_and_free(ph);
    idle_and_free(dh);
}
