//! Which device each rank computes on, and the check that NCCL ranks have a GPU each.

use tch::Device;

use crate::error::{Error, Result};
use crate::process_group::Backend;
use crate::rendezvous::store::Store;

/// How many GPUs this process sees (0 without CUDA). libtorch's CUDA half,
/// `libtorch_cuda.so`, registers CUDA when it is loaded, but a program links it only if
/// it calls into it (the linker's `--as-needed`): a tch program that only asks
/// `Cuda::is_available()` would see no GPU on a GPU machine. So it is loaded here first,
/// found as the program finds libtorch (its rpath, or `LD_LIBRARY_PATH`); with a
/// CPU-only libtorch there is none to load, and no GPU.
pub(crate) fn visible_gpus() -> usize {
    crate::ffi::os::load_libtorch_cuda();
    if tch::Cuda::is_available() {
        tch::Cuda::device_count() as usize
    } else {
        0
    }
}

/// The device of local rank `local_rank` on a node where each rank sees `gpus` GPUs:
/// the CPU without GPUs, else `cuda:local_rank`, wrapping round when there are more
/// ranks than GPUs (`cuda:local_rank % gpus`), so that ranks share the GPUs over Gloo
/// (NCCL refuses two ranks on one GPU: see [`check_own_gpus`]). A rank that sees one
/// GPU (`srun --gpus-per-task=1`, `CUDA_VISIBLE_DEVICES` set per rank) uses it.
pub(crate) fn local_device(local_rank: usize, gpus: usize) -> Device {
    match gpus {
        0 => Device::Cpu,
        n => Device::Cuda(local_rank % n),
    }
}

/// A device as PyTorch writes it: `cpu`, `cuda:0`.
pub(crate) fn device_name(device: Device) -> String {
    match device {
        Device::Cuda(i) => format!("cuda:{i}"),
        other => format!("{other:?}").to_lowercase(),
    }
}

/// The devices of the `local_world_size` ranks of a node, as the banner lists them.
pub(crate) fn node_devices(local_world_size: usize, device: Device, gpus: usize) -> String {
    match device {
        Device::Cuda(_) => (0..local_world_size)
            .map(|r| device_name(local_device(r, gpus)))
            .collect::<Vec<_>>()
            .join(" "),
        other => device_name(other),
    }
}

/// The physical GPU behind `cuda:index` of this process: the host and the entry of
/// `CUDA_VISIBLE_DEVICES` it maps to (the index itself when that is unset), so ranks
/// that see different GPUs under the same index (per-rank `CUDA_VISIBLE_DEVICES`) are
/// told apart.
pub(crate) fn gpu_identity(host: &str, visible: Option<&str>, index: usize) -> String {
    let physical = visible
        .and_then(|v| v.split(',').map(str::trim).nth(index).map(str::to_string))
        .unwrap_or_else(|| index.to_string());
    format!("{host}/gpu {physical}")
}

/// The first two local ranks that share a GPU, given each local rank's GPU identity.
pub(crate) fn first_shared(identities: &[String]) -> Option<(usize, usize)> {
    identities.iter().enumerate().find_map(|(i, id)| {
        identities[..i]
            .iter()
            .position(|other| other == id)
            .map(|j| (j, i))
    })
}

/// The error for NCCL ranks that share a GPU.
pub(crate) fn shared_gpu_error(
    local_world_size: usize,
    gpus: usize,
    (a, b): (usize, usize),
    identity: &str,
) -> Error {
    Error::Config(format!(
        "{local_world_size} ranks on this node but {gpus} GPU(s) visible to each: local ranks {a} and {b} \
         would both use {identity}, and NCCL needs a GPU of its own for every rank. Start at most {gpus} \
         rank(s) per node (--nproc-per-node {gpus}), make more GPUs visible (CUDA_VISIBLE_DEVICES), or \
         let the ranks share the GPUs over Gloo (TCH_DISTRIBUTED_BACKEND=gloo)"
    ))
}

fn hostname() -> String {
    crate::ffi::os::hostname().unwrap_or_else(|| "?".into())
}

/// Before any NCCL call: every rank publishes the GPU it uses, and a rank whose node
/// runs more ranks than it sees GPUs checks its node's ranks (the contiguous block of
/// ranks its local rank belongs to, as torchrun, tchrun and SLURM's block distribution
/// number them) for two on one GPU, which NCCL would refuse with "Duplicate GPU
/// detected". Gloo ranks may share.
///
/// # Errors
/// [`Error::Config`] naming the ranks, the GPU and the fixes.
pub(crate) fn check_own_gpus(
    store: &Store,
    backend: Backend,
    (rank, local_rank, local_world_size, world_size): (usize, usize, usize, usize),
    device: Device,
    gpus: usize,
) -> Result<()> {
    let Device::Cuda(index) = device else {
        return Ok(());
    };
    if backend != Backend::Nccl || world_size == 1 {
        return Ok(());
    }
    let visible = crate::protocol::cuda_visible_devices();
    let mine = gpu_identity(&hostname(), visible.as_deref(), index);
    store.set(&format!("tch_distributed/gpu/{rank}"), mine.as_bytes())?;
    if local_world_size <= gpus {
        return Ok(());
    }
    let first = rank.saturating_sub(local_rank);
    let identities = (first..(first + local_world_size).min(world_size))
        .map(|r| {
            store
                .get(&format!("tch_distributed/gpu/{r}"))
                .map(|b| String::from_utf8_lossy(&b).into_owned())
        })
        .collect::<Result<Vec<_>>>()?;
    match first_shared(&identities) {
        Some(pair) => Err(shared_gpu_error(
            local_world_size,
            gpus,
            pair,
            &identities[pair.1],
        )),
        None => Ok(()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ranks_take_a_gpu_each_and_share_round_robin_when_there_are_more() {
        assert_eq!(local_device(3, 0), Device::Cpu);
        assert_eq!(local_device(1, 4), Device::Cuda(1));
        assert_eq!(
            local_device(1, 1),
            Device::Cuda(0),
            "one visible GPU: that one"
        );
        assert_eq!(local_device(5, 2), Device::Cuda(1));
        assert_eq!(node_devices(3, Device::Cuda(0), 1), "cuda:0 cuda:0 cuda:0");
        assert_eq!(node_devices(2, Device::Cuda(0), 8), "cuda:0 cuda:1");
        assert_eq!(node_devices(2, Device::Cpu, 0), "cpu");
    }

    #[test]
    fn per_rank_visible_devices_tell_gpus_apart() {
        let a = gpu_identity("n1", Some("2"), 0);
        let b = gpu_identity("n1", Some("3"), 0);
        assert_ne!(a, b, "srun --gpus-per-task=1: each rank its own GPU");
        assert_eq!(gpu_identity("n1", None, 0), gpu_identity("n1", None, 0));
        assert_eq!(gpu_identity("n1", Some("4,5"), 1), "n1/gpu 5");
        let same = vec![gpu_identity("n1", None, 0), gpu_identity("n1", None, 0)];
        assert_eq!(first_shared(&same), Some((0, 1)));
        assert_eq!(first_shared(&[a, b]), None);
    }

    #[test]
    fn the_shared_gpu_error_names_the_counts_and_the_fixes() {
        let e = shared_gpu_error(2, 1, (0, 1), "host/gpu 0").to_string();
        for part in [
            "2 ranks on this node but 1 GPU(s)",
            "local ranks 0 and 1 would both use host/gpu 0",
            "--nproc-per-node 1",
            "CUDA_VISIBLE_DEVICES",
            "TCH_DISTRIBUTED_BACKEND=gloo",
        ] {
            assert!(e.contains(part), "{part:?} not in {e}");
        }
    }
}
