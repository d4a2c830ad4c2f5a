#[tch_distributed::distributed(world_size = 4)]
fn train() {}

fn main() {
    train();
}
