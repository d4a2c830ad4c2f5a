// `timeout = 60`: seconds a collective may wait before it fails.
// ANCHOR: train
#[tch_distributed::distributed(timeout = 60)]
fn train() -> String {
    tch_distributed::current().unwrap().banner()
}
// ANCHOR_END: train

fn main() {
    let banner = train();
    assert!(banner.contains("timeout 60 s"), "{banner}");
}
