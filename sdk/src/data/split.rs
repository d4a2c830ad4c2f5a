//! Distributed inference: a list of inputs split between the ranks, each rank working on
//! its own contiguous part, and the results gathered back on every rank in the inputs'
//! order, as Accelerate's `split_between_processes` followed by `gather_object`.

use serde::de::DeserializeOwned;
use serde::Serialize;
use tch::Tensor;

use crate::error::{Error, Result};
use crate::init;
use crate::process_group::ProcessGroup;

/// Splits `items` between the ranks of the current job, runs `f` on this rank's part,
/// and returns every rank's results, in the order of `items`, on every rank.
///
/// The split is contiguous, as Accelerate's `split_between_processes`: with `n` items
/// and `w` ranks, rank `r` gets `n / w` items, one more when `r < n % w`, starting
/// where rank `r - 1`'s end (10 items on 3 ranks: `0..4`, `4..7`, `7..10`). A rank
/// may get none (fewer items than ranks). `f` must return one result per item it was
/// given (a `Vec` of one entry per item, or a tensor of one row per item on dim 0);
/// the results come back concatenated rank by rank, so entry `i` is item `i`'s,
/// exactly as `f(items)` in one process would give them.
///
/// ```no_run
/// # fn main() -> anyhow::Result<()> {
/// let _ctx = tch_distributed::init()?;
/// let prompts = vec!["a".to_string(), "bb".into(), "ccc".into()];
/// // Every rank: the lengths of all three, computed a part per rank.
/// let lengths: Vec<usize> =
///     tch_distributed::split_between_processes(&prompts, |mine| {
///         mine.iter().map(|p| p.len()).collect()
///     })?;
/// assert_eq!(lengths, [1, 2, 3]);
/// # Ok(()) }
/// ```
///
/// What `items` can be ([`Splittable`]): a slice or `&Vec` of `Clone` items (the part
/// is a `Vec` of them), or a `&Tensor` split on dim 0 (the part is a tensor of those
/// rows). What `f` can return ([`Gatherable`]): a `Vec` of `serde` values (sent as
/// JSON, through CPU tensors), or a tensor with one row per item (gathered on its
/// device: NCCL's all-gather on CUDA, Gloo's on the CPU).
///
/// Every rank must call it, with the same number of items: the gather is a
/// collective. When `f` itself runs collectives (a model under ZeRO-3 gathers its
/// units in every forward pass), every rank must run it equally often: use
/// [`split_between_processes_padded`]. With one process, or before the job is
/// joined, it returns `f(items)`.
///
/// # Errors
/// - [`Error::Usage`], on every rank alike, when a rank's `f` returned a different
///   number of results than items, or tensors whose dtype or shape past dim 0 differ
///   between the ranks;
/// - [`Error::Collective`] or [`Error::Timeout`] when the gather fails (a rank died,
///   or one never reached it: a rank that panics in `f` leaves the others waiting
///   for the collective timeout).
pub fn split_between_processes<I, R>(items: I, f: impl FnOnce(I::Part) -> R) -> Result<R>
where
    I: Splittable,
    R: Gatherable,
{
    split(items, false, f)
}

/// [`split_between_processes`] with every rank given the same number of items, as
/// Accelerate's `apply_padding=True`: a rank with fewer items than the first rank gets
/// the last item of `items` again until it has as many (10 items on 3 ranks: 4 each,
/// the last two ranks with item 9 once more). The gather drops the results of those
/// repeated items, so the result is the same as without padding: one entry per item,
/// none twice.
///
/// For an `f` that runs collectives, such as a forward pass through a model under
/// ZeRO-3, or batches of a fixed size: every rank runs `f` on equally many items.
///
/// # Errors
/// As [`split_between_processes`]; `f` must return one result per item given,
/// repeated items included.
pub fn split_between_processes_padded<I, R>(items: I, f: impl FnOnce(I::Part) -> R) -> Result<R>
where
    I: Splittable,
    R: Gatherable,
{
    split(items, true, f)
}

/// Inputs that [`split_between_processes`] can split: a number of items and a way to
/// take a contiguous run of them.
pub trait Splittable {
    /// One rank's part: what `f` is given.
    type Part;
    /// How many items there are.
    fn count(&self) -> usize;
    /// Items `start..start + len`, then the last item again until `padded` items
    /// (`padded >= len`; no repeats when `padded == len`).
    fn part(&self, start: usize, len: usize, padded: usize) -> Self::Part;
}

impl<T: Clone> Splittable for &[T] {
    type Part = Vec<T>;
    fn count(&self) -> usize {
        self.len()
    }
    fn part(&self, start: usize, len: usize, padded: usize) -> Vec<T> {
        let mut part = self[start..start + len].to_vec();
        if let Some(last) = self.last() {
            part.resize(padded, last.clone());
        }
        part
    }
}

impl<T: Clone> Splittable for &Vec<T> {
    type Part = Vec<T>;
    fn count(&self) -> usize {
        self.len()
    }
    fn part(&self, start: usize, len: usize, padded: usize) -> Vec<T> {
        self.as_slice().part(start, len, padded)
    }
}

/// Rows of a tensor (dim 0); the part is those rows, on the tensor's device.
impl Splittable for &Tensor {
    type Part = Tensor;
    fn count(&self) -> usize {
        self.size().first().map_or(0, |&n| n as usize)
    }
    fn part(&self, start: usize, len: usize, padded: usize) -> Tensor {
        let rows = self.narrow(0, start as i64, len as i64);
        if padded == len {
            return rows;
        }
        let last = self.narrow(0, self.count() as i64 - 1, 1);
        let repeats = last.expand(
            [&[(padded - len) as i64][..], &last.size()[1..]].concat(),
            false,
        );
        Tensor::cat(&[rows, repeats], 0)
    }
}

/// Results that [`split_between_processes`] can gather from every rank: one per item.
pub trait Gatherable: Sized {
    /// How many results there are (one per item); `None` for what has no items (a
    /// tensor of no dims).
    fn count(&self) -> Option<usize>;
    /// What must be the same on every rank for the gather to work, in words (a
    /// tensor's dtype and shape past dim 0; nothing for a `Vec`).
    fn layout(&self) -> String;
    /// Every rank's results over `group`, in rank order, each rank's first
    /// `lens[rank]` only (`lens`: the items each rank was given before padding).
    /// Called on every rank of a job of several, once `count` and `layout` were
    /// checked on all of them.
    ///
    /// # Errors
    /// [`Error::Collective`] when a gather fails; [`Error::Usage`] when a rank's results
    /// cannot be written or read back as this type.
    fn gather(self, group: &ProcessGroup, lens: &[usize]) -> Result<Self>;
}

/// `serde` values, sent as JSON through CPU tensors (Gloo, whatever the job's backend).
impl<T: Serialize + DeserializeOwned> Gatherable for Vec<T> {
    fn count(&self) -> Option<usize> {
        Some(self.len())
    }
    fn layout(&self) -> String {
        String::new()
    }
    fn gather(mut self, group: &ProcessGroup, lens: &[usize]) -> Result<Self> {
        self.truncate(lens[group.rank()]);
        let bytes = serde_json::to_vec(&self)
            .map_err(|e| Error::Usage(format!("split_between_processes: {e}")))?;
        let mut all = Vec::with_capacity(lens.iter().sum());
        for (r, bytes) in all_gather_bytes(group, &bytes)?.iter().enumerate() {
            let part: Vec<T> = serde_json::from_slice(bytes).map_err(|e| {
                Error::Usage(format!(
                    "split_between_processes: rank {r}'s results do not read back as this \
                     type: {e}"
                ))
            })?;
            all.extend(part);
        }
        Ok(all)
    }
}

/// One row per item (dim 0), gathered on the tensor's device: every rank's rows, padded
/// with zeros to the longest rank's for the all-gather, then cut back.
impl Gatherable for Tensor {
    fn count(&self) -> Option<usize> {
        self.size().first().map(|&n| n as usize)
    }
    fn layout(&self) -> String {
        format!("{:?} rows of {:?}", self.kind(), self.size().get(1..))
    }
    fn gather(self, group: &ProcessGroup, lens: &[usize]) -> Result<Self> {
        let rows = *lens.iter().max().unwrap_or(&0) as i64;
        let mine = self.narrow(0, 0, lens[group.rank()] as i64);
        let mut shape = self.size();
        shape[0] = rows - mine.size()[0];
        let zeros = Tensor::zeros(&shape, (self.kind(), self.device()));
        let parts = group.all_gather(&Tensor::cat(&[mine, zeros], 0))?;
        let parts: Vec<Tensor> = parts
            .iter()
            .zip(lens)
            .map(|(part, &len)| part.narrow(0, 0, len as i64))
            .collect();
        Ok(Tensor::cat(&parts, 0))
    }
}

/// A rank's header, sent before the gather: its result count (-1 for none), then its
/// layout hashed (FNV-1a), so that a layout of any length fits. One all-gather of a
/// fixed-size CPU tensor: every rank finds a mismatch before a collective of
/// mismatched sizes, which Gloo would abort on.
fn header<R: Gatherable>(results: &R) -> [i64; 2] {
    let layout = results
        .layout()
        .bytes()
        .fold(0xcbf2_9ce4_8422_2325_u64, |h, b| {
            (h ^ u64::from(b)).wrapping_mul(0x100_0000_01b3)
        });
    [results.count().map_or(-1, |n| n as i64), layout as i64]
}

fn split<I, R>(items: I, padding: bool, f: impl FnOnce(I::Part) -> R) -> Result<R>
where
    I: Splittable,
    R: Gatherable,
{
    let total = items.count();
    let ctx = init::current().filter(|c| c.world_size() > 1);
    let (rank, world_size) = ctx.as_ref().map_or((0, 1), |c| (c.rank(), c.world_size()));
    let parts: Vec<Part> = (0..world_size)
        .map(|r| Part::of(total, r, world_size, padding))
        .collect();
    let me = parts[rank];
    let results = f(items.part(me.start, me.len, me.padded));
    let mine = header(&results);
    let headers: Vec<[i64; 2]> = match &ctx {
        None => vec![mine],
        Some(ctx) => {
            let all = ctx.process_group().all_gather(&Tensor::from_slice(&mine))?;
            all.iter()
                .map(|t| [t.int64_value(&[0]), t.int64_value(&[1])])
                .collect()
        }
    };
    for (r, (h, part)) in headers.iter().zip(&parts).enumerate() {
        let on = if world_size > 1 {
            format!("on rank {r}, ")
        } else {
            String::new()
        };
        if h[0] != part.padded as i64 {
            let returned = match h[0] {
                -1 => "a tensor of no dims".to_string(),
                n => format!("{n} results"),
            };
            return Err(Error::Usage(format!(
                "split_between_processes: {on}the closure was given {} items and returned \
                 {returned}: return one result per item (a Vec entry, or a tensor row on \
                 dim 0), so that the gather can put them back in order",
                part.padded
            )));
        }
        if h[1] != headers[0][1] {
            return Err(Error::Usage(format!(
                "split_between_processes: rank {r} returned tensors of another dtype or \
                 shape past dim 0 than rank 0: return the same dtype and row shape on \
                 every rank{}",
                if r == rank {
                    format!(" (here: {})", results.layout())
                } else {
                    String::new()
                }
            )));
        }
    }
    match ctx {
        None => Ok(results),
        Some(ctx) => {
            let lens: Vec<usize> = parts.iter().map(|p| p.len).collect();
            results.gather(ctx.process_group(), &lens)
        }
    }
}

/// Where rank `r`'s items lie: `start..start + len`, given as `padded` items (the last
/// item repeated) when padding.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Part {
    start: usize,
    len: usize,
    padded: usize,
}

impl Part {
    /// Accelerate's split: `divmod(total, world_size)`, the remainder one each to the
    /// first ranks; padded to the first rank's count.
    fn of(total: usize, rank: usize, world_size: usize, padding: bool) -> Part {
        let (each, extra) = (total / world_size, total % world_size);
        let start = rank * each + rank.min(extra);
        let len = each + usize::from(rank < extra);
        let padded = if padding && total > 0 {
            each + usize::from(extra > 0)
        } else {
            len
        };
        Part { start, len, padded }
    }
}

/// Every rank's `bytes`, in rank order: their lengths first, then the bytes padded to
/// the longest (two all-gathers of CPU tensors).
fn all_gather_bytes(group: &ProcessGroup, bytes: &[u8]) -> Result<Vec<Vec<u8>>> {
    let lens = group.all_gather(&Tensor::from_slice(&[bytes.len() as i64]))?;
    let lens: Vec<usize> = lens.iter().map(|t| t.int64_value(&[0]) as usize).collect();
    let longest = *lens.iter().max().unwrap_or(&0);
    let mut padded = bytes.to_vec();
    padded.resize(longest, 0);
    let parts = group.all_gather(&Tensor::from_slice(&padded))?;
    Ok(parts
        .iter()
        .zip(lens)
        .map(|(t, len)| {
            let mut v = vec![0u8; longest];
            t.copy_data(&mut v, longest);
            v.truncate(len);
            v
        })
        .collect())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Accelerate's split, worked by hand: 10 items on 3 ranks.
    #[test]
    fn parts_are_contiguous_with_the_remainder_to_the_first_ranks() {
        let parts: Vec<_> = (0..3).map(|r| Part::of(10, r, 3, false)).collect();
        let ranges: Vec<_> = parts.iter().map(|p| (p.start, p.len, p.padded)).collect();
        assert_eq!(ranges, [(0, 4, 4), (4, 3, 3), (7, 3, 3)]);
        let padded: Vec<_> = (0..3).map(|r| Part::of(10, r, 3, true).padded).collect();
        assert_eq!(padded, [4, 4, 4]);
        // Fewer items than ranks: the last ranks get none, or the last item padded.
        let few: Vec<_> = (0..4).map(|r| Part::of(2, r, 4, false)).collect();
        assert_eq!(few.iter().map(|p| p.len).collect::<Vec<_>>(), [1, 1, 0, 0]);
        assert_eq!(few[3].start, 2);
        assert_eq!(Part::of(2, 3, 4, true).padded, 1);
        assert_eq!(Part::of(0, 1, 4, true).padded, 0);
        // Every split covers the items once, in order.
        for total in 0..20 {
            for world in 1..6 {
                let mut next = 0;
                for r in 0..world {
                    let p = Part::of(total, r, world, false);
                    assert_eq!(p.start, next);
                    next += p.len;
                }
                assert_eq!(next, total);
            }
        }
    }

    #[test]
    fn a_padded_part_repeats_the_last_item() {
        let items: Vec<u32> = (0..10).collect();
        assert_eq!((&items).part(7, 3, 4), [7, 8, 9, 9]);
        assert_eq!((&items[..]).part(10, 0, 1), [9]);
        let rows = Tensor::arange(6, (tch::Kind::Int64, tch::Device::Cpu)).view([3, 2]);
        let part = (&rows).part(2, 1, 3);
        assert_eq!(
            Vec::<i64>::try_from(part.view([-1])).unwrap(),
            [4, 5, 4, 5, 4, 5]
        );
    }

    /// One process: `f` on every item, and the count checked.
    #[test]
    fn one_process_runs_f_on_everything() {
        let items = vec!["a", "bb", "ccc"];
        let lens: Vec<usize> =
            split_between_processes(&items, |mine| mine.iter().map(|s| s.len()).collect()).unwrap();
        assert_eq!(lens, [1, 2, 3]);
        let doubled =
            split_between_processes_padded(&Tensor::from_slice(&[1.0f32, 2.0]), |t| t * 2).unwrap();
        assert_eq!(Vec::<f32>::try_from(doubled).unwrap(), [2.0, 4.0]);
        let err = split_between_processes(&items, |_| vec![0u8]).unwrap_err();
        assert!(
            err.to_string()
                .contains("the closure was given 3 items and returned 1 results"),
            "{err}"
        );
        let err = split_between_processes(&items, |_| Tensor::from(1.0)).unwrap_err();
        assert!(
            err.to_string().contains("returned a tensor of no dims"),
            "{err}"
        );
    }
}
