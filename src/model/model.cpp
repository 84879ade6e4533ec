#include "model/model.h"

#include <algorithm>
#include <regex>

#include "core/error.h"
#include "model/weights.h"

namespace kestrel {

namespace {
constexpr float kLatentNormEps = 1e-6f;  // q_a_layernorm and kv_a_layernorm in every architecture (MODEL.md)
}

bool fp8_experts_stay_fp8(const ModelConfig& cfg) {
  return cfg.hidden_size % 128 == 0 && cfg.moe_intermediate_size % 128 == 0 && cfg.weight_block_size == 128;
}

ModelConfig load_model_config(const std::string& dir, const nlohmann::json& overrides) {
  return ModelConfig::load(dir + "/config.json", overrides);
}

std::unique_ptr<Model> Model::load(const std::string& dir, const ModelOptions& opts, std::unique_ptr<Backend> backend,
                                   const LoadOptions& lo) {
  KESTREL_CHECK(backend != nullptr, "Model::load needs a backend");
  auto m = std::unique_ptr<Model>(new Model());
  m->cfg_ = load_model_config(dir, lo.hf_overrides);
  m->opts_ = opts;
  m->backend_ = std::move(backend);
  const ModelConfig& cfg = m->cfg_;
  Backend& b = *m->backend_;
  if (lo.load_format != "auto" && lo.load_format != "safetensors" && lo.load_format != "dummy")
    fail("--load-format '{}' is not one of auto, safetensors, dummy", lo.load_format);
  const bool dummy = lo.load_format == "dummy";
  std::unique_ptr<WeightLoader> loader =
      dummy ? std::make_unique<WeightLoader>(cfg, lo.seed) : std::make_unique<WeightLoader>(dir, cfg);
  WeightLoader& w = *loader;

  b.configure(cfg, opts);
  const Init embed_init{1.0f, 0.0f}, norm_init{0.05f, 1.0f};
  m->embed_ = b.add_embedding(w.tensor("model.embed_tokens.weight", {cfg.vocab_size, cfg.hidden_size}, embed_init));
  for (int i = 0; i < cfg.num_hidden_layers; ++i)
    m->layers_.push_back(cfg.arch == Arch::deepseek_v32 ? load_deepseek_v32_layer(cfg, w, b, i)
                                                        : load_kimi_layer(cfg, w, b, i));
  m->final_norm_ = b.add_vector(w.tensor("model.norm.weight", {cfg.hidden_size}, norm_init));
  if (cfg.tie_word_embeddings) {
    m->lm_head_ = b.tied_head(m->embed_);
  } else {
    const StoredLinear head = w.linear("lm_head", cfg.vocab_size, cfg.hidden_size, Quant::none);
    m->lm_head_ = b.add_linear(std::span(&head, 1));
  }
  if (lo.load_mtp) m->load_mtp(w);
  b.finalize_weights();
  m->stored_bytes_ = w.handed_bytes();
  m->sequence_plan_ = plan_cache(m->cache_specs(), {.block_size = 64});

  if (m->mtp_) {
    std::vector<LayerCacheSpec> one(1);
    one[0].latent_bytes = latent_entry_bytes(cfg, opts.latent_cache);
    one[0].index_key_bytes = index_key_entry_bytes(cfg, opts.index_keys);
    m->mtp_plan_ = plan_cache(one, {.block_size = 64});
  }

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

// ---------------------------------------------------------------- the graph

Act Model::mla_mixer(StepOps& b, const MlaLayerWeights& w, int layer, Act x) const {
  const int64_t C = cfg_.kv_lora_rank, R = cfg_.qk_rope_head_dim, H = cfg_.num_attention_heads;
  const int64_t dq = cfg_.qk_head_dim(), dn = cfg_.qk_nope_head_dim;
  // The latent: c normed, k_pe rotated (deepseek_v32); a token attends to itself, so it is cached before attention.
  const Act kv = b.linear(w.kv_a, x);
  b.rms_norm_inplace(kv.slice(0, C), w.kv_a_norm, kLatentNormEps);
  if (cfg_.use_rope) b.rope(kv, 1, C + R, C, static_cast<int>(R), RopeStyle::interleaved);
  Act qr, q;
  if (w.q_a) {
    qr = b.rms_norm(b.linear(*w.q_a, x), w.q_a_norm, kLatentNormEps);
    q = b.linear(*w.q_b, qr);
  } else {
    q = b.linear(*w.q_proj, x);
  }
  if (cfg_.use_rope) b.rope(q, static_cast<int>(H), dq, dn, static_cast<int>(R), RopeStyle::interleaved);
  const Act o = b.mla_attention(w.attn, layer, x, qr, q, kv);
  return b.linear(w.o_proj, o);
}

Act Model::kda_mixer(StepOps& b, const KdaLayerWeights& w, int layer, Act x) const {
  const int64_t dk = cfg_.kda_head_dim;
  const Act qkv = b.linear(w.qkv, x);
  const Act fg = b.linear(w.fg_a, x);  // the rank-dk bottlenecks of the forget gate and the output gate
  const Act f = b.linear(w.f_b, fg.slice(0, dk));
  const Act beta = b.linear(w.b, x);
  const Act g = b.linear(w.g_b, fg.slice(dk, dk));
  const Act o = b.kda(w.core, layer, qkv, f, beta, g);
  return b.linear(w.o, o);
}

Act Model::ffn(StepOps& b, const FfnWeights& w, Act x) const {
  return b.linear(w.down, b.swiglu(b.linear(w.gate_up, x)));
}

void Model::decoder_layer(StepOps& b, const DecoderLayer& L, int layer, Act h) const {
  const float eps = cfg_.rms_norm_eps;
  b.begin_layer(layer);
  Act x = b.rms_norm(h, L.input_norm, eps);
  b.add(h, L.kda ? kda_mixer(b, *L.kda, layer, x) : mla_mixer(b, *L.mla, layer, x));
  x = b.rms_norm(h, L.post_norm, eps);
  if (L.moe) {
    const Act y = b.moe(*L.moe, x);
    if (L.shared) b.add(y, ffn(b, *L.shared, x));
    b.add(h, y);
  } else {
    b.add(h, ffn(b, *L.dense, x));
  }
  b.end_layer(layer);
}

void Model::graph(StepOps& b, float* hidden, std::span<const int> layers) const {
  static constexpr int kFinal[1] = {kFinalHidden};
  if (layers.empty()) layers = kFinal;
  const int64_t D = cfg_.hidden_size, stride = static_cast<int64_t>(layers.size()) * D;
  const Act h = b.embed(embed_);
  for (size_t l = 0; l < layers_.size(); ++l) {
    decoder_layer(b, layers_[l], static_cast<int>(l), h);
    for (size_t i = 0; hidden && i < layers.size(); ++i)
      if (layers[i] == static_cast<int>(l)) b.copy_out(h, hidden + static_cast<int64_t>(i) * D, stride);
  }
  for (size_t i = 0; hidden && i < layers.size(); ++i)
    if (layers[i] == kFinalHidden)
      b.copy_out(b.rms_norm(h, final_norm_, cfg_.rms_norm_eps), hidden + static_cast<int64_t>(i) * D, stride);
  b.logits(h, final_norm_, lm_head_);
}

void Model::load_mtp(WeightLoader& w) {
  const ModelConfig& cfg = cfg_;
  Backend& b = *backend_;
  KESTREL_CHECK(cfg.num_nextn_predict_layers > 0,
                "--speculative-config: method 'mtp' runs the checkpoint's multi-token-prediction layer, and this model "
                "has none: config.json's num_nextn_predict_layers is {} ({} checkpoints define none)",
                cfg.num_nextn_predict_layers, arch_name(cfg.arch));
  KESTREL_CHECK(cfg.arch == Arch::deepseek_v32, "multi-token-prediction layers of {} are not known (DeepSeek-V3.2's are)",
                arch_name(cfg.arch));
  KESTREL_CHECK(cfg.num_nextn_predict_layers == 1,
                "config.json's num_nextn_predict_layers is {}: the mtp drafter runs one MTP layer (DeepSeek-V3.2 has one)",
                cfg.num_nextn_predict_layers);
  const int64_t D = cfg.hidden_size, V = cfg.vocab_size;
  const int n = cfg.num_hidden_layers;
  const std::string p = "model.layers." + std::to_string(n) + ".";
  const Init norm{0.05f, 1.0f};
  MtpWeights m;
  m.enorm = b.add_vector(w.tensor(p + "enorm.weight", {D}, norm));
  m.hnorm = b.add_vector(w.tensor(p + "hnorm.weight", {D}, norm));
  // eh_proj and shared_head are plain linear layers in DeepSeek's FP8 checkpoints (vLLM builds them unquantized).
  const StoredLinear eh = w.linear(p + "eh_proj", D, 2 * D, Quant::none);
  m.eh_proj = b.add_linear(std::span(&eh, 1));
  m.block = load_deepseek_v32_layer(cfg, w, b, n);
  m.head_norm = b.add_vector(w.tensor(p + "shared_head.norm.weight", {D}, norm));
  if (const auto e = w.optional_tensor(p + "embed_tokens.weight", {V, D}, {1.0f, 0.0f}, DType::BF16, false))
    m.embed = b.add_embedding(*e);
  else
    m.embed = embed_;
  if (const auto h = w.optional_tensor(p + "shared_head.head.weight", {V, D}, {}, DType::BF16, false)) {
    StoredLinear head;
    head.weight = *h;
    head.out = V;
    head.in = D;
    m.head = b.add_linear(std::span(&head, 1));
  } else {
    m.head = lm_head_;
  }
  mtp_ = std::move(m);
}

namespace {

// One sequence in a pool of its own (SequenceState): state rows 0..S-1, then its token rows in order.
struct SequenceTables {
  std::vector<int32_t> block_table, state_rows;
  std::vector<int64_t> slots;
};

// Grows the sequence's rows to hold T more tokens and gives the step's tables.
SequenceTables sequence_tables(SequenceState& seq, const CachePlan& plan, int64_t T) {
  const int64_t B = plan.block_size, S = plan.state_rows_per_request;
  const int64_t blocks = plan.token_rows_for(seq.num_tokens + T);
  if (seq.rows.size() < static_cast<size_t>((S + blocks) * plan.row_bytes))
    seq.rows.resize(static_cast<size_t>((S + blocks) * plan.row_bytes), 0);
  SequenceTables t;
  t.block_table.resize(static_cast<size_t>(blocks));
  t.state_rows.resize(static_cast<size_t>(S));
  for (int64_t j = 0; j < blocks; ++j) t.block_table[j] = static_cast<int32_t>(S + j);
  for (int64_t r = 0; r < S; ++r) t.state_rows[r] = static_cast<int32_t>(r);
  t.slots.resize(static_cast<size_t>(T));
  for (int64_t i = 0; i < T; ++i) {
    const int64_t p = seq.num_tokens + i;
    t.slots[i] = (S + p / B) * B + p % B;
  }
  return t;
}

}  // namespace

SequenceState Model::new_mtp_sequence() const {
  KESTREL_CHECK(mtp_.has_value(), "the model was loaded without its MTP layer");
  SequenceState s;
  s.rows.assign(static_cast<size_t>(mtp_plan_.state_rows_per_request * mtp_plan_.row_bytes), 0);
  return s;
}

void Model::mtp_forward(SequenceState& seq, const int32_t* ids, const float* hidden, const float* embed_scale,
                        int64_t T, float* logits, float* hidden_out) const {
  KESTREL_CHECK(mtp_.has_value(), "the model was loaded without its MTP layer");
  KESTREL_CHECK(T > 0, "mtp_forward needs at least one position");
  const MtpWeights& m = *mtp_;
  const CachePlan& plan = mtp_plan_;
  const int64_t end = seq.num_tokens + T, D = cfg_.hidden_size;
  for (int64_t t = 0; t < T; ++t)
    KESTREL_CHECK(ids[t] >= 0 && ids[t] < cfg_.vocab_size, "token id {} is outside the vocabulary (0..{})", ids[t],
                  cfg_.vocab_size - 1);
  const SequenceTables tab = sequence_tables(seq, plan, T);
  const SequenceStep step{std::span(ids, T), seq.num_tokens, false, tab.block_table, tab.slots, tab.state_rows, {},
                          T - 1, 0};
  std::vector<float> in(static_cast<size_t>(T * 2 * D), 0.0f);
  for (int64_t t = 0; t < T; ++t) std::copy_n(hidden + t * D, D, in.data() + (t * 2 + 1) * D);
  const float eps = cfg_.rms_norm_eps;
  backend_->run_step(
      StepBatch{seq.rows.data(), &plan, std::span(&step, 1)},
      [&](StepOps& b) {
        const Act x = b.host_rows(in, 2 * D);
        const Act e = b.embed(m.embed);
        b.scale_rows(e, std::span(embed_scale, T));
        b.add(x.slice(0, D), e);
        b.rms_norm_inplace(x.slice(0, D), m.enorm, eps);
        b.rms_norm_inplace(x.slice(D, D), m.hnorm, eps);
        const Act h = b.linear(m.eh_proj, x);
        decoder_layer(b, m.block, 0, h);
        b.copy_out(h, hidden_out, D);
        b.logits(h, m.head_norm, m.head);
      },
      StepResults{logits, {}, nullptr});
  seq.num_tokens = end;
}

void Model::check_step(const StepBatch& batch) const {
  const CachePlan& plan = *batch.plan;
  KESTREL_CHECK(plan.page_offset.size() == layers_.size(), "cache plan of {} layers for a model of {}",
                plan.page_offset.size(), layers_.size());
  for (size_t l = 0; l < layers_.size(); ++l)
    KESTREL_CHECK(layers_[l].mla ? plan.latent_bytes[l] == latent_entry_bytes(cfg_, opts_.latent_cache) &&
                                       plan.index_key_bytes[l] == index_key_entry_bytes(cfg_, opts_.index_keys)
                                 : plan.state_row[l] >= 0,
                  "the cache plan does not match layer {} of the model", l);
  for (const SequenceStep& s : batch.seqs) {
    const int64_t n = static_cast<int64_t>(s.ids.size()), end = s.start + n;
    KESTREL_CHECK(n > 0, "a step needs at least one token per sequence");
    KESTREL_CHECK(s.lora == 0 || has_lora(s.lora), "LoRA adapter {} is not loaded", s.lora);
    KESTREL_CHECK(static_cast<int64_t>(s.slots.size()) == n, "{} slots for {} tokens", s.slots.size(), n);
    KESTREL_CHECK(plan.num_token_layers == 0 || static_cast<int64_t>(s.block_table.size()) * plan.block_size >= end,
                  "a block table of {} blocks cannot hold {} tokens", s.block_table.size(), end);
    KESTREL_CHECK(static_cast<int>(s.state_rows.size()) == plan.state_rows_per_request,
                  "{} state rows, the plan has {}", s.state_rows.size(), plan.state_rows_per_request);
    KESTREL_CHECK(s.logits_from >= 0 && s.logits_from <= n, "logits_from {} outside [0, {}]", s.logits_from, n);
    for (int32_t id : s.ids)
      KESTREL_CHECK(id >= 0 && id < cfg_.vocab_size, "token id {} is outside the vocabulary (0..{})", id,
                    cfg_.vocab_size - 1);
    // As the KDA layers take them: ascending inside the step, on block boundaries.
    for (size_t c = 0; c < s.checkpoints.size(); ++c) {
      const int64_t p = s.checkpoints[c].position;
      KESTREL_CHECK(p > s.start && p <= end && (c == 0 || p >= s.checkpoints[c - 1].position),
                    "KDA checkpoint at {} is not inside the step ({}, {}] in ascending order", p, s.start, end);
      KESTREL_CHECK(static_cast<int>(s.checkpoints[c].rows.size()) == plan.state_rows_per_request,
                    "a checkpoint of {} state rows, the plan has {}", s.checkpoints[c].rows.size(),
                    plan.state_rows_per_request);
    }
  }
}

void Model::forward(const StepBatch& batch, float* logits, float* hidden, std::span<const int> layers) const {
  check_step(batch);
  for (int l : layers)
    KESTREL_CHECK(l == kFinalHidden || (l >= 0 && l < static_cast<int>(layers_.size())),
                  "hidden states of layer {} asked for, the model has {} layers", l, layers_.size());
  backend_->run_step(batch, [this, hidden, layers](StepOps& ops) { graph(ops, hidden, layers); },
                     StepResults{logits, {}, nullptr});
}

void Model::forward_sampled(const StepBatch& batch, std::span<const SampleRow> rows,
                            std::vector<SampledToken>& out) const {
  check_step(batch);
  backend_->run_step(batch, [this](StepOps& ops) { graph(ops); }, StepResults{nullptr, rows, &out});
}

SequenceState Model::new_sequence() const {
  SequenceState s;
  s.rows.assign(static_cast<size_t>(sequence_plan_.state_rows_per_request * sequence_plan_.row_bytes), 0);
  return s;
}

void Model::load_lora(int32_t id, const LoraAdapter& adapter) {
  KESTREL_CHECK(id > 0, "a LoRA adapter id must be positive, got {}", id);
  backend_->load_lora(id, adapter);
  lora_keys_[id] = (++lora_loads_ << 32) ^ static_cast<uint32_t>(id);
}

void Model::unload_lora(int32_t id) {
  KESTREL_CHECK(has_lora(id), "LoRA adapter {} is not loaded", id);
  backend_->unload_lora(id);
  lora_keys_.erase(id);
}

uint64_t Model::lora_key(int32_t id) const {
  if (id == 0) return 0;
  const auto it = lora_keys_.find(id);
  KESTREL_CHECK(it != lora_keys_.end(), "LoRA adapter {} is not loaded", id);
  return it->second;
}

Act StepOps::host_rows(std::span<const float>, int64_t) { fail("this backend does not run drafters (host rows)"); }
void StepOps::scale_rows(Act, std::span<const float>) { fail("this backend does not run drafters (row scaling)"); }
void StepOps::copy_out(Act, float*, int64_t) { fail("this backend does not run drafters (hidden states)"); }

void Backend::load_lora(int32_t id, const LoraAdapter&) {
  fail("the {} backend does not run LoRA adapters (adapter {})", name(), id);
}

void Model::forward(SequenceState& seq, const int32_t* ids, int64_t T, float* logits, bool last_only,
                    int32_t lora, float* hidden, std::span<const int> layers) const {
  KESTREL_CHECK(T > 0, "forward needs at least one token");
  const CachePlan& plan = sequence_plan_;
  const int64_t end = seq.num_tokens + T;
  const SequenceTables tab = sequence_tables(seq, plan, T);
  const SequenceStep step{std::span(ids, T), seq.num_tokens, T > 1, tab.block_table, tab.slots, tab.state_rows, {},
                          last_only ? T - 1 : 0, lora};
  forward(StepBatch{seq.rows.data(), &plan, std::span(&step, 1)}, logits, hidden, layers);
  seq.num_tokens = end;
}

}  // namespace kestrel
