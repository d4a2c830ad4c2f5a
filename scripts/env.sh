# Sourced by the other scripts: makes libtorch available to cargo, for one of the two
# tch versions the SDK supports.
#
# TCHD_TCH picks the pair:
#   0.24 (the default): tch 0.24 with torch 2.11.0, in `.venv`; cargo works in the
#        repository itself, whose Cargo.lock is on tch 0.24 (the GPU machine's image
#        ships torch 2.11.0).
#   0.26: tch 0.26 with torch 2.13.0, in `.venv-2.13`; `tch_workspace` gives a copy of
#        the working tree (target/tch-0.26/ws) whose Cargo.lock is moved to tch 0.26.
#
# With LIBTORCH set, that libtorch is used as is. Otherwise the virtualenv gets torch,
# the CUDA headers that the NCCL backend compiles against, and safetensors for the tests
# that compare with PyTorch, on first use only (under a minute and 4.7 GB, by uv);
# later runs find it ready and do nothing.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
TCH="${TCHD_TCH:-0.24}"
case "$TCH" in
  # The cuda-toolkit that this torch itself pins, with the compiler headers.
  0.24) TORCH_VERSION=2.11.0 VENV="$ROOT/.venv" CUDA_HEADERS='cuda-toolkit[nvcc,cccl]==13.0.2' ;;
  0.26) TORCH_VERSION=2.13.0 VENV="$ROOT/.venv-2.13" CUDA_HEADERS='cuda-toolkit[nvcc,cccl]==13.0.3' ;;
  *)
    echo "error: tch $TCH is not supported: use 0.24 (torch 2.11.0) or 0.26 (torch 2.13.0)" >&2
    exit 2
    ;;
esac
# The Python side of the tests that compare with PyTorch (safetensors.torch), and
# TensorBoard's event reader for the Tracker's tests.
PY_TEST_DEPS='safetensors==0.5.3 tensorboard==2.21.0'
REQUIREMENTS="torch==$TORCH_VERSION $CUDA_HEADERS $PY_TEST_DEPS"
UV='uv==0.13.9'

if [ -z "${LIBTORCH:-}" ]; then
  # One marker per requirement list: a changed list installs what is new.
  MARKER="$VENV/.tch-distributed-$(echo "$REQUIREMENTS" | cksum | cut -d' ' -f1)"
  if [ ! -f "$MARKER" ]; then
    echo "setup: installing $REQUIREMENTS into $VENV (first run only: <1 min, ~4.7 GB)" >&2
    setup_start=$SECONDS
    [ -x "$VENV/bin/pip" ] || python3 -m venv "$VENV"
    # uv (pinned, into the virtualenv itself) downloads and unpacks the ~4.7 GB in
    # parallel: 24 s where pip took 111 s here. No cache: it would keep another ~4 GB
    # of wheels on disk. The system's certificates, as pip's.
    [ -x "$VENV/bin/uv" ] \
      || "$VENV/bin/pip" install --quiet --disable-pip-version-check --no-cache-dir "$UV"
    # shellcheck disable=SC2086
    UV_NO_CACHE=1 UV_NATIVE_TLS=1 "$VENV/bin/uv" pip install --quiet --python "$VENV/bin/python" \
      $REQUIREMENTS
    touch "$MARKER"
    echo "setup: installed in $((SECONDS - setup_start)) s" >&2
  fi
  export VIRTUAL_ENV="$VENV"
  export PATH="$VENV/bin:$PATH"
  export LIBTORCH_USE_PYTORCH=1
fi

# The C++ compiles (torch-sys's wrapper, the SDK's shim) go through ccache when it is
# installed: CI builds the same libtorch stack several times (the workspace, the ui
# cases' own target, a user's crate), each ~3 minutes of C++ on 2 cores without it.
if [ -z "${CXX:-}" ] && command -v ccache >/dev/null; then
  export CC="ccache cc" CXX="ccache c++"
  export CCACHE_DIR="${CCACHE_DIR:-$ROOT/target/ccache}"
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

# Makes directory $1 a copy of the working tree: the files git sees, tracked or not,
# mtimes kept so that cargo rebuilds only what changed; files gone here go there too.
# Its own target/ stays.
sync_tree() {
  local dest="$1" list
  mkdir -p "$dest"
  list="$(mktemp)"
  (cd "$ROOT" && git ls-files -co --exclude-standard -z) >"$list"
  (cd "$dest" && find . -path ./target -prune -o -type f -printf '%P\0') | sort -z \
    | comm -z -13 <(sort -z "$list") - | (cd "$dest" && xargs -0r rm -f)
  (cd "$ROOT" && tar --null -T "$list" -cf -) | tar -xf - -C "$dest"
  rm -f "$list"
}

# Prints the directory that cargo builds in for $TCH: the repository for 0.24; for 0.26,
# target/tch-0.26/ws, a copy of the working tree (sync_tree) with its Cargo.lock moved
# to tch 0.26.
tch_workspace() {
  if [ "$TCH" = 0.24 ]; then
    echo "$ROOT"
    return
  fi
  local ws="$ROOT/target/tch-$TCH/ws"
  sync_tree "$ws"
  (cd "$ws" && { cargo update --quiet --offline -p tch --precise "$TCH.0" 2>/dev/null \
    || cargo update --quiet -p tch --precise "$TCH.0"; })
  echo "$ws"
}
