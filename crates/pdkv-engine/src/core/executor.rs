//! The lifecycle executor: the stepper's side of pause, resume, sleep, wake,
//! KV release, prefix-cache reset and weight reload. The decisions are the
//! lifecycle machine's ([`crate::lifecycle::Machine`]); this applies its
//! actions to the scheduler, the pool, the KV connector and the model runner,
//! and answers the callers.

use std::time::Instant;

use pdkv_model::loader::ReloadError;
use pdkv_vmem::Tag;

use super::command::{LifecycleReply, Reply};
use super::stepper::EngineCore;
use crate::lifecycle::{
    Action, Completion, LifecycleError, Outcome, PauseMode, SleepLevel, Snapshot, Ticket,
    WeightInfo,
};
use crate::model::WeightSource;

/// An action that failed, and whether the operation must be undone (the
/// machine goes back to its state from before the operation; nothing after
/// the failed action was applied).
struct Failed {
    error: LifecycleError,
    undo: bool,
}

impl EngineCore {
    pub(super) fn reset_prefix_cache(
        &mut self,
        reset_running: bool,
        reset_external: bool,
        reply: Reply<bool>,
    ) {
        let mut done = if reset_running {
            let n = self.sched.reset_prefix_cache_preempting();
            tracing::info!(
                preempted = n,
                "prefix cache reset with running requests preempted; they recompute"
            );
            true
        } else {
            self.sched.reset_prefix_cache()
        };
        if done && reset_external {
            // Whatever the connector caches about block contents goes too.
            done = self.sched.connector_mut().is_none_or(|c| c.reset_cache());
        }
        self.answer(reply, done);
    }

    pub(super) fn pause(
        &mut self,
        mode: PauseMode,
        clear_cache: bool,
        deadline: Instant,
        reply: LifecycleReply,
    ) {
        self.report_transfers(mode == PauseMode::Abort);
        let ticket = self.ticket();
        let live = self.sched.has_work();
        let before = self.lc.snapshot();
        let out = self.lc.pause(mode, clear_cache, ticket, deadline, live);
        self.finish_outcome(ticket, out, reply, before);
    }

    pub(super) fn resume(&mut self, reply: LifecycleReply) {
        let before = self.lc.snapshot();
        let (out, cancelled) = self.lc.resume();
        self.complete(cancelled, &before);
        self.finish_outcome(self.next_ticket, out, reply, before);
    }

    pub(super) fn sleep(
        &mut self,
        level: SleepLevel,
        mode: PauseMode,
        deadline: Instant,
        reply: LifecycleReply,
    ) {
        if let Err(e) = self.check_sleep_mode() {
            self.answer(reply, Err(e));
            return;
        }
        self.report_transfers(mode == PauseMode::Abort);
        let ticket = self.ticket();
        let live = self.sched.has_work();
        let before = self.lc.snapshot();
        let out = self.lc.sleep(level, mode, ticket, deadline, live);
        self.finish_outcome(ticket, out, reply, before);
    }

    pub(super) fn wake(&mut self, tags: Option<Vec<Tag>>, reply: LifecycleReply) {
        let before = self.lc.snapshot();
        let out = self.lc.wake(tags.as_deref());
        let timed = !out.actions.is_empty();
        let t0 = self.clock.now();
        let result = self.run_outcome(out, &before);
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
        let before = self.lc.snapshot();
        let out = self
            .lc
            .release_kv_with(ticket, self.clock.now() + self.release_timeout);
        self.finish_outcome(ticket, out, reply, before);
    }

    /// Completes pending `wait` pauses and sleeps that are due.
    pub(super) fn poll_lifecycle(&mut self) {
        if !self.lc.has_pending() {
            return;
        }
        self.report_transfers(false);
        let before = self.lc.snapshot();
        let done = self.lc.poll(self.sched.has_work(), self.clock.now());
        if !done.is_empty() {
            self.complete(done, &before);
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
    /// A failed action turns the reply into that error; one that must be
    /// undone puts the machine back to `before`.
    fn run_outcome(
        &mut self,
        out: Outcome,
        before: &Snapshot,
    ) -> Option<Result<(), LifecycleError>> {
        let t0 = self.clock.now();
        let applied = self.apply_actions(&out.actions);
        if out.is_sleep && applied.is_ok() {
            self.lc_stats.last_sleep_seconds = self.seconds_since(t0);
            self.lc_stats.num_sleeps += 1;
        }
        match applied {
            Err(f) => {
                if f.undo {
                    tracing::warn!(error = %f.error, "lifecycle operation failed; the engine stays as it was before it");
                    self.lc.restore(before.clone());
                }
                Some(Err(f.error))
            }
            Ok(()) => out.reply,
        }
    }

    /// Applies an outcome and answers `reply` now, or files it under
    /// `ticket` when the machine deferred the answer.
    fn finish_outcome(
        &mut self,
        ticket: Ticket,
        out: Outcome,
        reply: LifecycleReply,
        before: Snapshot,
    ) {
        match self.run_outcome(out, &before) {
            Some(r) => {
                self.reloads.remove(&ticket);
                self.answer(reply, r);
            }
            None => {
                self.replies.insert(ticket, reply);
                self.requested.insert(ticket, before);
            }
        }
    }

    /// Applies and answers deferred outcomes (`before`: the machine's state
    /// before the event that completed them). One whose actions fail goes
    /// back to the state it was requested in (see
    /// [`crate::lifecycle::Machine::rollback_target`]), so a sleep that
    /// waited for transfers and then could not release its registrations
    /// does not leave its own pause behind.
    fn complete(&mut self, done: Vec<Completion>, before: &Snapshot) {
        for c in done {
            let reply = self.replies.remove(&c.ticket);
            let back = match self.requested.remove(&c.ticket) {
                Some(requested) => self.lc.rollback_target(&requested),
                None => before.clone(),
            };
            let r = self.run_outcome(c.outcome, &back).unwrap_or(Ok(()));
            self.reloads.remove(&c.ticket);
            if let Some(reply) = reply {
                self.answer(reply, r);
            }
        }
    }

    /// Tells the lifecycle machine whether transfers hold KV blocks.
    fn report_transfers(&mut self, aborting: bool) {
        let held = self.has_connector
            && (self.sched.has_transfers() || (aborting && self.sched.has_work()));
        self.lc.set_transfers(held);
    }

    /// Applies actions in order. A memory operation that fails does not
    /// stop the others (the machine already counts the tags as released,
    /// the safe side: no step runs, and a later wake retries); a failed
    /// registration release or wake stops here and is undone.
    fn apply_actions(&mut self, actions: &[Action]) -> Result<(), Failed> {
        let mut result = Ok(());
        for a in actions {
            if let Err(f) = self.apply_action(a) {
                tracing::error!(error = %f.error, "lifecycle action failed");
                let undo = f.undo;
                if result.is_ok() || undo {
                    result = Err(f);
                }
                if undo {
                    break;
                }
            }
        }
        self.mapped = [Tag::Weights, Tag::KvCache, Tag::Runtime]
            .into_iter()
            .all(|t| self.pool.is_awake(t));
        result
    }

    fn apply_action(&mut self, action: &Action) -> Result<(), Failed> {
        let go_on = |error: LifecycleError| Failed { error, undo: false };
        let undo = |error: LifecycleError| Failed { error, undo: true };
        let mem = |op: &str, tags: &[Tag], r: pdkv_vmem::Result<()>| {
            r.map_err(|e| {
                let names: Vec<&str> = tags.iter().map(|t| t.as_str()).collect();
                LifecycleError::Internal(format!("{op} of {} failed: {e}", names.join(", ")))
            })
        };
        match action {
            Action::AbortAll => self.abort_all(),
            Action::PreemptRunning => {
                self.sched.preempt_all_running();
            }
            Action::InvalidatePrefixCache => {
                if !self.sched.reset_prefix_cache() {
                    return Err(go_on(LifecycleError::Internal(
                        "the prefix cache could not be invalidated: blocks are in use".into(),
                    )));
                }
            }
            Action::ForgetFreeCachedBlocks => {
                self.sched.forget_free_cached_blocks();
            }
            Action::ReleaseTransfers => {
                self.sched.release_transfer_kv();
            }
            Action::ReleaseRegistrations => return self.release_registrations().map_err(undo),
            Action::Offload(tags) => {
                return mem("offload", tags, self.pool.offload(tags)).map_err(go_on)
            }
            Action::Discard(tags) => {
                return mem("discard", tags, self.pool.discard(tags)).map_err(go_on)
            }
            Action::Wake(tags) => {
                mem("wake", tags, self.pool.wake(tags)).map_err(undo)?;
                if let Err(e) = self.restore_registrations(tags) {
                    // The machine goes back to these tags asleep: so does
                    // their memory, or an asleep KV cache would hold pages.
                    self.put_back_to_sleep(tags);
                    return Err(undo(e));
                }
                return Ok(());
            }
            Action::ReloadWeights(ticket) => {
                let Some((source, version)) = self.reloads.remove(ticket) else {
                    return Err(go_on(LifecycleError::Internal(format!(
                        "no checkpoint for weight update {ticket}"
                    ))));
                };
                return self.reload_weights(source, version).map_err(go_on);
            }
        }
        Ok(())
    }

    /// Undoes a wake of `tags` whose registrations could not be restored:
    /// the weights go back to host memory (a backup again, as after an
    /// offload), everything else is discarded (the KV cache and the runtime
    /// hold nothing a wake must restore). A failure here is logged: the
    /// wake's own error is what the caller hears.
    fn put_back_to_sleep(&mut self, tags: &[Tag]) {
        for &tag in tags {
            let r = if tag == Tag::Weights {
                self.pool.offload(&[tag])
            } else {
                self.pool.discard(&[tag])
            };
            if let Err(e) = r {
                tracing::error!(tag = tag.as_str(), error = %e, "putting memory back to sleep after a failed wake failed");
            }
        }
    }

    /// Before the KV cache is unmapped: the connector gives up its
    /// registrations of it. A failure (transfers still in flight, a peer
    /// that does not acknowledge its unmap) fails the operation with what
    /// the connector said, and nothing is released.
    fn release_registrations(&mut self) -> Result<(), LifecycleError> {
        if !self.pool.is_awake(Tag::KvCache) {
            return Ok(());
        }
        let timeout = self.release_timeout;
        let t0 = self.clock.now();
        let Some(c) = self.sched.connector_mut() else {
            return Ok(());
        };
        let r = c.release_kv_caches(timeout);
        let ms = self.clock.now().saturating_duration_since(t0).as_millis() as u64;
        match r {
            Ok(()) => {
                tracing::info!(ms, "KV connector released its registrations");
                Ok(())
            }
            Err(e) => {
                // The engine stays awake: so must the registrations. A
                // connector rolls a failed release back itself; should the
                // rollback have failed too (it then holds no registration
                // at all), try once more now, or transfers would be
                // refused until the next wake.
                let again = match c.restore_kv_caches() {
                    Ok(()) => String::new(),
                    Err(r) => {
                        tracing::error!(error = %format!("{r:#}"), "the KV connector could not register the KV cache again after a failed release");
                        format!("; registering the KV cache again failed too, so transfers are refused until the next wake: {r:#}")
                    }
                };
                Err(LifecycleError::Conflict(format!(
                    "the KV connector could not release its registrations of the KV cache, so nothing was released and the engine stays as it was: {e:#}{again}"
                )))
            }
        }
    }

    /// After the KV cache is mapped again: the connector registers it anew
    /// (a new epoch). A failure fails the wake, which is then undone (the
    /// KV cache counts as asleep, and the next wake tries again).
    fn restore_registrations(&mut self, tags: &[Tag]) -> Result<(), LifecycleError> {
        if !tags.contains(&Tag::KvCache) {
            return Ok(());
        }
        match self.sched.connector_mut() {
            Some(c) => c.restore_kv_caches().map_err(|e| {
                LifecycleError::Internal(format!(
                    "the KV connector could not register the KV cache again, so the KV cache stays asleep (wake again to retry): {e:#}"
                ))
            }),
            None => Ok(()),
        }
    }

    /// Reloads weights in place through the lifecycle machine: at once, or
    /// (when transfers hold KV computed with the old weights) after
    /// releasing that KV, like every cache reset. Requests are refused
    /// meanwhile; a resume cancels it.
    pub(super) fn update_weights(
        &mut self,
        source: WeightSource,
        version: Option<String>,
        reply: LifecycleReply,
    ) {
        self.report_transfers(false);
        let ticket = self.ticket();
        self.reloads.insert(ticket, (source, version));
        let before = self.lc.snapshot();
        let deadline = self.clock.now() + self.release_timeout;
        let out = self
            .lc
            .update_weights(ticket, deadline, self.sched.has_work());
        self.finish_outcome(ticket, out, reply, before);
    }

    fn reload_weights(
        &mut self,
        source: WeightSource,
        version: Option<String>,
    ) -> Result<(), LifecycleError> {
        let t0 = self.clock.now();
        let path = source.path();
        let written = match &source {
            WeightSource::Checkpoint(p) => self.runner.reload_weights(p),
            WeightSource::Staged { weights, .. } => self.runner.install_weights(weights),
        };
        match written {
            Ok(()) => {
                let actions = self.lc.weights_written(true);
                self.apply_actions(&actions).map_err(|f| f.error)?;
                // KV a connector saved was computed with the old weights, and
                // a transfer must not mix them.
                if let Some(c) = self.sched.connector_mut() {
                    if !c.reset_cache() {
                        tracing::warn!(
                            connector = c.name(),
                            "the KV connector could not drop its cached KV after a weight update"
                        );
                    }
                    c.set_weights_version(version.as_deref());
                }
                self.weight_info = WeightInfo { version, path };
                let seconds = self.seconds_since(t0);
                self.lc_stats.last_weight_update_seconds = seconds;
                self.lc_stats.num_weight_updates += 1;
                tracing::info!(seconds, "weights reloaded in place");
                Ok(())
            }
            Err(ReloadError::Incompatible(e)) => {
                Err(LifecycleError::IncompatibleWeights(format!("{e:#}")))
            }
            Err(ReloadError::Unreadable(e)) => Err(LifecycleError::Invalid(format!("{e:#}"))),
            Err(ReloadError::RegionReleased) => Err(LifecycleError::Conflict(
                "the weights are asleep; wake weights first".into(),
            )),
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
