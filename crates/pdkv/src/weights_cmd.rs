//! `pdkv weights publish`: a checkpoint's weights published for a sync
//! (the trainer's side, for tests and benches), and `pdkv bench sync`: the
//! time of a sync beside a raw loopback socket copy of the same bytes and a
//! reload of the same checkpoint from disk, measured in one run.

use std::path::PathBuf;
use std::time::{Duration, Instant};

use anyhow::Context;
use clap::Args;
use pdkv_sync::{PublishOptions, Publisher, Puller};
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
}

fn checkpoint(given: Option<PathBuf>) -> anyhow::Result<PathBuf> {
    match given {
        Some(p) => Ok(p),
        None => crate::fetch::default_model_path(),
    }
}

pub fn run_publish(args: PublishArgs) -> anyhow::Result<()> {
    let path = checkpoint(args.checkpoint)?;
    let pool = Pool::default();
    let t0 = Instant::now();
    let m = pdkv_model::load_model(&path, &pool, &mut |_| {})
        .with_context(|| format!("loading {}", path.display()))?;
    tracing::info!(secs = t0.elapsed().as_secs_f64(), path = %path.display(), "weights loaded");
    let opts = PublishOptions {
        http_addr: args.http,
        transfer_addr: args.transfer,
        secret: crate::serve::kv_secret(args.kv_secret.as_deref())?,
        ..PublishOptions::default()
    };
    let rt = tokio::runtime::Runtime::new()?;
    rt.block_on(async move {
        let p = Publisher::start(m.model.weights().clone(), args.version, opts).await?;
        // The line scripts wait for.
        println!(
            "publishing {} tensors ({} bytes) at {}",
            p.manifest().tensors.len(),
            p.manifest().bytes(),
            p.url()
        );
        tokio::signal::ctrl_c().await?;
        tracing::info!(bytes_served = p.bytes_served(), "stopping");
        Ok(())
    })
}

#[derive(Args)]
pub struct SyncBenchArgs {
    /// A `.gguf` file or Hugging Face directory (default: the cached SmolLM2).
    #[arg(long)]
    pub model: Option<PathBuf>,
    /// Syncs measured (the best is reported, and every one printed).
    #[arg(long, default_value_t = 5)]
    pub rounds: usize,
    /// Connections the puller opens to the publisher.
    #[arg(long, default_value_t = 4)]
    pub conns: usize,
}

pub fn run_sync_bench(args: SyncBenchArgs) -> anyhow::Result<()> {
    let path = checkpoint(args.model)?;
    let (running_pool, published_pool) = (Pool::default(), Pool::default());
    let running = pdkv_model::load_model(&path, &running_pool, &mut |_| {})?;
    let published = pdkv_model::load_model(&path, &published_pool, &mut |_| {})?;
    let layout = running.model.weights().clone();
    let rt = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()?;
    let rounds = args.rounds.max(1);
    let (sync, raw, bytes) = rt.block_on(async {
        let p = Publisher::start(
            published.model.weights().clone(),
            None,
            PublishOptions {
                conns_per_peer: args.conns,
                ..PublishOptions::default()
            },
        )
        .await?;
        let puller = Puller::new(pdkv_transfer::auth::KvSecret::open(), args.conns).await?;
        let bytes = p.manifest().bytes();
        let (mut sync, mut raw) = (Vec::new(), Vec::new());
        // Interleaved, so both see the same machine.
        for r in 0..rounds {
            let t0 = Instant::now();
            let m = puller.manifest(&p.url()).await?;
            let fetched = t0.elapsed().as_secs_f64();
            let mut st = puller.stage(m, &layout)?;
            let staged = t0.elapsed().as_secs_f64();
            let rep = puller.pull(&mut st, None, Duration::from_secs(300)).await?;
            st.complete()?;
            let secs = t0.elapsed().as_secs_f64();
            sync.push(bytes as f64 / secs / 1e9);
            raw.push(crate::bench_transfer::raw_tcp(args.conns, bytes as usize).await?);
            eprintln!(
                "round {r}: sync {:.2} GB/s ({:.0} ms: manifest {:.0}, staging {:.0}, pull {:.0} + checksums {:.0}), raw TCP {:.2} GB/s",
                sync[r],
                secs * 1e3,
                fetched * 1e3,
                (staged - fetched) * 1e3,
                rep.read_seconds * 1e3,
                (rep.seconds - rep.read_seconds) * 1e3,
                raw[r]
            );
        }
        anyhow::Ok((sync, raw, bytes))
    })?;
    // A reload of the same checkpoint from disk (page cache warm).
    let mut disk = Vec::new();
    for _ in 0..rounds.min(3) {
        let t0 = Instant::now();
        pdkv_model::loader::reload_weights_into(
            running.model.weights(),
            running.model.config(),
            &path,
            &mut |_| {},
        )
        .map_err(|e| anyhow::anyhow!("{e}"))?;
        disk.push(t0.elapsed().as_secs_f64());
    }
    let best = |v: &[f64]| v.iter().cloned().fold(f64::MIN, f64::max);
    let fastest = |v: &[f64]| v.iter().cloned().fold(f64::MAX, f64::min);
    let (s, r) = (best(&sync), best(&raw));
    let sync_secs = bytes as f64 / s / 1e9;
    let d = fastest(&disk);
    println!(
        "{} bytes: sync {:.2} GB/s ({:.0} ms), raw loopback TCP {:.2} GB/s: ratio {:.2}; reload from disk {:.0} ms ({:.1}x the sync's time)",
        bytes,
        s,
        sync_secs * 1e3,
        r,
        s / r,
        d * 1e3,
        d / sync_secs
    );
    println!(
        "{}",
        serde_json::json!({
            "bench": "sync", "bytes": bytes, "conns": args.conns,
            "sync_gb_s": sync, "raw_tcp_gb_s": raw, "disk_reload_s": disk,
            "ratio_sync_vs_raw_tcp": s / r, "disk_vs_sync_time": d / sync_secs,
        })
    );
    Ok(())
}
