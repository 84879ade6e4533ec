"""Independent NumPy golden model of the three architectures Kestrel serves (kimi_linear, deepseek_v32, kimi_k3).

Written from the spec pages (shared/spec/MODEL.md, dsa_mla.md, kda_kimi_linear.md) and docs/reference-numerics.md,
without reading Kestrel's C++ forward pass, so that it can serve as a golden test of that reference. Deliberately
it takes the other algebraic form where there is a choice: MLA in the non-absorbed "MHA" form (keys and values
expanded from the cached latent through kv_b_proj), KDA in the plain token-by-token recurrent form. Arithmetic is
float64, except where the reference defines exact low-precision steps (FP8 weight dequantisation, the indexer's
FP8 quantisation and score accumulation), which are emulated bit for bit so that top-k selections match.

Public API:
    forward(ckpt_dir, token_ids) -> np.ndarray [len(token_ids), vocab]   (float64 logits, causal prefill)
    load_model(ckpt_dir) -> Model;  Model.forward(token_ids, audit=None) -> logits
    Audit(margin): collects the top-k decisions that fp32 rounding could legitimately flip
plus the format helpers (e4m3, e2m1, bf16, ue8m0 FP8 blocks, Hadamard) and a numpy-only safetensors reader.
"""

from __future__ import annotations

import json
import math
import os

import numpy as np

# ----------------------------------------------------------------------------------------------------------------
# Number formats
# ----------------------------------------------------------------------------------------------------------------

E4M3_MAX = 448.0
E2M1_MAGNITUDES = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])


def _e4m3_code_value(code: int) -> float:
    """Value of one FP8 e4m3fn code: 1 sign, 4 exponent (bias 7), 3 mantissa bits; no inf; S.1111.111 is NaN."""
    sign = -1.0 if code & 0x80 else 1.0
    exponent = (code >> 3) & 0xF
    mantissa = code & 0x7
    if exponent == 0xF and mantissa == 0x7:
        return math.nan
    if exponent == 0:
        return sign * mantissa * 2.0**-9
    return sign * (1.0 + mantissa / 8.0) * 2.0 ** (exponent - 7)


E4M3_TABLE = np.array([_e4m3_code_value(c) for c in range(256)], dtype=np.float64)


def e4m3_decode(codes: np.ndarray) -> np.ndarray:
    return E4M3_TABLE[np.asarray(codes, dtype=np.uint8)]


def e4m3_round(x: np.ndarray) -> np.ndarray:
    """Nearest e4m3fn value (ties to even), saturating at +-448; returns float64 values, -0 kept."""
    x = np.asarray(x, dtype=np.float64)
    mag = np.minimum(np.abs(x), E4M3_MAX)
    # frexp: mag = m * 2^e with m in [0.5, 1), so floor(log2 mag) = e - 1 exactly. Exponents below the smallest
    # normal (2^-6) share the subnormal quantum 2^-9.
    _, e = np.frexp(mag)
    exp2 = np.maximum(e - 1, -6)
    quantum = np.ldexp(1.0, exp2 - 3)
    rounded = np.rint(mag / quantum) * quantum  # rint rounds half to even; division by 2^k is exact
    rounded = np.minimum(rounded, E4M3_MAX)
    return np.copysign(rounded, x)


def e2m1_decode(codes: np.ndarray) -> np.ndarray:
    """4-bit e2m1 codes (bit 3 sign, then 2 exponent bits and 1 mantissa bit) to float64."""
    codes = np.asarray(codes, dtype=np.uint8)
    mag = E2M1_MAGNITUDES[codes & 0x7]
    return np.where(codes & 0x8, -mag, mag)


def bf16_decode(bits: np.ndarray) -> np.ndarray:
    return (np.asarray(bits, dtype=np.uint16).astype(np.uint32) << 16).view(np.float32)


def round_up_pow2_f32(s: np.ndarray) -> np.ndarray:
    """Smallest power of two >= s (s > 0, finite), computed exactly from the exponent; float32 result."""
    s = np.asarray(s, dtype=np.float64)
    m, e = np.frexp(s)  # s = m * 2^e, m in [0.5, 1): s is a power of two iff m == 0.5
    out = np.where(m == 0.5, s, np.ldexp(1.0, e))
    return out.astype(np.float32)


F32_INV_448 = np.float32(1.0) / np.float32(448.0)


def quantize_fp8_ue8m0(x: np.ndarray):
    """FP8 block quantisation along the last axis (one block per vector), as the indexer defines it.

    The vectors are first taken as float32 (the reference's activations are fp32). amax is floored at 1e-4, the
    scale is float32(amax * float32(1/448)) rounded up to a power of two, codes = e4m3(clamp(x/s, +-448)).
    Returns (code values as float64 [..., n], scales float32 [...])."""
    x32 = np.asarray(x, dtype=np.float32)
    amax = np.maximum(np.max(np.abs(x32), axis=-1), np.float32(1e-4)).astype(np.float32)
    scale = round_up_pow2_f32((amax * F32_INV_448).astype(np.float32))
    ratio = x32.astype(np.float64) / scale.astype(np.float64)[..., None]  # exact: s is a power of two
    codes = e4m3_round(np.clip(ratio, -E4M3_MAX, E4M3_MAX))
    return codes, scale


def hadamard_matrix(n: int) -> np.ndarray:
    """Sylvester Hadamard matrix of order n (a power of two), entries +-1: H[i, j] = (-1)^popcount(i & j)."""
    if n <= 0 or n & (n - 1):
        raise ValueError(f"Hadamard order must be a power of two, got {n}")
    h = np.ones((1, 1))
    while h.shape[0] < n:
        h = np.block([[h, h], [h, -h]])
    return h


def hadamard_rotate(x: np.ndarray) -> np.ndarray:
    """Orthonormal Hadamard rotation y = H x / sqrt(n) along the last axis."""
    n = x.shape[-1]
    return x @ hadamard_matrix(n).T / math.sqrt(n)


# ----------------------------------------------------------------------------------------------------------------
# safetensors, numpy only
# ----------------------------------------------------------------------------------------------------------------

_RAW_DTYPES = {
    "F32": np.dtype("<f4"),
    "F16": np.dtype("<f2"),
    "BF16": np.dtype("<u2"),
    "F8_E4M3": np.dtype("u1"),
    "U8": np.dtype("u1"),
    "I8": np.dtype("i1"),
    "I32": np.dtype("<i4"),
    "I64": np.dtype("<i8"),
    "F64": np.dtype("<f8"),
}


def read_safetensors_header(path: str):
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) != 8:
            raise ValueError(f"{path}: shorter than 8 bytes")
        n = int.from_bytes(head, "little")
        header = json.loads(f.read(n).decode("utf-8"))
    return header, 8 + n


class Checkpoint:
    """Tensors of a checkpoint directory (model.safetensors, or model.safetensors.index.json plus shards)."""

    def __init__(self, ckpt_dir: str):
        self.dir = ckpt_dir
        index_path = os.path.join(ckpt_dir, "model.safetensors.index.json")
        if os.path.exists(index_path):
            with open(index_path) as f:
                weight_map = json.load(f)["weight_map"]
            files = sorted(set(weight_map.values()))
        else:
            weight_map = None
            files = ["model.safetensors"]
        self.entries = {}  # name -> (path, dtype, shape, begin, end)
        for fname in files:
            path = os.path.join(ckpt_dir, fname)
            header, data_start = read_safetensors_header(path)
            for name, info in header.items():
                if name == "__metadata__":
                    continue
                if name in self.entries:
                    raise ValueError(f"tensor {name} appears in two files")
                begin, end = info["data_offsets"]
                self.entries[name] = (path, info["dtype"], tuple(info["shape"]), data_start + begin, data_start + end)
        if weight_map is not None:
            for name, fname in weight_map.items():
                if name not in self.entries or os.path.basename(self.entries[name][0]) != fname:
                    raise ValueError(f"index names {name} in {fname}, which does not hold it")
        self._cache = {}

    def has(self, name: str) -> bool:
        return name in self.entries

    def dtype(self, name: str) -> str:
        return self.entries[name][1]

    def raw(self, name: str) -> np.ndarray:
        """The stored array in its storage dtype (BF16 as uint16 bits, F8_E4M3 as uint8 codes)."""
        if name not in self.entries:
            raise KeyError(f"tensor {name} not in checkpoint {self.dir}")
        path, dtype, shape, begin, end = self.entries[name]
        np_dtype = _RAW_DTYPES[dtype]
        count = int(np.prod(shape, dtype=np.int64))
        if end - begin != count * np_dtype.itemsize:
            raise ValueError(f"{name}: byte range does not match dtype {dtype} and shape {shape}")
        with open(path, "rb") as f:
            f.seek(begin)
            buf = f.read(end - begin)
        return np.frombuffer(buf, dtype=np_dtype).reshape(shape)

    def tensor(self, name: str) -> np.ndarray:
        """A plain (unscaled) tensor decoded to float64."""
        dtype = self.dtype(name)
        raw = self.raw(name)
        if dtype == "BF16":
            return bf16_decode(raw).astype(np.float64)
        if dtype == "F8_E4M3":
            return e4m3_decode(raw)
        return raw.astype(np.float64)

    def weight(self, prefix: str) -> np.ndarray:
        """Linear weight [out, in] as float64: prefix.weight (bf16/f16/f32, or e4m3 with weight_scale_inv
        128x128 block scales), or MXFP4 prefix.weight_packed + prefix.weight_scale."""
        if prefix in self._cache:
            return self._cache[prefix]
        if self.has(prefix + ".weight_packed"):
            w = self._mxfp4_weight(prefix)
        else:
            name = prefix + ".weight"
            if self.dtype(name) == "F8_E4M3":
                w = self._fp8_block_weight(prefix)
            else:
                w = self.tensor(name)
        self._cache[prefix] = w
        return w

    def _fp8_block_weight(self, prefix: str) -> np.ndarray:
        codes = self.raw(prefix + ".weight")
        scale = self.raw(prefix + ".weight_scale_inv")
        if self.dtype(prefix + ".weight_scale_inv") != "F32":
            raise ValueError(f"{prefix}.weight_scale_inv must be F32")
        out_dim, in_dim = codes.shape
        if scale.shape != (-(-out_dim // 128), -(-in_dim // 128)):
            raise ValueError(f"{prefix}.weight_scale_inv has shape {scale.shape} for a weight {codes.shape}")
        full = np.repeat(np.repeat(scale, 128, axis=0), 128, axis=1)[:out_dim, :in_dim]
        # One fp32 multiply per element, as the reference dequantises.
        return (e4m3_decode(codes).astype(np.float32) * full.astype(np.float32)).astype(np.float64)

    def _mxfp4_weight(self, prefix: str) -> np.ndarray:
        packed = self.raw(prefix + ".weight_packed")
        scales = self.raw(prefix + ".weight_scale")
        out_dim, half = packed.shape
        in_dim = 2 * half
        if scales.shape != (out_dim, in_dim // 32):
            raise ValueError(f"{prefix}.weight_scale has shape {scales.shape} for in={in_dim}")
        codes = np.empty((out_dim, in_dim), dtype=np.uint8)
        codes[:, 0::2] = packed & 0x0F
        codes[:, 1::2] = packed >> 4
        factor = np.ldexp(1.0, scales.astype(np.int64) - 127)
        return e2m1_decode(codes) * np.repeat(factor, 32, axis=1)


# ----------------------------------------------------------------------------------------------------------------
# Configuration
# ----------------------------------------------------------------------------------------------------------------

ARCH_BY_CLASS = {
    "KimiLinearForCausalLM": "kimi_linear",
    "DeepseekV32ForCausalLM": "deepseek_v32",
    "KimiK3ForCausalLM": "kimi_k3",
}


def _first_present(cfg: dict, names, default=None):
    for n in names:
        if n in cfg and cfg[n] is not None:
            return cfg[n]
    return default


class Config:
    def __init__(self, cfg: dict):
        self.raw = cfg
        arch = cfg.get("model_type")
        if arch not in ("kimi_linear", "deepseek_v32", "kimi_k3"):
            arch = ARCH_BY_CLASS.get((cfg.get("architectures") or [None])[0])
        if arch is None:
            raise ValueError(f"unknown architecture: model_type={cfg.get('model_type')} "
                             f"architectures={cfg.get('architectures')}")
        self.arch = arch
        self.is_kimi = arch in ("kimi_linear", "kimi_k3")
        self.hidden = cfg["hidden_size"]
        self.n_layers = cfg["num_hidden_layers"]
        self.vocab = cfg["vocab_size"]
        self.eps = cfg["rms_norm_eps"]
        self.tie_embeddings = bool(cfg.get("tie_word_embeddings", False))

        # MLA
        self.n_heads = cfg["num_attention_heads"]
        self.q_lora_rank = cfg.get("q_lora_rank")
        self.kv_lora_rank = cfg["kv_lora_rank"]
        self.d_nope = cfg["qk_nope_head_dim"]
        self.d_rope = cfg["qk_rope_head_dim"]
        self.d_v = cfg["v_head_dim"]

        # RoPE (deepseek_v32 only; Kimi models are NoPE)
        self.use_rope = arch == "deepseek_v32"
        self.rope_theta = float(cfg.get("rope_theta", 10000.0))
        self.rope_scaling = cfg.get("rope_scaling")
        mscale = 1.0
        rs = self.rope_scaling
        if self.use_rope and rs and rs.get("type", rs.get("rope_type")) == "yarn":
            factor = float(rs["factor"])
            if factor > 1.0:
                mscale = 0.1 * float(rs.get("mscale_all_dim", 1.0)) * math.log(factor) + 1.0
        self.softmax_scale = (self.d_nope + self.d_rope) ** -0.5 * mscale * mscale

        # DSA indexer
        self.has_indexer = arch in ("deepseek_v32", "kimi_k3")
        if self.has_indexer:
            self.index_heads = cfg["index_n_heads"]
            self.index_dim = cfg["index_head_dim"]
            self.index_topk = cfg["index_topk"]

        # layer kinds
        if self.is_kimi:
            lac = cfg["linear_attn_config"]
            kda = set(lac["kda_layers"])
            full = set(lac["full_attn_layers"])
            kinds = []
            for i in range(self.n_layers):
                in_kda, in_full = (i + 1) in kda, (i + 1) in full
                if in_kda == in_full:
                    raise ValueError(f"layer {i + 1} (1-based) must be in exactly one of kda_layers/full_attn_layers")
                kinds.append("kda" if in_kda else "mla")
            self.layer_kinds = kinds
            self.kda_heads = lac["num_heads"]
            self.kda_head_dim = lac["head_dim"]
            self.kda_conv = lac.get("short_conv_kernel_size", 4)
            lb = cfg.get("kda_gate_lower_bound", lac.get("kda_gate_lower_bound"))
            self.kda_gate_lower_bound = None if lb is None else float(lb)
        else:
            self.layer_kinds = ["mla"] * self.n_layers

        # FFN / MoE
        self.first_dense = cfg.get("first_k_dense_replace", 0)
        self.moe_freq = cfg.get("moe_layer_freq", 1)
        self.n_experts = _first_present(cfg, ["n_routed_experts", "num_experts"], 0)
        self.top_k = _first_present(cfg, ["num_experts_per_tok", "num_experts_per_token"])
        self.n_shared = _first_present(cfg, ["n_shared_experts", "num_shared_experts"], 0)
        self.n_group = _first_present(cfg, ["n_group", "num_expert_group"], 1)
        if cfg.get("use_grouped_topk") is False:
            self.n_group = 1
        self.topk_group = _first_present(cfg, ["topk_group"], 1)
        self.routed_scale = float(_first_present(cfg, ["routed_scaling_factor"], 1.0))
        self.renormalize = bool(_first_present(cfg, ["norm_topk_prob", "moe_renormalize"], True))
        scoring = _first_present(cfg, ["scoring_func", "moe_router_activation_func"], "sigmoid")
        if scoring != "sigmoid":
            raise ValueError(f"router scoring {scoring} is not part of the spec")

    def is_moe_layer(self, i: int) -> bool:
        return self.n_experts > 0 and i >= self.first_dense and i % self.moe_freq == 0


# ----------------------------------------------------------------------------------------------------------------
# Building blocks
# ----------------------------------------------------------------------------------------------------------------


def rms_norm(x, w, eps):
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * w


def layer_norm(x, w, b, eps):
    mu = np.mean(x, axis=-1, keepdims=True)
    var = np.mean((x - mu) ** 2, axis=-1, keepdims=True)
    return (x - mu) / np.sqrt(var + eps) * w + b


def silu(x):
    return x / (1.0 + np.exp(-x))


def sigmoid(x):
    return 1.0 / (1.0 + np.exp(-x))


def softplus(x, threshold=20.0):
    return np.where(x > threshold, x, np.log1p(np.exp(np.minimum(x, threshold))))


def linear(x, w):
    return x @ w.T


def rope_frequencies(cfg: Config) -> np.ndarray:
    """The d_rope/2 rotary frequencies, with DeepSeek's YaRN blend when rope_scaling is yarn."""
    dim = cfg.d_rope
    base = cfg.rope_theta
    freqs = 1.0 / base ** (np.arange(0, dim, 2, dtype=np.float64) / dim)
    rs = cfg.rope_scaling
    if rs and rs.get("type", rs.get("rope_type")) == "yarn":
        factor = float(rs["factor"])
        orig = float(rs["original_max_position_embeddings"])
        beta_fast = float(rs.get("beta_fast", 32))
        beta_slow = float(rs.get("beta_slow", 1))

        def correction_dim(rotations):
            return dim * math.log(orig / (rotations * 2 * math.pi)) / (2 * math.log(base))

        low = max(math.floor(correction_dim(beta_fast)), 0)
        high = min(math.ceil(correction_dim(beta_slow)), dim - 1)
        if low == high:
            high += 0.001
        ramp = np.clip((np.arange(dim // 2, dtype=np.float64) - low) / (high - low), 0.0, 1.0)
        freqs = freqs / factor * ramp + freqs * (1.0 - ramp)
    return freqs


def rope_interleaved(x, positions, freqs):
    """Rotate pairs (x[2i], x[2i+1]) by pos * f_i; x [..., T, d] with T on axis -2 or broadcastable."""
    ang = positions[:, None] * freqs[None, :]  # [T, d/2]
    cos, sin = np.cos(ang), np.sin(ang)
    a, b = x[..., 0::2], x[..., 1::2]
    out = np.empty_like(x)
    out[..., 0::2] = a * cos - b * sin
    out[..., 1::2] = a * sin + b * cos
    return out


def rope_neox(x, positions, freqs):
    """Rotate pairs (x[i], x[i + d/2]) by pos * f_i (rotate-half)."""
    half = x.shape[-1] // 2
    ang = positions[:, None] * freqs[None, :]
    cos, sin = np.cos(ang), np.sin(ang)
    a, b = x[..., :half], x[..., half:]
    return np.concatenate([a * cos - b * sin, a * sin + b * cos], axis=-1)


def topk_rank(scores: np.ndarray, k: int) -> np.ndarray:
    """Indices of the k best entries: higher score first, then lower index (-0 equals +0)."""
    order = np.lexsort((np.arange(scores.shape[0]), -(scores + 0.0)))
    return order[:k]


# ----------------------------------------------------------------------------------------------------------------
# Conditioning audit
# ----------------------------------------------------------------------------------------------------------------


class Audit:
    """Collects the discrete decisions of a forward pass (indexer top-k, MoE expert and group choice) that an
    fp32 implementation of the same math could legitimately take the other way.

    The golden model runs in fp64. An fp32 implementation differs from it by rounding noise; on the indexer
    inputs that noise reaches ~1e-6 of the block's amax. Where it can move one input across an e4m3 rounding
    midpoint (or a block scale across a power of two) and that changes a top-k set, or where two candidates'
    scores are closer than the noise, the two implementations may select differently while both follow the
    spec, and their logits then differ far beyond rounding. Such an input cannot serve as a golden comparison;
    tests pick inputs for which the audit stays empty. margin bounds the fp32-vs-fp64 difference, relative to the
    block amax (indexer inputs) or to the compared values (scores, router scores)."""

    def __init__(self, margin: float = 5e-6):
        self.margin = margin
        self.events = []  # (layer, kind, position, detail)
        self.layer = None

    def add(self, kind: str, position: int, detail: str):
        self.events.append((self.layer, kind, int(position), detail))


_E4M3_FINITE = np.unique(E4M3_TABLE[np.isfinite(E4M3_TABLE)])


def fp8_code_range(x, scale, margin):
    """For an FP8 ue8m0 block quantisation (blocks along the last axis) of x with the given scales: the lowest and
    highest code value each input could round to when perturbed by margin * amax, and whether a block's scale
    could change (amax * 1/448 within that margin of a power of two)."""
    x32 = np.asarray(x, dtype=np.float32).astype(np.float64)
    amax = np.maximum(np.max(np.abs(x32), axis=-1), 1e-4)
    s = np.asarray(scale, dtype=np.float64)
    window = (margin * amax / s)[..., None]
    r = x32 / s[..., None]
    lo = e4m3_round(np.clip(r - window, -E4M3_MAX, E4M3_MAX))
    hi = e4m3_round(np.clip(r + window, -E4M3_MAX, E4M3_MAX))
    raw = amax * float(F32_INV_448)
    scale_fragile = round_up_pow2_f32(raw * (1 - margin)) != round_up_pow2_f32(raw * (1 + margin))
    return lo, hi, scale_fragile


def _other_codes(code, lo, hi):
    return [float(v) for v in _E4M3_FINITE[(_E4M3_FINITE >= lo) & (_E4M3_FINITE <= hi)] if v != code]


def audit_indexer(audit: Audit, topk: int, q, q_codes, q_scale, k, k_codes, k_scale, gate, scores):
    """Records the query rows whose top-k set an fp32 implementation could choose differently: a block scale
    within the margin of a power of two; one e4m3 code that the margin could change and whose change alters the
    selection (each such code is tried on its own); or a k-th/(k+1)-th score gap within the margin."""
    T = q_codes.shape[0]
    m = audit.margin
    q_lo, q_hi, q_scale_fragile = fp8_code_range(q, q_scale, m)
    k_lo, k_hi, k_scale_fragile = fp8_code_range(k, k_scale, m)
    for t in np.nonzero(q_scale_fragile.any(axis=1))[0]:
        audit.add("indexer-q-scale", t, "block scale within the margin of a power of two")
    for s_ in np.nonzero(k_scale_fragile)[0]:
        audit.add("indexer-k-scale", s_, "block scale within the margin of a power of two")

    def selection(row_scores, t):
        return set(topk_rank(row_scores[: t + 1], topk).tolist())

    decided = range(topk, T)  # rows with more candidates than topk; earlier rows select everything
    base = {t: selection(scores[t], t) for t in decided}
    for t in decided:
        order = np.sort(scores[t, : t + 1].astype(np.float64))[::-1]
        gap = order[topk - 1] - order[topk]
        if 0 < gap <= m * max(abs(order[topk - 1]), abs(order[topk])):
            audit.add("indexer-topk", t, f"k-th score {order[topk - 1]:.9g} vs next {order[topk]:.9g}")
        for j, d in zip(*np.nonzero((q_lo[t] != q_codes[t]) | (q_hi[t] != q_codes[t]))):
            for alt in _other_codes(q_codes[t, j, d], q_lo[t, j, d], q_hi[t, j, d]):
                qc = q_codes[t : t + 1].copy()
                qc[0, j, d] = alt
                new = indexer_scores(qc, q_scale[t : t + 1], k_codes[: t + 1], k_scale[: t + 1], gate[t : t + 1])
                if selection(new[0], t) != base[t]:
                    audit.add("indexer-q-code", t, f"head {j} dim {d}: code {q_codes[t, j, d]:g} or {alt:g}")
    for s_, d in zip(*np.nonzero((k_lo != k_codes) | (k_hi != k_codes))):
        for alt in _other_codes(k_codes[s_, d], k_lo[s_, d], k_hi[s_, d]):
            kc = k_codes.copy()
            kc[s_, d] = alt
            new = indexer_scores(q_codes, q_scale, kc, k_scale, gate)
            for t in decided:
                if t >= s_ and selection(new[t], t) != base[t]:
                    audit.add("indexer-k-code", t, f"key {s_} dim {d}: code {k_codes[s_, d]:g} or {alt:g}")


def audit_ranking(audit: Audit, kind: str, position: int, values, k: int):
    """Records a top-k choice whose k-th and (k+1)-th values are within the margin of each other."""
    order = np.sort(values[np.isfinite(values)])[::-1]
    if order.size <= k:
        return
    gap = order[k - 1] - order[k]
    if gap <= audit.margin * max(abs(order[k - 1]), abs(order[k]), 1e-30):
        audit.add(kind, position, f"k-th {order[k - 1]:.9g} vs next {order[k]:.9g}")


# ----------------------------------------------------------------------------------------------------------------
# Mixers and FFNs
# ----------------------------------------------------------------------------------------------------------------


def indexer_scores(q_codes, q_scale, k_codes, k_scale, gate):
    """Index scores I[t, s] = k_scale_s * sum_j w_tj * ReLU(q_codes[t, j] . k_codes[s]) in float32, as the
    reference evaluates them: exact e4m3 dots rounded once to fp32, folded weights
    w = fp32(gate) * fp32(H^-1/2) * q_scale * fp32(D^-1/2) left to right, head sum in order j = 0.. in fp32.
    q_codes [T, H, D] and k_codes [S, D] are e4m3 code values, q_scale [T, H], k_scale [S], gate [T, H]."""
    T, HI, D = q_codes.shape
    w = np.asarray(gate, dtype=np.float32) * np.float32(HI**-0.5)
    w = (w * np.asarray(q_scale, dtype=np.float32)).astype(np.float32)
    w = (w * np.float32(D**-0.5)).astype(np.float32)
    dots = np.einsum("tjd,sd->tjs", q_codes, k_codes)  # exact in float64 (e4m3 products, <= 2^25, 2^-18 grid)
    relu = np.maximum(dots.astype(np.float32), np.float32(0.0))
    acc = np.zeros((T, k_codes.shape[0]), dtype=np.float32)
    for j in range(HI):
        acc = (acc + (w[:, j, None] * relu[:, j, :]).astype(np.float32)).astype(np.float32)
    return (np.asarray(k_scale, dtype=np.float32)[None, :] * acc).astype(np.float32)


def indexer_select(cfg: Config, ck: Checkpoint, p: str, x, qr, positions, freqs, audit=None):
    """DSA lightning indexer for one layer over a causal prefill. Returns a bool mask [T, T] of selected keys."""
    T = x.shape[0]
    HI, D, R = cfg.index_heads, cfg.index_dim, cfg.d_rope
    q_src = qr if qr is not None else x
    q = linear(q_src, ck.weight(p + "indexer.wq_b")).reshape(T, HI, D)
    k = layer_norm(linear(x, ck.weight(p + "indexer.wk")), ck.tensor(p + "indexer.k_norm.weight"),
                   ck.tensor(p + "indexer.k_norm.bias"), 1e-6)
    if cfg.use_rope:
        q = np.concatenate([rope_neox(q[..., :R].transpose(1, 0, 2), positions, freqs).transpose(1, 0, 2),
                            q[..., R:]], axis=-1)
        k = np.concatenate([rope_neox(k[:, :R], positions, freqs), k[:, R:]], axis=-1)
    q = hadamard_rotate(q)
    k = hadamard_rotate(k)
    q_codes, q_scale = quantize_fp8_ue8m0(q)  # [T, HI, D], [T, HI]
    k_codes, k_scale = quantize_fp8_ue8m0(k)  # [T, D], [T]

    gate = linear(x, ck.weight(p + "indexer.weights_proj"))  # [T, HI]
    scores = indexer_scores(q_codes, q_scale, k_codes, k_scale, gate)

    mask = np.zeros((T, T), dtype=bool)
    for t in range(T):
        k_eff = min(cfg.index_topk, t + 1)
        mask[t, topk_rank(scores[t, : t + 1], k_eff)] = True
    if audit is not None:
        audit_indexer(audit, cfg.index_topk, q, q_codes, q_scale, k, k_codes, k_scale, gate, scores)
    return mask


def mla_attention_mha(q_nope, q_pe, c, k_pe, w_kvb, allowed, scale):
    """Non-absorbed MLA attention. q_nope [T, H, dn], q_pe [T, H, dr], latents c [S, C], shared k_pe [S, dr],
    kv_b_proj weight [H * (dn + dv), C] with per-head rows [W_UK | W_UV], allowed [T, S] bool.
    Per head: k_s = [W_UK c_s ; k_pe_s], v_s = W_UV c_s, softmax over the allowed keys. Returns o [T, H, dv]."""
    H, dn = q_nope.shape[1], q_nope.shape[2]
    kvb = linear(c, w_kvb).reshape(c.shape[0], H, -1)
    k_nope, v = kvb[..., :dn], kvb[..., dn:]
    scores = (np.einsum("thd,shd->hts", q_nope, k_nope) + np.einsum("thd,sd->hts", q_pe, k_pe)) * scale
    scores = np.where(allowed[None], scores, -np.inf)
    scores -= scores.max(axis=-1, keepdims=True)
    prob = np.exp(scores)
    prob /= prob.sum(axis=-1, keepdims=True)
    return np.einsum("hts,shd->thd", prob, v)


def mla_layer(cfg: Config, ck: Checkpoint, p: str, x, positions, freqs, audit=None):
    """MLA in the non-absorbed form: per head k = [W_UK c ; k_pe], v = W_UV c, over all cached latents."""
    T = x.shape[0]
    H, dn, dr, dv, C = cfg.n_heads, cfg.d_nope, cfg.d_rope, cfg.d_v, cfg.kv_lora_rank
    if cfg.q_lora_rank:
        qr = rms_norm(linear(x, ck.weight(p + "q_a_proj")), ck.tensor(p + "q_a_layernorm.weight"), 1e-6)
        q = linear(qr, ck.weight(p + "q_b_proj"))
    else:
        qr = None
        q = linear(x, ck.weight(p + "q_proj"))
    q = q.reshape(T, H, dn + dr)
    q_nope, q_pe = q[..., :dn], q[..., dn:]
    kv = linear(x, ck.weight(p + "kv_a_proj_with_mqa"))
    c = rms_norm(kv[:, :C], ck.tensor(p + "kv_a_layernorm.weight"), 1e-6)
    k_pe = kv[:, C:]
    if cfg.use_rope:
        q_pe = rope_interleaved(q_pe.transpose(1, 0, 2), positions, freqs).transpose(1, 0, 2)
        k_pe = rope_interleaved(k_pe, positions, freqs)

    allowed = np.tril(np.ones((T, T), dtype=bool))
    if cfg.has_indexer:
        allowed &= indexer_select(cfg, ck, p, x, qr, positions, freqs, audit)
    o = mla_attention_mha(q_nope, q_pe, c, k_pe, ck.weight(p + "kv_b_proj"), allowed, cfg.softmax_scale)
    return linear(o.reshape(T, H * dv), ck.weight(p + "o_proj"))


def causal_depthwise_conv_silu(z, w):
    """z [T, C], w [C, 1, W]: u_t = SiLU(sum_i w[:, i] * z_{t-W+1+i}), zero history before the sequence."""
    w2 = w.reshape(w.shape[0], w.shape[-1])
    W = w2.shape[1]
    T = z.shape[0]
    padded = np.concatenate([np.zeros((W - 1, z.shape[1])), z], axis=0)
    out = np.zeros_like(z)
    for i in range(W):
        out += w2[:, i] * padded[i : i + T]
    return silu(out)


def l2_normalize(z, eps=1e-6):
    return z / np.sqrt(np.sum(z * z, axis=-1, keepdims=True) + eps)


def kda_recurrence(q, k, v, g, beta):
    """Gated delta rule, token by token, per head, state S [dk, dv] starting at zero:
    S = diag(exp(g_t)) S;  S += beta_t k_t (v_t - S^T k_t)^T;  o_t = S^T q_t.
    q, k, g [T, H, dk] (q already scaled), v [T, H, dv], beta [T, H]. Returns o [T, H, dv]."""
    T, H, dk = k.shape
    S = np.zeros((H, dk, v.shape[2]))
    o = np.empty(v.shape)
    for t in range(T):
        S *= np.exp(g[t])[:, :, None]
        pred = np.einsum("hkv,hk->hv", S, k[t])
        S += beta[t][:, None, None] * k[t][:, :, None] * (v[t] - pred)[:, None, :]
        o[t] = np.einsum("hkv,hk->hv", S, q[t])
    return o


def kda_layer(cfg: Config, ck: Checkpoint, p: str, x):
    """Kimi Delta Attention, token-by-token recurrence with state S [H, dk, dv] starting at zero."""
    T = x.shape[0]
    H, dk = cfg.kda_heads, cfg.kda_head_dim
    dv = dk
    q = causal_depthwise_conv_silu(linear(x, ck.weight(p + "q_proj")), ck.tensor(p + "q_conv1d.weight"))
    k = causal_depthwise_conv_silu(linear(x, ck.weight(p + "k_proj")), ck.tensor(p + "k_conv1d.weight"))
    v = causal_depthwise_conv_silu(linear(x, ck.weight(p + "v_proj")), ck.tensor(p + "v_conv1d.weight"))
    q = l2_normalize(q.reshape(T, H, dk)) * dk**-0.5
    k = l2_normalize(k.reshape(T, H, dk))
    v = v.reshape(T, H, dv)

    f = linear(linear(x, ck.weight(p + "f_a_proj")), ck.weight(p + "f_b_proj"))
    f = (f + ck.tensor(p + "dt_bias").reshape(-1)).reshape(T, H, dk)
    a = np.exp(ck.tensor(p + "A_log").reshape(-1))[None, :, None]  # [1, H, 1]
    if cfg.kda_gate_lower_bound is not None:
        g = cfg.kda_gate_lower_bound * sigmoid(a * f)
    else:
        g = -a * softplus(f)
    beta = sigmoid(linear(x, ck.weight(p + "b_proj")))  # [T, H]

    o = kda_recurrence(q, k, v, g, beta)

    r = linear(linear(x, ck.weight(p + "g_a_proj")), ck.weight(p + "g_b_proj")).reshape(T, H, dv)
    y = rms_norm(o, ck.tensor(p + "o_norm.weight"), cfg.eps) * sigmoid(r)
    return linear(y.reshape(T, H * dv), ck.weight(p + "o_proj"))


def swiglu(ck: Checkpoint, gate: str, up: str, down: str, x):
    return linear(silu(linear(x, ck.weight(gate))) * linear(x, ck.weight(up)), ck.weight(down))


def route(cfg: Config, logits, bias, audit=None):
    """Sigmoid router: selection by s + bias (grouped when n_group > 1), weights from the unbiased s.
    Returns (expert ids [T, k], weights [T, k])."""
    T, E = logits.shape
    s = sigmoid(logits)
    b = s + bias if bias is not None else s.copy()
    ids = np.empty((T, cfg.top_k), dtype=np.int64)
    wts = np.empty((T, cfg.top_k))
    for t in range(T):
        sel_scores = b[t].copy()
        if cfg.n_group > 1:
            groups = sel_scores.reshape(cfg.n_group, E // cfg.n_group)
            group_score = np.sort(groups, axis=1)[:, -2:].sum(axis=1)
            keep = topk_rank(group_score, cfg.topk_group)
            if audit is not None:
                audit_ranking(audit, "moe-group", t, group_score, cfg.topk_group)
            dropped = np.ones(cfg.n_group, dtype=bool)
            dropped[keep] = False
            groups = np.where(dropped[:, None], -np.inf, groups)
            sel_scores = groups.reshape(E)
        chosen = topk_rank(sel_scores, cfg.top_k)
        if audit is not None:
            audit_ranking(audit, "moe-expert", t, sel_scores, cfg.top_k)
        w = s[t, chosen]
        if cfg.renormalize:
            w = w / w.sum()
        ids[t] = chosen
        wts[t] = w * cfg.routed_scale
    return ids, wts


def moe_layer(cfg: Config, ck: Checkpoint, p: str, x, audit=None):
    logits = linear(x, ck.weight(p + "gate"))
    bias_name = p + "gate.e_score_correction_bias"
    bias = ck.tensor(bias_name) if ck.has(bias_name) else None
    ids, wts = route(cfg, logits, bias, audit)
    out = np.zeros_like(x)
    names = ("w1", "w3", "w2") if cfg.is_kimi else ("gate_proj", "up_proj", "down_proj")
    for e in np.unique(ids):
        rows, slot = np.nonzero(ids == e)
        ep = f"{p}experts.{e}."
        y = swiglu(ck, ep + names[0], ep + names[1], ep + names[2], x[rows])
        out[rows] += wts[rows, slot][:, None] * y
    if cfg.n_shared:
        sp = p + "shared_experts."
        out += swiglu(ck, sp + "gate_proj", sp + "up_proj", sp + "down_proj", x)
    return out


# ----------------------------------------------------------------------------------------------------------------
# Model
# ----------------------------------------------------------------------------------------------------------------


class Model:
    def __init__(self, ckpt_dir: str):
        with open(os.path.join(ckpt_dir, "config.json")) as f:
            self.cfg = Config(json.load(f))
        self.ck = Checkpoint(ckpt_dir)
        self.freqs = rope_frequencies(self.cfg) if self.cfg.use_rope else None

    def forward(self, token_ids, audit: Audit | None = None) -> np.ndarray:
        """Logits [len(token_ids), vocab] of a causal prefill. With an Audit, records the decisions that fp32
        rounding could flip (see Audit)."""
        cfg, ck = self.cfg, self.ck
        ids = np.asarray(token_ids, dtype=np.int64)
        if ids.ndim != 1 or ids.size == 0 or ids.min() < 0 or ids.max() >= cfg.vocab:
            raise ValueError("token ids must be a non-empty 1-D sequence below vocab_size")
        positions = np.arange(ids.size, dtype=np.float64)
        h = ck.tensor("model.embed_tokens.weight")[ids]
        for i in range(cfg.n_layers):
            p = f"model.layers.{i}."
            if audit is not None:
                audit.layer = i
            x = rms_norm(h, ck.tensor(p + "input_layernorm.weight"), cfg.eps)
            if cfg.layer_kinds[i] == "kda":
                h = h + kda_layer(cfg, ck, p + "self_attn.", x)
            else:
                h = h + mla_layer(cfg, ck, p + "self_attn.", x, positions, self.freqs, audit)
            x = rms_norm(h, ck.tensor(p + "post_attention_layernorm.weight"), cfg.eps)
            if cfg.is_moe_layer(i):
                h = h + moe_layer(cfg, ck, p + ("block_sparse_moe." if cfg.is_kimi else "mlp."), x, audit)
            else:
                h = h + swiglu(ck, p + "mlp.gate_proj", p + "mlp.up_proj", p + "mlp.down_proj", x)
        h = rms_norm(h, ck.tensor("model.norm.weight"), cfg.eps)
        if ck.has("lm_head.weight"):
            head = ck.weight("lm_head")
        elif cfg.tie_embeddings:
            head = ck.tensor("model.embed_tokens.weight")
        else:
            raise KeyError("lm_head.weight missing and tie_word_embeddings is false")
        return linear(h, head)


def load_model(ckpt_dir: str) -> Model:
    return Model(ckpt_dir)


def forward(ckpt_dir: str, token_ids) -> np.ndarray:
    """Logits [len(token_ids), vocab] for every position of a full causal prefill of token_ids."""
    return Model(ckpt_dir).forward(token_ids)
