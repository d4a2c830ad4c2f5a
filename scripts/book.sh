#!/usr/bin/env bash
# The guide: installs the pinned mdBook into .tools/ (first run only, about a minute of
# compiling on 2 cores; later runs reuse it), builds book/ into book/book/, and fails
# on a broken include or link (scripts/check_book.py says which).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
MDBOOK_VERSION=0.5.4
MDBOOK="$ROOT/.tools/bin/mdbook"

if [ "$("$MDBOOK" --version 2>/dev/null)" != "mdbook v$MDBOOK_VERSION" ]; then
  echo "book: installing mdbook $MDBOOK_VERSION into $ROOT/.tools (first run only)" >&2
  # Without the default features (serve, watch, search): only `mdbook build`.
  # Unoptimized (--debug): it builds this one book in seconds all the same, and CI,
  # which starts with no .tools/, compiles it in less than half the time.
  cargo install mdbook --version "$MDBOOK_VERSION" --locked --no-default-features \
    --debug --root "$ROOT/.tools"
fi

LOG="$(mktemp)"
trap 'rm -f "$LOG"' EXIT
if ! "$MDBOOK" build "$ROOT/book" >"$LOG" 2>&1; then
  cat "$LOG" >&2
  echo "book: mdbook build failed" >&2
  exit 1
fi
python3 "$ROOT/scripts/check_book.py" "$ROOT/book" "$LOG"
echo "book: built $ROOT/book/book/index.html; includes and links checked"
