//! The scheduler and block pool without a model: budgets, chunking, prefix
//! hits, preemption, aborts, and a seeded random workload that checks every
//! invariant each step against a simulated KV cache.

use std::collections::HashMap;
use std::sync::Arc;

use pdkv_engine::sampling::splitmix64;
use pdkv_engine::scheduler::{NewRequest, ScheduledSeq, SeqUpdate};
use pdkv_engine::{FinishReason, Scheduler, SchedulerConfig, SchedulerOutput};
use pdkv_model::BLOCK_SIZE;

fn sched(max_num_seqs: usize, budget: usize, num_blocks: usize, caching: bool) -> Scheduler {
    Scheduler::new(SchedulerConfig {
        max_num_seqs,
        max_num_batched_tokens: budget,
        num_blocks,
        enable_prefix_caching: caching,
        speculative: None,
    })
}

/// A request that stops at token 0.
fn req(id: &str, prompt: Vec<u32>, max_tokens: usize) -> NewRequest {
    crate::common::new_request(id, prompt, max_tokens, vec![0])
}

/// The token a request samples at output `index`: a pure function, so a
/// request's output does not depend on how it was scheduled.
fn token_for(id: &str, index: usize) -> u32 {
    let mut h = index as u64;
    for b in id.bytes() {
        h = splitmix64(h ^ b as u64);
    }
    // Never 0 (the stop token) unless the test asks for it.
    1 + (h % 50) as u32
}

/// Runs a step, sampling with [`token_for`].
fn step(s: &mut Scheduler) -> (SchedulerOutput, Vec<SeqUpdate>) {
    let plan = s.schedule();
    let sampled: Vec<Option<u32>> = plan
        .seqs
        .iter()
        .map(|q| q.sample.then(|| token_for(&q.request_id, q.output_index)))
        .collect();
    let ups = s.update_from_output(&plan, &sampled);
    s.check_invariants();
    (plan, ups)
}

fn seq<'a>(plan: &'a SchedulerOutput, id: &str) -> Option<&'a ScheduledSeq> {
    plan.seqs.iter().find(|q| &*q.request_id == id)
}

fn prompt(seed: u32, n: usize) -> Vec<u32> {
    (0..n as u32)
        .map(|i| 1 + (seed * 131 + i * 7) % 97)
        .collect()
}

#[test]
fn chunked_prefill_respects_the_token_budget() {
    let mut s = sched(4, 7, 16, false);
    s.add_request(req("a", prompt(1, 20), 3));
    let mut starts = Vec::new();
    loop {
        let (plan, _) = step(&mut s);
        let q = seq(&plan, "a").unwrap();
        assert!(plan.num_tokens() <= 7);
        starts.push((q.start_pos, q.tokens.len(), q.sample));
        assert_eq!(
            q.block_table.len(),
            (q.start_pos + q.tokens.len()).div_ceil(BLOCK_SIZE)
        );
        if q.sample {
            break;
        }
    }
    assert_eq!(
        starts,
        vec![(0, 7, false), (7, 7, false), (14, 6, true)],
        "only the last chunk samples"
    );
    // Then one token per step until max_tokens.
    let (plan, ups) = step(&mut s);
    assert_eq!(seq(&plan, "a").unwrap().tokens, vec![token_for("a", 0)]);
    assert_eq!(ups[0].finished, None);
    let (_, ups) = step(&mut s);
    assert_eq!(ups[0].finished, Some(FinishReason::Length));
    assert!(!s.has_work());
    s.check_invariants();
}

#[test]
fn running_requests_go_first_and_max_num_seqs_holds() {
    let mut s = sched(2, 64, 32, false);
    s.add_request(req("a", prompt(1, 10), 5));
    s.add_request(req("b", prompt(2, 10), 5));
    s.add_request(req("c", prompt(3, 10), 5));
    let (plan, _) = step(&mut s);
    assert_eq!(plan.seqs.len(), 2);
    assert!(seq(&plan, "c").is_none(), "max_num_seqs = 2");
    let (plan, _) = step(&mut s);
    assert_eq!(
        plan.seqs.iter().map(|q| q.tokens.len()).collect::<Vec<_>>(),
        vec![1, 1]
    );
    assert_eq!(s.counts().num_waiting, 1);
}

#[test]
fn decodes_share_the_budget_with_a_chunked_prompt() {
    let mut s = sched(8, 10, 32, false);
    s.add_request(req("a", prompt(1, 4), 10));
    step(&mut s);
    s.add_request(req("b", prompt(2, 30), 2));
    let (plan, _) = step(&mut s);
    assert_eq!(seq(&plan, "a").unwrap().tokens.len(), 1);
    let b = seq(&plan, "b").unwrap();
    assert_eq!((b.start_pos, b.tokens.len(), b.sample), (0, 9, false));
    assert_eq!(plan.num_tokens(), 10);
}

#[test]
fn prefix_cache_hit_skips_computed_blocks() {
    let mut s = sched(4, 512, 32, true);
    let shared = prompt(5, 48);
    let mut pa = shared.clone();
    pa.extend([3, 4, 5]);
    s.add_request(req("a", pa, 2));
    while s.has_work() {
        step(&mut s);
    }
    let mut pb = shared.clone();
    pb.extend([9, 9]);
    s.add_request(req("b", pb, 1));
    let (plan, ups) = step(&mut s);
    let b = seq(&plan, "b").unwrap();
    assert_eq!(b.start_pos, 48, "three full blocks come from the cache");
    assert_eq!(b.tokens, vec![9, 9]);
    assert_eq!(ups[0].num_cached_tokens, 48);
    let c = s.counts();
    assert_eq!((c.prefix_cache_queries, c.prefix_cache_hits), (51 + 50, 48));
    // The identical prompt again: the last token is always computed.
    s.add_request(req("c", shared.clone(), 1));
    let (plan, _) = step(&mut s);
    let q = seq(&plan, "c").unwrap();
    assert_eq!((q.start_pos, q.tokens.len()), (32, 16));
    assert_eq!(s.block_pool().num_free(), 32);
}

#[test]
fn preemption_recomputes_and_continues_the_same_sequence() {
    // 4 blocks: two requests of 16+ tokens cannot both grow to 3 blocks.
    let mut s = sched(4, 64, 4, true);
    s.add_request(req("a", prompt(1, 16), 20));
    s.add_request(req("b", prompt(2, 16), 20));
    let mut outputs: HashMap<String, Vec<u32>> = HashMap::new();
    let mut preempted_b = false;
    for _ in 0..200 {
        if !s.has_work() {
            break;
        }
        let (plan, ups) = step(&mut s);
        if plan.preempted.iter().any(|p| &**p == "b") {
            preempted_b = true;
            assert_eq!(s.counts().num_waiting, 1);
        }
        if let Some(q) = seq(&plan, "b") {
            if preempted_b && q.start_pos == 0 {
                // Readmitted: prompt plus the output so far is recomputed.
                let mut expect = prompt(2, 16);
                expect.extend(&outputs["b"]);
                assert_eq!(q.tokens, expect);
                assert_eq!(q.output_index, outputs["b"].len());
            }
        }
        for u in ups {
            for &t in &u.new_tokens {
                outputs.entry(u.request_id.to_string()).or_default().push(t);
            }
        }
    }
    assert!(preempted_b, "the later request was preempted");
    assert!(s.counts().num_preemptions >= 1);
    assert!(!s.has_work());
    for id in ["a", "b"] {
        let want: Vec<u32> = (0..20).map(|i| token_for(id, i)).collect();
        assert_eq!(outputs[id], want, "{id} continued exactly");
    }
    assert_eq!(s.block_pool().num_free(), 4);
}

#[test]
fn stop_token_finishes_with_stop() {
    let mut s = sched(4, 64, 8, false);
    let mut r = req("a", prompt(1, 5), 10);
    r.stop_token_ids = vec![token_for("a", 1)];
    s.add_request(r);
    step(&mut s);
    let (_, ups) = step(&mut s);
    let (_, ups2) = step(&mut s);
    let fin: Vec<_> = ups.iter().chain(&ups2).filter_map(|u| u.finished).collect();
    assert_eq!(fin, vec![FinishReason::Stop]);
    assert!(!s.has_work());
}

#[test]
fn abort_in_every_state_frees_everything() {
    let mut s = sched(2, 8, 8, true);
    s.add_request(req("decoding", prompt(1, 4), 50));
    s.add_request(req("prefilling", prompt(2, 40), 5));
    s.add_request(req("waiting", prompt(3, 4), 5));
    step(&mut s);
    step(&mut s);
    assert!(!s.output_tokens("decoding").unwrap().is_empty());
    assert_eq!(s.counts().num_waiting, 1);
    assert!(!s.abort_request("unknown"));
    for id in ["waiting", "prefilling", "decoding"] {
        assert!(s.abort_request(id), "{id}");
        assert!(!s.abort_request(id), "{id} twice");
        s.check_invariants();
    }
    assert_eq!(s.block_pool().num_free(), 8);
    // A preempted request (back in waiting) aborts cleanly too.
    let mut s = sched(4, 64, 3, false);
    s.add_request(req("a", prompt(1, 16), 17));
    s.add_request(req("b", prompt(2, 16), 17));
    let mut n = 0;
    while s.counts().num_preemptions == 0 {
        step(&mut s);
        n += 1;
        assert!(n < 50, "no preemption happened");
    }
    assert!(s.abort_request("b"));
    assert!(s.abort_request("a"));
    s.check_invariants();
    assert_eq!(s.block_pool().num_free(), 3);
}

#[test]
fn reset_prefix_cache_refused_while_running() {
    let mut s = sched(2, 64, 8, true);
    s.add_request(req("a", prompt(1, 20), 3));
    step(&mut s);
    assert!(!s.reset_prefix_cache());
    while s.has_work() {
        step(&mut s);
    }
    assert!(s.reset_prefix_cache());
    assert_eq!(s.block_pool().num_cached_blocks(), 0);
}

/// A simulated KV cache: each slot holds a tag of the whole prefix that
/// produced it, so reading a stale, foreign or unwritten slot is detected.
struct SimKv {
    slots: Vec<Option<u64>>,
}

#[test]
fn preempt_all_running_frees_every_block_and_outputs_continue() {
    // Reference: both requests run undisturbed.
    let mut r = sched(4, 64, 32, true);
    r.add_request(req("a", prompt(1, 20), 12));
    r.add_request(req("b", prompt(2, 9), 12));
    let mut want: HashMap<String, Vec<u32>> = HashMap::new();
    while r.has_work() {
        for u in step(&mut r).1 {
            want.entry(u.request_id.to_string())
                .or_default()
                .extend(u.new_tokens.iter().copied());
        }
    }

    let mut s = sched(4, 64, 32, true);
    s.add_request(req("a", prompt(1, 20), 12));
    s.add_request(req("b", prompt(2, 9), 12));
    let mut got: HashMap<String, Vec<u32>> = HashMap::new();
    for _ in 0..3 {
        for u in step(&mut s).1 {
            got.entry(u.request_id.to_string())
                .or_default()
                .extend(u.new_tokens.iter().copied());
        }
    }
    assert_eq!(s.preempt_all_running(), 2);
    s.check_invariants();
    let c = s.counts();
    assert_eq!(
        (c.num_running, c.num_waiting, c.num_free_blocks),
        (0, 2, 32)
    );
    assert!(s.reset_prefix_cache(), "nothing holds a block");
    assert_eq!(s.block_pool().num_cached_blocks(), 0);
    // Admission order is kept: "a" is planned before "b" again.
    let (plan, ups) = step(&mut s);
    assert_eq!(&*plan.seqs[0].request_id, "a");
    assert_eq!(plan.seqs[0].start_pos, 0, "recomputed from scratch");
    for u in ups {
        got.entry(u.request_id.to_string())
            .or_default()
            .extend(u.new_tokens.iter().copied());
    }
    while s.has_work() {
        for u in step(&mut s).1 {
            got.entry(u.request_id.to_string())
                .or_default()
                .extend(u.new_tokens.iter().copied());
        }
    }
    assert_eq!(got, want);
}

fn prefix_tags(tokens: &[u32]) -> Vec<u64> {
    let mut h = 0xcbf29ce484222325u64;
    tokens
        .iter()
        .map(|&t| {
            h = splitmix64(h ^ t as u64);
            h
        })
        .collect()
}

struct Rng(u64);
impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(1);
        splitmix64(self.0)
    }
    fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }
}

/// Random adds/aborts/steps; every step checks the invariants and that each
/// scheduled sequence reads exactly the KV its own tokens produced. Then a
/// liveness phase: everything must finish within a bound, and all blocks
/// come back.
fn random_workload(seed: u64, caching: bool) -> (u64, u64) {
    let num_blocks = 24;
    let mut s = sched(6, 1 + (seed as usize % 40), num_blocks, caching);
    let mut rng = Rng(seed);
    let mut kv = SimKv {
        slots: vec![None; num_blocks * BLOCK_SIZE],
    };
    let mut tokens_of: HashMap<Arc<str>, Vec<u32>> = HashMap::new();
    let mut live: Vec<Arc<str>> = Vec::new();
    let mut next_id = 0;
    let bases: Vec<Vec<u32>> = (0..3).map(|i| prompt(100 + i, 64)).collect();
    let mut finished = 0;

    let run_step = |s: &mut Scheduler,
                    kv: &mut SimKv,
                    tokens_of: &mut HashMap<Arc<str>, Vec<u32>>,
                    live: &mut Vec<Arc<str>>,
                    rng: &mut Rng|
     -> usize {
        let plan = s.schedule();
        assert!(plan.num_tokens() <= s.config().max_num_batched_tokens);
        assert!(plan.seqs.len() <= s.config().max_num_seqs);
        let mut sampled = Vec::new();
        for q in &plan.seqs {
            let toks = &tokens_of[&q.request_id];
            let tags = prefix_tags(toks);
            assert_eq!(
                &toks[q.start_pos..q.start_pos + q.tokens.len()],
                &q.tokens[..],
                "seed {seed}"
            );
            let slot =
                |p: usize| q.block_table[p / BLOCK_SIZE] as usize * BLOCK_SIZE + p % BLOCK_SIZE;
            for (p, tag) in tags.iter().enumerate().take(q.start_pos) {
                assert_eq!(
                    kv.slots[slot(p)],
                    Some(*tag),
                    "seed {seed}: stale KV at position {p} of {}",
                    q.request_id
                );
            }
            for (p, tag) in tags
                .iter()
                .enumerate()
                .take(q.start_pos + q.tokens.len())
                .skip(q.start_pos)
            {
                kv.slots[slot(p)] = Some(*tag);
            }
            // Occasionally sample the stop token.
            sampled.push(q.sample.then(|| {
                if rng.below(40) == 0 {
                    0
                } else {
                    token_for(&q.request_id, q.output_index)
                }
            }));
        }
        let ups = s.update_from_output(&plan, &sampled);
        let mut done = 0;
        for u in ups {
            for &t in &u.new_tokens {
                tokens_of.get_mut(&u.request_id).unwrap().push(t);
            }
            if u.finished.is_some() {
                live.retain(|l| *l != u.request_id);
                tokens_of.remove(&u.request_id);
                done += 1;
            }
        }
        s.check_invariants();
        done
    };

    // Safety phase.
    for _ in 0..300 {
        match rng.below(10) {
            0..=2 => {
                let mut p = bases[rng.below(3) as usize][..rng.below(64) as usize + 1].to_vec();
                for _ in 0..rng.below(20) {
                    p.push(1 + rng.below(90) as u32);
                }
                let max_tokens = 1 + rng.below(30) as usize;
                if Scheduler::max_blocks_needed(p.len(), max_tokens) > num_blocks {
                    continue;
                }
                let id: Arc<str> = Arc::from(format!("r{next_id}").as_str());
                next_id += 1;
                tokens_of.insert(id.clone(), p.clone());
                live.push(id.clone());
                s.add_request(NewRequest {
                    cache_salt: None,
                    output_tokens: Vec::new(),
                    id,
                    prompt_tokens: p,
                    max_tokens,
                    stop_token_ids: vec![0],
                    kv_transfer_params: None,
                    prompt_logits: false,
                });
            }
            3 if !live.is_empty() => {
                let id = live.remove(rng.below(live.len() as u64) as usize);
                assert!(s.abort_request(&id));
                tokens_of.remove(&id);
                finished += 1;
            }
            _ => finished += run_step(&mut s, &mut kv, &mut tokens_of, &mut live, &mut rng),
        }
        s.check_invariants();
    }
    // Liveness phase: no new work; everything ends within a bound.
    let mut steps = 0;
    while s.has_work() {
        finished += run_step(&mut s, &mut kv, &mut tokens_of, &mut live, &mut rng);
        steps += 1;
        assert!(steps < 20_000, "seed {seed}: no progress");
    }
    assert_eq!(
        finished, next_id,
        "seed {seed}: every request ended exactly once"
    );
    assert_eq!(
        s.block_pool().num_free(),
        num_blocks,
        "seed {seed}: blocks leaked"
    );
    s.check_invariants();
    (s.counts().num_preemptions, s.counts().prefix_cache_hits)
}

#[test]
fn random_workloads_keep_invariants_and_conserve_blocks() {
    let (mut preemptions, mut hits) = (0, 0);
    for seed in 0..40 {
        let (p, h) = random_workload(seed, seed % 4 != 3);
        preemptions += p;
        hits += h;
    }
    // The workloads must exercise the interesting paths.
    assert!(preemptions > 20, "only {preemptions} preemptions");
    assert!(hits > 1000, "only {hits} prefix-cache hit tokens");
}

#[test]
fn random_workloads_preempt() {
    // The workload above is meant to exercise preemption; make sure it does.
    let mut s = sched(6, 64, 6, true);
    for i in 0..4 {
        s.add_request(req(&format!("r{i}"), prompt(i, 20), 40));
    }
    let mut steps = 0;
    while s.has_work() {
        step(&mut s);
        steps += 1;
        assert!(steps < 5000);
    }
    assert!(s.counts().num_preemptions > 0);
    assert_eq!(s.block_pool().num_free(), 6);
}
