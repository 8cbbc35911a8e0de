//! A real publisher and puller, over loopback TCP and over shared memory:
//! the staged bytes equal the published checkpoint's; a corrupted tensor, a
//! mismatched model and a publisher that went away are refused, naming what
//! failed.

use std::time::Duration;

use pdkv_model::init::write_random_checkpoint;
use pdkv_model::loader::load_model;
use pdkv_model::weights::Weights;
use pdkv_model::Arch;
use pdkv_sync::{MismatchError, PublishOptions, Publisher, Puller, SyncError, Transport};
use pdkv_transfer::auth::KvSecret;
use pdkv_vmem::Pool;

const WAIT: Duration = Duration::from_secs(30);

fn weights(preset: &str, seed: u64, pool: &Pool) -> (tempfile::TempDir, Weights) {
    let dir = tempfile::tempdir().unwrap();
    write_random_checkpoint(Arch::Llama, preset, seed, dir.path()).unwrap();
    let m = load_model(dir.path(), pool, &mut |_| {}).unwrap();
    (dir, m.model.weights().clone())
}

fn bytes(w: &Weights) -> Vec<(String, Vec<u8>)> {
    w.named()
        .into_iter()
        .map(|(n, t)| {
            let mut b = vec![0; t.bytes()];
            w.region.read_bytes(t.offset, &mut b).unwrap();
            (n, b)
        })
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pull_over_tcp_stages_the_published_weights_and_refuses_what_does_not_match() {
    stages_and_refuses(Transport::Tcp).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pull_over_shared_memory_stages_the_published_weights_and_refuses_what_does_not_match() {
    stages_and_refuses(Transport::Shm).await
}

async fn stages_and_refuses(transport: Transport) {
    let (pool_a, pool_b) = (Pool::default(), Pool::default());
    let (_a_dir, running) = weights("tiny", 1, &pool_a);
    let (_b_dir, new) = weights("tiny", 2, &pool_b);
    // In the memory the publisher serves in place: a tensor is corrupted
    // under the manifest below.
    let new = pdkv_sync::shared_weights(new).unwrap();
    assert_ne!(bytes(&running), bytes(&new), "two different checkpoints");
    let publisher = Publisher::start(new.clone(), Some("v2".into()), PublishOptions::default())
        .await
        .unwrap();
    let puller = Puller::new(KvSecret::open(), 4)
        .await
        .unwrap()
        .with_transport(transport);

    let manifest = puller.manifest(&publisher.url()).await.unwrap();
    assert_eq!(&manifest, publisher.manifest());
    assert_eq!(manifest.version.as_deref(), Some("v2"));
    let mut staging = puller.stage(manifest.clone(), &running).await.unwrap();
    assert_eq!(staging.transport(), transport.name());
    // Half the tensors, then the rest: one sync in several chunks.
    let names: Vec<String> = manifest.tensors.iter().map(|t| t.name.clone()).collect();
    let (first, _) = names.split_at(names.len() / 2);
    let r = puller.pull(&mut staging, Some(first), WAIT).await.unwrap();
    assert_eq!(r.tensors, first.len());
    let e = staging.complete().expect_err("half the tensors");
    assert!(matches!(e, SyncError::Incomplete { .. }), "{e}");
    let r2 = puller.pull(&mut staging, None, WAIT).await.unwrap();
    assert_eq!(r.tensors + r2.tensors, names.len());
    assert_eq!(r.bytes + r2.bytes, manifest.bytes());
    assert_eq!(r.transport, transport.name());
    // Over TCP the publisher serves each byte once; over shared memory the
    // engine copies them itself, and the publisher's agent serves none.
    let served = match transport {
        Transport::Shm => 0,
        _ => manifest.bytes(),
    };
    assert_eq!(
        publisher.bytes_served_reaching(served, WAIT).await,
        served,
        "each byte read once"
    );
    let staged = staging.complete().unwrap();
    assert_eq!(
        bytes(&staged),
        bytes(&new),
        "the staged bytes are the published ones"
    );
    // Installing: the running region now holds the new weights.
    // SAFETY: no model runs in this test: nothing reads `running` meanwhile.
    unsafe { running.copy_from(&staged) }.unwrap();
    assert_eq!(bytes(&running), bytes(&new));

    // A tensor whose bytes changed under the manifest: its checksum is
    // refused, naming it, and it stays unpulled.
    let (name, t) = new.named()[3].clone();
    let t = t.clone();
    let mut b = vec![0u8; 4];
    new.region.read_bytes(t.offset, &mut b).unwrap();
    b[0] ^= 0x40;
    new.region.write_bytes(t.offset, &b).unwrap();
    let mut staging = puller.stage(manifest.clone(), &running).await.unwrap();
    let e = puller.pull(&mut staging, None, WAIT).await.unwrap_err();
    match &e {
        SyncError::Checksum { name: n, .. } => assert_eq!(n, &name),
        other => panic!("{other}"),
    }
    assert!(e.to_string().contains(&name), "{e}");
    assert!(staging.complete().is_err());

    // A model of another size: refused before a byte moves.
    let pool_c = Pool::default();
    let (_c_dir, other) = weights("small", 3, &pool_c);
    let e = puller
        .stage(manifest.clone(), &other)
        .await
        .err()
        .expect("a mismatch");
    match e {
        SyncError::Mismatch(MismatchError::Shape { name, .. }) => {
            assert_eq!(name, "model.embed_tokens.weight")
        }
        other => panic!("{other}"),
    }

    // The publisher goes away: the pull fails, naming the publisher (over
    // shared memory the mapping would still hold the bytes, but a pull does
    // not go on once its publisher is gone).
    let mut staging = puller.stage(manifest.clone(), &running).await.unwrap();
    let addr = match transport {
        Transport::Shm => manifest.shm.as_ref().expect("shared").path.clone(),
        _ => manifest.transfer_addr.clone(),
    };
    drop(publisher);
    let e = puller.pull(&mut staging, None, WAIT).await.unwrap_err();
    assert!(
        matches!(&e, SyncError::Transfer { addr: a, .. } if *a == addr),
        "{e}"
    );
}
