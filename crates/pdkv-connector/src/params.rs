//! `kv_transfer_params`: the per-request JSON object that tells an engine
//! its part in a P/D transfer. A proxy (pdkv's own, or a router) puts it on
//! the request it sends P and the one it sends D; P returns one on its last
//! output, which read mode copies into D's request.
//!
//! This is the only module that spells the keys. The connector parses with
//! [`PdParams::parse`], the proxy builds with [`for_prefill`] and
//! [`for_decode`], and P's answer is built by [`returned_by_prefill`], so a
//! key cannot drift between the side that writes it and the side that reads
//! it.

use std::net::SocketAddr;

use serde_json::{json, Map, Value};

/// To P: compute the prompt and keep its KV for a decode engine.
pub const DO_REMOTE_DECODE: &str = "do_remote_decode";
/// To D: the prompt's KV comes from a prefill engine.
pub const DO_REMOTE_PREFILL: &str = "do_remote_prefill";
/// Names the transfer on both sides (the proxy draws it per request).
pub const TRANSFER_ID: &str = "transfer_id";
/// P's engine id, which D checks against P's bootstrap answer.
pub const REMOTE_ENGINE_ID: &str = "remote_engine_id";
/// P's control listener (`ip:port`): bootstrap, pulls, drops.
pub const REMOTE_BOOTSTRAP_ADDR: &str = "remote_bootstrap_addr";
/// Read mode: P's leased blocks holding the prompt's KV, in order.
pub const REMOTE_BLOCK_IDS: &str = "remote_block_ids";
/// Read mode: P's registration epoch when it leased the blocks.
pub const REMOTE_REGISTRATION_GENERATION: &str = "remote_registration_generation";
/// The prompt length P computed (informational).
pub const REMOTE_NUM_TOKENS: &str = "remote_num_tokens";
/// Read mode: the weights version P computed the KV with (`null`: the
/// weights it started with); D reads only KV of the weights it serves.
pub const REMOTE_WEIGHTS_VERSION: &str = "remote_weights_version";

/// The params a proxy puts on P's request.
pub fn for_prefill(transfer_id: &str) -> Value {
    json!({ DO_REMOTE_DECODE: true, TRANSFER_ID: transfer_id })
}

/// The params a proxy puts on D's request in write mode: P's engine id and
/// bootstrap address as P's `/kv_transfer/info` said (absent when unknown;
/// D then refuses the request naming the missing key).
pub fn for_decode(transfer_id: &str, remote_engine_id: Option<&str>, remote_bootstrap_addr: Option<&str>) -> Value {
    let mut p = json!({ DO_REMOTE_PREFILL: true, TRANSFER_ID: transfer_id });
    if let Some(e) = remote_engine_id {
        p[REMOTE_ENGINE_ID] = json!(e);
    }
    if let Some(a) = remote_bootstrap_addr {
        p[REMOTE_BOOTSTRAP_ADDR] = json!(a);
    }
    p
}

/// The params P returns on a request's last output: what D needs to load
/// the KV (`read` adds the leased blocks and P's registration epoch).
pub fn returned_by_prefill(
    transfer_id: &str,
    engine_id: &str,
    bootstrap_addr: &str,
    prompt_len: usize,
    read: Option<&ReadParams>,
) -> Value {
    let mut p = json!({
        DO_REMOTE_PREFILL: true,
        REMOTE_ENGINE_ID: engine_id,
        REMOTE_BOOTSTRAP_ADDR: bootstrap_addr,
        TRANSFER_ID: transfer_id,
        REMOTE_NUM_TOKENS: prompt_len,
    });
    if let Some(r) = read {
        p[REMOTE_BLOCK_IDS] = json!(r.block_ids);
        p[REMOTE_REGISTRATION_GENERATION] = json!(r.generation);
        p[REMOTE_WEIGHTS_VERSION] = json!(r.weights_version);
    }
    p
}

/// A request's `kv_transfer_params`, as the connector reads them.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum PdParams {
    /// To P: compute the prompt and hold its KV for D.
    RemoteDecode { transfer_id: String },
    /// To D: load the prompt's KV from P; `read` set in read mode.
    RemotePrefill {
        transfer_id: String,
        remote_engine_id: String,
        remote_bootstrap_addr: String,
        read: Option<ReadParams>,
    },
}

/// Read mode: what D reads from P.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ReadParams {
    /// P's blocks holding tokens `0..prompt_len-1`, in order.
    pub block_ids: Vec<u32>,
    /// P's registration epoch when it leased them.
    pub generation: u64,
    /// The weights P computed the KV with.
    pub weights_version: Option<String>,
}

type Obj = Map<String, Value>;

fn read_params(obj: &Obj) -> Result<Option<ReadParams>, String> {
    let ids = match obj.get(REMOTE_BLOCK_IDS) {
        None | Some(Value::Null) => return Ok(None),
        Some(Value::Array(a)) => a,
        Some(v) => return Err(format!("kv_transfer_params.{REMOTE_BLOCK_IDS} must be an array of block ids, got {v}")),
    };
    let block_ids = ids
        .iter()
        .map(|v| v.as_u64().and_then(|b| u32::try_from(b).ok()))
        .collect::<Option<Vec<u32>>>()
        .ok_or_else(|| format!("kv_transfer_params.{REMOTE_BLOCK_IDS} must hold block ids (integers from 0 to 2^32-1)"))?;
    let generation = match obj.get(REMOTE_REGISTRATION_GENERATION) {
        Some(v) => v.as_u64().ok_or_else(|| {
            format!("kv_transfer_params.{REMOTE_REGISTRATION_GENERATION} must be a non-negative integer, got {v}")
        })?,
        None => {
            return Err(format!(
                "kv_transfer_params.{REMOTE_REGISTRATION_GENERATION} is required with {REMOTE_BLOCK_IDS}"
            ))
        }
    };
    let weights_version = match obj.get(REMOTE_WEIGHTS_VERSION) {
        None | Some(Value::Null) => None,
        Some(Value::String(v)) => Some(v.clone()),
        Some(v) => return Err(format!("kv_transfer_params.{REMOTE_WEIGHTS_VERSION} must be a string or null, got {v}")),
    };
    Ok(Some(ReadParams { block_ids, generation, weights_version }))
}

fn flag(obj: &Obj, name: &str) -> Result<bool, String> {
    match obj.get(name) {
        None | Some(Value::Null) => Ok(false),
        Some(Value::Bool(b)) => Ok(*b),
        Some(v) => Err(format!("kv_transfer_params.{name} must be a boolean, got {v}")),
    }
}

fn text(obj: &Obj, name: &str) -> Result<String, String> {
    match obj.get(name) {
        Some(Value::String(s)) if !s.is_empty() => Ok(s.clone()),
        Some(Value::String(_)) => Err(format!("kv_transfer_params.{name} must not be empty")),
        None | Some(Value::Null) => Err(format!("kv_transfer_params.{name} is required")),
        Some(v) => Err(format!("kv_transfer_params.{name} must be a string, got {v}")),
    }
}

impl PdParams {
    /// Reads the params; `Ok(None)` when they ask for no transfer.
    pub fn parse(params: Option<&Value>) -> Result<Option<PdParams>, String> {
        let Some(v) = params else { return Ok(None) };
        if v.is_null() {
            return Ok(None);
        }
        let obj = v.as_object().ok_or_else(|| format!("kv_transfer_params must be a JSON object, got {v}"))?;
        let decode = flag(obj, DO_REMOTE_DECODE)?;
        let prefill = flag(obj, DO_REMOTE_PREFILL)?;
        match (decode, prefill) {
            (true, true) => Err(format!("kv_transfer_params: {DO_REMOTE_DECODE} and {DO_REMOTE_PREFILL} are both set")),
            (true, false) => Ok(Some(PdParams::RemoteDecode { transfer_id: text(obj, TRANSFER_ID)? })),
            (false, true) => {
                let remote_engine_id = text(obj, REMOTE_ENGINE_ID)?;
                let remote_bootstrap_addr = text(obj, REMOTE_BOOTSTRAP_ADDR)?;
                if remote_bootstrap_addr.parse::<SocketAddr>().is_err() {
                    return Err(format!(
                        "kv_transfer_params.{REMOTE_BOOTSTRAP_ADDR} {remote_bootstrap_addr:?} is not an ip:port address"
                    ));
                }
                Ok(Some(PdParams::RemotePrefill {
                    transfer_id: text(obj, TRANSFER_ID)?,
                    remote_engine_id,
                    remote_bootstrap_addr,
                    read: read_params(obj)?,
                }))
            }
            (false, false) => Ok(None),
        }
    }

    pub fn transfer_id(&self) -> &str {
        match self {
            PdParams::RemoteDecode { transfer_id } | PdParams::RemotePrefill { transfer_id, .. } => transfer_id,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn what_the_builders_write_the_parser_reads() {
        assert_eq!(
            PdParams::parse(Some(&for_prefill("t"))).unwrap(),
            Some(PdParams::RemoteDecode { transfer_id: "t".into() })
        );
        let d = for_decode("t", Some("p0"), Some("127.0.0.1:9"));
        assert_eq!(
            PdParams::parse(Some(&d)).unwrap(),
            Some(PdParams::RemotePrefill {
                transfer_id: "t".into(),
                remote_engine_id: "p0".into(),
                remote_bootstrap_addr: "127.0.0.1:9".into(),
                read: None
            })
        );
        let read = ReadParams { block_ids: vec![3, 4], generation: 2, weights_version: Some("v7".into()) };
        let back = returned_by_prefill("t", "p0", "127.0.0.1:9", 30, Some(&read));
        match PdParams::parse(Some(&back)).unwrap() {
            Some(PdParams::RemotePrefill { read: Some(r), .. }) => assert_eq!(r, read),
            other => panic!("{other:?}"),
        }
        assert_eq!(back[REMOTE_NUM_TOKENS], 30);
    }

    #[test]
    fn bad_params_name_the_key() {
        let cases = [
            (json!({"do_remote_decode": true}), "transfer_id is required"),
            (json!({"do_remote_decode": 1, "transfer_id": "t"}), "do_remote_decode must be a boolean"),
            (json!({"do_remote_decode": true, "do_remote_prefill": true}), "both set"),
            (for_decode("t", None, Some("127.0.0.1:9")), "remote_engine_id is required"),
            (for_decode("t", Some("p"), Some("nowhere")), "not an ip:port"),
            (json!([1]), "must be a JSON object"),
        ];
        for (v, needle) in cases {
            let e = PdParams::parse(Some(&v)).unwrap_err();
            assert!(e.contains(needle), "{e:?} lacks {needle:?}");
        }
        let mut d = for_decode("t", Some("p"), Some("127.0.0.1:9"));
        d[REMOTE_BLOCK_IDS] = json!([1, 2]);
        assert!(PdParams::parse(Some(&d)).unwrap_err().contains("remote_registration_generation is required"));
        d[REMOTE_BLOCK_IDS] = json!([-1]);
        d[REMOTE_REGISTRATION_GENERATION] = json!(1);
        assert!(PdParams::parse(Some(&d)).unwrap_err().contains("block ids"));
        assert_eq!(PdParams::parse(None).unwrap(), None);
        assert_eq!(PdParams::parse(Some(&json!({}))).unwrap(), None);
    }
}
