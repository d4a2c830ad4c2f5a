//! Map-style datasets and the batches they make.

use tch::{Device, Kind, Tensor};

use crate::error::{Error, Result};

/// A map-style dataset, as PyTorch's `torch.utils.data.Dataset`: `len()` samples, read
/// by index. A [`DataLoader`](crate::DataLoader) reads it from worker threads, each with
/// its own clone, so cloning should be cheap (share the data: `Tensor::shallow_clone`,
/// `Arc`).
pub trait Dataset: Clone + Send + 'static {
    /// One sample; [`Batch::collate`] stacks samples into a batch of the same type.
    type Item: Batch;

    /// The number of samples.
    fn len(&self) -> usize;

    /// Whether the dataset has no samples.
    fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Sample `index` (`index < len()`).
    ///
    /// # Errors
    /// Whatever reading the sample can fail with (a missing file, bad data).
    fn get(&self, index: usize) -> Result<Self::Item>;

    /// The samples at `indices` as one batch, leading dimension `indices.len()`. By
    /// default `get` each one and [`Batch::collate`] them; in-memory datasets read the
    /// whole batch with one `index_select` instead.
    ///
    /// # Errors
    /// What [`get`](Self::get) or [`Batch::collate`] fails with (a missing file, bad data, samples of different shapes).
    fn get_batch(&self, indices: &[usize]) -> Result<Self::Item> {
        let samples = indices
            .iter()
            .map(|&i| self.get(i))
            .collect::<Result<Vec<_>>>()?;
        Self::Item::collate(samples)
    }
}

/// A sample or a batch: one tensor or a tuple of them, stacked along a new leading
/// (batch) dimension.
pub trait Batch: Send + Sized + 'static {
    /// Stacks samples of equal shapes into a batch ([`Tensor::stack`] along dim 0).
    ///
    /// # Errors
    /// [`Error::Torch`] when the samples' shapes differ.
    fn collate(samples: Vec<Self>) -> Result<Self>;

    /// Applies `f` to every tensor (moving a batch to a device, pinning it).
    fn map_tensors(self, f: &mut impl FnMut(Tensor) -> Tensor) -> Self;

    /// The batch's size: its first tensor's leading dimension.
    fn rows(&self) -> i64;
}

fn stack(tensors: Vec<Tensor>) -> Result<Tensor> {
    Ok(Tensor::f_stack(&tensors, 0)?)
}

impl Batch for Tensor {
    fn collate(samples: Vec<Self>) -> Result<Self> {
        stack(samples)
    }
    fn map_tensors(self, f: &mut impl FnMut(Tensor) -> Tensor) -> Self {
        f(self)
    }
    fn rows(&self) -> i64 {
        self.size().first().copied().unwrap_or(1)
    }
}

impl Batch for (Tensor, Tensor) {
    fn collate(samples: Vec<Self>) -> Result<Self> {
        let (xs, ys): (Vec<_>, Vec<_>) = samples.into_iter().unzip();
        Ok((stack(xs)?, stack(ys)?))
    }
    fn map_tensors(self, f: &mut impl FnMut(Tensor) -> Tensor) -> Self {
        (f(self.0), f(self.1))
    }
    fn rows(&self) -> i64 {
        self.0.rows()
    }
}

/// Samples held in memory as tensors whose leading dimension indexes the samples, as
/// PyTorch's `TensorDataset`: sample `i` is `(xs[i], ys[i])`, and a batch is one
/// `index_select` on each.
#[derive(Debug)]
pub struct TensorDataset {
    xs: Tensor,
    ys: Tensor,
}

impl TensorDataset {
    /// `xs`: [n, …] inputs, `ys`: [n, …] targets.
    ///
    /// # Errors
    /// [`Error::InvalidInput`] when their leading dimensions differ.
    pub fn new(xs: &Tensor, ys: &Tensor) -> Result<Self> {
        let (n, m) = (xs.size().first().copied(), ys.size().first().copied());
        if n.is_none() || n != m {
            return Err(Error::InvalidInput(format!(
                "TensorDataset: inputs {:?} and targets {:?} need the same leading (sample) dimension",
                xs.size(),
                ys.size()
            )));
        }
        Ok(TensorDataset {
            xs: xs.shallow_clone(),
            ys: ys.shallow_clone(),
        })
    }

    /// The training split of a `tch::vision` dataset (MNIST, CIFAR-10, …).
    ///
    /// # Errors
    /// As [`TensorDataset::new`]: [`Error::InvalidInput`] when the images and labels differ in length.
    pub fn train(dataset: &tch::vision::dataset::Dataset) -> Result<Self> {
        Self::new(&dataset.train_images, &dataset.train_labels)
    }

    /// The test split of a `tch::vision` dataset.
    ///
    /// # Errors
    /// As [`TensorDataset::new`]: [`Error::InvalidInput`] when the images and labels differ in length.
    pub fn test(dataset: &tch::vision::dataset::Dataset) -> Result<Self> {
        Self::new(&dataset.test_images, &dataset.test_labels)
    }
}

impl Clone for TensorDataset {
    /// Shares the tensors' storage.
    fn clone(&self) -> Self {
        TensorDataset {
            xs: self.xs.shallow_clone(),
            ys: self.ys.shallow_clone(),
        }
    }
}

fn index_tensor(indices: &[usize], device: Device) -> Tensor {
    let indices: Vec<i64> = indices.iter().map(|&i| i as i64).collect();
    Tensor::from_slice(&indices).to_device(device)
}

impl Dataset for TensorDataset {
    type Item = (Tensor, Tensor);
    fn len(&self) -> usize {
        self.xs.size()[0] as usize
    }
    fn get(&self, index: usize) -> Result<Self::Item> {
        Ok((self.xs.f_get(index as i64)?, self.ys.f_get(index as i64)?))
    }
    fn get_batch(&self, indices: &[usize]) -> Result<Self::Item> {
        let index = index_tensor(indices, self.xs.device());
        Ok((
            self.xs.f_index_select(0, &index)?,
            self.ys.f_index_select(0, &index)?,
        ))
    }
}

/// Every window of `seq_len + 1` consecutive labels of a `tch::data::TextData`, as the
/// sequences `TextData::iter_shuffle` draws: sample `i` is the int64 labels at
/// positions `i ..= i + seq_len` (inputs are the first `seq_len`, targets the last).
#[derive(Debug)]
pub struct TextDataset {
    data: Tensor,
    seq_len: usize,
}

impl TextDataset {
    /// Windows of `seq_len + 1` labels over `text`.
    ///
    /// # Errors
    /// [`Error::InvalidInput`] when the text is not longer than `seq_len`.
    pub fn new(text: &tch::data::TextData, seq_len: usize) -> Result<Self> {
        let data = text.data().to_kind(Kind::Int64);
        if data.size()[0] <= seq_len as i64 {
            return Err(Error::InvalidInput(format!(
                "TextDataset: the text has {} characters, not more than the sequence length {seq_len}: use a longer text or a shorter sequence",
                data.size()[0]
            )));
        }
        Ok(TextDataset { data, seq_len })
    }
}

impl Clone for TextDataset {
    /// Shares the text's storage.
    fn clone(&self) -> Self {
        TextDataset {
            data: self.data.shallow_clone(),
            seq_len: self.seq_len,
        }
    }
}

impl Dataset for TextDataset {
    type Item = Tensor;
    fn len(&self) -> usize {
        self.data.size()[0] as usize - self.seq_len
    }
    fn get(&self, index: usize) -> Result<Tensor> {
        Ok(self
            .data
            .f_narrow(0, index as i64, self.seq_len as i64 + 1)?)
    }
    fn get_batch(&self, indices: &[usize]) -> Result<Tensor> {
        // [batch, seq_len + 1] positions, gathered at once.
        let starts = index_tensor(indices, Device::Cpu).unsqueeze(1);
        let offsets = Tensor::arange(self.seq_len as i64 + 1, (Kind::Int64, Device::Cpu));
        Ok(self.data.f_take(&(starts + offsets.unsqueeze(0)))?)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn batches_equal_collated_samples() {
        let xs = Tensor::arange(20, (Kind::Float, Device::Cpu)).view([10, 2]);
        let ys = Tensor::arange(10, (Kind::Int64, Device::Cpu));
        let ds = TensorDataset::new(&xs, &ys).unwrap();
        let indices = [7, 0, 3];
        let (bx, by) = ds.get_batch(&indices).unwrap();
        let samples: Vec<_> = indices.iter().map(|&i| ds.get(i).unwrap()).collect();
        let (cx, cy) = <(Tensor, Tensor)>::collate(samples).unwrap();
        assert!(bx.equal(&cx) && by.equal(&cy));
        assert_eq!(Vec::<i64>::try_from(&by).unwrap(), [7, 0, 3]);
        assert!(TensorDataset::new(&xs, &ys.narrow(0, 0, 9)).is_err());
    }

    #[test]
    fn text_windows() {
        let dir = std::env::temp_dir().join(format!("tchd-text-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("t.txt");
        std::fs::write(&path, "abcdefgh").unwrap();
        let text = tch::data::TextData::new(&path).unwrap();
        let ds = TextDataset::new(&text, 3).unwrap();
        assert_eq!(ds.len(), 5);
        let batch = ds.get_batch(&[0, 4]).unwrap();
        assert_eq!(batch.size(), [2, 4]);
        assert!(batch.get(1).equal(&ds.get(4).unwrap()));
        assert!(TextDataset::new(&text, 8).is_err());
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
