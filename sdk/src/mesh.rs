//! Hybrid sharding's 2-D mesh (FSDP2's `DeviceMesh` with a replicate and a shard
//! dimension, `HYBRID_SHARD`): the `shard_group` setting cuts the job's ranks into
//! shard groups of consecutive ranks (`node`: the ranks of one node), each of which
//! shards the model among its ranks; the ranks with the same place in every shard
//! group form a replicate group. A unit all-gathers within its shard group; gradients
//! are reduce-scattered within it, then each shard is all-reduced across the replicate
//! group, so only that all-reduce crosses nodes.

use std::time::Duration;

use tch::Device;

use crate::error::{Error, Result};
use crate::process_group::ProcessGroup;
use crate::rendezvous::Store;
use crate::settings::{Backend, ShardGroup};

/// A rank's two groups of the mesh.
#[derive(Clone, Debug)]
pub(crate) struct Mesh {
    /// The ranks that shard the model with this one: `rank / size` is the group,
    /// `rank % size` the place in it.
    pub shard: ProcessGroup,
    /// The ranks with this one's place in every shard group, which hold the same shard.
    pub replicate: ProcessGroup,
}

/// The mesh's place of a rank: `(shard group, place in it)`, in shard groups of `size`.
pub(crate) fn place(rank: usize, size: usize) -> (usize, usize) {
    (rank / size, rank % size)
}

impl Mesh {
    /// Joins this rank's shard group and replicate group for `group` through `store`
    /// (each under a key prefix of its own, so that every group meets only its ranks);
    /// none when the shard group is the whole job (flat sharding). Every rank calls it,
    /// in the same order as its other groups.
    ///
    /// # Errors
    /// [`Error::Config`] when the group's size does not divide the world size;
    /// [`Error::Rendezvous`] when a group's ranks do not join within `timeout`.
    #[allow(clippy::too_many_arguments)]
    pub fn join(
        store: &Store,
        group: ShardGroup,
        (rank, world_size, local_world_size): (usize, usize, usize),
        backend: Backend,
        device: Device,
        timeout: Duration,
    ) -> Result<Option<Mesh>> {
        let size = group
            .size(world_size, local_world_size)
            .map_err(|e| Error::Config(format!("shard_group = \"{group}\": {e}")))?;
        if size == world_size {
            return Ok(None);
        }
        let (shard_index, shard_rank) = place(rank, size);
        let shard_store = store.with_prefix(&format!("mesh/shard/{shard_index}/"))?;
        let shard = ProcessGroup::new(&shard_store, shard_rank, size, backend, device, timeout)?;
        let replicate_store = store.with_prefix(&format!("mesh/replicate/{shard_rank}/"))?;
        let replicate = ProcessGroup::new(
            &replicate_store,
            shard_index,
            world_size / size,
            backend,
            device,
            timeout,
        )?;
        Ok(Some(Mesh { shard, replicate }))
    }
}

#[cfg(test)]
mod tests {
    use super::place;

    #[test]
    fn shard_groups_are_consecutive_ranks_and_replicas_share_a_place() {
        // 2 nodes × 2 ranks, sharded within the node.
        assert_eq!(
            (0..4).map(|r| place(r, 2)).collect::<Vec<_>>(),
            [(0, 0), (0, 1), (1, 0), (1, 1)]
        );
        // Each replicate group: the ranks with one place, one per shard group.
        let replicas: Vec<usize> = (0..8).filter(|&r| place(r, 4).1 == 1).collect();
        assert_eq!(replicas, [1, 5]);
    }
}
