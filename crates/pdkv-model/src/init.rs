//! Random checkpoints in Hugging Face layout, for tests and benchmarks.
//!
//! [`write_random_checkpoint`] writes a directory that both this crate and
//! `transformers` load: `config.json`, `model.safetensors` (f32),
//! `tokenizer.json`, `tokenizer_config.json` (with a ChatML template) and
//! `generation_config.json`.
//!
//! Invariant: the output is a pure function of `(arch, preset, seed)`: the
//! same arguments give byte-identical files. Weights come from a splitmix64
//! generator; the tokenizer is a byte-level BPE whose merges are learned
//! deterministically from a fixed text, so it is fully reproducible too.

use std::collections::{BTreeMap, HashMap};
use std::path::Path;

use anyhow::{bail, Context};
use serde_json::{json, Value};

use crate::weights::LayerTensor;
use crate::{Arch, ModelConfig};

/// Special tokens of the generated tokenizer, appended after the merges.
pub const SPECIAL_TOKENS: [&str; 3] = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"];

/// Vocabulary size of every preset: 256 bytes + merges + special tokens.
pub const VOCAB_SIZE: usize = 512;

const CHATML_TEMPLATE: &str = "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}";

/// Text the tokenizer's merges are learned from.
const TRAINING_TEXT: &str = "\
The river ran low that summer, and the people of the valley walked down to the water every morning to see how much was left. \
Some said the rain would come before the harvest; others said it would not come at all. \
A small server in the corner of the library answered questions all day long, one token at a time, \
and nobody thought it strange that a machine could read and write. \
When the model slept, its memory was handed back, and when it woke, the weights were mapped again where they had been. \
Each request waited its turn in the queue, then its prompt was split into blocks of sixteen tokens, \
and the cache kept what had been computed so that nothing was done twice. \
Numbers like 2024, 3.14159 and 1000000 appear in text too, as do questions: what is the capital of France? Paris is. \
How many legs does a spider have? Eight! She counted them twice, to be sure. \
The quick brown fox jumps over the lazy dog, and the five boxing wizards jump quickly. \
Memory, compute and time are the three things a scheduler trades against each other, \
and a good one never loses a request, never frees a block twice, and never waits forever. \
def main():\n    print(\"hello, world\")\n    return 0\n\
In the evening the lights of the town came on one by one, and the river kept running, slower than before.";

/// Hyper-parameters of a preset.
pub fn preset_config(arch: Arch, preset: &str) -> anyhow::Result<ModelConfig> {
    let qwen = arch == Arch::Qwen3;
    let (hidden, inter, layers, heads, kv_heads, head_dim, max_pos) = match preset {
        // Qwen3 uses a head_dim different from hidden / heads on purpose.
        "tiny" => (64, 160, 2, 4, 2, if qwen { 32 } else { 16 }, 1024),
        "small" => (256, 640, 4, 8, 4, if qwen { 64 } else { 32 }, 2048),
        other => bail!("unknown preset `{other}` (known: tiny, small)"),
    };
    let eos = VOCAB_SIZE as u32 - 1;
    Ok(ModelConfig {
        arch,
        vocab_size: VOCAB_SIZE,
        hidden_size: hidden,
        intermediate_size: inter,
        num_layers: layers,
        num_heads: heads,
        num_kv_heads: kv_heads,
        head_dim,
        rope_theta: if qwen { 1_000_000.0 } else { 10_000.0 },
        rms_norm_eps: if qwen { 1e-6 } else { 1e-5 },
        max_position_embeddings: max_pos,
        tie_word_embeddings: !qwen,
        bos_token_id: Some(VOCAB_SIZE as u32 - 3),
        eos_token_ids: vec![eos],
    })
}

/// splitmix64: a small, well-mixed, reproducible generator.
struct SplitMix64(u64);

impl SplitMix64 {
    fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    /// Uniform in (0, 1].
    fn uniform(&mut self) -> f64 {
        ((self.next_u64() >> 11) + 1) as f64 / (1u64 << 53) as f64
    }

    /// Standard normal (Box-Muller).
    fn normal(&mut self) -> f64 {
        let (u1, u2) = (self.uniform(), self.uniform());
        (-2.0 * u1.ln()).sqrt() * (std::f64::consts::TAU * u2).cos()
    }

    fn normal_vec(&mut self, n: usize, std: f64) -> Vec<f32> {
        (0..n).map(|_| (self.normal() * std) as f32).collect()
    }

    /// Norm weights: 1 ± 0.1.
    fn norm_vec(&mut self, n: usize) -> Vec<f32> {
        (0..n)
            .map(|_| (1.0 + 0.2 * (self.uniform() - 0.5)) as f32)
            .collect()
    }
}

/// GPT-2's byte-to-character table: printable bytes map to themselves, the
/// rest to code points from 256 upwards, so every byte has a visible glyph.
pub fn byte_to_char() -> [char; 256] {
    let printable = |b: u32| {
        (0x21..=0x7e).contains(&b) || (0xa1..=0xac).contains(&b) || (0xae..=0xff).contains(&b)
    };
    let mut table = ['\0'; 256];
    let mut next = 256u32;
    for b in 0..256u32 {
        let c = if printable(b) {
            b
        } else {
            next += 1;
            next - 1
        };
        table[b as usize] = char::from_u32(c).unwrap_or('?');
    }
    table
}

/// Splits text roughly as GPT-2's pre-tokenizer does: a run of letters,
/// digits or other symbols, each with at most one leading space, or a run
/// of whitespace.
fn pre_split(text: &str) -> Vec<String> {
    #[derive(PartialEq, Clone, Copy)]
    enum Class {
        Letter,
        Digit,
        Other,
        Space,
    }
    let class = |c: char| {
        if c.is_alphabetic() {
            Class::Letter
        } else if c.is_numeric() {
            Class::Digit
        } else if c.is_whitespace() {
            Class::Space
        } else {
            Class::Other
        }
    };
    let chars: Vec<char> = text.chars().collect();
    let mut out = Vec::new();
    let mut i = 0;
    while i < chars.len() {
        let start = i;
        let mut cls = class(chars[i]);
        if chars[i] == ' ' && i + 1 < chars.len() && class(chars[i + 1]) != Class::Space {
            i += 1;
            cls = class(chars[i]);
        }
        while i < chars.len() && class(chars[i]) == cls {
            i += 1;
        }
        out.push(chars[start..i].iter().collect());
    }
    out
}

/// Learns `n_tokens` merged tokens from [`TRAINING_TEXT`]. Returns the merges
/// in rank order; ties are broken by the pair's text, so the result is fixed.
fn learn_merges(n_tokens: usize) -> anyhow::Result<Vec<(String, String)>> {
    let table = byte_to_char();
    let mut word_counts: BTreeMap<Vec<String>, usize> = BTreeMap::new();
    for piece in pre_split(TRAINING_TEXT) {
        let symbols = piece
            .bytes()
            .map(|b| table[b as usize].to_string())
            .collect();
        *word_counts.entry(symbols).or_default() += 1;
    }
    let mut words: Vec<(Vec<String>, usize)> = word_counts.into_iter().collect();
    let mut known: std::collections::HashSet<String> =
        table.iter().map(|c| c.to_string()).collect();
    let mut merges = Vec::new();
    let mut new_tokens = 0;
    while new_tokens < n_tokens {
        let mut pairs: HashMap<(&str, &str), usize> = HashMap::new();
        for (w, n) in &words {
            for p in w.windows(2) {
                *pairs.entry((p[0].as_str(), p[1].as_str())).or_default() += n;
            }
        }
        let Some((a, b)) = pairs
            .into_iter()
            .max_by(|(p1, n1), (p2, n2)| n1.cmp(n2).then_with(|| p2.cmp(p1)))
            .map(|((a, b), _)| (a.to_string(), b.to_string()))
        else {
            bail!("training text supports only {new_tokens} merged tokens, {n_tokens} wanted");
        };
        let merged = format!("{a}{b}");
        for (w, _) in &mut words {
            let mut i = 0;
            while i + 1 < w.len() {
                if w[i] == a && w[i + 1] == b {
                    w[i] = merged.clone();
                    w.remove(i + 1);
                }
                i += 1;
            }
        }
        if known.insert(merged) {
            new_tokens += 1;
        }
        merges.push((a, b));
    }
    Ok(merges)
}

/// The `tokenizer.json` document of the generated tokenizer, with exactly
/// `vocab_size` tokens: bytes (ids 0..256 in byte order), merged tokens,
/// then [`SPECIAL_TOKENS`].
pub fn tokenizer_json(vocab_size: usize) -> anyhow::Result<Value> {
    let n_merged = vocab_size
        .checked_sub(256 + SPECIAL_TOKENS.len())
        .context("vocabulary too small for the byte alphabet")?;
    let merges = learn_merges(n_merged)?;
    let mut vocab = serde_json::Map::new();
    let mut next = 0usize;
    let mut add = |vocab: &mut serde_json::Map<String, Value>, tok: String| {
        if !vocab.contains_key(&tok) {
            vocab.insert(tok, json!(next));
            next += 1;
        }
    };
    for c in byte_to_char() {
        add(&mut vocab, c.to_string());
    }
    for (a, b) in &merges {
        add(&mut vocab, format!("{a}{b}"));
    }
    let mut added = Vec::new();
    for s in SPECIAL_TOKENS {
        added.push(crate::tokenizer::added_token(vocab.len(), s, true));
        add(&mut vocab, s.to_string());
    }
    if vocab.len() != vocab_size {
        bail!("built {} tokens, wanted {vocab_size}", vocab.len());
    }
    let byte_level = |add_prefix_space: bool, trim: bool| json!({"type": "ByteLevel", "add_prefix_space": add_prefix_space, "trim_offsets": trim, "use_regex": true});
    let merges = merges
        .iter()
        .map(|(a, b)| json!([a, b]))
        .collect::<Vec<_>>();
    Ok(crate::tokenizer::bpe_json(
        added,
        [byte_level(false, true), byte_level(true, false)],
        vocab,
        json!(merges),
    ))
}

/// Random weights for `cfg`, in Hugging Face names and order.
fn random_tensors(cfg: &ModelConfig, seed: u64) -> Vec<(String, Vec<usize>, Vec<f32>)> {
    let mut rng = SplitMix64(seed);
    let mut out = Vec::new();
    let (h, v) = (cfg.hidden_size, cfg.vocab_size);
    let linear = 0.05;
    let mut push = |name: String, shape: Vec<usize>, data: Vec<f32>| out.push((name, shape, data));
    push(
        "model.embed_tokens.weight".into(),
        vec![v, h],
        rng.normal_vec(v * h, 0.5),
    );
    for i in 0..cfg.num_layers {
        let p = |n: &str| format!("model.layers.{i}.{n}.weight");
        // In checkpoint order: the random stream's order.
        for t in LayerTensor::of(cfg.arch) {
            let shape = t.shape(cfg);
            let data = match *shape {
                [n] => rng.norm_vec(n),
                [rows, cols] => rng.normal_vec(rows * cols, linear),
                _ => unreachable!("norms and linear layers only"),
            };
            push(p(t.names().0), shape, data);
        }
    }
    push("model.norm.weight".into(), vec![h], rng.norm_vec(h));
    if !cfg.tie_word_embeddings {
        push(
            "lm_head.weight".into(),
            vec![v, h],
            rng.normal_vec(v * h, 0.5),
        );
    }
    out
}

/// The f64 with the same shortest decimal form as `x` (1e-6, not
/// 9.99999997e-7), so that readers parsing f64 get the intended value.
fn shortest_f64(x: f32) -> f64 {
    x.to_string().parse().unwrap_or(x as f64)
}

/// `config.json` in the form transformers reads.
pub fn hf_config_json(cfg: &ModelConfig) -> Value {
    let mut c = json!({
        "architectures": [match cfg.arch { Arch::Llama => "LlamaForCausalLM", Arch::Qwen3 => "Qwen3ForCausalLM" }],
        "model_type": cfg.arch.as_str(),
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size,
        "num_hidden_layers": cfg.num_layers,
        "num_attention_heads": cfg.num_heads,
        "num_key_value_heads": cfg.num_kv_heads,
        "head_dim": cfg.head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": cfg.max_position_embeddings,
        "rms_norm_eps": shortest_f64(cfg.rms_norm_eps),
        "rope_theta": shortest_f64(cfg.rope_theta),
        "attention_bias": false,
        "attention_dropout": 0.0,
        "tie_word_embeddings": cfg.tie_word_embeddings,
        "bos_token_id": cfg.bos_token_id,
        "eos_token_id": cfg.eos_token_ids.first(),
        "torch_dtype": "float32",
    });
    match cfg.arch {
        Arch::Llama => c["mlp_bias"] = json!(false),
        Arch::Qwen3 => {
            c["use_sliding_window"] = json!(false);
            c["max_window_layers"] = json!(cfg.num_layers);
        }
    }
    c
}

pub(crate) fn write_json(path: &Path, v: &Value) -> anyhow::Result<()> {
    let mut text = serde_json::to_string_pretty(v)?;
    text.push('\n');
    std::fs::write(path, text).with_context(|| format!("cannot write {}", path.display()))
}

/// Writes a random checkpoint of `preset` ("tiny" or "small") to the
/// directory `out` (created if needed).
pub fn write_random_checkpoint(
    arch: Arch,
    preset: &str,
    seed: u64,
    out: &Path,
) -> anyhow::Result<()> {
    let cfg = preset_config(arch, preset)?;
    std::fs::create_dir_all(out).with_context(|| format!("cannot create {}", out.display()))?;
    let tok = tokenizer_json(cfg.vocab_size)?;
    write_json(&out.join("tokenizer.json"), &tok)?;
    let special = |i: usize| SPECIAL_TOKENS[i];
    write_json(
        &out.join("tokenizer_config.json"),
        &json!({
            "tokenizer_class": "PreTrainedTokenizerFast",
            "bos_token": special(0),
            "eos_token": special(2),
            "pad_token": special(0),
            "unk_token": null,
            "add_bos_token": false,
            "add_prefix_space": false,
            "clean_up_tokenization_spaces": false,
            "model_max_length": cfg.max_position_embeddings,
            "chat_template": CHATML_TEMPLATE,
        }),
    )?;
    let mut gen_eos = cfg.eos_token_ids.clone();
    gen_eos.push(cfg.bos_token_id.unwrap_or(0));
    write_json(
        &out.join("generation_config.json"),
        &json!({"bos_token_id": cfg.bos_token_id, "eos_token_id": gen_eos}),
    )?;
    write_json(&out.join("config.json"), &hf_config_json(&cfg))?;
    crate::safetensors::write_f32(&out.join("model.safetensors"), &random_tensors(&cfg, seed))?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn byte_table_is_a_bijection() {
        let t = byte_to_char();
        let set: std::collections::HashSet<char> = t.iter().copied().collect();
        assert_eq!(set.len(), 256);
        assert_eq!(t[b'a' as usize], 'a');
        assert_eq!(t[b' ' as usize], '\u{120}');
        assert_eq!(t[b'\n' as usize], '\u{10a}');
    }

    #[test]
    fn merges_are_deterministic_and_sized() {
        let a = tokenizer_json(VOCAB_SIZE).unwrap();
        let b = tokenizer_json(VOCAB_SIZE).unwrap();
        assert_eq!(a, b);
        assert_eq!(a["model"]["vocab"].as_object().unwrap().len(), VOCAB_SIZE);
        assert_eq!(a["added_tokens"][2]["id"], json!(VOCAB_SIZE - 1));
    }

    #[test]
    fn normals_have_the_right_spread() {
        let mut r = SplitMix64(7);
        let v = r.normal_vec(20_000, 0.5);
        let mean = v.iter().map(|&x| x as f64).sum::<f64>() / v.len() as f64;
        let var = v.iter().map(|&x| (x as f64 - mean).powi(2)).sum::<f64>() / v.len() as f64;
        assert!(mean.abs() < 0.02, "mean {mean}");
        assert!((var.sqrt() - 0.5).abs() < 0.02, "std {}", var.sqrt());
    }
}
