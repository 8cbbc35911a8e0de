//! The sans-IO scheduler: continuous batching with chunked prefill, prefix
//! caching and preemption by recompute.
//!
//! The scheduler knows nothing of threads, clocks, channels or the model. A
//! driver calls [`Scheduler::schedule`], runs the model on the returned
//! [`SchedulerOutput`], samples, and feeds the sampled tokens back with
//! [`Scheduler::update_from_output`].
//!
//! Policy, per step:
//! 1. Running requests first, in admission order: a decoding request computes
//!    its one new token, an unfinished prefill continues with the next chunk
//!    that fits in the step's token budget. If blocks run out, the most
//!    recently admitted running request is preempted (its blocks are freed, it
//!    goes to the *front* of the waiting queue and will recompute prompt plus
//!    the output generated so far — the sequence continues exactly as if never
//!    preempted).
//! 2. Then waiting requests, first come first served, while the token budget,
//!    `max_num_seqs` and free blocks allow. The prefix cache serves the longest
//!    run of already computed full blocks. A prompt larger than the remaining
//!    budget is admitted with a first chunk. No waiting request is admitted in
//!    a step that preempted.
//!
//! Only the chunk that reaches the end of a request's known tokens samples.
//!
//! With speculative decoding ([`SpeculativeConfig`], n-gram lookup) a
//! decoding request's one new token is followed by up to `k` draft tokens
//! ([`ScheduledSeq::num_draft`]), within the step's token budget and its
//! `max_tokens`; the step gives back the tokens it kept (the drafts the
//! sampler confirmed, then one it sampled) and only those count as
//! computed, so the KV rejected drafts wrote is overwritten later and never
//! reaches the prefix cache.
//!
//! With a KV connector ([`crate::connector`]): at admission the connector may
//! offer external KV for tokens beyond the local prefix hit. An asynchronous
//! load parks the request in *waiting for remote KV* holding its blocks (it
//! is neither waiting nor running, takes no step budget and is never
//! preempted); when the connector reports the load finished, the request
//! goes back to the front of the waiting queue holding its blocks, with the
//! loaded tokens counted as computed — or, when the load failed, fails or
//! recomputes them by the connector's policy. A finished request whose KV
//! the connector still reads (a prefill engine's blocks waiting for the
//! decode engine) or writes (an aborted load) keeps its blocks *held* until
//! the connector names it in `get_finished`.
//!
//! Invariants (checked by [`Scheduler::check_invariants`]):
//! - every block reference is held by exactly one request's block table
//!   (sum of table lengths over live requests == sum of reference counts);
//! - a waiting request holds no blocks and has computed nothing, except one
//!   whose external KV finished loading (it holds blocks covering its
//!   computed tokens);
//! - blocks held for transfers belong to no live request's table and are
//!   counted in the reference counts;
//! - a running request's table covers its computed tokens;
//! - when no request is live and no transfer holds blocks, every block is free.
//!
//! Files: `state.rs` (the [`Scheduler`], requests' lifetimes, counts,
//! invariants), `step.rs` (planning a step and applying its results),
//! `transfers.rs` (what the connector's transfers hold and report), and the
//! leaves `request.rs` ([`NewRequest`] and the scheduler's own record of a
//! request), `plan.rs` ([`SchedulerOutput`], [`ScheduledSeq`],
//! [`SeqUpdate`]) and `ngram.rs` (drafts by n-gram lookup).

mod ngram;
mod plan;
mod request;
mod state;
mod step;
mod transfers;

pub use ngram::{SpeculativeConfig, MAX_SPECULATIVE_TOKENS};
pub use plan::{ScheduledSeq, SchedulerOutput, SeqUpdate};
pub use request::NewRequest;
pub use state::{FailedLoad, Scheduler, SchedulerConfig, SchedulerCounts};
