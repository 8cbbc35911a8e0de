#!/usr/bin/env bash
# The scheduler's limits against end-to-end serving, measured: `pdkv serve`
# under the same client and load as scripts/vs-llamacpp.sh's HTTP figure
# (`pdkv bench serve --url`: streamed /v1/completions of ~110-token prompts,
# 64 greedy output tokens, EOS ignored) for each setting of
# --max-num-batched-tokens and --max-num-seqs, the settings interleaved and
# repeated --runs times (medians reported, the spread beside them).
#
#   scripts/sweep-scheduler.sh [--runs N] [--model FILE] [--concurrency C]
#                              [--tokens 128,256,512,1024] [--seqs 16,32,64]
#
# Every batched-tokens value runs at the default --max-num-seqs, and every
# max-num-seqs value at the default --max-num-batched-tokens. Prints one
# table; the raw figures go to target/sweep-scheduler.json.
set -euo pipefail
cd "$(dirname "$0")/.."

RUNS=2
CONC=32
TOKENS=128,256,512,1024,2048
SEQS=16,32,64
MODEL=
while [ $# -gt 0 ]; do
  case "$1" in
    --runs) RUNS=$2; shift 2 ;;
    --model) MODEL=$2; shift 2 ;;
    --concurrency) CONC=$2; shift 2 ;;
    --tokens) TOKENS=$2; shift 2 ;;
    --seqs) SEQS=$2; shift 2 ;;
    *) echo "unknown argument: $1" >&2; exit 2 ;;
  esac
done

cargo build --release -q -p pdkv
PDKV=$PWD/target/release/pdkv
if [ -z "$MODEL" ]; then
  MODEL=$("$PDKV" model fetch 2>/dev/null | tail -1)
  q8=${MODEL%.Q4_1.gguf}.Q8_0.gguf
  # The HTTP comparison's file, where scripts/vs-llamacpp.sh made it.
  [ -f "$q8" ] && MODEL=$q8
fi
[ -f "$MODEL" ] || { echo "no model file: $MODEL" >&2; exit 1; }
# The defaults, as `pdkv serve --help` states them.
default_of() { "$PDKV" serve --help | grep -A1 -- "--$1 " | sed -n 's/.*\[default: \([0-9]*\)\].*/\1/p'; }
DEF_TOKENS=$(default_of max-num-batched-tokens)
DEF_SEQS=$(default_of max-num-seqs)
[ -n "$DEF_TOKENS" ] && [ -n "$DEF_SEQS" ] || { echo "could not read the serve defaults from --help" >&2; exit 1; }

OUT=$(mktemp -d)
trap 'kill $(jobs -p) 2>/dev/null || true; rm -rf "$OUT"' EXIT
RES=$OUT/results.jsonl
: > "$RES"
PORT=18433
REQS=$((CONC * 3))

wait_health() {
  for _ in $(seq 600); do
    curl -sf "$1/health" >/dev/null 2>&1 && return 0
    sleep 0.5
  done
  echo "no health at $1 after 300 s" >&2
  exit 1
}

configs=()
for t in ${TOKENS//,/ }; do configs+=("$t:$DEF_SEQS"); done
for s in ${SEQS//,/ }; do
  [ "$s" = "$DEF_SEQS" ] || configs+=("$DEF_TOKENS:$s")
done

for r in $(seq "$RUNS"); do
  for cfg in "${configs[@]}"; do
    t=${cfg%:*}
    s=${cfg#*:}
    echo "run $r/$RUNS: --max-num-batched-tokens $t --max-num-seqs $s" >&2
    "$PDKV" serve --model "$MODEL" --port $PORT --max-num-batched-tokens "$t" --max-num-seqs "$s" \
      > "$OUT/serve.log" 2>&1 &
    pid=$!
    wait_health "http://127.0.0.1:$PORT"
    "$PDKV" bench serve --url "http://127.0.0.1:$PORT" --concurrency "$CONC" --requests "$REQS" \
      --max-tokens 64 --prompt-words 80 --disconnect-share 0 --warmup-s 0 --sample-s 5 \
      --request-timeout-s 300 --fresh-connections 2>"$OUT/bench.err" | tail -1 > "$OUT/bench.json"
    python3 - "$OUT/bench.json" "$t" "$s" >> "$RES" <<'EOF'
import json, sys
d = json.load(open(sys.argv[1]))
r = d["requests"]
if r["failed"]:
    sys.exit(f"{r['failed']} requests failed: {r['failed_by_cause']}")
print(json.dumps({"tokens": int(sys.argv[2]), "seqs": int(sys.argv[3]),
                  "tok_s": d["output_tok_per_s"], "ttft": d["ttft_ms"], "itl": d.get("itl_ms")}))
EOF
    kill $pid
    wait $pid 2>/dev/null || true
  done
done

mkdir -p target
python3 - "$RES" target/sweep-scheduler.json "$DEF_TOKENS" "$DEF_SEQS" "$CONC" "$(basename "$MODEL")" <<'EOF'
import json, statistics, sys
rows = [json.loads(l) for l in open(sys.argv[1])]
print(f"{sys.argv[6]}, concurrency {sys.argv[5]}; defaults: --max-num-batched-tokens {sys.argv[3]} --max-num-seqs {sys.argv[4]}")
print(f"{'batched-tokens':>14} {'max-seqs':>8} {'out tok/s':>10} {'TTFT p50 ms':>12} {'TTFT p90 ms':>12} {'ITL p50 ms':>11} {'ITL p90 ms':>11}   runs tok/s")
table = []
for key in dict.fromkeys((r["tokens"], r["seqs"]) for r in rows):
    rs = [r for r in rows if (r["tokens"], r["seqs"]) == key]
    v = statistics.median(r["tok_s"] for r in rs)
    p50 = statistics.median(r["ttft"]["p50"] for r in rs)
    p90 = statistics.median(r["ttft"]["p90"] for r in rs)
    i50 = statistics.median(r["itl"]["p50"] for r in rs)
    i90 = statistics.median(r["itl"]["p90"] for r in rs)
    print(f"{key[0]:>14} {key[1]:>8} {v:>10.1f} {p50:>12.0f} {p90:>12.0f} {i50:>11.1f} {i90:>11.1f}   "
          + " ".join(f"{r['tok_s']:.0f}" for r in rs))
    table.append({"max_num_batched_tokens": key[0], "max_num_seqs": key[1], "tok_s": v,
                  "ttft_p50_ms": p50, "ttft_p90_ms": p90, "itl_p50_ms": i50, "itl_p90_ms": i90,
                  "runs": [r["tok_s"] for r in rs]})
json.dump(table, open(sys.argv[2], "w"), indent=1)
EOF
