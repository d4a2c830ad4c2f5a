#[tch_distributed::distributed(timeout = 10, timeout = 20)]
fn train() {}

fn main() {
    train();
}
