//! Joining the job: [`init`] reads the launch environment, picks this rank's device
//! and backend, rendezvous through a `TCPStore` and builds the process group.

use std::sync::Mutex;
use std::time::Duration;

use tch::Device;

use crate::amp::{MixedPrecision, MixedPrecisionMode};
use crate::devices;
use crate::env::LaunchEnv;
use crate::error::{Error, Result};
use crate::job_token::{self, JobToken};
use crate::process_group::{Backend, GlooAddress, ProcessGroup};
use crate::rng::RandomState;
use crate::settings::Settings;
use crate::store::Store;

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
    master: Option<(String, u16)>,
    random: RandomState,
    /// GPUs this rank sees (0 on the CPU).
    gpus: usize,
    /// The run's settings, resolved (see [`crate::settings`]).
    settings: Settings,
    /// The mixed precision resolved on `device`, and why.
    precision: (MixedPrecision, String),
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
/// Errors: [`Error::Config`] for malformed variables or options,
/// [`Error::PortInUse`] when rank 0 cannot bind `MASTER_PORT`,
/// [`Error::Rendezvous`] when the other ranks do not join within the timeout (saying
/// how many of how many joined, and which are missing) or were started with another
/// `WORLD_SIZE` or the same `RANK`,
/// [`Error::BackendUnavailable`] when NCCL is asked for and cannot be used.
pub fn init_with(options: InitOptions) -> Result<Context> {
    init_with_settings(options.over_env()?, options.device)
}

/// [`init_with`] for the run's resolved settings (the `#[distributed]` entry's: the
/// environment over the attribute), which the context keeps.
pub(crate) fn init_with_settings(settings: Settings, device: Option<Device>) -> Result<Context> {
    let mut slot = CONTEXT.lock().unwrap_or_else(|e| e.into_inner());
    if let Some(ctx) = slot.as_ref() {
        return Ok(ctx.clone());
    }
    let ctx = Context::join_with(LaunchEnv::from_env()?, settings, device)?;
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

/// Counts this rank in at the store and waits, up to `timeout`, until all
/// `world_size` ranks have joined. Errors ([`Error::Rendezvous`]) say how many ranks
/// joined within the timeout and which did not, that two processes have the same
/// rank, or that the ranks were given different world sizes. `hosts_store`: this rank
/// hosts the store (rank 0 without torchrun's agent).
///
/// The first rank whose wait ends counts the ranks that joined and publishes the
/// count under the key the others wait for, so that every rank reports the same
/// count, even the ones whose store goes away when rank 0 exits with its error.
fn join(
    store: &Store,
    rank: usize,
    world_size: usize,
    timeout: Duration,
    hosts_store: bool,
) -> Result<()> {
    const ALL: &str = "tchd/join/all";
    const COUNT: &str = "tchd/join/count";
    let rendezvous = |message: String| Error::Rendezvous {
        addr: String::new(),
        port: 0,
        rank: Some(rank),
        world_size,
        message,
    };
    let size_key = |r: usize| format!("tchd/join/world_size/{r}");
    let rank_key = |r: usize| format!("tchd/join/rank/{r}");
    // Twice: as text, for the blocking read of rank 0's below, and as a counter,
    // which reads 0 without waiting when that rank never came.
    let size_counter = |r: usize| format!("tchd/join/size/{r}");
    store.set(&size_key(rank), world_size.to_string().as_bytes())?;
    store.add(&size_counter(rank), world_size as i64)?;
    if store.add(&rank_key(rank), 1)? > 1 {
        return Err(rendezvous(format!(
            "another process has already joined as rank {rank}: every process of the job needs \
             a rank of its own (RANK from 0 to {}); look for a job started twice, or a \
             launcher that gives the same RANK to two processes",
            world_size - 1
        )));
    }
    // World sizes travel as "size RANK=SIZE,…": each rank names the first rank whose
    // size differs from its own.
    if store.add(COUNT, 1)? == world_size as i64 {
        // The rank whose arrival completes this rank's count: every counted rank
        // published its size before counting itself, so compare them now (a rank
        // started with a larger WORLD_SIZE may be among them), before anyone proceeds.
        let mut sizes = Vec::new();
        for r in 0..world_size {
            sizes.push((r, store.add(&size_counter(r), 0)?));
        }
        let verdict = if sizes.iter().any(|&(_, s)| s == 0) {
            // As many processes as ranks, but not these ranks: some RANK lies outside
            // 0..world_size (its WORLD_SIZE is larger) or came twice.
            format!("missing {world_size} ")
        } else if sizes.iter().all(|&(_, s)| s == world_size as i64) {
            "ok".to_string()
        } else {
            let listed: Vec<String> = sizes.iter().map(|(r, s)| format!("{r}={s}")).collect();
            format!("size {}", listed.join(","))
        };
        store.set(ALL, verdict.as_bytes())?;
    }
    // Each `get` waits up to the store's timeout, the job's.
    let waited = (|| -> Result<Vec<u8>> {
        if rank != 0 {
            let size0 = String::from_utf8_lossy(&store.get(&size_key(0))?).into_owned();
            if size0 != world_size.to_string() {
                // Tells rank 0 and the ranks that agree with it, waiting below.
                let _ = store.set(ALL, format!("size {rank}={world_size}").as_bytes());
                return Ok(format!("size 0={size0}").into_bytes());
            }
        }
        store.get(ALL)
    })();
    let outcome = match waited {
        Ok(value) => String::from_utf8_lossy(&value).into_owned(),
        Err(_) => {
            // This rank's wait ended first: count, and tell the ranks still waiting.
            let counted = (|| -> Result<String> {
                let joined = store.add(COUNT, 0)?;
                let mut missing = Vec::new();
                for r in 0..world_size {
                    if store.add(&rank_key(r), 0)? == 0 {
                        missing.push(r.to_string());
                    }
                }
                Ok(format!("missing {joined} {}", missing.join(",")))
            })();
            match counted {
                Ok(outcome) => {
                    let _ = store.set(ALL, outcome.as_bytes());
                    if hosts_store {
                        // The others read the count from this rank's store: give the
                        // store a moment to send it before this rank exits.
                        let _ = store.add(COUNT, 0);
                        std::thread::sleep(Duration::from_millis(500));
                    }
                    outcome
                }
                Err(_) => {
                    return Err(rendezvous(format!(
                        "rank 0, which hosts the store, stopped answering before all {world_size} \
                         ranks joined: it may have given up waiting for them (its own output says \
                         how many joined within the timeout, {}) or failed",
                        crate::error::seconds(timeout)
                    )))
                }
            }
        }
    };
    let mine = world_size.to_string();
    let differing = outcome.strip_prefix("size ").and_then(|sizes| {
        sizes
            .split(',')
            .filter_map(|rs| rs.split_once('='))
            .find(|(_, size)| *size != mine)
    });
    if let Some((other, size)) = differing {
        // Under tchrun the world size is --nnodes × --nproc-per-node of each host's.
        let fix = if crate::protocol::under_tchrun() {
            "start tchrun on every host with the same --nnodes and --nproc-per-node"
        } else {
            "start every rank with the same WORLD_SIZE (the number of processes of the whole job)"
        };
        return Err(rendezvous(format!(
            "WORLD_SIZE is {world_size} here but {size} on rank {other}: the ranks disagree on \
             the job's size; {fix}"
        )));
    }
    let mut words = outcome.split(' ');
    match (words.next(), words.next(), words.next()) {
        (Some("missing"), Some(joined), Some("")) => Err(rendezvous(format!(
            "{joined} processes joined within {}, but not as the {world_size} ranks (0 to {}) \
             that this rank expects: the ranks were started with different WORLD_SIZE values, \
             or two of them with the same RANK; start every rank with the same WORLD_SIZE, the \
             number of processes of the whole job",
            crate::error::seconds(timeout),
            world_size - 1
        ))),
        (Some("missing"), Some(joined), missing) => {
            let missing: Vec<usize> = missing
                .unwrap_or_default()
                .split(',')
                .filter_map(|r| r.parse().ok())
                .collect();
            let verb = if missing.len() == 1 { "is" } else { "are" };
            Err(rendezvous(format!(
                "{joined} of {world_size} ranks joined within {} ({} {verb} missing): start \
                 all {world_size} ranks (WORLD_SIZE={world_size}: tchrun's or torchrun's \
                 --nproc-per-node times --nnodes, or the number of processes srun or mpirun \
                 starts), or check the missing ranks' own output: they may have failed before \
                 joining, or cannot reach this address",
                crate::error::seconds(timeout),
                crate::process_group::ranks_text(&missing)
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
    pub fn join(env: Option<LaunchEnv>, options: InitOptions) -> Result<Context> {
        Context::join_with(env, options.over_env()?, options.device)
    }

    /// [`Context::join`] with the run's settings, which the context keeps.
    fn join_with(
        env: Option<LaunchEnv>,
        settings: Settings,
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
        let timeout = settings
            .timeout
            .map_or(DEFAULT_TIMEOUT, Duration::from_secs_f64);
        let gpus = devices::visible_gpus();
        let device = device.unwrap_or_else(|| devices::local_device(env.local_rank, gpus));
        let (backend, note) = choose_backend(
            settings.backend,
            device,
            Backend::nccl_available(),
            env.world_size,
        )?;
        let precision = settings
            .mixed_precision
            .unwrap_or(MixedPrecisionMode::Exactly(MixedPrecision::No))
            .resolve(device)?;
        if let (Some(note), 0) = (note, env.rank) {
            crate::log::warn(note);
        }

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
            join(&store, env.rank, env.world_size, timeout, hosts_store).map_err(place)?;
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
            settings,
            precision,
        })
    }

    /// The run's settings, as resolved when this rank joined: for a `#[distributed]`
    /// function, the environment's (and `tchrun`'s) over the attribute's options.
    pub(crate) fn settings(&self) -> &Settings {
        &self.settings
    }

    /// The mixed precision the run resolved on this rank's device (`auto` decided),
    /// and why, for the banner.
    pub(crate) fn precision(&self) -> (MixedPrecision, &str) {
        (self.precision.0, &self.precision.1)
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
        format!(
            "tch-distributed: backend {}, world size {}, local world size {}, devices {}, rendezvous {}{gloo}, timeout {} s",
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
