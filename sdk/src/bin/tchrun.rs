//! `tchrun`: starts and supervises the ranks of a data-parallel training
//! program on one node, like PyTorch's `torchrun`.
//!
//! ```text
//! tchrun --nproc-per-node 4 -- ./train --epochs 10
//! ```

use std::ffi::OsString;
use std::process::ExitCode;
use std::time::Duration;

use std::io::IsTerminal;
use std::path::PathBuf;

use clap::{Parser, Subcommand};
use tch_distributed::launch::{launch_with_env, LaunchConfig, Launcher};
use tch_distributed::settings::{default_path, Settings};

/// What `tchrun --help` says after the options: where settings come from.
const SETTINGS_HELP: &str = "\
Settings: each flag marked [env: ...] comes from the flag, else its environment variable
(named in brackets), else the configuration file (its key is the flag's name with
underscores), else the program's #[distributed(...)] option of that name, else the
default. tchrun hands the result to every rank as those variables.

Configuration file: --config FILE, else $TCH_DISTRIBUTED_CONFIG, else
$XDG_CONFIG_HOME/tch-distributed/config.toml, else ~/.config/tch-distributed/config.toml
(when it exists). `tchrun config` writes it, asking a few questions or from flags.";

/// Runs a data-parallel training program, one process per rank, like torchrun.
///
/// Starts PROGRAM once per rank with the torchrun environment (RANK,
/// LOCAL_RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT, ...) and supervises the
/// ranks: when one fails the others are stopped and tchrun exits with 1, or,
/// with --max-restarts, all are started again; SIGINT/SIGTERM are forwarded to
/// the ranks; if tchrun dies, its ranks are killed. It shows rank 0's standard
/// output (every rank's with --all-ranks-stdout) and every rank's standard error,
/// line by line, each line whole (after `[rank N]` with --rank-prefix).
#[derive(Debug, Parser)]
#[command(
    name = "tchrun",
    version,
    override_usage = "tchrun [OPTIONS] [--] PROGRAM [ARGS]...\n       tchrun config [OPTIONS]\n       tchrun env\n       tchrun test [OPTIONS]",
    args_conflicts_with_subcommands = true,
    disable_help_subcommand = true,
    after_help = SETTINGS_HELP
)]
struct Args {
    #[command(subcommand)]
    subcommand: Option<Sub>,

    #[command(flatten)]
    settings: Settings,

    /// The run configuration file to read (see Configuration file below); a .yaml,
    /// .yml or .json file is Accelerate's (`accelerate config`'s default_config.yaml).
    #[arg(
        long,
        value_name = "FILE",
        visible_alias = "config-file",
        alias = "config_file"
    )]
    config: Option<PathBuf>,

    /// Seconds ranks get to exit after SIGTERM before they are killed.
    #[arg(long, value_name = "SECONDS", default_value_t = 5.0)]
    stop_grace_seconds: f64,

    /// The program to run and its arguments, taken verbatim.
    #[arg(
        value_name = "PROGRAM_AND_ARGS",
        trailing_var_arg = true,
        allow_hyphen_values = true
    )]
    command: Vec<OsString>,
}

fn main() -> ExitCode {
    let args = Args::parse();
    match args.subcommand {
        Some(Sub::Config(config_args)) => return write_config(config_args),
        Some(Sub::Env) => return env_report(),
        Some(Sub::Test(test_args)) => return self_test(test_args, args.stop_grace_seconds),
        None => {}
    }
    let run = match resolve(&args.settings, args.config.clone()) {
        Ok(run) => run,
        Err(err) => {
            tch_distributed::eprintln_whole!("tchrun: {err}");
            return ExitCode::from(2);
        }
    };
    let Some(config) = launch_config(&run, args.stop_grace_seconds) else {
        return ExitCode::from(2);
    };
    let (program, rest) = match args.command.split_first() {
        Some((program, rest)) => (program.clone(), rest),
        None => (OsString::new(), &[][..]),
    };
    match launch_with_env(&config, &program, rest, &run.rank_env()) {
        Ok(code) => ExitCode::from(u8::try_from(code).unwrap_or(1)),
        Err(err) => {
            tch_distributed::eprintln_whole!("tchrun: {err}");
            ExitCode::from(1)
        }
    }
}

#[derive(Debug, Subcommand)]
enum Sub {
    /// Writes a run configuration file for tchrun, as `accelerate config`: asks a few
    /// questions on a terminal, or takes the settings from flags (with flags, --yes, or
    /// when stdin is not a terminal, it asks nothing and writes exactly the settings
    /// given; the variables named in brackets do not apply here).
    Config(ConfigArgs),
    /// Prints what to paste into a bug report, as `accelerate env`: the versions of
    /// tch-distributed, tch, libtorch, CUDA, cuDNN and NCCL, the backends compiled in,
    /// the GPUs (compute capability, memory), the OS and Rust versions, and the
    /// launch, SDK and library variables that are set (secrets shown as "(set)").
    Env,
    /// Checks that a job works here, as `accelerate test`: starts the ranks (with the
    /// same settings as a run: --nproc-per-node, --backend, --gpus, ...) of a built-in
    /// check of every collective on the job's backend, a TCP store, and one DDP step
    /// against one process; rank 0 prints a line per check and the verdict. Exits 1
    /// when a check failed.
    Test(TestArgs),
}

#[derive(Debug, clap::Args)]
struct TestArgs {
    #[command(flatten)]
    settings: Settings,

    /// The run configuration file to read.
    #[arg(long, value_name = "FILE")]
    config: Option<PathBuf>,

    /// Run as one of the ranks (what `tchrun test` starts).
    #[arg(long, hide = true)]
    as_rank: bool,
}

/// How to launch the ranks of `run`: its settings, else the defaults. `None` (after
/// saying why) when `stop_grace_seconds` is not a duration.
fn launch_config(run: &Settings, stop_grace_seconds: f64) -> Option<LaunchConfig> {
    let defaults = LaunchConfig::default();
    let Ok(stop_grace) = Duration::try_from_secs_f64(stop_grace_seconds) else {
        tch_distributed::eprintln_whole!(
            "tchrun: --stop-grace-seconds must be a non-negative number of seconds"
        );
        return None;
    };
    Some(LaunchConfig {
        nproc_per_node: run.nproc_or_default(),
        nnodes: run.nnodes.unwrap_or(defaults.nnodes),
        node_rank: run.node_rank.unwrap_or(defaults.node_rank),
        master_addr: run
            .master_addr
            .clone()
            .unwrap_or(defaults.master_addr.clone()),
        master_port: run.master_port.unwrap_or(defaults.master_port),
        stop_grace,
        max_restarts: run.max_restarts.unwrap_or(defaults.max_restarts),
        all_ranks_stdout: run.all_ranks_stdout.unwrap_or(defaults.all_ranks_stdout),
        rank_prefix: run.rank_prefix.unwrap_or(defaults.rank_prefix),
        launcher: Launcher::Tchrun,
    })
}

/// `tchrun test`: starts the ranks of the built-in check (this binary again, as
/// `tchrun test --as-rank`), with the run's settings; or, as a rank, runs it.
fn self_test(args: TestArgs, stop_grace_seconds: f64) -> ExitCode {
    if args.as_rank {
        return match tch_distributed::rank_check() {
            Ok(true) => ExitCode::SUCCESS,
            Ok(false) => ExitCode::from(1),
            Err(err) => {
                tch_distributed::eprintln_whole!("Error: tchrun test: {err}");
                ExitCode::from(1)
            }
        };
    }
    let run = match resolve(&args.settings, args.config) {
        Ok(run) => run,
        Err(err) => {
            tch_distributed::eprintln_whole!("tchrun test: {err}");
            return ExitCode::from(2);
        }
    };
    let Some(config) = launch_config(&run, stop_grace_seconds) else {
        return ExitCode::from(2);
    };
    let me = match std::env::current_exe() {
        Ok(me) => me,
        Err(err) => {
            tch_distributed::eprintln_whole!("tchrun test: cannot find tchrun itself: {err}");
            return ExitCode::from(1);
        }
    };
    let rest = [OsString::from("test"), OsString::from("--as-rank")];
    match launch_with_env(&config, me.as_os_str(), &rest, &run.rank_env()) {
        Ok(code) => ExitCode::from(u8::try_from(code).unwrap_or(1)),
        Err(err) => {
            tch_distributed::eprintln_whole!("tchrun test: {err}");
            ExitCode::from(1)
        }
    }
}

/// `tchrun env`: the report on stdout.
fn env_report() -> ExitCode {
    match tch_distributed::launch::env_report() {
        Ok(report) => {
            print!("{report}");
            ExitCode::SUCCESS
        }
        Err(err) => {
            tch_distributed::eprintln_whole!("tchrun env: {err}");
            ExitCode::from(1)
        }
    }
}

#[derive(Debug, clap::Args)]
struct ConfigArgs {
    #[command(flatten)]
    settings: Settings,

    /// Where to write it [default: $TCH_DISTRIBUTED_CONFIG, else
    /// $XDG_CONFIG_HOME/tch-distributed/config.toml, else
    /// ~/.config/tch-distributed/config.toml].
    #[arg(long, value_name = "FILE")]
    config: Option<PathBuf>,

    /// Ask nothing: write the settings given as flags (none: an empty configuration).
    #[arg(long, short)]
    yes: bool,
}

/// The run's settings: the flags, else the environment, else the configuration file.
fn resolve(flags: &Settings, config: Option<PathBuf>) -> tch_distributed::Result<Settings> {
    let env = Settings::from_env()?;
    // A file named by --config or TCH_DISTRIBUTED_CONFIG must exist; the default one
    // is read when it does.
    let named = config.is_some() || tch_distributed::settings::config_named_by_env();
    let file = match config.or_else(default_path) {
        Some(path) if named || path.exists() => {
            let (file, advisory) = Settings::load_run_file(&path)?;
            tch_distributed::eprintln_whole!("tchrun: run configuration {}", path.display());
            if !advisory.is_empty() {
                tch_distributed::eprintln_whole!(
                    "tchrun: these keys of {} change nothing here: {}",
                    path.display(),
                    advisory.join("; ")
                );
            }
            file
        }
        _ => Settings::default(),
    };
    Ok(flags.clone().or(env).or(file))
}

/// `tchrun config`: asks (on a terminal, with no flags) or takes the flags, and writes
/// the file.
fn write_config(args: ConfigArgs) -> ExitCode {
    let fail = |err: &dyn std::fmt::Display| {
        tch_distributed::eprintln_whole!("tchrun config: {err}");
        ExitCode::from(2)
    };
    let Some(path) = args.config.or_else(default_path) else {
        return fail(&"HOME is not set: give the file with --config FILE");
    };
    let flags = args.settings;
    let config = if !args.yes && flags.is_empty() && std::io::stdin().is_terminal() {
        let current = match path.exists().then(|| Settings::load(&path)) {
            Some(Ok(current)) => current,
            Some(Err(err)) => {
                tch_distributed::eprintln_whole!("tchrun config: {err}; starting afresh");
                Settings::default()
            }
            None => Settings::default(),
        };
        println!(
            "Writing {}. Enter keeps the answer in brackets.",
            path.display()
        );
        match Settings::ask(
            &mut std::io::stdin().lock(),
            &mut std::io::stdout(),
            &current,
        ) {
            Ok(config) => config,
            Err(err) => return fail(&err),
        }
    } else {
        flags
    };
    if let Err(err) = tch_distributed::settings::save(&config, &path) {
        return fail(&err);
    }
    print!(
        "tchrun config: wrote {}\n{}",
        path.display(),
        config.to_toml()
    );
    ExitCode::SUCCESS
}
