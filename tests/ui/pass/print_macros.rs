// `println!`, `print!`, `eprintln!`, `eprint!` run on rank 0 only, as statements and
// as expressions.
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

fn main() {
    assert_eq!(train(2), 2);
}
