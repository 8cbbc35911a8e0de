//! The stepper: everything the engine core decides and does, with no
//! threads, channels or system clock. It owns the scheduler, the lifecycle
//! machine and the model runner; a driver feeds it [`Command`]s and calls
//! [`EngineCore::tick`]. The production driver is a thread
//! (`core/driver.rs`); a simulator drives it from its own loop with a
//! simulated [`ModelRunner`] and a virtual [`Clock`].
//!
//! The driver contract and the invariants are on [`EngineCore`].

use std::collections::{BTreeMap, HashMap};
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::Context;
use pdkv_vmem::RankPools;

use super::command::{abort_output, AddRequest, Command, LifecycleReply, OutputSink, Reply};
use super::limits::{check_config, RequestLimits};
use super::requests::{ActiveRequest, PromptLogprobs};
use crate::clock::Clock;
use crate::connector::{KvConnector, Waker};
use crate::constraint::{ConstraintError, StructuredStats, TokenConstraint};
use crate::detok::{Decode, IncrementalDetokenizer, StopChecker};
use crate::lifecycle::{LifecycleStatus, Machine, Refusal, SleepLevel, Ticket, WeightInfo};
use crate::model::ModelRunner;
use crate::sampling::{logprobs, sample, LogitsAdjust, SamplingConfig, TokenHistory};
use crate::scheduler::{NewRequest, Scheduler, SchedulerConfig, SchedulerOutput};
use crate::{
    AddRequestError, EngineConfig, EngineRequest, EngineStats, FinishReason, LifecycleStats,
    RequestOutput, SpecStats,
};

/// Where the stepper publishes its state for readers elsewhere (the
/// production handle's shared snapshot). A simulator may read the stepper
/// directly instead and pass [`NoPublisher`].
pub trait Publisher: Send {
    /// The lifecycle state after a lifecycle command, a completed
    /// operation or a refused command (always before the answer that
    /// follows it).
    fn lifecycle(&mut self, update: &LifecycleUpdate<'_>);

    /// The stats after every tick and before every answer.
    fn stats(&mut self, stats: &EngineStats);
}

/// A lifecycle publication.
pub struct LifecycleUpdate<'a> {
    pub status: LifecycleStatus,
    /// Why new requests are refused now (`None`: accepted).
    pub refusal: Option<String>,
    pub weight_info: &'a WeightInfo,
    /// Set on the first publication after applying a command that closes
    /// admission ([`Command::closes_admission`]): from now on the refusal it
    /// causes is visible.
    pub closed_admission: bool,
}

/// Publishes nothing.
pub struct NoPublisher;

impl Publisher for NoPublisher {
    fn lifecycle(&mut self, _update: &LifecycleUpdate<'_>) {}
    fn stats(&mut self, _stats: &EngineStats) {}
}

/// What a stepper is built from.
pub struct CoreParts {
    pub runner: Box<dyn ModelRunner>,
    /// Holds the regions the lifecycle offloads, discards and wakes, one
    /// pool per rank (a runner without memory may pass an empty pool: every
    /// tag counts as awake).
    pub pools: RankPools,
    pub config: EngineConfig,
    pub connector: Option<Box<dyn KvConnector>>,
    /// Given to the connector (before it registers the KV cache): how it
    /// tells the driver it has news. Unused without a connector.
    pub waker: Waker,
    /// Turns output tokens into text.
    pub decoder: Arc<dyn Decode + Send + Sync>,
    /// End a request unless it sets `ignore_eos`.
    pub eos_token_ids: Vec<u32>,
    /// The weights being served at start.
    pub weight_info: WeightInfo,
    pub clock: Arc<dyn Clock>,
    pub publisher: Box<dyn Publisher>,
}

impl SpecStats {
    fn record(&mut self, plan: &SchedulerOutput, kept: &[Vec<u32>]) {
        for (s, k) in plan.seqs.iter().zip(kept) {
            if s.num_draft > 0 {
                self.num_drafts += 1;
                self.num_draft_tokens += s.num_draft as u64;
                self.num_accepted_tokens += k.len().saturating_sub(1).min(s.num_draft) as u64;
            }
        }
    }
}

/// The engine core as a state machine, stepped by a driver.
///
/// Driver contract:
/// - [`EngineCore::apply`] applies one command at once (lifecycle
///   operations between steps, as every call here is); answers go through
///   the closures the command carries, each after the new state was
///   published to the [`Publisher`];
/// - [`EngineCore::tick`] is one turn of the core: complete due lifecycle
///   operations, run one step if allowed (else only look at the KV
///   connector), publish the stats, complete due operations again (so a
///   `wait` pause completes in the turn its last request finished);
/// - when [`EngineCore::has_runnable_work`] is false, ticking again changes
///   nothing until a command arrives, the KV connector calls its waker, or
///   the time reaches [`EngineCore::next_deadline`]; a driver waits for the
///   first of those;
/// - after [`EngineCore::shutdown`] every command is refused (`Abort`,
///   `Stopped`).
///
/// Invariants (the core's, whoever drives it):
/// - every accepted request ends exactly once: its last [`RequestOutput`]
///   carries a finish reason;
/// - a request whose output sink reports the receiver gone is aborted, and
///   its blocks freed, at that output;
/// - a failing (or panicking) forward pass ends the requests of that step
///   with [`FinishReason::Abort`] and the core keeps serving;
/// - a step runs only when the lifecycle machine allows it *and* the
///   weights, KV cache and runtime regions are all mapped;
/// - every timestamp comes from the [`Clock`]; nothing here sleeps.
pub struct EngineCore {
    pub(super) sched: Scheduler,
    pub(super) runner: Box<dyn ModelRunner>,
    decoder: Arc<dyn Decode + Send + Sync>,
    vocab: usize,
    eos_ids: Vec<u32>,
    limits: RequestLimits,
    /// Ordered, so ending them all (an abort pause, a shutdown) happens in
    /// one fixed order and a simulation replays.
    reqs: BTreeMap<Arc<str>, ActiveRequest>,
    logits: Vec<f32>,
    /// A row adjusted before sampling (penalties, bias, `min_tokens`).
    scratch: Vec<f32>,
    steps: u64,
    spec_stats: SpecStats,
    structured: StructuredStats,
    pub(super) pool: RankPools,
    pub(super) lc: Machine,
    /// Deferred lifecycle replies by ticket.
    pub(super) replies: BTreeMap<Ticket, LifecycleReply>,
    /// The machine's state when each deferred operation was requested: a
    /// failure when it completes goes back there, not to the state it
    /// waited in (which holds the operation's own pause).
    pub(super) requested: BTreeMap<Ticket, crate::lifecycle::Snapshot>,
    pub(super) next_ticket: Ticket,
    /// Weights, KV cache and runtime regions are all mapped (checked after
    /// every lifecycle command; a step needs it).
    pub(super) mapped: bool,
    /// The scheduler has a KV connector.
    pub(super) has_connector: bool,
    /// `EngineConfig::enable_sleep_mode`.
    pub(super) sleep_mode: bool,
    /// How long releasing transfer-held KV and registrations may take.
    pub(super) release_timeout: Duration,
    pub(super) lc_stats: LifecycleStats,
    /// The command being applied closes admission and its refusal is not
    /// published yet.
    closing: bool,
    pub(super) weight_info: WeightInfo,
    /// The checkpoint of each `update_weights` the machine has not
    /// finished yet, by ticket.
    pub(super) reloads: HashMap<Ticket, (crate::model::WeightSource, Option<String>)>,
    pub(super) clock: Arc<dyn Clock>,
    publisher: Box<dyn Publisher>,
    stopped: bool,
}

impl EngineCore {
    /// Checks the configuration, registers the KV cache with the connector
    /// (after giving it the waker) and builds the scheduler.
    pub fn new(parts: CoreParts) -> anyhow::Result<EngineCore> {
        let CoreParts {
            runner,
            pools: pool,
            config,
            connector,
            waker,
            decoder,
            eos_token_ids,
            weight_info,
            clock,
            publisher,
        } = parts;
        check_config(&config)?;
        let max_model_len = config.max_model_len.unwrap_or(runner.max_context_len());
        anyhow::ensure!(max_model_len > 0, "max_model_len must be at least 1");
        let capacity = config.num_kv_blocks * pdkv_model::BLOCK_SIZE;
        if max_model_len > capacity {
            tracing::warn!(
                max_model_len,
                capacity,
                "the KV cache holds fewer tokens than the context; longer requests are refused"
            );
        }
        let limits = RequestLimits {
            vocab_size: runner.vocab_size(),
            max_model_len,
            num_kv_blocks: config.num_kv_blocks,
            params_validator: connector.as_ref().map(|c| c.params_validator()),
        };
        let sched_config = SchedulerConfig {
            max_num_seqs: config.max_num_seqs,
            max_num_batched_tokens: config.max_num_batched_tokens,
            num_blocks: config.num_kv_blocks,
            enable_prefix_caching: config.enable_prefix_caching,
            speculative: config.speculative,
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
                c.set_waker(waker);
                c.set_weights_version(weight_info.version.as_deref());
                let spec = runner.kv_cache_spec();
                c.register_kv_caches(&spec).with_context(|| {
                    format!("registering the KV cache with connector {}", c.name())
                })?;
                Scheduler::with_connector(sched_config, c)
            }
            None => Scheduler::new(sched_config),
        };
        Ok(EngineCore {
            sched,
            vocab: limits.vocab_size,
            runner,
            decoder,
            eos_ids: eos_token_ids,
            limits,
            reqs: BTreeMap::new(),
            logits: Vec::new(),
            scratch: Vec::new(),
            steps: 0,
            spec_stats: SpecStats::default(),
            structured: StructuredStats::default(),
            pool,
            lc: Machine::new(),
            replies: BTreeMap::new(),
            requested: BTreeMap::new(),
            next_ticket: 0,
            mapped: true,
            has_connector,
            sleep_mode: config.enable_sleep_mode,
            release_timeout: config.kv_release_timeout,
            lc_stats: LifecycleStats::default(),
            closing: false,
            weight_info,
            reloads: HashMap::new(),
            clock,
            publisher,
            stopped: false,
        })
    }

    /// Applies one command (see the module docs).
    pub fn apply(&mut self, cmd: Command) {
        if self.stopped {
            self.refuse(cmd);
            return;
        }
        if let Command::Shutdown = cmd {
            self.shutdown();
            return;
        }
        self.closing = cmd.closes_admission();
        let lifecycle = cmd.is_lifecycle();
        self.apply_command(cmd);
        if lifecycle {
            self.publish_lifecycle();
        }
    }

    /// Checks `req` as the production handle does and queues it; its
    /// outputs go to `output`. The request gets serial 0 (see
    /// [`AddRequest::serial`]). A request the lifecycle refuses now (see
    /// [`EngineCore::admission`]) ends at once with `Abort`.
    pub fn add(
        &mut self,
        req: EngineRequest,
        seed: u64,
        output: OutputSink,
    ) -> Result<(), AddRequestError> {
        if self.stopped {
            return Err(AddRequestError::Stopped);
        }
        self.check_request(&req)?;
        if self.reqs.contains_key(req.id.as_str()) {
            return Err(AddRequestError::DuplicateId(req.id));
        }
        self.admit(AddRequest {
            serial: 0,
            req,
            seed,
            output,
        });
        Ok(())
    }

    /// Why `req` can never run here (empty prompt, bad parameters, too long
    /// for the context or the KV cache), if it cannot.
    pub fn check_request(&self, req: &EngineRequest) -> Result<(), AddRequestError> {
        self.limits.check(req)
    }

    /// One turn of the core (see the module docs).
    pub fn tick(&mut self) {
        if self.stopped {
            return;
        }
        self.poll_lifecycle();
        if self.can_step() {
            self.step();
        } else {
            self.poll_connector();
        }
        self.publish_stats();
        self.poll_lifecycle();
    }

    /// Whether a tick now would run a step: a request waits or runs and
    /// the lifecycle and memory allow steps.
    pub fn has_runnable_work(&self) -> bool {
        !self.stopped && self.sched.has_runnable() && self.can_step()
    }

    /// The earliest time at which a tick completes something by the clock
    /// alone (a pending operation's deadline).
    pub fn next_deadline(&self) -> Option<Instant> {
        self.lc.next_deadline()
    }

    /// The counters as the core sees them now.
    pub fn stats(&self) -> EngineStats {
        let c = self.sched.counts();
        let lc = self.lc.status();
        EngineStats {
            num_running: c.num_running,
            num_waiting: c.num_waiting + c.num_waiting_for_remote_kv,
            kv_blocks_total: c.num_blocks,
            kv_blocks_free: c.num_free_blocks,
            kv_blocks_held: c.num_held_blocks,
            num_waiting_for_remote_kv: c.num_waiting_for_remote_kv,
            prefix_cache_queries: c.prefix_cache_queries,
            prefix_cache_hits: c.prefix_cache_hits,
            num_preemptions: c.num_preemptions,
            steps: self.steps,
            spec: self.spec_stats,
            structured: self.structured,
            paused: lc.paused.is_some(),
            sleep_level: lc.sleeping.map(SleepLevel::as_u32),
            weights_discarded: lc.weights_discarded,
            lifecycle: self.lc_stats,
        }
    }

    pub fn lifecycle_status(&self) -> LifecycleStatus {
        self.lc.status()
    }

    /// `Ok` when a new request is accepted now, else why it is refused.
    pub fn admission(&self) -> Result<(), Refusal> {
        self.lc.admission()
    }

    pub fn weight_info(&self) -> &WeightInfo {
        &self.weight_info
    }

    /// The scheduler, for invariant checks.
    pub fn scheduler(&self) -> &Scheduler {
        &self.sched
    }

    /// The longest prompt plus output accepted, in tokens.
    pub fn max_model_len(&self) -> usize {
        self.limits.max_model_len
    }

    pub(crate) fn limits(&self) -> &RequestLimits {
        &self.limits
    }

    pub fn is_stopped(&self) -> bool {
        self.stopped
    }

    /// Stops the core: live requests end with `Abort`, pending operations
    /// with `Stopped`; every command from now on is refused.
    pub fn shutdown(&mut self) {
        if self.stopped {
            return;
        }
        self.stopped = true;
        self.abort_all();
        for (_, reply) in std::mem::take(&mut self.replies) {
            reply(Err(crate::LifecycleError::Stopped));
        }
        self.requested.clear();
        self.reloads.clear();
        self.publish_stats();
    }

    /// Answers a command the core will not apply (it stopped).
    fn refuse(&mut self, cmd: Command) {
        self.closing = cmd.closes_admission();
        if self.closing {
            self.publish_lifecycle();
        }
        cmd.refuse_stopped();
        self.publish_stats();
    }

    /// A step may run: the lifecycle allows it and all memory is mapped.
    pub(super) fn can_step(&self) -> bool {
        self.lc.may_step() && self.mapped
    }

    fn apply_command(&mut self, cmd: Command) {
        match cmd {
            Command::Add(add) => self.admit(*add),
            Command::Abort { id, serial } => {
                let matches = self
                    .reqs
                    .get(&id)
                    .is_some_and(|r| serial.is_none_or(|s| s == r.serial));
                if matches {
                    self.finish(&id, FinishReason::Abort, None);
                }
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
                self.answer(reply, found);
            }
            Command::ResetPrefixCache {
                reset_running,
                reset_external,
                reply,
            } => self.reset_prefix_cache(reset_running, reset_external, reply),
            Command::Pause {
                mode,
                clear_cache,
                deadline,
                reply,
            } => self.pause(mode, clear_cache, deadline, reply),
            Command::Resume(reply) => self.resume(reply),
            Command::Sleep {
                level,
                mode,
                deadline,
                reply,
            } => self.sleep(level, mode, deadline, reply),
            Command::Wake { tags, reply } => self.wake(tags, reply),
            Command::ReleaseKv(reply) => self.release_kv(reply),
            Command::UpdateWeights {
                source,
                version,
                reply,
            } => self.update_weights(source, version, reply),
            Command::Nudge => {}
            // `apply` handles it.
            Command::Shutdown => {}
        }
    }

    /// Publishes the new state, then answers a caller: whatever the caller
    /// does next (add a request, read stats or status) sees the state its
    /// command produced.
    pub(super) fn answer<T>(&mut self, reply: Reply<T>, value: T) {
        self.publish_lifecycle();
        self.publish_stats();
        reply(value);
    }

    /// Publishes the lifecycle snapshot and the admission decision; the
    /// first publication after a command that closes admission says so.
    pub(super) fn publish_lifecycle(&mut self) {
        let update = LifecycleUpdate {
            status: self.lc.status(),
            refusal: self.lc.admission().err().map(|r| r.to_string()),
            weight_info: &self.weight_info,
            closed_admission: std::mem::take(&mut self.closing),
        };
        self.publisher.lifecycle(&update);
    }

    pub(super) fn publish_stats(&mut self) {
        let stats = self.stats();
        self.publisher.stats(&stats);
    }

    /// Queues a request the sender checked, unless the lifecycle refuses it
    /// or its id still names a request whose KV is being transferred (it
    /// then ends at once).
    fn admit(&mut self, add: AddRequest) {
        let AddRequest {
            serial,
            req,
            seed,
            mut output,
        } = add;
        if let Err(reason) = self.lc.admission() {
            // Unreachable through the handle, whose gate closes from the
            // moment a pause, sleep or weight update is sent; callers of the
            // core itself meet it.
            tracing::warn!(id = %req.id, reason = %reason, "request reached a core that refuses requests; aborted");
            output(abort_output(&req));
            return;
        }
        if self.sched.is_held(&req.id) {
            // Its blocks are keyed by id until the transfer ends.
            tracing::warn!(id = %req.id, "request id still names a finished request whose KV is being transferred; refused");
            let mut out = abort_output(&req);
            out.finish_reason = Some(FinishReason::Error);
            out.error = Some(format!(
                "request id {} is still in use by a KV transfer",
                req.id
            ));
            output(out);
            return;
        }
        let id: Arc<str> = Arc::from(req.id.as_str());
        let p = &req.params;
        let mut stop_token_ids = p.stop_token_ids.clone();
        if !p.ignore_eos {
            stop_token_ids.extend(&self.eos_ids);
        }
        let adjust = LogitsAdjust::from_params(p, &stop_token_ids);
        let mut history = TokenHistory::new(&req.prompt_tokens, adjust.repetition_penalty != 1.0);
        let prompt_logprobs = p.prompt_logprobs.map(|k| PromptLogprobs {
            top: k as usize,
            prompt: req.prompt_tokens.clone(),
            entries: vec![None],
            sent: false,
        });
        let mut detok = IncrementalDetokenizer::new(&req.prompt_tokens)
            .keeping_special_tokens(!p.skip_special_tokens);
        let mut stops =
            StopChecker::new(p.stop.clone()).including_stop(p.include_stop_str_in_output);
        let mut guide = p.constraint.as_ref().map(|g| g.start());
        // Outputs produced elsewhere pass through the same steps as sampled
        // ones, their text dropped: it was sent; what a stop string held
        // back stays held.
        for &tok in &req.resume_token_ids {
            if let Some(Err(e)) = guide.as_mut().map(|g| g.commit(tok)) {
                tracing::warn!(id = %req.id, error = %e, "resumed output breaks the request's grammar; refused");
                let mut out = abort_output(&req);
                out.finish_reason = Some(FinishReason::Error);
                out.error = Some(format!(
                    "resume_token_ids do not follow the request's structured output constraint: {e}"
                ));
                output(out);
                return;
            }
            history.push(tok);
            let delta = detok.push(&*self.decoder, tok);
            if history.num_outputs() > p.min_tokens as usize {
                stops.push(&delta);
            } else {
                stops.push_unmatched(&delta);
            }
        }
        let active = ActiveRequest {
            serial,
            output,
            sampling: SamplingConfig::from_params(p, seed),
            adjust,
            history,
            guide,
            return_logits: p.return_logits,
            logprobs: p.logprobs.map(|k| k as usize),
            prompt_logprobs,
            detok,
            stops,
            min_tokens: p.min_tokens as usize,
            num_prompt_tokens: req.prompt_tokens.len(),
            num_cached_tokens: 0,
        };
        self.sched.add_request(NewRequest {
            id: id.clone(),
            prompt_tokens: req.prompt_tokens,
            max_tokens: p.max_tokens as usize,
            stop_token_ids,
            kv_transfer_params: if self.has_connector {
                req.kv_transfer_params
            } else {
                None
            },
            prompt_logits: p.prompt_logprobs.is_some(),
            cache_salt: req
                .cache_salt
                .as_deref()
                .map(crate::block_pool::BlockHash::salt),
            output_tokens: req.resume_token_ids,
        });
        if active.guide.is_some() {
            self.structured.num_running += 1;
        }
        self.reqs.insert(id, active);
    }

    /// Ends a request: frees its blocks and sends the final output (with
    /// `last`'s tokens and text when given).
    fn finish(&mut self, id: &Arc<str>, reason: FinishReason, last: Option<RequestOutput>) {
        let params = self.sched.finish_request_with(id, reason).flatten();
        self.finish_active(id, reason, last, params, None, false);
    }

    /// Ends the core's side of a request the scheduler already ended.
    fn finish_active(
        &mut self,
        id: &Arc<str>,
        reason: FinishReason,
        last: Option<RequestOutput>,
        params: Option<crate::KvTransferParams>,
        error: Option<String>,
        timed_out: bool,
    ) {
        let Some(mut active) = self.reqs.remove(id) else {
            return;
        };
        if active.guide.is_some() {
            self.structured.num_running -= 1;
        }
        let mut out = last.unwrap_or_else(|| active.output(id));
        out.finish_reason = Some(reason);
        out.kv_transfer_params = params;
        out.error = error;
        out.timed_out = timed_out;
        // A receiver that is gone only means the client left.
        (active.output)(out);
    }

    pub(super) fn abort_all(&mut self) {
        let ids: Vec<Arc<str>> = self.reqs.keys().cloned().collect();
        for id in ids {
            self.finish(&id, FinishReason::Abort, None);
        }
    }

    /// Runs the model on `plan`. Meanwhile, when the plan samples for
    /// constrained requests, another thread computes their next masks
    /// (their time and the time the step then waits for them are counted).
    fn forward(&mut self, plan: &SchedulerOutput) -> anyhow::Result<()> {
        let (runner, logits, vocab) = (&mut self.runner, &mut self.logits, self.vocab);
        let mut guides: Vec<&mut Box<dyn TokenConstraint>> = Vec::new();
        if self.structured.num_running > 0 {
            let sampling: std::collections::HashSet<&str> = plan
                .seqs
                .iter()
                .filter(|s| s.sample)
                .map(|s| &*s.request_id)
                .collect();
            guides.extend(
                self.reqs
                    .iter_mut()
                    .filter(|(id, _)| sampling.contains(&***id))
                    .filter_map(|(_, a)| a.guide.as_mut()),
            );
        }
        if guides.is_empty() {
            return run_forward(runner, logits, vocab, plan);
        }
        let clock = &*self.clock;
        let num = guides.len() as u64;
        let (result, spent, waited) = std::thread::scope(|scope| {
            let masks = scope.spawn(move || {
                let start = clock.now();
                for g in guides {
                    g.prepare();
                }
                clock.now() - start
            });
            let result = run_forward(runner, logits, vocab, plan);
            let done = clock.now();
            // llguidance turns its own panics into errors (met at `apply`);
            // a panic here is a bug of ours.
            let spent = masks.join().expect("mask thread panicked");
            (result, spent, clock.now() - done)
        });
        let st = &mut self.structured;
        st.num_masks += num;
        st.mask_seconds += spent.as_secs_f64();
        st.mask_wait_seconds += waited.as_secs_f64();
        st.num_steps += 1;
        result
    }

    /// Applies what the connector finished: freed transfers, loaded
    /// requests, failed loads (ended here with their error).
    pub(super) fn poll_connector(&mut self) {
        for f in self.sched.update_from_connector() {
            let error = format!("loading the request's KV failed: {}", f.error);
            self.finish_active(
                &f.request_id,
                FinishReason::Error,
                None,
                None,
                Some(error),
                f.timed_out,
            );
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
        let (kept, rows, failed) = self.sample(&plan);
        for (id, e) in failed {
            tracing::warn!(id = %id, error = %e, "structured output constraint failed; the request ends");
            let params = self
                .sched
                .finish_request_with(&id, FinishReason::Error)
                .flatten();
            let error = format!("{}: {e}", crate::constraint::FAILED);
            self.finish_active(&id, FinishReason::Error, None, params, Some(error), false);
        }
        self.spec_stats.record(&plan, &kept);
        let kept_refs: Vec<&[u32]> = kept.iter().map(Vec::as_slice).collect();
        let updates = self.sched.update_from_tokens(&plan, &kept_refs);
        for u in updates {
            if u.new_tokens.is_empty() {
                continue;
            }
            self.emit(u, &rows);
        }
    }

    /// Sends what a step added to one request (one token, or confirmed
    /// drafts and a sampled token: each goes through the detokenizer and
    /// the stop strings in turn, as if decoded one by one) and ends it
    /// when the scheduler did or a stop string matched.
    fn emit(&mut self, u: crate::scheduler::SeqUpdate, rows: &HashMap<Arc<str>, Vec<usize>>) {
        let Some(active) = self.reqs.get_mut(&u.request_id) else {
            return;
        };
        active.num_cached_tokens = u.num_cached_tokens;
        let mut out = active.output(&u.request_id);
        if let Some(pl) = active.prompt_logprobs.as_mut().filter(|pl| !pl.sent) {
            // Every prompt row was computed before the first token.
            pl.sent = true;
            out.prompt_logprobs = Some(std::mem::take(&mut pl.entries));
        }
        let row_ids = &rows[&u.request_id];
        // Outputs before this step's (the history holds this step's
        // already: sampling pushed them).
        let before = active.history.num_outputs() - row_ids.len();
        let mut finish = None;
        let last = u.new_tokens.len() - 1;
        for (i, &tok) in u.new_tokens.iter().enumerate() {
            out.token_ids.push(tok);
            let r = row_ids[i];
            let row = &self.logits[r * self.vocab..(r + 1) * self.vocab];
            if active.return_logits {
                out.logits.push(row.to_vec());
            }
            if let Some(k) = active.logprobs {
                out.logprobs.push(logprobs(row, tok, k));
            }
            // The scheduler's finish reason belongs to its last token.
            finish = u.finished.filter(|_| i == last);
            // A stop token (EOS or stop_token_ids) is not part of the text.
            if finish != Some(FinishReason::Stop) {
                let delta = active.detok.push(&*self.decoder, tok);
                let (text, hit) = if before + i + 1 > active.min_tokens {
                    active.stops.push(&delta)
                } else {
                    (active.stops.push_unmatched(&delta), false)
                };
                out.text.push_str(&text);
                if hit {
                    finish = Some(FinishReason::Stop);
                    break;
                }
            }
        }
        if finish.is_some() && !active.stops.stopped() {
            let rest = active.detok.flush(&*self.decoder);
            let (text, _) = active.stops.push(&rest);
            out.text.push_str(&text);
            if !active.stops.stopped() {
                out.text.push_str(&active.stops.flush());
            }
        }
        match finish {
            // The scheduler already ended it (stop token, length).
            Some(reason) if u.finished.is_some() => self.finish_active(
                &u.request_id,
                reason,
                Some(out),
                u.kv_transfer_params,
                None,
                false,
            ),
            Some(reason) => self.finish(&u.request_id, reason, Some(out)),
            None => {
                if !(active.output)(out) {
                    // The client is gone: free the blocks now.
                    tracing::debug!(id = %u.request_id, "output receiver closed; aborting");
                    self.finish(&u.request_id, FinishReason::Abort, None);
                }
            }
        }
    }

    /// Samples from the logits rows, in order: the tokens each seq keeps
    /// (empty for a seq that does not sample) and, per sampling request,
    /// the row of each of them. Rows of seqs with `all_logits` feed their
    /// prompt log-probabilities.
    ///
    /// A seq with drafts goes through its rows in order, each sampled
    /// exactly as a decode step at that output index would sample it (the
    /// rows are the bits one-token steps give, the history holds the
    /// tokens before it, the same uniform draw): a draft is confirmed when
    /// the sampled token equals it, and the first token that differs (or
    /// the one after the last draft) ends the seq's tokens. This is
    /// rejection sampling for a proposal that puts all its mass on the
    /// draft: the draft is kept with probability p(draft), and otherwise
    /// the token comes from p without the draft, renormalised. So every
    /// token, greedy or seeded, is the one decoding without drafts gives.
    ///
    /// A constrained request's rows get its grammar's mask first (the
    /// log-probabilities emitted later read the masked rows), and each
    /// token sampled advances its grammar; a request whose constraint
    /// fails is returned last, with no tokens.
    #[allow(clippy::type_complexity)]
    fn sample(
        &mut self,
        plan: &SchedulerOutput,
    ) -> (
        Vec<Vec<u32>>,
        HashMap<Arc<str>, Vec<usize>>,
        Vec<(Arc<str>, ConstraintError)>,
    ) {
        let vocab = self.vocab;
        let clock = &*self.clock;
        let mut failed = Vec::new();
        let mut kept = Vec::with_capacity(plan.seqs.len());
        let mut rows: HashMap<Arc<str>, Vec<usize>> = HashMap::new();
        let mut next_row = 0;
        for s in &plan.seqs {
            let first = next_row;
            next_row += s.num_logit_rows();
            let active = self
                .reqs
                .get_mut(&s.request_id)
                .expect("scheduled request is active");
            if s.all_logits {
                if let Some(pl) = active.prompt_logprobs.as_mut() {
                    for (i, r) in (first..next_row).enumerate() {
                        pl.take_row(s.start_pos + i, &self.logits[r * vocab..(r + 1) * vocab]);
                    }
                }
            }
            if !s.sample {
                kept.push(Vec::new());
                continue;
            }
            // The row of the seq's last known token, then one per draft.
            let row0 = next_row - 1 - s.num_draft;
            let draft = s.draft();
            let mut toks = Vec::with_capacity(1 + s.num_draft);
            let mut used = Vec::with_capacity(1 + s.num_draft);
            for i in 0..=s.num_draft {
                let row = row0 + i;
                if let Some(g) = active.guide.as_mut() {
                    let start = clock.now();
                    let masked = g.apply(&mut self.logits[row * vocab..(row + 1) * vocab]);
                    self.structured.mask_seconds += (clock.now() - start).as_secs_f64();
                    if i > 0 {
                        // A draft's row: its mask was not prepared.
                        self.structured.num_masks += 1;
                    }
                    if let Err(e) = masked {
                        failed.push((s.request_id.clone(), e));
                        break;
                    }
                }
                let logits = &self.logits[row * vocab..(row + 1) * vocab];
                let index = (s.output_index + i) as u64;
                let token = if active.adjust.is_active() {
                    self.scratch.clear();
                    self.scratch.extend_from_slice(logits);
                    active.adjust.apply(&mut self.scratch, &active.history);
                    sample(&self.scratch, &active.sampling, index)
                } else {
                    sample(logits, &active.sampling, index)
                };
                if let Some(Err(e)) = active.guide.as_mut().map(|g| g.commit(token)) {
                    failed.push((s.request_id.clone(), e));
                    break;
                }
                active.history.push(token);
                toks.push(token);
                used.push(row);
                if draft.get(i) != Some(&token) {
                    break;
                }
            }
            if failed.last().is_some_and(|(id, _)| *id == s.request_id) {
                kept.push(Vec::new());
                continue;
            }
            kept.push(toks);
            rows.insert(s.request_id.clone(), used);
        }
        (kept, rows, failed)
    }
}

/// Runs the model on `plan`; a panic of the runner is an error too.
fn run_forward(
    runner: &mut Box<dyn ModelRunner>,
    logits: &mut Vec<f32>,
    vocab: usize,
    plan: &SchedulerOutput,
) -> anyhow::Result<()> {
    match catch_unwind(AssertUnwindSafe(|| runner.forward(&plan.seqs, logits))) {
        Ok(r) => r?,
        Err(panic) => {
            let msg = pdkv_model::team::panic_message(&*panic);
            anyhow::bail!("the forward pass panicked: {msg}");
        }
    }
    let want = plan.num_logit_rows() * vocab;
    anyhow::ensure!(
        logits.len() == want,
        "the forward pass returned {} logits, expected {want}",
        logits.len()
    );
    Ok(())
}
