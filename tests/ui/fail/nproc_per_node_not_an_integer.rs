#[tch_distributed::distributed(nproc_per_node = "4")]
fn train() {}

fn main() {
    train();
}
