//! Why a deployment could not be started or kept running.

use std::path::PathBuf;
use std::process::ExitStatus;

#[derive(Debug, thiserror::Error)]
pub enum DeployError {
    #[error(
        "port {port} ({flag}) is not free: {source}; choose another with {flag} (0: any free port)"
    )]
    PortTaken {
        port: u16,
        flag: &'static str,
        #[source]
        source: std::io::Error,
    },
    #[error("creating {}", path.display())]
    LogFile {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("starting the {name} ({})", exe.display())]
    Spawn {
        name: String,
        exe: PathBuf,
        #[source]
        source: std::io::Error,
    },
    /// A child exited while the deployment needed it.
    #[error("the {name} exited early ({status}); its last log lines:\n{tail}")]
    Exited {
        name: String,
        status: ExitStatus,
        tail: String,
    },
    #[error("not healthy within the start-up timeout: {}", waiting.join(", "))]
    NotHealthy { waiting: Vec<String> },
    #[error("{what} ports from {first} run past 65535")]
    PortsPastEnd { what: &'static str, first: u16 },
    #[error(
        "port {port} would be used twice (proxy {proxy}, prefill {prefill:?}, decode {decode:?}, KV {kv:?})"
    )]
    PortTwice {
        port: u16,
        proxy: u16,
        prefill: Vec<u16>,
        decode: Vec<u16>,
        kv: Vec<u16>,
    },
    #[error("making the deployment's KV secret")]
    Secret(#[source] std::io::Error),
    #[error("building the HTTP client")]
    Client(#[source] reqwest::Error),
    #[error("asking {url} for its KV bootstrap address")]
    BootstrapAsk {
        url: String,
        #[source]
        source: reqwest::Error,
    },
    #[error("reading {url}'s /kv_transfer/info")]
    BootstrapBody {
        url: String,
        #[source]
        source: reqwest::Error,
    },
    #[error("{url}'s /kv_transfer/info names no bootstrap port: {info}")]
    NoBootstrapPort {
        url: String,
        info: serde_json::Value,
    },
}
