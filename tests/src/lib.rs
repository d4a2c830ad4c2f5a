//! Harness for the integration tests: runs real multi-process jobs with a timeout,
//! and kills the whole process tree when one hangs, so a hang fails fast.
//!
//! - Every process a test starts runs in a process group of its own ([`ProcessGroup`])
//!   that is killed at its timeout and when the test panics ([`run_with`],
//!   [`output_within`]), on the CPU unless the test asks for CUDA ([`pin_device`]).
//! - PyTorch (for comparisons and `torchrun`) is found in one place ([`python`]); a
//!   test that cannot run part of itself says so through [`skip`], which
//!   `scripts/test.sh` lists at its end and which fails the test under `CI=true`.
//! - Scratch directories are removed when the test passes, kept when it fails
//!   ([`scratch_dir`]).
//! - Several hosts on one machine, from network namespaces, for the multi-host tests
//!   ([`hosts`]).

use std::ffi::OsStr;
use std::fs;
use std::io::{Read, Write};
use std::ops::Deref;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Output, Stdio};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::thread;
use std::time::{Duration, Instant};

pub mod compare;
pub mod hosts;

/// The `tchrun` binary built next to the test executables (`target/<profile>/tchrun`).
///
/// Panics, saying how to build it, when it is missing: `cargo test` builds only this
/// package's binaries, so the README's test command builds the workspace's first.
pub fn tchrun() -> PathBuf {
    let exe = std::env::current_exe().expect("current_exe");
    // target/<profile>/deps/<test> -> target/<profile>/tchrun
    let path = exe
        .parent()
        .and_then(Path::parent)
        .expect("target dir")
        .join("tchrun");
    assert!(
        path.exists(),
        "{} is missing: run `cargo build --workspace --bins` first",
        path.display()
    );
    path
}

/// The workspace example `name` built next to the test executables
/// (`target/<profile>/examples/<name>`).
///
/// Panics, saying how to build it, when it is missing: `cargo test -p
/// tch-distributed-tests` does not build the examples package.
pub fn example(name: &str) -> PathBuf {
    let exe = std::env::current_exe().expect("current_exe");
    // target/<profile>/deps/<test> -> target/<profile>/examples/<name>
    let path = exe
        .parent()
        .and_then(Path::parent)
        .expect("target dir")
        .join("examples")
        .join(name);
    assert!(
        path.exists(),
        "{} is missing: run `cargo build --workspace --examples` first",
        path.display()
    );
    path
}

/// Where cargo keeps this workspace's builds, as `cargo metadata` reports them.
pub struct CargoDirs {
    /// The final artifacts (binaries, `package/`): `CARGO_TARGET_DIR`, a config's
    /// `build.target-dir`, or `target/`.
    pub target: PathBuf,
    /// The intermediate ones (dependencies' rlibs, build scripts' output,
    /// fingerprints): cargo's `build.build-dir`, which is the target directory unless
    /// set (and on cargo before 1.91, which has no such setting).
    pub build: PathBuf,
}

/// This workspace's [`CargoDirs`], asked of `cargo metadata` once per test process.
/// Panics when `cargo metadata` fails.
pub fn cargo_dirs() -> &'static CargoDirs {
    static DIRS: std::sync::OnceLock<CargoDirs> = std::sync::OnceLock::new();
    DIRS.get_or_init(ask_cargo_dirs)
}

fn ask_cargo_dirs() -> CargoDirs {
    let out = Command::new(std::env::var("CARGO").unwrap_or_else(|_| "cargo".into()))
        .current_dir(Path::new(env!("CARGO_MANIFEST_DIR")).join(".."))
        .env_remove("CARGO_MANIFEST_DIR")
        .args(["metadata", "--format-version", "1", "--no-deps"])
        .output()
        .expect("cargo metadata");
    assert!(
        out.status.success(),
        "cargo metadata: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let metadata: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let dir = |key: &str| metadata[key].as_str().map(PathBuf::from);
    let target = dir("target_directory").expect("target_directory");
    let build = dir("build_directory").unwrap_or_else(|| target.clone());
    CargoDirs { target, build }
}

/// A TCP port on 127.0.0.1 that was free a moment ago (bound to port 0 and released),
/// for a test that must name `MASTER_PORT` itself. Another process may take it in
/// between; the tests that use it start their ranks at once.
pub fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

/// The variable that names the Python with PyTorch the tests use:
/// `TCHD_PYTHON=/path/to/python` (see [`python`]).
pub const PYTHON_VAR: &str = "TCHD_PYTHON";

/// The Python whose PyTorch the tests compare with, and whose `torchrun` they launch
/// with: the one lookup every such test goes through (by [`python_or_skip`],
/// [`run_python`] or [`torchrun`]). The first of these that is set decides:
///
/// 1. `TCHD_PYTHON`: a Python by path, or by name on `PATH`; any Python with torch,
///    e.g. the GPU machine's `python3` (the GPU package's `run.sh` sets it);
/// 2. `VIRTUAL_ENV`: its `bin/python`, the virtualenv that `scripts/env.sh` activated
///    (`.venv` for torch 2.11, `.venv-2.13` for torch 2.13);
/// 3. otherwise the project's `.venv/bin/python` (plain `cargo test`).
///
/// A Python that is named but missing is not replaced by the next one, which could
/// hold another torch. `Err` says what was looked for and how to provide it.
pub fn python() -> Result<PathBuf, String> {
    find_python(|var| std::env::var_os(var))
}

/// [`python`]'s lookup in the environment that `var` reads.
fn find_python(var: impl Fn(&str) -> Option<std::ffi::OsString>) -> Result<PathBuf, String> {
    let set = |name: &str| var(name).filter(|v| !v.is_empty());
    if let Some(named) = set(PYTHON_VAR) {
        let named = PathBuf::from(named);
        let by_path = named.components().count() > 1;
        let found = if by_path {
            Some(named.clone()).filter(|p| p.is_file())
        } else {
            std::env::split_paths(&var("PATH").unwrap_or_default())
                .map(|dir| dir.join(&named))
                .find(|p| p.is_file())
        };
        let on_path = if by_path { "" } else { " on PATH" };
        return found.ok_or_else(|| {
            format!(
                "no PyTorch: {PYTHON_VAR}={} does not exist{on_path}",
                named.display()
            )
        });
    }
    let (python, origin) = match set("VIRTUAL_ENV") {
        Some(venv) => (PathBuf::from(venv).join("bin/python"), "VIRTUAL_ENV's"),
        None => (
            Path::new(env!("CARGO_MANIFEST_DIR"))
                .parent()
                .expect("the repository")
                .join(".venv/bin/python"),
            "the project's",
        ),
    };
    if python.is_file() {
        Ok(python)
    } else {
        Err(format!(
            "no PyTorch: {origin} {} does not exist ({PYTHON_VAR} is unset; \
             scripts/env.sh creates the project's .venv, or set {PYTHON_VAR} to a Python \
             with torch)",
            python.display()
        ))
    }
}

/// [`python`], or `None` after [`skip`] has recorded that the calling test leaves out
/// `what` for want of it (a failure under `CI=true`).
pub fn python_or_skip(what: &str) -> Option<PathBuf> {
    match python() {
        Ok(python) => Some(python),
        Err(why) => {
            skip(&format!("{what} not run: {why}"));
            None
        }
    }
}

/// How long one Python script of a test may run (importing torch on a busy 2-core
/// machine takes seconds).
pub const PYTHON_TIMEOUT: Duration = Duration::from_secs(300);

/// A `torchrun` command (arguments to be added) from [`python`]'s PyTorch: the
/// `torchrun` beside that Python, else `python -m torch.distributed.run` (what
/// `torchrun` runs). `None` after [`skip`] has recorded the skip (a failure under
/// `CI=true`).
pub fn torchrun() -> Option<Command> {
    let python = python_or_skip("torchrun")?;
    let beside = python.with_file_name("torchrun");
    Some(if beside.is_file() {
        Command::new(beside)
    } else {
        let mut cmd = Command::new(python);
        cmd.args(["-m", "torch.distributed.run"]);
        cmd
    })
}

/// Runs `script` with [`python`]'s Python (`python -c script args…`, `stdin` on its
/// standard input, within [`PYTHON_TIMEOUT`]) and returns its standard output; `None`
/// after [`skip`] has recorded that the comparison with PyTorch was left out (a
/// failure under `CI=true`). Panics with Python's stderr when the script fails.
pub fn run_python(script: &str, args: &[&str], stdin: &str) -> Option<String> {
    let python = python_or_skip("comparison with PyTorch")?;
    let mut cmd = Command::new(&python);
    cmd.arg("-c").arg(script).args(args);
    let out = output_within(&mut cmd, stdin.as_bytes(), PYTHON_TIMEOUT);
    assert!(
        out.status.success(),
        "{} failed ({}):\n{}",
        python.display(),
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
    Some(String::from_utf8(out.stdout).unwrap())
}

/// The variable that names the file [`skip`] appends to: `scripts/test.sh` sets it and
/// prints the file's lines at its end ("skipped: …", or "skipped: nothing").
pub const SKIP_LOG_VAR: &str = "TCHD_SKIP_LOG";

/// Whether this is a CI run (`CI=true`, as CI services set it), in which nothing may be
/// skipped: what a test would skip for want of it fails the test instead.
pub fn ci() -> bool {
    std::env::var("CI").is_ok_and(|v| v == "true")
}

/// The test that calls this: `TARGET::TEST` (the test executable's name without
/// cargo's hash, and the name of the thread libtest runs the test on).
pub fn current_test() -> String {
    let exe = std::env::current_exe().ok();
    let stem = exe
        .as_deref()
        .and_then(Path::file_stem)
        .and_then(|s| s.to_str())
        .unwrap_or("?");
    let target = match stem.rsplit_once('-') {
        Some((name, hash)) if hash.len() == 16 && hash.bytes().all(|b| b.is_ascii_hexdigit()) => {
            name
        }
        _ => stem,
    };
    match thread::current().name() {
        Some(test) if test != "main" => format!("{target}::{test}"),
        _ => target.to_string(),
    }
}

/// Records that the calling test leaves something out for `reason`, where the person
/// running the tests sees it: a line `TARGET::TEST: reason` appended to the file that
/// `TCHD_SKIP_LOG` names (`scripts/test.sh` lists them at its end) and written to the
/// test's stderr stream itself, which libtest does not capture. Under `CI=true`
/// ([`ci`]) it panics instead: there a missing PyTorch, `torchrun` or `mpirun` is a
/// failure.
pub fn skip(reason: &str) {
    let log = std::env::var_os(SKIP_LOG_VAR).filter(|v| !v.is_empty());
    let line = record_skip(reason, ci(), log.as_deref().map(Path::new));
    let _ = std::io::stderr().write_all(format!("skipped: {line}\n").as_bytes());
}

/// [`skip`] with `CI=true` or not, and the log file, given; returns the line logged.
fn record_skip(reason: &str, ci: bool, log: Option<&Path>) -> String {
    let line = format!("{}: {reason}", current_test());
    if ci {
        panic!("{line}\n(CI=true: a test that cannot run fails instead of skipping)");
    }
    if let Some(log) = log {
        // One write per line, appended: tests run in parallel threads and processes.
        let mut file = fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(log)
            .unwrap_or_else(|e| panic!("{SKIP_LOG_VAR}={}: {e}", log.display()));
        file.write_all(format!("{line}\n").as_bytes()).unwrap();
    }
    line
}

/// Joins a world of one in this test process, on the CPU over Gloo whatever the host
/// has (on a GPU machine `init()` would choose NCCL on `cuda:0`), as [`pin_device`]
/// does for the processes the harness starts.
pub fn init_on_cpu() -> tch_distributed::Context {
    tch_distributed::init_with(tch_distributed::InitOptions {
        backend: Some(tch_distributed::Backend::Gloo),
        device: Some(tch::Device::Cpu),
        ..Default::default()
    })
    .expect("a world of one on the CPU")
}

/// Whether an executable file named `program` is in a directory of `PATH`: a look,
/// without running anything (so without a wait to bound).
pub fn on_path(program: &str) -> bool {
    std::env::var_os("PATH")
        .is_some_and(|path| std::env::split_paths(&path).any(|dir| dir.join(program).is_file()))
}

/// Runs `cmd` to its end with `stdin` on its standard input and returns its output
/// (not checked for success), for short commands (a Python script, `--version`,
/// `--help`). It runs in its own process group held by a [`ProcessGroup`] (GPUs hidden
/// as [`pin_device`] says); past `timeout` the group is killed and the test panics
/// with what the command had printed.
pub fn output_within(cmd: &mut Command, stdin: &[u8], timeout: Duration) -> Output {
    let start = Instant::now();
    cmd.stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    let mut group =
        ProcessGroup::spawn(cmd).unwrap_or_else(|e| panic!("cannot start {cmd:?}: {e}"));
    let child = group.child_mut();
    let (mut input, out, err) = (
        child.stdin.take().unwrap(),
        child.stdout.take().unwrap(),
        child.stderr.take().unwrap(),
    );
    let stdin = stdin.to_vec();
    // A command that does not read its input is no error.
    let writer = thread::spawn(move || drop(input.write_all(&stdin)));
    let reader = |mut pipe: Box<dyn Read + Send>| {
        thread::spawn(move || {
            let mut bytes = Vec::new();
            let _ = pipe.read_to_end(&mut bytes);
            bytes
        })
    };
    let (out_reader, err_reader) = (reader(Box::new(out)), reader(Box::new(err)));
    let status = group.wait_until(start + timeout);
    // The group is gone now (on time or killed): every pipe is closed.
    drop(group);
    let _ = writer.join();
    let (stdout, stderr) = (out_reader.join().unwrap(), err_reader.join().unwrap());
    let Some(status) = status else {
        panic!(
            "{cmd:?} did not exit within {timeout:?}\nstdout:\n{}\nstderr:\n{}",
            String::from_utf8_lossy(&stdout),
            String::from_utf8_lossy(&stderr)
        );
    };
    Output {
        status,
        stdout,
        stderr,
    }
}

/// Removes the launch environment (torchrun's, SLURM's, the SDK's own) from `cmd`,
/// so that it runs as one process unless the test sets it up.
pub fn without_launcher(cmd: &mut Command) -> &mut Command {
    for var in [
        "RANK",
        "WORLD_SIZE",
        "LOCAL_RANK",
        "LOCAL_WORLD_SIZE",
        "MASTER_ADDR",
        "MASTER_PORT",
        "TCH_DISTRIBUTED_NPROC",
        "TCH_DISTRIBUTED_RECORD",
        "SLURM_PROCID",
        "SLURM_STEP_NUM_TASKS",
        "OMPI_COMM_WORLD_RANK",
        "OMPI_COMM_WORLD_SIZE",
        "PMI_RANK",
        "PMI_SIZE",
        "TCH_DISTRIBUTED_BACKEND",
        "TCH_DISTRIBUTED_CONFIG",
        "TCH_DISTRIBUTED_MIXED_PRECISION",
        "TCH_DISTRIBUTED_GRAD_ACCUM",
        "TCH_DISTRIBUTED_GPUS",
        "TCH_DISTRIBUTED_MAX_RESTARTS",
        ALL_RANKS_STDOUT_VAR,
    ] {
        cmd.env_remove(var);
    }
    cmd
}

/// A fresh, empty scratch directory for one test (`$TMPDIR/tchd-test-PID-N-NAME`).
///
/// It goes away with the returned [`Scratch`]: removed when the test passes, kept when
/// it fails (the `Scratch` is dropped while the test's thread panics), for inspection,
/// with its path written to the test's stderr. It derefs to [`Path`].
pub fn scratch_dir(name: &str) -> Scratch {
    static COUNTER: AtomicUsize = AtomicUsize::new(0);
    let dir = std::env::temp_dir().join(format!(
        "tchd-test-{}-{}-{name}",
        std::process::id(),
        COUNTER.fetch_add(1, Ordering::Relaxed)
    ));
    let _ = fs::remove_dir_all(&dir);
    fs::create_dir_all(&dir).unwrap();
    Scratch(dir)
}

/// A test's scratch directory (see [`scratch_dir`]): removed on drop unless the thread
/// is panicking, that is unless the test failed.
#[derive(Debug)]
pub struct Scratch(PathBuf);

impl Drop for Scratch {
    fn drop(&mut self) {
        if thread::panicking() {
            let note = format!("kept {} for inspection\n", self.0.display());
            let _ = std::io::stderr().write_all(note.as_bytes());
        } else {
            let _ = fs::remove_dir_all(&self.0);
        }
    }
}

impl Deref for Scratch {
    type Target = Path;
    fn deref(&self) -> &Path {
        &self.0
    }
}

impl AsRef<Path> for Scratch {
    fn as_ref(&self) -> &Path {
        &self.0
    }
}

/// Copies directory `from` into `to` (made if missing), subdirectories included: a
/// checkpoint directory, say, that a test resumes from twice.
pub fn copy_dir(from: &Path, to: &Path) {
    fs::create_dir_all(to).unwrap();
    for entry in fs::read_dir(from).unwrap() {
        let entry = entry.unwrap();
        let target = to.join(entry.file_name());
        match entry.file_type().unwrap().is_dir() {
            true => copy_dir(&entry.path(), &target),
            false => drop(fs::copy(entry.path(), target).unwrap()),
        }
    }
}

/// The bytes of optimizer state that rank `rank` of a worker run held, as the zero and
/// sharding workers write them (`DIR/OUT.state-bytes-RANK`).
pub fn state_bytes(dir: &Path, out: &str, rank: usize) -> usize {
    let file = dir.join(format!("{out}.state-bytes-{rank}"));
    let text = fs::read_to_string(&file).unwrap_or_else(|e| panic!("{}: {e}", file.display()));
    text.trim().parse().unwrap()
}

impl AsRef<OsStr> for Scratch {
    fn as_ref(&self) -> &OsStr {
        self.0.as_os_str()
    }
}

/// The outcome of one run.
#[derive(Debug)]
pub struct Run {
    pub status: ExitStatus,
    pub stdout: String,
    pub stderr: String,
    pub elapsed: Duration,
}

impl Run {
    /// Panics with the run's output unless it exited 0.
    pub fn assert_success(&self) -> &Self {
        assert!(
            self.status.success(),
            "exit {:?}\nstdout:\n{}\nstderr:\n{}",
            self.status,
            self.stdout,
            self.stderr
        );
        self
    }

    /// This run with its stdout as the ranks wrote it ([`without_rank_prefixes`]), for a
    /// launcher that showed every rank's ([`all_ranks_stdout`]).
    pub fn without_rank_prefixes(mut self) -> Run {
        self.stdout = without_rank_prefixes(&self.stdout);
        self
    }
}

/// The variable of the `all_ranks_stdout` setting. By default `tchrun` and a program that
/// starts its own ranks show global rank 0's standard output alone, as torchrun's
/// `--local-ranks-filter 0`; with it `true` they show every rank's, each line after
/// `[rank N] ` ([`rank_line`]). A test that reads other ranks' lines, or counts lines to
/// show that only rank 0 printed, sets it ([`all_ranks_stdout`], [`run_tchrun_all_ranks`]).
pub const ALL_RANKS_STDOUT_VAR: &str = "TCH_DISTRIBUTED_ALL_RANKS_STDOUT";

/// Sets [`ALL_RANKS_STDOUT_VAR`] for `cmd`: the launcher it runs (`tchrun`, or a program
/// that starts its own ranks) shows every rank's standard output.
pub fn all_ranks_stdout(cmd: &mut Command) -> &mut Command {
    cmd.env(ALL_RANKS_STDOUT_VAR, "true")
}

/// A line of a launcher that shows every rank's standard output: the rank that wrote it
/// and the line as the rank wrote it. `[rank 3] loss 0.5` is `(Some(3), "loss 0.5")`; a
/// line without the prefix (the launcher's own) is `(None, line)`.
pub fn rank_line(line: &str) -> (Option<usize>, &str) {
    line.strip_prefix("[rank ")
        .and_then(|rest| rest.split_once("] "))
        .and_then(|(rank, text)| Some((Some(rank.parse().ok()?), text)))
        .unwrap_or((None, line))
}

/// The standard output of a launcher that shows every rank's, each line without the
/// `[rank N] ` before it ([`rank_line`]), in the order the launcher showed them: what the
/// ranks wrote, for a test that reads their lines.
pub fn without_rank_prefixes(stdout: &str) -> String {
    stdout
        .lines()
        .map(|line| format!("{}\n", rank_line(line).1))
        .collect()
}

/// A process started in a process group of its own, whose whole group is SIGKILLed
/// and the process reaped when this is dropped: when a test ends, and when it panics
/// (a failed assertion while a job runs, a missed deadline), so that nothing a test
/// started (a launcher, its ranks, their children) outlives it.
///
/// Its exit is observed without reaping it (`waitid` with `WNOWAIT`), so the group is
/// killed while its id still belongs to it.
#[derive(Debug)]
pub struct ProcessGroup {
    child: Child,
}

impl ProcessGroup {
    /// Starts `cmd` as the leader of a new process group, its GPUs hidden unless it
    /// asks for them ([`pin_device`]).
    pub fn spawn(cmd: &mut Command) -> std::io::Result<Self> {
        pin_device(cmd);
        let child = cmd.process_group(0).spawn()?;
        Ok(Self { child })
    }

    /// The leader's pid, which is also the group's id.
    pub fn id(&self) -> u32 {
        self.child.id()
    }

    /// The leader, for its pipes.
    pub fn child_mut(&mut self) -> &mut Child {
        &mut self.child
    }

    /// Whether the leader has exited, leaving it unreaped.
    fn exited(&self) -> bool {
        let mut info: libc::siginfo_t = unsafe { std::mem::zeroed() };
        let rc = unsafe {
            libc::waitid(
                libc::P_PID,
                self.child.id() as libc::id_t,
                &mut info,
                libc::WEXITED | libc::WNOHANG | libc::WNOWAIT,
            )
        };
        // Not waitable (already reaped): exited too.
        rc != 0 || unsafe { info.si_pid() } != 0
    }

    /// SIGKILLs every process in the group.
    pub fn kill(&self) {
        unsafe { libc::kill(-(self.child.id() as i32), libc::SIGKILL) };
    }

    /// Waits until the leader exits, then kills what is left of its group and returns
    /// the leader's status; at `deadline`, kills the whole group and returns `None`.
    pub fn wait_until(&mut self, deadline: Instant) -> Option<ExitStatus> {
        loop {
            if self.exited() {
                self.kill();
                return Some(self.child.wait().unwrap());
            }
            if Instant::now() >= deadline {
                self.kill();
                self.child.wait().unwrap();
                return None;
            }
            thread::sleep(Duration::from_millis(20));
        }
    }
}

impl Drop for ProcessGroup {
    fn drop(&mut self) {
        self.kill();
        let _ = self.child.wait();
    }
}

static GPU_SUITE: AtomicBool = AtomicBool::new(false);

/// Declares this test executable a GPU suite (`tests/tests/gpu.rs`,
/// `corpus/tests/gpu.rs`): every process it starts sees the machine's GPUs.
pub fn gpu_suite() {
    GPU_SUITE.store(true, Ordering::Relaxed);
}

/// Hides the GPUs from `cmd` (`CUDA_VISIBLE_DEVICES=`, empty) unless it asks for them.
///
/// On a GPU machine the SDK's default backend is NCCL on `cuda:LOCAL_RANK`; the CPU
/// tests assume Gloo on the CPU (a banner with `devices cpu`, `auto: CPU`, one rank
/// per process rather than per GPU), so every process the harness starts runs on the
/// CPU, wherever the suite runs. A command asks for the GPUs when its environment,
/// given or inherited, has `TCHD_TEST_DEVICE=cuda` ([`TEST_DEVICE_VAR`]), when it sets
/// `CUDA_VISIBLE_DEVICES` itself, or when it runs in a [`gpu_suite`].
pub fn pin_device(cmd: &mut Command) -> &mut Command {
    let given = |var: &str| {
        cmd.get_envs()
            .find(|(k, _)| *k == OsStr::new(var))
            .map(|(_, v)| v.map(OsStr::to_os_string))
    };
    let device = given(TEST_DEVICE_VAR).unwrap_or_else(|| std::env::var_os(TEST_DEVICE_VAR));
    let asks = GPU_SUITE.load(Ordering::Relaxed)
        || device.as_deref() == Some(OsStr::new("cuda"))
        || matches!(given("CUDA_VISIBLE_DEVICES"), Some(Some(_)));
    if !asks {
        cmd.env("CUDA_VISIBLE_DEVICES", "");
    }
    cmd
}

/// Runs `cmd` in its own process group ([`ProcessGroup`], GPUs hidden unless it asks
/// for them: [`pin_device`]) with `D=dir` in its environment and `OMP_NUM_THREADS=1`,
/// calls `while_running(pid, dir)` once it has started, and kills the whole group if
/// it runs longer than `timeout` (then panics with its output). The group is killed
/// too when `while_running` panics, and once the command has exited (whatever it left
/// behind). Output goes to files in `dir`, so stray grandchildren cannot block the
/// test on a pipe.
///
/// `while_running` must bound its own waits (see [`wait_until`]): the timeout is
/// enforced once it returns.
pub fn run_with(
    mut cmd: Command,
    dir: &Path,
    timeout: Duration,
    while_running: impl FnOnce(u32, &Path),
) -> Run {
    let out_path = dir.join("run.stdout");
    let err_path = dir.join("run.stderr");
    let start = Instant::now();
    cmd.env("D", dir)
        .env("OMP_NUM_THREADS", "1")
        .stdin(Stdio::null())
        .stdout(fs::File::create(&out_path).unwrap())
        .stderr(fs::File::create(&err_path).unwrap());
    let mut group =
        ProcessGroup::spawn(&mut cmd).unwrap_or_else(|e| panic!("cannot start {cmd:?}: {e}"));
    while_running(group.id(), dir);
    let Some(status) = group.wait_until(start + timeout) else {
        panic!(
            "{cmd:?} did not exit within {timeout:?}\nstdout:\n{}\nstderr:\n{}",
            fs::read_to_string(&out_path).unwrap_or_default(),
            fs::read_to_string(&err_path).unwrap_or_default()
        );
    };
    Run {
        status,
        stdout: fs::read_to_string(&out_path).unwrap(),
        stderr: fs::read_to_string(&err_path).unwrap(),
        elapsed: start.elapsed(),
    }
}

/// Runs every `(command, dir)` at the same time, each as [`run_with`] does (its own
/// process group, `timeout`, output in its `dir`), and returns their runs in the same
/// order: ranks started by hand, or the nodes of a job on one machine.
/// `while_running(i, pid, dir)` is called for the `i`-th once it has started, on that
/// run's own thread.
pub fn run_together<D: AsRef<Path> + Send>(
    runs: Vec<(Command, D)>,
    timeout: Duration,
    while_running: impl Fn(usize, u32, &Path) + Sync,
) -> Vec<Run> {
    let while_running = &while_running;
    thread::scope(|s| {
        let handles: Vec<_> = runs
            .into_iter()
            .enumerate()
            .map(|(i, (cmd, dir))| {
                s.spawn(move || {
                    run_with(cmd, dir.as_ref(), timeout, |pid, dir| {
                        while_running(i, pid, dir)
                    })
                })
            })
            .collect();
        handles
            .into_iter()
            .map(|h| h.join().unwrap_or_else(|e| std::panic::resume_unwind(e)))
            .collect()
    })
}

/// `run_with` for `tchrun args…`.
pub fn run_tchrun(
    dir: &Path,
    args: &[&str],
    timeout: Duration,
    while_running: impl FnOnce(u32, &Path),
) -> Run {
    let mut cmd = Command::new(tchrun());
    cmd.args(args);
    run_with(cmd, dir, timeout, while_running)
}

/// [`run_tchrun`] showing every rank's standard output (`tchrun --all-ranks-stdout`),
/// the run's stdout as the ranks wrote it ([`Run::without_rank_prefixes`]): for a test
/// that reads other ranks' lines, or counts lines to show that only rank 0 printed.
pub fn run_tchrun_all_ranks(
    dir: &Path,
    args: &[&str],
    timeout: Duration,
    while_running: impl FnOnce(u32, &Path),
) -> Run {
    let all: Vec<&str> = std::iter::once("--all-ranks-stdout")
        .chain(args.iter().copied())
        .collect();
    run_tchrun(dir, &all, timeout, while_running).without_rank_prefixes()
}

/// Waits up to `timeout` until `file` exists and contains `needle`; returns its text.
pub fn wait_for_text(file: &Path, needle: &str, timeout: Duration) -> String {
    let deadline = Instant::now() + timeout;
    loop {
        let text = fs::read_to_string(file).unwrap_or_default();
        if text.contains(needle) {
            return text;
        }
        assert!(
            Instant::now() < deadline,
            "{} did not show {needle:?} within {timeout:?}:\n{text}",
            file.display()
        );
        thread::sleep(Duration::from_millis(20));
    }
}

/// Polls `ready` every 20 ms until it returns true; panics, naming `what`, when it has
/// not within `timeout` (a job that died early must fail the test, not hang it).
pub fn wait_until(what: &str, timeout: Duration, mut ready: impl FnMut() -> bool) {
    let deadline = Instant::now() + timeout;
    while !ready() {
        assert!(Instant::now() < deadline, "not within {timeout:?}: {what}");
        thread::sleep(Duration::from_millis(20));
    }
}

/// A small deterministic PRNG (xorshift64*).
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }
    fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }
}

/// `n` 28x28 images and their labels: class k is a bright 5x5 blob centred at a
/// class-dependent position (two rows of five), jittered by up to a pixel, on a
/// noisy background.
fn synthetic(n: usize, rng: &mut Rng) -> (Vec<u8>, Vec<u8>) {
    let mut images = Vec::with_capacity(n * 28 * 28);
    let mut labels = Vec::with_capacity(n);
    for _ in 0..n {
        let k = rng.below(10) as usize;
        let cy = [8, 20][k / 5] + rng.below(3) as i64 - 1;
        let cx = 4 + 5 * (k % 5) as i64 + rng.below(3) as i64 - 1;
        for y in 0..28i64 {
            for x in 0..28i64 {
                let pixel = if (y - cy).abs() <= 2 && (x - cx).abs() <= 2 {
                    180 + rng.below(76)
                } else {
                    rng.below(60)
                };
                images.push(pixel as u8);
            }
        }
        labels.push(k as u8);
    }
    (images, labels)
}

fn write_idx(path: &Path, magic: u32, dims: &[u32], data: &[u8]) {
    let mut bytes = magic.to_be_bytes().to_vec();
    for d in dims {
        bytes.extend(d.to_be_bytes());
    }
    bytes.extend(data);
    fs::write(path, bytes).unwrap();
}

/// Writes the four MNIST idx files into `dir`: `train` training and `test` test
/// images of a synthetic, learnable task (see `synthetic`), the same on every call.
pub fn write_mnist(dir: &Path, train: usize, test: usize) {
    let mut rng = Rng(0x9e37_79b9_7f4a_7c15);
    for (prefix, n) in [("train", train), ("t10k", test)] {
        let (images, labels) = synthetic(n, &mut rng);
        let n = n as u32;
        write_idx(
            &dir.join(format!("{prefix}-images-idx3-ubyte")),
            2051,
            &[n, 28, 28],
            &images,
        );
        write_idx(
            &dir.join(format!("{prefix}-labels-idx1-ubyte")),
            2049,
            &[n],
            &labels,
        );
    }
}

/// The binary `name` of this workspace built next to the test executable
/// (`target/<profile>/<name>`), found from the test executable's own path so that a
/// suite copied to another machine (see `scripts/test_gpu.sh --package`) finds the
/// binaries copied beside it. Panics, saying how to build it, when it is missing.
pub fn binary(name: &str) -> PathBuf {
    let exe = std::env::current_exe().expect("current_exe");
    // target/<profile>/deps/<test> -> target/<profile>/<name>
    let path = exe
        .parent()
        .and_then(Path::parent)
        .expect("target dir")
        .join(name);
    assert!(
        path.exists(),
        "{} is missing: run `cargo build --workspace --bins` first",
        path.display()
    );
    path
}

/// The environment variable with which a test asks the worker programs for CUDA:
/// `TCHD_TEST_DEVICE=cuda`. Unset (or `cpu`), the workers train on the CPU as always.
pub const TEST_DEVICE_VAR: &str = "TCHD_TEST_DEVICE";

/// Whether this worker was asked to train on CUDA (`TCHD_TEST_DEVICE=cuda`); panics on
/// any value other than `cuda` or `cpu`.
pub fn cuda_requested() -> bool {
    match std::env::var(TEST_DEVICE_VAR).as_deref() {
        Ok("cuda") => true,
        Ok("cpu") | Err(_) => false,
        Ok(other) => panic!("{TEST_DEVICE_VAR}={other:?}: use cuda or cpu"),
    }
}

/// The device a worker trains on: `rank_device` (the rank's device, as
/// `tch_distributed::init` chose it) when CUDA is requested, panicking unless it is
/// a CUDA device, else the CPU.
pub fn test_device(rank_device: tch::Device) -> tch::Device {
    if cuda_requested() {
        assert!(
            rank_device.is_cuda(),
            "{TEST_DEVICE_VAR}=cuda but this rank's device is {rank_device:?}: no GPU visible"
        );
        rank_device
    } else {
        tch::Device::Cpu
    }
}

/// Whether CUDA is available to this process, as `tch::Cuda::is_available()` says once
/// libtorch's CUDA library is loaded.
///
/// A Rust executable depends on `libtorch_cuda.so` only when it uses one of its symbols
/// (rustc links with `--as-needed`): a program that calls `tch_distributed::init` does,
/// but a test executable that only launches programs does not, and libtorch without
/// its CUDA library reports no GPU on a machine that has one. So this loads it first
/// (`dlopen`, found as the executable's own libraries are: `LD_LIBRARY_PATH`, then the
/// rpath), as `import torch` does. libtorch settles which CUDA support it has at its
/// first CUDA question, so call this before anything else asks.
pub fn cuda_available() -> bool {
    // Null for a CPU-only libtorch: then CUDA is simply not available.
    unsafe {
        libc::dlopen(
            c"libtorch_cuda.so".as_ptr(),
            libc::RTLD_NOW | libc::RTLD_GLOBAL,
        )
    };
    tch::Cuda::is_available()
}

/// The live children of `pid` (found through `/proc`; a zombie, already dead and
/// waiting to be reaped, does not count).
pub fn children(pid: u32) -> Vec<u32> {
    std::fs::read_dir("/proc")
        .unwrap()
        .filter_map(|e| e.ok()?.file_name().to_str()?.parse::<u32>().ok())
        .filter(|&p| {
            let stat = std::fs::read_to_string(format!("/proc/{p}/stat")).unwrap_or_default();
            // pid (comm) state ppid …: comm may hold spaces, so read after the last ')'.
            let mut fields = stat
                .rsplit_once(')')
                .map_or("", |(_, rest)| rest)
                .split_whitespace();
            let state = fields.next();
            let ppid = fields.next().and_then(|f| f.parse::<u32>().ok());
            state.is_some_and(|s| s != "Z") && ppid == Some(pid)
        })
        .collect()
}

/// `pid` and every process below it (its children, theirs, …), alive or not yet reaped.
pub fn process_tree(pid: u32) -> Vec<u32> {
    let mut tree = vec![pid];
    let mut next = 0;
    while next < tree.len() {
        tree.extend(children(tree[next]));
        next += 1;
    }
    tree
}

/// The addresses that the processes `pids` listen on with TCP, read from
/// `/proc/PID/net/tcp` and `tcp6` (each process's own network namespace) for the
/// sockets among its file descriptors.
pub fn listening_addresses(pids: &[u32]) -> Vec<std::net::SocketAddr> {
    use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};
    // An address as the kernel prints it: the IP's 32-bit words as host-order (here
    // little-endian) integers, then the port, in hex.
    fn parse(text: &str) -> Option<SocketAddr> {
        let (ip, port) = text.split_once(':')?;
        let port = u16::from_str_radix(port, 16).ok()?;
        let words: Vec<u32> = (0..ip.len() / 8)
            .map(|i| u32::from_str_radix(&ip[8 * i..8 * i + 8], 16))
            .collect::<Result<_, _>>()
            .ok()?;
        let ip: IpAddr = match words.as_slice() {
            [w] => Ipv4Addr::from(w.to_le_bytes()).into(),
            [a, b, c, d] => {
                let mut bytes = [0u8; 16];
                for (i, w) in [a, b, c, d].iter().enumerate() {
                    bytes[4 * i..4 * i + 4].copy_from_slice(&w.to_le_bytes());
                }
                Ipv6Addr::from(bytes).into()
            }
            _ => return None,
        };
        Some(SocketAddr::new(ip, port))
    }
    let mut found = Vec::new();
    for &pid in pids {
        let inodes: std::collections::HashSet<String> = fs::read_dir(format!("/proc/{pid}/fd"))
            .into_iter()
            .flatten()
            .filter_map(|e| fs::read_link(e.ok()?.path()).ok())
            .filter_map(|l| {
                let l = l.to_string_lossy().into_owned();
                Some(l.strip_prefix("socket:[")?.strip_suffix(']')?.to_string())
            })
            .collect();
        for table in ["tcp", "tcp6"] {
            let text = fs::read_to_string(format!("/proc/{pid}/net/{table}")).unwrap_or_default();
            for line in text.lines().skip(1) {
                let fields: Vec<&str> = line.split_whitespace().collect();
                // sl local rem st tx:rx tr:when retrnsmt uid timeout inode
                if fields.len() > 9 && fields[3] == "0A" && inodes.contains(fields[9]) {
                    found.extend(parse(fields[1]));
                }
            }
        }
    }
    found.sort();
    found.dedup();
    found
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_kernels_addresses_are_read_as_printed() {
        // This test process listens on loopback, and is found doing so.
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let bound = listener.local_addr().unwrap();
        let found = listening_addresses(&[std::process::id()]);
        assert!(found.contains(&bound), "{bound} not in {found:?}");
        let v6 = std::net::TcpListener::bind("[::1]:0");
        if let Ok(v6) = v6 {
            let bound = v6.local_addr().unwrap();
            assert!(listening_addresses(&[std::process::id()]).contains(&bound));
        }
    }
    use std::collections::HashMap;
    use std::ffi::OsString;
    use std::panic::{catch_unwind, AssertUnwindSafe};

    fn lookup(vars: &[(&str, &str)]) -> Result<PathBuf, String> {
        let vars: HashMap<String, OsString> = vars
            .iter()
            .map(|(k, v)| (k.to_string(), OsString::from(v)))
            .collect();
        find_python(|name| vars.get(name).cloned())
    }

    #[test]
    fn python_comes_from_the_first_place_that_is_set() {
        let venv = scratch_dir("venv");
        fs::create_dir_all(venv.join("bin")).unwrap();
        fs::write(venv.join("bin/python"), "").unwrap();
        let v = venv.to_str().unwrap();
        // TCHD_PYTHON wins, by path or by name on PATH; a missing one is not replaced.
        assert_eq!(
            lookup(&[("TCHD_PYTHON", "/bin/sh"), ("VIRTUAL_ENV", v)]),
            Ok(PathBuf::from("/bin/sh"))
        );
        let bin = venv.join("bin");
        assert_eq!(
            lookup(&[("TCHD_PYTHON", "python"), ("PATH", bin.to_str().unwrap())]),
            Ok(bin.join("python"))
        );
        let err = lookup(&[("TCHD_PYTHON", "/nonexistent"), ("VIRTUAL_ENV", v)]).unwrap_err();
        assert!(
            err.contains("TCHD_PYTHON=/nonexistent does not exist"),
            "{err}"
        );
        // Empty is unset; then VIRTUAL_ENV, also when its python is missing.
        assert_eq!(
            lookup(&[("TCHD_PYTHON", ""), ("VIRTUAL_ENV", v)]),
            Ok(venv.join("bin/python"))
        );
        let err = lookup(&[("VIRTUAL_ENV", "/nonexistent-venv")]).unwrap_err();
        assert!(
            err.contains("VIRTUAL_ENV's /nonexistent-venv/bin/python does not exist"),
            "{err}"
        );
        // Then the project's .venv.
        let project = Path::new(env!("CARGO_MANIFEST_DIR"))
            .parent()
            .unwrap()
            .join(".venv/bin/python");
        match lookup(&[]) {
            Ok(python) => assert_eq!(python, project),
            Err(err) => assert!(err.contains(project.to_str().unwrap()), "{err}"),
        }
    }

    #[test]
    fn a_skip_is_logged_with_the_test_name_and_fails_under_ci() {
        let dir = scratch_dir("skip-log");
        let log = dir.join("skipped");
        let name =
            "tch_distributed_tests::tests::a_skip_is_logged_with_the_test_name_and_fails_under_ci";
        assert_eq!(
            record_skip("no PyTorch: reason one", false, Some(&log)),
            format!("{name}: no PyTorch: reason one")
        );
        record_skip("reason two", false, Some(&log));
        assert_eq!(
            fs::read_to_string(&log).unwrap(),
            format!("{name}: no PyTorch: reason one\n{name}: reason two\n")
        );
        let failed = catch_unwind(|| record_skip("reason three", true, Some(&log)));
        let message = *failed.unwrap_err().downcast::<String>().unwrap();
        assert!(
            message.contains("reason three") && message.contains("CI=true"),
            "{message}"
        );
        assert_eq!(fs::read_to_string(&log).unwrap().lines().count(), 2);
    }

    /// Whether `pid` runs (exists and is not a zombie).
    fn alive(pid: i32) -> bool {
        fs::read_to_string(format!("/proc/{pid}/stat")).is_ok_and(|stat| {
            stat.rsplit_once(')')
                .and_then(|(_, rest)| rest.split_whitespace().next())
                .is_some_and(|state| state != "Z")
        })
    }

    #[test]
    fn a_panic_while_a_job_runs_kills_its_process_group() {
        let dir = scratch_dir("panic-kills");
        let pid_file = dir.join("pid");
        let mut cmd = Command::new("sh");
        cmd.args(["-c", "sleep 600 & echo $! > \"$D/pid\"; wait"]);
        let failed = catch_unwind(AssertUnwindSafe(|| {
            run_with(cmd, &dir, Duration::from_secs(60), |_, _| {
                wait_until("the pid file", Duration::from_secs(30), || {
                    fs::read_to_string(&pid_file).is_ok_and(|t| t.ends_with('\n'))
                });
                panic!("a failed assertion while the job runs");
            })
        }));
        assert!(failed.is_err());
        let sleep: i32 = fs::read_to_string(&pid_file)
            .unwrap()
            .trim()
            .parse()
            .unwrap();
        wait_until(
            "the job's grandchild is killed",
            Duration::from_secs(10),
            || !alive(sleep),
        );
    }

    #[test]
    fn a_job_past_its_timeout_is_killed_and_fails_the_test() {
        let dir = scratch_dir("timeout");
        let mut cmd = Command::new("sh");
        cmd.args(["-c", "echo started; sleep 600"]);
        let start = Instant::now();
        let failed = catch_unwind(AssertUnwindSafe(|| {
            run_with(cmd, &dir, Duration::from_millis(500), |_, _| {})
        }));
        let message = *failed.unwrap_err().downcast::<String>().unwrap();
        assert!(message.contains("did not exit within 500ms"), "{message}");
        assert!(message.contains("started"), "{message}");
        assert!(start.elapsed() < Duration::from_secs(30));
        let mut cmd = Command::new("sleep");
        cmd.arg("600");
        let failed = catch_unwind(AssertUnwindSafe(|| {
            output_within(&mut cmd, b"", Duration::from_millis(500))
        }));
        assert!(failed.is_err());
        assert!(start.elapsed() < Duration::from_secs(30));
    }

    #[test]
    fn rank_prefixes_are_read_and_removed() {
        assert_eq!(rank_line("[rank 3] loss 0.5"), (Some(3), "loss 0.5"));
        assert_eq!(rank_line("[rank 12] "), (Some(12), ""));
        assert_eq!(rank_line("[rank x] y"), (None, "[rank x] y"));
        assert_eq!(rank_line("plain"), (None, "plain"));
        assert_eq!(
            without_rank_prefixes("[rank 0] a\n[rank 1] [rank 0] b\nc\n"),
            "a\n[rank 0] b\nc\n"
        );
    }

    #[test]
    fn output_within_passes_stdin_and_returns_the_output() {
        let mut cmd = Command::new("sh");
        cmd.args(["-c", "tr a-z A-Z; echo err >&2; exit 3"]);
        let out = output_within(&mut cmd, b"hello\n", Duration::from_secs(30));
        assert_eq!(out.status.code(), Some(3));
        assert_eq!(out.stdout, b"HELLO\n");
        assert_eq!(out.stderr, b"err\n");
    }

    #[test]
    fn processes_see_no_gpu_unless_they_ask_for_one() {
        let visible = |cmd: &mut Command| {
            pin_device(cmd);
            cmd.get_envs()
                .find(|(k, _)| *k == "CUDA_VISIBLE_DEVICES")
                .map(|(_, v)| v.map(|v| v.to_str().unwrap().to_string()))
        };
        let mut cpu = Command::new("true");
        cpu.env(TEST_DEVICE_VAR, "cpu");
        assert_eq!(visible(&mut cpu), Some(Some(String::new())));
        let mut removed = Command::new("true");
        removed
            .env(TEST_DEVICE_VAR, "cpu")
            .env_remove("CUDA_VISIBLE_DEVICES");
        assert_eq!(visible(&mut removed), Some(Some(String::new())));
        let mut cuda = Command::new("true");
        cuda.env(TEST_DEVICE_VAR, "cuda");
        assert_eq!(visible(&mut cuda), None);
        let mut chosen = Command::new("true");
        chosen
            .env(TEST_DEVICE_VAR, "cpu")
            .env("CUDA_VISIBLE_DEVICES", "3");
        assert_eq!(visible(&mut chosen), Some(Some("3".to_string())));
        // And the process gets it.
        let dir = scratch_dir("pinned");
        let mut cmd = Command::new("sh");
        cmd.args(["-c", "echo \"[${CUDA_VISIBLE_DEVICES-unset}]\""])
            .env(TEST_DEVICE_VAR, "cpu");
        let run = run_with(cmd, &dir, Duration::from_secs(30), |_, _| {});
        assert_eq!(run.stdout, "[]\n");
    }

    #[test]
    fn a_scratch_dir_is_removed_when_the_test_passes_and_kept_when_it_fails() {
        let passed = scratch_dir("passes");
        let path = passed.to_path_buf();
        fs::write(passed.join("file"), "x").unwrap();
        drop(passed);
        assert!(!path.exists());
        let mut kept = PathBuf::new();
        let failed = catch_unwind(AssertUnwindSafe(|| {
            let dir = scratch_dir("fails");
            kept = dir.to_path_buf();
            panic!("the test fails");
        }));
        assert!(failed.is_err());
        assert!(kept.is_dir(), "{} kept", kept.display());
        fs::remove_dir_all(&kept).unwrap();
    }
}

/// Writes the parity tests' MLP fixture: `DIR/data.safetensors` (`x`: `rows` × 8 from a
/// normal distribution, `y`: `rows` × 4, `sin(x[:, :4] · x[:, 4:] + 0.5)`) and
/// `DIR/init.safetensors` (l1: Linear(8, 32) and l2: Linear(32, 4), under the
/// VarStore's names, drawn as PyTorch's `nn.Linear` draws them: uniform in
/// ±1/√fan_in), from libtorch's generator seeded with `seed`.
pub fn write_mlp_fixture(dir: &Path, seed: i64, rows: i64) {
    tch::manual_seed(seed);
    let cpu = (tch::Kind::Float, tch::Device::Cpu);
    let x = tch::Tensor::randn([rows, 8], cpu);
    let y = (x.narrow(1, 0, 4) * x.narrow(1, 4, 4) + 0.5).sin();
    let uniform = |shape: &[i64], fan_in: f64| {
        let bound = 1.0 / fan_in.sqrt();
        tch::Tensor::rand(shape, cpu) * (2.0 * bound) - bound
    };
    let weights = [
        ("l1.weight", uniform(&[32, 8], 8.0)),
        ("l1.bias", uniform(&[32], 8.0)),
        ("l2.weight", uniform(&[4, 32], 32.0)),
        ("l2.bias", uniform(&[4], 32.0)),
    ];
    tch::Tensor::write_safetensors(&[("x", &x), ("y", &y)], dir.join("data.safetensors")).unwrap();
    tch::Tensor::write_safetensors(&weights, dir.join("init.safetensors")).unwrap();
}
