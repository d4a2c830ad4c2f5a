#[tch_distributed::distributed(mixed_precision = "fp8")]
fn train() {}

fn main() {}
