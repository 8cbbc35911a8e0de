//! A 1P1D deployment (P, D and `pdkv proxy` as processes, SmolLM2) under
//! hostile connections: 3,000 idle HTTP connections on the proxy and on
//! each engine, and 300 idle connections plus garbage on each KV port (P's
//! control port, D's control port and D's transfer port). Requests through
//! the proxy all succeed with the colocated engine's outputs, every KV load
//! succeeds, and the servers close every idle connection within their
//! timeouts.

mod common;

use std::time::{Duration, Instant};

use common::{complete, metric, smollm2_path, wait_healthy, Proc, DEADLINE};
use serde_json::{json, Value};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

/// Raises this process's descriptor limit (the servers inherit it) to at
/// least `need`, or fails saying why.
fn raise_nofile(need: u64) {
    let mut lim = libc::rlimit { rlim_cur: 0, rlim_max: 0 };
    // SAFETY: plain syscalls on a local struct.
    unsafe {
        assert_eq!(libc::getrlimit(libc::RLIMIT_NOFILE, &mut lim), 0);
        if lim.rlim_cur < need {
            assert!(lim.rlim_max >= need, "this test needs {need} descriptors; the hard limit is {}", lim.rlim_max);
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
        v.push(TcpStream::connect(addr).await.unwrap_or_else(|e| panic!("connecting to {addr}: {e}")));
    }
    if garbage {
        let mut g = TcpStream::connect(addr).await.unwrap();
        g.write_all(&[0xab; 64]).await.unwrap();
        v.push(g);
    }
    v
}

fn host_port(url: &str) -> String {
    url.trim_start_matches("http://").trim_end_matches('/').to_string()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn idle_and_garbage_connections_on_every_port_do_not_break_pd() {
    let Some(model) = smollm2_path("idle_and_garbage_connections_on_every_port_do_not_break_pd") else { return };
    let model = model.to_str().unwrap().to_string();
    raise_nofile(16_384);
    let client = reqwest::Client::builder().timeout(DEADLINE).build().unwrap();
    let prompts: Vec<String> =
        (0..8).map(|i| format!("Note {i}: the market opens at dawn and the baker sells bread. It sells")).collect();
    let body = |p: &str| json!({"prompt": p, "max_tokens": 6, "temperature": 0});

    let colo = Proc::start(&[], &["serve", "--port", "0", "--model", &model, "--num-kv-blocks", "128"]);
    wait_healthy(&client, &colo.url("/health")).await;
    let mut expected = Vec::new();
    for p in &prompts {
        expected.push(complete(&client, &colo.base, &body(p)).await.expect("colocated"));
    }
    drop(colo);

    let http = ["--header-timeout-s", "3"];
    let common = ["serve", "--port", "0", "--model", &model, "--num-kv-blocks", "128"];
    let kv = |role: &str| format!(r#"{{"kv_connector":"pdkv","kv_role":"{role}"}}"#);
    let (p_kv, d_kv) = (kv("kv_producer"), kv("kv_consumer"));
    let p = Proc::start(&[], &[&common[..], &http, &["--kv-transfer-config", &p_kv, "--engine-id", "p0"]].concat());
    let d = Proc::start(&[], &[&common[..], &http, &["--kv-transfer-config", &d_kv, "--engine-id", "d0"]].concat());
    let proxy = Proc::start(&[], &[&["proxy", "--port", "0", "--prefill", &p.base, "--decode", &d.base][..], &http].concat());
    wait_healthy(&client, &proxy.url("/health")).await;
    let info = |s: &Proc| {
        let (client, url) = (client.clone(), s.url("/kv_transfer/info"));
        async move { client.get(url).send().await.unwrap().json::<Value>().await.unwrap() }
    };
    let (p_info, d_info) = (info(&p).await, info(&d).await);

    let mut held = Vec::new();
    for s in [&proxy, &p, &d] {
        held.extend(hold(&host_port(&s.base), 3000, false).await);
    }
    for addr in [&p_info["bootstrap_addr"], &d_info["bootstrap_addr"], &d_info["transfer_addr"]] {
        held.extend(hold(addr.as_str().unwrap(), 300, true).await);
    }

    let mut slowest = Duration::ZERO;
    for (i, prompt) in prompts.iter().enumerate() {
        let t0 = Instant::now();
        let got = complete(&client, &proxy.base, &body(prompt)).await;
        slowest = slowest.max(t0.elapsed());
        assert_eq!(got.as_deref(), Ok(expected[i].as_str()), "request {i} through the proxy");
    }
    println!("{} requests beside {} held connections; slowest {slowest:?}", prompts.len(), held.len());
    let m = client.get(d.url("/metrics")).send().await.unwrap().text().await.unwrap();
    assert_eq!(metric(&m, "pdkv_kv_loads_ok_total"), Some(prompts.len() as f64), "{m}");
    assert_eq!(metric(&m, "pdkv_kv_loads_failed_total"), Some(0.0));

    // Every held connection is closed by its server (HTTP at its 3 s header
    // timeout, the KV ports within their unproven bounds).
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
        assert!(closed.is_ok(), "held connection {i} was not closed by its server");
    }
    for s in [proxy, d, p] {
        assert!(s.terminate().success());
    }
}
