//! D's claims on the transfers of requests it has queued but not admitted
//! yet, as a pure state machine (no I/O, no clock, ordered tables).
//!
//! A prefill engine holds a finished prompt's KV for a *lease*. Under load a
//! decode engine's queue can outlast any fixed lease, so D claims each
//! queued request's transfer from P and claims it again every third of the
//! lease P answered with, until the request is admitted (its load takes
//! over), ends, or P says it no longer holds the transfer. Claims to one P
//! go together, at most [`MAX_CLAIM`] transfers a message.
//!
//! Invariants:
//! - a queued request is claimed within `first` (see [`ClaimBook::new`]) of being
//!   added, then at most a third of P's lease after each claim was sent
//!   (an exchange that fails is tried again after [`RETRY`]);
//! - at most one claim exchange per request is in flight;
//! - a request removed is never claimed again (an answer for it is
//!   ignored).

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::wire::{ClaimEnded, FailCode, MAX_CLAIM};

/// How soon a failed or refused claim is sent again.
pub const RETRY: Duration = Duration::from_secs(1);

/// Names one claim exchange.
pub type ClaimId = u64;

/// A claim to send: the exchange `id` carries `transfer_ids` to the P at
/// `addr`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ClaimSend {
    pub id: ClaimId,
    pub addr: String,
    pub transfer_ids: Vec<String>,
}

struct Entry {
    addr: String,
    transfer_id: String,
    due: Instant,
    /// The exchange carrying this request's claim now.
    sending: Option<ClaimId>,
}

struct Exchange {
    sent_at: Instant,
    reqs: Vec<Arc<str>>,
}

/// See the module docs.
pub struct ClaimBook {
    first: Duration,
    entries: BTreeMap<Arc<str>, Entry>,
    exchanges: BTreeMap<ClaimId, Exchange>,
    next: ClaimId,
    /// Transfers named in claims sent, for metrics.
    sent: u64,
}

impl ClaimBook {
    /// `first`: how long after a request is queued its first claim goes
    /// out (claims of requests queued together go in one message).
    pub fn new(first: Duration) -> ClaimBook {
        ClaimBook {
            first,
            entries: BTreeMap::new(),
            exchanges: BTreeMap::new(),
            next: 1,
            sent: 0,
        }
    }

    /// `req` was queued with KV to load from the P at `addr`.
    pub fn add(&mut self, now: Instant, req: &Arc<str>, addr: &str, transfer_id: &str) {
        self.entries.insert(
            req.clone(),
            Entry {
                addr: addr.to_string(),
                transfer_id: transfer_id.to_string(),
                due: now + self.first,
                sending: None,
            },
        );
    }

    /// `req` no longer waits in the queue (admitted, or ended).
    pub fn remove(&mut self, req: &str) {
        self.entries.remove(req);
    }

    /// Requests claimed now.
    pub fn len(&self) -> usize {
        self.entries.len()
    }

    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    /// Transfers named in claims sent so far.
    pub fn num_sent(&self) -> u64 {
        self.sent
    }

    /// When [`ClaimBook::due`] has claims to send next.
    pub fn poll_timeout(&self) -> Option<Instant> {
        self.entries
            .values()
            .filter(|e| e.sending.is_none())
            .map(|e| e.due)
            .min()
    }

    /// The claims due at `now`, one exchange per P (and per
    /// [`MAX_CLAIM`] transfers).
    pub fn due(&mut self, now: Instant) -> Vec<ClaimSend> {
        let mut by_addr: BTreeMap<String, Vec<Arc<str>>> = BTreeMap::new();
        for (req, e) in &self.entries {
            if e.sending.is_none() && e.due <= now {
                by_addr.entry(e.addr.clone()).or_default().push(req.clone());
            }
        }
        let mut out = Vec::new();
        for (addr, reqs) in by_addr {
            for chunk in reqs.chunks(MAX_CLAIM) {
                let id = self.next;
                self.next += 1;
                let mut transfer_ids = Vec::with_capacity(chunk.len());
                for req in chunk {
                    let e = self.entries.get_mut(req).expect("listed above");
                    e.sending = Some(id);
                    transfer_ids.push(e.transfer_id.clone());
                }
                self.sent += chunk.len() as u64;
                self.exchanges.insert(
                    id,
                    Exchange {
                        sent_at: now,
                        reqs: chunk.to_vec(),
                    },
                );
                out.push(ClaimSend {
                    id,
                    addr: addr.clone(),
                    transfer_ids,
                });
            }
        }
        out
    }

    /// P answered claim `id`: its lease, and the transfers it does not hold.
    /// Those P has not seen yet are claimed again after [`RETRY`]; those it
    /// ended are claimed no more (the load learns why when it pulls). `Err`:
    /// the exchange failed; every claim in it goes again after [`RETRY`].
    pub fn on_answer(
        &mut self,
        now: Instant,
        id: ClaimId,
        answer: Result<(Duration, Vec<ClaimEnded>), ()>,
    ) {
        let Some(x) = self.exchanges.remove(&id) else {
            return;
        };
        let (renew_at, ended) = match answer {
            Ok((lease, ended)) => (x.sent_at + lease / 3, ended),
            Err(()) => (now + RETRY, Vec::new()),
        };
        for req in &x.reqs {
            let Some(e) = self.entries.get_mut(req) else {
                continue;
            };
            if e.sending != Some(id) {
                continue;
            }
            e.sending = None;
            match ended.iter().find(|c| c.transfer_id == e.transfer_id) {
                Some(c) if c.code == FailCode::Unknown => e.due = now + RETRY,
                Some(_) => {
                    self.entries.remove(req);
                }
                None => e.due = renew_at,
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const LEASE: Duration = Duration::from_secs(30);

    fn book() -> ClaimBook {
        ClaimBook::new(Duration::from_secs(1))
    }

    fn r(s: &str) -> Arc<str> {
        Arc::from(s)
    }

    #[test]
    fn queued_requests_are_claimed_together_and_again_each_third_of_the_lease() {
        let t0 = Instant::now();
        let mut b = book();
        b.add(t0, &r("a"), "p1:1", "ta");
        b.add(t0, &r("b"), "p1:1", "tb");
        b.add(t0, &r("c"), "p2:1", "tc");
        assert!(b.due(t0).is_empty(), "the first claim waits to batch");
        let t1 = t0 + Duration::from_secs(1);
        assert_eq!(b.poll_timeout(), Some(t1));
        let sends = b.due(t1);
        assert_eq!(sends.len(), 2, "one exchange per P");
        assert_eq!(sends[0].addr, "p1:1");
        assert_eq!(sends[0].transfer_ids, vec!["ta", "tb"]);
        assert_eq!(b.poll_timeout(), None, "nothing more while in flight");
        b.on_answer(t1, sends[0].id, Ok((LEASE, Vec::new())));
        assert_eq!(b.poll_timeout(), Some(t1 + LEASE / 3));
        // P2's exchange failed: tried again soon.
        b.on_answer(t1, sends[1].id, Err(()));
        assert_eq!(b.poll_timeout(), Some(t1 + RETRY));
        // Admitted or ended: claimed no more, a late answer is ignored.
        let again = b.due(t1 + RETRY);
        assert_eq!(again.len(), 1);
        b.remove("c");
        b.on_answer(t1 + RETRY, again[0].id, Ok((LEASE, Vec::new())));
        assert_eq!(b.len(), 2);
        let renew = b.due(t1 + LEASE / 3);
        assert_eq!(renew[0].transfer_ids, vec!["ta", "tb"]);
        assert_eq!(b.num_sent(), 3 + 1 + 2);
    }

    #[test]
    fn what_p_ended_is_dropped_and_what_p_has_not_seen_is_retried() {
        let t0 = Instant::now();
        let mut b = book();
        b.add(t0, &r("a"), "p", "ta");
        b.add(t0, &r("b"), "p", "tb");
        let s = b.due(t0 + LEASE);
        let ended = vec![
            ClaimEnded {
                transfer_id: "ta".into(),
                code: FailCode::LeaseExpired,
            },
            ClaimEnded {
                transfer_id: "tb".into(),
                code: FailCode::Unknown,
            },
        ];
        b.on_answer(t0 + LEASE, s[0].id, Ok((LEASE, ended)));
        assert_eq!(b.len(), 1, "an ended transfer is claimed no more");
        assert_eq!(b.poll_timeout(), Some(t0 + LEASE + RETRY));
    }

    #[test]
    fn a_long_queue_is_claimed_in_bounded_messages() {
        let t0 = Instant::now();
        let mut b = book();
        for i in 0..(MAX_CLAIM + 3) {
            let id = r(&format!("q{i}"));
            b.add(t0, &id, "p", &format!("t{i}"));
        }
        let s = b.due(t0 + LEASE);
        assert_eq!(
            s.iter().map(|x| x.transfer_ids.len()).collect::<Vec<_>>(),
            vec![MAX_CLAIM, 3]
        );
    }
}
