//! The deployment's settings that every engine of it shares: how KV moves
//! from P to D, who moves it, and what D does with a load that failed. One
//! definition, used by `pdkv up`, `pdkv bench serve` and the lifecycle
//! matrix (the `clap::ValueEnum` derive makes them command-line values;
//! the transport and the transfer mode are the connector's own).

use clap::ValueEnum;

pub use pdkv_connector::config::{TransferMode, Transport};

/// D's `kv_load_failure_policy`: what a KV load that failed does to its
/// request (a load that P ended on purpose recomputes under either).
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum FailurePolicy {
    Fail,
    Recompute,
}

impl FailurePolicy {
    /// Its name in a `--kv-transfer-config`.
    pub fn as_str(self) -> &'static str {
        match self {
            FailurePolicy::Fail => "fail",
            FailurePolicy::Recompute => "recompute",
        }
    }
}
