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
//! Invariants:
//! - every access goes through [`Registry::access`], which checks segment,
//!   epoch, key and bounds before handing out an [`Access`]; on error no
//!   byte is touched;
//! - an [`Access`] holds the registration alive, so memory stays mapped for
//!   as long as an operation uses it, even if it is deregistered meanwhile;
//!   the pins drop when the last access ends;
//! - the number of segments a registry remembers is bounded.

use std::collections::HashMap;
use std::io::Read;
use std::os::fd::RawFd;
use std::sync::{Arc, Mutex};

use pdkv_vmem::{Chunk, Region};

/// A handle to a live registration; what a peer needs (with the agent
/// address) to address the memory. Copyable and cheap.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
pub struct Registration {
    pub segment: u64,
    pub key: u64,
    pub epoch: u64,
    pub len: u64,
}

/// Why a remote access was refused. The memory is never touched when one
/// of these is returned.
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
pub enum AccessError {
    #[error("unknown segment {segment}")]
    UnknownSegment { segment: u64 },
    #[error("segment {segment} is not registered now")]
    NotRegistered { segment: u64 },
    #[error("wrong key for segment {segment}")]
    BadKey { segment: u64 },
    #[error("stale epoch: access names epoch {have}, the registration is at epoch {want}")]
    StaleEpoch { have: u64, want: u64 },
    #[error("range {offset}+{len} is outside the registration of {registered} bytes")]
    OutOfBounds { offset: u64, len: u64, registered: u64 },
}

/// Why a registration could not be made.
#[derive(Debug, thiserror::Error)]
pub enum RegisterError {
    #[error("range {offset}+{len} is empty or outside the region of {region_len} bytes")]
    BadRange { offset: usize, len: usize, region_len: usize },
    #[error("the region is released (asleep); nothing to register")]
    NotMapped,
    #[error("registry full: {0} segments")]
    Full(usize),
    #[error("{op} failed: {source}")]
    Os {
        op: &'static str,
        #[source]
        source: std::io::Error,
    },
}

#[derive(Clone, Debug)]
pub struct RegistryOptions {
    /// Segments remembered (live or deregistered); registering a new range
    /// beyond this fails with [`RegisterError::Full`].
    pub max_segments: usize,
    /// Seed for a deterministic key sequence (tests); `None` draws every key
    /// from the operating system's random source.
    pub key_seed: Option<u64>,
}

impl Default for RegistryOptions {
    fn default() -> Self {
        RegistryOptions { max_segments: 4096, key_seed: None }
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
        let parts: Vec<(RawFd, usize)> = covering.iter().map(|m| (m.chunk.raw_fd(), m.chunk.len())).collect();
        let mapping = Mapping::map(&parts).map_err(|source| RegisterError::Os { op: "mmap(registration)", source })?;
        Ok(Pinned { reg, mapping, skew: offset - first, chunks: covering.into_iter().map(|m| m.chunk).collect() })
    }

    fn data(&self) -> *mut u8 {
        // SAFETY: skew < mapping length.
        unsafe { self.mapping.base().add(self.skew) }
    }

    /// The memfds under this registration, their lengths, and where byte 0
    /// of the registration lies in them laid end to end.
    pub(crate) fn layout(&self) -> (Vec<(RawFd, usize)>, usize) {
        (self.chunks.iter().map(|c| (c.raw_fd(), c.len())).collect(), self.skew)
    }
}

/// A checked grant to a byte range of a live registration. Holding it keeps
/// the registration's pages mapped.
pub struct Access {
    pinned: Arc<Pinned>,
    offset: usize,
    len: usize,
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
        assert_eq!(src.len(), self.len, "write_from: length differs from the grant");
        // SAFETY: checked against the registration when granted; the mapping
        // lives as long as `pinned`.
        unsafe { std::ptr::copy_nonoverlapping(src.as_ptr(), self.ptr(), self.len) };
    }

    /// Copies the granted range out into `dst` (exactly `len` bytes).
    pub fn read_into(&self, dst: &mut [u8]) {
        assert_eq!(dst.len(), self.len, "read_into: length differs from the grant");
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
        std::slice::from_raw_parts(self.ptr(), self.len)
    }

    /// The granted bytes, for I/O straight into registered memory.
    ///
    /// # Safety
    /// No other view of the range may exist while the slice lives.
    #[allow(clippy::mut_from_ref)]
    pub unsafe fn as_mut_slice(&self) -> &mut [u8] {
        std::slice::from_raw_parts_mut(self.ptr(), self.len)
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
}

/// All registrations of one agent.
pub struct Registry {
    opts: RegistryOptions,
    inner: Mutex<Inner>,
}

impl Registry {
    pub fn new(opts: RegistryOptions) -> Registry {
        let keys = match opts.key_seed {
            Some(seed) => KeySource::Seeded(seed),
            None => KeySource::Os,
        };
        Registry {
            opts,
            inner: Mutex::new(Inner {
                slots: HashMap::new(),
                by_range: HashMap::new(),
                next_segment: 1,
                keys,
            }),
        }
    }

    /// Registers `[offset, offset+len)` of `region`. The same range registered
    /// again (live or not) keeps its segment id and gets the next epoch and a
    /// fresh key; a live older registration of it is dropped.
    pub fn register(&self, region: &Arc<Region>, offset: usize, len: usize) -> Result<Registration, RegisterError> {
        let bad = || RegisterError::BadRange { offset, len, region_len: region.len() };
        if len == 0 || offset.checked_add(len).is_none_or(|e| e > region.len()) {
            return Err(bad());
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
        let key = inner.keys.next()?;
        let reg = Registration { segment, key, epoch, len: len as u64 };
        let pinned = Arc::new(Pinned::map(reg, region, offset)?);
        if segment == inner.next_segment {
            inner.next_segment += 1;
            inner.by_range.insert(range, segment);
        }
        let old = inner.slots.insert(
            segment,
            Slot { epoch, live: Some(pinned) },
        );
        drop(inner);
        drop(old); // an older live registration of the range: its pins go now (or when its last access ends)
        tracing::debug!(segment, epoch, len, "registered");
        Ok(reg)
    }

    /// Drops the registration of `segment`; its pages are unpinned once the
    /// accesses in flight end. Returns whether one was live.
    pub fn deregister(&self, segment: u64) -> bool {
        let mut inner = self.inner.lock().unwrap();
        let old = inner.slots.get_mut(&segment).and_then(|s| s.live.take());
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
        inner.slots.values().filter_map(|s| s.live.as_ref().map(|p| p.reg)).collect()
    }

    /// Checks an access against the live registration of `segment` and
    /// grants it. The checks, in order: the segment is known, it is
    /// registered now, the epoch is its current one, the key matches, and
    /// `offset+len` lies inside it.
    pub fn access(&self, segment: u64, key: u64, epoch: u64, offset: u64, len: u64) -> Result<Access, AccessError> {
        let inner = self.inner.lock().unwrap();
        let slot = inner.slots.get(&segment).ok_or(AccessError::UnknownSegment { segment })?;
        let Some(pinned) = slot.live.as_ref() else {
            if epoch < slot.epoch {
                return Err(AccessError::StaleEpoch { have: epoch, want: slot.epoch });
            }
            return Err(AccessError::NotRegistered { segment });
        };
        if epoch != slot.epoch {
            return Err(AccessError::StaleEpoch { have: epoch, want: slot.epoch });
        }
        if key != pinned.reg.key {
            return Err(AccessError::BadKey { segment });
        }
        let registered = pinned.reg.len;
        match offset.checked_add(len) {
            Some(end) if end <= registered => Ok(Access {
                pinned: pinned.clone(),
                offset: offset as usize,
                len: len as usize,
            }),
            _ => Err(AccessError::OutOfBounds { offset, len, registered }),
        }
    }

    /// Grants the whole live registration of `segment` to the holder of its
    /// own key (not a grant's): what sharing its memory with a peer needs.
    pub fn access_whole(&self, segment: u64, key: u64, epoch: u64) -> Result<Access, AccessError> {
        let len = self.get(segment).filter(|r| r.key == key).map_or(1, |r| r.len);
        let a = self.access(segment, key, epoch, 0, len)?;
        // A grant's key passed `access` only where the registration's own key would have.
        match a.registration().key == key {
            true => Ok(a),
            false => Err(AccessError::BadKey { segment }),
        }
    }

    /// How many memfds (chunks) the live registration of `segment` spans.
    pub fn chunk_count(&self, segment: u64) -> Option<usize> {
        let inner = self.inner.lock().unwrap();
        inner.slots.get(&segment)?.live.as_ref().map(|p| p.chunks.len())
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
    fn next(&mut self) -> Result<u64, RegisterError> {
        match self {
            KeySource::Os => {
                let mut b = [0u8; 8];
                std::fs::File::open("/dev/urandom")
                    .and_then(|mut f| f.read_exact(&mut b))
                    .map_err(|source| RegisterError::Os { op: "read /dev/urandom", source })?;
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
        Pool::new(PoolOptions { chunk_size: 64 << 10, single_allocation: false })
    }

    fn registry() -> Registry {
        Registry::new(RegistryOptions { max_segments: 8, key_seed: Some(7) })
    }

    fn pattern(len: usize, seed: u8) -> Vec<u8> {
        (0..len).map(|i| (i as u8).wrapping_mul(13).wrapping_add(seed)).collect()
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
        assert_eq!(five, [9; 5], "the region sees writes through the registration");
    }

    #[test]
    fn every_check_refuses_with_its_reason() {
        let pool = pool();
        let region = pool.allocate(Tag::KvCache, 64 << 10).unwrap();
        let reg_ = registry();
        let r = reg_.register(&region, 0, 4096).unwrap();
        let cases = [
            (r.segment + 1, r.key, r.epoch, 0, 1, AccessError::UnknownSegment { segment: r.segment + 1 }),
            (r.segment, r.key ^ 1, r.epoch, 0, 1, AccessError::BadKey { segment: r.segment }),
            (r.segment, r.key, r.epoch + 1, 0, 1, AccessError::StaleEpoch { have: 2, want: 1 }),
            (r.segment, r.key, r.epoch, 4000, 97, AccessError::OutOfBounds { offset: 4000, len: 97, registered: 4096 }),
            (r.segment, r.key, r.epoch, u64::MAX, 2, AccessError::OutOfBounds { offset: u64::MAX, len: 2, registered: 4096 }),
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
        reg_.local(&old, 0, back.len() as u64).unwrap().read_into(&mut back);
        assert!(back == old_bytes, "a registration pins and reaches the old pages");

        // The fix: re-register; the old epoch is refused, never served.
        let new = reg_.register(&region, 0, region.len()).unwrap();
        assert_eq!((new.segment, new.epoch), (old.segment, old.epoch + 1));
        assert_ne!(new.key, old.key);
        assert_eq!(
            reg_.local(&old, 0, 1).err(),
            Some(AccessError::StaleEpoch { have: old.epoch, want: new.epoch })
        );
        reg_.local(&new, 0, back.len() as u64).unwrap().read_into(&mut back);
        assert!(back == new_bytes, "the new registration reaches the new pages");

        // After deregistration too, the old epoch is named as stale.
        reg_.deregister(new.segment);
        assert_eq!(
            reg_.local(&old, 0, 1).err(),
            Some(AccessError::StaleEpoch { have: old.epoch, want: new.epoch })
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
        assert_eq!(Arc::strong_count(&chunk), 2, "pinned by the grant and by this test");
        drop(grant);
        assert_eq!(Arc::strong_count(&chunk), 1, "the last grant unpinned it");
    }

    #[test]
    fn bad_registrations_are_refused_and_the_registry_is_bounded() {
        let pool = pool();
        let region = pool.allocate(Tag::KvCache, 64 << 10).unwrap();
        let reg_ = registry();
        assert!(matches!(reg_.register(&region, 0, 0), Err(RegisterError::BadRange { .. })));
        assert!(matches!(reg_.register(&region, 1, region.len()), Err(RegisterError::BadRange { .. })));
        assert!(matches!(reg_.register(&region, usize::MAX, 2), Err(RegisterError::BadRange { .. })));
        for i in 0..8 {
            reg_.register(&region, i * 4096, 4096).unwrap();
        }
        assert!(matches!(reg_.register(&region, 8 * 4096, 4096), Err(RegisterError::Full(8))));
        // Re-registering a known range still works when full.
        assert_eq!(reg_.register(&region, 0, 4096).unwrap().epoch, 2);
        assert!(reg_.deregister(1) && reg_.forget(1));
        assert!(reg_.register(&region, 8 * 4096, 4096).is_ok());
        pool.discard(&[Tag::KvCache]).unwrap();
        assert!(matches!(reg_.register(&region, 4096, 4096), Err(RegisterError::NotMapped)));
    }
}
