// The CUDA backend's weights, in the forms its kernels take, and their upload. Linear weights and routed experts stay
// in their stored precision: bf16 as bf16, FP8 e4m3 codes with their 128 x 128 block scales (cuBLASLt's block-scaled
// FP8, kernels/cuda/gemm_fp8_block.h), MXFP4 experts as MXFP4. The checkpoint's bytes go straight from the
// safetensors files to their place in GPU memory through the weight streamer (gpu/weight_stream.h: a bounded pinned
// ring on several threads), or are made there (--load-format dummy, kernels/cuda/dummy_weights.h); only small tensors
// that change form (norms and gates to fp32, the DSA indexer's projections to fp32, MLA's kv_b to bf16) pass through
// host memory, one tensor at a time.
#pragma once
#include <cuda_runtime_api.h>

#include <chrono>
#include <cstdio>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "gpu/device_arena.h"
#include "gpu/dsa_indexer.h"
#include "gpu/weight_stream.h"
#include "kernels/cuda/gemm_fp8_block.h"
#include "kernels/cuda/mla_glue.h"
#include "kernels/cuda/moe.h"
#include "model/backend.h"
#include "model/model.h"

namespace kestrel::gpu {

// A linear weight [out, in] on the GPU: row blocks, each bf16 or FP8 block-scaled. A plain weight, or a stack whose
// parts share a form (FP8 parts whose rows, but the last's, are whole 128-row blocks), is one part; otherwise one part
// per stacked weight, each product writing its columns of the output.
struct DLinear {
  int64_t out = 0, in = 0;
  struct Part {
    int64_t row0 = 0, rows = 0;
    const uint16_t* bf16 = nullptr;             // [rows, in]
    std::optional<cuda::Fp8BlockWeight> fp8;    // cuda::fp8_block_weight_layout(rows, in)
  };
  std::vector<Part> parts;
};

struct DKda {
  const float* conv_qkv = nullptr;  // [3P, W]: the taps of q, k and v stacked
  const float *A_log = nullptr, *dt_bias = nullptr, *o_norm = nullptr;
};

struct DMla {
  const uint16_t* kv_b = nullptr;  // bf16 [H * (dn + dv), C]
  float kv_scale = 1.0f;
  std::unique_ptr<DsaIndexerGpu> indexer;  // with DSA
};

struct DMoe {
  const float* router = nullptr;  // fp32 [E, D]
  const float* bias = nullptr;    // fp32 [E] or null
  cuda::MoeRoutingParams routing;
  cuda::MoeExpertWeights experts;
};

// Bytes of weights on the GPU by the form they are kept in.
struct WeightBytes {
  size_t bf16 = 0, fp8 = 0, mxfp4 = 0, fp32 = 0;
  size_t total() const { return bf16 + fp8 + mxfp4 + fp32; }
};

// Every weight of a model on the GPU, by the handle index the backend gave out.
struct DeviceWeights {
  std::vector<const uint16_t*> embeddings;  // bf16 [V, D]
  std::vector<DLinear> linears;
  std::vector<const float*> vectors;
  std::vector<DMla> mla;
  std::vector<DKda> kda;
  std::vector<DMoe> moe;
  const float* rope_inv_freq = nullptr;  // [R / 2] with RoPE (deepseek_v32): the CPU's table
  WeightBytes bytes;
  size_t rounded = 0;  // weights whose bf16 form rounds their value (FP8 kv_b with scales that are not powers of two)
};

// Puts stored tensors into the arena in the forms above; copies of checkpoint bytes and dummy fills run
// asynchronously until finish().
class WeightUploader {
 public:
  WeightUploader(DeviceArena& arena, WeightBytes& bytes, std::FILE* log);
  ~WeightUploader();

  // The stored bytes of t (checkpoint bytes, or the dummy fill) into device memory at dst (nbytes of them).
  void raw(const StoredTensor& t, void* dst);
  // fp32 values of t (any float dtype, or FP8 codes as values) in a new device array.
  const float* f32(const StoredTensor& t, const char* what);
  // A linear weight as bf16 [out, in]: a copy of bf16 bytes, or (any other stored form) its values decoded on the host
  // and rounded; `rounded` counts the values that rounding changed.
  const uint16_t* bf16(const StoredLinear& l, const char* what, size_t& rounded);
  // Stacked parts in their stored forms (see DLinear).
  DLinear linear(std::span<const StoredLinear> parts, const char* what);
  // The host bytes of t (checkpoint or dummy), for tensors that change form.
  std::vector<uint8_t> host_bytes(const StoredTensor& t);
  // A linear weight's values, decoded exactly on the host (FP8: code * block scale; MXFP4: e2m1 * 2^(e - 127)).
  std::vector<float> decoded(const StoredLinear& l);
  template <typename T>
  T* take(size_t n, const char* what, size_t WeightBytes::*kind) {
    bytes_.*kind += n * sizeof(T);
    return arena_.take_n<T>(n, what);
  }
  // Waits for every copy and fill (Error naming a tensor that failed).
  void finish();
  cudaStream_t stream() const { return stream_; }

 private:
  DeviceArena& arena_;
  WeightBytes& bytes_;
  std::unique_ptr<WeightStreamer> streamer_;
  cudaStream_t stream_ = nullptr;  // dummy fills
  std::FILE* log_ = nullptr;
  // --load-format dummy: the tensors made on the device (the streamer's summary counts what it read) and since when.
  int64_t dummy_tensors_ = 0;
  size_t dummy_bytes_ = 0;
  std::chrono::steady_clock::time_point start_ = std::chrono::steady_clock::now();
};

}  // namespace kestrel::gpu
