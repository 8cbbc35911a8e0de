//! Loading a checkpoint (GGUF file or Hugging Face directory) into a pool.

use std::path::{Path, PathBuf};

use pdkv_vmem::Pool;

use crate::{ChatTemplate, Model, Tokenizer};

/// Progress of a load, for a progress display.
#[derive(Clone, Debug)]
pub struct LoadProgress {
    pub tensors_done: usize,
    pub tensors_total: usize,
    pub bytes_done: u64,
    pub bytes_total: u64,
}

pub struct LoadedModel {
    pub model: Model,
    pub tokenizer: Tokenizer,
    pub chat_template: Option<ChatTemplate>,
    /// A short name for `/v1/models` (file stem or directory name).
    pub name: String,
    pub source: PathBuf,
}

/// Loads `path`: a `.gguf` file, or a directory with `config.json`,
/// `*.safetensors` and `tokenizer.json` (and optionally `tokenizer_config.json`).
pub fn load_model(_path: &Path, _pool: &Pool, _progress: &mut dyn FnMut(&LoadProgress)) -> anyhow::Result<LoadedModel> {
    todo!()
}
