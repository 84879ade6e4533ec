// The check of the generic absorbed MLA attention (mla_attend_generic, for every latent format) against
// cpu::mla_attend_absorbed over the decoded latent rows, shared by the tests of each format, and the random index
// lists those tests give it.
#pragma once

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <random>
#include <string>
#include <vector>

#include "cuda_test_util.h"
#include "kernels/cpu/attention.h"

namespace kestrel::cuda::test_util {

struct AttendCase {
  int C, R, H, page_size;
  bool sparse;  // through index lists (else dense)
};

inline std::string attend_case_name(const ::testing::TestParamInfo<AttendCase>& info) {
  // Appended piece by piece: GCC 12 warns (-Wrestrict, a false positive) on "literal" + std::string&& once inlined.
  const AttendCase& a = info.param;
  std::string name = "C";
  name.append(std::to_string(a.C)).append("_R").append(std::to_string(a.R)).append("_H").append(std::to_string(a.H));
  name.append("_page").append(std::to_string(a.page_size)).append(a.sparse ? "_indices" : "_dense");
  return name;
}

// One request's share of a batch: its context length and the positions of its query rows.
struct Request {
  int ctx;
  std::vector<int> query_positions;
};

inline std::vector<int> contexts(const std::vector<Request>& reqs) {
  std::vector<int> ctx;
  for (const Request& r : reqs) ctx.push_back(r.ctx);
  return ctx;
}

// The query rows of a batch, request by request: each row's request and position.
struct QueryRows {
  std::vector<int32_t> req, pos;
};

inline QueryRows query_rows(const std::vector<Request>& reqs) {
  QueryRows rows;
  for (size_t r = 0; r < reqs.size(); ++r)
    for (int p : reqs[r].query_positions) {
      rows.req.push_back(static_cast<int32_t>(r));
      rows.pos.push_back(p);
    }
  return rows;
}

// Index lists of k per query row ([rows, k]) in random order: mostly causal positions, some -1 padding, some
// positions past the row (skipped), some repeats (counted twice). The row of request empty_request at position 0
// gets no valid entry at all (-1, or positions past it); empty_request -1: no such row.
inline std::vector<int32_t> random_index_lists(std::mt19937& rng, const std::vector<int32_t>& row_req,
                                               const std::vector<int32_t>& row_pos, int k, int empty_request) {
  const size_t rows = row_req.size();
  std::vector<int32_t> indices(rows * static_cast<size_t>(k));
  for (size_t row = 0; row < rows; ++row) {
    const int pos = row_pos[row];
    const bool none_valid = row_req[row] == empty_request && pos == 0;
    int32_t* idx = indices.data() + row * k;
    for (int i = 0; i < k; ++i) {
      const unsigned kind = rng() % 10;
      if (none_valid) idx[i] = kind < 5 ? -1 : pos + 1 + static_cast<int32_t>(rng() % 100);
      else if (kind < 6) idx[i] = static_cast<int32_t>(rng() % (pos + 1));
      else if (kind == 6) idx[i] = -1;
      else if (kind == 7) idx[i] = pos + 1 + static_cast<int32_t>(rng() % 50);
      else idx[i] = i > 0 ? idx[rng() % i] : 0;
    }
  }
  return indices;
}

// What check_attend_against_cpu found: the largest out error relative to max|value| of a row's attended positions,
// the largest lse error relative to 1 + |lse|, elements over the bound, elements still holding the poison, and rows
// whose reference attends to no position (lse -inf).
struct AttendErrors {
  double worst = 0.0, worst_lse = 0.0;
  int64_t bad = 0, poisoned = 0, empty_rows = 0;
};

// The GPU's out [rows, H, C] and lse [rows, H] against cpu::mla_attend_absorbed of each query row q [rows, H, C + R]
// over values[its request] ([ctx, C + R] decoded rows) up to its position, through its index list (indices
// [rows, k]) or densely (indices null). Bound, as the callers justify it: |out - ref| <= 1e-5 * max|value| of the
// attended rows + 1e-6, |lse - ref| <= 1e-5 * (1 + |ref|), an lse of -inf exactly. The first 8 elements over the
// bound are reported as failures, naming the row's request and position when name_request is set.
inline AttendErrors check_attend_against_cpu(const std::vector<float>& q, int H, int C, int R,
                                             const std::vector<int32_t>& row_req, const std::vector<int32_t>& row_pos,
                                             const std::vector<std::vector<float>>& values, const int32_t* indices,
                                             int k, float softmax_scale, const std::vector<float>& out,
                                             const std::vector<float>& lse, bool name_request) {
  const int width = C + R, rows = static_cast<int>(row_req.size());
  const bool sparse = indices != nullptr;
  AttendErrors e;
  std::vector<float> ref(static_cast<size_t>(H) * C), ref_lse(static_cast<size_t>(H));
  for (int row = 0; row < rows; ++row) {
    const size_t r = static_cast<size_t>(row_req[static_cast<size_t>(row)]);
    const int pos = row_pos[static_cast<size_t>(row)];
    const int32_t* idx = sparse ? indices + static_cast<size_t>(row) * k : nullptr;
    cpu::mla_attend_absorbed(q.data() + static_cast<size_t>(row) * H * width, H, C, R, values[r].data(), pos + 1, idx,
                             sparse ? k : 0, softmax_scale, ref.data(), ref_lse.data());
    float vmax = 0.0f;
    for (int i = 0; i < (sparse ? k : pos + 1); ++i) {
      const int p = sparse ? idx[i] : i;
      if (p < 0 || p > pos) continue;
      for (int c = 0; c < C; ++c) vmax = std::max(vmax, std::fabs(values[r][static_cast<size_t>(p) * width + c]));
    }
    if (ref_lse[0] == -kInf) ++e.empty_rows;
    const std::string where = name_request ? "row " + std::to_string(row) + " (request " + std::to_string(r) +
                                                 ", position " + std::to_string(pos) + ")"
                                           : "row " + std::to_string(row);
    const float tol = 1e-5f * vmax + 1e-6f;
    for (int h = 0; h < H; ++h) {
      const size_t hq = static_cast<size_t>(row) * H + h;
      const float rl = ref_lse[static_cast<size_t>(h)];
      if (bits(lse[hq]) == kPoisonBits) ++e.poisoned;
      const bool lse_ok = rl == -kInf ? lse[hq] == -kInf : std::fabs(lse[hq] - rl) <= 1e-5f * (1.0f + std::fabs(rl));
      if (!lse_ok && e.bad++ < 8) ADD_FAILURE() << "lse, " << where << " head " << h << ": " << lse[hq] << " vs " << rl;
      if (rl != -kInf) e.worst_lse = std::max(e.worst_lse, std::fabs(double{lse[hq]} - rl) / (1.0 + std::fabs(rl)));
      for (int c = 0; c < C; ++c) {
        const float g = out[hq * C + c], rv = ref[static_cast<size_t>(h) * C + c];
        if (bits(g) == kPoisonBits) ++e.poisoned;
        const float err = std::fabs(g - rv);
        if (!(err <= tol) && e.bad++ < 8)
          ADD_FAILURE() << "out, " << where << " head " << h << " col " << c << ": " << g << " vs " << rv
                        << " (tolerance " << tol << ")";
        if (vmax > 0.0f) e.worst = std::max(e.worst, double{err} / vmax);
      }
    }
  }
  return e;
}

// The line each attention case prints: what (the kernel and latent format) and the case's name with its errors.
inline void print_attend_errors(const char* what, const std::string& case_name, const AttendErrors& e) {
  std::printf("%s %s: largest |out error| / max|v| = %.3g (bound 1e-5), largest lse error / (1+|lse|) = %.3g "
              "(bound 1e-5)\n",
              what, case_name.c_str(), e.worst, e.worst_lse);
}

}  // namespace kestrel::cuda::test_util
