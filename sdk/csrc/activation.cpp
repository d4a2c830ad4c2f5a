// Activation checkpointing: none of a block's activations outlive its forward pass;
// an autograd node stands for the whole block and, in the backward pass, runs the
// block again (a callback into Rust) with autograd on and differentiates it, as
// torch.utils.checkpoint. The random generators' states and autocast's are those of
// the first run, so dropout draws the same numbers.
#include <torch/csrc/autograd/autograd.h>
#include <torch/csrc/autograd/engine.h>
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
    if (n == TDC_BLOCK_TOO_MANY_OUTPUTS) {
      throw std::invalid_argument(
          "the checkpointed block returned more outputs than the limit of " +
          std::to_string(max_outputs));
    }
    if (n < 0) throw std::runtime_error("the checkpointed block panicked");  // TDC_BLOCK_PANICKED
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

// Autocast's cache of casts off for its lifetime. A block's runs make their own
// casts: a cast cached elsewhere (before the block, or by another block of the same
// parameters) would put a node of another graph between the block and the parameter,
// which the recompute, casting anew, would not reach; and a cast cached in the
// recompute, after the region that clears the cache, would outlive the step and feed
// the next forward pass the old weights (the cache is keyed by tensor, not value).
struct NoCastCache {
  bool before = at::autocast::is_autocast_cache_enabled();
  NoCastCache() {
    at::autocast::set_autocast_cache_enabled(false);
  }
  ~NoCastCache() {
    at::autocast::set_autocast_cache_enabled(before);
  }
};

// Sets `saved` for its lifetime, then puts back what was there.
struct Restore {
  State before;
  NoCastCache no_cache;
  Restore(const State& saved, const variable_list& inputs)
      : before(State::capture(inputs)) {
    saved.set();
  }
  ~Restore() {
    try {
      before.set();
    } catch (...) {
    }
  }
};

// Whether `node` was recorded by the block's first run: numbered from `first` on
// (an AccumulateGrad, a parameter's, has the largest number and is not).
bool in_block(const Node* node, uint64_t first) {
  return node->sequence_nr() >= first && node->sequence_nr() != UINT64_MAX;
}

// Whether `edge` is one of `edges` (the same node and input).
bool among(const torch::autograd::edge_list& edges, const torch::autograd::Edge& edge) {
  for (const auto& e : edges) {
    if (e.is_valid() && e.function.get() == edge.function.get() && e.input_nr == edge.input_nr) {
      return true;
    }
  }
  return false;
}

// The edges by which the graph a run of the block recorded (its nodes numbered from
// `first` on) leaves the block, each once: to its inputs, to the parameters it used
// (their AccumulateGrad), to tensors it captured. The walk stops there, and at the
// edges in `inputs`.
torch::autograd::edge_list boundary(
    const variable_list& ys, const torch::autograd::edge_list& inputs, uint64_t first) {
  torch::autograd::edge_list out;
  std::unordered_set<const Node*> seen;
  std::vector<const Node*> stack;
  auto visit = [&](const torch::autograd::Edge& edge) {
    const Node* node = edge.function.get();
    if (node == nullptr) return;
    if (!among(inputs, edge) && in_block(node, first)) {
      if (seen.insert(node).second) stack.push_back(node);
    } else if (!among(out, edge)) {
      out.push_back(edge);
    }
  };
  for (const auto& y : ys) {
    if (y.defined() && y.requires_grad()) visit(torch::autograd::impl::gradient_edge(y));
  }
  while (!stack.empty()) {
    const Node* node = stack.back();
    stack.pop_back();
    for (const auto& edge : node->next_edges()) visit(edge);
  }
  return out;
}

struct CheckpointBackward : public Node {
  Block block;
  variable_list inputs;
  State state;
  bool released = false;

  // Its edges: one per input (none for an input without a gradient), then the others
  // by which the block's graph left it in the first run (the parameters it used,
  // tensors it captured), so that autograd, DDP's search of the graph, and the
  // parameters' hooks see them as the block's.
  CheckpointBackward(Block b, variable_list xs, State s)
      : block(std::move(b)), inputs(std::move(xs)), state(std::move(s)) {}

  std::string name() const override {
    return "tch_distributed::CheckpointBackward";
  }

  void release_variables() override {
    inputs.clear();
    released = true;
  }

  // The recompute's graph (its nodes numbered from `first` on) must leave the block
  // by this node's edges: a gradient along another would be lost.
  // The walk stops at those edges too: on CUDA the recompute runs on autograd's device
  // thread, whose numbers are not the forward pass's.
  void check_same_edges(const variable_list& ys, const variable_list& xs, uint64_t first) {
    auto known_edges = torch::autograd::collect_next_edges(xs);
    for (size_t i = inputs.size(); i < num_outputs(); i++) known_edges.push_back(next_edge(i));
    for (const auto& edge : boundary(ys, known_edges, first)) {
      if (!among(known_edges, edge)) {
        throw std::runtime_error(
            "the checkpointed block's recompute used a tensor that requires a gradient "
            "which its first run did not use, so that tensor's gradient would be lost: "
            "a checkpointed block must compute the same way from the same inputs (its "
            "random numbers are the first run's). Take what changes between calls out "
            "of the block, or call it without checkpoint");
      }
    }
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
    uint64_t first = at::sequence_number::peek();
    {
      Restore restore(state, inputs);
      at::AutoGradMode grad_mode(true);
      outputs = block.run(detached);
    }
    check_same_edges(outputs, detached, first);
    torch::autograd::edge_list roots;
    variable_list seeds;
    for (size_t i = 0; i < outputs.size() && i < grads.size(); i++) {
      if (outputs[i].requires_grad() && grads[i].defined()) {
        roots.push_back(torch::autograd::impl::gradient_edge(outputs[i]));
        seeds.push_back(grads[i]);
      }
    }
    if (roots.empty()) {
      throw std::runtime_error(
          "the checkpointed block's outputs depend on neither its inputs nor a "
          "parameter that requires a gradient: there is nothing to differentiate. Call "
          "the block without checkpoint");
    }
    // The gradients at this node's edges: the detached inputs' (which go on from
    // here), and the edges the first run's graph left by, which the recompute's
    // graph leaves by too. Nothing accumulates here: autograd delivers them along the
    // edges, so a parameter's hooks fire once, with every use of it summed.
    torch::autograd::edge_list wanted;
    std::vector<size_t> slots;
    for (size_t i = 0; i < detached.size(); i++) {
      if (!detached[i].requires_grad()) continue;
      wanted.push_back(torch::autograd::impl::gradient_edge(detached[i]));
      slots.push_back(i);
    }
    for (size_t e = inputs.size(); e < num_outputs(); e++) {
      wanted.push_back(next_edge(e));
      slots.push_back(e);
    }
    auto got = torch::autograd::Engine::get_default_engine().execute(
        roots, seeds, /*keep_graph=*/false, /*create_graph=*/false,
        /*accumulate_grad=*/false, wanted);
    variable_list result(num_outputs());
    for (size_t j = 0; j < slots.size(); j++) result[slots[j]] = got[j];
    return result;
  }
};
// The outputs `ys` of the first run, without its graph, and with the node that runs
// the block again in the backward pass as their history.
variable_list attach(
    const Block& block, const variable_list& xs, const variable_list& ys, uint64_t first,
    State state) {
  for (const auto& y : ys) {
    for (const auto& x : xs) {
      if (y.defined() && x.defined() && y.is_alias_of(x)) {
        throw std::invalid_argument(
            "the checkpointed block returned its input (or a view of it): it has "
            "nothing to recompute. Call the block directly");
      }
    }
  }
  // One edge per input (valid for those that require a gradient), then the others.
  const auto inputs = torch::autograd::collect_next_edges(xs);
  auto edges = inputs;
  bool reached = false;
  for (const auto& edge : boundary(ys, inputs, first)) {
    bool input = among(inputs, edge);
    reached |= input;
    if (!input) edges.push_back(edge);
  }
  bool any = false;
  for (const auto& e : inputs) any |= e.is_valid();
  if (any && !reached) {
    throw std::invalid_argument(
        "the checkpointed block's outputs do not depend on its inputs that require a "
        "gradient (it ignores them, or uses them through operations without a "
        "gradient, such as argmax): those inputs would get no gradient. Pass the block "
        "the tensors it computes from, or detach the inputs it does not differentiate");
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
    {
      NoCastCache no_cache;
      ys = block.run(xs);
    }
    bool trainable = false;
    for (const auto& y : ys) trainable |= y.defined() && y.requires_grad();
    if (trainable) ys = attach(block, xs, ys, first, std::move(state));
  }
  for (size_t i = 0; i < ys.size(); i++) outputs[i] = new at::Tensor(ys[i]);
  return static_cast<int>(ys.size());
}
} // namespace

int tdc_checkpoint(
    tdc_block_fn fn, void* ctx, tdc_drop drop, tdc_tensor* inputs, int n,
    tdc_tensor* outputs, int cap, int* n_out) {
  // The context is the Rust side's until the node holds it.
  auto held = tdc::context(ctx, drop);
  TDC_PROTECT(TDC_ERROR, {
    try {
      *n_out = run_checkpoint(Block{fn, held, cap}, tdc::tensors(inputs, n), outputs);
      return TDC_OK;
    } catch (const std::invalid_argument& e) {
      tdc::set_last_error(e.what());
      return TDC_USAGE_ERROR;
    }
  })
}
