// 1. Adds libtorch's lib directory (reported by tch-distributed's build script) to the
//    rpath of this crate's binaries and tests.
// 2. For every program `src/bin/NAME.rs`, writes `$OUT_DIR/plain/NAME.rs`: the same
//    text without the line holding `#[tch_distributed::distributed…]`. That is the
//    plain single-GPU program; `src/plain/NAME.rs` includes it as the bin `NAME_plain`.
use std::fs;
use std::path::Path;

fn main() {
    if let Ok(dir) = std::env::var("DEP_TCH_DISTRIBUTED_LIBTORCH_LIB") {
        println!("cargo:rustc-link-arg=-Wl,-rpath,{dir}");
    }
    let out = Path::new(&std::env::var("OUT_DIR").unwrap()).join("plain");
    fs::create_dir_all(&out).unwrap();
    println!("cargo:rerun-if-changed=src/bin");
    for entry in fs::read_dir("src/bin").unwrap() {
        let path = entry.unwrap().path();
        if path.extension().is_none_or(|e| e != "rs") {
            continue;
        }
        println!("cargo:rerun-if-changed={}", path.display());
        let text = fs::read_to_string(&path).unwrap();
        let attribute: Vec<&str> = text
            .lines()
            .filter(|l| l.trim_start().starts_with("#[tch_distributed::distributed"))
            .collect();
        assert_eq!(
            attribute.len(),
            1,
            "{}: a corpus program has exactly one #[tch_distributed::distributed] line",
            path.display()
        );
        let plain: Vec<&str> = text.lines().filter(|l| *l != attribute[0]).collect();
        fs::write(out.join(path.file_name().unwrap()), plain.join("\n") + "\n").unwrap();
    }
}
