//! The I/O the core queues for its driver, and what names a control
//! exchange so that its answer finds its way back. A leaf: the core's
//! files and the drivers (`net.rs`, a simulator) build on it.

use std::time::{Duration, Instant};

use pdkv_transfer::Registration;

use crate::recv::LoadId;
use crate::wire::{Destination, Message, Pull};

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
    /// D's claim on queued requests' transfers.
    Claim {
        id: crate::claims::ClaimId,
    },
    /// Best effort; the answer is only logged.
    DropUnpulled {
        transfer_id: String,
    },
}

pub use crate::ranks::Copy;

/// D, read mode: read the peer's blocks into this engine's, by `deadline`:
/// each copy from P's rank `remote[c.remote]` into this engine's
/// `local[c.local]`; report with
/// [`PdCore::on_read_result`](crate::pd::core::PdCore::on_read_result).
#[derive(Clone, Debug, PartialEq)]
pub struct ReadIo {
    pub load: LoadId,
    pub local: Vec<Registration>,
    pub remote: Vec<Registration>,
    pub transfer: Destination,
    pub copies: Vec<Copy>,
    pub deadline: Instant,
}

/// P: write this engine's blocks into the pull's destination, by
/// `deadline`: each copy from this engine's rank `local` (its registration
/// `local[c.local]`) into D's rank `dst.ranks[c.remote]`; report with
/// [`PdCore::on_write_done`](crate::pd::core::PdCore::on_write_done) (for
/// the pull that came on `conn`).
#[derive(Clone, Debug, PartialEq)]
pub struct WriteIo {
    pub conn: ConnId,
    pub local: Vec<Registration>,
    pub copies: Vec<Copy>,
    pub dst: Pull,
    pub deadline: Instant,
}

/// D: one exchange with the control listener at `addr`: send `msg`, hand
/// every frame back to
/// [`PdCore::on_reply`](crate::pd::core::PdCore::on_reply) until a final
/// one (a pull's `PullProgress` frames are not final), bounded by
/// `deadline`; a failure goes to
/// [`PdCore::on_exchange_failed`](crate::pd::core::PdCore::on_exchange_failed).
#[derive(Clone, Debug, PartialEq)]
pub struct SendIo {
    pub op: Op,
    pub addr: String,
    pub msg: Message,
    pub deadline: Instant,
}

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
    /// P: write this engine's blocks into a pull's destination ([`WriteIo`]).
    Write(WriteIo),
    /// D: one exchange with a control listener ([`SendIo`]).
    Send(SendIo),
    /// D, read mode: read the peer's blocks ([`ReadIo`]).
    Read(ReadIo),
    /// D: stop the load's read at once (its result still comes).
    CancelRead { load: LoadId },
    /// D: make sure nothing a peer still sends lands in the load's blocks: for
    /// every rank's `(segment, grant)`, revoke the grant on that registration
    /// (TCP) and, over shared memory, have every peer unmap the segment; report
    /// with [`PdCore::on_fenced`](crate::pd::core::PdCore::on_fenced) once
    /// every rank is fenced.
    Fence {
        load: LoadId,
        ranks: Vec<(u64, Option<u64>)>,
    },
}
