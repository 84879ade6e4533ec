#include "engine/scheduler.h"

#include <algorithm>
#include <limits>
#include <tuple>

#include "core/error.h"

namespace kestrel {

Scheduler::Scheduler(const SchedulerConfig& cfg, CacheManager& cache) : cfg_(cfg), cache_(cache) {
  KESTREL_CHECK(cfg.max_num_seqs >= 1, "max_num_seqs must be >= 1, got {}", cfg.max_num_seqs);
  KESTREL_CHECK(cfg.prefill_alignment >= 1, "prefill alignment must be >= 1");
  KESTREL_CHECK(cfg.max_num_batched_tokens >= cfg.prefill_alignment,
                "max_num_batched_tokens ({}) must be at least {}: prompts are cut only at multiples of the KDA chunk",
                cfg.max_num_batched_tokens, cfg.prefill_alignment);
  KESTREL_CHECK(cfg.checkpoint_interval >= 1, "the KDA checkpoint interval must be >= 1 block, got {}",
                cfg.checkpoint_interval);
  KESTREL_CHECK(cfg.long_prefill_token_threshold >= 0, "long_prefill_token_threshold must be >= 0, got {}",
                cfg.long_prefill_token_threshold);
  KESTREL_CHECK(cfg.max_itl_factor == 0 || cfg.max_itl_factor > 1,
                "max_itl_factor must be 0 (off) or greater than 1, got {}", cfg.max_itl_factor);
}

bool Scheduler::before(const Sequence* a, const Sequence* b) const {
  const Request& ra = *a->request;
  const Request& rb = *b->request;
  if (cfg_.policy == SchedulingPolicy::priority && ra.priority != rb.priority) return ra.priority < rb.priority;
  return std::tie(ra.arrival, a->index) < std::tie(rb.arrival, b->index);
}

void Scheduler::insert_sorted(std::vector<Sequence*>& q, Sequence* s) const {
  q.insert(std::upper_bound(q.begin(), q.end(), s, [&](const Sequence* x, const Sequence* y) { return before(x, y); }),
           s);
}

void Scheduler::add_waiting(Sequence* s) {
  s->status = Sequence::Status::waiting;
  insert_sorted(waiting_, s);
}

void Scheduler::add_running(Sequence* s) {
  s->status = Sequence::Status::running;
  s->admitted = admissions_++;
  if (cfg_.policy == SchedulingPolicy::priority) insert_sorted(running_, s);
  else running_.push_back(s);
}

void Scheduler::remove(Sequence* s) {
  for (auto* q : {&waiting_, &running_}) {
    const auto it = std::find(q->begin(), q->end(), s);
    if (it != q->end()) q->erase(it);
  }
  cache_.release(s->rows);
  s->status = Sequence::Status::finished;
}

int64_t Scheduler::reusable_end(const Sequence& s) const {
  return cfg_.prefill_alignment > 1 ? s.prompt_len : std::numeric_limits<int64_t>::max();
}

int64_t Scheduler::tokens_to_run(const Sequence& s, int64_t start, int64_t budget) const {
  const int64_t known = static_cast<int64_t>(s.tokens.size());
  int64_t end = std::min(known, start + budget);
  if (cfg_.prefill_alignment > 1 && start < s.prompt_len) {
    // Chunked KDA: a prompt segment stops at the prompt's end or at a multiple of the chunk.
    end = std::min(end, s.prompt_len);
    if (end < s.prompt_len) end = end / cfg_.prefill_alignment * cfg_.prefill_alignment;
  }
  return std::max<int64_t>(end - start, 0);
}

void Scheduler::add_drafts(StepPlan& plan, int64_t& budget) {
  for (ScheduledSequence& x : plan.seqs) {
    Sequence& s = *x.seq;
    if (s.drafts.empty()) continue;
    const int64_t L = static_cast<int64_t>(s.tokens.size());
    int m = static_cast<int>(std::min<int64_t>(static_cast<int64_t>(s.drafts.size()), budget));
    if (x.count != 1 || x.start + 1 != L || L <= s.prompt_len) m = 0;  // only a plain decode step verifies
    // Token rows for the drafts' positions: those held, then only rows nobody holds; then a state slot per draft.
    while (m > 0 && !cache_.grow(s.rows, L + m)) --m;
    if (m > 0) m = std::min(m, cache_.reserve_spec_slots(s.rows, m));
    if (m > 0) {
      const size_t V = s.draft_probs.size() / s.drafts.size();
      s.tokens.insert(s.tokens.end(), s.drafts.begin(), s.drafts.begin() + m);
      s.draft_probs.resize(V * static_cast<size_t>(m));
      s.num_draft = m;
      x = make_step(&s, x.start, 1 + m);
      budget -= m;
    } else {
      s.draft_probs.clear();
    }
    s.drafts.clear();
  }
}

ScheduledSequence Scheduler::make_step(Sequence* s, int64_t start, int64_t count) const {
  ScheduledSequence x;
  x.seq = s;
  x.start = start;
  x.count = count;
  x.prompt = start < s->prompt_len && s->prompt_len > 1;
  if (s->num_draft > 0) {
    KESTREL_CHECK(count == 1 + s->num_draft && start + count == static_cast<int64_t>(s->tokens.size()),
                  "a verification step of {} tokens for {} drafts", count, s->num_draft);
    x.num_draft = s->num_draft;
    x.logits_from = 0;
    const int G = cache_.plan().state_rows_per_request;
    for (int j = 0; G > 0 && j < s->num_draft; ++j)
      x.spec_slots.push_back({start + 1 + j, std::vector<int32_t>(s->rows.spec_rows.begin() + j * G,
                                                                  s->rows.spec_rows.begin() + (j + 1) * G)});
    return x;
  }
  const bool samples = start + count == static_cast<int64_t>(s->tokens.size()) && s->request->params.max_tokens > 0;
  // The logits of position q give the log-probability of token q + 1: scoring from token t needs rows from t - 1.
  x.logits_from = samples ? count - 1 : count;
  if (s->scored_until < s->prompt_len)
    x.logits_from = std::min(x.logits_from, std::clamp<int64_t>(s->scored_until - 1 - start, 0, count));
  if (s->request->keep_logits)
    x.logits_from = std::min(x.logits_from, std::clamp<int64_t>(s->logits_kept - start, 0, count));
  return x;
}

void Scheduler::preempt(Sequence* s) {
  s->drafts.clear();
  s->draft_probs.clear();
  running_.erase(std::find(running_.begin(), running_.end(), s));
  cache_.release(s->rows);
  s->num_computed = 0;
  add_waiting(s);
  ++preemptions_;
}

int64_t Scheduler::segment_budget(int64_t left, int64_t budget, int64_t prompt_budget) const {
  if (left <= 1) return budget;
  int64_t b = std::min(budget, prompt_budget);
  if (cfg_.long_prefill_token_threshold > 0) b = std::min(b, cfg_.long_prefill_token_threshold);
  return b;
}

StepPlan Scheduler::schedule() {
  StepPlan plan;
  int64_t budget = cfg_.max_num_batched_tokens;
  // The prompt share beside running decodes (rows with one token to compute), from the measured step costs.
  int64_t decodes = 0;
  for (const Sequence* s : running_)
    if (static_cast<int64_t>(s->tokens.size()) - s->num_computed == 1) ++decodes;
  last_allowance_ = -1;
  if (decodes > 0 && cfg_.max_itl_factor > 1) {
    if (!costs_.knows_decode(decodes)) {
      last_allowance_ = 0;  // a step of the decodes alone measures them (at most two per bucket of rows)
    } else {
      // Unknown prompt cost: the floor, whose step then teaches it.
      last_allowance_ = std::max<int64_t>({costs_.prompt_allowance(decodes, cfg_.max_itl_factor), kMinPromptChunk,
                                           cfg_.prefill_alignment});
    }
  }
  int64_t prompt_budget = last_allowance_ >= 0 ? last_allowance_ : std::numeric_limits<int64_t>::max();
  bool preempted = false;
  for (size_t i = 0; i < running_.size() && budget > 0;) {
    Sequence* s = running_[i];
    const int64_t left = static_cast<int64_t>(s->tokens.size()) - s->num_computed;
    const int64_t n = tokens_to_run(*s, s->num_computed, segment_budget(left, budget, prompt_budget));
    if (n == 0) {
      ++i;
      continue;
    }
    // Out of rows: recompute the sequence scheduled last later (the newest, or the lowest priority), until this
    // one fits or is itself the one preempted. Sequences before i are never victims.
    bool fits = true;
    while (!cache_.grow(s->rows, s->num_computed + n)) {
      Sequence* victim = running_.back();
      preempt(victim);
      preempted = true;
      ++plan.num_preempted;
      if (victim == s) {
        fits = false;
        break;
      }
    }
    if (!fits) break;
    plan.seqs.push_back(make_step(s, s->num_computed, n));
    budget -= n;
    if (left > 1) prompt_budget -= n;
    ++i;
  }
  // Drafts are best effort: after every running sequence got its share, never preempting, cut to what is left.
  add_drafts(plan, budget);
  for (Sequence* s : running_)
    if (!s->drafts.empty()) {  // got no part of the step
      s->drafts.clear();
      s->draft_probs.clear();
    }
  // A step that had to preempt admits nobody: the rows it freed go to the sequences already running.
  if (!preempted) admit_waiting(plan, budget, prompt_budget);
  add_checkpoints(plan);
  for (const ScheduledSequence& x : plan.seqs) plan.num_tokens += x.count;
  return plan;
}

void Scheduler::admit_waiting(StepPlan& plan, int64_t& budget, int64_t& prompt_budget) {
  while (!waiting_.empty() && budget > 0 && num_running() < cfg_.max_num_seqs) {
    Sequence* s = waiting_.front();
    const int64_t known = static_cast<int64_t>(s->tokens.size());
    // At least one token is computed, so that the step yields the logits to sample from.
    // A position to score is computed: its logits are never in the cache.
    int64_t limit = std::min(known - 1, reusable_end(*s));
    if (s->scored_until < s->prompt_len) limit = std::min(limit, s->scored_until - 1);
    const PrefixHit hit = cache_.lookup(s->rows, s->tokens, limit, s->request->cache_key);
    const int64_t left = known - hit.tokens;
    const int64_t n = tokens_to_run(*s, hit.tokens, segment_budget(left, budget, prompt_budget));
    if (n == 0 || !cache_.admit(s->rows, hit, hit.tokens + n, plan.ops, plan.pins)) break;
    if (left > 1) prompt_budget -= n;
    cache_.record_lookup(hit, known);
    s->num_computed = hit.tokens;
    waiting_.erase(waiting_.begin());
    add_running(s);
    plan.seqs.push_back(make_step(s, hit.tokens, n));
    budget -= n;
  }
}

void Scheduler::add_checkpoints(StepPlan& plan) {
  const CachePlan& cp = cache_.plan();
  if (!cache_.prefix_caching() || !cp.has_state()) return;
  const int64_t B = cp.block_size;
  for (ScheduledSequence& x : plan.seqs) {
    Sequence& s = *x.seq;
    const int64_t last = std::min(x.start + x.count, reusable_end(s)) / B;
    for (int64_t k = x.start / B + 1; k <= last; ++k) {
      if (k % cfg_.checkpoint_interval) continue;
      cache_.hash_blocks(s.rows, s.tokens, k, s.request->cache_key);
      if (cache_.has_checkpoint(s.rows.hashes[k - 1])) continue;
      std::vector<int32_t> rows = cache_.allocate_checkpoint();
      if (rows.empty()) return;  // no row to spare: checkpoints never cost a running sequence its rows
      x.checkpoints.push_back({k * B, std::move(rows)});
    }
  }
}

void Scheduler::observe(const StepPlan& plan, double seconds) {
  int64_t decode_rows = 0, prompt_tokens = 0;
  for (const ScheduledSequence& x : plan.seqs) {
    if (x.count - x.num_draft == 1) ++decode_rows;  // a verification step counts as its decode row
    else prompt_tokens += x.count;
  }
  costs_.observe(decode_rows, prompt_tokens, seconds);
}

void Scheduler::commit(const StepPlan& plan) {
  const int64_t B = cache_.plan().block_size;
  const int G = cache_.plan().state_rows_per_request;
  for (const ScheduledSequence& x : plan.seqs) {
    Sequence& s = *x.seq;
    KESTREL_CHECK(x.rejected >= 0 && x.rejected <= x.num_draft, "{} of {} drafts rejected", x.rejected, x.num_draft);
    s.num_computed = x.start + x.count - x.rejected;
    if (x.rejected > 0) {
      // The state after the last kept position is in its slot: it becomes the sequence's state (row ids swap; the
      // recurrence is never undone). Hashes of blocks holding rejected drafts are forgotten.
      const int slot = x.num_draft - static_cast<int>(x.rejected);
      for (int g = 0; g < G; ++g) std::swap(s.rows.state_rows[g], s.rows.spec_rows[slot * G + g]);
      s.rows.hashes.resize(std::min<size_t>(s.rows.hashes.size(), static_cast<size_t>(s.num_computed / B)));
    }
    // The slots go back: held across steps they would keep rows from sequences that need them.
    if (x.num_draft > 0) cache_.release_spec_slots(s.rows);
    const int64_t full = s.num_computed / B;
    cache_.name_blocks(s.rows, s.tokens, std::min(full, reusable_end(s) / B), s.request->cache_key);
    cache_.skip_blocks(s.rows, full);
    for (const ScheduledSequence::Checkpoint& c : x.checkpoints) {
      if (c.position <= s.num_computed) cache_.commit_checkpoint(s.rows, s.tokens, c.position / B - 1, c.rows);
      else cache_.unpin(c.rows);  // after a rejected draft: a state the sequence does not have
    }
  }
  cache_.unpin(plan.pins);
}

}  // namespace kestrel
