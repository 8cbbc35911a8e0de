//! [`PdCore`]: its state, the accessors, the engine's calls that concern
//! both sides, and the step that turns what the machines decided into
//! [`Io`] (`drive`). P's side of it is `serve.rs`, D's `load.rs`, the KV
//! cache registration `memory.rs`.

use std::collections::{BTreeMap, BTreeSet, VecDeque};
use std::sync::Arc;
use std::time::{Duration, Instant};

use pdkv_engine::connector::{
    ConnectorRequest, Ended, ExternalMatch, FinishedTransfers, LoadError,
};
use pdkv_transfer::Registry;
use serde_json::Value;

use super::counters::{Counters, InFlight};
use super::io::{ConnId, Io, Op, SendIo, CONTROL_IO};
use super::kv::KvInfo;
use crate::claims::ClaimBook;
use crate::config::{KvRole, KvTransferConfig};
use crate::params::{ParamsError, PdParams, DO_REMOTE_DECODE, DO_REMOTE_PREFILL};
use crate::peers::KvPeers;
use crate::recv::{LoadFailure, LoadId, RecvConfig, RecvMachine};
use crate::send::{SendConfig, SendMachine};
use crate::wire::{Destination, FailCode, Message, Pull};

/// How long after a request is queued on D its transfer is first claimed
/// (at most; a quarter of `abort_timeout` when that is shorter), so that
/// the claims of requests queued together go in one message.
pub const FIRST_CLAIM: Duration = Duration::from_secs(1);

/// See the module docs.
pub struct PdCore {
    pub(super) cfg: KvTransferConfig,
    pub(super) engine_id: String,
    /// This engine's control listener (`ip:port`), for P's params.
    pub(super) bootstrap_addr: String,
    /// Where peers reach this engine's KV (its TCP agent or shm socket).
    pub(super) transfer_dest: Destination,
    pub(super) registry: Arc<Registry>,
    pub(super) kv: Option<KvInfo>,
    pub(super) asleep: bool,
    pub(super) weights_version: Option<String>,
    pub(super) send: SendMachine,
    pub(super) recv: RecvMachine,
    /// D: remote prefills noted at admission, by request.
    pub(super) pending: BTreeMap<Arc<str>, (PdParams, usize)>,
    /// D: loads decided and not yet handed to the worker side.
    pub(super) new_loads: Vec<Arc<str>>,
    /// D: requests whose load was decided (a later admission loads nothing).
    pub(super) decided: BTreeSet<Arc<str>>,
    /// P: the destination of every pull being served.
    pub(super) pulls: BTreeMap<ConnId, Pull>,
    /// D: the grant of each load's pull on every rank: `(segment, key)`.
    pub(super) grants: BTreeMap<LoadId, Vec<(u64, u64)>>,
    pub(super) io: VecDeque<Io>,
    pub(super) sending_done: Vec<Arc<str>>,
    pub(super) recving: Vec<Arc<str>>,
    pub(super) abandoned: Vec<Arc<str>>,
    pub(super) errors: Vec<(u32, LoadError)>,
    pub(super) reported_errors: Vec<(u32, LoadError)>,
    pub(super) news: bool,
    pub(super) counters: Counters,
    /// D: claims on the transfers of queued requests.
    pub(super) claims: ClaimBook,
}

impl PdCore {
    /// Queues one control exchange ([`SendIo`]).
    pub(super) fn exchange(&mut self, op: Op, addr: String, msg: Message, deadline: Instant) {
        self.io.push_back(Io::Send(SendIo {
            op,
            addr,
            msg,
            deadline,
        }));
    }

    pub fn new(
        cfg: KvTransferConfig,
        engine_id: &str,
        bootstrap_addr: String,
        transfer_dest: Destination,
        registry: Arc<Registry>,
    ) -> PdCore {
        let send = SendMachine::new(send_config(&cfg, pdkv_model::BLOCK_SIZE));
        let cfg_abort = cfg.abort_timeout;
        let recv = RecvMachine::new(RecvConfig {
            load_timeout: cfg.load_timeout,
            block_size: pdkv_model::BLOCK_SIZE,
        });
        PdCore {
            cfg,
            engine_id: engine_id.to_string(),
            bootstrap_addr,
            transfer_dest,
            registry,
            kv: None,
            asleep: false,
            weights_version: None,
            send,
            recv,
            pending: BTreeMap::new(),
            new_loads: Vec::new(),
            decided: BTreeSet::new(),
            pulls: BTreeMap::new(),
            grants: BTreeMap::new(),
            io: VecDeque::new(),
            sending_done: Vec::new(),
            recving: Vec::new(),
            abandoned: Vec::new(),
            errors: Vec::new(),
            reported_errors: Vec::new(),
            news: false,
            counters: Counters::default(),
            claims: ClaimBook::new(FIRST_CLAIM.min(cfg_abort / 4)),
        }
    }

    pub fn config(&self) -> &KvTransferConfig {
        &self.cfg
    }

    pub fn engine_id(&self) -> &str {
        &self.engine_id
    }

    pub fn bootstrap_addr(&self) -> &str {
        &self.bootstrap_addr
    }

    pub fn transfer_dest(&self) -> &Destination {
        &self.transfer_dest
    }

    pub fn kv(&self) -> Option<&KvInfo> {
        self.kv.as_ref()
    }

    /// The registry every rank's KV cache is registered in.
    pub fn registry(&self) -> &Arc<Registry> {
        &self.registry
    }

    pub fn counters(&self) -> Counters {
        let l = self.send.lease_counts();
        Counters {
            claims_received: l.claims,
            leases_expired: l.expired_unclaimed,
            claimed_leases_expired: l.expired_claimed,
            leases_reclaimed: l.reclaimed,
            ..self.counters
        }
    }

    /// D: queued requests whose transfers it claims now.
    pub fn num_claimed(&self) -> usize {
        self.claims.len()
    }

    pub fn is_asleep(&self) -> bool {
        self.asleep
    }

    pub fn send_machine(&self) -> &SendMachine {
        &self.send
    }

    pub fn recv_machine(&self) -> &RecvMachine {
        &self.recv
    }

    /// The next I/O for the driver.
    pub fn poll_io(&mut self) -> Option<Io> {
        self.io.pop_front()
    }

    /// Whether the engine has something to pick up (`get_finished`) since
    /// the last call; the driver wakes the engine then.
    pub fn take_news(&mut self) -> bool {
        std::mem::take(&mut self.news)
    }

    /// What still uses the KV cache registration.
    pub fn in_flight(&self) -> InFlight {
        InFlight {
            ready_blocks: self.send.ready_blocks(),
            writes: self.send.writes_in_flight(),
            loads: self.recv.num_active(),
        }
    }

    /// The next time [`PdCore::handle_timeout`] must run.
    pub fn poll_timeout(&self) -> Option<Instant> {
        [
            self.send.poll_timeout(),
            self.recv.poll_timeout(),
            self.claims.poll_timeout(),
        ]
        .into_iter()
        .flatten()
        .min()
    }

    pub fn handle_timeout(&mut self, now: Instant) {
        self.send.handle_timeout(now);
        self.recv.handle_timeout(now);
        for c in self.claims.due(now) {
            self.counters.claims_sent += c.transfer_ids.len() as u64;
            self.exchange(
                Op::Claim { id: c.id },
                c.addr,
                Message::Claim {
                    transfer_ids: c.transfer_ids,
                },
                now + CONTROL_IO,
            );
        }
        self.drive(now);
    }

    pub fn request_added(&mut self, now: Instant, req: ConnectorRequest<'_>) {
        match PdParams::parse(req.kv_transfer_params) {
            Ok(Some(PdParams::RemoteDecode { transfer_id })) if self.cfg.kv_role.produces() => {
                self.send.on_request_running(&transfer_id, req.id);
            }
            Ok(Some(PdParams::RemotePrefill {
                transfer_id,
                remote_bootstrap_addr,
                ..
            })) if self.cfg.kv_role.consumes() => {
                // P holds the KV while this request waits its turn.
                self.claims
                    .add(now, req.id, &remote_bootstrap_addr, &transfer_id);
            }
            _ => return,
        }
        self.drive(now);
    }

    pub fn get_num_new_matched_tokens(
        &mut self,
        now: Instant,
        req: ConnectorRequest<'_>,
        num_computed_tokens: usize,
    ) -> ExternalMatch {
        match PdParams::parse(req.kv_transfer_params) {
            Ok(Some(PdParams::RemoteDecode { transfer_id })) if self.cfg.kv_role.produces() => {
                self.send.on_request_running(&transfer_id, req.id);
                self.drive(now);
                ExternalMatch::default()
            }
            Ok(Some(p @ PdParams::RemotePrefill { .. })) if self.cfg.kv_role.consumes() => {
                if self.decided.contains(req.id) {
                    return ExternalMatch::default();
                }
                let n = req
                    .prompt_tokens
                    .len()
                    .saturating_sub(1)
                    .saturating_sub(num_computed_tokens);
                if n == 0 {
                    // Everything is in the local cache: P need not keep it.
                    self.claims.remove(req.id);
                    self.decided.insert(req.id.clone());
                    if let PdParams::RemotePrefill {
                        transfer_id,
                        remote_bootstrap_addr,
                        ..
                    } = p
                    {
                        self.drop_unpulled(now, remote_bootstrap_addr, transfer_id);
                    }
                    return ExternalMatch::default();
                }
                self.pending
                    .insert(req.id.clone(), (p, req.prompt_tokens.len()));
                ExternalMatch {
                    num_tokens: n,
                    load_async: true,
                }
            }
            _ => ExternalMatch::default(),
        }
    }

    pub fn request_finished(
        &mut self,
        now: Instant,
        req: ConnectorRequest<'_>,
        end: Ended<'_>,
    ) -> (bool, Option<Value>) {
        let Ended { block_ids, reason } = end;
        self.pending.remove(req.id);
        self.claims.remove(req.id);
        let decided = self.decided.remove(req.id);
        let out = match PdParams::parse(req.kv_transfer_params) {
            Ok(Some(PdParams::RemoteDecode { transfer_id })) if self.cfg.kv_role.produces() => {
                self.prefill_finished(now, &transfer_id, req, block_ids, reason)
            }
            Ok(Some(PdParams::RemotePrefill {
                transfer_id,
                remote_bootstrap_addr,
                ..
            })) if self.cfg.kv_role.consumes() => {
                if self.recv.load_of(req.id).is_some() {
                    self.new_loads.retain(|r| r != req.id);
                    (self.recv.request_gone(now, req.id), None)
                } else if self.recving.iter().any(|r| r == req.id) {
                    // Ended, not yet reported: the engine frees the blocks then.
                    self.errors.retain(|(b, _)| !block_ids.contains(b));
                    (true, None)
                } else {
                    if !decided {
                        // Ended before its load was decided: P would hold the
                        // blocks until its lease expired.
                        self.drop_unpulled(now, remote_bootstrap_addr, transfer_id);
                    }
                    (false, None)
                }
            }
            _ => (false, None),
        };
        self.drive(now);
        out
    }

    /// P: stops holding KV for D; D: cuts every load short (the engine
    /// holds their blocks and recomputes the requests).
    pub fn abort_transfers(&mut self, now: Instant) {
        self.send.abort_all(now);
        self.recv.abort_all(now);
        self.new_loads.clear();
        self.drive(now);
    }

    /// P: ends held sends until `blocks` come back (see
    /// [`SendMachine::reclaim`]); returns how many will.
    pub fn reclaim(&mut self, now: Instant, blocks: usize) -> usize {
        if !self.cfg.reclaim_held_kv {
            return 0;
        }
        let n = self.send.reclaim(now, blocks);
        self.drive(now);
        n
    }

    /// Blocks held for transfers now (sending and receiving).
    pub fn num_held_blocks(&self) -> usize {
        self.send.held_blocks() + self.recv.held_blocks()
    }

    pub fn get_finished(&mut self) -> FinishedTransfers {
        let errors = std::mem::take(&mut self.errors);
        self.reported_errors.extend(errors);
        FinishedTransfers {
            sending: std::mem::take(&mut self.sending_done),
            recving: std::mem::take(&mut self.recving),
            abandoned: std::mem::take(&mut self.abandoned),
        }
    }

    pub fn get_block_ids_with_load_errors(&mut self) -> Vec<(u32, LoadError)> {
        std::mem::take(&mut self.reported_errors)
    }

    // ---- turning machine actions into I/O ----

    /// Carries out what the machines decided, and collects their reports.
    pub(super) fn drive(&mut self, now: Instant) {
        while let Some(a) = self.send.poll_action() {
            self.send_action(now, a);
        }
        for r in self.send.take_finished() {
            self.sending_done.push(r);
            self.news = true;
        }
        while let Some(a) = self.recv.poll_action() {
            self.recv_action(now, a);
        }
        for (req, lf) in self.recv.take_abandoned() {
            self.counters.loads_abandoned += 1;
            tracing::warn!(request = %req, "KV load given up before its transfer was fenced: {}", lf.failure);
            if let Some(id) = self.recv.load_of(&req) {
                if let Some(spec) = self.recv.spec(id) {
                    let e = load_error(&lf);
                    self.errors
                        .extend(spec.dst_blocks.iter().map(|&b| (b, e.clone())));
                }
            }
            self.abandoned.push(req);
            self.news = true;
        }
        for f in self.recv.take_finished() {
            self.load_finished(f);
        }
    }
}

pub(super) fn load_error(lf: &LoadFailure) -> LoadError {
    let timed_out = matches!(lf.failure.code, FailCode::Timeout | FailCode::Deadline);
    LoadError {
        message: lf.failure.message.clone(),
        recompute: lf.recompute,
        timed_out,
    }
}

pub(crate) fn send_config(cfg: &KvTransferConfig, block_size: usize) -> SendConfig {
    SendConfig {
        abort_timeout: cfg.abort_timeout,
        arrival_timeout: cfg.arrival_timeout,
        prefill_timeout: cfg.prefill_timeout,
        heartbeat: cfg.heartbeat,
        num_workers: cfg.num_workers,
        block_size,
    }
}

/// Whether `role` may take a request with these params.
pub fn validate(
    role: KvRole,
    peers: Option<&KvPeers>,
    params: Option<&Value>,
) -> Result<(), ParamsError> {
    match PdParams::parse(params)? {
        Some(PdParams::RemoteDecode { .. }) if !role.produces() => Err(ParamsError::WrongRole {
            key: DO_REMOTE_DECODE,
            role: role.as_str(),
            does_not: "sends no KV",
        }),
        Some(PdParams::RemotePrefill { .. }) if !role.consumes() => Err(ParamsError::WrongRole {
            key: DO_REMOTE_PREFILL,
            role: role.as_str(),
            does_not: "receives no KV",
        }),
        Some(PdParams::RemotePrefill {
            remote_bootstrap_addr: addr,
            ..
        }) if peers.is_some_and(|p| !p.allows(&addr)) => Err(ParamsError::NotAPeer {
            addr,
            listed: peers.map(|p| p.listed().join(", ")).unwrap_or_default(),
        }),
        _ => Ok(()),
    }
}
