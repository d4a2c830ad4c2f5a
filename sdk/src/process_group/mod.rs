//! Process groups and collectives over libtorch's `c10d::ProcessGroup` (Gloo for CPU
//! tensors, NCCL for CUDA tensors).

use std::ffi::CString;
use std::fmt;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use tch::{Device, Tensor};

use crate::error::{Error, Result, TorchText};
use crate::ffi::process_group::{PgHandle, PgOptions, WorkHandle};
use crate::ffi::TensorArray;
use crate::protocol;
use crate::rendezvous::network::{self, GlooAddress};
use crate::rendezvous::store::{millis, Store};

mod collective_record;
mod mismatch;
pub use crate::settings::Backend;
use collective_record::CollectiveRecord;

/// A reduction for [`ProcessGroup::all_reduce`] and [`ProcessGroup::reduce_scatter`],
/// as `torch.distributed.ReduceOp`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ReduceOp {
    Sum,
    /// The mean over ranks. Floating-point tensors only. Gloo has no native average:
    /// it sums and divides by the world size.
    Avg,
    Product,
    Min,
    Max,
}

impl ReduceOp {
    fn code(self) -> i32 {
        // c10d::ReduceOp::RedOpType numbering.
        match self {
            ReduceOp::Sum => 0,
            ReduceOp::Avg => 1,
            ReduceOp::Product => 2,
            ReduceOp::Min => 3,
            ReduceOp::Max => 4,
        }
    }
}

/// Process groups this process has created: each keeps its records in the store
/// under a prefix of its own (every rank creates its groups in the same order).
static GROUPS: AtomicU64 = AtomicU64::new(0);

/// A group of `world_size` processes that run collectives together, as
/// `torch.distributed.ProcessGroup`. Clones share the same group.
///
/// Every collective blocks until it completes and must be called by every rank in
/// the same order; one that does not complete within the group's timeout returns
/// [`Error::Timeout`] naming the operation, the time waited and, from the store, the
/// ranks that did not arrive. For that, each rank of a group of several records in
/// the store each collective it enters (one `set`, not waited for) and beats a
/// heartbeat there once a second from a thread of its own.
#[derive(Clone)]
pub struct ProcessGroup {
    shared: Arc<Shared>,
    rank: usize,
    world_size: usize,
    backend: Backend,
    timeout: Duration,
    gloo: GlooAddress,
}

/// What the clones of a group share.
struct Shared {
    /// Dropped before `raw`: stops the heartbeat.
    collectives: Option<CollectiveRecord>,
    raw: PgHandle,
    /// Models wrapped in DDP over this group so far (their records' keys).
    models: AtomicU64,
    /// Gradient averages over this group so far: DDP's synchronized backward passes.
    /// A sharded training loop during which it does not grow trains apart on each
    /// rank (see `Sharded`'s watch).
    gradient_averages: AtomicU64,
}

impl ProcessGroup {
    /// Joins the group through `store`: every rank must call this with the same
    /// `world_size`, `backend` and store. Gloo always serves CPU tensors; with
    /// [`Backend::Nccl`] NCCL serves CUDA tensors on `device` (`Device::Cuda(i)`), and
    /// with [`Backend::Gloo`] Gloo serves them too (staged through host memory), as
    /// `torch.distributed`'s `"gloo"` does, so several ranks can share one GPU.
    ///
    /// # Errors
    /// [`Error::BackendUnavailable`] when NCCL is asked for and was not built
    /// or `device` is not CUDA; [`Error::Rendezvous`] when the other ranks do not join
    /// within `timeout`.
    pub fn new(
        store: &Store,
        rank: usize,
        world_size: usize,
        backend: Backend,
        device: Device,
        timeout: Duration,
    ) -> Result<ProcessGroup> {
        Self::join(store, rank, world_size, backend, device, timeout, false)
    }

    /// As [`new`](Self::new), with every collective compared across the ranks before it
    /// runs: its kind, and its tensors' shapes and dtypes, by c10d's
    /// `ProcessGroupWrapper` over a Gloo group of its own, as `torch.distributed` under
    /// `TORCH_DISTRIBUTED_DEBUG=DETAIL` (the `debug = "detail"` setting). A mismatch is
    /// an [`Error::Collective`] on every rank, naming the ranks and their collectives,
    /// where it would otherwise hang or abort. Each collective costs an extra
    /// all-gather and barrier.
    ///
    /// # Errors
    /// As [`new`](Self::new).
    pub fn checked(
        store: &Store,
        rank: usize,
        world_size: usize,
        backend: Backend,
        device: Device,
        timeout: Duration,
    ) -> Result<ProcessGroup> {
        Self::join(store, rank, world_size, backend, device, timeout, true)
    }

    fn join(
        store: &Store,
        rank: usize,
        world_size: usize,
        backend: Backend,
        device: Device,
        timeout: Duration,
        checks: bool,
    ) -> Result<ProcessGroup> {
        if rank >= world_size {
            return Err(Error::Usage(format!(
                "rank {rank} is not below the world size {world_size}"
            )));
        }
        let cuda_device = match (backend, device) {
            (Backend::Nccl, _) if !crate::compat::nccl_available() => {
                return Err(Error::BackendUnavailable(
                    "the NCCL backend was not compiled into tch-distributed: build against a libtorch with CUDA \
                     with the CUDA headers installed (the README's setup does this), or use the gloo backend"
                        .into(),
                ))
            }
            (Backend::Nccl, Device::Cuda(i)) => i as i32,
            (Backend::Nccl, other) => {
                return Err(Error::BackendUnavailable(format!(
                    "the NCCL backend needs a CUDA device, got {other:?}: use the gloo backend on CPU"
                )))
            }
            (Backend::Gloo, _) => -1,
        };
        let rendezvous_error = |message| Error::Rendezvous {
            addr: "(store)".into(),
            port: store.port().unwrap_or(0),
            rank: Some(rank),
            world_size,
            message,
        };
        let group = GROUPS.fetch_add(1, Ordering::Relaxed);
        let collectives = if world_size > 1 {
            Some(
                CollectiveRecord::start(store, group, rank, world_size, timeout)
                    .map_err(|e| rendezvous_error(e.to_string()))?,
            )
        } else {
            None
        };
        let nccl = backend == Backend::Nccl;
        let gloo = GlooAddress::choose(protocol::gloo_socket_ifname(), store.endpoint())
            .map_err(rendezvous_error)?;
        if let (true, Some(name)) = (nccl, gloo.route_interface()) {
            protocol::default_nccl_socket_ifname(name);
        }
        let interfaces = CString::new(gloo.interfaces())
            .map_err(|_| Error::Config(format!("{} contains a NUL byte", network::GLOO_IFNAME)))?;
        let address = CString::new(gloo.address()).expect("an address has no NUL byte");
        let options = PgOptions {
            rank: rank as i32,
            world_size: world_size as i32,
            timeout_ms: millis(timeout),
            gloo: true,
            nccl,
            cuda_device,
            gloo_interfaces: &interfaces,
            gloo_address: &address,
            checks,
        };
        let raw = PgHandle::new(store.raw(), &options).map_err(|text| {
            rendezvous_error(network::connect_failure(rank, &text, store.endpoint()))
        })?;
        Ok(ProcessGroup {
            shared: Arc::new(Shared {
                collectives,
                raw,
                models: AtomicU64::new(0),
                gradient_averages: AtomicU64::new(0),
            }),
            rank,
            world_size,
            backend,
            timeout,
            gloo,
        })
    }

    /// The address this rank's Gloo device listens on, and why (see [`GlooAddress`]).
    pub fn gloo_address(&self) -> &GlooAddress {
        &self.gloo
    }

    /// This process's rank, in `0..world_size`.
    pub fn rank(&self) -> usize {
        self.rank
    }

    /// The number of processes in the group.
    pub fn world_size(&self) -> usize {
        self.world_size
    }

    /// The backend serving this group's accelerator tensors.
    pub fn backend(&self) -> Backend {
        self.backend
    }

    /// How long a collective may wait for the other ranks.
    pub fn timeout(&self) -> Duration {
        self.timeout
    }

    /// The group's handle, for the Reducer built over it.
    pub(crate) fn raw(&self) -> &PgHandle {
        &self.shared.raw
    }

    /// Records in the store that this rank enters its next collective, `what` (see
    /// the type's doc); returns its number, 0 in a group of one.
    pub(crate) fn enter(&self, what: &str) -> u64 {
        match &self.shared.collectives {
            Some(p) => p.enter(what),
            None => 0,
        }
    }

    /// Records that this rank left collective `n` (numbered by [`enter`](Self::enter)),
    /// completed or failed.
    pub(crate) fn leave(&self, n: u64) {
        if let Some(p) = &self.shared.collectives {
            p.leave(n);
        }
    }

    /// How long a collective waits before this rank reads the other ranks' records
    /// for a collective that cannot match (see [`Error::Deadlock`]); 5 s unless set.
    pub(crate) fn check_deadlocks_after(&self, after: Duration) {
        if let Some(p) = &self.shared.collectives {
            p.check_deadlocks_after(after);
        }
    }

    /// The error for collective `n` (`what`, numbered by [`enter`](Self::enter)) that
    /// libtorch reports as timed out with `text`: which ranks did not arrive, from
    /// their records and heartbeats in the store (this takes a few seconds), and what
    /// to check.
    pub(crate) fn timed_out(&self, what: &str, n: u64, text: TorchText) -> Error {
        let (stalled, report) = match &self.shared.collectives {
            Some(p) => {
                let f = p.diagnose(n, what, self.timeout);
                (f.stalled, f.report)
            }
            None => (vec![], "the only rank is this one".to_string()),
        };
        Error::Timeout {
            op: format!("{what} (collective {n} of rank {})", self.rank),
            timeout: self.timeout,
            stalled,
            report,
            source: text,
        }
    }

    /// When libtorch's `text` says that a peer closed its connection: who, as its
    /// launcher reported it to the job's store (tchrun on several nodes; waited for up
    /// to 3 s), else the peer's address from the text. `None` for other failures.
    pub(crate) fn peer_lost(&self, text: &TorchText) -> Option<String> {
        let full = text.full();
        let lost = [
            "closed by peer",
            "reset by peer",
            "Broken pipe",
            "Connection closed",
        ]
        .iter()
        .any(|s| full.contains(s));
        if !lost {
            return None;
        }
        let reported = self
            .shared
            .collectives
            .as_ref()
            .and_then(|p| p.reported_failure(Duration::from_secs(3)));
        Some(match reported {
            Some(line) => format!(
                "{line}, as its launcher reported, so rank {} lost its connection to it",
                self.rank
            ),
            None => {
                let peer = network::peer_endpoint(full)
                    .map(|peer| format!(" at {}", peer.ip()))
                    .unwrap_or_default();
                format!(
                    "a peer{peer} closed its connection to rank {}: a rank there stopped (it \
                     failed or was killed); its own output, or its launcher's, says why",
                    self.rank
                )
            }
        })
    }

    /// The store under this group's own prefix, in a group of several ranks.
    pub(crate) fn records(&self) -> Option<&Store> {
        self.shared.collectives.as_ref().map(|p| p.view())
    }

    /// A number for the next model wrapped in DDP over this group, the same on every
    /// rank (they wrap their models in the same order).
    pub(crate) fn next_model(&self) -> u64 {
        self.shared.models.fetch_add(1, Ordering::Relaxed)
    }

    /// How many times gradients were averaged over this group (DDP's synchronized
    /// backward passes, a sharded optimizer's reduce-scatters, over any of its
    /// clones).
    pub(crate) fn gradient_averages(&self) -> u64 {
        self.shared.gradient_averages.load(Ordering::Relaxed)
    }

    /// Counts one average of the gradients over this group.
    pub(crate) fn count_gradient_average(&self) {
        self.shared
            .gradient_averages
            .fetch_add(1, Ordering::Relaxed);
    }

    /// Runs collective `op` (`call`, a shim call), recorded by [`enter`](Self::enter).
    fn run(
        &self,
        op: &'static str,
        call: impl FnOnce() -> std::result::Result<(), TorchText>,
    ) -> Result<()> {
        let n = self.enter(op);
        let done = call();
        self.leave(n);
        done.map_err(|text| {
            if text.is_timeout() {
                self.timed_out(op, n, text)
            } else {
                let message = text.message();
                Error::Collective {
                    op,
                    message: match (mismatch::describe(&message), self.peer_lost(&text)) {
                        (Some(mismatch), _) => mismatch,
                        (None, Some(cause)) => format!("{cause}\n{message}"),
                        (None, None) => message,
                    },
                }
            }
        })
    }

    /// Reduces `tensor` across all ranks in place with `op`; every rank ends with the
    /// result, as `torch.distributed.all_reduce`. Any shape and dtype (`Avg` needs a
    /// floating-point dtype).
    ///
    /// # Errors
    /// [`Error::Collective`] when the collective fails (a rank left, a mismatch), [`Error::Timeout`] when a rank does not arrive in time.
    pub fn all_reduce(&self, tensor: &mut Tensor, op: ReduceOp) -> Result<()> {
        if op == ReduceOp::Avg && !tensor.is_floating_point() {
            return Err(Error::Usage(format!(
                "ReduceOp::Avg needs a floating-point tensor, got {:?}: use ReduceOp::Sum and divide",
                tensor.kind()
            )));
        }
        self.run("all_reduce", || {
            self.raw()
                .all_reduce(tensor, op.code(), millis(self.timeout))
        })
    }

    /// Copies `tensor` from rank `root` to every other rank, in place, as
    /// `torch.distributed.broadcast`.
    ///
    /// # Errors
    /// As [`all_reduce`](Self::all_reduce).
    pub fn broadcast(&self, tensor: &mut Tensor, root: usize) -> Result<()> {
        self.check_root(root)?;
        self.run("broadcast", || {
            self.raw()
                .broadcast(tensor, root as i32, millis(self.timeout))
        })
    }

    /// Gathers `tensor` from every rank; element `r` of the result is rank `r`'s
    /// tensor (same shape and dtype on every rank), as `torch.distributed.all_gather`.
    ///
    /// # Errors
    /// As [`all_reduce`](Self::all_reduce).
    pub fn all_gather(&self, tensor: &Tensor) -> Result<Vec<Tensor>> {
        let input = tensor.contiguous();
        let outputs: Vec<Tensor> = (0..self.world_size).map(|_| input.empty_like()).collect();
        self.all_gather_start(&outputs, &input)?.wait()?;
        Ok(outputs)
    }

    /// [`all_gather`](Self::all_gather) into `outputs` (one contiguous tensor per
    /// rank, of `input`'s shape and dtype; views of one buffer are fine), started: the
    /// outputs hold the result once [`Pending::wait`] returned. Every rank starts its
    /// collectives in the same order, as for the blocking ones.
    ///
    /// # Errors
    /// [`Error::Collective`] when the backend cannot start it.
    pub(crate) fn all_gather_start(&self, outputs: &[Tensor], input: &Tensor) -> Result<Pending> {
        let work = self
            .raw()
            .all_gather_start(&TensorArray::new(outputs), input, millis(self.timeout))
            .map_err(|message| Error::Collective {
                op: "all_gather",
                message,
            })?;
        Ok(Pending {
            group: self.clone(),
            work,
        })
    }

    /// Reduces `inputs[r]` across ranks with `op` and leaves the result on rank `r`,
    /// as `torch.distributed.reduce_scatter`. `inputs` holds one tensor per rank, all
    /// of one shape; the result has that shape.
    ///
    /// # Errors
    /// [`Error::Usage`] when `inputs.len() != world_size` or `op` is
    /// [`ReduceOp::Avg`] on an integer dtype; an error from the
    /// backend where it has no reduce-scatter.
    pub fn reduce_scatter(&self, inputs: &[Tensor], op: ReduceOp) -> Result<Tensor> {
        if inputs.len() != self.world_size {
            return Err(Error::Usage(format!(
                "reduce_scatter needs one input per rank: got {}, world size {}",
                inputs.len(),
                self.world_size
            )));
        }
        if op == ReduceOp::Avg && !inputs[0].is_floating_point() {
            return Err(Error::Usage(
                "ReduceOp::Avg needs a floating-point tensor: use ReduceOp::Sum and divide".into(),
            ));
        }
        let inputs: Vec<Tensor> = inputs.iter().map(|t| t.contiguous()).collect();
        let output = inputs[0].empty_like();
        self.reduce_scatter_into(&output, &inputs, op)?;
        Ok(output)
    }

    /// [`reduce_scatter`](Self::reduce_scatter) into `output`, from contiguous `inputs`
    /// of its shape (views of one buffer are fine), one per rank.
    pub(crate) fn reduce_scatter_into(
        &self,
        output: &Tensor,
        inputs: &[Tensor],
        op: ReduceOp,
    ) -> Result<()> {
        let inputs = TensorArray::new(inputs);
        self.run("reduce_scatter", || {
            self.raw()
                .reduce_scatter(output, &inputs, op.code(), millis(self.timeout))
        })
    }

    /// Blocks until every rank has reached this barrier, as `torch.distributed.barrier`.
    ///
    /// # Errors
    /// As [`all_reduce`](Self::all_reduce).
    pub fn barrier(&self) -> Result<()> {
        self.run("barrier", || self.raw().barrier(millis(self.timeout)))
    }

    /// Broadcasts `tensors` from `root` in flattened buffers of at most
    /// `buffer_bytes` bytes, without recording autograd history
    /// (`c10d::broadcast_coalesced`, as DDP uses for parameters and buffers).
    ///
    /// # Errors
    /// As [`all_reduce`](Self::all_reduce).
    pub fn broadcast_coalesced(
        &self,
        tensors: &[Tensor],
        buffer_bytes: usize,
        root: usize,
    ) -> Result<()> {
        self.check_root(root)?;
        let tensors = TensorArray::new(tensors);
        self.run("broadcast_coalesced", || {
            self.raw()
                .broadcast_coalesced(&tensors, buffer_bytes, root as i32)
        })
    }

    /// Checks that every rank has the same number of tensors as rank 0, with the same
    /// shapes, dtypes and layouts (`c10d::verify_params_across_processes`).
    ///
    /// # Errors
    /// [`Error::Collective`] whose message names the first mismatch.
    pub fn verify_same_shapes(&self, tensors: &[Tensor]) -> Result<()> {
        let tensors = TensorArray::new(tensors);
        self.run("verify_params_across_processes", || {
            self.raw().verify_params(&tensors)
        })
    }

    fn check_root(&self, root: usize) -> Result<()> {
        if root >= self.world_size {
            return Err(Error::Usage(format!(
                "root rank {root} is not below the world size {}",
                self.world_size
            )));
        }
        Ok(())
    }
}

/// A collective started by [`ProcessGroup::all_gather_start`] and not waited for yet.
/// Dropped without a wait, it still completes (the backend keeps its tensors).
pub(crate) struct Pending {
    group: ProcessGroup,
    work: WorkHandle,
}

impl Pending {
    /// Waits until the collective completes; the wait is recorded as a blocking
    /// collective's (its number, for the diagnosis of a stall, is taken now).
    ///
    /// # Errors
    /// As the blocking collective's ([`Error::Collective`], [`Error::Timeout`]).
    pub(crate) fn wait(self) -> Result<()> {
        let timeout = millis(self.group.timeout);
        self.group.run("all_gather", || self.work.wait(timeout))
    }
}

impl fmt::Debug for ProcessGroup {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ProcessGroup")
            .field("rank", &self.rank)
            .field("world_size", &self.world_size)
            .field("backend", &self.backend)
            .field("timeout", &self.timeout)
            .finish()
    }
}
