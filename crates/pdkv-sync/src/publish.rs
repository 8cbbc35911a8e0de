//! The trainer's side in Rust: a set of weights in registered memory, read
//! one-sided by the engines, and its manifest over HTTP (`GET /manifest`).

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Instant;

use anyhow::Context;
use axum::routing::get;
use axum::{Json, Router};
use pdkv_model::weights::Weights;
use pdkv_transfer::auth::KvSecret;
use pdkv_transfer::frame::Limits;
use pdkv_transfer::shm::{ExportOptions, ShmExporter};
use pdkv_transfer::tcp::{Agent, AgentConfig};
use pdkv_transfer::{Registration, Registry, RegistryOptions};
use tokio::task::JoinHandle;

use crate::manifest::{checksum, Manifest, ShmEndpoint, TensorEntry, PROTOCOL};

/// One tensor as a trainer holds it ([`Publisher::start_tensors`]).
#[derive(Clone, Debug)]
pub struct TrainerTensor {
    /// The Hugging Face name (`model.layers.0.self_attn.q_proj.weight`).
    pub name: String,
    /// `f32`, `f16` or `bf16`.
    pub dtype: String,
    pub shape: Vec<usize>,
    /// Little-endian values, row-major.
    pub bytes: Vec<u8>,
}

impl TrainerTensor {
    /// Every tensor of the safetensors files of a Hugging Face checkpoint
    /// directory (what a trainer would write, or `pdkv model export`).
    pub fn read_hf_dir(dir: &std::path::Path) -> anyhow::Result<Vec<TrainerTensor>> {
        let mut files: Vec<PathBuf> = std::fs::read_dir(dir)
            .with_context(|| format!("reading {}", dir.display()))?
            .filter_map(|e| e.ok().map(|e| e.path()))
            .filter(|p| p.extension().is_some_and(|x| x == "safetensors"))
            .collect();
        files.sort();
        anyhow::ensure!(
            !files.is_empty(),
            "{} holds no .safetensors file",
            dir.display()
        );
        let mut out = Vec::new();
        for f in files {
            let st = pdkv_model::safetensors::SafetensorsFile::open(&f)?;
            for (name, e) in &st.tensors {
                let (bytes, dtype) = st.raw(name).expect("a tensor of the file");
                out.push(TrainerTensor {
                    name: name.clone(),
                    dtype: dtype.name().to_ascii_lowercase(),
                    shape: e.shape.clone(),
                    bytes: bytes.to_vec(),
                });
            }
        }
        Ok(out)
    }
}

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
    /// Also share the registration over shared memory (a Unix socket in
    /// the temporary directory), for engines on this host.
    pub shm: bool,
}

impl Default for PublishOptions {
    fn default() -> Self {
        PublishOptions {
            http_addr: "127.0.0.1:0".into(),
            transfer_addr: "127.0.0.1:0".into(),
            secret: KvSecret::open(),
            conns_per_peer: 4,
            shm: true,
        }
    }
}

/// A running publisher. Dropping it stops both listeners; an engine
/// pulling meanwhile fails with a transfer error.
pub struct Publisher {
    region: Arc<pdkv_vmem::Region>,
    manifest: Manifest,
    http: SocketAddr,
    agent: Agent,
    reg: Registration,
    task: JoinHandle<()>,
    shm: Option<ShmExporter>,
}

/// How long a stopping publisher waits for engines that mapped its weights
/// to unmap them.
const UNMAP_WAIT: std::time::Duration = std::time::Duration::from_secs(2);

impl Drop for Publisher {
    /// Stops serving: over shared memory every engine that mapped the
    /// weights is asked to unmap them first (a copy in progress ends, the
    /// next one fails), then the registration goes.
    fn drop(&mut self) {
        self.task.abort();
        match &self.shm {
            Some(shm) => {
                if let Err(e) = shm.deregister(self.reg.segment, UNMAP_WAIT) {
                    tracing::warn!(error = %e, "stopping the publisher");
                }
            }
            None => {
                self.agent.registry().deregister(self.reg.segment);
            }
        }
    }
}

/// `weights` in memory a publisher can register and peers can map: as they
/// are when shared already, else copied once into shared memory of the same
/// layout (a loaded model's weights are private memory,
/// `pdkv_vmem::Backing::Private`; the private copy goes with `weights`).
/// [`Publisher::start`] serves what this returns in place: a write to it
/// is what pullers then read.
pub fn shared_weights(weights: Weights) -> anyhow::Result<Weights> {
    if weights.region.backing() == pdkv_vmem::Backing::Shared {
        return Ok(weights);
    }
    let region = pdkv_vmem::Pool::default()
        .allocate(pdkv_vmem::Tag::Weights, weights.region.len())
        .context("allocating shared memory for the published weights")?;
    let copy = weights.with_region(region);
    // SAFETY: `copy`'s region was just allocated; nothing reads it yet.
    unsafe { copy.copy_from(&weights) }.context("copying the weights to shared memory")?;
    Ok(copy)
}

impl Publisher {
    /// Publishes `weights` as the engine stores them (every tensor,
    /// checksummed now) as `version`, from shared memory
    /// ([`shared_weights`]).
    pub async fn start(
        weights: Weights,
        version: Option<String>,
        opts: PublishOptions,
    ) -> anyhow::Result<Publisher> {
        let tensors = tensor_entries(&weights);
        let weights = shared_weights(weights)?;
        Publisher::serve(weights.region, tensors, version, opts).await
    }

    /// Publishes tensors as a trainer holds them (Hugging Face names,
    /// `f32`, `f16` or `bf16` values in Hugging Face order), copied into
    /// registered memory and checksummed now, as `version`: each engine
    /// converts them to the type it stores while it pulls.
    pub async fn start_tensors(
        tensors: Vec<TrainerTensor>,
        version: Option<String>,
        opts: PublishOptions,
    ) -> anyhow::Result<Publisher> {
        let mut at = 0usize;
        let mut offsets = Vec::with_capacity(tensors.len());
        for t in &tensors {
            let Some(d) = pdkv_model::safetensors::Dtype::from_sync_name(&t.dtype) else {
                anyhow::bail!("tensor `{}`: {} is not f32, f16 or bf16", t.name, t.dtype);
            };
            let want = t.shape.iter().product::<usize>() * d.size();
            anyhow::ensure!(
                t.bytes.len() == want,
                "tensor `{}`: {} bytes for {:?} values of {}, expected {want}",
                t.name,
                t.bytes.len(),
                t.shape,
                t.dtype
            );
            offsets.push(at);
            at = (at + want).next_multiple_of(64);
        }
        let region = pdkv_vmem::Pool::default()
            .allocate(pdkv_vmem::Tag::Weights, at.max(64))
            .context("allocating the published tensors' memory")?;
        let mut entries = Vec::with_capacity(tensors.len());
        for (t, off) in tensors.into_iter().zip(offsets) {
            region
                .write_bytes(off, &t.bytes)
                .with_context(|| format!("copying tensor `{}`", t.name))?;
            entries.push(TensorEntry {
                crc32: checksum(&t.bytes),
                name: t.name,
                dtype: t.dtype,
                shape: t.shape,
                offset: off as u64,
                len: t.bytes.len() as u64,
            });
        }
        Publisher::serve(region, entries, version, opts).await
    }

    /// Serves the tensors `tensors` lying in `region`.
    async fn serve(
        region: Arc<pdkv_vmem::Region>,
        tensors: Vec<TensorEntry>,
        version: Option<String>,
        opts: PublishOptions,
    ) -> anyhow::Result<Publisher> {
        let t0 = Instant::now();
        let registry = Arc::new(Registry::new(RegistryOptions::default()));
        let reg = registry
            .register(&region, 0, region.len())
            .map_err(|e| anyhow::anyhow!("registering the weights: {e}"))?;
        let cfg = AgentConfig {
            secret: opts.secret.clone(),
            conns_per_peer: opts.conns_per_peer.max(1),
            ..AgentConfig::default()
        };
        let agent = Agent::bind(&opts.transfer_addr, registry, cfg)
            .await
            .with_context(|| format!("binding the transfer agent on {}", opts.transfer_addr))?;
        let shm = share_over_shm(&agent, &reg, &opts)?;
        let manifest = Manifest {
            protocol: PROTOCOL,
            version,
            transfer_addr: agent.local_addr().to_string(),
            segment: reg.segment,
            key: reg.key,
            epoch: reg.epoch,
            shm: shm.as_ref().map(|(_, path)| ShmEndpoint {
                path: path.display().to_string(),
                len: reg.len,
            }),
            tensors,
        };
        let (http, task) = serve_manifest(&opts.http_addr, &manifest, &agent).await?;
        tracing::info!(
            tensors = manifest.tensors.len(),
            bytes = manifest.bytes(),
            url = %format!("http://{http}"),
            transfer = %manifest.transfer_addr,
            shm = ?manifest.shm.as_ref().map(|s| &s.path),
            ms = t0.elapsed().as_millis() as u64,
            "publishing weights"
        );
        Ok(Publisher {
            region,
            manifest,
            http,
            agent,
            reg,
            task,
            shm: shm.map(|(e, _)| e),
        })
    }

    /// The URL engines are given in `init_weight_transfer_engine`.
    pub fn url(&self) -> String {
        format!("http://{}", self.http)
    }

    pub fn manifest(&self) -> &Manifest {
        &self.manifest
    }

    /// The memory the published tensors lie in (tests change bytes under
    /// the manifest to see a checksum refused).
    pub fn region(&self) -> &Arc<pdkv_vmem::Region> {
        &self.region
    }

    /// Bytes the engines have read so far over TCP (a read over shared
    /// memory is a copy the publisher does not see).
    pub fn bytes_served(&self) -> u64 {
        self.agent
            .serve_stats()
            .bytes_out
            .load(std::sync::atomic::Ordering::Relaxed)
    }

    /// [`Publisher::bytes_served`] once it reaches `n`, or at `wait`. The
    /// agent counts a read once its data is written, which may be just
    /// after the reader already has it.
    pub async fn bytes_served_reaching(&self, n: u64, wait: std::time::Duration) -> u64 {
        let deadline = tokio::time::Instant::now() + wait;
        let stats = self.agent.serve_stats();
        loop {
            let mut progress = std::pin::pin!(stats.progress.notified());
            progress.as_mut().enable();
            let served = self.bytes_served();
            if served >= n || tokio::time::timeout_at(deadline, progress).await.is_err() {
                return self.bytes_served();
            }
        }
    }
}

/// Shares the registration over shared memory too when `opts.shm` asks for
/// it: a Unix socket in the temporary directory, refused at once when the
/// registration cannot be shared.
fn share_over_shm(
    agent: &Agent,
    reg: &Registration,
    opts: &PublishOptions,
) -> anyhow::Result<Option<(ShmExporter, PathBuf)>> {
    let shm = match opts.shm {
        false => None,
        true => {
            static NEXT: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
            let n = NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            let path =
                std::env::temp_dir().join(format!("pdkv-publish-{}-{n}.sock", std::process::id()));
            let _ = std::fs::remove_file(&path);
            let exporter = ShmExporter::bind_with(
                &path,
                agent.registry().clone(),
                Limits::default(),
                ExportOptions {
                    secret: opts.secret.clone(),
                    ..ExportOptions::default()
                },
            )
            .with_context(|| format!("binding the shared-memory socket {}", path.display()))?;
            exporter
                .check_shareable(reg)
                .map_err(|e| anyhow::anyhow!("sharing the weights: {e}"))?;
            Some((exporter, path))
        }
    };
    Ok(shm)
}

/// Every tensor of `weights`, checksummed now.
fn tensor_entries(weights: &Weights) -> Vec<TensorEntry> {
    weights
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
        .collect()
}

/// Serves `manifest` (`GET /manifest`) and what the engines read so far
/// over TCP (`GET /stats`) on `http_addr`; the address bound and the
/// server's task.
async fn serve_manifest(
    http_addr: &str,
    manifest: &Manifest,
    agent: &Agent,
) -> anyhow::Result<(SocketAddr, JoinHandle<()>)> {
    let listener = pdkv_transfer::listen::bind(http_addr)
        .await
        .with_context(|| format!("binding the manifest server on {http_addr}"))?;
    let http = listener.local_addr()?;
    let served = Arc::new(manifest.clone());
    let stats = agent.serve_stats().clone();
    let total = manifest.bytes();
    let app = Router::new()
        .route(
            "/manifest",
            get(move || {
                let m = served.clone();
                async move { Json((*m).clone()) }
            }),
        )
        // What the engines read so far over TCP: how many copies of the
        // weights went through this publisher's link.
        .route(
            "/stats",
            get(move || {
                let out = stats.bytes_out.load(std::sync::atomic::Ordering::Relaxed);
                async move { Json(serde_json::json!({"bytes": total, "bytes_served": out})) }
            }),
        );
    let task = tokio::spawn(async move {
        if let Err(e) = axum::serve(listener, app).await {
            tracing::error!(error = %e, "the manifest server stopped");
        }
    });
    Ok((http, task))
}
