// A whole decode step of the GPU engine against the step roofline (../shared/bench/BENCHMARKING.md: [dense weights +
// MoE bytes touched + KV/state bytes] / 4.27 TB/s). Makes the `small` kimi_linear model, fills B sequences with an
// L-token prompt each through the engine, then times Engine::step() on steps where every sequence generates one
// token: with CUDA graphs (one per batch size, the default) and without, and with graphs and sampling on the GPU. The time per step is the time per output
// token of each sequence (what a user sees: scheduling, tables, kernels, logits copy and sampling included).
//
// Usage: model_step_bench [--batches 1,64] [--contexts 1024,8192] [--steps 32] [--preset small]
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <random>
#include <set>
#include <sstream>
#include <string>
#include <vector>

#include <unistd.h>

#include "core/stats.h"
#include "engine/engine.h"
#include "gpu/cuda_backend.h"
#include "model/make_model.h"
#include "model/model.h"

using namespace kestrel;

namespace {

constexpr double kBandwidth = 4.27e12;  // device-to-device copy, bytes/s (BENCHMARKING.md)

std::vector<int> parse_list(const char* s) {
  std::vector<int> v;
  std::stringstream in(s);
  std::string item;
  while (std::getline(in, item, ',')) v.push_back(std::stoi(item));
  return v;
}

// Bytes a decode step of B sequences at context L must read (and, for KDA states, write) at least once.
double step_bytes(const ModelConfig& c, int B, int64_t L) {
  const double D = c.hidden_size, bf = 2;
  double bytes = c.vocab_size * D * bf;  // LM head (the embedding reads B rows)
  for (int l = 0; l < c.num_hidden_layers; ++l) {
    if (c.layer_kinds[l] == LayerKind::kda) {
      const double H = c.kda_num_heads, dk = c.kda_head_dim, P = H * dk;
      bytes += (3 * P * D + dk * D + P * dk + H * D + dk * D + P * dk + D * P) * bf;  // projections
      bytes += B * 2.0 * H * dk * dk * 4;                                             // state read + write
    } else {
      const double H = c.num_attention_heads, C = c.kv_lora_rank, R = c.qk_rope_head_dim;
      const double q = c.q_lora_rank ? (D * c.q_lora_rank + c.q_lora_rank * H * c.qk_head_dim()) : D * H * c.qk_head_dim();
      bytes += (q + D * (C + R) + H * (c.qk_nope_head_dim + c.v_head_dim) * C + H * c.v_head_dim * D) * bf;
      bytes += B * static_cast<double>(L) * (C + R);  // FP8 latent rows
    }
    if (c.is_moe_layer(l)) {
      const double E = c.n_routed_experts, K = c.num_experts_per_tok, F = c.moe_intermediate_size;
      const double touched = E * (1 - std::pow(1 - K / E, B));
      const double per_weight = c.weight_quant == WeightQuant::mxfp4 ? 0.5 + 1.0 / 32 : bf;
      bytes += touched * 3 * D * F * per_weight + E * D * 4;  // experts + fp32 router
      bytes += 3 * D * F * c.n_shared_experts * bf;
    } else {
      bytes += 3 * D * c.intermediate_size * bf;
    }
  }
  return bytes;
}

}  // namespace

int main(int argc, char** argv) {
  std::vector<int> batches{1, 64}, contexts{1024, 8192};
  int steps = 32;
  std::string preset = "small";
  for (int i = 1; i + 1 < argc; i += 2) {
    if (!std::strcmp(argv[i], "--batches")) batches = parse_list(argv[i + 1]);
    else if (!std::strcmp(argv[i], "--contexts")) contexts = parse_list(argv[i + 1]);
    else if (!std::strcmp(argv[i], "--steps")) steps = std::stoi(argv[i + 1]);
    else if (!std::strcmp(argv[i], "--preset")) preset = argv[i + 1];
  }
  const std::string dir = std::filesystem::temp_directory_path() / ("kestrel_step_bench_" + std::to_string(::getpid()));
  make_model(find_preset(Arch::kimi_linear, preset), dir, 3);
  ModelOptions opts;
  opts.latent_cache = LatentCacheDtype::fp8;
  const ModelConfig c = load_model_config(dir);
  std::printf("model: kimi_linear %s (hidden %lld, %d layers, vocab %lld)\n", preset.c_str(),
              static_cast<long long>(c.hidden_size), c.num_hidden_layers, static_cast<long long>(c.vocab_size));
  std::printf("%6s %7s %12s %12s %12s %12s %10s %10s\n", "batch", "context", "step_ms", "no_graph_ms",
              "gpu_samp_ms", "roofline_ms", "x_roof", "tok/s");
  std::mt19937 rng(5);
  for (int L : contexts)
    for (int B : batches) {
      EngineConfig cfg;
      cfg.max_num_seqs = std::max(B, 1);
      cfg.max_num_batched_tokens = 2048;
      cfg.max_model_len = L + int64_t{B} * L / 2048 + 2 * steps + 192;
      cfg.enable_prefix_caching = false;
      // A model of its own per shape: the CUDA backend's workspaces are sized once, for the engine's limits.
      const auto model = Model::load(dir, opts, std::make_unique<gpu::CudaBackend>(0.6, nullptr));
      gpu::CudaBackend& gpu = gpu::cuda_backend(*model);
      const std::shared_ptr<void> attached = gpu::attach_engine(*model, cfg, nullptr);
      Engine e(*model, cfg);
      SamplingParams sp;
      // Long enough that no request ends while the last prompts are still prefilling.
      sp.max_tokens = static_cast<int>(int64_t{B} * L / cfg.max_num_batched_tokens) + 2 * steps + 64;
      sp.ignore_eos = true;
      for (int b = 0; b < B; ++b) {
        std::vector<int32_t> p(L);
        for (auto& t : p) t = static_cast<int32_t>(rng() % c.vocab_size);
        e.add_request(p, sp);
      }
      // Until every prompt is in the cache: each request has produced its first token.
      std::set<RequestId> started;
      while (static_cast<int>(started.size()) < B)
        for (const TokenEvent& t : e.step().tokens) started.insert(t.request);
      auto time_steps = [&](bool graphs) {
        gpu.set_cuda_graphs(graphs);
        for (int i = 0; i < 3; ++i) e.step();
        std::vector<double> ms;
        for (int i = 0; i < steps; ++i) {
          const auto t0 = std::chrono::steady_clock::now();
          const StepOutput o = e.step();
          const auto t1 = std::chrono::steady_clock::now();
          if (o.num_tokens != B) std::printf("warning: a step of %lld tokens\n", static_cast<long long>(o.num_tokens));
          ms.push_back(std::chrono::duration<double, std::milli>(t1 - t0).count());
        }
        std::sort(ms.begin(), ms.end());
        return percentile(ms, 50);
      };
      // Sampling on the host (logits copied back), without and with graphs; then sampling on the GPU (the
      // default: token ids copied back), graphs on. The profile below is of the default.
      gpu.set_gpu_sampling(false);
      const double no_graph = time_steps(false);
      const double graph = time_steps(true);
      gpu.set_gpu_sampling(true);
      const double gpu_sampled = time_steps(true);
      const double roof = step_bytes(c, B, L) / kBandwidth * 1e3;
      std::printf("%6d %7d %12.4f %12.4f %12.4f %12.4f %10.2f %10.0f\n", B, L, graph, no_graph, gpu_sampled, roof,
                  std::min(graph, gpu_sampled) / roof, B / std::min(graph, gpu_sampled) * 1e3);
      // Where the time goes: medians over a few steps of the host's preparation, the GPU's kernels (per layer
      // without a graph), the logits' copy, and the rest of Engine::step (scheduling, sampling).
      for (bool graphs : {true, false}) {
        gpu.set_cuda_graphs(graphs);
        gpu.set_profiling(true);
        e.step();
        std::vector<double> step, prep, gpu_ms, copy;
        std::vector<std::vector<double>> layer(c.num_hidden_layers);
        for (int i = 0; i < 8; ++i) {
          const auto t0 = std::chrono::steady_clock::now();
          e.step();
          step.push_back(std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count());
          const auto& t = gpu.last_step_times();
          prep.push_back(t.prepare_ms);
          gpu_ms.push_back(t.gpu_ms);
          copy.push_back(t.copy_ms);
          for (size_t l = 0; l < t.layer_ms.size(); ++l) layer[l].push_back(t.layer_ms[l]);
        }
        gpu.set_profiling(false);
        auto med = [](std::vector<double> v) {
          std::sort(v.begin(), v.end());
          return v.empty() ? 0.0 : percentile(v, 50);
        };
        std::printf("  profile B=%d L=%d %s: step %.4f ms = prepare %.4f + GPU %.4f + logits copy or GPU sampling "
                    "%.4f + engine %.4f\n",
                    B, L, graphs ? "graph" : "no graph", med(step), med(prep), med(gpu_ms), med(copy),
                    med(step) - med(prep) - med(gpu_ms) - med(copy));
        if (!graphs)
          for (int l = 0; l < c.num_hidden_layers; ++l)
            std::printf("    layer %d (%s, %s): %.4f ms\n", l, c.layer_kinds[l] == LayerKind::kda ? "KDA" : "MLA",
                        c.is_moe_layer(l) ? "MoE" : "FFN", med(layer[l]));
      }
      std::fflush(stdout);
    }
  std::filesystem::remove_all(dir);
  return 0;
}
