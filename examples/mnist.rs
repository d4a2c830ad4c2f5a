//! A small convolutional network trained on MNIST, written as plain single-GPU `tch`
//! code in the style of tch-rs's `mnist_conv` example. The one addition is
//! `#[tch_distributed::distributed]` on the training function, which makes it
//! data-parallel: every rank trains on its own share of the batches, gradients are
//! averaged over the ranks, and rank 0 alone prints and writes the checkpoint.
//!
//! Data: the four MNIST idx files, ungzipped into one directory `DIR`:
//! `train-images-idx3-ubyte`, `train-labels-idx1-ubyte`, `t10k-images-idx3-ubyte` and
//! `t10k-labels-idx1-ubyte` (e.g. from one of the usual MNIST mirrors, such as
//! <https://ossci-datasets.s3.amazonaws.com/mnist/>, where they end in `.gz`).
//!
//! Run it with any of:
//!
//! ```text
//! cargo run --release --example mnist -- --data DIR     # one process; with TCH_DISTRIBUTED_NPROC=2 it starts 2 ranks itself
//! tchrun --nproc-per-node 2 target/release/examples/mnist --data DIR
//! torchrun --standalone --nproc-per-node 2 --no-python target/release/examples/mnist --data DIR
//! ```
//!
//! With the default sizes (those of `mnist_conv`) it reaches about 99% test accuracy
//! in a few epochs. `--batch-size` is per rank: the global batch is that times the
//! number of ranks. The train loss printed is rank 0's mean over its own batches.

use anyhow::{Context as _, Result};
use clap::Parser;
use tch::nn::{self, ModuleT, OptimizerConfig};
use tch::{Device, Tensor};

#[derive(Parser, Debug)]
#[command(about = "A conv net on MNIST, data-parallel over tch-distributed")]
struct Args {
    /// Directory holding the four (ungzipped) MNIST idx files.
    #[arg(long)]
    data: std::path::PathBuf,
    /// Passes over the training set.
    #[arg(long, default_value_t = 2)]
    epochs: usize,
    /// Images per rank and step (the global batch is this times the world size).
    #[arg(long, default_value_t = 256)]
    batch_size: i64,
    /// Adam learning rate.
    #[arg(long, default_value_t = 1e-3)]
    lr: f64,
    /// Where to write the trained weights (`.safetensors`, else libtorch's format).
    #[arg(long)]
    checkpoint: Option<std::path::PathBuf>,
    /// Channels of the first convolution.
    #[arg(long, default_value_t = 32)]
    conv1: i64,
    /// Channels of the second convolution.
    #[arg(long, default_value_t = 64)]
    conv2: i64,
    /// Width of the hidden fully connected layer.
    #[arg(long, default_value_t = 1024)]
    hidden: i64,
}

#[derive(Debug)]
struct Net {
    conv1: nn::Conv2D,
    conv2: nn::Conv2D,
    fc1: nn::Linear,
    fc2: nn::Linear,
    flat: i64,
}

impl Net {
    fn new(vs: &nn::Path, args: &Args) -> Net {
        // 28x28 -> conv 5 -> 24x24 -> pool -> 12x12 -> conv 5 -> 8x8 -> pool -> 4x4.
        let flat = args.conv2 * 4 * 4;
        let conv1 = nn::conv2d(vs / "conv1", 1, args.conv1, 5, Default::default());
        let conv2 = nn::conv2d(vs / "conv2", args.conv1, args.conv2, 5, Default::default());
        let fc1 = nn::linear(vs / "fc1", flat, args.hidden, Default::default());
        let fc2 = nn::linear(vs / "fc2", args.hidden, 10, Default::default());
        Net {
            conv1,
            conv2,
            fc1,
            fc2,
            flat,
        }
    }
}

impl ModuleT for Net {
    fn forward_t(&self, xs: &Tensor, train: bool) -> Tensor {
        xs.view([-1, 1, 28, 28])
            .apply(&self.conv1)
            .max_pool2d_default(2)
            .apply(&self.conv2)
            .max_pool2d_default(2)
            .view([-1, self.flat])
            .apply(&self.fc1)
            .relu()
            .dropout(0.5, train)
            .apply(&self.fc2)
    }
}

#[tch_distributed::distributed]
fn train(args: &Args) -> Result<()> {
    let m = tch::vision::mnist::load_dir(&args.data).with_context(|| {
        format!(
            "loading MNIST from {} (it needs the four ungzipped idx files: see `--help`)",
            args.data.display()
        )
    })?;
    let vs = nn::VarStore::new(Device::cuda_if_available());
    let net = Net::new(&vs.root(), args);
    let mut opt = nn::Adam::default().build(&vs, args.lr)?;
    let mut test_accuracy = 0.0;
    for epoch in 1..=args.epochs {
        let (mut loss_sum, mut batches) = (0.0, 0);
        for (bimages, blabels) in m
            .train_iter(args.batch_size)
            .shuffle()
            .to_device(vs.device())
        {
            let loss = net
                .forward_t(&bimages, true)
                .cross_entropy_for_logits(&blabels);
            opt.backward_step(&loss);
            loss_sum += loss.double_value(&[]);
            batches += 1;
        }
        test_accuracy =
            net.batch_accuracy_for_logits(&m.test_images, &m.test_labels, vs.device(), 1024);
        println!(
            "epoch: {epoch:4} train loss: {:8.5} test acc: {:5.2}%",
            loss_sum / batches.max(1) as f64,
            100. * test_accuracy
        );
    }
    println!("final test accuracy: {:5.2}%", 100. * test_accuracy);
    if let Some(path) = &args.checkpoint {
        vs.save(path)?;
        println!("wrote {}", path.display());
    }
    Ok(())
}

fn main() -> Result<()> {
    let args = Args::parse();
    train(&args)
}
