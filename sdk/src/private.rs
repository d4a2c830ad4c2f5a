//! Runtime support for the code `#[distributed]` generates. Not public API: it may
//! change in any release. The macro emits calls to `::tch_distributed::__private::…`
//! only.

use std::cell::{Cell, RefCell};
use std::path::Path;
use std::sync::atomic::{AtomicU64, Ordering};

use tch::nn::VarStore;
use tch::{Device, TchError, Tensor};

use crate::amp::{Autocast, GradScaler, MixedPrecision};
use crate::data::Sharded;
use crate::ddp::{DdpOptions, DistributedDataParallel};
use crate::env::LaunchEnv;
use crate::init::{self, Context, InitOptions};
use crate::optim::{Optimizer, OptimizerKind};
use crate::process_group::Backend;
use crate::rng::AgreedSeed;

pub use crate::error::Error;

/// The attribute's options, as validated by the macro.
#[derive(Clone, Debug, Default)]
pub struct Options {
    pub backend: Option<&'static str>,
    pub nproc_per_node: Option<usize>,
    pub bucket_cap_mb: Option<f64>,
    pub find_unused_parameters: bool,
    pub timeout_secs: Option<f64>,
    pub mixed_precision: Option<&'static str>,
    pub grad_accum: Option<usize>,
}

thread_local! {
    static OPTIONS: RefCell<Options> = RefCell::new(Options::default());
    static PRECISION: Cell<MixedPrecision> = const { Cell::new(MixedPrecision::No) };
    static DEPTH: Cell<usize> = const { Cell::new(0) };
}

/// Ends the program as `main` returning an error does: `Error: …` on stderr (the
/// message names the problem and the fix) and exit code 1, without a panic's
/// pointer into the SDK's sources. Every caller is at a point where nothing is half
/// written: checkpoints are complete or absent.
fn fail(what: &str, e: impl std::fmt::Display) -> ! {
    let rank = init::current()
        .filter(|c| c.world_size() > 1)
        .map(|c| format!("rank {}: ", c.rank()))
        .unwrap_or_default();
    // One write, so that the lines of ranks failing at once do not interleave.
    let line = format!("Error: {rank}{what}: {e}\n");
    let _ = std::io::Write::write_all(&mut std::io::stderr(), line.as_bytes());
    // torchrun's (and tchrun's) root cause, when the launcher asks for it.
    crate::launch::error_file::record(line.trim_end(), None);
    std::process::exit(1)
}

/// Under a launcher that asks for an error file (`TORCHELASTIC_ERROR_FILE`), a panic
/// writes its message there too, with the backtrace when `RUST_BACKTRACE` asks for
/// one, before the default report; installed once, at the outermost entry.
fn record_panics() {
    static ONCE: std::sync::Once = std::sync::Once::new();
    if std::env::var_os(crate::launch::error_file::ERROR_FILE_ENV).is_none() {
        return;
    }
    ONCE.call_once(|| {
        let previous = std::panic::take_hook();
        std::panic::set_hook(Box::new(move |info| {
            let message = info.to_string();
            let backtrace = std::backtrace::Backtrace::capture();
            let details = (backtrace.status() == std::backtrace::BacktraceStatus::Captured)
                .then(|| format!("{message}\n\nstack backtrace:\n{backtrace}"));
            crate::launch::error_file::record(&message, details.as_deref());
            previous(info)
        }));
    });
}

/// [`fail`] for the SDK's own errors. Their message is the SDK's; libtorch's own text,
/// the error's source, follows it (`caused by: libtorch: …`) only when
/// `TORCH_SHOW_CPP_STACKTRACES=1` asks for libtorch's details.
fn fail_with_source(what: &str, e: &Error) -> ! {
    let mut message = e.to_string();
    if std::env::var("TORCH_SHOW_CPP_STACKTRACES").is_ok_and(|v| v == "1") {
        let mut source = std::error::Error::source(e);
        while let Some(cause) = source {
            message += &format!("\ncaused by: {cause}");
            source = cause.source();
        }
    }
    fail(what, message)
}

/// How many ranks to start when the program runs without a launcher:
/// `TCH_DISTRIBUTED_NPROC` wins over the attribute's `nproc_per_node`; without
/// either, one per visible GPU (`CUDA_VISIBLE_DEVICES` applies), else one process.
fn self_launch_ranks(options: &Options) -> usize {
    match std::env::var("TCH_DISTRIBUTED_NPROC") {
        Ok(v) => match v.trim().parse() {
            Ok(n) if n > 0 => n,
            _ => fail(
                "TCH_DISTRIBUTED_NPROC",
                format!(
                    "{v:?} is not a positive number of processes: set it to e.g. 2, or unset it"
                ),
            ),
        },
        Err(_) => options
            .nproc_per_node
            .unwrap_or_else(|| crate::devices::visible_gpus().max(1)),
    }
}

/// The attribute's options with the environment's settings over them, as
/// `tchrun` passes on its flags, its own environment and the configuration file
/// (see [`crate::config`]): `TCH_DISTRIBUTED_BACKEND`, `TCH_DISTRIBUTED_TIMEOUT`,
/// `TCH_DISTRIBUTED_MIXED_PRECISION` and `TCH_DISTRIBUTED_GRAD_ACCUM` win over the
/// attribute's `backend`, `timeout`, `mixed_precision` and `grad_accum`
/// (`TCH_DISTRIBUTED_NPROC` over `nproc_per_node`: [`self_launch_ranks`]). A variable
/// set to the empty string counts as unset. Also returns one line for each value
/// written in the attribute that a variable replaced, for rank 0 to print.
fn with_environment(mut options: Options) -> (Options, Vec<String>) {
    use crate::config::{BACKEND_ENV, GRAD_ACCUM_ENV, MIXED_PRECISIONS, MIXED_PRECISION_ENV};
    let var = |name: &str| {
        std::env::var(name)
            .ok()
            .map(|v| v.trim().to_ascii_lowercase())
            .filter(|v| !v.is_empty())
    };
    let mut overridden = Vec::new();
    let mut note = |name: &str, value: &str, option: &str, written: String| {
        overridden.push(format!(
            "{name}={value} overrides the attribute's {option} = {written} (set by tchrun's \
             flag or configuration file, or in the environment)"
        ));
    };
    // Joining reads these two itself, and names a bad value, when the attribute
    // gives none.
    if let Some(b) = var(BACKEND_ENV) {
        if let Some(written) = options.backend.take() {
            note(BACKEND_ENV, &b, "backend", format!("{written:?}"));
        }
    }
    if let Some(t) = var("TCH_DISTRIBUTED_TIMEOUT") {
        if let Some(written) = options.timeout_secs.take() {
            note(
                "TCH_DISTRIBUTED_TIMEOUT",
                &t,
                "timeout",
                written.to_string(),
            );
        }
    }
    if let Some(mp) = var(MIXED_PRECISION_ENV) {
        match MIXED_PRECISIONS.iter().find(|m| **m == mp) {
            Some(m) => {
                if let Some(written) = options.mixed_precision.replace(m) {
                    note(
                        MIXED_PRECISION_ENV,
                        m,
                        "mixed_precision",
                        format!("{written:?}"),
                    );
                }
            }
            None => fail(
                MIXED_PRECISION_ENV,
                format!("{mp:?} is not a mixed precision: use no, bf16, fp16 or auto, or unset it"),
            ),
        }
    }
    if let Some(k) = var(GRAD_ACCUM_ENV) {
        match k.parse::<usize>() {
            Ok(k) if k >= 1 => {
                if let Some(written) = options.grad_accum.replace(k) {
                    note(GRAD_ACCUM_ENV, &k.to_string(), "grad_accum", written.to_string());
                }
            }
            _ => fail(
                GRAD_ACCUM_ENV,
                format!(
                    "{k:?} is not a number of micro-batches per optimizer step: set it to 1 or more, or unset it"
                ),
            ),
        }
    }
    (options, overridden)
}

/// Function entry: joins the job (or, with no launcher and more than one rank
/// asked for, launches the ranks and exits with their result), then prints the
/// banner on rank 0. Returns a guard whose drop is the exit barrier.
pub fn enter(options: Options) -> Session {
    let depth = DEPTH.with(|d| d.replace(d.get() + 1));
    if depth > 0 {
        // A #[distributed] function called from another: already joined.
        return Session {
            outermost: false,
            finished: Cell::new(false),
        };
    }
    let (options, overridden) = with_environment(options);
    let env = LaunchEnv::from_env().unwrap_or_else(|e| fail("reading the launch environment", e));
    if env.is_none() {
        let ranks = self_launch_ranks(&options);
        if ranks > 1 {
            std::process::exit(self_launch(ranks));
        }
    }
    let init_options = InitOptions {
        backend: options
            .backend
            .map(|b| Backend::parse(b).unwrap_or_else(|e| fail("backend", e))),
        timeout: options.timeout_secs.map(std::time::Duration::from_secs_f64),
        device: None,
    };
    record_panics();
    let ctx =
        init::init_with(init_options).unwrap_or_else(|e| fail("joining the process group", e));
    let (precision, why) =
        MixedPrecision::parse(options.mixed_precision.unwrap_or("no"), ctx.device())
            .unwrap_or_else(|e| fail("mixed_precision", e));
    PRECISION.with(|p| p.set(precision));
    if ctx.world_size() > 1 {
        // Every rank continues from rank 0's random state (initial weights, dropout):
        // a seed the program set before the function is honoured, run after run.
        // Shuffles do not rely on the ranks staying in step: sharded loops draw theirs
        // under an `AgreedSeed`.
        if let Err(e) = ctx.random_state().adopt(ctx.device()) {
            fail("sharing rank 0's random state", e)
        }
    }
    if ctx.is_main_process() {
        for line in overridden {
            crate::log::warn(line);
        }
        println!("{}", banner(&ctx, &options, precision, &why));
    }
    OPTIONS.with(|o| *o.borrow_mut() = options);
    Session {
        outermost: true,
        finished: Cell::new(false),
    }
}

/// The context's banner and what the attribute's options add: bucket cap, mixed
/// precision (what was chosen and why), accumulation and the effective batch.
fn banner(ctx: &Context, options: &Options, precision: MixedPrecision, why: &str) -> String {
    let bucket = options
        .bucket_cap_mb
        .unwrap_or(DdpOptions::default().bucket_cap_mb);
    let mut line = format!("{}, bucket cap {bucket} MiB", ctx.banner());
    if options.mixed_precision.is_some() {
        let name = match precision {
            MixedPrecision::No => "no",
            MixedPrecision::Bf16 => "bf16",
            MixedPrecision::Fp16 => "fp16 with loss scaling",
        };
        line += &format!(", mixed precision {name} ({why})");
    }
    if let Some(k) = options.grad_accum.filter(|&k| k > 1) {
        let world = ctx.world_size();
        line += &format!(
            ", gradient accumulation {k} steps (effective batch = per-rank batch × {k} × {world} rank{} = {} × per-rank batch)",
            if world == 1 { "" } else { "s" },
            k * world
        );
    }
    line
}

/// How many times a program that launches its own ranks starts them all again after
/// one fails (`tchrun --max-restarts`): `TCH_DISTRIBUTED_MAX_RESTARTS`, else none.
fn self_launch_restarts() -> usize {
    match std::env::var("TCH_DISTRIBUTED_MAX_RESTARTS") {
        Ok(v) => v.trim().parse().unwrap_or_else(|_| {
            fail(
                "TCH_DISTRIBUTED_MAX_RESTARTS",
                format!("{v:?} is not a number of restarts: set it to e.g. 3, or unset it"),
            )
        }),
        Err(_) => 0,
    }
}

fn self_launch(ranks: usize) -> i32 {
    let exe = std::env::current_exe()
        .unwrap_or_else(|e| fail("finding this program to launch its ranks", e));
    let args: Vec<std::ffi::OsString> = std::env::args_os().skip(1).collect();
    let config = crate::launch::LaunchConfig {
        nproc_per_node: ranks,
        max_restarts: self_launch_restarts(),
        launcher: crate::launch::Launcher::SelfLaunch,
        ..Default::default()
    };
    crate::log::warn(format_args!(
        "no launcher environment; starting {ranks} ranks of {}",
        exe.display()
    ));
    crate::launch::launch(&config, exe.as_os_str(), &args)
        .unwrap_or_else(|e| fail("launching ranks", e))
}

/// Guard of a `#[distributed]` function's body. `finish` runs on every normal
/// return; a panic or an early `?` skips it.
pub struct Session {
    outermost: bool,
    finished: Cell<bool>,
}

impl Session {
    /// The exit barrier: every rank waits for the others, so that all finish
    /// together. A rank whose function returned an `Err` leaves at once instead: the
    /// others may be inside a collective that it will never join, and its exit is
    /// what lets the launcher stop them. It first writes the error, as `main`
    /// prints it (`Error: {e:?}`), to the launcher's `TORCHELASTIC_ERROR_FILE` when
    /// there is one, so that torchrun and tchrun report it as the root cause.
    pub fn finish(&self, ending: Ending) {
        self.finished.set(true);
        if !self.outermost {
            return;
        }
        if ending.failed {
            let message = match ending.message {
                Some(e) => format!("Error: {e}"),
                None => "Error: the #[distributed] function returned an Err".to_string(),
            };
            crate::launch::error_file::record_error(&message);
            return;
        }
        if let Err(e) = crate::record::write_models() {
            crate::log::warn(format_args!("{e}"));
        }
        if let Some(ctx) = init::current() {
            if let Err(e) = ctx.barrier() {
                crate::log::warn(format_args!(
                    "exit barrier failed on rank {}: {e}",
                    ctx.rank()
                ));
            }
        }
    }
}

impl Drop for Session {
    /// Leaving the function without `finish`: a panic (recorded by its hook) or an
    /// early return through `?`, an error whose message `main` is about to print
    /// (recorded from there, see [`record_early_exit`](crate::launch::error_file)).
    fn drop(&mut self) {
        DEPTH.with(|d| d.set(d.get().saturating_sub(1)));
        if self.outermost && !self.finished.get() && !std::thread::panicking() {
            crate::launch::error_file::record_early_exit();
        }
    }
}

fn context() -> Context {
    init::current()
        .unwrap_or_else(|| fail("internal", "no context: the function entry did not run"))
}

/// `Device::cuda_if_available()` / `Device::Cuda(i)` → this rank's device, in place
/// of the one the single-GPU code asked for.
pub fn device(_requested: Device) -> Device {
    context().device()
}

/// `println!` and friends run on rank 0 only.
pub fn is_main_process() -> bool {
    init::current().map(|c| c.is_main_process()).unwrap_or(true)
}

/// `<config>.build(&vs, lr)`: the SDK's [`Optimizer`] (the same libtorch optimizer
/// as tch's, with its state reachable for checkpoints) over `vs`, stepping through a
/// DDP of `vs`, with the attribute's accumulation and, for fp16, a loss scaler.
pub fn build(config: &impl OptimizerKind, vs: &VarStore, lr: f64) -> Result<Optimizer, TchError> {
    let ctx = context();
    let options = OPTIONS.with(|o| o.borrow().clone());
    let defaults = DdpOptions::default();
    // As PyTorch's DDP: a `bucket_cap_mb` given explicitly also caps the first bucket.
    let ddp_options = DdpOptions {
        bucket_cap_mb: options.bucket_cap_mb.unwrap_or(defaults.bucket_cap_mb),
        first_bucket_cap_mb: options
            .bucket_cap_mb
            .unwrap_or(defaults.first_bucket_cap_mb),
        find_unused_parameters: options.find_unused_parameters,
        ..defaults
    };
    // Failing to wrap the model ends the program with the cause and the fix: returned
    // through the caller's `?`, tch's error type would print it as an "Internal torch
    // error".
    let ddp = DistributedDataParallel::new(vs, ctx.process_group(), ddp_options)
        .unwrap_or_else(|e| fail_with_source("wrapping the model in DistributedDataParallel", &e));
    crate::record::model_built(vs);
    let mut opt = Optimizer::new(config, vs, lr)
        .map_err(|e| TchError::Torch(format!("tch-distributed: building the optimizer: {e}")))?
        .distributed(ddp)
        .accumulate(options.grad_accum.unwrap_or(1));
    if PRECISION.with(Cell::get) == MixedPrecision::Fp16 {
        opt = opt.grad_scaler(GradScaler::new());
    }
    Ok(opt)
}

/// A `let` whose value comes from a forward pass, under `mixed_precision`: autocast
/// while it is evaluated.
pub fn autocast() -> Autocast {
    Autocast::enter(context().device(), PRECISION.with(Cell::get))
        .unwrap_or_else(|e| fail("autocast", e))
}

/// The optimizer's methods that return a `Result` in the SDK and nothing in tch:
/// the value, or a panic that names the call.
pub fn or_fail<T>(r: crate::Result<T>, what: &str) -> T {
    r.unwrap_or_else(|e| fail_with_source(what, &e))
}

/// The backward steps of tch's optimizer and of the SDK's (the one `build` gives),
/// with tch's signatures.
///
/// Called with method syntax (`opt.__tchd_backward_step(&loss)`), so that the receiver
/// is borrowed as the user's `opt.backward_step(&loss)` borrows it: an owned optimizer,
/// a `&mut` argument, a field, or through a `Box`.
pub trait Steps {
    fn __tchd_backward_step(&mut self, loss: &Tensor);
    fn __tchd_backward_step_clip(&mut self, loss: &Tensor, max: f64);
    fn __tchd_backward_step_clip_norm(&mut self, loss: &Tensor, max: f64);
}

/// An optimizer the function did not build (a struct field, a `&mut` argument, one a
/// helper returns): tch's steps with the gradients averaged over the ranks before the
/// update (and before clipping), and rank 0's parameters adopted at its first step
/// ([`sync_before_step`]).
impl Steps for tch::nn::Optimizer {
    fn __tchd_backward_step(&mut self, loss: &Tensor) {
        self.zero_grad();
        loss.backward();
        self.sync_before_step();
        self.step();
    }
    fn __tchd_backward_step_clip(&mut self, loss: &Tensor, max: f64) {
        self.zero_grad();
        loss.backward();
        self.sync_before_step();
        self.clip_grad_value(max);
        self.step();
    }
    fn __tchd_backward_step_clip_norm(&mut self, loss: &Tensor, max: f64) {
        self.zero_grad();
        loss.backward();
        self.sync_before_step();
        self.clip_grad_norm(max);
        self.step();
    }
}

impl Steps for Optimizer {
    fn __tchd_backward_step(&mut self, loss: &Tensor) {
        self.attribute_backward_step(loss, |_| Ok(()), "backward_step");
    }
    fn __tchd_backward_step_clip(&mut self, loss: &Tensor, max: f64) {
        self.attribute_backward_step(loss, |o| o.clip_grad_value(max), "backward_step_clip");
    }
    fn __tchd_backward_step_clip_norm(&mut self, loss: &Tensor, max: f64) {
        self.attribute_backward_step(
            loss,
            |o| o.clip_grad_norm(max).map(drop),
            "backward_step_clip_norm",
        );
    }
}

impl Optimizer {
    /// The SDK optimizer's backward step under the attribute: as
    /// [`Optimizer::backward_step`], and, when it steps through no DDP (built outside
    /// the function), with the gradients averaged before `before_step`.
    fn attribute_backward_step(
        &mut self,
        loss: &Tensor,
        before_step: impl FnOnce(&mut Optimizer) -> crate::Result<()>,
        what: &str,
    ) {
        or_fail(self.zero_grad(), what);
        if or_fail(Optimizer::backward(self, loss), what) {
            self.sync_before_step();
            or_fail(before_step(self), what);
            or_fail(self.step(), what);
        }
    }
}

/// An optimizer whose gradients the function must average itself before it steps:
/// tch's, and the SDK's when it steps through no DDP. Behind references and boxes
/// too, so that `opt.step()` is found whatever holds the optimizer.
pub trait SyncBeforeStep {
    /// On several ranks: adopts rank 0's parameters the first time (as DDP does when
    /// it is built), then averages the gradients over the ranks. Nothing in a world of
    /// one, or for an SDK optimizer with a DDP (which averaged them during backward).
    fn sync_before_step(&self);
}

impl SyncBeforeStep for tch::nn::Optimizer {
    fn sync_before_step(&self) {
        average_gradients(&self.trainable_variables());
    }
}

impl SyncBeforeStep for Optimizer {
    fn sync_before_step(&self) {
        if self.ddp().is_none() {
            average_gradients(&self.trainable_variables());
        }
    }
}

impl<T: SyncBeforeStep + ?Sized> SyncBeforeStep for &T {
    fn sync_before_step(&self) {
        (**self).sync_before_step()
    }
}

impl<T: SyncBeforeStep + ?Sized> SyncBeforeStep for &mut T {
    fn sync_before_step(&self) {
        (**self).sync_before_step()
    }
}

impl<T: SyncBeforeStep + ?Sized> SyncBeforeStep for Box<T> {
    fn sync_before_step(&self) {
        (**self).sync_before_step()
    }
}

/// `opt.step()` in the function: averages the gradients first when `opt` is an
/// optimizer that [`SyncBeforeStep`] knows, does nothing for anything else (an LR
/// scheduler's `step`, a progress counter's).
pub trait StepKnown {
    fn __tchd_before_step(&self);
}
pub trait StepOther {
    fn __tchd_before_step(&self);
}
impl<T: SyncBeforeStep + ?Sized> StepKnown for Probe<&T> {
    fn __tchd_before_step(&self) {
        self.take().sync_before_step()
    }
}
impl<T> StepOther for &Probe<T> {
    fn __tchd_before_step(&self) {}
}

thread_local! {
    /// The optimizers (by their first variable's storage) whose parameters were made
    /// rank 0's already.
    static ADOPTED: RefCell<std::collections::HashSet<usize>> = RefCell::default();
}

/// Averages the gradients of `variables` over the ranks (one all-reduce per device and
/// dtype, of the gradients flattened into one buffer); the first time for these
/// variables, first broadcasts rank 0's values of them. Ends the program with an
/// `Error:` line naming the fix when the ranks do not have gradients for the same
/// variables (a layer that some ranks did not use), or when a collective fails.
fn average_gradients(variables: &[Tensor]) {
    let Some(ctx) = init::current().filter(|c| c.world_size() > 1) else {
        return;
    };
    let what = "averaging the gradients of an optimizer the function did not build";
    let pg = ctx.process_group();
    let key = variables.first().map_or(0, |v| v.data_ptr() as usize);
    if ADOPTED.with(|a| a.borrow_mut().insert(key)) {
        or_fail(pg.broadcast_coalesced(variables, 1 << 20, 0), what);
        crate::record::optimizer_stepped(variables);
    }
    let defined: Vec<i64> = variables
        .iter()
        .map(|v| v.grad().defined() as i64)
        .collect();
    let mut agreed = Tensor::from_slice(&defined);
    let mut all = agreed.copy();
    or_fail(pg.all_reduce(&mut agreed, crate::ReduceOp::Min), what);
    or_fail(pg.all_reduce(&mut all, crate::ReduceOp::Max), what);
    if !agreed.equal(&all) {
        let i = Vec::<i64>::try_from(&(all - &agreed))
            .unwrap_or_default()
            .iter()
            .position(|d| *d != 0)
            .unwrap_or(0);
        fail(
            what,
            format!(
                "variable {i} of the optimizer has a gradient on some ranks and none on \
                 others (a layer not used on every rank): use every layer in every \
                 step, or build the optimizer inside the function, whose DDP handles it \
                 (find_unused_parameters = true)"
            ),
        );
    }
    tch::no_grad(|| {
        let mut groups: Vec<Vec<Tensor>> = Vec::new();
        for g in variables.iter().map(Tensor::grad).filter(Tensor::defined) {
            match groups
                .iter_mut()
                .find(|group| group[0].device() == g.device() && group[0].kind() == g.kind())
            {
                Some(group) => group.push(g),
                None => groups.push(vec![g]),
            }
        }
        for grads in groups {
            let flat: Vec<Tensor> = grads.iter().map(|g| g.reshape([-1])).collect();
            let mut buffer = Tensor::cat(&flat, 0);
            or_fail(pg.all_reduce(&mut buffer, crate::ReduceOp::Avg), what);
            let mut offset = 0;
            for mut g in grads {
                let n = g.numel() as i64;
                g.copy_(&buffer.narrow(0, offset, n).view_as(&g));
                offset += n;
            }
        }
    });
}

/// `loss.backward()` in a function that built one optimizer: through it, so that the
/// gradients are averaged (and accumulated, and scaled) as its steps expect.
pub fn backward(opt: &mut Optimizer, loss: &Tensor) {
    or_fail(opt.backward(loss), "backward");
}

/// `vs.save(path)` on a `VarStore`: rank 0 writes atomically between barriers.
pub fn save(vs: &VarStore, path: impl AsRef<Path>) -> Result<(), TchError> {
    crate::checkpoint::save_var_store(&context(), vs, path)
        .map_err(|e| TchError::Torch(e.to_string()))
}

/// `vs.load(path)` on a `VarStore`: every rank loads after a barrier.
pub fn load(vs: &mut VarStore, path: impl AsRef<Path>) -> Result<(), TchError> {
    crate::checkpoint::load_var_store(&context(), vs, path)
        .map_err(|e| TchError::Torch(e.to_string()))
}

/// Type-directed dispatch for the rewrites that must leave other types alone
/// ("autoref specialization"): `(&Probe::new(x)).method()` resolves to the impl on
/// `Probe<Known>` when `x: Known`, else to the fallback on `&Probe<T>`.
pub struct Probe<T>(Cell<Option<T>>);

impl<T> Probe<T> {
    pub fn new(value: T) -> Self {
        Probe(Cell::new(Some(value)))
    }
    fn take(&self) -> T {
        self.0.take().expect("probe used once")
    }
}

/// Loops over the data iterators tch users write: each rank gets its own batches.
pub trait ShardKnown {
    type Iter;
    fn __tchd_iter(&self) -> Self::Iter;
}
/// Loops over anything else: untouched.
pub trait ShardOther {
    type Iter;
    fn __tchd_iter(&self) -> Self::Iter;
}

/// The head of a `for` loop: its iterator expression is evaluated while this lives,
/// under an [`AgreedSeed`] made from the loop (`site`, fixed by the macro), how many
/// times it has started (`runs`, one counter per loop) and the seed libtorch was last
/// seeded with, so a shuffle drawn there is the same on every rank. Dropped once the
/// loop's iterator exists; a sharded loop then checks that every rank starts from the
/// same batch.
pub struct LoopHead {
    site: u64,
    run: u64,
    _agreed: AgreedSeed,
}

/// Enters the head of loop `site`; see [`LoopHead`].
pub fn loop_head(site: u64, runs: &AtomicU64) -> LoopHead {
    let run = runs.fetch_add(1, Ordering::Relaxed);
    // The seed libtorch was last seeded with (rank 0's, adopted at entry, or one the
    // function set alike on every rank since): a program that seeds inside the
    // function gets the same shuffles run after run. Drawing numbers leaves it alone.
    let seeded = crate::rng::current_seed(-1)
        .unwrap_or_else(|e| fail("reading the random generator's seed", e));
    let agreed = AgreedSeed::seeded(crate::rng::mix(crate::rng::mix(site) ^ run ^ seeded))
        .unwrap_or_else(|e| fail("agreeing on the loop's shuffle", e));
    LoopHead {
        site,
        run,
        _agreed: agreed,
    }
}

impl LoopHead {
    fn shard<I: Iterator>(self, iter: I) -> Sharded<I>
    where
        I::Item: crate::record::Samples,
    {
        Sharded::new(iter)
            .with_progress(Some(self.run))
            .recording(crate::record::Recording::start(self.site, self.run))
            .check_same_start(<I::Item as crate::record::Samples>::samples)
            .unwrap_or_else(|e| fail("starting a sharded loop", e))
    }
}

impl ShardKnown for Probe<(LoopHead, tch::data::TextDataIter)> {
    type Iter = Sharded<tch::data::TextDataIter>;
    fn __tchd_iter(&self) -> Self::Iter {
        let (head, iter) = self.take();
        head.shard(iter)
    }
}
impl ShardKnown for Probe<(LoopHead, tch::data::Iter2)> {
    type Iter = Sharded<tch::data::Iter2>;
    fn __tchd_iter(&self) -> Self::Iter {
        let (head, iter) = self.take();
        head.shard(iter)
    }
}
impl<'a> ShardKnown for Probe<(LoopHead, &'a mut tch::data::Iter2)> {
    type Iter = Sharded<&'a mut tch::data::Iter2>;
    fn __tchd_iter(&self) -> Self::Iter {
        let (head, iter) = self.take();
        head.shard(iter)
    }
}
impl<T> ShardOther for &Probe<(LoopHead, T)> {
    type Iter = T;
    fn __tchd_iter(&self) -> T {
        self.take().1
    }
}

/// How the function ended: whether it returned an `Err`, and the error as `main`
/// prints it (`Debug`) when its type can say it.
pub struct Ending {
    failed: bool,
    message: Option<String>,
}

/// Whether the function's return value is an `Err`, with its message. The macro
/// calls `(&Probe::new(&out)).__tchd_failed()`; method lookup tries the receiver
/// `&Probe<_>` (a `Result` whose error is `Debug`: failed, with the message), then
/// `&&Probe<_>` (a `Result` with another error type: failed), then `&mut &Probe<_>`
/// (anything else: not a failure). Where the error type is still to be inferred at
/// the function's end (its last expression is `Ok(…)`), the first applies, so the
/// error type must be `Debug`, as `main`'s must; a function whose error type is
/// not `Debug` names it there (`Ok::<_, E>(…)`) and is reported without the message.
pub trait ExitKnown {
    fn __tchd_failed(self) -> Ending;
}
pub trait ExitOther {
    fn __tchd_failed(self) -> Ending;
}
impl<T, E: std::fmt::Debug> ExitKnown for &Probe<&Result<T, E>> {
    fn __tchd_failed(self) -> Ending {
        let message = self.take().as_ref().err().map(|e| format!("{e:?}"));
        Ending {
            failed: message.is_some(),
            message,
        }
    }
}
impl<T, E> ExitOther for &&Probe<&Result<T, E>> {
    fn __tchd_failed(self) -> Ending {
        Ending {
            failed: self.take().is_err(),
            message: None,
        }
    }
}
impl<T> ExitOther for &mut &Probe<T> {
    fn __tchd_failed(self) -> Ending {
        Ending {
            failed: false,
            message: None,
        }
    }
}

/// The `VarStore` behind `vs.save(…)`'s receiver, if it is one.
pub trait VarStoreRefKnown<'a> {
    fn __tchd_var_store(&self) -> Option<&'a VarStore>;
}
pub trait VarStoreRefOther<'a> {
    fn __tchd_var_store(&self) -> Option<&'a VarStore>;
}
impl<'a> VarStoreRefKnown<'a> for Probe<&'a VarStore> {
    fn __tchd_var_store(&self) -> Option<&'a VarStore> {
        Some(self.take())
    }
}
impl<'a, 'b: 'a> VarStoreRefKnown<'a> for Probe<&'a &'b VarStore> {
    fn __tchd_var_store(&self) -> Option<&'a VarStore> {
        Some(*self.take())
    }
}
impl<'a, T> VarStoreRefOther<'a> for &Probe<T> {
    fn __tchd_var_store(&self) -> Option<&'a VarStore> {
        None
    }
}

/// The `VarStore` behind `vs.load(…)`'s receiver, if it is one.
pub trait VarStoreMutKnown<'a> {
    fn __tchd_var_store_mut(&self) -> Option<&'a mut VarStore>;
}
pub trait VarStoreMutOther<'a> {
    fn __tchd_var_store_mut(&self) -> Option<&'a mut VarStore>;
}
impl<'a> VarStoreMutKnown<'a> for Probe<&'a mut VarStore> {
    fn __tchd_var_store_mut(&self) -> Option<&'a mut VarStore> {
        Some(self.take())
    }
}
impl<'a, T> VarStoreMutOther<'a> for &Probe<T> {
    fn __tchd_var_store_mut(&self) -> Option<&'a mut VarStore> {
        None
    }
}

/// Inside a `#[distributed]` function: the attribute's options (after the environment's
/// overrides) and the mixed precision chosen, for the run's recorded configuration.
pub(crate) fn attribute_settings() -> Option<(Options, MixedPrecision)> {
    (DEPTH.with(Cell::get) > 0).then(|| {
        (
            OPTIONS.with(|o| o.borrow().clone()),
            PRECISION.with(Cell::get),
        )
    })
}
