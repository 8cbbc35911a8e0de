//! Connection slots for a listener facing untrusted clients: at most `cap`
//! connections at once, each *unproven* until the server marks it proven
//! (it did something only a real peer can: presented a live key, sent a
//! well-formed request). At the cap the oldest unproven connection is
//! closed to make room for the newcomer; a proven connection is never
//! closed for one, so only when every slot is proven is a newcomer refused.
//! Clients that connect and idle, or send garbage, thus cannot keep a real
//! peer out, whose connections prove themselves at once.
//!
//! Each source address may hold at most `per_source` unproven connections:
//! a newcomer beyond that closes the oldest unproven connection *of its own
//! source*, so one flooding host only churns through its own share and
//! never pushes out another host's newcomer.

use std::collections::BTreeMap;
use std::net::IpAddr;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::sync::{OwnedSemaphorePermit, Semaphore};
use tokio::task::AbortHandle;

/// How long a newcomer waits for the slot an eviction frees.
const EVICT_WAIT: Duration = Duration::from_secs(1);

/// The pause an accept loop takes after closing a connection for a
/// newcomer: a client that reconnects as fast as it is closed would
/// otherwise spin the loop (and the host's CPU) without end. At most 500
/// such closes a second; a real peer's connection waits at most this long.
pub const EVICT_BACKOFF: Duration = Duration::from_millis(2);

struct Entry {
    source: IpAddr,
    proven: Arc<AtomicBool>,
    task: Option<AbortHandle>,
}

/// The slots of one listener.
pub struct ConnSlots {
    permits: Arc<Semaphore>,
    per_source: usize,
    table: Mutex<(u64, BTreeMap<u64, Entry>)>,
}

/// One connection's slot, given back on drop.
pub struct Slot {
    id: u64,
    proven: Arc<AtomicBool>,
    owner: Arc<ConnSlots>,
    _permit: OwnedSemaphorePermit,
}

/// What [`ConnSlots::admit`] did to make room.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Admitted {
    /// A slot was free.
    Free,
    /// The oldest unproven connection was closed for it.
    Evicted,
    /// Its source held `per_source` unproven connections: the oldest of
    /// them was closed for it.
    EvictedOwn,
}

impl ConnSlots {
    /// `cap` connections at most, of which at most `per_source` unproven
    /// ones from any one address.
    pub fn new(cap: usize, per_source: usize) -> Arc<ConnSlots> {
        Arc::new(ConnSlots {
            permits: Arc::new(Semaphore::new(cap.max(1))),
            per_source: per_source.max(1),
            table: Mutex::new((0, BTreeMap::new())),
        })
    }

    /// A slot for a new connection from `source` (closing its source's
    /// oldest unproven one beyond `per_source`, or the oldest unproven one
    /// at the cap), or `None` when every slot is held by a proven connection.
    pub async fn admit(self: &Arc<Self>, source: IpAddr) -> Option<(Slot, Admitted)> {
        let mut how = Admitted::Free;
        if self.unproven_from(source) >= self.per_source && self.evict_oldest_unproven(Some(source))
        {
            how = Admitted::EvictedOwn;
        }
        let permit = match self.permits.clone().try_acquire_owned() {
            Ok(p) => p,
            Err(_) => {
                if how == Admitted::Free {
                    if !self.evict_oldest_unproven(None) {
                        return None;
                    }
                    how = Admitted::Evicted;
                }
                tokio::time::timeout(EVICT_WAIT, self.permits.clone().acquire_owned())
                    .await
                    .ok()?
                    .ok()?
            }
        };
        let proven = Arc::new(AtomicBool::new(false));
        let mut t = self.table.lock().unwrap();
        let id = t.0;
        t.0 += 1;
        t.1.insert(
            id,
            Entry {
                source,
                proven: proven.clone(),
                task: None,
            },
        );
        Some((
            Slot {
                id,
                proven,
                owner: self.clone(),
                _permit: permit,
            },
            how,
        ))
    }

    fn unproven_from(&self, source: IpAddr) -> usize {
        let t = self.table.lock().unwrap();
        t.1.values()
            .filter(|e| e.source == source && !e.proven.load(Ordering::Relaxed))
            .count()
    }

    /// Names the task serving `slot`'s connection (what an eviction aborts).
    pub fn attach(&self, slot_id: u64, task: AbortHandle) {
        if let Some(e) = self.table.lock().unwrap().1.get_mut(&slot_id) {
            e.task = Some(task);
        }
    }

    /// Closes the oldest unproven connection (of `source` only, if named).
    fn evict_oldest_unproven(&self, source: Option<IpAddr>) -> bool {
        let mut t = self.table.lock().unwrap();
        let oldest =
            t.1.iter()
                .find(|(_, e)| {
                    !e.proven.load(Ordering::Relaxed)
                        && e.task.is_some()
                        && source.is_none_or(|s| s == e.source)
                })
                .map(|(&id, _)| id);
        match oldest.and_then(|id| t.1.remove(&id)) {
            Some(Entry {
                task: Some(task), ..
            }) => {
                task.abort();
                true
            }
            _ => false,
        }
    }

    /// Connections held now.
    pub fn len(&self) -> usize {
        self.table.lock().unwrap().1.len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

impl Slot {
    pub fn id(&self) -> u64 {
        self.id
    }

    /// The connection did what only a real peer can.
    pub fn prove(&self) {
        self.proven.store(true, Ordering::Relaxed);
    }

    pub fn is_proven(&self) -> bool {
        self.proven.load(Ordering::Relaxed)
    }
}

impl Drop for Slot {
    fn drop(&mut self) {
        self.owner.table.lock().unwrap().1.remove(&self.id);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const LOCAL: IpAddr = IpAddr::V4(std::net::Ipv4Addr::LOCALHOST);

    #[tokio::test]
    async fn at_the_cap_the_oldest_unproven_connection_gives_way_and_proven_ones_never() {
        let slots = ConnSlots::new(2, 8);
        let park = || tokio::spawn(std::future::pending::<()>());
        let (a, how) = slots.admit(LOCAL).await.unwrap();
        assert_eq!(how, Admitted::Free);
        let ta = park();
        slots.attach(a.id(), ta.abort_handle());
        let (b, _) = slots.admit(LOCAL).await.unwrap();
        let b_id = b.id();
        let tb = tokio::spawn(async move {
            let _slot = b;
            std::future::pending::<()>().await
        });
        slots.attach(b_id, tb.abort_handle());
        a.prove();
        // Full: the newcomer evicts b (unproven), never a (proven).
        let (c, how) = slots.admit(LOCAL).await.unwrap();
        assert_eq!(how, Admitted::Evicted);
        assert!(tb.await.unwrap_err().is_cancelled());
        assert!(!ta.is_finished());
        c.prove();
        // Every slot proven: refused.
        assert!(slots.admit(LOCAL).await.is_none());
        drop(c);
        assert!(slots.admit(LOCAL).await.is_some());
        ta.abort();
        drop(a);
    }

    #[tokio::test]
    async fn a_source_beyond_its_share_of_unproven_connections_closes_its_own_oldest() {
        let slots = ConnSlots::new(16, 2);
        let other = IpAddr::V4(std::net::Ipv4Addr::new(10, 0, 0, 2));
        // Each parked task holds its slot, as a served connection does.
        let park = |slot: Slot| {
            tokio::spawn(async move {
                let _slot = slot;
                std::future::pending::<()>().await
            })
        };
        let mut held = Vec::new();
        for src in [other, LOCAL, LOCAL] {
            let (slot, how) = slots.admit(src).await.unwrap();
            assert_eq!(how, Admitted::Free);
            let id = slot.id();
            let t = park(slot);
            slots.attach(id, t.abort_handle());
            held.push(t);
        }
        // LOCAL holds its share: its third closes its own oldest, not other's.
        let (third, how) = slots.admit(LOCAL).await.unwrap();
        assert_eq!(how, Admitted::EvictedOwn);
        assert!(held.remove(1).await.unwrap_err().is_cancelled());
        assert!(!held[0].is_finished() && !held[1].is_finished());
        // A proven connection does not count against its source's share.
        third.prove();
        let (fourth, how) = slots.admit(LOCAL).await.unwrap();
        assert_eq!(how, Admitted::Free);
        let id = fourth.id();
        let t = park(fourth);
        slots.attach(id, t.abort_handle());
        held.push(t);
        let (_fifth, how) = slots.admit(LOCAL).await.unwrap();
        assert_eq!(how, Admitted::EvictedOwn);
        assert!(held.remove(1).await.unwrap_err().is_cancelled());
        assert_eq!(slots.len(), 4);
        for t in held {
            t.abort();
        }
    }
}
