//! The TCP driver against real sockets on 127.0.0.1.

use std::sync::Arc;
use std::time::{Duration, Instant};

use pdkv_testkit::hostile::forged_proof;
use pdkv_transfer::auth::{self, KvSecret, Port};
use pdkv_transfer::frame::{Header, Target, HEADER_LEN};
use pdkv_transfer::proto::{InitiatorConfig, TransferError};
use pdkv_transfer::tcp::{Agent, AgentConfig, BatchError};
use pdkv_transfer::{AccessError, Registration, Registry, RegistryOptions};
use pdkv_vmem::{Pool, PoolOptions, Region, Tag};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::tcp::{OwnedReadHalf, OwnedWriteHalf};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::watch;

const MIB: usize = 1 << 20;

fn cfg(slice: u64) -> AgentConfig {
    AgentConfig {
        conns_per_peer: 3,
        initiator: InitiatorConfig {
            max_slice: slice,
            max_inflight_per_conn: 4,
            ..Default::default()
        },
        ..Default::default()
    }
}

struct Side {
    pool: Pool,
    region: Arc<Region>,
    reg: Registration,
    agent: Agent,
}

async fn side(len: usize, seed: u64, slice: u64) -> Side {
    side_with(
        len,
        slice,
        RegistryOptions {
            max_segments: 64,
            key_seed: Some(seed),
            ..Default::default()
        },
    )
    .await
}

async fn side_with(len: usize, slice: u64, opts: RegistryOptions) -> Side {
    side_config(len, opts, cfg(slice)).await
}

/// Registry options with room for eight segments, keys from `seed`.
fn eight_segments(seed: u64) -> RegistryOptions {
    RegistryOptions {
        max_segments: 8,
        key_seed: Some(seed),
        ..Default::default()
    }
}

/// A side whose whole `len`-byte region is registered, its agent bound
/// with `config`.
async fn side_config(len: usize, opts: RegistryOptions, config: AgentConfig) -> Side {
    let pool = Pool::new(PoolOptions {
        chunk_size: 256 << 10,
        single_allocation: false,
    });
    let region = pool.allocate(Tag::KvCache, len).unwrap();
    let registry = Arc::new(Registry::new(opts));
    let reg = registry.register(&region, 0, len).unwrap();
    let agent = Agent::bind("127.0.0.1:0", registry, config).await.unwrap();
    Side {
        pool,
        region,
        reg,
        agent,
    }
}

fn pattern(len: usize, seed: u64) -> Vec<u8> {
    let mut s = seed;
    (0..len)
        .map(|_| {
            s = s
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            (s >> 56) as u8
        })
        .collect()
}

fn read_region(r: &Region, off: usize, len: usize) -> Vec<u8> {
    let mut v = vec![0; len];
    r.read_bytes(off, &mut v).unwrap();
    v
}

const DL: Duration = Duration::from_secs(10);

/// A TCP relay in front of a real agent that holds the initiator's bytes:
/// each connection forwards at most `budget` bytes towards the agent until
/// [`Relay::open`], then everything. Replies flow freely, and a close on
/// either side closes the other. A test uses it to stop a batch at a known
/// point ("the agent has seen nothing", "each connection delivered one
/// request") by an event, whatever the machine's speed.
struct Relay {
    addr: String,
    open: watch::Sender<bool>,
    task: tokio::task::JoinHandle<()>,
}

impl Relay {
    /// `budget`: bytes after each connection's handshake, which always passes.
    async fn start(to: std::net::SocketAddr, budget: u64) -> Relay {
        let budget = budget + (auth::HELLO_LEN + auth::PROOF_LEN) as u64;
        let l = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = l.local_addr().unwrap().to_string();
        let (open, open_rx) = watch::channel(false);
        let task = tokio::spawn(async move {
            while let Ok((client, _)) = l.accept().await {
                tokio::spawn(relay_conn(client, to, budget, open_rx.clone()));
            }
        });
        Relay { addr, open, task }
    }

    /// Lets every byte through from now on.
    fn open(&self) {
        self.open.send_replace(true);
    }

    /// `d` addressed through this relay.
    fn via(&self, d: pdkv_transfer::RemoteDescriptor) -> pdkv_transfer::RemoteDescriptor {
        pdkv_transfer::RemoteDescriptor {
            agent_addr: self.addr.clone(),
            ..d
        }
    }
}

impl Drop for Relay {
    fn drop(&mut self) {
        self.task.abort();
    }
}

async fn relay_conn(
    client: TcpStream,
    to: std::net::SocketAddr,
    budget: u64,
    open: watch::Receiver<bool>,
) {
    let Ok(server) = TcpStream::connect(to).await else {
        return;
    };
    let (cr, mut cw) = client.into_split();
    let (mut sr, sw) = server.into_split();
    let up = tokio::spawn(pump_gated(cr, sw, budget, open));
    let _ = tokio::io::copy(&mut sr, &mut cw).await;
    up.abort(); // the agent closed: close towards the initiator too (cw drops)
}

/// Forwards `r` to `w`, at most `budget` bytes until the gate opens; waits
/// for the gate at most `DL`.
async fn pump_gated(
    mut r: OwnedReadHalf,
    mut w: OwnedWriteHalf,
    budget: u64,
    mut open: watch::Receiver<bool>,
) {
    let mut buf = vec![0u8; 64 << 10];
    let mut sent = 0u64;
    loop {
        let room = if *open.borrow() {
            buf.len()
        } else {
            (budget - sent).min(buf.len() as u64) as usize
        };
        if room == 0 {
            match tokio::time::timeout(DL, open.wait_for(|o| *o)).await {
                Ok(Ok(_)) => continue,
                _ => return,
            }
        }
        let n = match r.read(&mut buf[..room]).await {
            Ok(0) | Err(_) => return,
            Ok(n) => n,
        };
        if w.write_all(&buf[..n]).await.is_err() {
            return;
        }
        sent += n as u64;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn many_concurrent_batches_from_many_tasks_land_correctly() {
    let server = Arc::new(side(8 * MIB, 1, 64 << 10).await);
    let client = Arc::new(side(8 * MIB, 2, 64 << 10).await);
    const TASKS: usize = 16;
    const PART: usize = 256 << 10; // each task: 4 transfers of 64 KiB..., sliced at 64 KiB
    let mut joins = Vec::new();
    for t in 0..TASKS {
        let (server, client) = (server.clone(), client.clone());
        joins.push(tokio::spawn(async move {
            // Task t owns [t*PART, (t+1)*PART) on both sides for its write, and
            // the upper 4 MiB of the client for reading back.
            let data = pattern(PART, t as u64 + 100);
            client.region.write_bytes(t * PART, &data).unwrap();
            // Two transfers per batch, crossing slice boundaries oddly.
            let cut = 100_003;
            let ops = vec![
                (
                    client
                        .agent
                        .local(&client.reg, (t * PART) as u64, cut)
                        .unwrap(),
                    server.agent.describe(&server.reg, (t * PART) as u64, cut),
                ),
                (
                    client
                        .agent
                        .local(&client.reg, (t * PART) as u64 + cut, PART as u64 - cut)
                        .unwrap(),
                    server
                        .agent
                        .describe(&server.reg, (t * PART) as u64 + cut, PART as u64 - cut),
                ),
            ];
            client
                .agent
                .write(ops, Some(format!("task {t}").into_bytes()), DL)
                .await
                .unwrap();
            let back = (4 * MIB + t * PART) as u64;
            let ops = vec![(
                server
                    .agent
                    .describe(&server.reg, (t * PART) as u64, PART as u64),
                client.agent.local(&client.reg, back, PART as u64).unwrap(),
            )];
            client.agent.read(ops, DL).await.unwrap();
            assert!(
                read_region(&client.region, back as usize, PART) == data,
                "task {t} read back its bytes"
            );
            data
        }));
    }
    let mut all = Vec::new();
    for j in joins {
        all.push(j.await.unwrap());
    }
    for (t, data) in all.iter().enumerate() {
        assert!(
            &read_region(&server.region, t * PART, PART) == data,
            "task {t}'s bytes landed on the server"
        );
    }
    // Every notification arrived, each after its batch's data.
    let mut notes = Vec::new();
    for _ in 0..TASKS {
        notes.push(
            String::from_utf8(server.agent.recv_notification(DL).await.unwrap().payload).unwrap(),
        );
    }
    notes.sort();
    let mut want: Vec<String> = (0..TASKS).map(|t| format!("task {t}")).collect();
    want.sort();
    assert_eq!(notes, want);
    let stats = client.agent.peer_stats().await;
    assert_eq!(stats.len(), 1);
    assert_eq!(stats[0].1.bytes_written, (TASKS * PART) as u64);
    assert_eq!(stats[0].1.bytes_read, (TASKS * PART) as u64);
    assert_eq!(stats[0].1.failures, [0; 4]);
}

/// Sends one raw frame and returns the header of the answer (None: closed).
/// A raw connection to the agent at `addr`, through the handshake (no
/// secret), ready for frames.
async fn shaken(addr: impl tokio::net::ToSocketAddrs) -> TcpStream {
    let mut s = TcpStream::connect(addr).await.unwrap();
    auth::connect(&mut s, &KvSecret::open(), Port::Transfer, DL)
        .await
        .expect("handshake");
    s
}

/// Whether the server closes `c` within `DL` (after whatever it says first,
/// a denial say).
async fn closed_by_server(c: &mut TcpStream) -> bool {
    let mut buf = [0u8; 128];
    tokio::time::timeout(DL, async {
        loop {
            match c.read(&mut buf).await {
                Ok(0) | Err(_) => return,
                Ok(_) => {}
            }
        }
    })
    .await
    .is_ok()
}

async fn raw(s: &mut TcpStream, h: Header, data: &[u8]) -> Option<Header> {
    s.write_all(&h.encode()).await.ok()?;
    s.write_all(data).await.ok()?;
    answer(s).await
}

async fn answer(s: &mut TcpStream) -> Option<Header> {
    let mut b = [0u8; HEADER_LEN];
    tokio::time::timeout(DL, s.read_exact(&mut b))
        .await
        .expect("an answer or a close, never a hang")
        .ok()?;
    let h = Header::decode(&b, &Default::default()).unwrap();
    let mut data = vec![0; h.data_len()];
    s.read_exact(&mut data).await.ok()?;
    Some(h)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_hostile_client_is_refused_every_time_and_others_keep_being_served() {
    let server = side(MIB, 3, 64 << 10).await;
    let good = side(MIB, 4, 64 << 10).await;
    let secret = pattern(MIB, 9);
    server.region.write_bytes(0, &secret).unwrap();
    let reg = server.reg;
    let addr = server.agent.local_addr();
    let target = |key, epoch, offset, len| Target {
        segment: reg.segment,
        key,
        epoch,
        offset,
        len,
    };

    let good_round = |n: u64| {
        let (good, server, secret) = (&good, &server, &secret);
        async move {
            let ops = vec![(
                server.agent.describe(&server.reg, 4096 * n, 4096),
                good.agent.local(&good.reg, 0, 4096).unwrap(),
            )];
            good.agent.read(ops, DL).await.unwrap();
            assert!(
                read_region(&good.region, 0, 4096)
                    == secret[4096 * n as usize..4096 * (n as usize + 1)]
            );
        }
    };

    let mut s = shaken(addr).await;
    let refusals: Vec<(Header, Vec<u8>, AccessError)> = vec![
        (
            Header::WriteReq {
                op: 1,
                target: target(reg.key ^ 1, reg.epoch, 0, 8),
            },
            vec![0xAA; 8],
            AccessError::BadKey {
                segment: reg.segment,
            },
        ),
        (
            Header::ReadReq {
                op: 2,
                target: target(reg.key ^ 1, reg.epoch, 0, 8),
            },
            vec![],
            AccessError::BadKey {
                segment: reg.segment,
            },
        ),
        (
            Header::ReadReq {
                op: 3,
                target: target(reg.key, reg.epoch, MIB as u64 - 4, 8),
            },
            vec![],
            AccessError::OutOfBounds {
                offset: MIB as u64 - 4,
                len: 8,
                registered: MIB as u64,
            },
        ),
        (
            Header::WriteReq {
                op: 4,
                target: target(reg.key, reg.epoch, u64::MAX - 2, 8),
            },
            vec![0xAA; 8],
            AccessError::OutOfBounds {
                offset: u64::MAX - 2,
                len: 8,
                registered: MIB as u64,
            },
        ),
        (
            Header::WriteReq {
                op: 5,
                target: target(reg.key, reg.epoch + 5, 0, 8),
            },
            vec![0xAA; 8],
            AccessError::StaleEpoch {
                have: reg.epoch + 5,
                want: reg.epoch,
            },
        ),
        (
            Header::ReadReq {
                op: 6,
                target: Target {
                    segment: 999,
                    ..target(reg.key, reg.epoch, 0, 8)
                },
            },
            vec![],
            AccessError::UnknownSegment { segment: 999 },
        ),
    ];
    for (n, (h, data, want)) in refusals.into_iter().enumerate() {
        let got = raw(&mut s, h, &data).await;
        match got {
            Some(Header::Error { error, .. }) => assert_eq!(error, want.into()),
            other => panic!("expected a refusal {want:?}, got {other:?}"),
        }
        good_round(n as u64).await;
    }
    assert!(
        read_region(&server.region, 0, MIB) == secret,
        "no refused write touched memory"
    );
    assert_eq!(server.agent.serve_stats().refused_total(), 6);

    // Old epoch after re-registration: refused, never the stale pages.
    server.pool.discard(&[Tag::KvCache]).unwrap();
    server.pool.wake(&[Tag::KvCache]).unwrap();
    let fresh = pattern(MIB, 10);
    server.region.write_bytes(0, &fresh).unwrap();
    let new = server
        .agent
        .registry()
        .register(&server.region, 0, MIB)
        .unwrap();
    assert_eq!(new.epoch, reg.epoch + 1);
    let got = raw(
        &mut s,
        Header::ReadReq {
            op: 7,
            target: target(reg.key, reg.epoch, 0, 16),
        },
        &[],
    )
    .await;
    assert!(
        matches!(got, Some(Header::Error { error, .. }) if error == AccessError::StaleEpoch { have: 1, want: 2 }.into())
    );
    let old_desc = server.agent.describe(&reg, 0, 4096);
    let err = good
        .agent
        .read(
            vec![(old_desc, good.agent.local(&good.reg, 0, 4096).unwrap())],
            DL,
        )
        .await
        .unwrap_err();
    assert!(
        matches!(err, BatchError::Transfer(TransferError::Remote(_))),
        "{err:?}"
    );
    let new_desc = server.agent.describe(&new, 0, 4096);
    good.agent
        .read(
            vec![(new_desc, good.agent.local(&good.reg, 0, 4096).unwrap())],
            DL,
        )
        .await
        .unwrap();
    assert!(
        read_region(&good.region, 0, 4096) == fresh[..4096],
        "the new epoch serves the new pages"
    );

    // Garbage after the handshake: each kind closes that connection only.
    let garbage: Vec<Vec<u8>> = vec![
        b"GET / HTTP/1.1\r\nHost: x\r\n\r\n"
            .iter()
            .copied()
            .cycle()
            .take(HEADER_LEN)
            .collect(),
        {
            let mut h = Header::ReadReq {
                op: 1,
                target: target(new.key, new.epoch, 0, 8),
            }
            .encode();
            h[5] = 200;
            h.to_vec()
        },
        {
            let mut h = Header::WriteReq {
                op: 1,
                target: target(new.key, new.epoch, 0, 8),
            }
            .encode();
            h[8..12].copy_from_slice(&u32::MAX.to_le_bytes());
            h.to_vec()
        },
        Header::WriteAck { op: 1 }.encode().to_vec(),
    ];
    for (n, g) in garbage.into_iter().enumerate() {
        let mut bad = shaken(addr).await;
        bad.write_all(&g).await.unwrap();
        let mut b = [0u8; 1];
        let r = tokio::time::timeout(DL, bad.read(&mut b))
            .await
            .expect("closed, not hung");
        assert!(
            matches!(r, Ok(0) | Err(_)),
            "garbage {n}: the connection is closed"
        );
        let ops = vec![(
            server.agent.describe(&new, 0, 4096),
            good.agent.local(&good.reg, 0, 4096).unwrap(),
        )];
        good.agent.read(ops, DL).await.unwrap();
    }
    assert_eq!(
        server
            .agent
            .serve_stats()
            .malformed
            .load(std::sync::atomic::Ordering::Relaxed),
        4
    );
    assert!(read_region(&server.region, 0, MIB) == fresh);
}

/// A fake peer that takes one request's header and then dies (closes) or
/// hangs (keeps the socket, never answers).
async fn fake_peer(die: bool) -> (String, tokio::task::JoinHandle<()>) {
    let l = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = l.local_addr().unwrap().to_string();
    let task = tokio::spawn(async move {
        let mut held = Vec::new();
        loop {
            let (mut s, _) = l.accept().await.unwrap();
            auth::accept(&mut s, &KvSecret::open(), Port::Transfer, DL)
                .await
                .expect("the client's handshake");
            let mut b = [0u8; HEADER_LEN];
            if die {
                tokio::spawn(async move {
                    let _ = s.read_exact(&mut b).await;
                    drop(s);
                });
            } else {
                held.push(s);
            }
        }
    });
    (addr, task)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dead_peer_fails_with_peer_lost_and_a_hung_one_by_the_deadline() {
    let client = side(4 * MIB, 5, 64 << 10).await;
    let remote = Registration {
        segment: 1,
        key: 2,
        epoch: 1,
        len: 4 * MIB as u64,
    };
    for die in [true, false] {
        let (addr, task) = fake_peer(die).await;
        let desc = pdkv_transfer::RemoteDescriptor::new(addr, &remote, 0, 4 * MIB as u64);
        let deadline = Duration::from_millis(if die { 5000 } else { 300 });
        let t0 = Instant::now();
        let err = client
            .agent
            .write(
                vec![(
                    client.agent.local(&client.reg, 0, 4 * MIB as u64).unwrap(),
                    desc,
                )],
                None,
                deadline,
            )
            .await
            .unwrap_err();
        let took = t0.elapsed();
        if die {
            assert!(
                matches!(err, BatchError::Transfer(TransferError::PeerLost)),
                "{err:?}"
            );
        } else {
            assert!(
                matches!(err, BatchError::Transfer(TransferError::Timeout)),
                "{err:?}"
            );
            assert!(took >= deadline, "not before the deadline");
        }
        assert!(
            took < deadline + Duration::from_secs(1),
            "by the deadline: {took:?}"
        );
        task.abort();
    }
}

#[test]
fn a_real_agent_killed_mid_transfer_fails_the_batch_with_peer_lost() {
    // The server agent lives in its own runtime; shutting that runtime down
    // drops its tasks and closes its sockets, as a killed process would.
    let server_rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()
        .unwrap();
    const SERVER: usize = 512 * MIB;
    let server = server_rt.block_on(side(SERVER, 6, MIB as u64));
    let stats = server.agent.serve_stats().clone();
    let client_rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()
        .unwrap();
    client_rt.block_on(async {
        let client = side(16 * MIB, 7, MIB as u64).await;
        // Each connection delivers exactly one 1 MiB write frame, then the
        // relay holds the rest: the batch cannot end before the kill.
        let relay = Relay::start(server.agent.local_addr(), (HEADER_LEN + MIB) as u64).await;
        let local = client.agent.local(&client.reg, 0, 16 * MIB as u64).unwrap();
        let ops: Vec<_> = (0..32u64)
            .map(|i| {
                (
                    local.clone(),
                    relay.via(server.agent.describe(
                        &server.reg,
                        i * 16 * MIB as u64,
                        16 * MIB as u64,
                    )),
                )
            })
            .collect();
        let progress = stats.progress.notified();
        let t0 = Instant::now();
        let batch = client
            .agent
            .start(pdkv_transfer::proto::Direction::Write, ops, None, DL)
            .await
            .unwrap();
        tokio::time::timeout(DL, progress)
            .await
            .expect("the server served a slice");
        server_rt.shutdown_background();
        let res = batch.wait().await;
        assert_eq!(res, Err(TransferError::PeerLost));
        assert!(t0.elapsed() < DL, "failed by the deadline");
        let landed = stats.bytes_in.load(std::sync::atomic::Ordering::Relaxed);
        assert!(
            landed >= MIB as u64 && landed <= 3 * MIB as u64,
            "one slice per connection at most: {landed}"
        );
    });
    drop(server);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn deregistering_under_an_operation_in_flight_ends_it_cleanly() {
    let server = side(2 * MIB, 8, 256 << 10).await;
    let client = side(64 * MIB, 9, 256 << 10).await;
    // Each connection delivers one read request, then the relay holds the
    // rest until the segment is gone: the batch is in flight, by construction.
    let relay = Relay::start(server.agent.local_addr(), HEADER_LEN as u64).await;
    let desc = relay.via(server.agent.describe(&server.reg, 0, 2 * MIB as u64));
    // 32 reads of the same remote range into distinct local ranges.
    let ops: Vec<_> = (0..32u64)
        .map(|i| {
            (
                client
                    .agent
                    .local(&client.reg, i * 2 * MIB as u64, 2 * MIB as u64)
                    .unwrap(),
                desc.clone(),
            )
        })
        .collect();
    let progress = server.agent.serve_stats().progress.notified();
    let batch = client
        .agent
        .start(pdkv_transfer::proto::Direction::Read, ops, None, DL)
        .await
        .unwrap();
    tokio::time::timeout(DL, progress)
        .await
        .expect("the server served a slice");
    assert!(server.agent.registry().deregister(server.reg.segment));
    relay.open();
    let res = tokio::time::timeout(DL + Duration::from_secs(1), batch.wait())
        .await
        .expect("never hangs");
    assert_eq!(
        res,
        Err(TransferError::Remote(
            AccessError::NotRegistered {
                segment: server.reg.segment
            }
            .into()
        ))
    );
    // The next access is refused.
    let err = client
        .agent
        .read(
            vec![(
                server.agent.describe(&server.reg, 0, 8),
                client.agent.local(&client.reg, 0, 8).unwrap(),
            )],
            DL,
        )
        .await;
    assert!(matches!(
        err,
        Err(BatchError::Transfer(TransferError::Remote(_)))
    ));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cancel_ends_a_batch_at_once_and_the_peer_stays_usable() {
    let server = side(16 * MIB, 10, 256 << 10).await;
    let client = side(16 * MIB, 11, 256 << 10).await;
    // The relay delivers nothing until opened: the batch cannot finish
    // before the cancel, and it ends without waiting for the server.
    let relay = Relay::start(server.agent.local_addr(), 0).await;
    // The cancelled batch covers [0, 8 MiB) on both sides; the check after
    // it uses [12 MiB, +4 KiB), which late slices of it cannot reach.
    let desc = relay.via(server.agent.describe(&server.reg, 0, 8 * MIB as u64));
    let local = client.agent.local(&client.reg, 0, 8 * MIB as u64).unwrap();
    let ops = vec![(local, desc)];
    let batch = client
        .agent
        .start(pdkv_transfer::proto::Direction::Write, ops, None, DL)
        .await
        .unwrap();
    batch.cancel();
    assert_eq!(batch.wait().await, Err(TransferError::Cancelled));
    assert_eq!(
        server
            .agent
            .serve_stats()
            .bytes_in
            .load(std::sync::atomic::Ordering::Relaxed),
        0,
        "ended before any byte arrived"
    );
    // The slices already on the wire reach the server now; the connections
    // carry on, and the next batch over them lands.
    relay.open();
    let data = pattern(4096, 3);
    let at = 12 * MIB;
    client.region.write_bytes(at, &data).unwrap();
    let ops = vec![(
        client.agent.local(&client.reg, at as u64, 4096).unwrap(),
        relay.via(server.agent.describe(&server.reg, at as u64, 4096)),
    )];
    client.agent.write(ops, None, DL).await.unwrap();
    assert!(read_region(&server.region, at, 4096) == data);
    let stats = client.agent.peer_stats().await;
    assert_eq!(stats[0].1.failures, [0, 0, 1, 0]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_grant_confines_writes_and_revoke_fences_them_even_mid_payload() {
    use pdkv_transfer::{GrantHook, RevokeError};
    // The server tells the test each time it hands out an access through a grant.
    let (used_tx, mut used) = tokio::sync::mpsc::unbounded_channel();
    let hook = GrantHook(Arc::new(move |segment, key| {
        let _ = used_tx.send((segment, key));
    }));
    let opts = RegistryOptions {
        key_seed: Some(12),
        on_grant_use: Some(hook),
        ..Default::default()
    };
    let server = side_with(4 * MIB, 64 << 10, opts).await;
    let client = side(4 * MIB, 13, 64 << 10).await;
    let registry = server.agent.registry().clone();
    const AT: u64 = MIB as u64;
    const LEN: usize = 64 << 10;
    let grant = registry.grant(&server.reg, &[(AT, LEN as u64)]).unwrap();
    let write = |offset: u64, seed: u64| {
        let (client, server) = (&client, &server);
        async move {
            client.region.write_bytes(0, &pattern(LEN, seed)).unwrap();
            let ops = vec![(
                client.agent.local(&client.reg, 0, LEN as u64).unwrap(),
                server.agent.describe_grant(&grant, offset, LEN as u64),
            )];
            client.agent.write(ops, None, DL).await
        }
    };
    let next_use = |used: &mut tokio::sync::mpsc::UnboundedReceiver<(u64, u64)>| {
        let got = used.try_recv();
        assert_eq!(
            got,
            Ok((grant.segment, grant.key)),
            "the write went through the grant"
        );
    };

    // Inside the grant: lands.
    write(AT, 1).await.unwrap();
    next_use(&mut used);
    assert!(read_region(&server.region, AT as usize, LEN) == pattern(LEN, 1));
    // Outside it (but inside the registration): refused, nothing changed.
    let before = read_region(&server.region, 0, 4 * MIB);
    let err = write(0, 2).await.unwrap_err();
    let outside = AccessError::OutsideGrant {
        segment: grant.segment,
        offset: 0,
        len: 64 << 10,
    };
    assert!(
        matches!(err, BatchError::Transfer(TransferError::Remote(e)) if e == outside.into()),
        "{err:?}"
    );
    assert!(read_region(&server.region, 0, 4 * MIB) == before);

    // Mid-payload: a raw peer sends a write's header and half its data; the
    // agent holds the access while it waits for the rest.
    let mut s = shaken(server.agent.local_addr()).await;
    let target = Target {
        segment: grant.segment,
        key: grant.key,
        epoch: grant.epoch,
        offset: AT,
        len: LEN as u64,
    };
    let payload = pattern(LEN, 3);
    s.write_all(&Header::WriteReq { op: 1, target }.encode())
        .await
        .unwrap();
    s.write_all(&payload[..LEN / 2]).await.unwrap();
    let got = tokio::time::timeout(DL, used.recv())
        .await
        .expect("the agent took the access");
    assert_eq!(got, Some((grant.segment, grant.key)));
    let reg2 = registry.clone();
    let held = tokio::task::spawn_blocking(move || {
        reg2.revoke(grant.segment, grant.key, Duration::from_millis(50))
    })
    .await
    .unwrap();
    assert_eq!(
        held,
        Err(RevokeError::InUse {
            segment: grant.segment,
            key: grant.key,
            accesses: 1
        })
    );
    let reg2 = registry.clone();
    let fence = tokio::task::spawn_blocking(move || reg2.revoke(grant.segment, grant.key, DL));
    s.write_all(&payload[LEN / 2..]).await.unwrap();
    assert!(
        matches!(answer(&mut s).await, Some(Header::WriteAck { op: 1 })),
        "the write in flight completes"
    );
    assert_eq!(
        fence.await.unwrap(),
        Ok(()),
        "the fence held until its last byte landed"
    );
    let fenced = read_region(&server.region, 0, 4 * MIB);
    assert!(fenced[AT as usize..AT as usize + LEN] == payload[..]);

    // After the fence: the same write is refused, and no byte changes.
    let err = write(AT, 4).await.unwrap_err();
    let revoked = AccessError::BadKey {
        segment: grant.segment,
    };
    assert!(
        matches!(err, BatchError::Transfer(TransferError::Remote(e)) if e == revoked.into()),
        "{err:?}"
    );
    let got = raw(&mut s, Header::WriteReq { op: 2, target }, &pattern(LEN, 5)).await;
    assert!(matches!(got, Some(Header::Error { op: 2, error }) if error == revoked.into()));
    assert!(
        read_region(&server.region, 0, 4 * MIB) == fenced,
        "no byte changed after the fence"
    );
    assert!(
        used.try_recv().is_err(),
        "no access was handed out after the revoke"
    );
    let stats = server.agent.serve_stats();
    assert_eq!(
        stats.refused[2].load(std::sync::atomic::Ordering::Relaxed),
        2,
        "bad key (revoked)"
    );
    assert_eq!(
        stats.refused[7].load(std::sync::atomic::Ordering::Relaxed),
        1,
        "outside the grant"
    );
    // The registration's own key still writes.
    let ops = vec![(
        client.agent.local(&client.reg, 0, 4096).unwrap(),
        server.agent.describe(&server.reg, AT, 4096),
    )];
    client.agent.write(ops, None, DL).await.unwrap();
}

/// At the connection cap, clients that connect and idle (or send garbage or
/// a stale key) give way to a real peer: the oldest unproven connection is
/// closed for each newcomer, the peer's writes land, and a proven
/// connection is never the one closed. Unproven connections are closed at
/// their (short) timeout.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn idle_and_hostile_connections_at_the_cap_do_not_keep_a_real_peer_out() {
    let server_cfg = AgentConfig {
        max_conns: 8,
        unproven_timeout: Duration::from_secs(3),
        ..cfg(64 << 10)
    };
    let server_side = side_config(MIB, eight_segments(9), server_cfg).await;
    let (server, reg, region) = (&server_side.agent, server_side.reg, &server_side.region);
    let addr = server.local_addr();

    // 30 idle connections, one sending garbage, one presenting a stale key:
    // far more than the 8 slots.
    let mut idle = Vec::new();
    for _ in 0..30 {
        idle.push(TcpStream::connect(addr).await.unwrap());
    }
    let mut garbage = TcpStream::connect(addr).await.unwrap();
    garbage.write_all(&[0xff; HEADER_LEN]).await.unwrap();
    let mut stale = shaken(addr).await;
    let d = server.describe(&reg, 0, 16);
    let bad = Target {
        segment: d.segment,
        key: d.key ^ 1,
        epoch: d.epoch,
        offset: d.offset,
        len: 16,
    };
    let refused = raw(
        &mut stale,
        Header::WriteReq { op: 1, target: bad },
        &[0; 16],
    )
    .await;
    assert!(matches!(refused, Some(Header::Error { .. })), "{refused:?}");

    // A real peer's write lands all the same.
    let client = side(MIB, 3, 64 << 10).await;
    let data = pattern(256 << 10, 5);
    write_lands(&client, server, &reg, &data, "the real peer's write").await;
    assert!(read_region(region, 0, data.len()) == data);
    let evicted = server
        .serve_stats()
        .evicted
        .load(std::sync::atomic::Ordering::Relaxed);
    assert!(evicted > 0, "room was made by closing unproven connections");
    // Again, now that the peer's connections are proven: more newcomers do
    // not close them (the next write needs no new connection).
    for _ in 0..20 {
        idle.push(TcpStream::connect(addr).await.unwrap());
    }
    let again = pattern(64 << 10, 6);
    write_lands(&client, server, &reg, &again, "the second write").await;
    assert!(read_region(region, 0, again.len()) == again);
    let stats = client.agent.peer_stats().await;
    assert_eq!(
        stats[0].1.failures, [0; 4],
        "no connection of the peer failed"
    );

    // Every unproven connection still open is closed at its timeout (the
    // garbage one after a denial of its "handshake").
    for (i, c) in idle
        .iter_mut()
        .chain([&mut garbage, &mut stale])
        .enumerate()
    {
        assert!(closed_by_server(c).await, "connection {i} was not closed");
    }
}

/// `client` puts `data` at the start of its region and writes it to the
/// start of `reg` at `server`; the write must succeed (`what` names it).
async fn write_lands(client: &Side, server: &Agent, reg: &Registration, data: &[u8], what: &str) {
    client.region.write_bytes(0, data).unwrap();
    let len = data.len() as u64;
    let ops = vec![(
        client.agent.local(&client.reg, 0, len).unwrap(),
        server.describe(reg, 0, len),
    )];
    client.agent.write(ops, None, DL).await.expect(what);
}

/// Agents holding the same secret move data; one holding another secret is
/// refused with an error that names the secrets, and so are forged proofs,
/// proofs for another port, truncated hellos and garbage — none of which
/// disturbs a transfer between the real peers running at the same time.
/// With a secret, a connection that completed the handshake is proven:
/// unproven floods at the cap never close it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn only_peers_holding_the_deployment_secret_get_in_and_the_rest_never_disturb_them() {
    let secret = KvSecret::new("correct horse battery staple").unwrap();
    let with = |secret: &KvSecret| AgentConfig {
        secret: secret.clone(),
        max_conns: 16,
        unproven_timeout: Duration::from_secs(3),
        ..cfg(64 << 10)
    };
    let agent = |len: usize, seed: u64, c: AgentConfig| side_config(len, eight_segments(seed), c);
    let server = agent(4 * MIB, 21, with(&secret)).await;
    let client = agent(4 * MIB, 22, with(&secret)).await;
    let intruder = agent(
        MIB,
        23,
        with(&KvSecret::new("another deployment's secret").unwrap()),
    )
    .await;
    let open = agent(MIB, 24, with(&KvSecret::open())).await;
    let addr = server.agent.local_addr();
    let stats = server.agent.serve_stats().clone();
    let refused = || {
        stats
            .auth_refused
            .load(std::sync::atomic::Ordering::Relaxed)
    };

    // The real peer writes, and keeps its connections (proven).
    let data = pattern(4 * MIB, 7);
    client.region.write_bytes(0, &data).unwrap();
    let write_all = || {
        let ops = vec![(
            client.agent.local(&client.reg, 0, 4 * MIB as u64).unwrap(),
            server.agent.describe(&server.reg, 0, 4 * MIB as u64),
        )];
        client.agent.write(ops, None, DL)
    };
    write_all().await.expect("the peer holding the secret");

    // Peers without the secret: refused on connect, and told why.
    for (who, side) in [("another secret", &intruder), ("no secret", &open)] {
        let ops = vec![(
            side.agent.local(&side.reg, 0, 4096).unwrap(),
            server.agent.describe(&server.reg, 0, 4096),
        )];
        let err = side.agent.write(ops, None, DL).await.unwrap_err();
        let BatchError::Connect { reason, .. } = &err else {
            panic!("{who}: {err:?}")
        };
        assert!(reason.contains("KV secret"), "{who}: {reason}");
    }
    // Forged proofs, for this port and for another: denied.
    for port in [Port::Transfer, Port::Control] {
        let answer = forged_proof(&addr.to_string(), port).await;
        assert!(answer.starts_with(b"PDKVDENY"), "{port}: {answer:?}");
    }
    // Truncated hellos and garbage, then a flood of idle connections past the
    // cap; the real peer writes between each.
    let mut idle = Vec::new();
    for bytes in [
        &b"PDKVAUTH\x01\x01"[..],
        &[0xab; 64][..],
        &Header::WriteAck { op: 1 }.encode()[..],
    ] {
        let mut s = TcpStream::connect(addr).await.unwrap();
        s.write_all(bytes).await.unwrap();
        idle.push(s);
        write_all().await.expect("a write beside garbage");
    }
    for _ in 0..40 {
        idle.push(TcpStream::connect(addr).await.unwrap());
    }
    write_all().await.expect("a write beside the flood");
    assert!(read_region(&server.region, 0, 4 * MIB) == data);
    let stats_c = client.agent.peer_stats().await;
    assert_eq!(
        stats_c[0].1.failures, [0; 4],
        "no connection of the real peer failed"
    );
    // Every refused handshake counted, once its connection closed: 2 peers
    // (each with its connections), 2 forged proofs, then the garbage.
    for c in &mut idle {
        assert!(
            closed_by_server(c).await,
            "a connection that never proved itself stays open"
        );
    }
    assert!(refused() >= 2 * 3 + 2, "handshakes refused: {}", refused());
    let _ = (&server.pool, &client.pool, &intruder.pool, &open.pool);
}
