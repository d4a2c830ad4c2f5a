//! Where each parameter's shard lies: FSDP2's dim-0 sharding. A parameter of `d0`
//! rows is cut into `world_size` chunks of `ceil(d0 / world_size)` rows (as
//! `torch.chunk`); rank `r` holds rows `[r·c, min((r+1)·c, d0))`, padded with zeros to
//! `c` rows, so that every rank holds exactly `1/world_size` of the padded parameter.
//! A unit's shards sit one after another in one flat tensor per rank, which one
//! all-gather and one reduce-scatter move whole.

use tch::Tensor;

/// One parameter's place in its unit's flat shard.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct Piece {
    /// The parameter's shape (a scalar counts as one row of one element).
    pub shape: Vec<i64>,
    /// Its rows (`shape[0]`), and elements per row.
    pub rows: i64,
    pub row_len: i64,
    /// The rows of every rank's chunk, padding included: `ceil(rows / world_size)`.
    pub chunk_rows: i64,
    /// Where the chunk starts in the unit's flat shard (elements).
    pub offset: i64,
}

impl Piece {
    /// The elements of one rank's chunk, padding included.
    pub fn chunk_len(&self) -> i64 {
        self.chunk_rows * self.row_len
    }

    /// The rows of the parameter that rank `rank` holds: `(first, count)`; the count
    /// is 0 for ranks past the end (their chunk is all padding).
    pub fn rows_of(&self, rank: usize) -> (i64, i64) {
        let first = (rank as i64 * self.chunk_rows).min(self.rows);
        let end = (first + self.chunk_rows).min(self.rows);
        (first, end - first)
    }

    /// Rank `rank`'s rows of `full` (a tensor of the parameter's shape), as `[rows,
    /// row_len]`; `None` for a rank past the end.
    pub fn rows_in_full(&self, full: &Tensor, rank: usize) -> Option<Tensor> {
        let (first, rows) = self.rows_of(rank);
        (rows > 0).then(|| {
            full.reshape([self.rows, self.row_len])
                .narrow(0, first, rows)
        })
    }

    /// Rank `rank`'s rows in `flat`, that rank's flat shard of the unit (or a chunk of
    /// the parameter alone when `offset` is 0), padding left out, as `[rows,
    /// row_len]`; `None` for a rank past the end.
    pub fn rows_in_shard(&self, flat: &Tensor, rank: usize) -> Option<Tensor> {
        let (_, rows) = self.rows_of(rank);
        (rows > 0).then(|| {
            flat.narrow(0, self.offset, rows * self.row_len)
                .view([rows, self.row_len])
        })
    }

    /// The shape of one rank's chunk: `shape` with `chunk_rows` rows.
    pub fn chunk_shape(&self) -> Vec<i64> {
        let mut shape = if self.shape.is_empty() {
            vec![1]
        } else {
            self.shape.clone()
        };
        shape[0] = self.chunk_rows;
        shape
    }
}

/// The pieces of parameters of `shapes`, in that order, over `world_size` ranks, and
/// the elements of one rank's flat shard (the sum of the chunks).
pub(crate) fn layout(shapes: &[Vec<i64>], world_size: usize) -> (Vec<Piece>, i64) {
    let world = world_size.max(1) as i64;
    let mut offset = 0;
    let pieces = shapes
        .iter()
        .map(|shape| {
            let rows = shape.first().copied().unwrap_or(1);
            let row_len = shape.iter().skip(1).product::<i64>();
            let piece = Piece {
                shape: shape.clone(),
                rows,
                row_len,
                chunk_rows: (rows + world - 1) / world,
                offset,
            };
            offset += piece.chunk_len();
            piece
        })
        .collect();
    (pieces, offset)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn chunks_are_torch_chunk_s_padded_to_one_size() {
        let (pieces, total) = layout(&[vec![10, 3], vec![3], vec![], vec![1, 4]], 4);
        // 10 rows over 4 ranks: chunks of 3 rows; rank 3 holds the last one.
        assert_eq!(pieces[0].chunk_rows, 3);
        assert_eq!(
            (0..4).map(|r| pieces[0].rows_of(r)).collect::<Vec<_>>(),
            [(0, 3), (3, 3), (6, 3), (9, 1)]
        );
        // 3 rows over 4: rank 3's chunk is all padding.
        assert_eq!(pieces[1].rows_of(3), (3, 0));
        // A scalar is one row, on rank 0.
        assert_eq!(
            (pieces[2].rows, pieces[2].row_len, pieces[2].chunk_rows),
            (1, 1, 1)
        );
        assert_eq!(pieces[2].rows_of(1), (1, 0));
        assert_eq!(pieces[2].chunk_shape(), [1]);
        assert_eq!(pieces[3].chunk_shape(), [1, 4]);
        // Offsets follow each other; every rank holds the same number of elements.
        assert_eq!(
            pieces.iter().map(|p| p.offset).collect::<Vec<_>>(),
            [0, 9, 10, 11]
        );
        assert_eq!(total, 9 + 1 + 1 + 4);
        let padded: i64 = pieces.iter().map(|p| p.chunk_len() * 4).sum();
        assert_eq!(padded, total * 4);
    }

    #[test]
    fn one_rank_holds_everything() {
        let (pieces, total) = layout(&[vec![5, 2]], 1);
        assert_eq!(pieces[0].rows_of(0), (0, 5));
        assert_eq!(total, 10);
    }
}
