// A DCGAN on MNIST, in the shape of tch-rs's `gan` example: a generator of
// `nn::conv_transpose2d`s with `nn::batch_norm2d` and a discriminator of strided
// `nn::conv2d`s with leaky relus and batch norm, each in its own `nn::VarStore` with its
// own `nn::adam(0.5, 0.999, 0.)` optimizer, trained in turns by freezing the other store
// (`discriminator_vs.unfreeze(); generator_vs.freeze();` …), the latent noise from
// `Tensor::randn`. Where tch's example samples random batches, this one goes over the
// real images in epochs, `for (real, _) in Iter2::new(..).shuffle().to_device(..)`, with
// the usual DCGAN losses (binary cross-entropy on the discriminator's logits). The one
// line added for data parallelism is the attribute on `train`.
//
// Usage: gan DATA_DIR OUT.safetensors [EPOCHS]  (DATA_DIR: the four MNIST idx files)
// Writes the generator to OUT.safetensors and the discriminator to
// OUT.discriminator.safetensors.
use anyhow::Result;
use tch::data::Iter2;
use tch::{nn, nn::OptimizerConfig, Device, Kind, Tensor};

const LATENT_DIM: i64 = 16;
const BATCH: i64 = 32;
const LEARNING_RATE: f64 = 2e-4;

fn tr2d(
    p: nn::Path,
    c_in: i64,
    c_out: i64,
    k: i64,
    padding: i64,
    stride: i64,
) -> nn::ConvTranspose2D {
    let cfg = nn::ConvTransposeConfig {
        stride,
        padding,
        bias: false,
        ..Default::default()
    };
    nn::conv_transpose2d(p, c_in, c_out, k, cfg)
}

fn conv2d(p: nn::Path, c_in: i64, c_out: i64, k: i64, padding: i64, stride: i64) -> nn::Conv2D {
    let cfg = nn::ConvConfig {
        stride,
        padding,
        bias: false,
        ..Default::default()
    };
    nn::conv2d(p, c_in, c_out, k, cfg)
}

// LATENT_DIM x 1 x 1 -> 32 x 7 x 7 -> 16 x 14 x 14 -> 1 x 28 x 28, in [-1, 1].
fn generator(p: nn::Path) -> impl nn::ModuleT {
    nn::seq_t()
        .add(tr2d(&p / "tr1", LATENT_DIM, 32, 7, 0, 1))
        .add(nn::batch_norm2d(&p / "bn1", 32, Default::default()))
        .add_fn(|xs| xs.relu())
        .add(tr2d(&p / "tr2", 32, 16, 4, 1, 2))
        .add(nn::batch_norm2d(&p / "bn2", 16, Default::default()))
        .add_fn(|xs| xs.relu())
        .add(tr2d(&p / "tr3", 16, 1, 4, 1, 2))
        .add_fn(|xs| xs.tanh())
}

fn leaky_relu(xs: &Tensor) -> Tensor {
    xs.maximum(&(xs * 0.2))
}

// 1 x 28 x 28 -> 16 x 14 x 14 -> 32 x 7 x 7 -> one logit.
fn discriminator(p: nn::Path) -> impl nn::ModuleT {
    nn::seq_t()
        .add(conv2d(&p / "conv1", 1, 16, 4, 1, 2))
        .add_fn(leaky_relu)
        .add(conv2d(&p / "conv2", 16, 32, 4, 1, 2))
        .add(nn::batch_norm2d(&p / "bn2", 32, Default::default()))
        .add_fn(leaky_relu)
        .add(conv2d(&p / "conv3", 32, 1, 7, 0, 1))
        .add_fn(|xs| xs.view([-1]))
}

// Binary cross-entropy of the logits against an all-`target` label.
fn bce(logits: &Tensor, target: f64) -> Tensor {
    logits.binary_cross_entropy_with_logits::<Tensor>(
        &logits.full_like(target),
        None,
        None,
        tch::Reduction::Mean,
    )
}

#[tch_distributed::distributed]
fn train(data: &str, out: &str, epochs: i64) -> Result<()> {
    let device = Device::cuda_if_available();
    let m = tch::vision::mnist::load_dir(data)?;
    let images = m.train_images.view([-1, 1, 28, 28]) * 2. - 1.;

    let rand_latent = |n: i64| Tensor::randn([n, LATENT_DIM, 1, 1], (Kind::Float, device));

    let mut generator_vs = nn::VarStore::new(device);
    let generator = generator(generator_vs.root());
    let mut opt_g = nn::adam(0.5, 0.999, 0.).build(&generator_vs, LEARNING_RATE)?;

    let mut discriminator_vs = nn::VarStore::new(device);
    let discriminator = discriminator(discriminator_vs.root());
    let mut opt_d = nn::adam(0.5, 0.999, 0.).build(&discriminator_vs, LEARNING_RATE)?;

    for epoch in 1..=epochs {
        let (mut d_sum, mut g_sum, mut batches) = (0., 0., 0);
        for (real, _) in Iter2::new(&images, &m.train_labels, BATCH)
            .shuffle()
            .to_device(device)
        {
            let batch_size = real.size()[0];

            discriminator_vs.unfreeze();
            generator_vs.freeze();
            let discriminator_loss = {
                let y_real = real.apply_t(&discriminator, true);
                let fake = rand_latent(batch_size).apply_t(&generator, true).detach();
                let y_fake = fake.apply_t(&discriminator, true);
                bce(&y_real, 1.) + bce(&y_fake, 0.)
            };
            opt_d.backward_step(&discriminator_loss);

            discriminator_vs.freeze();
            generator_vs.unfreeze();
            let generator_loss = {
                let y_fake = rand_latent(batch_size)
                    .apply_t(&generator, true)
                    .apply_t(&discriminator, true);
                bce(&y_fake, 1.)
            };
            opt_g.backward_step(&generator_loss);

            d_sum += discriminator_loss.double_value(&[]);
            g_sum += generator_loss.double_value(&[]);
            batches += 1;
        }
        println!(
            "epoch: {:4} d loss: {:.4} g loss: {:.4}",
            epoch,
            d_sum / batches as f64,
            g_sum / batches as f64
        );
    }
    generator_vs.save(out)?;
    discriminator_vs.save(std::path::Path::new(out).with_extension("discriminator.safetensors"))?;
    Ok(())
}

fn main() -> Result<()> {
    let args: Vec<String> = std::env::args().collect();
    tch::manual_seed(42); // reproducible: the tests compare runs bit for bit
    let epochs = args.get(3).map_or(Ok(2), |e| e.parse())?;
    train(&args[1], &args[2], epochs)
}
