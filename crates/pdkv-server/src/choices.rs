//! The `n` choices of one generation request (GRPO-style groups).
//!
//! Each choice is an engine request of its own. Choice 0 is admitted first;
//! the others are admitted once choice 0 produced its first token, i.e.
//! once its prompt's KV is computed, so with prefix caching they take the
//! prompt's full blocks from the cache (shared, reference-counted) and each
//! computes only the prompt's last partial block and its own tokens. The
//! prompt is thus prefilled once; only choice 0 computes prompt
//! log-probabilities, and the others report its values.
//!
//! Seeds: choice `i` of a request seeded with `s` samples with seed
//! `s + i` (wrapping), as vLLM's child requests do, so choice 0 of a group
//! equals the same request with `n = 1`, and a seeded group reproduces
//! choice by choice. Unseeded choices each draw their own seed.
//!
//! Engine ids: choice 0 has the request's engine id (the response's id,
//! scoped when the client chose it: [`crate::ids`]), choice `i > 0` has
//! `{id}-{i}`.
//!
//! P/D: a group is one transfer. On a decode engine choice 0 carries the
//! request's `kv_transfer_params` and loads the prompt's KV from P; the
//! others, admitted after it, take the loaded full blocks from D's prefix
//! cache. A prefill engine computes the prompt once whatever `n` says (its
//! answer is for the proxy or router, which reads only the returned params),
//! so it runs one choice.
//!
//! Every choice's [`TrackedStream`] is owned by the group, which the handler
//! or the response body owns, so a client that disconnects aborts them all.

use std::collections::VecDeque;
use std::time::Instant;

use futures::{Stream, StreamExt};
use pdkv_engine::sampling::TokenLogprobs;
use pdkv_engine::{FinishReason, RequestOutput, SamplingParams};
use serde_json::Value;

use crate::admit::{admit, failed_request, KvIn, PromptIn};
use crate::error::ApiError;
use crate::ids::RequestIds;
use crate::tracker::TrackedStream;
use crate::AppState;

/// Most choices one request may ask for.
pub const MAX_N: usize = 128;

/// The seed of choice `index` of a request seeded with `seed` (see the
/// module docs).
pub fn choice_seed(seed: u64, index: usize) -> u64 {
    seed.wrapping_add(index as u64)
}

/// The engine id of choice `index` of request `id`.
pub fn choice_id(id: &str, index: usize) -> String {
    if index == 0 {
        id.to_string()
    } else {
        format!("{id}-{index}")
    }
}

/// Reads `n` (1 when absent) and checks `best_of` against it: `best_of`
/// above `n` (generate more, return the best) is not implemented.
pub fn parse_n(n: Option<i64>, best_of: Option<i64>) -> Result<usize, ApiError> {
    let n = match n.unwrap_or(1) {
        k if (1..=MAX_N as i64).contains(&k) => k as usize,
        k => {
            return Err(ApiError::invalid_param(
                "n",
                format!("n must be from 1 to {MAX_N}, got {k}"),
            ))
        }
    };
    match best_of {
        None => {}
        Some(b) if b == n as i64 => {}
        Some(b) if b < n as i64 => {
            return Err(ApiError::invalid_param(
                "best_of",
                format!("best_of ({b}) must not be smaller than n ({n})"),
            ))
        }
        Some(b) => {
            return Err(ApiError::invalid_param(
                "best_of",
                format!(
                "best_of ({b}) above n ({n}) is not supported; ask for n={b} and rank the choices"
            ),
            ))
        }
    }
    Ok(n)
}

/// The admitted choices of one request.
pub struct Group {
    pub id: String,
    pub created: u64,
    pub num_prompt_tokens: usize,
    /// Outputs produced before this engine took the request over
    /// (`resume_token_ids`): counted in the usage, not sent again.
    pub resumed: usize,
    /// It continues a stream another engine began: its opening chunks (the
    /// chat role) were sent already.
    pub continues: bool,
    /// Each streamed event names its output token ids in an SSE comment
    /// ([`pdkv_relay::TOKEN_IDS_HEADER`]).
    pub report_token_ids: bool,
    streams: Vec<TrackedStream>,
    /// Outputs read while admitting (choice 0's first), handed out first.
    early: VecDeque<(usize, RequestOutput)>,
    /// Per prompt of a [`Group::concat`]: its choices and its tokens
    /// (empty: every choice is of the one prompt).
    prompts: Vec<(usize, usize)>,
}

/// Admits the `n` choices of a request (see the module docs for the order,
/// the seeds and the ids). `params.prompt_logprobs` is computed by choice 0
/// only.
pub(crate) async fn admit_group(
    state: &AppState,
    ids: RequestIds,
    prompt: PromptIn,
    params: SamplingParams,
    kv: KvIn,
    arrived: Instant,
    n: usize,
) -> Result<Group, ApiError> {
    let KvIn {
        params: kv_transfer_params,
        resume,
    } = kv;
    if resume.is_some() && n > 1 {
        return Err(ApiError::invalid_param(
            "kv_transfer_params.resume_token_ids",
            format!(
                "kv_transfer_params.resume_token_ids resumes one sequence: it needs n = 1, got {n}"
            ),
        ));
    }
    let continues = resume.is_some();
    let resume = resume.unwrap_or_default();
    let resumed = resume.len();
    let prefill_for_remote_decode = matches!(
        pdkv_connector::params::PdParams::parse(kv_transfer_params.as_ref()),
        Ok(Some(pdkv_connector::params::PdParams::RemoteDecode { .. }))
    );
    let n = if prefill_for_remote_decode { 1 } else { n };
    let num_prompt_tokens = prompt.tokens.len();
    let first = admit(
        state,
        ids.engine.clone(),
        prompt.clone(),
        params.clone(),
        kv_transfer_params,
        resume,
        arrived,
    )
    .await?;
    let created = first.created;
    let mut group = Group {
        id: ids.shown,
        created,
        num_prompt_tokens,
        resumed,
        continues,
        report_token_ids: false,
        streams: vec![first.stream],
        early: VecDeque::new(),
        prompts: Vec::new(),
    };
    if n == 1 {
        return Ok(group);
    }
    // Wait for choice 0's prompt to be in the KV cache.
    match group.streams[0].next().await {
        Some(out) if out.finish_reason == Some(FinishReason::Error) => {
            return Err(failed_request(&out))
        }
        Some(out) => group.early.push_back((0, out)),
        None => {
            return Err(ApiError::unavailable(
                "the engine ended the request before its first token",
            ))
        }
    }
    for i in 1..n {
        let mut p = params.clone();
        p.prompt_logprobs = None;
        p.seed = params.seed.map(|s| choice_seed(s, i));
        let admitted = admit(
            state,
            choice_id(&ids.engine, i),
            prompt.clone(),
            p,
            None,
            Vec::new(),
            arrived,
        )
        .await?;
        group.streams.push(admitted.stream);
    }
    Ok(group)
}

/// One choice's whole generation.
#[derive(Default)]
pub struct Choice {
    pub text: String,
    pub token_ids: Vec<u32>,
    pub logprobs: Vec<TokenLogprobs>,
    pub prompt_logprobs: Option<Vec<Option<TokenLogprobs>>>,
    pub finish_reason: Option<FinishReason>,
    pub kv_transfer_params: Option<Value>,
}

impl Choice {
    /// Adds one output; a failed request becomes its error.
    fn push(&mut self, out: RequestOutput) -> Result<(), ApiError> {
        if out.finish_reason == Some(FinishReason::Error) {
            return Err(failed_request(&out));
        }
        self.text.push_str(&out.text);
        self.token_ids.extend(&out.token_ids);
        self.logprobs.extend(out.logprobs);
        if out.prompt_logprobs.is_some() {
            self.prompt_logprobs = out.prompt_logprobs;
        }
        if out.finish_reason.is_some() {
            self.finish_reason = out.finish_reason;
            self.kv_transfer_params = out.kv_transfer_params;
        }
        Ok(())
    }
}

impl Group {
    pub fn n(&self) -> usize {
        self.streams.len()
    }

    /// The groups of several prompts of one request as one, answered under
    /// `id`: prompt `k`'s choice `j` becomes choice `k * n + j` (`n` each,
    /// as vLLM numbers them), and the prompt tokens add up.
    pub fn concat(id: String, groups: Vec<Group>) -> Group {
        let created = groups.first().map_or(0, |g| g.created);
        let mut all = Group {
            id,
            created,
            num_prompt_tokens: 0,
            resumed: 0,
            continues: false,
            report_token_ids: false,
            streams: Vec::new(),
            early: VecDeque::new(),
            prompts: Vec::new(),
        };
        for g in groups {
            let base = all.streams.len();
            all.num_prompt_tokens += g.num_prompt_tokens;
            all.prompts.push((g.n(), g.num_prompt_tokens));
            all.early
                .extend(g.early.into_iter().map(|(i, out)| (base + i, out)));
            all.streams.extend(g.streams);
        }
        all
    }

    /// Per choice: its prompt's tokens and what it generated before this
    /// engine took it over (the start of a stream's usage so far).
    pub fn choice_usage(&self) -> Vec<(usize, usize)> {
        if self.prompts.is_empty() {
            let mut u = vec![(self.num_prompt_tokens, 0); self.n()];
            if let Some(first) = u.first_mut() {
                first.1 = self.resumed;
            }
            return u;
        }
        self.prompts
            .iter()
            .flat_map(|&(n, tokens)| std::iter::repeat_n((tokens, 0), n))
            .collect()
    }

    /// Collects every choice to its end. Choices run concurrently in the
    /// engine; their outputs wait in their streams while another is read.
    /// Choice 0's prompt log-probabilities are copied to the others.
    pub async fn collect(&mut self) -> Result<Vec<Choice>, ApiError> {
        let mut choices: Vec<Choice> = (0..self.n()).map(|_| Choice::default()).collect();
        while let Some((i, out)) = self.early.pop_front() {
            choices[i].push(out)?;
        }
        for (i, stream) in self.streams.iter_mut().enumerate() {
            while let Some(out) = stream.next().await {
                choices[i].push(out)?;
            }
        }
        let shared = choices[0].prompt_logprobs.clone();
        for c in &mut choices[1..] {
            c.prompt_logprobs = shared.clone();
        }
        Ok(choices)
    }

    /// [`Group::collect`], and each choice as `answer(index, choice)` makes
    /// it for a whole (not streamed) answer.
    pub async fn collect_answers(
        &mut self,
        answer: impl Fn(usize, &Choice) -> Value,
    ) -> Result<(Vec<Choice>, Vec<Value>), ApiError> {
        let done = self.collect().await?;
        let answers = done.iter().enumerate().map(|(i, c)| answer(i, c)).collect();
        Ok((done, answers))
    }

    /// Completion tokens over all choices so far.
    pub fn generated(&self) -> usize {
        self.resumed
            + self
                .streams
                .iter()
                .map(TrackedStream::generated)
                .sum::<usize>()
    }

    /// Every choice's outputs, merged as they come: `(index, Some(output))`,
    /// and `(index, None)` for a choice whose stream ended without a final
    /// output (the engine went away).
    pub fn into_stream(self) -> impl Stream<Item = (usize, Option<RequestOutput>)> + Send {
        let early = futures::stream::iter(self.early.into_iter().map(|(i, o)| (i, Some(o))));
        let each = self.streams.into_iter().enumerate().map(|(i, stream)| {
            futures::stream::unfold(Some(stream), move |stream| async move {
                let mut stream = stream?;
                match stream.next().await {
                    Some(out) => {
                        let last = out.finish_reason.is_some();
                        Some(((i, Some(out)), if last { None } else { Some(stream) }))
                    }
                    None => Some(((i, None), None)),
                }
            })
            .boxed()
        });
        early.chain(futures::stream::select_all(each))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn n_and_best_of() {
        assert_eq!(parse_n(None, None).unwrap(), 1);
        assert_eq!(parse_n(Some(8), Some(8)).unwrap(), 8);
        for (n, best_of, param) in [
            (0, None, "n"),
            (129, None, "n"),
            (2, Some(3), "best_of"),
            (4, Some(2), "best_of"),
        ] {
            assert_eq!(
                parse_n(Some(n), best_of).unwrap_err().param.as_deref(),
                Some(param),
                "n={n} best_of={best_of:?}"
            );
        }
    }

    #[test]
    fn choice_seeds_and_ids() {
        assert_eq!(choice_seed(7, 0), 7, "choice 0 is the n=1 request");
        assert_eq!(choice_seed(7, 3), 10);
        assert_eq!(choice_seed(u64::MAX, 1), 0);
        assert_eq!(choice_id("cmpl-x", 0), "cmpl-x");
        assert_eq!(choice_id("cmpl-x", 2), "cmpl-x-2");
    }
}
