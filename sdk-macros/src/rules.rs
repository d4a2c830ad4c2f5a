//! The macro's knowledge of tch and of the SDK, in one table that validation
//! (`validate.rs`), the analysis both share (`analysis.rs`) and the rewrite
//! (`expand.rs`) read: which names hold the rank, which calls train, which give the
//! job's context, which are collectives (every rank must make them together), which
//! the rewrite changes, which adaptors keep a sharded loop's source. A call that the
//! rewrite turns into a collective is a collective here, by the same entry.
//!
//! Decided by spelling, for syntax that has no type the macro could see: the names
//! below are method and macro names. Where a receiver's type decides (what `.build`
//! makes, an optimizer's `step` and backward steps, `loss.backward()` and the
//! `Result` methods of the optimizers the function built, a `VarStore`'s `save`, a
//! loop's source, the function's `Result`), the runtime's probes on that type decide
//! (`tch_distributed::__private`), and these names only say where a probe goes.
//! Validation has no types: a call named as a collective below is refused in a
//! branch that some ranks skip whatever its receiver (a two-argument `build` of
//! another type included).

/// Names whose value differs between ranks: a branch on them is taken by some ranks
/// only.
pub const RANK_NAMES: &[&str] = &[
    "rank",
    "local_rank",
    "node_rank",
    "global_rank",
    "is_main_process",
    "is_local_main_process",
];

/// The calls that make a loop a training loop: a backward pass, an optimizer step
/// (also as the rewrites spell them: `__private::backward(…)`,
/// `opt.__tchd_backward_step(…)`).
pub const TRAINING_CALLS: &[&str] = &[
    "backward",
    "backward_step",
    "backward_step_clip",
    "backward_step_clip_norm",
    "__tchd_backward_step",
    "__tchd_backward_step_clip",
    "__tchd_backward_step_clip_norm",
    "step",
    "zero_grad",
];

/// Calls that give the job's context or process group: `tch_distributed::current()`,
/// `init()`, `init_with(…)`, `ctx.process_group()`.
pub const GROUP_SOURCES: &[&str] = &["current", "init", "init_with", "process_group"];

/// Methods that hand on the value they are called on: an optimizer, a training closure,
/// the context or its process group passed on as `&opt`, `ctx.clone()`,
/// `ctx.process_group()`, `current().unwrap()`, `init()?`.
pub const HANDS_ON: &[&str] = &[
    "clone",
    "process_group",
    "as_ref",
    "as_mut",
    "unwrap",
    "expect",
];

/// The optimizer's methods that return a `Result` in the SDK and nothing (or a
/// number) in tch: on the optimizers the function built, the value's type decides
/// (an SDK `Result` is unwrapped, ending the program with the cause on an error).
pub const RESULT_METHODS: &[&str] = &[
    "zero_grad",
    "step",
    "backward",
    "clip_grad_norm",
    "clip_grad_value",
    "set_lr",
    "set_lr_group",
    "set_momentum",
    "set_momentum_group",
    "set_weight_decay",
    "set_weight_decay_group",
];

/// Method calls that run a model's forward pass.
pub const FORWARD_METHODS: &[&str] = &["forward", "forward_t", "apply", "apply_t"];

/// The iterator adaptors that a loop's data source may sit behind: `Iterator`'s
/// methods that keep, drop or pair its items (not `rev`, `cycle`: a sharded source
/// cannot).
pub const ADAPTORS: &[&str] = &[
    "enumerate",
    "take",
    "skip",
    "zip",
    "map",
    "filter",
    "filter_map",
    "take_while",
    "skip_while",
    "map_while",
    "step_by",
    "inspect",
    "peekable",
    "fuse",
    "chain",
    "flat_map",
    "flatten",
];

/// The [`ADAPTORS`] that keep a number of items that depends on the items
/// themselves: behind them, ranks may run out of batches at different steps, so a
/// sharded loop's end is agreed over the ranks (`__private::agreed_ends`: one
/// all-reduce per step; every rank stops when the first runs out). The others keep
/// the count equal on every rank (`take(n)`, `step_by(k)`, `zip` with a range, …)
/// and cost nothing.
pub const UNEVEN_ADAPTORS: &[&str] = &[
    "filter",
    "filter_map",
    "take_while",
    "skip_while",
    "map_while",
    "flat_map",
    "flatten",
];

/// Calls that every rank must make together: `#[distributed]` turns them into (or
/// they are) collectives, so a rank that skips one leaves the others waiting until
/// the timeout.
pub fn collective(method: &str, args: usize) -> Option<&'static str> {
    Some(match (method, args) {
        ("save", 1) => {
            "`save` on a VarStore waits for every rank (rank 0 writes the file alone, between barriers)"
        }
        ("load" | "load_partial", 1) => {
            "`load` on a VarStore waits for every rank (a barrier comes first)"
        }
        ("build", 2) => {
            "building the optimizer wraps the model in DDP, which broadcasts rank 0's parameters to every rank"
        }
        ("save_state", 3) | ("load_state", 2) => {
            "every rank writes or reads its part of a checkpoint (the ranks agree on it with collectives)"
        }
        ("backward", 0 | 1)
        | ("backward_step", 1)
        | ("backward_step_clip", 2)
        | ("backward_step_clip_norm", 2) => {
            "the backward pass all-reduces the gradients with every rank"
        }
        ("step", 0) => "the optimizer's step averages the gradients over the ranks first",
        ("barrier", 0) => "a barrier waits for every rank",
        ("all_reduce" | "broadcast" | "all_gather" | "reduce_scatter", _)
        | ("broadcast_coalesced", _) => "a collective waits for every rank",
        _ => return None,
    })
}
