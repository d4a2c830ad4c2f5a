#[tch_distributed::distributed(find_unused_parameters)]
fn train() {}

fn main() {
    train();
}
