//! `pdkv up` end to end: a tiny random model, prefill + decode + proxy as
//! child processes, a completion through the proxy, then SIGTERM stops all
//! of them (no child outlives `up`).

use pdkv_testkit::http;
use std::process::Stdio;
use std::sync::mpsc;
use std::time::{Duration, Instant};

use pdkv_model::Arch;
use pdkv_testkit::models::checkpoint;
use pdkv_testkit::proc::{pdkv, read_lines, Lines, Proc};
use serde_json::{json, Value};

/// Bound on every wait in this test.
const DEADLINE: Duration = Duration::from_secs(120);

fn alive(pid: i32) -> bool {
    // SAFETY: signal 0 only checks that the process exists.
    unsafe { libc::kill(pid, 0) == 0 }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn up_serves_through_the_proxy_and_stops_every_child() {
    let ckpt_dir = checkpoint(Arch::Llama, "tiny", 3);
    let ckpt = ckpt_dir.path();
    let (up, url, err) = start_up(ckpt, &[]);
    let port: u16 = url
        .strip_prefix("http://127.0.0.1:")
        .and_then(|p| p.parse().ok())
        .unwrap_or_else(|| panic!("proxy URL {url}"));
    assert_ne!(port, 0);

    let client = reqwest::Client::new();
    let resp = client
        .post(format!("{url}/v1/completions"))
        .json(
            &json!({"prompt": "The river", "max_tokens": 5, "temperature": 0, "ignore_eos": true}),
        )
        .send()
        .await
        .unwrap();
    let status = resp.status();
    let body: Value = resp.json().await.unwrap();
    assert_eq!(status, 200, "{body}");
    assert_eq!(body["usage"]["completion_tokens"], 5, "{body}");

    // SIGTERM stops everything.
    let status = terminate(up);
    let logs: Vec<String> = err.try_iter().collect();
    assert!(
        status.success(),
        "pdkv up exited with {status}; stderr:\n{}",
        logs.join("\n")
    );
    let pids: Vec<i32> = logs
        .iter()
        .filter_map(|l| l.split("(pid ").nth(1)?.split(')').next()?.parse().ok())
        .collect();
    assert_eq!(
        pids.len(),
        3,
        "three children started:\n{}",
        logs.join("\n")
    );
    for pid in pids {
        assert!(!alive(pid), "child {pid} outlived pdkv up");
    }
}

/// Starts `pdkv up --model MODEL --num-kv-blocks 64 --port 0 EXTRA` (port
/// 0: every child, the proxy too, binds a free port itself) and returns it
/// with the proxy's URL (from stdout).
fn start_up(
    model: &std::path::Path,
    extra: &[&str],
) -> (std::process::Child, String, mpsc::Receiver<String>) {
    let mut up = pdkv()
        .arg("up")
        .arg("--model")
        .arg(model)
        .args(["--num-kv-blocks", "64", "--port", "0"])
        .args(extra)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("spawn pdkv up");
    let out = read_lines(up.stdout.take().unwrap());
    let err = read_lines(up.stderr.take().unwrap());
    let deadline = Instant::now() + DEADLINE;
    loop {
        match out.recv_timeout(deadline.saturating_duration_since(Instant::now())) {
            Ok(line) => {
                if let Some(u) = line.strip_prefix("proxy: ") {
                    return (up, u.trim().to_string(), err);
                }
            }
            Err(e) => {
                let _ = up.kill();
                let _ = up.wait();
                let logs: Vec<String> = err.try_iter().collect();
                panic!("no proxy line ({e}); stderr:\n{}", logs.join("\n"));
            }
        }
    }
}

/// `pdkv up --prefill 2 --decode 2 --admin-token T`: one `/pause`,
/// `/sleep`, `/wake_up`, `/resume` on the proxy's address reaches every
/// engine, in order, and outputs after the wake equal those before; a call
/// that fails names the engines that refused it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn up_admin_token_drives_every_engine_with_one_call() {
    let ckpt_dir = checkpoint(Arch::Llama, "tiny", 5);
    let ckpt = ckpt_dir.path();
    let (up, url, _err) = start_up(
        ckpt,
        &["--prefill", "2", "--decode", "2", "--admin-token", "T"],
    );
    let client = reqwest::Client::new();
    let probe = |i: usize| json!({"prompt": format!("probe {i}: the river"), "max_tokens": 6, "temperature": 0, "ignore_eos": true});
    let generate = |body: Value| completion_text(&client, &url, body);
    // The model's routes answer through the proxy too.
    let v: Value = http::send(
        client
            .post(format!("{url}/tokenize"))
            .json(&json!({"prompt": "the river"})),
    )
    .await
    .json()
    .await
    .unwrap();
    let tokens = v["tokens"].as_array().unwrap_or_else(|| panic!("{v}"));
    assert!(
        !tokens.is_empty() && v["count"] == json!(tokens.len()),
        "{v}"
    );
    let back: Value = http::send(
        client
            .post(format!("{url}/detokenize"))
            .json(&json!({"tokens": tokens})),
    )
    .await
    .json()
    .await
    .unwrap();
    assert!(
        back["prompt"].as_str().is_some_and(|p| p.contains("river")),
        "{back}"
    );
    for path in [
        "/version",
        "/get_model_info",
        "/get_server_info",
        "/v1/models",
    ] {
        let resp = client.get(format!("{url}{path}")).send().await.unwrap();
        assert_eq!(resp.status(), 200, "{path}");
    }
    let mut before = Vec::new();
    for i in 0..4 {
        before.push(generate(probe(i)).await);
    }
    let call = |method: reqwest::Method, path: &'static str, token: &'static str| {
        let (client, url) = (client.clone(), url.clone());
        async move {
            let resp = http::send(
                client
                    .request(method, format!("{url}{path}"))
                    .bearer_auth(token),
            )
            .await;
            let status = resp.status().as_u16();
            (status, resp.json::<Value>().await.unwrap())
        }
    };
    use reqwest::Method;
    // Without the token: refused, nothing changes.
    let (status, _) = call(Method::POST, "/pause", "wrong").await;
    assert_eq!(status, 401);
    for (path, first) in [
        ("/pause?mode=keep", "prefill"),
        ("/sleep?level=1", "prefill"),
    ] {
        let (status, v) = call(Method::POST, path, "T").await;
        assert_eq!(status, 200, "{path}: {v}");
        let engines = v["engines"].as_array().unwrap();
        assert_eq!(engines.len(), 4, "{path}: every engine answered: {v}");
        assert!(engines.iter().all(|e| e["status"] == 200), "{v}");
        assert_eq!(
            engines[0]["role"], first,
            "{path}: stopping calls reach P first: {v}"
        );
    }
    let (status, v) = call(Method::GET, "/is_sleeping", "T").await;
    assert_eq!(
        (status, &v["is_sleeping"], &v["agree"]),
        (200, &json!(true), &json!(true)),
        "{v}"
    );
    // Each engine itself is asleep.
    for e in v["engines"].as_array().unwrap() {
        let u = e["url"].as_str().unwrap();
        let own: Value = http::send(client.get(format!("{u}/is_sleeping")).bearer_auth("T"))
            .await
            .json()
            .await
            .unwrap();
        assert_eq!(own["is_sleeping"], true, "{u}");
    }
    // A call every engine refuses names each of them.
    let (status, v) = call(Method::POST, "/sleep?level=9", "T").await;
    assert_eq!(status, 400, "{v}");
    let msg = v["error"]["message"].as_str().unwrap();
    assert!(
        msg.contains("failed on 2 of 4 engines") && msg.matches("prefill http://").count() == 2,
        "{msg}"
    );
    assert!(
        v["engines"]
            .as_array()
            .unwrap()
            .iter()
            .filter(|e| e["body"] == "not called")
            .count()
            == 2,
        "{v}"
    );
    for (path, first) in [("/wake_up", "decode"), ("/resume", "decode")] {
        let (status, v) = call(Method::POST, path, "T").await;
        assert_eq!(status, 200, "{path}: {v}");
        assert_eq!(
            v["engines"][0]["role"], first,
            "{path}: starting calls reach D first: {v}"
        );
    }
    let (_, v) = call(Method::GET, "/is_paused", "T").await;
    assert_eq!(
        (&v["is_paused"], &v["agree"]),
        (&json!(false), &json!(true)),
        "{v}"
    );
    for (i, b) in before.iter().enumerate() {
        assert_eq!(&generate(probe(i)).await, b, "probe {i} after the wake");
    }
    stop(up);
}

/// The text of the first choice of a completion `body` at `url`.
async fn completion_text(client: &reqwest::Client, url: &str, body: Value) -> String {
    let v: Value = http::send(client.post(format!("{url}/v1/completions")).json(&body))
        .await
        .json()
        .await
        .unwrap();
    v["choices"][0]["text"]
        .as_str()
        .unwrap_or_else(|| panic!("{v}"))
        .to_string()
}

/// Sends `pdkv up` SIGTERM and waits for its exit, bounded.
fn terminate(mut up: std::process::Child) -> std::process::ExitStatus {
    // SAFETY: plain syscall on our own child, not yet reaped.
    assert_eq!(unsafe { libc::kill(up.id() as i32, libc::SIGTERM) }, 0);
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        let _ = tx.send(up.wait());
    });
    rx.recv_timeout(DEADLINE)
        .expect("pdkv up exits after SIGTERM")
        .unwrap()
}

/// Stops `pdkv up` (SIGTERM) and waits for it, bounded.
fn stop(up: std::process::Child) {
    let status = terminate(up);
    assert!(status.success(), "pdkv up exited with {status}");
}

/// `pdkv up` with the servers split over ranks — P TP2 → D TP1, P TP1 → D
/// TP2, both TP2 — answers what whole servers answer, also after every
/// engine slept and woke through the proxy.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn up_with_servers_split_over_ranks_answers_as_whole_servers_do() {
    let ckpt_dir = checkpoint(Arch::Llama, "tiny", 11);
    let ckpt = ckpt_dir.path();
    let client = reqwest::Client::new();
    let probe = |i: usize| {
        json!({"prompt": format!("probe {i}: a long way down the river to the sea"),
            "max_tokens": 6, "temperature": 0, "ignore_eos": true})
    };
    let mut want: Option<Vec<String>> = None;
    for (p, d) in [("1", "1"), ("2", "1"), ("1", "2"), ("2", "2")] {
        let (up, url, _err) = start_up(
            ckpt,
            &[
                "--admin-token",
                "T",
                "--prefill-tensor-parallel-size",
                p,
                "--decode-tensor-parallel-size",
                d,
            ],
        );
        let mut got = Vec::new();
        for i in 0..4 {
            got.push(completion_text(&client, &url, probe(i)).await);
        }
        for path in ["/sleep?level=1", "/wake_up"] {
            let resp = http::send(client.post(format!("{url}{path}")).bearer_auth("T")).await;
            assert_eq!(resp.status(), 200, "P TP{p} D TP{d}: {path}");
        }
        for i in 0..4 {
            got.push(completion_text(&client, &url, probe(i)).await);
        }
        stop(up);
        match &want {
            None => want = Some(got),
            Some(w) => assert_eq!(&got, w, "P TP{p} -> D TP{d} against whole servers"),
        }
    }
}

/// The secret a sync test's deployment and publisher share.
const SYNC_SECRET: &str = "sync-test-secret-0123456789abcdef";

/// A trainer's sync through the proxy's one address: `pdkv weights publish`
/// holds a second checkpoint, the four phases fan out to P and D, each
/// pulls every tensor from the publisher, and afterwards the deployment
/// answers what a fresh deployment on the second checkpoint answers, with
/// the published version on every engine.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn up_syncs_weights_from_a_publisher_to_every_engine() {
    let a_dir = checkpoint(Arch::Llama, "tiny", 5);
    let a = a_dir.path();
    let b_dir = checkpoint(Arch::Llama, "tiny", 6);
    let b = b_dir.path();
    let c_dir = checkpoint(Arch::Llama, "tiny", 8);
    let c = c_dir.path();
    let (publisher, pub_url) = publish(b, "step-1");

    let (up, url, _err) = sync_up(a, &[]);
    let client = reqwest::Client::new();
    let call = |path: &'static str, body: Value| admin_post(&client, &url, path, body);
    let probe = |i: usize| json!({"prompt": format!("probe {i}: the river"), "max_tokens": 8, "temperature": 20.0, "seed": 77, "ignore_eos": true});
    let probes = || async {
        let mut out = Vec::new();
        for i in 0..4 {
            out.push(completion_text(&client, &url, probe(i)).await);
        }
        out
    };
    let version = || async {
        let info: Value = http::send(client.get(format!("{url}/weight_info")).bearer_auth("T"))
            .await
            .json()
            .await
            .unwrap();
        assert_eq!(info["agree"], json!(true), "{info}");
        info["version"].clone()
    };
    let before = probes().await;

    // Direct: every engine pulls from the publisher.
    call(
        "/init_weight_transfer_engine",
        json!({"init_info": {"backend": "pdkv", "url": pub_url}}),
    )
    .await;
    let v = call("/start_weight_update", json!({})).await;
    assert_eq!(
        v["engines"].as_array().map(Vec::len),
        Some(2),
        "P and D: {v}"
    );
    call("/update_weights", json!({"update_info": {}})).await;
    call("/pause?mode=keep", json!({})).await;
    call("/finish_weight_update", json!({})).await;
    call("/resume", json!({})).await;
    assert_eq!(version().await, json!("step-1"));
    let synced_b = probes().await;
    assert_ne!(synced_b, before, "the weights changed");
    stop_publisher(&client, publisher, &pub_url).await;

    // Relay over TCP: P pulls from the publisher, D from P's staging; one
    // copy of the weights goes through the publisher's link.
    let (publisher, pub_url) = publish(c, "step-2");
    call(
        "/init_weight_transfer_engine",
        json!({"init_info": {"url": pub_url, "transport": "tcp", "fanout": "relay"}}),
    )
    .await;
    let v = call("/start_weight_update", json!({})).await;
    assert_eq!(
        v["engines"][1]["body"],
        json!("not called"),
        "D waits for P: {v}"
    );
    let v = call("/update_weights", json!({"update_info": {}})).await;
    let engines = v["engines"].as_array().expect("engines");
    assert_eq!(engines.len(), 2, "{v}");
    for e in engines {
        assert_eq!(e["body"]["pulled"], e["body"]["total"], "{v}");
        assert_eq!(e["body"]["transport"], "tcp", "{v}");
    }
    call("/pause?mode=keep", json!({})).await;
    call("/finish_weight_update", json!({})).await;
    call("/resume", json!({})).await;
    assert_eq!(version().await, json!("step-2"));
    let stats: Value = pdkv_testkit::http::get_json(&client, &format!("{pub_url}/stats"))
        .await
        .1;
    assert_eq!(
        stats["bytes_served"], stats["bytes"],
        "one copy through the publisher: {stats}"
    );
    let synced_c = probes().await;
    stop(up);
    stop_publisher(&client, publisher, &pub_url).await;

    for (ckpt, synced) in [(&b, &synced_b), (&c, &synced_c)] {
        let (fresh, furl, _ferr) = sync_up(ckpt, &[]);
        let mut want = Vec::new();
        for i in 0..4 {
            want.push(completion_text(&client, &furl, probe(i)).await);
        }
        stop(fresh);
        assert_eq!(
            synced,
            &want,
            "equal to a fresh deployment on {}",
            ckpt.display()
        );
    }
}

/// A trainer's checkpoint as it holds it — the Hugging Face export (bf16)
/// of another checkpoint — published with `--format hf` to a 1P1D serving
/// Q8_0: both engines convert while they pull, and the deployment then
/// answers what a fresh Q8_0 deployment on that export answers.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn up_syncs_a_trainers_hf_checkpoint_into_a_quantised_deployment() {
    let a_dir = checkpoint(Arch::Llama, "tiny", 5);
    let b_dir = checkpoint(Arch::Llama, "tiny", 6);
    let export = tempfile::tempdir().unwrap();
    {
        let pool = pdkv_vmem::Pool::default();
        let m = pdkv_model::load_model(b_dir.path(), &pool, &mut |_| {}).expect("load");
        pdkv_model::export::export_hf(&m, export.path(), &mut |_| {}).expect("export");
    }
    let (publisher, pub_url) = publish_as(export.path(), "hf-1", &["--format", "hf"]);
    let q8 = ["--weight-format", "q8_0"];
    let (up, url, _err) = sync_up(a_dir.path(), &q8);
    let client = reqwest::Client::new();
    let call = |path: &'static str, body: Value| admin_post(&client, &url, path, body);
    let manifest: Value = pdkv_testkit::http::get_json(&client, &format!("{pub_url}/manifest"))
        .await
        .1;
    assert!(
        manifest["tensors"]
            .as_array()
            .unwrap()
            .iter()
            .all(|t| t["dtype"] == "bf16"),
        "published as the trainer holds them"
    );
    // Seeded sampling at a high temperature: every logit shows (a tiny
    // random model's greedy answers repeat one token whatever its weights).
    let probe = |i: usize| json!({"prompt": format!("probe {i}: the river"), "max_tokens": 8, "temperature": 20.0, "seed": 77, "ignore_eos": true});
    let mut before = Vec::new();
    for i in 0..4 {
        before.push(completion_text(&client, &url, probe(i)).await);
    }
    call(
        "/init_weight_transfer_engine",
        json!({"init_info": {"backend": "pdkv", "url": pub_url}}),
    )
    .await;
    call("/start_weight_update", json!({})).await;
    let v = call("/update_weights", json!({"update_info": {}})).await;
    for e in v["engines"].as_array().expect("engines") {
        assert!(
            e["body"]["convert_seconds"]
                .as_f64()
                .is_some_and(|s| s > 0.0),
            "each engine converted: {v}"
        );
    }
    call("/pause?mode=keep", json!({})).await;
    call("/finish_weight_update", json!({})).await;
    call("/resume", json!({})).await;
    let mut synced = Vec::new();
    for i in 0..4 {
        synced.push(completion_text(&client, &url, probe(i)).await);
    }
    assert_ne!(synced, before, "the weights changed");
    stop(up);
    stop_publisher(&client, publisher, &pub_url).await;

    let (fresh, furl, _ferr) = sync_up(export.path(), &q8);
    let mut want = Vec::new();
    for i in 0..4 {
        want.push(completion_text(&client, &furl, probe(i)).await);
    }
    stop(fresh);
    assert_eq!(
        synced, want,
        "equal to a fresh Q8_0 deployment on the export"
    );
}

/// `pdkv up --model DIR` with the sync tests' flags (their KV secret, the
/// admin token `T`) and `extra`.
fn sync_up(
    dir: &std::path::Path,
    extra: &[&str],
) -> (std::process::Child, String, mpsc::Receiver<String>) {
    let flags = ["--admin-token", "T", "--kv-secret", SYNC_SECRET];
    start_up(dir, &[&flags[..], extra].concat())
}

/// An admin POST (token `T`) to `{url}{path}` that must answer 200; its body.
async fn admin_post(client: &reqwest::Client, url: &str, path: &str, body: Value) -> Value {
    let u = format!("{url}{path}");
    let resp = http::send(client.post(&u).bearer_auth("T").json(&body)).await;
    let status = resp.status().as_u16();
    let v: Value = resp.json().await.unwrap();
    assert_eq!(status, 200, "{u}: {v}");
    v
}

/// `pdkv weights publish CKPT --version V` with the test's KV secret: the
/// process and its manifest URL.
fn publish(ckpt: &std::path::Path, version: &str) -> (Proc, String) {
    publish_as(ckpt, version, &[])
}

/// [`publish`] with `extra` flags.
fn publish_as(ckpt: &std::path::Path, version: &str, extra: &[&str]) -> (Proc, String) {
    let mut cmd = pdkv();
    cmd.args(["weights", "publish", "--version", version])
        .args(extra)
        .arg(ckpt)
        .env("PDKV_KV_SECRET", SYNC_SECRET)
        .env("RUST_LOG", "warn");
    let what = "pdkv weights publish";
    let mut publisher = Proc::spawn(cmd, Lines::Stdout, what);
    let line = publisher.wait_line(what, |l| l.starts_with("publishing "));
    let url = line.rsplit(' ').next().unwrap().to_string();
    assert!(url.starts_with("http://"), "{line}");
    (publisher, url)
}

/// Stops a publisher as an operator does, with SIGTERM: it exits cleanly
/// and takes its shared-memory socket (the one its manifest names) with
/// it, leaving nothing behind in the temporary directory.
async fn stop_publisher(client: &reqwest::Client, publisher: Proc, pub_url: &str) {
    let (status, manifest) = http::get_json(client, &format!("{pub_url}/manifest")).await;
    assert_eq!(status, 200, "{manifest}");
    let sock = std::path::PathBuf::from(
        manifest["shm"]["path"]
            .as_str()
            .unwrap_or_else(|| panic!("a shared-memory endpoint: {manifest}")),
    );
    assert!(sock.exists(), "{} while publishing", sock.display());
    let exit = publisher.terminate();
    assert!(exit.success(), "the publisher stops cleanly: {exit}");
    assert!(!sock.exists(), "{} left behind", sock.display());
}

/// The README's trainer step, run as written (its `url` and `ckpt` lines
/// set to this deployment's) against `pdkv up --admin-token TOKEN`: every
/// call answers a JSON body without an error, and the deployment serves
/// the same greedy answer afterwards (the reload is of the same weights).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn readme_trainer_step_runs_as_written() {
    let readme = std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/../../README.md"))
        .expect("README.md");
    let start = readme
        .find("auth='Authorization: Bearer TOKEN'")
        .expect("the trainer-step block in README.md");
    let end = start + readme[start..].find("```").expect("the block's end");
    let block = &readme[start..end];
    let ckpt_dir = checkpoint(Arch::Llama, "tiny", 9);
    let ckpt = ckpt_dir.path().to_str().unwrap().to_string();
    let (mut up, url, _err) = start_up(ckpt_dir.path(), &["--admin-token", "TOKEN"]);
    let client = reqwest::Client::new();
    let probe =
        json!({"prompt": "The river", "max_tokens": 6, "temperature": 0, "ignore_eos": true});
    let before = completion_text(&client, &url, probe.clone()).await;
    let mut script = String::from("set -eu\n");
    let mut curls = 0;
    for line in block.lines() {
        if line.starts_with("url=") {
            script.push_str(&format!("url={url}\n"));
        } else if line.starts_with("ckpt=") {
            script.push_str(&format!("ckpt={ckpt}\n"));
        } else {
            curls += usize::from(line.starts_with("curl "));
            // One answer per line, so each can be checked (an `echo` of
            // its own: the line may end in a comment).
            script.push_str(line);
            script.push_str(if line.starts_with("curl ") {
                "\necho\n"
            } else {
                "\n"
            });
        }
    }
    assert_eq!(curls, 6, "the block's calls:\n{block}");
    let out = tokio::task::spawn_blocking(move || {
        std::process::Command::new("bash")
            .arg("-c")
            .arg(&script)
            .output()
            .expect("bash runs the block")
    })
    .await
    .unwrap();
    assert!(out.status.success(), "{out:?}");
    let stdout = String::from_utf8(out.stdout).unwrap();
    let answers: Vec<Value> = stdout
        .lines()
        .filter(|l| !l.trim().is_empty())
        .map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("{e}: {l:?}")))
        .collect();
    assert_eq!(answers.len(), 6, "{stdout}");
    for a in &answers {
        assert!(a.get("error").is_none(), "{a}\nall: {stdout}");
    }
    assert_eq!(answers[3]["status"], "ok", "{stdout}");
    let after = completion_text(&client, &url, probe).await;
    assert_eq!(after, before);
    // SAFETY: plain syscall on our own child, not yet reaped.
    unsafe { libc::kill(up.id() as i32, libc::SIGTERM) };
    let _ = up.wait();
}

/// A taken `--port` fails at once, naming the port and the flag, before any
/// engine loads the model.
#[test]
fn a_taken_port_fails_before_loading() {
    let taken = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let port = taken.local_addr().unwrap().port().to_string();
    let ckpt_dir = checkpoint(Arch::Llama, "tiny", 3);
    let out = pdkv()
        .args([
            "up",
            "--model",
            ckpt_dir.path().to_str().unwrap(),
            "--port",
            &port,
        ])
        .stdin(Stdio::null())
        .output()
        .expect("pdkv up runs");
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "{err}");
    assert!(
        err.contains(&format!("port {port} (--port) is not free")) && err.contains("--port"),
        "{err}"
    );
    assert!(
        !err.contains("started the prefill"),
        "a child started: {err}"
    );
}
