//! Shared memory between an exporter and importers over a Unix socket.

use std::sync::Arc;
use std::time::{Duration, Instant};

use pdkv_transfer::frame::{Header, Limits, Target, HEADER_LEN};
use pdkv_transfer::shm::{recv_with_fds, ShmError, ShmExporter, ShmImporter};
use pdkv_transfer::{AccessError, Registry, RegistryOptions};
use pdkv_vmem::{Pool, PoolOptions, Tag};

const DL: Duration = Duration::from_secs(10);

fn sock_path(name: &str) -> std::path::PathBuf {
    let p = std::env::temp_dir().join(format!("pdkv-shm-{}-{name}.sock", std::process::id()));
    let _ = std::fs::remove_file(&p);
    p
}

#[test]
fn an_importer_copies_directly_and_every_check_holds() {
    let pool = Pool::new(PoolOptions { chunk_size: 64 << 10, single_allocation: false });
    let region = pool.allocate(Tag::KvCache, 512 << 10).unwrap();
    let registry = Arc::new(Registry::new(RegistryOptions { max_segments: 8, key_seed: Some(1) }));
    // A range starting mid-chunk: the importer must honour the skew.
    let off = (64 << 10) + 4096;
    let reg = registry.register(&region, off, 256 << 10).unwrap();
    let path = sock_path("copies");
    let exp = ShmExporter::bind(&path, registry.clone(), Limits::default()).unwrap();
    let imp = ShmImporter::connect(&path, Limits::default()).unwrap();

    let bad = pdkv_transfer::Registration { key: reg.key ^ 1, ..reg };
    assert!(matches!(
        imp.map(&bad, DL),
        Err(ShmError::Remote(e)) if e == AccessError::BadKey { segment: reg.segment }.into()
    ));
    let unknown = pdkv_transfer::Registration { segment: 77, ..reg };
    assert!(matches!(imp.map(&unknown, DL), Err(ShmError::Remote(_))));
    imp.map(&reg, DL).unwrap();

    let data: Vec<u8> = (0..100_000u32).map(|i| (i * 7) as u8).collect();
    imp.write(reg.segment, reg.epoch, 1000, &data).unwrap();
    let mut back = vec![0; data.len()];
    region.read_bytes(off + 1000, &mut back).unwrap();
    assert!(back == data, "the importer's write landed in the exporter's region");
    region.write_bytes(off, &[5; 64]).unwrap();
    let mut small = [0; 64];
    imp.read(reg.segment, reg.epoch, 0, &mut small).unwrap();
    assert_eq!(small, [5; 64]);

    assert!(matches!(
        imp.read(reg.segment, reg.epoch, reg.len - 10, &mut small),
        Err(ShmError::Remote(e)) if matches!(e, pdkv_transfer::frame::RemoteError::Access(AccessError::OutOfBounds { .. }))
    ));
    assert!(matches!(imp.write(reg.segment, reg.epoch + 1, 0, &[1]), Err(ShmError::Remote(_))));
    assert!(matches!(imp.read(reg.segment + 1, reg.epoch, 0, &mut small), Err(ShmError::NotMapped(_))));
    region.read_bytes(off + reg.len as usize - 10, &mut small[..10]).unwrap();
    assert_eq!(exp.peers(), 1);

    // Deregistration asks the importer to unmap and waits for its ack.
    exp.deregister(reg.segment, DL).unwrap();
    assert_eq!(imp.unmapped(), 1);
    assert!(matches!(imp.read(reg.segment, reg.epoch, 0, &mut small), Err(ShmError::NotMapped(_))));
    assert!(matches!(
        imp.map(&reg, DL),
        Err(ShmError::Remote(e)) if e == AccessError::NotRegistered { segment: reg.segment }.into()
    ));
    // Re-registered: a new epoch, mapped again.
    let again = registry.register(&region, off, 256 << 10).unwrap();
    imp.map(&again, DL).unwrap();
    imp.read(again.segment, again.epoch, 0, &mut small).unwrap();
    assert_eq!(small, [5; 64]);
    assert!(matches!(imp.read(again.segment, reg.epoch, 0, &mut small), Err(ShmError::Remote(_))), "old epoch refused");
}

#[test]
fn a_peer_that_never_acks_bounds_the_deregistration_by_its_deadline() {
    let pool = Pool::new(PoolOptions { chunk_size: 64 << 10, single_allocation: false });
    let region = pool.allocate(Tag::KvCache, 128 << 10).unwrap();
    let registry = Arc::new(Registry::new(RegistryOptions { max_segments: 8, key_seed: Some(2) }));
    let reg = registry.register(&region, 0, 128 << 10).unwrap();
    let path = sock_path("noack");
    let exp = ShmExporter::bind(&path, registry.clone(), Limits::default()).unwrap();

    // A hand-written peer: asks for the memfds, keeps them, never answers.
    let raw = std::os::unix::net::UnixStream::connect(&path).unwrap();
    let target = Target { segment: reg.segment, key: reg.key, epoch: reg.epoch, offset: 0, len: reg.len };
    std::io::Write::write_all(&mut &raw, &Header::MapReq { op: 1, target }.encode()).unwrap();
    let mut fds = Vec::new();
    let mut h = [0u8; HEADER_LEN];
    recv_with_fds(&raw, &mut h, &mut fds).unwrap();
    let header = Header::decode(&h, &Limits::default()).unwrap();
    assert!(matches!(header, Header::MapResp { op: 1, .. }));
    let mut layout = vec![0; header.data_len()];
    recv_with_fds(&raw, &mut layout, &mut fds).unwrap();
    assert_eq!(fds.len(), 2, "one memfd per 64 KiB chunk");

    let t0 = Instant::now();
    let err = exp.deregister(reg.segment, Duration::from_millis(200)).unwrap_err();
    let took = t0.elapsed();
    assert!(matches!(err, ShmError::UnmapTimeout { segment, ref peers } if segment == reg.segment && peers.len() == 1), "{err:?}");
    assert!(took >= Duration::from_millis(200) && took < Duration::from_secs(2), "{took:?}");
    assert!(registry.get(reg.segment).is_none(), "no new access is granted either way");
    drop(fds);
}
