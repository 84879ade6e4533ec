#include "kernels/cuda/sampling.h"

#include <climits>

#include "core/error.h"
#include "kernels/cuda/runtime.h"

namespace kestrel::cuda {

namespace {

void check_shape(const char* fn, int64_t rows, int64_t vocab) {
  KESTREL_CHECK(vocab >= 1 && vocab <= kMaxSampleVocab, "{}: vocab must be in [1, {}], got {}", fn, kMaxSampleVocab,
                vocab);
  KESTREL_CHECK(rows >= 0 && rows <= (INT_MAX - 1) / vocab,
                "{}: {} rows of {} logits exceed the sort's 32-bit offsets ({} values)", fn, rows, vocab, INT_MAX - 1);
}

}  // namespace

size_t sample_rows_workspace_bytes(int64_t rows, int64_t vocab) {
  check_shape("sample_rows_workspace_bytes", rows, vocab);
  size_t bytes = 0;
  KESTREL_CUDA_CHECK(detail::sample_rows_workspace_bytes(rows, vocab, &bytes));
  return bytes;
}

void sample_rows(const SampleRowsArgs& a, void* workspace, size_t workspace_bytes, cudaStream_t stream) {
  constexpr const char* fn = "sample_rows";
  check_shape(fn, a.rows, a.vocab);
  if (a.rows == 0) return;
  KESTREL_CHECK(a.logits != nullptr && a.params != nullptr && a.tokens != nullptr,
                "{}: logits, params and tokens must be set", fn);
  KESTREL_CHECK(a.logit_rows >= 1 && (a.source_rows != nullptr || a.logit_rows >= a.rows),
                "{}: {} logits rows for {} sampled rows without source_rows", fn, a.logit_rows, a.rows);
  KESTREL_CHECK((a.penalty_offsets == nullptr) == (a.penalty_tokens == nullptr),
                "{}: penalty_offsets and penalty_tokens are set together or not at all", fn);
  KESTREL_CHECK(a.max_top_logprobs >= 0 && a.max_top_logprobs <= kMaxSampleTopLogprobs,
                "{}: max_top_logprobs must be in [0, {}], got {}", fn, kMaxSampleTopLogprobs, a.max_top_logprobs);
  KESTREL_CHECK(a.max_top_logprobs == 0 || (a.token_logprobs != nullptr && a.top_ids != nullptr &&
                                            a.top_logprobs != nullptr),
                "{}: max_top_logprobs = {} needs token_logprobs, top_ids and top_logprobs", fn, a.max_top_logprobs);
  KESTREL_CHECK(a.token_masks != nullptr || a.mask_index == nullptr, "{}: mask_index needs token_masks", fn);
  KESTREL_CHECK(a.token_masks == nullptr || a.mask_words >= (a.vocab + 31) / 32,
                "{}: mask_words {} is below ceil(vocab / 32) = {}", fn, a.mask_words, (a.vocab + 31) / 32);
  const size_t need = sample_rows_workspace_bytes(a.rows, a.vocab);
  KESTREL_CHECK(workspace != nullptr && reinterpret_cast<uintptr_t>(workspace) % 256 == 0,
                "{}: the workspace must be set and 256-byte aligned", fn);
  KESTREL_CHECK(workspace_bytes >= need, "{}: workspace of {} bytes, {} rows of {} logits need {}", fn,
                workspace_bytes, a.rows, a.vocab, need);
  KESTREL_CUDA_CHECK(detail::launch_sample_rows(a, workspace, workspace_bytes, stream));
}

}  // namespace kestrel::cuda
