// GPU KDA kernels against the CPU reference (kestrel::cpu::kda_recurrent / kda_chunked) on fresh random inputs.
#include "kernels/cuda/kda.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <numeric>
#include <optional>
#include <random>
#include <vector>

#include "core/error.h"
#include "kernels/cpu/basic.h"
#include "kernels/cpu/kda.h"
#include "kernels/cuda/runtime.h"
#include "kda_test_inputs.h"

namespace kestrel::cuda {
namespace {

using namespace kda_test;

// Both sides compute in fp32; the GPU sums in other orders and forms the off-diagonal pair decays of a chunk as a
// product of two factors, so the two differ by rounding only. The bound is the CPU reference's own bound between
// its chunked and recurrent forms.
constexpr double kBound = 1e-5;

std::vector<float> random_states(int64_t n_slots, int H, uint32_t seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> normal(0.0f, 0.5f);
  std::vector<float> s(static_cast<size_t>(n_slots * H * kHeadState));
  for (float& e : s) e = normal(rng);
  return s;
}

class KdaCuda : public ::testing::Test {
 protected:
  void SetUp() override {
    if (device_count() == 0) GTEST_SKIP() << "no CUDA device";
  }
};

// ---------------------------------------------------------------------------------------------------- decode

// `steps` decode steps of N sequences whose states sit in shuffled slots of a larger pool; every step's output and
// the final pool are compared with the CPU recurrence; slots no sequence owns must stay bit-identical.
void check_decode(int N, int H, const GateSpec& gate, bool fused, uint32_t seed, int steps = 2) {
  SCOPED_TRACE(testing::Message() << "N=" << N << " H=" << H << " fused=" << fused);
  const int pool = N + 3;
  const int64_t slot_size = H * kHeadState;
  const std::vector<int32_t> slots = random_slots(N, pool, seed);
  const std::vector<float> initial = random_states(pool, H, seed + 1);
  std::vector<float> want_pool = initial;
  DeviceBuffer<float> d_pool = to_device(initial);
  const DeviceBuffer<int32_t> d_slots = to_device(slots);
  DeviceBuffer<float> d_o(static_cast<size_t>(N) * H * kDim);
  double max_err = 0;

  for (int step = 0; step < steps; ++step) {
    const Tokens tok(N, H, gate, seed + 100 + step);
    std::vector<float> want_o(static_cast<size_t>(N) * H * kDim);
    for (int i = 0; i < N; ++i) {
      const int64_t off = int64_t{i} * H * kDim;
      cpu::kda_recurrent(tok.q.data() + off, tok.k.data() + off, tok.v.data() + off, tok.g.data() + off,
                         tok.beta.data() + int64_t{i} * H, 1, H, kDim, kDim, 1.0f / std::sqrt(float(kDim)),
                         want_pool.data() + slots[i] * slot_size, want_o.data() + off);
    }
    const DeviceTokens dt(tok, fused);
    poison(d_o);
    kda_decode(dt.inputs, N, H, kDim, kDim, d_pool.get(), d_slots.get(), d_o.get(), nullptr);
    KESTREL_CUDA_CHECK(cudaDeviceSynchronize());
    const double err = rel_err(to_host(d_o), want_o);
    EXPECT_LE(err, kBound) << "o at step " << step;
    max_err = std::max(max_err, err);
  }

  const std::vector<float> got_pool = to_host(d_pool);
  std::vector<bool> owned(static_cast<size_t>(pool), false);
  for (int i = 0; i < N; ++i) {
    owned[slots[i]] = true;
    const int64_t off = slots[i] * slot_size;
    const double err = rel_err(got_pool.data() + off, want_pool.data() + off, slot_size);
    EXPECT_LE(err, kBound) << "state of sequence " << i;
    max_err = std::max(max_err, err);
  }
  std::printf("decode N=%d H=%d fused=%d: largest relative error %.3g\n", N, H, int{fused}, max_err);
  for (int s = 0; s < pool; ++s) {
    if (!owned[s]) {
      EXPECT_EQ(std::memcmp(got_pool.data() + s * slot_size, initial.data() + s * slot_size, slot_size * 4), 0)
          << "slot " << s << " belongs to no sequence but changed";
    }
  }
}

TEST_F(KdaCuda, DecodeFusedMatchesCpu) {
  for (int N : {1, 7, 64, 256}) check_decode(N, 4, kSoftplusGate, true, 1000 + N);
}

TEST_F(KdaCuda, DecodeFullHeadCountAndGivenGates) {
  check_decode(7, 32, kLowerBoundGate, false, 11);
  check_decode(64, 32, kSoftplusGate, false, 12);
  check_decode(7, 32, kLowerBoundGate, true, 13);
}

TEST_F(KdaCuda, DecodeStrongDecay) { check_decode(64, 4, kStrongGate, true, 21, 4); }

// ---------------------------------------------------------------------------------------------------- prefill

struct PrefillResult {
  std::vector<float> o, pool, checkpoints;
};

// One varlen prefill on the GPU, poisoned outputs, slots `slots` of a pool initialised to `initial`.
PrefillResult gpu_prefill(const Tokens& tok, bool fused, const KdaPrefillPlan& plan, const std::vector<int32_t>& slots,
                          const std::vector<float>& initial) {
  const int H = tok.H;
  const DeviceTokens dt(tok, fused);
  DeviceBuffer<float> d_pool = to_device(initial);
  const DeviceBuffer<int32_t> d_slots = to_device(slots);
  DeviceBuffer<float> d_o(static_cast<size_t>(tok.T) * H * kDim);
  DeviceBuffer<float> d_ck(static_cast<size_t>(plan.num_checkpoints() * H * kHeadState));
  DeviceBuffer<unsigned char> d_ws(plan.workspace_bytes(H));
  poison(d_o);
  poison(d_ck);
  poison(d_ws);
  kda_prefill(plan, dt.inputs, H, kDim, kDim, d_pool.get(), d_slots.get(), d_o.get(), d_ck.get(), d_ws.get(),
              d_ws.bytes(), nullptr);
  KESTREL_CUDA_CHECK(cudaDeviceSynchronize());
  return PrefillResult{to_host(d_o), to_host(d_pool), to_host(d_ck)};
}

void check_prefill(const std::vector<int64_t>& lengths, const std::vector<int64_t>& starts, int64_t every, int H,
                   const GateSpec& gate, bool fused, uint32_t seed, double bound = kBound) {
  SCOPED_TRACE(testing::Message() << "H=" << H << " every=" << every << " fused=" << fused);
  const int B = static_cast<int>(lengths.size());
  std::vector<int64_t> cu(static_cast<size_t>(B) + 1, 0);
  for (int b = 0; b < B; ++b) cu[b + 1] = cu[b] + lengths[b];
  const Tokens tok(cu[B], H, gate, seed);
  const KdaPrefillPlan plan(cu, starts, every);
  const int pool = B + 2;
  const int64_t slot_size = H * kHeadState;
  const std::vector<int32_t> slots = random_slots(B, pool, seed + 1);
  const std::vector<float> initial = random_states(pool, H, seed + 2);
  double max_err_seen = 0;

  const PrefillResult got = gpu_prefill(tok, fused, plan, slots, initial);

  std::vector<float> want_o(got.o.size());
  const float scale = 1.0f / std::sqrt(static_cast<float>(kDim));
  for (int b = 0; b < B; ++b) {
    SCOPED_TRACE(testing::Message() << "sequence " << b << " length " << lengths[b] << " start " << starts[b]);
    std::vector<float> state(initial.begin() + slots[b] * slot_size, initial.begin() + (slots[b] + 1) * slot_size);
    std::vector<float> ck(static_cast<size_t>(plan.checkpoints_of(b) * slot_size));
    const int64_t qk = cu[b] * H * kDim;
    const int n_ck = cpu::kda_chunked(tok.q.data() + qk, tok.k.data() + qk, tok.v.data() + qk, tok.g.data() + qk,
                                      tok.beta.data() + cu[b] * H, lengths[b], H, kDim, kDim, scale, state.data(),
                                      want_o.data() + qk, starts[b], 64, every > 0 ? ck.data() : nullptr, every);
    ASSERT_EQ(n_ck, plan.checkpoints_of(b));
    const double state_err = rel_err(got.pool.data() + slots[b] * slot_size, state.data(), slot_size);
    EXPECT_LE(state_err, bound) << "final state";
    max_err_seen = std::max(max_err_seen, state_err);
    if (lengths[b] == 0) {
      EXPECT_EQ(std::memcmp(got.pool.data() + slots[b] * slot_size, state.data(), slot_size * 4), 0)
          << "an empty sequence must leave its state bit-identical";
    }
    for (int64_t j = 0; j < n_ck; ++j) {
      const double err = rel_err(got.checkpoints.data() + (plan.first_checkpoint(b) + j) * slot_size,
                                 ck.data() + j * slot_size, slot_size);
      EXPECT_LE(err, bound) << "checkpoint " << j;
      max_err_seen = std::max(max_err_seen, err);
    }
  }
  const double o_err = rel_err(got.o, want_o);
  EXPECT_LE(o_err, bound) << "outputs";
  max_err_seen = std::max(max_err_seen, o_err);
  std::vector<bool> owned(static_cast<size_t>(pool), false);
  for (int32_t s : slots) owned[s] = true;
  for (int s = 0; s < pool; ++s) {
    if (!owned[s]) {
      EXPECT_EQ(std::memcmp(got.pool.data() + s * slot_size, initial.data() + s * slot_size, slot_size * 4), 0)
          << "slot " << s << " belongs to no sequence but changed";
    }
  }
  std::printf("prefill B=%d T=%lld H=%d fused=%d: largest relative error %.3g\n", B, static_cast<long long>(cu[B]), H,
              int{fused}, max_err_seen);
}

// Lengths around the chunk size, resumed sequences that start mid-chunk, an empty sequence, checkpoints every 64.
TEST_F(KdaCuda, PrefillVarlenFusedMatchesCpu) {
  check_prefill({1, 63, 64, 65, 200, 130, 0}, {0, 0, 5, 64, 10, 128, 7}, 64, 4, kSoftplusGate, true, 31);
}

TEST_F(KdaCuda, PrefillVarlenGivenGatesCheckpointsEvery128) {
  check_prefill({100, 257, 3, 128}, {28, 0, 126, 256}, 128, 3, kLowerBoundGate, false, 32);
  check_prefill({70, 1}, {0, 500}, 0, 32, kSoftplusGate, false, 33);
}

// g down to about -80 per token: within one chunk G reaches about -1000, where any exp(-G) would overflow.
// With the same g on both sides (given gates) both compute the same G, and only the summation orders and the
// split of the off-diagonal pair decays differ: the usual bound. With the gate fused in, the GPU's expf/log1pf
// give g within an ulp of the CPU's std::exp/log1p, and the cumulative sums G (|G| up to ~1000) then differ by
// about |G| 2^-24 in the exponent of every pair decay; this test's bound is twice the usual one for that case.
TEST_F(KdaCuda, PrefillStrongDecayStaysFiniteAndMatchesCpu) {
  check_prefill({300, 77}, {0, 40}, 64, 2, kStrongGate, false, 41);
  check_prefill({300, 77}, {0, 40}, 64, 2, kStrongGate, true, 42, 2 * kBound);
}

// The shared state layout: prefill of T tokens equals prefill of T - 3 followed by 3 decode steps.
TEST_F(KdaCuda, PrefillThenDecodeEqualsLongerPrefill) {
  const int H = 4;
  const int64_t T = 133;
  const Tokens tok(T, H, kSoftplusGate, 51);
  const std::vector<float> initial = random_states(1, H, 52);
  const std::vector<int32_t> slot0 = {0};
  const int64_t T0 = T - 3;
  const KdaPrefillPlan full(std::vector<int64_t>{0, T}, std::vector<int64_t>{0});
  const PrefillResult want = gpu_prefill(tok, true, full, slot0, initial);

  const KdaPrefillPlan head(std::vector<int64_t>{0, T0}, std::vector<int64_t>{0});
  const DeviceTokens dt(tok, true);
  DeviceBuffer<float> d_pool = to_device(initial);
  const DeviceBuffer<int32_t> d_slot = to_device(slot0);
  DeviceBuffer<float> d_o(static_cast<size_t>(T) * H * kDim);
  DeviceBuffer<unsigned char> d_ws(head.workspace_bytes(H));
  poison(d_o);
  kda_prefill(head, dt.inputs, H, kDim, kDim, d_pool.get(), d_slot.get(), d_o.get(), nullptr, d_ws.get(), d_ws.bytes(),
              nullptr);
  for (int64_t t = T0; t < T; ++t) {
    KdaInputs step = dt.inputs;
    const int64_t off = t * H * kDim;
    step.q += off;
    step.k += off;
    step.v += off;
    step.gate += off;
    step.beta += t * H;
    kda_decode(step, 1, H, kDim, kDim, d_pool.get(), d_slot.get(), d_o.get() + off, nullptr);
  }
  KESTREL_CUDA_CHECK(cudaDeviceSynchronize());
  const double o_err = rel_err(to_host(d_o), want.o), state_err = rel_err(to_host(d_pool), want.pool);
  EXPECT_LE(o_err, kBound);
  EXPECT_LE(state_err, kBound);
  std::printf("prefill %lld + 3 decodes vs prefill %lld: relative error o %.3g, state %.3g\n",
              static_cast<long long>(T0), static_cast<long long>(T), o_err, state_err);
}

// ---------------------------------------------------------------------------------------------------- arguments

TEST_F(KdaCuda, RejectsWhatIsNotImplementedOrMalformed) {
  const Tokens tok(2, 1, kSoftplusGate, 61);
  const DeviceTokens dt(tok, true);
  DeviceBuffer<float> pool(static_cast<size_t>(kHeadState)), o(2 * kDim);
  const DeviceBuffer<int32_t> slots = to_device(std::vector<int32_t>{0});
  EXPECT_THROW(kda_decode(dt.inputs, 1, 1, 64, 64, pool.get(), slots.get(), o.get(), nullptr), Error);
  EXPECT_THROW(kda_decode(dt.inputs, 1, 1, kDim, kDim, pool.get() + 1, slots.get(), o.get(), nullptr), Error);
  KdaInputs half_gate = dt.inputs;
  half_gate.dt_bias = nullptr;
  EXPECT_THROW(kda_decode(half_gate, 1, 1, kDim, kDim, pool.get(), slots.get(), o.get(), nullptr), Error);
  const std::vector<int64_t> cu = {0, 2}, start = {0};
  EXPECT_THROW(KdaPrefillPlan(cu, start, 100), Error);
  EXPECT_THROW(KdaPrefillPlan(std::vector<int64_t>{0, 2, 1}, std::vector<int64_t>{0, 0}), Error);
  const KdaPrefillPlan plan(cu, start);
  EXPECT_THROW(kda_prefill(plan, dt.inputs, 1, kDim, kDim, pool.get(), slots.get(), o.get(), nullptr, nullptr, 0,
                           nullptr),
               Error);
}

// The plan's chunk and checkpoint layout, worked by hand: a sequence resumed at position 100 with 200 tokens has
// chunks [100,128) [128,192) [192,256) [256,300) and, every 128, checkpoints after positions 127 and 255.
TEST(KdaPrefillPlan, ChunksAndCheckpointsAtAbsolutePositions) {
  const KdaPrefillPlan plan(std::vector<int64_t>{0, 5, 205}, std::vector<int64_t>{3, 100}, 128);
  ASSERT_EQ(plan.num_chunks(), 5);
  const auto& c = plan.chunks();
  EXPECT_EQ(c[0].t0, 0);
  EXPECT_EQ(c[0].n, 5);
  EXPECT_EQ(c[0].checkpoint, -1);
  const int64_t want_t0[] = {5, 33, 97, 161}, want_n[] = {28, 64, 64, 44}, want_ck[] = {0, -1, 1, -1};
  for (int i = 0; i < 4; ++i) {
    EXPECT_EQ(c[i + 1].t0, want_t0[i]) << i;
    EXPECT_EQ(c[i + 1].n, want_n[i]) << i;
    EXPECT_EQ(c[i + 1].seq, 1) << i;
    EXPECT_EQ(c[i + 1].checkpoint, want_ck[i]) << i;
  }
  EXPECT_EQ(plan.num_checkpoints(), 2);
  EXPECT_EQ(plan.checkpoints_of(0), 0);
  EXPECT_EQ(plan.checkpoints_of(1), 2);
  EXPECT_EQ(plan.first_checkpoint(1), 0);
}

}  // namespace
}  // namespace kestrel::cuda
