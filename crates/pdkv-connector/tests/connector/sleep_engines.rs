//! The seeds' bug cannot come back: P/D engines that sleep (level 1 or 2,
//! or release only their KV memory) and
//! wake keep serving exactly the KV their engines compute — never KV from
//! the pages the KV cache had before the sleep — and a sleeping engine holds
//! (almost) no device memory, also while a shared-memory peer had its KV
//! segment mapped. (The start-up gate for connectors that cannot release is
//! tested in pdkv-engine's `tests/connector.rs`.)
//!
//! Sleep swaps the physical pages under the KV cache's fixed addresses. A
//! transfer registration holds its own reference to the pages it covers (as
//! an RDMA memory region does), so without the connector's release before
//! the unmap and restore after the map, P would send D the stale pre-sleep
//! KV (and D would receive into pages its engine no longer reads), while the
//! old pages stayed allocated. Every round here uses fresh prompts and
//! compares D's greedy tokens and logits bits with a colocated engine's.

use std::time::Duration;

use crate::common::{
    assert_idle, assert_matches_colocated, colocated, config, consumer, engine, fingerprint,
    idle_and_free, metric, pd, producer, prompt, remote_prefill, run, WAIT,
};
use pdkv_engine::{EngineConfig, EngineHandle, PauseMode, SleepLevel};
use pdkv_vmem::Tag;

/// How a round takes the KV cache's memory away.
#[derive(Clone, Copy, Debug, PartialEq)]
enum Release {
    /// Sleep level 1 (weights offloaded to host memory).
    Level1,
    /// Sleep level 2 (weights discarded, reloaded after the wake).
    Level2,
    /// `release_kv_cache_memory` (weights stay).
    KvOnly,
}

/// Takes the KV memory of `engines` away as `how` says, checks its pages
/// are free, and brings it back; returns each engine's device bytes
/// (awake, released).
fn sleep_and_wake(
    engines: &[&EngineHandle],
    how: Release,
    checkpoint: &std::path::Path,
) -> Vec<(u64, u64)> {
    let awake: Vec<u64> = engines
        .iter()
        .map(|e| e.pool().device_bytes().total())
        .collect();
    for e in engines {
        match how {
            Release::Level1 => e
                .sleep(SleepLevel::L1, PauseMode::Abort, WAIT)
                .expect("sleep"),
            Release::Level2 => e
                .sleep(SleepLevel::L2, PauseMode::Abort, WAIT)
                .expect("sleep"),
            Release::KvOnly => {
                e.pause(PauseMode::Abort, false, WAIT).expect("pause");
                e.release_kv_cache_memory()
                    .expect("release_kv_cache_memory");
            }
        }
    }
    let asleep: Vec<u64> = engines
        .iter()
        .map(|e| e.pool().device_bytes().total())
        .collect();
    for e in engines {
        assert_eq!(
            e.pool().device_bytes().get(Tag::KvCache),
            0,
            "{how:?}: the KV cache's pages must be free"
        );
        match how {
            // A resume maps the KV cache again and ends the pause.
            Release::KvOnly => e.resume().expect("resume"),
            _ => e.wake_up(None).expect("wake"),
        }
        if how == Release::Level2 {
            e.update_weights(checkpoint, None)
                .expect("reload after a level-2 sleep");
        }
    }
    awake.into_iter().zip(asleep).collect()
}

fn survives_sleep(transport: &str) {
    let t = format!(r#","transport":"{transport}""#);
    let sleepy = EngineConfig {
        enable_sleep_mode: true,
        ..config()
    };
    let p = engine(Some((&producer(&t), "p-sleep")), sleepy.clone());
    let d = engine(Some((&consumer(&t), "d-sleep")), sleepy);
    let colo = colocated();
    let rounds: [(&str, Vec<&EngineHandle>, Release); 6] = [
        ("awake", vec![], Release::Level1),
        ("P", vec![&p.handle], Release::Level1),
        ("D", vec![&d.handle], Release::Level1),
        ("both", vec![&p.handle, &d.handle], Release::Level1),
        ("both, level 2", vec![&p.handle, &d.handle], Release::Level2),
        (
            "both, KV memory only",
            vec![&p.handle, &d.handle],
            Release::KvOnly,
        ),
    ];
    for (r, (name, sleepers, how)) in rounds.iter().enumerate() {
        for (awake, asleep) in sleep_and_wake(sleepers, *how, p.checkpoint()) {
            if *how != Release::KvOnly {
                assert!(
                    asleep * 50 <= awake,
                    "{transport}/{name}: {asleep} bytes asleep of {awake} awake (over 2%)"
                );
            }
        }
        for i in 0..4u64 {
            let pr = prompt(100 * r as u64 + i, 20 + 9 * i as usize);
            let want = fingerprint(&run(
                &colo.handle,
                &format!("c{r}-{i}"),
                pr.clone(),
                5,
                None,
            ));
            let got =
                pd(&p.handle, &d.handle, &format!("t{r}-{i}"), &pr, 5).map(|out| fingerprint(&out));
            assert_eq!(
                got.as_ref(),
                Ok(&want),
                "{transport}: after {name} slept and woke, prompt {i}"
            );
        }
        idle_and_free(&p.handle);
        idle_and_free(&d.handle);
    }
    assert_eq!(metric(&d.handle, "loads_ok_total"), 24.0);
    assert_eq!(metric(&d.handle, "loads_failed_total"), 0.0);
    // Nothing stays pinned: every live chunk belongs to a mapped region.
    assert_eq!(p.handle.pool().pinned_bytes(), 0);
    assert_eq!(d.handle.pool().pinned_bytes(), 0);
}

#[test]
fn pd_outputs_after_sleep_and_wake_equal_colocated_over_tcp() {
    survives_sleep("tcp");
}

#[test]
fn pd_outputs_after_sleep_and_wake_equal_colocated_over_shm() {
    survives_sleep("shm");
}

/// KV that P holds for D was computed with P's weights: a weight reload
/// releases it before writing the new weights, so D's pull is refused
/// (never served KV of the old weights), and P holds nothing afterwards.
#[test]
fn a_weight_reload_on_p_releases_the_kv_held_for_d_first() {
    let sleepy = EngineConfig {
        enable_sleep_mode: true,
        ..config()
    };
    // A lease far longer than the test: only the reload can end the send.
    let lease = r#","abort_timeout_s":300,"load_timeout_s":310"#;
    let p = engine(Some((&producer(lease), "p-reload")), sleepy.clone());
    let d = engine(Some((&consumer(""), "d-reload")), sleepy);
    let pr = prompt(900, 40);
    let params = remote_prefill(&p.handle, "rp", &pr, "t1");
    assert!(
        p.handle
            .wait_stats(WAIT, |s| s.kv_blocks_held > 0)
            .is_some(),
        "P holds the KV for D"
    );

    let new_weights = tempfile::tempdir().unwrap();
    pdkv_model::init::write_random_checkpoint(
        pdkv_model::Arch::Llama,
        "tiny",
        8,
        new_weights.path(),
    )
    .unwrap();
    p.handle
        .update_weights(new_weights.path(), Some("seed-8".into()))
        .unwrap();
    assert_idle(&p.handle, Duration::from_secs(5), "P after the reload");

    // D's pull is refused as released on purpose (never served old-weight
    // KV), and D computes the prompt itself under its default `fail` policy.
    let out = run(&d.handle, "rd", pr.clone(), 3, Some(params));
    let colo = colocated();
    assert_matches_colocated(&colo.handle, &out, &pr, 3, "D after P's reload");
    assert_eq!(metric(&p.handle, "pulls_released_total"), 1.0);
    assert_eq!(
        (
            metric(&d.handle, "loads_released_total"),
            metric(&d.handle, "loads_failed_total")
        ),
        (1.0, 0.0)
    );
    idle_and_free(&d.handle);
}

/// A sleep over a `keep` pause preempts the frozen requests for recompute;
/// they are requests, not transfers, so the release does not wait for them
/// (its bound here is far longer than the sleep's own).
#[test]
fn a_sleep_over_a_keep_pause_does_not_wait_for_frozen_requests() {
    let config = EngineConfig {
        enable_sleep_mode: true,
        kv_release_timeout: Duration::from_secs(120),
        ..config()
    };
    let e = engine(Some((&producer(""), "p-keep")), config);
    // Long (most of the tiny model's 1,024 positions), so it cannot finish
    // between the wait and the pause however the host schedules this thread
    // (150 tokens once ended before a loaded host woke the waiter).
    let stream = crate::common::start(&e.handle, "long", prompt(5, 30), 900, None);
    assert!(
        e.handle.wait_stats(WAIT, |s| s.num_running == 1).is_some(),
        "the long request runs"
    );
    e.handle
        .pause(PauseMode::Keep, false, WAIT)
        .expect("keep pause");
    assert_eq!(
        e.handle.stats().num_running,
        1,
        "the request is frozen running"
    );
    e.handle
        .sleep(SleepLevel::L1, PauseMode::Keep, Duration::from_secs(20))
        .expect("sleep over the keep pause");
    e.handle.wake_up(None).expect("wake");
    e.handle.resume().expect("resume");
    crate::common::assert_finished(
        &crate::common::collect(stream),
        pdkv_engine::FinishReason::Length,
        "the frozen request",
    );
    idle_and_free(&e.handle);
}
