//! Checkpoints, resume and preemption: `resume DIR STEPS` trains to step `STEPS`,
//! resuming from the newest complete checkpoint under `DIR`, saving one every 5
//! steps and at the end, and on SIGTERM/SIGINT saving one at the end of the step and
//! exiting with 128 + the signal.

use tch::nn::{self, Module};
use tch::{Kind, Tensor};
use tch_distributed::{
    Checkpointer, DataLoader, DdpOptions, DistributedDataParallel, Optimizer, Preemption,
    TensorDataset, TrainState,
};

fn main() -> anyhow::Result<()> {
    let args: Vec<String> = std::env::args().collect();
    let (dir, last_step) = (&args[1], args[2].parse::<u64>()?);
    let ctx = tch_distributed::init()?;
    tch::manual_seed(0);
    let xs = Tensor::randn([200, 16], (Kind::Float, tch::Device::Cpu));
    let ys = xs.narrow(1, 0, 4).argmax(1, false);
    let loader = DataLoader::new(TensorDataset::new(&xs, &ys)?, 8)?.to_device(ctx.device());
    let mut vs = nn::VarStore::new(ctx.device());
    let net = nn::linear(vs.root(), 16, 4, Default::default());
    let ddp = DistributedDataParallel::new(&vs, ctx.process_group(), DdpOptions::default())?;
    let mut opt = Optimizer::new(&nn::Adam::default(), &vs, 1e-2)?.distributed(ddp);

    // ANCHOR: resume
    let checkpoints = Checkpointer::new(dir).keep_last(3);
    let preemption = Preemption::install()?;
    let mut step = 0;
    if let Some(state) = checkpoints.load_state(&mut vs, &mut opt)? {
        step = state.step;
        loader.resume(state.loader_position());
        if ctx.is_main_process() {
            println!("resumed at step {step}, epoch {}", state.epoch);
        }
    }
    // ANCHOR_END: resume

    // ANCHOR: loop
    'training: while step < last_step {
        for batch in &loader {
            let (x, y) = batch?;
            opt.backward_step(&net.forward(&x).cross_entropy_for_logits(&y))?;
            step += 1;
            let state = || {
                TrainState {
                    step,
                    config: serde_json::json!({ "lr": 1e-2 }),
                    ..Default::default()
                }
                .with_loader_position(loader.position())
            };
            if step % 5 == 0 || step == last_step {
                checkpoints.save_state(&vs, &mut opt, &state())?;
            }
            if let Some(signal) = preemption.requested()? {
                checkpoints.save_state(&vs, &mut opt, &state())?;
                std::process::exit(tch_distributed::preempted_exit_code(signal));
            }
            if step == last_step {
                break 'training;
            }
        }
    }
    // ANCHOR_END: loop
    if ctx.is_main_process() {
        let steps: Vec<u64> = checkpoints.list()?.iter().map(|(s, _)| *s).collect();
        println!("trained to step {step}; checkpoints at steps {steps:?}");
    }
    Ok(())
}
