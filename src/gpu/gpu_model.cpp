#include "gpu/gpu_model.h"

#include <algorithm>
#include <array>
#include <chrono>
#include <cmath>
#include <cstring>
#include <optional>

#include "core/error.h"
#include "core/formats.h"
#include "gpu/dsa_indexer.h"
#include "kernels/cuda/dsa.h"
#include "kernels/cuda/fp4_cache.h"
#include "kernels/cuda/gemm.h"
#include "kernels/cuda/gemm_fp8.h"
#include "kernels/cuda/kda.h"
#include "kernels/cuda/kda_glue.h"
#include "kernels/cuda/kda_tc.h"
#include "kernels/cuda/linear_f32.h"
#include "kernels/cuda/mla_decode.h"
#include "kernels/cuda/mla_glue.h"
#include "kernels/cuda/moe.h"
#include "kernels/cuda/ops.h"
#include "kernels/cuda/runtime.h"
#include "kernels/cuda/sampling.h"
#include "kernels/cuda/short_conv_parts.h"
#include "kernels/cuda/v32_glue.h"

namespace kestrel {

namespace {
constexpr float kLatentNormEps = 1e-6f;  // as model/layers.cpp
constexpr int kFastKdaDim = 128;         // the chunked and decode KDA kernels' head size
constexpr int kFastLatentC = 512, kFastLatentR = 64;  // the tensor-core MLA decode kernel's latent

// Whether MLA attention runs the tensor-core kernels (dense mla_decode, sparse sparse_mla_decode): they read Kimi's
// FP8 entry of C = 512, R = 64. Everything else -- other shapes and deepseek_v32's tiled FP8 entry -- runs the
// generic fp32 kernel (mla_glue.h), except for fast_sparse_mla below.
bool fast_mla(const ModelConfig& cfg) {
  return cfg.kv_lora_rank == kFastLatentC && cfg.qk_rope_head_dim == kFastLatentR && cfg.arch != Arch::deepseek_v32;
}
// Whether the DSA's sparse MLA runs sparse_mla_decode: it also reads deepseek_v32's FP8 entry (SparseMlaEntry::v32_fp8)
// of C = 512, R = 64.
bool fast_sparse_mla(const ModelConfig& cfg) {
  return cfg.kv_lora_rank == kFastLatentC && cfg.qk_rope_head_dim == kFastLatentR;
}
static_assert(cuda::v32_latent_entry_bytes(kFastLatentC, kFastLatentR) == cuda::kV32LatentEntryBytes,
              "the sparse MLA kernel's deepseek_v32 entry is the cache's");
}  // namespace

// ---------------------------------------------------------------- device weights

namespace gpu {

struct DLinear {
  const uint16_t* w = nullptr;  // bf16 [out, in]
  int64_t out = 0, in = 0;
  // The checkpoint's FP8 codes and block scales (Linear::fp8), when it stores the weight so; see linear() below.
  std::optional<cuda::Fp8BlockMatrix> fp8;
};

struct DKda {
  DLinear qkv;   // [q; k; v]: [3P, D], one GEMM for the three projections
  DLinear fg_a;  // [f_a; g_a]: [2dk, D]
  DLinear f_b, b, g_b, o;
  const float* conv_qkv = nullptr;  // [3P, W]: the taps of q, k and v stacked
  const float *A_log = nullptr, *dt_bias = nullptr, *o_norm = nullptr;
};

struct DMla {
  std::optional<DLinear> q_a, q_b, q_proj;
  const float* q_a_norm = nullptr;
  DLinear kv_a, o_proj;
  const float* kv_a_norm = nullptr;
  const uint16_t* kv_b = nullptr;  // bf16 [H * (dn + dv), C]
  float kv_scale = 1.0f;
  const float* inv_freq = nullptr;  // [R / 2] with RoPE (deepseek_v32): MlaAttention's table
  cuda::LatentEntry entry = cuda::LatentEntry::kimi_fp8;  // the cache's latent entry layout
  IndexKeyDtype keys = IndexKeyDtype::fp8;
};

struct DFfn {
  DLinear w13;  // [gate ; up]: [2F, D]
  DLinear down;
  int64_t F = 0;
};

struct DMoe {
  const float* router = nullptr;  // fp32 [E, D]
  const float* bias = nullptr;    // fp32 [E] or null
  cuda::MoeRoutingParams routing;
  cuda::MoeExpertWeights experts;
  std::optional<DFfn> shared;
};

struct DLayer {
  const float *input_norm = nullptr, *post_norm = nullptr;
  std::optional<DKda> kda;
  std::optional<DMla> mla;
  std::optional<DFfn> dense;
  std::optional<DMoe> moe;
};

struct DeviceWeights {
  const uint16_t* embed = nullptr;  // bf16 [V, D]
  const uint16_t* lm_head = nullptr;
  const float* final_norm = nullptr;
  std::vector<DLayer> layers;
  std::vector<std::unique_ptr<DsaIndexerGpu>> indexers;  // per layer: the MLA layer's DSA indexer, or null
};

// Copies host tensors into the arena in the forms the kernels take.
class Uploader {
 public:
  explicit Uploader(DeviceArena& arena) : arena_(arena) {}

  const float* f32(const Tensor& t, const char* what) { return f32(t.data.data(), t.data.size(), what); }
  const float* f32(const float* p, size_t n, const char* what) {
    float* d = arena_.take_n<float>(n, what);
    copy(d, p, n * sizeof(float));
    return d;
  }
  const uint16_t* bf16(const std::vector<const Tensor*>& parts, const char* what) {
    size_t n = 0;
    for (const Tensor* t : parts) n += t->data.size();
    std::vector<uint16_t> h(n);
    size_t at = 0;
    for (const Tensor* t : parts)
      for (float v : t->data) {
        h[at] = f32_to_bf16(v);
        rounded_ += bf16_to_f32(h[at++]) != v && v == v;
      }
    uint16_t* d = arena_.take_n<uint16_t>(n, what);
    copy(d, h.data(), n * sizeof(uint16_t));
    return d;
  }
  DLinear linear(const Linear& l, const char* what) {
    DLinear d{bf16({&l.w}, what), l.out(), l.in(), {}};
    if (l.fp8) d.fp8 = fp8_block({&*l.fp8}, d.out, d.in, what);
    return d;
  }
  // Linears of one input width stacked by rows: one GEMM for several projections of the same input.
  DLinear stacked(const std::vector<const Linear*>& parts, const char* what) {
    const Linear& first = *parts[0];
    std::vector<const Tensor*> w;
    std::vector<const Fp8BlockWeight*> fp8;
    int64_t out = 0;
    // The scale rows stack when every part has FP8 codes of one block size and every part but the last ends on a
    // block boundary (DeepSeek-V3.2's widths are multiples of 128).
    bool fp8_stacks = first.fp8.has_value();
    for (size_t i = 0; i < parts.size(); ++i) {
      const Linear& l = *parts[i];
      KESTREL_CHECK(l.in() == first.in(), "{}: stacked weights of different widths", what);
      w.push_back(&l.w);
      out += l.out();
      fp8_stacks = fp8_stacks && l.fp8 && l.fp8->block == first.fp8->block &&
                   (i + 1 == parts.size() || l.out() % l.fp8->block == 0);
      if (l.fp8) fp8.push_back(&*l.fp8);
    }
    DLinear d{bf16(w, what), out, first.in(), {}};
    if (fp8_stacks) d.fp8 = fp8_block(fp8, d.out, d.in, what);
    return d;
  }
  // FP8 codes and scales of weights stacked by rows, all of one block size; none for a block the kernel does not
  // take (not a multiple of 16: such a weight runs on its bf16 copy at every size).
  std::optional<cuda::Fp8BlockMatrix> fp8_block(const std::vector<const Fp8BlockWeight*>& parts, int64_t out,
                                                int64_t in, const char* what) {
    const int block = parts[0]->block;
    if (block % 16 != 0) return std::nullopt;
    std::vector<uint8_t> codes;
    std::vector<float> scales;
    for (const Fp8BlockWeight* p : parts) {
      codes.insert(codes.end(), p->codes.begin(), p->codes.end());
      scales.insert(scales.end(), p->scales.begin(), p->scales.end());
    }
    KESTREL_CHECK(static_cast<int64_t>(codes.size()) == out * in &&
                      static_cast<int64_t>(scales.size()) == (out + block - 1) / block * ((in + block - 1) / block),
                  "{}: FP8 codes and scales do not match a [{}, {}] weight", what, out, in);
    return cuda::Fp8BlockMatrix{bytes(codes, what), f32(scales.data(), scales.size(), what), out, in, block};
  }
  const uint8_t* bytes(const std::vector<uint8_t>& h, const char* what) {
    uint8_t* d = arena_.take_n<uint8_t>(h.size(), what);
    copy(d, h.data(), h.size());
    return d;
  }
  size_t uploaded() const { return uploaded_; }
  // Weights whose bf16 copy is not their exact value (none for bf16 checkpoints, nor for FP8 ones with power-of-two
  // block scales such as DeepSeek-V3.2's ue8m0).
  size_t rounded() const { return rounded_; }

 private:
  void copy(void* d, const void* h, size_t n) {
    KESTREL_CUDA_CHECK(cudaMemcpy(d, h, n, cudaMemcpyHostToDevice));
    uploaded_ += n;
  }
  DeviceArena& arena_;
  size_t uploaded_ = 0, rounded_ = 0;
};

}  // namespace gpu

// The one friend of the model's modules: reads their host weights for the upload.
struct GpuWeightAccess {
  static gpu::DKda kda(const KdaMixer& m, gpu::Uploader& up) {
    gpu::DKda d;
    d.qkv = up.stacked({&m.q_, &m.k_, &m.v_}, "KDA q/k/v_proj");
    d.fg_a = up.stacked({&m.f_a_, &m.g_a_}, "KDA f_a/g_a_proj");
    d.f_b = up.linear(m.f_b_, "KDA f_b_proj");
    d.b = up.linear(m.b_, "KDA b_proj");
    d.g_b = up.linear(m.g_b_, "KDA g_b_proj");
    d.o = up.linear(m.o_, "KDA o_proj");
    std::vector<float> conv;
    for (const Tensor* c : {&m.conv_q_, &m.conv_k_, &m.conv_v_}) conv.insert(conv.end(), c->data.begin(), c->data.end());
    d.conv_qkv = up.f32(conv.data(), conv.size(), "KDA conv");
    d.A_log = up.f32(m.A_log_, "KDA A_log");
    d.dt_bias = up.f32(m.dt_bias_, "KDA dt_bias");
    d.o_norm = up.f32(m.o_norm_, "KDA o_norm");
    return d;
  }

  static gpu::DMla mla(const MlaAttention& m, gpu::Uploader& up) {
    const ModelConfig& cfg = m.cfg_;
    KESTREL_CHECK(m.latent_ != LatentCacheDtype::auto_fp32,
                  "the GPU engine keeps the MLA latent in FP8 or NVFP4 (--kv-cache-dtype fp8 or nvfp4), not fp32");
    gpu::DMla d;
    d.entry = m.latent_ == LatentCacheDtype::nvfp4 ? cuda::LatentEntry::nvfp4
              : cfg.arch == Arch::deepseek_v32     ? cuda::LatentEntry::v32_fp8
                                                   : cuda::LatentEntry::kimi_fp8;
    d.keys = m.keys_;
    if (m.q_a_) {
      d.q_a = up.linear(*m.q_a_, "MLA q_a_proj");
      d.q_a_norm = up.f32(m.q_a_norm_, "MLA q_a_layernorm");
      d.q_b = up.linear(*m.q_b_, "MLA q_b_proj");
    } else {
      d.q_proj = up.linear(*m.q_proj_, "MLA q_proj");
    }
    d.kv_a = up.linear(m.kv_a_, "MLA kv_a_proj");
    d.kv_a_norm = up.f32(m.kv_a_norm_, "MLA kv_a_layernorm");
    d.kv_b = up.bf16({&m.kv_b_}, "MLA kv_b_proj");
    d.o_proj = up.linear(m.o_proj_, "MLA o_proj");
    d.kv_scale = m.kv_scale_;
    if (cfg.use_rope) d.inv_freq = up.f32(m.inv_freq_.data(), m.inv_freq_.size(), "MLA RoPE frequencies");
    return d;
  }

  static gpu::DFfn ffn(const FeedForward& f, gpu::Uploader& up) {
    return {up.stacked({&f.gate, &f.up}, "FFN gate/up"), up.linear(f.down, "FFN down"), f.gate.out()};
  }

  static gpu::DMoe moe(const MoE& m, const ModelConfig& cfg, gpu::Uploader& up) {
    gpu::DMoe d;
    d.router = up.f32(m.router_, "MoE router");
    if (!m.bias_.empty()) d.bias = up.f32(m.bias_, "MoE router bias");
    d.routing = {m.routing_.n_experts, m.routing_.top_k, m.routing_.n_group, m.routing_.topk_group,
                 m.routing_.renormalize, m.routing_.scaling};
    const int E = m.routing_.n_experts;
    const int64_t D = cfg.hidden_size, F = cfg.moe_intermediate_size;
    cuda::MoeExpertWeights& x = d.experts;
    x.n_experts = E;
    x.D = D;
    x.F = F;
    if (cfg.weight_quant == WeightQuant::mxfp4 && mxfp4_exact(m, D, F)) {
      // The checkpoint's MXFP4 experts, re-encoded from their decoded values: mxfp4_exact checked that this gives
      // back exactly the values the CPU computes with.
      x.dtype = cuda::ExpertDtype::mxfp4;
      std::vector<uint8_t> p13(E * 2 * F * D / 2), s13(E * 2 * F * D / 32), p2(E * D * F / 2), s2(E * D * F / 32);
      for (int e = 0; e < E; ++e) {
        const FeedForward& f = m.experts_[e];
        const int64_t n = F * D;
        mxfp4_encode(f.gate.w.ptr(), n, p13.data() + (2 * e) * n / 2, s13.data() + (2 * e) * n / 32);
        mxfp4_encode(f.up.w.ptr(), n, p13.data() + (2 * e + 1) * n / 2, s13.data() + (2 * e + 1) * n / 32);
        mxfp4_encode(f.down.w.ptr(), n, p2.data() + e * n / 2, s2.data() + e * n / 32);
      }
      x.w13_packed = up.bytes(p13, "MoE experts (MXFP4)");
      x.w13_scales = up.bytes(s13, "MoE experts (MXFP4 scales)");
      x.w2_packed = up.bytes(p2, "MoE experts (MXFP4)");
      x.w2_scales = up.bytes(s2, "MoE experts (MXFP4 scales)");
    } else {
      x.dtype = cuda::ExpertDtype::bf16;
      std::vector<const Tensor*> w13, w2;
      for (const FeedForward& f : m.experts_) {
        w13.push_back(&f.gate.w);
        w13.push_back(&f.up.w);
        w2.push_back(&f.down.w);
      }
      x.w13 = up.bf16(w13, "MoE experts gate/up");
      x.w2 = up.bf16(w2, "MoE experts down");
    }
    if (m.shared_) d.shared = ffn(*m.shared_, up);
    return d;
  }

  // Whether MXFP4 re-encoding reproduces every expert weight exactly (it does for weights that came from MXFP4).
  static bool mxfp4_exact(const MoE& m, int64_t D, int64_t F) {
    if (D % 32 != 0 || F % 32 != 0) return false;
    std::vector<uint8_t> packed(D * F / 2), scales(D * F / 32);
    std::vector<float> back(D * F);
    for (const FeedForward& f : m.experts_)
      for (const Linear* l : {&f.gate, &f.up, &f.down}) {
        const int64_t n = l->w.numel();
        mxfp4_encode(l->w.ptr(), n, packed.data(), scales.data());
        mxfp4_decode(packed.data(), scales.data(), n, back.data());
        if (std::memcmp(back.data(), l->w.ptr(), n * sizeof(float)) != 0) return false;
      }
    return true;
  }

  static IndexKeyDtype index_keys(const MlaAttention& m) { return m.keys_; }
  static const Tensor& embed(const Model& m) { return m.embed_; }
  static const Tensor& lm_head(const Model& m) {
    return m.config().tie_word_embeddings ? m.embed_ : m.lm_head_;
  }
  static const Tensor& final_norm(const Model& m) { return m.final_norm_; }
};

namespace gpu {

// ---------------------------------------------------------------- per-step metadata

// Host-side staging of a step's small tables (pinned) and their device copy: put() appends, flush() copies all at
// once. Capacity is fixed at start-up from the limits.
class Staging {
 public:
  Staging(DeviceArena& arena, size_t capacity) : capacity_(capacity) {
    dev_ = arena.take_n<uint8_t>(capacity, "step tables");
    KESTREL_CUDA_CHECK(cudaMallocHost(reinterpret_cast<void**>(&host_), capacity));
  }
  ~Staging() {
    if (host_) cudaFreeHost(host_);
  }
  Staging(const Staging&) = delete;
  Staging& operator=(const Staging&) = delete;

  void reset() { used_ = 0; }
  template <typename T>
  T* put(const std::vector<T>& v) {
    const size_t start = (used_ + 15) / 16 * 16, n = v.size() * sizeof(T);
    KESTREL_CHECK(start + n <= capacity_, "the step's tables need more than the {} bytes set aside", capacity_);
    if (n) std::memcpy(host_ + start, v.data(), n);
    used_ = start + n;
    return reinterpret_cast<T*>(dev_ + start);
  }
  void flush(cudaStream_t s) {
    if (used_) KESTREL_CUDA_CHECK(cudaMemcpyAsync(dev_, host_, used_, cudaMemcpyHostToDevice, s));
  }

 private:
  uint8_t* dev_ = nullptr;
  uint8_t* host_ = nullptr;
  size_t capacity_ = 0, used_ = 0;
};

struct StepScratch {
  cuda::Gemm gemm;
  std::unique_ptr<Staging> staging;
  float *h = nullptr, *xf = nullptr, *y = nullptr, *y2 = nullptr;
  uint16_t* x_bf = nullptr;
  // KDA
  float *raw = nullptr, *q = nullptr, *k = nullptr, *v = nullptr, *gate = nullptr, *gout = nullptr, *o = nullptr;
  float* beta = nullptr;
  uint16_t *low_bf = nullptr, *o_bf = nullptr;
  float* kda_checkpoints = nullptr;
  size_t kda_checkpoint_states = 0;
  void* kda_ws = nullptr;
  size_t kda_ws_bytes = 0;
  // MLA
  float *kv = nullptr, *qa = nullptr, *mq = nullptr, *q_abs = nullptr, *obar = nullptr, *lse = nullptr, *mo = nullptr;
  uint16_t *qa_bf = nullptr, *mq_bf = nullptr, *q_abs_bf = nullptr, *obar_bf = nullptr, *mo_bf = nullptr;
  void* mla_ws = nullptr;
  size_t mla_ws_bytes = 0;
  // DSA: the selected positions of every token, and the sparse attention's scratch.
  int32_t* indices = nullptr;
  int index_topk = 0;
  void* sparse_ws = nullptr;
  size_t sparse_ws_bytes = 0;
  // FFN / MoE
  float* gu = nullptr;
  uint16_t* act_bf = nullptr;
  float *router_logits = nullptr, *route_w = nullptr;
  int32_t* route_ids = nullptr;
  void* moe_ws = nullptr;
  size_t moe_ws_bytes = 0;
  // LM head
  float *hw = nullptr, *logits = nullptr;
  uint16_t* hw_bf = nullptr;
  int64_t logits_rows = 0;
  // Sampling on the GPU (forward_sampled): outputs, workspace, and the rows' parameters and penalty lists.
  int64_t sample_rows = 0;
  size_t sample_penalty_capacity = 0;
  int32_t *sampled_tokens = nullptr, *sampled_top_ids = nullptr;
  float *sampled_logprobs = nullptr, *sampled_top_logprobs = nullptr;
  void* sample_ws = nullptr;
  size_t sample_ws_bytes = 0;
  std::unique_ptr<Staging> sample_staging;
};

// A linear layer over M tokens: y[M, out] = x[M, in] · W^T, x bf16 and y fp32 (or bf16), rows contiguous.
// A weight the checkpoint stores in FP8 is on the GPU twice, as its FP8 codes and scales and as bf16. Single-token
// steps stream the FP8 form (half the bytes); every larger step runs cuBLASLt on the bf16 copy. On an H200
// (bench/gpu/gemm_fp8_bench.cpp, graph-timed, bench/results/gpu_h200_session4.md) the FP8 kernel is 1.39-1.45x
// cuBLASLt bf16 at M = 1 on weights with K >= 7168 (2048x7168, 576x7168, 7168x16384, 7168x18432: up to 2.8 TB/s of
// codes), but 0.98x on 7168x2048 and 0.80x on 24576x1536, and at M = 2 only 0.61-1.05x: it multiplies on the CUDA
// cores and is bound by instruction issue once a second row shares each loaded weight. So kFp8MaxRows stays 1; a
// per-shape choice (FP8 at M = 1 only for K >= 4096) would win the last few percent on the short-K shapes. Dequantising
// into a bf16 scratch per layer instead would add 3 bytes of traffic per weight. The cost is one byte per weight of
// GPU memory for these linears (the attention projections and dense FFNs; not the routed experts). The FP8 result is
// the reference's x · (code * scale) up to fp32 rounding order; the bf16 copy is exact when the block scales are
// powers of two (DeepSeek-V3.2's ue8m0) and rounds the weight otherwise (GpuModel::rounded_weights()).
namespace {

constexpr int64_t kFp8MaxRows = 1;

// x with leading dimension ldx (>= l.in): a slice of wider rows, e.g. one half of the KDA mixer's [f_a | g_a].
void linear(StepScratch& s, const DLinear& l, const uint16_t* x, int64_t ldx, int64_t M, float* y, cudaStream_t st) {
  if (l.fp8 && M <= kFp8MaxRows)
    cuda::linear_fp8(x, M, ldx, *l.fp8, y, l.out, st);
  else
    s.gemm.linear(x, M, l.in, ldx, l.w, l.out, y, l.out, st);
}

void linear(StepScratch& s, const DLinear& l, const uint16_t* x, int64_t M, float* y, cudaStream_t st) {
  linear(s, l, x, l.in, M, y, st);
}

void linear_bf16(StepScratch& s, const DLinear& l, const uint16_t* x, int64_t M, uint16_t* y, cudaStream_t st) {
  if (l.fp8 && M <= kFp8MaxRows)
    cuda::linear_fp8_bf16(x, M, l.in, *l.fp8, y, l.out, st);
  else
    s.gemm.linear_bf16(x, M, l.in, l.in, l.w, l.out, y, l.out, st);
}

}  // namespace

}  // namespace gpu

// ---------------------------------------------------------------- set-up

namespace gpu {

namespace {
int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }
}  // namespace

GpuModel::GpuModel(const Model& host, const GpuLimits& limits, DeviceArena& arena) : host_(host), limits_(limits) {
  const ModelConfig& cfg = host.config();
  KESTREL_CHECK(limits.max_tokens > 0 && limits.max_seqs > 0 && limits.max_model_len > 0 && limits.block_size > 0,
                "GPU limits must be positive (tokens {}, seqs {}, model len {}, block {})", limits.max_tokens,
                limits.max_seqs, limits.max_model_len, limits.block_size);
  const size_t before = arena.used();
  w_ = std::make_unique<DeviceWeights>();
  Uploader up(arena);
  w_->embed = up.bf16({&GpuWeightAccess::embed(host)}, "embedding");
  w_->lm_head = cfg.tie_word_embeddings ? w_->embed : up.bf16({&GpuWeightAccess::lm_head(host)}, "LM head");
  w_->final_norm = up.f32(GpuWeightAccess::final_norm(host), "final norm");
  int64_t F_max = 0, E_max = 0, K_max = 0;
  for (const DecoderLayer& L : host.layers()) {
    DLayer d;
    d.input_norm = up.f32(L.input_norm, "input norm");
    d.post_norm = up.f32(L.post_norm, "post-attention norm");
    if (L.kda) d.kda = GpuWeightAccess::kda(*L.kda, up);
    if (L.mla) d.mla = GpuWeightAccess::mla(*L.mla, up);
    if (L.dense) {
      d.dense = GpuWeightAccess::ffn(*L.dense, up);
      F_max = std::max(F_max, d.dense->F);
    }
    if (L.moe) {
      d.moe = GpuWeightAccess::moe(*L.moe, cfg, up);
      E_max = std::max<int64_t>(E_max, d.moe->routing.n_experts);
      K_max = std::max<int64_t>(K_max, d.moe->routing.top_k);
      if (d.moe->shared) F_max = std::max(F_max, d.moe->shared->F);
    }
    w_->layers.push_back(std::move(d));
  }
  // The DSA indexers: the first takes the step workspace, the others share it (layers run one after another).
  w_->indexers.resize(host.layers().size());
  std::shared_ptr<DsaIndexerWorkspace> shared_ws;
  const int64_t S_lim = std::min<int64_t>(limits.max_seqs, limits.max_tokens);
  for (size_t l = 0; l < host.layers().size(); ++l) {
    const MlaAttention* mla = host.layers()[l].mla.get();
    if (!mla || !mla->indexer()) continue;
    const IndexKeyDtype keys = GpuWeightAccess::index_keys(*mla);
    w_->indexers[l] = shared_ws ? std::make_unique<DsaIndexerGpu>(*mla->indexer(), cfg, keys, shared_ws, arena)
                                : std::make_unique<DsaIndexerGpu>(*mla->indexer(), cfg, keys, limits.max_tokens,
                                                                  static_cast<int>(S_lim), limits.max_model_len, arena);
    shared_ws = w_->indexers[l]->workspace();
  }
  weight_bytes_ = arena.used() - before;
  rounded_weights_ = up.rounded();

  // Workspaces for a step of max_tokens tokens.
  const size_t ws_before = arena.used();
  s_ = std::make_unique<StepScratch>();
  StepScratch& s = *s_;
  const int64_t N = limits.max_tokens, S = std::min<int64_t>(limits.max_seqs, N), D = cfg.hidden_size;
  auto f32 = [&](int64_t n, const char* what) { return arena.take_n<float>(static_cast<size_t>(std::max<int64_t>(n, 1)), what); };
  auto b16 = [&](int64_t n, const char* what) {
    return arena.take_n<uint16_t>(static_cast<size_t>(std::max<int64_t>(n, 1)), what);
  };
  s.h = f32(N * D, "residual stream");
  s.xf = f32(N * D, "normed activations");
  s.y = f32(N * D, "layer output");
  s.y2 = f32(N * D, "layer output");
  s.x_bf = b16(N * D, "normed activations (bf16)");
  if (cfg.num_layers_of(LayerKind::kda) > 0) {
    const int64_t H = cfg.kda_num_heads, dk = cfg.kda_head_dim, P = H * dk;
    // raw: the rows [q | k | v] of the fused projection; q, k and v: its convolved parts, one after another.
    s.raw = f32(N * 3 * P, "KDA q/k/v projections");
    s.q = f32(N * 3 * P, "KDA q/k/v");
    s.k = s.q + N * P;
    s.v = s.k + N * P;
    for (float** p : {&s.gate, &s.gout, &s.o}) *p = f32(N * P, "KDA activations");
    s.low_bf = b16(N * 2 * dk, "KDA gate bottlenecks");
    s.beta = f32(N * H, "KDA beta");
    s.o_bf = b16(N * P, "KDA output");
    if (dk == kFastKdaDim && host.options().kda_chunked_prefill) {
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
    const int64_t dq = cfg.qk_head_dim(), dv = cfg.v_head_dim, qlr = cfg.q_lora_rank;
    s.kv = f32(N * (C + R), "MLA latent");
    if (qlr) {
      s.qa = f32(N * qlr, "MLA query latent");
      s.qa_bf = b16(N * qlr, "MLA query latent");
    }
    s.mq = f32(N * H * dq, "MLA queries");
    s.mq_bf = b16(N * H * dq, "MLA queries");
    s.q_abs = f32(N * H * (C + R), "MLA absorbed queries");
    s.q_abs_bf = b16(N * H * (C + R), "MLA absorbed queries");
    s.obar = f32(N * H * C, "MLA attention output");
    s.obar_bf = b16(N * H * C, "MLA attention output");
    s.lse = f32(N * H, "MLA lse");
    s.mo = f32(N * H * dv, "MLA heads output");
    s.mo_bf = b16(N * H * dv, "MLA heads output");
    if (cfg.has_indexer) {
      s.index_topk = cfg.index_topk;
      s.indices = arena.take_n<int32_t>(static_cast<size_t>(N * cfg.index_topk), "DSA selected positions");
      if (fast_sparse_mla(cfg)) {
        for (int b = 1; b <= S; ++b)
          s.sparse_ws_bytes = std::max(s.sparse_ws_bytes, cuda::sparse_mla_decode_workspace_bytes(
                                                              b, 1, static_cast<int>(H), cfg.index_topk));
        for (int64_t n = 1; n <= N; ++n)
          s.sparse_ws_bytes = std::max(s.sparse_ws_bytes, cuda::sparse_mla_decode_workspace_bytes(
                                                              1, static_cast<int>(n), static_cast<int>(H), cfg.index_topk));
        if (s.sparse_ws_bytes) s.sparse_ws = arena.take(s.sparse_ws_bytes, "sparse MLA workspace");
      }
    }
    if (fast_mla(cfg)) {
      // The kernel's split of the context (and so its scratch) depends on the shape in ways that are not monotone:
      // take the largest over every shape a step can launch (decode batches of 1..S, prompts of 1..N tokens) at
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
  s.gu = f32(N * 2 * std::max<int64_t>(F_max, 1), "FFN gate/up");
  s.act_bf = b16(N * std::max<int64_t>(F_max, 1), "FFN activations");
  if (E_max > 0) {
    s.router_logits = f32(N * E_max, "router logits");
    s.route_w = f32(N * K_max, "routing weights");
    s.route_ids = arena.take_n<int32_t>(static_cast<size_t>(N * K_max), "routing ids");
    s.moe_ws_bytes = cuda::moe_workspace_bytes(N, static_cast<int>(K_max), static_cast<int>(E_max), D,
                                               cfg.moe_intermediate_size);
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
    s.sample_staging = std::make_unique<Staging>(
        arena, static_cast<size_t>(s.sample_rows) * (sizeof(cuda::SampleRowParams) + 16) +
                   s.sample_penalty_capacity * sizeof(cuda::SamplePenaltyToken) + 4096);
  }
  tables_ = std::make_unique<StepTables>();
  max_blocks_ = max_blocks;
  // Last: nothing after it can throw, so the destructor always runs for a created stream.
  KESTREL_CUDA_CHECK(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking));
  workspace_bytes_ = arena.used() - ws_before;
}

void GpuModel::mark(size_t i) {
  if (!profiling_) return;
  while (events_.size() <= i) {
    cudaEvent_t e = nullptr;
    KESTREL_CUDA_CHECK(cudaEventCreate(&e));
    events_.push_back(e);
  }
  KESTREL_CUDA_CHECK(cudaEventRecord(events_[i], stream_));
}

GpuModel::~GpuModel() {
  for (cudaEvent_t e : events_) cudaEventDestroy(e);
  for (auto& [key, exec] : graphs_by_size_)
    if (exec) cudaGraphExecDestroy(exec);
  if (stream_) cudaStreamDestroy(stream_);
}

// ---------------------------------------------------------------- forward

// The step's sequences in the order the GPU runs them: single generated tokens first (one KDA decode launch and
// one MLA decode launch cover them), then chunked-KDA prompts, then the rest (multi-token non-prompt steps).
struct Ordered {
  std::vector<int> seq;            // internal position -> index in batch.seqs
  std::vector<int64_t> first;      // internal position -> first token (internal token order), size S + 1
  int decode = 0, chunked = 0;     // counts of the first two groups
};

// A step's tables on the device (in the staging buffer) and how the step is cut into launches.
struct StepTables {
  Ordered ord;
  int64_t N = 0, wanted = 0, bt_stride = 1;
  int S = 0;
  bool graph = false;  // replayed from a CUDA graph
  const int32_t *ids = nullptr, *row_req = nullptr, *row_pos = nullptr, *ctx = nullptr, *bt = nullptr;
  const int32_t* out_rows = nullptr;
  const int64_t *slots = nullptr, *cu = nullptr;
  std::vector<const int32_t*> state_rows;            // per state group: each sequence's state row
  std::vector<float* const*> hist;  // per layer: conv-history pointers of q (k's and v's follow, hist_floats apart)
  // KDA through the recurrence (every sequence when dk is not the fast kernels' 128, else those the fast kernels
  // do not take): one launch over sequences [first_recurrent, S) with recurrent_cu, or, when one of them asks for
  // a checkpoint, each sequence in segments cut at its checkpoints.
  bool fast_kda = false;
  int first_recurrent = 0;
  const int64_t* recurrent_cu = nullptr;
  struct Segment {
    int seq;            // internal position
    int64_t t0, len;    // tokens (internal order)
    const int64_t* cu;  // device {0, len}
    const CheckpointTarget* checkpoint;  // taken after the segment, or null
  };
  std::vector<Segment> segments;
};

bool GpuModel::prepare(const StepBatch& batch, StepTables& t, bool graphs) {
  const ModelConfig& cfg = host_.config();
  const CachePlan& plan = *batch.plan;
  const auto& seqs = batch.seqs;
  StepScratch& s = *s_;
  const cudaStream_t st = stream_;
  const int64_t V = cfg.vocab_size;
  KESTREL_CHECK(plan.page_offset.size() == w_->layers.size(), "cache plan of {} layers for a model of {}",
                plan.page_offset.size(), w_->layers.size());
  KESTREL_CHECK(plan.row_bytes % 16 == 0, "the GPU needs 16-byte aligned cache rows, the plan has {} bytes",
                plan.row_bytes);
  const bool chunked_kda = host_.options().kda_chunked_prefill;
  for (size_t l = 0; l < w_->layers.size(); ++l) {
    const DLayer& L = w_->layers[l];
    KESTREL_CHECK(L.mla ? plan.latent_bytes[l] == latent_entry_bytes(cfg, L.mla->entry == cuda::LatentEntry::nvfp4
                                                                         ? LatentCacheDtype::nvfp4
                                                                         : LatentCacheDtype::fp8) &&
                              plan.index_key_bytes[l] == index_key_entry_bytes(cfg, L.mla->keys)
                        : plan.state_row[l] >= 0,
                  "the cache plan does not match layer {} of the model on the GPU", l);
  }

  // Validation, as Model::forward.
  Ordered& ord = t.ord;
  ord = Ordered{};
  int64_t N = 0, wanted = 0;
  for (size_t i = 0; i < seqs.size(); ++i) {
    const SequenceStep& q = seqs[i];
    const int64_t n = static_cast<int64_t>(q.ids.size()), end = q.start + n;
    KESTREL_CHECK(n > 0, "a step needs at least one token per sequence");
    KESTREL_CHECK(static_cast<int64_t>(q.slots.size()) == n, "{} slots for {} tokens", q.slots.size(), n);
    KESTREL_CHECK(plan.num_token_layers == 0 || static_cast<int64_t>(q.block_table.size()) * plan.block_size >= end,
                  "a block table of {} blocks cannot hold {} tokens", q.block_table.size(), end);
    KESTREL_CHECK(static_cast<int>(q.state_rows.size()) == plan.state_rows_per_request,
                  "{} state rows, the plan has {}", q.state_rows.size(), plan.state_rows_per_request);
    KESTREL_CHECK(q.logits_from >= 0 && q.logits_from <= n, "logits_from {} outside [0, {}]", q.logits_from, n);
    for (int32_t id : q.ids) KESTREL_CHECK(id >= 0 && id < V, "token id {} is outside the vocabulary (0..{})", id, V - 1);
    // The kernels are sized for max_model_len (the MLA split, the indexer's scores): a longer context would be cut.
    KESTREL_CHECK(end <= limits_.max_model_len, "a sequence of {} tokens exceeds the GPU's max_model_len {}", end,
                  limits_.max_model_len);
    // As KdaMixer::forward: checkpoints ascending inside the step, on block boundaries (the chunked kernel takes them
    // at multiples of the block size).
    for (size_t c = 0; c < q.checkpoints.size(); ++c) {
      const int64_t p = q.checkpoints[c].position;
      KESTREL_CHECK(p > q.start && p <= end && (c == 0 || p > q.checkpoints[c - 1].position) && p % plan.block_size == 0,
                    "KDA checkpoint at {} is not a block boundary inside the step ({}, {}] in ascending order", p,
                    q.start, end);
      KESTREL_CHECK(static_cast<int>(q.checkpoints[c].rows.size()) == plan.state_rows_per_request,
                    "a checkpoint of {} state rows, the plan has {}", q.checkpoints[c].rows.size(),
                    plan.state_rows_per_request);
    }
    N += n;
    wanted += n - q.logits_from;
  }
  KESTREL_CHECK(N <= limits_.max_tokens, "a step of {} tokens exceeds the GPU's limit of {}", N, limits_.max_tokens);
  KESTREL_CHECK(static_cast<int64_t>(seqs.size()) <= limits_.max_seqs, "a step of {} sequences exceeds the limit of {}",
                seqs.size(), limits_.max_seqs);
  t.N = N;
  t.wanted = wanted;
  if (seqs.empty()) return false;
  auto group_of = [&](const SequenceStep& q) {
    if (q.ids.size() == 1 && !q.prompt) return 0;
    return q.prompt && chunked_kda ? 1 : 2;
  };
  for (int g = 0; g < 3; ++g)
    for (size_t i = 0; i < seqs.size(); ++i)
      if (group_of(seqs[i]) == g) ord.seq.push_back(static_cast<int>(i));
  const int S = static_cast<int>(ord.seq.size());
  ord.first.assign(S + 1, 0);
  for (int j = 0; j < S; ++j) {
    const SequenceStep& q = seqs[ord.seq[j]];
    ord.first[j + 1] = ord.first[j] + static_cast<int64_t>(q.ids.size());
    const int g = group_of(q);
    ord.decode += g == 0;
    ord.chunked += g == 1;
  }

  // Step tables.
  Staging& tab = *s.staging;
  tab.reset();
  std::vector<int32_t> ids(N), row_req(N), row_pos(N), ctx(S);
  std::vector<int64_t> slots(N), cu(S + 1, 0);
  // A CUDA graph replays fixed shapes: every sequence a single generated token and no checkpoint, block tables of
  // the longest possible width, and the MLA split sized for the longest context.
  bool any_checkpoint = false;
  for (const SequenceStep& q : seqs) any_checkpoint |= !q.checkpoints.empty();
  // Every row's logits wanted: the graph gathers and projects S rows (a recomputed token after a preemption wants
  // none).
  t.graph = graphs && ord.decode == S && !any_checkpoint && wanted == N;
  int64_t bt_stride = 1;
  for (int j = 0; j < S; ++j) bt_stride = std::max<int64_t>(bt_stride, seqs[ord.seq[j]].block_table.size());
  if (t.graph) {
    // Graphs are captured per power-of-two block-table width (so per bucket of context), which also sizes the MLA
    // decode's split: a few graphs per batch size instead of tables and splits sized for max_model_len.
    int64_t width = 1;
    while (width < bt_stride) width *= 2;
    bt_stride = std::min(width, max_blocks_);
  }
  std::vector<int32_t> bt(static_cast<size_t>(S * bt_stride), 0);
  for (int j = 0; j < S; ++j) {
    const SequenceStep& q = seqs[ord.seq[j]];
    for (size_t t = 0; t < q.ids.size(); ++t) {
      const int64_t at = ord.first[j] + static_cast<int64_t>(t);
      ids[at] = q.ids[t];
      slots[at] = q.slots[t];
      row_req[at] = j;
      row_pos[at] = static_cast<int32_t>(q.start + static_cast<int64_t>(t));
    }
    ctx[j] = static_cast<int32_t>(q.start + static_cast<int64_t>(q.ids.size()));
    cu[j + 1] = ord.first[j + 1];
    std::copy(q.block_table.begin(), q.block_table.end(), bt.begin() + j * bt_stride);
  }
  t.S = S;
  t.bt_stride = bt_stride;
  t.ids = tab.put(ids);
  t.slots = tab.put(slots);
  t.row_req = tab.put(row_req);
  t.row_pos = tab.put(row_pos);
  t.ctx = tab.put(ctx);
  t.cu = tab.put(cu);
  t.bt = tab.put(bt);
  // KDA: per state group, each sequence's state row; per KDA layer, its conv-history pointers.
  const int groups = plan.state_rows_per_request;
  t.state_rows.assign(groups, nullptr);
  for (int g = 0; g < groups; ++g) {
    std::vector<int32_t> r(S);
    for (int j = 0; j < S; ++j) r[j] = seqs[ord.seq[j]].state_rows[g];
    t.state_rows[g] = tab.put(r);
  }
  const int64_t Hk = cfg.kda_num_heads, dk = cfg.kda_head_dim;
  auto state_base = [&](int32_t row, size_t l) { return state_at(batch, row, l); };
  t.hist.assign(w_->layers.size(), {});
  for (size_t l = 0; l < w_->layers.size(); ++l) {
    if (!w_->layers[l].kda) continue;
    KESTREL_CHECK(plan.state_offset[l] % 16 == 0, "the GPU needs 16-byte aligned KDA states (layer {})", l);
    std::vector<float*> p(S);
    for (int j = 0; j < S; ++j) p[j] = state_base(seqs[ord.seq[j]].state_rows[plan.state_row[l]], l) + Hk * dk * dk;
    t.hist[l] = tab.put(p);
  }
  // Logit rows: each sequence's wanted positions, in the caller's order.
  std::vector<int32_t> out_rows;
  {
    std::vector<int64_t> first_of(seqs.size());
    for (int j = 0; j < S; ++j) first_of[ord.seq[j]] = ord.first[j];
    for (size_t i = 0; i < seqs.size(); ++i)
      for (int64_t t = seqs[i].logits_from; t < static_cast<int64_t>(seqs[i].ids.size()); ++t)
        out_rows.push_back(static_cast<int32_t>(first_of[i] + t));
  }
  t.out_rows = tab.put(out_rows);
  // KDA through the recurrence (every sequence when dk is not the fast kernels' 128, else those the fast kernels do
  // not take): one launch when no such sequence asks for a checkpoint, else each sequence cut at its checkpoints.
  t.fast_kda = dk == kFastKdaDim;
  const int first_recurrent = t.first_recurrent = t.fast_kda ? ord.decode + ord.chunked : 0;
  bool recurrent_checkpoints = false;
  for (int j = first_recurrent; j < S; ++j) recurrent_checkpoints |= !seqs[ord.seq[j]].checkpoints.empty();
  std::vector<StepTables::Segment>& segments = t.segments;
  segments.clear();
  t.recurrent_cu = nullptr;
  if (first_recurrent < S && !recurrent_checkpoints) {
    std::vector<int64_t> rcu;
    for (int j = first_recurrent; j <= S; ++j) rcu.push_back(ord.first[j] - ord.first[first_recurrent]);
    t.recurrent_cu = tab.put(rcu);
  } else if (first_recurrent < S) {
    for (int j = first_recurrent; j < S; ++j) {
      const SequenceStep& q = seqs[ord.seq[j]];
      int64_t done = 0;
      const int64_t n = static_cast<int64_t>(q.ids.size());
      auto add = [&](int64_t len, const CheckpointTarget* ck) {
        if (len > 0 || ck) segments.push_back({j, ord.first[j] + done, len, tab.put(std::vector<int64_t>{0, len}), ck});
        done += len;
      };
      for (const CheckpointTarget& ck : q.checkpoints) add(ck.position - q.start - done, &ck);
      add(n - done, nullptr);
    }
  }
  tab.flush(st);
  return true;
}

void GpuModel::run(const StepBatch& batch, const StepTables& t) {
  const ModelConfig& cfg = host_.config();
  const CachePlan& plan = *batch.plan;
  const auto& seqs = batch.seqs;
  StepScratch& s = *s_;
  const cudaStream_t st = stream_;
  const Ordered& ord = t.ord;
  const int64_t N = t.N, D = cfg.hidden_size;
  const int S = t.S;
  const int64_t Wc = cfg.short_conv_kernel_size, Hk = cfg.kda_num_heads, dk = cfg.kda_head_dim, P = Hk * dk;
  const int64_t hist_floats = (Wc - 1) * P;
  auto state_base = [&](int32_t row, size_t l) { return state_at(batch, row, l); };
  const int first_recurrent = t.first_recurrent;
  const bool fast_kda = t.fast_kda;
  cuda::embed_bf16(t.ids, N, w_->embed, D, s.h, st);
  for (size_t l = 0; l < w_->layers.size(); ++l) {
    const DLayer& L = w_->layers[l];
    if (!t.graph) mark(2 + 3 * l);
    if (w_->indexers[l]) {
      // The indexer takes the fp32 normed input (its products are fp32); the rest its bf16 copy.
      cuda::rms_norm_f32(s.h, D, L.input_norm, N, D, cfg.rms_norm_eps, s.xf, D, st);
      cuda::to_bf16(s.xf, N * D, s.x_bf, st);
    } else {
      cuda::rms_norm_bf16(s.h, D, L.input_norm, N, D, cfg.rms_norm_eps, s.x_bf, D, st);
    }
    if (L.kda) {
      const DKda& k = *L.kda;
      const int g = plan.state_row[l];
      float* pool_states = reinterpret_cast<float*>(batch.pool + plan.state_offset[l]);
      // The projections [q | k | v] in one GEMM (rows of 3P), conv-history checkpoints (from the raw inputs, before
      // the convolution advances the histories) and the three short convolutions in one launch.
      linear(s, k.qkv, s.x_bf, N, s.raw, st);
      for (int j = 0; j < S; ++j) {
        const SequenceStep& q = seqs[ord.seq[j]];
        const float* hist = state_base(q.state_rows[g], l) + Hk * dk * dk;
        for (const CheckpointTarget& ck : q.checkpoints) {
          float* dst = state_base(ck.rows[g], l) + Hk * dk * dk;
          for (int64_t i = 0; i < Wc - 1; ++i) {
            // Row i of the q, k and v histories (hist_floats apart): one token's raw q, k, v (P apart) or an older
            // row of the histories.
            const int64_t rel = ck.position - (Wc - 1) + i - q.start;
            const float* src = rel >= 0 ? s.raw + (ord.first[j] + rel) * 3 * P : hist + (rel + Wc - 1) * P;
            const int64_t src_pitch = rel >= 0 ? P : hist_floats;
            KESTREL_CUDA_CHECK(cudaMemcpy2DAsync(dst + i * P, hist_floats * sizeof(float), src,
                                                 src_pitch * sizeof(float), P * sizeof(float), 3,
                                                 cudaMemcpyDeviceToDevice, st));
          }
        }
      }
      cuda::short_conv_silu_varlen_parts(s.raw, 3 * P, t.cu, S, 3, P, k.conv_qkv, static_cast<int>(Wc), t.hist[l],
                                         hist_floats, s.q, s.k - s.q, st);
      // [f_a | g_a] in one GEMM (rows of 2dk); f_b and g_b read their halves.
      linear_bf16(s, k.fg_a, s.x_bf, N, s.low_bf, st);
      linear(s, k.f_b, s.low_bf, 2 * dk, N, s.gate, st);
      linear(s, k.b, s.x_bf, N, s.beta, st);
      cuda::KdaInputs in;
      in.q = s.q;
      in.k = s.k;
      in.v = s.v;
      in.gate = s.gate;
      in.beta = s.beta;
      in.A_log = k.A_log;
      in.dt_bias = k.dt_bias;
      in.gate_lower_bound = cfg.kda_gate_lower_bound;
      in.beta_is_logit = true;
      in.normalize_qk = true;
      in.scale = static_cast<float>(1.0 / std::sqrt(static_cast<double>(dk)));
      in.state_stride = plan.row_bytes / static_cast<int64_t>(sizeof(float));
      auto at_token = [&](cuda::KdaInputs x, int64_t t0) {
        x.q += t0 * P;
        x.k += t0 * P;
        x.v += t0 * P;
        x.gate += t0 * P;
        x.beta += t0 * Hk;
        return x;
      };
      const int H = static_cast<int>(Hk), d = static_cast<int>(dk);
      if (fast_kda && ord.decode > 0) {
        cuda::kda_decode(in, ord.decode, H, d, d, pool_states, t.state_rows[g], s.o, st);
        // A single token's checkpoint (recurrent-prefill mode names blocks that generated tokens complete) is the
        // state after it: copied once the decode has updated the state in place.
        for (int j = 0; j < ord.decode; ++j)
          for (const CheckpointTarget& ck : seqs[ord.seq[j]].checkpoints)
            KESTREL_CUDA_CHECK(cudaMemcpyAsync(state_base(ck.rows[g], l), state_base(seqs[ord.seq[j]].state_rows[g], l),
                                               Hk * dk * dk * sizeof(float), cudaMemcpyDeviceToDevice, st));
      }
      if (fast_kda && ord.chunked > 0) {
        const int b0 = ord.decode, b1 = ord.decode + ord.chunked;
        const int64_t t0 = ord.first[b0];
        std::vector<int64_t> pcu{0}, pstart;
        bool any_ck = false;
        for (int j = b0; j < b1; ++j) {
          pcu.push_back(ord.first[j + 1] - t0);
          pstart.push_back(seqs[ord.seq[j]].start);
          any_ck |= !seqs[ord.seq[j]].checkpoints.empty();
        }
        const int64_t every = plan.block_size;
        const cuda::KdaPrefillPlan pp(pcu, pstart, any_ck ? every : 0);
        KESTREL_CHECK(pp.workspace_bytes(H) <= s.kda_ws_bytes &&
                          static_cast<size_t>(pp.num_checkpoints()) <= s.kda_checkpoint_states,
                      "the KDA prefill of this step needs more workspace than was set aside");
        float* checkpoints = pp.num_checkpoints() ? s.kda_checkpoints : nullptr;
        if (tensor_core_kda_)
          cuda::kda_prefill_tc(pp, at_token(in, t0), H, d, d, pool_states, t.state_rows[g] + b0, s.o + t0 * P,
                               checkpoints, s.kda_ws, s.kda_ws_bytes, st);
        else
          cuda::kda_prefill(pp, at_token(in, t0), H, d, d, pool_states, t.state_rows[g] + b0, s.o + t0 * P,
                            checkpoints, s.kda_ws, s.kda_ws_bytes, st);
        for (int j = b0; j < b1; ++j) {
          const SequenceStep& q = seqs[ord.seq[j]];
          const int64_t first_boundary = q.start / every + 1;  // the first multiple of `every` after start
          for (const CheckpointTarget& ck : q.checkpoints) {
            const int64_t idx = pp.first_checkpoint(j - b0) + ck.position / every - first_boundary;
            KESTREL_CUDA_CHECK(cudaMemcpyAsync(state_base(ck.rows[g], l), s.kda_checkpoints + idx * Hk * dk * dk,
                                               Hk * dk * dk * sizeof(float), cudaMemcpyDeviceToDevice, st));
          }
        }
      }
      if (t.recurrent_cu) {
        const int64_t t0 = ord.first[first_recurrent];
        cuda::kda_recurrent_varlen(at_token(in, t0), t.recurrent_cu, S - first_recurrent, H, d, d, pool_states,
                                   t.state_rows[g] + first_recurrent, s.o + t0 * P, st);
      }
      for (const StepTables::Segment& sg : t.segments) {
        const SequenceStep& q = seqs[ord.seq[sg.seq]];
        if (sg.len > 0)
          cuda::kda_recurrent_varlen(at_token(in, sg.t0), sg.cu, 1, H, d, d, pool_states, t.state_rows[g] + sg.seq,
                                     s.o + sg.t0 * P, st);
        if (sg.checkpoint)
          KESTREL_CUDA_CHECK(cudaMemcpyAsync(state_base(sg.checkpoint->rows[g], l), state_base(q.state_rows[g], l),
                                             Hk * dk * dk * sizeof(float), cudaMemcpyDeviceToDevice, st));
      }
      // Output gate and norm, then o_proj.
      linear(s, k.g_b, s.low_bf + dk, 2 * dk, N, s.gout, st);
      cuda::kda_gated_rmsnorm_bf16(s.o, s.gout, k.o_norm, N, H, d, cfg.rms_norm_eps, s.o_bf, st);
      linear(s, k.o, s.o_bf, N, s.y, st);
    } else {
      mla_layer(*L.mla, l, batch, t);
    }
    cuda::add_inplace(s.h, s.y, N * D, st);
    if (!t.graph) mark(3 + 3 * l);
    ffn_layer(L, N);
    cuda::add_inplace(s.h, s.y, N * D, st);
    if (!t.graph) mark(4 + 3 * l);
  }

  // Final norm and LM head over the wanted rows (the first logits_rows of them; forward() does the rest).
  cuda::gather_rows(s.h, D, t.out_rows, t.wanted, s.hw, st);
  cuda::rms_norm_bf16(s.hw, D, w_->final_norm, t.wanted, D, cfg.rms_norm_eps, s.hw_bf, D, st);
  lm_head(0, std::min(s.logits_rows, t.wanted));
}

void GpuModel::lm_head(int64_t r0, int64_t rows) {
  const int64_t D = host_.config().hidden_size, V = host_.config().vocab_size;
  s_->gemm.linear(s_->hw_bf + r0 * D, rows, D, D, w_->lm_head, V, s_->logits, V, stream_);
}

void GpuModel::launch(const StepBatch& batch, const StepTables& t) {
  const cudaStream_t st = stream_;
  if (t.graph) {
    // One graph per batch size and block-table width (and pool), captured on first use, replayed after.
    cudaGraphExec_t& exec = graphs_by_size_[{t.S, batch.pool, t.bt_stride}];
    if (!exec) {
      cudaGraph_t graph = nullptr;
      KESTREL_CUDA_CHECK(cudaStreamBeginCapture(st, cudaStreamCaptureModeThreadLocal));
      try {
        run(batch, t);
      } catch (...) {
        cudaStreamEndCapture(st, &graph);
        if (graph) cudaGraphDestroy(graph);
        throw;
      }
      KESTREL_CUDA_CHECK(cudaStreamEndCapture(st, &graph));
      const cudaError_t inst = cudaGraphInstantiate(&exec, graph, 0);
      cudaGraphDestroy(graph);
      KESTREL_CUDA_CHECK(inst);
    }
    KESTREL_CUDA_CHECK(cudaGraphLaunch(exec, st));
  } else {
    run(batch, t);
  }
}

void GpuModel::forward_sampled(const StepBatch& batch, std::span<const SampleRow> rows, std::vector<SampledToken>& out) {
  StepTables& t = *tables_;
  out.assign(rows.size(), SampledToken{});
  const auto t0 = Clock::now();
  if (!prepare(batch, t, graphs_)) return;
  const auto t1 = Clock::now();
  StepScratch& s = *s_;
  const cudaStream_t st = stream_;
  const int64_t V = host_.config().vocab_size;
  KESTREL_CHECK(t.wanted <= s.logits_rows && static_cast<int64_t>(rows.size()) <= s.sample_rows,
                "a step sampling {} rows of {} wanted exceeds the GPU's sampling buffers", rows.size(), t.wanted);
  mark(0);
  launch(batch, t);
  mark(1);
  const auto t2 = Clock::now();
  // The rows' parameters and penalty lists; lists beyond the buffer are sampled on the host from copied logits.
  size_t penalties = 0;
  for (const SampleRow& r : rows) penalties += r.penalties.size();
  if (penalties > s.sample_penalty_capacity) {
    std::vector<float> host(static_cast<size_t>(t.wanted * V));
    KESTREL_CUDA_CHECK(cudaMemcpyAsync(host.data(), s.logits, host.size() * sizeof(float), cudaMemcpyDeviceToHost, st));
    KESTREL_CUDA_CHECK(cudaStreamSynchronize(st));
    for (size_t i = 0; i < rows.size(); ++i)
      out[i].token = sample_token(*rows[i].params, host.data() + rows[i].logits_row * V, V, rows[i].uniform,
                                  rows[i].penalties, rows[i].params->logprobs >= 0 ? &out[i].logprob : nullptr);
    record_times(t, t0, t1, t2);
    return;
  }
  std::vector<cuda::SampleRowParams> params(rows.size());
  std::vector<int32_t> source(rows.size()), offsets{0};
  std::vector<cuda::SamplePenaltyToken> tokens;
  int max_top = 0;
  for (size_t i = 0; i < rows.size(); ++i) {
    const SamplingParams& p = *rows[i].params;
    params[i] = {rows[i].uniform, p.temperature, p.top_p, p.min_p, p.presence_penalty, p.frequency_penalty,
                 p.repetition_penalty, p.top_k, p.logprobs};
    source[i] = static_cast<int32_t>(rows[i].logits_row);
    for (const PenaltyToken& pt : rows[i].penalties) tokens.push_back({pt.token, pt.generated});
    offsets.push_back(static_cast<int32_t>(tokens.size()));
    max_top = std::max(max_top, p.logprobs);
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
  tab.flush(st);
  a.tokens = s.sampled_tokens;
  a.token_logprobs = s.sampled_logprobs;
  a.top_ids = s.sampled_top_ids;
  a.top_logprobs = s.sampled_top_logprobs;
  a.max_top_logprobs = std::min(max_top, cuda::kMaxSampleTopLogprobs);
  cuda::sample_rows(a, s.sample_ws, s.sample_ws_bytes, st);
  // The kernel writes each row's alternatives at a stride of a.max_top_logprobs (not kMaxSampleTopLogprobs).
  const size_t n = rows.size(), K = static_cast<size_t>(a.max_top_logprobs);
  std::vector<int32_t> tok(n), top_ids(n * K);
  std::vector<float> lp(n), top_lp(n * K);
  KESTREL_CUDA_CHECK(cudaMemcpyAsync(tok.data(), s.sampled_tokens, n * sizeof(int32_t), cudaMemcpyDeviceToHost, st));
  KESTREL_CUDA_CHECK(cudaMemcpyAsync(lp.data(), s.sampled_logprobs, n * sizeof(float), cudaMemcpyDeviceToHost, st));
  if (max_top > 0) {
    KESTREL_CUDA_CHECK(
        cudaMemcpyAsync(top_ids.data(), s.sampled_top_ids, n * K * sizeof(int32_t), cudaMemcpyDeviceToHost, st));
    KESTREL_CUDA_CHECK(
        cudaMemcpyAsync(top_lp.data(), s.sampled_top_logprobs, n * K * sizeof(float), cudaMemcpyDeviceToHost, st));
  }
  KESTREL_CUDA_CHECK(cudaStreamSynchronize(st));
  record_times(t, t0, t1, t2);
  for (size_t i = 0; i < n; ++i) {
    out[i].token = tok[i];
    const int want = rows[i].params->logprobs;
    if (want < 0) continue;
    out[i].logprob.token = tok[i];
    out[i].logprob.logprob = lp[i];
    for (int k = 0; k < want; ++k) out[i].logprob.top.emplace_back(top_ids[i * K + k], top_lp[i * K + k]);
  }
}

void GpuModel::forward(const StepBatch& batch, float* logits) {
  StepTables& t = *tables_;
  const auto t0 = Clock::now();
  if (!prepare(batch, t, graphs_)) return;
  const auto t1 = Clock::now();
  const cudaStream_t st = stream_;
  const int64_t V = host_.config().vocab_size;
  mark(0);
  launch(batch, t);
  mark(1);
  const auto t2 = Clock::now();
  const StepScratch& s = *s_;
  for (int64_t r0 = 0; r0 < t.wanted; r0 += s.logits_rows) {
    const int64_t rows = std::min(s.logits_rows, t.wanted - r0);
    if (r0 > 0) lm_head(r0, rows);
    KESTREL_CUDA_CHECK(cudaMemcpyAsync(logits + r0 * V, s.logits, rows * V * sizeof(float), cudaMemcpyDeviceToHost, st));
    KESTREL_CUDA_CHECK(cudaStreamSynchronize(st));
  }
  // Synchronous also when no logits are wanted (a middle prompt chunk): the next step reuses the staging buffer.
  KESTREL_CUDA_CHECK(cudaStreamSynchronize(st));
  record_times(t, t0, t1, t2);
}

void GpuModel::record_times(const StepTables& t, Clock::time_point t0, Clock::time_point t1, Clock::time_point t2) {
  if (!profiling_) return;
  const auto t3 = Clock::now();
  auto ms = [](auto a, auto b) { return std::chrono::duration<double, std::milli>(b - a).count(); };
  auto between = [&](size_t a, size_t b) {
    float v = 0;
    KESTREL_CUDA_CHECK(cudaEventElapsedTime(&v, events_[a], events_[b]));
    return v;
  };
  times_ = StepTimes{};
  times_.graph = t.graph;
  times_.prepare_ms = ms(t0, t1);
  times_.gpu_ms = between(0, 1);
  // The copy (and GPU sampling) waits for the kernels: its own time is what the host waited beyond them.
  times_.copy_ms = std::max(0.0, ms(t2, t3) - times_.gpu_ms);
  if (!t.graph)
    for (size_t l = 0; l < w_->layers.size(); ++l) {
      times_.mixer_ms.push_back(between(2 + 3 * l, 3 + 3 * l));
      times_.ffn_ms.push_back(between(3 + 3 * l, 4 + 3 * l));
    }
}

bool GpuModel::samples_on_gpu() const { return sampling_ && s_->sampled_tokens != nullptr; }

float* GpuModel::state_at(const StepBatch& batch, int32_t row, size_t layer) const {
  const CachePlan& plan = *batch.plan;
  return reinterpret_cast<float*>(batch.pool + int64_t{row} * plan.row_bytes + plan.state_offset[layer]);
}

void GpuModel::mla_layer(const DMla& m, size_t l, const StepBatch& batch, const StepTables& t) {
  const Ordered& ord = t.ord;
  const int64_t N = t.N, bt_stride = t.bt_stride;
  const int S = t.S;
  const int64_t* d_slots = t.slots;
  const int32_t *d_row_req = t.row_req, *d_row_pos = t.row_pos, *d_ctx = t.ctx, *d_bt = t.bt;
  const ModelConfig& cfg = host_.config();
  const CachePlan& plan = *batch.plan;
  StepScratch& s = *s_;
  const cudaStream_t st = stream_;
  const int64_t H = cfg.num_attention_heads, C = cfg.kv_lora_rank, R = cfg.qk_rope_head_dim;
  const int64_t dn = cfg.qk_nope_head_dim, dv = cfg.v_head_dim, dq = cfg.qk_head_dim(), qlr = cfg.q_lora_rank;
  const cuda::Pages pages{batch.pool + plan.page_offset[l], plan.row_bytes, plan.block_size};
  const cuda::BlockTable table{d_bt, static_cast<int>(bt_stride)};

  // The new tokens' latents first: a token attends to itself.
  linear(s, m.kv_a, s.x_bf, N, s.kv, st);
  cuda::rms_norm_f32(s.kv, C + R, m.kv_a_norm, N, C, kLatentNormEps, s.kv, C + R, st);
  // deepseek_v32: interleaved RoPE on k_pe before it is cached, and its own FP8 entry (tiles of 128, bf16 tail).
  if (m.inv_freq)
    cuda::rope_rows(s.kv + C, N, C + R, 1, R, static_cast<int>(R), cuda::RopeStyle::interleaved, d_row_pos, m.inv_freq,
                    st);
  if (m.entry == cuda::LatentEntry::v32_fp8)
    cuda::mla_latent_write_v32(s.kv, C + R, N, static_cast<int>(C), static_cast<int>(R), d_slots, pages, st);
  else if (m.entry == cuda::LatentEntry::nvfp4)
    cuda::mla_latent_write_nvfp4(s.kv, C + R, N, static_cast<int>(C), static_cast<int>(R), m.kv_scale, d_slots, pages,
                                 st);
  else
    cuda::mla_latent_write_fp8(s.kv, C + R, N, static_cast<int>(C), static_cast<int>(R), m.kv_scale, d_slots, pages,
                               st);

  // Queries, absorbed per head: q_abs[t, h] = [W_UK,h^T q_nope ; q_pe].
  if (m.q_a) {
    // qr (the normed query latent) in fp32 for the indexer, in bf16 for q_b.
    linear(s, *m.q_a, s.x_bf, N, s.qa, st);
    cuda::rms_norm_f32(s.qa, qlr, m.q_a_norm, N, qlr, kLatentNormEps, s.qa, qlr, st);
    cuda::to_bf16(s.qa, N * qlr, s.qa_bf, st);
    linear(s, *m.q_b, s.qa_bf, N, s.mq, st);
  } else {
    linear(s, *m.q_proj, s.x_bf, N, s.mq, st);
  }
  // Interleaved RoPE on each head's q_pe (fp32, before q_nope is rounded to bf16 for the absorption).
  if (m.inv_freq)
    cuda::rope_rows(s.mq + dn, N, H * dq, static_cast<int>(H), dq, static_cast<int>(R), cuda::RopeStyle::interleaved,
                    d_row_pos, m.inv_freq, st);
  cuda::to_bf16(s.mq, N * H * dq, s.mq_bf, st);
  s.gemm.batched(s.mq_bf, H * dq, dq, m.kv_b, C, (dn + dv) * C, /*transpose_w=*/false, s.q_abs, H * (C + R), C + R,
                 N, C, dn, H, st);
  if (R > 0)
    KESTREL_CUDA_CHECK(cudaMemcpy2DAsync(s.q_abs + C, (C + R) * sizeof(float), s.mq + dn, dq * sizeof(float),
                                         R * sizeof(float), N * H, cudaMemcpyDeviceToDevice, st));

  const float scale = cfg.softmax_scale();
  DsaIndexerGpu* indexer = w_->indexers[l].get();
  if (indexer) {
    // DSA: the new tokens' index keys, then every token's top-k positions.
    const int64_t latent_bytes = plan.latent_bytes[l];
    const cuda::Pages key_pages{batch.pool + plan.page_offset[l] + plan.block_size * latent_bytes, plan.row_bytes,
                                plan.block_size};
    indexer->write_keys(s.xf, N, d_slots, d_row_pos, key_pages, st);
    std::vector<IndexerRequest> reqs(S);
    for (int j = 0; j < S; ++j) {
      const SequenceStep& q = batch.seqs[ord.seq[j]];
      reqs[j] = {ord.first[j], ord.first[j + 1] - ord.first[j], q.start + static_cast<int64_t>(q.ids.size()), j};
    }
    indexer->select(s.xf, qlr ? s.qa : s.xf, N, d_row_pos, reqs, d_ctx, key_pages, table, s.indices, st, t.graph);
  }
  const int k = s.index_topk;
  // The dense tensor-core kernel reads Kimi's FP8 latent only, the sparse one Kimi's and deepseek_v32's; the other
  // latents (NVFP4, deepseek_v32's without an indexer) go to the generic kernel.
  const bool fast_latent = fast_mla(cfg) && m.entry == cuda::LatentEntry::kimi_fp8;
  const bool fast_sparse = fast_sparse_mla(cfg) && (m.entry == cuda::LatentEntry::kimi_fp8 ||
                                                    m.entry == cuda::LatentEntry::v32_fp8);
  if (indexer && fast_sparse) {
    // Sparse MLA over the selected positions: one launch for the single generated tokens, one per prompt.
    cuda::to_bf16(s.q_abs, N * H * (C + R), s.q_abs_bf, st);
    auto run = [&](int b0, int batch_n, int n_q) {
      const int64_t t0 = ord.first[b0];
      cuda::SparseMlaDecodeArgs a;
      a.q_abs = s.q_abs_bf + t0 * H * (C + R);
      a.batch = batch_n;
      a.n_q = n_q;
      a.heads = static_cast<int>(H);
      a.indices = s.indices + t0 * k;
      a.k = k;
      a.ctx_lens = d_ctx + b0;
      a.latent_pages = pages;
      a.entry = m.entry == cuda::LatentEntry::v32_fp8 ? cuda::SparseMlaEntry::v32_fp8 : cuda::SparseMlaEntry::kimi_fp8;
      a.block_table = {d_bt + b0 * bt_stride, static_cast<int>(bt_stride)};
      a.kv_scale = m.kv_scale;
      a.softmax_scale = scale;
      a.out = s.obar + t0 * H * C;
      a.lse = s.lse + t0 * H;
      cuda::sparse_mla_decode(a, s.sparse_ws, s.sparse_ws_bytes, st);
    };
    if (ord.decode > 0) run(0, ord.decode, 1);
    for (int j = ord.decode; j < S; ++j) run(j, 1, static_cast<int>(ord.first[j + 1] - ord.first[j]));
  } else if (indexer) {
    cuda::mla_attend_generic(s.q_abs, N, static_cast<int>(H), static_cast<int>(C), static_cast<int>(R), m.entry,
                             d_row_req, d_row_pos, pages, table, m.kv_scale, scale, s.indices, k, s.obar, s.lse, st);
  } else if (fast_latent) {
    // Tensor-core decode kernel: one launch for the single generated tokens, one per prompt (its tokens are the
    // causal queries of one request).
    cuda::to_bf16(s.q_abs, N * H * (C + R), s.q_abs_bf, st);
    auto run = [&](int b0, int batch_n, int n_q, int max_ctx) {
      // The grid is sized for a power of two (or max_model_len): the shapes the workspace was sized for.
      int sized = 1;
      while (sized < max_ctx) sized *= 2;
      max_ctx = static_cast<int>(std::min<int64_t>(sized, limits_.max_model_len));
      const int64_t t0 = ord.first[b0];
      cuda::MlaDecodeArgs a;
      a.q_abs = s.q_abs_bf + t0 * H * (C + R);
      a.batch = batch_n;
      a.n_q = n_q;
      a.heads = static_cast<int>(H);
      a.ctx_lens = d_ctx + b0;
      a.max_ctx_len = max_ctx;
      a.latent_dtype = cuda::LatentDtype::fp8_e4m3;
      a.latent_pages = pages;
      a.block_table = {d_bt + b0 * bt_stride, static_cast<int>(bt_stride)};
      a.kv_scale = m.kv_scale;
      a.softmax_scale = scale;
      a.out = s.obar + t0 * H * C;
      a.lse = s.lse + t0 * H;
      const size_t need = cuda::mla_decode_workspace_bytes(batch_n, n_q, a.heads, max_ctx);
      KESTREL_CHECK(need <= s.mla_ws_bytes, "the MLA decode of this step needs {} bytes of workspace, {} were set aside",
                    need, s.mla_ws_bytes);
      cuda::mla_decode(a, s.mla_ws, s.mla_ws_bytes, st);
    };
    const auto& seqs = batch.seqs;
    auto ctx_of = [&](int j) {
      const SequenceStep& q = seqs[ord.seq[j]];
      return static_cast<int>(q.start + static_cast<int64_t>(q.ids.size()));
    };
    if (ord.decode > 0) {
      int max_ctx = 1;
      for (int j = 0; j < ord.decode; ++j) max_ctx = std::max(max_ctx, ctx_of(j));
      // Replayed for any context that fits the block table's width.
      if (t.graph) max_ctx = static_cast<int>(std::min<int64_t>(limits_.max_model_len, bt_stride * plan.block_size));
      run(0, ord.decode, 1, max_ctx);
    }
    for (int j = ord.decode; j < S; ++j)
      run(j, 1, static_cast<int>(ord.first[j + 1] - ord.first[j]), ctx_of(j));
  } else {
    cuda::mla_attend_generic(s.q_abs, N, static_cast<int>(H), static_cast<int>(C), static_cast<int>(R), m.entry,
                             d_row_req, d_row_pos, pages, table, m.kv_scale, scale, nullptr, 0, s.obar, s.lse, st);
  }

  // Un-absorb per head (o[t, h] = W_UV,h obar[t, h]) and project.
  cuda::to_bf16(s.obar, N * H * C, s.obar_bf, st);
  s.gemm.batched(s.obar_bf, H * C, C, m.kv_b + dn * C, C, (dn + dv) * C, /*transpose_w=*/true, s.mo, H * dv, dv, N,
                 dv, C, H, st);
  cuda::to_bf16(s.mo, N * H * dv, s.mo_bf, st);
  linear(s, m.o_proj, s.mo_bf, N, s.y, st);
}

void GpuModel::ffn_layer(const DLayer& L, int64_t N) {
  const ModelConfig& cfg = host_.config();
  StepScratch& s = *s_;
  const cudaStream_t st = stream_;
  const int64_t D = cfg.hidden_size;
  auto dense = [&](const DFfn& f, float* out) {
    linear(s, f.w13, s.x_bf, N, s.gu, st);
    cuda::swiglu_bf16(s.gu, N, f.F, s.act_bf, st);
    linear(s, f.down, s.act_bf, N, out, st);
  };
  if (L.dense) {
    cuda::rms_norm_bf16(s.h, D, L.post_norm, N, D, cfg.rms_norm_eps, s.x_bf, D, st);
    dense(*L.dense, s.y);
    return;
  }
  // MoE: the router sees the fp32 normed input (expert choice follows the reference), the experts its bf16 copy.
  const DMoe& m = *L.moe;
  cuda::rms_norm_f32(s.h, D, L.post_norm, N, D, cfg.rms_norm_eps, s.xf, D, st);
  cuda::to_bf16(s.xf, N * D, s.x_bf, st);
  cuda::linear_f32(s.xf, N, D, m.router, m.routing.n_experts, s.router_logits, st);
  cuda::moe_route(s.router_logits, m.bias, N, m.routing, s.route_ids, s.route_w, st);
  cuda::moe_experts(s.x_bf, N, s.route_ids, s.route_w, m.routing.top_k, m.experts, s.y, s.moe_ws, s.moe_ws_bytes, st);
  if (m.shared) {
    dense(*m.shared, s.y2);
    cuda::add_inplace(s.y, s.y2, N * D, st);
  }
}

}  // namespace gpu
}  // namespace kestrel
