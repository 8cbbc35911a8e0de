//! Weights in the trainer's format: a Hugging Face checkpoint (BF16, F16
//! or F32 safetensors, possibly sharded) loaded or reloaded into a model
//! served in any format, converted by one code path, and a served model
//! exported back as a BF16 Hugging Face checkpoint.

use std::path::Path;
use std::time::Instant;

use pdkv_model::export::export_hf;
use pdkv_model::init::write_random_checkpoint;
use pdkv_model::loader::{reload_weights_into, ReloadError, WeightFormat};
use pdkv_model::qtype::QType;
use pdkv_model::safetensors::{write_f32, SafetensorsFile};
use pdkv_model::weights::{DType, Weights};
use pdkv_model::{load_model, load_model_as, Arch, KvCache, KvDtype, LoadedModel, Model, SeqInput};
use pdkv_model::{ChatMessage, Workspace};
use pdkv_testkit::models::{copy_side_files, smollm2};
use pdkv_vmem::Pool;

// ------------------------------------------------------------ helpers ----

fn tmpdir() -> tempfile::TempDir {
    tempfile::tempdir().expect("temp dir")
}

fn load_as(path: &Path, format: WeightFormat) -> LoadedModel {
    load_model_as(path, format, &Pool::default(), &mut |_| {})
        .unwrap_or_else(|e| panic!("loading {} as {format}: {e:#}", path.display()))
}

fn format(q: QType) -> WeightFormat {
    WeightFormat::Convert(DType::Quant(q))
}

/// Every tensor of a weights region: its place, shape, format and bytes.
fn tensors(w: &Weights) -> Vec<(usize, Vec<usize>, DType, Vec<u8>)> {
    w.tensors_by_offset()
        .iter()
        .map(|t| {
            // SAFETY: the tensor lies inside its weights region, and nothing
            // writes the region while the test reads it.
            let bytes = unsafe { w.region.slice::<u8>(t.offset, t.bytes()).to_vec() };
            (t.offset, t.shape.clone(), t.dtype, bytes)
        })
        .collect()
}

/// Asserts that two sets of weights hold the same tensors, bit for bit,
/// naming the first that differs.
fn assert_same_weights(a: &Weights, b: &Weights, what: &str) {
    let (ta, tb) = (tensors(a), tensors(b));
    assert_eq!(ta.len(), tb.len(), "{what}: tensor counts differ");
    let names: std::collections::HashMap<usize, String> =
        a.named().into_iter().map(|(n, t)| (t.offset, n)).collect();
    for (x, y) in ta.iter().zip(&tb) {
        let name = &names[&x.0];
        assert_eq!(
            (x.0, &x.1, x.2),
            (y.0, &y.1, y.2),
            "{what}: `{name}` is laid out differently"
        );
        assert!(x.3 == y.3, "{what}: `{name}` holds other bytes");
    }
}

/// Greedy tokens after `prompt` (`n` of them), with a fresh KV cache.
fn greedy(model: &Model, prompt: &[u32], n: usize) -> Vec<u32> {
    let prompts = [prompt.to_vec()];
    let pool = Pool::default();
    let mut out =
        pdkv_model::bench::greedy_continuations(model, &pool, &prompts, n, 1, KvDtype::F32)
            .unwrap();
    out.remove(0)
}

/// The last position's logits after `prompt`.
fn logits(model: &Model, prompt: &[u32]) -> Vec<f32> {
    let pool = Pool::default();
    let cfg = model.config();
    let blocks = prompt.len().div_ceil(16);
    let kv = KvCache::new(&pool, cfg, blocks, KvDtype::F32).unwrap();
    let mut ws = Workspace::new(&pool, cfg, prompt.len()).unwrap();
    let table: Vec<u32> = (0..blocks as u32).collect();
    let seq = SeqInput {
        tokens: prompt,
        start_pos: 0,
        block_table: &table,
        want_logits: true,
    };
    let mut out = Vec::new();
    model.forward(&kv, &mut ws, &[seq], &mut out).unwrap();
    out.split_off(out.len() - cfg.vocab_size)
}

/// Chat prompts of `lm`, tokenised.
fn chat_prompts(lm: &LoadedModel) -> Vec<Vec<u32>> {
    let template = lm.chat_template.as_ref().expect("a chat template");
    ["What is the capital of France?", "Count to five.", "Hi!"]
        .iter()
        .map(|q| {
            let msgs = [ChatMessage {
                role: "user".into(),
                content: q.to_string(),
                ..Default::default()
            }];
            let text = template.render(&msgs, true).unwrap();
            lm.tokenizer.encode(&text, false).unwrap()
        })
        .collect()
}

/// Every tensor of a checkpoint directory's `model.safetensors`, as f32.
pub(crate) fn read_all(dir: &Path) -> Vec<(String, Vec<usize>, Vec<f32>)> {
    let st = SafetensorsFile::open(&dir.join("model.safetensors")).unwrap();
    st.tensors
        .iter()
        .map(|(name, e)| {
            let mut v = vec![0f32; e.shape.iter().product()];
            st.read_f32(name, &mut v).unwrap();
            (name.clone(), e.shape.clone(), v)
        })
        .collect()
}

/// Writes the tensors of `dir`'s `model.safetensors` as two shards with a
/// `model.safetensors.index.json` into `out`, beside `dir`'s other files.
fn write_two_shards(dir: &Path, out: &Path) {
    copy_side_files(dir, out);
    let all = read_all(dir);
    let (first, second) = all.split_at(all.len() / 2);
    let mut map = serde_json::Map::new();
    for (file, part) in [
        ("model-00001-of-00002.safetensors", first),
        ("model-00002-of-00002.safetensors", second),
    ] {
        write_f32(&out.join(file), part).unwrap();
        for (name, _, _) in part {
            map.insert(name.clone(), file.into());
        }
    }
    let index = serde_json::json!({"metadata": {}, "weight_map": map});
    std::fs::write(
        out.join("model.safetensors.index.json"),
        serde_json::to_string_pretty(&index).unwrap(),
    )
    .unwrap();
}

// -------------------------------------------------------------- tests ----

/// A random checkpoint reloaded into a model served in Q8_0, Q4_1, F16
/// (and the other formats) that was loaded from another random checkpoint
/// holds exactly what a fresh load of it in that format holds.
#[test]
fn a_checkpoint_reloaded_into_a_converted_model_equals_a_fresh_load_in_that_format() {
    for arch in [Arch::Llama, Arch::Qwen3] {
        let (a, b) = (tmpdir(), tmpdir());
        write_random_checkpoint(arch, "tiny", 1, a.path()).unwrap();
        write_random_checkpoint(arch, "tiny", 2, b.path()).unwrap();
        for q in [
            QType::Q8_0,
            QType::Q4_1,
            QType::F16,
            QType::BF16,
            QType::Q4_0,
            QType::Q5_1,
            QType::Q6_K,
        ] {
            let what = format!("{arch:?} {q:?}");
            let running = load_as(a.path(), format(q));
            assert_eq!(
                running.model.weights().layers[0].wq.dtype,
                // As the loader keeps the planned format (Q4_1 packed).
                DType::Quant(
                    WeightFormat::Convert(DType::Quant(q))
                        .planned(false, 64)
                        .unwrap()
                        .loaded()
                ),
                "{what}"
            );
            let cfg = running.model.config().clone();
            reload_weights_into(running.model.weights(), &cfg, b.path(), &mut |_| {})
                .unwrap_or_else(|e| panic!("{what}: {e:#}"));
            let fresh = load_as(b.path(), format(q));
            assert_same_weights(running.model.weights(), fresh.model.weights(), &what);
        }
    }
}

/// A reload into a converted model that finds a tensor of the wrong shape
/// (late in the plan, after tensors a careless writer would have written)
/// names it and writes nothing.
#[test]
fn a_wrong_shape_refuses_a_converting_reload_before_any_write() {
    let (a, b) = (tmpdir(), tmpdir());
    write_random_checkpoint(Arch::Llama, "tiny", 1, a.path()).unwrap();
    write_random_checkpoint(Arch::Llama, "tiny", 2, b.path()).unwrap();
    let bad_name = "model.layers.1.mlp.up_proj.weight";
    let mut all = read_all(b.path());
    let bad = all.iter_mut().find(|t| t.0 == bad_name).unwrap();
    bad.1 = vec![bad.1[1], bad.1[0]];
    write_f32(&b.path().join("model.safetensors"), &all).unwrap();
    let running = load_as(a.path(), format(QType::Q4_1));
    let cfg = running.model.config().clone();
    let before = tensors(running.model.weights());
    match reload_weights_into(running.model.weights(), &cfg, b.path(), &mut |_| {}) {
        Err(ReloadError::Incompatible(e)) => {
            assert!(format!("{e:#}").contains(bad_name), "{e:#}")
        }
        other => panic!("a wrong shape gave {other:?}"),
    }
    assert!(
        tensors(running.model.weights()) == before,
        "the refused reload wrote"
    );
}

/// Two shards with an index load as the single file does, in the stored
/// and in a converted format; a stray safetensors file beside the shards
/// that the index does not name is not read.
#[test]
fn a_sharded_checkpoint_loads_as_the_single_file_does() {
    let (single, sharded) = (tmpdir(), tmpdir());
    write_random_checkpoint(Arch::Qwen3, "tiny", 5, single.path()).unwrap();
    write_two_shards(single.path(), sharded.path());
    std::fs::copy(
        single.path().join("model.safetensors"),
        sharded.path().join("consolidated.safetensors"),
    )
    .unwrap();
    for f in [WeightFormat::AsStored, format(QType::Q8_0)] {
        let one = load_as(single.path(), f);
        let two = load_as(sharded.path(), f);
        assert_same_weights(one.model.weights(), two.model.weights(), &f.to_string());
    }
}

/// A model exported as a BF16 Hugging Face checkpoint loads back with the
/// same config, tokenizer and template, its weights the served ones
/// rounded to bf16 (an f32 model here, so every value checks).
#[test]
fn an_exported_checkpoint_loads_back_with_the_weights_rounded_to_bf16() {
    let (src, out) = (tmpdir(), tmpdir());
    write_random_checkpoint(Arch::Qwen3, "tiny", 3, src.path()).unwrap();
    let lm = load_model(src.path(), &Pool::default(), &mut |_| {}).unwrap();
    let summary = export_hf(&lm, out.path(), &mut |_| {}).unwrap();
    let back = load_model(out.path(), &Pool::default(), &mut |_| {}).unwrap();
    assert_eq!(back.model.config(), lm.model.config());
    assert_eq!(
        back.chat_template.as_ref().map(|t| t.source()),
        lm.chat_template.as_ref().map(|t| t.source())
    );
    assert_eq!(chat_prompts(&back), chat_prompts(&lm));
    assert_eq!(back.tokenizer.eos_token_ids(), lm.tokenizer.eos_token_ids());
    let st = SafetensorsFile::open(&out.path().join("model.safetensors")).unwrap();
    assert_eq!(st.tensors.len(), summary.tensors);
    let (w, wb) = (lm.model.weights(), back.model.weights());
    for ((name, t), (name_b, tb)) in w.named().into_iter().zip(wb.named()) {
        assert_eq!(name, name_b);
        let mut want = Vec::new();
        pdkv_model::export::dequantize_tensor(w, t, &mut want);
        let mut got = Vec::new();
        pdkv_model::export::dequantize_tensor(wb, tb, &mut got);
        let rounded: Vec<u32> = want
            .iter()
            .map(|&v| half::bf16::from_f32(v).to_f32().to_bits())
            .collect();
        let got: Vec<u32> = got.iter().map(|v| v.to_bits()).collect();
        assert!(got == rounded, "`{name}` is not the served values in bf16");
    }
}

/// SmolLM2's Q4_1 GGUF exported to a BF16 Hugging Face checkpoint: reloaded
/// into the running Q4_1 model it holds exactly what a fresh load of the
/// export as Q4_1 holds (the same greedy tokens follow), and loaded as BF16
/// it has the GGUF's config and logits close to the Q4_1 model's. Prints
/// how long the converting reload takes beside a reload of the GGUF.
#[test]
fn smollm2_exported_to_hf_reloads_into_q4_1_as_a_fresh_q4_1_load() {
    let Some(gguf) = smollm2("smollm2_exported_to_hf_reloads_into_q4_1_as_a_fresh_q4_1_load")
    else {
        return;
    };
    let out = tmpdir();
    let running = load_model(&gguf, &Pool::default(), &mut |_| {}).unwrap();
    let t = Instant::now();
    let summary = export_hf(&running, out.path(), &mut |_| {}).unwrap();
    println!(
        "export: {} tensors, {} bytes of BF16 weights, {} bytes in all, {:.2} s",
        summary.tensors,
        summary.weights_bytes,
        summary.total_bytes,
        t.elapsed().as_secs_f64()
    );
    let cfg = running.model.config().clone();
    let w = running.model.weights();
    let before = greedy_all(&running);

    let t = Instant::now();
    reload_weights_into(w, &cfg, &gguf, &mut |_| {}).unwrap();
    let gguf_s = t.elapsed().as_secs_f64();
    let t = Instant::now();
    reload_weights_into(w, &cfg, out.path(), &mut |_| {}).unwrap();
    let hf_s = t.elapsed().as_secs_f64();
    println!(
        "reload into the running Q4_1 model: the GGUF {:.3} s, the BF16 export converted {:.3} s",
        gguf_s, hf_s
    );

    let fresh = load_as(out.path(), format(QType::Q4_1));
    assert_same_weights(w, fresh.model.weights(), "reloaded vs fresh Q4_1");
    let (a, b) = (greedy_all(&running), greedy_all(&fresh));
    assert_eq!(a, b, "greedy tokens differ between reloaded and fresh");
    let same = before.iter().zip(&a).filter(|(x, y)| x == y).count();
    println!(
        "greedy after the round trip: {same}/{} prompts unchanged from the GGUF's",
        a.len()
    );
    exported_bf16_is_close(&running, &gguf, out.path());
}

/// Greedy tokens of `lm` after each chat prompt.
fn greedy_all(lm: &LoadedModel) -> Vec<Vec<u32>> {
    chat_prompts(lm)
        .iter()
        .map(|p| greedy(&lm.model, p, 8))
        .collect()
}

/// The export at `dir` of the GGUF `gguf` (`q4` loaded), loaded as stored
/// (BF16): the GGUF model's config, tokens and template, and logits close
/// to the Q4_1 model's, with f32 activations (only the weights' bf16
/// rounding differs: [`EXPORT_LOGITS_TOL_F32`]) and with each model's
/// default activations (int8 blocks for Q4_1, bf16 or f32 for BF16:
/// [`EXPORT_LOGITS_TOL`]).
fn exported_bf16_is_close(q4: &LoadedModel, gguf: &Path, dir: &Path) {
    let bf = load_model(dir, &Pool::default(), &mut |_| {}).unwrap();
    assert_eq!(bf.model.config(), q4.model.config());
    assert_eq!(bf.tokenizer.bos_token_id(), q4.tokenizer.bos_token_id());
    assert_eq!(bf.tokenizer.eos_token_ids(), q4.tokenizer.eos_token_ids());
    assert_eq!(
        bf.chat_template.as_ref().map(|t| t.source()),
        q4.chat_template.as_ref().map(|t| t.source())
    );
    assert_eq!(chat_prompts(&bf), chat_prompts(q4));
    assert_eq!(
        bf.model.weights().layers[0].wq.dtype,
        DType::Quant(QType::BF16)
    );
    let wide = |p: &Path| {
        let lm = load_model(p, &Pool::default(), &mut |_| {}).unwrap();
        lm.model.with_int8_activations(false)
    };
    let (q4_f32, bf_f32) = (wide(gguf), wide(dir));
    for p in chat_prompts(q4) {
        for (what, a, b, tol) in [
            ("f32 activations", &q4_f32, &bf_f32, EXPORT_LOGITS_TOL_F32),
            (
                "default activations",
                &q4.model,
                &bf.model,
                EXPORT_LOGITS_TOL,
            ),
        ] {
            let (a, b) = (logits(a, &p), logits(b, &p));
            let (top, diff) = (crate::max_abs(&a), crate::max_abs_diff(&a, &b));
            println!(
                "bf16 export vs Q4_1, {what}: max |Δlogit| {diff:.4} of max |logit| {top:.2} ({:.2e}); argmax {} vs {}",
                diff / top,
                pdkv_model::bench::argmax(&a),
                pdkv_model::bench::argmax(&b)
            );
            assert!(diff <= tol * top, "{what}: {diff} of {top}");
        }
    }
}

/// How far the BF16 export's logits may stray from the Q4_1 model's with
/// f32 activations, relative to the largest logit: the weights differ only
/// by the bf16 rounding of the dequantised values (measured: up to 5.7e-3
/// on SmolLM2's three prompts).
const EXPORT_LOGITS_TOL_F32: f32 = 1e-2;

/// As [`EXPORT_LOGITS_TOL_F32`] with each model's default activations,
/// whose roundings differ too (int8 per 32-value block against bf16 or
/// f32): measured up to 4.8e-2, as far as int8 activations stray from
/// transformers' f32 logits on the same weights (`numerics.rs`).
const EXPORT_LOGITS_TOL: f32 = 6e-2;

/// SmolLM2's GGUF loaded in another format: as F32 it computes the stored
/// blocks' bits (f32 activations: the block kernels' f32 path is the f32
/// path on the dequantised weights), and requantised to Q8_0 (Q/K rows
/// un-permuted before quantising) its logits stay close to the Q4_1
/// model's.
#[test]
fn smollm2_gguf_loaded_in_another_format_computes_as_the_stored_one() {
    let Some(gguf) = smollm2("smollm2_gguf_loaded_in_another_format_computes_as_the_stored_one")
    else {
        return;
    };
    let stored = load_as(&gguf, WeightFormat::AsStored);
    let wide = load_as(&gguf, WeightFormat::Convert(DType::F32));
    let q8 = load_as(&gguf, format(QType::Q8_0));
    assert_eq!(wide.model.weights().layers[0].wq.dtype, DType::F32);
    assert_eq!(
        q8.model.weights().layers[0].wq.dtype,
        DType::Quant(QType::Q8_0)
    );
    let prompts = chat_prompts(&stored);
    let (stored, wide) = (
        stored.model.with_int8_activations(false),
        wide.model.with_int8_activations(false),
    );
    for p in &prompts {
        let (a, b) = (logits(&stored, p), logits(&wide, p));
        let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
        assert!(bits(&a) == bits(&b), "f32 weights differ from the blocks");
        let c = logits(&q8.model, p);
        let (top, diff) = (crate::max_abs(&a), crate::max_abs_diff(&a, &c));
        println!("GGUF as Q8_0 vs Q4_1: max |Δlogit| {diff:.4} of {top:.2}");
        assert!(diff <= EXPORT_LOGITS_TOL * top, "{diff} of {top}");
    }
}
