//! Request handlers: the OpenAI endpoints, health, models and metrics.

use std::sync::Arc;
use std::time::Instant;

use axum::extract::State;
use axum::http::{header, HeaderMap, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::Extension;
use pdkv_engine::sampling::TokenLogprobs;
use pdkv_engine::{FinishReason, RequestOutput, SamplingParams};
use pdkv_model::{ChatMessage, Ending, Tokenizer};
use serde_json::{json, Value};

use crate::admit::{json_response, kv_params, usage_json, with_request_id, KvIn, PromptIn};
use crate::chat::{stream_chat, whole_chat, ChatView};
use crate::choices::{admit_group, parse_n, Choice, Group};
use crate::error::ApiError;
use crate::fields::Screened;
use crate::ids::{RequestIds, Sender};
use crate::listen::PeerAddr;
use crate::logprobs;
use crate::metrics::LifecycleGauges;
use crate::openai::{
    chat_messages, parse_max_tokens, parse_prompts, ChatRequest, CompletionRequest, Endpoint,
    Prompt, SamplingFields, StreamOptions, DEFAULT_COMPLETION_MAX_TOKENS,
};
use crate::sse::{sse_response, ChunkHead, StreamUsage};
use crate::AppState;

pub(crate) fn check_model(state: &AppState, model: Option<&str>) -> Result<(), ApiError> {
    match model {
        Some(m) if m != state.served_model_name() => Err(ApiError::model_not_found(m)),
        _ => Ok(()),
    }
}

/// Runs CPU-heavy prompt preparation (tokenization, templates) off the
/// async workers.
pub(crate) async fn blocking<T: Send + 'static>(
    f: impl FnOnce() -> Result<T, ApiError> + Send + 'static,
) -> Result<T, ApiError> {
    tokio::task::spawn_blocking(f).await.unwrap_or_else(|e| {
        Err(ApiError::internal(format!(
            "prompt preparation failed: {e}"
        )))
    })
}

/// The tokens of a conversation rendered with the model's chat template,
/// ending as `ending` says, with extra template variables (`kwargs`;
/// `add_special_tokens`: let the tokenizer add BOS and the like too).
pub(crate) async fn chat_prompt_tokens_with(
    state: &AppState,
    messages: Vec<ChatMessage>,
    ending: Ending,
    add_special_tokens: bool,
    kwargs: serde_json::Map<String, Value>,
) -> Result<Vec<u32>, ApiError> {
    let engine = state.engine().clone();
    blocking(move || {
        let template = engine.chat_template().ok_or_else(|| {
            ApiError::invalid_param("messages", "this model has no chat template")
        })?;
        let text = template
            .render_ending(&messages, ending, &kwargs)
            .map_err(|e| {
                let param = match ending {
                    Ending::ContinueLast => "continue_final_message",
                    _ => "messages",
                };
                ApiError::invalid_param(param, format!("could not apply the chat template: {e:#}"))
            })?;
        engine
            .tokenizer()
            .encode(&text, add_special_tokens)
            .map_err(|e| {
                ApiError::invalid_param(
                    "messages",
                    format!("could not tokenize the conversation: {e:#}"),
                )
            })
    })
    .await
}

/// How a conversation's prompt ends: the assistant's turn opened
/// (`add_generation_prompt`, true by default) or the last message continued
/// (`continue_final_message`), not both, as vLLM asks.
pub(crate) fn chat_ending(
    add_generation_prompt: Option<bool>,
    continue_final_message: Option<bool>,
) -> Result<Ending, ApiError> {
    match (
        add_generation_prompt.unwrap_or(true),
        continue_final_message == Some(true),
    ) {
        (true, true) => Err(ApiError::invalid_param(
            "add_generation_prompt",
            "continue_final_message continues the last message: set add_generation_prompt to false",
        )),
        (false, true) => Ok(Ending::ContinueLast),
        (true, false) => Ok(Ending::NextTurn),
        (false, false) => Ok(Ending::Closed),
    }
}

/// `truncate_prompt_tokens`: keeps the last `k` tokens of the prompt (`-1`:
/// the model's context length); `None` keeps it whole.
pub(crate) fn truncate_prompt(
    state: &AppState,
    mut tokens: Vec<u32>,
    k: Option<i64>,
) -> Result<Vec<u32>, ApiError> {
    let keep = match k {
        None => return Ok(tokens),
        Some(-1) => state.engine().max_model_len(),
        Some(k) if k >= 1 => usize::try_from(k).unwrap_or(usize::MAX),
        Some(k) => {
            return Err(ApiError::invalid_param(
                "truncate_prompt_tokens",
                format!("truncate_prompt_tokens must be -1 or at least 1, got {k}"),
            ))
        }
    };
    if tokens.len() > keep {
        tokens.drain(..tokens.len() - keep);
    }
    Ok(tokens)
}

/// Validates token ids against the vocabulary.
pub(crate) fn check_token_ids(state: &AppState, ids: &[u32]) -> Result<(), ApiError> {
    if ids.is_empty() {
        return Err(ApiError::invalid_param(
            "prompt",
            "prompt must not be empty",
        ));
    }
    let vocab = state.engine().model_config().vocab_size;
    if let Some(bad) = ids.iter().find(|&&t| t as usize >= vocab) {
        return Err(ApiError::invalid_param(
            "prompt",
            format!("token id {bad} is out of range for a vocabulary of {vocab}"),
        ));
    }
    Ok(())
}

/// Validates the token ids of `logit_bias` and `stop_token_ids` against the
/// vocabulary, naming the field (the engine checks them too, without one).
pub(crate) fn check_sampling_ids(
    state: &AppState,
    params: &SamplingParams,
) -> Result<(), ApiError> {
    let vocab = state.engine().model_config().vocab_size;
    if let Some((bad, _)) = params.logit_bias.iter().find(|(t, _)| *t as usize >= vocab) {
        return Err(ApiError::invalid_param(
            "logit_bias",
            format!("logit_bias token id {bad} is out of range for a vocabulary of {vocab}"),
        ));
    }
    if let Some(bad) = params
        .allowed_token_ids
        .iter()
        .flatten()
        .find(|&&t| t as usize >= vocab)
    {
        return Err(ApiError::invalid_param(
            "allowed_token_ids",
            format!("allowed token id {bad} is out of range for a vocabulary of {vocab}"),
        ));
    }
    if let Some(bad) = params.stop_token_ids.iter().find(|&&t| t as usize >= vocab) {
        return Err(ApiError::invalid_param(
            "stop_token_ids",
            format!("stop token id {bad} is out of range for a vocabulary of {vocab}"),
        ));
    }
    Ok(())
}

/// Longest client-chosen request id, in bytes.
const MAX_REQUEST_ID_LEN: usize = 256;

/// The ids of a new request: the client's `X-Request-Id` header, else its
/// `request_id` body field, scoped to the client for the engine (see
/// [`crate::ids`]); else a fresh `{prefix}<hex>` id. The shown id is the
/// response's `id`, so `/abort_requests` can name the request.
pub(crate) fn choose_request_id(
    state: &AppState,
    headers: &HeaderMap,
    peer: Option<Extension<PeerAddr>>,
    body_id: Option<&str>,
    prefix: &str,
) -> Result<RequestIds, ApiError> {
    let (param, given) = match headers.get("x-request-id") {
        Some(v) => {
            let v = v.to_str().map_err(|_| {
                ApiError::invalid_param("X-Request-Id", "X-Request-Id must be visible ASCII")
            })?;
            ("X-Request-Id", Some(v))
        }
        None => ("request_id", body_id),
    };
    let Some(id) = given else {
        return Ok(RequestIds::made(state.next_request_id(prefix)));
    };
    if id.is_empty() || id.len() > MAX_REQUEST_ID_LEN {
        return Err(ApiError::invalid_param(
            param,
            format!(
                "{param} must be 1 to {MAX_REQUEST_ID_LEN} bytes long, got {}",
                id.len()
            ),
        ));
    }
    if id.chars().any(char::is_control) {
        return Err(ApiError::invalid_param(
            param,
            format!("{param} must not contain control characters"),
        ));
    }
    let sender = Sender {
        peer: peer.map(|Extension(PeerAddr(a))| a.ip()),
        authorization: headers
            .get(header::AUTHORIZATION)
            .map(HeaderValue::as_bytes),
        forwarded_for: headers.get("x-forwarded-for").map(HeaderValue::as_bytes),
    };
    Ok(state.scoped_request_id(id, &sender))
}

/// Whether the caller asked for each streamed event's token ids
/// ([`pdkv_relay::TOKEN_IDS_HEADER`]).
pub(crate) fn reports_token_ids(headers: &HeaderMap) -> bool {
    headers.contains_key(pdkv_relay::TOKEN_IDS_HEADER)
}

/// `POST /v1/completions`.
pub async fn completions(
    State(state): State<AppState>,
    headers: HeaderMap,
    peer: Option<Extension<PeerAddr>>,
    Screened(req): Screened<CompletionRequest>,
) -> Result<Response, ApiError> {
    let arrived = Instant::now();
    check_model(&state, req.model.as_deref())?;
    let ids = choose_request_id(&state, &headers, peer, req.request_id.as_deref(), "cmpl-")?;
    if req.suffix.as_deref().is_some_and(|s| !s.is_empty()) {
        return Err(ApiError::invalid_param("suffix", "suffix is not supported"));
    }
    // `max_tokens: 0` with `echo` scores the prompt (its log-probabilities)
    // without generating: one token is computed and left out of the answer.
    let score_only = req.max_tokens == Some(0);
    if score_only && (req.echo != Some(true) || req.stream == Some(true)) {
        return Err(ApiError::invalid_param(
            "max_tokens",
            "max_tokens 0 scores the prompt: it needs echo: true and no streaming",
        ));
    }
    let max_tokens = if score_only {
        1
    } else {
        parse_max_tokens("max_tokens", req.max_tokens)?.unwrap_or(DEFAULT_COMPLETION_MAX_TOKENS)
    };
    let n = parse_n(req.n, req.best_of)?;
    let fields = req.sampling();
    let mut params = fields.to_params(max_tokens, Endpoint::Completions)?;
    check_sampling_ids(&state, &params)?;
    crate::structured::constrain(&state, &fields, &mut params).await?;
    let echo = req.echo.unwrap_or(false);
    if echo && params.logprobs.is_some() {
        // The prompt's tokens are listed with their log-probabilities, as
        // vLLM does: prompt_logprobs at the same k unless asked otherwise.
        params.prompt_logprobs = params.prompt_logprobs.or(params.logprobs);
    }
    let prompts = parse_prompts(&req.prompt)?;
    if prompts.len() > 1 && !matches!(req.kv_transfer_params, None | Some(Value::Null)) {
        return Err(ApiError::invalid_param(
            "kv_transfer_params",
            "kv_transfer_params needs a single prompt (one transfer per request)",
        ));
    }
    let mut prepared = Vec::with_capacity(prompts.len());
    for given in prompts {
        prepared.push(prepare_prompt(&state, &req, given, &params, score_only).await?);
    }
    let model = state.served_model_name().to_string();
    let usage = StreamOptions::usage(req.stream_options.as_ref());
    if prepared.len() > 1 {
        if req.stream == Some(true) {
            let (group, views) =
                admit_prompts(&state, &ids.engine, prepared, params, arrived, n).await?;
            let group = Group::concat(ids.shown, group);
            return Ok(stream_completion(group, views, n, model, usage));
        }
        return batch_completion(&state, ids, prepared, params, arrived, n, model).await;
    }
    let (prompt, view) = prepared.pop().expect("one prompt");
    let kv = kv_params(req.kv_transfer_params, &ids.engine)?;
    if req.echo == Some(true) && kv.resume.is_some() {
        return Err(ApiError::invalid_param(
            "echo",
            "echo cannot be combined with kv_transfer_params.resume_token_ids (the prompt was sent already)",
        ));
    }
    let mut group = admit_group(&state, ids, prompt, params, kv, arrived, n).await?;
    group.report_token_ids = reports_token_ids(&headers);

    if req.stream.unwrap_or(false) {
        return Ok(stream_completion(group, vec![view], n, model, usage));
    }
    whole_completion(group, view, model).await
}

/// One prompt of a completions request, tokenized and checked, with how
/// its choices are shown.
async fn prepare_prompt(
    state: &AppState,
    req: &CompletionRequest,
    given: Prompt,
    params: &SamplingParams,
    score_only: bool,
) -> Result<(PromptIn, CompletionView), ApiError> {
    let tok = state.engine().tokenizer().clone();
    let (prompt_tokens, prompt_text) = match given {
        Prompt::Tokens(ids) => (ids, None),
        Prompt::Text(text) => {
            let tok = tok.clone();
            let add_special = req.add_special_tokens.unwrap_or(true);
            blocking(move || {
                tok.encode(&text, add_special)
                    .map(|ids| (ids, Some(text)))
                    .map_err(|e| {
                        ApiError::invalid_param(
                            "prompt",
                            format!("could not tokenize the prompt: {e:#}"),
                        )
                    })
            })
            .await?
        }
    };
    let prompt_tokens = truncate_prompt(state, prompt_tokens, req.truncate_prompt_tokens)?;
    check_token_ids(state, &prompt_tokens)?;
    // vLLM echoes a text prompt as given and a token prompt decoded.
    let echo_text = req
        .echo
        .unwrap_or(false)
        .then(|| prompt_text.unwrap_or_else(|| tok.decode(&prompt_tokens, false)));
    let view = CompletionView {
        tok,
        score_only,
        names: logprobs::Names::of(req.return_tokens_as_token_ids.unwrap_or(false)),
        logprobs: params.logprobs.is_some(),
        want_prompt_logprobs: req.prompt_logprobs.as_ref().is_some_and(|v| !v.is_null()),
        return_token_ids: req.return_token_ids.unwrap_or(false),
        prompt_tokens: prompt_tokens.clone(),
        echo_text,
    };
    Ok((PromptIn::new(prompt_tokens, req.cache_salt.clone())?, view))
}

/// Several prompts in one request, answered whole: each is its own group
/// (engine ids `{id}-p{k}`), all admitted before any is read so they run
/// together; choice `j` of prompt `k` has index `k * n + j`, and `usage`
/// adds up every prompt's.
async fn batch_completion(
    state: &AppState,
    ids: RequestIds,
    prepared: Vec<(PromptIn, CompletionView)>,
    params: SamplingParams,
    arrived: Instant,
    n: usize,
    model: String,
) -> Result<Response, ApiError> {
    let (groups, views) = admit_prompts(state, &ids.engine, prepared, params, arrived, n).await?;
    let id = ids.shown;
    let created = groups[0].created;
    let (mut choices, mut prompt_tokens, mut completion_tokens) = (Vec::new(), 0, 0);
    for (k, (mut group, view)) in groups.into_iter().zip(views).enumerate() {
        let done = group.collect().await?;
        for (j, c) in done.iter().enumerate() {
            let mut v = view.whole_choice(j, c);
            v["index"] = json!(k * n + j);
            choices.push(v);
        }
        prompt_tokens += group.num_prompt_tokens;
        if !view.score_only {
            completion_tokens += group.generated();
        }
    }
    let resp = json_response(&json!({
        "id": id,
        "object": "text_completion",
        "created": created,
        "model": model,
        "choices": choices,
        "usage": usage_json(prompt_tokens, completion_tokens),
    }));
    Ok(with_request_id(resp, &id))
}

/// Admits each prompt of a request as its own group (engine ids
/// `{id}-p{k}`), all before any is read so they run together.
async fn admit_prompts(
    state: &AppState,
    engine_id: &str,
    prepared: Vec<(PromptIn, CompletionView)>,
    params: SamplingParams,
    arrived: Instant,
    n: usize,
) -> Result<(Vec<Group>, Vec<CompletionView>), ApiError> {
    let (mut groups, mut views) = (Vec::new(), Vec::new());
    for (k, (prompt, view)) in prepared.into_iter().enumerate() {
        let g = admit_group(
            state,
            RequestIds::made(format!("{engine_id}-p{k}")),
            prompt,
            params.clone(),
            KvIn::default(),
            arrived,
            n,
        )
        .await?;
        groups.push(g);
        views.push(view);
    }
    Ok((groups, views))
}

/// A completion's choices as server-sent events: `n` per prompt, prompt
/// `k`'s shown by `views[k]` (choice `i` is prompt `i / n`'s).
fn stream_completion(
    group: Group,
    views: Vec<CompletionView>,
    n: usize,
    model: String,
    usage: StreamUsage,
) -> Response {
    let (id, created) = (group.id.clone(), group.created);
    let head = ChunkHead::of(&group, "text_completion", &model);
    let mut per_choice = vec![StreamedChoice::default(); group.n()];
    // Each prompt's log-probabilities, from its choice 0, shown by all.
    let mut shared_prompt_lp: Vec<Option<Vec<Option<TokenLogprobs>>>> = vec![None; views.len()];
    let chunk = move |i: usize, out: &RequestOutput, usage: bool| {
        let k = (i / n.max(1)).min(views.len() - 1);
        let view = &views[k];
        if out.prompt_logprobs.is_some() {
            shared_prompt_lp[k] = out.prompt_logprobs.clone();
        }
        let c = &mut per_choice[i];
        let first = !c.started;
        c.started = true;
        let mut choice = view.choice(
            i,
            out,
            first.then_some(shared_prompt_lp[k].as_deref()).flatten(),
            first,
            c.offset,
        );
        c.offset += view.offset_advance(out, first);
        let text_empty = choice["text"].as_str().is_some_and(str::is_empty);
        // The first piece carries the echoed prompt and prompt logprobs.
        let carries_prompt = first && (view.echo_text.is_some() || view.want_prompt_logprobs);
        let shows_tokens = view.logprobs || view.return_token_ids;
        if text_empty && out.finish_reason.is_none() && !carries_prompt && !shows_tokens {
            return None;
        }
        choice["finish_reason"] = json!(out.finish_reason.map(FinishReason::as_str));
        let mut v = json!({"id": id, "object": "text_completion", "created": created, "model": model, "choices": [choice]});
        if usage {
            v["usage"] = Value::Null;
        }
        Some(v)
    };
    let id = group.id.clone();
    with_request_id(sse_response(group, head, usage, Vec::new(), chunk), &id)
}

/// A completion's choices, whole, in one JSON answer.
async fn whole_completion(
    mut group: Group,
    view: CompletionView,
    model: String,
) -> Result<Response, ApiError> {
    let (done, choices) = group
        .collect_answers(|i, c| view.whole_choice(i, c))
        .await?;
    let kv_out = done[0].kv_transfer_params.clone();
    let resp = json_response(&json!({
        "id": group.id,
        "object": "text_completion",
        "created": group.created,
        "model": model,
        "choices": choices,
        "usage": usage_json(
            group.num_prompt_tokens,
            if view.score_only { 0 } else { group.generated() },
        ),
        "kv_transfer_params": kv_out,
    }));
    Ok(with_request_id(resp, &group.id))
}

/// How a completion's choices are shown: the options that shape them and
/// the prompt they may echo.
struct CompletionView {
    tok: Arc<Tokenizer>,
    /// `max_tokens: 0`: the generated token is left out (prompt scoring).
    score_only: bool,
    /// How log-probabilities name tokens (`return_tokens_as_token_ids`).
    names: logprobs::Names,
    logprobs: bool,
    /// The client asked for `prompt_logprobs` itself (not only through echo).
    want_prompt_logprobs: bool,
    return_token_ids: bool,
    prompt_tokens: Vec<u32>,
    /// The prompt as echoed, when `echo` is set.
    echo_text: Option<String>,
}

/// A streamed choice's progress.
#[derive(Clone, Default)]
struct StreamedChoice {
    started: bool,
    /// Characters of the text sent so far (`text_offset` of the next token).
    offset: usize,
}

impl CompletionView {
    /// A choice object for `out` (a whole choice or a stream's piece); on
    /// the `first` piece the echoed prompt leads. `prompt_lp` are the
    /// prompt log-probabilities (choice 0's), `offset` the text offset of
    /// the first token.
    fn choice(
        &self,
        index: usize,
        out: &RequestOutput,
        prompt_lp: Option<&[Option<TokenLogprobs>]>,
        first: bool,
        offset: usize,
    ) -> Value {
        let echo = self.echo_text.as_deref().filter(|_| first);
        let text = format!("{}{}", echo.unwrap_or(""), out.text);
        self.shape(
            index,
            text,
            &out.token_ids,
            &out.logprobs,
            prompt_lp,
            echo.is_some(),
            first,
            offset,
        )
    }

    #[allow(clippy::too_many_arguments)]
    fn shape(
        &self,
        index: usize,
        text: String,
        ids: &[u32],
        lps: &[TokenLogprobs],
        prompt_lp: Option<&[Option<TokenLogprobs>]>,
        echoed: bool,
        first: bool,
        offset: usize,
    ) -> Value {
        let mut choice =
            json!({"index": index, "text": text, "logprobs": null, "finish_reason": null});
        if self.logprobs {
            let mut all_ids = Vec::new();
            let mut entries: Vec<Option<&TokenLogprobs>> = Vec::new();
            if echoed {
                all_ids.extend_from_slice(&self.prompt_tokens);
                let prompt = prompt_lp.unwrap_or(&[]);
                entries.extend(
                    (0..self.prompt_tokens.len()).map(|p| prompt.get(p).and_then(Option::as_ref)),
                );
            }
            all_ids.extend_from_slice(ids);
            entries.extend(lps.iter().map(Some));
            choice["logprobs"] =
                logprobs::completion_logprobs(&self.tok, self.names, &all_ids, &entries, offset);
        }
        if first && self.want_prompt_logprobs {
            choice["prompt_logprobs"] =
                prompt_lp.map_or(Value::Null, |p| logprobs::prompt_logprobs(&self.tok, p));
        }
        if self.return_token_ids {
            if first {
                choice["prompt_token_ids"] = json!(self.prompt_tokens);
            }
            choice["token_ids"] = json!(ids);
        }
        choice
    }

    /// How far `out` (a stream's piece) moves the text offset.
    fn offset_advance(&self, out: &RequestOutput, first: bool) -> usize {
        if !self.logprobs {
            return 0;
        }
        let echoed = if first && self.echo_text.is_some() {
            logprobs::text_len(&self.tok, &self.prompt_tokens)
        } else {
            0
        };
        echoed + logprobs::text_len(&self.tok, &out.token_ids)
    }

    /// A whole (non-streamed) choice.
    fn whole_choice(&self, index: usize, c: &Choice) -> Value {
        let (out_text, out_ids, out_lps) = if self.score_only {
            ("", &[][..], &[][..])
        } else {
            (c.text.as_str(), &c.token_ids[..], &c.logprobs[..])
        };
        let text = format!("{}{}", self.echo_text.as_deref().unwrap_or(""), out_text);
        let prompt_lp = c.prompt_logprobs.as_deref();
        let echoed = self.echo_text.is_some();
        let mut v = self.shape(index, text, out_ids, out_lps, prompt_lp, echoed, true, 0);
        v["finish_reason"] = json!(c.finish_reason.unwrap_or(FinishReason::Abort).as_str());
        v
    }
}

/// `POST /v1/chat/completions`.
pub async fn chat_completions(
    State(state): State<AppState>,
    headers: HeaderMap,
    peer: Option<Extension<PeerAddr>>,
    Screened(req): Screened<ChatRequest>,
) -> Result<Response, ApiError> {
    let arrived = Instant::now();
    check_model(&state, req.model.as_deref())?;
    let ids = choose_request_id(
        &state,
        &headers,
        peer,
        req.request_id.as_deref(),
        "chatcmpl-",
    )?;
    let (messages, max_tokens) = check_chat_request(&state, &req)?;
    let ending = chat_ending(req.add_generation_prompt, req.continue_final_message)?;
    // vLLM's chat `echo`: an answer starts with the last message's text
    // when that message is the assistant's own (the role it answers in).
    let echo = messages
        .last()
        .filter(|m| req.echo == Some(true) && m.role == "assistant" && !m.content.is_empty())
        .map(|m| m.content.clone());
    // Validate sampling fields before the (costly) template and tokenizer
    // (`max_tokens` is settled below once the prompt's length is known).
    let n = parse_n(req.n, req.best_of)?;
    let fields = SamplingFields {
        structural_tag: req.structural_tag.clone(),
        ..req.sampling()
    };
    let mut params = fields.to_params(max_tokens.unwrap_or(u32::MAX), Endpoint::Chat)?;
    check_sampling_ids(&state, &params)?;
    crate::structured::constrain(&state, &fields, &mut params).await?;
    let tools = crate::tools::parse(
        req.tools.as_ref(),
        req.tool_choice.as_ref(),
        req.parallel_tool_calls.as_ref(),
        state.tool_parser(),
    )?;
    if let Some(spec) = tools.as_ref().and_then(crate::tools::Tools::spec) {
        crate::structured::constrain_with(&state, "tool_choice", spec, &mut params).await?;
    }
    let mut kwargs = req.chat_template_kwargs.clone().unwrap_or_default();
    if let Some(t) = &tools {
        kwargs.insert("tools".into(), t.listed.clone());
    }

    // The template already places BOS and other special tokens.
    let prompt_tokens = chat_prompt_tokens_with(
        &state,
        messages,
        ending,
        req.add_special_tokens.unwrap_or(false),
        kwargs,
    )
    .await?;
    let prompt_tokens = truncate_prompt(&state, prompt_tokens, req.truncate_prompt_tokens)?;
    check_token_ids(&state, &prompt_tokens)?;
    // Without a limit a chat reply may use the rest of the context.
    params.max_tokens = match max_tokens {
        Some(n) => n,
        None => {
            let room = state
                .engine()
                .max_model_len()
                .saturating_sub(prompt_tokens.len());
            u32::try_from(room.max(1)).unwrap_or(u32::MAX)
        }
    };
    let kv = kv_params(req.kv_transfer_params, &ids.engine)?;
    let return_token_ids = req.return_token_ids.unwrap_or(false);
    let view = ChatView {
        tok: state.engine().tokenizer().clone(),
        names: logprobs::Names::of(req.return_tokens_as_token_ids.unwrap_or(false)),
        top: params.logprobs.map(|k| k as usize),
        want_prompt_logprobs: params.prompt_logprobs.is_some(),
        return_token_ids,
        prompt_ids: return_token_ids.then(|| prompt_tokens.clone()),
        tools: tools.filter(crate::tools::Tools::reads_calls),
        echo,
    };
    let prompt = PromptIn::new(prompt_tokens, req.cache_salt.clone())?;
    let mut group = admit_group(&state, ids, prompt, params, kv, arrived, n).await?;
    group.report_token_ids = reports_token_ids(&headers);
    let model = state.served_model_name().to_string();

    if req.stream.unwrap_or(false) {
        let usage = StreamOptions::usage(req.stream_options.as_ref());
        return Ok(stream_chat(group, view, model, usage));
    }
    whole_chat(group, view, model).await
}

/// Checks a chat request's messages and options before its prompt is
/// built: its messages, and its `max_completion_tokens` (or `max_tokens`).
fn check_chat_request(
    state: &AppState,
    req: &ChatRequest,
) -> Result<(Vec<ChatMessage>, Option<u32>), ApiError> {
    if req.messages.is_empty() {
        return Err(ApiError::invalid_param(
            "messages",
            "messages must not be empty",
        ));
    }
    if state.engine().chat_template().is_none() {
        return Err(ApiError::invalid_param(
            "messages",
            "this model has no chat template; use /v1/completions with a plain prompt",
        )
        .with_code("no_chat_template"));
    }
    let messages = chat_messages(&req.messages)?;
    let max_tokens = match parse_max_tokens("max_completion_tokens", req.max_completion_tokens)? {
        Some(n) => Some(n),
        None => parse_max_tokens("max_tokens", req.max_tokens)?,
    };
    Ok((messages, max_tokens))
}

/// `GET /weight_sync/manifest` (open, as a publisher's manifest is: the
/// reads it describes need the deployment's KV secret): this engine's
/// complete weight-sync staging, for another engine to pull from. The reads
/// go to the host the caller reached this server by.
pub async fn weight_sync_manifest(State(state): State<AppState>, headers: HeaderMap) -> Response {
    let host = headers
        .get(header::HOST)
        .and_then(|h| h.to_str().ok())
        .map(|h| match h.rsplit_once(':') {
            // `host:port`, `[v6]:port`; a bare `[v6]` or name stays whole.
            Some((host, port)) if !port.is_empty() && port.bytes().all(|b| b.is_ascii_digit()) => {
                host.to_string()
            }
            _ => h.to_string(),
        });
    let Some(host) = host.filter(|h| !h.is_empty()) else {
        return ApiError::invalid("GET /weight_sync/manifest needs a Host header").into_response();
    };
    match state.weight_sync().relay_manifest(&host).await {
        Ok(v) => json_response(&v),
        Err(e) => e.into_response(),
    }
}

/// `GET /kv_transfer/info`: what the KV connector says about itself
/// (engine id, role, bootstrap address), for P/D proxies; 404 without one.
pub async fn kv_transfer_info(State(state): State<AppState>) -> Response {
    match state.engine().kv_connector_info() {
        Some(info) => json_response(info),
        None => ApiError::not_found("this server has no KV connector").into_response(),
    }
}

/// `GET /v1/models`.
pub async fn models(State(state): State<AppState>) -> Response {
    json_response(&json!({
        "object": "list",
        "data": [{
            "id": state.served_model_name(),
            "object": "model",
            "created": state.started_at(),
            "owned_by": "pdkv",
            "root": state.engine().model_name(),
            "parent": null,
            "max_model_len": state.engine().max_model_len(),
        }],
    }))
}

/// `GET /health`: 200 while the engine serves. While it is paused (in any
/// mode), asleep, without weights after a level-2 sleep, or stopped, it is a
/// 503 with `Retry-After` and the reason, so a router's health check steers
/// traffic to engines that serve. Meanwhile the generation routes answer
/// the same retryable 503 (paused `abort`/`wait`, asleep), or hold new
/// requests until `/resume` (paused `keep`) — never a wrong answer. So
/// `pause?mode=keep`, then waiting for the router to mark the engine
/// unhealthy, then sleeping, takes an engine out of a router's rotation
/// without losing a request.
pub async fn health(State(state): State<AppState>) -> Response {
    let st = crate::admin::lifecycle_status(&state);
    let refusal = state.engine().refusal();
    if refusal.is_none() && st.paused.is_none() && st.sleeping.is_none() {
        return StatusCode::OK.into_response();
    }
    let code = if state.engine().is_stopped() {
        "stopped"
    } else if st.sleeping.is_some() {
        "sleeping"
    } else if st.paused.is_some() {
        "paused"
    } else {
        "unavailable"
    };
    let reason = refusal
        .unwrap_or_else(|| "the engine is paused (keep): new requests wait for /resume".into());
    let mut resp = ApiError::unavailable(reason)
        .with_code(code)
        .into_response();
    resp.headers_mut()
        .insert(header::RETRY_AFTER, HeaderValue::from_static("1"));
    resp
}

/// `GET /metrics` in the Prometheus text format.
pub async fn metrics(State(state): State<AppState>) -> Response {
    let st = crate::admin::lifecycle_status(&state);
    let lifecycle = LifecycleGauges {
        sleep_level: st.sleeping.map(|l| l.as_u32()),
        paused: st.paused.is_some(),
        weights_discarded: st.weights_discarded,
        host_backup_bytes: state.engine().pool().host_backup_bytes(),
    };
    let stats = state.engine().stats();
    let device: Vec<_> = state
        .engine()
        .pool()
        .ranks()
        .iter()
        .map(|p| p.device_bytes())
        .collect();
    let connector = state.engine().kv_connector_metrics();
    let mut text = state
        .metrics()
        .render_with(&stats, &device, &lifecycle, &connector);
    state.weight_sync().render(&mut text);
    crate::structured::render(state.structured(), &mut text);
    (
        [(
            header::CONTENT_TYPE,
            "text/plain; version=0.0.4; charset=utf-8",
        )],
        text,
    )
        .into_response()
}

pub async fn not_found() -> ApiError {
    ApiError::not_found("no such route")
}

pub async fn method_not_allowed() -> ApiError {
    ApiError {
        status: StatusCode::METHOD_NOT_ALLOWED,
        ..ApiError::invalid("method not allowed on this route")
    }
}
