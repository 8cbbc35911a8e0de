//! The proxy: one real [`RelayPlan`] per client request, driven as the
//! production proxy drives it. Its actions become HTTP calls to P and D
//! (engine requests added to their cores), cancellations and drops at P;
//! the engines' answers come back to the plan as its events. A D answer
//! computed on one weights version throughout must equal a colocated
//! engine's.
//!
//! Every other client streams: its D calls answer as the server does when
//! the proxy asks for token ids (a head at D's first output, then per
//! output an event whose comment names its tokens, `[DONE]` at the end),
//! so a D that crashes mid-stream is resumed by the plan on D once it
//! serves again. A resumed stream that ends whole must carry, as the
//! client read it, exactly a colocated engine's tokens.

use std::collections::BTreeMap;
use std::sync::Arc;

use pdkv_connector::wire::FailCode;
use pdkv_engine::{
    AddRequestError, Command, EngineRequest, FinishReason, RequestOutput, SamplingParams,
};
use serde_json::json;

use crate::cluster::Cluster;
use crate::ctx::{Ctx, Ev, Ix};
use crate::model::reference;
use crate::net::Net;
use crate::plan::{Action, CallError, Event, Mode, Outcome, PrefillAnswer, RelayPlan};
use crate::RETRYABLE_CODE;
use pdkv_relay::TOKEN_IDS_COMMENT;

/// Resumes of one stream at most, as the proxy's default.
const MAX_RESUMES: u32 = 3;
/// How long a resumed call waits for a D that serves, as the proxy's default.
const RESUME_WAIT: std::time::Duration = std::time::Duration::from_secs(30);
/// How often a waiting resumed call looks again.
const RESUME_POLL: std::time::Duration = std::time::Duration::from_millis(250);

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Side {
    P,
    D,
}

/// One HTTP call of the proxy to an engine.
pub struct Call {
    client: u64,
    side: Side,
    node: Ix,
    inc: u64,
    id: String,
    req: EngineRequest,
    /// The engine accepted it and has not ended it.
    live: bool,
    finals: u32,
    tokens: Vec<u32>,
    /// The node's weights when it started (for the reference check).
    weights: u64,
    reloads: u64,
    /// D streams its answer (a streaming client's call).
    stream: bool,
    head_sent: bool,
    /// A resumed call: it waits until then for a D that serves.
    resume_until: Option<std::time::Instant>,
    /// When the last piece of a streamed answer reaches the proxy: one
    /// connection's pieces arrive in order.
    delivered: Option<std::time::Instant>,
}

/// One client request and what the proxy answered it.
pub struct Client {
    prompt: Vec<u32>,
    max_tokens: usize,
    plan: RelayPlan,
    p: Ix,
    d: Ix,
    p_call: Option<u64>,
    d_call: Option<u64>,
    pub status: Option<u16>,
    pub body: Vec<u8>,
    pub outcome: Option<Outcome>,
    gone: bool,
    streaming: bool,
    /// The stream ended with an error event.
    stream_failed: bool,
    resumed: u32,
    /// The weights of the D calls so far, and whether they differed or one
    /// of them saw its engine reload weights meanwhile: the reference check
    /// of a resumed stream needs one version throughout.
    d_weights: Option<u64>,
    mixed: bool,
}

/// The proxy's clients and its calls to the engines.
#[derive(Default)]
pub struct Proxy {
    clients: BTreeMap<u64, Client>,
    calls: BTreeMap<u64, Call>,
    /// The engine that crashes at its next output of a stream in progress.
    armed_crash: Option<Ix>,
}

/// The parts of the world the proxy acts through.
pub struct Through<'a> {
    pub ctx: &'a mut Ctx,
    pub net: &'a mut Net,
    pub cluster: &'a mut Cluster,
}

impl Proxy {
    /// The engine at `ix` crashes at its next output of a stream in
    /// progress.
    pub fn arm_crash(&mut self, ix: Ix) {
        self.armed_crash = Some(ix);
    }

    /// A client's plan and calls, for a violation's message.
    pub fn describe(&self, id: u64) -> String {
        let calls: Vec<String> = self
            .calls
            .values()
            .filter(|c| c.client == id)
            .map(|c| {
                format!(
                    "{} {:?} node {} live {} finals {} tokens {:?} resume {:?}",
                    c.id, c.side, c.node, c.live, c.finals, c.tokens, c.req.resume_token_ids
                )
            })
            .collect();
        format!("{:?}; calls {calls:?}", self.clients[&id].plan)
    }

    pub fn client(&self, id: u64) -> &Client {
        &self.clients[&id]
    }

    /// The clients whose request has not ended, in order.
    pub fn open_clients(&self) -> Vec<u64> {
        self.clients
            .iter()
            .filter(|(_, c)| c.outcome.is_none())
            .map(|(&k, _)| k)
            .collect()
    }

    /// Every client request has ended (and was counted).
    pub fn all_ended(&self) -> bool {
        self.clients.values().all(|c| c.outcome.is_some())
    }

    /// A client request through the proxy; returns the client's id.
    pub fn new_client(&mut self, w: &mut Through, prompt: Vec<u32>, max_tokens: usize) -> u64 {
        let client = w.ctx.id();
        w.ctx.report.clients += 1;
        let transfer_id = format!("t{client}");
        let mode = if w.ctx.opts.read_mode {
            Mode::Read
        } else {
            Mode::Write {
                remote_engine_id: Some(w.cluster.slots[0].spec_name.clone()),
                remote_bootstrap_addr: Some(w.cluster.slots[0].addr.clone()),
            }
        };
        // Every other client streams, and may be resumed.
        let streaming = client.is_multiple_of(2);
        let req = json!({"stream": streaming});
        let plan = RelayPlan::new(mode, streaming, &transfer_id)
            .with_resumes(req.as_object().expect("an object"), MAX_RESUMES);
        self.clients.insert(
            client,
            Client {
                prompt,
                max_tokens,
                plan,
                p: 0,
                d: 1,
                p_call: None,
                d_call: None,
                status: None,
                body: Vec::new(),
                outcome: None,
                gone: false,
                streaming,
                stream_failed: false,
                resumed: 0,
                d_weights: None,
                mixed: false,
            },
        );
        self.drive_plan(w, client);
        client
    }

    /// An event for a client's plan arrives at the proxy.
    pub fn event(&mut self, w: &mut Through, client: u64, event: Event) {
        let Some(c) = self.clients.get_mut(&client) else {
            return;
        };
        if let Event::ClientGone = event {
            c.gone = true;
        }
        c.plan.handle(event);
        self.drive_plan(w, client);
    }

    /// Carries out what a client's plan decided.
    fn drive_plan(&mut self, w: &mut Through, client: u64) {
        loop {
            let Some(c) = self.clients.get_mut(&client) else {
                return;
            };
            let Some(a) = c.plan.poll_action() else {
                return;
            };
            match a {
                Action::SendPrefill { params } => {
                    let call = self.new_call(w, client, Side::P, 1, Some(params), Vec::new());
                    self.clients.get_mut(&client).expect("live").p_call = Some(call);
                }
                Action::SendDecode { params } => {
                    let n = self.clients[&client].max_tokens as u32;
                    let call = self.new_call(w, client, Side::D, n, params, Vec::new());
                    self.clients.get_mut(&client).expect("live").d_call = Some(call);
                }
                Action::ResumeDecode { token_ids } => {
                    w.ctx.report.resumed += 1;
                    let c = self.clients.get_mut(&client).expect("live");
                    c.resumed += 1;
                    let n = c.max_tokens as u32;
                    let call = self.new_call(w, client, Side::D, n, None, token_ids);
                    let until = w.ctx.now() + RESUME_WAIT;
                    self.calls.get_mut(&call).expect("new").resume_until = Some(until);
                    self.clients.get_mut(&client).expect("live").d_call = Some(call);
                }
                Action::CancelPrefill => {
                    if let Some(call) = self.clients[&client].p_call {
                        let d = w.net.delay(w.ctx);
                        w.ctx.at(d, Ev::CallCancel { call });
                    }
                }
                Action::CancelDecode => {
                    if let Some(call) = self.clients[&client].d_call {
                        let d = w.net.delay(w.ctx);
                        w.ctx.at(d, Ev::CallCancel { call });
                    }
                }
                Action::DropAtPrefill { code } => self.drop_at_prefill(w, client, code),
                Action::PrefillSkipped(_) => w.ctx.report.prefill_skipped += 1,
                Action::Reply(r) => {
                    let c = self.clients.get_mut(&client).expect("live");
                    c.status = Some(r.status);
                    c.body = r.body;
                }
                Action::StartStream { status } => {
                    self.clients.get_mut(&client).expect("live").status = Some(status);
                }
                Action::Stream(b) => {
                    let c = self.clients.get_mut(&client).expect("live");
                    c.body.extend(b);
                }
                Action::FailStream { event, .. } => {
                    let c = self.clients.get_mut(&client).expect("live");
                    c.body.extend(event);
                    c.stream_failed = true;
                }
                Action::EndStream => {}
                Action::Count { outcome, .. } => self.count(w.ctx, client, outcome),
            }
        }
    }

    fn drop_at_prefill(&mut self, w: &mut Through, client: u64, code: FailCode) {
        let p = self.clients[&client].p;
        w.net
            .proxy_drop(w.ctx, w.cluster, p, &format!("t{client}"), code);
    }

    /// The plan counts the client's outcome: once, and a server-side
    /// failure other than a retryable refusal is a loss.
    fn count(&mut self, ctx: &mut Ctx, client: u64, outcome: Outcome) {
        let c = self.clients.get_mut(&client).expect("live");
        if c.outcome.is_some() {
            ctx.violation(format!("client {client} counted twice"));
            return;
        }
        c.outcome = Some(outcome);
        // A stream that ended with an error event failed on the server side.
        let status = if c.stream_failed { Some(502) } else { c.status };
        *ctx.report.outcomes.entry(outcome.as_str()).or_default() += 1;
        if outcome == Outcome::Ok && c.streaming && c.resumed > 0 {
            check_resumed(ctx, client, c);
        }
        // Lost: the client's request failed on the server side, other than
        // a retryable refusal (an engine not serving answers 503).
        if let Some(s) = status {
            if s >= 500 && s != 503 {
                ctx.report.lost += 1;
                if ctx.report.losses.len() < 5 {
                    let body = String::from_utf8_lossy(&self.clients[&client].body)
                        .chars()
                        .take(300)
                        .collect::<String>();
                    ctx.report
                        .losses
                        .push(format!("client {client}: {s} {body}"));
                }
            }
        }
    }

    fn new_call(
        &mut self,
        w: &mut Through,
        client: u64,
        side: Side,
        max_tokens: u32,
        kv: Option<serde_json::Value>,
        resume_token_ids: Vec<u32>,
    ) -> u64 {
        let call = w.ctx.id();
        let c = &self.clients[&client];
        let node = if side == Side::P { c.p } else { c.d };
        let id = format!(
            "c{client}-{}-{call}",
            if side == Side::P { "p" } else { "d" }
        );
        let params = SamplingParams {
            temperature: 0.0,
            max_tokens,
            ignore_eos: true,
            ..SamplingParams::default()
        };
        let stream = side == Side::D && c.streaming;
        let req = EngineRequest {
            cache_salt: None,
            resume_token_ids,
            id: id.clone(),
            prompt_tokens: c.prompt.clone(),
            params,
            kv_transfer_params: kv,
        };
        let inc = w.cluster.inc(node);
        let (weights, reloads) = (
            w.cluster.node(node).map_or(0, |n| n.weights),
            w.cluster.slots[node].reloads,
        );
        self.calls.insert(
            call,
            Call {
                client,
                side,
                node,
                inc,
                id,
                req,
                live: false,
                finals: 0,
                tokens: Vec::new(),
                weights,
                reloads,
                stream,
                head_sent: false,
                resume_until: None,
                delivered: None,
            },
        );
        let d = w.net.delay(w.ctx);
        w.ctx.at(d, Ev::Call { call });
        call
    }

    /// An HTTP call reaches its engine, which takes the request or
    /// refuses it; returns the node touched.
    pub fn call_arrives(&mut self, w: &mut Through, call_id: u64) -> Option<Ix> {
        let call = self.calls.get_mut(&call_id).expect("known");
        if call.resume_until.is_some() {
            // A resumed call goes to D as it is now (restarted or not).
            call.inc = w.cluster.inc(call.node);
        }
        let call = &self.calls[&call_id];
        let (node, inc, client, side) = (call.node, call.inc, call.client, call.side);
        let req = call.req.clone();
        let Some(n) = w.cluster.live(node, inc) else {
            if !self.wait_to_resume(w, call_id) {
                self.call_failed(w, client, side, "the engine is down");
            }
            return None;
        };
        let mut known = req.prompt_tokens.clone();
        known.extend_from_slice(&req.resume_token_ids);
        n.oracle.lock().unwrap().start(&req.id, &known);
        let out = n.outputs.clone();
        let id = req.id.clone();
        let sink = Box::new(move |o: RequestOutput| {
            out.lock().unwrap().push((id.clone(), o));
            true
        });
        let n = w.cluster.node_mut(node).expect("live");
        let (weights, seed) = (n.weights, 7);
        match n.core.add(req.clone(), seed, sink) {
            Ok(()) => {
                let c = self.calls.get_mut(&call_id).expect("known");
                c.live = true;
                c.weights = weights;
                if side == Side::D {
                    let cl = self.clients.get_mut(&client).expect("live");
                    cl.mixed |= cl.d_weights.is_some_and(|w| w != weights);
                    cl.d_weights = Some(weights);
                }
            }
            Err(e) => {
                if let Some(n) = w.cluster.node(node) {
                    n.oracle.lock().unwrap().forget(&req.id);
                }
                // A resumed call waits for a D that serves, as the server
                // holds a request without KV params until `/resume`.
                let waits =
                    matches!(e, AddRequestError::Unavailable(_)) && self.wait_to_resume(w, call_id);
                if !waits {
                    refused(w, client, side, &e);
                }
            }
        }
        Some(node)
    }

    /// A resumed call whose D does not serve yet looks again a little later,
    /// until its wait is over; whether it waits.
    fn wait_to_resume(&mut self, w: &mut Through, call_id: u64) -> bool {
        match self.calls[&call_id].resume_until {
            Some(until) if w.ctx.now() + RESUME_POLL <= until => {
                w.ctx.at(RESUME_POLL, Ev::Call { call: call_id });
                true
            }
            _ => false,
        }
    }

    /// The call failed without an answer (its engine is down or crashed).
    pub fn call_failed(&mut self, w: &mut Through, client: u64, side: Side, why: &str) {
        let e = CallError {
            timed_out: false,
            detail: why.to_string(),
        };
        let event = if side == Side::P {
            Event::PrefillFailed(e)
        } else {
            Event::DecodeFailed(e)
        };
        let d = w.net.delay(w.ctx);
        w.ctx.at(d, Ev::Proxy { client, event });
    }

    /// The proxy's connection for a call closes: the engine aborts the
    /// request. Returns the node touched.
    pub fn call_cancel(&mut self, cluster: &mut Cluster, call_id: u64) -> Option<Ix> {
        let call = &self.calls[&call_id];
        if !call.live {
            return None;
        }
        let (node, inc, id) = (call.node, call.inc, call.id.clone());
        cluster.live(node, inc)?;
        let n = cluster.node_mut(node).expect("live");
        n.core.apply(Command::Abort {
            id: Arc::from(id.as_str()),
            serial: None,
        });
        Some(node)
    }

    /// The engine at `ix` crashed: its calls end, and the proxy learns
    /// it for each.
    pub fn crashed(&mut self, cluster: &Cluster, ix: Ix) -> Vec<(u64, Side)> {
        let reloads = cluster.slots[ix].reloads;
        let mut lost = Vec::new();
        for c in self.calls.values_mut().filter(|c| c.node == ix && c.live) {
            c.live = false;
            if c.reloads != reloads {
                if let Some(cl) = self.clients.get_mut(&c.client) {
                    cl.mixed = true;
                }
            }
            lost.push((c.client, c.side));
        }
        lost
    }

    /// Ids of up to `n` requests live on the engine at `ix`.
    pub fn live_calls(&self, ix: Ix, inc: u64, n: usize) -> Vec<String> {
        self.calls
            .values()
            .filter(|c| c.node == ix && c.inc == inc && c.live)
            .map(|c| c.id.clone())
            .take(n)
            .collect()
    }

    /// An output of the engine at `ix` for request `id`: the oracle learns
    /// its tokens, the call collects them, and its last output answers the
    /// plan (P's answer, or D's head, body and end).
    pub fn output(&mut self, w: &mut Through, ix: Ix, id: &str, out: RequestOutput) {
        let Some(n) = w.cluster.node(ix) else { return };
        n.oracle.lock().unwrap().extend(id, &out.token_ids);
        let inc = w.cluster.inc(ix);
        let found = self
            .calls
            .iter()
            .find(|(_, c)| c.node == ix && c.inc == inc && c.id == id)
            .map(|(&k, _)| k);
        let Some(call_id) = found else { return };
        let call = self.calls.get_mut(&call_id).expect("found");
        if call.finals > 0 {
            let what = format!("request {id} on node {ix} produced output after its last one");
            w.ctx.violation(what);
            return;
        }
        call.tokens.extend_from_slice(&out.token_ids);
        if call.stream {
            return self.stream_output(w, ix, call_id, out);
        }
        let Some(reason) = out.finish_reason else {
            return;
        };
        call.finals += 1;
        call.live = false;
        let (client, side) = (call.client, call.side);
        if let Some(n) = w.cluster.node(ix) {
            n.oracle.lock().unwrap().forget(id);
        }
        let events = match side {
            Side::P => vec![Event::Prefill(match reason {
                FinishReason::Abort => PrefillAnswer::Aborted,
                FinishReason::Error => PrefillAnswer::Error {
                    status: 500,
                    code: Some("kv_transfer_failed".into()),
                    body: out.error.clone().unwrap_or_default().into_bytes(),
                },
                _ => PrefillAnswer::Done {
                    params: out.kv_transfer_params.clone(),
                },
            })],
            Side::D => {
                self.check_reference(w.ctx, w.cluster, call_id, reason);
                let call = &self.calls[&call_id];
                let status = if reason == FinishReason::Error {
                    500
                } else {
                    200
                };
                let body = json!({"tokens": call.tokens, "finish_reason": reason.as_str(), "error": out.error}).to_string();
                vec![
                    Event::DecodeHead { status },
                    Event::DecodeBody(body.into_bytes()),
                    Event::DecodeEnd,
                ]
            }
        };
        let d = w.net.delay(w.ctx);
        for e in events {
            w.ctx.at(d, Ev::Proxy { client, event: e });
        }
    }

    /// A streaming D call's output as the server streams it to a proxy
    /// that asked for token ids: the head at the first output, an event per
    /// output led by its tokens' comment, `[DONE]` (or an error event) and
    /// the end at the last.
    fn stream_output(&mut self, w: &mut Through, ix: Ix, call_id: u64, out: RequestOutput) {
        let call = self.calls.get_mut(&call_id).expect("found");
        let error = out.finish_reason == Some(FinishReason::Error);
        let mut events = Vec::new();
        let first = !call.head_sent;
        call.head_sent = true;
        if first {
            let status = if error { 500 } else { 200 };
            events.push(Event::DecodeHead { status });
        }
        if !out.token_ids.is_empty() {
            let ids = json!(out.token_ids);
            let event = format!("{TOKEN_IDS_COMMENT}{ids}\ndata: {{\"tokens\":{ids}}}\n\n");
            events.push(Event::DecodeBody(event.into_bytes()));
        }
        let client = call.client;
        if out.finish_reason.is_none() && self.armed_crash == Some(ix) {
            // It dies right after this piece left.
            self.armed_crash = None;
            w.ctx.at(std::time::Duration::ZERO, Ev::Crash(ix));
        }
        let call = self.calls.get_mut(&call_id).expect("found");
        if let Some(reason) = out.finish_reason {
            call.finals += 1;
            call.live = false;
            if let Some(n) = w.cluster.node(ix) {
                n.oracle.lock().unwrap().forget(&call.id);
            }
            if !error {
                self.check_reference(w.ctx, w.cluster, call_id, reason);
            }
            let err = json!({"error": {"message": out.error, "code": "kv_transfer_failed"}});
            let tail = match (error, first) {
                (true, true) => err.to_string(),
                (true, false) => format!("data: {err}\n\ndata: [DONE]\n\n"),
                (false, _) => "data: [DONE]\n\n".to_string(),
            };
            events.push(Event::DecodeBody(tail.into_bytes()));
            events.push(Event::DecodeEnd);
        }
        // In order behind the pieces before (a connection's bytes arrive in
        // the order they were sent).
        let at = w.ctx.now() + w.net.delay(w.ctx);
        let call = self.calls.get_mut(&call_id).expect("found");
        let at = call.delivered.map_or(at, |last| at.max(last));
        call.delivered = Some(at);
        for e in events {
            w.ctx.at_instant(at, Ev::Proxy { client, event: e });
        }
    }

    /// A D request that ran on one weights version from start to end must
    /// answer what a colocated engine answers.
    fn check_reference(
        &self,
        ctx: &mut Ctx,
        cluster: &Cluster,
        call_id: u64,
        reason: FinishReason,
    ) {
        let call = &self.calls[&call_id];
        if !matches!(reason, FinishReason::Length)
            || cluster.slots[call.node].reloads != call.reloads
        {
            return;
        }
        if !call.req.resume_token_ids.is_empty() {
            // A resumed call is checked as the client read the stream.
            return;
        }
        let client = &self.clients[&call.client];
        let want = reference(&client.prompt, client.max_tokens, call.weights);
        if call.tokens != want {
            let what = format!(
                "client {}: D answered {:?}, a colocated engine with weights {} answers {:?}",
                call.client, call.tokens, call.weights, want
            );
            ctx.violation(what);
        } else {
            ctx.report.checked_outputs += 1;
        }
    }
}

/// A resumed stream that ended: no token-id comment reached the client,
/// and, when it ended whole on one weights version throughout, its tokens
/// as the client read them are a colocated engine's.
fn check_resumed(ctx: &mut Ctx, client: u64, c: &Client) {
    let text = String::from_utf8_lossy(&c.body);
    let mut got: Vec<u32> = Vec::new();
    for event in text.split("\n\n") {
        if event.lines().any(|l| l.starts_with(':')) {
            ctx.violation(format!(
                "client {client}'s stream carries a comment: {event:?}"
            ));
            return;
        }
        let Some(data) = event.strip_prefix("data: ") else {
            continue;
        };
        if let Ok(v) = serde_json::from_str::<serde_json::Value>(data) {
            if let Some(t) = v.get("tokens").and_then(|t| t.as_array()) {
                got.extend(t.iter().filter_map(|t| t.as_u64()).map(|t| t as u32));
            }
        }
    }
    if got.len() != c.max_tokens {
        // Ended early: a lifecycle operation aborted it.
        return;
    }
    // Tokens computed on other weights than the first (an engine restarted
    // on newer ones) are checked for their number only.
    let Some(weights) = c.d_weights.filter(|_| !c.mixed) else {
        return;
    };
    let want = reference(&c.prompt, c.max_tokens, weights);
    if got != want {
        ctx.violation(format!(
            "client {client}: its resumed stream read {got:?}, a colocated engine with weights {weights} answers {want:?}"
        ));
    } else {
        ctx.report.checked_resumed += 1;
    }
}

/// The engine refused the call: the proxy gets its HTTP error.
fn refused(w: &mut Through, client: u64, side: Side, e: &AddRequestError) {
    let (status, code) = match e {
        AddRequestError::Unavailable(_) => (503, Some(RETRYABLE_CODE.to_string())),
        AddRequestError::Stopped => (503, None),
        AddRequestError::DuplicateId(_) => (409, None),
        _ => (400, None),
    };
    let body = json!({"error": {"message": e.to_string(), "code": code}})
        .to_string()
        .into_bytes();
    let events = match side {
        Side::P => vec![Event::Prefill(PrefillAnswer::Error { status, code, body })],
        Side::D => vec![
            Event::DecodeHead { status },
            Event::DecodeBody(body),
            Event::DecodeEnd,
        ],
    };
    let d = w.net.delay(w.ctx);
    for e in events {
        w.ctx.at(d, Ev::Proxy { client, event: e });
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::Options;

    struct Rooms {
        ctx: Ctx,
        net: Net,
        cluster: Cluster,
        proxy: Proxy,
    }

    impl Rooms {
        fn new() -> Rooms {
            let mut opts = Options::for_seed(0);
            opts.read_mode = false;
            let mut ctx = Ctx::new(opts);
            let cluster = Cluster::new(&mut ctx).expect("built");
            while ctx.pop().is_some() {}
            Rooms {
                ctx,
                net: Net::new(false),
                cluster,
                proxy: Proxy::default(),
            }
        }

        /// The proxy, and the rooms it acts through.
        fn split(&mut self) -> (&mut Proxy, Through<'_>) {
            let w = Through {
                ctx: &mut self.ctx,
                net: &mut self.net,
                cluster: &mut self.cluster,
            };
            (&mut self.proxy, w)
        }

        /// The events scheduled since the last look, in order.
        fn events(&mut self) -> Vec<Ev> {
            std::iter::from_fn(|| self.ctx.pop())
                .map(|t| t.ev)
                .collect()
        }

        /// A client whose prefill call has reached P (in write mode the
        /// plan calls D at once too); returns (client, P's call).
        fn client_at_p(&mut self) -> (u64, u64) {
            let (proxy, mut w) = self.split();
            let client = proxy.new_client(&mut w, (1..=20).collect(), 2);
            let evs = self.events();
            let c = &self.proxy.clients[&client];
            let (p, d) = (c.p_call.expect("sent to P"), c.d_call.expect("sent to D"));
            let mut calls: Vec<u64> = evs
                .iter()
                .map(|e| match e {
                    Ev::Call { call } => *call,
                    e => panic!("only calls: {e:?}"),
                })
                .collect();
            calls.sort();
            assert_eq!(calls, [p, d]);
            let (proxy, mut w) = self.split();
            assert_eq!(proxy.call_arrives(&mut w, p), Some(0));
            (client, p)
        }
    }

    fn last_output(id: &str, tokens: Vec<u32>) -> RequestOutput {
        RequestOutput {
            token_ids: tokens,
            finish_reason: Some(FinishReason::Length),
            ..RequestOutput::empty(id.into(), 20)
        }
    }

    #[test]
    fn a_client_request_starts_with_its_prefill_at_p() {
        let mut r = Rooms::new();
        let (client, call) = r.client_at_p();
        let ids = r.proxy.live_calls(0, 0, 3);
        assert_eq!(ids, [format!("c{client}-p-{call}")]);
        assert!(r.proxy.live_calls(1, 0, 3).is_empty());
        assert_eq!(r.proxy.open_clients(), [client]);
        assert!(!r.proxy.all_ended());
        assert_eq!(r.ctx.report.clients, 1);
    }

    #[test]
    fn a_request_that_ends_twice_is_a_violation() {
        let mut r = Rooms::new();
        let (client, call) = r.client_at_p();
        let id = format!("c{client}-p-{call}");
        let (proxy, mut w) = r.split();
        proxy.output(&mut w, 0, &id, last_output(&id, vec![5]));
        assert!(r.ctx.report.violations.is_empty());
        // P's answer goes to the plan.
        let evs = r.events();
        assert!(
            matches!(evs[..], [Ev::Proxy { client: c, event: Event::Prefill(PrefillAnswer::Done { .. }) }] if c == client),
            "{evs:?}"
        );
        assert!(r.proxy.live_calls(0, 0, 3).is_empty());
        let (proxy, mut w) = r.split();
        proxy.output(&mut w, 0, &id, last_output(&id, vec![6]));
        let v = &r.ctx.report.violations;
        assert_eq!(v.len(), 1);
        assert!(
            v[0].ends_with(&format!(
                "request {id} on node 0 produced output after its last one"
            )),
            "{v:?}"
        );
    }

    #[test]
    fn a_client_counted_twice_is_a_violation_and_a_server_error_a_loss() {
        let mut r = Rooms::new();
        let (client, _) = r.client_at_p();
        r.proxy.clients.get_mut(&client).unwrap().status = Some(500);
        r.proxy.count(&mut r.ctx, client, Outcome::PrefillError);
        assert_eq!((r.ctx.report.lost, r.ctx.report.losses.len()), (1, 1));
        assert!(r.proxy.all_ended() && r.ctx.report.violations.is_empty());
        r.proxy.count(&mut r.ctx, client, Outcome::Ok);
        let v = &r.ctx.report.violations;
        assert!(v.len() == 1 && v[0].ends_with(&format!("client {client} counted twice")));
        assert_eq!(r.ctx.report.outcomes.values().sum::<u64>(), 1);
    }

    #[test]
    fn calls_to_a_crashed_engine_fail() {
        let mut r = Rooms::new();
        let (client, _) = r.client_at_p();
        assert_eq!(r.proxy.crashed(&r.cluster, 0), [(client, Side::P)]);
        assert!(r.proxy.crashed(&r.cluster, 0).is_empty());
        r.cluster.crash(0);
        let (proxy, mut w) = r.split();
        let again = proxy.new_call(&mut w, client, Side::P, 1, None, Vec::new());
        r.events();
        let (proxy, mut w) = r.split();
        assert_eq!(proxy.call_arrives(&mut w, again), None);
        let evs = r.events();
        assert!(
            matches!(
                evs[..],
                [Ev::Proxy {
                    event: Event::PrefillFailed(_),
                    ..
                }]
            ),
            "{evs:?}"
        );
    }
}
