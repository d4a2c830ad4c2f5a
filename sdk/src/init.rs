//! Joining the job: [`init`] reads the launch environment, picks this rank's device
//! and backend, rendezvous through a `TCPStore` and builds the process group.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use tch::Device;

use crate::amp::{MixedPrecision, MixedPrecisionMode};
use crate::ddp::DistributedDataParallel;
use crate::devices;
use crate::env::LaunchEnv;
use crate::error::{Error, Result};
use crate::loop_position::LoopPositions;
use crate::process_group::{Backend, ProcessGroup};
use crate::random_state::RandomState;
use crate::rendezvous::job_token::{self, JobToken};
use crate::rendezvous::store::Store;
use crate::rendezvous::{self, GlooAddress};
use crate::settings::{DebugLevel, DeepSpeed, Offload, Settings};

/// The timeout of collectives and rendezvous when none is given: 30 minutes, as
/// `torch.distributed`'s `default_pg_timeout`.
pub const DEFAULT_TIMEOUT: Duration = Duration::from_secs(1800);

/// Options for [`init_with`]. They win over the environment; `None` fields come from
/// the environment (`TCH_DISTRIBUTED_BACKEND`, `TCH_DISTRIBUTED_TIMEOUT` in seconds:
/// [`crate::settings`]) or defaults.
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
    /// Hybrid sharding's shard and replicate groups (the `shard_group` setting), when
    /// the shard group is not the whole job.
    mesh: Option<crate::mesh::Mesh>,
    master: Option<(String, u16)>,
    random: RandomState,
    /// GPUs this rank sees (0 on the CPU).
    gpus: usize,
    /// The run's settings and precision, shared by the clones.
    run: Arc<Run>,
}

/// What a context keeps of the run: its settings, resolved (see [`crate::settings`]),
/// and the mixed precision resolved on the rank's device, with why.
#[derive(Debug)]
struct Run {
    settings: Settings,
    /// The DeepSpeed file the `deepspeed` setting names, read (its settings are in
    /// `settings`; its optimizer, scheduler and loss scaling apply at `.build`).
    deepspeed: Option<DeepSpeed>,
    precision: MixedPrecision,
    why: String,
    /// The DDPs `#[distributed]` built for optimizers the function did not build.
    optimizer_ddps: OptimizerDdps,
    /// Where the sharded loops stand, and where a loaded checkpoint resumes them.
    loops: LoopPositions,
    /// The units `fully_shard` declared, for the sharded optimizers built after.
    units: crate::unit_registry::Units,
    /// Whether rank 0 printed the banner: once a run, however many `#[distributed]`
    /// functions or methods the program enters.
    banner: std::sync::atomic::AtomicBool,
}

/// The DDP of each optimizer the function did not build, by its first variable's
/// data pointer: built at the optimizer's first step (see `runtime::rewrites`).
#[derive(Default)]
struct OptimizerDdps(Mutex<Vec<(usize, DistributedDataParallel)>>);

impl std::fmt::Debug for OptimizerDdps {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let n = self.0.lock().map_or(0, |d| d.len());
        write!(f, "{n} optimizer DDP(s)")
    }
}

static CONTEXT: Mutex<Option<Context>> = Mutex::new(None);

/// Joins the job described by the environment with default options; see
/// [`init_with`].
///
/// # Errors
/// As [`init_with`].
pub fn init() -> Result<Context> {
    init_with(InitOptions::default())
}

/// Joins the job described by the environment, as `torch.distributed.init_process_group`
/// with the `env://` method.
///
/// - Under `torchrun`/`tchrun` (`RANK`, `WORLD_SIZE`, `MASTER_ADDR`, `MASTER_PORT`, …):
///   under the launcher's agent store (`TORCHELASTIC_USE_AGENT_STORE=True`, which
///   both set) every rank connects to its `TCPStore` as a client; without it (SLURM,
///   MPI, ranks started by hand), rank 0 hosts a `TCPStore` on
///   `MASTER_ADDR:MASTER_PORT` and the others connect.
/// - With no launcher variables: a world of one process over an in-process store, with
///   no network.
///
/// The first call in a process builds the context; later calls return it again
/// (their options are ignored), as Accelerate's `PartialState`.
///
/// # Errors
/// [`Error::Config`] for malformed variables or options,
/// [`Error::PortInUse`] when rank 0 cannot bind `MASTER_PORT`,
/// [`Error::Rendezvous`] when the other ranks do not join within the timeout (saying
/// how many of how many joined, and which are missing) or were started with another
/// `WORLD_SIZE` or the same `RANK`,
/// [`Error::BackendUnavailable`] when NCCL is asked for and cannot be used.
pub fn init_with(options: InitOptions) -> Result<Context> {
    let (settings, deepspeed) = options.over_env()?.with_deepspeed()?;
    init_with_settings(settings, deepspeed, options.device)
}

/// [`init_with`] for the run's resolved settings (the `#[distributed]` entry's: the
/// environment over the attribute, with the DeepSpeed file's that `deepspeed` names,
/// read: [`Settings::with_deepspeed`]), which the context keeps.
pub(crate) fn init_with_settings(
    settings: Settings,
    deepspeed: Option<DeepSpeed>,
    device: Option<Device>,
) -> Result<Context> {
    let mut slot = CONTEXT.lock().unwrap_or_else(|e| e.into_inner());
    if let Some(ctx) = slot.as_ref() {
        return Ok(ctx.clone());
    }
    crate::host_memory::keep_freed_memory();
    let ctx = Context::join_with(LaunchEnv::from_env()?, settings, deepspeed, device)?;
    *slot = Some(ctx.clone());
    Ok(ctx)
}

impl InitOptions {
    /// The options given, over the environment's settings (`TCH_DISTRIBUTED_BACKEND`,
    /// `TCH_DISTRIBUTED_TIMEOUT`, …: [`crate::settings`]).
    fn over_env(&self) -> Result<Settings> {
        let given = Settings {
            backend: self.backend,
            timeout: self.timeout.map(|t| t.as_secs_f64()),
            ..Settings::default()
        };
        Ok(given.or(Settings::from_env()?))
    }
}

/// The context built by [`init`], if any.
pub fn current() -> Option<Context> {
    CONTEXT.lock().unwrap_or_else(|e| e.into_inner()).clone()
}

/// The current context's device and mixed precision, read in place (no clone): what
/// the autocast of every forward pass needs.
pub(crate) fn current_precision() -> Option<(Device, MixedPrecision)> {
    let slot = CONTEXT.lock().unwrap_or_else(|e| e.into_inner());
    slot.as_ref().map(|c| (c.device, c.run.precision))
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

/// `offload` moves what ZeRO stages 2 and 3 shard: with `zero` set to 0 or 1 it has
/// nothing to move.
///
/// # Errors
/// [`Error::Config`] naming both settings and the fix.
fn check_offload(settings: &Settings) -> Result<()> {
    match (settings.offload, settings.zero) {
        (Some(offload), Some(stage)) if offload != Offload::None && stage < 2 => {
            Err(Error::Config(format!(
                "offload = \"{offload}\" with zero = {stage}: offload keeps the shards of ZeRO \
                 stages 2 and 3 in host memory. Set zero = 2 (or 3), or offload = \"none\""
            )))
        }
        _ => Ok(()),
    }
}

/// The job's backend: the one asked for (the attribute, [`InitOptions`], or
/// `TCH_DISTRIBUTED_BACKEND`), else NCCL on CUDA devices and Gloo on the CPU, as
/// PyTorch's users choose them. Returns a note for rank 0 to print when Gloo was asked
/// for on CUDA devices with more than one rank: it works, through host copies, but
/// is slower than NCCL.
///
/// Never falls back to Gloo without a word: a job of several ranks on CUDA devices
/// that asks for nothing, in a build without NCCL (its headers were not found at build
/// time), fails with [`Error::Config`] naming the fix.
fn choose_backend(
    asked: Option<Backend>,
    device: Device,
    nccl_built: bool,
    world_size: usize,
) -> Result<(Backend, Option<String>)> {
    let several_on_cuda = device.is_cuda() && world_size > 1;
    match asked {
        Some(Backend::Gloo) if several_on_cuda => Ok((
            Backend::Gloo,
            Some(format!(
                "backend gloo on {} for {world_size} ranks: Gloo copies every all-reduce \
                 through host memory, which is much slower than NCCL on GPUs",
                crate::devices::device_name(device)
            )),
        )),
        Some(backend) => Ok((backend, None)),
        None if device.is_cuda() && nccl_built => Ok((Backend::Nccl, None)),
        None if several_on_cuda => Err(Error::Config(format!(
            "{world_size} ranks on CUDA devices need the NCCL backend, and this build of \
             tch-distributed has none: the CUDA and NCCL headers were not found when it was \
             built (cargo printed `tch-distributed: NCCL backend not built`). Install them \
             next to torch (pip install 'cuda-toolkit[nvcc,cccl]') or point \
             TCH_DISTRIBUTED_CUDA_INCLUDE at them, then rebuild; or ask for Gloo \
             (backend = \"gloo\" in the attribute, or TCH_DISTRIBUTED_BACKEND=gloo), which \
             works on GPUs but is much slower"
        ))),
        None => Ok((Backend::Gloo, None)),
    }
}

impl Context {
    /// Builds a context for `env` (a single process when `None`); see [`init_with`].
    /// Unlike `init`, this does not register the context as the process's current one.
    ///
    /// # Errors
    /// As [`init_with`].
    pub fn join(env: Option<LaunchEnv>, options: InitOptions) -> Result<Context> {
        let (settings, deepspeed) = options.over_env()?.with_deepspeed()?;
        Context::join_with(env, settings, deepspeed, options.device)
    }

    /// [`Context::join`] with the run's settings and DeepSpeed file, which the context
    /// keeps.
    fn join_with(
        env: Option<LaunchEnv>,
        settings: Settings,
        deepspeed: Option<DeepSpeed>,
        device: Option<Device>,
    ) -> Result<Context> {
        let env = env.unwrap_or(LaunchEnv {
            rank: 0,
            local_rank: 0,
            world_size: 1,
            local_world_size: 1,
            master_addr: String::new(),
            master_port: 0,
            agent_store_prefix: None,
        });
        if let Some(ds) = &deepspeed {
            ds.check_batch(settings.grad_accum.unwrap_or(1), env.world_size)?;
            if env.rank == 0 && !ds.advisory.is_empty() {
                crate::log::warn(format_args!(
                    "{}: these keys change nothing here: {}",
                    ds.path.display(),
                    ds.advisory.join("; ")
                ));
            }
        }
        let timeout = settings
            .timeout
            .map_or(DEFAULT_TIMEOUT, Duration::from_secs_f64);
        let gpus = devices::visible_gpus();
        let device = device.unwrap_or_else(|| devices::local_device(env.local_rank, gpus));
        let (backend, note) = choose_backend(
            settings.backend,
            device,
            crate::compat::nccl_available(),
            env.world_size,
        )?;
        let precision = crate::precision::resolve_mixed_precision(
            settings
                .mixed_precision
                .unwrap_or(MixedPrecisionMode::Exactly(MixedPrecision::No)),
            device,
        )?;
        if let (Some(note), 0) = (note, env.rank) {
            crate::log::warn(note);
        }
        check_offload(&settings)?;

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
        // The job's keys live under its token's prefix, sealed, when it has one (`job_token`).
        let token = JobToken::from_env();
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
            .map_err(place)?
            .served_by_launcher();
            job_token::agree(&client, token.as_ref(), env.rank).map_err(place)?;
            (
                job_token::view(&client, token.as_ref(), prefix)?,
                Some((env.master_addr.clone(), env.master_port)),
            )
        } else {
            // Rank 0 hosts the store, on loopback when every rank is on this host.
            let store = if env.rank == 0 {
                let several_hosts = env.local_world_size < env.world_size;
                Store::tcp_server(
                    &env.master_addr,
                    env.master_port,
                    env.world_size,
                    several_hosts,
                    timeout,
                )
            } else {
                Store::tcp(
                    &env.master_addr,
                    env.master_port,
                    env.world_size,
                    false,
                    timeout,
                )
            }
            .map_err(place)?;
            job_token::agree(&store, token.as_ref(), env.rank).map_err(place)?;
            let store = match &token {
                Some(token) => job_token::view(&store, Some(token), "")?,
                None => store,
            };
            (store, Some((env.master_addr.clone(), env.master_port)))
        };
        if env.world_size > 1 {
            let hosts_store = env.agent_store_prefix.is_none() && env.rank == 0;
            rendezvous::join::wait_for_all_ranks(
                &store,
                env.rank,
                env.world_size,
                timeout,
                hosts_store,
            )
            .map_err(place)?;
        }
        let random = RandomState::share(&store, env.rank, env.world_size, device).map_err(place)?;
        devices::check_own_gpus(
            &store,
            backend,
            (
                env.rank,
                env.local_rank,
                env.local_world_size,
                env.world_size,
            ),
            device,
            gpus,
        )
        .map_err(place)?;
        let join = match settings.debug.unwrap_or_default() {
            DebugLevel::Off => ProcessGroup::new,
            DebugLevel::Detail => ProcessGroup::checked,
        };
        let group =
            join(&store, env.rank, env.world_size, backend, device, timeout).map_err(place)?;
        if let Some(after) = settings.deadlock_check {
            group.check_deadlocks_after(Duration::from_secs_f64(after));
        }
        let mesh = match settings.shard_group {
            Some(shard_group) if env.world_size > 1 => crate::mesh::Mesh::join(
                &store,
                shard_group,
                (env.rank, env.world_size, env.local_world_size),
                backend,
                device,
                timeout,
            )
            .map_err(place)?,
            _ => None,
        };
        Ok(Context {
            rank: env.rank,
            local_rank: env.local_rank,
            world_size: env.world_size,
            local_world_size: env.local_world_size,
            device,
            group,
            mesh,
            master,
            random,
            gpus,
            run: Arc::new(Run {
                settings,
                deepspeed,
                precision: precision.0,
                why: precision.1,
                optimizer_ddps: OptimizerDdps::default(),
                loops: LoopPositions::default(),
                units: crate::unit_registry::Units::default(),
                banner: std::sync::atomic::AtomicBool::new(false),
            }),
        })
    }

    /// Whether this is the first call in the run (the banner is printed once).
    pub(crate) fn first_banner(&self) -> bool {
        !self
            .run
            .banner
            .swap(true, std::sync::atomic::Ordering::Relaxed)
    }

    /// Where the run's sharded loops stand ([`LoopPositions`]).
    pub(crate) fn loops(&self) -> &LoopPositions {
        &self.run.loops
    }

    /// The units `fully_shard` declared in this run.
    pub(crate) fn units(&self) -> &crate::unit_registry::Units {
        &self.run.units
    }

    /// Runs `f` on the DDP that `#[distributed]` keeps for the optimizer whose first
    /// variable's data is at `key`: `None` until `f` builds one (at the optimizer's
    /// first step). Not reentrant.
    pub(crate) fn with_optimizer_ddp<R>(
        &self,
        key: usize,
        f: impl FnOnce(&mut Option<DistributedDataParallel>) -> R,
    ) -> R {
        let mut all = self
            .run
            .optimizer_ddps
            .0
            .lock()
            .unwrap_or_else(|e| e.into_inner());
        let i = all.iter().position(|(k, _)| *k == key);
        let mut slot = i.map(|i| all.swap_remove(i).1);
        let r = f(&mut slot);
        if let Some(ddp) = slot {
            all.push((key, ddp));
        }
        r
    }

    /// The run's settings, as resolved when this rank joined: for a `#[distributed]`
    /// function, the environment's (and `tchrun`'s) over the attribute's options.
    pub(crate) fn settings(&self) -> &Settings {
        &self.run.settings
    }

    /// The DeepSpeed file the run's `deepspeed` setting names, read.
    pub(crate) fn deepspeed(&self) -> Option<&DeepSpeed> {
        self.run.deepspeed.as_ref()
    }

    /// Why the run resolved its [mixed precision](Context::mixed_precision), for the
    /// banner (e.g. "auto: compute capability 9.0").
    pub(crate) fn precision_why(&self) -> &str {
        &self.run.why
    }

    /// The mixed precision of the forward passes, resolved on this rank's device
    /// (`auto` decided: bf16 on GPUs of compute capability 8.0 or more, fp16 below, no
    /// on the CPU) from the attribute, `tchrun --mixed-precision`,
    /// `TCH_DISTRIBUTED_MIXED_PRECISION` or the configuration file; as Accelerate's
    /// `accelerator.mixed_precision`.
    pub fn mixed_precision(&self) -> MixedPrecision {
        self.run.precision
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

    /// Hybrid sharding's mesh (the `shard_group` setting): this rank's shard and
    /// replicate groups; none for flat sharding over every rank.
    pub(crate) fn mesh(&self) -> Option<&crate::mesh::Mesh> {
        self.mesh.as_ref()
    }

    /// Blocks until every rank reaches this point.
    ///
    /// # Errors
    /// [`Error::Collective`] or [`Error::Timeout`] when a rank does not reach it.
    pub fn barrier(&self) -> Result<()> {
        self.group.barrier()
    }

    /// The start-up banner printed by rank 0, e.g.
    /// `tch-distributed: backend gloo, world size 2, local world size 2, devices cpu,
    /// rendezvous 127.0.0.1:29500, timeout 1800 s`; across hosts it also says where
    /// Gloo listens (`gloo on 10.0.0.2 (eth0, the route to the master)`).
    pub fn banner(&self) -> String {
        let device = devices::node_devices(self.local_world_size, self.device, self.gpus);
        let rendezvous = match &self.master {
            Some((addr, port)) => format!("{addr}:{port}"),
            None => "in-process (single process)".to_string(),
        };
        // Across hosts, where Gloo listens (see `GlooAddress`); on one host, loopback,
        // which goes without saying.
        let gloo = match self.group.gloo_address() {
            GlooAddress::Loopback { .. } => String::new(),
            chosen => format!(", gloo on {chosen}"),
        };
        let checks = match self.run.settings.debug {
            Some(DebugLevel::Detail) => ", debug detail (every collective checked across ranks)",
            _ => "",
        };
        format!(
            "tch-distributed: backend {}, world size {}, local world size {}, devices {}, rendezvous {}{gloo}, timeout {} s{checks}",
            self.backend(),
            self.world_size,
            self.local_world_size,
            device,
            rendezvous,
            self.group.timeout().as_secs_f64()
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_backend_is_nccl_on_cuda_gloo_on_the_cpu_and_never_a_silent_fallback() {
        let (cpu, cuda) = (Device::Cpu, Device::Cuda(0));
        let choose = |asked, device, nccl, world| choose_backend(asked, device, nccl, world);
        // Nothing asked for: as PyTorch's users choose.
        assert_eq!(choose(None, cuda, true, 2).unwrap(), (Backend::Nccl, None));
        assert_eq!(choose(None, cuda, true, 1).unwrap(), (Backend::Nccl, None));
        assert_eq!(choose(None, cpu, true, 2).unwrap(), (Backend::Gloo, None));
        assert_eq!(choose(None, cpu, false, 2).unwrap(), (Backend::Gloo, None));
        // One process on a GPU without NCCL: no collective crosses a process.
        assert_eq!(choose(None, cuda, false, 1).unwrap(), (Backend::Gloo, None));
        // Several ranks on GPUs without NCCL: an error that says how to get it.
        let err = choose(None, cuda, false, 2).unwrap_err().to_string();
        for part in [
            "2 ranks on CUDA devices need the NCCL backend",
            "TCH_DISTRIBUTED_CUDA_INCLUDE",
            "TCH_DISTRIBUTED_BACKEND=gloo",
        ] {
            assert!(err.contains(part), "{part:?} not in {err}");
        }
        // Asked for: given, with a note for Gloo on several GPUs.
        let (backend, note) = choose(Some(Backend::Gloo), cuda, false, 2).unwrap();
        assert_eq!(backend, Backend::Gloo);
        assert!(note.unwrap().contains("slower than NCCL"));
        assert_eq!(
            choose(Some(Backend::Gloo), cuda, true, 1).unwrap(),
            (Backend::Gloo, None)
        );
        assert_eq!(
            choose(Some(Backend::Gloo), cpu, true, 4).unwrap(),
            (Backend::Gloo, None)
        );
        assert_eq!(
            choose(Some(Backend::Nccl), cuda, true, 2).unwrap(),
            (Backend::Nccl, None)
        );
    }
}
