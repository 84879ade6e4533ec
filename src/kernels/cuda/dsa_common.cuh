// Shared pieces of the DSA kernels (dsa_*.cu): argument checks, page addressing and the warp-level tensor-core
// instructions they use.
#pragma once
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <mutex>
#include <string>
#include <unordered_map>

#include "kernels/cuda/dsa.h"
#include "kernels/cuda/runtime.h"

namespace kestrel::cuda::dsa {

// Argument checks of the host entry points. kestrel::fail cannot be used here (nvcc rejects fmt's consteval
// format strings), so a failed check goes through cuda::check, which throws kestrel::Error with `what` in it.
inline void require(bool ok, const std::string& what) {
  if (!ok) check(cudaErrorInvalidValue, what.c_str());
}

inline void check_pages(const Pages& p, const char* fn) {
  require(p.base != nullptr && p.page_stride > 0 && p.page_stride % 16 == 0 && p.page_size > 0 &&
              (p.page_size & (p.page_size - 1)) == 0,
          std::string(fn) + ": pages need a base, a positive page stride that is a multiple of 16 bytes (rows are " +
              "read in 16-byte pieces) and a power-of-two page size, got stride " + std::to_string(p.page_stride) +
              ", size " + std::to_string(p.page_size));
}

// A value computed once per device (host side: launch plans read occupancy and attributes, which are too slow to
// query on every decode step).
class DeviceCache {
 public:
  template <typename F>
  int get(F compute) {
    int device = 0;
    check(cudaGetDevice(&device), "cudaGetDevice");
    std::lock_guard<std::mutex> lock(mutex_);
    const auto it = values_.find(device);
    if (it != values_.end()) return it->second;
    const int value = compute();
    values_.emplace(device, value);
    return value;
  }

 private:
  std::mutex mutex_;
  std::unordered_map<int, int> values_;
};

inline int device_sm_count() {
  static DeviceCache cache;
  return cache.get([] {
    int device = 0, sms = 0;
    check(cudaGetDevice(&device), "cudaGetDevice");
    check(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device), "cudaDeviceGetAttribute");
    return sms;
  });
}

// Whether the current device is compute capability 9.0 exactly: sm_90a machine code (the wgmma kernels) runs there
// only.
inline bool device_is_sm90() {
  static DeviceCache cache;
  return cache.get([] {
           int device = 0, major = 0, minor = 0;
           check(cudaGetDevice(&device), "cudaGetDevice");
           check(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device), "cudaDeviceGetAttribute");
           check(cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, device), "cudaDeviceGetAttribute");
           return major == 9 && minor == 0 ? 1 : 0;
         }) != 0;
}

// The arguments of the index-score kernels (dsa_index.cu, dsa_index_wgmma.cu, dsa_index_fp8_wgmma.cu):
// index_scores_decode's, flattened.
struct ScoreParams {
  const uint8_t* q;
  const float* w;
  int n_q;
  int heads;
  Pages pages;
  BlockTable bt;
  const int32_t* ctx_lens;
  int max_ctx;
  float* scores;
  int64_t stride;
  int tiles_per_split;  // key tiles of one CTA (its kernel's tile: 64 or 32 keys, 32 per warp tile in fast_fp8)
};

// Lets a score kernel use `smem` bytes of dynamic shared memory (all of the multiprocessor's shared memory carve-out)
// and returns how many of its CTAs are resident per multiprocessor (call once per device, through a DeviceCache).
inline int prepare_kernel(void (*kernel)(ScoreParams), int threads, size_t smem, const char* name) {
  check(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(smem)), name);
  check(cudaFuncSetAttribute(kernel, cudaFuncAttributePreferredSharedMemoryCarveout, 100), name);
  int per_sm = 0;
  check(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, threads, smem), name);
  require(per_sm > 0, std::string(name) + " does not fit on a multiprocessor");
  return per_sm;
}

// The score kernels' grid: one wave of CTAs over (key range, request, row group), each CTA a contiguous range of
// key tiles. Sets p.tiles_per_split; at most max_splits ranges per (request, row group).
inline dim3 one_wave_grid(ScoreParams& p, int batch, int groups, int tiles, int max_splits, int per_sm) {
  const int splits = std::clamp(per_sm * device_sm_count() / (batch * groups), 1, max_splits);
  p.tiles_per_split = (tiles + splits - 1) / splits;
  return dim3((tiles + p.tiles_per_split - 1) / p.tiles_per_split, batch, groups);
}

// The block-table index of position pos >= 0: page_size is a power of two (check_pages), so a shift instead of the
// signed division by a runtime value that `pos / page_size` compiles to (about 25 instructions, issued per key per
// tile in the score kernels' copy loops).
__device__ __forceinline__ int page_index(const Pages& pages, int pos) { return pos >> (__ffs(pages.page_size) - 1); }

// Address of the row of request `req` at `pos` inside its page (rows of `row_bytes` from the page start).
__device__ __forceinline__ const uint8_t* page_row(const Pages& pages, const BlockTable& bt, int req, int pos,
                                                   int row_bytes) {
  const int page = bt.pages[static_cast<int64_t>(req) * bt.stride + page_index(pages, pos)];
  return pages.base + static_cast<int64_t>(page) * pages.page_stride +
         static_cast<int64_t>(pos & (pages.page_size - 1)) * row_bytes;
}

// ---- tensor-core instructions (PTX ISA, warp-level mma.sync). Fragment layouts, with g = lane / 4 and
// t = lane % 4: A (16 x K, row major) rows g and g + 8; B (K x 8, column major) column g; C/D (16 x 8) rows g, g + 8
// and columns 2t, 2t + 1.

// D += A * B, s8 x s8 -> s32, m16n8k32. a[r]: 4 bytes of A (r = 0: row g, k 4t..4t+3; 1: row g+8; 2: row g,
// k 16+4t..; 3: row g+8, k 16+4t..); b[r]: 4 bytes of column g (r = 0: k 4t..4t+3; 1: k 16+4t..).
__device__ __forceinline__ void mma_s8(int32_t (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k32.row.col.s32.s8.s8.s32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
      : "+r"(d[0]), "+r"(d[1]), "+r"(d[2]), "+r"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// D += A * B, f16 x f16 -> f32, m16n8k16; fragments as mma_bf16 below. (On sm_90 an e4m3 mma.sync is not a
// tensor instruction of its own: ptxas expands it into these after converting both operands on every call.)
__device__ __forceinline__ void mma_f16(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// D += A * B, bf16 x bf16 -> f32, m16n8k16. a[r]: two bf16 (r = 0: row g, k 2t, 2t+1; 1: row g+8; 2: row g,
// k 8+2t..; 3: row g+8, k 8+2t..); b[r]: two bf16 of column g (r = 0: k 2t, 2t+1; 1: k 8+2t..).
__device__ __forceinline__ void mma_bf16(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// Four 8x8 b16 matrices from shared memory; lane l gives the row address of matrix l / 8, row l % 8.
__device__ __forceinline__ void ldmatrix_x4(uint32_t (&r)[4], const void* smem_row) {
  const uint32_t addr = static_cast<uint32_t>(__cvta_generic_to_shared(smem_row));
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr));
}

__device__ __forceinline__ void ldmatrix_x4_trans(uint32_t (&r)[4], const void* smem_row) {
  const uint32_t addr = static_cast<uint32_t>(__cvta_generic_to_shared(smem_row));
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr));
}

// 16-byte asynchronous copy global -> shared; with src_bytes = 0 the destination is zero-filled and nothing is read.
__device__ __forceinline__ void cp_async_16(void* smem, const void* gmem, int src_bytes) {
  const uint32_t addr = static_cast<uint32_t>(__cvta_generic_to_shared(smem));
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(addr), "l"(gmem), "r"(src_bytes));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n"); }
template <int N>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N));
}

// Merges `splits` partial attention outputs of each of `rows` rows ([rows, splits, 512] normalised outputs and
// [rows, splits] lse) into out [rows, 512] and lse [rows], in split order; empty splits (lse = -inf) weigh 0 and a row
// whose splits are all empty gives 0 and -inf. Shared by the sparse (dsa_mla.cu) and dense (mla_decode.cu) decodes.
void launch_split_combine(const float* part_o, const float* part_lse, int splits, int64_t rows, float* out,
                          float* lse, cudaStream_t stream, const char* what);

// ---- FP8 -> bf16 conversions of the sparse MLA kernels (dsa_mla.cu, dsa_mla_wgmma.cu).

__device__ __forceinline__ uint32_t e4m3x2_to_bf16x2(uint16_t two) {
  const __half2_raw h = __nv_cvt_fp8x2_to_halfraw2(two, __NV_E4M3);
  const float2 f = __half22float2(__half2(h));
  const __nv_bfloat162 b = __float22bfloat162_rn(f);
  return *reinterpret_cast<const uint32_t*>(&b);
}

__device__ __forceinline__ uint32_t pack_bf16(float lo, float hi) {
  const __nv_bfloat162 b = __floats2bfloat162_rn(lo, hi);
  return *reinterpret_cast<const uint32_t*>(&b);
}

// Two e4m3 codes times a tile scale: fp32(code * scale) each, as dequantize_fp8, then rounded to bf16 (exact when
// the product has at most 8 significant bits, as for a power-of-two scale).
__device__ __forceinline__ uint32_t e4m3x2_scaled_to_bf16x2(uint16_t two, float scale) {
  const __half2_raw h = __nv_cvt_fp8x2_to_halfraw2(two, __NV_E4M3);
  const float2 f = __half22float2(__half2(h));
  return pack_bf16(__fmul_rn(f.x, scale), __fmul_rn(f.y, scale));
}

// True when any of the four bytes is an e4m3 NaN code (0x7F or 0xFF).
__device__ __forceinline__ bool has_e4m3_nan(uint32_t w) {
  // With the signs cleared every byte is <= 0x7F, so adding 1 never carries into the next byte and sets a byte's top
  // bit exactly when the byte was 0x7F.
  return (((w & 0x7F7F7F7Fu) + 0x01010101u) & 0x80808080u) != 0;
}

}  // namespace kestrel::cuda::dsa
