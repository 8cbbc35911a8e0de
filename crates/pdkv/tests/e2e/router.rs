//! pdkv behind the vLLM router (PyPI `vllm-router`, unchanged): `pdkv up
//! --prefill 2 --decode 2` on loopback, the router in front of its four
//! engines in its P/D mode, in both of the router's dialects:
//!
//! - read mode, as the router drives vLLM's NIXL connector (P is sent no
//!   transfer id; its answer is copied verbatim into D's request);
//! - write mode, as the router drives vLLM's Mooncake connector (the router
//!   asks each P's bootstrap port `GET /query` at start-up, and sends P and
//!   D the same transfer id).
//!
//! In each: greedy outputs through the router (completions and chat,
//! streamed and not) equal a colocated engine's and every request's KV came
//! from a P (both Ds loaded, none failed). Then one D is slept while
//! traffic flows: until the router's health check steers away its clients
//! get retryable 503s, never a wrong answer. Then the sequence that loses
//! nothing: `pause?mode=keep` on the other D, wait until the router marks
//! it unhealthy, sleep, wake, resume — every request answered, correctly.
//!
//! `scripts/test.sh` installs the router into a virtual environment and
//! names it in `PDKV_VLLM_ROUTER`.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use futures::StreamExt;
use pdkv_testkit::{
    deploy::Spec,
    http::{self, generate, metrics, wait_healthy},
    models::smollm2,
    proc::{pdkv, Lines, Proc},
    prom::metric,
    DEADLINE,
};
use serde_json::{json, Value};

const TOKEN: &str = "router-test-token";

/// The two tests start five engines each: one at a time.
static SERIAL: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

/// The router's launcher, or `None` (with a note) outside CI.
fn router_path(test: &str) -> Option<PathBuf> {
    let found = std::env::var_os("PDKV_VLLM_ROUTER")
        .map(PathBuf::from)
        .filter(|p| p.is_file());
    if found.is_none() {
        assert!(
            std::env::var_os("CI").is_none(),
            "{test}: PDKV_VLLM_ROUTER is not set under CI (scripts/test.sh installs vllm-router)"
        );
        println!("skipping {test}: set PDKV_VLLM_ROUTER to a vllm-router launcher (scripts/test.sh installs one)");
    }
    found
}

/// `pdkv up --prefill 2 --decode 2`, with what it printed when ready.
struct Up {
    _child: Proc,
    /// (HTTP base, KV bootstrap port) of each prefill engine.
    prefill: Vec<(String, u16)>,
    decode: Vec<String>,
}

fn start_up(model: &str, mode: &str) -> Up {
    let mut cmd = pdkv();
    cmd.args([
        "up",
        "--model",
        model,
        "--prefill",
        "2",
        "--decode",
        "2",
        "--transfer-mode",
        mode,
    ])
    .args([
        "--num-kv-blocks",
        "256",
        "--port",
        "0",
        "--admin-token",
        TOKEN,
    ]);
    let child = Proc::spawn(cmd, Lines::Stdout, "pdkv up").with_grace(Duration::from_secs(15));
    let deadline = Instant::now() + DEADLINE;
    let (mut prefill, mut decode) = (Vec::new(), Vec::new());
    loop {
        let line = child
            .lines
            .recv_timeout(deadline.saturating_duration_since(Instant::now()))
            .unwrap_or_else(|e| panic!("pdkv up never became ready ({e})"));
        if let Some(rest) = line.strip_prefix("prefill ") {
            // "prefill I: URL (KV bootstrap port K)"
            let url = rest
                .split_whitespace()
                .nth(1)
                .expect("prefill url")
                .to_string();
            let port = rest
                .rsplit(' ')
                .next()
                .unwrap()
                .trim_end_matches(')')
                .parse()
                .expect("kv port");
            prefill.push((url, port));
        } else if let Some(rest) = line.strip_prefix("decode ") {
            decode.push(
                rest.split_whitespace()
                    .nth(1)
                    .expect("decode url")
                    .to_string(),
            );
        } else if line.starts_with("proxy: ") {
            break;
        }
    }
    assert_eq!(
        (prefill.len(), decode.len()),
        (2, 2),
        "pdkv up printed its engines"
    );
    Up {
        _child: child,
        prefill,
        decode,
    }
}

/// The router in P/D mode in front of `up`'s engines, health-checking
/// every second (3 failed checks mark a worker unhealthy).
fn start_router(router: &PathBuf, up: &Up, connector: &str) -> (Proc, String) {
    let port = free_port();
    let mut cmd = Command::new(router);
    cmd.args([
        "--vllm-pd-disaggregation",
        "--host",
        "127.0.0.1",
        "--port",
        &port.to_string(),
    ])
    .args([
        "--prometheus-port",
        &free_port().to_string(),
        "--kv-connector",
        connector,
    ])
    .args([
        "--policy",
        "round_robin",
        "--health-check-interval-secs",
        "1",
        "--worker-startup-check-interval",
        "1",
    ]);
    for (url, kv) in &up.prefill {
        cmd.arg("--prefill").arg(url);
        if connector == "mooncake" {
            cmd.arg(kv.to_string());
        }
    }
    for url in &up.decode {
        cmd.arg("--decode").arg(url);
    }
    let child = Proc::spawn(cmd, Lines::Stdout, "vllm-router").with_grace(Duration::from_secs(15));
    (child, format!("http://127.0.0.1:{port}"))
}

const PROMPTS: [&str; 8] = [
    "The library opens at nine and closes at five on weekdays. Question: when does it close? Answer:",
    "The river Thames flows through London and reaches the North Sea. It flows through",
    "To bake bread you need flour, water, salt and yeast. The first step is",
    "The server rack in room four has twelve machines and two switches. How many machines?",
    "A young fox lived at the edge of a forest and every morning watched the farmer",
    "Light travels at about three hundred thousand kilometres per second. In glass it is",
    "The old town has narrow streets, a cathedral with a green roof and a market every",
    "The team agreed to ship the release on Friday after fixing the login bug. On Friday they",
];

/// Request `i`: completions for even `i`, chat for odd; `i % 4 >= 2`
/// streams. Requests `0..2 * PROMPTS.len()` all differ in their last
/// tokens, so none is served whole from D's prefix cache (each loads KV).
fn request(i: usize) -> (&'static str, Value) {
    let round = (i / PROMPTS.len()) % 2;
    let p = format!(
        "{}{}",
        PROMPTS[i % PROMPTS.len()],
        if round == 0 { "" } else { " Think again:" }
    );
    let stream = i % 4 >= 2;
    if i.is_multiple_of(2) {
        (
            "/v1/completions",
            json!({"prompt": p, "max_tokens": 8, "temperature": 0, "stream": stream}),
        )
    } else {
        let messages = json!([{"role": "user", "content": p}]);
        (
            "/v1/chat/completions",
            json!({"messages": messages, "max_tokens": 8, "temperature": 0, "stream": stream}),
        )
    }
}

async fn admin(client: &reqwest::Client, base: &str, path: &str) -> Value {
    let (status, v) = http::answer(client.post(format!("{base}{path}")).bearer_auth(TOKEN)).await;
    assert!(status.is_success(), "{base}{path}: {status} {v}");
    v
}

/// Waits until the router reports `url` healthy (or not), bounded.
async fn wait_router_health(
    client: &reqwest::Client,
    router: &str,
    url: &str,
    healthy: bool,
) -> Duration {
    let started = Instant::now();
    loop {
        let v: Value = pdkv_testkit::http::get_json(client, &format!("{router}/workers"))
            .await
            .1;
        let w = v["workers"]
            .as_array()
            .unwrap()
            .iter()
            .find(|w| w["url"] == url)
            .cloned();
        if w.as_ref().and_then(|w| w["is_healthy"].as_bool()) == Some(healthy) {
            return started.elapsed();
        }
        assert!(
            started.elapsed() < DEADLINE,
            "the router never marked {url} healthy={healthy}: {v}"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

fn counter(client_text: &str, name: &str) -> f64 {
    metric(client_text, name).unwrap_or(0.0)
}

/// What the router's clients got during a phase.
#[derive(Debug, Default)]
struct Seen {
    ok: usize,
    /// 503s carrying the engine's retryable code.
    retryable: usize,
    /// Anything else: wrong text or another error.
    bad: Vec<String>,
}

/// Sends requests through the router (2 at a time) until `stop`, checking
/// each answer against the colocated one.
/// [`traffic`] on a task of its own, until the flag returned is set.
fn start_traffic(
    client: &reqwest::Client,
    router: &str,
    expected: &Arc<Vec<String>>,
) -> (Arc<AtomicBool>, tokio::task::JoinHandle<Seen>) {
    let stop = Arc::new(AtomicBool::new(false));
    let flow = tokio::spawn(traffic(
        client.clone(),
        router.to_string(),
        expected.clone(),
        stop.clone(),
    ));
    (stop, flow)
}

async fn traffic(
    client: reqwest::Client,
    router: String,
    expected: Arc<Vec<String>>,
    stop: Arc<AtomicBool>,
) -> Seen {
    let seen = Arc::new(Mutex::new(Seen::default()));
    let worker = |w: usize| {
        let (client, router, expected, stop, seen) = (
            client.clone(),
            router.clone(),
            expected.clone(),
            stop.clone(),
            seen.clone(),
        );
        async move {
            let mut i = w;
            while !stop.load(Ordering::SeqCst) {
                let (path, body) = request(i);
                let got = generate(&client, &router, path, &body).await;
                let mut s = seen.lock().unwrap();
                match got {
                    Ok(text) if text == expected[i % expected.len()] => s.ok += 1,
                    Ok(text) => s.bad.push(format!(
                        "request {i}: {text:?} != {:?}",
                        expected[i % expected.len()]
                    )),
                    Err((503, body)) if body.contains("engine_not_serving") => s.retryable += 1,
                    Err((status, body)) => s.bad.push(format!("request {i}: {status} {body}")),
                }
                drop(s);
                i += 2;
            }
        }
    };
    futures::future::join(worker(0), worker(1)).await;
    Arc::try_unwrap(seen).unwrap().into_inner().unwrap()
}

async fn router_drives_pdkv(test: &str, mode: &str, connector: &str) {
    let Some(model) = smollm2(test) else {
        return;
    };
    let Some(router_bin) = router_path(test) else {
        return;
    };
    let _serial = SERIAL.lock().await;
    let model = model.to_str().unwrap().to_string();
    let client = reqwest::Client::builder()
        .timeout(Duration::from_secs(120))
        .build()
        .unwrap();

    let colo = Spec::new(Path::new(&model), 256).start_colocated();
    wait_healthy(&client, &colo.url("/health")).await;
    let n = 2 * PROMPTS.len();
    let mut expected = Vec::with_capacity(n);
    for i in 0..n {
        let (path, body) = request(i);
        expected.push(
            generate(&client, &colo.base, path, &body)
                .await
                .expect("colocated answer"),
        );
    }
    let expected = Arc::new(expected);

    let up = start_up(&model, mode);
    let (_router, router) = start_router(&router_bin, &up, connector);
    wait_healthy(&client, &format!("{router}/health")).await;

    // Every output through the router equals the colocated one.
    let got = futures::stream::iter((0..n).map(|i| {
        let (client, router) = (client.clone(), router.clone());
        async move {
            let (path, body) = request(i);
            (i, generate(&client, &router, path, &body).await)
        }
    }))
    .buffer_unordered(4)
    .collect::<Vec<_>>()
    .await;
    for (i, r) in got {
        let text =
            r.unwrap_or_else(|e| panic!("{mode}: request {i} through the router failed: {e:?}"));
        assert_eq!(text, expected[i], "{mode}: request {i} through the router");
    }
    // Every request's KV came from a P: both Ds loaded, none failed.
    let mut loads = 0.0;
    for d in &up.decode {
        let m = metrics(&client, d).await;
        let (ok, failed) = (
            counter(&m, "pdkv_kv_loads_ok_total"),
            counter(&m, "pdkv_kv_loads_failed_total"),
        );
        assert!(
            ok > 0.0 && failed == 0.0,
            "{mode}: decode {d} loaded {ok}, failed {failed}"
        );
        loads += ok;
    }
    assert_eq!(loads, n as f64, "{mode}: one KV load per request");
    // The router's cache flush reaches the engines.
    let resp = http::send(client.post(format!("{router}/flush_cache"))).await;
    assert!(
        resp.status().is_success(),
        "{mode}: /flush_cache through the router: {}",
        resp.text().await.unwrap()
    );

    // One D sleeps while traffic flows: retryable 503s until the router's
    // health check steers away, never a wrong answer.
    let (d_sleep, d_drain) = (up.decode[1].clone(), up.decode[0].clone());
    let (stop, flow) = start_traffic(&client, &router, &expected);
    tokio::time::sleep(Duration::from_millis(500)).await;
    // `wait`: requests D is running finish; new ones are refused.
    admin(&client, &d_sleep, "/sleep?level=1&mode=wait").await;
    let steered = wait_router_health(&client, &router, &d_sleep, false).await;
    stop.store(true, Ordering::SeqCst);
    let seen = flow.await.unwrap();
    eprintln!(
        "{mode}: sleeping a D under load: {seen:?}; the router steered away after {steered:?}"
    );
    assert!(
        seen.bad.is_empty(),
        "{mode}: wrong answers or other errors while a D slept: {:?}",
        seen.bad
    );
    assert!(seen.ok > 0, "{mode}: traffic flowed: {seen:?}");
    admin(&client, &d_sleep, "/wake_up").await;
    wait_router_health(&client, &router, &d_sleep, true).await;

    // The sequence that loses nothing: pause keep (requests sent meanwhile
    // are held, /health steers the router away), sleep, wake, resume.
    let (stop, flow) = start_traffic(&client, &router, &expected);
    tokio::time::sleep(Duration::from_millis(500)).await;
    admin(&client, &d_drain, "/pause?mode=keep").await;
    wait_router_health(&client, &router, &d_drain, false).await;
    admin(&client, &d_drain, "/sleep?level=1").await;
    admin(&client, &d_drain, "/wake_up").await;
    let v: Value = http::send(
        client
            .get(format!("{d_drain}/is_paused"))
            .bearer_auth(TOKEN),
    )
    .await
    .json()
    .await
    .unwrap();
    if v["is_paused"] == json!(true) {
        admin(&client, &d_drain, "/resume").await;
    }
    wait_router_health(&client, &router, &d_drain, true).await;
    tokio::time::sleep(Duration::from_millis(500)).await;
    stop.store(true, Ordering::SeqCst);
    let seen = flow.await.unwrap();
    eprintln!("{mode}: drain (pause keep), sleep, wake, resume under load: {seen:?}");
    assert!(
        seen.bad.is_empty() && seen.retryable == 0,
        "{mode}: the drain lost requests: {seen:?}"
    );
    assert!(seen.ok > 0, "{mode}: traffic flowed: {seen:?}");
    for d in &up.decode {
        let m = metrics(&client, d).await;
        assert_eq!(
            counter(&m, "pdkv_kv_loads_failed_total"),
            0.0,
            "{mode}: decode {d} failed a load: {m}"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn vllm_router_drives_pdkv_in_read_mode_as_nixl() {
    router_drives_pdkv(
        "vllm_router_drives_pdkv_in_read_mode_as_nixl",
        "read",
        "nixl",
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn vllm_router_drives_pdkv_in_write_mode_as_mooncake() {
    router_drives_pdkv(
        "vllm_router_drives_pdkv_in_write_mode_as_mooncake",
        "write",
        "mooncake",
    )
    .await;
}
