//! KV connectors for prefill/decode disaggregation, built on `pdkv-transfer`.
//!
//! [`build`] turns a `--kv-transfer-config` JSON ([`config`]) into the P/D
//! connector ([`pd::PdConnector`]), which speaks the control protocol of
//! [`wire`] and keeps the prefill side's sending state in the sans-IO
//! [`send::SendMachine`].

pub mod config;
pub mod pd;
pub mod send;
pub mod wire;

use pdkv_engine::KvConnector;

use crate::config::{KvTransferConfig, TransferMode};

/// Builds the connector a `--kv-transfer-config` JSON asks for. A bad
/// configuration is refused with a message naming the bad field.
pub fn build(config_json: &str, engine_id: &str) -> anyhow::Result<Box<dyn KvConnector>> {
    let cfg = KvTransferConfig::parse(config_json)?;
    if cfg.transfer_mode == TransferMode::Read {
        anyhow::bail!("kv_transfer_config: transfer_mode: transfer_mode \"read\" is not available yet; use \"write\"");
    }
    anyhow::ensure!(
        !engine_id.is_empty() && engine_id.chars().all(|c| c.is_ascii_alphanumeric() || "-_.".contains(c)),
        "engine id {engine_id:?} must be non-empty and use only letters, digits, '-', '_' and '.'"
    );
    Ok(Box::new(pd::PdConnector::new(cfg, engine_id)?))
}
