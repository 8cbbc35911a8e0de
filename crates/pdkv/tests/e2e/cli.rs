//! The `pdkv` binary end to end: `model init`, `serve` on an ephemeral port
//! (found in the log line `listening on http://ADDR`), requests over HTTP,
//! and a graceful SIGTERM shutdown. `smollm2_answers_paris` runs the real
//! SmolLM2 model when its GGUF is present and says so when it skips (under
//! CI its absence fails). Processes are run with `common`'s `Proc`.

use std::path::{Path, PathBuf};
use std::process::Stdio;

use pdkv_testkit::{
    http::{self, wait_healthy},
    models::smollm2,
    proc::{pdkv, Proc},
    sse::stream_text,
};
use serde_json::{json, Value};

/// `pdkv serve --port 0 ARGS...` with the environment variables `envs`.
fn serve(args: &[&str], envs: &[(&str, &str)]) -> Proc {
    Proc::start_env(&[], &[&["serve", "--port", "0"], args].concat(), envs)
}

fn init_checkpoint(out: &Path) {
    let o = pdkv()
        .args([
            "model", "init", "--arch", "llama", "--preset", "tiny", "--seed", "5", "--out",
        ])
        .arg(out)
        .output()
        .expect("run pdkv model init");
    assert!(
        o.status.success(),
        "model init failed: {}",
        String::from_utf8_lossy(&o.stderr)
    );
}

/// A tiny checkpoint written by `pdkv model init` in a new temporary
/// directory (removed when the first value drops); its path.
fn tiny_checkpoint() -> (tempfile::TempDir, PathBuf) {
    let dir = tempfile::tempdir().unwrap();
    let ckpt = dir.path().join("tiny");
    init_checkpoint(&ckpt);
    (dir, ckpt)
}

/// `pdkv ARGS --model CKPT`, which must succeed (`what` names it in the
/// failure); its stdout.
fn run_ok(args: &[&str], ckpt: &Path, what: &str) -> String {
    let o = pdkv().args(args).arg("--model").arg(ckpt).output().unwrap();
    let stdout = String::from_utf8_lossy(&o.stdout).into_owned();
    assert!(
        o.status.success(),
        "{what} failed:\n{stdout}\n{}",
        String::from_utf8_lossy(&o.stderr)
    );
    stdout
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn model_init_then_serve_answers_a_completion() {
    let (_dir, ckpt) = tiny_checkpoint();
    for f in [
        "config.json",
        "model.safetensors",
        "tokenizer.json",
        "tokenizer_config.json",
    ] {
        assert!(ckpt.join(f).is_file(), "model init wrote no {f}");
    }

    let s = serve(
        &[
            "--model",
            ckpt.to_str().unwrap(),
            "--num-kv-blocks",
            "64",
            "--served-model-name",
            "tiny",
        ],
        &[],
    );
    let client = reqwest::Client::new();
    wait_healthy(&client, &s.url("/health")).await;

    let models: Value = pdkv_testkit::http::get_json(&client, &s.url("/v1/models"))
        .await
        .1;
    assert_eq!(models["data"][0]["id"], "tiny");

    let resp = http::send(client.post(s.url("/v1/completions")).json(&json!({"model": "tiny", "prompt": "The river", "max_tokens": 5, "temperature": 0, "ignore_eos": true}))).await;
    assert_eq!(resp.status(), 200);
    let body: Value = resp.json().await.unwrap();
    assert_eq!(body["object"], "text_completion");
    assert_eq!(body["choices"][0]["finish_reason"], "length");
    assert_eq!(body["usage"]["completion_tokens"], 5);

    let metrics = pdkv_testkit::http::get_text(&client, &s.url("/metrics")).await;
    assert!(metrics.contains("pdkv_kv_blocks_total 64\n"), "{metrics}");
    // Without --admin-token the lifecycle API does not exist.
    let resp = http::send(client.post(s.url("/sleep")).bearer_auth("anything")).await;
    assert_eq!(resp.status(), 404);

    let status = s.terminate();
    assert!(
        status.success(),
        "pdkv serve exited with {status} after SIGTERM"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn admin_token_from_flag_or_env_guards_the_lifecycle_api() {
    let (_dir, ckpt) = tiny_checkpoint();
    let model = ckpt.to_str().unwrap();
    let client = reqwest::Client::new();
    for (args, envs) in [
        (
            vec![
                "--model",
                model,
                "--num-kv-blocks",
                "32",
                "--admin-token",
                "flag-secret",
            ],
            vec![],
        ),
        (
            vec!["--model", model, "--num-kv-blocks", "32"],
            vec![("PDKV_ADMIN_TOKEN", "flag-secret")],
        ),
    ] {
        let s = serve(&args, &envs);
        wait_healthy(&client, &s.url("/health")).await;
        let resp = client.get(s.url("/is_sleeping")).send().await.unwrap();
        assert_eq!(resp.status(), 401);
        let resp = http::send(client.get(s.url("/is_sleeping")).bearer_auth("wrong")).await;
        assert_eq!(resp.status(), 401);
        let resp = http::send(client.get(s.url("/is_sleeping")).bearer_auth("flag-secret")).await;
        assert_eq!(resp.status(), 200);
        assert_eq!(
            resp.json::<Value>().await.unwrap(),
            json!({"is_sleeping": false, "level": null, "weights_discarded": false})
        );
        let v: Value = http::send(
            client
                .post(s.url("/sleep?level=1"))
                .bearer_auth("flag-secret"),
        )
        .await
        .json()
        .await
        .unwrap();
        assert_eq!(v["status"], "sleeping", "{v}");
        let resp = http::send(client.post(s.url("/wake_up")).bearer_auth("flag-secret")).await;
        assert_eq!(resp.status(), 200);
        let status = s.terminate();
        assert!(status.success(), "pdkv serve exited with {status}");
    }
    // An empty token is refused at start-up rather than guarding nothing.
    let o = pdkv()
        .args([
            "serve",
            "--port",
            "0",
            "--model",
            model,
            "--admin-token",
            "",
        ])
        .stdin(Stdio::null())
        .output()
        .unwrap();
    assert!(!o.status.success());
    assert!(String::from_utf8_lossy(&o.stderr).contains("admin-token"));
}

#[test]
fn bench_sleep_checks_outputs_and_reports_memory_per_level() {
    let (_dir, ckpt) = tiny_checkpoint();
    let bench = [
        "bench",
        "sleep",
        "--num-kv-blocks",
        "64",
        "--cycles",
        "2",
        "--probe-tokens",
        "6",
    ];
    let stdout = run_ok(&bench, &ckpt, "bench sleep");
    assert!(stdout.contains("PASS"), "{stdout}");
    let last: Value =
        serde_json::from_str(stdout.lines().last().unwrap()).expect("last line is JSON");
    assert_eq!(last["probes_match"], true);
    for level in ["0", "1", "2"] {
        let l = &last["levels"][level];
        assert!(l["sleep_ms"].as_f64().unwrap() >= 0.0, "{last}");
        assert!(l["wake_ms"].as_f64().unwrap() >= 0.0, "{last}");
        assert!(l["awake_bytes"].as_u64().unwrap() > 0, "{last}");
        assert_eq!(l["probes_run"], l["probes_matched"], "{last}");
    }
    // Level 0 only pauses; levels 1 and 2 release the weights and the KV cache.
    assert_eq!(last["levels"]["0"]["asleep_fraction"], 1.0, "{last}");
    for level in ["1", "2"] {
        assert!(
            last["levels"][level]["asleep_fraction"].as_f64().unwrap() < 0.1,
            "{last}"
        );
    }
    assert!(
        last["levels"]["1"]["host_backup_bytes"].as_u64().unwrap() > 0,
        "{last}"
    );
    assert_eq!(last["levels"]["2"]["host_backup_bytes"], 0, "{last}");
    assert!(
        last["levels"]["2"]["reload_ms"].as_f64().is_some(),
        "{last}"
    );
}

#[test]
fn model_init_rejects_an_unknown_preset() {
    let dir = tempfile::tempdir().unwrap();
    let o = pdkv()
        .args([
            "model", "init", "--arch", "qwen3", "--preset", "huge", "--out",
        ])
        .arg(dir.path().join("x"))
        .output()
        .unwrap();
    assert!(!o.status.success());
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(err.contains("huge"), "{err}");
}

#[test]
fn serve_with_a_missing_model_fails_with_its_path() {
    let o = pdkv()
        .args(["serve", "--port", "0", "--model", "/nonexistent/model.gguf"])
        .stdin(Stdio::null())
        .output()
        .unwrap();
    assert!(!o.status.success());
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(
        err.contains("error:") && err.contains("/nonexistent/model.gguf"),
        "{err}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn smollm2_answers_paris() {
    let Some(path) = smollm2("smollm2_answers_paris") else {
        return;
    };
    let s = serve(
        &["--model", path.to_str().unwrap(), "--num-kv-blocks", "128"],
        &[],
    );
    let client = reqwest::Client::new();
    wait_healthy(&client, &s.url("/health")).await;
    let question = json!([{"role": "user", "content": "Name the capital city of France."}]);

    let body: Value = http::send(
        client
            .post(s.url("/v1/chat/completions"))
            .json(&json!({"messages": question, "temperature": 0, "max_tokens": 32})),
    )
    .await
    .json()
    .await
    .unwrap();
    let answer = body["choices"][0]["message"]["content"]
        .as_str()
        .unwrap_or_default()
        .to_string();
    assert!(answer.contains("Paris"), "answer: {answer:?} ({body})");

    let text =
        http::send(client.post(s.url("/v1/chat/completions")).json(
            &json!({"messages": question, "temperature": 0, "max_tokens": 32, "stream": true}),
        ))
        .await
        .text()
        .await
        .unwrap();
    let streamed = stream_text(&text).unwrap_or_else(|e| panic!("bad stream: {e}"));
    assert!(text.ends_with("data: [DONE]\n\n"));
    assert_eq!(
        streamed, answer,
        "greedy streaming and non-streaming answers differ"
    );
    let status = s.terminate();
    assert!(status.success(), "pdkv serve exited with {status}");
}

#[test]
fn bench_pd_checks_outputs_and_compares_the_first_request_after_a_wake() {
    let (_dir, ckpt) = tiny_checkpoint();
    let bench = [
        "bench",
        "pd",
        "--prompt-lens",
        "48",
        "--concurrency",
        "1,3",
        "--max-tokens",
        "4",
        "--num-kv-blocks",
        "64",
        "--max-num-batched-tokens",
        "64",
        "--wake-rounds",
        "2",
    ];
    let stdout = run_ok(&bench, &ckpt, "bench pd");
    assert!(
        stdout.contains("outputs equal to colocated: yes"),
        "{stdout}"
    );
    let last: Value =
        serde_json::from_str(stdout.lines().last().unwrap()).expect("last line is JSON");
    assert_eq!(last["levels"].as_array().unwrap().len(), 2, "{last}");
    for level in last["levels"].as_array().unwrap() {
        assert_eq!(level["outputs_equal"], true, "{last}");
        assert!(
            level["pd"]["ttft_ms_mean"].as_f64().unwrap() > 0.0,
            "{last}"
        );
    }
    let moved = &last["kv_moved"];
    assert!(moved["bytes_per_token"].as_f64().unwrap() > 0.0, "{last}");
    assert_eq!(moved["kv_cache_dtype"], "f16", "{last}");
    let w = &last["after_wake"];
    assert_eq!(w["rounds"], 2, "{last}");
    assert_eq!(w["first"]["ttft_ms"].as_array().unwrap().len(), 2, "{last}");
    assert_eq!(
        w["steady"]["ttft_ms"].as_array().unwrap().len(),
        6,
        "{last}"
    );
    assert!(
        w["ratio"].as_f64().unwrap() > 0.0 && w["wake_ms_median"].as_f64().unwrap() > 0.0,
        "{last}"
    );
}

/// `pdkv bench spec` on SmolLM2: both workloads run with and without drafts,
/// the outputs are identical (the bench fails otherwise), and the answers
/// that copy their prompts keep drafts. No figure is asserted: speed is the
/// bench's to report.
#[test]
fn bench_spec_checks_outputs_and_keeps_drafts_on_copies() {
    let Some(model) = smollm2("bench_spec_checks_outputs_and_keeps_drafts_on_copies") else {
        return;
    };
    let args = ["bench", "spec", "--max-tokens", "32", "--repeats", "1"];
    let stdout = run_ok(&args, &model, "bench spec");
    assert!(
        stdout.contains("outputs with and without drafts: identical"),
        "{stdout}"
    );
    let last: Value =
        serde_json::from_str(stdout.lines().last().unwrap()).expect("last line is JSON");
    let rows = last["workloads"].as_array().unwrap();
    assert_eq!(rows.len(), 2, "{last}");
    assert!(rows[0]["workload"]
        .as_str()
        .unwrap()
        .starts_with("repetitive"));
    assert!(rows[0]["accepted_tokens"].as_u64().unwrap() > 0, "{last}");
    for r in rows {
        assert!(
            r["off_tok_s"].as_f64().unwrap() > 0.0 && r["on_tok_s"].as_f64().unwrap() > 0.0,
            "{last}"
        );
    }
}

/// `pdkv bench structured` runs both sides to the same token count and
/// reports the masks it computed; no figure is asserted.
#[test]
fn bench_structured_runs_both_sides_and_reports_masks() {
    let Some(model) = smollm2("bench_structured_runs_both_sides_and_reports_masks") else {
        return;
    };
    let args = [
        "bench",
        "structured",
        "--concurrency",
        "4",
        "--max-tokens",
        "24",
        "--repeats",
        "1",
    ];
    let stdout = run_ok(&args, &model, "bench structured");
    let last: Value =
        serde_json::from_str(stdout.lines().last().unwrap()).expect("last line is JSON");
    assert!(
        last["unconstrained_tok_s"].as_f64().unwrap() > 0.0,
        "{last}"
    );
    assert!(last["structured_tok_s"].as_f64().unwrap() > 0.0, "{last}");
    assert_eq!(
        last["masks"].as_u64(),
        Some(4 * 24),
        "a mask per constrained token: {last}"
    );
}
