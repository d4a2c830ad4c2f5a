//! Accelerate's configuration file (`default_config.yaml`, written by `accelerate
//! config`, or JSON by `accelerate config default`) read into the run's settings:
//! `tchrun --config default_config.yaml` (a `.yaml`, `.yml` or `.json` file is
//! Accelerate's; any other is tch-distributed's TOML). Every key has a meaning: most
//! give settings of the table (`num_processes` and `num_machines` give
//! `nproc_per_node`, `mixed_precision`, `gpu_ids`, `main_process_ip`, …;
//! `distributed_type: FSDP` with its `fsdp_config` gives `zero`, `shard_group` and
//! `offload`; `DEEPSPEED` with its `deepspeed_config` gives those and `deepspeed`),
//! some change nothing here and are listed ([`Accelerate::advisory`]), any other is an
//! error that names it.

use std::path::Path;

use serde_json::{Map, Value as Json};
use yaml_rust2::{Yaml, YamlLoader};

use crate::error::{Error, Result};
use crate::foreign::{self, object, unknown};
use crate::Settings;

/// An Accelerate configuration, read.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Accelerate {
    /// The settings its keys give.
    pub settings: Settings,
    /// The keys given that change nothing here, each with why.
    pub advisory: Vec<String>,
}

impl Accelerate {
    /// Reads `path`.
    ///
    /// # Errors
    /// [`Error::Io`] when it cannot be read; [`Error::Config`] naming the file and the
    /// key when it is not YAML, a value is not what Accelerate writes, or a key is one
    /// the SDK does not read.
    pub fn load(path: &Path) -> Result<Accelerate> {
        let text = foreign::read(path, "Accelerate")?;
        Accelerate::parse(path, &text)
    }

    /// Reads `text`, the contents of `path`.
    ///
    /// # Errors
    /// As [`load`](Self::load).
    pub fn parse(path: &Path, text: &str) -> Result<Accelerate> {
        let fail = |what: String| Error::Config(format!("{}: {what}", path.display()));
        let docs = YamlLoader::load_from_str(text).map_err(|e| {
            fail(format!(
                "not YAML ({e}): Accelerate's configuration is a YAML (or JSON) mapping"
            ))
        })?;
        let top = docs.first().map(json).unwrap_or(Json::Null);
        let top = top
            .as_object()
            .ok_or_else(|| fail("not a mapping of keys to values".into()))?;
        let mut out = Accelerate::default();
        out.read(top).map_err(fail)?;
        Ok(out)
    }

    fn give(&mut self, key: &str, source: &str, text: &str) -> std::result::Result<(), String> {
        foreign::give(&mut self.settings, key, source, text)
    }

    fn note(&mut self, key: &str, why: &str) {
        self.advisory.push(format!("{key} ({why})"));
    }

    fn read(&mut self, top: &Map<String, Json>) -> std::result::Result<(), String> {
        let kind = top
            .get("distributed_type")
            .and_then(Json::as_str)
            .unwrap_or("NO");
        let (mut processes, mut machines) = (None, 1);
        for (key, value) in top {
            let text = text(value);
            match key.as_str() {
                "compute_environment" if text == "LOCAL_MACHINE" => {}
                "compute_environment" => {
                    return Err(format!(
                        "compute_environment = {text}: tchrun launches on the machines it runs \
                         on (LOCAL_MACHINE); run it on each node"
                    ))
                }
                "distributed_type" => match kind {
                    "NO" | "MULTI_GPU" | "FSDP" | "DEEPSPEED" => {}
                    "MULTI_CPU" => self.give("backend", key, "gloo")?,
                    other => {
                        return Err(format!(
                            "distributed_type = {other}: use NO, MULTI_CPU, MULTI_GPU, FSDP or \
                             DEEPSPEED"
                        ))
                    }
                },
                "num_processes" => processes = value.as_i64().filter(|&n| n > 0),
                "num_machines" => {
                    machines = value.as_i64().filter(|&n| n > 0).ok_or(format!(
                        "num_machines = {text}: a number of machines is needed"
                    ))?;
                    self.give("nnodes", key, &machines.to_string())?;
                }
                "machine_rank" => self.give("node_rank", key, &text)?,
                "main_process_ip" if !value.is_null() => self.give("master_addr", key, &text)?,
                "main_process_port" if !value.is_null() => self.give("master_port", key, &text)?,
                "main_process_ip" | "main_process_port" => {}
                "gpu_ids" if !value.is_null() => self.give("gpus", key, &text)?,
                "gpu_ids" => {}
                "mixed_precision" => match text.as_str() {
                    "no" | "fp16" | "bf16" => self.give("mixed_precision", key, &text)?,
                    other => {
                        return Err(format!("mixed_precision = {other}: use no, fp16 or bf16"))
                    }
                },
                "debug" => {
                    if value.as_bool() == Some(true) {
                        self.give("debug", key, "detail")?;
                    }
                }
                "rdzv_backend" if text == "static" => {}
                "rdzv_backend" => {
                    return Err(format!(
                        "rdzv_backend = {text}: the rendezvous is static, at the main process's \
                         address: use static"
                    ))
                }
                "fsdp_config" if kind == "FSDP" => self.fsdp(object(key, value)?)?,
                "deepspeed_config" if kind == "DEEPSPEED" => self.deepspeed(object(key, value)?)?,
                "fsdp_config" | "deepspeed_config" => self.note(key, "not this distributed_type's"),
                "parallelism_config" => self.parallelism(object(key, value)?)?,
                "use_cpu" => {
                    if value.as_bool() == Some(true) {
                        self.note(
                            key,
                            "the ranks use the GPUs they see: CUDA_VISIBLE_DEVICES= keeps them on \
                             the CPU",
                        );
                    }
                }
                // What Accelerate writes into every file, for its own launcher.
                "same_network" | "main_training_function" => {}
                "enable_cpu_affinity"
                | "downcast_bf16"
                | "dynamo_config"
                | "mpirun_config"
                | "ipex_config"
                | "tpu_use_cluster"
                | "tpu_use_sudo"
                | "tpu_name"
                | "tpu_zone"
                | "tpu_vm"
                | "tpu_env"
                | "commands"
                | "command_file" => {
                    if !is_off(value) {
                        self.note(key, "Accelerate's own; nothing to do here");
                    }
                }
                other => return Err(unknown("an Accelerate", other)),
            }
        }
        if let Some(n) = processes {
            if n % machines != 0 {
                return Err(format!(
                    "num_processes = {n} (every machine's) does not divide into num_machines = \
                     {machines}: give every machine the same number of processes"
                ));
            }
            self.give(
                "nproc_per_node",
                "num_processes",
                &(n / machines).to_string(),
            )?;
        }
        Ok(())
    }

    /// `fsdp_config`: FSDP2's `reshard_after_forward` (or FSDP1's sharding strategy) is
    /// the ZeRO stage, hybrid strategies shard within a node, `fsdp_offload_params` is
    /// CPU offload.
    fn fsdp(&mut self, block: &Map<String, Json>) -> std::result::Result<(), String> {
        // FULL_SHARD unless said otherwise.
        let mut stage = 3;
        for (k, v) in block {
            let key = format!("fsdp_config.{k}");
            let text = text(v);
            match k.as_str() {
                "fsdp_version" => {}
                "fsdp_reshard_after_forward" | "fsdp_sharding_strategy" => {
                    let (zero, hybrid) = match text.as_str() {
                        "true" | "FULL_SHARD" | "1" => (3, false),
                        "false" | "SHARD_GRAD_OP" | "2" => (2, false),
                        "NO_SHARD" | "3" => (0, false),
                        "HYBRID_SHARD" | "4" => (3, true),
                        "_HYBRID_SHARD_ZERO2" | "5" => (2, true),
                        other => {
                            return Err(format!("{key} = {other}: not an FSDP sharding strategy"))
                        }
                    };
                    stage = zero;
                    if hybrid {
                        self.give("shard_group", &key, "node")?;
                    }
                }
                "fsdp_offload_params" => {
                    if v.as_bool() == Some(true) {
                        self.give("offload", &key, "all")?;
                    }
                }
                "fsdp_auto_wrap_policy"
                | "fsdp_transformer_layer_cls_to_wrap"
                | "fsdp_min_num_params" => self.note(
                    &key,
                    "the units are the modules the program wraps in fully_shard",
                ),
                "fsdp_activation_checkpointing" => {
                    self.note(&key, "the program wraps its blocks in checkpointed")
                }
                "fsdp_state_dict_type"
                | "fsdp_cpu_ram_efficient_loading"
                | "fsdp_use_orig_params"
                | "fsdp_sync_module_states"
                | "fsdp_forward_prefetch"
                | "fsdp_backward_prefetch" => self.note(
                    &key,
                    "units are sharded as they are built, every rank gets rank 0's values, \
                         the next unit is prefetched, and checkpoints hold each rank's shards",
                ),
                _ => return Err(unknown("an Accelerate", &key)),
            }
        }
        self.give("zero", "fsdp_config", &stage.to_string())
    }

    /// `deepspeed_config`: Accelerate's own keys, or the `ds_config.json` it names.
    fn deepspeed(&mut self, block: &Map<String, Json>) -> std::result::Result<(), String> {
        let (mut param, mut optimizer) = (false, false);
        for (k, v) in block {
            let key = format!("deepspeed_config.{k}");
            let text = text(v);
            match k.as_str() {
                "deepspeed_config_file" => self.give("deepspeed", &key, &text)?,
                "zero_stage" => self.give("zero", &key, &text)?,
                "gradient_accumulation_steps" => self.give("grad_accum", &key, &text)?,
                "gradient_clipping" => self.give("gradient_clipping", &key, &text)?,
                "offload_optimizer_device" | "offload_param_device" => {
                    let cpu = match text.as_str() {
                        "none" => false,
                        "cpu" => true,
                        other => return Err(format!("{key} = {other}: use none or cpu")),
                    };
                    if k == "offload_param_device" {
                        param = cpu;
                    } else {
                        optimizer = cpu;
                    }
                }
                "zero3_init_flag"
                | "zero3_save_16bit_model"
                | "deepspeed_multinode_launcher"
                | "deepspeed_hostfile"
                | "deepspeed_exclusion_filter"
                | "deepspeed_inclusion_filter" => self.note(
                    &key,
                    "units are sharded as they are built, saves write fp32, and tchrun launches",
                ),
                _ => return Err(unknown("an Accelerate", &key)),
            }
        }
        match foreign::offload(
            param.then_some("deepspeed_config.offload_param_device"),
            optimizer.then_some("deepspeed_config.offload_optimizer_device"),
        ) {
            Some((source, value)) => self.give("offload", source, value),
            None => Ok(()),
        }
    }

    /// `parallelism_config`: data parallelism's shard size is hybrid sharding's group;
    /// tensor and context parallelism are not there.
    fn parallelism(&mut self, block: &Map<String, Json>) -> std::result::Result<(), String> {
        for (k, v) in block {
            let key = format!("parallelism_config.{k}");
            let size = v.as_i64().unwrap_or(1);
            match k.as_str() {
                "parallelism_config_dp_shard_size" if size > 1 => {
                    self.give("shard_group", &key, &size.to_string())?
                }
                "parallelism_config_dp_replicate_size" | "parallelism_config_dp_shard_size" => {}
                "parallelism_config_tp_size" | "parallelism_config_cp_size" if size <= 1 => {}
                "parallelism_config_tp_size" | "parallelism_config_cp_size" => {
                    return Err(format!(
                        "{key} = {size}: tensor and context parallelism are not supported: use 1"
                    ))
                }
                _ => return Err(unknown("an Accelerate", &key)),
            }
        }
        Ok(())
    }
}

/// A YAML value as JSON.
fn json(y: &Yaml) -> Json {
    match y {
        Yaml::Real(r) => r.parse::<f64>().map_or(Json::Null, Json::from),
        Yaml::Integer(i) => Json::from(*i),
        Yaml::String(s) => Json::from(s.as_str()),
        Yaml::Boolean(b) => Json::from(*b),
        Yaml::Array(a) => Json::Array(a.iter().map(json).collect()),
        Yaml::Hash(h) => Json::Object(
            h.iter()
                .map(|(k, v)| {
                    (
                        k.as_str().map_or_else(|| format!("{k:?}"), str::to_string),
                        json(v),
                    )
                })
                .collect(),
        ),
        _ => Json::Null,
    }
}

/// A value as a setting's text: a string's contents, else its JSON.
fn text(value: &Json) -> String {
    value
        .as_str()
        .map_or_else(|| value.to_string(), str::to_string)
}

/// `false`, `null`, `"no"`, `"NO"`, an empty list or mapping: what Accelerate writes for
/// a key it leaves off.
fn is_off(value: &Json) -> bool {
    match value {
        Json::Null | Json::Bool(false) => true,
        Json::String(s) => s.eq_ignore_ascii_case("no") || s.is_empty(),
        Json::Array(a) => a.is_empty(),
        Json::Object(o) => o.is_empty(),
        _ => false,
    }
}
