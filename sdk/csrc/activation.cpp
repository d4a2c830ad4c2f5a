// Activation checkpointing: none of a block's activations outlive its forward pass;
// an autograd node stands for the whole block and, in the backward pass, runs the
// block again (a callback into Rust) with autograd on and differentiates it, as
// torch.utils.checkpoint. The random generators' states and autocast's are those of
// the first run, so dropout draws the same numbers.
#include <torch/csrc/autograd/autograd.h>
#include <torch/csrc/autograd/edge.h>
#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/functions/utils.h>
#include <torch/csrc/autograd/grad_mode.h>

#include <ATen/ATen.h>
#include <ATen/SequenceNumber.h>
#include <ATen/autocast_mode.h>
#include <ATen/Context.h>
#include <ATen/core/Generator.h>

#include <memory>
#include <mutex>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <unordered_set>
#include <utility>
#include <vector>

#include "internal.hpp"

namespace {
using torch::autograd::Node;
using torch::autograd::variable_list;

// A node as autograd holds it: a std::shared_ptr in libtorch 2.11, a
// c10::intrusive_ptr in 2.13.
using NodePtr = std::remove_cv_t<
    std::remove_reference_t<decltype(std::declval<torch::autograd::Edge>().function)>>;

template <typename T, typename... Args>
NodePtr make_node(Args&&... args) {
  if constexpr (std::is_same_v<NodePtr, std::shared_ptr<Node>>) {
    return std::make_shared<T>(std::forward<Args>(args)...);
  } else {
    return c10::make_intrusive<T>(std::forward<Args>(args)...);
  }
}

// The block: the Rust closure behind `fn` and its context.
struct Block {
  tdc_block_fn fn;
  std::shared_ptr<void> ctx;
  int max_outputs;

  variable_list run(const variable_list& inputs) const {
    // Rust takes each input (a new handle it frees) and hands each output over (a
    // handle freed here).
    std::vector<tdc_tensor> in;
    in.reserve(inputs.size());
    for (const auto& x : inputs) in.push_back(new at::Tensor(x));
    std::vector<tdc_tensor> out(max_outputs, nullptr);
    int n = fn(ctx.get(), in.data(), static_cast<int>(in.size()), out.data(), max_outputs);
    if (n == -2) {
      throw std::invalid_argument(
          "the checkpointed block returned more outputs than the limit of " +
          std::to_string(max_outputs));
    }
    if (n < 0) throw std::runtime_error("the checkpointed block panicked");
    variable_list outputs;
    for (int i = 0; i < n; i++) {
      auto* t = static_cast<at::Tensor*>(out[i]);
      outputs.push_back(*t);
      delete t;
    }
    return outputs;
  }
};

// The generators and autocast as the first run found them, put back around the
// recompute (and the caller's put back after it).
struct State {
  at::Tensor cpu_rng;
  std::vector<std::pair<c10::Device, at::Tensor>> cuda_rng;
  bool autocast_cpu = false, autocast_cuda = false;
  at::ScalarType dtype_cpu = at::kBFloat16, dtype_cuda = at::kHalf;

  static at::Tensor get(at::Generator gen) {
    std::lock_guard<std::mutex> lock(gen.mutex());
    return gen.get_state();
  }

  static void put(at::Generator gen, const at::Tensor& state) {
    std::lock_guard<std::mutex> lock(gen.mutex());
    gen.set_state(state);
  }

  static State capture(const variable_list& inputs) {
    State s;
    s.cpu_rng = get(at::detail::getDefaultCPUGenerator());
    for (const auto& x : inputs) {
      if (!x.defined() || !x.is_cuda()) continue;
      bool seen = false;
      for (const auto& [d, _] : s.cuda_rng) seen |= d == x.device();
      if (!seen) {
        s.cuda_rng.emplace_back(
            x.device(), get(at::globalContext().defaultGenerator(x.device())));
      }
    }
    s.autocast_cpu = at::autocast::is_autocast_enabled(at::kCPU);
    s.dtype_cpu = at::autocast::get_autocast_dtype(at::kCPU);
    s.autocast_cuda = at::autocast::is_autocast_enabled(at::kCUDA);
    s.dtype_cuda = at::autocast::get_autocast_dtype(at::kCUDA);
    return s;
  }

  void set() const {
    put(at::detail::getDefaultCPUGenerator(), cpu_rng);
    for (const auto& [d, state] : cuda_rng) {
      put(at::globalContext().defaultGenerator(d), state);
    }
    at::autocast::set_autocast_enabled(at::kCPU, autocast_cpu);
    at::autocast::set_autocast_dtype(at::kCPU, dtype_cpu);
    at::autocast::set_autocast_enabled(at::kCUDA, autocast_cuda);
    at::autocast::set_autocast_dtype(at::kCUDA, dtype_cuda);
  }
};

// Sets `saved` for its lifetime, then puts back what was there. It is an autocast
// region of its own, as PyTorch's recompute enters `torch.autocast`: the casts of the
// parameters that autocast caches in it are dropped when it ends, if no region
// encloses it. Otherwise the next forward pass would read this step's casts after the
// optimizer changed the parameters (the cache is keyed by tensor, not by value).
struct Restore {
  State before;
  Restore(const State& saved, const variable_list& inputs)
      : before(State::capture(inputs)) {
    saved.set();
    at::autocast::increment_nesting();
  }
  ~Restore() {
    try {
      if (at::autocast::decrement_nesting() == 0) at::autocast::clear_cache();
      before.set();
    } catch (...) {
    }
  }
};

struct CheckpointBackward : public Node {
  Block block;
  variable_list inputs;
  State state;
  bool released = false;

  CheckpointBackward(Block b, variable_list xs, State s)
      : block(std::move(b)), inputs(std::move(xs)), state(std::move(s)) {}

  std::string name() const override {
    return "tch_distributed::CheckpointBackward";
  }

  void release_variables() override {
    inputs.clear();
    released = true;
  }

  variable_list apply(variable_list&& grads) override {
    if (released) {
      throw std::runtime_error(
          "a checkpointed block was differentiated twice: its inputs were released "
          "after the first backward pass (retain_graph is not supported)");
    }
    variable_list detached;
    for (const auto& x : inputs) {
      auto d = x.detach();
      d.requires_grad_(x.requires_grad());
      detached.push_back(d);
    }
    variable_list outputs;
    {
      Restore restore(state, inputs);
      at::AutoGradMode grad_mode(true);
      outputs = block.run(detached);
    }
    variable_list roots, seeds;
    for (size_t i = 0; i < outputs.size() && i < grads.size(); i++) {
      if (outputs[i].requires_grad() && grads[i].defined()) {
        roots.push_back(outputs[i]);
        seeds.push_back(grads[i]);
      }
    }
    if (roots.empty()) {
      throw std::runtime_error(
          "the checkpointed block's outputs depend on neither its inputs nor a "
          "parameter that requires a gradient: there is nothing to differentiate. Call "
          "the block without checkpoint");
    }
    // Accumulates into the block's parameters (their hooks fire once, here) and into
    // the detached inputs, whose gradients go on from this node.
    torch::autograd::backward(roots, seeds);
    // One gradient per edge: the inputs', then none for the anchor, if any.
    variable_list result(num_outputs());
    for (size_t i = 0; i < detached.size(); i++) {
      if (detached[i].requires_grad()) result[i] = detached[i].grad();
    }
    return result;
  }
};
// Whether the graph the first run recorded (its nodes numbered from `first` on) leads
// from an output in `ys` to an input in `xs` that requires a gradient. The walk stops
// at the nodes recorded before the block ran.
bool reaches_an_input(const variable_list& ys, const variable_list& xs, uint64_t first) {
  std::vector<std::pair<const Node*, uint32_t>> targets;
  for (const auto& x : xs) {
    if (!x.defined() || !x.requires_grad()) continue;
    auto edge = torch::autograd::impl::gradient_edge(x);
    targets.emplace_back(edge.function.get(), edge.input_nr);
  }
  std::unordered_set<const Node*> seen;
  std::vector<const Node*> stack;
  for (const auto& y : ys) {
    if (y.defined() && y.grad_fn()) stack.push_back(y.grad_fn().get());
  }
  while (!stack.empty()) {
    const Node* node = stack.back();
    stack.pop_back();
    if (!seen.insert(node).second) continue;
    for (const auto& edge : node->next_edges()) {
      const Node* next = edge.function.get();
      if (next == nullptr) continue;
      for (const auto& [target, nr] : targets) {
        if (next == target && edge.input_nr == nr) return true;
      }
      if (next->sequence_nr() >= first && next->sequence_nr() != UINT64_MAX) {
        stack.push_back(next);
      }
    }
  }
  return false;
}

// The outputs `ys` of the first run, without its graph, and with the node that runs
// the block again in the backward pass as their history.
variable_list attach(
    const Block& block, const variable_list& xs, const variable_list& ys, uint64_t first,
    State state) {
  bool any = false;
  for (const auto& x : xs) any |= x.defined() && x.requires_grad();
  for (const auto& y : ys) {
    for (const auto& x : xs) {
      if (y.defined() && x.defined() && y.is_alias_of(x)) {
        throw std::invalid_argument(
            "the checkpointed block returned its input (or a view of it): it has "
            "nothing to recompute. Call the block directly");
      }
    }
  }
  if (any && !reaches_an_input(ys, xs, first)) {
    throw std::invalid_argument(
        "the checkpointed block's outputs do not depend on its inputs that require a "
        "gradient (it ignores them, or uses them through operations without a "
        "gradient, such as argmax): those inputs would get no gradient. Pass the block "
        "the tensors it computes from, or detach the inputs it does not differentiate");
  }
  auto edges = torch::autograd::collect_next_edges(xs);
  // A block whose inputs require no gradient (the data, token ids) is differentiated
  // still, for its parameters: the node gets an edge to a leaf of its own (an
  // anchor, whose gradient is none), so that the backward pass runs it.
  if (!any) {
    auto anchor = at::zeros({}, at::kFloat).requires_grad_(true);
    edges.push_back(torch::autograd::impl::gradient_edge(anchor));
  }
  auto node = make_node<CheckpointBackward>(block, xs, std::move(state));
  node->set_next_edges(std::move(edges));
  variable_list result;
  for (const auto& y : ys) {
    // Detached, the output lets go of the first run's graph and its activations.
    auto out = y.defined() ? y.detach() : y;
    if (out.defined() && torch::autograd::isDifferentiableType(out.scalar_type())) {
      torch::autograd::set_history(out, node);
    } else {
      node->add_input_metadata(Node::undefined_input());
    }
    result.push_back(out);
  }
  return result;
}

// Runs `block` on `xs` as tdc_checkpoint says; writes the outputs' handles to
// `outputs` and returns their count. A usage error is a std::invalid_argument.
//
// The first run records autograd's graph, as the forward pass of PyTorch's
// non-reentrant checkpoint does, but only to learn what the outputs depend on: it is
// dropped, with the block's activations, before this returns. Outputs that require no
// gradient (a frozen block on the data) are the block's own, with no node, as
// PyTorch's: nothing runs again for them.
int run_checkpoint(const Block& block, variable_list xs, tdc_tensor* outputs) {
  variable_list ys;
  if (!torch::autograd::GradMode::is_enabled()) {
    ys = block.run(xs);
  } else {
    State state = State::capture(xs);
    uint64_t first = at::sequence_number::peek();
    ys = block.run(xs);
    bool trainable = false;
    for (const auto& y : ys) trainable |= y.defined() && y.requires_grad();
    if (trainable) ys = attach(block, xs, ys, first, std::move(state));
  }
  for (size_t i = 0; i < ys.size(); i++) outputs[i] = new at::Tensor(ys[i]);
  return static_cast<int>(ys.size());
}
} // namespace

bool tdc::is_checkpoint_node(const Node* node) {
  return dynamic_cast<const CheckpointBackward*>(node) != nullptr;
}

int tdc_checkpoint(
    tdc_block_fn fn, void* ctx, tdc_drop drop, tdc_tensor* inputs, int n,
    tdc_tensor* outputs, int cap, int* n_out) {
  // The context is the Rust side's until the node holds it.
  auto held = tdc::context(ctx, drop);
  TDC_PROTECT(1, {
    try {
      *n_out = run_checkpoint(Block{fn, held, cap}, tdc::tensors(inputs, n), outputs);
      return 0;
    } catch (const std::invalid_argument& e) {
      tdc::set_last_error(e.what());
      return TDC_USAGE_ERROR;
    }
  })
}
