"""Writes crates/pdkv-model/tests/fixtures/quant_blocks.json: raw GGUF blocks of
every block format pdkv reads, and their values as llama.cpp's gguf-py package
dequantises them (an implementation independent of pdkv's), for the loader's
tests.

Usage (a venv with `pip install gguf numpy`):
  python scripts/make_quant_fixture.py FILE.gguf...
Files: make them from the shipped SmolLM2 with llama.cpp's llama-quantize
(../shared/tools/build-llama-cpp.sh builds it), e.g. Q4_K_M (Q4_K, Q6_K,
Q5_0), Q5_K_M (Q5_K, Q5_1), Q4_0.
"""
import json
import sys

import numpy as np
from gguf import GGUFReader
from gguf.constants import GGML_QUANT_SIZES
from gguf.quants import dequantize

ROWS = 2  # rows sampled per type: the first and one from the middle
VALUES = 512  # of each row: two K-quant super-blocks, 16 blocks of 32
out = {}
for path in sys.argv[1:]:
    for t in GGUFReader(path).tensors:
        name = t.tensor_type.name
        if name in out or name in ("F32", "F16", "BF16"):
            continue
        block, bytes_ = GGML_QUANT_SIZES[t.tensor_type]
        raw = np.asarray(t.data, dtype=np.uint8).reshape(-1)
        k = int(t.shape[0])  # values per row (ggml's ne[0])
        row_bytes = k // block * bytes_
        n_rows = raw.size // row_bytes
        rows = []
        for r in (0, n_rows // 2)[:ROWS]:
            data = raw[r * row_bytes:r * row_bytes + min(k, VALUES) // block * bytes_]
            vals = dequantize(data, t.tensor_type).astype(np.float32).reshape(-1)
            rows.append({"tensor": t.name, "row": r, "hex": data.tobytes().hex(), "values": [float(v) for v in vals]})
        out[name] = {"block_values": block, "block_bytes": bytes_, "rows": rows}
        print(f"{name}: {t.name}, rows of {k} values (the first {min(k, VALUES)} kept)", file=sys.stderr)
dst = "crates/pdkv-model/tests/fixtures/quant_blocks.json"
json.dump(out, open(dst, "w"))
print(f"wrote {dst}: {', '.join(sorted(out))}", file=sys.stderr)
