//! Running `pdkv` processes in tests: start a subcommand, find the address
//! it listens on in its log (`listening on http://ADDR`), talk HTTP to it,
//! stop it with SIGTERM. Every wait is bounded.
#![allow(dead_code)]

use std::io::{BufRead, BufReader};
use std::path::PathBuf;
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use serde_json::Value;

/// Bound on every wait in these tests.
pub const DEADLINE: Duration = Duration::from_secs(180);

/// A running `pdkv` process, killed on drop if still alive.
pub struct Proc {
    child: Option<Child>,
    pub base: String,
    /// Its stderr lines after the `listening` line.
    pub lines: mpsc::Receiver<String>,
}

/// The `pdkv` binary with `RUST_LOG=info`, for a subcommand run to its end.
pub fn pdkv() -> Command {
    let mut c = Command::new(env!("CARGO_BIN_EXE_pdkv"));
    c.env("RUST_LOG", "info");
    c
}

impl Proc {
    /// `pdkv ARGS...` (prefixed with `prefix`, e.g. `ip netns exec NS`),
    /// waiting for its `listening on` line.
    pub fn start(prefix: &[&str], args: &[&str]) -> Proc {
        Proc::start_env(prefix, args, &[])
    }

    /// [`Proc::start`] with the environment variables `envs` added (after
    /// `RUST_LOG=info`, so they may override it).
    pub fn start_env(prefix: &[&str], args: &[&str], envs: &[(&str, &str)]) -> Proc {
        let exe = env!("CARGO_BIN_EXE_pdkv");
        let mut cmd = match prefix.split_first() {
            Some((first, rest)) => {
                let mut c = Command::new(first);
                c.args(rest).arg(exe);
                c
            }
            None => Command::new(exe),
        };
        let mut child = cmd
            .env("RUST_LOG", "info")
            .envs(envs.iter().copied())
            .args(args)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .expect("spawn pdkv");
        let stderr = child.stderr.take().expect("stderr");
        let (tx, lines) = mpsc::channel();
        std::thread::spawn(move || {
            for line in BufReader::new(stderr).lines() {
                let Ok(line) = line else { break };
                if tx.send(line).is_err() {
                    break;
                }
            }
        });
        let mut p = Proc {
            child: Some(child),
            base: String::new(),
            lines,
        };
        let deadline = Instant::now() + DEADLINE;
        let mut seen = Vec::new();
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            match p.lines.recv_timeout(left) {
                Ok(line) => {
                    if let Some(rest) = line.split("listening on ").nth(1) {
                        p.base = rest
                            .split_whitespace()
                            .next()
                            .unwrap_or_default()
                            .to_string();
                        return p;
                    }
                    seen.push(line);
                }
                Err(e) => panic!(
                    "`pdkv {}`: no `listening on` line ({e}); stderr:\n{}",
                    args.join(" "),
                    seen.join("\n")
                ),
            }
        }
    }

    pub fn url(&self, path: &str) -> String {
        format!("{}{}", self.base, path)
    }

    pub fn pid(&self) -> u32 {
        self.child.as_ref().expect("child").id()
    }

    /// Kills the process at once (SIGKILL) and reaps it.
    pub fn kill(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }

    /// Sends SIGTERM and waits (bounded) for the exit status.
    pub fn terminate(mut self) -> ExitStatus {
        let mut child = self.child.take().expect("child");
        let pid = child.id() as libc::pid_t;
        // SAFETY: plain syscall on our own child's pid, which has not been reaped.
        assert_eq!(unsafe { libc::kill(pid, libc::SIGTERM) }, 0);
        let (tx, rx) = mpsc::channel();
        std::thread::spawn(move || {
            let _ = tx.send(child.wait());
        });
        rx.recv_timeout(DEADLINE)
            .expect("pdkv exits after SIGTERM")
            .expect("wait")
    }
}

impl Drop for Proc {
    fn drop(&mut self) {
        self.kill();
    }
}

/// The SmolLM2 GGUF, if this machine has it; under CI its absence fails.
pub fn smollm2_path(test: &str) -> Option<PathBuf> {
    let mut candidates = Vec::new();
    if let Some(p) = std::env::var_os("PDKV_SMOLLM2_GGUF") {
        candidates.push(PathBuf::from(p));
    }
    if let Some(home) = std::env::var_os("HOME") {
        candidates
            .push(PathBuf::from(home).join(".cache/pdkv/models/SmolLM2-135M-Instruct.Q4_1.gguf"));
    }
    let found = candidates.into_iter().find(|p| p.is_file());
    if found.is_none() {
        assert!(
            std::env::var_os("CI").is_none(),
            "{test}: the SmolLM2 GGUF is missing under CI (scripts/test.sh fetches it)"
        );
        println!(
            "skipping {test}: no SmolLM2 GGUF (set PDKV_SMOLLM2_GGUF or run `pdkv model fetch`)"
        );
    }
    found
}

/// Polls `url` until it answers 2xx, bounded by [`DEADLINE`].
pub async fn wait_healthy(client: &reqwest::Client, url: &str) {
    let deadline = Instant::now() + DEADLINE;
    loop {
        if let Ok(r) = client.get(url).send().await {
            if r.status().is_success() {
                return;
            }
        }
        assert!(Instant::now() < deadline, "{url} never became healthy");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// One sample of a Prometheus text exposition (no labels).
pub fn metric(text: &str, name: &str) -> Option<f64> {
    text.lines()
        .filter(|l| !l.starts_with('#'))
        .find_map(|l| l.strip_prefix(name).and_then(|r| r.strip_prefix(' ')))
        .and_then(|v| v.trim().parse().ok())
}

/// Waits until `pred` holds for the server's `/metrics`, bounded.
pub async fn wait_metrics(
    client: &reqwest::Client,
    base: &str,
    what: &str,
    pred: impl Fn(&str) -> bool,
) -> String {
    let deadline = Instant::now() + DEADLINE;
    loop {
        let text = client
            .get(format!("{base}/metrics"))
            .send()
            .await
            .unwrap()
            .text()
            .await
            .unwrap();
        if pred(&text) {
            return text;
        }
        assert!(
            Instant::now() < deadline,
            "{base}: {what} never held; metrics:\n{text}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// The server is idle with every KV block free (none held for transfers).
pub fn quiescent(text: &str) -> bool {
    metric(text, "pdkv_num_requests_running") == Some(0.0)
        && metric(text, "pdkv_num_requests_waiting") == Some(0.0)
        && metric(text, "pdkv_kv_blocks_held") == Some(0.0)
        && metric(text, "pdkv_kv_blocks_free") == metric(text, "pdkv_kv_blocks_total")
}

/// The text of a completion, streamed (SSE) or not.
pub async fn complete(
    client: &reqwest::Client,
    base: &str,
    body: &Value,
) -> Result<String, (u16, String)> {
    let resp = client
        .post(format!("{base}/v1/completions"))
        .json(body)
        .send()
        .await
        .map_err(|e| (0, e.to_string()))?;
    let status = resp.status().as_u16();
    let text = resp.text().await.map_err(|e| (status, e.to_string()))?;
    if status != 200 {
        return Err((status, text));
    }
    if body["stream"].as_bool() != Some(true) {
        let v: Value = serde_json::from_str(&text).map_err(|e| (status, format!("{e}: {text}")))?;
        return Ok(v["choices"][0]["text"]
            .as_str()
            .unwrap_or_default()
            .to_string());
    }
    let mut out = String::new();
    for event in text.split("\n\n").filter(|e| !e.is_empty()) {
        let data = event
            .strip_prefix("data: ")
            .ok_or((status, format!("bad event {event:?}")))?;
        if data == "[DONE]" {
            return Ok(out);
        }
        let chunk: Value =
            serde_json::from_str(data).map_err(|e| (status, format!("{e}: {data}")))?;
        if chunk.get("error").is_some() {
            return Err((status, data.to_string()));
        }
        out.push_str(chunk["choices"][0]["text"].as_str().unwrap_or_default());
    }
    Err((status, format!("stream ended without [DONE]: {text}")))
}
