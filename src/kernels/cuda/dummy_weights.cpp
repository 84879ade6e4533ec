#include "kernels/cuda/dummy_weights.h"

#include "core/error.h"
#include "kernels/cuda/runtime.h"

namespace kestrel::cuda {

void fill_dummy_device(const DummySpec& spec, void* dst, size_t bytes, cudaStream_t s) {
  const DummyParams p = dummy_params(spec);
  const size_t width = dtype_size(spec.dtype);
  const size_t expected = static_cast<size_t>(p.numel) * width;
  KESTREL_CHECK(bytes == expected, "fill_dummy_device: {} {} is {} bytes, the destination has {}",
                dummy_layout_name(spec.layout), dtype_name(spec.dtype), expected, bytes);
  if (bytes == 0) return;
  KESTREL_CHECK(dst != nullptr, "fill_dummy_device: the destination is null");
  KESTREL_CUDA_CHECK(detail::launch_fill_dummy(p, static_cast<int>(width), dst, s));
}

}  // namespace kestrel::cuda
