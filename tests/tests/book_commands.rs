//! Every shell command in the README and the book works as pasted (from the
//! repository's root, after the README's first command).
//!
//! Each line of a `sh` code block is checked against this workspace:
//! - `cargo build|run|install`: the packages (`-p`), binaries (`--bin`) and examples
//!   (`--example`) it names exist, and in the package it names;
//! - a workspace program (`target/{debug,release}/[examples/]NAME`, or what `cargo run`
//!   runs) is one of the workspace's targets, and its arguments parse: the program,
//!   run with them and `--help` added, exits 0 (clap stops at an unknown flag first);
//! - `tchrun`'s own flags parse the same way, and so does `tchrun config`;
//! - scripts and files of the repository that a command names exist;
//! - the short ones run: `tchrun … hello_ranks` is run for real and must succeed.
//!
//! Placeholders for the user's own program (`my-trainer ARGS`) are left alone, and so
//! are other launchers' own flags (`torchrun`, `srun`, `mpirun`, `sbatch`): only the
//! workspace program they start is checked.

use std::collections::BTreeMap;
use std::fs;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use tch_distributed_tests::{run_with, scratch_dir, tchrun, without_launcher, Run};

/// The user's program in the docs, not a workspace target.
const PLACEHOLDERS: [&str; 1] = ["my-trainer"];

fn repo() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("..")
        .canonicalize()
        .unwrap()
}

/// One command line of a `sh` block: where it is, and its words (comments, leading
/// `VAR=value` assignments and the shell's `&` and `\` removed).
struct Line {
    at: String,
    words: Vec<String>,
}

/// The command lines of the `sh` code blocks in `file`.
fn sh_lines(file: &Path, name: &str) -> Vec<Line> {
    let text = fs::read_to_string(file).unwrap();
    let mut lines = Vec::new();
    let mut fence: Option<bool> = None; // Some(is_sh) inside a block
    for (no, line) in text.lines().enumerate() {
        let trimmed = line.trim_start();
        if let Some(lang) = trimmed.strip_prefix("```") {
            fence = match fence {
                None => Some(lang.trim() == "sh"),
                Some(_) => None,
            };
            continue;
        }
        if fence != Some(true) || trimmed.starts_with("{{#") {
            continue;
        }
        // A comment starts at a `#` after whitespace (or at the start of the line).
        let code = match line.find(" #") {
            Some(at) => &line[..at],
            None if trimmed.starts_with('#') => "",
            None => line,
        };
        let words: Vec<String> = code
            .split_whitespace()
            .skip_while(|w| {
                w.split_once('=').is_some_and(|(k, _)| {
                    !k.is_empty()
                        && k.chars()
                            .all(|c| c == '_' || c.is_ascii_uppercase() || c.is_ascii_digit())
                })
            })
            // A trailing `&` (run in the background) or `\` (continued on the next
            // line) is the shell's, not an argument.
            .filter(|w| *w != "&" && *w != "\\")
            .map(str::to_string)
            .collect();
        if !words.is_empty() {
            lines.push(Line {
                at: format!("{name}:{}", no + 1),
                words,
            });
        }
    }
    lines
}

/// The workspace's packages: name -> (manifest directory, bin names, example names).
type Targets = BTreeMap<String, (PathBuf, Vec<String>, Vec<String>)>;

fn workspace_targets(dir: &Path) -> Targets {
    let mut cmd = Command::new(std::env::var("CARGO").unwrap_or_else(|_| "cargo".into()));
    cmd.current_dir(repo()).args([
        "metadata",
        "--no-deps",
        "--format-version",
        "1",
        "--offline",
    ]);
    let run = run_with(cmd, dir, Duration::from_secs(120), |_, _| {});
    run.assert_success();
    let meta: serde_json::Value = serde_json::from_str(&run.stdout).unwrap();
    let mut targets = Targets::new();
    for package in meta["packages"].as_array().unwrap() {
        let manifest = PathBuf::from(package["manifest_path"].as_str().unwrap());
        let (mut bins, mut examples) = (Vec::new(), Vec::new());
        for target in package["targets"].as_array().unwrap() {
            let name = target["name"].as_str().unwrap().to_string();
            let kinds: Vec<&str> = target["kind"]
                .as_array()
                .unwrap()
                .iter()
                .filter_map(|k| k.as_str())
                .collect();
            if kinds.contains(&"bin") {
                bins.push(name);
            } else if kinds.contains(&"example") {
                examples.push(name);
            }
        }
        targets.insert(
            package["name"].as_str().unwrap().to_string(),
            (manifest.parent().unwrap().to_path_buf(), bins, examples),
        );
    }
    targets
}

/// The options of `tchrun`, from its help, each with whether it takes a value
/// (`--nproc-per-node <N>`; a flag whose value is optional and follows an `=`,
/// `--all-ranks-stdout[=<BOOL>]`, takes none after it).
fn options(help: &str) -> BTreeMap<String, bool> {
    help.lines()
        .filter_map(|l| {
            let l = l.trim_start();
            let l = l.strip_prefix("-h, ").unwrap_or(l);
            let (flag, rest) = l.split_once(' ').unwrap_or((l, ""));
            let flag = flag.split_once("[=").map_or(flag, |(flag, _)| flag);
            flag.starts_with("--")
                .then(|| (flag.to_string(), rest.starts_with('<')))
        })
        .collect()
}

struct Checker {
    dir: PathBuf,
    targets: Targets,
    /// `tchrun`'s options: whether each takes a value.
    tchrun_options: BTreeMap<String, bool>,
    problems: Vec<String>,
    ran: usize,
}

impl Checker {
    fn run(&self, mut cmd: Command, timeout: Duration) -> Run {
        without_launcher(&mut cmd).current_dir(repo());
        run_with(cmd, &self.dir, timeout, |_, _| {})
    }

    fn problem(&mut self, line: &Line, what: String) {
        self.problems
            .push(format!("{}: `{}`: {what}", line.at, line.words.join(" ")));
    }

    fn check(&mut self, line: &Line) {
        let words = &line.words;
        let first = words[0].as_str();
        let base = first.rsplit('/').next().unwrap();
        match base {
            "cargo" => self.check_cargo(line),
            "tchrun" => self.check_tchrun(line, 1),
            "export" | "pip" | "python3" | "source" => {}
            _ => {
                // Another launcher (torchrun, srun, mpirun, sbatch), a script or a
                // workspace program: files of the repository exist, and the program
                // it starts is checked.
                for word in words.iter().filter(|w| is_repo_file(w)) {
                    if !repo().join(word).exists() {
                        self.problem(line, format!("no file {word} in the repository"));
                    }
                }
                if let Some(at) = words.iter().position(|w| program_name(w).is_some()) {
                    self.check_program(line, &words[at], &words[at + 1..]);
                }
            }
        }
    }

    fn check_cargo(&mut self, line: &Line) {
        let words = &line.words;
        let sub = words.get(1).map(String::as_str).unwrap_or("");
        if !["build", "run", "install"].contains(&sub) {
            return self.problem(line, format!("cargo {sub} is not checked"));
        }
        let (cargo_args, program_args) = match words.iter().position(|w| w == "--") {
            Some(at) => (&words[2..at], &words[at + 1..]),
            None => (&words[2..], &words[words.len()..]),
        };
        let value = |flags: &[&str]| -> Vec<String> {
            cargo_args
                .windows(2)
                .filter(|w| flags.contains(&w[0].as_str()))
                .map(|w| w[1].clone())
                .collect()
        };
        let mut packages = value(&["-p", "--package"]);
        for path in value(&["--path"]) {
            // The own-crate chapter's clone of this repository, next to the crate.
            let dir = repo().join(path.strip_prefix("../tch-distributed/").unwrap_or(&path));
            match self.targets.iter().find(|(_, (d, ..))| *d == dir) {
                Some((name, _)) => packages.push(name.clone()),
                None => self.problem(line, format!("no workspace package at {path}")),
            }
        }
        for p in &packages {
            if !self.targets.contains_key(p) {
                self.problem(line, format!("no package {p} in the workspace"));
            }
        }
        let mut programs = Vec::new();
        for (flag, examples) in [("--bin", false), ("--example", true)] {
            for name in value(&[flag]) {
                let owners: Vec<&String> = self
                    .targets
                    .iter()
                    .filter(|(p, (_, bins, exs))| {
                        (packages.is_empty() || packages.contains(p))
                            && if examples { exs } else { bins }.contains(&name)
                    })
                    .map(|(p, _)| p)
                    .collect();
                if owners.is_empty() {
                    let within = match packages.is_empty() {
                        true => "the workspace".to_string(),
                        false => format!("package {}", packages.join(", ")),
                    };
                    self.problem(line, format!("no {flag} target {name} in {within}"));
                } else {
                    programs.push(match examples {
                        true => format!("target/debug/examples/{name}"),
                        false => format!("target/debug/{name}"),
                    });
                }
            }
        }
        if sub == "run" {
            if let [program] = programs.as_slice() {
                self.check_program(line, &program.clone(), program_args);
            }
        }
    }

    /// `tchrun [OPTIONS] PROGRAM ARGS` from `words[start..]`.
    fn check_tchrun(&mut self, line: &Line, start: usize) {
        let words = &line.words[start..];
        if words.first().map(String::as_str) == Some("config") {
            let mut cmd = Command::new(tchrun());
            cmd.args(words).arg("--help");
            return self.parses(line, cmd);
        }
        let mut at = 0;
        while at < words.len() && words[at].starts_with('-') {
            // An unknown option would be taken for the program (tchrun passes
            // everything from the program on verbatim).
            let Some(&valued) = self.tchrun_options.get(&words[at]) else {
                let what = format!("tchrun has no option {}", words[at]);
                return self.problem(line, what);
            };
            at += if valued { 2 } else { 1 };
        }
        let mut cmd = Command::new(tchrun());
        cmd.args(&words[..at.min(words.len())]).arg("--help");
        self.parses(line, cmd);
        let Some(program) = words.get(at) else {
            return;
        };
        let args = &words[at + 1..];
        self.check_program(line, program, args);
        // A short one: run it for real, on the debug build.
        if program_name(program).as_deref() == Some("hello_ranks") {
            let mut cmd = Command::new(tchrun());
            cmd.args(&words[..at]).arg(debug_path(program)).args(args);
            let run = self.run(cmd, Duration::from_secs(120));
            self.ran += 1;
            if !run.status.success() {
                self.problem(line, format!("failed: {}", run.stderr));
            }
        }
    }

    fn check_program(&mut self, line: &Line, program: &str, args: &[String]) {
        let Some(name) = program_name(program) else {
            return;
        };
        if PLACEHOLDERS.contains(&name.as_str()) {
            return;
        }
        let example = program.contains("/examples/");
        let known = self
            .targets
            .values()
            .any(|(_, bins, examples)| if example { examples } else { bins }.contains(&name));
        if !known {
            return self.problem(line, format!("{program}: no such workspace target"));
        }
        if name == "tchrun" {
            return;
        }
        let path = debug_path(program);
        // Only a program that takes flags (answers --help) has arguments to check.
        let mut help = Command::new(&path);
        help.arg("--help");
        let takes_flags = {
            let run = self.run(help, Duration::from_secs(60));
            run.status.success() && run.stdout.contains("Usage")
        };
        if takes_flags {
            let mut cmd = Command::new(&path);
            cmd.args(args).arg("--help");
            self.parses(line, cmd);
        } else if !args.is_empty() {
            self.problem(line, format!("{name} takes no arguments"));
        }
    }

    fn parses(&mut self, line: &Line, cmd: Command) {
        let run = self.run(cmd, Duration::from_secs(60));
        if !run.status.success() {
            self.problem(
                line,
                format!("its arguments do not parse: {}", run.stderr.trim()),
            );
        }
    }
}

/// The name of the workspace program that `word` runs (`target/release/examples/x`
/// or `./x` gives `x`), if it is one.
fn program_name(word: &str) -> Option<String> {
    let rest = word
        .strip_prefix("target/release/")
        .or_else(|| word.strip_prefix("target/debug/"))
        .or_else(|| word.strip_prefix("./"))?;
    let rest = rest.strip_prefix("examples/").unwrap_or(rest);
    (!rest.contains('/') && !rest.is_empty()).then(|| rest.to_string())
}

/// The debug build of the program that `word` names (the test suite builds debug).
fn debug_path(word: &str) -> PathBuf {
    let name = program_name(word).unwrap();
    let dir = match word.contains("/examples/") {
        true => "examples/",
        false => "",
    };
    tchrun().parent().unwrap().join(format!("{dir}{name}"))
}

/// Whether `word` names a file of the repository (a script, a listing).
fn is_repo_file(word: &str) -> bool {
    ["scripts/", "book/"].iter().any(|p| word.starts_with(p))
}

#[test]
fn every_shell_command_in_the_readme_and_the_book_works_as_pasted() {
    let dir = scratch_dir("book-commands");
    let targets = workspace_targets(&dir);
    let mut help = Command::new(tchrun());
    help.arg("--help");
    let help = run_with(help, &dir, Duration::from_secs(60), |_, _| {});
    help.assert_success();
    let mut checker = Checker {
        tchrun_options: options(&help.stdout),
        dir: dir.to_path_buf(),
        targets,
        problems: Vec::new(),
        ran: 0,
    };
    assert_eq!(
        (
            checker.tchrun_options.get("--nproc-per-node"),
            checker.tchrun_options.get("--help"),
            checker.tchrun_options.get("--all-ranks-stdout")
        ),
        (Some(&true), Some(&false), Some(&false)),
        "{:?}",
        checker.tchrun_options
    );
    let mut files = vec![(repo().join("README.md"), "README.md".to_string())];
    let mut pages: Vec<PathBuf> = fs::read_dir(repo().join("book/src"))
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|e| e == "md"))
        .collect();
    pages.sort();
    files.extend(pages.into_iter().map(|p| {
        let name = format!("book/src/{}", p.file_name().unwrap().to_string_lossy());
        (p, name)
    }));
    let mut checked = 0;
    for (file, name) in &files {
        for line in sh_lines(file, name) {
            checker.check(&line);
            checked += 1;
        }
    }
    assert!(checked > 30, "only {checked} commands found");
    assert!(checker.ran > 0, "no short command was run");
    assert!(
        checker.problems.is_empty(),
        "{} of {checked} commands do not work as pasted:\n{}",
        checker.problems.len(),
        checker.problems.join("\n")
    );
}
