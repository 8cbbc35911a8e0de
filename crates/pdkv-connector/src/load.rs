//! What D's receive machine ([`crate::recv::RecvMachine`]) takes and gives:
//! a load's spec and P's answers (in), how a load ended and the actions for
//! the driver (out). A leaf, like the machine without I/O, clock or
//! threads.

use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::params::ReadParams;
use crate::wire::Failure;

/// Names one load (never reused).
pub type LoadId = u64;

/// The failure of a load that a cache reset cut short (the engine
/// recomputes the request).
pub const CUT_SHORT: &str = "load cut short by a cache reset";

/// How long a failed fence waits before it is tried again.
pub const FENCE_RETRY: Duration = Duration::from_secs(1);

#[derive(Clone, Debug)]
pub struct RecvConfig {
    /// D gives up this long after it last heard from P.
    pub load_timeout: Duration,
    /// Tokens per block.
    pub block_size: usize,
}

/// What D decided to load for a request.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LoadSpec {
    pub req: Arc<str>,
    pub transfer_id: String,
    pub remote_engine_id: String,
    /// P's control listener.
    pub addr: String,
    pub prompt_len: usize,
    /// Index, in the request's block table, of the first block loaded.
    pub first_block: usize,
    /// D's blocks that receive the KV, in order.
    pub dst_blocks: Vec<u32>,
    /// Read mode: P's leased blocks, its generation and weights.
    pub read: Option<ReadParams>,
}

/// P's answer to a bootstrap (write mode).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct BootInfo {
    pub engine_id: String,
    pub layout: String,
    pub block_bytes: u64,
}

/// P's answer to a handshake (read mode): its engine id, layout, transfer
/// address and live registration (`None` while its KV is released).
pub use crate::wire::HandshakeInfo as PeerInfo;

/// What the engine's own KV cache looks like (peers must match it).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LocalKv {
    pub layout: String,
    pub block_bytes: u64,
    /// The weights this engine serves.
    pub weights_version: Option<String>,
}

/// How a pull ended, as the driver saw it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum PullResult {
    /// P's final answer.
    Answered(Result<(), Failure>),
    /// It failed before the pull left D (nothing to fence).
    NotSent(Failure),
    /// The exchange broke or timed out after the pull may have left D: P
    /// may still be writing.
    Lost(Failure),
}

/// A load's failure as the engine sees it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LoadFailure {
    pub failure: Failure,
    /// Recompute whatever the policy says (the failure was on purpose).
    pub recompute: bool,
}

impl LoadFailure {
    pub(crate) fn new(failure: Failure) -> LoadFailure {
        let recompute = failure.code.on_purpose();
        LoadFailure { failure, recompute }
    }
}

/// How a load ended.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum LoadEnd {
    Loaded,
    Failed(LoadFailure),
    /// Its request ended first; nothing to report but the blocks.
    Gone,
}

/// What the driver must do.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Action {
    /// Ask P at `addr` who it is ([`RecvMachine::on_bootstrap`]).
    Bootstrap { addr: String },
    /// Read mode: ask P at `addr` for its transfer address and registration
    /// ([`RecvMachine::on_handshake`]).
    Handshake { addr: String },
    /// Send the pull for the load (P writes `spec.dst_blocks`); report with
    /// [`RecvMachine::on_pull_result`], and every progress from P with
    /// [`RecvMachine::on_progress`].
    Pull {
        load: LoadId,
        spec: LoadSpec,
        weights_version: Option<String>,
    },
    /// Read mode: read P's blocks `read.block_ids[first..]` at `generation`
    /// into `spec.dst_blocks`, by `deadline`; report with
    /// [`RecvMachine::on_read_result`].
    Read {
        load: LoadId,
        spec: LoadSpec,
        peer: PeerInfo,
        generation: u64,
        deadline: Instant,
    },
    /// Read mode: tell P the read ended; report P's answer with
    /// [`RecvMachine::on_read_done_answer`].
    ReadDone {
        load: LoadId,
        addr: String,
        transfer_id: String,
    },
    /// Stop the load's own read at once (its end still comes as
    /// [`RecvMachine::on_read_result`]).
    CancelRead { load: LoadId },
    /// Ask P to drop the transfer; report with [`RecvMachine::on_drop_answer`].
    Drop {
        load: LoadId,
        addr: String,
        transfer_id: String,
    },
    /// Make sure nothing P still sends can land in the load's blocks;
    /// report with [`RecvMachine::on_fenced`].
    Fence { load: LoadId },
    /// Tell P (best effort, no answer needed) that D will never pull it.
    DropUnpulled { addr: String, transfer_id: String },
    /// The load ended: the driver forgets what it kept for it (the pull's
    /// grant, its connection).
    Forget { load: LoadId },
}

/// The phase of a load, for tests and metrics.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PhaseName {
    Decided,
    Booting,
    Pulling,
    Handshaking,
    Reading,
    Confirming,
    Fencing,
}

/// A load that ended, with the blocks it had.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Finished {
    pub req: Arc<str>,
    pub end: LoadEnd,
    pub dst_blocks: Vec<u32>,
}
