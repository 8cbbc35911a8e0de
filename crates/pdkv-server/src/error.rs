//! OpenAI-style errors and the JSON body extractor that produces them.
//!
//! Every failure a client can cause is answered with
//! `{"error":{"message":..,"type":..,"param":..,"code":..}}` and a 4xx status;
//! axum's default plain-text rejections never reach a client because
//! [`ApiJson`] replaces the stock `Json` extractor and the router installs
//! JSON fallbacks for unknown paths and methods.

use axum::body::Bytes;
use axum::extract::rejection::BytesRejection;
use axum::extract::{FromRequest, Request};
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use pdkv_engine::{AddRequestError, LifecycleError};
use serde::de::DeserializeOwned;
use serde::Serialize;

/// An error and its sources on one line, `a: b: c`, a source left out
/// where the text before it already says it.
pub fn error_chain(e: &dyn std::error::Error) -> String {
    let mut s = e.to_string();
    let mut src = e.source();
    while let Some(cause) = src {
        let c = cause.to_string();
        if !s.contains(&c) {
            s.push_str(": ");
            s.push_str(&c);
        }
        src = cause.source();
    }
    s
}

/// An error as the OpenAI API reports it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ApiError {
    pub status: StatusCode,
    pub message: String,
    /// `invalid_request_error`, `not_found_error`, `service_unavailable_error`, `server_error`.
    pub kind: &'static str,
    /// The request field at fault, when one is.
    pub param: Option<String>,
    pub code: Option<&'static str>,
}

#[derive(Serialize)]
struct ErrorBody<'a> {
    error: ErrorDetail<'a>,
}

#[derive(Serialize)]
struct ErrorDetail<'a> {
    message: &'a str,
    #[serde(rename = "type")]
    kind: &'a str,
    param: Option<&'a str>,
    code: Option<&'a str>,
}

impl ApiError {
    /// A 400 `invalid_request_error`.
    pub fn invalid(message: impl Into<String>) -> ApiError {
        ApiError {
            status: StatusCode::BAD_REQUEST,
            message: message.into(),
            kind: "invalid_request_error",
            param: None,
            code: None,
        }
    }

    /// A 400 `invalid_request_error` about one field.
    pub fn invalid_param(param: &str, message: impl Into<String>) -> ApiError {
        ApiError {
            param: Some(param.to_string()),
            ..ApiError::invalid(message)
        }
    }

    pub fn not_found(message: impl Into<String>) -> ApiError {
        ApiError {
            status: StatusCode::NOT_FOUND,
            message: message.into(),
            kind: "not_found_error",
            param: None,
            code: None,
        }
    }

    pub fn model_not_found(requested: &str) -> ApiError {
        ApiError {
            param: Some("model".to_string()),
            code: Some("model_not_found"),
            ..ApiError::not_found(format!("The model `{requested}` does not exist."))
        }
    }

    pub fn unavailable(message: impl Into<String>) -> ApiError {
        ApiError {
            status: StatusCode::SERVICE_UNAVAILABLE,
            message: message.into(),
            kind: "service_unavailable_error",
            param: None,
            code: None,
        }
    }

    /// A 401: the admin API needs `Authorization: Bearer <token>`.
    pub fn unauthorized(message: impl Into<String>) -> ApiError {
        ApiError {
            status: StatusCode::UNAUTHORIZED,
            message: message.into(),
            kind: "authentication_error",
            param: None,
            code: Some("invalid_api_key"),
        }
    }

    /// A 409: the request conflicts with the engine's current state.
    pub fn conflict(message: impl Into<String>) -> ApiError {
        ApiError {
            status: StatusCode::CONFLICT,
            message: message.into(),
            kind: "conflict_error",
            param: None,
            code: None,
        }
    }

    /// 504: a deadline passed (the message names the setting to raise).
    pub fn timeout(message: impl Into<String>) -> ApiError {
        ApiError {
            status: StatusCode::GATEWAY_TIMEOUT,
            message: message.into(),
            kind: "timeout_error",
            param: None,
            code: Some("timeout"),
        }
    }

    pub fn internal(message: impl Into<String>) -> ApiError {
        ApiError {
            status: StatusCode::INTERNAL_SERVER_ERROR,
            message: message.into(),
            kind: "server_error",
            param: None,
            code: None,
        }
    }

    pub fn with_code(mut self, code: &'static str) -> ApiError {
        self.code = Some(code);
        self
    }

    /// The JSON body, as sent to clients (also used inside SSE streams).
    pub fn body_json(&self) -> String {
        let body = ErrorBody {
            error: ErrorDetail {
                message: &self.message,
                kind: self.kind,
                param: self.param.as_deref(),
                code: self.code,
            },
        };
        serde_json::to_string(&body).unwrap_or_else(|_| String::from("{\"error\":{}}"))
    }
}

impl std::fmt::Display for ApiError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "{} ({}): {}",
            self.status.as_u16(),
            self.kind,
            self.message
        )
    }
}

impl std::error::Error for ApiError {}

/// The code of a 503 that clears by itself (paused, asleep, weights being
/// reloaded): such responses carry `Retry-After`. Defined with the relay
/// plan, which decides on it.
pub use pdkv_relay::RETRYABLE_CODE;

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let body = self.body_json();
        let mut resp = (
            self.status,
            [(axum::http::header::CONTENT_TYPE, "application/json")],
            body,
        )
            .into_response();
        if self.code == Some(RETRYABLE_CODE) {
            resp.headers_mut().insert(
                axum::http::header::RETRY_AFTER,
                axum::http::HeaderValue::from_static("1"),
            );
        }
        resp
    }
}

impl From<AddRequestError> for ApiError {
    fn from(e: AddRequestError) -> ApiError {
        let message = e.to_string();
        match e {
            AddRequestError::TooLong { .. } | AddRequestError::ExceedsKvCapacity { .. } => {
                ApiError::invalid_param("prompt", message).with_code("context_length_exceeded")
            }
            AddRequestError::Invalid(_) => ApiError::invalid(message),
            // Ids can come from clients (`X-Request-Id`, `request_id`).
            AddRequestError::DuplicateId(_) => {
                ApiError::conflict(message).with_code("duplicate_request_id")
            }
            AddRequestError::Stopped => ApiError::unavailable(message),
            AddRequestError::Unavailable(_) => {
                ApiError::unavailable(message).with_code(RETRYABLE_CODE)
            }
        }
    }
}

impl From<LifecycleError> for ApiError {
    fn from(e: LifecycleError) -> ApiError {
        let message = e.to_string();
        match e {
            LifecycleError::Conflict(_) => ApiError::conflict(message),
            LifecycleError::Cancelled(_) => ApiError::conflict(message).with_code("cancelled"),
            LifecycleError::Invalid(_) => ApiError::invalid(message),
            LifecycleError::IncompatibleWeights(_) => {
                ApiError::invalid(message).with_code("incompatible_weights")
            }
            LifecycleError::Timeout(_) => ApiError::timeout(message),
            LifecycleError::Stopped => ApiError::unavailable(message),
            LifecycleError::Internal(_) => ApiError::internal(message),
        }
    }
}

/// A JSON request body parsed with errors in the OpenAI shape: malformed JSON,
/// wrong types and missing fields become 400s naming the field, an oversize
/// body a 413.
pub struct ApiJson<T>(pub T);

impl<S, T> FromRequest<S> for ApiJson<T>
where
    S: Send + Sync,
    T: DeserializeOwned,
{
    type Rejection = ApiError;

    async fn from_request(req: Request, state: &S) -> Result<Self, Self::Rejection> {
        let bytes = Bytes::from_request(req, state)
            .await
            .map_err(body_rejection)?;
        parse_json(&bytes).map(ApiJson)
    }
}

/// The deepest nesting of arrays and objects a request body may have. The
/// same bound on engines and the proxy (which must parse a whole body to
/// rewrite it, where a typed parse skips unknown fields), and below the
/// JSON parser's own recursion limit, so every server answers the same.
pub const MAX_JSON_DEPTH: usize = 100;

/// How deep `bytes` nests arrays and objects (outside strings), stopping
/// early once past `limit`.
fn json_depth(bytes: &[u8], limit: usize) -> usize {
    let (mut depth, mut deepest, mut in_string, mut escaped) = (0usize, 0usize, false, false);
    for &b in bytes {
        if in_string {
            match b {
                _ if escaped => escaped = false,
                b'\\' => escaped = true,
                b'"' => in_string = false,
                _ => {}
            }
            continue;
        }
        match b {
            b'"' => in_string = true,
            b'[' | b'{' => {
                depth += 1;
                deepest = deepest.max(depth);
                if deepest > limit {
                    return deepest;
                }
            }
            b']' | b'}' => depth = depth.saturating_sub(1),
            _ => {}
        }
    }
    deepest
}

/// Parses `bytes` as `T`, naming the offending field on type errors.
pub fn parse_json<T: DeserializeOwned>(bytes: &[u8]) -> Result<T, ApiError> {
    if json_depth(bytes, MAX_JSON_DEPTH) > MAX_JSON_DEPTH {
        return Err(ApiError::invalid(format!(
            "request body nests arrays and objects deeper than {MAX_JSON_DEPTH} levels"
        )));
    }
    let de = &mut serde_json::Deserializer::from_slice(bytes);
    match serde_path_to_error::deserialize::<_, T>(de) {
        Ok(v) => Ok(v),
        Err(e) => {
            let path = e.path().to_string();
            let inner = e.into_inner();
            let message = if inner.is_syntax() || inner.is_eof() {
                format!("request body is not valid JSON: {inner}")
            } else {
                format!("invalid request body: {inner}")
            };
            let mut err = ApiError::invalid(message);
            // A path of "." means the error is about the document as a whole.
            if path != "." && !inner.is_syntax() && !inner.is_eof() {
                err.param = Some(path);
            }
            Err(err)
        }
    }
}

/// A body that could not be read (over the size limit: a 413), as an
/// OpenAI-shaped error.
pub fn body_rejection(r: BytesRejection) -> ApiError {
    let status = r.status();
    if status == StatusCode::PAYLOAD_TOO_LARGE {
        ApiError {
            status,
            message: "request body is too large".to_string(),
            kind: "invalid_request_error",
            param: None,
            code: Some("request_too_large"),
        }
    } else {
        ApiError {
            status,
            ..ApiError::invalid(format!(
                "could not read the request body: {}",
                r.body_text()
            ))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Each source follows its error after `: `, unless the text so far
    /// already holds it (an error that prints its cause itself).
    #[test]
    fn an_error_chain_names_each_source_once() {
        #[derive(Debug)]
        struct E(&'static str, Option<Box<E>>);
        impl std::fmt::Display for E {
            fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.write_str(self.0)
            }
        }
        impl std::error::Error for E {
            fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
                self.1.as_deref().map(|e| e as _)
            }
        }
        let refused = E("connection refused", None);
        let e = E("connecting to 127.0.0.1:9", Some(Box::new(refused)));
        assert_eq!(
            error_chain(&e),
            "connecting to 127.0.0.1:9: connection refused"
        );
        let said = E("connect failed: connection refused", None);
        let e = E(
            "request failed",
            Some(Box::new(E(
                "connect failed: connection refused",
                Some(Box::new(said)),
            ))),
        );
        assert_eq!(
            error_chain(&e),
            "request failed: connect failed: connection refused"
        );
    }

    #[test]
    fn the_relay_plans_errors_have_the_openai_shape() {
        let ours: serde_json::Value = serde_json::from_str(&pdkv_relay::plan::error_json(
            "m",
            "server_error",
            "upstream_error",
        ))
        .unwrap();
        let api = ApiError {
            status: axum::http::StatusCode::BAD_GATEWAY,
            message: "m".into(),
            kind: "server_error",
            param: None,
            code: Some("upstream_error"),
        };
        assert_eq!(
            ours,
            serde_json::from_str::<serde_json::Value>(&api.body_json()).unwrap()
        );
    }

    #[test]
    fn nesting_is_measured_outside_strings_only() {
        assert_eq!(json_depth(br#"{"a": [1, {"b": []}]}"#, 100), 4);
        assert_eq!(json_depth(br#"{"a": "[[[[{{{{", "b": "\"[["}"#, 100), 1);
        assert_eq!(json_depth(b"1", 100), 0);
        let deep = format!("{}{}", "[".repeat(150), "]".repeat(150));
        assert_eq!(
            json_depth(deep.as_bytes(), 100),
            101,
            "stops once past the limit"
        );
        let err = parse_json::<serde_json::Value>(deep.as_bytes()).unwrap_err();
        assert!(
            err.message.contains("deeper than 100 levels"),
            "{}",
            err.message
        );
        let ok = format!("{}{}", "[".repeat(100), "]".repeat(100));
        assert!(parse_json::<serde_json::Value>(ok.as_bytes()).is_ok());
    }
    use serde::Deserialize;

    #[derive(Debug, Deserialize)]
    struct Body {
        #[allow(dead_code)]
        max_tokens: Option<u32>,
        #[allow(dead_code)]
        prompt: String,
    }

    #[test]
    fn type_errors_name_the_field() {
        let err = parse_json::<Body>(br#"{"prompt":"a","max_tokens":"x"}"#).unwrap_err();
        assert_eq!(err.status, StatusCode::BAD_REQUEST);
        assert_eq!(err.param.as_deref(), Some("max_tokens"));
        let missing = parse_json::<Body>(br#"{"max_tokens":3}"#).unwrap_err();
        assert!(missing.message.contains("prompt"), "{}", missing.message);
    }

    #[test]
    fn syntax_errors_are_400_without_param() {
        let err = parse_json::<Body>(b"{\"prompt\":").unwrap_err();
        assert_eq!(err.status, StatusCode::BAD_REQUEST);
        assert_eq!(err.param, None);
        assert!(err.message.contains("not valid JSON"));
        let v: serde_json::Value = serde_json::from_str(&err.body_json()).unwrap();
        assert_eq!(v["error"]["type"], "invalid_request_error");
    }

    #[test]
    fn engine_errors_map_to_statuses() {
        let too_long: ApiError = AddRequestError::TooLong {
            prompt: 10,
            max_tokens: 5,
            max_model_len: 12,
        }
        .into();
        assert_eq!(too_long.status, StatusCode::BAD_REQUEST);
        let stopped: ApiError = AddRequestError::Stopped.into();
        assert_eq!(stopped.status, StatusCode::SERVICE_UNAVAILABLE);
        let dup: ApiError = AddRequestError::DuplicateId("x".into()).into();
        assert_eq!(dup.status, StatusCode::CONFLICT);
    }

    #[test]
    fn lifecycle_errors_map_to_statuses() {
        let cases: Vec<(LifecycleError, StatusCode)> = vec![
            (
                LifecycleError::Conflict("not paused".into()),
                StatusCode::CONFLICT,
            ),
            (
                LifecycleError::Cancelled("resumed".into()),
                StatusCode::CONFLICT,
            ),
            (
                LifecycleError::Invalid("bad".into()),
                StatusCode::BAD_REQUEST,
            ),
            (
                LifecycleError::IncompatibleWeights("shape".into()),
                StatusCode::BAD_REQUEST,
            ),
            (
                LifecycleError::Timeout("pause".into()),
                StatusCode::GATEWAY_TIMEOUT,
            ),
            (LifecycleError::Stopped, StatusCode::SERVICE_UNAVAILABLE),
            (
                LifecycleError::Internal("mmap".into()),
                StatusCode::INTERNAL_SERVER_ERROR,
            ),
        ];
        for (e, want) in cases {
            let text = e.to_string();
            let api: ApiError = e.into();
            assert_eq!(api.status, want, "{text}");
            assert_eq!(api.message, text);
        }
    }
}
