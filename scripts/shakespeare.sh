#!/usr/bin/env bash
# The main job: the shakespeare example, data-parallel on 2 CPU processes over Gloo.
# Usage: scripts/shakespeare.sh [--steps N] [other example flags]
source "$(dirname "${BASH_SOURCE[0]}")/env.sh"
cd "$ROOT"

DATA="$(tinyshakespeare)"

cargo build --release --quiet -p tch-distributed-examples --example shakespeare
export TCH_DISTRIBUTED_BACKEND=gloo
# No launcher: the #[distributed] training function starts its own 2 ranks.
export TCH_DISTRIBUTED_NPROC=2
exec target/release/examples/shakespeare \
  --data "$DATA" --checkpoint "$ROOT/data/shakespeare.safetensors" "$@"
