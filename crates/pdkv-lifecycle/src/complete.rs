//! The completion client of the load and the probes: one `/v1/completions`
//! request, its JSON body or its event stream (SSE) read to the end, or left
//! after the first event on purpose; how it ended, as the client saw it.

use serde_json::Value;

use crate::bounds::REQUEST_DEADLINE;

/// How one completion request ended, as the client saw it.
#[derive(Debug, Default)]
pub(crate) struct Reply {
    pub(crate) status: u16,
    pub(crate) retry_after: bool,
    pub(crate) text: String,
    pub(crate) finish: Option<String>,
    /// The error object of an error body or an SSE error event.
    pub(crate) error: Option<Value>,
    /// The answer was an event stream.
    pub(crate) streamed: bool,
    /// Streams: `[DONE]` arrived.
    pub(crate) done: bool,
    /// The client left after the first event, as asked.
    pub(crate) disconnected: bool,
    /// No usable answer (transport error, malformed body), with why.
    pub(crate) broken: Option<String>,
}

/// Posts a completion; with `leave_early`, a stream is dropped after its
/// first event.
pub(crate) async fn complete(
    client: &reqwest::Client,
    url: &str,
    body: &Value,
    id: Option<&str>,
    leave_early: bool,
) -> Reply {
    let mut req = client.post(url).json(body).timeout(REQUEST_DEADLINE);
    if let Some(id) = id {
        req = req.header("x-request-id", id);
    }
    let mut resp = match req.send().await {
        Ok(r) => r,
        Err(e) => {
            return Reply {
                broken: Some(format!("sending: {e}")),
                ..Reply::default()
            }
        }
    };
    let mut reply = Reply {
        status: resp.status().as_u16(),
        retry_after: resp.headers().contains_key(reqwest::header::RETRY_AFTER),
        ..Reply::default()
    };
    let streaming = body["stream"].as_bool() == Some(true);
    if reply.status != 200 || !streaming {
        let text = match resp.text().await {
            Ok(t) => t,
            Err(e) => {
                reply.broken = Some(format!("reading the body: {e}"));
                return reply;
            }
        };
        match serde_json::from_str::<Value>(&text) {
            Ok(v) if v.get("error").is_some() => reply.error = Some(v["error"].clone()),
            Ok(v) => {
                reply.text = v["choices"][0]["text"]
                    .as_str()
                    .unwrap_or_default()
                    .to_string();
                reply.finish = v["choices"][0]["finish_reason"]
                    .as_str()
                    .map(str::to_string);
            }
            Err(_) => reply.broken = Some(format!("a body that is not JSON: {}", text.trim())),
        }
        return reply;
    }
    reply.streamed = true;
    let mut buf = String::new();
    loop {
        let chunk = match resp.chunk().await {
            Ok(Some(c)) => c,
            Ok(None) => break,
            Err(e) => {
                reply.broken = Some(format!("the stream broke: {e}"));
                return reply;
            }
        };
        buf.push_str(&String::from_utf8_lossy(&chunk));
        while let Some(end) = buf.find("\n\n") {
            let event: String = buf.drain(..end + 2).collect();
            let Some(data) = event.trim_end().strip_prefix("data: ") else {
                reply.broken = Some(format!("a malformed event {event:?}"));
                return reply;
            };
            if data == "[DONE]" {
                reply.done = true;
                continue;
            }
            let v: Value = match serde_json::from_str(data) {
                Ok(v) => v,
                Err(e) => {
                    reply.broken = Some(format!("an event that is not JSON ({e}): {data}"));
                    return reply;
                }
            };
            if let Some(err) = v.get("error") {
                reply.error = Some(err.clone());
                continue;
            }
            if let Some(choice) = v["choices"].get(0) {
                reply
                    .text
                    .push_str(choice["text"].as_str().unwrap_or_default());
                if let Some(f) = choice["finish_reason"].as_str() {
                    reply.finish = Some(f.to_string());
                }
            }
            if leave_early {
                reply.disconnected = true;
                return reply;
            }
        }
    }
    if !buf.trim().is_empty() {
        reply.broken = Some(format!("the stream ended inside an event: {buf:?}"));
    }
    reply
}
