//! The lifecycle executor: the stepper's side of pause, resume, sleep, wake,
//! KV release, prefix-cache reset and weight reload. The decisions are the
//! lifecycle machine's ([`crate::lifecycle::Machine`]); this applies its
//! actions to the scheduler, the pool, the KV connector and the model runner,
//! and answers the callers.

use std::path::PathBuf;
use std::time::Instant;

use pdkv_model::loader::ReloadError;
use pdkv_vmem::Tag;

use super::command::{LifecycleReply, Reply};
use super::stepper::EngineCore;
use crate::lifecycle::{Action, Completion, LifecycleError, Outcome, PauseMode, SleepLevel, Ticket, WeightInfo};

/// A weight reload waiting for KV transfers to give their blocks back
/// before it writes (see [`EngineCore::weight_reload_waiting`]).
pub(super) struct PendingReload {
    path: PathBuf,
    version: Option<String>,
    reply: LifecycleReply,
    pub(super) deadline: Instant,
}

impl PendingReload {
    pub(super) fn stop(self) {
        (self.reply)(Err(LifecycleError::Stopped));
    }
}

impl EngineCore {
    pub(super) fn reset_prefix_cache(&mut self, reset_running: bool, reply: Reply<bool>) {
        if reset_running {
            self.sched.preempt_all_running();
        }
        let mut done = self.sched.reset_prefix_cache();
        if done {
            // Whatever the connector caches about block contents goes too.
            done = self.sched.connector_mut().is_none_or(|c| c.reset_cache());
        }
        self.answer(reply, done);
    }

    pub(super) fn pause(&mut self, mode: PauseMode, clear_cache: bool, deadline: Instant, reply: LifecycleReply) {
        self.report_transfers(mode == PauseMode::Abort);
        let ticket = self.ticket();
        let live = self.sched.has_work();
        let out = self.lc.pause(mode, clear_cache, ticket, deadline, live);
        self.finish_outcome(ticket, out, reply);
    }

    pub(super) fn resume(&mut self, reply: LifecycleReply) {
        let (out, cancelled) = self.lc.resume();
        self.complete(cancelled);
        self.finish_outcome(self.next_ticket, out, reply);
    }

    pub(super) fn sleep(&mut self, level: SleepLevel, mode: PauseMode, deadline: Instant, reply: LifecycleReply) {
        if let Err(e) = self.check_sleep_mode() {
            self.answer(reply, Err(e));
            return;
        }
        self.report_transfers(mode == PauseMode::Abort);
        let ticket = self.ticket();
        let live = self.sched.has_work();
        let out = self.lc.sleep(level, mode, ticket, deadline, live);
        self.finish_outcome(ticket, out, reply);
    }

    pub(super) fn wake(&mut self, tags: Option<Vec<Tag>>, reply: LifecycleReply) {
        let out = self.lc.wake(tags.as_deref());
        let timed = !out.actions.is_empty();
        let t0 = self.clock.now();
        let result = self.run_outcome(out);
        if timed {
            self.lc_stats.last_wake_seconds = self.seconds_since(t0);
            self.lc_stats.num_wakes += 1;
        }
        if let Some(r) = result {
            self.answer(reply, r);
        }
    }

    pub(super) fn release_kv(&mut self, reply: LifecycleReply) {
        if let Err(e) = self.check_sleep_mode() {
            self.answer(reply, Err(e));
            return;
        }
        self.report_transfers(false);
        let ticket = self.ticket();
        let out = self.lc.release_kv_with(ticket, self.clock.now() + self.release_timeout);
        self.finish_outcome(ticket, out, reply);
    }

    /// Completes pending `wait` pauses and sleeps that are due.
    pub(super) fn poll_lifecycle(&mut self) {
        if !self.lc.has_pending() {
            return;
        }
        self.report_transfers(false);
        let done = self.lc.poll(self.sched.has_work(), self.clock.now());
        if !done.is_empty() {
            self.complete(done);
            self.publish_lifecycle();
        }
    }

    fn seconds_since(&self, t0: Instant) -> f64 {
        self.clock.now().saturating_duration_since(t0).as_secs_f64()
    }

    /// With a KV connector, releasing KV memory needs sleep mode enabled
    /// (which start-up allows only for a connector that supports it).
    fn check_sleep_mode(&self) -> Result<(), LifecycleError> {
        if self.has_connector && !self.sleep_mode {
            return Err(LifecycleError::Conflict(
                "sleep mode is not enabled on this engine with a KV connector; start it with --enable-sleep-mode".into(),
            ));
        }
        Ok(())
    }

    fn ticket(&mut self) -> Ticket {
        self.next_ticket += 1;
        self.next_ticket
    }

    /// Applies an outcome's actions and returns its reply (`None`: deferred).
    /// A failed action turns the reply into that error.
    fn run_outcome(&mut self, out: Outcome) -> Option<Result<(), LifecycleError>> {
        let t0 = self.clock.now();
        let applied = self.apply_actions(&out.actions);
        if out.is_sleep {
            self.lc_stats.last_sleep_seconds = self.seconds_since(t0);
            self.lc_stats.num_sleeps += 1;
        }
        match applied {
            Err(e) => Some(Err(e)),
            Ok(()) => out.reply,
        }
    }

    /// Applies an outcome and answers `reply` now, or files it under
    /// `ticket` when the machine deferred the answer.
    fn finish_outcome(&mut self, ticket: Ticket, out: Outcome, reply: LifecycleReply) {
        match self.run_outcome(out) {
            Some(r) => self.answer(reply, r),
            None => {
                self.replies.insert(ticket, reply);
            }
        }
    }

    /// Applies and answers deferred outcomes.
    fn complete(&mut self, done: Vec<Completion>) {
        for c in done {
            let reply = self.replies.remove(&c.ticket);
            let r = self.run_outcome(c.outcome).unwrap_or(Ok(()));
            if let Some(reply) = reply {
                self.answer(reply, r);
            }
        }
    }

    /// Tells the lifecycle machine whether transfers hold KV blocks.
    fn report_transfers(&mut self, aborting: bool) {
        let held = self.has_connector && (self.sched.has_transfers() || (aborting && self.sched.has_work()));
        self.lc.set_transfers(held);
    }

    fn apply_actions(&mut self, actions: &[Action]) -> Result<(), LifecycleError> {
        let mut result = Ok(());
        for a in actions {
            // Go on after a failure: the machine already counts the tags as
            // released, which is the safe side (no step runs); a later wake
            // retries.
            if let Err(e) = self.apply_action(a) {
                tracing::error!(error = %e, "lifecycle action failed");
                if result.is_ok() {
                    result = Err(e);
                }
            }
        }
        self.mapped = [Tag::Weights, Tag::KvCache, Tag::Runtime].into_iter().all(|t| self.pool.is_awake(t));
        result
    }

    fn apply_action(&mut self, action: &Action) -> Result<(), LifecycleError> {
        let mem = |op: &str, tags: &[Tag], r: pdkv_vmem::Result<()>| {
            r.map_err(|e| {
                let names: Vec<&str> = tags.iter().map(|t| t.as_str()).collect();
                LifecycleError::Internal(format!("{op} of {} failed: {e}", names.join(", ")))
            })
        };
        match action {
            Action::AbortAll => {
                self.abort_all();
                Ok(())
            }
            Action::PreemptRunning => {
                self.sched.preempt_all_running();
                Ok(())
            }
            Action::InvalidatePrefixCache => {
                if self.sched.reset_prefix_cache() {
                    Ok(())
                } else {
                    Err(LifecycleError::Internal("the prefix cache could not be invalidated: blocks are in use".into()))
                }
            }
            Action::ForgetFreeCachedBlocks => {
                self.sched.forget_free_cached_blocks();
                Ok(())
            }
            Action::ReleaseTransfers => {
                self.sched.release_transfer_kv();
                Ok(())
            }
            Action::Offload(tags) => {
                self.release_registrations(tags);
                mem("offload", tags, self.pool.offload(tags))
            }
            Action::Discard(tags) => {
                self.release_registrations(tags);
                mem("discard", tags, self.pool.discard(tags))
            }
            Action::Wake(tags) => {
                mem("wake", tags, self.pool.wake(tags))?;
                self.restore_registrations(tags)
            }
        }
    }

    /// Before the KV cache is unmapped: the connector gives up its
    /// registrations of it (bounded). A failure is logged; the connector
    /// drops its registrations in any case, so no one reaches the old pages.
    fn release_registrations(&mut self, tags: &[Tag]) {
        if !tags.contains(&Tag::KvCache) || !self.pool.is_awake(Tag::KvCache) {
            return;
        }
        let timeout = self.release_timeout;
        let t0 = self.clock.now();
        let Some(c) = self.sched.connector_mut() else { return };
        let r = c.release_kv_caches(timeout);
        let ms = self.clock.now().saturating_duration_since(t0).as_millis() as u64;
        match r {
            Ok(()) => tracing::info!(ms, "KV connector released its registrations"),
            Err(e) => tracing::error!(error = %format!("{e:#}"), "KV connector release failed"),
        }
    }

    /// After the KV cache is mapped again: the connector registers it anew
    /// (a new epoch). A failure fails the wake.
    fn restore_registrations(&mut self, tags: &[Tag]) -> Result<(), LifecycleError> {
        if !tags.contains(&Tag::KvCache) {
            return Ok(());
        }
        match self.sched.connector_mut() {
            Some(c) => c.restore_kv_caches().map_err(|e| {
                LifecycleError::Internal(format!("the KV connector could not register the KV cache again: {e:#}"))
            }),
            None => Ok(()),
        }
    }

    /// Reloads weights in place, once no request runs (or a keep pause
    /// froze them) and no transfer holds KV computed with the old ones.
    pub(super) fn update_weights(&mut self, path: PathBuf, version: Option<String>, reply: LifecycleReply) {
        if let Err(e) = self.lc.check_update_weights(self.sched.has_work()) {
            self.answer(reply, Err(e));
            return;
        }
        if !self.sched.has_transfers() {
            let r = self.reload_weights(path, version);
            self.answer(reply, r);
            return;
        }
        // KV that transfers hold was computed with the old weights: release
        // it before writing new ones, and wait (bounded) until every block
        // is back.
        // TEMPORARY: this wait moves into the lifecycle machine; until then
        // the reload is parked here and each tick looks again.
        self.sched.release_transfer_kv();
        let deadline = self.clock.now() + self.release_timeout;
        self.reload = Some(PendingReload { path, version, reply, deadline });
        self.poll_weight_reload();
    }

    /// The parked weight reload: writes once the transfers gave their blocks
    /// back, times out at its deadline, else waits on.
    pub(super) fn poll_weight_reload(&mut self) {
        self.poll_connector();
        let held = self.sched.has_transfers();
        let Some(pending) = &self.reload else { return };
        if held && self.clock.now() < pending.deadline {
            return;
        }
        let PendingReload { path, version, reply, .. } = self.reload.take().expect("checked above");
        let r = if held {
            Err(LifecycleError::Timeout(format!(
                "KV transfers still held blocks after {:?}; the weights were not changed",
                self.release_timeout
            )))
        } else {
            self.reload_weights(path, version)
        };
        self.answer(reply, r);
        // As `apply` does after every lifecycle command.
        self.publish_lifecycle();
    }

    fn reload_weights(&mut self, path: PathBuf, version: Option<String>) -> Result<(), LifecycleError> {
        let t0 = self.clock.now();
        match self.runner.reload_weights(&path) {
            Ok(()) => {
                let actions = self.lc.weights_written(true);
                self.apply_actions(&actions)?;
                // KV a connector saved was computed with the old weights.
                if let Some(c) = self.sched.connector_mut() {
                    if !c.reset_cache() {
                        tracing::warn!(connector = c.name(), "the KV connector could not drop its cached KV after a weight update");
                    }
                }
                self.weight_info = WeightInfo { version, path };
                let seconds = self.seconds_since(t0);
                self.lc_stats.last_weight_update_seconds = seconds;
                self.lc_stats.num_weight_updates += 1;
                tracing::info!(seconds, "weights reloaded in place");
                Ok(())
            }
            Err(ReloadError::Incompatible(e)) => Err(LifecycleError::IncompatibleWeights(format!("{e:#}"))),
            Err(ReloadError::Unreadable(e)) => Err(LifecycleError::Invalid(format!("{e:#}"))),
            Err(ReloadError::RegionReleased) => {
                Err(LifecycleError::Conflict("the weights are asleep; wake weights first".into()))
            }
            Err(ReloadError::Partial(e)) => {
                let actions = self.lc.weights_written(false);
                let _ = self.apply_actions(&actions);
                Err(LifecycleError::Internal(format!(
                    "reloading weights failed part-way ({e:#}); requests are refused until a reload succeeds"
                )))
            }
        }
    }
}
