//! The function's entry and exit: joining the job (or launching its ranks) with the
//! run's settings (the environment's over the attribute's, [`Settings::over_attribute`]),
//! the banner, the exit barrier.

use std::cell::Cell;

use crate::amp::MixedPrecision;
use crate::ddp::DdpOptions;
use crate::env::LaunchEnv;
use crate::init::{self, Context};
use crate::settings::Settings;

use super::fail;
use super::probes::Ending;

thread_local! {
    /// How many `#[distributed]` functions this thread is inside: only the outermost
    /// joins and leaves.
    static DEPTH: Cell<usize> = const { Cell::new(0) };
}

/// Under a launcher that asks for an error file (`TORCHELASTIC_ERROR_FILE`), a panic
/// writes its message there too, with the backtrace when `RUST_BACKTRACE` asks for
/// one, before the default report; installed once, at the outermost entry.
fn record_panics() {
    static ONCE: std::sync::Once = std::sync::Once::new();
    if crate::protocol::error_file().is_none() {
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

/// Function entry: joins the job (or, with no launcher and more than one rank
/// asked for, launches the ranks and exits with their result), then prints the
/// banner on rank 0. Returns a guard whose drop is the exit barrier. `attribute` is
/// the settings written in `#[distributed(…)]`, `(key, value as text)`, read by
/// `Settings::from_attribute` (as the macro checked them).
pub fn enter(attribute: &[(&str, &str)]) -> Session {
    let depth = DEPTH.with(|d| d.replace(d.get() + 1));
    if depth > 0 {
        // A #[distributed] function called from another: already joined.
        return Session {
            outermost: false,
            finished: Cell::new(false),
        };
    }
    // Checked when the attribute was expanded, by the same rows.
    let attribute = Settings::from_attribute(attribute.iter().copied())
        .unwrap_or_else(|e| fail("reading the attribute's settings", e));
    let (settings, overridden) = Settings::over_attribute(attribute)
        .unwrap_or_else(|e| fail("reading the run's settings", e));
    // The DeepSpeed file's settings, where `deepspeed` names one: checked before any
    // rank starts.
    let (settings, deepspeed) = settings
        .with_deepspeed()
        .unwrap_or_else(|e| fail("reading the run's settings", e));
    let env = LaunchEnv::from_env().unwrap_or_else(|e| fail("reading the launch environment", e));
    if env.is_none() {
        // Without a launcher: the ranks asked for, else one per visible GPU
        // (`CUDA_VISIBLE_DEVICES` applies), else one process.
        let ranks = settings
            .nproc_per_node
            .unwrap_or_else(|| crate::devices::visible_gpus().max(1));
        if ranks > 1 {
            std::process::exit(self_launch(ranks, &settings));
        }
    }
    if let Some(joined) = init::current() {
        // A second function, after the first returned: the job is joined already.
        let conflicts = settings.conflicts(joined.settings());
        if !conflicts.is_empty() {
            let list: Vec<String> = conflicts
                .iter()
                .map(|(key, given, was)| format!("{key} = {given} (the job's: {was})"))
                .collect();
            fail(
                "entering a second #[distributed] function",
                crate::Error::Usage(format!(
                    "it asks for {}, but this process joined its job with the first \
                     function's settings, and a process runs one job with one set of \
                     settings (as Accelerate's AcceleratorState). Give the functions the \
                     same settings, leave them out of the later ones, or run each in a \
                     process of its own",
                    list.join(", ")
                )),
            )
        }
    }
    record_panics();
    let ctx = init::init_with_settings(settings, deepspeed, None)
        .unwrap_or_else(|e| fail("joining the process group", e));
    if ctx.world_size() > 1 {
        // Every rank continues from rank 0's random state (initial weights, dropout):
        // a seed the program set before the function is honoured, run after run.
        // Shuffles do not rely on the ranks staying in step: sharded loops draw theirs
        // under an `AgreedSeed`.
        if let Err(e) = ctx.random_state().adopt(ctx.device()) {
            fail("sharing rank 0's random state", e)
        }
    }
    // Once a run: a program may enter several functions, or the methods of an
    // `impl` block under the attribute, one after the other.
    if ctx.is_main_process() && ctx.first_banner() {
        for line in overridden {
            crate::log::warn(line);
        }
        println!("{}", banner(&ctx));
    }
    Session {
        outermost: true,
        finished: Cell::new(false),
    }
}

/// The context's banner and what the run's settings add: bucket cap, mixed
/// precision (what was chosen and why), ZeRO, accumulation and the effective batch.
fn banner(ctx: &Context) -> String {
    let settings = ctx.settings();
    let bucket = settings
        .bucket_cap_mb
        .unwrap_or(DdpOptions::default().bucket_cap_mb);
    let mut line = format!("{}, bucket cap {bucket} MiB", ctx.banner());
    if settings.mixed_precision.is_some() {
        let (precision, why) = (ctx.mixed_precision(), ctx.precision_why());
        let name = match precision {
            MixedPrecision::No => "no",
            MixedPrecision::Bf16 => "bf16",
            MixedPrecision::Fp16 => "fp16 with loss scaling",
        };
        line += &format!(", mixed precision {name} ({why})");
    }
    if let Some(stage) = settings.zero.filter(|&s| s > 0 && ctx.world_size() > 1) {
        let what = match stage {
            1 => "optimizer state",
            2 => "optimizer state and gradients",
            _ => "optimizer state, gradients and parameters",
        };
        line += &match (stage, ctx.mesh()) {
            (2 | 3, Some(mesh)) => format!(
                ", ZeRO stage {stage} ({what} sharded over {} ranks, replicated {} times: \
                 hybrid sharding)",
                mesh.shard.world_size(),
                mesh.replicate.world_size()
            ),
            _ => format!(
                ", ZeRO stage {stage} ({what} sharded over {} ranks)",
                ctx.world_size()
            ),
        };
    }
    if let Some(ds) = ctx.deepspeed() {
        line += &format!(", DeepSpeed configuration {}", ds.path.display());
    }
    if let Some(offload) = settings
        .offload
        .and_then(|o| crate::shard::offload::banner(o, ctx.device()))
    {
        line += &format!(", {offload}");
    }
    if let Some(k) = settings.grad_accum.filter(|&k| k > 1) {
        let world = ctx.world_size();
        line += &format!(
            ", gradient accumulation {k} steps (effective batch = per-rank batch × {k} × {world} rank{} = {} × per-rank batch)",
            if world == 1 { "" } else { "s" },
            k * world
        );
    }
    line
}

/// Starts `ranks` ranks of this program through the launcher behind `tchrun`, with the
/// launcher's settings (`max_restarts`, `all_ranks_stdout`, `rank_prefix`), and returns the exit code
/// to exit with.
fn self_launch(ranks: usize, settings: &Settings) -> i32 {
    let exe = std::env::current_exe()
        .unwrap_or_else(|e| fail("finding this program to launch its ranks", e));
    let args: Vec<std::ffi::OsString> = std::env::args_os().skip(1).collect();
    let config = crate::launch::LaunchConfig {
        nproc_per_node: ranks,
        max_restarts: settings.max_restarts.unwrap_or(0),
        all_ranks_stdout: settings.all_ranks_stdout.unwrap_or(false),
        rank_prefix: settings.rank_prefix.unwrap_or(false),
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
        let ctx = init::current();
        // The model leaves whole (as FSDP2's `full_tensor()`): every variable that ZeRO
        // stage 3 sharded is gathered for good, on every rank.
        if let Some(ctx) = &ctx {
            if let Err(e) = ctx.units().make_whole() {
                crate::log::warn(format_args!(
                    "gathering the sharded variables at the function's return failed on rank \
                     {}: they stay sharded, and reading one is an error: {e}",
                    ctx.rank()
                ));
            }
        }
        if let Err(e) = crate::record::write_models() {
            crate::log::warn(format_args!("{e}"));
        }
        if let Some(ctx) = ctx {
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
