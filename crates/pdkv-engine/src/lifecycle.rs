//! The engine lifecycle an RL trainer drives between rollouts: pause,
//! resume, sleep, wake, KV-cache release, prefix-cache reset, weight reload.
//!
//! Public types used by the admin HTTP API, and the state machine
//! ([`Machine`]) that decides every lifecycle transition. The machine is
//! sans-IO: it takes events (a command, "the engine is idle now", the clock)
//! and returns [`Action`]s and replies; the engine core applies the actions
//! (memory operations on the pool, scheduler operations) in order.
//!
//! Rules the machine enforces:
//! - pause modes: `abort` aborts every live request; `wait` lets live
//!   requests finish and completes once none is left (or times out, the pause
//!   staying in effect); `keep` freezes them (no steps) and completes at once;
//! - admission: refused (retryable) while paused with `abort`/`wait`, while
//!   asleep, and after a level-2 sleep until weights are reloaded; accepted
//!   and queued during a `keep` pause;
//! - a step runs only when no pause other than `wait` holds, nothing sleeps,
//!   the weights and the KV cache are both mapped and the weights are valid:
//!   the model never reads released (or zeroed) memory;
//! - every operation that releases the KV cache (sleep level >= 1,
//!   `release_kv_cache_memory`) first preempts running requests for
//!   recompute (freeing every block) and invalidates the whole prefix cache,
//!   so that KV zeroed by a wake is never attended to; a weight reload does
//!   the same, so that KV computed with old weights is never reused;
//! - wake maps the given tags (the runtime scratch always); a pause that a
//!   sleep started ends with the final wake, an explicit pause only with
//!   resume;
//! - resume cancels pending pauses/sleeps and maps a KV cache that
//!   `release_kv_cache_memory` released;
//! - release, then reset: an operation that resets the KV cache (a pause
//!   with `clear_cache`, sleep level >= 1, `release_kv_cache_memory`), once
//!   its pause is complete, first releases the KV that transfers hold
//!   ([`Action::ReleaseTransfers`], in this one place) and waits, bounded by
//!   its deadline, until the transfers gave every block back (the core
//!   reports it with [`Machine::set_transfers`]); only then does it reset.
//!   A resume fails such an operation still pending. A pause that keeps the
//!   cache does not wait for transfers.

use std::collections::BTreeSet;
use std::path::PathBuf;
use std::time::Instant;

use pdkv_vmem::Tag;

/// What a pause does to requests that are running.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PauseMode {
    /// Abort running requests (they finish with `FinishReason::Abort`).
    Abort,
    /// Let running requests finish; admit nothing new.
    Wait,
    /// Freeze running requests where they are; they continue after resume.
    Keep,
}

impl PauseMode {
    pub fn parse(s: &str) -> Option<PauseMode> {
        match s {
            "abort" => Some(PauseMode::Abort),
            "wait" => Some(PauseMode::Wait),
            "keep" => Some(PauseMode::Keep),
            _ => None,
        }
    }

    pub fn as_str(self) -> &'static str {
        match self {
            PauseMode::Abort => "abort",
            PauseMode::Wait => "wait",
            PauseMode::Keep => "keep",
        }
    }
}

/// Sleep levels as in vLLM.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SleepLevel {
    /// Pause only; memory stays.
    L0,
    /// Weights offloaded to host memory, KV cache discarded.
    L1,
    /// Weights and KV cache discarded; weights must be reloaded before serving.
    L2,
}

impl SleepLevel {
    pub fn parse(n: u32) -> Option<SleepLevel> {
        match n {
            0 => Some(SleepLevel::L0),
            1 => Some(SleepLevel::L1),
            2 => Some(SleepLevel::L2),
            _ => None,
        }
    }

    pub fn as_u32(self) -> u32 {
        match self {
            SleepLevel::L0 => 0,
            SleepLevel::L1 => 1,
            SleepLevel::L2 => 2,
        }
    }
}

/// Where the weights being served came from.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct WeightInfo {
    /// The version string given with the last reload (`None` for the weights loaded at start).
    pub version: Option<String>,
    pub path: PathBuf,
}

/// The lifecycle state, a snapshot.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LifecycleStatus {
    pub paused: Option<PauseMode>,
    /// Sleep level while asleep (any tag released).
    pub sleeping: Option<SleepLevel>,
    /// Tags whose memory is released now.
    pub asleep_tags: Vec<Tag>,
    /// True after a level-2 wake until weights are reloaded: requests are refused.
    pub weights_discarded: bool,
}

#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum LifecycleError {
    /// The operation needs a completed pause (HTTP 409).
    #[error("{0}")]
    Conflict(String),
    /// Bad argument (HTTP 400).
    #[error("{0}")]
    Invalid(String),
    /// New weights do not fit the running model (HTTP 400); the old weights keep serving.
    #[error("incompatible weights: {0}")]
    IncompatibleWeights(String),
    /// The operation did not finish within its deadline (HTTP 504).
    #[error("timed out: {0}")]
    Timeout(String),
    /// A resume or another operation cancelled this one (HTTP 409).
    #[error("cancelled: {0}")]
    Cancelled(String),
    #[error("the engine has stopped")]
    Stopped,
    /// Memory mapping or loading failed (HTTP 500).
    #[error("{0}")]
    Internal(String),
}

/// Why requests are refused after a level-2 sleep until weights are reloaded.
pub const WEIGHTS_DISCARDED: &str =
    "weights were discarded by sleep level 2; reload them with update_weights";

/// Why a new request is refused now (see [`Lifecycle::admission`]): the
/// text is what the client reads.
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
pub enum Refusal {
    #[error("the engine is asleep (sleep level {}); retry after /wake_up", .0.as_u32())]
    Asleep(SleepLevel),
    /// A sleep still releasing transfers.
    #[error("the engine is going to sleep (sleep level {}); retry after /wake_up", .0.as_u32())]
    GoingToSleep(SleepLevel),
    /// A weight update still releasing transfers.
    #[error("the engine is updating its weights; retry in a moment")]
    UpdatingWeights,
    #[error("{WEIGHTS_DISCARDED}")]
    WeightsDiscarded,
    #[error("the engine is paused (mode {}); retry after /resume", .0.as_str())]
    Paused(PauseMode),
}

/// The message of `release_kv_cache_memory` without a pause.
pub const RELEASE_NEEDS_PAUSE: &str =
    "release_kv_cache_memory needs the engine paused first (POST /pause)";

/// Identifies a command whose reply may be deferred (a `wait` pause or sleep).
pub type Ticket = u64;

/// What the engine core must do, in order.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Action {
    /// End every live request (waiting and running) with `FinishReason::Abort`.
    AbortAll,
    /// Preempt every running request for recompute: its blocks are freed and
    /// it recomputes prompt plus output after scheduling resumes.
    PreemptRunning,
    /// Drop every prefix-cache entry. Follows `PreemptRunning` (or idleness):
    /// every block is free.
    InvalidatePrefixCache,
    /// Drop the hashes of the free blocks only (blocks held by frozen
    /// requests keep theirs).
    ForgetFreeCachedBlocks,
    /// Copy these tags' regions to host memory and release them.
    Offload(Vec<Tag>),
    /// Release these tags' regions; their contents are lost.
    Discard(Vec<Tag>),
    /// Map these tags' regions again (fresh pages, backups restored).
    Wake(Vec<Tag>),
    /// Stop holding KV for transfers: loads in flight are cut short (their
    /// requests recompute), finished requests' KV is no longer kept for
    /// remote readers. Blocks come back as the transfers end.
    ReleaseTransfers,
    /// The KV connector gives up its registrations of the KV cache (before
    /// the KV cache is unmapped). If it cannot, the core applies nothing
    /// after it and restores the machine's state from before the operation
    /// ([`Machine::snapshot`] / [`Machine::restore`]): the operation fails,
    /// the engine stays as it was, and a retry can succeed.
    ReleaseRegistrations,
    /// Write the weights of the `update_weights` call with this ticket into
    /// the weights region; then apply [`Machine::weights_written`].
    ReloadWeights(Ticket),
}

/// The answer to an event: actions to apply now, then (unless deferred) the
/// reply to the caller.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct Outcome {
    pub actions: Vec<Action>,
    /// `None` when the reply is deferred (a pending `wait`); it then comes
    /// from [`Machine::poll`] or [`Machine::resume`].
    pub reply: Option<Result<(), LifecycleError>>,
    /// The actions release memory for a sleep (for the sleep-duration metric).
    pub is_sleep: bool,
}

impl Outcome {
    fn done(actions: Vec<Action>) -> Outcome {
        Outcome {
            actions,
            reply: Some(Ok(())),
            is_sleep: false,
        }
    }

    fn err(e: LifecycleError) -> Outcome {
        Outcome {
            actions: Vec::new(),
            reply: Some(Err(e)),
            is_sleep: false,
        }
    }
}

/// A deferred reply that [`Machine::poll`] or [`Machine::resume`] produced.
#[derive(Debug, PartialEq, Eq)]
pub struct Completion {
    pub ticket: Ticket,
    pub outcome: Outcome,
}

/// Who started the pause: an explicit pause stays until resume, a pause
/// that a sleep started ends with the final wake.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Origin {
    Explicit,
    Sleep,
}

/// What a pending `wait` does once the engine is idle.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Then {
    Pause {
        clear_cache: bool,
    },
    Sleep(SleepLevel),
    /// `release_kv_cache_memory`.
    ReleaseKv,
    /// `update_weights`.
    UpdateWeights,
}

impl Then {
    /// The operation resets the KV cache, so transfers must give their
    /// blocks back first.
    fn resets_cache(self) -> bool {
        matches!(
            self,
            Then::Pause { clear_cache: true }
                | Then::Sleep(SleepLevel::L1 | SleepLevel::L2)
                | Then::ReleaseKv
                | Then::UpdateWeights
        )
    }

    fn name(self) -> &'static str {
        match self {
            Then::Pause { .. } => "pause",
            Then::Sleep(_) => "sleep",
            Then::ReleaseKv => "release_kv_cache_memory",
            Then::UpdateWeights => "update_weights",
        }
    }
}

#[derive(Debug)]
struct Pending {
    ticket: Ticket,
    deadline: Instant,
    then: Then,
    /// Past the pause: waiting for transfers to give their blocks back.
    releasing: bool,
}

/// The machine's state apart from pending operations: what
/// [`Machine::restore`] brings back when an operation's actions failed.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Snapshot {
    pause: Option<(PauseMode, Origin)>,
    sleeping: Option<SleepLevel>,
    asleep: BTreeSet<Tag>,
    weights_discarded: bool,
}

/// The lifecycle state machine (see the module docs).
#[derive(Debug, Default)]
pub struct Machine {
    pause: Option<(PauseMode, Origin)>,
    sleeping: Option<SleepLevel>,
    /// Weights and/or KV cache released now (the runtime tag is not tracked:
    /// it is released with a sleep and woken by every wake).
    asleep: BTreeSet<Tag>,
    weights_discarded: bool,
    pending: Vec<Pending>,
    /// Transfers hold KV blocks (or may, right after an abort), as the core
    /// last reported.
    transfers: bool,
}

impl Machine {
    /// The core reports whether transfers hold KV blocks now (blocks of
    /// finished requests kept for remote readers, loads in flight).
    pub fn set_transfers(&mut self, held: bool) {
        self.transfers = held;
    }

    pub fn new() -> Machine {
        Machine::default()
    }

    /// The state before an operation, for [`Machine::restore`].
    pub fn snapshot(&self) -> Snapshot {
        Snapshot {
            pause: self.pause,
            sleeping: self.sleeping,
            asleep: self.asleep.clone(),
            weights_discarded: self.weights_discarded,
        }
    }

    /// An operation's actions failed part-way (the connector could not
    /// release or restore its registrations, a memory operation failed):
    /// the machine goes back to the state before it. Memory operations are
    /// idempotent, so whatever part did happen is redone or undone by the
    /// next sleep or wake; until then no step runs that the old state
    /// forbids.
    /// The state to go back to when an operation requested in state
    /// `requested` fails after waiting: that state, except that an explicit
    /// pause made while the operation waited stays (its own implicit pause,
    /// a sleep's, goes with it).
    pub fn rollback_target(&self, requested: &Snapshot) -> Snapshot {
        let mut s = requested.clone();
        if let Some((mode, Origin::Explicit)) = self.pause {
            s.pause = Some((mode, Origin::Explicit));
        }
        s
    }

    pub fn restore(&mut self, s: Snapshot) {
        self.pause = s.pause;
        self.sleeping = s.sleeping;
        self.asleep = s.asleep;
        self.weights_discarded = s.weights_discarded;
    }

    pub fn status(&self) -> LifecycleStatus {
        LifecycleStatus {
            paused: self.pause.map(|(m, _)| m),
            sleeping: self.sleeping,
            asleep_tags: self.asleep.iter().copied().collect(),
            weights_discarded: self.weights_discarded,
        }
    }

    /// `Ok` when a new request is accepted now (queued during a keep
    /// pause), else why it is refused.
    pub fn admission(&self) -> Result<(), Refusal> {
        if let Some(level) = self.sleeping {
            return Err(Refusal::Asleep(level));
        }
        // A sleep still releasing transfers refuses already: a request let in
        // now would meet the sleep in the queue.
        if let Some(p) = self
            .pending
            .iter()
            .find(|p| matches!(p.then, Then::Sleep(_)))
        {
            let Then::Sleep(level) = p.then else {
                unreachable!()
            };
            return Err(Refusal::GoingToSleep(level));
        }
        // So is a weight update releasing transfers: it needs the engine idle.
        if self.pending.iter().any(|p| p.then == Then::UpdateWeights) {
            return Err(Refusal::UpdatingWeights);
        }
        if self.weights_discarded {
            return Err(Refusal::WeightsDiscarded);
        }
        match self.pause {
            Some((mode @ (PauseMode::Abort | PauseMode::Wait), _)) => Err(Refusal::Paused(mode)),
            _ => Ok(()),
        }
    }

    /// Whether the core may run a step.
    pub fn may_step(&self) -> bool {
        let pause_allows = matches!(self.pause, None | Some((PauseMode::Wait, _)));
        pause_allows && self.sleeping.is_none() && self.asleep.is_empty() && !self.weights_discarded
    }

    /// The earliest deadline of a pending operation.
    pub fn next_deadline(&self) -> Option<Instant> {
        self.pending.iter().map(|p| p.deadline).min()
    }

    pub fn has_pending(&self) -> bool {
        !self.pending.is_empty()
    }

    /// Enters a pause with `mode` (replacing the current mode); `origin`
    /// becomes explicit unless only a sleep asks for it. Returns the actions
    /// that apply the mode now and whether the pause is complete.
    fn enter_pause(&mut self, mode: PauseMode, origin: Origin, live: bool) -> (Vec<Action>, bool) {
        let origin = match (self.pause, origin) {
            (Some((_, Origin::Explicit)), _) | (_, Origin::Explicit) => Origin::Explicit,
            _ => Origin::Sleep,
        };
        self.pause = Some((mode, origin));
        match mode {
            PauseMode::Abort => (vec![Action::AbortAll], true),
            PauseMode::Keep => (Vec::new(), true),
            PauseMode::Wait => (Vec::new(), !live),
        }
    }

    /// The pause is complete: reset now, or first release the transfers'
    /// KV and wait for it (`ticket` and `deadline` of the operation).
    fn after_pause(&mut self, then: Then, ticket: Ticket, deadline: Instant) -> Outcome {
        if then.resets_cache() && self.transfers {
            self.pending.push(Pending {
                ticket,
                deadline,
                then,
                releasing: true,
            });
            return Outcome {
                actions: vec![Action::ReleaseTransfers],
                reply: None,
                is_sleep: false,
            };
        }
        self.reset(then, ticket)
    }

    /// What an operation does once its pause is complete and no transfer
    /// holds blocks.
    fn reset(&mut self, then: Then, ticket: Ticket) -> Outcome {
        match then {
            Then::UpdateWeights => Outcome::done(vec![Action::ReloadWeights(ticket)]),
            Then::Pause { clear_cache } => {
                let actions = if clear_cache {
                    vec![Action::ForgetFreeCachedBlocks]
                } else {
                    Vec::new()
                };
                Outcome::done(actions)
            }
            Then::Sleep(level) => self.release_for_sleep(level),
            Then::ReleaseKv => {
                self.asleep.insert(Tag::KvCache);
                Outcome::done(vec![
                    Action::PreemptRunning,
                    Action::InvalidatePrefixCache,
                    Action::ReleaseRegistrations,
                    Action::Discard(vec![Tag::KvCache]),
                ])
            }
        }
    }

    /// Pause with `mode`. `live`: some request is waiting or running.
    pub fn pause(
        &mut self,
        mode: PauseMode,
        clear_cache: bool,
        ticket: Ticket,
        deadline: Instant,
        live: bool,
    ) -> Outcome {
        self.pause_then(
            mode,
            Origin::Explicit,
            Then::Pause { clear_cache },
            ticket,
            deadline,
            live,
        )
    }

    /// Enters a pause and runs `then` once it is complete: now, or when
    /// the engine becomes idle (the operation waits as `pending`).
    fn pause_then(
        &mut self,
        mode: PauseMode,
        origin: Origin,
        then: Then,
        ticket: Ticket,
        deadline: Instant,
        live: bool,
    ) -> Outcome {
        let (mut actions, complete) = self.enter_pause(mode, origin, live);
        if complete {
            let mut out = self.after_pause(then, ticket, deadline);
            actions.append(&mut out.actions);
            out.actions = actions;
            out
        } else {
            self.pending.push(Pending {
                ticket,
                deadline,
                then,
                releasing: false,
            });
            Outcome {
                actions,
                reply: None,
                is_sleep: false,
            }
        }
    }

    /// Ends the pause. Pending pauses and sleeps fail with `Cancelled`; a KV
    /// cache released by `release_kv_cache_memory` is mapped again first.
    pub fn resume(&mut self) -> (Outcome, Vec<Completion>) {
        let cancelled = self
            .pending
            .drain(..)
            .map(|p| Completion {
                ticket: p.ticket,
                outcome: Outcome::err(LifecycleError::Cancelled(
                    "a resume ended the pause first".into(),
                )),
            })
            .collect();
        let mut actions = Vec::new();
        if self.pause.is_some() && self.sleeping.is_none() && self.asleep.remove(&Tag::KvCache) {
            actions.push(Action::Wake(vec![Tag::KvCache, Tag::Runtime]));
        }
        self.pause = None;
        (Outcome::done(actions), cancelled)
    }

    /// Pause with `mode`, then release memory per `level`. Sleeping again
    /// while asleep only re-applies the release of the deeper level.
    pub fn sleep(
        &mut self,
        level: SleepLevel,
        mode: PauseMode,
        ticket: Ticket,
        deadline: Instant,
        live: bool,
    ) -> Outcome {
        if let Some(current) = self.sleeping {
            let deeper = if level.as_u32() > current.as_u32() {
                level
            } else {
                current
            };
            return self.release_for_sleep(deeper);
        }
        self.pause_then(
            mode,
            Origin::Sleep,
            Then::Sleep(level),
            ticket,
            deadline,
            live,
        )
    }

    /// The memory side of a sleep; the engine is paused and (for `wait`) idle.
    fn release_for_sleep(&mut self, level: SleepLevel) -> Outcome {
        self.sleeping = Some(level);
        let mut out = match level {
            SleepLevel::L0 => Outcome::done(Vec::new()),
            SleepLevel::L1 => {
                self.asleep.extend([Tag::Weights, Tag::KvCache]);
                Outcome::done(vec![
                    Action::PreemptRunning,
                    Action::InvalidatePrefixCache,
                    Action::ReleaseRegistrations,
                    Action::Offload(vec![Tag::Weights]),
                    Action::Discard(vec![Tag::KvCache, Tag::Runtime]),
                ])
            }
            SleepLevel::L2 => {
                self.asleep.extend([Tag::Weights, Tag::KvCache]);
                self.weights_discarded = true;
                Outcome::done(vec![
                    Action::PreemptRunning,
                    Action::InvalidatePrefixCache,
                    Action::ReleaseRegistrations,
                    Action::Discard(vec![Tag::Weights, Tag::KvCache, Tag::Runtime]),
                ])
            }
        };
        out.is_sleep = true;
        out
    }

    /// Completes pending operations: those whose `wait` is over (`live` is
    /// false) succeed, those past their deadline time out (the pause stays).
    pub fn poll(&mut self, live: bool, now: Instant) -> Vec<Completion> {
        let mut out = Vec::new();
        let pending = std::mem::take(&mut self.pending);
        let mut keep = Vec::new();
        for p in pending {
            if p.releasing {
                if !self.transfers {
                    out.push(Completion {
                        ticket: p.ticket,
                        outcome: self.reset(p.then, p.ticket),
                    });
                } else if now >= p.deadline {
                    out.push(Completion {
                        ticket: p.ticket,
                        outcome: Outcome::err(LifecycleError::Timeout(format!(
                            "KV transfers still held blocks when the {} deadline passed; the pause stays in effect",
                            p.then.name()
                        ))),
                    });
                } else {
                    keep.push(p);
                }
                continue;
            }
            // A keep or abort pause that replaced the wait decides now.
            let waiting = live && matches!(self.pause, Some((PauseMode::Wait, _)));
            if !waiting && self.pause.is_some() {
                // `after_pause` may file the operation again, as releasing.
                self.pending.append(&mut keep);
                let outcome = self.after_pause(p.then, p.ticket, p.deadline);
                keep = std::mem::take(&mut self.pending);
                out.push(Completion {
                    ticket: p.ticket,
                    outcome,
                });
            } else if now >= p.deadline {
                let what = p.then.name();
                out.push(Completion {
                    ticket: p.ticket,
                    outcome: Outcome::err(LifecycleError::Timeout(format!(
                        "requests were still running when the {what} deadline passed; the pause stays in effect"
                    ))),
                });
            } else {
                keep.push(p);
            }
        }
        self.pending = keep;
        out
    }

    /// Maps `tags` again (`None`: weights and KV cache); the runtime scratch
    /// always wakes. When nothing sleeps any more, a sleep ends, and so does
    /// a pause that the sleep started.
    pub fn wake(&mut self, tags: Option<&[Tag]>) -> Outcome {
        let asked: Vec<Tag> = match tags {
            None => vec![Tag::Weights, Tag::KvCache],
            Some(t) => t.iter().copied().filter(|&t| t != Tag::Runtime).collect(),
        };
        if self.sleeping.is_none() && self.asleep.is_empty() {
            return Outcome::done(Vec::new());
        }
        for t in &asked {
            self.asleep.remove(t);
        }
        let mut wake: Vec<Tag> = asked;
        wake.push(Tag::Runtime);
        if self.asleep.is_empty() && self.sleeping.take().is_some() {
            if let Some((_, Origin::Sleep)) = self.pause {
                self.pause = None;
                // A timed-out sleep's pending wait can no longer matter.
                self.pending.clear();
            }
        }
        Outcome::done(vec![Action::Wake(wake)])
    }

    /// Frees every block and releases the KV cache; needs a completed pause.
    /// Without transfers holding blocks it completes at once; otherwise it
    /// waits for them until `deadline` (see [`Machine::set_transfers`]).
    pub fn release_kv_with(&mut self, ticket: Ticket, deadline: Instant) -> Outcome {
        if self.pause.is_none() {
            return Outcome::err(LifecycleError::Conflict(RELEASE_NEEDS_PAUSE.into()));
        }
        if !self.pending.is_empty() {
            return Outcome::err(LifecycleError::Conflict(
                "release_kv_cache_memory needs a completed pause; requests are still finishing"
                    .into(),
            ));
        }
        self.after_pause(Then::ReleaseKv, ticket, deadline)
    }

    /// [`Machine::release_kv_with`] for an engine without transfers (it
    /// never waits, so it needs no ticket or deadline). Tests only: it
    /// reads the system clock.
    #[cfg(test)]
    pub fn release_kv(&mut self) -> Outcome {
        debug_assert!(
            !self.transfers,
            "an engine with transfers uses release_kv_with"
        );
        self.release_kv_with(0, Instant::now())
    }

    /// Whether weights may be reloaded now. They must be mapped, and no
    /// request may be running unless a keep pause froze it (such requests
    /// recompute with the new weights after resume). `live`: some request is
    /// waiting or running.
    pub fn check_update_weights(&self, live: bool) -> Result<(), LifecycleError> {
        if self.asleep.contains(&Tag::Weights) {
            return Err(LifecycleError::Conflict(
                "the weights are asleep; wake weights first (POST /wake_up?tags=weights)".into(),
            ));
        }
        let frozen = matches!(self.pause, Some((PauseMode::Keep, _)));
        if live && !frozen {
            return Err(LifecycleError::Conflict(
                "update_weights needs the engine idle or paused (POST /pause): requests are live"
                    .into(),
            ));
        }
        Ok(())
    }

    /// Starts a weight update (see [`Machine::check_update_weights`]): at
    /// once when no transfer holds KV ([`Action::ReloadWeights`]), else
    /// after releasing the transfers' KV, like every cache reset (requests
    /// are refused meanwhile; a resume cancels it; `deadline` bounds it).
    pub fn update_weights(&mut self, ticket: Ticket, deadline: Instant, live: bool) -> Outcome {
        if let Err(e) = self.check_update_weights(live) {
            return Outcome::err(e);
        }
        if let Some(p) = self.pending.first() {
            return Outcome::err(LifecycleError::Conflict(format!(
                "update_weights: a {} is still in progress",
                p.then.name()
            )));
        }
        self.after_pause(Then::UpdateWeights, ticket, deadline)
    }

    /// New weights are in place (`complete`), or writing them failed part-way
    /// (the weights are then unusable until a reload succeeds). Either way no
    /// KV computed with the old weights may be reused.
    pub fn weights_written(&mut self, complete: bool) -> Vec<Action> {
        self.weights_discarded = !complete;
        vec![Action::PreemptRunning, Action::InvalidatePrefixCache]
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    fn later() -> Instant {
        Instant::now() + Duration::from_secs(60)
    }

    /// Resumes `m`, which has one pending operation: the resume itself
    /// does nothing else, and the pending one is cancelled.
    fn resume_cancels_one(m: &mut Machine) {
        let (out, cancelled) = m.resume();
        assert_eq!(out, ok(vec![]));
        assert_eq!(cancelled.len(), 1);
        assert!(matches!(
            cancelled[0].outcome.reply,
            Some(Err(LifecycleError::Cancelled(_)))
        ));
    }

    fn ok(actions: Vec<Action>) -> Outcome {
        Outcome::done(actions)
    }

    #[test]
    fn pause_modes_decide_admission_and_steps() {
        let mut m = Machine::new();
        assert!(m.may_step() && m.admission().is_ok());
        assert_eq!(
            m.pause(PauseMode::Abort, false, 1, later(), true),
            ok(vec![Action::AbortAll])
        );
        assert!(!m.may_step());
        assert!(m
            .admission()
            .unwrap_err()
            .to_string()
            .contains("paused (mode abort)"));
        m.resume();
        assert!(m.may_step() && m.admission().is_ok());

        let out = m.pause(PauseMode::Keep, true, 2, later(), true);
        assert_eq!(out, ok(vec![Action::ForgetFreeCachedBlocks]));
        assert!(!m.may_step(), "keep freezes running requests");
        assert!(m.admission().is_ok(), "keep queues new requests");
        assert_eq!(m.status().paused, Some(PauseMode::Keep));
        m.resume();
        assert_eq!(m.status().paused, None);
    }

    #[test]
    fn wait_completes_when_idle_or_times_out() {
        let mut m = Machine::new();
        let out = m.pause(PauseMode::Wait, true, 7, later(), true);
        assert_eq!(out.reply, None, "deferred while requests run");
        assert!(m.may_step(), "running requests go on under wait");
        assert!(m.admission().is_err());
        assert!(m.poll(true, Instant::now()).is_empty());
        let done = m.poll(false, Instant::now());
        assert_eq!(
            done,
            vec![Completion {
                ticket: 7,
                outcome: ok(vec![Action::ForgetFreeCachedBlocks])
            }]
        );
        m.resume();

        let t0 = Instant::now();
        m.pause(
            PauseMode::Wait,
            false,
            8,
            t0 + Duration::from_millis(5),
            true,
        );
        let done = m.poll(true, t0 + Duration::from_millis(6));
        assert_eq!(done.len(), 1);
        assert!(matches!(
            done[0].outcome.reply,
            Some(Err(LifecycleError::Timeout(_)))
        ));
        assert_eq!(
            m.status().paused,
            Some(PauseMode::Wait),
            "the pause stays after a timeout"
        );
    }

    #[test]
    fn resume_cancels_pending_operations() {
        let mut m = Machine::new();
        m.sleep(SleepLevel::L1, PauseMode::Wait, 3, later(), true);
        resume_cancels_one(&mut m);
        assert!(m.poll(false, Instant::now()).is_empty());
        assert_eq!(
            m.status().sleeping,
            None,
            "a cancelled sleep releases nothing"
        );
    }

    #[test]
    fn sleep_levels_release_and_invalidate() {
        let mut m = Machine::new();
        let out = m.sleep(SleepLevel::L1, PauseMode::Keep, 1, later(), true);
        assert_eq!(
            out.actions,
            vec![
                Action::PreemptRunning,
                Action::InvalidatePrefixCache,
                Action::ReleaseRegistrations,
                Action::Offload(vec![Tag::Weights]),
                Action::Discard(vec![Tag::KvCache, Tag::Runtime]),
            ]
        );
        assert!(out.is_sleep);
        assert!(!m.may_step() && m.admission().unwrap_err().to_string().contains("asleep"));
        // Idempotent: sleeping again re-applies the same (idempotent) release.
        assert_eq!(
            m.sleep(SleepLevel::L1, PauseMode::Abort, 2, later(), false)
                .actions,
            out.actions
        );
        assert_eq!(
            m.wake(None),
            ok(vec![Action::Wake(vec![
                Tag::Weights,
                Tag::KvCache,
                Tag::Runtime
            ])])
        );
        assert!(
            m.may_step() && m.admission().is_ok(),
            "the final wake ends the sleep's pause"
        );
        assert_eq!(m.status(), Machine::new().status());

        let out = m.sleep(SleepLevel::L2, PauseMode::Abort, 3, later(), false);
        assert_eq!(out.actions[0], Action::AbortAll);
        assert!(out.actions.contains(&Action::Discard(vec![
            Tag::Weights,
            Tag::KvCache,
            Tag::Runtime
        ])));
        m.wake(None);
        assert!(!m.may_step());
        assert_eq!(m.admission().unwrap_err().to_string(), WEIGHTS_DISCARDED);
        assert!(m.check_update_weights(false).is_ok());
        assert_eq!(
            m.weights_written(true),
            vec![Action::PreemptRunning, Action::InvalidatePrefixCache]
        );
        assert!(m.may_step() && m.admission().is_ok());

        let out = m.sleep(SleepLevel::L0, PauseMode::Abort, 4, later(), false);
        assert_eq!(out.actions, vec![Action::AbortAll]);
        assert!(!m.may_step() && m.status().sleeping == Some(SleepLevel::L0));
        m.wake(Some(&[Tag::Weights]));
        assert!(m.may_step());
    }

    #[test]
    fn selective_wake_in_either_order() {
        for order in [[Tag::Weights, Tag::KvCache], [Tag::KvCache, Tag::Weights]] {
            let mut m = Machine::new();
            m.sleep(SleepLevel::L1, PauseMode::Abort, 1, later(), false);
            assert_eq!(
                m.wake(Some(&order[..1])),
                ok(vec![Action::Wake(vec![order[0], Tag::Runtime])])
            );
            assert!(!m.may_step() && m.admission().is_err());
            assert_eq!(m.status().asleep_tags, vec![order[1]]);
            m.wake(Some(&order[1..]));
            assert!(m.may_step() && m.admission().is_ok());
        }
    }

    #[test]
    fn explicit_pause_survives_the_wake() {
        let mut m = Machine::new();
        m.pause(PauseMode::Keep, false, 1, later(), false);
        m.sleep(SleepLevel::L1, PauseMode::Keep, 2, later(), false);
        m.wake(None);
        assert_eq!(m.status().paused, Some(PauseMode::Keep));
        assert!(!m.may_step());
        m.resume();
        assert!(m.may_step());
    }

    #[test]
    fn wake_when_awake_changes_nothing() {
        let mut m = Machine::new();
        assert_eq!(m.wake(None), ok(vec![]));
        assert_eq!(m.status(), Machine::new().status());
    }

    #[test]
    fn release_kv_needs_a_pause_and_resume_maps_it_again() {
        let mut m = Machine::new();
        let out = m.release_kv();
        assert_eq!(
            out.reply,
            Some(Err(LifecycleError::Conflict(RELEASE_NEEDS_PAUSE.into())))
        );
        m.pause(PauseMode::Keep, false, 1, later(), true);
        assert_eq!(
            m.release_kv(),
            ok(vec![
                Action::PreemptRunning,
                Action::InvalidatePrefixCache,
                Action::ReleaseRegistrations,
                Action::Discard(vec![Tag::KvCache])
            ])
        );
        assert!(m.admission().is_ok(), "keep still queues");
        let (out, _) = m.resume();
        assert_eq!(
            out,
            ok(vec![Action::Wake(vec![Tag::KvCache, Tag::Runtime])])
        );
        assert!(m.may_step());
    }

    #[test]
    fn names_parse_both_ways() {
        for m in [PauseMode::Abort, PauseMode::Wait, PauseMode::Keep] {
            assert_eq!(PauseMode::parse(m.as_str()), Some(m));
        }
        assert_eq!(PauseMode::parse("freeze"), None);
        for (n, l) in [
            (0, SleepLevel::L0),
            (1, SleepLevel::L1),
            (2, SleepLevel::L2),
        ] {
            assert_eq!(SleepLevel::parse(n), Some(l));
            assert_eq!(l.as_u32(), n);
        }
        assert_eq!(SleepLevel::parse(3), None);
        assert_eq!(Then::Sleep(SleepLevel::L1).name(), "sleep");
        assert_eq!(Then::Pause { clear_cache: true }.name(), "pause");
        assert_eq!(Then::ReleaseKv.name(), "release_kv_cache_memory");
        assert_eq!(Then::UpdateWeights.name(), "update_weights");
    }

    #[test]
    fn sleeping_again_only_goes_deeper() {
        let mut m = Machine::new();
        m.sleep(SleepLevel::L1, PauseMode::Abort, 1, later(), false);
        // L2 while at L1: the weights are discarded too.
        let out = m.sleep(SleepLevel::L2, PauseMode::Abort, 2, later(), false);
        assert!(
            out.actions.contains(&Action::Discard(vec![
                Tag::Weights,
                Tag::KvCache,
                Tag::Runtime
            ])),
            "{out:?}"
        );
        assert_eq!(
            (m.status().sleeping, m.status().weights_discarded),
            (Some(SleepLevel::L2), true)
        );
        // L1 while at L2 stays at L2.
        m.sleep(SleepLevel::L1, PauseMode::Abort, 3, later(), false);
        assert_eq!(m.status().sleeping, Some(SleepLevel::L2));
        // L0 while at L1 stays at L1.
        let mut m = Machine::new();
        m.sleep(SleepLevel::L1, PauseMode::Abort, 1, later(), false);
        m.sleep(SleepLevel::L0, PauseMode::Abort, 2, later(), false);
        assert_eq!(m.status().sleeping, Some(SleepLevel::L1));
    }

    #[test]
    fn the_earliest_pending_deadline_is_the_next_one() {
        let mut m = Machine::new();
        assert_eq!((m.next_deadline(), m.has_pending()), (None, false));
        let t0 = Instant::now();
        m.pause(PauseMode::Wait, false, 1, t0 + Duration::from_secs(9), true);
        m.sleep(
            SleepLevel::L1,
            PauseMode::Wait,
            2,
            t0 + Duration::from_secs(3),
            true,
        );
        assert!(m.has_pending());
        assert_eq!(m.next_deadline(), Some(t0 + Duration::from_secs(3)));
    }

    #[test]
    fn cache_resets_release_transfers_first_and_wait_for_them() {
        let sleep_actions = vec![
            Action::PreemptRunning,
            Action::InvalidatePrefixCache,
            Action::ReleaseRegistrations,
            Action::Offload(vec![Tag::Weights]),
            Action::Discard(vec![Tag::KvCache, Tag::Runtime]),
        ];
        let mut m = Machine::new();
        m.set_transfers(true);
        let out = m.sleep(SleepLevel::L1, PauseMode::Keep, 1, later(), true);
        assert_eq!(
            (out.actions, out.reply),
            (vec![Action::ReleaseTransfers], None)
        );
        assert_eq!(
            m.status().sleeping,
            None,
            "nothing is released before the transfers gave their blocks back"
        );
        assert!(
            m.admission().is_err(),
            "a sleep on its way refuses new requests, even in keep mode"
        );
        assert!(m.poll(true, Instant::now()).is_empty());
        m.set_transfers(false);
        let done = m.poll(true, Instant::now());
        assert_eq!(done.len(), 1);
        assert_eq!(
            (done[0].ticket, &done[0].outcome.actions),
            (1, &sleep_actions)
        );
        assert_eq!(done[0].outcome.reply, Some(Ok(())));
        assert_eq!(m.status().sleeping, Some(SleepLevel::L1));

        // A pause that keeps the cache does not wait for transfers.
        let mut m = Machine::new();
        m.set_transfers(true);
        assert_eq!(
            m.pause(PauseMode::Keep, false, 1, later(), true),
            ok(vec![])
        );
        // One that clears it does, and so does release_kv_cache_memory.
        let out = m.pause(PauseMode::Keep, true, 2, later(), true);
        assert_eq!(
            (out.actions, out.reply),
            (vec![Action::ReleaseTransfers], None)
        );
        m.set_transfers(false);
        assert_eq!(
            m.poll(false, Instant::now())[0].outcome,
            ok(vec![Action::ForgetFreeCachedBlocks])
        );
        m.set_transfers(true);
        let out = m.release_kv_with(3, later());
        assert_eq!(
            (out.actions, out.reply),
            (vec![Action::ReleaseTransfers], None)
        );
        m.set_transfers(false);
        let done = m.poll(false, Instant::now());
        assert_eq!(
            done[0].outcome,
            ok(vec![
                Action::PreemptRunning,
                Action::InvalidatePrefixCache,
                Action::ReleaseRegistrations,
                Action::Discard(vec![Tag::KvCache])
            ])
        );
    }

    #[test]
    fn a_release_that_outlives_its_deadline_times_out_and_resume_cancels_one() {
        let mut m = Machine::new();
        m.set_transfers(true);
        let t0 = Instant::now();
        m.sleep(
            SleepLevel::L2,
            PauseMode::Abort,
            1,
            t0 + Duration::from_millis(5),
            false,
        );
        assert!(m.poll(false, t0 + Duration::from_millis(1)).is_empty());
        let done = m.poll(false, t0 + Duration::from_millis(6));
        assert!(
            matches!(done[0].outcome.reply, Some(Err(LifecycleError::Timeout(_)))),
            "{done:?}"
        );
        assert!(
            done[0].outcome.actions.is_empty(),
            "nothing is discarded while transfers hold blocks"
        );
        assert_eq!(m.status().sleeping, None);
        assert!(!m.may_step(), "the pause stays");

        let mut m = Machine::new();
        m.set_transfers(true);
        m.sleep(SleepLevel::L1, PauseMode::Keep, 4, later(), true);
        resume_cancels_one(&mut m);
        assert!(m.may_step());
    }

    #[test]
    fn weight_updates_need_mapped_weights_and_no_running_requests() {
        let mut m = Machine::new();
        assert!(m.check_update_weights(false).is_ok());
        assert!(matches!(
            m.check_update_weights(true),
            Err(LifecycleError::Conflict(_))
        ));
        m.pause(PauseMode::Keep, false, 1, later(), true);
        assert!(
            m.check_update_weights(true).is_ok(),
            "frozen requests recompute"
        );
        m.resume();
        m.sleep(SleepLevel::L1, PauseMode::Abort, 2, later(), false);
        let e = m.check_update_weights(false).unwrap_err();
        assert!(e.to_string().contains("wake weights first"));
        m.wake(Some(&[Tag::Weights]));
        assert!(m.check_update_weights(false).is_ok());
        m.weights_written(false);
        assert!(
            m.status().weights_discarded,
            "a partial write leaves unusable weights"
        );
    }

    #[test]
    fn a_failed_operation_restores_the_state_before_it() {
        let mut m = Machine::new();
        m.pause(PauseMode::Keep, false, 1, later(), true);
        let before = m.snapshot();
        let out = m.sleep(SleepLevel::L1, PauseMode::Keep, 2, later(), true);
        assert!(out.actions.contains(&Action::ReleaseRegistrations));
        assert_eq!(m.status().sleeping, Some(SleepLevel::L1));
        // The connector could not release: the sleep did not happen.
        m.restore(before.clone());
        assert_eq!(m.status().sleeping, None);
        assert_eq!(m.status().paused, Some(PauseMode::Keep), "the pause stays");
        assert!(m.admission().is_ok(), "keep still queues");
        // A retry goes through the same way.
        assert_eq!(
            m.sleep(SleepLevel::L1, PauseMode::Keep, 3, later(), true)
                .actions,
            out.actions
        );

        // A wake whose registration restore failed: still asleep, and the
        // next wake does the work again (not a no-op).
        let asleep = m.snapshot();
        let woke = m.wake(None);
        assert_eq!(m.status().sleeping, None);
        m.restore(asleep);
        assert_eq!(m.status().sleeping, Some(SleepLevel::L1));
        assert!(!m.may_step());
        assert_eq!(m.wake(None), woke, "the retry wakes the same tags");
        assert!(m.status().asleep_tags.is_empty());
        assert_eq!(
            m.snapshot(),
            before,
            "after the wake: paused (keep) as before the sleep"
        );
    }

    #[test]
    fn a_weight_update_goes_through_release_then_reset() {
        let t0 = Instant::now();
        // Idle, no transfers: at once.
        let mut m = Machine::new();
        assert_eq!(
            m.update_weights(1, later(), false),
            ok(vec![Action::ReloadWeights(1)])
        );
        assert!(matches!(
            m.update_weights(2, later(), true).reply,
            Some(Err(LifecycleError::Conflict(_)))
        ));
        // Transfers hold KV: released first, requests refused meanwhile,
        // then the reload.
        m.set_transfers(true);
        let out = m.update_weights(3, t0 + Duration::from_secs(5), false);
        assert_eq!(
            (out.actions, out.reply),
            (vec![Action::ReleaseTransfers], None)
        );
        assert!(m
            .admission()
            .unwrap_err()
            .to_string()
            .contains("updating its weights"));
        assert!(matches!(
            m.update_weights(4, later(), false).reply,
            Some(Err(LifecycleError::Conflict(_)))
        ));
        assert!(m.poll(false, t0).is_empty());
        m.set_transfers(false);
        let done = m.poll(false, t0);
        assert_eq!(
            done,
            vec![Completion {
                ticket: 3,
                outcome: ok(vec![Action::ReloadWeights(3)])
            }]
        );
        assert!(m.admission().is_ok());
        // Bounded, and a resume cancels it.
        m.set_transfers(true);
        m.update_weights(5, t0 + Duration::from_secs(5), false);
        let done = m.poll(false, t0 + Duration::from_secs(5));
        assert!(
            matches!(done[0].outcome.reply, Some(Err(LifecycleError::Timeout(_)))),
            "{done:?}"
        );
        m.update_weights(6, later(), false);
        let (_, cancelled) = m.resume();
        assert!(matches!(
            cancelled[0].outcome.reply,
            Some(Err(LifecycleError::Cancelled(_)))
        ));
        assert!(m.admission().is_ok());
        // Frozen by a keep pause: allowed with live requests.
        let mut m = Machine::new();
        m.pause(PauseMode::Keep, false, 1, later(), true);
        assert_eq!(
            m.update_weights(7, later(), true),
            ok(vec![Action::ReloadWeights(7)])
        );
    }
}
