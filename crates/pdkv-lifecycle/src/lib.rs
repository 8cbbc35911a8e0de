//! `pdkv-lifecycle`: the lifecycle matrix under load, across a prefill
//! server (P), a decode server (D) and the P/D proxy, each a child process
//! running the `pdkv` executable the caller names ([`Options::exe`]) on
//! loopback. `pdkv lifecycle` is its command; tests call [`run_matrix`] and
//! assert on the typed [`MatrixReport`].
//!
//! What one run does:
//! 1. Starts P and D (`pdkv serve` with the `pdkv` KV connector, sleep mode
//!    and the admin API) and then `pdkv proxy` in front of them, through
//!    `pdkv-deploy` as `pdkv up` does; every child listens on port 0 and
//!    its address is read from its `listening on http://ADDR` log line.
//!    Start-up is bounded and reported on stderr.
//! 2. Baseline, with nothing else running: the greedy probe set through the
//!    proxy (the reference texts), and the device bytes of P and D awake
//!    (the sum over tags of `pdkv_device_memory_bytes`).
//! 3. Per case and cycle: background load through the proxy (workers looping
//!    requests of varied lengths, streaming and not; every
//!    `--disconnect-every`-th request leaves after its first event), the
//!    case's admin calls on P, D or both, restoring both to serving, letting
//!    the load run on until it has completed requests again, stopping it
//!    (each worker finishes its request, bounded), waiting until P and D are
//!    quiescent, and the probe set again.
//!
//! A case passes when every admin call answered as expected, every probe
//! equals the baseline (each probe's KV loaded from P), no load request was
//! lost, no transfer failed, P and D are quiescent, the device bytes after
//! the wake equal the awake baseline, and a sleeping engine (level 1 or 2)
//! held at most 2% of its awake bytes while asleep.
//!
//! A load request is *lost* unless it got: a 200 with a complete body (JSON
//! with a finish reason, or events ending with a finish reason and
//! `[DONE]`); a 503 carrying `Retry-After` (D not serving, passed on by the
//! proxy); a finish reason `abort` in a case that aborts D's requests on
//! purpose (an abort pause of D; for `abort_requests` only the requests D
//! reported as aborted); or the client's own deliberate disconnect. A P that
//! stops on purpose (paused, asleep, aborting) never reaches the client: the
//! proxy lets D compute the prompt, so an abort pause of P alone aborts
//! nothing a client sees. An error the proxy reports (`upstream_error`,
//! `upstream_timeout`, an error event ending a stream) is lost. Every kind
//! is counted.
//!
//! No case tolerates a failed transfer: the deltas of P's
//! `pdkv_kv_pulls_failed_total` and D's `pdkv_kv_loads_failed_total` must be
//! 0. A transfer that a lifecycle operation or a refusal ends on purpose is
//! not a failure and is counted apart, and reported: on P
//! `pdkv_kv_pulls_released_total` (its cache reset or sleep, a refused or
//! aborted prefill, other weights) and `pdkv_kv_pulls_cancelled_total` (D
//! dropped the transfer); on D `pdkv_kv_loads_released_total` (P ended it on
//! purpose; D recomputes), `pdkv_kv_loads_cut_short_total` (D's own cache
//! reset), `pdkv_kv_loads_cancelled_total` (its request ended first) and
//! `pdkv_kv_loads_lease_expired_total` (P's lease ended before D got to it:
//! only for a transfer no D claimed). A lease that expires on a transfer D
//! claimed (`pdkv_kv_claimed_leases_expired_total` on P) fails the case. D's
//! `--kv-load-failure-policy` is `fail` by default, the strict setting (a
//! failed load would also fail its request); the matrix passes under
//! `recompute` too.
//!
//! Sleeps use mode `keep` (running requests are frozen and, when the KV
//! cache is released, recompute after the wake), the mode in which no
//! request may be lost. Level 2 follows a trainer's sequence: pause (keep),
//! sleep, wake, reload the weights from the checkpoint the servers started
//! with, resume. `trainer_sequence_{p,both}` are the calls an RL trainer
//! makes: `/pause?mode=keep`, `/sleep?level=1` without a mode (it keeps the
//! pause's mode), `/wake_up` (the explicit pause stays), `/resume`.
//!
//! Moments a case needs are arranged, not waited for by luck:
//! - `p_sleeps_while_d_pulls` sleeps P only while a transfer waits at P, and
//!   fails if none ever does. Write mode: P is paused (`keep`) first, so D's
//!   pulls park at P (P's `pdkv_kv_pulls_pending` >= 1, and it stays so while
//!   P computes nothing); read mode: D is paused (`keep`) first and a
//!   prompt is computed at P for a D that does not read it, so P holds its
//!   blocks (`pdkv_kv_send_held_blocks` >= 1); D asks for it after the wake
//!   and computes it itself.
//! - `reset_prefix_cache_{p,d}` must answer `true` idle; while a transfer
//!   holds blocks, `false` without `reset_running_requests` and `true` with
//!   it (running requests preempted, the transfer untouched). The case holds
//!   a transfer on purpose under load: on
//!   P a `do_remote_decode` request whose transfer no D has pulled yet
//!   (READY for its lease), on D a load whose first control exchange goes to
//!   a listener of this command that never answers (in flight, holding its
//!   blocks, for the connector's 5 s control bound). Both are released
//!   right after the reset (a D request loads P's transfer; D's request is
//!   aborted; P's transfer must still load after the reset), and once the
//!   load stopped the reset answers `true` again.
//!
//! Invariants: every wait is bounded; every child is killed and reaped when
//! the run ends, fails or is interrupted (and gets SIGTERM from the kernel
//! if this process dies, through `PR_SET_PDEATHSIG`).
//!
//! Files, one job each: `cases` (the catalogue), `cluster` (the deployment
//! and the calls on P and D), `metrics` (the Prometheus parser and the
//! transfer counters), `complete` (the completion and SSE client), `load`
//! (the load and its outcomes), `probes`, `fake` (the unanswering
//! listener), `holds` (moments arranged on purpose), `ops` (one function per
//! operation), `runner` (a case run, phase by phase), `matrix` (the whole
//! run), `report` (results and their text), `bounds` (every bound).

mod bounds;
mod cases;
mod clock;
mod cluster;
mod complete;
mod context;
mod error;
mod fake;
mod holds;
mod load;
mod matrix;
mod metrics;
mod ops;
mod options;
mod probes;
mod prompts;
mod report;
mod runner;

pub use cases::case_names;
pub use error::{CallError, LifecycleError, Problem};
pub use load::LoadCounts;
pub use matrix::run_matrix;
pub use metrics::TransferCounts;
pub use options::{OnCase, Options};
pub use pdkv_deploy::{FailurePolicy, TransferMode, Transport};
pub use report::{CaseResult, MatrixReport};
