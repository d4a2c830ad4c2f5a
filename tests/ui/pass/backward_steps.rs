// `.build(&vs, lr)` wraps the model in DDP; every optimizer step form goes through it.
use tch::nn::{self, Module, OptimizerConfig};
use tch::{Device, Kind, Tensor};

// ANCHOR: train
#[tch_distributed::distributed]
fn train() -> anyhow::Result<Vec<Tensor>> {
    let vs = nn::VarStore::new(Device::cuda_if_available());
    let net = nn::linear(vs.root(), 3, 1, Default::default());
    let mut opt = nn::Adam::default().build(&vs, 1e-2)?;
    let xs = Tensor::ones([4, 3], (Kind::Float, vs.device()));
    let loss = |net: &nn::Linear| (net.forward(&xs) - 5.0).square().mean(Kind::Float);
    opt.backward_step(&loss(&net));
    opt.backward_step_clip(&loss(&net), 0.5);
    opt.backward_step_clip_norm(&loss(&net), 1.0);
    opt.zero_grad();
    loss(&net).backward();
    opt.step();
    Ok(vec![net.ws.detach(), net.bs.unwrap().detach()])
}
// ANCHOR_END: train

/// The same four steps in one process without the attribute and without any optimizer
/// object: autograd for the gradients; clipping as PyTorch's
/// `torch.nn.utils.clip_grad_value_` (clamp each element to ±0.5) and `clip_grad_norm_`
/// (scale by `1.0 / (norm + 1e-6)` when below 1); Adam's update as `torch.optim.Adam`
/// and libtorch's `torch::optim::Adam` compute it, with tch's defaults (betas 0.9 and
/// 0.999, eps 1e-8, no weight decay). Returns the parameters and, per step, whether
/// clipping changed the gradient.
fn reference() -> (Vec<Tensor>, Vec<bool>) {
    let vs = nn::VarStore::new(Device::Cpu);
    let net = nn::linear(vs.root(), 3, 1, Default::default());
    let xs = Tensor::ones([4, 3], (Kind::Float, Device::Cpu));
    let params = [
        net.ws.shallow_clone(),
        net.bs.as_ref().unwrap().shallow_clone(),
    ];
    let (lr, beta1, beta2, eps): (f64, f64, f64, f64) = (1e-2, 0.9, 0.999, 1e-8);
    let mut m: Vec<Tensor> = params.iter().map(Tensor::zeros_like).collect();
    let mut v: Vec<Tensor> = params.iter().map(Tensor::zeros_like).collect();
    let mut clipped = Vec::new();
    for (step, clip) in [(1, ""), (2, "value"), (3, "norm"), (4, "")] {
        for p in &params {
            let mut g = p.grad();
            if g.defined() {
                let _ = g.zero_();
            }
        }
        (net.forward(&xs) - 5.0)
            .square()
            .mean(Kind::Float)
            .backward();
        let mut grads: Vec<Tensor> = params.iter().map(|p| p.grad().copy()).collect();
        let before: Vec<Tensor> = grads.iter().map(Tensor::copy).collect();
        match clip {
            "value" => grads = grads.iter().map(|g| g.clamp(-0.5, 0.5)).collect(),
            "norm" => {
                let norms: Vec<Tensor> = grads.iter().map(|g| g.norm()).collect();
                let total = Tensor::stack(&norms, 0).norm().double_value(&[]);
                let coef = 1.0 / (total + 1e-6);
                if coef < 1.0 {
                    grads = grads.iter().map(|g| g * coef).collect();
                }
            }
            _ => {}
        }
        clipped.push(grads.iter().zip(&before).any(|(g, b)| !g.equal(b)));
        tch::no_grad(|| {
            let (bias1, bias2) = (1.0 - beta1.powi(step), 1.0 - beta2.powi(step));
            for (i, p) in params.iter().enumerate() {
                m[i] = &m[i] * beta1 + &grads[i] * (1.0 - beta1);
                v[i] = &v[i] * beta2 + &grads[i] * &grads[i] * (1.0 - beta2);
                let denom = &v[i].sqrt() / bias2.sqrt() + eps;
                p.shallow_clone().copy_(&(p - &m[i] / denom * (lr / bias1)));
            }
        });
    }
    let params = params.iter().map(|p| p.detach().copy()).collect();
    (params, clipped)
}

fn main() -> anyhow::Result<()> {
    tch::manual_seed(0);
    let trained = train()?;
    tch::manual_seed(0);
    let (expected, clipped) = reference();
    assert_eq!(clipped, [false, true, true, false], "both clips must act");
    let named = |ts: &[Tensor]| -> Vec<(String, Tensor)> {
        ["weight", "bias"]
            .iter()
            .zip(ts)
            .map(|(n, t)| (n.to_string(), t.to_device(Device::Cpu)))
            .collect()
    };
    let diff = tch_distributed_tests::compare::named(&named(&trained), &named(&expected));
    // f32 rounding of the same arithmetic, in another order here and there: measured
    // 1.9e-9 (one element's last bit).
    diff.assert_within(
        1e-7,
        "one process under #[distributed] against the written-out steps",
    );
    Ok(())
}
