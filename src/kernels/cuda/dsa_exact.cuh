// The exact-score pieces shared by the two IndexScoreMode::exact kernels (dsa_index.cu: mma.sync, exact_mma;
// dsa_index_wgmma.cu: wgmma, exact on Hopper): the e4m3 code -> limb table, the single-rounding combine of the limb
// accumulators (the file comment of dsa_index.cu derives it) and the in-order head sum.
#pragma once
#include <cuda_runtime.h>

#include <cstdint>

namespace kestrel::cuda::dsa {

// The three signed 7-bit limbs of an e4m3 code's value * 512, as bytes 0..2 (NaN codes give 0).
__device__ inline uint32_t limb_entry(int code) {
  const int mag = code & 0x7F;
  if (mag == 0x7F) return 0;  // NaN: its scores are set to NaN through the flags
  const int e = mag >> 3, m = mag & 7;
  const int u = e ? (8 + m) << (e - 1) : m;
  int l0 = u & 127, l1 = (u >> 7) & 127, l2 = u >> 14;
  if (code & 0x80) {
    l0 = -l0;
    l1 = -l1;
    l2 = -l2;
  }
  return static_cast<uint32_t>(static_cast<uint8_t>(l0)) | static_cast<uint32_t>(static_cast<uint8_t>(l1)) << 8 |
         static_cast<uint32_t>(static_cast<uint8_t>(l2)) << 16;
}

// Four e4m3 codes -> the same four positions of limb 0, 1 and 2.
__device__ __forceinline__ void to_limbs(const uint32_t* lut, uint32_t w, uint32_t& l0, uint32_t& l1,
                                         uint32_t& l2) {
  const uint32_t x0 = lut[w & 0xFF], x1 = lut[(w >> 8) & 0xFF], x2 = lut[(w >> 16) & 0xFF], x3 = lut[w >> 24];
  const uint32_t t01 = __byte_perm(x0, x1, 0x5140), t23 = __byte_perm(x2, x3, 0x5140);
  l0 = __byte_perm(t01, t23, 0x5410);
  l1 = __byte_perm(t01, t23, 0x7632);
  l2 = __byte_perm(__byte_perm(x0, x1, 0x0062), __byte_perm(x2, x3, 0x0062), 0x5410);
}

// The three limb planes of one 16-byte piece of codes (l[b]: limb b of the same 16 codes, in their order).
__device__ __forceinline__ void to_limbs(const uint32_t* lut, const uint4& v, uint4 (&l)[3]) {
  to_limbs(lut, v.x, l[0].x, l[1].x, l[2].x);
  to_limbs(lut, v.y, l[0].y, l[1].y, l[2].y);
  to_limbs(lut, v.z, l[0].z, l[1].z, l[2].z);
  to_limbs(lut, v.w, l[0].w, l[1].w, l[2].w);
}

// x as fp32, exactly, for |x| < 2^22: 1.5 * 2^23 + x has unit spacing there.
__device__ __forceinline__ float small_int_to_float(int32_t x) {
  return __fsub_rn(__int_as_float(0x4B400000 + x), 12582912.0f);
}

// fp32(S) * 2^-18 for the exact dot S = sum_i 2^(7i) acc[i] (see the file comment).
__device__ __forceinline__ float exact_dot(int32_t a0, int32_t a1, int32_t a2, int32_t a3, int32_t a4) {
  const int32_t mid = a1 + a2 * 128, hi = a3 + a4 * 128;
  const int32_t high = hi + (mid >> 14), low = a0 + (mid & 0x3FFF) * 128;
  return __fadd_rn(__fmul_rn(small_int_to_float(high), 8.0f), __fmul_rn(small_int_to_float(low), 0x1p-18f));
}

__device__ __forceinline__ void cp_async_4(void* smem, const void* gmem, int src_bytes) {
  const uint32_t addr = static_cast<uint32_t>(__cvta_generic_to_shared(smem));
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;\n" ::"r"(addr), "l"(gmem), "r"(src_bytes));
}

// The in-order head sums of one tile: thread (token tl, key) of the group adds its H terms j = 0..H-1.
template <int H>
__device__ __forceinline__ float ordered_head_sum(const float* terms) {
  float acc = 0.0f;
#pragma unroll
  for (int j = 0; j < H; j += 4) {
    const float4 v = *reinterpret_cast<const float4*>(terms + j);
    acc = __fadd_rn(acc, v.x);
    acc = __fadd_rn(acc, v.y);
    acc = __fadd_rn(acc, v.z);
    acc = __fadd_rn(acc, v.w);
  }
  return acc;
}


}  // namespace kestrel::cuda::dsa
