//! The engine lifecycle an RL trainer drives between rollouts: pause,
//! resume, sleep, wake, KV-cache release, prefix-cache reset, weight reload.
//!
//! Public types used by the admin HTTP API; the state machine itself lives
//! here too (sans-IO: it decides, the core applies).

use std::path::PathBuf;

use pdkv_vmem::Tag;

/// What a pause does to requests that are running.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PauseMode {
    /// Abort running requests (they finish with `FinishReason::Abort`).
    Abort,
    /// Let running requests finish; admit nothing new.
    Wait,
    /// Freeze running requests where they are; they continue after resume.
    Keep,
}

impl PauseMode {
    pub fn parse(s: &str) -> Option<PauseMode> {
        match s {
            "abort" => Some(PauseMode::Abort),
            "wait" => Some(PauseMode::Wait),
            "keep" => Some(PauseMode::Keep),
            _ => None,
        }
    }

    pub fn as_str(self) -> &'static str {
        match self {
            PauseMode::Abort => "abort",
            PauseMode::Wait => "wait",
            PauseMode::Keep => "keep",
        }
    }
}

/// Sleep levels as in vLLM.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SleepLevel {
    /// Pause only; memory stays.
    L0,
    /// Weights offloaded to host memory, KV cache discarded.
    L1,
    /// Weights and KV cache discarded; weights must be reloaded before serving.
    L2,
}

impl SleepLevel {
    pub fn parse(n: u32) -> Option<SleepLevel> {
        match n {
            0 => Some(SleepLevel::L0),
            1 => Some(SleepLevel::L1),
            2 => Some(SleepLevel::L2),
            _ => None,
        }
    }

    pub fn as_u32(self) -> u32 {
        match self {
            SleepLevel::L0 => 0,
            SleepLevel::L1 => 1,
            SleepLevel::L2 => 2,
        }
    }
}

/// Where the weights being served came from.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct WeightInfo {
    /// The version string given with the last reload (`None` for the weights loaded at start).
    pub version: Option<String>,
    pub path: PathBuf,
}

/// The lifecycle state, a snapshot.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LifecycleStatus {
    pub paused: Option<PauseMode>,
    /// Sleep level while asleep (any tag released).
    pub sleeping: Option<SleepLevel>,
    /// Tags whose memory is released now.
    pub asleep_tags: Vec<Tag>,
    /// True after a level-2 wake until weights are reloaded: requests are refused.
    pub weights_discarded: bool,
}

#[derive(Debug, thiserror::Error)]
pub enum LifecycleError {
    /// The operation needs a completed pause (HTTP 409).
    #[error("{0}")]
    Conflict(String),
    /// Bad argument (HTTP 400).
    #[error("{0}")]
    Invalid(String),
    /// New weights do not fit the running model (HTTP 400); the old weights keep serving.
    #[error("incompatible weights: {0}")]
    IncompatibleWeights(String),
    /// The operation did not finish within its deadline (HTTP 504).
    #[error("timed out: {0}")]
    Timeout(String),
    /// A resume or another operation cancelled this one (HTTP 409).
    #[error("cancelled: {0}")]
    Cancelled(String),
    #[error("the engine has stopped")]
    Stopped,
    /// Memory mapping or loading failed (HTTP 500).
    #[error("{0}")]
    Internal(String),
}
