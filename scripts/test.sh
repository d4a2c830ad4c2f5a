#!/usr/bin/env bash
# The test suite: unit tests, multi-process integration tests (Gloo on CPU, 1-3
# ranks, each run under a timeout), doc tests.
source "$(dirname "${BASH_SOURCE[0]}")/env.sh"
cd "$ROOT"
export OMP_NUM_THREADS=1
# The integration tests run the workspace's binaries (tchrun, the workers).
cargo build --workspace --bins --examples
cargo test --workspace "$@"
scripts/book.sh  # the guide: mdBook (pinned, installed on first use), fails on a broken include or link
