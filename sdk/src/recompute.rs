//! Activation checkpointing (recomputation), as `torch.utils.checkpoint.checkpoint`: none of a block's
//! activations outlive its forward pass, and the backward pass runs the block again to
//! differentiate it. The autograd node is the shim's (`csrc/activation.cpp`); the
//! block is a Rust closure it calls back.

use std::sync::{Arc, Mutex};

use tch::nn::{Module, ModuleT};
use tch::Tensor;

use crate::error::{Error, Result};
use crate::ffi::activation::{self, CheckpointError};

/// The most outputs a checkpointed block may return.
const MAX_OUTPUTS: usize = 64;

/// A block [`checkpoint`] can run again in the backward pass: a closure from one tensor
/// to one, that owns what it uses (`Fn(&Tensor) -> Tensor + Send + 'static`). The
/// backward pass may run on another thread (autograd's device thread on CUDA), after
/// the function that made the closure returned, so a closure that borrows its block
/// (`|x| blocks[i].forward(x)` over a `Vec`'s module) is not one: wrap the module itself
/// with [`checkpointed`], or move an owned clone into the closure. Implemented for
/// every such closure.
#[diagnostic::on_unimplemented(
    message = "`tch_distributed::checkpoint` needs a block that owns what it uses \
               (`Fn(&Tensor) -> Tensor + Send + 'static`): it keeps the block until the \
               backward pass runs it again, maybe on another thread",
    label = "this block borrows what it uses (a module of a `Vec`, a local), or is not \
             a `Fn(&Tensor) -> Tensor`",
    note = "wrap the module itself, which the checkpoint then owns: \
            `tch_distributed::checkpointed(block)` (`checkpointed_t` for a `ModuleT`), \
            and call its `forward`; or move an owned clone into the closure: \
            `move |x| block.forward(x)`"
)]
pub trait BlockOne: Fn(&Tensor) -> Tensor + Send + 'static {}

#[diagnostic::do_not_recommend]
impl<F: Fn(&Tensor) -> Tensor + Send + 'static> BlockOne for F {}

/// A block [`checkpoint_many`] can run again in the backward pass:
/// `Fn(&[Tensor]) -> Vec<Tensor> + Send + 'static`, as [`BlockOne`] for several
/// tensors.
#[diagnostic::on_unimplemented(
    message = "`tch_distributed::checkpoint_many` needs a block that owns what it uses \
               (`Fn(&[Tensor]) -> Vec<Tensor> + Send + 'static`): it keeps the block \
               until the backward pass runs it again, maybe on another thread",
    label = "this block borrows what it uses (a module of a `Vec`, a local), or is not \
             a `Fn(&[Tensor]) -> Vec<Tensor>`",
    note = "move an owned clone of what it uses into the closure \
            (`move |xs| …`), or wrap a module with `tch_distributed::checkpointed(block)`"
)]
pub trait BlockMany: Fn(&[Tensor]) -> Vec<Tensor> + Send + 'static {}

#[diagnostic::do_not_recommend]
impl<F: Fn(&[Tensor]) -> Vec<Tensor> + Send + 'static> BlockMany for F {}

/// [`checkpoint_many`], returning its errors: [`Error::Usage`] for a block that
/// returns its input (or a view of it), whose outputs do not depend on its inputs that
/// require a gradient, or that returns more than 64 tensors; [`Error::Torch`] for a
/// failure of the forward pass.
///
/// # Errors
/// [`Error::Usage`] for a block that returns its input (or a view of it), whose outputs do not depend on its inputs that require a gradient, or that returns more than 64 tensors; [`Error::Torch`] for a failure of the forward pass.
pub fn f_checkpoint_many(block: impl BlockMany, inputs: &[Tensor]) -> Result<Vec<Tensor>> {
    activation::checkpoint(Box::new(block), inputs, MAX_OUTPUTS).map_err(|e| match e {
        // The shim's usage error: a block that returns its input, or ignores the
        // inputs that require a gradient, or too many outputs.
        CheckpointError::Usage(e) => Error::Usage(format!("activation checkpointing: {e}")),
        CheckpointError::Failed(e) => {
            Error::Torch(format!("a checkpointed block's forward pass: {e}"))
        }
    })
}

/// Runs `block` on `inputs` without keeping its activations, as
/// `torch.utils.checkpoint.checkpoint(block, *inputs, use_reentrant=False)`: in the
/// backward pass the block runs again, with autograd, and is differentiated. Returns
/// the block's outputs (at most 64), the same values as `block(inputs)`.
///
/// - The first run records autograd's graph, as PyTorch's forward pass does, to learn
///   what the outputs depend on; the graph, and the activations it holds, are
///   dropped before this returns. The peak is one block's activations, as in the
///   recompute.
/// - Outputs that depend on nothing that requires a gradient (a frozen block on the
///   data) are returned as the block made them: nothing runs again for them.
/// - The block's node in the graph has an edge to each of its inputs, each parameter
///   it used and each tensor it captured (what the first run's graph reached). The
///   recompute's gradients go along them: a parameter gets its gradient once per
///   backward pass, all its uses summed, so DDP's hooks fire once, and DDP's
///   `find_unused_parameters` search of the graph finds the block's parameters.
/// - The recompute draws the same random numbers (dropout) as the first run: the CPU
///   generator's state, and that of each CUDA device of the inputs, are set back for
///   it, as PyTorch's `preserve_rng_state`; autocast's state is the first run's too,
///   with its cache of casts off in both runs.
/// - A block none of whose inputs requires a gradient (the first block, on the data or
///   on token ids) is differentiated still, for its parameters, as under
///   `use_reentrant=False`; PyTorch's reentrant checkpoint gives its parameters none.
/// - Under `tch::no_grad` it runs the block.
///
/// The block must compute from its inputs. Errors at the call: a block that returns an
/// input (or a view of it), and one with inputs that require a gradient none of which
/// its outputs depend on (it ignores them, or uses them through operations without a
/// gradient, such as `argmax`). In the backward pass, a block whose recompute uses a
/// tensor that requires a gradient and that its first run did not use fails it (its
/// gradient would be lost). The graph cannot be differentiated twice (`retain_graph`).
///
/// Panics with `Error: …` where [`f_checkpoint_many`] returns an error (as tch's
/// modules panic on a failed forward pass).
///
/// # Panics
/// With `Error: …` where [`f_checkpoint_many`] returns an error.
pub fn checkpoint_many(block: impl BlockMany, inputs: &[Tensor]) -> Vec<Tensor> {
    f_checkpoint_many(block, inputs).unwrap_or_else(|e| panic!("Error: {e}"))
}

/// [`checkpoint_many`] for a block of one input and one output: `block(input)`
/// without its activations, recomputed in the backward pass.
///
/// ```no_run
/// # use tch::{nn, nn::Module, Tensor};
/// # let vs = nn::VarStore::new(tch::Device::Cpu);
/// # let x = Tensor::zeros([8, 64], (tch::Kind::Float, tch::Device::Cpu));
/// let layer = nn::linear(vs.root() / "l1", 64, 64, Default::default());
/// let y = tch_distributed::checkpoint(move |x| layer.forward(x).gelu("none"), &x);
/// ```
pub fn checkpoint(block: impl BlockOne, input: &Tensor) -> Tensor {
    checkpoint_many(move |xs| vec![block(&xs[0])], std::slice::from_ref(input)).remove(0)
}

/// A module whose forward pass is checkpointed ([`checkpoint`]): it implements tch's
/// `Module`, so the program uses it as the module itself (in an `nn::seq()` too). Made
/// by [`checkpointed`]; [`CheckpointedT`] is the same for a `ModuleT`.
#[derive(Debug)]
pub struct Checkpointed<M> {
    module: Arc<Mutex<M>>,
}

/// A module with a train mode (dropout, batch norm) whose forward pass is
/// checkpointed ([`checkpoint`]): it implements tch's `ModuleT`, so the program uses it
/// as the module itself (in an `nn::seq_t()` too); both runs of the block see the same
/// `train`. Made by [`checkpointed_t`], as tch's `nn::func_t` is to `nn::func`.
#[derive(Debug)]
pub struct CheckpointedT<M> {
    module: Arc<Mutex<M>>,
}

/// `module` with its forward pass checkpointed, as wrapping a block's forward in
/// `torch.utils.checkpoint.checkpoint`: its activations are recomputed in the backward
/// pass rather than kept. For a `ModuleT` (a block with dropout, a `func_t`), use
/// [`checkpointed_t`].
pub fn checkpointed<M: Module + 'static>(module: M) -> Checkpointed<M> {
    Checkpointed {
        module: Arc::new(Mutex::new(module)),
    }
}

/// [`checkpointed`] for a `ModuleT`: `module.forward_t(xs, train)` checkpointed.
///
/// ```no_run
/// # use tch::nn::{self, ModuleT};
/// # let vs = nn::VarStore::new(tch::Device::Cpu);
/// let mut blocks = nn::seq_t();
/// for i in 0..4 {
///     let linear = nn::linear(vs.root() / i, 64, 64, Default::default());
///     let block = nn::func_t(move |xs, train| xs.apply(&linear).gelu("none").dropout(0.1, train));
///     blocks = blocks.add(tch_distributed::checkpointed_t(block));
/// }
/// ```
pub fn checkpointed_t<M: ModuleT + 'static>(module: M) -> CheckpointedT<M> {
    CheckpointedT {
        module: Arc::new(Mutex::new(module)),
    }
}

/// The module behind a lock shared with the blocks the backward pass has yet to run.
fn lock<M>(module: &Mutex<M>) -> std::sync::MutexGuard<'_, M> {
    module.lock().unwrap_or_else(|e| e.into_inner())
}

impl<M> Checkpointed<M> {
    /// The module.
    pub fn inner(&self) -> std::sync::MutexGuard<'_, M> {
        lock(&self.module)
    }
}

impl<M> CheckpointedT<M> {
    /// The module.
    pub fn inner(&self) -> std::sync::MutexGuard<'_, M> {
        lock(&self.module)
    }
}

impl<M: Module + 'static> Module for Checkpointed<M> {
    fn forward(&self, xs: &Tensor) -> Tensor {
        let module = self.module.clone();
        checkpoint(move |x| lock(&module).forward(x), xs)
    }
}

impl<M: ModuleT + 'static> ModuleT for CheckpointedT<M> {
    fn forward_t(&self, xs: &Tensor, train: bool) -> Tensor {
        let module = self.module.clone();
        checkpoint(move |x| lock(&module).forward_t(x, train), xs)
    }
}
