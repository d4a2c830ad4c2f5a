#!/usr/bin/env bash
# GPU benchmarks: every workload on one CUDA device, fp32 and bf16, Rust under
# #[distributed] against PyTorch DDP and plain PyTorch (bench/python/gpu_suite.py; method
# in bench/RESULTS.md, "GPU").
#
#   scripts/bench_gpu.sh [suite flags]          builds (release), then runs here: needs a GPU
#   scripts/bench_gpu.sh --package DIR          builds and copies into DIR what a GPU machine
#                                               without Rust needs; there: DIR/run.sh [suite flags]
#
# The suite's flags: --only mlp,cnn,transformer,linear200,linear4096 --ranks 1,2
# --precision fp32,bf16 --scale X --rounds N --out DIR (python3 bench/python/gpu_suite.py
# --help). The package holds the stripped `ddp` and `tchrun` binaries (linked dynamically
# against libtorch: run.sh points LD_LIBRARY_PATH at the torch/lib of the python3 on PATH,
# which must be torch 2.11.0 with CUDA), the Python scripts and tinyshakespeare. Builds go
# to $CARGO_TARGET_DIR when set, else target/.
source "$(dirname "${BASH_SOURCE[0]}")/env.sh"
cd "$ROOT"
TARGET="${CARGO_TARGET_DIR:-$ROOT/target}"

package=""
if [ "${1:-}" = "--package" ]; then
  package="${2:?--package needs a directory}"
  shift 2
fi

build() {
  cargo build --release --quiet -p tch-distributed --bin tchrun
  cargo build --release --quiet -p tch-distributed-bench --bin ddp
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
  exec "$PYTHON" bench/python/gpu_suite.py --bin "$TARGET/release" --data "$DATA" \
    --version-file "$TARGET/bench-gpu-version" --out "$TARGET/gpu-bench-out" "$@"
fi

DATA="$(tinyshakespeare)"
build
mkdir -p "$package/bin" "$package/python" "$package/data"
for bin in ddp tchrun; do
  # The binaries keep a RUNPATH naming this machine's libtorch; LD_LIBRARY_PATH, which
  # run.sh sets to the GPU machine's torch/lib, is searched before it.
  strip -o "$package/bin/$bin" "$TARGET/release/$bin"
done
cp bench/python/ddp_bench.py bench/python/gpu_suite.py "$package/python/"
cp "$DATA" "$package/data/tinyshakespeare.txt"
{
  git -C "$ROOT" describe --always --dirty 2>/dev/null || echo unknown
} >"$package/VERSION"
cat >"$package/run.sh" <<'EOF'
#!/usr/bin/env bash
# The GPU benchmark table (made by tch-distributed's scripts/bench_gpu.sh --package).
#   ./run.sh [--only linear4096,linear200] [--scale 0.5] [--ranks 1] [--out DIR]
# Needs: an NVIDIA GPU and python3 with torch 2.11.0 (CUDA) on PATH, or PYTHON=…;
# no Rust. An estimated 5-8 minutes for everything; the table goes to stdout and to
# gpu-bench-out/table.md, the raw figures and each run's log next to it.
set -euo pipefail
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
PYTHON="${PYTHON:-python3}"
if ! TORCH_LIB="$("$PYTHON" -c 'import torch, os; print(os.path.join(os.path.dirname(torch.__file__), "lib"))' 2>/dev/null)"; then
  echo "run.sh: $PYTHON cannot import torch: put python3 with torch 2.11.0 (CUDA) on PATH, or set PYTHON" >&2
  exit 2
fi
export LD_LIBRARY_PATH="$TORCH_LIB${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
exec "$PYTHON" "$HERE/python/gpu_suite.py" --bin "$HERE/bin" \
  --data "$HERE/data/tinyshakespeare.txt" --version-file "$HERE/VERSION" "$@"
EOF
chmod +x "$package/run.sh"
echo "package: $package ($(du -sh "$package" | cut -f1)):" >&2
(cd "$package" && find . -type f | sort | xargs ls -l | awk '{printf "  %10d  %s\n", $5, $9}') >&2
echo "on the GPU machine: $package/run.sh   (or: bash run.sh --only linear4096)" >&2
