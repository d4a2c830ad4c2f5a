#[tch_distributed::distributed(timeout = "30s")]
fn train() {}

fn main() {
    train();
}
