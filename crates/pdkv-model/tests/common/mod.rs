//! What several of these test files need.

use std::path::PathBuf;

/// The SmolLM2 GGUF (`PDKV_SMOLLM2_GGUF`, or the model cache). `None` with
/// a note where the machine has none; CI must have it (it fetches it first).
pub fn smollm2_or_skip() -> Option<PathBuf> {
    let candidates = [
        std::env::var_os("PDKV_SMOLLM2_GGUF").map(PathBuf::from),
        std::env::var_os("HOME")
            .map(|h| PathBuf::from(h).join(".cache/pdkv/models/SmolLM2-135M-Instruct.Q4_1.gguf")),
    ];
    let found = candidates.into_iter().flatten().find(|p| p.is_file());
    if found.is_none() {
        if std::env::var_os("CI").is_some() {
            panic!("CI must fetch SmolLM2 first (pdkv model fetch)");
        }
        println!("SKIPPED: SmolLM2 GGUF not found (run `pdkv model fetch`)");
    }
    found
}
