//! What the matrix reads in an engine's metrics (through the clients' one
//! Prometheus parser, `pdkv_deploy::prom`): device bytes by rank, why an
//! engine is not quiescent, and the transfer counters of P and D.

use pdkv_deploy::prom;

use crate::error::CallError;

pub(crate) use pdkv_deploy::prom::{metric, metric_sum, quiescent};

/// The sum of the samples of `name` per value of its `rank` label, by rank.
pub(crate) fn rank_sums(text: &str, name: &str) -> Vec<u64> {
    let mut by_rank: Vec<(usize, f64)> = prom::sums_by_label(text, name, "rank")
        .into_iter()
        .filter_map(|(rank, v)| Some((rank.parse().ok()?, v)))
        .collect();
    by_rank.sort_by_key(|&(rank, _)| rank);
    by_rank.into_iter().map(|(_, v)| v as u64).collect()
}

/// The gauges that say why an engine is not quiescent.
pub(crate) fn busy(text: &str) -> String {
    let show = |n: &str| metric(text, n).map_or("-".to_string(), |v| v.to_string());
    format!(
        "running {}, waiting {}, waiting for remote KV {}, held {}, free {}/{}, send held {}, pulls pending {}",
        show("pdkv_num_requests_running"),
        show("pdkv_num_requests_waiting"),
        show("pdkv_num_requests_waiting_for_remote_kv"),
        show("pdkv_kv_blocks_held"),
        show("pdkv_kv_blocks_free"),
        show("pdkv_kv_blocks_total"),
        show("pdkv_kv_send_held_blocks"),
        show("pdkv_kv_pulls_pending"),
    )
}

/// Transfer counters of P and D at one moment (or their change over a case).
#[derive(Clone, Copy, Debug, Default)]
pub struct TransferCounts {
    /// P: pulls served, or (read mode) reads D confirmed.
    pub pulls_ok: f64,
    pub pulls_failed: f64,
    /// P: pulls refused because P ended the transfer on purpose.
    pub pulls_released: f64,
    /// P: pulls ended because D dropped the transfer.
    pub pulls_cancelled: f64,
    pub loads_ok: f64,
    pub loads_failed: f64,
    /// D: loads P ended on purpose (recomputed).
    pub loads_released: f64,
    /// D: loads its own cache reset ended (recomputed).
    pub loads_cut_short: f64,
    /// D: loads whose request ended first.
    pub loads_cancelled: f64,
    /// D: loads that found P's lease expired (recomputed: P's work lost).
    pub loads_lease_expired: f64,
    /// P: leases that expired on transfers no D claimed, and on claimed
    /// ones (must stay 0 while every D lives).
    pub leases_expired: f64,
    pub claimed_leases_expired: f64,
    /// P: held transfers given back for new prompts (counted in D's
    /// `loads_released` too: D recomputes them).
    pub leases_reclaimed: f64,
}

impl TransferCounts {
    /// The counters in P's and D's expositions now.
    pub(crate) fn read(p: &str, d: &str) -> Result<TransferCounts, CallError> {
        let get = |t: &str, n: &'static str| metric(t, n).ok_or(CallError::NoCounter(n));
        // In read mode P serves no pulls: D reads, then tells P it is done.
        let served = get(p, "pdkv_kv_pulls_ok_total")?
            + metric(p, "pdkv_kv_reads_done_total").unwrap_or(0.0);
        Ok(TransferCounts {
            pulls_ok: served,
            pulls_failed: get(p, "pdkv_kv_pulls_failed_total")?,
            pulls_released: get(p, "pdkv_kv_pulls_released_total")?,
            pulls_cancelled: get(p, "pdkv_kv_pulls_cancelled_total")?,
            loads_ok: get(d, "pdkv_kv_loads_ok_total")?,
            loads_failed: get(d, "pdkv_kv_loads_failed_total")?,
            loads_released: get(d, "pdkv_kv_loads_released_total")?,
            loads_cut_short: get(d, "pdkv_kv_loads_cut_short_total")?,
            loads_cancelled: get(d, "pdkv_kv_loads_cancelled_total")?,
            loads_lease_expired: get(d, "pdkv_kv_loads_lease_expired_total")?,
            leases_expired: get(p, "pdkv_kv_leases_expired_total")?,
            claimed_leases_expired: get(p, "pdkv_kv_claimed_leases_expired_total")?,
            leases_reclaimed: get(p, "pdkv_kv_leases_reclaimed_total")?,
        })
    }

    pub(crate) fn minus(&self, b: &TransferCounts) -> TransferCounts {
        TransferCounts {
            pulls_ok: self.pulls_ok - b.pulls_ok,
            pulls_failed: self.pulls_failed - b.pulls_failed,
            pulls_released: self.pulls_released - b.pulls_released,
            pulls_cancelled: self.pulls_cancelled - b.pulls_cancelled,
            loads_ok: self.loads_ok - b.loads_ok,
            loads_failed: self.loads_failed - b.loads_failed,
            loads_released: self.loads_released - b.loads_released,
            loads_cut_short: self.loads_cut_short - b.loads_cut_short,
            loads_cancelled: self.loads_cancelled - b.loads_cancelled,
            loads_lease_expired: self.loads_lease_expired - b.loads_lease_expired,
            leases_expired: self.leases_expired - b.leases_expired,
            claimed_leases_expired: self.claimed_leases_expired - b.claimed_leases_expired,
            leases_reclaimed: self.leases_reclaimed - b.leases_reclaimed,
        }
    }

    /// Transfers ended on purpose, as P and as D counted them (one transfer
    /// may count on both sides).
    pub fn on_purpose(&self) -> (f64, f64) {
        (
            self.pulls_released + self.pulls_cancelled,
            self.loads_released
                + self.loads_cut_short
                + self.loads_cancelled
                + self.loads_lease_expired,
        )
    }

    /// The non-zero on-purpose counters, for a case's notes.
    pub(crate) fn on_purpose_note(&self) -> Option<String> {
        let parts: Vec<String> = [
            ("P pulls released", self.pulls_released),
            ("P pulls cancelled by D", self.pulls_cancelled),
            ("D loads released by P", self.loads_released),
            ("D loads cut short", self.loads_cut_short),
            ("D loads cancelled", self.loads_cancelled),
            (
                "D loads that found the lease expired",
                self.loads_lease_expired,
            ),
            ("P leases expired unclaimed", self.leases_expired),
            (
                "of the D loads released, reclaimed by P for new prompts",
                self.leases_reclaimed,
            ),
        ]
        .iter()
        .filter(|(_, v)| *v > 0.0)
        .map(|(n, v)| format!("{v} {n}"))
        .collect();
        (!parts.is_empty()).then(|| format!("ended on purpose: {}", parts.join(", ")))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ranks_come_in_rank_order_whatever_the_labels_order() {
        let text = "pdkv_rank_device_memory_bytes{rank=\"10\",tag=\"kv_cache\"} 5\n\
                    pdkv_rank_device_memory_bytes{tag=\"weights\",rank=\"2\"} 7\n\
                    pdkv_rank_device_memory_bytes{rank=\"2\",tag=\"kv_cache\"} 1\n";
        assert_eq!(rank_sums(text, "pdkv_rank_device_memory_bytes"), vec![8, 5]);
        assert!(rank_sums(text, "pdkv_missing").is_empty());
    }
}
