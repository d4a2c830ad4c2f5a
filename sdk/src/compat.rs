//! The two tch versions this SDK builds with, side by side: tch 0.24 (libtorch 2.11)
//! and tch 0.26 (libtorch 2.13). Cargo picks the one the user's crate depends on (the
//! SDK asks for `>=0.24, <0.27`; `torch-sys` links natively, so a build holds one).
//!
//! Every difference between the two is handled here or, for the C++ shim, in
//! `csrc/internal.hpp`. The Rust API that the SDK uses is the same in both (0.26 adds
//! generated ops and drops `align_as`/`align_tensors`, which the SDK does not call), so
//! what is left here is saying which pair this build is.
//!
//! The build script reads libtorch's version off its headers (cfg `tdc_libtorch`) and
//! refuses any but 2.11 and 2.13. Which tch goes with it is torch-sys's to enforce, and
//! it does before this crate's build script runs: it compares Python's
//! `torch.__version__` (or a libtorch's `build-version` file) with the version it
//! expects, and with that check bypassed its own C++ does not compile against the other
//! version's headers. So the libtorch version also gives tch's.

/// The tch that this build uses: `"0.24"` or `"0.26"`.
#[cfg(tdc_libtorch = "2.11")]
pub const TCH_VERSION: &str = "0.24";
/// The tch that this build uses: `"0.24"` or `"0.26"`.
#[cfg(tdc_libtorch = "2.13")]
pub const TCH_VERSION: &str = "0.26";

/// The libtorch that this build compiled against and links (`"2.11.0"` or `"2.13.0"`),
/// as its headers give it.
pub const LIBTORCH_VERSION: &str = env!("TDC_LIBTORCH_VERSION");

/// Whether the NCCL backend was compiled into this build (libtorch with CUDA, and the
/// CUDA and NCCL headers found by `build.rs`).
pub fn nccl_available() -> bool {
    crate::ffi::process_group::nccl_compiled()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Against cargo's own record of its choice: the lockfile of the workspace this
    /// test was built in.
    #[test]
    fn tch_version_is_the_one_cargo_chose() {
        let lock = std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/../Cargo.lock"))
            .expect("the workspace's Cargo.lock");
        let locked = lock
            .split("[[package]]")
            .find(|p| p.contains("\nname = \"tch\"\n"))
            .and_then(|p| p.lines().find_map(|l| l.strip_prefix("version = \"")))
            .expect("tch in Cargo.lock");
        assert!(
            locked.starts_with(&format!("{TCH_VERSION}.")),
            "{locked} vs {TCH_VERSION}"
        );
    }
}
