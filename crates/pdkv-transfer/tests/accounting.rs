//! Memory accounting under registrations, measured from the live memfds of
//! this process (its own test binary, so no other test's memory is counted).

use std::sync::Arc;

use pdkv_transfer::{Registry, RegistryOptions};
use pdkv_vmem::{Pool, PoolOptions, Tag};

/// The tests here measure the whole process; they run one at a time.
static SERIAL: std::sync::Mutex<()> = std::sync::Mutex::new(());

/// Physical bytes of every live `kv_cache` memfd in this process, whether
/// held by a descriptor or only by a mapping: what the machine really
/// holds, whoever holds it.
fn live_kv_memfd_bytes() -> u64 {
    use std::collections::HashMap;
    use std::os::unix::fs::MetadataExt;
    let mut by_inode: HashMap<u64, u64> = HashMap::new();
    for e in std::fs::read_dir("/proc/self/fd").unwrap().flatten() {
        let Ok(target) = std::fs::read_link(e.path()) else {
            continue;
        };
        if !target.to_string_lossy().starts_with("/memfd:pdkv-kv_cache") {
            continue;
        }
        if let Ok(m) = std::fs::metadata(e.path()) {
            by_inode.insert(m.ino(), m.blocks() * 512);
        }
    }
    // Memfds reachable only through a mapping: chunks are mapped whole, so
    // the largest mapping of an inode is its size.
    for line in std::fs::read_to_string("/proc/self/maps").unwrap().lines() {
        if !line.contains("/memfd:pdkv-kv_cache") {
            continue;
        }
        let f: Vec<&str> = line.split_whitespace().collect();
        let (lo, hi) = f[0].split_once('-').unwrap();
        let len = u64::from_str_radix(hi, 16).unwrap() - u64::from_str_radix(lo, 16).unwrap();
        let ino: u64 = f[4].parse().unwrap();
        let e = by_inode.entry(ino).or_insert(0);
        *e = (*e).max(len);
    }
    by_inode.values().sum()
}

/// A pool of 1 MiB chunks, one region of `len` bytes in it, and a
/// registry of four segments whose keys come from `seed`.
fn setup(len: usize, seed: u64) -> (Pool, Arc<pdkv_vmem::Region>, Arc<Registry>) {
    let pool = Pool::new(PoolOptions {
        chunk_size: 1 << 20,
        single_allocation: false,
    });
    let region = pool.allocate(Tag::KvCache, len).unwrap();
    let registry = Arc::new(Registry::new(RegistryOptions {
        max_segments: 4,
        key_seed: Some(seed),
        ..Default::default()
    }));
    (pool, region, registry)
}

#[test]
fn released_memory_is_freed_only_after_deregistration_and_the_last_access() {
    let _serial = SERIAL.lock().unwrap();
    const LEN: usize = 4 << 20;
    let (pool, region, registry) = setup(LEN, 1);
    assert_eq!(live_kv_memfd_bytes(), LEN as u64);

    // Register half the region: the two chunks under it are pinned.
    let reg = registry.register(&region, LEN / 4, LEN / 2).unwrap();
    let grant = registry.local(&reg, 0, 4096).unwrap();
    pool.discard(&[Tag::KvCache]).unwrap();
    assert_eq!(region.physical_bytes(), 0, "the region holds nothing");
    assert_eq!(
        live_kv_memfd_bytes(),
        (LEN / 2) as u64,
        "the registration still pins its two chunks"
    );
    assert_eq!(
        pool.device_bytes().get(Tag::KvCache),
        (LEN / 2) as u64,
        "and the pool counts them"
    );
    assert_eq!(pool.pinned_bytes(), (LEN / 2) as u64);

    // Waking maps fresh pages; the pinned old ones are still there too.
    pool.wake(&[Tag::KvCache]).unwrap();
    assert_eq!(live_kv_memfd_bytes(), (LEN + LEN / 2) as u64);

    assert!(registry.deregister(reg.segment));
    assert_eq!(
        live_kv_memfd_bytes(),
        (LEN + LEN / 2) as u64,
        "an access in flight keeps them"
    );
    drop(grant);
    assert_eq!(
        live_kv_memfd_bytes(),
        LEN as u64,
        "freed after deregistration and the last access"
    );
    assert_eq!(pool.device_bytes().get(Tag::KvCache), LEN as u64);
    assert_eq!(pool.pinned_bytes(), 0);

    // The fix's order: deregister, release, wake, register again -> nothing leaks.
    let reg = registry.register(&region, 0, LEN).unwrap();
    registry.deregister(reg.segment);
    pool.discard(&[Tag::KvCache]).unwrap();
    assert_eq!(live_kv_memfd_bytes(), 0);
    pool.wake(&[Tag::KvCache]).unwrap();
    let again = registry.register(&region, 0, LEN).unwrap();
    assert_eq!(again.epoch, reg.epoch + 1);
    assert_eq!(
        live_kv_memfd_bytes(),
        LEN as u64,
        "one set of pages, shared by region and registration"
    );
}

#[test]
fn shared_memory_is_freed_only_after_every_peer_acked_its_unmap() {
    use pdkv_transfer::frame::Limits;
    use pdkv_transfer::shm::{ShmExporter, ShmImporter};
    let _serial = SERIAL.lock().unwrap();
    const LEN: usize = 2 << 20;
    let (pool, region, registry) = setup(LEN, 2);
    let reg = registry.register(&region, 0, LEN).unwrap();
    let path = std::env::temp_dir().join(format!("pdkv-acct-{}.sock", std::process::id()));
    let _ = std::fs::remove_file(&path);
    let exp = ShmExporter::bind(&path, registry.clone(), Limits::default()).unwrap();
    let importers: Vec<ShmImporter> = (0..3)
        .map(|_| ShmImporter::connect(&path, Limits::default()).unwrap())
        .collect();
    for imp in &importers {
        imp.map(&reg, std::time::Duration::from_secs(10)).unwrap();
    }
    pool.discard(&[Tag::KvCache]).unwrap();
    assert_eq!(region.physical_bytes(), 0);
    assert_eq!(
        pool.device_bytes().total(),
        LEN as u64,
        "the registration pins the pages"
    );
    assert_eq!(
        live_kv_memfd_bytes(),
        LEN as u64,
        "registration and three peers' mappings pin the pages"
    );
    // Dropping the registry's registration alone would not free them: the
    // peers' mappings pin them too. The exporter waits for every ack.
    exp.deregister(reg.segment, std::time::Duration::from_secs(10))
        .unwrap();
    assert!(importers.iter().all(|i| i.unmapped() == 1));
    assert_eq!(
        live_kv_memfd_bytes(),
        0,
        "freed once every peer acked and the registration went"
    );
    assert_eq!(pool.device_bytes().total(), 0);
}
