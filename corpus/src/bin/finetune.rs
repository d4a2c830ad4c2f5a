// Transfer learning, as tch-rs's `transfer-learning` example does it, but trained in
// batches: a backbone whose variables are loaded from a pretrained weights file
// (`vs.load(..)`) and frozen (`vs.freeze()`), a new linear head trained on top of its
// features, computed in the loop under `tch::no_grad` with `apply_t(&backbone, false)`
// (batch norm in eval mode), over `Iter2::new(..).shuffle().to_device(..)`.
//
// tch's example uses two VarStores (one for the pretrained resnet, one for the head);
// this program keeps both parts in one, as is also common: the backbone is built, loaded
// and frozen, then the head is created on the same store after the freeze, so the head's
// variables are the only ones that require gradients, and `vs.save` writes the whole
// fine-tuned model. The one line added for data parallelism is the attribute on `train`.
//
// The pretrained file comes from the `pretrain` sub-command: the backbone and a
// 10-class classifier trained on the MNIST digits. Fine-tuning then learns a new task on
// the backbone's features: whether the digit is 5 or above.
//
// Usage: finetune pretrain DATA_DIR WEIGHTS.safetensors [EPOCHS]
//        finetune DATA_DIR WEIGHTS.safetensors OUT.safetensors [EPOCHS]
// (DATA_DIR: the four MNIST idx files)
use anyhow::Result;
use tch::data::Iter2;
use tch::nn::{self, Module, ModuleT, OptimizerConfig, SequentialT};
use tch::{Device, Kind};

const FEATURES: i64 = 64;
const BATCH: i64 = 32;

fn backbone(p: &nn::Path) -> SequentialT {
    nn::seq_t()
        .add_fn(|xs| xs.view([-1, 1, 28, 28]))
        .add(nn::conv2d(p / "conv1", 1, 16, 5, Default::default()))
        .add(nn::batch_norm2d(p / "bn1", 16, Default::default()))
        .add_fn(|xs| xs.relu().max_pool2d_default(2))
        .add(nn::conv2d(p / "conv2", 16, 32, 5, Default::default()))
        .add(nn::batch_norm2d(p / "bn2", 32, Default::default()))
        .add_fn(|xs| xs.relu().max_pool2d_default(2).flat_view())
        .add(nn::linear(p / "fc", 512, FEATURES, Default::default()))
        .add_fn(|xs| xs.relu())
}

/// Trains the backbone with a 10-class classifier on the digits; saves both.
fn pretrain(data: &str, weights: &str, epochs: i64) -> Result<()> {
    let m = tch::vision::mnist::load_dir(data)?;
    let vs = nn::VarStore::new(Device::cuda_if_available());
    let net = nn::seq_t()
        .add(backbone(&(vs.root() / "backbone")))
        .add(nn::linear(
            vs.root() / "classifier",
            FEATURES,
            10,
            Default::default(),
        ));
    let mut opt = nn::Adam::default().build(&vs, 1e-3)?;
    for epoch in 1..=epochs {
        for (bimages, blabels) in m.train_iter(BATCH).shuffle().to_device(vs.device()) {
            let loss = net
                .forward_t(&bimages, true)
                .cross_entropy_for_logits(&blabels);
            opt.backward_step(&loss);
        }
        let test_accuracy =
            net.batch_accuracy_for_logits(&m.test_images, &m.test_labels, vs.device(), 1024);
        println!(
            "pretrain epoch: {:4} test acc: {:5.2}%",
            epoch,
            100. * test_accuracy
        );
    }
    vs.save(weights)?;
    Ok(())
}

#[tch_distributed::distributed]
fn train(data: &str, weights: &str, out: &str, epochs: i64) -> Result<()> {
    let m = tch::vision::mnist::load_dir(data)?;
    // The new task: is the digit 5 or above?
    let train_labels = m.train_labels.ge(5).to_kind(Kind::Int64);
    let test_labels = m.test_labels.ge(5).to_kind(Kind::Int64);

    let mut vs = nn::VarStore::new(Device::cuda_if_available());
    let backbone = backbone(&(vs.root() / "backbone"));
    vs.load(weights)?;
    vs.freeze();
    let head = nn::linear(vs.root() / "head", FEATURES, 2, Default::default());
    let mut opt = nn::Sgd {
        momentum: 0.9,
        ..Default::default()
    }
    .build(&vs, 0.1)?;

    let test_features = tch::no_grad(|| {
        m.test_images
            .to_device(vs.device())
            .apply_t(&backbone, false)
    });
    for epoch in 1..=epochs {
        for (bimages, blabels) in Iter2::new(&m.train_images, &train_labels, BATCH)
            .shuffle()
            .to_device(vs.device())
        {
            let features = tch::no_grad(|| bimages.apply_t(&backbone, false));
            let loss = head.forward(&features).cross_entropy_for_logits(&blabels);
            opt.backward_step(&loss);
        }
        let test_accuracy = test_features
            .apply(&head)
            .accuracy_for_logits(&test_labels.to_device(vs.device()));
        println!(
            "epoch: {:4} test acc: {:5.2}%",
            epoch,
            100. * f64::try_from(test_accuracy)?
        );
    }
    vs.save(out)?;
    Ok(())
}

fn main() -> Result<()> {
    let args: Vec<String> = std::env::args().collect();
    tch::manual_seed(42); // reproducible: the tests compare runs bit for bit
    if args[1] == "pretrain" {
        let epochs = args.get(4).map_or(Ok(1), |e| e.parse())?;
        return pretrain(&args[2], &args[3], epochs);
    }
    let epochs = args.get(4).map_or(Ok(2), |e| e.parse())?;
    train(&args[1], &args[2], &args[3], epochs)
}
