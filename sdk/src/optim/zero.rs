//! ZeRO stage 1: the optimizer's state sharded over the ranks. Every rank still holds
//! every parameter and gets every averaged gradient (DDP is unchanged). Each parameter
//! is cut on dim 0 as stages 2 and 3 cut it ([`crate::shard`]'s layout, `torch.chunk`'s
//! `ceil(rows / world_size)` rows a rank): each rank keeps the state of its rows of
//! every parameter and updates them, then every rank broadcasts its rows to the others.
//! Each rank holds exactly its `1/N` of the state (none past the last row), where
//! `ZeroRedundancyOptimizer` deals whole parameters out.

use tch::Tensor;

use crate::error::Result;
use crate::init::Context;
use crate::shard::{layout, set_grad, Piece};

/// The bytes of one `broadcast_coalesced` buffer when the ranks send their updated
/// rows. c10d broadcasts rows that fill a buffer alone in place, without a copy;
/// smaller ones share a buffer this big. At 1 MiB the copies stay small beside a
/// model's memory.
const BROADCAST_BYTES: usize = 1 << 20;

/// How the parameters are cut over the ranks, and the job it is for.
pub(crate) struct Zero {
    ctx: Context,
    /// Per parameter (in the optimizer's order), its rows on each rank.
    pieces: Vec<Piece>,
}

impl Zero {
    pub fn new(ctx: Context) -> Zero {
        Zero {
            ctx,
            pieces: Vec::new(),
        }
    }

    /// This rank and the world size.
    pub fn rank_and_world_size(&self) -> (usize, usize) {
        (self.ctx.rank(), self.ctx.world_size())
    }

    /// How many parameters are cut (the first ones of the optimizer's).
    pub fn cut(&self) -> usize {
        self.pieces.len()
    }

    /// Cuts the parameters that are not cut yet (those added since), on dim 0.
    pub fn partition(&mut self, params: &[Tensor]) {
        let shapes: Vec<Vec<i64>> = params[self.pieces.len().min(params.len())..]
            .iter()
            .map(Tensor::size)
            .collect();
        let (pieces, _) = layout::layout(&shapes, self.ctx.world_size());
        self.pieces.extend(pieces);
    }

    /// Rank `rank`'s rows of `full` (parameter `i`'s shape), a view in that shape with
    /// fewer rows; `None` when the rank holds none of them.
    fn rows_of(&self, i: usize, full: &Tensor, rank: usize) -> Option<Tensor> {
        let piece = &self.pieces[i];
        let rows = piece.rows_in_full(full, rank)?;
        let mut shape = piece.chunk_shape();
        shape[0] = rows.size()[0];
        Some(rows.view(shape.as_slice()))
    }

    /// This rank's rows of `full`, a tensor of parameter `i`'s shape (its state, say);
    /// `None` when this rank holds none of them.
    pub fn rows(&self, i: usize, full: &Tensor) -> Option<Tensor> {
        self.rows_of(i, full, self.ctx.rank())
    }

    /// What the step updates: per parameter, this rank's rows of it with the rows of
    /// its gradient as `.grad` (views: the step writes into the parameter), or `None`
    /// where this rank holds no rows.
    pub fn views(&self, params: &[Tensor]) -> Result<Vec<Option<Tensor>>> {
        params
            .iter()
            .enumerate()
            .map(|(i, p)| {
                let Some(view) = self.rows(i, &p.detach()) else {
                    return Ok(None);
                };
                let grad = p.grad();
                if grad.defined() {
                    set_grad(
                        &view,
                        &self.rows(i, &grad).expect("a gradient of the same rows"),
                    )?;
                }
                Ok(Some(view))
            })
            .collect()
    }

    /// Every rank broadcasts its updated rows to the others (one `broadcast_coalesced`
    /// per rank, in place); frozen variables (`requires_grad` off) are left out.
    ///
    /// # Errors
    /// [`Error::Collective`](crate::Error::Collective) when a broadcast
    /// fails.
    pub fn share(&self, params: &[Tensor]) -> Result<()> {
        let pg = self.ctx.process_group();
        for rank in 0..self.ctx.world_size() {
            let rows: Vec<Tensor> = params
                .iter()
                .enumerate()
                // Frozen variables never change: nothing of theirs to send.
                .filter(|(_, p)| p.requires_grad())
                .filter_map(|(i, p)| self.rows_of(i, &p.detach(), rank))
                .collect();
            if !rows.is_empty() {
                pg.broadcast_coalesced(&rows, BROADCAST_BYTES, rank)?;
            }
        }
        Ok(())
    }
}
