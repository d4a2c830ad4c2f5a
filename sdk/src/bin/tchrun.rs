//! `tchrun`: starts and supervises the ranks of a data-parallel training
//! program on one node, like PyTorch's `torchrun`.
//!
//! ```text
//! tchrun --nproc-per-node 4 -- ./train --epochs 10
//! ```

use std::ffi::OsString;
use std::process::ExitCode;
use std::time::Duration;

use clap::Parser;
use tch_distributed::launch::{launch, LaunchConfig};

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
    override_usage = "tchrun [OPTIONS] [--] PROGRAM [ARGS]..."
)]
struct Args {
    /// Number of ranks to start on this node.
    #[arg(long, alias = "nproc_per_node", value_name = "N", default_value_t = 1)]
    nproc_per_node: usize,

    /// Number of nodes in the job.
    #[arg(long, value_name = "M", default_value_t = 1)]
    nnodes: usize,

    /// Index of this node in 0..nnodes.
    #[arg(long, alias = "node_rank", value_name = "R", default_value_t = 0)]
    node_rank: usize,

    /// Address of the node running rank 0.
    #[arg(
        long,
        alias = "master_addr",
        value_name = "ADDR",
        default_value = "127.0.0.1"
    )]
    master_addr: String,

    /// Port rank 0 listens on; 0 picks a free port (single node only).
    #[arg(long, alias = "master_port", value_name = "PORT", default_value_t = 0)]
    master_port: u16,

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
    let stop_grace = match Duration::try_from_secs_f64(args.stop_grace_seconds) {
        Ok(grace) => grace,
        Err(_) => {
            eprintln!("tchrun: --stop-grace-seconds must be a non-negative number of seconds");
            return ExitCode::from(2);
        }
    };
    let config = LaunchConfig {
        nproc_per_node: args.nproc_per_node,
        nnodes: args.nnodes,
        node_rank: args.node_rank,
        master_addr: args.master_addr,
        master_port: args.master_port,
        stop_grace,
        max_restarts: args.max_restarts,
    };
    let (program, rest) = match args.command.split_first() {
        Some((program, rest)) => (program.clone(), rest),
        None => (OsString::new(), &[][..]),
    };
    match launch(&config, &program, rest) {
        Ok(code) => ExitCode::from(u8::try_from(code).unwrap_or(1)),
        Err(err) => {
            eprintln!("{err}");
            ExitCode::from(1)
        }
    }
}
