// libtorch's CUDA caching-allocator statistics for the Rust side of the GPU benchmarks:
// what `torch.cuda.max_memory_allocated()`, `max_memory_reserved()`,
// `reset_peak_memory_stats()` and `empty_cache()` read and do in Python. tch exposes
// none of these; the device-generic `at::accelerator` API (ATen/DeviceAccelerator.h)
// reaches the same allocator instance without the CUDA headers.
#include <ATen/DeviceAccelerator.h>

#include <cstdint>

extern "C" {

// out[0..4]: allocated bytes now, allocated peak, reserved bytes now, reserved peak
// (the "all" pool, as torch.cuda.memory_stats()'s "allocated_bytes.all.*").
// Returns 0, or 1 when libtorch has no accelerator or the call throws.
int tdcb_device_memory(int device, int64_t* out) {
  try {
    const auto stats = at::accelerator::getDeviceStats(static_cast<c10::DeviceIndex>(device));
    const auto all = static_cast<size_t>(c10::CachingAllocator::StatType::AGGREGATE);
    out[0] = stats.allocated_bytes[all].current;
    out[1] = stats.allocated_bytes[all].peak;
    out[2] = stats.reserved_bytes[all].current;
    out[3] = stats.reserved_bytes[all].peak;
    return 0;
  } catch (...) {
    return 1;
  }
}

// Frees the allocator's cached blocks and restarts its peaks from the current values,
// as torch.cuda.empty_cache() then torch.cuda.reset_peak_memory_stats().
int tdcb_device_memory_reset(int device) {
  try {
    at::accelerator::emptyCache();
    at::accelerator::resetPeakStats(static_cast<c10::DeviceIndex>(device));
    return 0;
  } catch (...) {
    return 1;
  }
}

}  // extern "C"
