//! The launch environment contract: which rank this process is, and where rank 0's
//! store is. Read from the variables that `torchrun` (and `tchrun`) set.

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
    /// Errors: [`Error::Config`] naming the variable when one is malformed or missing.
    pub fn from_env() -> Result<Option<LaunchEnv>> {
        LaunchEnv::from_vars(|name| std::env::var(name).ok())
    }

    /// As [`LaunchEnv::from_env`], reading variables through `var`.
    pub fn from_vars(var: impl Fn(&str) -> Option<String>) -> Result<Option<LaunchEnv>> {
        let Some(rank) = var("RANK") else {
            if var("WORLD_SIZE").is_some() {
                return Err(Error::Config(
                    "WORLD_SIZE is set but RANK is not: set both (torchrun and tchrun do)".into(),
                ));
            }
            return Ok(None);
        };
        let number = |name: &str, value: &str| -> Result<usize> {
            value.trim().parse().map_err(|_| {
                Error::Config(format!("{name}={value:?} is not a non-negative integer"))
            })
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
            (Some(addr), Some(port)) => {
                let port = port
                    .trim()
                    .parse::<u16>()
                    .map_err(|_| Error::Config(format!("MASTER_PORT={port:?} is not a TCP port (1-65535)")))?;
                (addr, port)
            }
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
