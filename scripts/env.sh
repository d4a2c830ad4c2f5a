# Sourced by the other scripts: makes libtorch available to cargo.
#
# With LIBTORCH set, that libtorch is used as is. Otherwise a project-local virtualenv
# gets torch (the version the chosen tch requires), the CUDA headers that the NCCL
# backend compiles against, and safetensors for the tests that compare with PyTorch, on
# first use only (about 3 minutes and 4.7 GB); later runs find it ready and do nothing.
#
# TCHD_TORCH_VERSION picks the pair: 2.11.0 (the default; tch 0.24; `.venv`, which the
# workspace's Cargo.lock builds against) or 2.13.0 (tch 0.26; `.venv-2.13`).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
TORCH_VERSION="${TCHD_TORCH_VERSION:-2.11.0}"
case "$TORCH_VERSION" in
  # The cuda-toolkit that this torch itself pins, with the compiler headers.
  2.11.0) VENV="$ROOT/.venv" CUDA_HEADERS='cuda-toolkit[nvcc,cccl]==13.0.2' ;;
  2.13.0) VENV="$ROOT/.venv-2.13" CUDA_HEADERS='cuda-toolkit[nvcc,cccl]==13.0.3' ;;
  *)
    echo "error: TCHD_TORCH_VERSION=$TORCH_VERSION is not supported: use 2.11.0 (tch 0.24) or 2.13.0 (tch 0.26)" >&2
    exit 2
    ;;
esac
# The Python side of the tests that compare with PyTorch (safetensors.torch).
PY_TEST_DEPS='safetensors==0.5.3'
REQUIREMENTS="torch==$TORCH_VERSION $CUDA_HEADERS $PY_TEST_DEPS"

if [ -z "${LIBTORCH:-}" ]; then
  # One marker per requirement list: a changed list installs what is new.
  MARKER="$VENV/.tch-distributed-$(echo "$REQUIREMENTS" | cksum | cut -d' ' -f1)"
  if [ ! -f "$MARKER" ]; then
    echo "setup: installing $REQUIREMENTS into $VENV (first run only: ~3 min, ~4.7 GB)" >&2
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
