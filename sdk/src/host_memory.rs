//! What glibc's allocator does with the host memory that tensors free: the process's
//! one policy, set at two moments.
//!
//! - **Kept for the next step** ([`keep_freed_memory`], when the run's context is
//!   built). glibc gives the top of its heap back to the system once more than the
//!   trim threshold is free there, and maps blocks above the mmap threshold on their
//!   own; it raises both thresholds as the process frees large blocks (up to 32 and
//!   64 MiB), so whether a training step's tensors come from memory kept since the
//!   last step or from fresh pages depends on what the process freed before. On one
//!   rank of the bench's transformer, a step grew the heap by about 30 MiB and gave it
//!   back: 896 page faults a step, where the same step in Python, whose imports had
//!   raised the thresholds, took none. The SDK fixes the thresholds where glibc's
//!   heuristic ends (mmap 32 MiB, trim 64 MiB), so every run keeps a step's memory for
//!   the next.
//! - **Given back** ([`return_freed_memory`], when ZeRO stages 2 and 3 shard CPU
//!   parameters): a 64 KiB mmap threshold and glibc's default trim threshold, so that
//!   what sharding frees leaves the resident set, which is what it is for.
//!
//! A user who tunes glibc's allocator (`MALLOC_MMAP_THRESHOLD_`,
//! `MALLOC_TRIM_THRESHOLD_`, `MALLOC_TOP_PAD_`, or `GLIBC_TUNABLES` with a
//! `glibc.malloc` key) keeps their setting: the SDK then changes nothing.

use crate::ffi::os;

/// glibc's largest dynamic mmap threshold on 64-bit (`DEFAULT_MMAP_THRESHOLD_MAX`).
const KEPT_MMAP_THRESHOLD: i32 = 32 << 20;
/// Twice that, as glibc sets the trim threshold when it raises the mmap threshold.
const KEPT_TRIM_THRESHOLD: i32 = 64 << 20;
/// Blocks from 64 KiB up are mapped on their own and unmapped when freed.
const RETURNED_MMAP_THRESHOLD: i32 = 64 << 10;
/// glibc's default trim threshold (`DEFAULT_TRIM_THRESHOLD`, 128 KiB).
const RETURNED_TRIM_THRESHOLD: i32 = 128 << 10;

/// Keeps the memory a step frees for the next step (see the module's documentation),
/// unless the user tuned the allocator.
pub(crate) fn keep_freed_memory() {
    if !crate::protocol::malloc_tuned() {
        os::set_malloc_thresholds(KEPT_MMAP_THRESHOLD, KEPT_TRIM_THRESHOLD);
    }
}

/// Gives freed memory back to the system (see the module's documentation), unless
/// the user tuned the allocator.
pub(crate) fn return_freed_memory() {
    if !crate::protocol::malloc_tuned() {
        os::set_malloc_thresholds(RETURNED_MMAP_THRESHOLD, RETURNED_TRIM_THRESHOLD);
    }
}
