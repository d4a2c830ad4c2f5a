//! The two tch versions this SDK builds with, side by side: tch 0.24 (libtorch 2.11)
//! and tch 0.26 (libtorch 2.13). Cargo picks the one the user's crate depends on (the
//! SDK asks for `>=0.24, <0.27`; `torch-sys` links natively, so a build holds one).
//!
//! Every difference between the two is handled here or, for the C++ shim, behind
//! `TORCH_VERSION_MINOR` in `csrc/internal.hpp`. The Rust API that the SDK uses is the
//! same in both (0.26 adds generated ops and drops `align_as`/`align_tensors`, which the
//! SDK does not call), so what is left here is knowing which pair this build is and
//! refusing a mismatched pair.
//!
//! The build script reads libtorch's version off its headers (cfg `tdc_libtorch`).
//! Cargo tells a build script nothing about the versions of its dependencies, so the
//! version of tch is read here, off tch's own API, and the two are compared when this
//! crate compiles: a mismatch (possible only with `LIBTORCH_BYPASS_VERSION_CHECK`, or a
//! `LIBTORCH` without a `build-version` file, since torch-sys checks the rest) stops
//! the build with one message that names both versions and the fix.

use tch::{TchError, Tensor};

/// The tch that this build uses: `"0.24"` or `"0.26"`.
pub const TCH_VERSION: &str = match TCH_MINOR {
    24 => "0.24",
    _ => "0.26",
};

/// The libtorch that this build compiled against and links (`"2.11.0"` or `"2.13.0"`),
/// as its headers give it.
pub const LIBTORCH_VERSION: &str = env!("TDC_LIBTORCH_VERSION");

/// tch's minor version: 26 when `Tensor::f_get_device` is one of tch's own (inherent)
/// functions, which it is from 0.26 on; 24 when the path falls through to the
/// stand-in below, whose return type says so.
const TCH_MINOR: u32 = minor_of(Tensor::f_get_device);

/// The stand-in for `Tensor::f_get_device` on tch 0.24. Inherent functions win over
/// trait functions in a path, so on 0.26 this is never chosen.
#[allow(dead_code)]
trait Before026 {
    fn f_get_device(&self) -> Tch024;
}

/// What the stand-in returns: the mark of tch 0.24.
struct Tch024;

impl Before026 for Tensor {
    fn f_get_device(&self) -> Tch024 {
        Tch024
    }
}

trait Minor {
    const MINOR: u32;
}

impl Minor for Tch024 {
    const MINOR: u32 = 24;
}

impl Minor for Result<i64, TchError> {
    const MINOR: u32 = 26;
}

const fn minor_of<R: Minor>(_: fn(&Tensor) -> R) -> u32 {
    R::MINOR
}

#[cfg(tdc_libtorch = "2.11")]
const _: () = assert!(
    TCH_MINOR == 24,
    "tch-distributed: this build found libtorch 2.11, but cargo chose tch 0.26, which needs \
     libtorch 2.13: pip install torch==2.13.0 (or set LIBTORCH to libtorch 2.13), or \
     depend on tch = \"0.24\""
);

#[cfg(tdc_libtorch = "2.13")]
const _: () = assert!(
    TCH_MINOR == 26,
    "tch-distributed: this build found libtorch 2.13, but cargo chose tch 0.24, which needs \
     libtorch 2.11: pip install torch==2.11.0 (or set LIBTORCH to libtorch 2.11), or \
     depend on tch = \"0.26\""
);

#[cfg(test)]
mod tests {
    use super::*;

    /// The probe against cargo's own record of its choice: the lockfile of the
    /// workspace this test was built in.
    #[test]
    fn the_probe_reads_the_tch_that_cargo_chose() {
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
        let pair = match TCH_VERSION {
            "0.24" => "2.11.",
            _ => "2.13.",
        };
        assert!(LIBTORCH_VERSION.starts_with(pair), "{LIBTORCH_VERSION}");
    }
}
