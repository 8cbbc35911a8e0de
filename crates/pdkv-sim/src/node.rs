//! One simulated engine process: the real [`EngineCore`] (scheduler,
//! lifecycle machine, core logic) with the real P/D connector core
//! ([`PdCore`] with its send and receive machines) behind a driver whose
//! I/O goes to the simulated network, the real memory pools (one per
//! tensor-parallel rank) and registry, and the simulated model.

use std::collections::VecDeque;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use pdkv_connector::config::KvTransferConfig;
use pdkv_connector::pd::core::{Io, PdCore};
use pdkv_connector::pd::{Driver, PdConnector, Shared};
use pdkv_connector::wire::Destination;
use pdkv_engine::lifecycle::WeightInfo;
use pdkv_engine::{Clock, CoreParts, EngineConfig, EngineCore, NoPublisher, RequestOutput};
use pdkv_transfer::{Registry, RegistryOptions};
use pdkv_vmem::{Pool, PoolOptions, RankPools};

use crate::model::{weights_path, Ids, Oracle, SharedOracle, SimModel};

/// KV blocks of every simulated engine.
pub const NUM_BLOCKS: usize = 48;

/// The simulation's clock: time moves only when the simulator says.
pub struct SimClock(Mutex<Instant>);

impl SimClock {
    pub fn new(t0: Instant) -> SimClock {
        SimClock(Mutex::new(t0))
    }

    pub fn set(&self, t: Instant) {
        let mut now = self.0.lock().unwrap();
        assert!(t >= *now, "simulated time runs backwards");
        *now = t;
    }
}

impl Clock for SimClock {
    fn now(&self) -> Instant {
        *self.0.lock().unwrap()
    }
}

/// The connector's driver: the I/O it asks for waits in `io` for the
/// simulator; deregistration is the registry's (TCP semantics), checked to
/// come while every rank's KV cache is still mapped, and failed on request
/// for one rank's segment (a shared-memory peer that never acknowledges its
/// unmap of that rank).
struct SimDriver {
    clock: Arc<SimClock>,
    io: Arc<Mutex<VecDeque<Io>>>,
    registry: Arc<Registry>,
    pools: RankPools,
    fail_release: Arc<Mutex<Option<u64>>>,
    oracle: SharedOracle,
    name: String,
}

impl Driver for SimDriver {
    fn now(&self) -> Instant {
        self.clock.now()
    }

    fn execute(&self, _shared: &Arc<Shared>, io: Io) {
        self.io.lock().unwrap().push_back(io);
    }

    fn deregister(&self, segment: u64, _timeout: Duration) -> anyhow::Result<()> {
        if !self.pools.is_awake(pdkv_vmem::Tag::KvCache) {
            let v = format!(
                "{}: the KV cache registration is released after the KV cache was unmapped",
                self.name
            );
            self.oracle.lock().unwrap().violations.push(v);
        }
        let mut fail = self.fail_release.lock().unwrap();
        if *fail == Some(segment) {
            *fail = None;
            anyhow::bail!(
                "a shared-memory peer did not acknowledge unmapping segment {segment} (injected)"
            );
        }
        self.registry.deregister(segment);
        Ok(())
    }

    fn timer_changed(&self, _shared: &Arc<Shared>) {}
}

/// What a node is, once built.
pub struct Node {
    pub name: String,
    /// Its control listener (the `remote_bootstrap_addr` D uses).
    pub addr: String,
    /// Where peers reach its KV.
    pub transfer_addr: String,
    pub core: EngineCore,
    pub conn: Arc<Shared>,
    pub io: Arc<Mutex<VecDeque<Io>>>,
    pub registry: Arc<Registry>,
    /// One pool per tensor-parallel rank.
    pub pools: RankPools,
    pub oracle: SharedOracle,
    /// Outputs the engine produced, by request id, in order.
    pub outputs: Arc<Mutex<Vec<(String, RequestOutput)>>>,
    /// The connector has news for the core.
    pub woke: Arc<AtomicBool>,
    /// The weights it serves (the simulated model's id).
    pub weights: u64,
    /// The deregistration of this segment (one rank's KV cache) fails
    /// once.
    pub fail_release: Arc<Mutex<Option<u64>>>,
    /// Tensor-parallel ranks.
    pub tp: usize,
}

/// How to build one.
pub struct NodeSpec<'a> {
    pub name: &'a str,
    pub addr: String,
    pub transfer_addr: String,
    pub kv_config: &'a str,
    pub weights: u64,
    pub key_seed: u64,
    /// Tensor-parallel ranks (1 to [`crate::model::NUM_KV_HEADS`]).
    pub tp: usize,
}

pub fn engine_config(tp: usize) -> EngineConfig {
    EngineConfig {
        max_num_seqs: 8,
        max_num_batched_tokens: 64,
        num_kv_blocks: NUM_BLOCKS,
        kv_cache_dtype: pdkv_model::KvDtype::F32,
        enable_prefix_caching: true,
        max_model_len: Some(NUM_BLOCKS * pdkv_model::BLOCK_SIZE),
        enable_sleep_mode: true,
        kv_release_timeout: Duration::from_secs(5),
        tensor_parallel_size: tp,
        speculative: None,
    }
}

impl Node {
    pub fn build(spec: NodeSpec<'_>, clock: Arc<SimClock>) -> anyhow::Result<Node> {
        let ranks: Vec<Pool> = (0..spec.tp)
            .map(|_| {
                Pool::new(PoolOptions {
                    chunk_size: 4096,
                    single_allocation: false,
                })
            })
            .collect();
        let oracle: SharedOracle = Arc::new(Mutex::new(Oracle::default()));
        let model = SimModel::new(&ranks, NUM_BLOCKS, spec.name, oracle.clone(), spec.weights)?;
        let pools = RankPools::new(ranks);
        let registry = Arc::new(Registry::new(RegistryOptions {
            key_seed: Some(spec.key_seed),
            ..RegistryOptions::default()
        }));
        let io = Arc::new(Mutex::new(VecDeque::new()));
        let cfg = KvTransferConfig::parse(spec.kv_config)?;
        let dest = Destination::Tcp {
            addr: spec.transfer_addr.clone(),
        };
        let pd = PdCore::new(cfg, spec.name, spec.addr.clone(), dest, registry.clone());
        let fail_release = Arc::new(Mutex::new(None));
        let driver = SimDriver {
            clock: clock.clone(),
            io: io.clone(),
            registry: registry.clone(),
            pools: pools.clone(),
            fail_release: fail_release.clone(),
            oracle: oracle.clone(),
            name: spec.name.to_string(),
        };
        let connector = PdConnector::with_driver(pd, Box::new(driver));
        let conn = connector.shared().clone();
        let woke = Arc::new(AtomicBool::new(false));
        let waker = {
            let w = woke.clone();
            Arc::new(move || w.store(true, Ordering::Release))
        };
        let core = EngineCore::new(CoreParts {
            runner: Box::new(model),
            pools: pools.clone(),
            config: engine_config(spec.tp),
            connector: Some(Box::new(connector)),
            waker,
            decoder: Arc::new(Ids),
            eos_token_ids: Vec::new(),
            weight_info: WeightInfo {
                version: Some(version(spec.weights)),
                path: weights_path(spec.weights).into(),
            },
            clock,
            publisher: Box::new(NoPublisher),
        })?;
        Ok(Node {
            name: spec.name.to_string(),
            addr: spec.addr,
            transfer_addr: spec.transfer_addr,
            core,
            conn,
            io,
            registry,
            pools,
            oracle,
            outputs: Arc::new(Mutex::new(Vec::new())),
            woke,
            weights: spec.weights,
            fail_release,
            tp: spec.tp,
        })
    }

    /// Whether the connector woke the core since the last look.
    pub fn take_woken(&self) -> bool {
        self.woke.swap(false, Ordering::AcqRel)
    }
}

/// The version string of weights id `w`.
pub fn version(w: u64) -> String {
    format!("w{w}")
}
