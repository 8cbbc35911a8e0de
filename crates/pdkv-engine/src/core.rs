//! The engine core: a thread that owns the model, the KV cache and the
//! scheduler, and drives them step by step.
//!
//! Threading: callers talk to the core through a bounded command channel
//! (`std::sync::mpsc::sync_channel`); the core answers each request on its own
//! output channel. The core blocks on the command channel (with a timeout)
//! when it has nothing to do, so an idle engine does not spin.
//!
//! Invariants:
//! - every accepted request ends exactly once: its last [`RequestOutput`]
//!   carries a finish reason, after which its id is free again;
//! - a request whose stream is gone (dropped by a disconnecting client) is
//!   aborted, and its blocks freed, at the latest when its next output finds
//!   the receiver closed;
//! - a failing (or panicking) forward pass ends the requests of that step
//!   with [`FinishReason::Abort`] and the core keeps serving;
//! - lifecycle operations (pause, sleep, wake, release, weight reload) run on
//!   the core thread between steps, decided by [`crate::lifecycle::Machine`];
//!   a step runs only when the machine allows it *and* the weights, KV cache
//!   and runtime regions are all mapped, so the model never touches released
//!   memory;
//! - admission is ordered with the lifecycle: a request accepted by
//!   `add_request` is in the command channel before any pause or sleep that
//!   refuses it (both are sent under one lock, and a refusing command counts
//!   as closing admission from the moment it is sent until the core has
//!   published the refusal). Every caller's wait on the core is bounded.

use std::collections::HashMap;
use std::hash::{BuildHasher, Hasher};
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::mpsc::{Receiver, RecvTimeoutError, SyncSender, TryRecvError, TrySendError};
use std::sync::{Arc, Condvar, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use pdkv_model::{ChatTemplate, KvCache, LoadedModel, Model, ModelConfig, SeqInput, Tokenizer, Workspace};
use pdkv_vmem::{Pool, Tag};
use tokio::sync::mpsc::{unbounded_channel, UnboundedReceiver, UnboundedSender};

use crate::connector::{KvCacheSpec, KvConnector};
use crate::detok::{IncrementalDetokenizer, StopChecker};
use crate::sampling::{sample, SamplingConfig};
use crate::scheduler::{NewRequest, Scheduler, SchedulerConfig, SchedulerOutput};
use crate::lifecycle::{Action, Completion, LifecycleError, LifecycleStatus, Machine, Outcome, PauseMode, SleepLevel, Ticket, WeightInfo};
use crate::{AddRequestError, EngineConfig, EngineRequest, EngineStats, FinishReason, RequestOutput};

/// Commands waiting for the core, at most. A full channel makes
/// `add_request` wait for the core's next drain (one step).
const COMMAND_CAPACITY: usize = 4096;

/// How long an idle core sleeps on the command channel before looking again.
const IDLE_WAIT: Duration = Duration::from_millis(200);

/// Longest a caller waits for the core to answer a lifecycle command (beyond
/// the operation's own timeout, if it has one). The core answers between
/// steps, so this only bounds a wedged core.
const CONTROL_WAIT: Duration = Duration::from_secs(120);

/// Longest a caller waits for a weight reload (reading and converting a
/// checkpoint on the core thread).
const UPDATE_WEIGHTS_WAIT: Duration = Duration::from_secs(600);

type Reply = SyncSender<Result<(), LifecycleError>>;

enum Command {
    Add(Box<AddCommand>),
    /// `serial` set: only that incarnation of the id (a dropped stream).
    Abort {
        id: Arc<str>,
        serial: Option<u64>,
    },
    ResetPrefixCache {
        reset_running: bool,
        reply: SyncSender<bool>,
    },
    Pause {
        mode: PauseMode,
        clear_cache: bool,
        deadline: Instant,
        reply: Reply,
    },
    Resume(Reply),
    Sleep {
        level: SleepLevel,
        mode: PauseMode,
        deadline: Instant,
        reply: Reply,
    },
    Wake {
        tags: Option<Vec<Tag>>,
        reply: Reply,
    },
    ReleaseKv(Reply),
    AbortRequests {
        ids: Vec<String>,
        reply: SyncSender<Vec<String>>,
    },
    UpdateWeights {
        path: PathBuf,
        version: Option<String>,
        reply: Reply,
    },
    /// The KV connector has news (a finished transfer); nothing else.
    Nudge,
    Shutdown,
}

impl Command {
    /// Whether the command refuses new requests once applied (see the module
    /// docs on admission ordering).
    fn closes_admission(&self) -> bool {
        matches!(
            self,
            Command::Pause { mode: PauseMode::Abort | PauseMode::Wait, .. } | Command::Sleep { .. }
        )
    }

    /// Answers a command that the core will never apply.
    fn refuse_stopped(self, shared: &Shared) {
        if self.closes_admission() {
            shared.closing_in_flight.fetch_sub(1, Ordering::SeqCst);
        }
        match self {
            Command::Add(add) => {
                shared.add_taken();
                let _ = add.tx.send(abort_output(&add.req));
            }
            Command::ResetPrefixCache { reply, .. } => {
                let _ = reply.try_send(false);
            }
            Command::AbortRequests { reply, .. } => {
                let _ = reply.try_send(Vec::new());
            }
            Command::Pause { reply, .. }
            | Command::Resume(reply)
            | Command::Sleep { reply, .. }
            | Command::Wake { reply, .. }
            | Command::ReleaseKv(reply)
            | Command::UpdateWeights { reply, .. } => {
                let _ = reply.try_send(Err(LifecycleError::Stopped));
            }
            Command::Abort { .. } | Command::Nudge | Command::Shutdown => {}
        }
    }
}

struct AddCommand {
    serial: u64,
    req: EngineRequest,
    seed: u64,
    tx: UnboundedSender<RequestOutput>,
}

/// The published stats plus what callers did since the core last looked.
///
/// Accepted requests still in the command channel count as waiting, so a
/// snapshot never looks idle while an accepted request is unseen by the core.
struct StatsState {
    stats: EngineStats,
    /// Adds sent but not yet applied by the core.
    pending_adds: usize,
}

/// State shared between handles and the core.
struct Shared {
    stats: Mutex<StatsState>,
    /// Notified whenever `stats` is republished.
    stats_changed: Condvar,
    /// Live request ids and the serial of their current incarnation.
    live: Mutex<HashMap<String, u64>>,
    stopped: AtomicBool,
    next_serial: AtomicU64,
    /// Why new requests are refused now (`None`: accepted), published by
    /// the core after each lifecycle change.
    refusal: Mutex<Option<String>>,
    /// Admission-closing commands sent but not yet applied by the core.
    closing_in_flight: AtomicUsize,
    lifecycle: Mutex<LifecycleStatus>,
    weight_info: Mutex<WeightInfo>,
}

impl Shared {
    /// A caller sent an add (`delta` = +1) or took a failed one back (-1):
    /// the snapshot counts it as waiting at once.
    fn add_pending(&self, delta: isize) {
        let mut st = self.stats.lock().unwrap();
        st.pending_adds = st.pending_adds.checked_add_signed(delta).expect("pending add count underflow");
        st.stats.num_waiting = st.stats.num_waiting.checked_add_signed(delta).expect("waiting count underflow");
    }

    /// The core took an add from the channel. The snapshot keeps counting it
    /// as waiting until the core publishes the scheduler's view.
    fn add_taken(&self) {
        let mut st = self.stats.lock().unwrap();
        st.pending_adds = st.pending_adds.checked_sub(1).expect("pending add count underflow");
    }
}

struct Inner {
    cmd_tx: SyncSender<Command>,
    /// Held while sending an `Add` or a lifecycle command, so that the
    /// admission check and the send are one step (see the module docs).
    send_lock: Mutex<()>,
    shared: Arc<Shared>,
    tokenizer: Arc<Tokenizer>,
    config: EngineConfig,
    model_name: String,
    chat_template: Option<ChatTemplate>,
    model_config: ModelConfig,
    pool: Pool,
    max_model_len: usize,
    /// The connector's [`KvConnector::info`], if the engine has one.
    connector_info: Option<serde_json::Value>,
    params_validator: Option<crate::connector::ParamsValidator>,
    connector_metrics: Option<crate::connector::MetricsReader>,
    thread: Mutex<Option<JoinHandle<()>>>,
}

impl Inner {
    fn shutdown(&self) {
        let handle = self.thread.lock().unwrap().take();
        let Some(handle) = handle else { return };
        // A send fails only if the core already exited.
        let _ = self.cmd_tx.send(Command::Shutdown);
        if handle.join().is_err() {
            tracing::error!("engine core thread panicked");
        }
        self.shared.stopped.store(true, Ordering::SeqCst);
    }
}

impl Drop for Inner {
    fn drop(&mut self) {
        self.shutdown();
    }
}

/// Starts engines.
pub struct Engine;

impl Engine {
    /// Allocates the KV cache (`num_kv_blocks` blocks) and workspace in `pool`
    /// and starts the engine core thread.
    pub fn start(model: LoadedModel, pool: Pool, config: EngineConfig) -> anyhow::Result<EngineHandle> {
        Engine::start_with_connector(model, pool, config, None)
    }

    /// [`Engine::start`] with a KV connector: its `register_kv_caches` is
    /// called with the new KV cache before the core starts, and the core
    /// drives it from then on (see [`crate::connector`]).
    pub fn start_with_connector(
        model: LoadedModel,
        pool: Pool,
        config: EngineConfig,
        connector: Option<Box<dyn KvConnector>>,
    ) -> anyhow::Result<EngineHandle> {
        use anyhow::Context;
        anyhow::ensure!(config.max_num_seqs > 0, "max_num_seqs must be at least 1");
        anyhow::ensure!(config.max_num_batched_tokens > 0, "max_num_batched_tokens must be at least 1");
        anyhow::ensure!(config.num_kv_blocks > 0, "num_kv_blocks must be at least 1");
        let LoadedModel { model, tokenizer, chat_template, name, source } = model;
        let model_config = model.config().clone();
        let max_model_len = config.max_model_len.unwrap_or(model_config.max_position_embeddings);
        anyhow::ensure!(max_model_len > 0, "max_model_len must be at least 1");
        let capacity = config.num_kv_blocks * pdkv_model::BLOCK_SIZE;
        if max_model_len > capacity {
            tracing::warn!(
                max_model_len,
                capacity,
                "the KV cache holds fewer tokens than the context; longer requests are refused"
            );
        }
        let kv = KvCache::new(&pool, &model_config, config.num_kv_blocks).context("allocating the KV cache")?;
        let ws = Workspace::new(&pool, &model_config, config.max_num_batched_tokens)
            .context("allocating the runtime workspace")?;
        let tokenizer = Arc::new(tokenizer);
        let connector_info = connector.as_ref().map(|c| c.info());
        let params_validator = connector.as_ref().map(|c| c.params_validator());
        let connector_metrics = connector.as_ref().and_then(|c| c.metrics_reader());
        let shared = Arc::new(Shared {
            stats: Mutex::new(StatsState {
                stats: EngineStats {
                    kv_blocks_total: config.num_kv_blocks,
                    kv_blocks_free: config.num_kv_blocks,
                    ..EngineStats::default()
                },
                pending_adds: 0,
            }),
            stats_changed: Condvar::new(),
            live: Mutex::new(HashMap::new()),
            stopped: AtomicBool::new(false),
            next_serial: AtomicU64::new(0),
            refusal: Mutex::new(None),
            closing_in_flight: AtomicUsize::new(0),
            lifecycle: Mutex::new(Machine::new().status()),
            weight_info: Mutex::new(WeightInfo { version: None, path: source }),
        });
        let (cmd_tx, cmd_rx) = std::sync::mpsc::sync_channel(COMMAND_CAPACITY);
        let eos_ids = tokenizer
            .eos_token_ids()
            .iter()
            .chain(&model_config.eos_token_ids)
            .copied()
            .collect::<std::collections::BTreeSet<u32>>()
            .into_iter()
            .collect();
        let sched_config = SchedulerConfig {
            max_num_seqs: config.max_num_seqs,
            max_num_batched_tokens: config.max_num_batched_tokens,
            num_blocks: config.num_kv_blocks,
            enable_prefix_caching: config.enable_prefix_caching,
        };
        let has_connector = connector.is_some();
        if let Some(c) = &connector {
            anyhow::ensure!(
                !config.enable_sleep_mode || c.supports_sleep_mode(),
                "sleep mode is enabled but KV connector {} does not support it (it cannot release and restore its KV cache registrations)",
                c.name()
            );
        }
        let sched = match connector {
            Some(mut c) => {
                let spec = KvCacheSpec {
                    region: kv.region().clone(),
                    num_blocks: kv.num_blocks(),
                    block_bytes: kv.block_bytes(),
                    block_size: kv.block_size(),
                    layout: format!(
                        "{}:layers={}:kv_dim={}:block={}:f32",
                        model_config.arch.as_str(),
                        kv.num_layers(),
                        kv.kv_dim(),
                        kv.block_size()
                    ),
                };
                let nudge = cmd_tx.clone();
                c.set_waker(Arc::new(move || {
                    // A full channel means the core has commands to read
                    // and will look at the connector anyway.
                    let _ = nudge.try_send(Command::Nudge);
                }));
                c.register_kv_caches(&spec).with_context(|| format!("registering the KV cache with connector {}", c.name()))?;
                Scheduler::with_connector(sched_config, c)
            }
            None => Scheduler::new(sched_config),
        };
        let core = Core {
            sched,
            model,
            kv,
            ws,
            tokenizer: tokenizer.clone(),
            vocab: model_config.vocab_size,
            eos_ids,
            reqs: HashMap::new(),
            shared: shared.clone(),
            rx: cmd_rx,
            logits: Vec::new(),
            steps: 0,
            pool: pool.clone(),
            lc: Machine::new(),
            replies: HashMap::new(),
            next_ticket: 0,
            mapped: true,
            has_connector,
            sleep_mode: config.enable_sleep_mode,
            release_timeout: config.kv_release_timeout,
            lc_stats: LifecycleStats::default(),
            closing: false,
        };
        let thread = std::thread::Builder::new()
            .name("pdkv-engine-core".into())
            .spawn(move || core.run())
            .context("spawning the engine core thread")?;
        Ok(EngineHandle {
            inner: Arc::new(Inner {
                cmd_tx,
                send_lock: Mutex::new(()),
                shared,
                tokenizer,
                config,
                model_name: name,
                chat_template,
                model_config,
                pool,
                max_model_len,
                connector_info,
                params_validator,
                connector_metrics,
                thread: Mutex::new(Some(thread)),
            }),
        })
    }
}

/// A cheap, cloneable handle to a running engine. The engine stops when the
/// last handle is dropped (or at [`EngineHandle::shutdown`]).
#[derive(Clone)]
pub struct EngineHandle {
    inner: Arc<Inner>,
}

fn random_seed() -> u64 {
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    h.write_u64(0x5eed);
    h.finish()
}

impl EngineHandle {
    fn validate(&self, req: &EngineRequest) -> Result<(), AddRequestError> {
        let p = &req.params;
        let invalid = |m: String| Err(AddRequestError::Invalid(m));
        if req.prompt_tokens.is_empty() {
            return invalid("the prompt is empty".into());
        }
        if let Some(check) = &self.inner.params_validator {
            if let Err(e) = check(req.kv_transfer_params.as_ref()) {
                return invalid(format!("kv_transfer_params: {e}"));
            }
        }
        if p.max_tokens < 1 {
            return invalid("max_tokens must be at least 1".into());
        }
        if !(p.temperature >= 0.0 && p.temperature.is_finite()) {
            return invalid(format!("temperature must be >= 0, got {}", p.temperature));
        }
        if !(p.top_p > 0.0 && p.top_p <= 1.0) {
            return invalid(format!("top_p must be in (0, 1], got {}", p.top_p));
        }
        if p.stop.iter().any(|s| s.is_empty()) {
            return invalid("stop strings must not be empty".into());
        }
        let vocab = self.inner.model_config.vocab_size;
        if let Some(&t) = req.prompt_tokens.iter().find(|&&t| t as usize >= vocab) {
            return invalid(format!("prompt token id {t} is outside the vocabulary of {vocab}"));
        }
        if let Some(&t) = p.stop_token_ids.iter().find(|&&t| t as usize >= vocab) {
            return invalid(format!("stop token id {t} is outside the vocabulary of {vocab}"));
        }
        let prompt = req.prompt_tokens.len();
        let max_tokens = p.max_tokens as usize;
        if prompt + max_tokens > self.inner.max_model_len {
            return Err(AddRequestError::TooLong { prompt, max_tokens, max_model_len: self.inner.max_model_len });
        }
        let needed = Scheduler::max_blocks_needed(prompt, max_tokens);
        let total = self.inner.config.num_kv_blocks;
        if needed > total {
            return Err(AddRequestError::ExceedsKvCapacity { needed, total });
        }
        Ok(())
    }

    /// Validates and enqueues a request.
    pub fn add_request(&self, req: EngineRequest) -> Result<RequestStream, AddRequestError> {
        let shared = &self.inner.shared;
        if shared.stopped.load(Ordering::SeqCst) {
            return Err(AddRequestError::Stopped);
        }
        self.validate(&req)?;
        // Admission check and send under one lock: a pause or sleep sent
        // after this request is behind it in the channel.
        let _send = self.inner.send_lock.lock().unwrap();
        // The counter first: a closing command decrements it only after the
        // core published its refusal.
        if shared.closing_in_flight.load(Ordering::SeqCst) > 0 {
            return Err(AddRequestError::Unavailable("the engine is pausing; retry after /resume".into()));
        }
        if let Some(reason) = shared.refusal.lock().unwrap().clone() {
            return Err(AddRequestError::Unavailable(reason));
        }
        let serial = shared.next_serial.fetch_add(1, Ordering::Relaxed);
        {
            let mut live = shared.live.lock().unwrap();
            if live.contains_key(&req.id) {
                return Err(AddRequestError::DuplicateId(req.id));
            }
            live.insert(req.id.clone(), serial);
        }
        let seed = req.params.seed.unwrap_or_else(random_seed);
        // Unbounded on purpose: a request sends at most max_tokens + 1
        // messages (one per token, plus an abort), so max_tokens bounds it.
        let (tx, rx) = unbounded_channel();
        let id = req.id.clone();
        let cmd = Command::Add(Box::new(AddCommand { serial, req, seed, tx }));
        shared.add_pending(1);
        if self.inner.cmd_tx.send(cmd).is_err() {
            shared.add_pending(-1);
            shared.live.lock().unwrap().remove(&id);
            return Err(AddRequestError::Stopped);
        }
        Ok(RequestStream { id, serial, rx, cmd_tx: self.inner.cmd_tx.clone(), done: false })
    }

    /// Aborts a request by id; unknown or finished ids are ignored (returns false).
    pub fn abort(&self, request_id: &str) -> bool {
        if !self.inner.shared.live.lock().unwrap().contains_key(request_id) {
            return false;
        }
        self.inner.cmd_tx.send(Command::Abort { id: Arc::from(request_id), serial: None }).is_ok()
    }

    /// Drops every prefix-cache entry. Returns false while any KV block is in
    /// use (a request is running) or when the engine stopped. Blocks the
    /// caller until the core answers, which it does before its next step.
    pub fn reset_prefix_cache(&self) -> bool {
        self.reset_prefix_cache_with(false)
    }

    /// Sends a command built around a fresh reply channel and waits (at most
    /// `wait`) for the core's answer.
    fn control<T>(
        &self,
        wait: Duration,
        make: impl FnOnce(SyncSender<T>) -> Command,
    ) -> Result<T, LifecycleError> {
        let shared = &self.inner.shared;
        if shared.stopped.load(Ordering::SeqCst) {
            return Err(LifecycleError::Stopped);
        }
        let (tx, rx) = std::sync::mpsc::sync_channel(1);
        let cmd = make(tx);
        {
            let _send = self.inner.send_lock.lock().unwrap();
            let closes = cmd.closes_admission();
            if closes {
                shared.closing_in_flight.fetch_add(1, Ordering::SeqCst);
            }
            if self.inner.cmd_tx.send(cmd).is_err() {
                if closes {
                    shared.closing_in_flight.fetch_sub(1, Ordering::SeqCst);
                }
                return Err(LifecycleError::Stopped);
            }
        }
        match rx.recv_timeout(wait) {
            Ok(v) => Ok(v),
            Err(RecvTimeoutError::Timeout) => Err(LifecycleError::Timeout(format!(
                "the engine core did not answer within {:.0} s",
                wait.as_secs_f64()
            ))),
            Err(RecvTimeoutError::Disconnected) => Err(LifecycleError::Stopped),
        }
    }

    pub fn stats(&self) -> EngineStats {
        self.inner.shared.stats.lock().unwrap().stats.clone()
    }

    /// Waits until the stats satisfy `pred` (checked now and at every update
    /// by the core) and returns them, or `None` after `timeout`. Blocks the
    /// calling thread: for tests and tools, not for async handlers.
    pub fn wait_stats(&self, timeout: Duration, mut pred: impl FnMut(&EngineStats) -> bool) -> Option<EngineStats> {
        let deadline = Instant::now() + timeout;
        let shared = &self.inner.shared;
        let mut stats = shared.stats.lock().unwrap();
        loop {
            if pred(&stats.stats) {
                return Some(stats.stats.clone());
            }
            let left = deadline.checked_duration_since(Instant::now())?;
            stats = shared.stats_changed.wait_timeout(stats, left).unwrap().0;
        }
    }

    pub fn tokenizer(&self) -> &Arc<Tokenizer> {
        &self.inner.tokenizer
    }

    pub fn config(&self) -> &EngineConfig {
        &self.inner.config
    }

    /// The model's short name (for `/v1/models`).
    pub fn model_name(&self) -> &str {
        &self.inner.model_name
    }

    pub fn chat_template(&self) -> Option<&ChatTemplate> {
        self.inner.chat_template.as_ref()
    }

    pub fn model_config(&self) -> &ModelConfig {
        &self.inner.model_config
    }

    /// The memory pool holding weights, KV cache and runtime scratch.
    pub fn pool(&self) -> &Pool {
        &self.inner.pool
    }

    /// The model's context length as the engine enforces it.
    /// What the KV connector says about itself (engine id, role,
    /// addresses); `None` without a connector.
    pub fn kv_connector_info(&self) -> Option<&serde_json::Value> {
        self.inner.connector_info.as_ref()
    }

    /// The KV connector's counters now (see [`crate::connector::MetricsReader`]).
    pub fn kv_connector_metrics(&self) -> Vec<(&'static str, &'static str, f64)> {
        self.inner.connector_metrics.as_ref().map(|m| m()).unwrap_or_default()
    }

    pub fn max_model_len(&self) -> usize {
        self.inner.max_model_len
    }

    /// True once the engine stopped (shutdown or a dead core thread).
    pub fn is_stopped(&self) -> bool {
        self.inner.shared.stopped.load(Ordering::SeqCst)
    }

    /// Pauses scheduling; see [`PauseMode`]. `clear_cache` also resets the
    /// prefix cache once the pause is complete (with `keep`, only free blocks
    /// lose their cache entries). Returns when the pause is complete: at once
    /// for `abort` (requests aborted) and `keep` (requests frozen), for `wait`
    /// when every live request finished — or `Timeout` at `timeout`, the
    /// pause staying in effect. Blocks the calling thread.
    pub fn pause(&self, mode: PauseMode, clear_cache: bool, timeout: Duration) -> Result<(), LifecycleError> {
        let deadline = Instant::now() + timeout;
        self.control(timeout + CONTROL_WAIT, |reply| Command::Pause { mode, clear_cache, deadline, reply })?
    }

    /// Ends a pause (a no-op when not paused). A pending `wait` pause or
    /// sleep fails with `Cancelled`; a KV cache released by
    /// [`EngineHandle::release_kv_cache_memory`] is mapped again first.
    pub fn resume(&self) -> Result<(), LifecycleError> {
        self.control(CONTROL_WAIT, Command::Resume)?
    }

    /// Pauses (with `mode`, as [`EngineHandle::pause`]) and releases memory
    /// per `level`: level 1 offloads the weights to host memory and discards
    /// the KV cache, level 2 discards both (weights must then be reloaded
    /// with [`EngineHandle::update_weights`]). Level >= 1 preempts frozen
    /// requests for recompute and invalidates the prefix cache. Sleeping
    /// while asleep succeeds (a deeper level releases more).
    pub fn sleep(&self, level: SleepLevel, mode: PauseMode, timeout: Duration) -> Result<(), LifecycleError> {
        let deadline = Instant::now() + timeout;
        self.control(timeout + CONTROL_WAIT, |reply| Command::Sleep { level, mode, deadline, reply })?
    }

    /// Maps memory back for `tags` (weights and KV cache when `None`; the
    /// runtime scratch always). Scheduling resumes when every tag is awake;
    /// the final wake also ends a pause that the sleep started (an explicit
    /// pause stays until [`EngineHandle::resume`]). After a level-2 sleep,
    /// requests are refused until weights are reloaded. Waking an awake
    /// engine changes nothing.
    pub fn wake_up(&self, tags: Option<&[pdkv_vmem::Tag]>) -> Result<(), LifecycleError> {
        let tags = tags.map(<[Tag]>::to_vec);
        self.control(CONTROL_WAIT, |reply| Command::Wake { tags, reply })?
    }

    /// Releases the KV cache's physical memory: every block is freed
    /// (requests frozen by a `keep` pause are preempted for recompute) and
    /// the prefix cache invalidated. Needs a completed pause (`Conflict`
    /// otherwise). The KV cache comes back with `wake_up` or `resume`.
    pub fn release_kv_cache_memory(&self) -> Result<(), LifecycleError> {
        self.control(CONTROL_WAIT, Command::ReleaseKv)?
    }

    /// Resets the prefix cache; with `reset_running_requests`, running
    /// requests are preempted for recompute first. Returns false when it
    /// cannot reset now (blocks in use) or the engine stopped.
    pub fn reset_prefix_cache_with(&self, reset_running_requests: bool) -> bool {
        self.control(CONTROL_WAIT, |reply| Command::ResetPrefixCache { reset_running: reset_running_requests, reply })
            .unwrap_or(false)
    }

    /// Aborts the given requests; returns the ids that were live.
    pub fn abort_requests(&self, ids: &[String]) -> Vec<String> {
        let ids = ids.to_vec();
        self.control(CONTROL_WAIT, |reply| Command::AbortRequests { ids, reply }).unwrap_or_default()
    }

    /// Reloads weights from a checkpoint in place (same addresses), after
    /// checking the architecture and every tensor's shape against the running
    /// model: a checkpoint that does not fit is refused with
    /// `IncompatibleWeights` and the old weights keep serving. Needs the
    /// weights awake and no request running, unless a `keep` pause froze them
    /// (they are preempted and recompute with the new weights after resume);
    /// `Conflict` otherwise. Afterwards the prefix cache is invalidated and a
    /// level-2 "weights discarded" state ends.
    pub fn update_weights(&self, path: &std::path::Path, version: Option<String>) -> Result<(), LifecycleError> {
        let path = path.to_path_buf();
        self.control(UPDATE_WEIGHTS_WAIT, |reply| Command::UpdateWeights { path, version, reply })?
    }

    /// Where the weights being served came from.
    pub fn weight_info(&self) -> WeightInfo {
        self.inner.shared.weight_info.lock().unwrap().clone()
    }

    /// The lifecycle state as the core last published it (after every
    /// lifecycle change, before answering the command that made it).
    pub fn lifecycle_status(&self) -> LifecycleStatus {
        self.inner.shared.lifecycle.lock().unwrap().clone()
    }

    /// Stops the engine thread: running requests end with `Abort`. Waits for
    /// the thread to exit.
    pub fn shutdown(&self) {
        self.inner.shutdown();
    }
}

/// The outputs of one request. Dropping it before the final output aborts
/// the request.
pub struct RequestStream {
    id: String,
    serial: u64,
    rx: UnboundedReceiver<RequestOutput>,
    cmd_tx: SyncSender<Command>,
    done: bool,
}

impl RequestStream {
    pub fn request_id(&self) -> &str {
        &self.id
    }

    fn on_item(&mut self, item: Option<RequestOutput>) -> Option<RequestOutput> {
        match &item {
            Some(o) if o.finish_reason.is_none() => {}
            _ => self.done = true,
        }
        item
    }

    /// The next output; `None` after the final one.
    pub async fn next(&mut self) -> Option<RequestOutput> {
        if self.done {
            return None;
        }
        let item = self.rx.recv().await;
        self.on_item(item)
    }

    /// Blocking variant for threads outside an async runtime.
    pub fn blocking_next(&mut self) -> Option<RequestOutput> {
        if self.done {
            return None;
        }
        let item = self.rx.blocking_recv();
        self.on_item(item)
    }
}

impl Drop for RequestStream {
    fn drop(&mut self) {
        if self.done {
            return;
        }
        // Never block in drop. If the channel is full, the core still aborts
        // the request when its next output finds this receiver closed.
        let cmd = Command::Abort { id: Arc::from(self.id.as_str()), serial: Some(self.serial) };
        match self.cmd_tx.try_send(cmd) {
            Ok(()) | Err(TrySendError::Disconnected(_)) => {}
            Err(TrySendError::Full(_)) => tracing::debug!(id = %self.id, "command channel full; abort deferred"),
        }
    }
}

/// Per-request state the core keeps next to the scheduler's.
struct ActiveRequest {
    serial: u64,
    tx: UnboundedSender<RequestOutput>,
    sampling: SamplingConfig,
    return_logits: bool,
    detok: IncrementalDetokenizer,
    stops: StopChecker,
    num_prompt_tokens: usize,
    num_cached_tokens: usize,
}

impl ActiveRequest {
    fn output(&self, id: &str) -> RequestOutput {
        RequestOutput {
            request_id: id.to_string(),
            token_ids: Vec::new(),
            text: String::new(),
            finish_reason: None,
            num_prompt_tokens: self.num_prompt_tokens,
            num_cached_tokens: self.num_cached_tokens,
            logits: Vec::new(),
            kv_transfer_params: None,
            error: None,
        }
    }
}

/// Lifecycle counters published with the stats.
#[derive(Default)]
struct LifecycleStats {
    last_sleep_seconds: f64,
    last_wake_seconds: f64,
    last_weight_update_seconds: f64,
    num_sleeps: u64,
    num_wakes: u64,
    num_weight_updates: u64,
}

struct Core {
    sched: Scheduler,
    model: Model,
    kv: KvCache,
    ws: Workspace,
    tokenizer: Arc<Tokenizer>,
    vocab: usize,
    eos_ids: Vec<u32>,
    reqs: HashMap<Arc<str>, ActiveRequest>,
    shared: Arc<Shared>,
    rx: Receiver<Command>,
    logits: Vec<f32>,
    steps: u64,
    pool: Pool,
    lc: Machine,
    /// Deferred lifecycle replies by ticket.
    replies: HashMap<Ticket, Reply>,
    next_ticket: Ticket,
    /// Weights, KV cache and runtime regions are all mapped (checked after
    /// every lifecycle command; a step needs it).
    mapped: bool,
    /// The scheduler has a KV connector.
    has_connector: bool,
    /// `EngineConfig::enable_sleep_mode`.
    sleep_mode: bool,
    /// How long releasing transfer-held KV and registrations may take.
    release_timeout: Duration,
    lc_stats: LifecycleStats,
    /// The command being applied closes admission and still counts in
    /// `Shared::closing_in_flight`.
    closing: bool,
}

/// Marks the engine stopped however the core thread ends (even by a panic),
/// so that callers get `Stopped` instead of a hang.
struct StoppedGuard(Arc<Shared>);

impl Drop for StoppedGuard {
    fn drop(&mut self) {
        self.0.stopped.store(true, Ordering::SeqCst);
        if let Ok(mut live) = self.0.live.lock() {
            live.clear();
        }
    }
}

impl Core {
    fn run(mut self) {
        let _guard = StoppedGuard(self.shared.clone());
        tracing::debug!("engine core started");
        loop {
            self.poll_lifecycle();
            if !self.drain_commands() {
                break;
            }
            self.poll_lifecycle();
            if self.can_step() {
                self.step();
            } else {
                self.poll_connector();
            }
            self.publish_stats();
        }
        self.shared.stopped.store(true, Ordering::SeqCst);
        self.abort_all();
        for (_, reply) in self.replies.drain() {
            let _ = reply.try_send(Err(LifecycleError::Stopped));
        }
        // Commands queued behind the shutdown end too.
        while let Ok(cmd) = self.rx.try_recv() {
            cmd.refuse_stopped(&self.shared);
        }
        self.publish_stats();
        tracing::debug!("engine core stopped");
    }

    /// Applies pending commands; waits for one when idle. False on shutdown.
    fn drain_commands(&mut self) -> bool {
        if !(self.sched.has_runnable() && self.can_step()) {
            let now = Instant::now();
            let wait = self.lc.next_deadline().map_or(IDLE_WAIT, |d| d.saturating_duration_since(now).min(IDLE_WAIT));
            match self.rx.recv_timeout(wait) {
                Ok(cmd) => {
                    if !self.apply(cmd) {
                        return false;
                    }
                }
                Err(RecvTimeoutError::Timeout) => return true,
                Err(RecvTimeoutError::Disconnected) => return false,
            }
        }
        // Bounded, so a flood of commands cannot starve the running requests.
        for _ in 0..COMMAND_CAPACITY {
            match self.rx.try_recv() {
                Ok(cmd) => {
                    if !self.apply(cmd) {
                        return false;
                    }
                }
                Err(TryRecvError::Empty) => return true,
                Err(TryRecvError::Disconnected) => return false,
            }
        }
        true
    }

    /// A step may run: the lifecycle allows it and all memory is mapped.
    fn can_step(&self) -> bool {
        self.lc.may_step() && self.mapped
    }

    fn apply(&mut self, cmd: Command) -> bool {
        self.closing = cmd.closes_admission();
        let lifecycle = !matches!(cmd, Command::Add(_) | Command::Abort { .. } | Command::Nudge | Command::Shutdown);
        let go_on = self.apply_command(cmd);
        if lifecycle {
            self.publish_lifecycle();
        }
        go_on
    }

    fn apply_command(&mut self, cmd: Command) -> bool {
        match cmd {
            Command::Add(add) => self.add(*add),
            Command::Abort { id, serial } => {
                let matches = self.reqs.get(&id).is_some_and(|r| serial.is_none_or(|s| s == r.serial));
                if matches {
                    self.finish(&id, FinishReason::Abort, None);
                }
            }
            Command::ResetPrefixCache { reset_running, reply } => {
                if reset_running {
                    self.sched.preempt_all_running();
                }
                let mut done = self.sched.reset_prefix_cache();
                if done {
                    // Whatever the connector caches about block contents goes too.
                    done = self.sched.connector_mut().is_none_or(|c| c.reset_cache());
                }
                self.answer(&reply, done);
            }
            Command::Pause { mode, clear_cache, deadline, reply } => {
                self.report_transfers(mode == PauseMode::Abort);
                let ticket = self.ticket();
                let live = self.sched.has_work();
                let out = self.lc.pause(mode, clear_cache, ticket, deadline, live);
                self.finish_outcome(ticket, out, reply);
            }
            Command::Resume(reply) => {
                let (out, cancelled) = self.lc.resume();
                self.complete(cancelled);
                self.finish_outcome(self.next_ticket, out, reply);
            }
            Command::Sleep { level, mode, deadline, reply } => {
                if let Err(e) = self.check_sleep_mode() {
                    self.answer(&reply, Err(e));
                    return true;
                }
                self.report_transfers(mode == PauseMode::Abort);
                let ticket = self.ticket();
                let live = self.sched.has_work();
                let out = self.lc.sleep(level, mode, ticket, deadline, live);
                self.finish_outcome(ticket, out, reply);
            }
            Command::Wake { tags, reply } => {
                let out = self.lc.wake(tags.as_deref());
                let timed = !out.actions.is_empty();
                let t0 = Instant::now();
                let result = self.run_outcome(out);
                if timed {
                    self.lc_stats.last_wake_seconds = t0.elapsed().as_secs_f64();
                    self.lc_stats.num_wakes += 1;
                }
                if let Some(r) = result {
                    self.answer(&reply, r);
                }
            }
            Command::ReleaseKv(reply) => {
                if let Err(e) = self.check_sleep_mode() {
                    self.answer(&reply, Err(e));
                    return true;
                }
                self.report_transfers(false);
                let ticket = self.ticket();
                let out = self.lc.release_kv_with(ticket, Instant::now() + self.release_timeout);
                self.finish_outcome(ticket, out, reply);
            }
            Command::AbortRequests { ids, reply } => {
                let mut found = Vec::new();
                for id in ids {
                    let key = self.reqs.get_key_value(id.as_str()).map(|(k, _)| k.clone());
                    if let Some(key) = key {
                        self.finish(&key, FinishReason::Abort, None);
                        found.push(id);
                    }
                }
                self.answer(&reply, found);
            }
            Command::UpdateWeights { path, version, reply } => {
                let r = self.update_weights(path, version);
                self.answer(&reply, r);
            }
            Command::Nudge => {}
            Command::Shutdown => return false,
        }
        true
    }

    /// Publishes the new state, then answers a lifecycle caller: whatever
    /// the caller does next (add a request, read stats or status) sees the
    /// state its operation produced.
    fn answer<T>(&mut self, reply: &SyncSender<T>, value: T) {
        self.publish_lifecycle();
        self.publish_stats();
        let _ = reply.try_send(value);
    }

    /// With a KV connector, releasing KV memory needs sleep mode enabled
    /// (which start-up allows only for a connector that supports it).
    fn check_sleep_mode(&self) -> Result<(), LifecycleError> {
        if self.has_connector && !self.sleep_mode {
            return Err(LifecycleError::Conflict(
                "sleep mode is not enabled on this engine with a KV connector; start it with --enable-sleep-mode".into(),
            ));
        }
        Ok(())
    }

    fn ticket(&mut self) -> Ticket {
        self.next_ticket += 1;
        self.next_ticket
    }

    /// Applies an outcome's actions and returns its reply (`None`: deferred).
    /// A failed action turns the reply into that error.
    fn run_outcome(&mut self, out: Outcome) -> Option<Result<(), LifecycleError>> {
        let t0 = Instant::now();
        let applied = self.apply_actions(&out.actions);
        if out.is_sleep {
            self.lc_stats.last_sleep_seconds = t0.elapsed().as_secs_f64();
            self.lc_stats.num_sleeps += 1;
        }
        match applied {
            Err(e) => Some(Err(e)),
            Ok(()) => out.reply,
        }
    }

    /// Applies an outcome and answers `reply` now, or files it under
    /// `ticket` when the machine deferred the answer.
    fn finish_outcome(&mut self, ticket: Ticket, out: Outcome, reply: Reply) {
        match self.run_outcome(out) {
            Some(r) => self.answer(&reply, r),
            None => {
                self.replies.insert(ticket, reply);
            }
        }
    }

    /// Applies and answers deferred outcomes.
    fn complete(&mut self, done: Vec<Completion>) {
        for c in done {
            let reply = self.replies.remove(&c.ticket);
            let r = self.run_outcome(c.outcome).unwrap_or(Ok(()));
            if let Some(reply) = reply {
                self.answer(&reply, r);
            }
        }
    }

    /// Tells the lifecycle machine whether transfers hold KV blocks.
    fn report_transfers(&mut self, aborting: bool) {
        let held = self.has_connector && (self.sched.has_transfers() || (aborting && self.sched.has_work()));
        self.lc.set_transfers(held);
    }

    /// Completes pending `wait` pauses and sleeps that are due.
    fn poll_lifecycle(&mut self) {
        if !self.lc.has_pending() {
            return;
        }
        self.report_transfers(false);
        let done = self.lc.poll(self.sched.has_work(), Instant::now());
        if !done.is_empty() {
            self.complete(done);
            self.publish_lifecycle();
        }
    }

    fn apply_actions(&mut self, actions: &[Action]) -> Result<(), LifecycleError> {
        let mem = |op: &str, tags: &[Tag], r: pdkv_vmem::Result<()>| {
            r.map_err(|e| {
                let names: Vec<&str> = tags.iter().map(|t| t.as_str()).collect();
                LifecycleError::Internal(format!("{op} of {} failed: {e}", names.join(", ")))
            })
        };
        let mut result = Ok(());
        for a in actions {
            let r = match a {
                Action::AbortAll => {
                    self.abort_all();
                    Ok(())
                }
                Action::PreemptRunning => {
                    self.sched.preempt_all_running();
                    Ok(())
                }
                Action::InvalidatePrefixCache => {
                    if self.sched.reset_prefix_cache() {
                        Ok(())
                    } else {
                        Err(LifecycleError::Internal("the prefix cache could not be invalidated: blocks are in use".into()))
                    }
                }
                Action::ForgetFreeCachedBlocks => {
                    self.sched.forget_free_cached_blocks();
                    Ok(())
                }
                Action::ReleaseTransfers => {
                    self.sched.release_transfer_kv();
                    Ok(())
                }
                Action::Offload(tags) => {
                    self.release_registrations(tags);
                    mem("offload", tags, self.pool.offload(tags))
                }
                Action::Discard(tags) => {
                    self.release_registrations(tags);
                    mem("discard", tags, self.pool.discard(tags))
                }
                Action::Wake(tags) => {
                    let r = mem("wake", tags, self.pool.wake(tags));
                    if r.is_ok() {
                        self.restore_registrations(tags)
                    } else {
                        r
                    }
                }
            };
            // Go on after a failure: the machine already counts the tags as
            // released, which is the safe side (no step runs); a later wake
            // retries.
            if let Err(e) = r {
                tracing::error!(error = %e, "lifecycle action failed");
                if result.is_ok() {
                    result = Err(e);
                }
            }
        }
        self.mapped = [Tag::Weights, Tag::KvCache, Tag::Runtime].into_iter().all(|t| self.pool.is_awake(t));
        result
    }

    /// Releases the KV that transfers hold and waits, bounded by the release
    /// timeout, until they gave every block back. For operations that run
    /// inside one command (a weight reload); pauses and sleeps wait through
    /// the lifecycle machine instead.
    fn drain_transfers(&mut self) -> bool {
        self.sched.release_transfer_kv();
        let deadline = Instant::now() + self.release_timeout;
        loop {
            self.poll_connector();
            if !self.sched.has_transfers() {
                return true;
            }
            if Instant::now() >= deadline {
                return false;
            }
            // The connector's own threads end the transfers; look again soon.
            std::thread::park_timeout(Duration::from_millis(2));
        }
    }

    /// Before the KV cache is unmapped: the connector gives up its
    /// registrations of it (bounded). A failure is logged; the connector
    /// drops its registrations in any case, so no one reaches the old pages.
    fn release_registrations(&mut self, tags: &[Tag]) {
        if !tags.contains(&Tag::KvCache) || !self.pool.is_awake(Tag::KvCache) {
            return;
        }
        let timeout = self.release_timeout;
        if let Some(c) = self.sched.connector_mut() {
            let t0 = Instant::now();
            match c.release_kv_caches(timeout) {
                Ok(()) => tracing::info!(ms = t0.elapsed().as_millis() as u64, "KV connector released its registrations"),
                Err(e) => tracing::error!(error = %format!("{e:#}"), "KV connector release failed"),
            }
        }
    }

    /// After the KV cache is mapped again: the connector registers it anew
    /// (a new epoch). A failure fails the wake.
    fn restore_registrations(&mut self, tags: &[Tag]) -> Result<(), LifecycleError> {
        if !tags.contains(&Tag::KvCache) {
            return Ok(());
        }
        match self.sched.connector_mut() {
            Some(c) => c.restore_kv_caches().map_err(|e| {
                LifecycleError::Internal(format!("the KV connector could not register the KV cache again: {e:#}"))
            }),
            None => Ok(()),
        }
    }

    fn update_weights(&mut self, path: PathBuf, version: Option<String>) -> Result<(), LifecycleError> {
        use pdkv_model::loader::{reload_weights_into, ReloadError};
        self.lc.check_update_weights(self.sched.has_work())?;
        // KV that transfers hold was computed with the old weights: release
        // it before writing new ones.
        if self.sched.has_transfers() && !self.drain_transfers() {
            return Err(LifecycleError::Timeout(format!(
                "KV transfers still held blocks after {:?}; the weights were not changed",
                self.release_timeout
            )));
        }
        let t0 = Instant::now();
        let expected = self.model.config().clone();
        let loaded = reload_weights_into(self.model.weights(), &expected, &path, &mut |_| {});
        match loaded {
            Ok(()) => {
                let actions = self.lc.weights_written(true);
                self.apply_actions(&actions)?;
                // KV a connector saved was computed with the old weights.
                if let Some(c) = self.sched.connector_mut() {
                    if !c.reset_cache() {
                        tracing::warn!(connector = c.name(), "the KV connector could not drop its cached KV after a weight update");
                    }
                }
                *self.shared.weight_info.lock().unwrap() = WeightInfo { version, path };
                self.lc_stats.last_weight_update_seconds = t0.elapsed().as_secs_f64();
                self.lc_stats.num_weight_updates += 1;
                tracing::info!(seconds = t0.elapsed().as_secs_f64(), "weights reloaded in place");
                Ok(())
            }
            Err(ReloadError::Incompatible(e)) => Err(LifecycleError::IncompatibleWeights(format!("{e:#}"))),
            Err(ReloadError::Unreadable(e)) => Err(LifecycleError::Invalid(format!("{e:#}"))),
            Err(ReloadError::RegionReleased) => {
                Err(LifecycleError::Conflict("the weights are asleep; wake weights first".into()))
            }
            Err(ReloadError::Partial(e)) => {
                let actions = self.lc.weights_written(false);
                let _ = self.apply_actions(&actions);
                Err(LifecycleError::Internal(format!(
                    "reloading weights failed part-way ({e:#}); requests are refused until a reload succeeds"
                )))
            }
        }
    }

    /// Publishes the lifecycle snapshot and the admission decision; then,
    /// if the command being applied closes admission, it no longer counts as
    /// in flight (the refusal is visible from now on).
    fn publish_lifecycle(&mut self) {
        *self.shared.lifecycle.lock().unwrap() = self.lc.status();
        *self.shared.refusal.lock().unwrap() = self.lc.admission().err();
        if std::mem::take(&mut self.closing) {
            self.shared.closing_in_flight.fetch_sub(1, Ordering::SeqCst);
        }
    }

    fn add(&mut self, add: AddCommand) {
        self.shared.add_taken();
        let AddCommand { serial, req, seed, tx } = add;
        if let Err(reason) = self.lc.admission() {
            // The send-side gate makes this unreachable for pauses and
            // sleeps; it covers weights left unusable by a failed reload.
            tracing::warn!(id = %req.id, reason, "request reached a core that refuses requests; aborted");
            let mut live = self.shared.live.lock().unwrap();
            if live.get(&req.id) == Some(&serial) {
                live.remove(&req.id);
            }
            drop(live);
            let _ = tx.send(abort_output(&req));
            return;
        }
        if self.sched.is_held(&req.id) {
            // Its blocks are keyed by id until the transfer ends.
            tracing::warn!(id = %req.id, "request id still names a finished request whose KV is being transferred; refused");
            let mut live = self.shared.live.lock().unwrap();
            if live.get(&req.id) == Some(&serial) {
                live.remove(&req.id);
            }
            drop(live);
            let mut out = abort_output(&req);
            out.finish_reason = Some(FinishReason::Error);
            out.error = Some(format!("request id {} is still in use by a KV transfer", req.id));
            let _ = tx.send(out);
            return;
        }
        let id: Arc<str> = Arc::from(req.id.as_str());
        let p = &req.params;
        let mut stop_token_ids = p.stop_token_ids.clone();
        if !p.ignore_eos {
            stop_token_ids.extend(&self.eos_ids);
        }
        let active = ActiveRequest {
            serial,
            tx,
            sampling: SamplingConfig::from_params(p, seed),
            return_logits: p.return_logits,
            detok: IncrementalDetokenizer::new(&req.prompt_tokens),
            stops: StopChecker::new(p.stop.clone()),
            num_prompt_tokens: req.prompt_tokens.len(),
            num_cached_tokens: 0,
        };
        self.sched.add_request(NewRequest {
            id: id.clone(),
            prompt_tokens: req.prompt_tokens,
            max_tokens: p.max_tokens as usize,
            stop_token_ids,
            kv_transfer_params: if self.has_connector { req.kv_transfer_params } else { None },
        });
        self.reqs.insert(id, active);
    }

    /// Ends a request: frees its blocks, releases its id and sends the final
    /// output (with `last`'s tokens and text when given).
    fn finish(&mut self, id: &Arc<str>, reason: FinishReason, last: Option<RequestOutput>) {
        let params = self.sched.finish_request_with(id, reason).flatten();
        self.finish_active(id, reason, last, params, None);
    }

    /// Ends the core's side of a request the scheduler already ended.
    fn finish_active(
        &mut self,
        id: &Arc<str>,
        reason: FinishReason,
        last: Option<RequestOutput>,
        params: Option<crate::KvTransferParams>,
        error: Option<String>,
    ) {
        let Some(active) = self.reqs.remove(id) else { return };
        {
            let mut live = self.shared.live.lock().unwrap();
            if live.get(&**id) == Some(&active.serial) {
                live.remove(&**id);
            }
        }
        let mut out = last.unwrap_or_else(|| active.output(id));
        out.finish_reason = Some(reason);
        out.kv_transfer_params = params;
        out.error = error;
        // A closed receiver only means the client left.
        let _ = active.tx.send(out);
    }

    fn abort_all(&mut self) {
        let ids: Vec<Arc<str>> = self.reqs.keys().cloned().collect();
        for id in ids {
            self.finish(&id, FinishReason::Abort, None);
        }
    }

    fn forward(&mut self, plan: &SchedulerOutput) -> anyhow::Result<()> {
        let inputs: Vec<SeqInput<'_>> = plan
            .seqs
            .iter()
            .map(|s| SeqInput {
                tokens: &s.tokens,
                start_pos: s.start_pos,
                block_table: &s.block_table,
                want_logits: s.sample,
            })
            .collect();
        let (model, kv, ws, logits) = (&self.model, &self.kv, &mut self.ws, &mut self.logits);
        match catch_unwind(AssertUnwindSafe(|| model.forward(kv, ws, &inputs, logits))) {
            Ok(r) => r?,
            Err(panic) => {
                let msg = panic
                    .downcast_ref::<&str>()
                    .map(|s| s.to_string())
                    .or_else(|| panic.downcast_ref::<String>().cloned())
                    .unwrap_or_else(|| "unknown panic".into());
                anyhow::bail!("the forward pass panicked: {msg}");
            }
        }
        let want = plan.num_sampled() * self.vocab;
        anyhow::ensure!(
            self.logits.len() == want,
            "the forward pass returned {} logits, expected {want}",
            self.logits.len()
        );
        Ok(())
    }

    /// Applies what the connector finished: freed transfers, loaded
    /// requests, failed loads (ended here with their error).
    fn poll_connector(&mut self) {
        for f in self.sched.update_from_connector() {
            let error = format!("loading the request's KV failed: {}", f.error);
            self.finish_active(&f.request_id, FinishReason::Error, None, None, Some(error));
        }
    }

    fn step(&mut self) {
        self.poll_connector();
        let plan = self.sched.schedule();
        if let Some(c) = self.sched.connector_mut() {
            // Admission may have started loads even when nothing runs.
            let meta = c.build_connector_meta();
            c.start_load_kv(meta);
        }
        if plan.is_empty() {
            return;
        }
        self.steps += 1;
        if let Err(e) = self.forward(&plan) {
            tracing::error!(error = %format!("{e:#}"), seqs = plan.seqs.len(), "forward failed; aborting the step's requests");
            for s in &plan.seqs {
                self.finish(&s.request_id, FinishReason::Abort, None);
            }
            return;
        }
        if let Some(c) = self.sched.connector_mut() {
            c.wait_for_save();
        }
        // Sample from the rows, in order.
        let mut sampled = Vec::with_capacity(plan.seqs.len());
        let mut rows: HashMap<Arc<str>, usize> = HashMap::new();
        let mut row = 0;
        for s in &plan.seqs {
            if !s.sample {
                sampled.push(None);
                continue;
            }
            let logits = &self.logits[row * self.vocab..(row + 1) * self.vocab];
            let active = self.reqs.get(&s.request_id).expect("scheduled request is active");
            sampled.push(Some(sample(logits, &active.sampling, s.output_index as u64)));
            rows.insert(s.request_id.clone(), row);
            row += 1;
        }
        let updates = self.sched.update_from_output(&plan, &sampled);
        for u in updates {
            let Some(tok) = u.new_token else { continue };
            let Some(active) = self.reqs.get_mut(&u.request_id) else { continue };
            active.num_cached_tokens = u.num_cached_tokens;
            let mut out = active.output(&u.request_id);
            out.token_ids.push(tok);
            if active.return_logits {
                let r = rows[&u.request_id];
                out.logits.push(self.logits[r * self.vocab..(r + 1) * self.vocab].to_vec());
            }
            let mut finish = u.finished;
            // A stop token (EOS or stop_token_ids) is not part of the text.
            if finish != Some(FinishReason::Stop) {
                let delta = active.detok.push(&*self.tokenizer, tok);
                let (text, hit) = active.stops.push(&delta);
                out.text.push_str(&text);
                if hit {
                    finish = Some(FinishReason::Stop);
                }
            }
            if finish.is_some() && !active.stops.stopped() {
                let rest = active.detok.flush(&*self.tokenizer);
                let (text, _) = active.stops.push(&rest);
                out.text.push_str(&text);
                if !active.stops.stopped() {
                    out.text.push_str(&active.stops.flush());
                }
            }
            match finish {
                // The scheduler already ended it (stop token, length).
                Some(reason) if u.finished.is_some() => {
                    self.finish_active(&u.request_id, reason, Some(out), u.kv_transfer_params, None)
                }
                Some(reason) => self.finish(&u.request_id, reason, Some(out)),
                None => {
                    if active.tx.send(out).is_err() {
                        // The client is gone: free the blocks now.
                        tracing::debug!(id = %u.request_id, "output receiver closed; aborting");
                        self.finish(&u.request_id, FinishReason::Abort, None);
                    }
                }
            }
        }
    }

    fn publish_stats(&mut self) {
        let c = self.sched.counts();
        let mut st = self.shared.stats.lock().unwrap();
        let pending = st.pending_adds;
        let s = &mut st.stats;
        s.num_running = c.num_running;
        s.num_waiting = c.num_waiting + c.num_waiting_for_remote_kv + pending;
        s.num_waiting_for_remote_kv = c.num_waiting_for_remote_kv;
        s.kv_blocks_held = c.num_held_blocks;
        s.kv_blocks_total = c.num_blocks;
        s.kv_blocks_free = c.num_free_blocks;
        s.prefix_cache_queries = c.prefix_cache_queries;
        s.prefix_cache_hits = c.prefix_cache_hits;
        s.num_preemptions = c.num_preemptions;
        s.steps = self.steps;
        let lc = self.lc.status();
        s.paused = lc.paused.is_some();
        s.sleep_level = lc.sleeping.map(SleepLevel::as_u32);
        s.weights_discarded = lc.weights_discarded;
        let l = &self.lc_stats;
        s.last_sleep_seconds = l.last_sleep_seconds;
        s.last_wake_seconds = l.last_wake_seconds;
        s.last_weight_update_seconds = l.last_weight_update_seconds;
        s.num_sleeps = l.num_sleeps;
        s.num_wakes = l.num_wakes;
        s.num_weight_updates = l.num_weight_updates;
        drop(st);
        self.shared.stats_changed.notify_all();
    }
}

fn abort_output(req: &EngineRequest) -> RequestOutput {
    RequestOutput {
        request_id: req.id.clone(),
        token_ids: Vec::new(),
        text: String::new(),
        finish_reason: Some(FinishReason::Abort),
        num_prompt_tokens: req.prompt_tokens.len(),
        num_cached_tokens: 0,
        logits: Vec::new(),
        kv_transfer_params: None,
        error: None,
    }
}
