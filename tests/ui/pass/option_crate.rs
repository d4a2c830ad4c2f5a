// `crate = "…"`: the path of a renamed or re-exported tch-distributed.
mod reexport {
    pub use tch_distributed as tchd;
}

#[tch_distributed::distributed(crate = "reexport::tchd")]
fn train() -> usize {
    println!("printed by rank 0");
    reexport::tchd::current().unwrap().rank()
}

fn main() {
    assert_eq!(train(), 0);
}
