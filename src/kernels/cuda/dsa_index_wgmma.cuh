// The int8 warpgroup MMA (wgmma, sm_90a) of the exact indexer-score kernel (dsa_index_wgmma.cu), next to the bf16
// forms and the fences of mla_decode_wgmma.cuh, which it reuses. PTX ISA "Asynchronous Warpgroup Level Matrix
// Multiply-Accumulate".
//
// Operand layout without swizzle ("interleave"): a core matrix is 8 rows of 16 bytes stored as 128 contiguous bytes
// (row r at byte 16 r). For a K-major s8 operand of N rows and 32 k values (one k32 step), the core matrices are
// (row group n8, k half c), rows 8 n8 .. 8 n8 + 7 and k 16 c .. 16 c + 15; the descriptor gives the byte distance
// between k-adjacent core matrices (lbo) and between row-adjacent ones (sbo).
//
// Fragments of m64nNk32 with s8 operands (w = warp within the warpgroup, g = lane / 4, t = lane % 4):
// A from registers, four 32-bit registers of four bytes each, like mma.sync m16n8k32's A over the warp's rows
// 16 w .. 16 w + 15: a[0] = row g, k 4t .. 4t+3; a[1] = row g + 8, same k; a[2] = row g, k 16+4t ..; a[3] = row g + 8,
// k 16+4t ... Accumulator (s32, N/2 registers): register 4i + e holds row 16w + g + 8 (e / 2), column
// 8i + 2t + (e % 2).
#pragma once
#include <cstdint>

#include "kernels/cuda/mla_decode_wgmma.cuh"

namespace kestrel::cuda::dsa {

using mla::fence_proxy_async_smem;
using mla::wgmma_commit;
using mla::wgmma_fence;
using mla::wgmma_wait;

// Descriptor of an operand without swizzle at `smem` (generic pointer into shared memory, 16-byte aligned): lbo =
// bytes between k-adjacent core matrices, sbo = bytes between row-adjacent (M or N) core matrices. Layout type 0
// (bits 62-63), base offset 0.
__device__ __forceinline__ uint64_t smem_desc_interleave(const void* smem, uint32_t lbo_bytes, uint32_t sbo_bytes) {
  const uint32_t addr = static_cast<uint32_t>(__cvta_generic_to_shared(smem));
  return static_cast<uint64_t>((addr & 0x3FFFFu) >> 4) | static_cast<uint64_t>((lbo_bytes >> 4) & 0x3FFFu) << 16 |
         static_cast<uint64_t>((sbo_bytes >> 4) & 0x3FFFu) << 32;
}

// Pins a register that a wgmma writes asynchronously: the compiler may not move its uses across this point (after
// wgmma_wait) nor its definitions (before the wgmma).
__device__ __forceinline__ void wgmma_fence_operand(int32_t& r) { asm volatile("" : "+r"(r)::"memory"); }

// d (64 x 32 s32) = (scale_d ? d : 0) + A B, A = 64 x 32 s8 from registers (fragment above), B = 32 x 32 s8, K-major
// (descriptor). Exact: int32 accumulation without saturation.
__device__ __forceinline__ void wgmma_m64n32k32_s8_rs(int32_t (&d)[16], const uint32_t (&a)[4], uint64_t desc_b,
                                                      int scale_d) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %21, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n32k32.s32.s8.s8 "
      "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15}, {%16, %17, %18, %19}, %20, p;\n}\n"
      : "+r"(d[0]), "+r"(d[1]), "+r"(d[2]), "+r"(d[3]), "+r"(d[4]), "+r"(d[5]), "+r"(d[6]), "+r"(d[7]), "+r"(d[8]),
        "+r"(d[9]), "+r"(d[10]), "+r"(d[11]), "+r"(d[12]), "+r"(d[13]), "+r"(d[14]), "+r"(d[15])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b), "r"(scale_d));
}

}  // namespace kestrel::cuda::dsa
