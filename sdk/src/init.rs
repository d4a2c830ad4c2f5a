//! Joining the job: [`init`] reads the launch environment, picks this rank's device
//! and backend, rendezvous through a `TCPStore` and builds the process group.

use std::sync::Mutex;
use std::time::Duration;

use tch::Device;

use crate::devices;
use crate::env::LaunchEnv;
use crate::error::{Error, Result};
use crate::process_group::{Backend, ProcessGroup};
use crate::rng::RandomState;
use crate::store::Store;

/// The timeout of collectives and rendezvous when none is given: 30 minutes, as
/// `torch.distributed`'s `default_pg_timeout`.
pub const DEFAULT_TIMEOUT: Duration = Duration::from_secs(1800);

/// Options for [`init_with`]. `None` fields come from the environment
/// (`TCH_DISTRIBUTED_BACKEND`, `TCH_DISTRIBUTED_TIMEOUT` in seconds) or defaults.
#[derive(Clone, Debug, Default)]
pub struct InitOptions {
    /// The backend; default NCCL when this rank has a CUDA device and NCCL was built,
    /// else Gloo.
    pub backend: Option<Backend>,
    /// The timeout of rendezvous and of every collective; default [`DEFAULT_TIMEOUT`].
    pub timeout: Option<Duration>,
    /// This rank's device; default `Device::Cuda(local_rank)` when CUDA is available
    /// (`Device::Cuda(0)` when the process sees a single GPU, as under `srun
    /// --gpus-per-task=1`), else `Device::Cpu`.
    pub device: Option<Device>,
}

/// This process's place in the job: rank, world size, device and process group.
/// Cheap to clone; clones share the process group.
#[derive(Clone, Debug)]
pub struct Context {
    rank: usize,
    local_rank: usize,
    world_size: usize,
    local_world_size: usize,
    device: Device,
    group: ProcessGroup,
    master: Option<(String, u16)>,
    random: RandomState,
    /// GPUs this rank sees (0 on the CPU).
    gpus: usize,
}

static CONTEXT: Mutex<Option<Context>> = Mutex::new(None);

/// Joins the job described by the environment with default options; see
/// [`init_with`].
pub fn init() -> Result<Context> {
    init_with(InitOptions::default())
}

/// Joins the job described by the environment, as `torch.distributed.init_process_group`
/// with the `env://` method.
///
/// - Under `torchrun`/`tchrun` (`RANK`, `WORLD_SIZE`, `MASTER_ADDR`, `MASTER_PORT`, …):
///   rank 0 hosts a `TCPStore` on `MASTER_ADDR:MASTER_PORT` and the others connect;
///   under torchrun's agent store every rank connects as a client.
/// - With no launcher variables: a world of one process over an in-process store, with
///   no network.
///
/// The first call in a process builds the context; later calls return it again
/// (their options are ignored), as Accelerate's `PartialState`.
///
/// Errors: [`Error::Config`] for malformed variables or options,
/// [`Error::PortInUse`] when rank 0 cannot bind `MASTER_PORT`,
/// [`Error::Rendezvous`] when the other ranks do not join within the timeout,
/// [`Error::BackendUnavailable`] when NCCL is asked for and cannot be used.
pub fn init_with(options: InitOptions) -> Result<Context> {
    let mut slot = CONTEXT.lock().unwrap_or_else(|e| e.into_inner());
    if let Some(ctx) = slot.as_ref() {
        return Ok(ctx.clone());
    }
    let ctx = Context::join(LaunchEnv::from_env()?, options)?;
    *slot = Some(ctx.clone());
    Ok(ctx)
}

/// The context built by [`init`], if any.
pub fn current() -> Option<Context> {
    CONTEXT.lock().unwrap_or_else(|e| e.into_inner()).clone()
}

/// This process's `(rank, world size)` in the current job; `(0, 1)` without one.
pub(crate) fn rank_and_world_size() -> (usize, usize) {
    current()
        .map(|c| (c.rank(), c.world_size()))
        .unwrap_or((0, 1))
}

/// `value` reduced with `op` over the ranks of the current job (one all-reduce of a
/// CPU scalar); `value` itself without a job of several ranks.
pub(crate) fn all_reduce_scalar(value: i64, op: crate::ReduceOp) -> Result<i64> {
    match current() {
        Some(ctx) if ctx.world_size() > 1 => {
            let mut t = tch::Tensor::from_slice(&[value]);
            ctx.process_group().all_reduce(&mut t, op)?;
            Ok(t.int64_value(&[0]))
        }
        _ => Ok(value),
    }
}

fn env_timeout() -> Result<Option<Duration>> {
    match std::env::var("TCH_DISTRIBUTED_TIMEOUT") {
        Ok(v) => v
            .trim()
            .parse::<f64>()
            .ok()
            .filter(|s| s.is_finite() && *s > 0.0)
            .map(|s| Some(Duration::from_secs_f64(s)))
            .ok_or_else(|| {
                Error::Config(format!(
                    "TCH_DISTRIBUTED_TIMEOUT={v:?} is not a positive number of seconds"
                ))
            }),
        Err(_) => Ok(None),
    }
}

impl Context {
    /// Builds a context for `env` (a single process when `None`); see [`init_with`].
    /// Unlike `init`, this does not register the context as the process's current one.
    pub fn join(env: Option<LaunchEnv>, options: InitOptions) -> Result<Context> {
        let env = env.unwrap_or(LaunchEnv {
            rank: 0,
            local_rank: 0,
            world_size: 1,
            local_world_size: 1,
            master_addr: String::new(),
            master_port: 0,
            agent_store_prefix: None,
        });
        let timeout = match options.timeout {
            Some(t) => t,
            None => env_timeout()?.unwrap_or(DEFAULT_TIMEOUT),
        };
        let gpus = devices::visible_gpus();
        let device = options
            .device
            .unwrap_or_else(|| devices::local_device(env.local_rank, gpus));
        let backend = match options.backend {
            Some(b) => b,
            None => match std::env::var("TCH_DISTRIBUTED_BACKEND") {
                Ok(name) => Backend::parse(&name)?,
                Err(_) if device.is_cuda() && Backend::nccl_available() => Backend::Nccl,
                Err(_) => Backend::Gloo,
            },
        };

        // Store and process-group failures name the rendezvous point and this rank.
        let place = |e: Error| match e {
            Error::Rendezvous { message, .. } => Error::Rendezvous {
                addr: env.master_addr.clone(),
                port: env.master_port,
                rank: Some(env.rank),
                world_size: env.world_size,
                message,
            },
            other => other,
        };
        let (store, master) = if env.world_size == 1 && env.master_port == 0 {
            (Store::in_process()?, None)
        } else if let Some(prefix) = &env.agent_store_prefix {
            let client = Store::tcp(
                &env.master_addr,
                env.master_port,
                env.world_size,
                false,
                timeout,
            )
            .map_err(place)?;
            (
                client.with_prefix(prefix)?,
                Some((env.master_addr.clone(), env.master_port)),
            )
        } else {
            let is_server = env.rank == 0;
            let store = Store::tcp(
                &env.master_addr,
                env.master_port,
                env.world_size,
                is_server,
                timeout,
            )
            .map_err(place)?;
            (store, Some((env.master_addr.clone(), env.master_port)))
        };
        let random = RandomState::share(&store, env.rank, env.world_size, device).map_err(place)?;
        devices::check_own_gpus(
            &store,
            backend,
            (env.rank, env.local_rank, env.local_world_size, env.world_size),
            device,
            gpus,
        )
        .map_err(place)?;
        let group = ProcessGroup::new(&store, env.rank, env.world_size, backend, device, timeout)
            .map_err(place)?;
        Ok(Context {
            rank: env.rank,
            local_rank: env.local_rank,
            world_size: env.world_size,
            local_world_size: env.local_world_size,
            device,
            group,
            master,
            random,
            gpus,
        })
    }

    /// Global rank, in `0..world_size`.
    pub fn rank(&self) -> usize {
        self.rank
    }

    /// The job's seed, the same on every rank: a hash of rank 0's random state when it
    /// joined, so a program that seeds libtorch before joining (`tch::manual_seed` in
    /// `main`) gets the same job seed run after run. It seeds
    /// [`AgreedSeed`](crate::AgreedSeed), so that shuffles agree on every rank.
    pub fn seed(&self) -> u64 {
        self.random.seed()
    }

    /// Rank 0's random state when it joined (shared at rendezvous).
    pub(crate) fn random_state(&self) -> &RandomState {
        &self.random
    }

    /// Rank within this node, in `0..local_world_size`; it indexes this node's GPUs.
    pub fn local_rank(&self) -> usize {
        self.local_rank
    }

    /// Number of processes in the job.
    pub fn world_size(&self) -> usize {
        self.world_size
    }

    /// Number of processes on this node.
    pub fn local_world_size(&self) -> usize {
        self.local_world_size
    }

    /// Whether this is rank 0, the process that prints, logs and writes checkpoints.
    pub fn is_main_process(&self) -> bool {
        self.rank == 0
    }

    /// Whether this is local rank 0, the process that prepares per-node files.
    pub fn is_local_main_process(&self) -> bool {
        self.local_rank == 0
    }

    /// This rank's device: `Device::Cuda(local_rank)` or `Device::Cpu`.
    pub fn device(&self) -> Device {
        self.device
    }

    /// The backend serving this rank's device.
    pub fn backend(&self) -> Backend {
        self.group.backend()
    }

    /// The job's process group.
    pub fn process_group(&self) -> &ProcessGroup {
        &self.group
    }

    /// Blocks until every rank reaches this point.
    pub fn barrier(&self) -> Result<()> {
        self.group.barrier()
    }

    /// The start-up banner printed by rank 0, e.g.
    /// `tch-distributed: backend gloo, world size 2, local world size 2, devices cpu,
    /// rendezvous 127.0.0.1:29500, timeout 1800 s`.
    pub fn banner(&self) -> String {
        let device = devices::node_devices(self.local_world_size, self.device, self.gpus);
        let rendezvous = match &self.master {
            Some((addr, port)) => format!("{addr}:{port}"),
            None => "in-process (single process)".to_string(),
        };
        format!(
            "tch-distributed: backend {}, world size {}, local world size {}, devices {}, rendezvous {}, timeout {} s",
            self.backend(),
            self.world_size,
            self.local_world_size,
            device,
            rendezvous,
            self.group.timeout().as_secs_f64()
        )
    }
}
