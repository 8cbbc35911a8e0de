//! Sleepable memory: the CPU stand-in for CUDA virtual memory management.
//!
//! A [`Region`] is a reserved virtual address range (`PROT_NONE`) into which
//! physical *chunks* are mapped with `MAP_SHARED | MAP_FIXED`. Each chunk is a
//! memfd, the analogue of a `cuMemCreate` handle: its pages are allocated when
//! the chunk is created (`fallocate`), and freed when the last reference to
//! the memfd goes away. Because the virtual range is reserved for the whole
//! life of the region, chunks can later be swapped under the same addresses.
//!
//! Accounting is honest: "device bytes" are read from the memfds themselves
//! (`fstat` blocks of every live chunk), never from RSS.
//!
//! A region only this process reads may instead be [`Backing::Private`]:
//! one anonymous mapping with transparent huge pages asked for (see
//! [`private`]), freed and refilled at the same addresses as chunks are,
//! its bytes read with `mincore`; no one outside can map it, so it cannot
//! be registered for transfers.
//!
//! Invariants:
//! - a region's base address and length never change while it lives;
//! - every byte of `[base, base+len)` is either mapped to exactly one live
//!   chunk (a private region: to its own anonymous mapping) or reserved
//!   `PROT_NONE`, all of it alike: `mapped` says which;
//! - this crate never interprets the bytes it holds.
//!
//! [`RankPools`] is one pool per tensor-parallel rank, whose sleep and wake
//! act on every rank or on none.

use std::fmt;
use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::sync::{Arc, Mutex, Weak};

mod private;
mod ranks;
pub use ranks::RankPools;

/// What a region holds; sleep and wake act on tags.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Tag {
    Weights,
    KvCache,
    Runtime,
}

impl Tag {
    pub const ALL: [Tag; 3] = [Tag::Weights, Tag::KvCache, Tag::Runtime];

    pub fn as_str(self) -> &'static str {
        match self {
            Tag::Weights => "weights",
            Tag::KvCache => "kv_cache",
            Tag::Runtime => "runtime",
        }
    }

    pub fn parse(s: &str) -> Option<Tag> {
        Tag::ALL.into_iter().find(|t| t.as_str() == s)
    }

    fn index(self) -> usize {
        self as usize
    }
}

impl fmt::Display for Tag {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

#[derive(Debug, thiserror::Error)]
pub enum VmemError {
    #[error("{op} failed: {source}")]
    Os {
        op: &'static str,
        #[source]
        source: io::Error,
    },
    #[error("region length must be non-zero")]
    ZeroLength,
    #[error("chunk size {0} is not a positive multiple of the page size {1}")]
    BadChunkSize(usize, usize),
    #[error("range {offset}+{len} is outside the region of {region_len} bytes")]
    OutOfBounds {
        offset: usize,
        len: usize,
        region_len: usize,
    },
    /// A failure asked for through [`Pool::faults`].
    #[error("{0} failed: injected fault")]
    Injected(&'static str),
    /// An operation over ranks failed on one of them ([`RankPools`]).
    #[error("rank {rank}: {source}{undo}")]
    OnRank {
        rank: usize,
        #[source]
        source: Box<VmemError>,
        /// What was done about the ranks the operation had reached.
        undo: String,
    },
}

pub type Result<T> = std::result::Result<T, VmemError>;

fn os_err(op: &'static str) -> VmemError {
    VmemError::Os {
        op,
        source: io::Error::last_os_error(),
    }
}

pub fn page_size() -> usize {
    // SAFETY: sysconf has no memory-safety preconditions.
    let p = unsafe { libc::sysconf(libc::_SC_PAGESIZE) };
    if p <= 0 {
        4096
    } else {
        p as usize
    }
}

fn round_up(n: usize, to: usize) -> usize {
    n.div_ceil(to) * to
}

/// How a region's pages are held.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Backing {
    /// memfd chunks: other mappings (a registration, a peer over shared
    /// memory) can reach them.
    Shared,
    /// One private anonymous mapping, aligned to 2 MiB and asked for
    /// transparent huge pages: for memory that only this process reads,
    /// streamed at the rate of its pages (a model's weights). Nothing
    /// outside can map it.
    Private,
}

/// How a pool backs its regions.
#[derive(Clone, Debug)]
pub struct PoolOptions {
    /// Size of one physical chunk; regions are backed by `ceil(len / chunk)` chunks.
    pub chunk_size: usize,
    /// One physical handle per region, whatever its size.
    pub single_allocation: bool,
}

impl Default for PoolOptions {
    fn default() -> Self {
        PoolOptions {
            chunk_size: 2 << 20,
            single_allocation: false,
        }
    }
}

/// A physical allocation: one memfd. Pages are freed when the last `Arc`
/// to it is dropped (the fd closes) — a registration that keeps an `Arc`
/// pins the pages, as an RDMA memory region does.
pub struct Chunk {
    fd: OwnedFd,
    len: usize,
    tag: Tag,
}

impl Chunk {
    fn create(tag: Tag, len: usize) -> Result<Chunk> {
        let name = match tag {
            Tag::Weights => c"pdkv-weights",
            Tag::KvCache => c"pdkv-kv_cache",
            Tag::Runtime => c"pdkv-runtime",
        };
        // SAFETY: name is a valid NUL-terminated string.
        let raw = unsafe { libc::memfd_create(name.as_ptr(), libc::MFD_CLOEXEC) };
        if raw < 0 {
            return Err(os_err("memfd_create"));
        }
        // SAFETY: raw is a freshly created fd that we own.
        let fd = unsafe { OwnedFd::from_raw_fd(raw) };
        // SAFETY: plain syscalls on an fd we own.
        if unsafe { libc::ftruncate(fd.as_raw_fd(), len as libc::off_t) } != 0 {
            return Err(os_err("ftruncate"));
        }
        // Allocate the pages now, as cuMemCreate does: accounting then shows
        // what the chunk really holds, and first-touch cost is paid up front.
        // SAFETY: a plain syscall on an fd we own.
        if unsafe { libc::fallocate(fd.as_raw_fd(), 0, 0, len as libc::off_t) } != 0 {
            return Err(os_err("fallocate"));
        }
        Ok(Chunk { fd, len, tag })
    }

    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    pub fn tag(&self) -> Tag {
        self.tag
    }

    pub fn raw_fd(&self) -> RawFd {
        self.fd.as_raw_fd()
    }

    /// Physical bytes the memfd holds right now (allocated blocks).
    pub fn physical_bytes(&self) -> u64 {
        let mut st = std::mem::MaybeUninit::<libc::stat>::uninit();
        // SAFETY: fstat writes a stat struct into st on success.
        let rc = unsafe { libc::fstat(self.fd.as_raw_fd(), st.as_mut_ptr()) };
        if rc != 0 {
            return 0;
        }
        // SAFETY: fstat succeeded, st is initialised.
        let st = unsafe { st.assume_init() };
        (st.st_blocks as u64) * 512
    }
}

impl fmt::Debug for Chunk {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Chunk")
            .field("fd", &self.fd.as_raw_fd())
            .field("len", &self.len)
            .finish()
    }
}

/// A mapped chunk: where in the region it lives.
#[derive(Clone, Debug)]
pub struct MappedChunk {
    pub offset: usize,
    pub chunk: Arc<Chunk>,
}

/// The size in bytes of the file behind `fd`.
fn fd_size(fd: RawFd) -> io::Result<u64> {
    let mut st = std::mem::MaybeUninit::<libc::stat>::uninit();
    // SAFETY: fstat writes a stat struct into st on success; a bad fd is an error.
    if unsafe { libc::fstat(fd, st.as_mut_ptr()) } != 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: fstat succeeded, st is initialised.
    Ok(unsafe { st.assume_init() }.st_size.max(0) as u64)
}

/// Reserves `len` bytes of address space, `PROT_NONE`: nothing is backed.
pub(crate) fn reserve(len: usize) -> io::Result<*mut u8> {
    // SAFETY: an anonymous PROT_NONE reservation; no memory is touched.
    let base = unsafe {
        libc::mmap(
            std::ptr::null_mut(),
            len,
            libc::PROT_NONE,
            libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_NORESERVE,
            -1,
            0,
        )
    };
    if base == libc::MAP_FAILED {
        return Err(io::Error::last_os_error());
    }
    Ok(base as *mut u8)
}

/// Maps `len` bytes of `fd` read-write, shared, at `addr`, with the page
/// tables filled in now (`MAP_POPULATE`): the chunk's pages exist already
/// (`fallocate`), and mapping them all at once costs a fraction of taking
/// one fault per page on first use, which would otherwise land on the first
/// requests after a start or a wake.
///
/// # Safety
/// `[addr, addr+len)` must lie inside a reservation the caller owns.
unsafe fn map_shared_fixed(addr: *mut u8, fd: RawFd, len: usize) -> io::Result<()> {
    // SAFETY: MAP_FIXED replaces only `[addr, addr+len)`, which the caller
    // guarantees lies inside a reservation it owns, so no mapping of anyone
    // else is replaced; `fd` is only read by the kernel.
    let p = unsafe {
        libc::mmap(
            addr as *mut libc::c_void,
            len,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_SHARED | libc::MAP_FIXED | libc::MAP_POPULATE,
            fd,
            0,
        )
    };
    if p == libc::MAP_FAILED {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

/// A private mapping of existing memfds, one after the other, in a
/// reservation of its own: how a registration or a peer reaches chunks
/// without going through their region. It keeps the pages of what it maps
/// alive until dropped, whatever the region does meanwhile.
pub struct FdMapping {
    base: *mut u8,
    len: usize,
}

// SAFETY: the mapping is owned by this value and unmapped only in Drop;
// concurrent access to the bytes is governed by its users (the transfer
// protocol), as with device memory a NIC reads and writes.
unsafe impl Send for FdMapping {}
// SAFETY: as for Send; `&self` methods only read the base and length.
unsafe impl Sync for FdMapping {}

impl FdMapping {
    /// Maps each `(fd, len)` read-write, shared, one after the other. Every
    /// `len` must be a whole number of pages (see [`FdMapping::map_at`]).
    pub fn map(parts: &[(RawFd, usize)]) -> io::Result<FdMapping> {
        let len: usize = parts.iter().map(|p| p.1).sum();
        let mut mapping = FdMapping::reserve(len)?;
        let mut at = 0;
        for &(fd, plen) in parts {
            // On error, Drop unmaps whatever was mapped.
            mapping.map_at(at, fd, plen)?;
            at += plen;
        }
        Ok(mapping)
    }

    /// Reserves `len` bytes of address space (`PROT_NONE`, nothing backed),
    /// to be filled part by part with [`FdMapping::map_at`]: a peer that
    /// receives thousands of descriptors in batches maps each batch as it
    /// arrives and closes it, instead of holding them all open at once.
    pub fn reserve(len: usize) -> io::Result<FdMapping> {
        if len == 0 {
            return Err(io::Error::new(io::ErrorKind::InvalidInput, "empty mapping"));
        }
        Ok(FdMapping {
            base: reserve(len)?,
            len,
        })
    }

    /// Maps the first `len` bytes of `fd` read-write, shared, at `offset`
    /// inside this mapping, replacing what was there (the reservation, or
    /// an earlier part). Refused, with nothing changed, unless `offset` and
    /// `len` are whole pages, `len > 0`, the range lies inside the mapping,
    /// and `fd` holds at least `len` bytes — a shorter file would leave
    /// pages that fault (`SIGBUS`) on first touch. The mapping keeps the
    /// pages alive once mapped: the caller may close `fd` right after.
    /// `&mut self`: nothing reads the bytes while the mapping is being filled.
    pub fn map_at(&mut self, offset: usize, fd: RawFd, len: usize) -> io::Result<()> {
        let invalid = |why: &str| {
            io::Error::new(
                io::ErrorKind::InvalidInput,
                format!("map_at({offset}, {len}): {why}"),
            )
        };
        let page = page_size();
        if len == 0 || !offset.is_multiple_of(page) || !len.is_multiple_of(page) {
            return Err(invalid("not whole, non-empty pages"));
        }
        if offset.checked_add(len).is_none_or(|end| end > self.len) {
            return Err(invalid("outside the mapping"));
        }
        if fd_size(fd)? < len as u64 {
            return Err(invalid("the file is shorter than the part"));
        }
        // SAFETY: [base+offset, +len) lies inside our own reservation
        // (checked above); MAP_FIXED replaces exactly that part of it.
        unsafe { map_shared_fixed(self.base.add(offset), fd, len) }
    }

    pub fn base(&self) -> *mut u8 {
        self.base
    }

    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
}

impl Drop for FdMapping {
    fn drop(&mut self) {
        // SAFETY: we own [base, base+len); nothing else maps it.
        unsafe { libc::munmap(self.base as *mut libc::c_void, self.len) };
    }
}

/// Host memory for an offload backup: its own anonymous mapping, so that
/// freeing it (on wake) returns the pages to the system at once instead of
/// leaving them on the allocator's heap — sleep/wake cycles do not grow the
/// process.
struct HostBuffer {
    ptr: *mut u8,
    len: usize,
}

// SAFETY: the buffer owns its mapping; access goes through the region's lock.
unsafe impl Send for HostBuffer {}

impl HostBuffer {
    fn new(len: usize) -> Result<HostBuffer> {
        // SAFETY: a fresh private anonymous mapping; no existing memory is touched.
        let p = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
                -1,
                0,
            )
        };
        if p == libc::MAP_FAILED {
            return Err(os_err("mmap(host backup)"));
        }
        Ok(HostBuffer {
            ptr: p as *mut u8,
            len,
        })
    }
}

impl Drop for HostBuffer {
    fn drop(&mut self) {
        // SAFETY: we own exactly this mapping.
        unsafe { libc::munmap(self.ptr as *mut libc::c_void, self.len) };
    }
}

/// A reserved virtual range with physical chunks mapped into it.
pub struct Region {
    base: *mut u8,
    len: usize,
    tag: Tag,
    backing: Backing,
    opts: PoolOptions,
    state: Mutex<RegionState>,
    ledger: Arc<Ledger>,
}

/// Every chunk a pool created that is still alive, wherever it is held: by
/// its region, or by someone who pinned it (a registration, a peer's map).
#[derive(Default)]
struct Ledger {
    chunks: Mutex<Vec<Weak<Chunk>>>,
    faults: Faults,
}

impl Ledger {
    fn record(&self, chunk: &Arc<Chunk>) {
        let mut chunks = self.chunks.lock().unwrap();
        chunks.retain(|w| w.strong_count() > 0);
        chunks.push(Arc::downgrade(chunk));
    }

    fn live(&self) -> Vec<Arc<Chunk>> {
        self.chunks
            .lock()
            .unwrap()
            .iter()
            .filter_map(Weak::upgrade)
            .collect()
    }
}

/// What backs a region right now.
struct RegionState {
    /// Whether pages back the range now (false while released).
    mapped: bool,
    /// A shared region's mapped chunks in address order; empty while
    /// released, and always for a private region.
    chunks: Vec<MappedChunk>,
    /// Host copy taken by `offload`, restored by `wake`.
    backup: Option<HostBuffer>,
}

// SAFETY: the region owns its mapping; concurrent access to the bytes is
// governed by the callers (they hand out disjoint ranges), like a device buffer.
unsafe impl Send for Region {}
// SAFETY: as for Send; the backing state is behind a mutex.
unsafe impl Sync for Region {}

impl Region {
    fn new(
        (tag, len, backing): (Tag, usize, Backing),
        opts: &PoolOptions,
        ledger: Arc<Ledger>,
    ) -> Result<Region> {
        if len == 0 {
            return Err(VmemError::ZeroLength);
        }
        let page = page_size();
        if opts.chunk_size == 0 || !opts.chunk_size.is_multiple_of(page) {
            return Err(VmemError::BadChunkSize(opts.chunk_size, page));
        }
        let len = round_up(len, page);
        let base = match backing {
            Backing::Shared => reserve(len),
            Backing::Private => private::reserve_aligned(len, private::HUGE_PAGE),
        }
        .map_err(|source| VmemError::Os {
            op: "mmap(reserve)",
            source,
        })?;
        let region = Region {
            base,
            len,
            tag,
            backing,
            opts: opts.clone(),
            state: Mutex::new(RegionState {
                mapped: false,
                chunks: Vec::new(),
                backup: None,
            }),
            ledger,
        };
        let chunks = region.map_fresh()?;
        {
            let mut st = region.state.lock().unwrap();
            (st.chunks, st.mapped) = (chunks, true);
        }
        Ok(region)
    }

    /// Backs the whole range with fresh zeroed pages: new chunks (returned)
    /// for a shared region, a new private mapping for a private one.
    fn map_fresh(&self) -> Result<Vec<MappedChunk>> {
        match self.backing {
            Backing::Shared => self.map_fresh_chunks(),
            Backing::Private => {
                // SAFETY: the range is our own reservation (or our own
                // released mapping); no views of it exist while it is
                // released.
                unsafe { private::map_private_fixed(self.base, self.len) }.map_err(|source| {
                    VmemError::Os {
                        op: "mmap(private)",
                        source,
                    }
                })?;
                Ok(Vec::new())
            }
        }
    }

    /// Creates new zeroed chunks and maps them over the whole range.
    fn map_fresh_chunks(&self) -> Result<Vec<MappedChunk>> {
        let step = if self.opts.single_allocation {
            self.len
        } else {
            self.opts.chunk_size
        };
        let mut mapped = Vec::with_capacity(self.len.div_ceil(step));
        let mut offset = 0;
        while offset < self.len {
            let clen = step.min(self.len - offset);
            let chunk = Arc::new(Chunk::create(self.tag, clen)?);
            self.ledger.record(&chunk);
            // SAFETY: [base+offset, +clen) lies inside our reservation;
            // MAP_FIXED replaces exactly that part of it.
            unsafe { map_shared_fixed(self.base.add(offset), chunk.raw_fd(), clen) }.map_err(
                |source| VmemError::Os {
                    op: "mmap(chunk)",
                    source,
                },
            )?;
            mapped.push(MappedChunk { offset, chunk });
            offset += clen;
        }
        Ok(mapped)
    }

    /// Puts the `PROT_NONE` reservation back over the whole range, unmapping
    /// every chunk. Chunks are freed when their last reference drops.
    fn unmap_chunks(&self) -> Result<()> {
        // SAFETY: replaces exactly our own range with a fresh reservation.
        let p = unsafe {
            libc::mmap(
                self.base as *mut libc::c_void,
                self.len,
                libc::PROT_NONE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_NORESERVE | libc::MAP_FIXED,
                -1,
                0,
            )
        };
        if p == libc::MAP_FAILED {
            return Err(os_err("mmap(release)"));
        }
        Ok(())
    }

    /// Whether physical pages back the region now.
    pub fn is_mapped(&self) -> bool {
        self.state.lock().unwrap().mapped
    }

    /// How the region's pages are held.
    pub fn backing(&self) -> Backing {
        self.backing
    }

    /// Bytes of the region in transparent huge pages now, as the kernel
    /// reports them (`/proc/self/smaps`; 0 for a shared region on systems
    /// whose shared memory has no huge pages, or where it cannot be read).
    pub fn huge_page_bytes(&self) -> u64 {
        private::huge_page_bytes(self.base, self.len)
    }

    /// Copies the contents to host memory, then releases the physical chunks.
    /// Idempotent: a released region keeps the backup it has (if any).
    pub fn offload(&self) -> Result<()> {
        let mut st = self.state.lock().unwrap();
        if !st.mapped {
            return Ok(());
        }
        if self.ledger.faults.take(&self.ledger.faults.offloads) {
            return Err(VmemError::Injected("offload"));
        }
        let backup = HostBuffer::new(self.len)?;
        // SAFETY: the range is mapped (chunks non-empty) and readable; the
        // buffer holds `len` writable bytes.
        unsafe { std::ptr::copy_nonoverlapping(self.base, backup.ptr, self.len) };
        self.unmap_chunks()?;
        (st.chunks, st.mapped) = (Vec::new(), false);
        st.backup = Some(backup);
        Ok(())
    }

    /// Releases the physical chunks without a backup; the contents are lost.
    /// Idempotent; also drops a backup taken by an earlier `offload`.
    pub fn discard(&self) -> Result<()> {
        let mut st = self.state.lock().unwrap();
        st.backup = None;
        if !st.mapped {
            return Ok(());
        }
        self.unmap_chunks()?;
        (st.chunks, st.mapped) = (Vec::new(), false);
        Ok(())
    }

    /// Maps fresh zeroed chunks at the same addresses and restores the host
    /// backup, if one was taken. Idempotent: an awake region is left alone.
    pub fn wake(&self) -> Result<()> {
        let mut st = self.state.lock().unwrap();
        if st.mapped {
            return Ok(());
        }
        if self.ledger.faults.take(&self.ledger.faults.wakes) {
            return Err(VmemError::Injected("wake"));
        }
        let chunks = self.map_fresh()?;
        if let Some(backup) = st.backup.take() {
            // SAFETY: the range was just mapped read-write.
            unsafe { std::ptr::copy_nonoverlapping(backup.ptr, self.base, self.len) };
        }
        (st.chunks, st.mapped) = (chunks, true);
        Ok(())
    }

    /// Bytes held in host memory by an `offload` backup.
    pub fn host_backup_bytes(&self) -> u64 {
        self.state
            .lock()
            .unwrap()
            .backup
            .as_ref()
            .map_or(0, |b| b.len as u64)
    }

    pub fn tag(&self) -> Tag {
        self.tag
    }

    /// Length in bytes (rounded up to whole pages).
    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    pub fn base(&self) -> *mut u8 {
        self.base
    }

    /// Physical bytes held by the chunks mapped now (a private region:
    /// its resident pages).
    pub fn physical_bytes(&self) -> u64 {
        let st = self.state.lock().unwrap();
        match self.backing {
            Backing::Shared => st.chunks.iter().map(|m| m.chunk.physical_bytes()).sum(),
            Backing::Private if st.mapped => private::resident_bytes(self.base, self.len),
            Backing::Private => 0,
        }
    }

    /// The chunks mapped now, in address order (none for a private region).
    pub fn chunks(&self) -> Vec<MappedChunk> {
        self.state.lock().unwrap().chunks.clone()
    }

    fn check(&self, offset: usize, len: usize) -> Result<()> {
        match offset.checked_add(len) {
            Some(end) if end <= self.len => Ok(()),
            _ => Err(VmemError::OutOfBounds {
                offset,
                len,
                region_len: self.len,
            }),
        }
    }

    /// Copies `src` into the region at `offset`.
    pub fn write_bytes(&self, offset: usize, src: &[u8]) -> Result<()> {
        self.check(offset, src.len())?;
        // SAFETY: bounds checked; the range is mapped read-write.
        unsafe { std::ptr::copy_nonoverlapping(src.as_ptr(), self.base.add(offset), src.len()) };
        Ok(())
    }

    /// Copies bytes at `offset` out into `dst`.
    pub fn read_bytes(&self, offset: usize, dst: &mut [u8]) -> Result<()> {
        self.check(offset, dst.len())?;
        // SAFETY: bounds checked; the range is mapped readable.
        unsafe {
            std::ptr::copy_nonoverlapping(self.base.add(offset), dst.as_mut_ptr(), dst.len())
        };
        Ok(())
    }

    /// A typed view of `count` elements at byte `offset`.
    ///
    /// # Safety
    /// `offset` must be aligned for `T`, the bytes there must be valid values
    /// of `T` (plain numbers are), and no one may write the range while the
    /// slice lives.
    pub unsafe fn slice<T: Copy>(&self, offset: usize, count: usize) -> &[T] {
        let bytes = count * std::mem::size_of::<T>();
        assert!(
            offset.checked_add(bytes).is_some_and(|e| e <= self.len),
            "slice out of bounds"
        );
        assert_eq!(offset % std::mem::align_of::<T>(), 0, "misaligned slice");
        // SAFETY: the range is inside the region (checked above) and aligned
        // for `T` (checked above); that the bytes there are valid `T`s and
        // that no one writes them while the slice lives is the caller's
        // promise (see # Safety).
        unsafe { std::slice::from_raw_parts(self.base.add(offset) as *const T, count) }
    }

    /// A mutable typed view of `count` elements at byte `offset`.
    ///
    /// # Safety
    /// As [`Region::slice`], and the caller must guarantee that no other view
    /// overlaps this range while it lives.
    #[allow(clippy::mut_from_ref)]
    pub unsafe fn slice_mut<T: Copy>(&self, offset: usize, count: usize) -> &mut [T] {
        let bytes = count * std::mem::size_of::<T>();
        assert!(
            offset.checked_add(bytes).is_some_and(|e| e <= self.len),
            "slice out of bounds"
        );
        assert_eq!(offset % std::mem::align_of::<T>(), 0, "misaligned slice");
        // SAFETY: in bounds and aligned (checked above); the caller promises
        // that no other view overlaps the range while this one lives.
        unsafe { std::slice::from_raw_parts_mut(self.base.add(offset) as *mut T, count) }
    }
}

impl Drop for Region {
    fn drop(&mut self) {
        // SAFETY: we own the whole reservation; unmapping it also unmaps the
        // chunks. The memfds close when their last Arc goes.
        unsafe { libc::munmap(self.base as *mut libc::c_void, self.len) };
    }
}

impl fmt::Debug for Region {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Region")
            .field("tag", &self.tag)
            .field("base", &self.base)
            .field("len", &self.len)
            .finish()
    }
}

/// Live physical bytes per tag.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct TagBytes(pub [u64; 3]);

impl TagBytes {
    pub fn get(&self, tag: Tag) -> u64 {
        self.0[tag.index()]
    }

    pub fn total(&self) -> u64 {
        self.0.iter().sum()
    }
}

/// Failures a pool is asked to fake: the next `n` region wakes or offloads
/// that would touch memory fail as an OS failure would, before changing
/// anything. Shared by the pool's clones.
#[derive(Debug, Default)]
pub struct Faults {
    wakes: std::sync::atomic::AtomicUsize,
    offloads: std::sync::atomic::AtomicUsize,
}

impl Faults {
    /// Fails the next `n` region wakes.
    pub fn fail_wakes(&self, n: usize) {
        self.wakes.store(n, std::sync::atomic::Ordering::SeqCst);
    }

    /// Fails the next `n` region offloads.
    pub fn fail_offloads(&self, n: usize) {
        self.offloads.store(n, std::sync::atomic::Ordering::SeqCst);
    }

    fn take(&self, counter: &std::sync::atomic::AtomicUsize) -> bool {
        use std::sync::atomic::Ordering::SeqCst;
        counter
            .fetch_update(SeqCst, SeqCst, |n| n.checked_sub(1))
            .is_ok()
    }
}

/// Allocates regions and accounts for them, per engine (the analogue of a
/// CUDA memory pool with tags).
#[derive(Clone)]
pub struct Pool {
    inner: Arc<PoolInner>,
}

struct PoolInner {
    opts: PoolOptions,
    regions: Mutex<Vec<Weak<Region>>>,
    ledger: Arc<Ledger>,
}

impl Default for Pool {
    fn default() -> Self {
        Pool::new(PoolOptions::default())
    }
}

impl Pool {
    pub fn new(opts: PoolOptions) -> Pool {
        Pool {
            inner: Arc::new(PoolInner {
                opts,
                regions: Mutex::new(Vec::new()),
                ledger: Arc::default(),
            }),
        }
    }

    pub fn options(&self) -> &PoolOptions {
        &self.inner.opts
    }

    /// Failures to inject into this pool's operations (tests, simulations).
    pub fn faults(&self) -> &Faults {
        &self.inner.ledger.faults
    }

    /// Whether any region with `tag` holds a host backup.
    pub fn has_backup(&self, tag: Tag) -> bool {
        self.regions()
            .iter()
            .any(|r| r.tag() == tag && r.host_backup_bytes() > 0)
    }

    /// Reserves `len` bytes (rounded up to whole pages) and backs them with
    /// fresh zeroed physical chunks.
    pub fn allocate(&self, tag: Tag, len: usize) -> Result<Arc<Region>> {
        self.allocate_backed(tag, len, Backing::Shared)
    }

    /// [`Pool::allocate`] with the pages held as `backing` says.
    pub fn allocate_backed(&self, tag: Tag, len: usize, backing: Backing) -> Result<Arc<Region>> {
        let region = Arc::new(Region::new(
            (tag, len, backing),
            &self.inner.opts,
            self.inner.ledger.clone(),
        )?);
        let mut regions = self.inner.regions.lock().unwrap();
        regions.retain(|w| w.strong_count() > 0);
        regions.push(Arc::downgrade(&region));
        Ok(region)
    }

    /// The regions of this pool that are still alive.
    pub fn regions(&self) -> Vec<Arc<Region>> {
        self.inner
            .regions
            .lock()
            .unwrap()
            .iter()
            .filter_map(Weak::upgrade)
            .collect()
    }

    fn for_tags(&self, tags: &[Tag], op: impl Fn(&Region) -> Result<()>) -> Result<()> {
        for r in self.regions().iter().filter(|r| tags.contains(&r.tag())) {
            op(r)?;
        }
        Ok(())
    }

    /// Offloads every region with one of `tags` to host memory and releases it.
    pub fn offload(&self, tags: &[Tag]) -> Result<()> {
        self.for_tags(tags, Region::offload)
    }

    /// Releases every region with one of `tags`; contents are lost.
    pub fn discard(&self, tags: &[Tag]) -> Result<()> {
        self.for_tags(tags, Region::discard)
    }

    /// Wakes every region with one of `tags` at its old addresses.
    pub fn wake(&self, tags: &[Tag]) -> Result<()> {
        self.for_tags(tags, Region::wake)
    }

    /// Tags whose regions are all mapped now (a tag with no region counts as awake).
    pub fn is_awake(&self, tag: Tag) -> bool {
        self.regions()
            .iter()
            .filter(|r| r.tag() == tag)
            .all(|r| r.is_mapped())
    }

    /// Host memory held by offload backups.
    pub fn host_backup_bytes(&self) -> u64 {
        self.regions().iter().map(|r| r.host_backup_bytes()).sum()
    }

    /// Live physical bytes per tag, read from the memfds: every chunk this
    /// pool created that is still alive, mapped in its region or not (a
    /// chunk pinned by a registration after its region slept still counts),
    /// and the resident pages of its private regions.
    pub fn device_bytes(&self) -> TagBytes {
        let mut out = TagBytes::default();
        for c in self.inner.ledger.live() {
            out.0[c.tag().index()] += c.physical_bytes();
        }
        for r in self.regions() {
            if r.backing() == Backing::Private {
                out.0[r.tag().index()] += r.physical_bytes();
            }
        }
        out
    }

    /// Physical bytes of chunks that are alive but no longer mapped in any
    /// region of this pool: pinned by someone else after a release.
    pub fn pinned_bytes(&self) -> u64 {
        let mapped: Vec<*const Chunk> = self
            .regions()
            .iter()
            .flat_map(|r| r.chunks())
            .map(|m| Arc::as_ptr(&m.chunk))
            .collect();
        self.inner
            .ledger
            .live()
            .iter()
            .filter(|c| !mapped.contains(&Arc::as_ptr(c)))
            .map(|c| c.physical_bytes())
            .sum()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn allocate_write_read_and_account() {
        let pool = Pool::new(PoolOptions {
            chunk_size: 64 << 10,
            single_allocation: false,
        });
        let r = pool.allocate(Tag::KvCache, 200 << 10).unwrap();
        assert_eq!(r.len(), 200 << 10);
        assert_eq!(r.chunks().len(), 4, "200 KiB in 64 KiB chunks");
        assert_eq!(pool.device_bytes().get(Tag::KvCache), 200 << 10);
        assert_eq!(pool.device_bytes().get(Tag::Weights), 0);

        // Fresh pages read as zeros.
        let mut buf = vec![1u8; 1000];
        r.read_bytes(100_000, &mut buf).unwrap();
        assert!(buf.iter().all(|&b| b == 0));

        // A write that crosses a chunk boundary reads back whole.
        let data: Vec<u8> = (0..10_000u32).map(|i| (i % 251) as u8).collect();
        let off = (64 << 10) - 5000;
        r.write_bytes(off, &data).unwrap();
        let mut back = vec![0u8; data.len()];
        r.read_bytes(off, &mut back).unwrap();
        assert_eq!(back, data);

        assert!(matches!(
            r.write_bytes(r.len() - 1, &[0, 0]),
            Err(VmemError::OutOfBounds { .. })
        ));

        drop(r);
        assert_eq!(
            pool.device_bytes().total(),
            0,
            "dropping the region frees its chunks"
        );
    }

    #[test]
    fn single_allocation_uses_one_chunk() {
        let pool = Pool::new(PoolOptions {
            chunk_size: 4096,
            single_allocation: true,
        });
        let r = pool.allocate(Tag::Weights, 100_000).unwrap();
        assert_eq!(r.chunks().len(), 1);
        assert_eq!(r.len(), round_up(100_000, page_size()));
        assert_eq!(pool.device_bytes().get(Tag::Weights), r.len() as u64);
    }

    #[test]
    fn typed_views_share_the_bytes() {
        let pool = Pool::default();
        let r = pool.allocate(Tag::Runtime, 4096).unwrap();
        // SAFETY: offset 64 is aligned for f32; the mutable view is last used before the shared one is made.
        unsafe {
            let w = r.slice_mut::<f32>(64, 4);
            w.copy_from_slice(&[1.0, 2.0, 3.0, 4.0]);
            assert_eq!(r.slice::<f32>(64, 4), &[1.0, 2.0, 3.0, 4.0]);
        }
    }

    fn fill(r: &Region, seed: u8) -> Vec<u8> {
        let data: Vec<u8> = (0..r.len())
            .map(|i| (i as u8).wrapping_mul(31).wrapping_add(seed))
            .collect();
        r.write_bytes(0, &data).unwrap();
        data
    }

    #[test]
    fn offload_and_wake_restore_contents_at_the_same_address() {
        let pool = Pool::new(PoolOptions {
            chunk_size: 64 << 10,
            single_allocation: false,
        });
        let w = pool.allocate(Tag::Weights, 300 << 10).unwrap();
        let base = w.base();
        let data = fill(&w, 3);

        pool.offload(&[Tag::Weights]).unwrap();
        assert!(!w.is_mapped());
        assert_eq!(pool.device_bytes().total(), 0, "asleep: no physical bytes");
        assert_eq!(pool.host_backup_bytes(), w.len() as u64);
        pool.offload(&[Tag::Weights]).unwrap(); // idempotent, keeps the backup
        assert_eq!(pool.host_backup_bytes(), w.len() as u64);

        pool.wake(&[Tag::Weights]).unwrap();
        assert_eq!(w.base(), base, "same virtual address");
        assert_eq!(pool.device_bytes().get(Tag::Weights), w.len() as u64);
        assert_eq!(pool.host_backup_bytes(), 0);
        let mut back = vec![0u8; w.len()];
        w.read_bytes(0, &mut back).unwrap();
        assert!(back == data, "contents restored");
        pool.wake(&[Tag::Weights]).unwrap(); // idempotent
        assert_eq!(w.chunks().len(), 5);
    }

    #[test]
    fn discard_frees_and_wakes_zeroed_and_tags_are_independent() {
        let pool = Pool::default();
        let kv = pool.allocate(Tag::KvCache, 1 << 20).unwrap();
        let w = pool.allocate(Tag::Weights, 1 << 20).unwrap();
        fill(&kv, 9);
        let wdata = fill(&w, 5);
        pool.discard(&[Tag::KvCache]).unwrap();
        assert_eq!(pool.device_bytes().get(Tag::KvCache), 0);
        assert_eq!(pool.device_bytes().get(Tag::Weights), 1 << 20);
        assert!(!pool.is_awake(Tag::KvCache) && pool.is_awake(Tag::Weights));
        pool.wake(&[Tag::KvCache]).unwrap();
        let mut back = vec![1u8; kv.len()];
        kv.read_bytes(0, &mut back).unwrap();
        assert!(back.iter().all(|&b| b == 0), "fresh pages are zeroed");
        w.read_bytes(0, &mut back).unwrap();
        assert!(back == wdata, "weights untouched");
    }

    #[test]
    fn a_held_chunk_pins_its_pages_across_release() {
        let pool = Pool::default();
        let r = pool.allocate(Tag::KvCache, 1 << 20).unwrap();
        fill(&r, 1);
        let pinned = r.chunks()[0].chunk.clone();
        pool.discard(&[Tag::KvCache]).unwrap();
        assert_eq!(r.physical_bytes(), 0, "the region holds nothing");
        assert_eq!(
            pinned.physical_bytes(),
            pinned.len() as u64,
            "but the held chunk keeps its pages"
        );
        assert_eq!(
            pool.device_bytes().get(Tag::KvCache),
            pinned.len() as u64,
            "and they are counted"
        );
        assert_eq!(pool.pinned_bytes(), pinned.len() as u64);
        drop(pinned);
        assert_eq!(
            pool.device_bytes().total(),
            0,
            "freed when the last holder lets go"
        );
        assert_eq!(pool.pinned_bytes(), 0);
    }

    #[test]
    fn a_reservation_filled_part_by_part_reaches_the_chunks() {
        let pool = Pool::new(PoolOptions {
            chunk_size: 64 << 10,
            single_allocation: false,
        });
        let r = pool.allocate(Tag::KvCache, 192 << 10).unwrap();
        let data = fill(&r, 4);
        let chunks = r.chunks();
        let mut m = FdMapping::reserve(r.len()).unwrap();
        // Out of order: the last chunk first, then the others.
        for c in chunks.iter().rev() {
            m.map_at(c.offset, c.chunk.raw_fd(), c.chunk.len()).unwrap();
        }
        // SAFETY: the whole range was just mapped, and nothing else writes it.
        let seen = unsafe { std::slice::from_raw_parts(m.base(), m.len()) };
        assert!(seen == &data[..], "every part shows its chunk's bytes");
        // SAFETY: in bounds and mapped read-write.
        unsafe { *m.base().add(70_000) = 0xEE };
        let mut b = [0u8];
        r.read_bytes(70_000, &mut b).unwrap();
        assert_eq!(b, [0xEE], "shared with the region");
    }

    #[test]
    fn map_at_refuses_what_would_fault_or_escape() {
        let page = page_size();
        let pool = Pool::new(PoolOptions {
            chunk_size: 64 << 10,
            single_allocation: false,
        });
        let r = pool.allocate(Tag::KvCache, 64 << 10).unwrap();
        let fd = r.chunks()[0].chunk.raw_fd();
        let mut m = FdMapping::reserve(128 << 10).unwrap();
        let refused = [
            (1, page),                     // misaligned offset
            (0, page + 1),                 // a partial page
            (0, 0),                        // empty
            (128 << 10, page),             // past the end
            (usize::MAX - page + 1, page), // overflowing
            (0, 128 << 10),                // longer than the file
        ];
        for (off, len) in refused {
            let e = m.map_at(off, fd, len).unwrap_err();
            assert_eq!(e.kind(), io::ErrorKind::InvalidInput, "({off}, {len}): {e}");
        }
        assert!(m.map_at(0, -1, page).is_err(), "a bad descriptor");
        assert!(FdMapping::reserve(0).is_err());
        m.map_at(64 << 10, fd, 64 << 10).unwrap();
    }

    #[test]
    fn bad_arguments_are_refused() {
        let pool = Pool::new(PoolOptions {
            chunk_size: 1000,
            single_allocation: false,
        });
        assert!(matches!(
            pool.allocate(Tag::Runtime, 10),
            Err(VmemError::BadChunkSize(..))
        ));
        assert!(matches!(
            Pool::default().allocate(Tag::Runtime, 0),
            Err(VmemError::ZeroLength)
        ));
    }
}
