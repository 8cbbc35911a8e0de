//! The engine's side: fetch a publisher's manifest, stage a copy of the
//! running weights' layout, and read the tensors one-sided into it, each
//! checked against its checksum. Nothing here touches the running weights:
//! the engine installs a complete staging in one switch.

use std::collections::BTreeSet;
use std::sync::Arc;
use std::time::{Duration, Instant};

use pdkv_model::weights::{TensorRef, Weights};
use pdkv_transfer::auth::KvSecret;
use pdkv_transfer::frame::Limits;
use pdkv_transfer::proto::Direction;
use pdkv_transfer::shm::{ShmImporter, ShmImporterConfig};
use pdkv_transfer::tcp::{Agent, AgentConfig, LocalSlice};
use pdkv_transfer::{Registration, Registry, RegistryOptions, RemoteDescriptor};
use pdkv_vmem::{Pool, Region, Tag};

use crate::manifest::{checksum, converts, plan, Manifest, MismatchError, TensorEntry};

/// Bytes per read batch of a pull over TCP (checksums of one overlap the
/// next).
const GROUP_BYTES: u64 = 8 << 20;
/// Bytes copied over shared memory before they are checksummed: small
/// enough to still be in the core's cache when the checksum reads them.
const SHM_PIECE: usize = 256 << 10;
/// Threads copying a pull over shared memory.
const SHM_LANES: usize = 2;
/// Bound on mapping a publisher's registration.
const MAP_TIMEOUT: Duration = Duration::from_secs(10);

/// How a puller reaches a publisher.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Transport {
    /// Shared memory when the publisher offers it and is on this host
    /// (its socket answers), TCP otherwise.
    #[default]
    Auto,
    Tcp,
    /// Shared memory or nothing.
    Shm,
}

impl Transport {
    pub fn parse(s: &str) -> Option<Transport> {
        match s {
            "auto" => Some(Transport::Auto),
            "tcp" => Some(Transport::Tcp),
            "shm" => Some(Transport::Shm),
            _ => None,
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            Transport::Auto => "auto",
            Transport::Tcp => "tcp",
            Transport::Shm => "shm",
        }
    }
}

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
/// staging region of its last sync, kept for the next one with its
/// registration (fresh memory costs the kernel's zeroing of every page,
/// more than the pull itself; a fresh registration the mapping of every
/// page again).
pub struct Puller {
    agent: Agent,
    http: reqwest::Client,
    secret: KvSecret,
    transport: Transport,
    spare: Arc<std::sync::Mutex<Option<Spare>>>,
    /// The conversion scratch of the last sync that had one, kept likewise.
    spare_scratch: Arc<std::sync::Mutex<Option<Spare>>>,
    /// The last publisher mapped over shared memory, kept for the next
    /// sync from it (mapping a registration fills its page tables: a cost
    /// of the order of the copy itself).
    mapped: std::sync::Mutex<Option<ShmSource>>,
}

/// A registered region a sync fills and the puller keeps for the next one:
/// the staging, or the conversion scratch.
struct Spare {
    region: Arc<Region>,
    reg: Registration,
}

impl Puller {
    /// An agent on loopback with `conns` connections per publisher.
    pub async fn new(secret: KvSecret, conns: usize) -> anyhow::Result<Puller> {
        Puller::bind("127.0.0.1", secret, conns).await
    }

    /// An agent on `ip` (port chosen by the system) with `conns`
    /// connections per publisher. Its address is where another engine
    /// reads this one's complete staging ([`Staging::relay_manifest`]).
    pub async fn bind(ip: &str, secret: KvSecret, conns: usize) -> anyhow::Result<Puller> {
        let registry = Arc::new(Registry::new(RegistryOptions::default()));
        let cfg = AgentConfig {
            secret: secret.clone(),
            conns_per_peer: conns.max(1),
            ..AgentConfig::default()
        };
        let agent = Agent::bind(&format!("{ip}:0"), registry, cfg).await?;
        let http = reqwest::Client::builder()
            .timeout(Duration::from_secs(30))
            .build()?;
        Ok(Puller {
            agent,
            http,
            secret,
            transport: Transport::Auto,
            spare: Arc::default(),
            spare_scratch: Arc::default(),
            mapped: std::sync::Mutex::new(None),
        })
    }

    /// Where this puller's agent serves reads of its stagings.
    pub fn agent_addr(&self) -> String {
        self.agent.local_addr().to_string()
    }

    /// How this puller reaches publishers (default [`Transport::Auto`]).
    pub fn with_transport(mut self, transport: Transport) -> Puller {
        self.transport = transport;
        self
    }

    pub fn transport(&self) -> Transport {
        self.transport
    }

    /// Bytes of the staging region (and conversion scratch) kept between
    /// syncs (0 before the first).
    pub fn spare_bytes(&self) -> u64 {
        [&self.spare, &self.spare_scratch]
            .iter()
            .map(|m| {
                m.lock()
                    .unwrap()
                    .as_ref()
                    .map_or(0, |s| s.region.len() as u64)
            })
            .sum()
    }

    /// Frees the staging region kept between syncs (an open staging is not
    /// affected; it becomes the spare when dropped), and lets go of the last
    /// publisher's shared memory.
    pub fn drop_spare(&self) {
        if let Some(s) = self.spare.lock().unwrap().take() {
            self.agent.registry().deregister(s.reg.segment);
        }
        if let Some(s) = self.spare_scratch.lock().unwrap().take() {
            self.agent.registry().deregister(s.reg.segment);
        }
        self.mapped.lock().unwrap().take();
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
    /// tensor's name, type, shape and size, allocates (or reuses) a region
    /// laid out as `layout` for the bytes, and, over shared memory, maps the
    /// publisher's registration (or reuses the last sync's mapping of it,
    /// kept until another publisher is mapped or [`Puller::drop_spare`]).
    pub async fn stage(&self, manifest: Manifest, layout: &Weights) -> Result<Staging, SyncError> {
        let plan: Vec<(TensorEntry, TensorRef)> = plan(&manifest, layout)?
            .into_iter()
            .map(|(e, t)| (e.clone(), t))
            .collect();
        let shm = self.connect_shm(&manifest, &plan).await?;
        // The last sync's region when nothing else holds it any more (an
        // installed staging is dropped by the engine after its switch).
        let kept = self.spare.lock().unwrap().take();
        let kept = match kept {
            Some(s)
                if Arc::strong_count(&s.region) == 1
                    && s.region.len() >= layout.layout_bytes()
                    && s.region.is_mapped() =>
            {
                Some(s)
            }
            Some(s) => {
                self.agent.registry().deregister(s.reg.segment);
                None
            }
            None => None,
        };
        let Spare { region, reg } = match kept {
            Some(s) => s,
            None => {
                let region = Pool::default()
                    .allocate(Tag::Weights, layout.layout_bytes())
                    .map_err(|e| SyncError::Staging(e.to_string()))?;
                let reg = self
                    .agent
                    .registry()
                    .register(&region, 0, region.len())
                    .map_err(|e| SyncError::Staging(e.to_string()))?;
                Spare { region, reg }
            }
        };
        let (scratch, landing) = self.scratch_for(&plan)?;
        Ok(Staging {
            weights: layout.with_region(region),
            reg,
            registry: self.agent.registry().clone(),
            spare: self.spare.clone(),
            spare_scratch: self.spare_scratch.clone(),
            shm,
            manifest,
            plan,
            scratch,
            landing,
            staged_crc: std::collections::HashMap::new(),
            pulled: BTreeSet::new(),
            bytes: 0,
            seconds: 0.0,
        })
    }

    /// Where the tensors published in a trainer's type land before they
    /// are converted: a registered region holding them one after the other
    /// (64-byte aligned), and each one's offset in it (`None`: read straight
    /// into the staging).
    fn scratch_for(
        &self,
        plan: &[(TensorEntry, TensorRef)],
    ) -> Result<(Option<Spare>, Vec<Option<usize>>), SyncError> {
        let mut at = 0usize;
        let landing: Vec<Option<usize>> = plan
            .iter()
            .map(|(e, dest)| {
                converts(e, dest).then(|| {
                    let off = at;
                    at = (at + e.len as usize).next_multiple_of(64);
                    off
                })
            })
            .collect();
        if at == 0 {
            return Ok((None, landing));
        }
        // The last one, when big enough and nothing else holds it.
        let kept = self.spare_scratch.lock().unwrap().take();
        match kept {
            Some(s)
                if Arc::strong_count(&s.region) == 1
                    && s.region.len() >= at
                    && s.region.is_mapped() =>
            {
                return Ok((Some(s), landing));
            }
            Some(s) => {
                self.agent.registry().deregister(s.reg.segment);
            }
            None => {}
        }
        let region = Pool::default()
            .allocate(Tag::Weights, at)
            .map_err(|e| SyncError::Staging(format!("the conversion scratch: {e}")))?;
        let reg = self
            .agent
            .registry()
            .register(&region, 0, region.len())
            .map_err(|e| SyncError::Staging(format!("the conversion scratch: {e}")))?;
        Ok((Some(Spare { region, reg }), landing))
    }

    /// The publisher's registration mapped over shared memory, when this
    /// puller's transport and the manifest allow it.
    async fn connect_shm(
        &self,
        m: &Manifest,
        plan: &[(TensorEntry, TensorRef)],
    ) -> Result<Option<ShmSource>, SyncError> {
        let ep = match (self.transport, &m.shm) {
            (Transport::Tcp, _) | (Transport::Auto, None) => return Ok(None),
            (Transport::Shm, None) => {
                return Err(SyncError::Transfer {
                    addr: m.transfer_addr.clone(),
                    tensors: plan.len(),
                    first: plan.first().map(|p| p.0.name.clone()).unwrap_or_default(),
                    reason: "the transport is shm, and the publisher does not share memory".into(),
                })
            }
            (_, Some(ep)) => ep.clone(),
        };
        let reg = Registration {
            segment: m.segment,
            key: m.key,
            epoch: m.epoch,
            len: ep.len,
        };
        // The same registration as last time, still mapped, its publisher
        // still there: reused as it is.
        {
            let mut cached = self.mapped.lock().unwrap();
            match cached.as_ref() {
                Some(c)
                    if c.path == ep.path
                        && c.reg == reg
                        && !c.importer.peer_lost()
                        && c.importer.mapped_epoch(reg.segment) == Some(reg.epoch) =>
                {
                    return Ok(Some(c.clone()));
                }
                _ => *cached = None,
            }
        }
        let cfg = ShmImporterConfig {
            workers: 1,
            secret: self.secret.clone(),
            ..ShmImporterConfig::default()
        };
        let path = ep.path.clone();
        let mapped = tokio::task::spawn_blocking(move || {
            let imp =
                ShmImporter::connect_with(std::path::Path::new(&path), Limits::default(), cfg)
                    .map_err(|e| format!("connecting to {path}: {e}"))?;
            imp.map(&reg, MAP_TIMEOUT)
                .map_err(|e| format!("mapping the publisher's weights: {e}"))?;
            Ok::<_, String>(imp)
        })
        .await
        .unwrap_or_else(|e| Err(format!("the mapping task failed: {e}")));
        match mapped {
            Ok(imp) => {
                let src = ShmSource {
                    importer: Arc::new(imp),
                    path: ep.path,
                    reg,
                };
                *self.mapped.lock().unwrap() = Some(src.clone());
                Ok(Some(src))
            }
            Err(reason) if self.transport == Transport::Auto => {
                tracing::info!(path = %ep.path, %reason, "the publisher's shared memory is out of reach; pulling over TCP");
                Ok(None)
            }
            Err(reason) => Err(SyncError::Transfer {
                addr: ep.path,
                tensors: plan.len(),
                first: plan.first().map(|p| p.0.name.clone()).unwrap_or_default(),
                reason,
            }),
        }
    }

    /// Reads the tensors `names` (every one not pulled yet when `None`)
    /// into `staging`, each checked against its checksum: copied from the
    /// publisher's shared memory when the staging mapped it, else read
    /// over TCP. The tensors count as pulled only if every byte landed and
    /// every checksum matched; otherwise none of them does (a retry reads
    /// them again).
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
        let via = match &staging.shm {
            Some(src) => {
                let got = pull_shm(staging, src, &wanted, Instant::now() + timeout).await;
                (got, "shm")
            }
            None => (self.pull_tcp(staging, &wanted, timeout, t0).await, "tcp"),
        };
        let ((got, read_secs), transport) = match via {
            (Ok(g), t) => (g, t),
            (Err(e), _) => return Err(e),
        };
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
        let t_convert = Instant::now();
        convert(staging, &wanted).await?;
        let convert_seconds = t_convert.elapsed().as_secs_f64();
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
            convert_seconds,
            transport,
        })
    }

    /// The TCP path of [`Puller::pull`]: batches of about [`GROUP_BYTES`]
    /// started at once over the agent's connections, each batch's checksums
    /// computed on a blocking thread as soon as it landed, while the later
    /// ones are still on the wire. Returns each tensor's checksum and the
    /// seconds until the last byte landed.
    async fn pull_tcp(
        &self,
        staging: &Staging,
        wanted: &[usize],
        timeout: Duration,
        t0: Instant,
    ) -> Result<(Vec<(usize, u32)>, f64), SyncError> {
        let m = &staging.manifest;
        let mut groups: Vec<Vec<usize>> = vec![Vec::new()];
        let mut acc = 0u64;
        for &i in wanted {
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
                let e = &staging.plan[i].0;
                let (_, reg, at) = staging.landing_of(i);
                let local = LocalSlice::grant(&staging.registry, reg, at as u64, e.len)
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
            let ranges: Vec<(usize, Arc<Region>, usize, usize)> = g
                .iter()
                .map(|&i| {
                    let (region, _, at) = staging.landing_of(i);
                    (i, region.clone(), at, staging.plan[i].0.len as usize)
                })
                .collect();
            sums.push(tokio::task::spawn_blocking(move || {
                ranges
                    .into_iter()
                    .map(|(i, region, off, n)| {
                        // SAFETY: the tensor lies inside its landing region
                        // (held here), and the batch that wrote it ended.
                        let bytes = unsafe {
                            std::slice::from_raw_parts(region.base().add(off).cast_const(), n)
                        };
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
        match failed {
            Some(e) => Err(e),
            None => Ok((got, read_secs)),
        }
    }
}

/// The shared-memory path of [`Puller::pull`]: [`SHM_LANES`] threads,
/// each copying its share of the tensors from the publisher's mapping into
/// the staging in pieces of [`SHM_PIECE`] and checksumming each piece while
/// it is still in cache, checking the deadline between pieces. Returns each
/// tensor's checksum and the seconds the copies took.
async fn pull_shm(
    staging: &Staging,
    src: &ShmSource,
    wanted: &[usize],
    deadline: Instant,
) -> Result<(Vec<(usize, u32)>, f64), SyncError> {
    let t0 = Instant::now();
    let m = &staging.manifest;
    // Dealt to the lanes largest first, each to the lane with the fewest
    // bytes so far.
    let mut jobs: Vec<ShmCopy> = wanted
        .iter()
        .map(|&i| {
            let e = &staging.plan[i].0;
            let (region, _, at) = staging.landing_of(i);
            ShmCopy {
                tensor: i,
                from: e.offset,
                to: region.base() as usize + at,
                len: e.len as usize,
            }
        })
        .collect();
    jobs.sort_by_key(|j| std::cmp::Reverse(j.len));
    let mut lanes: Vec<(usize, Vec<ShmCopy>)> = (0..SHM_LANES).map(|_| (0, Vec::new())).collect();
    for j in jobs {
        let lane = lanes.iter_mut().min_by_key(|l| l.0).expect("a lane");
        lane.0 += j.len;
        lane.1.push(j);
    }
    let (segment, epoch) = (m.segment, m.epoch);
    let mut tasks = Vec::new();
    for (_, lane) in lanes.into_iter().filter(|l| !l.1.is_empty()) {
        let importer = src.importer.clone();
        let held = (
            staging.weights.region.clone(),
            staging.scratch.as_ref().map(|s| s.region.clone()),
        );
        tasks.push(tokio::task::spawn_blocking(move || {
            let _held = held;
            let mut sums = Vec::with_capacity(lane.len());
            for ShmCopy {
                tensor: i,
                from,
                to,
                len: n,
            } in lane
            {
                let mut h = crc32fast::Hasher::new();
                let mut done = 0;
                while done < n {
                    if Instant::now() >= deadline {
                        return Err((i, "deadline passed".to_string()));
                    }
                    if importer.peer_lost() {
                        return Err((i, "the publisher was lost".to_string()));
                    }
                    let k = SHM_PIECE.min(n - done);
                    // SAFETY: the tensor lies inside its landing region
                    // (held by this task), which only this pull writes.
                    let dst = unsafe { std::slice::from_raw_parts_mut((to + done) as *mut u8, k) };
                    importer
                        .read(segment, epoch, from + done as u64, dst)
                        .map_err(|e| (i, e.to_string()))?;
                    h.update(dst);
                    done += k;
                }
                sums.push((i, h.finalize()));
            }
            Ok(sums)
        }));
    }
    let mut got = Vec::with_capacity(wanted.len());
    let mut failed = None;
    for t in tasks {
        match t.await {
            Ok(Ok(sums)) => got.extend(sums),
            Ok(Err((i, reason))) => {
                failed.get_or_insert(SyncError::Transfer {
                    addr: src.path.clone(),
                    tensors: wanted.len(),
                    first: staging.plan[i].0.name.clone(),
                    reason,
                });
            }
            Err(e) => {
                failed.get_or_insert(SyncError::Staging(format!("a copy task failed: {e}")));
            }
        }
    }
    match failed {
        Some(e) => Err(e),
        None => Ok((got, t0.elapsed().as_secs_f64())),
    }
}

/// One tensor of a pull over shared memory.
struct ShmCopy {
    tensor: usize,
    /// Where it lies in the publisher's registration.
    from: u64,
    /// The address it lands at (in the staging, or in the conversion
    /// scratch).
    to: usize,
    len: usize,
}

/// A publisher's registration mapped here over shared memory.
#[derive(Clone)]
struct ShmSource {
    importer: Arc<ShmImporter>,
    /// The publisher's socket.
    path: String,
    reg: Registration,
}

/// What one [`Puller::pull`] moved.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct PullReport {
    pub tensors: usize,
    pub bytes: u64,
    /// The whole pull: reads and checksums.
    pub seconds: f64,
    /// Of it, the reads (over shared memory, the copies with their
    /// checksums: one pass).
    pub read_seconds: f64,
    /// Of it, converting tensors published in a trainer's type into the
    /// engine's (0 when every tensor came as the engine stores it).
    pub convert_seconds: f64,
    /// `tcp` or `shm`.
    pub transport: &'static str,
}

/// A sync in progress: the manifest, and a region laid out as the running
/// weights that the pulls fill.
pub struct Staging {
    weights: Weights,
    reg: Registration,
    registry: Arc<Registry>,
    spare: Arc<std::sync::Mutex<Option<Spare>>>,
    spare_scratch: Arc<std::sync::Mutex<Option<Spare>>>,
    /// The publisher's registration, mapped (shared memory), or `None`:
    /// pulls go over TCP.
    shm: Option<ShmSource>,
    manifest: Manifest,
    plan: Vec<(TensorEntry, TensorRef)>,
    /// Where tensors published in a trainer's type land before conversion.
    scratch: Option<Spare>,
    /// Per tensor of the plan, its offset in `scratch` (`None`: it lands
    /// straight in the staging, as the engine stores it).
    landing: Vec<Option<usize>>,
    /// Checksums of converted tensors as staged (what a relay announces).
    staged_crc: std::collections::HashMap<usize, u32>,
    pulled: BTreeSet<String>,
    bytes: u64,
    seconds: f64,
}

impl Drop for Staging {
    /// The publisher's mapping goes now; the region and its registration
    /// become the puller's spare, and so does the conversion scratch (an
    /// older spare is deregistered).
    fn drop(&mut self) {
        self.shm = None;
        if let Some(s) = self.scratch.take() {
            if let Some(old) = self.spare_scratch.lock().unwrap().replace(s) {
                self.registry.deregister(old.reg.segment);
            }
        }
        let old = self.spare.lock().unwrap().replace(Spare {
            region: self.weights.region.clone(),
            reg: self.reg,
        });
        if let Some(old) = old {
            self.registry.deregister(old.reg.segment);
        }
    }
}

/// Converts the tensors of `wanted` that were published in a trainer's
/// type from the scratch into the staging (on a blocking thread), keeping
/// each one's staged checksum for a relay.
async fn convert(staging: &mut Staging, wanted: &[usize]) -> Result<(), SyncError> {
    let jobs: Vec<(usize, String, String, TensorRef, usize, usize)> = wanted
        .iter()
        .filter_map(|&i| {
            let (e, dest) = &staging.plan[i];
            let at = staging.landing[i]?;
            Some((
                i,
                e.name.clone(),
                e.dtype.clone(),
                dest.clone(),
                at,
                e.len as usize,
            ))
        })
        .collect();
    let Some(scratch) = staging.scratch.as_ref().map(|s| s.region.clone()) else {
        return Ok(());
    };
    let region = staging.weights.region.clone();
    let done = tokio::task::spawn_blocking(move || {
        let mut sums = Vec::with_capacity(jobs.len());
        for (i, name, dtype, dest, at, len) in jobs {
            // SAFETY: `at..at + len` lies inside the scratch (laid out by
            // `scratch_for`) and `dest` inside the staging (laid out as the
            // plan's layout); both are held here and only this pull touches
            // them, one after the other.
            let (src, dst) = unsafe {
                (
                    std::slice::from_raw_parts(scratch.base().add(at).cast_const(), len),
                    std::slice::from_raw_parts_mut(region.base().add(dest.offset), dest.bytes()),
                )
            };
            pdkv_model::loader::convert_tensor(&name, src, &dtype, &dest, dst)
                .map_err(|e| SyncError::Staging(format!("{e:#}")))?;
            sums.push((i, checksum(dst)));
        }
        Ok::<_, SyncError>(sums)
    })
    .await
    .map_err(|e| SyncError::Staging(format!("a conversion task failed: {e}")))??;
    staging.staged_crc.extend(done);
    Ok(())
}

impl Staging {
    /// Where tensor `i` of the plan lands: its region, that region's
    /// registration, and the offset in it.
    fn landing_of(&self, i: usize) -> (&Arc<Region>, &Registration, usize) {
        match (self.landing[i], &self.scratch) {
            (Some(at), Some(s)) => (&s.region, &s.reg, at),
            _ => (&self.weights.region, &self.reg, self.plan[i].1.offset),
        }
    }

    pub fn manifest(&self) -> &Manifest {
        &self.manifest
    }

    /// `shm` when the pulls copy from the publisher's shared memory, `tcp`
    /// otherwise.
    pub fn transport(&self) -> &'static str {
        match self.shm {
            Some(_) => "shm",
            None => "tcp",
        }
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

    /// This staging as a publisher's manifest, once every tensor is pulled
    /// and checked: another engine of the deployment pulls from it instead
    /// of from the trainer (a relay). The tensors lie where the staging
    /// holds them, read from `transfer_addr` (the puller's agent, see
    /// [`Puller::agent_addr`]) with the deployment's KV secret; their
    /// checksums are the publisher's.
    pub fn relay_manifest(&self, transfer_addr: String) -> Result<Manifest, SyncError> {
        self.complete()?;
        Ok(Manifest {
            protocol: crate::manifest::PROTOCOL,
            version: self.manifest.version.clone(),
            transfer_addr,
            segment: self.reg.segment,
            key: self.reg.key,
            epoch: self.reg.epoch,
            shm: None,
            tensors: self
                .plan
                .iter()
                .enumerate()
                .map(|(i, (e, dest))| match self.staged_crc.get(&i) {
                    // Converted: announced as staged, in the engine's type.
                    Some(&crc32) => TensorEntry {
                        name: e.name.clone(),
                        dtype: dest.dtype.name().into(),
                        shape: dest.shape.clone(),
                        offset: dest.offset as u64,
                        len: dest.bytes() as u64,
                        crc32,
                    },
                    None => TensorEntry {
                        offset: dest.offset as u64,
                        ..e.clone()
                    },
                })
                .collect(),
        })
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
