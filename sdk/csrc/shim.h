// The C interface between Rust and libtorch's c10d.
//
// One error convention, as torch-sys does: every function catches every C++
// exception, stores its message in a thread-local and returns a failure value
// (NULL for constructors, TDC_ERROR, or another status named below, for the rest).
// `tdc_last_error` hands the message to Rust, which frees it with `free`. No C++
// exception crosses into Rust. Rust mirrors these names in `sdk/src/ffi/sys.rs`
// (`Status`) and matches on them by name.
//
// Tensors cross as tch's `C_tensor*`, which is a `torch::Tensor*`.
#pragma once
#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

typedef struct tdc_store tdc_store;
typedef struct tdc_pg tdc_pg;
typedef struct tdc_reducer tdc_reducer;
// A collective started and not waited for yet.
typedef struct tdc_work tdc_work;
typedef void* tdc_tensor;

// ---- status codes ----
// What the functions that return an `int` status return.
// Success (also what Rust's callbacks return when they went well: tdc_callback,
// tdc_seal_fn, tdc_open_fn).
#define TDC_OK 0
// A failure, whose message is this thread's last error (tdc_last_error).
#define TDC_ERROR 1
// A usage error (the caller's mistake, a std::invalid_argument), where a function
// tells it apart from a failure (tdc_checkpoint); its message is the last error too.
#define TDC_USAGE_ERROR 2
// What a checkpointed block (tdc_block_fn) returns instead of its output count: it
// panicked (any other negative value counts as this too), or it returned more
// outputs than the room it was given.
#define TDC_BLOCK_PANICKED (-1)
#define TDC_BLOCK_TOO_MANY_OUTPUTS (-2)
// What tdc_store_port returns for a store without a port (not a TCP store).
#define TDC_NO_PORT (-1)

// The last error message of this thread (malloc'ed, or NULL when none); resets it.
char* tdc_last_error(void);

// 1 when the NCCL backend was compiled into this build.
int tdc_nccl_compiled(void);
// What libtorch was built with and finds here, for `tchrun env`: `key\tvalue\n` lines
// (CPU capability, CUDA, cuDNN, NCCL, and one line per GPU) in *data (malloc'ed; the
// caller frees it) of *len bytes.
int tdc_runtime_report(char** data, size_t* len);

// ---- stores ----
// A TCPStore client of host:port, or, with listen_fd >= 0, its server on that socket,
// already bound and listening (c10d's masterListenFd; the store closes it).
tdc_store* tdc_tcp_store_new(
    const char* host, int port, int world_size, int listen_fd,
    int64_t timeout_ms);
// An in-process store, for a world of one process (no network).
tdc_store* tdc_hash_store_new(void);
tdc_store* tdc_prefix_store_new(const char* prefix, tdc_store* base);
// A job's sealed view of `base` (sealed_store.cpp): keys under `prefix` (joined with
// '/', as PrefixStore), each value sealed by `seal` with the TDC_SECRET_BYTES-byte
// `secret`, the full key as associated data, into `len + overhead` bytes at `out`;
// `open` reverses it into `len - overhead` bytes. Both return TDC_OK, or another value
// when the value cannot be sealed or does not open (not sealed with this secret and
// key).
#define TDC_SECRET_BYTES 32
typedef int (*tdc_seal_fn)(
    const uint8_t* secret, const char* key, const uint8_t* plain, size_t len, uint8_t* out);
typedef int (*tdc_open_fn)(
    const uint8_t* secret, const char* key, const uint8_t* sealed, size_t len, uint8_t* out);
tdc_store* tdc_sealed_store_new(
    const char* prefix, tdc_store* base, const uint8_t* secret, size_t overhead,
    tdc_seal_fn seal, tdc_open_fn open);
void tdc_store_free(tdc_store* store);
// A second connection to the same store (c10d's Store::clone: a new TCP client for a
// TCPStore, the same prefix over a clone of the base for a PrefixStore), so that one
// thread can wait on it without holding up the others' use of `store`.
tdc_store* tdc_store_clone(tdc_store* store);
// How long get/wait on this store handle wait for a key.
int tdc_store_set_timeout(tdc_store* store, int64_t timeout_ms);
// The port the store listens on or connects to (useful after port 0), or TDC_NO_PORT.
int tdc_store_port(tdc_store* store);
int tdc_store_set(tdc_store* store, const char* key, const uint8_t* data, size_t len);
// *data is malloc'ed; the caller frees it.
int tdc_store_get(tdc_store* store, const char* key, uint8_t** data, size_t* len);
int tdc_store_add(tdc_store* store, const char* key, int64_t delta, int64_t* result);
// Every key of the store (c10d's listKeys), each followed by a NUL, in *data
// (malloc'ed; the caller frees it) of *len bytes in all.
int tdc_store_list_keys(tdc_store* store, char** data, size_t* len);

// ---- process group ----
// Builds a ProcessGroup over `store`: Gloo for CPU tensors when `gloo` is set, NCCL
// for CUDA tensors on `cuda_device` when `nccl` is set. `default_nccl` picks the
// backend used for barriers.
// Gloo's device: `gloo_interfaces` (comma-separated interface names) when not
// empty, else `gloo_address` (an address of this host) when not empty, else the
// hostname's address (c10d's default). With `checks`, every backend is wrapped in
// c10d's ProcessGroupWrapper (TORCH_DISTRIBUTED_DEBUG=DETAIL's collective checks).
tdc_pg* tdc_pg_new(
    tdc_store* store, int rank, int size, int64_t timeout_ms, int gloo,
    int nccl, int cuda_device, const char* gloo_interfaces, const char* gloo_address,
    int checks);
void tdc_pg_free(tdc_pg* pg);

// Collectives. Each blocks until done or until `timeout_ms` has passed.
// op: 0 sum, 1 average, 2 product, 3 min, 4 max (c10d::ReduceOp's numbering).
int tdc_all_reduce(tdc_pg* pg, tdc_tensor t, int op, int64_t timeout_ms);
int tdc_broadcast(tdc_pg* pg, tdc_tensor t, int root, int64_t timeout_ms);
int tdc_reduce_scatter(
    tdc_pg* pg, tdc_tensor output, tdc_tensor* inputs, int n, int op,
    int64_t timeout_ms);
int tdc_barrier(tdc_pg* pg, int64_t timeout_ms);
// All-gathers `input` from every rank into `outputs` (one per rank), started: returns
// at once (NULL on failure); the outputs hold the result once tdc_work_wait returned 0.
tdc_work* tdc_all_gather_start(
    tdc_pg* pg, tdc_tensor* outputs, int n, tdc_tensor input, int64_t timeout_ms);
// Waits until `work` completes (its failure or timeout is the error).
int tdc_work_wait(tdc_work* work, int64_t timeout_ms);
// Releases `work` (waited for or not: the backend keeps what it still needs).
void tdc_work_free(tdc_work* work);
// c10d::broadcast_coalesced: broadcasts tensors from `root` in flattened buffers of
// at most `buffer_bytes` bytes, without recording autograd history.
int tdc_broadcast_coalesced(
    tdc_pg* pg, tdc_tensor* tensors, int n, size_t buffer_bytes, int root);
// c10d::verify_params_across_processes: same count, shapes and dtypes as rank 0.
int tdc_verify_params(tdc_pg* pg, tdc_tensor* params, int n);

// ---- reducer (the engine of DistributedDataParallel) ----
tdc_reducer* tdc_reducer_new(
    tdc_pg* pg, tdc_tensor* params, const char** names, int n,
    int64_t bucket_bytes_cap, int64_t first_bucket_bytes_cap,
    int find_unused_parameters, int gradient_as_bucket_view);
void tdc_reducer_free(tdc_reducer* reducer);
int tdc_reducer_prepare_for_forward(tdc_reducer* reducer);
// Static-graph mode (DDP's static_graph=True): the first synchronized backward only
// records which variables get gradients; delay_all_reduce, called once it has ended,
// all-reduces every bucket and finishes it, as PyTorch's _delayed_all_reduce.
int tdc_reducer_set_static_graph(tdc_reducer* reducer);
// Registers gradient compression on the Reducer: 1 c10d's built-in FP16_COMPRESS hook,
// 2 the same in bfloat16 (PyTorch's bf16_compress_hook).
int tdc_reducer_register_comm_hook(tdc_reducer* reducer, int kind);
int tdc_reducer_delay_all_reduce(tdc_reducer* reducer);
// *rebuilt is set to 1 when the buckets were rebuilt by this call.
int tdc_reducer_rebuild_buckets(tdc_reducer* reducer, int* rebuilt);
int tdc_reducer_prepare_for_backward(tdc_reducer* reducer, tdc_tensor* outputs, int n);
// Number of buckets and the number of parameters in each (written to `sizes`,
// which holds `cap` entries).
int tdc_reducer_buckets(tdc_reducer* reducer, int64_t* sizes, int cap, int* count);

/* Data: `out` (int64, 1-D, n elements) receives the permutation that PyTorch's
 * `torch.randperm(n, generator=torch.Generator().manual_seed(seed))` draws. */
int tdc_randperm(int64_t n, uint64_t seed, tdc_tensor out);

/* Checkpoints. `opt` is torch-sys's `C_optimizer*`, a `torch::optim::Optimizer*`.
 * The state is libtorch's own optimizer archive (`Optimizer::save`), returned in a
 * malloc'ed buffer that the caller frees. */
// ---- optimizer updates (optim.cpp) ----
// Each updates one group of parameters (same device, dtype, options and step count)
// in place from their gradients; `mode`: 0 libtorch's C++ arithmetic (tch's), 1
// torch.optim's foreach arithmetic, both in `_foreach_*` ops; 2 ATen's fused kernel. SGD: `bufs` NULL at the group's first step with
// momentum, when the new buffers are handed out in `new_bufs` (owned by the caller).
int tdc_sgd_step(
    tdc_tensor* params, tdc_tensor* bufs, tdc_tensor* new_bufs, int n, double lr,
    double momentum, double dampening, double weight_decay, int nesterov, int mode);
// Adam, or AdamW when `decoupled`; `step` is the update's number (1 at the first);
// `steps` are the fused kernels' float32 step counts, incremented first.
int tdc_adam_step(
    tdc_tensor* params, tdc_tensor* exp_avgs, tdc_tensor* exp_avg_sqs,
    tdc_tensor* max_exp_avg_sqs, tdc_tensor* steps, int n, int64_t step, double lr,
    double beta1, double beta2, double eps, double weight_decay, int amsgrad,
    int decoupled, int mode);
int tdc_rmsprop_step(
    tdc_tensor* params, tdc_tensor* square_avgs, tdc_tensor* momentum_bufs,
    tdc_tensor* grad_avgs, int n, double lr, double alpha, double eps,
    double weight_decay, double momentum, int centered, int mode);
// Sets the parameters' gradients to none, as `zero_grad(set_to_none=True)`.
int tdc_zero_grad(tdc_tensor* params, int n);
// The gradient accumulators of an optimizer's parameters, held from when they joined
// it (see optim.cpp): `add` appends `n` parameters (a parameter without a gradient
// holds none); `changed` writes to `first` the first of the `n` parameters (all those
// added, in order) whose accumulator autograd would use now is not the one held
// (`set_data` replaced it), or -1.
typedef struct tdc_accumulators tdc_accumulators;
tdc_accumulators* tdc_accumulators_new(void);
int tdc_accumulators_add(tdc_accumulators* a, tdc_tensor* params, int n);
int tdc_accumulators_changed(tdc_accumulators* a, tdc_tensor* params, int n, int* first);
void tdc_accumulators_free(tdc_accumulators* a);
// The per-parameter state of a libtorch optimizer archive (what tch-distributed 0.1
// wrote as optimizer.pt); see optim.cpp.
int tdc_optimizer_archive_state(
    int kind, tdc_tensor* params, const int64_t* groups, int n, const uint8_t* data,
    size_t len, tdc_tensor* out, int64_t* steps);
/* The default CPU generator's state as a new uint8 tensor in `*out` (a
 * `torch::Tensor*` the caller owns), and setting it back. */
int tdc_rng_state(int cuda_index, tdc_tensor* out);
int tdc_set_rng_state(int cuda_index, tdc_tensor state);
// The seed one default generator was last seeded with (torch.Generator.initial_seed).
int tdc_rng_current_seed(int cuda_index, uint64_t* out);
// Seeds one default generator, as torch.Generator.manual_seed does.
int tdc_seed_rng(int cuda_index, uint64_t seed);

/* Mixed precision: `at::_amp_foreach_non_finite_check_and_unscale_` over `n`
 * gradients of one device and dtype (multiplied by `inv_scale`; `found_inf` set to 1
 * when one holds an inf or NaN), as PyTorch's GradScaler.unscale_. */
int tdc_amp_unscale(tdc_tensor* grads, int n, tdc_tensor found_inf, tdc_tensor inv_scale);

/* Autocast for a device type (0: CPU, 1: CUDA) to `dtype` (a c10::ScalarType code):
 * enter returns the previous setting, which exit restores; leaving the outermost
 * level clears the cast cache. */
int tdc_autocast_enter(int device_type, int dtype, int* prev_enabled, int* prev_dtype);

/* Turns libtorch's use of oneDNN (MKL-DNN) on or off for the whole process, as
 * Python's `torch.backends.mkldnn.enabled`. */
int tdc_set_onednn_enabled(int enabled);
int tdc_autocast_exit(int device_type, int prev_enabled, int prev_dtype);
/* The compute capability of CUDA device `device` (fails without CUDA support). */
int tdc_cuda_capability(int device, int* major, int* minor);


// ---- fully sharded training (sharding.cpp) ----
// Called by a hook with the index it was registered with; returns TDC_OK, or another
// value to fail the backward pass (the cause stays on the caller's side).
typedef int (*tdc_callback)(void* ctx, int index);
// Releases a hook's context, when the last hook holding it is gone.
typedef void (*tdc_drop)(void* ctx);
typedef struct tdc_grad_hooks tdc_grad_hooks;
// Frees the memory of `t`'s storage (its sizes stay: FSDP2's resharding); until it is
// allocated again (tdc_storage_alias), any access to its data is a libtorch error whose
// message is `message`.
int tdc_storage_free(tdc_tensor t, const char* message);
// Allocates `t`'s storage again if it was freed, and returns a new tensor over it
// (same sizes) whose writes do not count as writes to `t` (autograd's saved tensors of
// `t` stay valid); NULL on failure.
tdc_tensor tdc_storage_alias(tdc_tensor t);
// The bytes `t`'s storage holds now.
int tdc_storage_bytes(tdc_tensor t, size_t* out);
// The identity of the tensor behind `t` (its TensorImpl's address): equal for every
// handle of one tensor (tch's shallow clones), whatever its storage holds.
uintptr_t tdc_tensor_key(tdc_tensor t);
// Sets `t`'s `.grad` to `grad` (NULL: none).
int tdc_set_grad(tdc_tensor t, tdc_tensor grad);
// Copies `src` into `dst` (any devices) without waiting: between pinned host memory and
// a GPU the copy is queued on the current stream (`copy_(src, non_blocking=true)`).
int tdc_copy_async(tdc_tensor dst, tdc_tensor src);
// Calls `callback(ctx, index)` each time `t`'s gradient is computed in a backward pass.
int tdc_hook_gradient(
    tdc_tensor t, tdc_callback callback, void* ctx, tdc_drop drop, int index);
// Calls `callback(ctx, i)` each time parameter i's `.grad` has been accumulated, until
// the hooks are freed.
tdc_grad_hooks* tdc_grad_hooks_new(
    tdc_tensor* params, int n, tdc_callback callback, void* ctx, tdc_drop drop);
// out[i] = 1 when parameter i's gradient accumulator is in the autograd graph of
// `roots` (a backward pass from them accumulates its `.grad`), else 0; as the
// Reducer's search for unused parameters.
int tdc_grad_hooks_reachable(tdc_grad_hooks* hooks, tdc_tensor* roots, int n, int* out);
void tdc_grad_hooks_free(tdc_grad_hooks* hooks);

// ---- activation checkpointing (activation.cpp) ----
// Runs a block on `n` inputs (handles the callee frees) and writes at most `cap`
// outputs (handles the caller frees) to `outputs`; returns their count,
// TDC_BLOCK_PANICKED when it failed, TDC_BLOCK_TOO_MANY_OUTPUTS for more than `cap`.
typedef int (*tdc_block_fn)(void* ctx, tdc_tensor* inputs, int n, tdc_tensor* outputs, int cap);
// Runs the block without autograd and gives its outputs (at most `cap`, their count in
// `n_out`) one autograd node that runs it again in the backward pass, with the
// random generators' and autocast's states of this run. The context is released
// (`drop`) with the node, or before returning when there is none. Returns
// TDC_USAGE_ERROR for a usage error (a block that returns its input, or more than
// `cap` outputs).
int tdc_checkpoint(
    tdc_block_fn fn, void* ctx, tdc_drop drop, tdc_tensor* inputs, int n,
    tdc_tensor* outputs, int cap, int* n_out);

#ifdef __cplusplus
}
#endif
