//! Loading a checkpoint (GGUF file or Hugging Face directory) into a pool.
//!
//! Both formats go through one plan: from the config, [`WeightsPlan`] lists
//! every tensor the model needs with its row-major shape, its name in each
//! format, and its place in a single `weights` region. Each source tensor is
//! then checked against the planned shape and converted to f32 straight into
//! its place in the region (no intermediate copy of the model), or, for a
//! matrix the plan keeps in a block or 16-bit format, copied when the source
//! already has that format and otherwise converted row by row (widened to
//! f32, then [`crate::quantize`]d). The plan's formats are the checkpoint's
//! own, the running model's (a reload of a Hugging Face checkpoint), or a
//! chosen [`WeightFormat`] (a fresh load).
//!
//! Invariants:
//! - every tensor of the plan is written exactly once, or the load fails
//!   with an error naming the tensor (missing, wrong shape, unsupported type);
//! - weights end up in Hugging Face order: GGUF files of the `llama`
//!   architecture store Q and K rows interleaved per head for llama.cpp's
//!   RoPE, and are un-permuted here.
//!
//! One file per job: [`plan`] lays the weights out and fills the region,
//! [`format`] chooses the formats of a converted load,
//! [`from_gguf`] and [`from_hf`] read each format (config, tensors,
//! tokenizer), [`load`] loads a checkpoint whole and [`reload`] writes one
//! into a running model's region; this file only hands their names on.

mod format;
mod from_gguf;
mod from_hf;
mod load;
mod plan;
mod reload;

pub use format::{WeightFormat, WEIGHT_FORMAT_NAMES};
pub use from_gguf::gguf_config;
pub use from_hf::{convert_tensor, hf_config};
pub use load::{load_model, load_model_as, load_weights_like, load_weights_matching, LoadedModel};
pub use plan::LoadProgress;
pub use reload::{reload_weights_into, stage_checkpoint, ReloadError};
