//! The engine's side: fetch a publisher's manifest, stage a copy of the
//! running weights' layout, and read the tensors one-sided into it, each
//! checked against its checksum. Nothing here touches the running weights:
//! the engine installs a complete staging in one switch.

use std::collections::BTreeSet;
use std::sync::Arc;
use std::time::{Duration, Instant};

use pdkv_model::weights::{TensorRef, Weights};
use pdkv_transfer::auth::KvSecret;
use pdkv_transfer::proto::Direction;
use pdkv_transfer::tcp::{Agent, AgentConfig, LocalSlice};
use pdkv_transfer::{Registration, Registry, RegistryOptions, RemoteDescriptor};
use pdkv_vmem::{Pool, Region, Tag};

use crate::manifest::{checksum, plan, Manifest, MismatchError, TensorEntry};

/// Bytes per read batch of a pull (checksums of one overlap the next).
const GROUP_BYTES: u64 = 8 << 20;

/// Why a sync step failed. Every variant about a tensor names it; none
/// touches the running weights.
#[derive(Debug, thiserror::Error)]
pub enum SyncError {
    #[error("fetching the manifest from {url}: {reason}")]
    Manifest { url: String, reason: String },
    #[error("{0}")]
    Mismatch(#[from] MismatchError),
    #[error("update_weights names `{0}`, which the publisher does not publish")]
    NotPublished(String),
    #[error(
        "reading {tensors} tensor(s) from the publisher at {addr} (first `{first}`): {reason}"
    )]
    Transfer {
        addr: String,
        tensors: usize,
        first: String,
        reason: String,
    },
    #[error("tensor `{name}`: checksum {got:08x} of the bytes read, the publisher announced {expected:08x}")]
    Checksum {
        name: String,
        expected: u32,
        got: u32,
    },
    #[error("{missing} of {total} tensors were not pulled yet (first `{first}`)")]
    Incomplete {
        missing: usize,
        total: usize,
        first: String,
    },
    #[error("staging the weights: {0}")]
    Staging(String),
}

/// A pulling engine's transfer agent (it only initiates reads), and the
/// staging region of its last sync, kept for the next one (fresh memory
/// costs the kernel's zeroing of every page: more than the pull itself).
pub struct Puller {
    agent: Agent,
    http: reqwest::Client,
    spare: Arc<std::sync::Mutex<Option<Arc<Region>>>>,
}

impl Puller {
    /// An agent on loopback with `conns` connections per publisher.
    pub async fn new(secret: KvSecret, conns: usize) -> anyhow::Result<Puller> {
        let registry = Arc::new(Registry::new(RegistryOptions::default()));
        let cfg = AgentConfig {
            secret,
            conns_per_peer: conns.max(1),
            ..AgentConfig::default()
        };
        let agent = Agent::bind("127.0.0.1:0", registry, cfg).await?;
        let http = reqwest::Client::builder()
            .timeout(Duration::from_secs(30))
            .build()?;
        Ok(Puller {
            agent,
            http,
            spare: Arc::default(),
        })
    }

    /// Bytes of the staging region kept between syncs (0 before the first).
    pub fn spare_bytes(&self) -> u64 {
        self.spare
            .lock()
            .unwrap()
            .as_ref()
            .map_or(0, |r| r.len() as u64)
    }

    /// Frees the staging region kept between syncs.
    pub fn drop_spare(&self) {
        self.spare.lock().unwrap().take();
    }

    /// `GET {url}/manifest`.
    pub async fn manifest(&self, url: &str) -> Result<Manifest, SyncError> {
        let u = format!("{}/manifest", url.trim_end_matches('/'));
        let err = |reason: String| SyncError::Manifest {
            url: u.clone(),
            reason,
        };
        let resp = self
            .http
            .get(&u)
            .send()
            .await
            .map_err(|e| err(e.to_string()))?;
        if !resp.status().is_success() {
            return Err(err(format!("status {}", resp.status())));
        }
        let body = resp.bytes().await.map_err(|e| err(e.to_string()))?;
        serde_json::from_slice(&body).map_err(|e| err(format!("not a manifest: {e}")))
    }

    /// Stages `manifest` for the running weights `layout`: checks every
    /// tensor's name, type, shape and size, and allocates a region laid out
    /// as `layout` for the bytes.
    pub fn stage(&self, manifest: Manifest, layout: &Weights) -> Result<Staging, SyncError> {
        let plan: Vec<(TensorEntry, TensorRef)> = plan(&manifest, layout)?
            .into_iter()
            .map(|(e, t)| (e.clone(), t))
            .collect();
        // The last sync's region when nothing else holds it any more (an
        // installed staging is dropped by the engine after its switch).
        let kept = self.spare.lock().unwrap().take().filter(|r| {
            Arc::strong_count(r) == 1 && r.len() >= layout.layout_bytes() && r.is_mapped()
        });
        let region = match kept {
            Some(r) => r,
            None => Pool::default()
                .allocate(Tag::Weights, layout.layout_bytes())
                .map_err(|e| SyncError::Staging(e.to_string()))?,
        };
        let reg = self
            .agent
            .registry()
            .register(&region, 0, region.len())
            .map_err(|e| SyncError::Staging(e.to_string()))?;
        Ok(Staging {
            weights: layout.with_region(region),
            reg,
            registry: self.agent.registry().clone(),
            spare: self.spare.clone(),
            manifest,
            plan,
            pulled: BTreeSet::new(),
            bytes: 0,
            seconds: 0.0,
        })
    }

    /// Reads the tensors `names` (every one not pulled yet when `None`)
    /// into `staging` over the agent's connections, in batches of about
    /// [`GROUP_BYTES`] started at once, checking each batch's checksums as
    /// soon as it landed. The tensors count as pulled only if every batch
    /// landed and every checksum matched; otherwise none of them does (a
    /// retry reads them again).
    pub async fn pull(
        &self,
        staging: &mut Staging,
        names: Option<&[String]>,
        timeout: Duration,
    ) -> Result<PullReport, SyncError> {
        let t0 = Instant::now();
        let wanted: Vec<usize> = match names {
            None => (0..staging.plan.len())
                .filter(|&i| !staging.pulled.contains(&staging.plan[i].0.name))
                .collect(),
            Some(names) => names
                .iter()
                .map(|n| {
                    staging
                        .plan
                        .iter()
                        .position(|(e, _)| &e.name == n)
                        .ok_or_else(|| SyncError::NotPublished(n.clone()))
                })
                .collect::<Result<_, _>>()?,
        };
        if wanted.is_empty() {
            return Ok(PullReport::default());
        }
        let m = &staging.manifest;
        // Batches of about GROUP_BYTES, all started at once; each one's
        // checksums run on a blocking thread as soon as it landed, while
        // the later ones are still on the wire.
        let mut groups: Vec<Vec<usize>> = vec![Vec::new()];
        let mut acc = 0u64;
        for &i in &wanted {
            if acc >= GROUP_BYTES {
                groups.push(Vec::new());
                acc = 0;
            }
            acc += staging.plan[i].0.len;
            groups.last_mut().expect("one group at least").push(i);
        }
        let transfer_error = |first: usize, reason: String| SyncError::Transfer {
            addr: m.transfer_addr.clone(),
            tensors: wanted.len(),
            first: staging.plan[first].0.name.clone(),
            reason,
        };
        let mut batches = Vec::with_capacity(groups.len());
        for g in &groups {
            let mut transfers = Vec::with_capacity(g.len());
            for &i in g {
                let (e, dest) = &staging.plan[i];
                let local =
                    LocalSlice::grant(&staging.registry, &staging.reg, dest.offset as u64, e.len)
                        .map_err(|err| SyncError::Staging(err.to_string()))?;
                let remote = RemoteDescriptor {
                    agent_addr: m.transfer_addr.clone(),
                    segment: m.segment,
                    key: m.key,
                    epoch: m.epoch,
                    offset: e.offset,
                    len: e.len,
                };
                transfers.push((local, remote));
            }
            let b = self
                .agent
                .start(Direction::Read, transfers, None, timeout)
                .await
                .map_err(|e| transfer_error(g[0], e.to_string()))?;
            batches.push(b);
        }
        let mut sums = Vec::with_capacity(groups.len());
        let mut read_secs = 0.0;
        let mut failed = None;
        for (g, b) in groups.iter().zip(batches) {
            if failed.is_some() {
                b.cancel();
                continue;
            }
            if let Err(e) = b.wait().await {
                failed = Some(transfer_error(g[0], e.to_string()));
                continue;
            }
            read_secs = t0.elapsed().as_secs_f64();
            let base = staging.weights.region.base() as usize;
            let ranges: Vec<(usize, usize, usize)> = g
                .iter()
                .map(|&i| (i, staging.plan[i].1.offset, staging.plan[i].1.bytes()))
                .collect();
            let region = staging.weights.region.clone();
            sums.push(tokio::task::spawn_blocking(move || {
                let _held = region;
                ranges
                    .into_iter()
                    .map(|(i, off, n)| {
                        // SAFETY: the tensor lies inside the staging region
                        // (held above), and the batch that wrote it ended.
                        let bytes =
                            unsafe { std::slice::from_raw_parts((base + off) as *const u8, n) };
                        (i, checksum(bytes))
                    })
                    .collect::<Vec<_>>()
            }));
        }
        let mut got = Vec::with_capacity(wanted.len());
        for s in sums {
            got.extend(
                s.await
                    .map_err(|e| SyncError::Staging(format!("a checksum task failed: {e}")))?,
            );
        }
        if let Some(e) = failed {
            return Err(e);
        }
        let mut bytes = 0u64;
        for (i, sum) in got {
            let e = &staging.plan[i].0;
            if sum != e.crc32 {
                return Err(SyncError::Checksum {
                    name: e.name.clone(),
                    expected: e.crc32,
                    got: sum,
                });
            }
            bytes += e.len;
        }
        for &i in &wanted {
            staging.pulled.insert(staging.plan[i].0.name.clone());
        }
        let seconds = t0.elapsed().as_secs_f64();
        staging.bytes += bytes;
        staging.seconds += seconds;
        Ok(PullReport {
            tensors: wanted.len(),
            bytes,
            seconds,
            read_seconds: read_secs,
        })
    }
}

/// What one [`Puller::pull`] moved.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct PullReport {
    pub tensors: usize,
    pub bytes: u64,
    /// The whole pull: reads and checksums.
    pub seconds: f64,
    /// Of it, the reads.
    pub read_seconds: f64,
}

/// A sync in progress: the manifest, and a region laid out as the running
/// weights that the pulls fill.
pub struct Staging {
    weights: Weights,
    reg: Registration,
    registry: Arc<Registry>,
    spare: Arc<std::sync::Mutex<Option<Arc<Region>>>>,
    manifest: Manifest,
    plan: Vec<(TensorEntry, TensorRef)>,
    pulled: BTreeSet<String>,
    bytes: u64,
    seconds: f64,
}

impl Drop for Staging {
    fn drop(&mut self) {
        self.registry.deregister(self.reg.segment);
        *self.spare.lock().unwrap() = Some(self.weights.region.clone());
    }
}

impl Staging {
    pub fn manifest(&self) -> &Manifest {
        &self.manifest
    }

    /// Tensors pulled and checked, of all the model's.
    pub fn progress(&self) -> (usize, usize) {
        (self.pulled.len(), self.plan.len())
    }

    /// Bytes pulled and seconds spent pulling, over every pull so far.
    pub fn totals(&self) -> (u64, f64) {
        (self.bytes, self.seconds)
    }

    /// Bytes of the staging region.
    pub fn staged_bytes(&self) -> u64 {
        self.weights.region.len() as u64
    }

    /// The staged weights, once every tensor is pulled and checked.
    pub fn complete(&self) -> Result<Arc<Weights>, SyncError> {
        let missing: Vec<&str> = self
            .plan
            .iter()
            .map(|(e, _)| e.name.as_str())
            .filter(|n| !self.pulled.contains(*n))
            .collect();
        if let Some(first) = missing.first() {
            return Err(SyncError::Incomplete {
                missing: missing.len(),
                total: self.plan.len(),
                first: first.to_string(),
            });
        }
        Ok(Arc::new(self.weights.clone()))
    }
}
