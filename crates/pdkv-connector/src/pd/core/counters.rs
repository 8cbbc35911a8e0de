//! What the core counts for metrics, and what a release finds in flight.
//! A leaf.

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
    /// D: transfers named in claims sent to prefill engines.
    pub claims_sent: u64,
    /// P: transfers named in claims received.
    pub claims_received: u64,
    /// P: leases that expired on transfers no decode engine claimed.
    pub leases_expired: u64,
    /// P: leases that expired although a decode engine had claimed the
    /// transfer (its claims stopped).
    pub claimed_leases_expired: u64,
    /// P: held transfers given back early because new prompts needed the
    /// blocks.
    pub leases_reclaimed: u64,
    /// D: loads that found P's KV gone because its lease expired
    /// (recomputed: work lost, not a lifecycle operation's choice).
    pub loads_lease_expired: u64,
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
