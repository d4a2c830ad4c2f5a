// Adds libtorch's lib directory (reported by tch-distributed's build script) to the
// rpath of this crate's binaries and tests, so they run here without LD_LIBRARY_PATH
// (elsewhere, e.g. a GPU machine that received `scripts/bench_gpu.sh --package`,
// LD_LIBRARY_PATH names that machine's torch/lib), and compiles csrc/cuda_memory.cpp:
// the CUDA caching allocator's statistics, which tch does not expose.
use std::path::PathBuf;

fn main() {
    println!("cargo:rerun-if-changed=csrc/cuda_memory.cpp");
    println!("cargo:rerun-if-env-changed=LIBTORCH_CXX11_ABI");
    let Ok(dir) = std::env::var("DEP_TCH_DISTRIBUTED_LIBTORCH_LIB") else {
        panic!("tch-distributed did not report its libtorch directory");
    };
    println!("cargo:rustc-link-arg=-Wl,-rpath,{dir}");
    let include = PathBuf::from(&dir)
        .parent()
        .expect("libtorch's lib directory has a parent")
        .join("include");
    // libtorch 2.11 (pip and the C++ distribution) is built with the C++11 ABI.
    let abi = std::env::var("LIBTORCH_CXX11_ABI").unwrap_or_else(|_| "1".into());
    cc::Build::new()
        .cpp(true)
        .pic(true)
        .warnings(false)
        .include(&include)
        .include(include.join("torch/csrc/api/include"))
        .flag("-std=c++17")
        .flag(format!("-D_GLIBCXX_USE_CXX11_ABI={abi}"))
        .flag("-DGLOG_USE_GLOG_EXPORT")
        .file("csrc/cuda_memory.cpp")
        .compile("tdcb_cuda_memory");
    println!("cargo:rustc-link-search=native={dir}");
}
