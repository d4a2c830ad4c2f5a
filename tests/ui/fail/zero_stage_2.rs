#[tch_distributed::distributed(zero = 2)]
fn train() {}

fn main() {}
