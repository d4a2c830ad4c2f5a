#[tch_distributed::distributed]
extern "C" fn train() {}

fn main() {
    train();
}
