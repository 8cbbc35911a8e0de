//! The SSE bytes the relay plan forwards: whole events, and the token-id
//! comments of a decode engine stripped and recorded.

use crate::codes::TOKEN_IDS_COMMENT;

/// The length of the longest prefix of `buf` made of complete events.
pub fn complete_events_len(buf: &[u8]) -> usize {
    buf.windows(2)
        .rposition(|w| w == b"\n\n")
        .map_or(0, |i| i + 2)
}

/// `bytes` (SSE events, the last perhaps unterminated) without the
/// token-id comment lines ([`TOKEN_IDS_COMMENT`]), whose ids are appended
/// to `ids`; an event left empty goes too. A comment that does not parse
/// stays (clients skip comments).
pub fn strip_token_ids(bytes: &[u8], ids: &mut Vec<u32>) -> Vec<u8> {
    let prefix = TOKEN_IDS_COMMENT.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut rest = bytes;
    while !rest.is_empty() {
        let (event, tail, terminated) = match rest.windows(2).position(|w| w == b"\n\n") {
            Some(i) => (&rest[..i], &rest[i + 2..], true),
            None => (rest, &rest[rest.len()..], false),
        };
        let mut kept: Vec<&[u8]> = Vec::new();
        for line in event.split(|&b| b == b'\n') {
            let parsed = line
                .strip_prefix(prefix)
                .and_then(|json| serde_json::from_slice::<Vec<u32>>(json).ok());
            match parsed {
                Some(v) => ids.extend(v),
                None => kept.push(line),
            }
        }
        if !kept.is_empty() {
            out.extend(kept.join(&b'\n'));
            if terminated {
                out.extend_from_slice(b"\n\n");
            }
        }
        rest = tail;
    }
    out
}
