# Sourced by the other scripts: makes libtorch available to cargo.
#
# With LIBTORCH set, that libtorch is used as is. Otherwise a project-local
# virtualenv `.venv` gets torch==2.11.0 (the version tch 0.24 requires) plus the CUDA
# headers that the NCCL backend compiles against, on first use only (about 3 minutes
# and 4.6 GB); later runs find it ready and do nothing.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
TORCH_VERSION=2.11.0
CUDA_HEADERS='cuda-toolkit[nvcc,cccl]==13.0.2'

if [ -z "${LIBTORCH:-}" ]; then
  VENV="$ROOT/.venv"
  MARKER="$VENV/.tch-distributed-torch-$TORCH_VERSION"
  if [ ! -f "$MARKER" ]; then
    echo "setup: installing torch==$TORCH_VERSION and CUDA headers into $VENV (first run only: ~3 min, ~4.6 GB)" >&2
    python3 -m venv "$VENV"
    "$VENV/bin/pip" install --quiet --disable-pip-version-check "torch==$TORCH_VERSION" "$CUDA_HEADERS"
    touch "$MARKER"
  fi
  export VIRTUAL_ENV="$VENV"
  export PATH="$VENV/bin:$PATH"
  export LIBTORCH_USE_PYTORCH=1
fi
