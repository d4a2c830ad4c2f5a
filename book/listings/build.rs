// Adds libtorch's lib directory (reported by tch-distributed's build script) to the
// rpath of this crate's binaries and tests, so they run without LD_LIBRARY_PATH.
fn main() {
    if let Ok(dir) = std::env::var("DEP_TCH_DISTRIBUTED_LIBTORCH_LIB") {
        println!("cargo:rustc-link-arg=-Wl,-rpath,{dir}");
    }
}
