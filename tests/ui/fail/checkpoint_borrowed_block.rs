// The closure form of activation checkpointing over a block borrowed from a `Vec`, as
// `torch.utils.checkpoint.checkpoint(block, h)` is written: the checkpoint keeps its
// block until the backward pass, so the closure must own it. The error says so and
// names the fix (`checkpointed(block)`, or an owned clone moved in).
use tch::nn::{self, Module};
use tch::{Device, Kind, Tensor};

fn main() {
    let vs = nn::VarStore::new(Device::Cpu);
    let blocks: Vec<nn::Linear> = (0..2)
        .map(|i| nn::linear(vs.root() / i, 4, 4, Default::default()))
        .collect();
    let mut h = Tensor::zeros([2, 4], (Kind::Float, Device::Cpu));
    for block in &blocks {
        h = tch_distributed::checkpoint(|x| block.forward(x), &h);
    }
}
