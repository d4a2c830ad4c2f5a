#[tch_distributed::distributed]
async fn train() {}

fn main() {
    let _ = train();
}
