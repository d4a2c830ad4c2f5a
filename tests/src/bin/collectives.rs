//! Worker: checks every collective on this rank and prints `ok <name>` per check.
//! Exits non-zero (with the failed assertion) on a wrong answer.

use tch::{Device, Kind, Tensor};
use tch_distributed::ReduceOp;

fn main() -> anyhow::Result<()> {
    tch::set_num_threads(1);
    let ctx = tch_distributed::init()?;
    let pg = ctx.process_group();
    let (r, n) = (ctx.rank() as i64, ctx.world_size() as i64);
    if std::env::args().nth(1).as_deref() == Some("--hang") {
        // Rank 0 waits in an all-reduce that the other ranks never reach.
        if r == 0 {
            let err = pg
                .all_reduce(
                    &mut Tensor::ones([4], (Kind::Float, Device::Cpu)),
                    ReduceOp::Sum,
                )
                .unwrap_err();
            println!("error: {err}");
            // anyhow's alternate form adds the error's sources: libtorch's own text.
            println!("alternate: {:#}", anyhow::Error::from(err));
            // Fail, so that the launcher stops the rank that never came.
            std::process::exit(3);
        } else {
            std::thread::sleep(std::time::Duration::from_secs(30));
        }
        return Ok(());
    }
    for kind in [Kind::Float, Kind::Double, Kind::Int64] {
        let opts = (kind, Device::Cpu);
        // rank r holds [r+1, 2(r+1), 3(r+1)]
        let mine = || Tensor::from_slice(&[1i64, 2, 3]).to_kind(kind) * (r + 1);
        let ranks: Vec<i64> = (1..=n).collect();
        let sum: i64 = ranks.iter().sum();
        let prod: i64 = ranks.iter().product();
        let base = Tensor::from_slice(&[1i64, 2, 3]).to_kind(kind);

        let mut t = mine();
        pg.all_reduce(&mut t, ReduceOp::Sum)?;
        check(&t, &(&base * sum), "all_reduce sum", kind);
        let mut t = mine();
        pg.all_reduce(&mut t, ReduceOp::Product)?;
        let expected = Tensor::from_slice(&[1i64, 2i64.pow(n as u32), 3i64.pow(n as u32)])
            .to_kind(kind)
            * prod;
        check(&t, &expected, "all_reduce product", kind);
        let mut t = mine();
        pg.all_reduce(&mut t, ReduceOp::Min)?;
        check(&t, &base, "all_reduce min", kind);
        let mut t = mine();
        pg.all_reduce(&mut t, ReduceOp::Max)?;
        check(&t, &(&base * n), "all_reduce max", kind);
        let mut t = mine();
        if kind == Kind::Int64 {
            let err = pg
                .all_reduce(&mut t, ReduceOp::Avg)
                .unwrap_err()
                .to_string();
            assert!(err.contains("floating-point"), "{err}");
            println!("ok all_reduce avg rejects {kind:?}");
        } else {
            pg.all_reduce(&mut t, ReduceOp::Avg)?;
            check(&t, &(&base * sum / n), "all_reduce avg", kind);
        }

        let mut t = if r == n - 1 {
            mine()
        } else {
            Tensor::zeros([3], opts)
        };
        pg.broadcast(&mut t, (n - 1) as usize)?;
        check(&t, &(&base * n), "broadcast", kind);

        let gathered = pg.all_gather(&mine())?;
        assert_eq!(gathered.len(), n as usize);
        for (i, g) in gathered.iter().enumerate() {
            check(g, &(&base * (i as i64 + 1)), "all_gather", kind);
        }

        // inputs[j] = (j+1) * (r+1) * base; rank j receives sum_r (j+1)(r+1) base
        let inputs: Vec<Tensor> = (0..n).map(|j| mine() * (j + 1)).collect();
        let out = pg.reduce_scatter(&inputs, ReduceOp::Sum)?;
        check(&out, &(&base * (sum * (r + 1))), "reduce_scatter sum", kind);
    }
    pg.barrier()?;
    println!("ok barrier");
    Ok(())
}

fn check(actual: &Tensor, expected: &Tensor, what: &str, kind: Kind) {
    assert_eq!(actual.kind(), kind, "{what}: dtype changed");
    let equal =
        actual
            .to_kind(Kind::Double)
            .allclose(&expected.to_kind(Kind::Double), 1e-12, 1e-12, false);
    assert!(
        equal,
        "{what} {kind:?}: got {actual:?}, expected {expected:?}"
    );
    println!("ok {what} {kind:?}");
}
