//! Harness for the integration tests: runs real multi-process jobs with a timeout,
//! and kills the whole process tree when one hangs, so a hang fails fast.

use std::fs;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Command, ExitStatus, Stdio};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::thread;
use std::time::{Duration, Instant};

pub mod compare;

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

/// The virtualenv whose torch gave this build its libtorch: `VIRTUAL_ENV`, which
/// `scripts/env.sh` sets (`.venv` for torch 2.11, `.venv-2.13` for torch 2.13), else
/// the project's `.venv` when it exists; `None` when libtorch came from `LIBTORCH`.
pub fn venv() -> Option<PathBuf> {
    std::env::var_os("VIRTUAL_ENV")
        .map(PathBuf::from)
        .or_else(|| Some(Path::new(env!("CARGO_MANIFEST_DIR")).join("../.venv")))
        .filter(|venv| venv.join("bin/python").exists())
}

/// The venv's `torchrun`, when there is a venv.
pub fn torchrun() -> Option<PathBuf> {
    venv()
        .map(|venv| venv.join("bin/torchrun"))
        .filter(|path| path.exists())
}

/// Runs `script` with the project venv's python (`python -c script args…`, `stdin`
/// on its standard input) and returns its standard output; `None`, saying so on
/// stderr, when there is no venv (libtorch from `LIBTORCH`), so that comparisons with
/// PyTorch run wherever PyTorch is installed. Panics with python's stderr when the
/// script fails.
pub fn venv_python(script: &str, args: &[&str], stdin: &str) -> Option<String> {
    let Some(python) = venv().map(|venv| venv.join("bin/python")) else {
        eprintln!("no venv python: comparison with PyTorch skipped");
        return None;
    };
    let mut child = Command::new(&python)
        .arg("-c")
        .arg(script)
        .args(args)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap_or_else(|e| panic!("cannot start {}: {e}", python.display()));
    std::io::Write::write_all(&mut child.stdin.take().unwrap(), stdin.as_bytes()).unwrap();
    let out = child.wait_with_output().unwrap();
    assert!(
        out.status.success(),
        "python failed:\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    Some(String::from_utf8(out.stdout).unwrap())
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
    ] {
        cmd.env_remove(var);
    }
    cmd
}

/// A fresh, empty scratch directory for one test.
pub fn scratch_dir(name: &str) -> PathBuf {
    static COUNTER: AtomicUsize = AtomicUsize::new(0);
    let dir = std::env::temp_dir().join(format!(
        "tchd-test-{}-{}-{name}",
        std::process::id(),
        COUNTER.fetch_add(1, Ordering::Relaxed)
    ));
    let _ = fs::remove_dir_all(&dir);
    fs::create_dir_all(&dir).unwrap();
    dir
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
}

/// Runs `cmd` in its own process group with `D=dir` in its environment and
/// `OMP_NUM_THREADS=1`, calls `while_running(pid, dir)` once it has started, and
/// kills the whole group if it runs longer than `timeout` (then panics with its
/// output). Output goes to files in `dir`, so stray grandchildren cannot block the
/// test on a pipe.
pub fn run_with(
    mut cmd: Command,
    dir: &Path,
    timeout: Duration,
    while_running: impl FnOnce(u32, &Path),
) -> Run {
    let out_path = dir.join("run.stdout");
    let err_path = dir.join("run.stderr");
    let start = Instant::now();
    let mut child = cmd
        .env("D", dir)
        .env("OMP_NUM_THREADS", "1")
        .stdin(Stdio::null())
        .stdout(fs::File::create(&out_path).unwrap())
        .stderr(fs::File::create(&err_path).unwrap())
        .process_group(0)
        .spawn()
        .unwrap_or_else(|e| panic!("cannot start {cmd:?}: {e}"));
    let pid = child.id();
    while_running(pid, dir);
    let status = loop {
        if let Some(status) = child.try_wait().unwrap() {
            break status;
        }
        if start.elapsed() > timeout {
            unsafe { libc::kill(-(pid as i32), libc::SIGKILL) };
            child.wait().unwrap();
            panic!(
                "{cmd:?} did not exit within {timeout:?}\nstdout:\n{}\nstderr:\n{}",
                fs::read_to_string(&out_path).unwrap_or_default(),
                fs::read_to_string(&err_path).unwrap_or_default()
            );
        }
        thread::sleep(Duration::from_millis(20));
    };
    // Reap anything the run left behind in its group.
    unsafe { libc::kill(-(pid as i32), libc::SIGKILL) };
    Run {
        status,
        stdout: fs::read_to_string(&out_path).unwrap(),
        stderr: fs::read_to_string(&err_path).unwrap(),
        elapsed: start.elapsed(),
    }
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

/// The Python to compare with: the project venv's when it exists, else `python3` on
/// `PATH` (the GPU machine, which has PyTorch but no checkout's venv).
pub fn python() -> PathBuf {
    venv()
        .map(|venv| venv.join("bin/python"))
        .unwrap_or_else(|| PathBuf::from("python3"))
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
