// tch-rs's char-rnn (`char_rnn.rs`) made restartable, with the lines a user adds for
// that: a `Checkpointer` over a directory, `load_state` before training (the step and
// epoch counters restored from the `TrainState` it returns) and `save_state` every
// `CHECKPOINT_EVERY` steps. Nothing is written about the batch loop: under the
// attribute it resumes by itself, with the same shuffle, past the batches it had
// trained on. The one line added for data parallelism is the attribute on `train`.
//
// Usage: char_rnn_resume INPUT.txt OUT.safetensors CHECKPOINT_DIR [EPOCHS]
use anyhow::Result;
use tch::data::TextData;
use tch::nn::{Linear, Module, OptimizerConfig, LSTM, RNN};
use tch::{nn, Device, Kind, Tensor};
use tch_distributed::{Checkpointer, TrainState};

const LEARNING_RATE: f64 = 0.01;
const HIDDEN_SIZE: i64 = 32;
const SEQ_LEN: i64 = 16;
const BATCH_SIZE: i64 = 16;
const SAMPLING_LEN: i64 = 48;
const CHECKPOINT_EVERY: u64 = 4;

/// Draws `SAMPLING_LEN` characters from the LSTM + Linear model, one at a time.
fn sample(data: &TextData, lstm: &LSTM, linear: &Linear, device: Device) -> String {
    let labels = data.labels();
    let mut state = lstm.zero_state(1);
    let mut last_label = 0i64;
    let mut result = String::new();
    for _ in 0..SAMPLING_LEN {
        let input = Tensor::zeros([1, labels], (Kind::Float, device));
        let _ = input.narrow(1, last_label, 1).fill_(1.0);
        state = lstm.step(&input, &state);
        let sampled_y = linear
            .forward(&state.h())
            .squeeze_dim(0)
            .softmax(-1, Kind::Float)
            .multinomial(1, false);
        last_label = i64::try_from(sampled_y).unwrap();
        result.push(data.label_to_char(last_label))
    }
    result
}

#[tch_distributed::distributed]
fn train(input: &str, out: &str, checkpoint_dir: &str, epochs: u64) -> Result<()> {
    let device = Device::cuda_if_available();
    let mut vs = nn::VarStore::new(device);
    let data = TextData::new(input)?;
    let labels = data.labels();
    println!("Dataset loaded, {labels} labels.");
    let lstm = nn::lstm(vs.root(), labels, HIDDEN_SIZE, Default::default());
    let linear = nn::linear(vs.root(), HIDDEN_SIZE, labels, Default::default());
    let mut opt = nn::Adam::default().build(&vs, LEARNING_RATE)?;
    let checkpoints = Checkpointer::new(checkpoint_dir).keep_last(2);
    let (mut step, mut first_epoch) = (0, 1);
    if let Some(state) = checkpoints.load_state(&mut vs, &mut opt)? {
        (step, first_epoch) = (state.step, state.epoch);
        println!("resumed from step {step}");
    }
    for epoch in first_epoch..=epochs {
        let mut sum_loss = 0.;
        let mut cnt_loss = 0.;
        for batch in data.iter_shuffle(SEQ_LEN + 1, BATCH_SIZE) {
            let xs_onehot = batch.narrow(1, 0, SEQ_LEN).onehot(labels);
            let ys = batch.narrow(1, 1, SEQ_LEN).to_kind(Kind::Int64);
            let (lstm_out, _) = lstm.seq(&xs_onehot.to_device(device));
            let logits = linear.forward(&lstm_out);
            let loss = logits
                .view([BATCH_SIZE * SEQ_LEN, labels])
                .cross_entropy_for_logits(&ys.to_device(device).view([BATCH_SIZE * SEQ_LEN]));
            opt.backward_step_clip(&loss, 0.5);
            sum_loss += f64::try_from(loss)?;
            cnt_loss += 1.0;
            step += 1;
            if step % CHECKPOINT_EVERY == 0 {
                let state = TrainState {
                    step,
                    epoch,
                    ..Default::default()
                };
                checkpoints.save_state(&vs, &mut opt, &state)?;
            }
        }
        println!("Epoch: {} loss: {:5.3}", epoch, sum_loss / cnt_loss);
        println!("Sample: {}", sample(&data, &lstm, &linear, device));
    }
    vs.save(out)?;
    Ok(())
}

fn main() -> Result<()> {
    let args: Vec<String> = std::env::args().collect();
    tch::manual_seed(42); // reproducible: the tests compare runs bit for bit
    let epochs = args.get(4).map_or(Ok(2), |e| e.parse())?;
    train(&args[1], &args[2], &args[3], epochs)
}
