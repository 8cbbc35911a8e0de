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
//!
//! Third-party routers speak two other dialects, which [`canonical`] maps
//! onto pdkv's before anything parses them (the server calls it when a
//! request arrives, knowing the request's id):
//! - *read-mode routers* (vLLM's NIXL shape) send P no transfer id, so P
//!   names the transfer after its own request id and returns it as
//!   `remote_request_id`, with its control address split into `remote_host`
//!   and `remote_port`; the router copies P's answer verbatim into D's
//!   request, where those keys stand for `transfer_id` and
//!   `remote_bootstrap_addr`.
//! - *write-mode routers* (vLLM's Mooncake shape) learn P's engine id from
//!   `GET /query` on P's bootstrap port (pdkv's control listener answers it)
//!   and send D `remote_bootstrap_addr` as a URL, `http://HOST:PORT`.

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

/// Read-mode routers: P's request id, which names the transfer when the
/// router sent none.
pub const REMOTE_REQUEST_ID: &str = "remote_request_id";
/// Read-mode routers: the host of P's control listener.
pub const REMOTE_HOST: &str = "remote_host";
/// Read-mode routers: the port of P's control listener.
pub const REMOTE_PORT: &str = "remote_port";
/// Read-mode routers: P's tensor-parallel size (pdkv engines are TP 1).
pub const TP_SIZE: &str = "tp_size";
/// Output token ids the request already produced on an engine that failed
/// (a list of integers): the engine that gets it computes their KV with the
/// prompt's and continues after them (pdkv's own key; the proxy's request
/// migration sends it, a router may too).
pub const RESUME_TOKEN_IDS: &str = "resume_token_ids";

/// Maps a router's dialect onto pdkv's keys (see the module docs), for a
/// request this engine names `request_id`. Keys already in pdkv's shape win;
/// anything that is not an object is returned as it came (the parser
/// refuses it with its reason).
pub fn canonical(mut params: Value, request_id: &str) -> Value {
    let Some(obj) = params.as_object_mut() else {
        return params;
    };
    let set = |obj: &Obj, k: &str| obj.get(k).is_some_and(|v| !v.is_null());
    if obj.get(DO_REMOTE_DECODE) == Some(&Value::Bool(true)) && !set(obj, TRANSFER_ID) {
        obj.insert(TRANSFER_ID.into(), json!(request_id));
    }
    if obj.get(DO_REMOTE_PREFILL) == Some(&Value::Bool(true)) {
        if !set(obj, TRANSFER_ID) {
            if let Some(id) = obj
                .get(REMOTE_REQUEST_ID)
                .filter(|v| v.is_string())
                .cloned()
            {
                obj.insert(TRANSFER_ID.into(), id);
            }
        }
        match obj.get(REMOTE_BOOTSTRAP_ADDR) {
            Some(Value::String(url)) => {
                if let Some(rest) = url.strip_prefix("http://") {
                    let addr = rest.trim_end_matches('/').to_string();
                    obj.insert(REMOTE_BOOTSTRAP_ADDR.into(), json!(addr));
                }
            }
            None | Some(Value::Null) => {
                if let (Some(Value::String(host)), Some(port)) = (
                    obj.get(REMOTE_HOST),
                    obj.get(REMOTE_PORT).and_then(Value::as_u64),
                ) {
                    let addr = join_host_port(host, port);
                    obj.insert(REMOTE_BOOTSTRAP_ADDR.into(), json!(addr));
                }
            }
            Some(_) => {}
        }
    }
    params
}

/// `host:port`, with an IPv6 literal in brackets.
fn join_host_port(host: &str, port: u64) -> String {
    if host.contains(':') && !host.starts_with('[') {
        format!("[{host}]:{port}")
    } else {
        format!("{host}:{port}")
    }
}

/// Splits `host:port` (a name, an IPv4 or a bracketed IPv6 literal, and a
/// port from 1 to 65535).
pub fn split_host_port(addr: &str) -> Option<(&str, u16)> {
    let (host, port) = addr.rsplit_once(':')?;
    let port: u16 = port.parse().ok().filter(|&p| p > 0)?;
    let bare = host
        .strip_prefix('[')
        .and_then(|h| h.strip_suffix(']'))
        .unwrap_or(host);
    let ok = if host.starts_with('[') {
        bare.parse::<std::net::Ipv6Addr>().is_ok()
    } else {
        !host.is_empty()
            && host
                .chars()
                .all(|c| c.is_ascii_alphanumeric() || c == '.' || c == '-' || c == '_')
    };
    ok.then_some((bare, port))
}

/// The params a proxy puts on P's request.
pub fn for_prefill(transfer_id: &str) -> Value {
    json!({ DO_REMOTE_DECODE: true, TRANSFER_ID: transfer_id })
}

/// The params a proxy puts on D's request in write mode: P's engine id and
/// bootstrap address as P's `/kv_transfer/info` said (absent when unknown;
/// D then refuses the request naming the missing key).
pub fn for_decode(
    transfer_id: &str,
    remote_engine_id: Option<&str>,
    remote_bootstrap_addr: Option<&str>,
) -> Value {
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
/// the KV (`read` adds the leased blocks and P's registration epoch). The
/// read-mode router keys (`remote_request_id`, `remote_host`,
/// `remote_port`) repeat the transfer id and the control address for
/// routers that copy them into D's request as they are; `tp_size` is P's
/// number of ranks (informational: D learns P's head split from the
/// handshake or the pull).
pub fn returned_by_prefill(
    transfer_id: &str,
    engine_id: &str,
    bootstrap_addr: &str,
    prompt_len: usize,
    tp_size: usize,
    read: Option<&ReadParams>,
) -> Value {
    let mut p = json!({
        DO_REMOTE_PREFILL: true,
        DO_REMOTE_DECODE: false,
        REMOTE_ENGINE_ID: engine_id,
        REMOTE_BOOTSTRAP_ADDR: bootstrap_addr,
        TRANSFER_ID: transfer_id,
        REMOTE_REQUEST_ID: transfer_id,
        REMOTE_NUM_TOKENS: prompt_len,
        TP_SIZE: tp_size,
    });
    if let Some((host, port)) = split_host_port(bootstrap_addr) {
        p[REMOTE_HOST] = json!(host);
        p[REMOTE_PORT] = json!(port);
    }
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

/// Why `kv_transfer_params` were refused; each names the key at fault.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum ParamsError {
    #[error("kv_transfer_params must be a JSON object, got {0}")]
    NotAnObject(Value),
    #[error("kv_transfer_params.{key} must be {want}, got {got}")]
    WrongType {
        key: &'static str,
        want: &'static str,
        got: Value,
    },
    #[error("kv_transfer_params.{0} must not be empty")]
    Empty(&'static str),
    #[error("kv_transfer_params.{0} is required")]
    Missing(&'static str),
    #[error("kv_transfer_params: {DO_REMOTE_DECODE} and {DO_REMOTE_PREFILL} are both set")]
    BothDirections,
    #[error("kv_transfer_params.{REMOTE_BOOTSTRAP_ADDR} {0:?} is not a host:port address")]
    NotHostPort(String),
    #[error(
        "kv_transfer_params.{REMOTE_BLOCK_IDS} must hold block ids (integers from 0 to 2^32-1)"
    )]
    BadBlockIds,
    #[error(
        "kv_transfer_params.{REMOTE_REGISTRATION_GENERATION} is required with {REMOTE_BLOCK_IDS}"
    )]
    NoGeneration,
    /// A bootstrap address outside the engine's `kv_peers`.
    #[error("kv_transfer_params.{REMOTE_BOOTSTRAP_ADDR} {addr:?} is not among this engine's kv_peers ({listed}); it opens no KV connection there")]
    NotAPeer { addr: String, listed: String },
    /// Params for a direction this engine's role does not serve.
    #[error("kv_transfer_params.{key}: this engine is a {role} and {does_not}")]
    WrongRole {
        key: &'static str,
        role: &'static str,
        does_not: &'static str,
    },
}

type Obj = Map<String, Value>;

fn read_params(obj: &Obj) -> Result<Option<ReadParams>, ParamsError> {
    let ids = match obj.get(REMOTE_BLOCK_IDS) {
        None | Some(Value::Null) => return Ok(None),
        Some(Value::Array(a)) => a,
        Some(v) => {
            return Err(ParamsError::WrongType {
                key: REMOTE_BLOCK_IDS,
                want: "an array of block ids",
                got: v.clone(),
            })
        }
    };
    let block_ids = ids
        .iter()
        .map(|v| v.as_u64().and_then(|b| u32::try_from(b).ok()))
        .collect::<Option<Vec<u32>>>()
        .ok_or(ParamsError::BadBlockIds)?;
    let generation = match obj.get(REMOTE_REGISTRATION_GENERATION) {
        Some(v) => v.as_u64().ok_or_else(|| ParamsError::WrongType {
            key: REMOTE_REGISTRATION_GENERATION,
            want: "a non-negative integer",
            got: v.clone(),
        })?,
        None => return Err(ParamsError::NoGeneration),
    };
    let weights_version = match obj.get(REMOTE_WEIGHTS_VERSION) {
        None | Some(Value::Null) => None,
        Some(Value::String(v)) => Some(v.clone()),
        Some(v) => {
            return Err(ParamsError::WrongType {
                key: REMOTE_WEIGHTS_VERSION,
                want: "a string or null",
                got: v.clone(),
            })
        }
    };
    Ok(Some(ReadParams {
        block_ids,
        generation,
        weights_version,
    }))
}

fn flag(obj: &Obj, name: &'static str) -> Result<bool, ParamsError> {
    match obj.get(name) {
        None | Some(Value::Null) => Ok(false),
        Some(Value::Bool(b)) => Ok(*b),
        Some(v) => Err(ParamsError::WrongType {
            key: name,
            want: "a boolean",
            got: v.clone(),
        }),
    }
}

fn text(obj: &Obj, name: &'static str) -> Result<String, ParamsError> {
    match obj.get(name) {
        Some(Value::String(s)) if !s.is_empty() => Ok(s.clone()),
        Some(Value::String(_)) => Err(ParamsError::Empty(name)),
        None | Some(Value::Null) => Err(ParamsError::Missing(name)),
        Some(v) => Err(ParamsError::WrongType {
            key: name,
            want: "a string",
            got: v.clone(),
        }),
    }
}

impl PdParams {
    /// Reads the params; `Ok(None)` when they ask for no transfer.
    pub fn parse(params: Option<&Value>) -> Result<Option<PdParams>, ParamsError> {
        let Some(v) = params else { return Ok(None) };
        if v.is_null() {
            return Ok(None);
        }
        let obj = v
            .as_object()
            .ok_or_else(|| ParamsError::NotAnObject(v.clone()))?;
        let decode = flag(obj, DO_REMOTE_DECODE)?;
        let prefill = flag(obj, DO_REMOTE_PREFILL)?;
        match (decode, prefill) {
            (true, true) => Err(ParamsError::BothDirections),
            (true, false) => Ok(Some(PdParams::RemoteDecode {
                transfer_id: text(obj, TRANSFER_ID)?,
            })),
            (false, true) => {
                let remote_engine_id = text(obj, REMOTE_ENGINE_ID)?;
                let remote_bootstrap_addr = text(obj, REMOTE_BOOTSTRAP_ADDR)?;
                if split_host_port(&remote_bootstrap_addr).is_none() {
                    return Err(ParamsError::NotHostPort(remote_bootstrap_addr));
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
            PdParams::RemoteDecode { transfer_id }
            | PdParams::RemotePrefill { transfer_id, .. } => transfer_id,
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
            Some(PdParams::RemoteDecode {
                transfer_id: "t".into()
            })
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
        let read = ReadParams {
            block_ids: vec![3, 4],
            generation: 2,
            weights_version: Some("v7".into()),
        };
        let back = returned_by_prefill("t", "p0", "127.0.0.1:9", 30, 2, Some(&read));
        match PdParams::parse(Some(&back)).unwrap() {
            Some(PdParams::RemotePrefill { read: Some(r), .. }) => assert_eq!(r, read),
            other => panic!("{other:?}"),
        }
        assert_eq!(back[REMOTE_NUM_TOKENS], 30);
        assert_eq!(back[TP_SIZE], 2, "P's ranks");
    }

    #[test]
    fn bad_params_name_the_key() {
        let cases = [
            (json!({"do_remote_decode": true}), "transfer_id is required"),
            (
                json!({"do_remote_decode": 1, "transfer_id": "t"}),
                "do_remote_decode must be a boolean",
            ),
            (
                json!({"do_remote_decode": true, "do_remote_prefill": true}),
                "both set",
            ),
            (
                for_decode("t", None, Some("127.0.0.1:9")),
                "remote_engine_id is required",
            ),
            (
                for_decode("t", Some("p"), Some("nowhere")),
                "not a host:port",
            ),
            (
                for_decode("t", Some("p"), Some("host:0")),
                "not a host:port",
            ),
            (for_decode("t", Some("p"), Some("a b:9")), "not a host:port"),
            (json!([1]), "must be a JSON object"),
        ];
        for (v, needle) in cases {
            let e = PdParams::parse(Some(&v)).unwrap_err().to_string();
            assert!(e.contains(needle), "{e:?} lacks {needle:?}");
        }
        let mut d = for_decode("t", Some("p"), Some("127.0.0.1:9"));
        d[REMOTE_BLOCK_IDS] = json!([1, 2]);
        assert!(PdParams::parse(Some(&d))
            .unwrap_err()
            .to_string()
            .contains("remote_registration_generation is required"));
        d[REMOTE_BLOCK_IDS] = json!([-1]);
        d[REMOTE_REGISTRATION_GENERATION] = json!(1);
        assert!(PdParams::parse(Some(&d))
            .unwrap_err()
            .to_string()
            .contains("block ids"));
        assert_eq!(PdParams::parse(None).unwrap(), None);
        assert_eq!(PdParams::parse(Some(&json!({}))).unwrap(), None);
    }

    /// The shapes vLLM-compatible routers send, after [`canonical`], read
    /// as pdkv's own.
    #[test]
    fn router_dialects_read_as_pdkv_params() {
        // Read mode: P gets no transfer id and names it after its request.
        let to_p = json!({"do_remote_decode": true, "do_remote_prefill": false, "remote_engine_id": null,
            "remote_block_ids": null, "remote_host": null, "remote_port": null});
        assert_eq!(
            PdParams::parse(Some(&canonical(to_p, "cmpl-7"))).unwrap(),
            Some(PdParams::RemoteDecode {
                transfer_id: "cmpl-7".into()
            })
        );
        // P's answer, copied verbatim to D with only the router keys kept.
        let read = ReadParams {
            block_ids: vec![5],
            generation: 3,
            weights_version: None,
        };
        let back = returned_by_prefill("cmpl-7", "p0", "10.0.0.5:7100", 20, 1, Some(&read));
        assert_eq!(
            (back[REMOTE_HOST].as_str(), back[REMOTE_PORT].as_u64()),
            (Some("10.0.0.5"), Some(7100))
        );
        let mut only_router_keys = back.clone();
        let o = only_router_keys.as_object_mut().unwrap();
        o.remove(TRANSFER_ID);
        o.remove(REMOTE_BOOTSTRAP_ADDR);
        for to_d in [back, only_router_keys] {
            let got = PdParams::parse(Some(&canonical(to_d, "d-req"))).unwrap();
            assert_eq!(
                got,
                Some(PdParams::RemotePrefill {
                    transfer_id: "cmpl-7".into(),
                    remote_engine_id: "p0".into(),
                    remote_bootstrap_addr: "10.0.0.5:7100".into(),
                    read: Some(read.clone()),
                })
            );
        }
        // Write mode: the bootstrap address comes as a URL.
        let to_d = json!({"do_remote_decode": false, "do_remote_prefill": true, "transfer_id": "xfer-1",
            "remote_bootstrap_addr": "http://prefill-0:7100", "remote_engine_id": "p0"});
        assert_eq!(
            PdParams::parse(Some(&canonical(to_d, "d-req"))).unwrap(),
            Some(PdParams::RemotePrefill {
                transfer_id: "xfer-1".into(),
                remote_engine_id: "p0".into(),
                remote_bootstrap_addr: "prefill-0:7100".into(),
                read: None,
            })
        );
        // pdkv's own keys win over the router's.
        let mine = canonical(
            json!({"do_remote_decode": true, "transfer_id": "t"}),
            "cmpl-8",
        );
        assert_eq!(mine[TRANSFER_ID], "t");
        // Not an object: left for the parser to refuse.
        assert_eq!(canonical(json!([1]), "x"), json!([1]));
        assert_eq!(split_host_port("[::1]:80"), Some(("::1", 80)));
        assert_eq!(split_host_port("[nope]:80"), None);
    }
}
