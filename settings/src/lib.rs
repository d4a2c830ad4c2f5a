//! The run's settings: one table, [`TABLE`], and the typed values it reads, [`Settings`].
//!
//! Each row names a setting once: the option of `#[distributed(…)]`, the `tchrun` flag,
//! the `TCH_DISTRIBUTED_*` variable, the configuration-file key, the value's type and
//! parser, the default and the doc line. `tchrun`'s flags (the `clap::Args` of [`Settings`]),
//! the configuration file ([`Settings::load`], [`Settings::to_toml`]), the environment
//! ([`Settings::from_env`]), the variables `tchrun` hands its ranks
//! ([`Settings::rank_env`]) and the reference chapter's table ([`reference_table`]) are
//! all read off it; the attribute's compile-time options are tested against it. A new
//! setting is one row of the `settings!` table below plus its use.
//!
//! Where several places give a setting, the first wins:
//!
//! 1. `tchrun`'s flag (`--grad-accum 4`);
//! 2. the environment variable (`TCH_DISTRIBUTED_GRAD_ACCUM=4`);
//! 3. the configuration file (`grad_accum = 4`);
//! 4. the option of `#[distributed(…)]` (`grad_accum = 4`);
//! 5. the default.
//!
//! `tchrun` merges the first three and hands the result to every rank as the variables
//! ([`Settings::rank_env`]); the `#[distributed]` entry puts the environment over the
//! attribute's options. A program run under `torchrun`, `srun` or `mpirun`, or one that
//! starts its own ranks, reads the same variables, not the file. Every setting takes
//! effect the same way wherever it is given.

use std::fmt;
use std::path::Path;

mod accelerate;
mod ask;
mod deepspeed;
mod error;
mod file;
mod foreign;
mod values;

pub use accelerate::Accelerate;
pub use deepspeed::{DeepSpeed, LossScaling, OptimizerBlock, SchedulerBlock, SCHEDULERS};
pub use error::{Error, Result};

pub use values::{
    Backend, CommHook, DebugLevel, Implementation, MixedPrecision, MixedPrecisionMode, Offload,
    ShardGroup,
};

pub use file::{config_named_by_env, default_path, default_path_from, CONFIG_ENV};

/// How a setting's value is written in Rust source (the attribute's options): the
/// kind of literal its row takes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Literal {
    /// A string: `backend = "nccl"`.
    String,
    /// An integer or a float: `grad_accum = 4`, `timeout = 600`.
    Number,
    /// `true` or `false`: `static_graph = true`.
    Bool,
}

/// A setting's type: how a flag's, a variable's or the file's text becomes the value,
/// and how the value is written back (for the ranks' variables and the file).
pub trait Value: Sized + Clone + fmt::Display {
    /// Parses `text` (trimmed).
    ///
    /// # Errors
    /// What is allowed, when `text` is not a value of this type: `use gloo or nccl`.
    fn parse(text: &str) -> std::result::Result<Self, String>;

    /// How the attribute writes it: a string literal, unless a number or a bool.
    const LITERAL: Literal = Literal::String;

    /// How the configuration file writes it: a TOML string, unless a number or a bool.
    fn to_toml(&self) -> toml::Value {
        toml::Value::String(self.to_string())
    }
}

macro_rules! integer_value {
    ($($t:ty),*) => {$(
        impl Value for $t {
            fn parse(text: &str) -> std::result::Result<Self, String> {
                text.parse().map_err(|_| match <$t>::MAX as u64 {
                    u64::MAX => "a whole number is needed".to_string(),
                    max => format!("a whole number from 0 to {max} is needed"),
                })
            }
            const LITERAL: Literal = Literal::Number;
            fn to_toml(&self) -> toml::Value {
                toml::Value::Integer(*self as i64)
            }
        }
    )*};
}
integer_value!(usize, u16, u8);

impl Value for f64 {
    fn parse(text: &str) -> std::result::Result<Self, String> {
        text.parse()
            .ok()
            .filter(|v: &f64| v.is_finite())
            .ok_or_else(|| "a number is needed".to_string())
    }
    const LITERAL: Literal = Literal::Number;
    fn to_toml(&self) -> toml::Value {
        toml::Value::Float(*self)
    }
}

impl Value for bool {
    /// `true`/`false`, `1`/`0`, `on`/`off`, `yes`/`no`, in any case.
    fn parse(text: &str) -> std::result::Result<Self, String> {
        match text.to_ascii_lowercase().as_str() {
            "true" | "1" | "on" | "yes" => Ok(true),
            "false" | "0" | "off" | "no" => Ok(false),
            _ => Err("use true or false".into()),
        }
    }
    const LITERAL: Literal = Literal::Bool;
    fn to_toml(&self) -> toml::Value {
        toml::Value::Boolean(*self)
    }
}

impl Value for String {
    fn parse(text: &str) -> std::result::Result<Self, String> {
        Ok(text.to_string())
    }
}

impl Value for Backend {
    fn parse(text: &str) -> std::result::Result<Self, String> {
        Backend::parse(text).map_err(|_| "use gloo or nccl".into())
    }
}

impl Value for MixedPrecisionMode {
    fn parse(text: &str) -> std::result::Result<Self, String> {
        text.to_ascii_lowercase().parse().map_err(|_| {
            "use no, bf16, fp16 or auto (bf16 on GPUs of compute capability 8.0 or more, \
                 fp16 below, none on the CPU)"
                .into()
        })
    }
}

impl Value for CommHook {
    fn parse(text: &str) -> std::result::Result<Self, String> {
        match text.to_ascii_lowercase().as_str() {
            "none" => Ok(CommHook::None),
            "fp16" => Ok(CommHook::Fp16),
            "bf16" => Ok(CommHook::Bf16),
            _ => Err(
                "use none, fp16 or bf16 (gradients all-reduced in half precision, as \
                      PyTorch's fp16_compress_hook and bf16_compress_hook)"
                    .into(),
            ),
        }
    }
}

impl Value for ShardGroup {
    fn parse(text: &str) -> std::result::Result<Self, String> {
        match text.to_ascii_lowercase().as_str() {
            "node" => Ok(ShardGroup::Node),
            n => match n.parse() {
                Ok(size) if size > 0 => Ok(ShardGroup::Size(size)),
                _ => Err(
                    "use node (the ranks of one node) or a number of ranks that \
                          divides the world size"
                        .into(),
                ),
            },
        }
    }
}

impl Value for Offload {
    fn parse(text: &str) -> std::result::Result<Self, String> {
        match text.to_ascii_lowercase().as_str() {
            "none" => Ok(Offload::None),
            "optimizer" => Ok(Offload::Optimizer),
            "all" => Ok(Offload::All),
            _ => Err(
                "use none, optimizer (the optimizer's state and step in host memory, as \
                 DeepSpeed's offload_optimizer) or all (the parameter shards too, as FSDP2's \
                 CPUOffloadPolicy)"
                    .into(),
            ),
        }
    }
}

impl Value for DebugLevel {
    fn parse(text: &str) -> std::result::Result<Self, String> {
        match text.to_ascii_lowercase().as_str() {
            "off" => Ok(DebugLevel::Off),
            "detail" => Ok(DebugLevel::Detail),
            _ => Err("use off or detail".into()),
        }
    }
}

impl Value for Implementation {
    fn parse(text: &str) -> std::result::Result<Self, String> {
        text.to_ascii_lowercase().parse().map_err(|_| {
            "use fused (ATen's fused kernels, as torch.optim's fused=True), foreach \
                 (torch.optim's foreach=True) or tch (tch's own arithmetic, bit for bit)"
                .into()
        })
    }
}

/// The GPUs the ranks may use, as `CUDA_VISIBLE_DEVICES` takes them: comma-separated
/// ids (`0,1`, or `GPU-…`/`MIG-…` UUIDs), or `all`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Gpus(String);

impl Gpus {
    /// The ids to make visible; `None` for `all`.
    pub fn ids(&self) -> Option<Vec<String>> {
        gpu_ids(&self.0).ok().flatten()
    }
}

impl fmt::Display for Gpus {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl Value for Gpus {
    fn parse(text: &str) -> std::result::Result<Self, String> {
        gpu_ids(text).map(|_| Gpus(text.to_string()))
    }
}

/// A value that must not be printed (the job token): `Debug` shows `…`; `Display`
/// gives the value, for the variable that hands it to the ranks.
#[derive(Clone, PartialEq, Eq)]
pub struct Secret(String);

impl Secret {
    /// The value.
    pub fn expose(&self) -> &str {
        &self.0
    }
}

impl fmt::Debug for Secret {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("Secret(…)")
    }
}

impl fmt::Display for Secret {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl Value for Secret {
    fn parse(text: &str) -> std::result::Result<Self, String> {
        Ok(Secret(text.to_string()))
    }
}

/// The ids of a `gpus` setting: `Ok(None)` for `all`; an error saying what is wrong.
fn gpu_ids(gpus: &str) -> std::result::Result<Option<Vec<String>>, String> {
    let gpus = gpus.trim();
    if gpus.eq_ignore_ascii_case("all") {
        return Ok(None);
    }
    let ids: Vec<String> = gpus.split(',').map(|s| s.trim().to_string()).collect();
    for id in &ids {
        let numeric = !id.is_empty() && id.chars().all(|c| c.is_ascii_digit());
        let uuid =
            (id.starts_with("GPU-") || id.starts_with("MIG-")) && !id.contains(char::is_whitespace);
        if !numeric && !uuid {
            return Err(format!(
                "{id:?} is not a GPU id: give comma-separated ids such as 0,1 (or GPU-/MIG- UUIDs), or all"
            ));
        }
    }
    for (i, id) in ids.iter().enumerate() {
        if ids[..i].contains(id) {
            return Err(format!("GPU {id} is named twice"));
        }
    }
    Ok(Some(ids))
}

// The checks a row adds to its type's parser.
type Check<T> = fn(&T) -> std::result::Result<(), String>;
fn any<T>(_: &T) -> std::result::Result<(), String> {
    Ok(())
}
fn at_least_one(n: &usize) -> std::result::Result<(), String> {
    (*n >= 1)
        .then_some(())
        .ok_or_else(|| "at least 1 is needed".into())
}
fn positive(x: &f64) -> std::result::Result<(), String> {
    (*x > 0.0)
        .then_some(())
        .ok_or_else(|| "a positive number is needed".into())
}
fn not_blank(s: &String) -> std::result::Result<(), String> {
    (!s.trim().is_empty())
        .then_some(())
        .ok_or_else(|| "give a host name or an address".into())
}
fn zero_stage(stage: &u8) -> std::result::Result<(), String> {
    (*stage <= 3).then_some(()).ok_or_else(|| {
        "use 1 (optimizer state sharded, as PyTorch's ZeroRedundancyOptimizer), 2 (and \
         gradients), 3 (and parameters, as FSDP2's fully_shard) or 0 (off)"
            .into()
    })
}

/// One row of the table: where a setting can be given, and what it is.
pub struct Setting {
    /// The configuration-file key, and the attribute's option when [`attribute`](Self::attribute).
    pub key: &'static str,
    /// Whether `#[distributed(…)]` takes it as an option named [`key`](Self::key).
    pub attribute: bool,
    /// `tchrun`'s flag, without the dashes (`grad-accum`), if it has one.
    pub flag: Option<&'static str>,
    /// Another spelling of the flag that `tchrun` accepts (Accelerate's or torchrun's).
    pub alias: Option<&'static str>,
    /// The environment variable.
    pub var: &'static str,
    /// Whether the configuration file takes it.
    pub file: bool,
    /// The value's placeholder in `--help` (`K`).
    pub value_name: &'static str,
    /// What values it takes.
    pub values: &'static str,
    /// The default, in words.
    pub default: &'static str,
    /// What it does.
    pub doc: &'static str,
    /// The literal the attribute writes its value as.
    pub literal: Literal,
    set: fn(&mut Settings, &str) -> std::result::Result<(), String>,
    text: fn(&Settings) -> Option<String>,
    toml: fn(&Settings) -> Option<toml::Value>,
}

impl Setting {
    /// This row's value in `settings`, as text (what its variable would hold).
    pub fn text(&self, settings: &Settings) -> Option<String> {
        (self.text)(settings)
    }

    /// Parses `text` into this row's field of `settings` with the row's type's parser
    /// and the row's check.
    ///
    /// # Errors
    /// What is allowed (the row's message, `at least 1 is needed`), when the parser or
    /// the check refuses `text`; `settings` is left as it was.
    pub fn set(&self, settings: &mut Settings, text: &str) -> std::result::Result<(), String> {
        (self.set)(settings, text.trim())
    }
}

/// Declares the settings: the [`Settings`] struct, one `Option` field per row, and
/// [`TABLE`], the rows.
macro_rules! settings {
    ($(
        $(#[doc = $doc:literal])+
        $key:ident: $ty:ty [$check:path] {
            attribute: $attribute:literal,
            flag: $flag:expr,
            alias: $alias:expr,
            var: $var:literal,
            file: $file:literal,
            value_name: $value_name:literal,
            values: $values:literal,
            default: $default:literal $(,)?
        }
    )*) => {
        /// The run's settings, each `None` until some source gives it (see the
        /// module's documentation for the sources and their order).
        #[derive(Clone, Debug, Default, PartialEq)]
        pub struct Settings {
            $($(#[doc = $doc])+ pub $key: Option<$ty>,)*
        }

        /// Every setting, in the order of `tchrun --help` and the reference chapter.
        pub const TABLE: &[Setting] = &[$(Setting {
            key: stringify!($key),
            attribute: $attribute,
            flag: $flag,
            alias: $alias,
            var: $var,
            file: $file,
            value_name: $value_name,
            values: $values,
            default: $default,
            doc: concat!($($doc),+),
            literal: <$ty as Value>::LITERAL,
            set: |s, text| {
                let value = <$ty as Value>::parse(text)?;
                let check: Check<$ty> = $check;
                check(&value)?;
                s.$key = Some(value);
                Ok(())
            },
            text: |s| s.$key.as_ref().map(ToString::to_string),
            toml: |s| s.$key.as_ref().map(Value::to_toml),
        }),*];

        impl Settings {
            /// Each setting from `self`, else from `lower`: `flags.or(env).or(file)`.
            pub fn or(self, lower: Settings) -> Settings {
                Settings { $($key: self.$key.or(lower.$key),)* }
            }
        }
    };
}

settings! {
    /// Ranks to start on this node.
    nproc_per_node: usize [at_least_one] {
        attribute: true, flag: Some("nproc-per-node"), alias: Some("nproc_per_node"),
        var: "TCH_DISTRIBUTED_NPROC", file: true, value_name: "N",
        values: "1 or more", default: "one per --gpus id, else one per visible GPU, else 1",
    }
    /// Nodes in the job.
    nnodes: usize [at_least_one] {
        attribute: false, flag: Some("nnodes"), alias: None,
        var: "TCH_DISTRIBUTED_NNODES", file: true, value_name: "M",
        values: "1 or more", default: "1",
    }
    /// This node's index in 0..nnodes.
    node_rank: usize [any] {
        attribute: false, flag: Some("node-rank"), alias: Some("node_rank"),
        var: "TCH_DISTRIBUTED_NODE_RANK", file: true, value_name: "R",
        values: "0 to nnodes - 1", default: "0",
    }
    /// Address of node 0, where its launcher hosts the rendezvous store.
    master_addr: String [not_blank] {
        attribute: false, flag: Some("master-addr"), alias: Some("master_addr"),
        var: "TCH_DISTRIBUTED_MASTER_ADDR", file: true, value_name: "ADDR",
        values: "a host name or an address", default: "127.0.0.1",
    }
    /// Port of node 0's rendezvous store; 0 picks a free port (single node only).
    master_port: u16 [any] {
        attribute: false, flag: Some("master-port"), alias: Some("master_port"),
        var: "TCH_DISTRIBUTED_MASTER_PORT", file: true, value_name: "PORT",
        values: "0 to 65535", default: "0",
    }
    /// The process group's backend.
    backend: Backend [any] {
        attribute: true, flag: Some("backend"), alias: None,
        var: "TCH_DISTRIBUTED_BACKEND", file: true, value_name: "BACKEND",
        values: "gloo or nccl", default: "NCCL on GPUs, else Gloo",
    }
    /// The GPUs the ranks use, by id, as accelerate launch --gpu_ids: the ranks' CUDA_VISIBLE_DEVICES; all leaves it as it is.
    gpus: Gpus [any] {
        attribute: false, flag: Some("gpus"), alias: Some("gpu_ids"),
        var: "TCH_DISTRIBUTED_GPUS", file: true, value_name: "IDS",
        values: "comma-separated ids (0,1, or GPU-/MIG- UUIDs), or all", default: "all",
    }
    /// Seconds that the rendezvous and every collective may take.
    timeout: f64 [positive] {
        attribute: true, flag: Some("timeout"), alias: None,
        var: "TCH_DISTRIBUTED_TIMEOUT", file: true, value_name: "SECONDS",
        values: "a positive number of seconds", default: "1800, as torch.distributed",
    }
    /// Seconds a collective waits before the rank reads the other ranks' records in the store: one that entered another collective under the same number (the ranks called collectives in different orders) stops the job then, not at the timeout.
    deadlock_check: f64 [positive] {
        attribute: true, flag: Some("deadlock-check"), alias: None,
        var: "TCH_DISTRIBUTED_DEADLOCK_CHECK", file: true, value_name: "SECONDS",
        values: "a positive number of seconds", default: "5",
    }
    /// Checks of every collective across the ranks before it runs (kind, shapes, dtypes), as TORCH_DISTRIBUTED_DEBUG=DETAIL: a mismatch is an error naming the ranks and tensors instead of a hang; each collective costs an extra all-gather and barrier.
    debug: DebugLevel [any] {
        attribute: false, flag: Some("debug"), alias: None,
        var: "TCH_DISTRIBUTED_DEBUG", file: true, value_name: "LEVEL",
        values: "off or detail", default: "off",
    }
    /// Mixed precision of the forward pass (autocast), with loss scaling for fp16.
    mixed_precision: MixedPrecisionMode [any] {
        attribute: true, flag: Some("mixed-precision"), alias: Some("mixed_precision"),
        var: "TCH_DISTRIBUTED_MIXED_PRECISION", file: true, value_name: "MODE",
        values: "no, bf16, fp16 or auto (bf16 on GPUs of compute capability 8.0 or more, fp16 below, no on the CPU)",
        default: "no",
    }
    /// Micro-batches per optimizer step (gradient accumulation).
    grad_accum: usize [at_least_one] {
        attribute: true, flag: Some("grad-accum"), alias: Some("gradient_accumulation_steps"),
        var: "TCH_DISTRIBUTED_GRAD_ACCUM", file: true, value_name: "K",
        values: "1 or more", default: "1",
    }
    /// At each step of the optimizers a `#[distributed]` function builds, the gradients' global L2 norm clipped to this (after unscaling, on the averaged gradients), as DeepSpeed's gradient_clipping and the HF Trainer's max_grad_norm.
    gradient_clipping: f64 [positive] {
        attribute: true, flag: Some("gradient-clipping"), alias: Some("max_grad_norm"),
        var: "TCH_DISTRIBUTED_GRADIENT_CLIPPING", file: true, value_name: "NORM",
        values: "a positive number", default: "none (the program clips, if it does)",
    }
    /// The kernels of the optimizers a `#[distributed]` function builds.
    optimizer: Implementation [any] {
        attribute: true, flag: Some("optimizer"), alias: None,
        var: "TCH_DISTRIBUTED_OPTIMIZER", file: true, value_name: "IMPL",
        values: "fused, foreach or tch", default: "as the optimizer's own default",
    }
    /// ZeRO stage: 1 shards the optimizers' state over the ranks, 2 their gradients too,
    /// 3 the parameters too (FSDP2's `fully_shard`).
    zero: u8 [zero_stage] {
        attribute: true, flag: Some("zero"), alias: None,
        var: "TCH_DISTRIBUTED_ZERO", file: true, value_name: "STAGE",
        values: "0 (off), 1, 2 or 3", default: "0",
    }
    /// Size cap of DDP's gradient buckets, in MiB (it also caps the first bucket), as PyTorch's; at ZeRO stages 2 and 3, that of the reduce-scatter buckets too unless reduce_bucket_mb is given.
    bucket_cap_mb: f64 [positive] {
        attribute: true, flag: Some("bucket-cap-mb"), alias: None,
        var: "TCH_DISTRIBUTED_BUCKET_CAP_MB", file: true, value_name: "MIB",
        values: "a positive number of MiB", default: "25 (first bucket 1), as PyTorch's DDP",
    }
    /// Size cap of the buckets at ZeRO stages 2 and 3, in MiB: the gradients of the variables no `fully_shard` unit holds are reduce-scattered in buckets of at most this size, and an all-gather's buffer holds at most this much, as DeepSpeed's reduce_bucket_size (which counts elements).
    reduce_bucket_mb: f64 [positive] {
        attribute: true, flag: Some("reduce-bucket-mb"), alias: None,
        var: "TCH_DISTRIBUTED_REDUCE_BUCKET_MB", file: true, value_name: "MIB",
        values: "a positive number of MiB", default: "bucket_cap_mb's (25)",
    }
    /// At ZeRO stages 2 and 3, the ranks that shard the model among themselves: node (the ranks of one node) or a size; the groups replicate it, and only the gradient shards' all-reduce crosses groups (hybrid sharding, FSDP2's HYBRID_SHARD, Accelerate's dp_shard_size).
    shard_group: ShardGroup [any] {
        attribute: true, flag: Some("shard-group"), alias: None,
        var: "TCH_DISTRIBUTED_SHARD_GROUP", file: true, value_name: "GROUP",
        values: "node, or a number of ranks that divides the world size", default: "every rank (flat sharding)",
    }
    /// At ZeRO stages 2 and 3, what lives in host memory rather than on the GPU: optimizer (the optimizer state, the gradient shards and the fp32 shards it steps, stepped by the CPU, as DeepSpeed's offload_optimizer) or all (the parameter shards too, each copied to the GPU for its all-gather, as FSDP2's CPUOffloadPolicy); pinned memory, copies overlapping the compute. Nothing to offload on the CPU.
    offload: Offload [any] {
        attribute: true, flag: Some("offload"), alias: None,
        var: "TCH_DISTRIBUTED_OFFLOAD", file: true, value_name: "WHAT",
        values: "none, optimizer or all", default: "none",
    }
    /// A DeepSpeed JSON configuration (ds_config.json, as the HF Trainer's --deepspeed): its zero_optimization, fp16/bf16, gradient_accumulation_steps and gradient_clipping give the settings of the same meaning, its optimizer and scheduler apply to the optimizers .build makes, its batch sizes are checked; "auto" takes the run's value. Every rank reads it.
    deepspeed: String [any] {
        attribute: true, flag: Some("deepspeed"), alias: None,
        var: "TCH_DISTRIBUTED_DEEPSPEED", file: true, value_name: "FILE",
        values: "the path of a DeepSpeed JSON file", default: "none",
    }
    /// Whether DDP looks for variables that the loss leaves out, each step.
    find_unused_parameters: bool [any] {
        attribute: true, flag: Some("find-unused-parameters"), alias: None,
        var: "TCH_DISTRIBUTED_FIND_UNUSED_PARAMETERS", file: true, value_name: "BOOL",
        values: "true or false", default: "false",
    }
    /// DDP's gradient compression: each bucket all-reduced in fp16 or bf16 (half the bytes), as PyTorch's fp16_compress_hook and bf16_compress_hook.
    comm_hook: CommHook [any] {
        attribute: true, flag: Some("comm-hook"), alias: None,
        var: "TCH_DISTRIBUTED_COMM_HOOK", file: true, value_name: "HOOK",
        values: "none, fp16 or bf16", default: "none",
    }
    /// The Reducer's static-graph mode, as DDP's static_graph=True: the variables that get gradients are the same every step.
    static_graph: bool [any] {
        attribute: true, flag: Some("static-graph"), alias: None,
        var: "TCH_DISTRIBUTED_STATIC_GRAPH", file: true, value_name: "BOOL",
        values: "true or false", default: "false",
    }
    /// Restarts of every rank after one fails, as torchrun's --max-restarts: each attempt gets a fresh rendezvous, and a program that loads its newest checkpoint at start resumes from it; give every node the same value.
    max_restarts: usize [any] {
        attribute: false, flag: Some("max-restarts"), alias: Some("max_restarts"),
        var: "TCH_DISTRIBUTED_MAX_RESTARTS", file: true, value_name: "K",
        values: "0 or more", default: "0",
    }
    /// Whether rank 0 draws a progress bar per epoch on a terminal.
    progress: bool [any] {
        attribute: false, flag: Some("progress"), alias: None,
        var: "TCH_DISTRIBUTED_PROGRESS", file: true, value_name: "BOOL",
        values: "true or false", default: "true",
    }
    /// Whether tchrun, or a program that starts its own ranks, shows every rank's standard output, each line after `[rank N]` (as torchrun's --tee 1 prefixes each line); standard error is every rank's either way.
    all_ranks_stdout: bool [any] {
        attribute: false, flag: Some("all-ranks-stdout"), alias: None,
        var: "TCH_DISTRIBUTED_ALL_RANKS_STDOUT", file: true, value_name: "BOOL",
        values: "true or false", default: "false: rank 0's only, as torchrun's --local-ranks-filter 0",
    }
    /// Whether tchrun, or a program that starts its own ranks, puts `[rank N]` before each line of every rank's standard error (as torchrun's --tee prefixes each line); each line arrives whole either way.
    rank_prefix: bool [any] {
        attribute: false, flag: Some("rank-prefix"), alias: None,
        var: "TCH_DISTRIBUTED_RANK_PREFIX", file: true, value_name: "BOOL",
        values: "true or false", default: "false",
    }
    /// The job's secret: the rendezvous store's keys go under a prefix derived from it and its values are sealed with it; tchrun makes a fresh one per job.
    job_token: Secret [any] {
        attribute: false, flag: None, alias: None,
        var: "TCH_DISTRIBUTED_JOB_TOKEN", file: false, value_name: "TOKEN",
        values: "any text, the same on every node", default: "tchrun's own; none under torchrun, srun or mpirun",
    }
    /// A directory where each rank records its batches and models, for tests that compare runs.
    record: String [any] {
        attribute: false, flag: None, alias: None,
        var: "TCH_DISTRIBUTED_RECORD", file: false, value_name: "DIR",
        values: "a directory", default: "none (nothing recorded)",
    }
}

/// Where a setting came from, to name it in an error.
#[derive(Clone, Debug)]
pub enum Origin {
    /// `tchrun`'s command line (`--grad-accum`).
    Flags,
    /// An environment variable (`TCH_DISTRIBUTED_GRAD_ACCUM`).
    Env,
    /// A configuration file, and the setting's line in it (`grad_accum in FILE,
    /// line 2`).
    File(std::path::PathBuf, usize),
    /// An option of `#[distributed(…)]` (`grad_accum = 0`).
    Attribute,
}

impl Origin {
    /// The setting `row` with `value`, as it is written here: `--gpus 0,x`,
    /// `TCH_DISTRIBUTED_GPUS="0,x"`, `gpus = "0,x" in FILE`.
    fn setting(&self, row: &Setting, value: &str) -> String {
        match self {
            Origin::Flags => format!("--{} {value}", row.flag.unwrap_or(row.key)),
            Origin::Env => format!("{}={value:?}", row.var),
            Origin::File(path, line) => {
                format!("{} = {value:?} in {}, line {line}", row.key, path.display())
            }
            Origin::Attribute if row.literal == Literal::String => {
                format!("{} = {value:?}", row.key)
            }
            Origin::Attribute => format!("{} = {value}", row.key),
        }
    }

    /// The error for `value` of `row`, which is not allowed: why.
    fn bad(&self, row: &Setting, value: &str, why: &str) -> Error {
        Error::Setting {
            given: self.setting(row, value),
            allowed: why.to_string(),
        }
    }
}

/// The value of the variable of the row whose key is `key`, when set and not empty
/// (for the settings read before, or apart from, the function's entry).
pub fn var(key: &str) -> Option<String> {
    let row = row(key)?;
    std::env::var(row.var)
        .ok()
        .map(|v| v.trim().to_string())
        .filter(|v| !v.is_empty())
}

/// The row whose key is `key`.
pub fn row(key: &str) -> Option<&'static Setting> {
    TABLE.iter().find(|r| r.key == key)
}

/// The options that `#[distributed(…)]` takes: the keys of the rows whose
/// [`attribute`](Setting::attribute) is true, in the table's order.
pub fn attribute_options() -> impl Iterator<Item = &'static str> {
    TABLE.iter().filter(|r| r.attribute).map(|r| r.key)
}

impl Settings {
    /// The settings given by environment variables, read through `var` (see
    /// [`TABLE`]). A variable set to the empty string counts as unset.
    ///
    /// # Errors
    /// [`Error::Setting`] naming the variable, its value and what is allowed.
    pub fn from_vars(var: impl Fn(&str) -> Option<String>) -> Result<Settings> {
        let mut settings = Settings::default();
        for row in TABLE {
            if let Some(text) = var(row.var).filter(|v| !v.trim().is_empty()) {
                row.set(&mut settings, &text)
                    .map_err(|why| Origin::Env.bad(row, &text, &why))?;
            }
        }
        Ok(settings)
    }

    /// The options written in `#[distributed(…)]`, each `(key, value)` with the value as
    /// text: a string literal's contents, a number's or a bool's digits or word. Each
    /// goes through its row's parser and check, as a flag, a variable or the file's key
    /// does: the attribute's macro calls this at compile time (an error is the compile
    /// error, at the option) and the function's entry again at run time, on values that
    /// passed then.
    ///
    /// # Errors
    /// [`Error::Config`] for a key that is not an option of the attribute (naming the
    /// valid ones); [`Error::Setting`] naming the option and what it takes, for a value
    /// its row does not allow.
    pub fn from_attribute<'a>(
        options: impl IntoIterator<Item = (&'a str, &'a str)>,
    ) -> Result<Settings> {
        let mut settings = Settings::default();
        for (key, text) in options {
            let Some(row) = row(key).filter(|r| r.attribute) else {
                let valid: Vec<&str> = attribute_options().chain(["crate"]).collect();
                return Err(Error::Config(format!(
                    "unknown option `{key}`; valid options: {}",
                    valid.join(", ")
                )));
            };
            row.set(&mut settings, text)
                .map_err(|why| Origin::Attribute.bad(row, text, &why))?;
        }
        Ok(settings)
    }

    /// The settings given by this process's environment; see [`Settings::from_vars`].
    ///
    /// # Errors
    /// As [`Settings::from_vars`].
    pub fn from_env() -> Result<Settings> {
        Settings::from_vars(|name| std::env::var(name).ok())
    }

    /// The environment's settings over `attribute`'s (the options written in
    /// `#[distributed(…)]`), and one line for each value written in the attribute
    /// that the environment replaced, for rank 0 to print.
    ///
    /// # Errors
    /// As [`Settings::from_env`].
    pub fn over_attribute(attribute: Settings) -> Result<(Settings, Vec<String>)> {
        let env = Settings::from_env()?;
        let notes = TABLE
            .iter()
            .filter_map(|row| {
                let (given, written) = (row.text(&env)?, row.text(&attribute)?);
                (given != written).then(|| {
                    format!(
                        "{}={given} overrides the attribute's {} (set by tchrun's flag or \
                         configuration file, or in the environment)",
                        row.var,
                        Origin::Attribute.setting(row, &written)
                    )
                })
            })
            .collect();
        Ok((env.or(attribute), notes))
    }

    /// These settings with those of the DeepSpeed file that `deepspeed` names, if any
    /// (see [`DeepSpeed::over`]), and the file, read.
    ///
    /// # Errors
    /// As [`DeepSpeed::load`] and [`DeepSpeed::over`].
    pub fn with_deepspeed(self) -> Result<(Settings, Option<DeepSpeed>)> {
        let Some(path) = self.deepspeed.clone() else {
            return Ok((self, None));
        };
        let ds = DeepSpeed::load(Path::new(&path))?;
        Ok((ds.over(self)?, Some(ds)))
    }

    /// The settings given here that differ from those the process joined its job with
    /// (`joined`), as `(key, given, joined)`; `"unset"` where `joined` has none. A
    /// process runs one job with one set of settings, as Accelerate's
    /// `AcceleratorState`: a later `#[distributed]` function may leave a setting out (it
    /// then runs with the job's), not ask for another value.
    pub fn conflicts(&self, joined: &Settings) -> Vec<(&'static str, String, String)> {
        TABLE
            .iter()
            .filter_map(|row| {
                let given = row.text(self)?;
                let was = row.text(joined).unwrap_or_else(|| "unset".to_string());
                (given != was).then_some((row.key, given, was))
            })
            .collect()
    }

    /// Whether no setting is given.
    pub fn is_empty(&self) -> bool {
        *self == Settings::default()
    }

    /// The variables every rank gets from these settings: each setting given, as its
    /// variable, and `CUDA_VISIBLE_DEVICES` for `gpus`.
    pub fn rank_env(&self) -> Vec<(String, String)> {
        let mut env: Vec<(String, String)> = TABLE
            .iter()
            .filter_map(|row| Some((row.var.to_string(), row.text(self)?)))
            .collect();
        if let Some(ids) = self.gpu_ids() {
            env.push(("CUDA_VISIBLE_DEVICES".to_string(), ids.join(",")));
        }
        env
    }

    /// The GPU ids to make visible to the ranks; `None` for `all` or no `gpus`.
    pub fn gpu_ids(&self) -> Option<Vec<String>> {
        self.gpus.as_ref().and_then(Gpus::ids)
    }

    /// Ranks per node when nothing gives `nproc_per_node`: one per GPU id given,
    /// else 1.
    pub fn nproc_or_default(&self) -> usize {
        self.nproc_per_node
            .or_else(|| self.gpu_ids().map(|ids| ids.len()))
            .unwrap_or(1)
    }

    /// Reads a configuration file; see [`file`].
    ///
    /// # Errors
    /// [`Error::Io`] when it cannot be read; [`Error::Config`] naming the file when it
    /// is not valid TOML or has an unknown key; [`Error::Setting`] naming the file and
    /// the key for a value that is not allowed.
    pub fn load(path: &Path) -> Result<Settings> {
        file::load(path)
    }

    /// Reads the run's configuration file `path`: Accelerate's (see [`Accelerate`])
    /// when it ends in `.yaml`, `.yml` or `.json`, as `accelerate config` writes it,
    /// else tch-distributed's TOML ([`load`](Self::load)). Also returns the keys that
    /// change nothing here, each with why, for the launcher to list.
    ///
    /// # Errors
    /// As [`load`](Self::load) and [`Accelerate::load`].
    pub fn load_run_file(path: &Path) -> Result<(Settings, Vec<String>)> {
        let accelerate = path
            .extension()
            .and_then(|e| e.to_str())
            .is_some_and(|e| ["yaml", "yml", "json"].contains(&e.to_ascii_lowercase().as_str()));
        match accelerate {
            true => Accelerate::load(path).map(|a| (a.settings, a.advisory)),
            false => Settings::load(path).map(|s| (s, Vec::new())),
        }
    }

    /// The configuration file's text: a header comment, then one `key = value` line
    /// per setting that is given.
    pub fn to_toml(&self) -> String {
        file::to_toml(self)
    }

    /// Asks for the launch settings on `output`, reading the answers from `input`, as
    /// `accelerate config` does; `current` gives the answers that Enter keeps.
    ///
    /// # Errors
    /// [`Error::Config`] when `input` ends before every question is answered;
    /// [`Error::Io`] when reading or writing fails.
    pub fn ask(
        input: &mut impl std::io::BufRead,
        output: &mut impl std::io::Write,
        current: &Settings,
    ) -> Result<Settings> {
        ask::ask(input, output, current)
    }
}

/// The reference chapter's table of settings (Markdown), from [`TABLE`]: the book's
/// `reference.md` holds it, and a test checks that it is this.
pub fn reference_table() -> String {
    let mut out = String::from(
        "| setting | attribute | `tchrun` flag | variable | file key | values | default |\n\
         |---|---|---|---|---|---|---|\n",
    );
    let code = |s: String| format!("`{s}`");
    for row in TABLE {
        out += &format!(
            "| {} | {} | {} | `{}` | {} | {} | {} |\n",
            row.doc.trim().trim_end_matches('.'),
            if row.attribute {
                code(format!("{} = …", row.key))
            } else {
                "–".into()
            },
            row.flag.map_or("–".into(), |f| match row.value_name {
                "BOOL" => code(format!("--{f}[=BOOL]")),
                value => code(format!("--{f} {value}")),
            }),
            row.var,
            if row.file {
                code(row.key.to_string())
            } else {
                "–".into()
            },
            row.values,
            row.default,
        );
    }
    out
}

/// clap's arguments, one per row with a flag, for `tchrun` and `tchrun config`.
impl clap::FromArgMatches for Settings {
    fn from_arg_matches(matches: &clap::ArgMatches) -> std::result::Result<Self, clap::Error> {
        let mut settings = Settings::default();
        for row in TABLE.iter().filter(|r| r.flag.is_some()) {
            if let Some(text) = matches.get_one::<String>(row.key) {
                // Checked by the argument's value parser already.
                row.set(&mut settings, text)
                    .map_err(|why| clap::Error::raw(clap::error::ErrorKind::InvalidValue, why))?;
            }
        }
        Ok(settings)
    }

    fn update_from_arg_matches(
        &mut self,
        matches: &clap::ArgMatches,
    ) -> std::result::Result<(), clap::Error> {
        *self = Settings::from_arg_matches(matches)?.or(self.clone());
        Ok(())
    }
}

impl clap::Args for Settings {
    fn augment_args(mut cmd: clap::Command) -> clap::Command {
        for row in TABLE {
            let Some(flag) = row.flag else { continue };
            let parse = move |text: &str| -> std::result::Result<String, String> {
                row.set(&mut Settings::default(), text)?;
                Ok(text.trim().to_string())
            };
            let mut arg = clap::Arg::new(row.key)
                .long(flag)
                .value_name(row.value_name)
                .value_parser(parse)
                .help(format!(
                    "{}: {} [env: {}] [default: {}]",
                    row.doc.trim().trim_end_matches('.'),
                    row.values,
                    row.var,
                    row.default
                ));
            if row.value_name == "BOOL" {
                // `--static-graph`, or `--static-graph=false`: with an `=`, so that
                // the program's path after it is not taken for the value.
                arg = arg
                    .num_args(0..=1)
                    .require_equals(true)
                    .default_missing_value("true");
            }
            if let Some(alias) = row.alias {
                arg = arg.alias(alias);
            }
            cmd = cmd.arg(arg);
        }
        cmd
    }

    fn augment_args_for_update(cmd: clap::Command) -> clap::Command {
        Self::augment_args(cmd)
    }
}

#[cfg(test)]
mod tests;
