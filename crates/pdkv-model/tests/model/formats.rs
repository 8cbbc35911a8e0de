//! Every GGUF block format the loader reads, against llama.cpp's own
//! dequantisation of real blocks (`scripts/make_quant_fixture.py`: blocks
//! from SmolLM2 files made with llama-quantize, values from gguf-py).

use std::path::Path;

use pdkv_model::gguf::{dequantize, GgmlType};
use serde_json::Value;

fn type_named(name: &str) -> GgmlType {
    (0..40)
        .map(GgmlType)
        .find(|t| t.name() == Some(name))
        .unwrap_or_else(|| panic!("no ggml type {name}"))
}

fn hex(s: &str) -> Vec<u8> {
    (0..s.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(&s[i..i + 2], 16).unwrap())
        .collect()
}

#[test]
fn every_block_format_dequantises_as_llama_cpp_does() {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/quant_blocks.json");
    let fx: Value = serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap();
    let fx = fx.as_object().unwrap();
    for name in [
        "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q4_K", "Q5_K", "Q6_K",
    ] {
        let t = &fx[name];
        let ty = type_named(name);
        assert!(ty.can_dequantize(), "{name}");
        for row in t["rows"].as_array().unwrap() {
            let data = hex(row["hex"].as_str().unwrap());
            let want: Vec<f32> = row["values"]
                .as_array()
                .unwrap()
                .iter()
                .map(|v| v.as_f64().unwrap() as f32)
                .collect();
            let mut got = vec![f32::NAN; want.len()];
            dequantize(ty, &data, &mut got).unwrap();
            // Up to one rounding apart: llama.cpp may fuse `d*q - m` into one
            // operation where pdkv rounds twice.
            let block = t["block_values"].as_u64().unwrap() as usize;
            for (b, (g, w)) in got.chunks(block).zip(want.chunks(block)).enumerate() {
                let scale = w
                    .iter()
                    .fold(0f32, |a, v| a.max(v.abs()))
                    .max(f32::MIN_POSITIVE);
                for (i, (x, y)) in g.iter().zip(w).enumerate() {
                    assert!(
                        (x - y).abs() <= scale * 1e-6,
                        "{name} {} row {} block {b} value {i}: {x} vs llama.cpp {y}",
                        row["tensor"],
                        row["row"]
                    );
                }
            }
        }
    }
}

#[test]
fn formats_without_a_reader_are_named_in_the_error() {
    for name in ["Q2_K", "Q3_K", "Q8_1", "I8"] {
        let ty = type_named(name);
        assert!(!ty.can_dequantize(), "{name}");
        let (block, bytes) = ty.block_layout().unwrap();
        let err = dequantize(ty, &vec![0; bytes], &mut vec![0.0; block])
            .unwrap_err()
            .to_string();
        assert!(err.contains(name), "{name}: {err}");
    }
}
