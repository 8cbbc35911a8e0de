//! Incremental detokenization and stop strings for streaming.
//!
//! [`IncrementalDetokenizer`] turns a growing list of token ids into text
//! deltas. Decoding one token alone loses context (a leading space, the other
//! half of a multi-byte character split across tokens), so each step decodes
//! a short window `ids[prefix_offset..]` and compares it with the decoding of
//! `ids[prefix_offset..read_offset]`; only the new suffix is emitted, and not
//! while it ends in U+FFFD (an incomplete UTF-8 sequence that the next token
//! may complete).
//!
//! [`StopChecker`] finds stop strings in the accumulated text. The text is cut
//! before the earliest match, and text that could still turn into a stop
//! string (a suffix that is a prefix of one) is held back, so a streamed delta
//! never contains any part of a stop string.

use pdkv_model::Tokenizer;

/// Decodes token ids to text.
pub trait Decode {
    /// Special tokens left out.
    fn decode(&self, ids: &[u32]) -> String;

    /// Special tokens kept when `skip_special` is false (a decoder without
    /// special tokens decodes the same either way).
    fn decode_with(&self, ids: &[u32], skip_special: bool) -> String {
        let _ = skip_special;
        self.decode(ids)
    }
}

impl Decode for Tokenizer {
    fn decode(&self, ids: &[u32]) -> String {
        Tokenizer::decode(self, ids, true)
    }

    fn decode_with(&self, ids: &[u32], skip_special: bool) -> String {
        Tokenizer::decode(self, ids, skip_special)
    }
}

/// Context tokens from the prompt used to decode the first output tokens.
const PROMPT_CONTEXT: usize = 5;

/// Text deltas from a growing sequence of token ids.
#[derive(Clone, Debug)]
pub struct IncrementalDetokenizer {
    ids: Vec<u32>,
    prefix_offset: usize,
    read_offset: usize,
    skip_special: bool,
}

impl IncrementalDetokenizer {
    /// Starts after `prompt`, whose last few tokens serve as context.
    pub fn new(prompt: &[u32]) -> IncrementalDetokenizer {
        let ctx = &prompt[prompt.len().saturating_sub(PROMPT_CONTEXT)..];
        IncrementalDetokenizer {
            ids: ctx.to_vec(),
            prefix_offset: 0,
            read_offset: ctx.len(),
            skip_special: true,
        }
    }

    /// Keeps special tokens in the text (`skip_special_tokens: false`).
    pub fn keeping_special_tokens(mut self, keep: bool) -> IncrementalDetokenizer {
        self.skip_special = !keep;
        self
    }

    /// Adds one token and returns the text it completes (possibly empty).
    pub fn push(&mut self, dec: &dyn Decode, id: u32) -> String {
        self.ids.push(id);
        self.take(dec, false)
    }

    /// Text still pending at the end of the sequence, including an
    /// incomplete character (as U+FFFD).
    pub fn flush(&mut self, dec: &dyn Decode) -> String {
        self.take(dec, true)
    }

    fn take(&mut self, dec: &dyn Decode, finish: bool) -> String {
        if self.read_offset == self.ids.len() {
            return String::new();
        }
        let skip = self.skip_special;
        let prefix = dec.decode_with(&self.ids[self.prefix_offset..self.read_offset], skip);
        let full = dec.decode_with(&self.ids[self.prefix_offset..], skip);
        if full.len() <= prefix.len() || !full.is_char_boundary(prefix.len()) {
            return String::new();
        }
        if !finish && full.ends_with('\u{FFFD}') {
            return String::new();
        }
        let delta = full[prefix.len()..].to_string();
        self.prefix_offset = self.read_offset;
        self.read_offset = self.ids.len();
        // Keep the window short: the decoded prefix only needs recent context.
        if self.prefix_offset > 0 {
            self.ids.drain(..self.prefix_offset);
            self.read_offset -= self.prefix_offset;
            self.prefix_offset = 0;
        }
        delta
    }
}

/// Accumulates output text, cuts it at stop strings and decides how much of
/// it is safe to stream.
#[derive(Clone, Debug)]
pub struct StopChecker {
    stops: Vec<String>,
    max_stop_len: usize,
    text: String,
    /// Bytes of `text` already handed out.
    emitted: usize,
    stopped: bool,
    /// A matched stop string stays in the text.
    include_stop: bool,
}

impl StopChecker {
    pub fn new(stops: Vec<String>) -> StopChecker {
        let max_stop_len = stops.iter().map(|s| s.len()).max().unwrap_or(0);
        StopChecker {
            stops,
            max_stop_len,
            text: String::new(),
            emitted: 0,
            stopped: false,
            include_stop: false,
        }
    }

    /// Keeps a matched stop string in the text (`include_stop_str_in_output`):
    /// the text is cut right after it instead of before it.
    pub fn including_stop(mut self, include: bool) -> StopChecker {
        self.include_stop = include;
        self
    }

    /// The text kept so far (cut before a stop string once one matched).
    pub fn text(&self) -> &str {
        &self.text
    }

    pub fn stopped(&self) -> bool {
        self.stopped
    }

    /// Appends `delta` and returns `(text safe to emit now, matched a stop)`.
    pub fn push(&mut self, delta: &str) -> (String, bool) {
        assert!(!self.stopped, "text pushed after a stop string matched");
        if delta.is_empty() {
            return (String::new(), false);
        }
        let before = self.text.len();
        self.text.push_str(delta);
        if self.stops.is_empty() {
            return (self.drain_to(self.text.len()), false);
        }
        // A match must end inside the new text; start early enough to see one
        // that began in held-back text.
        // Never before emitted text: with `push_unmatched` a stop string
        // may lie in text already handed out, and that text stays.
        let mut from = before
            .saturating_sub(self.max_stop_len.saturating_sub(1))
            .max(self.emitted);
        while !self.text.is_char_boundary(from) {
            from -= 1;
        }
        // The earliest match; of two at one place, the longer.
        let earliest = self
            .stops
            .iter()
            .filter_map(|s| {
                self.text[from..]
                    .find(s.as_str())
                    .map(|p| (from + p, usize::MAX - s.len()))
            })
            .min()
            .map(|(p, rev_len)| (p, usize::MAX - rev_len));
        if let Some((pos, len)) = earliest {
            let pos = if self.include_stop { pos + len } else { pos };
            self.text.truncate(pos);
            self.stopped = true;
            return (self.drain_to(pos), true);
        }
        let safe = self.text.len() - self.held_back();
        (self.drain_to(safe), false)
    }

    /// Appends `delta` without looking for stop strings (before
    /// `min_tokens` were generated) and returns the text safe to emit now:
    /// a suffix that may still begin a stop string is held back, since a
    /// later push may complete the match.
    pub fn push_unmatched(&mut self, delta: &str) -> String {
        assert!(!self.stopped, "text pushed after a stop string matched");
        self.text.push_str(delta);
        let safe = self.text.len() - self.held_back();
        self.drain_to(safe)
    }

    /// Everything not yet emitted (at the end of a request that did not stop
    /// on a string: held-back text was not a stop after all).
    pub fn flush(&mut self) -> String {
        self.drain_to(self.text.len())
    }

    /// Length of the longest suffix of the text that is a proper prefix of a
    /// stop string, measured on a char boundary.
    fn held_back(&self) -> usize {
        let t = self.text.as_bytes();
        let mut best = 0;
        for s in &self.stops {
            let s = s.as_bytes();
            for n in (1..s.len().min(t.len() + 1)).rev() {
                if n <= best {
                    break;
                }
                if t[t.len() - n..] == s[..n] {
                    best = n;
                    break;
                }
            }
        }
        let mut cut = self.text.len() - best;
        while !self.text.is_char_boundary(cut) {
            cut -= 1;
        }
        self.text.len() - cut
    }

    fn drain_to(&mut self, end: usize) -> String {
        if end <= self.emitted {
            return String::new();
        }
        let out = self.text[self.emitted..end].to_string();
        self.emitted = end;
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A byte-level vocabulary: token `i` is byte `i` (ids >= 256 decode to
    /// nothing, like special tokens skipped in decoding). Invalid UTF-8
    /// decodes to U+FFFD, as real byte-level BPE decoders do.
    struct Bytes;
    impl Decode for Bytes {
        fn decode(&self, ids: &[u32]) -> String {
            let bytes: Vec<u8> = ids.iter().filter(|&&i| i < 256).map(|&i| i as u8).collect();
            String::from_utf8_lossy(&bytes).into_owned()
        }
    }

    fn ids(s: &str) -> Vec<u32> {
        s.bytes().map(|b| b as u32).collect()
    }

    fn stream(prompt: &str, out: &[u32]) -> Vec<String> {
        let mut d = IncrementalDetokenizer::new(&ids(prompt));
        out.iter().map(|&t| d.push(&Bytes, t)).collect()
    }

    #[test]
    fn deltas_concatenate_to_the_full_decode() {
        let text = "héllo wörld ✓ done";
        let deltas = stream("prompt: ", &ids(text));
        assert_eq!(deltas.concat(), text);
    }

    #[test]
    fn partial_utf8_is_held_until_complete() {
        let check = "✓".as_bytes(); // three bytes
        let mut out = ids("a");
        out.extend(check.iter().map(|&b| b as u32));
        let deltas = stream("", &out);
        assert_eq!(deltas, vec!["a", "", "", "✓"], "no U+FFFD is ever emitted");
        // Flush at the end emits an incomplete character once.
        let mut d = IncrementalDetokenizer::new(&[]);
        assert_eq!(d.push(&Bytes, check[0] as u32), "");
        assert_eq!(d.flush(&Bytes), "\u{FFFD}");
        assert_eq!(d.flush(&Bytes), "");
    }

    #[test]
    fn special_tokens_emit_nothing() {
        let deltas = stream("x", &[300, b'o' as u32, 301, b'k' as u32]);
        assert_eq!(deltas, vec!["", "o", "", "k"]);
    }

    fn run_stops(stops: &[&str], deltas: &[&str]) -> (Vec<String>, bool, String) {
        let mut c = StopChecker::new(stops.iter().map(|s| s.to_string()).collect());
        let mut out = Vec::new();
        for d in deltas {
            let (e, hit) = c.push(d);
            out.push(e);
            if hit {
                return (out, true, c.text().to_string());
            }
        }
        out.push(c.flush());
        (out, false, c.text().to_string())
    }

    #[test]
    fn an_included_stop_string_ends_the_text() {
        let mut s = StopChecker::new(vec!["ab".into(), "abc".into()]).including_stop(true);
        let (a, stop) = s.push("xx a");
        assert!(!stop);
        let (b, stop) = s.push("bc yy");
        assert!(stop);
        // The longer of two stops that match at one place.
        assert_eq!(format!("{a}{b}"), "xx abc");
        assert_eq!(s.text(), "xx abc");
        let mut plain = StopChecker::new(vec!["ab".into()]);
        let (t, stop) = plain.push("xx ab yy");
        assert_eq!((t.as_str(), stop), ("xx ", true));
    }

    #[test]
    fn stop_string_cuts_and_is_never_streamed() {
        let (out, hit, text) = run_stops(&["STOP"], &["hello S", "TO", "P and more"]);
        assert!(hit);
        assert_eq!(text, "hello ");
        assert_eq!(out, vec!["hello ", "", ""]);
        assert!(out.iter().all(|d| !d.contains('S')));
    }

    #[test]
    fn held_back_text_is_released_when_it_is_not_a_stop() {
        let (out, hit, text) = run_stops(&["STOP"], &["ab S", "T", "x", "yz"]);
        assert!(!hit);
        assert_eq!(text, "ab STxyz");
        assert_eq!(out, vec!["ab ", "", "STx", "yz", ""]);
        // Released at the end when the request ends for another reason.
        let (out, _, _) = run_stops(&["STOP"], &["ab ST"]);
        assert_eq!(out, vec!["ab ", "ST"]);
    }

    #[test]
    fn earliest_of_several_stops_wins_and_multibyte_is_respected() {
        let (_, hit, text) = run_stops(&["world", "lo w"], &["hel", "lo world"]);
        assert!(hit);
        assert_eq!(text, "hel");
        let (out, hit, text) = run_stops(&["é!"], &["caf", "é", "s é!"]);
        assert!(hit);
        assert_eq!(text, "cafés ");
        assert_eq!(out.concat(), "cafés ");
    }

    #[test]
    fn unmatched_text_is_kept_and_a_later_match_cuts_only_new_text() {
        let mut c = StopChecker::new(vec!["ab".into()]);
        // Before min_tokens: "ab" does not stop, a trailing "a" is held back.
        assert_eq!(c.push_unmatched("xab"), "xab");
        assert_eq!(c.push_unmatched("a"), "");
        // The held-back "a" and the new "b" make a match after min_tokens.
        assert_eq!(c.push("b"), (String::new(), true));
        assert_eq!(c.text(), "xab");
    }
}
