#!/usr/bin/env bash
# The project's test command: fetches the default model (SmolLM2-135M-Instruct)
# when it is not cached yet, then runs every test in release mode.
set -euo pipefail
cd "$(dirname "$0")/.."
cargo build --release --locked -p pdkv
./target/release/pdkv model fetch
cargo test --release --locked --workspace
