//! Three RL steps of SkyRL, prime-rl and AReaL, replayed against real pdkv
//! processes: the HTTP requests each framework's own client sends, in its
//! order, against `pdkv serve --dev-mode` (one engine) and `pdkv up
//! --dev-mode` (prefill, decode and the proxy). The served model is a tiny
//! random Llama (seed 1); the trainer's updates are the checkpoints of seeds
//! 2, 3 and 4, one per step.
//!
//! Each test checks: no call fails and no rollout is lost (an aborted one is
//! completed by its continuation); every sampled token's logprob equals the
//! prompt logprob of the same tokens under the weights it was sampled with
//! (within [`LOGPROB_TOL`]); after each update, greedy answers equal a fresh
//! `pdkv serve` of that step's checkpoint.
//!
//! Sources (line ranges at the commits named):
//! - SkyRL a9564572eb8e, `skyrl/backends/skyrl_train/inference_servers/remote_inference_client.py`,
//!   `.../inference_servers/engine_utils.py`, `skyrl/train/trainer.py`,
//!   `skyrl/backends/skyrl_train/workers/worker_dispatch.py`, `.../workers/fsdp/fsdp_worker.py`.
//! - prime-rl 559b44772e47, `src/prime_rl/utils/client.py`,
//!   `src/prime_rl/orchestrator/{dispatcher,envs}.py`,
//!   `packages/prime-rl-configs/src/prime_rl/configs/orchestrator.py`.
//! - AReaL 4aef98d8d818, `areal/engine/vllm_remote.py`, `areal/infra/remote_inf_engine.py`,
//!   `areal/engine/fsdp_engine.py`, `areal/api/cli_args.py`.

use std::collections::BTreeMap;
use std::path::Path;
use std::time::Duration;

use pdkv_model::Arch;
use pdkv_testkit::{
    deploy::Spec,
    http::{get_json, metrics, token_ids, wait_healthy, wait_metrics},
    models::checkpoint,
    proc::{pdkv, Lines, Proc},
    prom::metric,
    DEADLINE,
};
use serde_json::{json, Value};
use tempfile::TempDir;

/// Largest |sampled logprob - recomputed prompt logprob| accepted.
const LOGPROB_TOL: f64 = 1e-4;
/// Rollouts per step, sent at once.
const ROLLOUTS: usize = 8;
/// KV blocks per engine: 8 rollouts of a few hundred tokens fit.
const KV_BLOCKS: &str = "256";
/// Greedy probes compared with a fresh server after each update.
const PROBES: usize = 3;
/// Tokens of a rollout that must still be running when the trainer acts
/// (prime-rl's in-flight update, AReaL's abort): long enough to be caught.
const LONG_ROLLOUT: u64 = 256;
/// Grace for `pdkv up` to stop its children on drop.
const UP_GRACE: Duration = Duration::from_secs(20);

/// The prompt of rollout `i`: 8 ordinary token ids (< 500).
fn prompt(i: usize) -> Vec<u64> {
    (0..8)
        .map(|j| ((i * 37 + j * 11 + 5) % 500) as u64)
        .collect()
}

/// Greedy probe `i`, different from every rollout prompt.
fn probe(i: usize) -> Vec<u64> {
    (0..6)
        .map(|j| ((i * 53 + j * 29 + 301) % 500) as u64)
        .collect()
}

/// The checkpoints of one test: index 0 is served (seed 1), index k the
/// trainer's update of step k (seed k + 1).
fn checkpoints() -> Vec<TempDir> {
    (1..=4)
        .map(|seed| checkpoint(Arch::Llama, "tiny", seed))
        .collect()
}

#[derive(Clone, Copy, Debug)]
enum Kind {
    /// `pdkv serve --dev-mode`.
    Serve,
    /// `pdkv up --dev-mode`: one prefill engine, one decode engine, the proxy.
    Up,
}

/// A running deployment: where clients send requests (`base`), and its
/// engines (the server itself, or P then D behind the proxy).
struct Deployment {
    _proc: Proc,
    base: String,
    engines: Vec<String>,
    /// The served model's name (`/v1/models`), which the clients send as
    /// `model` (SkyRL's `model_name`, prime-rl's `model.name`).
    model: String,
}

impl Deployment {
    /// The engine that samples tokens (the decode engine behind a proxy):
    /// where `/metrics` shows rollouts running.
    fn sampler(&self) -> &str {
        self.engines.last().expect("an engine")
    }
}

async fn deploy(client: &reqwest::Client, kind: Kind, model: &Path) -> Deployment {
    let (proc, base, engines) = start(client, kind, model).await;
    let (status, v) = get_json(client, &format!("{base}/v1/models")).await;
    assert_eq!(status, 200, "{v}");
    let model = v["data"][0]["id"]
        .as_str()
        .unwrap_or_else(|| panic!("no model: {v}"))
        .to_string();
    Deployment {
        _proc: proc,
        base,
        engines,
        model,
    }
}

/// Starts `kind` on `model`: the process, its address and its engines.
async fn start(client: &reqwest::Client, kind: Kind, model: &Path) -> (Proc, String, Vec<String>) {
    let m = model.to_str().unwrap();
    match kind {
        Kind::Serve => {
            let p = Spec::new(model, KV_BLOCKS.parse().unwrap())
                .serve_args(&["--dev-mode"])
                .start_colocated();
            wait_healthy(client, &p.url("/health")).await;
            let base = p.base.clone();
            (p, base.clone(), vec![base])
        }
        Kind::Up => {
            let mut cmd = pdkv();
            // The children inherit stderr; keep it to warnings.
            cmd.env("RUST_LOG", "warn").args([
                "up",
                "--dev-mode",
                "--model",
                m,
                "--num-kv-blocks",
                KV_BLOCKS,
                "--port",
                "0",
            ]);
            let mut p = Proc::spawn(cmd, Lines::Stdout, "pdkv up").with_grace(UP_GRACE);
            let line = p.wait_line("pdkv up", |l| l.starts_with("proxy: "));
            let base = line["proxy: ".len()..].trim().to_string();
            wait_healthy(client, &format!("{base}/health")).await;
            // The proxy's lifecycle answers name its engines, P first.
            let (status, v) = get_json(client, &format!("{base}/is_sleeping")).await;
            assert_eq!(status, 200, "{v}");
            let mut engines: Vec<(String, String)> = v["engines"]
                .as_array()
                .unwrap_or_else(|| panic!("no engines: {v}"))
                .iter()
                .map(|e| {
                    (
                        e["role"].as_str().unwrap_or_default().to_string(),
                        e["url"].as_str().expect("an engine url").to_string(),
                    )
                })
                .collect();
            engines.sort_by_key(|(role, _)| role != "prefill");
            assert_eq!(engines.len(), 2, "{v}");
            (p, base, engines.into_iter().map(|(_, u)| u).collect())
        }
    }
}

/// One answer's worth of sampled tokens: the context it continued, what it
/// sampled with their logprobs, under which checkpoint (index into
/// [`checkpoints`]), and whether the weights may have changed under it (an
/// in-flight update): then only a prefix is sampled under `version`.
#[derive(Clone, Debug)]
struct Segment {
    version: usize,
    context: Vec<u64>,
    tokens: Vec<u64>,
    logprobs: Vec<f64>,
    finish: String,
    straddles: bool,
}

/// `"token_id:N"` -> N.
fn token_id(s: &Value) -> u64 {
    s.as_str()
        .and_then(|s| s.strip_prefix("token_id:"))
        .and_then(|n| n.parse().ok())
        .unwrap_or_else(|| panic!("not token_id:N: {s}"))
}

/// Posts and insists on a 200; bounded by [`DEADLINE`].
async fn ok(req: reqwest::RequestBuilder, what: &str) -> Value {
    let (status, v) = tokio::time::timeout(DEADLINE, pdkv_testkit::http::answer(req))
        .await
        .unwrap_or_else(|_| panic!("{what}: no answer within {DEADLINE:?}"));
    assert_eq!(status, 200, "{what}: {v}");
    v
}

/// An `/inference/v1/generate` answer's first choice as a segment
/// (SkyRL `_generate_single`, remote_inference_client.py 507-521).
fn generate_segment(v: &Value, context: &[u64], version: usize) -> Segment {
    let c = &v["choices"][0];
    let tokens = token_ids(&c["token_ids"]);
    let content = c["logprobs"]["content"]
        .as_array()
        .unwrap_or_else(|| panic!("no logprobs: {v}"));
    assert_eq!(content.len(), tokens.len(), "{v}");
    for (e, t) in content.iter().zip(&tokens) {
        assert_eq!(token_id(&e["token"]), *t, "{v}");
    }
    Segment {
        version,
        context: context.to_vec(),
        tokens,
        logprobs: content
            .iter()
            .map(|e| e["logprob"].as_f64().unwrap())
            .collect(),
        finish: c["finish_reason"].as_str().unwrap_or_default().to_string(),
        straddles: false,
    }
}

/// The prompt logprobs of `tokens` after `context`, recomputed by `base`
/// (prime-rl's `prefill_logprobs`, client.py 479-510, with
/// `prompt_logprobs: 0`: the prompt's own tokens only).
async fn recompute(
    client: &reqwest::Client,
    base: &str,
    context: &[u64],
    tokens: &[u64],
) -> Vec<f64> {
    let full: Vec<u64> = context.iter().chain(tokens).copied().collect();
    let body = json!({"token_ids": full,
        "sampling_params": {"max_tokens": 1, "temperature": 1.0, "top_p": 1.0, "prompt_logprobs": 0}});
    let v = ok(
        client
            .post(format!("{base}/inference/v1/generate"))
            .json(&body),
        "prompt logprobs",
    )
    .await;
    let plp = v["prompt_logprobs"]
        .as_array()
        .unwrap_or_else(|| panic!("no prompt_logprobs: {v}"));
    assert_eq!(plp.len(), full.len(), "{v}");
    tokens
        .iter()
        .enumerate()
        .map(|(j, t)| {
            plp[context.len() + j][t.to_string()]["logprob"]
                .as_f64()
                .unwrap_or_else(|| panic!("position {}: {v}", context.len() + j))
        })
        .collect()
}

/// How many leading tokens of `seg` carry the logprob `base` recomputes.
async fn matching_prefix(client: &reqwest::Client, base: &str, seg: &Segment) -> usize {
    if seg.tokens.is_empty() {
        return 0;
    }
    let want = recompute(client, base, &seg.context, &seg.tokens).await;
    want.iter()
        .zip(&seg.logprobs)
        .take_while(|(a, b)| (*a - *b).abs() <= LOGPROB_TOL)
        .count()
}

/// Every token of every segment sampled under `version` (none straddling)
/// matches `base`'s recompute.
async fn check_logprobs(client: &reqwest::Client, base: &str, segs: &[Segment], version: usize) {
    for s in segs.iter().filter(|s| s.version == version && !s.straddles) {
        let n = matching_prefix(client, base, s).await;
        assert_eq!(
            n,
            s.tokens.len(),
            "version {version}: sampled logprobs differ from the recompute at token {n}: {s:?}"
        );
    }
}

/// What a checkpoint answers to the [`PROBES`]: the greedy tokens, and
/// the prompt logprobs of the probe itself. The tiny random model all but
/// copies its last token (the sampled tokens' logprobs are about -1e-7
/// under every seed), so the prompt logprobs, of tokens it does not
/// expect, are what tells one checkpoint from another.
#[derive(Debug)]
struct Probes {
    tokens: Vec<Vec<u64>>,
    prompt_logprobs: Vec<f64>,
}

async fn greedy(client: &reqwest::Client, base: &str) -> Probes {
    let mut out = Probes {
        tokens: Vec::new(),
        prompt_logprobs: Vec::new(),
    };
    for i in 0..PROBES {
        let body = json!({"token_ids": probe(i), "sampling_params":
            {"max_tokens": 8, "temperature": 0.0, "ignore_eos": true, "prompt_logprobs": 0}});
        let v = ok(
            client
                .post(format!("{base}/inference/v1/generate"))
                .json(&body),
            "greedy probe",
        )
        .await;
        out.tokens.push(token_ids(&v["choices"][0]["token_ids"]));
        let plp = v["prompt_logprobs"]
            .as_array()
            .unwrap_or_else(|| panic!("{v}"));
        for (j, t) in probe(i).iter().enumerate().skip(1) {
            out.prompt_logprobs.push(
                plp[j][t.to_string()]["logprob"]
                    .as_f64()
                    .unwrap_or_else(|| panic!("{v}")),
            );
        }
    }
    out
}

/// The largest difference between two lists of logprobs.
fn largest_diff(a: &[f64], b: &[f64]) -> f64 {
    assert_eq!(a.len(), b.len());
    a.iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs())
        .fold(0.0, f64::max)
}

/// One fresh `pdkv serve` per checkpoint, one after the other: its greedy
/// answers equal those the deployment gave after the update to it, and it
/// recomputes the logprobs of every segment sampled under it. Returns, per
/// segment, how many leading tokens matched (all, for segments that do not
/// straddle an update).
async fn check_with_fresh_servers(
    client: &reqwest::Client,
    ckpts: &[TempDir],
    greedy_seen: &BTreeMap<usize, Probes>,
    segs: &[Segment],
) -> Vec<usize> {
    // Each update changes the probes' logprobs: the check tells
    // checkpoints apart.
    for (v, p) in greedy_seen {
        if let Some(prev) = v.checked_sub(1).and_then(|u| greedy_seen.get(&u)) {
            let d = largest_diff(&p.prompt_logprobs, &prev.prompt_logprobs);
            assert!(
                d > 0.1,
                "checkpoints {} and {v} answer the probes alike ({d})",
                v - 1
            );
        }
    }
    let mut prefix = vec![0; segs.len()];
    for (version, ckpt) in ckpts.iter().enumerate() {
        let here: Vec<usize> = (0..segs.len())
            .filter(|&i| segs[i].version == version)
            .collect();
        if here.is_empty() && !greedy_seen.contains_key(&version) {
            continue;
        }
        let fresh = deploy(client, Kind::Serve, ckpt.path()).await;
        if let Some(seen) = greedy_seen.get(&version) {
            let want = greedy(client, &fresh.base).await;
            assert_eq!(
                want.tokens, seen.tokens,
                "greedy answers after the update to checkpoint {version} differ from a fresh server's"
            );
            let d = largest_diff(&want.prompt_logprobs, &seen.prompt_logprobs);
            assert!(
                d <= LOGPROB_TOL,
                "checkpoint {version}: probe prompt logprobs differ from a fresh server's by {d}"
            );
        }
        for i in here {
            prefix[i] = matching_prefix(client, &fresh.base, &segs[i]).await;
            if !segs[i].straddles {
                assert_eq!(
                    prefix[i],
                    segs[i].tokens.len(),
                    "checkpoint {version}: a fresh server's recompute differs at token {}: {:?}",
                    prefix[i],
                    segs[i]
                );
            }
        }
    }
    prefix
}

/// `name`'s value in `base`'s `/metrics` (0 when absent).
async fn gauge(client: &reqwest::Client, base: &str, name: &str) -> f64 {
    metric(&metrics(client, base).await, name).unwrap_or(0.0)
}

/// Waits until a rollout runs on `base` and has sampled a token (its
/// `pdkv_generation_tokens_total` past `gen0`): a pause sent then finds
/// some of the step's tokens generated and rollouts in flight. (Not every
/// rollout at once: under load a small model's rollout can finish before
/// the last one is admitted, and that wait then never ends.)
async fn wait_sampling(client: &reqwest::Client, base: &str, gen0: f64) {
    wait_metrics(client, base, "a rollout sampling", |t| {
        metric(t, "pdkv_num_requests_running").unwrap_or(0.0) >= 1.0
            && metric(t, "pdkv_generation_tokens_total").unwrap_or(0.0) > gen0
    })
    .await;
}

// ---------------------------------------------------------------- SkyRL

/// SkyRL's vLLM sampling params (engine_utils.py 55-82) with its defaults
/// (skyrl/train/config/config.py 995-1020: temperature 1.0, top_p 1.0,
/// top_k -1, min_p 0.0, logprobs 1) and a short `max_generate_length`; the
/// seed comes through `additional_kwargs` (engine_utils.py 78-81) so a run
/// replays.
fn skyrl_sampling_params(seed: u64) -> Value {
    json!({"min_tokens": 1, "skip_special_tokens": true, "include_stop_str_in_output": true,
        "max_tokens": 16, "temperature": 1.0, "top_p": 1.0, "top_k": -1, "min_p": 0.0,
        "logprobs": 1, "stop": null, "seed": seed})
}

/// SkyRL's `generate` (remote_inference_client.py 370-464): one
/// `/inference/v1/generate` per prompt, all at once, each with its session
/// in `X-Session-ID` (466-532), then `/detokenize` of each answer (445-460,
/// 862-892).
async fn skyrl_generate(client: &reqwest::Client, dep: &Deployment, step: usize) -> Vec<Segment> {
    let tasks: Vec<_> = (0..ROLLOUTS)
        .map(|i| {
            let (client, base, model) = (client.clone(), dep.base.clone(), dep.model.clone());
            tokio::spawn(async move {
                let p = prompt(i);
                let payload = json!({"sampling_params": skyrl_sampling_params((step * 100 + i) as u64),
                    "model": model, "token_ids": p});
                let v = ok(
                    client
                        .post(format!("{base}/inference/v1/generate"))
                        .header("X-Session-ID", format!("step{step}-traj{i}"))
                        .json(&payload),
                    "SkyRL generate",
                )
                .await;
                let seg = generate_segment(&v, &p, step);
                assert!(matches!(seg.finish.as_str(), "stop" | "length"), "{v}");
                let d = ok(
                    client
                        .post(format!("{base}/detokenize"))
                        .json(&json!({"model": model, "tokens": seg.tokens})),
                    "SkyRL detokenize",
                )
                .await;
                assert!(d["prompt"].is_string(), "{d}");
                seg
            })
        })
        .collect();
    let mut out = Vec::new();
    for t in tasks {
        out.push(t.await.expect("a rollout task"));
    }
    out
}

/// SkyRL's control plane: `_call_all_servers` (remote_inference_client.py
/// 933-983) sends the call to every backend (`server_urls`, not the
/// router) at once.
async fn skyrl_fan_out(
    client: &reqwest::Client,
    engines: &[String],
    path: &str,
    body: Option<Value>,
) {
    let calls = engines.iter().map(|e| {
        let mut req = client.post(format!("{e}{path}"));
        if let Some(b) = &body {
            req = req.json(b);
        }
        ok(req, path)
    });
    futures::future::join_all(calls).await;
}

/// SkyRL, colocated and synchronous, three steps: generate; `sleep()`
/// (trainer.py 379-381: level 2, by query string, remote_inference_client.py
/// 1023-1047); `save_weights_for_sampler` (worker_dispatch.py 629-653):
/// `wake_up(tags=["weights"])`, the broadcast, `wake_up(tags=["kv_cache"])`.
/// The broadcast goes over NCCL, which pdkv does not speak: a `POST
/// /update_weights {"path"}` of the step's checkpoint stands in for it,
/// with the `reset_prefix_cache(reset_running_requests=True)` the FSDP
/// worker issues alongside it (fsdp_worker.py 276-285). The whole sync is
/// bracketed by a keep-mode pause and a resume, as the fully-async path
/// does (worker_dispatch.py 673-681; pause 985-1009, resume 1011-1013).
async fn skyrl_three_steps(kind: Kind) {
    let client = reqwest::Client::new();
    let ckpts = checkpoints();
    let dep = deploy(&client, kind, ckpts[0].path()).await;
    // `get_world_size` (remote_inference_client.py, get_world_size).
    for e in &dep.engines {
        let (status, v) = get_json(&client, &format!("{e}/get_world_size")).await;
        assert_eq!((status.as_u16(), &v["world_size"]), (200, &json!(1)), "{v}");
    }
    let mut segs = Vec::new();
    let mut greedy_seen = BTreeMap::new();
    for step in 0..=3 {
        let batch = skyrl_generate(&client, &dep, step).await;
        assert_eq!(batch.len(), ROLLOUTS);
        check_logprobs(&client, &dep.base, &batch, step).await;
        segs.extend(batch);
        if step == 3 {
            break;
        }
        let e = &dep.engines;
        skyrl_fan_out(&client, e, "/pause?mode=keep&clear_cache=false", None).await;
        skyrl_fan_out(&client, e, "/sleep?level=2", None).await;
        skyrl_fan_out(&client, e, "/wake_up?tags=weights", None).await;
        let dir = ckpts[step + 1].path().to_str().unwrap().to_string();
        skyrl_fan_out(&client, e, "/update_weights", Some(json!({"path": dir}))).await;
        skyrl_fan_out(
            &client,
            e,
            "/reset_prefix_cache",
            Some(json!({"reset_running_requests": true})),
        )
        .await;
        skyrl_fan_out(&client, e, "/wake_up?tags=kv_cache", None).await;
        skyrl_fan_out(&client, e, "/resume", None).await;
        greedy_seen.insert(step + 1, greedy(&client, &dep.base).await);
    }
    drop(dep);
    check_with_fresh_servers(&client, &ckpts, &greedy_seen, &segs).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn frameworks_skyrl_three_steps_on_serve() {
    skyrl_three_steps(Kind::Serve).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn frameworks_skyrl_three_steps_on_up() {
    skyrl_three_steps(Kind::Up).await;
}

// ---------------------------------------------------------------- AReaL

/// AReaL's `agenerate` (remote_inf_engine.py 719-880) for one rollout: the
/// vLLM payload of `build_generation_request` (vllm_remote.py 44-96) on
/// `/v1/completions` with the prompt as token ids, parsed as
/// `parse_generation_response` does (98-127); an answer cut short by a
/// pause ("abort") is sent again with its tokens appended to the prompt
/// and `max_tokens` reduced by them (785-853), until it stops. The
/// generation config is AReaL's default (cli_args.py 163-232: top_p 1.0,
/// top_k 1e8, temperature 1.0) with `ignore_eos` on so every rollout runs
/// long enough to be caught by the pause, and a `seed` added (not in
/// AReaL's payload) so runs replay. Segments sent before the pause are
/// under `version`, continuations under `version + 1`. Before each send it
/// waits while the trainer has paused the executor (`paused`, set around
/// the weight update), as AReaL's loop does.
async fn areal_rollout(
    client: reqwest::Client,
    base: String,
    i: usize,
    version: usize,
    mut paused: tokio::sync::watch::Receiver<bool>,
) -> Vec<Segment> {
    let mut input = prompt(i);
    let mut left = LONG_ROLLOUT;
    let mut out: Vec<Segment> = Vec::new();
    let mut stop = String::new();
    while !matches!(stop.as_str(), "stop" | "length") && left > 0 {
        // "Request is interrupted, wait for some time to avoid interfering
        // with update weights requests" (791-793): the executor's pause.
        tokio::time::timeout(DEADLINE, paused.wait_for(|p| !*p))
            .await
            .expect("the trainer continues generation in time")
            .expect("the trainer's pause flag");
        let payload = json!({"top_p": 1.0, "top_k": 100_000_000, "max_tokens": left,
            "temperature": 1.0, "stop_token_ids": [], "ignore_eos": true,
            "skip_special_tokens": true, "return_tokens_as_token_ids": true, "logprobs": 0,
            "use_beam_search": false, "stream": false, "prompt": input,
            "seed": (version * 100 + i + out.len() * 10) as u64});
        let v = ok(
            client.post(format!("{base}/v1/completions")).json(&payload),
            "AReaL completion",
        )
        .await;
        let c = &v["choices"][0];
        let lp = &c["logprobs"];
        let tokens: Vec<u64> = lp["tokens"]
            .as_array()
            .unwrap_or_else(|| panic!("no logprobs.tokens: {v}"))
            .iter()
            .map(token_id)
            .collect();
        let logprobs: Vec<f64> = lp["token_logprobs"]
            .as_array()
            .unwrap()
            .iter()
            .map(|x| x.as_f64().unwrap())
            .collect();
        assert_eq!(tokens.len(), logprobs.len(), "{v}");
        stop = c["finish_reason"].as_str().unwrap_or_default().to_string();
        assert!(matches!(stop.as_str(), "stop" | "length" | "abort"), "{v}");
        assert!(tokens.len() as u64 <= left, "{v}");
        out.push(Segment {
            version: if out.is_empty() { version } else { version + 1 },
            context: input.clone(),
            tokens: tokens.clone(),
            logprobs,
            finish: stop.clone(),
            straddles: false,
        });
        input.extend(&tokens);
        left -= tokens.len() as u64;
    }
    assert_eq!(left, 0, "a rollout ended short: {out:?}");
    out
}

/// AReaL, three steps of asynchronous RL: rollouts in flight; the trainer's
/// `_update_weights_from_disk` (fsdp_engine.py 1600-1622):
/// `pause_generation` (remote_inf_engine.py 1205-1213: `POST
/// /areal_pause_generation {}`, vllm_remote.py 216-222) aborts them,
/// `update_weights_from_disk` posts `/areal_update_weights {"model_path"}`
/// (vllm_remote.py 129-147), `continue_generation` posts
/// `/areal_continue_generation {}`; each aborted rollout is then completed
/// by its continuation. AReaL sends every call to each of its servers'
/// addresses: here the one address is the server, or the proxy.
async fn areal_three_steps(kind: Kind) {
    let client = reqwest::Client::new();
    let ckpts = checkpoints();
    let dep = deploy(&client, kind, ckpts[0].path()).await;
    let mut segs = Vec::new();
    let mut greedy_seen = BTreeMap::new();
    let mut aborted = 0;
    for step in 0..=3 {
        let (pause_tx, pause_rx) = tokio::sync::watch::channel(false);
        let gen0 = gauge(&client, dep.sampler(), "pdkv_generation_tokens_total").await;
        let tasks: Vec<_> = (0..ROLLOUTS)
            .map(|i| {
                let (c, b, p) = (client.clone(), dep.base.clone(), pause_rx.clone());
                tokio::spawn(areal_rollout(c, b, i, step, p))
            })
            .collect();
        if step < 3 {
            wait_sampling(&client, dep.sampler(), gen0).await;
            let call = |path: &str, body: Value| {
                ok(
                    client.post(format!("{}{path}", dep.base)).json(&body),
                    "AReaL",
                )
            };
            pause_tx.send_replace(true);
            call("/areal_pause_generation", json!({})).await;
            let dir = ckpts[step + 1].path().to_str().unwrap().to_string();
            let v = call("/areal_update_weights", json!({"model_path": dir})).await;
            assert_eq!(v["success"], json!(true), "{v}");
            call("/areal_continue_generation", json!({})).await;
            pause_tx.send_replace(false);
        }
        let mut batch = Vec::new();
        for t in tasks {
            let rollout = t.await.expect("a rollout task");
            aborted += rollout.iter().filter(|s| s.finish == "abort").count();
            batch.extend(rollout);
        }
        // What the current weights sampled is recomputed before the next
        // update; what the previous ones sampled, by a fresh server below.
        let now = if step < 3 { step + 1 } else { step };
        check_logprobs(&client, &dep.base, &batch, now).await;
        segs.extend(batch);
        if step < 3 {
            greedy_seen.insert(step + 1, greedy(&client, &dep.base).await);
        }
    }
    println!("AReaL on {kind:?}: {aborted} rollouts aborted and continued");
    assert!(aborted > 0, "no rollout was in flight at a pause");
    drop(dep);
    check_with_fresh_servers(&client, &ckpts, &greedy_seen, &segs).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn frameworks_areal_three_steps_on_serve() {
    areal_three_steps(Kind::Serve).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn frameworks_areal_three_steps_on_up() {
    areal_three_steps(Kind::Up).await;
}

// ---------------------------------------------------------------- prime-rl

/// prime-rl's train sampling args (orchestrator.py 45-68 of the configs
/// package: temperature 1.0, top_p 1.0, logprobs) on `/inference/v1/generate`
/// with `skip_special_tokens: false`; `ignore_eos` through its `extra_body`
/// knob so rollouts run long enough to be in flight at the update, and a
/// seed. prime-rl also salts the prefix cache per policy version
/// (`cache_salt`, dispatcher.py 516-531, envs.py 87-91), sent here as it
/// does.
async fn prime_rollout(
    client: reqwest::Client,
    base: String,
    model: String,
    i: usize,
    version: usize,
) -> Segment {
    let p = prompt(i);
    let body = json!({"model": model, "token_ids": p, "cache_salt": format!("policy-{version}"), "sampling_params": {
        "temperature": 1.0, "top_p": 1.0, "max_tokens": LONG_ROLLOUT, "logprobs": 0,
        "skip_special_tokens": false, "ignore_eos": true, "seed": (version * 100 + i) as u64}});
    let v = ok(
        client
            .post(format!("{base}/inference/v1/generate"))
            .json(&body),
        "prime-rl rollout",
    )
    .await;
    let seg = generate_segment(&v, &p, version);
    assert_eq!(seg.finish, "length", "{v}");
    assert_eq!(seg.tokens.len() as u64, LONG_ROLLOUT, "{v}");
    seg
}

/// prime-rl, three steps with the policy updated in flight: rollouts run
/// while `update_weights` (client.py 274-320) pauses the engine in keep
/// mode (`_pause_engines`, 253-261), posts `/update_weights {"weight_dir"}`
/// and resumes (263-271): the frozen rollouts finish under the new weights.
/// Which of their tokens each set of weights sampled is not in the answer,
/// so their logprobs are not checked; that they straddled the update is
/// (some tokens were generated before the pause, not all). The last
/// step's rollouts, under one set of weights, are checked in full.
/// prime-rl's admin client posts to its `base_url` (client.py 128-157):
/// here the server, or the proxy, which passes each call to P and D.
async fn prime_rl_three_steps(kind: Kind) {
    let client = reqwest::Client::new();
    let ckpts = checkpoints();
    let dep = deploy(&client, kind, ckpts[0].path()).await;
    let base = dep.base.clone();
    let sampler = dep.sampler().to_string();
    let mut segs = Vec::new();
    let mut greedy_seen = BTreeMap::new();
    for step in 0..=3 {
        let gen0 = gauge(&client, &sampler, "pdkv_generation_tokens_total").await;
        let tasks: Vec<_> = (0..ROLLOUTS)
            .map(|i| {
                tokio::spawn(prime_rollout(
                    client.clone(),
                    base.clone(),
                    dep.model.clone(),
                    i,
                    step,
                ))
            })
            .collect();
        if step < 3 {
            wait_sampling(&client, &sampler, gen0).await;
            let admin = |path: &str| client.post(format!("{base}{path}"));
            ok(
                admin("/pause?mode=keep&clear_cache=false"),
                "prime-rl pause",
            )
            .await;
            let frozen = gauge(&client, &sampler, "pdkv_generation_tokens_total").await - gen0;
            let all = (ROLLOUTS as u64 * LONG_ROLLOUT) as f64;
            assert!(
                frozen > 0.0 && frozen < all,
                "{frozen} of {all} tokens generated when the pause answered: no rollout straddles the update"
            );
            let dir = ckpts[step + 1].path().to_str().unwrap().to_string();
            ok(
                admin("/update_weights").json(&json!({"weight_dir": dir})),
                "prime-rl update_weights",
            )
            .await;
            ok(admin("/resume"), "prime-rl resume").await;
        }
        let mut batch = Vec::new();
        for t in tasks {
            let mut seg = t.await.expect("a rollout task");
            seg.straddles = step < 3;
            batch.push(seg);
        }
        if step < 3 {
            greedy_seen.insert(step + 1, greedy(&client, &base).await);
        } else {
            check_logprobs(&client, &base, &batch, step).await;
        }
        segs.extend(batch);
    }
    drop(dep);
    check_with_fresh_servers(&client, &ckpts, &greedy_seen, &segs).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn frameworks_prime_rl_three_steps_on_serve() {
    prime_rl_three_steps(Kind::Serve).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn frameworks_prime_rl_three_steps_on_up() {
    prime_rl_three_steps(Kind::Up).await;
}
