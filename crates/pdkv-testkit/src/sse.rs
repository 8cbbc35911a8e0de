//! Server-sent event streams as pdkv (and OpenAI) send them: `data: JSON`
//! events separated by a blank line, closed by `data: [DONE]`.

use serde_json::Value;

/// The `data:` payloads of a whole stream, `[DONE]` included; panics on an
/// event that is not a data event or a stream not ending in a blank line.
pub fn payloads(text: &str) -> Vec<String> {
    assert!(text.ends_with("\n\n"), "stream does not end with a blank line: {text:?}");
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

/// The JSON events of a stream, `[DONE]` left out; panics on a payload that
/// is not JSON.
pub fn values(text: &str) -> Vec<Value> {
    payloads(text)
        .into_iter()
        .filter(|p| p != "[DONE]")
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

/// The text of a whole stream (the pieces of its first choice joined), or
/// the error: an event carrying `error`, a malformed event, or a stream
/// that ended without `[DONE]`.
pub fn stream_text(text: &str) -> Result<String, String> {
    let mut out = String::new();
    for event in text.split("\n\n").filter(|e| !e.trim().is_empty()) {
        let data = event
            .trim()
            .strip_prefix("data: ")
            .ok_or_else(|| format!("bad event {event:?}"))?;
        if data == "[DONE]" {
            return Ok(out);
        }
        let chunk: Value = serde_json::from_str(data).map_err(|e| format!("{e}: {data}"))?;
        if chunk.get("error").is_some() {
            return Err(data.to_string());
        }
        out.push_str(&choice_text(&chunk));
    }
    Err(format!("stream ended without [DONE]: {text}"))
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
        assert!(stream_text("data: {\"choices\":[{\"text\":\"a\"}]}\n\n").unwrap_err().contains("without [DONE]"));
        assert!(stream_text("data: {\"error\":{}}\n\n").is_err());
        assert!(stream_text("event: x\n\n").unwrap_err().contains("bad event"));
    }
}
