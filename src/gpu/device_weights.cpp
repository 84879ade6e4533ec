#include "gpu/device_weights.h"

#include <algorithm>
#include <cstring>
#include <thread>

#include "core/error.h"
#include "core/formats.h"
#include "kernels/cuda/dummy_weights.h"
#include "kernels/cuda/runtime.h"
#include "model/weights.h"

namespace kestrel::gpu {

namespace {

// The streamer's ring: 4 threads x 3 chunks of 64 MiB of pinned memory (768 MiB), enough to keep a disk and the
// host-to-device link busy while the host holds no copy of the model.
constexpr int kStreamThreads = 4;
constexpr size_t kStreamChunk = size_t{64} << 20;
constexpr int kStreamChunksPerThread = 3;

bool is_float(DType d) { return d == DType::F32 || d == DType::F16 || d == DType::BF16 || d == DType::F64; }

}  // namespace

WeightUploader::WeightUploader(DeviceArena& arena, WeightBytes& bytes, std::FILE* log)
    : arena_(arena),
      bytes_(bytes),
      streamer_(std::make_unique<WeightStreamer>(
          std::max(1, std::min<int>(kStreamThreads, static_cast<int>(std::thread::hardware_concurrency()))),
          kStreamChunk, kStreamChunksPerThread)),
      log_(log) {
  if (log) streamer_->set_progress(terminal_progress("loading weights", log));
  KESTREL_CUDA_CHECK(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking));
}

WeightUploader::~WeightUploader() {
  if (stream_) cudaStreamDestroy(stream_);
}

void WeightUploader::raw(const StoredTensor& t, void* dst) {
  const size_t n = t.nbytes();
  if (n == 0) return;
  if (t.dummy) {
    cuda::fill_dummy_device(*t.dummy, dst, n, stream_);
    ++dummy_tensors_;
    dummy_bytes_ += n;
    return;
  }
  KESTREL_CHECK(t.bytes.size() == n, "tensor '{}': {} bytes stored, {} expected", t.name, t.bytes.size(), n);
  if (t.file)
    streamer_->enqueue(t.name, FileSource{*t.file, static_cast<uint64_t>(t.file_offset)}, n, dst);
  else
    streamer_->enqueue(t.name, HostSource{t.bytes.data(), false}, n, dst);
}

std::vector<uint8_t> WeightUploader::host_bytes(const StoredTensor& t) {
  if (t.dummy) {
    std::vector<uint8_t> b(dummy_bytes(*t.dummy));
    fill_dummy(*t.dummy, b);
    return b;
  }
  return std::vector<uint8_t>(t.bytes.begin(), t.bytes.end());
}

std::vector<float> WeightUploader::decoded(const StoredLinear& l) {
  const size_t n = static_cast<size_t>(l.out * l.in);
  if (l.format == WeightFormat::plain) return decode_to_f32(l.weight.dtype, host_bytes(l.weight), l.weight.name);
  std::vector<float> v(n);
  if (l.format == WeightFormat::fp8_block) {
    const std::vector<uint8_t> codes = host_bytes(l.weight);
    const std::vector<float> scales = decode_to_f32(DType::F32, host_bytes(l.scales), l.scales.name);
    fp8_block_decode(codes.data(), scales.data(), l.out, l.in, l.block, v.data());
  } else {
    mxfp4_decode(host_bytes(l.weight).data(), host_bytes(l.scales).data(), static_cast<int64_t>(n), v.data());
  }
  return v;
}

const float* WeightUploader::f32(const StoredTensor& t, const char* what) {
  const std::vector<float> v = decode_to_f32(t.dtype, host_bytes(t), t.name);
  float* d = take<float>(v.size(), what, &WeightBytes::fp32);
  KESTREL_CUDA_CHECK(cudaMemcpy(d, v.data(), v.size() * sizeof(float), cudaMemcpyHostToDevice));
  return d;
}

const uint16_t* WeightUploader::bf16(const StoredLinear& l, const char* what, size_t& rounded) {
  const size_t n = static_cast<size_t>(l.out * l.in);
  uint16_t* d = take<uint16_t>(n, what, &WeightBytes::bf16);
  if (l.format == WeightFormat::plain && l.weight.dtype == DType::BF16) {
    raw(l.weight, d);
    return d;
  }
  const std::vector<float> v = decoded(l);
  std::vector<uint16_t> h(n);
  for (size_t i = 0; i < n; ++i) {
    h[i] = f32_to_bf16(v[i]);
    rounded += bf16_to_f32(h[i]) != v[i] && v[i] == v[i];
  }
  KESTREL_CUDA_CHECK(cudaMemcpy(d, h.data(), n * sizeof(uint16_t), cudaMemcpyHostToDevice));
  return d;
}

DLinear WeightUploader::linear(std::span<const StoredLinear> parts, const char* what) {
  KESTREL_CHECK(!parts.empty(), "{}: a linear weight needs at least one part", what);
  DLinear d;
  d.in = parts[0].in;
  for (const StoredLinear& p : parts) {
    KESTREL_CHECK(p.in == d.in, "{}: stacked weights of different widths ({} and {})", what, d.in, p.in);
    KESTREL_CHECK(p.format != WeightFormat::mxfp4, "{}: '{}' is MXFP4, which the GPU reads for routed experts only",
                  what, p.weight.name);
    d.out += p.out;
  }
  const bool all_fp8 = std::all_of(parts.begin(), parts.end(), [](const StoredLinear& p) {
    return p.format == WeightFormat::fp8_block;
  });
  for (const StoredLinear& p : parts)
    if (p.format == WeightFormat::fp8_block)
      KESTREL_CHECK(p.block == cuda::kFp8BlockGroup, "{}: '{}' has {}x{} blocks; the GPU's FP8 products take 128x128",
                    what, p.weight.name, p.block, p.block);
  bool joins = all_fp8;
  for (size_t i = 0; i + 1 < parts.size(); ++i) joins = joins && parts[i].out % cuda::kFp8BlockGroup == 0;
  const bool all_plain = std::none_of(parts.begin(), parts.end(), [](const StoredLinear& p) {
    return p.format == WeightFormat::fp8_block;
  });
  if (all_plain) {
    // One bf16 array, the parts' rows one after another.
    uint16_t* w = take<uint16_t>(static_cast<size_t>(d.out * d.in), what, &WeightBytes::bf16);
    int64_t row0 = 0;
    for (const StoredLinear& p : parts) {
      uint16_t* at = w + row0 * d.in;
      if (p.weight.dtype == DType::BF16) {
        raw(p.weight, at);
      } else {
        KESTREL_CHECK(is_float(p.weight.dtype), "{}: '{}' has dtype {}", what, p.weight.name, dtype_name(p.weight.dtype));
        const std::vector<float> v = decode_to_f32(p.weight.dtype, host_bytes(p.weight), p.weight.name);
        std::vector<uint16_t> h(v.size());
        for (size_t i = 0; i < v.size(); ++i) h[i] = f32_to_bf16(v[i]);
        KESTREL_CUDA_CHECK(cudaMemcpy(at, h.data(), h.size() * sizeof(uint16_t), cudaMemcpyHostToDevice));
      }
      row0 += p.out;
    }
    d.parts.push_back({0, d.out, w, std::nullopt});
    return d;
  }
  // FP8 parts in cuBLASLt's layout: one joined weight when the scale grids stack, else one per part (a bf16 part of
  // a mixed stack keeps its own array).
  auto fp8_part = [&](std::span<const StoredLinear> ps, int64_t rows) {
    const cuda::Fp8BlockWeightLayout lay = cuda::fp8_block_weight_layout(rows, d.in);
    uint8_t* codes = take<uint8_t>(lay.code_bytes(), what, &WeightBytes::fp8);
    float* scales = take<float>(lay.scale_bytes() / sizeof(float), what, &WeightBytes::fp8);
    if (lay.same_as_checkpoint()) {
      int64_t r0 = 0;
      for (const StoredLinear& p : ps) {
        raw(p.weight, codes + r0 * lay.row_bytes);
        raw(p.scales, scales + (r0 / cuda::kFp8BlockGroup) * lay.scale_row_floats);
        r0 += p.out;
      }
    } else {
      // Rows padded to the layout's pitches (small weights only: K not a multiple of 16 or of 512).
      std::vector<uint8_t> hc(lay.code_bytes(), 0);
      std::vector<float> hs(lay.scale_bytes() / sizeof(float), 0.0f);
      int64_t r0 = 0;
      for (const StoredLinear& p : ps) {
        const std::vector<uint8_t> c = host_bytes(p.weight);
        const std::vector<float> s = decode_to_f32(DType::F32, host_bytes(p.scales), p.scales.name);
        const int64_t cols = (d.in + cuda::kFp8BlockGroup - 1) / cuda::kFp8BlockGroup;
        for (int64_t r = 0; r < p.out; ++r) std::memcpy(hc.data() + (r0 + r) * lay.row_bytes, c.data() + r * d.in, d.in);
        const int64_t brows = (p.out + cuda::kFp8BlockGroup - 1) / cuda::kFp8BlockGroup;
        for (int64_t b = 0; b < brows; ++b)
          std::copy_n(s.data() + b * cols, cols, hs.data() + (r0 / cuda::kFp8BlockGroup + b) * lay.scale_row_floats);
        r0 += p.out;
      }
      KESTREL_CUDA_CHECK(cudaMemcpy(codes, hc.data(), hc.size(), cudaMemcpyHostToDevice));
      KESTREL_CUDA_CHECK(cudaMemcpy(scales, hs.data(), hs.size() * sizeof(float), cudaMemcpyHostToDevice));
    }
    return cuda::Fp8BlockWeight{codes, scales, rows, d.in};
  };
  if (joins) {
    d.parts.push_back({0, d.out, nullptr, fp8_part(parts, d.out)});
    return d;
  }
  int64_t row0 = 0;
  for (size_t i = 0; i < parts.size(); ++i) {
    const StoredLinear& p = parts[i];
    DLinear::Part part{row0, p.out, nullptr, std::nullopt};
    if (p.format == WeightFormat::fp8_block) {
      part.fp8 = fp8_part(parts.subspan(i, 1), p.out);
    } else {
      size_t rounded = 0;
      part.bf16 = bf16(p, what, rounded);
    }
    d.parts.push_back(part);
    row0 += p.out;
  }
  return d;
}

void WeightUploader::finish() {
  streamer_->finish();
  KESTREL_CUDA_CHECK(cudaStreamSynchronize(stream_));
  if (log_ && dummy_tensors_ > 0) {
    const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - start_).count();
    std::fprintf(log_, "[kestrel] dummy weights: %lld tensors, %.2f GiB made on the device in %.2f s\n",
                 static_cast<long long>(dummy_tensors_), static_cast<double>(dummy_bytes_) / (1u << 30), s);
  }
}

}  // namespace kestrel::gpu
