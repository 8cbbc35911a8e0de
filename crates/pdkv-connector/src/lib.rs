//! KV connectors for prefill/decode disaggregation, built on `pdkv-transfer`.
//!
//! [`build`] turns a `--kv-transfer-config` JSON ([`config`]) into the P/D
//! connector ([`pd::PdConnector`]), which speaks the control protocol of
//! [`wire`], reads and writes `kv_transfer_params` through [`params`] (the
//! one module that spells their keys), and decides in sans-IO machines:
//! the prefill side's [`send::SendMachine`], the decode side's
//! [`recv::RecvMachine`], glued by [`pd::core::PdCore`]. Two more
//! connectors share the same entry point:
//! the host-memory offload tier ([`offload::OffloadConnector`],
//! `"kv_connector": "offload"`) and the multi-connector that combines
//! several ([`multi::MultiConnector`], `"kv_connector": "multi"`).

pub mod config;
pub mod multi;
pub mod offload;
pub mod params;
pub mod pd;
pub mod recv;
pub mod send;
pub mod wire;

use pdkv_engine::KvConnector;

use crate::config::KvTransferConfig;

/// Builds the connector a `--kv-transfer-config` JSON asks for. A bad
/// configuration is refused with a message naming the bad field.
pub fn build(config_json: &str, engine_id: &str) -> anyhow::Result<Box<dyn KvConnector>> {
    // The offload and multi connectors have configurations of their own.
    let kind = serde_json::from_str::<serde_json::Value>(config_json)
        .ok()
        .and_then(|v| v.get("kv_connector").and_then(|k| k.as_str()).map(str::to_string));
    match kind.as_deref() {
        Some(offload::CONNECTOR_NAME) => {
            check_engine_id(engine_id)?;
            let cfg = offload::OffloadConfig::parse(config_json)?;
            return Ok(Box::new(offload::OffloadConnector::new(cfg, engine_id)));
        }
        Some(multi::CONNECTOR_NAME) => {
            check_engine_id(engine_id)?;
            return Ok(Box::new(multi::MultiConnector::from_json(config_json, engine_id)?));
        }
        _ => {}
    }
    let cfg = KvTransferConfig::parse(config_json)?;
    check_engine_id(engine_id)?;
    Ok(Box::new(pd::PdConnector::new(cfg, engine_id)?))
}

fn check_engine_id(engine_id: &str) -> anyhow::Result<()> {
    anyhow::ensure!(
        !engine_id.is_empty() && engine_id.chars().all(|c| c.is_ascii_alphanumeric() || "-_.".contains(c)),
        "engine id {engine_id:?} must be non-empty and use only letters, digits, '-', '_' and '.'"
    );
    Ok(())
}
