//! In-process engines for the crates' integration tests: the tiny random
//! checkpoint of an architecture, written to a temporary directory, loaded
//! by the real loader and served by a real engine.

use std::path::Path;

use pdkv_engine::{Engine, EngineConfig, EngineHandle, KvConnector};
use pdkv_model::Arch;
use pdkv_vmem::Pool;

/// A running engine and the directory of its checkpoint; shut down on drop.
pub struct Started {
    pub handle: EngineHandle,
    dir: tempfile::TempDir,
}

impl Started {
    /// The checkpoint the engine loaded (for weight reloads).
    pub fn checkpoint(&self) -> &Path {
        self.dir.path()
    }
}

impl std::ops::Deref for Started {
    type Target = EngineHandle;
    fn deref(&self) -> &EngineHandle {
        &self.handle
    }
}

impl Drop for Started {
    fn drop(&mut self) {
        self.handle.shutdown();
    }
}

/// An engine on the tiny random model of `arch` (seed 7: the same weights
/// every time), with `connector` when given, or why it could not start.
pub fn start(
    arch: Arch,
    connector: Option<Box<dyn KvConnector>>,
    config: EngineConfig,
) -> anyhow::Result<Started> {
    let dir = tempfile::tempdir()?;
    pdkv_model::init::write_random_checkpoint(arch, "tiny", 7, dir.path())?;
    let pool = Pool::default();
    let model = pdkv_model::load_model(dir.path(), &pool, &mut |_| {})?;
    let handle = Engine::start_with_connector(model, pool, config, connector)?;
    Ok(Started { handle, dir })
}

/// A deterministic prompt of `len` token ids below 500 (below every tiny
/// model's special tokens).
pub fn prompt(seed: u64, len: usize) -> Vec<u32> {
    (0..len as u64)
        .map(|i| (pdkv_engine::sampling::splitmix64(seed.wrapping_mul(1_000_003) ^ i) % 500) as u32)
        .collect()
}
