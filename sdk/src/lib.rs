//! Data-parallel training for [`tch`] over libtorch's own distributed engine, c10d
//! (`TCPStore`, `ProcessGroupGloo`, `ProcessGroupNCCL` and `c10d::Reducer`, the C++
//! core of PyTorch's `DistributedDataParallel`).
//!
//! ```no_run
//! # fn main() -> tch_distributed::Result<()> {
//! let ctx = tch_distributed::init()?; // reads RANK, WORLD_SIZE, MASTER_ADDR, … (or runs alone)
//! if ctx.is_main_process() {
//!     println!("{}", ctx.banner());
//! }
//! # Ok(()) }
//! ```
//!
//! Start several ranks with `tchrun --nproc-per-node N PROGRAM` or
//! `torchrun --nproc-per-node N --no-python PROGRAM`.

// Every call into C goes through the safe layer in `ffi/`, the only module with
// `unsafe` code; each `unsafe` block there names the invariant it relies on.
#![deny(unsafe_op_in_unsafe_fn)]
#![warn(clippy::undocumented_unsafe_blocks)]

#[doc(hidden)]
#[path = "runtime/mod.rs"]
pub mod __private;
mod amp;
mod checkpoint;
mod compat;
mod data;
mod ddp;
mod devices;
mod env;
mod error;
mod ffi;
mod files;
mod host_memory;
mod init;
pub mod launch;
mod log;
mod loop_position;
mod mesh;
mod observe;
mod optim;
mod precision;
mod process_group;
mod protocol;
mod random_state;
mod rank_helpers;
mod recompute;
pub mod record;
mod rendezvous;
mod rng;
mod schedule;
mod self_test;
pub mod settings;
mod shard;
mod unit_registry;

pub use amp::{autocast, Autocast, GradScaler};
pub use checkpoint::{
    load_var_store, preempted_exit_code, save_trainable, save_var_store, AccumulationCycle,
    Checkpointer, Preemption, TrainState,
};
pub use compat::{nccl_available, LIBTORCH_VERSION, TCH_VERSION};
pub use data::{
    find_executable_batch_size, global_batch_size, per_rank_batch_size, shard,
    split_between_processes, split_between_processes_padded, Batch, Batches, DataLoader, Dataset,
    DistributedSampler, Gatherable, LoaderPosition, LrScaling, Sharded, Splittable, TensorDataset,
    TextDataset,
};
pub use ddp::{CommHook, DdpOptions, DdpStats, DistributedDataParallel, NoSync};
pub use env::LaunchEnv;
pub use error::{Error, Result};
pub use init::{current, init, init_with, Context, InitOptions, DEFAULT_TIMEOUT};
pub use loop_position::LoopPosition;
pub use observe::{Tracker, PROGRESS_ENV};
pub use optim::{Algorithm, Implementation, Optimizer, OptimizerKind};
pub use precision::{resolve_mixed_precision, MixedPrecision, MixedPrecisionMode};
pub use process_group::{Backend, ProcessGroup, ReduceOp};
pub use rank_helpers::{any_rank, local_main_process_first, main_process_first};
pub use recompute::{
    checkpoint, checkpoint_many, checkpointed, checkpointed_t, f_checkpoint_many, BlockMany,
    BlockOne, Checkpointed, CheckpointedT,
};
pub use rendezvous::{GlooAddress, Store};
pub use rng::AgreedSeed;
pub use schedule::{LrSchedule, LrScheduler, ScheduledOptimizer, WarmupType};
#[doc(hidden)]
pub use self_test::rank_check;
pub use shard::{fully_shard, summon_full_params, FullyShard, ShardingStats};

#[doc(inline)]
#[doc = include_str!("distributed.md")]
pub use tch_distributed_macros::distributed;

/// The README's Rust code, compiled as a doc test so that it stays true.
#[cfg(doctest)]
#[doc = include_str!("../../README.md")]
pub struct ReadmeDoctests;

/// The error variants a caller matches on, each from the SDK's own calls: at the
/// crate's root, which may use every module (in `error.rs` it would make `error`
/// depend on the modules that depend on it).
#[cfg(test)]
mod error_variants {
    /// Each kind of failure comes as its own variant, from the SDK's own calls, with
    /// the text it always had.
    #[test]
    fn callers_can_match_on_what_went_wrong() {
        use crate::{Checkpointer, Error, GradScaler, Implementation, Optimizer, TensorDataset};
        use tch::{nn, Device, Kind, Tensor};

        // Data the program hands over.
        let xs = Tensor::zeros([3, 2], (Kind::Float, Device::Cpu));
        let ys = Tensor::zeros([2], (Kind::Int64, Device::Cpu));
        match TensorDataset::new(&xs, &ys) {
            Err(Error::InvalidInput(m)) => assert!(m.starts_with("TensorDataset: inputs"), "{m}"),
            other => panic!("{:?}", other.err()),
        }

        // A call that cannot work.
        let mut vs = nn::VarStore::new(Device::Cpu);
        let w = vs.root().zeros("w", &[2]);
        let rms = Optimizer::new(&nn::RmsProp::default(), &vs, 0.1).unwrap();
        match rms.with_implementation(Implementation::Fused) {
            Err(Error::Usage(m)) => assert!(m.starts_with("RMSprop has no fused kernel"), "{m}"),
            other => panic!("{:?}", other.err()),
        }

        // A checkpoint that cannot be used: step 8 has no COMPLETE marker.
        let dir = tempfile::tempdir().unwrap();
        std::fs::create_dir_all(dir.path().join("step-0000000008")).unwrap();
        let ckpt = Checkpointer::new(dir.path());
        let mut sgd = Optimizer::new(&nn::Sgd::default(), &vs, 0.1).unwrap();
        match ckpt.load_state(&mut vs, &mut sgd) {
            Err(e @ Error::Checkpoint { .. }) => {
                let Error::Checkpoint { path, .. } = &e else {
                    unreachable!()
                };
                assert_eq!(path.as_deref(), Some(dir.path()));
                let m = e.to_string();
                assert!(m.starts_with("no usable checkpoint in "), "{m}");
                assert!(m.contains("(incomplete (no COMPLETE marker))"), "{m}");
            }
            other => panic!("{:?}", other.err()),
        }
        // An optimizer state that is not one: no path, the reason as its source.
        match sgd.load_state(b"not a safetensors file") {
            Err(Error::Checkpoint {
                path: None,
                message,
                source: Some(_),
            }) => assert!(message.starts_with("optimizer state: "), "{message}"),
            other => panic!("{:?}", other.err()),
        }

        // fp16 gradients that keep overflowing.
        (&w * f64::INFINITY).sum(Kind::Float).backward();
        let mut scaler = GradScaler::new().max_consecutive_skips(1);
        scaler.unscale_gradients(&[w.shallow_clone()]).unwrap();
        let e = scaler.update().unwrap_err();
        assert!(
            matches!(e, Error::Diverged { skipped: 1, scale } if scale == 32768.0),
            "{e:?}"
        );
        assert!(
            e.to_string().starts_with(
                "fp16: 1 steps in a row had inf or NaN gradients and were skipped (the scale is now 32768): "
            ),
            "{e}"
        );
    }
}

/// The thread-safety the public types had when each carried an `unsafe impl` of its
/// own; they get it now from the handles of `ffi/` (whose `unsafe impl`s say why):
/// checked at compile time. (The sharded optimizer's state needs `Send + Sync` where it
/// is shared with autograd's threads, which the compiler checks there.)
#[cfg(test)]
mod thread_safety {
    fn send<T: Send>() {}
    fn send_sync<T: Send + Sync>() {}

    #[test]
    fn the_types_keep_their_send_and_sync() {
        send_sync::<crate::Store>();
        send_sync::<crate::ProcessGroup>();
        send::<crate::DistributedDataParallel>();
        send::<crate::Optimizer>();
    }
}
