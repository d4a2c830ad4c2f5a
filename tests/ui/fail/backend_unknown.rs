#[tch_distributed::distributed(backend = "mpi")]
fn train() {}

fn main() {
    train();
}
