//! Why the matrix could not run ([`LifecycleError`]), why a call to an
//! engine gave no usable answer ([`CallError`]), and why a case check
//! failed ([`Problem`], which becomes one of the case's reasons).

use std::path::PathBuf;

use pdkv_deploy::DeployError;

/// Why the matrix could not run (a case that ran and failed is not an
/// error: it is in the [`crate::MatrixReport`]).
#[derive(Debug, thiserror::Error)]
pub enum LifecycleError {
    #[error("unknown case `{0}` (`pdkv lifecycle --list` shows the cases)")]
    UnknownCase(String),
    #[error("--cases names no case")]
    NoCase,
    /// An option out of its range, with the rule it breaks.
    #[error("{0}")]
    BadOption(&'static str),
    #[error("finding {}", path.display())]
    Model {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error(transparent)]
    Deploy(#[from] DeployError),
    #[error("building the HTTP client")]
    Client(#[source] reqwest::Error),
    #[error("baseline probe {index}: {reason}")]
    BaselineProbe { index: usize, reason: String },
    /// The baseline or a case could not measure what it needs.
    #[error(transparent)]
    Call(#[from] CallError),
    #[error(transparent)]
    Problem(#[from] Problem),
    #[error("case {name} cycle {cycle}")]
    Case {
        name: String,
        cycle: usize,
        #[source]
        source: Box<LifecycleError>,
    },
}

/// Why a call to P, D or the proxy gave no usable answer. The texts are a
/// case's reasons as the report shows them.
#[derive(Debug, thiserror::Error)]
pub enum CallError {
    #[error("{what}: {cause}")]
    Send { what: String, cause: reqwest::Error },
    #[error("{what}: reading the body: {cause}")]
    Body { what: String, cause: reqwest::Error },
    #[error("{what} answered {status}: {body}")]
    Status {
        what: String,
        status: reqwest::StatusCode,
        body: String,
    },
    #[error("{what} answered {status}")]
    Refused {
        what: String,
        status: reqwest::StatusCode,
    },
    #[error("{what}: not JSON ({cause}): {text}")]
    NotJson {
        what: String,
        cause: serde_json::Error,
        text: String,
    },
    #[error("{role} exports no {metric}")]
    NoMetric { role: &'static str, metric: String },
    #[error("no {0} in the metrics")]
    NoCounter(&'static str),
    #[error("admin task: {0}")]
    Task(tokio::task::JoinError),
}

/// Why a check of a case failed: a call gave no usable answer, or an
/// answer or a measurement is not what the case requires.
#[derive(Debug, thiserror::Error)]
pub enum Problem {
    #[error(transparent)]
    Call(#[from] CallError),
    #[error("{0}")]
    Unexpected(String),
}
