//! `--kv-transfer-config`: the JSON that selects and tunes the P/D connector.
//!
//! Parsing is strict: unknown fields are refused, and every error names the
//! field it is about (`kv_transfer_config: <field>: <why>`), so an operator
//! sees at once which part of the configuration to fix. Cross-field rules
//! (`load_timeout_s > abort_timeout_s`, positive durations) are checked after
//! the fields parsed.

use crate::peers::KvPeers;
use std::path::PathBuf;
use std::time::Duration;

use pdkv_engine::LoadFailurePolicy;
use pdkv_transfer::auth::KvSecret;
use serde::de::DeserializeOwned;
use serde::Deserialize;

/// A configuration refused, naming the field.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("kv_transfer_config: {field}: {message}")]
pub struct ConfigError {
    /// The field concerned (`.` when the document itself is malformed).
    pub field: String,
    pub message: String,
}

impl ConfigError {
    fn new(field: impl Into<String>, message: impl Into<String>) -> ConfigError {
        ConfigError {
            field: field.into(),
            message: message.into(),
        }
    }
}

/// Which side(s) of a P/D pair this engine plays.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Deserialize, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub enum KvRole {
    /// Prefill: computes prompts and sends their KV.
    KvProducer,
    /// Decode: receives KV and generates.
    KvConsumer,
    /// Both.
    KvBoth,
}

impl KvRole {
    pub fn as_str(self) -> &'static str {
        match self {
            KvRole::KvProducer => "kv_producer",
            KvRole::KvConsumer => "kv_consumer",
            KvRole::KvBoth => "kv_both",
        }
    }

    /// Whether this engine receives KV (and so registers a destination).
    pub fn consumes(self) -> bool {
        matches!(self, KvRole::KvConsumer | KvRole::KvBoth)
    }

    /// Whether this engine sends KV.
    pub fn produces(self) -> bool {
        matches!(self, KvRole::KvProducer | KvRole::KvBoth)
    }
}

/// How KV bytes move between the engines.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default, Deserialize, serde::Serialize)]
#[cfg_attr(feature = "clap", derive(clap::ValueEnum))]
#[serde(rename_all = "snake_case")]
pub enum Transport {
    /// The `pdkv-transfer` TCP agent (any two hosts).
    #[default]
    Tcp,
    /// Shared memory over a Unix socket (same host).
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

/// Who moves the bytes.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default, Deserialize, serde::Serialize)]
#[cfg_attr(feature = "clap", derive(clap::ValueEnum))]
#[serde(rename_all = "snake_case")]
pub enum TransferMode {
    /// The producer writes into the consumer's blocks (the consumer pulls).
    #[default]
    Write,
    /// The consumer reads the producer's leased blocks.
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

/// The fields as written, before defaults and cross-field checks.
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct Raw {
    kv_connector: String,
    kv_role: KvRole,
    #[serde(default)]
    transport: Transport,
    #[serde(default)]
    transfer_mode: TransferMode,
    kv_ip: Option<String>,
    #[serde(default)]
    kv_port: u16,
    num_workers: Option<usize>,
    abort_timeout_s: Option<f64>,
    load_timeout_s: Option<f64>,
    arrival_timeout_s: Option<f64>,
    prefill_timeout_s: Option<f64>,
    heartbeat_s: Option<f64>,
    kv_unproven_timeout_s: Option<f64>,
    #[serde(default)]
    kv_load_failure_policy: LoadFailurePolicy,
    shm_dir: Option<PathBuf>,
    reclaim_held_kv: Option<bool>,
    kv_peers: Option<Vec<String>>,
}

/// A checked connector configuration.
#[derive(Clone, Debug, PartialEq)]
pub struct KvTransferConfig {
    pub kv_connector: String,
    pub kv_role: KvRole,
    pub transport: Transport,
    pub transfer_mode: TransferMode,
    /// The address the control listener and the TCP agent bind to and advertise.
    pub kv_ip: String,
    /// The control (bootstrap) port; 0 picks a free one.
    pub kv_port: u16,
    /// The producer's concurrent senders.
    pub num_workers: usize,
    /// The producer's deadline for a pull's write (from when the KV is
    /// ready) and the lease of blocks held for a consumer.
    pub abort_timeout: Duration,
    /// The consumer gives up a load this long after it last heard from the
    /// producer; longer than `abort_timeout`.
    pub load_timeout: Duration,
    /// How long the producer keeps a pull for a transfer it has not seen yet.
    pub arrival_timeout: Duration,
    /// The longest a pull waits for the producer to finish computing the
    /// prompt (a long prompt takes long; the pull waits, not fails).
    pub prefill_timeout: Duration,
    /// How often a waiting pull hears from the producer; shorter than
    /// `load_timeout`.
    pub heartbeat: Duration,
    /// How long a KV port keeps a connection that has not proven itself
    /// (the transfer port: its handshake and each frame until an access
    /// the registry accepts; the control port: its handshake and first
    /// message, at most its 5 s I/O bound).
    pub unproven_timeout: Duration,
    pub kv_load_failure_policy: LoadFailurePolicy,
    /// A producer whose every block is held for transfers no consumer took
    /// yet gives some back for new prompts (`true`, the default; the
    /// consumers recompute those), or holds them until they are taken or
    /// their leases end (`false`).
    pub reclaim_held_kv: bool,
    /// A consumer connects for KV only to these peers (`None`: any); see
    /// [`crate::peers`].
    pub kv_peers: Option<KvPeers>,
    /// Where a consumer's shared-memory socket lives.
    pub shm_dir: PathBuf,
    /// The deployment's KV secret, proven by both ends of every KV
    /// connection ([`pdkv_transfer::auth`]). Never part of the JSON (which
    /// shows up in process lists and logs): `pdkv serve` takes it from
    /// `--kv-secret` / `PDKV_KV_SECRET`. Open when unset.
    pub kv_secret: KvSecret,
}

/// The one connector name this crate serves.
pub const CONNECTOR_NAME: &str = "pdkv";

fn seconds(field: &str, v: f64) -> Result<Duration, ConfigError> {
    if !v.is_finite() || v <= 0.0 || v > 1e9 {
        return Err(ConfigError::new(
            field,
            format!("must be a positive number of seconds, got {v}"),
        ));
    }
    Ok(Duration::from_secs_f64(v))
}

/// serde_json's message without its " at line L column C" suffix.
fn strip_position(e: &serde_json::Error) -> String {
    let s = e.to_string();
    let tail = format!(" at line {} column {}", e.line(), e.column());
    s.strip_suffix(&tail).map(str::to_string).unwrap_or(s)
}

/// Deserializes `json` strictly into `T`; the error names the field at
/// fault (a missing or unknown field by its own name).
pub(crate) fn parse_fields<T: DeserializeOwned>(json: &str) -> Result<T, ConfigError> {
    let de = &mut serde_json::Deserializer::from_str(json);
    serde_path_to_error::deserialize(de).map_err(|e| {
        let mut field = e.path().to_string();
        let message = strip_position(e.inner());
        if field == "." {
            for lead in ["missing field `", "unknown field `"] {
                if let Some(name) = message.strip_prefix(lead).and_then(|r| r.split('`').next()) {
                    field = name.to_string();
                }
            }
        }
        ConfigError { field, message }
    })
}

impl KvTransferConfig {
    /// Parses and checks a configuration; the error names the bad field.
    pub fn parse(json: &str) -> Result<KvTransferConfig, ConfigError> {
        let raw: Raw = parse_fields(json)?;
        if raw.kv_connector != CONNECTOR_NAME {
            return Err(ConfigError::new(
                "kv_connector",
                format!(
                    "unknown connector {:?}; this build offers {CONNECTOR_NAME:?}",
                    raw.kv_connector
                ),
            ));
        }
        let kv_ip = raw.kv_ip.unwrap_or_else(|| "127.0.0.1".to_string());
        if kv_ip.parse::<std::net::IpAddr>().is_err() {
            return Err(ConfigError::new(
                "kv_ip",
                format!("{kv_ip:?} is not an IP address"),
            ));
        }
        let num_workers = raw.num_workers.unwrap_or(4);
        if num_workers == 0 {
            return Err(ConfigError::new("num_workers", "must be at least 1"));
        }
        let kv_peers = match &raw.kv_peers {
            None => None,
            Some(list) => Some(
                KvPeers::parse(list).map_err(|e| ConfigError::new("kv_peers", e.to_string()))?,
            ),
        };
        let abort_s = raw.abort_timeout_s.unwrap_or(30.0);
        let abort_timeout = seconds("abort_timeout_s", abort_s)?;
        let load_s = raw.load_timeout_s.unwrap_or(abort_s + 10.0);
        let load_timeout = seconds("load_timeout_s", load_s)?;
        if load_timeout <= abort_timeout {
            return Err(ConfigError::new(
                "load_timeout_s",
                format!(
                    "load_timeout_s ({load_s}) must be greater than abort_timeout_s ({abort_s})"
                ),
            ));
        }
        let arrival_timeout = seconds("arrival_timeout_s", raw.arrival_timeout_s.unwrap_or(10.0))?;
        let prefill_timeout = seconds("prefill_timeout_s", raw.prefill_timeout_s.unwrap_or(600.0))?;
        let beat_s = raw.heartbeat_s.unwrap_or(2.0_f64.min(load_s / 4.0));
        let heartbeat = seconds("heartbeat_s", beat_s)?;
        if heartbeat >= load_timeout {
            return Err(ConfigError::new(
                "heartbeat_s",
                format!("heartbeat_s ({beat_s}) must be less than load_timeout_s ({load_s})"),
            ));
        }
        let unproven_timeout = seconds(
            "kv_unproven_timeout_s",
            raw.kv_unproven_timeout_s.unwrap_or(10.0),
        )?;
        Ok(KvTransferConfig {
            kv_connector: raw.kv_connector,
            kv_role: raw.kv_role,
            transport: raw.transport,
            transfer_mode: raw.transfer_mode,
            kv_ip,
            kv_port: raw.kv_port,
            num_workers,
            abort_timeout,
            load_timeout,
            arrival_timeout,
            prefill_timeout,
            heartbeat,
            unproven_timeout,
            kv_load_failure_policy: raw.kv_load_failure_policy,
            reclaim_held_kv: raw.reclaim_held_kv.unwrap_or(true),
            kv_peers,
            shm_dir: raw.shm_dir.unwrap_or_else(std::env::temp_dir),
            kv_secret: KvSecret::open(),
        })
    }
}
