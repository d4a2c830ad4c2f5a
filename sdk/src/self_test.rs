//! `tchrun test`: a built-in check of the job's machinery, as `accelerate test`. Each
//! rank joins the job, checks every collective on the job's backend and device against
//! its closed-form result, a TCP store of its own (set, get, add, and keys written by
//! every rank), and one DDP step against the same step in one process; rank 0 prints
//! one line per check and a verdict.

use std::time::Duration;

use tch::nn::{self, Module};
use tch::{Device, Kind, Tensor};

use crate::ddp::{DdpOptions, DistributedDataParallel};
use crate::env::LaunchEnv;
use crate::error::Result;
use crate::init::{self, Context};
use crate::process_group::{ProcessGroup, ReduceOp};
use crate::rendezvous::store::Store;

/// One check's name and, when it failed, why.
type Outcome = (&'static str, std::result::Result<(), String>);

/// What a rank of `tchrun test` runs: joins the job, runs every check, and has rank 0
/// print the table and the verdict. Returns whether every check passed on every rank.
///
/// # Errors
/// When the job cannot be joined, or a collective fails outright (a rank died, or the
/// timeout passed): the checks cannot go on.
#[doc(hidden)]
pub fn rank_check() -> Result<bool> {
    tch::set_num_threads(1);
    let ctx = init::init()?;
    let group = ctx.process_group();
    let device = ctx.device();
    let mut outcomes: Vec<Outcome> = vec![
        ("all_reduce (sum, max, min, avg)", all_reduce(group, device)),
        ("broadcast", broadcast(group, device)),
        ("all_gather", all_gather(group, device)),
        ("reduce_scatter", reduce_scatter(group, device)),
        ("broadcast_coalesced", broadcast_coalesced(group, device)),
        ("barrier", group.barrier().map_err(|e| e.to_string())),
    ];
    outcomes.push(("TCP store", store(&ctx)));
    outcomes.push(("one DDP step against one process", ddp_step(&ctx)));
    // Every rank's failures, as one bit per check.
    let mask: i64 = outcomes
        .iter()
        .enumerate()
        .filter(|(_, (_, r))| r.is_err())
        .map(|(i, _)| 1 << i)
        .sum();
    let masks: Vec<i64> = group
        .all_gather(&Tensor::from_slice(&[mask]))?
        .iter()
        .map(|t| t.int64_value(&[0]))
        .collect();
    for (i, (name, result)) in outcomes.iter().enumerate() {
        if let Err(why) = result {
            crate::eprintln_whole!("tchrun test: rank {}: {name}: {why}", ctx.rank());
        }
        if ctx.is_main_process() {
            let failed: Vec<String> = (0..masks.len())
                .filter(|&r| masks[r] & (1 << i) != 0)
                .map(|r| r.to_string())
                .collect();
            match failed.is_empty() {
                true => println!("  ok      {name}"),
                false => println!("  FAILED  {name} (rank {})", failed.join(", ")),
            }
        }
    }
    let passed = masks.iter().all(|&m| m == 0);
    if ctx.is_main_process() {
        println!(
            "tchrun test: {} on {} rank(s), backend {}, devices {}",
            if passed { "passed" } else { "FAILED" },
            ctx.world_size(),
            ctx.backend(),
            crate::devices::device_name(device)
        );
    }
    group.barrier()?;
    Ok(passed)
}

/// `Err` naming what differs unless `got` equals `expected` exactly.
fn expect_equal(what: &str, got: &Tensor, expected: &Tensor) -> std::result::Result<(), String> {
    let got = got.to_device(Device::Cpu);
    if got.equal(expected) {
        Ok(())
    } else {
        Err(format!("{what}: got {got:?}, expected {expected:?}"))
    }
}

fn collective<T>(r: Result<T>) -> std::result::Result<T, String> {
    r.map_err(|e| e.to_string())
}

/// Rank `r` holds `[r + 1, 2 (r + 1)]` (floats).
fn own(rank: usize, device: Device) -> Tensor {
    let r = (rank + 1) as f32;
    Tensor::from_slice(&[r, 2.0 * r]).to_device(device)
}

fn all_reduce(group: &ProcessGroup, device: Device) -> std::result::Result<(), String> {
    let n = group.world_size() as f32;
    let sum = n * (n + 1.0) / 2.0;
    for (op, expected) in [
        (ReduceOp::Sum, [sum, 2.0 * sum]),
        (ReduceOp::Max, [n, 2.0 * n]),
        (ReduceOp::Min, [1.0, 2.0]),
        (ReduceOp::Avg, [sum / n, 2.0 * sum / n]),
    ] {
        let mut t = own(group.rank(), device);
        collective(group.all_reduce(&mut t, op))?;
        expect_equal(&format!("{op:?}"), &t, &Tensor::from_slice(&expected))?;
    }
    Ok(())
}

fn broadcast(group: &ProcessGroup, device: Device) -> std::result::Result<(), String> {
    let root = group.world_size() - 1;
    let mut t = own(group.rank(), device);
    collective(group.broadcast(&mut t, root))?;
    expect_equal("from the last rank", &t, &own(root, Device::Cpu))
}

fn all_gather(group: &ProcessGroup, device: Device) -> std::result::Result<(), String> {
    let parts = collective(group.all_gather(&own(group.rank(), device)))?;
    for (r, part) in parts.iter().enumerate() {
        expect_equal(&format!("rank {r}'s part"), part, &own(r, Device::Cpu))?;
    }
    Ok(())
}

/// Input `j` of rank `r` is `own(r) * (j + 1)`: rank `j` gets `sum_r own(r) * (j + 1)`.
fn reduce_scatter(group: &ProcessGroup, device: Device) -> std::result::Result<(), String> {
    let n = group.world_size();
    let inputs: Vec<Tensor> = (0..n)
        .map(|j| own(group.rank(), device) * (j + 1) as f64)
        .collect();
    let got = collective(group.reduce_scatter(&inputs, ReduceOp::Sum))?;
    let sum = (n * (n + 1) / 2) as f32 * (group.rank() + 1) as f32;
    expect_equal(
        "this rank's sum",
        &got,
        &Tensor::from_slice(&[sum, 2.0 * sum]),
    )
}

/// Three tensors of different shapes and dtypes from rank 0, in one small bucket.
fn broadcast_coalesced(group: &ProcessGroup, device: Device) -> std::result::Result<(), String> {
    let r = group.rank() as f64;
    let tensors = [
        own(group.rank(), device),
        (Tensor::ones([3, 2], (Kind::Float, device)) * r),
        (Tensor::ones([5], (Kind::Double, device)) * (r + 7.0)),
    ];
    collective(group.broadcast_coalesced(&tensors, 16, 0))?;
    expect_equal("the first", &tensors[0], &own(0, Device::Cpu))?;
    expect_equal(
        "the second",
        &tensors[1],
        &Tensor::zeros([3, 2], tch::kind::FLOAT_CPU),
    )?;
    expect_equal(
        "the third",
        &tensors[2],
        &(Tensor::ones([5], tch::kind::DOUBLE_CPU) * 7.0),
    )
}

/// A TCP store of its own: rank 0 hosts it on a free port (told to the others by a
/// broadcast), every rank writes a key, adds to a counter, and reads every rank's key.
fn store(ctx: &Context) -> std::result::Result<(), String> {
    let group = ctx.process_group();
    let timeout = Duration::from_secs(60);
    let host = LaunchEnv::from_env()
        .ok()
        .flatten()
        .map_or_else(|| "127.0.0.1".to_string(), |env| env.master_addr);
    let hosted = match ctx.rank() {
        0 => Some(collective(Store::tcp(
            &host,
            0,
            ctx.world_size(),
            true,
            timeout,
        ))?),
        _ => None,
    };
    let port = hosted.as_ref().and_then(Store::port).unwrap_or(0);
    let mut port_t = Tensor::from_slice(&[port as i64]);
    collective(group.broadcast(&mut port_t, 0))?;
    let port = port_t.int64_value(&[0]) as u16;
    let store = match hosted {
        Some(store) => store,
        None => collective(Store::tcp(&host, port, ctx.world_size(), false, timeout))?,
    };
    // The count first: a rank whose key is there has counted.
    collective(store.add("check/count", 1))?;
    let mine = format!("value of rank {}", ctx.rank());
    collective(store.set(&format!("check/{}", ctx.rank()), mine.as_bytes()))?;
    for r in 0..ctx.world_size() {
        let got = collective(store.get(&format!("check/{r}")))?;
        if got != format!("value of rank {r}").as_bytes() {
            return Err(format!(
                "rank {r}'s key reads {:?}",
                String::from_utf8_lossy(&got)
            ));
        }
    }
    // Every rank has counted, since every rank's key is there; the barrier keeps rank
    // 0's store up until every rank has read it.
    let count = collective(store.add("check/count", 0))?;
    collective(group.barrier())?;
    if count != ctx.world_size() as i64 {
        return Err(format!(
            "the counter reads {count}, expected {}",
            ctx.world_size()
        ));
    }
    Ok(())
}

/// One DDP backward pass of a two-layer model on this rank's rows of a global batch,
/// against the same model's gradient on the whole batch in this process (on the CPU):
/// DDP's average of the ranks' gradients is the whole batch's.
fn ddp_step(ctx: &Context) -> std::result::Result<(), String> {
    let (device, n) = (ctx.device(), ctx.world_size() as i64);
    // Built on the CPU and moved: the CUDA generator draws other initial weights than
    // the CPU's from the same seed.
    let model = |device: Device| {
        tch::manual_seed(1234);
        let mut vs = nn::VarStore::new(Device::Cpu);
        let net = nn::seq()
            .add(nn::linear(vs.root() / "l1", 8, 16, Default::default()))
            .add_fn(|x| x.tanh())
            .add(nn::linear(vs.root() / "l2", 16, 1, Default::default()));
        vs.set_device(device);
        (vs, net)
    };
    let rows = 4 * n;
    let x = Tensor::arange(rows * 8, tch::kind::FLOAT_CPU).view([rows, 8]) / (rows * 8) as f64;
    let y = x.sum_dim_intlist(1, true, Kind::Float).cos();
    let loss = |net: &nn::Sequential, x: &Tensor, y: &Tensor| {
        net.forward(x).mse_loss(y, tch::Reduction::Mean)
    };

    let (reference_vs, reference) = model(Device::Cpu);
    loss(&reference, &x, &y).backward();

    let (vs, net) = model(device);
    let ddp = collective(DistributedDataParallel::new(
        &vs,
        ctx.process_group(),
        DdpOptions::default(),
    ))?;
    let mine = |t: &Tensor| t.narrow(0, 4 * ctx.rank() as i64, 4).to_device(device);
    collective(ddp.backward(&loss(&net, &mine(&x), &mine(&y))))?;

    let expected: std::collections::BTreeMap<String, Tensor> =
        reference_vs.variables().into_iter().collect();
    for (name, var) in vs.variables() {
        let got = var.grad().to_device(Device::Cpu);
        let want = expected[&name].grad();
        let diff = (&got - &want).abs().max().double_value(&[]);
        let scale = want.abs().max().double_value(&[]).max(1e-12);
        if diff > 1e-5 * scale {
            return Err(format!(
                "the gradient of {name} differs from one process's by {diff:e} (of {scale:e})"
            ));
        }
    }
    Ok(())
}
