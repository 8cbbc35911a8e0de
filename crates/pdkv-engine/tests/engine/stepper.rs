//! The engine core driven directly, on the test's thread: a fake model
//! (the next token is a function of the last one), a manual clock, outputs
//! collected by closures. No engine thread, no channel, no real waiting.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use pdkv_engine::connector::KvCacheSpec;
use pdkv_engine::detok::Decode;
use pdkv_engine::lifecycle::{LifecycleError, WeightInfo};
use pdkv_engine::scheduler::ScheduledSeq;
use pdkv_engine::{
    AddRequestError, Clock, Command, CoreParts, EngineConfig, EngineCore, EngineRequest,
    FinishReason, LifecycleReply, ModelRunner, NoPublisher, OutputSink, PauseMode, RequestOutput,
    SamplingParams,
};
use pdkv_model::loader::ReloadError;
use pdkv_model::BLOCK_SIZE;
use pdkv_vmem::{Pool, Region, Tag};

const VOCAB: usize = 64;

/// The token the fake model predicts after `t`.
fn next(t: u32) -> u32 {
    (t * 7 + 3) % VOCAB as u32
}

/// What the fake model does on its n-th forward call (counting from 1).
#[derive(Clone, Copy)]
enum Fault {
    Error,
    Panic,
}

/// Logits that put all weight on `next(last token)`; checks the block
/// tables it is given cover the tokens.
struct FakeModel {
    kv: Arc<Region>,
    num_blocks: usize,
    calls: usize,
    faults: BTreeMap<usize, Fault>,
}

impl FakeModel {
    fn new(pool: &Pool, num_blocks: usize, faults: &[(usize, Fault)]) -> FakeModel {
        let kv = pool
            .allocate(Tag::KvCache, num_blocks * 64)
            .expect("KV region");
        FakeModel {
            kv,
            num_blocks,
            calls: 0,
            faults: faults.iter().copied().collect(),
        }
    }
}

impl ModelRunner for FakeModel {
    fn forward(&mut self, seqs: &[ScheduledSeq], logits: &mut Vec<f32>) -> anyhow::Result<()> {
        logits.clear();
        self.calls += 1;
        match self.faults.get(&self.calls) {
            Some(Fault::Error) => anyhow::bail!("injected failure"),
            Some(Fault::Panic) => panic!("injected panic"),
            None => {}
        }
        for s in seqs {
            assert!(
                s.block_table.len() * BLOCK_SIZE >= s.start_pos + s.tokens.len(),
                "block table too short"
            );
            assert!(s
                .block_table
                .iter()
                .all(|&b| (b as usize) < self.num_blocks));
            if s.sample {
                let mut row = vec![0.0f32; VOCAB];
                row[next(*s.tokens.last().expect("a seq has tokens")) as usize] = 1.0;
                logits.extend(row);
            }
        }
        Ok(())
    }

    fn vocab_size(&self) -> usize {
        VOCAB
    }

    fn max_context_len(&self) -> usize {
        1024
    }

    fn kv_cache_spec(&self) -> KvCacheSpec {
        KvCacheSpec::single(self.kv.clone(), self.num_blocks, 64, BLOCK_SIZE, "fake")
    }

    fn reload_weights(&mut self, _path: &std::path::Path) -> Result<(), ReloadError> {
        Ok(())
    }
}

/// One letter per token.
struct Letters;

impl Decode for Letters {
    fn decode(&self, ids: &[u32]) -> String {
        ids.iter()
            .map(|&i| char::from(b'a' + (i % 26) as u8))
            .collect()
    }
}

fn letters(ids: &[u32]) -> String {
    Letters.decode(ids)
}

/// Time moves only when the test says so.
struct ManualClock(Mutex<Instant>);

impl ManualClock {
    fn advance(&self, d: Duration) {
        *self.0.lock().unwrap() += d;
    }
}

impl Clock for ManualClock {
    fn now(&self) -> Instant {
        *self.0.lock().unwrap()
    }
}

const NUM_BLOCKS: usize = 16;

fn core_with(faults: &[(usize, Fault)]) -> (EngineCore, Arc<ManualClock>) {
    let pool = Pool::default();
    let clock = Arc::new(ManualClock(Mutex::new(Instant::now())));
    let config = EngineConfig {
        max_num_seqs: 4,
        max_num_batched_tokens: 32,
        num_kv_blocks: NUM_BLOCKS,
        max_model_len: Some(NUM_BLOCKS * BLOCK_SIZE),
        ..EngineConfig::default()
    };
    let core = EngineCore::new(CoreParts {
        runner: Box::new(FakeModel::new(&pool, NUM_BLOCKS, faults)),
        pools: pdkv_vmem::RankPools::single(pool),
        config,
        connector: None,
        waker: Arc::new(|| {}),
        decoder: Arc::new(Letters),
        eos_token_ids: vec![],
        weight_info: WeightInfo {
            version: None,
            path: "fake".into(),
        },
        clock: clock.clone(),
        publisher: Box::new(NoPublisher),
    })
    .expect("core");
    (core, clock)
}

/// Every output of every request, by id.
#[derive(Clone, Default)]
struct Outputs(Arc<Mutex<BTreeMap<String, Vec<RequestOutput>>>>);

impl Outputs {
    fn sink(&self, id: &str) -> OutputSink {
        let (all, id) = (self.0.clone(), id.to_string());
        Box::new(move |o| {
            all.lock().unwrap().entry(id.clone()).or_default().push(o);
            true
        })
    }

    /// The request's finish reason once its last output came.
    fn finish(&self, id: &str) -> Option<FinishReason> {
        self.0
            .lock()
            .unwrap()
            .get(id)
            .and_then(|v| v.last())
            .and_then(|o| o.finish_reason)
    }

    /// Tokens and text of a finished request; checks it ended exactly once.
    fn result(&self, id: &str) -> (Vec<u32>, String, FinishReason) {
        let all = self.0.lock().unwrap();
        let outs = &all[id];
        let finals = outs.iter().filter(|o| o.finish_reason.is_some()).count();
        assert_eq!(finals, 1, "{id} ended {finals} times");
        let last = outs
            .last()
            .unwrap()
            .finish_reason
            .expect("the final output is the last");
        (
            outs.iter().flat_map(|o| o.token_ids.clone()).collect(),
            outs.iter().map(|o| o.text.as_str()).collect(),
            last,
        )
    }
}

fn request(id: &str, prompt_tokens: Vec<u32>, max_tokens: u32) -> EngineRequest {
    EngineRequest::new(
        id,
        prompt_tokens,
        SamplingParams {
            temperature: 0.0,
            max_tokens,
            ignore_eos: true,
            ..SamplingParams::default()
        },
    )
}

fn prompt(len: usize, salt: u32) -> Vec<u32> {
    (0..len as u32)
        .map(|i| (i * 13 + salt) % VOCAB as u32)
        .collect()
}

/// The fake model's greedy continuation of `prompt`.
fn expected(prompt: &[u32], n: usize) -> Vec<u32> {
    let mut last = *prompt.last().unwrap();
    (0..n)
        .map(|_| {
            last = next(last);
            last
        })
        .collect()
}

/// Ticks until `done`, checking the scheduler's invariants every tick.
fn tick_until(core: &mut EngineCore, mut done: impl FnMut() -> bool) {
    for _ in 0..500 {
        if done() {
            return;
        }
        core.tick();
        core.scheduler().check_invariants();
    }
    panic!("not done after 500 ticks: {:?}", core.stats());
}

fn assert_all_blocks_free(core: &EngineCore) {
    let s = core.stats();
    assert_eq!((s.num_running, s.num_waiting), (0, 0), "{s:?}");
    assert_eq!(s.kv_blocks_free, s.kv_blocks_total, "{s:?}");
    assert_eq!(s.kv_blocks_total, NUM_BLOCKS);
    assert!(!core.has_runnable_work());
}

#[test]
fn requests_run_to_completion_on_a_fake_model_without_a_thread() {
    let (mut core, _clock) = core_with(&[]);
    let outs = Outputs::default();
    // Short; longer than a step's budget (chunked prefill); one that a stop
    // token ends.
    let (pa, pb, pc) = (prompt(5, 1), prompt(40, 2), prompt(20, 3));
    let c_tokens = expected(&pc, 10);
    let stop = c_tokens[2];
    let mut c_req = request("c", pc.clone(), 10);
    c_req.params.stop_token_ids = vec![stop];
    c_req.params.return_logits = true;
    core.add(request("a", pa.clone(), 6), 1, outs.sink("a"))
        .unwrap();
    core.add(request("b", pb.clone(), 4), 2, outs.sink("b"))
        .unwrap();
    core.add(c_req, 3, outs.sink("c")).unwrap();
    assert!(core.has_runnable_work());

    // The handle's checks hold here too.
    let dup = core.add(request("a", pa.clone(), 1), 4, outs.sink("x"));
    assert_eq!(dup, Err(AddRequestError::DuplicateId("a".into())));
    assert!(matches!(
        core.add(request("e", vec![], 1), 5, outs.sink("x")),
        Err(AddRequestError::Invalid(_))
    ));
    let too_long = core.add(request("l", prompt(250, 4), 10), 6, outs.sink("x"));
    assert!(
        matches!(too_long, Err(AddRequestError::TooLong { .. })),
        "{too_long:?}"
    );

    tick_until(&mut core, || {
        ["a", "b", "c"].iter().all(|id| outs.finish(id).is_some())
    });

    let (tokens, text, finish) = outs.result("a");
    assert_eq!(
        (tokens.clone(), finish),
        (expected(&pa, 6), FinishReason::Length)
    );
    assert_eq!(text, letters(&tokens));
    let (tokens, text, finish) = outs.result("b");
    assert_eq!(
        (tokens.clone(), finish),
        (expected(&pb, 4), FinishReason::Length)
    );
    assert_eq!(text, letters(&tokens));
    let (tokens, text, finish) = outs.result("c");
    let n = c_tokens.iter().position(|&t| t == stop).unwrap() + 1;
    assert_eq!(
        (tokens.clone(), finish),
        (c_tokens[..n].to_vec(), FinishReason::Stop)
    );
    assert_eq!(
        text,
        letters(&tokens[..n - 1]),
        "a stop token is not part of the text"
    );
    let c_logits: Vec<Vec<f32>> = outs.0.lock().unwrap()["c"]
        .iter()
        .flat_map(|o| o.logits.clone())
        .collect();
    assert_eq!(c_logits.len(), n);
    assert!(c_logits
        .iter()
        .zip(&tokens)
        .all(|(row, &t)| row[t as usize] == 1.0));
    assert!(
        !outs.0.lock().unwrap().contains_key("x"),
        "refused requests produce no output"
    );

    assert_all_blocks_free(&core);
    assert!(core.stats().steps >= 6);
    core.shutdown();
    assert_eq!(
        core.add(request("late", pa, 1), 7, outs.sink("late")),
        Err(AddRequestError::Stopped)
    );
}

#[test]
fn a_wait_pause_times_out_by_the_manual_clock_alone() {
    let started = Instant::now();
    let (mut core, clock) = core_with(&[]);
    let outs = Outputs::default();
    let p = prompt(10, 5);
    core.add(request("long", p.clone(), 50), 1, outs.sink("long"))
        .unwrap();
    core.tick();
    core.tick();

    let answer: Arc<Mutex<Option<Result<(), LifecycleError>>>> = Arc::default();
    let reply: LifecycleReply = {
        let answer = answer.clone();
        Box::new(move |r| *answer.lock().unwrap() = Some(r))
    };
    let deadline = clock.now() + Duration::from_secs(5);
    core.apply(Command::Pause {
        mode: PauseMode::Wait,
        clear_cache: false,
        deadline,
        reply,
    });
    assert_eq!(
        *answer.lock().unwrap(),
        None,
        "deferred while a request runs"
    );
    assert_eq!(core.lifecycle_status().paused, Some(PauseMode::Wait));
    assert!(core
        .admission()
        .unwrap_err()
        .to_string()
        .contains("paused (mode wait)"));
    assert_eq!(core.next_deadline(), Some(deadline));

    clock.advance(Duration::from_millis(4_999));
    core.tick();
    assert_eq!(*answer.lock().unwrap(), None, "not yet at the deadline");
    clock.advance(Duration::from_millis(2));
    core.tick();
    assert!(
        matches!(
            *answer.lock().unwrap(),
            Some(Err(LifecycleError::Timeout(_)))
        ),
        "{:?}",
        answer.lock().unwrap()
    );
    assert_eq!(
        core.lifecycle_status().paused,
        Some(PauseMode::Wait),
        "the pause stays after a timeout"
    );
    assert_eq!(core.next_deadline(), None);
    assert_eq!(outs.finish("long"), None, "the request is still running");
    assert!(
        started.elapsed() < Duration::from_secs(5),
        "a 5 s deadline passed without waiting 5 s"
    );

    // Under `wait` the request runs on to its end; resume reopens admission.
    tick_until(&mut core, || outs.finish("long").is_some());
    let (tokens, _, finish) = outs.result("long");
    assert_eq!((tokens, finish), (expected(&p, 50), FinishReason::Length));
    let resumed: Arc<Mutex<Option<Result<(), LifecycleError>>>> = Arc::default();
    let reply: LifecycleReply = {
        let resumed = resumed.clone();
        Box::new(move |r| *resumed.lock().unwrap() = Some(r))
    };
    core.apply(Command::Resume(reply));
    assert_eq!(*resumed.lock().unwrap(), Some(Ok(())));
    assert_eq!(core.admission(), Ok(()));
    assert_all_blocks_free(&core);
}

#[test]
fn a_failing_or_panicking_forward_aborts_its_step_and_the_core_serves_on() {
    let (mut core, _clock) = core_with(&[(2, Fault::Error), (4, Fault::Panic)]);
    let outs = Outputs::default();
    for (i, id) in ["err", "panic"].into_iter().enumerate() {
        core.add(request(id, prompt(5, i as u32), 8), 1, outs.sink(id))
            .unwrap();
        core.tick();
        assert_eq!(outs.finish(id), None, "{id}: the first step succeeds");
        core.tick();
        assert_eq!(outs.result(id).2, FinishReason::Abort, "{id}");
        assert_all_blocks_free(&core);
    }
    let p = prompt(7, 9);
    core.add(request("after", p.clone(), 5), 1, outs.sink("after"))
        .unwrap();
    tick_until(&mut core, || outs.finish("after").is_some());
    let (tokens, _, finish) = outs.result("after");
    assert_eq!((tokens, finish), (expected(&p, 5), FinishReason::Length));
    assert_all_blocks_free(&core);
}
