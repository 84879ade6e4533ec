#include "gpu/cuda_backend.h"

#include <algorithm>
#include <cmath>
#include <cstring>

#include "core/error.h"
#include "core/formats.h"
#include "engine/sampler.h"
#include "gpu/cuda_state.h"
#include "kernels/cpu/attention.h"
#include "kernels/cuda/dsa.h"
#include "kernels/cuda/kda_tc.h"
#include "kernels/cuda/mla_decode.h"
#include "kernels/cuda/runtime.h"
#include "kernels/cuda/sampling.h"
#include "model/weights.h"

namespace kestrel::gpu {

namespace {
constexpr int kFastKdaDim = 128;                      // the chunked and decode KDA kernels' head size
constexpr int kFastLatentC = 512, kFastLatentR = 64;  // the tensor-core MLA kernels' latent
int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }
double gib(size_t b) { return static_cast<double>(b) / double(1 << 30); }
using Clock = std::chrono::steady_clock;
}  // namespace

CudaState::~CudaState() {
  for (cudaEvent_t e : events) cudaEventDestroy(e);
  for (auto& [key, exec] : graphs)
    if (exec) cudaGraphExecDestroy(exec);
  if (stream) cudaStreamDestroy(stream);
}

void CudaState::mark(size_t i) {
  if (!profiling) return;
  while (events.size() <= i) {
    cudaEvent_t e = nullptr;
    KESTREL_CUDA_CHECK(cudaEventCreate(&e));
    events.push_back(e);
  }
  KESTREL_CUDA_CHECK(cudaEventRecord(events[i], stream));
}

namespace {
// The state, once a device is known to be there (its cuBLASLt handles need one).
std::unique_ptr<CudaState> new_state() {
  KESTREL_CHECK(cuda::device_count() > 0, "--device cuda: no CUDA device is visible");
  return std::make_unique<CudaState>();
}
}  // namespace

CudaBackend::CudaBackend(double utilization, std::FILE* log) : s_(new_state()) {
  s_->log = log;
  s_->utilization = utilization;
  s_->budget = DeviceArena::budget(utilization);
  s_->arena = std::make_unique<DeviceArena>(s_->budget);
  KESTREL_CUDA_CHECK(cudaStreamCreateWithFlags(&s_->stream, cudaStreamNonBlocking));
}

CudaBackend::~CudaBackend() = default;

void CudaBackend::configure(const ModelConfig& cfg, const ModelOptions& opts) {
  KESTREL_CHECK(opts.latent_cache != LatentCacheDtype::auto_fp32,
                "the GPU keeps the MLA latent in bf16, FP8 or NVFP4 (--kv-cache-dtype auto, bf16, fp8 or nvfp4), not "
                "fp32");
  s_->cfg = cfg;
  s_->opts = opts;
  s_->uploader = std::make_unique<WeightUploader>(*s_->arena, s_->w.bytes, s_->log);
  s_->fp8_gemm = std::make_unique<cuda::Fp8BlockGemm>();
  if (cfg.use_rope) {
    const std::vector<float> f = cpu::rope_inv_freq(cfg.qk_rope_head_dim, cfg.rope_theta, cfg.yarn ? &*cfg.yarn : nullptr);
    float* d = s_->uploader->take<float>(f.size(), "RoPE frequencies", &WeightBytes::fp32);
    KESTREL_CUDA_CHECK(cudaMemcpy(d, f.data(), f.size() * sizeof(float), cudaMemcpyHostToDevice));
    s_->w.rope_inv_freq = d;
  }
}

EmbeddingW CudaBackend::add_embedding(const StoredTensor& table) {
  const StoredLinear as_linear{WeightFormat::plain, table, {}, table.shape.at(0), table.shape.at(1), 0};
  size_t rounded = 0;
  s_->w.embeddings.push_back(s_->uploader->bf16(as_linear, "embedding", rounded));
  return EmbeddingW{static_cast<int32_t>(s_->w.embeddings.size() - 1)};
}

LinearW CudaBackend::tied_head(EmbeddingW table) {
  DLinear d;
  d.out = s_->cfg.vocab_size;
  d.in = s_->cfg.hidden_size;
  d.parts.push_back({0, d.out, s_->w.embeddings.at(table.id), std::nullopt});
  s_->w.linears.push_back(d);
  return LinearW{static_cast<int32_t>(s_->w.linears.size() - 1), d.out, d.in};
}

LinearW CudaBackend::add_linear(std::span<const StoredLinear> parts) {
  s_->w.linears.push_back(s_->uploader->linear(parts, parts[0].weight.name.c_str()));
  const DLinear& d = s_->w.linears.back();
  return LinearW{static_cast<int32_t>(s_->w.linears.size() - 1), d.out, d.in};
}

VecW CudaBackend::add_vector(const StoredTensor& t) {
  s_->w.vectors.push_back(s_->uploader->f32(t, t.name.c_str()));
  return VecW{static_cast<int32_t>(s_->w.vectors.size() - 1), t.numel()};
}

MlaAttnW CudaBackend::add_mla_attention(const MlaAttnSpec& spec) {
  WeightUploader& up = *s_->uploader;
  DMla m;
  m.kv_b = up.bf16(spec.kv_b, "MLA kv_b_proj", s_->w.rounded);
  m.kv_scale = spec.kv_scale;
  if (spec.indexer) {
    const MlaAttnSpec::Indexer& ix = *spec.indexer;
    // fp32 projections: the indexer's products feed FP8 quantisation and a top-k (dsa_indexer.h).
    auto f32_linear = [&](const StoredLinear& l, const char* what) -> const float* {
      const std::vector<float> v = up.decoded(l);
      float* d = up.take<float>(v.size(), what, &WeightBytes::fp32);
      KESTREL_CUDA_CHECK(cudaMemcpy(d, v.data(), v.size() * sizeof(float), cudaMemcpyHostToDevice));
      return d;
    };
    DsaIndexerWeights w;
    w.wq_b = f32_linear(ix.wq_b, "DSA indexer wq_b");
    w.wk = f32_linear(ix.wk, "DSA indexer wk");
    w.weights_proj = f32_linear(ix.weights_proj, "DSA indexer weights_proj");
    w.k_norm_w = up.f32(ix.k_norm_w, "DSA indexer k_norm");
    w.k_norm_b = up.f32(ix.k_norm_b, "DSA indexer k_norm");
    m.indexer = std::make_unique<DsaIndexerGpu>(w, s_->cfg, s_->opts.index_keys, *s_->arena);
  }
  s_->w.mla.push_back(std::move(m));
  return MlaAttnW{static_cast<int32_t>(s_->w.mla.size() - 1)};
}

KdaW CudaBackend::add_kda(const KdaSpec& spec) {
  WeightUploader& up = *s_->uploader;
  DKda k;
  std::vector<float> conv;
  for (const StoredTensor* c : {&spec.conv_q, &spec.conv_k, &spec.conv_v}) {
    const std::vector<float> v = decode_to_f32(c->dtype, up.host_bytes(*c), c->name);
    conv.insert(conv.end(), v.begin(), v.end());
  }
  float* d = up.take<float>(conv.size(), "KDA conv", &WeightBytes::fp32);
  KESTREL_CUDA_CHECK(cudaMemcpy(d, conv.data(), conv.size() * sizeof(float), cudaMemcpyHostToDevice));
  k.conv_qkv = d;
  k.A_log = up.f32(spec.A_log, "KDA A_log");
  k.dt_bias = up.f32(spec.dt_bias, "KDA dt_bias");
  k.o_norm = up.f32(spec.o_norm, "KDA o_norm");
  s_->w.kda.push_back(k);
  return KdaW{static_cast<int32_t>(s_->w.kda.size() - 1)};
}

MoeW CudaBackend::add_moe(const MoeSpec& spec) {
  WeightUploader& up = *s_->uploader;
  const ModelConfig& cfg = s_->cfg;
  DMoe m;
  m.router = up.f32(spec.router, "MoE router");
  if (spec.bias) m.bias = up.f32(*spec.bias, "MoE router bias");
  m.routing = {spec.n_experts, spec.top_k, spec.n_group, spec.topk_group, spec.renormalize, spec.scaling};
  const int E = spec.n_experts;
  const int64_t D = cfg.hidden_size, F = cfg.moe_intermediate_size;
  cuda::MoeExpertWeights& x = m.experts;
  x.n_experts = E;
  x.D = D;
  x.F = F;
  const WeightFormat format = spec.gate.at(0).format;
  for (int e = 0; e < E; ++e)
    for (const StoredLinear* l : {&spec.gate[e], &spec.up[e], &spec.down[e]})
      KESTREL_CHECK(l->format == format, "MoE experts of one layer in two stored formats ('{}')", l->weight.name);
  const int64_t n = F * D;  // values of one expert's gate, up or down
  if (format == WeightFormat::mxfp4) {
    x.dtype = cuda::ExpertDtype::mxfp4;
    uint8_t* p13 = up.take<uint8_t>(static_cast<size_t>(E * 2 * n / 2), "MoE experts (MXFP4)", &WeightBytes::mxfp4);
    uint8_t* s13 = up.take<uint8_t>(static_cast<size_t>(E * 2 * n / 32), "MoE experts (MXFP4 scales)", &WeightBytes::mxfp4);
    uint8_t* p2 = up.take<uint8_t>(static_cast<size_t>(E * n / 2), "MoE experts (MXFP4)", &WeightBytes::mxfp4);
    uint8_t* s2 = up.take<uint8_t>(static_cast<size_t>(E * n / 32), "MoE experts (MXFP4 scales)", &WeightBytes::mxfp4);
    for (int e = 0; e < E; ++e) {
      up.raw(spec.gate[e].weight, p13 + (2 * e) * n / 2);
      up.raw(spec.gate[e].scales, s13 + (2 * e) * n / 32);
      up.raw(spec.up[e].weight, p13 + (2 * e + 1) * n / 2);
      up.raw(spec.up[e].scales, s13 + (2 * e + 1) * n / 32);
      up.raw(spec.down[e].weight, p2 + e * n / 2);
      up.raw(spec.down[e].scales, s2 + e * n / 32);
    }
    x.w13_packed = p13;
    x.w13_scales = s13;
    x.w2_packed = p2;
    x.w2_scales = s2;
  } else if (format == WeightFormat::fp8_block && fp8_experts_stay_fp8(cfg)) {
    x.dtype = cuda::ExpertDtype::fp8_block;
    const int64_t sn = (F / 128) * (D / 128);  // scales of one gate, up or down
    uint8_t* c13 = up.take<uint8_t>(static_cast<size_t>(E * 2 * n), "MoE experts (FP8)", &WeightBytes::fp8);
    float* s13 = up.take<float>(static_cast<size_t>(E * 2 * sn), "MoE experts (FP8 scales)", &WeightBytes::fp8);
    uint8_t* c2 = up.take<uint8_t>(static_cast<size_t>(E * n), "MoE experts (FP8)", &WeightBytes::fp8);
    float* s2 = up.take<float>(static_cast<size_t>(E * sn), "MoE experts (FP8 scales)", &WeightBytes::fp8);
    for (int e = 0; e < E; ++e) {
      up.raw(spec.gate[e].weight, c13 + (2 * e) * n);
      up.raw(spec.gate[e].scales, s13 + (2 * e) * sn);
      up.raw(spec.up[e].weight, c13 + (2 * e + 1) * n);
      up.raw(spec.up[e].scales, s13 + (2 * e + 1) * sn);
      up.raw(spec.down[e].weight, c2 + e * n);
      up.raw(spec.down[e].scales, s2 + e * sn);
    }
    x.fp8_w13 = c13;
    x.fp8_w13_scales = s13;
    x.fp8_w2 = c2;
    x.fp8_w2_scales = s2;
  } else {
    x.dtype = cuda::ExpertDtype::bf16;
    uint16_t* w13 = up.take<uint16_t>(static_cast<size_t>(E * 2 * n), "MoE experts (bf16)", &WeightBytes::bf16);
    uint16_t* w2 = up.take<uint16_t>(static_cast<size_t>(E * n), "MoE experts (bf16)", &WeightBytes::bf16);
    // bf16 experts, or FP8 ones of shapes the FP8 expert kernels do not take (fp8_experts_stay_fp8), decoded.
    auto put = [&](const StoredLinear& l, uint16_t* at) {
      if (l.format == WeightFormat::plain && l.weight.dtype == DType::BF16) {
        up.raw(l.weight, at);
        return;
      }
      const std::vector<float> v = up.decoded(l);
      std::vector<uint16_t> h(v.size());
      for (size_t i = 0; i < v.size(); ++i) {
        h[i] = f32_to_bf16(v[i]);
        s_->w.rounded += bf16_to_f32(h[i]) != v[i] && v[i] == v[i];
      }
      KESTREL_CUDA_CHECK(cudaMemcpy(at, h.data(), h.size() * 2, cudaMemcpyHostToDevice));
    };
    for (int e = 0; e < E; ++e) {
      put(spec.gate[e], w13 + (2 * e) * n);
      put(spec.up[e], w13 + (2 * e + 1) * n);
      put(spec.down[e], w2 + e * n);
    }
    x.w13 = w13;
    x.w2 = w2;
  }
  s_->w.moe.push_back(m);
  return MoeW{static_cast<int32_t>(s_->w.moe.size() - 1)};
}

void CudaBackend::finalize_weights() {
  s_->uploader->finish();
  s_->uploader.reset();
}

size_t CudaBackend::weight_bytes() const { return s_->w.bytes.total(); }
size_t CudaBackend::workspace_bytes() const { return s_->workspace_bytes; }
size_t CudaBackend::rounded_weights() const { return s_->w.rounded; }
bool CudaBackend::prepared() const { return s_->prepared; }
const GpuLimits& CudaBackend::limits() const { return s_->limits; }
DeviceArena& CudaBackend::arena() { return *s_->arena; }
cudaStream_t CudaBackend::stream() const { return s_->stream; }
void CudaBackend::set_cuda_graphs(bool on) { s_->graphs_on = on; }
size_t CudaBackend::num_cuda_graphs() const {
  size_t n = 0;
  for (const auto& [key, exec] : s_->graphs) n += exec != nullptr;
  return n;
}
void CudaBackend::set_gpu_sampling(bool on) { s_->sampling_on = on; }
void CudaBackend::set_tensor_core_kda_prefill(bool on) { s_->tensor_core_kda = on; }
void CudaBackend::set_profiling(bool on) { s_->profiling = on; }
const CudaBackend::StepTimes& CudaBackend::last_step_times() const { return s_->times; }

bool CudaBackend::samples_rows(const SamplingParams& p) const {
  return s_->sampling_on && s_->s.sampled_tokens != nullptr && p.logprobs <= cuda::kMaxSampleTopLogprobs;
}

void CudaBackend::print_memory(std::FILE* out, size_t stored_bytes) const {
  if (!out) return;
  const WeightBytes& w = s_->w.bytes;
  std::fprintf(out,
               "[kestrel] GPU memory: budget %.2f GiB (--gpu-memory-utilization %.2f): weights %.3f GiB (bf16 %.3f, "
               "fp8 %.3f, mxfp4 %.3f, fp32 %.3f; %.4f of the checkpoint's %.3f GiB), workspaces %.3f GiB, left for "
               "the cache %.3f GiB\n",
               gib(s_->budget), s_->utilization, gib(w.total()), gib(w.bf16), gib(w.fp8), gib(w.mxfp4), gib(w.fp32),
               stored_bytes ? static_cast<double>(w.total()) / static_cast<double>(stored_bytes) : 0.0,
               gib(stored_bytes), gib(s_->workspace_bytes), gib(s_->arena->remaining()));
}

void CudaBackend::prepare(const Model& model, const GpuLimits& limits) {
  CudaState& st = *s_;
  KESTREL_CHECK(!st.prepared, "the CUDA backend's workspaces are sized once");
  KESTREL_CHECK(limits.max_tokens > 0 && limits.max_seqs > 0 && limits.max_model_len > 0 && limits.block_size > 0,
                "GPU limits must be positive (tokens {}, seqs {}, model len {}, block {})", limits.max_tokens,
                limits.max_seqs, limits.max_model_len, limits.block_size);
  st.limits = limits;
  const ModelConfig& cfg = st.cfg;
  DeviceArena& arena = *st.arena;
  StepScratch& s = st.s;
  const size_t before = arena.used();
  const int64_t N = limits.max_tokens, S = std::min<int64_t>(limits.max_seqs, N), D = cfg.hidden_size;
  auto f32 = [&](int64_t n, const char* what) {
    return arena.take_n<float>(static_cast<size_t>(std::max<int64_t>(n, 1)), what);
  };
  auto b16 = [&](int64_t n, const char* what) {
    return arena.take_n<uint16_t>(static_cast<size_t>(std::max<int64_t>(n, 1)), what);
  };
  // The activations of the model's graph for N tokens.
  s.act_bytes = activation_stack_bytes(model, N);
  s.act_base = arena.take_n<uint8_t>(s.act_bytes, "activations");
  // The FP8 products' quantized activations and staged outputs, for the largest of them (the LM head's rows too).
  for (const DLinear& l : st.w.linears)
    for (const DLinear::Part& p : l.parts)
      if (p.fp8)  // any M <= N: an M that is not a multiple of 4 also stages its output, so the largest is in N-3..N
        for (int64_t M = std::max<int64_t>(1, N - 3); M <= N; ++M)
          s.fp8_ws_bytes = std::max(s.fp8_ws_bytes, cuda::Fp8BlockGemm::workspace_bytes(M, p.rows, l.in));
  if (s.fp8_ws_bytes) s.fp8_ws = arena.take(s.fp8_ws_bytes, "FP8 activations");

  if (cfg.num_layers_of(LayerKind::kda) > 0) {
    const int64_t H = cfg.kda_num_heads, dk = cfg.kda_head_dim, P = H * dk;
    s.q = f32(N * 3 * P, "KDA q/k/v");
    s.k = s.q + N * P;
    s.v = s.k + N * P;
    s.kda_o = f32(N * P, "KDA output");
    if (dk == kFastKdaDim && st.opts.kda_chunked_prefill) {
      // The most chunks a step can have: every sequence but one of two tokens across a chunk boundary (two chunks
      // each), the last one with the rest, starting one token before a boundary: 2 (S - 1) + 1 + ceil((n - 1) / 64).
      const int64_t pairs = std::min<int64_t>(S - 1, (N - 1) / 2);
      std::vector<int64_t> cu{0}, start;
      for (int64_t i = 0; i < pairs; ++i) {
        cu.push_back(cu.back() + 2);
        start.push_back(63);
      }
      cu.push_back(N);
      start.push_back(63);
      const cuda::KdaPrefillPlan worst(cu, start);
      s.kda_ws_bytes = worst.workspace_bytes(static_cast<int>(H)) + size_t{2} * S * 64 * sizeof(int64_t);
      s.kda_ws = arena.take(s.kda_ws_bytes, "KDA prefill workspace");
      s.kda_checkpoint_states = static_cast<size_t>(ceil_div(N, limits.block_size) + S);
      s.kda_checkpoints = f32(static_cast<int64_t>(s.kda_checkpoint_states) * H * dk * dk, "KDA checkpoints");
    }
  }
  if (cfg.num_layers_of(LayerKind::mla) > 0) {
    const int64_t H = cfg.num_attention_heads, C = cfg.kv_lora_rank, R = cfg.qk_rope_head_dim;
    s.q_abs = f32(N * H * (C + R), "MLA absorbed queries");
    s.q_abs_bf = b16(N * H * (C + R), "MLA absorbed queries");
    s.obar = f32(N * H * C, "MLA attention output");
    s.obar_bf = b16(N * H * C, "MLA attention output");
    s.lse = f32(N * H, "MLA lse");
    const bool fast_shape = C == kFastLatentC && R == kFastLatentR;
    if (cfg.has_indexer) {
      s.index_topk = cfg.index_topk;
      s.indices = arena.take_n<int32_t>(static_cast<size_t>(N * cfg.index_topk), "DSA selected positions");
      if (fast_shape) {
        for (int b = 1; b <= S; ++b)
          s.sparse_ws_bytes = std::max(s.sparse_ws_bytes, cuda::sparse_mla_decode_workspace_bytes(
                                                              b, 1, static_cast<int>(H), cfg.index_topk));
        for (int64_t n = 1; n <= N; ++n)
          s.sparse_ws_bytes = std::max(s.sparse_ws_bytes, cuda::sparse_mla_decode_workspace_bytes(
                                                              1, static_cast<int>(n), static_cast<int>(H), cfg.index_topk));
        if (s.sparse_ws_bytes) s.sparse_ws = arena.take(s.sparse_ws_bytes, "sparse MLA workspace");
      }
      // The DSA indexers: the first takes the step workspace, the others share it (layers run one after another).
      std::shared_ptr<DsaIndexerWorkspace> shared;
      for (DMla& m : st.w.mla) {
        if (!m.indexer) continue;
        if (shared) {
          m.indexer->share_workspace(shared);
        } else {
          m.indexer->make_workspace(N, static_cast<int>(S), limits.max_model_len, arena);
          shared = m.indexer->workspace();
        }
      }
    } else if (fast_shape) {
      // The dense kernel's split of the context (and so its scratch) depends on the shape in ways that are not
      // monotone: the largest over every shape a step can launch (decode batches of 1..S, prompts of 1..N tokens) at
      // lengths up to max_model_len in powers of two and max_model_len itself.
      const int L = static_cast<int>(std::min<int64_t>(limits.max_model_len, int64_t{1} << 30));
      std::vector<int> lens;
      for (int len = 1; len < L; len *= 2) lens.push_back(len);
      lens.push_back(L);
      const int heads = static_cast<int>(H);
      for (int len : lens) {
        for (int b = 1; b <= S; ++b)
          s.mla_ws_bytes = std::max(s.mla_ws_bytes, cuda::mla_decode_workspace_bytes(b, 1, heads, len));
        for (int n = 1; n <= std::min<int64_t>(N, len); ++n)
          s.mla_ws_bytes = std::max(s.mla_ws_bytes, cuda::mla_decode_workspace_bytes(1, n, heads, len));
      }
      if (s.mla_ws_bytes) s.mla_ws = arena.take(s.mla_ws_bytes, "MLA decode workspace");
    }
  }
  int64_t E_max = 0, K_max = 0;
  for (const DMoe& m : st.w.moe) {
    E_max = std::max<int64_t>(E_max, m.routing.n_experts);
    K_max = std::max<int64_t>(K_max, m.routing.top_k);
    s.moe_ws_bytes = std::max(s.moe_ws_bytes, cuda::moe_workspace_bytes(N, m.routing.top_k, m.routing.n_experts, D,
                                                                        cfg.moe_intermediate_size, m.experts.dtype));
  }
  if (E_max > 0) {
    s.router_logits = f32(N * E_max, "router logits");
    s.route_w = f32(N * K_max, "routing weights");
    s.route_ids = arena.take_n<int32_t>(static_cast<size_t>(N * K_max), "routing ids");
    s.moe_ws = arena.take(s.moe_ws_bytes, "MoE workspace");
  }
  s.hw = f32(N * D, "final hidden states");
  s.hw_bf = b16(N * D, "final hidden states");
  s.logits_rows = std::max<int64_t>(std::min<int64_t>(N, std::max<int64_t>(S, 64)), 1);
  s.logits = f32(s.logits_rows * cfg.vocab_size, "logits");
  // Step tables: per token ids, slots, request and position; per sequence block tables, lengths, state slots and
  // conv-history pointers; per prompt sequence its cumulative lengths.
  const int64_t max_blocks = ceil_div(limits.max_model_len, limits.block_size) + 1;
  const int64_t groups = std::max<int64_t>(1, cfg.num_layers_of(LayerKind::kda));
  const size_t table_bytes = static_cast<size_t>(N * 32 + S * max_blocks * 4 + S * (groups * 4 + 64) +
                                                 groups * 3 * S * 8 + 2 * (N + S) * 16) +
                             (size_t{1} << 20);
  s.staging = std::make_unique<Staging>(arena, table_bytes);
  // Sampling: one row per sequence (the engine samples on the GPU only when no request keeps its logits), penalty
  // lists of up to 2048 tokens a row on average (more: the step samples on the host from copied logits).
  s.sample_rows = std::min<int64_t>(S, s.logits_rows);
  if (cfg.vocab_size <= cuda::kMaxSampleVocab) {
    const int64_t K = cuda::kMaxSampleTopLogprobs;
    s.sampled_tokens = arena.take_n<int32_t>(s.sample_rows, "sampled tokens");
    s.sampled_logprobs = f32(s.sample_rows, "sampled log-probabilities");
    s.sampled_top_ids = arena.take_n<int32_t>(s.sample_rows * K, "sampled alternatives");
    s.sampled_top_logprobs = f32(s.sample_rows * K, "sampled alternatives");
    s.sample_ws_bytes = cuda::sample_rows_workspace_bytes(s.sample_rows, cfg.vocab_size);
    s.sample_ws = arena.take(s.sample_ws_bytes, "sampling workspace");
    s.sample_penalty_capacity = static_cast<size_t>(s.sample_rows) * 2048;
    // Per row: its parameters, source and mask index, and a token mask (structured output).
    const size_t mask_bytes = static_cast<size_t>((cfg.vocab_size + 31) / 32) * sizeof(uint32_t);
    s.sample_staging = std::make_unique<Staging>(
        arena, static_cast<size_t>(s.sample_rows) * (sizeof(cuda::SampleRowParams) + 32 + mask_bytes) +
                   s.sample_penalty_capacity * sizeof(cuda::SamplePenaltyToken) + 4096);
  }
  st.max_blocks = max_blocks;
  st.workspace_bytes = arena.used() - before;
  st.prepared = true;
}

namespace {

void record_times(CudaState& st, Clock::time_point t0, Clock::time_point t1, Clock::time_point t2) {
  if (!st.profiling) return;
  const auto t3 = Clock::now();
  auto ms = [](auto a, auto b) { return std::chrono::duration<double, std::milli>(b - a).count(); };
  auto between = [&](size_t a, size_t b) {
    float v = 0;
    KESTREL_CUDA_CHECK(cudaEventElapsedTime(&v, st.events[a], st.events[b]));
    return v;
  };
  st.times = CudaBackend::StepTimes{};
  st.times.graph = st.tables.graph;
  st.times.prepare_ms = ms(t0, t1);
  st.times.gpu_ms = between(0, 1);
  // The copy (and GPU sampling) waits for the kernels: its own time is what the host waited beyond them.
  st.times.copy_ms = std::max(0.0, ms(t2, t3) - st.times.gpu_ms);
  if (!st.tables.graph)
    for (size_t l = 0; l < st.cfg.layer_kinds.size(); ++l) st.times.layer_ms.push_back(between(2 + l, 3 + l));
}

// The LM head over wanted rows [r0, r0 + rows) of the step (past the first logits_rows, which the step's graph ran).
void lm_head(CudaState& st, int64_t r0, int64_t rows) {
  StepScratch& s = st.s;
  const int64_t D = st.cfg.hidden_size, V = st.cfg.vocab_size;
  if (s.head_fp8)
    st.fp8_gemm->linear(s.hw + r0 * D, rows, D, *s.head_fp8, s.logits, V, s.fp8_ws, s.fp8_ws_bytes, st.stream);
  else
    st.gemm.linear(s.hw_bf + r0 * D, rows, D, D, s.head_bf16, V, s.logits, V, st.stream);
}

// Each row's token chosen on the GPU (kernels/cuda/sampling.h: what sample_token does); only the tokens (and asked-for
// log-probabilities) come to the host. Rows whose penalty lists do not fit the buffers are sampled on the host.
void sample(CudaState& st, std::span<const SampleRow> rows, std::vector<SampledToken>& out) {
  const StepTables& t = st.tables;
  StepScratch& s = st.s;
  const cudaStream_t stream = st.stream;
  const int64_t V = st.cfg.vocab_size;
  out.assign(rows.size(), SampledToken{});
  KESTREL_CHECK(t.wanted <= s.logits_rows && static_cast<int64_t>(rows.size()) <= s.sample_rows,
                "a step sampling {} rows of {} wanted exceeds the GPU's sampling buffers", rows.size(), t.wanted);
  size_t penalties = 0;
  for (const SampleRow& r : rows) penalties += r.penalties.size();
  if (penalties > s.sample_penalty_capacity) {
    std::vector<float> host(static_cast<size_t>(t.wanted * V));
    KESTREL_CUDA_CHECK(cudaMemcpyAsync(host.data(), s.logits, host.size() * sizeof(float), cudaMemcpyDeviceToHost, stream));
    KESTREL_CUDA_CHECK(cudaStreamSynchronize(stream));
    for (size_t i = 0; i < rows.size(); ++i)
      out[i].token = sample_token(*rows[i].params, host.data() + rows[i].logits_row * V, V, rows[i].uniform,
                                  rows[i].penalties, rows[i].params->logprobs >= 0 ? &out[i].logprob : nullptr,
                                  rows[i].token_mask);
    return;
  }
  std::vector<cuda::SampleRowParams> params(rows.size());
  std::vector<int32_t> source(rows.size()), offsets{0}, mask_index(rows.size(), -1);
  std::vector<cuda::SamplePenaltyToken> tokens;
  // Structured output: the masked rows' masks back to back (mask_words each), and each row's index among them.
  const int64_t mask_words = (V + 31) / 32;
  std::vector<uint32_t> masks;
  int max_top = 0;
  bool greedy_only = true;  // then sample_rows is one launch (SampleRowsArgs::greedy_only)
  for (size_t i = 0; i < rows.size(); ++i) {
    if (!rows[i].token_mask.empty()) {
      KESTREL_CHECK(static_cast<int64_t>(rows[i].token_mask.size()) == mask_words,
                    "a token mask of {} words for a vocabulary of {} tokens", rows[i].token_mask.size(), V);
      mask_index[i] = static_cast<int32_t>(masks.size() / mask_words);
      masks.insert(masks.end(), rows[i].token_mask.begin(), rows[i].token_mask.end());
    }
    const SamplingParams& p = *rows[i].params;
    params[i] = {rows[i].uniform, p.temperature, p.top_p, p.min_p, p.presence_penalty, p.frequency_penalty,
                 p.repetition_penalty, p.top_k, p.logprobs};
    source[i] = static_cast<int32_t>(rows[i].logits_row);
    for (const PenaltyToken& pt : rows[i].penalties) tokens.push_back({pt.token, pt.generated});
    offsets.push_back(static_cast<int32_t>(tokens.size()));
    max_top = std::max(max_top, p.logprobs);
    greedy_only = greedy_only && p.temperature == 0.0f;
  }
  Staging& tab = *s.sample_staging;
  tab.reset();
  cuda::SampleRowsArgs a;
  a.logits = s.logits;
  a.logit_rows = t.wanted;
  a.vocab = V;
  a.rows = static_cast<int64_t>(rows.size());
  a.source_rows = tab.put(source);
  a.params = tab.put(params);
  a.penalty_offsets = tokens.empty() ? nullptr : tab.put(offsets);
  a.penalty_tokens = tokens.empty() ? nullptr : tab.put(tokens);
  if (!masks.empty()) {
    a.token_masks = tab.put(masks);
    a.mask_index = tab.put(mask_index);
    a.mask_words = mask_words;
  }
  tab.flush(stream);
  a.tokens = s.sampled_tokens;
  a.token_logprobs = s.sampled_logprobs;
  a.top_ids = s.sampled_top_ids;
  a.top_logprobs = s.sampled_top_logprobs;
  a.max_top_logprobs = std::min(max_top, cuda::kMaxSampleTopLogprobs);
  a.greedy_only = greedy_only;
  cuda::sample_rows(a, s.sample_ws, s.sample_ws_bytes, stream);
  // The kernel writes each row's alternatives at a stride of a.max_top_logprobs (not kMaxSampleTopLogprobs).
  const size_t n = rows.size(), K = static_cast<size_t>(a.max_top_logprobs);
  std::vector<int32_t> tok(n), top_ids(n * K);
  std::vector<float> lp(n), top_lp(n * K);
  KESTREL_CUDA_CHECK(cudaMemcpyAsync(tok.data(), s.sampled_tokens, n * sizeof(int32_t), cudaMemcpyDeviceToHost, stream));
  KESTREL_CUDA_CHECK(cudaMemcpyAsync(lp.data(), s.sampled_logprobs, n * sizeof(float), cudaMemcpyDeviceToHost, stream));
  if (max_top > 0) {
    KESTREL_CUDA_CHECK(
        cudaMemcpyAsync(top_ids.data(), s.sampled_top_ids, n * K * sizeof(int32_t), cudaMemcpyDeviceToHost, stream));
    KESTREL_CUDA_CHECK(
        cudaMemcpyAsync(top_lp.data(), s.sampled_top_logprobs, n * K * sizeof(float), cudaMemcpyDeviceToHost, stream));
  }
  KESTREL_CUDA_CHECK(cudaStreamSynchronize(stream));
  for (size_t i = 0; i < n; ++i) {
    out[i].token = tok[i];
    const int want = rows[i].params->logprobs;
    if (want < 0) continue;
    out[i].logprob.token = tok[i];
    out[i].logprob.logprob = lp[i];
    for (int k = 0; k < want; ++k) out[i].logprob.top.emplace_back(top_ids[i * K + k], top_lp[i * K + k]);
  }
}

}  // namespace

void CudaBackend::run_step(const StepBatch& batch, const std::function<void(StepOps&)>& graph,
                           const StepResults& results) {
  for (const SequenceStep& q : batch.seqs)
    KESTREL_CHECK(q.lora == 0, "the CUDA backend does not run LoRA adapters yet (a request with adapter {})", q.lora);
  CudaState& st = *s_;
  const auto t0 = Clock::now();
  if (!st.prepare_tables(batch)) {
    if (results.sampled) results.sampled->assign(results.sample.size(), SampledToken{});
    return;
  }
  const auto t1 = Clock::now();
  st.mark(0);
  st.launch(batch, graph);
  st.mark(1);
  const auto t2 = Clock::now();
  const StepTables& t = st.tables;
  const StepScratch& s = st.s;
  const int64_t V = st.cfg.vocab_size;
  if (results.sampled) {
    sample(st, results.sample, *results.sampled);
  } else {
    for (int64_t r0 = 0; results.logits && r0 < t.wanted; r0 += s.logits_rows) {
      const int64_t rows = std::min(s.logits_rows, t.wanted - r0);
      if (r0 > 0) lm_head(st, r0, rows);
      KESTREL_CUDA_CHECK(
          cudaMemcpyAsync(results.logits + r0 * V, s.logits, rows * V * sizeof(float), cudaMemcpyDeviceToHost, st.stream));
      KESTREL_CUDA_CHECK(cudaStreamSynchronize(st.stream));
    }
    // Synchronous also when no logits are wanted (a middle prompt chunk): the next step reuses the staging buffer.
    KESTREL_CUDA_CHECK(cudaStreamSynchronize(st.stream));
  }
  record_times(st, t0, t1, t2);
}

CudaBackend& cuda_backend(const Model& model) {
  auto* b = dynamic_cast<CudaBackend*>(&model.backend());
  KESTREL_CHECK(b != nullptr, "the model was loaded into the {} backend, not the CUDA one", model.backend().name());
  return *b;
}

}  // namespace kestrel::gpu
