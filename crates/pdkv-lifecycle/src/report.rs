//! What a run found: each case run's result ([`CaseResult`]) and the whole
//! matrix ([`MatrixReport`]), and their text (a line per case run, a
//! summary, a JSON line last) as `pdkv lifecycle` prints them.

use pdkv_deploy::{FailurePolicy, TransferMode, Transport};
use serde_json::{json, Value};

use crate::bounds::MIB;
use crate::load::LoadCounts;
use crate::metrics::TransferCounts;

/// The result of one case run.
#[derive(Clone, Debug, Default)]
pub struct CaseResult {
    /// The case's name in the catalogue (`--cases` takes it).
    pub name: String,
    /// Which cycle of `--cycles` this run was, from 1.
    pub cycle: usize,
    /// Why the case failed, one line a check; empty: it passed.
    pub reasons: Vec<String>,
    /// What was seen but fails nothing (slow phases, transfers ended on
    /// purpose, gauges read while asleep).
    pub notes: Vec<String>,
    /// How the requests of the load ended over the case.
    pub load: LoadCounts,
    /// Transfer counter deltas over the case (before the probes).
    pub t: TransferCounts,
    /// P's device bytes awake, from the baseline.
    pub p_awake: u64,
    /// D's device bytes awake, from the baseline.
    pub d_awake: u64,
    /// P's device bytes read while it slept; `None` where the case did
    /// not put P to sleep.
    pub p_asleep: Option<u64>,
    /// D's device bytes read while it slept, as `p_asleep` for P.
    pub d_asleep: Option<u64>,
    /// Greedy probes whose text matched the baseline's after the case.
    pub probes_equal: usize,
    /// Greedy probes sent after the case.
    pub probes_run: usize,
    /// Seconds each phase took.
    pub phases: Vec<(&'static str, f64)>,
    /// How long the case run took, wall clock.
    pub wall_s: f64,
}

impl CaseResult {
    pub fn passed(&self) -> bool {
        self.reasons.is_empty()
    }

    /// The case's line in the report (`PASS name cycle ...`).
    pub fn line(&self) -> String {
        let mib = |b: u64| format!("{:.1}", b as f64 / MIB);
        let asleep = |b: Option<u64>| b.map_or("-".to_string(), mib);
        let t = &self.t;
        let mut s = format!(
            "{} {} {}  transfers {}/{} ended on purpose P {} D {}  lost {}{}  P {}/{} MiB  D {}/{} MiB  probes {}/{}  load ok {} 503 {} abort {} disc {}",
            if self.passed() { "PASS" } else { "FAIL" },
            self.name,
            self.cycle,
            t.pulls_ok + t.loads_ok,
            t.pulls_failed + t.loads_failed,
            t.on_purpose().0,
            t.on_purpose().1,
            self.load.lost.len(),
            if self.load.bare_503 > 0 { format!(" ({} 503s without Retry-After)", self.load.bare_503) } else { String::new() },
            mib(self.p_awake),
            asleep(self.p_asleep),
            mib(self.d_awake),
            asleep(self.d_asleep),
            self.probes_equal,
            self.probes_run,
            self.load.complete,
            self.load.retryable,
            self.load.aborted,
            self.load.disconnected,
        );
        let extra: Vec<&String> = self.reasons.iter().chain(&self.notes).collect();
        if !extra.is_empty() {
            s.push_str("  [");
            s.push_str(
                &extra
                    .iter()
                    .map(|s| s.as_str())
                    .collect::<Vec<_>>()
                    .join("; "),
            );
            s.push(']');
        }
        s
    }

    /// The case in the report's JSON summary.
    pub fn json(&self) -> Value {
        json!({
            "name": self.name, "cycle": self.cycle, "pass": self.passed(),
            "reasons": self.reasons, "notes": self.notes,
            "transfers": {"pulls_ok": self.t.pulls_ok, "pulls_failed": self.t.pulls_failed,
                          "pulls_released": self.t.pulls_released, "pulls_cancelled": self.t.pulls_cancelled,
                          "loads_ok": self.t.loads_ok, "loads_failed": self.t.loads_failed,
                          "loads_released": self.t.loads_released, "loads_cut_short": self.t.loads_cut_short,
                          "loads_cancelled": self.t.loads_cancelled, "loads_lease_expired": self.t.loads_lease_expired,
                          "leases_expired": self.t.leases_expired, "claimed_leases_expired": self.t.claimed_leases_expired,
                          "leases_reclaimed": self.t.leases_reclaimed},
            "load": {"sent": self.load.sent, "complete": self.load.complete, "retry_503": self.load.retryable,
                     "aborted": self.load.aborted, "disconnected": self.load.disconnected,
                     "lost": self.load.lost.len(), "lost_503_without_retry_after": self.load.bare_503},
            "p_awake_bytes": self.p_awake, "p_asleep_bytes": self.p_asleep,
            "d_awake_bytes": self.d_awake, "d_asleep_bytes": self.d_asleep,
            "probes_equal": self.probes_equal, "probes_run": self.probes_run,
            "phase_s": self.phases.iter().map(|(n, s)| (n.to_string(), json!(s))).collect::<serde_json::Map<_, _>>(),
        })
    }
}

/// Every case run of a matrix, and the settings it ran under.
#[derive(Clone, Debug)]
pub struct MatrixReport {
    pub transport: Transport,
    pub transfer_mode: TransferMode,
    pub kv_load_failure_policy: FailurePolicy,
    /// Cases selected (each ran `cycles` times).
    pub cases: usize,
    pub cycles: usize,
    /// Every case run, in the order they ran.
    pub results: Vec<CaseResult>,
}

impl MatrixReport {
    pub fn failed(&self) -> Vec<&CaseResult> {
        self.results.iter().filter(|r| !r.passed()).collect()
    }

    pub fn passed(&self) -> bool {
        self.results.iter().all(CaseResult::passed)
    }

    /// The summary line and a line per failed case run.
    pub fn summary(&self) -> String {
        let failed = self.failed();
        let mut s = format!(
            "summary: {}/{} case runs passed ({} cases x {} cycles, transport {:?}, transfer mode {:?}, kv_load_failure_policy {:?})",
            self.results.len() - failed.len(),
            self.results.len(),
            self.cases,
            self.cycles,
            self.transport,
            self.transfer_mode,
            self.kv_load_failure_policy
        );
        for f in &failed {
            s.push_str(&format!(
                "\nfailed: {} cycle {}: {}",
                f.name,
                f.cycle,
                f.reasons.join("; ")
            ));
        }
        s
    }

    /// The JSON summary (a line, last on `pdkv lifecycle`'s stdout).
    pub fn json(&self) -> Value {
        let failed = self.failed().len();
        json!({
            "transport": format!("{:?}", self.transport).to_lowercase(),
            "transfer_mode": format!("{:?}", self.transfer_mode).to_lowercase(),
            "kv_load_failure_policy": format!("{:?}", self.kv_load_failure_policy).to_lowercase(),
            "passed": self.results.len() - failed,
            "failed": failed,
            "cases": self.results.iter().map(CaseResult::json).collect::<Vec<_>>(),
        })
    }
}
