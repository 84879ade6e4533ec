// Requests and sequences: plain data the scheduler and the engine share. A request asks for n completions of
// one prompt; each completion is a sequence with its own tokens, rows and random stream.
#pragma once
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "cache/cache_manager.h"
#include "engine/sampler.h"

namespace kestrel {

using RequestId = int64_t;

enum class FinishReason { none, stop, length, abort };
const char* finish_reason_name(FinishReason r);

struct Request;

struct Sequence {
  enum class Status { waiting, running, finished };

  Request* request = nullptr;
  int index = 0;                 // which of the request's n completions
  std::vector<int32_t> tokens;   // the prompt, then the generated tokens
  int64_t prompt_len = 0;
  int64_t num_computed = 0;      // tokens whose cache entries and states are in its rows
  Status status = Status::waiting;
  int64_t admitted = -1;         // admission counter: a higher value was admitted later
  SequenceRows rows;
  Sampler sampler;
  std::vector<TokenLogprob> logprobs;
  std::optional<grammar::OutputMatcher> constraint;  // structured output: the grammar state of its tokens
  std::vector<float> logits;     // [positions, vocab] of the fed positions it computed, when the request keeps them
  int64_t logits_first = 0;      // the position of logits' first row (later than 0 after a prefix-cache hit)
  int64_t logits_kept = 0;       // logits of positions before this one are in `logits` (or came from the cache)
  // The next prompt position whose log-probability the request records (prompt_len: none left, or not asked for).
  // Only the first sequence of a request scores its prompt; a recompute after preemption resumes here.
  int64_t scored_until = 0;
  FinishReason finish = FinishReason::none;
  // Speculative decoding, within one step: `drafts` are the drafter's proposals (draft_probs: their distributions
  // [drafts, vocab], empty for point masses); the scheduler moves the ones the step can verify to the end of `tokens`
  // (the last num_draft entries). Empty and zero between steps.
  std::vector<int32_t> drafts;
  int num_draft = 0;
  std::vector<float> draft_probs;

  Sequence(Request* r, int idx, std::vector<int32_t> toks, int64_t prompt, const Sampler& s)
      : request(r), index(idx), tokens(std::move(toks)), prompt_len(prompt), sampler(s) {}
  int64_t num_generated() const { return static_cast<int64_t>(tokens.size()) - prompt_len; }
};

struct Request {
  RequestId id = 0;
  std::vector<int32_t> prompt;
  SamplingParams params;
  int priority = 0;          // lower runs first under the priority policy
  uint64_t cache_key = 0;    // extra key of its prefix-cache hashes (e.g. a LoRA id); only equal keys share
  bool keep_logits = false;  // keep the logits of every fed position (tests, --dump-logits)
  int64_t arrival = 0;
  std::vector<std::unique_ptr<Sequence>> seqs;  // seqs[0] runs the prompt; the others fork from it
  bool forked = false;
  std::vector<TokenLogprob> prompt_logprobs;  // positions params.prompt_logprobs_start, ... in order
};

// What a finished request produced.
struct Completion {
  int index = 0;
  std::vector<int32_t> token_ids;
  std::vector<TokenLogprob> logprobs;
  std::optional<grammar::OutputMatcher> constraint;  // structured output: the grammar state of its tokens  // with params.logprobs >= 0
  std::vector<float> logits;           // with keep_logits: [prompt + generated - 1 - logits_first, vocab]
  int64_t logits_first = 0;            // the first position with logits: positions a prefix hit skipped have none
  FinishReason finish = FinishReason::none;
};
struct RequestOutput {
  RequestId id = 0;
  std::vector<int32_t> prompt;
  std::vector<Completion> completions;  // by index; none for a request that only scores its prompt
  // With params.prompt_logprobs >= 0: prompt positions prompt_logprobs_start, ..., prompt - 1 (fewer when aborted).
  std::vector<TokenLogprob> prompt_logprobs;
  int64_t prompt_logprobs_start = 0;
};

}  // namespace kestrel
