// CPU cost of the engine's bookkeeping per step, without the model: Scheduler::schedule (budget, admission with
// prefix-cache lookups, row allocation, preemption, KDA checkpoints), step_inputs (block tables into slots and
// page views for the kernels) and Scheduler::commit (naming full blocks and checkpoints), plus the engine's
// per-token update (append the sampled token, finish, admit replacements). Sampling itself is not included: it
// runs on the logits where they are (on the GPU, for a GPU backend).
//
// The cache is laid out as K3.1 Pro's at TP8 (93 layers: 24 attention, 69 KDA; B = 128; one KDA layer per state
// row, so 69 state rows per request) with the bytes of every page shrunk to keep the pool small: the bookkeeping
// does not depend on row size.
#include <algorithm>
#include <chrono>
#include <ctime>
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "cache/cache_manager.h"
#include "engine/step_inputs.h"
#include "engine/scheduler.h"

using namespace kestrel;

// Thread CPU time: the machine this runs on may be shared, and time the thread spends descheduled is not work.
struct CpuClock {
  using duration = std::chrono::nanoseconds;
  using time_point = std::chrono::time_point<CpuClock>;
  static time_point now() {
    timespec ts;
    clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts);
    return time_point(duration(int64_t{ts.tv_sec} * 1000000000 + ts.tv_nsec));
  }
};
using Clock = CpuClock;

namespace {

struct Scenario {
  const char* name;
  int running = 256;
  int64_t system_prompt = 1024;  // shared by every request: prefix-cache hits
  int64_t prompt = 2048;
  int min_tokens = 1 << 20, max_tokens = 1 << 20;  // a finished request is replaced by a new one
  int alignment = 64;                               // 64: chunked KDA prefill; 1: recurrent (decode checkpoints)
  int64_t budget = 8192;
  int steps = 2000;
};

struct Timing {
  std::vector<double> total, schedule, inputs, commit, update;
  std::vector<int64_t> tokens;
};

double us(Clock::duration d) { return std::chrono::duration<double, std::micro>(d).count(); }

double percentile(std::vector<double> v, double q) {
  std::sort(v.begin(), v.end());
  return v[static_cast<size_t>(q * (v.size() - 1))];
}
double mean(const std::vector<double>& v) {
  double s = 0;
  for (double x : v) s += x;
  return s / v.size();
}

void run(const Scenario& sc) {
  constexpr int B = 128;
  std::vector<LayerCacheSpec> layers;
  for (int l = 0; l < 93; ++l)
    layers.push_back(l % 4 == 3 || l == 92 ? LayerCacheSpec{1, 0, 0} : LayerCacheSpec{0, 0, B * 24});
  const CachePlan plan = plan_cache(layers, {.block_size = B, .min_block_size = 64});
  const int64_t per_request = plan.rows_per_request(sc.prompt + sc.max_tokens);
  const int32_t rows = static_cast<int32_t>(std::min<int64_t>(per_request, 69 + (sc.prompt + 4096) / B) *
                                            sc.running * 3 / 2);
  CacheManager cache(plan, rows, true);
  Scheduler sched(SchedulerConfig{sc.budget, sc.running, SchedulingPolicy::fcfs, sc.alignment, 1}, cache);

  std::mt19937 rng(1);
  std::vector<int32_t> system(sc.system_prompt);
  for (auto& t : system) t = static_cast<int32_t>(rng() % 160000);
  std::vector<std::unique_ptr<Request>> requests;
  int64_t next_id = 0;
  SamplingParams params;
  auto add = [&] {
    auto r = std::make_unique<Request>();
    r->id = r->arrival = next_id++;
    r->prompt = system;
    for (int64_t i = sc.system_prompt; i < sc.prompt; ++i) r->prompt.push_back(static_cast<int32_t>(rng() % 160000));
    r->params = params;
    r->params.max_tokens = sc.min_tokens + static_cast<int>(rng() % (sc.max_tokens - sc.min_tokens + 1));
    r->seqs.push_back(std::make_unique<Sequence>(r.get(), 0, r->prompt, sc.prompt, Sampler(r->params, {}, 0)));
    sched.add_waiting(r->seqs[0].get());
    requests.push_back(std::move(r));
  };
  for (int i = 0; i < sc.running; ++i) add();

  Timing tm;
  int64_t finished = 0;
  auto step = [&](bool record) {
    const auto t0 = Clock::now();
    const StepPlan p = sched.schedule();
    const auto t1 = Clock::now();
    const StepInputs in = step_inputs(p, B);
    const auto t2 = Clock::now();
    sched.commit(p);
    const auto t3 = Clock::now();
    for (const ScheduledSequence& x : p.seqs) {
      Sequence& s = *x.seq;
      if (x.start + x.count < static_cast<int64_t>(s.tokens.size())) continue;
      s.tokens.push_back(static_cast<int32_t>(rng() % 160000));
      if (s.num_generated() >= s.request->params.max_tokens) {
        sched.remove(&s);
        ++finished;
        add();
      }
    }
    const auto t4 = Clock::now();
    if (!record) return p;
    tm.schedule.push_back(us(t1 - t0));
    tm.inputs.push_back(us(t2 - t1));
    tm.commit.push_back(us(t3 - t2));
    tm.update.push_back(us(t4 - t3));
    tm.total.push_back(us(t4 - t0));
    tm.tokens.push_back(p.num_tokens);
    if (in.steps.size() != p.seqs.size()) std::abort();
    return p;
  };
  // Warm up until every request has finished its prompt and decodes.
  while (sched.num_waiting() > 0 || std::any_of(sched.running().begin(), sched.running().end(), [](const Sequence* s) {
           return s->num_computed < s->prompt_len;
         }))
    step(false);
  for (int i = 0; i < sc.steps; ++i) step(true);

  int64_t tokens = 0;
  for (int64_t t : tm.tokens) tokens += t;
  const PrefixCacheCounters& c = cache.prefix_cache().counters();
  std::printf("%-34s %5d %6.1f | %7.1f %7.1f %7.1f | %6.1f %6.1f %6.1f %6.1f | %6lld %7lld %6lld %6lld\n", sc.name,
              sc.running, static_cast<double>(tokens) / sc.steps, mean(tm.total), percentile(tm.total, 0.5),
              percentile(tm.total, 0.99), mean(tm.schedule), mean(tm.inputs), mean(tm.commit), mean(tm.update),
              static_cast<long long>(finished), static_cast<long long>(c.hit_tokens),
              static_cast<long long>(c.checkpoints_taken), static_cast<long long>(sched.num_preemptions()));
  std::printf("%-34s p99 per part: sched %.1f, inputs %.1f, commit %.1f, update %.1f; slowest step %.1f\n", "",
              percentile(tm.schedule, 0.99), percentile(tm.inputs, 0.99), percentile(tm.commit, 0.99),
              percentile(tm.update, 0.99), percentile(tm.total, 1.0));
}

}  // namespace

int main() {
  std::printf("%-34s %5s %6s | %7s %7s %7s | %6s %6s %6s %6s | %6s %7s %6s %6s\n", "scenario (CPU us per step)",
              "seqs", "tok", "mean", "p50", "p99", "sched", "inputs", "commit", "update", "done", "hit tok", "ckpts",
              "preempt");
  run({.name = "decode, 2K context"});
  run({.name = "decode, 32K context", .system_prompt = 1024, .prompt = 32768, .steps = 1000});
  run({.name = "churn: 64-512 tokens, 1K shared", .min_tokens = 64, .max_tokens = 512});
  run({.name = "churn, recurrent KDA (decode ckpts)", .min_tokens = 64, .max_tokens = 512, .alignment = 1});
  return 0;
}
