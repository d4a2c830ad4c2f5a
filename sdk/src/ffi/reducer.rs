//! DDP's engine, c10d's `Reducer` (`shim.cpp`'s `tdc_reducer_*`): an owned handle,
//! [`ReducerHandle`], whose methods are the Reducer's steps.

use std::ffi::{c_char, c_int, CString};
use std::ptr::NonNull;

use super::process_group::PgHandle;
use super::sys;
use super::tensor::TensorArray;
use super::{check_ptr, check_text};
use crate::error::TorchText;

/// How to build a Reducer ([`ReducerHandle::new`]), as `tdc_reducer_new` takes it.
pub(crate) struct ReducerOptions {
    pub bucket_bytes_cap: i64,
    pub first_bucket_bytes_cap: i64,
    pub find_unused_parameters: bool,
    pub gradient_as_bucket_view: bool,
}

/// A gradient compression hook of the Reducer (`tdc_reducer_register_comm_hook`'s
/// `kind`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum CommHookKind {
    /// c10d's built-in `FP16_COMPRESS` hook.
    Fp16 = 1,
    /// The same in bfloat16 (PyTorch's `bf16_compress_hook`).
    Bf16 = 2,
}

/// An owned `c10d::Reducer` (`tdc_reducer*`) over the gradients of its parameters:
/// freed when dropped. It holds its own references to its process group and its
/// parameters, so it borrows neither.
pub(crate) struct ReducerHandle(NonNull<sys::Reducer>);

// SAFETY: the Reducer is driven from one thread at a time (the handle is not `Sync`:
// every method takes `&self` of a value that one thread holds), and may move between
// threads: its autograd hooks run on autograd's threads, which c10d's Reducer locks
// for itself.
unsafe impl Send for ReducerHandle {}

impl ReducerHandle {
    /// A Reducer over `params` (named `names`, one each) on `group`
    /// (`tdc_reducer_new`).
    ///
    /// # Errors
    /// libtorch's text when it cannot be made.
    pub(crate) fn new(
        group: &PgHandle,
        params: &TensorArray<'_>,
        names: &[CString],
        options: &ReducerOptions,
    ) -> Result<ReducerHandle, TorchText> {
        params.assert_complete(names.len(), "the Reducer's parameters");
        let name_ptrs: Vec<*const c_char> = names.iter().map(|n| n.as_ptr()).collect();
        // SAFETY: `group` is a live group (the Reducer keeps a reference of its own);
        // `params` holds `count()` tensors borrowed for the call and `name_ptrs` as
        // many C strings, which the shim copies.
        let raw = unsafe {
            sys::tdc_reducer_new(
                group.as_raw(),
                params.as_ptr(),
                name_ptrs.as_ptr(),
                params.count(),
                options.bucket_bytes_cap,
                options.first_bucket_bytes_cap,
                c_int::from(options.find_unused_parameters),
                c_int::from(options.gradient_as_bucket_view),
            )
        };
        check_ptr(raw).map(ReducerHandle)
    }

    /// Static-graph mode (`tdc_reducer_set_static_graph`).
    ///
    /// # Errors
    /// libtorch's text.
    pub(crate) fn set_static_graph(&self) -> Result<(), TorchText> {
        // SAFETY: `self` is a live Reducer, used by this thread alone.
        check_text(unsafe { sys::tdc_reducer_set_static_graph(self.0.as_ptr()) })
    }

    /// Registers gradient compression (`tdc_reducer_register_comm_hook`).
    ///
    /// # Errors
    /// libtorch's text.
    pub(crate) fn register_comm_hook(&self, kind: CommHookKind) -> Result<(), TorchText> {
        // SAFETY: `self` is a live Reducer, used by this thread alone.
        check_text(unsafe { sys::tdc_reducer_register_comm_hook(self.0.as_ptr(), kind as c_int) })
    }

    /// All-reduces every bucket after a static graph's first backward pass
    /// (`tdc_reducer_delay_all_reduce`).
    ///
    /// # Errors
    /// libtorch's text.
    pub(crate) fn delay_all_reduce(&self) -> Result<(), TorchText> {
        // SAFETY: `self` is a live Reducer, used by this thread alone.
        check_text(unsafe { sys::tdc_reducer_delay_all_reduce(self.0.as_ptr()) })
    }

    /// Readies the Reducer for a forward pass (`tdc_reducer_prepare_for_forward`).
    ///
    /// # Errors
    /// libtorch's text.
    pub(crate) fn prepare_for_forward(&self) -> Result<(), TorchText> {
        // SAFETY: `self` is a live Reducer, used by this thread alone.
        check_text(unsafe { sys::tdc_reducer_prepare_for_forward(self.0.as_ptr()) })
    }

    /// Rebuilds the buckets when due; whether it did (`tdc_reducer_rebuild_buckets`).
    ///
    /// # Errors
    /// libtorch's text.
    pub(crate) fn rebuild_buckets(&self) -> Result<bool, TorchText> {
        let mut rebuilt = 0;
        // SAFETY: `self` is a live Reducer, used by this thread alone; `rebuilt` is an
        // int the shim writes.
        check_text(unsafe { sys::tdc_reducer_rebuild_buckets(self.0.as_ptr(), &mut rebuilt) })?;
        Ok(rebuilt != 0)
    }

    /// Readies the Reducer for a backward pass from `outputs` (searched for unused
    /// parameters under `find_unused_parameters`)
    /// (`tdc_reducer_prepare_for_backward`).
    ///
    /// # Errors
    /// libtorch's text.
    pub(crate) fn prepare_for_backward(&self, outputs: &TensorArray<'_>) -> Result<(), TorchText> {
        outputs.assert_complete(outputs.len(), "the Reducer's outputs");
        // SAFETY: `self` is a live Reducer, used by this thread alone; `outputs` holds
        // `count()` tensors borrowed for the call.
        check_text(unsafe {
            sys::tdc_reducer_prepare_for_backward(
                self.0.as_ptr(),
                outputs.as_ptr(),
                outputs.count(),
            )
        })
    }

    /// The number of parameters in each bucket, in the Reducer's order
    /// (`tdc_reducer_buckets`).
    ///
    /// # Errors
    /// libtorch's text.
    pub(crate) fn bucket_sizes(&self) -> Result<Vec<i64>, TorchText> {
        let mut count: c_int = 0;
        // SAFETY: `self` is a live Reducer, used by this thread alone; with a capacity
        // of 0 the shim writes no size, only `count`.
        check_text(unsafe {
            sys::tdc_reducer_buckets(self.0.as_ptr(), std::ptr::null_mut(), 0, &mut count)
        })?;
        let mut sizes = vec![0i64; usize::try_from(count).unwrap_or(0)];
        let cap = c_int::try_from(sizes.len()).unwrap_or(0);
        // SAFETY: as above; `sizes` holds `cap` entries, the most the shim writes.
        check_text(unsafe {
            sys::tdc_reducer_buckets(self.0.as_ptr(), sizes.as_mut_ptr(), cap, &mut count)
        })?;
        Ok(sizes)
    }
}

impl Drop for ReducerHandle {
    fn drop(&mut self) {
        // SAFETY: the handle owns the Reducer, which no one uses after this.
        unsafe { sys::tdc_reducer_free(self.0.as_ptr()) }
    }
}
