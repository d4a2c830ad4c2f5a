//! Global and per-rank batch sizes, and learning-rate scaling.

use crate::error::{Error, Result};

/// The per-rank batch size for a global batch of `global` samples per step over
/// `world_size` ranks: `global / world_size`.
///
/// # Errors
/// [`Error::Config`] when `world_size` is 0 or `global` does not divide by
/// it (the message gives the nearest global batch sizes that do).
pub fn per_rank_batch_size(global: usize, world_size: usize) -> Result<usize> {
    if world_size == 0 {
        return Err(Error::Config("the world size must be at least 1".into()));
    }
    if global == 0 || global.checked_rem(world_size) != Some(0) {
        let below = global / world_size * world_size;
        let above = below + world_size;
        return Err(Error::Config(format!(
            "a global batch of {global} samples does not divide over {world_size} ranks: use a multiple of {world_size} ({}{above}), or set the per-rank batch size instead",
            if below > 0 { format!("{below} or ") } else { String::new() }
        )));
    }
    Ok(global / world_size)
}

/// The global batch size, samples per optimizer step over all ranks:
/// `per_rank * world_size * accumulation_steps`.
pub fn global_batch_size(per_rank: usize, world_size: usize, accumulation_steps: usize) -> usize {
    per_rank * world_size * accumulation_steps
}

/// How to scale a learning rate tuned at one global batch size for another.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum LrScaling {
    /// `lr × k` for a batch `k` times larger: the linear scaling rule of Goyal et al.,
    /// "Accurate, Large Minibatch SGD: Training ImageNet in 1 Hour" (2017,
    /// arXiv:1706.02677), for SGD, usually with a warm-up; also what Accelerate's
    /// guide suggests when the number of processes multiplies the batch.
    Linear,
    /// `lr × √k`: Krizhevsky, "One weird trick for parallelizing convolutional neural
    /// networks" (2014, arXiv:1404.5997), and for Adam-style optimizers Malladi et
    /// al., "On the SDEs and Scaling Rules for Adaptive Gradient Algorithms" (2022,
    /// arXiv:2205.10287).
    Sqrt,
}

impl LrScaling {
    /// `base_lr`, tuned at a global batch of `base_batch` samples, scaled for a global
    /// batch of `batch` samples.
    ///
    /// # Errors
    /// [`Error::Config`] when either batch size is 0.
    pub fn scale(self, base_lr: f64, base_batch: usize, batch: usize) -> Result<f64> {
        if base_batch == 0 || batch == 0 {
            return Err(Error::Config(
                "learning-rate scaling needs batch sizes of at least 1".into(),
            ));
        }
        let k = batch as f64 / base_batch as f64;
        Ok(match self {
            LrScaling::Linear => base_lr * k,
            LrScaling::Sqrt => base_lr * k.sqrt(),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn batch_sizes() {
        assert_eq!(per_rank_batch_size(256, 8).unwrap(), 32);
        let e = per_rank_batch_size(100, 8).unwrap_err().to_string();
        assert!(e.contains("96 or 104"), "{e}");
        assert!(per_rank_batch_size(4, 0).is_err());
        assert_eq!(global_batch_size(32, 8, 2), 512);
    }

    #[test]
    fn lr_scaling() {
        assert_eq!(LrScaling::Linear.scale(0.1, 256, 1024).unwrap(), 0.4);
        assert_eq!(LrScaling::Sqrt.scale(1e-3, 64, 256).unwrap(), 2e-3);
        assert!(LrScaling::Sqrt.scale(1e-3, 0, 256).is_err());
    }
}
