//! What every room of the simulated world shares: the virtual clock and
//! its event queue, the run's one random source, ids, the run's options
//! and phase, and the report the rooms count into.
//!
//! A leaf: it knows the events ([`Ev`]) but none of the rooms that handle
//! them.

use std::collections::BinaryHeap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use pdkv_connector::ranks::Copy as KvCopy;
use pdkv_connector::recv::LoadId;
use pdkv_connector::wire::{Failure, Message};

use crate::node::SimClock;
use crate::plan::Event;
use crate::rng::Rng;
use crate::{Options, Report};

/// A node's place in the cluster.
pub type Ix = usize;

/// An event on the clock. Ordered by time, then by when it was scheduled.
pub struct Timed {
    pub at: Instant,
    pub seq: u64,
    pub ev: Ev,
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
pub enum Ev {
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
    /// The engine crashes at its next output of a stream in progress (so
    /// the proxy must resume that stream elsewhere).
    CrashMidStream(Ix),
    Restart(Ix),
    Partition {
        a: Ix,
        b: Ix,
        until: Instant,
    },
    /// Faults stop, everything is brought back to serving.
    Heal,
}

/// The clock, the queue, the random source and the report of one run.
pub struct Ctx {
    pub opts: Options,
    pub rng: Rng,
    pub clock: Arc<SimClock>,
    pub t0: Instant,
    queue: BinaryHeap<Timed>,
    seq: u64,
    next_id: u64,
    /// The liveness phase has begun: no new clients, operations or faults.
    pub healed: bool,
    pub report: Report,
}

impl Ctx {
    pub fn new(opts: Options) -> Ctx {
        let t0 = Instant::now();
        Ctx {
            rng: Rng::new(opts.seed),
            clock: Arc::new(SimClock::new(t0)),
            t0,
            queue: BinaryHeap::new(),
            seq: 0,
            next_id: 1,
            healed: false,
            report: Report {
                seed: opts.seed,
                p_tp: opts.p_tp,
                d_tp: opts.d_tp,
                ..Report::default()
            },
            opts,
        }
    }

    pub fn now(&self) -> Instant {
        pdkv_engine::Clock::now(&*self.clock)
    }

    /// Schedules `ev` `after` from now.
    pub fn at(&mut self, after: Duration, ev: Ev) {
        let at = self.now() + after;
        self.at_instant(at, ev);
    }

    pub fn at_instant(&mut self, at: Instant, ev: Ev) {
        self.seq += 1;
        self.queue.push(Timed {
            at,
            seq: self.seq,
            ev,
        });
    }

    /// The next event, earliest first (of two at one time, the one
    /// scheduled first).
    pub fn pop(&mut self) -> Option<Timed> {
        self.queue.pop()
    }

    /// A fresh id (connections, writes, reads, calls, clients share them).
    pub fn id(&mut self) -> u64 {
        self.next_id += 1;
        self.next_id
    }

    /// Notes a broken invariant, with the simulated time.
    pub fn violation(&mut self, what: String) {
        let t = self.now() - self.t0;
        self.report
            .violations
            .push(format!("t={:.3}s: {what}", t.as_secs_f64()));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ctx() -> Ctx {
        Ctx::new(Options::for_seed(3))
    }

    fn drain(c: &mut Ctx) -> Vec<(Duration, u64, String)> {
        let t0 = c.t0;
        std::iter::from_fn(|| c.pop())
            .map(|t| (t.at - t0, t.seq, format!("{:?}", t.ev)))
            .collect()
    }

    #[test]
    fn events_come_by_time_then_by_schedule_order() {
        let mut c = ctx();
        c.at(Duration::from_millis(5), Ev::Tick(0));
        c.at(Duration::from_millis(1), Ev::Tick(1));
        c.at(Duration::from_millis(5), Ev::Heal);
        c.at(Duration::from_millis(1), Ev::ClientArrives);
        let ms = Duration::from_millis;
        assert_eq!(
            drain(&mut c),
            vec![
                (ms(1), 2, "Tick(1)".to_string()),
                (ms(1), 4, "ClientArrives".to_string()),
                (ms(5), 1, "Tick(0)".to_string()),
                (ms(5), 3, "Heal".to_string()),
            ]
        );
    }

    #[test]
    fn delays_count_from_the_simulated_now() {
        let mut c = ctx();
        c.clock.set(c.t0 + Duration::from_secs(2));
        c.at(Duration::from_millis(10), Ev::Heal);
        let at = c.t0 + Duration::from_secs(3);
        c.at_instant(at, Ev::ClientArrives);
        let got: Vec<Duration> = drain(&mut c).into_iter().map(|e| e.0).collect();
        assert_eq!(got, [Duration::from_millis(2010), Duration::from_secs(3)]);
    }

    #[test]
    fn ids_are_fresh_and_violations_carry_the_time() {
        let mut c = ctx();
        assert_eq!((c.id(), c.id(), c.id()), (2, 3, 4));
        c.clock.set(c.t0 + Duration::from_millis(1500));
        c.violation("a block leaked".into());
        assert_eq!(c.report.violations, ["t=1.500s: a block leaked"]);
        assert_eq!((c.report.seed, c.report.p_tp), (3, c.opts.p_tp));
    }
}
