//! The prefill engine's sending side as a pure state machine.
//!
//! No I/O, no clock, no threads: the driver passes events and the time in and
//! carries out the [`Action`]s that come out of [`SendMachine::poll_action`].
//! Every table is ordered (`BTreeMap`), so the same events give the same
//! actions in the same order: a simulation replays exactly.
//!
//! Per transfer (one request on P, named by its `transfer_id`):
//! - **WAITING**: the request is queued or running; a pull that arrives now
//!   is parked;
//! - **READY**: the request finished; its blocks are held for D until a pull
//!   took them or the lease expired: `abort_timeout` from the finish, or
//!   from D's last *claim*, whichever is later;
//! - **DONE**: nothing more to send; kept a while as a tombstone so a late
//!   pull or drop gets a precise answer ([`Failure`] with its [`FailCode`]).
//!
//! Deadlines count from when P's KV is ready, not from a pull's receipt: a
//! pull parked on a WAITING transfer waits while P computes (however long
//! the prompt), bounded only by `prefill_timeout`, and gets a
//! [`Action::Progress`] every `heartbeat` so that D, which gives up
//! `load_timeout` after it last heard from P, knows P is alive. Once the
//! transfer is READY and the pull matched, the pull has `abort_timeout` for
//! its write (P tells D with one more progress at that moment, so D's clock
//! restarts then too and outlasts P's).
//!
//! Invariants:
//! - every pull is answered exactly once ([`Action::Answer`]): success, or an
//!   error at once when P aborted the request, D released the transfer, the
//!   lease expired, the pull does not match the transfer (both numbers
//!   named), a deadline passed, or the write failed;
//! - [`SendMachine::end_send`] is the only way a send ends; it queues the
//!   request for [`SendMachine::take_finished`] (the engine frees the blocks)
//!   once no write reads the blocks;
//! - a transfer is pulled at most once: after its pull was answered the send
//!   ends, and a second pull is refused;
//! - a pull takes one of `num_workers` permits only when its transfer is
//!   READY and it matched, and gives it back when its write ended;
//! - a write in flight is never cut short: it ends by the pull's deadline.
//!   Only D's drop answers the writing pull early (with
//!   [`FailCode::Dropped`]); every other answer comes once no write of the
//!   pull is in flight, and so does the drop's own answer: D may reuse its
//!   blocks on any answer but that early one;
//! - every parked or queued pull has a deadline (`arrival_timeout` from its
//!   receipt while its transfer is unknown, `prefill_timeout` from its
//!   receipt while the transfer waits, `abort_timeout` from its admission).
//!
//! Claims: a D that queued the request but has not admitted it yet (a busy
//! D's queue can be longer than any fixed lease) claims the transfer and
//! claims it again before each lease runs out ([`SendMachine::on_claim`]).
//! A claim on a WAITING transfer counts from when it becomes READY at the
//! earliest. So only a transfer no D claims (the proxy never sent its
//! request on, D crashed, D dropped it) expires `abort_timeout` after its
//! finish or its last claim, and its blocks go back in bounded time.
//! Memory pressure is the one other way a held transfer ends early: when
//! P's engine cannot admit a new prompt because transfers hold its blocks,
//! [`SendMachine::reclaim`] gives back unclaimed transfers first (oldest
//! first), then claimed ones newest first (those D reaches last), with
//! [`FailCode::Reclaimed`] (D recomputes).
//!
//! Read mode uses the same states with no pull: D reads the READY blocks
//! one-sided while the *lease* (`abort_timeout` from the finish) holds them,
//! then reports [`SendMachine::on_read_done`], which ends the send at once.
//! The read is valid only if the transfer was still READY when that report
//! came: a lease that expired, was aborted or released gave the blocks back
//! meanwhile, and the report learns why.

use std::collections::{BTreeMap, VecDeque};
use std::sync::Arc;
use std::time::{Duration, Instant};

pub use crate::wire::{FailCode, Failure};

pub type PullId = u64;
pub type DropId = u64;

/// Most pulls held at once (parked, queued or writing); one more is
/// refused at once. A pull for a transfer P has not seen yet waits up to
/// `arrival_timeout`, so without a bound a peer could park them without end.
pub const MAX_PULLS: usize = 4096;

/// Most ended transfers remembered at once (the oldest go first).
pub const MAX_TOMBSTONES: usize = 1 << 16;

/// The message a pull gets when D released the transfer.
pub const RELEASED: &str = "released by the decode engine";

/// The message a pull gets when P stopped holding KV for a cache reset
/// ([`SendMachine::abort_all`]).
pub const CACHE_RESET: &str = "the prefill engine released the KV (cache reset)";

/// The message a pull gets when P's KV cache registration is released
/// (the engine sleeps).
pub const ASLEEP: &str = "the prefill engine's KV cache is released (asleep)";

#[derive(Clone, Debug)]
pub struct SendConfig {
    pub abort_timeout: Duration,
    pub arrival_timeout: Duration,
    /// The longest a pull waits for its request to finish computing.
    pub prefill_timeout: Duration,
    /// How often a waiting pull hears that P is still computing.
    pub heartbeat: Duration,
    pub num_workers: usize,
    /// Tokens per block.
    pub block_size: usize,
}

/// A pull as the machine checks it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PullSpec {
    pub transfer_id: String,
    pub first_block: usize,
    pub num_tokens: usize,
    /// Destination blocks D sent.
    pub num_blocks: usize,
    /// The weights version D serves; KV computed with other weights is refused.
    pub weights_version: Option<String>,
}

/// What the driver must do.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Action {
    /// Answer the pull (once).
    Answer {
        pull: PullId,
        result: Result<(), Failure>,
    },
    /// Tell the pull's D that P is alive and working on it (D's deadline
    /// restarts).
    Progress { pull: PullId },
    /// Write `src_blocks` (P's block ids, in the order of D's offsets), by
    /// `deadline`, then report [`SendMachine::on_write_done`].
    StartWrite {
        pull: PullId,
        src_blocks: Vec<u32>,
        deadline: Instant,
    },
    /// Answer the drop (once).
    DropAnswer { drop: DropId, known: bool },
}

#[derive(Clone, Debug, PartialEq)]
enum Phase {
    Waiting,
    Ready {
        expires: Instant,
    },
    Done {
        failure: Failure,
        forget_at: Instant,
    },
}

/// The state of one transfer as a test sees it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PhaseName {
    Waiting,
    Ready,
    Done,
}

struct Transfer {
    req: Option<Arc<str>>,
    phase: Phase,
    /// The engine keeps `blocks` for this transfer until the request is
    /// handed back through `take_finished`.
    holding: bool,
    blocks: Vec<u32>,
    prompt_len: usize,
    /// The weights version the KV was computed with (set at READY).
    weights_version: Option<String>,
    /// The pull whose write reads the blocks now.
    writing: Option<PullId>,
    /// Drops answered once no write reads the blocks.
    drop_waiters: Vec<DropId>,
    /// Set by [`SendMachine::abort_all`] while WAITING: the send ends (with
    /// [`FailCode::CacheReset`]) instead of becoming READY when the request
    /// finishes.
    reset: bool,
    /// Until when a D's last claim holds the lease (`None`: never
    /// claimed); a claim while WAITING counts from READY at the earliest.
    claimed_until: Option<Instant>,
    /// Order in which transfers became READY (for reclaiming).
    ready_seq: u64,
}

impl Transfer {
    fn waiting(req: Option<Arc<str>>) -> Transfer {
        Transfer {
            req,
            phase: Phase::Waiting,
            holding: false,
            blocks: Vec::new(),
            prompt_len: 0,
            weights_version: None,
            writing: None,
            drop_waiters: Vec::new(),
            reset: false,
            claimed_until: None,
            ready_seq: 0,
        }
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum PullState {
    /// Its transfer is unknown or WAITING.
    Parked,
    /// Matched a READY transfer; waits for a permit.
    Queued,
    /// Its write runs; `answered` once D got an answer early (drop).
    Writing { answered: bool },
}

struct PendingPull {
    spec: PullSpec,
    deadline: Instant,
    /// `prefill_timeout` from receipt: the deadline once the transfer is known.
    full_deadline: Instant,
    /// When a parked pull next tells D that P is alive.
    next_heartbeat: Instant,
    state: PullState,
    src_blocks: Vec<u32>,
}

/// See the module docs.
pub struct SendMachine {
    cfg: SendConfig,
    transfers: BTreeMap<String, Transfer>,
    pulls: BTreeMap<PullId, PendingPull>,
    /// The pull of each transfer (one at most).
    pull_of: BTreeMap<String, PullId>,
    queue: VecDeque<PullId>,
    permits: usize,
    actions: VecDeque<Action>,
    finished: Vec<Arc<str>>,
    /// The weights P serves now.
    weights_version: Option<String>,
    /// Sends ended since the tombstones were last bounded.
    done_since_bound: usize,
    leases: LeaseCounts,
    next_ready_seq: u64,
}

/// What happened to leases, for metrics and the simulator's checks.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct LeaseCounts {
    /// Claims received (one per transfer named).
    pub claims: u64,
    /// Leases that expired on transfers no D had claimed.
    pub expired_unclaimed: u64,
    /// Leases that expired although a D had claimed the transfer (its
    /// claims stopped: it crashed or lost P).
    pub expired_claimed: u64,
    /// Transfers given back early because P needed their blocks.
    pub reclaimed: u64,
}

impl SendMachine {
    pub fn new(cfg: SendConfig) -> SendMachine {
        let permits = cfg.num_workers.max(1);
        SendMachine {
            cfg,
            transfers: BTreeMap::new(),
            pulls: BTreeMap::new(),
            pull_of: BTreeMap::new(),
            queue: VecDeque::new(),
            permits,
            actions: VecDeque::new(),
            finished: Vec::new(),
            weights_version: None,
            done_since_bound: 0,
            leases: LeaseCounts::default(),
            next_ready_seq: 0,
        }
    }

    /// P's engine needs `blocks` more blocks than it has free and transfers
    /// hold them: READY transfers no write reads end with
    /// [`FailCode::Reclaimed`] — unclaimed ones first, oldest first, then
    /// claimed ones newest first — until their blocks cover `blocks`.
    /// Returns the blocks given back (through `take_finished`).
    pub fn reclaim(&mut self, now: Instant, blocks: usize) -> usize {
        let mut candidates: Vec<(bool, i64, String, usize)> = self
            .transfers
            .iter()
            .filter(|(k, t)| {
                matches!(t.phase, Phase::Ready { .. })
                    && t.writing.is_none()
                    && !self.pull_of.contains_key(*k)
            })
            .map(|(k, t)| {
                // Unclaimed before claimed; oldest unclaimed, newest claimed.
                let order = if t.claimed_until.is_some() {
                    -(t.ready_seq as i64)
                } else {
                    t.ready_seq as i64
                };
                (t.claimed_until.is_some(), order, k.clone(), t.blocks.len())
            })
            .collect();
        candidates.sort();
        let mut freed = 0;
        for (_, _, tid, n) in candidates {
            if freed >= blocks {
                break;
            }
            let why = format!(
                "the prefill engine needed the blocks of transfer {tid:?} for new prompts before a decode engine took them"
            );
            self.end_send(now, &tid, Failure::new(FailCode::Reclaimed, why), false);
            self.leases.reclaimed += 1;
            freed += n;
        }
        freed
    }

    /// How long a claim holds the lease from its receipt.
    pub fn lease(&self) -> Duration {
        self.cfg.abort_timeout
    }

    pub fn lease_counts(&self) -> LeaseCounts {
        self.leases
    }

    /// A D holds a queued request for `transfer_id`: the lease runs on for
    /// `abort_timeout` from now (from when the transfer becomes READY at the
    /// earliest). `Err`: P does not hold the transfer, and why; `Unknown`
    /// while P has not seen its request yet (D claims again later).
    pub fn on_claim(&mut self, now: Instant, transfer_id: &str) -> Result<(), Failure> {
        self.leases.claims += 1;
        let until = now + self.cfg.abort_timeout;
        let Some(t) = self.transfers.get_mut(transfer_id) else {
            return Err(Failure::new(
                FailCode::Unknown,
                format!("transfer {transfer_id:?} is unknown to the prefill engine"),
            ));
        };
        match &mut t.phase {
            Phase::Ready { expires } => *expires = (*expires).max(until),
            Phase::Waiting => {}
            Phase::Done { failure, .. } => return Err(failure.clone()),
        }
        t.claimed_until = Some(t.claimed_until.map_or(until, |u| u.max(until)));
        Ok(())
    }

    /// How long a DONE transfer is remembered: as long as a decode engine
    /// may still come for it (its request may wait in D's queue as long as
    /// a pull may wait here), so a late pull learns why the transfer ended
    /// (a lease that expired is recomputed) instead of finding it unknown.
    fn retention(&self) -> Duration {
        self.cfg.abort_timeout + self.cfg.arrival_timeout + self.cfg.prefill_timeout
    }

    /// Forgets the oldest tombstones beyond [`MAX_TOMBSTONES`].
    fn bound_tombstones(&mut self) {
        let mut done: Vec<(Instant, String)> = self
            .transfers
            .iter()
            .filter_map(|(k, t)| match &t.phase {
                Phase::Done { forget_at, .. } if t.writing.is_none() && !t.holding => {
                    Some((*forget_at, k.clone()))
                }
                _ => None,
            })
            .collect();
        if done.len() <= MAX_TOMBSTONES {
            return;
        }
        done.sort();
        let excess = done.len() - MAX_TOMBSTONES;
        for (_, k) in done.into_iter().take(excess) {
            self.transfers.remove(&k);
        }
    }

    /// The weights P serves from now on: transfers that become READY later
    /// carry it, and a pull naming another version is refused.
    pub fn set_weights_version(&mut self, version: Option<String>) {
        self.weights_version = version;
    }

    /// The next action for the driver.
    pub fn poll_action(&mut self) -> Option<Action> {
        self.actions.pop_front()
    }

    /// Requests whose blocks no write reads any more (each once).
    pub fn take_finished(&mut self) -> Vec<Arc<str>> {
        std::mem::take(&mut self.finished)
    }

    /// Blocks held for D now.
    pub fn held_blocks(&self) -> usize {
        self.transfers
            .values()
            .filter(|t| t.holding)
            .map(|t| t.blocks.len())
            .sum()
    }

    /// Sender permits free now.
    pub fn free_permits(&self) -> usize {
        self.permits
    }

    /// The phase of `transfer_id`, if the machine knows it.
    pub fn phase(&self, transfer_id: &str) -> Option<PhaseName> {
        self.transfers.get(transfer_id).map(|t| match t.phase {
            Phase::Waiting => PhaseName::Waiting,
            Phase::Ready { .. } => PhaseName::Ready,
            Phase::Done { .. } => PhaseName::Done,
        })
    }

    /// Pulls not yet answered or whose write still runs.
    pub fn live_pulls(&self) -> usize {
        self.pulls.len()
    }

    /// Transfers remembered (any phase), for bounds and tests.
    pub fn num_transfers(&self) -> usize {
        self.transfers.len()
    }

    fn answer(&mut self, pull: PullId, result: Result<(), Failure>) {
        self.actions.push_back(Action::Answer { pull, result });
    }

    /// P queued the request of `transfer_id`: WAITING (unless known).
    pub fn on_request_running(&mut self, transfer_id: &str, req: &Arc<str>) {
        self.transfers
            .entry(transfer_id.to_string())
            .or_insert_with(|| Transfer::waiting(Some(req.clone())));
        // A pull parked while the transfer was unknown now waits for the
        // request, up to the prefill timeout from its receipt.
        if let Some(p) = self
            .pull_of
            .get(transfer_id)
            .and_then(|id| self.pulls.get_mut(id))
        {
            if p.state == PullState::Parked {
                p.deadline = p.full_deadline;
            }
        }
    }

    /// P's request ended holding `blocks`. `completed`: it stopped normally
    /// (stop or length); otherwise it was aborted or failed. Returns whether
    /// the blocks are held for D (the engine frees them once
    /// [`SendMachine::take_finished`] names the request).
    pub fn on_request_finished(
        &mut self,
        now: Instant,
        transfer_id: &str,
        req: &Arc<str>,
        blocks: &[u32],
        prompt_len: usize,
        completed: bool,
    ) -> bool {
        self.on_request_running(transfer_id, req);
        let t = self.transfers.get_mut(transfer_id).expect("inserted above");
        if !matches!(t.phase, Phase::Waiting) {
            // Already DONE (D released it) or finished before: nothing to hold.
            return false;
        }
        t.req = Some(req.clone());
        let end = if t.reset {
            Some(Failure::new(FailCode::CacheReset, CACHE_RESET))
        } else if !completed {
            Some(Failure::new(
                FailCode::PrefillAborted,
                "the prefill request was aborted before it finished",
            ))
        } else if prompt_len.saturating_sub(1).div_ceil(self.cfg.block_size) == 0 {
            Some(Failure::new(
                FailCode::Mismatch,
                "nothing to send: the prompt has a single token",
            ))
        } else {
            None
        };
        if let Some(f) = end {
            self.end_send(now, transfer_id, f, false);
            return false;
        }
        let version = self.weights_version.clone();
        let t = self.transfers.get_mut(transfer_id).expect("known");
        let expires = (now + self.cfg.abort_timeout).max(t.claimed_until.unwrap_or(now));
        t.phase = Phase::Ready { expires };
        t.ready_seq = self.next_ready_seq;
        self.next_ready_seq += 1;
        t.holding = true;
        t.blocks = blocks.to_vec();
        t.prompt_len = prompt_len;
        t.weights_version = version;
        if let Some(&pull) = self.pull_of.get(transfer_id) {
            if self
                .pulls
                .get(&pull)
                .is_some_and(|p| p.state == PullState::Parked)
            {
                self.admit(now, pull);
            }
        }
        true
    }

    /// D asks for a transfer's blocks.
    pub fn on_pull(&mut self, now: Instant, pull: PullId, spec: PullSpec) {
        let tid = spec.transfer_id.clone();
        if self.pulls.len() >= MAX_PULLS {
            let why = format!("P holds {MAX_PULLS} pulls already, the most it keeps; transfer {tid:?} was not pulled");
            self.answer(pull, Err(Failure::new(FailCode::TransferFailed, why)));
            return;
        }
        if self.pull_of.contains_key(&tid) {
            self.answer(
                pull,
                Err(Failure::new(
                    FailCode::Mismatch,
                    format!("transfer {tid:?} already has a pull in progress"),
                )),
            );
            return;
        }
        let full_deadline = now + self.cfg.prefill_timeout;
        let deadline = match self.transfers.get(&tid).map(|t| &t.phase) {
            Some(Phase::Done { failure, .. }) => {
                let f = failure.clone();
                self.answer(pull, Err(f));
                return;
            }
            None => full_deadline.min(now + self.cfg.arrival_timeout),
            Some(_) => full_deadline,
        };
        self.pull_of.insert(tid.clone(), pull);
        let next_heartbeat = now + self.cfg.heartbeat;
        let p = PendingPull {
            spec,
            deadline,
            full_deadline,
            next_heartbeat,
            state: PullState::Parked,
            src_blocks: Vec::new(),
        };
        self.pulls.insert(pull, p);
        if matches!(
            self.transfers.get(&tid).map(|t| &t.phase),
            Some(Phase::Ready { .. })
        ) {
            self.admit(now, pull);
        }
    }

    /// Checks a parked pull against its READY transfer and queues it with
    /// `abort_timeout` from now for its write (or answers the mismatch and
    /// ends the send).
    fn admit(&mut self, now: Instant, pull: PullId) {
        let p = &self.pulls[&pull];
        let t = &self.transfers[&p.spec.transfer_id];
        match check(&p.spec, t, self.cfg.block_size) {
            Ok(src) => {
                let deadline = now + self.cfg.abort_timeout;
                let p = self.pulls.get_mut(&pull).expect("known");
                p.src_blocks = src;
                p.state = PullState::Queued;
                p.deadline = deadline;
                self.actions.push_back(Action::Progress { pull });
                self.queue.push_back(pull);
                self.try_start();
            }
            Err(f) => {
                // Out of the table first, so ending the send does not answer
                // this pull with the tombstone's failure as well.
                let tid = p.spec.transfer_id.clone();
                self.remove_pull(pull);
                let tomb = Failure::new(
                    f.code,
                    format!("transfer {tid:?} refused an earlier pull: {}", f.message),
                );
                self.end_send(now, &tid, tomb, false);
                self.answer(pull, Err(f));
            }
        }
    }

    fn remove_pull(&mut self, pull: PullId) -> Option<PendingPull> {
        let p = self.pulls.remove(&pull)?;
        if self.pull_of.get(&p.spec.transfer_id) == Some(&pull) {
            self.pull_of.remove(&p.spec.transfer_id);
        }
        self.queue.retain(|&q| q != pull);
        Some(p)
    }

    /// Hands permits to queued pulls.
    fn try_start(&mut self) {
        while self.permits > 0 {
            let Some(pull) = self.queue.pop_front() else {
                return;
            };
            let Some(p) = self.pulls.get_mut(&pull) else {
                continue;
            };
            self.permits -= 1;
            p.state = PullState::Writing { answered: false };
            let tid = p.spec.transfer_id.clone();
            let (src_blocks, deadline) = (p.src_blocks.clone(), p.deadline);
            if let Some(t) = self.transfers.get_mut(&tid) {
                t.writing = Some(pull);
            }
            self.actions.push_back(Action::StartWrite {
                pull,
                src_blocks,
                deadline,
            });
        }
    }

    /// A write ended (`Err` says why it failed).
    pub fn on_write_done(&mut self, now: Instant, pull: PullId, result: Result<(), Failure>) {
        let Some(p) = self.remove_pull(pull) else {
            return;
        };
        let PullState::Writing { answered } = p.state else {
            return;
        };
        self.permits += 1;
        let tid = p.spec.transfer_id;
        if let Some(t) = self.transfers.get_mut(&tid) {
            t.writing = None;
        }
        if !answered {
            let tomb = match &result {
                Ok(()) => Failure::new(
                    FailCode::AlreadyDone,
                    format!("transfer {tid:?} was sent already"),
                ),
                Err(e) => Failure::new(e.code, format!("transfer {tid:?} failed: {}", e.message)),
            };
            self.answer(pull, result);
            self.end_send(now, &tid, tomb, false);
        }
        self.release_if_idle(&tid);
        self.try_start();
    }

    /// `transfer_id` is released by D (its request ended or its load was
    /// abandoned: [`FailCode::Dropped`]) or by a proxy that saw P refuse or
    /// abort the request (a pull then learns that code). The drop is
    /// answered once no write reads the blocks.
    pub fn on_drop(&mut self, now: Instant, transfer_id: &str, drop: DropId, code: FailCode) {
        let known = self.transfers.contains_key(transfer_id);
        if !known {
            // A pull parked on the unknown transfer is answered, and the
            // tombstone refuses the request's blocks when it finishes.
            self.transfers
                .insert(transfer_id.to_string(), Transfer::waiting(None));
        }
        if !matches!(self.transfers[transfer_id].phase, Phase::Done { .. }) {
            let message = match code {
                FailCode::Dropped => RELEASED.to_string(),
                other => format!("the transfer was dropped at the prefill engine ({other})"),
            };
            self.end_send(now, transfer_id, Failure::new(code, message), true);
        }
        let t = self.transfers.get_mut(transfer_id).expect("known");
        if t.writing.is_some() {
            t.drop_waiters.push(drop);
        } else {
            self.actions.push_back(Action::DropAnswer { drop, known });
        }
    }

    /// Ends `transfer_id` with `failure` whatever its phase (a tombstone if
    /// P has not seen it yet): P refused a pull for it at once (its KV cache
    /// is released), so its request, if it runs later, holds nothing for D.
    pub fn end_transfer(&mut self, now: Instant, transfer_id: &str, failure: Failure) {
        if !self.transfers.contains_key(transfer_id) {
            self.transfers
                .insert(transfer_id.to_string(), Transfer::waiting(None));
        }
        self.end_send(now, transfer_id, failure, false);
    }

    /// Read mode: D finished reading `transfer_id`'s blocks. `Ok` when the
    /// lease still held them (the send ends now and the blocks go back);
    /// otherwise why the lease had ended, so D discards what it read.
    pub fn on_read_done(&mut self, now: Instant, transfer_id: &str) -> Result<(), Failure> {
        match self.transfers.get(transfer_id).map(|t| &t.phase) {
            Some(Phase::Ready { .. }) => {
                let tomb = Failure::new(
                    FailCode::AlreadyDone,
                    format!("transfer {transfer_id:?} was read already"),
                );
                self.end_send(now, transfer_id, tomb, false);
                Ok(())
            }
            Some(Phase::Done { failure, .. }) => Err(failure.clone()),
            Some(Phase::Waiting) => Err(Failure::new(
                FailCode::Protocol,
                format!("the prefill request of transfer {transfer_id:?} has not finished"),
            )),
            None => Err(Failure::new(
                FailCode::Unknown,
                format!("transfer {transfer_id:?} is unknown to the prefill engine"),
            )),
        }
    }

    /// Stop holding KV for D (the engine is about to reset its cache): every
    /// READY transfer ends now with [`FailCode::CacheReset`] (its queued pull
    /// is answered at once; a write in flight keeps the blocks until it
    /// ends, by its deadline); every WAITING transfer answers its parked
    /// pull at once and will end, not become READY, when its request
    /// finishes. Idempotent; transfers that start afterwards are not affected.
    pub fn abort_all(&mut self, now: Instant) {
        self.end_ready(now, Failure::new(FailCode::CacheReset, CACHE_RESET));
        let waiting: Vec<String> = self
            .transfers
            .iter_mut()
            .filter(|(_, t)| matches!(t.phase, Phase::Waiting))
            .map(|(k, t)| {
                t.reset = true;
                k.clone()
            })
            .collect();
        for tid in waiting {
            let parked = self.pull_of.get(&tid).copied().filter(|p| {
                self.pulls
                    .get(p)
                    .is_some_and(|p| p.state == PullState::Parked)
            });
            if let Some(pull) = parked {
                self.remove_pull(pull);
                self.answer(pull, Err(Failure::new(FailCode::CacheReset, CACHE_RESET)));
            }
        }
    }

    /// Ends every READY transfer with `failure` (see [`SendMachine::end_send`]).
    pub fn end_ready(&mut self, now: Instant, failure: Failure) {
        let ready: Vec<String> = self
            .transfers
            .iter()
            .filter(|(_, t)| matches!(t.phase, Phase::Ready { .. }))
            .map(|(k, _)| k.clone())
            .collect();
        for tid in ready {
            self.end_send(now, &tid, failure.clone(), false);
        }
    }

    /// Blocks of READY transfers no write reads yet: KV waiting for D.
    pub fn ready_blocks(&self) -> usize {
        self.transfers
            .values()
            .filter(|t| matches!(t.phase, Phase::Ready { .. }) && t.writing.is_none())
            .map(|t| t.blocks.len())
            .sum()
    }

    /// Writes reading this engine's blocks now.
    pub fn writes_in_flight(&self) -> usize {
        self.pulls
            .values()
            .filter(|p| matches!(p.state, PullState::Writing { .. }))
            .count()
    }

    /// Ends the send of `transfer_id`: DONE with `failure` (what later pulls
    /// learn), pulls not writing answered with it (the writing one too when
    /// `answer_writer`), and the blocks given back once no write reads them.
    /// The only place a send ends.
    pub fn end_send(
        &mut self,
        now: Instant,
        transfer_id: &str,
        failure: Failure,
        answer_writer: bool,
    ) {
        let forget_at = now + self.retention();
        let Some(t) = self.transfers.get_mut(transfer_id) else {
            return;
        };
        if matches!(t.phase, Phase::Done { .. }) {
            return;
        }
        t.phase = Phase::Done {
            failure: failure.clone(),
            forget_at,
        };
        self.done_since_bound += 1;
        if let Some(&pull) = self.pull_of.get(transfer_id) {
            match self.pulls.get(&pull).map(|p| p.state) {
                Some(PullState::Writing { answered: false }) if answer_writer => {
                    if let Some(p) = self.pulls.get_mut(&pull) {
                        p.state = PullState::Writing { answered: true };
                    }
                    self.answer(pull, Err(failure));
                }
                Some(PullState::Writing { .. }) | None => {}
                Some(_) => {
                    self.remove_pull(pull);
                    self.answer(pull, Err(failure));
                }
            }
        }
        self.release_if_idle(transfer_id);
        if self.done_since_bound >= MAX_TOMBSTONES / 8 {
            self.done_since_bound = 0;
            self.bound_tombstones();
        }
    }

    /// A DONE transfer whose blocks no write reads gives them back and
    /// answers the drops that waited for that.
    fn release_if_idle(&mut self, transfer_id: &str) {
        let Some(t) = self.transfers.get_mut(transfer_id) else {
            return;
        };
        if !matches!(t.phase, Phase::Done { .. }) || t.writing.is_some() {
            return;
        }
        if t.holding {
            t.holding = false;
            t.blocks.clear();
            if let Some(r) = &t.req {
                self.finished.push(r.clone());
            }
        }
        for drop in std::mem::take(&mut t.drop_waiters) {
            self.actions
                .push_back(Action::DropAnswer { drop, known: true });
        }
    }

    /// When [`SendMachine::handle_timeout`] must run next.
    pub fn poll_timeout(&self) -> Option<Instant> {
        let pulls = self.pulls.values().filter_map(|p| match p.state {
            PullState::Parked => Some(p.deadline.min(p.next_heartbeat)),
            PullState::Queued => Some(p.deadline),
            PullState::Writing { .. } => None,
        });
        let transfers = self.transfers.values().filter_map(|t| match &t.phase {
            Phase::Ready { expires } if t.writing.is_none() => Some(*expires),
            Phase::Done { forget_at, .. } if t.writing.is_none() && !t.holding => Some(*forget_at),
            _ => None,
        });
        pulls.chain(transfers).min()
    }

    /// Answers pulls whose deadline passed, tells parked pulls that P is
    /// alive, ends sends whose lease expired, forgets old tombstones.
    pub fn handle_timeout(&mut self, now: Instant) {
        let due: Vec<PullId> = self
            .pulls
            .iter()
            .filter(|(_, p)| !matches!(p.state, PullState::Writing { .. }) && p.deadline <= now)
            .map(|(&id, _)| id)
            .collect();
        for pull in due {
            self.expire_pull(now, pull);
        }
        let beat = self.cfg.heartbeat;
        for (&pull, p) in self.pulls.iter_mut() {
            if p.state == PullState::Parked && p.next_heartbeat <= now {
                p.next_heartbeat = now + beat;
                self.actions.push_back(Action::Progress { pull });
            }
        }
        let expired: Vec<(String, bool)> = self
            .transfers
            .iter()
            .filter(|(_, t)| {
                t.writing.is_none() && matches!(t.phase, Phase::Ready { expires } if expires <= now)
            })
            .map(|(k, t)| (k.clone(), t.claimed_until.is_some()))
            .collect();
        for (tid, claimed) in expired {
            let why = if claimed {
                self.leases.expired_claimed += 1;
                format!("the lease of transfer {tid:?} expired: the decode engine that claimed it stopped claiming it (lease {:?})", self.cfg.abort_timeout)
            } else {
                self.leases.expired_unclaimed += 1;
                format!("the lease of transfer {tid:?} expired before any decode engine claimed or pulled it (abort_timeout_s {:?})", self.cfg.abort_timeout)
            };
            self.end_send(now, &tid, Failure::new(FailCode::LeaseExpired, why), false);
        }
        self.transfers.retain(|_, t| {
            !matches!(t.phase, Phase::Done { forget_at, .. } if forget_at <= now && t.writing.is_none() && !t.holding)
        });
    }

    /// A parked or queued pull reached its deadline: answered with why.
    fn expire_pull(&mut self, now: Instant, pull: PullId) {
        let Some(p) = self.remove_pull(pull) else {
            return;
        };
        let tid = p.spec.transfer_id;
        let phase = self.transfers.get(&tid).map(|t| &t.phase);
        let failure = match phase {
            None => Failure::new(
                FailCode::Unknown,
                format!("transfer {tid:?} is unknown to the prefill engine (not seen within arrival_timeout_s, {:?})", self.cfg.arrival_timeout),
            ),
            Some(Phase::Waiting) => Failure::new(
                FailCode::Deadline,
                format!(
                    "the prefill request of transfer {tid:?} did not finish within prefill_timeout_s ({:?})",
                    self.cfg.prefill_timeout
                ),
            ),
            Some(_) => Failure::new(
                FailCode::Deadline,
                format!(
                    "no sender was free for transfer {tid:?} within abort_timeout_s ({:?}; num_workers {} senders)",
                    self.cfg.abort_timeout, self.cfg.num_workers
                ),
            ),
        };
        if matches!(phase, Some(Phase::Ready { .. })) {
            self.end_send(now, &tid, failure.clone(), false);
        }
        self.answer(pull, Err(failure));
    }
}

/// Checks a pull against a READY transfer; gives P's source blocks.
fn check(spec: &PullSpec, t: &Transfer, block_size: usize) -> Result<Vec<u32>, Failure> {
    let mismatch = |m: String| Failure::new(FailCode::Mismatch, m);
    if spec.weights_version != t.weights_version {
        return Err(Failure::new(
            FailCode::WeightsMismatch,
            format!(
                "weights mismatch: the decode engine serves weights {:?}, the prefill engine computed this KV with {:?}",
                spec.weights_version, t.weights_version
            ),
        ));
    }
    let want = t.prompt_len.saturating_sub(1);
    if spec.num_tokens != want {
        return Err(mismatch(format!(
            "prompt length mismatch: the decode engine asks for the KV of {} tokens, the prefill engine computed {} ({}-token prompt)",
            spec.num_tokens, want, t.prompt_len
        )));
    }
    let needed = want.div_ceil(block_size);
    if spec.first_block >= needed {
        return Err(mismatch(format!(
            "first_block {} is past the {} blocks of the transfer",
            spec.first_block, needed
        )));
    }
    let n = needed - spec.first_block;
    if spec.num_blocks != n {
        return Err(mismatch(format!(
            "block count mismatch: the decode engine sent {} destination blocks, the transfer has {} from block {}",
            spec.num_blocks, n, spec.first_block
        )));
    }
    if needed > t.blocks.len() {
        return Err(mismatch(format!(
            "the prefill engine holds {} blocks for the transfer, {} are needed",
            t.blocks.len(),
            needed
        )));
    }
    Ok(t.blocks[spec.first_block..needed].to_vec())
}

#[cfg(test)]
mod tests {
    use super::*;

    const ABORT: Duration = Duration::from_secs(30);
    const ARRIVAL: Duration = Duration::from_secs(10);
    const PREFILL: Duration = Duration::from_secs(600);
    const BEAT: Duration = Duration::from_secs(2);

    fn machine(workers: usize) -> SendMachine {
        SendMachine::new(SendConfig {
            abort_timeout: ABORT,
            arrival_timeout: ARRIVAL,
            prefill_timeout: PREFILL,
            heartbeat: BEAT,
            num_workers: workers,
            block_size: 16,
        })
    }

    fn rid(s: &str) -> Arc<str> {
        Arc::from(s)
    }

    /// A pull for a 40-token prompt (39 tokens: blocks 0..3) from block `first`.
    fn pull(tid: &str, first: usize) -> PullSpec {
        PullSpec {
            transfer_id: tid.into(),
            first_block: first,
            num_tokens: 39,
            num_blocks: 3 - first,
            weights_version: None,
        }
    }

    /// The actions but progress reports (see the heartbeat tests for those).
    fn actions(m: &mut SendMachine) -> Vec<Action> {
        all_actions(m)
            .into_iter()
            .filter(|a| !matches!(a, Action::Progress { .. }))
            .collect()
    }

    fn all_actions(m: &mut SendMachine) -> Vec<Action> {
        std::iter::from_fn(|| m.poll_action()).collect()
    }

    fn failure_of(a: &[Action], pull: PullId) -> Failure {
        match a
            .iter()
            .find(|x| matches!(x, Action::Answer { pull: p, .. } if *p == pull))
        {
            Some(Action::Answer { result: Err(e), .. }) => e.clone(),
            other => panic!("no error answer for pull {pull}: {other:?} in {a:?}"),
        }
    }

    fn err_of(a: &[Action], pull: PullId) -> String {
        failure_of(a, pull).message
    }

    fn fail(code: FailCode, message: &str) -> Failure {
        Failure::new(code, message)
    }

    /// A READY transfer "t" for request "r" with blocks 10..14 of a 40-token prompt.
    fn ready(m: &mut SendMachine, now: Instant) {
        m.on_request_running("t", &rid("r"));
        assert_eq!(m.phase("t"), Some(PhaseName::Waiting));
        assert!(m.on_request_finished(now, "t", &rid("r"), &[10, 11, 12, 13], 40, true));
        assert_eq!(m.phase("t"), Some(PhaseName::Ready));
        assert_eq!(m.held_blocks(), 4);
    }

    #[test]
    fn a_pull_parked_on_a_waiting_transfer_is_written_when_it_is_ready() {
        let t0 = Instant::now();
        let mut m = machine(2);
        m.on_request_running("t", &rid("r"));
        m.on_pull(t0, 1, pull("t", 1));
        assert!(actions(&mut m).is_empty(), "parked while WAITING");
        assert_eq!(
            m.poll_timeout(),
            Some(t0 + BEAT),
            "a parked pull hears from P every heartbeat"
        );
        let t1 = t0 + Duration::from_secs(1);
        assert!(m.on_request_finished(t1, "t", &rid("r"), &[10, 11, 12, 13], 40, true));
        // The write's deadline counts from when the KV was ready, and D hears of it.
        assert_eq!(
            all_actions(&mut m),
            vec![
                Action::Progress { pull: 1 },
                Action::StartWrite {
                    pull: 1,
                    src_blocks: vec![11, 12],
                    deadline: t1 + ABORT
                }
            ]
        );
        assert_eq!(m.free_permits(), 1);
        assert_eq!(
            m.poll_timeout(),
            None,
            "no lease expiry while the write reads the blocks"
        );
        m.on_write_done(t1, 1, Ok(()));
        assert_eq!(
            actions(&mut m),
            vec![Action::Answer {
                pull: 1,
                result: Ok(())
            }]
        );
        assert_eq!(m.take_finished(), vec![rid("r")]);
        assert_eq!(
            (m.held_blocks(), m.free_permits(), m.live_pulls()),
            (0, 2, 0)
        );
        assert_eq!(m.phase("t"), Some(PhaseName::Done));
        // A second pull is refused with the reason, at once.
        m.on_pull(t1, 2, pull("t", 0));
        assert!(err_of(&actions(&mut m), 2).contains("was sent already"));
        // The tombstone is forgotten after its retention.
        m.handle_timeout(t1 + ABORT + ARRIVAL + PREFILL);
        assert_eq!(m.phase("t"), None);
    }

    #[test]
    fn a_pull_for_an_unknown_transfer_waits_for_it_until_the_arrival_timeout() {
        let t0 = Instant::now();
        let mut m = machine(1);
        m.on_pull(t0, 1, pull("t", 0));
        assert_eq!(m.poll_timeout(), Some(t0 + BEAT));
        m.handle_timeout(t0 + BEAT);
        assert_eq!(all_actions(&mut m), vec![Action::Progress { pull: 1 }]);
        // Arrives in time: it is served.
        ready(&mut m, t0 + Duration::from_secs(2));
        assert!(matches!(
            actions(&mut m)[..],
            [Action::StartWrite { pull: 1, .. }]
        ));

        let mut m = machine(1);
        m.on_pull(t0, 1, pull("t", 0));
        m.handle_timeout(t0 + ARRIVAL - Duration::from_millis(1));
        assert!(actions(&mut m).is_empty());
        m.handle_timeout(t0 + ARRIVAL);
        assert!(err_of(&actions(&mut m), 1).contains("unknown to the prefill engine"));
        assert_eq!(m.live_pulls(), 0);
    }

    #[test]
    fn a_long_prefill_keeps_its_pull_alive_with_heartbeats_until_the_kv_is_ready() {
        // A prompt that takes longer than abort_timeout to compute: the pull
        // waits (hearing from P every heartbeat), and its write deadline
        // counts from when the KV is ready.
        let t0 = Instant::now();
        let mut m = machine(1);
        m.on_request_running("t", &rid("r"));
        m.on_pull(t0, 1, pull("t", 0));
        let mut now = t0;
        let mut beats = 0;
        while now < t0 + 3 * ABORT {
            now = m.poll_timeout().expect("a parked pull has a timeout");
            m.handle_timeout(now);
            let a = all_actions(&mut m);
            assert!(
                a.iter().all(|x| *x == Action::Progress { pull: 1 }),
                "only heartbeats while P computes: {a:?}"
            );
            beats += a.len();
        }
        assert_eq!(
            beats as u32,
            (3 * ABORT).as_secs() as u32 / BEAT.as_secs() as u32
        );
        assert!(m.on_request_finished(now, "t", &rid("r"), &[1, 2, 3], 40, true));
        let a = all_actions(&mut m);
        assert_eq!(a[0], Action::Progress { pull: 1 });
        assert!(
            matches!(a[1], Action::StartWrite { pull: 1, deadline, .. } if deadline == now + ABORT),
            "{a:?}"
        );
    }

    #[test]
    fn a_pull_on_a_request_still_running_at_the_prefill_timeout_gets_an_error() {
        let t0 = Instant::now();
        let mut m = machine(1);
        m.on_request_running("t", &rid("r"));
        m.on_pull(t0, 1, pull("t", 0));
        m.handle_timeout(t0 + PREFILL - Duration::from_millis(1));
        assert!(actions(&mut m).is_empty());
        m.handle_timeout(t0 + PREFILL);
        let f = failure_of(&actions(&mut m), 1);
        assert_eq!(f.code, FailCode::Deadline);
        assert!(f.message.contains("prefill_timeout_s"), "{f}");
        // The request finishes later: READY, and its lease runs.
        assert!(m.on_request_finished(t0 + PREFILL, "t", &rid("r"), &[1, 2, 3], 40, true));
        assert_eq!(m.poll_timeout(), Some(t0 + PREFILL + ABORT));
    }

    #[test]
    fn a_pull_parked_as_unknown_waits_the_full_deadline_once_the_request_is_queued() {
        let t0 = Instant::now();
        let mut m = machine(1);
        m.on_pull(t0, 1, pull("t", 0));
        m.on_request_running("t", &rid("r"));
        m.handle_timeout(t0 + ARRIVAL);
        assert!(
            actions(&mut m).is_empty(),
            "known now: the pull waits for the request"
        );
        m.handle_timeout(t0 + PREFILL);
        assert_eq!(failure_of(&actions(&mut m), 1).code, FailCode::Deadline);
    }

    #[test]
    fn kv_computed_with_other_weights_is_refused_with_its_code() {
        let t0 = Instant::now();
        let mut m = machine(1);
        m.set_weights_version(Some("v2".into()));
        ready(&mut m, t0);
        m.on_pull(t0, 1, pull("t", 0));
        let f = failure_of(&actions(&mut m), 1);
        assert_eq!(f.code, FailCode::WeightsMismatch);
        assert!(f.code.on_purpose() && f.message.contains("v2"), "{f}");
        assert_eq!(
            m.take_finished(),
            vec![rid("r")],
            "the refused pull ends the send"
        );
        let mut m = machine(1);
        m.set_weights_version(Some("v2".into()));
        ready(&mut m, t0);
        m.on_pull(
            t0,
            1,
            PullSpec {
                weights_version: Some("v2".into()),
                ..pull("t", 0)
            },
        );
        assert!(matches!(
            actions(&mut m)[..],
            [Action::StartWrite { pull: 1, .. }]
        ));
    }

    #[test]
    fn a_drop_from_a_proxy_gives_a_parked_pull_its_code_at_once() {
        let t0 = Instant::now();
        let mut m = machine(1);
        m.on_pull(t0, 1, pull("t", 0));
        m.on_drop(t0, "t", 7, FailCode::PrefillRefused);
        let a = actions(&mut m);
        assert_eq!(failure_of(&a, 1).code, FailCode::PrefillRefused);
        assert!(a.contains(&Action::DropAnswer {
            drop: 7,
            known: false
        }));
        // A later pull learns the same code from the tombstone.
        m.on_pull(t0, 2, pull("t", 0));
        assert_eq!(
            failure_of(&actions(&mut m), 2).code,
            FailCode::PrefillRefused
        );
    }

    #[test]
    fn the_same_events_give_the_same_actions_in_the_same_order() {
        // Many transfers ended at once (abort_all, a lease sweep) come out in
        // one fixed order, so a simulation replays.
        let t0 = Instant::now();
        let run = || {
            let mut m = machine(1);
            for i in (0..50).rev() {
                let (t, r) = (format!("t{i}"), rid(&format!("r{i}")));
                m.on_request_running(&t, &r);
                if i % 2 == 0 {
                    assert!(m.on_request_finished(t0, &t, &r, &[1, 2, 3], 40, true));
                }
                m.on_pull(t0, 100 + i, pull(&t, 0));
            }
            m.abort_all(t0);
            let mut out = format!("{:?}", all_actions(&mut m));
            out.push_str(&format!("{:?}", m.take_finished()));
            out
        };
        let first = run();
        assert!(first.contains("CacheReset"));
        for _ in 0..5 {
            assert_eq!(run(), first);
        }
    }

    #[test]
    fn a_done_transfer_is_forgotten_by_the_timer_once_nothing_holds_it() {
        let t0 = Instant::now();
        let mut m = machine(1);
        ready(&mut m, t0);
        m.on_drop(t0, "t", 7, FailCode::Dropped);
        assert_eq!(m.take_finished(), vec![rid("r")]);
        // The tombstone's forget time is the next timeout, and it goes then.
        let forget = t0 + ABORT + ARRIVAL + PREFILL;
        assert_eq!(m.poll_timeout(), Some(forget));
        m.handle_timeout(forget);
        assert_eq!(m.poll_timeout(), None);
        // While a write still reads a DONE transfer's blocks, no forget time.
        let mut m = machine(1);
        ready(&mut m, t0);
        m.on_pull(t0, 1, pull("t", 0));
        assert!(matches!(
            actions(&mut m)[..],
            [Action::StartWrite { pull: 1, .. }]
        ));
        m.on_drop(t0, "t", 8, FailCode::Dropped);
        assert_eq!(
            m.poll_timeout(),
            None,
            "the write in flight keeps the transfer"
        );
    }

    #[test]
    fn the_lease_expires_and_a_later_pull_learns_why() {
        let t0 = Instant::now();
        let mut m = machine(1);
        ready(&mut m, t0);
        assert_eq!(m.poll_timeout(), Some(t0 + ABORT));
        m.handle_timeout(t0 + ABORT - Duration::from_millis(1));
        assert!(m.take_finished().is_empty());
        m.handle_timeout(t0 + ABORT);
        assert_eq!(
            m.take_finished(),
            vec![rid("r")],
            "the expiry gives the blocks back"
        );
        assert_eq!(m.held_blocks(), 0);
        m.on_pull(t0 + ABORT, 1, pull("t", 0));
        assert!(err_of(&actions(&mut m), 1).contains("lease"));
    }

    #[test]
    fn claims_hold_the_lease_for_as_long_as_they_come_and_not_longer() {
        let t0 = Instant::now();
        let mut m = machine(1);
        // Claimed while P still computes: the lease runs from the claim or
        // the finish, whichever is later.
        m.on_request_running("t", &rid("r"));
        assert_eq!(m.on_claim(t0, "t"), Ok(()));
        let t1 = t0 + Duration::from_secs(5);
        assert!(m.on_request_finished(t1, "t", &rid("r"), &[10, 11, 12, 13], 40, true));
        assert_eq!(m.poll_timeout(), Some(t1 + ABORT));
        // D claims again every third of the lease, for ten leases.
        let mut now = t1;
        for _ in 0..30 {
            now += ABORT / 3;
            m.handle_timeout(now);
            assert_eq!(m.on_claim(now, "t"), Ok(()));
        }
        assert_eq!(
            m.phase("t"),
            Some(PhaseName::Ready),
            "a claimed lease holds"
        );
        assert_eq!(m.poll_timeout(), Some(now + ABORT));
        // D stops claiming (it crashed): the lease ends one lease later.
        m.handle_timeout(now + ABORT);
        assert_eq!(m.take_finished(), vec![rid("r")]);
        let c = m.lease_counts();
        assert_eq!(
            (c.claims, c.expired_claimed, c.expired_unclaimed),
            (31, 1, 0)
        );
        // A later claim learns why, as a pull would.
        let f = m.on_claim(now + ABORT, "t").unwrap_err();
        assert_eq!(f.code, FailCode::LeaseExpired);
        assert!(f.message.contains("stopped claiming"), "{}", f.message);
        // A transfer P has not seen: unknown (D claims again later).
        assert_eq!(m.on_claim(now, "new").unwrap_err().code, FailCode::Unknown);
        assert_eq!(m.phase("new"), None, "a claim creates nothing");
        // An unclaimed transfer expires one lease after its finish.
        let t2 = now + ABORT;
        m.on_request_running("u", &rid("ru"));
        assert!(m.on_request_finished(t2, "u", &rid("ru"), &[1, 2, 3], 40, true));
        m.handle_timeout(t2 + ABORT);
        assert_eq!(m.take_finished(), vec![rid("ru")]);
        assert_eq!(m.lease_counts().expired_unclaimed, 1);
    }

    #[test]
    fn reclaim_gives_back_unclaimed_oldest_then_claimed_newest_but_never_a_pulled_one() {
        let t0 = Instant::now();
        let mut m = machine(1);
        // READY in this order: a (claimed), b (unclaimed), c (claimed),
        // d (unclaimed), e (pulled: queued or writing, never reclaimed).
        for (i, tid) in ["a", "b", "c", "d", "e"].into_iter().enumerate() {
            let r = rid(&format!("r{tid}"));
            m.on_request_running(tid, &r);
            let b = 10 * i as u32;
            assert!(m.on_request_finished(t0, tid, &r, &[b, b + 1, b + 2], 40, true));
        }
        assert_eq!(m.on_claim(t0, "a"), Ok(()));
        assert_eq!(m.on_claim(t0, "c"), Ok(()));
        m.on_pull(t0, 1, pull("e", 0));
        all_actions(&mut m);
        let order = |m: &mut SendMachine, n| {
            let got = m.reclaim(t0, n);
            (got, m.take_finished())
        };
        assert_eq!(order(&mut m, 1), (3, vec![rid("rb")]), "oldest unclaimed");
        assert_eq!(order(&mut m, 4), (6, vec![rid("rd"), rid("rc")]));
        assert_eq!(
            order(&mut m, 100),
            (3, vec![rid("ra")]),
            "the pulled one stays"
        );
        assert_eq!(m.phase("e"), Some(PhaseName::Ready));
        assert_eq!(m.lease_counts().reclaimed, 4);
        // A pull for a reclaimed transfer learns why (D recomputes).
        m.on_pull(t0, 2, pull("b", 0));
        let f = failure_of(&actions(&mut m), 2);
        assert_eq!(f.code, FailCode::Reclaimed);
        assert!(f.code.on_purpose());
    }

    #[test]
    fn an_abort_on_p_answers_the_waiting_pull_at_once() {
        let t0 = Instant::now();
        let mut m = machine(1);
        m.on_request_running("t", &rid("r"));
        m.on_pull(t0, 1, pull("t", 0));
        assert!(!m.on_request_finished(t0, "t", &rid("r"), &[1, 2, 3], 40, false));
        assert!(err_of(&actions(&mut m), 1).contains("aborted"));
        assert!(m.take_finished().is_empty(), "nothing was held");
        assert_eq!(m.phase("t"), Some(PhaseName::Done));
    }

    #[test]
    fn a_single_token_prompt_has_nothing_to_send() {
        let mut m = machine(1);
        assert!(!m.on_request_finished(Instant::now(), "t", &rid("r"), &[1], 1, true));
        assert_eq!((m.phase("t"), m.held_blocks()), (Some(PhaseName::Done), 0));
    }

    #[test]
    fn drops_end_the_send_in_every_phase() {
        let t0 = Instant::now();
        // Unknown: not known; the request's blocks are refused later.
        let mut m = machine(1);
        m.on_drop(t0, "t", 7, FailCode::Dropped);
        assert_eq!(
            actions(&mut m),
            vec![Action::DropAnswer {
                drop: 7,
                known: false
            }]
        );
        m.on_request_running("t", &rid("r"));
        assert!(!m.on_request_finished(t0, "t", &rid("r"), &[1, 2, 3], 40, true));
        m.on_pull(t0, 1, pull("t", 0));
        assert_eq!(
            failure_of(&actions(&mut m), 1),
            fail(FailCode::Dropped, RELEASED)
        );

        // WAITING with a parked pull: the pull is answered at once.
        let mut m = machine(1);
        m.on_request_running("t", &rid("r"));
        m.on_pull(t0, 1, pull("t", 0));
        m.on_drop(t0, "t", 7, FailCode::Dropped);
        let a = actions(&mut m);
        assert_eq!(failure_of(&a, 1), fail(FailCode::Dropped, RELEASED));
        assert!(a.contains(&Action::DropAnswer {
            drop: 7,
            known: true
        }));
        assert!(!m.on_request_finished(t0, "t", &rid("r"), &[1, 2, 3], 40, true));

        // READY: blocks given back at once.
        let mut m = machine(1);
        ready(&mut m, t0);
        m.on_drop(t0, "t", 7, FailCode::Dropped);
        assert_eq!(
            actions(&mut m),
            vec![Action::DropAnswer {
                drop: 7,
                known: true
            }]
        );
        assert_eq!(m.take_finished(), vec![rid("r")]);
    }

    #[test]
    fn a_drop_during_a_write_answers_the_pull_at_once_and_the_drop_after_the_write() {
        let t0 = Instant::now();
        let mut m = machine(1);
        ready(&mut m, t0);
        m.on_pull(t0, 1, pull("t", 0));
        assert!(matches!(
            actions(&mut m)[..],
            [Action::StartWrite { pull: 1, .. }]
        ));
        m.on_drop(t0, "t", 7, FailCode::Dropped);
        assert_eq!(
            actions(&mut m),
            vec![Action::Answer {
                pull: 1,
                result: Err(fail(FailCode::Dropped, RELEASED))
            }]
        );
        assert!(
            m.take_finished().is_empty(),
            "the write still reads the blocks"
        );
        assert_eq!(m.held_blocks(), 4);
        m.on_write_done(t0, 1, Err(crate::wire::write_failure(false, "cancelled")));
        assert_eq!(
            actions(&mut m),
            vec![Action::DropAnswer {
                drop: 7,
                known: true
            }],
            "the pull is not answered twice"
        );
        assert_eq!(m.take_finished(), vec![rid("r")]);
        assert_eq!(m.free_permits(), 1);
    }

    #[test]
    fn mismatched_pulls_are_refused_naming_both_numbers() {
        let t0 = Instant::now();
        let cases = [
            (
                PullSpec {
                    transfer_id: "t".into(),
                    first_block: 0,
                    num_tokens: 41,
                    num_blocks: 3,
                    weights_version: None,
                },
                ["41", "39"],
            ),
            (
                PullSpec {
                    transfer_id: "t".into(),
                    first_block: 0,
                    num_tokens: 39,
                    num_blocks: 2,
                    weights_version: None,
                },
                ["sent 2", "has 3"],
            ),
            (
                PullSpec {
                    transfer_id: "t".into(),
                    first_block: 3,
                    num_tokens: 39,
                    num_blocks: 0,
                    weights_version: None,
                },
                ["first_block 3", "3 blocks"],
            ),
        ];
        for (spec, needles) in cases {
            let mut m = machine(1);
            ready(&mut m, t0);
            m.on_pull(t0, 1, spec);
            let a = actions(&mut m);
            assert_eq!(a.len(), 1, "answered once: {a:?}");
            let e = err_of(&a, 1);
            assert!(!e.contains("earlier pull"), "{e}");
            for n in needles {
                assert!(e.contains(n), "{e:?} lacks {n:?}");
            }
            assert_eq!(
                m.take_finished(),
                vec![rid("r")],
                "a refused pull ends the send"
            );
        }
        // Fewer blocks held than the prompt needs.
        let mut m = machine(1);
        assert!(m.on_request_finished(t0, "t", &rid("r"), &[1, 2], 40, true));
        m.on_pull(t0, 1, pull("t", 0));
        assert!(err_of(&actions(&mut m), 1).contains("holds 2 blocks"));
    }

    /// D revokes its grant at the same time as it drops a load it gives up
    /// (a sleep): a write refused by D's registry before the drop arrives
    /// is D's drop, not a failed transfer.
    #[test]
    fn a_write_refused_by_the_destination_is_ds_drop() {
        let t0 = Instant::now();
        for (refused, code) in [(true, FailCode::Dropped), (false, FailCode::TransferFailed)] {
            let mut m = machine(1);
            ready(&mut m, t0);
            m.on_pull(t0, 1, pull("t", 0));
            assert!(matches!(
                actions(&mut m)[..],
                [Action::StartWrite { pull: 1, .. }]
            ));
            m.on_write_done(t0, 1, Err(crate::wire::write_failure(refused, "bad key")));
            let a = actions(&mut m);
            let answered = a.iter().find_map(|x| match x {
                Action::Answer {
                    pull: 1,
                    result: Err(f),
                } => Some(f.code),
                _ => None,
            });
            assert_eq!(answered, Some(code), "{a:?}");
            assert_eq!(m.take_finished(), vec![rid("r")]);
        }
    }

    #[test]
    fn pulls_are_bounded_and_one_beyond_the_bound_is_refused_at_once() {
        let t0 = Instant::now();
        let mut m = machine(1);
        // Pulls for transfers P has not seen park until their arrival timeout.
        for i in 0..MAX_PULLS as u64 {
            m.on_pull(t0, i, pull(&format!("t{i}"), 0));
        }
        assert!(actions(&mut m).is_empty());
        assert_eq!(m.live_pulls(), MAX_PULLS);
        m.on_pull(t0, MAX_PULLS as u64, pull("one-more", 0));
        assert!(err_of(&actions(&mut m), MAX_PULLS as u64).contains("pulls already"));
        assert_eq!(m.live_pulls(), MAX_PULLS);
        // Once the parked ones time out, pulls are taken again.
        m.handle_timeout(t0 + Duration::from_secs(3600));
        assert_eq!(m.live_pulls(), 0);
        m.on_pull(
            t0 + Duration::from_secs(3600),
            MAX_PULLS as u64 + 1,
            pull("later", 0),
        );
        assert_eq!(m.live_pulls(), 1);
    }

    #[test]
    fn permits_bound_the_writes_and_a_queued_pull_has_a_deadline() {
        let t0 = Instant::now();
        let mut m = machine(1);
        for (t, r) in [("a", "ra"), ("b", "rb"), ("c", "rc")] {
            assert!(m.on_request_finished(t0, t, &rid(r), &[1, 2, 3], 40, true));
        }
        m.on_pull(t0, 1, pull("a", 0));
        m.on_pull(t0, 2, pull("b", 0));
        assert!(
            matches!(actions(&mut m)[..], [Action::StartWrite { pull: 1, .. }]),
            "one permit"
        );
        let t1 = t0 + Duration::from_secs(5);
        m.on_pull(t1, 3, pull("c", 0));
        assert!(actions(&mut m).is_empty());
        m.on_write_done(t1, 1, Err(crate::wire::write_failure(false, "peer lost")));
        let a = actions(&mut m);
        assert!(err_of(&a, 1).contains("writing the KV blocks failed: peer lost"));
        assert!(
            a.iter()
                .any(|x| matches!(x, Action::StartWrite { pull: 2, .. })),
            "the permit goes to the next pull"
        );
        assert_eq!(m.take_finished(), vec![rid("ra")]);
        // Pull 3 waits for the permit until its deadline (the lease of "c"
        // expires at the same moment).
        m.handle_timeout(t1 + ABORT);
        let a = actions(&mut m);
        let e = err_of(&a, 3);
        assert!(
            e.contains("no sender was free") || e.contains("lease"),
            "{e}"
        );
        assert_eq!(m.take_finished(), vec![rid("rc")]);
        assert_eq!(m.live_pulls(), 1, "pull 2 still writing");
    }

    #[test]
    fn one_pull_per_transfer_and_abort_all_releases_ready_transfers() {
        let t0 = Instant::now();
        let mut m = machine(1);
        m.on_request_running("t", &rid("r"));
        m.on_pull(t0, 1, pull("t", 0));
        m.on_pull(t0, 2, pull("t", 0));
        assert!(err_of(&actions(&mut m), 2).contains("already has a pull"));
        assert!(m.on_request_finished(t0, "t", &rid("r"), &[1, 2, 3], 40, true));
        assert!(matches!(
            actions(&mut m)[..],
            [Action::StartWrite { pull: 1, .. }]
        ));
        assert!(m.on_request_finished(t0, "u", &rid("q"), &[4, 5, 6], 40, true));
        m.abort_all(t0);
        assert_eq!(
            m.take_finished(),
            vec![rid("q")],
            "the idle transfer is released at once"
        );
        assert!(
            actions(&mut m).is_empty(),
            "the writing pull is answered when its write ends"
        );
        m.on_write_done(t0, 1, Ok(()));
        assert_eq!(
            actions(&mut m),
            vec![Action::Answer {
                pull: 1,
                result: Ok(())
            }]
        );
        assert_eq!(m.take_finished(), vec![rid("r")]);
    }
    #[test]
    fn abort_all_answers_parked_pulls_at_once_and_waiting_transfers_never_become_ready() {
        let t0 = Instant::now();
        let mut m = machine(1);
        // "w" is READY and being written, "q" READY with a queued pull (no
        // permit), "r" READY and idle, "s" WAITING with a parked pull.
        for (t, r) in [("w", "rw"), ("q", "rq"), ("r", "rr")] {
            m.on_request_running(t, &rid(r));
            assert!(m.on_request_finished(t0, t, &rid(r), &[1, 2, 3], 40, true));
        }
        m.on_pull(t0, 1, pull("w", 0));
        m.on_pull(t0, 2, pull("q", 0));
        m.on_request_running("s", &rid("rs"));
        m.on_pull(t0, 3, pull("s", 0));
        assert!(matches!(
            actions(&mut m)[..],
            [Action::StartWrite { pull: 1, .. }]
        ));
        assert_eq!((m.ready_blocks(), m.writes_in_flight()), (6, 1));

        m.abort_all(t0);
        let a = actions(&mut m);
        assert_eq!(failure_of(&a, 2), fail(FailCode::CacheReset, CACHE_RESET));
        assert_eq!(failure_of(&a, 3), fail(FailCode::CacheReset, CACHE_RESET));
        assert_eq!(
            a.len(),
            2,
            "the writing pull is answered by its write: {a:?}"
        );
        let mut done = m.take_finished();
        done.sort();
        assert_eq!(done, vec![rid("rq"), rid("rr")]);
        assert_eq!(
            (m.ready_blocks(), m.writes_in_flight(), m.held_blocks()),
            (0, 1, 3)
        );
        // Idempotent: nothing more happens.
        m.abort_all(t0);
        assert!(actions(&mut m).is_empty() && m.take_finished().is_empty());

        // The write ends: its pull gets the write's result, the blocks go back.
        m.on_write_done(t0, 1, Ok(()));
        assert_eq!(
            actions(&mut m),
            vec![Action::Answer {
                pull: 1,
                result: Ok(())
            }]
        );
        assert_eq!(m.take_finished(), vec![rid("rw")]);
        // The WAITING request finishes: its send ends instead of holding blocks.
        assert!(!m.on_request_finished(t0, "s", &rid("rs"), &[4, 5, 6], 40, true));
        assert_eq!(m.phase("s"), Some(PhaseName::Done));
        m.on_pull(t0, 4, pull("s", 0));
        assert_eq!(failure_of(&actions(&mut m), 4).code, FailCode::CacheReset);
        // A transfer that starts after the abort works normally.
        m.on_request_running("n", &rid("rn"));
        assert!(m.on_request_finished(t0, "n", &rid("rn"), &[7, 8, 9], 40, true));
        m.on_pull(t0, 5, pull("n", 0));
        assert!(matches!(
            actions(&mut m)[..],
            [Action::StartWrite { pull: 5, .. }]
        ));
        assert_eq!(m.held_blocks(), 3);
    }

    #[test]
    fn a_read_done_ends_the_lease_at_once_and_a_late_one_learns_why() {
        let t0 = Instant::now();
        let mut m = machine(1);
        ready(&mut m, t0);
        assert_eq!(m.on_read_done(t0, "t"), Ok(()));
        assert_eq!(
            m.take_finished(),
            vec![rid("r")],
            "the lease ends on the report"
        );
        assert_eq!((m.held_blocks(), m.phase("t")), (0, Some(PhaseName::Done)));
        assert!(m
            .on_read_done(t0, "t")
            .unwrap_err()
            .message
            .contains("was read already"));

        // Expired before the report: the read is refused with the reason.
        let mut m = machine(1);
        ready(&mut m, t0);
        m.handle_timeout(t0 + ABORT);
        assert_eq!(m.take_finished(), vec![rid("r")]);
        assert_eq!(
            m.on_read_done(t0 + ABORT, "t").unwrap_err().code,
            FailCode::LeaseExpired
        );
        // Aborted (cache reset) and unknown transfers.
        let mut m = machine(1);
        ready(&mut m, t0);
        m.abort_all(t0);
        assert_eq!(
            m.on_read_done(t0, "t"),
            Err(fail(FailCode::CacheReset, CACHE_RESET))
        );
        assert_eq!(
            m.on_read_done(t0, "zz").unwrap_err().code,
            FailCode::Unknown
        );
    }

    #[test]
    fn end_ready_spares_writes_in_flight() {
        let t0 = Instant::now();
        let mut m = machine(1);
        ready(&mut m, t0);
        m.on_pull(t0, 1, pull("t", 0));
        actions(&mut m);
        m.on_request_running("u", &rid("q"));
        assert!(m.on_request_finished(t0, "u", &rid("q"), &[1, 2, 3], 40, true));
        m.end_ready(t0, fail(FailCode::Asleep, ASLEEP));
        assert_eq!(m.take_finished(), vec![rid("q")]);
        m.on_pull(t0, 2, pull("u", 0));
        assert_eq!(
            failure_of(&actions(&mut m), 2),
            fail(FailCode::Asleep, ASLEEP)
        );
        assert_eq!(m.writes_in_flight(), 1);
        m.on_write_done(t0, 1, Ok(()));
        assert_eq!(m.take_finished(), vec![rid("r")]);
    }

    #[test]
    fn tombstones_are_bounded_and_the_oldest_go_first() {
        let t0 = Instant::now();
        let mut m = machine(1);
        let n = MAX_TOMBSTONES + MAX_TOMBSTONES / 8;
        for i in 0..n {
            let t = format!("t{i}");
            m.on_drop(
                t0 + Duration::from_millis(i as u64),
                &t,
                i as u64,
                FailCode::Dropped,
            );
        }
        assert!(
            m.num_transfers() <= MAX_TOMBSTONES + MAX_TOMBSTONES / 8,
            "{}",
            m.num_transfers()
        );
        assert!(m.num_transfers() >= MAX_TOMBSTONES);
        assert_eq!(m.phase("t0"), None, "the oldest is forgotten");
        assert_eq!(
            m.phase(&format!("t{}", n - 1)),
            Some(PhaseName::Done),
            "the newest is kept"
        );
    }

    #[test]
    fn a_transfer_refused_while_asleep_holds_nothing_when_its_request_finishes() {
        // P's KV cache was released: a pull is refused at once and its
        // transfer ends, so the request (queued by a keep pause) holds no
        // blocks for D when it runs after the resume.
        let t0 = Instant::now();
        let mut m = machine(1);
        m.on_request_running("t", &rid("r"));
        m.end_transfer(t0, "t", fail(FailCode::Asleep, ASLEEP));
        assert!(!m.on_request_finished(t0, "t", &rid("r"), &[1, 2, 3], 40, true));
        assert_eq!(m.held_blocks(), 0);
        // Unknown when refused: the tombstone does the same later.
        m.end_transfer(t0, "u", fail(FailCode::Asleep, ASLEEP));
        m.on_request_running("u", &rid("q"));
        assert!(!m.on_request_finished(t0, "u", &rid("q"), &[4, 5, 6], 40, true));
        m.on_pull(t0, 1, pull("u", 0));
        assert_eq!(failure_of(&actions(&mut m), 1).code, FailCode::Asleep);
    }
}
