#include "parallel/prefill_plan.h"

#include <algorithm>
#include <cstring>
#include <numeric>

#include "parallel/dcp_layout.h"

namespace kestrel::parallel {
namespace {

void check_requests(std::span<const PrefillRequest> requests, int world, const char* who) {
  KESTREL_CHECK(world >= 1, "{}: world size must be at least 1, got {}", who, world);
  for (size_t q = 0; q < requests.size(); ++q)
    KESTREL_CHECK(requests[q].start >= 0 && requests[q].tokens >= 0, "{}: request {} has start {} and {} tokens",
                  who, q, requests[q].start, requests[q].tokens);
}

}  // namespace

std::vector<int64_t> causal_piece_sizes(int64_t tokens, int world) {
  KESTREL_CHECK(world >= 1 && tokens >= 0, "causal_piece_sizes: bad tokens {} or world size {}", tokens, world);
  const int pieces = 2 * world;
  std::vector<int64_t> sizes(pieces, tokens / pieces);
  int64_t extra = tokens % pieces;
  for (int i = 0; i < world && extra > 0; ++i, --extra) ++sizes[i];
  for (int i = pieces - 1; i >= world && extra > 0; --i, --extra) ++sizes[i];
  return sizes;
}

TokenShardPlan::TokenShardPlan(std::span<const PrefillRequest> requests, int world)
    : world_(world), pieces_(world), tokens_(world) {
  check_requests(requests, world, "TokenShardPlan");
  for (size_t q = 0; q < requests.size(); ++q) {
    const std::vector<int64_t> sizes = causal_piece_sizes(requests[q].tokens, world);
    std::vector<int64_t> first(sizes.size() + 1, 0);
    std::partial_sum(sizes.begin(), sizes.end(), first.begin() + 1);
    for (int r = 0; r < world; ++r) {
      for (int piece : {r, 2 * world - 1 - r}) {
        const TokenPiece p{static_cast<int64_t>(q), step_tokens_ + first[piece], requests[q].start + first[piece],
                           sizes[piece]};
        pieces_[r].push_back(p);
        for (int64_t i = 0; i < p.count; ++i) tokens_[r].push_back(p.first_token + i);
      }
    }
    step_tokens_ += requests[q].tokens;
  }
}

int64_t TokenShardPlan::causal_work(int rank) const {
  int64_t work = 0;
  for (const TokenPiece& p : pieces_[rank])  // positions first_position .. first_position + count - 1, each + 1
    work += p.count * (2 * p.first_position + p.count + 1) / 2;
  return work;
}

HeadRange head_range(int heads, int world, int rank) {
  KESTREL_CHECK(heads >= 1 && world >= 1 && rank >= 0 && rank < world, "head_range: {} heads, rank {} of {}", heads,
                rank, world);
  const auto bound = [&](int r) { return static_cast<int>(int64_t{r} * heads / world); };
  return {bound(rank), bound(rank + 1)};
}

namespace {

void check_heads(const TokenShardPlan& plan, const Communicator& comm, int heads, int head_dim, const char* who) {
  KESTREL_CHECK(comm.size() == plan.world(), "{}: plan for {} ranks used by {} ranks", who, plan.world(),
                comm.size());
  KESTREL_CHECK(heads >= 1 && head_dim >= 1, "{}: {} heads of dim {}", who, heads, head_dim);
}

}  // namespace

std::vector<float> head_to_token_sharded(Communicator& comm, const TokenShardPlan& plan,
                                         std::span<const float> head_sharded, int heads, int head_dim) {
  check_heads(plan, comm, heads, head_dim, "head_to_token_sharded");
  const int W = comm.size(), me = comm.rank();
  // One token's heads on rank r: slab(r) values.
  const auto slab = [&](int r) { return static_cast<size_t>(head_range(heads, W, r).count()) * head_dim; };
  KESTREL_CHECK(head_sharded.size() == plan.step_tokens() * slab(me),
                "head_to_token_sharded: expected {} values, got {}", plan.step_tokens() * slab(me),
                head_sharded.size());
  std::vector<float> send;
  send.reserve(head_sharded.size());
  std::vector<size_t> send_bytes(W), recv_bytes(W);
  const size_t mine = plan.tokens_of(me).size();
  for (int d = 0; d < W; ++d) {
    for (int64_t t : plan.tokens_of(d))
      send.insert(send.end(), head_sharded.begin() + t * slab(me), head_sharded.begin() + (t + 1) * slab(me));
    send_bytes[d] = plan.tokens_of(d).size() * slab(me) * sizeof(float);
    recv_bytes[d] = mine * slab(d) * sizeof(float);
  }
  std::vector<float> recv(mine * heads * head_dim);
  comm.all_to_all_v(send.data(), send_bytes, recv.data(), recv_bytes);
  std::vector<float> out(recv.size());
  auto from = recv.begin();
  for (int s = 0; s < W; ++s) {
    const size_t first = static_cast<size_t>(head_range(heads, W, s).begin) * head_dim;
    for (size_t i = 0; i < mine; ++i, from += slab(s))
      std::copy_n(from, slab(s), out.begin() + i * heads * head_dim + first);
  }
  return out;
}

std::vector<float> token_to_head_sharded(Communicator& comm, const TokenShardPlan& plan,
                                         std::span<const float> token_sharded, int heads, int head_dim) {
  check_heads(plan, comm, heads, head_dim, "token_to_head_sharded");
  const int W = comm.size(), me = comm.rank();
  const auto slab = [&](int r) { return static_cast<size_t>(head_range(heads, W, r).count()) * head_dim; };
  const size_t mine = plan.tokens_of(me).size(), row = static_cast<size_t>(heads) * head_dim;
  KESTREL_CHECK(token_sharded.size() == mine * row, "token_to_head_sharded: expected {} values, got {}", mine * row,
                token_sharded.size());
  std::vector<float> send;
  send.reserve(token_sharded.size());
  std::vector<size_t> send_bytes(W), recv_bytes(W);
  for (int d = 0; d < W; ++d) {
    const size_t first = static_cast<size_t>(head_range(heads, W, d).begin) * head_dim;
    for (size_t i = 0; i < mine; ++i)
      send.insert(send.end(), token_sharded.begin() + i * row + first,
                  token_sharded.begin() + i * row + first + slab(d));
    send_bytes[d] = mine * slab(d) * sizeof(float);
    recv_bytes[d] = plan.tokens_of(d).size() * slab(me) * sizeof(float);
  }
  std::vector<float> recv(plan.step_tokens() * slab(me));
  comm.all_to_all_v(send.data(), send_bytes, recv.data(), recv_bytes);
  std::vector<float> out(recv.size());
  auto from = recv.begin();
  for (int s = 0; s < W; ++s)
    for (int64_t t : plan.tokens_of(s)) {
      std::copy_n(from, slab(me), out.begin() + t * slab(me));
      from += slab(me);
    }
  return out;
}

GatheredContextPlan::GatheredContextPlan(std::span<const PrefillRequest> requests, int world)
    : world_(world), contributed_(world) {
  check_requests(requests, world, "GatheredContextPlan");
  for (const PrefillRequest& req : requests) {
    const int64_t offset = workspace_rows_;
    offsets_.push_back(offset);
    for (int r = 0; r < world; ++r)
      for (int64_t l = 0; l < dcp_local_count(req.start, r, world); ++l)
        contributed_[r].push_back(offset + dcp_position(l, r, world));
    for (int64_t i = 0; i < req.tokens; ++i) step_rows_.push_back(offset + req.start + i);
    workspace_rows_ += req.start + req.tokens;
  }
}

std::vector<uint8_t> gather_context(Communicator& comm, const GatheredContextPlan& plan,
                                    std::span<const uint8_t> contributed, std::span<const uint8_t> step_rows,
                                    size_t row_bytes) {
  const int W = comm.size(), me = comm.rank();
  KESTREL_CHECK(W == plan.world(), "gather_context: plan for {} ranks used by {} ranks", plan.world(), W);
  KESTREL_CHECK(row_bytes >= 1, "gather_context: rows must have at least one byte");
  KESTREL_CHECK(contributed.size() == plan.contributed_rows(me).size() * row_bytes,
                "gather_context: rank {} must contribute {} rows of {} bytes, got {} bytes", me,
                plan.contributed_rows(me).size(), row_bytes, contributed.size());
  KESTREL_CHECK(step_rows.size() == plan.step_rows().size() * row_bytes,
                "gather_context: expected {} step rows of {} bytes, got {} bytes", plan.step_rows().size(),
                row_bytes, step_rows.size());
  std::vector<size_t> counts(W);
  for (int r = 0; r < W; ++r) counts[r] = plan.contributed_rows(r).size() * row_bytes;
  std::vector<uint8_t> gathered(std::accumulate(counts.begin(), counts.end(), size_t{0}));
  comm.all_gather_v(contributed.data(), contributed.size(), gathered.data(), counts);
  std::vector<uint8_t> workspace(plan.workspace_rows() * row_bytes);
  const uint8_t* from = gathered.data();
  for (int r = 0; r < W; ++r)
    for (int64_t row : plan.contributed_rows(r)) {
      std::memcpy(workspace.data() + row * row_bytes, from, row_bytes);
      from += row_bytes;
    }
  for (size_t i = 0; i < plan.step_rows().size(); ++i)
    std::memcpy(workspace.data() + plan.step_rows()[i] * row_bytes, step_rows.data() + i * row_bytes, row_bytes);
  return workspace;
}

}  // namespace kestrel::parallel
