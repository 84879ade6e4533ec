#include "llm_session.h"

#include <map>

#include "cli/device.h"
#include "core/error.h"
#include "model/lora.h"
#include "server/completion_text.h"

namespace kestrel::python {

LlmSession::LlmSession(const std::string& model_dir, const SessionOptions& opts)
    : model_(Model::load(model_dir, opts.model, cli::make_backend(opts.device, opts.gpu_memory_utilization),
                         opts.load)),
      tokenizer_(text::Tokenizer::load(model_dir)) {
  EngineConfig cfg = opts.engine;
  if (const DeviceAttach attach = cli::device_attach(opts.device)) device_ = attach(*model_, cfg);
  engine_ = std::make_unique<Engine>(*model_, cfg);
}

LlmSession::~LlmSession() {
  engine_.reset();  // before the device state it runs on
  device_.reset();
}

std::vector<int32_t> LlmSession::encode(const std::string& text, bool add_special_tokens) const {
  return tokenizer_.encode(text, {.parse_special = true, .add_special_tokens = add_special_tokens});
}

std::string LlmSession::decode(const std::vector<int32_t>& ids, bool skip_special_tokens) const {
  for (int32_t t : ids) KESTREL_CHECK(tokenizer_.is_known(t), "token id {} is not in the tokenizer's vocabulary", t);
  return tokenizer_.decode(ids, skip_special_tokens);
}

std::string LlmSession::token_text(int32_t id) const {
  return tokenizer_.is_known(id) ? tokenizer_.decode({&id, 1}) : "";
}

namespace {

const char* finish_name(FinishReason r) {
  switch (r) {
    case FinishReason::stop: return "stop";
    case FinishReason::length: return "length";
    default: return "abort";
  }
}

// One completion while it runs: its text so far, and where a stop string ended it (the engine, which knows no text,
// keeps generating until every completion of the request has ended).
struct Running {
  std::unique_ptr<server::CompletionText> text;
  server::OutputDelta total;
  int64_t tokens = 0;
  bool stopped = false;
};

}  // namespace

std::vector<GenerateResult> LlmSession::generate(const std::vector<GenerateRequest>& requests) {
  std::lock_guard lock(mu_);
  const int32_t eos = static_cast<int32_t>(model_->config().eos_token_id);
  std::vector<RequestId> ids;
  try {
    for (const GenerateRequest& r : requests) ids.push_back(engine_->add_request(r.prompt, r.params, r.priority));
  } catch (const Error&) {
    for (RequestId id : ids) engine_->abort(id);
    throw;
  }
  std::map<RequestId, size_t> which;
  for (size_t i = 0; i < ids.size(); ++i) which[ids[i]] = i;
  std::vector<std::vector<Running>> running(requests.size());
  for (size_t i = 0; i < requests.size(); ++i) {
    const GenerateRequest& r = requests[i];
    if (r.params.max_tokens == 0) continue;
    server::CompletionTextOptions o;
    o.skip_special_tokens = r.skip_special_tokens;
    o.stop = r.stop;
    o.include_stop_str_in_output = r.include_stop_str_in_output;
    o.stop_token_ids = r.params.stop_token_ids;
    if (!r.params.ignore_eos) o.stop_token_ids.push_back(eos);
    running[i].resize(static_cast<size_t>(r.params.n));
    for (Running& c : running[i]) c.text = std::make_unique<server::CompletionText>(tokenizer_, o);
  }

  std::vector<std::optional<RequestOutput>> outputs(requests.size());
  size_t left = requests.size();
  while (left > 0) {
    StepOutput step = engine_->step();
    std::vector<RequestId> all_stopped;
    for (const TokenEvent& e : step.tokens) {
      const size_t i = which.at(e.request);
      Running& c = running[i][static_cast<size_t>(e.index)];
      if (c.stopped) continue;
      ++c.tokens;
      if (!requests[i].detokenize && requests[i].stop.empty()) continue;
      server::OutputDelta d;
      c.text->push(e.token, d);
      c.total.merge(d);
      if (c.text->stopped_by_string()) {
        c.stopped = true;
        bool all = true;
        for (const Running& x : running[i]) all = all && x.stopped;
        if (all) all_stopped.push_back(e.request);
      }
    }
    for (RequestOutput& out : step.finished) {
      outputs[which.at(out.id)] = std::move(out);
      --left;
    }
    for (RequestId id : all_stopped)
      if (!outputs[which.at(id)]) {
        outputs[which.at(id)] = engine_->abort(id);
        --left;
      }
  }

  std::vector<GenerateResult> results;
  for (size_t i = 0; i < requests.size(); ++i) {
    RequestOutput& out = *outputs[i];
    GenerateResult g;
    g.prompt = std::move(out.prompt);
    g.prompt_logprobs = std::move(out.prompt_logprobs);
    g.prompt_logprobs_start = out.prompt_logprobs_start;
    for (Completion& comp : out.completions) {
      Running& c = running[i][static_cast<size_t>(comp.index)];
      CompletionResult r;
      r.index = comp.index;
      r.token_ids = std::move(comp.token_ids);
      r.logprobs = std::move(comp.logprobs);
      if (c.stopped) {
        // Tokens after the one that completed the stop string are not part of the output.
        r.token_ids.resize(static_cast<size_t>(c.tokens));
        if (r.logprobs.size() > r.token_ids.size()) r.logprobs.resize(r.token_ids.size());
        r.finish_reason = "stop";
        r.stop_reason = *c.text->stop_string();
      } else {
        server::OutputDelta d;
        c.text->finish(d);
        c.total.merge(d);
        r.finish_reason = finish_name(comp.finish);
        if (comp.finish == FinishReason::stop && !r.token_ids.empty() && r.token_ids.back() != eos)
          r.stop_reason = r.token_ids.back();
      }
      if (requests[i].detokenize) r.text = std::move(c.total.content);
      g.outputs.push_back(std::move(r));
    }
    results.push_back(std::move(g));
  }
  return results;
}

void LlmSession::load_lora(int32_t id, const std::string& path, int max_rank) {
  const LoraAdapter adapter = load_lora_adapter(path, max_rank);
  std::lock_guard lock(mu_);
  KESTREL_CHECK(!engine_->has_unfinished(), "LoRA adapter {} cannot be loaded while requests run", id);
  model_->load_lora(id, adapter);
}

}  // namespace kestrel::python
