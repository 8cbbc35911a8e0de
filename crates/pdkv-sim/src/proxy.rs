//! The proxy: one real [`RelayPlan`] per client request, driven as the
//! production proxy drives it. Its actions become HTTP calls to P and D
//! (engine requests added to their cores), cancellations and drops at P;
//! the engines' answers come back to the plan as its events. A D answer
//! computed on one weights version throughout must equal a colocated
//! engine's.

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
}

/// The proxy's clients and its calls to the engines.
#[derive(Default)]
pub struct Proxy {
    clients: BTreeMap<u64, Client>,
    calls: BTreeMap<u64, Call>,
}

/// The parts of the world the proxy acts through.
pub struct Through<'a> {
    pub ctx: &'a mut Ctx,
    pub net: &'a mut Net,
    pub cluster: &'a mut Cluster,
}

impl Proxy {
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
        let plan = RelayPlan::new(mode, false, &transfer_id);
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
                    let n = self.clients[&client].max_tokens as u32;
                    let call = self.new_call(w, client, Side::D, n, None, token_ids);
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
                Action::StartStream { .. }
                | Action::Stream(_)
                | Action::EndStream
                | Action::FailStream { .. } => {}
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
        let status = c.status;
        *ctx.report.outcomes.entry(outcome.as_str()).or_default() += 1;
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
            },
        );
        let d = w.net.delay(w.ctx);
        w.ctx.at(d, Ev::Call { call });
        call
    }

    /// An HTTP call reaches its engine, which takes the request or
    /// refuses it; returns the node touched.
    pub fn call_arrives(&mut self, w: &mut Through, call_id: u64) -> Option<Ix> {
        let call = &self.calls[&call_id];
        let (node, inc, client, side) = (call.node, call.inc, call.client, call.side);
        let req = call.req.clone();
        let Some(n) = w.cluster.live(node, inc) else {
            self.call_failed(w, client, side, "the engine is down");
            return None;
        };
        n.oracle.lock().unwrap().start(&req.id, &req.prompt_tokens);
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
            }
            Err(e) => {
                if let Some(n) = w.cluster.node(node) {
                    n.oracle.lock().unwrap().forget(&req.id);
                }
                refused(w, client, side, &e);
            }
        }
        Some(node)
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
    pub fn crashed(&mut self, ix: Ix) -> Vec<(u64, Side)> {
        self.calls
            .values_mut()
            .filter(|c| c.node == ix && c.live)
            .map(|c| {
                c.live = false;
                (c.client, c.side)
            })
            .collect()
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
            request_id: id.into(),
            token_ids: tokens,
            text: String::new(),
            finish_reason: Some(FinishReason::Length),
            num_prompt_tokens: 20,
            num_cached_tokens: 0,
            logits: Vec::new(),
            logprobs: Vec::new(),
            prompt_logprobs: None,
            kv_transfer_params: None,
            error: None,
            timed_out: false,
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
        assert_eq!(r.proxy.crashed(0), [(client, Side::P)]);
        assert!(r.proxy.crashed(0).is_empty());
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
