//! Fully sharded data parallel: ZeRO stages 2 and 3 with the semantics of PyTorch's
//! FSDP2 (`fully_shard`), for the SDK's [`Optimizer`](crate::Optimizer).
//!
//! - [`layout`]: where each parameter's exact `1/N` shard lies (dim 0, padded);
//! - [`param`]: one sharded parameter (FSDP2's `FSDPParam`): the variable, its place
//!   and its chunk of the shard, and the copies of its rows;
//! - [`param_group`]: one unit's parameters (FSDP2's `FSDPParamGroup`): their shard,
//!   their [`ShardedState`](param_group::ShardedState) (sharded, unsharding,
//!   unsharded), `unshard` (all-gather) and `reshard` (free), `reshard_after_forward`,
//!   `param_dtype`;
//! - [`engine`]: an optimizer's units and their hooks (FSDP2's root `FSDPState`), when
//!   each bucket is complete, and the steps;
//! - [`collectives`]: the gradient buckets, their order and reduce-scatters, the
//!   agreement on which members had a gradient, the bucket cap (FSDP2's
//!   `_fsdp_collectives`);
//! - [`unit`]: [`fully_shard`], the units gathered around their passes;
//! - [`policy`]: what the run asks of the units (mixed precision, bucket cap,
//!   offload), read from its settings;
//! - [`offload`]: CPU offload, where a unit keeps the shard its optimizer steps and
//!   the copies between host and device;
//! - [`hooks`]: the shim's storage and autograd hooks.
//!
//! Hybrid sharding's groups are [`crate::mesh`]'s.

mod collectives;
mod engine;
mod hooks;
pub(crate) mod layout;
pub(crate) mod offload;
mod param;
mod param_group;
pub(crate) mod policy;
mod unit;

pub use engine::ShardingStats;
pub(crate) use engine::{named, Sharding};
pub(crate) use hooks::set_grad;
pub(crate) use layout::Piece;
pub(crate) use policy::Policy;
pub use unit::{fully_shard, summon_full_params, FullyShard};
