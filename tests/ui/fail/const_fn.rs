#[tch_distributed::distributed]
const fn train() {}

fn main() {
    train();
}
