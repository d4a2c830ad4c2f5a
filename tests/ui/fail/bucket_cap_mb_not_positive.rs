#[tch_distributed::distributed(bucket_cap_mb = 0)]
fn train() {}

fn main() {
    train();
}
