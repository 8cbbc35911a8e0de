//! The deployment's settings that every engine of it shares: how KV moves
//! from P to D, who moves it, and what D does with a load that failed. One
//! definition, used by `pdkv up`, `pdkv bench serve` and the lifecycle
//! matrix (the `clap::ValueEnum` derive makes them command-line values).

use clap::ValueEnum;

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum Transport {
    Tcp,
    Shm,
}

impl Transport {
    /// Its name in a `--kv-transfer-config`.
    pub fn as_str(self) -> &'static str {
        match self {
            Transport::Tcp => "tcp",
            Transport::Shm => "shm",
        }
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum TransferMode {
    /// P writes into D's blocks (D pulls).
    Write,
    /// D reads P's leased blocks.
    Read,
}

impl TransferMode {
    /// Its name in a `--kv-transfer-config`.
    pub fn as_str(self) -> &'static str {
        match self {
            TransferMode::Write => "write",
            TransferMode::Read => "read",
        }
    }
}

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
