// Hopper warpgroup matrix instructions (wgmma, sm_90a) and their shared-memory operand descriptors, as the MLA
// decode kernel (mla_decode.cu) uses them. PTX ISA "Asynchronous Warpgroup Level Matrix Multiply-Accumulate".
//
// Operand layout in shared memory: the 128-byte swizzle. A region of rows of 128 bytes (64 16-bit values) whose
// base is 1024-byte aligned stores 16-byte chunk c of row r at chunk c ^ (r % 8) of that row. One such region per
// 64 columns; a K-major operand (rows = M or N, 128 bytes of K each) and an MN-major one (rows = K, 128 bytes of
// M or N each) use the same physical arrangement, so one tile of latent rows [key][dim] serves as the K-major B of
// Q K^T and as the MN-major B of P V.
//
// Accumulator fragment of m64nNk16 (fp32, N/2 registers per thread; w = warp within the warpgroup, g = lane / 4,
// t = lane % 4): register 4i + e holds row 16w + g + 8 (e / 2), column 8i + 2t + (e % 2). The A fragment from
// registers (16-bit types, four 32-bit registers) holds, low half first: {row g, cols 2t, 2t+1}, {row g+8, same},
// {row g, cols 8+2t, 9+2t}, {row g+8, same} of the warp's 16 rows: the accumulator layout of two adjacent n8 blocks.
#pragma once
#include <cstdint>

namespace kestrel::cuda::mla {

// Descriptor of a 128-byte-swizzled operand at `smem` (generic pointer into shared memory, 16-byte aligned; the
// region's swizzle atoms 1024-byte aligned). K-major: sbo = bytes from one group of 8 rows to the next, lbo unused
// (16). MN-major: lbo = bytes from one 64-column block to the next, sbo = bytes from one group of 8 K rows to the
// next. Layout type 1 (bits 62-63) is the 128-byte swizzle; base offset 0.
__device__ __forceinline__ uint64_t smem_desc_sw128(const void* smem, uint32_t lbo_bytes, uint32_t sbo_bytes) {
  const uint32_t addr = static_cast<uint32_t>(__cvta_generic_to_shared(smem));
  return static_cast<uint64_t>((addr & 0x3FFFFu) >> 4) | static_cast<uint64_t>((lbo_bytes >> 4) & 0x3FFFu) << 16 |
         static_cast<uint64_t>((sbo_bytes >> 4) & 0x3FFFu) << 32 | uint64_t{1} << 62;
}

// Orders this thread's register accesses before the next wgmma (needed before the first wgmma of a batch and
// whenever the accumulators or A registers were written by other instructions).
__device__ __forceinline__ void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void wgmma_commit() { asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory"); }
// Waits until at most N committed wgmma groups of this warpgroup are pending.
template <int N>
__device__ __forceinline__ void wgmma_wait() {
  asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(N) : "memory");
}
// Makes this thread's ordinary shared-memory writes visible to later wgmma reads (the async proxy); a barrier
// between the writers and the wgmma issue is still needed.
__device__ __forceinline__ void fence_proxy_async_smem() {
  asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
}

#define KESTREL_MLA_D16 \
    "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), \
    "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15])
#define KESTREL_MLA_R16 \
    "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15"
#define KESTREL_MLA_D128 \
    "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), \
    "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), \
    "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), \
    "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), \
    "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), \
    "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), \
    "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), \
    "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63]), \
    "+f"(d[64]), "+f"(d[65]), "+f"(d[66]), "+f"(d[67]), "+f"(d[68]), "+f"(d[69]), "+f"(d[70]), "+f"(d[71]), \
    "+f"(d[72]), "+f"(d[73]), "+f"(d[74]), "+f"(d[75]), "+f"(d[76]), "+f"(d[77]), "+f"(d[78]), "+f"(d[79]), \
    "+f"(d[80]), "+f"(d[81]), "+f"(d[82]), "+f"(d[83]), "+f"(d[84]), "+f"(d[85]), "+f"(d[86]), "+f"(d[87]), \
    "+f"(d[88]), "+f"(d[89]), "+f"(d[90]), "+f"(d[91]), "+f"(d[92]), "+f"(d[93]), "+f"(d[94]), "+f"(d[95]), \
    "+f"(d[96]), "+f"(d[97]), "+f"(d[98]), "+f"(d[99]), "+f"(d[100]), "+f"(d[101]), "+f"(d[102]), "+f"(d[103]), \
    "+f"(d[104]), "+f"(d[105]), "+f"(d[106]), "+f"(d[107]), "+f"(d[108]), "+f"(d[109]), "+f"(d[110]), "+f"(d[111]), \
    "+f"(d[112]), "+f"(d[113]), "+f"(d[114]), "+f"(d[115]), "+f"(d[116]), "+f"(d[117]), "+f"(d[118]), "+f"(d[119]), \
    "+f"(d[120]), "+f"(d[121]), "+f"(d[122]), "+f"(d[123]), "+f"(d[124]), "+f"(d[125]), "+f"(d[126]), "+f"(d[127])
#define KESTREL_MLA_R128 \
    "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, " \
    "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, " \
    "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, " \
    "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63, " \
    "%64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, %78, %79, " \
    "%80, %81, %82, %83, %84, %85, %86, %87, %88, %89, %90, %91, %92, %93, %94, %95, " \
    "%96, %97, %98, %99, %100, %101, %102, %103, %104, %105, %106, %107, %108, %109, %110, %111, " \
    "%112, %113, %114, %115, %116, %117, %118, %119, %120, %121, %122, %123, %124, %125, %126, %127"

// d (64 x 32 fp32) = (scale_d ? d : 0) + A B, A = 64 x 16 (K-major, descriptor), B = 32 x 16 (K-major, descriptor).
// kBf16: bf16 operands, else f16.
template <bool kBf16>
__device__ __forceinline__ void wgmma_m64n32k16_ss(float (&d)[16], uint64_t desc_a, uint64_t desc_b, int scale_d) {
  if constexpr (kBf16) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %18, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n32k16.f32.bf16.bf16 {" KESTREL_MLA_R16 "}, %16, %17, p, 1, 1, 0, 0;\n}\n"
        : KESTREL_MLA_D16
        : "l"(desc_a), "l"(desc_b), "r"(scale_d));
  } else {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %18, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n32k16.f32.f16.f16 {" KESTREL_MLA_R16 "}, %16, %17, p, 1, 1, 0, 0;\n}\n"
        : KESTREL_MLA_D16
        : "l"(desc_a), "l"(desc_b), "r"(scale_d));
  }
}

// d (64 x 256 fp32) += A B, A = 64 x 16 from registers (fragment above), B = 16 x 256 MN-major (descriptor,
// transposed: the rows in shared memory are K).
template <bool kBf16>
__device__ __forceinline__ void wgmma_m64n256k16_rs_mn(float (&d)[128], const uint32_t (&a)[4], uint64_t desc_b) {
  if constexpr (kBf16) {
    asm volatile(
        "{\nwgmma.mma_async.sync.aligned.m64n256k16.f32.bf16.bf16 {" KESTREL_MLA_R128 "}, "
        "{%128, %129, %130, %131}, %132, 1, 1, 1, 1;\n}\n"
        : KESTREL_MLA_D128
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b));
  } else {
    asm volatile(
        "{\nwgmma.mma_async.sync.aligned.m64n256k16.f32.f16.f16 {" KESTREL_MLA_R128 "}, "
        "{%128, %129, %130, %131}, %132, 1, 1, 1, 1;\n}\n"
        : KESTREL_MLA_D128
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b));
  }
}

// One online-softmax step over a 64 x 32 score tile held in the m64n32 accumulator layout (x: this thread's 16
// scores in the log2 domain, -inf where masked; mx: this thread's maxima of its two rows, before the quad
// reduction): the running maximum m_run is raised when the tile's exceeds it by more than `slack` (always from
// -inf to finite); l_run and the value accumulator o (m64n256 layout) are rescaled by the same factor; P against
// the running maximum goes to pa as the A fragments of the tile's two 16-column k-steps, rounded by
// pack(lo, hi) -> two 16-bit values; the normaliser sums the unrounded P.
template <typename Pack>
__device__ __forceinline__ void online_softmax_step(const float (&x)[16], float (&mx)[2], float (&m_run)[2],
                                                    float (&l_run)[2], uint32_t (&pa)[2][4], float (&o)[128],
                                                    float slack, Pack pack) {
  constexpr float kNegInf = -__builtin_huge_valf();
  float alpha[2], m_use[2];
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    mx[r] = fmaxf(mx[r], __shfl_xor_sync(0xFFFFFFFFu, mx[r], 1));
    mx[r] = fmaxf(mx[r], __shfl_xor_sync(0xFFFFFFFFu, mx[r], 2));
    alpha[r] = 1.0f;
    if (mx[r] > m_run[r] + slack) {
      alpha[r] = exp2f(m_run[r] - mx[r]);
      m_run[r] = mx[r];
    }
    // With no finite score yet every exponent is exp2(-inf) = 0, never exp2(-inf - -inf).
    m_use[r] = m_run[r] == kNegInf ? 0.0f : m_run[r];
    l_run[r] *= alpha[r];
  }
#pragma unroll
  for (int k = 0; k < 4; ++k) {
    float pr[4];
#pragma unroll
    for (int e = 0; e < 4; ++e) pr[e] = exp2f(x[4 * k + e] - m_use[e >> 1]);
    pa[k >> 1][(k & 1) * 2] = pack(pr[0], pr[1]);
    pa[k >> 1][(k & 1) * 2 + 1] = pack(pr[2], pr[3]);
    l_run[0] += pr[0] + pr[1];
    l_run[1] += pr[2] + pr[3];
  }
  if (alpha[0] != 1.0f || alpha[1] != 1.0f) {
#pragma unroll
    for (int n = 0; n < 32; ++n) {
      o[4 * n] *= alpha[0];
      o[4 * n + 1] *= alpha[0];
      o[4 * n + 2] *= alpha[1];
      o[4 * n + 3] *= alpha[1];
    }
  }
}

#undef KESTREL_MLA_D16
#undef KESTREL_MLA_R16
#undef KESTREL_MLA_D128
#undef KESTREL_MLA_R128

}  // namespace kestrel::cuda::mla
