//! The relay plan: what the proxy decides for one client request, as a pure
//! state machine.
//!
//! No I/O, no clock, no threads, no HTTP library: the driver (the axum and
//! reqwest code of `pdkv_server::proxy`, or a simulator) feeds [`Event`]s in
//! with [`RelayPlan::handle`] and carries out the [`Action`]s that
//! [`RelayPlan::poll_action`] gives, in that order. Statuses are `u16`,
//! bodies bytes, `kv_transfer_params` JSON values. Timeouts are the
//! driver's: a call that ran out of time comes in as a [`CallError`] with
//! `timed_out` set.
//!
//! One plan per client request. It starts by asking for P's request (and,
//! in write mode, D's at the same time); in read mode D is asked once P
//! answered, with the `kv_transfer_params` P returned.
//!
//! Rules:
//! - A request that wants its prompt's logits ([`needs_prompt_logits`]:
//!   `prompt_logprobs`, or `echo` with `logprobs`) goes to D alone, which
//!   computes the prompt ([`RelayPlan::for_request`]): the client's body as
//!   it came, D's answer passed through as it comes (status, head and body,
//!   streamed or not), counted by D's status (2xx ok, 4xx the client's bad
//!   request, else D's error); a D that gives no head is a 502, and a body
//!   D breaks off ends the client's body broken too.
//! - P failing *on purpose* is not the client's failure: a 503 with the
//!   OpenAI code `engine_not_serving` (P paused or asleep) or an answer with
//!   `finish_reason: "abort"` (P's lifecycle or an admin aborted it). Write
//!   mode: D keeps running and P is told to drop the transfer with
//!   [`FailCode::PrefillRefused`] / [`FailCode::PrefillAborted`], so that a
//!   pull D parked at P is answered at once and D computes the prompt
//!   itself. Read mode: D gets the client's body without
//!   `kv_transfer_params`. Either way the client gets D's answer.
//! - P going away (its connection refused or broken, not timed out) is
//!   not the client's failure either: as above with
//!   [`OnPurpose::Lost`] (in write mode D's pull then fails and its
//!   `kv_load_failure_policy` decides).
//! - Any other P failure (error status, timeout, an answer
//!   that is not a completion) ends the request: D is cancelled and the
//!   client gets P's error (its status and body passed through, or the
//!   proxy's 502/504). It is always a status: no stream is committed while
//!   P runs.
//! - D's error status is passed through; a failing D (error status,
//!   transport error, broken stream) cancels a P still running and drops
//!   the transfer at P ([`FailCode::Dropped`]) unless P's part is over. A
//!   stream D breaks ends with an SSE error event and `data: [DONE]`.
//! - D finishing first: its answer stands and a P still running is cancelled.
//! - Streaming: D's status is committed only once P answered (or D's whole
//!   answer is in), so a P failure reaches the client as a status; D's
//!   events are forwarded cut at event boundaries (`\n\n`).
//! - A client error (400, 404, 409, 413, 422 from P or D: the client's own
//!   bad request) counts as [`Outcome::BadRequest`]; a timeout is a 504
//!   naming the proxy's `request_timeout`, any other failed call a 502.
//! - The client going away cancels both calls.
//! - Request migration ([`RelayPlan::with_resumes`]): D's streamed events
//!   name their output token ids in SSE comments
//!   ([`crate::TOKEN_IDS_HEADER`]), which the plan strips and records. D
//!   lost mid-stream (its connection refused or broken, not a timeout and
//!   not an error status) is replaced: [`Action::ResumeDecode`] sends the
//!   client's body to a decode server that serves with the tokens whose
//!   text the client has, and that D's events continue the same stream.
//!   An event D broke off halfway is dropped whole (neither its text nor
//!   its tokens count), so the client sees every token's text exactly
//!   once. At most the given number of resumes per request; past them,
//!   or when the new D answers an error status, the stream fails as
//!   without migration.
//!
//! Invariants:
//! - [`Action::Count`] comes exactly once, last; after it the plan is
//!   finished and ignores every event.
//! - Events a plan did not ask for or no longer waits for (the late answer
//!   of a cancelled call) are ignored, which a simulated network needs.
//! - Every buffer is bounded by [`MAX_BUFFERED`]: an answer beyond it is a
//!   failed call.
//! - Within one event's actions, upstream ones (send, cancel, drop) come
//!   before the client's answer, and the count comes last.

use std::collections::VecDeque;

use pdkv_connector::params;
use pdkv_connector::wire::FailCode;
use serde_json::{json, Map, Value};

pub use crate::answer::PrefillAnswer;
use crate::codes::{DECODE_LOST_CODE, RETRYABLE_CODE};
pub use crate::outcome::{OnPurpose, Outcome};
pub use crate::request::{can_resume, is_prompt_batch, needs_prompt_logits};
pub use crate::stream::{complete_events_len, strip_token_ids};

/// Largest answer (or unfinished event) the plan holds for the client.
pub const MAX_BUFFERED: usize = 64 << 20;

/// The part a backend plays.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Role {
    Prefill,
    Decode,
}

impl Role {
    pub fn as_str(self) -> &'static str {
        match self {
            Role::Prefill => "prefill",
            Role::Decode => "decode",
        }
    }
}

impl std::fmt::Display for Role {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// How the KV goes from P to D.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Mode {
    /// P and D at once; D pulls the KV from the P named here (P's engine id
    /// and bootstrap address, as its `/kv_transfer/info` said; `None` when
    /// unknown).
    Write {
        remote_engine_id: Option<String>,
        remote_bootstrap_addr: Option<String>,
    },
    /// P first; D reads the blocks P's answer names.
    Read,
}

impl Mode {
    /// The mode for a P as its `GET /kv_transfer/info` described it (its
    /// `transfer_mode`, engine id and bootstrap address; all `None` when it
    /// described nothing): read mode when it says so, else write mode
    /// naming P as far as it is known.
    pub fn for_prefill(
        transfer_mode: Option<&str>,
        engine_id: Option<&str>,
        bootstrap_addr: Option<&str>,
    ) -> Mode {
        if transfer_mode == Some("read") {
            return Mode::Read;
        }
        Mode::Write {
            remote_engine_id: engine_id.map(str::to_string),
            remote_bootstrap_addr: bootstrap_addr.map(str::to_string),
        }
    }
}

/// How a request D answered alone counts, by D's status.
fn alone_outcome(status: u16) -> Outcome {
    match status {
        200..=299 => Outcome::Ok,
        400..=499 => Outcome::BadRequest,
        _ => Outcome::DecodeError,
    }
}

/// Whether `status` says the client's request itself is wrong (so the
/// failure is counted as a bad request, not as a backend's).
pub fn is_client_error(status: u16) -> bool {
    matches!(status, 400 | 404 | 409 | 413 | 422)
}

/// A call that ended without an answer.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CallError {
    /// It ran past the driver's bound (the proxy's `request_timeout`).
    pub timed_out: bool,
    /// What went wrong, for people.
    pub detail: String,
}

/// What happened.
#[derive(Clone, Debug, PartialEq)]
pub enum Event {
    /// P answered.
    Prefill(PrefillAnswer),
    /// P's call ended without an answer.
    PrefillFailed(CallError),
    /// D's status line and headers arrived.
    DecodeHead { status: u16 },
    /// More of D's body.
    DecodeBody(Vec<u8>),
    /// D's body is complete.
    DecodeEnd,
    /// D's call (or its body) broke off.
    DecodeFailed(CallError),
    /// The client disconnected.
    ClientGone,
}

/// Whose headers go with a reply.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Head {
    /// Those worth passing on from D's answer.
    Decode,
    /// The content type of P's answer.
    Prefill,
    /// The proxy's own JSON error.
    Json,
}

/// A whole answer to the client.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Reply {
    pub status: u16,
    pub head: Head,
    /// Add `Retry-After: 1` (a 503 that clears by itself).
    pub retry_after: bool,
    pub body: Vec<u8>,
}

/// The log line and the blame of a request that did not end well.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Cause {
    pub role: Role,
    /// What the call did ("answered 500", "timed out: ..."), for people.
    pub what: String,
}

/// What the driver must do, in order.
#[derive(Clone, Debug, PartialEq)]
pub enum Action {
    /// Send P the client's body as a one-token prefill with these params.
    SendPrefill { params: Value },
    /// Send D the client's body with these params (`None`: with none, so D
    /// computes the prompt itself).
    SendDecode { params: Option<Value> },
    /// D was lost mid-stream: send the client's body to a decode server
    /// that serves (another, or the same once it is back), with
    /// `kv_transfer_params` holding only `resume_token_ids` (these tokens,
    /// an empty list when the client has none yet: the new D still must
    /// not open the stream again). It computes the prompt and them, and
    /// continues the stream.
    ResumeDecode { token_ids: Vec<u32> },
    /// Drop P's request (closing its connection aborts it).
    CancelPrefill,
    /// Drop D's request.
    CancelDecode,
    /// Tell P to drop the transfer (`pdkv_connector::wire::drop_transfer`).
    DropAtPrefill { code: FailCode },
    /// P stopped on purpose; D computes the prompt itself (count it, log it).
    PrefillSkipped(OnPurpose),
    /// Answer the client with this, whole.
    Reply(Reply),
    /// Answer the client with D's status and headers and a streamed body.
    StartStream { status: u16 },
    /// The next bytes of the stream (whole events, but for a trailer D
    /// left unterminated at its end).
    Stream(Vec<u8>),
    /// The stream is complete.
    EndStream,
    /// Send `event` (an SSE error event and `data: [DONE]`), then end: as
    /// a complete body, or, when `broken`, as a broken one (the client sees
    /// the answer cut off, as D's own broken body shows when it passes
    /// through).
    FailStream { event: Vec<u8>, broken: bool },
    /// Count the request's outcome (exactly once, last).
    Count {
        outcome: Outcome,
        cause: Option<Cause>,
    },
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Prefill {
    Running,
    /// Answered: its KV waits for D (write) or D was given P's params (read).
    Done,
    /// Stopped on purpose; D computes the prompt itself.
    Skipped(OnPurpose),
    /// Cancelled, failed, or its transfer dropped: nothing more to do there.
    Over,
}

#[derive(Debug, PartialEq, Eq)]
enum Decode {
    /// Read mode: asked once P answered.
    NotAsked,
    /// Asked; no head yet.
    Asked,
    /// D's head arrived and the client has not been answered: the body is
    /// gathered (a whole non-streamed or error answer, or events held until
    /// P answered).
    Gathering {
        status: u16,
        buf: Vec<u8>,
    },
    /// D's events go to the client; `buf` holds an unfinished event.
    Streaming {
        buf: Vec<u8>,
    },
    /// D alone: its answer, with this status, passes to the client as it
    /// comes.
    Passing {
        status: u16,
    },
    Over,
}

/// The proxy's decisions for one client request; see the module docs.
#[derive(Debug)]
pub struct RelayPlan {
    read: bool,
    /// D alone computes the prompt; P is never asked.
    alone: bool,
    streaming: bool,
    transfer_id: String,
    prefill: Prefill,
    decode: Decode,
    outcome: Option<Outcome>,
    actions: VecDeque<Action>,
    /// D's events carry their token ids (see [`RelayPlan::with_resumes`]).
    tracking: bool,
    resumes_left: u32,
    /// Output tokens whose text went to the client.
    produced: Vec<u32>,
    /// The client's stream head was sent.
    stream_started: bool,
}

impl RelayPlan {
    /// A plan for one request; its first actions send P's request (and D's,
    /// in write mode).
    pub fn new(mode: Mode, streaming: bool, transfer_id: &str) -> RelayPlan {
        let mut plan = RelayPlan::start(
            mode == Mode::Read,
            false,
            streaming,
            transfer_id,
            Prefill::Running,
        );
        plan.push(Action::SendPrefill {
            params: params::for_prefill(transfer_id),
        });
        if let Mode::Write {
            remote_engine_id,
            remote_bootstrap_addr,
        } = &mode
        {
            let p = params::for_decode(
                transfer_id,
                remote_engine_id.as_deref(),
                remote_bootstrap_addr.as_deref(),
            );
            plan.ask_decode(Some(p));
        }
        plan
    }

    /// A plan with nothing done yet: D not asked, P in the state given.
    fn start(
        read: bool,
        alone: bool,
        streaming: bool,
        transfer_id: &str,
        prefill: Prefill,
    ) -> RelayPlan {
        RelayPlan {
            read,
            alone,
            streaming,
            transfer_id: transfer_id.to_string(),
            prefill,
            decode: Decode::NotAsked,
            outcome: None,
            actions: VecDeque::new(),
            tracking: false,
            resumes_left: 0,
            produced: Vec::new(),
            stream_started: false,
        }
    }

    /// The plan for a client request whose JSON body is `req`, through a P
    /// of `mode`: a request that wants its prompt's logits goes to D alone
    /// ([`RelayPlan::decode_alone`]), any other through P and D
    /// ([`RelayPlan::new`]). It streams when `req` says `"stream": true`.
    pub fn for_request(req: &Map<String, Value>, mode: Mode, transfer_id: &str) -> RelayPlan {
        let streaming = req.get("stream").and_then(Value::as_bool).unwrap_or(false);
        if needs_prompt_logits(req) || is_prompt_batch(req) {
            let params = req.get("kv_transfer_params").cloned();
            return RelayPlan::decode_alone(streaming, transfer_id, params);
        }
        RelayPlan::new(mode, streaming, transfer_id)
    }

    /// The plan for a client request whose JSON body is `req` when no
    /// prefill server is up: one that needs its prompt's logits or carries
    /// several prompts is [`RelayPlan::decode_alone`]'s; any other goes to
    /// D as after P was lost (its first action sends D the client's body
    /// with the client's own `kv_transfer_params`), so that its stream is
    /// cut at events and can be resumed ([`RelayPlan::with_resumes`]).
    pub fn without_prefill(req: &Map<String, Value>, transfer_id: &str) -> RelayPlan {
        let streaming = req.get("stream").and_then(Value::as_bool).unwrap_or(false);
        let params = req.get("kv_transfer_params").cloned();
        if needs_prompt_logits(req) || is_prompt_batch(req) {
            return RelayPlan::decode_alone(streaming, transfer_id, params);
        }
        let mut plan = RelayPlan::start(
            false,
            false,
            streaming,
            transfer_id,
            Prefill::Skipped(OnPurpose::Lost),
        );
        plan.ask_decode(params);
        plan
    }

    /// A plan that sends the client's request to D alone, which computes
    /// the prompt: its first action sends D the client's body as it came
    /// (`params`: the client's own `kv_transfer_params`, if any), and D's
    /// answer passes through as it comes.
    pub fn decode_alone(streaming: bool, transfer_id: &str, params: Option<Value>) -> RelayPlan {
        let mut plan = RelayPlan::start(false, true, streaming, transfer_id, Prefill::Over);
        plan.ask_decode(params);
        plan
    }

    /// Lets a streamed request through P and D survive losing D mid-stream
    /// up to `max` times (see the module docs); without effect on a plan
    /// that does not stream through P and D, or for a request
    /// [`can_resume`] refuses. The driver then asks every D of this plan
    /// for token ids ([`RelayPlan::tracks_token_ids`]).
    pub fn with_resumes(mut self, req: &Map<String, Value>, max: u32) -> RelayPlan {
        if self.streaming && !self.alone && max > 0 && can_resume(req) {
            self.tracking = true;
            self.resumes_left = max;
        }
        self
    }

    /// Whether D must be asked for each event's token ids
    /// ([`crate::TOKEN_IDS_HEADER`]).
    pub fn tracks_token_ids(&self) -> bool {
        self.tracking
    }

    /// Whether D alone answers (P is never asked).
    pub fn is_decode_alone(&self) -> bool {
        self.alone
    }

    pub fn transfer_id(&self) -> &str {
        &self.transfer_id
    }

    /// Whether the client streams.
    pub fn streaming(&self) -> bool {
        self.streaming
    }

    /// The outcome, once counted.
    pub fn outcome(&self) -> Option<Outcome> {
        self.outcome
    }

    /// Whether the outcome is counted: no event changes anything now.
    pub fn is_finished(&self) -> bool {
        self.outcome.is_some()
    }

    /// The next thing to do.
    #[must_use]
    pub fn poll_action(&mut self) -> Option<Action> {
        self.actions.pop_front()
    }

    pub fn handle(&mut self, event: Event) {
        if self.is_finished() {
            return;
        }
        if self.alone {
            return self.handle_alone(event);
        }
        match event {
            Event::Prefill(answer) => self.on_prefill(answer),
            Event::PrefillFailed(e) => self.on_prefill_failed(Failure::Call(e)),
            Event::DecodeHead { status } => self.on_decode_head(status),
            Event::DecodeBody(bytes) => self.on_decode_body(bytes),
            Event::DecodeEnd => self.on_decode_end(),
            Event::DecodeFailed(e) => self.on_decode_failed(Failure::Call(e)),
            Event::ClientGone => self.on_client_gone(),
        }
    }

    fn push(&mut self, a: Action) {
        self.actions.push_back(a);
    }

    fn finish(&mut self, outcome: Outcome, cause: Option<Cause>) {
        self.prefill = Prefill::Over;
        self.decode = Decode::Over;
        self.outcome = Some(outcome);
        self.push(Action::Count { outcome, cause });
    }

    /// The client's stream goes on: D's events, their token-id comments
    /// stripped and recorded when tracking.
    fn forward(&mut self, bytes: Vec<u8>) {
        let bytes = if self.tracking {
            strip_token_ids(&bytes, &mut self.produced)
        } else {
            bytes
        };
        if !bytes.is_empty() {
            self.push(Action::Stream(bytes));
        }
    }

    fn start_stream(&mut self, status: u16) {
        self.stream_started = true;
        self.push(Action::StartStream { status });
    }

    /// Whether a lost D is replaced ([`RelayPlan::with_resumes`]).
    fn can_resume_after(&self, f: &Failure) -> bool {
        self.tracking
            && self.stream_started
            && self.resumes_left > 0
            && matches!(self.decode, Decode::Streaming { .. } | Decode::Asked)
            && matches!(
                f,
                Failure::Call(CallError {
                    timed_out: false,
                    ..
                })
            )
    }

    /// Sends the request to another D with the tokens the client has; an
    /// event D left unfinished is dropped.
    fn resume(&mut self) {
        self.release_prefill();
        self.resumes_left -= 1;
        self.push(Action::ResumeDecode {
            token_ids: self.produced.clone(),
        });
        self.decode = Decode::Asked;
    }

    fn ask_decode(&mut self, params: Option<Value>) {
        self.push(Action::SendDecode { params });
        self.decode = Decode::Asked;
    }

    fn on_prefill(&mut self, answer: PrefillAnswer) {
        if self.prefill != Prefill::Running {
            return;
        }
        match answer {
            PrefillAnswer::Done { params } => {
                self.prefill = Prefill::Done;
                if self.read {
                    self.ask_decode(params);
                } else {
                    self.commit_if_ready();
                }
            }
            PrefillAnswer::Aborted => self.prefill_skipped(OnPurpose::Aborted),
            PrefillAnswer::Error {
                status: 503,
                code: Some(code),
                ..
            } if code == RETRYABLE_CODE => self.prefill_skipped(OnPurpose::Refused),
            PrefillAnswer::Error { status, body, .. } => {
                self.on_prefill_failed(Failure::Status { status, body })
            }
            PrefillAnswer::Malformed { reason } => {
                self.on_prefill_failed(Failure::Unusable(reason))
            }
        }
    }

    /// P stopped on purpose: D goes on (write mode, after P is told to
    /// drop the transfer) or is asked without params (read mode).
    fn prefill_skipped(&mut self, why: OnPurpose) {
        self.prefill = Prefill::Skipped(why);
        self.push(Action::PrefillSkipped(why));
        if self.read {
            self.ask_decode(None);
        } else {
            self.push(Action::DropAtPrefill { code: why.code() });
            self.commit_if_ready();
        }
    }

    fn on_prefill_failed(&mut self, f: Failure) {
        if self.prefill != Prefill::Running {
            return;
        }
        if let Failure::Call(CallError {
            timed_out: false, ..
        }) = &f
        {
            // P went away: D computes the prompt, as when P refuses.
            return self.prefill_skipped(OnPurpose::Lost);
        }
        // No stream is committed while P runs: the client gets P's status.
        if matches!(self.decode, Decode::Asked | Decode::Gathering { .. }) {
            self.push(Action::CancelDecode);
        }
        self.push(Action::Reply(f.reply(Role::Prefill)));
        let outcome = if f.is_client_error() {
            Outcome::BadRequest
        } else {
            Outcome::PrefillError
        };
        self.finish(
            outcome,
            Some(Cause {
                role: Role::Prefill,
                what: f.describe(),
            }),
        );
    }

    fn prefill_answered(&self) -> bool {
        matches!(self.prefill, Prefill::Done | Prefill::Skipped(_))
    }

    /// Streaming: D's status goes to the client once D's head is a success
    /// and P has answered; the events gathered so far follow.
    fn commit_if_ready(&mut self) {
        if !self.streaming || !self.prefill_answered() {
            return;
        }
        let Decode::Gathering { status, buf } = &mut self.decode else {
            return;
        };
        if !(200..300).contains(status) {
            return;
        }
        let (status, mut buf) = (*status, std::mem::take(buf));
        self.start_stream(status);
        let rest = buf.split_off(complete_events_len(&buf));
        self.forward(buf);
        self.decode = Decode::Streaming { buf: rest };
    }

    fn on_decode_head(&mut self, status: u16) {
        if self.decode != Decode::Asked {
            return;
        }
        if self.stream_started && (200..300).contains(&status) {
            // A resumed D: its events continue the client's stream.
            self.decode = Decode::Streaming { buf: Vec::new() };
            return;
        }
        if !(200..300).contains(&status) {
            // Nobody will take P's KV.
            self.release_prefill();
        }
        self.decode = Decode::Gathering {
            status,
            buf: Vec::new(),
        };
        self.commit_if_ready();
    }

    /// D failed: a P still running is cancelled, and a transfer P may
    /// still hold for D is dropped.
    fn release_prefill(&mut self) {
        match self.prefill {
            Prefill::Running => {
                self.push(Action::CancelPrefill);
                self.push(Action::DropAtPrefill {
                    code: FailCode::Dropped,
                });
            }
            Prefill::Done => self.push(Action::DropAtPrefill {
                code: FailCode::Dropped,
            }),
            Prefill::Skipped(_) | Prefill::Over => {}
        }
        self.prefill = Prefill::Over;
    }

    fn on_decode_body(&mut self, bytes: Vec<u8>) {
        let (Decode::Gathering { buf, .. } | Decode::Streaming { buf }) = &mut self.decode else {
            return;
        };
        if buf.len() + bytes.len() > MAX_BUFFERED {
            let reason =
                format!("its answer holds more than {MAX_BUFFERED} bytes this proxy would buffer");
            return self.on_decode_failed(Failure::Unusable(reason));
        }
        buf.extend_from_slice(&bytes);
        if let Decode::Streaming { buf } = &mut self.decode {
            let n = complete_events_len(buf);
            if n > 0 {
                let rest = buf.split_off(n);
                let events = std::mem::replace(buf, rest);
                self.forward(events);
            }
        }
    }

    /// D's whole answer goes to the client as D gave it.
    fn reply_as_decode(&mut self, status: u16, body: Vec<u8>) {
        self.push(Action::Reply(Reply {
            status,
            head: Head::Decode,
            retry_after: false,
            body,
        }));
    }

    fn on_decode_end(&mut self) {
        match std::mem::replace(&mut self.decode, Decode::Over) {
            Decode::Gathering { status, buf } if (200..300).contains(&status) => {
                // D's answer is whole: it stands, whatever P still does.
                if self.prefill == Prefill::Running {
                    self.push(Action::CancelPrefill);
                }
                if self.streaming {
                    self.start_stream(status);
                    self.forward(buf);
                    self.push(Action::EndStream);
                } else {
                    self.reply_as_decode(status, buf);
                }
                self.finish(Outcome::Ok, None);
            }
            Decode::Gathering { status, buf } => {
                if self.stream_started {
                    // A resumed D refused: the stream ends with its error.
                    let f = Failure::Status { status, body: buf };
                    self.push(Action::FailStream {
                        event: f.sse_event(Role::Decode),
                        broken: false,
                    });
                } else {
                    self.reply_as_decode(status, buf);
                }
                let outcome = if is_client_error(status) {
                    Outcome::BadRequest
                } else {
                    Outcome::DecodeError
                };
                self.finish(
                    outcome,
                    Some(Cause {
                        role: Role::Decode,
                        what: format!("answered {status}"),
                    }),
                );
            }
            Decode::Streaming { buf } => {
                self.forward(buf);
                self.push(Action::EndStream);
                self.finish(Outcome::Ok, None);
            }
            other @ (Decode::NotAsked | Decode::Asked | Decode::Passing { .. } | Decode::Over) => {
                self.decode = other
            }
        }
    }

    fn on_decode_failed(&mut self, f: Failure) {
        let f = match &self.decode {
            Decode::Gathering { status, .. } if !(200..300).contains(status) => {
                f.after_status(*status)
            }
            Decode::Asked | Decode::Gathering { .. } | Decode::Streaming { .. } => f,
            Decode::NotAsked | Decode::Passing { .. } | Decode::Over => return,
        };
        if self.can_resume_after(&f) {
            return self.resume();
        }
        self.release_prefill();
        if self.stream_started {
            self.push(Action::FailStream {
                event: f.sse_event(Role::Decode),
                broken: false,
            });
        } else if let Failure::Call(
            e @ CallError {
                timed_out: false, ..
            },
        ) = &f
        {
            // D went away before the client saw anything: nothing is lost
            // by sending the request again, whole, to a D that serves.
            let message = format!(
                "decode server lost before it answered ({}); the request can be sent again",
                e.detail
            );
            self.push(Action::Reply(Reply {
                status: 503,
                head: Head::Json,
                retry_after: true,
                body: error_json(&message, "server_error", DECODE_LOST_CODE).into_bytes(),
            }));
        } else {
            self.push(Action::Reply(f.reply(Role::Decode)));
        }
        self.finish(
            Outcome::DecodeError,
            Some(Cause {
                role: Role::Decode,
                what: f.describe(),
            }),
        );
    }

    fn on_client_gone(&mut self) {
        if self.prefill == Prefill::Running {
            self.push(Action::CancelPrefill);
        }
        if matches!(
            self.decode,
            Decode::Asked | Decode::Gathering { .. } | Decode::Streaming { .. }
        ) {
            self.push(Action::CancelDecode);
        }
        self.finish(Outcome::Cancelled, None);
    }
}

/// D alone: its answer passes through as it comes.
impl RelayPlan {
    fn handle_alone(&mut self, event: Event) {
        match (event, &self.decode) {
            (Event::DecodeHead { status }, Decode::Asked) => {
                // Whatever D's status: its answer is the client's.
                self.push(Action::StartStream { status });
                self.decode = Decode::Passing { status };
            }
            (Event::DecodeBody(bytes), Decode::Passing { .. }) => {
                self.push(Action::Stream(bytes));
            }
            (Event::DecodeEnd, &Decode::Passing { status }) => {
                self.push(Action::EndStream);
                self.finish(alone_outcome(status), None);
            }
            (Event::DecodeFailed(e), Decode::Asked) => {
                let message = format!("decode server failed: {}", e.detail);
                self.push(Action::Reply(Reply {
                    status: 502,
                    head: Head::Json,
                    retry_after: false,
                    body: error_json(&message, "server_error", "upstream_error").into_bytes(),
                }));
                self.finish(Outcome::DecodeError, None);
            }
            (Event::DecodeFailed(_), &Decode::Passing { status }) => {
                // The status is the client's already: the body ends broken.
                self.push(Action::FailStream {
                    event: Vec::new(),
                    broken: true,
                });
                self.finish(alone_outcome(status), None);
            }
            (Event::ClientGone, decode) => {
                let outcome = match decode {
                    Decode::Passing { status } => alone_outcome(*status),
                    _ => Outcome::Cancelled,
                };
                self.push(Action::CancelDecode);
                self.finish(outcome, None);
            }
            // P is never asked; nothing else is waited for.
            _ => {}
        }
    }
}

/// An OpenAI error body (the shape of `pdkv_server::error::ApiError`, which
/// `pdkv-server`'s tests check).
pub fn error_json(message: &str, kind: &str, code: &str) -> String {
    json!({"error": {"message": message, "type": kind, "param": null, "code": code}}).to_string()
}

/// Why a call gave nothing usable.
enum Failure {
    /// An error status with its body (passed to the client).
    Status {
        status: u16,
        body: Vec<u8>,
    },
    Call(CallError),
    Unusable(String),
}

impl Failure {
    fn is_client_error(&self) -> bool {
        matches!(self, Failure::Status { status, .. } if is_client_error(*status))
    }

    fn describe(&self) -> String {
        match self {
            Failure::Status { status, .. } => format!("answered {status}"),
            Failure::Call(CallError {
                timed_out: true,
                detail,
            }) => format!("timed out: {detail}"),
            Failure::Call(CallError { detail, .. }) => format!("failed: {detail}"),
            Failure::Unusable(reason) => format!("gave an unusable answer: {reason}"),
        }
    }

    /// D's error answer whose body then broke off: said with D's status.
    fn after_status(self, status: u16) -> Failure {
        Failure::Unusable(format!(
            "answered {status}, then its body {}",
            self.describe()
        ))
    }

    /// The proxy's own error for this failure: status and body.
    fn proxy_error(&self, role: Role) -> (u16, String) {
        let message = format!("{role} server {}", self.describe());
        match self {
            Failure::Call(CallError {
                timed_out: true, ..
            }) => {
                let message = format!(
                    "{message}; the proxy's request_timeout bounds each upstream request: \
                     raise request_timeout (pdkv proxy --request-timeout) for longer requests"
                );
                (
                    504,
                    error_json(&message, "timeout_error", "upstream_timeout"),
                )
            }
            _ => (502, error_json(&message, "server_error", "upstream_error")),
        }
    }

    fn reply(&self, role: Role) -> Reply {
        match self {
            Failure::Status { status, body } => Reply {
                status: *status,
                head: Head::Prefill,
                retry_after: *status == 503,
                body: body.clone(),
            },
            _ => {
                let (status, body) = self.proxy_error(role);
                Reply {
                    status,
                    head: Head::Json,
                    retry_after: false,
                    body: body.into_bytes(),
                }
            }
        }
    }

    /// The events ending a stream this failure cut short: the proxy's
    /// error and `[DONE]`.
    fn sse_event(&self, role: Role) -> Vec<u8> {
        // An error status with an OpenAI error body passes that body on.
        let passed = match self {
            Failure::Status { body, .. } => serde_json::from_slice::<Value>(body)
                .ok()
                .filter(|v| v.get("error").is_some())
                .map(|v| v.to_string()),
            _ => None,
        };
        let data = passed.unwrap_or_else(|| self.proxy_error(role).1);
        format!("data: {data}\n\ndata: [DONE]\n\n").into_bytes()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const TID: &str = "t1";

    fn write() -> Mode {
        Mode::Write {
            remote_engine_id: Some("p0".into()),
            remote_bootstrap_addr: Some("127.0.0.1:7000".into()),
        }
    }

    fn p_params() -> Value {
        params::for_prefill(TID)
    }

    fn d_params() -> Value {
        params::for_decode(TID, Some("p0"), Some("127.0.0.1:7000"))
    }

    fn p_answer(status: u16, body: &str) -> Event {
        Event::Prefill(PrefillAnswer::parse(status, body.as_bytes()))
    }

    const NOT_SERVING: &str = r#"{"error":{"message":"paused","type":"service_unavailable_error","param":null,"code":"engine_not_serving"}}"#;
    const P_DONE: &str =
        r#"{"choices":[{"text":"x","finish_reason":"length"}],"kv_transfer_params":null}"#;
    const P_ABORTED: &str = r#"{"choices":[{"text":"","finish_reason":"abort"}]}"#;
    const D_BODY: &str = r#"{"choices":[{"text":"hello","finish_reason":"length"}]}"#;

    fn refused() -> Event {
        p_answer(503, NOT_SERVING)
    }

    fn aborted() -> Event {
        p_answer(200, P_ABORTED)
    }

    fn p_done() -> Event {
        p_answer(200, P_DONE)
    }

    fn head(status: u16) -> Event {
        Event::DecodeHead { status }
    }

    fn body(s: &str) -> Event {
        Event::DecodeBody(s.as_bytes().to_vec())
    }

    fn failed(timed_out: bool) -> CallError {
        CallError {
            timed_out,
            detail: "connection reset".into(),
        }
    }

    fn stream(s: &str) -> Action {
        Action::Stream(s.as_bytes().to_vec())
    }

    fn reply(status: u16, head: Head, body: &str) -> Action {
        Action::Reply(Reply {
            status,
            head,
            retry_after: false,
            body: body.as_bytes().to_vec(),
        })
    }

    fn ok() -> Action {
        Action::Count {
            outcome: Outcome::Ok,
            cause: None,
        }
    }

    fn count(outcome: Outcome, role: Role, what: &str) -> Action {
        Action::Count {
            outcome,
            cause: Some(Cause {
                role,
                what: what.into(),
            }),
        }
    }

    fn drain(plan: &mut RelayPlan) -> Vec<Action> {
        std::iter::from_fn(|| plan.poll_action()).collect()
    }

    /// Runs `steps` (an event and the exact actions it must give) on a new
    /// plan, after checking the plan's first actions.
    fn check(mode: Mode, streaming: bool, steps: Vec<(Event, Vec<Action>)>) -> RelayPlan {
        let read = mode == Mode::Read;
        let plan = RelayPlan::new(mode, streaming, TID);
        let mut first = vec![Action::SendPrefill { params: p_params() }];
        if !read {
            first.push(Action::SendDecode {
                params: Some(d_params()),
            });
        }
        drive(plan, first, steps)
    }

    /// Checks a plan's `first` actions, then runs `steps` (an event and the
    /// exact actions it must give).
    fn drive(
        mut plan: RelayPlan,
        first: Vec<Action>,
        steps: Vec<(Event, Vec<Action>)>,
    ) -> RelayPlan {
        assert_eq!(drain(&mut plan), first, "first actions");
        for (i, (event, want)) in steps.into_iter().enumerate() {
            let what = format!("step {i}: {event:?}");
            plan.handle(event);
            assert_eq!(drain(&mut plan), want, "{what}");
        }
        plan
    }

    /// The reply and count of a failed call, whatever its message.
    fn error_reply(actions: &[Action]) -> (u16, Value) {
        let Some(Action::Reply(r)) = actions.iter().find(|a| matches!(a, Action::Reply(_))) else {
            panic!("no reply in {actions:?}")
        };
        assert_eq!(r.head, Head::Json);
        (
            r.status,
            serde_json::from_slice(&r.body).expect("JSON error"),
        )
    }

    #[test]
    fn write_mode_success_answers_with_ds_body() {
        let plan = check(
            write(),
            false,
            vec![
                (p_done(), vec![]),
                (head(200), vec![]),
                (body(&D_BODY[..10]), vec![]),
                (body(&D_BODY[10..]), vec![]),
                (
                    Event::DecodeEnd,
                    vec![reply(200, Head::Decode, D_BODY), ok()],
                ),
            ],
        );
        assert_eq!(plan.outcome(), Some(Outcome::Ok));
    }

    #[test]
    fn write_mode_streaming_commits_only_after_p_answered_and_cuts_at_event_boundaries() {
        check(
            write(),
            true,
            vec![
                (head(200), vec![]),
                // Held until P answered; an unfinished event stays held.
                (body("data: 1\n\ndata: 2"), vec![]),
                (
                    p_done(),
                    vec![Action::StartStream { status: 200 }, stream("data: 1\n\n")],
                ),
                (body("\n"), vec![]),
                (
                    body("\ndata: [DONE]\n\n"),
                    vec![stream("data: 2\n\ndata: [DONE]\n\n")],
                ),
                (Event::DecodeEnd, vec![Action::EndStream, ok()]),
            ],
        );
    }

    #[test]
    fn write_mode_refused_prefill_keeps_d_and_drops_at_p_with_prefill_refused() {
        let skipped = || {
            vec![
                Action::PrefillSkipped(OnPurpose::Refused),
                Action::DropAtPrefill {
                    code: FailCode::PrefillRefused,
                },
            ]
        };
        let plan = check(
            write(),
            false,
            vec![
                (refused(), skipped()),
                (head(200), vec![]),
                (body(D_BODY), vec![]),
                (
                    Event::DecodeEnd,
                    vec![reply(200, Head::Decode, D_BODY), ok()],
                ),
            ],
        );
        assert_eq!(plan.outcome(), Some(Outcome::Ok));
        let mut start = skipped();
        start.push(Action::StartStream { status: 200 });
        check(
            write(),
            true,
            vec![
                (head(200), vec![]),
                (refused(), start),
                (body("data: 1\n\n"), vec![stream("data: 1\n\n")]),
                (Event::DecodeEnd, vec![Action::EndStream, ok()]),
            ],
        );
    }

    #[test]
    fn write_mode_aborted_or_lost_prefill_keeps_d_and_drops_at_p_naming_why() {
        // P lost (connection refused or broken): D keeps its request, whose
        // pull then fails and its policy decides.
        for (event, why) in [
            (aborted(), OnPurpose::Aborted),
            (Event::PrefillFailed(failed(false)), OnPurpose::Lost),
        ] {
            write_mode_skipped_prefill(event, why);
        }
    }

    fn write_mode_skipped_prefill(aborted: Event, why: OnPurpose) {
        let aborted = || aborted.clone();
        let skipped = || {
            vec![
                Action::PrefillSkipped(why),
                Action::DropAtPrefill { code: why.code() },
            ]
        };
        check(
            write(),
            false,
            vec![
                (head(200), vec![]),
                (aborted(), skipped()),
                (body(D_BODY), vec![]),
                (
                    Event::DecodeEnd,
                    vec![reply(200, Head::Decode, D_BODY), ok()],
                ),
            ],
        );
        let mut then_stream = skipped();
        then_stream.extend([Action::StartStream { status: 200 }, stream("data: 1\n\n")]);
        check(
            write(),
            true,
            vec![
                (head(200), vec![]),
                (body("data: 1\n\n"), vec![]),
                (aborted(), then_stream),
                (Event::DecodeEnd, vec![Action::EndStream, ok()]),
            ],
        );
        // D's answer after a skipped prefill may still fail: then nothing
        // more is dropped at P (it was already).
        check(
            write(),
            false,
            vec![
                (aborted(), skipped()),
                (head(500), vec![]),
                (
                    Event::DecodeEnd,
                    vec![
                        reply(500, Head::Decode, ""),
                        count(Outcome::DecodeError, Role::Decode, "answered 500"),
                    ],
                ),
            ],
        );
    }

    #[test]
    fn other_prefill_errors_cancel_d_and_pass_ps_status_through() {
        let p500 = r#"{"error":{"message":"boom","type":"server_error","param":null,"code":null}}"#;
        let p503 = r#"{"error":{"message":"stopped","type":"service_unavailable_error","param":null,"code":null}}"#;
        for streaming in [false, true] {
            check(
                write(),
                streaming,
                vec![
                    (head(200), vec![]),
                    (body("data: 1\n\n"), vec![]),
                    (
                        p_answer(500, p500),
                        vec![
                            Action::CancelDecode,
                            reply(500, Head::Prefill, p500),
                            count(Outcome::PrefillError, Role::Prefill, "answered 500"),
                        ],
                    ),
                ],
            );
            // A 503 that is not `engine_not_serving` is a failure, retryable.
            let retryable = Reply {
                status: 503,
                head: Head::Prefill,
                retry_after: true,
                body: p503.as_bytes().to_vec(),
            };
            check(
                write(),
                streaming,
                vec![(
                    p_answer(503, p503),
                    vec![
                        Action::CancelDecode,
                        Action::Reply(retryable),
                        count(Outcome::PrefillError, Role::Prefill, "answered 503"),
                    ],
                )],
            );
        }
    }

    #[test]
    fn client_errors_count_as_bad_requests() {
        let p400 = r#"{"error":{"message":"too long","type":"invalid_request_error","param":"prompt","code":"context_length_exceeded"}}"#;
        check(
            write(),
            true,
            vec![(
                p_answer(400, p400),
                vec![
                    Action::CancelDecode,
                    reply(400, Head::Prefill, p400),
                    count(Outcome::BadRequest, Role::Prefill, "answered 400"),
                ],
            )],
        );
        for status in [400, 404, 409, 413, 422] {
            check(
                write(),
                false,
                vec![
                    (p_done(), vec![]),
                    (
                        head(status),
                        vec![Action::DropAtPrefill {
                            code: FailCode::Dropped,
                        }],
                    ),
                    (body("{}"), vec![]),
                    (
                        Event::DecodeEnd,
                        vec![
                            reply(status, Head::Decode, "{}"),
                            count(
                                Outcome::BadRequest,
                                Role::Decode,
                                &format!("answered {status}"),
                            ),
                        ],
                    ),
                ],
            );
        }
        assert!(!is_client_error(503) && !is_client_error(500) && !is_client_error(429));
    }

    #[test]
    fn failed_calls_are_502_and_timeouts_504_naming_request_timeout() {
        for (timed_out, status, code) in [
            (false, 502, "upstream_error"),
            (true, 504, "upstream_timeout"),
        ] {
            let mut plan = RelayPlan::new(write(), false, TID);
            let _ = drain(&mut plan);
            // P's timeout ends the request; P lost is a skip (above), and
            // a failed P call that is not either (an unusable answer) a 502.
            let failure = if timed_out {
                Event::PrefillFailed(failed(true))
            } else {
                p_answer(200, "not json")
            };
            plan.handle(failure);
            let actions = drain(&mut plan);
            assert_eq!(actions[0], Action::CancelDecode);
            let (got, body) = error_reply(&actions);
            assert_eq!(
                (got, body["error"]["code"].as_str()),
                (status, Some(code)),
                "{body}"
            );
            let message = body["error"]["message"].as_str().unwrap();
            let why = if timed_out {
                "connection reset"
            } else {
                "not JSON"
            };
            assert!(
                message.starts_with("prefill server") && message.contains(why),
                "{message}"
            );
            assert_eq!(
                message.contains("raise request_timeout"),
                timed_out,
                "{message}"
            );
            assert!(matches!(
                actions.last(),
                Some(Action::Count {
                    outcome: Outcome::PrefillError,
                    ..
                })
            ));

            let mut plan = RelayPlan::new(write(), true, TID);
            let _ = drain(&mut plan);
            plan.handle(Event::DecodeFailed(failed(timed_out)));
            let actions = drain(&mut plan);
            assert_eq!(
                actions[..2],
                [
                    Action::CancelPrefill,
                    Action::DropAtPrefill {
                        code: FailCode::Dropped
                    }
                ]
            );
            // Lost before the client saw anything: a retryable 503 (the
            // proxy sends the request again); a timeout stays a 504.
            let (got, body) = error_reply(&actions);
            assert_eq!(got, if timed_out { status } else { 503 });
            let retry = actions
                .iter()
                .any(|a| matches!(a, Action::Reply(r) if r.retry_after));
            assert_eq!(retry, !timed_out, "{actions:?}");
            if !timed_out {
                assert_eq!(body["error"]["code"], DECODE_LOST_CODE, "{body}");
            }
            assert!(
                body["error"]["message"]
                    .as_str()
                    .unwrap()
                    .starts_with("decode server"),
                "{body}"
            );
            assert!(matches!(
                actions.last(),
                Some(Action::Count {
                    outcome: Outcome::DecodeError,
                    ..
                })
            ));
        }
    }

    #[test]
    fn an_unusable_prefill_answer_is_a_failure() {
        for body in [
            "not json",
            r#"{"object":"text_completion"}"#,
            r#"{"choices":[{}],"kv_transfer_params":[1]}"#,
        ] {
            let mut plan = RelayPlan::new(Mode::Read, false, TID);
            let _ = drain(&mut plan);
            plan.handle(p_answer(200, body));
            let actions = drain(&mut plan);
            assert_eq!(error_reply(&actions).0, 502, "{body}");
            assert!(
                matches!(
                    actions[..],
                    [
                        Action::Reply(_),
                        Action::Count {
                            outcome: Outcome::PrefillError,
                            ..
                        }
                    ]
                ),
                "{actions:?}"
            );
        }
    }

    #[test]
    fn a_failing_d_drops_the_transfer_at_p_unless_ps_part_is_over() {
        // P still running: cancelled, and its transfer dropped.
        check(
            write(),
            false,
            vec![
                (
                    head(503),
                    vec![
                        Action::CancelPrefill,
                        Action::DropAtPrefill {
                            code: FailCode::Dropped,
                        },
                    ],
                ),
                (body(NOT_SERVING), vec![]),
                (
                    Event::DecodeEnd,
                    vec![
                        reply(503, Head::Decode, NOT_SERVING),
                        count(Outcome::DecodeError, Role::Decode, "answered 503"),
                    ],
                ),
            ],
        );
        // P answered: only dropped; a late P event changes nothing.
        check(
            write(),
            false,
            vec![
                (p_done(), vec![]),
                (
                    head(500),
                    vec![Action::DropAtPrefill {
                        code: FailCode::Dropped,
                    }],
                ),
                (p_done(), vec![]),
            ],
        );
        // D's error body breaks off: a 502 that names D's status.
        let plan = check(
            write(),
            false,
            vec![(
                head(500),
                vec![
                    Action::CancelPrefill,
                    Action::DropAtPrefill {
                        code: FailCode::Dropped,
                    },
                ],
            )],
        );
        let mut plan = plan;
        plan.handle(Event::DecodeFailed(failed(false)));
        let actions = drain(&mut plan);
        let (status, body) = error_reply(&actions);
        assert_eq!(status, 502);
        assert!(
            body["error"]["message"]
                .as_str()
                .unwrap()
                .contains("answered 500, then its body failed"),
            "{body}"
        );
        assert_eq!(actions.len(), 2, "no second drop: {actions:?}");
    }

    #[test]
    fn a_broken_stream_ends_with_an_error_event_never_half_an_event() {
        let plan = check(
            write(),
            true,
            vec![
                (p_done(), vec![]),
                (head(200), vec![Action::StartStream { status: 200 }]),
                (body("data: 1\n\ndata: hal"), vec![stream("data: 1\n\n")]),
            ],
        );
        let mut plan = plan;
        plan.handle(Event::DecodeFailed(failed(false)));
        let actions = drain(&mut plan);
        assert_eq!(
            actions[0],
            Action::DropAtPrefill {
                code: FailCode::Dropped
            }
        );
        let Action::FailStream {
            event,
            broken: false,
        } = &actions[1]
        else {
            panic!("{actions:?}")
        };
        let text = String::from_utf8(event.clone()).unwrap();
        assert!(
            text.starts_with("data: {\"error\":") && text.ends_with("}\n\ndata: [DONE]\n\n"),
            "{text}"
        );
        assert!(!text.contains("hal"), "{text}");
        assert!(text.contains("upstream_error"), "{text}");
        assert_eq!(
            actions[2],
            count(
                Outcome::DecodeError,
                Role::Decode,
                "failed: connection reset"
            )
        );
        assert_eq!(actions.len(), 3);
    }

    /// A streamed request through P and D that may be resumed twice.
    fn resumable() -> RelayPlan {
        let req = json!({"prompt": "hi", "stream": true})
            .as_object()
            .unwrap()
            .clone();
        let plan = RelayPlan::for_request(&req, write(), TID).with_resumes(&req, 2);
        assert!(plan.tracks_token_ids());
        plan
    }

    /// [`resumable`] with P done and D's stream begun.
    fn resumable_streaming() -> RelayPlan {
        drive(
            resumable(),
            first_actions(),
            vec![
                (p_done(), vec![]),
                (head(200), vec![Action::StartStream { status: 200 }]),
            ],
        )
    }

    fn first_actions() -> Vec<Action> {
        vec![
            Action::SendPrefill { params: p_params() },
            Action::SendDecode {
                params: Some(d_params()),
            },
        ]
    }

    #[test]
    fn a_lost_d_is_resumed_with_exactly_the_tokens_whose_text_the_client_has() {
        let mut plan = drive(
            resumable_streaming(),
            vec![],
            vec![
                // Token ids lead each event and are stripped; an event of
                // ids alone (text held back) goes whole.
                (
                    body(
                        ": token_ids [5]\ndata: a\n\n: token_ids [6,7]\n\n: token_ids [8]\ndata: b",
                    ),
                    vec![stream("data: a\n\n")],
                ),
                // D dies halfway through the event of token 8: neither its
                // text nor its token counts.
                (
                    Event::DecodeFailed(failed(false)),
                    vec![
                        Action::DropAtPrefill {
                            code: FailCode::Dropped,
                        },
                        Action::ResumeDecode {
                            token_ids: vec![5, 6, 7],
                        },
                    ],
                ),
                // The new D's head continues the same stream: no new head.
                (head(200), vec![]),
                (
                    body(": token_ids [8]\ndata: b\n\ndata: [DONE]\n\n"),
                    vec![stream("data: b\n\ndata: [DONE]\n\n")],
                ),
                (Event::DecodeEnd, vec![Action::EndStream, ok()]),
            ],
        );
        assert_eq!(plan.outcome(), Some(Outcome::Ok));
        assert_eq!(plan.poll_action(), None);
    }

    #[test]
    fn without_a_prefill_server_d_computes_the_prompt_and_its_stream_can_be_resumed() {
        let r = req(json!({"prompt": "hi", "stream": true}));
        let plan = RelayPlan::without_prefill(&r, TID).with_resumes(&r, 1);
        assert!(plan.tracks_token_ids() && !plan.is_decode_alone());
        drive(
            plan,
            vec![Action::SendDecode { params: None }],
            vec![
                (head(200), vec![Action::StartStream { status: 200 }]),
                (
                    body(": token_ids [3]\ndata: a\n\n"),
                    vec![stream("data: a\n\n")],
                ),
                // No P to drop anything at.
                (
                    Event::DecodeFailed(failed(false)),
                    vec![Action::ResumeDecode { token_ids: vec![3] }],
                ),
            ],
        );
        let logits = req(json!({"prompt": "hi", "stream": true, "prompt_logprobs": 1}));
        assert!(RelayPlan::without_prefill(&logits, TID).is_decode_alone());
    }

    #[test]
    fn a_resumed_d_that_is_lost_too_is_replaced_until_the_bound_then_the_stream_fails() {
        let lost = || Event::DecodeFailed(failed(false));
        let mut plan = drive(
            resumable_streaming(),
            vec![],
            vec![
                (
                    body(": token_ids [5]\ndata: a\n\n"),
                    vec![stream("data: a\n\n")],
                ),
                (
                    lost(),
                    vec![
                        Action::DropAtPrefill {
                            code: FailCode::Dropped,
                        },
                        Action::ResumeDecode { token_ids: vec![5] },
                    ],
                ),
                // Refused connection before any head: resumed again.
                (lost(), vec![Action::ResumeDecode { token_ids: vec![5] }]),
            ],
        );
        plan.handle(lost());
        let actions = drain(&mut plan);
        assert!(
            matches!(&actions[0], Action::FailStream { broken: false, .. }),
            "{actions:?}"
        );
        assert!(matches!(
            &actions[1],
            Action::Count {
                outcome: Outcome::DecodeError,
                ..
            }
        ));
    }

    #[test]
    fn a_resumed_d_answering_an_error_status_ends_the_stream_with_its_error() {
        let mut plan = drive(
            resumable_streaming(),
            vec![],
            vec![
                (
                    Event::DecodeFailed(failed(false)),
                    vec![
                        Action::DropAtPrefill {
                            code: FailCode::Dropped,
                        },
                        Action::ResumeDecode { token_ids: vec![] },
                    ],
                ),
                (head(400), vec![]),
                (body(r#"{"error":{"message":"bad","code":"x"}}"#), vec![]),
            ],
        );
        plan.handle(Event::DecodeEnd);
        let actions = drain(&mut plan);
        let Action::FailStream { event, .. } = &actions[0] else {
            panic!("{actions:?}")
        };
        let text = String::from_utf8(event.clone()).unwrap();
        assert!(
            text.contains("bad") && text.ends_with("data: [DONE]\n\n"),
            "{text}"
        );
        assert_eq!(plan.outcome(), Some(Outcome::BadRequest));
    }

    #[test]
    fn timeouts_and_plans_without_resumes_fail_the_stream_as_before() {
        let mut plan = resumable_streaming();
        plan.handle(Event::DecodeFailed(failed(true)));
        assert!(drain(&mut plan)
            .iter()
            .any(|a| matches!(a, Action::FailStream { .. })));
        let req = |v: Value| v.as_object().unwrap().clone();
        for body in [
            json!({"prompt": "hi", "stream": true, "n": 2}),
            json!({"prompt": "hi", "stream": true, "echo": true}),
            json!({"prompt": "hi", "stream": true, "prompt_logprobs": 1}),
            json!({"prompt": "hi", "stream": false}),
        ] {
            let r = req(body.clone());
            let plan = RelayPlan::for_request(&r, write(), TID).with_resumes(&r, 2);
            assert!(!plan.tracks_token_ids(), "{body}");
        }
    }

    #[test]
    fn token_id_comments_are_stripped_and_collected_in_order() {
        let mut ids = Vec::new();
        let out = strip_token_ids(
            b": token_ids [1,2]\ndata: x\n\n: token_ids [3]\n\n: other\ndata: y\n\n: token_ids [4]\ndata: z",
            &mut ids,
        );
        assert_eq!(ids, vec![1, 2, 3, 4]);
        assert_eq!(out, b"data: x\n\n: other\ndata: y\n\ndata: z");
        let mut ids = Vec::new();
        let garbled = b": token_ids [nope]\ndata: x\n\n";
        assert_eq!(strip_token_ids(garbled, &mut ids), garbled.to_vec());
        assert!(ids.is_empty());
    }

    #[test]
    fn d_finishing_first_stands_and_cancels_p() {
        check(
            write(),
            false,
            vec![
                (head(200), vec![]),
                (body(D_BODY), vec![]),
                (
                    Event::DecodeEnd,
                    vec![
                        Action::CancelPrefill,
                        reply(200, Head::Decode, D_BODY),
                        ok(),
                    ],
                ),
            ],
        );
        // Streaming: D's whole answer goes out, its unterminated trailer too.
        check(
            write(),
            true,
            vec![
                (head(200), vec![]),
                (body("data: 1\n\ndata: [DONE]"), vec![]),
                (
                    Event::DecodeEnd,
                    vec![
                        Action::CancelPrefill,
                        Action::StartStream { status: 200 },
                        stream("data: 1\n\ndata: [DONE]"),
                        Action::EndStream,
                        ok(),
                    ],
                ),
            ],
        );
    }

    #[test]
    fn the_client_leaving_cancels_what_runs_and_counts_once() {
        let cancelled = Action::Count {
            outcome: Outcome::Cancelled,
            cause: None,
        };
        check(
            write(),
            true,
            vec![(
                Event::ClientGone,
                vec![
                    Action::CancelPrefill,
                    Action::CancelDecode,
                    cancelled.clone(),
                ],
            )],
        );
        check(
            Mode::Read,
            false,
            vec![(
                Event::ClientGone,
                vec![Action::CancelPrefill, cancelled.clone()],
            )],
        );
        let mut plan = check(
            write(),
            true,
            vec![
                (p_done(), vec![]),
                (head(200), vec![Action::StartStream { status: 200 }]),
                (Event::ClientGone, vec![Action::CancelDecode, cancelled]),
            ],
        );
        // Finished: every later event is ignored, the count stays one.
        for e in [
            body("data: 1\n\n"),
            Event::DecodeEnd,
            Event::ClientGone,
            p_done(),
            Event::DecodeFailed(failed(true)),
        ] {
            plan.handle(e);
            assert_eq!(drain(&mut plan), vec![]);
        }
        assert_eq!(plan.outcome(), Some(Outcome::Cancelled));
        assert!(plan.is_finished());
    }

    #[test]
    fn events_not_asked_for_are_ignored() {
        // Read mode: D's events before D was asked, a body before its head.
        check(
            Mode::Read,
            false,
            vec![
                (head(200), vec![]),
                (body("x"), vec![]),
                (Event::DecodeEnd, vec![]),
                (Event::DecodeFailed(failed(false)), vec![]),
                (p_done(), vec![Action::SendDecode { params: None }]),
                (body("early"), vec![]),
                (Event::Prefill(PrefillAnswer::Aborted), vec![]),
                (head(200), vec![]),
                (head(500), vec![]),
                (body(D_BODY), vec![]),
                (
                    Event::DecodeEnd,
                    vec![reply(200, Head::Decode, D_BODY), ok()],
                ),
            ],
        );
    }

    #[test]
    fn read_mode_sends_d_exactly_ps_params_once_p_answered() {
        let params = json!({"do_remote_prefill": true, "transfer_id": TID, "remote_block_ids": [4, 5],
                            "remote_registration_generation": 2});
        let answer =
            json!({"choices": [{"finish_reason": "length"}], "kv_transfer_params": params})
                .to_string();
        check(
            Mode::Read,
            true,
            vec![
                (
                    p_answer(200, &answer),
                    vec![Action::SendDecode {
                        params: Some(params.clone()),
                    }],
                ),
                // P answered already: D's status is committed at its head.
                (head(200), vec![Action::StartStream { status: 200 }]),
                (body("data: 1\n\n"), vec![stream("data: 1\n\n")]),
                (Event::DecodeEnd, vec![Action::EndStream, ok()]),
            ],
        );
        // P returned no params: D computes the prompt itself, and that is
        // no skip.
        check(
            Mode::Read,
            false,
            vec![(p_done(), vec![Action::SendDecode { params: None }])],
        );
    }

    #[test]
    fn read_mode_refused_aborted_or_lost_prefill_sends_d_the_body_without_params() {
        for (event, why) in [
            (refused(), OnPurpose::Refused),
            (aborted(), OnPurpose::Aborted),
            (Event::PrefillFailed(failed(false)), OnPurpose::Lost),
        ] {
            let skipped = || {
                vec![
                    Action::PrefillSkipped(why),
                    Action::SendDecode { params: None },
                ]
            };
            check(
                Mode::Read,
                false,
                vec![
                    (event.clone(), skipped()),
                    (head(200), vec![]),
                    (body(D_BODY), vec![]),
                    (
                        Event::DecodeEnd,
                        vec![reply(200, Head::Decode, D_BODY), ok()],
                    ),
                ],
            );
            check(
                Mode::Read,
                true,
                vec![
                    (event.clone(), skipped()),
                    (head(200), vec![Action::StartStream { status: 200 }]),
                    (body("data: 1\n\n"), vec![stream("data: 1\n\n")]),
                    (Event::DecodeEnd, vec![Action::EndStream, ok()]),
                ],
            );
            // D failing then has no transfer at P to drop.
            check(
                Mode::Read,
                false,
                vec![
                    (event, skipped()),
                    (head(500), vec![]),
                    (
                        Event::DecodeEnd,
                        vec![
                            reply(500, Head::Decode, ""),
                            count(Outcome::DecodeError, Role::Decode, "answered 500"),
                        ],
                    ),
                ],
            );
        }
    }

    #[test]
    fn read_mode_prefill_failure_never_asks_d_and_a_failed_d_ends_ps_lease() {
        let p400 = r#"{"error":{"message":"too long","type":"invalid_request_error","param":null,"code":null}}"#;
        check(
            Mode::Read,
            true,
            vec![(
                p_answer(400, p400),
                vec![
                    reply(400, Head::Prefill, p400),
                    count(Outcome::BadRequest, Role::Prefill, "answered 400"),
                ],
            )],
        );
        let params = json!({"do_remote_prefill": true, "transfer_id": TID, "remote_block_ids": [4],
                            "remote_registration_generation": 1});
        let answer =
            json!({"choices": [{"finish_reason": "length"}], "kv_transfer_params": params})
                .to_string();
        let sent = vec![Action::SendDecode {
            params: Some(params),
        }];
        let mut plan = check(Mode::Read, false, vec![(p_answer(200, &answer), sent)]);
        plan.handle(Event::DecodeFailed(failed(false)));
        let actions = drain(&mut plan);
        // D will not read P's leased blocks: the lease ends now.
        assert_eq!(
            actions[0],
            Action::DropAtPrefill {
                code: FailCode::Dropped
            }
        );
        assert_eq!(error_reply(&actions).0, 503, "D lost before it answered");
        assert_eq!(actions.len(), 3);
    }

    #[test]
    fn answers_beyond_the_buffer_bound_fail_the_call() {
        let mut plan = check(
            write(),
            false,
            vec![(p_done(), vec![]), (head(200), vec![])],
        );
        plan.handle(Event::DecodeBody(vec![b'x'; MAX_BUFFERED]));
        assert_eq!(drain(&mut plan), vec![]);
        plan.handle(body("y"));
        let actions = drain(&mut plan);
        assert_eq!(
            actions[0],
            Action::DropAtPrefill {
                code: FailCode::Dropped
            }
        );
        let (status, body) = error_reply(&actions);
        assert_eq!(status, 502);
        assert!(
            body["error"]["message"]
                .as_str()
                .unwrap()
                .contains("more than"),
            "{body}"
        );
        assert_eq!(plan.outcome(), Some(Outcome::DecodeError));
    }

    #[test]
    fn prefill_answers_are_classified() {
        assert_eq!(
            PrefillAnswer::parse(503, NOT_SERVING.as_bytes()),
            PrefillAnswer::Error {
                status: 503,
                code: Some(RETRYABLE_CODE.into()),
                body: NOT_SERVING.as_bytes().to_vec()
            }
        );
        assert_eq!(
            PrefillAnswer::parse(502, b"<html>"),
            PrefillAnswer::Error {
                status: 502,
                code: None,
                body: b"<html>".to_vec()
            }
        );
        assert_eq!(
            PrefillAnswer::parse(200, P_ABORTED.as_bytes()),
            PrefillAnswer::Aborted
        );
        assert_eq!(
            PrefillAnswer::parse(200, P_DONE.as_bytes()),
            PrefillAnswer::Done { params: None }
        );
        let with = json!({"choices": [{"finish_reason": "stop"}], "kv_transfer_params": {"a": 1}})
            .to_string();
        assert_eq!(
            PrefillAnswer::parse(200, with.as_bytes()),
            PrefillAnswer::Done {
                params: Some(json!({"a": 1}))
            }
        );
        assert!(matches!(
            PrefillAnswer::parse(200, b"{}"),
            PrefillAnswer::Malformed { .. }
        ));
    }

    #[test]
    fn the_proxys_errors_have_the_openai_shape() {
        let ours: Value =
            serde_json::from_str(&error_json("m", "server_error", "upstream_error")).unwrap();
        // The same body as the server's `ApiError` (checked against it in
        // `pdkv_server::error`'s tests).
        assert_eq!(
            ours,
            json!({"error": {"message": "m", "type": "server_error", "param": null, "code": "upstream_error"}})
        );
    }

    #[test]
    fn outcomes_index_their_list() {
        for (i, o) in Outcome::ALL.iter().enumerate() {
            assert_eq!(o.index(), i, "{o:?}");
        }
        assert_eq!(
            OnPurpose::ALL.map(OnPurpose::code),
            [
                FailCode::PrefillRefused,
                FailCode::PrefillAborted,
                FailCode::Dropped
            ]
        );
    }

    fn req(v: Value) -> Map<String, Value> {
        v.as_object().cloned().expect("an object")
    }

    /// Runs `steps` on a plan for D alone made from the request `body`,
    /// after checking that its first action sends D the client's params.
    fn check_alone(body: Value, steps: Vec<(Event, Vec<Action>)>) -> RelayPlan {
        let body = req(body);
        let plan = RelayPlan::for_request(&body, write(), TID);
        assert!(plan.is_decode_alone(), "{body:?}");
        let first = vec![Action::SendDecode {
            params: body.get("kv_transfer_params").cloned(),
        }];
        drive(plan, first, steps)
    }

    fn alone_count(outcome: Outcome) -> Action {
        Action::Count {
            outcome,
            cause: None,
        }
    }

    #[test]
    fn only_requests_wanting_their_prompts_logits_go_to_d_alone() {
        for (body, alone) in [
            (json!({"prompt": "x", "prompt_logprobs": 1}), true),
            (json!({"prompt": "x", "prompt_logprobs": 0}), true),
            (json!({"prompt": "x", "echo": true, "logprobs": 2}), true),
            (json!({"prompt": "x", "echo": true, "logprobs": true}), true),
            (json!({"prompt": "x", "prompt_logprobs": null}), false),
            (
                json!({"token_ids": [1], "sampling_params": {"prompt_logprobs": 0}}),
                true,
            ),
            (
                json!({"token_ids": [1], "sampling_params": {"prompt_logprobs": null}}),
                false,
            ),
            (json!({"prompt": "x", "prompt_logprobs": false}), false),
            (json!({"prompt": "x", "echo": true}), false),
            (json!({"prompt": "x", "echo": false, "logprobs": 2}), false),
            (json!({"prompt": "x", "logprobs": 2}), false),
            (
                json!({"prompt": "x", "echo": true, "logprobs": null}),
                false,
            ),
        ] {
            let body = req(body);
            assert_eq!(needs_prompt_logits(&body), alone, "{body:?}");
            let plan = RelayPlan::for_request(&body, write(), TID);
            assert_eq!(plan.is_decode_alone(), alone, "{body:?}");
        }
        // Several prompts in one body: D alone (one transfer, one prompt).
        for (body, batch) in [
            (json!({"prompt": ["a", "b"]}), true),
            (json!({"prompt": [[1, 2], [3]]}), true),
            (json!({"prompt": ["a"]}), false),
            (json!({"prompt": [1, 2, 3]}), false),
        ] {
            let body = req(body);
            assert_eq!(is_prompt_batch(&body), batch, "{body:?}");
            let plan = RelayPlan::for_request(&body, write(), TID);
            assert_eq!(plan.is_decode_alone(), batch, "{body:?}");
        }
        // Any other request goes through P and D, streaming as it says.
        let mut plan =
            RelayPlan::for_request(&req(json!({"prompt": "x", "stream": true})), write(), TID);
        assert!(plan.streaming());
        assert_eq!(
            drain(&mut plan),
            vec![
                Action::SendPrefill { params: p_params() },
                Action::SendDecode {
                    params: Some(d_params())
                }
            ]
        );
        let plan = RelayPlan::for_request(&req(json!({"prompt": "x"})), Mode::Read, TID);
        assert!(!plan.streaming() && !plan.is_decode_alone());
    }

    #[test]
    fn d_alone_gets_the_clients_own_params_and_its_answer_passes_through_uncut() {
        let client_params = json!({"do_remote_prefill": true, "transfer_id": "theirs"});
        let plan = check_alone(
            json!({"prompt": "x", "prompt_logprobs": 1, "stream": true, "kv_transfer_params": client_params}),
            vec![
                (head(200), vec![Action::StartStream { status: 200 }]),
                // Passed on as it comes, not cut at event boundaries.
                (body("data: 1\n\nda"), vec![stream("data: 1\n\nda")]),
                (body("ta: 2\n\n"), vec![stream("ta: 2\n\n")]),
                (
                    Event::DecodeEnd,
                    vec![Action::EndStream, alone_count(Outcome::Ok)],
                ),
            ],
        );
        assert!(plan.streaming());
        assert_eq!(plan.outcome(), Some(Outcome::Ok));
        // Not streamed: D's whole answer passes through the same way.
        check_alone(
            json!({"prompt": "x", "echo": true, "logprobs": 1}),
            vec![
                (p_done(), vec![]),
                (head(200), vec![Action::StartStream { status: 200 }]),
                (body(D_BODY), vec![stream(D_BODY)]),
                (
                    Event::DecodeEnd,
                    vec![Action::EndStream, alone_count(Outcome::Ok)],
                ),
            ],
        );
    }

    #[test]
    fn d_alone_counts_by_its_status_which_passes_through() {
        for (status, outcome) in [
            (200, Outcome::Ok),
            (204, Outcome::Ok),
            (400, Outcome::BadRequest),
            (401, Outcome::BadRequest),
            (429, Outcome::BadRequest),
            (500, Outcome::DecodeError),
            (503, Outcome::DecodeError),
        ] {
            let plan = check_alone(
                json!({"prompt": "x", "prompt_logprobs": 1}),
                vec![
                    (head(status), vec![Action::StartStream { status }]),
                    (body(NOT_SERVING), vec![stream(NOT_SERVING)]),
                    (
                        Event::DecodeEnd,
                        vec![Action::EndStream, alone_count(outcome)],
                    ),
                ],
            );
            assert_eq!(plan.outcome(), Some(outcome), "{status}");
        }
    }

    #[test]
    fn d_alone_failing_before_its_head_is_a_502_and_after_it_ends_the_body_broken() {
        for timed_out in [false, true] {
            let mut plan = RelayPlan::for_request(
                &req(json!({"prompt": "x", "prompt_logprobs": 1})),
                Mode::Read,
                TID,
            );
            let _ = drain(&mut plan);
            plan.handle(Event::DecodeFailed(failed(timed_out)));
            let actions = drain(&mut plan);
            let (status, v) = error_reply(&actions);
            assert_eq!(status, 502, "timed out: {timed_out}");
            assert_eq!(v["error"]["code"], "upstream_error");
            assert_eq!(v["error"]["type"], "server_error");
            assert_eq!(
                v["error"]["message"],
                "decode server failed: connection reset"
            );
            assert_eq!(actions.len(), 2, "{actions:?}");
            assert_eq!(actions[1], alone_count(Outcome::DecodeError));
        }
        check_alone(
            json!({"prompt": "x", "prompt_logprobs": 1}),
            vec![
                (head(200), vec![Action::StartStream { status: 200 }]),
                (body("{\"choi"), vec![stream("{\"choi")]),
                (
                    Event::DecodeFailed(failed(true)),
                    vec![
                        Action::FailStream {
                            event: Vec::new(),
                            broken: true,
                        },
                        alone_count(Outcome::Ok),
                    ],
                ),
                (Event::DecodeEnd, vec![]),
            ],
        );
    }

    #[test]
    fn d_alone_client_leaving_cancels_d_and_counts_once() {
        let plan = check_alone(
            json!({"prompt": "x", "prompt_logprobs": 1}),
            vec![
                // P is never asked: its answers are ignored.
                (refused(), vec![]),
                (Event::PrefillFailed(failed(false)), vec![]),
                (
                    Event::ClientGone,
                    vec![Action::CancelDecode, alone_count(Outcome::Cancelled)],
                ),
                (head(200), vec![]),
                (Event::ClientGone, vec![]),
            ],
        );
        assert_eq!(plan.outcome(), Some(Outcome::Cancelled));
        // Once D's status went out, the request counts by it.
        check_alone(
            json!({"prompt": "x", "prompt_logprobs": 1}),
            vec![
                (head(404), vec![Action::StartStream { status: 404 }]),
                (
                    Event::ClientGone,
                    vec![Action::CancelDecode, alone_count(Outcome::BadRequest)],
                ),
            ],
        );
    }

    #[test]
    fn the_mode_follows_the_prefill_servers_info() {
        assert_eq!(
            Mode::for_prefill(Some("write"), Some("p0"), Some("127.0.0.1:7000")),
            write()
        );
        assert_eq!(
            Mode::for_prefill(None, None, None),
            Mode::Write {
                remote_engine_id: None,
                remote_bootstrap_addr: None
            }
        );
        assert_eq!(
            Mode::for_prefill(Some("read"), Some("p0"), Some("127.0.0.1:7000")),
            Mode::Read
        );
    }

    #[test]
    fn events_are_cut_at_boundaries() {
        assert_eq!(complete_events_len(b"data: {\"a\""), 0);
        assert_eq!(complete_events_len(b"data: 1\n\ndata: 2"), 9);
        assert_eq!(complete_events_len(b"data: 1\n\ndata: 2\n\n"), 18);
        assert_eq!(complete_events_len(b""), 0);
    }
}
