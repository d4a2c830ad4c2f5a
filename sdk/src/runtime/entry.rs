//! The function's entry and exit: joining the job (or launching its ranks), the
//! attribute's options with the environment over them, the banner, the exit barrier.

use std::cell::{Cell, RefCell};

use crate::amp::{MixedPrecision, MixedPrecisionMode};
use crate::ddp::DdpOptions;
use crate::env::LaunchEnv;
use crate::init::{self, Context, InitOptions};
use crate::optim::Implementation;
use crate::process_group::Backend;

use super::fail;
use super::probes::Ending;

/// The attribute's options, parsed and validated by the macro, which writes them as
/// typed values: nothing of the attribute is parsed again at run time.
#[derive(Clone, Debug, Default)]
pub struct Options {
    pub backend: Option<Backend>,
    pub nproc_per_node: Option<usize>,
    pub bucket_cap_mb: Option<f64>,
    pub find_unused_parameters: bool,
    pub timeout_secs: Option<f64>,
    pub mixed_precision: Option<MixedPrecisionMode>,
    pub grad_accum: Option<usize>,
    pub optimizer: Option<Implementation>,
    /// The ZeRO stage (1); `Some(0)` from the environment turns it off.
    pub zero: Option<u8>,
}

thread_local! {
    static OPTIONS: RefCell<Options> = RefCell::new(Options::default());
    static PRECISION: Cell<MixedPrecision> = const { Cell::new(MixedPrecision::No) };
    static DEPTH: Cell<usize> = const { Cell::new(0) };
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

/// The line rank 0 prints when a variable replaced a value written in the attribute.
fn overrides(name: &str, value: &str, option: &str, written: &str) -> String {
    format!(
        "{name}={value} overrides the attribute's {option} = {written} (set by tchrun's \
         flag or configuration file, or in the environment)"
    )
}

/// How many ranks to start when the program runs without a launcher:
/// `TCH_DISTRIBUTED_NPROC` wins over the attribute's `nproc_per_node` (and says so);
/// without either, one per visible GPU (`CUDA_VISIBLE_DEVICES` applies), else one
/// process.
fn self_launch_ranks(options: &Options) -> usize {
    use crate::config::NPROC_ENV;
    match std::env::var(NPROC_ENV) {
        Ok(v) => match v.trim().parse::<usize>() {
            Ok(n) if n > 0 => {
                if let Some(written) = options.nproc_per_node.filter(|&w| w != n) {
                    crate::log::warn(overrides(
                        NPROC_ENV,
                        &n.to_string(),
                        "nproc_per_node",
                        &written.to_string(),
                    ));
                }
                n
            }
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
/// `TCH_DISTRIBUTED_MIXED_PRECISION`, `TCH_DISTRIBUTED_GRAD_ACCUM` and
/// `TCH_DISTRIBUTED_OPTIMIZER` win over the attribute's `backend`, `timeout`,
/// `mixed_precision`, `grad_accum` and `optimizer`
/// (`TCH_DISTRIBUTED_NPROC` over `nproc_per_node`: [`self_launch_ranks`]). A variable
/// set to the empty string counts as unset. Also returns one line for each value
/// written in the attribute that a variable replaced, for rank 0 to print.
fn with_environment(mut options: Options) -> (Options, Vec<String>) {
    use crate::config::{
        BACKEND_ENV, GRAD_ACCUM_ENV, MIXED_PRECISION_ENV, OPTIMIZER_ENV, ZERO_ENV,
    };
    let var = |name: &str| {
        std::env::var(name)
            .ok()
            .map(|v| v.trim().to_ascii_lowercase())
            .filter(|v| !v.is_empty())
    };
    let mut overridden = Vec::new();
    let mut note = |name: &str, value: &str, option: &str, written: String| {
        overridden.push(overrides(name, value, option, &written));
    };
    // Joining reads these two itself, and names a bad value, when the attribute
    // gives none.
    if let Some(b) = var(BACKEND_ENV) {
        if let Some(written) = options.backend.take() {
            note(BACKEND_ENV, &b, "backend", format!("\"{written}\""));
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
        match mp.parse::<MixedPrecisionMode>() {
            Ok(m) => {
                if let Some(written) = options.mixed_precision.replace(m) {
                    note(
                        MIXED_PRECISION_ENV,
                        &mp,
                        "mixed_precision",
                        format!("\"{written}\""),
                    );
                }
            }
            Err(_) => fail(
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
    if let Some(o) = var(OPTIMIZER_ENV) {
        match o.parse::<Implementation>() {
            Ok(i) => {
                if let Some(written) = options.optimizer.replace(i) {
                    note(OPTIMIZER_ENV, &o, "optimizer", format!("\"{written}\""));
                }
            }
            Err(_) => fail(
                OPTIMIZER_ENV,
                format!("{o:?} is not an optimizer implementation: use fused, foreach or tch, or unset it"),
            ),
        }
    }
    if let Some(z) = var(ZERO_ENV) {
        match z.parse::<u8>() {
            Ok(stage @ (0 | 1)) => {
                if let Some(written) = options.zero.replace(stage) {
                    note(ZERO_ENV, &z, "zero", written.to_string());
                }
            }
            _ => fail(
                ZERO_ENV,
                format!("{z:?} is not a ZeRO stage: use 1 (optimizer-state sharding) or 0 (off), or unset it"),
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
        backend: options.backend,
        timeout: options.timeout_secs.map(std::time::Duration::from_secs_f64),
        device: None,
    };
    record_panics();
    let ctx =
        init::init_with(init_options).unwrap_or_else(|e| fail("joining the process group", e));
    let (precision, why) = (options.mixed_precision)
        .unwrap_or(MixedPrecisionMode::Exactly(MixedPrecision::No))
        .resolve(ctx.device())
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
    if options.zero == Some(1) && ctx.world_size() > 1 {
        line += &format!(
            ", ZeRO stage 1 (optimizer state sharded over {} ranks)",
            ctx.world_size()
        );
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

/// Inside a `#[distributed]` function: the attribute's options (after the environment's
/// overrides) and the mixed precision chosen, for the run's recorded configuration.
pub(crate) fn attribute_settings() -> Option<(Options, MixedPrecision)> {
    (DEPTH.with(Cell::get) > 0).then(|| (options(), precision()))
}

/// The attribute's options after the environment's overrides, as the function's entry
/// settled them (the defaults outside a `#[distributed]` function).
pub(crate) fn options() -> Options {
    OPTIONS.with(|o| o.borrow().clone())
}

/// The mixed precision the function's entry chose.
pub(crate) fn precision() -> MixedPrecision {
    PRECISION.with(Cell::get)
}
