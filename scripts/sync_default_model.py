"""Weight sync of the default model, end to end, against fresh engines.

    python3 scripts/sync_default_model.py PDKV OLD.gguf NEW.gguf [--transport auto|tcp|shm] [--fanout direct|relay]
    python3 scripts/sync_default_model.py PDKV OLD.gguf HF_DIR --format hf --weight-format q4_1

OLD and NEW are two checkpoints of one model (the same tensors, types and
shapes; NEW different bytes: for SmolLM2, make one with llama.cpp's
quantize tool, e.g. the shipped Q4_1 to Q8_0 and back to Q4_1). Starts
`pdkv weights publish NEW`, then for each of a 1P1D deployment behind the
proxy (`pdkv up`) and a colocated server (`pdkv serve`) on OLD: syncs NEW
through the four weight-transfer phases (a `keep` pause around the switch,
as a trainer makes it), and compares greedy answers with a fresh
deployment of the same shape started on NEW. Prints each engine's pull
time and bytes and the bytes that went through the publisher's link, and
exits non-zero on the first failed check.

With `--format hf`, NEW is a Hugging Face directory (say `pdkv model
export --model OLD.gguf --out DIR`, with `--double TENSOR` doubling one of
its BF16 tensors so that the answers change): it is published as a trainer
holds it (`pdkv weights publish --format hf`), every engine converts it to
the format it serves while it pulls, and the fresh deployments load NEW in
`--weight-format` (the format OLD is served in).
"""

import json
import os
import secrets
import shutil
import struct
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "python", "pdkv-publish"))
from pdkv_publish import engine  # noqa: E402

DEADLINE = 300
TOKEN = "T"
PROMPTS = [
    "The capital of France is",
    "Write a haiku about the sea:",
    "def fibonacci(n):",
    "Three reasons to learn Rust are",
]


def check(cond, what):
    if not cond:
        raise SystemExit(f"FAILED: {what}")
    print(f"ok: {what}", flush=True)


def call(url, path, body=None, method="POST"):
    return engine.call(url, path, body, method, token=TOKEN, timeout=DEADLINE)


def answers(url):
    out = []
    for p in PROMPTS:
        status, v = call(url, "/v1/completions",
                         {"prompt": p, "max_tokens": 24, "temperature": 0, "ignore_eos": True})
        check(status == 200, f"a completion answered ({status})")
        out.append(v["choices"][0]["text"])
    return out


def wait_line(proc, prefix):
    """The rest of the first stdout line of `proc` starting with `prefix`."""
    found, ready = {}, threading.Event()

    def read():
        for line in proc.stdout:
            if line.startswith(prefix) and "v" not in found:
                found["v"] = line[len(prefix):].strip()
                ready.set()
        ready.set()

    threading.Thread(target=read, daemon=True).start()
    if not ready.wait(DEADLINE) or "v" not in found:
        proc.kill()
        raise SystemExit(f"FAILED: no line starting {prefix!r}")
    return found["v"]


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def double_bf16_tensor(src, dst, name):
    """A copy of the Hugging Face directory `src` at `dst` with the BF16
    tensor `name` doubled (each value's exponent one up; zeros, infinities
    and NaNs as they are)."""
    shutil.copytree(src, dst)
    for f in sorted(os.listdir(dst)):
        if not f.endswith(".safetensors"):
            continue
        path = os.path.join(dst, f)
        with open(path, "r+b") as fh:
            n = struct.unpack("<Q", fh.read(8))[0]
            header = json.loads(fh.read(n))
            meta = header.get(name)
            if meta is None:
                continue
            if meta["dtype"] != "BF16":
                raise SystemExit(f"FAILED: {name} is {meta['dtype']}, not BF16")
            a, b = meta["data_offsets"]
            fh.seek(8 + n + a)
            vals = list(struct.unpack(f"<{(b - a) // 2}H", fh.read(b - a)))
            for i, v in enumerate(vals):
                e = (v >> 7) & 0xFF
                if 0 < e < 0xFE:
                    vals[i] = v + (1 << 7)
            fh.seek(8 + n + a)
            fh.write(struct.pack(f"<{len(vals)}H", *vals))
            return
    raise SystemExit(f"FAILED: no tensor {name} in {src}")


def start(pdkv, shape, model, secret, extra=()):
    if shape == "pd":
        p = subprocess.Popen([pdkv, "up", "--model", model, "--port", "0", "--admin-token", TOKEN,
                              "--kv-secret", secret, *extra],
                             stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
        return p, wait_line(p, "proxy: ")
    port = free_port()
    p = subprocess.Popen([pdkv, "serve", "--model", model, "--port", str(port),
                          "--admin-token", TOKEN, "--kv-secret", secret, *extra],
                         stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, text=True)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + DEADLINE
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(url + "/health", timeout=5) as r:
                if r.status == 200:
                    return p, url
        except (urllib.error.URLError, ConnectionError):
            pass
        if p.poll() is not None:
            raise SystemExit("FAILED: pdkv serve exited")
        time.sleep(0.2)
    p.kill()
    raise SystemExit("FAILED: pdkv serve did not become healthy")


def stop(p):
    engine.stop(p, DEADLINE)


def engines(v):
    """Each engine's answer of a step: the proxy's fan-out, or one server's."""
    return [e["body"] for e in v["engines"]] if "engines" in v else [v]


def sync(url, publisher_url, transport, fanout):
    info = {"backend": "pdkv", "url": publisher_url, "transport": transport}
    if fanout != "direct":
        info["fanout"] = fanout
    status, v = call(url, "/init_weight_transfer_engine", {"init_info": info})
    check(status == 200, "init_weight_transfer_engine")
    t0 = time.monotonic()
    marks = []

    def mark(name):
        marks.append((name, time.monotonic()))

    status, v = call(url, "/start_weight_update", {})
    check(status == 200, f"start_weight_update ({v})")
    mark("start")
    status, v = call(url, "/update_weights", {"update_info": {}})
    check(status == 200, f"update_weights ({v})")
    mark("pull")
    pulls = engines(v)
    check(call(url, "/pause?mode=keep")[0] == 200, "pause keep")
    mark("pause")
    status, f = call(url, "/finish_weight_update", {})
    check(status == 200, f"finish_weight_update ({f})")
    mark("finish")
    check(call(url, "/resume")[0] == 200, "resume")
    mark("resume")
    total = time.monotonic() - t0
    last, phases = t0, []
    for name, t in marks:
        phases.append(f"{name} {(t - last) * 1e3:.0f}")
        last = t
    for e, s in zip(pulls, engines(f)):
        print(f"  engine: {e['bytes']} bytes over {e['transport']} in {e['seconds'] * 1e3:.1f} ms "
              f"({e['bytes'] / e['seconds'] / 1e9:.2f} GB/s; of it conversion "
              f"{e.get('convert_seconds', 0) * 1e3:.1f} ms), switch {s['switch_seconds'] * 1e3:.1f} ms")
    print(f"  the four phases through {url}: {total * 1e3:.0f} ms ({', '.join(phases)} ms)")


def served(publisher_url):
    with urllib.request.urlopen(publisher_url + "/stats", timeout=DEADLINE) as r:
        return json.loads(r.read())["bytes_served"]


def main():
    args = sys.argv[1:]
    opts = {"--transport": "auto", "--fanout": "direct", "--format": "engine",
            "--weight-format": None, "--double": None}
    for flag in opts:
        if flag in args:
            i = args.index(flag)
            opts[flag] = args[i + 1]
            del args[i:i + 2]
    transport, fanout = opts["--transport"], opts["--fanout"]
    pdkv, old, new = args
    fresh_extra = ["--weight-format", opts["--weight-format"]] if opts["--weight-format"] else []
    scratch = None
    if opts["--double"]:
        scratch = tempfile.TemporaryDirectory()
        changed = os.path.join(scratch.name, "new")
        double_bf16_tensor(new, changed, opts["--double"])
        new = changed
    secret = secrets.token_hex(16)
    pub = subprocess.Popen([pdkv, "weights", "publish", new, "--version", "step-2",
                            "--format", opts["--format"]],
                           stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
                           env={"PDKV_KV_SECRET": secret, "PATH": "/usr/bin:/bin"})
    publisher_url = wait_line(pub, "publishing ").rsplit(" at ", 1)[1]
    try:
        for shape in ("pd", "colocated"):
            print(f"{shape}:", flush=True)
            p, url = start(pdkv, shape, old, secret)
            try:
                before = answers(url)
                was = served(publisher_url)
                sync(url, publisher_url, transport, fanout if shape == "pd" else "direct")
                print(f"  through the publisher's link (TCP): {served(publisher_url) - was} bytes")
                status, info = call(url, "/weight_info", method="GET")
                check(info.get("version") == "step-2", f"every engine reports step-2 ({info.get('version')})")
                synced = answers(url)
            finally:
                stop(p)
            check(synced != before, "the answers changed")
            f, furl = start(pdkv, shape, new, secret, fresh_extra)
            try:
                want = answers(furl)
            finally:
                stop(f)
            check(synced == want, f"{shape}: the synced engines answer as fresh ones on the new checkpoint")
    finally:
        stop(pub)
    print("default-model sync: all checks passed")


if __name__ == "__main__":
    main()
