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
//!   with [`FinishReason::Abort`] and the core keeps serving.

use std::collections::HashMap;
use std::hash::{BuildHasher, Hasher};
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::mpsc::{Receiver, RecvTimeoutError, SyncSender, TryRecvError, TrySendError};
use std::sync::{Arc, Condvar, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use pdkv_model::{ChatTemplate, KvCache, LoadedModel, Model, ModelConfig, SeqInput, Tokenizer, Workspace};
use pdkv_vmem::Pool;
use tokio::sync::mpsc::{unbounded_channel, UnboundedReceiver, UnboundedSender};

use crate::detok::{IncrementalDetokenizer, StopChecker};
use crate::sampling::{sample, SamplingConfig};
use crate::scheduler::{NewRequest, Scheduler, SchedulerConfig, SchedulerOutput};
use crate::lifecycle::{LifecycleError, LifecycleStatus, PauseMode, SleepLevel, WeightInfo};
use crate::{AddRequestError, EngineConfig, EngineRequest, EngineStats, FinishReason, RequestOutput};

/// Commands waiting for the core, at most. A full channel makes
/// `add_request` wait for the core's next drain (one step).
const COMMAND_CAPACITY: usize = 4096;

/// How long an idle core sleeps on the command channel before looking again.
const IDLE_WAIT: Duration = Duration::from_millis(200);

enum Command {
    Add(Box<AddCommand>),
    /// `serial` set: only that incarnation of the id (a dropped stream).
    Abort {
        id: Arc<str>,
        serial: Option<u64>,
    },
    ResetPrefixCache(SyncSender<bool>),
    Shutdown,
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
    shared: Arc<Shared>,
    tokenizer: Arc<Tokenizer>,
    config: EngineConfig,
    model_name: String,
    chat_template: Option<ChatTemplate>,
    model_config: ModelConfig,
    pool: Pool,
    max_model_len: usize,
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
        use anyhow::Context;
        anyhow::ensure!(config.max_num_seqs > 0, "max_num_seqs must be at least 1");
        anyhow::ensure!(config.max_num_batched_tokens > 0, "max_num_batched_tokens must be at least 1");
        anyhow::ensure!(config.num_kv_blocks > 0, "num_kv_blocks must be at least 1");
        let LoadedModel { model, tokenizer, chat_template, name, .. } = model;
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
        let core = Core {
            sched: Scheduler::new(SchedulerConfig {
                max_num_seqs: config.max_num_seqs,
                max_num_batched_tokens: config.max_num_batched_tokens,
                num_blocks: config.num_kv_blocks,
                enable_prefix_caching: config.enable_prefix_caching,
            }),
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
        };
        let thread = std::thread::Builder::new()
            .name("pdkv-engine-core".into())
            .spawn(move || core.run())
            .context("spawning the engine core thread")?;
        Ok(EngineHandle {
            inner: Arc::new(Inner {
                cmd_tx,
                shared,
                tokenizer,
                config,
                model_name: name,
                chat_template,
                model_config,
                pool,
                max_model_len,
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
        let (tx, rx) = std::sync::mpsc::sync_channel(1);
        if self.inner.cmd_tx.send(Command::ResetPrefixCache(tx)).is_err() {
            return false;
        }
        rx.recv().unwrap_or(false)
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
    pub fn max_model_len(&self) -> usize {
        self.inner.max_model_len
    }

    /// True once the engine stopped (shutdown or a dead core thread).
    pub fn is_stopped(&self) -> bool {
        self.inner.shared.stopped.load(Ordering::SeqCst)
    }

    /// Stops the engine thread: running requests end with `Abort`. Waits for
    /// the thread to exit.
    /// Pauses scheduling; see [`PauseMode`]. `clear_cache` also resets the
    /// prefix cache once idle. Returns when the pause is complete (for `wait`,
    /// when running requests finished) or fails at `timeout`.
    pub fn pause(&self, _mode: PauseMode, _clear_cache: bool, _timeout: Duration) -> Result<(), LifecycleError> {
        todo!()
    }

    /// Ends a pause. Fails a pending cache-resetting operation.
    pub fn resume(&self) -> Result<(), LifecycleError> {
        todo!()
    }

    /// Pauses (with `mode`) and releases memory per `level`.
    pub fn sleep(&self, _level: SleepLevel, _mode: PauseMode, _timeout: Duration) -> Result<(), LifecycleError> {
        todo!()
    }

    /// Maps memory back for `tags` (all tags when `None`); scheduling resumes
    /// when every tag is awake (and, after level 2, once weights are reloaded).
    pub fn wake_up(&self, _tags: Option<&[pdkv_vmem::Tag]>) -> Result<(), LifecycleError> {
        todo!()
    }

    /// Releases the KV cache's physical memory; needs a completed pause.
    pub fn release_kv_cache_memory(&self) -> Result<(), LifecycleError> {
        todo!()
    }

    /// Resets the prefix cache; with `reset_running_requests`, running
    /// requests are preempted first. Returns false when it cannot reset now.
    pub fn reset_prefix_cache_with(&self, _reset_running_requests: bool) -> bool {
        todo!()
    }

    /// Aborts the given requests; returns the ids that were live.
    pub fn abort_requests(&self, _ids: &[String]) -> Vec<String> {
        todo!()
    }

    /// Reloads weights in place (same addresses) from a checkpoint; refuses a
    /// checkpoint of another architecture or shape, keeping the old weights.
    pub fn update_weights(&self, _path: &std::path::Path, _version: Option<String>) -> Result<(), LifecycleError> {
        todo!()
    }

    pub fn weight_info(&self) -> WeightInfo {
        todo!()
    }

    pub fn lifecycle_status(&self) -> LifecycleStatus {
        todo!()
    }

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
        }
    }
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
            if !self.drain_commands() {
                break;
            }
            self.step();
            self.publish_stats();
        }
        self.shared.stopped.store(true, Ordering::SeqCst);
        self.abort_all();
        // Requests queued behind the shutdown end too.
        while let Ok(cmd) = self.rx.try_recv() {
            match cmd {
                Command::Add(add) => {
                    self.shared.add_taken();
                    let _ = add.tx.send(abort_output(&add.req));
                }
                Command::ResetPrefixCache(reply) => {
                    let _ = reply.try_send(false);
                }
                Command::Abort { .. } | Command::Shutdown => {}
            }
        }
        self.publish_stats();
        tracing::debug!("engine core stopped");
    }

    /// Applies pending commands; waits for one when idle. False on shutdown.
    fn drain_commands(&mut self) -> bool {
        if !self.sched.has_work() {
            match self.rx.recv_timeout(IDLE_WAIT) {
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

    fn apply(&mut self, cmd: Command) -> bool {
        match cmd {
            Command::Add(add) => self.add(*add),
            Command::Abort { id, serial } => {
                let matches = self.reqs.get(&id).is_some_and(|r| serial.is_none_or(|s| s == r.serial));
                if matches {
                    self.finish(&id, FinishReason::Abort, None);
                }
            }
            Command::ResetPrefixCache(reply) => {
                let _ = reply.try_send(self.sched.reset_prefix_cache());
            }
            Command::Shutdown => return false,
        }
        true
    }

    fn add(&mut self, add: AddCommand) {
        self.shared.add_taken();
        let AddCommand { serial, req, seed, tx } = add;
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
        });
        self.reqs.insert(id, active);
    }

    /// Ends a request: frees its blocks, releases its id and sends the final
    /// output (with `last`'s tokens and text when given).
    fn finish(&mut self, id: &Arc<str>, reason: FinishReason, last: Option<RequestOutput>) {
        self.sched.finish_request(id, reason);
        let Some(active) = self.reqs.remove(id) else { return };
        {
            let mut live = self.shared.live.lock().unwrap();
            if live.get(&**id) == Some(&active.serial) {
                live.remove(&**id);
            }
        }
        let mut out = last.unwrap_or_else(|| active.output(id));
        out.finish_reason = Some(reason);
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

    fn step(&mut self) {
        let plan = self.sched.schedule();
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
        s.num_waiting = c.num_waiting + pending;
        s.kv_blocks_total = c.num_blocks;
        s.kv_blocks_free = c.num_free_blocks;
        s.prefix_cache_queries = c.prefix_cache_queries;
        s.prefix_cache_hits = c.prefix_cache_hits;
        s.num_preemptions = c.num_preemptions;
        s.steps = self.steps;
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
    }
}
