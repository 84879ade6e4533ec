#include "parallel/local_world.h"

#include <condition_variable>
#include <cstring>
#include <deque>
#include <exception>
#include <mutex>
#include <numeric>
#include <string>
#include <thread>
#include <vector>

namespace kestrel::parallel {
namespace {

enum class Op { kAllGather, kAllGatherV, kAllToAllV, kAllReduceSum, kBarrier };

const char* op_name(Op op) {
  switch (op) {
    case Op::kAllGather: return "all_gather";
    case Op::kAllGatherV: return "all_gather_v";
    case Op::kAllToAllV: return "all_to_all_v";
    case Op::kAllReduceSum: return "all_reduce_sum";
    case Op::kBarrier: return "barrier";
  }
  return "?";
}

// What one rank brought to the current collective. Valid from its posting until the collective's second barrier.
struct Posting {
  Op op = Op::kBarrier;
  const void* send = nullptr;
  size_t bytes = 0;  // all_gather: bytes per rank; all_gather_v: own contribution; all_reduce_sum: floats
  std::span<const size_t> send_bytes;
  std::span<const size_t> recv_bytes;
};

size_t offset_of(std::span<const size_t> counts, int index) {
  return std::accumulate(counts.begin(), counts.begin() + index, size_t{0});
}

// An in-place all_gather passes the rank's own block as `send`: source and destination are then the same bytes.
void copy_bytes(void* dst, const void* src, size_t n) {
  if (n > 0 && dst != src) std::memcpy(dst, src, n);
}

// State shared by the ranks of one LocalWorld::run. Every collective is: post, barrier, check the postings agree,
// copy out of the other ranks' buffers, barrier (after which the buffers may be reused).
class Group {
 public:
  explicit Group(int size)
      : size_(size), posts_(size), mail_(static_cast<size_t>(size) * size), finished_(size, false) {}

  int size() const { return size_; }
  const Posting& post(int rank) const { return posts_[rank]; }

  void collective_begin(int rank, const Posting& p) {
    posts_[rank] = p;
    arrive_and_wait(rank);
    const std::string problem = disagreement();
    if (!problem.empty()) {
      arrive_and_wait(rank);  // every rank finds the same problem; none may free its buffers while others read them
      fail("{}", problem);
    }
  }
  void collective_end(int rank) { arrive_and_wait(rank); }

  void send(int src, int dst, const void* data, size_t bytes) {
    std::lock_guard lk(mu_);
    if (aborted_) throw CollectiveAborted(fmt::format("rank {}: send aborted because another rank failed", src));
    const auto* p = static_cast<const uint8_t*>(data);
    mail_[box(src, dst)].emplace_back(p, p + bytes);
    cv_.notify_all();
  }

  void recv(int src, int dst, void* data, size_t bytes) {
    std::unique_lock lk(mu_);
    auto& queue = mail_[box(src, dst)];
    cv_.wait(lk, [&] { return !queue.empty() || aborted_ || finished_[src]; });
    if (aborted_) throw CollectiveAborted(fmt::format("rank {}: recv aborted because another rank failed", dst));
    if (queue.empty()) fail("rank {} waits for a row from rank {}, which has returned", dst, src);
    const std::vector<uint8_t>& row = queue.front();
    KESTREL_CHECK(row.size() == bytes, "rank {} expected a row of {} bytes from rank {} but it sent {} bytes", dst,
                  bytes, src, row.size());
    copy_bytes(data, row.data(), bytes);
    queue.pop_front();
  }

  void abort() {
    std::lock_guard lk(mu_);
    aborted_ = true;
    cv_.notify_all();
  }

  void finish(int rank) {
    std::lock_guard lk(mu_);
    finished_[rank] = true;
    ++finished_count_;
    cv_.notify_all();
  }

  // Rows still queued after every rank returned: a send without its recv.
  void check_mail_delivered() const {
    for (int src = 0; src < size_; ++src)
      for (int dst = 0; dst < size_; ++dst)
        KESTREL_CHECK(mail_[box(src, dst)].empty(), "rank {} sent {} row(s) to rank {} that were never received",
                      src, mail_[box(src, dst)].size(), dst);
  }

 private:
  size_t box(int src, int dst) const { return static_cast<size_t>(src) * size_ + dst; }

  void arrive_and_wait(int rank) {
    std::unique_lock lk(mu_);
    check_can_complete(rank);
    const uint64_t generation = generation_;
    if (++arrived_ == size_) {
      arrived_ = 0;
      ++generation_;
      cv_.notify_all();
      return;
    }
    cv_.wait(lk, [&] { return generation_ != generation || aborted_ || finished_count_ > 0; });
    if (generation_ != generation) return;
    check_can_complete(rank);
  }

  // A rank that has returned never arrives again, so once one has, a collective still waiting cannot complete.
  void check_can_complete(int rank) const {
    if (aborted_) throw CollectiveAborted(fmt::format("rank {}: collective aborted because another rank failed", rank));
    for (int r = 0; r < size_; ++r)
      if (finished_[r]) fail("rank {} waits in a collective that rank {} never entered (it has returned)", rank, r);
  }

  // What is inconsistent about the current postings, or "". Runs on every rank over the same postings, so every
  // rank reaches the same verdict.
  std::string disagreement() const {
    const Posting& first = posts_[0];
    for (int r = 1; r < size_; ++r)
      if (posts_[r].op != first.op)
        return fmt::format("collective mismatch: rank 0 called {} but rank {} called {}", op_name(first.op), r,
                           op_name(posts_[r].op));
    switch (first.op) {
      case Op::kAllGather:
      case Op::kAllReduceSum:
        for (int r = 1; r < size_; ++r)
          if (posts_[r].bytes != first.bytes)
            return fmt::format("{} size mismatch: rank 0 passed {}, rank {} passed {}", op_name(first.op),
                               first.bytes, r, posts_[r].bytes);
        break;
      case Op::kAllGatherV:
        for (int r = 0; r < size_; ++r) {
          if (!std::equal(posts_[r].recv_bytes.begin(), posts_[r].recv_bytes.end(), first.recv_bytes.begin()))
            return fmt::format("all_gather_v: rank {} and rank 0 disagree on the byte counts", r);
          if (posts_[r].bytes != first.recv_bytes[r])
            return fmt::format("all_gather_v: rank {} sends {} bytes but the counts say {}", r, posts_[r].bytes,
                               first.recv_bytes[r]);
        }
        break;
      case Op::kAllToAllV:
        for (int s = 0; s < size_; ++s)
          for (int d = 0; d < size_; ++d)
            if (posts_[s].send_bytes[d] != posts_[d].recv_bytes[s])
              return fmt::format("all_to_all_v: rank {} sends {} bytes to rank {}, which expects {}", s,
                                 posts_[s].send_bytes[d], d, posts_[d].recv_bytes[s]);
        break;
      case Op::kBarrier:
        break;
    }
    return "";
  }

  const int size_;
  std::vector<Posting> posts_;
  std::mutex mu_;
  std::condition_variable cv_;
  int arrived_ = 0;
  uint64_t generation_ = 0;
  bool aborted_ = false;
  int finished_count_ = 0;
  std::vector<std::deque<std::vector<uint8_t>>> mail_;
  std::vector<bool> finished_;
};

class LocalCommunicator final : public Communicator {
 public:
  LocalCommunicator(Group& group, int rank) : group_(group), rank_(rank) {}

  int rank() const override { return rank_; }
  int size() const override { return group_.size(); }

  void all_gather(const void* send, size_t bytes, void* recv) override {
    group_.collective_begin(rank_, {Op::kAllGather, send, bytes, {}, {}});
    auto* out = static_cast<uint8_t*>(recv);
    for (int r = 0; r < size(); ++r) copy_bytes(out + r * bytes, group_.post(r).send, bytes);
    group_.collective_end(rank_);
  }

  void all_gather_v(const void* send, size_t send_bytes, void* recv, std::span<const size_t> recv_bytes) override {
    check_counts("all_gather_v", recv_bytes);
    group_.collective_begin(rank_, {Op::kAllGatherV, send, send_bytes, {}, recv_bytes});
    auto* out = static_cast<uint8_t*>(recv);
    for (int r = 0; r < size(); ++r) {
      copy_bytes(out, group_.post(r).send, recv_bytes[r]);
      out += recv_bytes[r];
    }
    group_.collective_end(rank_);
  }

  void all_to_all_v(const void* send, std::span<const size_t> send_bytes, void* recv,
                    std::span<const size_t> recv_bytes) override {
    check_counts("all_to_all_v send", send_bytes);
    check_counts("all_to_all_v recv", recv_bytes);
    group_.collective_begin(rank_, {Op::kAllToAllV, send, 0, send_bytes, recv_bytes});
    auto* out = static_cast<uint8_t*>(recv);
    for (int s = 0; s < size(); ++s) {
      const Posting& p = group_.post(s);
      copy_bytes(out, static_cast<const uint8_t*>(p.send) + offset_of(p.send_bytes, rank_), recv_bytes[s]);
      out += recv_bytes[s];
    }
    group_.collective_end(rank_);
  }

  void all_reduce_sum(float* data, size_t n) override {
    group_.collective_begin(rank_, {Op::kAllReduceSum, data, n, {}, {}});
    std::vector<float> total(static_cast<const float*>(group_.post(0).send),
                             static_cast<const float*>(group_.post(0).send) + n);
    for (int r = 1; r < size(); ++r) {
      const auto* part = static_cast<const float*>(group_.post(r).send);
      for (size_t i = 0; i < n; ++i) total[i] += part[i];
    }
    // Every rank must have read `data` before its owner overwrites it.
    group_.collective_end(rank_);
    copy_bytes(data, total.data(), n * sizeof(float));
  }

  void send(int dst, const void* data, size_t bytes) override {
    check_peer("send", dst);
    group_.send(rank_, dst, data, bytes);
  }

  void recv(int src, void* data, size_t bytes) override {
    check_peer("recv", src);
    group_.recv(src, rank_, data, bytes);
  }

  void barrier() override {
    group_.collective_begin(rank_, {Op::kBarrier, nullptr, 0, {}, {}});
    group_.collective_end(rank_);
  }

 private:
  void check_counts(const char* what, std::span<const size_t> counts) const {
    KESTREL_CHECK(counts.size() == static_cast<size_t>(size()), "{}: {} counts for {} ranks", what, counts.size(),
                  size());
  }
  void check_peer(const char* what, int peer) const {
    KESTREL_CHECK(peer >= 0 && peer < size(), "{}: rank {} out of range [0, {})", what, peer, size());
  }

  Group& group_;
  const int rank_;
};

}  // namespace

LocalWorld::LocalWorld(int size) : size_(size) {
  KESTREL_CHECK(size >= 1, "LocalWorld: size must be at least 1, got {}", size);
}

void LocalWorld::run(const std::function<void(Communicator&)>& fn) const {
  Group group(size_);
  struct Outcome {
    std::exception_ptr error;
    bool aborted = false;  // the error is a CollectiveAborted caused by another rank's failure
  };
  std::vector<Outcome> outcomes(size_);
  {
    std::vector<std::jthread> threads;
    threads.reserve(size_);
    for (int r = 0; r < size_; ++r) {
      threads.emplace_back([&, r] {
        LocalCommunicator comm(group, r);
        try {
          fn(comm);
          group.finish(r);
        } catch (const CollectiveAborted&) {
          outcomes[r] = {std::current_exception(), true};
          group.abort();
        } catch (...) {
          outcomes[r] = {std::current_exception(), false};
          group.abort();
        }
      });
    }
  }
  for (const Outcome& o : outcomes)
    if (o.error && !o.aborted) std::rethrow_exception(o.error);
  for (const Outcome& o : outcomes)
    if (o.error) std::rethrow_exception(o.error);
  group.check_mail_delivered();
}

}  // namespace kestrel::parallel
