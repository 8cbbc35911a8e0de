//! What the core keeps per request next to the scheduler's state: how it
//! samples (parameters, adjustments, history, grammar), what it reports
//! (log-probabilities, prompt log-probabilities) and how its text is cut
//! (detokenizer, stop strings).

use crate::constraint::TokenConstraint;
use crate::core::command::OutputSink;
use crate::detok::{IncrementalDetokenizer, StopChecker};
use crate::sampling::{logprobs, LogitsAdjust, SamplingConfig, TokenHistory, TokenLogprobs};
use crate::RequestOutput;

/// Per-request state the core keeps next to the scheduler's.
pub(super) struct ActiveRequest {
    pub(super) serial: u64,
    pub(super) output: OutputSink,
    pub(super) sampling: SamplingConfig,
    pub(super) adjust: LogitsAdjust,
    /// The tokens seen so far (penalties, `min_tokens`).
    pub(super) history: TokenHistory,
    /// Structured outputs: where the output is in its grammar.
    pub(super) guide: Option<Box<dyn TokenConstraint>>,
    pub(super) return_logits: bool,
    /// Top log-probabilities per output token, when asked.
    pub(super) logprobs: Option<usize>,
    pub(super) prompt_logprobs: Option<PromptLogprobs>,
    pub(super) detok: IncrementalDetokenizer,
    pub(super) stops: StopChecker,
    /// Stop strings match only once this many tokens were generated.
    pub(super) min_tokens: usize,
    pub(super) num_prompt_tokens: usize,
    pub(super) num_cached_tokens: usize,
}

/// A request's prompt log-probabilities, gathered from its prefill's rows
/// (chunk by chunk; a preempted prefill computes them again and the rows
/// already gathered are skipped).
pub(super) struct PromptLogprobs {
    pub(super) top: usize,
    pub(super) prompt: Vec<u32>,
    /// One per prompt token so far; the first is `None`.
    pub(super) entries: Vec<Option<TokenLogprobs>>,
    pub(super) sent: bool,
}

impl PromptLogprobs {
    /// Takes the row computed at prompt position `pos`: it predicts the
    /// token at `pos + 1`.
    pub(super) fn take_row(&mut self, pos: usize, row: &[f32]) {
        let next = pos + 1;
        if next == self.entries.len() && next < self.prompt.len() {
            self.entries
                .push(Some(logprobs(row, self.prompt[next], self.top)));
        }
    }
}

impl ActiveRequest {
    pub(super) fn output(&self, id: &str) -> RequestOutput {
        RequestOutput {
            num_cached_tokens: self.num_cached_tokens,
            ..RequestOutput::empty(id.to_string(), self.num_prompt_tokens)
        }
    }
}
