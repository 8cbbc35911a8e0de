//! `pdkv model export`: a model written as a Hugging Face checkpoint
//! directory (BF16 safetensors, config, tokenizer, chat template), the
//! format RL trainers hold; `pdkv serve` loads it back in any format.

use std::path::PathBuf;
use std::time::Instant;

use anyhow::Context;
use clap::{Args, ValueEnum};
use pdkv_vmem::Pool;

use crate::progress::{self, LoadDisplay};

#[derive(Args)]
pub struct ExportArgs {
    /// What to write: `hf`, a Hugging Face checkpoint directory with the
    /// weights in BF16.
    #[arg(long, value_enum, default_value = "hf")]
    pub format: ExportFormat,
    /// The directory to write (created if needed; files of the same names
    /// are replaced).
    #[arg(long)]
    pub out: PathBuf,
    /// A `.gguf` file or a Hugging Face checkpoint directory (default: the
    /// model `pdkv serve` loads without `--model`).
    #[arg(long)]
    pub model: Option<PathBuf>,
}

#[derive(Clone, Copy, Debug, ValueEnum)]
pub enum ExportFormat {
    Hf,
}

/// Loads the model, writes it, and prints the directory on stdout (the
/// sizes and time on stderr).
pub fn run(args: ExportArgs) -> anyhow::Result<()> {
    let ExportFormat::Hf = args.format;
    let pool = Pool::default();
    let (path, loaded) = progress::load_model(args.model, &pool)?;
    let started = Instant::now();
    let mut display = LoadDisplay::labelled("exporting");
    let summary = pdkv_model::export::export_hf(&loaded, &args.out, &mut |p| display.update(p))
        .with_context(|| format!("exporting {} to {}", path.display(), args.out.display()))?;
    display.finish();
    eprintln!(
        "exported {} to {}: {} tensors, {} bytes of BF16 weights, {} bytes in all, in {:.2} s",
        path.display(),
        summary.dir.display(),
        summary.tensors,
        summary.weights_bytes,
        summary.total_bytes,
        started.elapsed().as_secs_f64()
    );
    println!("{}", summary.dir.display());
    Ok(())
}
