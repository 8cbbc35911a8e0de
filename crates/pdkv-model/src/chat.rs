//! Chat templates (Jinja, from GGUF metadata or tokenizer_config.json).

use serde::{Deserialize, Serialize};

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ChatMessage {
    pub role: String,
    pub content: String,
}

pub struct ChatTemplate {
    source: String,
    bos_token: String,
    eos_token: String,
}

impl ChatTemplate {
    pub fn new(source: String, bos_token: String, eos_token: String) -> ChatTemplate {
        ChatTemplate { source, bos_token, eos_token }
    }

    /// Renders the conversation to the prompt text.
    pub fn render(&self, _messages: &[ChatMessage], _add_generation_prompt: bool) -> anyhow::Result<String> {
        let _ = (&self.source, &self.bos_token, &self.eos_token);
        todo!()
    }
}
