//! The SDK as crates.io and docs.rs will see it: `cargo package` packs the settings
//! crate, the macros crate and then the SDK (each package depends on the packed copies
//! of those before it), and builds
//! each from its package; `--features doc-only` documents the SDK with no libtorch at
//! all, as docs.rs builds it (`[package.metadata.docs.rs]`).

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use tch_distributed_tests::{cargo_dirs, run_with, scratch_dir};

fn repo() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("..")
        .canonicalize()
        .unwrap()
}

fn cargo() -> Command {
    let mut cmd = Command::new(std::env::var("CARGO").unwrap_or_else(|_| "cargo".into()));
    cmd.current_dir(repo())
        .env_remove("CARGO_MANIFEST_DIR")
        // Built to check, never debugged.
        .env("CARGO_PROFILE_DEV_DEBUG", "false");
    cmd
}

/// Forgets what an earlier `cargo package` made of the workspace's own crates: the
/// copies it extracted from its temporary registry
/// (`$CARGO_HOME/registry/src/-HASH/NAME-0.1.0`; crates.io's are under
/// `index.crates.io-…`) and the fingerprints of the settings and macros crates in the
/// build directory. Cargo takes a registry crate of the same version as unchanged, so
/// the SDK's package would otherwise build against the settings crate as it was packed
/// before, not as it is now (the next build compiles those two crates again).
fn forget_packed_copies() {
    let fingerprints = cargo_dirs().build.join("debug/.fingerprint");
    if let Ok(entries) = std::fs::read_dir(&fingerprints) {
        for entry in entries.flatten() {
            let name = entry.file_name().to_string_lossy().into_owned();
            if name.starts_with("tch-distributed-settings-")
                || name.starts_with("tch-distributed-macros-")
            {
                let _ = std::fs::remove_dir_all(entry.path());
            }
        }
    }
    let home = std::env::var_os("CARGO_HOME")
        .map(PathBuf::from)
        .or_else(|| std::env::var_os("HOME").map(|h| Path::new(&h).join(".cargo")));
    let Some(src) = home.map(|h| h.join("registry/src")) else {
        return;
    };
    let Ok(registries) = std::fs::read_dir(&src) else {
        return;
    };
    for registry in registries.flatten() {
        if !registry.file_name().to_string_lossy().starts_with('-') {
            continue;
        }
        for krate in ["tch-distributed-settings", "tch-distributed-macros"] {
            let copy = registry.path().join(format!("{krate}-0.1.0"));
            if copy.exists() {
                std::fs::remove_dir_all(&copy)
                    .unwrap_or_else(|e| panic!("{}: {e}", copy.display()));
            }
        }
    }
}

#[test]
fn cargo_package_packs_and_builds_the_settings_the_macros_then_the_sdk() {
    let dir = scratch_dir("package");
    forget_packed_copies();
    let mut cmd = cargo();
    // --allow-dirty: a developer's uncommitted changes; CI's clone is clean anyway.
    cmd.args([
        "package",
        "-p",
        "tch-distributed-settings",
        "-p",
        "tch-distributed-macros",
        "-p",
        "tch-distributed",
    ])
    .arg("--allow-dirty");
    let run = run_with(cmd, &dir, Duration::from_secs(1800), |_, _| {});
    run.assert_success();
    for krate in [
        "tch-distributed-settings",
        "tch-distributed-macros",
        "tch-distributed",
    ] {
        let packed = cargo_dirs()
            .target
            .join(format!("package/{krate}-0.1.0.crate"));
        assert!(packed.exists(), "{}", packed.display());
        assert!(
            run.stderr.contains(&format!("Verifying {krate} v0.1.0")),
            "{krate} was not built from its package:\n{}",
            run.stderr
        );
    }
    // The metadata that crates.io shows.
    for field in ["description", "keywords", "categories", "readme", "license"] {
        assert!(
            !run.stderr.contains(&format!("manifest has no {field}")),
            "{}",
            run.stderr
        );
    }
}

#[test]
fn the_sdk_documents_without_libtorch_as_docs_rs_does() {
    let dir = scratch_dir("doc-only");
    let venv = std::env::var("VIRTUAL_ENV").unwrap_or_default();
    // No way to find a libtorch: no variable naming one, no Python with torch on PATH.
    let path: Vec<String> = std::env::var("PATH")
        .unwrap_or_default()
        .split(':')
        .filter(|p| venv.is_empty() || !p.starts_with(&venv))
        .map(str::to_string)
        .collect();
    let mut cmd = cargo();
    cmd.args([
        "doc",
        "-p",
        "tch-distributed",
        "--no-deps",
        "--features",
        "doc-only",
    ])
    .env("CARGO_TARGET_DIR", repo().join("target/doc-only"))
    .env("PATH", path.join(":"))
    .env_remove("VIRTUAL_ENV")
    .env_remove("LIBTORCH")
    .env_remove("LIBTORCH_USE_PYTORCH")
    .env_remove("LIBTORCH_LIB")
    .env_remove("LIBTORCH_INCLUDE");
    let run = run_with(cmd, &dir, Duration::from_secs(1200), |_, _| {});
    run.assert_success();
    let index = repo().join("target/doc-only/doc/tch_distributed/index.html");
    let html = std::fs::read_to_string(&index).unwrap();
    assert!(html.contains("distributed"), "{}", index.display());
}
