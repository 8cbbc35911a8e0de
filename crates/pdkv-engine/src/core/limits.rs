//! What every request and every engine configuration is checked against,
//! shared by the handle (on the caller's thread) and the stepper (for
//! callers that drive it directly).

use crate::connector::ParamsValidator;
use crate::scheduler::Scheduler;
use crate::{AddRequestError, EngineConfig, EngineRequest};

/// Refuses a configuration the scheduler cannot run.
pub(crate) fn check_config(config: &EngineConfig) -> anyhow::Result<()> {
    anyhow::ensure!(config.max_num_seqs > 0, "max_num_seqs must be at least 1");
    anyhow::ensure!(
        config.max_num_batched_tokens > 0,
        "max_num_batched_tokens must be at least 1"
    );
    anyhow::ensure!(config.num_kv_blocks > 0, "num_kv_blocks must be at least 1");
    anyhow::ensure!(
        config.tensor_parallel_size > 0,
        "tensor_parallel_size must be at least 1"
    );
    Ok(())
}

/// The limits a request must fit.
#[derive(Clone)]
pub(crate) struct RequestLimits {
    pub vocab_size: usize,
    pub max_model_len: usize,
    pub num_kv_blocks: usize,
    /// The KV connector's check of `kv_transfer_params`, if the engine has one.
    pub params_validator: Option<ParamsValidator>,
}

impl RequestLimits {
    /// Why `req` can never run on this engine, if it cannot.
    pub fn check(&self, req: &EngineRequest) -> Result<(), AddRequestError> {
        let p = &req.params;
        let invalid = |m: String| Err(AddRequestError::Invalid(m));
        if req.prompt_tokens.is_empty() {
            return invalid("the prompt is empty".into());
        }
        if let Some(check) = &self.params_validator {
            if let Err(e) = check(req.kv_transfer_params.as_ref()) {
                return invalid(format!("kv_transfer_params: {e}"));
            }
        }
        if p.max_tokens < 1 {
            return invalid("max_tokens must be at least 1".into());
        }
        if !(p.temperature >= 0.0 && p.temperature.is_finite()) {
            return invalid(format!("temperature must be >= 0, got {}", p.temperature));
        }
        if !(p.top_p > 0.0 && p.top_p <= 1.0) {
            return invalid(format!("top_p must be in (0, 1], got {}", p.top_p));
        }
        if p.stop.iter().any(|s| s.is_empty()) {
            return invalid("stop strings must not be empty".into());
        }
        if !(p.repetition_penalty > 0.0 && p.repetition_penalty.is_finite()) {
            return invalid(format!(
                "repetition_penalty must be > 0, got {}",
                p.repetition_penalty
            ));
        }
        for (name, v) in [
            ("presence_penalty", p.presence_penalty),
            ("frequency_penalty", p.frequency_penalty),
        ] {
            if !(-2.0..=2.0).contains(&v) {
                return invalid(format!("{name} must be in [-2, 2], got {v}"));
            }
        }
        if p.min_tokens > p.max_tokens {
            return invalid(format!(
                "min_tokens ({}) must not exceed max_tokens ({})",
                p.min_tokens, p.max_tokens
            ));
        }
        for (name, k) in [
            ("logprobs", p.logprobs),
            ("prompt_logprobs", p.prompt_logprobs),
        ] {
            if let Some(k) = k.filter(|&k| k > crate::MAX_LOGPROBS) {
                return invalid(format!(
                    "{name} must be at most {}, got {k}",
                    crate::MAX_LOGPROBS
                ));
            }
        }
        if p.prompt_logprobs.is_some() && req.kv_transfer_params.is_some() {
            // Its prompt must be computed here, position by position.
            return invalid("prompt_logprobs cannot be combined with kv_transfer_params".into());
        }
        let vocab = self.vocab_size;
        for &(t, bias) in &p.logit_bias {
            if t as usize >= vocab {
                return invalid(format!(
                    "logit_bias token id {t} is outside the vocabulary of {vocab}"
                ));
            }
            if !(-100.0..=100.0).contains(&bias) {
                return invalid(format!(
                    "logit_bias for token {t} must be in [-100, 100], got {bias}"
                ));
            }
        }
        if let Some(&t) = req.prompt_tokens.iter().find(|&&t| t as usize >= vocab) {
            return invalid(format!(
                "prompt token id {t} is outside the vocabulary of {vocab}"
            ));
        }
        if let Some(&t) = req.resume_token_ids.iter().find(|&&t| t as usize >= vocab) {
            return invalid(format!(
                "resume_token_ids: token id {t} is outside the vocabulary of {vocab}"
            ));
        }
        if !req.resume_token_ids.is_empty() {
            let done = req.resume_token_ids.len();
            if done >= p.max_tokens as usize {
                return invalid(format!(
                    "resume_token_ids holds {done} tokens: nothing is left of max_tokens ({})",
                    p.max_tokens
                ));
            }
            if p.prompt_logprobs.is_some() {
                return invalid("prompt_logprobs cannot be combined with resume_token_ids".into());
            }
        }
        if let Some(&t) = p.stop_token_ids.iter().find(|&&t| t as usize >= vocab) {
            return invalid(format!(
                "stop token id {t} is outside the vocabulary of {vocab}"
            ));
        }
        let prompt = req.prompt_tokens.len();
        let max_tokens = p.max_tokens as usize;
        if prompt + max_tokens > self.max_model_len {
            return Err(AddRequestError::TooLong {
                prompt,
                max_tokens,
                max_model_len: self.max_model_len,
            });
        }
        let needed = Scheduler::max_blocks_needed(prompt, max_tokens);
        let total = self.num_kv_blocks;
        if needed > total {
            return Err(AddRequestError::ExceedsKvCapacity { needed, total });
        }
        Ok(())
    }
}
