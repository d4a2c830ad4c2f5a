//! `fully_shard`: the units whose parameters a sharded optimizer gathers around their
//! forward and backward passes, as FSDP2's `fully_shard(module)`.

use std::sync::{Arc, Mutex, OnceLock, Weak};

use tch::nn::{Module, ModuleT, Path};
use tch::Tensor;

use super::engine::Inner;

/// A unit as the program declared it: its variables' path, and the sharded optimizer
/// it belongs to once one is built over them.
pub(crate) struct Slot {
    /// The variables' names start with this (`"layers.3."`); empty for the whole store.
    pub prefix: String,
    bound: OnceLock<(Weak<Inner>, usize)>,
}

impl Slot {
    pub fn bind(&self, inner: Weak<Inner>, unit: usize) -> bool {
        self.bound.set((inner, unit)).is_ok()
    }

    fn engine(&self) -> Option<(Arc<Inner>, usize)> {
        let (inner, unit) = self.bound.get()?;
        Some((inner.upgrade()?, *unit))
    }
}

/// The units the program declared in this run, in order (the run's context keeps
/// them until an optimizer claims them), and the sharded optimizers' parameters.
#[derive(Default)]
pub(crate) struct Units {
    declared: Mutex<Vec<Arc<Slot>>>,
    engines: Mutex<Vec<Weak<Inner>>>,
}

impl Units {
    pub fn declared(&self) -> Vec<Arc<Slot>> {
        self.declared.lock().expect("units lock").clone()
    }

    fn declare(&self, slot: Arc<Slot>) {
        self.declared.lock().expect("units lock").push(slot);
    }

    pub fn add_engine(&self, engine: Weak<Inner>) {
        self.engines.lock().expect("units lock").push(engine);
    }

    /// Runs `f` with every sharded parameter of the run gathered (a collective: every
    /// rank calls it), as FSDP2's `summon_full_params`, then frees again those that
    /// were free. With `loaded`, `f` wrote new values into the parameters (a load):
    /// the shards are cut from them again.
    ///
    /// Errors: `f`'s, or [`Error::Collective`](crate::Error::Collective) from a gather.
    pub fn with_full_parameters<R>(
        &self,
        loaded: bool,
        f: impl FnOnce() -> crate::Result<R>,
    ) -> crate::Result<R> {
        let engines: Vec<Arc<Inner>> = self
            .engines
            .lock()
            .expect("units lock")
            .iter()
            .filter_map(Weak::upgrade)
            .collect();
        // Each engine's gather around the next: the innermost runs `f`.
        fn nested<R>(
            engines: &[Arc<Inner>],
            loaded: bool,
            f: impl FnOnce() -> crate::Result<R>,
        ) -> crate::Result<R> {
            match engines.split_first() {
                None => f(),
                Some((first, rest)) => {
                    first.with_full_parameters(loaded, || nested(rest, loaded, f))
                }
            }
        }
        nested(&engines, loaded, f)
    }
}

impl std::fmt::Debug for Units {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let n = self.declared.lock().map_or(0, |u| u.len());
        write!(f, "{n} fully sharded unit(s)")
    }
}

/// A module whose variables (those under the path given to [`fully_shard`]) form one
/// unit of fully sharded training. It is the module itself to the program: it
/// implements tch's `Module` and `ModuleT` by running the module's forward pass.
///
/// Under ZeRO stage 3 (`zero = 3`), the unit's parameters hold memory only around its
/// forward pass and its backward pass: they are all-gathered before each and freed
/// after each (the backward's gather runs when the unit's output gets its gradient,
/// before the unit's own backward). The gradients of a unit are reduce-scattered once
/// all of them are ready, in one collective per unit. Under stage 2 the unit only
/// groups that reduce-scatter; with no sharding (or one rank) it changes nothing.
pub struct FullyShard<M> {
    module: M,
    slot: Arc<Slot>,
}

/// Makes `module`, whose variables are those under `path`, a unit of fully sharded
/// training, as FSDP2's `fully_shard(module)`. Call it before building the optimizer
/// (which claims the units it finds), on the same module on every rank. Variables that
/// no unit claims form the root unit, gathered after each step and kept. A unit
/// nested in another claims its own variables.
///
/// ```no_run
/// # use tch::nn;
/// # let vs = nn::VarStore::new(tch::Device::Cpu);
/// let root = vs.root();
/// let layer = tch_distributed::fully_shard(nn::linear(&root / "l1", 1024, 1024, Default::default()), &(&root / "l1"));
/// ```
pub fn fully_shard<M>(module: M, path: &Path) -> FullyShard<M> {
    let components: Vec<&str> = path.components().collect();
    let prefix = match components.is_empty() {
        true => String::new(),
        false => format!("{}.", components.join(".")),
    };
    let slot = Arc::new(Slot {
        prefix,
        bound: OnceLock::new(),
    });
    if let Some(ctx) = crate::init::current() {
        ctx.units().declare(slot.clone());
    }
    FullyShard { module, slot }
}

impl<M> FullyShard<M> {
    /// The module.
    pub fn inner(&self) -> &M {
        &self.module
    }

    fn around(&self, forward: impl FnOnce() -> Tensor) -> Tensor {
        match self.slot.engine() {
            None => forward(),
            Some((inner, unit)) => inner.around_forward(unit, forward).unwrap_or_else(|e| {
                crate::__private::fail_with_source("a fully sharded unit's forward pass", &e)
            }),
        }
    }
}

impl<M: Module> Module for FullyShard<M> {
    fn forward(&self, xs: &Tensor) -> Tensor {
        self.around(|| self.module.forward(xs))
    }
}

impl<M: ModuleT> FullyShard<M> {
    /// The forward pass of a module with a train mode (tch's `ModuleT`: dropout, batch
    /// norm), gathered as [`Module::forward`] is. (tch gives every `Module` its
    /// `ModuleT`, so a `FullyShard` of a `ModuleT`-only module has this method rather
    /// than the trait.)
    pub fn forward_t(&self, xs: &Tensor, train: bool) -> Tensor {
        self.around(|| self.module.forward_t(xs, train))
    }
}

impl<M: std::fmt::Debug> std::fmt::Debug for FullyShard<M> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("FullyShard")
            .field("prefix", &self.slot.prefix)
            .field("module", &self.module)
            .finish()
    }
}
