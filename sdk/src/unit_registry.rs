//! The units `fully_shard` declared and the sharded parameters, which the run's context
//! keeps: `fully_shard` declares a unit here, the unit's parameters are sharded (when it
//! is declared in a job that shards them, else by the optimizer that claims it) and
//! registered here, and the checkpoints, `vs.save`/`vs.load`, `summon_full_params` and
//! the function's return gather them through here. A leaf, so that the context can
//! hold it without depending on the sharding itself.

use std::any::Any;
use std::sync::{Arc, Mutex, OnceLock, Weak};

use tch::nn::{Path, Variables};
use tch::Tensor;

use crate::error::Result;

/// One unit's sharded parameters, as the run's context sees them.
pub(crate) trait ShardedParameters: Send + Sync {
    /// Runs `f` with the unit's parameters gathered whole and exact (a collective:
    /// every rank calls it), as FSDP's `summon_full_params`, then leaves them as they
    /// were. With `writeback`, `f` wrote new values into the parameters (a load): the
    /// shard is cut from them again, if `f` succeeded.
    fn with_full_parameters(
        &self,
        writeback: bool,
        f: &mut dyn FnMut() -> Result<()>,
    ) -> Result<()>;

    /// Gathers the parameters whole and exact for good: they are resharded no more
    /// (a collective).
    fn make_whole(&self) -> Result<()>;

    /// The whole, exact value of the variable whose [`tensor_key`] is `key`, if it is
    /// one of this unit's: the variable itself while it is gathered exactly, else a
    /// new tensor all-gathered from its rows alone (a collective: every rank asks for
    /// the same variables in the same order). A save holds one variable this way.
    ///
    /// [`tensor_key`]: crate::ffi::tensor_key
    fn whole(&self, key: usize) -> Result<Option<Tensor>>;

    /// If the variable whose key is `key` is one of this unit's: writes `rows(first,
    /// count)`, its rows `[first, first + count)` as a tensor of its shape with
    /// `count` rows, into this rank's shard, and returns true. A load reads only this
    /// rank's rows this way; [`after_load`](Self::after_load) then updates the
    /// parameters that are gathered.
    fn load_rows(
        &self,
        key: usize,
        rows: &mut dyn FnMut(i64, i64) -> Result<Tensor>,
    ) -> Result<bool>;

    /// After [`load_rows`](Self::load_rows): a gathered unit gathers its new values (a
    /// collective).
    fn after_load(&self) -> Result<()>;

    /// Whether the variable whose key is `key` is one of this unit's.
    fn holds(&self, key: usize) -> bool;
}

/// A unit as the program declared it: its variables' path, its sharded parameters once
/// they are sharded, and the sharded optimizer (and the unit in it) that steps them.
#[derive(Debug)]
pub(crate) struct Slot {
    /// The variables' names start with this (`"layers.3."`); empty for the whole store.
    pub prefix: String,
    /// The unit's parameters (the sharding's own type), once sharded.
    params: OnceLock<Arc<dyn Any + Send + Sync>>,
    /// The optimizer's engine (the sharding's own type) and the unit's number in it.
    engine: Mutex<Option<(Weak<dyn Any + Send + Sync>, usize)>>,
}

impl Slot {
    pub fn new(prefix: String) -> Slot {
        Slot {
            prefix,
            params: OnceLock::new(),
            engine: Mutex::new(None),
        }
    }

    /// Sets the unit's sharded parameters; false when it had some already.
    pub fn set_params(&self, params: Arc<dyn Any + Send + Sync>) -> bool {
        self.params.set(params).is_ok()
    }

    /// The unit's sharded parameters, if it was sharded.
    pub fn params(&self) -> Option<Arc<dyn Any + Send + Sync>> {
        self.params.get().cloned()
    }

    /// Binds the unit to unit `unit` of `engine` (a later optimizer takes it over).
    pub fn bind(&self, engine: Weak<dyn Any + Send + Sync>, unit: usize) {
        *self.engine.lock().expect("slot lock") = Some((engine, unit));
    }

    /// The engine and unit it is bound to, while the engine lives.
    pub fn bound(&self) -> Option<(Arc<dyn Any + Send + Sync>, usize)> {
        let engine = self.engine.lock().expect("slot lock");
        let (engine, unit) = engine.as_ref()?;
        Some((engine.upgrade()?, *unit))
    }
}

/// Units declared before any job was joined (`fully_shard` outside the
/// `#[distributed]` function): the first context takes them.
static BEFORE_JOIN: Mutex<Vec<Arc<Slot>>> = Mutex::new(Vec::new());

/// Declares `slot` in the run, or for the run to come when no job is joined yet.
pub(crate) fn declare_before_join(slot: Arc<Slot>) {
    BEFORE_JOIN.lock().expect("units lock").push(slot);
}

/// The units the program declared in this run, in order, and every sharded unit's
/// parameters (the declared ones and the optimizers' roots).
pub(crate) struct Units {
    declared: Mutex<Vec<Arc<Slot>>>,
    sharded: Mutex<Vec<Arc<dyn ShardedParameters>>>,
    /// The `VarStore`s the run has seen (`vs.root()` in the function), where a unit
    /// declared later finds its variables.
    stores: Mutex<Vec<Weak<Mutex<Variables>>>>,
}

impl Default for Units {
    /// The run's units, starting with those declared before it was joined.
    fn default() -> Units {
        let before = std::mem::take(&mut *BEFORE_JOIN.lock().expect("units lock"));
        Units {
            declared: Mutex::new(before),
            sharded: Mutex::new(Vec::new()),
            stores: Mutex::new(Vec::new()),
        }
    }
}

impl Units {
    pub fn declared(&self) -> Vec<Arc<Slot>> {
        self.declared.lock().expect("units lock").clone()
    }

    pub fn declare(&self, slot: Arc<Slot>) {
        self.declared.lock().expect("units lock").push(slot);
    }

    /// Registers a unit's sharded parameters: they are gathered through here.
    pub fn add_sharded(&self, params: Arc<dyn ShardedParameters>) {
        self.sharded.lock().expect("units lock").push(params);
    }

    fn sharded(&self) -> Vec<Arc<dyn ShardedParameters>> {
        self.sharded.lock().expect("units lock").clone()
    }

    /// Runs `f` with every sharded parameter of the run gathered, as
    /// [`ShardedParameters::with_full_parameters`] does for one unit's.
    ///
    /// # Errors
    /// `f`'s, or [`Error::Collective`](crate::Error::Collective) from a gather.
    pub fn with_full_parameters<R>(
        &self,
        writeback: bool,
        f: impl FnOnce() -> Result<R>,
    ) -> Result<R> {
        let units = self.sharded();
        // Each unit's gather around the next; the innermost runs `f`.
        fn nested(
            units: &[Arc<dyn ShardedParameters>],
            writeback: bool,
            f: &mut dyn FnMut() -> Result<()>,
        ) -> Result<()> {
            match units.split_first() {
                None => f(),
                Some((first, rest)) => {
                    first.with_full_parameters(writeback, &mut || nested(rest, writeback, f))
                }
            }
        }
        let (mut f, mut out) = (Some(f), None);
        nested(&units, writeback, &mut || {
            out = Some(f.take().expect("called once")()?);
            Ok(())
        })?;
        Ok(out.expect("the innermost call ran"))
    }

    /// Remembers a `VarStore` (its variables) the run has seen.
    pub fn know_store(&self, variables: &Arc<Mutex<Variables>>) {
        let mut stores = self.stores.lock().expect("units lock");
        stores.retain(|s| s.strong_count() > 0);
        if !stores
            .iter()
            .any(|s| std::ptr::eq(s.as_ptr(), Arc::as_ptr(variables)))
        {
            stores.push(Arc::downgrade(variables));
        }
    }

    /// The trainable variables under `path` (whose names start with `prefix`) that no
    /// sharded unit holds yet, with their names, in the order they were created; `None`
    /// when the run has seen no store that `path` belongs to. A store is `path`'s when
    /// `path` reaches its variables (tch's `Path` does not say which store it is of).
    pub fn variables_under(&self, path: &Path, prefix: &str) -> Option<(Vec<String>, Vec<Tensor>)> {
        let stores: Vec<Arc<Mutex<Variables>>> = self
            .stores
            .lock()
            .expect("units lock")
            .iter()
            .filter_map(Weak::upgrade)
            .collect();
        let held = self.sharded();
        for store in stores {
            let members: Vec<(String, Tensor)> = {
                let v = store.lock().expect("variable store lock");
                let names: std::collections::HashMap<usize, &String> = v
                    .named_variables
                    .iter()
                    .filter(|(name, _)| name.starts_with(prefix))
                    .map(|(name, t)| (crate::ffi::tensor_key(t), name))
                    .collect();
                v.trainable_variables
                    .iter()
                    .filter_map(|var| {
                        let key = crate::ffi::tensor_key(&var.tensor);
                        let name = names.get(&key)?;
                        (!held.iter().any(|u| u.holds(key)))
                            .then(|| ((*name).clone(), var.tensor.shallow_clone()))
                    })
                    .collect()
            };
            let Some((name, first)) = members.first() else {
                continue;
            };
            // `path` reaches the first of them: the store is `path`'s.
            let mut parts: Vec<&str> = name[prefix.len()..].split('.').collect();
            let last = parts.pop().unwrap_or_default();
            let reached = parts
                .into_iter()
                .fold(path.clone(), |p, part| p.sub(part))
                .get(last);
            if reached.is_some_and(|t| crate::ffi::tensor_key(&t) == crate::ffi::tensor_key(first))
            {
                return Some(members.into_iter().unzip());
            }
        }
        None
    }

    /// `var`'s whole value: gathered from its shards if a unit holds it (see
    /// [`ShardedParameters::whole`]), else `var` itself.
    ///
    /// # Errors
    /// [`Error::Collective`](crate::Error::Collective) from a gather.
    pub fn whole(&self, var: &Tensor) -> Result<Tensor> {
        let key = crate::ffi::tensor_key(var);
        for unit in self.sharded() {
            if let Some(whole) = unit.whole(key)? {
                return Ok(whole);
            }
        }
        Ok(var.shallow_clone())
    }

    /// Loads `var`'s rows through `rows` if a unit holds it (see
    /// [`ShardedParameters::load_rows`]); false when none does.
    ///
    /// # Errors
    /// `rows`' own.
    pub fn load_rows(
        &self,
        var: &Tensor,
        rows: &mut dyn FnMut(i64, i64) -> Result<Tensor>,
    ) -> Result<bool> {
        let key = crate::ffi::tensor_key(var);
        for unit in self.sharded() {
            if unit.load_rows(key, rows)? {
                return Ok(true);
            }
        }
        Ok(false)
    }

    /// After a load by rows: every unit that is gathered gathers its new values.
    ///
    /// # Errors
    /// [`Error::Collective`](crate::Error::Collective) from a gather.
    pub fn after_load(&self) -> Result<()> {
        self.sharded().iter().try_for_each(|unit| unit.after_load())
    }

    /// Makes every sharded parameter whole and exact for good (the run is over).
    ///
    /// # Errors
    /// [`Error::Collective`](crate::Error::Collective) from a gather.
    pub fn make_whole(&self) -> Result<()> {
        self.sharded().iter().try_for_each(|unit| unit.make_whole())
    }
}

impl std::fmt::Debug for Units {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let n = self.declared.lock().map_or(0, |u| u.len());
        write!(f, "{n} fully sharded unit(s)")
    }
}
