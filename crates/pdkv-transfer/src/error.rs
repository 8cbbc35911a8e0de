//! The typed errors of registered memory and its grants: why an access, a
//! registration, a grant or a revocation was refused. A leaf: [`crate::registry`]
//! and [`crate::grant`] both build on it and it imports neither.

/// Why a remote access was refused. The memory is never touched when one
/// of these is returned.
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
pub enum AccessError {
    #[error("unknown segment {segment}")]
    UnknownSegment { segment: u64 },
    #[error("segment {segment} is not registered now")]
    NotRegistered { segment: u64 },
    #[error("wrong key for segment {segment}")]
    BadKey { segment: u64 },
    #[error("stale epoch: access names epoch {have}, the registration is at epoch {want}")]
    StaleEpoch { have: u64, want: u64 },
    #[error("range {offset}+{len} is outside the registration of {registered} bytes")]
    OutOfBounds {
        offset: u64,
        len: u64,
        registered: u64,
    },
    /// Inside the registration, but outside every range of the grant named.
    #[error("range {offset}+{len} is outside the ranges granted by this key of segment {segment}")]
    OutsideGrant { segment: u64, offset: u64, len: u64 },
}

/// Why a registration could not be made.
#[derive(Debug, thiserror::Error)]
pub enum RegisterError {
    #[error("range {offset}+{len} is empty or outside the region of {region_len} bytes")]
    BadRange {
        offset: usize,
        len: usize,
        region_len: usize,
    },
    #[error("the region is released (asleep); nothing to register")]
    NotMapped,
    #[error("the region is private memory of this process (huge-page backed); only shared regions can be registered")]
    Private,
    #[error("registry full: {0} segments")]
    Full(usize),
    /// A failure asked for through [`Registry::fail_register_after`].
    #[error("registering failed: injected fault")]
    Injected,
    #[error("{op} failed: {source}")]
    Os {
        op: &'static str,
        #[source]
        source: std::io::Error,
    },
}

/// Why a grant was not made.
#[derive(Debug, thiserror::Error)]
pub enum GrantError {
    /// The registration named is not live at that epoch with that key.
    #[error(transparent)]
    Access(#[from] AccessError),
    #[error("a grant names at least one range")]
    NoRanges,
    #[error("range {offset}+{len} is empty or outside the registration of {registered} bytes")]
    BadRange {
        offset: u64,
        len: u64,
        registered: u64,
    },
    #[error("grant table full: {0} grants")]
    Full(usize),
    #[error("grant table full: {ranges} more ranges do not fit in the bound of {limit}")]
    TooManyRanges { ranges: usize, limit: usize },
    #[error("{op} failed: {source}")]
    Os {
        op: &'static str,
        #[source]
        source: std::io::Error,
    },
}

/// Why a revocation did not complete.
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
pub enum RevokeError {
    /// No new access succeeds, but `accesses` handed out earlier were still
    /// held when the wait ended: bytes may still land through them.
    /// Revoking again waits for them again.
    #[error("{accesses} accesses through grant {key:#x} of segment {segment} outlived the wait")]
    InUse {
        segment: u64,
        key: u64,
        accesses: usize,
    },
}
