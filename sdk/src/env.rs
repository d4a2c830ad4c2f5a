//! The launch environment contract: which rank this process is, and where rank 0's
//! store is. Read from the variables that `torchrun` (and `tchrun`) set, from those of
//! an MPI launcher (`mpirun` of Open MPI, MPICH or Intel MPI), or from those of a SLURM
//! job step (`srun`).

use crate::error::{Error, Result};

/// What a launcher told this process, as `torchrun` states it in the environment.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LaunchEnv {
    /// Global rank, in `0..world_size` (`RANK`).
    pub rank: usize,
    /// Rank within this node, in `0..local_world_size` (`LOCAL_RANK`).
    pub local_rank: usize,
    /// Number of processes in the job (`WORLD_SIZE`).
    pub world_size: usize,
    /// Number of processes on this node (`LOCAL_WORLD_SIZE`; defaults to `world_size`).
    pub local_world_size: usize,
    /// Host of rank 0's store (`MASTER_ADDR`).
    pub master_addr: String,
    /// Port of rank 0's store (`MASTER_PORT`).
    pub master_port: u16,
    /// Set under torchrun's agent store (`TORCHELASTIC_USE_AGENT_STORE=True`): the
    /// launcher already hosts the store, every rank connects as a client, and keys
    /// live under this prefix (`/worker/attempt_{TORCHELASTIC_RESTART_COUNT}`).
    pub agent_store_prefix: Option<String>,
}

impl LaunchEnv {
    /// Reads the process environment. `Ok(None)` when no launcher variables are set
    /// (a plain single process).
    ///
    /// # Errors
    /// [`Error::Config`] naming the variable when one is malformed or missing.
    pub fn from_env() -> Result<Option<LaunchEnv>> {
        LaunchEnv::from_vars(crate::protocol::var)
    }

    /// As [`LaunchEnv::from_env`], reading variables through `var`.
    ///
    /// Whose variables count, when several launchers' are set: torchrun's (`RANK`)
    /// first, then Open MPI's (`OMPI_COMM_WORLD_RANK`), then MPICH's and Intel MPI's
    /// (`PMI_RANK` with `MPI_LOCALRANKID`), then a SLURM job step's
    /// (`SLURM_STEP_NUM_TASKS`). An MPI launcher inside a SLURM allocation starts its
    /// daemons with `srun`, so its ranks also see a job step's variables, which
    /// describe the daemons rather than the ranks: the MPI variables win.
    ///
    /// # Errors
    /// [`Error::Config`] naming the variable when one is malformed (not a number) or out
    /// of range (a rank not below the world size); [`Error::Usage`] for launchers'
    /// variables that contradict each other.
    pub fn from_vars(var: impl Fn(&str) -> Option<String>) -> Result<Option<LaunchEnv>> {
        if var("RANK").is_none() {
            if var("OMPI_COMM_WORLD_RANK").is_some() {
                return Self::from_mpi(&var, &OPEN_MPI).map(Some);
            }
            if var("PMI_RANK").is_some() && var("MPI_LOCALRANKID").is_some() {
                return Self::from_mpi(&var, &MPICH).map(Some);
            }
            if var("SLURM_STEP_NUM_TASKS").is_some() {
                return Self::from_slurm(&var).map(Some);
            }
        }
        let Some(rank) = var("RANK") else {
            if var("WORLD_SIZE").is_some() {
                return Err(Error::Config(
                    "WORLD_SIZE is set but RANK is not: set both (torchrun and tchrun do)".into(),
                ));
            }
            return Ok(None);
        };
        let rank = number("RANK", &rank)?;
        let world_size = match var("WORLD_SIZE") {
            Some(v) => number("WORLD_SIZE", &v)?,
            None => {
                return Err(Error::Config(
                    "RANK is set but WORLD_SIZE is not: set both (torchrun and tchrun do)".into(),
                ))
            }
        };
        if world_size == 0 || rank >= world_size {
            return Err(Error::Config(format!(
                "RANK={rank} must be below WORLD_SIZE={world_size}"
            )));
        }
        let local_rank = var("LOCAL_RANK")
            .map(|v| number("LOCAL_RANK", &v))
            .transpose()?
            .unwrap_or(rank);
        let local_world_size = var("LOCAL_WORLD_SIZE")
            .map(|v| number("LOCAL_WORLD_SIZE", &v))
            .transpose()?
            .unwrap_or(world_size);
        if local_rank >= local_world_size {
            return Err(Error::Config(format!(
                "LOCAL_RANK={local_rank} must be below LOCAL_WORLD_SIZE={local_world_size}"
            )));
        }
        let (master_addr, master_port) = match (var("MASTER_ADDR"), var("MASTER_PORT")) {
            (Some(addr), Some(port)) => (addr, port_number(&port)?),
            _ if world_size == 1 => (String::new(), 0),
            _ => {
                return Err(Error::Config(
                    "MASTER_ADDR and MASTER_PORT must be set when WORLD_SIZE > 1: they name rank 0's host and a free \
                     port (torchrun and tchrun set them)"
                        .into(),
                ))
            }
        };
        let agent_store_prefix = match var("TORCHELASTIC_USE_AGENT_STORE").as_deref() {
            Some("True") | Some("true") | Some("1") => {
                let attempt = var("TORCHELASTIC_RESTART_COUNT").unwrap_or_else(|| "0".into());
                Some(format!("/worker/attempt_{attempt}"))
            }
            _ => None,
        };
        Ok(Some(LaunchEnv {
            rank,
            local_rank,
            world_size,
            local_world_size,
            master_addr,
            master_port,
            agent_store_prefix,
        }))
    }

    /// A task of a SLURM job step, as `srun` starts one process per task:
    ///
    /// | field | from |
    /// |---|---|
    /// | rank | `SLURM_PROCID` |
    /// | world size | `SLURM_STEP_NUM_TASKS` |
    /// | local rank | `SLURM_LOCALID` |
    /// | local world size | this node's entry (`SLURM_NODEID`) in `SLURM_STEP_TASKS_PER_NODE`, e.g. `4(x2)` |
    /// | store host | `MASTER_ADDR`, else the first host of `SLURM_STEP_NODELIST` (e.g. `gpu[03-06]` → `gpu03`) |
    /// | store port | `MASTER_PORT`, else 15000 + the last 4 digits of `SLURM_JOB_ID`, as PyTorch Lightning picks it |
    ///
    /// Only a job step counts (`srun`; `SLURM_STEP_NUM_TASKS` is set): a program run
    /// directly in the batch script is one process.
    fn from_slurm(var: &impl Fn(&str) -> Option<String>) -> Result<LaunchEnv> {
        let required = |name: &str| {
            var(name).ok_or_else(|| {
                Error::Config(format!(
                    "{name} is not set in a SLURM job step: start the ranks with srun (one task per GPU)"
                ))
            })
        };
        let world_size = number("SLURM_STEP_NUM_TASKS", &required("SLURM_STEP_NUM_TASKS")?)?;
        let rank = number("SLURM_PROCID", &required("SLURM_PROCID")?)?;
        let local_rank = number("SLURM_LOCALID", &required("SLURM_LOCALID")?)?;
        let node = number(
            "SLURM_NODEID",
            &var("SLURM_NODEID").unwrap_or_else(|| "0".into()),
        )?;
        let tasks_per_node =
            var("SLURM_STEP_TASKS_PER_NODE").unwrap_or_else(|| world_size.to_string());
        let local_world_size = tasks_on_node(&tasks_per_node, node).ok_or_else(|| {
            Error::Config(format!(
                "SLURM_STEP_TASKS_PER_NODE={tasks_per_node:?} has no entry for node {node}"
            ))
        })?;
        if rank >= world_size || local_rank >= local_world_size {
            return Err(Error::Config(format!(
                "SLURM task {rank} (local {local_rank}) does not fit {world_size} tasks, {local_world_size} on this node"
            )));
        }
        let master_addr = match var("MASTER_ADDR") {
            Some(addr) => addr,
            None => {
                let list = required("SLURM_STEP_NODELIST")?;
                first_host(&list).ok_or_else(|| {
                    Error::Config(format!(
                        "SLURM_STEP_NODELIST={list:?} names no host: set MASTER_ADDR to the first node's address"
                    ))
                })?
            }
        };
        let master_port = match var("MASTER_PORT") {
            Some(port) => port_number(&port)?,
            None => port_from_job_id(&required("SLURM_JOB_ID")?),
        };
        Ok(LaunchEnv {
            rank,
            local_rank,
            world_size,
            local_world_size,
            master_addr,
            master_port,
            agent_store_prefix: None,
        })
    }

    /// A rank started by an MPI launcher (`mpirun -np N PROGRAM`), from the variables
    /// that the launcher names in `vars`:
    ///
    /// | field | Open MPI | MPICH, Intel MPI |
    /// |---|---|---|
    /// | rank | `OMPI_COMM_WORLD_RANK` | `PMI_RANK` |
    /// | world size | `OMPI_COMM_WORLD_SIZE` | `PMI_SIZE` |
    /// | local rank | `OMPI_COMM_WORLD_LOCAL_RANK` | `MPI_LOCALRANKID` |
    /// | local world size | `OMPI_COMM_WORLD_LOCAL_SIZE` | `MPI_LOCALNRANKS` |
    ///
    /// The store's host is `MASTER_ADDR`; else, when every rank runs on this node,
    /// `127.0.0.1`; else the first host of the SLURM allocation (`SLURM_JOB_NODELIST`,
    /// where rank 0 runs under SLURM's default placement). The port is `MASTER_PORT`,
    /// else 15000 + the last four digits of the job's id (`PMIX_NAMESPACE`, Open MPI's
    /// `OMPI_MCA_ess_base_jobid`, `SLURM_JOB_ID`), as for a SLURM job step, else 29500
    /// (torchrun's default).
    fn from_mpi(var: &impl Fn(&str) -> Option<String>, vars: &MpiVars) -> Result<LaunchEnv> {
        let required = |name: &str| {
            var(name).ok_or_else(|| {
                Error::Config(format!(
                    "{name} is not set, but {} is: {} sets both; set them all or none",
                    vars.rank, vars.launcher
                ))
            })
        };
        let rank = number(vars.rank, &required(vars.rank)?)?;
        let world_size = number(vars.size, &required(vars.size)?)?;
        let local_rank = number(vars.local_rank, &required(vars.local_rank)?)?;
        let local_world_size = number(vars.local_size, &required(vars.local_size)?)?;
        if rank >= world_size || local_rank >= local_world_size || local_world_size > world_size {
            return Err(Error::Config(format!(
                "{} rank {rank} (local {local_rank}) does not fit {world_size} ranks, {local_world_size} on this node",
                vars.launcher
            )));
        }
        let master_addr = match var("MASTER_ADDR") {
            Some(addr) => addr,
            None if local_world_size == world_size => "127.0.0.1".to_string(),
            None => {
                let list = var("SLURM_JOB_NODELIST").or_else(|| var("SLURM_NODELIST"));
                list.as_deref().and_then(first_host).ok_or_else(|| {
                    Error::Config(format!(
                        "the {} ranks run on several hosts and MASTER_ADDR is not set: pass the address of \
                         rank 0's host to every rank, e.g. {}",
                        vars.launcher, vars.pass_master
                    ))
                })?
            }
        };
        let master_port = match var("MASTER_PORT") {
            Some(port) => port_number(&port)?,
            None => ["PMIX_NAMESPACE", "OMPI_MCA_ess_base_jobid", "SLURM_JOB_ID"]
                .iter()
                .find_map(|name| var(name))
                .map_or(29500, |job| port_from_job_id(&job)),
        };
        Ok(LaunchEnv {
            rank,
            local_rank,
            world_size,
            local_world_size,
            master_addr,
            master_port,
            agent_store_prefix: None,
        })
    }
}

/// The variables an MPI launcher sets for each rank.
struct MpiVars {
    launcher: &'static str,
    rank: &'static str,
    size: &'static str,
    local_rank: &'static str,
    local_size: &'static str,
    /// How to give every rank `MASTER_ADDR` with this launcher.
    pass_master: &'static str,
}

const OPEN_MPI: MpiVars = MpiVars {
    launcher: "Open MPI's mpirun",
    rank: "OMPI_COMM_WORLD_RANK",
    size: "OMPI_COMM_WORLD_SIZE",
    local_rank: "OMPI_COMM_WORLD_LOCAL_RANK",
    local_size: "OMPI_COMM_WORLD_LOCAL_SIZE",
    pass_master: "`mpirun -x MASTER_ADDR=node0 -x MASTER_PORT=29500 …`",
};

const MPICH: MpiVars = MpiVars {
    launcher: "MPICH's or Intel MPI's mpirun",
    rank: "PMI_RANK",
    size: "PMI_SIZE",
    local_rank: "MPI_LOCALRANKID",
    local_size: "MPI_LOCALNRANKS",
    pass_master: "`mpirun -genv MASTER_ADDR node0 -genv MASTER_PORT 29500 …`",
};

/// The store's port for a job that names no `MASTER_PORT`: 15000 + the last four
/// digits of its id, as PyTorch Lightning picks it for a SLURM job.
fn port_from_job_id(job: &str) -> u16 {
    let digits: String = job.chars().filter(char::is_ascii_digit).collect();
    let last4 = &digits[digits.len().saturating_sub(4)..];
    15000 + last4.parse::<u16>().unwrap_or(0)
}

fn number(name: &str, value: &str) -> Result<usize> {
    value
        .trim()
        .parse()
        .map_err(|_| {
            Error::Config(format!(
                "{name}={value:?} is not a non-negative integer: the launcher sets it (tchrun, torchrun, srun, mpirun); set it to a number, or unset RANK, WORLD_SIZE and LOCAL_RANK to run one process"
            ))
        })
}

fn port_number(port: &str) -> Result<u16> {
    port.trim()
        .parse::<u16>()
        .ok()
        .filter(|&p| p > 0)
        .ok_or_else(|| Error::Config(format!("MASTER_PORT={port:?} is not a TCP port (1-65535)")))
}

/// The number of tasks on node `node` from SLURM's compressed list, e.g. `2(x3),1`
/// is 2, 2, 2, 1.
fn tasks_on_node(list: &str, node: usize) -> Option<usize> {
    let mut seen = 0;
    for entry in list.split(',') {
        let (count, repeat) = match entry.split_once("(x") {
            Some((count, rest)) => (count, rest.trim_end_matches(')').trim().parse().ok()?),
            None => (entry, 1),
        };
        seen += repeat;
        if node < seen {
            return count.trim().parse().ok();
        }
    }
    None
}

/// The first host of a SLURM host list: `gpu[03-06,09],login1` → `gpu03`.
fn first_host(list: &str) -> Option<String> {
    let list = list.trim();
    let end = list.find([',', '[']).unwrap_or(list.len());
    let prefix = &list[..end];
    if list[end..].starts_with('[') {
        let inside = &list[end + 1..];
        let first = inside.split([',', '-', ']']).next()?;
        return Some(format!("{prefix}{first}"));
    }
    (!prefix.is_empty()).then(|| prefix.to_string())
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;

    fn parse(vars: &[(&str, &str)]) -> Result<Option<LaunchEnv>> {
        let map: HashMap<String, String> = vars
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        LaunchEnv::from_vars(|k| map.get(k).cloned())
    }

    #[test]
    fn no_variables_is_a_single_process() {
        assert_eq!(parse(&[]).unwrap(), None);
    }

    #[test]
    fn torchrun_agent_store() {
        let env = parse(&[
            ("RANK", "1"),
            ("LOCAL_RANK", "1"),
            ("WORLD_SIZE", "2"),
            ("LOCAL_WORLD_SIZE", "2"),
            ("MASTER_ADDR", "127.0.0.1"),
            ("MASTER_PORT", "29500"),
            ("TORCHELASTIC_USE_AGENT_STORE", "True"),
            ("TORCHELASTIC_RESTART_COUNT", "3"),
        ])
        .unwrap()
        .unwrap();
        assert_eq!(env.rank, 1);
        assert_eq!(env.master_port, 29500);
        assert_eq!(env.agent_store_prefix.as_deref(), Some("/worker/attempt_3"));
    }

    #[test]
    fn a_slurm_job_step() {
        let step = [
            ("SLURM_JOB_ID", "123456"),
            ("SLURM_STEP_NUM_TASKS", "8"),
            ("SLURM_PROCID", "5"),
            ("SLURM_LOCALID", "1"),
            ("SLURM_NODEID", "1"),
            ("SLURM_STEP_TASKS_PER_NODE", "4(x2)"),
            ("SLURM_STEP_NODELIST", "gpu[03-04]"),
        ];
        let env = parse(&step).unwrap().unwrap();
        assert_eq!(
            (
                env.rank,
                env.world_size,
                env.local_rank,
                env.local_world_size
            ),
            (5, 8, 1, 4)
        );
        assert_eq!(env.master_addr, "gpu03");
        assert_eq!(env.master_port, 15000 + 3456);
        let mut with_master = step.to_vec();
        with_master.extend([("MASTER_ADDR", "10.0.0.1"), ("MASTER_PORT", "29400")]);
        let env = parse(&with_master).unwrap().unwrap();
        assert_eq!(
            (env.master_addr.as_str(), env.master_port),
            ("10.0.0.1", 29400)
        );
        // The batch script itself, outside srun: one process.
        assert_eq!(
            parse(&[("SLURM_JOB_ID", "1"), ("SLURM_PROCID", "0")]).unwrap(),
            None
        );
        // torchrun inside an allocation wins.
        let mut torchrun = step.to_vec();
        torchrun.extend([("RANK", "0"), ("WORLD_SIZE", "1")]);
        assert_eq!(parse(&torchrun).unwrap().unwrap().world_size, 1);
    }

    /// Open MPI's variables, as `mpirun -np 4` on two hosts sets them for rank 3.
    const OMPI_RANK_3: [(&str, &str); 5] = [
        ("OMPI_COMM_WORLD_RANK", "3"),
        ("OMPI_COMM_WORLD_SIZE", "4"),
        ("OMPI_COMM_WORLD_LOCAL_RANK", "1"),
        ("OMPI_COMM_WORLD_LOCAL_SIZE", "2"),
        ("PMIX_NAMESPACE", "330760193"),
    ];

    #[test]
    fn an_open_mpi_rank() {
        let mut vars = OMPI_RANK_3.to_vec();
        vars.extend([("MASTER_ADDR", "10.0.0.1"), ("MASTER_PORT", "29400")]);
        let env = parse(&vars).unwrap().unwrap();
        assert_eq!(
            (
                env.rank,
                env.world_size,
                env.local_rank,
                env.local_world_size
            ),
            (3, 4, 1, 2)
        );
        assert_eq!(
            (env.master_addr.as_str(), env.master_port),
            ("10.0.0.1", 29400)
        );
        // Several hosts and no MASTER_ADDR: the error says how to pass it.
        let e = parse(&OMPI_RANK_3).unwrap_err().to_string();
        assert!(e.contains("MASTER_ADDR") && e.contains("mpirun -x"), "{e}");
        // Under SLURM the allocation's first host, and the job's own port.
        let mut slurm = OMPI_RANK_3.to_vec();
        slurm.extend([
            ("SLURM_JOB_NODELIST", "gpu[03-04]"),
            // mpirun's daemons are an srun step: these describe them, not the ranks.
            ("SLURM_STEP_NUM_TASKS", "2"),
            ("SLURM_PROCID", "1"),
            ("SLURM_LOCALID", "0"),
        ]);
        let env = parse(&slurm).unwrap().unwrap();
        assert_eq!((env.rank, env.world_size), (3, 4));
        assert_eq!(
            (env.master_addr.as_str(), env.master_port),
            ("gpu03", 15000 + 193)
        );
        // One host: loopback.
        let one_host = [
            ("OMPI_COMM_WORLD_RANK", "1"),
            ("OMPI_COMM_WORLD_SIZE", "2"),
            ("OMPI_COMM_WORLD_LOCAL_RANK", "1"),
            ("OMPI_COMM_WORLD_LOCAL_SIZE", "2"),
        ];
        let env = parse(&one_host).unwrap().unwrap();
        assert_eq!(
            (env.master_addr.as_str(), env.master_port),
            ("127.0.0.1", 29500)
        );
        // torchrun's variables win.
        let mut torchrun = one_host.to_vec();
        torchrun.extend([("RANK", "0"), ("WORLD_SIZE", "1")]);
        assert_eq!(parse(&torchrun).unwrap().unwrap().world_size, 1);
    }

    #[test]
    fn an_mpich_or_intel_mpi_rank() {
        let vars = [
            ("PMI_RANK", "2"),
            ("PMI_SIZE", "3"),
            ("MPI_LOCALRANKID", "2"),
            ("MPI_LOCALNRANKS", "3"),
            ("MASTER_PORT", "29411"),
        ];
        let env = parse(&vars).unwrap().unwrap();
        assert_eq!(
            (
                env.rank,
                env.world_size,
                env.local_rank,
                env.local_world_size
            ),
            (2, 3, 2, 3)
        );
        assert_eq!(
            (env.master_addr.as_str(), env.master_port),
            ("127.0.0.1", 29411)
        );
        let e = parse(&[
            ("PMI_RANK", "0"),
            ("PMI_SIZE", "4"),
            ("MPI_LOCALRANKID", "0"),
            ("MPI_LOCALNRANKS", "2"),
        ])
        .unwrap_err()
        .to_string();
        assert!(e.contains("-genv MASTER_ADDR"), "{e}");
        // srun --mpi=pmi2 sets PMI_RANK without MPI_LOCALRANKID: SLURM's variables.
        let env = parse(&[
            ("PMI_RANK", "1"),
            ("PMI_SIZE", "2"),
            ("SLURM_JOB_ID", "42"),
            ("SLURM_STEP_NUM_TASKS", "2"),
            ("SLURM_PROCID", "1"),
            ("SLURM_LOCALID", "1"),
            ("SLURM_STEP_NODELIST", "localhost"),
        ])
        .unwrap()
        .unwrap();
        assert_eq!((env.rank, env.local_rank, env.master_port), (1, 1, 15042));
        // torchrun's variables win.
        let mut torchrun = vars.to_vec();
        torchrun.extend([("RANK", "0"), ("WORLD_SIZE", "1")]);
        assert_eq!(parse(&torchrun).unwrap().unwrap().world_size, 1);
    }

    #[test]
    fn mpi_errors_name_the_variable() {
        let e = parse(&[("OMPI_COMM_WORLD_RANK", "0")])
            .unwrap_err()
            .to_string();
        assert!(e.contains("OMPI_COMM_WORLD_SIZE is not set"), "{e}");
        let e = parse(&[
            ("PMI_RANK", "x"),
            ("PMI_SIZE", "2"),
            ("MPI_LOCALRANKID", "0"),
            ("MPI_LOCALNRANKS", "2"),
        ])
        .unwrap_err()
        .to_string();
        assert!(e.contains("PMI_RANK=\"x\""), "{e}");
        let e = parse(&[
            ("OMPI_COMM_WORLD_RANK", "2"),
            ("OMPI_COMM_WORLD_SIZE", "2"),
            ("OMPI_COMM_WORLD_LOCAL_RANK", "0"),
            ("OMPI_COMM_WORLD_LOCAL_SIZE", "1"),
        ])
        .unwrap_err()
        .to_string();
        assert!(e.contains("rank 2 (local 0) does not fit 2 ranks"), "{e}");
        assert_eq!(port_from_job_id("prterun-vm-32585@1"), 15000 + 5851);
        assert_eq!(port_from_job_id("none"), 15000);
    }

    #[test]
    fn slurm_lists() {
        assert_eq!(tasks_on_node("2(x3),1", 2), Some(2));
        assert_eq!(tasks_on_node("2(x3),1", 3), Some(1));
        assert_eq!(tasks_on_node("2(x3),1", 4), None);
        assert_eq!(first_host("gpu[03-06,09],login1").as_deref(), Some("gpu03"));
        assert_eq!(first_host("node7,node8").as_deref(), Some("node7"));
        assert_eq!(first_host("localhost").as_deref(), Some("localhost"));
        assert_eq!(first_host(""), None);
    }

    #[test]
    fn errors_name_the_variable() {
        let e = parse(&[("RANK", "0"), ("WORLD_SIZE", "2")])
            .unwrap_err()
            .to_string();
        assert!(e.contains("MASTER_ADDR"), "{e}");
        let e = parse(&[("RANK", "2"), ("WORLD_SIZE", "2")])
            .unwrap_err()
            .to_string();
        assert!(e.contains("RANK=2"), "{e}");
        let e = parse(&[("RANK", "x"), ("WORLD_SIZE", "2")])
            .unwrap_err()
            .to_string();
        assert!(e.contains("RANK=\"x\""), "{e}");
        let e = parse(&[
            ("RANK", "0"),
            ("WORLD_SIZE", "2"),
            ("MASTER_ADDR", "h"),
            ("MASTER_PORT", "99999"),
        ])
        .unwrap_err()
        .to_string();
        assert!(e.contains("MASTER_PORT"), "{e}");
    }
}
