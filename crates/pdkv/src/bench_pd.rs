//! `pdkv bench pd`: time to first token and throughput of one prefill and
//! one decode engine (1P1D, KV moved by the `pdkv` connector) against one
//! colocated engine, on the same machine and model, per prompt length and
//! concurrency.
//!
//! The engines run in this process and are driven through their handles
//! exactly as the HTTP layer drives them (the proxy adds one HTTP hop on
//! each side, not measured here). Each request goes to P (`max_tokens` 1,
//! `do_remote_decode`) and D (`do_remote_prefill` with P's bootstrap
//! address) at the same time, as the proxy sends it. Prompts are distinct
//! random token ids (no prefix-cache hits); outputs are greedy with EOS
//! ignored, so every request generates `max_tokens` tokens, and the P/D
//! tokens are checked against the colocated ones (they must be equal).
//!
//! Measured per request: TTFT (add → first token), and for P/D the part of
//! it after P finished prefilling (P's answer → D's first token: the pull,
//! the write of the KV and D's one-token step), reported as the KV-transfer
//! share of TTFT. The colocated engine runs alone, then P and D together, so
//! the two never compete for the cores with each other's runs. Results: a
//! table, and a JSON line last on stdout.

use std::collections::HashMap;
use std::path::PathBuf;
use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use clap::Args;
use pdkv_connector::params;
use pdkv_engine::{
    Engine, EngineConfig, EngineHandle, EngineRequest, FinishReason, SamplingParams,
};
use pdkv_vmem::Pool;
use serde_json::json;

use crate::progress;

/// Longest a request may take before the bench gives up on it.
const REQUEST_DEADLINE: Duration = Duration::from_secs(900);

#[derive(Args, Debug)]
pub struct PdArgs {
    /// A `.gguf` file or Hugging Face directory (default: the cached SmolLM2).
    #[arg(long)]
    pub model: Option<PathBuf>,
    /// Prompt lengths in tokens.
    #[arg(long, value_delimiter = ',', default_values_t = [512usize, 2048])]
    pub prompt_lens: Vec<usize>,
    /// Concurrent requests; each level sends this many requests at once.
    #[arg(long, value_delimiter = ',', default_values_t = [1usize, 8, 32])]
    pub concurrency: Vec<usize>,
    /// Tokens generated per request.
    #[arg(long, default_value_t = 16)]
    pub max_tokens: u32,
    /// `tcp` or `shm`.
    #[arg(long, default_value = "tcp")]
    pub transport: String,
    /// KV cache blocks per engine (16 tokens each).
    #[arg(long, default_value_t = 2304)]
    pub num_kv_blocks: usize,
    /// Every engine's KV cache element type (see `pdkv serve
    /// --kv-cache-dtype`).
    #[arg(long, default_value = "auto")]
    pub kv_cache_dtype: pdkv_model::KvDtype,
    /// Most tokens computed in one engine step.
    #[arg(long, default_value_t = 512)]
    pub max_num_batched_tokens: usize,
    /// Sleep/wake rounds for the first-request-after-wake comparison (0: skip).
    #[arg(long, default_value_t = 5)]
    pub wake_rounds: usize,
    /// Only the first-request-after-wake comparison (P and D alone, no
    /// colocated engine, no table).
    #[arg(long)]
    pub wake_only: bool,
    /// Ranks P splits the model over (tensor parallelism; the colocated
    /// engine always runs whole, so the outputs check P/D across splits).
    #[arg(long, default_value_t = 1)]
    pub prefill_tensor_parallel_size: usize,
    /// Ranks D splits the model over.
    #[arg(long, default_value_t = 1)]
    pub decode_tensor_parallel_size: usize,
}

/// One (setup, prompt length, concurrency) measurement.
struct Level {
    ttft_ms: Vec<f64>,
    /// P/D only: P's answer → D's first token.
    after_prefill_ms: Vec<f64>,
    wall: Duration,
    generated: usize,
    prompt_tokens: usize,
    outputs: Vec<Vec<u32>>,
}

fn mean(v: &[f64]) -> f64 {
    if v.is_empty() {
        f64::NAN
    } else {
        v.iter().sum::<f64>() / v.len() as f64
    }
}

fn percentile(v: &[f64], p: f64) -> f64 {
    if v.is_empty() {
        return f64::NAN;
    }
    let mut s = v.to_vec();
    s.sort_by(f64::total_cmp);
    s[((s.len() - 1) as f64 * p).round() as usize]
}

/// Distinct pseudo-random prompts (splitmix64), ids in `[100, vocab)`.
fn prompts(n: usize, len: usize, vocab: usize, salt: u64) -> Vec<Vec<u32>> {
    let mut x = 0x9e37_79b9_7f4a_7c15u64 ^ salt.wrapping_mul(0xbf58_476d_1ce4_e5b9);
    let mut next = move || {
        x = x.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = x;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    };
    let span = (vocab - 100) as u64;
    (0..n)
        .map(|_| (0..len).map(|_| 100 + (next() % span) as u32).collect())
        .collect()
}

fn params(max_tokens: u32) -> SamplingParams {
    SamplingParams {
        temperature: 0.0,
        max_tokens,
        ignore_eos: true,
        ..SamplingParams::default()
    }
}

fn start_engine(
    args: &PdArgs,
    connector: Option<Box<dyn pdkv_engine::KvConnector>>,
    tensor_parallel_size: usize,
) -> anyhow::Result<EngineHandle> {
    let pool = Pool::default();
    let (_, model) = progress::load_model(args.model.clone(), &pool)?;
    let config = EngineConfig {
        max_num_seqs: 64,
        max_num_batched_tokens: args.max_num_batched_tokens,
        num_kv_blocks: args.num_kv_blocks,
        kv_cache_dtype: args.kv_cache_dtype,
        enable_prefix_caching: true,
        max_model_len: None,
        enable_sleep_mode: connector.as_ref().is_some_and(|c| c.supports_sleep_mode()),
        tensor_parallel_size,
        ..EngineConfig::default()
    };
    Engine::start_with_connector(model, pool, config, connector)
}

/// Runs `prompts` on a colocated engine, all at once.
fn run_colocated(
    engine: &EngineHandle,
    prompts: &[Vec<u32>],
    max_tokens: u32,
    tag: &str,
) -> anyhow::Result<Level> {
    let t0 = Instant::now();
    let handles: Vec<_> = prompts
        .iter()
        .enumerate()
        .map(|(i, p)| {
            let req = EngineRequest::new(format!("{tag}-{i}"), p.clone(), params(max_tokens));
            let mut stream = engine.add_request(req)?;
            Ok(std::thread::spawn(move || collect(&mut stream, t0)))
        })
        .collect::<anyhow::Result<_>>()?;
    let mut level = Level::empty(prompts);
    for h in handles {
        let (ttft, toks) = h
            .join()
            .map_err(|_| anyhow::anyhow!("a request thread panicked"))??;
        level.ttft_ms.push(ttft.as_secs_f64() * 1e3);
        level.generated += toks.len();
        level.outputs.push(toks);
    }
    level.wall = t0.elapsed();
    Ok(level)
}

/// Reads a request to its end: (time to first token from `t0`, tokens).
pub(crate) fn collect(
    stream: &mut pdkv_engine::RequestStream,
    t0: Instant,
) -> anyhow::Result<(Duration, Vec<u32>)> {
    let mut first = None;
    let mut toks = Vec::new();
    let deadline = Instant::now() + REQUEST_DEADLINE;
    while let Some(out) = stream.blocking_next() {
        if first.is_none() && !out.token_ids.is_empty() {
            first = Some(t0.elapsed());
        }
        toks.extend(&out.token_ids);
        match out.finish_reason {
            Some(FinishReason::Length | FinishReason::Stop) => break,
            Some(r) => bail!(
                "request {} ended with {}: {}",
                out.request_id,
                r.as_str(),
                out.error.unwrap_or_default()
            ),
            None => {}
        }
        if Instant::now() > deadline {
            bail!("request {} ran past {REQUEST_DEADLINE:?}", out.request_id);
        }
    }
    Ok((first.context("the request produced no token")?, toks))
}

impl Level {
    fn empty(prompts: &[Vec<u32>]) -> Level {
        Level {
            ttft_ms: Vec::new(),
            after_prefill_ms: Vec::new(),
            wall: Duration::ZERO,
            generated: 0,
            prompt_tokens: prompts.iter().map(Vec::len).sum(),
            outputs: Vec::new(),
        }
    }
}

/// Runs `prompts` through P and D, each request sent to both at once.
fn run_pd(
    p: &EngineHandle,
    d: &EngineHandle,
    prompts: &[Vec<u32>],
    max_tokens: u32,
    tag: &str,
) -> anyhow::Result<Level> {
    let info = p
        .kv_connector_info()
        .context("the prefill engine has no connector")?;
    let engine_id = info["engine_id"].as_str().map(str::to_string);
    let bootstrap = info["bootstrap_addr"].as_str().map(str::to_string);
    let t0 = Instant::now();
    let mut handles = Vec::new();
    for (i, prompt) in prompts.iter().enumerate() {
        let transfer_id = format!("{tag}-{i}");
        let mut p_stream = p.add_request(
            EngineRequest::new(format!("{tag}-p-{i}"), prompt.clone(), params(1))
                .with_kv_transfer_params(Some(params::for_prefill(&transfer_id))),
        )?;
        let mut d_stream = d.add_request(
            EngineRequest::new(format!("{tag}-d-{i}"), prompt.clone(), params(max_tokens))
                .with_kv_transfer_params(Some(params::for_decode(
                    &transfer_id,
                    engine_id.as_deref(),
                    bootstrap.as_deref(),
                ))),
        )?;
        let p_done = std::thread::spawn(move || -> anyhow::Result<Duration> {
            collect(&mut p_stream, t0)?;
            Ok(t0.elapsed())
        });
        let d_done = std::thread::spawn(move || collect(&mut d_stream, t0));
        handles.push((p_done, d_done));
    }
    let mut level = Level::empty(prompts);
    for (p_done, d_done) in handles {
        let p_at = p_done
            .join()
            .map_err(|_| anyhow::anyhow!("a request thread panicked"))??;
        let (ttft, toks) = d_done
            .join()
            .map_err(|_| anyhow::anyhow!("a request thread panicked"))??;
        level.ttft_ms.push(ttft.as_secs_f64() * 1e3);
        level
            .after_prefill_ms
            .push((ttft.saturating_sub(p_at)).as_secs_f64() * 1e3);
        level.generated += toks.len();
        level.outputs.push(toks);
    }
    level.wall = t0.elapsed();
    Ok(level)
}

/// Steady-state requests measured after each round's first request.
const STEADY_PER_ROUND: usize = 3;

/// One P/D request's timing: TTFT and the part of it before P answered.
#[derive(Clone, Copy)]
struct Timing {
    ttft_ms: f64,
    p_ms: f64,
}

/// The first P/D request after both engines slept (level 1) and woke,
/// against steady-state requests of the same length, over several rounds.
struct AfterWake {
    first: Vec<Timing>,
    steady: Vec<Timing>,
    /// How long each engine's wake took (ms), P then D, every round.
    wake_ms: Vec<f64>,
}

fn median(v: impl Iterator<Item = f64>) -> f64 {
    percentile(&v.collect::<Vec<_>>(), 0.5)
}

impl AfterWake {
    fn first_ms(&self) -> f64 {
        median(self.first.iter().map(|t| t.ttft_ms))
    }
    fn steady_ms(&self) -> f64 {
        median(self.steady.iter().map(|t| t.ttft_ms))
    }
    fn ratio(&self) -> f64 {
        self.first_ms() / self.steady_ms()
    }
    fn summary(&self) -> String {
        format!(
            "first request after P and D slept (level 1) and woke: ttft {:.1} ms (median of {} rounds) vs steady {:.1} ms (median of {}): ratio {:.2}; wake {:.0} ms (median per engine)",
            self.first_ms(),
            self.first.len(),
            self.steady_ms(),
            self.steady.len(),
            self.ratio(),
            median(self.wake_ms.iter().copied())
        )
    }
    fn json(&self) -> serde_json::Value {
        let part = |v: &[Timing]| {
            json!({
                "ttft_ms_median": median(v.iter().map(|t| t.ttft_ms)),
                "p_answered_ms_median": median(v.iter().map(|t| t.p_ms)),
                "after_p_ms_median": median(v.iter().map(|t| t.ttft_ms - t.p_ms)),
                "ttft_ms": v.iter().map(|t| t.ttft_ms).collect::<Vec<_>>(),
            })
        };
        json!({
            "rounds": self.first.len(),
            "first": part(&self.first),
            "steady": part(&self.steady),
            "ratio": self.ratio(),
            "wake_ms_median": median(self.wake_ms.iter().copied()),
        })
    }
}

/// Runs one P/D request alone and returns its timing.
fn timed_pd(
    p: &EngineHandle,
    d: &EngineHandle,
    prompt: &[u32],
    tag: &str,
) -> anyhow::Result<Timing> {
    let r = run_pd(p, d, &[prompt.to_vec()], 1, tag)?;
    Ok(Timing {
        ttft_ms: r.ttft_ms[0],
        p_ms: r.ttft_ms[0] - r.after_prefill_ms[0],
    })
}

/// `rounds` times: both engines sleep (level 1) and wake, then one request
/// (the first after the wake) and `STEADY_PER_ROUND` more (steady state),
/// each alone, prompts distinct. Skipped (None) when the connector cannot
/// sleep or no round is asked for.
fn first_request_after_wake(
    args: &PdArgs,
    p: &EngineHandle,
    d: &EngineHandle,
    vocab: usize,
) -> anyhow::Result<Option<AfterWake>> {
    if !(p.config().enable_sleep_mode && d.config().enable_sleep_mode) || args.wake_rounds == 0 {
        return Ok(None);
    }
    let len = args.prompt_lens[0];
    let per_round = 1 + STEADY_PER_ROUND;
    let ps = prompts(args.wake_rounds * per_round, len, vocab, 99);
    let mut out = AfterWake {
        first: Vec::new(),
        steady: Vec::new(),
        wake_ms: Vec::new(),
    };
    for round in 0..args.wake_rounds {
        for e in [p, d] {
            wait_quiet(e, "P/D")?;
            e.sleep(
                pdkv_engine::SleepLevel::L1,
                pdkv_engine::PauseMode::Abort,
                Duration::from_secs(60),
            )
            .map_err(|e| anyhow::anyhow!("sleep: {e}"))?;
        }
        for e in [p, d] {
            let t = Instant::now();
            e.wake_up(None).map_err(|e| anyhow::anyhow!("wake: {e}"))?;
            out.wake_ms.push(t.elapsed().as_secs_f64() * 1e3);
        }
        let mine = &ps[round * per_round..(round + 1) * per_round];
        let first = timed_pd(p, d, &mine[0], &format!("wake{round}-first"))?;
        eprintln!(
            "  wake round {round}: first request ttft {:.1} ms (P answered at {:.1} ms)",
            first.ttft_ms, first.p_ms
        );
        out.first.push(first);
        for (i, pr) in mine[1..].iter().enumerate() {
            let t = timed_pd(p, d, pr, &format!("wake{round}-steady{i}"))?;
            eprintln!(
                "  wake round {round}: steady request ttft {:.1} ms (P answered at {:.1} ms)",
                t.ttft_ms, t.p_ms
            );
            out.steady.push(t);
        }
    }
    Ok(Some(out))
}

/// Starts P and D with `pdkv` connectors and warms them with one short request.
fn start_pd(args: &PdArgs) -> anyhow::Result<(EngineHandle, EngineHandle)> {
    // At 32 concurrent 2048-token prompts P's queue holds requests for
    // minutes: pulls and D's wait must outlast it.
    let cfg = |role: &str| {
        format!(
            r#"{{"kv_connector":"pdkv","kv_role":"{role}","transport":"{}","abort_timeout_s":900,"load_timeout_s":960}}"#,
            args.transport
        )
    };
    let p = start_engine(
        args,
        Some(pdkv_connector::build(&cfg("kv_producer"), "bench-p")?),
        args.prefill_tensor_parallel_size,
    )?;
    let d = start_engine(
        args,
        Some(pdkv_connector::build(&cfg("kv_consumer"), "bench-d")?),
        args.decode_tensor_parallel_size,
    )?;
    run_pd(
        &p,
        &d,
        &prompts(1, 64, p.model_config().vocab_size, 7),
        2,
        "warm",
    )?;
    Ok((p, d))
}

/// `--wake-only`: P and D alone, the after-wake comparison and nothing else.
fn run_wake_only(args: &PdArgs) -> anyhow::Result<()> {
    anyhow::ensure!(
        args.wake_rounds >= 1,
        "--wake-only needs --wake-rounds of at least 1"
    );
    eprintln!(
        "bench pd: prefill + decode engines ({}), after-wake comparison only",
        args.transport
    );
    let (p, d) = start_pd(args)?;
    let vocab = p.model_config().vocab_size;
    let w = first_request_after_wake(args, &p, &d, vocab)?.context("the engines cannot sleep")?;
    p.shutdown();
    d.shutdown();
    println!("{}", w.summary());
    println!(
        "{}",
        json!({"bench": "pd", "transport": args.transport, "after_wake": w.json()})
    );
    Ok(())
}

/// Waits until an engine has no request and no held block.
fn wait_quiet(e: &EngineHandle, what: &str) -> anyhow::Result<()> {
    e.wait_stats(Duration::from_secs(60), |s| {
        s.num_running == 0 && s.num_waiting == 0 && s.kv_blocks_free == s.kv_blocks_total
    })
    .with_context(|| format!("the {what} engine did not return to idle with all blocks free"))?;
    Ok(())
}

/// A (prompt length, concurrency) level.
type LevelKey = (usize, usize);

pub fn run_pd_bench(args: PdArgs) -> anyhow::Result<()> {
    anyhow::ensure!(
        !args.prompt_lens.is_empty() && !args.concurrency.is_empty(),
        "nothing to measure"
    );
    anyhow::ensure!(args.max_tokens >= 1, "--max-tokens must be at least 1");
    if args.wake_only {
        return run_wake_only(&args);
    }
    let levels: Vec<LevelKey> = args
        .prompt_lens
        .iter()
        .flat_map(|&l| args.concurrency.iter().map(move |&c| (l, c)))
        .collect();
    // Colocated first, alone.
    let colo = measure_colocated(&args, &levels)?;
    eprintln!("bench pd: prefill + decode engines ({})", args.transport);
    let (p, d) = start_pd(&args)?;
    let sent_before = bytes_sent(&p);
    let pd_results = measure_pd(&args, &levels, &colo.inputs, &p, &d)?;
    let prompt_tokens: usize = levels
        .iter()
        .flat_map(|k| colo.inputs[k].iter().map(Vec::len))
        .sum();
    let moved = KvMoved {
        bytes: bytes_sent(&p) - sent_before,
        prompt_tokens,
        dtype: args.kv_cache_dtype,
    };
    let after_wake = first_request_after_wake(&args, &p, &d, colo.vocab)?;
    p.shutdown();
    d.shutdown();
    let all_equal = print_pd_report(
        &args,
        &levels,
        &colo.results,
        &pd_results,
        after_wake,
        &moved,
    );
    if !all_equal {
        bail!("P/D outputs differ from the colocated engine's");
    }
    Ok(())
}

/// KV bytes P sent in its pulls so far (its connector's counter).
fn bytes_sent(p: &EngineHandle) -> f64 {
    p.kv_connector_metrics()
        .iter()
        .find(|m| m.0 == "bytes_sent_total")
        .map_or(0.0, |m| m.2)
}

/// The KV bytes the P/D levels moved, per prompt token.
struct KvMoved {
    bytes: f64,
    prompt_tokens: usize,
    dtype: pdkv_model::KvDtype,
}

impl KvMoved {
    fn json(&self) -> serde_json::Value {
        json!({"bytes": self.bytes, "prompt_tokens": self.prompt_tokens,
               "bytes_per_token": self.bytes / self.prompt_tokens.max(1) as f64,
               "kv_cache_dtype": self.dtype.to_string()})
    }

    fn summary(&self) -> String {
        format!(
            "KV moved: {:.1} MiB for {} prompt tokens, {:.0} bytes per token ({} KV cache)",
            self.bytes / (1u64 << 20) as f64,
            self.prompt_tokens,
            self.bytes / self.prompt_tokens.max(1) as f64,
            self.dtype
        )
    }
}

/// What the colocated engine's run leaves for the P/D run.
struct Colocated {
    /// The prompts of each level (P/D gets the same).
    inputs: HashMap<LevelKey, Vec<Vec<u32>>>,
    results: HashMap<LevelKey, Level>,
    vocab: usize,
}

/// Every level on a colocated engine (started, warmed and shut down here).
fn measure_colocated(args: &PdArgs, levels: &[LevelKey]) -> anyhow::Result<Colocated> {
    eprintln!("bench pd: colocated engine");
    let colo = start_engine(args, None, 1)?;
    let vocab = colo.model_config().vocab_size;
    let mut inputs = HashMap::new();
    for &(len, conc) in levels {
        inputs.insert(
            (len, conc),
            prompts(conc, len, vocab, (len * 1000 + conc) as u64),
        );
    }
    // Warm-up: one short request (first-touch of pages, thread pools).
    run_colocated(&colo, &prompts(1, 64, vocab, 7), 2, "warm")?;
    let mut colo_results = HashMap::new();
    for &(len, conc) in levels {
        let r = run_colocated(
            &colo,
            &inputs[&(len, conc)],
            args.max_tokens,
            &format!("c{len}x{conc}"),
        )?;
        eprintln!(
            "  prompt {len:>5} x{conc:<3} ttft mean {:>8.1} ms  wall {:>6.2} s",
            mean(&r.ttft_ms),
            r.wall.as_secs_f64()
        );
        wait_quiet(&colo, "colocated")?;
        colo_results.insert((len, conc), r);
    }
    colo.shutdown();
    drop(colo);
    Ok(Colocated {
        inputs,
        results: colo_results,
        vocab,
    })
}

/// Every level through P and D.
fn measure_pd(
    args: &PdArgs,
    levels: &[LevelKey],
    inputs: &HashMap<LevelKey, Vec<Vec<u32>>>,
    p: &EngineHandle,
    d: &EngineHandle,
) -> anyhow::Result<HashMap<LevelKey, Level>> {
    let mut pd_results = HashMap::new();
    for &(len, conc) in levels {
        let r = run_pd(
            p,
            d,
            &inputs[&(len, conc)],
            args.max_tokens,
            &format!("pd{len}x{conc}"),
        )?;
        eprintln!(
            "  prompt {len:>5} x{conc:<3} ttft mean {:>8.1} ms  wall {:>6.2} s",
            mean(&r.ttft_ms),
            r.wall.as_secs_f64()
        );
        wait_quiet(p, "prefill")?;
        wait_quiet(d, "decode")?;
        pd_results.insert((len, conc), r);
    }
    Ok(pd_results)
}

/// The table and the JSON line on stdout; whether every P/D output equals
/// the colocated one.
fn print_pd_report(
    args: &PdArgs,
    levels: &[LevelKey],
    colo_results: &HashMap<LevelKey, Level>,
    pd_results: &HashMap<LevelKey, Level>,
    after_wake: Option<AfterWake>,
    moved: &KvMoved,
) -> bool {
    println!(
        "{:>6} {:>4} | {:>10} {:>10} {:>9} | {:>10} {:>10} {:>9} {:>9} | {:>7} {:>7} {:>6}",
        "prompt",
        "conc",
        "colo ttft",
        "colo p90",
        "colo t/s",
        "pd ttft",
        "pd p90",
        "pd t/s",
        "xfer ms",
        "ttft x",
        "tput x",
        "equal"
    );
    let mut rows = Vec::new();
    let mut all_equal = true;
    for &(len, conc) in levels {
        let (c, q) = (&colo_results[&(len, conc)], &pd_results[&(len, conc)]);
        let (row, equal) = level_row(len, conc, c, q);
        all_equal &= equal;
        rows.push(row);
    }
    println!(
        "outputs equal to colocated: {}",
        if all_equal { "yes" } else { "NO" }
    );
    if let Some(w) = &after_wake {
        println!("{}", w.summary());
    }
    println!("{}", moved.summary());
    let after_wake = after_wake.map(|w| w.json());
    println!(
        "{}",
        json!({"bench": "pd", "transport": args.transport, "max_tokens": args.max_tokens,
               "prefill_tensor_parallel_size": args.prefill_tensor_parallel_size,
               "decode_tensor_parallel_size": args.decode_tensor_parallel_size,
               "levels": rows, "after_wake": after_wake, "kv_moved": moved.json()})
    );
    all_equal
}

/// One level's table row (printed) and its JSON; whether its outputs are equal.
fn level_row(len: usize, conc: usize, c: &Level, q: &Level) -> (serde_json::Value, bool) {
    let c_tput = c.generated as f64 / c.wall.as_secs_f64();
    let q_tput = q.generated as f64 / q.wall.as_secs_f64();
    let equal = c.outputs == q.outputs;
    let share = mean(&q.after_prefill_ms) / mean(&q.ttft_ms);
    println!(
        "{len:>6} {conc:>4} | {:>10.1} {:>10.1} {:>9.1} | {:>10.1} {:>10.1} {:>9.1} {:>9.1} | {:>7.2} {:>7.2} {:>6}",
        mean(&c.ttft_ms),
        percentile(&c.ttft_ms, 0.9),
        c_tput,
        mean(&q.ttft_ms),
        percentile(&q.ttft_ms, 0.9),
        q_tput,
        mean(&q.after_prefill_ms),
        mean(&q.ttft_ms) / mean(&c.ttft_ms),
        q_tput / c_tput,
        equal
    );
    let row = json!({
        "prompt_len": len,
        "concurrency": conc,
        "colocated": {"ttft_ms_mean": mean(&c.ttft_ms), "ttft_ms_p90": percentile(&c.ttft_ms, 0.9),
                      "gen_tok_per_s": c_tput, "prompt_tok_per_s": c.prompt_tokens as f64 / c.wall.as_secs_f64()},
        "pd": {"ttft_ms_mean": mean(&q.ttft_ms), "ttft_ms_p90": percentile(&q.ttft_ms, 0.9),
               "gen_tok_per_s": q_tput, "prompt_tok_per_s": q.prompt_tokens as f64 / q.wall.as_secs_f64(),
               "after_prefill_ms_mean": mean(&q.after_prefill_ms), "transfer_share_of_ttft": share},
        "ttft_ratio_pd_vs_colocated": mean(&q.ttft_ms) / mean(&c.ttft_ms),
        "throughput_ratio_pd_vs_colocated": q_tput / c_tput,
        "outputs_equal": equal,
    });
    (row, equal)
}
