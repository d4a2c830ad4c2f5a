#[tch_distributed::distributed(crate = "not a path")]
fn train() {}

fn main() {
    train();
}
