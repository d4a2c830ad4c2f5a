// Adds libtorch's lib directory (reported by tch-distributed's build script) to the
// rpath of this crate's binaries and tests, so they run without LD_LIBRARY_PATH; and
// writes the `ui_pass` binary's table of cases, one per file in `ui/pass/`, so that a
// case added there runs with no list to keep.
use std::fmt::Write as _;
use std::path::Path;

fn main() {
    if let Ok(dir) = std::env::var("DEP_TCH_DISTRIBUTED_LIBTORCH_LIB") {
        println!("cargo:rustc-link-arg=-Wl,-rpath,{dir}");
    }
    pass_cases();
}

/// `$OUT_DIR/ui_pass_cases.rs`: each `ui/pass/NAME.rs` included whole in a module of
/// its own (its `main` stays private there; `run` reports it as a `main` would), and
/// `CASES`, the names with their `run`s, sorted.
fn pass_cases() {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("ui/pass");
    println!("cargo:rerun-if-changed={}", dir.display());
    let mut names: Vec<String> = std::fs::read_dir(&dir)
        .expect("tests/ui/pass")
        .map(|entry| entry.unwrap().path())
        .filter(|path| path.extension().is_some_and(|e| e == "rs"))
        .map(|path| path.file_stem().unwrap().to_string_lossy().into_owned())
        .collect();
    names.sort();
    let mut out = String::new();
    for name in &names {
        let file = dir.join(format!("{name}.rs"));
        println!("cargo:rerun-if-changed={}", file.display());
        writeln!(
            out,
            "mod case_{name} {{\n    include!({file:?});\n    pub(crate) fn run() -> \
             std::process::ExitCode {{\n        std::process::Termination::report(main())\n    \
             }}\n}}"
        )
        .unwrap();
    }
    out.push_str("const CASES: &[(&str, fn() -> std::process::ExitCode)] = &[\n");
    for name in &names {
        writeln!(out, "    ({name:?}, case_{name}::run),").unwrap();
    }
    out.push_str("];\n");
    let path = Path::new(&std::env::var("OUT_DIR").unwrap()).join("ui_pass_cases.rs");
    std::fs::write(path, out).unwrap();
}
