//! The models tests run on: the shipped SmolLM2 GGUF (fetched by the test
//! command) and tiny random checkpoints written on the spot.

use std::path::{Path, PathBuf};

use pdkv_model::Arch;

/// Where `pdkv model fetch` puts the default model, under `$HOME`.
const SMOLLM2_IN_HOME: &str = ".cache/pdkv/models/SmolLM2-135M-Instruct.Q4_1.gguf";

/// The SmolLM2 GGUF (`$PDKV_SMOLLM2_GGUF`, else the fetched default), if
/// this machine has it. Without it `test` is skipped with a line saying so,
/// except under CI (`CI` set), where its absence fails the test.
pub fn smollm2(test: &str) -> Option<PathBuf> {
    let mut candidates = Vec::new();
    if let Some(p) = std::env::var_os("PDKV_SMOLLM2_GGUF") {
        candidates.push(PathBuf::from(p));
    }
    if let Some(home) = std::env::var_os("HOME") {
        candidates.push(PathBuf::from(home).join(SMOLLM2_IN_HOME));
    }
    let found = candidates.into_iter().find(|p| p.is_file());
    if found.is_none() {
        assert!(
            std::env::var_os("CI").is_none(),
            "{test}: the SmolLM2 GGUF is missing under CI (scripts/test.sh fetches it)"
        );
        println!(
            "skipping {test}: no SmolLM2 GGUF (set PDKV_SMOLLM2_GGUF or run `pdkv model fetch`)"
        );
    }
    found
}

/// A random checkpoint of `arch` and `preset` (`tiny`, ...) drawn from
/// `seed`, in a new temporary directory (removed on drop).
pub fn checkpoint(arch: Arch, preset: &str, seed: u64) -> tempfile::TempDir {
    let dir = tempfile::tempdir().expect("tempdir");
    pdkv_model::init::write_random_checkpoint(arch, preset, seed, dir.path())
        .expect("write checkpoint");
    dir
}

/// Copies a Hugging Face checkpoint directory's files but its safetensors
/// (config, tokenizer, generation config) from `from` to `to`.
pub fn copy_side_files(from: &Path, to: &Path) {
    for f in [
        "config.json",
        "tokenizer.json",
        "tokenizer_config.json",
        "generation_config.json",
    ] {
        std::fs::copy(from.join(f), to.join(f))
            .unwrap_or_else(|e| panic!("copy {} to {}: {e}", from.join(f).display(), to.display()));
    }
}
