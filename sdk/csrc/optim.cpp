// The optimizer updates of the SDK's `Optimizer` (sdk/src/optim/kernels.rs): each
// function updates one group of parameters (same device, dtype, options and step
// count) in place, with one call of ATen's multi-tensor kernels per operation, never a
// loop of per-parameter kernels.
//
// Three implementations (`mode`):
// - 0, tch: libtorch's C++ `torch::optim` arithmetic (torch/csrc/api/src/optim/
//   {sgd,adam,adamw,rmsprop}.cpp, what tch runs), operation for operation, with the
//   `_foreach_*` ops. On the CPU a `_foreach_*` op runs the same kernel per tensor as
//   the C++ optimizer, so a program's results are tch's to the bit; on CUDA it is one
//   multi-tensor kernel per operation.
// - 1, foreach: `torch.optim`'s `foreach=True` arithmetic (its `_multi_tensor_*`
//   functions), which differs from C++ only in taking running averages with `lerp_`
//   (Adam's first moment, centered RMSprop's gradient average) and Adam's bias
//   correction as Python writes it.
// - 2, fused: ATen's fused kernels, `_fused_sgd_`, `_fused_adam_`, `_fused_adamw_`,
//   as `torch.optim.{SGD,Adam,AdamW}(fused=True)` call them: one kernel for the whole
//   update (the step counts are `state_steps` tensors, incremented first, as
//   `torch.optim` does).
#include <ATen/ATen.h>
#include <torch/csrc/autograd/grad_mode.h>
#include <torch/optim/adam.h>
#include <torch/optim/adamw.h>
#include <torch/optim/optimizer.h>
#include <torch/optim/rmsprop.h>
#include <torch/optim/sgd.h>
#include <torch/serialize/input-archive.h>

#include <cmath>
#include <cstring>
#include <sstream>

#include "internal.hpp"

namespace {

std::vector<at::Tensor> list(tdc_tensor* ts, int n) {
  std::vector<at::Tensor> out;
  out.reserve(n);
  for (int i = 0; i < n; i++) out.push_back(*static_cast<at::Tensor*>(ts[i]));
  return out;
}

// The gradients of `params`, which the caller checked are defined.
std::vector<at::Tensor> grads_of(const std::vector<at::Tensor>& params) {
  std::vector<at::Tensor> out;
  out.reserve(params.size());
  for (const auto& p : params) out.push_back(p.grad());
  return out;
}

// Hands new tensors to the caller, which owns them (tch's `Tensor::from_ptr`).
void give(const std::vector<at::Tensor>& ts, tdc_tensor* out) {
  for (size_t i = 0; i < ts.size(); i++) out[i] = new at::Tensor(ts[i]);
}

} // namespace

extern "C" {

int tdc_sgd_step(
    tdc_tensor* params_, tdc_tensor* bufs_, tdc_tensor* new_bufs, int n,
    double lr, double momentum, double dampening, double weight_decay,
    int nesterov, int mode) {
  TDC_PROTECT(TDC_ERROR, {
    // tch's and torch.optim's foreach SGD are the same operations.
    const bool fused = mode == 2;
    at::NoGradGuard no_grad;
    auto params = list(params_, n);
    auto grads = grads_of(params);
    const bool first = momentum != 0 && bufs_ == nullptr;
    if (fused) {
      std::vector<at::Tensor> bufs;
      if (momentum != 0) {
        if (first) {
          for (const auto& g : grads) bufs.push_back(at::empty_like(g));
          give(bufs, new_bufs);
        } else {
          bufs = list(bufs_, n);
        }
      }
      at::_fused_sgd_(
          params, grads, bufs, weight_decay, momentum, lr, dampening,
          nesterov != 0, /*maximize=*/false, first);
      return TDC_OK;
    }
    // d_p = grad (+ weight_decay * p)
    std::vector<at::Tensor> d_p = grads;
    if (weight_decay != 0) d_p = at::_foreach_add(grads, params, weight_decay);
    if (momentum != 0) {
      std::vector<at::Tensor> bufs;
      if (first) {
        // Once, at a parameter's first step, as the C++ optimizer does.
        for (const auto& d : d_p) bufs.push_back(d.detach().clone());
        give(bufs, new_bufs);
      } else {
        bufs = list(bufs_, n);
        at::_foreach_mul_(bufs, momentum);
        at::_foreach_add_(bufs, d_p, 1 - dampening);
      }
      if (nesterov) {
        d_p = at::_foreach_add(d_p, bufs, momentum);
      } else {
        d_p = bufs;
      }
    }
    at::_foreach_add_(params, d_p, -1 * lr);
    return TDC_OK;
  })
}

int tdc_adam_step(
    tdc_tensor* params_, tdc_tensor* exp_avgs_, tdc_tensor* exp_avg_sqs_,
    tdc_tensor* max_exp_avg_sqs_, tdc_tensor* steps_, int n, int64_t step,
    double lr, double beta1, double beta2, double eps, double weight_decay,
    int amsgrad, int decoupled, int mode) {
  TDC_PROTECT(TDC_ERROR, {
    const bool fused = mode == 2;
    const bool python = mode == 1;
    at::NoGradGuard no_grad;
    auto params = list(params_, n);
    auto grads = grads_of(params);
    auto exp_avgs = list(exp_avgs_, n);
    auto exp_avg_sqs = list(exp_avg_sqs_, n);
    std::vector<at::Tensor> max_exp_avg_sqs;
    if (amsgrad) max_exp_avg_sqs = list(max_exp_avg_sqs_, n);
    if (fused) {
      auto steps = list(steps_, n);
      at::_foreach_add_(steps, 1);
      if (decoupled) {
        at::_fused_adamw_(
            params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, steps, lr,
            beta1, beta2, weight_decay, eps, amsgrad != 0, /*maximize=*/false);
      } else {
        at::_fused_adam_(
            params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, steps, lr,
            beta1, beta2, weight_decay, eps, amsgrad != 0, /*maximize=*/false);
      }
      return TDC_OK;
    }
    // AdamW decays the parameters first; Adam adds the decay to the gradients.
    if (weight_decay != 0) {
      if (decoupled) {
        at::_foreach_mul_(params, 1 - lr * weight_decay);
      } else {
        grads = at::_foreach_add(grads, params, weight_decay);
      }
    }
    const double bias_correction1 = 1 - std::pow(beta1, step);
    const double bias_correction2 = 1 - std::pow(beta2, step);
    if (python) {
      at::_foreach_lerp_(exp_avgs, grads, 1 - beta1);
    } else {
      at::_foreach_mul_(exp_avgs, beta1);
      at::_foreach_add_(exp_avgs, grads, 1 - beta1);
    }
    at::_foreach_mul_(exp_avg_sqs, beta2);
    at::_foreach_addcmul_(exp_avg_sqs, grads, grads, 1 - beta2);
    std::vector<at::Tensor> denom;
    if (amsgrad) {
      at::_foreach_maximum_(max_exp_avg_sqs, exp_avg_sqs);
      denom = at::_foreach_sqrt(max_exp_avg_sqs);
    } else {
      denom = at::_foreach_sqrt(exp_avg_sqs);
    }
    // Python: `bc ** 0.5` and `(lr / bc) * -1`.
    at::_foreach_div_(
        denom, python ? std::pow(bias_correction2, 0.5) : std::sqrt(bias_correction2));
    at::_foreach_add_(denom, eps);
    const double step_size = lr / bias_correction1;
    at::_foreach_addcdiv_(params, exp_avgs, denom, python ? step_size * -1 : -step_size);
    return TDC_OK;
  })
}

int tdc_rmsprop_step(
    tdc_tensor* params_, tdc_tensor* square_avgs_, tdc_tensor* momentum_bufs_,
    tdc_tensor* grad_avgs_, int n, double lr, double alpha, double eps,
    double weight_decay, double momentum, int centered, int mode) {
  TDC_PROTECT(TDC_ERROR, {
    at::NoGradGuard no_grad;
    auto params = list(params_, n);
    auto grads = grads_of(params);
    auto square_avgs = list(square_avgs_, n);
    if (weight_decay != 0) grads = at::_foreach_add(grads, params, weight_decay);
    at::_foreach_mul_(square_avgs, alpha);
    at::_foreach_addcmul_(square_avgs, grads, grads, 1 - alpha);
    std::vector<at::Tensor> avg;
    if (centered) {
      auto grad_avgs = list(grad_avgs_, n);
      if (mode == 1) {
        at::_foreach_lerp_(grad_avgs, grads, 1 - alpha);
      } else {
        at::_foreach_mul_(grad_avgs, alpha);
        at::_foreach_add_(grad_avgs, grads, 1 - alpha);
      }
      avg = at::_foreach_addcmul(square_avgs, grad_avgs, grad_avgs, -1);
      at::_foreach_sqrt_(avg);
      at::_foreach_add_(avg, eps);
    } else {
      avg = at::_foreach_sqrt(square_avgs);
      at::_foreach_add_(avg, eps);
    }
    if (momentum > 0) {
      auto bufs = list(momentum_bufs_, n);
      at::_foreach_mul_(bufs, momentum);
      at::_foreach_addcdiv_(bufs, grads, avg);
      at::_foreach_add_(params, bufs, -lr);
    } else {
      at::_foreach_addcdiv_(params, grads, avg, -lr);
    }
    return TDC_OK;
  })
}

int tdc_zero_grad(tdc_tensor* params_, int n) {
  TDC_PROTECT(TDC_ERROR, {
    for (auto& p : list(params_, n)) p.mutable_grad().reset();
    return TDC_OK;
  })
}

// The gradient accumulators of an optimizer's parameters as they joined it, held (as
// c10d's Reducer and the sharding's hooks hold the ones they hook), so that autograd
// hands out the same ones for as long as nothing replaces them. `set_data` with
// another dtype or device replaces a variable's (`vs.double()`, `vs.half()` and back,
// `vs.set_device(…)`, a load in another dtype): the new one has none of the hooks
// that average its gradient over the ranks.
struct tdc_accumulators {
  std::vector<tdc::Accumulator> held;  // null for a parameter without a gradient
};

tdc_accumulators* tdc_accumulators_new() {
  TDC_PROTECT(nullptr, { return new tdc_accumulators(); })
}

int tdc_accumulators_add(tdc_accumulators* a, tdc_tensor* params, int n) {
  TDC_PROTECT(TDC_ERROR, {
    for (int i = 0; i < n; i++) {
      const auto& p = tdc::tensor(params[i]);
      a->held.push_back(
          p.requires_grad() && p.is_leaf() ? torch::autograd::impl::grad_accumulator(p)
                                           : tdc::Accumulator());
    }
    return TDC_OK;
  })
}

int tdc_accumulators_changed(tdc_accumulators* a, tdc_tensor* params, int n, int* first) {
  TDC_PROTECT(TDC_ERROR, {
    TORCH_CHECK(
        static_cast<size_t>(n) == a->held.size(), "accumulators: ", a->held.size(),
        " held, ", n, " parameters given");
    *first = -1;
    for (int i = 0; i < n; i++) {
      const auto& held = a->held[i];
      if (held &&
          torch::autograd::impl::try_get_grad_accumulator(tdc::tensor(params[i])).get() !=
              held.get()) {
        *first = i;
        break;
      }
    }
    return TDC_OK;
  })
}

void tdc_accumulators_free(tdc_accumulators* a) {
  delete a;
}

// Reads an optimizer state that an earlier tch-distributed wrote in libtorch's
// optimizer archive (`optimizer.pt`): loads it into a libtorch optimizer of `kind` (0
// SGD, 1 Adam, 2 AdamW, 3 RMSprop) over `params`, each in parameter group
// `groups[i]`, built as tch builds its optimizers (an empty group 0, then each
// parameter added to its group, in order), and hands out, for
// each parameter in order, its state tensors (`out[i * 4 + k]`, NULL when absent): SGD
// momentum_buffer; Adam/AdamW exp_avg, exp_avg_sq, max_exp_avg_sq; RMSprop
// square_avg, momentum_buffer, grad_avg; and its step count in `steps[i]` (-1 when the
// parameter has no state). The groups' options in the archive are not read: the
// optimizer's own are kept.
int tdc_optimizer_archive_state(
    int kind, tdc_tensor* params_, const int64_t* groups, int n,
    const uint8_t* data, size_t len, tdc_tensor* out, int64_t* steps) {
  TDC_PROTECT(TDC_ERROR, {
    auto params = list(params_, n);
    std::unique_ptr<torch::optim::Optimizer> opt;
    std::vector<at::Tensor> none;
    switch (kind) {
      case 0: opt = std::make_unique<torch::optim::SGD>(none, torch::optim::SGDOptions(0)); break;
      case 1: opt = std::make_unique<torch::optim::Adam>(none); break;
      case 2: opt = std::make_unique<torch::optim::AdamW>(none); break;
      case 3: opt = std::make_unique<torch::optim::RMSprop>(none); break;
      default: throw std::invalid_argument("unknown optimizer kind");
    }
    auto& param_groups = opt->param_groups();
    for (int i = 0; i < n; i++) {
      while (param_groups.size() <= static_cast<size_t>(groups[i])) {
        param_groups.push_back(
            torch::optim::OptimizerParamGroup({}, opt->defaults().clone()));
      }
      param_groups[groups[i]].params().push_back(params[i]);
    }
    std::istringstream in(std::string(reinterpret_cast<const char*>(data), len));
    torch::serialize::InputArchive archive;
    archive.load_from(in);
    opt->load(archive);
    auto& state = opt->state();
    for (int i = 0; i < n; i++) {
      for (int k = 0; k < 4; k++) out[i * 4 + k] = nullptr;
      steps[i] = -1;
      auto found = state.find(params[i].unsafeGetTensorImpl());
      if (found == state.end()) continue;
      auto put = [&](int k, const at::Tensor& t) {
        if (t.defined()) out[i * 4 + k] = new at::Tensor(t);
      };
      auto* s = found->second.get();
      if (auto* sgd = dynamic_cast<torch::optim::SGDParamState*>(s)) {
        put(0, sgd->momentum_buffer());
        steps[i] = 0;
      } else if (auto* adam = dynamic_cast<torch::optim::AdamParamState*>(s)) {
        put(0, adam->exp_avg());
        put(1, adam->exp_avg_sq());
        put(2, adam->max_exp_avg_sq());
        steps[i] = adam->step();
      } else if (auto* adamw = dynamic_cast<torch::optim::AdamWParamState*>(s)) {
        put(0, adamw->exp_avg());
        put(1, adamw->exp_avg_sq());
        put(2, adamw->max_exp_avg_sq());
        steps[i] = adamw->step();
      } else if (auto* rms = dynamic_cast<torch::optim::RMSpropParamState*>(s)) {
        put(0, rms->square_avg());
        put(1, rms->momentum_buffer());
        put(2, rms->grad_avg());
        steps[i] = rms->step();
      }
    }
    return TDC_OK;
  })
}

} // extern "C"
