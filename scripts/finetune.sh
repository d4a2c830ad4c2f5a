#!/usr/bin/env bash
# The second main job: LoRA fine-tuning (examples/finetune.rs), the FSDP/DeepSpeed
# guide's job, on 2 CPU ranks over Gloo. A small GPT is pretrained on tinyshakespeare's
# first 90% (once: runs/finetune/base.safetensors is kept), then its adapters are
# trained on the text after it under the guide's ds_config.json (ZeRO-2, AdamW,
# WarmupLR, bf16, gradient clipping) with 2 micro-batches a step and each block's
# activations recomputed; it prints the held-out loss before and after and writes
# runs/finetune/{checkpoint-N,final_model,logs,training_config.json}.
# Usage: scripts/finetune.sh [train flags: --steps N --save-steps N --lr X …]
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/env.sh"
cd "$(tch_workspace)"

DATA="$(tinyshakespeare)"
cargo build --release --quiet -p tch-distributed --bin tchrun
cargo build --release --quiet -p tch-distributed-examples --example finetune
export TCH_DISTRIBUTED_BACKEND=gloo
TCHRUN="$PWD/target/release/tchrun"
BIN="$PWD/target/release/examples/finetune"
RUN="$ROOT/runs/finetune"
mkdir -p "$RUN"
if [ ! -f "$RUN/base.safetensors" ]; then
  "$TCHRUN" --nproc-per-node 2 "$BIN" pretrain --data "$DATA" --out "$RUN/base.safetensors"
fi
exec "$TCHRUN" --nproc-per-node 2 --grad-accum 2 --deepspeed "$ROOT/examples/ds_config.json" \
  "$BIN" train --data "$DATA" --base "$RUN/base.safetensors" --output-dir "$RUN" "$@"
