//! Fully sharded data parallel: ZeRO stages 2 and 3 with the semantics of PyTorch's
//! FSDP2 (`fully_shard`), for the SDK's [`Optimizer`](crate::Optimizer).
//!
//! - [`layout`]: where each parameter's exact `1/N` shard lies (dim 0, padded);
//! - [`param_group`]: one unit's parameters (FSDP2's `FSDPParamGroup`): their shard,
//!   their [`ShardedState`](param_group::ShardedState) (sharded, unsharding,
//!   unsharded), `unshard` (all-gather) and `reshard` (free), `reshard_after_forward`,
//!   `param_dtype`;
//! - [`engine`]: an optimizer's units, its gradient buckets and their
//!   reduce-scatters, and the steps;
//! - [`unit`]: [`fully_shard`], the units gathered around their passes;
//! - [`hooks`]: the shim's storage and autograd hooks.

mod engine;
mod hooks;
pub(crate) mod layout;
mod param_group;
mod unit;

pub use engine::ShardingStats;
pub(crate) use engine::{bucket_bytes, named, Sharding};
pub(crate) use hooks::set_grad;
pub(crate) use layout::Piece;
pub use unit::{fully_shard, summon_full_params, FullyShard};
