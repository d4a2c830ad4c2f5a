// Shared between the shim's translation units (shim.cpp, sealed_store.cpp, nccl.cpp,
// optim.cpp, sharding.cpp, activation.cpp).
#pragma once
#include <torch/headeronly/version.h>
#include <torch/csrc/distributed/c10d/Backend.hpp>
#include <torch/csrc/distributed/c10d/Store.hpp>
#include <torch/csrc/autograd/variable.h>

#include <chrono>
#include <memory>
#include <string>
#include <vector>

#include "shim.h"

// The libtorch versions the shim is written for, in one place: 2.11 (tch 0.24) and
// 2.13 (tch 0.26). Between them the c10d headers that the shim uses differ only in
// what it does not call (2.13 adds `Reducer(…, batched_grad_copy = false)` last,
// `Store::barrier`, Gloo's `alltoall`, `Backend::suspend`/`resume`), so one source
// compiles and behaves the same against both. A difference that needs code goes here,
// behind TORCH_VERSION_MINOR.
static_assert(
    TORCH_VERSION_MAJOR == 2 &&
        (TORCH_VERSION_MINOR == 11 || TORCH_VERSION_MINOR == 13),
    "tch-distributed's shim supports libtorch 2.11 and 2.13 (build.rs checks first)");

struct tdc_store {
  c10::intrusive_ptr<c10d::Store> store;
};

namespace tdc {
// Stores `message` as this thread's last error.
void set_last_error(const std::string& message);

// Creates the NCCL backend (nccl.cpp); throws when NCCL was not compiled in.
c10::intrusive_ptr<c10d::Backend> make_nccl_backend(
    const c10::intrusive_ptr<c10d::Store>& store, int rank, int size,
    std::chrono::milliseconds timeout, int cuda_device);
bool nccl_compiled();
// Appends the NCCL version and one line per GPU (name, compute capability, memory) to
// `lines` as `key\tvalue\n`; nothing in a build without CUDA.
void cuda_report(std::string& lines);

// A gradient accumulator as autograd hands it out: a std::shared_ptr<Node> in libtorch
// 2.11, a c10::intrusive_ptr<Node> in 2.13.
using Accumulator =
    decltype(torch::autograd::impl::grad_accumulator(std::declval<const at::Tensor&>()));

// The tensor behind a handle from Rust (`tch::Tensor`'s `at::Tensor*`).
inline at::Tensor& tensor(tdc_tensor t) {
  return *static_cast<at::Tensor*>(t);
}

inline std::vector<at::Tensor> tensors(tdc_tensor* ts, int n) {
  std::vector<at::Tensor> out;
  out.reserve(n);
  for (int i = 0; i < n; i++) out.push_back(tensor(ts[i]));
  return out;
}

// The Rust side's context, released (through `drop`) with the last owner.
inline std::shared_ptr<void> context(void* ctx, tdc_drop drop) {
  return std::shared_ptr<void>(ctx, [drop](void* p) { drop(p); });
}
} // namespace tdc

// Wraps a function body: any C++ exception becomes this thread's last error and
// the function returns `fail` (NULL, TDC_ERROR, or TDC_NO_PORT).
#define TDC_PROTECT(fail, ...)                   \
  try {                                          \
    __VA_ARGS__                                  \
  } catch (const std::exception& e) {            \
    tdc::set_last_error(e.what());               \
    return fail;                                 \
  } catch (...) {                                \
    tdc::set_last_error("unknown C++ exception"); \
    return fail;                                 \
  }
