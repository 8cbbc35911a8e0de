//! The network between the proxy and the engines, and its faults: delays
//! (with, when faults are on, rare spikes past every deadline), partitions
//! between two engines, KV frames lost, duplicated or held up, control
//! connections that break, and the fault plan of a run (partitions, a
//! crash). Control exchanges (one TCP connection each in production) are
//! kept here from the request to the last frame of the answer.

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use pdkv_connector::pd::core::{Op, SendIo};
use pdkv_connector::recv::LoadId;
use pdkv_connector::wire::{FailCode, Failure, Message};

use crate::cluster::Cluster;
use crate::ctx::{Ctx, Ev, Ix};

/// A control exchange (one TCP connection in production).
#[derive(Debug)]
pub struct Conn {
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

impl Conn {
    fn new(from: Option<(Ix, u64, Op)>, to: Ix, to_inc: u64, is_pull: bool) -> Conn {
        Conn {
            from,
            to,
            to_inc,
            done: false,
            is_pull,
            finals: 0,
            broken: false,
        }
    }
}

pub struct Net {
    /// Faults are injected (until the heal).
    pub faults: bool,
    partitions: Vec<(Ix, Ix, Instant)>,
    conns: BTreeMap<u64, Conn>,
    /// (node, grant key) → load, from the pulls D sent.
    grants: BTreeMap<(Ix, u64), LoadId>,
}

impl Net {
    pub fn new(faults: bool) -> Net {
        Net {
            faults,
            partitions: Vec::new(),
            conns: BTreeMap::new(),
            grants: BTreeMap::new(),
        }
    }

    /// A network delay: usually a few hundred microseconds, with faults
    /// on sometimes a spike (a frame that arrives long after its deadline).
    pub fn delay(&mut self, ctx: &mut Ctx) -> Duration {
        let base = Duration::from_micros(ctx.rng.range(100, 2000));
        if self.faults && ctx.rng.chance(0.005) {
            return base + Duration::from_millis(ctx.rng.range(1000, 60_000));
        }
        base
    }

    /// The delay between two nodes, past any partition between them.
    pub fn link_delay(&mut self, ctx: &mut Ctx, a: Ix, b: Ix) -> Duration {
        let now = ctx.now();
        let mut d = self.delay(ctx);
        for &(x, y, until) in &self.partitions {
            if (x, y) == (a, b) || (x, y) == (b, a) {
                d = d.max(until.saturating_duration_since(now) + Duration::from_millis(1));
            }
        }
        d
    }

    /// With faults on, one KV message in a hundred is lost.
    pub fn lost(&mut self, ctx: &mut Ctx) -> bool {
        self.faults && ctx.rng.chance(0.01)
    }

    /// When a KV frame from `a` reaches `b`, in the order its arrivals are
    /// scheduled: none (lost), one, or two (duplicated); with faults on,
    /// now and then held up past every deadline.
    pub fn kv_frame_arrivals(&mut self, ctx: &mut Ctx, a: Ix, b: Ix) -> Vec<Duration> {
        if self.lost(ctx) {
            return Vec::new();
        }
        let mut d = self.link_delay(ctx, a, b);
        if self.faults && ctx.rng.chance(0.02) {
            // A frame held up in the network past every deadline.
            d += Duration::from_millis(ctx.rng.range(20_000, 90_000));
        }
        let mut arrivals = Vec::with_capacity(2);
        if self.faults && ctx.rng.chance(0.01) {
            arrivals.push(d + self.delay(ctx));
        }
        arrivals.push(d);
        arrivals
    }

    /// The faults of a run: up to two partitions between P and D, and on
    /// some seeds a crash of one engine, somewhere in the safety phase.
    pub fn plan_faults(&mut self, ctx: &mut Ctx) {
        let safety = ctx.opts.safety;
        let n = ctx.rng.range(0, 3);
        for _ in 0..n {
            let at = Duration::from_millis(ctx.rng.below(safety.as_millis() as u64));
            let len = Duration::from_millis(ctx.rng.range(500, 30_000));
            let until = ctx.t0 + at + len;
            ctx.at(at, Ev::Partition { a: 0, b: 1, until });
        }
        if ctx.opts.crashes && ctx.rng.chance(0.5) {
            let ix = ctx.rng.below(2) as usize;
            let at = Duration::from_millis(ctx.rng.below(safety.as_millis() as u64));
            ctx.at(at, Ev::Crash(ix));
        }
        if ctx.opts.crashes {
            // D also dies in the middle of a stream, at a time drawn from a
            // source of its own (the run's stream stays as it was).
            let mut own = crate::rng::Rng::new(ctx.opts.seed ^ 0x6d69_6473_7472_6561);
            let at = Duration::from_millis(own.below(safety.as_millis() as u64));
            ctx.at(at, Ev::CrashMidStream(1));
        }
    }

    pub fn partition(&mut self, a: Ix, b: Ix, until: Instant) {
        self.partitions.push((a, b, until));
    }

    /// Faults stop: no more spikes, losses or partitions.
    pub fn heal(&mut self) {
        self.faults = false;
        self.partitions.clear();
    }

    /// Node `ix` (D, or the proxy's side of it) opens a control exchange.
    #[allow(clippy::too_many_arguments)]
    pub fn send(&mut self, ctx: &mut Ctx, cluster: &Cluster, ix: Ix, io: SendIo) {
        let SendIo {
            op,
            addr,
            msg,
            deadline,
        } = io;
        let addr = addr.as_str();
        let inc = cluster.inc(ix);
        let Some(to) = cluster.by_addr(addr) else {
            let f = Failure::new(FailCode::PeerLost, format!("no engine at {addr}"));
            if let Some(n) = cluster.node(ix) {
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
        let conn = ctx.id();
        let to_inc = cluster.inc(to);
        self.conns
            .insert(conn, Conn::new(Some((ix, inc, op)), to, to_inc, is_pull));
        let d = self.link_delay(ctx, ix, to);
        ctx.at(d, Ev::CtrlRequest { conn, msg });
        ctx.at_instant(deadline, Ev::CtrlDeadline { conn });
        if self.faults && ctx.rng.chance(0.01) {
            let t = Duration::from_millis(ctx.rng.range(1, 5000));
            ctx.at(t, Ev::CtrlBreak { conn });
        }
    }

    /// The proxy tells P to drop a transfer; the answer is not waited for.
    pub fn proxy_drop(
        &mut self,
        ctx: &mut Ctx,
        cluster: &Cluster,
        p: Ix,
        transfer_id: &str,
        code: FailCode,
    ) {
        let conn = ctx.id();
        let to_inc = cluster.inc(p);
        self.conns.insert(conn, Conn::new(None, p, to_inc, false));
        let msg = Message::Drop {
            transfer_id: transfer_id.to_string(),
            code,
        };
        let d = self.delay(ctx);
        ctx.at(d, Ev::CtrlRequest { conn, msg });
        if self.faults && ctx.rng.chance(0.05) {
            // A proxy that sends its drop twice.
            let conn2 = ctx.id();
            self.conns.insert(conn2, Conn::new(None, p, to_inc, false));
            let msg = Message::Drop {
                transfer_id: transfer_id.to_string(),
                code,
            };
            let d = self.delay(ctx);
            ctx.at(d, Ev::CtrlRequest { conn: conn2, msg });
        }
    }

    /// A control request reaches its server; returns the node touched.
    pub fn ctrl_request(
        &mut self,
        ctx: &mut Ctx,
        cluster: &Cluster,
        conn: u64,
        msg: Message,
    ) -> Option<Ix> {
        let c = self.conns.get_mut(&conn)?;
        let (to, to_inc) = (c.to, c.to_inc);
        if c.done {
            return None;
        }
        let Some(n) = cluster.live(to, to_inc) else {
            // Nobody there: the opener learns the connection broke.
            if c.from.is_none() {
                c.done = true;
            }
            ctx.at(Duration::from_micros(200), Ev::CtrlBreak { conn });
            return None;
        };
        n.conn.event(|c, now| c.on_control(now, conn, msg));
        Some(to)
    }

    /// The serving node answers on `conn`.
    pub fn reply(&mut self, ctx: &mut Ctx, conn: u64, msg: Message, last: bool) {
        let Some(c) = self.conns.get_mut(&conn) else {
            return;
        };
        if last {
            c.finals += 1;
            if c.finals > 1 && c.is_pull {
                let what = format!("pull on connection {conn} answered {} times", c.finals);
                ctx.violation(what);
                return;
            }
        }
        let (to, from) = (c.to, c.from.as_ref().map(|f| f.0));
        let Some(from) = from else {
            // The proxy's drop: answered, nobody waits for it.
            c.done |= last;
            return;
        };
        let d = self.link_delay(ctx, to, from);
        ctx.at(d, Ev::CtrlFrame { conn, msg, last });
    }

    /// A frame of the answer reaches the opener; returns the node touched.
    pub fn ctrl_frame(
        &mut self,
        cluster: &Cluster,
        conn: u64,
        msg: Message,
        last: bool,
    ) -> Option<Ix> {
        let c = self.conns.get_mut(&conn)?;
        if c.done {
            return None;
        }
        if last {
            c.done = true;
        }
        let (ix, inc, op) = c.from.clone()?;
        let n = cluster.live(ix, inc)?;
        n.conn.event(|c, now| c.on_reply(now, op, msg));
        Some(ix)
    }

    /// `conn` breaks (both ends learn it); returns the node touched.
    pub fn ctrl_break(&mut self, cluster: &Cluster, conn: u64) -> Option<Ix> {
        if let Some(c) = self.conns.get_mut(&conn) {
            c.broken |= !c.done;
        }
        self.ctrl_fail(cluster, conn, FailCode::PeerLost, "the connection broke")
    }

    /// The exchange ends without its answer; returns the node touched.
    pub fn ctrl_fail(
        &mut self,
        cluster: &Cluster,
        conn: u64,
        code: FailCode,
        what: &str,
    ) -> Option<Ix> {
        let c = self.conns.get_mut(&conn)?;
        if c.done {
            return None;
        }
        c.done = true;
        let (ix, inc, op) = c.from.clone()?;
        let n = cluster.live(ix, inc)?;
        let f = Failure::new(code, format!("exchange {conn}: {what}"));
        n.conn
            .event(|c, now| c.on_exchange_failed(now, op, f, true));
        Some(ix)
    }

    /// Every exchange has ended.
    pub fn idle(&self) -> bool {
        self.conns.values().all(|c| c.done)
    }

    /// The engine at `ix` (incarnation `inc`) crashed: the exchanges it
    /// served break, as a dead process's connections do.
    pub fn crashed(&mut self, ctx: &mut Ctx, ix: Ix, inc: u64) {
        let open: Vec<u64> = self
            .conns
            .iter()
            .filter(|(_, c)| !c.done && c.to == ix && c.to_inc == inc)
            .map(|(&k, _)| k)
            .collect();
        for conn in open {
            ctx.at(Duration::from_micros(200), Ev::CtrlBreak { conn });
        }
    }

    /// The first exchange that has not ended, for a violation's message.
    pub fn first_open(&self) -> Option<String> {
        self.conns
            .iter()
            .find(|(_, c)| !c.done)
            .map(|(k, c)| format!("{k:?}: {c:?}"))
    }

    /// Pulls a prefill engine that is still up never answered, on
    /// connections no fault broke.
    pub fn unanswered_pulls(&self, cluster: &Cluster) -> usize {
        self.conns
            .values()
            .filter(|c| {
                c.is_pull && c.finals == 0 && !c.broken && cluster.live(c.to, c.to_inc).is_some()
            })
            .count()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::Options;

    fn ctx(seed: u64) -> Ctx {
        Ctx::new(Options::for_seed(seed))
    }

    fn delays(seed: u64, faults: bool, n: usize) -> Vec<Duration> {
        let (mut c, mut net) = (ctx(seed), Net::new(faults));
        (0..n).map(|_| net.delay(&mut c)).collect()
    }

    fn events(c: &mut Ctx) -> Vec<(Duration, String)> {
        let t0 = c.t0;
        std::iter::from_fn(|| c.pop())
            .map(|t| (t.at - t0, format!("{:?}", t.ev)))
            .collect()
    }

    #[test]
    fn delays_are_short_without_faults_and_replay_for_a_seed() {
        let d = delays(1, false, 2000);
        let (lo, hi) = (Duration::from_micros(100), Duration::from_micros(2000));
        assert!(d.iter().all(|d| (lo..=hi).contains(d)));
        assert_eq!(d, delays(1, false, 2000));
        assert_ne!(d, delays(2, false, 2000));
    }

    #[test]
    fn faults_spike_some_delays_past_a_second() {
        let d = delays(1, true, 5000);
        let spikes = d.iter().filter(|d| **d >= Duration::from_secs(1)).count();
        assert!(spikes > 0 && spikes < 100, "{spikes} spikes in 5000");
        assert!(d.iter().all(|d| *d <= Duration::from_millis(62_000)));
        assert_eq!(d, delays(1, true, 5000));
    }

    #[test]
    fn a_partition_holds_both_directions_until_it_ends_and_a_heal_lifts_it() {
        let (mut c, mut net) = (ctx(1), Net::new(false));
        let until = c.t0 + Duration::from_secs(10);
        net.partition(0, 1, until);
        c.clock.set(c.t0 + Duration::from_secs(4));
        let over = Duration::from_millis(6001);
        assert!(net.link_delay(&mut c, 0, 1) >= over);
        assert!(net.link_delay(&mut c, 1, 0) >= over);
        assert!(net.link_delay(&mut c, 0, 2) < Duration::from_millis(3));
        net.heal();
        assert!(net.link_delay(&mut c, 0, 1) < Duration::from_millis(3));
        assert!(!net.faults);
    }

    #[test]
    fn kv_frames_arrive_once_without_faults_and_are_lost_duplicated_or_held_with() {
        let arrivals = |faults| {
            let (mut c, mut net) = (ctx(7), Net::new(faults));
            (0..3000)
                .map(|_| net.kv_frame_arrivals(&mut c, 0, 1))
                .collect::<Vec<_>>()
        };
        assert!(arrivals(false).iter().all(|a| a.len() == 1));
        let faulty = arrivals(true);
        let count = |f: &dyn Fn(&Vec<Duration>) -> bool| faulty.iter().filter(|a| f(a)).count();
        let lost = count(&|a| a.is_empty());
        let twice = count(&|a| a.len() == 2);
        let held = count(&|a| a.last().is_some_and(|d| *d >= Duration::from_secs(20)));
        assert!(lost > 0 && twice > 0 && held > 0, "{lost} {twice} {held}");
        // A duplicate comes after the frame it copies, and is scheduled first.
        assert!(faulty.iter().filter(|a| a.len() == 2).all(|a| a[0] > a[1]));
        assert_eq!(faulty, arrivals(true));
    }

    #[test]
    fn the_fault_plan_is_the_seeds() {
        let plan = |seed| {
            let (mut c, mut net) = (ctx(seed), Net::new(true));
            net.plan_faults(&mut c);
            events(&mut c)
        };
        assert_eq!(plan(15), plan(15));
        let all: Vec<_> = (0..40).flat_map(plan).collect();
        assert!(all.iter().any(|(_, e)| e.starts_with("Partition")));
        assert!(all.iter().any(|(_, e)| e.starts_with("Crash")));
        assert!(all.iter().all(|(t, _)| *t < Duration::from_secs(60)));
    }

    #[test]
    fn a_control_request_to_a_crashed_engine_breaks_and_the_proxys_drop_ends() {
        let mut c = ctx(0);
        let mut cluster = Cluster::new(&mut c).expect("built");
        let mut net = Net::new(false);
        let _ = events(&mut c);
        net.proxy_drop(&mut c, &cluster, 0, "t1", FailCode::Timeout);
        cluster.crash(0);
        let evs: Vec<Ev> = std::iter::from_fn(|| c.pop()).map(|t| t.ev).collect();
        assert_eq!(evs.len(), 1);
        let Some(Ev::CtrlRequest { conn, msg }) = evs.into_iter().next() else {
            panic!("a control request")
        };
        assert!(!net.idle());
        assert_eq!(net.ctrl_request(&mut c, &cluster, conn, msg), None);
        assert!(net.idle());
        let got = events(&mut c);
        assert_eq!(got.len(), 1);
        assert!(got[0].1.starts_with("CtrlBreak"), "{got:?}");
        assert_eq!(net.ctrl_break(&cluster, conn), None);
        assert_eq!(net.unanswered_pulls(&cluster), 0);
    }

    #[test]
    fn an_exchange_to_no_engine_opens_nothing() {
        let mut c = ctx(0);
        let cluster = Cluster::new(&mut c).expect("built");
        let mut net = Net::new(false);
        let _ = events(&mut c);
        let msg = Message::Drop {
            transfer_id: "t1".into(),
            code: FailCode::Timeout,
        };
        let op = Op::DropUnpulled {
            transfer_id: "t1".into(),
        };
        let deadline = c.t0 + Duration::from_secs(1);
        let io = SendIo {
            op,
            addr: "127.0.0.9:1".into(),
            msg,
            deadline,
        };
        net.send(&mut c, &cluster, 1, io);
        assert!(events(&mut c).is_empty() && net.idle());
    }
}
