// A CIFAR-style ResNet, as tch-rs's `cifar` example writes it: `nn::seq_t()` of
// `conv_bn` blocks (`nn::conv2d` without bias + `nn::batch_norm2d` + relu), residual
// `layer`s built with `nn::func_t` (`pre + ys`), `forward_t(.., true)` to train and
// `batch_accuracy_for_logits` (which runs `forward_t(.., false)`) for test accuracy, SGD
// with momentum, Nesterov and weight decay, a per-epoch learning-rate schedule
// (`opt.set_lr(learning_rate(epoch))`), `train_iter(..).shuffle().to_device(..)` and
// `tch::vision::dataset::augmentation` (random flips and crops). The widths are cut down
// to train on 16×16 images in seconds. The one line added for data parallelism is the
// attribute on `train`.
//
// The data is a `tch::vision::dataset::Dataset` read from a safetensors file holding
// `train_images`, `test_images` (uint8, [N, 3, 16, 16]: CIFAR's 32×32 halved) and
// `train_labels`, `test_labels` (int64, [N]), scaled to [0, 1] as tch's CIFAR loader does.
//
// Usage: resnet DATA.safetensors OUT.safetensors [EPOCHS]
use std::collections::HashMap;

use anyhow::{anyhow, Result};
use tch::nn::{FuncT, ModuleT, OptimizerConfig, SequentialT};
use tch::vision::dataset::Dataset;
use tch::{nn, Device, Kind, Tensor};

const BATCH: i64 = 32;

fn conv_bn(vs: &nn::Path, c_in: i64, c_out: i64) -> SequentialT {
    let conv2d_cfg = nn::ConvConfig {
        padding: 1,
        bias: false,
        ..Default::default()
    };
    nn::seq_t()
        .add(nn::conv2d(vs, c_in, c_out, 3, conv2d_cfg))
        .add(nn::batch_norm2d(vs, c_out, Default::default()))
        .add_fn(|x| x.relu())
}

fn layer<'a>(vs: &nn::Path, c_in: i64, c_out: i64) -> FuncT<'a> {
    let pre = conv_bn(&vs.sub("pre"), c_in, c_out);
    let block1 = conv_bn(&vs.sub("b1"), c_out, c_out);
    let block2 = conv_bn(&vs.sub("b2"), c_out, c_out);
    nn::func_t(move |xs, train| {
        let pre = xs.apply_t(&pre, train).max_pool2d_default(2);
        let ys = pre.apply_t(&block1, train).apply_t(&block2, train);
        pre + ys
    })
}

fn fast_resnet(vs: &nn::Path) -> SequentialT {
    nn::seq_t()
        .add(conv_bn(&vs.sub("pre"), 3, 8))
        .add(layer(&vs.sub("layer1"), 8, 16))
        .add(conv_bn(&vs.sub("inter"), 16, 32))
        .add_fn(|x| x.max_pool2d_default(2))
        .add(layer(&vs.sub("layer2"), 32, 64))
        .add_fn(|x| x.max_pool2d_default(2).flat_view())
        .add(nn::linear(vs.sub("linear"), 64, 10, Default::default()))
        .add_fn(|x| x * 0.125)
}

fn learning_rate(epoch: i64) -> f64 {
    if epoch < 2 {
        0.1
    } else if epoch < 3 {
        0.01
    } else {
        0.001
    }
}

fn load_dataset(path: &str) -> Result<Dataset> {
    let mut tensors: HashMap<String, Tensor> =
        Tensor::read_safetensors(path)?.into_iter().collect();
    let mut take = |name: &str| {
        tensors
            .remove(name)
            .ok_or_else(|| anyhow!("{path}: no tensor named {name}"))
    };
    let images = |t: Tensor| t.to_kind(Kind::Float) / 255.0;
    Ok(Dataset {
        train_images: images(take("train_images")?),
        train_labels: take("train_labels")?,
        test_images: images(take("test_images")?),
        test_labels: take("test_labels")?,
        labels: 10,
    })
}

#[tch_distributed::distributed]
fn train(data: &str, out: &str, epochs: i64) -> Result<()> {
    let m = load_dataset(data)?;
    let vs = nn::VarStore::new(Device::cuda_if_available());
    let net = fast_resnet(&vs.root());
    let mut opt = nn::Sgd {
        momentum: 0.9,
        dampening: 0.,
        wd: 5e-4,
        nesterov: true,
    }
    .build(&vs, 0.)?;
    for epoch in 1..=epochs {
        opt.set_lr(learning_rate(epoch));
        for (bimages, blabels) in m.train_iter(BATCH).shuffle().to_device(vs.device()) {
            let bimages = tch::vision::dataset::augmentation(&bimages, true, 4, 0);
            let loss = net
                .forward_t(&bimages, true)
                .cross_entropy_for_logits(&blabels);
            opt.backward_step(&loss);
        }
        let test_accuracy =
            net.batch_accuracy_for_logits(&m.test_images, &m.test_labels, vs.device(), 512);
        println!("epoch: {:4} test acc: {:5.2}%", epoch, 100. * test_accuracy);
    }
    vs.save(out)?;
    Ok(())
}

fn main() -> Result<()> {
    let args: Vec<String> = std::env::args().collect();
    tch::manual_seed(42); // reproducible: the tests compare runs bit for bit
    let epochs = args.get(3).map_or(Ok(2), |e| e.parse())?;
    train(&args[1], &args[2], epochs)
}
