// `.build(a, b)` is decided by the receiver's type: on one of tch's optimizer
// configurations it makes the SDK's optimizer (tch's methods, `Result`s unwrapped where
// tch has none); on a configuration of the program's own (which implements tch's
// `OptimizerConfig`) it makes tch's optimizer, stepped as written (and averaged as an
// optimizer the function did not build); on any other type it runs as written. The
// receiver and the arguments are evaluated once.
use tch::nn::{self, Module, OptimizerConfig};
use tch::{Device, Kind, Tensor};

/// A configuration of the program's own: tch's SGD under another name.
#[derive(Clone, Copy)]
struct MySgd;
impl OptimizerConfig for MySgd {
    fn build_copt(&self, lr: f64) -> Result<tch::COptimizer, tch::TchError> {
        tch::COptimizer::sgd(lr, 0.0, 0.0, 0.0, false)
    }
}

/// Anything else with a two-argument `build`.
struct Report {
    title: String,
}
impl Report {
    fn build(self, lines: usize, footer: &str) -> String {
        format!("{}: {lines} lines, {footer}", self.title)
    }
}

#[tch_distributed::distributed]
fn train() -> anyhow::Result<(String, Vec<f32>, Vec<f32>)> {
    tch::manual_seed(3);
    let vs = nn::VarStore::new(Device::Cpu);
    let net = nn::linear(vs.root(), 2, 1, Default::default());
    let xs = Tensor::ones([4, 2], (Kind::Float, Device::Cpu));
    let calls = std::cell::Cell::new(0);
    fn counted<T>(calls: &std::cell::Cell<i32>, value: T) -> T {
        calls.set(calls.get() + 1);
        value
    }
    // tch's configuration: the SDK's optimizer, whose `zero_grad` returns a `Result`
    // that the attribute unwraps.
    let mut sdk = nn::Sgd::default().build(&vs, counted(&calls, 0.1))?;
    let _: &tch_distributed::Optimizer = &sdk;
    sdk.zero_grad();
    sdk.backward_step(&net.forward(&xs).sum(Kind::Float));
    let after_sdk = Vec::<f32>::try_from(net.ws.flatten(0, -1))?;
    // The program's own configuration: tch's optimizer, as written.
    let mut own = counted(&calls, MySgd).build(&vs, 0.1)?;
    let _: &nn::Optimizer = &own;
    own.zero_grad();
    own.backward_step(&net.forward(&xs).sum(Kind::Float));
    let after_own = Vec::<f32>::try_from(net.ws.flatten(0, -1))?;
    let report = Report { title: counted(&calls, "report".to_string()) }.build(3, "end");
    assert_eq!(calls.get(), 3, "each receiver and argument evaluated once");
    Ok((report, after_sdk, after_own))
}

fn main() -> anyhow::Result<()> {
    let (report, after_sdk, after_own) = train()?;
    assert_eq!(report, "report: 3 lines, end");
    // Each took one SGD step of lr 0.1 on a gradient of 4 per weight (4 rows of ones).
    for (s, o) in after_sdk.iter().zip(&after_own) {
        assert!((o - (s - 0.4)).abs() < 1e-6, "{after_sdk:?} then {after_own:?}");
    }
    Ok(())
}
