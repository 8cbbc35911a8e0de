//! Checkpoint loading: the GGUF parser and dequantisers, random checkpoints
//! round-tripping through the Hugging Face loader, refusal of bad
//! checkpoints, and the real SmolLM2 GGUF against fixtures made by
//! `scripts/make_tokenizer_fixture.py` with transformers.

use std::path::Path;

use half::f16;
use pdkv_model::gguf::{dequantize, GgmlType, GgufError, GgufFile, GgufValue};
use pdkv_model::init::{preset_config, write_random_checkpoint};
use pdkv_model::safetensors::{write_f32, SafetensorsFile};
use pdkv_model::{load_model, Arch, ChatMessage, KvDtype, LoadedModel};
use pdkv_testkit::models::smollm2;
use pdkv_vmem::Pool;
use serde_json::Value;

// ------------------------------------------------------------ helpers ----

/// Builds GGUF v3 images for the parser tests.
#[derive(Default)]
struct GgufBuilder {
    kv: Vec<u8>,
    n_kv: u64,
    infos: Vec<u8>,
    n_tensors: u64,
    data: Vec<u8>,
}

impl GgufBuilder {
    fn string(buf: &mut Vec<u8>, s: &str) {
        buf.extend((s.len() as u64).to_le_bytes());
        buf.extend(s.as_bytes());
    }

    /// Counts a key-value pair and writes its key and GGUF type `ty`; the
    /// caller writes the value.
    fn kv_head(&mut self, k: &str, ty: u32) {
        Self::string(&mut self.kv, k);
        self.kv.extend(ty.to_le_bytes());
        self.n_kv += 1;
    }

    fn kv_u32(&mut self, k: &str, v: u32) -> &mut Self {
        self.kv_head(k, 4);
        self.kv.extend(v.to_le_bytes());
        self
    }

    fn kv_f32(&mut self, k: &str, v: f32) -> &mut Self {
        self.kv_head(k, 6);
        self.kv.extend(v.to_le_bytes());
        self
    }

    fn kv_str(&mut self, k: &str, v: &str) -> &mut Self {
        self.kv_head(k, 8);
        Self::string(&mut self.kv, v);
        self
    }

    fn kv_str_array(&mut self, k: &str, v: &[&str]) -> &mut Self {
        self.kv_head(k, 9);
        self.kv.extend(8u32.to_le_bytes());
        self.kv.extend((v.len() as u64).to_le_bytes());
        for s in v {
            Self::string(&mut self.kv, s);
        }
        self
    }

    /// Adds a tensor; `dims` innermost first, as GGUF stores them.
    fn tensor(&mut self, name: &str, dims: &[u64], ty: u32, bytes: &[u8]) -> &mut Self {
        while !self.data.len().is_multiple_of(32) {
            self.data.push(0);
        }
        Self::string(&mut self.infos, name);
        self.infos.extend((dims.len() as u32).to_le_bytes());
        for d in dims {
            self.infos.extend(d.to_le_bytes());
        }
        self.infos.extend(ty.to_le_bytes());
        self.infos.extend((self.data.len() as u64).to_le_bytes());
        self.data.extend(bytes);
        self.n_tensors += 1;
        self
    }

    fn build(&self) -> Vec<u8> {
        let mut out = b"GGUF".to_vec();
        out.extend(3u32.to_le_bytes());
        out.extend(self.n_tensors.to_le_bytes());
        out.extend(self.n_kv.to_le_bytes());
        out.extend(&self.kv);
        out.extend(&self.infos);
        while !out.len().is_multiple_of(32) {
            out.push(0);
        }
        out.extend(&self.data);
        out
    }
}

fn f16b(x: f32) -> [u8; 2] {
    f16::from_f32(x).to_le_bytes()
}

/// A Q4_1 block: d = 0.5, m = -1, value j = (j < 16 ? j : 31 - j).
fn q4_1_block() -> (Vec<u8>, Vec<f32>) {
    let mut b = Vec::new();
    b.extend(f16b(0.5));
    b.extend(f16b(-1.0));
    for j in 0..16u8 {
        b.push(j | ((15 - j) << 4));
    }
    // Worked by hand: low nibble of byte j is j, high nibble is 15 - j.
    let expected = (0..32)
        .map(|j| {
            if j < 16 {
                0.5 * j as f32 - 1.0
            } else {
                0.5 * (31 - j) as f32 - 1.0
            }
        })
        .collect();
    (b, expected)
}

/// A Q8_0 block: d = 0.25, q_j = 3j - 50.
fn q8_0_block() -> (Vec<u8>, Vec<f32>) {
    let mut b = Vec::new();
    b.extend(f16b(0.25));
    for j in 0..32i32 {
        b.push((3 * j - 50) as i8 as u8);
    }
    let expected = (0..32).map(|j| 0.25 * (3 * j - 50) as f32).collect();
    (b, expected)
}

fn small_gguf() -> Vec<u8> {
    let (q41, _) = q4_1_block();
    let (q80, _) = q8_0_block();
    let f32s: Vec<u8> = (0..6).flat_map(|i| (i as f32).to_le_bytes()).collect();
    let mut g = GgufBuilder::default();
    g.kv_str("general.architecture", "llama")
        .kv_u32("llama.block_count", 1)
        .kv_f32("llama.rope.freq_base", 10000.0)
        .kv_str_array("tokenizer.ggml.tokens", &["a", "b", "<|x|>"])
        .tensor("m", &[3, 2], 0, &f32s)
        .tensor("q41", &[32], 3, &q41)
        .tensor("q80", &[32], 8, &q80)
        .tensor("q3k", &[256], 11, &[0u8; 110]);
    g.build()
}

fn tmpdir() -> tempfile::TempDir {
    tempfile::tempdir().expect("temp dir")
}

/// Every tensor's bytes of a weights region, in the region's order.
fn region_bytes(w: &pdkv_model::weights::Weights) -> Vec<Vec<u8>> {
    w.tensors_by_offset()
        .iter()
        // SAFETY: each tensor lies inside its weights region, and nothing
        // writes the region while the test reads it.
        .map(|t| unsafe { w.region.slice::<u8>(t.offset, t.bytes()).to_vec() })
        .collect()
}

fn load(path: &Path) -> anyhow::Result<LoadedModel> {
    load_model(path, &Pool::default(), &mut |_| {})
}

fn fixture() -> Value {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/smollm2_tokens.json");
    serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap()
}

// --------------------------------------------------------------- GGUF ----

#[test]
fn gguf_parses_metadata_and_tensors() {
    let g = GgufFile::from_bytes(small_gguf()).unwrap();
    assert_eq!(g.version, 3);
    assert_eq!(g.get_str("general.architecture"), Some("llama"));
    assert_eq!(g.get_u64("llama.block_count"), Some(1));
    assert_eq!(
        g.get("llama.rope.freq_base"),
        Some(&GgufValue::F32(10000.0))
    );
    assert_eq!(
        g.get_str_array("tokenizer.ggml.tokens").unwrap(),
        ["a", "b", "<|x|>"]
    );
    let m = g.tensor("m").unwrap();
    assert_eq!(m.shape(), [2, 3], "dims are innermost first");
    let mut out = vec![0.0; 6];
    g.dequantize_into(m, &mut out).unwrap();
    assert_eq!(out, [0.0, 1.0, 2.0, 3.0, 4.0, 5.0]);

    // Rows land where the row map says.
    g.dequantize_rows_into(m, &mut out, &|r| 1 - r).unwrap();
    assert_eq!(out, [3.0, 4.0, 5.0, 0.0, 1.0, 2.0]);

    let err = g
        .dequantize_into(g.tensor("q3k").unwrap(), &mut vec![0.0; 256])
        .unwrap_err();
    assert!(
        matches!(&err, GgufError::UnsupportedType { tensor, .. } if tensor == "q3k"),
        "{err}"
    );
    assert!(err.to_string().contains("Q3_K"), "{err}");
}

#[test]
fn gguf_quantised_blocks_match_hand_computed_values() {
    let g = GgufFile::from_bytes(small_gguf()).unwrap();
    for (name, (_, expected)) in [("q41", q4_1_block()), ("q80", q8_0_block())] {
        let mut out = vec![0.0; 32];
        g.dequantize_into(g.tensor(name).unwrap(), &mut out)
            .unwrap();
        assert_eq!(out, expected, "{name}");
    }
    // Q4_0: d = 2, x = d * (nibble - 8).
    let mut b = f16b(2.0).to_vec();
    b.extend((0..16u8).map(|j| j | (j << 4)));
    let mut out = vec![0.0; 32];
    dequantize(GgmlType::Q4_0, &b, &mut out).unwrap();
    let expected: Vec<f32> = (0..32).map(|j| 2.0 * ((j % 16) as f32 - 8.0)).collect();
    assert_eq!(out, expected);
    // Sizes that are not whole blocks are refused.
    assert!(dequantize(GgmlType::Q8_0, &b, &mut out).is_err());
    assert!(dequantize(GgmlType::Q4_0, &b, &mut out[..16]).is_err());
}

#[test]
fn gguf_truncated_or_garbage_input_is_an_error() {
    let full = small_gguf();
    for len in 0..full.len() {
        assert!(
            GgufFile::from_bytes(full[..len].to_vec()).is_err(),
            "prefix of {len} bytes parsed"
        );
    }
    assert!(matches!(
        GgufFile::from_bytes(b"GGML\x03\0\0\0".to_vec()),
        Err(GgufError::BadMagic)
    ));
    let mut v4 = full.clone();
    v4[4] = 4;
    assert!(matches!(
        GgufFile::from_bytes(v4),
        Err(GgufError::UnsupportedVersion(4))
    ));
    // A metadata count far beyond the file must not allocate or panic.
    let mut huge = full.clone();
    huge[16..24].copy_from_slice(&u64::MAX.to_le_bytes());
    assert!(GgufFile::from_bytes(huge).is_err());
    // Pseudo-random garbage after a valid magic and version.
    let mut state = 0x1234_5678_u64;
    for _ in 0..200 {
        let mut bytes = b"GGUF\x03\0\0\0".to_vec();
        for _ in 0..64 {
            state = state
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            bytes.push((state >> 56) as u8);
        }
        assert!(GgufFile::from_bytes(bytes).is_err());
    }
    // Corrupting single bytes of a valid image never panics.
    for i in 0..full.len() {
        let mut b = full.clone();
        b[i] ^= 0xa5;
        let _ = GgufFile::from_bytes(b);
    }
}

// ----------------------------------------------- random checkpoints ----

#[test]
fn random_checkpoint_round_trips_through_the_loader() {
    for arch in [Arch::Llama, Arch::Qwen3] {
        let dir = tmpdir();
        write_random_checkpoint(arch, "tiny", 42, dir.path()).unwrap();
        let expected = preset_config(arch, "tiny").unwrap();
        let mut calls = Vec::new();
        let pool = Pool::default();
        let lm = load_model(dir.path(), &pool, &mut |p| calls.push(p.clone())).unwrap();
        let cfg = lm.model.config();
        assert_eq!(cfg.eos_token_ids[0], expected.eos_token_ids[0]);
        assert_eq!(
            cfg.eos_token_ids,
            [511, 509],
            "generation_config.json adds <|endoftext|> as a stop id"
        );
        let mut cfg_no_eos = cfg.clone();
        cfg_no_eos.eos_token_ids.truncate(1);
        assert_eq!(cfg_no_eos, expected, "{arch:?}");
        if arch == Arch::Qwen3 {
            assert_ne!(cfg.head_dim, cfg.hidden_size / cfg.num_heads);
        }

        // One call per tensor, ending at the totals.
        let last = calls.last().unwrap();
        assert_eq!(last.tensors_done, last.tensors_total);
        assert_eq!(calls.len(), last.tensors_total);
        assert_eq!(last.bytes_done, last.bytes_total);

        // Shapes and values agree with the safetensors file.
        let w = lm.model.weights();
        let st = SafetensorsFile::open(&dir.path().join("model.safetensors")).unwrap();
        let l1 = &w.layers[1];
        for (name, t) in [
            ("model.embed_tokens.weight", &w.embed),
            ("model.layers.1.self_attn.q_proj.weight", &l1.wq),
            ("model.layers.1.self_attn.k_proj.weight", &l1.wk),
            ("model.layers.1.mlp.down_proj.weight", &l1.w_down),
            ("model.norm.weight", &w.final_norm),
        ] {
            assert_eq!(st.tensors[name].shape, t.shape, "{name}");
            let mut v = vec![0.0; t.numel()];
            st.read_f32(name, &mut v).unwrap();
            assert_eq!(w.get(t), &v[..], "{name}");
        }
        assert_eq!(l1.wq.shape, [cfg.q_dim(), cfg.hidden_size]);
        assert_eq!(l1.wo.shape, [cfg.hidden_size, cfg.q_dim()]);
        assert_eq!(w.lm_head == w.embed, cfg.tie_word_embeddings);
        assert_eq!(l1.q_norm.is_some(), arch == Arch::Qwen3);
        assert_eq!(
            pool.device_bytes().get(pdkv_vmem::Tag::Weights),
            w.region.len() as u64
        );

        // Tokenizer: round trip, specials stay whole, size matches the model.
        let tok = &lm.tokenizer;
        assert_eq!(tok.vocab_size(), cfg.vocab_size);
        for text in [
            "Hello, world! The river ran low.",
            "  spaces\n\nand 12345 日本 🙂",
            "",
        ] {
            let ids = tok.encode(text, false).unwrap();
            assert_eq!(tok.decode(&ids, false), text);
        }
        let im_start = tok.token_to_id("<|im_start|>").unwrap();
        assert_eq!(tok.encode("<|im_start|>user", false).unwrap()[0], im_start);
        assert_eq!(tok.id_to_token(im_start).as_deref(), Some("<|im_start|>"));
        assert_eq!(tok.bos_token_id(), Some(509));
        assert_eq!(tok.eos_token_ids(), [511, 509]);

        // Chat template renders ChatML.
        let msgs = [ChatMessage {
            role: "user".into(),
            content: "Hi".into(),
            ..Default::default()
        }];
        let text = lm
            .chat_template
            .as_ref()
            .unwrap()
            .render(&msgs, true)
            .unwrap();
        assert_eq!(
            text,
            "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
        );
    }
}

#[test]
fn random_checkpoints_are_reproducible() {
    let (a, b, c) = (tmpdir(), tmpdir(), tmpdir());
    write_random_checkpoint(Arch::Qwen3, "tiny", 7, a.path()).unwrap();
    write_random_checkpoint(Arch::Qwen3, "tiny", 7, b.path()).unwrap();
    write_random_checkpoint(Arch::Qwen3, "tiny", 8, c.path()).unwrap();
    for f in [
        "config.json",
        "model.safetensors",
        "tokenizer.json",
        "tokenizer_config.json",
        "generation_config.json",
    ] {
        let read = |d: &tempfile::TempDir| std::fs::read(d.path().join(f)).unwrap();
        assert_eq!(read(&a), read(&b), "{f} differs for the same seed");
    }
    let read = |d: &tempfile::TempDir| std::fs::read(d.path().join("model.safetensors")).unwrap();
    assert_ne!(read(&a), read(&c), "different seeds give different weights");
    assert!(write_random_checkpoint(Arch::Llama, "huge", 1, a.path()).is_err());
}

/// Rewrites `model.safetensors` of `dir` through `edit`.
fn edit_checkpoint(dir: &Path, edit: impl FnOnce(&mut Vec<(String, Vec<usize>, Vec<f32>)>)) {
    let path = dir.join("model.safetensors");
    let st = SafetensorsFile::open(&path).unwrap();
    let mut tensors: Vec<_> = st
        .tensors
        .iter()
        .map(|(name, e)| {
            let mut v = vec![0.0; e.shape.iter().product()];
            st.read_f32(name, &mut v).unwrap();
            (name.clone(), e.shape.clone(), v)
        })
        .collect();
    drop(st);
    edit(&mut tensors);
    write_f32(&path, &tensors).unwrap();
}

fn load_err(path: &Path) -> String {
    match load(path) {
        Ok(_) => panic!("{} loaded", path.display()),
        Err(e) => format!("{e:#}"),
    }
}

#[test]
fn bad_checkpoints_are_refused_naming_the_problem() {
    let dir = tmpdir();
    write_random_checkpoint(Arch::Llama, "tiny", 3, dir.path()).unwrap();

    // Wrong shape.
    let bad = "model.layers.1.self_attn.k_proj.weight";
    edit_checkpoint(dir.path(), |ts| {
        let t = ts.iter_mut().find(|t| t.0 == bad).unwrap();
        t.1 = vec![t.1[0] * 2, t.1[1] / 2];
    });
    let err = load_err(dir.path());
    assert!(err.contains(bad) && err.contains("shape"), "{err}");

    // Missing tensor.
    let gone = "model.layers.0.mlp.up_proj.weight";
    edit_checkpoint(dir.path(), |ts| ts.retain(|t| t.0 != gone && t.0 != bad));
    let err = load_err(dir.path());
    assert!(err.contains(gone), "{err}");

    // Unknown architecture.
    let cfg_path = dir.path().join("config.json");
    let mut cfg: Value =
        serde_json::from_str(&std::fs::read_to_string(&cfg_path).unwrap()).unwrap();
    cfg["model_type"] = "mistral".into();
    std::fs::write(&cfg_path, cfg.to_string()).unwrap();
    let err = load_err(dir.path());
    assert!(err.contains("mistral"), "{err}");

    // A safetensors header that lies about its length.
    let st = dir.path().join("model.safetensors");
    std::fs::write(&st, [0xff; 16]).unwrap();
    cfg["model_type"] = "llama".into();
    std::fs::write(&cfg_path, cfg.to_string()).unwrap();
    let err = load_err(dir.path());
    assert!(err.contains("model.safetensors"), "{err}");
}

// ------------------------------------------------------- SmolLM2 GGUF ----

#[test]
fn smollm2_gguf_loads_and_matches_transformers() {
    let Some(path) = smollm2("smollm2_gguf_loads_and_matches_transformers") else {
        return;
    };
    let lm = load(&path).unwrap();
    let cfg = lm.model.config();
    assert_eq!(cfg.arch, Arch::Llama);
    assert_eq!(
        (
            cfg.num_layers,
            cfg.num_heads,
            cfg.num_kv_heads,
            cfg.head_dim
        ),
        (30, 9, 3, 64)
    );
    assert_eq!(
        (cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size),
        (576, 1536, 49152)
    );
    assert!(cfg.tie_word_embeddings);
    assert_eq!(cfg.rope_theta, 100_000.0);
    assert_eq!(cfg.max_position_embeddings, 8192);
    assert_eq!(
        (cfg.bos_token_id, cfg.eos_token_ids.as_slice()),
        (Some(1), &[2][..])
    );
    assert_eq!(lm.model.weights().lm_head, lm.model.weights().embed);

    let fx = fixture();
    let tok = &lm.tokenizer;
    assert_eq!(tok.vocab_size() as u64, fx["vocab_size"].as_u64().unwrap());
    for case in fx["tokens"].as_array().unwrap() {
        let text = case["text"].as_str().unwrap();
        let want: Vec<u32> = serde_json::from_value(case["ids"].clone()).unwrap();
        let got = tok.encode(text, false).unwrap();
        assert_eq!(got, want, "token ids of {text:?}");
        assert_eq!(tok.decode(&got, false), text, "round trip of {text:?}");
    }

    let tmpl = lm
        .chat_template
        .as_ref()
        .expect("GGUF carries a chat template");
    for case in fx["chat"].as_array().unwrap() {
        let msgs: Vec<ChatMessage> = serde_json::from_value(case["messages"].clone()).unwrap();
        let gen = case["add_generation_prompt"].as_bool().unwrap();
        let got = tmpl.render(&msgs, gen).unwrap();
        assert_eq!(got, case["expected"].as_str().unwrap());
    }

    // Dequantised (and, for q/k, un-permuted) rows equal transformers'.
    let w = lm.model.weights();
    for row in fx["weight_rows"].as_array().unwrap() {
        let name = row["tensor"].as_str().unwrap();
        let r = row["row"].as_u64().unwrap() as usize;
        let t = match name {
            "model.layers.0.self_attn.q_proj.weight" => &w.layers[0].wq,
            "model.layers.0.self_attn.k_proj.weight" => &w.layers[0].wk,
            "model.layers.29.self_attn.k_proj.weight" => &w.layers[29].wk,
            "model.layers.3.mlp.down_proj.weight" => &w.layers[3].w_down,
            "model.embed_tokens.weight" => &w.embed,
            other => panic!("fixture names unknown tensor {other}"),
        };
        let values = w.row_f32(t, r);
        let got = &values[..16];
        let want: Vec<f32> = serde_json::from_value(row["first"].clone()).unwrap();
        for (g, e) in got.iter().zip(&want) {
            assert!((g - e).abs() <= 1e-6, "{name} row {r}: {got:?} vs {want:?}");
        }
    }
}

/// The weights region of the SmolLM2 GGUF holds the file's tensor bytes:
/// its block-format (and f32) tensors as they are in the file, any other
/// type dequantised to f32; and the region is no larger than that plus
/// alignment.
#[test]
fn smollm2_weights_region_holds_the_files_tensor_bytes() {
    let Some(path) = smollm2("smollm2_weights_region_holds_the_files_tensor_bytes") else {
        return;
    };
    let g = pdkv_model::gguf::GgufFile::open(&path).unwrap();
    let mut kept = 0usize;
    let mut types = std::collections::BTreeMap::new();
    for t in &g.tensors {
        *types.entry(t.ty.to_string()).or_insert(0usize) += 1;
        let raw = g.tensor_data(t).unwrap().len();
        kept += match t.ty {
            ty if ty == GgmlType::F32 || pdkv_model::weights::quant_of(ty).is_some() => raw,
            _ => t.shape().iter().product::<usize>() * 4,
        };
    }
    let pool = Pool::default();
    let lm = load_model(&path, &pool, &mut |_| {}).unwrap();
    let w = lm.model.weights();
    println!(
        "tensor types {types:?}: {kept} bytes kept; weights region {} bytes",
        w.region.len()
    );
    assert_eq!(w.bytes_total(), kept);
    assert!(
        w.region.len() >= kept && w.region.len() <= kept + 64 * g.tensors.len() + (2 << 20),
        "{}",
        w.region.len()
    );
    assert!(
        matches!(w.layers[0].wq.dtype, pdkv_model::weights::DType::Quant(_)),
        "the projections keep their blocks"
    );
}

/// A safetensors checkpoint in BF16 or F16 keeps its matrices 16-bit (half
/// the weights region of the same model in f32) and computes exactly what
/// the f32 checkpoint of the same values computes: the 16-bit values are
/// widened exactly and enter the same f32 arithmetic.
#[test]
fn a_16_bit_safetensors_checkpoint_stays_16_bit_and_gives_the_f32_checkpoints_bits() {
    use crate::hf_weights::read_all;
    use pdkv_model::loader::reload_weights_into;
    use pdkv_model::safetensors::{write_as, Dtype};
    use pdkv_model::{KvCache, SeqInput, Workspace};
    use pdkv_vmem::Tag;
    let src = tmpdir();
    write_random_checkpoint(Arch::Qwen3, "tiny", 11, src.path()).unwrap();
    let originals = read_all(src.path());
    for (dtype, round) in [
        (
            Dtype::BF16,
            (|v: f32| half::bf16::from_f32(v).to_f32()) as fn(f32) -> f32,
        ),
        (Dtype::F16, |v: f32| half::f16::from_f32(v).to_f32()),
    ] {
        // The same values twice: as f32 (rounded first) and as `dtype`.
        let tensors: Vec<(String, Vec<usize>, Vec<f32>)> = originals
            .iter()
            .map(|(name, shape, v)| {
                (
                    name.clone(),
                    shape.clone(),
                    v.iter().copied().map(round).collect(),
                )
            })
            .collect();
        let (wide, narrow) = (tmpdir(), tmpdir());
        for d in [&wide, &narrow] {
            for f in [
                "config.json",
                "tokenizer.json",
                "tokenizer_config.json",
                "generation_config.json",
            ] {
                std::fs::copy(src.path().join(f), d.path().join(f)).unwrap();
            }
        }
        write_as(&wide.path().join("model.safetensors"), &tensors, Dtype::F32).unwrap();
        write_as(&narrow.path().join("model.safetensors"), &tensors, dtype).unwrap();
        let run = |dir: &Path| {
            let pool = Pool::default();
            let lm = load_model(dir, &pool, &mut |_| {}).unwrap();
            // f32 activations: by default a CPU with bf16 dot products
            // rounds the activations of BF16 matrices to bf16 (bf16dot).
            let model = lm.model.with_int8_activations(false);
            let cfg = model.config().clone();
            let kv = KvCache::new(&pool, &cfg, 4, KvDtype::F32).unwrap();
            let mut ws = Workspace::new(&pool, &cfg, 32).unwrap();
            let toks: Vec<u32> = (0..21)
                .map(|i| (i * 37 + 5) % cfg.vocab_size as u32)
                .collect();
            let seq = SeqInput {
                tokens: &toks,
                start_pos: 0,
                block_table: &[0, 1],
                want_logits: true,
            };
            let mut logits = Vec::new();
            model.forward(&kv, &mut ws, &[seq], &mut logits).unwrap();
            let bytes = pool.device_bytes().get(Tag::Weights);
            (
                logits.iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
                bytes,
                model.weights().layers[0].wq.dtype,
            )
        };
        let (want, wide_bytes, wide_dtype) = run(wide.path());
        let (got, narrow_bytes, narrow_dtype) = run(narrow.path());
        assert_eq!(wide_dtype, pdkv_model::weights::DType::F32);
        assert!(
            matches!(narrow_dtype, pdkv_model::weights::DType::Quant(_)),
            "{dtype:?}: {narrow_dtype:?}"
        );
        assert_eq!(
            got, want,
            "{dtype:?} logits differ from the f32 checkpoint's"
        );
        assert!(
            narrow_bytes * 10 < wide_bytes * 6,
            "{dtype:?}: weights take {narrow_bytes} bytes, the f32 checkpoint {wide_bytes}"
        );

        // A reload keeps the 16-bit layout: the f32 checkpoint of the same
        // (rounded) values is converted back to the very same 16-bit bytes,
        // and a 16-bit one of other values lands as a fresh load of it would.
        let pool = Pool::default();
        let lm = load_model(narrow.path(), &pool, &mut |_| {}).unwrap();
        let cfg = lm.model.config().clone();
        let before = region_bytes(lm.model.weights());
        reload_weights_into(lm.model.weights(), &cfg, wide.path(), &mut |_| {}).unwrap();
        assert!(
            region_bytes(lm.model.weights()) == before,
            "{dtype:?}: the f32 checkpoint of the same values changed the weights"
        );
        let other = tmpdir();
        write_random_checkpoint(Arch::Qwen3, "tiny", 12, other.path()).unwrap();
        let tensors2 = read_all(other.path());
        write_as(&other.path().join("model.safetensors"), &tensors2, dtype).unwrap();
        reload_weights_into(lm.model.weights(), &cfg, other.path(), &mut |_| {}).unwrap();
        let fresh = load_model(other.path(), &Pool::default(), &mut |_| {}).unwrap();
        for (a, b) in lm
            .model
            .weights()
            .tensors_by_offset()
            .iter()
            .zip(fresh.model.weights().tensors_by_offset())
        {
            assert_eq!((a.offset, &a.shape, a.dtype), (b.offset, &b.shape, b.dtype));
            let bytes = |w: &pdkv_model::weights::Weights, t: &pdkv_model::weights::TensorRef| {
                // SAFETY: the tensor lies inside its weights region.
                unsafe { w.region.slice::<u8>(t.offset, t.bytes()).to_vec() }
            };
            assert_eq!(
                bytes(lm.model.weights(), a),
                bytes(fresh.model.weights(), b),
                "{dtype:?}: a reloaded tensor differs from a fresh load"
            );
        }
    }
}
