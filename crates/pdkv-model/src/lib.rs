//! Tokenizer and transformer math on CPU: checkpoint loading (GGUF and
//! Hugging Face directories), Llama and Qwen3 architectures, and paged
//! attention over KV blocks that live in a `pdkv-vmem` region.
//!
//! Invariant: every kernel reduces in a fixed order per output row, so a
//! sequence's logits are bit-identical whatever else is in the batch and
//! however its prefill is chunked.

pub mod bench;
pub mod bf16dot;
pub mod chat;
pub mod checkpoint_file;
pub mod config;
pub mod dispatch;
pub mod export;
pub mod forward;
pub mod gguf;
pub mod init;
pub mod kernels;
pub mod kv;
pub mod loader;
pub mod packed;
mod prefetch;
pub mod profile;
pub mod qkernels;
pub mod qtype;
pub mod quantize;
pub mod safetensors;
pub mod team;
pub mod tokenizer;
pub mod tp;
pub mod weights;
pub mod workspace;

pub use chat::{ChatMessage, ChatTemplate, Ending};
pub use config::{Arch, ModelConfig};
pub use forward::{Model, SeqInput, Workspace};
pub use kv::{KvCache, KvDtype};
pub use loader::{load_model, load_model_as, LoadProgress, LoadedModel, WeightFormat};
pub use tokenizer::Tokenizer;

/// Tokens per KV block.
pub const BLOCK_SIZE: usize = 16;
