// `for` over anything that is not a tch data iterator is left alone, whatever it is
// called.
#[tch_distributed::distributed]
fn train() -> usize {
    let shuffle = vec![1, 2, 3];
    let mut total = 0;
    for x in shuffle.iter() {
        total += x;
    }
    for x in 0..4 {
        total += x;
    }
    for t in [tch::Tensor::from(1)] {
        total += t.int64_value(&[]) as usize;
    }
    total
}

fn main() {
    assert_eq!(train(), 13);
}
