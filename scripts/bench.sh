#!/usr/bin/env bash
# Benchmarks (release builds).
#
#   scripts/bench.sh [all] [suite flags]   every benchmark, Rust against PyTorch DDP: tables on stdout
#   scripts/bench.sh loader [flags]        DataLoader samples/s, one rank
#   scripts/bench.sh ddp|allreduce [flags] one side-by-side benchmark's Rust side, one process
#   scripts/bench.sh optim [flags]         the optimizer step alone: tch's, the SDK's implementations
#                                          (and torch.optim's with --python PYTHON)
#   scripts/bench.sh agree [STEPS] [ROUNDS] what a sharded loop's agreed exit and agreed end
#                                          cost a step: 2 ranks over Gloo
#   scripts/bench.sh zero                  ZeRO stage 1's memory: Adam on 52.5 M parameters, 1/2/4 ranks
#   scripts/bench.sh sharding              ZeRO 1/2/3 against DDP and PyTorch FSDP2: memory, step time
#   scripts/bench.sh activation            activation checkpointing against the plain model: memory, step time
#   scripts/bench.sh collective-checks    what debug = "detail" costs an all-reduce (1 KiB to 4 MiB,
#                                          2 ranks over Gloo): the sweep with and without the checks
#   scripts/bench.sh multi-node [STEPS]    shakespeare's tokens/s, 1 host × 2 ranks against 2 hosts ×
#                                          1 rank (network namespaces; root and `ip`)
#
# The suite's flags: --only mlp,cnn,transformer,linear200,allreduce --rounds N --scale X
# --json FILE (see target/release/suite --help). Builds go to $CARGO_TARGET_DIR when set,
# else target/.
source "$(dirname "${BASH_SOURCE[0]}")/env.sh"
cd "$ROOT"
export OMP_NUM_THREADS=1
TARGET="${CARGO_TARGET_DIR:-$ROOT/target}"
bench=all
if [ $# -gt 0 ] && [ "${1#-}" = "$1" ]; then
  bench="$1"
  shift
fi
case "$bench" in
  all | suite)
    DATA="$(tinyshakespeare)"
    cargo build --release --quiet -p tch-distributed --bin tchrun
    cargo build --release --quiet -p tch-distributed-bench --bins
    PYTHON="${BENCH_PYTHON:-${VIRTUAL_ENV:+$VIRTUAL_ENV/bin/python}}"
    exec "$TARGET/release/suite" --python "${PYTHON:-python3}" --data "$DATA" "$@"
    ;;
  sharding)
    cargo build --release --quiet -p tch-distributed --bin tchrun
    cargo build --release --quiet -p tch-distributed-bench --bin sharding
    PYTHON="${BENCH_PYTHON:-${VIRTUAL_ENV:+$VIRTUAL_ENV/bin/python}}"
    exec "$TARGET/release/sharding" --python "${PYTHON:-python3}" "$@"
    ;;
  zero)
    cargo build --release --quiet -p tch-distributed --bin tchrun
    cargo build --release --quiet -p tch-distributed-bench --bin zero
    exec "$TARGET/release/zero" "$@"
    ;;
  activation)
    cargo build --release --quiet -p tch-distributed --bin tchrun
    cargo build --release --quiet -p tch-distributed-bench --bin activation
    exec "$TARGET/release/activation" "$@"
    ;;
  collective-checks)
    cargo build --release --quiet -p tch-distributed --bin tchrun
    cargo build --release --quiet -p tch-distributed-bench --bin allreduce
    for debug in off detail; do
      "$TARGET/release/tchrun" --nproc-per-node 2 --debug "$debug" "$TARGET/release/allreduce" \
        --max-bytes $((4 << 20)) --volume $((64 << 20)) "$@" | sed -n "s/^BENCH /$debug /p"
    done | python3 -c '
import json, sys
rows = {}
for line in sys.stdin:
    debug, report = line.split(" ", 1)
    r = json.loads(report)
    rows.setdefault(r["bytes"], {})[debug] = r["seconds"] * 1e6
print("| bytes | all-reduce | with debug = \"detail\" | added |")
print("|---|---|---|---|")
for size, t in sorted(rows.items()):
    print(f"| {size} | {t[\"off\"]:.0f} us | {t[\"detail\"]:.0f} us | +{t[\"detail\"] - t[\"off\"]:.0f} us |")
'
    ;;
  multi-node)
    cargo build --release --quiet -p tch-distributed --bin tchrun
    cargo build --release --quiet -p tch-distributed-examples --example shakespeare
    exec bench/multi_node.sh "$TARGET/release/tchrun" "$TARGET/release/examples/shakespeare" \
      "$(tinyshakespeare)" "$@"
    ;;
  *)
    cargo build --release --quiet -p tch-distributed-bench --bin "$bench"
    exec "$TARGET/release/$bench" "$@"
    ;;
esac
