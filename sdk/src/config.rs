//! The run configuration, as `accelerate config` writes one: `tchrun config` asks a few
//! questions (or takes flags) and writes a TOML file; `tchrun` reads it.
//!
//! Every setting can come from four places; the first that gives it wins:
//!
//! 1. `tchrun`'s command-line flag (`--grad-accum 4`);
//! 2. an environment variable (`TCH_DISTRIBUTED_GRAD_ACCUM=4`);
//! 3. the configuration file (`grad_accum = 4`);
//! 4. the option of `#[distributed(…)]` in the program (`grad_accum = 4`), for the
//!    settings that the attribute has, else the default.
//!
//! `tchrun` merges the first three and hands the program's settings to every rank as
//! environment variables ([`RunConfig::rank_env`]); the `#[distributed]` entry applies
//! those over the attribute's options. A program run under `torchrun`, `srun` or
//! `mpirun`, or one that starts its own ranks, reads the same variables, not the file.
//!
//! | file key | flag | variable | meaning |
//! |---|---|---|---|
//! | `nproc_per_node` | `--nproc-per-node` | `TCH_DISTRIBUTED_NPROC` | ranks on this node |
//! | `nnodes` | `--nnodes` | `TCH_DISTRIBUTED_NNODES` | nodes in the job |
//! | `node_rank` | `--node-rank` | `TCH_DISTRIBUTED_NODE_RANK` | this node's index |
//! | `master_addr` | `--master-addr` | `TCH_DISTRIBUTED_MASTER_ADDR` | node 0's address |
//! | `master_port` | `--master-port` | `TCH_DISTRIBUTED_MASTER_PORT` | rank 0's store port |
//! | `backend` | `--backend` | `TCH_DISTRIBUTED_BACKEND` | `gloo` or `nccl` |
//! | `gpus` | `--gpus` | `TCH_DISTRIBUTED_GPUS` | GPU ids, e.g. `"0,1"`: the ranks' `CUDA_VISIBLE_DEVICES` |
//! | `mixed_precision` | `--mixed-precision` | `TCH_DISTRIBUTED_MIXED_PRECISION` | `no`, `bf16`, `fp16`, `auto` |
//! | `grad_accum` | `--grad-accum` | `TCH_DISTRIBUTED_GRAD_ACCUM` | micro-batches per optimizer step |
//!
//! The file is `--config FILE`, else `$TCH_DISTRIBUTED_CONFIG`, else
//! `$XDG_CONFIG_HOME/tch-distributed/config.toml`, else
//! `~/.config/tch-distributed/config.toml` ([`default_path`]).

use std::io::{BufRead, Write};
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use crate::error::{Error, Result};

/// `TCH_DISTRIBUTED_CONFIG`: the configuration file `tchrun` reads when `--config` is
/// not given.
pub const CONFIG_ENV: &str = "TCH_DISTRIBUTED_CONFIG";
/// `TCH_DISTRIBUTED_BACKEND`: `gloo` or `nccl`.
pub const BACKEND_ENV: &str = "TCH_DISTRIBUTED_BACKEND";
/// `TCH_DISTRIBUTED_NPROC`: ranks per node.
pub const NPROC_ENV: &str = "TCH_DISTRIBUTED_NPROC";
/// `TCH_DISTRIBUTED_MIXED_PRECISION`: `no`, `bf16`, `fp16` or `auto`; wins over the
/// attribute's `mixed_precision`.
pub const MIXED_PRECISION_ENV: &str = "TCH_DISTRIBUTED_MIXED_PRECISION";
/// `TCH_DISTRIBUTED_GRAD_ACCUM`: micro-batches per optimizer step; wins over the
/// attribute's `grad_accum`.
pub const GRAD_ACCUM_ENV: &str = "TCH_DISTRIBUTED_GRAD_ACCUM";
/// `TCH_DISTRIBUTED_OPTIMIZER`: `fused`, `foreach` or `tch`, the kernels of the
/// optimizers a `#[distributed]` function builds; wins over the attribute's
/// `optimizer`.
pub const OPTIMIZER_ENV: &str = "TCH_DISTRIBUTED_OPTIMIZER";
/// `TCH_DISTRIBUTED_ZERO`: `1` shards the optimizers' state over the ranks (ZeRO stage
/// 1), `0` turns it off; wins over the attribute's `zero`.
pub const ZERO_ENV: &str = "TCH_DISTRIBUTED_ZERO";
/// `TCH_DISTRIBUTED_GPUS`: the GPU ids the ranks may use (`0,1`).
pub const GPUS_ENV: &str = "TCH_DISTRIBUTED_GPUS";

/// The file's header: what it is and how it ranks against the other sources.
const HEADER: &str = "\
# tch-distributed run configuration, written by `tchrun config` and read by `tchrun`.
# tchrun's flags and TCH_DISTRIBUTED_* variables win over it; it wins over the options
# of #[distributed(...)]. A setting left out is decided by those, or by the defaults.
";

/// Each setting's file key, `tchrun` flag and environment variable.
const NAMES: [(&str, &str, &str); 9] = [
    ("nproc_per_node", "--nproc-per-node", NPROC_ENV),
    ("nnodes", "--nnodes", "TCH_DISTRIBUTED_NNODES"),
    ("node_rank", "--node-rank", "TCH_DISTRIBUTED_NODE_RANK"),
    (
        "master_addr",
        "--master-addr",
        "TCH_DISTRIBUTED_MASTER_ADDR",
    ),
    (
        "master_port",
        "--master-port",
        "TCH_DISTRIBUTED_MASTER_PORT",
    ),
    ("backend", "--backend", BACKEND_ENV),
    ("gpus", "--gpus", GPUS_ENV),
    ("mixed_precision", "--mixed-precision", MIXED_PRECISION_ENV),
    ("grad_accum", "--grad-accum", GRAD_ACCUM_ENV),
];

/// The backends, and the mixed-precision modes, a configuration may name.
pub const BACKENDS: [&str; 2] = ["gloo", "nccl"];
/// See [`BACKENDS`].
pub const MIXED_PRECISIONS: [&str; 4] = ["no", "bf16", "fp16", "auto"];

/// Where a setting came from, to name it in an error.
#[derive(Clone, Debug)]
pub enum Origin {
    /// `tchrun`'s command line (`--grad-accum`).
    Flags,
    /// An environment variable (`TCH_DISTRIBUTED_GRAD_ACCUM`).
    Env,
    /// A configuration file (`grad_accum in FILE`).
    File(PathBuf),
}

impl Origin {
    /// How the setting whose file key is `key` is spelled here.
    fn name(&self, key: &str) -> String {
        let (_, flag, var) = NAMES
            .iter()
            .find(|(k, _, _)| *k == key)
            .expect("a known setting");
        match self {
            Origin::Flags => flag.to_string(),
            Origin::Env => var.to_string(),
            Origin::File(path) => format!("{key} in {}", path.display()),
        }
    }

    /// The setting `key` with `value` (a TOML string when `text`), as it is written
    /// here: `--gpus 0,x`, `TCH_DISTRIBUTED_GPUS="0,x"`, `gpus = "0,x" in FILE`.
    fn setting(&self, key: &str, value: &str, text: bool) -> String {
        let name = self.name(key);
        match self {
            Origin::Flags => format!("{name} {value}"),
            Origin::Env => format!("{name}={value:?}"),
            Origin::File(path) if text => format!("{key} = {value:?} in {}", path.display()),
            Origin::File(path) => format!("{key} = {value} in {}", path.display()),
        }
    }
}

/// A run's settings; `None` leaves a setting to the next source (see the module's
/// documentation). Serialized as the configuration file, one `key = value` line per
/// setting that is given.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RunConfig {
    /// Ranks to start on this node.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub nproc_per_node: Option<usize>,
    /// Nodes in the job.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub nnodes: Option<usize>,
    /// This node's index in `0..nnodes`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub node_rank: Option<usize>,
    /// Address of node 0, where its launcher hosts the store.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub master_addr: Option<String>,
    /// Port of node 0's store.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub master_port: Option<u16>,
    /// `gloo` or `nccl`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub backend: Option<String>,
    /// The GPUs the ranks may use, comma-separated ids as `CUDA_VISIBLE_DEVICES` takes
    /// them (`"0,1"`, or `GPU-…`/`MIG-…` UUIDs); `"all"` leaves `CUDA_VISIBLE_DEVICES`
    /// as it is.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub gpus: Option<String>,
    /// `no`, `bf16`, `fp16` or `auto`, as the attribute's `mixed_precision`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub mixed_precision: Option<String>,
    /// Micro-batches per optimizer step, as the attribute's `grad_accum`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub grad_accum: Option<usize>,
}

impl RunConfig {
    /// The settings given by environment variables (see the module's table), read
    /// through `var`.
    ///
    /// # Errors
    /// [`Error::Config`] naming the variable when a value is malformed.
    pub fn from_vars(var: impl Fn(&str) -> Option<String>) -> Result<RunConfig> {
        let get = |key: &str| {
            let (_, _, name) = NAMES.iter().find(|(k, _, _)| *k == key).unwrap();
            var(name)
                .map(|v| v.trim().to_string())
                .filter(|v| !v.is_empty())
        };
        let number = |key: &str| -> Result<Option<usize>> {
            get(key)
                .map(|v| {
                    v.parse().map_err(|_| {
                        Error::Config(format!(
                            "{}={v:?} is not a non-negative integer",
                            Origin::Env.name(key)
                        ))
                    })
                })
                .transpose()
        };
        let master_port = get("master_port")
            .map(|v| {
                v.parse().map_err(|_| {
                    Error::Config(format!(
                        "{}={v:?} is not a TCP port (1-65535)",
                        Origin::Env.name("master_port")
                    ))
                })
            })
            .transpose()?;
        let config = RunConfig {
            nproc_per_node: number("nproc_per_node")?,
            nnodes: number("nnodes")?,
            node_rank: number("node_rank")?,
            master_addr: get("master_addr"),
            master_port,
            backend: get("backend").map(|b| b.to_ascii_lowercase()),
            gpus: get("gpus"),
            mixed_precision: get("mixed_precision").map(|m| m.to_ascii_lowercase()),
            grad_accum: number("grad_accum")?,
        };
        config.validate(&Origin::Env)?;
        Ok(config)
    }

    /// The settings given by this process's environment; see [`RunConfig::from_vars`].
    ///
    /// # Errors
    /// As [`RunConfig::from_vars`].
    pub fn from_env() -> Result<RunConfig> {
        RunConfig::from_vars(|name| std::env::var(name).ok())
    }

    /// Reads a configuration file.
    ///
    /// # Errors
    /// [`Error::Io`] when it cannot be read; [`Error::Config`] naming the file, the
    /// line and the key when it is not valid TOML, has an unknown key or a value that
    /// is not allowed.
    pub fn load(path: &Path) -> Result<RunConfig> {
        let text = std::fs::read_to_string(path).map_err(|source| Error::Io {
            context: format!("reading the run configuration {}", path.display()),
            source,
        })?;
        let config: RunConfig = toml::from_str(&text).map_err(|e| {
            Error::Config(format!("{}: {}", path.display(), e.to_string().trim_end()))
        })?;
        config.validate(&Origin::File(path.to_path_buf()))?;
        Ok(config)
    }

    /// The file's text: a header comment, then one `key = value` line per setting
    /// that is given.
    pub fn to_toml(&self) -> String {
        let body = toml::to_string(self).expect("a RunConfig serializes");
        format!("{HEADER}{body}")
    }

    /// Writes the file (and its directory), replacing it whole: a reader sees the old
    /// file or the new one.
    ///
    /// # Errors
    /// [`Error::Io`] when the directory or the file cannot be written.
    pub fn save(&self, path: &Path) -> Result<()> {
        let io = |source| Error::Io {
            context: format!("writing the run configuration {}", path.display()),
            source,
        };
        if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
            std::fs::create_dir_all(dir).map_err(io)?;
        }
        let mut part = path.as_os_str().to_owned();
        part.push(".part");
        std::fs::write(&part, self.to_toml()).map_err(io)?;
        std::fs::rename(&part, path).map_err(io)
    }

    /// Each setting from `self`, else from `lower`: `flags.or(env).or(file)`.
    pub fn or(self, lower: RunConfig) -> RunConfig {
        RunConfig {
            nproc_per_node: self.nproc_per_node.or(lower.nproc_per_node),
            nnodes: self.nnodes.or(lower.nnodes),
            node_rank: self.node_rank.or(lower.node_rank),
            master_addr: self.master_addr.or(lower.master_addr),
            master_port: self.master_port.or(lower.master_port),
            backend: self.backend.or(lower.backend),
            gpus: self.gpus.or(lower.gpus),
            mixed_precision: self.mixed_precision.or(lower.mixed_precision),
            grad_accum: self.grad_accum.or(lower.grad_accum),
        }
    }

    /// Whether no setting is given.
    pub fn is_empty(&self) -> bool {
        *self == RunConfig::default()
    }

    /// Checks each value on its own (how they fit together, e.g. `node_rank <
    /// nnodes`, is checked when the ranks are started).
    ///
    /// # Errors
    /// [`Error::Config`] naming the setting as `origin` spells it and the values
    /// allowed.
    pub fn validate(&self, origin: &Origin) -> Result<()> {
        let bad = |key: &str, value: &str, allowed: &str| {
            let text = !matches!(key, "nproc_per_node" | "nnodes" | "grad_accum");
            Err(Error::Config(format!(
                "{}: {allowed}",
                origin.setting(key, value, text)
            )))
        };
        if self.nproc_per_node == Some(0) {
            return bad("nproc_per_node", "0", "start at least 1 rank per node");
        }
        if self.nnodes == Some(0) {
            return bad("nnodes", "0", "a job has at least 1 node");
        }
        if self.grad_accum == Some(0) {
            return bad(
                "grad_accum",
                "0",
                "it counts the micro-batches per optimizer step: at least 1",
            );
        }
        if let Some(addr) = self.master_addr.as_deref().filter(|a| a.trim().is_empty()) {
            return bad("master_addr", addr, "give a host name or an address");
        }
        if let Some(backend) = self.backend.as_deref() {
            if !BACKENDS.contains(&backend) {
                return bad("backend", backend, "use gloo or nccl");
            }
        }
        if let Some(mp) = self.mixed_precision.as_deref() {
            if !MIXED_PRECISIONS.contains(&mp) {
                return bad("mixed_precision", mp, "use no, bf16, fp16 or auto");
            }
        }
        if let Some(gpus) = self.gpus.as_deref() {
            if let Err(why) = gpu_ids(gpus) {
                return bad("gpus", gpus, &why);
            }
        }
        Ok(())
    }

    /// The GPU ids to make visible to the ranks; `None` for `all` or no `gpus`.
    pub fn gpu_ids(&self) -> Option<Vec<String>> {
        self.gpus.as_deref().and_then(|g| gpu_ids(g).ok().flatten())
    }

    /// Ranks per node when nothing gives `nproc_per_node`: one per GPU id given,
    /// else 1.
    pub fn nproc_or_default(&self) -> usize {
        self.nproc_per_node
            .or_else(|| self.gpu_ids().map(|ids| ids.len()))
            .unwrap_or(1)
    }

    /// The variables every rank gets from this configuration: the program's settings
    /// (`TCH_DISTRIBUTED_BACKEND`, `TCH_DISTRIBUTED_MIXED_PRECISION`,
    /// `TCH_DISTRIBUTED_GRAD_ACCUM`) and `CUDA_VISIBLE_DEVICES` for `gpus`.
    pub fn rank_env(&self) -> Vec<(String, String)> {
        let mut env = Vec::new();
        if let Some(backend) = &self.backend {
            env.push((BACKEND_ENV.to_string(), backend.clone()));
        }
        if let Some(mp) = &self.mixed_precision {
            env.push((MIXED_PRECISION_ENV.to_string(), mp.clone()));
        }
        if let Some(k) = self.grad_accum {
            env.push((GRAD_ACCUM_ENV.to_string(), k.to_string()));
        }
        if let Some(ids) = self.gpu_ids() {
            env.push(("CUDA_VISIBLE_DEVICES".to_string(), ids.join(",")));
        }
        env
    }

    /// Asks for each setting on `output`, reading the answers from `input`, as
    /// `accelerate config` does; `current` gives the answers that Enter keeps.
    ///
    /// # Errors
    /// [`Error::Config`] when `input` ends before every question is answered;
    /// [`Error::Io`] when reading or writing fails.
    pub fn ask(
        input: &mut impl BufRead,
        output: &mut impl Write,
        current: &RunConfig,
    ) -> Result<RunConfig> {
        let mut q = Questions { input, output };
        let mut c = RunConfig {
            nnodes: q.number(
                "How many machines (nodes) does the job use?",
                current.nnodes,
                "1",
                1,
            )?,
            ..RunConfig::default()
        };
        if c.nnodes.unwrap_or(1) > 1 {
            let n = c.nnodes.unwrap_or(1);
            loop {
                c.node_rank = q.number(
                    &format!("Which machine is this one, 0 to {}?", n - 1),
                    current.node_rank,
                    "0",
                    0,
                )?;
                if c.node_rank.unwrap_or(0) < n {
                    break;
                }
                q.say(&format!("  the machines are numbered 0 to {}", n - 1))?;
            }
            c.master_addr = q.text(
                "Address of machine 0, reachable from every machine?",
                current.master_addr.clone(),
                "127.0.0.1",
                |a| Ok(a.to_string()),
            )?;
            while c.master_port.is_none() {
                c.master_port = q.text(
                    "Port of the rendezvous store on machine 0 (the same on every machine)?",
                    current.master_port,
                    "none",
                    |p| {
                        p.parse()
                            .ok()
                            .filter(|&p: &u16| p > 0)
                            .ok_or_else(|| "a TCP port, 1-65535".to_string())
                    },
                )?;
                if c.master_port.is_none() {
                    q.say("  several machines need a fixed port, e.g. 29500")?;
                }
            }
        }
        c.gpus = q.text(
            "Which GPUs should the ranks use, by id (e.g. 0,1), or all?",
            current.gpus.clone(),
            "all",
            |g| match gpu_ids(g)? {
                Some(_) => Ok(g.to_string()),
                None => Ok("all".to_string()),
            },
        )?;
        if c.gpus.as_deref() == Some("all") {
            c.gpus = None;
        }
        let per_node_default = match c.gpu_ids() {
            Some(ids) => ids.len().to_string(),
            None => "1".to_string(),
        };
        c.nproc_per_node = q.number(
            "How many processes (ranks) per machine?",
            current.nproc_per_node,
            &per_node_default,
            1,
        )?;
        c.backend = q.choice(
            "Backend: gloo, nccl, or auto (NCCL on GPUs, else Gloo)?",
            current.backend.clone(),
            &BACKENDS,
            "auto",
        )?;
        c.mixed_precision = q.choice(
            "Mixed precision: no, bf16, fp16, auto, or program (the program's own choice)?",
            current.mixed_precision.clone(),
            &MIXED_PRECISIONS,
            "program",
        )?;
        c.grad_accum = q.text(
            "Gradient accumulation: micro-batches per optimizer step, or program?",
            current.grad_accum,
            "program",
            |k| {
                k.parse()
                    .ok()
                    .filter(|&k: &usize| k >= 1)
                    .ok_or_else(|| "a number, at least 1".to_string())
            },
        )?;
        Ok(c)
    }
}

/// The ids of a `gpus` setting: `Ok(None)` for `all`; an error saying what is wrong.
fn gpu_ids(gpus: &str) -> std::result::Result<Option<Vec<String>>, String> {
    let gpus = gpus.trim();
    if gpus.eq_ignore_ascii_case("all") {
        return Ok(None);
    }
    let ids: Vec<String> = gpus.split(',').map(|s| s.trim().to_string()).collect();
    for id in &ids {
        let numeric = !id.is_empty() && id.chars().all(|c| c.is_ascii_digit());
        let uuid =
            (id.starts_with("GPU-") || id.starts_with("MIG-")) && !id.contains(char::is_whitespace);
        if !numeric && !uuid {
            return Err(format!(
                "{id:?} is not a GPU id: give comma-separated ids such as 0,1 (or GPU-/MIG- UUIDs), or all"
            ));
        }
    }
    for (i, id) in ids.iter().enumerate() {
        if ids[..i].contains(id) {
            return Err(format!("GPU {id} is named twice"));
        }
    }
    Ok(Some(ids))
}

/// The questions of `tchrun config`, one per line.
struct Questions<'a, R, W> {
    input: &'a mut R,
    output: &'a mut W,
}

impl<R: BufRead, W: Write> Questions<'_, R, W> {
    fn say(&mut self, line: &str) -> Result<()> {
        writeln!(self.output, "{line}").map_err(io_error)
    }

    /// Asks until `parse` accepts the answer. Enter keeps `current` (or, without one,
    /// gives `None`, shown as `unset`); `unset` itself is also accepted.
    fn text<T: std::fmt::Display>(
        &mut self,
        question: &str,
        current: Option<T>,
        unset: &str,
        parse: impl Fn(&str) -> std::result::Result<T, String>,
    ) -> Result<Option<T>> {
        loop {
            let shown = current
                .as_ref()
                .map_or_else(|| unset.to_string(), ToString::to_string);
            write!(self.output, "{question} [{shown}]: ").map_err(io_error)?;
            self.output.flush().map_err(io_error)?;
            let mut line = String::new();
            if self.input.read_line(&mut line).map_err(io_error)? == 0 {
                return Err(Error::Config(format!(
                    "no answer to {question:?}: the input ended"
                )));
            }
            let answer = line.trim();
            if answer.is_empty() {
                return Ok(current);
            }
            if answer == unset {
                return Ok(None);
            }
            match parse(answer) {
                Ok(value) => return Ok(Some(value)),
                Err(why) => self.say(&format!("  {answer:?}: {why}"))?,
            }
        }
    }

    fn number(
        &mut self,
        question: &str,
        current: Option<usize>,
        unset: &str,
        at_least: usize,
    ) -> Result<Option<usize>> {
        self.text(question, current, unset, |a| {
            a.parse()
                .ok()
                .filter(|&n| n >= at_least)
                .ok_or_else(|| format!("a number, at least {at_least}"))
        })
    }

    fn choice(
        &mut self,
        question: &str,
        current: Option<String>,
        choices: &[&str],
        unset: &str,
    ) -> Result<Option<String>> {
        self.text(question, current, unset, |a| {
            let a = a.to_ascii_lowercase();
            if choices.contains(&a.as_str()) {
                Ok(a)
            } else {
                Err(format!("one of {}, or {unset}", choices.join(", ")))
            }
        })
    }
}

fn io_error(source: std::io::Error) -> Error {
    Error::Io {
        context: "asking for the run configuration".into(),
        source,
    }
}

/// Where `tchrun` looks for its configuration file when `--config` is not given, read
/// through `var`: `TCH_DISTRIBUTED_CONFIG`, else
/// `$XDG_CONFIG_HOME/tch-distributed/config.toml`, else
/// `$HOME/.config/tch-distributed/config.toml` (the XDG base directory rule that
/// `accelerate config` also follows for its cache). `None` without `HOME`.
pub fn default_path_from(var: impl Fn(&str) -> Option<String>) -> Option<PathBuf> {
    let set = |name: &str| var(name).filter(|v| !v.is_empty());
    if let Some(path) = set(CONFIG_ENV) {
        return Some(PathBuf::from(path));
    }
    let base = set("XDG_CONFIG_HOME")
        .map(PathBuf::from)
        .filter(|p| p.is_absolute())
        .or_else(|| set("HOME").map(|home| Path::new(&home).join(".config")))?;
    Some(base.join("tch-distributed").join("config.toml"))
}

/// [`default_path_from`] this process's environment.
pub fn default_path() -> Option<PathBuf> {
    default_path_from(|name| std::env::var(name).ok())
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;

    fn vars(pairs: &[(&str, &str)]) -> impl Fn(&str) -> Option<String> {
        let map: HashMap<String, String> = pairs
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        move |k| map.get(k).cloned()
    }

    fn full() -> RunConfig {
        RunConfig {
            nproc_per_node: Some(2),
            nnodes: Some(2),
            node_rank: Some(1),
            master_addr: Some("10.0.0.1".into()),
            master_port: Some(29500),
            backend: Some("nccl".into()),
            gpus: Some("0,1".into()),
            mixed_precision: Some("bf16".into()),
            grad_accum: Some(4),
        }
    }

    #[test]
    fn the_file_round_trips() {
        let dir = std::env::temp_dir().join(format!("tchd-config-{}", std::process::id()));
        let path = dir.join("sub").join("config.toml");
        for config in [
            full(),
            RunConfig::default(),
            RunConfig {
                grad_accum: Some(3),
                ..RunConfig::default()
            },
        ] {
            config.save(&path).unwrap();
            assert_eq!(RunConfig::load(&path).unwrap(), config);
        }
        std::fs::remove_dir_all(&dir).unwrap();
        assert_eq!(
            full().to_toml(),
            format!(
                "{HEADER}nproc_per_node = 2\nnnodes = 2\nnode_rank = 1\nmaster_addr = \"10.0.0.1\"\n\
                 master_port = 29500\nbackend = \"nccl\"\ngpus = \"0,1\"\nmixed_precision = \"bf16\"\n\
                 grad_accum = 4\n"
            )
        );
    }

    #[test]
    fn bad_files_say_where() {
        let dir = std::env::temp_dir().join(format!("tchd-config-bad-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("config.toml");
        for (text, needle) in [
            ("grad_acum = 2\n", "unknown field `grad_acum`"),
            ("backend = \"mpi\"\n", "backend = \"mpi\" in "),
            ("grad_accum = \"four\"\n", "grad_accum"),
            ("mixed_precision = \"fp8\"\n", "use no, bf16, fp16 or auto"),
            ("gpus = \"0,zero\"\n", "\"zero\" is not a GPU id"),
        ] {
            std::fs::write(&path, text).unwrap();
            let e = RunConfig::load(&path).unwrap_err().to_string();
            assert!(e.contains(needle), "{text}: {e}");
            assert!(e.contains(&path.display().to_string()), "{text}: {e}");
        }
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn environment_variables() {
        let env = RunConfig::from_vars(vars(&[
            ("TCH_DISTRIBUTED_NPROC", "3"),
            ("TCH_DISTRIBUTED_BACKEND", "Gloo"),
            ("TCH_DISTRIBUTED_MIXED_PRECISION", "fp16"),
            ("TCH_DISTRIBUTED_GRAD_ACCUM", "2"),
            ("TCH_DISTRIBUTED_GPUS", "1,0"),
            ("TCH_DISTRIBUTED_MASTER_PORT", "29501"),
        ]))
        .unwrap();
        assert_eq!(env.nproc_per_node, Some(3));
        assert_eq!(env.backend.as_deref(), Some("gloo"));
        assert_eq!(env.master_port, Some(29501));
        assert_eq!(
            env.rank_env(),
            [
                ("TCH_DISTRIBUTED_BACKEND", "gloo"),
                ("TCH_DISTRIBUTED_MIXED_PRECISION", "fp16"),
                ("TCH_DISTRIBUTED_GRAD_ACCUM", "2"),
                ("CUDA_VISIBLE_DEVICES", "1,0"),
            ]
            .map(|(k, v)| (k.to_string(), v.to_string()))
        );
        let e = RunConfig::from_vars(vars(&[("TCH_DISTRIBUTED_GRAD_ACCUM", "x")]))
            .unwrap_err()
            .to_string();
        assert!(e.contains("TCH_DISTRIBUTED_GRAD_ACCUM=\"x\""), "{e}");
        let e = RunConfig::from_vars(vars(&[("TCH_DISTRIBUTED_GRAD_ACCUM", "0")]))
            .unwrap_err()
            .to_string();
        assert!(e.contains("TCH_DISTRIBUTED_GRAD_ACCUM=\"0\": "), "{e}");
    }

    #[test]
    fn flags_over_environment_over_file() {
        let flags = RunConfig {
            backend: Some("gloo".into()),
            ..RunConfig::default()
        };
        let env = RunConfig {
            backend: Some("nccl".into()),
            grad_accum: Some(3),
            ..RunConfig::default()
        };
        let merged = flags.or(env).or(full());
        assert_eq!(merged.backend.as_deref(), Some("gloo"));
        assert_eq!(merged.grad_accum, Some(3));
        assert_eq!(merged.mixed_precision.as_deref(), Some("bf16"));
    }

    #[test]
    fn gpus() {
        let c = |gpus: &str| RunConfig {
            gpus: Some(gpus.into()),
            ..RunConfig::default()
        };
        assert_eq!(c("0,1").nproc_or_default(), 2);
        assert_eq!(c("all").nproc_or_default(), 1);
        assert_eq!(c("all").rank_env(), []);
        assert_eq!(RunConfig::default().nproc_or_default(), 1);
        let three = RunConfig {
            nproc_per_node: Some(3),
            ..c("2,3")
        };
        assert_eq!(three.nproc_or_default(), 3);
        assert!(c("GPU-8f2e,MIG-1").validate(&Origin::Flags).is_ok());
        let e = c("0,0").validate(&Origin::Flags).unwrap_err().to_string();
        assert!(e.contains("--gpus 0,0: GPU 0 is named twice"), "{e}");
        assert!(c("").validate(&Origin::Flags).is_err());
    }

    #[test]
    fn default_path() {
        let p = |pairs: &[(&str, &str)]| default_path_from(vars(pairs));
        assert_eq!(
            p(&[("HOME", "/home/u")]),
            Some(PathBuf::from("/home/u/.config/tch-distributed/config.toml"))
        );
        assert_eq!(
            p(&[("HOME", "/home/u"), ("XDG_CONFIG_HOME", "/cfg")]),
            Some(PathBuf::from("/cfg/tch-distributed/config.toml"))
        );
        // A relative XDG_CONFIG_HOME is ignored, as the XDG rule says.
        assert_eq!(
            p(&[("HOME", "/home/u"), ("XDG_CONFIG_HOME", "cfg")]),
            Some(PathBuf::from("/home/u/.config/tch-distributed/config.toml"))
        );
        assert_eq!(
            p(&[("HOME", "/home/u"), (CONFIG_ENV, "/etc/run.toml")]),
            Some(PathBuf::from("/etc/run.toml"))
        );
        assert_eq!(p(&[]), None);
    }

    #[test]
    fn questions() {
        let answers = "2\n5\n1\n10.0.0.1\n\n29500\n0,1\n\nNCCL\nbf16\nprogram\n";
        let mut out = Vec::new();
        let c = RunConfig::ask(&mut answers.as_bytes(), &mut out, &RunConfig::default()).unwrap();
        let out = String::from_utf8(out).unwrap();
        assert_eq!(
            c,
            RunConfig {
                nnodes: Some(2),
                node_rank: Some(1),
                master_addr: Some("10.0.0.1".into()),
                master_port: Some(29500),
                gpus: Some("0,1".into()),
                nproc_per_node: None,
                backend: Some("nccl".into()),
                mixed_precision: Some("bf16".into()),
                grad_accum: None,
            },
            "{out}"
        );
        // Out of range, then an empty port (required): asked again.
        assert!(out.contains("the machines are numbered 0 to 1"), "{out}");
        assert!(
            out.contains("How many processes (ranks) per machine? [2]"),
            "{out}"
        );
        // Enter keeps what the file had; the input ending is an error.
        let mut out = Vec::new();
        let kept = RunConfig::ask(&mut "\n\n\n\n\n\n\n\n\n".as_bytes(), &mut out, &full());
        assert_eq!(kept.unwrap(), full());
        let e = RunConfig::ask(
            &mut "1\n".as_bytes(),
            &mut Vec::new(),
            &RunConfig::default(),
        )
        .unwrap_err()
        .to_string();
        assert!(e.contains("the input ended"), "{e}");
    }
}
