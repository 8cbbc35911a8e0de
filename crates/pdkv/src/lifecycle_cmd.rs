//! `pdkv lifecycle`: the lifecycle matrix under load across a prefill
//! server, a decode server and the P/D proxy (the crate `pdkv-lifecycle`
//! runs it; its docs say what a run does and when a case passes). This
//! command parses the arguments, runs the matrix with this executable in
//! every child, prints a line per case run as it ends, the summary and a
//! JSON line last on stdout, and fails when a case run failed.

use std::io::Write;
use std::path::PathBuf;

use anyhow::{anyhow, bail, Context};
use clap::Args;
use pdkv_deploy::FailurePolicy;
use pdkv_lifecycle::{CaseResult, Options};

use crate::fetch;
use crate::proxy_cmd::wait_for_signal;
use crate::up::DeploymentArgs;

#[derive(Args, Debug)]
pub struct LifecycleArgs {
    #[command(flatten)]
    pub deployment: DeploymentArgs,
    /// D's policy for a KV load that failed (a load that P ended on purpose
    /// recomputes under either).
    #[arg(long, value_enum, default_value = "fail")]
    pub kv_load_failure_policy: FailurePolicy,
    /// P's bound on holding KV for a pull and answering it, in seconds
    /// (the connector's `abort_timeout_s`; default: the connector's).
    #[arg(long)]
    pub kv_abort_timeout_s: Option<f64>,
    /// `all`, or case names separated by commas (`--list` shows them).
    #[arg(long, default_value = "all")]
    pub cases: String,
    /// Times each case runs.
    #[arg(long, default_value_t = 1)]
    pub cycles: usize,
    /// Load workers, each looping one request at a time.
    #[arg(long, default_value_t = 8)]
    pub load_concurrency: usize,
    /// Every N-th load request leaves after its first event (0: never).
    #[arg(long, default_value_t = 4)]
    pub disconnect_every: usize,
    /// Load prompts repeat a prefix of about 25 tokens 1 to N times (4:
    /// 25-100 tokens; 60: up to 1,500).
    #[arg(long, default_value_t = 4)]
    pub load_prompt_repeats: usize,
    /// Greedy probe prompts compared with the baseline after every case.
    #[arg(long, default_value_t = 30)]
    pub probes: usize,
    /// Tokens each probe generates.
    #[arg(long, default_value_t = 8)]
    pub probe_tokens: u32,
    /// KV cache size of P and D, in blocks of 16 tokens.
    #[arg(long, default_value_t = 256)]
    pub num_kv_blocks: usize,
    /// Ranks P splits the model over (tensor parallelism).
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u16).range(1..=64))]
    pub prefill_tensor_parallel_size: u16,
    /// Ranks D splits the model over.
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u16).range(1..=64))]
    pub decode_tensor_parallel_size: u16,
    /// How long a pause or sleep is held under load, in milliseconds.
    #[arg(long, default_value_t = 300)]
    pub hold_ms: u64,
    /// Bound on each admin call, in seconds.
    #[arg(long, default_value_t = 120)]
    pub op_timeout: u64,
    /// Bound on the start-up (model loading included), in seconds.
    #[arg(long, default_value_t = 300)]
    pub startup_timeout: u64,
    /// Forward the children's logs to stderr.
    #[arg(long)]
    pub show_logs: bool,
    /// Print the case names and exit.
    #[arg(long)]
    pub list: bool,
}

impl LifecycleArgs {
    /// The matrix these arguments ask for, run with `exe` and `model`.
    fn options(self, exe: PathBuf, model: PathBuf) -> Options {
        let mut o = Options::new(exe, model);
        o.transport = self.deployment.transport;
        o.transfer_mode = self.deployment.transfer_mode;
        o.kv_load_failure_policy = self.kv_load_failure_policy;
        o.kv_abort_timeout_s = self.kv_abort_timeout_s;
        o.cases = self.cases;
        o.cycles = self.cycles;
        o.load_concurrency = self.load_concurrency;
        o.disconnect_every = self.disconnect_every;
        o.load_prompt_repeats = self.load_prompt_repeats;
        o.probes = self.probes;
        o.probe_tokens = self.probe_tokens;
        o.num_kv_blocks = self.num_kv_blocks;
        o.prefill_tensor_parallel_size = self.prefill_tensor_parallel_size;
        o.decode_tensor_parallel_size = self.decode_tensor_parallel_size;
        o.hold_ms = self.hold_ms;
        o.op_timeout = self.op_timeout;
        o.startup_timeout = self.startup_timeout;
        o.show_logs = self.show_logs;
        o.on_case = Some(Box::new(print_case));
        o
    }
}

/// A case run's line, as soon as it ran.
fn print_case(r: &CaseResult) {
    println!("{}  ({:.1}s)", r.line(), r.wall_s);
    let _ = std::io::stdout().flush();
}

pub fn run(args: LifecycleArgs) -> anyhow::Result<()> {
    if args.list {
        for name in pdkv_lifecycle::case_names() {
            println!("{name}");
        }
        return Ok(());
    }
    let exe = std::env::current_exe().context("finding the pdkv executable")?;
    let model = args.deployment.model.clone();
    let mut options = args.options(exe, model.clone().unwrap_or_default());
    // The arguments are checked before a default model is fetched.
    options.validate()?;
    if model.is_none() {
        options.model = fetch::default_model_path()?;
    }
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .context("starting the async runtime")?;
    let report = runtime.block_on(async {
        tokio::select! {
            r = pdkv_lifecycle::run_matrix(options) => r.map_err(anyhow::Error::from),
            _ = wait_for_signal() => Err(anyhow!("interrupted")),
        }
    })?;
    println!("{}", report.summary());
    println!("{}", report.json());
    let failed = report.failed().len();
    if failed > 0 {
        bail!("{failed} of {} case runs failed", report.results.len());
    }
    Ok(())
}
