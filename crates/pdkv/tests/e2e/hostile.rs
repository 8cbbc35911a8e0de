//! A 1P1D deployment (P, D and `pdkv proxy` as processes, SmolLM2, one KV
//! secret) under hostile connections: 3,000 idle HTTP connections on the
//! proxy and on each engine; on each KV port (P's control port, D's control
//! port and D's transfer port) 300 idle connections, garbage, a truncated
//! handshake and forged proofs; and a decode engine holding another
//! deployment's secret. Requests through the proxy all succeed with the
//! colocated engine's outputs, every KV load succeeds, the intruder's load
//! fails naming the secrets, and the servers close every idle connection
//! within their timeouts.

use std::time::{Duration, Instant};

use std::path::Path;

use pdkv_deploy::EngineRole;
use pdkv_testkit::{
    deploy::{Pd, Spec},
    hostile::forged_proof,
    http::{self, complete, wait_healthy},
    models::smollm2,
    proc::Proc,
    prom::metric,
    DEADLINE,
};
use pdkv_transfer::auth::Port;
use serde_json::{json, Value};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

/// Raises this process's descriptor limit (the servers inherit it) to at
/// least `need`, or fails saying why.
fn raise_nofile(need: u64) {
    let mut lim = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: plain syscalls on a local struct.
    unsafe {
        assert_eq!(libc::getrlimit(libc::RLIMIT_NOFILE, &mut lim), 0);
        if lim.rlim_cur < need {
            assert!(
                lim.rlim_max >= need,
                "this test needs {need} descriptors; the hard limit is {}",
                lim.rlim_max
            );
            lim.rlim_cur = need;
            assert_eq!(libc::setrlimit(libc::RLIMIT_NOFILE, &lim), 0);
        }
    }
}

/// `n` connections to `addr` that send nothing (and, with `garbage`, one
/// that sends 64 bytes of junk).
async fn hold(addr: &str, n: usize, garbage: bool) -> Vec<TcpStream> {
    let mut v = Vec::with_capacity(n + 1);
    for _ in 0..n {
        v.push(
            TcpStream::connect(addr)
                .await
                .unwrap_or_else(|e| panic!("connecting to {addr}: {e}")),
        );
    }
    if garbage {
        let mut g = TcpStream::connect(addr).await.unwrap();
        g.write_all(&[0xab; 64]).await.unwrap();
        v.push(g);
    }
    v
}

fn host_port(url: &str) -> String {
    url.trim_start_matches("http://")
        .trim_end_matches('/')
        .to_string()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn idle_and_garbage_connections_on_every_port_do_not_break_pd() {
    let Some(model) = smollm2("idle_and_garbage_connections_on_every_port_do_not_break_pd") else {
        return;
    };
    let model = model.to_str().unwrap().to_string();
    raise_nofile(16_384);
    // No idle connections kept: at their caps the servers close their
    // oldest idle connection for each newcomer, which would be this
    // client's own pooled one, and a request sent on it as it closes
    // fails to send (it did once in CI).
    let client = reqwest::Client::builder()
        .timeout(DEADLINE)
        .pool_max_idle_per_host(0)
        .build()
        .unwrap();
    let prompts: Vec<String> = (0..8)
        .map(|i| format!("Note {i}: the market opens at dawn and the baker sells bread. It sells"))
        .collect();
    let body = |p: &str| json!({"prompt": p, "max_tokens": 6, "temperature": 0});

    let colo = Spec::new(Path::new(&model), 128).start_colocated();
    wait_healthy(&client, &colo.url("/health")).await;
    let mut expected = Vec::new();
    for p in &prompts {
        expected.push(
            complete(&client, &colo.base, &body(p))
                .await
                .expect("colocated"),
        );
    }
    drop(colo);

    let Pd { p, d, proxy } = Spec::new(Path::new(&model), 128)
        .http_args(&["--header-timeout-s", "3"])
        .kv("kv_unproven_timeout_s", 2)
        .env("PDKV_KV_SECRET", "this deployment's KV secret, 42")
        .start_pd();
    wait_healthy(&client, &proxy.url("/health")).await;
    let info = |s: &Proc| {
        let (client, url) = (client.clone(), s.url("/kv_transfer/info"));
        async move {
            http::send(client.get(url))
                .await
                .json::<Value>()
                .await
                .unwrap()
        }
    };
    let (p_info, d_info) = (info(&p).await, info(&d).await);

    let mut held = Vec::new();
    for s in [&proxy, &p, &d] {
        held.extend(hold(&host_port(&s.base), 3000, false).await);
    }
    let kv_ports = [
        (&p_info["bootstrap_addr"], Port::Control),
        (&d_info["bootstrap_addr"], Port::Control),
        (&d_info["transfer_addr"], Port::Transfer),
    ];
    for (addr, port) in kv_ports {
        let addr = addr.as_str().unwrap();
        held.extend(hold(addr, 300, true).await);
        // A handshake cut short, and proofs made without the secret.
        let mut cut = TcpStream::connect(addr).await.unwrap();
        cut.write_all(b"PDKVAUTH\x01").await.unwrap();
        held.push(cut);
        for _ in 0..3 {
            let answer = forged_proof(addr, port).await;
            assert!(
                answer.starts_with(b"PDKVDENY"),
                "{addr}: a forged proof was not denied: {answer:?}"
            );
        }
    }

    // A decode engine of another deployment (another secret) loads from P:
    // its load fails naming the secrets, P is undisturbed.
    let intruder = Spec::new(Path::new(&model), 128)
        .env("PDKV_KV_SECRET", "another deployment's KV secret")
        .start_engine(EngineRole::Decode, "d9");
    let stolen = json!({
        "prompt": prompts[0], "max_tokens": 2, "temperature": 0,
        "kv_transfer_params": {"do_remote_prefill": true, "remote_engine_id": "p0",
                               "remote_bootstrap_addr": p_info["bootstrap_addr"], "transfer_id": "stolen"},
    });
    let r = http::send(client.post(intruder.url("/v1/completions")).json(&stolen)).await;
    let (status, text) = (r.status().as_u16(), r.text().await.unwrap());
    assert_eq!(status, 500, "{text}");
    assert!(
        text.contains("KV secret"),
        "the intruder's error names the secrets: {text}"
    );
    assert!(intruder.terminate().success());

    let mut slowest = Duration::ZERO;
    for (i, prompt) in prompts.iter().enumerate() {
        let t0 = Instant::now();
        let got = complete(&client, &proxy.base, &body(prompt)).await;
        slowest = slowest.max(t0.elapsed());
        assert_eq!(
            got.as_deref(),
            Ok(expected[i].as_str()),
            "request {i} through the proxy"
        );
    }
    println!(
        "{} requests beside {} held connections; slowest {slowest:?}",
        prompts.len(),
        held.len()
    );
    let m = pdkv_testkit::http::get_text(&client, &d.url("/metrics")).await;
    assert_eq!(
        metric(&m, "pdkv_kv_loads_ok_total"),
        Some(prompts.len() as f64),
        "{m}"
    );
    assert_eq!(metric(&m, "pdkv_kv_loads_failed_total"), Some(0.0));
    // The forged proofs (3 on each KV port) were counted as refused handshakes.
    assert!(
        metric(&m, "pdkv_kv_handshakes_refused_total").unwrap() >= 6.0,
        "{m}"
    );
    let pm = pdkv_testkit::http::get_text(&client, &p.url("/metrics")).await;
    assert!(
        metric(&pm, "pdkv_kv_handshakes_refused_total").unwrap() >= 3.0,
        "{pm}"
    );

    // Every held connection is closed by its server (HTTP at its 3 s header
    // timeout, the KV ports at their 2 s unproven bound).
    let deadline = Instant::now() + Duration::from_secs(60);
    let mut buf = [0u8; 256];
    for (i, c) in held.iter_mut().enumerate() {
        // Whatever the server says before it closes (an error), then EOF.
        let closed = tokio::time::timeout_at(deadline.into(), async {
            loop {
                match c.read(&mut buf).await {
                    Ok(0) | Err(_) => return,
                    Ok(_) => {}
                }
            }
        })
        .await;
        assert!(
            closed.is_ok(),
            "held connection {i} was not closed by its server"
        );
    }
    for s in [proxy, d, p] {
        assert!(s.terminate().success());
    }
}
