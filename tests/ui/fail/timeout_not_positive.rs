#[tch_distributed::distributed(timeout = 0.0)]
fn train() {}

fn main() {
    train();
}
