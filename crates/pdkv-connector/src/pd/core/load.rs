//! D's side of the core: loads decided and started, the answers to its
//! exchanges, reads and fences ended, and the receive machine's actions
//! turned into exchanges, pulls (with their grants), reads and fences.

use std::ops::Range;
use std::sync::Arc;
use std::time::{Duration, Instant};

use pdkv_engine::connector::{Allocated, ConnectorRequest};

use super::io::{Io, Op, ReadIo, CONTROL_IO};
use super::state::{load_error, PdCore};
use crate::params::PdParams;
use crate::ranks::RankReg;
use crate::recv::{self, BootInfo, LoadEnd, LoadId, LoadSpec, PullResult};
use crate::wire::{FailCode, Failure, HandshakeInfo, Message, Pull, PullRank};

impl PdCore {
    pub fn update_state_after_alloc(&mut self, req: ConnectorRequest<'_>, alloc: Allocated<'_>) {
        let Allocated {
            block_ids,
            num_computed_tokens,
            num_external_tokens,
        } = alloc;
        let Some((params, prompt_len)) = self.pending.remove(req.id) else {
            return;
        };
        // Admitted: its load (or its local compute) takes over from claims.
        self.claims.remove(req.id);
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
            Op::Claim { id } => {
                let answer = match msg {
                    Message::ClaimOk { lease_ms, ended } => {
                        Ok((Duration::from_millis(lease_ms), ended))
                    }
                    other => {
                        tracing::warn!(answer = ?other, "a claim was refused; claiming again shortly");
                        Err(())
                    }
                };
                self.claims.on_answer(now, id, answer);
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
            Op::Claim { id } => {
                tracing::debug!("a claim exchange failed, claiming again shortly: {failure}");
                self.claims.on_answer(now, id, Err(()));
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

    pub(super) fn drop_unpulled(&mut self, now: Instant, addr: String, transfer_id: String) {
        self.counters.drops_unpulled += 1;
        let msg = Message::Drop {
            transfer_id: transfer_id.clone(),
            code: FailCode::Dropped,
        };
        self.exchange(
            Op::DropUnpulled { transfer_id },
            addr,
            msg,
            now + CONTROL_IO,
        );
    }

    pub(super) fn recv_action(&mut self, now: Instant, a: recv::Action) {
        match a {
            recv::Action::Bootstrap { addr } => {
                let op = Op::Bootstrap { addr: addr.clone() };
                self.exchange(op, addr, Message::Bootstrap, now + CONTROL_IO);
            }
            recv::Action::Handshake { addr } => {
                let op = Op::Handshake { addr: addr.clone() };
                self.exchange(op, addr, Message::Handshake, now + CONTROL_IO);
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
                self.exchange(Op::ReadDone { load }, addr, msg, now + CONTROL_IO);
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
                self.exchange(Op::Drop { load }, addr, msg, now + wait);
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
        self.exchange(Op::Pull { load }, spec.addr, Message::Pull(pull), deadline);
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
        self.io.push_back(Io::Read(ReadIo {
            load,
            local: kv.regs(),
            remote,
            transfer: peer.transfer,
            copies,
            deadline,
        }));
    }

    /// A load ended and nothing writes its blocks: reported in `recving`,
    /// with its blocks as load errors when it failed.
    pub(super) fn load_finished(&mut self, f: recv::Finished) {
        let c = &mut self.counters;
        match &f.end {
            LoadEnd::Loaded => c.loads_ok += 1,
            LoadEnd::Gone => c.loads_cancelled += 1,
            LoadEnd::Failed(lf) if lf.failure.message == recv::CUT_SHORT => c.loads_cut_short += 1,
            LoadEnd::Failed(lf) if lf.failure.code == FailCode::LeaseExpired => {
                c.loads_lease_expired += 1
            }
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
