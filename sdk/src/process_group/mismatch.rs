//! The text of c10d's `ProcessGroupWrapper` when the ranks' collectives differ (under
//! `debug = "detail"`), in the SDK's words: which rank runs which collective on which
//! tensors.

/// One rank's collective as the wrapper prints it: `Rank 1 is running collective:
/// CollectiveFingerPrint(SequenceNumber=0, OpType=ALLREDUCE, TensorShape=[4],
/// TensorDtypes=Float, …)`.
struct FingerPrint {
    rank: String,
    sequence: String,
    op: String,
    shape: String,
    dtype: String,
}

/// The SDK's message for the wrapper's mismatch text; `None` for any other text.
pub(crate) fn describe(text: &str) -> Option<String> {
    let rest = text
        .split_once("Detected mismatch between collectives on ranks.")?
        .1;
    let prints: Vec<FingerPrint> = rest.split("Rank ").skip(1).filter_map(parse).collect();
    let [mine, other] = prints.as_slice() else {
        return None;
    };
    Some(format!(
        "the ranks called different collectives (debug = \"detail\" compares each one \
         before it runs): rank {} is in {}, rank {} in {}. Every rank must run the same \
         collectives in the same order, on tensors of the same shapes and dtypes: look \
         for a collective that one rank skips or adds (a branch on the rank or on its \
         own data), or a batch of another size on one rank",
        mine.rank,
        mine.what(),
        other.rank,
        other.what()
    ))
}

fn parse(part: &str) -> Option<FingerPrint> {
    let (rank, print) = part.split_once(" is running collective: CollectiveFingerPrint(")?;
    let between = |start: &str, end: &str| -> Option<String> {
        let from = print.split_once(start)?.1;
        Some(from.split_once(end).map_or(from, |(v, _)| v).to_string())
    };
    Some(FingerPrint {
        rank: rank.trim().to_string(),
        sequence: between("SequenceNumber=", ",")?,
        op: between("OpType=", ",")?,
        shape: between("TensorShape=", ", TensorDtypes=")?,
        dtype: between("TensorDtypes=", ", TensorDeviceTypes=")?,
    })
}

impl FingerPrint {
    /// `all_reduce of [3] Float (its collective 1)`, as the SDK names collectives.
    fn what(&self) -> String {
        let op = match self.op.trim_start_matches('_') {
            "ALLREDUCE" | "ALLREDUCE_COALESCED" => "all_reduce".to_string(),
            "ALLGATHER" | "ALLGATHER_BASE" | "ALLGATHER_COALESCED" => "all_gather".into(),
            "REDUCE_SCATTER" | "REDUCE_SCATTER_BASE" => "reduce_scatter".into(),
            other => other.to_ascii_lowercase(),
        };
        let n = self
            .sequence
            .parse::<u64>()
            .map_or(self.sequence.clone(), |n| (n + 1).to_string());
        format!("{op} of {} {} (its collective {n})", self.shape, self.dtype)
    }
}

#[cfg(test)]
mod tests {
    /// The wrapper's text in libtorch 2.11, as a 2-rank run under `debug = "detail"`
    /// printed it.
    #[test]
    fn the_wrapper_text_reads_as_ranks_and_collectives() {
        let print = |rank, op, shape| {
            format!(
                "Rank {rank} is running collective: CollectiveFingerPrint(SequenceNumber=0, \
                 OpType={op}, TensorShape={shape}, TensorDtypes=Float, \
                 TensorDeviceTypes=TensorOptions(dtype=float (default), device=cpu, \
                 layout=Strided (default)))"
            )
        };
        let text = format!(
            "Detected mismatch between collectives on ranks. {}, but {}.Collectives differ \
             in the following aspects:   Op type: ALLREDUCEvs BROADCAST",
            print(0, "ALLREDUCE", "[3, 2]"),
            print(1, "BROADCAST", "[4]")
        );
        let message = super::describe(&text).unwrap();
        assert!(
            message.contains(
                "rank 0 is in all_reduce of [3, 2] Float (its collective 1), rank 1 in \
                 broadcast of [4] Float (its collective 1)"
            ),
            "{message}"
        );
        assert!(super::describe("Connection reset by peer").is_none());
    }
}
