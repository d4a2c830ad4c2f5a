//! Worker for `split_between_processes`: `inference_worker OUT_DIR`, on one process (the
//! reference) or several. Each rank writes `OUT_DIR/rank{r}.json`: the items it was
//! given and the gathered results of each case.
//!
//! - `strings`: 10 strings, each mapped to `(item, its length)` (JSON through Gloo);
//! - `padded`: the same with padding, given as a slice (`&[T]`, the others a `&Vec`);
//!   each item runs one all-reduce in the closure, as a
//!   forward pass through a ZeRO-3 model would, so a rank given fewer items would hang;
//! - `tensor`: 10 rows through a `Linear(4, 3)` (the same seed on every rank), gathered
//!   as one `[10, 3]` tensor;
//! - `wrong_count`: rank 1's closure returns one result too few: every rank must get
//!   the same error;
//! - `wrong_layout`: rank 1's rows have 2 columns, the others' 3: every rank must get
//!   the error naming rank 1.

use serde_json::json;
use tch::nn::{self, Module};
use tch::{Device, Kind, Tensor};

fn main() -> anyhow::Result<()> {
    let out = std::env::args()
        .nth(1)
        .expect("usage: inference_worker OUT_DIR");
    tch::set_num_threads(1);
    let ctx = tch_distributed::init()?;
    let rank = ctx.rank();
    let items: Vec<String> = (0..10).map(|i| format!("item-{}", "x".repeat(i))).collect();

    let mut given = Vec::new();
    let strings: Vec<(String, usize)> = tch_distributed::split_between_processes(&items, |mine| {
        given = mine.clone();
        mine.into_iter()
            .map(|s| {
                let n = s.len();
                (s, n)
            })
            .collect()
    })?;

    let mut given_padded = Vec::new();
    let padded: Vec<(String, usize)> =
        tch_distributed::split_between_processes_padded(items.as_slice(), |mine| {
            given_padded = mine.clone();
            mine.into_iter()
                .map(|s| {
                    // One collective per item: equally many on every rank.
                    tch_distributed::any_rank(false).unwrap();
                    let n = s.len();
                    (s, n)
                })
                .collect()
        })?;

    tch::manual_seed(0);
    let vs = nn::VarStore::new(Device::Cpu);
    let linear = nn::linear(vs.root(), 4, 3, Default::default());
    let inputs = Tensor::arange(40, (Kind::Float, Device::Cpu)).view([10, 4]) / 40.0;
    let outputs = tch::no_grad(|| {
        tch_distributed::split_between_processes(&inputs, |rows| linear.forward(&rows))
    })?;

    let wrong_layout = tch::no_grad(|| {
        tch_distributed::split_between_processes(&inputs, |rows| {
            let out = linear.forward(&rows);
            match rank {
                1 => out.narrow(1, 0, 2),
                _ => out,
            }
        })
    });
    let wrong_layout = match wrong_layout {
        Ok(t) => format!("no error: {t:?}"),
        Err(e) => e.to_string(),
    };

    let wrong = tch_distributed::split_between_processes(&items, |mine| {
        let keep = if rank == 1 {
            mine.len() - 1
        } else {
            mine.len()
        };
        mine[..keep].to_vec()
    });
    let wrong_count = match wrong {
        Ok(v) => format!("no error: {v:?}"),
        Err(e) => e.to_string(),
    };

    let record = json!({
        "given": given,
        "given_padded": given_padded,
        "strings": strings,
        "padded": padded,
        "tensor": Vec::<f32>::try_from(outputs.view([-1]))?,
        "tensor_shape": outputs.size(),
        "wrong_count": wrong_count,
        "wrong_layout": wrong_layout,
    });
    std::fs::write(format!("{out}/rank{rank}.json"), record.to_string())?;
    Ok(())
}
