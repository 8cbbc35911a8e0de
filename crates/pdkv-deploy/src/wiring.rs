//! The command lines of a deployment's children: `pdkv serve` as a prefill,
//! decode or colocated engine, and `pdkv proxy` in front of them. Secrets
//! are not here: they go by environment ([`crate::Proc::spawn`]).

use std::path::Path;

use crate::modes::{FailurePolicy, TransferMode, Transport};

/// Every child listens on loopback.
pub const HOST: &str = "127.0.0.1";

/// What an engine of the deployment is.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum EngineRole {
    /// A prefill engine (`kv_producer`).
    Prefill,
    /// A decode engine (`kv_consumer`).
    Decode,
    /// A whole engine, no KV connector.
    Colocated,
}

impl EngineRole {
    /// Its `kv_role`, for the connector's engines.
    fn kv_role(self) -> Option<&'static str> {
        match self {
            EngineRole::Prefill => Some("kv_producer"),
            EngineRole::Decode => Some("kv_consumer"),
            EngineRole::Colocated => None,
        }
    }
}

/// The HTTP connection bounds every server of a deployment (engines and
/// proxy) is started with: their `--max-connections` and
/// `--header-timeout-s`.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct HttpBounds {
    pub max_connections: usize,
    pub header_timeout_s: f64,
}

impl HttpBounds {
    /// The flags that give a server these bounds.
    fn args(&self) -> [String; 4] {
        [
            "--max-connections".to_string(),
            self.max_connections.to_string(),
            "--header-timeout-s".to_string(),
            self.header_timeout_s.to_string(),
        ]
    }
}

/// The settings every engine of a deployment is started with.
#[derive(Clone, Debug)]
pub struct EngineWiring {
    pub transport: Transport,
    pub transfer_mode: TransferMode,
    /// D's `kv_load_failure_policy` (`None`: the connector's default).
    pub kv_load_failure_policy: Option<FailurePolicy>,
    /// P's `abort_timeout_s` (`None`: the connector's default).
    pub abort_timeout_s: Option<f64>,
    /// KV cache size of each engine, in blocks (`None`: the server's default).
    pub num_kv_blocks: Option<usize>,
    /// Every engine's `--kv-cache-dtype` (`None`: its default).
    pub kv_cache_dtype: Option<String>,
    /// Ranks of every engine, unless the role's own size below is given.
    pub tensor_parallel_size: u16,
    pub prefill_tensor_parallel_size: Option<u16>,
    pub decode_tensor_parallel_size: Option<u16>,
    /// `--enable-sleep-mode` (the admin API is for sleeping between
    /// rollouts: a deployment with an admin token sleeps).
    pub sleep_mode: bool,
    /// Every engine's `--weight-format` (`None`: as the checkpoint stores
    /// its weights).
    pub weight_format: Option<String>,
    /// The decode engines' `--speculative-config` (JSON; `None`: off).
    /// Prefill engines compute prompts and sample one token: they take none.
    pub speculative_config: Option<String>,
    /// Every engine's `--tool-call-parser` with `--enable-auto-tool-choice`
    /// (`None`: `tool_choice: auto` is refused). Prefill engines read the
    /// same requests, so they take it too.
    pub tool_call_parser: Option<String>,
    /// The HTTP bounds of every engine, and of the proxy in front of them
    /// (`None`: each server's defaults).
    pub http: Option<HttpBounds>,
}

impl EngineWiring {
    /// The engines' defaults for `transport` and `transfer_mode`.
    pub fn new(transport: Transport, transfer_mode: TransferMode) -> EngineWiring {
        EngineWiring {
            transport,
            transfer_mode,
            kv_load_failure_policy: None,
            abort_timeout_s: None,
            num_kv_blocks: None,
            kv_cache_dtype: None,
            tensor_parallel_size: 1,
            prefill_tensor_parallel_size: None,
            decode_tensor_parallel_size: None,
            sleep_mode: false,
            weight_format: None,
            speculative_config: None,
            tool_call_parser: None,
            http: None,
        }
    }

    /// The ranks an engine of `role` splits the model over.
    pub fn ranks(&self, role: EngineRole) -> u16 {
        match role {
            EngineRole::Prefill => self.prefill_tensor_parallel_size,
            EngineRole::Decode => self.decode_tensor_parallel_size,
            EngineRole::Colocated => None,
        }
        .unwrap_or(self.tensor_parallel_size)
    }

    /// The connector's `--kv-transfer-config` of an engine of `kv_role`.
    fn kv_transfer_config(&self, kv_role: &str, kv_port: u16) -> serde_json::Value {
        let mut config = serde_json::json!({
            "kv_connector": "pdkv",
            "kv_role": kv_role,
            "transport": self.transport.as_str(),
            "transfer_mode": self.transfer_mode.as_str(),
            "kv_port": kv_port,
        });
        if let Some(p) = self.kv_load_failure_policy {
            config["kv_load_failure_policy"] = p.as_str().into();
        }
        if let Some(s) = self.abort_timeout_s {
            config["abort_timeout_s"] = s.into();
        }
        if kv_role == "kv_consumer" {
            // Every engine of the deployment listens on loopback: a decode
            // engine connects for KV nowhere else, whatever a client's
            // kv_transfer_params name.
            config["kv_peers"] = serde_json::json!(["127.0.0.0/8", "::1"]);
        }
        config
    }
}

/// `pdkv serve` as an engine of `role` on `port` (0: a free one), with its
/// KV control port `kv_port` (0: a free one; prefill engines).
pub fn serve_args(
    w: &EngineWiring,
    model: &Path,
    role: EngineRole,
    port: u16,
    kv_port: u16,
    engine_id: &str,
) -> Vec<String> {
    let mut v = vec![
        "serve".to_string(),
        "--model".to_string(),
        model.display().to_string(),
        "--host".to_string(),
        HOST.to_string(),
        "--port".to_string(),
        port.to_string(),
    ];
    if let Some(kv_role) = role.kv_role() {
        v.extend([
            "--kv-transfer-config".to_string(),
            w.kv_transfer_config(kv_role, kv_port).to_string(),
        ]);
    }
    v.extend(["--engine-id".to_string(), engine_id.to_string()]);
    if let Some(n) = w.num_kv_blocks {
        v.extend(["--num-kv-blocks".to_string(), n.to_string()]);
    }
    if let Some(d) = &w.kv_cache_dtype {
        v.extend(["--kv-cache-dtype".to_string(), d.clone()]);
    }
    let tp = w.ranks(role);
    if tp > 1 {
        v.extend(["--tensor-parallel-size".to_string(), tp.to_string()]);
    }
    if w.sleep_mode {
        v.push("--enable-sleep-mode".to_string());
    }
    if let Some(f) = &w.weight_format {
        v.extend(["--weight-format".to_string(), f.clone()]);
    }
    if let Some(c) = w
        .speculative_config
        .as_ref()
        .filter(|_| role != EngineRole::Prefill)
    {
        v.extend(["--speculative-config".to_string(), c.clone()]);
    }
    if let Some(p) = &w.tool_call_parser {
        v.extend([
            "--enable-auto-tool-choice".to_string(),
            "--tool-call-parser".to_string(),
            p.clone(),
        ]);
    }
    if let Some(h) = &w.http {
        v.extend(h.args());
    }
    v
}

/// `pdkv proxy` on `port` in front of the prefill and decode servers at
/// these URLs; `health_interval_ms`: its health checks' interval, `http`
/// its HTTP bounds (`None`: the proxy's defaults).
pub fn proxy_args(
    prefill: &[String],
    decode: &[String],
    port: u16,
    health_interval_ms: Option<u64>,
    http: Option<HttpBounds>,
) -> Vec<String> {
    let mut v = vec![
        "proxy".to_string(),
        "--prefill".to_string(),
        prefill.join(","),
        "--decode".to_string(),
        decode.join(","),
        "--host".to_string(),
        HOST.to_string(),
        "--port".to_string(),
        port.to_string(),
    ];
    if let Some(ms) = health_interval_ms {
        v.extend(["--health-interval-ms".to_string(), ms.to_string()]);
    }
    if let Some(h) = &http {
        v.extend(h.args());
    }
    v
}

#[cfg(test)]
mod tests {
    use super::*;

    fn flag<'a>(args: &'a [String], name: &str) -> Option<&'a str> {
        let i = args.iter().position(|a| a == name)?;
        args.get(i + 1).map(String::as_str)
    }

    #[test]
    fn engines_get_their_role_and_ranks() {
        let mut w = EngineWiring::new(Transport::Shm, TransferMode::Read);
        w.prefill_tensor_parallel_size = Some(2);
        w.kv_load_failure_policy = Some(FailurePolicy::Fail);
        w.sleep_mode = true;
        let p = serve_args(&w, Path::new("/m"), EngineRole::Prefill, 0, 7000, "p0");
        let config: serde_json::Value =
            serde_json::from_str(flag(&p, "--kv-transfer-config").unwrap()).unwrap();
        assert_eq!(config["kv_role"], "kv_producer");
        assert_eq!(config["transport"], "shm");
        assert_eq!(config["transfer_mode"], "read");
        assert_eq!(config["kv_port"], 7000);
        assert_eq!(config["kv_load_failure_policy"], "fail");
        assert!(config.get("abort_timeout_s").is_none());
        assert_eq!(flag(&p, "--tensor-parallel-size"), Some("2"));
        assert!(p.iter().any(|a| a == "--enable-sleep-mode"));
        let d = serve_args(&w, Path::new("/m"), EngineRole::Decode, 9, 0, "d0");
        assert_eq!(flag(&d, "--tensor-parallel-size"), None);
        let dc: serde_json::Value =
            serde_json::from_str(flag(&d, "--kv-transfer-config").unwrap()).unwrap();
        assert_eq!(dc["kv_peers"], serde_json::json!(["127.0.0.0/8", "::1"]));
        assert!(config.get("kv_peers").is_none(), "P connects to no peer");
        assert_eq!(flag(&d, "--port"), Some("9"));
        let c = serve_args(&w, Path::new("/m"), EngineRole::Colocated, 0, 0, "c");
        assert_eq!(flag(&c, "--kv-transfer-config"), None);
        // No HTTP bounds given: every server keeps its defaults.
        let proxy = proxy_args(&[], &[], 0, None, None);
        for args in [&p, &d, &c, &proxy] {
            assert_eq!(flag(args, "--max-connections"), None);
            assert_eq!(flag(args, "--header-timeout-s"), None);
        }
    }
}
