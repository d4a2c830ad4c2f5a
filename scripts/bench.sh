#!/usr/bin/env bash
# Benchmarks (release builds). Usage: scripts/bench.sh loader [flags]
source "$(dirname "${BASH_SOURCE[0]}")/env.sh"
cd "$ROOT"
export OMP_NUM_THREADS=1
bench="${1:-loader}"
shift || true
cargo build --release --quiet -p tch-distributed-bench --bin "$bench"
exec "target/release/$bench" "$@"
