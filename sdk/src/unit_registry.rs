//! The units `fully_shard` declared and the sharded optimizers' parameters, which the
//! run's context keeps: `fully_shard` declares a unit here, a sharded optimizer claims
//! the units and registers its parameters, and the checkpoints and `vs.save`/`vs.load`
//! gather them through here. A leaf, so that the context can hold it without depending
//! on the sharding itself.

use std::any::Any;
use std::sync::{Arc, Mutex, OnceLock, Weak};

use crate::error::Result;

/// A sharded optimizer's parameters, as the run's context sees them.
pub(crate) trait ShardedParameters: Send + Sync {
    /// Runs `f` with every parameter gathered (a collective: every rank calls it), as
    /// FSDP2's `summon_full_params`, then frees again those that were free. With
    /// `loaded`, `f` wrote new values into the parameters (a load): the shards are cut
    /// from them again, if `f` succeeded.
    fn with_full_parameters(&self, loaded: bool, f: &mut dyn FnMut() -> Result<()>) -> Result<()>;
}

/// A unit as the program declared it: its variables' path, and the sharded optimizer
/// (and the unit in it) it belongs to once one is built over them.
#[derive(Debug)]
pub(crate) struct Slot {
    /// The variables' names start with this (`"layers.3."`); empty for the whole store.
    pub prefix: String,
    bound: OnceLock<(Weak<dyn Any + Send + Sync>, usize)>,
}

impl Slot {
    pub fn new(prefix: String) -> Slot {
        Slot {
            prefix,
            bound: OnceLock::new(),
        }
    }

    /// Binds the unit to unit `unit` of `engine`; false when it was bound already.
    pub fn bind(&self, engine: Weak<dyn Any + Send + Sync>, unit: usize) -> bool {
        self.bound.set((engine, unit)).is_ok()
    }

    /// The engine and unit it is bound to, while the engine lives.
    pub fn bound(&self) -> Option<(Arc<dyn Any + Send + Sync>, usize)> {
        let (engine, unit) = self.bound.get()?;
        Some((engine.upgrade()?, *unit))
    }
}

/// The units the program declared in this run, in order, and the sharded optimizers'
/// parameters.
#[derive(Default)]
pub(crate) struct Units {
    declared: Mutex<Vec<Arc<Slot>>>,
    engines: Mutex<Vec<Weak<dyn ShardedParameters>>>,
}

impl Units {
    pub fn declared(&self) -> Vec<Arc<Slot>> {
        self.declared.lock().expect("units lock").clone()
    }

    pub fn declare(&self, slot: Arc<Slot>) {
        self.declared.lock().expect("units lock").push(slot);
    }

    pub fn add_engine(&self, engine: Weak<dyn ShardedParameters>) {
        self.engines.lock().expect("units lock").push(engine);
    }

    /// Runs `f` with every sharded parameter of the run gathered, as
    /// [`ShardedParameters::with_full_parameters`] does for one optimizer's.
    ///
    /// Errors: `f`'s, or [`Error::Collective`](crate::Error::Collective) from a gather.
    pub fn with_full_parameters<R>(
        &self,
        loaded: bool,
        f: impl FnOnce() -> Result<R>,
    ) -> Result<R> {
        let engines: Vec<Arc<dyn ShardedParameters>> = self
            .engines
            .lock()
            .expect("units lock")
            .iter()
            .filter_map(Weak::upgrade)
            .collect();
        // Each engine's gather around the next; the innermost runs `f`.
        fn nested(
            engines: &[Arc<dyn ShardedParameters>],
            loaded: bool,
            f: &mut dyn FnMut() -> Result<()>,
        ) -> Result<()> {
            match engines.split_first() {
                None => f(),
                Some((first, rest)) => {
                    first.with_full_parameters(loaded, &mut || nested(rest, loaded, f))
                }
            }
        }
        let (mut f, mut out) = (Some(f), None);
        nested(&engines, loaded, &mut || {
            out = Some(f.take().expect("called once")()?);
            Ok(())
        })?;
        Ok(out.expect("the innermost call ran"))
    }
}

impl std::fmt::Debug for Units {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let n = self.declared.lock().map_or(0, |u| u.len());
        write!(f, "{n} fully sharded unit(s)")
    }
}
