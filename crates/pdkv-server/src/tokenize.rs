//! vLLM's tokenizer endpoints and the version: `POST /tokenize` (a prompt
//! or a conversation to token ids), `POST /detokenize` (token ids to text)
//! and `GET /version`.

use axum::extract::State;
use axum::response::Response;
use serde::Deserialize;
use serde_json::json;

use crate::admit::json_response;
use crate::error::{ApiError, ApiJson};
use crate::openai::{chat_messages, ChatMessageIn};
use crate::routes::{blocking, chat_prompt_tokens, check_model};
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
}

/// The body of `POST /detokenize`.
#[derive(Debug, Deserialize)]
pub struct DetokenizeRequest {
    pub model: Option<String>,
    pub tokens: Vec<u32>,
}

/// `POST /tokenize`: `{"count", "max_model_len", "tokens", "token_strs"}`
/// (`token_strs` is null, as vLLM's default).
pub async fn tokenize(
    State(state): State<AppState>,
    ApiJson(req): ApiJson<TokenizeRequest>,
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
            let generation = req.add_generation_prompt.unwrap_or(true);
            chat_prompt_tokens(
                &state,
                messages,
                generation,
                req.add_special_tokens.unwrap_or(false),
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
    Ok(json_response(&json!({
        "count": tokens.len(),
        "max_model_len": state.engine().max_model_len(),
        "tokens": tokens,
        "token_strs": null,
    })))
}

/// `POST /detokenize`: `{"prompt": text}`, special tokens kept (as vLLM's).
pub async fn detokenize(
    State(state): State<AppState>,
    ApiJson(req): ApiJson<DetokenizeRequest>,
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
