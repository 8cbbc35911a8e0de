//! `pdkv`: serve a model over an OpenAI-compatible HTTP API (with the
//! lifecycle admin API behind `--admin-token`), fetch the default model,
//! write random test checkpoints, and benchmark decoding, sleep mode and
//! sustained serving through the P/D proxy.
//!
//! Logs go to stderr (`RUST_LOG`, default `info`); results a script may
//! consume (a fetched model's path, the benchmark's JSON line) go to stdout.

mod bench;
mod bench_pd;
mod bench_serve;
mod bench_sleep;
mod bench_spec;
mod bench_structured;
mod bench_transfer;
mod common;
mod export_cmd;
mod fetch;
mod http_args;
mod lifecycle_cmd;
mod progress;
mod proxy_cmd;
mod serve;
mod up;
mod weights_cmd;

use std::path::PathBuf;
use std::process::ExitCode;

use clap::{Args, Parser, Subcommand, ValueEnum};

#[derive(Parser)]
#[command(
    name = "pdkv",
    version,
    about = "An LLM inference server on CPU with a paged KV cache"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Serve a model over an OpenAI-compatible HTTP API.
    Serve(serve::ServeArgs),
    /// Run the P/D proxy in front of prefill and decode servers.
    Proxy(proxy_cmd::ProxyArgs),
    /// Start prefill and decode servers and the proxy on loopback.
    Up(up::UpArgs),
    /// Run the lifecycle matrix (pause, sleep, wake, release, reload) under
    /// load across a prefill server, a decode server and the proxy.
    Lifecycle(lifecycle_cmd::LifecycleArgs),
    /// Fetch or create model checkpoints.
    #[command(subcommand)]
    Model(ModelCommand),
    /// Benchmarks.
    #[command(subcommand)]
    Bench(BenchCommand),
    /// Weight sync tools.
    #[command(subcommand)]
    Weights(WeightsCommand),
}

#[derive(Subcommand)]
enum WeightsCommand {
    /// Publish a checkpoint's weights for engines to sync from (runs until
    /// Ctrl-C; prints the URL for `init_weight_transfer_engine`).
    Publish(weights_cmd::PublishArgs),
}

#[derive(Subcommand)]
enum ModelCommand {
    /// Download the default model (SmolLM2-135M-Instruct, Q4_1 GGUF) into the cache.
    Fetch {
        /// Directory to store the model in (default: $PDKV_MODEL_DIR or ~/.cache/pdkv/models).
        #[arg(long)]
        dir: Option<PathBuf>,
    },
    /// Write a checkpoint with random weights (for tests).
    Init(InitArgs),
    /// Write a model as a Hugging Face checkpoint directory (BF16
    /// safetensors, config, tokenizer and chat template).
    Export(export_cmd::ExportArgs),
}

#[derive(Clone, Copy, ValueEnum)]
enum ArchArg {
    Llama,
    Qwen3,
}

impl From<ArchArg> for pdkv_model::Arch {
    fn from(a: ArchArg) -> pdkv_model::Arch {
        match a {
            ArchArg::Llama => pdkv_model::Arch::Llama,
            ArchArg::Qwen3 => pdkv_model::Arch::Qwen3,
        }
    }
}

#[derive(Args)]
struct InitArgs {
    /// Model family: Llama (SmolLM2's) or Qwen3 (with Q/K norms).
    #[arg(long, value_enum)]
    arch: ArchArg,
    /// Size preset: `tiny` or `small`.
    #[arg(long, default_value = "tiny")]
    preset: String,
    /// Seed of the random weights: the same arguments write the same bytes.
    #[arg(long, default_value_t = 0)]
    seed: u64,
    /// Output directory.
    #[arg(long)]
    out: PathBuf,
}

#[derive(Subcommand)]
enum BenchCommand {
    /// Decode throughput per batch size, against the memory-bandwidth roofline.
    Decode(bench::DecodeArgs),
    /// Prompt-processing throughput: one prompt per length, computed in chunks as the server would.
    Prefill(bench::PrefillArgs),
    /// Perplexity of a text (windows scored on their second half, as
    /// llama-perplexity does) over each KV cache element type.
    Perplexity(bench::PerplexityArgs),
    /// Sleep and wake latency and memory per sleep level, with a greedy
    /// probe checking that outputs after every wake equal the awake run.
    Sleep(bench_sleep::SleepArgs),
    /// Transfer throughput over TCP loopback and shared memory, beside raw baselines.
    Transfer(bench_transfer::TransferArgs),
    /// Time to first token and throughput of 1P1D against a colocated engine.
    Pd(bench_pd::PdArgs),
    /// Sustained load through the P/D proxy (its own 1P1D deployment, or
    /// `--url`): failures by cause, throughput, TTFT and inter-token
    /// latency, memory drift, and every KV block free at the end.
    Serve(bench_serve::ServeBenchArgs),
    /// A weight sync's throughput beside a raw loopback socket copy of the
    /// same bytes, and a reload of the same checkpoint from disk.
    Sync(weights_cmd::SyncBenchArgs),
    /// Batch-1 decode with speculative decoding (n-gram drafts) against
    /// the same engine without it, on answers that repeat their prompts and
    /// answers that do not; the outputs must be identical.
    Spec(bench_spec::SpecArgs),
    /// Decode throughput of concurrent JSON-schema constrained requests
    /// against the same requests unconstrained, and the masks' time per
    /// step.
    Structured(bench_structured::StructuredArgs),
}

fn init_logging() {
    use std::io::IsTerminal;
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info"));
    tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .with_ansi(std::io::stderr().is_terminal())
        .init();
}

fn run(cli: Cli) -> anyhow::Result<()> {
    match cli.command {
        Command::Serve(args) => serve::run(args),
        Command::Proxy(args) => proxy_cmd::run(args),
        Command::Up(args) => up::run(args),
        Command::Lifecycle(args) => lifecycle_cmd::run(args),
        Command::Model(ModelCommand::Fetch { dir }) => {
            let dir = dir.map_or_else(fetch::default_model_dir, Ok)?;
            let path = fetch::fetch_default_model(&dir)?;
            println!("{}", path.display());
            Ok(())
        }
        Command::Model(ModelCommand::Init(a)) => {
            pdkv_model::init::write_random_checkpoint(a.arch.into(), &a.preset, a.seed, &a.out)?;
            println!("{}", a.out.display());
            Ok(())
        }
        Command::Model(ModelCommand::Export(args)) => export_cmd::run(args),
        Command::Bench(BenchCommand::Decode(args)) => bench::run_decode(args),
        Command::Bench(BenchCommand::Prefill(args)) => bench::run_prefill(args),
        Command::Bench(BenchCommand::Perplexity(args)) => bench::run_perplexity(args),
        Command::Bench(BenchCommand::Sleep(args)) => bench_sleep::run_sleep(args),
        Command::Bench(BenchCommand::Transfer(args)) => bench_transfer::run_transfer(args),
        Command::Bench(BenchCommand::Pd(args)) => bench_pd::run_pd_bench(args),
        Command::Bench(BenchCommand::Serve(args)) => bench_serve::run_serve_bench(args),
        Command::Bench(BenchCommand::Sync(args)) => weights_cmd::run_sync_bench(args),
        Command::Bench(BenchCommand::Spec(args)) => bench_spec::run_spec(args),
        Command::Bench(BenchCommand::Structured(args)) => bench_structured::run_structured(args),
        Command::Weights(WeightsCommand::Publish(args)) => weights_cmd::run_publish(args),
    }
}

/// The command line's grammar: the derived one, with what a derive
/// cannot say (`bench serve`'s deployment flags refused beside `--url`).
fn command() -> clap::Command {
    use clap::CommandFactory;
    Cli::command().mut_subcommand("bench", |b| {
        b.mut_subcommand("serve", bench_serve::refuse_beside_url)
    })
}

fn main() -> ExitCode {
    use clap::FromArgMatches;
    let cli = Cli::from_arg_matches(&command().get_matches()).unwrap_or_else(|e| e.exit());
    init_logging();
    match run(cli) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e:#}");
            ExitCode::FAILURE
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every flag and subcommand of every command says what it does.
    #[test]
    fn every_flag_has_help() {
        fn walk(cmd: &clap::Command, path: &str, missing: &mut Vec<String>) {
            for arg in cmd.get_arguments() {
                let id = arg.get_id().as_str();
                if id == "help" || id == "version" {
                    continue;
                }
                if arg.get_help().is_none() && arg.get_long_help().is_none() {
                    missing.push(format!("{path} --{}", arg.get_long().unwrap_or(id)));
                }
            }
            for sub in cmd.get_subcommands() {
                let sub_path = format!("{path} {}", sub.get_name());
                if sub.get_about().is_none() && sub.get_name() != "help" {
                    missing.push(sub_path.clone());
                }
                walk(sub, &sub_path, missing);
            }
        }
        let mut missing = Vec::new();
        walk(&command(), "pdkv", &mut missing);
        assert!(missing.is_empty(), "without help text: {missing:#?}");
    }

    /// `bench serve` refuses the flags of the deployment it would start
    /// beside `--url` (naming both), and takes them without it.
    #[test]
    fn bench_serve_refuses_deployment_flags_beside_url() {
        let url = ["pdkv", "bench", "serve", "--url", "http://127.0.0.1:1"];
        for flag in [
            &["--max-connections", "5"][..],
            &["--header-timeout-s", "2"],
            &["--startup-timeout", "9"],
            &["--model", "m.gguf"],
            &["--transport", "shm"],
            &["--transfer-mode", "read"],
            &["--num-kv-blocks", "64"],
            &["--log-dir", "logs"],
        ] {
            let e = command()
                .try_get_matches_from(url.iter().chain(flag))
                .expect_err(flag[0]);
            assert_eq!(
                e.kind(),
                clap::error::ErrorKind::ArgumentConflict,
                "{flag:?}"
            );
            let text = e.to_string();
            assert!(text.contains(flag[0]) && text.contains("--url"), "{text}");
            let own = ["pdkv", "bench", "serve"];
            let m = command().try_get_matches_from(own.iter().chain(flag));
            assert!(m.is_ok(), "{flag:?} without --url: {m:?}");
        }
        // The servers' own defaults are not a conflict.
        assert!(command().try_get_matches_from(url).is_ok());
    }
}
