#!/usr/bin/env bash
# The project's test command: fetches the default model (SmolLM2-135M-Instruct)
# when it is not cached yet, installs the vLLM router (PyPI `vllm-router`, for
# the tests that run pdkv behind it) into a virtual environment in the user's
# cache, then runs every test in release mode.
#
#   scripts/test.sh          the test command (CI runs it; about 9.5
#                            minutes on 2 cores from a fresh clone, build
#                            included)
#   scripts/test.sh --full   also the long runs: the lifecycle matrix in every
#                            transport, transfer mode and failure policy, the
#                            simulator over 500 seeds
set -euo pipefail
cd "$(dirname "$0")/.."

full=0
for arg in "$@"; do
    case "$arg" in
        --full) full=1 ;;
        *) echo "usage: scripts/test.sh [--full]" >&2; exit 2 ;;
    esac
done

# Cargo's own target directory (CARGO_TARGET_DIR, or target/ beside the workspace).
target_dir=$(cargo metadata --format-version 1 --no-deps | python3 -c 'import json, sys; print(json.load(sys.stdin)["target_directory"])')

# One build of everything the tests need (the pdkv binary among it, with the
# same features as the tests see, so nothing is built twice).
cargo test --release --locked --workspace --no-run
"$target_dir/release/pdkv" model fetch

# The router's virtual environment lives in the user's cache beside the
# model, one per version, so a fresh clone reuses it.
ROUTER_VERSION=0.1.17
ROUTER_VENV="${XDG_CACHE_HOME:-$HOME/.cache}/pdkv/vllm-router-$ROUTER_VERSION"
installed=$("$ROUTER_VENV/bin/pip" show vllm-router 2>/dev/null | sed -n 's/^Version: //p' || true)
if [ "$installed" != "$ROUTER_VERSION" ]; then
    rm -rf "$ROUTER_VENV"
    python3 -m venv "$ROUTER_VENV"
    "$ROUTER_VENV/bin/pip" install --quiet --disable-pip-version-check "vllm-router==$ROUTER_VERSION"
fi
export PDKV_VLLM_ROUTER="$ROUTER_VENV/bin/vllm-router"

if [ "$full" = 1 ]; then
    export PDKV_FULL_SUITE=1
fi
cargo test --release --locked --workspace --no-fail-fast
