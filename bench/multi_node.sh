#!/usr/bin/env bash
# Tokens/s per process of the shakespeare example, 1 host × 2 ranks against 2 hosts ×
# 1 rank, the hosts made of network namespaces on this machine (root and iproute2's
# `ip`). Run through `scripts/bench.sh multi-node [STEPS]`, which builds tchrun and the
# example in release first; prints a Markdown table.
set -euo pipefail
TCHRUN="$1" SHAKESPEARE="$2" DATA="$3" STEPS="${4:-200}"
NS="tchd-bench-$$"
source "$(dirname "${BASH_SOURCE[0]}")/hosts.sh"
make_hosts "$NS"
OUT="$(mktemp -d)"
# "trained N steps in T s: R tokens/s per process; …" → R
rate() { sed -n 's/^trained .*: \([0-9]*\) tokens\/s per process.*/\1/p' "$1"; }
args=(--data "$DATA" --steps "$STEPS" --log-every 1000000 --checkpoint "$OUT/model.safetensors")
(cd "$OUT" && ip netns exec "$NS-h0" "$TCHRUN" --nproc-per-node 2 "$SHAKESPEARE" "${args[@]}" >one.out 2>one.err)
for i in 0 1; do
  (cd "$OUT" && ip netns exec "$NS-h$i" "$TCHRUN" --nnodes 2 --node-rank "$i" --nproc-per-node 1 \
    --master-addr 10.77.0.1 --master-port 29400 "$SHAKESPEARE" "${args[@]}" >"two$i.out" 2>"two$i.err") &
done
wait
echo "| layout | tokens/s per process |"
echo "|---|---|"
echo "| 1 host × 2 ranks (loopback) | $(rate "$OUT/one.out") |"
echo "| 2 hosts × 1 rank (veth and a bridge) | $(rate "$OUT/two0.out") |"
echo
echo "shakespeare, $STEPS steps, default sizes, release build, OMP_NUM_THREADS=1, $(nproc --all) cores."
rm -rf "$OUT"
