//! Revocable, range-restricted grants on a registration: the fence a
//! decode engine raises so that a late write into blocks it freed is
//! impossible by construction.
//!
//! A [`Grant`] is a key of its own to some byte ranges of one registration
//! (see [`crate::Registry::grant`]). An access naming the grant's key
//! succeeds only inside the *union* of its ranges (ranges are sorted and
//! merged when granted, so an access may span two adjacent ranges), and
//! only while the grant is live. Revoking it ([`crate::Registry::revoke`])
//! refuses every new access at once and then waits, bounded, until every
//! [`crate::Access`] handed out through it has been dropped: the TCP agent
//! holds its access while it copies a write's payload from the socket into
//! memory, so once `revoke` returned `Ok`, no byte can land through the
//! grant any more.
//!
//! Invariants: the table is bounded (grants and ranges, live and draining);
//! a revoked grant is forgotten once its last access ended; grants end with
//! their registration (deregistering or re-registering revokes them all);
//! waiting uses a condition variable, never polling.

use std::collections::HashMap;
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

pub use crate::error::{GrantError, RevokeError};

/// A handle to a live grant: what a peer needs (with the agent address) to
/// write or read the granted ranges. The registration's own key is not
/// part of it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
pub struct Grant {
    pub segment: u64,
    pub key: u64,
    pub epoch: u64,
}

/// Sorts and merges `ranges` (offset, len) into disjoint, non-adjacent
/// `(start, end)` pairs, each checked to be non-empty and inside
/// `registered` bytes.
pub(crate) fn normalize(
    ranges: &[(u64, u64)],
    registered: u64,
) -> Result<Vec<(u64, u64)>, GrantError> {
    if ranges.is_empty() {
        return Err(GrantError::NoRanges);
    }
    let mut spans = Vec::with_capacity(ranges.len());
    for &(offset, len) in ranges {
        match offset.checked_add(len) {
            Some(end) if len > 0 && end <= registered => spans.push((offset, end)),
            _ => {
                return Err(GrantError::BadRange {
                    offset,
                    len,
                    registered,
                })
            }
        }
    }
    spans.sort_unstable();
    let mut merged: Vec<(u64, u64)> = Vec::with_capacity(spans.len());
    for (start, end) in spans {
        match merged.last_mut() {
            Some(last) if start <= last.1 => last.1 = last.1.max(end),
            _ => merged.push((start, end)),
        }
    }
    Ok(merged)
}

/// Whether `[offset, offset+len)` lies inside one of the merged `spans`.
pub(crate) fn covers(spans: &[(u64, u64)], offset: u64, len: u64) -> bool {
    let Some(end) = offset.checked_add(len) else {
        return false;
    };
    let i = spans.partition_point(|s| s.0 <= offset);
    i > 0 && end <= spans[i - 1].1
}

/// Called with `(segment, key)` each time an access through a grant is
/// handed out. See [`crate::RegistryOptions::on_grant_use`].
#[derive(Clone)]
pub struct GrantHook(pub Arc<dyn Fn(u64, u64) + Send + Sync>);

impl std::fmt::Debug for GrantHook {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("GrantHook")
    }
}

/// One grant, shared by the table and by every access handed out through it.
pub(crate) struct GrantState {
    pub(crate) grant: Grant,
    spans: Vec<(u64, u64)>,
    /// Accesses handed out through this grant and not yet dropped.
    users: Mutex<usize>,
    idle: Condvar,
}

impl GrantState {
    pub(crate) fn new(grant: Grant, spans: Vec<(u64, u64)>) -> Arc<GrantState> {
        Arc::new(GrantState {
            grant,
            spans,
            users: Mutex::new(0),
            idle: Condvar::new(),
        })
    }

    pub(crate) fn covers(&self, offset: u64, len: u64) -> bool {
        covers(&self.spans, offset, len)
    }

    fn is_idle(&self) -> bool {
        *self.users.lock().unwrap() == 0
    }

    /// Waits until no access through this grant is held, at most `timeout`;
    /// on timeout, how many still are.
    pub(crate) fn wait_idle(&self, timeout: Duration) -> Result<(), usize> {
        let deadline = Instant::now() + timeout;
        let mut users = self.users.lock().unwrap();
        while *users > 0 {
            let now = Instant::now();
            if now >= deadline {
                return Err(*users);
            }
            users = self.idle.wait_timeout(users, deadline - now).unwrap().0;
        }
        Ok(())
    }
}

/// One access's hold on its grant: counted when made, uncounted when dropped.
pub(crate) struct GrantUse(Arc<GrantState>);

impl GrantUse {
    pub(crate) fn new(state: &Arc<GrantState>) -> GrantUse {
        *state.users.lock().unwrap() += 1;
        GrantUse(state.clone())
    }
}

impl Drop for GrantUse {
    fn drop(&mut self) {
        let mut users = self.0.users.lock().unwrap();
        // Counted once in `new`, so at least this use is there.
        *users -= 1;
        if *users == 0 {
            self.0.idle.notify_all();
        }
    }
}

struct Entry {
    state: Arc<GrantState>,
    /// Refuses new accesses; the entry stays until its last access ended.
    revoked: bool,
}

/// The grants of one registry, live and draining, bounded.
pub(crate) struct GrantTable {
    by_segment: HashMap<u64, HashMap<u64, Entry>>,
    grants: usize,
    spans: usize,
    max_grants: usize,
    max_spans: usize,
}

impl GrantTable {
    pub(crate) fn new(max_grants: usize, max_spans: usize) -> GrantTable {
        GrantTable {
            by_segment: HashMap::new(),
            grants: 0,
            spans: 0,
            max_grants,
            max_spans,
        }
    }

    pub(crate) fn contains(&self, segment: u64, key: u64) -> bool {
        self.by_segment
            .get(&segment)
            .is_some_and(|g| g.contains_key(&key))
    }

    /// Whether a grant of `spans` merged ranges fits; forgets drained
    /// revoked grants first if it would not.
    pub(crate) fn admit(&mut self, spans: usize) -> Result<(), GrantError> {
        if !self.fits(spans) {
            self.sweep();
        }
        if self.grants >= self.max_grants {
            return Err(GrantError::Full(self.max_grants));
        }
        if !self.fits(spans) {
            return Err(GrantError::TooManyRanges {
                ranges: spans,
                limit: self.max_spans,
            });
        }
        Ok(())
    }

    fn fits(&self, spans: usize) -> bool {
        self.grants < self.max_grants && self.spans.saturating_add(spans) <= self.max_spans
    }

    pub(crate) fn insert(&mut self, state: Arc<GrantState>) {
        let g = state.grant;
        self.grants += 1;
        self.spans += state.spans.len();
        self.by_segment.entry(g.segment).or_default().insert(
            g.key,
            Entry {
                state,
                revoked: false,
            },
        );
    }

    /// The live (not revoked) grant `key` of `segment` at `epoch`.
    pub(crate) fn live(&self, segment: u64, key: u64, epoch: u64) -> Option<&Arc<GrantState>> {
        let e = self.by_segment.get(&segment)?.get(&key)?;
        (!e.revoked && e.state.grant.epoch == epoch).then_some(&e.state)
    }

    /// Refuses new accesses through the grant; returns it to wait on.
    pub(crate) fn mark_revoked(&mut self, segment: u64, key: u64) -> Option<Arc<GrantState>> {
        let e = self.by_segment.get_mut(&segment)?.get_mut(&key)?;
        e.revoked = true;
        Some(e.state.clone())
    }

    /// Forgets the grant `state` names, if it is still this entry and drained.
    pub(crate) fn forget_if_drained(&mut self, state: &Arc<GrantState>) {
        let g = state.grant;
        let Some(keys) = self.by_segment.get_mut(&g.segment) else {
            return;
        };
        if keys
            .get(&g.key)
            .is_some_and(|e| Arc::ptr_eq(&e.state, state) && e.revoked && state.is_idle())
        {
            keys.remove(&g.key);
            self.grants -= 1;
            self.spans -= state.spans.len();
            if keys.is_empty() {
                self.by_segment.remove(&g.segment);
            }
        }
    }

    /// Revokes every grant of `segment` (its registration ended) and
    /// forgets those no access holds.
    pub(crate) fn retire_segment(&mut self, segment: u64) {
        let Some(keys) = self.by_segment.get_mut(&segment) else {
            return;
        };
        let states: Vec<Arc<GrantState>> = keys
            .values_mut()
            .map(|e| {
                e.revoked = true;
                e.state.clone()
            })
            .collect();
        for s in &states {
            self.forget_if_drained(s);
        }
    }

    /// Forgets every revoked grant whose accesses all ended.
    fn sweep(&mut self) {
        let drained: Vec<Arc<GrantState>> = self
            .by_segment
            .values()
            .flat_map(|keys| keys.values())
            .filter(|e| e.revoked && e.state.is_idle())
            .map(|e| e.state.clone())
            .collect();
        for s in &drained {
            self.forget_if_drained(s);
        }
    }

    /// Grants and merged ranges held now (live and draining).
    pub(crate) fn len(&self) -> (usize, usize) {
        (self.grants, self.spans)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ranges_are_checked_sorted_and_merged_and_coverage_is_their_union() {
        let spans = normalize(&[(100, 50), (0, 10), (10, 5), (140, 60), (300, 1)], 1000).unwrap();
        assert_eq!(spans, vec![(0, 15), (100, 200), (300, 301)]);
        for (off, len, want) in [
            (0, 15, true),
            (5, 10, true),
            (0, 16, false),
            (14, 2, false),
            (100, 100, true), // across the two merged ranges
            (150, 51, false),
            (15, 1, false),
            (300, 1, true),
            (299, 2, false),
            (u64::MAX, 2, false),
            (1000, 0, false),
        ] {
            assert_eq!(covers(&spans, off, len), want, "{off}+{len}");
        }
        assert!(matches!(normalize(&[], 10), Err(GrantError::NoRanges)));
        for bad in [(0, 0), (5, 6), (u64::MAX, 2), (10, 1)] {
            assert!(
                matches!(
                    normalize(&[(0, 1), bad], 10),
                    Err(GrantError::BadRange { .. })
                ),
                "{bad:?}"
            );
        }
    }

    #[test]
    fn the_table_is_bounded_and_forgets_drained_grants_to_make_room() {
        let mut t = GrantTable::new(2, 3);
        let g = |key| Grant {
            segment: 1,
            key,
            epoch: 1,
        };
        let a = GrantState::new(g(10), vec![(0, 1), (2, 3)]);
        t.admit(2).unwrap();
        t.insert(a.clone());
        assert!(matches!(
            t.admit(2),
            Err(GrantError::TooManyRanges {
                ranges: 2,
                limit: 3
            })
        ));
        t.admit(1).unwrap();
        t.insert(GrantState::new(g(11), vec![(0, 1)]));
        assert!(matches!(t.admit(1), Err(GrantError::Full(2))));
        // Revoked while an access holds it: still counted.
        let held = GrantUse::new(&a);
        assert!(t.mark_revoked(1, 10).is_some());
        assert!(t.live(1, 10, 1).is_none(), "no new access once revoked");
        assert!(matches!(t.admit(1), Err(GrantError::Full(2))));
        drop(held);
        t.admit(1).unwrap();
        assert_eq!(t.len(), (1, 1), "the drained grant was forgotten");
        t.retire_segment(1);
        assert_eq!(t.len(), (0, 0));
    }
}
