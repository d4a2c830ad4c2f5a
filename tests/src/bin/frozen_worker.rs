//! Worker of `tests/tests/frozen.rs`: a LoRA-style program, as PEFT fine-tunes under
//! DeepSpeed or FSDP. Three layers (`layers.0`: 10 → 12, tanh, `layers.1`: 12 → 9,
//! tanh, `layers.2`: 9 → 4), each a base linear (`layers.N.base.weight`,
//! `layers.N.base.bias`) whose variables are frozen after the model is built
//! (`set_requires_grad(false)`), plus a low-rank adapter (`lora_a`: rank 2 × in,
//! random; `lora_b`: out × 2, zeros; added as `x · aᵀ · bᵀ · 2`). Adam (lr 0.01) for 8
//! steps on 24 samples, each rank on its own share of them, so that the averaged
//! gradient is the whole batch's. Run with `TCH_DISTRIBUTED_ZERO=1|2|3` to shard it;
//! with `UNITS=1` each layer is a unit of its own (`fully_shard`).
//!
//! With `READ=1`, after every step it reads every variable directly, which gives the
//! value or (a stage-3 unit's variable, resharded) an error that names it, and inside
//! `summon_full_params`, which gives every value; rank `r` writes the sum of each
//! variable read there, step by step, to DIR/OUT.sums-r (a line a step). At stage 3
//! it also converts the model to f64 inside `summon_full_params` before the optimizer
//! is built, which must be an error that leaves every variable f32.
//!
//! With `CHECKPOINT=1` every layer is also an activation-checkpointed block
//! (`checkpointed`), its unit gathered again for the recompute in the backward pass.
//!
//! Prints how many variables are sharded once the model is built (all 12 of them at
//! stage 3 with units: they were sharded as they were built).
//!
//! Writes: with `INIT_OUT=1`, rank 0 the initial variables to DIR/OUT.init.safetensors;
//! rank 0 the model (`vs.save`) to DIR/OUT and its trainable variables
//! (`save_trainable`) to DIR/OUT.adapter.safetensors; and, after the
//! `#[distributed]` function has returned, every rank the variables as it holds them
//! to DIR/OUT.after-RANK.safetensors.
//!
//! With `TCHD_TEST_DEVICE=cuda` it trains on the rank's CUDA device, and writes it to
//! DIR/OUT.device-RANK.
//!
//! Usage: frozen_worker DIR OUT
use tch::nn::{self, Module, OptimizerConfig};
use tch::{Device, Kind, Tensor};

const RANK: i64 = 2;
const SCALE: f64 = 2.0;

/// A linear layer with a low-rank adapter beside it.
#[derive(Debug)]
struct Lora {
    base: nn::Linear,
    a: Tensor,
    b: Tensor,
}

impl Lora {
    fn new(p: &nn::Path, inputs: i64, outputs: i64) -> Lora {
        Lora {
            base: nn::linear(p / "base", inputs, outputs, Default::default()),
            a: p.randn("lora_a", &[RANK, inputs], 0.0, 0.3),
            b: p.zeros("lora_b", &[outputs, RANK]),
        }
    }
}

impl Module for Lora {
    fn forward(&self, xs: &Tensor) -> Tensor {
        xs.apply(&self.base) + xs.matmul(&self.a.tr()).matmul(&self.b.tr()) * SCALE
    }
}

#[tch_distributed::distributed]
fn train(dir: &str, out: &str) -> anyhow::Result<nn::VarStore> {
    let env = |k: &str| std::env::var(k).ok();
    let (rank, world) = tch_distributed::current().map_or((0, 1), |c| (c.rank(), c.world_size()));
    tch::manual_seed(0);
    let xs = Tensor::randn([24, 10], (Kind::Float, Device::Cpu));
    let ys = xs.narrow(1, 0, 4).sin() + xs.narrow(1, 4, 4).cos();
    let share = 24 / world as i64;
    // The rank's GPU under the GPU suite (TCHD_TEST_DEVICE=cuda), else the CPU.
    let device = tch_distributed_tests::test_device(Device::cuda_if_available());
    let (x, y) = (
        xs.narrow(0, rank as i64 * share, share).to_device(device),
        ys.narrow(0, rank as i64 * share, share).to_device(device),
    );

    let mut vs = nn::VarStore::new(device);
    let root = vs.root();
    let units = env("UNITS").is_some();
    let checkpointed = env("CHECKPOINT").is_some();
    let layers: Vec<Box<dyn Module>> = [(10, 12), (12, 9), (9, 4)]
        .into_iter()
        .enumerate()
        .map(|(i, (inputs, outputs))| {
            let path = &root / "layers" / i;
            let layer = Lora::new(&path, inputs, outputs);
            let layer = match units {
                true => tch_distributed::fully_shard(layer, &path),
                false => tch_distributed::fully_shard(layer, &(&root / "unclaimed")),
            };
            match checkpointed {
                true => Box::new(tch_distributed::checkpointed(layer)) as Box<dyn Module>,
                false => Box::new(layer),
            }
        })
        .collect();
    // At stage 3 the units are sharded as they are built (their variables read as an
    // error until gathered): no rank holds the whole model.
    let sharded = vs
        .variables()
        .values()
        .filter(|t| t.f_sum(Kind::Double).is_err())
        .count();
    println!("variables sharded as built: {sharded}");
    // The base is frozen once built, as a LoRA program loads and freezes its base.
    for (name, var) in vs.variables() {
        if name.contains(".base.") {
            let _ = var.set_requires_grad(false);
        }
    }
    // (At stage 3 the units are sharded already: read whole inside `summon_full_params`.)
    if env("INIT_OUT").is_some() {
        tch_distributed::summon_full_params(false, || -> anyhow::Result<()> {
            if rank == 0 {
                let named: Vec<(String, Tensor)> = vs.variables().into_iter().collect();
                Tensor::write_safetensors(&named, format!("{dir}/{out}.init.safetensors"))?;
            }
            Ok(())
        })??;
    }
    let read = env("READ").is_some();
    // A conversion of the sharded model (as a program converts its model once built)
    // is an error that leaves every variable as it was.
    if read && env("TCH_DISTRIBUTED_ZERO").as_deref() == Some("3") {
        let converted = tch_distributed::summon_full_params(true, || vs.double());
        let e = converted
            .expect_err("a conversion of sharded variables")
            .to_string();
        anyhow::ensure!(e.contains("was converted to Double"), "{e}");
        let kinds = tch_distributed::summon_full_params(false, || {
            vs.variables()
                .values()
                .map(Tensor::kind)
                .collect::<Vec<_>>()
        })?;
        anyhow::ensure!(kinds.iter().all(|&k| k == Kind::Float), "{kinds:?}");
    }
    let mut opt = nn::Adam::default().build(&vs, 0.01)?;
    let mut sums = String::new();
    for _ in 0..8 {
        // One `let` for the forward pass and the loss: under mixed precision it runs
        // under autocast (the closure too).
        let loss = layers
            .iter()
            .enumerate()
            .fold(x.shallow_clone(), |h, (i, layer)| {
                match i + 1 < layers.len() {
                    true => layer.forward(&h).tanh(),
                    false => layer.forward(&h),
                }
            })
            .mse_loss(&y, tch::Reduction::Mean);
        opt.backward_step(&loss);
        if read {
            for (name, var) in vs.variables() {
                // A read and a write (a copy of itself): the value, or the error.
                let read = var.f_sum(Kind::Double).map(drop);
                let written = tch::no_grad(|| var.shallow_clone().f_copy_(&var));
                for e in [read.err(), written.err()].into_iter().flatten() {
                    let e = e.to_string();
                    anyhow::ensure!(
                        e.contains(&format!("variable `{name}` is sharded by ZeRO stage 3")),
                        "reading {name}: {e}"
                    );
                }
            }
            let mut line = tch_distributed::summon_full_params(false, || {
                let mut named: Vec<(String, Tensor)> = vs.variables().into_iter().collect();
                named.sort_by(|a, b| a.0.cmp(&b.0));
                named
                    .iter()
                    .map(|(name, t)| format!("{name}={:e}", t.sum(Kind::Double).double_value(&[])))
                    .collect::<Vec<_>>()
                    .join(" ")
            })?;
            line.push('\n');
            sums += &line;
        }
    }
    if read {
        std::fs::write(format!("{dir}/{out}.sums-{rank}"), &sums)?;
    }
    if tch_distributed_tests::cuda_requested() {
        std::fs::write(format!("{dir}/{out}.device-{rank}"), format!("{device:?}"))?;
    }
    vs.save(format!("{dir}/{out}"))?;
    tch_distributed::save_trainable(&vs, format!("{dir}/{out}.adapter.safetensors"))?;
    Ok(vs)
}

fn main() -> anyhow::Result<()> {
    tch::set_num_threads(1);
    let args: Vec<String> = std::env::args().collect();
    let (dir, out) = (&args[1], &args[2]);
    let vs = train(dir, out)?;
    // The function has returned: the model is whole on every rank.
    let rank = std::env::var("RANK").unwrap_or_else(|_| "0".into());
    let named: Vec<(String, Tensor)> = vs.variables().into_iter().collect();
    Tensor::write_safetensors(&named, format!("{dir}/{out}.after-{rank}.safetensors"))?;
    Ok(())
}
