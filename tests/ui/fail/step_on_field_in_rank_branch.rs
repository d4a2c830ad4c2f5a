use tch::nn::{self, Module, OptimizerConfig};
use tch::{Device, Kind, Tensor};

// A trainer struct: `self.opt` is an optimizer, which only the rewrite's probe can
// tell from its type, so a `step()` on a field inside a rank branch is refused.
struct Trainer {
    net: nn::Linear,
    opt: nn::Optimizer,
}

impl Trainer {
    #[tch_distributed::distributed]
    fn fit(&mut self) -> anyhow::Result<()> {
        let ctx = tch_distributed::current().unwrap();
        let x = Tensor::ones([1, 2], (Kind::Float, Device::Cpu));
        let loss = self.net.forward(&x).sum(Kind::Float);
        self.opt.zero_grad();
        loss.backward();
        if ctx.rank() == 0 {
            self.opt.step();
        }
        Ok(())
    }
}

fn main() -> anyhow::Result<()> {
    let vs = nn::VarStore::new(Device::Cpu);
    let net = nn::linear(vs.root(), 2, 1, Default::default());
    let opt = nn::Sgd::default().build(&vs, 0.1)?;
    Trainer { net, opt }.fit()
}
