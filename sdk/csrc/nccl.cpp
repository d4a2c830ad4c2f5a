// The NCCL backend. Compiled with -DTDC_WITH_NCCL (plus USE_C10D_NCCL, USE_CUDA and
// the CUDA/NCCL include paths) only when libtorch has CUDA and the headers were
// found; otherwise asking for NCCL fails with a message saying how to get it.
#include "internal.hpp"

#include <sstream>

#ifdef TDC_WITH_NCCL
#include <ATen/cuda/CUDAContext.h>
#include <torch/csrc/distributed/c10d/ProcessGroupNCCL.hpp>
#endif

extern "C" int tdc_cuda_capability(int device, int* major, int* minor) {
  TDC_PROTECT(TDC_ERROR, {
#ifdef TDC_WITH_NCCL
    const cudaDeviceProp* props = at::cuda::getDeviceProperties(device);
    *major = props->major;
    *minor = props->minor;
    return TDC_OK;
#else
    (void)device, (void)major, (void)minor;
    throw std::runtime_error(
        "this build of tch-distributed has no CUDA support (libtorch without CUDA, or the CUDA headers were not found at build time)");
#endif
  })
}

namespace tdc {

void cuda_report(std::string& lines) {
#ifdef TDC_WITH_NCCL
  lines += "nccl\t" + c10d::getNcclVersion() + "\n";
  for (int i = 0; i < at::cuda::device_count(); ++i) {
    const cudaDeviceProp* props = at::cuda::getDeviceProperties(i);
    std::ostringstream line;
    line << "gpu " << i << "\t" << props->name << ", compute capability " << props->major
         << "." << props->minor << ", " << props->totalGlobalMem << " bytes\n";
    lines += line.str();
  }
#else
  (void)lines;
#endif
}

bool nccl_compiled() {
#ifdef TDC_WITH_NCCL
  return true;
#else
  return false;
#endif
}

c10::intrusive_ptr<c10d::Backend> make_nccl_backend(
    const c10::intrusive_ptr<c10d::Store>& store, int rank, int size,
    std::chrono::milliseconds timeout, int cuda_device) {
#ifdef TDC_WITH_NCCL
  auto options = c10d::ProcessGroupNCCL::Options::create();
  options->timeout = timeout;
  (void)cuda_device; // bound on the ProcessGroup by the caller
  return c10::make_intrusive<c10d::ProcessGroupNCCL>(store, rank, size, options);
#else
  (void)store, (void)rank, (void)size, (void)timeout, (void)cuda_device;
  throw std::runtime_error(
      "the NCCL backend was not compiled into tch-distributed: build against a "
      "libtorch with CUDA and install the CUDA headers (pip install "
      "'cuda-toolkit[nvcc,cccl]==13.0.2'), or use backend gloo");
#endif
}

} // namespace tdc
