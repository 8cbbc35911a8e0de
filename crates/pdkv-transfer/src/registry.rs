//! Registered memory: the CPU analogue of an RDMA memory region.
//!
//! [`Registry::register`] takes a byte range of a [`Region`] and returns a
//! [`Registration`] handle `{segment, key, epoch, len}`. The registry keeps,
//! per registration, its *own* references to the physical chunks covering
//! the range and its *own* mapping of them. Two consequences follow, both
//! deliberate (they are what a NIC does with pinned pages):
//!
//! - while the registration lives, those pages stay allocated even if the
//!   region is released (slept or discarded);
//! - access through the registration reaches the pages it pinned, which are
//!   the *old* pages once the region has been woken with fresh ones.
//!
//! The cure is to deregister before the region releases its memory and to
//! register again after it wakes. Re-registering a range gives it the same
//! segment id and a new epoch; every access names the epoch it was granted
//! and an access with any other epoch is refused, so stale pages are never
//! served once the range has been registered again.
//!
//! Besides its own key, a registration can be reached through *grants*
//! ([`Registry::grant`], see [`crate::grant`]): keys of their own to some of
//! its ranges, revocable at any time with a bounded wait for the accesses
//! in flight ([`Registry::revoke`]), and ended with the registration.
//!
//! Invariants:
//! - every access goes through [`Registry::access`], which checks segment,
//!   epoch, key (the registration's, or a live grant's and its ranges) and
//!   bounds before handing out an [`Access`]; on error no byte is touched;
//! - an [`Access`] holds the registration alive, so memory stays mapped for
//!   as long as an operation uses it, even if it is deregistered meanwhile;
//!   the pins drop when the last access ends;
//! - the number of segments a registry remembers is bounded, and so are
//!   its grants (count and ranges, live and draining).

use std::collections::HashMap;
use std::io::Read;
use std::os::fd::RawFd;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use pdkv_vmem::{Chunk, Region};

pub use crate::error::{AccessError, RegisterError};
use crate::error::{GrantError, RevokeError};
use crate::grant::{normalize, Grant, GrantHook, GrantState, GrantTable, GrantUse};

/// A handle to a live registration; what a peer needs (with the agent
/// address) to address the memory. Copyable and cheap.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
pub struct Registration {
    pub segment: u64,
    pub key: u64,
    pub epoch: u64,
    pub len: u64,
}

impl Registration {
    /// The whole registered range, as a request addresses it.
    pub fn whole(&self) -> crate::frame::Target {
        crate::frame::Target {
            segment: self.segment,
            key: self.key,
            epoch: self.epoch,
            offset: 0,
            len: self.len,
        }
    }
}

#[derive(Clone, Debug)]
pub struct RegistryOptions {
    /// Segments remembered (live or deregistered); registering a new range
    /// beyond this fails with [`RegisterError::Full`].
    pub max_segments: usize,
    /// Seed for a deterministic key sequence (tests); `None` draws every key
    /// (registrations' and grants') from the operating system's random source.
    pub key_seed: Option<u64>,
    /// Grants held at once, live or revoked with accesses still in flight;
    /// more fail with [`GrantError::Full`].
    pub max_grants: usize,
    /// Ranges (after merging) all those grants may name together; more fail
    /// with [`GrantError::TooManyRanges`].
    pub max_grant_ranges: usize,
    /// Called with `(segment, key)` each time an access through a grant is
    /// handed out, after the registry's lock is released. A seam for
    /// deterministic tests of revocation ("the agent holds an access now");
    /// `None` in production.
    pub on_grant_use: Option<GrantHook>,
}

impl Default for RegistryOptions {
    fn default() -> Self {
        RegistryOptions {
            max_segments: 4096,
            key_seed: None,
            max_grants: 1 << 16,
            max_grant_ranges: 1 << 20,
            on_grant_use: None,
        }
    }
}

/// Registrations and shm peers map chunks through `pdkv-vmem`'s mapping.
pub(crate) use pdkv_vmem::FdMapping as Mapping;

/// The pages and the private mapping of one registration.
pub(crate) struct Pinned {
    pub(crate) reg: Registration,
    mapping: Mapping,
    /// Where byte 0 of the registered range lies in our mapping.
    skew: usize,
    /// The chunks this registration keeps alive (dropped after `mapping`).
    chunks: Vec<Arc<Chunk>>,
}

impl Pinned {
    fn map(reg: Registration, region: &Region, offset: usize) -> Result<Pinned, RegisterError> {
        let end = offset + reg.len as usize;
        let covering: Vec<_> = region
            .chunks()
            .into_iter()
            .filter(|m| m.offset < end && m.offset + m.chunk.len() > offset)
            .collect();
        let (first, last) = match (covering.first(), covering.last()) {
            (Some(f), Some(l)) => (f.offset, l.offset + l.chunk.len()),
            _ => return Err(RegisterError::NotMapped),
        };
        if first > offset || last < end {
            return Err(RegisterError::NotMapped);
        }
        let parts: Vec<(RawFd, usize)> = covering
            .iter()
            .map(|m| (m.chunk.raw_fd(), m.chunk.len()))
            .collect();
        let mapping = Mapping::map(&parts).map_err(|source| RegisterError::Os {
            op: "mmap(registration)",
            source,
        })?;
        Ok(Pinned {
            reg,
            mapping,
            skew: offset - first,
            chunks: covering.into_iter().map(|m| m.chunk).collect(),
        })
    }

    fn data(&self) -> *mut u8 {
        // SAFETY: skew < mapping length.
        unsafe { self.mapping.base().add(self.skew) }
    }

    /// The memfds under this registration, their lengths, and where byte 0
    /// of the registration lies in them laid end to end.
    pub(crate) fn layout(&self) -> (Vec<(RawFd, usize)>, usize) {
        (
            self.chunks.iter().map(|c| (c.raw_fd(), c.len())).collect(),
            self.skew,
        )
    }
}

/// A checked grant to a byte range of a live registration. Holding it keeps
/// the registration's pages mapped, and, if it came through a [`Grant`],
/// keeps that grant's revocation waiting.
pub struct Access {
    pinned: Arc<Pinned>,
    offset: usize,
    len: usize,
    /// The grant it came through, if any (dropped with the access).
    _grant: Option<GrantUse>,
}

impl Access {
    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    pub fn registration(&self) -> Registration {
        self.pinned.reg
    }

    pub(crate) fn pinned(&self) -> &Arc<Pinned> {
        &self.pinned
    }

    /// Copies `src` (exactly `len` bytes) into the granted range.
    pub fn write_from(&self, src: &[u8]) {
        assert_eq!(
            src.len(),
            self.len,
            "write_from: length differs from the grant"
        );
        // SAFETY: checked against the registration when granted; the mapping
        // lives as long as `pinned`.
        unsafe { std::ptr::copy_nonoverlapping(src.as_ptr(), self.ptr(), self.len) };
    }

    /// Copies the granted range out into `dst` (exactly `len` bytes).
    pub fn read_into(&self, dst: &mut [u8]) {
        assert_eq!(
            dst.len(),
            self.len,
            "read_into: length differs from the grant"
        );
        // SAFETY: as in `write_from`.
        unsafe { std::ptr::copy_nonoverlapping(self.ptr(), dst.as_mut_ptr(), self.len) };
    }

    fn ptr(&self) -> *mut u8 {
        // SAFETY: offset + len <= registration length, checked when granted.
        unsafe { self.pinned.data().add(self.offset) }
    }

    /// The granted bytes, for I/O straight from registered memory.
    ///
    /// # Safety
    /// No one may write the range while the slice lives (the transfer
    /// protocol must not schedule a write and a read of one range at once).
    pub unsafe fn as_slice(&self) -> &[u8] {
        // SAFETY: `ptr()..+len` lies inside the registration (checked when
        // the access was granted) and stays mapped while `pinned` lives, as
        // long as the returned borrow of `self`; that no one writes it
        // meanwhile is the caller's promise (see # Safety).
        unsafe { std::slice::from_raw_parts(self.ptr(), self.len) }
    }

    /// The granted bytes, for I/O straight into registered memory.
    ///
    /// # Safety
    /// No other view of the range may exist while the slice lives.
    #[allow(clippy::mut_from_ref)]
    pub unsafe fn as_mut_slice(&self) -> &mut [u8] {
        // SAFETY: in bounds and mapped as in `as_slice`; that no other view
        // of the range exists meanwhile is the caller's promise.
        unsafe { std::slice::from_raw_parts_mut(self.ptr(), self.len) }
    }
}

struct Slot {
    /// The current (or last) epoch of this segment.
    epoch: u64,
    live: Option<Arc<Pinned>>,
}

struct Inner {
    slots: HashMap<u64, Slot>,
    by_range: HashMap<(usize, usize, usize), u64>,
    next_segment: u64,
    keys: KeySource,
    grants: GrantTable,
}

impl Inner {
    /// The live registration of `segment` if `epoch` is its current one:
    /// the checks every access starts with, in order.
    fn current(&self, segment: u64, epoch: u64) -> Result<&Arc<Pinned>, AccessError> {
        let slot = self
            .slots
            .get(&segment)
            .ok_or(AccessError::UnknownSegment { segment })?;
        let Some(pinned) = slot.live.as_ref() else {
            if epoch < slot.epoch {
                return Err(AccessError::StaleEpoch {
                    have: epoch,
                    want: slot.epoch,
                });
            }
            return Err(AccessError::NotRegistered { segment });
        };
        if epoch != slot.epoch {
            return Err(AccessError::StaleEpoch {
                have: epoch,
                want: slot.epoch,
            });
        }
        Ok(pinned)
    }
}

/// All registrations of one agent.
pub struct Registry {
    opts: RegistryOptions,
    inner: Mutex<Inner>,
    /// Registrations that succeed before one fails ([`Registry::fail_register_after`]).
    fault: Mutex<Option<usize>>,
}

impl Registry {
    pub fn new(opts: RegistryOptions) -> Registry {
        let keys = match opts.key_seed {
            Some(seed) => KeySource::Seeded(seed),
            None => KeySource::Os,
        };
        let grants = GrantTable::new(opts.max_grants, opts.max_grant_ranges);
        Registry {
            opts,
            inner: Mutex::new(Inner {
                slots: HashMap::new(),
                by_range: HashMap::new(),
                next_segment: 1,
                keys,
                grants,
            }),
            fault: Mutex::new(None),
        }
    }

    /// Makes the registration after the next `n` fail with
    /// [`RegisterError::Injected`] (once), for tests and simulations of a
    /// registration that fails part of the way through an engine's ranks.
    pub fn fail_register_after(&self, n: usize) {
        *self.fault.lock().unwrap() = Some(n);
    }

    /// Registers `[offset, offset+len)` of `region`. The same range registered
    /// again (live or not) keeps its segment id and gets the next epoch and a
    /// fresh key; a live older registration of it is dropped.
    pub fn register(
        &self,
        region: &Arc<Region>,
        offset: usize,
        len: usize,
    ) -> Result<Registration, RegisterError> {
        {
            let mut f = self.fault.lock().unwrap();
            match *f {
                Some(0) => {
                    *f = None;
                    return Err(RegisterError::Injected);
                }
                Some(n) => *f = Some(n - 1),
                None => {}
            }
        }
        let bad = || RegisterError::BadRange {
            offset,
            len,
            region_len: region.len(),
        };
        if len == 0 || offset.checked_add(len).is_none_or(|e| e > region.len()) {
            return Err(bad());
        }
        // Private memory has no descriptor a peer could map.
        if region.backing() == pdkv_vmem::Backing::Private {
            return Err(RegisterError::Private);
        }
        let range = (region.base() as usize, offset, len);
        let mut inner = self.inner.lock().unwrap();
        let (segment, epoch) = match inner.by_range.get(&range) {
            Some(&seg) => (seg, inner.slots[&seg].epoch + 1),
            None => {
                if inner.slots.len() >= self.opts.max_segments {
                    return Err(RegisterError::Full(self.opts.max_segments));
                }
                let seg = inner.next_segment;
                (seg, 1)
            }
        };
        let key = inner.keys.next().map_err(|source| RegisterError::Os {
            op: "read /dev/urandom",
            source,
        })?;
        let reg = Registration {
            segment,
            key,
            epoch,
            len: len as u64,
        };
        let pinned = Arc::new(Pinned::map(reg, region, offset)?);
        if segment == inner.next_segment {
            inner.next_segment += 1;
            inner.by_range.insert(range, segment);
        }
        let old = inner.slots.insert(
            segment,
            Slot {
                epoch,
                live: Some(pinned),
            },
        );
        inner.grants.retire_segment(segment); // the older epoch's grants end with it
        drop(inner);
        drop(old); // an older live registration of the range: its pins go now (or when its last access ends)
        tracing::debug!(segment, epoch, len, "registered");
        Ok(reg)
    }

    /// Drops the registration of `segment` and revokes its grants (without
    /// waiting: [`Registry::revoke`] still waits for a grant's accesses in
    /// flight); its pages are unpinned once the accesses in flight end.
    /// Returns whether one was live.
    pub fn deregister(&self, segment: u64) -> bool {
        let mut inner = self.inner.lock().unwrap();
        let old = inner.slots.get_mut(&segment).and_then(|s| s.live.take());
        inner.grants.retire_segment(segment);
        drop(inner);
        let was = old.is_some();
        drop(old);
        if was {
            tracing::debug!(segment, "deregistered");
        }
        was
    }

    /// Forgets a deregistered segment altogether (frees its slot). A later
    /// registration of the same range starts a new segment.
    pub fn forget(&self, segment: u64) -> bool {
        let mut inner = self.inner.lock().unwrap();
        match inner.slots.get(&segment) {
            Some(s) if s.live.is_none() => {
                inner.slots.remove(&segment);
                inner.by_range.retain(|_, v| *v != segment);
                true
            }
            _ => false,
        }
    }

    /// The live registration of `segment`, if any.
    pub fn get(&self, segment: u64) -> Option<Registration> {
        let inner = self.inner.lock().unwrap();
        inner.slots.get(&segment)?.live.as_ref().map(|p| p.reg)
    }

    /// Every live registration.
    pub fn live(&self) -> Vec<Registration> {
        let inner = self.inner.lock().unwrap();
        inner
            .slots
            .values()
            .filter_map(|s| s.live.as_ref().map(|p| p.reg))
            .collect()
    }

    /// Checks an access against the live registration of `segment` and
    /// grants it. The checks, in order: the segment is known, it is
    /// registered now, the epoch is its current one, the key is the
    /// registration's (then `offset+len` must lie inside it) or a live
    /// grant's of it (then inside the registration, `OutOfBounds` otherwise,
    /// and inside the union of the grant's ranges, `OutsideGrant`
    /// otherwise). Any other key, a revoked grant's included, is `BadKey`.
    pub fn access(
        &self,
        segment: u64,
        key: u64,
        epoch: u64,
        offset: u64,
        len: u64,
    ) -> Result<Access, AccessError> {
        let inner = self.inner.lock().unwrap();
        let pinned = inner.current(segment, epoch)?;
        let registered = pinned.reg.len;
        let grant = match key == pinned.reg.key {
            true => None,
            false => Some(
                inner
                    .grants
                    .live(segment, key, epoch)
                    .ok_or(AccessError::BadKey { segment })?,
            ),
        };
        if offset.checked_add(len).is_none_or(|end| end > registered) {
            return Err(AccessError::OutOfBounds {
                offset,
                len,
                registered,
            });
        }
        if grant.is_some_and(|g| !g.covers(offset, len)) {
            return Err(AccessError::OutsideGrant {
                segment,
                offset,
                len,
            });
        }
        let access = Access {
            pinned: pinned.clone(),
            offset: offset as usize,
            len: len as usize,
            _grant: grant.map(GrantUse::new),
        };
        drop(inner);
        if let (Some(hook), true) = (&self.opts.on_grant_use, access._grant.is_some()) {
            (hook.0)(segment, key);
        }
        Ok(access)
    }

    /// Grants the whole live registration of `segment` to the holder of its
    /// own key (not a grant's): what sharing its memory with a peer needs.
    pub fn access_whole(&self, segment: u64, key: u64, epoch: u64) -> Result<Access, AccessError> {
        let inner = self.inner.lock().unwrap();
        let pinned = inner.current(segment, epoch)?;
        if key != pinned.reg.key {
            return Err(AccessError::BadKey { segment });
        }
        Ok(Access {
            pinned: pinned.clone(),
            offset: 0,
            len: pinned.reg.len as usize,
            _grant: None,
        })
    }

    /// Makes a grant: a key of its own to `ranges` (offset, len) of the live
    /// registration `reg`, accepted by [`Registry::access`] for ranges
    /// inside their union (see [`crate::grant`]). Every range must be
    /// non-empty and inside the registration. The grant ends when revoked
    /// or when the registration does (deregistered or registered again).
    pub fn grant(&self, reg: &Registration, ranges: &[(u64, u64)]) -> Result<Grant, GrantError> {
        let mut inner = self.inner.lock().unwrap();
        let pinned = inner.current(reg.segment, reg.epoch)?;
        if reg.key != pinned.reg.key {
            return Err(AccessError::BadKey {
                segment: reg.segment,
            }
            .into());
        }
        let spans = normalize(ranges, pinned.reg.len)?;
        inner.grants.admit(spans.len())?;
        let key = loop {
            let key = inner.keys.next().map_err(|source| GrantError::Os {
                op: "read /dev/urandom",
                source,
            })?;
            if key != reg.key && !inner.grants.contains(reg.segment, key) {
                break key;
            }
        };
        let grant = Grant {
            segment: reg.segment,
            key,
            epoch: reg.epoch,
        };
        inner.grants.insert(GrantState::new(grant, spans));
        drop(inner);
        tracing::debug!(
            segment = grant.segment,
            epoch = grant.epoch,
            ranges = ranges.len(),
            "granted"
        );
        Ok(grant)
    }

    /// Revokes the grant `key` of `segment`. From the moment this returns,
    /// `Ok` or not, no new access through it succeeds; then it waits, at
    /// most `timeout`, until every [`Access`] handed out through it has been
    /// dropped, and `Ok` means no byte can land through the grant any more.
    /// [`RevokeError::InUse`] names how many accesses outlived the wait;
    /// revoking again waits for them again. Idempotent: an unknown grant, or
    /// one revoked and drained already, is `Ok` at once.
    pub fn revoke(&self, segment: u64, key: u64, timeout: Duration) -> Result<(), RevokeError> {
        let Some(state) = self.inner.lock().unwrap().grants.mark_revoked(segment, key) else {
            return Ok(());
        };
        // The registry's lock is not held while waiting: accesses go on.
        state
            .wait_idle(timeout)
            .map_err(|accesses| RevokeError::InUse {
                segment,
                key,
                accesses,
            })?;
        self.inner.lock().unwrap().grants.forget_if_drained(&state);
        tracing::debug!(segment, "grant revoked");
        Ok(())
    }

    /// Grants held now (live, or revoked with accesses in flight) and the
    /// merged ranges they name.
    pub fn grants(&self) -> (usize, usize) {
        self.inner.lock().unwrap().grants.len()
    }

    /// How many memfds (chunks) the live registration of `segment` spans.
    pub fn chunk_count(&self, segment: u64) -> Option<usize> {
        let inner = self.inner.lock().unwrap();
        inner
            .slots
            .get(&segment)?
            .live
            .as_ref()
            .map(|p| p.chunks.len())
    }

    /// Grants access to a local registration by its handle.
    pub fn local(&self, reg: &Registration, offset: u64, len: u64) -> Result<Access, AccessError> {
        self.access(reg.segment, reg.key, reg.epoch, offset, len)
    }
}

/// Where registration keys come from.
enum KeySource {
    /// Each key read from the operating system's random source.
    Os,
    /// A deterministic sequence (splitmix64), for tests.
    Seeded(u64),
}

impl KeySource {
    fn next(&mut self) -> std::io::Result<u64> {
        match self {
            KeySource::Os => {
                let mut b = [0u8; 8];
                std::fs::File::open("/dev/urandom").and_then(|mut f| f.read_exact(&mut b))?;
                Ok(u64::from_le_bytes(b))
            }
            KeySource::Seeded(state) => Ok(splitmix64(state)),
        }
    }
}

/// One step of splitmix64: a small, well-mixed deterministic generator.
pub(crate) fn splitmix64(state: &mut u64) -> u64 {
    *state = state.wrapping_add(0x9E37_79B9_7F4A_7C15);
    let mut z = *state;
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

#[cfg(test)]
mod tests {
    use super::*;
    use pdkv_vmem::{Pool, PoolOptions, Tag};

    fn pool() -> Pool {
        Pool::new(PoolOptions {
            chunk_size: 64 << 10,
            single_allocation: false,
        })
    }

    fn registry() -> Registry {
        Registry::new(RegistryOptions {
            max_segments: 8,
            key_seed: Some(7),
            ..Default::default()
        })
    }

    fn pattern(len: usize, seed: u8) -> Vec<u8> {
        (0..len)
            .map(|i| (i as u8).wrapping_mul(13).wrapping_add(seed))
            .collect()
    }

    #[test]
    fn access_reaches_the_region_bytes_across_chunks() {
        let pool = pool();
        let region = pool.allocate(Tag::KvCache, 256 << 10).unwrap();
        let reg_ = registry();
        // A range that starts and ends mid-chunk and spans three chunks.
        let (off, len) = ((64 << 10) - 100, (128 << 10) + 200);
        let r = reg_.register(&region, off, len).unwrap();
        assert_eq!((r.segment, r.epoch, r.len), (1, 1, len as u64));

        let data = pattern(len, 3);
        region.write_bytes(off, &data).unwrap();
        let mut back = vec![0; len];
        reg_.local(&r, 0, len as u64).unwrap().read_into(&mut back);
        assert!(back == data, "registration sees the region's bytes");

        reg_.local(&r, 10, 5).unwrap().write_from(&[9; 5]);
        let mut five = [0; 5];
        region.read_bytes(off + 10, &mut five).unwrap();
        assert_eq!(
            five, [9; 5],
            "the region sees writes through the registration"
        );
    }

    #[test]
    fn every_check_refuses_with_its_reason() {
        let pool = pool();
        let region = pool.allocate(Tag::KvCache, 64 << 10).unwrap();
        let reg_ = registry();
        let r = reg_.register(&region, 0, 4096).unwrap();
        let cases = [
            (
                r.segment + 1,
                r.key,
                r.epoch,
                0,
                1,
                AccessError::UnknownSegment {
                    segment: r.segment + 1,
                },
            ),
            (
                r.segment,
                r.key ^ 1,
                r.epoch,
                0,
                1,
                AccessError::BadKey { segment: r.segment },
            ),
            (
                r.segment,
                r.key,
                r.epoch + 1,
                0,
                1,
                AccessError::StaleEpoch { have: 2, want: 1 },
            ),
            (
                r.segment,
                r.key,
                r.epoch,
                4000,
                97,
                AccessError::OutOfBounds {
                    offset: 4000,
                    len: 97,
                    registered: 4096,
                },
            ),
            (
                r.segment,
                r.key,
                r.epoch,
                u64::MAX,
                2,
                AccessError::OutOfBounds {
                    offset: u64::MAX,
                    len: 2,
                    registered: 4096,
                },
            ),
        ];
        for (seg, key, epoch, off, len, want) in cases {
            assert_eq!(reg_.access(seg, key, epoch, off, len).err(), Some(want));
        }
        assert!(reg_.access(r.segment, r.key, r.epoch, 4000, 96).is_ok());
        assert!(reg_.deregister(r.segment));
        assert_eq!(
            reg_.access(r.segment, r.key, r.epoch, 0, 1).err(),
            Some(AccessError::NotRegistered { segment: r.segment })
        );
    }

    #[test]
    fn sleeping_under_a_registration_reaches_old_pages_and_reregistering_refuses_the_old_epoch() {
        let pool = pool();
        let region = pool.allocate(Tag::KvCache, 128 << 10).unwrap();
        let reg_ = registry();
        let old_bytes = pattern(region.len(), 1);
        region.write_bytes(0, &old_bytes).unwrap();
        let old = reg_.register(&region, 0, region.len()).unwrap();

        // Sleep and wake: the region gets fresh pages, then new contents.
        pool.discard(&[Tag::KvCache]).unwrap();
        pool.wake(&[Tag::KvCache]).unwrap();
        let new_bytes = pattern(region.len(), 2);
        region.write_bytes(0, &new_bytes).unwrap();

        // The seeds' bug, reproduced: the old registration still serves the old pages.
        let mut back = vec![0; region.len()];
        reg_.local(&old, 0, back.len() as u64)
            .unwrap()
            .read_into(&mut back);
        assert!(
            back == old_bytes,
            "a registration pins and reaches the old pages"
        );

        // The fix: re-register; the old epoch is refused, never served.
        let new = reg_.register(&region, 0, region.len()).unwrap();
        assert_eq!((new.segment, new.epoch), (old.segment, old.epoch + 1));
        assert_ne!(new.key, old.key);
        assert_eq!(
            reg_.local(&old, 0, 1).err(),
            Some(AccessError::StaleEpoch {
                have: old.epoch,
                want: new.epoch
            })
        );
        reg_.local(&new, 0, back.len() as u64)
            .unwrap()
            .read_into(&mut back);
        assert!(
            back == new_bytes,
            "the new registration reaches the new pages"
        );

        // After deregistration too, the old epoch is named as stale.
        reg_.deregister(new.segment);
        assert_eq!(
            reg_.local(&old, 0, 1).err(),
            Some(AccessError::StaleEpoch {
                have: old.epoch,
                want: new.epoch
            })
        );
    }

    #[test]
    fn an_access_in_flight_keeps_pages_after_deregistration() {
        let pool = pool();
        let region = pool.allocate(Tag::KvCache, 64 << 10).unwrap();
        let reg_ = registry();
        let data = pattern(region.len(), 5);
        region.write_bytes(0, &data).unwrap();
        let r = reg_.register(&region, 0, region.len()).unwrap();
        let grant = reg_.local(&r, 0, region.len() as u64).unwrap();
        let chunk = region.chunks()[0].chunk.clone();
        pool.discard(&[Tag::KvCache]).unwrap();
        reg_.deregister(r.segment);
        let mut back = vec![0; data.len()];
        grant.read_into(&mut back);
        assert!(back == data, "the grant finishes on the pinned pages");
        assert_eq!(
            Arc::strong_count(&chunk),
            2,
            "pinned by the grant and by this test"
        );
        drop(grant);
        assert_eq!(Arc::strong_count(&chunk), 1, "the last grant unpinned it");
    }

    use crate::grant::{Grant, GrantError, RevokeError};
    use std::time::{Duration, Instant};

    const DL: Duration = Duration::from_secs(10);

    #[test]
    fn a_grant_opens_exactly_its_ranges_and_the_registrations_key_keeps_working() {
        let pool = pool();
        let region = pool.allocate(Tag::KvCache, 64 << 10).unwrap();
        let reg_ = registry();
        let r = reg_.register(&region, 4096, 32 << 10).unwrap();
        let g = reg_
            .grant(&r, &[(8192, 4096), (0, 100), (12288, 100)])
            .unwrap();
        assert_eq!((g.segment, g.epoch), (r.segment, r.epoch));
        assert_ne!(g.key, r.key);
        let through = |off, len| reg_.access(g.segment, g.key, g.epoch, off, len).map(|_| ());
        assert_eq!(through(0, 100), Ok(()));
        assert_eq!(
            through(8192, 4196),
            Ok(()),
            "two adjacent ranges: their union"
        );
        assert_eq!(
            through(50, 51),
            Err(AccessError::OutsideGrant {
                segment: r.segment,
                offset: 50,
                len: 51
            })
        );
        assert_eq!(
            through(4096, 1),
            Err(AccessError::OutsideGrant {
                segment: r.segment,
                offset: 4096,
                len: 1
            })
        );
        assert_eq!(
            through(12288, 101),
            Err(AccessError::OutsideGrant {
                segment: r.segment,
                offset: 12288,
                len: 101
            })
        );
        assert_eq!(
            through(32 << 10, 1),
            Err(AccessError::OutOfBounds {
                offset: 32 << 10,
                len: 1,
                registered: 32 << 10
            })
        );
        assert_eq!(
            reg_.access(g.segment, g.key, g.epoch + 1, 0, 1).err(),
            Some(AccessError::StaleEpoch {
                have: g.epoch + 1,
                want: g.epoch
            })
        );
        // Writes through the grant land in the region, at the registration's offsets.
        reg_.access(g.segment, g.key, g.epoch, 8192, 4)
            .unwrap()
            .write_from(&[1, 2, 3, 4]);
        let mut b = [0; 4];
        region.read_bytes(4096 + 8192, &mut b).unwrap();
        assert_eq!(b, [1, 2, 3, 4]);
        assert!(
            reg_.access(r.segment, r.key, r.epoch, 0, 32 << 10).is_ok(),
            "the registration's key reaches it all"
        );
        assert!(
            matches!(
                reg_.access_whole(r.segment, g.key, g.epoch),
                Err(AccessError::BadKey { .. })
            ),
            "a grant never opens it whole"
        );

        // Refused grants.
        assert!(matches!(reg_.grant(&r, &[]), Err(GrantError::NoRanges)));
        assert!(
            matches!(reg_.grant(&r, &[(0, 1), (32 << 10, 1)]), Err(GrantError::BadRange { offset, .. }) if offset == 32 << 10)
        );
        assert!(matches!(
            reg_.grant(&r, &[(5, 0)]),
            Err(GrantError::BadRange { .. })
        ));
        let wrong_key = Registration {
            key: r.key ^ 1,
            ..r
        };
        assert!(matches!(
            reg_.grant(&wrong_key, &[(0, 1)]),
            Err(GrantError::Access(AccessError::BadKey { .. }))
        ));
        let as_grant = Registration { key: g.key, ..r };
        assert!(
            matches!(
                reg_.grant(&as_grant, &[(0, 1)]),
                Err(GrantError::Access(AccessError::BadKey { .. }))
            ),
            "no grant of a grant"
        );
        assert_eq!(
            reg_.grants(),
            (1, 2),
            "three ranges, two of them adjacent: two after merging"
        );
    }

    #[test]
    fn revoke_refuses_at_once_and_waits_for_the_access_in_flight() {
        let pool = pool();
        let region = pool.allocate(Tag::KvCache, 64 << 10).unwrap();
        let reg_ = Arc::new(registry());
        let r = reg_.register(&region, 0, 64 << 10).unwrap();
        let g = reg_.grant(&r, &[(0, 4096)]).unwrap();
        // Another thread holds an access through the grant until told to drop it.
        // Each channel carries one message, once: unbounded, they hold at most one.
        let (take, taken) = std::sync::mpsc::channel();
        let (release, released) = std::sync::mpsc::channel::<()>();
        let dropped = Arc::new(std::sync::atomic::AtomicBool::new(false));
        let holder = {
            let (reg_, dropped) = (reg_.clone(), dropped.clone());
            std::thread::spawn(move || {
                let a = reg_.access(g.segment, g.key, g.epoch, 0, 4096).unwrap();
                take.send(()).unwrap();
                released
                    .recv_timeout(DL)
                    .expect("the test releases the access");
                dropped.store(true, std::sync::atomic::Ordering::SeqCst);
                drop(a);
            })
        };
        taken.recv_timeout(DL).unwrap();

        let t0 = Instant::now();
        let held = reg_.revoke(g.segment, g.key, Duration::from_millis(50));
        assert_eq!(
            held,
            Err(RevokeError::InUse {
                segment: g.segment,
                key: g.key,
                accesses: 1
            })
        );
        assert!(
            t0.elapsed() >= Duration::from_millis(50),
            "it waited its timeout"
        );
        assert_eq!(
            reg_.access(g.segment, g.key, g.epoch, 0, 1).err(),
            Some(AccessError::BadKey { segment: g.segment }),
            "refused even so"
        );
        assert_eq!(
            reg_.grants(),
            (1, 1),
            "remembered while an access is in flight"
        );

        // Revoking again waits for that access, and returns once it is dropped.
        let revoker = {
            let (reg_, dropped) = (reg_.clone(), dropped.clone());
            std::thread::spawn(move || {
                let res = reg_.revoke(g.segment, g.key, DL);
                (
                    res,
                    dropped.load(std::sync::atomic::Ordering::SeqCst),
                    Instant::now(),
                )
            })
        };
        let t1 = Instant::now();
        release.send(()).unwrap();
        holder.join().unwrap();
        let (res, was_dropped, at) = revoker.join().unwrap();
        assert_eq!(res, Ok(()));
        assert!(
            was_dropped,
            "revoke returned only after the access was dropped"
        );
        assert!(
            at.duration_since(t1) < DL,
            "woken by the drop, not by its deadline"
        );
        assert_eq!(reg_.grants(), (0, 0), "a drained grant is forgotten");
        assert_eq!(
            reg_.revoke(g.segment, g.key, Duration::ZERO),
            Ok(()),
            "idempotent"
        );
        assert_eq!(
            reg_.revoke(g.segment, 12345, Duration::ZERO),
            Ok(()),
            "an unknown grant"
        );
        assert!(
            reg_.access(r.segment, r.key, r.epoch, 0, 1).is_ok(),
            "the registration is untouched"
        );
    }

    #[test]
    fn grants_end_with_their_registration() {
        let pool = pool();
        let region = pool.allocate(Tag::KvCache, 64 << 10).unwrap();
        let reg_ = registry();
        let r = reg_.register(&region, 0, 64 << 10).unwrap();
        let g = reg_.grant(&r, &[(0, 4096)]).unwrap();
        let again = reg_.register(&region, 0, 64 << 10).unwrap();
        assert_eq!(reg_.grants(), (0, 0));
        assert_eq!(
            reg_.access(g.segment, g.key, again.epoch, 0, 1).err(),
            Some(AccessError::BadKey { segment: g.segment })
        );
        assert_eq!(
            reg_.access(g.segment, g.key, g.epoch, 0, 1).err(),
            Some(AccessError::StaleEpoch {
                have: g.epoch,
                want: again.epoch
            })
        );
        assert!(matches!(
            reg_.grant(&r, &[(0, 1)]),
            Err(GrantError::Access(AccessError::StaleEpoch { .. }))
        ));

        // Deregistered under an access in flight: the grant drains, and
        // revoke still waits for it.
        let g2 = reg_.grant(&again, &[(0, 4096)]).unwrap();
        let a = reg_.access(g2.segment, g2.key, g2.epoch, 0, 4096).unwrap();
        assert!(reg_.deregister(again.segment));
        assert_eq!(
            reg_.access(g2.segment, g2.key, g2.epoch, 0, 1).err(),
            Some(AccessError::NotRegistered {
                segment: g2.segment
            })
        );
        assert_eq!(reg_.grants(), (1, 1));
        assert_eq!(
            reg_.revoke(g2.segment, g2.key, Duration::ZERO),
            Err(RevokeError::InUse {
                segment: g2.segment,
                key: g2.key,
                accesses: 1
            })
        );
        drop(a);
        assert_eq!(reg_.revoke(g2.segment, g2.key, Duration::ZERO), Ok(()));
        assert_eq!(reg_.grants(), (0, 0));
    }

    #[test]
    fn the_grant_table_is_bounded_and_revoking_makes_room() {
        let pool = pool();
        let region = pool.allocate(Tag::KvCache, 64 << 10).unwrap();
        let reg_ = Registry::new(RegistryOptions {
            key_seed: Some(8),
            max_grants: 3,
            max_grant_ranges: 10,
            ..Default::default()
        });
        let r = reg_.register(&region, 0, 64 << 10).unwrap();
        let gs: Vec<Grant> = (0..3)
            .map(|i| reg_.grant(&r, &[(i * 4096, 4096)]).unwrap())
            .collect();
        assert!(matches!(
            reg_.grant(&r, &[(0, 1)]),
            Err(GrantError::Full(3))
        ));
        reg_.revoke(gs[0].segment, gs[0].key, DL).unwrap();
        let wide: Vec<(u64, u64)> = (0..9).map(|i| (i * 100, 10)).collect();
        assert!(
            matches!(
                reg_.grant(&r, &wide),
                Err(GrantError::TooManyRanges {
                    ranges: 9,
                    limit: 10
                })
            ),
            "2 held + 9 > 10"
        );
        // Adjacent ranges merge and count once.
        let touching: Vec<(u64, u64)> = (0..8).map(|i| (i * 10, 10)).collect();
        let g = reg_.grant(&r, &touching).unwrap();
        assert_eq!(reg_.grants(), (3, 3));
        assert!(reg_.access(g.segment, g.key, g.epoch, 0, 80).is_ok());
        let mut keys: Vec<u64> = gs.iter().map(|g| g.key).chain([g.key, r.key]).collect();
        keys.sort_unstable();
        keys.dedup();
        assert_eq!(keys.len(), 5, "every key distinct");
    }

    #[test]
    fn bad_registrations_are_refused_and_the_registry_is_bounded() {
        let pool = pool();
        let region = pool.allocate(Tag::KvCache, 64 << 10).unwrap();
        let reg_ = registry();
        assert!(matches!(
            reg_.register(&region, 0, 0),
            Err(RegisterError::BadRange { .. })
        ));
        assert!(matches!(
            reg_.register(&region, 1, region.len()),
            Err(RegisterError::BadRange { .. })
        ));
        assert!(matches!(
            reg_.register(&region, usize::MAX, 2),
            Err(RegisterError::BadRange { .. })
        ));
        for i in 0..8 {
            reg_.register(&region, i * 4096, 4096).unwrap();
        }
        assert!(matches!(
            reg_.register(&region, 8 * 4096, 4096),
            Err(RegisterError::Full(8))
        ));
        // Re-registering a known range still works when full.
        assert_eq!(reg_.register(&region, 0, 4096).unwrap().epoch, 2);
        assert!(reg_.deregister(1) && reg_.forget(1));
        assert!(reg_.register(&region, 8 * 4096, 4096).is_ok());
        pool.discard(&[Tag::KvCache]).unwrap();
        assert!(matches!(
            reg_.register(&region, 4096, 4096),
            Err(RegisterError::NotMapped)
        ));
        // Private memory: refused, however full the registry is.
        let private = pool
            .allocate_backed(Tag::Weights, 64 << 10, pdkv_vmem::Backing::Private)
            .unwrap();
        let e = reg_.register(&private, 0, 4096).unwrap_err();
        assert!(matches!(e, RegisterError::Private), "{e}");
    }
}
