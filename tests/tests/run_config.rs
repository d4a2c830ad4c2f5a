//! The run configuration (`tchrun config`, `tchrun --config`, the default file) and
//! `tchrun --gpus`; the precedence of a setting's sources: flags over environment
//! variables over the configuration file over the attribute's options
//! (`run_config_worker`'s attribute: `backend = "nccl"`, `nproc_per_node = 3`,
//! `mixed_precision = "bf16"`, `grad_accum = 2`).

use std::fs;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use tch_distributed_tests::{
    run_with, scratch_dir, tchrun, without_launcher, without_rank_prefixes, Run,
};

const WORKER: &str = env!("CARGO_BIN_EXE_run_config_worker");
const TIMEOUT: Duration = Duration::from_secs(90);

/// The file `tchrun config` writes, before its settings.
const HEADER: &str = "\
# tch-distributed run configuration, written by `tchrun config` and read by `tchrun`.
# tchrun's flags and TCH_DISTRIBUTED_* variables win over it; it wins over the options
# of #[distributed(...)]. A setting left out is decided by those, or by the defaults.
";

/// `program args…` with none of the caller's launch or settings variables, and a
/// home of its own (`dir/home`, no `XDG_CONFIG_HOME`), so that no configuration file
/// of the machine's user is read; then `env`.
fn command(program: impl AsRef<std::ffi::OsStr>, dir: &Path, env: &[(&str, &str)]) -> Command {
    let mut cmd = Command::new(program);
    without_launcher(&mut cmd);
    for var in [
        "TCH_DISTRIBUTED_CONFIG",
        "TCH_DISTRIBUTED_BACKEND",
        "TCH_DISTRIBUTED_TIMEOUT",
        "TCH_DISTRIBUTED_MIXED_PRECISION",
        "TCH_DISTRIBUTED_GRAD_ACCUM",
        "TCH_DISTRIBUTED_GPUS",
        "TCH_DISTRIBUTED_NNODES",
        "TCH_DISTRIBUTED_NODE_RANK",
        "TCH_DISTRIBUTED_MASTER_ADDR",
        "TCH_DISTRIBUTED_MASTER_PORT",
        "XDG_CONFIG_HOME",
        "CUDA_VISIBLE_DEVICES",
    ] {
        cmd.env_remove(var);
    }
    cmd.env("HOME", dir.join("home"));
    cmd.envs(env.iter().copied());
    cmd
}

/// `tchrun args…` in `dir` with `env` (see `command`).
fn tchrun_in(dir: &Path, args: &[&str], env: &[(&str, &str)]) -> Run {
    let mut cmd = command(tchrun(), dir, env);
    cmd.args(args);
    run_with(cmd, dir, TIMEOUT, |_, _| {})
}

/// Ranks that print `RANK WORLD_SIZE CUDA_VISIBLE_DEVICES` and the settings that reach
/// the program, one line each, sorted by rank (`--all-ranks-stdout`: every rank's line).
const PRINT_ENV: [&str; 4] = [
    "--all-ranks-stdout",
    "sh",
    "-c",
    "echo \"$RANK $WORLD_SIZE ${CUDA_VISIBLE_DEVICES:--} ${TCH_DISTRIBUTED_BACKEND:--} \
     ${TCH_DISTRIBUTED_MIXED_PRECISION:--} ${TCH_DISTRIBUTED_GRAD_ACCUM:--}\"",
];

fn sorted_lines(run: &Run) -> Vec<String> {
    run.assert_success();
    let stdout = without_rank_prefixes(&run.stdout);
    let mut lines: Vec<String> = stdout.lines().map(str::to_string).collect();
    lines.sort();
    lines
}

fn write_config(dir: &Path, text: &str) -> PathBuf {
    let path = dir.join("run.toml");
    fs::write(&path, text).unwrap();
    path
}

#[test]
fn tchrun_config_writes_the_expected_toml_and_tchrun_reads_it() {
    let dir = scratch_dir("config-write");
    let path = dir.join("sub").join("run.toml");
    let p = path.to_str().unwrap();
    // Flags, and stdin not a terminal: nothing is asked.
    let run = tchrun_in(
        &dir,
        &[
            "config",
            "--config",
            p,
            "--nproc-per-node",
            "2",
            "--backend",
            "gloo",
            "--gpus",
            "0,1",
            "--mixed-precision",
            "fp16",
            "--grad-accum",
            "3",
        ],
        &[],
    );
    run.assert_success();
    let expected = format!(
        "{HEADER}nproc_per_node = 2\nbackend = \"gloo\"\ngpus = \"0,1\"\n\
         mixed_precision = \"fp16\"\ngrad_accum = 3\n"
    );
    assert_eq!(fs::read_to_string(&path).unwrap(), expected);
    assert_eq!(run.stdout, format!("tchrun config: wrote {p}\n{expected}"));
    // The ranks get the file's settings: 2 of them, GPUs 0 and 1, the program's
    // settings as variables.
    let run = tchrun_in(&dir, &[&["--config", p][..], &PRINT_ENV].concat(), &[]);
    assert_eq!(
        sorted_lines(&run),
        ["0 2 0,1 gloo fp16 3", "1 2 0,1 gloo fp16 3"]
    );
    assert!(
        run.stderr
            .contains(&format!("tchrun: run configuration {p}")),
        "{}",
        run.stderr
    );
    // No flags and no terminal: a configuration with no settings, at the default
    // place (under HOME here).
    let run = tchrun_in(&dir, &["config"], &[]);
    run.assert_success();
    let default = dir.join("home/.config/tch-distributed/config.toml");
    assert_eq!(fs::read_to_string(&default).unwrap(), HEADER);
    // --yes asks nothing either; XDG_CONFIG_HOME moves the default file.
    let xdg = dir.join("xdg");
    let run = tchrun_in(
        &dir,
        &["config", "--yes", "--grad-accum", "5"],
        &[("XDG_CONFIG_HOME", xdg.to_str().unwrap())],
    );
    run.assert_success();
    assert_eq!(
        fs::read_to_string(xdg.join("tch-distributed/config.toml")).unwrap(),
        format!("{HEADER}grad_accum = 5\n")
    );
}

#[test]
fn the_default_file_is_found_where_users_expect_it() {
    let dir = scratch_dir("config-default");
    let put = |path: PathBuf, k: usize| {
        fs::create_dir_all(path.parent().unwrap()).unwrap();
        fs::write(&path, format!("grad_accum = {k}\n")).unwrap();
        path
    };
    let home = put(dir.join("home/.config/tch-distributed/config.toml"), 1);
    let xdg = dir.join("xdg");
    let xdg_file = put(xdg.join("tch-distributed/config.toml"), 2);
    let named = put(dir.join("named.toml"), 3);
    let flag = put(dir.join("flag.toml"), 4);
    let xdg_env = ("XDG_CONFIG_HOME", xdg.to_str().unwrap());
    let named_env = ("TCH_DISTRIBUTED_CONFIG", named.to_str().unwrap());
    let cases: [(&[&str], &[(&str, &str)], &Path, &str); 4] = [
        (&[], &[], &home, "1"),
        (&[], &[xdg_env], &xdg_file, "2"),
        (&[], &[xdg_env, named_env], &named, "3"),
        (
            &["--config", flag.to_str().unwrap()],
            &[xdg_env, named_env],
            &flag,
            "4",
        ),
    ];
    for (args, env, file, k) in cases {
        let run = tchrun_in(&dir, &[args, &PRINT_ENV].concat(), env);
        assert_eq!(sorted_lines(&run), [format!("0 1 - - - {k}")], "{file:?}");
        assert!(
            run.stderr
                .contains(&format!("tchrun: run configuration {}", file.display())),
            "{}",
            run.stderr
        );
    }
    // A file named by --config or TCH_DISTRIBUTED_CONFIG must exist.
    let missing = dir.join("missing.toml");
    let missing = missing.to_str().unwrap();
    for (args, env) in [
        (&["--config", missing][..], &[][..]),
        (&[][..], &[("TCH_DISTRIBUTED_CONFIG", missing)][..]),
    ] {
        let run = tchrun_in(&dir, &[args, &["true"][..]].concat(), env);
        assert_eq!(run.status.code(), Some(2), "{}", run.stderr);
        assert!(
            run.stderr.contains(missing) && run.stderr.contains("No such file"),
            "{}",
            run.stderr
        );
    }
}

#[test]
fn bad_settings_name_their_source() {
    let dir = scratch_dir("config-errors");
    let bad_file = write_config(&dir, "backend = \"gloo\"\ngrad_acum = 2\n");
    let bad_file = bad_file.to_str().unwrap();
    let cases: [(&[&str], &[(&str, &str)], &str); 5] = [
        (
            &["--config", bad_file, "true"],
            &[],
            "unknown field `grad_acum`",
        ),
        (
            &["--gpus", "0,x", "true"],
            &[],
            "invalid value '0,x' for '--gpus <IDS>': \"x\" is not a GPU id",
        ),
        (
            &["true"],
            &[("TCH_DISTRIBUTED_GRAD_ACCUM", "0")],
            "TCH_DISTRIBUTED_GRAD_ACCUM=\"0\": at least 1 is needed",
        ),
        (
            &["true"],
            &[("TCH_DISTRIBUTED_MIXED_PRECISION", "fp8")],
            "TCH_DISTRIBUTED_MIXED_PRECISION=\"fp8\": use no, bf16, fp16 or auto",
        ),
        (
            &["--mixed-precision", "fp8", "true"],
            &[],
            "invalid value 'fp8' for '--mixed-precision <MODE>'",
        ),
    ];
    for (args, env, needle) in cases {
        let run = tchrun_in(&dir, args, env);
        assert_eq!(run.status.code(), Some(2), "{args:?}: {}", run.stderr);
        assert!(run.stderr.contains(needle), "{args:?}: {}", run.stderr);
    }
    // The file's line is shown.
    let run = tchrun_in(&dir, &["--config", bad_file, "true"], &[]);
    assert!(run.stderr.contains("line 2"), "{}", run.stderr);
}

#[test]
fn gpus_picks_the_gpus_by_id() {
    let dir = scratch_dir("gpus");
    // One rank per id unless told otherwise; the ranks' CUDA_VISIBLE_DEVICES replaces
    // tchrun's own.
    let run = tchrun_in(
        &dir,
        &[&["--gpus", "0,1"][..], &PRINT_ENV].concat(),
        &[("CUDA_VISIBLE_DEVICES", "5")],
    );
    assert_eq!(sorted_lines(&run), ["0 2 0,1 - - -", "1 2 0,1 - - -"]);
    let run = tchrun_in(
        &dir,
        &[&["--gpus", "3", "--nproc-per-node", "2"][..], &PRINT_ENV].concat(),
        &[],
    );
    assert_eq!(sorted_lines(&run), ["0 2 3 - - -", "1 2 3 - - -"]);
    // `all` leaves CUDA_VISIBLE_DEVICES alone, over a file's ids.
    let file = write_config(&dir, "gpus = \"2,3\"\n");
    let run = tchrun_in(
        &dir,
        &[
            &["--config", file.to_str().unwrap(), "--gpus", "all"][..],
            &PRINT_ENV,
        ]
        .concat(),
        &[("CUDA_VISIBLE_DEVICES", "7")],
    );
    assert_eq!(sorted_lines(&run), ["0 1 7 - - -"]);
}

/// The banner line of a run of `run_config_worker`, and its line of all-reduced steps.
fn banner_and_steps(run: &Run) -> (String, String) {
    run.assert_success();
    let banner = run
        .stdout
        .lines()
        .find(|l| l.starts_with("tch-distributed: backend"))
        .unwrap_or_else(|| panic!("no banner: {}", run.stdout))
        .to_string();
    let steps = run
        .stdout
        .lines()
        .find(|l| l.starts_with("synced "))
        .unwrap_or_else(|| panic!("no steps: {}", run.stdout))
        .to_string();
    (banner, steps)
}

fn assert_banner(banner: &str, parts: &[&str]) {
    for part in parts {
        assert!(banner.contains(part), "no {part:?} in {banner}");
    }
}

#[test]
fn flags_over_environment_over_file_over_the_attribute() {
    let dir = scratch_dir("precedence");
    let file = write_config(
        &dir,
        "nproc_per_node = 3\nbackend = \"nccl\"\nmixed_precision = \"fp16\"\ngrad_accum = 3\n",
    );
    let file = file.to_str().unwrap();
    let with_file = |args: &[&'static str]| [&["--config", file][..], args].concat();
    let env = [
        ("TCH_DISTRIBUTED_NPROC", "2"),
        ("TCH_DISTRIBUTED_BACKEND", "gloo"),
        ("TCH_DISTRIBUTED_MIXED_PRECISION", "no"),
        ("TCH_DISTRIBUTED_GRAD_ACCUM", "4"),
    ];

    // The attribute alone: bf16, 2 micro-batches per step (6 of 12 backward passes
    // all-reduce) and NCCL, which the CPU refuses.
    let run = tchrun_in(
        &dir,
        &["--nproc-per-node", "2", "--backend", "gloo", WORKER],
        &[],
    );
    let (banner, steps) = banner_and_steps(&run);
    assert_banner(
        &banner,
        &[
            "world size 2,",
            "mixed precision bf16 (asked for",
            "gradient accumulation 2 steps",
        ],
    );
    assert_eq!(steps, "synced 6 local 6");
    let run = tchrun_in(&dir, &[WORKER], &[]);
    if !run.status.success() {
        assert!(
            run.stderr.contains("the NCCL backend needs a CUDA device"),
            "{}",
            run.stderr
        );
    } else {
        assert!(run.stdout.contains("backend nccl"), "{}", run.stdout);
    }

    // The file over the attribute (the flag's backend over the file's NCCL).
    let run = tchrun_in(&dir, &with_file(&["--backend", "gloo", WORKER]), &[]);
    let (banner, steps) = banner_and_steps(&run);
    assert_banner(
        &banner,
        &[
            "backend gloo, world size 3,",
            "mixed precision fp16 with loss scaling (asked for",
            "gradient accumulation 3 steps",
        ],
    );
    assert_eq!(steps, "synced 4 local 8");

    // The environment over the file.
    let (banner, steps) = banner_and_steps(&tchrun_in(&dir, &with_file(&[WORKER]), &env));
    assert_banner(
        &banner,
        &[
            "backend gloo, world size 2,",
            "mixed precision no (asked for)",
        ],
    );
    assert!(!banner.contains("gradient accumulation 3"), "{banner}");
    assert_banner(&banner, &["gradient accumulation 4 steps"]);
    assert_eq!(steps, "synced 3 local 9");

    // Flags over the environment.
    let mut nccl_env = env;
    nccl_env[1] = ("TCH_DISTRIBUTED_BACKEND", "nccl");
    let args = with_file(&[
        "--nproc-per-node",
        "3",
        "--backend",
        "gloo",
        "--mixed-precision",
        "auto",
        "--grad-accum",
        "6",
        WORKER,
    ]);
    let (banner, steps) = banner_and_steps(&tchrun_in(&dir, &args, &nccl_env));
    assert_banner(
        &banner,
        &[
            "backend gloo, world size 3,",
            "mixed precision no (auto: CPU)",
            "gradient accumulation 6 steps",
        ],
    );
    assert_eq!(steps, "synced 2 local 10");
}

#[test]
fn without_a_launcher_the_environment_wins_over_the_attribute() {
    // The program starts its own ranks: the attribute's nproc_per_node = 3, unless
    // TCH_DISTRIBUTED_NPROC says otherwise; the settings' variables apply as under
    // tchrun.
    let dir = scratch_dir("self-launch-precedence");
    let backend = ("TCH_DISTRIBUTED_BACKEND", "gloo");
    let run = run_with(command(WORKER, &dir, &[backend]), &dir, TIMEOUT, |_, _| {});
    let (banner, _) = banner_and_steps(&run);
    assert_banner(
        &banner,
        &[
            "backend gloo, world size 3,",
            "timeout 600 s",
            "mixed precision bf16",
        ],
    );
    // Rank 0 says which of the attribute's values the environment replaced.
    let says = |run: &Run, line: &str| {
        assert_eq!(
            run.stderr.matches(line).count(),
            1,
            "once: {line:?}\n{}",
            run.stderr
        );
    };
    says(
        &run,
        "tch-distributed: TCH_DISTRIBUTED_BACKEND=gloo overrides the attribute's backend = \"nccl\"",
    );
    assert!(!run.stderr.contains("overrides the attribute's timeout"));
    assert!(
        run.stdout.contains("optimizer tch zero Some(1)"),
        "the attribute's optimizer and zero:\n{}",
        run.stdout
    );
    let env = [
        backend,
        ("TCH_DISTRIBUTED_NPROC", "2"),
        ("TCH_DISTRIBUTED_TIMEOUT", "3"),
        ("TCH_DISTRIBUTED_MIXED_PRECISION", "no"),
        ("TCH_DISTRIBUTED_GRAD_ACCUM", "3"),
        ("TCH_DISTRIBUTED_OPTIMIZER", "foreach"),
        ("TCH_DISTRIBUTED_ZERO", "0"),
    ];
    let run = run_with(command(WORKER, &dir, &env), &dir, TIMEOUT, |_, _| {});
    let (banner, steps) = banner_and_steps(&run);
    assert_banner(
        &banner,
        &[
            "world size 2,",
            "timeout 3 s",
            "mixed precision no (asked for)",
            "gradient accumulation 3 steps",
        ],
    );
    assert_eq!(steps, "synced 4 local 8");
    // Every option that a variable can set, each said once when it replaces the
    // attribute's value.
    says(
        &run,
        "TCH_DISTRIBUTED_NPROC=2 overrides the attribute's nproc_per_node = 3 ",
    );
    says(
        &run,
        "TCH_DISTRIBUTED_MIXED_PRECISION=no overrides the attribute's mixed_precision = \"bf16\" ",
    );
    says(
        &run,
        "TCH_DISTRIBUTED_TIMEOUT=3 overrides the attribute's timeout = 600 ",
    );
    says(
        &run,
        "TCH_DISTRIBUTED_GRAD_ACCUM=3 overrides the attribute's grad_accum = 2 ",
    );
    says(
        &run,
        "TCH_DISTRIBUTED_OPTIMIZER=foreach overrides the attribute's optimizer = \"tch\" ",
    );
    says(
        &run,
        "TCH_DISTRIBUTED_ZERO=0 overrides the attribute's zero = 1 ",
    );
    assert!(
        run.stdout.contains("optimizer foreach zero None"),
        "the environment's optimizer and zero:\n{}",
        run.stdout
    );
    // A bad value stops the program before it starts anything.
    let run = run_with(
        command(
            WORKER,
            &dir,
            &[backend, ("TCH_DISTRIBUTED_GRAD_ACCUM", "many")],
        ),
        &dir,
        TIMEOUT,
        |_, _| {},
    );
    assert_eq!(run.status.code(), Some(1), "{}", run.stderr);
    assert!(
        run.stderr
            .contains("Error: reading the run's settings: TCH_DISTRIBUTED_GRAD_ACCUM=\"many\": a whole number is needed"),
        "{}",
        run.stderr
    );
}

/// The reference chapter's table of settings is the SDK's own table
/// (`tch_distributed::settings::TABLE`), rendered: a setting added there shows up in
/// the book, or this fails. `BLESS=1` rewrites the chapter's file.
#[test]
fn the_reference_chapters_table_is_the_settings_table() {
    let path =
        std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../book/src/reference-settings.md");
    let want = tch_distributed::settings::reference_table();
    if std::env::var_os("BLESS").is_some() {
        std::fs::write(&path, &want).unwrap();
    }
    let have = std::fs::read_to_string(&path).unwrap_or_default();
    assert_eq!(
        have,
        want,
        "{} is not the settings table: rerun with BLESS=1 to rewrite it",
        path.display()
    );
}
