#[tch_distributed::distributed(grad_accum = 0)]
fn train() {}

fn main() {}
