"""A trainer's weight sync with the Python publisher, against a real pdkv
P/D deployment (`pdkv up`: a prefill server, a decode server, the proxy).

    python3 tests/sync_pd.py PATH/TO/pdkv

Publishes a second checkpoint's tensors with `pdkv_publish.Publisher`,
drives the four phases through the proxy's one address, and checks:
a corrupted tensor and a wrong shape are refused naming the tensor while
the old weights keep serving; a good sync over shared memory (the memfd
sent to each engine) switches every engine to its version; a third
checkpoint published in place (`Publisher.update`) and synced over TCP
makes the deployment answer what a fresh deployment on that checkpoint
answers. Exits non-zero on the first failed check.
"""

import json
import os
import secrets
import subprocess
import sys
import tempfile
import threading

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from pdkv_publish import Publisher, Tensor, engine  # noqa: E402
from pdkv_publish.publisher import read_safetensors  # noqa: E402

DEADLINE = 120
TOKEN = "T"


def check(cond, what):
    if not cond:
        raise SystemExit(f"FAILED: {what}")
    print(f"ok: {what}", flush=True)


def init_checkpoint(pdkv, out, seed):
    subprocess.run([pdkv, "model", "init", "--arch", "llama", "--preset", "tiny",
                    "--seed", str(seed), "--out", out], check=True, timeout=DEADLINE,
                   stdout=subprocess.DEVNULL)


def up(pdkv, model, secret, *extra):
    p = subprocess.Popen([pdkv, "up", "--model", model, "--num-kv-blocks", "64", "--port", "0",
                          "--admin-token", TOKEN, "--kv-secret", secret, *extra],
                         stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    found = {}

    def read():
        for line in p.stdout:
            if line.startswith("proxy: ") and "url" not in found:
                found["url"] = line.split(" ", 1)[1].strip()
                ready.set()
        ready.set()

    ready = threading.Event()
    threading.Thread(target=read, daemon=True).start()
    if not ready.wait(DEADLINE) or "url" not in found:
        p.kill()
        raise SystemExit("FAILED: pdkv up printed no proxy line")
    return p, found["url"]


def stop(p):
    if not engine.stop(p, DEADLINE):
        raise SystemExit("FAILED: pdkv up did not stop")


def call(url, path, body=None, method="POST"):
    return engine.call(url, path, body, method, token=TOKEN, timeout=DEADLINE)


def probes(url):
    out = []
    for i in range(4):
        body = {"prompt": f"probe {i}: the river", "max_tokens": 8, "temperature": 20.0,
                "seed": 77, "ignore_eos": True}
        status, v = call(url, "/v1/completions", body)
        check(status == 200, f"completion {i} answered ({status})")
        out.append(v["choices"][0]["text"])
    return out


def sync(url, publisher, transport="auto"):
    status, v = call(url, "/init_weight_transfer_engine",
                     {"init_info": {"backend": "pdkv", "url": publisher.url, "transport": transport}})
    check(status == 200, f"init_weight_transfer_engine ({v})")
    return call(url, "/start_weight_update", {})


def transports(v):
    """The transport each engine reported for a fanned-out step."""
    return sorted(e["body"].get("transport") for e in v["engines"])


def switch(url):
    check(call(url, "/pause?mode=keep")[0] == 200, "pause")
    status, v = call(url, "/finish_weight_update", {})
    check(status == 200, f"finish_weight_update ({v})")
    check(call(url, "/resume")[0] == 200, "resume")


def main():
    pdkv = sys.argv[1]
    secret = secrets.token_hex(16)
    with tempfile.TemporaryDirectory() as d:
        a, b, c = (os.path.join(d, x) for x in "abc")
        init_checkpoint(pdkv, a, 5)
        init_checkpoint(pdkv, b, 6)
        init_checkpoint(pdkv, c, 8)
        tensors = read_safetensors(os.path.join(b, "model.safetensors"))
        third = read_safetensors(os.path.join(c, "model.safetensors"))
        export_dir = os.path.join(d, "b-bf16")
        subprocess.run([pdkv, "model", "export", "--model", b, "--out", export_dir], check=True,
                       timeout=DEADLINE, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        exported = {}
        for f in sorted(os.listdir(export_dir)):
            if f.endswith(".safetensors"):
                exported.update(read_safetensors(os.path.join(export_dir, f)))
        deployment, url = up(pdkv, a, secret)
        try:
            before = probes(url)

            # A wrong shape: refused at start, naming the tensor.
            name = next(iter(tensors))
            t = tensors[name]
            bad = dict(tensors)
            bad[name] = Tensor(t.data, t.dtype, tuple(reversed(t.shape)) + (1,))
            with Publisher(bad, version="bad", secret=secret) as p:
                status, v = sync(url, p)
                check(status == 400 and name in json.dumps(v), f"a wrong shape is refused naming {name}")

            # A corrupted tensor: its checksum is refused, naming it.
            with Publisher(tensors, version="bad", secret=secret) as p:
                status, v = sync(url, p)
                check(status == 200, f"start_weight_update ({v})")
                victim = p.manifest["tensors"][2]
                p._view[victim["offset"]] ^= 0x10
                status, v = call(url, "/update_weights", {"update_info": {}})
                check(status == 400 and victim["name"] in json.dumps(v),
                      f"a bad checksum is refused naming {victim['name']}")
            check(probes(url) == before, "the old weights still serve")

            # A wrong secret: the engines refuse the publisher.
            with Publisher(tensors, version="bad", secret=secrets.token_hex(16)) as p:
                status, v = sync(url, p)
                status, v = call(url, "/update_weights", {"update_info": {}})
                check(status == 503 and "KV secret" in json.dumps(v), "a publisher of another deployment is refused")

            # The good sync over shared memory, in two chunks, paused
            # around the switch.
            with Publisher(tensors, version="py-1", secret=secret) as p:
                check(p.shm_path is not None and p.manifest["shm"]["path"] == p.shm_path,
                      "the manifest offers shared memory")
                status, v = sync(url, p)
                check(status == 200 and transports(v) == ["shm", "shm"], f"start_weight_update over shm ({v})")
                names = [t["name"] for t in p.manifest["tensors"]]
                status, v = call(url, "/update_weights", {"update_info": {"names": names[:3]}})
                check(status == 200, f"a first chunk of 3 tensors ({v})")
                status, v = call(url, "/update_weights", {"update_info": {}})
                check(status == 200 and transports(v) == ["shm", "shm"], f"the rest, copied from shared memory ({v})")
                switch(url)
                check(p.bytes_served == 0, f"no byte went over TCP ({p.bytes_served})")
                status, info = call(url, "/weight_info", method="GET")
                check(info.get("version") == "py-1" and info.get("agree") is True, f"every engine serves py-1 ({info})")
                synced = probes(url)
                check(synced != before, "the outputs changed")

                # The next step's weights, published in place, over TCP.
                p.update(third, version="py-2")
                status, v = sync(url, p, transport="tcp")
                check(status == 200 and transports(v) == ["tcp", "tcp"], f"start_weight_update over tcp ({v})")
                status, v = call(url, "/update_weights", {"update_info": {}})
                check(status == 200, f"update_weights ({v})")
                switch(url)
                served = p.bytes_served
                check(served == 2 * p.total_bytes(), f"P and D each read every byte once ({served} of 2 x {p.total_bytes()})")
            status, info = call(url, "/weight_info", method="GET")
            check(info.get("version") == "py-2" and info.get("agree") is True, f"every engine serves py-2 ({info})")
            synced = probes(url)

            # As a trainer holds them: the second checkpoint's BF16 export,
            # converted by each engine (serving f32) while it pulls.
            with Publisher(exported, version="py-bf16", secret=secret) as p:
                check(all(t["dtype"] == "bf16" for t in p.manifest["tensors"]), "published as bf16")
                status, v = sync(url, p)
                check(status == 200, f"start_weight_update of bf16 tensors ({v})")
                status, v = call(url, "/update_weights", {"update_info": {}})
                converted = [e["body"].get("convert_seconds", 0) > 0 for e in v.get("engines", [])]
                check(status == 200 and converted == [True, True], f"each engine converted ({v})")
                switch(url)
            synced_bf16 = probes(url)
        finally:
            stop(deployment)
        fresh, furl = up(pdkv, c, secret)
        try:
            want = probes(furl)
        finally:
            stop(fresh)
        check(synced == want, "the synced deployment answers as a fresh one on the third checkpoint")
        fresh, furl = up(pdkv, export_dir, secret, "--weight-format", "f32")
        try:
            want = probes(furl)
        finally:
            stop(fresh)
        check(synced_bf16 == want, "the bf16 sync answers as a fresh deployment on the export, widened to f32")
    print("python publisher: all checks passed")


if __name__ == "__main__":
    main()
