// The GPU engine of the model tests: a checkpoint loaded into a CUDA backend of its own (its arena `util` of the
// GPU's memory), attached to an engine. The CPU reference is a separate load of the same checkpoint on the CPU
// backend with ModelOptions::gpu_numerics.
#pragma once
#include <cstdio>
#include <memory>
#include <string>

#include "cpu/cpu_backend.h"
#include "engine/engine.h"
#include "gpu/cuda_backend.h"
#include "model/model.h"

namespace kestrel::gpu_test {

struct GpuEngineRun {
  std::unique_ptr<Model> model;  // on the CUDA backend
  std::shared_ptr<void> attached;
  std::unique_ptr<Engine> engine;
  gpu::CudaBackend& backend() const { return gpu::cuda_backend(*model); }
};

// Prompts' KDA on the fp32 chunked kernel (reference quality) unless tensor_core_kda.
inline GpuEngineRun gpu_engine(const std::string& dir, ModelOptions o, EngineConfig cfg, double util, std::FILE* log,
                               bool tensor_core_kda = false, const LoadOptions& lo = {}) {
  GpuEngineRun r;
  o.gpu_numerics = false;
  r.model = Model::load(dir, o, std::make_unique<gpu::CudaBackend>(util, log), lo);
  r.backend().set_tensor_core_kda_prefill(tensor_core_kda);
  r.attached = gpu::attach_engine(*r.model, cfg, log);
  r.engine = std::make_unique<Engine>(*r.model, cfg);
  return r;
}

// The CPU reference of the GPU's numerics.
inline std::unique_ptr<Model> cpu_reference_model(const std::string& dir, ModelOptions o, bool gpu_numerics = true,
                                                  const LoadOptions& lo = {}) {
  o.gpu_numerics = gpu_numerics;
  return load_cpu_model(dir, o, lo);
}

}  // namespace kestrel::gpu_test
