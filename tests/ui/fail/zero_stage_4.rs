#[tch_distributed::distributed(zero = 4)]
fn train() {}

fn main() {}
