//! The lifecycle matrix end to end: `pdkv lifecycle --cases all` on a tiny
//! random Llama checkpoint, in write mode over TCP and read mode over shared
//! memory, both with D's `kv_load_failure_policy` `fail` (where a failed
//! transfer would fail its request, and every case requires none).
//! The command starts P, D and the proxy itself, runs every case under load
//! with client disconnects, and checks outputs against the awake baseline,
//! lost requests, quiescence and device memory; here its exit status must
//! be 0 and its output must list every case (from `--list`) as PASS.

use std::io::Read;
use std::process::{Command, Stdio};
use std::sync::mpsc;
use std::time::Duration;

/// Bound on one whole matrix run.
const RUN_DEADLINE: Duration = Duration::from_secs(900);

fn pdkv() -> Command {
    Command::new(env!("CARGO_BIN_EXE_pdkv"))
}

/// Runs `pdkv ARGS`, bounded by [`RUN_DEADLINE`] (killed after it);
/// returns (success, stdout, stderr).
fn run_bounded(args: &[&str]) -> (bool, String, String) {
    let mut child = pdkv()
        .args(args)
        .env("RUST_LOG", "info")
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("spawn pdkv");
    let mut out = child.stdout.take().expect("stdout");
    let mut err = child.stderr.take().expect("stderr");
    let out_reader = std::thread::spawn(move || {
        let mut s = String::new();
        let _ = out.read_to_string(&mut s);
        s
    });
    let err_reader = std::thread::spawn(move || {
        let mut s = String::new();
        let _ = err.read_to_string(&mut s);
        s
    });
    let pid = child.id();
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        let _ = tx.send(child.wait());
    });
    let status = match rx.recv_timeout(RUN_DEADLINE) {
        Ok(s) => s.expect("wait for pdkv"),
        Err(_) => {
            // SAFETY: a plain syscall on our own child (its waiter has not reaped it).
            unsafe { libc::kill(pid as libc::pid_t, libc::SIGKILL) };
            panic!(
                "`pdkv {}` did not finish within {RUN_DEADLINE:?}",
                args.join(" ")
            );
        }
    };
    (
        status.success(),
        out_reader.join().unwrap(),
        err_reader.join().unwrap(),
    )
}

#[test]
fn every_lifecycle_case_passes_under_load_in_write_and_read_mode() {
    let dir = tempfile::tempdir().unwrap();
    let model = dir.path().join("tiny-llama");
    let model = model.to_str().unwrap();
    let (ok, _, err) = run_bounded(&[
        "model", "init", "--arch", "llama", "--preset", "tiny", "--out", model,
    ]);
    assert!(ok, "model init failed: {err}");

    let (ok, list, err) = run_bounded(&["lifecycle", "--list"]);
    assert!(ok, "--list failed: {err}");
    let cases: Vec<&str> = list
        .lines()
        .map(str::trim)
        .filter(|l| !l.is_empty())
        .collect();
    assert_eq!(cases.len(), 40, "{list}");

    // Write mode over TCP and read mode over shared memory: each transfer
    // mode and each transport once (the other two pairings run by hand with
    // the same command; the test command stays within its time budget).
    for (transport, mode) in [("tcp", "write"), ("shm", "read")] {
        let (ok, out, err) = run_bounded(&[
            "lifecycle",
            "--cases",
            "all",
            "--model",
            model,
            "--transport",
            transport,
            "--transfer-mode",
            mode,
            "--kv-load-failure-policy",
            "fail",
            "--probes",
            "30",
            "--load-concurrency",
            "4",
            // P gives up on transfers nobody collects after 5 s (the default
            // 30 s would only make the run slower).
            "--kv-abort-timeout-s",
            "5",
        ]);
        let tail: String = err
            .lines()
            .rev()
            .take(40)
            .collect::<Vec<_>>()
            .into_iter()
            .rev()
            .collect::<Vec<_>>()
            .join("\n");
        println!("{transport} {mode} fail:\n{out}");
        let missing: Vec<&&str> = cases
            .iter()
            .filter(|c| !out.lines().any(|l| l.starts_with(&format!("PASS {c} 1 "))))
            .collect();
        assert!(missing.is_empty(), "{transport} {mode}: cases not passing: {missing:?}\nstdout:\n{out}\nstderr tail:\n{tail}");
        assert!(
            ok,
            "{transport} {mode}: pdkv lifecycle failed\nstdout:\n{out}\nstderr tail:\n{tail}"
        );
        let summary: serde_json::Value =
            serde_json::from_str(out.lines().last().unwrap_or_default())
                .expect("a JSON summary last on stdout");
        assert_eq!(summary["failed"], 0, "{summary}");
        assert_eq!(summary["passed"], cases.len(), "{summary}");
    }
}
