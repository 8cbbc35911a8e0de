//! One case run, phase by phase: the load warms up, the case's operations
//! run under it, the load runs on after the restore and stops, and then the
//! checks — the load's outcomes, quiescence and serving, device memory
//! against the baseline (awake, and asleep while it slept), transfer
//! counters, and the probes against the baseline's texts.

use std::collections::HashMap;
use std::sync::atomic::Ordering;
use std::sync::Arc;

use tokio::task::JoinHandle;

use crate::bounds::{ASLEEP_MAX_FRACTION, WORKER_STOP_DEADLINE};
use crate::cases::{Case, Op, Role, Target};
use crate::clock::PhaseClock;
use crate::context::Runner;
use crate::error::LifecycleError;
use crate::load::{load_worker, wait_progress, Load, LoadCounts};
use crate::probes::run_probes;
use crate::report::CaseResult;

/// The engine a `reset_prefix_cache` case resets.
fn reset_role(case: &Case) -> Role {
    if case.target == Target::P {
        Role::P
    } else {
        Role::D
    }
}

impl Runner<'_> {
    pub(crate) async fn run_case(
        &self,
        case: &Case,
        cycle: usize,
    ) -> Result<CaseResult, LifecycleError> {
        let mut res = CaseResult {
            name: case.name.clone(),
            cycle,
            p_awake: self.base.p_awake,
            d_awake: self.base.d_awake,
            ..CaseResult::default()
        };
        let before = self.c.counters().await?;
        if let Op::ResetPrefixCache = case.op {
            self.reset_idle(&mut res, reset_role(case)).await;
        }
        let (load, workers) = self.start_load(case, cycle);
        let n = self.o.load_concurrency as u64;
        let mut clock = PhaseClock::new();
        if !wait_progress(&load, 0, n).await {
            res.reasons.push(format!(
                "the load completed no {n} requests before the operations"
            ));
        }
        clock.lap("warm-up");
        let rep = self.operate(case, cycle, &load).await;
        clock.lap("operations");
        res.reasons.extend(rep.errors);
        res.notes.extend(rep.notes);
        res.p_asleep = rep.asleep.get(&Role::P).copied();
        res.d_asleep = rep.asleep.get(&Role::D).copied();

        self.restore_and_stop(&mut res, &load, workers, &mut clock)
            .await;
        res.load = LoadCounts::tally(load.take_outcomes(), case.aborts_all(), &rep.aborted_ids);
        res.reasons.extend(res.load.lost_reason());

        self.check_settled(&mut res).await?;
        if let Op::ResetPrefixCache = case.op {
            // Idle again, with the held transfer released: it succeeds.
            let role = reset_role(case);
            if let Err(e) = self
                .c
                .expect_reset(role, true, true, "idle after the load")
                .await
            {
                res.reasons.push(e.to_string());
            }
        }
        clock.lap("quiescence");
        if let Some(t) = case.sleeping() {
            self.check_asleep(&mut res, t, &rep.asleep_ranks);
        }
        let after = self.c.counters().await?;
        res.t = after.minus(&before);
        res.notes.extend(res.t.on_purpose_note());
        if res.t.claimed_leases_expired > 0.0 {
            res.reasons.push(format!(
                "{} leases expired on transfers D had claimed (P threw away KV a queued request was waiting for)",
                res.t.claimed_leases_expired
            ));
        }
        if res.t.pulls_failed > 0.0 || res.t.loads_failed > 0.0 {
            res.reasons.push(format!(
                "failed transfers: {} pulls on P, {} loads on D (a transfer ended on purpose is counted apart)",
                res.t.pulls_failed, res.t.loads_failed
            ));
        }
        self.check_probes(&mut res).await?;
        clock.lap("probes");
        res.notes.extend(clock.slow());
        res.phases = clock.laps;
        Ok(res)
    }

    /// Idle, the reset must succeed.
    async fn reset_idle(&self, res: &mut CaseResult, role: Role) {
        match self.c.wait_quiescent(role).await {
            Ok(slow) => res.notes.extend(slow),
            Err(e) => res.reasons.push(e.to_string()),
        }
        if let Err(e) = self.c.expect_reset(role, true, true, "idle").await {
            res.reasons.push(e.to_string());
        }
    }

    /// The case's load through the proxy: `--load-concurrency` workers.
    fn start_load(&self, case: &Case, cycle: usize) -> (Arc<Load>, Vec<JoinHandle<()>>) {
        let load = Arc::new(Load::new(
            self.c.client.clone(),
            &self.c.proxy,
            self.run_id,
            format!("{}-{cycle}", case.name),
            self.o.disconnect_every,
            self.o.load_prompt_repeats,
        ));
        let workers = (0..self.o.load_concurrency)
            .map(|_| tokio::spawn(load_worker(load.clone())))
            .collect();
        (load, workers)
    }

    /// Serving again under load (it completes requests again), then the
    /// load stops: each worker finishes its request, bounded.
    async fn restore_and_stop(
        &self,
        res: &mut CaseResult,
        load: &Load,
        workers: Vec<JoinHandle<()>>,
        clock: &mut PhaseClock,
    ) {
        let n = self.o.load_concurrency as u64;
        let done = load.completed.load(Ordering::Relaxed);
        if !wait_progress(load, done, n).await {
            res.reasons.push(format!(
                "the load completed no {n} requests after the restore"
            ));
        }
        clock.lap("load after restore");
        load.stop.store(true, Ordering::Release);
        for w in workers {
            if tokio::time::timeout(WORKER_STOP_DEADLINE, w).await.is_err() {
                res.reasons
                    .push("a load worker did not stop in time".into());
            }
        }
        clock.lap("stopping the load");
    }

    /// Quiescent, serving, no memory drift (in all and on any rank: a rank
    /// that grew while another shrank would cancel out in the sum).
    async fn check_settled(&self, res: &mut CaseResult) -> Result<(), LifecycleError> {
        let c = &self.c;
        for role in [Role::P, Role::D] {
            match c.wait_quiescent(role).await {
                Ok(slow) => res.notes.extend(slow),
                Err(e) => res.reasons.push(e.to_string()),
            }
            if let Err(e) = c.check_serving(role).await {
                res.reasons.push(e.to_string());
            }
            let (base, base_ranks) = self.base.awake(role);
            let awake = c.device_bytes(role).await?;
            if awake != base {
                res.reasons.push(format!(
                    "{} device bytes {awake} after the case, {base} at the baseline",
                    role.name()
                ));
            }
            let ranks = c.rank_bytes(role).await?;
            if ranks != base_ranks {
                res.reasons.push(format!(
                    "{} device bytes by rank {ranks:?} after the case, {base_ranks:?} at the baseline",
                    role.name()
                ));
            }
        }
        Ok(())
    }

    /// A sleeping engine held at most [`ASLEEP_MAX_FRACTION`] of its awake
    /// device bytes, in all and on every rank.
    fn check_asleep(
        &self,
        res: &mut CaseResult,
        t: Target,
        asleep_ranks: &HashMap<Role, Vec<u64>>,
    ) {
        for (role, awake, asleep) in [
            (Role::P, res.p_awake, res.p_asleep),
            (Role::D, res.d_awake, res.d_asleep),
        ] {
            if !t.has(role) {
                continue;
            }
            match asleep {
                Some(a) if a as f64 <= ASLEEP_MAX_FRACTION * awake as f64 => {}
                Some(a) => res.reasons.push(format!(
                    "{} kept {:.1}% of its device bytes asleep ({a} of {awake})",
                    role.name(),
                    100.0 * a as f64 / awake.max(1) as f64
                )),
                None => res
                    .reasons
                    .push(format!("{} device bytes asleep not measured", role.name())),
            }
            let (_, base_ranks) = self.base.awake(role);
            if let Some(asleep) = asleep_ranks.get(&role) {
                for (r, (a, awake)) in asleep.iter().zip(base_ranks).enumerate() {
                    if *a as f64 > ASLEEP_MAX_FRACTION * *awake as f64 {
                        res.reasons.push(format!(
                            "{} rank {r} kept {:.1}% of its device bytes asleep ({a} of {awake})",
                            role.name(),
                            100.0 * *a as f64 / (*awake).max(1) as f64
                        ));
                    }
                }
            }
        }
    }

    /// The probes run alone: each must load its KV from P, so transfers
    /// work again after the restore (D recomputing would hide it), and
    /// their texts must equal the baseline's.
    async fn check_probes(&self, res: &mut CaseResult) -> Result<(), LifecycleError> {
        let c = &self.c;
        let before = c.counters().await?;
        let got = run_probes(c, &self.base.prompts, self.o.probe_tokens).await;
        let after = c.counters().await?;
        let (loads, pulls) = (
            after.loads_ok - before.loads_ok,
            after.pulls_ok - before.pulls_ok,
        );
        if loads != got.len() as f64 || pulls != got.len() as f64 {
            res.reasons.push(format!(
                "the {} probes after the restore loaded {loads} KV transfers on D ({} failed), P served {pulls} pulls or reads",
                got.len(),
                after.loads_failed - before.loads_failed
            ));
        }
        res.probes_run = got.len();
        let mut diffs = Vec::new();
        for (i, (g, want)) in got.iter().zip(&self.base.texts).enumerate() {
            match g {
                Ok(text) if text == want => res.probes_equal += 1,
                Ok(text) => diffs.push(format!("probe {i}: {text:?} != {want:?}")),
                Err(e) => diffs.push(format!("probe {i}: {e}")),
            }
        }
        if !diffs.is_empty() {
            res.reasons
                .push(format!("{} probes differ ({})", diffs.len(), diffs[0]));
        }
        Ok(())
    }
}
