//! Everything the P/D connector decides for one engine, without I/O.
//!
//! [`PdCore`] holds P's [`SendMachine`] and D's [`RecvMachine`], the KV
//! cache registration and the engine-side bookkeeping. It takes the
//! engine's connector calls and the driver's I/O results, each with the
//! time, and queues [`Io`] for the driver. The production driver
//! (`net.rs`) runs it over TCP and shared memory; a simulator runs the same
//! core over a simulated network. Registering, granting and forgetting
//! memory are in-process calls on the real [`Registry`] and happen here;
//! only what waits on a peer (the network, an unmap acknowledgement, the end
//! of an access in flight) is the driver's.

use std::collections::{BTreeMap, BTreeSet, VecDeque};
use std::ops::Range;
use std::sync::Arc;
use std::time::{Duration, Instant};

use pdkv_engine::connector::{
    ConnectorRequest, ExternalMatch, FinishedTransfers, KvCacheSpec, LoadError,
};
use pdkv_engine::FinishReason;
use pdkv_transfer::{Registration, Registry};
use serde_json::Value;

use crate::config::{KvRole, KvTransferConfig, TransferMode};
use crate::params::{self, PdParams, ReadParams};
use crate::ranks::RankReg;
use crate::recv::{
    self, BootInfo, LoadEnd, LoadFailure, LoadId, LoadSpec, LocalKv, PullResult, RecvConfig,
    RecvMachine,
};
use crate::send::{self, PullSpec, SendConfig, SendMachine, ASLEEP};
use crate::wire::{Destination, FailCode, Failure, HandshakeInfo, Message, Pull, PullRank};

/// Names a control connection a peer opened to this engine (one exchange).
pub type ConnId = u64;

/// Bounds one control exchange that needs no long wait.
pub const CONTROL_IO: Duration = Duration::from_secs(5);

/// What a D-side control exchange is for, so its answer finds its way back.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Op {
    Bootstrap {
        addr: String,
    },
    Handshake {
        addr: String,
    },
    Pull {
        load: LoadId,
    },
    Drop {
        load: LoadId,
    },
    ReadDone {
        load: LoadId,
    },
    /// Best effort; the answer is only logged.
    DropUnpulled {
        transfer_id: String,
    },
}

pub use crate::ranks::Copy;

/// I/O for the driver. Results come back through the `on_*` methods.
#[derive(Clone, Debug, PartialEq)]
pub enum Io {
    /// P: send `msg` on connection `conn` (opened by a peer); `last` ends the
    /// exchange and closes it.
    Reply {
        conn: ConnId,
        msg: Message,
        last: bool,
    },
    /// P: write this engine's blocks into the pull's destination, by
    /// `deadline`: each copy from this engine's rank `local` (its
    /// registration `local[c.local]`) into D's rank `dst.ranks[c.remote]`;
    /// report with [`PdCore::on_write_done`].
    Write {
        conn: ConnId,
        local: Vec<Registration>,
        copies: Vec<Copy>,
        dst: Pull,
        deadline: Instant,
    },
    /// D: one exchange with the control listener at `addr`: send `msg`,
    /// hand every frame back to [`PdCore::on_reply`] until a final one (a
    /// pull's `PullProgress` frames are not final), bounded by `deadline`;
    /// a failure goes to [`PdCore::on_exchange_failed`].
    Send {
        op: Op,
        addr: String,
        msg: Message,
        deadline: Instant,
    },
    /// D, read mode: read the peer's blocks into this engine's, by
    /// `deadline`: each copy from P's rank `remote[c.remote]` into this
    /// engine's `local[c.local]`; report with [`PdCore::on_read_result`].
    Read {
        load: LoadId,
        local: Vec<Registration>,
        remote: Vec<Registration>,
        transfer: Destination,
        copies: Vec<Copy>,
        deadline: Instant,
    },
    /// D: stop the load's read at once (its result still comes).
    CancelRead { load: LoadId },
    /// D: make sure nothing a peer still sends lands in the load's blocks:
    /// for every rank's `(segment, grant)`, revoke the grant on that
    /// registration (TCP) and, over shared memory, have every peer unmap the
    /// segment; report with [`PdCore::on_fenced`] once every rank is fenced.
    Fence {
        load: LoadId,
        ranks: Vec<(u64, Option<u64>)>,
    },
}

/// This engine's KV cache, once registered: one registration per rank.
#[derive(Clone)]
pub struct KvInfo {
    pub ranks: Vec<RankKv>,
    /// Bytes of the whole model's block (every rank's part).
    pub block_bytes: u64,
    /// Bytes of one KV head's part of a block.
    pub head_bytes: u64,
    pub num_kv_heads: usize,
    pub block_size: usize,
    pub layout: String,
}

/// One rank's KV cache and its registration.
#[derive(Clone)]
pub struct RankKv {
    /// The current registration (gone while asleep; restore makes the next
    /// epoch).
    pub reg: Registration,
    pub region: Arc<pdkv_vmem::Region>,
    pub heads: Range<usize>,
    /// Bytes registered: every block of the rank.
    pub len: usize,
    /// Bytes of the rank's block.
    pub block_bytes: u64,
}

impl KvInfo {
    /// The generation peers read at: the first rank's epoch (every rank is
    /// registered again together).
    pub fn generation(&self) -> u64 {
        self.ranks[0].reg.epoch
    }

    pub fn regs(&self) -> Vec<Registration> {
        self.ranks.iter().map(|r| r.reg).collect()
    }

    pub fn heads(&self) -> Vec<Range<usize>> {
        self.ranks.iter().map(|r| r.heads.clone()).collect()
    }

    fn rank_regs(&self) -> Vec<RankReg> {
        self.ranks
            .iter()
            .map(|r| RankReg {
                heads: (r.heads.start, r.heads.end),
                reg: r.reg,
            })
            .collect()
    }
}

/// Transfer counters, for metrics.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Counters {
    pub pulls_ok: u64,
    /// P: pulls answered with a genuine failure.
    pub pulls_failed: u64,
    /// P: pulls ended because D (or a proxy) dropped the transfer.
    pub pulls_cancelled: u64,
    /// P: pulls refused because a lifecycle operation or a refusal ended the
    /// transfer on purpose (D recomputes).
    pub pulls_released: u64,
    pub loads_ok: u64,
    pub loads_failed: u64,
    /// D: loads a cache reset cut short.
    pub loads_cut_short: u64,
    /// D: loads whose request ended first.
    pub loads_cancelled: u64,
    /// D: loads P's lifecycle (or a refusal) ended on purpose.
    pub loads_released: u64,
    /// D: loads given up (deadline, lost connection) before their fence.
    pub loads_abandoned: u64,
    /// D: fences of loads P may still have been writing.
    pub fences: u64,
    pub drops_unpulled: u64,
    /// P: drops received (from decode engines or proxies).
    pub drops_received: u64,
    pub bytes_sent: u64,
    pub handshakes: u64,
    pub bytes_read: u64,
    pub reads_done: u64,
    pub reads_late: u64,
}

/// What a connector release found still in flight.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct InFlight {
    /// P: blocks of READY transfers D has not taken.
    pub ready_blocks: usize,
    /// P: writes reading this engine's blocks.
    pub writes: usize,
    /// D: loads that may write into this engine's blocks.
    pub loads: usize,
}

impl InFlight {
    pub fn is_idle(&self) -> bool {
        *self == InFlight::default()
    }
}

impl std::fmt::Display for InFlight {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "{} blocks held for decode engines, {} writes reading this engine's blocks, {} loads writing into them",
            self.ready_blocks, self.writes, self.loads
        )
    }
}

/// See the module docs.
pub struct PdCore {
    cfg: KvTransferConfig,
    engine_id: String,
    /// This engine's control listener (`ip:port`), for P's params.
    bootstrap_addr: String,
    /// Where peers reach this engine's KV (its TCP agent or shm socket).
    transfer_dest: Destination,
    registry: Arc<Registry>,
    kv: Option<KvInfo>,
    asleep: bool,
    weights_version: Option<String>,
    send: SendMachine,
    recv: RecvMachine,
    /// D: remote prefills noted at admission, by request.
    pending: BTreeMap<Arc<str>, (PdParams, usize)>,
    /// D: loads decided and not yet handed to the worker side.
    new_loads: Vec<Arc<str>>,
    /// D: requests whose load was decided (a later admission loads nothing).
    decided: BTreeSet<Arc<str>>,
    /// P: the destination of every pull being served.
    pulls: BTreeMap<ConnId, Pull>,
    /// D: the grant of each load's pull on every rank: `(segment, key)`.
    grants: BTreeMap<LoadId, Vec<(u64, u64)>>,
    io: VecDeque<Io>,
    sending_done: Vec<Arc<str>>,
    recving: Vec<Arc<str>>,
    abandoned: Vec<Arc<str>>,
    errors: Vec<(u32, LoadError)>,
    reported_errors: Vec<(u32, LoadError)>,
    news: bool,
    counters: Counters,
}

impl PdCore {
    pub fn new(
        cfg: KvTransferConfig,
        engine_id: &str,
        bootstrap_addr: String,
        transfer_dest: Destination,
        registry: Arc<Registry>,
    ) -> PdCore {
        let send = SendMachine::new(send_config(&cfg, pdkv_model::BLOCK_SIZE));
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
        self.counters
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
        [self.send.poll_timeout(), self.recv.poll_timeout()]
            .into_iter()
            .flatten()
            .min()
    }

    pub fn handle_timeout(&mut self, now: Instant) {
        self.send.handle_timeout(now);
        self.recv.handle_timeout(now);
        self.drive(now);
    }

    // ---- the engine's calls ----

    /// Registers every rank's KV cache (all or none: a rank that fails
    /// deregisters the ranks before it, and the error names it).
    pub fn register_kv_caches(&mut self, spec: &KvCacheSpec) -> anyhow::Result<()> {
        let heads: Vec<Range<usize>> = spec.ranks.iter().map(|r| r.heads.clone()).collect();
        crate::ranks::check_heads(&heads, spec.num_kv_heads)
            .map_err(|e| anyhow::anyhow!("the KV cache spec: {e}"))?;
        anyhow::ensure!(
            spec.block_bytes.is_multiple_of(spec.num_kv_heads),
            "the KV cache spec: blocks of {} bytes do not split into {} heads",
            spec.block_bytes,
            spec.num_kv_heads
        );
        let lens: Vec<usize> = (0..spec.ranks.len())
            .map(|i| spec.num_blocks * spec.rank_block_bytes(i))
            .collect();
        let parts: Vec<(&Arc<pdkv_vmem::Region>, usize)> =
            spec.ranks.iter().map(|r| &r.region).zip(lens).collect();
        let regs = register_ranks(&self.registry, &parts)
            .map_err(|e| anyhow::anyhow!("registering the KV cache for transfers: {e}"))?;
        let ranks: Vec<RankKv> = spec
            .ranks
            .iter()
            .zip(regs)
            .enumerate()
            .map(|(i, (r, reg))| RankKv {
                reg,
                region: r.region.clone(),
                heads: r.heads.clone(),
                len: reg.len as usize,
                block_bytes: spec.rank_block_bytes(i) as u64,
            })
            .collect();
        self.kv = Some(KvInfo {
            ranks,
            block_bytes: spec.block_bytes as u64,
            head_bytes: spec.head_bytes() as u64,
            num_kv_heads: spec.num_kv_heads,
            block_size: spec.block_size,
            layout: spec.layout.clone(),
        });
        self.send = SendMachine::new(send_config(&self.cfg, spec.block_size));
        self.send.set_weights_version(self.weights_version.clone());
        self.recv = RecvMachine::new(RecvConfig {
            load_timeout: self.cfg.load_timeout,
            block_size: spec.block_size,
        });
        self.set_local();
        Ok(())
    }

    fn set_local(&mut self) {
        if let Some(kv) = &self.kv {
            self.recv.set_local(LocalKv {
                layout: kv.layout.clone(),
                block_bytes: kv.block_bytes,
                weights_version: self.weights_version.clone(),
            });
        }
    }

    pub fn set_weights_version(&mut self, version: Option<&str>) {
        self.weights_version = version.map(str::to_string);
        self.send.set_weights_version(self.weights_version.clone());
        self.set_local();
    }

    fn block_size(&self) -> usize {
        self.kv
            .as_ref()
            .map_or(pdkv_model::BLOCK_SIZE, |k| k.block_size)
    }

    pub fn request_added(&mut self, now: Instant, req: ConnectorRequest<'_>) {
        if let Ok(Some(PdParams::RemoteDecode { transfer_id })) =
            PdParams::parse(req.kv_transfer_params)
        {
            if self.cfg.kv_role.produces() {
                self.send.on_request_running(&transfer_id, req.id);
                self.drive(now);
            }
        }
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

    pub fn update_state_after_alloc(
        &mut self,
        req: ConnectorRequest<'_>,
        block_ids: &[u32],
        num_computed_tokens: usize,
        num_external_tokens: usize,
    ) {
        let Some((params, prompt_len)) = self.pending.remove(req.id) else {
            return;
        };
        if num_external_tokens == 0 {
            return;
        }
        let PdParams::RemotePrefill {
            transfer_id,
            remote_engine_id,
            remote_bootstrap_addr,
            read,
        } = params
        else {
            return;
        };
        let bs = self.block_size();
        let first = num_computed_tokens / bs;
        let last = (num_computed_tokens + num_external_tokens)
            .div_ceil(bs)
            .min(block_ids.len());
        let spec = LoadSpec {
            req: req.id.clone(),
            transfer_id,
            remote_engine_id,
            addr: remote_bootstrap_addr,
            prompt_len,
            first_block: first,
            dst_blocks: block_ids.get(first..last).unwrap_or(&[]).to_vec(),
            read,
        };
        self.decided.insert(req.id.clone());
        self.recv.decide(spec);
        self.new_loads.push(req.id.clone());
    }

    /// The loads decided since the last call (the engine's step metadata).
    pub fn take_new_loads(&mut self) -> Vec<Arc<str>> {
        std::mem::take(&mut self.new_loads)
    }

    pub fn start_load_kv(&mut self, now: Instant, reqs: Vec<Arc<str>>) {
        for req in reqs {
            // Nothing may write into a released region: fail at once.
            let refused = self.asleep.then(|| {
                Failure::new(
                    FailCode::Asleep,
                    "the decode engine's KV cache is released (asleep); the load was not started",
                )
            });
            self.recv.start(now, &req, refused);
        }
        self.drive(now);
    }

    pub fn request_finished(
        &mut self,
        now: Instant,
        req: ConnectorRequest<'_>,
        block_ids: &[u32],
        reason: FinishReason,
    ) -> (bool, Option<Value>) {
        self.pending.remove(req.id);
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

    /// P's request ended: its blocks are held for D (READY) unless the send
    /// ended; the params tell D where to load from.
    fn prefill_finished(
        &mut self,
        now: Instant,
        transfer_id: &str,
        req: ConnectorRequest<'_>,
        block_ids: &[u32],
        reason: FinishReason,
    ) -> (bool, Option<Value>) {
        let completed = matches!(reason, FinishReason::Stop | FinishReason::Length);
        let prompt_len = req.prompt_tokens.len();
        let held = self.send.on_request_finished(
            now,
            transfer_id,
            req.id,
            block_ids,
            prompt_len,
            completed,
        );
        if !completed {
            return (held, None);
        }
        let read = match self.cfg.transfer_mode {
            TransferMode::Write => None,
            TransferMode::Read => match self.read_params(held, block_ids, prompt_len) {
                Some(r) => Some(r),
                // Not leased: no params, so D computes the prompt itself.
                None => return (held, None),
            },
        };
        let p = params::returned_by_prefill(
            transfer_id,
            &self.engine_id,
            &self.bootstrap_addr,
            prompt_len,
            self.kv.as_ref().map_or(1, |k| k.ranks.len()),
            read.as_ref(),
        );
        (held, Some(p))
    }

    /// Read mode: the leased blocks, P's registration epoch and weights for
    /// a finished request's params (no blocks for a one-token prompt).
    /// `None` when the blocks are not leased (the send ended).
    fn read_params(&self, held: bool, block_ids: &[u32], prompt_len: usize) -> Option<ReadParams> {
        let needed = prompt_len.saturating_sub(1).div_ceil(self.block_size());
        if needed > 0 && (!held || block_ids.len() < needed) {
            return None;
        }
        let generation = self.kv.as_ref().map(|k| k.generation())?;
        Some(ReadParams {
            block_ids: block_ids[..needed].to_vec(),
            generation,
            weights_version: self.weights_version.clone(),
        })
    }

    /// P: stops holding KV for D; D: cuts every load short (the engine
    /// holds their blocks and recomputes the requests).
    pub fn abort_transfers(&mut self, now: Instant) {
        self.send.abort_all(now);
        self.recv.abort_all(now);
        self.new_loads.clear();
        self.drive(now);
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

    /// Decides whether the KV cache registrations can be released now:
    /// nothing in flight. Then P refuses pulls and D loads at once
    /// (`asleep`), READY transfers end with [`FailCode::Asleep`], and every
    /// rank's registration to deregister is returned (the driver
    /// deregisters them, over shared memory after the peers'
    /// acknowledgements). `Ok(None)`: not registered, or released already.
    /// `Err`: what was in flight; nothing changed.
    pub fn begin_release(&mut self, now: Instant) -> Result<Option<Vec<Registration>>, InFlight> {
        let Some(kv) = &self.kv else { return Ok(None) };
        if self.asleep {
            return Ok(None);
        }
        let busy = self.in_flight();
        if !busy.is_idle() {
            return Err(busy);
        }
        let regs = kv.regs();
        self.asleep = true;
        self.send
            .end_ready(now, Failure::new(FailCode::Asleep, ASLEEP));
        self.drive(now);
        Ok(Some(regs))
    }

    /// Registers every rank's KV cache again (the same segments, a new
    /// epoch and key each) and serves again — all ranks or none: when one
    /// rank's registration fails, the ranks registered before it are
    /// deregistered again, the connector stays released, and the error
    /// names the rank (a retry starts over). Idempotent. Also undoes a
    /// release whose deregistration failed.
    pub fn restore(&mut self) -> anyhow::Result<()> {
        let Some(k) = self.kv.as_mut() else {
            return Ok(());
        };
        if !self.asleep {
            return Ok(());
        }
        let parts: Vec<(&Arc<pdkv_vmem::Region>, usize)> =
            k.ranks.iter().map(|r| (&r.region, r.len)).collect();
        let regs = register_ranks(&self.registry, &parts).map_err(|e| {
            anyhow::anyhow!(
                "registering the KV cache again: {e}; the KV cache stays released and a retry registers every rank"
            )
        })?;
        for (r, reg) in k.ranks.iter_mut().zip(regs) {
            tracing::info!(
                segment = reg.segment,
                epoch = reg.epoch,
                heads = ?r.heads,
                "KV cache registered again"
            );
            r.reg = reg;
        }
        self.asleep = false;
        Ok(())
    }

    // ---- the driver's events ----

    /// A peer's control message on connection `conn` (P side, and the
    /// bootstrap/handshake every engine answers).
    pub fn on_control(&mut self, now: Instant, conn: ConnId, msg: Message) {
        let reply = match msg {
            Message::Bootstrap => Some(self.bootstrap_answer()),
            Message::Handshake => Some(self.handshake_answer()),
            Message::ReadDone { transfer_id } if self.cfg.kv_role.produces() => {
                Some(self.read_done(now, &transfer_id))
            }
            Message::Pull(p) if self.cfg.kv_role.produces() => self.pull(now, conn, p),
            Message::Drop { transfer_id, code } if self.cfg.kv_role.produces() => {
                self.counters.drops_received += 1;
                self.send.on_drop(now, &transfer_id, conn, code);
                None
            }
            Message::Pull(_) | Message::Drop { .. } | Message::ReadDone { .. } => {
                Some(Message::Error {
                    reason: format!(
                        "engine {} is a {} and sends no KV",
                        self.engine_id,
                        self.cfg.kv_role.as_str()
                    ),
                })
            }
            other => Some(Message::Error {
                reason: format!("unexpected message {other:?}"),
            }),
        };
        if let Some(msg) = reply {
            self.io.push_back(Io::Reply {
                conn,
                msg,
                last: true,
            });
        }
        self.drive(now);
    }

    fn not_registered(&self) -> Message {
        Message::Error {
            reason: format!(
                "engine {} has not registered its KV cache yet",
                self.engine_id
            ),
        }
    }

    fn bootstrap_answer(&self) -> Message {
        match &self.kv {
            Some(kv) => Message::BootstrapOk {
                engine_id: self.engine_id.clone(),
                layout: kv.layout.clone(),
                block_bytes: kv.block_bytes,
            },
            None => self.not_registered(),
        }
    }

    /// The answer names P's live registration, or none while P is asleep.
    fn handshake_answer(&self) -> Message {
        match &self.kv {
            Some(kv) => Message::HandshakeOk(HandshakeInfo {
                engine_id: self.engine_id.clone(),
                layout: kv.layout.clone(),
                block_bytes: kv.block_bytes,
                transfer: self.transfer_dest.clone(),
                ranks: (!self.asleep).then(|| kv.rank_regs()),
            }),
            None => self.not_registered(),
        }
    }

    fn read_done(&mut self, now: Instant, transfer_id: &str) -> Message {
        match self.send.on_read_done(now, transfer_id) {
            Ok(()) => {
                self.counters.reads_done += 1;
                Message::ReadDoneOk
            }
            Err(f) => {
                self.counters.reads_late += 1;
                Message::ReadDoneErr {
                    code: f.code,
                    reason: f.message,
                }
            }
        }
    }

    /// P: a pull arrives; answered at once while asleep.
    fn pull(&mut self, now: Instant, conn: ConnId, p: Pull) -> Option<Message> {
        if self.asleep {
            self.counters.pulls_released += 1;
            // D recomputes the prompt: P keeps nothing for this transfer.
            self.send
                .end_transfer(now, &p.transfer_id, Failure::new(FailCode::Asleep, ASLEEP));
            return Some(Message::PullErr {
                code: FailCode::Asleep,
                reason: ASLEEP.into(),
            });
        }
        if let Some(reason) = self.bad_destination(&p) {
            self.counters.pulls_failed += 1;
            return Some(Message::PullErr {
                code: FailCode::Mismatch,
                reason,
            });
        }
        let spec = PullSpec {
            transfer_id: p.transfer_id.clone(),
            first_block: p.first_block,
            num_tokens: p.num_tokens,
            num_blocks: p.blocks.len(),
            weights_version: p.weights_version.clone(),
        };
        self.pulls.insert(conn, p);
        self.send.on_pull(now, conn, spec);
        None
    }

    /// P: what is wrong with a pull's destination ranks, if anything: they
    /// must hold this model's heads in order, and each rank's registration
    /// must be long enough for the blocks named (D's registry checks every
    /// access again; this refuses a pull P could not even cut into copies).
    fn bad_destination(&self, p: &Pull) -> Option<String> {
        let kv = self.kv.as_ref()?;
        let heads: Vec<Range<usize>> = p.ranks.iter().map(|r| r.rank.heads()).collect();
        if let Err(e) = crate::ranks::check_heads(&heads, kv.num_kv_heads) {
            return Some(format!("the pull's destination ranks: {e}"));
        }
        let top = p.blocks.iter().max().map_or(0, |&b| b as u64 + 1);
        for (i, r) in p.ranks.iter().enumerate() {
            let need = top.checked_mul(r.rank.heads().len() as u64 * kv.head_bytes);
            if need.is_none_or(|n| n > r.rank.reg.len) {
                return Some(format!(
                    "the pull's destination rank {i} registers {} bytes, too few for block {}",
                    r.rank.reg.len,
                    top.saturating_sub(1)
                ));
            }
        }
        None
    }

    /// P: a write ended.
    pub fn on_write_done(
        &mut self,
        now: Instant,
        conn: ConnId,
        result: Result<(), Failure>,
        bytes: u64,
    ) {
        if result.is_ok() {
            self.counters.bytes_sent += bytes;
        }
        self.send.on_write_done(now, conn, result);
        self.drive(now);
    }

    /// D: a frame answering an exchange.
    pub fn on_reply(&mut self, now: Instant, op: Op, msg: Message) {
        match op {
            Op::Bootstrap { addr } => {
                let answer = match msg {
                    Message::BootstrapOk {
                        engine_id,
                        layout,
                        block_bytes,
                    } => Ok(BootInfo {
                        engine_id,
                        layout,
                        block_bytes,
                    }),
                    Message::Error { reason } => Err(Failure::new(
                        FailCode::Protocol,
                        format!("bootstrap with {addr} refused: {reason}"),
                    )),
                    other => Err(Failure::new(
                        FailCode::Protocol,
                        format!("bootstrap with {addr}: unexpected answer {other:?}"),
                    )),
                };
                self.recv.on_bootstrap(now, &addr, answer);
            }
            Op::Handshake { addr } => {
                let answer = match msg {
                    Message::HandshakeOk(h) => {
                        self.counters.handshakes += 1;
                        Ok(h)
                    }
                    Message::Error { reason } => Err(Failure::new(
                        FailCode::Protocol,
                        format!("handshake with {addr} refused: {reason}"),
                    )),
                    other => Err(Failure::new(
                        FailCode::Protocol,
                        format!("handshake with {addr}: unexpected answer {other:?}"),
                    )),
                };
                self.recv.on_handshake(now, &addr, answer);
            }
            Op::Pull { load } => match msg {
                Message::PullProgress => self.recv.on_progress(now, load),
                Message::PullOk => {
                    self.recv
                        .on_pull_result(now, load, PullResult::Answered(Ok(())))
                }
                Message::PullErr { code, reason } => {
                    let f = Failure::new(
                        code,
                        format!("the prefill engine refused the pull: {reason}"),
                    );
                    self.recv
                        .on_pull_result(now, load, PullResult::Answered(Err(f)));
                }
                other => {
                    // Not an answer P sends: it may still be writing.
                    let f = Failure::new(
                        FailCode::Protocol,
                        format!("pull: unexpected answer {other:?}"),
                    );
                    self.recv.on_pull_result(now, load, PullResult::Lost(f));
                }
            },
            Op::Drop { load } => {
                let answer = match msg {
                    Message::DropOk { known } => Ok(known),
                    other => Err(Failure::new(
                        FailCode::Protocol,
                        format!("drop answered with {other:?}"),
                    )),
                };
                self.recv.on_drop_answer(now, load, answer);
            }
            Op::ReadDone { load } => {
                let answer = match msg {
                    Message::ReadDoneOk => Ok(()),
                    Message::ReadDoneErr { code, reason } => Err(Failure::new(code, reason)),
                    other => Err(Failure::new(
                        FailCode::Protocol,
                        format!("read_done: unexpected answer {other:?}"),
                    )),
                };
                if answer.is_ok() {
                    if let Some(spec) = self.recv.spec(load) {
                        self.counters.bytes_read += spec.dst_blocks.len() as u64
                            * self.kv.as_ref().map_or(0, |k| k.block_bytes);
                    }
                }
                self.recv.on_read_done_answer(now, load, answer);
            }
            Op::DropUnpulled { transfer_id } => {
                tracing::debug!(%transfer_id, answer = ?msg, "dropped a transfer this engine does not pull")
            }
        }
        self.drive(now);
    }

    /// D: an exchange failed. `sent`: the message may have reached the peer.
    pub fn on_exchange_failed(&mut self, now: Instant, op: Op, failure: Failure, sent: bool) {
        match op {
            Op::Bootstrap { addr } => self.recv.on_bootstrap(now, &addr, Err(failure)),
            Op::Handshake { addr } => self.recv.on_handshake(now, &addr, Err(failure)),
            Op::Pull { load } => {
                let r = if sent {
                    PullResult::Lost(failure)
                } else {
                    PullResult::NotSent(failure)
                };
                self.recv.on_pull_result(now, load, r);
            }
            Op::Drop { load } => self.recv.on_drop_answer(now, load, Err(failure)),
            Op::ReadDone { load } => {
                let f = Failure::new(
                    failure.code,
                    format!(
                        "read_done failed, the read is unconfirmed: {}",
                        failure.message
                    ),
                );
                self.recv.on_read_done_answer(now, load, Err(f));
            }
            Op::DropUnpulled { transfer_id } => {
                tracing::warn!(%transfer_id, "drop failed: {failure}")
            }
        }
        self.drive(now);
    }

    /// D, read mode: the load's read ended.
    pub fn on_read_result(&mut self, now: Instant, load: LoadId, result: Result<(), Failure>) {
        self.recv.on_read_result(now, load, result);
        self.drive(now);
    }

    /// D: the load's local fence ended.
    pub fn on_fenced(&mut self, now: Instant, load: LoadId, result: Result<(), Failure>) {
        if let Err(f) = &result {
            tracing::warn!(load, "fence failed, will try again: {f}");
        }
        self.recv.on_fenced(now, load, result);
        self.drive(now);
    }

    fn drop_unpulled(&mut self, now: Instant, addr: String, transfer_id: String) {
        self.counters.drops_unpulled += 1;
        let msg = Message::Drop {
            transfer_id: transfer_id.clone(),
            code: FailCode::Dropped,
        };
        self.io.push_back(Io::Send {
            op: Op::DropUnpulled { transfer_id },
            addr,
            msg,
            deadline: now + CONTROL_IO,
        });
    }

    // ---- turning machine actions into I/O ----

    /// Carries out what the machines decided, and collects their reports.
    fn drive(&mut self, now: Instant) {
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

    fn send_action(&mut self, _now: Instant, a: send::Action) {
        match a {
            send::Action::Answer { pull, result } => {
                self.pulls.remove(&pull);
                let c = &mut self.counters;
                let msg = match result {
                    Ok(()) => {
                        c.pulls_ok += 1;
                        Message::PullOk
                    }
                    Err(f) => {
                        match f.code {
                            FailCode::Dropped => c.pulls_cancelled += 1,
                            code if code.on_purpose() => c.pulls_released += 1,
                            _ => c.pulls_failed += 1,
                        }
                        Message::PullErr {
                            code: f.code,
                            reason: f.message,
                        }
                    }
                };
                self.io.push_back(Io::Reply {
                    conn: pull,
                    msg,
                    last: true,
                });
            }
            send::Action::Progress { pull } => self.io.push_back(Io::Reply {
                conn: pull,
                msg: Message::PullProgress,
                last: false,
            }),
            send::Action::DropAnswer { drop, known } => self.io.push_back(Io::Reply {
                conn: drop,
                msg: Message::DropOk { known },
                last: true,
            }),
            send::Action::StartWrite {
                pull,
                src_blocks,
                deadline,
            } => {
                let (Some(dst), Some(kv)) = (self.pulls.get(&pull).cloned(), self.kv.as_ref())
                else {
                    self.send.on_write_done(
                        deadline,
                        pull,
                        Err(crate::wire::write_failure(
                            false,
                            "the pull's destination is gone",
                        )),
                    );
                    return;
                };
                let pairs: Vec<(u32, u32)> = src_blocks
                    .iter()
                    .copied()
                    .zip(dst.blocks.iter().copied())
                    .collect();
                let remote: Vec<Range<usize>> = dst.ranks.iter().map(|r| r.rank.heads()).collect();
                let copies = crate::ranks::copies(&kv.heads(), &remote, kv.head_bytes, &pairs);
                self.io.push_back(Io::Write {
                    conn: pull,
                    local: kv.regs(),
                    copies,
                    dst,
                    deadline,
                });
            }
        }
    }

    fn recv_action(&mut self, now: Instant, a: recv::Action) {
        match a {
            recv::Action::Bootstrap { addr } => {
                let op = Op::Bootstrap { addr: addr.clone() };
                self.io.push_back(Io::Send {
                    op,
                    addr,
                    msg: Message::Bootstrap,
                    deadline: now + CONTROL_IO,
                });
            }
            recv::Action::Handshake { addr } => {
                let op = Op::Handshake { addr: addr.clone() };
                self.io.push_back(Io::Send {
                    op,
                    addr,
                    msg: Message::Handshake,
                    deadline: now + CONTROL_IO,
                });
            }
            recv::Action::Pull {
                load,
                spec,
                weights_version,
            } => self.send_pull(now, load, spec, weights_version),
            recv::Action::Read {
                load,
                spec,
                peer,
                generation,
                deadline,
            } => self.start_read(now, load, spec, peer, generation, deadline),
            recv::Action::ReadDone {
                load,
                addr,
                transfer_id,
            } => {
                let msg = Message::ReadDone { transfer_id };
                self.io.push_back(Io::Send {
                    op: Op::ReadDone { load },
                    addr,
                    msg,
                    deadline: now + CONTROL_IO,
                });
            }
            recv::Action::CancelRead { load } => self.io.push_back(Io::CancelRead { load }),
            recv::Action::Drop {
                load,
                addr,
                transfer_id,
            } => {
                let msg = Message::Drop {
                    transfer_id,
                    code: FailCode::Dropped,
                };
                // P answers a drop once no write reads the blocks: as long as
                // a write may take.
                let wait = self.cfg.abort_timeout + CONTROL_IO;
                self.io.push_back(Io::Send {
                    op: Op::Drop { load },
                    addr,
                    msg,
                    deadline: now + wait,
                });
            }
            recv::Action::Fence { load } => {
                self.counters.fences += 1;
                // Every rank's segment; its grant where the pull made one.
                let grants = self.grants.get(&load);
                let ranks = self.kv.as_ref().map_or(Vec::new(), |k| {
                    k.ranks
                        .iter()
                        .map(|r| {
                            let seg = r.reg.segment;
                            let key = grants
                                .and_then(|g| g.iter().find(|(s, _)| *s == seg))
                                .map(|&(_, key)| key);
                            (seg, key)
                        })
                        .collect()
                });
                self.io.push_back(Io::Fence { load, ranks });
            }
            recv::Action::DropUnpulled { addr, transfer_id } => {
                self.drop_unpulled(now, addr, transfer_id)
            }
            recv::Action::Forget { load } => {
                // Nothing uses them any more (the load is fenced or ended).
                for (segment, key) in self.grants.remove(&load).unwrap_or_default() {
                    let _ = self.registry.revoke(segment, key, Duration::ZERO);
                }
            }
        }
    }

    /// D: the pull for a load, with a grant that opens exactly its blocks.
    fn send_pull(
        &mut self,
        now: Instant,
        load: LoadId,
        spec: LoadSpec,
        weights_version: Option<String>,
    ) {
        let Some(kv) = self.kv.clone() else {
            let f = Failure::new(FailCode::Protocol, "the KV cache is not registered");
            self.recv.on_pull_result(now, load, PullResult::NotSent(f));
            return;
        };
        let mut ranks = Vec::with_capacity(kv.ranks.len());
        let mut grants = Vec::with_capacity(kv.ranks.len());
        for (i, r) in kv.ranks.iter().enumerate() {
            let ranges = crate::ranks::block_ranges(&spec.dst_blocks, r.block_bytes);
            match self.registry.grant(&r.reg, &ranges) {
                Ok(g) => grants.push((r.reg.segment, g.key)),
                Err(e) => {
                    for (segment, key) in grants {
                        let _ = self.registry.revoke(segment, key, Duration::ZERO);
                    }
                    let f = Failure::new(
                        FailCode::Protocol,
                        format!("granting the load's blocks of rank {i} failed: {e}"),
                    );
                    self.recv.on_pull_result(now, load, PullResult::NotSent(f));
                    return;
                }
            }
            ranks.push(PullRank {
                rank: RankReg {
                    heads: (r.heads.start, r.heads.end),
                    reg: r.reg,
                },
                grant_key: grants.last().map(|g| g.1),
            });
        }
        self.grants.insert(load, grants);
        let pull = Pull {
            transfer_id: spec.transfer_id.clone(),
            engine_id: self.engine_id.clone(),
            first_block: spec.first_block,
            num_tokens: spec.prompt_len - 1,
            dst: self.transfer_dest.clone(),
            ranks,
            blocks: spec.dst_blocks.clone(),
            weights_version,
        };
        // The machine's deadline bounds the load; the exchange itself may
        // last as long as P heartbeats.
        let deadline = now + self.cfg.prefill_timeout + self.cfg.load_timeout;
        self.io.push_back(Io::Send {
            op: Op::Pull { load },
            addr: spec.addr,
            msg: Message::Pull(pull),
            deadline,
        });
    }

    /// D, read mode: reads P's blocks `read.block_ids[first..]` at the
    /// params' generation (a registration that moved on refuses it).
    fn start_read(
        &mut self,
        now: Instant,
        load: LoadId,
        spec: LoadSpec,
        peer: HandshakeInfo,
        generation: u64,
        deadline: Instant,
    ) {
        let (Some(kv), Some(rp), Some(remote)) =
            (self.kv.clone(), spec.read.clone(), peer.ranks.clone())
        else {
            let f = Failure::new(FailCode::Protocol, "read mode without a registration");
            self.recv.on_read_result(now, load, Err(f));
            return;
        };
        let heads: Vec<Range<usize>> = remote.iter().map(|r| r.heads()).collect();
        if let Err(e) = crate::ranks::check_heads(&heads, kv.num_kv_heads) {
            let f = Failure::new(
                FailCode::Mismatch,
                format!("the prefill engine's KV ranks: {e}"),
            );
            self.recv.on_read_result(now, load, Err(f));
            return;
        }
        let src = &rp.block_ids[spec.first_block..spec.first_block + spec.dst_blocks.len()];
        let pairs: Vec<(u32, u32)> = spec
            .dst_blocks
            .iter()
            .copied()
            .zip(src.iter().copied())
            .collect();
        let copies = crate::ranks::copies(&kv.heads(), &heads, kv.head_bytes, &pairs);
        // The handshake's registrations are those of the generation the
        // params name (the machine checked the first rank's epoch against
        // it, and every rank is registered again together); a registration
        // that moved on since refuses the read.
        debug_assert_eq!(remote.first().map(|r| r.reg.epoch), Some(generation));
        let remote = remote.iter().map(|r| r.reg).collect();
        self.io.push_back(Io::Read {
            load,
            local: kv.regs(),
            remote,
            transfer: peer.transfer,
            copies,
            deadline,
        });
    }

    /// A load ended and nothing writes its blocks: reported in `recving`,
    /// with its blocks as load errors when it failed.
    fn load_finished(&mut self, f: recv::Finished) {
        let c = &mut self.counters;
        match &f.end {
            LoadEnd::Loaded => c.loads_ok += 1,
            LoadEnd::Gone => c.loads_cancelled += 1,
            LoadEnd::Failed(lf) if lf.failure.message == recv::CUT_SHORT => c.loads_cut_short += 1,
            LoadEnd::Failed(lf) if lf.recompute => c.loads_released += 1,
            LoadEnd::Failed(_) => c.loads_failed += 1,
        }
        if let LoadEnd::Failed(lf) = &f.end {
            if lf.failure.message != recv::CUT_SHORT {
                tracing::warn!(request = %f.req, "KV load failed: {}", lf.failure);
            }
            let e = load_error(lf);
            self.errors
                .extend(f.dst_blocks.iter().map(|&b| (b, e.clone())));
        }
        self.recving.push(f.req);
        self.news = true;
    }
}

/// Registers every rank's `(region, len)` in order, all or none: when rank
/// `i` fails, ranks `0..i` are deregistered again, and the error names the
/// rank, its length and what was undone.
fn register_ranks(
    registry: &Registry,
    ranks: &[(&Arc<pdkv_vmem::Region>, usize)],
) -> Result<Vec<Registration>, String> {
    let mut regs = Vec::with_capacity(ranks.len());
    for (i, &(region, len)) in ranks.iter().enumerate() {
        match registry.register(region, 0, len) {
            Ok(reg) => regs.push(reg),
            Err(e) => {
                for reg in &regs {
                    registry.deregister(reg.segment);
                }
                let undo = match i {
                    0 => String::new(),
                    1 => "; rank 0 was deregistered again".to_string(),
                    _ => format!("; ranks 0..{i} were deregistered again"),
                };
                return Err(format!("rank {i} ({len} bytes): {e}{undo}"));
            }
        }
    }
    Ok(regs)
}

fn load_error(lf: &LoadFailure) -> LoadError {
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
pub fn validate(role: KvRole, params: Option<&Value>) -> Result<(), String> {
    match PdParams::parse(params)? {
        Some(PdParams::RemoteDecode { .. }) if !role.produces() => Err(format!(
            "kv_transfer_params.do_remote_decode: this engine is a {} and sends no KV",
            role.as_str()
        )),
        Some(PdParams::RemotePrefill { .. }) if !role.consumes() => Err(format!(
            "kv_transfer_params.do_remote_prefill: this engine is a {} and receives no KV",
            role.as_str()
        )),
        _ => Ok(()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use pdkv_transfer::RegistryOptions;
    use pdkv_vmem::{Pool, PoolOptions, Tag};

    const BS: usize = pdkv_model::BLOCK_SIZE;
    const BLOCKS: usize = 8;

    /// A core of `role` with a registered KV cache of real memory.
    fn core(role: &str) -> (PdCore, Pool) {
        core_in(role, "write")
    }

    fn core_in(role: &str, mode: &str) -> (PdCore, Pool) {
        let cfg = KvTransferConfig::parse(&format!(
            r#"{{"kv_connector":"pdkv","kv_role":"{role}","transfer_mode":"{mode}"}}"#
        ))
        .unwrap();
        let pool = Pool::new(PoolOptions {
            chunk_size: 4096,
            single_allocation: false,
        });
        let region = pool.allocate(Tag::KvCache, BLOCKS * 4096).unwrap();
        let registry = Arc::new(Registry::new(RegistryOptions::default()));
        let dest = Destination::Tcp {
            addr: "127.0.0.1:10".into(),
        };
        let mut c = PdCore::new(cfg, "e0", "127.0.0.1:9".into(), dest, registry);
        let spec = KvCacheSpec::single(region, BLOCKS, 4096, BS, "l");
        c.register_kv_caches(&spec).unwrap();
        (c, pool)
    }

    fn prompt() -> Vec<u32> {
        (0..3 * BS as u32 + 1).collect()
    }

    /// D decides and starts the load of request "r1" (transfer "t1", the
    /// whole prompt's KV into blocks 1, 2, 3); returns the request id.
    fn start_load(c: &mut PdCore, now: Instant) -> Arc<str> {
        let id: Arc<str> = Arc::from("r1");
        let toks = prompt();
        let params = params::for_decode("t1", Some("p0"), Some("127.0.0.1:20"));
        let req = || ConnectorRequest {
            id: &id,
            prompt_tokens: &toks,
            kv_transfer_params: Some(&params),
        };
        c.get_num_new_matched_tokens(now, req(), 0);
        c.update_state_after_alloc(req(), &[1, 2, 3], 0, 3 * BS);
        let loads = c.take_new_loads();
        c.start_load_kv(now, loads);
        id
    }

    #[test]
    fn d_loads_only_the_blocks_past_its_local_prefix_and_a_release_waits_for_the_load() {
        let t0 = Instant::now();
        let (mut c, _pool) = core("kv_both");
        let id: Arc<str> = Arc::from("r1");
        let toks = prompt();
        let params = params::for_decode("t1", Some("p0"), Some("127.0.0.1:20"));
        let req = || ConnectorRequest {
            id: &id,
            prompt_tokens: &toks,
            kv_transfer_params: Some(&params),
        };
        // One block is in D's prefix cache: P's KV of the other two comes.
        let m = c.get_num_new_matched_tokens(t0, req(), BS);
        assert_eq!(
            m,
            ExternalMatch {
                num_tokens: 2 * BS,
                load_async: true
            }
        );
        c.update_state_after_alloc(req(), &[4, 5, 6, 7], BS, 2 * BS);
        assert_eq!(c.take_new_loads(), vec![id.clone()]);
        let load = c.recv_machine().load_of("r1").expect("decided");
        let spec = c.recv_machine().spec(load).unwrap();
        assert_eq!((spec.first_block, &spec.dst_blocks[..]), (1, &[5, 6][..]));
        assert_eq!(c.num_held_blocks(), 2);
        // Asked again in a later step: decided already.
        assert_eq!(
            c.get_num_new_matched_tokens(t0, req(), BS),
            ExternalMatch::default()
        );
        // A started load may write into the blocks: no release meanwhile.
        c.start_load_kv(t0, vec![id.clone()]);
        let busy = c.begin_release(t0).unwrap_err();
        assert_eq!(
            busy,
            InFlight {
                ready_blocks: 0,
                writes: 0,
                loads: 1
            }
        );
        assert!(!busy.is_idle());
        assert!(
            busy.to_string().contains("1 loads writing into them"),
            "{busy}"
        );
        assert!(!c.is_asleep());
        // Cut short before its pull left: nothing can write, it ends at once.
        c.abort_transfers(t0);
        assert_eq!(c.in_flight(), InFlight::default());
        assert!(c.begin_release(t0).unwrap().is_some());
    }

    #[test]
    fn a_release_marks_the_core_asleep_until_it_is_restored() {
        let t0 = Instant::now();
        let (mut c, _pool) = core("kv_both");
        assert!(c.in_flight().is_idle() && !c.is_asleep());
        let reg = c.begin_release(t0).unwrap().expect("registered");
        assert_eq!(reg, c.kv().unwrap().regs());
        assert!(c.is_asleep());
        assert_eq!(c.begin_release(t0).unwrap(), None, "released already");
        // A load started while asleep ends at once: nothing may write.
        let id = start_load(&mut c, t0);
        let f = c.get_finished();
        assert_eq!(f.recving, vec![id.clone()]);
        c.restore().unwrap();
        assert!(!c.is_asleep());
        assert_ne!(c.kv().unwrap().generation(), reg[0].epoch, "a new epoch");
    }

    fn drops_unpulled(c: &mut PdCore) -> Vec<String> {
        std::iter::from_fn(|| c.poll_io())
            .filter_map(|io| match io {
                Io::Send {
                    op: Op::DropUnpulled { transfer_id },
                    ..
                } => Some(transfer_id),
                _ => None,
            })
            .collect()
    }

    #[test]
    fn a_request_that_ends_before_its_load_is_decided_or_started_tells_p_and_holds_nothing() {
        let t0 = Instant::now();
        let toks = prompt();
        let (mut d, _pool) = core("kv_consumer");
        let (r1, r2, r3): (Arc<str>, Arc<str>, Arc<str>) =
            (Arc::from("r1"), Arc::from("r2"), Arc::from("r3"));
        let pa = params::for_decode("t1", Some("p0"), Some("127.0.0.1:20"));
        let pb = params::for_decode("t2", Some("p0"), Some("127.0.0.1:20"));
        let pc = params::for_decode("t3", Some("p0"), Some("127.0.0.1:20"));
        let req = |id, params| ConnectorRequest {
            id,
            prompt_tokens: &toks,
            kv_transfer_params: Some(params),
        };
        // r1 ends before D decided its load: P is told to drop t1 now.
        d.get_num_new_matched_tokens(t0, req(&r1, &pa), 0);
        assert_eq!(
            d.request_finished(t0, req(&r1, &pa), &[], FinishReason::Abort),
            (false, None)
        );
        assert_eq!(drops_unpulled(&mut d), vec!["t1".to_string()]);
        // r2 and r3 decided; r2 ends before the step started its load.
        for (id, params, blocks) in [(&r2, &pb, [1, 2, 3]), (&r3, &pc, [4, 5, 6])] {
            d.get_num_new_matched_tokens(t0, req(id, params), 0);
            d.update_state_after_alloc(req(id, params), &blocks, 0, 3 * BS);
        }
        let (freed, _) = d.request_finished(t0, req(&r2, &pb), &[1, 2, 3], FinishReason::Abort);
        assert!(!freed, "a load never started holds nothing");
        assert_eq!(d.take_new_loads(), vec![r3.clone()]);
        assert_eq!(drops_unpulled(&mut d), vec!["t2".to_string()]);
        assert_eq!(d.recv_machine().load_of("r2"), None);
        // A producer's request with decode params is not D's: nothing to drop.
        let (mut p, _pool2) = core("kv_producer");
        p.get_num_new_matched_tokens(t0, req(&r1, &pa), 0);
        assert_eq!(
            p.request_finished(t0, req(&r1, &pa), &[], FinishReason::Abort),
            (false, None)
        );
        assert_eq!(drops_unpulled(&mut p), Vec::<String>::new());
        // A consumer's request with prefill params holds nothing for D.
        let pp = params::for_prefill("t9");
        assert_eq!(
            d.request_finished(t0, req(&r1, &pp), &[7, 8], FinishReason::Stop),
            (false, None)
        );
        assert_eq!(d.send_machine().phase("t9"), None);
    }

    #[test]
    fn read_mode_p_returns_the_leased_blocks_and_its_generation_or_no_params() {
        let t0 = Instant::now();
        let (mut p, _pool) = core_in("kv_producer", "read");
        let epoch = p.kv().unwrap().generation();
        let finish = |p: &mut PdCore, tid: &str, toks: &[u32], blocks: &[u32], reason| {
            let id: Arc<str> = Arc::from(format!("r-{tid}"));
            let params = params::for_prefill(tid);
            let req = || ConnectorRequest {
                id: &id,
                prompt_tokens: toks,
                kv_transfer_params: Some(&params),
            };
            p.request_added(t0, req());
            p.request_finished(t0, req(), blocks, reason)
        };
        let toks = prompt(); // 3 blocks of KV
        let (held, out) = finish(&mut p, "t1", &toks, &[4, 5, 6], FinishReason::Stop);
        let out = out.expect("params for D");
        assert!(held);
        assert_eq!(out[params::REMOTE_BLOCK_IDS], serde_json::json!([4, 5, 6]));
        assert_eq!(
            out[params::REMOTE_REGISTRATION_GENERATION],
            serde_json::json!(epoch)
        );
        assert_eq!(out[params::TRANSFER_ID], serde_json::json!("t1"));
        // Fewer blocks than the KV needs: nothing to lease, D computes.
        assert_eq!(
            finish(&mut p, "t2", &toks, &[7, 8], FinishReason::Length).1,
            None
        );
        // An aborted prefill holds nothing for D.
        assert_eq!(
            finish(&mut p, "t3", &toks, &[1, 2, 3], FinishReason::Abort).1,
            None
        );
        // A one-token prompt has no KV to read: params without blocks.
        let (_, out) = finish(&mut p, "t4", &[7], &[], FinishReason::Stop);
        assert_eq!(
            out.expect("params")[params::REMOTE_BLOCK_IDS],
            serde_json::json!([])
        );
    }

    fn replies(c: &mut PdCore) -> Vec<Message> {
        std::iter::from_fn(|| c.poll_io())
            .filter_map(|io| match io {
                Io::Reply { msg, .. } => Some(msg),
                _ => None,
            })
            .collect()
    }

    #[test]
    fn control_messages_are_answered_by_role_and_counted() {
        let t0 = Instant::now();
        let (mut p, _pool) = core_in("kv_producer", "read");
        let reg = p.kv().unwrap().regs();
        p.on_control(t0, 1, Message::Handshake);
        assert!(
            matches!(&replies(&mut p)[..], [Message::HandshakeOk(h)] if h.ranks.as_ref().map(|r| r.iter().map(|r| r.reg).collect::<Vec<_>>()) == Some(reg.clone()) && h.engine_id == "e0")
        );
        p.on_control(
            t0,
            2,
            Message::Drop {
                transfer_id: "t1".into(),
                code: FailCode::Dropped,
            },
        );
        assert_eq!(replies(&mut p), vec![Message::DropOk { known: false }]);
        p.on_control(
            t0,
            3,
            Message::ReadDone {
                transfer_id: "t9".into(),
            },
        );
        assert!(matches!(
            &replies(&mut p)[..],
            [Message::ReadDoneErr { .. }]
        ));
        let c = p.counters();
        assert_eq!((c.drops_received, c.reads_late, c.reads_done), (1, 1, 0));
        // Asleep: the handshake names no registration.
        p.begin_release(t0).unwrap();
        p.on_control(t0, 4, Message::Handshake);
        assert!(matches!(&replies(&mut p)[..], [Message::HandshakeOk(h)] if h.ranks.is_none()));
        // A decode engine sends no KV.
        let (mut d, _pool2) = core("kv_consumer");
        let pull = Pull {
            transfer_id: "t1".into(),
            engine_id: "d9".into(),
            first_block: 0,
            num_tokens: 3 * BS,
            dst: Destination::Tcp {
                addr: "127.0.0.1:11".into(),
            },
            ranks: vec![PullRank {
                rank: RankReg {
                    heads: (0, 1),
                    reg: Registration {
                        segment: 1,
                        key: 2,
                        epoch: 1,
                        len: 4096 * 3,
                    },
                },
                grant_key: None,
            }],
            blocks: vec![0, 1, 2],
            weights_version: None,
        };
        for msg in [
            Message::Pull(pull),
            Message::Drop {
                transfer_id: "t1".into(),
                code: FailCode::Dropped,
            },
            Message::ReadDone {
                transfer_id: "t1".into(),
            },
        ] {
            d.on_control(t0, 5, msg);
            assert!(
                matches!(&replies(&mut d)[..], [Message::Error { reason }] if reason.contains("sends no KV"))
            );
        }
        assert_eq!(d.counters().drops_received, 0);
    }

    #[test]
    fn a_failed_exchange_ends_the_load_at_once_not_at_its_deadline() {
        let t0 = Instant::now();
        let (mut d, _pool) = core("kv_consumer");
        let id = start_load(&mut d, t0);
        let op = std::iter::from_fn(|| d.poll_io())
            .find_map(|io| match io {
                Io::Send {
                    op: op @ Op::Bootstrap { .. },
                    ..
                } => Some(op),
                _ => None,
            })
            .expect("a bootstrap");
        // Nobody listens at P's address.
        d.on_exchange_failed(
            t0,
            op,
            Failure::new(FailCode::PeerLost, "connection refused"),
            false,
        );
        assert_eq!(d.get_finished().recving, vec![id.clone()]);
        let errors = d.get_block_ids_with_load_errors();
        assert_eq!(
            errors.iter().map(|(b, _)| *b).collect::<Vec<_>>(),
            vec![1, 2, 3]
        );
        assert!(
            errors[0].1.message.contains("connection refused"),
            "{:?}",
            errors[0].1
        );
        assert_eq!(d.recv_machine().num_loads(), 0);
    }

    #[test]
    fn each_role_takes_only_its_own_params() {
        let t0 = Instant::now();
        let id: Arc<str> = Arc::from("r1");
        let toks = prompt();
        let for_d = params::for_decode("t1", Some("p0"), Some("127.0.0.1:20"));
        let for_p = params::for_prefill("t2");
        // A producer loads nothing.
        let (mut p, _pool) = core("kv_producer");
        let req = ConnectorRequest {
            id: &id,
            prompt_tokens: &toks,
            kv_transfer_params: Some(&for_d),
        };
        assert_eq!(
            p.get_num_new_matched_tokens(t0, req, 0),
            ExternalMatch::default()
        );
        // A consumer keeps nothing for a decode engine, a producer does —
        // from whichever call comes first.
        let (mut d, _pool2) = core("kv_consumer");
        let req = || ConnectorRequest {
            id: &id,
            prompt_tokens: &toks,
            kv_transfer_params: Some(&for_p),
        };
        d.request_added(t0, req());
        assert_eq!(
            d.get_num_new_matched_tokens(t0, req(), 0),
            ExternalMatch::default()
        );
        assert_eq!(d.send_machine().phase("t2"), None);
        p.request_added(t0, req());
        assert!(p.send_machine().phase("t2").is_some());
        let (mut p2, _pool3) = core("kv_producer");
        assert_eq!(
            p2.get_num_new_matched_tokens(t0, req(), 0),
            ExternalMatch::default()
        );
        assert!(p2.send_machine().phase("t2").is_some());
    }
}
