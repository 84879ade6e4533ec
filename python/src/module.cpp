// kestrel._kestrel: the native half of the Python API (python/kestrel holds the other). It takes and returns plain
// values (dicts, lists, tuples), so that the Python classes alone carry vLLM's names and defaults. The engine runs
// with the GIL released.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include "cli/device.h"
#include "core/error.h"
#include "engine/spec_decode.h"
#include "llm_session.h"

namespace py = pybind11;

namespace kestrel::python {
namespace {

template <typename T>
void take(const py::dict& d, const char* key, T& into) {
  if (d.contains(key) && !d[key].is_none()) into = d[key].cast<T>();
}

// The session's options from a dict of the engine's own names (the Python LLM maps vLLM's names onto these).
SessionOptions session_options(const py::dict& d) {
  SessionOptions o;
  take(d, "device", o.device);
  o.device = cli::resolve_device(o.device);
  take(d, "gpu_memory_utilization", o.gpu_memory_utilization);
  std::string kv_cache_dtype = "auto", index_cache_dtype = "fp8";
  take(d, "kv_cache_dtype", kv_cache_dtype);
  take(d, "index_cache_dtype", index_cache_dtype);
  o.model.latent_cache = cli::parse_kv_cache_dtype(kv_cache_dtype, o.device, "kv_cache_dtype");
  if (index_cache_dtype == "mxfp4") o.model.index_keys = IndexKeyDtype::mxfp4;
  else if (index_cache_dtype != "fp8") fail("index_cache_dtype '{}' is not one of fp8, mxfp4", index_cache_dtype);
  bool batch_invariant = false;
  take(d, "batch_invariant", batch_invariant);
  if (batch_invariant && o.device == "cuda")
    fail("batch_invariant: the GPU's kernels are not batch-invariant yet (cuBLASLt chooses algorithms per batch "
         "shape); use device='cpu'");
  if (batch_invariant) o.model.kda_chunked_prefill = false;
  std::string load_format = "auto";
  take(d, "load_format", load_format);
  o.load.load_format = load_format == "dummy" ? "dummy" : "safetensors";
  if (load_format != "auto" && load_format != "safetensors" && load_format != "dummy")
    fail("load_format '{}' is not one of auto, safetensors, dummy", load_format);
  std::string hf_overrides = "{}";
  take(d, "hf_overrides", hf_overrides);
  o.load.hf_overrides = nlohmann::json::parse(hf_overrides, nullptr, false);
  if (o.load.hf_overrides.is_discarded() || !o.load.hf_overrides.is_object())
    fail("hf_overrides must be a dict, got {}", hf_overrides);
  EngineConfig& e = o.engine;
  take(d, "max_model_len", e.max_model_len);
  take(d, "max_num_seqs", e.max_num_seqs);
  take(d, "max_num_batched_tokens", e.max_num_batched_tokens);
  take(d, "block_size", e.block_size);
  take(d, "kv_cache_memory_bytes", e.cache_bytes);
  take(d, "enable_prefix_caching", e.enable_prefix_caching);
  std::string policy = "fcfs";
  take(d, "scheduling_policy", policy);
  if (policy == "priority") e.policy = SchedulingPolicy::priority;
  else if (policy != "fcfs") fail("scheduling_policy '{}' is not one of fcfs, priority", policy);
  std::string speculative_config;  // JSON, as --speculative-config
  take(d, "speculative_config", speculative_config);
  if (!speculative_config.empty()) e.speculative = parse_speculative_config(speculative_config);
  o.load.load_mtp = e.speculative && e.speculative->method == "mtp";  // the mtp drafter's own layer
  return o;
}

GenerateRequest generate_request(const py::dict& d) {
  GenerateRequest r;
  r.prompt = d["prompt_token_ids"].cast<std::vector<int32_t>>();
  SamplingParams& p = r.params;
  take(d, "n", p.n);
  take(d, "max_tokens", p.max_tokens);
  take(d, "temperature", p.temperature);
  take(d, "top_p", p.top_p);
  take(d, "top_k", p.top_k);
  take(d, "min_p", p.min_p);
  take(d, "presence_penalty", p.presence_penalty);
  take(d, "frequency_penalty", p.frequency_penalty);
  take(d, "repetition_penalty", p.repetition_penalty);
  take(d, "seed", p.seed);
  take(d, "logprobs", p.logprobs);
  take(d, "prompt_logprobs", p.prompt_logprobs);
  take(d, "prompt_logprobs_start", p.prompt_logprobs_start);
  take(d, "stop_token_ids", p.stop_token_ids);
  take(d, "ignore_eos", p.ignore_eos);
  take(d, "stop", r.stop);
  take(d, "include_stop_str_in_output", r.include_stop_str_in_output);
  take(d, "skip_special_tokens", r.skip_special_tokens);
  take(d, "detokenize", r.detokenize);
  take(d, "priority", r.priority);
  take(d, "lora_id", p.lora_id);
  return r;
}

py::tuple logprob_tuple(const TokenLogprob& lp) {
  py::list top;
  for (const auto& [t, l] : lp.top) top.append(py::make_tuple(t, l));
  return py::make_tuple(lp.token, lp.logprob, lp.rank, top);
}

py::list logprob_list(const std::vector<TokenLogprob>& lps) {
  py::list out;
  for (const TokenLogprob& lp : lps) out.append(logprob_tuple(lp));
  return out;
}

py::dict result_dict(const GenerateResult& g) {
  py::dict d;
  d["prompt_token_ids"] = g.prompt;
  d["prompt_logprobs"] = logprob_list(g.prompt_logprobs);
  d["prompt_logprobs_start"] = g.prompt_logprobs_start;
  py::list outputs;
  for (const CompletionResult& c : g.outputs) {
    py::dict o;
    o["index"] = c.index;
    o["text"] = py::bytes(c.text).attr("decode")("utf-8", "replace");
    o["token_ids"] = c.token_ids;
    o["logprobs"] = logprob_list(c.logprobs);
    o["finish_reason"] = c.finish_reason;
    if (!c.stop_reason) o["stop_reason"] = py::none();
    else if (const auto* id = std::get_if<int32_t>(&*c.stop_reason)) o["stop_reason"] = *id;
    else o["stop_reason"] = std::get<std::string>(*c.stop_reason);
    outputs.append(o);
  }
  d["outputs"] = outputs;
  return d;
}

}  // namespace
}  // namespace kestrel::python

PYBIND11_MODULE(_kestrel, m) {
  using namespace kestrel;
  using namespace kestrel::python;
  m.doc() = "Kestrel's engine in this process (use kestrel.LLM)";
  // Errors the engine names (bad parameters, prompts beyond the limits, missing files) are the caller's.
  py::register_exception<Error>(m, "KestrelError", PyExc_ValueError);

  py::class_<LlmSession>(m, "Session")
      .def(py::init([](const std::string& model_dir, const py::dict& opts) {
             const SessionOptions o = session_options(opts);
             py::gil_scoped_release unlocked;
             return std::make_unique<LlmSession>(model_dir, o);
           }),
           py::arg("model_dir"), py::arg("options"))
      .def(
          "generate",
          [](LlmSession& s, const py::list& requests) {
            std::vector<GenerateRequest> reqs;
            for (const py::handle& r : requests) reqs.push_back(generate_request(r.cast<py::dict>()));
            std::vector<GenerateResult> results;
            {
              py::gil_scoped_release unlocked;
              results = s.generate(reqs);
            }
            py::list out;
            for (const GenerateResult& g : results) out.append(result_dict(g));
            return out;
          },
          py::arg("requests"))
      .def("encode", &LlmSession::encode, py::arg("text"), py::arg("add_special_tokens") = false)
      .def(
          "decode",
          [](const LlmSession& s, const std::vector<int32_t>& ids, bool skip) {
            return py::bytes(s.decode(ids, skip)).attr("decode")("utf-8", "replace");
          },
          py::arg("token_ids"), py::arg("skip_special_tokens") = false)
      .def(
          "token_text",
          [](const LlmSession& s, int32_t id) { return py::bytes(s.token_text(id)).attr("decode")("utf-8", "replace"); },
          py::arg("token_id"))
      .def(
          "load_lora",
          [](LlmSession& s, int32_t id, const std::string& path, int max_rank) {
            py::gil_scoped_release unlocked;
            s.load_lora(id, path, max_rank);
          },
          py::arg("lora_id"), py::arg("path"), py::arg("max_rank"))
      .def("unload_lora", &LlmSession::unload_lora, py::arg("lora_id"))
      .def("reset_prefix_cache", &LlmSession::reset_prefix_cache)
      .def_property_readonly("max_model_len", &LlmSession::max_model_len)
      .def_property_readonly("vocab_size", [](const LlmSession& s) { return s.config().vocab_size; })
      .def_property_readonly("eos_token_id", [](const LlmSession& s) { return s.config().eos_token_id; })
      .def_property_readonly("architecture", [](const LlmSession& s) { return std::string(arch_name(s.config().arch)); })
      .def("stats", [](const LlmSession& s) {
        const EngineStats st = s.stats();
        py::dict d;
        d["steps"] = st.steps;
        d["computed_tokens"] = st.computed_tokens;
        d["generated_tokens"] = st.generated_tokens;
        d["preemptions"] = st.preemptions;
        d["prefix_hit_tokens"] = st.prefix.hit_tokens;
        d["prefix_query_tokens"] = st.prefix.query_tokens;
        d["spec_decode_num_drafts"] = st.spec.num_drafts;
        d["spec_decode_num_draft_tokens"] = st.spec.num_draft_tokens;
        d["spec_decode_num_accepted_tokens"] = st.spec.num_accepted_tokens;
        return d;
      });
}
