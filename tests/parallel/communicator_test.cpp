#include <gtest/gtest.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <future>
#include <mutex>
#include <numeric>
#include <stdexcept>
#include <thread>
#include <bit>

#include "parallel/local_world.h"

namespace kestrel::parallel {
namespace {

// Runs world.run(fn) and returns the exception it threw (or nullptr); a run that hangs fails the process instead of
// the test suite timing out without saying why.
std::exception_ptr run_with_deadline(const LocalWorld& world, const std::function<void(Communicator&)>& fn) {
  std::promise<std::exception_ptr> done;
  std::future<std::exception_ptr> result = done.get_future();
  std::thread runner([&] {
    try {
      world.run(fn);
      done.set_value(nullptr);
    } catch (...) {
      done.set_value(std::current_exception());
    }
  });
  if (result.wait_for(std::chrono::seconds(20)) != std::future_status::ready) {
    std::fprintf(stderr, "LocalWorld::run did not return within 20 s: deadlock\n");
    std::_Exit(1);
  }
  runner.join();
  return result.get();
}

std::string message_of(std::exception_ptr e) {
  try {
    std::rethrow_exception(e);
  } catch (const std::exception& x) {
    return x.what();
  }
}

// A byte that depends on who wrote it, for whom, in which repetition and where.
uint8_t pattern(int src, int dst, int iter, size_t i) {
  return static_cast<uint8_t>(src * 37 + dst * 11 + iter * 5 + i * 3 + 1);
}

TEST(Communicator, AllGatherRepeated) {
  for (int W = 1; W <= 8; ++W) {
    LocalWorld(W).run([W](Communicator& comm) {
      ASSERT_EQ(comm.size(), W);
      for (int iter = 0; iter < 200; ++iter) {
        const size_t bytes = 1 + iter % 7;
        std::vector<uint8_t> mine(bytes), all(bytes * W);
        for (size_t i = 0; i < bytes; ++i) mine[i] = pattern(comm.rank(), 0, iter, i);
        comm.all_gather(mine.data(), bytes, all.data());
        for (int r = 0; r < W; ++r)
          for (size_t i = 0; i < bytes; ++i) ASSERT_EQ(all[r * bytes + i], pattern(r, 0, iter, i)) << W << " " << iter;
      }
    });
  }
}

TEST(Communicator, AllGatherInPlace) {
  LocalWorld(4).run([](Communicator& comm) {
    std::vector<int32_t> all(4 * 3, -1);
    for (int i = 0; i < 3; ++i) all[comm.rank() * 3 + i] = comm.rank() * 10 + i;
    comm.all_gather(all.data() + comm.rank() * 3, 3 * sizeof(int32_t), all.data());
    for (int r = 0; r < 4; ++r)
      for (int i = 0; i < 3; ++i) EXPECT_EQ(all[r * 3 + i], r * 10 + i);
  });
}

TEST(Communicator, AllGatherVRepeated) {
  for (int W = 1; W <= 8; ++W) {
    LocalWorld(W).run([W](Communicator& comm) {
      for (int iter = 0; iter < 100; ++iter) {
        // Rank r contributes (r * 3 + iter) % 5 bytes: zero-byte contributions included.
        auto bytes_of = [iter](int r) { return static_cast<size_t>((r * 3 + iter) % 5); };
        std::vector<uint8_t> mine(bytes_of(comm.rank()));
        for (size_t i = 0; i < mine.size(); ++i) mine[i] = pattern(comm.rank(), 0, iter, i);
        const std::vector<size_t> counts = all_gather_sizes(comm, mine.size());
        ASSERT_EQ(counts.size(), static_cast<size_t>(W));
        for (int r = 0; r < W; ++r) ASSERT_EQ(counts[r], bytes_of(r));
        std::vector<uint8_t> all(std::accumulate(counts.begin(), counts.end(), size_t{0}));
        comm.all_gather_v(mine.data(), mine.size(), all.data(), counts);
        size_t at = 0;
        for (int r = 0; r < W; ++r)
          for (size_t i = 0; i < counts[r]; ++i) ASSERT_EQ(all[at++], pattern(r, 0, iter, i));
      }
    });
  }
}

TEST(Communicator, AllToAllVRepeated) {
  for (int W = 1; W <= 8; ++W) {
    LocalWorld(W).run([W](Communicator& comm) {
      const int me = comm.rank();
      for (int iter = 0; iter < 100; ++iter) {
        auto bytes_between = [iter](int src, int dst) { return static_cast<size_t>((src * 5 + dst * 2 + iter) % 6); };
        std::vector<size_t> send_counts(W), recv_counts(W);
        std::vector<uint8_t> send;
        for (int d = 0; d < W; ++d) {
          send_counts[d] = bytes_between(me, d);
          recv_counts[d] = bytes_between(d, me);
          for (size_t i = 0; i < send_counts[d]; ++i) send.push_back(pattern(me, d, iter, i));
        }
        std::vector<uint8_t> recv(std::accumulate(recv_counts.begin(), recv_counts.end(), size_t{0}));
        comm.all_to_all_v(send.data(), send_counts, recv.data(), recv_counts);
        size_t at = 0;
        for (int s = 0; s < W; ++s)
          for (size_t i = 0; i < recv_counts[s]; ++i) ASSERT_EQ(recv[at++], pattern(s, me, iter, i));
      }
    });
  }
}

TEST(Communicator, AllReduceSumIsInRankOrderAndIdenticalOnEveryRank) {
  for (int W = 1; W <= 8; ++W) {
    // Values where fp32 addition order changes the result: a rank-order sum is what every rank must get.
    auto value = [](int r, int iter, size_t i) {
      const float big = (r % 2 == 0 ? 1.0e8f : -1.0e8f);
      return (i % 3 == 0) ? big * static_cast<float>(1 + iter % 3) : 0.1f * static_cast<float>(r + 1) + iter + i;
    };
    std::vector<std::vector<float>> results(W);
    LocalWorld(W).run([&](Communicator& comm) {
      for (int iter = 0; iter < 50; ++iter) {
        std::vector<float> data(7);
        for (size_t i = 0; i < data.size(); ++i) data[i] = value(comm.rank(), iter, i);
        comm.all_reduce_sum(data.data(), data.size());
        for (size_t i = 0; i < data.size(); ++i) {
          float expected = value(0, iter, i);
          for (int r = 1; r < W; ++r) expected += value(r, iter, i);
          ASSERT_EQ(std::bit_cast<uint32_t>(data[i]), std::bit_cast<uint32_t>(expected));
        }
        if (iter == 49) results[comm.rank()] = data;
      }
    });
    for (int r = 1; r < W; ++r) EXPECT_EQ(results[r], results[0]);
  }
}

TEST(Communicator, SendRecvRowsOfVariableSize) {
  for (int W = 2; W <= 8; ++W) {
    LocalWorld(W).run([](Communicator& comm) {
      const int me = comm.rank(), W = comm.size();
      for (int iter = 0; iter < 50; ++iter) {
        // A chain 0 -> 1 -> ... -> W-1: every receive is posted by a rank that has already sent, as NCCL needs.
        const size_t bytes = static_cast<size_t>(iter % 4 == 0 ? 0 : iter + me);
        if (me > 0) {
          const std::vector<uint8_t> row = recv_row(comm, me - 1);
          ASSERT_EQ(row.size(), static_cast<size_t>(iter % 4 == 0 ? 0 : iter + me - 1));
          for (size_t i = 0; i < row.size(); ++i) ASSERT_EQ(row[i], pattern(me - 1, me, iter, i));
        }
        if (me + 1 < W) {
          std::vector<uint8_t> row(bytes);
          for (size_t i = 0; i < bytes; ++i) row[i] = pattern(me, me + 1, iter, i);
          send_row(comm, me + 1, row);
        }
        comm.barrier();
      }
    });
  }
}

TEST(Communicator, ExceptionInOneRankPropagatesWithoutHanging) {
  for (int W = 2; W <= 8; W *= 2) {
    const int culprit = W - 1;
    std::exception_ptr e = run_with_deadline(LocalWorld(W), [culprit](Communicator& comm) {
      std::vector<int> all(comm.size());
      for (int iter = 0; iter < 10; ++iter) {
        int mine = comm.rank();
        comm.all_gather(&mine, sizeof(mine), all.data());
      }
      if (comm.rank() == culprit) throw std::out_of_range("rank-local failure");
      for (int iter = 0; iter < 10; ++iter) comm.barrier();
    });
    ASSERT_TRUE(e);
    try {
      std::rethrow_exception(e);
    } catch (const std::out_of_range& x) {
      EXPECT_STREQ(x.what(), "rank-local failure");
    } catch (...) {
      ADD_FAILURE() << "the original exception type was not kept";
    }
  }
}

TEST(Communicator, ExceptionWhileOthersWaitInRecv) {
  std::exception_ptr e = run_with_deadline(LocalWorld(3), [](Communicator& comm) {
    if (comm.rank() == 0) fail("rank 0 failed before sending");
    int x = 0;
    comm.recv(0, &x, sizeof(x));
  });
  ASSERT_TRUE(e);
  EXPECT_EQ(message_of(e), "rank 0 failed before sending");
}

TEST(Communicator, RankReturningEarlyIsReported) {
  std::exception_ptr e = run_with_deadline(LocalWorld(4), [](Communicator& comm) {
    if (comm.rank() == 2) return;
    comm.barrier();
  });
  ASSERT_TRUE(e);
  EXPECT_NE(message_of(e).find("never entered"), std::string::npos) << message_of(e);
}

TEST(Communicator, MismatchedCollectivesAreReported) {
  std::exception_ptr kinds = run_with_deadline(LocalWorld(3), [](Communicator& comm) {
    int x = comm.rank(), all[3];
    if (comm.rank() == 1)
      comm.barrier();
    else
      comm.all_gather(&x, sizeof(x), all);
  });
  ASSERT_TRUE(kinds);
  EXPECT_NE(message_of(kinds).find("collective mismatch"), std::string::npos) << message_of(kinds);

  std::exception_ptr sizes = run_with_deadline(LocalWorld(3), [](Communicator& comm) {
    int64_t x[2] = {0, 0}, all[6];
    comm.all_gather(x, comm.rank() == 2 ? 8 : 16, all);
  });
  ASSERT_TRUE(sizes);
  EXPECT_NE(message_of(sizes).find("size mismatch"), std::string::npos) << message_of(sizes);

  std::exception_ptr a2a = run_with_deadline(LocalWorld(2), [](Communicator& comm) {
    uint8_t send[4] = {}, recv[4] = {};
    const std::vector<size_t> send_counts = {1, 1};
    const std::vector<size_t> recv_counts = {1, comm.rank() == 0 ? size_t{2} : size_t{1}};
    comm.all_to_all_v(send, send_counts, recv, recv_counts);
  });
  ASSERT_TRUE(a2a);
  EXPECT_NE(message_of(a2a).find("all_to_all_v"), std::string::npos) << message_of(a2a);
}

TEST(Communicator, RowSizeMismatchAndUndeliveredRowsAreReported) {
  std::exception_ptr size = run_with_deadline(LocalWorld(2), [](Communicator& comm) {
    int32_t x[2] = {1, 2};
    if (comm.rank() == 0) comm.send(1, x, sizeof(x));
    if (comm.rank() == 1) comm.recv(0, x, sizeof(int32_t));
  });
  ASSERT_TRUE(size);
  EXPECT_NE(message_of(size).find("expected a row of 4 bytes"), std::string::npos) << message_of(size);

  std::exception_ptr lost = run_with_deadline(LocalWorld(2), [](Communicator& comm) {
    int32_t x = 7;
    if (comm.rank() == 1) comm.send(0, &x, sizeof(x));
  });
  ASSERT_TRUE(lost);
  EXPECT_NE(message_of(lost).find("never received"), std::string::npos) << message_of(lost);
}

TEST(Communicator, WorldCanRunAgainAfterAFailure) {
  const LocalWorld world(3);
  EXPECT_THROW(world.run([](Communicator& comm) {
    if (comm.rank() == 1) fail("first run fails");
    comm.barrier();
  }),
               Error);
  int sum = 0;
  std::mutex mu;
  world.run([&](Communicator& comm) {
    float v = static_cast<float>(comm.rank() + 1);
    comm.all_reduce_sum(&v, 1);
    std::lock_guard lk(mu);
    sum += static_cast<int>(v);
  });
  EXPECT_EQ(sum, 3 * 6);
}

}  // namespace
}  // namespace kestrel::parallel
