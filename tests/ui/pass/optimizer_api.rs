// Every public method of tch's `nn::Optimizer`, called with tch's signatures on the
// optimizer that `.build` returns under the attribute (the SDK's, here with tch's own
// arithmetic: `optimizer = "tch"`), and on tch's own in a function without it: one
// process gives bit-identical parameters.
use tch::nn::{self, Module, OptimizerConfig};
use tch::{Device, Kind, Tensor};

#[tch_distributed::distributed(optimizer = "tch")]
fn distributed() -> anyhow::Result<Vec<Tensor>> {
    tch::manual_seed(7);
    let vs = nn::VarStore::new(Device::cuda_if_available());
    let body = nn::linear(vs.root() / "body", 3, 4, Default::default());
    // A second parameter group, as minGPT's no-weight-decay group.
    let head = nn::linear(vs.root().set_group(1) / "head", 4, 1, Default::default());
    let mut opt = nn::Sgd { momentum: 0.5, wd: 1e-2, ..Default::default() }.build(&vs, 0.1)?;
    let xs = Tensor::randn([8, 3], (Kind::Float, vs.device()));
    let loss = |xs: &Tensor| head.forward(&body.forward(xs).relu()).square().mean(Kind::Float);
    opt.set_lr(0.05);
    opt.set_lr_group(1, 0.02);
    opt.set_momentum(0.8);
    opt.set_momentum_group(1, 0.3);
    opt.set_weight_decay(1e-3);
    opt.set_weight_decay_group(1, 0.0);
    opt.backward_step(&loss(&xs));
    opt.backward_step_clip(&loss(&xs), 0.01);
    opt.backward_step_clip_norm(&loss(&xs), 0.05);
    opt.zero_grad();
    loss(&xs).backward();
    opt.clip_grad_value(0.02);
    opt.clip_grad_norm(0.03);
    opt.step();
    let variables: Vec<Tensor> = opt.trainable_variables();
    assert_eq!(variables.len(), 4);
    Ok(variables)
    }

// The same lines, with tch's optimizer.
fn plain() -> anyhow::Result<Vec<Tensor>> {
    tch::manual_seed(7);
    let vs = nn::VarStore::new(Device::cuda_if_available());
    let body = nn::linear(vs.root() / "body", 3, 4, Default::default());
    // A second parameter group, as minGPT's no-weight-decay group.
    let head = nn::linear(vs.root().set_group(1) / "head", 4, 1, Default::default());
    let mut opt = nn::Sgd { momentum: 0.5, wd: 1e-2, ..Default::default() }.build(&vs, 0.1)?;
    let xs = Tensor::randn([8, 3], (Kind::Float, vs.device()));
    let loss = |xs: &Tensor| head.forward(&body.forward(xs).relu()).square().mean(Kind::Float);
    opt.set_lr(0.05);
    opt.set_lr_group(1, 0.02);
    opt.set_momentum(0.8);
    opt.set_momentum_group(1, 0.3);
    opt.set_weight_decay(1e-3);
    opt.set_weight_decay_group(1, 0.0);
    opt.backward_step(&loss(&xs));
    opt.backward_step_clip(&loss(&xs), 0.01);
    opt.backward_step_clip_norm(&loss(&xs), 0.05);
    opt.zero_grad();
    loss(&xs).backward();
    opt.clip_grad_value(0.02);
    opt.clip_grad_norm(0.03);
    opt.step();
    let variables: Vec<Tensor> = opt.trainable_variables();
    assert_eq!(variables.len(), 4);
    Ok(variables)
    }

fn main() -> anyhow::Result<()> {
    let ours = distributed()?;
    let tchs = plain()?;
    assert_eq!(ours.len(), tchs.len(), "as many variables on both sides");
    for (a, b) in ours.iter().zip(&tchs) {
        assert!(a.equal(b), "the SDK's optimizer differs from tch's: {a} vs {b}");
    }
    Ok(())
}
