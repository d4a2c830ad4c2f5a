#!/usr/bin/env bash
# The test suite: unit tests, multi-process integration tests (Gloo on CPU, 1-3
# ranks, each run under a timeout), doc tests, the module graph's check for cycles, the book.
#
#   scripts/test.sh [ARGS…]              tch 0.24 with torch 2.11.0, the workspace's Cargo.lock
#   scripts/test.sh --tch 0.26 [ARGS…]   tch 0.26 with torch 2.13.0 (see below): without
#                                        ARGS, everything builds and what goes through
#                                        libtorch runs
#   scripts/test.sh --all-tch [ARGS…]    both, one after the other (what CI runs)
#
# ARGS go to `cargo test` (a filter, `-p PACKAGE`, …).
#
# It ends by listing what the tests skipped ("skipped: nothing" when nothing), e.g. a
# comparison with PyTorch when no Python with torch is found (TCHD_PYTHON, else the
# virtualenv, see tests/src/lib.rs); with CI=true a test fails instead of skipping.
#
# tch 0.26 builds a copy of the working tree in target/tch-0.26/ws whose Cargo.lock is
# moved to tch 0.26, against `.venv-2.13` (see env.sh), so the workspace's own lock and
# build stay on tch 0.24. There it builds every test and runs those that go through
# libtorch (the list below); the book's HTML, which does not depend on tch, is built
# once, with tch 0.24.
set -euo pipefail
case "${1:-}" in
  --tch) export TCHD_TCH="${2:?--tch needs 0.24 or 0.26}"; shift 2 ;;
  --all-tch)
    shift
    "$0" --tch 0.24 "$@"
    # CI builds from a clean clone and never reuses the first leg's build or torch: the
    # disk holds one build and one torch (~5 GB each) at a time, not ~17 GB at the
    # second leg's peak (the compiler cache stays). `.ci/run` builds the GPU packages,
    # which need `.venv`, before this.
    if [ "${CI:-}" = true ]; then
      find "$(dirname "$0")/../target" -mindepth 1 -maxdepth 1 ! -name ccache -exec rm -rf {} +
      rm -rf "$(dirname "$0")/../.venv"
    fi
    exec "$0" --tch 0.26 "$@"
    ;;
esac
source "$(dirname "${BASH_SOURCE[0]}")/env.sh"
export OMP_NUM_THREADS=1
start=$SECONDS
cd "$(tch_workspace)"
# A test that cannot run part of itself here (no PyTorch, torchrun or mpirun: see
# `skip` in tests/src/lib.rs) appends a line to this file; the list is printed at the
# end, passed or failed. Under CI=true such a test fails instead.
TCHD_SKIP_LOG="$(mktemp -t tchd-skipped-XXXXXX)"
export TCHD_SKIP_LOG
report_skips() {
  if [ -s "$TCHD_SKIP_LOG" ]; then
    echo "test.sh: tch $TCH: skipped:" >&2
    sed 's/^/  /' "$TCHD_SKIP_LOG" >&2
  else
    echo "test.sh: tch $TCH: skipped: nothing" >&2
  fi
  rm -f "$TCHD_SKIP_LOG"
}
trap report_skips EXIT
# The integration tests run the workspace's binaries (tchrun, the workers).
cargo build --workspace --bins --examples
# `--test NAME` for every integration test of the workspace that builds with its
# default features (not the CUDA suites'), from cargo's own list. With `--lib`, what
# `cargo test` runs here: not the test harnesses of the ~90 binaries and examples
# (workers, listings, the corpus's programs, the benchmarks), which have no test and
# would each be compiled and linked again against libtorch only to run nothing. A test
# belongs in a library or tests/.
mapfile -t TESTS < <(cargo metadata --no-deps --format-version 1 | python3 -c '
import json, sys
for package in json.load(sys.stdin)["packages"]:
    for target in package["targets"]:
        if "test" in target["kind"] and not target.get("required-features"):
            print("--test=" + target["name"])
' | sort -u)
if [ "$TCH" = 0.26 ] && [ $# -eq 0 ]; then
  # What differs between the two libtorch versions, as CI runs it (--all-tch): all of
  # it builds (every test, example and listing, against tch 0.26's API), and the tests
  # that go through libtorch run: the unit tests (the shim: store, job token, autocast,
  # kernels), the collectives, DDP's Reducer and its error text, the optimizers'
  # kernels, mixed precision, checkpoints' formats, the sealed store, c10d's collective
  # checks (ProcessGroupWrapper), comparisons with
  # PyTorch 2.13, a user's own crate on tch 0.26 and the main job. The rest (the macro's
  # rules, launching, settings, sharded loops) is the same code on either version, and
  # runs on tch 0.24. Any ARGS run the given tests instead.
  cargo test --workspace --lib "${TESTS[@]}" --no-run
  cargo test --workspace --lib
  # Not the checkpoint and main-job tests that deliver signals or restart a killed rank
  # (the launcher's work, the same on either version; resuming bit for bit still runs).
  cargo test -p tch-distributed-tests \
    --test collectives --test ddp --test parity --test optimizer_parity \
    --test optimizer_state --test amp --test grad_scaler --test checkpoint \
    --test error_hints --test security --test zero --test own_crate --test shakespeare \
    --test collective_checks -- \
    --skip ctrl_c_in_a_terminal --skip a_signal_to_every_process --skip sigterm_checkpoints \
    --skip under_max_restarts
  cargo test -p tch-distributed-corpus --test char_rnn
elif [ $# -eq 0 ]; then
  cargo test --workspace --lib "${TESTS[@]}"
  cargo test --workspace --doc
else
  cargo test --workspace "$@"
fi
if [ "$TCH" = 0.24 ]; then
  python3 scripts/modules.py --check  # no import cycle among sdk/src's modules (it names each)
  # Every C call goes through sdk/src/ffi/, the one module with `unsafe` code, and each
  # of its `unsafe` blocks and impls says why it is sound; every public function that
  # returns an error or panics says when, in `# Errors` and `# Panics` sections (only
  # these lints as errors).
  cargo clippy -p tch-distributed -p tch-distributed-settings --lib -- \
    -D clippy::undocumented_unsafe_blocks -D unsafe_op_in_unsafe_fn \
    -D clippy::missing_errors_doc -D clippy::missing_panics_doc
  outside_ffi="$(grep -rnE '^\s*[^/]*\bunsafe\b' sdk/src --include=*.rs | grep -v '^sdk/src/ffi/' || true)"
  if [ -n "$outside_ffi" ]; then
    echo "error: \`unsafe\` outside sdk/src/ffi/ (move the call behind a safe wrapper there):" >&2
    echo "$outside_ffi" >&2
    exit 1
  fi
  scripts/book.sh  # the guide: mdBook (pinned, installed on first use), fails on a broken include or link
fi
echo "test.sh: tch $TCH, torch $TORCH_VERSION: passed in $((SECONDS - start)) s" >&2
