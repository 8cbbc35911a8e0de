//! `pdkv-transfer`: registered memory and one-sided transfers between agents.
//!
//! This is the layer prefill and decode engines use to move KV blocks. An
//! agent registers ranges of its memory ([`registry`]); a peer holding a
//! [`RemoteDescriptor`] reads or writes them one-sided, in batches with a
//! deadline and an optional notification delivered after all data landed.
//!
//! Modules: [`auth`] (the handshake every KV connection opens with: both
//! ends prove they hold the deployment's secret), [`error`] (why an access,
//! registration, grant or revocation was refused), [`registry`] (registrations, keys, epochs, checked access),
//! [`grant`] (revocable, range-restricted keys to a registration: the
//! fence against late writes over TCP),
//! [`listen`] (listeners with a backlog for bursts),
//! [`frame`] (wire format, a decoder that never panics), [`proto`] (the
//! initiator's sans-IO state machine: slicing, deadlines, completion,
//! notification after all data), [`tcp`] (the tokio driver: [`tcp::Agent`]),
//! [`shm`] (memfds over a Unix socket, in batches of at most
//! [`shm::MAX_FDS`] so a registration of any number of chunks can be
//! shared; batches copied on worker threads with the same batch, error and
//! [`proto::Stats`] types as TCP; unmap acks before deregistration, and
//! [`shm::ShmExporter::fence`], the fence over shared memory).
//! Metrics: bytes, operations and failures by reason per peer
//! ([`proto::Stats`]), and refusals by reason on the serving side
//! ([`tcp::ServeStats`]).
//!
//! Invariants (the crate keeps all of them at every step):
//! - `pdkv-transfer` never interprets the bytes it moves (KV contents are
//!   opaque);
//! - every remote access is checked against a live registration (segment,
//!   epoch, key, bounds — and, through a grant, its ranges) before any byte
//!   is touched; nothing outside a registration can be read or written;
//! - every wait has a deadline, and every queue and buffer a bound;
//! - the protocol logic ([`frame`], [`proto`]) is sans-IO: it does no I/O
//!   and reads no clock; drivers pass time and bytes in.

pub mod auth;
pub mod conns;
pub mod error;
pub mod frame;
pub mod grant;
pub mod listen;
pub mod proto;
pub mod registry;
pub mod shm;
pub mod tcp;

pub use grant::{Grant, GrantError, GrantHook, RevokeError};
pub use registry::{Access, AccessError, RegisterError, Registration, Registry, RegistryOptions};

/// What a peer needs to address a registration: where the owning agent
/// listens and the registration's handle. Serialisable for handshakes.
#[derive(Clone, Debug, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
pub struct RemoteDescriptor {
    pub agent_addr: String,
    pub segment: u64,
    pub key: u64,
    pub epoch: u64,
    /// Start of the described range inside the registration.
    pub offset: u64,
    pub len: u64,
}

impl RemoteDescriptor {
    /// Describes `[offset, offset+len)` of `reg`, owned by the agent at `agent_addr`.
    pub fn new(
        agent_addr: impl Into<String>,
        reg: &Registration,
        offset: u64,
        len: u64,
    ) -> RemoteDescriptor {
        RemoteDescriptor {
            agent_addr: agent_addr.into(),
            segment: reg.segment,
            key: reg.key,
            epoch: reg.epoch,
            offset,
            len,
        }
    }

    /// Describes `[offset, offset+len)` of the registration `grant` opens,
    /// addressed with the grant's key: refused outside its ranges and once
    /// it is revoked.
    pub fn granted(
        agent_addr: impl Into<String>,
        grant: &Grant,
        offset: u64,
        len: u64,
    ) -> RemoteDescriptor {
        RemoteDescriptor {
            agent_addr: agent_addr.into(),
            segment: grant.segment,
            key: grant.key,
            epoch: grant.epoch,
            offset,
            len,
        }
    }
}
