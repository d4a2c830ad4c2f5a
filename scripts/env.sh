# Sourced by the other scripts: makes libtorch available to cargo.
#
# With LIBTORCH set, that libtorch is used as is. Otherwise a project-local
# virtualenv `.venv` gets torch==2.11.0 (the version tch 0.24 requires), the CUDA
# headers that the NCCL backend compiles against, and safetensors for the tests that
# compare with PyTorch, on first use only (about 3 minutes and 4.6 GB); later runs find
# it ready and do nothing.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
TORCH_VERSION=2.11.0
CUDA_HEADERS='cuda-toolkit[nvcc,cccl]==13.0.2'
# The Python side of the tests that compare with PyTorch (safetensors.torch).
PY_TEST_DEPS='safetensors==0.5.3'
REQUIREMENTS="torch==$TORCH_VERSION $CUDA_HEADERS $PY_TEST_DEPS"

if [ -z "${LIBTORCH:-}" ]; then
  VENV="$ROOT/.venv"
  # One marker per requirement list: a changed list installs what is new.
  MARKER="$VENV/.tch-distributed-$(echo "$REQUIREMENTS" | cksum | cut -d' ' -f1)"
  if [ ! -f "$MARKER" ]; then
    echo "setup: installing $REQUIREMENTS into $VENV (first run only: ~3 min, ~4.6 GB)" >&2
    [ -x "$VENV/bin/pip" ] || python3 -m venv "$VENV"
    # shellcheck disable=SC2086
    "$VENV/bin/pip" install --quiet --disable-pip-version-check $REQUIREMENTS
    touch "$MARKER"
  fi
  export VIRTUAL_ENV="$VENV"
  export PATH="$VENV/bin:$PATH"
  export LIBTORCH_USE_PYTORCH=1
fi

# Puts tinyshakespeare in data/ (from ../shared/data when present, else downloaded);
# prints its path.
tinyshakespeare() {
  local data="$ROOT/data/tinyshakespeare.txt"
  if [ ! -f "$data" ]; then
    mkdir -p "$ROOT/data"
    if [ -f "$ROOT/../shared/data/tinyshakespeare.txt" ]; then
      cp "$ROOT/../shared/data/tinyshakespeare.txt" "$data"
    else
      echo "downloading tinyshakespeare (1.1 MB)" >&2
      curl -fsSL -o "$data.part" https://raw.githubusercontent.com/karpathy/char-rnn/master/data/tinyshakespeare/input.txt
      mv "$data.part" "$data"
    fi
  fi
  echo "$data"
}
