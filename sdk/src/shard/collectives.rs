//! The collectives of the sharded parameters, as FSDP2's `_fsdp_collectives`: the
//! gradient buckets, the one order every rank reduce-scatters them in, the
//! reduce-scatter of a bucket into its gradient shard, the agreement on which members
//! had a gradient, and the bucket cap. A unit's all-gathers are its own
//! (`param_group`).

use std::sync::Mutex;

use tch::{Kind, Tensor};

use super::hooks;
use super::layout::Piece;
use crate::error::Result;
use crate::process_group::{ProcessGroup, ReduceOp};

/// The reduce-scatters of a cycle run in one fixed order on every rank: the declared
/// units' buckets from the last unit to the first (the order of a backward pass when
/// they were declared in the forward's order), then the root's, from its last
/// parameters to its first, as the Reducer launches its buckets in order. A bucket
/// complete early (all its gradients accumulated) waits for those before it, so that
/// a bucket that is complete on one rank and not on another (a member without a
/// gradient there) cannot pair one rank's collective with another bucket's: the
/// incomplete ones run at the step, in the same order.
pub(super) struct Order {
    /// How many buckets of the order were reduce-scattered in this cycle (all of them
    /// once the gradients are finished, until the step is over).
    pub(super) next: usize,
    /// The buckets whose gradients were all accumulated in this cycle.
    pub(super) complete: Vec<bool>,
    /// Whether the cycle's gradients are finished: every bucket reduce-scattered and
    /// the members with a gradient agreed on ([`agree_used`]), until the step is over.
    pub(super) finished: bool,
}

/// Trainable parameters whose gradients are reduce-scattered together.
pub(super) struct Bucket {
    /// The unit of its members.
    pub(super) unit: usize,
    /// Its parameters (places in the optimizer), their places in `grad`, and their
    /// chunks of their unit's shard (what the optimizer steps).
    pub(super) members: Vec<usize>,
    pub(super) pieces: Vec<Piece>,
    pub(super) views: Vec<Tensor>,
    /// This rank's gradient chunks of the members, one after another (the
    /// reduce-scatter's output).
    pub(super) grad: Tensor,
    /// Per member, its chunk of `grad` in the member's shape with `chunk_rows` rows;
    /// the `.grad` of its view, or none in a cycle where no rank had a gradient for it
    /// (see [`agree_used`]).
    pub(super) grads: Vec<Tensor>,
    /// Per member, whether this backward pass accumulated its gradient.
    pub(super) ready: Vec<bool>,
    /// Per member, whether this rank had a gradient for it when the bucket was last
    /// reduce-scattered (the Reducer's `local_used_map`).
    pub(super) used: Vec<bool>,
}

/// Reduce-scatters (averages) the bucket's full gradients into `out` (its gradient
/// shard, or a tensor of its shape on the parameters' device), one collective; each full gradient is dropped once copied into the collective's
/// buffer, and whether this rank had it is kept for [`agree_used`]. A member without
/// a gradient here counts as zero, as DDP's `find_unused_parameters`.
pub(super) fn reduce_scatter(
    group: &ProcessGroup,
    params: &[Tensor],
    bucket: &mut Bucket,
    out: &Tensor,
) -> Result<()> {
    let world = group.world_size();
    let len = out.numel() as i64;
    // Only the padding, and the pieces of members without a gradient, are zeroed:
    // the rest is written below.
    let buffer = out.new_empty([world as i64 * len], (out.kind(), out.device()));
    let chunks: Vec<Tensor> = (0..world)
        .map(|r| buffer.narrow(0, r as i64 * len, len))
        .collect();
    tch::no_grad(|| -> Result<()> {
        let Bucket {
            members,
            pieces,
            used,
            ..
        } = &mut *bucket;
        for ((&i, piece), used) in members.iter().zip(pieces.iter()).zip(used.iter_mut()) {
            let g = params[i].grad();
            *used = g.defined();
            for (r, chunk) in chunks.iter().enumerate() {
                let (_, rows) = piece.rows_of(r);
                let written = if g.defined() { rows * piece.row_len } else { 0 };
                let mut padding =
                    chunk.narrow(0, piece.offset + written, piece.chunk_len() - written);
                let _ = padding.zero_();
                let src = g.defined().then(|| piece.rows_in_full(&g, r)).flatten();
                if let Some(src) = src {
                    piece.rows_in_shard(chunk, r).expect("rows").copy_(&src);
                }
            }
            drop(g);
            hooks::clear_grad(&params[i])?;
        }
        Ok(())
    })?;
    group.reduce_scatter_into(out, &chunks, ReduceOp::Avg)
}

/// After a cycle's reduce-scatters, which members some rank had a gradient for: one
/// all-reduce (max) of every bucket's `used` flags, as the Reducer's
/// `local_used_map`. Their shards get their gradient chunk as `.grad`; the others
/// none for this step, so that the optimizer skips them, as DDP leaves an unused
/// variable's gradient undefined. The flags are all-reduced on `device`, the
/// parameters'.
///
/// # Errors
/// [`Error::Collective`](crate::Error::Collective) when the all-reduce fails;
/// [`Error::Torch`](crate::Error::Torch) when a gradient cannot be set.
pub(super) fn agree_used(
    group: &ProcessGroup,
    buckets: &[Mutex<Bucket>],
    device: tch::Device,
) -> Result<()> {
    let mut buckets: Vec<_> = buckets
        .iter()
        .map(|b| b.lock().expect("bucket lock"))
        .collect();
    if buckets.is_empty() {
        return Ok(());
    }
    let local: Vec<f32> = buckets
        .iter()
        .flat_map(|b| b.used.iter().map(|&u| f32::from(u8::from(u))))
        .collect();
    let mut used = Tensor::from_slice(&local).to_device(device);
    group.all_reduce(&mut used, ReduceOp::Max)?;
    let mut used = Vec::<f32>::try_from(used.to_kind(Kind::Float))?.into_iter();
    for bucket in &mut buckets {
        for (view, grad) in bucket.views.iter().zip(&bucket.grads) {
            match used.next().is_some_and(|u| u > 0.0) {
                true => hooks::set_grad(view, grad)?,
                false => hooks::clear_grad(view)?,
            }
        }
    }
    Ok(())
}
