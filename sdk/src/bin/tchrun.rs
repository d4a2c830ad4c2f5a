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
use tch_distributed::config::{default_path, Origin, RunConfig, CONFIG_ENV};
use tch_distributed::launch::{launch_with_env, LaunchConfig, Launcher};

/// What `tchrun --help` says after the options: where settings come from.
const SETTINGS_HELP: &str = "\
Settings: each of --nproc-per-node, --nnodes, --node-rank, --master-addr, --master-port,
--backend, --gpus, --mixed-precision and --grad-accum comes from the flag, else its
environment variable (named in brackets), else the configuration file, else the
program's #[distributed(...)] option of that name, else the default.

Configuration file: --config FILE, else $TCH_DISTRIBUTED_CONFIG, else
$XDG_CONFIG_HOME/tch-distributed/config.toml, else ~/.config/tch-distributed/config.toml
(when it exists). `tchrun config` writes it, asking a few questions or from flags.";

/// Runs a data-parallel training program, one process per rank, like torchrun.
///
/// Starts PROGRAM once per rank with the torchrun environment (RANK,
/// LOCAL_RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT, ...) and supervises the
/// ranks: when one fails the others are stopped and tchrun exits with 1, or,
/// with --max-restarts, all are started again; SIGINT/SIGTERM are forwarded to
/// the ranks; if tchrun dies, its ranks are killed.
#[derive(Debug, Parser)]
#[command(
    name = "tchrun",
    version,
    override_usage = "tchrun [OPTIONS] [--] PROGRAM [ARGS]...\n       tchrun config [OPTIONS]",
    args_conflicts_with_subcommands = true,
    disable_help_subcommand = true,
    after_help = SETTINGS_HELP
)]
struct Args {
    #[command(subcommand)]
    subcommand: Option<Sub>,

    #[command(flatten)]
    settings: Settings,

    /// The run configuration file to read (see Configuration file below).
    #[arg(long, value_name = "FILE")]
    config: Option<PathBuf>,

    /// Seconds ranks get to exit after SIGTERM before they are killed.
    #[arg(long, value_name = "SECONDS", default_value_t = 5.0)]
    stop_grace_seconds: f64,

    /// When a rank fails, stop every rank and start them all again, up to K
    /// times (as torchrun's --max-restarts). Each attempt gets a fresh
    /// rendezvous and TORCHELASTIC_RESTART_COUNT; a program that loads its newest
    /// checkpoint at start resumes from it. Give every node the same value.
    #[arg(long, alias = "max_restarts", value_name = "K", default_value_t = 0)]
    max_restarts: usize,

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
    if let Some(Sub::Config(config_args)) = args.subcommand {
        return write_config(config_args);
    }
    let run = match resolve(&args.settings, args.config.clone()) {
        Ok(run) => run,
        Err(err) => {
            tch_distributed::eprintln_whole!("tchrun: {err}");
            return ExitCode::from(2);
        }
    };
    let defaults = LaunchConfig::default();
    let stop_grace = match Duration::try_from_secs_f64(args.stop_grace_seconds) {
        Ok(grace) => grace,
        Err(_) => {
            tch_distributed::eprintln_whole!(
                "tchrun: --stop-grace-seconds must be a non-negative number of seconds"
            );
            return ExitCode::from(2);
        }
    };
    let config = LaunchConfig {
        nproc_per_node: run.nproc_or_default(),
        nnodes: run.nnodes.unwrap_or(defaults.nnodes),
        node_rank: run.node_rank.unwrap_or(defaults.node_rank),
        master_addr: run.master_addr.clone().unwrap_or(defaults.master_addr),
        master_port: run.master_port.unwrap_or(defaults.master_port),
        stop_grace,
        max_restarts: args.max_restarts,
        launcher: Launcher::Tchrun,
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

/// The settings of a run, or of a configuration: one flag each, spelled as
/// torchrun's and Accelerate's.
#[derive(Debug, clap::Args)]
struct Settings {
    /// Number of ranks to start on this node [env: TCH_DISTRIBUTED_NPROC] [default: one
    /// per --gpus id, else 1].
    #[arg(long, alias = "nproc_per_node", value_name = "N")]
    nproc_per_node: Option<usize>,

    /// Number of nodes in the job [env: TCH_DISTRIBUTED_NNODES] [default: 1].
    #[arg(long, value_name = "M")]
    nnodes: Option<usize>,

    /// Index of this node in 0..nnodes [env: TCH_DISTRIBUTED_NODE_RANK] [default: 0].
    #[arg(long, alias = "node_rank", value_name = "R")]
    node_rank: Option<usize>,

    /// Address of the node running rank 0 [env: TCH_DISTRIBUTED_MASTER_ADDR] [default:
    /// 127.0.0.1].
    #[arg(long, alias = "master_addr", value_name = "ADDR")]
    master_addr: Option<String>,

    /// Port of the job's rendezvous store, which node 0's tchrun hosts; 0 picks a
    /// free port (single node only) [env:
    /// TCH_DISTRIBUTED_MASTER_PORT] [default: 0].
    #[arg(long, alias = "master_port", value_name = "PORT")]
    master_port: Option<u16>,

    /// Process group backend of the ranks [env: TCH_DISTRIBUTED_BACKEND] [default:
    /// NCCL on GPUs, else Gloo].
    #[arg(long, value_name = "BACKEND", value_parser = ["gloo", "nccl"])]
    backend: Option<String>,

    /// The GPUs the ranks use, by id, as accelerate launch --gpu_ids: the ranks'
    /// CUDA_VISIBLE_DEVICES; `all` leaves it as it is [env: TCH_DISTRIBUTED_GPUS].
    #[arg(long, alias = "gpu_ids", value_name = "IDS")]
    gpus: Option<String>,

    /// Mixed precision of the forward pass, as the attribute's mixed_precision [env:
    /// TCH_DISTRIBUTED_MIXED_PRECISION].
    #[arg(long, alias = "mixed_precision", value_name = "MODE",
          value_parser = ["no", "bf16", "fp16", "auto"])]
    mixed_precision: Option<String>,

    /// Micro-batches per optimizer step, as the attribute's grad_accum [env:
    /// TCH_DISTRIBUTED_GRAD_ACCUM].
    #[arg(long, alias = "gradient_accumulation_steps", value_name = "K")]
    grad_accum: Option<usize>,
}

impl Settings {
    fn to_run_config(&self) -> RunConfig {
        RunConfig {
            nproc_per_node: self.nproc_per_node,
            nnodes: self.nnodes,
            node_rank: self.node_rank,
            master_addr: self.master_addr.clone(),
            master_port: self.master_port,
            backend: self.backend.clone(),
            gpus: self.gpus.clone(),
            mixed_precision: self.mixed_precision.clone(),
            grad_accum: self.grad_accum,
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
fn resolve(settings: &Settings, config: Option<PathBuf>) -> tch_distributed::Result<RunConfig> {
    let flags = settings.to_run_config();
    flags.validate(&Origin::Flags)?;
    let env = RunConfig::from_env()?;
    // A file named by --config or TCH_DISTRIBUTED_CONFIG must exist; the default one
    // is read when it does.
    let named = config.is_some() || std::env::var_os(CONFIG_ENV).is_some_and(|v| !v.is_empty());
    let file = match config.or_else(default_path) {
        Some(path) if named || path.exists() => {
            let file = RunConfig::load(&path)?;
            tch_distributed::eprintln_whole!("tchrun: run configuration {}", path.display());
            file
        }
        _ => RunConfig::default(),
    };
    Ok(flags.or(env).or(file))
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
    let flags = args.settings.to_run_config();
    if let Err(err) = flags.validate(&Origin::Flags) {
        return fail(&err);
    }
    let config = if !args.yes && flags.is_empty() && std::io::stdin().is_terminal() {
        let current = match path.exists().then(|| RunConfig::load(&path)) {
            Some(Ok(current)) => current,
            Some(Err(err)) => {
                tch_distributed::eprintln_whole!("tchrun config: {err}; starting afresh");
                RunConfig::default()
            }
            None => RunConfig::default(),
        };
        println!(
            "Writing {}. Enter keeps the answer in brackets.",
            path.display()
        );
        match RunConfig::ask(
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
    if let Err(err) = config.save(&path) {
        return fail(&err);
    }
    print!(
        "tchrun config: wrote {}\n{}",
        path.display(),
        config.to_toml()
    );
    ExitCode::SUCCESS
}
