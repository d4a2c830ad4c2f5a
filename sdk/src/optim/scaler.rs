//! [`GradScaler`]'s steps of an [`Optimizer`]: the scaler (`amp`) knows gradients,
//! the optimizer (this module) knows its variables and how to step them.

use super::Optimizer;
use crate::amp::GradScaler;
use crate::error::Result;

impl GradScaler {
    /// Divides the gradients of `opt`'s variables by the scale, in place, and records
    /// whether one holds an inf or NaN on any rank (one all-reduce). Call it at most
    /// once per step, after backward, to clip or inspect the true gradients;
    /// [`step`](Self::step) calls it otherwise.
    ///
    /// # Errors
    /// [`Error::Usage`](crate::Error::Usage) when called twice in a step;
    /// [`Error::Torch`](crate::Error::Torch) or [`Error::Collective`](crate::Error::Collective)
    /// when the kernels or the all-reduce fail.
    pub fn unscale(&mut self, opt: &Optimizer) -> Result<()> {
        opt.finish_gradients()?;
        self.unscale_gradients(&opt.stepped_tensors())
    }

    /// Unscales (unless [`unscale`](Self::unscale) already did) and runs `opt.step()`
    /// unless a gradient on any rank held an inf or NaN; returns whether it stepped.
    ///
    /// # Errors
    /// As [`unscale`](Self::unscale); [`Error::Diverged`](crate::Error::Diverged) after too many skipped steps in a row; [`Error::Torch`](crate::Error::Torch) from the step.
    pub fn step(&mut self, opt: &mut Optimizer) -> Result<bool> {
        opt.finish_gradients()?;
        let overflow = self.overflowed(|| opt.stepped_tensors())?;
        if !overflow {
            opt.step()?;
        }
        Ok(!overflow)
    }
}
