//! Deployments of real `pdkv` processes for tests, built on `pdkv up`'s
//! own argument wiring ([`pdkv_deploy::serve_args`], [`pdkv_deploy::proxy_args`]):
//! a colocated engine, or a prefill engine, a decode engine and the proxy
//! in front of them. Each child is a [`Proc`] the test holds, so it can
//! kill one of them, read its log or talk to it directly.

use std::path::{Path, PathBuf};

use pdkv_deploy::{proxy_args, serve_args, EngineRole, EngineWiring, TransferMode, Transport};
use serde_json::{Map, Value};

use crate::proc::Proc;

/// What every engine of a deployment is started with, beyond the wiring
/// `pdkv up` gives it.
#[derive(Clone, Debug)]
pub struct Spec {
    pub model: PathBuf,
    pub wiring: EngineWiring,
    /// Fields added to each engine's `--kv-transfer-config` (an object:
    /// `load_timeout_s`, `shm_dir`, ...).
    pub kv_extra: Map<String, Value>,
    /// Arguments added to every engine's command line.
    pub serve_extra: Vec<String>,
    /// Arguments added to the proxy's command line.
    pub proxy_extra: Vec<String>,
    /// Environment of every child (secrets, API keys, admin tokens).
    pub env: Vec<(String, String)>,
}

impl Spec {
    /// `model` over TCP in write mode, with `num_kv_blocks` blocks per engine.
    pub fn new(model: &Path, num_kv_blocks: usize) -> Spec {
        let mut wiring = EngineWiring::new(Transport::Tcp, TransferMode::Write);
        wiring.num_kv_blocks = Some(num_kv_blocks);
        Spec {
            model: model.to_path_buf(),
            wiring,
            kv_extra: Map::new(),
            serve_extra: Vec::new(),
            proxy_extra: Vec::new(),
            env: Vec::new(),
        }
    }

    pub fn transport(mut self, t: Transport) -> Spec {
        self.wiring.transport = t;
        self
    }

    /// Adds the field `key` to every engine's `--kv-transfer-config`.
    pub fn kv(mut self, key: &str, value: impl Into<Value>) -> Spec {
        self.kv_extra.insert(key.to_string(), value.into());
        self
    }

    /// Adds `args` to every engine's command line.
    pub fn serve_args(mut self, args: &[&str]) -> Spec {
        self.serve_extra.extend(args.iter().map(|a| a.to_string()));
        self
    }

    /// Adds `args` to the proxy's and to every engine's command line (for
    /// flags both take, such as the HTTP bounds).
    pub fn http_args(mut self, args: &[&str]) -> Spec {
        self.serve_extra.extend(args.iter().map(|a| a.to_string()));
        self.proxy_extra.extend(args.iter().map(|a| a.to_string()));
        self
    }

    /// Sets `key=value` in every child's environment.
    pub fn env(mut self, key: &str, value: &str) -> Spec {
        self.env.push((key.to_string(), value.to_string()));
        self
    }

    /// The command line of an engine of `role` named `engine_id`.
    pub fn engine_args(&self, role: EngineRole, engine_id: &str) -> Vec<String> {
        let mut args = serve_args(&self.wiring, &self.model, role, 0, 0, engine_id);
        if let Some(i) = args.iter().position(|a| a == "--kv-transfer-config") {
            let mut config: Value =
                serde_json::from_str(&args[i + 1]).expect("up's wiring writes JSON");
            for (k, v) in &self.kv_extra {
                config[k] = v.clone();
            }
            args[i + 1] = config.to_string();
        }
        args.extend(self.serve_extra.iter().cloned());
        args
    }

    /// Starts an engine of `role` named `engine_id`, waiting until it
    /// listens.
    pub fn start_engine(&self, role: EngineRole, engine_id: &str) -> Proc {
        self.start(&self.engine_args(role, engine_id))
    }

    /// Starts a colocated engine (no KV connector), waiting until it
    /// listens.
    pub fn start_colocated(&self) -> Proc {
        self.start_engine(EngineRole::Colocated, "colocated")
    }

    /// Starts the proxy in front of `prefill` and `decode`, waiting until it
    /// listens.
    pub fn start_proxy(&self, prefill: &[&Proc], decode: &[&Proc]) -> Proc {
        let urls = |ps: &[&Proc]| ps.iter().map(|p| p.base.clone()).collect::<Vec<_>>();
        let mut args = proxy_args(&urls(prefill), &urls(decode), 0, None, None);
        args.extend(self.proxy_extra.iter().cloned());
        self.start(&args)
    }

    /// A prefill engine `p0`, a decode engine `d0` and the proxy in front
    /// of them.
    pub fn start_pd(&self) -> Pd {
        let p = self.start_engine(EngineRole::Prefill, "p0");
        let d = self.start_engine(EngineRole::Decode, "d0");
        let proxy = self.start_proxy(&[&p], &[&d]);
        Pd { p, d, proxy }
    }

    fn start(&self, args: &[String]) -> Proc {
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        let env: Vec<(&str, &str)> = self
            .env
            .iter()
            .map(|(k, v)| (k.as_str(), v.as_str()))
            .collect();
        Proc::start_env(&[], &args, &env)
    }
}

/// A prefill engine, a decode engine and the proxy in front of them; every
/// child stopped on drop.
pub struct Pd {
    pub p: Proc,
    pub d: Proc,
    pub proxy: Proc,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn engines_get_up_s_wiring_with_the_extras_merged() {
        let spec = Spec::new(Path::new("/m.gguf"), 64)
            .kv("load_timeout_s", 4)
            .kv("kv_load_failure_policy", "fail")
            .http_args(&["--header-timeout-s", "3"]);
        let args = spec.engine_args(EngineRole::Decode, "d0");
        let i = args
            .iter()
            .position(|a| a == "--kv-transfer-config")
            .unwrap();
        let config: Value = serde_json::from_str(&args[i + 1]).unwrap();
        assert_eq!(config["kv_role"], "kv_consumer");
        assert_eq!(config["transport"], "tcp");
        assert_eq!(config["load_timeout_s"], 4);
        assert_eq!(config["kv_load_failure_policy"], "fail");
        let has = |a: &str, b: &str| args.windows(2).any(|w| w[0] == a && w[1] == b);
        assert!(
            has("--num-kv-blocks", "64") && has("--engine-id", "d0") && has("--model", "/m.gguf")
        );
        assert!(has("--header-timeout-s", "3") && has("--port", "0"));
        assert!(spec.proxy_extra.iter().any(|a| a == "--header-timeout-s"));
        let colo = spec.engine_args(EngineRole::Colocated, "c0");
        assert!(!colo.iter().any(|a| a == "--kv-transfer-config"));
    }
}
