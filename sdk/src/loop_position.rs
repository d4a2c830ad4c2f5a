//! Where each loop that `#[distributed]` sharded stands: the run's record of them
//! (kept in its [`Context`](crate::Context)), which [`Checkpointer::save_state`]
//! writes into the checkpoint and [`Checkpointer::load_state`] hands back, so that
//! the resumed program's loops start where they stopped.
//!
//! [`Checkpointer::save_state`]: crate::Checkpointer::save_state
//! [`Checkpointer::load_state`]: crate::Checkpointer::load_state

use std::sync::Mutex;

use serde::{Deserialize, Serialize};

/// Where a sharded loop stands: in its `run`-th run (its epoch, from 0, as the loop's
/// head counts the times it started: the agreed shuffle of a run is drawn from that
/// number), having dealt `batches` of the run's batches to the ranks together (the
/// batches a rank yielded × the world size). A resumed loop draws the same shuffle and
/// skips those batches, as Accelerate's `skip_first_batches`, at any world size.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct LoopPosition {
    /// The loop, as `#[distributed]` numbers the loops of its function (a program
    /// whose function's loops changed does not find its old loops).
    pub site: u64,
    /// The loop's run (epoch) in progress, from 0.
    pub run: u64,
    /// The batches of that run dealt to all ranks together.
    pub batches: u64,
}

/// Where a [`DataLoader`](crate::DataLoader) stands, for checkpoints: the epoch being
/// read and how many samples of it all ranks together have consumed. Resuming with
/// another world size skips the same number of samples, rounded down to whole
/// batches.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct LoaderPosition {
    /// The epoch in progress (or the next one, at an epoch boundary).
    pub epoch: u64,
    /// Samples of that epoch consumed over all ranks (padding included).
    pub samples_in_epoch: u64,
}

/// The positions of the run's sharded loops and data loaders, and those a loaded
/// checkpoint gave for their next start.
#[derive(Debug, Default)]
pub(crate) struct LoopPositions {
    now: Mutex<Vec<LoopPosition>>,
    resume: Mutex<Vec<LoopPosition>>,
    /// The run's loaders' positions, by number (the order they were made in).
    loaders: Mutex<Vec<LoaderPosition>>,
    /// A checkpoint's positions for them, taken once each.
    loaders_resume: Mutex<Vec<Option<LoaderPosition>>>,
}

impl LoopPositions {
    /// Records where the loop `position.site` stands now.
    pub(crate) fn update(&self, position: LoopPosition) {
        let mut now = self.now.lock().unwrap_or_else(|e| e.into_inner());
        match now.iter_mut().find(|p| p.site == position.site) {
            Some(p) => *p = position,
            None => now.push(position),
        }
    }

    /// Where every loop stands now, by site.
    pub(crate) fn now(&self) -> Vec<LoopPosition> {
        let mut now = self.now.lock().unwrap_or_else(|e| e.into_inner()).clone();
        now.sort_by_key(|p| p.site);
        now
    }

    /// Makes `positions` (a checkpoint's) where the loops start next.
    pub(crate) fn resume_from(&self, positions: &[LoopPosition]) {
        *self.resume.lock().unwrap_or_else(|e| e.into_inner()) = positions.to_vec();
    }

    /// Numbers a new loader of the run (0, 1, …, in the order they are made).
    pub(crate) fn add_loader(&self) -> usize {
        let mut loaders = self.loaders.lock().unwrap_or_else(|e| e.into_inner());
        loaders.push(LoaderPosition::default());
        loaders.len() - 1
    }

    /// Records where loader `number` stands now.
    pub(crate) fn update_loader(&self, number: usize, position: LoaderPosition) {
        let mut loaders = self.loaders.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(p) = loaders.get_mut(number) {
            *p = position;
        }
    }

    /// Where every loader of the run stands now, by number.
    pub(crate) fn loaders(&self) -> Vec<LoaderPosition> {
        self.loaders
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
    }

    /// Makes `positions` (a checkpoint's) where the loaders start their next epoch.
    pub(crate) fn resume_loaders_from(&self, positions: &[LoaderPosition]) {
        *self
            .loaders_resume
            .lock()
            .unwrap_or_else(|e| e.into_inner()) = positions.iter().copied().map(Some).collect();
    }

    /// Where loader `number` starts its next epoch, once: the checkpoint's position
    /// for it, if any.
    pub(crate) fn take_loader_resume(&self, number: usize) -> Option<LoaderPosition> {
        let mut resume = self
            .loaders_resume
            .lock()
            .unwrap_or_else(|e| e.into_inner());
        resume.get_mut(number)?.take()
    }

    /// Where loop `site` starts, once: the checkpoint's position for it, if any.
    pub(crate) fn take_resume(&self, site: u64) -> Option<LoopPosition> {
        let mut resume = self.resume.lock().unwrap_or_else(|e| e.into_inner());
        let i = resume.iter().position(|p| p.site == site)?;
        Some(resume.swap_remove(i))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_loop_has_one_position_and_a_resume_is_taken_once() {
        let loops = LoopPositions::default();
        let at = |site, run, batches| LoopPosition { site, run, batches };
        loops.update(at(7, 0, 2));
        loops.update(at(3, 1, 0));
        loops.update(at(7, 0, 4));
        assert_eq!(loops.now(), vec![at(3, 1, 0), at(7, 0, 4)]);
        loops.resume_from(&[at(7, 2, 6)]);
        assert_eq!(loops.take_resume(3), None);
        assert_eq!(loops.take_resume(7), Some(at(7, 2, 6)));
        assert_eq!(loops.take_resume(7), None, "once");

        let (first, second) = (loops.add_loader(), loops.add_loader());
        let at = |epoch, samples_in_epoch| LoaderPosition {
            epoch,
            samples_in_epoch,
        };
        loops.update_loader(second, at(1, 32));
        assert_eq!(loops.loaders(), vec![at(0, 0), at(1, 32)]);
        loops.resume_loaders_from(&[at(2, 8)]);
        assert_eq!(loops.take_loader_resume(second), None);
        assert_eq!(loops.take_loader_resume(first), Some(at(2, 8)));
        assert_eq!(loops.take_loader_resume(first), None, "once");
    }
}
