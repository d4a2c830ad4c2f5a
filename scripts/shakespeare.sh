#!/usr/bin/env bash
# The main job: the shakespeare example, data-parallel on 2 CPU processes over Gloo.
# Usage: scripts/shakespeare.sh [--tch 0.24|0.26] [--steps N] [other example flags]
# (--tch 0.26: built with tch 0.26 and torch 2.13.0; see env.sh)
if [ "${1:-}" = --tch ]; then
  export TCHD_TCH="${2:?--tch needs 0.24 or 0.26}"
  shift 2
fi
source "$(dirname "${BASH_SOURCE[0]}")/env.sh"
cd "$(tch_workspace)"

DATA="$(tinyshakespeare)"

cargo build --release --quiet -p tch-distributed-examples --example shakespeare
export TCH_DISTRIBUTED_BACKEND=gloo
# No launcher: the #[distributed] training function starts its own 2 ranks.
export TCH_DISTRIBUTED_NPROC=2
# Metrics, TensorBoard events, loss.png, config.json and the trained weights, side
# by side.
RUN="$ROOT/runs/shakespeare"
exec "$PWD/target/release/examples/shakespeare" \
  --data "$DATA" --runs "$RUN" --checkpoint "$RUN/shakespeare.safetensors" "$@"
