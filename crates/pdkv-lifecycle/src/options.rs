//! What one run of the matrix is asked to do.

use std::path::PathBuf;

use pdkv_deploy::{FailurePolicy, TransferMode, Transport};

use crate::cases::select_cases;
use crate::error::LifecycleError;
use crate::report::CaseResult;

/// Called with each case run's result as soon as it has one.
pub type OnCase = Box<dyn FnMut(&CaseResult) + Send + Sync>;

/// A run of the matrix: the deployment it starts and the cases it runs.
/// [`Options::new`] gives the defaults of `pdkv lifecycle`.
pub struct Options {
    /// The `pdkv` executable every child runs.
    pub exe: PathBuf,
    /// A `.gguf` file or a checkpoint directory.
    pub model: PathBuf,
    /// How KV moves from P to D.
    pub transport: Transport,
    /// Who moves the bytes: P writes into D's blocks, or D reads P's.
    pub transfer_mode: TransferMode,
    /// D's policy for a KV load that failed.
    pub kv_load_failure_policy: FailurePolicy,
    /// P's bound on holding KV for a pull and answering it, in seconds
    /// (`None`: the connector's).
    pub kv_abort_timeout_s: Option<f64>,
    /// `all`, or case names separated by commas ([`crate::case_names`]).
    pub cases: String,
    /// Times each case runs.
    pub cycles: usize,
    /// Load workers, each looping one request at a time.
    pub load_concurrency: usize,
    /// Every N-th load request leaves after its first event (0: never).
    pub disconnect_every: usize,
    /// Load prompts repeat their prefix 1 to this many times (about 25
    /// tokens each): 4 gives 25-100 tokens, 60 up to 1,500.
    pub load_prompt_repeats: usize,
    /// Greedy probe prompts compared with the baseline after every case.
    pub probes: usize,
    /// Tokens each probe generates.
    pub probe_tokens: u32,
    /// KV cache size of P and D, in blocks of 16 tokens.
    pub num_kv_blocks: usize,
    /// Ranks P splits the model over (tensor parallelism).
    pub prefill_tensor_parallel_size: u16,
    /// Ranks D splits the model over.
    pub decode_tensor_parallel_size: u16,
    /// How long a pause or sleep is held under load, in milliseconds.
    pub hold_ms: u64,
    /// Bound on each admin call, in seconds.
    pub op_timeout: u64,
    /// Bound on the start-up (model loading included), in seconds.
    pub startup_timeout: u64,
    /// Forward the children's logs to stderr.
    pub show_logs: bool,
    /// Called with each case run's result as soon as it ran.
    pub on_case: Option<OnCase>,
}

impl Options {
    /// The defaults of `pdkv lifecycle`, with `exe` in every child.
    pub fn new(exe: PathBuf, model: PathBuf) -> Options {
        Options {
            exe,
            model,
            transport: Transport::Tcp,
            transfer_mode: TransferMode::Write,
            kv_load_failure_policy: FailurePolicy::Fail,
            kv_abort_timeout_s: None,
            cases: "all".to_string(),
            cycles: 1,
            load_concurrency: 8,
            disconnect_every: 4,
            load_prompt_repeats: 4,
            probes: 30,
            probe_tokens: 8,
            num_kv_blocks: 256,
            prefill_tensor_parallel_size: 1,
            decode_tensor_parallel_size: 1,
            hold_ms: 300,
            op_timeout: 120,
            startup_timeout: 300,
            show_logs: false,
            on_case: None,
        }
    }

    /// Fails on a case selection that names no known case, or an option
    /// out of its range ([`crate::run_matrix`] checks it first too).
    pub fn validate(&self) -> Result<(), LifecycleError> {
        select_cases(&self.cases)?;
        let rules = [
            (self.cycles > 0, "--cycles must be at least 1"),
            (
                self.load_concurrency > 0,
                "--load-concurrency must be at least 1",
            ),
            (
                self.load_prompt_repeats > 0,
                "--load-prompt-repeats must be at least 1",
            ),
            (self.probes > 0, "--probes must be at least 1"),
            (self.probe_tokens > 0, "--probe-tokens must be at least 1"),
            (
                self.op_timeout > 0,
                "--op-timeout must be at least 1 second",
            ),
        ];
        match rules.iter().find(|(ok, _)| !ok) {
            Some((_, rule)) => Err(LifecycleError::BadOption(rule)),
            None => Ok(()),
        }
    }
}
