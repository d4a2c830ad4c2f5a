//! Compile tests of `#[distributed]` (trybuild): every option and every rewritten
//! pattern compiles and runs as one process (`ui/pass`), and every diagnostic reads as
//! recorded (`ui/fail/*.rs` with its `.stderr`). `TRYBUILD=overwrite` re-records them.

#[test]
fn ui() {
    // The pass cases run, and trybuild builds them outside this crate, without its
    // rpath: they find libtorch through the loader's path.
    let lib = env!("TCHD_LIBTORCH_LIB");
    let path = match std::env::var("LD_LIBRARY_PATH") {
        Ok(old) if !old.is_empty() => format!("{lib}:{old}"),
        _ => lib.to_string(),
    };
    std::env::set_var("LD_LIBRARY_PATH", path);
    // One process, no launcher: the cases must not join a job of the test runner's.
    for var in [
        "RANK",
        "WORLD_SIZE",
        "TCH_DISTRIBUTED_NPROC",
        "SLURM_PROCID",
    ] {
        std::env::remove_var(var);
    }
    let t = trybuild::TestCases::new();
    t.pass("ui/pass/*.rs");
    t.compile_fail("ui/fail/*.rs");
}
