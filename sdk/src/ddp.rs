//! `DistributedDataParallel` for a `tch::nn::VarStore`, over libtorch's
//! `c10d::Reducer` — the same C++ engine as PyTorch's DDP.

use std::cell::Cell;
use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::ffi::CString;

use tch::nn::{Optimizer, VarStore};
use tch::Tensor;

use crate::error::{ranks_text, Error, Result, TorchText};
use crate::ffi::reducer::{CommHookKind, ReducerHandle, ReducerOptions};
use crate::ffi::TensorArray;
use crate::process_group::ProcessGroup;
pub use crate::settings::CommHook;

const MIB: f64 = 1024.0 * 1024.0;

/// Bucket size of the parameter and buffer broadcasts, as PyTorch's DDP (250 MiB).
const BROADCAST_BUCKET_BYTES: usize = 250 * 1024 * 1024;

/// Options of [`DistributedDataParallel`]; the defaults are PyTorch's.
#[derive(Clone, Debug, PartialEq)]
pub struct DdpOptions {
    /// Gradient bucket size in MiB (PyTorch's `bucket_cap_mb`, default 25).
    pub bucket_cap_mb: f64,
    /// Size of the first bucket in MiB (PyTorch's `_DEFAULT_FIRST_BUCKET_BYTES`,
    /// default 1), so the last layers' gradients start their all-reduce early. PyTorch
    /// uses it only when `bucket_cap_mb` is left at its default; when `bucket_cap_mb`
    /// is passed, the first bucket is that size too (torch 2.11's
    /// `bucket_bytes_cap_default`): set both to match such a run.
    pub first_bucket_cap_mb: f64,
    /// Traverse the autograd graph from the loss before each backward to find
    /// parameters that got no gradient, so their buckets do not wait forever
    /// (PyTorch's `find_unused_parameters`, default false; it costs a graph walk).
    pub find_unused_parameters: bool,
    /// Give every rank rank 0's buffers (variables that are not trainable, such as
    /// batch-norm running statistics, `zeros_no_train`) for its forward passes, as
    /// PyTorch's `broadcast_buffers` (default true). PyTorch broadcasts them at the
    /// start of a forward pass that follows a synchronized one; DDP here does not see
    /// the forward pass, so it broadcasts them at the end of each synchronized
    /// backward, which gives the next forward pass the same values and never touches
    /// a tensor that a forward pass saved for a backward still to come.
    pub broadcast_buffers: bool,
    /// The Reducer's static-graph mode, as PyTorch's `static_graph=True`: the set of
    /// variables that get gradients, and the order they get them in, is the same every
    /// step, so the Reducer learns it in the first synchronized backward pass (whose
    /// all-reduce runs once that pass has ended) and then needs no graph walk for
    /// variables the loss leaves out, which it may, without `find_unused_parameters`
    /// (default false).
    pub static_graph: bool,
    /// Gradient compression for the all-reduce, as PyTorch's `register_comm_hook`
    /// with `fp16_compress_hook` or `bf16_compress_hook` (default none): see
    /// [`CommHook`].
    pub comm_hook: CommHook,
}

impl Default for DdpOptions {
    fn default() -> Self {
        DdpOptions {
            bucket_cap_mb: 25.0,
            first_bucket_cap_mb: 1.0,
            find_unused_parameters: false,
            broadcast_buffers: true,
            static_graph: false,
            comm_hook: CommHook::None,
        }
    }
}

/// Counters of what DDP did, for tests and benchmarks.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct DdpStats {
    /// Backward passes whose gradients were all-reduced.
    pub synced_backward_passes: u64,
    /// Backward passes run under [`DistributedDataParallel::no_sync`] (local only).
    pub local_backward_passes: u64,
    /// Times the Reducer rebuilt its buckets from the observed gradient order.
    pub bucket_rebuilds: u64,
}

/// Data-parallel training of the trainable variables of a `VarStore`, as PyTorch's
/// `torch.nn.parallel.DistributedDataParallel`.
///
/// On construction it checks that every rank has the same variables (count, shapes,
/// dtypes), broadcasts all variables from rank 0, and registers a `c10d::Reducer`
/// over the trainable ones. Then each [`backward`](Self::backward) all-reduces
/// gradients bucket by bucket while backward is still running, and leaves every
/// rank with the gradient averaged over ranks. With a world of one process the
/// Reducer is skipped and `backward` is plain `loss.backward()`.
///
/// ```no_run
/// # fn main() -> tch_distributed::Result<()> {
/// use tch::nn::{self, Module, OptimizerConfig};
/// let ctx = tch_distributed::init()?;
/// let vs = nn::VarStore::new(ctx.device());
/// let net = nn::linear(vs.root(), 4, 1, Default::default());
/// let mut opt = nn::Sgd::default().build(&vs, 0.1)?;
/// let ddp = tch_distributed::DistributedDataParallel::new(&vs, ctx.process_group(), Default::default())?;
/// let xs = tch::Tensor::randn([8, 4], (tch::Kind::Float, ctx.device()));
/// let loss = net.forward(&xs).square().mean(None);
/// ddp.backward_step(&mut opt, &loss)?; // instead of opt.backward_step(&loss)
/// # Ok(()) }
/// ```
pub struct DistributedDataParallel {
    reducer: Option<ReducerHandle>,
    group: ProcessGroup,
    buffers: Vec<Tensor>,
    options: DdpOptions,
    require_grad_sync: Cell<bool>,
    /// The Reducer was prepared for a backward pass still to come
    /// ([`prepare_next_backward`](Self::prepare_next_backward)).
    prepared: Cell<bool>,
    stats: Cell<DdpStats>,
    /// The Reducer's variables' names, in its order (the indices of its errors).
    names: Vec<String>,
}

impl DistributedDataParallel {
    /// Wraps the variables of `vs` for data-parallel training over `group`. Every
    /// rank must call it with a store holding the same variables.
    ///
    /// # Errors
    /// [`Error::Config`] for non-positive bucket sizes; [`Error::Usage`] for a
    /// store with no trainable variable, or ranks whose variables differ (on every
    /// rank, naming each variable that differs and every rank's shape of it, from
    /// descriptions the ranks publish in the store); [`Error::Timeout`] or
    /// [`Error::Collective`] when a rank does not take part.
    pub fn new(vs: &VarStore, group: &ProcessGroup, options: DdpOptions) -> Result<Self> {
        let named = vs.variables();
        let name_of: HashMap<usize, &String> = named
            .iter()
            .map(|(n, t)| (crate::ffi::tensor_key(t), n))
            .collect();
        // Registration order, the order PyTorch's DDP sees `module.parameters()` in.
        let params: Vec<(String, Tensor)> = vs
            .trainable_variables()
            .into_iter()
            .filter(|t| t.requires_grad())
            .map(|t| {
                let name = name_of.get(&crate::ffi::tensor_key(&t));
                (name.map_or("?", |s| s.as_str()).to_string(), t)
            })
            .collect();
        // Buffers are the variables that are not trainable at all (`zeros_no_train`,
        // batch norm's statistics). Frozen ones (trainable, but `requires_grad` off, as
        // after `vs.freeze()`) are PyTorch's frozen parameters: broadcast here, once.
        let trainable: std::collections::HashSet<usize> = vs
            .trainable_variables()
            .iter()
            .map(|t| crate::ffi::tensor_key(t))
            .collect();
        Self::wrap(&named, &trainable, params, group, options)
    }

    /// Wraps `variables` (name, variable; the names for errors) and averages the
    /// gradients of those that `averaged` picks, in that order: what `#[distributed]`
    /// builds, at its first step, for an optimizer the function did not build, over
    /// its variables that got a gradient. Every variable is checked and broadcast from
    /// rank 0 as in [`new`](Self::new); there are no buffers (an optimizer does not
    /// see them).
    pub(crate) fn over_variables(
        variables: &[(String, Tensor)],
        averaged: impl Fn(&Tensor) -> bool,
        group: &ProcessGroup,
        options: DdpOptions,
    ) -> Result<Self> {
        let named: HashMap<String, Tensor> = variables
            .iter()
            .map(|(n, t)| (n.clone(), t.shallow_clone()))
            .collect();
        let params: Vec<(String, Tensor)> = variables
            .iter()
            .filter(|(_, t)| t.requires_grad() && averaged(t))
            .map(|(n, t)| (n.clone(), t.shallow_clone()))
            .collect();
        let trainable = variables
            .iter()
            .map(|(_, t)| crate::ffi::tensor_key(t))
            .collect();
        Self::wrap(&named, &trainable, params, group, options)
    }

    /// How many variables the Reducer averages the gradients of.
    pub(crate) fn variable_count(&self) -> usize {
        self.names.len()
    }

    /// [`new`](Self::new) over `named` (every variable, by name), of which `trainable`
    /// (by data pointer) are trainable and `params` (in the Reducer's order) get
    /// gradients.
    fn wrap(
        named: &HashMap<String, Tensor>,
        trainable: &std::collections::HashSet<usize>,
        params: Vec<(String, Tensor)>,
        group: &ProcessGroup,
        options: DdpOptions,
    ) -> Result<Self> {
        for (name, mb) in [
            ("bucket_cap_mb", options.bucket_cap_mb),
            ("first_bucket_cap_mb", options.first_bucket_cap_mb),
        ] {
            if !(mb.is_finite() && mb > 0.0) {
                return Err(Error::Config(format!(
                    "{name} must be a positive number of MiB, got {mb}"
                )));
            }
        }
        if params.is_empty() {
            return Err(Error::Usage(
                "the VarStore has no trainable variable: build the model on it before wrapping it in \
                 DistributedDataParallel"
                    .into(),
            ));
        }
        // A name order that every rank agrees on (HashMap order differs per process).
        let mut all: Vec<(&String, &Tensor)> = named.iter().collect();
        all.sort_by(|a, b| a.0.cmp(b.0));
        let buffers: Vec<Tensor> = all
            .iter()
            .filter(|(_, t)| !trainable.contains(&crate::ffi::tensor_key(t)))
            .map(|(_, t)| t.shallow_clone())
            .collect();
        let description = describe(&all, |t| {
            if !trainable.contains(&crate::ffi::tensor_key(t)) {
                "buffer"
            } else if t.requires_grad() {
                "trainable"
            } else {
                "frozen"
            }
        });
        let all: Vec<Tensor> = all.iter().map(|(_, t)| t.shallow_clone()).collect();

        same_models(group, &description)?;
        // c10d still checks what the descriptions leave out (strides).
        group.verify_same_shapes(&all)?;
        group.broadcast_coalesced(&all, BROADCAST_BUCKET_BYTES, 0)?;

        let (names, params): (Vec<String>, Vec<Tensor>) = params.into_iter().unzip();
        let reducer = if group.world_size() > 1 {
            let cnames: Vec<CString> = names
                .iter()
                .map(|n| CString::new(n.as_str()).unwrap_or_default())
                .collect();
            let reducer_options = ReducerOptions {
                bucket_bytes_cap: (options.bucket_cap_mb * MIB) as i64,
                first_bucket_bytes_cap: (options.first_bucket_cap_mb * MIB) as i64,
                find_unused_parameters: options.find_unused_parameters,
                // `true` would make gradients views, which tch's zero_grad cannot detach.
                gradient_as_bucket_view: false,
            };
            let reducer = ReducerHandle::new(
                group.raw(),
                &TensorArray::new(&params),
                &cnames,
                &reducer_options,
            )
            .map_err(|t| Error::Torch(t.message()))?;
            if options.static_graph {
                reducer
                    .set_static_graph()
                    .map_err(|t| Error::Torch(t.message()))?;
            }
            let hook = match options.comm_hook {
                CommHook::None => None,
                CommHook::Fp16 => Some(CommHookKind::Fp16),
                CommHook::Bf16 => Some(CommHookKind::Bf16),
            };
            if let Some(hook) = hook {
                reducer
                    .register_comm_hook(hook)
                    .map_err(|t| Error::Torch(t.message()))?;
            }
            Some(reducer)
        } else {
            None
        };
        Ok(DistributedDataParallel {
            reducer,
            group: group.clone(),
            buffers,
            options,
            require_grad_sync: Cell::new(true),
            prepared: Cell::new(false),
            stats: Cell::new(DdpStats::default()),
            names,
        })
    }

    /// The process group gradients are averaged over.
    pub fn process_group(&self) -> &ProcessGroup {
        &self.group
    }

    /// The options this DDP was built with.
    pub fn options(&self) -> &DdpOptions {
        &self.options
    }

    /// What DDP has done so far.
    pub fn stats(&self) -> DdpStats {
        self.stats.get()
    }

    /// Runs `loss.backward()` and, unless inside [`no_sync`](Self::no_sync), averages
    /// the gradients over all ranks while backward runs. `loss` is a scalar tensor;
    /// every rank must call this the same number of times.
    ///
    /// # Errors
    /// [`Error::Timeout`] when the gradient all-reduce times out (naming the
    /// ranks that did not arrive: each synchronized backward pass is recorded in the
    /// store, see [`ProcessGroup`]); [`Error::UnusedParameters`], naming them, when
    /// variables got no gradient in the last backward pass without
    /// `find_unused_parameters` (the Reducer notices at the next one);
    /// [`Error::Torch`] when backward fails otherwise; [`Error::Collective`] when
    /// broadcasting buffers fails.
    ///
    /// # Panics
    /// Never: the Reducer it expects is made with the DDP whenever the world has several ranks.
    pub fn backward(&self, loss: &Tensor) -> Result<()> {
        let (synced, entered) = if self.prepared.take() {
            (true, None)
        } else {
            self.prepare(Some(loss))?
        };
        let done = loss.f_backward();
        if let Some((n, _)) = &entered {
            self.group.leave(*n);
        }
        done.map_err(|e| {
            let text = crate::error::torch_text(e);
            match entered {
                // The Reducer's all-reduce runs inside backward: its timeout is
                // backward's error.
                Some((n, what)) if text.is_timeout() => self.group.timed_out(&what, n, text),
                Some((_, what)) => match self.group.peer_lost(&text) {
                    Some(cause) => Error::Collective {
                        op: "backward",
                        message: format!("{what}: {cause}\n{}", text.message()),
                    },
                    None => self.reducer_error(text),
                },
                None => self.reducer_error(text),
            }
        })?;
        let passes = self.stats.get().synced_backward_passes;
        if synced && self.options.static_graph && passes == 1 {
            // The first pass of a static graph only recorded the gradients' order.
            let r = self.reducer.as_ref().expect("synced with a reducer");
            self.reducer_call(r.delay_all_reduce())?;
        }
        // After the backward pass, never between a forward pass and its backward:
        // autograd saved the buffers (batch norm's running statistics) at the forward
        // pass and checks that they were not modified in place since.
        if synced {
            self.broadcast_buffers()?;
        }
        Ok(())
    }

    /// Prepares the Reducer now for the next backward pass, whichever runs it: a plain
    /// `loss.backward()` then averages the gradients while it runs, as
    /// [`backward`](Self::backward) does (which takes the preparation over). What
    /// `#[distributed]` does after each step of an optimizer the function did not
    /// build, whose backward pass it does not see. For a Reducer that needs no loss
    /// to prepare: not with `find_unused_parameters` or `static_graph`, and with no
    /// buffers to broadcast after the pass.
    ///
    /// # Errors
    /// As [`backward`](Self::backward)'s preparation
    /// ([`Error::UnusedParameters`] when the last backward pass left variables
    /// without a gradient).
    pub(crate) fn prepare_next_backward(&self) -> Result<()> {
        debug_assert!(!self.options.find_unused_parameters && !self.options.static_graph);
        debug_assert!(self.buffers.is_empty());
        let (synced, _) = self.prepare(None)?;
        self.prepared.set(synced);
        Ok(())
    }

    /// Readies the Reducer for a backward pass of `loss` (`None`: whatever loss comes)
    /// and counts it: whether it all-reduces, and the collective it is as recorded in
    /// the store (see [`ProcessGroup`]).
    #[allow(clippy::type_complexity)]
    fn prepare(&self, loss: Option<&Tensor>) -> Result<(bool, Option<(u64, String)>)> {
        let mut stats = self.stats.get();
        // The collective this backward pass is, as recorded in the store: a timeout
        // in the gradient all-reduce names the ranks that did not arrive.
        let mut entered = None;
        let synced = match &self.reducer {
            Some(reducer) if self.require_grad_sync.get() => {
                let what = format!(
                    "the gradient all-reduce of backward pass {}",
                    stats.synced_backward_passes + 1
                );
                if loss.is_some() {
                    entered = Some((self.group.enter(&what), what));
                }
                self.reducer_call(reducer.prepare_for_forward())?;
                let rebuilt = self.reducer_call(reducer.rebuild_buckets())?;
                stats.bucket_rebuilds += u64::from(rebuilt);
                // As PyTorch's DDP: a static graph finds its unused variables itself.
                let outputs = match loss {
                    Some(loss)
                        if self.options.find_unused_parameters && !self.options.static_graph =>
                    {
                        TensorArray::of([loss])
                    }
                    _ => TensorArray::of([]),
                };
                self.reducer_call(reducer.prepare_for_backward(&outputs))?;
                stats.synced_backward_passes += 1;
                self.group.count_gradient_average();
                true
            }
            Some(_) => {
                stats.local_backward_passes += 1;
                false
            }
            None => {
                stats.synced_backward_passes += 1;
                false
            }
        };
        self.stats.set(stats);
        Ok((synced, entered))
    }

    /// Copies rank 0's buffers to every rank (a no-op with `broadcast_buffers` off or
    /// no buffers). [`backward`](Self::backward) calls it after each synchronized
    /// backward pass; call it yourself before a forward pass that must use rank 0's
    /// buffers when no synchronized backward came since they last changed (say,
    /// evaluation right after a `no_sync` micro-batch). Every rank must call it.
    ///
    /// # Errors
    /// [`Error::Collective`] when the broadcast fails.
    pub fn broadcast_buffers(&self) -> Result<()> {
        if self.options.broadcast_buffers && !self.buffers.is_empty() && self.group.world_size() > 1
        {
            tch::no_grad(|| {
                self.group
                    .broadcast_coalesced(&self.buffers, BROADCAST_BUCKET_BYTES, 0)
            })?;
        }
        Ok(())
    }

    /// `opt.backward_step(loss)` with gradients averaged over ranks: zero the
    /// gradients, [`backward`](Self::backward), step.
    ///
    /// # Errors
    /// As [`backward`](Self::backward), and [`Error::Torch`] from the step.
    pub fn backward_step(&self, opt: &mut Optimizer, loss: &Tensor) -> Result<()> {
        opt.zero_grad();
        self.backward(loss)?;
        opt.step();
        Ok(())
    }

    /// `opt.backward_step_clip(loss, max)`: as [`backward_step`](Self::backward_step),
    /// clamping each averaged gradient element to `[-max, max]` before the step.
    ///
    /// # Errors
    /// As [`backward_step`](Self::backward_step).
    pub fn backward_step_clip(&self, opt: &mut Optimizer, loss: &Tensor, max: f64) -> Result<()> {
        opt.zero_grad();
        self.backward(loss)?;
        opt.clip_grad_value(max);
        opt.step();
        Ok(())
    }

    /// `opt.backward_step_clip_norm(loss, max)`: as [`backward_step`](Self::backward_step),
    /// scaling the averaged gradients so their global L2 norm is at most `max`. Every
    /// rank clips by the same norm, since every rank holds the same averaged gradients.
    ///
    /// # Errors
    /// As [`backward_step`](Self::backward_step).
    pub fn backward_step_clip_norm(
        &self,
        opt: &mut Optimizer,
        loss: &Tensor,
        max: f64,
    ) -> Result<()> {
        opt.zero_grad();
        self.backward(loss)?;
        opt.clip_grad_norm(max);
        opt.step();
        Ok(())
    }

    /// Skips the all-reduce of the backward passes run while the returned guard
    /// lives, so gradients accumulate locally; the next backward outside it averages
    /// the accumulated gradients. As PyTorch's `DistributedDataParallel.no_sync()`,
    /// the way to accumulate gradients over micro-batches.
    pub fn no_sync(&self) -> NoSync<'_> {
        let previous = self.require_grad_sync.replace(false);
        NoSync {
            ddp: self,
            previous,
        }
    }

    /// The number of parameters in each gradient bucket, in the Reducer's order
    /// (empty with a world of one process). Before the first backward all parameters
    /// share one bucket; the buckets are rebuilt by size at the second backward, as
    /// PyTorch's DDP does.
    ///
    /// # Errors
    /// [`Error::Torch`] when the Reducer cannot report its buckets.
    pub fn bucket_sizes(&self) -> Result<Vec<usize>> {
        let Some(reducer) = &self.reducer else {
            return Ok(vec![]);
        };
        let sizes = self.reducer_call(reducer.bucket_sizes())?;
        Ok(sizes.into_iter().map(|s| s as usize).collect())
    }
}

/// Guard returned by [`DistributedDataParallel::no_sync`]; restores synchronization
/// when dropped.
pub struct NoSync<'a> {
    ddp: &'a DistributedDataParallel,
    previous: bool,
}

impl Drop for NoSync<'_> {
    fn drop(&mut self) {
        self.ddp.require_grad_sync.set(self.previous);
    }
}

/// `variables` (sorted by name) described one per line, `name\tshape\tdtype\trole`,
/// with `role` from `role_of`: what each rank publishes in the store to compare.
fn describe(variables: &[(&String, &Tensor)], role_of: impl Fn(&Tensor) -> &'static str) -> String {
    variables
        .iter()
        .map(|(name, t)| format!("{name}\t{:?}\t{:?}\t{}\n", t.size(), t.kind(), role_of(t)))
        .collect()
}

/// Checks that every rank of `group` built the model that `description` describes
/// (see [`describe`]): each rank publishes its description in the store, and one
/// all-gather of their fingerprints tells every rank whether they differ. When they
/// do, every rank reads one description per distinct model and fails with the same
/// error, naming each variable that differs and every rank's shape of it.
fn same_models(group: &ProcessGroup, description: &str) -> Result<()> {
    let Some(records) = group.records() else {
        return Ok(());
    };
    let model = group.next_model();
    let key = |rank: usize| format!("model/{model}/{rank}");
    records.set(&key(group.rank()), description.as_bytes())?;
    let mine = Tensor::from_slice(&[crate::random_state::fnv1a(description.bytes()) as i64]);
    let gathered: Vec<i64> = group
        .all_gather(&mine)?
        .iter()
        .map(|t| t.int64_value(&[0]))
        .collect();
    if gathered.iter().all(|&h| h == gathered[0]) {
        return Ok(());
    }
    // The ranks of each distinct model, in the order of their first rank.
    let mut models: Vec<(i64, Vec<usize>)> = Vec::new();
    for (rank, &h) in gathered.iter().enumerate() {
        match models.iter_mut().find(|(m, _)| *m == h) {
            Some((_, ranks)) => ranks.push(rank),
            None => models.push((h, vec![rank])),
        }
    }
    let mut variables: Vec<BTreeMap<String, [String; 3]>> = Vec::new();
    for (_, ranks) in &models {
        let text = records.get(&key(ranks[0]))?;
        let text = String::from_utf8_lossy(&text);
        variables.push(
            text.lines()
                .filter_map(|line| {
                    let mut fields = line.split('\t');
                    let name = fields.next()?.to_string();
                    let mut rest = [String::new(), String::new(), String::new()];
                    for slot in rest.iter_mut() {
                        *slot = fields.next()?.to_string();
                    }
                    Some((name, rest))
                })
                .collect(),
        );
    }
    let names: BTreeSet<&String> = variables.iter().flat_map(|v| v.keys()).collect();
    let mut lines = Vec::new();
    for name in names {
        let of: Vec<Option<&[String; 3]>> = variables.iter().map(|v| v.get(name)).collect();
        if of.iter().all(|v| *v == of[0]) {
            continue;
        }
        // The shape always; the dtype and the role (trainable, frozen, buffer) only
        // where they differ.
        let differs = |i: usize| {
            let present: BTreeSet<&str> = of.iter().flatten().map(|v| v[i].as_str()).collect();
            present.len() > 1
        };
        let (kind, role) = (differs(1), differs(2));
        let sides: Vec<String> = models
            .iter()
            .zip(&of)
            .map(|((_, ranks), v)| {
                let verb = if ranks.len() == 1 { "has" } else { "have" };
                let what = match v {
                    None => "no such variable".to_string(),
                    Some([shape, dtype, r]) => {
                        let mut what = shape.clone();
                        if kind {
                            what += &format!(" {dtype}");
                        }
                        if role {
                            what += &format!(" ({r})");
                        }
                        what
                    }
                };
                format!("{} {verb} {what}", ranks_text(ranks))
            })
            .collect();
        lines.push(format!("  variable \"{name}\": {}", sides.join(", ")));
    }
    const LISTED: usize = 10;
    if lines.len() > LISTED {
        let more = lines.len() - LISTED;
        lines.truncate(LISTED);
        lines.push(format!("  and {more} more variables"));
    }
    Err(Error::Usage(format!(
        "the ranks built different models:\n{}\n{MODELS_HINT}",
        lines.join("\n")
    )))
}

const MODELS_HINT: &str = "hint: every rank must create the same variables, with the same \
     names, shapes and dtypes, before `.build(&vs, lr)` (or DistributedDataParallel::new); \
     look for model sizes that depend on the rank or on rank-local data";

impl DistributedDataParallel {
    /// A Reducer call's result, its error as [`reducer_error`](Self::reducer_error).
    fn reducer_call<T>(&self, done: std::result::Result<T, TorchText>) -> Result<T> {
        done.map_err(|text| self.reducer_error(text))
    }

    /// A Reducer error as the SDK's: variables that got no gradient named (their
    /// indices in the Reducer's text, "Parameter indices which did not receive grad for
    /// rank R: 2 3", mapped to the store's names), else libtorch's message, with the
    /// option's name in tch-distributed when it names `find_unused_parameters`.
    fn reducer_error(&self, text: TorchText) -> Error {
        let message = text.message();
        if !self.options.find_unused_parameters {
            if let Some(variables) = unused_variables(&self.names, &message) {
                return Error::UnusedParameters {
                    variables,
                    source: text,
                };
            }
        }
        if message.contains("find_unused_parameters") {
            Error::Torch(format!(
                "{message}\nhint: in tch-distributed this is DdpOptions::find_unused_parameters \
                 (#[distributed(find_unused_parameters = true)])"
            ))
        } else {
            Error::Torch(message)
        }
    }
}

/// The names of the variables that the Reducer's `message` lists as having no
/// gradient, by their indices into `names`; `None` when it lists none, or an index
/// out of range.
fn unused_variables(names: &[String], message: &str) -> Option<Vec<String>> {
    const LISTING: &str = "Parameter indices which did not receive grad for rank ";
    let line = message
        .lines()
        .find_map(|l| l.trim().strip_prefix(LISTING))?;
    let (_, indices) = line.split_once(": ")?;
    let variables: Option<Vec<String>> = indices
        .split_whitespace()
        .map(|i| names.get(i.parse::<usize>().ok()?).cloned())
        .collect();
    variables.filter(|v| !v.is_empty())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The Reducer's text (PyTorch 2.11), C++ frames cut.
    const REDUCER: &str = "Expected to have finished reduction in the prior iteration before \
        starting a new one. This error indicates that your module has parameters that were \
        not used in producing loss. You can enable unused parameter detection by passing the \
        keyword argument `find_unused_parameters=True` to \
        `torch.nn.parallel.DistributedDataParallel`, and by \nmaking sure all `forward` \
        function outputs participate in calculating loss.\nParameter indices which did not \
        receive grad for rank 1: 0 2\n In addition, you can set the environment variable \
        TORCH_DISTRIBUTED_DEBUG to either INFO or DETAIL to print out information about \
        which particular parameters did not receive gradient on this rank as part of this error";

    fn names() -> Vec<String> {
        ["a.weight", "b.weight", "c.bias"]
            .map(String::from)
            .to_vec()
    }

    #[test]
    fn the_reducers_unused_indices_become_the_variables_names() {
        assert_eq!(
            unused_variables(&names(), REDUCER),
            Some(vec!["a.weight".to_string(), "c.bias".to_string()])
        );
        // Not the listing, or an index the SDK did not give: libtorch's text stays.
        assert_eq!(
            unused_variables(&names(), "Expected to have finished reduction"),
            None
        );
        let beyond = REDUCER.replace("rank 1: 0 2", "rank 1: 0 3");
        assert_eq!(unused_variables(&names(), &beyond), None);
        let none = REDUCER.replace("rank 1: 0 2", "rank 1: ");
        assert_eq!(unused_variables(&names(), &none), None);
    }

    #[test]
    fn the_unused_parameters_error_names_them_and_both_fixes_with_libtorchs_text_as_source() {
        let e = Error::UnusedParameters {
            variables: vec!["unused.weight".into()],
            source: TorchText::new(REDUCER),
        };
        let shown = e.to_string();
        assert!(
            shown.starts_with(
                "variable \"unused.weight\" got no gradient in the last backward pass"
            ),
            "{shown}"
        );
        for fix in [
            "#[distributed(find_unused_parameters = true)]",
            "if it should not train, freeze it (set_requires_grad(false))",
        ] {
            assert!(shown.contains(fix), "{fix} not in {shown}");
        }
        assert!(!shown.contains("Expected to have finished"), "{shown}");
        let source = std::error::Error::source(&e).unwrap().to_string();
        assert!(
            source.contains("Expected to have finished reduction"),
            "{source}"
        );
        // Many: the first 10, and how many more.
        let e = Error::UnusedParameters {
            variables: (0..12).map(|i| format!("l{i}.weight")).collect(),
            source: TorchText::new(REDUCER),
        };
        let shown = e.to_string();
        assert!(
            shown.contains("\"l9.weight\", and 2 more got no gradient"),
            "{shown}"
        );
        assert!(!shown.contains("l10.weight"), "{shown}");
        // Exactly 10: all listed, no "and 0 more".
        let e = Error::UnusedParameters {
            variables: (0..10).map(|i| format!("l{i}.weight")).collect(),
            source: TorchText::new(REDUCER),
        };
        let shown = e.to_string();
        assert!(shown.contains("\"l9.weight\" got no gradient"), "{shown}");
    }
}
