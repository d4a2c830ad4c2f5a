//! The run's settings: the table of the crate `tch-distributed-settings`, which has no
//! libtorch so that the `#[distributed]` attribute's macro reads the same rows at compile
//! time (see that crate for the sources and their order: `tchrun`'s flags, then the
//! `TCH_DISTRIBUTED_*` variables, then the configuration file, then the attribute). A
//! new setting is one row of its `settings!` table plus its use.
//!
//! What needs the SDK lives here: writing the configuration file (atomically, as every
//! file the SDK writes).

use std::path::Path;

pub use tch_distributed_settings::{
    attribute_options, config_named_by_env, default_path, default_path_from, reference_table, row,
    var, Backend, CommHook, DebugLevel, DeepSpeed, Gpus, Implementation, Literal, MixedPrecision,
    MixedPrecisionMode, Offload, OptimizerBlock, Origin, SchedulerBlock, Secret, Setting, Settings,
    ShardGroup, Value, CONFIG_ENV, TABLE,
};

use crate::error::Result;

/// Writes `settings` as the configuration file at `path` (and its directory), replacing
/// it whole: a reader sees the old file or the new one.
///
/// # Errors
/// [`Error::Io`](crate::Error::Io) when the directory or the file cannot be written.
pub fn save(settings: &Settings, path: &Path) -> Result<()> {
    crate::files::replace_with_bytes(path, settings.to_toml().as_bytes())
}
