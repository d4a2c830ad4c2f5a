//! One sharded parameter, as FSDP2's `FSDPParam`: the variable (whole, its memory
//! freed while its unit is resharded), its place in its unit's flat shard, and its
//! chunk of that shard (what the optimizer steps). It moves its own rows: into the
//! shard ([`cut`](FsdpParam::cut)), out of an all-gather's output
//! ([`copy_out`](FsdpParam::copy_out)), and frees its memory
//! ([`free_unsharded`](FsdpParam::free_unsharded)).

use tch::Tensor;

use super::hooks;
use super::layout::Piece;
use crate::error::Result;

/// One member of a unit (see the module's documentation).
pub(crate) struct FsdpParam {
    /// Its name in the `VarStore`.
    pub name: String,
    /// The variable itself, whole: FSDP2's unsharded parameter. Its memory is freed
    /// between passes when its unit reshards after forward (stage 3).
    pub unsharded: Tensor,
    /// Its place in the unit's flat shard.
    pub piece: Piece,
    /// Its chunk of the unit's flat shard, in its shape with `chunk_rows` rows:
    /// FSDP2's `sharded_param`, what the optimizer steps.
    pub sharded: Tensor,
}

impl FsdpParam {
    /// `unsharded` (named `name`), whose chunk lies at `piece` in `shard` (this rank's
    /// flat shard of the unit).
    pub fn new(name: String, unsharded: Tensor, piece: Piece, shard: &Tensor) -> FsdpParam {
        let sharded = shard
            .narrow(0, piece.offset, piece.chunk_len())
            .view(piece.chunk_shape().as_slice());
        FsdpParam {
            name,
            unsharded,
            piece,
            sharded,
        }
    }

    /// Copies rank `rank`'s rows of the (whole) variable into `shard`, this rank's flat
    /// shard of the unit; the padding stays as it is.
    pub fn cut(&self, shard: &Tensor, rank: usize) {
        if let Some(mine) = self.piece.rows_in_full(&self.unsharded, rank) {
            tch::no_grad(|| {
                let mut rows = self.piece.rows_in_shard(shard, rank).expect("rows");
                rows.copy_(&mine);
            });
        }
    }

    /// Copies every rank's rows out of an all-gather's output (`chunks`, one per rank,
    /// each starting at element `base` of the unit's flat shard) into the variable's
    /// memory, which it gets again if it was freed (FSDP2's
    /// `foreach_all_gather_copy_out`).
    ///
    /// # Errors
    /// [`Error::Torch`](crate::Error::Torch) when the memory cannot be given back.
    pub fn copy_out(&self, chunks: &[Tensor], base: i64) -> Result<()> {
        let piece = Piece {
            offset: self.piece.offset - base,
            ..self.piece.clone()
        };
        let full = hooks::storage_alias(&self.unsharded)?;
        tch::no_grad(|| {
            for (r, chunk) in chunks.iter().enumerate() {
                if let Some(part) = piece.rows_in_shard(chunk, r) {
                    piece.rows_in_full(&full, r).expect("rows").copy_(&part);
                }
            }
        });
        Ok(())
    }

    /// Frees the variable's memory (FSDP2's `free_unsharded_param`): until the next
    /// [`copy_out`](Self::copy_out), reading it is an error that says why and what
    /// to do.
    ///
    /// # Errors
    /// [`Error::Torch`](crate::Error::Torch) when the storage cannot be freed.
    pub fn free_unsharded(&self) -> Result<()> {
        hooks::free_storage(&self.unsharded, &resharded_message(&self.name))
    }
}

/// What reading a resharded variable says (libtorch's error, from the freed storage).
fn resharded_message(name: &str) -> String {
    format!(
        "tch-distributed: variable `{name}` is sharded by ZeRO stage 3 (fully_shard): between \
         its unit's forward and backward passes this rank holds only its rows of it, not the \
         whole tensor. To read or write it whole, do so inside \
         `tch_distributed::summon_full_params(…)`, which gathers every sharded variable on \
         every rank, or after the #[distributed] function returns, when the model is whole \
         again. To change its dtype or device (`vs.double()`, `vs.set_device(…)`), give them to \
         the VarStore before the model is built (`VarStore::new(device)`, then \
         `vs.set_kind(kind)`, then the layers)"
    )
}
