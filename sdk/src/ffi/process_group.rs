//! c10d process groups and their collectives (`shim.cpp`'s `tdc_pg_*`, `tdc_work_*`
//! and collectives): an owned group, [`PgHandle`], whose methods are the collectives
//! (each borrows its tensors for the call), and an owned started collective,
//! [`WorkHandle`].

use std::ffi::{c_int, CStr};
use std::ptr::NonNull;

use tch::Tensor;

use super::store::StoreHandle;
use super::sys;
use super::tensor::{ptr, TensorArray};
use super::{check_ptr, check_text};
use crate::error::TorchText;

/// Whether the NCCL backend was compiled into this build (`tdc_nccl_compiled`).
pub(crate) fn nccl_compiled() -> bool {
    // SAFETY: no arguments, no failure: it reads a constant of the build.
    unsafe { sys::tdc_nccl_compiled() != 0 }
}

/// How to build a process group ([`PgHandle::new`]), as `tdc_pg_new` takes it.
pub(crate) struct PgOptions<'a> {
    pub rank: i32,
    pub world_size: i32,
    pub timeout_ms: i64,
    /// Gloo for CPU tensors.
    pub gloo: bool,
    /// NCCL for CUDA tensors on `cuda_device`.
    pub nccl: bool,
    pub cuda_device: i32,
    /// Gloo's device: interface names (comma-separated) when not empty, else this
    /// address when not empty, else the hostname's address.
    pub gloo_interfaces: &'a CStr,
    pub gloo_address: &'a CStr,
    /// c10d's `ProcessGroupWrapper` around every backend (collective checks).
    pub checks: bool,
}

/// An owned `c10d::ProcessGroup` (`tdc_pg*`): freed when dropped. Its collectives
/// block until done or until their timeout.
pub(crate) struct PgHandle(NonNull<sys::Pg>);

// SAFETY: a `tdc_pg` holds only an intrusive pointer to a c10d process group; c10d's
// process groups are thread-safe (the backends queue collectives from any thread,
// which DDP's Reducer relies on from autograd's threads), so the handle may be used,
// and freed, from any thread.
unsafe impl Send for PgHandle {}
// SAFETY: as for `Send`: every operation through `&PgHandle` is a thread-safe
// collective of the group.
unsafe impl Sync for PgHandle {}

impl PgHandle {
    /// Joins the group of `options.world_size` ranks through `store` (`tdc_pg_new`).
    ///
    /// # Errors
    /// libtorch's message when the other ranks do not join in time, or a backend
    /// cannot be made.
    pub(crate) fn new(store: &StoreHandle, options: &PgOptions<'_>) -> Result<PgHandle, String> {
        // SAFETY: `store` is a live store (the group keeps its own reference to it) and
        // both strings are C strings for the call.
        let raw = unsafe {
            sys::tdc_pg_new(
                store.as_raw(),
                options.rank,
                options.world_size,
                options.timeout_ms,
                c_int::from(options.gloo),
                c_int::from(options.nccl),
                options.cuda_device,
                options.gloo_interfaces.as_ptr(),
                options.gloo_address.as_ptr(),
                c_int::from(options.checks),
            )
        };
        check_ptr(raw).map(PgHandle).map_err(|t| t.message())
    }

    /// The raw handle, for another wrapper of this module's parent that passes it to
    /// the shim while `self` is borrowed.
    pub(super) fn as_raw(&self) -> *mut sys::Pg {
        self.0.as_ptr()
    }

    /// All-reduces `t` in place with reduction `op` (c10d's `ReduceOp` numbering)
    /// (`tdc_all_reduce`).
    ///
    /// # Errors
    /// libtorch's text (a timeout, a peer lost, a mismatch).
    pub(crate) fn all_reduce(
        &self,
        t: &Tensor,
        op: c_int,
        timeout_ms: i64,
    ) -> Result<(), TorchText> {
        // SAFETY: `self` is a live group and `t` a tensor borrowed for the call.
        check_text(unsafe { sys::tdc_all_reduce(self.as_raw(), ptr(t), op, timeout_ms) })
    }

    /// Broadcasts `t` in place from rank `root` (`tdc_broadcast`).
    ///
    /// # Errors
    /// libtorch's text.
    pub(crate) fn broadcast(
        &self,
        t: &Tensor,
        root: c_int,
        timeout_ms: i64,
    ) -> Result<(), TorchText> {
        // SAFETY: `self` is a live group and `t` a tensor borrowed for the call.
        check_text(unsafe { sys::tdc_broadcast(self.as_raw(), ptr(t), root, timeout_ms) })
    }

    /// Reduce-scatters `inputs` (one per rank) into `output` (`tdc_reduce_scatter`).
    ///
    /// # Errors
    /// libtorch's text.
    pub(crate) fn reduce_scatter(
        &self,
        output: &Tensor,
        inputs: &TensorArray<'_>,
        op: c_int,
        timeout_ms: i64,
    ) -> Result<(), TorchText> {
        inputs.assert_complete(inputs.len(), "reduce_scatter's inputs");
        // SAFETY: `self` is a live group; `output` and every input are tensors
        // borrowed for the call (`inputs` holds `count()` of them, none NULL).
        check_text(unsafe {
            sys::tdc_reduce_scatter(
                self.as_raw(),
                ptr(output),
                inputs.as_ptr(),
                inputs.count(),
                op,
                timeout_ms,
            )
        })
    }

    /// Waits until every rank reached the barrier (`tdc_barrier`).
    ///
    /// # Errors
    /// libtorch's text.
    pub(crate) fn barrier(&self, timeout_ms: i64) -> Result<(), TorchText> {
        // SAFETY: `self` is a live group.
        check_text(unsafe { sys::tdc_barrier(self.as_raw(), timeout_ms) })
    }

    /// Starts an all-gather of `input` into `outputs`, one per rank
    /// (`tdc_all_gather_start`); the backend keeps its own references to the tensors
    /// until it completes, so they are borrowed for the call only.
    ///
    /// # Errors
    /// libtorch's message when it cannot start.
    pub(crate) fn all_gather_start(
        &self,
        outputs: &TensorArray<'_>,
        input: &Tensor,
        timeout_ms: i64,
    ) -> Result<WorkHandle, String> {
        outputs.assert_complete(outputs.len(), "all_gather's outputs");
        // SAFETY: `self` is a live group; `input` and every output are tensors
        // borrowed for the call (the work holds `at::Tensor` copies of them).
        let raw = unsafe {
            sys::tdc_all_gather_start(
                self.as_raw(),
                outputs.as_ptr(),
                outputs.count(),
                ptr(input),
                timeout_ms,
            )
        };
        check_ptr(raw).map(WorkHandle).map_err(|t| t.message())
    }

    /// Broadcasts `ts` from `root` in flattened buffers of at most `buffer_bytes`
    /// (`tdc_broadcast_coalesced`).
    ///
    /// # Errors
    /// libtorch's text.
    pub(crate) fn broadcast_coalesced(
        &self,
        ts: &TensorArray<'_>,
        buffer_bytes: usize,
        root: c_int,
    ) -> Result<(), TorchText> {
        ts.assert_complete(ts.len(), "broadcast_coalesced's tensors");
        // SAFETY: `self` is a live group and every tensor is borrowed for the call.
        check_text(unsafe {
            sys::tdc_broadcast_coalesced(self.as_raw(), ts.as_ptr(), ts.count(), buffer_bytes, root)
        })
    }

    /// Checks that every rank has tensors of the same count, shapes and dtypes as rank
    /// 0 (`tdc_verify_params`).
    ///
    /// # Errors
    /// libtorch's text, naming the first mismatch.
    pub(crate) fn verify_params(&self, ts: &TensorArray<'_>) -> Result<(), TorchText> {
        ts.assert_complete(ts.len(), "verify_params's tensors");
        // SAFETY: `self` is a live group and every tensor is borrowed for the call.
        check_text(unsafe { sys::tdc_verify_params(self.as_raw(), ts.as_ptr(), ts.count()) })
    }
}

impl Drop for PgHandle {
    fn drop(&mut self) {
        // SAFETY: the handle owns the group, which no one uses after this (a Reducer
        // over it holds a reference of its own).
        unsafe { sys::tdc_pg_free(self.0.as_ptr()) }
    }
}

/// An owned collective that was started and not waited for (`tdc_work*`): freed when
/// dropped, waited for or not (the backend keeps what it still needs).
pub(crate) struct WorkHandle(NonNull<sys::Work>);

// SAFETY: a `tdc_work` holds only an intrusive pointer to a `c10d::Work`, whose wait
// and release may happen on any thread (its state is behind its own mutex). Not
// `Sync`: one thread at a time waits for it.
unsafe impl Send for WorkHandle {}

impl WorkHandle {
    /// Waits until the collective completes (`tdc_work_wait`).
    ///
    /// # Errors
    /// libtorch's text: the collective's failure, or its timeout.
    pub(crate) fn wait(&self, timeout_ms: i64) -> Result<(), TorchText> {
        // SAFETY: `self` is a live work, used by this thread alone (`&self` of a type
        // that is not `Sync`).
        check_text(unsafe { sys::tdc_work_wait(self.0.as_ptr(), timeout_ms) })
    }
}

impl Drop for WorkHandle {
    fn drop(&mut self) {
        // SAFETY: the handle owns the work, which no one uses after this.
        unsafe { sys::tdc_work_free(self.0.as_ptr()) }
    }
}
