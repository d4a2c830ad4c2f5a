//! The `ui/pass` cases of `tests/ui.rs`, each a whole program as a user writes one (its
//! `#[distributed]` function and its `main`), built here into one binary with the
//! workspace's own build rather than by trybuild, which compiles the libtorch stack
//! again for its own project.
//!
//! `ui_pass NAME` runs case `NAME`'s `main` (its exit code is `main`'s, as the program's
//! own would be); `ui_pass --list` prints the names, one per line.

include!(concat!(env!("OUT_DIR"), "/ui_pass_cases.rs"));

fn main() -> std::process::ExitCode {
    let arg = std::env::args().nth(1).unwrap_or_default();
    if arg == "--list" {
        for (name, _) in CASES {
            println!("{name}");
        }
        return std::process::ExitCode::SUCCESS;
    }
    match CASES.iter().find(|(name, _)| *name == arg) {
        Some((_, run)) => run(),
        None => {
            eprintln!("ui_pass: no case {arg:?}: give one of `ui_pass --list`");
            std::process::ExitCode::from(2)
        }
    }
}
