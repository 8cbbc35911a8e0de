//! Server-sent event streams as pdkv (and OpenAI) send them: `data: JSON`
//! events separated by a blank line, closed by `data: [DONE]`.

use futures::stream::{BoxStream, StreamExt};
use serde_json::Value;

use crate::DEADLINE;

/// Reads a streamed answer one event at a time, as it arrives; every wait
/// for the next piece is bounded by [`DEADLINE`].
pub struct Reader {
    body: BoxStream<'static, reqwest::Result<Vec<u8>>>,
    buf: Vec<u8>,
}

impl Reader {
    pub fn new(resp: reqwest::Response) -> Reader {
        Reader {
            body: resp.bytes_stream().map(|r| r.map(|b| b.to_vec())).boxed(),
            buf: Vec::new(),
        }
    }

    /// The next event's `data:` payload (`[DONE]` included); `None` at the
    /// end of the body. Panics on an event that is not a data event and on
    /// a body that ends inside an event.
    pub async fn next(&mut self) -> Option<String> {
        loop {
            if let Some(i) = self.buf.windows(2).position(|w| w == b"\n\n") {
                let event: Vec<u8> = self.buf.drain(..i + 2).collect();
                let text = String::from_utf8(event).expect("a UTF-8 event");
                let data = text
                    .trim_end()
                    .strip_prefix("data: ")
                    .unwrap_or_else(|| panic!("not a data event: {text:?}"));
                return Some(data.to_string());
            }
            let chunk = tokio::time::timeout(DEADLINE, self.body.next())
                .await
                .expect("the next piece of the stream in time");
            match chunk {
                Some(c) => self.buf.extend_from_slice(&c.expect("a body chunk")),
                None => {
                    assert!(
                        self.buf.is_empty(),
                        "stream ended inside an event: {:?}",
                        String::from_utf8_lossy(&self.buf)
                    );
                    return None;
                }
            }
        }
    }

    /// The next payload as JSON; panics at the end, on `[DONE]` or on a
    /// payload that is not JSON.
    pub async fn next_json(&mut self) -> Value {
        let p = self.next().await.expect("an event");
        serde_json::from_str(&p).unwrap_or_else(|e| panic!("bad event ({e}): {p}"))
    }

    /// Every payload left, to the end of the body.
    pub async fn rest(&mut self) -> Vec<String> {
        let mut out = Vec::new();
        while let Some(e) = self.next().await {
            out.push(e);
        }
        out
    }
}

/// The `data:` payloads of a whole stream, `[DONE]` included; panics on an
/// event that is not a data event or a stream not ending in a blank line.
pub fn payloads(text: &str) -> Vec<String> {
    assert!(
        text.ends_with("\n\n"),
        "stream does not end with a blank line: {text:?}"
    );
    text.split("\n\n")
        .filter(|e| !e.trim().is_empty())
        .map(|e| {
            e.trim()
                .strip_prefix("data: ")
                .unwrap_or_else(|| panic!("not a data event: {e:?}"))
                .to_string()
        })
        .collect()
}

/// The JSON events of a whole stream, `[DONE]` left out; panics on a
/// payload that is not JSON or a stream that does not end with `[DONE]`.
pub fn values(text: &str) -> Vec<Value> {
    let mut all = payloads(text);
    assert_eq!(
        all.pop().as_deref(),
        Some("[DONE]"),
        "stream does not end with [DONE]: {text}"
    );
    all.into_iter()
        .map(|p| serde_json::from_str(&p).unwrap_or_else(|e| panic!("bad event ({e}): {p}")))
        .collect()
}

/// The text a choice carries, in any of the shapes pdkv answers with:
/// completions (`text`), chat (`message.content`) or a chat chunk
/// (`delta.content`).
pub fn choice_text(v: &Value) -> String {
    let choice = &v["choices"][0];
    choice["text"]
        .as_str()
        .or(choice["message"]["content"].as_str())
        .or(choice["delta"]["content"].as_str())
        .unwrap_or_default()
        .to_string()
}

/// Why [`stream_text`] found no whole stream.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum StreamError {
    /// An event that is not `data: ...`.
    BadEvent(String),
    /// A `data:` payload that is not JSON (the parser's message, the payload).
    BadJson(String, String),
    /// An event carrying `error` (its payload).
    Error(String),
    /// The stream ended without `[DONE]` (the whole stream).
    NoDone(String),
}

impl std::fmt::Display for StreamError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            StreamError::BadEvent(e) => write!(f, "bad event {e:?}"),
            StreamError::BadJson(e, data) => write!(f, "{e}: {data}"),
            StreamError::Error(data) => f.write_str(data),
            StreamError::NoDone(text) => write!(f, "stream ended without [DONE]: {text}"),
        }
    }
}

impl std::error::Error for StreamError {}

/// The text of a whole stream (the pieces of its first choice joined), or
/// the error: an event carrying `error`, a malformed event, or a stream
/// that ended without `[DONE]`.
pub fn stream_text(text: &str) -> Result<String, StreamError> {
    let mut out = String::new();
    for event in text.split("\n\n").filter(|e| !e.trim().is_empty()) {
        let data = event
            .trim()
            .strip_prefix("data: ")
            .ok_or_else(|| StreamError::BadEvent(event.to_string()))?;
        if data == "[DONE]" {
            return Ok(out);
        }
        let chunk: Value = serde_json::from_str(data)
            .map_err(|e| StreamError::BadJson(e.to_string(), data.to_string()))?;
        if chunk.get("error").is_some() {
            return Err(StreamError::Error(data.to_string()));
        }
        out.push_str(&choice_text(&chunk));
    }
    Err(StreamError::NoDone(text.to_string()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_stream_joins_its_pieces_and_needs_done() {
        let s = "data: {\"choices\":[{\"text\":\"a\"}]}\n\ndata: {\"choices\":[{\"delta\":{\"content\":\"b\"}}]}\n\ndata: [DONE]\n\n";
        assert_eq!(stream_text(s).unwrap(), "ab");
        assert_eq!(payloads(s).len(), 3);
        assert_eq!(values(s).len(), 2);
        let no_done = stream_text("data: {\"choices\":[{\"text\":\"a\"}]}\n\n").unwrap_err();
        assert!(matches!(no_done, StreamError::NoDone(_)), "{no_done}");
        assert!(no_done.to_string().contains("without [DONE]"));
        assert_eq!(
            stream_text("data: {\"error\":{}}\n\n"),
            Err(StreamError::Error("{\"error\":{}}".into()))
        );
        assert!(matches!(
            stream_text("data: {x\n\n"),
            Err(StreamError::BadJson(..))
        ));
        let bad = stream_text("event: x\n\n").unwrap_err();
        assert_eq!(bad, StreamError::BadEvent("event: x".into()));
        assert!(bad.to_string().contains("bad event"));
    }
}
