use super::file::HEADER;
use super::*;
use std::collections::HashMap;
use std::path::PathBuf;

fn vars(pairs: &[(&str, &str)]) -> impl Fn(&str) -> Option<String> {
    let map: HashMap<String, String> = pairs
        .iter()
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect();
    move |k| map.get(k).cloned()
}

fn full() -> Settings {
    Settings {
        nproc_per_node: Some(2),
        nnodes: Some(2),
        node_rank: Some(1),
        master_addr: Some("10.0.0.1".into()),
        master_port: Some(29500),
        backend: Some(Backend::Nccl),
        gpus: Some(Gpus("0,1".into())),
        mixed_precision: Some(MixedPrecisionMode::Exactly(MixedPrecision::Bf16)),
        grad_accum: Some(4),
        ..Settings::default()
    }
}

#[test]
fn every_row_has_its_names_once_and_a_variable_under_the_prefix() {
    for (i, row) in TABLE.iter().enumerate() {
        assert!(row.var.starts_with("TCH_DISTRIBUTED_"), "{}", row.key);
        assert!(
            !row.doc.trim().is_empty() && !row.default.is_empty(),
            "{}",
            row.key
        );
        for other in &TABLE[..i] {
            assert_ne!(row.key, other.key);
            assert_ne!(row.var, other.var);
            assert!(row.flag.is_none() || row.flag != other.flag, "{}", row.key);
        }
    }
}

#[test]
fn every_value_written_back_reads_the_same() {
    let mut all = full();
    for row in TABLE {
        if row.text(&all).is_none() {
            row.set(&mut all, good(row)).unwrap();
        }
    }
    let env: HashMap<String, String> = all.rank_env().into_iter().collect();
    assert_eq!(Settings::from_vars(|k| env.get(k).cloned()).unwrap(), all);
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("config.toml");
    std::fs::write(&path, all.to_toml()).unwrap();
    // The file leaves out the rows it does not take.
    let mut in_file = Settings::default();
    for row in TABLE.iter().filter(|r| r.file) {
        row.set(&mut in_file, &row.text(&all).unwrap()).unwrap();
    }
    assert!(in_file.job_token.is_none() && in_file.record.is_none());
    assert_eq!(Settings::load(&path).unwrap(), in_file);
}

#[test]
fn the_file_round_trips() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("config.toml");
    for config in [
        full(),
        Settings::default(),
        Settings {
            grad_accum: Some(3),
            ..Settings::default()
        },
    ] {
        std::fs::write(&path, config.to_toml()).unwrap();
        assert_eq!(Settings::load(&path).unwrap(), config);
    }
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
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("config.toml");
    for (text, needle) in [
        ("grad_acum = 2\n", "unknown field `grad_acum`"),
        ("backend = \"mpi\"\n", "backend = \"mpi\" in "),
        ("grad_accum = \"four\"\n", "grad_accum"),
        ("grad_accum = 0\n", "grad_accum = \"0\" in "),
        ("mixed_precision = \"fp8\"\n", "use no, bf16, fp16 or auto"),
        ("gpus = \"0,zero\"\n", "\"zero\" is not a GPU id"),
        ("zero = 4\n", "use 1 (optimizer state sharded"),
    ] {
        std::fs::write(&path, text).unwrap();
        let e = Settings::load(&path).unwrap_err().to_string();
        assert!(e.contains(needle), "{text}: {e}");
        assert!(e.contains(&path.display().to_string()), "{text}: {e}");
    }
}

#[test]
fn environment_variables() {
    let env = Settings::from_vars(vars(&[
        ("TCH_DISTRIBUTED_NPROC", "3"),
        ("TCH_DISTRIBUTED_BACKEND", "Gloo"),
        ("TCH_DISTRIBUTED_MIXED_PRECISION", "fp16"),
        ("TCH_DISTRIBUTED_GRAD_ACCUM", "2"),
        ("TCH_DISTRIBUTED_GPUS", "1,0"),
        ("TCH_DISTRIBUTED_MASTER_PORT", "29501"),
        ("TCH_DISTRIBUTED_TIMEOUT", " "),
    ]))
    .unwrap();
    assert_eq!(env.nproc_per_node, Some(3));
    assert_eq!(env.backend, Some(Backend::Gloo));
    assert_eq!(env.master_port, Some(29501));
    assert_eq!(env.timeout, None, "an empty variable is unset");
    assert_eq!(
        env.rank_env(),
        [
            ("TCH_DISTRIBUTED_NPROC", "3"),
            ("TCH_DISTRIBUTED_MASTER_PORT", "29501"),
            ("TCH_DISTRIBUTED_BACKEND", "gloo"),
            ("TCH_DISTRIBUTED_GPUS", "1,0"),
            ("TCH_DISTRIBUTED_MIXED_PRECISION", "fp16"),
            ("TCH_DISTRIBUTED_GRAD_ACCUM", "2"),
            ("CUDA_VISIBLE_DEVICES", "1,0"),
        ]
        .map(|(k, v)| (k.to_string(), v.to_string()))
    );
    let e = Settings::from_vars(vars(&[("TCH_DISTRIBUTED_GRAD_ACCUM", "x")]))
        .unwrap_err()
        .to_string();
    assert!(e.contains("TCH_DISTRIBUTED_GRAD_ACCUM=\"x\""), "{e}");
    let e = Settings::from_vars(vars(&[("TCH_DISTRIBUTED_GRAD_ACCUM", "0")]))
        .unwrap_err()
        .to_string();
    assert!(e.contains("TCH_DISTRIBUTED_GRAD_ACCUM=\"0\": "), "{e}");
    let e = Settings::from_vars(vars(&[("TCH_DISTRIBUTED_TIMEOUT", "-1")]))
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("TCH_DISTRIBUTED_TIMEOUT=\"-1\": a positive number"),
        "{e}"
    );
}

#[test]
fn flags_over_environment_over_file() {
    let flags = Settings {
        backend: Some(Backend::Gloo),
        ..Settings::default()
    };
    let env = Settings {
        backend: Some(Backend::Nccl),
        grad_accum: Some(3),
        ..Settings::default()
    };
    let merged = flags.or(env).or(full());
    assert_eq!(merged.backend, Some(Backend::Gloo));
    assert_eq!(merged.grad_accum, Some(3));
    assert_eq!(
        merged.mixed_precision,
        Some(MixedPrecisionMode::Exactly(MixedPrecision::Bf16))
    );
}

#[test]
fn gpus() {
    let c = |gpus: &str| Settings {
        gpus: Some(Gpus::parse(gpus).unwrap()),
        ..Settings::default()
    };
    assert_eq!(c("0,1").nproc_or_default(), 2);
    assert_eq!(c("all").nproc_or_default(), 1);
    assert_eq!(
        c("all").rank_env(),
        [("TCH_DISTRIBUTED_GPUS".into(), "all".into())]
    );
    assert_eq!(Settings::default().nproc_or_default(), 1);
    let three = Settings {
        nproc_per_node: Some(3),
        ..c("2,3")
    };
    assert_eq!(three.nproc_or_default(), 3);
    assert!(Gpus::parse("GPU-8f2e,MIG-1").is_ok());
    let row = row("gpus").unwrap();
    let e = row.set(&mut Settings::default(), "0,0").unwrap_err();
    assert_eq!(
        Origin::Flags.bad(row, "0,0", &e).to_string(),
        "--gpus 0,0: GPU 0 is named twice"
    );
    assert!(Gpus::parse("").is_err());
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
    let c = Settings::ask(&mut answers.as_bytes(), &mut out, &Settings::default()).unwrap();
    let out = String::from_utf8(out).unwrap();
    assert_eq!(
        c,
        Settings {
            nnodes: Some(2),
            node_rank: Some(1),
            master_addr: Some("10.0.0.1".into()),
            master_port: Some(29500),
            gpus: Some(Gpus("0,1".into())),
            nproc_per_node: None,
            backend: Some(Backend::Nccl),
            mixed_precision: Some(MixedPrecisionMode::Exactly(MixedPrecision::Bf16)),
            grad_accum: None,
            ..Settings::default()
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
    let kept = Settings::ask(&mut "\n\n\n\n\n\n\n\n\n".as_bytes(), &mut out, &full());
    assert_eq!(kept.unwrap(), full());
    let e = Settings::ask(&mut "1\n".as_bytes(), &mut Vec::new(), &Settings::default())
        .unwrap_err()
        .to_string();
    assert!(e.contains("the input ended"), "{e}");
}

/// A value that `row` takes, for the tests that walk the table.
fn good(row: &Setting) -> &'static str {
    match row.value_name {
        "BOOL" => "true",
        "SECONDS" | "MIB" => "2.5",
        "IMPL" => "foreach",
        "LEVEL" => "detail",
        "HOOK" => "bf16",
        "BACKEND" => "nccl",
        "MODE" => "bf16",
        "IDS" => "0,1",
        "ADDR" => "10.0.0.1",
        "WHAT" => "optimizer",
        _ => "3",
    }
}

/// A value that `row` refuses, if any (a free-text row takes every value).
fn bad(row: &Setting) -> Option<&'static str> {
    ["bogus value", "0", "-1"]
        .into_iter()
        .find(|text| row.set(&mut Settings::default(), text).is_err())
}

/// The `allowed` part of a setting's error.
fn allowed(e: Error) -> String {
    match e {
        Error::Setting { allowed, .. } => allowed,
        other => panic!("not a setting's error: {other}"),
    }
}

/// Every row, through every place that gives it: the attribute (what its macro checks at
/// compile time and the entry reads at run time, `Settings::from_attribute`), `tchrun`'s
/// flag, the variable and the configuration file's key. Each reads the same value from
/// the same text, and refuses the same bad text with the same message, the row's.
#[test]
fn every_row_reads_alike_and_fails_alike_wherever_it_is_given() {
    use clap::{Args, FromArgMatches};
    let cli = |args: &[String]| -> std::result::Result<Settings, String> {
        let cmd = Settings::augment_args(clap::Command::new("tchrun").no_binary_name(true));
        let matches = cmd.try_get_matches_from(args).map_err(|e| e.to_string())?;
        Settings::from_arg_matches(&matches).map_err(|e| e.to_string())
    };
    let dir = tempfile::tempdir().unwrap();
    let file = |key: &str, text: &str| -> Result<Settings> {
        let path = dir.path().join("config.toml");
        std::fs::write(&path, format!("{key} = {text:?}\n")).unwrap();
        Settings::load(&path)
    };
    let mut free_text = Vec::new();
    for row in TABLE {
        let text = good(row);
        let mut want = Settings::default();
        row.set(&mut want, text)
            .unwrap_or_else(|e| panic!("{}: {text:?}: {e}", row.key));
        assert_eq!(
            Settings::from_vars(vars(&[(row.var, text)])).unwrap(),
            want,
            "{}",
            row.key
        );
        if row.attribute {
            assert_eq!(
                Settings::from_attribute([(row.key, text)]).unwrap(),
                want,
                "{}",
                row.key
            );
        }
        if row.file {
            assert_eq!(file(row.key, text).unwrap(), want, "{}", row.key);
        }
        if let Some(flag) = row.flag {
            assert_eq!(
                cli(&[format!("--{flag}={text}")]).unwrap(),
                want,
                "{}",
                row.key
            );
        }

        let Some(text) = bad(row) else {
            free_text.push(row.key);
            continue;
        };
        let why = row.set(&mut Settings::default(), text).unwrap_err();
        let from_var = Settings::from_vars(vars(&[(row.var, text)])).unwrap_err();
        assert_eq!(
            from_var.to_string(),
            format!("{}={text:?}: {why}", row.var),
            "{}",
            row.key
        );
        if row.attribute {
            let e = Settings::from_attribute([(row.key, text)]).unwrap_err();
            assert_eq!(allowed(e), why, "{}", row.key);
        }
        if row.file {
            assert_eq!(
                allowed(file(row.key, text).unwrap_err()),
                why,
                "{}",
                row.key
            );
        }
        if let Some(flag) = row.flag {
            let e = cli(&[format!("--{flag}={text}")]).unwrap_err();
            assert!(e.contains(&why), "--{flag}={text}: {e}");
        }
    }
    // Text of any kind: the address (a blank one is refused where it is given, and a
    // blank variable is unset), the DeepSpeed file (read when the run starts), the job's
    // secret, the record directory.
    assert_eq!(
        free_text,
        ["master_addr", "deepspeed", "job_token", "record"]
    );
}

#[test]
fn an_option_the_attribute_does_not_take_is_named_with_the_valid_ones() {
    let e = Settings::from_attribute([("nnodes", "2")])
        .unwrap_err()
        .to_string();
    assert!(
        e.starts_with("unknown option `nnodes`; valid options: nproc_per_node, "),
        "{e}"
    );
    assert!(e.ends_with(", crate"), "{e}");
    let e = Settings::from_attribute([("zero", "4")])
        .unwrap_err()
        .to_string();
    assert!(e.starts_with("zero = 4: use 1 "), "{e}");
    let e = Settings::from_attribute([("backend", "mpi")])
        .unwrap_err()
        .to_string();
    assert_eq!(e, "backend = \"mpi\": use gloo or nccl");
}

#[test]
fn offloads() {
    assert_eq!(Offload::parse("all"), Ok(Offload::All));
    assert_eq!(Offload::parse("Optimizer"), Ok(Offload::Optimizer));
    assert_eq!(Offload::parse("none"), Ok(Offload::None));
    assert!(Offload::parse("cpu")
        .unwrap_err()
        .contains("use none, optimizer"));
    for offload in [Offload::None, Offload::Optimizer, Offload::All] {
        assert_eq!(Offload::parse(&offload.to_string()), Ok(offload));
    }
}

#[test]
fn shard_groups() {
    assert_eq!(ShardGroup::parse("node"), Ok(ShardGroup::Node));
    assert_eq!(ShardGroup::parse("Node"), Ok(ShardGroup::Node));
    assert_eq!(ShardGroup::parse("2"), Ok(ShardGroup::Size(2)));
    assert!(ShardGroup::parse("0").unwrap_err().contains("use node"));
    assert_eq!(ShardGroup::Node.to_string(), "node");
    // 2 nodes of 2 ranks: a node's ranks; 4 ranks do not split into groups of 3.
    assert_eq!(ShardGroup::Node.size(4, 2), Ok(2));
    assert!(ShardGroup::Size(3)
        .size(4, 2)
        .unwrap_err()
        .contains("do not divide the job's 4 ranks"));
}

mod deepspeed {
    use super::*;

    /// The FSDP/DeepSpeed guide's `ds_config.json`, verbatim (also `examples/ds_config.json`).
    const GUIDE: &str = r#"{
  "train_batch_size": "auto",
  "train_micro_batch_size_per_gpu": "auto",
  "gradient_accumulation_steps": "auto",
  "gradient_clipping": 1.0,
  "zero_optimization": {
    "stage": 2,
    "offload_optimizer": {
      "device": "cpu",
      "pin_memory": true
    },
    "allgather_partitions": true,
    "allgather_bucket_size": 2e8,
    "reduce_scatter": true,
    "reduce_bucket_size": 2e8,
    "overlap_comm": true,
    "contiguous_gradients": true
  },
  "fp16": {
    "enabled": false
  },
  "bf16": {
    "enabled": true
  },
  "optimizer": {
    "type": "AdamW",
    "params": {
      "lr": "auto",
      "betas": "auto",
      "eps": "auto",
      "weight_decay": "auto"
    }
  },
  "scheduler": {
    "type": "WarmupLR",
    "params": {
      "warmup_min_lr": "auto",
      "warmup_max_lr": "auto",
      "warmup_num_steps": "auto"
    }
  }
}"#;

    fn parse(text: &str) -> Result<DeepSpeed> {
        DeepSpeed::parse(Path::new("ds_config.json"), text)
    }

    #[test]
    fn the_guides_file_gives_its_settings() {
        let ds = parse(GUIDE).unwrap();
        let s = &ds.settings;
        assert_eq!(s.zero, Some(2));
        assert_eq!(s.offload, Some(Offload::Optimizer));
        assert_eq!(s.gradient_clipping, Some(1.0));
        assert_eq!(
            s.mixed_precision,
            Some(MixedPrecisionMode::Exactly(MixedPrecision::Bf16))
        );
        // 2e8 elements of 4 bytes.
        assert_eq!(s.reduce_bucket_mb, Some(2e8 * 4.0 / 1048576.0));
        // "auto": the run's.
        assert_eq!(s.grad_accum, None);
        assert_eq!((ds.train_batch_size, ds.micro_batch_size), (None, None));
        let optimizer = ds.optimizer.unwrap();
        assert_eq!(optimizer.kind, "adamw");
        assert_eq!(
            (optimizer.lr, optimizer.betas, optimizer.eps),
            (None, None, None)
        );
        let scheduler = ds.scheduler.unwrap();
        assert_eq!(scheduler.kind, "WarmupLR");
        assert!(scheduler.params.is_empty());
        let advisory = ds.advisory.join("; ");
        for key in [
            "overlap_comm",
            "contiguous_gradients",
            "allgather_partitions",
            "reduce_scatter",
        ] {
            assert!(advisory.contains(key), "{advisory}");
        }
    }

    #[test]
    fn the_run_and_the_file_give_a_setting_in_one_place() {
        let ds = parse(GUIDE).unwrap();
        let run = Settings {
            zero: Some(3),
            ..Settings::default()
        };
        let e = ds.over(run).unwrap_err().to_string();
        assert!(
            e.contains("zero_optimization.stage gives zero = 2, and the run gives zero = 3"),
            "{e}"
        );
        let run = Settings {
            zero: Some(2),
            grad_accum: Some(4),
            ..Settings::default()
        };
        let merged = ds.over(run).unwrap();
        assert_eq!(
            (merged.zero, merged.grad_accum, merged.offload),
            (Some(2), Some(4), Some(Offload::Optimizer))
        );
    }

    #[test]
    fn batch_sizes_agree_with_the_accumulation_and_the_world() {
        let ds = parse(r#"{"train_batch_size": 64, "train_micro_batch_size_per_gpu": 8}"#).unwrap();
        assert_eq!(ds.check_batch(2, 4).unwrap(), Some(8));
        let e = ds.check_batch(4, 4).unwrap_err().to_string();
        assert!(
            e.contains("train_batch_size 64 is not train_micro_batch_size_per_gpu 8 × gradient_accumulation_steps 4 × 4 ranks = 128"),
            "{e}"
        );
        let ds = parse(r#"{"train_batch_size": 64}"#).unwrap();
        assert_eq!(ds.check_batch(2, 4).unwrap(), Some(8));
        assert!(ds
            .check_batch(3, 4)
            .unwrap_err()
            .to_string()
            .contains("a multiple of 12"));
    }

    #[test]
    fn keys_it_cannot_honour_are_named() {
        for (text, needle) in [
            (
                r#"{"zero_optimization": {"stage": 2, "bogus": 1}}"#,
                "`zero_optimization.bogus` is not a DeepSpeed key",
            ),
            (
                r#"{"fp16": {"enabled": true}, "bf16": {"enabled": true}}"#,
                "both true",
            ),
            (
                r#"{"zero_optimization": {"offload_optimizer": {"device": "nvme"}}}"#,
                "NVMe is not supported",
            ),
            (r#"{"fp16": {"loss_scale": 128}}"#, "static loss scale"),
            (r#"{"optimizer": {"type": "Lamb"}}"#, "Adam, AdamW and SGD"),
            (
                r#"{"scheduler": {"type": "OneCycle"}}"#,
                "WarmupLR, WarmupDecayLR, WarmupCosineLR",
            ),
            (
                r#"{"zero_optimization": {"stage": 5}}"#,
                "zero_optimization.stage: 5",
            ),
            ("{", "not JSON"),
        ] {
            let e = parse(text).unwrap_err().to_string();
            assert!(e.starts_with("ds_config.json: "), "{e}");
            assert!(e.contains(needle), "{text}: {e}");
        }
    }

    #[test]
    fn an_auto_precision_leaves_it_to_the_run() {
        for text in [
            r#"{"fp16": {"enabled": "auto"}, "bf16": {"enabled": false}}"#,
            r#"{"bf16": {"enabled": "auto"}}"#,
            "{}",
        ] {
            assert_eq!(
                parse(text).unwrap().settings.mixed_precision,
                None,
                "{text}"
            );
        }
        let off = parse(r#"{"fp16": {"enabled": false}, "bf16": {"enabled": false}}"#).unwrap();
        assert_eq!(
            off.settings.mixed_precision,
            Some(MixedPrecisionMode::Exactly(MixedPrecision::No))
        );
    }

    #[test]
    fn offload_param_offloads_everything_and_fp16_keeps_its_loss_scaling() {
        let ds = parse(
            r#"{"zero_optimization": {"stage": 3, "offload_param": {"device": "cpu"},
                "offload_optimizer": {"device": "cpu"}},
                "fp16": {"enabled": true, "loss_scale": 0, "initial_scale_power": 12,
                "loss_scale_window": 500, "hysteresis": 2, "min_loss_scale": 1}}"#,
        )
        .unwrap();
        assert_eq!(ds.settings.offload, Some(Offload::All));
        assert_eq!(
            ds.settings.mixed_precision,
            Some(MixedPrecisionMode::Exactly(MixedPrecision::Fp16))
        );
        assert_eq!(
            ds.loss_scaling,
            LossScaling {
                initial_scale_power: Some(12),
                loss_scale_window: Some(500),
            }
        );
        let advisory = ds.advisory.join(" ");
        assert!(advisory.contains("fp16.hysteresis") && advisory.contains("fp16.min_loss_scale"));
    }
    /// Every key the SDK reads, from a file on disk: its value, or a note when the SDK
    /// honours it its own way; the variants that read differently.
    #[test]
    fn every_key_reads_to_its_value_or_a_note() {
        let dir = std::env::temp_dir().join(format!("tchd-ds-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("ds_config.json");
        std::fs::write(
            &path,
            r#"{"gradient_clipping": 0, "fp16": {"enabled": true, "auto_cast": true},
                "zero_optimization": {"stage": 3, "sub_group_size": 1e9,
                  "stage3_gather_16bit_weights_on_model_save": true,
                  "reduce_bucket_size": 5e8, "allgather_bucket_size": 2e8,
                  "offload_optimizer": {"device": "none", "pin_memory": false,
                    "buffer_count": 4}},
                "optimizer": {"type": "SGD", "params": {"lr": 0.1, "momentum": 0.9}},
                "scheduler": {"type": "WarmupLR", "params": {"warmup_type": "linear",
                  "warmup_num_steps": 10, "last_batch_iteration": -1}}}"#,
        )
        .unwrap();
        let ds = DeepSpeed::load(&path);
        std::fs::remove_dir_all(&dir).unwrap();
        let ds = ds.unwrap();
        assert_eq!(ds.path, path);
        let s = &ds.settings;
        // DeepSpeed's 0: no clipping.
        assert_eq!(s.gradient_clipping, None);
        assert_eq!(
            s.mixed_precision,
            Some(MixedPrecisionMode::Exactly(MixedPrecision::Fp16))
        );
        assert_eq!((s.zero, s.offload), (Some(3), None));
        // One cap serves both: reduce_bucket_size's, with a note.
        assert_eq!(s.reduce_bucket_mb, Some(5e8 * 4.0 / 1048576.0));
        let advisory = ds.advisory.join("; ");
        for key in [
            "fp16.auto_cast",
            "zero_optimization.sub_group_size",
            "stage3_gather_16bit_weights_on_model_save",
            "zero_optimization.allgather_bucket_size",
            "offload_optimizer.pin_memory",
            "offload_optimizer.buffer_count",
        ] {
            assert!(advisory.contains(key), "{key}: {advisory}");
        }
        let optimizer = ds.optimizer.unwrap();
        assert_eq!(
            (optimizer.kind.as_str(), optimizer.lr, optimizer.momentum),
            ("sgd", Some(0.1), Some(0.9))
        );
        let scheduler = ds.scheduler.unwrap();
        assert_eq!(scheduler.warmup_type.as_deref(), Some("linear"));
        assert_eq!(scheduler.params.get("warmup_num_steps"), Some(&10.0));
        // The guide's file: equal caps and pinned memory need no note.
        let guide = parse(GUIDE).unwrap().advisory.join("; ");
        assert!(
            !guide.contains("allgather_bucket_size") && !guide.contains("pin_memory"),
            "{guide}"
        );
        let adam = parse(
            r#"{"optimizer": {"type": "Adam", "params": {"betas": [0.8, 0.99],
                "adam_w_mode": false, "torch_adam": true, "fused": true}}}"#,
        )
        .unwrap()
        .optimizer
        .unwrap();
        assert_eq!(
            (adam.betas, adam.adam_w_mode),
            (Some((0.8, 0.99)), Some(false))
        );
        for count in ["6.5", "-1"] {
            let e = parse(&format!(r#"{{"train_batch_size": {count}}}"#))
                .unwrap_err()
                .to_string();
            assert!(
                e.contains("a whole number or \"auto\" is needed"),
                "{count}: {e}"
            );
        }
    }
}

mod accelerate {
    use super::*;

    /// A file of `examples/accelerate/`, written by Accelerate 1.15 itself
    /// (`accelerate config default`, and its `ClusterConfig.to_yaml_file`).
    fn written_by_accelerate(name: &str) -> Accelerate {
        let path = Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("../examples/accelerate")
            .join(name);
        Accelerate::load(&path).unwrap()
    }

    #[test]
    fn accelerates_own_files_give_their_settings() {
        let cpu = written_by_accelerate("multi_cpu.yaml");
        assert_eq!(cpu.settings.nproc_per_node, Some(2));
        assert_eq!(cpu.settings.nnodes, Some(1));
        assert_eq!(cpu.settings.node_rank, Some(0));
        assert_eq!(cpu.settings.backend, Some(Backend::Gloo));
        assert_eq!(
            cpu.settings.mixed_precision,
            Some(MixedPrecisionMode::Exactly(MixedPrecision::No))
        );
        let fsdp = written_by_accelerate("fsdp.yaml");
        assert_eq!(fsdp.settings.zero, Some(3));
        assert_eq!(fsdp.settings.nproc_per_node, Some(2));
        assert_eq!(
            fsdp.settings.gpus.as_ref().map(ToString::to_string),
            Some("all".into())
        );
        assert_eq!(
            fsdp.settings.mixed_precision,
            Some(MixedPrecisionMode::Exactly(MixedPrecision::Bf16))
        );
        assert!(fsdp
            .advisory
            .join(" ")
            .contains("fsdp_config.fsdp_auto_wrap_policy"));
        // `accelerate config default` writes JSON into default_config.yaml.
        let default = written_by_accelerate("default_config.yaml");
        assert_eq!(default.settings.nproc_per_node, Some(1));
        // Only what would matter: the CPU asked for; not the keys Accelerate writes for
        // its own launcher.
        assert_eq!(default.advisory.len(), 1, "{:?}", default.advisory);
        assert!(default.advisory[0].starts_with("use_cpu"));
        assert!(
            cpu.advisory.iter().all(|a| a.starts_with("use_cpu")),
            "{:?}",
            cpu.advisory
        );
        let (settings, _) = Settings::load_run_file(
            &Path::new(env!("CARGO_MANIFEST_DIR")).join("../examples/accelerate/fsdp.yaml"),
        )
        .unwrap();
        assert_eq!(settings, fsdp.settings);
    }

    fn parse(text: &str) -> Result<Accelerate> {
        Accelerate::parse(Path::new("default_config.yaml"), text)
    }

    #[test]
    fn strategies_map_to_stages_and_groups() {
        for (strategy, zero, group) in [
            ("FULL_SHARD", 3, None),
            ("SHARD_GRAD_OP", 2, None),
            ("NO_SHARD", 0, None),
            ("HYBRID_SHARD", 3, Some(ShardGroup::Node)),
            ("_HYBRID_SHARD_ZERO2", 2, Some(ShardGroup::Node)),
        ] {
            let a = parse(&format!(
                "distributed_type: FSDP\nfsdp_config:\n  fsdp_sharding_strategy: {strategy}\n  fsdp_offload_params: true\n"
            ))
            .unwrap();
            assert_eq!(a.settings.zero, Some(zero), "{strategy}");
            assert_eq!(a.settings.shard_group, group, "{strategy}");
            assert_eq!(a.settings.offload, Some(Offload::All), "{strategy}");
        }
        let a = parse(
            "distributed_type: DEEPSPEED\ndeepspeed_config:\n  zero_stage: 2\n  offload_optimizer_device: cpu\n  gradient_accumulation_steps: 4\n  gradient_clipping: 1.0\n",
        )
        .unwrap();
        assert_eq!(
            (
                a.settings.zero,
                a.settings.offload,
                a.settings.grad_accum,
                a.settings.gradient_clipping
            ),
            (Some(2), Some(Offload::Optimizer), Some(4), Some(1.0))
        );
    }

    #[test]
    fn keys_it_cannot_honour_are_named() {
        for (text, needle) in [
            ("bogus_key: 1\n", "`bogus_key` is not an Accelerate key"),
            (
                "distributed_type: TPU\n",
                "distributed_type = TPU: use NO, MULTI_CPU",
            ),
            (
                "num_processes: 3\nnum_machines: 2\n",
                "does not divide into num_machines = 2",
            ),
            ("mixed_precision: fp8\n", "mixed_precision = fp8"),
            (
                "distributed_type: FSDP\nfsdp_config:\n  fsdp_bogus: 1\n",
                "`fsdp_config.fsdp_bogus`",
            ),
            (
                "parallelism_config:\n  parallelism_config_tp_size: 2\n",
                "tensor and context parallelism",
            ),
            ("[1, 2]\n", "not a mapping"),
        ] {
            let e = parse(text).unwrap_err().to_string();
            assert!(e.starts_with("default_config.yaml: "), "{e}");
            assert!(e.contains(needle), "{text}: {e}");
        }
    }
    /// Each key of a launch: what it gives, what it leaves to the run (a null, an off
    /// value), and what it refuses.
    #[test]
    fn each_key_gives_its_setting_or_leaves_it() {
        let a = parse(
            "compute_environment: LOCAL_MACHINE\ndebug: true\nnum_processes: 4\nnum_machines: 2\n\
             main_process_ip: 10.0.0.1\nmain_process_port: 29555\ngpu_ids: 0,1\n\
             rdzv_backend: static\nenable_cpu_affinity: true\ncommands: [echo hi]\n\
             dynamo_config: {}\nmpirun_config: []\n",
        )
        .unwrap();
        let s = &a.settings;
        assert_eq!((s.nproc_per_node, s.nnodes), (Some(2), Some(2)));
        assert_eq!(s.debug, Some(DebugLevel::Detail));
        assert_eq!(
            (s.master_addr.as_deref(), s.master_port),
            (Some("10.0.0.1"), Some(29555))
        );
        assert!(s.gpus.is_some());
        let advisory = a.advisory.join("; ");
        assert!(
            advisory.contains("enable_cpu_affinity") && advisory.contains("commands"),
            "{advisory}"
        );
        assert!(
            !advisory.contains("dynamo_config") && !advisory.contains("mpirun_config"),
            "{advisory}"
        );
        let a = parse(
            "debug: false\nnum_processes: 0\nmain_process_ip: null\nmain_process_port: null\n\
             gpu_ids: null\n",
        )
        .unwrap();
        let s = &a.settings;
        assert_eq!(
            (s.debug, s.nproc_per_node, s.gpus.is_some()),
            (None, None, false)
        );
        assert_eq!((s.master_addr.as_deref(), s.master_port), (None, None));
        // Another distributed_type's block is left, with a note.
        let a = parse(
            "distributed_type: MULTI_GPU\nfsdp_config:\n  fsdp_sharding_strategy: SHARD_GRAD_OP\n\
             deepspeed_config:\n  zero_stage: 2\n",
        )
        .unwrap();
        assert_eq!(a.settings.zero, None);
        assert_eq!(a.advisory.len(), 2, "{:?}", a.advisory);
        let a = parse(
            "distributed_type: DEEPSPEED\ndeepspeed_config:\n  deepspeed_config_file: ds.json\n  \
             offload_param_device: cpu\n  offload_optimizer_device: cpu\n  zero3_init_flag: true\n",
        )
        .unwrap();
        assert_eq!(a.settings.deepspeed.as_deref(), Some("ds.json"));
        assert_eq!(a.settings.offload, Some(Offload::All));
        assert!(a.advisory.join(" ").contains("zero3_init_flag"));
        for (block, group) in [
            (
                "dp_shard_size: 2\n  parallelism_config_dp_replicate_size: 2",
                Some(ShardGroup::Size(2)),
            ),
            ("dp_shard_size: 1\n  parallelism_config_tp_size: 1", None),
        ] {
            let a = parse(&format!(
                "parallelism_config:\n  parallelism_config_{block}\n"
            ))
            .unwrap();
            assert_eq!(a.settings.shard_group, group, "{block}");
        }
        for (text, needle) in [
            (
                "compute_environment: AMAZON_SAGEMAKER\n",
                "compute_environment = AMAZON_SAGEMAKER",
            ),
            ("rdzv_backend: c10d\n", "rdzv_backend = c10d"),
            ("num_machines: 0\n", "num_machines = 0"),
        ] {
            let e = parse(text).unwrap_err().to_string();
            assert!(e.contains(needle), "{text}: {e}");
        }
    }
}
