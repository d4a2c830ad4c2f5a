#!/usr/bin/env bash
# Hybrid sharding across hosts: ZeRO-3 with every layer a unit (the sharding bench's
# model, 16 × Linear(1024, 1024), Adam, 5 steps after a warm-up one), 2 hosts × 2
# ranks made of network namespaces (root and iproute2's `ip`), flat (every rank one
# shard group) against shard_group = node, and DDP. For each: the bytes host 0's link
# carried (its veth's rx + tx counters, the whole run: rendezvous, broadcast, steps),
# the slowest rank's mean step and the largest added peak memory per rank. Run
# through `scripts/bench.sh hybrid`, which builds tchrun and the sharding bench in
# release first; prints a Markdown table.
set -euo pipefail
TCHRUN="$1" SHARDING="$2"
NS="tchd-hybrid-$$"
source "$(dirname "${BASH_SOURCE[0]}")/hosts.sh"
make_hosts "$NS"
OUT="$(mktemp -d)"
bytes() {
  ip netns exec "$NS-h0" sh -c \
    'echo $(( $(cat /sys/class/net/eth0/statistics/rx_bytes) + $(cat /sys/class/net/eth0/statistics/tx_bytes) ))'
}
echo "| 2 hosts × 2 ranks | bytes through host 0's link (MB) | step (ms) | added peak per rank (MB) |"
echo "|---|---|---|---|"
for layout in "DDP:0:4" "ZeRO-3, flat (shard groups of 4):3:4" "ZeRO-3, shard_group = node:3:node"; do
  IFS=: read -r name zero group <<<"$layout"
  before=$(bytes)
  for i in 0 1; do
    ip netns exec "$NS-h$i" env TCH_DISTRIBUTED_ZERO="$zero" TCH_DISTRIBUTED_SHARD_GROUP="$group" \
      TCHD_BENCH_UNITS=1 TCHD_BENCH_DEVICE=cpu CUDA_VISIBLE_DEVICES= OMP_NUM_THREADS=1 \
      MALLOC_MMAP_THRESHOLD_=65536 \
      "$TCHRUN" --nnodes 2 --node-rank "$i" --nproc-per-node 2 --master-addr 10.77.0.1 \
      --master-port 29400 "$SHARDING" --worker >"$OUT/$i.out" 2>"$OUT/$i.err" &
  done
  wait
  after=$(bytes)
  cat "$OUT/0.err" "$OUT/1.err" | sed -n 's/^.*SHARDING //p' | python3 -c '
import json, sys
rows = [json.loads(l) for l in sys.stdin]
step = max(r["step_ms"] for r in rows)
added = max(r["peak"] - r["baseline"] for r in rows)
print(f"{step:.1f} {added / 1e6:.0f}")' >"$OUT/row"
  read -r step added <"$OUT/row"
  echo "| $name | $(python3 -c "print(f'{($after - $before) / 1e6:.1f}')") | $step | $added |"
done
echo
echo "Release build, OMP_NUM_THREADS=1, Gloo over veth and a bridge, $(nproc --all) cores shared by the 4 ranks."
rm -rf "$OUT"
