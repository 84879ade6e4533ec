// Dummy weights written straight into device memory: the bytes core/dummy_weights.h's fill_dummy writes on the
// host, bit for bit (both run dummy_word of core/dummy_weights_element.h), so a --load-format dummy model is the
// same on the CPU and the GPU and needs no host copy.
#pragma once
#include <cuda_runtime_api.h>

#include <cstddef>

#include "core/dummy_weights.h"

namespace kestrel::cuda {

// Writes fill_dummy(spec)'s bytes to dst (device memory of `bytes` = dummy_bytes(spec) bytes, any alignment),
// asynchronously on s. Checks spec as dummy_params does and bytes against it (kestrel::Error); allocates nothing
// and reads no device data on the host, so it can be captured in a CUDA graph. Each thread writes 16 bytes (one
// 16-byte store where dst allows it).
void fill_dummy_device(const DummySpec& spec, void* dst, size_t bytes, cudaStream_t s);

namespace detail {
// The kernel launch behind fill_dummy_device (dummy_weights.cu), once the arguments are checked.
cudaError_t launch_fill_dummy(const DummyParams& p, int element_bytes, void* dst, cudaStream_t s);
}  // namespace detail

}  // namespace kestrel::cuda
