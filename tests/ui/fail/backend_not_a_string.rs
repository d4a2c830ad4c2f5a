#[tch_distributed::distributed(backend = gloo)]
fn train() {}

fn main() {
    train();
}
