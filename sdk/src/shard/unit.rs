//! `fully_shard`: the units whose parameters a sharded optimizer gathers around their
//! forward and backward passes, as FSDP2's `fully_shard(module)`.

use std::sync::Arc;

use tch::nn::{Module, ModuleT, Path};
use tch::Tensor;

use super::engine::Inner;
use super::param_group::UnitParams;
use crate::unit_registry::Slot;

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
#[derive(Debug)]
pub struct FullyShard<M> {
    module: M,
    slot: Arc<Slot>,
}

/// Makes `module`, whose variables are those under `path`, a unit of fully sharded
/// training, as FSDP2's `fully_shard(module)`. Call it on the same module on every
/// rank, once the module is built. Variables that no unit holds form the root unit,
/// gathered after each step and kept. A unit nested in another holds its own
/// variables (declare the inner one first, as it is built first).
///
/// In a job that shards the parameters (`zero = 3`, several ranks) whose `VarStore`
/// the function has seen (`vs.root()` in the `#[distributed]` function), the unit's
/// trainable variables are sharded here, as DeepSpeed's `zero.Init`: every rank keeps
/// its rows of rank 0's values and frees the rest, so that the whole model is never on
/// a rank, only one unit at a time while it is built. Otherwise (a unit declared before
/// the job is joined, or under a store built elsewhere) they are sharded when the
/// sharded optimizer is built, which claims the units it finds: until then every rank
/// holds the whole model. The variables a unit holds are those under `path` when it
/// is sharded; one created there later belongs to the root.
///
/// ```no_run
/// # use tch::nn;
/// # let vs = nn::VarStore::new(tch::Device::Cpu);
/// let root = vs.root();
/// let layer = tch_distributed::fully_shard(nn::linear(&root / "l1", 1024, 1024, Default::default()), &(&root / "l1"));
/// ```
///
/// # Panics
/// As tch's modules do on a failure, when sharding the unit here fails: the ranks'
/// variables under `path` differ in shape, or a collective failed (a rank is gone or
/// the timeout passed).
pub fn fully_shard<M>(module: M, path: &Path) -> FullyShard<M> {
    let components: Vec<&str> = path.components().collect();
    let prefix = match components.is_empty() {
        true => String::new(),
        false => format!("{}.", components.join(".")),
    };
    let slot = Arc::new(Slot::new(prefix));
    match crate::init::current() {
        Some(ctx) => {
            ctx.units().declare(slot.clone());
            if let Err(e) = shard_now(&ctx, &slot, path) {
                panic!("Error: sharding the unit under `{}`: {e}", slot.prefix);
            }
        }
        None => crate::unit_registry::declare_before_join(slot.clone()),
    }
    FullyShard { module, slot }
}

/// Shards the unit's variables now, in a stage-3 job of several ranks whose store the
/// run knows (see [`fully_shard`]).
fn shard_now(ctx: &crate::init::Context, slot: &Slot, path: &Path) -> crate::Result<()> {
    if ctx.world_size() < 2 || ctx.settings().zero != Some(3) {
        return Ok(());
    }
    let Some((names, params)) = ctx.units().variables_under(path, &slot.prefix) else {
        return Ok(());
    };
    let group = ctx.process_group();
    let shard = ctx.mesh().map_or(group, |m| &m.shard);
    // Rank 0's values, as the optimizer's build gives the rest of the model.
    group.verify_same_shapes(&params)?;
    group.broadcast_coalesced(&params, 25 << 20, 0)?;
    if params.iter().any(|p| p.device() == tch::Device::Cpu) {
        crate::host_memory::return_freed_memory();
    }
    let unit = Arc::new(UnitParams::new(
        shard,
        names,
        params,
        &super::Policy::of(ctx),
        true,
    )?);
    ctx.units().add_sharded(unit.clone());
    slot.set_params(unit);
    Ok(())
}

impl<M> FullyShard<M> {
    /// The module.
    pub fn inner(&self) -> &M {
        &self.module
    }

    /// Runs `forward` on `xs` as a pass of the unit: between its gather and its
    /// reshard when its parameters are sharded (by its optimizer, which also
    /// prefetches the next unit and reduce-scatters the gradients, or on its own once
    /// sharded without one).
    fn around(&self, xs: &Tensor, forward: impl FnOnce(&Tensor) -> Tensor) -> Tensor {
        let bound = self
            .slot
            .bound()
            .and_then(|(engine, unit)| Some((engine.downcast::<Inner>().ok()?, unit)));
        let done = match bound {
            Some((inner, unit)) => inner.around_forward(unit, xs, forward),
            None => match self
                .slot
                .params()
                .and_then(|p| p.downcast::<UnitParams>().ok())
            {
                Some(params) => params.around_forward(xs, forward),
                None => return forward(xs),
            },
        };
        // tch's modules panic on a failed forward pass; so does this one (a gather's
        // collective failed: another rank is gone or timed out).
        done.unwrap_or_else(|e| panic!("Error: a fully sharded unit's forward pass: {e}"))
    }
}

impl<M: Module> Module for FullyShard<M> {
    fn forward(&self, xs: &Tensor) -> Tensor {
        self.around(xs, |xs| self.module.forward(xs))
    }
}

impl<M: ModuleT> FullyShard<M> {
    /// The forward pass of a module with a train mode (tch's `ModuleT`: dropout, batch
    /// norm), gathered as [`Module::forward`] is. (tch gives every `Module` its
    /// `ModuleT`, so a `FullyShard` of a `ModuleT`-only module has this method rather
    /// than the trait.)
    pub fn forward_t(&self, xs: &Tensor, train: bool) -> Tensor {
        self.around(xs, |xs| self.module.forward_t(xs, train))
    }
}

/// Runs `f` with every variable that ZeRO stage 3 sharded whole on this rank, as
/// FSDP's `summon_full_params` (FSDP2's `full_tensor()`): inside `f` a sharded
/// variable reads (and prints, saves, evaluates) as the whole tensor, in its own dtype
/// (under mixed precision too), as the optimizer's last step left it. Afterwards the
/// variables are resharded. With `writeback`, what `f` wrote into them is kept (each
/// rank's shard is cut from its values; write the same values on every rank); without,
/// it is dropped at the reshard.
///
/// Every rank must call it: the gathers are collectives. It gathers every unit at
/// once, so the whole model is on every rank while `f` runs: to save a model, call
/// `vs.save` (which writes one variable at a time) rather than reading it here. With
/// nothing sharded (other stages, one rank, no job) it just runs `f`.
///
/// ```no_run
/// # use tch::{nn, Kind};
/// # fn demo(vs: &nn::VarStore) -> tch_distributed::Result<()> {
/// let checksum = tch_distributed::summon_full_params(false, || {
///     vs.variables().values().map(|t| t.sum(Kind::Double).double_value(&[])).sum::<f64>()
/// })?;
/// # Ok(()) }
/// ```
///
/// # Errors
/// [`Error::Collective`](crate::Error::Collective) when a gather fails (a rank is
/// gone, or the timeout passed); [`Error::Usage`](crate::Error::Usage) when `f`
/// converted a sharded variable to another dtype or device (`vs.double()`,
/// `vs.set_device(…)`): a unit's shard stays in the dtype and device it was sharded in,
/// so the conversion is undone (give the `VarStore` its dtype and device before the
/// model is built). `f`'s own result is returned inside `Ok`.
pub fn summon_full_params<R>(writeback: bool, f: impl FnOnce() -> R) -> crate::Result<R> {
    match crate::init::current() {
        Some(ctx) => ctx.units().with_full_parameters(writeback, || Ok(f())),
        None => Ok(f()),
    }
}
