//! `pdkv bench serve` end to end on SmolLM2: its own 1P1D deployment under
//! 12 s of load (past the HTTP side's 10 s header timeout) with intended disconnects and an idle flood on the proxy's
//! port and every KV port. No request fails unintentionally, some are cut
//! on purpose, every KV block is free on P and D at the end, and the
//! latency percentiles are there and ordered.

use std::io::Read;
use std::process::Stdio;
use std::sync::mpsc;

use pdkv_testkit::{models::smollm2, proc::pdkv, DEADLINE};
use serde_json::Value;

/// Runs `pdkv ARGS`, bounded by [`DEADLINE`]: (exit success, stdout, stderr).
fn run_bounded(args: &[&str]) -> (bool, String, String) {
    let mut child = pdkv()
        .args(args)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let read = |mut pipe: Box<dyn Read + Send>| {
        std::thread::spawn(move || {
            let mut s = String::new();
            let _ = pipe.read_to_string(&mut s);
            s
        })
    };
    let out = read(Box::new(child.stdout.take().unwrap()));
    let err = read(Box::new(child.stderr.take().unwrap()));
    let pid = child.id();
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        let _ = tx.send(child.wait());
    });
    let status = match rx.recv_timeout(DEADLINE) {
        Ok(s) => s.unwrap(),
        Err(_) => {
            // SAFETY: a plain syscall on our own child's pid, not yet reaped.
            unsafe { libc::kill(pid as libc::pid_t, libc::SIGKILL) };
            panic!(
                "`pdkv {}` did not finish within {DEADLINE:?}",
                args.join(" ")
            );
        }
    };
    (status.success(), out.join().unwrap(), err.join().unwrap())
}

/// `pdkv bench serve ARGS` on SmolLM2 (`None` where the model cannot be
/// had), its logs in a temporary directory: it must succeed; the JSON line
/// it prints last, and the logs' directory.
fn bench_serve(test: &str, args: &[&str]) -> Option<(Value, tempfile::TempDir)> {
    let model = smollm2(test)?;
    let logs = tempfile::tempdir().unwrap();
    let mut all = vec!["bench", "serve"];
    all.extend_from_slice(args);
    all.extend([
        "--model",
        model.to_str().unwrap(),
        "--log-dir",
        logs.path().to_str().unwrap(),
    ]);
    let v = bench_json(&all);
    Some((v, logs))
}

/// Runs `pdkv ARGS` (a `bench serve`), which must succeed, and returns
/// the JSON line it prints last.
fn bench_json(args: &[&str]) -> Value {
    let (ok, stdout, stderr) = run_bounded(args);
    println!("{stdout}");
    assert!(ok, "`pdkv {}` failed; stderr:\n{stderr}", args.join(" "));
    let last = stdout.lines().last().expect("a JSON line");
    serde_json::from_str(last).unwrap_or_else(|e| panic!("{e}: {last}"))
}

fn ms(v: &Value, what: &str, p: &str) -> f64 {
    v[what][p]
        .as_f64()
        .unwrap_or_else(|| panic!("{what}.{p} missing: {v}"))
}

#[test]
fn bench_serve_holds_up_under_disconnects_and_an_idle_flood() {
    let Some((v, logs)) = bench_serve(
        "bench_serve_holds_up_under_disconnects_and_an_idle_flood",
        &[
            "--duration-s",
            "12",
            "--warmup-s",
            "2",
            "--concurrency",
            "8",
            "--max-tokens",
            "8",
            "--disconnect-share",
            "0.2",
            "--idle-flood",
            "200",
            "--idle-flood-kv",
            "50",
            "--sample-s",
            "5",
        ],
    ) else {
        return;
    };

    let req = &v["requests"];
    assert_eq!(
        req["failed"], 0,
        "unintended failures: {}",
        req["failed_by_cause"]
    );
    assert!(req["ok"].as_u64().unwrap() > 0, "{req}");
    assert!(
        req["disconnected"].as_u64().unwrap() >= 1,
        "no intended disconnect: {req}"
    );

    let blocks = v["blocks"].as_array().unwrap();
    assert_eq!(blocks.len(), 2, "{v}");
    for b in blocks {
        assert_eq!(b["all_free"], true, "{b}");
        assert_eq!(b["free"], b["total"], "{b}");
    }
    for what in ["ttft_ms", "itl_ms"] {
        let (p50, p90, p99, max) = (
            ms(&v, what, "p50"),
            ms(&v, what, "p90"),
            ms(&v, what, "p99"),
            ms(&v, what, "max"),
        );
        assert!(
            0.0 < p50 && p50 <= p90 && p90 <= p99 && p99 <= max,
            "{what}: {}",
            v[what]
        );
    }
    assert!(v["output_tok_per_s"].as_f64().unwrap() > 0.0, "{v}");
    // The flood was held on the proxy and on every KV port, and the HTTP
    // side closed idle connections (after its 10 s header timeout).
    let flood = v["idle_flood"].as_array().unwrap();
    assert!(flood.len() >= 3, "{flood:?}");
    assert!(
        flood[0]["closed_by_server"].as_u64().unwrap() > 0,
        "{}",
        flood[0]
    );
    // The drift baseline is a sample after the warm-up; children's logs are files.
    assert!(
        v["memory_drift"].as_array().is_some_and(|d| !d.is_empty()),
        "{v}"
    );
    for name in ["prefill", "decode", "proxy"] {
        assert!(
            logs.path().join(format!("{name}.log")).is_file(),
            "no {name}.log"
        );
    }
}

/// `--chaos`: a 1P2D deployment whose engines are killed with SIGKILL every
/// 4 s (decode 0, the prefill engine, decode 1, ...) and started again at
/// once while 8 clients stream: no request fails, every one's greedy tokens
/// equal what it gets at rest afterwards, every KV block is free at the end,
/// and the proxy resumed lost streams or let a decode engine compute prompts
/// while the prefill engine was gone.
#[test]
fn bench_serve_chaos_kills_engines_without_failing_a_request() {
    let Some((v, _logs)) = bench_serve(
        "bench_serve_chaos_kills_engines_without_failing_a_request",
        &[
            "--chaos",
            "--verify-outputs",
            "--chaos-interval-s",
            "4",
            "--duration-s",
            "18",
            "--warmup-s",
            "2",
            "--concurrency",
            "8",
            "--max-tokens",
            "32",
            "--disconnect-share",
            "0",
            "--sample-s",
            "5",
        ],
    ) else {
        return;
    };
    let req = &v["requests"];
    assert_eq!(req["failed"], 0, "failures: {}", req["failed_by_cause"]);
    assert!(req["ok"].as_u64().unwrap() > 0, "{req}");
    let chaos = &v["chaos"];
    assert!(chaos["killed"].as_u64().unwrap() >= 3, "{chaos}");
    let killed: Vec<&str> = chaos["kills"]
        .as_array()
        .unwrap()
        .iter()
        .map(|k| k["engine"].as_str().unwrap())
        .collect();
    assert_eq!(killed[..3], ["decode 0", "prefill", "decode 1"], "{chaos}");
    let blocks = v["blocks"].as_array().unwrap();
    assert_eq!(blocks.len(), 3, "{v}");
    for b in blocks {
        assert_eq!(b["all_free"], true, "{b}");
    }
    // Every request that ended well got what it gets at rest.
    let verified = &v["verify_outputs"];
    assert_eq!(verified["differ"], 0, "{verified}");
    assert_eq!(verified["failed"], 0, "{verified}");
    assert_eq!(verified["checked"], req["ok"], "{verified}");
    let proxy = &chaos["proxy"];
    let handled = proxy["streams_resumed"].as_f64().unwrap_or(0.0)
        + proxy["prefill_down"].as_f64().unwrap_or(0.0)
        + proxy["prefill_skipped"]["lost"].as_f64().unwrap_or(0.0);
    assert!(handled >= 1.0, "the proxy saw no kill: {proxy}");
}
