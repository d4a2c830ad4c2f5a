#[tch_distributed::distributed(find_unused_parameters = 1)]
fn train() {}

fn main() {
    train();
}
