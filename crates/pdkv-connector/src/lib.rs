//! KV connectors for prefill/decode disaggregation, built on `pdkv-transfer`.
//!
//! [`build`] turns a `--kv-transfer-config` JSON ([`config`]) into the P/D
//! connector ([`pd::PdConnector`]), which speaks the control protocol of
//! [`wire`], reads and writes `kv_transfer_params` through [`params`] (the
//! one module that spells their keys), and decides in sans-IO machines:
//! the prefill side's [`send::SendMachine`], the decode side's
//! [`recv::RecvMachine`] (what it takes and gives in [`load`]), glued by
//! [`pd::core::PdCore`]. Two more
//! connectors share the same entry point:
//! the host-memory offload tier ([`offload::OffloadConnector`],
//! `"kv_connector": "offload"`) and the multi-connector that combines
//! several ([`multi::MultiConnector`], `"kv_connector": "multi"`).

pub mod claims;
pub mod config;
pub mod load;
pub mod multi;
pub mod offload;
pub mod params;
pub mod pd;
pub mod peers;
pub mod ranks;
pub mod recv;
pub mod send;
pub mod wire;

use pdkv_engine::KvConnector;

use crate::config::KvTransferConfig;

/// Builds the connector a `--kv-transfer-config` JSON asks for. A bad
/// configuration is refused with a message naming the bad field.
/// The deployment's KV secret ([`pdkv_transfer::auth`]).
pub use pdkv_transfer::auth::KvSecret;

pub fn build(config_json: &str, engine_id: &str) -> anyhow::Result<Box<dyn KvConnector>> {
    build_with_secret(
        config_json,
        engine_id,
        &pdkv_transfer::auth::KvSecret::open(),
    )
}

/// [`build`], with the deployment's KV secret for every P/D connector in
/// it (a multi-connector's children included).
pub fn build_with_secret(
    config_json: &str,
    engine_id: &str,
    secret: &pdkv_transfer::auth::KvSecret,
) -> anyhow::Result<Box<dyn KvConnector>> {
    // The offload and multi connectors have configurations of their own.
    let kind = serde_json::from_str::<serde_json::Value>(config_json)
        .ok()
        .and_then(|v| {
            v.get("kv_connector")
                .and_then(|k| k.as_str())
                .map(str::to_string)
        });
    match kind.as_deref() {
        Some(offload::CONNECTOR_NAME) => {
            check_engine_id(engine_id)?;
            let cfg = offload::OffloadConfig::parse(config_json)?;
            return Ok(Box::new(offload::OffloadConnector::new(cfg, engine_id)));
        }
        Some(multi::CONNECTOR_NAME) => {
            check_engine_id(engine_id)?;
            return Ok(Box::new(multi::MultiConnector::from_json(
                config_json,
                engine_id,
                secret,
            )?));
        }
        _ => {}
    }
    let mut cfg = KvTransferConfig::parse(config_json)?;
    cfg.kv_secret = secret.clone();
    check_engine_id(engine_id)?;
    Ok(Box::new(pd::PdConnector::new(cfg, engine_id)?))
}

fn check_engine_id(engine_id: &str) -> anyhow::Result<()> {
    anyhow::ensure!(
        !engine_id.is_empty()
            && engine_id
                .chars()
                .all(|c| c.is_ascii_alphanumeric() || "-_.".contains(c)),
        "engine id {engine_id:?} must be non-empty and use only letters, digits, '-', '_' and '.'"
    );
    Ok(())
}
