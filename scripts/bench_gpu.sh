#!/usr/bin/env bash
# GPU benchmarks: every workload on one CUDA device, fp32 and bf16, Rust under
# #[distributed] against PyTorch DDP and plain PyTorch (bench/python/gpu_suite.py; method
# in bench/RESULTS.md, "GPU"); then sharding's memory and speed (bench/sharding.rs
# --device cuda: DDP and ZeRO stages 1-3 against PyTorch's DDP and FSDP2).
#
#   scripts/bench_gpu.sh [suite flags]          builds (release), then runs here: needs a GPU
#   scripts/bench_gpu.sh --package DIR          builds and copies into DIR what a GPU machine
#                                               without Rust needs; there: DIR/run.sh [suite flags]
#
# The suite's flags: --only mlp,cnn,transformer,linear200,linear4096 --ranks 1,2
# --precision fp32,bf16 --scale X --rounds N --out DIR (python3 bench/python/gpu_suite.py
# --help). The package holds the stripped `ddp`, `sharding` and `tchrun` binaries (linked dynamically
# against libtorch: run.sh points LD_LIBRARY_PATH at the torch/lib of the python3 on PATH,
# which must be torch 2.11.0 with CUDA), the Python scripts and tinyshakespeare. Builds go
# to $CARGO_TARGET_DIR when set, else target/. TCHD_PACKAGE_PROFILE=dev builds the
# package unoptimized in target/debug, sharing the test suite's build (what CI does:
# it checks that the package builds); release otherwise.
source "$(dirname "${BASH_SOURCE[0]}")/env.sh"
cd "$ROOT"
TARGET="${CARGO_TARGET_DIR:-$ROOT/target}"

package=""
if [ "${1:-}" = "--package" ]; then
  package="${2:?--package needs a directory}"
  shift 2
fi

PROFILE="${TCHD_PACKAGE_PROFILE:-release}"
PROFILE_DIR="$([ "$PROFILE" = dev ] && echo debug || echo "$PROFILE")"
build() {
  cargo build --profile "$PROFILE" --quiet -p tch-distributed --bin tchrun
  cargo build --profile "$PROFILE" --quiet -p tch-distributed-bench --bin ddp --bin sharding
}

if [ -z "$package" ]; then
  PYTHON="${BENCH_PYTHON:-${VIRTUAL_ENV:+$VIRTUAL_ENV/bin/python}}"
  PYTHON="${PYTHON:-python3}"
  if ! "$PYTHON" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)' 2>/dev/null; then
    echo "scripts/bench_gpu.sh: needs a GPU: no CUDA device is visible to $PYTHON here." >&2
    echo "  Build a package here and run it on a GPU machine instead:" >&2
    echo "    scripts/bench_gpu.sh --package /tmp/benchpkg   # then, there: /tmp/benchpkg/run.sh" >&2
    exit 2
  fi
  DATA="$(tinyshakespeare)"
  build
  git -C "$ROOT" describe --always --dirty >"$TARGET/bench-gpu-version" 2>/dev/null || true
  "$PYTHON" bench/python/gpu_suite.py --bin "$TARGET/$PROFILE_DIR" --data "$DATA" \
    --version-file "$TARGET/bench-gpu-version" --out "$TARGET/gpu-bench-out" "$@"
  # Sharding's memory on the GPU: DDP and ZeRO stages 1-3 against PyTorch's DDP and
  # FSDP2, 2 and 4 ranks sharing the GPU over Gloo.
  exec "$TARGET/$PROFILE_DIR/sharding" --device cuda --python "$PYTHON"
fi

DATA="$(tinyshakespeare)"
build
mkdir -p "$package/bin" "$package/python" "$package/data"
for bin in ddp sharding tchrun; do
  # The binaries keep a RUNPATH naming this machine's libtorch; LD_LIBRARY_PATH, which
  # run.sh sets to the GPU machine's torch/lib, is searched before it.
  strip -o "$package/bin/$bin" "$TARGET/$PROFILE_DIR/$bin"
done
cp bench/python/ddp_bench.py bench/python/gpu_suite.py bench/python/fsdp_bench.py "$package/python/"
cp "$DATA" "$package/data/tinyshakespeare.txt"
{
  git -C "$ROOT" describe --always --dirty 2>/dev/null || echo unknown
} >"$package/VERSION"
cat >"$package/run.sh" <<'EOF'
#!/usr/bin/env bash
# The GPU benchmark table (made by tch-distributed's scripts/bench_gpu.sh --package).
#   ./run.sh [--only linear4096,linear200] [--scale 0.5] [--ranks 1] [--out DIR]
# Needs: an NVIDIA GPU and python3 with torch 2.11.0 (CUDA) on PATH, or PYTHON=…;
# no Rust. An estimated 7-10 minutes for everything; the suite's table goes to stdout
# and to gpu-bench-out/table.md, the raw figures and each run's log next to it; then
# the sharding table, to stdout.
set -euo pipefail
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
PYTHON="${PYTHON:-python3}"
if ! TORCH_LIB="$("$PYTHON" -c 'import torch, os; print(os.path.join(os.path.dirname(torch.__file__), "lib"))' 2>/dev/null)"; then
  echo "run.sh: $PYTHON cannot import torch: put python3 with torch 2.11.0 (CUDA) on PATH, or set PYTHON" >&2
  exit 2
fi
export LD_LIBRARY_PATH="$TORCH_LIB${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
"$PYTHON" "$HERE/python/gpu_suite.py" --bin "$HERE/bin" \
  --data "$HERE/data/tinyshakespeare.txt" --version-file "$HERE/VERSION" "$@"
# Sharding's memory on the GPU (about 2 minutes): DDP and ZeRO stages 1-3 against
# PyTorch's DDP and FSDP2, 2 and 4 ranks sharing the GPU over Gloo. SHARDING=0 skips it.
if [ "${SHARDING:-1}" != 0 ]; then
  # bench/sharding.rs finds fsdp_bench.py beside its sources; here, beside run.sh.
  TCHD_FSDP_BENCH="$HERE/python/fsdp_bench.py" "$HERE/bin/sharding" --device cuda --python "$PYTHON"
fi
EOF
chmod +x "$package/run.sh"
echo "package: $package ($(du -sh "$package" | cut -f1)):" >&2
(cd "$package" && find . -type f | sort | xargs ls -l | awk '{printf "  %10d  %s\n", $5, $9}') >&2
echo "on the GPU machine: $package/run.sh   (or: bash run.sh --only linear4096)" >&2
