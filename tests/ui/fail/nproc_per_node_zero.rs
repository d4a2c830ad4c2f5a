#[tch_distributed::distributed(nproc_per_node = 0)]
fn train() {}

fn main() {
    train();
}
