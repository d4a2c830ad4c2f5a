//! Type-directed dispatch for the rewrites that must leave other types alone
//! ("autoref specialization"): which loops are sharded, which receivers of
//! `save`/`load` are `VarStore`s, which `step()` is an optimizer's, whether the
//! function's value is an `Err`.

use std::cell::Cell;
use std::sync::atomic::{AtomicU64, Ordering};

use tch::nn::VarStore;

use crate::data::Sharded;
use crate::rng::AgreedSeed;

use super::fail;
use super::rewrites::SyncBeforeStep;

/// Type-directed dispatch for the rewrites that must leave other types alone
/// ("autoref specialization"): `(&Probe::new(x)).method()` resolves to the impl on
/// `Probe<Known>` when `x: Known`, else to the fallback on `&Probe<T>`.
pub struct Probe<T>(Cell<Option<T>>);

impl<T> Probe<T> {
    pub fn new(value: T) -> Self {
        Probe(Cell::new(Some(value)))
    }
    fn take(&self) -> T {
        self.0.take().expect("probe used once")
    }
}

/// Loops over the data iterators tch users write: each rank gets its own batches.
pub trait ShardKnown {
    type Iter;
    fn __tchd_iter(&self) -> Self::Iter;
}
/// Loops over anything else: untouched.
pub trait ShardOther {
    type Iter;
    fn __tchd_iter(&self) -> Self::Iter;
}

/// The head of a `for` loop: its iterator expression is evaluated while this lives,
/// under an [`AgreedSeed`] made from the loop (`site`, fixed by the macro), how many
/// times it has started (`runs`, one counter per loop) and the seed libtorch was last
/// seeded with, so a shuffle drawn there is the same on every rank. Dropped once the
/// loop's iterator exists; a sharded loop then checks that every rank starts from the
/// same batch.
///
/// After [`Checkpointer::load_state`](crate::Checkpointer::load_state), the loop's
/// next start resumes the checkpoint's position for it: its run count (so the same
/// shuffle), and the batches of that run already dealt, skipped.
pub struct LoopHead {
    site: u64,
    run: u64,
    /// Batches of this run that the ranks had dealt before a checkpoint it resumes.
    skip: u64,
    _agreed: AgreedSeed,
}

/// Enters the head of loop `site`; see [`LoopHead`].
pub fn loop_head(site: u64, runs: &AtomicU64) -> LoopHead {
    let resume = crate::init::current().and_then(|c| c.loops().take_resume(site));
    if let Some(resume) = resume {
        runs.store(resume.run, Ordering::Relaxed);
    }
    let run = runs.fetch_add(1, Ordering::Relaxed);
    // The seed libtorch was last seeded with (rank 0's, adopted at entry, or one the
    // function set alike on every rank since): a program that seeds inside the
    // function gets the same shuffles run after run. Drawing numbers leaves it alone.
    let seeded = crate::rng::current_seed(-1)
        .unwrap_or_else(|e| fail("reading the random generator's seed", e));
    let agreed = AgreedSeed::seeded(crate::rng::mix(crate::rng::mix(site) ^ run ^ seeded))
        .unwrap_or_else(|e| fail("agreeing on the loop's shuffle", e));
    LoopHead {
        site,
        run,
        skip: resume.map_or(0, |r| r.batches),
        _agreed: agreed,
    }
}

impl LoopHead {
    fn shard<I: Iterator>(self, iter: I) -> Sharded<I>
    where
        I::Item: crate::record::Samples,
    {
        Sharded::new(iter)
            .positioned(self.site, self.run, self.skip)
            .watching()
            .with_progress(Some(self.run))
            .recording(crate::record::Recording::start(self.site, self.run))
            .check_same_start(<I::Item as crate::record::Samples>::samples)
            .unwrap_or_else(|e| fail("starting a sharded loop", e))
    }
}

impl ShardKnown for Probe<(LoopHead, tch::data::TextDataIter)> {
    type Iter = Sharded<tch::data::TextDataIter>;
    fn __tchd_iter(&self) -> Self::Iter {
        let (head, iter) = self.take();
        head.shard(iter)
    }
}
impl ShardKnown for Probe<(LoopHead, tch::data::Iter2)> {
    type Iter = Sharded<tch::data::Iter2>;
    fn __tchd_iter(&self) -> Self::Iter {
        let (head, iter) = self.take();
        head.shard(iter)
    }
}
impl<'a> ShardKnown for Probe<(LoopHead, &'a mut tch::data::Iter2)> {
    type Iter = Sharded<&'a mut tch::data::Iter2>;
    fn __tchd_iter(&self) -> Self::Iter {
        let (head, iter) = self.take();
        head.shard(iter)
    }
}
impl<T> ShardOther for &Probe<(LoopHead, T)> {
    type Iter = T;
    fn __tchd_iter(&self) -> T {
        self.take().1
    }
}

/// How the function ended: whether it returned an `Err`, and the error as `main`
/// prints it (`Debug`) when its type can say it.
pub struct Ending {
    pub(crate) failed: bool,
    pub(crate) message: Option<String>,
}

/// Whether the function's return value is an `Err`, with its message. The macro
/// calls `(&Probe::new(&out)).__tchd_failed()`; method lookup tries the receiver
/// `&Probe<_>` (a `Result` whose error is `Debug`: failed, with the message), then
/// `&&Probe<_>` (a `Result` with another error type: failed), then `&mut &Probe<_>`
/// (anything else: not a failure). Where the error type is still to be inferred at
/// the function's end (its last expression is `Ok(…)`), the first applies, so the
/// error type must be `Debug`, as `main`'s must; a function whose error type is
/// not `Debug` names it there (`Ok::<_, E>(…)`) and is reported without the message.
pub trait ExitKnown {
    fn __tchd_failed(self) -> Ending;
}
pub trait ExitOther {
    fn __tchd_failed(self) -> Ending;
}
impl<T, E: std::fmt::Debug> ExitKnown for &Probe<&Result<T, E>> {
    fn __tchd_failed(self) -> Ending {
        let message = self.take().as_ref().err().map(|e| format!("{e:?}"));
        Ending {
            failed: message.is_some(),
            message,
        }
    }
}
impl<T, E> ExitOther for &&Probe<&Result<T, E>> {
    fn __tchd_failed(self) -> Ending {
        Ending {
            failed: self.take().is_err(),
            message: None,
        }
    }
}
impl<T> ExitOther for &mut &Probe<T> {
    fn __tchd_failed(self) -> Ending {
        Ending {
            failed: false,
            message: None,
        }
    }
}

/// The `VarStore` behind `vs.save(…)`'s or `vs.root()`'s receiver, if it is one.
pub trait VarStoreRefKnown<'a> {
    fn __tchd_var_store(&self) -> Option<&'a VarStore>;
}
pub trait VarStoreRefOther<'a> {
    fn __tchd_var_store(&self) -> Option<&'a VarStore>;
}
impl<'a> VarStoreRefKnown<'a> for Probe<&'a VarStore> {
    fn __tchd_var_store(&self) -> Option<&'a VarStore> {
        Some(self.take())
    }
}
impl<'a, 'b: 'a> VarStoreRefKnown<'b> for Probe<&'a &'b VarStore> {
    fn __tchd_var_store(&self) -> Option<&'b VarStore> {
        Some(*self.take())
    }
}
impl<'a, 'b: 'a> VarStoreRefKnown<'a> for Probe<&'a &'b mut VarStore> {
    fn __tchd_var_store(&self) -> Option<&'a VarStore> {
        Some(&**self.take())
    }
}
impl<'a, T> VarStoreRefOther<'a> for &Probe<T> {
    fn __tchd_var_store(&self) -> Option<&'a VarStore> {
        None
    }
}

/// The `VarStore` behind `vs.load(…)`'s receiver, if it is one.
pub trait VarStoreMutKnown<'a> {
    fn __tchd_var_store_mut(&self) -> Option<&'a mut VarStore>;
}
pub trait VarStoreMutOther<'a> {
    fn __tchd_var_store_mut(&self) -> Option<&'a mut VarStore>;
}
impl<'a> VarStoreMutKnown<'a> for Probe<&'a mut VarStore> {
    fn __tchd_var_store_mut(&self) -> Option<&'a mut VarStore> {
        Some(self.take())
    }
}
impl<'a, 'b: 'a> VarStoreMutKnown<'a> for Probe<&'a mut &'b mut VarStore> {
    fn __tchd_var_store_mut(&self) -> Option<&'a mut VarStore> {
        Some(&mut **self.take())
    }
}
impl<'a, T> VarStoreMutOther<'a> for &Probe<T> {
    fn __tchd_var_store_mut(&self) -> Option<&'a mut VarStore> {
        None
    }
}

/// `opt.step()` in the function: averages the gradients first when `opt` is an
/// optimizer that [`SyncBeforeStep`] knows, does nothing for anything else (an LR
/// scheduler's `step`, a progress counter's).
pub trait StepKnown {
    fn __tchd_before_step(&self);
}
pub trait StepOther {
    fn __tchd_before_step(&self);
}
impl<T: SyncBeforeStep + ?Sized> StepKnown for Probe<&T> {
    fn __tchd_before_step(&self) {
        self.take().sync_before_step()
    }
}
impl<T> StepOther for &Probe<T> {
    fn __tchd_before_step(&self) {}
}

/// `config.build(vs, lr)`: the receiver and arguments, evaluated once, with the call
/// as written (`|(config, vs, lr)| config.build(vs, lr)`) for receivers that are no
/// optimizer configuration the SDK knows. The function only gives the closure its
/// argument's type.
pub fn build_call<A, T, F: FnOnce(A) -> T>(args: A, call: F) -> (A, F) {
    (args, call)
}

/// `.build(&vs, lr)` on one of tch's optimizer configurations ([`OptimizerKind`]):
/// the SDK's optimizer, stepping through a DDP of `vs` ([`super::build`]).
pub trait BuildKnown {
    fn __tchd_build(&self) -> Result<crate::Optimizer, tch::TchError>;
}
/// `.build(…)` on anything else (a configuration of the program's own, a builder of
/// another crate): the call as written. An optimizer it makes is averaged as one the
/// function did not build (see [`super::SyncBeforeStep`]).
pub trait BuildOther {
    type Output;
    fn __tchd_build(&self) -> Self::Output;
}
impl<C: crate::OptimizerKind, F> BuildKnown for Probe<((C, &VarStore, f64), F)> {
    fn __tchd_build(&self) -> Result<crate::Optimizer, tch::TchError> {
        let ((config, vs, lr), _) = self.take();
        super::build(&config, vs, lr)
    }
}
impl<A, T, F: FnOnce(A) -> T> BuildOther for &Probe<(A, F)> {
    type Output = T;
    fn __tchd_build(&self) -> T {
        let (args, call) = self.take();
        call(args)
    }
}

/// A method of an optimizer the function built, that returns a `Result` in the SDK
/// and nothing (or a number) in tch: the value, or the end of the program with the
/// cause and the fix (`what` names the call).
pub trait ResultKnown {
    type Output;
    fn __tchd_or_fail(&self, what: &str) -> Self::Output;
}
/// The same method on tch's optimizer (one a configuration the SDK does not know
/// built): its value as is.
pub trait ResultOther {
    type Output;
    fn __tchd_or_fail(&self, what: &str) -> Self::Output;
}
impl<T> ResultKnown for Probe<crate::Result<T>> {
    type Output = T;
    fn __tchd_or_fail(&self, what: &str) -> T {
        super::or_fail(self.take(), what)
    }
}
impl<T> ResultOther for &Probe<T> {
    type Output = T;
    fn __tchd_or_fail(&self, _what: &str) -> T {
        self.take()
    }
}

/// `loss.backward()` in a function that built one optimizer: through it when it is
/// the SDK's, so that the gradients are averaged (and accumulated, and scaled) as its
/// steps expect.
pub trait BackwardKnown {
    fn __tchd_backward(&self, loss: &tch::Tensor);
}
/// With tch's optimizer (one a configuration the SDK does not know built): the plain
/// backward pass, which that optimizer's DDP averages once it has one.
pub trait BackwardOther {
    fn __tchd_backward(&self, loss: &tch::Tensor);
}
impl BackwardKnown for Probe<&mut crate::Optimizer> {
    fn __tchd_backward(&self, loss: &tch::Tensor) {
        super::backward(self.take(), loss)
    }
}
impl<T> BackwardOther for &Probe<T> {
    fn __tchd_backward(&self, loss: &tch::Tensor) {
        super::or_fail(loss.f_backward().map_err(Into::into), "backward")
    }
}
