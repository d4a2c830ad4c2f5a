//! The value types of settings that several of the SDK's modules share: the backend,
//! the mixed precision and the optimizer implementation, with their spellings. What
//! needs libtorch lives with the SDK's modules (`nccl_available` in the process group,
//! `resolve_mixed_precision` in `amp`, `Algorithm::preferred_implementation` in
//! `optim`): this crate has no libtorch, so that the attribute's macro can read it.

use std::fmt;

use crate::error::{Error, Result};

/// A communication backend, as `torch.distributed`'s `backend` argument.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Backend {
    /// Gloo: collectives on CPU tensors (and on CUDA tensors through host copies).
    Gloo,
    /// NCCL: collectives on CUDA tensors; CPU tensors still go through Gloo.
    Nccl,
}

impl Backend {
    /// Parses `"gloo"` or `"nccl"` (case-insensitive).
    ///
    /// # Errors
    /// [`Error::Config`] for any other name, listing the valid ones.
    pub fn parse(name: &str) -> Result<Backend> {
        match name.to_ascii_lowercase().as_str() {
            "gloo" => Ok(Backend::Gloo),
            "nccl" => Ok(Backend::Nccl),
            other => Err(Error::Config(format!(
                "unknown backend {other:?}: use \"gloo\" or \"nccl\""
            ))),
        }
    }
}

impl fmt::Display for Backend {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Backend::Gloo => "gloo",
            Backend::Nccl => "nccl",
        })
    }
}

/// How DDP compresses gradients for their all-reduce: a communication hook on the
/// Reducer, as PyTorch's `DistributedDataParallel.register_comm_hook`.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum CommHook {
    /// float32 all-reduce, as without a hook (the default).
    #[default]
    None,
    /// Each bucket cast to float16 and divided by the world size, all-reduced, and
    /// cast back: c10d's built-in `FP16_COMPRESS` hook, PyTorch's `fp16_compress_hook`.
    /// Half the bytes; gradients beyond float16's range (65504) overflow.
    Fp16,
    /// The same in bfloat16, as PyTorch's `bf16_compress_hook`: half the bytes,
    /// float32's range, 8 bits of mantissa.
    Bf16,
}

impl fmt::Display for CommHook {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            CommHook::None => "none",
            CommHook::Fp16 => "fp16",
            CommHook::Bf16 => "bf16",
        })
    }
}

/// Which ranks shard the parameters, gradients and optimizer state among themselves
/// at ZeRO stages 2 and 3 (hybrid sharding, FSDP2's 2-D mesh `HYBRID_SHARD`,
/// Accelerate's `dp_shard_size`): each group of consecutive ranks of this size holds
/// one sharded copy of the model, and the groups replicate it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ShardGroup {
    /// The ranks of one node (`LOCAL_WORLD_SIZE`): all-gathers and reduce-scatters stay
    /// within the node; only the gradient shards' all-reduce crosses nodes.
    Node,
    /// Groups of this many consecutive ranks; it must divide the world size.
    Size(usize),
}

impl ShardGroup {
    /// The group's size in a job of `world_size` ranks with `local_world_size` on
    /// each node.
    ///
    /// # Errors
    /// What to give instead when the size does not divide the world size (or, for
    /// `node`, when the nodes hold different numbers of ranks).
    pub fn size(
        self,
        world_size: usize,
        local_world_size: usize,
    ) -> std::result::Result<usize, String> {
        let (size, what) = match self {
            ShardGroup::Node => (
                local_world_size,
                format!("the {local_world_size} ranks of a node"),
            ),
            ShardGroup::Size(n) => (n, format!("{n} ranks")),
        };
        if size == 0 || world_size % size != 0 {
            return Err(format!(
                "shard groups of {what} do not divide the job's {world_size} ranks: give a \
                 size that divides the world size (every node the same number of ranks for \
                 \"node\")"
            ));
        }
        Ok(size)
    }
}

/// Where ZeRO stages 2 and 3 keep what the optimizer steps (DeepSpeed's
/// `offload_optimizer` and `offload_param`, FSDP2's `CPUOffloadPolicy`): the GPU's
/// memory, or the host's. On a run whose parameters are in host memory already (the
/// CPU) there is nothing to offload, and each value trains as `None`.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Offload {
    /// Everything on the device (the default).
    #[default]
    None,
    /// The optimizer state, the gradient shards and the shards the optimizer steps
    /// (fp32) in pinned host memory, stepped by the CPU (DeepSpeed's
    /// `offload_optimizer: {device: cpu, pin_memory: true}`); the device keeps a copy
    /// of the parameter shards for the all-gathers, refreshed after each step.
    Optimizer,
    /// As `Optimizer`, and the device keeps no parameter shard: each all-gather's input
    /// is copied from the host as it starts (FSDP2's `CPUOffloadPolicy`, DeepSpeed's
    /// `offload_param`). Only the units being computed are on the device.
    All,
}

impl fmt::Display for Offload {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Offload::None => "none",
            Offload::Optimizer => "optimizer",
            Offload::All => "all",
        })
    }
}

impl fmt::Display for ShardGroup {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            ShardGroup::Node => f.write_str("node"),
            ShardGroup::Size(n) => write!(f, "{n}"),
        }
    }
}

/// How much the process group checks, as `TORCH_DISTRIBUTED_DEBUG`.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum DebugLevel {
    /// No checks beyond the SDK's own (the default).
    #[default]
    Off,
    /// Every collective compared across the ranks before it runs (its kind, and its
    /// tensors' shapes and dtypes), by c10d's `ProcessGroupWrapper`, as
    /// `TORCH_DISTRIBUTED_DEBUG=DETAIL`: a mismatch is an error naming the ranks and the
    /// tensors, instead of a hang or Gloo's abort. Each collective costs an extra
    /// all-gather and a barrier over Gloo.
    Detail,
}

impl fmt::Display for DebugLevel {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            DebugLevel::Off => "off",
            DebugLevel::Detail => "detail",
        })
    }
}

/// The precision of the forward pass, as Accelerate's `mixed_precision`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum MixedPrecision {
    /// float32 throughout.
    No,
    /// bfloat16 autocast: float32's range, so no loss scaling.
    Bf16,
    /// float16 autocast, with a `GradScaler` (tch-distributed's) against underflowing gradients.
    Fp16,
}

impl MixedPrecision {
    /// What `auto` picks on a CUDA device of compute capability `major`.x: bf16 from 8.0
    /// on (Ampere: A100, RTX 30), whose tensor cores run it at fp16's speed; fp16 before.
    pub fn for_compute_capability(major: i32) -> Self {
        if major >= 8 {
            MixedPrecision::Bf16
        } else {
            MixedPrecision::Fp16
        }
    }
}

/// `no`, `bf16` or `fp16`, as the attribute's `mixed_precision` spells them.
impl fmt::Display for MixedPrecision {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            MixedPrecision::No => "no",
            MixedPrecision::Bf16 => "bf16",
            MixedPrecision::Fp16 => "fp16",
        })
    }
}

/// What a run asks for (the attribute's `mixed_precision`,
/// `TCH_DISTRIBUTED_MIXED_PRECISION`): one precision, or `Auto`, which each rank
/// resolves on its device (tch-distributed's `resolve_mixed_precision`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum MixedPrecisionMode {
    /// This precision on every device.
    Exactly(MixedPrecision),
    /// bf16 or fp16 by the GPU's compute capability; none on the CPU.
    Auto,
}

/// `no`, `bf16`, `fp16` or `auto`, as the attribute spells them.
impl fmt::Display for MixedPrecisionMode {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            MixedPrecisionMode::Exactly(p) => p.fmt(f),
            MixedPrecisionMode::Auto => f.write_str("auto"),
        }
    }
}

impl std::str::FromStr for MixedPrecisionMode {
    type Err = Error;

    /// `"no"`, `"bf16"`, `"fp16"` or `"auto"`.
    ///
    /// # Errors
    /// [`Error::Config`] for any other value.
    fn from_str(value: &str) -> Result<Self> {
        Ok(match value {
            "no" => MixedPrecisionMode::Exactly(MixedPrecision::No),
            "bf16" => MixedPrecisionMode::Exactly(MixedPrecision::Bf16),
            "fp16" => MixedPrecisionMode::Exactly(MixedPrecision::Fp16),
            "auto" => MixedPrecisionMode::Auto,
            other => {
                return Err(Error::Config(format!(
                    "mixed precision {other:?}: use \"no\", \"bf16\", \"fp16\" or \"auto\""
                )))
            }
        })
    }
}

/// Which kernels and arithmetic run the update. Each runs one ATen kernel per
/// operation, or one for the whole update (fused), over all the parameters of a group
/// that share a device and dtype; none is a loop of per-parameter kernels. An optimizer
/// starts with its algorithm's preferred implementation: fused where libtorch has a fused kernel
/// (SGD, Adam, AdamW), else foreach (RMSprop).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Implementation {
    /// ATen's fused kernels (`_fused_sgd_`, `_fused_adam_`, `_fused_adamw_`), as
    /// `torch.optim.{SGD,Adam,AdamW}(fused=True)`, bit for bit: one kernel for the
    /// whole update of a group. RMSprop has none.
    Fused,
    /// `torch.optim`'s `foreach=True` arithmetic (its `_multi_tensor_*` functions), bit
    /// for bit: one `_foreach_*` kernel per operation.
    Foreach,
    /// libtorch's C++ `torch::optim` arithmetic, what tch's `nn::Optimizer` runs, in
    /// `_foreach_*` kernels: a program's results are the plain tch program's to the bit
    /// on the CPU. It differs from `foreach` only where Python takes a running average
    /// with `lerp_` (Adam's and AdamW's first moment, centered RMSprop's gradient
    /// average) and C++ with `mul_` then `add_`: equal in exact arithmetic, rounded
    /// differently in float32.
    Tch,
}

impl std::str::FromStr for Implementation {
    type Err = Error;

    /// `fused`, `foreach` or `tch`.
    ///
    /// # Errors
    /// [`Error::Config`] for any other value.
    fn from_str(value: &str) -> Result<Self> {
        match value {
            "fused" => Ok(Implementation::Fused),
            "foreach" => Ok(Implementation::Foreach),
            "tch" => Ok(Implementation::Tch),
            other => Err(Error::Config(format!(
                "optimizer implementation {other:?}: use \"fused\", \"foreach\" or \"tch\""
            ))),
        }
    }
}

/// `fused`, `foreach` or `tch`.
impl std::fmt::Display for Implementation {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Implementation::Fused => "fused",
            Implementation::Foreach => "foreach",
            Implementation::Tch => "tch",
        })
    }
}
