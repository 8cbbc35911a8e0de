//! P's side of the core, and the control messages every engine answers:
//! bootstrap and handshake, pulls, drops and read-done, writes ended, and
//! the send machine's actions turned into replies and writes.

use std::ops::Range;
use std::time::Instant;

use pdkv_engine::connector::ConnectorRequest;
use pdkv_engine::FinishReason;
use serde_json::Value;

use super::io::{ConnId, Io, WriteIo};
use super::state::PdCore;
use crate::config::TransferMode;
use crate::params::{self, ReadParams};
use crate::send::{self, PullSpec, ASLEEP};
use crate::wire::{ClaimEnded, FailCode, Failure, HandshakeInfo, Message, Pull, MAX_CLAIM};

impl PdCore {
    /// P's request ended: its blocks are held for D (READY) unless the send
    /// ended; the params tell D where to load from.
    pub(super) fn prefill_finished(
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
            Message::Claim { transfer_ids } if self.cfg.kv_role.produces() => {
                Some(self.claim(now, &transfer_ids))
            }
            Message::Pull(_)
            | Message::Drop { .. }
            | Message::ReadDone { .. }
            | Message::Claim { .. } => Some(Message::Error {
                reason: format!(
                    "engine {} is a {} and sends no KV",
                    self.engine_id,
                    self.cfg.kv_role.as_str()
                ),
            }),
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

    /// A D's claim on queued requests' transfers (at most [`MAX_CLAIM`]).
    fn claim(&mut self, now: Instant, transfer_ids: &[String]) -> Message {
        if transfer_ids.len() > MAX_CLAIM {
            return Message::Error {
                reason: format!(
                    "a claim names {} transfers, more than the {MAX_CLAIM} one claim may",
                    transfer_ids.len()
                ),
            };
        }
        let ended = transfer_ids
            .iter()
            .filter_map(|tid| {
                let f = self.send.on_claim(now, tid).err()?;
                Some(ClaimEnded {
                    transfer_id: tid.clone(),
                    code: f.code,
                })
            })
            .collect();
        Message::ClaimOk {
            lease_ms: self.send.lease().as_millis() as u64,
            ended,
        }
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
            tracing::warn!(transfer_id = %p.transfer_id, "a pull was refused: {reason}");
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

    pub(super) fn send_action(&mut self, _now: Instant, a: send::Action) {
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
                            _ => {
                                c.pulls_failed += 1;
                                tracing::warn!("a pull failed: {f}");
                            }
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
                self.io.push_back(Io::Write(WriteIo {
                    conn: pull,
                    local: kv.regs(),
                    copies,
                    dst,
                    deadline,
                }));
            }
        }
    }
}
