#include "kernels/cuda/moe.h"

#include <algorithm>
#include <climits>
#include <cmath>

#include "core/error.h"
#include "kernels/cuda/runtime.h"

namespace kestrel::cuda {

namespace {

bool aligned16(const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; }

size_t align256(size_t n) { return (n + 255) / 256 * 256; }

// Byte offsets of the workspace regions of one moe_experts call; each region starts on a 256-byte boundary. The
// FP8 regions (x_codes .. h_scales) are empty for the other dtypes, and h is fp32 for FP8 experts.
struct ExpertsLayout {
  int rows_per_tile;
  int64_t max_tiles;
  size_t chunk_base, expert_offset, tile_start, tiles, sorted_pair, h, pair_out, x_codes, x_scales, h_codes, h_scales,
      total;
};

void check_expert_shapes(const char* fn, int64_t T, int top_k, int n_experts, int64_t D, int64_t F, ExpertDtype dtype) {
  KESTREL_CHECK(T >= 0, "{}: T must be non-negative, got {}", fn, T);
  KESTREL_CHECK(top_k >= 1, "{}: top_k must be positive, got {}", fn, top_k);
  KESTREL_CHECK(n_experts >= 1, "{}: n_experts must be positive, got {}", fn, n_experts);
  KESTREL_CHECK(D > 0 && D % 32 == 0 && F > 0 && F % 32 == 0,
                "{}: D and F must be positive multiples of 32, got D={} F={}", fn, D, F);
  KESTREL_CHECK(dtype != ExpertDtype::fp8_block || (D % 128 == 0 && F % 128 == 0),
                "{}: FP8 block-scaled experts need D and F multiples of 128 (the scale blocks), got D={} F={}", fn, D,
                F);
  KESTREL_CHECK(T <= INT_MAX / top_k, "{}: T * top_k = {} * {} does not fit in int32", fn, T, top_k);
  KESTREL_CHECK(F / 32 <= 65535 && (D + 63) / 64 <= 65535, "{}: D={} F={} exceed the GEMM grid", fn, D, F);
}

ExpertsLayout experts_layout(int64_t T, int top_k, int n_experts, int64_t D, int64_t F, ExpertDtype dtype) {
  const int64_t P = T * top_k;
  const int64_t n_chunks = (P + detail::kMoeSortChunk - 1) / detail::kMoeSortChunk;
  const bool fp8 = dtype == ExpertDtype::fp8_block;
  ExpertsLayout l{};
  l.rows_per_tile = detail::moe_rows_per_tile(T);
  // Each non-empty expert has at most one partial tile: sum ceil(c_e / R) <= ceil(P / R) + min(E, P).
  l.max_tiles = (P + l.rows_per_tile - 1) / l.rows_per_tile + std::min<int64_t>(n_experts, P);
  size_t at = 0;
  auto region = [&](size_t bytes) {
    const size_t start = at;
    at += align256(bytes);
    return start;
  };
  l.chunk_base = region(static_cast<size_t>(n_chunks) * n_experts * sizeof(int32_t));
  l.expert_offset = region((static_cast<size_t>(n_experts) + 1) * sizeof(int32_t));
  l.tile_start = region((static_cast<size_t>(n_experts) + 1) * sizeof(int32_t));
  l.tiles = region(static_cast<size_t>(l.max_tiles) * 2 * sizeof(int32_t));
  l.sorted_pair = region(static_cast<size_t>(P) * sizeof(int32_t));
  l.h = region(static_cast<size_t>(P) * F * (fp8 ? sizeof(float) : sizeof(uint16_t)));
  l.pair_out = region(static_cast<size_t>(P) * D * sizeof(float));
  l.x_codes = region(fp8 ? static_cast<size_t>(T) * D : 0);
  l.x_scales = region(fp8 ? static_cast<size_t>(T) * (D / 128) * sizeof(float) : 0);
  l.h_codes = region(fp8 ? static_cast<size_t>(P) * F : 0);
  l.h_scales = region(fp8 ? static_cast<size_t>(P) * (F / 128) * sizeof(float) : 0);
  l.total = at;
  return l;
}

void check_expert_weights(const char* fn, const MoeExpertWeights& w) {
  switch (w.dtype) {
    case ExpertDtype::bf16:
      KESTREL_CHECK(w.w13 && w.w2, "{}: bf16 experts need w13 and w2", fn);
      KESTREL_CHECK(aligned16(w.w13) && aligned16(w.w2), "{}: w13 and w2 must be 16-byte aligned", fn);
      break;
    case ExpertDtype::mxfp4:
      KESTREL_CHECK(w.w13_packed && w.w13_scales && w.w2_packed && w.w2_scales,
                    "{}: mxfp4 experts need w13_packed, w13_scales, w2_packed and w2_scales", fn);
      KESTREL_CHECK(aligned16(w.w13_packed) && aligned16(w.w2_packed),
                    "{}: w13_packed and w2_packed must be 16-byte aligned", fn);
      break;
    case ExpertDtype::fp8_block:
      KESTREL_CHECK(w.fp8_w13 && w.fp8_w13_scales && w.fp8_w2 && w.fp8_w2_scales,
                    "{}: fp8_block experts need fp8_w13, fp8_w13_scales, fp8_w2 and fp8_w2_scales", fn);
      KESTREL_CHECK(aligned16(w.fp8_w13) && aligned16(w.fp8_w2), "{}: fp8_w13 and fp8_w2 must be 16-byte aligned",
                    fn);
      break;
  }
}

// Checks a moe_experts call and fills the arguments every dtype shares (x left to the caller).
detail::MoeExpertArgs expert_args(const char* fn, const void* x, int64_t T, const int32_t* ids, const float* weights,
                                  int top_k, const MoeExpertWeights& w, float* y, void* workspace,
                                  size_t workspace_bytes) {
  check_expert_shapes(fn, T, top_k, w.n_experts, w.D, w.F, w.dtype);
  check_expert_weights(fn, w);
  detail::MoeExpertArgs args{};
  if (T == 0) return args;
  KESTREL_CHECK(x && ids && weights && y, "{}: x, ids, weights and y must be set", fn);
  KESTREL_CHECK(aligned16(x) && aligned16(y), "{}: x and y must be 16-byte aligned", fn);
  const ExpertsLayout l = experts_layout(T, top_k, w.n_experts, w.D, w.F, w.dtype);
  KESTREL_CHECK(workspace && workspace_bytes >= l.total, "{}: workspace of {} bytes, need {}", fn, workspace_bytes,
                l.total);
  KESTREL_CHECK(aligned16(workspace), "{}: workspace must be 16-byte aligned", fn);
  KESTREL_CHECK(l.max_tiles <= INT_MAX, "{}: {} row tiles exceed the GEMM grid", fn, l.max_tiles);

  auto* base = static_cast<char*>(workspace);
  args.T = T;
  args.ids = ids;
  args.weights = weights;
  args.top_k = top_k;
  args.w = w;
  args.y = y;
  args.rows_per_tile = l.rows_per_tile;
  args.max_tiles = l.max_tiles;
  args.chunk_base = reinterpret_cast<int32_t*>(base + l.chunk_base);
  args.expert_offset = reinterpret_cast<int32_t*>(base + l.expert_offset);
  args.tile_start = reinterpret_cast<int32_t*>(base + l.tile_start);
  args.tiles = reinterpret_cast<int32_t*>(base + l.tiles);
  args.sorted_pair = reinterpret_cast<int32_t*>(base + l.sorted_pair);
  args.pair_out = reinterpret_cast<float*>(base + l.pair_out);
  if (w.dtype == ExpertDtype::fp8_block) {
    args.h_f32 = reinterpret_cast<float*>(base + l.h);
    args.x_codes = reinterpret_cast<uint8_t*>(base + l.x_codes);
    args.x_scales = reinterpret_cast<float*>(base + l.x_scales);
    args.h_codes = reinterpret_cast<uint8_t*>(base + l.h_codes);
    args.h_scales = reinterpret_cast<float*>(base + l.h_scales);
  } else {
    args.h = reinterpret_cast<uint16_t*>(base + l.h);
  }
  return args;
}

}  // namespace

namespace detail {

int moe_rows_per_tile(int64_t T) { return T <= 16 ? 16 : T <= 32 ? 32 : T <= 48 ? 48 : 64; }

}  // namespace detail

void moe_route(const float* logits, const float* bias, int64_t T, const MoeRoutingParams& p, int32_t* ids,
               float* weights, cudaStream_t s) {
  const int E = p.n_experts;
  KESTREL_CHECK(T >= 0 && T <= INT_MAX, "moe_route: T = {} is out of range", T);
  KESTREL_CHECK(E >= 1 && E <= kMoeMaxRoutedExperts, "moe_route: n_experts must be in [1, {}], got {}",
                kMoeMaxRoutedExperts, E);
  KESTREL_CHECK(p.top_k >= 1 && p.top_k <= E, "moe_route: top_k must be in [1, n_experts = {}], got {}", E, p.top_k);
  KESTREL_CHECK(p.n_group >= 1 && E % p.n_group == 0, "moe_route: n_group = {} must divide n_experts = {}", p.n_group,
                E);
  KESTREL_CHECK(p.topk_group >= 1 && p.topk_group <= p.n_group,
                "moe_route: topk_group must be in [1, n_group = {}], got {}", p.n_group, p.topk_group);
  KESTREL_CHECK(static_cast<int64_t>(p.topk_group) * (E / p.n_group) >= p.top_k,
                "moe_route: {} groups of {} experts leave fewer than top_k = {} candidates", p.topk_group,
                E / p.n_group, p.top_k);
  KESTREL_CHECK(std::isfinite(p.scaling), "moe_route: scaling must be finite, got {}", p.scaling);
  if (T == 0) return;
  KESTREL_CHECK(logits && ids && weights, "moe_route: logits, ids and weights must be set");
  const detail::MoeRouteArgs args{logits,    bias,      T,           E, p.top_k, p.n_group, p.topk_group,
                                  p.renormalize, p.scaling, ids, weights};
  KESTREL_CUDA_CHECK(detail::launch_moe_route(args, s));
}

size_t moe_workspace_bytes(int64_t T, int top_k, int n_experts, int64_t D, int64_t F, ExpertDtype dtype) {
  check_expert_shapes("moe_workspace_bytes", T, top_k, n_experts, D, F, dtype);
  return experts_layout(T, top_k, n_experts, D, F, dtype).total;
}

void moe_experts(const uint16_t* x, int64_t T, const int32_t* ids, const float* weights, int top_k,
                 const MoeExpertWeights& w, float* y, void* workspace, size_t workspace_bytes, cudaStream_t s) {
  KESTREL_CHECK(w.dtype != ExpertDtype::fp8_block,
                "moe_experts: fp8_block experts take fp32 activations (the float* form of moe_experts)");
  detail::MoeExpertArgs args = expert_args("moe_experts", x, T, ids, weights, top_k, w, y, workspace, workspace_bytes);
  if (T == 0) return;
  args.x = x;
  KESTREL_CUDA_CHECK(detail::launch_moe_experts(args, s));
}

void moe_experts(const float* x, int64_t T, const int32_t* ids, const float* weights, int top_k,
                 const MoeExpertWeights& w, float* y, void* workspace, size_t workspace_bytes, cudaStream_t s) {
  KESTREL_CHECK(w.dtype == ExpertDtype::fp8_block,
                "moe_experts: fp32 activations are for fp8_block experts; bf16 and mxfp4 experts take bf16 x");
  detail::MoeExpertArgs args = expert_args("moe_experts", x, T, ids, weights, top_k, w, y, workspace, workspace_bytes);
  if (T == 0) return;
  args.x_f32 = x;
  KESTREL_CUDA_CHECK(detail::launch_moe_experts(args, s));
}

namespace detail {

MoeFp8Intermediates moe_fp8_intermediates(const void* workspace, int64_t T, int top_k, int n_experts, int64_t D,
                                          int64_t F) {
  check_expert_shapes("moe_fp8_intermediates", T, top_k, n_experts, D, F, ExpertDtype::fp8_block);
  const ExpertsLayout l = experts_layout(T, top_k, n_experts, D, F, ExpertDtype::fp8_block);
  const auto* base = static_cast<const char*>(workspace);
  return MoeFp8Intermediates{reinterpret_cast<const int32_t*>(base + l.expert_offset),
                             reinterpret_cast<const int32_t*>(base + l.sorted_pair),
                             reinterpret_cast<const float*>(base + l.h),
                             reinterpret_cast<const uint8_t*>(base + l.h_codes),
                             reinterpret_cast<const float*>(base + l.h_scales)};
}

}  // namespace detail

}  // namespace kestrel::cuda
