//! The raw declarations of the C shim (`csrc/shim.h`): its opaque handle types, its
//! callbacks' types, its status codes and its functions. Private to [`ffi`](super):
//! every call goes through one of the safe wrappers beside this file.

use std::ffi::{c_char, c_int, c_void};

// ---- status codes (shim.h's `TDC_*`) ----

/// Success (`TDC_OK`); also what Rust's callbacks return when they went well.
pub(super) const TDC_OK: c_int = 0;
/// A failure whose message is this thread's last error (`TDC_ERROR`).
pub(super) const TDC_ERROR: c_int = 1;
/// A usage error, told apart from a failure by `tdc_checkpoint` (`TDC_USAGE_ERROR`).
pub(super) const TDC_USAGE_ERROR: c_int = 2;
/// A checkpointed block panicked (`TDC_BLOCK_PANICKED`).
pub(super) const TDC_BLOCK_PANICKED: c_int = -1;
/// A checkpointed block returned more outputs than it had room for
/// (`TDC_BLOCK_TOO_MANY_OUTPUTS`).
pub(super) const TDC_BLOCK_TOO_MANY_OUTPUTS: c_int = -2;
/// `tdc_store_port` of a store without a port (`TDC_NO_PORT`).
pub(super) const TDC_NO_PORT: c_int = -1;

pub(super) type Tensor = *mut c_void;

#[repr(C)]
pub(super) struct Store {
    _private: [u8; 0],
}
#[repr(C)]
pub(super) struct Pg {
    _private: [u8; 0],
}
#[repr(C)]
pub(super) struct Reducer {
    _private: [u8; 0],
}

#[repr(C)]
pub(super) struct Work {
    _private: [u8; 0],
}

#[repr(C)]
pub(super) struct GradHooks {
    _private: [u8; 0],
}

#[repr(C)]
pub(super) struct Accumulators {
    _private: [u8; 0],
}

/// A checkpointed block's call into Rust (`tdc_block_fn`).
pub(super) type BlockFn = unsafe extern "C" fn(
    ctx: *mut c_void,
    inputs: *const Tensor,
    n: c_int,
    outputs: *mut Tensor,
    cap: c_int,
) -> c_int;
/// A hook's call into Rust with its context and index; 0, or non-zero to fail the
/// backward pass (`tdc_callback`).
pub(super) type Callback = unsafe extern "C" fn(ctx: *mut c_void, index: c_int) -> c_int;
/// Releases a hook's context (`tdc_drop`).
pub(super) type DropFn = unsafe extern "C" fn(ctx: *mut c_void);

/// The length of a sealed store's secret (`TDC_SECRET_BYTES`).
pub(crate) const SECRET_BYTES: usize = 32;

/// Seals `len` bytes at `plain` with `secret` ([`SECRET_BYTES`]) and `key` (a C string,
/// the associated data) into `len + overhead` bytes at `out`; 0 on success
/// (`tdc_seal_fn`).
pub(super) type SealFn = unsafe extern "C" fn(
    secret: *const u8,
    key: *const c_char,
    plain: *const u8,
    len: usize,
    out: *mut u8,
) -> c_int;

/// Opens `len` sealed bytes into `len - overhead` bytes at `out`; 0 when they were
/// sealed with this secret and key, else non-zero (`tdc_open_fn`).
pub(super) type OpenFn = unsafe extern "C" fn(
    secret: *const u8,
    key: *const c_char,
    sealed: *const u8,
    len: usize,
    out: *mut u8,
) -> c_int;

extern "C" {
    pub(super) fn tdc_last_error() -> *mut c_char;
    pub(super) fn tdc_nccl_compiled() -> c_int;
    pub(super) fn tdc_runtime_report(data: *mut *mut c_char, len: *mut usize) -> c_int;

    pub(super) fn tdc_tcp_store_new(
        host: *const c_char,
        port: c_int,
        world_size: c_int,
        listen_fd: c_int,
        timeout_ms: i64,
    ) -> *mut Store;
    pub(super) fn tdc_hash_store_new() -> *mut Store;
    pub(super) fn tdc_prefix_store_new(prefix: *const c_char, base: *mut Store) -> *mut Store;
    pub(super) fn tdc_sealed_store_new(
        prefix: *const c_char,
        base: *mut Store,
        secret: *const u8,
        overhead: usize,
        seal: SealFn,
        open: OpenFn,
    ) -> *mut Store;
    pub(super) fn tdc_store_free(store: *mut Store);
    pub(super) fn tdc_store_clone(store: *mut Store) -> *mut Store;
    pub(super) fn tdc_store_set_timeout(store: *mut Store, timeout_ms: i64) -> c_int;
    pub(super) fn tdc_store_port(store: *mut Store) -> c_int;
    pub(super) fn tdc_store_set(
        store: *mut Store,
        key: *const c_char,
        data: *const u8,
        len: usize,
    ) -> c_int;
    pub(super) fn tdc_store_get(
        store: *mut Store,
        key: *const c_char,
        data: *mut *mut u8,
        len: *mut usize,
    ) -> c_int;
    pub(super) fn tdc_store_add(
        store: *mut Store,
        key: *const c_char,
        delta: i64,
        result: *mut i64,
    ) -> c_int;
    pub(super) fn tdc_store_list_keys(
        store: *mut Store,
        data: *mut *mut c_char,
        len: *mut usize,
    ) -> c_int;

    pub(super) fn tdc_pg_new(
        store: *mut Store,
        rank: c_int,
        size: c_int,
        timeout_ms: i64,
        gloo: c_int,
        nccl: c_int,
        cuda_device: c_int,
        gloo_interfaces: *const c_char,
        gloo_address: *const c_char,
        checks: c_int,
    ) -> *mut Pg;
    pub(super) fn tdc_pg_free(pg: *mut Pg);
    pub(super) fn tdc_all_reduce(pg: *mut Pg, t: Tensor, op: c_int, timeout_ms: i64) -> c_int;
    pub(super) fn tdc_broadcast(pg: *mut Pg, t: Tensor, root: c_int, timeout_ms: i64) -> c_int;
    pub(super) fn tdc_reduce_scatter(
        pg: *mut Pg,
        output: Tensor,
        inputs: *const Tensor,
        n: c_int,
        op: c_int,
        timeout_ms: i64,
    ) -> c_int;
    pub(super) fn tdc_barrier(pg: *mut Pg, timeout_ms: i64) -> c_int;
    pub(super) fn tdc_all_gather_start(
        pg: *mut Pg,
        outputs: *const Tensor,
        n: c_int,
        input: Tensor,
        timeout_ms: i64,
    ) -> *mut Work;
    pub(super) fn tdc_work_wait(work: *mut Work, timeout_ms: i64) -> c_int;
    pub(super) fn tdc_work_free(work: *mut Work);
    pub(super) fn tdc_broadcast_coalesced(
        pg: *mut Pg,
        ts: *const Tensor,
        n: c_int,
        buffer_bytes: usize,
        root: c_int,
    ) -> c_int;
    pub(super) fn tdc_verify_params(pg: *mut Pg, ts: *const Tensor, n: c_int) -> c_int;

    pub(super) fn tdc_reducer_new(
        pg: *mut Pg,
        params: *const Tensor,
        names: *const *const c_char,
        n: c_int,
        bucket_bytes_cap: i64,
        first_bucket_bytes_cap: i64,
        find_unused_parameters: c_int,
        gradient_as_bucket_view: c_int,
    ) -> *mut Reducer;
    pub(super) fn tdc_reducer_free(r: *mut Reducer);
    pub(super) fn tdc_reducer_prepare_for_forward(r: *mut Reducer) -> c_int;
    pub(super) fn tdc_reducer_set_static_graph(r: *mut Reducer) -> c_int;
    pub(super) fn tdc_reducer_register_comm_hook(r: *mut Reducer, kind: c_int) -> c_int;
    pub(super) fn tdc_reducer_delay_all_reduce(r: *mut Reducer) -> c_int;
    pub(super) fn tdc_reducer_rebuild_buckets(r: *mut Reducer, rebuilt: *mut c_int) -> c_int;
    pub(super) fn tdc_reducer_prepare_for_backward(
        r: *mut Reducer,
        outputs: *const Tensor,
        n: c_int,
    ) -> c_int;
    pub(super) fn tdc_reducer_buckets(
        r: *mut Reducer,
        sizes: *mut i64,
        cap: c_int,
        count: *mut c_int,
    ) -> c_int;

    pub(super) fn tdc_randperm(n: i64, seed: u64, out: Tensor) -> c_int;

    pub(super) fn tdc_sgd_step(
        params: *const Tensor,
        bufs: *const Tensor,
        new_bufs: *mut Tensor,
        n: c_int,
        lr: f64,
        momentum: f64,
        dampening: f64,
        weight_decay: f64,
        nesterov: c_int,
        mode: c_int,
    ) -> c_int;
    pub(super) fn tdc_adam_step(
        params: *const Tensor,
        exp_avgs: *const Tensor,
        exp_avg_sqs: *const Tensor,
        max_exp_avg_sqs: *const Tensor,
        steps: *const Tensor,
        n: c_int,
        step: i64,
        lr: f64,
        beta1: f64,
        beta2: f64,
        eps: f64,
        weight_decay: f64,
        amsgrad: c_int,
        decoupled: c_int,
        mode: c_int,
    ) -> c_int;
    pub(super) fn tdc_rmsprop_step(
        params: *const Tensor,
        square_avgs: *const Tensor,
        momentum_bufs: *const Tensor,
        grad_avgs: *const Tensor,
        n: c_int,
        lr: f64,
        alpha: f64,
        eps: f64,
        weight_decay: f64,
        momentum: f64,
        centered: c_int,
        mode: c_int,
    ) -> c_int;
    pub(super) fn tdc_zero_grad(params: *const Tensor, n: c_int) -> c_int;
    pub(super) fn tdc_accumulators_new() -> *mut Accumulators;
    pub(super) fn tdc_accumulators_add(
        a: *mut Accumulators,
        params: *const Tensor,
        n: c_int,
    ) -> c_int;
    pub(super) fn tdc_accumulators_changed(
        a: *mut Accumulators,
        params: *const Tensor,
        n: c_int,
        first: *mut c_int,
    ) -> c_int;
    pub(super) fn tdc_accumulators_free(a: *mut Accumulators);
    pub(super) fn tdc_optimizer_archive_state(
        kind: c_int,
        params: *const Tensor,
        groups: *const i64,
        n: c_int,
        data: *const u8,
        len: usize,
        out: *mut Tensor,
        steps: *mut i64,
    ) -> c_int;
    pub(super) fn tdc_rng_state(cuda_index: c_int, out: *mut Tensor) -> c_int;
    pub(super) fn tdc_set_rng_state(cuda_index: c_int, state: Tensor) -> c_int;
    pub(super) fn tdc_rng_current_seed(cuda_index: c_int, out: *mut u64) -> c_int;
    pub(super) fn tdc_seed_rng(cuda_index: c_int, seed: u64) -> c_int;

    pub(super) fn tdc_autocast_enter(
        device_type: c_int,
        dtype: c_int,
        prev_enabled: *mut c_int,
        prev_dtype: *mut c_int,
    ) -> c_int;
    pub(super) fn tdc_autocast_exit(
        device_type: c_int,
        prev_enabled: c_int,
        prev_dtype: c_int,
    ) -> c_int;
    pub(super) fn tdc_set_onednn_enabled(enabled: c_int) -> c_int;
    pub(super) fn tdc_cuda_capability(device: c_int, major: *mut c_int, minor: *mut c_int)
        -> c_int;

    pub(super) fn tdc_storage_free(t: Tensor, message: *const c_char) -> c_int;
    pub(super) fn tdc_storage_alias(t: Tensor) -> Tensor;
    pub(super) fn tdc_storage_bytes(t: Tensor, out: *mut usize) -> c_int;
    pub(super) fn tdc_tensor_key(t: Tensor) -> usize;
    pub(super) fn tdc_set_grad(t: Tensor, grad: Tensor) -> c_int;
    pub(super) fn tdc_copy_async(dst: Tensor, src: Tensor) -> c_int;
    pub(super) fn tdc_hook_gradient(
        t: Tensor,
        callback: Callback,
        ctx: *mut c_void,
        drop: DropFn,
        index: c_int,
    ) -> c_int;
    pub(super) fn tdc_grad_hooks_new(
        params: *const Tensor,
        n: c_int,
        callback: Callback,
        ctx: *mut c_void,
        drop: DropFn,
    ) -> *mut GradHooks;
    pub(super) fn tdc_grad_hooks_reachable(
        hooks: *mut GradHooks,
        roots: *const Tensor,
        n: c_int,
        out: *mut c_int,
    ) -> c_int;
    pub(super) fn tdc_grad_hooks_free(hooks: *mut GradHooks);
    pub(super) fn tdc_checkpoint(
        block: BlockFn,
        ctx: *mut c_void,
        drop: DropFn,
        inputs: *const Tensor,
        n: c_int,
        outputs: *mut Tensor,
        cap: c_int,
        n_out: *mut c_int,
    ) -> c_int;
    pub(super) fn tdc_amp_unscale(
        grads: *const Tensor,
        n: c_int,
        found_inf: Tensor,
        inv_scale: Tensor,
    ) -> c_int;
}
