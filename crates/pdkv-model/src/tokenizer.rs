//! Tokenizer: the `tokenizers` crate, from tokenizer.json or GGUF metadata.
//!
//! A GGUF file carries a byte-level BPE vocabulary (`tokenizer.ggml.model`
//! = "gpt2") as token strings, merges and token types, plus a name for the
//! pre-tokenizer (`tokenizer.ggml.pre`). [`Tokenizer::from_gguf`] rebuilds
//! the equivalent `tokenizer.json` document from those and hands it to the
//! `tokenizers` crate, so both sources go through the same implementation.

use std::path::Path;

use anyhow::{bail, Context};
use serde_json::{json, Value};

use crate::gguf::GgufFile;

pub struct Tokenizer {
    inner: tokenizers::Tokenizer,
    bos_token_id: Option<u32>,
    eos_token_ids: Vec<u32>,
}

/// GGUF token type of control (special) tokens.
const TOKEN_TYPE_CONTROL: i64 = 3;
/// GGUF token type of user-defined added tokens.
const TOKEN_TYPE_USER_DEFINED: i64 = 4;

/// Split pattern of Llama 3 style byte-level tokenizers (digits in runs of
/// up to three).
const LLAMA3_SPLIT: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";
/// Split pattern of Qwen2/Qwen3 tokenizers (single digits).
const QWEN2_SPLIT: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";

fn byte_level(use_regex: bool) -> Value {
    json!({"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": true, "use_regex": use_regex})
}

fn split_then_bytes(pattern: &str) -> Value {
    json!({"type": "Sequence", "pretokenizers": [
        {"type": "Split", "pattern": {"Regex": pattern}, "behavior": "Isolated", "invert": false},
        byte_level(false),
    ]})
}

/// The pre-tokenizer that goes with a GGUF `tokenizer.ggml.pre` name.
fn pre_tokenizer_for(pre: &str) -> Value {
    match pre {
        // SmolLM: every digit on its own, then GPT-2 splitting.
        "smollm" => json!({"type": "Sequence", "pretokenizers": [
            {"type": "Digits", "individual_digits": true},
            byte_level(true),
        ]}),
        "llama3" | "llama-v3" | "llama-bpe" | "smaug-bpe" | "dbrx" | "falcon3" => {
            split_then_bytes(LLAMA3_SPLIT)
        }
        "qwen2" | "deepseek-r1-qwen" => split_then_bytes(QWEN2_SPLIT),
        "gpt2" | "default" => byte_level(true),
        other => {
            tracing::warn!(
                pre = other,
                "unknown GGUF pre-tokenizer; using GPT-2 byte-level splitting"
            );
            byte_level(true)
        }
    }
}

impl Tokenizer {
    /// Wraps a `tokenizers` tokenizer.
    pub fn new(
        inner: tokenizers::Tokenizer,
        bos_token_id: Option<u32>,
        eos_token_ids: Vec<u32>,
    ) -> Tokenizer {
        Tokenizer {
            inner,
            bos_token_id,
            eos_token_ids,
        }
    }

    /// Loads a `tokenizer.json`; special ids are set with
    /// [`Tokenizer::with_special_ids`].
    pub fn from_file(path: &Path) -> anyhow::Result<Tokenizer> {
        let inner = tokenizers::Tokenizer::from_file(path)
            .map_err(|e| anyhow::anyhow!("cannot load tokenizer {}: {e}", path.display()))?;
        Ok(Tokenizer::new(inner, None, Vec::new()))
    }

    /// Sets the BOS id and the ids that end generation.
    pub fn with_special_ids(
        mut self,
        bos_token_id: Option<u32>,
        eos_token_ids: Vec<u32>,
    ) -> Tokenizer {
        self.bos_token_id = bos_token_id;
        self.eos_token_ids = eos_token_ids;
        self
    }

    /// Builds the tokenizer a GGUF file describes (byte-level BPE only).
    pub fn from_gguf(gguf: &GgufFile) -> anyhow::Result<Tokenizer> {
        let json = gguf_tokenizer_json(gguf)?;
        let inner: tokenizers::Tokenizer = json
            .to_string()
            .parse()
            .map_err(|e| anyhow::anyhow!("tokenizer built from GGUF metadata is invalid: {e}"))?;
        let bos = gguf
            .get_u64("tokenizer.ggml.bos_token_id")
            .map(|v| v as u32);
        let mut eos = Vec::new();
        for key in ["tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id"] {
            if let Some(id) = gguf.get_u64(key) {
                if !eos.contains(&(id as u32)) {
                    eos.push(id as u32);
                }
            }
        }
        Ok(Tokenizer::new(inner, bos, eos))
    }

    pub fn encode(&self, text: &str, add_special_tokens: bool) -> anyhow::Result<Vec<u32>> {
        let enc = self
            .inner
            .encode(text, add_special_tokens)
            .map_err(|e| anyhow::anyhow!("tokenization failed: {e}"))?;
        Ok(enc.get_ids().to_vec())
    }

    /// Decodes ids to text, skipping special tokens when asked. Ids outside
    /// the vocabulary are skipped.
    pub fn decode(&self, ids: &[u32], skip_special_tokens: bool) -> String {
        match self.inner.decode(ids, skip_special_tokens) {
            Ok(s) => s,
            Err(e) => {
                tracing::warn!(error = %e, "decoding failed");
                String::new()
            }
        }
    }

    /// Vocabulary size including added tokens.
    pub fn vocab_size(&self) -> usize {
        self.inner.get_vocab_size(true)
    }

    pub fn bos_token_id(&self) -> Option<u32> {
        self.bos_token_id
    }

    pub fn eos_token_ids(&self) -> &[u32] {
        &self.eos_token_ids
    }

    pub fn token_to_id(&self, token: &str) -> Option<u32> {
        self.inner.token_to_id(token)
    }

    /// The token string of an id, as the vocabulary spells it.
    pub fn id_to_token(&self, id: u32) -> Option<String> {
        self.inner.id_to_token(id)
    }

    /// The underlying `tokenizers` tokenizer.
    pub fn inner(&self) -> &tokenizers::Tokenizer {
        &self.inner
    }
}

/// The `tokenizer.json` document equivalent to a GGUF file's vocabulary.
pub fn gguf_tokenizer_json(gguf: &GgufFile) -> anyhow::Result<Value> {
    let model = gguf
        .get_str("tokenizer.ggml.model")
        .context("GGUF has no tokenizer.ggml.model")?;
    if model != "gpt2" {
        bail!("GGUF tokenizer model `{model}` is not supported (only byte-level BPE, `gpt2`)");
    }
    let tokens = gguf
        .get_str_array("tokenizer.ggml.tokens")
        .context("GGUF has no tokenizer.ggml.tokens string array")?;
    let merges = gguf
        .get_str_array("tokenizer.ggml.merges")
        .context("GGUF has no tokenizer.ggml.merges string array")?;
    let types: Vec<i64> = match gguf
        .get("tokenizer.ggml.token_type")
        .and_then(|v| v.as_array())
    {
        Some(a) => a.iter().map(|v| v.as_i64().unwrap_or(1)).collect(),
        None => vec![1; tokens.len()],
    };
    if types.len() != tokens.len() {
        bail!(
            "GGUF token_type has {} entries for {} tokens",
            types.len(),
            tokens.len()
        );
    }

    let mut vocab = serde_json::Map::with_capacity(tokens.len());
    let mut added = Vec::new();
    for (id, (&tok, &ty)) in tokens.iter().zip(&types).enumerate() {
        if vocab.insert(tok.to_string(), json!(id)).is_some() {
            bail!("GGUF vocabulary lists token {tok:?} twice");
        }
        if ty == TOKEN_TYPE_CONTROL || ty == TOKEN_TYPE_USER_DEFINED {
            added.push(added_token(id, tok, ty == TOKEN_TYPE_CONTROL));
        }
    }

    let pre = gguf.get_str("tokenizer.ggml.pre").unwrap_or("default");
    let add_bos = gguf
        .get("tokenizer.ggml.add_bos_token")
        .and_then(|v| v.as_bool())
        .unwrap_or(false);
    let bos = gguf.get_u64("tokenizer.ggml.bos_token_id");
    let post_processor = match (add_bos, bos) {
        (true, Some(bos)) => {
            let bos_tok = tokens
                .get(bos as usize)
                .with_context(|| format!("bos_token_id {bos} is outside the vocabulary"))?;
            let mut specials = serde_json::Map::new();
            specials.insert(
                bos_tok.to_string(),
                json!({"id": bos_tok, "ids": [bos], "tokens": [bos_tok]}),
            );
            json!({
                "type": "TemplateProcessing",
                "single": [{"SpecialToken": {"id": bos_tok, "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}}],
                "pair": [{"SpecialToken": {"id": bos_tok, "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}},
                         {"SpecialToken": {"id": bos_tok, "type_id": 1}}, {"Sequence": {"id": "B", "type_id": 1}}],
                "special_tokens": specials,
            })
        }
        _ => Value::Null,
    };

    Ok(bpe_json(
        added,
        [pre_tokenizer_for(pre), post_processor],
        vocab,
        json!(merges),
    ))
}

/// An added token of a `tokenizer.json`.
pub(crate) fn added_token(id: usize, content: &str, special: bool) -> Value {
    json!({
        "id": id, "content": content, "single_word": false, "lstrip": false, "rstrip": false,
        "normalized": false, "special": special,
    })
}

/// A byte-level BPE `tokenizer.json` (the byte-level decoder): its added
/// tokens, pre-tokenizer and post-processor, vocabulary and merges.
pub(crate) fn bpe_json(
    added: Vec<Value>,
    [pre_tokenizer, post_processor]: [Value; 2],
    vocab: serde_json::Map<String, Value>,
    merges: Value,
) -> Value {
    json!({
        "version": "1.0",
        "truncation": null,
        "padding": null,
        "added_tokens": added,
        "normalizer": null,
        "pre_tokenizer": pre_tokenizer,
        "post_processor": post_processor,
        "decoder": {"type": "ByteLevel", "add_prefix_space": true, "trim_offsets": true, "use_regex": true},
        "model": {
            "type": "BPE", "dropout": null, "unk_token": null, "continuing_subword_prefix": null,
            "end_of_word_suffix": null, "fuse_unk": false, "byte_fallback": false, "ignore_merges": false,
            "vocab": vocab,
            "merges": merges,
        },
    })
}
