//! The KV cache registration: every rank registered (all or none),
//! released for sleep and restored under a new epoch.

use std::ops::Range;
use std::sync::Arc;
use std::time::Instant;

use pdkv_engine::connector::KvCacheSpec;
use pdkv_transfer::{Registration, Registry};

use super::counters::InFlight;
use super::kv::{KvInfo, RankKv};
use super::state::{send_config, PdCore};
use crate::recv::{LocalKv, RecvConfig, RecvMachine};
use crate::send::{SendMachine, ASLEEP};
use crate::wire::{FailCode, Failure};

impl PdCore {
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

    pub(super) fn block_size(&self) -> usize {
        self.kv
            .as_ref()
            .map_or(pdkv_model::BLOCK_SIZE, |k| k.block_size)
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
