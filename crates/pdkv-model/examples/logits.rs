//! Writes the next-token logits of a token-id prompt, for comparison with
//! other implementations.
//!
//! `logits MODEL_PATH OUT.f32 ID ID ...` (f32 little-endian, one vocab row).

use pdkv_model::{load_model, KvCache, KvDtype, SeqInput, Workspace, BLOCK_SIZE};
use pdkv_vmem::Pool;

fn main() -> anyhow::Result<()> {
    let mut args = std::env::args().skip(1);
    let usage = "usage: logits MODEL_PATH OUT.f32 ID...";
    let path = args.next().ok_or_else(|| anyhow::anyhow!(usage))?;
    let out = args.next().ok_or_else(|| anyhow::anyhow!(usage))?;
    let ids: Vec<u32> = args.map(|a| a.parse()).collect::<Result<_, _>>()?;
    anyhow::ensure!(!ids.is_empty(), "{usage}");
    let pool = Pool::default();
    let m = load_model(path.as_ref(), &pool, &mut |_| {})?;
    let cfg = m.model.config();
    let blocks = ids.len().div_ceil(BLOCK_SIZE);
    let kv = KvCache::new(&pool, cfg, blocks, KvDtype::F32)?;
    let mut ws = Workspace::new(&pool, cfg, ids.len())?;
    let table: Vec<u32> = (0..blocks as u32).collect();
    let mut logits = Vec::new();
    let input = SeqInput {
        tokens: &ids,
        start_pos: 0,
        block_table: &table,
        want_logits: true,
    };
    m.model.forward(&kv, &mut ws, &[input], &mut logits)?;
    let bytes: Vec<u8> = logits.iter().flat_map(|v| v.to_le_bytes()).collect();
    std::fs::write(&out, bytes)?;
    Ok(())
}
