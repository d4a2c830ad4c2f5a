//! A user's own crate, outside this workspace: `tch = "0.24"` or `"0.26"` (whichever
//! this build's libtorch pairs with) and the SDK by path, with the guide's `build.rs`
//! (an rpath to libtorch). Resolved by cargo from scratch, it must get one torch-sys;
//! built (with the workspace's versions), it must run without `LD_LIBRARY_PATH`,
//! training the guide's data-parallel listing on 2 self-launched ranks that end with
//! equal parameters.
//!
//! `scripts/test.sh` runs this with tch 0.24 and `scripts/test.sh --tch 0.26` with tch
//! 0.26. The crate and its target directory stay in `target/user-crate/` for the next
//! run; what it compiles shares the workspace's build directory.

use std::fs;
use std::path::Path;
use std::process::Command;
use std::time::Duration;

use tch::Tensor;
use tch_distributed_tests::{
    all_ranks_stdout, cargo_dirs, compare, run_with, scratch_dir, without_launcher,
};

#[path = "support/messages.rs"]
mod messages;

/// What a user writes: the own-crate chapter's manifest
/// (`book/listings/own-crate/Cargo.toml`), with tch `tch` and the SDK of this
/// repository; plus an empty `[workspace]`, since the crate's directory lies inside the
/// repository (a user's crate does not).
fn manifest(tch: &str, sdk: &Path) -> String {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("../book/listings/own-crate/Cargo.toml");
    let chapter = fs::read_to_string(path).unwrap();
    let (tch_line, sdk_path) = ("tch = \"0.26\"", "path = \"../tch-distributed/sdk\"");
    for line in [tch_line, sdk_path] {
        assert!(
            chapter.contains(line),
            "{line} not in the chapter's manifest:\n{chapter}"
        );
    }
    let text = chapter
        .replace(tch_line, &format!("tch = \"{tch}\""))
        .replace(sdk_path, &format!("path = \"{}\"", sdk.display()));
    format!("{text}\n[workspace]\n")
}

/// Writes `text` to `path` unless it already holds it (so cargo's fingerprints stay).
fn write_if_changed(path: &Path, text: &str) {
    if fs::read_to_string(path).ok().as_deref() != Some(text) {
        fs::write(path, text).unwrap();
    }
}

/// `cargo SUBCOMMAND` (`build`, `generate-lockfile`) in the crate in `krate`, as its
/// user runs it, with its own target directory. Its intermediate artifacts go to this
/// workspace's build directory (cargo's `build.build-dir`), so that the dependencies
/// of the versions and features this workspace built (tch and torch-sys above all) are
/// not compiled again.
fn cargo(krate: &Path, subcommand: &str) -> Command {
    let mut build = Command::new(std::env::var("CARGO").unwrap_or_else(|_| "cargo".into()));
    build
        .current_dir(krate)
        .args([subcommand, "--quiet"])
        .env("CARGO_TARGET_DIR", krate.join("target"))
        .env("CARGO_BUILD_BUILD_DIR", &cargo_dirs().build)
        // Built to run, never debugged: no debug info keeps its target small.
        .env("CARGO_PROFILE_DEV_DEBUG", "false")
        .env_remove("CARGO_MANIFEST_DIR");
    build
}

/// The tch of this build, the other supported one, and the torch each needs.
fn versions() -> [(&'static str, &'static str); 2] {
    let pairs = [("0.24", "2.11.0"), ("0.26", "2.13.0")];
    if tch_distributed::TCH_VERSION == pairs[0].0 {
        pairs
    } else {
        [pairs[1], pairs[0]]
    }
}

#[test]
fn a_user_crate_on_this_tch_adds_the_sdk_and_trains_on_two_ranks() {
    let repo = Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    let repo = repo.canonicalize().unwrap();
    let tch = tch_distributed::TCH_VERSION;
    let krate = repo.join(format!("target/user-crate/tch-{tch}"));
    fs::create_dir_all(krate.join("src")).unwrap();
    write_if_changed(&krate.join("Cargo.toml"), &manifest(tch, &repo.join("sdk")));
    let listing = fs::read_to_string(repo.join("book/listings/src/bin/data_parallel.rs")).unwrap();
    write_if_changed(&krate.join("src/main.rs"), &listing);
    // The guide's build script: an rpath to libtorch, so the binary runs as it is.
    let build_rs = fs::read_to_string(repo.join("examples/build.rs")).unwrap();
    write_if_changed(&krate.join("build.rs"), &build_rs);

    // Resolved as a user's crate is: from scratch (no lockfile given), to one
    // torch-sys, tch's.
    let dir = scratch_dir("user-crate");
    let _ = fs::remove_file(krate.join("Cargo.lock"));
    let resolved = run_with(
        cargo(&krate, "generate-lockfile"),
        &dir,
        Duration::from_secs(300),
        |_, _| {},
    );
    resolved.assert_success();
    let lock = fs::read_to_string(krate.join("Cargo.lock")).unwrap();
    let torch_sys: Vec<&str> = lock
        .split("[[package]]")
        .filter(|p| p.contains("\nname = \"torch-sys\"\n"))
        .collect();
    assert_eq!(torch_sys.len(), 1, "one torch-sys in the graph:\n{lock}");
    assert!(
        torch_sys[0].contains(&format!("version = \"{tch}.")),
        "torch-sys {tch}:\n{}",
        torch_sys[0]
    );

    // Built with the versions of this workspace's Cargo.lock (cargo keeps those of the
    // crate's graph), which its build directory holds built already (see `cargo`),
    // against the libtorch this test was built with.
    fs::copy(repo.join("Cargo.lock"), krate.join("Cargo.lock")).unwrap();
    let built = run_with(
        cargo(&krate, "build"),
        &dir,
        Duration::from_secs(1800),
        |_, _| {},
    );
    built.assert_success();

    // At run time the binary finds libtorch through the rpath that its build script
    // added (the alternative, LD_LIBRARY_PATH, is removed to show it is not needed).
    let record = dir.join("record");
    let mut run = Command::new(krate.join("target/debug/my-trainer"));
    without_launcher(&mut run)
        .arg(dir.join("model.safetensors"))
        .env_remove("LD_LIBRARY_PATH")
        .env("TCH_DISTRIBUTED_NPROC", "2")
        .env("TCH_DISTRIBUTED_RECORD", &record);
    // Every rank's stdout: what only rank 0 prints is seen once.
    all_ranks_stdout(&mut run);
    let ran = run_with(run, &dir, Duration::from_secs(180), |_, _| {}).without_rank_prefixes();
    ran.assert_success();
    assert!(
        ran.stdout.contains("backend gloo, world size 2"),
        "{}",
        ran.stdout
    );

    // It trained: the mean loss fell from the first epoch to the last.
    let losses: Vec<f64> = ran
        .stdout
        .lines()
        .filter_map(|l| l.rsplit_once("mean loss ")?.1.trim().parse().ok())
        .collect();
    assert_eq!(
        losses.len(),
        3,
        "one line per epoch, rank 0 only:\n{}",
        ran.stdout
    );
    assert!(losses[2] < losses[0] * 0.8, "{losses:?}");

    // Both ranks ended with the same parameters, bit for bit.
    let read = |rank: usize| {
        let mut named =
            Tensor::read_safetensors(record.join(format!("rank-{rank}-model-0.safetensors")))
                .unwrap();
        named.sort_by(|a, b| a.0.cmp(&b.0));
        named
    };
    let (rank0, rank1) = (read(0), read(1));
    assert_eq!(rank0.len(), 4, "l1 and l2, weight and bias");
    let diff = compare::named(&rank0, &rank1);
    assert!(diff.is_exact(), "rank 0 and rank 1 differ: {diff:?}");

    // The chapter's section 7: tchrun, built inside the crate (reusing its build of the
    // SDK), launches the same program, whose model ends as the self-launched run's.
    let mut tchrun = cargo(&krate, "build");
    tchrun.args(["-p", "tch-distributed", "--bin", "tchrun"]);
    run_with(tchrun, &dir, Duration::from_secs(600), |_, _| {}).assert_success();
    let launched = dir.join("launched.safetensors");
    let mut run = Command::new(krate.join("target/debug/tchrun"));
    without_launcher(&mut run)
        .args(["--nproc-per-node", "2"])
        .arg(krate.join("target/debug/my-trainer"))
        .arg(&launched)
        .env_remove("LD_LIBRARY_PATH");
    let ran = run_with(run, &dir, Duration::from_secs(180), |_, _| {});
    ran.assert_success();
    let mut saved = Tensor::read_safetensors(&launched).unwrap();
    saved.sort_by(|a, b| a.0.cmp(&b.0));
    let diff = compare::named(&saved, &rank0);
    assert!(diff.is_exact(), "under tchrun the model differs: {diff:?}");
}

/// A crate that asks for the other tch than the libtorch it builds with pairs with
/// (`tch = "0.26"` beside torch 2.11.0 on the tch 0.24 leg, and the reverse) does not
/// build: tch's own build script stops with one line that names both versions, the
/// line that the book's troubleshooting chapter shows (`book/src/errors/`, written
/// for the tch 0.24 leg; the 0.26 leg's line is the same with the versions swapped).
#[test]
fn a_user_crate_on_the_other_tch_stops_with_one_line_naming_both_versions() {
    let [(_, torch), (other_tch, other_torch)] = versions();
    let repo = Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    let repo = repo.canonicalize().unwrap();
    let krate = repo.join(format!("target/user-crate/mismatch-tch-{other_tch}"));
    fs::create_dir_all(krate.join("src")).unwrap();
    write_if_changed(
        &krate.join("Cargo.toml"),
        &manifest(other_tch, &repo.join("sdk")),
    );
    write_if_changed(&krate.join("src/main.rs"), "fn main() {}\n");
    // The workspace's versions but for the other tch's (cargo resolves those again), so
    // that what the workspace built is reused up to torch-sys's build script.
    fs::copy(repo.join("Cargo.lock"), krate.join("Cargo.lock")).unwrap();

    let dir = scratch_dir("user-crate-mismatch");
    let mut build = cargo(&krate, "build");
    build.env_remove("LIBTORCH_BYPASS_VERSION_CHECK");
    let built = run_with(build, &dir, Duration::from_secs(900), |_, _| {});
    assert!(!built.status.success(), "it built:\n{}", built.stderr);
    let line = built
        .stderr
        .lines()
        .map(str::trim)
        .find(|l| l.starts_with("Error: this tch version expects"))
        .unwrap_or_else(|| panic!("no version line in:\n{}", built.stderr));
    assert!(
        line.contains(&format!("expects PyTorch {other_torch}, got {torch}")),
        "{line}"
    );
    // In the book's terms (the tch 0.24 leg): expects 2.13.0, got 2.11.0.
    let as_recorded = if torch == "2.11.0" {
        line.to_string()
    } else {
        line.replace("2.11.0", "{a}")
            .replace("2.13.0", "2.11.0")
            .replace("{a}", "2.13.0")
    };
    messages::assert_recorded("libtorch-mismatch", &as_recorded);
}
