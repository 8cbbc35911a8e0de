//! `pdkv-sync`: weight sync from a trainer without a disk round-trip.
//!
//! A publisher (the trainer's side: [`publish::Publisher`]) holds the new weights in registered
//! memory and answers `GET /manifest` with every tensor's name, type,
//! shape, place and CRC-32 ([`manifest`]). An engine's [`pull::Puller`]
//! checks the manifest against the running model's layout before a byte
//! moves, stages a region laid out as the running weights, and reads the
//! tensors one-sided over the transfer engine (`pdkv-transfer`: keys,
//! epochs, sliced reads over parallel connections), each checked against
//! its checksum. The engine then installs the complete staging in one
//! switch; until then the old weights serve, and a failed, cut-off or
//! mismatched sync leaves them untouched.
//!
//! Invariants: nothing here writes the running weights; a staging counts
//! a tensor as pulled only after its bytes landed and matched their
//! checksum; every error names the tensor (or the publisher) it is about.

pub mod manifest;
pub mod publish;
pub mod pull;

pub use manifest::{checksum, converts, Manifest, MismatchError, TensorEntry, PROTOCOL};
pub use publish::{shared_weights, PublishOptions, Publisher, TrainerTensor};
pub use pull::{PullReport, Puller, Staging, SyncError, Transport};
