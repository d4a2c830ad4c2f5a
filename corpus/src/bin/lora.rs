// LoRA fine-tuning, as PEFT trains adapters under DeepSpeed ZeRO or FSDP: a small
// character-level model (a token embedding, residual MLP blocks, a linear head) is
// pretrained on the text by the `pretrain` sub-command. The fine-tuning builds the same
// model with a low-rank adapter beside each block's linear layers (`lora_a`: r × in,
// random; `lora_b`: out × r, zeros; added as x·aᵀ·bᵀ·alpha/r, as PEFT's `LoraLayer`),
// wraps each block in `fully_shard` (FSDP's auto-wrap of transformer blocks), loads
// the pretrained weights into it with `vs.load_partial` (the file has no adapters),
// freezes every variable but the adapters (`set_requires_grad(false)`), and trains the
// adapters with AdamW over `iter_shuffle` windows. It prints the loss on the text's
// first windows before and after, and writes the adapters alone with
// `tch_distributed::save_trainable` (PEFT's `adapter_model.safetensors`, beside the
// model) and the whole model with `vs.save`. The one line added for data parallelism is the attribute on
// `finetune`; `zero = 2` or `3` (`TCH_DISTRIBUTED_ZERO`) shards it.
//
// Usage: lora pretrain INPUT.txt BASE.safetensors [STEPS]
//        lora INPUT.txt BASE.safetensors MODEL.safetensors [EPOCHS]
use anyhow::Result;
use tch::data::TextData;
use tch::nn::{self, Module, OptimizerConfig};
use tch::{Device, Kind, Tensor};
use tch_distributed::{fully_shard, FullyShard};

const N_EMBD: i64 = 32;
const N_BLOCK: usize = 2;
const LORA_R: i64 = 4;
const LORA_ALPHA: f64 = 8.0;
const BLOCK_SIZE: i64 = 16;
const BATCH: i64 = 16;

/// A linear layer, with a low-rank adapter beside it when fine-tuning.
#[derive(Debug)]
struct Lora {
    base: nn::Linear,
    adapter: Option<(Tensor, Tensor)>,
}

fn lora(p: nn::Path, inputs: i64, outputs: i64, adapter: bool) -> Lora {
    Lora {
        base: nn::linear(&p, inputs, outputs, Default::default()),
        adapter: adapter.then(|| {
            (
                p.randn("lora_a", &[LORA_R, inputs], 0.0, 0.1),
                p.zeros("lora_b", &[outputs, LORA_R]),
            )
        }),
    }
}

impl Module for Lora {
    fn forward(&self, xs: &Tensor) -> Tensor {
        let out = xs.apply(&self.base);
        match &self.adapter {
            Some((a, b)) => out + xs.matmul(&a.tr()).matmul(&b.tr()) * (LORA_ALPHA / LORA_R as f64),
            None => out,
        }
    }
}

/// A residual MLP block.
#[derive(Debug)]
struct Block {
    fc1: Lora,
    fc2: Lora,
}

impl Module for Block {
    fn forward(&self, xs: &Tensor) -> Tensor {
        xs + self.fc2.forward(&self.fc1.forward(xs).gelu("none"))
    }
}

struct Model {
    embed: nn::Embedding,
    blocks: Vec<FullyShard<Block>>,
    head: nn::Linear,
}

impl Model {
    fn new(p: &nn::Path, vocab: i64, adapters: bool) -> Model {
        let embed = nn::embedding(p / "embed", vocab, N_EMBD, Default::default());
        let blocks = (0..N_BLOCK)
            .map(|i| {
                let path = p / "blocks" / i;
                let block = Block {
                    fc1: lora(&path / "fc1", N_EMBD, 4 * N_EMBD, adapters),
                    fc2: lora(&path / "fc2", 4 * N_EMBD, N_EMBD, adapters),
                };
                fully_shard(block, &path)
            })
            .collect();
        let head = nn::linear(p / "head", N_EMBD, vocab, Default::default());
        Model {
            embed,
            blocks,
            head,
        }
    }

    /// The logits of every position of `xs` ([batch, time] labels).
    fn forward(&self, xs: &Tensor) -> Tensor {
        let h = self
            .blocks
            .iter()
            .fold(xs.apply(&self.embed), |h, block| block.forward(&h));
        h.apply(&self.head)
    }
}

/// The mean cross-entropy of predicting each next label of `windows` (`TextData`'s
/// bytes).
fn loss(model: &Model, windows: &Tensor, vocab: i64) -> Tensor {
    let windows = windows.to_kind(Kind::Int64);
    let xs = windows.narrow(1, 0, BLOCK_SIZE);
    let ys = windows.narrow(1, 1, BLOCK_SIZE);
    model
        .forward(&xs)
        .view([-1, vocab])
        .cross_entropy_for_logits(&ys.reshape([-1]))
}

/// The text's first 8 windows, the same in every run.
fn first_windows(data: &TextData, device: Device) -> Tensor {
    let labels = data.data();
    Tensor::stack(
        &(0..8)
            .map(|i| labels.narrow(0, i * (BLOCK_SIZE + 1), BLOCK_SIZE + 1))
            .collect::<Vec<_>>(),
        0,
    )
    .to_device(device)
}

fn pretrain(input: &str, base: &str, steps: usize) -> Result<()> {
    let data = TextData::new(input)?;
    let vocab = data.labels();
    let vs = nn::VarStore::new(Device::cuda_if_available());
    let model = Model::new(&vs.root(), vocab, false);
    let mut opt = nn::Adam::default().build(&vs, 1e-2)?;
    for batch in data.iter_shuffle(BLOCK_SIZE + 1, BATCH).take(steps) {
        let l = loss(&model, &batch.to_device(vs.device()), vocab);
        opt.backward_step(&l);
    }
    vs.save(base)?;
    Ok(())
}

#[tch_distributed::distributed]
fn finetune(input: &str, base: &str, out: &str, epochs: usize) -> Result<()> {
    let data = TextData::new(input)?;
    let vocab = data.labels();
    let mut vs = nn::VarStore::new(Device::cuda_if_available());
    let model = Model::new(&vs.root(), vocab, true);
    let missing = vs.load_partial(base)?;
    println!("{} adapter variables are not in the base", missing.len());
    for (name, var) in vs.variables() {
        if !name.contains(".lora_") {
            let _ = var.set_requires_grad(false);
        }
    }
    let windows = first_windows(&data, vs.device());
    let before = tch::no_grad(|| loss(&model, &windows, vocab)).double_value(&[]);
    let mut opt = nn::AdamW::default().build(&vs, 1e-2)?;
    for epoch in 1..=epochs {
        for batch in data.iter_shuffle(BLOCK_SIZE + 1, BATCH) {
            let l = loss(&model, &batch.to_device(vs.device()), vocab);
            opt.backward_step(&l);
        }
        println!("epoch {epoch} done");
    }
    let after = tch::no_grad(|| loss(&model, &windows, vocab)).double_value(&[]);
    println!("loss on the first windows: base {before:.4}, fine-tuned {after:.4}");
    let dir = std::path::Path::new(out)
        .parent()
        .unwrap_or(std::path::Path::new("."));
    tch_distributed::save_trainable(&vs, dir.join("adapter_model.safetensors"))?;
    vs.save(out)?;
    Ok(())
}

fn main() -> Result<()> {
    tch::manual_seed(42); // reproducible: the tests compare runs bit for bit
    let args: Vec<String> = std::env::args().collect();
    match args.get(1).map(String::as_str) {
        Some("pretrain") if args.len() >= 4 => {
            let steps = args.get(4).map_or(Ok(20), |s| s.parse())?;
            pretrain(&args[2], &args[3], steps)
        }
        Some(_) if args.len() >= 4 => {
            let epochs = args.get(4).map_or(Ok(1), |s| s.parse())?;
            finetune(&args[1], &args[2], &args[3], epochs)
        }
        _ => anyhow::bail!(
            "usage: lora pretrain INPUT.txt BASE.safetensors [STEPS]\n       lora INPUT.txt BASE.safetensors MODEL.safetensors [EPOCHS]"
        ),
    }
}
