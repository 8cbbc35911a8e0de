//! A registration of far more memfds than one message can carry, shared
//! over shared memory while the process may not hold them all open at once.
//!
//! Its own test binary: it lowers this process's descriptor limit, which
//! would disturb tests running beside it.

use std::sync::Arc;
use std::time::Duration;

use pdkv_transfer::frame::{Limits, Target};
use pdkv_transfer::proto::{Direction, Transfer};
use pdkv_transfer::shm::{check_shareable, ShmExporter, ShmImporter, MAX_FDS};
use pdkv_transfer::tcp::LocalSlice;
use pdkv_transfer::{Registry, RegistryOptions};
use pdkv_vmem::{Pool, PoolOptions, Tag};

const DL: Duration = Duration::from_secs(10);
const CHUNK: usize = 8 << 10;
const CHUNKS: usize = 700;

fn open_fds() -> usize {
    std::fs::read_dir("/proc/self/fd").unwrap().count()
}

/// Sets the soft limit on open descriptors; returns the old one.
fn set_nofile(soft: u64) -> u64 {
    let mut lim = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: getrlimit/setrlimit read and write a plain struct we own.
    unsafe {
        assert_eq!(libc::getrlimit(libc::RLIMIT_NOFILE, &mut lim), 0);
        let old = lim.rlim_cur;
        lim.rlim_cur = soft.min(lim.rlim_max);
        assert_eq!(libc::setrlimit(libc::RLIMIT_NOFILE, &lim), 0);
        old
    }
}

fn pattern(len: usize, seed: u8) -> Vec<u8> {
    (0..len)
        .map(|i| (i as u8).wrapping_mul(29).wrapping_add(seed) ^ (i >> 13) as u8)
        .collect()
}

#[test]
fn a_registration_of_700_memfds_is_mapped_in_batches_within_a_tight_descriptor_limit() {
    let pool = Pool::new(PoolOptions {
        chunk_size: CHUNK,
        single_allocation: false,
    });
    let remote = pool.allocate(Tag::KvCache, CHUNKS * CHUNK).unwrap();
    let registry = Arc::new(Registry::new(RegistryOptions {
        key_seed: Some(21),
        ..Default::default()
    }));
    // Mid-chunk to mid-chunk: the skew is honoured and both ends are partial chunks.
    let (off, len) = (CHUNK / 2, (CHUNKS - 1) * CHUNK);
    let reg = registry.register(&remote, off, len).unwrap();
    assert_eq!(registry.chunk_count(reg.segment), Some(CHUNKS));
    check_shareable(CHUNKS, &Limits::default()).unwrap();

    // The importer's own registered memory, in one chunk.
    let local_pool = Pool::new(PoolOptions {
        chunk_size: len.next_multiple_of(4096),
        single_allocation: true,
    });
    let local = local_pool.allocate(Tag::KvCache, len).unwrap();
    let local_registry = Registry::new(RegistryOptions {
        key_seed: Some(22),
        ..Default::default()
    });
    let local_reg = local_registry.register(&local, 0, len).unwrap();

    let path = std::env::temp_dir().join(format!("pdkv-shm-many-{}.sock", std::process::id()));
    let _ = std::fs::remove_file(&path);
    let exp = ShmExporter::bind(&path, registry.clone(), Limits::default()).unwrap();
    exp.check_shareable(&reg).unwrap();
    let imp = ShmImporter::connect(&path, Limits::default()).unwrap();
    // A refused map: the exporter has accepted the connection and serves it,
    // so the descriptors counted below are all there is before the import.
    let wrong_key = pdkv_transfer::Registration {
        key: reg.key ^ 1,
        ..reg
    };
    assert!(imp.map(&wrong_key, DL).is_err());

    // From here the process may open two batches' worth of descriptors more
    // than it holds, far fewer than the registration's 700: mapping only
    // works if each batch is mapped and closed before the next arrives.
    let before = open_fds();
    let old_limit = set_nofile((before + 2 * MAX_FDS) as u64);
    assert!(
        before + 2 * MAX_FDS < before + CHUNKS,
        "the limit really is tighter than the registration"
    );
    imp.map(&reg, DL).unwrap();
    assert_eq!(open_fds(), before, "no descriptor of the import stays open");
    assert_eq!(imp.mapped_epoch(reg.segment), Some(reg.epoch));
    set_nofile(old_limit);

    // Direct copies: write through the import, read in the exporter's region.
    let data = pattern(len, 1);
    imp.write(reg.segment, reg.epoch, 0, &data).unwrap();
    let mut back = vec![0; len];
    remote.read_bytes(off, &mut back).unwrap();
    assert!(back == data, "every chunk of the import reaches its memfd");

    // Batches: read it all back into local memory, then write new bytes.
    let slice = LocalSlice::grant(&local_registry, &local_reg, 0, len as u64).unwrap();
    let target = Target {
        segment: reg.segment,
        key: reg.key,
        epoch: reg.epoch,
        offset: 0,
        len: len as u64,
    };
    let h = imp
        .start(
            Direction::Read,
            vec![Transfer {
                local: slice.clone(),
                remote: target,
            }],
            None,
            std::time::Instant::now() + DL,
        )
        .unwrap();
    h.wait_blocking().unwrap();
    local.read_bytes(0, &mut back).unwrap();
    assert!(back == data, "read back whole");
    let fresh = pattern(len, 2);
    local.write_bytes(0, &fresh).unwrap();
    let h = imp
        .start(
            Direction::Write,
            vec![Transfer {
                local: slice,
                remote: target,
            }],
            None,
            std::time::Instant::now() + DL,
        )
        .unwrap();
    h.wait_blocking().unwrap();
    remote.read_bytes(off, &mut back).unwrap();
    assert!(back == fresh, "written whole");
    // Bytes outside the registration, in its first and last chunks, untouched.
    let mut edge = vec![1; off];
    remote.read_bytes(0, &mut edge).unwrap();
    assert!(edge.iter().all(|&b| b == 0));
    remote.read_bytes(off + len, &mut edge).unwrap();
    assert!(edge.iter().all(|&b| b == 0));

    exp.deregister(reg.segment, DL).unwrap();
    assert_eq!(imp.unmapped(), 1, "the importer acked the unmap");
    assert_eq!(imp.mapped_epoch(reg.segment), None);
    assert!(registry.get(reg.segment).is_none());
}
