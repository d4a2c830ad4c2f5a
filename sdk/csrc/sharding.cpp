// Fully sharded training (ZeRO-3, FSDP2's `fully_shard`): what Rust cannot do through
// tch. A unit's full parameters hold memory only between its all-gather and its
// reshard: their storage is freed and refilled in place, as FSDP2 does with
// `untyped_storage().resize_()`, so that autograd's saved tensors (which share that
// storage) see the gathered values again in backward. The hooks call back into Rust:
// one when a unit's output gets its gradient (gather before the unit's backward), one
// when a parameter's gradient has been accumulated (reduce-scatter it).
#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/grad_mode.h>
#include <torch/csrc/autograd/utils/lambda_post_hook.h>
#include <torch/csrc/autograd/variable.h>

#include <ATen/ATen.h>
#include <memory>
#include <unordered_set>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "internal.hpp"

struct tdc_grad_hooks {
  std::vector<tdc::Accumulator> accumulators;
  std::vector<uintptr_t> keys;
  ~tdc_grad_hooks() {
    for (size_t i = 0; i < accumulators.size(); i++) {
      accumulators[i]->del_post_hook(keys[i]);
    }
  }
};

namespace {
using tdc::context;
using tdc::tensor;

void call(tdc_callback callback, void* ctx, int index) {
  if (callback(ctx, index) != TDC_OK) {
    // The cause was kept on the Rust side, which reports it after `backward` fails.
    throw std::runtime_error("tch-distributed: a sharded unit's gradient hook failed");
  }
}
} // namespace

// A freed storage throws on any access to its data, with `message` (c10's own check:
// `StorageImpl::release_data_and_set_meta_custom_data_ptr_error_msg_`, what PyTorch
// uses for storages whose data is gone), so that a read of a resharded parameter is a
// libtorch error that names it, never a null pointer a kernel dereferences. c10 has no
// public way to lift that check again when the storage gets its memory back; the flag
// and the method that refreshes the storage's cached "has a check" bit are private.
// An explicit template instantiation may name private members (C++17
// [temp.explicit]/14: "the usual access checking rules do not apply to names used to
// specify explicit instantiations"): `Private` hands out pointers to exactly those two.
namespace {
template <typename Tag, typename Tag::type Member>
struct Private {
  friend typename Tag::type get(Tag) {
    return Member;
  }
};
struct ThrowOnAccess {
  using type = bool c10::StorageImpl::*;
  friend type get(ThrowOnAccess);
};
struct RefreshCheck {
  using type = void (c10::StorageImpl::*)();
  friend type get(RefreshCheck);
};
template struct Private<ThrowOnAccess, &c10::StorageImpl::throw_on_immutable_data_ptr_>;
template struct Private<RefreshCheck, &c10::StorageImpl::refresh_has_data_ptr_check>;
} // namespace

int tdc_storage_free(tdc_tensor t, const char* message) {
  TDC_PROTECT(TDC_ERROR, {
    auto* storage = tensor(t).storage().unsafeGetStorageImpl();
    storage->set_data_ptr_noswap(at::DataPtr(nullptr, storage->device()));
    storage->set_nbytes(0);
    storage->release_data_and_set_meta_custom_data_ptr_error_msg_(std::string(message));
    return TDC_OK;
  })
}

tdc_tensor tdc_storage_alias(tdc_tensor t) {
  TDC_PROTECT(nullptr, {
    auto& param = tensor(t);
    auto* storage = param.storage().unsafeGetStorageImpl();
    size_t nbytes = (param.storage_offset() + param.numel()) * param.element_size();
    if (storage->nbytes() < nbytes) {
      storage->set_data_ptr_noswap(storage->allocator()->allocate(nbytes));
      storage->set_nbytes(nbytes);
    }
    // The data is there again: reads are allowed (see `Private` above).
    storage->*get(ThrowOnAccess{}) = false;
    (storage->*get(RefreshCheck{}))();
    // A tensor of its own over the same storage: writing through it leaves the
    // parameter's version counter alone, so the tensors autograd saved from it in the
    // forward pass stay valid for the backward pass.
    at::Tensor alias = at::empty({0}, param.options());
    alias.set_(param.storage(), param.storage_offset(), param.sizes(), param.strides());
    return new at::Tensor(std::move(alias));
  })
}

uintptr_t tdc_tensor_key(tdc_tensor t) {
  return reinterpret_cast<uintptr_t>(tensor(t).unsafeGetTensorImpl());
}

int tdc_storage_bytes(tdc_tensor t, size_t* out) {
  TDC_PROTECT(TDC_ERROR, {
    *out = tensor(t).storage().nbytes();
    return TDC_OK;
  })
}

int tdc_set_grad(tdc_tensor t, tdc_tensor grad) {
  TDC_PROTECT(TDC_ERROR, {
    tensor(t).mutable_grad() = grad == nullptr ? at::Tensor() : tensor(grad);
    return TDC_OK;
  })
}

int tdc_copy_async(tdc_tensor dst, tdc_tensor src) {
  TDC_PROTECT(TDC_ERROR, {
    at::NoGradGuard no_grad;
    tensor(dst).copy_(tensor(src), /*non_blocking=*/true);
    return TDC_OK;
  })
}

int tdc_hook_gradient(
    tdc_tensor t, tdc_callback callback, void* ctx, tdc_drop drop, int index) {
  TDC_PROTECT(TDC_ERROR, {
    auto held = context(ctx, drop);
    tensor(t).register_hook([callback, held, index](const at::Tensor&) {
      call(callback, held.get(), index);
    });
    return TDC_OK;
  })
}

tdc_grad_hooks* tdc_grad_hooks_new(
    tdc_tensor* params, int n, tdc_callback callback, void* ctx, tdc_drop drop) {
  TDC_PROTECT(nullptr, {
    auto held = context(ctx, drop);
    auto hooks = std::make_unique<tdc_grad_hooks>();
    for (int i = 0; i < n; i++) {
      // As c10d's Reducer: a post hook on the parameter's gradient accumulator runs
      // once its `.grad` holds this backward's gradient. The accumulator is kept
      // alive here (autograd holds it weakly).
      auto accumulator = torch::autograd::impl::grad_accumulator(tensor(params[i]));
      if (!accumulator) {
        throw std::invalid_argument(
            "parameter " + std::to_string(i) + " does not require a gradient");
      }
      auto key = accumulator->add_post_hook(
          std::make_unique<torch::autograd::utils::LambdaPostHook>(
              [callback, held, i](
                  const torch::autograd::variable_list& outputs,
                  const torch::autograd::variable_list&) {
                call(callback, held.get(), i);
                return outputs;
              }));
      hooks->accumulators.push_back(std::move(accumulator));
      hooks->keys.push_back(key);
    }
    return hooks.release();
  })
}

int tdc_grad_hooks_reachable(tdc_grad_hooks* hooks, tdc_tensor* roots, int n, int* out) {
  TDC_PROTECT(TDC_ERROR, {
    using torch::autograd::Node;
    std::unordered_set<Node*> seen;
    std::vector<Node*> stack;
    auto visit = [&](Node* node) {
      if (node != nullptr && seen.insert(node).second) stack.push_back(node);
    };
    for (int i = 0; i < n; i++) {
      const auto& root = tensor(roots[i]);
      if (root.grad_fn()) {
        visit(root.grad_fn().get());
      } else if (root.requires_grad()) {
        visit(torch::autograd::impl::try_get_grad_accumulator(root).get());
      }
    }
    // A checkpointed block's node (activation.cpp) has edges to the parameters the
    // block used, as any node to what it differentiates.
    while (!stack.empty()) {
      Node* node = stack.back();
      stack.pop_back();
      for (const auto& edge : node->next_edges()) visit(edge.function.get());
    }
    for (size_t i = 0; i < hooks->accumulators.size(); i++) {
      out[i] = seen.count(hooks->accumulators[i].get()) ? 1 : 0;
    }
    return TDC_OK;
  })
}

void tdc_grad_hooks_free(tdc_grad_hooks* hooks) {
  delete hooks;
}
