// Planning of prefill steps across W ranks (PARALLEL.md "Token-sharded prefill", "DCP prefill by gathered context").
#pragma once
#include <cstdint>
#include <span>
#include <vector>

#include "parallel/communicator.h"

namespace kestrel::parallel {

// One request of a prefill step: it computes positions [start, start + tokens) after `start` cached positions.
struct PrefillRequest {
  int64_t start = 0;
  int64_t tokens = 0;
};

// Sizes of the 2W causal pieces of `tokens` consecutive tokens, in position order. They differ by at most one:
// the remainder goes first to pieces 0..W-1 (the first piece of ranks 0..W-1), then to pieces 2W-1 down to W (the
// second piece of ranks 0..W-1). With this order no two ranks' causal work differs by more than the work of the
// request's last token.
std::vector<int64_t> causal_piece_sizes(int64_t tokens, int world);

struct TokenPiece {
  int64_t request;
  int64_t first_token;     // index of its first token among the step's tokens (requests back to back)
  int64_t first_position;  // position of that token in its request
  int64_t count;
};

// Token-sharded attention: every request is cut into 2W pieces and rank r takes pieces r and 2W-1-r of each.
class TokenShardPlan {
 public:
  TokenShardPlan(std::span<const PrefillRequest> requests, int world);

  int world() const { return world_; }
  int64_t step_tokens() const { return step_tokens_; }
  // Rank r's pieces, in its token-sharded order: for each request, piece r, then piece 2W-1-r.
  std::span<const TokenPiece> pieces_of(int rank) const { return pieces_[rank]; }
  // Step-token indices of rank r's tokens, in its token-sharded order.
  std::span<const int64_t> tokens_of(int rank) const { return tokens_[rank]; }
  // Causal work of rank r: the sum over its tokens of (position + 1), the number of keys each token attends.
  int64_t causal_work(int rank) const;

 private:
  int world_;
  int64_t step_tokens_ = 0;
  std::vector<std::vector<TokenPiece>> pieces_;
  std::vector<std::vector<int64_t>> tokens_;
};

// The heads rank r holds in the head-sharded layout: [floor(r*H/W), floor((r+1)*H/W)). With H divisible by W that
// is H/W heads from r*H/W; otherwise shares differ by one (H = 4, W = 3: 1, 1, 2), and ranks beyond H hold none.
struct HeadRange {
  int begin = 0;
  int end = 0;
  int count() const { return end - begin; }
};
HeadRange head_range(int heads, int world, int rank);

// The two all-to-alls around token-sharded attention. Head-sharded layout on rank r: [step_tokens,
// head_range(H, W, r).count(), D], the rank's heads of every step token. Token-sharded layout on rank r:
// [tokens_of(r), H, D], every head of the rank's own tokens.
std::vector<float> head_to_token_sharded(Communicator& comm, const TokenShardPlan& plan,
                                         std::span<const float> head_sharded, int heads, int head_dim);
std::vector<float> token_to_head_sharded(Communicator& comm, const TokenShardPlan& plan,
                                         std::span<const float> token_sharded, int heads, int head_dim);

// DCP prefill by gathered context: the cached positions [0, start) of each request are spread over the W ranks
// (position t on rank t mod W at local index t / W). The step gathers them into one workspace on every rank, in
// which position p of request q is row workspace_offset(q) + p for every p < start + tokens; the rows of the
// step's own tokens come from the step's computation, which every rank has.
class GatheredContextPlan {
 public:
  GatheredContextPlan(std::span<const PrefillRequest> requests, int world);

  int world() const { return world_; }
  int64_t workspace_rows() const { return workspace_rows_; }
  int64_t workspace_offset(int64_t request) const { return offsets_[request]; }
  // The workspace rows of the cached rows rank r contributes, in the order it sends them: for each request, its
  // local rows 0 .. dcp_local_count(start, r, W)-1.
  std::span<const int64_t> contributed_rows(int rank) const { return contributed_[rank]; }
  // The workspace rows of the step's tokens, in step order.
  std::span<const int64_t> step_rows() const { return step_rows_; }

 private:
  int world_;
  int64_t workspace_rows_ = 0;
  std::vector<int64_t> offsets_;
  std::vector<std::vector<int64_t>> contributed_;
  std::vector<int64_t> step_rows_;
};

// contributed: this rank's rows in contributed_rows(rank) order; step_rows: the step's tokens' rows, in step order;
// rows of row_bytes bytes (any cache format). Returns the workspace [workspace_rows, row_bytes], the same on every
// rank.
std::vector<uint8_t> gather_context(Communicator& comm, const GatheredContextPlan& plan,
                                    std::span<const uint8_t> contributed, std::span<const uint8_t> step_rows,
                                    size_t row_bytes);

}  // namespace kestrel::parallel
