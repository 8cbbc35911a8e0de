//! The production handle: [`EngineHandle`] (validation, the admission gate,
//! blocking lifecycle calls), [`RequestStream`], and the state shared with
//! the core thread, which the stepper updates through [`SharedPublisher`].
//!
//! Admission is ordered with the lifecycle: a request accepted by
//! `add_request` is in the command channel before any pause or sleep that
//! refuses it (both are sent under one lock, and a refusing command counts
//! as closing admission from the moment it is sent until the core has
//! published the refusal). Every caller's wait on the core is bounded.

use std::collections::HashMap;
use std::hash::{BuildHasher, Hasher};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::mpsc::{RecvTimeoutError, SyncSender, TrySendError};
use std::sync::{Arc, Condvar, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use pdkv_model::{ChatTemplate, ModelConfig, Tokenizer};
use pdkv_vmem::{RankPools, Tag};
use tokio::sync::mpsc::{unbounded_channel, UnboundedReceiver, UnboundedSender};

use super::command::{AddRequest, Command, OutputSink, Reply};
use super::limits::RequestLimits;
use super::stepper::{LifecycleUpdate, Publisher};
use crate::clock::Clock;
use crate::lifecycle::{LifecycleError, LifecycleStatus, PauseMode, SleepLevel, WeightInfo};
use crate::{AddRequestError, EngineConfig, EngineRequest, EngineStats, RequestOutput};

/// Longest a caller waits for the core to answer a lifecycle command (beyond
/// the operation's own timeout, if it has one). The core answers between
/// steps, so this only bounds a wedged core.
const CONTROL_WAIT: Duration = Duration::from_secs(120);

/// Longest a caller waits for a weight reload (reading and converting a
/// checkpoint on the core thread).
const UPDATE_WEIGHTS_WAIT: Duration = Duration::from_secs(600);

/// The published stats plus what callers did since the core last looked.
///
/// Accepted requests still in the command channel count as waiting, so a
/// snapshot never looks idle while an accepted request is unseen by the core.
pub(super) struct StatsState {
    pub stats: EngineStats,
    /// Adds sent but not yet taken by the core.
    pub pending_adds: usize,
}

/// State shared between handles and the core thread.
pub(super) struct Shared {
    pub stats: Mutex<StatsState>,
    /// Notified whenever `stats` is republished.
    pub stats_changed: Condvar,
    /// Live request ids and the serial of their current incarnation.
    pub live: Mutex<HashMap<String, u64>>,
    pub stopped: AtomicBool,
    pub next_serial: AtomicU64,
    /// Why new requests are refused now (`None`: accepted), published by
    /// the core after each lifecycle change.
    pub refusal: Mutex<Option<String>>,
    /// Admission-closing commands sent but not yet published by the core.
    pub closing_in_flight: AtomicUsize,
    /// What the latest of them tells a refused request (written under the
    /// send lock with the counter's increment).
    pub closing_reason: Mutex<&'static str>,
    pub lifecycle: Mutex<LifecycleStatus>,
    pub weight_info: Mutex<WeightInfo>,
    /// Woken after each lifecycle publication (and when the engine stops),
    /// for callers waiting for admission to open again.
    pub lifecycle_changed: tokio::sync::Notify,
}

impl Shared {
    pub fn new(stats: EngineStats, lifecycle: LifecycleStatus, weight_info: WeightInfo) -> Shared {
        Shared {
            stats: Mutex::new(StatsState {
                stats,
                pending_adds: 0,
            }),
            stats_changed: Condvar::new(),
            live: Mutex::new(HashMap::new()),
            stopped: AtomicBool::new(false),
            next_serial: AtomicU64::new(0),
            refusal: Mutex::new(None),
            closing_in_flight: AtomicUsize::new(0),
            closing_reason: Mutex::new(""),
            lifecycle: Mutex::new(lifecycle),
            weight_info: Mutex::new(weight_info),
            lifecycle_changed: tokio::sync::Notify::new(),
        }
    }

    /// A caller sent an add (`delta` = +1) or took a failed one back (-1):
    /// the snapshot counts it as waiting at once.
    fn add_pending(&self, delta: isize) {
        let mut st = self.stats.lock().unwrap();
        st.pending_adds = st
            .pending_adds
            .checked_add_signed(delta)
            .expect("pending add count underflow");
        st.stats.num_waiting = st
            .stats
            .num_waiting
            .checked_add_signed(delta)
            .expect("waiting count underflow");
    }

    /// The core took an add from the channel. The snapshot keeps counting it
    /// as waiting until the core publishes the scheduler's view.
    pub fn add_taken(&self) {
        let mut st = self.stats.lock().unwrap();
        st.pending_adds = st
            .pending_adds
            .checked_sub(1)
            .expect("pending add count underflow");
    }

    /// A request ended: its id is free again (unless a newer incarnation
    /// holds it).
    fn release_id(&self, id: &str, serial: u64) {
        let mut live = self.live.lock().unwrap();
        if live.get(id) == Some(&serial) {
            live.remove(id);
        }
    }
}

/// The stepper's [`Publisher`] in production: writes the shared snapshot
/// that handles read.
pub(super) struct SharedPublisher(pub Arc<Shared>);

impl Publisher for SharedPublisher {
    fn lifecycle(&mut self, update: &LifecycleUpdate<'_>) {
        let shared = &self.0;
        *shared.lifecycle.lock().unwrap() = update.status.clone();
        *shared.refusal.lock().unwrap() = update.refusal.clone();
        *shared.weight_info.lock().unwrap() = update.weight_info.clone();
        // After the refusal: the command no longer counts as in flight.
        if update.closed_admission {
            shared.closing_in_flight.fetch_sub(1, Ordering::SeqCst);
        }
        shared.lifecycle_changed.notify_waiters();
    }

    fn stats(&mut self, stats: &EngineStats) {
        let mut st = self.0.stats.lock().unwrap();
        let pending = st.pending_adds;
        st.stats = EngineStats {
            num_waiting: stats.num_waiting + pending,
            ..stats.clone()
        };
        drop(st);
        self.0.stats_changed.notify_all();
    }
}

/// A request's outputs go to its stream; the final one frees its id first
/// (so whoever sees it may reuse the id at once).
fn output_sink(
    shared: Arc<Shared>,
    id: String,
    serial: u64,
    tx: UnboundedSender<RequestOutput>,
) -> OutputSink {
    Box::new(move |out| {
        if out.finish_reason.is_some() {
            shared.release_id(&id, serial);
        }
        tx.send(out).is_ok()
    })
}

pub(super) struct Inner {
    pub cmd_tx: SyncSender<Command>,
    /// Held while sending an `Add` or a lifecycle command, so that the
    /// admission check and the send are one step (see the module docs).
    pub send_lock: Mutex<()>,
    pub shared: Arc<Shared>,
    pub tokenizer: Arc<Tokenizer>,
    pub config: EngineConfig,
    pub model_name: String,
    pub chat_template: Option<ChatTemplate>,
    pub model_config: ModelConfig,
    pub pools: RankPools,
    pub limits: RequestLimits,
    /// The connector's [`crate::KvConnector::info`], if the engine has one.
    pub connector_info: Option<serde_json::Value>,
    pub connector_metrics: Option<crate::connector::MetricsReader>,
    /// The running weights' layout, for staging a sync (see
    /// [`EngineHandle::weights_layout`]).
    pub weights_layout: Option<pdkv_model::weights::Weights>,
    /// The core's clock, for the deadlines the handle sends.
    pub clock: Arc<dyn Clock>,
    pub thread: Mutex<Option<JoinHandle<()>>>,
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
        self.shared.lifecycle_changed.notify_waiters();
    }
}

impl Drop for Inner {
    fn drop(&mut self) {
        self.shutdown();
    }
}

/// A cheap, cloneable handle to a running engine. The engine stops when the
/// last handle is dropped (or at [`EngineHandle::shutdown`]).
#[derive(Clone)]
pub struct EngineHandle {
    pub(super) inner: Arc<Inner>,
}

fn random_seed() -> u64 {
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    h.write_u64(0x5eed);
    h.finish()
}

impl EngineHandle {
    /// Why a new request would be refused now (paused, pausing, asleep,
    /// weights discarded, stopped), or `None` while requests are admitted.
    pub fn refusal(&self) -> Option<String> {
        let shared = &self.inner.shared;
        if shared.stopped.load(Ordering::SeqCst) {
            return Some("the engine has stopped".into());
        }
        if shared.closing_in_flight.load(Ordering::SeqCst) > 0 {
            return Some((*shared.closing_reason.lock().unwrap()).into());
        }
        shared.refusal.lock().unwrap().clone()
    }

    /// Validates and enqueues a request.
    pub fn add_request(&self, req: EngineRequest) -> Result<RequestStream, AddRequestError> {
        let shared = &self.inner.shared;
        if shared.stopped.load(Ordering::SeqCst) {
            return Err(AddRequestError::Stopped);
        }
        self.inner.limits.check(&req)?;
        // Admission check and send under one lock: a pause or sleep sent
        // after this request is behind it in the channel.
        let _send = self.inner.send_lock.lock().unwrap();
        // The counter first: a closing command decrements it only after the
        // core published its refusal.
        if shared.closing_in_flight.load(Ordering::SeqCst) > 0 {
            return Err(AddRequestError::Unavailable(
                (*shared.closing_reason.lock().unwrap()).into(),
            ));
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
        // Unbounded on purpose (the core must never wait on a slow client),
        // and bounded by the request: its sink sends one output per sampled
        // token (at most `max_tokens`, which admission holds under
        // `max_model_len`; the last one carries the finish) plus at most one
        // final output without a token (an abort or an error), and is
        // dropped once the request ended. One such channel per live request.
        let (tx, rx) = unbounded_channel();
        let id = req.id.clone();
        let output = output_sink(shared.clone(), id.clone(), serial, tx);
        let cmd = Command::Add(Box::new(AddRequest {
            serial,
            req,
            seed,
            output,
        }));
        shared.add_pending(1);
        if self.inner.cmd_tx.send(cmd).is_err() {
            shared.add_pending(-1);
            shared.live.lock().unwrap().remove(&id);
            return Err(AddRequestError::Stopped);
        }
        Ok(RequestStream {
            id,
            serial,
            rx,
            cmd_tx: self.inner.cmd_tx.clone(),
            done: false,
        })
    }

    /// Aborts a request by id; unknown or finished ids are ignored (returns false).
    pub fn abort(&self, request_id: &str) -> bool {
        if !self
            .inner
            .shared
            .live
            .lock()
            .unwrap()
            .contains_key(request_id)
        {
            return false;
        }
        self.inner
            .cmd_tx
            .send(Command::Abort {
                id: Arc::from(request_id),
                serial: None,
            })
            .is_ok()
    }

    /// Drops every prefix-cache entry, the KV connector's cache included.
    /// Returns false while any KV block is in use (a request is running) or
    /// when the engine stopped. Blocks the caller until the core answers,
    /// which it does before its next step.
    pub fn reset_prefix_cache(&self) -> bool {
        self.reset_prefix_cache_with(false, true)
    }

    /// Sends a command built around a fresh reply and waits (at most `wait`)
    /// for the core's answer.
    fn control<T: Send + 'static>(
        &self,
        wait: Duration,
        make: impl FnOnce(Reply<T>) -> Command,
    ) -> Result<T, LifecycleError> {
        let shared = &self.inner.shared;
        if shared.stopped.load(Ordering::SeqCst) {
            return Err(LifecycleError::Stopped);
        }
        let (tx, rx) = std::sync::mpsc::sync_channel(1);
        // A core that drops the reply unanswered disconnects the channel.
        let cmd = make(Box::new(move |v| {
            let _ = tx.try_send(v);
        }));
        {
            let _send = self.inner.send_lock.lock().unwrap();
            let closing = cmd.closing_refusal();
            let closes = closing.is_some();
            if let Some(reason) = closing {
                *shared.closing_reason.lock().unwrap() = reason;
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
    pub fn wait_stats(
        &self,
        timeout: Duration,
        mut pred: impl FnMut(&EngineStats) -> bool,
    ) -> Option<EngineStats> {
        // The caller's own real-time wait, not engine time.
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

    /// The memory of every rank (one for a whole model): weights, KV cache
    /// and runtime scratch.
    pub fn pool(&self) -> &RankPools {
        &self.inner.pools
    }

    /// What the KV connector says about itself (engine id, role,
    /// addresses); `None` without a connector.
    pub fn kv_connector_info(&self) -> Option<&serde_json::Value> {
        self.inner.connector_info.as_ref()
    }

    /// The KV connector's counters now (see [`crate::connector::MetricsReader`]).
    pub fn kv_connector_metrics(&self) -> Vec<(&'static str, &'static str, f64)> {
        self.inner
            .connector_metrics
            .as_ref()
            .map(|m| m())
            .unwrap_or_default()
    }

    /// The model's context length as the engine enforces it.
    pub fn max_model_len(&self) -> usize {
        self.inner.limits.max_model_len
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
    pub fn pause(
        &self,
        mode: PauseMode,
        clear_cache: bool,
        timeout: Duration,
    ) -> Result<(), LifecycleError> {
        let deadline = self.inner.clock.now() + timeout;
        self.control(timeout + CONTROL_WAIT, |reply| Command::Pause {
            mode,
            clear_cache,
            deadline,
            reply,
        })?
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
    pub fn sleep(
        &self,
        level: SleepLevel,
        mode: PauseMode,
        timeout: Duration,
    ) -> Result<(), LifecycleError> {
        let deadline = self.inner.clock.now() + timeout;
        self.control(timeout + CONTROL_WAIT, |reply| Command::Sleep {
            level,
            mode,
            deadline,
            reply,
        })?
    }

    /// Maps memory back for `tags` (weights and KV cache when `None`; the
    /// runtime scratch always). Scheduling resumes when every tag is awake;
    /// the final wake also ends a pause that the sleep started (an explicit
    /// pause stays until [`EngineHandle::resume`]). After a level-2 sleep,
    /// requests are refused until weights are reloaded. Waking an awake
    /// engine changes nothing.
    pub fn wake_up(&self, tags: Option<&[Tag]>) -> Result<(), LifecycleError> {
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
    /// requests are preempted for recompute first; with `reset_external`,
    /// the KV connector's cache (a host offload store) is emptied too, as
    /// vLLM's `reset_external`. Returns false when it cannot reset now
    /// (blocks in use) or the engine stopped.
    pub fn reset_prefix_cache_with(
        &self,
        reset_running_requests: bool,
        reset_external: bool,
    ) -> bool {
        self.control(CONTROL_WAIT, |reply| Command::ResetPrefixCache {
            reset_running: reset_running_requests,
            reset_external,
            reply,
        })
        .unwrap_or(false)
    }

    /// Aborts the given requests; returns the ids that were live.
    pub fn abort_requests(&self, ids: &[String]) -> Vec<String> {
        let ids = ids.to_vec();
        self.control(CONTROL_WAIT, |reply| Command::AbortRequests { ids, reply })
            .unwrap_or_default()
    }

    /// Reloads weights from a checkpoint in place (same addresses), after
    /// checking the architecture and every tensor's shape against the running
    /// model: a checkpoint that does not fit is refused with
    /// `IncompatibleWeights` and the old weights keep serving. Needs the
    /// weights awake and no request running, unless a `keep` pause froze them
    /// (they are preempted and recompute with the new weights after resume);
    /// `Conflict` otherwise. Afterwards the prefix cache is invalidated and a
    /// level-2 "weights discarded" state ends.
    pub fn update_weights(
        &self,
        path: &std::path::Path,
        version: Option<String>,
    ) -> Result<(), LifecycleError> {
        let source = crate::model::WeightSource::Checkpoint(path.to_path_buf());
        self.control(UPDATE_WEIGHTS_WAIT, |reply| Command::UpdateWeights {
            source,
            version,
            reply,
        })?
    }

    /// [`EngineHandle::update_weights`] from weights a sync staged in
    /// memory: `staged` is laid out as [`EngineHandle::weights_layout`] and
    /// every tensor in it was checked; `origin` is what `/weight_info`
    /// reports as the path. The same rules and the same switch as a reload
    /// from disk: transfers holding KV computed with the old weights are
    /// released first, caches are invalidated, a `keep` pause's requests
    /// recompute with the new weights.
    pub fn install_weights(
        &self,
        staged: Arc<pdkv_model::weights::Weights>,
        origin: String,
        version: Option<String>,
    ) -> Result<(), LifecycleError> {
        let source = crate::model::WeightSource::Staged {
            weights: staged,
            origin,
        };
        self.control(UPDATE_WEIGHTS_WAIT, |reply| Command::UpdateWeights {
            source,
            version,
            reply,
        })?
    }

    /// The layout of the running weights (one rank: a model that is not
    /// split), which a weight sync stages a copy of; `None` where the model
    /// cannot take staged weights.
    pub fn weights_layout(&self) -> Option<&pdkv_model::weights::Weights> {
        self.inner.weights_layout.as_ref()
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

    /// Resolves at the next lifecycle publication (or when the engine
    /// stops). Create it *before* reading the state it should change, so a
    /// change in between is not missed.
    pub fn lifecycle_changed(&self) -> impl std::future::Future<Output = ()> + Send + '_ {
        let mut notified = Box::pin(self.inner.shared.lifecycle_changed.notified());
        notified.as_mut().enable();
        notified
    }

    /// Whether a command that pauses (a pause, a sleep, ...) is on its way
    /// to the core: admission is closing, and the lifecycle will say paused.
    pub fn admission_closing(&self) -> bool {
        self.inner.shared.closing_in_flight.load(Ordering::SeqCst) > 0
    }

    /// The ids of every live request (admitted and not yet ended), sorted.
    pub fn live_request_ids(&self) -> Vec<String> {
        let mut ids: Vec<String> = self
            .inner
            .shared
            .live
            .lock()
            .unwrap()
            .keys()
            .cloned()
            .collect();
        ids.sort_unstable();
        ids
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
        let cmd = Command::Abort {
            id: Arc::from(self.id.as_str()),
            serial: Some(self.serial),
        };
        match self.cmd_tx.try_send(cmd) {
            Ok(()) | Err(TrySendError::Disconnected(_)) => {}
            Err(TrySendError::Full(_)) => {
                tracing::debug!(id = %self.id, "command channel full; abort deferred")
            }
        }
    }
}
