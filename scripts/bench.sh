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
#   scripts/bench.sh comm-hook             DDP's gradient compression (comm_hook none, fp16, bf16): the
#                                          bytes a synchronized step sends (loopback's counter) and
#                                          its time, mlp workload on 2 ranks over Gloo
#   scripts/bench.sh hybrid                ZeRO-3 across 2 hosts × 2 ranks, flat against
#                                          shard_group = node, and DDP: the bytes between the
#                                          hosts, step time, memory (network namespaces; root
#                                          and `ip`)
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
print("| bytes | all-reduce | with debug = detail | added |")
print("|---|---|---|---|")
for size, t in sorted(rows.items()):
    off, detail = t["off"], t["detail"]
    print(f"| {size} | {off:.0f} us | {detail:.0f} us | +{detail - off:.0f} us |")
'
    ;;
  comm-hook)
    cargo build --release --quiet -p tch-distributed --bin tchrun
    cargo build --release --quiet -p tch-distributed-bench --bin ddp
    # The bytes of a synchronized step: loopback's transmit counter over a run of 60
    # synchronized steps minus one of 20 (what every run sends once, the rendezvous and
    # the initial broadcast of the weights, cancels out). Other traffic on loopback
    # counts too: run it on a quiet machine.
    tx() { cat /sys/class/net/lo/statistics/tx_bytes; }
    for hook in none fp16 bf16; do
      for steps in 10 50; do
        before=$(tx)
        report=$("$TARGET/release/tchrun" --nproc-per-node 2 --comm-hook "$hook" \
          "$TARGET/release/ddp" --workload mlp --warmup 10 --steps "$steps" "$@" | sed -n 's/^BENCH //p')
        echo "$hook $steps $(( $(tx) - before )) $report"
      done
    done | python3 -c '
import json, sys
runs = {}
for line in sys.stdin:
    hook, steps, sent, report = line.split(" ", 3)
    runs.setdefault(hook, {})[int(steps)] = (int(sent), json.loads(report))
print("| comm_hook | bytes per synchronized step | of none | step |")
print("|---|---|---|---|")
per = {h: (r[50][0] - r[10][0]) / 40 for h, r in runs.items()}
for hook, r in runs.items():
    sent, ratio, step = per[hook] / 1e6, per[hook] / per["none"], r[50][1]["step_ms"]
    print(f"| {hook} | {sent:.2f} MB | {ratio:.2f} | {step:.1f} ms |")
'
    ;;
  hybrid)
    cargo build --release --quiet -p tch-distributed --bin tchrun
    cargo build --release --quiet -p tch-distributed-bench --bin sharding
    exec bench/hybrid.sh "$TARGET/release/tchrun" "$TARGET/release/sharding" "$@"
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
