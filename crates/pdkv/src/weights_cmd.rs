//! `pdkv weights publish`: a checkpoint's weights published for a sync
//! (the trainer's side, for tests and benches), and `pdkv bench sync`: the
//! time of a sync beside a raw loopback socket copy of the same bytes and a
//! reload of the same checkpoint from disk, measured in one run.

use std::path::PathBuf;
use std::time::{Duration, Instant};

use anyhow::Context;
use clap::Args;
use pdkv_sync::{PublishOptions, Publisher, Puller, Transport};
use pdkv_vmem::Pool;

#[derive(Args)]
pub struct PublishArgs {
    /// A `.gguf` file or Hugging Face directory (default: the cached SmolLM2).
    pub checkpoint: Option<PathBuf>,
    /// The manifest's HTTP address (the URL engines get in `init_info.url`).
    #[arg(long, default_value = "127.0.0.1:0")]
    pub http: String,
    /// The transfer agent's address.
    #[arg(long, default_value = "127.0.0.1:0")]
    pub transfer: String,
    /// The version the weights are published as.
    #[arg(long)]
    pub version: Option<String>,
    /// The deployment's KV secret (the engines' `--kv-secret`).
    #[arg(long, env = "PDKV_KV_SECRET", hide_env_values = true)]
    pub kv_secret: Option<String>,
    /// `engine`: the checkpoint loaded and published as an engine stores
    /// it; `hf`: a Hugging Face directory's tensors published as they are
    /// (names, f32/f16/bf16), as a trainer holds them, for each engine to
    /// convert while it pulls.
    #[arg(long, default_value = "engine")]
    pub format: String,
}

fn checkpoint(given: Option<PathBuf>) -> anyhow::Result<PathBuf> {
    match given {
        Some(p) => Ok(p),
        None => crate::fetch::default_model_path(),
    }
}

/// What `pdkv weights publish` announces.
enum Published {
    /// As an engine stores the weights.
    Engine(pdkv_model::weights::Weights),
    /// As a trainer holds them.
    Trainer(Vec<pdkv_sync::TrainerTensor>),
}

pub fn run_publish(args: PublishArgs) -> anyhow::Result<()> {
    let path = checkpoint(args.checkpoint)?;
    let pool = Pool::default();
    let t0 = Instant::now();
    let published = match args.format.as_str() {
        "engine" => {
            let m = pdkv_model::load_model(&path, &pool, &mut |_| {})
                .with_context(|| format!("loading {}", path.display()))?;
            Published::Engine(m.model.weights().clone())
        }
        "hf" => Published::Trainer(pdkv_sync::TrainerTensor::read_hf_dir(&path)?),
        f => anyhow::bail!("--format {f}: give engine or hf"),
    };
    tracing::info!(secs = t0.elapsed().as_secs_f64(), path = %path.display(), "weights loaded");
    let opts = PublishOptions {
        http_addr: args.http,
        transfer_addr: args.transfer,
        secret: crate::serve::kv_secret(args.kv_secret.as_deref())?,
        ..PublishOptions::default()
    };
    let rt = tokio::runtime::Runtime::new()?;
    rt.block_on(async move {
        let p = match published {
            Published::Engine(weights) => Publisher::start(weights, args.version, opts).await?,
            Published::Trainer(tensors) => {
                Publisher::start_tensors(tensors, args.version, opts).await?
            }
        };
        // The line scripts wait for.
        println!(
            "publishing {} tensors ({} bytes) at {}",
            p.manifest().tensors.len(),
            p.manifest().bytes(),
            p.url()
        );
        // Ctrl-C or SIGTERM: the publisher drops, its shared-memory
        // socket file with it.
        crate::common::wait_for_signal().await;
        tracing::info!(bytes_served = p.bytes_served(), "stopping");
        drop(p);
        Ok(())
    })
}

#[derive(Args)]
pub struct SyncBenchArgs {
    /// A `.gguf` file or Hugging Face directory (default: the cached SmolLM2).
    #[arg(long)]
    pub model: Option<PathBuf>,
    /// Syncs measured per transport (the best is reported, and every one printed).
    #[arg(long, default_value_t = 5)]
    pub rounds: usize,
    /// Connections the puller opens to the publisher (TCP).
    #[arg(long, default_value_t = 4)]
    pub conns: usize,
    /// `tcp`, `shm`, or `both`.
    #[arg(long, default_value = "both")]
    pub transport: String,
    /// What the publisher announces: `engine` (tensors as the engine stores
    /// them, copied as they are) or `hf` (the model's Hugging Face export,
    /// bf16 tensors as a trainer holds them, converted by the engine while
    /// it pulls).
    #[arg(long, default_value = "engine")]
    pub format: String,
}

/// A plain copy of `bytes` between two warm buffers on one thread: the
/// shared-memory baseline (as `pdkv bench transfer` measures it); GB/s.
fn memcpy_gbps(bytes: usize) -> f64 {
    let src: Vec<u8> = (0..bytes)
        .map(|i| (i as u32).wrapping_mul(2654435761) as u8)
        .collect();
    let mut dst = vec![1u8; bytes];
    dst.copy_from_slice(&src); // warm
    let t0 = Instant::now();
    dst.copy_from_slice(&src);
    std::hint::black_box(&dst);
    bytes as f64 / t0.elapsed().as_secs_f64() / 1e9
}

/// The transports `--transport` names (`tcp`, `shm` or `both`).
fn sync_transports(arg: &str) -> anyhow::Result<Vec<Transport>> {
    Ok(match arg {
        "both" => vec![Transport::Tcp, Transport::Shm],
        t => vec![Transport::parse(t)
            .filter(|t| *t != Transport::Auto)
            .with_context(|| format!("--transport {t}: give tcp, shm or both"))?],
    })
}

/// One transport's rounds: sync GB/s and its baseline's GB/s, and (TCP)
/// raw TCP between cache-resident buffers, round by round.
struct TransportRounds {
    t: Transport,
    sync: Vec<f64>,
    base: Vec<f64>,
    hot: Vec<f64>,
    /// Seconds of each round spent converting (0 when copied as stored).
    convert: Vec<f64>,
}

pub fn run_sync_bench(args: SyncBenchArgs) -> anyhow::Result<()> {
    let transports = sync_transports(&args.transport)?;
    let hf = match args.format.as_str() {
        "engine" => false,
        "hf" => true,
        f => anyhow::bail!("--format {f}: give engine or hf"),
    };
    let path = checkpoint(args.model.clone())?;
    let (running_pool, published_pool) = (Pool::default(), Pool::default());
    let running = pdkv_model::load_model(&path, &running_pool, &mut |_| {})?;
    let published = pdkv_model::load_model(&path, &published_pool, &mut |_| {})?;
    // In the trainer's format: the model's Hugging Face export (bf16), as
    // a trainer would hold it; the disk baseline reloads that export.
    let export = tempfile::tempdir()?;
    let (trainer, disk_path) = if hf {
        pdkv_model::export::export_hf(&published, export.path(), &mut |_| {})?;
        let tensors = pdkv_sync::TrainerTensor::read_hf_dir(export.path())?;
        (Some(tensors), export.path().to_path_buf())
    } else {
        (None, path.clone())
    };
    drop(published_pool);
    let rt = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()?;
    let rounds = args.rounds.max(1);
    let opts = PublishOptions {
        conns_per_peer: args.conns,
        ..PublishOptions::default()
    };
    let (results, bytes) = rt.block_on(async {
        let p = match trainer {
            Some(tensors) => Publisher::start_tensors(tensors, None, opts).await?,
            None => Publisher::start(published.model.weights().clone(), None, opts).await?,
        };
        sync_rounds(&args, &transports, rounds, &running.model, &p).await
    })?;
    let disk = disk_reloads(&running.model, &disk_path, rounds.min(3))?;
    print_sync_report(&results, bytes, &disk, args.conns, &args.format);
    Ok(())
}

/// Publishes `published`'s weights and syncs them into `running`'s layout
/// `rounds` times per transport, each round beside its baseline; the
/// rounds and the bytes of one sync.
async fn sync_rounds(
    args: &SyncBenchArgs,
    transports: &[Transport],
    rounds: usize,
    running: &pdkv_model::Model,
    p: &Publisher,
) -> anyhow::Result<(Vec<TransportRounds>, u64)> {
    let bytes = p.manifest().bytes();
    let mut results = Vec::new();
    for &t in transports {
        let puller = Puller::new(pdkv_transfer::auth::KvSecret::open(), args.conns)
            .await?
            .with_transport(t);
        let mut r = TransportRounds {
            t,
            sync: Vec::new(),
            base: Vec::new(),
            hot: Vec::new(),
            convert: Vec::new(),
        };
        // Interleaved with the baseline, so both see the same machine.
        for round in 0..rounds {
            sync_round(p, &puller, running, args.conns, bytes, round, &mut r).await?;
        }
        results.push(r);
    }
    Ok((results, bytes))
}

/// One sync over `r.t` and its baselines, pushed onto `r`, with a line on
/// stderr.
async fn sync_round(
    p: &Publisher,
    puller: &Puller,
    running: &pdkv_model::Model,
    conns: usize,
    bytes: u64,
    round: usize,
    r: &mut TransportRounds,
) -> anyhow::Result<()> {
    let t = r.t;
    let t0 = Instant::now();
    let m = puller.manifest(&p.url()).await?;
    let fetched = t0.elapsed().as_secs_f64();
    let mut st = puller.stage(m, running.weights()).await?;
    let staged = t0.elapsed().as_secs_f64();
    let rep = puller.pull(&mut st, None, Duration::from_secs(300)).await?;
    st.complete()?;
    drop(st);
    let secs = t0.elapsed().as_secs_f64();
    r.sync.push(bytes as f64 / secs / 1e9);
    r.convert.push(rep.convert_seconds);
    r.base.push(match t {
        Transport::Shm => memcpy_gbps(bytes as usize),
        _ => crate::bench_transfer::raw_tcp_whole(conns, bytes as usize).await?,
    });
    if t == Transport::Tcp {
        r.hot
            .push(crate::bench_transfer::raw_tcp(conns, bytes as usize).await?);
    }
    eprintln!(
        "{} round {round}: sync {:.2} GB/s ({:.0} ms: manifest {:.0}, staging {:.0}, pull {:.0} + checksums {:.0} + conversion {:.0}), {} {:.2} GB/s{}",
        t.name(),
        r.sync[round],
        secs * 1e3,
        fetched * 1e3,
        (staged - fetched) * 1e3,
        rep.read_seconds * 1e3,
        (rep.seconds - rep.read_seconds - rep.convert_seconds) * 1e3,
        rep.convert_seconds * 1e3,
        baseline_name(t),
        r.base[round],
        r.hot
            .get(round)
            .map(|h| format!(", raw TCP between cache-resident 1 MiB buffers {h:.2} GB/s"))
            .unwrap_or_default()
    );
    Ok(())
}

/// Seconds of `n` reloads of the same checkpoint from disk (page cache warm).
fn disk_reloads(
    running: &pdkv_model::Model,
    path: &std::path::Path,
    n: usize,
) -> anyhow::Result<Vec<f64>> {
    let mut disk = Vec::new();
    for _ in 0..n {
        let t0 = Instant::now();
        pdkv_model::loader::reload_weights_into(
            running.weights(),
            running.config(),
            path,
            &mut |_| {},
        )
        .map_err(|e| anyhow::anyhow!("{e}"))?;
        disk.push(t0.elapsed().as_secs_f64());
    }
    Ok(disk)
}

/// A line per transport (best rounds against their baselines and the
/// fastest disk reload), then the JSON line.
fn print_sync_report(
    results: &[TransportRounds],
    bytes: u64,
    disk: &[f64],
    conns: usize,
    format: &str,
) {
    let best = |v: &[f64]| v.iter().cloned().fold(f64::MIN, f64::max);
    let fastest = |v: &[f64]| v.iter().cloned().fold(f64::MAX, f64::min);
    let d = fastest(disk);
    let mut json = serde_json::Map::new();
    for TransportRounds {
        t,
        sync,
        base,
        hot,
        convert,
    } in results
    {
        let (s, b) = (best(sync), best(base));
        let sync_secs = bytes as f64 / s / 1e9;
        println!(
            "{} bytes ({format}) over {}: sync {:.2} GB/s ({:.0} ms, of which conversion {:.0} ms), {} {:.2} GB/s: ratio {:.2}; reload from disk {:.0} ms ({:.1}x the sync's time)",
            bytes,
            t.name(),
            s,
            sync_secs * 1e3,
            fastest(convert) * 1e3,
            baseline_name(*t),
            b,
            s / b,
            d * 1e3,
            d / sync_secs
        );
        if !hot.is_empty() {
            println!(
                "  raw TCP between cache-resident 1 MiB buffers (the `pdkv bench transfer` baseline) {:.2} GB/s: ratio {:.2}",
                best(hot),
                s / best(hot)
            );
        }
        json.insert(
            t.name().into(),
            serde_json::json!({
                "sync_gb_s": sync, "baseline": baseline_name(*t), "baseline_gb_s": base,
                "ratio": s / b, "disk_vs_sync_time": d / sync_secs,
                "raw_tcp_cache_resident_gb_s": hot, "convert_s": convert,
            }),
        );
    }
    println!(
        "{}",
        serde_json::json!({
            "bench": "sync", "format": format, "bytes": bytes, "conns": conns,
            "disk_reload_s": disk, "transports": json,
        })
    );
}

fn baseline_name(t: Transport) -> &'static str {
    match t {
        Transport::Shm => "memcpy",
        _ => "raw loopback TCP of the same bytes between whole buffers",
    }
}
