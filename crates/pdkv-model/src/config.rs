//! Model hyper-parameters, from a Hugging Face `config.json` or GGUF metadata.

use serde::{Deserialize, Serialize};

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Arch {
    /// Llama family (Llama, SmolLM2): GQA, RoPE, SwiGLU, RMSNorm.
    Llama,
    /// Qwen3: as Llama plus RMSNorm on each head of q and k before RoPE.
    Qwen3,
}

impl Arch {
    pub fn as_str(self) -> &'static str {
        match self {
            Arch::Llama => "llama",
            Arch::Qwen3 => "qwen3",
        }
    }
}

/// Everything the math needs to know about a checkpoint's shape.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct ModelConfig {
    pub arch: Arch,
    pub vocab_size: usize,
    pub hidden_size: usize,
    pub intermediate_size: usize,
    pub num_layers: usize,
    pub num_heads: usize,
    pub num_kv_heads: usize,
    pub head_dim: usize,
    pub rope_theta: f32,
    pub rms_norm_eps: f32,
    pub max_position_embeddings: usize,
    pub tie_word_embeddings: bool,
    pub bos_token_id: Option<u32>,
    pub eos_token_ids: Vec<u32>,
}

impl ModelConfig {
    pub fn q_dim(&self) -> usize {
        self.num_heads * self.head_dim
    }

    pub fn kv_dim(&self) -> usize {
        self.num_kv_heads * self.head_dim
    }

    /// Checks the shape relations the math relies on.
    pub fn validate(&self) -> anyhow::Result<()> {
        anyhow::ensure!(self.num_layers > 0, "num_layers must be > 0");
        anyhow::ensure!(self.hidden_size > 0 && self.vocab_size > 0, "empty model");
        anyhow::ensure!(
            self.num_kv_heads > 0 && self.num_heads.is_multiple_of(self.num_kv_heads),
            "num_heads {} is not a multiple of num_kv_heads {}",
            self.num_heads,
            self.num_kv_heads
        );
        anyhow::ensure!(
            self.head_dim.is_multiple_of(2),
            "head_dim {} must be even for RoPE",
            self.head_dim
        );
        Ok(())
    }
}
