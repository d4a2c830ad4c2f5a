#!/usr/bin/env bash
# The test suite: unit tests, multi-process integration tests (Gloo on CPU, 1-3
# ranks, each run under a timeout), doc tests, the book.
#
#   scripts/test.sh [ARGS…]              tch 0.24 with torch 2.11.0, the workspace's Cargo.lock
#   scripts/test.sh --tch 0.26 [ARGS…]   tch 0.26 with torch 2.13.0 (see below)
#   scripts/test.sh --all-tch [ARGS…]    both, one after the other (what CI runs)
#
# ARGS go to `cargo test` (a filter, `-p PACKAGE`, …).
#
# tch 0.26 builds a copy of the working tree in target/tch-0.26/ws whose Cargo.lock is
# moved to tch 0.26, against `.venv-2.13`, so the workspace's own lock and build stay
# on tch 0.24. There it runs every test but the trybuild cases (`ui`, compiler text
# that does not depend on tch) and the book's HTML.
set -euo pipefail
tch=0.24
case "${1:-}" in
  --tch) tch="${2:?--tch needs 0.24 or 0.26}"; shift 2 ;;
  --all-tch)
    shift
    "$0" --tch 0.24 "$@"
    exec "$0" --tch 0.26 "$@"
    ;;
esac
case "$tch" in
  0.24) export TCHD_TORCH_VERSION=2.11.0 ;;
  0.26) export TCHD_TORCH_VERSION=2.13.0 ;;
  *) echo "error: --tch $tch is not supported: use 0.24 or 0.26" >&2; exit 2 ;;
esac
source "$(dirname "${BASH_SOURCE[0]}")/env.sh"
cd "$ROOT"
export OMP_NUM_THREADS=1
start=$SECONDS

if [ "$tch" = 0.24 ]; then
  # The integration tests run the workspace's binaries (tchrun, the workers).
  cargo build --workspace --bins --examples
  cargo test --workspace "$@"
  scripts/book.sh  # the guide: mdBook (pinned, installed on first use), fails on a broken include or link
else
  ws="$ROOT/target/tch-$tch/ws"
  mkdir -p "$ws"
  # The tree as git sees it (tracked and untracked, not ignored), mtimes kept so that
  # cargo rebuilds only what changed; files deleted here are deleted there.
  git ls-files -co --exclude-standard -z >"$ws/../files"
  (cd "$ws" && find . -type f -not -path './target/*' -printf '%P\0') >"$ws/../present"
  sort -z "$ws/../files" >"$ws/../files.sorted"
  sort -z "$ws/../present" | comm -z -13 "$ws/../files.sorted" - | (cd "$ws" && xargs -0r rm -f)
  tar --null -T "$ws/../files" -cf - | tar -xf - -C "$ws"
  cd "$ws"
  cargo update --quiet -p tch --precise 0.26.0
  grep -q '^name = "torch-sys"' Cargo.lock
  cargo build --workspace --bins --examples
  cargo test --workspace "$@"
fi
echo "test.sh: tch $tch, torch $TORCH_VERSION: passed in $((SECONDS - start)) s" >&2
