//! Compile tests of `#[distributed]`: every option and every rewritten pattern compiles
//! and runs as one process (`ui/pass`, built into the `ui_pass` binary), and every
//! diagnostic reads as recorded (`ui/fail/*.rs` with its `.stderr`, by trybuild).
//! `TRYBUILD=overwrite` re-records them.

use std::io::Write;
use std::time::Duration;

use tch_distributed_tests::{output_within, pin_device, without_launcher};

/// How long trybuild may take: it runs cargo with no timeout of its own, and a cold
/// build of the cases on this 2-core machine takes a few minutes.
const DEADLINE: Duration = Duration::from_secs(30 * 60);

/// Starts a thread that, past `DEADLINE`, kills every process this test started
/// (cargo, rustc, the pass cases: the whole tree below this process), says why on
/// stderr and exits the test executable with 101, a failure.
fn watchdog() {
    std::thread::spawn(|| {
        std::thread::sleep(DEADLINE);
        // Parents first; again until none is left (a child started after a snapshot).
        let mut killed = std::collections::HashSet::new();
        for _ in 0..20 {
            let mut tree = tch_distributed_tests::children(std::process::id());
            if tree.is_empty() {
                break;
            }
            let mut i = 0;
            while i < tree.len() {
                let below = tch_distributed_tests::children(tree[i]);
                tree.extend(below);
                i += 1;
            }
            for &pid in &tree {
                unsafe { libc::kill(pid as i32, libc::SIGKILL) };
            }
            killed.extend(tree);
            std::thread::sleep(Duration::from_millis(100));
        }
        let note = format!(
            "ui: trybuild did not finish within {DEADLINE:?}; killed the {} processes it \
             had started (cargo, rustc, the cases) and failed the test\n",
            killed.len()
        );
        let _ = std::io::stderr().write_all(note.as_bytes());
        std::process::exit(101);
    });
}

#[test]
fn ui() {
    watchdog();
    // Only diagnostics: trybuild checks (`cargo check`) the cases rather than building
    // them, and never runs one. The programs that must compile and run are the `ui_pass`
    // binary's (below), built with the workspace.
    trybuild::TestCases::new().compile_fail("ui/fail/*.rs");
}

/// Every `ui/pass/NAME.rs` compiled (into the `ui_pass` binary, one module each: see
/// tests/build.rs) and run as one process, with no launcher, on the CPU unless the
/// suite asks for CUDA: its `main` must succeed.
#[test]
fn pass_cases_compile_and_run_as_programs() {
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("ui/pass");
    let mut files: Vec<String> = std::fs::read_dir(&dir)
        .unwrap()
        .map(|entry| entry.unwrap().path())
        .filter(|path| path.extension().is_some_and(|e| e == "rs"))
        .map(|path| path.file_stem().unwrap().to_string_lossy().into_owned())
        .collect();
    files.sort();
    let ui_pass = || {
        let mut cmd = std::process::Command::new(env!("CARGO_BIN_EXE_ui_pass"));
        without_launcher(&mut cmd).env("OMP_NUM_THREADS", "1");
        pin_device(&mut cmd);
        cmd
    };
    let list = output_within(ui_pass().arg("--list"), b"", Duration::from_secs(60));
    let cases: Vec<String> = String::from_utf8(list.stdout)
        .unwrap()
        .lines()
        .map(String::from)
        .collect();
    assert_eq!(
        cases,
        files,
        "the ui_pass binary's cases are the files in {}",
        dir.display()
    );
    let mut failed = Vec::new();
    for case in &cases {
        let run = output_within(ui_pass().arg(case), b"", Duration::from_secs(120));
        if !run.status.success() {
            failed.push(format!(
                "ui/pass/{case}.rs: {}\nstdout:\n{}\nstderr:\n{}",
                run.status,
                String::from_utf8_lossy(&run.stdout),
                String::from_utf8_lossy(&run.stderr)
            ));
        }
    }
    assert!(failed.is_empty(), "{}", failed.join("\n\n"));
}
