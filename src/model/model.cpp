#include "model/model.h"

#include <algorithm>
#include <regex>

#include "core/error.h"
#include "kernels/cpu/basic.h"
#include "model/weights.h"

namespace kestrel {

std::unique_ptr<Model> Model::load(const std::string& dir, const ModelOptions& opts) {
  auto m = std::unique_ptr<Model>(new Model());
  m->cfg_ = ModelConfig::load(dir + "/config.json");
  m->opts_ = opts;
  const ModelConfig& cfg = m->cfg_;
  WeightLoader w(dir, cfg.weight_block_size);
  m->embed_ = w.get("model.embed_tokens.weight", {cfg.vocab_size, cfg.hidden_size});
  for (int i = 0; i < cfg.num_hidden_layers; ++i)
    m->layers_.push_back(cfg.arch == Arch::deepseek_v32 ? load_deepseek_v32_layer(cfg, w, i, opts)
                                                        : load_kimi_layer(cfg, w, i, opts));
  m->final_norm_ = w.get("model.norm.weight", {cfg.hidden_size});
  if (!cfg.tie_word_embeddings) m->lm_head_ = w.get("lm_head.weight", {cfg.vocab_size, cfg.hidden_size});

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

SequenceState Model::new_sequence() const {
  SequenceState s;
  s.mla.resize(layers_.size());
  s.kda.resize(layers_.size());
  for (size_t i = 0; i < layers_.size(); ++i)
    if (layers_[i].kda) s.kda[i] = layers_[i].kda->new_state();
  return s;
}

void Model::forward(SequenceState& seq, const int32_t* ids, int64_t T, float* logits, bool last_only) const {
  const int64_t D = cfg_.hidden_size, V = cfg_.vocab_size;
  KESTREL_CHECK(T > 0, "forward needs at least one token");
  std::vector<float> h(static_cast<size_t>(T) * D), x(h.size()), y(h.size());
  for (int64_t t = 0; t < T; ++t) {
    KESTREL_CHECK(ids[t] >= 0 && ids[t] < V, "token id {} is outside the vocabulary (0..{})", ids[t], V - 1);
    std::copy_n(embed_.ptr() + int64_t{ids[t]} * D, D, h.data() + t * D);
  }
  const int64_t pos0 = seq.num_tokens;
  for (size_t l = 0; l < layers_.size(); ++l) {
    const DecoderLayer& L = layers_[l];
    cpu::rms_norm(h.data(), L.input_norm.ptr(), x.data(), T, D, cfg_.rms_norm_eps);
    if (L.kda)
      L.kda->forward(x.data(), T, pos0, seq.kda[l], opts_.kda_chunked_prefill, y.data());
    else
      L.mla->forward(x.data(), T, seq.mla[l], y.data());
    for (size_t i = 0; i < h.size(); ++i) h[i] += y[i];
    cpu::rms_norm(h.data(), L.post_norm.ptr(), x.data(), T, D, cfg_.rms_norm_eps);
    if (L.moe)
      L.moe->forward(x.data(), T, y.data());
    else
      L.dense->forward(x.data(), T, y.data());
    for (size_t i = 0; i < h.size(); ++i) h[i] += y[i];
  }
  seq.num_tokens = pos0 + T;
  const int64_t first = last_only ? T - 1 : 0, rows = T - first;
  cpu::rms_norm(h.data() + first * D, final_norm_.ptr(), x.data(), rows, D, cfg_.rms_norm_eps);
  const Tensor& head = cfg_.tie_word_embeddings ? embed_ : lm_head_;
  cpu::linear(x.data(), head.ptr(), logits, rows, D, V);
}

}  // namespace kestrel
