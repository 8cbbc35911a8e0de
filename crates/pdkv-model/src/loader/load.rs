//! Loading a checkpoint whole: its config, weights, tokenizer and chat
//! template.

use std::path::{Path, PathBuf};

use anyhow::{bail, Context};
use pdkv_vmem::Pool;

use super::format::WeightFormat;
use super::from_gguf::{gguf_chat_template, gguf_config, load_gguf_weights};
use super::from_hf::{hf_config, hf_tokenizer, load_hf_weights, load_planned, open_hf_shards};
use super::plan::{LoadProgress, WeightsPlan};
use super::reload::{config_mismatches, running_quant};
use crate::gguf::GgufFile;
use crate::weights::Weights;
use crate::{ChatTemplate, Model, ModelConfig, Tokenizer};

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
/// The weights keep the checkpoint's formats ([`WeightFormat::AsStored`]).
pub fn load_model(
    path: &Path,
    pool: &Pool,
    progress: &mut dyn FnMut(&LoadProgress),
) -> anyhow::Result<LoadedModel> {
    load_model_as(path, WeightFormat::AsStored, pool, progress)
}

/// [`load_model`] with the matrices stored as `format` says: converted by
/// the same code a reload into a model of that format runs, so the two hold
/// the same bytes.
pub fn load_model_as(
    path: &Path,
    format: WeightFormat,
    pool: &Pool,
    progress: &mut dyn FnMut(&LoadProgress),
) -> anyhow::Result<LoadedModel> {
    let name = if path.is_dir() {
        path.file_name()
    } else {
        path.file_stem()
    }
    .map(|s| s.to_string_lossy().into_owned())
    .unwrap_or_else(|| "model".to_string());
    let (config, weights, tokenizer, chat_template) = if path.is_dir() {
        let cfg = hf_config(path)?;
        let weights = load_hf_weights(path, &cfg, format, pool, progress)?;
        let (tok, tmpl) = hf_tokenizer(path, &cfg)?;
        (cfg, weights, tok, tmpl)
    } else {
        let gguf =
            GgufFile::open(path).with_context(|| format!("cannot read GGUF {}", path.display()))?;
        let cfg = gguf_config(&gguf)?;
        let weights = load_gguf_weights(&gguf, &cfg, format, pool, progress)?;
        let tok = Tokenizer::from_gguf(&gguf)?;
        let tmpl = gguf_chat_template(&gguf, &tok);
        (cfg, weights, tok, tmpl)
    };
    if tokenizer.vocab_size() > config.vocab_size {
        bail!(
            "tokenizer has {} tokens but the model's vocabulary is {}",
            tokenizer.vocab_size(),
            config.vocab_size
        );
    }
    Ok(LoadedModel {
        model: Model::new(config, weights),
        tokenizer,
        chat_template,
        name,
        source: path.to_path_buf(),
    })
}

/// Reads only the config and weights of a checkpoint (for reloading weights
/// in place of a running model's): the result must match `expected` exactly.
pub fn load_weights_matching(
    path: &Path,
    expected: &ModelConfig,
    pool: &Pool,
    progress: &mut dyn FnMut(&LoadProgress),
) -> anyhow::Result<Weights> {
    let check = |cfg: &ModelConfig| -> anyhow::Result<()> {
        if cfg != expected {
            bail!(
                "checkpoint {} has config {cfg:?}, expected {expected:?}",
                path.display()
            );
        }
        Ok(())
    };
    if path.is_dir() {
        let cfg = hf_config(path)?;
        check(&cfg)?;
        load_hf_weights(path, &cfg, WeightFormat::AsStored, pool, progress)
    } else {
        let gguf =
            GgufFile::open(path).with_context(|| format!("cannot read GGUF {}", path.display()))?;
        let cfg = gguf_config(&gguf)?;
        check(&cfg)?;
        load_gguf_weights(&gguf, &cfg, WeightFormat::AsStored, pool, progress)
    }
}

/// [`load_weights_matching`] for reloading into `running` (weights of the
/// config `expected`): a Hugging Face checkpoint is converted to the
/// running model's format tensor by tensor, as [`super::reload_weights_into`]
/// converts it; a GGUF file keeps its own formats.
pub fn load_weights_like(
    path: &Path,
    running: &Weights,
    expected: &ModelConfig,
    pool: &Pool,
    progress: &mut dyn FnMut(&LoadProgress),
) -> anyhow::Result<Weights> {
    if !path.is_dir() {
        return load_weights_matching(path, expected, pool, progress);
    }
    let cfg = hf_config(path)?;
    if !config_mismatches(&cfg, expected).is_empty() {
        bail!(
            "checkpoint {} has config {cfg:?}, expected {expected:?}",
            path.display()
        );
    }
    let shards = open_hf_shards(path)?;
    let plan = WeightsPlan::new(expected, &running_quant(running));
    load_planned(&shards, plan, pool, progress)
}
