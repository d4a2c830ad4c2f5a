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
mod init;
pub mod launch;
mod log;
mod loop_position;
mod observe;
mod optim;
mod process_group;
mod protocol;
mod random_state;
mod rank_helpers;
pub mod record;
mod rendezvous;
mod rng;
pub mod settings;

pub use amp::{autocast, Autocast, GradScaler, MixedPrecision, MixedPrecisionMode};
pub use checkpoint::{
    load_var_store, preempted_exit_code, save_var_store, Checkpointer, Preemption, TrainState,
};
pub use compat::{LIBTORCH_VERSION, TCH_VERSION};
pub use data::{
    global_batch_size, per_rank_batch_size, shard, Batch, Batches, DataLoader, Dataset,
    DistributedSampler, LoaderPosition, LrScaling, Sharded, TensorDataset, TextDataset,
};
pub use ddp::{DdpOptions, DdpStats, DistributedDataParallel, NoSync};
pub use env::LaunchEnv;
pub use error::{Error, Result};
pub use init::{current, init, init_with, Context, InitOptions, DEFAULT_TIMEOUT};
pub use loop_position::LoopPosition;
pub use observe::{Tracker, PROGRESS_ENV};
pub use optim::{Algorithm, Implementation, Optimizer, OptimizerKind};
pub use process_group::{Backend, ProcessGroup, ReduceOp};
pub use rank_helpers::{local_main_process_first, main_process_first};
pub use rendezvous::{GlooAddress, Store};
pub use rng::AgreedSeed;

#[doc(inline)]
#[doc = include_str!("distributed.md")]
pub use tch_distributed_macros::distributed;

/// The README's Rust code, compiled as a doc test so that it stays true.
#[cfg(doctest)]
#[doc = include_str!("../../README.md")]
pub struct ReadmeDoctests;
