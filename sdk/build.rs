//! Compiles the C++ shim in `csrc/` against the libtorch that torch-sys found.
//!
//! libtorch is located exactly as torch-sys locates it (`LIBTORCH`, or
//! `LIBTORCH_USE_PYTORCH=1` with a Python that has torch 2.11.0 or 2.13.0); torch-sys
//! hands us its lib directory as `DEP_TCH_LIBTORCH_LIB`. libtorch's version, read off
//! its headers, becomes the cfg `tdc_libtorch = "2.11"` or `"2.13"` (see
//! `src/compat.rs`) and `TDC_LIBTORCH_VERSION`; any other version ends the build with
//! one line that says what to install. The NCCL backend is compiled when that
//! libtorch has CUDA and the CUDA runtime and NCCL headers are found (see
//! `cuda_include_dirs`). The lib directory is passed on to crates that depend on this
//! one as `DEP_TCH_DISTRIBUTED_LIBTORCH_LIB`, so they can add it to their rpath.

use std::env;
use std::path::{Path, PathBuf};
use std::process::Command;

/// Reads an environment variable and asks cargo to rerun when it changes.
fn env_var(name: &str) -> Option<String> {
    println!("cargo:rerun-if-env-changed={name}");
    env::var(name).ok().filter(|v| !v.is_empty())
}

fn python() -> String {
    if env::var_os("VIRTUAL_ENV").is_some() {
        "python"
    } else {
        "python3"
    }
    .to_string()
}

/// `_GLIBCXX_USE_CXX11_ABI` as the libtorch in use was built with.
fn cxx11_abi() -> String {
    if let Some(abi) = env_var("LIBTORCH_CXX11_ABI") {
        return abi;
    }
    if env_var("LIBTORCH_USE_PYTORCH").is_some() {
        let out = Command::new(python())
            .args([
                "-c",
                "import torch; print(int(torch._C._GLIBCXX_USE_CXX11_ABI))",
            ])
            .output();
        if let Ok(out) = out {
            let abi = String::from_utf8_lossy(&out.stdout).trim().to_string();
            if abi == "0" || abi == "1" {
                return abi;
            }
        }
        panic!(
            "could not ask python for torch._C._GLIBCXX_USE_CXX11_ABI; set LIBTORCH_CXX11_ABI=0|1"
        );
    }
    "1".to_string()
}

/// With `LIBTORCH_USE_PYTORCH`, stops the build when the Python on `PATH` now has
/// another torch than the one torch-sys built against (a new virtualenv activated over
/// an existing build): torch-sys does not look again, so the binary would silently keep
/// the old libtorch. Reruns when `VIRTUAL_ENV` changes (activating another
/// virtualenv).
fn check_same_libtorch(built: &Path) {
    if env_var("LIBTORCH_USE_PYTORCH").is_none() {
        return;
    }
    env_var("VIRTUAL_ENV");
    let Ok(out) = Command::new(python())
        .args([
            "-c",
            "import os, torch; print(os.path.join(os.path.dirname(torch.__file__), 'lib'))",
        ])
        .output()
    else {
        return;
    };
    let now = PathBuf::from(String::from_utf8_lossy(&out.stdout).trim());
    let same = |a: &Path, b: &Path| match (a.canonicalize(), b.canonicalize()) {
        (Ok(a), Ok(b)) => a == b,
        _ => true,
    };
    if out.status.success() && !same(&now, built) {
        fail(&format!(
            "this build links the libtorch in {}, but the Python on PATH now has the one in \
             {}: torch-sys does not look again by itself. Run `cargo clean -p torch-sys` \
             (then build again) to use the new one, or put the old virtualenv back on PATH",
            built.display(),
            now.display()
        ));
    }
}

/// Include directories holding `cuda_runtime.h`, `crt/host_config.h` and `nccl.h`.
/// `TCH_DISTRIBUTED_CUDA_INCLUDE` (colon-separated) wins; otherwise the pip packages
/// next to torch (`nvidia/cu13/include`, `nvidia/nccl/include`) and `$CUDA_HOME/include`.
/// `libtorch_minor` names, when headers are missing, the toolkit that torch wheel wants.
fn cuda_include_dirs(lib_dir: &Path, libtorch_minor: u32) -> Option<Vec<PathBuf>> {
    let mut candidates: Vec<PathBuf> = Vec::new();
    if let Some(dirs) = env_var("TCH_DISTRIBUTED_CUDA_INCLUDE") {
        candidates.extend(env::split_paths(&dirs));
    } else {
        if let Some(site) = lib_dir.parent().and_then(Path::parent) {
            for sub in [
                "nvidia/cu13/include",
                "nvidia/cuda_runtime/include",
                "nvidia/nccl/include",
            ] {
                candidates.push(site.join(sub));
            }
        }
        for var in ["CUDA_HOME", "CUDA_PATH"] {
            if let Some(home) = env_var(var) {
                candidates.push(PathBuf::from(home).join("include"));
            }
        }
        candidates.push(PathBuf::from("/usr/local/cuda/include"));
    }
    let has = |file: &str| candidates.iter().any(|d| d.join(file).exists());
    let needed = ["cuda_runtime.h", "crt/host_config.h", "nccl.h"];
    if needed.iter().all(|f| has(f)) {
        Some(candidates.into_iter().filter(|d| d.exists()).collect())
    } else {
        let missing: Vec<_> = needed.iter().filter(|f| !has(f)).collect();
        // The CUDA 13 headers of the toolkit each torch wheel was built with.
        let toolkit = if libtorch_minor >= 13 {
            "13.0.3"
        } else {
            "13.0.2"
        };
        println!(
            "cargo:warning=tch-distributed: NCCL backend not built: headers {missing:?} not found \
             (pip install 'cuda-toolkit[nvcc,cccl]=={toolkit}' next to torch, or set TCH_DISTRIBUTED_CUDA_INCLUDE)"
        );
        None
    }
}

/// libtorch's version (major, minor, patch), read off its headers
/// (`torch/headeronly/version.h`, `torch/version.h` before 2.11). Exits with one line
/// that names the version and the fix when it is not one this SDK supports.
fn libtorch_version(include: &Path) -> (u32, u32, u32) {
    let text = ["torch/headeronly/version.h", "torch/version.h"]
        .iter()
        .find_map(|h| std::fs::read_to_string(include.join(h)).ok())
        .unwrap_or_default();
    let define = |name: &str| -> Option<u32> {
        text.lines()
            .find_map(|l| l.trim().strip_prefix("#define ")?.strip_prefix(name))
            .and_then(|v| v.trim().parse().ok())
    };
    let version = (
        define("TORCH_VERSION_MAJOR "),
        define("TORCH_VERSION_MINOR "),
        define("TORCH_VERSION_PATCH "),
    );
    match version {
        (Some(2), Some(minor @ (11 | 13)), Some(patch)) => (2, minor, patch),
        (Some(major), Some(minor), Some(patch)) => fail(&format!(
            "libtorch {major}.{minor}.{patch} found in {}: tch-distributed supports libtorch 2.11 \
             (tch 0.24) and 2.13 (tch 0.26): pip install torch==2.13.0 (or 2.11.0), or point \
             LIBTORCH at one of those",
            include.display()
        )),
        _ => fail(&format!(
            "no libtorch version in {}/torch/headeronly/version.h: is {} a libtorch? Set \
             LIBTORCH to an unpacked libtorch 2.11 or 2.13, or LIBTORCH_USE_PYTORCH=1 with \
             torch 2.11.0 or 2.13.0 installed",
            include.display(),
            include.parent().unwrap_or(include).display()
        )),
    }
}

/// Ends the build with `error: tch-distributed: {message}` on one line.
fn fail(message: &str) -> ! {
    eprintln!("error: tch-distributed: {message}");
    std::process::exit(1)
}

fn main() {
    println!("cargo:rustc-check-cfg=cfg(tdc_libtorch, values(\"2.11\", \"2.13\"))");
    println!("cargo:rustc-check-cfg=cfg(tdc_nccl)");
    // The compiler's version, for `tchrun env`'s report.
    let rustc = env::var("RUSTC").unwrap_or_else(|_| "rustc".into());
    let rustc_version = Command::new(rustc)
        .arg("--version")
        .output()
        .ok()
        .map(|out| String::from_utf8_lossy(&out.stdout).trim().to_string())
        .unwrap_or_default();
    println!("cargo:rustc-env=TDC_RUSTC_VERSION={rustc_version}");
    // Documentation only (docs.rs, `--features doc-only`): no libtorch, no shim; the
    // docs describe the tch 0.24 / libtorch 2.11 pair. Nothing built this way links.
    if env::var_os("CARGO_FEATURE_DOC_ONLY").is_some() {
        println!("cargo:rustc-cfg=tdc_libtorch=\"2.11\"");
        println!("cargo:rustc-env=TDC_LIBTORCH_VERSION=2.11.0");
        return;
    }
    let lib_dir = PathBuf::from(env::var("DEP_TCH_LIBTORCH_LIB").expect(
        "torch-sys did not report its libtorch directory; set LIBTORCH, or LIBTORCH_USE_PYTORCH=1 \
         with the project's .venv first on PATH",
    ));
    let torch_root = lib_dir
        .parent()
        .expect("libtorch lib dir has a parent")
        .to_path_buf();
    let include = torch_root.join("include");
    check_same_libtorch(&lib_dir);
    let version = libtorch_version(&include);
    println!(
        "cargo:rustc-cfg=tdc_libtorch=\"{}.{}\"",
        version.0, version.1
    );
    println!(
        "cargo:rustc-env=TDC_LIBTORCH_VERSION={}.{}.{}",
        version.0, version.1, version.2
    );
    let abi = cxx11_abi();

    // Real Gloo headers when this libtorch ships them, else declaration-only stand-ins.
    let gloo_include = if include.join("gloo/context.h").exists() {
        include.clone()
    } else {
        PathBuf::from("csrc/gloo_stubs")
    };

    let mut build = cc::Build::new();
    build
        .cpp(true)
        .pic(true)
        .warnings(false)
        .include(&include)
        .include(include.join("torch/csrc/api/include"))
        .include(&gloo_include)
        .flag("-std=c++17")
        .flag(format!("-D_GLIBCXX_USE_CXX11_ABI={abi}"))
        .flag("-DGLOG_USE_GLOG_EXPORT")
        .flag("-DUSE_C10D_GLOO")
        .file("csrc/shim.cpp")
        .file("csrc/sealed_store.cpp")
        .file("csrc/optim.cpp")
        .file("csrc/sharding.cpp")
        .file("csrc/activation.cpp")
        .file("csrc/nccl.cpp");

    let has_cuda = lib_dir.join("libtorch_cuda.so").exists();
    let nccl = if has_cuda {
        cuda_include_dirs(&lib_dir, version.1)
    } else {
        None
    };
    if let Some(dirs) = &nccl {
        build
            .includes(dirs)
            .define("TDC_WITH_NCCL", None)
            .define("USE_C10D_NCCL", None)
            .define("USE_CUDA", None);
        println!("cargo:rustc-cfg=tdc_nccl");
        println!("cargo:rustc-link-lib=torch_cuda");
        println!("cargo:rustc-link-lib=c10_cuda");
    } else if !has_cuda {
        println!("cargo:warning=tch-distributed: libtorch has no CUDA; building Gloo (CPU) only");
    }
    build.compile("tdc_shim");

    println!("cargo:rustc-link-search=native={}", lib_dir.display());
    // Our own binaries (tchrun, unit tests) find libtorch without LD_LIBRARY_PATH;
    // dependents get the directory through the `links` metadata.
    println!("cargo:rustc-link-arg=-Wl,-rpath,{}", lib_dir.display());
    println!("cargo:libtorch_lib={}", lib_dir.display());
    for f in [
        "shim.cpp",
        "sealed_store.cpp",
        "optim.cpp",
        "sharding.cpp",
        "activation.cpp",
        "shim.h",
        "internal.hpp",
        "nccl.cpp",
    ] {
        println!("cargo:rerun-if-changed=csrc/{f}");
    }
    println!("cargo:rerun-if-changed=csrc/gloo_stubs");
}
