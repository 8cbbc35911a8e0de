//! The scheduler's side of the KV connector protocol, driven step by step
//! with a scripted connector: loads park requests holding their blocks,
//! finished loads resume with the loaded tokens computed, failed loads fail
//! or recompute by policy, and blocks a transfer holds are freed only when
//! the connector says so. Invariants are checked after every call.

use std::collections::HashSet;
use std::sync::{Arc, Mutex};

use pdkv_engine::connector::{
    Allocated, ConnectorMeta, ConnectorRequest, Ended, ExternalMatch, FinishedTransfers,
    KvCacheSpec, KvConnector, LoadFailurePolicy, Waker,
};
use pdkv_engine::scheduler::{NewRequest, Scheduler, SchedulerConfig, SchedulerOutput};
use pdkv_engine::FinishReason;

/// What the test tells the connector, and what the connector saw.
#[derive(Default)]
struct Script {
    policy: LoadFailurePolicy,
    /// Requests whose KV (all but the last prompt token) arrives remotely.
    remote: HashSet<String>,
    /// Requests whose blocks the connector keeps after they finish.
    hold_on_finish: HashSet<String>,
    /// Seen: (request, blocks, first computed token, external tokens).
    allocs: Vec<(String, Vec<u32>, usize, usize)>,
    /// Loads in flight (request ids), as `request_finished` must know.
    loading: HashSet<String>,
    finished: FinishedTransfers,
    errors: Vec<(u32, pdkv_engine::LoadError)>,
    /// `request_finished` calls: (request, reason, blocks).
    ended: Vec<(String, FinishReason, Vec<u32>)>,
    /// `abort_transfers` calls.
    aborts: usize,
    /// Says it can release and restore its registrations (sleep mode).
    sleep_mode: bool,
    /// What `release_kv_caches` answers while set (else `Ok`).
    release_error: Option<String>,
    /// What `restore_kv_caches` answers while set (else `Ok`).
    restore_error: Option<String>,
    /// `release_kv_caches` / `restore_kv_caches` calls, failed ones included.
    releases: usize,
    restores: usize,
    /// The engine's waker, once it gave it.
    waker: Option<Waker>,
}

#[derive(Clone, Default)]
struct Scripted(Arc<Mutex<Script>>, Arc<std::sync::Condvar>);

impl KvConnector for Scripted {
    fn name(&self) -> &str {
        "scripted"
    }
    fn supports_sleep_mode(&self) -> bool {
        self.0.lock().unwrap().sleep_mode
    }
    fn info(&self) -> serde_json::Value {
        serde_json::json!({})
    }
    fn set_waker(&mut self, waker: Waker) {
        self.0.lock().unwrap().waker = Some(waker);
    }
    fn load_failure_policy(&self) -> LoadFailurePolicy {
        self.0.lock().unwrap().policy
    }
    fn get_num_new_matched_tokens(
        &mut self,
        req: ConnectorRequest<'_>,
        num_computed: usize,
    ) -> ExternalMatch {
        if self.0.lock().unwrap().remote.contains(&**req.id) {
            ExternalMatch {
                num_tokens: req.prompt_tokens.len() - 1 - num_computed,
                load_async: true,
            }
        } else {
            ExternalMatch::default()
        }
    }
    fn update_state_after_alloc(&mut self, req: ConnectorRequest<'_>, a: Allocated<'_>) {
        let mut s = self.0.lock().unwrap();
        s.allocs.push((
            req.id.to_string(),
            a.block_ids.to_vec(),
            a.num_computed_tokens,
            a.num_external_tokens,
        ));
        s.loading.insert(req.id.to_string());
    }
    fn build_connector_meta(&mut self) -> ConnectorMeta {
        ConnectorMeta::empty()
    }
    fn request_finished(
        &mut self,
        req: ConnectorRequest<'_>,
        end: Ended<'_>,
    ) -> (bool, Option<serde_json::Value>) {
        let Ended {
            block_ids: blocks,
            reason,
        } = end;
        let mut s = self.0.lock().unwrap();
        s.ended.push((req.id.to_string(), reason, blocks.to_vec()));
        let delay = s.loading.contains(&**req.id) || s.hold_on_finish.contains(&**req.id);
        (
            delay,
            delay.then(|| serde_json::json!({"held": req.id.to_string()})),
        )
    }
    fn abort_transfers(&mut self) {
        self.0.lock().unwrap().aborts += 1;
        self.1.notify_all();
    }
    fn register_kv_caches(&mut self, _spec: &KvCacheSpec) -> anyhow::Result<()> {
        Ok(())
    }
    fn start_load_kv(&mut self, _meta: ConnectorMeta) {}
    fn get_finished(&mut self) -> FinishedTransfers {
        std::mem::take(&mut self.0.lock().unwrap().finished)
    }
    fn get_block_ids_with_load_errors(&mut self) -> Vec<(u32, pdkv_engine::LoadError)> {
        std::mem::take(&mut self.0.lock().unwrap().errors)
    }
    fn release_kv_caches(&mut self, _timeout: std::time::Duration) -> anyhow::Result<()> {
        let mut s = self.0.lock().unwrap();
        s.releases += 1;
        match &s.release_error {
            Some(e) => anyhow::bail!("{e}"),
            None => Ok(()),
        }
    }
    fn restore_kv_caches(&mut self) -> anyhow::Result<()> {
        let mut s = self.0.lock().unwrap();
        s.restores += 1;
        match &s.restore_error {
            Some(e) => anyhow::bail!("{e}"),
            None => Ok(()),
        }
    }
}

impl Scripted {
    /// A connector whose `id` loads its KV remotely.
    fn remote(id: &str) -> Scripted {
        let conn = Scripted::default();
        conn.0.lock().unwrap().remote.insert(id.into());
        conn
    }

    /// A connector that keeps the blocks of `id` after it finishes.
    fn holding(id: &str) -> Scripted {
        let conn = Scripted::default();
        conn.0.lock().unwrap().hold_on_finish.insert(id.into());
        conn
    }

    fn load_done(&self, id: &str, error: Option<&str>) {
        let mut s = self.0.lock().unwrap();
        assert!(s.loading.remove(id), "{id} was not loading");
        if let Some(e) = error {
            let blocks = s
                .allocs
                .iter()
                .rev()
                .find(|a| a.0 == id)
                .expect("allocated")
                .1
                .clone();
            s.errors.extend(
                blocks
                    .into_iter()
                    .map(|b| (b, pdkv_engine::LoadError::failed(e.to_string()))),
            );
        }
        s.finished.recving.push(Arc::from(id));
    }
    fn send_done(&self, id: &str) {
        self.0.lock().unwrap().finished.sending.push(Arc::from(id));
    }

    /// [`Scripted::send_done`], then wakes the engine as a real connector
    /// does when a transfer ended.
    fn send_done_and_wake(&self, id: &str) {
        self.send_done(id);
        let waker = self
            .0
            .lock()
            .unwrap()
            .waker
            .clone()
            .expect("the engine gave its waker");
        waker();
    }

    /// Waits (bounded) until the script satisfies `pred`; panics naming
    /// `what` otherwise.
    fn wait_for(&self, what: &str, pred: impl Fn(&Script) -> bool) {
        let s = self.0.lock().unwrap();
        let (_s, timeout) = self
            .1
            .wait_timeout_while(s, crate::common::WAIT, |s| !pred(s))
            .unwrap();
        assert!(
            !timeout.timed_out(),
            "{what}: not within {:?}",
            crate::common::WAIT
        );
    }
}

const NUM_BLOCKS: usize = 32;

fn sched(conn: &Scripted) -> Scheduler {
    let cfg = SchedulerConfig {
        max_num_seqs: 8,
        max_num_batched_tokens: 256,
        num_blocks: NUM_BLOCKS,
        enable_prefix_caching: true,
        speculative: None,
    };
    Scheduler::with_connector(cfg, Box::new(conn.clone()))
}

fn req(id: &str, prompt: Vec<u32>, max_tokens: usize) -> NewRequest {
    crate::common::new_request(id, prompt, max_tokens, vec![])
}

/// Steps until the scheduler has no work left.
fn run_out(s: &mut Scheduler) {
    while s.has_work() {
        step(s);
    }
}

/// Runs one step with token 7 sampled everywhere; checks invariants.
fn step(s: &mut Scheduler) -> SchedulerOutput {
    let out = s.schedule();
    let sampled: Vec<Option<u32>> = out.seqs.iter().map(|q| q.sample.then_some(7)).collect();
    s.update_from_output(&out, &sampled);
    s.check_invariants();
    out
}

fn prompt(n: usize, salt: u32) -> Vec<u32> {
    (0..n as u32).map(|i| 100 + salt * 1000 + i).collect()
}

#[test]
fn a_remote_load_parks_the_request_then_only_the_last_token_is_computed() {
    let conn = Scripted::remote("d");
    let mut s = sched(&conn);
    s.add_request(req("d", prompt(40, 1), 3));
    s.add_request(req("local", prompt(20, 2), 2));
    let out = step(&mut s);
    // Only the local request ran; `d` waits for its KV holding 3 blocks.
    assert_eq!(
        out.seqs.iter().map(|q| &*q.request_id).collect::<Vec<_>>(),
        ["local"]
    );
    let c = s.counts();
    assert_eq!(c.num_waiting_for_remote_kv, 1);
    let allocs = conn.0.lock().unwrap().allocs.clone();
    assert_eq!(allocs.len(), 1);
    assert_eq!((allocs[0].2, allocs[0].3, allocs[0].1.len()), (0, 39, 3));
    // Nothing happens to `d` until the load ends.
    for _ in 0..3 {
        let out = step(&mut s);
        assert!(out.seqs.iter().all(|q| &*q.request_id != "d"));
    }
    conn.load_done("d", None);
    assert!(s.update_from_connector().is_empty());
    s.check_invariants();
    let out = step(&mut s);
    let q = out
        .seqs
        .iter()
        .find(|q| &*q.request_id == "d")
        .expect("d runs after its load");
    assert_eq!((q.start_pos, q.tokens.len(), q.sample), (39, 1, true));
    assert_eq!(q.block_table, allocs[0].1);
    run_out(&mut s);
    assert_eq!(s.counts().num_free_blocks, NUM_BLOCKS);
}

#[test]
fn a_local_prefix_hit_shrinks_the_remote_load() {
    let conn = Scripted::default();
    let mut s = sched(&conn);
    let p = prompt(50, 3);
    s.add_request(req("warm", p[..40].to_vec(), 1));
    run_out(&mut s);
    conn.0.lock().unwrap().remote.insert("d".into());
    s.add_request(req("d", p.clone(), 2));
    step(&mut s);
    let allocs = conn.0.lock().unwrap().allocs.clone();
    // Two full blocks (32 tokens) hit locally; tokens 32..49 come from remote.
    assert_eq!((allocs[0].2, allocs[0].3), (32, 17));
    conn.load_done("d", None);
    s.update_from_connector();
    let out = step(&mut s);
    assert_eq!(out.seqs[0].start_pos, 49);
    run_out(&mut s);
    assert_eq!(s.counts().num_free_blocks, NUM_BLOCKS);
}

#[test]
fn a_failed_load_recomputes_or_fails_by_policy() {
    for policy in [LoadFailurePolicy::Recompute, LoadFailurePolicy::Fail] {
        let conn = Scripted::remote("d");
        conn.0.lock().unwrap().policy = policy;
        let mut s = sched(&conn);
        s.add_request(req("d", prompt(40, 4), 2));
        step(&mut s);
        conn.load_done("d", Some("peer went away"));
        let failed = s.update_from_connector();
        s.check_invariants();
        match policy {
            LoadFailurePolicy::Fail => {
                assert_eq!(failed.len(), 1);
                assert_eq!(&*failed[0].request_id, "d");
                assert_eq!(failed[0].error, "peer went away");
                assert!(!s.has_work());
                let ended = conn.0.lock().unwrap().ended.clone();
                assert_eq!(ended.last().map(|e| e.1), Some(FinishReason::Error));
            }
            LoadFailurePolicy::Recompute => {
                assert!(failed.is_empty());
                let out = step(&mut s);
                // Every prompt token is computed here, from the start.
                assert_eq!((out.seqs[0].start_pos, out.seqs[0].tokens.len()), (0, 40));
                run_out(&mut s);
            }
        }
        assert_eq!(s.counts().num_free_blocks, NUM_BLOCKS, "{policy:?}");
    }
}

#[test]
fn blocks_of_an_aborted_load_stay_held_until_the_load_ends() {
    let conn = Scripted::remote("d");
    let mut s = sched(&conn);
    s.add_request(req("d", prompt(40, 5), 2));
    step(&mut s);
    assert!(s.abort_request("d"));
    s.check_invariants();
    // The connector still writes the blocks: they are neither free nor
    // anyone's, and a new request cannot get them.
    assert_eq!(s.counts().num_held_blocks, 3);
    assert_eq!(s.counts().num_free_blocks, NUM_BLOCKS - 3);
    assert!(s.is_held("d"));
    conn.load_done("d", None);
    s.update_from_connector();
    s.check_invariants();
    assert_eq!(s.counts().num_held_blocks, 0);
    assert_eq!(s.counts().num_free_blocks, NUM_BLOCKS);
}

#[test]
fn a_finished_producer_request_holds_its_blocks_until_sent() {
    let conn = Scripted::holding("p");
    let mut s = sched(&conn);
    s.add_request(req("p", prompt(40, 6), 1));
    let out = s.schedule();
    let updates = s.update_from_output(&out, &[Some(7)]);
    s.check_invariants();
    assert_eq!(updates[0].finished, Some(FinishReason::Length));
    assert_eq!(
        updates[0].kv_transfer_params,
        Some(serde_json::json!({"held": "p"}))
    );
    assert!(!s.has_work());
    assert_eq!(s.counts().num_held_blocks, 3);
    // Held blocks are out of reach: no one else's table gets them.
    let held: HashSet<u32> = conn.0.lock().unwrap().ended[0].2.iter().copied().collect();
    s.add_request(req("big", prompt(NUM_BLOCKS * 16 - 3 * 16, 7), 1));
    while s.has_work() {
        let out = step(&mut s);
        assert!(out
            .seqs
            .iter()
            .all(|q| q.block_table.iter().all(|b| !held.contains(b))));
    }
    assert_eq!(s.counts().num_free_blocks, NUM_BLOCKS - 3);
    conn.send_done("p");
    s.update_from_connector();
    s.check_invariants();
    assert_eq!(s.counts().num_held_blocks, 0);
    assert_eq!(s.counts().num_free_blocks, NUM_BLOCKS);
}

#[test]
fn a_cache_reset_cuts_loads_short_and_they_recompute_under_either_policy() {
    for policy in [LoadFailurePolicy::Fail, LoadFailurePolicy::Recompute] {
        let conn = Scripted::default();
        {
            let mut s = conn.0.lock().unwrap();
            s.policy = policy;
            s.remote
                .extend(["loading".to_string(), "landed".to_string()]);
            s.hold_on_finish.insert("p".into());
        }
        let mut s = sched(&conn);
        // A finished producer request whose KV waits for its reader.
        s.add_request(req("p", prompt(40, 8), 1));
        step(&mut s);
        s.add_request(req("landed", prompt(40, 9), 2));
        s.add_request(req("loading", prompt(40, 10), 2));
        step(&mut s);
        // `landed`'s KV arrives but it is not scheduled before the reset.
        conn.load_done("landed", None);
        s.update_from_connector();
        s.check_invariants();
        assert!(s.has_transfers());
        assert!(
            !s.reset_prefix_cache(),
            "transfers hold blocks: the reset must refuse"
        );

        assert_eq!(s.release_transfer_kv(), 1);
        s.check_invariants();
        assert_eq!(conn.0.lock().unwrap().aborts, 1);
        assert_eq!(s.counts().num_waiting_for_remote_kv, 0);
        // The transfers still hold the producer's and the cut load's blocks.
        assert_eq!(s.counts().num_held_blocks, 6);
        // The cut load ends (even as an error) and the send ends.
        conn.load_done("loading", Some("load cut short by a cache reset"));
        conn.send_done("p");
        assert!(
            s.update_from_connector().is_empty(),
            "{policy:?}: a cut load is never failed"
        );
        s.check_invariants();
        assert!(!s.has_transfers());
        assert!(s.reset_prefix_cache());
        // Both recompute their whole prompts.
        let out = step(&mut s);
        let starts: Vec<(String, usize, usize)> = out
            .seqs
            .iter()
            .map(|q| (q.request_id.to_string(), q.start_pos, q.tokens.len()))
            .collect();
        assert!(
            starts.contains(&("loading".to_string(), 0, 40)),
            "{starts:?}"
        );
        assert!(
            starts.contains(&("landed".to_string(), 0, 40)),
            "{starts:?}"
        );
        run_out(&mut s);
        assert_eq!(s.counts().num_free_blocks, NUM_BLOCKS);
    }
}

#[test]
fn sleep_mode_refuses_a_connector_that_cannot_release_and_gates_sleep_without_it() {
    use pdkv_engine::{Engine, EngineConfig, LifecycleError, PauseMode, SleepLevel};
    let dir = tempfile::tempdir().unwrap();
    pdkv_model::init::write_random_checkpoint(pdkv_model::Arch::Llama, "tiny", 7, dir.path())
        .unwrap();
    let load = || {
        let pool = pdkv_vmem::Pool::default();
        let model = pdkv_model::load_model(dir.path(), &pool, &mut |_| {}).unwrap();
        (model, pool)
    };
    // `Scripted` says it cannot release its registrations.
    let (model, pool) = load();
    let config = EngineConfig {
        enable_sleep_mode: true,
        ..EngineConfig::default()
    };
    let err =
        Engine::start_with_connector(model, pool, config, Some(Box::new(Scripted::default())))
            .err()
            .expect("refused");
    assert!(
        err.to_string().contains("scripted") && err.to_string().contains("sleep"),
        "{err}"
    );
    // Without sleep mode it starts, and refuses to release KV memory.
    let (model, pool) = load();
    let e = Engine::start_with_connector(
        model,
        pool,
        EngineConfig::default(),
        Some(Box::new(Scripted::default())),
    )
    .unwrap();
    let r = e.sleep(
        SleepLevel::L1,
        PauseMode::Abort,
        std::time::Duration::from_secs(10),
    );
    assert!(
        matches!(r, Err(LifecycleError::Conflict(ref m)) if m.contains("--enable-sleep-mode")),
        "{r:?}"
    );
    assert!(e.lifecycle_status().sleeping.is_none());
    e.shutdown();
}

/// The KV cache is memfd chunks (a registration can pin and export them)
/// only where a connector may register it; without one it is private
/// memory, and either way a sleep frees it and a wake brings it back at
/// the same address with the same outputs.
#[test]
fn the_kv_cache_is_shared_memory_only_with_a_connector() {
    use pdkv_engine::{EngineConfig, PauseMode, SleepLevel};
    use pdkv_model::Arch;
    use pdkv_vmem::{Backing, Tag};
    let kv_region = |e: &pdkv_engine::EngineHandle| {
        let kv: Vec<_> = e
            .pool()
            .regions()
            .into_iter()
            .filter(|r| r.tag() == Tag::KvCache)
            .collect();
        assert_eq!(kv.len(), 1, "one KV cache region");
        (kv[0].backing(), kv[0].base() as usize)
    };
    let e = crate::common::start_with_connector(
        Arch::Llama,
        EngineConfig::default(),
        Some(Box::new(Scripted::default())),
    );
    assert_eq!(kv_region(&e).0, Backing::Shared);
    drop(e);

    let config = EngineConfig {
        enable_sleep_mode: true,
        ..EngineConfig::default()
    };
    let e = crate::common::start_with_connector(Arch::Llama, config, None);
    let (backing, base) = kv_region(&e);
    assert_eq!(backing, Backing::Private);
    let want = probe(&e, "awake");
    let kv = device_bytes(&e, Tag::KvCache);
    assert!(kv > 0);
    e.sleep(
        SleepLevel::L1,
        PauseMode::Abort,
        std::time::Duration::from_secs(10),
    )
    .unwrap();
    assert_eq!(
        device_bytes(&e, Tag::KvCache),
        0,
        "asleep, the KV cache is freed"
    );
    e.wake_up(None).unwrap();
    assert_eq!(device_bytes(&e, Tag::KvCache), kv);
    assert_eq!(kv_region(&e), (Backing::Private, base));
    assert_eq!(probe(&e, "after-wake"), want);
}

/// A weight reload first releases the KV that transfers hold (it was
/// computed with the old weights) and waits, bounded, until the connector
/// gave every block back; only then are the weights written.
#[test]
fn a_weight_reload_waits_for_transfers_to_give_their_blocks_back() {
    use pdkv_engine::EngineConfig;
    use std::time::Duration;
    let conn = Scripted::holding("held");
    let e = crate::common::start_with_connector(
        pdkv_model::Arch::Llama,
        EngineConfig::default(),
        Some(Box::new(conn.clone())),
    );
    // From the start (before the core's first publication too) the stats
    // show every block free.
    let (total, s) = (e.config().num_kv_blocks, e.stats());
    assert_eq!((s.kv_blocks_total, s.kv_blocks_free), (total, total));
    crate::common::run_to_length(&e, "held", 3, 40, 1);

    std::thread::scope(|s| {
        let reload = s.spawn(|| e.update_weights(e.checkpoint(), Some("again".into())));
        // The reload asked the connector to stop holding KV...
        crate::common::wait_until("the reload never released the transfers", || {
            conn.0.lock().unwrap().aborts != 0
        });
        // ...and waits while the blocks are still held.
        assert!(
            !reload.is_finished(),
            "the reload went on while a transfer held blocks"
        );
        conn.send_done("held");
        reload
            .join()
            .unwrap()
            .expect("the reload succeeds once the blocks came back");
    });
    assert_eq!(e.weight_info().version.as_deref(), Some("again"));
    let counted = e.wait_stats(Duration::from_secs(30), |s| {
        s.lifecycle.num_weight_updates == 1
    });
    assert!(
        counted.is_some(),
        "one weight update counted: {:?}",
        e.stats()
    );
}

// ---- lifecycle operations whose connector calls fail, or wait ----

/// A sleep-mode engine on the tiny checkpoint with `conn`, which says it
/// can release and restore its registrations.
fn sleepy(conn: &Scripted, config: pdkv_engine::EngineConfig) -> crate::common::TestEngine {
    conn.0.lock().unwrap().sleep_mode = true;
    let config = pdkv_engine::EngineConfig {
        enable_sleep_mode: true,
        ..config
    };
    crate::common::start_with_connector(
        pdkv_model::Arch::Llama,
        config,
        Some(Box::new(conn.clone())),
    )
}

/// The tokens and logits bits of the greedy reference request.
fn probe(e: &pdkv_engine::EngineHandle, id: &str) -> (Vec<u32>, Vec<Vec<u32>>) {
    let out = crate::common::run_to_length(e, id, 5, 40, 4);
    (out.tokens.clone(), out.logit_bits())
}

/// Live device bytes of `tag`.
fn device_bytes(e: &pdkv_engine::EngineHandle, tag: pdkv_vmem::Tag) -> u64 {
    e.pool().device_bytes().get(tag)
}

/// The connector refuses to release its registrations (say, a transfer
/// still in flight): `sleep(1)` and `release_kv_cache_memory` fail with
/// what the connector said and leave the engine as it was — awake, its
/// memory mapped, its keep pause in place — and a retry once the connector
/// can release succeeds. Catches the old behaviour, in which the failed
/// release was only logged and the sleep went on to unmap the KV cache
/// under a registration that still pinned (and exposed) its pages.
#[test]
fn a_failed_registration_release_fails_sleep_and_kv_release_and_changes_nothing() {
    use pdkv_engine::{LifecycleError, PauseMode, SleepLevel};
    use pdkv_vmem::Tag;
    use std::time::Duration;
    const REFUSAL: &str = "1 loads writing into them (scripted refusal)";
    let conn = Scripted::default();
    let e = sleepy(&conn, pdkv_engine::EngineConfig::default());
    let want = probe(&e, "before");
    let (kv, weights) = (
        device_bytes(&e, Tag::KvCache),
        device_bytes(&e, Tag::Weights),
    );
    assert!(kv > 0 && weights > 0);

    conn.0.lock().unwrap().release_error = Some(REFUSAL.into());
    e.pause(PauseMode::Keep, false, Duration::from_secs(10))
        .unwrap();
    for (i, what) in ["sleep(1)", "release_kv_cache_memory"]
        .into_iter()
        .enumerate()
    {
        let r = match what {
            "sleep(1)" => e.sleep(SleepLevel::L1, PauseMode::Keep, Duration::from_secs(10)),
            _ => e.release_kv_cache_memory(),
        };
        let err = r.expect_err("the connector refused to release");
        assert!(
            matches!(err, LifecycleError::Conflict(_)),
            "{what}: {err:?}"
        );
        assert!(
            err.to_string().contains(REFUSAL),
            "{what} does not say what the connector said: {err}"
        );
        assert_eq!(
            conn.0.lock().unwrap().releases,
            i + 1,
            "{what} asked the connector once"
        );
        let st = e.lifecycle_status();
        assert_eq!(
            (st.sleeping, st.asleep_tags.clone(), st.paused),
            (None, vec![], Some(PauseMode::Keep)),
            "{what}"
        );
        assert_eq!(e.stats().sleep_level, None, "{what}");
        assert_eq!(
            (
                device_bytes(&e, Tag::KvCache),
                device_bytes(&e, Tag::Weights)
            ),
            (kv, weights),
            "{what}: memory"
        );
    }
    // Still the same engine: it serves once resumed...
    e.resume().unwrap();
    assert_eq!(probe(&e, "after-refusals"), want);

    // ...and, once the connector can release, both operations work.
    conn.0.lock().unwrap().release_error = None;
    e.pause(PauseMode::Keep, false, Duration::from_secs(10))
        .unwrap();
    e.sleep(SleepLevel::L1, PauseMode::Keep, Duration::from_secs(10))
        .expect("the retried sleep");
    assert_eq!(e.lifecycle_status().sleeping, Some(SleepLevel::L1));
    assert_eq!(
        (
            device_bytes(&e, Tag::KvCache),
            device_bytes(&e, Tag::Weights)
        ),
        (0, 0),
        "asleep"
    );
    e.wake_up(None).unwrap();
    e.resume().unwrap();
    assert_eq!(probe(&e, "after-sleep"), want);
    e.pause(PauseMode::Keep, false, Duration::from_secs(10))
        .unwrap();
    e.release_kv_cache_memory().expect("the retried release");
    assert_eq!(device_bytes(&e, Tag::KvCache), 0);
    e.resume().unwrap();
    assert_eq!(device_bytes(&e, Tag::KvCache), kv);
    assert_eq!(probe(&e, "after-release"), want);
    let s = conn.0.lock().unwrap();
    // Each of the two refused releases was followed by a restore (the
    // engine stays awake, so the connector must hold its registrations:
    // idempotent for one that rolled back itself), then one per wake.
    assert_eq!((s.releases, s.restores), (4, 4));
}

/// A sleep that first waits for a transfer to give its blocks back, and then
/// finds the connector unable to release its registrations, fails and
/// leaves the engine as it was before the sleep was asked for: awake and
/// *not paused* (the sleep's own pause goes with it), so it serves at once
/// and a retry succeeds. Catches the old behaviour, in which the failure
/// restored the state the sleep had waited in, so the engine stayed paused
/// with nobody left to resume it.
#[test]
fn a_sleep_that_waited_for_transfers_and_then_failed_leaves_no_pause_behind() {
    use pdkv_engine::{LifecycleError, PauseMode, SleepLevel};
    use std::time::Duration;
    const REFUSAL: &str = "a peer did not acknowledge its unmap (scripted refusal)";
    let conn = Scripted::holding("held");
    let e = sleepy(&conn, pdkv_engine::EngineConfig::default());
    crate::common::run_to_length(&e, "held", 3, 40, 1);
    conn.0.lock().unwrap().release_error = Some(REFUSAL.into());

    std::thread::scope(|s| {
        let sleep = s.spawn(|| e.sleep(SleepLevel::L1, PauseMode::Keep, Duration::from_secs(30)));
        // The sleep waits (paused) while the transfer holds its blocks...
        crate::common::wait_until("the sleep never paused the engine", || {
            e.lifecycle_status().paused.is_some()
        });
        assert!(
            !sleep.is_finished(),
            "the sleep went on while a transfer held blocks"
        );
        // ...then the blocks come back and the release is refused.
        conn.send_done_and_wake("held");
        let err = sleep
            .join()
            .unwrap()
            .expect_err("the connector refused to release");
        assert!(
            matches!(err, LifecycleError::Conflict(ref m) if m.contains(REFUSAL)),
            "{err:?}"
        );
    });
    let st = e.lifecycle_status();
    assert_eq!(
        (st.sleeping, st.asleep_tags.clone(), st.paused),
        (None, vec![], None),
        "{st:?}"
    );
    // It serves without a resume, and the retried sleep works.
    crate::common::run_to_length(&e, "after", 5, 40, 2);
    conn.0.lock().unwrap().release_error = None;
    e.sleep(SleepLevel::L1, PauseMode::Keep, Duration::from_secs(10))
        .expect("the retried sleep");
    assert_eq!(e.lifecycle_status().sleeping, Some(SleepLevel::L1));
    e.wake_up(None).unwrap();
    e.resume().unwrap();
    crate::common::run_to_length(&e, "woken", 5, 40, 2);
}

/// The connector cannot register the KV cache again after it was mapped:
/// `wake_up` fails, the lifecycle still shows the KV cache asleep (no step
/// may run on a KV cache no transfer can reach at its new epoch), and a
/// second `wake_up` calls `restore_kv_caches` again and, once it succeeds,
/// serves. Catches the old behaviour, in which the failed wake left the
/// machine saying "awake", so the second wake changed nothing and never
/// retried the restore.
#[test]
fn a_failed_registration_restore_fails_the_wake_and_the_next_wake_retries_it() {
    use pdkv_engine::{PauseMode, SleepLevel};
    use pdkv_vmem::Tag;
    use std::time::Duration;
    const REFUSAL: &str = "the transfer agent is gone (scripted refusal)";
    let conn = Scripted::default();
    let e = sleepy(&conn, pdkv_engine::EngineConfig::default());
    let want = probe(&e, "before");
    e.sleep(SleepLevel::L1, PauseMode::Keep, Duration::from_secs(10))
        .unwrap();

    conn.0.lock().unwrap().restore_error = Some(REFUSAL.into());
    let err = e
        .wake_up(None)
        .expect_err("the connector could not restore");
    assert!(
        err.to_string().contains(REFUSAL),
        "the wake does not say what the connector said: {err}"
    );
    assert_eq!(conn.0.lock().unwrap().restores, 1);
    let st = e.lifecycle_status();
    assert_eq!(st.sleeping, Some(SleepLevel::L1), "{st:?}");
    assert!(
        st.asleep_tags.contains(&Tag::KvCache),
        "the KV cache counts as asleep: {st:?}"
    );
    assert_eq!(e.stats().sleep_level, Some(1));
    let refused = e.add_request(crate::common::request(
        "while-asleep",
        crate::common::prompt(5, 40),
        crate::common::greedy(4),
    ));
    assert!(
        matches!(refused, Err(pdkv_engine::AddRequestError::Unavailable(_))),
        "{:?}",
        refused.err()
    );

    conn.0.lock().unwrap().restore_error = None;
    e.wake_up(None)
        .expect("the second wake restores the registrations");
    assert_eq!(
        conn.0.lock().unwrap().restores,
        2,
        "the second wake called restore again"
    );
    let st = e.lifecycle_status();
    assert_eq!(
        (st.sleeping, st.asleep_tags, st.paused),
        (None, vec![], None)
    );
    assert!(device_bytes(&e, Tag::KvCache) > 0);
    assert_eq!(probe(&e, "after-wake"), want);
}

/// A weight update that waits for transfers to give their blocks back
/// waits inside the lifecycle machine: the core goes on answering other
/// commands meanwhile (it aborts a request, reports status, refuses new
/// requests), and a `resume` cancels the update, which then returns
/// `Cancelled` without touching the weights (the version is unchanged and
/// outputs are those of the old weights although the checkpoint asked for
/// differs). Catches the old behaviour, in which the update parked the
/// core thread with every other command left in its channel until the
/// transfers ended or the release timeout passed, so the resume could not
/// cancel it.
#[test]
fn a_weight_update_waiting_for_transfers_leaves_the_core_answering_and_a_resume_cancels_it() {
    use pdkv_engine::{AddRequestError, LifecycleError, PauseMode};
    use std::time::{Duration, Instant};
    let conn = Scripted::holding("held");
    // A release timeout far longer than any wait below: an update that
    // blocked the core would show as a core that does not answer.
    let config = pdkv_engine::EngineConfig {
        kv_release_timeout: Duration::from_secs(120),
        ..Default::default()
    };
    let e = crate::common::start_with_connector(
        pdkv_model::Arch::Llama,
        config,
        Some(Box::new(conn.clone())),
    );
    let other = tempfile::tempdir().unwrap();
    pdkv_model::init::write_random_checkpoint(pdkv_model::Arch::Llama, "tiny", 8, other.path())
        .unwrap();
    let want = probe(&e, "before");
    let info = e.weight_info();
    crate::common::run_to_length(&e, "held", 3, 40, 1);
    // Two requests frozen by a keep pause (an update may run under it).
    e.pause(PauseMode::Keep, false, Duration::from_secs(10))
        .unwrap();
    let q1 = e
        .add_request(crate::common::greedy_request("q1", 6, 30, 3))
        .unwrap();
    let q2 = e
        .add_request(crate::common::greedy_request("q2", 5, 40, 4))
        .unwrap();

    std::thread::scope(|s| {
        let update = s.spawn(|| e.update_weights(other.path(), Some("other".into())));
        conn.wait_for("the update released the transfers", |s| s.aborts == 1);
        assert!(
            !update.is_finished(),
            "the update went on while a transfer held blocks"
        );

        let t0 = Instant::now();
        assert_eq!(
            e.abort_requests(&["q1".to_string()]),
            vec!["q1".to_string()],
            "the core answers meanwhile"
        );
        assert_eq!(crate::common::collect(q1).finish, Some(FinishReason::Abort));
        assert!(!e.reset_prefix_cache(), "a transfer holds blocks");
        assert_eq!(e.lifecycle_status().paused, Some(PauseMode::Keep));
        let refused = e.add_request(crate::common::greedy_request("new", 7, 20, 1));
        assert!(
            matches!(refused, Err(AddRequestError::Unavailable(ref m)) if m.contains("updating its weights")),
            "{:?}",
            refused.err()
        );
        assert!(e.stats().kv_blocks_held > 0);
        e.resume().expect("the resume is answered");
        assert!(
            t0.elapsed() < Duration::from_secs(10),
            "the core answered after {:?}",
            t0.elapsed()
        );
        match update.join().unwrap() {
            Err(LifecycleError::Cancelled(_)) => {}
            other => panic!("the update ended as {other:?}, not Cancelled"),
        }
    });
    assert_eq!(e.weight_info(), info, "the weights are unchanged");
    assert_eq!(info.version, None);
    assert_eq!(e.stats().lifecycle.num_weight_updates, 0);
    // q2, frozen during the update, runs on the old weights.
    let q2 = crate::common::collect(q2);
    assert_eq!(
        (q2.tokens.clone(), q2.logit_bits()),
        want,
        "q2 ran on other weights"
    );
    conn.send_done_and_wake("held");
    crate::common::wait_idle(&e);
    assert_eq!(probe(&e, "after"), want);
}
