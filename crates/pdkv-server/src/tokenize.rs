//! vLLM's tokenizer endpoints and the version: `POST /tokenize` (a prompt
//! or a conversation to token ids), `POST /detokenize` (token ids to text)
//! and `GET /version`.

use axum::extract::State;
use axum::response::Response;
use serde::Deserialize;
use serde_json::{json, Value};

use crate::admit::json_response;
use crate::error::ApiError;
use crate::fields::{Body, Screen, Screened};
use crate::openai::{chat_messages, ChatMessageIn};
use crate::routes::{blocking, chat_ending, chat_prompt_tokens_with, check_model};
use crate::AppState;

/// The body of `POST /tokenize`: exactly one of `prompt` and `messages`.
#[derive(Debug, Deserialize)]
pub struct TokenizeRequest {
    pub model: Option<String>,
    pub prompt: Option<String>,
    pub messages: Option<Vec<ChatMessageIn>>,
    /// Let the tokenizer add BOS and the like (default: true for a prompt,
    /// false for a conversation, whose template places them, as in vLLM).
    pub add_special_tokens: Option<bool>,
    /// Conversations only: end with the assistant's turn opening (default true).
    pub add_generation_prompt: Option<bool>,
    /// Conversations only: end inside the last message, as chat
    /// completions do with it.
    pub continue_final_message: Option<bool>,
    /// Also list each token's vocabulary string (`token_strs`).
    pub return_token_strs: Option<bool>,
    /// Conversations only (a prompt ignores it, as vLLM's does): extra
    /// variables for the chat template.
    pub chat_template_kwargs: Option<serde_json::Map<String, Value>>,
    /// Conversations only (likewise): the tools the template lists.
    pub tools: Option<Value>,
}

impl Screen for TokenizeRequest {
    const BODY: Body = Body::Tokenize;
}

/// The body of `POST /detokenize`.
#[derive(Debug, Deserialize)]
pub struct DetokenizeRequest {
    pub model: Option<String>,
    pub tokens: Vec<u32>,
}

impl Screen for DetokenizeRequest {
    const BODY: Body = Body::Detokenize;
}

/// `POST /tokenize`: `{"count", "max_model_len", "tokens", "token_strs"}`
/// (`token_strs` null unless `return_token_strs`, as in vLLM).
pub async fn tokenize(
    State(state): State<AppState>,
    Screened(req): Screened<TokenizeRequest>,
) -> Result<Response, ApiError> {
    check_model(&state, req.model.as_deref())?;
    let tokens = match (req.prompt, req.messages) {
        (Some(prompt), None) => {
            let tok = state.engine().tokenizer().clone();
            let special = req.add_special_tokens.unwrap_or(true);
            blocking(move || {
                tok.encode(&prompt, special).map_err(|e| {
                    ApiError::invalid_param(
                        "prompt",
                        format!("could not tokenize the prompt: {e:#}"),
                    )
                })
            })
            .await?
        }
        (None, Some(messages)) => {
            if state.engine().chat_template().is_none() {
                return Err(ApiError::invalid_param(
                    "messages",
                    "this model has no chat template",
                ));
            }
            let messages = chat_messages(&messages)?;
            let ending = chat_ending(req.add_generation_prompt, req.continue_final_message)?;
            let mut kwargs = req.chat_template_kwargs.unwrap_or_default();
            // Listed for the template as chat completions list them.
            let none = json!("none");
            if let Some(t) = crate::tools::parse(req.tools.as_ref(), Some(&none), None, None)? {
                kwargs.insert("tools".into(), t.listed);
            }
            chat_prompt_tokens_with(
                &state,
                messages,
                ending,
                req.add_special_tokens.unwrap_or(false),
                kwargs,
            )
            .await?
        }
        (Some(_), Some(_)) => {
            return Err(ApiError::invalid(
                "give either `prompt` or `messages`, not both",
            ))
        }
        (None, None) => {
            return Err(ApiError::invalid_param(
                "prompt",
                "`prompt` or `messages` is required",
            ))
        }
    };
    let token_strs = req.return_token_strs.unwrap_or(false).then(|| {
        let tok = state.engine().tokenizer();
        tokens
            .iter()
            .map(|&id| tok.id_to_token(id))
            .collect::<Vec<_>>()
    });
    Ok(json_response(&json!({
        "count": tokens.len(),
        "max_model_len": state.engine().max_model_len(),
        "tokens": tokens,
        "token_strs": token_strs,
    })))
}

/// `POST /detokenize`: `{"prompt": text}`, special tokens kept (as vLLM's).
pub async fn detokenize(
    State(state): State<AppState>,
    Screened(req): Screened<DetokenizeRequest>,
) -> Result<Response, ApiError> {
    check_model(&state, req.model.as_deref())?;
    let vocab = state.engine().model_config().vocab_size;
    if let Some(bad) = req.tokens.iter().find(|&&t| t as usize >= vocab) {
        return Err(ApiError::invalid_param(
            "tokens",
            format!("token id {bad} is out of range for a vocabulary of {vocab}"),
        ));
    }
    let tok = state.engine().tokenizer().clone();
    let text = blocking(move || Ok(tok.decode(&req.tokens, false))).await?;
    Ok(json_response(&json!({"prompt": text})))
}

/// `GET /version`: the server's crate version.
pub async fn version() -> Response {
    json_response(&json!({"version": env!("CARGO_PKG_VERSION")}))
}
