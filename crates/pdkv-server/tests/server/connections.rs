//! Hostile connections against a real server on loopback: thousands of
//! clients that connect and send nothing do not keep real requests from
//! being served, and each is closed once its header timeout passes; at the
//! connection cap idle connections give way to newcomers, and only when
//! every connection carries a request do new clients wait (not fail)
//! until a slot frees.

use std::time::{Duration, Instant};

use pdkv_engine::EngineConfig;
use pdkv_server::listen::HttpLimits;
use pdkv_testkit::http;
use serde_json::json;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

use crate::common::{Server, Serving, DEADLINE};

/// Waits (bounded) until the server closes `s`: a read returns 0 bytes (or
/// the connection is reset).
async fn closed_by_server(s: &mut TcpStream) -> bool {
    let mut buf = [0u8; 64];
    matches!(
        tokio::time::timeout(DEADLINE, s.read(&mut buf)).await,
        Ok(Ok(0)) | Ok(Err(_))
    )
}

/// A server taking at most `max_connections` connections, each of which
/// must send its request head within `header_timeout`; and its address.
async fn limited(max_connections: usize, header_timeout: Duration) -> (Server, String) {
    let limits = HttpLimits {
        max_connections,
        header_timeout,
    };
    let serving = Serving {
        limits,
        ..Serving::default()
    };
    let s = Server::spawn_serving("tiny", 7, None, EngineConfig::default(), serving).await;
    let addr = s.base.trim_start_matches("http://").to_string();
    (s, addr)
}

async fn completion(server: &Server) -> Duration {
    let started = Instant::now();
    let resp = http::send(
        server
            .client
            .post(server.url("/v1/completions"))
            .json(&json!({"prompt": "hello", "max_tokens": 2, "temperature": 0})),
    )
    .await;
    assert_eq!(resp.status(), 200, "{}", resp.text().await.unwrap());
    started.elapsed()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn idle_connections_do_not_starve_requests_and_are_closed_at_their_timeout() {
    let (s, addr) = limited(4096, Duration::from_secs(2)).await;
    // 3000 clients that connect and never send a byte, and one that sends
    // half a request head.
    let mut idle = Vec::with_capacity(3001);
    for _ in 0..3000 {
        idle.push(TcpStream::connect(&addr).await.expect("connect"));
    }
    let mut half = TcpStream::connect(&addr).await.expect("connect");
    half.write_all(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n")
        .await
        .unwrap();
    // Real requests are served meanwhile.
    let mut slowest = Duration::ZERO;
    for _ in 0..5 {
        slowest = slowest.max(completion(&s).await);
    }
    eprintln!("slowest of 5 requests beside 3000 idle connections: {slowest:?}");
    assert_eq!(s.health().await, 200);
    // Every idle connection is closed by the server once its timeout passed.
    assert!(
        closed_by_server(&mut half).await,
        "the half-sent head was not closed"
    );
    for (i, c) in idle.iter_mut().enumerate() {
        assert!(
            closed_by_server(c).await,
            "idle connection {i} was not closed"
        );
    }
    s.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn at_the_cap_idle_connections_give_way_so_health_metrics_and_requests_are_served() {
    let (s, addr) = limited(4, Duration::from_secs(600)).await;
    let mut idle = Vec::new();
    for _ in 0..4 {
        idle.push(TcpStream::connect(&addr).await.expect("connect"));
    }
    // Every slot is held by a client that sends nothing (and will not for
    // 600 s): a newcomer closes the oldest of them and is served at once.
    for path in ["/health", "/metrics"] {
        let r = tokio::time::timeout(DEADLINE, s.client.get(s.url(path)).send())
            .await
            .expect("served at the cap")
            .unwrap();
        assert_eq!(r.status(), 200, "{path}");
    }
    tokio::time::timeout(DEADLINE, completion(&s))
        .await
        .expect("a request served at the cap");
    assert!(
        closed_by_server(&mut idle[0]).await,
        "the oldest idle connection gave way"
    );
    s.stop().await;
}

/// A head sent and its body held back: the request is in flight.
async fn stalled_body(addr: &str) -> TcpStream {
    let mut c = TcpStream::connect(addr).await.expect("connect");
    c.write_all(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: 100\r\n\r\n{")
        .await
        .unwrap();
    c
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_body_that_stops_coming_fails_its_request_at_the_header_timeout() {
    let (s, addr) = limited(16, Duration::from_secs(1)).await;
    let mut c = stalled_body(&addr).await;
    let t0 = Instant::now();
    let mut answer = Vec::new();
    tokio::time::timeout(DEADLINE, c.read_to_end(&mut answer))
        .await
        .expect("closed, not held")
        .unwrap();
    let answer = String::from_utf8_lossy(&answer);
    assert!(answer.starts_with("HTTP/1.1 400"), "{answer}");
    assert!(
        answer.contains("invalid_request_error"),
        "an OpenAI error body: {answer}"
    );
    assert!(
        t0.elapsed() >= Duration::from_millis(900),
        "{:?}",
        t0.elapsed()
    );
    s.stop().await;
}
