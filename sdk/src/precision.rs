//! Which precision a device runs a run's forward pass in: the `mixed_precision`
//! setting resolved on the device (bf16 or fp16 by a GPU's compute capability for
//! `auto`), the autocast dtype of each precision, and the CPUs whose oneDNN kernels
//! cannot run a lower precision. Autocast itself and the loss scaler are in `amp`.

use tch::{Device, Kind};

use crate::error::{Error, Result};
use crate::ffi;
pub use crate::settings::{MixedPrecision, MixedPrecisionMode};

/// The precision that `mode` asks for on `device`, and why, for the banner: `Exactly`
/// gives its precision; `Auto` picks bf16 on CUDA devices of compute capability 8.0 or
/// more (A100, H100, RTX 30 and 40 series), fp16 on older ones, and on the CPU no mixed
/// precision (bf16 autocast on the CPU only when asked for: it is slower on most CPUs),
/// as Accelerate's `mixed_precision` resolves. Parse a setting's text with
/// `"bf16".parse::<MixedPrecisionMode>()` first.
///
/// ```no_run
/// # fn demo() -> tch_distributed::Result<()> {
/// use tch_distributed::{resolve_mixed_precision, MixedPrecisionMode};
/// let (precision, why) = resolve_mixed_precision(MixedPrecisionMode::Auto, tch::Device::Cuda(0))?;
/// println!("mixed precision {precision} ({why})");
/// # Ok(()) }
/// ```
///
/// # Errors
/// [`Error::Torch`] when `Auto` cannot read the CUDA device's properties.
pub fn resolve_mixed_precision(
    mode: MixedPrecisionMode,
    device: Device,
) -> Result<(MixedPrecision, String)> {
    let p = match mode {
        MixedPrecisionMode::Exactly(p) => p,
        MixedPrecisionMode::Auto => {
            let Device::Cuda(index) = device else {
                return Ok((MixedPrecision::No, "auto: CPU".into()));
            };
            let (major, minor) = ffi::amp::cuda_capability(index as i32).map_err(Error::Torch)?;
            return Ok((
                MixedPrecision::for_compute_capability(major),
                format!("auto: compute capability {major}.{minor}"),
            ));
        }
    };
    match onednn_off_because(p) {
        Some(why) if !device.is_cuda() => Ok((p, format!("asked for; oneDNN off: {why}"))),
        _ => Ok((p, "asked for".into())),
    }
}

/// The autocast dtype of `precision`, if any.
pub(crate) fn autocast_kind(precision: MixedPrecision) -> Option<Kind> {
    match precision {
        MixedPrecision::No => None,
        MixedPrecision::Bf16 => Some(Kind::BFloat16),
        MixedPrecision::Fp16 => Some(Kind::Half),
    }
}

/// Why oneDNN is turned off for `precision` on this CPU, if it is. oneDNN's LSTM (which
/// libtorch's CPU autocast casts to the lower precision, `mkldnn_rnn_layer`) needs
/// AVX-512 for bf16, and cannot train in fp16 on any CPU this was measured on: it fails
/// with "could not create a primitive descriptor for the LSTM forward propagation
/// primitive", in PyTorch too (measured: bf16 without AVX-512; fp16 on an AMD EPYC with
/// AVX-512, and on an Intel Xeon with AVX512-FP16 and AMX-BF16, where oneDNN's own log
/// says "f16 training not supported"). Then [`Autocast::enter`] turns oneDNN off for
/// the process on its first CPU entry (as `torch.backends.mkldnn.enabled = False`): the
/// LSTM runs libtorch's own kernels in float32, and the matmuls and convolutions
/// autocast as usual.
///
/// [`Autocast::enter`]: crate::Autocast::enter
pub(crate) fn onednn_off_because(precision: MixedPrecision) -> Option<&'static str> {
    match precision {
        MixedPrecision::No => None,
        MixedPrecision::Fp16 => Some("its LSTM does not train in fp16 on a CPU"),
        MixedPrecision::Bf16 => {
            #[cfg(target_arch = "x86_64")]
            let avx512 = std::arch::is_x86_feature_detected!("avx512bw");
            #[cfg(not(target_arch = "x86_64"))]
            let avx512 = true;
            (!avx512).then_some("this CPU has no AVX-512")
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The banner's reason says why oneDNN is off, on the CPU only and for a lower
    /// precision only: always for fp16, for bf16 without AVX-512.
    #[test]
    fn the_reason_says_when_onednn_is_off() {
        let why = |p, device| {
            resolve_mixed_precision(MixedPrecisionMode::Exactly(p), device)
                .unwrap()
                .1
        };
        for p in [MixedPrecision::Bf16, MixedPrecision::Fp16] {
            let expected = match onednn_off_because(p) {
                Some(why) => format!("asked for; oneDNN off: {why}"),
                None => "asked for".into(),
            };
            assert_eq!(why(p, Device::Cpu), expected, "{p:?}");
            assert_eq!(why(p, Device::Cuda(0)), "asked for", "{p:?}");
        }
        assert_eq!(why(MixedPrecision::No, Device::Cpu), "asked for");
    }

    #[test]
    fn auto_picks_bf16_from_ampere_on_and_each_mode_names_its_dtype() {
        for (major, choice) in [
            (6, MixedPrecision::Fp16),
            (7, MixedPrecision::Fp16),
            (8, MixedPrecision::Bf16),
            (9, MixedPrecision::Bf16),
        ] {
            assert_eq!(
                MixedPrecision::for_compute_capability(major),
                choice,
                "{major}"
            );
        }
        for (mode, kind) in [
            (MixedPrecision::No, None),
            (MixedPrecision::Bf16, Some(Kind::BFloat16)),
            (MixedPrecision::Fp16, Some(Kind::Half)),
        ] {
            assert_eq!(autocast_kind(mode), kind);
            // Displayed as the attribute spells it, so it parses back.
            let shown = mode.to_string();
            assert_eq!(
                shown.parse::<MixedPrecisionMode>().unwrap(),
                MixedPrecisionMode::Exactly(mode),
                "{shown}"
            );
        }
    }

    #[test]
    fn each_mode_displays_as_the_attribute_spells_it() {
        // The note that an environment variable overrides the attribute's value
        // quotes the attribute's value with this.
        for spelled in ["no", "bf16", "fp16", "auto"] {
            let mode: MixedPrecisionMode = spelled.parse().unwrap();
            assert_eq!(mode.to_string(), spelled);
        }
    }

    #[test]
    fn auto_and_parsing() {
        assert_eq!(
            resolve_mixed_precision(MixedPrecisionMode::Auto, Device::Cpu)
                .unwrap()
                .0,
            MixedPrecision::No
        );
        let bf16: MixedPrecisionMode = "bf16".parse().unwrap();
        assert_eq!(
            resolve_mixed_precision(bf16, Device::Cpu).unwrap().0,
            MixedPrecision::Bf16
        );
        let e = "fp8".parse::<MixedPrecisionMode>().unwrap_err().to_string();
        assert!(e.contains("\"auto\""), "{e}");
    }
}
