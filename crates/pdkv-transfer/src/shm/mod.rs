//! Shared memory between agents on one host.
//!
//! A [`ShmExporter`] listens on a Unix socket. A peer ([`ShmImporter`])
//! asks it for a registration (`MapReq` naming segment, key and epoch); the
//! exporter checks the request against its [`Registry`] like any remote
//! access (with the registration's own key: a grant does not open a whole
//! mapping) and answers with the registration's layout (`MapResp`) and its
//! memfds in batches of at most [`MAX_FDS`] (`MapPart`, SCM_RIGHTS), so a
//! registration of any number of chunks can be shared. The importer
//! reserves the whole range, maps each batch as it arrives and closes its
//! descriptors (`layout.rs`), and from then on copies directly, checking each
//! copy against the epoch and bounds it imported. What cannot work is
//! refused with its own reason: more chunks than `Limits::max_map_chunks`
//! ([`ShmError::TooManyChunks`]; [`check_shareable`] tells at start-up), a
//! reply that contradicts itself ([`ShmError::BadMap`]).
//!
//! A peer's mapping pins pages just as a registration does, so
//! [`ShmExporter::deregister`] first sends `Unmap` to every peer that mapped
//! the segment and waits (up to a deadline) for each `UnmapAck`; the
//! importer acknowledges only after its copies in flight ended and its
//! mapping is gone. Only then is the registration dropped, so the memory is
//! accounted free only once no one can reach it. [`ShmExporter::fence`]
//! does the same and keeps the registration: the fence a decode engine
//! raises before reusing blocks a peer could still be writing, since over
//! shared memory the peer copies directly and a range-restricted grant
//! cannot stop it.
//!
//! Batches ([`ShmImporter::start`]) take the TCP path's descriptions
//! ([`Transfer`] of a [`LocalSlice`] and a remote [`Target`]) and end with
//! its [`TransferError`]. A worker thread checks every remote range against
//! the imported registration (key, epoch, bounds) before the first byte
//! moves, then copies slice by slice; between slices it checks cancellation
//! and the deadline and never starts a slice after either. The notification
//! goes over the socket after the last slice, and the exporter queues it
//! (bounded; full → `Busy`) only on receipt, so it follows all the data. An
//! unmap takes the mapping's write lock: it waits for the slice in
//! progress, and the batch's next slice finds the mapping gone and fails
//! with `NotRegistered`. Each mapping lives in a slot of its own, and a
//! batch holds the slot it checked: a later map of the segment gets a new
//! slot (retiring any older one), so an old batch never continues into it.
//!
//! Control frames are the [`crate::frame`] headers; blocking sockets with
//! timeouts, one reader thread per connection.
//!
//! Bounds: at most `Limits::max_map_chunks` memfds per shared registration,
//! at most [`MAX_FDS`] descriptors received per frame, one map reply in
//! assembly per `map` call in flight, every wait with a deadline.
//!
//! [`Registry`]: crate::registry::Registry
//! [`Transfer`]: crate::proto::Transfer
//! [`TransferError`]: crate::proto::TransferError
//! [`LocalSlice`]: crate::tcp::LocalSlice
//! [`Target`]: crate::frame::Target

mod export;
mod fds;
mod import;
mod layout;

use std::io;
use std::os::fd::OwnedFd;
use std::os::unix::net::UnixStream;
use std::time::Duration;

use crate::frame::{FrameError, Header, Limits, RemoteError, HEADER_LEN, MAX_PART_FDS};

pub use export::{
    ExportOptions, ShmExporter, ShmNotification, DEFAULT_MAX_PEERS, DEFAULT_NOTIFY_QUEUE,
};
pub use fds::{recv_with_fds, send_with_fds};
pub use import::{ShmBatchHandle, ShmImporter, ShmImporterConfig, SliceHook};

/// Most memfds one frame carries (SCM_MAX_FD); a map reply sends a
/// registration's memfds in batches of at most this many.
pub const MAX_FDS: usize = MAX_PART_FDS;

/// How long one control write may block on a peer that does not read.
const WRITE_TIMEOUT: Duration = Duration::from_secs(5);
/// How long a connection's handshake ([`crate::auth`]) may take, each side.
const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(5);

#[derive(Debug, thiserror::Error)]
pub enum ShmError {
    #[error(transparent)]
    Remote(RemoteError),
    #[error("segment {0} is not mapped here")]
    NotMapped(u64),
    #[error("deadline passed")]
    Timeout,
    #[error("the peer was lost")]
    PeerLost,
    #[error("peers {peers:?} did not acknowledge unmapping segment {segment} in time; their mappings still pin its pages")]
    UnmapTimeout { segment: u64, peers: Vec<u64> },
    #[error("malformed frame: {0}")]
    Frame(#[from] FrameError),
    #[error("bad map reply: {0}")]
    BadMap(#[from] BadMap),
    #[error("registration spans {chunks} memfds; at most {limit} can be shared (Limits::max_map_chunks)")]
    TooManyChunks { chunks: u64, limit: u64 },
    #[error(transparent)]
    Io(#[from] io::Error),
}

impl From<RemoteError> for ShmError {
    /// The exporter's refusal; the chunk limit is named the same whichever
    /// side enforced it.
    fn from(e: RemoteError) -> ShmError {
        match e {
            RemoteError::TooManyChunks { chunks, limit } => {
                ShmError::TooManyChunks { chunks, limit }
            }
            e => ShmError::Remote(e),
        }
    }
}

impl From<crate::error::AccessError> for ShmError {
    fn from(e: crate::error::AccessError) -> ShmError {
        ShmError::Remote(e.into())
    }
}

/// How a map reply contradicted itself. The map fails and nothing of it
/// stays mapped; the connection goes on.
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
pub enum BadMap {
    #[error("the head does not describe the registration asked for")]
    Head,
    #[error("a second head for one map")]
    SecondHead,
    #[error("a part before the head")]
    NoHead,
    #[error("a part that is not a chunk index and 1..={MAX_FDS} lengths")]
    Part,
    #[error("a part starts at chunk {got}; chunk {want} was next")]
    OutOfOrder { want: u64, got: u64 },
    #[error("a part names {lens} chunks and carries {fds} memfds")]
    FdCount { lens: usize, fds: usize },
    #[error("the parts go past the {chunks} chunks or {bytes} bytes the head announced")]
    PastEnd { chunks: u64, bytes: u64 },
    #[error("the chunks add up to {got} bytes; the head announced {want}")]
    ShortTotal { want: u64, got: u64 },
}

/// Whether a registration spanning `chunks` memfds can be shared under
/// `limits`: the check an exporter and an importer both make on every map,
/// for a caller to run at start-up (with `Registry::chunk_count`, or
/// [`ShmExporter::check_shareable`]) rather than learn it on the first map.
pub fn check_shareable(chunks: usize, limits: &Limits) -> Result<(), ShmError> {
    let limit = limits.max_map_chunks as u64;
    match chunks as u64 {
        n if n > limit => Err(ShmError::TooManyChunks { chunks: n, limit }),
        _ => Ok(()),
    }
}

/// Reads one frame (header and data), collecting the descriptors that came
/// with it: at most [`MAX_FDS`], more fail the read.
fn read_header(
    sock: &UnixStream,
    limits: &Limits,
    fds: &mut Vec<OwnedFd>,
) -> Result<(Header, Vec<u8>), ShmError> {
    let mut h = [0u8; HEADER_LEN];
    recv_with_fds(sock, &mut h, fds)?;
    let header = Header::decode(&h, limits)?;
    let mut data = vec![0u8; header.data_len()];
    recv_with_fds(sock, &mut data, fds)?;
    if fds.len() > MAX_FDS {
        return Err(io::Error::new(
            io::ErrorKind::InvalidData,
            "more memfds than one frame may carry",
        )
        .into());
    }
    Ok((header, data))
}
