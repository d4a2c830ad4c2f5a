//! DeepSpeed's JSON configuration (`ds_config.json`): the `deepspeed` setting
//! (`tchrun --deepspeed FILE`, as the HF Trainer's `--deepspeed`) names one, and every
//! key of it has a meaning here: most give settings of the table ([`DeepSpeed::settings`]:
//! `zero_optimization.stage` is `zero`, `offload_optimizer`/`offload_param` are
//! `offload`, `reduce_bucket_size` is `reduce_bucket_mb`, `bf16`/`fp16` are
//! `mixed_precision`, `gradient_accumulation_steps` is `grad_accum`,
//! `gradient_clipping` is `gradient_clipping`); the batch sizes, the `optimizer` and
//! `scheduler` blocks and fp16's loss-scale keys are kept for the SDK, which applies
//! them to the optimizer that `.build` makes; a few keys change nothing here and are
//! listed once ([`DeepSpeed::advisory`]); any other key is an error that names it.
//!
//! `"auto"`, as the HF integration writes it, leaves a value to the run (the program's
//! learning rate, the run's accumulation, …): nothing is taken from the file for it.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use serde_json::{Map, Value as Json};

use crate::error::{Error, Result};
use crate::foreign::{self, object, unknown};
use crate::values::{MixedPrecision, MixedPrecisionMode};
use crate::Settings;

/// Bytes of an element of DeepSpeed's bucket sizes, which count elements: fp32
/// gradients.
const ELEMENT_BYTES: f64 = 4.0;

/// A DeepSpeed configuration, read (see the module's documentation).
#[derive(Clone, Debug, Default, PartialEq)]
pub struct DeepSpeed {
    /// The file it was read from.
    pub path: PathBuf,
    /// The settings its keys give.
    pub settings: Settings,
    /// For each setting it gives, the key that gives it (`zero` ←
    /// `zero_optimization.stage`), to name both in a conflict.
    pub sources: Vec<(&'static str, &'static str)>,
    /// `train_batch_size`, when not `"auto"`: samples per optimizer step over every
    /// rank.
    pub train_batch_size: Option<usize>,
    /// `train_micro_batch_size_per_gpu`, when not `"auto"`: samples per rank per
    /// micro-batch.
    pub micro_batch_size: Option<usize>,
    /// The `optimizer` block.
    pub optimizer: Option<OptimizerBlock>,
    /// The `scheduler` block.
    pub scheduler: Option<SchedulerBlock>,
    /// fp16's dynamic loss scaling, the keys given (`initial_scale_power`,
    /// `loss_scale_window`).
    pub loss_scaling: LossScaling,
    /// The keys given that change nothing here, each with why: one warning lists them.
    pub advisory: Vec<String>,
}

/// DeepSpeed's `optimizer` block: its `type` and the `params` given (not `"auto"`).
#[derive(Clone, Debug, Default, PartialEq)]
pub struct OptimizerBlock {
    /// `type`, lower-cased: `adam`, `adamw` or `sgd`.
    pub kind: String,
    pub lr: Option<f64>,
    /// `betas`: Adam's `(beta1, beta2)`.
    pub betas: Option<(f64, f64)>,
    pub eps: Option<f64>,
    pub weight_decay: Option<f64>,
    /// SGD's `momentum`.
    pub momentum: Option<f64>,
    /// `adam_w_mode` for `type: Adam`: DeepSpeed's Adam is AdamW unless it is false.
    pub adam_w_mode: Option<bool>,
}

/// DeepSpeed's `scheduler` block: its `type` and its `params` (numbers, `"auto"`
/// left out; `warmup_type`'s text kept).
#[derive(Clone, Debug, Default, PartialEq)]
pub struct SchedulerBlock {
    /// `type`, as written: `WarmupLR`, `WarmupDecayLR` or `WarmupCosineLR`.
    pub kind: String,
    /// The numeric parameters given, by name.
    pub params: BTreeMap<String, f64>,
    /// `warmup_type`: `log` or `linear`, when given.
    pub warmup_type: Option<String>,
}

/// fp16's dynamic loss scaling as DeepSpeed's keys give it (each `None` when left out),
/// for the SDK's `GradScaler`.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct LossScaling {
    /// `initial_scale_power`: the first scale is `2^power`.
    pub initial_scale_power: Option<u32>,
    /// `loss_scale_window`: clean steps before the scale doubles.
    pub loss_scale_window: Option<u64>,
}

/// The scheduler types DeepSpeed names that the SDK runs.
pub const SCHEDULERS: [&str; 3] = ["WarmupLR", "WarmupDecayLR", "WarmupCosineLR"];

impl DeepSpeed {
    /// Reads `path`.
    ///
    /// # Errors
    /// [`Error::Io`] when it cannot be read; [`Error::Config`] naming the file and the
    /// key when it is not JSON, a value is not what DeepSpeed takes, or a key is one the
    /// SDK does not read (with what to do).
    pub fn load(path: &Path) -> Result<DeepSpeed> {
        let text = foreign::read(path, "DeepSpeed")?;
        DeepSpeed::parse(path, &text)
    }

    /// Reads `text`, the contents of `path`.
    ///
    /// # Errors
    /// As [`load`](Self::load).
    pub fn parse(path: &Path, text: &str) -> Result<DeepSpeed> {
        let fail = |what: String| Error::Config(format!("{}: {what}", path.display()));
        let json: Json = serde_json::from_str(text).map_err(|e| {
            fail(format!(
                "not JSON ({e}): DeepSpeed's configuration is a JSON object"
            ))
        })?;
        let top = json
            .as_object()
            .ok_or_else(|| fail("not a JSON object".into()))?;
        let mut ds = DeepSpeed {
            path: path.to_path_buf(),
            ..DeepSpeed::default()
        };
        ds.read(top).map_err(fail)?;
        Ok(ds)
    }

    /// The settings `self` gives over `given` (the run's other sources): each value of
    /// the file where `given` has none.
    ///
    /// # Errors
    /// [`Error::Config`] naming both places when `given` sets a setting that the file
    /// sets to another value: a setting is given in one place.
    pub fn over(&self, given: Settings) -> Result<Settings> {
        let rows = self
            .sources
            .iter()
            .filter_map(|(key, source)| Some((crate::row(key)?, key, source)));
        for (row, key, source) in rows {
            if let (Some(run), Some(file)) = (row.text(&given), row.text(&self.settings)) {
                if run != file {
                    return Err(Error::Config(format!(
                        "{}: {source} gives {key} = {file}, and the run gives {key} = {run} \
                         (tchrun's flag, a TCH_DISTRIBUTED_* variable, the configuration file \
                         or the attribute): give it in one place, or write \"auto\" in the \
                         DeepSpeed file to take the run's",
                        self.path.display()
                    )));
                }
            }
        }
        Ok(given.or(self.settings.clone()))
    }

    /// Checks the batch sizes given against the run's accumulation and world size, as
    /// DeepSpeed checks `train_batch_size = train_micro_batch_size_per_gpu ×
    /// gradient_accumulation_steps × world size`; returns the micro-batch size they fix,
    /// if any.
    ///
    /// # Errors
    /// [`Error::Config`] naming the three values and the world size when they disagree.
    pub fn check_batch(&self, accumulation: usize, world_size: usize) -> Result<Option<usize>> {
        let per_micro_batch = accumulation * world_size;
        match (self.train_batch_size, self.micro_batch_size) {
            (Some(train), Some(micro)) if train != micro * per_micro_batch => {
                Err(Error::Config(format!(
                    "{}: train_batch_size {train} is not train_micro_batch_size_per_gpu {micro} \
                     × gradient_accumulation_steps {accumulation} × {world_size} ranks = {}: \
                     give consistent values, or \"auto\" for one of them",
                    self.path.display(),
                    micro * per_micro_batch
                )))
            }
            (Some(train), None) if train % per_micro_batch != 0 => Err(Error::Config(format!(
                "{}: train_batch_size {train} does not divide into gradient_accumulation_steps \
                 {accumulation} × {world_size} ranks: give a multiple of {per_micro_batch}, or \
                 \"auto\"",
                self.path.display()
            ))),
            (Some(train), None) => Ok(Some(train / per_micro_batch)),
            (_, micro) => Ok(micro),
        }
    }

    fn give(
        &mut self,
        key: &'static str,
        source: &'static str,
        text: &str,
    ) -> std::result::Result<(), String> {
        foreign::give(&mut self.settings, key, source, text)?;
        self.sources.push((key, source));
        Ok(())
    }

    fn note(&mut self, key: &str, why: &str) {
        self.advisory.push(format!("{key} ({why})"));
    }

    fn read(&mut self, top: &Map<String, Json>) -> std::result::Result<(), String> {
        let (mut fp16, mut bf16) = (None, None);
        for (key, value) in top {
            match key.as_str() {
                "train_batch_size" => self.train_batch_size = count(key, value)?,
                "train_micro_batch_size_per_gpu" => self.micro_batch_size = count(key, value)?,
                "gradient_accumulation_steps" => {
                    if let Some(k) = count(key, value)? {
                        self.give("grad_accum", "gradient_accumulation_steps", &k.to_string())?;
                    }
                }
                "gradient_clipping" => match number(key, value)? {
                    // DeepSpeed's 0: no clipping.
                    Some(max) if max > 0.0 => {
                        self.give("gradient_clipping", "gradient_clipping", &max.to_string())?
                    }
                    _ => {}
                },
                "zero_optimization" => self.zero(object(key, value)?)?,
                "fp16" => fp16 = Some(self.fp16(object(key, value)?)?),
                "bf16" | "bfloat16" => {
                    let block = object(key, value)?;
                    for (k, v) in block {
                        match k.as_str() {
                            "enabled" => bf16 = Some(flag(&format!("{key}.enabled"), v)?),
                            "immediate_grad_update" | "check_grad_overflow" => self.note(
                                &format!("{key}.{k}"),
                                "the step reads the gradients as they are",
                            ),
                            other => return Err(unknown("a DeepSpeed", &format!("{key}.{other}"))),
                        }
                    }
                }
                "optimizer" => self.optimizer = Some(optimizer(object(key, value)?)?),
                "scheduler" => self.scheduler = Some(scheduler(object(key, value)?)?),
                "steps_per_print" | "wall_clock_breakdown" | "memory_breakdown" | "dump_state" => {
                    self.note(key, "DeepSpeed's own logging: the SDK's Tracker logs a run")
                }
                "zero_allow_untested_optimizer" | "zero_force_ds_cpu_optimizer" => {
                    self.note(key, "every optimizer of the SDK shards")
                }
                "prescale_gradients" => self.note(
                    key,
                    "gradients are averaged in the collective, as with prescaling, up to rounding",
                ),
                other => return Err(unknown("a DeepSpeed", other)),
            }
        }
        // `enabled`: given, "auto" (the run decides), or no block at all.
        let (precision, source) = match (fp16, bf16) {
            (Some(Some(true)), Some(Some(true))) => {
                return Err(
                    "fp16.enabled and bf16.enabled are both true: enable one of them".into(),
                )
            }
            (_, Some(Some(true))) => (MixedPrecision::Bf16, "bf16.enabled"),
            (Some(Some(true)), _) => (MixedPrecision::Fp16, "fp16.enabled"),
            (Some(None), _) | (_, Some(None)) | (None, None) => return Ok(()),
            (Some(Some(false)), _) => (MixedPrecision::No, "fp16.enabled"),
            (_, Some(Some(false))) => (MixedPrecision::No, "bf16.enabled"),
        };
        let mode = MixedPrecisionMode::Exactly(precision);
        self.give("mixed_precision", source, &mode.to_string())
    }

    /// Reads the `fp16` block; returns `enabled`, when given.
    fn fp16(&mut self, block: &Map<String, Json>) -> std::result::Result<Option<bool>, String> {
        let mut enabled = None;
        for (k, v) in block {
            let key = format!("fp16.{k}");
            match k.as_str() {
                "enabled" => enabled = flag(&key, v)?,
                "loss_scale" => match number(&key, v)? {
                    Some(scale) if scale != 0.0 => {
                        return Err(format!(
                            "{key} = {scale}: a static loss scale is not supported: use 0 \
                             (dynamic loss scaling, the SDK's GradScaler)"
                        ))
                    }
                    _ => {}
                },
                "initial_scale_power" => {
                    self.loss_scaling.initial_scale_power = count(&key, v)?.map(|p| p as u32);
                }
                "loss_scale_window" => {
                    self.loss_scaling.loss_scale_window = count(&key, v)?.map(|w| w as u64);
                }
                "min_loss_scale" => self.note(
                    &key,
                    "the scale has no floor, as PyTorch's GradScaler: a run that overflows step \
                     after step stops with an error instead",
                ),
                "hysteresis" | "consecutive_hysteresis" => self.note(
                    &key,
                    "the scale halves at each overflow, as PyTorch's GradScaler",
                ),
                "auto_cast" => self.note(&key, "the forward pass runs under autocast"),
                _ => return Err(unknown("a DeepSpeed", &key)),
            }
        }
        Ok(enabled)
    }

    fn zero(&mut self, block: &Map<String, Json>) -> std::result::Result<(), String> {
        let mut reduce = None;
        let mut gather = None;
        let (mut optimizer, mut param) = (false, false);
        for (k, v) in block {
            let key = format!("zero_optimization.{k}");
            match k.as_str() {
                "stage" => {
                    if let Some(stage) = count(&key, v)? {
                        self.give("zero", "zero_optimization.stage", &stage.to_string())?;
                    }
                }
                "offload_optimizer" => optimizer = self.offload(&key, object(&key, v)?)?,
                "offload_param" => param = self.offload(&key, object(&key, v)?)?,
                "reduce_bucket_size" => reduce = number(&key, v)?,
                "allgather_bucket_size" => gather = number(&key, v)?,
                "overlap_comm" => self.note(
                    &key,
                    "each bucket is reduce-scattered as soon as its gradients are ready, during \
                     the backward pass",
                ),
                "contiguous_gradients" => self.note(
                    &key,
                    "gradients are copied into their bucket's buffer as they are reduced",
                ),
                "allgather_partitions" | "reduce_scatter" => self.note(
                    &key,
                    "parameters are all-gathered and gradients reduce-scattered",
                ),
                "round_robin_gradients"
                | "sub_group_size"
                | "stage3_max_live_parameters"
                | "stage3_max_reuse_distance"
                | "stage3_prefetch_bucket_size"
                | "stage3_param_persistence_threshold"
                | "stage3_gather_16bit_weights_on_model_save"
                | "stage3_gather_fp16_weights_on_model_save"
                | "elastic_checkpoint"
                | "load_from_fp32_weights"
                | "ignore_unused_parameters" => self.note(
                    &key,
                    "the units (fully_shard) decide what is gathered when, a save writes the \
                     fp32 weights, and variables without gradients are handled",
                ),
                _ => return Err(unknown("a DeepSpeed", &key)),
            }
        }
        if let Some((source, value)) = foreign::offload(
            param.then_some("zero_optimization.offload_param"),
            optimizer.then_some("zero_optimization.offload_optimizer"),
        ) {
            self.give("offload", source, value)?;
        }
        // DeepSpeed has two caps; here one caps both the reduce-scatters and the gathers.
        if let Some(elements) = reduce.or(gather) {
            if let (Some(r), Some(g)) = (reduce, gather) {
                if r != g {
                    self.note(
                        "zero_optimization.allgather_bucket_size",
                        "one bucket cap serves both here: reduce_bucket_size's",
                    );
                }
            }
            let mib = elements * ELEMENT_BYTES / (1 << 20) as f64;
            self.give(
                "reduce_bucket_mb",
                "zero_optimization.reduce_bucket_size",
                &mib.to_string(),
            )?;
        }
        Ok(())
    }

    /// Reads an `offload_optimizer` or `offload_param` block; returns whether it
    /// offloads (`device: "cpu"`).
    fn offload(
        &mut self,
        key: &str,
        block: &Map<String, Json>,
    ) -> std::result::Result<bool, String> {
        let mut cpu = false;
        for (k, v) in block {
            let inner = format!("{key}.{k}");
            match k.as_str() {
                "device" => match v.as_str() {
                    Some("none") => cpu = false,
                    Some("cpu") => cpu = true,
                    Some("nvme") => {
                        return Err(format!(
                            "{inner} = \"nvme\": offload to NVMe is not supported: use \"cpu\""
                        ))
                    }
                    _ => return Err(format!("{inner}: use \"cpu\" or \"none\"")),
                },
                "pin_memory" => {
                    if flag(&inner, v)? == Some(false) {
                        self.note(
                            &inner,
                            "offloaded memory is always pinned, for copies that do not wait",
                        );
                    }
                }
                "buffer_count" | "buffer_size" | "fast_init" | "ratio" | "max_in_cpu"
                | "nvme_path" => self.note(
                    &inner,
                    "CPU offload here keeps every offloaded shard in host memory",
                ),
                _ => return Err(unknown("a DeepSpeed", &inner)),
            }
        }
        Ok(cpu)
    }
}

fn optimizer(block: &Map<String, Json>) -> std::result::Result<OptimizerBlock, String> {
    let mut out = OptimizerBlock::default();
    for (k, v) in block {
        match k.as_str() {
            "type" => {
                let kind = v
                    .as_str()
                    .ok_or("optimizer.type: a name such as \"AdamW\" is needed")?;
                out.kind = kind.to_ascii_lowercase();
                if !["adam", "adamw", "sgd"].contains(&out.kind.as_str()) {
                    return Err(format!(
                        "optimizer.type = \"{kind}\": the SDK's optimizers are Adam, AdamW and SGD \
                         (the one .build makes): use one of them"
                    ));
                }
            }
            "params" => {
                for (p, value) in object("optimizer.params", v)? {
                    let key = format!("optimizer.params.{p}");
                    match p.as_str() {
                        "lr" => out.lr = number(&key, value)?,
                        "eps" => out.eps = number(&key, value)?,
                        "weight_decay" => out.weight_decay = number(&key, value)?,
                        "momentum" => out.momentum = number(&key, value)?,
                        "betas" => {
                            if !is_auto(value) {
                                let pair = value.as_array().filter(|a| a.len() == 2);
                                let pair = pair
                                    .and_then(|a| Some((a[0].as_f64()?, a[1].as_f64()?)))
                                    .ok_or(format!(
                                        "{key}: two numbers ([0.9, 0.999]) or \"auto\""
                                    ))?;
                                out.betas = Some(pair);
                            }
                        }
                        "adam_w_mode" => out.adam_w_mode = flag(&key, value)?,
                        "torch_adam" | "fused" => {}
                        _ => return Err(unknown("a DeepSpeed", &key)),
                    }
                }
            }
            other => return Err(unknown("a DeepSpeed", &format!("optimizer.{other}"))),
        }
    }
    if out.kind.is_empty() {
        return Err("optimizer: a type (\"AdamW\", \"Adam\" or \"SGD\") is needed".into());
    }
    Ok(out)
}

fn scheduler(block: &Map<String, Json>) -> std::result::Result<SchedulerBlock, String> {
    let mut out = SchedulerBlock::default();
    for (k, v) in block {
        match k.as_str() {
            "type" => {
                let kind = v.as_str().unwrap_or_default();
                if !SCHEDULERS.contains(&kind) {
                    return Err(format!(
                        "scheduler.type = {v}: the SDK runs DeepSpeed's {}: use one of them",
                        SCHEDULERS.join(", ")
                    ));
                }
                out.kind = kind.to_string();
            }
            "params" => {
                for (p, value) in object("scheduler.params", v)? {
                    let key = format!("scheduler.params.{p}");
                    match p.as_str() {
                        "warmup_type" => {
                            let t = value.as_str().filter(|t| ["log", "linear"].contains(t));
                            out.warmup_type = Some(
                                t.ok_or(format!("{key}: \"log\" or \"linear\""))?
                                    .to_string(),
                            );
                        }
                        "warmup_min_lr" | "warmup_max_lr" | "warmup_num_steps"
                        | "total_num_steps" | "warmup_min_ratio" | "cos_min_ratio" => {
                            if let Some(n) = number(&key, value)? {
                                out.params.insert(p.clone(), n);
                            }
                        }
                        "last_batch_iteration" => {}
                        _ => return Err(unknown("a DeepSpeed", &key)),
                    }
                }
            }
            other => return Err(unknown("a DeepSpeed", &format!("scheduler.{other}"))),
        }
    }
    if out.kind.is_empty() {
        return Err(format!(
            "scheduler: a type ({}) is needed",
            SCHEDULERS.join(", ")
        ));
    }
    Ok(out)
}

fn is_auto(value: &Json) -> bool {
    value.as_str() == Some("auto")
}

fn number(key: &str, value: &Json) -> std::result::Result<Option<f64>, String> {
    if is_auto(value) {
        return Ok(None);
    }
    value
        .as_f64()
        .map(Some)
        .ok_or_else(|| format!("{key} = {value}: a number or \"auto\" is needed"))
}

fn count(key: &str, value: &Json) -> std::result::Result<Option<usize>, String> {
    match number(key, value)? {
        None => Ok(None),
        Some(n) if n >= 0.0 && n.fract() == 0.0 => Ok(Some(n as usize)),
        Some(_) => Err(format!(
            "{key} = {value}: a whole number or \"auto\" is needed"
        )),
    }
}

fn flag(key: &str, value: &Json) -> std::result::Result<Option<bool>, String> {
    if is_auto(value) {
        return Ok(None);
    }
    value
        .as_bool()
        .map(Some)
        .ok_or_else(|| format!("{key} = {value}: true, false or \"auto\" is needed"))
}
