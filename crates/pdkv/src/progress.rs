//! A model-load progress display on stderr: one line redrawn in place on a
//! terminal, or a log line every 10% otherwise.

use std::io::{IsTerminal, Write};
use std::path::PathBuf;

use anyhow::Context;
use pdkv_model::{LoadProgress, LoadedModel, WeightFormat};
use pdkv_vmem::Pool;

use crate::fetch;

/// Generated tokens and the seconds they took: a bench's decode rate.
#[derive(Clone, Copy, Debug, Default)]
pub struct Throughput {
    pub tokens: usize,
    pub seconds: f64,
}

impl Throughput {
    pub fn tok_s(self) -> f64 {
        self.tokens as f64 / self.seconds.max(1e-9)
    }
}

/// Loads `--model` into `pool`, showing progress; without `--model`, the
/// default model (fetched on first use). Returns the path it loaded.
pub fn load_model(model: Option<PathBuf>, pool: &Pool) -> anyhow::Result<(PathBuf, LoadedModel)> {
    load_model_as(model, WeightFormat::AsStored, pool)
}

/// [`load_model`] with the weights stored as `format` says.
pub fn load_model_as(
    model: Option<PathBuf>,
    format: WeightFormat,
    pool: &Pool,
) -> anyhow::Result<(PathBuf, LoadedModel)> {
    let path = match model {
        Some(p) => p,
        None => fetch::default_model_path()?,
    };
    tracing::info!(path = %path.display(), weight_format = %format, "loading model");
    let mut display = LoadDisplay::new();
    let loaded = pdkv_model::load_model_as(&path, format, pool, &mut |p| display.update(p))
        .with_context(|| format!("loading {}", path.display()))?;
    display.finish();
    Ok((path, loaded))
}

/// The tokens of `text` as a user's turn in `model`'s chat template, the
/// assistant's turn opened (the benches' chat prompts).
pub fn user_prompt(model: &LoadedModel, text: &str) -> anyhow::Result<Vec<u32>> {
    let template = model
        .chat_template
        .as_ref()
        .context("the model has no chat template")?;
    let prompt = template.render(&[pdkv_model::ChatMessage::new("user", text)], true)?;
    model.tokenizer.encode(&prompt, false)
}

const MIB: f64 = 1024.0 * 1024.0;

pub struct LoadDisplay {
    /// What the line says is under way (`loading model`).
    label: &'static str,
    terminal: bool,
    /// Last percentage shown, to avoid redrawing the same line.
    last_percent: Option<u64>,
}

impl LoadDisplay {
    pub fn new() -> LoadDisplay {
        LoadDisplay::labelled("loading model")
    }

    /// A display whose line starts with `label` (`exporting`).
    pub fn labelled(label: &'static str) -> LoadDisplay {
        LoadDisplay {
            label,
            terminal: std::io::stderr().is_terminal(),
            last_percent: None,
        }
    }

    pub fn update(&mut self, p: &LoadProgress) {
        let percent = p
            .bytes_done
            .saturating_mul(100)
            .checked_div(p.bytes_total)
            .unwrap_or(100);
        let step = if self.terminal { 1 } else { 10 };
        let due = match self.last_percent {
            None => true,
            Some(last) => percent / step > last / step || (percent == 100 && last != 100),
        };
        if !due {
            return;
        }
        self.last_percent = Some(percent);
        let line = format!(
            "{}: {percent:>3}% ({:.1}/{:.1} MiB, {}/{} tensors)",
            self.label,
            p.bytes_done as f64 / MIB,
            p.bytes_total as f64 / MIB,
            p.tensors_done,
            p.tensors_total
        );
        let mut err = std::io::stderr().lock();
        if self.terminal {
            let _ = write!(err, "\r{line}");
            let _ = err.flush();
        } else {
            let _ = writeln!(err, "{line}");
        }
    }

    /// Ends the in-place line.
    pub fn finish(&mut self) {
        if self.terminal && self.last_percent.is_some() {
            let _ = writeln!(std::io::stderr());
        }
    }
}
