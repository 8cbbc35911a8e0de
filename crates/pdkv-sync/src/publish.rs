//! The trainer's side in Rust: a set of weights in registered memory, read
//! one-sided by the engines, and its manifest over HTTP (`GET /manifest`).

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Instant;

use anyhow::Context;
use axum::routing::get;
use axum::{Json, Router};
use pdkv_model::weights::Weights;
use pdkv_transfer::auth::KvSecret;
use pdkv_transfer::tcp::{Agent, AgentConfig};
use pdkv_transfer::{Registration, Registry, RegistryOptions};
use tokio::task::JoinHandle;

use crate::manifest::{checksum, Manifest, TensorEntry, PROTOCOL};

/// Where a publisher listens.
#[derive(Clone, Debug)]
pub struct PublishOptions {
    /// The manifest's HTTP address (`host:port`, port 0 for any).
    pub http_addr: String,
    /// The transfer agent's address (`host:port`, port 0 for any).
    pub transfer_addr: String,
    /// The deployment's KV secret: the engines prove it on every
    /// connection to the transfer agent.
    pub secret: KvSecret,
    /// Connections each engine opens to the agent (reads run in parallel
    /// over them).
    pub conns_per_peer: usize,
}

impl Default for PublishOptions {
    fn default() -> Self {
        PublishOptions {
            http_addr: "127.0.0.1:0".into(),
            transfer_addr: "127.0.0.1:0".into(),
            secret: KvSecret::open(),
            conns_per_peer: 4,
        }
    }
}

/// A running publisher. Dropping it stops both listeners; an engine
/// pulling meanwhile fails with a transfer error.
pub struct Publisher {
    weights: Weights,
    manifest: Manifest,
    http: SocketAddr,
    agent: Agent,
    reg: Registration,
    task: JoinHandle<()>,
}

impl Drop for Publisher {
    fn drop(&mut self) {
        self.task.abort();
        self.agent.registry().deregister(self.reg.segment);
    }
}

impl Publisher {
    /// Publishes `weights` (every tensor, checksummed now) as `version`.
    pub async fn start(
        weights: Weights,
        version: Option<String>,
        opts: PublishOptions,
    ) -> anyhow::Result<Publisher> {
        let t0 = Instant::now();
        let registry = Arc::new(Registry::new(RegistryOptions::default()));
        let reg = registry
            .register(&weights.region, 0, weights.region.len())
            .map_err(|e| anyhow::anyhow!("registering the weights: {e}"))?;
        let cfg = AgentConfig {
            secret: opts.secret.clone(),
            conns_per_peer: opts.conns_per_peer.max(1),
            ..AgentConfig::default()
        };
        let agent = Agent::bind(&opts.transfer_addr, registry, cfg)
            .await
            .with_context(|| format!("binding the transfer agent on {}", opts.transfer_addr))?;
        let tensors = weights
            .named()
            .into_iter()
            .map(|(name, t)| {
                let n = t.bytes();
                // SAFETY: the tensor lies inside the region, which nothing
                // writes while it is published.
                let bytes =
                    unsafe { std::slice::from_raw_parts(weights.region.base().add(t.offset), n) };
                TensorEntry {
                    name,
                    dtype: t.dtype.name().into(),
                    shape: t.shape.clone(),
                    offset: t.offset as u64,
                    len: n as u64,
                    crc32: checksum(bytes),
                }
            })
            .collect();
        let manifest = Manifest {
            protocol: PROTOCOL,
            version,
            transfer_addr: agent.local_addr().to_string(),
            segment: reg.segment,
            key: reg.key,
            epoch: reg.epoch,
            tensors,
        };
        let listener = tokio::net::TcpListener::bind(&opts.http_addr)
            .await
            .with_context(|| format!("binding the manifest server on {}", opts.http_addr))?;
        let http = listener.local_addr()?;
        let served = Arc::new(manifest.clone());
        let app = Router::new().route(
            "/manifest",
            get(move || {
                let m = served.clone();
                async move { Json((*m).clone()) }
            }),
        );
        let task = tokio::spawn(async move {
            if let Err(e) = axum::serve(listener, app).await {
                tracing::error!(error = %e, "the manifest server stopped");
            }
        });
        tracing::info!(
            tensors = manifest.tensors.len(),
            bytes = manifest.bytes(),
            url = %format!("http://{http}"),
            transfer = %manifest.transfer_addr,
            ms = t0.elapsed().as_millis() as u64,
            "publishing weights"
        );
        Ok(Publisher {
            weights,
            manifest,
            http,
            agent,
            reg,
            task,
        })
    }

    /// The URL engines are given in `init_weight_transfer_engine`.
    pub fn url(&self) -> String {
        format!("http://{}", self.http)
    }

    pub fn manifest(&self) -> &Manifest {
        &self.manifest
    }

    /// The published weights (tests change their bytes under the manifest
    /// to see a checksum refused).
    pub fn weights(&self) -> &Weights {
        &self.weights
    }

    /// Bytes the engines have read so far.
    pub fn bytes_served(&self) -> u64 {
        self.agent
            .serve_stats()
            .bytes_out
            .load(std::sync::atomic::Ordering::Relaxed)
    }
}
