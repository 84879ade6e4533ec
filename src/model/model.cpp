#include "model/model.h"

#include <algorithm>
#include <regex>

#include "core/error.h"
#include "core/formats.h"
#include "kernels/cpu/basic.h"
#include "model/weights.h"

namespace kestrel {

std::unique_ptr<Model> Model::load(const std::string& dir, const ModelOptions& opts) {
  auto m = std::unique_ptr<Model>(new Model());
  m->cfg_ = ModelConfig::load(dir + "/config.json");
  m->opts_ = opts;
  const ModelConfig& cfg = m->cfg_;
  WeightLoader w(dir, cfg.weight_block_size, opts.bf16_activations, opts.keep_fp8_weights);
  m->embed_ = w.get("model.embed_tokens.weight", {cfg.vocab_size, cfg.hidden_size});
  for (int i = 0; i < cfg.num_hidden_layers; ++i)
    m->layers_.push_back(cfg.arch == Arch::deepseek_v32 ? load_deepseek_v32_layer(cfg, w, i, opts)
                                                        : load_kimi_layer(cfg, w, i, opts));
  m->final_norm_ = w.get("model.norm.weight", {cfg.hidden_size});
  if (!cfg.tie_word_embeddings) m->lm_head_ = w.get("lm_head.weight", {cfg.vocab_size, cfg.hidden_size});
  m->sequence_plan_ = plan_cache(m->cache_specs(), {.block_size = 64});

  // Multi-token-prediction layers (numbered from num_hidden_layers on) are not run; anything else left over is an
  // error, since a tensor we do not understand means the checkpoint is not the model we think it is.
  const std::regex layer_re(R"(model\.layers\.(\d+)\..*)");
  std::vector<std::string> unexpected;
  for (const std::string& name : w.unused()) {
    std::smatch mt;
    if (std::regex_match(name, mt, layer_re) && std::stoll(mt[1]) >= cfg.num_hidden_layers) continue;
    unexpected.push_back(name);
  }
  if (!unexpected.empty()) {
    std::string list;
    for (size_t i = 0; i < unexpected.size() && i < 10; ++i) list += (i ? ", " : "") + unexpected[i];
    fail("{}: {} unexpected tensor(s) in the checkpoint: {}{}", dir, unexpected.size(), list,
         unexpected.size() > 10 ? ", ..." : "");
  }
  return m;
}

std::vector<LayerCacheSpec> model_cache_specs(const ModelConfig& cfg, const ModelOptions& opts, int tp) {
  KESTREL_CHECK(tp >= 1, "tensor parallel size must be >= 1, got {}", tp);
  std::vector<LayerCacheSpec> specs(cfg.layer_kinds.size());
  for (size_t l = 0; l < specs.size(); ++l) {
    if (cfg.layer_kinds[l] == LayerKind::mla) {
      specs[l].latent_bytes = latent_entry_bytes(cfg, opts.latent_cache);
      specs[l].index_key_bytes = index_key_entry_bytes(cfg, opts.index_keys);
    } else {
      KESTREL_CHECK(cfg.kda_num_heads % tp == 0, "{} KDA heads do not split over {} GPUs", cfg.kda_num_heads, tp);
      specs[l].state_bytes = kda_state_bytes(cfg, cfg.kda_num_heads / tp);
    }
  }
  return specs;
}

std::vector<LayerCacheSpec> Model::cache_specs(int tp) const { return model_cache_specs(cfg_, opts_, tp); }

int Model::prefill_alignment() const {
  return opts_.kda_chunked_prefill && cfg_.num_layers_of(LayerKind::kda) > 0 ? 64 : 1;
}

void Model::forward(const StepBatch& batch, float* logits, MlaStepRunner* mla_runner) const {
  const int64_t D = cfg_.hidden_size, V = cfg_.vocab_size;
  const CachePlan& plan = *batch.plan;
  const auto& seqs = batch.seqs;
  KESTREL_CHECK(plan.page_offset.size() == layers_.size(), "cache plan of {} layers for a model of {}",
                plan.page_offset.size(), layers_.size());
  for (size_t l = 0; l < layers_.size(); ++l) {
    const MlaAttention* mla = layers_[l].mla.get();
    KESTREL_CHECK(mla ? plan.latent_bytes[l] == mla->latent_bytes() && plan.index_key_bytes[l] ==
                                                                           mla->index_key_bytes()
                      : plan.state_row[l] >= 0,
                  "the cache plan does not match layer {} of the model", l);
  }
  std::vector<int64_t> first(seqs.size() + 1, 0);
  int64_t wanted = 0;
  for (size_t i = 0; i < seqs.size(); ++i) {
    const SequenceStep& s = seqs[i];
    const int64_t n = static_cast<int64_t>(s.ids.size()), end = s.start + n;
    KESTREL_CHECK(n > 0, "a step needs at least one token per sequence");
    KESTREL_CHECK(static_cast<int64_t>(s.slots.size()) == n, "{} slots for {} tokens", s.slots.size(), n);
    KESTREL_CHECK(plan.num_token_layers == 0 || static_cast<int64_t>(s.block_table.size()) * plan.block_size >= end,
                  "a block table of {} blocks cannot hold {} tokens", s.block_table.size(), end);
    KESTREL_CHECK(static_cast<int>(s.state_rows.size()) == plan.state_rows_per_request, "{} state rows, the plan has {}",
                  s.state_rows.size(), plan.state_rows_per_request);
    KESTREL_CHECK(s.logits_from >= 0 && s.logits_from <= n, "logits_from {} outside [0, {}]", s.logits_from, n);
    first[i + 1] = first[i] + n;
    wanted += n - s.logits_from;
  }
  const int64_t N = first.back();
  std::vector<float> h(static_cast<size_t>(N) * D), x(h.size()), y(h.size());
  for (size_t i = 0; i < seqs.size(); ++i)
    for (int64_t t = 0; t < first[i + 1] - first[i]; ++t) {
      const int32_t id = seqs[i].ids[t];
      KESTREL_CHECK(id >= 0 && id < V, "token id {} is outside the vocabulary (0..{})", id, V - 1);
      std::copy_n(embed_.ptr() + int64_t{id} * D, D, h.data() + (first[i] + t) * D);
    }
  auto state_at = [&](int32_t row, size_t l) {
    return kda_state_view(cfg_, batch.pool + int64_t{row} * plan.row_bytes + plan.state_offset[l]);
  };
  auto pages_of = [&](const SequenceStep& s, size_t l) {
    return TokenPages{batch.pool + plan.page_offset[l], plan.row_bytes,  plan.block_size,
                      s.block_table.data(),             s.slots.data(), s.start};
  };
  std::vector<MlaStepRequest> mla_requests(seqs.size());
  for (size_t l = 0; l < layers_.size(); ++l) {
    const DecoderLayer& L = layers_[l];
    cpu::rms_norm(h.data(), L.input_norm.ptr(), x.data(), N, D, cfg_.rms_norm_eps);
    if (L.mla && mla_runner) {
      for (size_t i = 0; i < seqs.size(); ++i) mla_requests[i] = {pages_of(seqs[i], l), first[i + 1] - first[i]};
      mla_runner->run(*L.mla, x.data(), mla_requests, y.data());
    } else {
      for (size_t i = 0; i < seqs.size(); ++i) {
        const SequenceStep& s = seqs[i];
        const int64_t n = first[i + 1] - first[i];
        const float* xi = x.data() + first[i] * D;
        float* yi = y.data() + first[i] * D;
        if (L.kda) {
          const int g = plan.state_row[l];
          std::vector<KdaCheckpoint> checkpoints;
          for (const CheckpointTarget& c : s.checkpoints) checkpoints.push_back({c.position, state_at(c.rows[g], l)});
          L.kda->forward(xi, n, s.start, state_at(s.state_rows[g], l), opts_.kda_chunked_prefill && s.prompt,
                         checkpoints, plan.block_size, yi);
        } else {
          L.mla->forward(xi, n, pages_of(s, l), yi);
        }
      }
    }
    for (size_t i = 0; i < h.size(); ++i) h[i] += y[i];
    cpu::rms_norm(h.data(), L.post_norm.ptr(), x.data(), N, D, cfg_.rms_norm_eps);
    if (L.moe)
      L.moe->forward(x.data(), N, y.data());
    else
      L.dense->forward(x.data(), N, y.data());
    for (size_t i = 0; i < h.size(); ++i) h[i] += y[i];
  }
  int64_t row = 0;
  for (size_t i = 0; i < seqs.size(); ++i) {
    const int64_t from = first[i] + seqs[i].logits_from, rows = first[i + 1] - from;
    cpu::rms_norm(h.data() + from * D, final_norm_.ptr(), x.data() + row * D, rows, D, cfg_.rms_norm_eps);
    row += rows;
  }
  const Tensor& head = cfg_.tie_word_embeddings ? embed_ : lm_head_;
  if (opts_.bf16_activations)
    for (int64_t i = 0; i < wanted * D; ++i) x[i] = round_to_bf16(x[i]);
  cpu::linear(x.data(), head.ptr(), logits, wanted, D, V);
}

SequenceState Model::new_sequence() const {
  SequenceState s;
  s.rows.assign(static_cast<size_t>(sequence_plan_.state_rows_per_request * sequence_plan_.row_bytes), 0);
  return s;
}

void Model::forward(SequenceState& seq, const int32_t* ids, int64_t T, float* logits, bool last_only) const {
  KESTREL_CHECK(T > 0, "forward needs at least one token");
  const CachePlan& plan = sequence_plan_;
  const int64_t B = plan.block_size, S = plan.state_rows_per_request, end = seq.num_tokens + T;
  const int64_t blocks = plan.token_rows_for(end);
  seq.rows.resize(static_cast<size_t>((S + blocks) * plan.row_bytes), 0);
  std::vector<int32_t> block_table(blocks), state_rows(S);
  for (int64_t j = 0; j < blocks; ++j) block_table[j] = static_cast<int32_t>(S + j);
  for (int64_t r = 0; r < S; ++r) state_rows[r] = static_cast<int32_t>(r);
  std::vector<int64_t> slots(T);
  for (int64_t t = 0; t < T; ++t) {
    const int64_t p = seq.num_tokens + t;
    slots[t] = (S + p / B) * B + p % B;
  }
  const SequenceStep step{std::span(ids, T), seq.num_tokens, T > 1, block_table, slots, state_rows, {},
                          last_only ? T - 1 : 0};
  forward(StepBatch{seq.rows.data(), &plan, std::span(&step, 1)}, logits);
  seq.num_tokens = end;
}

}  // namespace kestrel
