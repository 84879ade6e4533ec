#include "kernels/cuda/dsa_generic.h"

#include <climits>
#include <cmath>
#include <cstdint>

#include "core/error.h"
#include "kernels/cuda/runtime.h"

namespace kestrel::cuda {

namespace {

// The generic scores put the requests on the grid's y dimension and groups of query tokens on its z dimension.
constexpr int kMaxGridY = 65535;
constexpr int kMaxGridZ = 65535;
constexpr int64_t kMaxVectors = int64_t{INT_MAX} * 8;  // the prep kernels: 8 vectors per CTA on the grid's x

bool power_of_two(int64_t n) { return n > 0 && (n & (n - 1)) == 0; }

// fp32(n^-1/2), computed as MlaCore::select does (in double, rounded once).
float inv_sqrt(int n) { return static_cast<float>(1.0 / std::sqrt(static_cast<double>(n))); }

bool aligned4(const void* p) { return reinterpret_cast<uintptr_t>(p) % 4 == 0; }

void check_key_pages(const char* fn, const Pages& pages, int D) {
  KESTREL_CHECK(pages.base != nullptr && aligned4(pages.base) && pages.page_stride > 0 && pages.page_stride % 4 == 0,
                "{}: index pages need a 4-byte aligned base and a positive page stride that is a multiple of 4, got "
                "stride {}",
                fn, pages.page_stride);
  KESTREL_CHECK(power_of_two(pages.page_size) && int64_t{pages.page_size} * D % 4 == 0,
                "{}: the page size must be a power of two with page_size * head_dim a multiple of 4 (aligned scales), "
                "got page size {} and head_dim {}",
                fn, pages.page_size, D);
}

}  // namespace

void index_query_prep(const float* q, const float* raw_weights, int64_t T, int heads, int head_dim, uint8_t* codes,
                      float* weights, cudaStream_t s) {
  constexpr const char* fn = "index_query_prep";
  KESTREL_CHECK(power_of_two(head_dim) && head_dim <= kMaxGenericIndexPrepDim,
                "{}: head_dim must be a power of two <= {}, got {}", fn, kMaxGenericIndexPrepDim, head_dim);
  KESTREL_CHECK(heads > 0, "{}: need at least one head, got {}", fn, heads);
  KESTREL_CHECK(T >= 0 && T * heads <= kMaxVectors, "{}: T = {} tokens of {} heads is outside [0, {}] vectors", fn, T,
                heads, kMaxVectors);
  if (T == 0) return;
  KESTREL_CHECK(q != nullptr && raw_weights != nullptr && codes != nullptr && weights != nullptr,
                "{}: q, raw_weights, codes and weights must be set", fn);
  KESTREL_CUDA_CHECK(
      detail::launch_index_query_prep(q, raw_weights, T, heads, head_dim, inv_sqrt(heads), inv_sqrt(head_dim), codes,
                                      weights, s));
}

void index_key_write_generic(const float* keys, int64_t T, int head_dim, const int64_t* slots,
                             const Pages& index_pages, cudaStream_t s) {
  constexpr const char* fn = "index_key_write_generic";
  KESTREL_CHECK(power_of_two(head_dim) && head_dim <= kMaxGenericIndexPrepDim,
                "{}: head_dim must be a power of two <= {}, got {}", fn, kMaxGenericIndexPrepDim, head_dim);
  KESTREL_CHECK(T >= 0 && T <= kMaxVectors, "{}: T = {} outside [0, {}]", fn, T, kMaxVectors);
  if (T == 0) return;
  KESTREL_CHECK(keys != nullptr && slots != nullptr, "{}: keys and slots must be set", fn);
  check_key_pages(fn, index_pages, head_dim);
  KESTREL_CUDA_CHECK(
      detail::launch_index_key_write_generic(keys, T, head_dim, inv_sqrt(head_dim), slots, index_pages, s));
}

void index_scores_generic(const IndexQueries& queries, int head_dim, const Pages& index_pages,
                          const BlockTable& block_table, const int32_t* ctx_lens, int max_ctx_len, float* scores,
                          int64_t score_stride, cudaStream_t s, IndexKeyFormat keys) {
  constexpr const char* fn = "index_scores_generic";
  KESTREL_CHECK(power_of_two(head_dim) && head_dim >= kMinGenericIndexScoreDim && head_dim <= kMaxGenericIndexScoreDim,
                "{}: head_dim must be a power of two in [{}, {}], got {}", fn, kMinGenericIndexScoreDim,
                kMaxGenericIndexScoreDim, head_dim);
  KESTREL_CHECK(queries.heads > 0 && int64_t{queries.heads} * head_dim <= kMaxGenericIndexQueryBytes,
                "{}: {} heads of {} codes: need at least one head and at most {} query bytes per token", fn,
                queries.heads, head_dim, kMaxGenericIndexQueryBytes);
  KESTREL_CHECK(queries.batch >= 0 && queries.batch <= kMaxGridY && queries.n_q >= 1 &&
                    queries.n_q <= kMaxGridZ * kGenericScoreTokensPerCta,
                "{}: need 0 <= batch <= {} and 1 <= n_q <= {}, got batch {}, n_q {}", fn, kMaxGridY,
                kMaxGridZ * kGenericScoreTokensPerCta, queries.batch, queries.n_q);
  KESTREL_CHECK(max_ctx_len >= 0 && score_stride >= max_ctx_len, "{}: score stride {} is smaller than max_ctx_len {}",
                fn, score_stride, max_ctx_len);
  if (queries.batch == 0 || max_ctx_len == 0) return;
  KESTREL_CHECK(queries.codes != nullptr && queries.weights != nullptr && ctx_lens != nullptr && scores != nullptr,
                "{}: codes, weights, ctx_lens and scores must be set", fn);
  KESTREL_CHECK(aligned4(queries.codes), "{}: the query codes must be 4-byte aligned", fn);
  KESTREL_CHECK(block_table.pages != nullptr && block_table.stride > 0,
                "{}: the block table needs pages and a positive stride, got stride {}", fn, block_table.stride);
  KESTREL_CHECK(keys == IndexKeyFormat::fp8 || head_dim >= 32, "{}: MXFP4 keys need head_dim >= 32, got {}", fn,
                head_dim);
  check_key_pages(fn, index_pages, head_dim);
  KESTREL_CUDA_CHECK(detail::launch_index_scores_generic(queries, head_dim, index_pages, block_table, ctx_lens,
                                                         max_ctx_len, scores, score_stride, s, keys));
}

void shift_ctx_lens(const int32_t* ctx_lens, int n, int32_t shift, int32_t* out, cudaStream_t s) {
  KESTREL_CHECK(n >= 0, "shift_ctx_lens: negative count {}", n);
  if (n == 0) return;
  KESTREL_CHECK(ctx_lens != nullptr && out != nullptr, "shift_ctx_lens: ctx_lens and out must be set");
  KESTREL_CUDA_CHECK(detail::launch_shift_ctx_lens(ctx_lens, n, shift, out, s));
}

}  // namespace kestrel::cuda
