#!/usr/bin/env bash
# The CUDA test suite: tests/tests/gpu.rs (test target `gpu`) and corpus/tests/gpu.rs
# (`corpus_gpu`), both behind the `gpu` feature, so that the default `cargo test`
# leaves them out. Every test asserts first that CUDA is available: without a GPU
# the suite fails, it never skips.
#
#   scripts/test_gpu.sh [FILTER]           build (release) and run the suite here (needs a GPU)
#   scripts/test_gpu.sh --package DIR      build it and copy what it runs into DIR, for a
#                                          GPU machine without Rust: there run DIR/run.sh
#
# The package holds the two test executables, tchrun, the worker programs, the
# examples and the corpus programs, stripped, in the layout the tests expect
# (DIR/release/deps/<test> finds DIR/release/<program>), and run.sh, which takes
# libtorch from the machine's own `python3 -c 'import torch'` (torch 2.11, the version
# these binaries are built against) through LD_LIBRARY_PATH. The binaries link
# libtorch dynamically and carry the NCCL backend when scripts/env.sh's CUDA headers
# were found at build time. `gpu-package/` at the repository root is git-ignored.
# TCHD_PACKAGE_PROFILE=dev builds it unoptimized in target/debug, sharing the test
# suite's build (what CI does: it checks that the package builds); release otherwise.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/env.sh"
cd "$ROOT"

PACKAGE=""
ARGS=()
while [ $# -gt 0 ]; do
  case "$1" in
    --package)
      [ $# -ge 2 ] || { echo "test_gpu.sh: --package needs a directory" >&2; exit 2; }
      PACKAGE="$2"
      shift 2
      ;;
    -h | --help)
      sed -n '2,18p' "${BASH_SOURCE[0]}" | sed 's/^# \{0,1\}//'
      exit 0
      ;;
    *)
      ARGS+=("$1")
      shift
      ;;
  esac
done

# What the tests run, besides tchrun: the worker programs (tests/src/bin), the
# examples, and the corpus programs.
WORKERS=(ddp_worker amp_worker data_loading_worker settings_worker checkpoint_worker sharding_worker frozen_worker)
EXAMPLES=(shakespeare mnist)
CORPUS=(mnist_conv char_rnn min_gpt resnet gan finetune lora)
TESTS=(gpu corpus_gpu)

if [ -z "$PACKAGE" ]; then
  # Fail before a long build when this machine has no GPU: ask PyTorch when python3
  # has it (the venv), else nvidia-smi.
  if python3 -c 'import torch' 2>/dev/null; then
    check=(python3 -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)')
  else
    check=(nvidia-smi -L)
  fi
  if ! "${check[@]}" >/dev/null 2>&1; then
    echo "test_gpu.sh: no GPU visible here (${check[*]} failed): the CUDA suite needs one." >&2
    echo "To build it for a GPU machine, use: scripts/test_gpu.sh --package DIR" >&2
    exit 1
  fi
fi

PROFILE="${TCHD_PACKAGE_PROFILE:-release}"
PROFILE_DIR="$([ "$PROFILE" = dev ] && echo debug || echo "$PROFILE")"
echo "test_gpu.sh: building ($PROFILE)" >&2
cargo build --profile "$PROFILE" -p tch-distributed --bin tchrun
cargo build --profile "$PROFILE" -p tch-distributed-examples --examples
# Building a test target builds its package's programs too; the JSON messages name
# the test executables.
declare -A EXE
for spec in "tch-distributed-tests gpu" "tch-distributed-corpus corpus_gpu"; do
  read -r pkg test <<<"$spec"
  path=$(cargo test --profile "$PROFILE" -p "$pkg" --features gpu --test "$test" --no-run \
    --message-format=json-render-diagnostics |
    python3 -c '
import json, sys
test = sys.argv[1]
for line in sys.stdin:
    try:
        m = json.loads(line)
    except ValueError:
        continue
    if m.get("reason") == "compiler-artifact" and m["target"]["name"] == test and m.get("executable") and m["profile"]["test"]:
        print(m["executable"])
' "$test" | tail -n 1)
  [ -n "$path" ] || { echo "test_gpu.sh: no executable for test $test of $pkg" >&2; exit 1; }
  EXE[$test]="$path"
done

if [ -z "$PACKAGE" ]; then
  status=0
  for test in "${TESTS[@]}"; do
    echo "== $test: ${EXE[$test]}"
    "${EXE[$test]}" --test-threads=1 --show-output "${ARGS[@]}" || status=1
  done
  [ $status -eq 0 ] && echo "test_gpu.sh: all GPU tests passed" || echo "test_gpu.sh: GPU tests FAILED" >&2
  exit $status
fi

# The package.
rm -rf "$PACKAGE"
mkdir -p "$PACKAGE/release/deps" "$PACKAGE/release/examples"
PACKAGE="$(cd "$PACKAGE" && pwd)"
BIN="${CARGO_TARGET_DIR:-$ROOT/target}/$PROFILE_DIR"
copy() { # SRC DEST: a stripped copy
  cp "$1" "$2"
  strip --strip-all "$2" 2>/dev/null || strip "$2"
}
copy "$BIN/tchrun" "$PACKAGE/release/tchrun"
for name in "${WORKERS[@]}" "${CORPUS[@]}"; do
  copy "$BIN/$name" "$PACKAGE/release/$name"
done
for name in "${EXAMPLES[@]}"; do
  copy "$BIN/examples/$name" "$PACKAGE/release/examples/$name"
done
for test in "${TESTS[@]}"; do
  copy "${EXE[$test]}" "$PACKAGE/release/deps/$test"
done

cat >"$PACKAGE/run.sh" <<'EOF'
#!/usr/bin/env bash
# Runs the tch-distributed CUDA suite that scripts/test_gpu.sh --package copied here.
# Needs an NVIDIA GPU and python3 with torch 2.11 on PATH: its torch/lib is the
# libtorch these binaries run against. Usage: run.sh [FILTER] (a libtest name filter);
# SUITES="gpu" or SUITES="corpus_gpu" runs one of the two test executables only.
set -uo pipefail
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
TORCH_LIB="$(python3 -c 'import os, torch; print(os.path.join(os.path.dirname(torch.__file__), "lib"))')" || {
  echo "run.sh: python3 with torch is needed on PATH (its lib/ holds libtorch)" >&2
  exit 1
}
export LD_LIBRARY_PATH="$TORCH_LIB${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
# The PyTorch the tests compare with (tch_distributed_tests::python): this python3.
export TCHD_PYTHON="${TCHD_PYTHON:-$(command -v python3)}"
python3 -c 'import torch; print("torch", torch.__version__, "CUDA", torch.version.cuda, "GPU available:", torch.cuda.is_available(), *(torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())))'
missing=$(ldd "$HERE/release/tchrun" "$HERE/release/deps/gpu" 2>&1 | grep 'not found' | sort -u)
if [ -n "$missing" ]; then
  echo "run.sh: libraries not found with LD_LIBRARY_PATH=$LD_LIBRARY_PATH:" >&2
  echo "$missing" >&2
  exit 1
fi
LOG="$(mktemp -t tchd-gpu-XXXXXX.log)"
status=0
for test in ${SUITES:-gpu corpus_gpu}; do
  echo "== $test"
  "$HERE/release/deps/$test" --test-threads=1 --show-output "$@" 2>&1 | tee -a "$LOG"
  [ "${PIPESTATUS[0]}" -eq 0 ] || status=1
done
echo
echo "== results"
grep -E '^test .* \.\.\. ' "$LOG" | sed 's/^test //'
if [ $status -eq 0 ]; then
  echo "run.sh: all GPU tests passed"
else
  echo "run.sh: GPU tests FAILED (full log: $LOG)"
fi
exit $status
EOF
chmod +x "$PACKAGE/run.sh"

echo "test_gpu.sh: package in $PACKAGE ($(du -sh "$PACKAGE" | cut -f1)); on the GPU machine run $PACKAGE/run.sh (or the copied folder's run.sh)"
ls -l "$PACKAGE/release" "$PACKAGE/release/deps" "$PACKAGE/release/examples" | sed 's/^/  /'
