//! The cluster's engines: one slot per engine process (P first, then D),
//! each holding the live [`Node`] of its current incarnation, when its
//! core and connector run next, and how long its steps compute.
//!
//! A crash empties a slot and counts a new incarnation: events meant for
//! an older one find [`Cluster::live`] empty and are dropped.

use std::collections::BTreeSet;
use std::time::{Duration, Instant};

use pdkv_connector::recv::LoadId;

use crate::ctx::{Ctx, Ev, Ix};
use crate::node::{Node, NodeSpec};

/// The fixed cost of one engine step, on top of its tokens.
const STEP_COST: Duration = Duration::from_millis(2);
/// How soon a core the connector woke looks again.
const IDLE_COST: Duration = Duration::from_micros(100);

pub struct Slot {
    pub node: Option<Node>,
    /// Counts restarts; events for an older incarnation are dropped.
    pub inc: u64,
    pub spec_name: String,
    pub addr: String,
    pub transfer_addr: String,
    kv_config: String,
    /// Weight reloads (and restarts, and sleeps that dropped the weights):
    /// a request that saw one is not held to the reference answer.
    pub reloads: u64,
    /// Scheduled connector timer times (deduplicated).
    timers: BTreeSet<Instant>,
    pub tick_at: Option<Instant>,
    /// Compute time per token of this engine's steps.
    per_token: Duration,
    /// The engine computes its last step until then.
    pub busy_until: Option<Instant>,
    /// Tensor-parallel ranks of the engine.
    tp: usize,
}

/// Every engine of the deployment, by [`Ix`].
pub struct Cluster {
    pub slots: Vec<Slot>,
}

impl Cluster {
    /// A prefill engine (`p0`) and a decode engine (`d1`), each on the
    /// number of ranks the options name.
    pub fn new(ctx: &mut Ctx) -> anyhow::Result<Cluster> {
        let mut c = Cluster { slots: Vec::new() };
        for (i, is_p) in [true, false].into_iter().enumerate() {
            c.add_slot(ctx, i, is_p)?;
        }
        Ok(c)
    }

    fn add_slot(&mut self, ctx: &mut Ctx, i: usize, is_p: bool) -> anyhow::Result<()> {
        let (role, name) = if is_p {
            ("kv_producer", format!("p{i}"))
        } else {
            ("kv_consumer", format!("d{i}"))
        };

        let mode = if ctx.opts.read_mode { "read" } else { "write" };
        let kv_config = format!(
            r#"{{"kv_connector":"pdkv","kv_role":"{role}","transfer_mode":"{mode}","abort_timeout_s":30,"load_timeout_s":40,"arrival_timeout_s":10,"prefill_timeout_s":120,"heartbeat_s":2,"num_workers":2,"kv_load_failure_policy":"{}"}}"#,
            ctx.opts.policy
        );
        let mut slot = Slot {
            node: None,
            inc: 0,
            spec_name: name,
            addr: format!("127.0.0.{}:7000", i + 1),
            transfer_addr: format!("127.0.0.{}:7001", i + 1),
            kv_config,
            reloads: 0,
            timers: BTreeSet::new(),
            tick_at: None,
            per_token: Duration::from_micros(20),
            busy_until: None,
            tp: if is_p { ctx.opts.p_tp } else { ctx.opts.d_tp },
        };
        if is_p && ctx.opts.slow_prefill {
            // A prefill engine slow enough that a long prompt outlasts every
            // transfer timeout (as a 7,000-token prompt does on a CPU).
            slot.per_token = Duration::from_millis(ctx.rng.range(30, 120));
        }
        slot.node = Some(build_node(ctx, &slot, 1)?);
        self.slots.push(slot);
        Ok(())
    }

    pub fn len(&self) -> usize {
        self.slots.len()
    }

    /// The node at `ix` if it is still incarnation `inc`.
    pub fn live(&self, ix: Ix, inc: u64) -> Option<&Node> {
        let s = &self.slots[ix];
        if s.inc != inc {
            return None;
        }
        s.node.as_ref()
    }

    pub fn node(&self, ix: Ix) -> Option<&Node> {
        self.slots[ix].node.as_ref()
    }

    pub fn node_mut(&mut self, ix: Ix) -> Option<&mut Node> {
        self.slots[ix].node.as_mut()
    }

    /// The engines that are up.
    pub fn nodes(&self) -> impl Iterator<Item = &Node> {
        self.slots.iter().filter_map(|s| s.node.as_ref())
    }

    pub fn inc(&self, ix: Ix) -> u64 {
        self.slots[ix].inc
    }

    /// The engine listening at `addr` (control or transfer address).
    pub fn by_addr(&self, addr: &str) -> Option<Ix> {
        self.slots
            .iter()
            .position(|s| s.addr == addr || s.transfer_addr == addr)
    }

    /// The core runs a turn; returns the node touched.
    pub fn tick(&mut self, ctx: &Ctx, ix: Ix) -> Option<Ix> {
        if self.slots[ix].tick_at.is_some_and(|t| t <= ctx.now()) {
            self.slots[ix].tick_at = None;
        }
        let n = self.node_mut(ix)?;
        n.take_woken();
        n.core.tick();
        n.core.scheduler().check_invariants();
        Some(ix)
    }

    /// The connector looks at its deadlines (none may stay pending past
    /// its time); returns the node touched.
    pub fn conn_timer(&mut self, ctx: &mut Ctx, ix: Ix) -> Option<Ix> {
        let now = ctx.now();
        self.slots[ix].timers.retain(|&t| t > now);
        let n = self.node(ix)?;
        n.conn.event(|c, now| c.handle_timeout(now));
        let next = n.conn.inspect(|c| c.poll_timeout());
        if next.is_some_and(|t| t <= now) {
            let what = format!(
                "{}: a connector deadline at or before now is still pending after its timeout ran",
                n.name
            );
            ctx.violation(what);
        }
        Some(ix)
    }

    /// D's fence of a load's grants took effect; returns the node touched.
    pub fn fenced(&self, node: Ix, inc: u64, load: LoadId) -> Option<Ix> {
        let n = self.live(node, inc)?;
        n.conn.event(|c, now| c.on_fenced(now, load, Ok(())));
        Some(node)
    }

    /// When the node's core and connector run next: a step as soon as its
    /// last one has computed, a look when the connector woke the core, the
    /// core's and the connector's own deadlines.
    pub fn schedule(&mut self, ctx: &mut Ctx, ix: Ix) {
        let Some(n) = self.node(ix) else { return };
        let woke = n.woke.load(std::sync::atomic::Ordering::Acquire);
        let runnable = n.core.has_runnable_work();
        let deadline = n.core.next_deadline();
        let timer = n.conn.inspect(|c| c.poll_timeout());
        let now = ctx.now();
        let tokens = std::mem::take(&mut n.oracle.lock().unwrap().last_step_tokens);
        let slot = &mut self.slots[ix];
        if tokens > 0 {
            slot.busy_until = Some(now + STEP_COST + slot.per_token * tokens as u32);
        }
        let busy = slot.busy_until.filter(|&b| b > now);
        let tick = if runnable {
            Some(busy.unwrap_or(now + STEP_COST))
        } else if woke {
            Some(now + IDLE_COST)
        } else {
            deadline.map(|d| d.max(now))
        };
        if let Some(t) = tick {
            if slot.tick_at.is_none_or(|at| at > t) {
                slot.tick_at = Some(t);
                ctx.at_instant(t, Ev::Tick(ix));
            }
        }
        if let Some(t) = timer {
            let t = t.max(now);
            if slot.timers.insert(t) {
                ctx.at_instant(t, Ev::ConnTimer(ix));
            }
        }
    }

    /// The engine at `ix` is gone, with everything it held; what was
    /// scheduled for it finds a newer incarnation.
    pub fn crash(&mut self, ix: Ix) {
        let slot = &mut self.slots[ix];
        slot.node = None;
        slot.inc += 1;
        slot.timers.clear();
        slot.tick_at = None;
    }

    /// A crashed engine starts again on weights `w` (and its operator
    /// with it, in the safety phase).
    pub fn restart(&mut self, ctx: &mut Ctx, ix: Ix, w: u64) {
        if self.slots[ix].node.is_some() {
            return;
        }
        match build_node(ctx, &self.slots[ix], w) {
            Ok(n) => {
                self.slots[ix].node = Some(n);
                self.slots[ix].reloads += 1;
                if !ctx.healed && ctx.opts.lifecycle {
                    ctx.at(Duration::from_millis(100), Ev::Operator(ix));
                }
            }
            Err(e) => ctx.violation(format!("restarting node {ix} failed: {e:#}")),
        }
    }

    /// Every live engine serves weights `w`, and holds them: a level-2
    /// sleep the operator called before the heal can end after the heal's
    /// script was written, discarding the weights it had found in place.
    pub fn weights_agree(&self, w: u64) -> bool {
        self.nodes()
            .all(|n| n.weights == w && !n.core.lifecycle_status().weights_discarded)
    }

    /// The live engines' successful KV loads.
    pub fn live_loads_ok(&self) -> u64 {
        self.nodes()
            .map(|n| n.conn.inspect(|c| c.counters().loads_ok))
            .sum()
    }
}

/// A new incarnation of the engine `slot` describes, on weights `weights`.
fn build_node(ctx: &mut Ctx, slot: &Slot, weights: u64) -> anyhow::Result<Node> {
    let spec = NodeSpec {
        name: &slot.spec_name,
        addr: slot.addr.clone(),
        transfer_addr: slot.transfer_addr.clone(),
        kv_config: &slot.kv_config,
        weights,
        key_seed: ctx.rng.next_u64(),
        tp: slot.tp,
    };
    Node::build(spec, ctx.clock.clone())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::Options;

    fn cluster(seed: u64) -> (Ctx, Cluster) {
        let mut ctx = Ctx::new(Options::for_seed(seed));
        let c = Cluster::new(&mut ctx).expect("built");
        (ctx, c)
    }

    #[test]
    fn a_prefill_and_a_decode_engine_on_their_ranks_and_addresses() {
        let (ctx, c) = cluster(5);
        assert_eq!(c.len(), 2);
        let names: Vec<&str> = c.nodes().map(|n| n.name.as_str()).collect();
        assert_eq!(names, ["p0", "d1"]);
        assert_eq!(c.node(0).unwrap().tp, ctx.opts.p_tp);
        assert_eq!(c.node(1).unwrap().tp, ctx.opts.d_tp);
        assert_eq!(c.by_addr("127.0.0.1:7000"), Some(0));
        assert_eq!(c.by_addr("127.0.0.2:7001"), Some(1));
        assert_eq!(c.by_addr("127.0.0.9:7000"), None);
        assert!(c.weights_agree(1) && !c.weights_agree(2));
    }

    #[test]
    fn an_idle_engine_schedules_nothing() {
        let (mut ctx, mut c) = cluster(5);
        assert_eq!(c.tick(&ctx, 0), Some(0));
        c.schedule(&mut ctx, 0);
        c.schedule(&mut ctx, 1);
        let events: Vec<String> = std::iter::from_fn(|| ctx.pop())
            .map(|t| format!("{:?}", t.ev))
            .filter(|e| e.starts_with("Tick"))
            .collect();
        assert_eq!(events, Vec::<String>::new());
    }

    #[test]
    fn a_crash_ends_the_incarnation_and_a_restart_begins_the_next() {
        let (mut ctx, mut c) = cluster(5);
        assert!(c.live(1, 0).is_some());
        c.crash(1);
        assert!(c.live(1, 0).is_none() && c.node(1).is_none());
        assert_eq!(c.inc(1), 1);
        assert_eq!((c.tick(&ctx, 1), c.conn_timer(&mut ctx, 1)), (None, None));
        c.restart(&mut ctx, 1, 3);
        let n = c.live(1, 1).expect("restarted");
        assert_eq!((n.weights, c.slots[1].reloads), (3, 1));
        assert!(!c.weights_agree(1) && !c.weights_agree(3));
        // Its operator starts again with it.
        let ev = ctx.pop().expect("an operator event");
        assert_eq!(format!("{:?}", ev.ev), "Operator(1)");
    }

    #[test]
    fn the_same_seed_builds_the_same_cluster() {
        let keys = |seed| {
            let (mut ctx, _) = cluster(seed);
            (ctx.rng.next_u64(), ctx.opts.p_tp, ctx.opts.d_tp)
        };
        assert_eq!(keys(9), keys(9));
        assert_ne!(keys(9).0, keys(10).0);
    }
}
