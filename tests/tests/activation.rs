//! Activation checkpointing (`tch_distributed::checkpoint`, `checkpointed`): the
//! gradients are those of the same model without it, bit for bit (deterministic CPU
//! operations), with dropout, under bf16 autocast, and on 2 ranks under the attribute.

use std::path::Path;
use std::process::Command;
use std::time::Duration;

use tch::nn::{self, Module};
use tch::{Device, Kind, Tensor};
use tch_distributed::MixedPrecision;
use tch_distributed_tests::compare::files as compare;
use tch_distributed_tests::{run_with, scratch_dir, tchrun};

/// A block's forward pass, checkpointed or not.
type Layer = Box<dyn Fn(&Tensor) -> Tensor>;

const WORKER: &str = env!("CARGO_BIN_EXE_activation_worker");

/// libtorch's CPU generator is the process's: the tests that draw from it (a layer's
/// initialization, `randn`) or set it (a checkpoint's recompute puts the first run's
/// state back, then the one it found) take turns. Without them, a recompute in another
/// test rewound the numbers a bit-for-bit test drew (a flaky failure, seen once).
static GENERATOR: std::sync::Mutex<()> = std::sync::Mutex::new(());

/// This test's turn with the CPU generator.
fn generator_turn() -> std::sync::MutexGuard<'static, ()> {
    GENERATOR.lock().unwrap_or_else(|e| e.into_inner())
}

/// Every variable's gradient, by name (sorted), and zeroes it.
fn take_gradients(vs: &nn::VarStore) -> Vec<(String, Tensor)> {
    let mut named: Vec<(String, Tensor)> = vs
        .variables()
        .into_iter()
        .map(|(name, mut t)| {
            let grad = t.grad().copy();
            t.zero_grad();
            (name, grad)
        })
        .collect();
    named.sort_by(|a, b| a.0.cmp(&b.0));
    named
}

/// `ours` has `plain`'s `count` gradients, bit for bit, none of them zero.
fn assert_same_gradients(plain: &[(String, Tensor)], ours: &[(String, Tensor)], count: usize) {
    assert_eq!((plain.len(), ours.len()), (count, count));
    for ((name, a), (_, b)) in plain.iter().zip(ours) {
        assert!(
            a.abs().sum(Kind::Float).double_value(&[]) > 0.0,
            "{name}: no gradient"
        );
        assert!(a.equal(b), "{name}: {a} vs {b}");
    }
}

/// Three blocks (Linear(8, 8), tanh, dropout 0.3) and a head on 5 rows of data; two
/// forward and backward passes, with a step of plain gradient descent after each (the
/// gradients add up). Returns every parameter's gradient, by name, and the loss of
/// each pass.
fn gradients(checkpointed: bool, precision: MixedPrecision) -> (Vec<(String, Tensor)>, Vec<f64>) {
    tch::manual_seed(0);
    let vs = nn::VarStore::new(Device::Cpu);
    let root = vs.root();
    let layers: Vec<nn::Linear> = (0..3)
        .map(|i| nn::linear(&root / format!("l{i}"), 8, 8, Default::default()))
        .collect();
    let head = nn::linear(&root / "head", 8, 1, Default::default());
    let blocks: Vec<Layer> = layers
        .into_iter()
        .map(|layer| -> Layer {
            let block = move |x: &Tensor| layer.forward(x).tanh().dropout(0.3, true);
            match checkpointed {
                true => {
                    let block = std::sync::Arc::new(std::sync::Mutex::new(block));
                    Box::new(move |x| {
                        let block = block.clone();
                        tch_distributed::checkpoint(move |x| block.lock().unwrap()(x), x)
                    })
                }
                false => Box::new(block),
            }
        })
        .collect();
    let mut losses = Vec::new();
    for pass in 0..2 {
        let x = Tensor::randn([5, 8], (Kind::Float, Device::Cpu)) + pass as f64;
        let loss = tch_distributed::autocast(Device::Cpu, precision, || {
            let hidden = blocks.iter().fold(x, |h, block| block(&h));
            head.forward(&hidden).square().mean(Kind::Float)
        })
        .unwrap();
        losses.push(loss.double_value(&[]));
        loss.backward();
        // A step between the passes (the next pass must see the updated weights).
        tch::no_grad(|| {
            for (_, mut t) in vs.variables() {
                let update = t.grad() * 0.5;
                let _ = t.g_sub_(&update);
            }
        });
    }
    (take_gradients(&vs), losses)
}

fn assert_bit_identical(precision: MixedPrecision) {
    let _turn = generator_turn();
    let (plain, plain_losses) = gradients(false, precision);
    let (ours, our_losses) = gradients(true, precision);
    assert_eq!(plain_losses, our_losses, "{precision:?}: the losses");
    assert_same_gradients(&plain, &ours, 8);
}

/// The recompute draws dropout's numbers from the generator's state of the first run
/// (and the generator goes on from where the first run left it): the gradients, and
/// the next pass's losses, are bit for bit the plain model's.
#[test]
fn gradients_with_dropout_are_the_plain_model_s_bit_for_bit() {
    assert_bit_identical(MixedPrecision::No);
}

/// The recompute runs under the first run's autocast (bf16 and fp16 on the CPU), and
/// leaves nothing in autocast's cache of casts: the second pass reads the weights the
/// step changed (with the recompute's casts cached, its loss was 35.55, not 23.58).
#[test]
fn gradients_under_autocast_are_the_plain_model_s_bit_for_bit() {
    assert_bit_identical(MixedPrecision::Bf16);
    assert_bit_identical(MixedPrecision::Fp16);
}

/// A block that returns its input (or a view of it) is an error at the call; one that
/// returns more than 64 tensors too. Under `no_grad` the block just runs.
#[test]
fn a_block_that_returns_its_input_is_an_error() {
    let _turn = generator_turn();
    let x = Tensor::ones([3], (Kind::Float, Device::Cpu)).set_requires_grad(true);
    let err =
        tch_distributed::f_checkpoint_many(|xs| vec![xs[0].narrow(0, 0, 2)], &[x.shallow_clone()])
            .unwrap_err()
            .to_string();
    assert!(err.contains("returned its input"), "{err}");
    let many = |xs: &[Tensor]| (0..65).map(|_| &xs[0] * 2.0).collect();
    let err = tch_distributed::f_checkpoint_many(many, &[x.shallow_clone()])
        .unwrap_err()
        .to_string();
    assert!(err.contains("more outputs"), "{err}");
    let y = tch::no_grad(|| tch_distributed::checkpoint(|x| x * 3.0, &x));
    assert!(!y.requires_grad());
    assert_eq!(Vec::<f32>::try_from(&y).unwrap(), [3.0, 3.0, 3.0]);
}

/// A frozen block on the data (outputs that depend on nothing trainable) is the
/// block's own run, without a node, as under PyTorch's non-reentrant checkpoint:
/// nothing runs again for it, and the layer after it trains as in the plain model.
/// A block whose outputs ignore its inputs that require a gradient is an error at
/// the call.
#[test]
fn a_frozen_block_runs_once_and_one_that_ignores_its_input_is_an_error() {
    let _turn = generator_turn();
    let mut vs = nn::VarStore::new(Device::Cpu);
    let frozen = nn::linear(vs.root() / "frozen", 3, 2, Default::default());
    vs.freeze();
    let head = nn::linear(vs.root() / "head", 2, 1, Default::default());
    let x = Tensor::ones([4, 3], (Kind::Float, Device::Cpu));
    let plain = frozen.forward(&x).relu();
    let runs = std::sync::Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let counted = runs.clone();
    let ours = tch_distributed::checkpoint(
        move |x| {
            counted.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
            frozen.forward(x).relu()
        },
        &x,
    );
    assert!(!ours.requires_grad() && ours.equal(&plain));
    let mut grads = Vec::new();
    for hidden in [plain, ours] {
        head.forward(&hidden).sum(Kind::Float).backward();
        grads.push(head.ws.grad().copy());
        let _ = head.ws.grad().zero_();
    }
    assert!(grads[0].equal(&grads[1]));
    assert_eq!(runs.load(std::sync::atomic::Ordering::SeqCst), 1);

    let w = head.ws.shallow_clone();
    let err = tch_distributed::f_checkpoint_many(
        move |xs| vec![w.exp(), xs[0].argmax(1, false)],
        &[Tensor::ones([2, 2], (Kind::Float, Device::Cpu)).set_requires_grad(true)],
    )
    .unwrap_err()
    .to_string();
    assert!(
        err.starts_with(
            "activation checkpointing: the checkpointed block's outputs do not depend on its \
             inputs that require a gradient"
        ),
        "{err}"
    );
}

/// A block that computes differently in its recompute (here, from a parameter its first
/// run did not use) is an error in the backward pass: that parameter's gradient would
/// be lost.
#[test]
fn a_block_whose_recompute_differs_is_an_error_in_the_backward_pass() {
    let _turn = generator_turn();
    let vs = nn::VarStore::new(Device::Cpu);
    let first = vs.root().var("first", &[3], nn::Init::Const(1.0));
    let second = vs.root().var("second", &[3], nn::Init::Const(2.0));
    let calls = std::sync::atomic::AtomicUsize::new(0);
    let x = Tensor::ones([3], (Kind::Float, Device::Cpu)).set_requires_grad(true);
    let y = tch_distributed::checkpoint(
        move |x| match calls.fetch_add(1, std::sync::atomic::Ordering::SeqCst) {
            0 => x * &first,
            _ => x * &second,
        },
        &x,
    );
    let err = y.sum(Kind::Float).f_backward().unwrap_err().to_string();
    assert!(
        err.starts_with(
            "Internal torch error: the checkpointed block's recompute used a tensor that \
             requires a gradient which its first run did not use"
        ),
        "{err}"
    );
}

/// Several inputs and outputs: each input gets the gradient of what the block made of
/// it.
#[test]
fn several_inputs_and_outputs_get_their_gradients() {
    let _turn = generator_turn();
    let a = Tensor::from_slice(&[1.0f32, 2.0]).set_requires_grad(true);
    let b = Tensor::from_slice(&[3.0f32, 4.0]).set_requires_grad(true);
    let ys = tch_distributed::checkpoint_many(
        |xs| vec![&xs[0] * &xs[1], xs[0].square()],
        &[a.shallow_clone(), b.shallow_clone()],
    );
    (ys[0].sum(Kind::Float) + ys[1].sum(Kind::Float)).backward();
    // d/da (a·b + a²) = b + 2a; d/db = a.
    assert_eq!(Vec::<f32>::try_from(a.grad()).unwrap(), [5.0, 8.0]);
    assert_eq!(Vec::<f32>::try_from(b.grad()).unwrap(), [1.0, 2.0]);
}

fn run(dir: &Path, out: &str, checkpointed: bool, env: &[(&str, &str)]) {
    let mut cmd = Command::new(tchrun());
    cmd.args(["--nproc-per-node", "2", WORKER])
        .args([dir.to_str().unwrap(), out])
        .env("CHECKPOINT", if checkpointed { "1" } else { "0" })
        .envs(env.iter().copied());
    run_with(cmd, dir, Duration::from_secs(120), |_, _| {}).assert_success();
}

/// On 2 ranks under `#[distributed]`, dropout in every block, the first block on the
/// data: the parameters after 6 steps are the plain model's, bit for bit. Under DDP
/// (its Reducer averages the gradients the recompute computes, which reach each
/// parameter along the block's node's edges, once: with one layer shared by the 4
/// blocks too, its uses summed), with `find_unused_parameters`
/// (whose search of the graph finds the parameters behind the node), under bf16 mixed
/// precision, with accumulation (`no_sync` between micro-batches), and at ZeRO stage 3
/// with every block a unit (gathered again for the recompute).
#[test]
fn on_2_ranks_under_the_attribute_training_is_the_plain_model_s() {
    let dir = scratch_dir("activation");
    let cases: [(&str, &[(&str, &str)]); 6] = [
        ("ddp", &[]),
        ("shared", &[("SHARED", "1")]),
        ("bf16", &[("TCH_DISTRIBUTED_MIXED_PRECISION", "bf16")]),
        (
            "find-unused",
            &[("TCH_DISTRIBUTED_FIND_UNUSED_PARAMETERS", "1")],
        ),
        ("accumulation", &[("TCH_DISTRIBUTED_GRAD_ACCUM", "2")]),
        ("zero3", &[("TCH_DISTRIBUTED_ZERO", "3"), ("UNITS", "1")]),
    ];
    for (name, env) in cases {
        let plain = format!("{name}-plain.safetensors");
        let ours = format!("{name}-checkpointed.safetensors");
        run(&dir, &plain, false, env);
        run(&dir, &ours, true, env);
        let diff = compare(&dir.join(&plain), &dir.join(&ours));
        assert_eq!(diff.max_abs, 0.0, "{name}: {diff:?}");
    }
}

/// min-gpt's shape of model: an `nn::seq_t()` of `func_t` blocks (layer norm, linear,
/// GELU, dropout, a residual) after a token embedding, each block `checkpointed_t`.
/// The gradients of two passes in train mode are the plain model's, bit for bit.
#[test]
fn checkpointed_t_blocks_in_a_seq_t_train_as_the_plain_blocks() {
    let _turn = generator_turn();
    let grads = |checkpointed: bool| {
        tch::manual_seed(0);
        let vs = nn::VarStore::new(Device::Cpu);
        let root = vs.root();
        let embedding = nn::embedding(&root / "emb", 12, 8, Default::default());
        let mut blocks = nn::seq_t();
        for i in 0..3 {
            let path = &root / i;
            let norm = nn::layer_norm(&path / "ln", vec![8], Default::default());
            let linear = nn::linear(&path / "lin", 8, 8, Default::default());
            let block = nn::func_t(move |xs, train| {
                xs + xs
                    .apply(&norm)
                    .apply(&linear)
                    .gelu("none")
                    .dropout(0.2, train)
            });
            blocks = match checkpointed {
                true => blocks.add(tch_distributed::checkpointed_t(block)),
                false => blocks.add(block),
            };
        }
        for pass in 0..2 {
            let ids = Tensor::from_slice(&[1i64, 4, 9, 4, 2, 10]).view([2, 3]) + pass;
            let hidden = ids.apply(&embedding).apply_t(&blocks, true);
            hidden.square().mean(Kind::Float).backward();
        }
        take_gradients(&vs)
    };
    assert_same_gradients(&grads(false), &grads(true), 13);
}

/// A block whose inputs cannot require a gradient (token ids into an embedding, or no
/// input at all) is differentiated for its parameters still: their gradients are the
/// plain block's, bit for bit.
#[test]
fn a_block_on_token_ids_gets_its_parameters_gradients() {
    let _turn = generator_turn();
    let vs = nn::VarStore::new(Device::Cpu);
    let embedding =
        tch_distributed::checkpointed(nn::embedding(vs.root() / "e", 10, 4, Default::default()));
    let scale = vs.root().var("scale", &[4], nn::Init::Const(0.5));
    let ids = Tensor::from_slice(&[1i64, 7, 7, 3]);
    let grads = |checkpointed: bool| {
        let hidden = match checkpointed {
            true => embedding.forward(&ids),
            false => embedding.inner().forward(&ids),
        };
        let weighted = match checkpointed {
            true => {
                let scale = scale.shallow_clone();
                tch_distributed::checkpoint_many(move |_| vec![scale.exp()], &[]).remove(0)
            }
            false => scale.exp(),
        };
        (hidden.tanh() * weighted)
            .square()
            .sum(Kind::Float)
            .backward();
        take_gradients(&vs)
    };
    assert_same_gradients(&grads(false), &grads(true), 2);
}

/// `checkpointed(module)` is the module to the program: `Module::forward` gives the
/// module's values and, through the recompute, its gradients; `inner` is the module.
#[test]
fn a_checkpointed_module_is_the_module() {
    let _turn = generator_turn();
    let vs = nn::VarStore::new(Device::Cpu);
    let layer = nn::linear(vs.root() / "l", 4, 3, Default::default());
    let x = Tensor::ones([2, 4], (Kind::Float, Device::Cpu)).set_requires_grad(true);
    let plain = layer.forward(&x).tanh().sum(Kind::Float);
    plain.backward();
    let (plain_ws, plain_x) = (layer.ws.grad().copy(), x.grad().copy());
    for (_, mut t) in vs.variables() {
        t.zero_grad();
    }
    let _ = x.grad().zero_();
    let wrapped = tch_distributed::checkpointed(layer);
    let ours = wrapped.forward(&x).tanh().sum(Kind::Float);
    assert!(ours.equal(&plain));
    ours.backward();
    assert!(wrapped.inner().ws.grad().equal(&plain_ws));
    assert!(x.grad().equal(&plain_x));
}
