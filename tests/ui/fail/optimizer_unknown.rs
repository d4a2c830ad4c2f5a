#[tch_distributed::distributed(optimizer = "apex")]
fn train() {}

fn main() {}
