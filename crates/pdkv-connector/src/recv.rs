//! The decode engine's receiving side as a pure state machine.
//!
//! No I/O, no clock, no threads: the driver passes events and the time in and
//! carries out the [`Action`]s that come out of [`RecvMachine::poll_action`];
//! every table is ordered, so the same events give the same actions.
//!
//! One load per request whose prompt's KV comes from a prefill engine (P),
//! in one of these phases:
//! - **Decided**: D's destination blocks exist; the load has not started;
//! - **Booting** (write mode) / **Handshaking** (read mode): D asks P's
//!   control listener who it is (and, in read mode, where its KV lives and
//!   at which registration generation), once per address (cached);
//! - **Pulling** (write mode): D's pull is at P, which writes the blocks
//!   and answers. D gives up `load_timeout` after it last heard from P:
//!   P reports progress while it computes a long prompt, so the wait is
//!   bounded by P's liveness, never by a fixed clock running while P works;
//! - **Reading** / **Confirming** (read mode): D reads P's leased blocks
//!   one-sided, then tells P `read_done`; the data counts only if P's lease
//!   still held the blocks;
//! - **Fencing**: D stopped waiting (its request ended, a cache reset cut the
//!   load short, its deadline passed, the connection broke) while P may
//!   still write into the blocks. The blocks are not given back until a
//!   *fence* proves nothing more can land in them: P's answer to the pull or
//!   to a drop (P answers both only once no write of the transfer is in
//!   flight, except the early `Dropped` answer to the writing pull), or the
//!   driver's local fence (the pull's grant revoked; over shared memory,
//!   P's mapping removed), or, in read mode, the end of D's own read. A
//!   failed fence is tried again, bounded per try, until one succeeds.
//!
//! Reports:
//! - [`RecvMachine::take_finished`]: loads that ended and whose blocks
//!   nothing writes any more (the engine may free or use them);
//! - [`RecvMachine::take_abandoned`]: loads D gave up while their request is
//!   alive but before the fence: the request fails or recomputes *now*,
//!   its blocks stay held by the engine until the load is finished.
//!
//! A failure carries a [`FailCode`]; one that is on purpose (P's lifecycle
//! released the KV, P refused or aborted the request, other weights) makes
//! the request recompute whatever `kv_load_failure_policy` says.

use std::collections::{BTreeMap, BTreeSet, VecDeque};
use std::sync::Arc;
use std::time::Instant;

pub use crate::load::{
    Action, BootInfo, Finished, LoadEnd, LoadFailure, LoadId, LoadSpec, LocalKv, PeerInfo,
    PhaseName, PullResult, RecvConfig, CUT_SHORT, FENCE_RETRY,
};
use crate::params::ReadParams;
use crate::wire::{FailCode, Failure};

/// What a load does after its fence.
#[derive(Clone, Debug, PartialEq, Eq)]
enum After {
    Report(LoadEnd),
}

#[derive(Clone, Debug, PartialEq, Eq)]
enum Phase {
    Decided,
    Booting {
        deadline: Instant,
        refreshed: bool,
    },
    Pulling {
        deadline: Instant,
    },
    Handshaking {
        deadline: Instant,
        refreshed: bool,
    },
    Reading {
        deadline: Instant,
    },
    Confirming {
        deadline: Instant,
    },
    Fencing {
        after: After,
        drop_pending: bool,
        fence_pending: bool,
        retry_at: Option<Instant>,
    },
}

struct Load {
    spec: LoadSpec,
    phase: Phase,
    /// The engine was told the load failed (abandoned) or cut it short
    /// itself: it holds the blocks until the load is finished and needs no
    /// other report.
    engine_knows: bool,
    /// Read mode: why the read failed (Confirming): P's answer to
    /// `read_done` may say the lease ended on purpose.
    read_err: Option<Failure>,
}

/// See the module docs.
pub struct RecvMachine {
    cfg: RecvConfig,
    local: Option<LocalKv>,
    loads: BTreeMap<LoadId, Load>,
    by_req: BTreeMap<Arc<str>, LoadId>,
    next: LoadId,
    boots: BTreeMap<String, BootInfo>,
    booting: BTreeSet<String>,
    peers: BTreeMap<String, PeerInfo>,
    handshaking: BTreeSet<String>,
    actions: VecDeque<Action>,
    finished: Vec<Finished>,
    abandoned: Vec<(Arc<str>, LoadFailure)>,
}

fn fail(code: FailCode, message: impl Into<String>) -> Failure {
    Failure::new(code, message)
}

impl RecvMachine {
    pub fn new(cfg: RecvConfig) -> RecvMachine {
        RecvMachine {
            cfg,
            local: None,
            loads: BTreeMap::new(),
            by_req: BTreeMap::new(),
            next: 1,
            boots: BTreeMap::new(),
            booting: BTreeSet::new(),
            peers: BTreeMap::new(),
            handshaking: BTreeSet::new(),
            actions: VecDeque::new(),
            finished: Vec::new(),
            abandoned: Vec::new(),
        }
    }

    /// The engine's KV cache facts and weights (set at registration and
    /// after every weight reload).
    pub fn set_local(&mut self, local: LocalKv) {
        self.local = Some(local);
    }

    pub fn poll_action(&mut self) -> Option<Action> {
        self.actions.pop_front()
    }

    /// Loads whose blocks nothing writes any more (each once).
    pub fn take_finished(&mut self) -> Vec<Finished> {
        std::mem::take(&mut self.finished)
    }

    /// Loads given up before their fence, for requests still alive.
    pub fn take_abandoned(&mut self) -> Vec<(Arc<str>, LoadFailure)> {
        std::mem::take(&mut self.abandoned)
    }

    /// Loads not yet finished (any phase).
    pub fn num_loads(&self) -> usize {
        self.loads.len()
    }

    /// Loads that may write into this engine's blocks (started, not finished).
    pub fn num_active(&self) -> usize {
        self.loads
            .values()
            .filter(|l| l.phase != Phase::Decided)
            .count()
    }

    /// Destination blocks of every load not finished.
    pub fn held_blocks(&self) -> usize {
        self.loads.values().map(|l| l.spec.dst_blocks.len()).sum()
    }

    pub fn phase(&self, req: &str) -> Option<PhaseName> {
        let l = self.loads.get(self.by_req.get(req)?)?;
        Some(match l.phase {
            Phase::Decided => PhaseName::Decided,
            Phase::Booting { .. } => PhaseName::Booting,
            Phase::Pulling { .. } => PhaseName::Pulling,
            Phase::Handshaking { .. } => PhaseName::Handshaking,
            Phase::Reading { .. } => PhaseName::Reading,
            Phase::Confirming { .. } => PhaseName::Confirming,
            Phase::Fencing { .. } => PhaseName::Fencing,
        })
    }

    /// Whether a load of `transfer_id` that is not finished has `block`
    /// among its destination blocks (a write may land there).
    pub fn is_loading_into(&self, transfer_id: &str, block: u32) -> bool {
        self.loads
            .values()
            .any(|l| l.spec.transfer_id == transfer_id && l.spec.dst_blocks.contains(&block))
    }

    /// The load of `req`, if one is not finished.
    pub fn load_of(&self, req: &str) -> Option<LoadId> {
        self.by_req.get(req).copied()
    }

    pub fn spec(&self, load: LoadId) -> Option<&LoadSpec> {
        self.loads.get(&load).map(|l| &l.spec)
    }

    /// A load for `spec.req` was decided (D's blocks exist).
    pub fn decide(&mut self, spec: LoadSpec) -> LoadId {
        let id = self.next;
        self.next += 1;
        self.by_req.insert(spec.req.clone(), id);
        self.loads.insert(
            id,
            Load {
                spec,
                phase: Phase::Decided,
                engine_knows: false,
                read_err: None,
            },
        );
        id
    }

    /// Starts a decided load. `refused`: the engine's KV cache is released
    /// (nothing may write into it), so the load ends at once.
    pub fn start(&mut self, now: Instant, req: &str, refused: Option<Failure>) {
        let Some(&id) = self.by_req.get(req) else {
            return;
        };
        let Some(l) = self.loads.get(&id) else { return };
        if l.phase != Phase::Decided {
            return;
        }
        if let Some(f) = refused {
            self.fail_unsent(id, f);
            return;
        }
        if l.spec.dst_blocks.is_empty() {
            self.fail_unsent(
                id,
                fail(FailCode::Protocol, "no destination blocks for the load"),
            );
            return;
        }
        let deadline = now + self.cfg.load_timeout;
        let addr = l.spec.addr.clone();
        if l.spec.read.is_some() {
            self.set_phase(
                id,
                Phase::Handshaking {
                    deadline,
                    refreshed: false,
                },
            );
            match self.peers.get(&addr).cloned() {
                Some(peer) => self.with_peer(now, id, &peer),
                None => self.ask_handshake(addr),
            }
        } else {
            self.set_phase(
                id,
                Phase::Booting {
                    deadline,
                    refreshed: false,
                },
            );
            match self.boots.get(&addr).cloned() {
                Some(boot) => self.with_boot(now, id, &boot),
                None => self.ask_bootstrap(addr),
            }
        }
    }

    fn set_phase(&mut self, id: LoadId, phase: Phase) {
        if let Some(l) = self.loads.get_mut(&id) {
            l.phase = phase;
        }
    }

    fn ask_bootstrap(&mut self, addr: String) {
        if self.booting.insert(addr.clone()) {
            self.actions.push_back(Action::Bootstrap { addr });
        }
    }

    fn ask_handshake(&mut self, addr: String) {
        if self.handshaking.insert(addr.clone()) {
            self.actions.push_back(Action::Handshake { addr });
        }
    }

    /// Loads waiting in `phase_is` for `addr`.
    fn waiting_on(&self, addr: &str, booting: bool) -> Vec<LoadId> {
        self.loads
            .iter()
            .filter(|(_, l)| l.spec.addr == addr)
            .filter(|(_, l)| {
                if booting {
                    matches!(l.phase, Phase::Booting { .. })
                } else {
                    matches!(l.phase, Phase::Handshaking { .. })
                }
            })
            .map(|(&id, _)| id)
            .collect()
    }

    /// P at `addr` answered a bootstrap (or it failed).
    pub fn on_bootstrap(&mut self, now: Instant, addr: &str, answer: Result<BootInfo, Failure>) {
        self.booting.remove(addr);
        match answer {
            Ok(boot) => {
                self.boots.insert(addr.to_string(), boot.clone());
                for id in self.waiting_on(addr, true) {
                    self.with_boot(now, id, &boot);
                }
            }
            Err(f) => {
                self.boots.remove(addr);
                for id in self.waiting_on(addr, true) {
                    self.fail_unsent(id, f.clone());
                }
            }
        }
    }

    /// Checks P's bootstrap against the load and this engine, then pulls.
    fn with_boot(&mut self, now: Instant, id: LoadId, boot: &BootInfo) {
        let Some(l) = self.loads.get(&id) else { return };
        let Phase::Booting {
            deadline,
            refreshed,
        } = l.phase
        else {
            return;
        };
        if boot.engine_id != l.spec.remote_engine_id {
            // A P restarted under another id at the same address: ask again
            // once (the cache may be old), then refuse.
            if !refreshed {
                let addr = l.spec.addr.clone();
                self.set_phase(
                    id,
                    Phase::Booting {
                        deadline,
                        refreshed: true,
                    },
                );
                self.boots.remove(&addr);
                self.ask_bootstrap(addr);
                return;
            }
            let f = fail(
                FailCode::Mismatch,
                format!(
                    "remote_engine_id mismatch: the request names {:?}, the prefill engine at {} is {:?}",
                    l.spec.remote_engine_id, l.spec.addr, boot.engine_id
                ),
            );
            // Another engine than the params name: leave its transfers alone.
            self.finish(id, LoadEnd::Failed(LoadFailure::new(f)));
            return;
        }
        if let Err(f) = self.check_layout(&boot.engine_id, &boot.layout, boot.block_bytes) {
            self.fail_unsent(id, f);
            return;
        }
        let deadline = now + self.cfg.load_timeout;
        let spec = l.spec.clone();
        let weights_version = self.local.as_ref().and_then(|k| k.weights_version.clone());
        self.set_phase(id, Phase::Pulling { deadline });
        self.actions.push_back(Action::Pull {
            load: id,
            spec,
            weights_version,
        });
    }

    fn check_layout(&self, engine_id: &str, layout: &str, block_bytes: u64) -> Result<(), Failure> {
        let Some(k) = &self.local else {
            return Err(fail(FailCode::Protocol, "the KV cache is not registered"));
        };
        if layout != k.layout || block_bytes != k.block_bytes {
            return Err(fail(
                FailCode::Mismatch,
                format!(
                    "KV layout mismatch: the prefill engine {engine_id:?} has {layout:?} ({block_bytes} bytes per block), this engine has {:?} ({} bytes per block)",
                    k.layout, k.block_bytes
                ),
            ));
        }
        Ok(())
    }

    /// P reported progress on the load's pull: D's deadline restarts.
    pub fn on_progress(&mut self, now: Instant, load: LoadId) {
        let t = self.cfg.load_timeout;
        if let Some(Load {
            phase: Phase::Pulling { deadline },
            ..
        }) = self.loads.get_mut(&load)
        {
            *deadline = now + t;
        }
    }

    /// The load's pull ended.
    pub fn on_pull_result(&mut self, now: Instant, load: LoadId, result: PullResult) {
        let Some(l) = self.loads.get(&load) else {
            return;
        };
        match (&l.phase, result) {
            (Phase::Pulling { .. }, PullResult::Answered(Ok(()))) => {
                self.finish(load, LoadEnd::Loaded)
            }
            // The early answer to a drop (a proxy's): P may still write.
            (Phase::Pulling { .. }, PullResult::Answered(Err(f)))
                if f.code == FailCode::Dropped =>
            {
                self.abandon(now, load, f);
            }
            (Phase::Pulling { .. }, PullResult::Answered(Err(f))) => {
                self.finish(load, LoadEnd::Failed(LoadFailure::new(f)));
            }
            (Phase::Pulling { .. }, PullResult::NotSent(f)) => self.fail_unsent(load, f),
            (Phase::Pulling { .. }, PullResult::Lost(f)) => self.abandon(now, load, f),
            (Phase::Fencing { .. }, PullResult::Answered(Err(f)))
                if f.code == FailCode::Dropped => {}
            (Phase::Fencing { .. }, PullResult::Answered(_) | PullResult::NotSent(_)) => {
                self.fenced(load)
            }
            _ => {}
        }
    }

    /// D stops waiting for a load P may still write: the engine learns the
    /// failure now (its blocks stay held), the fence starts.
    fn abandon(&mut self, now: Instant, load: LoadId, f: Failure) {
        let Some(l) = self.loads.get_mut(&load) else {
            return;
        };
        let lf = LoadFailure::new(f);
        if !l.engine_knows {
            l.engine_knows = true;
            self.abandoned.push((l.spec.req.clone(), lf.clone()));
        }
        self.start_fence(now, load, LoadEnd::Failed(lf));
    }

    /// Moves a load to Fencing: in write mode a drop and the local fence at
    /// once (either ends it), in read mode a cancel of the read.
    fn start_fence(&mut self, _now: Instant, load: LoadId, end: LoadEnd) {
        let Some(l) = self.loads.get_mut(&load) else {
            return;
        };
        let read = l.spec.read.is_some();
        let (addr, tid) = (l.spec.addr.clone(), l.spec.transfer_id.clone());
        let reading = matches!(l.phase, Phase::Reading { .. });
        l.phase = Phase::Fencing {
            after: After::Report(end),
            drop_pending: !read,
            fence_pending: !read,
            retry_at: None,
        };
        if read {
            if reading {
                self.actions.push_back(Action::CancelRead { load });
            } else {
                // Handshaking or Confirming: nothing of ours writes the blocks.
                self.fenced(load);
            }
            return;
        }
        self.actions.push_back(Action::Drop {
            load,
            addr,
            transfer_id: tid,
        });
        self.actions.push_back(Action::Fence { load });
    }

    /// P answered the load's drop (`Ok`) or the drop failed.
    pub fn on_drop_answer(&mut self, now: Instant, load: LoadId, answer: Result<bool, Failure>) {
        match answer {
            Ok(_) => self.fenced(load),
            Err(_) => self.fence_attempt_failed(now, load, true),
        }
    }

    /// The driver's local fence for the load succeeded (`Ok`) or not.
    pub fn on_fenced(&mut self, now: Instant, load: LoadId, result: Result<(), Failure>) {
        match result {
            Ok(()) => self.fenced(load),
            Err(_) => self.fence_attempt_failed(now, load, false),
        }
    }

    fn fence_attempt_failed(&mut self, now: Instant, load: LoadId, was_drop: bool) {
        if let Some(Load {
            phase:
                Phase::Fencing {
                    drop_pending,
                    fence_pending,
                    retry_at,
                    ..
                },
            ..
        }) = self.loads.get_mut(&load)
        {
            if was_drop {
                *drop_pending = false;
            } else {
                *fence_pending = false;
            }
            if !*drop_pending && !*fence_pending {
                *retry_at = Some(now + FENCE_RETRY);
            }
        }
    }

    /// Nothing can land in the load's blocks any more: report it. A read
    /// given up also ends P's lease now (else P keeps the blocks until the
    /// lease expires).
    fn fenced(&mut self, load: LoadId) {
        let Some(l) = self.loads.get(&load) else {
            return;
        };
        if let Phase::Fencing {
            after: After::Report(end),
            ..
        } = &l.phase
        {
            let end = end.clone();
            let lease = l
                .spec
                .read
                .is_some()
                .then(|| (l.spec.addr.clone(), l.spec.transfer_id.clone()));
            self.finish(load, end);
            if let Some((addr, transfer_id)) = lease {
                self.actions
                    .push_back(Action::DropUnpulled { addr, transfer_id });
            }
        }
    }

    /// P at `addr` answered a handshake (read mode), or it failed.
    pub fn on_handshake(&mut self, now: Instant, addr: &str, answer: Result<PeerInfo, Failure>) {
        self.handshaking.remove(addr);
        match answer {
            Ok(peer) => {
                self.peers.insert(addr.to_string(), peer.clone());
                for id in self.waiting_on(addr, false) {
                    self.with_peer(now, id, &peer);
                }
            }
            Err(f) => {
                self.peers.remove(addr);
                for id in self.waiting_on(addr, false) {
                    self.fail_unsent(id, f.clone());
                }
            }
        }
    }

    /// Read mode: checks P's handshake (handshaking again, once, when the
    /// params name another engine or a newer generation), then reads.
    fn with_peer(&mut self, now: Instant, id: LoadId, peer: &PeerInfo) {
        let Some(l) = self.loads.get(&id) else { return };
        let Phase::Handshaking {
            deadline,
            refreshed,
        } = l.phase
        else {
            return;
        };
        let rp = l.spec.read.clone().expect("read mode");
        let behind = peer.generation().is_none_or(|g| g < rp.generation);
        if (peer.engine_id != l.spec.remote_engine_id || behind) && !refreshed {
            let addr = l.spec.addr.clone();
            self.set_phase(
                id,
                Phase::Handshaking {
                    deadline,
                    refreshed: true,
                },
            );
            self.peers.remove(&addr);
            self.ask_handshake(addr);
            return;
        }
        if peer.engine_id != l.spec.remote_engine_id {
            let f = fail(
                FailCode::Mismatch,
                format!(
                    "remote_engine_id mismatch: the request names {:?}, the prefill engine at {} is {:?}",
                    l.spec.remote_engine_id, l.spec.addr, peer.engine_id
                ),
            );
            // Another engine than the params name: leave its transfers alone.
            self.finish(id, LoadEnd::Failed(LoadFailure::new(f)));
            return;
        }
        if let Err(f) = self.check_read(&l.spec, &rp, peer) {
            self.fail_unsent(id, f);
            return;
        }
        let deadline = now + self.cfg.load_timeout;
        let spec = l.spec.clone();
        self.set_phase(id, Phase::Reading { deadline });
        self.actions.push_back(Action::Read {
            load: id,
            spec,
            peer: peer.clone(),
            generation: rp.generation,
            deadline,
        });
    }

    /// What must hold before D reads P's leased blocks.
    fn check_read(&self, spec: &LoadSpec, rp: &ReadParams, peer: &PeerInfo) -> Result<(), Failure> {
        self.check_layout(&peer.engine_id, &peer.layout, peer.block_bytes)?;
        let mine = self.local.as_ref().and_then(|k| k.weights_version.clone());
        if rp.weights_version != mine {
            return Err(fail(
                FailCode::WeightsMismatch,
                format!(
                    "weights mismatch: the prefill engine {:?} computed this KV with weights {:?}, this engine serves {:?}",
                    peer.engine_id, rp.weights_version, mine
                ),
            ));
        }
        match peer.generation() {
            None => {
                return Err(fail(
                    FailCode::Asleep,
                    format!(
                        "the prefill engine {:?} has released its KV cache (asleep): generation {} cannot be read",
                        peer.engine_id, rp.generation
                    ),
                ))
            }
            // Registered again since it leased the blocks: a release (a
            // sleep) ended the lease on purpose.
            Some(g) if g != rp.generation => {
                return Err(fail(
                    FailCode::Asleep,
                    format!(
                        "the prefill engine {:?} released and registered its KV cache again since it leased these blocks (generation {} is now {}): the lease ended",
                        peer.engine_id, rp.generation, g
                    ),
                ))
            }
            Some(_) => {}
        }
        let tokens = spec.prompt_len.saturating_sub(1);
        let needed = tokens.div_ceil(self.cfg.block_size);
        if rp.block_ids.len() != needed {
            return Err(fail(
                FailCode::Mismatch,
                format!(
                    "block count mismatch: kv_transfer_params.remote_block_ids names {} blocks, the KV of {tokens} tokens fills {needed} blocks of {} tokens",
                    rp.block_ids.len(),
                    self.cfg.block_size
                ),
            ));
        }
        let end = spec.first_block + spec.dst_blocks.len();
        if spec.dst_blocks.is_empty() || end > needed {
            return Err(fail(
                FailCode::Mismatch,
                format!("no blocks to read: blocks {}..{end} of the {needed} in kv_transfer_params.remote_block_ids", spec.first_block),
            ));
        }
        Ok(())
    }

    /// Read mode: D's own read of the load's blocks ended (nothing writes
    /// them any more). Either way P is told `read_done`: it ends the lease,
    /// and its answer says whether the data is valid — or, for a failed
    /// read, whether P had ended the lease on purpose (D then recomputes).
    pub fn on_read_result(&mut self, now: Instant, load: LoadId, result: Result<(), Failure>) {
        let Some(l) = self.loads.get_mut(&load) else {
            return;
        };
        match &l.phase {
            Phase::Reading { .. } => {
                let (addr, tid) = (l.spec.addr.clone(), l.spec.transfer_id.clone());
                if result.is_err() {
                    // A fresh handshake next time (P may have moved on).
                    self.peers.remove(&addr);
                }
                l.read_err = result.err();
                l.phase = Phase::Confirming {
                    deadline: now + self.cfg.load_timeout,
                };
                self.actions.push_back(Action::ReadDone {
                    load,
                    addr,
                    transfer_id: tid,
                });
            }
            Phase::Fencing { .. } => self.fenced(load),
            _ => {}
        }
    }

    /// Read mode: P's answer to `read_done` (`Ok`: its lease held the
    /// blocks until the read ended, so the data is valid).
    pub fn on_read_done_answer(
        &mut self,
        _now: Instant,
        load: LoadId,
        answer: Result<(), Failure>,
    ) {
        let Some(l) = self.loads.get(&load) else {
            return;
        };
        if !matches!(l.phase, Phase::Confirming { .. }) {
            return;
        }
        let tid = &l.spec.transfer_id;
        let end = match (answer, &l.read_err) {
            (Ok(()), None) => LoadEnd::Loaded,
            // P had ended the lease on purpose: that is why the read failed.
            (Err(f), Some(read)) if f.code.on_purpose() => LoadEnd::Failed(LoadFailure::new(Failure::new(
                f.code,
                format!(
                    "the KV read of transfer {tid:?} failed ({}): the prefill engine had ended the lease on purpose: {}",
                    read.message, f.message
                ),
            ))),
            (_, Some(read)) => LoadEnd::Failed(LoadFailure::new(read.clone())),
            (Err(f), None) => LoadEnd::Failed(LoadFailure::new(Failure::new(
                f.code,
                format!(
                    "the KV read of transfer {tid:?} is void: the prefill engine no longer held the blocks when the read ended: {}",
                    f.message
                ),
            ))),
        };
        self.finish(load, end);
    }

    /// The request of a load ended. Returns whether the engine must keep
    /// the request's blocks until the load is finished (a load P may still
    /// write into; a load not started is dropped at P and needs nothing).
    pub fn request_gone(&mut self, now: Instant, req: &str) -> bool {
        let Some(&id) = self.by_req.get(req) else {
            return false;
        };
        let Some(l) = self.loads.get_mut(&id) else {
            return false;
        };
        match l.phase {
            Phase::Decided => {
                let (addr, transfer_id) = (l.spec.addr.clone(), l.spec.transfer_id.clone());
                self.remove(id);
                self.actions
                    .push_back(Action::DropUnpulled { addr, transfer_id });
                false
            }
            // Its blocks went to the engine's held set when it learned.
            Phase::Fencing { .. } => false,
            Phase::Booting { .. } | Phase::Handshaking { .. } => {
                // Nothing was sent that writes: done now.
                l.engine_knows = true;
                let (addr, transfer_id) = (l.spec.addr.clone(), l.spec.transfer_id.clone());
                self.finish(id, LoadEnd::Gone);
                self.actions
                    .push_back(Action::DropUnpulled { addr, transfer_id });
                true
            }
            Phase::Confirming { .. } => {
                l.engine_knows = true;
                self.finish(id, LoadEnd::Gone);
                true
            }
            Phase::Pulling { .. } | Phase::Reading { .. } => {
                l.engine_knows = true;
                self.start_fence(now, id, LoadEnd::Gone);
                true
            }
        }
    }

    /// A cache reset cut every load short (the engine holds their blocks
    /// and recomputes the requests): loads not started end now, the others
    /// once fenced.
    pub fn abort_all(&mut self, now: Instant) {
        let ids: Vec<LoadId> = self.loads.keys().copied().collect();
        for id in ids {
            let Some(l) = self.loads.get_mut(&id) else {
                continue;
            };
            l.engine_knows = true;
            let cut = LoadEnd::Failed(LoadFailure::new(fail(FailCode::CacheReset, CUT_SHORT)));
            match l.phase {
                Phase::Decided
                | Phase::Booting { .. }
                | Phase::Handshaking { .. }
                | Phase::Confirming { .. } => self.finish(id, cut),
                Phase::Pulling { .. } | Phase::Reading { .. } => self.start_fence(now, id, cut),
                Phase::Fencing { .. } => {}
            }
        }
    }

    /// Ends a load: reported in `finished` (the engine frees or uses the
    /// blocks) and forgotten.
    fn finish(&mut self, id: LoadId, end: LoadEnd) {
        let Some(l) = self.remove(id) else { return };
        self.actions.push_back(Action::Forget { load: id });
        self.finished.push(Finished {
            req: l.spec.req,
            end,
            dst_blocks: l.spec.dst_blocks,
        });
    }

    /// Ends a load that failed before anything reached P's blocks: P is
    /// told to drop the transfer (best effort), so it frees the blocks it
    /// keeps for D now instead of when its lease expires.
    fn fail_unsent(&mut self, id: LoadId, f: Failure) {
        let Some(l) = self.loads.get(&id) else { return };
        let (addr, transfer_id) = (l.spec.addr.clone(), l.spec.transfer_id.clone());
        self.finish(id, LoadEnd::Failed(LoadFailure::new(f)));
        self.actions
            .push_back(Action::DropUnpulled { addr, transfer_id });
    }

    fn remove(&mut self, id: LoadId) -> Option<Load> {
        let l = self.loads.remove(&id)?;
        if self.by_req.get(&l.spec.req) == Some(&id) {
            self.by_req.remove(&l.spec.req);
        }
        Some(l)
    }

    /// When [`RecvMachine::handle_timeout`] must run next.
    pub fn poll_timeout(&self) -> Option<Instant> {
        self.loads
            .values()
            .filter_map(|l| match &l.phase {
                Phase::Booting { deadline, .. }
                | Phase::Pulling { deadline }
                | Phase::Handshaking { deadline, .. }
                | Phase::Reading { deadline }
                | Phase::Confirming { deadline } => Some(*deadline),
                Phase::Fencing { retry_at, .. } => *retry_at,
                Phase::Decided => None,
            })
            .min()
    }

    /// Gives up loads past their deadline, tries failed fences again.
    pub fn handle_timeout(&mut self, now: Instant) {
        let ids: Vec<LoadId> = self.loads.keys().copied().collect();
        for id in ids {
            let Some(l) = self.loads.get(&id) else {
                continue;
            };
            let timeout = || {
                fail(
                    FailCode::Timeout,
                    format!(
                        "no answer from the prefill engine at {} within load_timeout_s ({:?}) of last hearing from it",
                        l.spec.addr, self.cfg.load_timeout
                    ),
                )
            };
            match &l.phase {
                Phase::Booting { deadline, .. } | Phase::Handshaking { deadline, .. }
                    if *deadline <= now =>
                {
                    let f = timeout();
                    self.fail_unsent(id, f);
                }
                Phase::Confirming { deadline } if *deadline <= now => {
                    let f = l.read_err.clone().unwrap_or_else(timeout);
                    self.finish(id, LoadEnd::Failed(LoadFailure::new(f)));
                }
                Phase::Pulling { deadline } | Phase::Reading { deadline } if *deadline <= now => {
                    let f = timeout();
                    self.abandon(now, id, f);
                }
                Phase::Fencing {
                    retry_at: Some(at), ..
                } if *at <= now => self.retry_fence(id),
                _ => {}
            }
        }
    }

    fn retry_fence(&mut self, id: LoadId) {
        let Some(l) = self.loads.get_mut(&id) else {
            return;
        };
        let (addr, tid) = (l.spec.addr.clone(), l.spec.transfer_id.clone());
        if let Phase::Fencing {
            drop_pending,
            fence_pending,
            retry_at,
            ..
        } = &mut l.phase
        {
            *drop_pending = true;
            *fence_pending = true;
            *retry_at = None;
        }
        self.actions.push_back(Action::Drop {
            load: id,
            addr,
            transfer_id: tid,
        });
        self.actions.push_back(Action::Fence { load: id });
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    const LOAD: Duration = Duration::from_secs(40);

    fn machine() -> RecvMachine {
        let mut m = RecvMachine::new(RecvConfig {
            load_timeout: LOAD,
            block_size: 16,
        });
        m.set_local(LocalKv {
            layout: "l".into(),
            block_bytes: 64,
            weights_version: None,
        });
        m
    }

    fn spec(req: &str) -> LoadSpec {
        LoadSpec {
            req: Arc::from(req),
            transfer_id: format!("t-{req}"),
            remote_engine_id: "p0".into(),
            addr: "127.0.0.1:9".into(),
            prompt_len: 40,
            first_block: 0,
            dst_blocks: vec![5, 6, 7],
            read: None,
        }
    }

    fn boot() -> BootInfo {
        BootInfo {
            engine_id: "p0".into(),
            layout: "l".into(),
            block_bytes: 64,
        }
    }

    fn actions(m: &mut RecvMachine) -> Vec<Action> {
        std::iter::from_fn(|| m.poll_action()).collect()
    }

    /// A load of `req` whose pull is at P (bootstrapped already or now).
    fn pulling(m: &mut RecvMachine, now: Instant, req: &str) -> LoadId {
        actions(m);
        let id = m.decide(spec(req));
        m.start(now, req, None);
        if m.phase(req) == Some(PhaseName::Booting) {
            assert_eq!(
                actions(m),
                vec![Action::Bootstrap {
                    addr: "127.0.0.1:9".into()
                }]
            );
            m.on_bootstrap(now, "127.0.0.1:9", Ok(boot()));
        }
        assert!(matches!(actions(m)[..], [Action::Pull { load, .. }] if load == id));
        assert_eq!(m.phase(req), Some(PhaseName::Pulling));
        id
    }

    fn ends(m: &mut RecvMachine) -> Vec<(String, LoadEnd)> {
        m.take_finished()
            .into_iter()
            .map(|f| (f.req.to_string(), f.end))
            .collect()
    }

    #[test]
    fn counts_and_the_block_oracle_follow_a_load_from_decided_to_finished() {
        let t0 = Instant::now();
        let mut m = machine();
        assert_eq!((m.num_loads(), m.num_active(), m.held_blocks()), (0, 0, 0));
        let a = m.decide(spec("a"));
        // Decided: D's blocks are held, nothing may write into them yet.
        assert_eq!((m.num_loads(), m.num_active(), m.held_blocks()), (1, 0, 3));
        assert!(m.is_loading_into("t-a", 5) && m.is_loading_into("t-a", 7));
        assert!(!m.is_loading_into("t-a", 8), "a block outside the load");
        assert!(
            !m.is_loading_into("t-b", 5),
            "a block of the load, another transfer"
        );
        m.decide(LoadSpec {
            dst_blocks: vec![9, 10],
            ..spec("b")
        });
        assert_eq!((m.num_loads(), m.num_active(), m.held_blocks()), (2, 0, 5));
        m.start(t0, "a", None);
        m.on_bootstrap(t0, "127.0.0.1:9", Ok(boot()));
        assert_eq!(m.phase("a"), Some(PhaseName::Pulling));
        assert_eq!((m.num_loads(), m.num_active(), m.held_blocks()), (2, 1, 5));
        m.on_pull_result(t0, a, PullResult::Answered(Ok(())));
        assert_eq!(ends(&mut m), vec![("a".into(), LoadEnd::Loaded)]);
        assert_eq!((m.num_loads(), m.num_active(), m.held_blocks()), (1, 0, 2));
        assert!(
            !m.is_loading_into("t-a", 5),
            "a finished load holds no block"
        );
        assert!(m.is_loading_into("t-b", 9));
        assert_eq!((m.load_of("a"), m.phase("a")), (None, None));
        assert!(m.load_of("b").is_some());
    }

    #[test]
    fn a_drop_answered_early_at_p_fences_the_load_before_its_blocks_go_back() {
        let t0 = Instant::now();
        let mut m = machine();
        let a = pulling(&mut m, t0, "a");
        // A proxy dropped the transfer at P while P may still be writing.
        m.on_pull_result(
            t0,
            a,
            PullResult::Answered(Err(Failure::new(FailCode::Dropped, "released"))),
        );
        assert!(
            m.take_finished().is_empty(),
            "no block goes back before the fence"
        );
        assert_eq!(m.take_abandoned().len(), 1);
        assert_eq!(m.phase("a"), Some(PhaseName::Fencing));
        assert!(m.is_loading_into("t-a", 5));
        m.on_fenced(t0, a, Ok(()));
        assert!(
            matches!(&ends(&mut m)[..], [(_, LoadEnd::Failed(lf))] if lf.failure.code == FailCode::Dropped)
        );
        // Any other refusal ends the load at once: nothing of P writes.
        let b = pulling(&mut m, t0, "b");
        m.on_pull_result(
            t0,
            b,
            PullResult::Answered(Err(Failure::new(FailCode::CacheReset, "reset"))),
        );
        assert!(
            matches!(&ends(&mut m)[..], [(_, LoadEnd::Failed(lf))] if lf.failure.code == FailCode::CacheReset)
        );
    }

    #[test]
    fn a_load_bootstraps_once_per_address_pulls_and_ends_with_p_s_answer() {
        let t0 = Instant::now();
        let mut m = machine();
        let a = pulling(&mut m, t0, "a");
        // The second load to the same P needs no bootstrap.
        let b = pulling(&mut m, t0, "b");
        m.on_pull_result(t0, a, PullResult::Answered(Ok(())));
        assert_eq!(ends(&mut m), vec![("a".into(), LoadEnd::Loaded)]);
        assert_eq!(actions(&mut m), vec![Action::Forget { load: a }]);
        let f = Failure::new(FailCode::CacheReset, "reset");
        m.on_pull_result(t0, b, PullResult::Answered(Err(f.clone())));
        assert_eq!(
            ends(&mut m),
            vec![(
                "b".into(),
                LoadEnd::Failed(LoadFailure {
                    failure: f,
                    recompute: true
                })
            )]
        );
        assert_eq!(m.num_loads(), 0);
    }

    #[test]
    fn d_waits_while_p_reports_progress_and_gives_up_load_timeout_after_last_hearing() {
        let t0 = Instant::now();
        let mut m = machine();
        let a = pulling(&mut m, t0, "a");
        // A long prefill: progress every 2 s for ten minutes keeps the load.
        let mut now = t0;
        for _ in 0..300 {
            now += Duration::from_secs(2);
            m.on_progress(now, a);
            m.handle_timeout(now);
        }
        assert_eq!(m.phase("a"), Some(PhaseName::Pulling));
        assert_eq!(m.poll_timeout(), Some(now + LOAD));
        m.handle_timeout(now + LOAD);
        // Given up: the engine learns now, the blocks wait for a fence.
        let ab = m.take_abandoned();
        assert_eq!(ab.len(), 1);
        assert_eq!(
            (ab[0].1.failure.code, ab[0].1.recompute),
            (FailCode::Timeout, false)
        );
        assert!(
            m.take_finished().is_empty(),
            "no block is given back before the fence"
        );
        assert_eq!(
            actions(&mut m),
            vec![
                Action::Drop {
                    load: a,
                    addr: "127.0.0.1:9".into(),
                    transfer_id: "t-a".into()
                },
                Action::Fence { load: a }
            ]
        );
        assert_eq!(m.phase("a"), Some(PhaseName::Fencing));
    }

    #[test]
    fn a_fence_ends_on_a_drop_answer_a_local_fence_or_a_real_pull_answer_never_the_early_one() {
        let t0 = Instant::now();
        for how in 0..4 {
            let mut m = machine();
            let a = pulling(&mut m, t0, "a");
            assert!(
                m.request_gone(t0, "a"),
                "the engine keeps the blocks until the fence"
            );
            actions(&mut m);
            // The early answer to our drop, and a broken connection: no fence.
            m.on_pull_result(
                t0,
                a,
                PullResult::Answered(Err(Failure::new(FailCode::Dropped, "released"))),
            );
            m.on_pull_result(
                t0,
                a,
                PullResult::Lost(Failure::new(FailCode::PeerLost, "reset")),
            );
            assert!(m.take_finished().is_empty(), "case {how}");
            match how {
                0 => m.on_drop_answer(t0, a, Ok(true)),
                1 => m.on_fenced(t0, a, Ok(())),
                2 => m.on_pull_result(t0, a, PullResult::Answered(Ok(()))),
                _ => m.on_pull_result(
                    t0,
                    a,
                    PullResult::Answered(Err(Failure::new(FailCode::TransferFailed, "x"))),
                ),
            }
            assert_eq!(
                ends(&mut m),
                vec![("a".into(), LoadEnd::Gone)],
                "case {how}"
            );
            assert!(
                m.take_abandoned().is_empty(),
                "a gone request is not abandoned"
            );
        }
    }

    #[test]
    fn failed_fences_are_tried_again_until_one_holds() {
        let t0 = Instant::now();
        let mut m = machine();
        let a = pulling(&mut m, t0, "a");
        m.request_gone(t0, "a");
        actions(&mut m);
        m.on_drop_answer(t0, a, Err(Failure::new(FailCode::PeerLost, "down")));
        assert_eq!(m.poll_timeout(), None, "the local fence is still pending");
        m.on_fenced(t0, a, Err(Failure::new(FailCode::Timeout, "in use")));
        assert_eq!(m.poll_timeout(), Some(t0 + FENCE_RETRY));
        m.handle_timeout(t0 + FENCE_RETRY);
        assert_eq!(actions(&mut m).len(), 2, "drop and fence again");
        m.on_fenced(t0 + FENCE_RETRY, a, Ok(()));
        assert_eq!(ends(&mut m), vec![("a".into(), LoadEnd::Gone)]);
        // The other order: a failed local fence waits for the drop's answer.
        let b = pulling(&mut m, t0, "b");
        m.request_gone(t0, "b");
        actions(&mut m);
        m.on_fenced(t0, b, Err(Failure::new(FailCode::Timeout, "in use")));
        assert_eq!(m.poll_timeout(), None, "the drop is still pending");
        m.on_drop_answer(t0, b, Ok(true));
        assert_eq!(ends(&mut m), vec![("b".into(), LoadEnd::Gone)]);
    }

    #[test]
    fn a_broken_connection_abandons_the_load_and_fences_it() {
        let t0 = Instant::now();
        let mut m = machine();
        let a = pulling(&mut m, t0, "a");
        m.on_pull_result(
            t0,
            a,
            PullResult::Lost(Failure::new(FailCode::PeerLost, "reset")),
        );
        assert_eq!(m.take_abandoned()[0].1.failure.code, FailCode::PeerLost);
        m.on_fenced(t0, a, Ok(()));
        match &ends(&mut m)[..] {
            [(r, LoadEnd::Failed(lf))] => {
                assert_eq!((r.as_str(), lf.failure.code), ("a", FailCode::PeerLost))
            }
            other => panic!("{other:?}"),
        }
        // Failed before the pull left D: nothing to fence.
        let b = pulling(&mut m, t0, "b");
        m.on_pull_result(
            t0,
            b,
            PullResult::NotSent(Failure::new(FailCode::PeerLost, "refused")),
        );
        assert!(m.take_abandoned().is_empty());
        assert_eq!(ends(&mut m).len(), 1);
    }

    #[test]
    fn an_unstarted_load_of_an_ended_request_is_dropped_at_p_and_forgotten() {
        let t0 = Instant::now();
        let mut m = machine();
        m.decide(spec("a"));
        assert!(!m.request_gone(t0, "a"));
        assert_eq!(
            actions(&mut m),
            vec![Action::DropUnpulled {
                addr: "127.0.0.1:9".into(),
                transfer_id: "t-a".into()
            }]
        );
        assert_eq!((m.num_loads(), m.take_finished().len()), (0, 0));
    }

    #[test]
    fn a_cache_reset_cuts_every_load_short_and_fences_the_ones_in_flight() {
        let t0 = Instant::now();
        let mut m = machine();
        m.decide(spec("idle"));
        let a = pulling(&mut m, t0, "a");
        m.abort_all(t0);
        let e = ends(&mut m);
        assert_eq!(e.len(), 1);
        assert!(
            matches!(&e[0], (r, LoadEnd::Failed(lf)) if r == "idle" && lf.recompute && lf.failure.message == CUT_SHORT)
        );
        assert!(
            m.take_abandoned().is_empty(),
            "the engine cut them short itself"
        );
        assert!(actions(&mut m).contains(&Action::Fence { load: a }));
        m.on_drop_answer(t0, a, Ok(true));
        assert!(
            matches!(&ends(&mut m)[..], [(r, LoadEnd::Failed(lf))] if r == "a" && lf.failure.code == FailCode::CacheReset)
        );
    }

    #[test]
    fn bootstrap_mismatches_fail_their_loads_without_a_pull() {
        let t0 = Instant::now();
        let mut m = machine();
        m.decide(spec("a"));
        m.start(t0, "a", None);
        actions(&mut m);
        m.on_bootstrap(
            t0,
            "127.0.0.1:9",
            Ok(BootInfo {
                layout: "other".into(),
                ..boot()
            }),
        );
        match &ends(&mut m)[..] {
            [(_, LoadEnd::Failed(lf))] => {
                assert_eq!(lf.failure.code, FailCode::Mismatch);
                assert!(
                    lf.failure.message.contains("layout mismatch"),
                    "{}",
                    lf.failure
                );
            }
            other => panic!("{other:?}"),
        }
        // Another engine id: asked again once, then refused.
        let mut m = machine();
        m.decide(spec("b"));
        m.start(t0, "b", None);
        assert_eq!(
            actions(&mut m),
            vec![Action::Bootstrap {
                addr: "127.0.0.1:9".into()
            }]
        );
        m.on_bootstrap(
            t0,
            "127.0.0.1:9",
            Ok(BootInfo {
                engine_id: "p9".into(),
                ..boot()
            }),
        );
        assert_eq!(
            actions(&mut m),
            vec![Action::Bootstrap {
                addr: "127.0.0.1:9".into()
            }]
        );
        assert_eq!(
            (ends(&mut m), m.phase("b")),
            (vec![], Some(PhaseName::Booting))
        );
        m.on_bootstrap(
            t0,
            "127.0.0.1:9",
            Ok(BootInfo {
                engine_id: "p9".into(),
                ..boot()
            }),
        );
        assert!(
            matches!(&ends(&mut m)[..], [(_, LoadEnd::Failed(lf))] if lf.failure.message.contains("remote_engine_id"))
        );
        // A stale answer cached for the address: the second answer names the
        // engine the params name, and the load pulls.
        let mut m = machine();
        m.decide(spec("c"));
        m.start(t0, "c", None);
        actions(&mut m);
        m.on_bootstrap(
            t0,
            "127.0.0.1:9",
            Ok(BootInfo {
                engine_id: "p9".into(),
                ..boot()
            }),
        );
        assert_eq!(
            actions(&mut m),
            vec![Action::Bootstrap {
                addr: "127.0.0.1:9".into()
            }]
        );
        m.on_bootstrap(t0, "127.0.0.1:9", Ok(boot()));
        assert!(matches!(actions(&mut m)[..], [Action::Pull { .. }]));
        assert_eq!(
            (ends(&mut m), m.phase("c")),
            (vec![], Some(PhaseName::Pulling))
        );
    }

    fn read_spec(req: &str, generation: u64, weights: Option<&str>) -> LoadSpec {
        LoadSpec {
            read: Some(ReadParams {
                block_ids: vec![1, 2, 3],
                generation,
                weights_version: weights.map(str::to_string),
            }),
            ..spec(req)
        }
    }

    fn peer(epoch: Option<u64>) -> PeerInfo {
        PeerInfo {
            engine_id: "p0".into(),
            layout: "l".into(),
            block_bytes: 64,
            transfer: crate::wire::Destination::Tcp {
                addr: "127.0.0.1:10".into(),
            },
            ranks: epoch.map(|e| {
                vec![crate::ranks::RankReg {
                    heads: (0, 1),
                    reg: pdkv_transfer::Registration {
                        segment: 1,
                        key: 2,
                        epoch: e,
                        len: 4096,
                    },
                }]
            }),
        }
    }

    #[test]
    fn every_phase_s_deadline_holds_until_it_is_due_and_no_longer() {
        let t0 = Instant::now();
        let just_before = t0 + LOAD - Duration::from_millis(1);
        let timed_out = |m: &mut RecvMachine| match &ends(m)[..] {
            [(_, LoadEnd::Failed(lf))] => {
                lf.failure.code == FailCode::Timeout
                    && lf.failure.message.contains("load_timeout_s")
            }
            _ => false,
        };
        // Booting (write mode) and Handshaking (read mode): no answer.
        for read in [false, true] {
            let mut m = machine();
            m.decide(if read {
                read_spec("a", 1, None)
            } else {
                spec("a")
            });
            m.start(t0, "a", None);
            actions(&mut m);
            let waiting = if read {
                PhaseName::Handshaking
            } else {
                PhaseName::Booting
            };
            assert_eq!(m.poll_timeout(), Some(t0 + LOAD));
            m.handle_timeout(just_before);
            assert_eq!((ends(&mut m), m.phase("a")), (vec![], Some(waiting)));
            m.handle_timeout(t0 + LOAD);
            assert!(timed_out(&mut m), "read mode {read}");
            let acts = actions(&mut m);
            assert!(
                acts.iter()
                    .any(|x| matches!(x, Action::DropUnpulled { .. })),
                "P's lease ends now: {acts:?}"
            );
        }
        // Confirming: P never answers read_done.
        let mut m = machine();
        m.decide(read_spec("a", 1, None));
        m.start(t0, "a", None);
        m.on_handshake(t0, "127.0.0.1:9", Ok(peer(Some(1))));
        let a = m.load_of("a").unwrap();
        m.on_read_result(t0, a, Ok(()));
        m.handle_timeout(just_before);
        assert_eq!(
            (ends(&mut m), m.phase("a")),
            (vec![], Some(PhaseName::Confirming))
        );
        m.handle_timeout(t0 + LOAD);
        assert!(timed_out(&mut m));
        // Fencing: a retry waits for its time.
        let b = pulling(&mut m, t0, "b");
        m.request_gone(t0, "b");
        actions(&mut m);
        m.on_drop_answer(t0, b, Err(Failure::new(FailCode::PeerLost, "down")));
        m.on_fenced(t0, b, Err(Failure::new(FailCode::Timeout, "in use")));
        m.handle_timeout(t0 + FENCE_RETRY - Duration::from_millis(1));
        assert_eq!(actions(&mut m), vec![], "no retry before FENCE_RETRY");
        // Another load's deadline does not end the ones not due.
        let mut m = machine();
        m.decide(spec("c"));
        m.start(t0, "c", None);
        actions(&mut m);
        let late = t0 + Duration::from_secs(5);
        m.decide(LoadSpec {
            addr: "127.0.0.1:11".into(),
            ..spec("d")
        });
        m.start(late, "d", None);
        m.handle_timeout(t0 + LOAD);
        assert!(timed_out(&mut m));
        assert_eq!(m.phase("d"), Some(PhaseName::Booting));
        assert_eq!(m.poll_timeout(), Some(late + LOAD));
    }

    #[test]
    fn read_mode_refuses_a_lease_of_a_registration_p_has_replaced_and_blocks_past_p_s_kv() {
        let t0 = Instant::now();
        // The load of `spec` after a handshake naming P's registration at
        // `epoch`: refused without a read.
        let refused = |spec: LoadSpec, epoch: u64| {
            let mut m = machine();
            let req = spec.req.to_string();
            m.decide(spec);
            m.start(t0, &req, None);
            actions(&mut m);
            m.on_handshake(t0, "127.0.0.1:9", Ok(peer(Some(epoch))));
            assert!(
                !actions(&mut m)
                    .iter()
                    .any(|x| matches!(x, Action::Read { .. })),
                "nothing is read"
            );
            match &ends(&mut m)[..] {
                [(_, LoadEnd::Failed(lf))] => lf.clone(),
                other => panic!("{other:?}"),
            }
        };
        // The params name generation 1, P is registered at 2 (it slept and
        // woke since it leased the blocks): the lease ended on purpose.
        let lf = refused(read_spec("a", 1, None), 2);
        assert_eq!((lf.failure.code, lf.recompute), (FailCode::Asleep, true));
        assert!(
            lf.failure.message.contains("generation 1 is now 2"),
            "{}",
            lf.failure
        );
        // D's blocks reach past the blocks P's KV fills.
        let lf = refused(
            LoadSpec {
                first_block: 1,
                ..read_spec("b", 1, None)
            },
            1,
        );
        assert_eq!(lf.failure.code, FailCode::Mismatch);
        assert!(
            lf.failure
                .message
                .contains("no blocks to read: blocks 1..4 of the 3"),
            "{}",
            lf.failure
        );
    }

    #[test]
    fn read_mode_handshakes_again_for_a_newer_generation_reads_then_confirms() {
        let t0 = Instant::now();
        let mut m = machine();
        m.decide(read_spec("a", 1, None));
        m.start(t0, "a", None);
        assert_eq!(
            actions(&mut m),
            vec![Action::Handshake {
                addr: "127.0.0.1:9".into()
            }]
        );
        m.on_handshake(t0, "127.0.0.1:9", Ok(peer(Some(1))));
        let a = match &actions(&mut m)[..] {
            [Action::Read {
                load,
                generation: 1,
                ..
            }] => *load,
            other => panic!("{other:?}"),
        };
        m.on_read_result(t0, a, Ok(()));
        assert!(matches!(actions(&mut m)[..], [Action::ReadDone { .. }]));
        assert_eq!(m.phase("a"), Some(PhaseName::Confirming));
        m.on_read_done_answer(t0, a, Ok(()));
        assert_eq!(ends(&mut m), vec![("a".into(), LoadEnd::Loaded)]);

        // P slept and woke: the params name generation 2, the cached
        // handshake says 1, so D handshakes again before reading.
        actions(&mut m);
        m.decide(read_spec("b", 2, None));
        m.start(t0, "b", None);
        assert_eq!(
            actions(&mut m),
            vec![Action::Handshake {
                addr: "127.0.0.1:9".into()
            }]
        );
        m.on_handshake(t0, "127.0.0.1:9", Ok(peer(Some(2))));
        assert!(matches!(
            actions(&mut m)[..],
            [Action::Read { generation: 2, .. }]
        ));
    }

    #[test]
    fn read_mode_refuses_kv_of_other_weights_and_void_reads() {
        let t0 = Instant::now();
        let mut m = machine();
        m.decide(read_spec("a", 1, Some("v2")));
        m.start(t0, "a", None);
        m.on_handshake(t0, "127.0.0.1:9", Ok(peer(Some(1))));
        match &ends(&mut m)[..] {
            [(_, LoadEnd::Failed(lf))] => {
                assert!(lf.recompute && lf.failure.code == FailCode::WeightsMismatch)
            }
            other => panic!("{other:?}"),
        }
        m.decide(read_spec("b", 1, None));
        m.start(t0, "b", None);
        actions(&mut m);
        let b = m.load_of("b").unwrap();
        m.on_read_result(t0, b, Ok(()));
        m.on_read_done_answer(t0, b, Err(Failure::new(FailCode::LeaseExpired, "expired")));
        assert!(
            matches!(&ends(&mut m)[..], [(_, LoadEnd::Failed(lf))] if lf.failure.message.contains("void"))
        );
    }

    /// P slept (or released its KV) and registered again while D held a
    /// lease's params: D's read names the lease's older generation and is
    /// refused. P's answer to read_done says P ended the lease on purpose,
    /// so the load recomputes; without such an answer the read's own
    /// failure stands. Catches the old behaviour, in which the refused read
    /// failed the load at once (under `fail`, the request).
    #[test]
    fn a_read_refused_after_p_released_the_lease_on_purpose_recomputes() {
        let t0 = Instant::now();
        let stale = || {
            Failure::new(
                FailCode::TransferFailed,
                "stale epoch: access names epoch 1, the registration is at epoch 2",
            )
        };
        for (answer, recompute) in [
            (
                Err(Failure::new(FailCode::CacheReset, "released (cache reset)")),
                true,
            ),
            // P reclaimed the KV after its lease: on purpose too.
            (
                Err(Failure::new(FailCode::LeaseExpired, "the lease expired")),
                true,
            ),
            (
                Err(Failure::new(FailCode::Protocol, "P lost the transfer")),
                false,
            ),
            (Ok(()), false),
        ] {
            let mut m = machine();
            m.decide(read_spec("a", 1, None));
            m.start(t0, "a", None);
            m.on_handshake(t0, "127.0.0.1:9", Ok(peer(Some(1))));
            actions(&mut m);
            let a = m.load_of("a").unwrap();
            m.on_read_result(t0, a, Err(stale()));
            assert!(
                m.take_finished().is_empty(),
                "the load waits for P's word on the lease"
            );
            assert!(actions(&mut m)
                .iter()
                .any(|x| matches!(x, Action::ReadDone { load, .. } if *load == a)));
            m.on_read_done_answer(t0, a, answer.clone());
            match &ends(&mut m)[..] {
                [(_, LoadEnd::Failed(lf))] => {
                    assert_eq!(lf.recompute, recompute, "{answer:?}: {lf:?}");
                    assert!(lf.failure.message.contains("stale epoch"), "{lf:?}");
                    if !recompute {
                        // Not on purpose: the read's own failure stands.
                        assert_eq!(lf.failure, stale(), "{answer:?}");
                    }
                }
                other => panic!("{answer:?}: {other:?}"),
            }
        }
        // P never answers: the read's failure, at the deadline.
        let mut m = machine();
        m.decide(read_spec("b", 1, None));
        m.start(t0, "b", None);
        m.on_handshake(t0, "127.0.0.1:9", Ok(peer(Some(1))));
        actions(&mut m);
        let b = m.load_of("b").unwrap();
        m.on_read_result(t0, b, Err(stale()));
        m.handle_timeout(t0 + LOAD);
        assert!(
            matches!(&ends(&mut m)[..], [(_, LoadEnd::Failed(lf))] if !lf.recompute && lf.failure.message.contains("stale epoch"))
        );
    }

    #[test]
    fn a_read_given_up_is_cancelled_and_ends_when_the_read_does() {
        let t0 = Instant::now();
        let mut m = machine();
        m.decide(read_spec("a", 1, None));
        m.start(t0, "a", None);
        m.on_handshake(t0, "127.0.0.1:9", Ok(peer(Some(1))));
        actions(&mut m);
        let a = m.load_of("a").unwrap();
        m.handle_timeout(t0 + LOAD);
        assert_eq!(m.take_abandoned().len(), 1);
        assert_eq!(actions(&mut m), vec![Action::CancelRead { load: a }]);
        assert!(
            m.take_finished().is_empty(),
            "our own read may still write the blocks"
        );
        m.on_read_result(
            t0 + LOAD,
            a,
            Err(Failure::new(FailCode::TransferFailed, "cancelled")),
        );
        assert_eq!(m.take_finished().len(), 1);
        // P's lease ends now, not when it expires.
        assert!(actions(&mut m).iter().any(
            |x| matches!(x, Action::DropUnpulled { transfer_id, .. } if transfer_id == "t-a")
        ));
    }

    #[test]
    fn a_load_refused_while_asleep_ends_at_once_on_purpose() {
        let t0 = Instant::now();
        let mut m = machine();
        m.decide(spec("a"));
        m.start(t0, "a", Some(Failure::new(FailCode::Asleep, "asleep")));
        assert!(matches!(&ends(&mut m)[..], [(_, LoadEnd::Failed(lf))] if lf.recompute));
        assert!(!actions(&mut m)
            .iter()
            .any(|a| matches!(a, Action::Bootstrap { .. } | Action::Pull { .. })));
    }
}
