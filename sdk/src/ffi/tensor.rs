//! Tensors across the shim. A tensor crosses as tch's `C_tensor*`, a `torch::Tensor*`:
//! borrowed for one call ([`TensorArray`], whose lifetime keeps the tensors alive and
//! unmoved while the pointers exist), or handed over by the shim as a new
//! `torch::Tensor*` that Rust owns ([`take`]). And [`SyncTensors`], the one place that
//! says why tensors may be shared between threads.

use std::marker::PhantomData;
use std::ops::Deref;

use tch::Tensor;

use super::sys;

/// The raw `torch::Tensor*` behind `t`, for a call that borrows it. The pointer is
/// valid as long as `t` lives (tch boxes the `torch::Tensor` on the C++ heap, so a
/// move of `t` does not move it).
pub(super) fn ptr(t: &Tensor) -> sys::Tensor {
    t.as_ptr() as sys::Tensor
}

/// Takes over a `torch::Tensor*` that the shim allocated for the caller (`new
/// at::Tensor(…)`): the returned tensor frees it when dropped.
///
/// # Safety
/// `p` is not NULL, came from the shim's `new at::Tensor`, and nothing else owns or
/// frees it (each pointer is taken once).
pub(super) unsafe fn take(p: sys::Tensor) -> Tensor {
    // SAFETY: the caller's contract: `p` is an owned, live `torch::Tensor*`, which is
    // what tch's `C_tensor*` is, and no one else frees it.
    unsafe { Tensor::from_ptr(p as *mut torch_sys::C_tensor) }
}

/// [`take`] for a pointer that may be NULL (a slot the shim left empty).
///
/// # Safety
/// As [`take`] when `p` is not NULL.
unsafe fn take_optional(p: sys::Tensor) -> Option<Tensor> {
    // SAFETY: the caller's contract, for a pointer that is not NULL.
    (!p.is_null()).then(|| unsafe { take(p) })
}

/// [`take_optional`] for each pointer of an array the shim filled: its tensors, in
/// order, `None` for each NULL.
///
/// # Safety
/// As [`take`] for each pointer that is not NULL.
pub(super) unsafe fn take_all(ptrs: Vec<sys::Tensor>) -> Vec<Option<Tensor>> {
    ptrs.into_iter()
        // SAFETY: the caller's contract, for each pointer.
        .map(|p| unsafe { take_optional(p) })
        .collect()
}

/// The raw pointers of borrowed tensors, for the shim's array arguments (`tdc_tensor*`
/// with a count): each pointer is valid for `'a`, the borrow of its tensor. An entry
/// may be NULL where the array was built from optional tensors ([`optional`]); the
/// wrappers check that an array the shim reads whole is complete
/// ([`assert_complete`]).
///
/// [`optional`]: TensorArray::optional
/// [`assert_complete`]: TensorArray::assert_complete
pub(crate) struct TensorArray<'a> {
    ptrs: Vec<sys::Tensor>,
    complete: bool,
    _borrow: PhantomData<&'a Tensor>,
}

impl<'a> TensorArray<'a> {
    /// The tensors of a slice, in order.
    pub(crate) fn new(ts: &'a [Tensor]) -> TensorArray<'a> {
        Self::of(ts)
    }

    /// The tensors `ts` yields, in order.
    pub(crate) fn of(ts: impl IntoIterator<Item = &'a Tensor>) -> TensorArray<'a> {
        TensorArray {
            ptrs: ts.into_iter().map(ptr).collect(),
            complete: true,
            _borrow: PhantomData,
        }
    }

    /// Optional tensors, in order: NULL for each `None`.
    pub(crate) fn optional(ts: impl IntoIterator<Item = Option<&'a Tensor>>) -> TensorArray<'a> {
        let ptrs: Vec<sys::Tensor> = ts
            .into_iter()
            .map(|t| t.map_or(std::ptr::null_mut(), ptr))
            .collect();
        let complete = ptrs.iter().all(|p| !p.is_null());
        TensorArray {
            ptrs,
            complete,
            _borrow: PhantomData,
        }
    }

    /// How many tensors (entries) there are.
    pub(crate) fn len(&self) -> usize {
        self.ptrs.len()
    }

    /// The first entry, for the shim's `const tdc_tensor*` parameters.
    pub(super) fn as_ptr(&self) -> *const sys::Tensor {
        self.ptrs.as_ptr()
    }

    /// The count, for the shim's `int n` parameters.
    ///
    /// Panics past `i32::MAX` tensors, which no call holds.
    pub(super) fn count(&self) -> std::ffi::c_int {
        std::ffi::c_int::try_from(self.ptrs.len()).expect("fewer than 2^31 tensors")
    }

    /// Panics unless the array holds `n` tensors, none NULL: what the shim reads
    /// whole. A wrapper calls this before handing the array to a function that
    /// dereferences every entry; a failure is a bug of the SDK's, not of its user.
    pub(super) fn assert_complete(&self, n: usize, what: &str) {
        assert!(
            self.complete && self.ptrs.len() == n,
            "{what}: {n} tensors expected, got {} ({})",
            self.ptrs.len(),
            if self.complete {
                "all present"
            } else {
                "some missing"
            }
        );
    }

    /// Panics unless the array holds `n` entries (some may be NULL).
    pub(super) fn assert_len(&self, n: usize, what: &str) {
        assert_eq!(self.ptrs.len(), n, "{what}: {n} entries expected");
    }
}

/// The identity of the tensor behind `t`: the same for every handle of one tensor
/// (tch's `shallow_clone`s, a `VarStore`'s variable and the module's copy of it),
/// whatever its storage holds (a resharded parameter's is empty). Tensors are told
/// apart by this, never by their data's address, which a freed storage does not have
/// and which empty tensors share.
pub(crate) fn tensor_key(t: &Tensor) -> usize {
    // SAFETY: `ptr(t)` is the live `at::Tensor*` that `t` owns for this call, and
    // `tdc_tensor_key` only reads its TensorImpl pointer (it cannot throw).
    unsafe { sys::tdc_tensor_key(ptr(t)) }
}

/// Tensors that several threads read at once: a `Vec<Tensor>` that is `Sync` (tch's
/// `Tensor` is `Send` only). What holds it (a sharded optimizer's state, shared with
/// autograd's threads through its hooks) becomes `Sync` without an `unsafe impl` of
/// its own. Reads as the slice of its tensors.
pub(crate) struct SyncTensors(Vec<Tensor>);

// SAFETY: shared access gives out `&Tensor` only. A `&Tensor` reads the
// `torch::Tensor` handle (an intrusive pointer whose count is atomic) and reaches its
// TensorImpl and storage, which every `shallow_clone` of it shares too; tch's
// `Tensor: Send` already lets another thread hold such a clone and do anything a
// `&Tensor` allows, so reading the handles from several threads at once adds no
// access that safe code does not have already. Writes through the tensors' data are
// ordered by their users' locks (a bucket's or a unit's `Mutex`), as in PyTorch.
unsafe impl Sync for SyncTensors {}

impl From<Vec<Tensor>> for SyncTensors {
    fn from(ts: Vec<Tensor>) -> Self {
        SyncTensors(ts)
    }
}

impl Deref for SyncTensors {
    type Target = [Tensor];

    fn deref(&self) -> &[Tensor] {
        &self.0
    }
}
