//! The initiator's side of one-sided transfers, as a pure state machine.
//!
//! An [`Initiator`] serves one peer over any number of connections. A batch
//! of transfers is sliced into operations of at most `max_slice` bytes,
//! queued, and handed to connections by [`Initiator::poll_transmit`] (at most
//! `max_inflight_per_conn` outstanding per connection). Responses come back
//! through [`Initiator::on_response`]; when every data operation of a batch
//! has been acknowledged, its notification (if any) is sent, and the batch
//! completes when that is acknowledged too: the remote sees the notification
//! only after all data landed. Completions come out of
//! [`Initiator::poll_event`].
//!
//! Time is passed in: a batch has a deadline, [`Initiator::poll_timeout`]
//! says when the driver must call [`Initiator::handle_timeout`], which fails
//! every batch whose deadline has passed. No I/O, no clock, no threads.
//!
//! Invariants:
//! - every batch ends exactly once (one [`Completion`]), by its deadline at
//!   the latest;
//! - batches, queued operations and in-flight operations are bounded;
//! - a response for an operation whose batch already ended is absorbed (the
//!   driver drains its data); a response that contradicts the protocol is an
//!   error the driver answers by closing that connection.

use std::collections::{BTreeMap, HashMap, VecDeque};
use std::time::Instant;

use crate::frame::{RemoteError, Target};

pub type OpId = u64;
pub type BatchId = u64;
pub type ConnId = usize;

/// A local memory range, as the driver defines it. The state machine only
/// needs its length and to cut it into slices.
pub trait LocalRange: Clone {
    fn len(&self) -> u64;
    fn is_empty(&self) -> bool {
        self.len() == 0
    }
    /// The sub-range `[offset, offset+len)`; always within `self`.
    fn slice(&self, offset: u64, len: u64) -> Self;
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Direction {
    /// Local → remote.
    Write,
    /// Remote → local.
    Read,
}

/// One transfer of a batch: a local range and a remote range of equal length.
#[derive(Clone, Debug)]
pub struct Transfer<L> {
    pub local: L,
    pub remote: Target,
}

/// What every transport checks of a batch before it starts it: the
/// notification within `max_notify` bytes, and each transfer's local
/// range as long as its remote one.
pub(crate) fn check_batch<L: LocalRange>(
    transfers: &[Transfer<L>],
    notify: Option<&[u8]>,
    max_notify: usize,
) -> Result<(), StartError> {
    if let Some(n) = notify.filter(|n| n.len() > max_notify) {
        return Err(StartError::NotifyTooLarge {
            len: n.len(),
            limit: max_notify,
        });
    }
    match (transfers.iter().enumerate()).find(|(_, t)| t.local.len() != t.remote.len) {
        Some((index, t)) => Err(StartError::LengthMismatch {
            index,
            local: t.local.len(),
            remote: t.remote.len,
        }),
        None => Ok(()),
    }
}

/// Why a batch failed.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum TransferError {
    #[error("the peer was lost")]
    PeerLost,
    #[error("deadline passed")]
    Timeout,
    #[error("cancelled")]
    Cancelled,
    #[error("refused by the remote: {0}")]
    Remote(RemoteError),
}

impl TransferError {
    /// Index for per-reason failure counters.
    pub fn reason_index(&self) -> usize {
        match self {
            TransferError::PeerLost => 0,
            TransferError::Timeout => 1,
            TransferError::Cancelled => 2,
            TransferError::Remote(_) => 3,
        }
    }
    pub const REASONS: [&'static str; 4] = ["peer_lost", "timeout", "cancelled", "remote"];
}

/// Why a batch could not be started.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum StartError {
    #[error("transfer {index}: local length {local} differs from remote length {remote}")]
    LengthMismatch {
        index: usize,
        local: u64,
        remote: u64,
    },
    #[error("too many batches in flight ({0})")]
    TooManyBatches(usize),
    #[error("too many operations queued ({0})")]
    TooManyOps(usize),
    #[error("notification of {len} bytes exceeds the limit {limit}")]
    NotifyTooLarge { len: usize, limit: usize },
}

/// What a driver must send on a connection.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Request<L> {
    /// Send `local`'s bytes to `target`.
    Write { op: OpId, target: Target, local: L },
    /// Ask for `target`'s bytes; they go into `local` (see [`Initiator::read_target`]).
    Read { op: OpId, target: Target },
    /// Deliver a notification to the remote.
    Notify { op: OpId, payload: Vec<u8> },
}

/// A response the driver received for `op`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Response {
    WriteAck,
    /// Read data of this length has been placed into the op's local range.
    ReadDone {
        len: u64,
    },
    NotifyAck,
    Error(RemoteError),
}

/// The peer answered something the protocol does not allow; the driver
/// closes the connection.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("protocol violation on connection {conn}: {what}")]
pub struct ProtocolViolation {
    pub conn: ConnId,
    pub what: String,
}

/// A batch ended.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Completion {
    pub batch: BatchId,
    pub result: Result<(), TransferError>,
}

#[derive(Clone, Debug)]
pub struct InitiatorConfig {
    pub max_slice: u64,
    pub max_inflight_per_conn: usize,
    pub max_batches: usize,
    pub max_queued_ops: usize,
    pub max_notify: usize,
}

impl Default for InitiatorConfig {
    fn default() -> Self {
        InitiatorConfig {
            max_slice: 1 << 20,
            // Slices outstanding per connection: enough to keep a loopback
            // or LAN pipe full at 1 MiB slices (8 left it ~15% short of a
            // plain socket copy in `pdkv bench transfer`).
            max_inflight_per_conn: 32,
            max_batches: 1024,
            max_queued_ops: 65_536,
            max_notify: 64 << 10,
        }
    }
}

/// Counters for one peer.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Stats {
    pub bytes_written: u64,
    pub bytes_read: u64,
    pub ops_done: u64,
    pub batches_ok: u64,
    /// Failed batches by [`TransferError::reason_index`].
    pub failures: [u64; 4],
}

enum OpKind<L> {
    Write { target: Target, local: L },
    Read { target: Target, local: L },
    Notify { payload: Vec<u8> },
}

struct Op<L> {
    batch: BatchId,
    kind: OpKind<L>,
    /// The connection it was sent on; `None` while queued.
    sent_on: Option<ConnId>,
    /// False once its batch ended: a late response is absorbed.
    live: bool,
}

struct Batch {
    /// Data operations not yet acknowledged.
    pending: usize,
    deadline: Instant,
    notify: Option<Vec<u8>>,
}

struct Conn {
    live: bool,
    inflight: usize,
}

pub struct Initiator<L> {
    cfg: InitiatorConfig,
    next_op: OpId,
    next_batch: BatchId,
    conns: Vec<Conn>,
    ops: HashMap<OpId, Op<L>>,
    queue: VecDeque<OpId>,
    batches: BTreeMap<BatchId, Batch>,
    events: VecDeque<Completion>,
    stats: Stats,
}

impl<L: LocalRange> Initiator<L> {
    pub fn new(cfg: InitiatorConfig) -> Initiator<L> {
        Initiator {
            cfg,
            next_op: 1,
            next_batch: 1,
            conns: Vec::new(),
            ops: HashMap::new(),
            queue: VecDeque::new(),
            batches: BTreeMap::new(),
            events: VecDeque::new(),
            stats: Stats::default(),
        }
    }

    pub fn stats(&self) -> &Stats {
        &self.stats
    }

    /// A new connection is up; returns its id.
    pub fn add_conn(&mut self) -> ConnId {
        self.conns.push(Conn {
            live: true,
            inflight: 0,
        });
        self.conns.len() - 1
    }

    /// Whether `conn` is still up (a driver's writer stops once it is not).
    pub fn conn_live(&self, conn: ConnId) -> bool {
        self.conns.get(conn).is_some_and(|c| c.live)
    }

    pub fn live_conns(&self) -> usize {
        self.conns.iter().filter(|c| c.live).count()
    }

    /// Starts a batch. Its completion comes out of `poll_event`, by
    /// `deadline` at the latest.
    pub fn start(
        &mut self,
        now: Instant,
        dir: Direction,
        transfers: Vec<Transfer<L>>,
        notify: Option<Vec<u8>>,
        deadline: Instant,
    ) -> Result<BatchId, StartError> {
        if self.batches.len() >= self.cfg.max_batches {
            return Err(StartError::TooManyBatches(self.cfg.max_batches));
        }
        check_batch(&transfers, notify.as_deref(), self.cfg.max_notify)?;
        let slices: u64 = (transfers.iter())
            .map(|t| t.remote.len.div_ceil(self.cfg.max_slice))
            .sum();
        if self.queue.len() as u64 + slices > self.cfg.max_queued_ops as u64 {
            return Err(StartError::TooManyOps(self.cfg.max_queued_ops));
        }
        let batch = self.next_batch;
        self.next_batch += 1;
        let mut pending = 0;
        for t in transfers {
            let mut off = 0;
            while off < t.remote.len {
                let len = self.cfg.max_slice.min(t.remote.len - off);
                // Saturating: an offset past the end is the remote's to refuse.
                let target = Target {
                    offset: t.remote.offset.saturating_add(off),
                    len,
                    ..t.remote
                };
                let local = t.local.slice(off, len);
                let kind = match dir {
                    Direction::Write => OpKind::Write { target, local },
                    Direction::Read => OpKind::Read { target, local },
                };
                self.enqueue(batch, kind, false);
                pending += 1;
                off += len;
            }
        }
        self.batches.insert(
            batch,
            Batch {
                pending,
                deadline,
                notify,
            },
        );
        if pending == 0 {
            self.data_landed(batch);
        }
        if deadline <= now {
            self.finish(batch, Err(TransferError::Timeout));
        } else if self.live_conns() == 0 && !self.conns.is_empty() {
            self.finish(batch, Err(TransferError::PeerLost));
        }
        Ok(batch)
    }

    fn enqueue(&mut self, batch: BatchId, kind: OpKind<L>, front: bool) {
        let op = self.next_op;
        self.next_op += 1;
        self.ops.insert(
            op,
            Op {
                batch,
                kind,
                sent_on: None,
                live: true,
            },
        );
        if front {
            self.queue.push_front(op);
        } else {
            self.queue.push_back(op);
        }
    }

    /// All data of `batch` landed: send its notification, or complete it.
    fn data_landed(&mut self, batch: BatchId) {
        let Some(b) = self.batches.get_mut(&batch) else {
            return;
        };
        match b.notify.take() {
            Some(payload) => self.enqueue(batch, OpKind::Notify { payload }, true),
            None => self.finish(batch, Ok(())),
        }
    }

    fn finish(&mut self, batch: BatchId, result: Result<(), TransferError>) {
        if self.batches.remove(&batch).is_none() {
            return;
        }
        match &result {
            Ok(()) => self.stats.batches_ok += 1,
            Err(e) => self.stats.failures[e.reason_index()] += 1,
        }
        // Unsent ops go; sent ones stay (not live) until answered or their
        // connection is lost, so in-flight accounting stays exact.
        self.ops
            .retain(|_, op| op.batch != batch || op.sent_on.is_some());
        for op in self.ops.values_mut().filter(|op| op.batch == batch) {
            op.live = false;
        }
        self.events.push_back(Completion { batch, result });
    }

    /// The next request to send on `conn`, if it may carry one now.
    #[must_use]
    pub fn poll_transmit(&mut self, conn: ConnId) -> Option<Request<L>> {
        let c = self.conns.get(conn)?;
        if !c.live || c.inflight >= self.cfg.max_inflight_per_conn {
            return None;
        }
        while let Some(id) = self.queue.pop_front() {
            let Some(op) = self.ops.get_mut(&id) else {
                continue;
            };
            op.sent_on = Some(conn);
            self.conns[conn].inflight += 1;
            return Some(match &op.kind {
                OpKind::Write { target, local } => Request::Write {
                    op: id,
                    target: *target,
                    local: local.clone(),
                },
                OpKind::Read { target, .. } => Request::Read {
                    op: id,
                    target: *target,
                },
                OpKind::Notify { payload } => Request::Notify {
                    op: id,
                    payload: payload.clone(),
                },
            });
        }
        None
    }

    /// Where the data of a read response for `op` goes, with its expected
    /// length; `None` if the op's batch has ended (the driver drains the data).
    pub fn read_target(&self, op: OpId) -> Option<L> {
        match self.ops.get(&op) {
            Some(Op {
                kind: OpKind::Read { local, .. },
                live: true,
                ..
            }) => Some(local.clone()),
            _ => None,
        }
    }

    /// A response for `op` arrived on `conn`.
    pub fn on_response(
        &mut self,
        conn: ConnId,
        op_id: OpId,
        resp: Response,
    ) -> Result<(), ProtocolViolation> {
        let violation = |what: String| ProtocolViolation { conn, what };
        let Some(op) = self.ops.get(&op_id) else {
            return Err(violation(format!("response for unknown op {op_id}")));
        };
        if op.sent_on != Some(conn) {
            return Err(violation(format!(
                "response for op {op_id} on the wrong connection"
            )));
        }
        let bytes = match (&op.kind, resp) {
            (OpKind::Write { target, .. }, Response::WriteAck) => target.len,
            (OpKind::Read { target, .. }, Response::ReadDone { len }) if len == target.len => {
                target.len
            }
            (OpKind::Notify { .. }, Response::NotifyAck) | (_, Response::Error(_)) => 0,
            _ => {
                return Err(violation(format!(
                    "response {resp:?} does not fit op {op_id}"
                )))
            }
        };
        let op = self.ops.remove(&op_id).expect("looked up above");
        self.conns[conn].inflight -= 1;
        if !op.live {
            return Ok(());
        }
        self.stats.ops_done += 1;
        match (&op.kind, resp) {
            (_, Response::Error(e)) => self.finish(op.batch, Err(TransferError::Remote(e))),
            (OpKind::Notify { .. }, _) => self.finish(op.batch, Ok(())),
            (kind, _) => {
                match kind {
                    OpKind::Write { .. } => self.stats.bytes_written += bytes,
                    _ => self.stats.bytes_read += bytes,
                }
                let b = self
                    .batches
                    .get_mut(&op.batch)
                    .expect("a live op has a live batch");
                b.pending -= 1;
                if b.pending == 0 {
                    self.data_landed(op.batch);
                }
            }
        }
        Ok(())
    }

    /// `conn` is gone: every batch with an operation on it fails with
    /// `PeerLost`, and so does every batch when no connection is left.
    pub fn conn_lost(&mut self, conn: ConnId) {
        let Some(c) = self.conns.get_mut(conn) else {
            return;
        };
        if !c.live {
            return;
        }
        c.live = false;
        c.inflight = 0;
        let mut hit: Vec<BatchId> = Vec::new();
        self.ops.retain(|_, op| {
            if op.sent_on == Some(conn) {
                if op.live {
                    hit.push(op.batch);
                }
                false
            } else {
                true
            }
        });
        if self.live_conns() == 0 {
            hit.extend(self.batches.keys().copied());
        }
        hit.sort_unstable();
        hit.dedup();
        for b in hit {
            self.finish(b, Err(TransferError::PeerLost));
        }
    }

    /// Ends `batch` with `Cancelled` (no-op if it already ended). Requests
    /// already sent may still land; their responses are absorbed.
    pub fn cancel(&mut self, batch: BatchId) {
        self.finish(batch, Err(TransferError::Cancelled));
    }

    /// Fails every batch whose deadline is at or before `now`.
    pub fn handle_timeout(&mut self, now: Instant) {
        let due: Vec<BatchId> = self
            .batches
            .iter()
            .filter(|(_, b)| b.deadline <= now)
            .map(|(&id, _)| id)
            .collect();
        for b in due {
            self.finish(b, Err(TransferError::Timeout));
        }
    }

    /// The earliest deadline of a live batch.
    pub fn poll_timeout(&self) -> Option<Instant> {
        self.batches.values().map(|b| b.deadline).min()
    }

    /// The next batch that ended.
    pub fn poll_event(&mut self) -> Option<Completion> {
        self.events.pop_front()
    }

    /// Batches not yet ended.
    pub fn live_batches(&self) -> usize {
        self.batches.len()
    }

    /// Operations queued or in flight (including absorbed late ones).
    pub fn ops_outstanding(&self) -> usize {
        self.ops.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::error::AccessError;
    use std::time::Duration;

    /// A local range in tests: (offset, len) into an imaginary buffer.
    #[derive(Clone, Copy, Debug, PartialEq, Eq)]
    struct R(u64, u64);
    impl LocalRange for R {
        fn len(&self) -> u64 {
            self.1
        }
        fn slice(&self, offset: u64, len: u64) -> R {
            assert!(offset + len <= self.1);
            R(self.0 + offset, len)
        }
    }

    fn t(local_off: u64, remote_off: u64, len: u64) -> Transfer<R> {
        Transfer {
            local: R(local_off, len),
            remote: Target {
                segment: 1,
                key: 2,
                epoch: 3,
                offset: remote_off,
                len,
            },
        }
    }

    fn init(slice: u64, inflight: usize) -> Initiator<R> {
        Initiator::new(InitiatorConfig {
            max_slice: slice,
            max_inflight_per_conn: inflight,
            max_batches: 4,
            max_queued_ops: 64,
            max_notify: 16,
        })
    }

    /// A remote that acks everything it is sent, one round at a time, on
    /// every connection; returns the requests seen. Bounded: a livelock fails.
    fn drive(i: &mut Initiator<R>, conns: &[ConnId]) -> Vec<Request<R>> {
        let mut seen = Vec::new();
        for _round in 0..1000 {
            let mut sent = Vec::new();
            for &c in conns {
                while let Some(r) = i.poll_transmit(c) {
                    sent.push((c, r));
                }
            }
            if sent.is_empty() {
                return seen;
            }
            for (c, r) in sent {
                let (op, resp) = match &r {
                    Request::Write { op, .. } => (*op, Response::WriteAck),
                    Request::Read { op, target } => (*op, Response::ReadDone { len: target.len }),
                    Request::Notify { op, .. } => (*op, Response::NotifyAck),
                };
                i.on_response(c, op, resp).unwrap();
                seen.push(r);
            }
        }
        panic!("drive did not settle within 1000 rounds");
    }

    #[test]
    fn batches_are_sliced_spread_and_notified_after_all_data() {
        let now = Instant::now();
        let mut i = init(100, 2);
        let (a, b) = (i.add_conn(), i.add_conn());
        let id = i
            .start(
                now,
                Direction::Write,
                vec![t(0, 1000, 250), t(500, 0, 100)],
                Some(b"done".to_vec()),
                now + Duration::from_secs(5),
            )
            .unwrap();
        let seen = drive(&mut i, &[a, b]);
        let writes: Vec<_> = seen
            .iter()
            .filter_map(|r| match r {
                Request::Write { target, local, .. } => Some((target.offset, target.len, local.0)),
                _ => None,
            })
            .collect();
        assert_eq!(
            writes,
            vec![
                (1000, 100, 0),
                (1100, 100, 100),
                (1200, 50, 200),
                (0, 100, 500)
            ]
        );
        assert!(
            matches!(seen.last(), Some(Request::Notify { payload, .. }) if payload == b"done"),
            "the notification goes last, after every write was acked"
        );
        assert_eq!(
            i.poll_event(),
            Some(Completion {
                batch: id,
                result: Ok(())
            })
        );
        assert_eq!(i.poll_event(), None);
        assert_eq!(i.stats().bytes_written, 350);
        assert_eq!(i.ops_outstanding(), 0);
    }

    #[test]
    fn the_notification_waits_for_the_last_ack() {
        let now = Instant::now();
        let mut i = init(100, 8);
        let c = i.add_conn();
        i.start(
            now,
            Direction::Read,
            vec![t(0, 0, 300)],
            Some(b"n".to_vec()),
            now + Duration::from_secs(1),
        )
        .unwrap();
        let reqs: Vec<_> = std::iter::from_fn(|| i.poll_transmit(c)).collect();
        assert_eq!(reqs.len(), 3);
        let ops: Vec<OpId> = reqs
            .iter()
            .map(|r| match r {
                Request::Read { op, .. } => *op,
                _ => unreachable!(),
            })
            .collect();
        assert_eq!(i.read_target(ops[1]), Some(R(100, 100)));
        i.on_response(c, ops[2], Response::ReadDone { len: 100 })
            .unwrap();
        i.on_response(c, ops[0], Response::ReadDone { len: 100 })
            .unwrap();
        assert_eq!(
            i.poll_transmit(c),
            None,
            "no notification while a slice is outstanding"
        );
        i.on_response(c, ops[1], Response::ReadDone { len: 100 })
            .unwrap();
        assert!(matches!(i.poll_transmit(c), Some(Request::Notify { .. })));
    }

    #[test]
    fn a_five_second_deadline_is_tested_in_microseconds() {
        let t0 = Instant::now();
        let mut i = init(100, 1);
        let c = i.add_conn();
        let id = i
            .start(
                t0,
                Direction::Write,
                vec![t(0, 0, 200)],
                None,
                t0 + Duration::from_secs(5),
            )
            .unwrap();
        let r = i.poll_transmit(c).unwrap();
        assert_eq!(i.poll_transmit(c), None, "in-flight bound of one");
        assert_eq!(i.poll_timeout(), Some(t0 + Duration::from_secs(5)));
        i.handle_timeout(t0 + Duration::from_micros(4_999_999));
        assert_eq!(i.poll_event(), None);
        i.handle_timeout(t0 + Duration::from_secs(5));
        assert_eq!(
            i.poll_event(),
            Some(Completion {
                batch: id,
                result: Err(TransferError::Timeout)
            })
        );
        assert_eq!(i.poll_timeout(), None);
        // The late ack is absorbed and frees the connection's slot.
        let Request::Write { op, .. } = r else {
            unreachable!()
        };
        i.on_response(c, op, Response::WriteAck).unwrap();
        assert_eq!(i.ops_outstanding(), 0);
        assert_eq!(i.poll_event(), None, "a batch ends exactly once");
        assert_eq!(i.stats().failures, [0, 1, 0, 0]);
    }

    #[test]
    fn losing_a_connection_fails_its_batches_and_the_rest_carry_on() {
        let now = Instant::now();
        let dl = now + Duration::from_secs(1);
        let mut i = init(100, 1);
        let (a, b) = (i.add_conn(), i.add_conn());
        let x = i
            .start(now, Direction::Write, vec![t(0, 0, 100)], None, dl)
            .unwrap();
        let y = i
            .start(now, Direction::Write, vec![t(0, 0, 100)], None, dl)
            .unwrap();
        let _ = i.poll_transmit(a).unwrap();
        let rb = i.poll_transmit(b).unwrap();
        i.conn_lost(a);
        assert_eq!(
            i.poll_event(),
            Some(Completion {
                batch: x,
                result: Err(TransferError::PeerLost)
            })
        );
        let Request::Write { op, .. } = rb else {
            unreachable!()
        };
        i.on_response(b, op, Response::WriteAck).unwrap();
        assert_eq!(
            i.poll_event(),
            Some(Completion {
                batch: y,
                result: Ok(())
            })
        );
        // The last connection goes: queued batches fail at once, new ones too.
        let z = i
            .start(now, Direction::Read, vec![t(0, 0, 100)], None, dl)
            .unwrap();
        i.conn_lost(b);
        assert_eq!(
            i.poll_event(),
            Some(Completion {
                batch: z,
                result: Err(TransferError::PeerLost)
            })
        );
        let w = i
            .start(now, Direction::Read, vec![t(0, 0, 100)], None, dl)
            .unwrap();
        assert_eq!(
            i.poll_event(),
            Some(Completion {
                batch: w,
                result: Err(TransferError::PeerLost)
            })
        );
        assert_eq!(i.live_batches(), 0);
        assert_eq!(i.ops_outstanding(), 0);
    }

    #[test]
    fn remote_refusal_cancel_and_bad_responses() {
        let now = Instant::now();
        let dl = now + Duration::from_secs(1);
        let mut i = init(100, 8);
        let c = i.add_conn();
        let x = i
            .start(now, Direction::Write, vec![t(0, 0, 200)], None, dl)
            .unwrap();
        let ops: Vec<OpId> = std::iter::from_fn(|| i.poll_transmit(c))
            .map(|r| match r {
                Request::Write { op, .. } => op,
                _ => unreachable!(),
            })
            .collect();
        let stale = RemoteError::Access(AccessError::StaleEpoch { have: 3, want: 4 });
        i.on_response(c, ops[0], Response::Error(stale)).unwrap();
        assert_eq!(
            i.poll_event(),
            Some(Completion {
                batch: x,
                result: Err(TransferError::Remote(stale))
            })
        );
        i.on_response(c, ops[1], Response::WriteAck).unwrap();
        assert_eq!(i.poll_event(), None);

        let y = i
            .start(now, Direction::Read, vec![t(0, 0, 50)], None, dl)
            .unwrap();
        let Some(Request::Read { op, .. }) = i.poll_transmit(c) else {
            panic!()
        };
        assert!(
            i.on_response(c, op, Response::WriteAck).is_err(),
            "an ack that does not fit the op"
        );
        assert!(
            i.on_response(c, op, Response::ReadDone { len: 49 })
                .is_err(),
            "a short read"
        );
        assert!(
            i.on_response(c, 999, Response::WriteAck).is_err(),
            "an unknown op"
        );
        i.cancel(y);
        assert_eq!(
            i.poll_event(),
            Some(Completion {
                batch: y,
                result: Err(TransferError::Cancelled)
            })
        );
        assert_eq!(
            i.read_target(op),
            None,
            "a cancelled read's data is drained, not placed"
        );
        i.on_response(c, op, Response::ReadDone { len: 50 })
            .unwrap();
        assert_eq!(i.ops_outstanding(), 0);
    }

    #[test]
    fn bounds_and_edge_cases() {
        let now = Instant::now();
        let dl = now + Duration::from_secs(1);
        let mut i = init(10, 8);
        let c = i.add_conn();
        let mismatch = Transfer {
            local: R(0, 5),
            remote: t(0, 0, 6).remote,
        };
        assert_eq!(
            i.start(now, Direction::Write, vec![mismatch], None, dl),
            Err(StartError::LengthMismatch {
                index: 0,
                local: 5,
                remote: 6
            })
        );
        assert_eq!(
            i.start(now, Direction::Write, vec![t(0, 0, 1000)], None, dl),
            Err(StartError::TooManyOps(64))
        );
        assert!(matches!(
            i.start(now, Direction::Write, vec![], Some(vec![0; 17]), dl),
            Err(StartError::NotifyTooLarge { .. })
        ));
        // An empty batch completes at once; with a notification it sends just that.
        let e = i.start(now, Direction::Write, vec![], None, dl).unwrap();
        assert_eq!(
            i.poll_event(),
            Some(Completion {
                batch: e,
                result: Ok(())
            })
        );
        let n = i
            .start(now, Direction::Write, vec![], Some(b"x".to_vec()), dl)
            .unwrap();
        assert!(matches!(
            drive(&mut i, &[c]).as_slice(),
            [Request::Notify { .. }]
        ));
        assert_eq!(
            i.poll_event(),
            Some(Completion {
                batch: n,
                result: Ok(())
            })
        );
        // A deadline already passed fails at once.
        let p = i
            .start(now, Direction::Write, vec![t(0, 0, 5)], None, now)
            .unwrap();
        assert_eq!(
            i.poll_event(),
            Some(Completion {
                batch: p,
                result: Err(TransferError::Timeout)
            })
        );
        for _ in 0..4 {
            i.start(now, Direction::Write, vec![t(0, 0, 5)], None, dl)
                .unwrap();
        }
        assert_eq!(
            i.start(now, Direction::Write, vec![], None, dl),
            Err(StartError::TooManyBatches(4))
        );
    }
}
