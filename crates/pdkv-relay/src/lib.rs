//! What the P/D proxy decides for one client request, without I/O.
//!
//! [`plan::RelayPlan`] is a sans-IO state machine: events in (P's answer,
//! D's head, body and end, a failed or timed-out call, the client leaving),
//! actions out (send to P or D, cancel either, drop the transfer at P,
//! answer or stream to the client, count the outcome once). The proxy's
//! axum and reqwest driver (`pdkv_server::proxy`) and the cluster simulator
//! (`pdkv-sim`) both drive it.
//!
//! **Architecture invariant:** this crate knows no HTTP library, async
//! runtime, clock or thread: statuses are `u16`, bodies bytes,
//! `kv_transfer_params` JSON values. It depends on `pdkv-connector` only
//! for the protocol's keys ([`pdkv_connector::params`]) and
//! [`pdkv_connector::wire::FailCode`].

mod answer;
pub mod codes;
mod outcome;
pub mod plan;
mod request;
mod stream;

pub use codes::{DECODE_LOST_CODE, RETRYABLE_CODE, TOKEN_IDS_COMMENT, TOKEN_IDS_HEADER};
