//! What ranks that take different paths agree on, in the loops `#[distributed]`
//! shards: an exit one rank takes (`agree_exit`), and the end of a loop whose
//! adaptors keep a number of batches of their own (`agreed_ends`). Each is one
//! all-reduce of one number, at a point every rank reaches; loops that need neither
//! get neither.

use crate::init;
use crate::ReduceOp;

use super::fail;

/// The exit every rank takes after a statement of a sharded loop: `taken`, the exit
/// this rank took in it (its number among the statement's exits, whose
/// `priorities` say which wins: a `return` (3) over a `break` to an outer loop (2)
/// over a `break` (1) over a `continue` (0), the first written among equals), or
/// `None`. Every rank gets the same answer: the winning exit of any rank, else
/// `None`. As Accelerate's `set_trigger`/`check_trigger`, written by the macro.
pub fn agree_exit(taken: Option<u32>, priorities: &[u8]) -> Option<u32> {
    // The priority above the exit's number, reversed (the first written wins among
    // equals); 0 for none.
    let score = |k: u32| ((priorities[k as usize] as i64 + 1) << 32) | (u32::MAX - k) as i64;
    let mine = taken.map_or(0, score);
    let best = init::all_reduce_scalar(mine, ReduceOp::Max)
        .unwrap_or_else(|e| fail("agreeing on a loop's exit with the other ranks", e));
    (best != 0).then(|| u32::MAX - (best & 0xffff_ffff) as u32)
}

#[cfg(test)]
mod tests {
    #[test]
    fn one_process_takes_its_own_exit() {
        assert_eq!(super::agree_exit(None, &[1, 0]), None);
        assert_eq!(super::agree_exit(Some(0), &[1, 0]), Some(0));
        assert_eq!(super::agree_exit(Some(1), &[1, 0]), Some(1));
    }
}

/// `iter`, ended on every rank when the first runs out: see [`AgreedEnds`].
pub fn agreed_ends<I: IntoIterator>(iter: I) -> AgreedEnds<I::IntoIter> {
    AgreedEnds {
        inner: iter.into_iter(),
        steps: 0,
        ended: false,
    }
}

/// A sharded loop's iterator behind an adaptor that keeps a number of batches of its
/// own (`filter`, `take_while`, `flat_map`, …), whose ranks may run out at different
/// steps: before each step, the ranks agree whether every one has a batch (one
/// all-reduce); at the first that has none, every rank stops. The batches the others
/// still had are dropped, and rank 0 says how many. Stopping together, rather than
/// PyTorch's `Join` (where the ranks that ran out shadow the others' gradient
/// all-reduces with zeros), works whatever else the loop's body does together (a
/// metric's all-reduce, a checkpoint's barrier), which `Join` would have to know of.
pub struct AgreedEnds<I> {
    inner: I,
    /// Steps every rank has taken.
    steps: u64,
    ended: bool,
}

impl<I: Iterator> Iterator for AgreedEnds<I> {
    type Item = I::Item;

    fn next(&mut self) -> Option<I::Item> {
        if self.ended {
            return None;
        }
        let item = self.inner.next();
        let every = init::all_reduce_scalar(item.is_some() as i64, ReduceOp::Min)
            .unwrap_or_else(|e| fail("agreeing with the other ranks on a loop's end", e));
        if every == 1 {
            self.steps += 1;
            return item;
        }
        self.ended = true;
        // What this rank still had, counted over the ranks once all are here.
        let left = match item {
            Some(_) => 1 + self.inner.by_ref().count() as i64,
            None => 0,
        };
        let dropped = init::all_reduce_scalar(left, ReduceOp::Sum)
            .unwrap_or_else(|e| fail("counting a loop's dropped batches", e));
        if dropped > 0 && init::current().is_some_and(|c| c.is_main_process()) {
            crate::log::warn(format_args!(
                "a sharded loop ran out of batches on some ranks after {} steps (an adaptor \
                 such as `filter` kept different numbers on different ranks): every rank \
                 stopped with the first, and the other ranks' {dropped} remaining batches were \
                 dropped. To train on them, filter the data before it is sharded (e.g. in the \
                 dataset), so that every rank gets the same number",
                self.steps
            ));
        }
        None
    }
}
