#[tch_distributed::distributed]
struct Trainer;

fn main() {}
