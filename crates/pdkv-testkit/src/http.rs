//! HTTP clients for a running server: JSON posts, completions (streamed or
//! not), admin calls, and bounded waits on health and on `/metrics`.

use std::time::Instant;

use reqwest::StatusCode;
use serde_json::Value;

use crate::{sse, DEADLINE, POLL};

/// Posts `body` as JSON to `url`; returns the status and the JSON answer
/// (panics on a body that is not JSON).
pub async fn post_json(client: &reqwest::Client, url: &str, body: &Value) -> (StatusCode, Value) {
    answer(client.post(url).json(body)).await
}

/// Posts raw bytes as `application/json` to `url` (for malformed bodies).
pub async fn post_raw(client: &reqwest::Client, url: &str, body: Vec<u8>) -> (StatusCode, Value) {
    answer(
        client
            .post(url)
            .header("content-type", "application/json")
            .body(body),
    )
    .await
}

/// GETs `url`; returns the status and the JSON answer.
pub async fn get_json(client: &reqwest::Client, url: &str) -> (StatusCode, Value) {
    answer(client.get(url)).await
}

/// GETs `url`; returns the body's text (panics when the request fails).
pub async fn get_text(client: &reqwest::Client, url: &str) -> String {
    let resp = client.get(url).send().await.expect("send");
    resp.text().await.expect("body")
}

/// Posts to an admin route `base` + `path` (query included) with the bearer
/// `token`, and an optional JSON body.
pub async fn admin(
    client: &reqwest::Client,
    base: &str,
    path: &str,
    token: &str,
    body: Option<&Value>,
) -> (StatusCode, Value) {
    let mut req = client.post(format!("{base}{path}")).bearer_auth(token);
    if let Some(b) = body {
        req = req.json(b);
    }
    answer(req).await
}

/// Sends `req`; the response, whatever its status (panics when the request
/// fails).
pub async fn send(req: reqwest::RequestBuilder) -> reqwest::Response {
    req.send().await.expect("send")
}

/// A response's `Retry-After` header, when it has one.
pub fn retry_after(resp: &reqwest::Response) -> Option<&str> {
    resp.headers()
        .get("retry-after")
        .map(|v| v.to_str().expect("an ASCII Retry-After"))
}

/// Sends `req`; returns the status and the JSON answer (panics on a body
/// that is not JSON).
pub async fn answer(req: reqwest::RequestBuilder) -> (StatusCode, Value) {
    let resp = req.send().await.expect("send");
    let status = resp.status();
    let text = resp.text().await.expect("body");
    let v = serde_json::from_str(&text)
        .unwrap_or_else(|e| panic!("{status}: non-JSON body ({e}): {text:?}"));
    (status, v)
}

/// The text of a `/v1/completions` or `/v1/chat/completions` answer from
/// `base` + `path`, streamed (SSE, when `body.stream` is true) or not; the
/// status and the body of anything else.
pub async fn generate(
    client: &reqwest::Client,
    base: &str,
    path: &str,
    body: &Value,
) -> Result<String, (u16, String)> {
    let resp = client
        .post(format!("{base}{path}"))
        .json(body)
        .send()
        .await
        .map_err(|e| (0, e.to_string()))?;
    let status = resp.status().as_u16();
    let text = resp.text().await.map_err(|e| (status, e.to_string()))?;
    if status != 200 {
        return Err((status, text));
    }
    if body["stream"].as_bool() != Some(true) {
        let v: Value = serde_json::from_str(&text).map_err(|e| (status, format!("{e}: {text}")))?;
        return Ok(sse::choice_text(&v));
    }
    sse::stream_text(&text).map_err(|e| (status, e.to_string()))
}

/// [`generate`] on `/v1/completions`.
pub async fn complete(
    client: &reqwest::Client,
    base: &str,
    body: &Value,
) -> Result<String, (u16, String)> {
    generate(client, base, "/v1/completions", body).await
}

/// The text of `base`'s `/metrics`.
pub async fn metrics(client: &reqwest::Client, base: &str) -> String {
    get_text(client, &format!("{base}/metrics")).await
}

/// Polls `url` until it answers 2xx, bounded by [`DEADLINE`].
pub async fn wait_healthy(client: &reqwest::Client, url: &str) {
    let deadline = Instant::now() + DEADLINE;
    loop {
        if let Ok(r) = client.get(url).send().await {
            if r.status().is_success() {
                return;
            }
        }
        assert!(Instant::now() < deadline, "{url} never became healthy");
        tokio::time::sleep(POLL).await;
    }
}

/// Polls `base`'s `/metrics` until `pred` holds, bounded by [`DEADLINE`];
/// returns the text that satisfied it.
pub async fn wait_metrics(
    client: &reqwest::Client,
    base: &str,
    what: &str,
    pred: impl Fn(&str) -> bool,
) -> String {
    let deadline = Instant::now() + DEADLINE;
    loop {
        let text = metrics(client, base).await;
        if pred(&text) {
            return text;
        }
        assert!(
            Instant::now() < deadline,
            "{base}: {what} never held; metrics:\n{text}"
        );
        tokio::time::sleep(POLL).await;
    }
}

/// An OpenAI-shaped error answer: the status wanted, and an `error` object
/// with a message, a type, and `param` and `code` present.
pub fn assert_openai_error(status: StatusCode, body: &Value, want: StatusCode, ctx: &str) {
    assert_eq!(status, want, "{ctx}: {body}");
    let err = &body["error"];
    assert!(
        err["message"].as_str().is_some_and(|m| !m.is_empty()),
        "{ctx}: {body}"
    );
    assert!(err["type"].is_string(), "{ctx}: {body}");
    assert!(
        err.get("param").is_some() && err.get("code").is_some(),
        "{ctx}: {body}"
    );
}

/// An error answer of status `want` whose `error.code` is `code`.
pub fn assert_error_code(status: StatusCode, body: &Value, want: StatusCode, code: &str) {
    assert_eq!(
        (status, body["error"]["code"].as_str()),
        (want, Some(code)),
        "{body}"
    );
}

/// The `error.message` of an error answer (panics when it has none).
pub fn error_message(body: &Value) -> &str {
    body["error"]["message"]
        .as_str()
        .unwrap_or_else(|| panic!("no error message: {body}"))
}

/// A JSON list of token ids (`token_ids`, `prompt_token_ids`, `tokens`)
/// as numbers (panics on anything else).
pub fn token_ids(v: &Value) -> Vec<u64> {
    v.as_array()
        .unwrap_or_else(|| panic!("not a list: {v}"))
        .iter()
        .map(|t| t.as_u64().unwrap_or_else(|| panic!("not a token id: {t}")))
        .collect()
}
