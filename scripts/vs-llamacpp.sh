#!/usr/bin/env bash
# pdkv beside llama.cpp on the same GGUF files, in one run on this machine, as ratios.
#
#   scripts/vs-llamacpp.sh [--runs N] [--only decode,prefill,long,http,quality] [--threads T]
#
# Builds llama.cpp's tools once (../shared/tools/build-llama-cpp.sh, ~10 min,
# cached), makes Q8_0 and Q4_K_M files from the shipped Q4_1 SmolLM2 with
# llama-quantize (cached beside it; decode runs on all three), then, each pair measured back to back and repeated
# --runs times (the median is reported; the machine's noise shows as the
# spread):
#   decode   llama-batched-bench -npp 128 -ntg 32 -npl 1,32  vs  pdkv bench decode --context 128 --steps 128
#            (and, pdkv's alone, b1_of_copy_bw and b1_of_read_bw: batch 1's share of
#            the copy bandwidth, and of a plain read, measured beside it)
#   prefill  llama-bench -p 512,2048 -n 0                      vs  pdkv bench prefill --tokens 512,2048
#   long     llama-bench -p 8192 -n 0                          vs  pdkv bench prefill --tokens 8192
#            llama-bench -p 0 -n 64 -d 4096,8128               vs  pdkv bench decode --batch-sizes 1 --context D
#            (batch-1 decode at a depth; the model has 8,192 positions, so the deeper
#            row is 8,128 tokens of context plus the 64 timed ones)
#            Both sides keep K and V in f16 (llama.cpp's default, pdkv's auto);
#            llama.cpp runs with and without flash attention, its better figure counts.
#   http     llama-server -np 32 and pdkv serve on the Q8_0 file, the same client
#            (pdkv bench serve --url: streamed /v1/completions, greedy, EOS ignored)
#            at concurrency 1 and 32
#   quality  llama-perplexity -c 512 -ctk T -ctv T             vs  pdkv bench perplexity --ctx 512 --kv-cache-dtype T
#            on the shipped Q4_1 file, the same text ($PPL_TEXT, by default the GPL-3's
#            text), T = f32, f16 and q8_0 KV (once: both are deterministic; llama.cpp's
#            q8_0 with flash attention, which its q8_0 V needs, f32 and f16 without), each
#            side's change against its own f32 KV, and pdkv's greedy agreement with its
#            f32 KV over 200 prompts cut from the text (32 new tokens each)
# Prints one table and writes the raw figures as JSON to target/vs-llamacpp.json.
set -euo pipefail
cd "$(dirname "$0")/.."

RUNS=3
ONLY=decode,prefill,long,http,quality
THREADS=$(nproc)
while [ $# -gt 0 ]; do
  case "$1" in
    --runs) RUNS=$2; shift 2 ;;
    --only) ONLY=$2; shift 2 ;;
    --threads) THREADS=$2; shift 2 ;;
    *) echo "unknown argument: $1" >&2; exit 2 ;;
  esac
done
want() { [[ ",$ONLY," == *",$1,"* ]]; }

echo "building pdkv (release)" >&2
cargo build --release -q -p pdkv
PDKV=$PWD/target/release/pdkv
echo "building llama.cpp's tools (cached after the first time)" >&2
B=$(../shared/tools/build-llama-cpp.sh | tail -1)
export LD_LIBRARY_PATH=$B
Q41=$("$PDKV" model fetch 2>/dev/null | tail -1)
[ -f "$Q41" ] || Q41=~/.cache/pdkv/models/SmolLM2-135M-Instruct.Q4_1.gguf
[ -f "$Q41" ] || { echo "no SmolLM2 GGUF: run pdkv model fetch" >&2; exit 1; }
Q80=${Q41%.Q4_1.gguf}.Q8_0.gguf
Q4KM=${Q41%.Q4_1.gguf}.Q4_K_M.gguf
for pair in "$Q80:Q8_0" "$Q4KM:Q4_K_M"; do
  f=${pair%:*}
  if [ ! -f "$f" ]; then
    echo "making $f with llama-quantize" >&2
    "$B/llama-quantize" --allow-requantize "$Q41" "$f.tmp" "${pair##*:}" "$THREADS" >/dev/null 2>&1
    mv "$f.tmp" "$f"
  fi
done
OUT=$(mktemp -d)
trap 'kill $(jobs -p) 2>/dev/null || true; rm -rf "$OUT"' EXIT
export PDKV_THREADS=$THREADS
# Some virtual machines list AMX in the CPU flags without enabling its tile
# state: llama.cpp's repacked (AMX) matmuls then crash. There its tools run
# without weight repacking (LLAMA_ARG_REPACK for batched-bench and server),
# and the table says so.
LB_REPACK=()
if ! "$B/llama-bench" -m "$Q80" -t "$THREADS" -p 16 -n 0 -r 1 >/dev/null 2>&1; then
  echo "llama.cpp crashes with weight repacking on this machine: running it with --repack 0" >&2
  LB_REPACK=(--repack 0)
  export LLAMA_ARG_REPACK=0
fi

# One JSON line per measurement: {"what":..., "file":..., "tool":..., "value":...}
RES=$OUT/results.jsonl
: > "$RES"
record() { printf '{"what":"%s","file":"%s","tool":"%s","value":%s}\n' "$1" "$2" "$3" "$4" >> "$RES"; }

if want decode; then
  for f in "$Q80" "$Q41" "$Q4KM"; do
    name=$(basename "$f")
    for r in $(seq "$RUNS"); do
      echo "decode $name run $r/$RUNS" >&2
      "$B/llama-batched-bench" -m "$f" -t "$THREADS" -tb "$THREADS" -c 8192 -b 2048 -ub 512 \
        -npp 128 -ntg 32 -npl 1,32 > "$OUT/bb.txt" 2>/dev/null
      # | PP | TG | B | N_KV | T_PP | S_PP | T_TG | S_TG | T | S |
      awk -F'|' '$4+0 > 0 { gsub(/ /, "", $4); gsub(/ /, "", $9); print $4, $9 }' "$OUT/bb.txt" |
        while read -r b tg; do record "decode_b$b" "$name" llama.cpp "$tg"; done
      # 128 timed steps (llama.cpp times 32, from the same context: pdkv's
      # last steps see the longer context): 32 steps of batch 1 are ~0.2 s,
      # too short for a steady share of the copy bandwidth.
      "$PDKV" bench decode --model "$f" --batch-sizes 1,32 --context 128 --steps 128 2>/dev/null | tail -1 > "$OUT/pd.json"
      python3 -c 'import json,sys; d=json.load(open(sys.argv[1]))["decode_tok_s"]; [print(b, v) for b, v in d.items()]' "$OUT/pd.json" |
        while read -r b tg; do record "decode_b$b" "$name" pdkv "$tg"; done
      record "b1_of_copy_bw" "$name" pdkv \
        "$(python3 -c 'import json,sys; print(json.load(open(sys.argv[1]))["roofline_fraction_b1"])' "$OUT/pd.json")"
      record "b1_of_read_bw" "$name" pdkv \
        "$(python3 -c 'import json,sys; print(json.load(open(sys.argv[1]))["read_fraction_b1"])' "$OUT/pd.json")"
    done
  done
fi

if want prefill; then
  name=$(basename "$Q80")
  for r in $(seq "$RUNS"); do
    echo "prefill $name run $r/$RUNS" >&2
    "$B/llama-bench" -m "$Q80" -t "$THREADS" "${LB_REPACK[@]}" -p 512,2048 -n 0 -r 1 -o json > "$OUT/lb.json" 2>/dev/null
    python3 -c 'import json,sys; [print(x["n_prompt"], x["avg_ts"]) for x in json.load(open(sys.argv[1]))]' "$OUT/lb.json" |
      while read -r n ts; do record "prefill_$n" "$name" llama.cpp "$ts"; done
    "$PDKV" bench prefill --model "$Q80" --tokens 512,2048 2>/dev/null | tail -1 > "$OUT/pp.json"
    python3 -c 'import json,sys; d=json.load(open(sys.argv[1]))["prefill_tok_s"]; [print(n, v) for n, v in d.items()]' "$OUT/pp.json" |
      while read -r n ts; do record "prefill_$n" "$name" pdkv "$ts"; done
  done
fi

if want long; then
  name=$(basename "$Q80")
  for r in $(seq "$RUNS"); do
    echo "long contexts $name run $r/$RUNS" >&2
    "$B/llama-bench" -m "$Q80" -t "$THREADS" "${LB_REPACK[@]}" -ctk f16 -ctv f16 -fa 0,1 -p 8192 -n 0 -r 1 -o json > "$OUT/lbp.json" 2>/dev/null
    "$B/llama-bench" -m "$Q80" -t "$THREADS" "${LB_REPACK[@]}" -ctk f16 -ctv f16 -fa 0,1 -p 0 -n 64 -d 4096,8128 -r 1 -o json > "$OUT/lbd.json" 2>/dev/null
    # Per measure, the better of the two flash-attention settings.
    python3 -c '
import json, sys
best = {}
for f in sys.argv[1:]:
    for x in json.load(open(f)):
        n, d = x["n_prompt"], x["n_depth"]
        what = f"prefill_{n}" if n else f"decode_b1_d{d}"
        best[what] = max(best.get(what, 0), x["avg_ts"])
for what, ts in best.items():
    print(what, ts)' "$OUT/lbp.json" "$OUT/lbd.json" |
      while read -r what ts; do record "$what" "$name" llama.cpp "$ts"; done
    "$PDKV" bench prefill --model "$Q80" --tokens 8192 --repeats 1 --kv-cache-dtype f16 2>/dev/null | tail -1 > "$OUT/pp.json"
    python3 -c 'import json,sys; d=json.load(open(sys.argv[1]))["prefill_tok_s"]; [print(n, v) for n, v in d.items()]' "$OUT/pp.json" |
      while read -r n ts; do record "prefill_$n" "$name" pdkv "$ts"; done
    for d in 4096 8128; do
      "$PDKV" bench decode --model "$Q80" --batch-sizes 1 --context $d --steps 64 --kv-cache-dtype f16 2>/dev/null | tail -1 > "$OUT/pd.json"
      v=$(python3 -c 'import json,sys; print(json.load(open(sys.argv[1]))["decode_tok_s"]["1"])' "$OUT/pd.json")
      record "decode_b1_d$d" "$name" pdkv "$v"
    done
  done
fi

if want quality; then
  name=$(basename "$Q41")
  TEXT=${PPL_TEXT:-/usr/share/common-licenses/GPL-3}
  [ -f "$TEXT" ] || { echo "no text to score at $TEXT (set PPL_TEXT)" >&2; exit 1; }
  for t in f32 f16 q8_0; do
    echo "quality $name: llama-perplexity, $t KV" >&2
    # llama.cpp keeps a q8_0 V cache only with flash attention; with it on,
    # its f32 KV scored as its f16 to the last digit here (18.3914 both), so
    # f32 and f16 run without it.
    fa=off; [ $t = q8_0 ] && fa=on
    "$B/llama-perplexity" -m "$Q41" -f "$TEXT" -c 512 -b 512 -t "$THREADS" -ctk $t -ctv $t -fa $fa > "$OUT/lp.txt" 2>&1 || true
    v=$(sed -n 's/.*Final estimate: PPL = \([0-9.]*\).*/\1/p' "$OUT/lp.txt")
    [ -n "$v" ] || { echo "llama-perplexity gave no estimate with $t KV:" >&2; tail -5 "$OUT/lp.txt" >&2; exit 1; }
    record "ppl_kv_$t" "$name" llama.cpp "$v"
  done
  echo "quality $name: pdkv bench perplexity, f32 / f16 / q8_0 KV" >&2
  "$PDKV" bench perplexity --model "$Q41" --file "$TEXT" --ctx 512 --kv-cache-dtype f32,f16,q8_0 2>/dev/null | tail -1 > "$OUT/ppl.json"
  python3 -c '
import json, sys
d = json.load(open(sys.argv[1]))
for r in d["rows"]:
    t = r["kv_cache_dtype"]
    print("ppl_kv_" + t, r["perplexity"])
    print("same_answers_kv_" + t, r["same_answers"] / d["greedy_prompts"])
    print("same_tokens_kv_" + t, r["same_token_share"])' "$OUT/ppl.json" |
    while read -r what v; do record "$what" "$name" pdkv "$v"; done
fi

# Waits (bounded) until $1/health answers 200.
wait_health() {
  for _ in $(seq 600); do
    curl -sf -o /dev/null "$1/health" && return 0
    sleep 0.5
  done
  echo "$1 did not become healthy within 300 s" >&2
  return 1
}

http_load() { # url concurrency requests -> output tok/s
  "$PDKV" bench serve --url "$1" --concurrency "$2" --requests "$3" --max-tokens 64 --prompt-words 80 \
    --disconnect-share 0 --warmup-s 0 --sample-s 5 --request-timeout-s 300 --fresh-connections 2>"$OUT/serve.err" | tail -1 > "$OUT/serve.json"
  python3 - "$OUT/serve.json" <<'EOF'
import json, sys
d = json.load(open(sys.argv[1]))
r = d["requests"]
# A server may close a kept-alive connection just as the client reuses it
# (llama-server does, now and then): a few such failures are reported and
# the throughput of the rest stands; more mean the run is void.
if r["failed"]:
    print(f"{r['failed']} of {r['ok'] + r['failed']} requests failed: {r['failed_by_cause']}", file=sys.stderr)
if r["failed"] > 0.05 * (r["ok"] + r["failed"]):
    sys.exit("too many failures")
print(d["output_tok_per_s"])
EOF
}

if want http; then
  name=$(basename "$Q80")
  LPORT=18431
  PPORT=18432
  for r in $(seq "$RUNS"); do
    for c in 1 32; do
      n=$((c == 1 ? 8 : 96))
      echo "http c$c run $r/$RUNS: llama-server" >&2
      "$B/llama-server" -m "$Q80" -t "$THREADS" -tb "$THREADS" -np 32 -c $((32 * 512)) --port $LPORT \
        --host 127.0.0.1 > "$OUT/ls.log" 2>&1 &
      lpid=$!
      wait_health "http://127.0.0.1:$LPORT"
      v=$(http_load "http://127.0.0.1:$LPORT" "$c" "$n")
      record "http_c$c" "$name" llama.cpp "$v"
      kill $lpid; wait $lpid 2>/dev/null || true
      echo "http c$c run $r/$RUNS: pdkv serve" >&2
      "$PDKV" serve --model "$Q80" --port $PPORT > "$OUT/ps.log" 2>&1 &
      ppid=$!
      wait_health "http://127.0.0.1:$PPORT"
      v=$(http_load "http://127.0.0.1:$PPORT" "$c" "$n")
      record "http_c$c" "$name" pdkv "$v"
      kill $ppid; wait $ppid 2>/dev/null || true
    done
  done
fi

mkdir -p target
python3 - "$RES" target/vs-llamacpp.json "$(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | xargs)" "$THREADS" <<'EOF'
import json, statistics, sys
rows = [json.loads(l) for l in open(sys.argv[1])]
keys = []
for r in rows:
    k = (r["what"], r["file"])
    if k not in keys:
        keys.append(k)
print(f"cpu: {sys.argv[3]}, {sys.argv[4]} threads; medians of the runs (tok/s)")
import os
if os.environ.get("LLAMA_ARG_REPACK") == "0":
    print("llama.cpp ran without weight repacking (with it, it crashes on this machine)")
print(f"{'measure':<14} {'file':<34} {'llama.cpp':>10} {'pdkv':>10} {'ratio':>7}   runs pdkv / llama.cpp")
table = []
for what, f in keys:
    v = {t: [r["value"] for r in rows if (r["what"], r["file"], r["tool"]) == (what, f, t)] for t in ("llama.cpp", "pdkv")}
    if not v["llama.cpp"] or not v["pdkv"] or what.startswith("ppl_"):
        continue
    l, p = statistics.median(v["llama.cpp"]), statistics.median(v["pdkv"])
    spread = " ".join(f"{x:.0f}" for x in v["pdkv"]) + " / " + " ".join(f"{x:.0f}" for x in v["llama.cpp"])
    print(f"{what:<14} {f:<34} {l:>10.1f} {p:>10.1f} {p / l:>6.2f}x   {spread}")
    table.append({"measure": what, "file": f, "llama_cpp": l, "pdkv": p, "ratio": p / l, "runs": v})
# pdkv's own figures beside them: batch-1 decode's weight streaming rate as a
# share of the copy bandwidth `pdkv bench decode` measures in the same run,
# and of a plain read measured beside each copy.
own = []
for what, f in keys:
    v = [r["value"] for r in rows if (r["what"], r["file"], r["tool"]) == (what, f, "pdkv")]
    if what.startswith(("b1_of_copy_bw", "b1_of_read_bw")) and v:
        m = statistics.median(v)
        print(f"{what:<14} {f:<34} {'':>10} {m:>10.3f} {'':>7}   {' '.join(f'{x:.3f}' for x in v)}")
        own.append({"measure": what, "file": f, "pdkv": m, "runs": v})
# Quality: each side's perplexity over its KV types (lower is better), the
# change against its own f32 KV, and pdkv's greedy agreement with its f32 KV.
quality = []
one = lambda what, f, t: next((r["value"] for r in rows if (r["what"], r["file"], r["tool"]) == (what, f, t)), None)
qfiles = [f for what, f in keys if what == "ppl_kv_f32"]
for f in qfiles:
    print(f"perplexity of the same text, {f} (lower is better; vs f32: against the same side's f32 KV)")
    print(f"{'kv':<6} {'llama.cpp':>10} {'vs f32':>8} {'pdkv':>10} {'vs f32':>8} {'same answers':>13} {'same tokens':>12}")
    base = {t: one("ppl_kv_f32", f, t) for t in ("llama.cpp", "pdkv")}
    for kv in ("f32", "f16", "q8_0"):
        l, p = one(f"ppl_kv_{kv}", f, "llama.cpp"), one(f"ppl_kv_{kv}", f, "pdkv")
        if l is None or p is None:
            continue
        sa, st = one(f"same_answers_kv_{kv}", f, "pdkv"), one(f"same_tokens_kv_{kv}", f, "pdkv")
        dl, dp = 100 * (l / base["llama.cpp"] - 1), 100 * (p / base["pdkv"] - 1)
        print(f"{kv:<6} {l:>10.4f} {dl:>+7.2f}% {p:>10.4f} {dp:>+7.2f}% {100 * sa:>12.1f}% {100 * st:>11.1f}%")
        quality.append({"kv_cache_dtype": kv, "file": f, "llama_cpp_ppl": l, "pdkv_ppl": p,
                        "llama_cpp_vs_f32": l / base["llama.cpp"], "pdkv_vs_f32": p / base["pdkv"],
                        "pdkv_same_answers": sa, "pdkv_same_tokens": st})
json.dump({"cpu": sys.argv[3], "threads": int(sys.argv[4]), "results": table, "pdkv_only": own, "quality": quality}, open(sys.argv[2], "w"), indent=1)
EOF
