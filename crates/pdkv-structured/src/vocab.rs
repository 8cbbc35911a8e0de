//! The served tokenizer as llguidance sees it: every token's bytes (special
//! tokens marked, as llguidance expects) in a trie, and tokenization by the
//! tokenizer itself.

use std::sync::Arc;

use llguidance::toktrie::{TokEnv, TokRxInfo, TokTrie, TokenId, TokenizerEnv};
use pdkv_model::Tokenizer;

struct Env {
    trie: TokTrie,
    tokenizer: Arc<Tokenizer>,
}

impl TokenizerEnv for Env {
    fn tok_trie(&self) -> &TokTrie {
        &self.trie
    }

    fn tokenize_bytes(&self, s: &[u8]) -> Vec<TokenId> {
        match std::str::from_utf8(s) {
            Ok(text) => match self.tokenizer.encode(text, false) {
                Ok(ids) => ids,
                Err(_) => self.trie.greedy_tokenize(s),
            },
            // Not text: the trie's longest-match tokenization.
            Err(_) => self.trie.greedy_tokenize(s),
        }
    }
}

/// The environment for `tokenizer` when the model's logits rows are
/// `vocab_size` wide (ids past the tokenizer's vocabulary have no bytes
/// and are never allowed); `eos` is the end the grammar allows once it is
/// complete.
pub(crate) fn tok_env(
    tokenizer: Arc<Tokenizer>,
    vocab_size: usize,
    eos: u32,
) -> anyhow::Result<TokEnv> {
    let json = tokenizer
        .inner()
        .to_string(false)
        .map_err(|e| anyhow::anyhow!("serialising the tokenizer: {e}"))?;
    let json: serde_json::Value = serde_json::from_str(&json)?;
    let mut words = llguidance::token_bytes_from_tokenizer_json(&json)?;
    anyhow::ensure!(
        words.len() <= vocab_size,
        "the tokenizer has {} tokens, more than the model's {vocab_size} logits",
        words.len()
    );
    words.resize(vocab_size, Vec::new());
    let info = TokRxInfo::new(vocab_size as u32, eos);
    let trie = TokTrie::from(&info, &words);
    Ok(Arc::new(Env { trie, tokenizer }))
}
