//! CPU offload at ZeRO stages 2 and 3 (the `offload` setting): where a unit keeps the
//! shard its optimizer steps, and the copies between it and the device. Offloaded, the
//! shard the optimizer steps (fp32), its gradient and the optimizer's state live in
//! pinned host memory and the CPU steps them, as DeepSpeed's `offload_optimizer` and
//! FSDP2's `CPUOffloadPolicy`. Every copy is queued on the device's current stream
//! without the host waiting: a gradient shard goes to the host as soon as its bucket
//! is reduce-scattered (during the backward pass), and a parameter shard to the device
//! as its all-gather starts (during the compute of the unit before, with the
//! prefetch). The host waits once per step, before the CPU reads the gradients
//! ([`wait_for_copies`]).

use tch::{Device, Kind, Tensor};

use crate::error::{Error, Result};
use crate::settings::Offload;

/// Where a unit keeps its shard (the `offload` setting, on the run's device).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Placement {
    /// With the parameters, on their device: no offload, or nothing to offload (the
    /// parameters are in host memory already).
    Device,
    /// The stepped shard in host memory and a copy of it on the device for the
    /// all-gathers, refreshed after each step (`offload = "optimizer"`).
    HostAndDevice,
    /// The stepped shard in host memory only: each all-gather copies its input to the
    /// device as it starts (`offload = "all"`).
    Host,
}

impl Placement {
    /// Where `offload` puts the shards of parameters on `device`: on the CPU there is
    /// nothing to offload ([`Placement::Device`]), unless [`COPIES_ON_CPU_ENV`] is set.
    pub fn of(offload: Offload, device: Device) -> Placement {
        let apart = device != Device::Cpu || copies_on_cpu();
        match offload {
            Offload::Optimizer if apart => Placement::HostAndDevice,
            Offload::All if apart => Placement::Host,
            _ => Placement::Device,
        }
    }

    /// Whether the stepped shard is in host memory, apart from the parameters.
    pub fn offloaded(self) -> bool {
        self != Placement::Device
    }
}

/// `TCH_DISTRIBUTED_OFFLOAD_COPIES_ON_CPU=1`, for the SDK's own tests on machines
/// without a GPU: a CPU run with `offload` keeps the shards it steps apart from the
/// parameters, as on a GPU, so that every copy between them runs (host to host) and a
/// missing one shows in the parameters. Not a setting: it only costs memory.
pub(crate) const COPIES_ON_CPU_ENV: &str = "TCH_DISTRIBUTED_OFFLOAD_COPIES_ON_CPU";

fn copies_on_cpu() -> bool {
    std::env::var(COPIES_ON_CPU_ENV).is_ok_and(|v| v == "1")
}

/// A zeroed host tensor of `len` elements of `kind`, for the shards of parameters on
/// `device`: pinned (page-locked) when `device` is a GPU, so that copies to and from it
/// run without the host waiting.
pub(crate) fn host_zeros(len: i64, kind: Kind, device: Device) -> Tensor {
    let t = Tensor::zeros([len], (kind, Device::Cpu));
    match device {
        Device::Cuda(_) => t.pin_memory(device),
        _ => t,
    }
}

/// Copies `src` into `dst` (of the same shape; the devices may differ) without the host
/// waiting, between pinned host memory and a GPU; synchronously otherwise.
///
/// # Errors
/// [`Error::Torch`] when libtorch refuses the copy.
pub(crate) fn copy(dst: &Tensor, src: &Tensor) -> Result<()> {
    crate::ffi::sharding::copy_async(dst, src)
        .map_err(|e| Error::Torch(format!("copying a shard between host and device: {e}")))
}

/// A new copy of `src` on `device` (from pinned memory, without the host waiting).
///
/// # Errors
/// [`Error::Torch`] when libtorch refuses the copy.
pub(crate) fn to_device(src: &Tensor, device: Device) -> Result<Tensor> {
    let dst = Tensor::empty(src.size().as_slice(), (src.kind(), device));
    copy(&dst, src)?;
    Ok(dst)
}

/// Waits for the copies queued on `device` (the gradient shards on their way to the
/// host) before the host reads them: the device synchronized; nothing to wait for on
/// the CPU.
pub(crate) fn wait_for_copies(device: Device) {
    if let Device::Cuda(index) = device {
        tch::Cuda::synchronize(index as i64);
    }
}

/// What the start-up banner says of `offload` on `device` (none for `none`).
pub(crate) fn banner(offload: Offload, device: Device) -> Option<String> {
    let memory = match device {
        Device::Cuda(_) => "pinned host memory",
        _ => "host memory",
    };
    Some(match Placement::of(offload, device) {
        _ if offload == Offload::None => return None,
        Placement::Device => format!(
            "offload = {offload}: nothing to offload on the CPU (the parameters are in host \
             memory already)"
        ),
        Placement::HostAndDevice => format!(
            "optimizer offloaded (its state, the gradient shards and the fp32 shards it steps \
             in {memory}, stepped by the CPU)"
        ),
        Placement::Host => format!(
            "everything offloaded (the parameter shards, gradient shards and optimizer state \
             in {memory}, stepped by the CPU; each unit copied to the device for its \
             all-gather)"
        ),
    })
}
