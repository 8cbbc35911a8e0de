//! Tokenizer: the `tokenizers` crate, from tokenizer.json or GGUF metadata.

pub struct Tokenizer {
    inner: tokenizers::Tokenizer,
    bos_token_id: Option<u32>,
    eos_token_ids: Vec<u32>,
}

impl Tokenizer {
    pub fn encode(&self, _text: &str, _add_special_tokens: bool) -> anyhow::Result<Vec<u32>> {
        let _ = &self.inner;
        todo!()
    }

    /// Decodes ids to text, skipping special tokens when asked.
    pub fn decode(&self, _ids: &[u32], _skip_special_tokens: bool) -> String {
        todo!()
    }

    pub fn vocab_size(&self) -> usize {
        todo!()
    }

    pub fn bos_token_id(&self) -> Option<u32> {
        self.bos_token_id
    }

    pub fn eos_token_ids(&self) -> &[u32] {
        &self.eos_token_ids
    }

    pub fn token_to_id(&self, _token: &str) -> Option<u32> {
        todo!()
    }
}
