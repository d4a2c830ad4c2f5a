//! ZeRO stage 1: the optimizer's state sharded over the ranks, with the semantics of
//! PyTorch's `torch.distributed.optim.ZeroRedundancyOptimizer`. Every rank still holds
//! every parameter and gets every averaged gradient (DDP is unchanged); each rank keeps
//! the state of, and updates, only the parameters it owns, then the owners broadcast
//! the updated parameters to every rank.

use tch::Tensor;

use crate::error::Result;
use crate::init::Context;

/// The bytes of one `broadcast_coalesced` buffer when the owners send their updated
/// parameters (DDP's default bucket size).
const BROADCAST_BYTES: usize = 25 << 20;

/// Which rank owns each parameter, and the job it is sharded over.
pub(crate) struct Zero {
    ctx: Context,
    /// `owner[i]`: the rank that keeps parameter `i`'s state and updates it.
    owner: Vec<usize>,
}

impl Zero {
    pub fn new(ctx: Context) -> Zero {
        Zero {
            ctx,
            owner: Vec::new(),
        }
    }

    /// This rank.
    pub fn rank(&self) -> usize {
        self.ctx.rank()
    }

    /// Partitions the parameters over the ranks as `ZeroRedundancyOptimizer` does:
    /// group after group, each group's parameters largest first (in their order among
    /// equals), each to the rank whose parameters hold the fewest elements so far (the
    /// lowest such rank). `groups[g]` lists group `g`'s parameters (places in the
    /// optimizer), `params` the tensors.
    pub fn partition(&mut self, params: &[Tensor], groups: &[Vec<usize>]) {
        let world = self.ctx.world_size();
        let mut sizes = vec![0usize; world];
        let mut owner = vec![0; params.len()];
        for members in groups {
            let mut sorted = members.clone();
            // A stable sort: equals keep their order, as Python's `sorted`.
            sorted.sort_by_key(|&i| std::cmp::Reverse(params[i].numel()));
            for i in sorted {
                let rank = (0..world).min_by_key(|&r| (sizes[r], r)).unwrap_or(0);
                owner[i] = rank;
                sizes[rank] += params[i].numel();
            }
        }
        self.owner = owner;
    }

    /// Whether this rank owns each parameter.
    pub fn owned(&self) -> Vec<bool> {
        let rank = self.rank();
        self.owner.iter().map(|&r| r == rank).collect()
    }

    /// The owners broadcast their parameters to every rank (one `broadcast_coalesced`
    /// per rank), after they updated them.
    ///
    /// Errors with [`Error::Collective`](crate::Error::Collective) when a broadcast
    /// fails.
    pub fn share(&self, params: &[Tensor]) -> Result<()> {
        let pg = self.ctx.process_group();
        for rank in 0..self.ctx.world_size() {
            let mine: Vec<Tensor> = params
                .iter()
                .zip(&self.owner)
                .filter(|(_, &r)| r == rank)
                .map(|(p, _)| p.shallow_clone())
                .collect();
            if !mine.is_empty() {
                pg.broadcast_coalesced(&mine, BROADCAST_BYTES, rank)?;
            }
        }
        Ok(())
    }
}
