// extern "C" functions over libtorch's c10d: stores, process groups, collectives and
// the Reducer. See shim.h for the error convention.
#include <torch/csrc/autograd/grad_mode.h>
#include <torch/csrc/distributed/c10d/HashStore.hpp>
#include <torch/csrc/distributed/c10d/PrefixStore.hpp>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>
#include <torch/csrc/distributed/c10d/ProcessGroupGloo.hpp>
#include <torch/csrc/distributed/c10d/ProcessGroupWrapper.hpp>
#include <torch/csrc/distributed/c10d/TCPStore.hpp>
#include <torch/csrc/distributed/c10d/comm.hpp>
#include <torch/csrc/distributed/c10d/logger.hpp>
#include <torch/csrc/distributed/c10d/reducer.hpp>

#include <ATen/ATen.h>
#include <ATen/Version.h>
#include <ATen/detail/CUDAHooksInterface.h>
#include <sstream>
#include <ATen/autocast_mode.h>
#include <ATen/CPUGeneratorImpl.h>
#include <c10/util/Logging.h>
#include <sstream>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <memory>
#include <mutex>

#include "internal.hpp"

struct tdc_pg {
  c10::intrusive_ptr<c10d::ProcessGroup> pg;
};

struct tdc_work {
  c10::intrusive_ptr<c10d::Work> work;
};

struct tdc_reducer {
  std::shared_ptr<c10d::Reducer> reducer;
  // The group its buckets are all-reduced over (a comm hook's state).
  c10::intrusive_ptr<c10d::ProcessGroup> pg;
  // As DDP's constructor gives its Reducer one: the Reducer logs through it (when the
  // set of unused parameters changes under find_unused_parameters, it calls it
  // without checking that it is there). Destroyed first, as DDP's.
  std::shared_ptr<c10d::Logger> logger;
};

namespace {
thread_local std::string last_error;
thread_local bool has_last_error = false;

std::chrono::milliseconds ms(int64_t v) {
  return std::chrono::milliseconds(v);
}

using tdc::tensor;
using tdc::tensors;

// Waits for `work`; a failure or timeout surfaces as an exception.
void wait(const c10::intrusive_ptr<c10d::Work>& work, int64_t timeout_ms) {
  if (!work->wait(ms(timeout_ms))) {
    throw std::runtime_error("operation did not complete");
  }
}

c10d::ReduceOp reduce_op(int op) {
  switch (op) {
    case 0: return c10d::ReduceOp::SUM;
    case 1: return c10d::ReduceOp::AVG;
    case 2: return c10d::ReduceOp::PRODUCT;
    case 3: return c10d::ReduceOp::MIN;
    case 4: return c10d::ReduceOp::MAX;
  }
  throw std::invalid_argument("unknown reduce op " + std::to_string(op));
}

bool is_gloo(const c10::intrusive_ptr<c10d::ProcessGroup>& pg, const at::Tensor& t) {
  return pg->getBackend(t.device().type())->getBackendName() == "gloo";
}
} // namespace

void tdc::set_last_error(const std::string& message) {
  last_error = message;
  has_last_error = true;
}

extern "C" {

char* tdc_last_error(void) {
  if (!has_last_error) return nullptr;
  has_last_error = false;
  return strdup(last_error.c_str());
}

int tdc_nccl_compiled(void) {
  return tdc::nccl_compiled() ? 1 : 0;
}

int tdc_runtime_report(char** data, size_t* len) {
  TDC_PROTECT(TDC_ERROR, {
    std::string lines;
    auto& cuda = at::detail::getCUDAHooks();
    lines += std::string("cpu capability\t") + at::get_cpu_capability() + "\n";
    lines += std::string("cuda available\t") + (cuda.hasCUDA() ? "yes" : "no") + "\n";
    if (cuda.hasCUDART()) {
      lines += "cuda runtime\t" + std::to_string(cuda.versionCUDART()) + "\n";
    }
    if (cuda.hasCuDNN()) {
      lines += "cudnn\t" + std::to_string(cuda.versionCuDNN()) + "\n";
    }
    if (cuda.hasCUDA()) {
      lines += "cuda devices\t" + std::to_string(cuda.deviceCount()) + "\n";
    }
    tdc::cuda_report(lines);
    *len = lines.size();
    *data = static_cast<char*>(malloc(lines.empty() ? 1 : lines.size()));
    if (!lines.empty()) memcpy(*data, lines.data(), lines.size());
    return TDC_OK;
  })
}

// While connecting, c10d logs each failed attempt (warnings, then an error) with the
// C++ stack trace ("TCP client failed to connect/validate …" and the frames); a store
// read that times out, or whose server has gone, logs its socket's failure the same
// way. Each failure reaches the caller as an error that says where and what to check,
// so c10d's own lines are silenced while a store connects or is read, unless
// TORCH_CPP_LOG_LEVEL or TORCH_SHOW_CPP_STACKTRACES=1 asks for libtorch's own output.
// The level is process-wide: the first of overlapping quiet sections (several threads
// may read stores at once) saves it and the last restores it.
namespace {
std::mutex quiet_mutex;
int quiet_depth = 0;
int quiet_saved = 0;
} // namespace

struct QuietStoreWarnings {
  QuietStoreWarnings() {
    std::lock_guard<std::mutex> lock(quiet_mutex);
    if (quiet_depth++ > 0) return;
    quiet_saved = FLAGS_caffe2_log_level;
    const char* show = std::getenv("TORCH_SHOW_CPP_STACKTRACES");
    bool asked = std::getenv("TORCH_CPP_LOG_LEVEL") != nullptr || (show != nullptr && std::string(show) == "1");
    if (!asked && quiet_saved < 3) FLAGS_caffe2_log_level = 3;  // fatal only
  }
  ~QuietStoreWarnings() {
    std::lock_guard<std::mutex> lock(quiet_mutex);
    if (--quiet_depth == 0) FLAGS_caffe2_log_level = quiet_saved;
  }
};

tdc_store* tdc_tcp_store_new(
    const char* host, int port, int world_size, int listen_fd,
    int64_t timeout_ms) {
  TDC_PROTECT(nullptr, {
    c10d::TCPStoreOptions opts;
    opts.port = static_cast<std::uint16_t>(port);
    // A server takes over the socket its caller bound and listens on.
    opts.isServer = listen_fd >= 0;
    if (listen_fd >= 0) opts.masterListenFd = listen_fd;
    opts.numWorkers = world_size;
    // The process group's own rendezvous waits for every rank, with its timeout.
    opts.waitWorkers = false;
    opts.timeout = ms(timeout_ms);
    QuietStoreWarnings quiet;
    return new tdc_store{c10::make_intrusive<c10d::TCPStore>(host, opts)};
  })
}

tdc_store* tdc_hash_store_new(void) {
  TDC_PROTECT(nullptr, { return new tdc_store{c10::make_intrusive<c10d::HashStore>()}; })
}

tdc_store* tdc_prefix_store_new(const char* prefix, tdc_store* base) {
  TDC_PROTECT(nullptr, {
    return new tdc_store{c10::make_intrusive<c10d::PrefixStore>(prefix, base->store)};
  })
}

void tdc_store_free(tdc_store* store) {
  delete store;
}

tdc_store* tdc_store_clone(tdc_store* store) {
  TDC_PROTECT(nullptr, {
    QuietStoreWarnings quiet;
    return new tdc_store{store->store->clone()};
  })
}

int tdc_store_set_timeout(tdc_store* store, int64_t timeout_ms) {
  TDC_PROTECT(TDC_ERROR, {
    store->store->setTimeout(ms(timeout_ms));
    return TDC_OK;
  })
}

int tdc_store_port(tdc_store* store) {
  TDC_PROTECT(TDC_NO_PORT, {
    auto* tcp = dynamic_cast<c10d::TCPStore*>(store->store.get());
    return tcp == nullptr ? TDC_NO_PORT : static_cast<int>(tcp->getPort());
  })
}

int tdc_store_set(tdc_store* store, const char* key, const uint8_t* data, size_t len) {
  TDC_PROTECT(TDC_ERROR, {
    QuietStoreWarnings quiet;
    store->store->set(key, std::vector<uint8_t>(data, data + len));
    return TDC_OK;
  })
}

int tdc_store_get(tdc_store* store, const char* key, uint8_t** data, size_t* len) {
  TDC_PROTECT(TDC_ERROR, {
    QuietStoreWarnings quiet;
    auto value = store->store->get(key);
    *len = value.size();
    *data = static_cast<uint8_t*>(malloc(value.size() == 0 ? 1 : value.size()));
    if (!value.empty()) memcpy(*data, value.data(), value.size());
    return TDC_OK;
  })
}

int tdc_store_add(tdc_store* store, const char* key, int64_t delta, int64_t* result) {
  TDC_PROTECT(TDC_ERROR, {
    QuietStoreWarnings quiet;
    *result = store->store->add(key, delta);
    return TDC_OK;
  })
}

int tdc_store_list_keys(tdc_store* store, char** data, size_t* len) {
  TDC_PROTECT(TDC_ERROR, {
    QuietStoreWarnings quiet;
    std::string all;
    for (const auto& key : store->store->listKeys()) {
      all += key;
      all.push_back('\0');
    }
    *len = all.size();
    *data = static_cast<char*>(malloc(all.empty() ? 1 : all.size()));
    if (!all.empty()) memcpy(*data, all.data(), all.size());
    return TDC_OK;
  })
}

tdc_pg* tdc_pg_new(
    tdc_store* store, int rank, int size, int64_t timeout_ms, int gloo, int nccl,
    int cuda_device, const char* gloo_interfaces, const char* gloo_address, int checks) {
  TDC_PROTECT(nullptr, {
    auto pg = c10::make_intrusive<c10d::ProcessGroup>(store->store, rank, size);
    if (nccl && cuda_device >= 0) {
      // As `init_process_group(device_id=…)`: the group is bound to this rank's GPU.
      pg->setBoundDeviceId(at::Device(at::DeviceType::CUDA, cuda_device));
    }
    // Gloo's devices: one per named interface, as PyTorch reads GLOO_SOCKET_IFNAME;
    // else the given address; else c10d's default (the hostname's address).
    auto gloo_options = [&] {
      auto options = c10d::ProcessGroupGloo::Options::create(ms(timeout_ms));
      if (*gloo_interfaces != '\0') {
        std::stringstream names(gloo_interfaces);
        std::string name;
        while (std::getline(names, name, ',')) {
          if (!name.empty()) {
            options->devices.push_back(
                c10d::ProcessGroupGloo::createDeviceForInterface(name));
          }
        }
      } else if (*gloo_address != '\0') {
        options->devices.push_back(
            c10d::ProcessGroupGloo::createDeviceForHostname(gloo_address));
      } else {
        options->devices.push_back(c10d::ProcessGroupGloo::createDefaultDevice());
      }
      return options;
    };
    // With `checks`, as torch.distributed under TORCH_DISTRIBUTED_DEBUG=DETAIL: each
    // backend wrapped in c10d's ProcessGroupWrapper, which compares every collective's
    // kind, shapes and dtypes across the ranks (through a Gloo group of its own) before
    // running it.
    auto checked = [&](c10::intrusive_ptr<c10d::Backend> backend,
                       const std::string& name) -> c10::intrusive_ptr<c10d::Backend> {
      if (!checks) return backend;
      auto prefixed = c10::make_intrusive<c10d::PrefixStore>("wrapper/" + name + "/", store->store);
      auto helper = c10::make_intrusive<c10d::ProcessGroupGloo>(prefixed, rank, size, gloo_options());
      return c10::make_intrusive<c10d::ProcessGroupWrapper>(backend, helper);
    };
    // Each backend gets its own key space, as torch.distributed does.
    if (gloo) {
      auto prefixed = c10::make_intrusive<c10d::PrefixStore>("cpu/", store->store);
      auto backend = checked(
          c10::make_intrusive<c10d::ProcessGroupGloo>(prefixed, rank, size, gloo_options()),
          "cpu");
      pg->setBackend(at::DeviceType::CPU, c10d::ProcessGroup::GLOO, backend);
      if (!nccl) {
        // As torch.distributed's "gloo": the same backend serves CUDA tensors (it
        // stages them through host memory), so ranks can share a GPU.
        pg->setBackend(at::DeviceType::CUDA, c10d::ProcessGroup::GLOO, backend);
      }
      pg->setDefaultBackend(c10d::ProcessGroup::GLOO);
    }
    if (nccl) {
      auto prefixed = c10::make_intrusive<c10d::PrefixStore>("cuda/", store->store);
      auto backend = checked(
          tdc::make_nccl_backend(prefixed, rank, size, ms(timeout_ms), cuda_device), "cuda");
      pg->setBackend(at::DeviceType::CUDA, c10d::ProcessGroup::NCCL, backend);
      pg->setDefaultBackend(c10d::ProcessGroup::NCCL);
    }
    return new tdc_pg{pg};
  })
}

void tdc_pg_free(tdc_pg* pg) {
  try {
    delete pg;
  } catch (...) {
  }
}

int tdc_all_reduce(tdc_pg* pg, tdc_tensor t, int op, int64_t timeout_ms) {
  TDC_PROTECT(TDC_ERROR, {
    auto& x = tensor(t);
    std::vector<at::Tensor> ts{x};
    c10d::AllreduceOptions opts;
    opts.timeout = ms(timeout_ms);
    // Gloo has no AVG: sum, then divide, as DDP's own Gloo path does.
    bool divide = op == 1 && is_gloo(pg->pg, x);
    opts.reduceOp = divide ? c10d::ReduceOp(c10d::ReduceOp::SUM) : reduce_op(op);
    wait(pg->pg->allreduce(ts, opts), timeout_ms);
    if (divide) {
      at::NoGradGuard no_grad;
      x.div_(pg->pg->getSize());
    }
    return TDC_OK;
  })
}

int tdc_broadcast(tdc_pg* pg, tdc_tensor t, int root, int64_t timeout_ms) {
  TDC_PROTECT(TDC_ERROR, {
    std::vector<at::Tensor> ts{tensor(t)};
    c10d::BroadcastOptions opts;
    opts.rootRank = root;
    opts.timeout = ms(timeout_ms);
    wait(pg->pg->broadcast(ts, opts), timeout_ms);
    return TDC_OK;
  })
}

tdc_work* tdc_all_gather_start(
    tdc_pg* pg, tdc_tensor* outputs, int n, tdc_tensor input, int64_t timeout_ms) {
  TDC_PROTECT(nullptr, {
    std::vector<std::vector<at::Tensor>> out{tensors(outputs, n)};
    std::vector<at::Tensor> in{tensor(input)};
    c10d::AllgatherOptions opts;
    opts.timeout = ms(timeout_ms);
    return new tdc_work{pg->pg->allgather(out, in, opts)};
  })
}

int tdc_work_wait(tdc_work* work, int64_t timeout_ms) {
  TDC_PROTECT(TDC_ERROR, {
    wait(work->work, timeout_ms);
    return TDC_OK;
  })
}

void tdc_work_free(tdc_work* work) {
  delete work;
}

int tdc_reduce_scatter(
    tdc_pg* pg, tdc_tensor output, tdc_tensor* inputs, int n, int op,
    int64_t timeout_ms) {
  TDC_PROTECT(TDC_ERROR, {
    auto& x = tensor(output);
    bool gloo = is_gloo(pg->pg, x);
    // Gloo reduce-scatters CPU tensors only: CUDA ones go through the host (as its
    // CUDA all-reduce does inside Gloo), in and out.
    bool staged = gloo && x.is_cuda();
    std::vector<at::Tensor> in_list = tensors(inputs, n);
    at::Tensor result = staged ? x.to(at::kCPU) : x;
    if (staged) {
      for (auto& t : in_list) t = t.to(at::kCPU);
    }
    std::vector<at::Tensor> out{result};
    std::vector<std::vector<at::Tensor>> in{in_list};
    c10d::ReduceScatterOptions opts;
    opts.timeout = ms(timeout_ms);
    bool divide = op == 1 && gloo;
    opts.reduceOp = divide ? c10d::ReduceOp(c10d::ReduceOp::SUM) : reduce_op(op);
    wait(pg->pg->reduce_scatter(out, in, opts), timeout_ms);
    at::NoGradGuard no_grad;
    if (divide) {
      result.div_(pg->pg->getSize());
    }
    if (staged) {
      x.copy_(result);
    }
    return TDC_OK;
  })
}

int tdc_barrier(tdc_pg* pg, int64_t timeout_ms) {
  TDC_PROTECT(TDC_ERROR, {
    c10d::BarrierOptions opts;
    opts.timeout = ms(timeout_ms);
    wait(pg->pg->barrier(opts), timeout_ms);
    return TDC_OK;
  })
}

int tdc_broadcast_coalesced(
    tdc_pg* pg, tdc_tensor* ts, int n, size_t buffer_bytes, int root) {
  TDC_PROTECT(TDC_ERROR, {
    at::NoGradGuard no_grad;
    std::vector<at::Tensor> detached;
    detached.reserve(n);
    for (int i = 0; i < n; i++) detached.push_back(tensor(ts[i]).detach());
    c10d::broadcast_coalesced(pg->pg, detached, buffer_bytes, root);
    return TDC_OK;
  })
}

int tdc_verify_params(tdc_pg* pg, tdc_tensor* params, int n) {
  TDC_PROTECT(TDC_ERROR, {
    c10d::verify_params_across_processes(pg->pg, tensors(params, n), std::nullopt);
    return TDC_OK;
  })
}

tdc_reducer* tdc_reducer_new(
    tdc_pg* pg, tdc_tensor* params, const char** names, int n,
    int64_t bucket_bytes_cap, int64_t first_bucket_bytes_cap,
    int find_unused_parameters, int gradient_as_bucket_view) {
  TDC_PROTECT(nullptr, {
    auto ps = tensors(params, n);
    std::unordered_map<size_t, std::string> param_names;
    for (int i = 0; i < n; i++) param_names[i] = names[i];
    // As DistributedDataParallel in torch 2.11: without unused-parameter search the
    // first iteration uses one bucket, and the Reducer rebuilds buckets of
    // (first_bucket_bytes_cap, bucket_bytes_cap) from the order gradients became
    // ready; with it, the size-based buckets are used from the start. Buckets are
    // reversed because gradients become ready roughly back to front.
    std::vector<size_t> limits;
    if (find_unused_parameters) {
      limits = {static_cast<size_t>(first_bucket_bytes_cap),
                static_cast<size_t>(bucket_bytes_cap)};
    } else {
      limits = {std::numeric_limits<size_t>::max()};
    }
    std::vector<bool> sparse(n, false);
    auto [indices, per_bucket_limits] =
        c10d::compute_bucket_assignment_by_size(ps, limits, sparse);
    std::reverse(indices.begin(), indices.end());
    auto reducer = std::make_shared<c10d::Reducer>(
        ps, std::move(indices), pg->pg, sparse, bucket_bytes_cap,
        find_unused_parameters != 0, gradient_as_bucket_view != 0,
        std::move(param_names), first_bucket_bytes_cap,
        /*skip_all_reduce_unused_params=*/false,
        /*use_python_reducer=*/false,
        /*bucket_bytes_cap_list=*/std::vector<int64_t>{});
    auto logger = std::make_shared<c10d::Logger>(reducer);
    reducer->set_logger(logger);
    return new tdc_reducer{std::move(reducer), pg->pg, std::move(logger)};
  })
}

void tdc_reducer_free(tdc_reducer* reducer) {
  try {
    delete reducer;
  } catch (...) {
  }
}

namespace {
// bf16 gradient compression, as PyTorch's bf16_compress_hook (and c10d's built-in
// FP16CompressCommHook in bf16): the bucket cast to bfloat16 and divided by the world
// size, all-reduced (sum), and copied back into the bucket.
class Bf16CompressCommHook
    : public c10d::CppCommHookInterface<c10::intrusive_ptr<c10d::ProcessGroup>> {
 public:
  explicit Bf16CompressCommHook(const c10::intrusive_ptr<c10d::ProcessGroup>& state)
      : c10d::CppCommHookInterface<c10::intrusive_ptr<c10d::ProcessGroup>>(state) {}

  c10::intrusive_ptr<c10::ivalue::Future> runHook(c10d::GradBucket& bucket) override {
    auto compressed = bucket.getBufferRef().to(at::kBFloat16);
    compressed.div_(state_->getSize());
    std::vector<at::Tensor> tensors = {compressed};
    auto reduced = state_->allreduce(tensors)->getFuture();
    auto buffer = bucket.getBufferRef();
    auto decompress = [buffer](c10::ivalue::Future& future) {
      buffer.copy_(future.value().toTensorVector()[0]);
      return c10::IValue(buffer);
    };
    return reduced->then(decompress, reduced->elementType());
  }
};
} // namespace

int tdc_reducer_register_comm_hook(tdc_reducer* reducer, int kind) {
  TDC_PROTECT(TDC_ERROR, {
    switch (kind) {
      case 1:
        reducer->reducer->register_builtin_comm_hook(c10d::BuiltinCommHookType::FP16_COMPRESS);
        break;
      case 2:
        reducer->reducer->register_comm_hook(
            std::make_unique<Bf16CompressCommHook>(reducer->pg));
        break;
      default:
        throw std::invalid_argument("unknown comm hook " + std::to_string(kind));
    }
    return TDC_OK;
  })
}

int tdc_reducer_prepare_for_forward(tdc_reducer* reducer) {
  TDC_PROTECT(TDC_ERROR, {
    reducer->reducer->prepare_for_forward();
    return TDC_OK;
  })
}

int tdc_reducer_set_static_graph(tdc_reducer* reducer) {
  TDC_PROTECT(TDC_ERROR, {
    reducer->reducer->set_static_graph();
    return TDC_OK;
  })
}

int tdc_reducer_delay_all_reduce(tdc_reducer* reducer) {
  TDC_PROTECT(TDC_ERROR, {
    reducer->reducer->delay_all_reduce();
    return TDC_OK;
  })
}

int tdc_reducer_rebuild_buckets(tdc_reducer* reducer, int* rebuilt) {
  TDC_PROTECT(TDC_ERROR, {
    *rebuilt = reducer->reducer->rebuild_buckets() ? 1 : 0;
    return TDC_OK;
  })
}

int tdc_reducer_prepare_for_backward(tdc_reducer* reducer, tdc_tensor* outputs, int n) {
  TDC_PROTECT(TDC_ERROR, {
    reducer->reducer->prepare_for_backward(tensors(outputs, n));
    return TDC_OK;
  })
}

int tdc_reducer_buckets(tdc_reducer* reducer, int64_t* sizes, int cap, int* count) {
  TDC_PROTECT(TDC_ERROR, {
    auto buckets = reducer->reducer->get_grad_buckets(/*return_zero_tensors=*/false);
    *count = static_cast<int>(buckets.size());
    for (int i = 0; i < *count && i < cap; i++) {
      sizes[i] = static_cast<int64_t>(buckets[i].getParameters().size());
    }
    return TDC_OK;
  })
}

} // extern "C"

int tdc_randperm(int64_t n, uint64_t seed, tdc_tensor out) {
  TDC_PROTECT(TDC_ERROR, {
    // A generator of its own, as DistributedSampler's `torch.Generator()`: the
    // global generators are left untouched.
    auto gen = at::make_generator<at::CPUGeneratorImpl>(seed);
    tensor(out).copy_(at::randperm(n, gen, at::TensorOptions().dtype(at::kLong)));
    return TDC_OK;
  })
}

// The default generator of the CPU (cuda_index < 0) or of CUDA device cuda_index.
static at::Generator default_generator(int cuda_index) {
  if (cuda_index < 0) return at::detail::getDefaultCPUGenerator();
  return at::globalContext().defaultGenerator(c10::Device(c10::DeviceType::CUDA, cuda_index));
}

int tdc_rng_state(int cuda_index, tdc_tensor* out) {
  TDC_PROTECT(TDC_ERROR, {
    auto gen = default_generator(cuda_index);
    std::lock_guard<std::mutex> lock(gen.mutex());
    *out = new torch::Tensor(gen.get_state());
    return TDC_OK;
  })
}

int tdc_set_rng_state(int cuda_index, tdc_tensor state) {
  TDC_PROTECT(TDC_ERROR, {
    auto gen = default_generator(cuda_index);
    std::lock_guard<std::mutex> lock(gen.mutex());
    gen.set_state(tensor(state));
    return TDC_OK;
  })
}

int tdc_rng_current_seed(int cuda_index, uint64_t* out) {
  TDC_PROTECT(TDC_ERROR, {
    auto gen = default_generator(cuda_index);
    std::lock_guard<std::mutex> lock(gen.mutex());
    *out = gen.current_seed();
    return TDC_OK;
  })
}

int tdc_seed_rng(int cuda_index, uint64_t seed) {
  TDC_PROTECT(TDC_ERROR, {
    auto gen = default_generator(cuda_index);
    std::lock_guard<std::mutex> lock(gen.mutex());
    gen.set_current_seed(seed);
    return TDC_OK;
  })
}

int tdc_amp_unscale(tdc_tensor* grads, int n, tdc_tensor found_inf, tdc_tensor inv_scale) {
  TDC_PROTECT(TDC_ERROR, {
    std::vector<at::Tensor> ts;
    ts.reserve(n);
    for (int i = 0; i < n; i++) ts.push_back(tensor(grads[i]));
    at::_amp_foreach_non_finite_check_and_unscale_(ts, tensor(found_inf), tensor(inv_scale));
    return TDC_OK;
  })
}

int tdc_autocast_enter(int device_type, int dtype, int* prev_enabled, int* prev_dtype) {
  TDC_PROTECT(TDC_ERROR, {
    const auto device = device_type == 1 ? at::kCUDA : at::kCPU;
    *prev_enabled = at::autocast::is_autocast_enabled(device);
    *prev_dtype = static_cast<int>(at::autocast::get_autocast_dtype(device));
    at::autocast::set_autocast_enabled(device, true);
    at::autocast::set_autocast_dtype(device, static_cast<at::ScalarType>(dtype));
    at::autocast::increment_nesting();
    return TDC_OK;
  })
}

int tdc_set_onednn_enabled(int enabled) {
  TDC_PROTECT(TDC_ERROR, {
    at::globalContext().setUserEnabledMkldnn(enabled != 0);
    return TDC_OK;
  })
}

int tdc_autocast_exit(int device_type, int prev_enabled, int prev_dtype) {
  TDC_PROTECT(TDC_ERROR, {
    const auto device = device_type == 1 ? at::kCUDA : at::kCPU;
    if (at::autocast::decrement_nesting() == 0) at::autocast::clear_cache();
    at::autocast::set_autocast_enabled(device, prev_enabled != 0);
    at::autocast::set_autocast_dtype(device, static_cast<at::ScalarType>(prev_dtype));
    return TDC_OK;
  })
}
