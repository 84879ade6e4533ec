#include "engine/engine.h"

#include <algorithm>
#include <chrono>
#include <climits>

#include "core/error.h"

namespace kestrel {

const char* finish_reason_name(FinishReason r) {
  switch (r) {
    case FinishReason::none: return "none";
    case FinishReason::stop: return "stop";
    case FinishReason::length: return "length";
    case FinishReason::abort: return "abort";
  }
  return "?";
}

namespace {

// The config's context length (ModelConfig::context_length), capped by --max-model-len.
int64_t model_max_len(const Model& model, const EngineConfig& cfg) {
  const ModelConfig& c = model.config();
  const int64_t model_max = c.context_length;
  KESTREL_CHECK(cfg.max_model_len >= 0, "--max-model-len must be >= 0, got {}", cfg.max_model_len);
  KESTREL_CHECK(model_max <= 0 || cfg.max_model_len <= model_max,
                "--max-model-len {} is beyond the model's context length {} (config.json '{}')", cfg.max_model_len,
                model_max, c.context_length_key);
  KESTREL_CHECK(cfg.max_model_len > 0 || model_max > 0,
                "config.json gives no context length (max_position_embeddings, model_max_length, max_seq_len, "
                "seq_length or max_sequence_length): pass --max-model-len");
  return cfg.max_model_len ? cfg.max_model_len : model_max;
}

CachePlan plan_for(const Model& model, const EngineConfig& cfg) {
  const int min_block = std::max(16, model.prefill_alignment());
  return plan_cache(model.cache_specs(), {.block_size = cfg.block_size,
                                          .min_block_size = min_block,
                                          .max_block_size = std::max(min_block, cfg.max_block_size),
                                          .max_model_len = model_max_len(model, cfg)});
}

int32_t pool_rows(const CachePlan& plan, const EngineConfig& cfg) {
  const int64_t rows = cfg.num_rows ? cfg.num_rows : cfg.cache_bytes / plan.row_bytes;
  KESTREL_CHECK(rows >= 1 + plan.state_rows_per_request && rows <= INT32_MAX,
                "a cache of {} rows of {} bytes cannot hold a sequence ({} state rows + 1 token row)", rows,
                plan.row_bytes, plan.state_rows_per_request);
  return static_cast<int32_t>(rows);
}

// An explicit max_model_len must fit in the cache; without one it is the model's, capped at what the cache holds.
int64_t resolve_max_model_len(const Model& model, const EngineConfig& cfg, const CachePlan& plan, int32_t rows) {
  const int64_t fits = (rows - plan.state_rows_per_request) * int64_t{plan.block_size};
  const int64_t len = model_max_len(model, cfg);
  if (cfg.max_model_len == 0) return len > 0 ? std::min(len, fits) : fits;
  KESTREL_CHECK(plan.rows_per_request(len) <= rows,
                "max_model_len {} needs {} rows of {} bytes ({} tokens per row, {} state rows per sequence), the cache "
                "has {}; lower max_model_len to at most {} or give the cache more memory",
                len, plan.rows_per_request(len), plan.row_bytes, plan.block_size, plan.state_rows_per_request, rows,
                fits);
  return len;
}

}  // namespace

CachePlan engine_plan(const Model& model, const EngineConfig& cfg) { return plan_for(model, cfg); }

Engine::Engine(const Model& model, const EngineConfig& cfg)
    : model_(model),
      cfg_(cfg),
      cache_(plan_for(model, cfg), pool_rows(plan_for(model, cfg), cfg), cfg.enable_prefix_caching,
             !cfg.executor || cfg.executor_on_host_pool),
      max_model_len_(resolve_max_model_len(model, cfg, cache_.plan(), cache_.pool().num_rows())),
      scheduler_(SchedulerConfig{cfg.max_num_batched_tokens, cfg.max_num_seqs, cfg.policy, model.prefill_alignment(),
                                 cfg.checkpoint_interval, cfg.long_prefill_token_threshold, cfg.max_itl_factor},
                 cache_),
      runner_(cfg.executor ? cfg.executor(model, cache_) : std::make_unique<ModelRunner>(model, cache_)) {
  if (cfg_.speculative) {
    validate_speculative_config(*cfg_.speculative);
    drafter_ = cfg_.drafter ? cfg_.drafter : make_drafter(*cfg_.speculative, model_);
    const std::vector<int> layers = drafter_->hidden_layers();
    if (!layers.empty()) runner_->keep_hidden(layers);
    hidden_width_ = static_cast<int64_t>(layers.size()) * model_.config().hidden_size;
    stats_.spec.accepted_per_pos.assign(static_cast<size_t>(cfg_.speculative->num_speculative_tokens), 0);
  } else {
    KESTREL_CHECK(!cfg_.drafter, "a drafter without a speculative config (num_speculative_tokens)");
  }
}

void Engine::propose_drafts() {
  const int64_t V = model_.config().vocab_size;
  const int k = cfg_.speculative->num_speculative_tokens;
  for (Sequence* s : scheduler_.running()) {
    const int64_t L = static_cast<int64_t>(s->tokens.size());
    // Only a sequence that decodes next (its last token sampled, everything before it computed) drafts; one that
    // keeps its logits decodes one token at a time.
    if (s->num_draft != 0 || !s->drafts.empty() || s->num_computed != L - 1 || L <= s->prompt_len) continue;
    const Request& r = *s->request;
    if (r.keep_logits) continue;
    const int most = std::min<int64_t>(k, r.params.max_tokens - s->num_generated() - 1);
    if (most <= 0) continue;
    draft_.tokens.clear();
    draft_.probs.clear();
    drafter_->propose(*s, most, V, draft_);
    int m = static_cast<int>(std::min<size_t>(draft_.tokens.size(), static_cast<size_t>(most)));
    // With a grammar, drafts after one outside it (or after its end) are never verified.
    if (s->constraint && m > 0)
      m = static_cast<int>(grammar_draft_prefix(*s->constraint, std::span(draft_.tokens).first(static_cast<size_t>(m))));
    if (m == 0) continue;
    KESTREL_CHECK(draft_.probs.empty() || static_cast<int64_t>(draft_.probs.size()) >= m * V,
                  "a drafter gave {} draft probabilities for {} drafts of vocabulary {}", draft_.probs.size(), m, V);
    for (int i = 0; i < m; ++i)
      KESTREL_CHECK(draft_.tokens[i] >= 0 && draft_.tokens[i] < V, "draft token {} is outside the vocabulary (0..{})",
                    draft_.tokens[i], V - 1);
    s->drafts.assign(draft_.tokens.begin(), draft_.tokens.begin() + m);
    if (!draft_.probs.empty()) s->draft_probs.assign(draft_.probs.begin(), draft_.probs.begin() + m * V);
    else s->draft_probs.clear();
  }
}

RequestId Engine::add_request(std::vector<int32_t> prompt, const SamplingParams& params, int priority,
                              bool keep_logits, uint64_t cache_key) {
  const int64_t V = model_.config().vocab_size, P = static_cast<int64_t>(prompt.size());
  KESTREL_CHECK(P >= 1, "a request needs at least one prompt token");
  for (int32_t t : prompt) KESTREL_CHECK(t >= 0 && t < V, "prompt token id {} is outside the vocabulary (0..{})", t, V - 1);
  params.validate(V);
  KESTREL_CHECK(params.max_tokens > 0 || params.prompt_logprobs_start < P,
                "a request that only scores its prompt must score at least one token: prompt_logprobs_start {} is not "
                "before the prompt's end ({} tokens)",
                params.prompt_logprobs_start, P);
  KESTREL_CHECK(P + params.max_tokens <= max_model_len_,
                "request of {} prompt tokens + max_tokens {} exceeds max_model_len {} (what the cache holds for one "
                "sequence)",
                P, params.max_tokens, max_model_len_);
  KESTREL_CHECK(params.lora_id >= 0, "lora_id must be >= 0, got {}", params.lora_id);
  KESTREL_CHECK(params.lora_id == 0 || model_.has_lora(params.lora_id), "LoRA adapter {} is not loaded",
                params.lora_id);
  auto r = std::make_unique<Request>();
  r->id = next_id_++;
  r->params = params;
  r->priority = priority;
  // Prefixes are shared only among requests of the same adapter weights (the key changes when they are reloaded).
  r->cache_key = cache_key ^ (model_.lora_key(params.lora_id) * 0x9E3779B97F4A7C15ull);
  r->keep_logits = keep_logits;
  r->arrival = r->id;
  r->prompt = std::move(prompt);
  r->seqs.push_back(std::make_unique<Sequence>(r.get(), 0, r->prompt, P, Sampler(params, r->prompt, 0)));
  r->seqs[0]->scored_until = params.scores_prompt() ? std::min(params.prompt_logprobs_start, P) : P;
  if (params.constraint) r->seqs[0]->constraint.emplace(params.constraint);
  scheduler_.add_waiting(r->seqs[0].get());
  const RequestId id = r->id;
  requests_.emplace(id, std::move(r));
  return id;
}

RequestOutput Engine::abort(RequestId id) {
  const auto it = requests_.find(id);
  KESTREL_CHECK(it != requests_.end(), "no unfinished request {}", id);
  for (auto& s : it->second->seqs)
    if (s->status != Sequence::Status::finished) {
      scheduler_.remove(s.get());
      s->finish = FinishReason::abort;
    }
  if (drafter_)
    for (const auto& s : it->second->seqs) drafter_->release(*s);
  RequestOutput out = collect(*it->second);
  requests_.erase(it);
  return out;
}

void Engine::finish_if_done(Sequence& s, int32_t token) {
  const SamplingParams& p = s.request->params;
  const auto& stops = p.stop_token_ids;
  if (std::find(stops.begin(), stops.end(), token) != stops.end() ||
      (!p.ignore_eos && token == model_.config().eos_token_id))
    s.finish = FinishReason::stop;
  else if (s.num_generated() >= p.max_tokens)
    s.finish = FinishReason::length;
  else
    return;
  scheduler_.remove(&s);
}

void Engine::sample(Sequence& s, const float* logits, StepOutput& out) {
  const bool want_logprobs = s.request->params.logprobs >= 0;
  TokenLogprob lp;
  std::vector<uint32_t> mask;
  if (s.constraint) {
    mask.resize(static_cast<size_t>(s.constraint->mask_words()));
    s.constraint->fill_mask(mask);
  }
  const int32_t token = s.sampler.sample(logits, model_.config().vocab_size, want_logprobs ? &lp : nullptr, mask);
  record(s, token, want_logprobs ? &lp : nullptr, out);
}

void Engine::record(Sequence& s, int32_t token, TokenLogprob* logprob, StepOutput& out) {
  if (s.constraint)
    KESTREL_CHECK(s.constraint->accept_token(token), "request {}: token {} is outside its grammar's mask",
                  s.request->id, token);
  if (logprob) s.logprobs.push_back(std::move(*logprob));
  s.tokens.push_back(token);
  out.tokens.push_back({s.request->id, s.index, token});
  ++stats_.generated_tokens;
  if (s.constraint && s.constraint->terminated() && s.status != Sequence::Status::finished) {
    // The grammar is complete and ended (a stop token), whatever ignore_eos says: nothing may follow.
    s.finish = FinishReason::stop;
    scheduler_.remove(&s);
    return;
  }
  finish_if_done(s, token);
}

// The other n - 1 completions start from the parent's prompt rows: full blocks shared, the partial block and the
// states copied. A child that finds no row (or no sequence slot) waits and recomputes its prompt, which gives the
// same bits.
void Engine::fork(Sequence& parent, const float* logits, StepOutput& out) {
  Request& r = *parent.request;
  r.forked = true;
  for (int i = 1; i < r.params.n; ++i) {
    auto child = std::make_unique<Sequence>(&r, i, parent.tokens, parent.prompt_len, Sampler(r.params, r.prompt, i));
    child->scored_until = parent.prompt_len;
    child->constraint = parent.constraint;  // the parent has not sampled yet: the grammar's start
    child->logits = parent.logits;
    child->logits_first = parent.logits_first;
    child->logits_kept = parent.logits_kept;
    std::vector<RowOp> ops;
    if (scheduler_.num_running() < cfg_.max_num_seqs &&
        cache_.fork(parent.rows, parent.num_computed, child->rows, ops)) {
      runner_->apply(ops);
      child->num_computed = parent.num_computed;
      scheduler_.add_running(child.get());
    } else {
      scheduler_.add_waiting(child.get());
    }
    Sequence& c = *child;
    r.seqs.push_back(std::move(child));
    sample(c, logits, out);
  }
}

bool Engine::samples_on_executor(const StepPlan& plan) const {
  bool any = false;
  for (const ScheduledSequence& x : plan.seqs) {
    const Sequence& s = *x.seq;
    // Prompt log-probabilities are taken on the host, from the logits (token_logprob); a request that only scores
    // ends there too.
    if (s.request->keep_logits || s.scored_until < s.prompt_len || s.request->params.max_tokens == 0) return false;
    if (x.num_draft > 0) return false;  // verification runs on the host, over every position's logits
    if (x.start + x.count < static_cast<int64_t>(s.tokens.size())) continue;  // samples nothing this step
    if (s.index == 0 && !s.request->forked && s.request->params.n > 1) return false;
    if (!runner_->samples(s.request->params)) return false;
    if (s.constraint && !runner_->applies_token_masks()) return false;
    any = true;
  }
  // A step that samples nothing (prompt chunks, recomputed tokens) runs as any other.
  return any;
}

void Engine::observe_step(const StepPlan& plan, std::chrono::steady_clock::time_point start) {
  const double measured = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  scheduler_.observe(plan, cfg_.step_seconds ? cfg_.step_seconds(plan, measured) : measured);
}

StepOutput Engine::step() {
  StepOutput out;
  if (drafter_) propose_drafts();
  StepPlan plan = scheduler_.schedule();
  KESTREL_CHECK(!plan.seqs.empty() || scheduler_.idle(),
                "no sequence could be scheduled although {} wait and {} run", scheduler_.num_waiting(),
                scheduler_.num_running());
  std::vector<RequestId> touched;
  if (!plan.seqs.empty() && samples_on_executor(plan)) {
    // The executor chooses the tokens where the logits are; each sequence's sampler supplies its uniform and
    // penalties and counts the token, exactly as Sampler::sample would.
    std::vector<SampleRow> rows;
    std::vector<Sequence*> sampled;
    std::vector<std::vector<uint32_t>> masks;
    int64_t row = 0;
    for (const ScheduledSequence& x : plan.seqs) {
      Sequence& s = *x.seq;
      row += x.count - x.logits_from;
      if (x.start + x.count < static_cast<int64_t>(s.tokens.size())) continue;
      rows.push_back({row - 1, &s.request->params, s.sampler.draw_uniform(), s.sampler.penalty_tokens(), {}});
      sampled.push_back(&s);
      masks.emplace_back();
      if (s.constraint) {
        masks.back().resize(static_cast<size_t>(s.constraint->mask_words()));
        s.constraint->fill_mask(masks.back());
      }
    }
    for (size_t i = 0; i < rows.size(); ++i) rows[i].token_mask = masks[i];
    const auto t0 = std::chrono::steady_clock::now();
    std::vector<SampledToken> tokens = runner_->execute_sampled(plan, rows);
    observe_step(plan, t0);
    scheduler_.commit(plan);
    KESTREL_CHECK(tokens.size() == sampled.size(), "the executor sampled {} rows of {}", tokens.size(), sampled.size());
    for (size_t i = 0; i < sampled.size(); ++i) {
      Sequence& s = *sampled[i];
      s.sampler.accept(tokens[i].token);
      record(s, tokens[i].token, s.request->params.logprobs >= 0 ? &tokens[i].logprob : nullptr, out);
      touched.push_back(s.request->id);
    }
    return finish_step(plan, touched, std::move(out));
  }
  const auto t0 = std::chrono::steady_clock::now();
  const std::vector<float>& logits = runner_->execute(plan);
  observe_step(plan, t0);
  const int64_t V = model_.config().vocab_size;
  // Verification first: it decides how many of a sequence's positions the commit keeps.
  std::vector<VerifyResult> verified(plan.seqs.size());
  {
    int64_t row = 0;
    for (size_t i = 0; i < plan.seqs.size(); ++i) {
      ScheduledSequence& x = plan.seqs[i];
      const float* first = logits.data() + row * V;
      row += x.count - x.logits_from;
      if (x.num_draft == 0) continue;
      Sequence& s = *x.seq;
      const SpeculativeConfig& sc = *cfg_.speculative;
      VerifyOptions opt{sc.rejection_sample_method == "synthetic", sc.synthetic_acceptance_rates, {}};
      const std::span<const int32_t> drafts = std::span(s.tokens).subspan(x.start + 1, x.num_draft);
      std::vector<std::vector<uint32_t>> masks;
      if (s.constraint) opt.masks = masks = grammar_draft_masks(*s.constraint, drafts);
      verified[i] = verify_draft(s.sampler, first, V, drafts, s.draft_probs, s.request->params.logprobs >= 0, opt);
      const int a = verified[i].accepted;
      x.rejected = x.num_draft - a;
      ++stats_.spec.num_drafts;
      stats_.spec.num_draft_tokens += x.num_draft;
      stats_.spec.num_accepted_tokens += a;
      for (int j = 0; j < a; ++j) ++stats_.spec.accepted_per_pos[static_cast<size_t>(j)];
    }
  }
  scheduler_.commit(plan);
  if (hidden_width_ > 0) {
    // The drafter sees the hidden states of the positions the step kept.
    const std::vector<float>& hidden = runner_->hidden();
    int64_t token = 0;
    for (const ScheduledSequence& x : plan.seqs) {
      drafter_->observe(*x.seq, x.start, x.count - x.rejected, hidden.data() + token * hidden_width_);
      token += x.count;
    }
  }
  int64_t row = 0;
  for (size_t i = 0; i < plan.seqs.size(); ++i) {
    const ScheduledSequence& x = plan.seqs[i];
    Sequence& s = *x.seq;
    const int64_t rows = x.count - x.logits_from;
    const float* first = logits.data() + row * V;
    row += rows;
    if (x.num_draft > 0) {
      // The kept drafts and the target's own token, in order, each checked for the end as if sampled alone.
      touched.push_back(s.request->id);
      s.tokens.resize(static_cast<size_t>(x.start + 1));
      s.num_draft = 0;
      s.draft_probs.clear();
      VerifyResult& v = verified[i];
      for (size_t j = 0; j < v.tokens.size() && s.status != Sequence::Status::finished; ++j)
        record(s, v.tokens[j], v.logprobs.empty() ? nullptr : &v.logprobs[j], out);
      continue;
    }
    if (s.request->keep_logits && rows > 0) {
      if (s.logits.empty()) s.logits_first = x.start + x.logits_from;
      s.logits.insert(s.logits.end(), first, first + rows * V);
      s.logits_kept = x.start + x.count;
    }
    if (s.scored_until < s.prompt_len) score_prompt(s, x, first);
    if (x.start + x.count < static_cast<int64_t>(s.tokens.size())) continue;
    touched.push_back(s.request->id);
    if (s.request->params.max_tokens == 0) {  // scored its prompt; generates nothing
      s.finish = FinishReason::length;
      scheduler_.remove(&s);
      continue;
    }
    const float* last = first + (rows - 1) * V;
    if (s.index == 0 && !s.request->forked && s.request->params.n > 1) fork(s, last, out);
    sample(s, last, out);
  }
  return finish_step(plan, touched, std::move(out));
}

void Engine::score_prompt(Sequence& s, const ScheduledSequence& x, const float* logits) {
  const int64_t V = model_.config().vocab_size;
  Request& r = *s.request;
  for (int64_t row = x.logits_from; row < x.count; ++row) {
    const int64_t next = x.start + row + 1;  // the token these logits predict
    if (next != s.scored_until || next >= s.prompt_len) continue;
    TokenLogprob lp;
    token_logprob(logits + (row - x.logits_from) * V, V, s.tokens[next], r.params.prompt_logprobs, lp);
    r.prompt_logprobs.push_back(std::move(lp));
    ++s.scored_until;
  }
}

bool Engine::reset_prefix_cache() {
  if (has_unfinished()) return false;
  cache_.pool().evict_idle();
  return true;
}

StepOutput Engine::finish_step(const StepPlan& plan, const std::vector<RequestId>& touched, StepOutput out) {
  for (RequestId id : touched) {
    const auto it = requests_.find(id);
    if (it == requests_.end()) continue;
    Request* r = it->second.get();
    const bool done = std::all_of(r->seqs.begin(), r->seqs.end(),
                                  [](const auto& s) { return s->status == Sequence::Status::finished; });
    if (!done || static_cast<int>(r->seqs.size()) < r->params.n) continue;
    if (drafter_)
      for (const auto& s : r->seqs) drafter_->release(*s);
    out.finished.push_back(collect(*r));
    requests_.erase(it);
  }
  out.num_tokens = plan.num_tokens;
  out.num_preempted = plan.num_preempted;
  ++stats_.steps;
  stats_.computed_tokens += plan.num_tokens;
  return out;
}

std::vector<RequestOutput> Engine::run_to_completion() {
  std::vector<RequestOutput> done;
  while (has_unfinished()) {
    StepOutput o = step();
    for (RequestOutput& r : o.finished) done.push_back(std::move(r));
  }
  std::sort(done.begin(), done.end(), [](const RequestOutput& a, const RequestOutput& b) { return a.id < b.id; });
  return done;
}

RequestOutput Engine::collect(Request& r) const {
  RequestOutput out;
  out.id = r.id;
  out.prompt = r.prompt;
  out.prompt_logprobs = r.prompt_logprobs;
  out.prompt_logprobs_start = r.params.prompt_logprobs_start;
  for (const auto& s : r.seqs) {
    if (r.params.max_tokens == 0) break;  // scoring only: no completion
    Completion c;
    c.index = s->index;
    c.token_ids.assign(s->tokens.begin() + s->prompt_len, s->tokens.end());
    c.logprobs = s->logprobs;
    c.logits = s->logits;
    c.logits_first = s->logits_first;
    c.finish = s->finish;
    out.completions.push_back(std::move(c));
  }
  std::sort(out.completions.begin(), out.completions.end(),
            [](const Completion& a, const Completion& b) { return a.index < b.index; });
  return out;
}

EngineStats Engine::stats() const {
  EngineStats s = stats_;
  s.preemptions = scheduler_.num_preemptions();
  s.prefix = cache_.prefix_cache().counters();
  return s;
}

void Engine::check_accounting() const {
  std::vector<const SequenceRows*> live;
  for (const auto& [id, r] : requests_)
    for (const auto& s : r->seqs)
      if (s->status != Sequence::Status::finished) live.push_back(&s->rows);
  cache_.check_accounting(live);
}

}  // namespace kestrel
