//! Log-probabilities in the OpenAI and vLLM JSON shapes.
//!
//! The engine reports, per position, the chosen token's log-probability,
//! its rank and the top tokens ([`TokenLogprobs`]). As vLLM does, a
//! position's list starts with the chosen token followed by the top tokens
//! not already listed; `-inf` is sent as -9999.0 (JSON has no infinity); a
//! token is shown as its own text, decoded alone with special tokens kept.

use pdkv_engine::sampling::TokenLogprobs;
use pdkv_model::Tokenizer;
use serde_json::{json, Map, Value};

/// What a log-probability of `-inf` is sent as (OpenAI's and vLLM's value).
const FLOOR: f64 = -9999.0;

fn clamp(lp: f64) -> f64 {
    lp.max(FLOOR)
}

/// A token's text, decoded alone, special tokens kept.
pub fn token_text(tok: &Tokenizer, id: u32) -> String {
    tok.decode(&[id], false)
}

/// The chosen token first, then the top tokens that are not it.
fn ranked(e: &TokenLogprobs) -> Vec<(u32, f64)> {
    let mut out = Vec::with_capacity(e.top.len() + 1);
    out.push((e.token, e.logprob));
    out.extend(e.top.iter().copied().filter(|&(t, _)| t != e.token));
    out
}

/// `choices[i].logprobs` of `/v1/completions`: `tokens`, `token_logprobs`,
/// `top_logprobs` (one `{token: logprob}` object per position, the chosen
/// token and the top k) and `text_offset` (in characters, from
/// `initial_offset`). A `None` entry (the first prompt token with `echo`)
/// has a null logprob and null top list.
pub fn completion_logprobs(
    tok: &Tokenizer,
    names: Names,
    ids: &[u32],
    entries: &[Option<&TokenLogprobs>],
    initial_offset: usize,
) -> Value {
    debug_assert_eq!(ids.len(), entries.len());
    let (mut tokens, mut token_logprobs, mut top_logprobs, mut text_offset) =
        (Vec::new(), Vec::new(), Vec::new(), Vec::new());
    let mut offset = initial_offset;
    for (&id, e) in ids.iter().zip(entries) {
        let text = token_text(tok, id);
        text_offset.push(offset);
        offset += text.chars().count();
        tokens.push(Value::String(names.label(tok, id)));
        match e {
            None => {
                token_logprobs.push(Value::Null);
                top_logprobs.push(Value::Null);
            }
            Some(e) => {
                token_logprobs.push(json!(clamp(e.logprob)));
                let mut top = Map::new();
                for (t, lp) in ranked(e) {
                    top.entry(names.label(tok, t)).or_insert(json!(clamp(lp)));
                }
                top_logprobs.push(Value::Object(top));
            }
        }
    }
    json!({"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": top_logprobs, "text_offset": text_offset})
}

/// Characters the tokens `ids` decode to one by one (the text offset after them).
pub fn text_len(tok: &Tokenizer, ids: &[u32]) -> usize {
    ids.iter()
        .map(|&id| token_text(tok, id).chars().count())
        .sum()
}

/// How tokens are named in log-probabilities: by their text, or as
/// `token_id:N` (vLLM's `return_tokens_as_token_ids`, which the
/// token-in/token-out API always uses).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Names {
    Text,
    TokenIds,
}

impl Names {
    pub fn of(as_ids: bool) -> Names {
        if as_ids {
            Names::TokenIds
        } else {
            Names::Text
        }
    }

    pub fn label(self, tok: &Tokenizer, id: u32) -> String {
        match self {
            Names::Text => token_text(tok, id),
            Names::TokenIds => format!("token_id:{id}"),
        }
    }
}

fn chat_entry(tok: &Tokenizer, names: Names, id: u32, lp: f64) -> Value {
    let text = names.label(tok, id);
    let bytes: Vec<u8> = text.as_bytes().to_vec();
    json!({"token": text, "logprob": clamp(lp), "bytes": bytes})
}

/// `choices[i].logprobs.content` of `/v1/chat/completions`: per token
/// `{token, logprob, bytes, top_logprobs}`, with `top` entries of the
/// position's list (vLLM's: the chosen token first).
pub fn chat_content(
    tok: &Tokenizer,
    names: Names,
    entries: &[TokenLogprobs],
    top: usize,
) -> Vec<Value> {
    entries
        .iter()
        .map(|e| {
            let mut v = chat_entry(tok, names, e.token, e.logprob);
            let tops: Vec<Value> = ranked(e)
                .into_iter()
                .take(top)
                .map(|(t, lp)| chat_entry(tok, names, t, lp))
                .collect();
            v["top_logprobs"] = Value::Array(tops);
            v
        })
        .collect()
}

/// vLLM's `prompt_logprobs`: per prompt token null (the first) or an object
/// from token id to `{logprob, rank, decoded_token}` holding the prompt
/// token and the top k.
pub fn prompt_logprobs(tok: &Tokenizer, entries: &[Option<TokenLogprobs>]) -> Value {
    let one = |e: &TokenLogprobs| {
        let mut m = Map::new();
        m.insert(
            e.token.to_string(),
            json!({"logprob": clamp(e.logprob), "rank": e.rank, "decoded_token": token_text(tok, e.token)}),
        );
        for (i, &(t, lp)) in e.top.iter().enumerate() {
            m.entry(t.to_string()).or_insert_with(|| {
                json!({"logprob": clamp(lp), "rank": i + 1, "decoded_token": token_text(tok, t)})
            });
        }
        Value::Object(m)
    };
    Value::Array(
        entries
            .iter()
            .map(|e| e.as_ref().map_or(Value::Null, one))
            .collect(),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_chosen_token_leads_and_is_listed_once() {
        let e = TokenLogprobs {
            token: 5,
            logprob: -2.0,
            rank: 2,
            top: vec![(3, -0.5), (5, -2.0)],
        };
        assert_eq!(ranked(&e), vec![(5, -2.0), (3, -0.5)]);
        let outside = TokenLogprobs {
            token: 9,
            logprob: f64::NEG_INFINITY,
            rank: 7,
            top: vec![(3, -0.5)],
        };
        assert_eq!(ranked(&outside), vec![(9, f64::NEG_INFINITY), (3, -0.5)]);
        assert_eq!(clamp(f64::NEG_INFINITY), -9999.0);
    }
}
