//! The simulated deployment: a proxy, P and D engines, clients, operators
//! driving lifecycle operations, and the network between them, on one
//! virtual clock and one seed.
//!
//! Everything that decides runs for real: every engine's
//! [`pdkv_engine::EngineCore`] (scheduler, lifecycle machine, core logic)
//! and P/D connector core (send and receive machines), and one
//! [`RelayPlan`](crate::plan::RelayPlan) per client request. The
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
//!
//! The world is a composition of rooms, each in its own module: the shared
//! clock, queue and random source ([`crate::ctx`]), the engines
//! ([`crate::cluster`]), the network and its faults ([`crate::net`]), KV
//! reads and writes ([`crate::kv`]), the proxy ([`crate::proxy`]), the
//! clients' load ([`crate::workload`]), the operators
//! ([`crate::operator`]) and the checks over all of them
//! ([`crate::checker`]). This module owns them and runs the event loop.

use std::time::Duration;

use pdkv_connector::pd::core::Io;
use pdkv_connector::wire::{write_failure, FailCode, Failure};
use pdkv_engine::RequestOutput;

use crate::checker::{self, View};
use crate::cluster::Cluster;
use crate::ctx::{Ctx, Ev, Ix, Timed};
use crate::kv::Transfers;
use crate::net::Net;
use crate::operator::Operators;
use crate::plan::Event;
use crate::proxy::{Proxy, Through};
use crate::workload::Workload;
use crate::{Options, Report};

pub struct World {
    ctx: Ctx,
    cluster: Cluster,
    net: Net,
    kv: Transfers,
    proxy: Proxy,
    workload: Workload,
    ops: Operators,
    heal_rounds: u32,
}

impl World {
    pub fn new(opts: Options) -> anyhow::Result<World> {
        let faults = opts.faults;
        let mut ctx = Ctx::new(opts);
        let workload = Workload::new(&mut ctx);
        let cluster = Cluster::new(&mut ctx)?;
        let ops = Operators::new(cluster.len());
        ctx.at(Duration::from_millis(1), Ev::ClientArrives);
        if ctx.opts.lifecycle {
            ops.start(&mut ctx);
        }
        let heal = ctx.opts.safety;
        ctx.at(heal, Ev::Heal);
        let mut net = Net::new(faults);
        if net.faults {
            net.plan_faults(&mut ctx);
        }
        Ok(World {
            ctx,
            cluster,
            net,
            kv: Transfers::default(),
            proxy: Proxy::default(),
            workload,
            ops,
            heal_rounds: 0,
        })
    }

    /// What the run saw.
    pub fn into_report(self) -> Report {
        self.ctx.report
    }

    // ---- the run ----

    pub fn run(&mut self) -> anyhow::Result<()> {
        let end = self.ctx.t0 + self.ctx.opts.safety + self.ctx.opts.liveness;
        while let Some(t) = self.ctx.pop() {
            if t.at > end {
                break;
            }
            self.ctx.clock.set(t.at);
            self.ctx.report.events += 1;
            self.trace(&t);
            self.handle(t.ev);
            if !self.ctx.report.violations.is_empty() {
                return Ok(());
            }
            if self.ctx.healed && checker::quiescent(&self.view()) {
                // An operator's heal script can fail a step (a weight update
                // that timed out on transfers): heal again, as an operator
                // would, until every engine serves the cluster's weights.
                let probes_sent = !self.workload.probes.is_empty();
                if !probes_sent
                    && !self.cluster.weights_agree(self.ops.cluster_weights)
                    && self.heal_rounds < 5
                {
                    self.heal_rounds += 1;
                    self.heal();
                    continue;
                }
                if !probes_sent {
                    let mut w = through(&mut self.ctx, &mut self.net, &mut self.cluster);
                    self.workload.send_probes(&mut self.proxy, &mut w);
                    continue;
                }
                break;
            }
        }
        self.ctx.report.simulated = self.ctx.now() - self.ctx.t0;
        checker::final_checks(&mut self.ctx, &checker::view_of!(self));
        Ok(())
    }

    fn view(&self) -> View<'_> {
        checker::view_of!(self)
    }

    /// Folds the event (its time, its place in the schedule, its kind)
    /// into the run's trace hash: two runs of a seed must agree on it.
    fn trace(&mut self, t: &Timed) {
        use std::hash::{Hash, Hasher};
        let mut h = std::collections::hash_map::DefaultHasher::new();
        self.ctx.report.trace.hash(&mut h);
        (t.at - self.ctx.t0).hash(&mut h);
        t.seq.hash(&mut h);
        std::mem::discriminant(&t.ev).hash(&mut h);
        self.ctx.report.trace = h.finish();
    }

    /// Hands an event to the room it is for; the node it touched, if any,
    /// then runs [`World::after`].
    fn handle(&mut self, ev: Ev) {
        let (ctx, net, cluster, kv) = (
            &mut self.ctx,
            &mut self.net,
            &mut self.cluster,
            &mut self.kv,
        );
        let touched = match ev {
            Ev::Tick(ix) => cluster.tick(ctx, ix),
            Ev::ConnTimer(ix) => cluster.conn_timer(ctx, ix),
            Ev::CtrlRequest { conn, msg } => net.ctrl_request(ctx, cluster, conn, msg),
            Ev::CtrlFrame { conn, msg, last } => net.ctrl_frame(cluster, conn, msg, last),
            Ev::CtrlDeadline { conn } => {
                net.ctrl_fail(cluster, conn, FailCode::Timeout, "no answer in time")
            }
            Ev::CtrlBreak { conn } => net.ctrl_break(cluster, conn),
            Ev::WriteFrame {
                write,
                part,
                copy,
                bytes,
            } => {
                kv.write_frame(ctx, net, cluster, write, part, copy, bytes);
                None
            }
            Ev::WriteAck { write, part, ok } => kv.write_ack(cluster, write, part, ok),
            Ev::WriteDeadline { write } => kv.write_end(
                cluster,
                write,
                Err(write_failure(false, "the write's deadline passed")),
            ),
            Ev::ReadReq { read, part, copy } => {
                kv.read_req(ctx, net, cluster, read, part, copy);
                None
            }
            Ev::ReadResp {
                read,
                part,
                copy,
                bytes,
            } => kv.read_resp(ctx, cluster, read, part, copy, bytes),
            Ev::ReadDeadline { read } => kv.read_end(
                cluster,
                read,
                Err(Failure::new(
                    FailCode::Timeout,
                    "the read's deadline passed",
                )),
            ),
            Ev::Fenced { node, inc, load } => cluster.fenced(node, inc, load),
            ev => return self.handle_proxy_or_operator(ev),
        };
        if let Some(ix) = touched {
            self.after(ix);
        }
    }

    /// The events of the proxy, the clients, the operators and the faults.
    fn handle_proxy_or_operator(&mut self, ev: Ev) {
        let mut w = through(&mut self.ctx, &mut self.net, &mut self.cluster);
        let touched = match ev {
            Ev::Call { call } => self.proxy.call_arrives(&mut w, call),
            Ev::CallCancel { call } => self.proxy.call_cancel(w.cluster, call),
            Ev::Proxy { client, event } => {
                self.proxy.event(&mut w, client, event);
                None
            }
            Ev::ClientArrives => {
                self.workload.client_arrives(&mut self.proxy, &mut w);
                None
            }
            Ev::ClientLeaves { client } => {
                self.proxy.event(&mut w, client, Event::ClientGone);
                None
            }
            Ev::Operator(ix) => {
                let faults = w.net.faults;
                self.ops.operate(w.ctx, w.cluster, &self.proxy, faults, ix)
            }
            Ev::Crash(ix) => {
                self.crash(ix);
                None
            }
            Ev::CrashMidStream(ix) => {
                self.proxy.arm_crash(ix);
                None
            }
            Ev::Restart(ix) => {
                let cw = self.ops.cluster_weights;
                self.cluster.restart(&mut self.ctx, ix, cw);
                None
            }
            Ev::Partition { a, b, until } => {
                self.net.partition(a, b, until);
                None
            }
            Ev::Heal => {
                self.heal();
                None
            }
            ev => unreachable!("{ev:?} is an engine's or the network's"),
        };
        if let Some(ix) = touched {
            self.after(ix);
        }
    }

    /// After anything touched a node: its outputs, its connector's I/O,
    /// its operator's answer, its timers, and the checks that hold at
    /// every moment.
    fn after(&mut self, ix: Ix) {
        let Some(n) = self.cluster.node(ix) else {
            return;
        };
        let outputs: Vec<(String, RequestOutput)> = std::mem::take(&mut *n.outputs.lock().unwrap());
        let ios: Vec<Io> = std::mem::take(&mut *n.io.lock().unwrap())
            .into_iter()
            .collect();
        for (id, out) in outputs {
            let mut w = through(&mut self.ctx, &mut self.net, &mut self.cluster);
            self.proxy.output(&mut w, ix, &id, out);
        }
        for io in ios {
            self.io(ix, io);
        }
        self.ops.answer(&mut self.ctx, &mut self.cluster, ix);
        self.cluster.schedule(&mut self.ctx, ix);
        checker::check_node(&mut self.ctx, &self.cluster, ix);
    }

    /// Carries out the I/O a node's connector asked for.
    fn io(&mut self, ix: Ix, io: Io) {
        let (ctx, net, cluster, kv) = (&mut self.ctx, &mut self.net, &self.cluster, &mut self.kv);
        let touched = match io {
            Io::Reply { conn, msg, last } => {
                net.reply(ctx, conn, msg, last);
                None
            }
            Io::Send(io) => {
                net.send(ctx, cluster, ix, io);
                None
            }
            Io::Write(io) => kv.start_write(ctx, net, cluster, ix, io),
            Io::Read(io) => kv.start_read(ctx, net, cluster, ix, io),
            Io::CancelRead { load } => kv.cancel_read(cluster, ix, load),
            Io::Fence { load, ranks } => {
                kv.fence(ctx, net, cluster, ix, load, ranks);
                None
            }
        };
        if let Some(ix) = touched {
            self.after(ix);
        }
    }

    // ---- faults ----

    /// An engine crashes: its requests are gone (the proxy's calls to it
    /// break), and it restarts a little later.
    fn crash(&mut self, ix: Ix) {
        if self.ctx.healed || self.cluster.node(ix).is_none() {
            return;
        }
        self.ctx.report.crashes += 1;
        // Its requests are gone: the proxy's calls to it break.
        let lost = self.proxy.crashed(&self.cluster, ix);
        let inc = self.cluster.inc(ix);
        self.net.crashed(&mut self.ctx, ix, inc);
        self.cluster.crash(ix);
        self.ops.crashed(ix);
        for (client, side) in lost {
            let mut w = through(&mut self.ctx, &mut self.net, &mut self.cluster);
            self.proxy
                .call_failed(&mut w, client, side, "the engine crashed");
        }
        let back = Duration::from_millis(self.ctx.rng.range(200, 5000));
        self.ctx.at(back, Ev::Restart(ix));
    }

    /// The liveness phase: faults stop, no new clients or operations; every
    /// engine is brought back to serving (one weights version).
    fn heal(&mut self) {
        self.ctx.healed = true;
        self.net.heal();
        let w = self.ops.cluster_weights;
        for ix in 0..self.cluster.len() {
            if self.cluster.node(ix).is_none() {
                self.cluster.restart(&mut self.ctx, ix, w);
            }
            self.ops.heal(&mut self.ctx, &self.cluster, ix);
        }
    }
}

fn through<'a>(ctx: &'a mut Ctx, net: &'a mut Net, cluster: &'a mut Cluster) -> Through<'a> {
    Through { ctx, net, cluster }
}
