//! `pdkv up` end to end: a tiny random model, prefill + decode + proxy as
//! child processes, a completion through the proxy, then SIGTERM stops all
//! of them (no child outlives `up`).

use std::io::{BufRead, BufReader};
use std::process::{Command, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use serde_json::{json, Value};

/// Bound on every wait in this test.
const DEADLINE: Duration = Duration::from_secs(120);

fn pdkv() -> Command {
    let mut c = Command::new(env!("CARGO_BIN_EXE_pdkv"));
    c.env("RUST_LOG", "info");
    c
}

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port()
}

/// Lines of a child's pipe, read on a thread.
fn lines(pipe: impl std::io::Read + Send + 'static) -> mpsc::Receiver<String> {
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        for line in BufReader::new(pipe).lines() {
            let Ok(line) = line else { break };
            if tx.send(line).is_err() {
                break;
            }
        }
    });
    rx
}

fn alive(pid: i32) -> bool {
    // SAFETY: signal 0 only checks that the process exists.
    unsafe { libc::kill(pid, 0) == 0 }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn up_serves_through_the_proxy_and_stops_every_child() {
    let dir = tempfile::tempdir().unwrap();
    let ckpt = dir.path().join("tiny");
    let o = pdkv()
        .args(["model", "init", "--arch", "llama", "--preset", "tiny", "--seed", "3", "--out"])
        .arg(&ckpt)
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));

    let port = free_port();
    let mut up = pdkv()
        .args(["up", "--model", ckpt.to_str().unwrap(), "--num-kv-blocks", "64", "--port", &port.to_string()])
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("spawn pdkv up");
    let out = lines(up.stdout.take().unwrap());
    let err = lines(up.stderr.take().unwrap());

    // Ready: the proxy's URL on stdout.
    let deadline = Instant::now() + DEADLINE;
    let mut stdout = Vec::new();
    let url = loop {
        let left = deadline.saturating_duration_since(Instant::now());
        match out.recv_timeout(left) {
            Ok(line) => {
                if let Some(u) = line.strip_prefix("proxy: ") {
                    break u.trim().to_string();
                }
                stdout.push(line);
            }
            Err(e) => {
                let _ = up.kill();
                let logs: Vec<String> = err.try_iter().collect();
                panic!("no proxy line ({e}); stdout {stdout:?}; stderr:\n{}", logs.join("\n"));
            }
        }
    };
    assert_eq!(url, format!("http://127.0.0.1:{port}"));

    let client = reqwest::Client::new();
    let resp = client
        .post(format!("{url}/v1/completions"))
        .json(&json!({"prompt": "The river", "max_tokens": 5, "temperature": 0, "ignore_eos": true}))
        .send()
        .await
        .unwrap();
    let status = resp.status();
    let body: Value = resp.json().await.unwrap();
    assert_eq!(status, 200, "{body}");
    assert_eq!(body["usage"]["completion_tokens"], 5, "{body}");

    // SIGTERM stops everything.
    // SAFETY: plain syscall on our own child, not yet reaped.
    assert_eq!(unsafe { libc::kill(up.id() as i32, libc::SIGTERM) }, 0);
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        let _ = tx.send(up.wait());
    });
    let status = rx.recv_timeout(DEADLINE).expect("pdkv up exits after SIGTERM").unwrap();
    let logs: Vec<String> = err.try_iter().collect();
    assert!(status.success(), "pdkv up exited with {status}; stderr:\n{}", logs.join("\n"));
    let pids: Vec<i32> = logs
        .iter()
        .filter_map(|l| l.split("(pid ").nth(1)?.split(')').next()?.parse().ok())
        .collect();
    assert_eq!(pids.len(), 3, "three children started:\n{}", logs.join("\n"));
    for pid in pids {
        assert!(!alive(pid), "child {pid} outlived pdkv up");
    }
}
