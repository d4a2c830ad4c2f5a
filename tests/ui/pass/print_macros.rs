// `println!`, `print!`, `eprintln!`, `eprint!` run on rank 0 only, as statements and
// as expressions.
// ANCHOR: train
#[tch_distributed::distributed]
fn train(epochs: usize) -> usize {
    for epoch in 0..epochs {
        println!("epoch {epoch}");
        print!("...");
        eprintln!("to stderr");
        let () = eprint!("as an expression");
    }
    epochs
}
// ANCHOR_END: train

fn main() {
    assert_eq!(train(2), 2);
}
