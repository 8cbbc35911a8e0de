//! The operators: one per engine, driving lifecycle operations under load
//! as the RL trainer and an administrator would (pauses of every mode,
//! sleeps and wakes, KV release, prefix resets, aborts, weight updates
//! toward the deployment's moving version), one call at a time from a
//! script drawn at random. With faults on, a call now and then meets a
//! fault injected on one rank of the KV cache, fails, and is retried.
//! In the liveness phase the script brings the engine back to serving the
//! cluster's weights.

use std::collections::VecDeque;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use pdkv_engine::{Command, LifecycleError, PauseMode, SleepLevel};
use pdkv_vmem::Tag;

use crate::cluster::Cluster;
use crate::ctx::{Ctx, Ev, Ix};
use crate::model::weights_path;
use crate::node::version;
use crate::proxy::Proxy;

/// A lifecycle step an operator takes on its node.
#[derive(Clone, Debug, PartialEq)]
pub enum Step {
    Pause(PauseMode, bool),
    Resume,
    Sleep(SleepLevel, PauseMode),
    Wake(Option<Vec<Tag>>),
    ReleaseKv,
    ResetPrefix(bool),
    AbortSome,
    Reload(u64),
    Hold(Duration),
}

type Answer = Arc<Mutex<Option<Result<(), String>>>>;

#[derive(Default)]
struct Operator {
    script: VecDeque<Step>,
    /// Answers to the call in progress: (step, result).
    answer: Answer,
    waiting: Option<(Step, Instant)>,
    /// The call in progress retries one an injected rank fault failed:
    /// how many more tries it gets after this one.
    retrying: Option<u32>,
    /// A registration fault was asked of the node's registry and has not
    /// yet been seen to fail a call: no release fault is injected meanwhile
    /// (a release that fails restores every rank, and that restore must
    /// not meet the registration fault meant for a wake).
    register_fault_armed: bool,
}

/// Tries of a lifecycle call after an injected rank fault failed it.
const RANK_FAULT_RETRIES: u32 = 3;

/// The operators of every engine, and the weights version the deployment
/// moves toward.
pub struct Operators {
    ops: Vec<Operator>,
    /// The weights every engine serves once healed.
    pub cluster_weights: u64,
}

impl Operators {
    pub fn new(nodes: usize) -> Operators {
        Operators {
            ops: (0..nodes).map(|_| Operator::default()).collect(),
            cluster_weights: 1,
        }
    }

    /// Each operator begins a little after the start.
    pub fn start(&self, ctx: &mut Ctx) {
        for i in 0..self.ops.len() {
            let d = Duration::from_millis(ctx.rng.range(100, 2000));
            ctx.at(d, Ev::Operator(i));
        }
    }

    /// The engine at `ix` crashed: its operator forgets everything.
    pub fn crashed(&mut self, ix: Ix) {
        self.ops[ix] = Operator::default();
    }

    /// No operator waits for a call or has steps left.
    pub fn idle(&self) -> bool {
        self.ops
            .iter()
            .all(|o| o.waiting.is_none() && o.script.is_empty())
    }

    /// The next lifecycle sequence for the engine at `ix`.
    fn pick_script(&mut self, ctx: &mut Ctx, cluster: &Cluster, ix: Ix) -> Vec<Step> {
        let rng = &mut ctx.rng;
        // Now and then a hold longer than every transfer timeout: requests a
        // keep pause froze on P wait for it, their pulls with them.
        let hold = if rng.chance(0.05) {
            rng.range(30_000, 90_000)
        } else {
            rng.range(10, 3000)
        };
        let hold = Step::Hold(Duration::from_millis(hold));
        let mode = *rng.pick(&[PauseMode::Abort, PauseMode::Wait, PauseMode::Keep]);
        let level = *rng.pick(&[SleepLevel::L0, SleepLevel::L1, SleepLevel::L2]);
        let weights = cluster.node(ix).map_or(1, |n| n.weights);
        let wake = match rng.below(3) {
            0 => vec![Step::Wake(None)],
            1 => vec![
                Step::Wake(Some(vec![Tag::Weights])),
                Step::Wake(Some(vec![Tag::KvCache])),
            ],
            _ => vec![
                Step::Wake(Some(vec![Tag::KvCache])),
                Step::Wake(Some(vec![Tag::Weights])),
            ],
        };
        match rng.below(8) {
            // The RL trainer's sequence.
            0 | 1 => vec![
                Step::Pause(PauseMode::Keep, false),
                Step::Sleep(SleepLevel::L1, PauseMode::Keep),
                hold,
            ]
            .into_iter()
            .chain(wake)
            .chain([Step::Resume])
            .collect(),
            2 => vec![Step::Pause(mode, rng.chance(0.5)), hold, Step::Resume],
            3 => {
                let mut s = vec![Step::Sleep(level, mode), hold];
                s.extend(wake);
                if level == SleepLevel::L2 {
                    s.push(Step::Reload(weights));
                }
                s.push(Step::Resume);
                s
            }
            4 => vec![
                Step::Pause(PauseMode::Keep, false),
                Step::ReleaseKv,
                hold,
                Step::Resume,
            ],
            5 => vec![Step::ResetPrefix(rng.chance(0.5))],
            6 => vec![Step::AbortSome],
            _ => {
                // A weight update toward the deployment's next version:
                // engines converge on it, mixing versions meanwhile.
                if weights == self.cluster_weights {
                    self.cluster_weights += 1;
                }
                let w = self.cluster_weights;
                vec![
                    Step::Pause(PauseMode::Keep, false),
                    Step::Reload(w),
                    Step::Resume,
                ]
            }
        }
    }

    /// The operator of `ix` takes its next step (drawing a new script
    /// when it has none, in the safety phase); with `faults`, the call may
    /// meet an injected rank fault. Returns the node touched.
    pub fn operate(
        &mut self,
        ctx: &mut Ctx,
        cluster: &mut Cluster,
        proxy: &Proxy,
        faults: bool,
        ix: Ix,
    ) -> Option<Ix> {
        if cluster.node(ix).is_none() || self.ops[ix].waiting.is_some() {
            return None;
        }
        if self.ops[ix].script.is_empty() {
            if ctx.healed {
                return None;
            }
            // Serving for a while between two lifecycle sequences.
            let (lo, hi) = ctx.opts.op_idle_ms;
            let idle = Duration::from_millis(ctx.rng.range(lo, hi));
            let s = self.pick_script(ctx, cluster, ix);
            self.ops[ix].script.push_back(Step::Hold(idle));
            self.ops[ix].script.extend(s);
        }
        let step = self.ops[ix].script.pop_front().expect("not empty");
        ctx.report.operations += 1;
        if let Step::Hold(d) = step {
            ctx.at(d, Ev::Operator(ix));
            return None;
        }
        let slot: Answer = Arc::new(Mutex::new(None));
        self.ops[ix].answer = slot.clone();
        self.ops[ix].waiting = Some((step.clone(), ctx.now()));
        let deadline = ctx.now() + Duration::from_secs(20);
        // A retry meets no fault of its own: it shows the call succeeds
        // once the fault is gone.
        if faults && self.ops[ix].retrying.is_none() {
            self.inject_rank_fault(ctx, cluster, ix, &step);
        }
        let inc = cluster.inc(ix);
        let cmd = command(step, slot, deadline, || proxy.live_calls(ix, inc, 3));
        let n = cluster.node_mut(ix).expect("up");
        n.core.apply(cmd);
        Some(ix)
    }

    /// Now and then, a fault on one rank for the lifecycle call `step`
    /// about to be made: before a sleep or a KV release, one rank's
    /// deregistration fails (a shared-memory peer that did not acknowledge
    /// its unmap), so the release fails part of the way; before a wake of
    /// the released KV cache of an engine of several ranks, the
    /// registration of a rank other than the first fails, so the restore
    /// fails part of the way. One fault at a time per engine.
    fn inject_rank_fault(&mut self, ctx: &mut Ctx, cluster: &Cluster, ix: Ix, step: &Step) {
        let Some(n) = cluster.node(ix) else {
            return;
        };
        let rng = &mut ctx.rng;
        let release_armed = n.fail_release.lock().unwrap().is_some();
        let register_armed = self.ops[ix].register_fault_armed;
        match step {
            Step::Sleep(..) | Step::ReleaseKv => {
                // Drawn first, so an engine of one rank draws as many
                // numbers as before ranks existed.
                let hit = rng.chance(0.2);
                if register_armed || release_armed || !hit {
                    return;
                }
                let segments: Vec<u64> = n.conn.inspect(|c| {
                    c.kv()
                        .map(|k| k.regs().iter().map(|r| r.segment).collect())
                        .unwrap_or_default()
                });
                if segments.is_empty() {
                    return;
                }
                let r = match segments.len() {
                    1 => 0,
                    len => rng.below(len as u64) as usize,
                };
                *n.fail_release.lock().unwrap() = Some(segments[r]);
                // Now and then the rollback fails too: registering every
                // rank again fails on one of them (drawn only for several
                // ranks, as above).
                if segments.len() > 1 && rng.chance(0.25) {
                    let k = rng.below(segments.len() as u64) as usize;
                    n.registry.fail_register_after(k);
                    self.ops[ix].register_fault_armed = true;
                }
            }
            Step::Wake(tags) if tags.as_ref().is_none_or(|t| t.contains(&Tag::KvCache)) => {
                let released = n.conn.inspect(|c| c.is_asleep())
                    && n.core
                        .lifecycle_status()
                        .asleep_tags
                        .contains(&Tag::KvCache);
                if n.tp < 2 || !released || register_armed || release_armed {
                    return;
                }
                if !rng.chance(0.3) {
                    return;
                }
                // Ranks 0..k register again, rank k fails.
                let k = rng.range(1, n.tp as u64 - 1) as usize;
                n.registry.fail_register_after(k);
                self.ops[ix].register_fault_armed = true;
            }
            _ => {}
        }
    }

    /// The operator's call was answered: note it, go on with the script.
    /// A call unanswered for 60 s is a violation.
    pub fn answer(&mut self, ctx: &mut Ctx, cluster: &mut Cluster, ix: Ix) {
        let Some((step, since)) = self.ops[ix].waiting.clone() else {
            return;
        };
        let answer = self.ops[ix].answer.lock().unwrap().take();
        let Some(answer) = answer else {
            if ctx.now() - since > Duration::from_secs(60) {
                let what = format!("node {ix}: {step:?} unanswered for 60 s");
                ctx.violation(what);
            }
            return;
        };
        self.ops[ix].waiting = None;
        if let (Step::Reload(w), Ok(())) = (&step, &answer) {
            cluster.slots[ix].reloads += 1;
            if let Some(n) = cluster.node_mut(ix) {
                n.weights = *w;
            }
        }
        if let (Step::Sleep(level, _), Ok(())) = (&step, &answer) {
            if *level != SleepLevel::L0 {
                cluster.slots[ix].reloads += 1;
            }
        }
        self.retry_after_fault(ctx, ix, &step, &answer);
        match answer {
            Ok(()) => ctx.report.operations_ok += 1,
            Err(e) => {
                ctx.report.operations_failed += 1;
                *ctx.report.operation_errors.entry(short(&e)).or_default() += 1;
            }
        }
        let gap = Duration::from_millis(ctx.rng.range(1, 200));
        ctx.at(gap, Ev::Operator(ix));
    }

    /// A call an injected rank fault failed is expected to fail, and to
    /// succeed when retried (as an operator would): the engine and its
    /// connector must have put every rank back as it was.
    fn retry_after_fault(
        &mut self,
        ctx: &mut Ctx,
        ix: Ix,
        step: &Step,
        answer: &Result<(), String>,
    ) {
        let op = &mut self.ops[ix];
        let retrying = op.retrying.take();
        let report = &mut ctx.report;
        match answer {
            Err(e) if is_injected(e) => {
                if e.contains(INJECTED_REGISTER) && e.contains(INJECTED_RELEASE) {
                    report.rank_release_faults += 1;
                    report.rank_rollback_faults += 1;
                    op.register_fault_armed = false;
                } else if e.contains(INJECTED_REGISTER) {
                    report.rank_restore_faults += 1;
                    op.register_fault_armed = false;
                } else {
                    report.rank_release_faults += 1;
                }
                op.retrying = Some(RANK_FAULT_RETRIES);
                op.script.push_front(step.clone());
            }
            Ok(()) if retrying.is_some() => report.rank_faults_retried += 1,
            // The retry met something else (transfers in flight, a sleep
            // the operator's pause had not reached): try again, a few times.
            Err(_) if retrying.is_some_and(|left| left > 1) => {
                op.retrying = retrying.map(|left| left - 1);
                op.script.push_front(step.clone());
            }
            _ => {}
        }
    }

    /// The liveness phase for the engine at `ix` (up again by now): wake
    /// and resume it, and bring it to the cluster's weights; what its
    /// script still had to do is dropped.
    pub fn heal(&mut self, ctx: &mut Ctx, cluster: &Cluster, ix: Ix) {
        let w = self.cluster_weights;
        let mut script = VecDeque::new();
        script.extend([Step::Wake(None), Step::Resume]);
        if cluster.node(ix).is_some_and(|n| n.weights != w)
            || cluster
                .node(ix)
                .is_some_and(|n| n.core.lifecycle_status().weights_discarded)
        {
            script.extend([
                Step::Pause(PauseMode::Keep, false),
                Step::Reload(w),
                Step::Resume,
            ]);
        }
        // What a script in progress still had to do is replaced, a
        // retry it held included (unless that call is in flight).
        let op = &mut self.ops[ix];
        op.script = script;
        if op.waiting.is_none() {
            op.retrying = None;
        }
        ctx.at(Duration::from_millis(1), Ev::Operator(ix));
    }
}

/// The engine command for `step`, answering into `slot`; `live_calls`
/// names the requests an abort ends.
fn command(
    step: Step,
    slot: Answer,
    deadline: Instant,
    live_calls: impl FnOnce() -> Vec<String>,
) -> Command {
    let reply = {
        let slot = slot.clone();
        Box::new(move |r: Result<(), LifecycleError>| {
            *slot.lock().unwrap() = Some(r.map_err(|e| e.to_string()))
        })
    };
    match step {
        Step::Pause(mode, clear_cache) => Command::Pause {
            mode,
            clear_cache,
            deadline,
            reply,
        },
        Step::Resume => Command::Resume(reply),
        Step::Sleep(level, mode) => Command::Sleep {
            level,
            mode,
            deadline,
            reply,
        },
        Step::Wake(tags) => Command::Wake { tags, reply },
        Step::ReleaseKv => Command::ReleaseKv(reply),
        Step::Reload(w) => Command::UpdateWeights {
            source: pdkv_engine::WeightSource::Checkpoint(weights_path(w).into()),
            version: Some(version(w)),
            reply,
        },
        Step::ResetPrefix(reset_running) => Command::ResetPrefixCache {
            reset_running,
            reset_external: true,
            reply: Box::new(move |_| *slot.lock().unwrap() = Some(Ok(()))),
        },
        Step::AbortSome => Command::AbortRequests {
            ids: live_calls(),
            reply: Box::new(move |_| *slot.lock().unwrap() = Some(Ok(()))),
        },
        Step::Hold(_) => unreachable!("a hold is no call"),
    }
}

/// What the registry's injected registration failure says.
const INJECTED_REGISTER: &str = "registering failed: injected fault";
/// What the simulated driver's injected deregistration failure says.
const INJECTED_RELEASE: &str = "did not acknowledge unmapping segment";

/// Whether a lifecycle call's error comes from an injected rank fault.
fn is_injected(e: &str) -> bool {
    e.contains(INJECTED_REGISTER) || e.contains(INJECTED_RELEASE)
}

fn short(e: &str) -> String {
    e.chars().take(60).collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::Options;

    fn rooms(seed: u64) -> (Ctx, Cluster, Operators) {
        let mut ctx = Ctx::new(Options::for_seed(seed));
        let cluster = Cluster::new(&mut ctx).expect("built");
        while ctx.pop().is_some() {}
        let ops = Operators::new(cluster.len());
        (ctx, cluster, ops)
    }

    fn scripts(seed: u64) -> (Vec<Vec<Step>>, u64) {
        let (mut ctx, cluster, mut ops) = rooms(seed);
        let s = (0..200)
            .map(|i| ops.pick_script(&mut ctx, &cluster, i % 2))
            .collect();
        (s, ops.cluster_weights)
    }

    #[test]
    fn scripts_are_the_seeds_and_end_serving() {
        let (s, weights) = scripts(4);
        assert_eq!((s.clone(), weights), scripts(4));
        assert_ne!(s, scripts(5).0);
        for script in &s {
            let last = script.last().expect("a step");
            assert!(
                matches!(last, Step::Resume | Step::ResetPrefix(_) | Step::AbortSome),
                "{script:?}"
            );
        }
        // Weight updates move the deployment's version, one at a time for
        // engines that serve it.
        let updates = s
            .iter()
            .filter(|s| s.get(1) == Some(&Step::Reload(2)))
            .count();
        assert!(
            updates > 0 && weights == 2,
            "{updates} updates, weights {weights}"
        );
    }

    #[test]
    fn an_operator_first_serves_a_while() {
        let (mut ctx, mut cluster, mut ops) = rooms(4);
        let proxy = Proxy::default();
        assert_eq!(ops.operate(&mut ctx, &mut cluster, &proxy, false, 0), None);
        assert_eq!(ctx.report.operations, 1);
        let t = ctx.pop().expect("the next step");
        assert_eq!(format!("{:?}", t.ev), "Operator(0)");
        let (lo, hi) = ctx.opts.op_idle_ms;
        let idle = (t.at - ctx.t0).as_millis() as u64;
        assert!((lo..=hi).contains(&idle), "{idle} ms");
        assert!(!ops.idle());
    }

    #[test]
    fn an_answered_call_goes_on_and_an_unanswered_one_is_a_violation() {
        let (mut ctx, mut cluster, mut ops) = rooms(4);
        let proxy = Proxy::default();
        ops.ops[1].script = [Step::Resume].into();
        assert_eq!(
            ops.operate(&mut ctx, &mut cluster, &proxy, false, 1),
            Some(1)
        );
        cluster.node_mut(1).unwrap().core.tick();
        ops.answer(&mut ctx, &mut cluster, 1);
        assert_eq!((ctx.report.operations, ctx.report.operations_ok), (1, 1));
        assert!(ops.idle());
        assert_eq!(format!("{:?}", ctx.pop().expect("next").ev), "Operator(1)");

        ops.ops[0].waiting = Some((Step::ReleaseKv, ctx.now()));
        ctx.clock.set(ctx.t0 + Duration::from_secs(61));
        ops.answer(&mut ctx, &mut cluster, 0);
        let v = &ctx.report.violations;
        assert!(
            v.len() == 1 && v[0].ends_with("node 0: ReleaseKv unanswered for 60 s"),
            "{v:?}"
        );
    }

    #[test]
    fn a_heal_brings_an_engine_to_the_clusters_weights() {
        let (mut ctx, cluster, mut ops) = rooms(4);
        ops.cluster_weights = 3;
        ops.ops[0].script = [Step::AbortSome].into();
        ops.ops[0].retrying = Some(2);
        ops.heal(&mut ctx, &cluster, 0);
        let want = [
            Step::Wake(None),
            Step::Resume,
            Step::Pause(PauseMode::Keep, false),
            Step::Reload(3),
            Step::Resume,
        ];
        assert_eq!(ops.ops[0].script, want);
        assert_eq!(ops.ops[0].retrying, None);
        ops.cluster_weights = 1;
        ops.heal(&mut ctx, &cluster, 1);
        assert_eq!(ops.ops[1].script, [Step::Wake(None), Step::Resume]);
    }

    #[test]
    fn injected_faults_are_told_by_their_errors() {
        assert!(is_injected("rank 1: registering failed: injected fault"));
        assert!(is_injected(
            "a shared-memory peer did not acknowledge unmapping segment 4 (injected)"
        ));
        assert!(!is_injected("timed out: KV transfers still held blocks"));
        assert_eq!(short(&"x".repeat(100)).len(), 60);
    }
}
