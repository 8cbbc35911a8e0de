//! The one Prometheus text parser of the matrix (unlabelled samples, sums
//! over labels, sums by rank), what quiescence means in an engine's
//! metrics, and the transfer counters of P and D.

use std::collections::BTreeMap;

use crate::error::CallError;

/// One unlabelled sample of a Prometheus exposition.
pub(crate) fn metric(text: &str, name: &str) -> Option<f64> {
    text.lines()
        .filter(|l| !l.starts_with('#'))
        .find_map(|l| l.strip_prefix(name).and_then(|r| r.strip_prefix(' ')))
        .and_then(|v| v.trim().parse().ok())
}

/// The sum of the samples of `name` per value of its `rank` label, by rank.
pub(crate) fn rank_sums(text: &str, name: &str) -> Vec<u64> {
    let mut by_rank: BTreeMap<usize, f64> = BTreeMap::new();
    for l in text.lines().filter(|l| !l.starts_with('#')) {
        let Some(rest) = l.strip_prefix(name).and_then(|r| r.strip_prefix('{')) else {
            continue;
        };
        let Some((labels, v)) = rest.rsplit_once(' ') else {
            continue;
        };
        let rank = labels
            .split(',')
            .find_map(|kv| kv.strip_prefix("rank=\""))
            .and_then(|r| r.split('"').next())
            .and_then(|r| r.parse().ok());
        if let (Some(rank), Ok(v)) = (rank, v.trim().parse::<f64>()) {
            *by_rank.entry(rank).or_default() += v;
        }
    }
    by_rank.values().map(|&v| v as u64).collect()
}

/// The sum of every labelled sample of `name`.
pub(crate) fn metric_sum(text: &str, name: &str) -> Option<f64> {
    let samples: Vec<f64> = text
        .lines()
        .filter(|l| !l.starts_with('#'))
        .filter_map(|l| l.strip_prefix(name).and_then(|r| r.strip_prefix('{')))
        .filter_map(|r| r.rsplit_once(' ').and_then(|(_, v)| v.trim().parse().ok()))
        .collect();
    (!samples.is_empty()).then(|| samples.iter().sum())
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

/// Idle, with every KV block free (none held for transfers).
pub(crate) fn quiescent(text: &str) -> bool {
    metric(text, "pdkv_num_requests_running") == Some(0.0)
        && metric(text, "pdkv_num_requests_waiting") == Some(0.0)
        && metric(text, "pdkv_kv_blocks_held") == Some(0.0)
        && metric(text, "pdkv_kv_blocks_free").is_some()
        && metric(text, "pdkv_kv_blocks_free") == metric(text, "pdkv_kv_blocks_total")
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
        }
    }

    /// Transfers ended on purpose, as P and as D counted them (one transfer
    /// may count on both sides).
    pub fn on_purpose(&self) -> (f64, f64) {
        (
            self.pulls_released + self.pulls_cancelled,
            self.loads_released + self.loads_cut_short + self.loads_cancelled,
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
    fn metrics_parse_with_and_without_labels() {
        let text = "# HELP x y\npdkv_kv_blocks_free 10\npdkv_kv_blocks_free_x 3\n\
                    pdkv_device_memory_bytes{tag=\"weights\"} 100\npdkv_device_memory_bytes{tag=\"kv_cache\"} 20\n";
        assert_eq!(metric(text, "pdkv_kv_blocks_free"), Some(10.0));
        assert_eq!(metric(text, "pdkv_kv_blocks_total"), None);
        assert_eq!(metric_sum(text, "pdkv_device_memory_bytes"), Some(120.0));
        assert_eq!(metric_sum(text, "pdkv_kv_blocks_free"), None);
    }
}
