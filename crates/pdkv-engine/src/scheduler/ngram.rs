//! Speculative decoding by n-gram (prompt) lookup: the draft is what
//! followed the last time the sequence's latest `n` tokens appeared in it.
//! A leaf.
//!
//! Drafts cost nothing to make; the engine verifies them in the forward
//! pass that computes the sequence's next token (one row of logits per
//! position) and keeps the longest run the model itself would have
//! sampled ([`crate::sampling`] says how sampling stays exact).

use serde::Deserialize;

/// `--speculative-config`, as vLLM spells it for the n-gram method:
/// `{"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_max": n,
/// "prompt_lookup_min": m}`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SpeculativeConfig {
    /// Most draft tokens a sequence proposes per step.
    pub num_speculative_tokens: usize,
    /// Longest suffix looked up (tried first).
    pub prompt_lookup_max: usize,
    /// Shortest suffix looked up.
    pub prompt_lookup_min: usize,
}

/// The JSON object, every key named (any other is refused).
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct Spelled {
    method: Option<String>,
    num_speculative_tokens: Option<usize>,
    prompt_lookup_max: Option<usize>,
    prompt_lookup_min: Option<usize>,
}

/// Without `prompt_lookup_max`: this, or `prompt_lookup_min` when that is given.
const DEFAULT_LOOKUP_MAX: usize = 5;
/// Without `prompt_lookup_min`: this, or `prompt_lookup_max` when that is
/// smaller. A single repeated token is too weak a hint to spend positions on.
const DEFAULT_LOOKUP_MIN: usize = 2;
/// Bound on `num_speculative_tokens` (each is a position of every step).
pub const MAX_SPECULATIVE_TOKENS: usize = 16;

impl std::str::FromStr for SpeculativeConfig {
    type Err = String;

    fn from_str(s: &str) -> Result<SpeculativeConfig, String> {
        let v: Spelled = serde_json::from_str(s).map_err(|e| {
            format!("--speculative-config: {e} (this server takes method, num_speculative_tokens, prompt_lookup_max, prompt_lookup_min)")
        })?;
        match v.method.as_deref() {
            Some("ngram") => {}
            Some(other) => {
                return Err(format!(
                "--speculative-config: method {other:?} is not supported here (supported: ngram)"
            ))
            }
            None => return Err("--speculative-config: method is required (ngram)".into()),
        }
        let k = v
            .num_speculative_tokens
            .ok_or("--speculative-config: num_speculative_tokens is required")?;
        if !(1..=MAX_SPECULATIVE_TOKENS).contains(&k) {
            return Err(format!(
                "--speculative-config: num_speculative_tokens {k} is outside 1..={MAX_SPECULATIVE_TOKENS}"
            ));
        }
        let max = v
            .prompt_lookup_max
            .unwrap_or_else(|| v.prompt_lookup_min.unwrap_or(DEFAULT_LOOKUP_MAX));
        let min = v
            .prompt_lookup_min
            .unwrap_or_else(|| DEFAULT_LOOKUP_MIN.min(max));
        if min == 0 || min > max {
            return Err(format!(
                "--speculative-config: prompt_lookup_min {min} and prompt_lookup_max {max} must satisfy 1 <= min <= max"
            ));
        }
        Ok(SpeculativeConfig {
            num_speculative_tokens: k,
            prompt_lookup_max: max,
            prompt_lookup_min: min,
        })
    }
}

impl SpeculativeConfig {
    /// The draft for a sequence of `tokens`, at most `limit` tokens (and at
    /// most `num_speculative_tokens`): for `n` from `prompt_lookup_max` down
    /// to `prompt_lookup_min`, the tokens that followed the latest earlier
    /// occurrence of the last `n` tokens. Empty when no suffix recurs.
    pub fn propose(&self, tokens: &[u32], limit: usize) -> Vec<u32> {
        let k = self.num_speculative_tokens.min(limit);
        let len = tokens.len();
        if k == 0 {
            return Vec::new();
        }
        for n in (self.prompt_lookup_min..=self.prompt_lookup_max).rev() {
            if n >= len {
                continue;
            }
            let suffix = &tokens[len - n..];
            // Latest start `s < len - n` with tokens[s..s + n] == suffix.
            let found = (0..len - n).rev().find(|&s| &tokens[s..s + n] == suffix);
            if let Some(s) = found {
                let from = s + n;
                return tokens[from..(from + k).min(len)].to_vec();
            }
        }
        Vec::new()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cfg(k: usize, min: usize, max: usize) -> SpeculativeConfig {
        SpeculativeConfig {
            num_speculative_tokens: k,
            prompt_lookup_max: max,
            prompt_lookup_min: min,
        }
    }

    #[test]
    fn the_latest_longest_match_gives_what_followed_it() {
        // ... 1 2 3 [4 5] ... 7 2 3 [9 8] ... 2 3 -> the latest "2 3" is
        // followed by 9 8.
        let t = [1, 2, 3, 4, 5, 6, 7, 2, 3, 9, 8, 2, 3];
        assert_eq!(cfg(2, 1, 3).propose(&t, 10), vec![9, 8]);
        // A longer suffix that recurs wins over the latest short one:
        // "1 2 3" appears at 0, its follower is 4.
        let t = [1, 2, 3, 4, 5, 2, 3, 6, 1, 2, 3];
        assert_eq!(cfg(3, 2, 3).propose(&t, 10), vec![4, 5, 2]);
        assert_eq!(cfg(3, 2, 2).propose(&t, 10), vec![6, 1, 2]);
    }

    #[test]
    fn drafts_are_bounded_and_may_be_empty() {
        let t = [5, 6, 7, 5, 6];
        assert_eq!(cfg(4, 2, 2).propose(&t, 10), vec![7, 5, 6]);
        assert_eq!(cfg(4, 2, 2).propose(&t, 1), vec![7]);
        assert_eq!(cfg(4, 2, 2).propose(&t, 0), Vec::<u32>::new());
        assert_eq!(cfg(1, 2, 2).propose(&t, 10), vec![7]);
        // No suffix of 2..=3 recurs.
        assert!(cfg(4, 2, 3).propose(&[1, 2, 3, 4, 5], 10).is_empty());
        // Shorter than the suffix.
        assert!(cfg(4, 3, 3).propose(&[1, 1], 10).is_empty());
    }

    #[test]
    fn the_json_spelling_is_vllms_and_refuses_what_it_does_not_know() {
        let c: SpeculativeConfig =
            r#"{"method":"ngram","num_speculative_tokens":4,"prompt_lookup_max":3}"#
                .parse()
                .unwrap();
        assert_eq!(c, cfg(4, 2, 3));
        let c: SpeculativeConfig =
            r#"{"method":"ngram","num_speculative_tokens":2,"prompt_lookup_min":4}"#
                .parse()
                .unwrap();
        assert_eq!(c, cfg(2, 4, 4));
        let c: SpeculativeConfig =
            r#"{"method":"ngram","num_speculative_tokens":2,"prompt_lookup_max":1}"#
                .parse()
                .unwrap();
        assert_eq!(c, cfg(2, 1, 1));
        for (bad, says) in [
            (
                r#"{"method":"eagle","num_speculative_tokens":2}"#,
                "\"eagle\" is not supported",
            ),
            (r#"{"num_speculative_tokens":2}"#, "method is required"),
            (
                r#"{"method":"ngram"}"#,
                "num_speculative_tokens is required",
            ),
            (
                r#"{"method":"ngram","num_speculative_tokens":0}"#,
                "outside 1..=16",
            ),
            (
                r#"{"method":"ngram","num_speculative_tokens":2,"prompt_lookup_min":3,"prompt_lookup_max":2}"#,
                "1 <= min <= max",
            ),
            (
                r#"{"method":"ngram","num_speculative_tokens":2,"model":"x"}"#,
                "unknown field `model`",
            ),
            ("not json", "--speculative-config"),
        ] {
            let e = bad.parse::<SpeculativeConfig>().unwrap_err();
            assert!(e.contains(says), "{bad}: {e}");
        }
    }
}
