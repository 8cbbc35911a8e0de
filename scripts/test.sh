#!/usr/bin/env bash
# The project's test command: fetches the default model (SmolLM2-135M-Instruct)
# when it is not cached yet, installs the vLLM router (PyPI `vllm-router`, for
# the tests that run pdkv behind it) into a virtual environment under target/,
# then runs every test in release mode.
set -euo pipefail
cd "$(dirname "$0")/.."
cargo build --release --locked -p pdkv
./target/release/pdkv model fetch

ROUTER_VERSION=0.1.17
ROUTER_VENV=target/vllm-router-venv
installed=$("$ROUTER_VENV/bin/pip" show vllm-router 2>/dev/null | sed -n 's/^Version: //p' || true)
if [ "$installed" != "$ROUTER_VERSION" ]; then
    rm -rf "$ROUTER_VENV"
    python3 -m venv "$ROUTER_VENV"
    "$ROUTER_VENV/bin/pip" install --quiet --disable-pip-version-check "vllm-router==$ROUTER_VERSION"
fi
export PDKV_VLLM_ROUTER="$PWD/$ROUTER_VENV/bin/vllm-router"

cargo test --release --locked --workspace
