// `nproc_per_node = 1`: how many ranks the program starts when run with no launcher.
#[tch_distributed::distributed(nproc_per_node = 1)]
fn train() -> usize {
    tch_distributed::current().unwrap().world_size()
}

fn main() {
    assert_eq!(train(), 1);
}
