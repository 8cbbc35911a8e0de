//! Private regions: one anonymous mapping per region, aligned to the huge
//! page size and asked for transparent huge pages.
//!
//! A region that only this process reads (a model's running weights) does
//! not need to be a memfd: nothing maps it from outside. Kept private, its
//! pages can be 2 MiB ones where the kernel offers them for anonymous
//! memory (`/sys/kernel/mm/transparent_hugepage/enabled` is `always` or
//! `madvise`; shared memory has its own switch, often `never`), and a
//! stream over 100 MiB of weights then takes 50 TLB entries instead of
//! 25,600 — under virtualisation each miss is a two-level page walk.
//! Freeing works as for a memfd chunk: putting the reservation back over
//! the range drops the pages at once (they belong to no one else).

use std::io;

/// The huge page size asked for: the x86-64 and arm64 (4 KiB granule) PMD size.
pub(crate) const HUGE_PAGE: usize = 2 << 20;

/// Reserves `len` bytes of address space (`PROT_NONE`) starting at a
/// multiple of `align` (a power of two, a multiple of the page size).
pub(crate) fn reserve_aligned(len: usize, align: usize) -> io::Result<*mut u8> {
    debug_assert!(align.is_power_of_two());
    let span = len
        .checked_add(align)
        .ok_or_else(|| io::Error::new(io::ErrorKind::InvalidInput, "reservation too large"))?;
    let raw = crate::reserve(span)? as usize;
    let start = raw.next_multiple_of(align);
    let (head, tail) = (start - raw, raw + span - (start + len));
    // SAFETY: both ranges are the ends of the reservation just made, which
    // no one else knows; what stays is `[start, start+len)`.
    unsafe {
        if head > 0 {
            libc::munmap(raw as *mut libc::c_void, head);
        }
        if tail > 0 {
            libc::munmap((start + len) as *mut libc::c_void, tail);
        }
    }
    Ok(start as *mut u8)
}

/// Maps fresh zeroed private pages read-write over `[addr, addr+len)`,
/// asks for huge pages, and faults every page in now (as a memfd chunk's
/// `fallocate` and `MAP_POPULATE` do: the cost is paid here, not on the
/// first requests).
///
/// # Safety
/// `[addr, addr+len)` must lie inside a reservation the caller owns, and
/// nothing may hold references into it.
pub(crate) unsafe fn map_private_fixed(addr: *mut u8, len: usize) -> io::Result<()> {
    // SAFETY: MAP_FIXED replaces only the caller's own range (see # Safety).
    let p = unsafe {
        libc::mmap(
            addr as *mut libc::c_void,
            len,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_FIXED,
            -1,
            0,
        )
    };
    if p == libc::MAP_FAILED {
        return Err(io::Error::last_os_error());
    }
    // A kernel without transparent huge pages says EINVAL: small pages then.
    // SAFETY: advice on a mapping we own; it changes no contents.
    unsafe { libc::madvise(p, len, libc::MADV_HUGEPAGE) };
    // SAFETY: as above; populating writes nothing visible (zero pages).
    if unsafe { libc::madvise(p, len, libc::MADV_POPULATE_WRITE) } != 0 {
        // Before Linux 5.14: touch each page (a write, so it is not the
        // shared zero page).
        let page = crate::page_size();
        for off in (0..len).step_by(page) {
            // SAFETY: inside the mapping just made, read-write.
            unsafe { std::ptr::write_volatile(addr.add(off), 0u8) };
        }
    }
    Ok(())
}

/// Bytes of `[addr, addr+len)` that physical pages back now (`mincore`).
/// For private anonymous memory this is what the range really holds.
pub(crate) fn resident_bytes(addr: *mut u8, len: usize) -> u64 {
    let page = crate::page_size();
    let mut vec = vec![0u8; len.div_ceil(page)];
    // SAFETY: mincore writes one byte per page of the range into `vec`,
    // which has that many; the range is our own mapping.
    let rc = unsafe { libc::mincore(addr as *mut libc::c_void, len, vec.as_mut_ptr()) };
    if rc != 0 {
        return 0;
    }
    vec.iter().filter(|&&v| v & 1 == 1).count() as u64 * page as u64
}

/// Bytes of `[addr, addr+len)` in transparent huge pages now, from
/// `/proc/self/smaps` (0 where it cannot be read).
pub(crate) fn huge_page_bytes(addr: *mut u8, len: usize) -> u64 {
    let Ok(smaps) = std::fs::read_to_string("/proc/self/smaps") else {
        return 0;
    };
    let (lo, hi) = (addr as usize, addr as usize + len);
    let mut inside = false;
    let mut total = 0;
    for line in smaps.lines() {
        if let Some((range, _)) = line.split_once(' ') {
            if let Some((a, b)) = range.split_once('-') {
                if let (Ok(a), Ok(b)) = (usize::from_str_radix(a, 16), usize::from_str_radix(b, 16))
                {
                    inside = a < hi && b > lo;
                    continue;
                }
            }
        }
        if let Some(kb) = line.strip_prefix("AnonHugePages:") {
            if inside {
                let kb = kb.trim().trim_end_matches("kB").trim();
                total += kb.parse::<u64>().unwrap_or(0) * 1024;
            }
        }
    }
    total
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{Backing, Pool, Tag};

    fn pattern(len: usize, seed: u8) -> Vec<u8> {
        (0..len)
            .map(|i| (i as u8).wrapping_mul(31) ^ seed)
            .collect()
    }

    #[test]
    fn a_private_region_sleeps_and_wakes_at_the_same_aligned_address() {
        let pool = Pool::default();
        let w = pool
            .allocate_backed(Tag::Weights, (5 << 20) + 4096, Backing::Private)
            .unwrap();
        let _kv = pool.allocate(Tag::KvCache, 1 << 20).unwrap();
        let base = w.base();
        assert_eq!(base as usize % HUGE_PAGE, 0, "aligned for huge pages");
        assert_eq!(w.backing(), Backing::Private);
        assert!(w.chunks().is_empty(), "no memfd behind it");
        let len = w.len() as u64;
        assert_eq!(resident_bytes(base, w.len()), len, "populated up front");
        assert_eq!(pool.device_bytes().get(Tag::Weights), len);
        assert!(w.huge_page_bytes() <= len);
        let data = pattern(w.len(), 7);
        w.write_bytes(0, &data).unwrap();

        pool.offload(&[Tag::Weights]).unwrap();
        assert!(!w.is_mapped() && pool.is_awake(Tag::KvCache));
        assert_eq!(
            resident_bytes(base, w.len()),
            0,
            "the kernel freed the pages"
        );
        assert_eq!(pool.device_bytes().get(Tag::Weights), 0);
        assert_eq!(pool.device_bytes().get(Tag::KvCache), 1 << 20);
        assert_eq!(pool.host_backup_bytes(), len);

        pool.wake(&[Tag::Weights]).unwrap();
        assert_eq!(w.base(), base, "same virtual address");
        assert_eq!(pool.device_bytes().get(Tag::Weights), len);
        let mut back = vec![0u8; w.len()];
        w.read_bytes(0, &mut back).unwrap();
        assert!(back == data, "contents restored");

        pool.discard(&[Tag::Weights]).unwrap();
        assert_eq!(resident_bytes(base, w.len()), 0);
        assert_eq!(pool.host_backup_bytes(), 0);
        pool.wake(&[Tag::Weights]).unwrap();
        w.read_bytes(0, &mut back).unwrap();
        assert!(back.iter().all(|&b| b == 0), "fresh pages are zeroed");
        drop(w);
        assert_eq!(pool.device_bytes().get(Tag::Weights), 0, "dropped, freed");
    }

    #[test]
    fn an_aligned_reservation_is_exactly_the_asked_range() {
        let len = 3 * 4096;
        let p = reserve_aligned(len, HUGE_PAGE).unwrap();
        assert_eq!(p as usize % HUGE_PAGE, 0);
        // SAFETY: our own reservation, mapped read-write over its range only.
        unsafe { map_private_fixed(p, len) }.unwrap();
        assert_eq!(resident_bytes(p, len), len as u64);
        // SAFETY: in bounds and read-write.
        unsafe { *p.add(len - 1) = 9 };
        // SAFETY: our own mapping; nothing refers to it after this.
        assert_eq!(unsafe { libc::munmap(p as *mut libc::c_void, len) }, 0);
    }
}
