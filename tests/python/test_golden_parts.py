"""Unit tests of the golden model's own pieces: number formats, safetensors reading, RoPE/YaRN, Hadamard,
indexer scores and top-k tie rule, MoE routing, the KDA recurrence and the MLA attention form."""

import json
import math
import types

import numpy as np
import pytest

import golden_numpy as g


# ---------------------------------------------------------------- e4m3


def test_e4m3_known_codes():
    t = g.E4M3_TABLE
    assert t[0x00] == 0.0 and not np.signbit(t[0x00])
    assert t[0x80] == 0.0 and np.signbit(t[0x80])
    assert t[0x01] == 2.0**-9  # smallest subnormal
    assert t[0x07] == 7 * 2.0**-9  # largest subnormal
    assert t[0x08] == 2.0**-6  # smallest normal
    assert t[0x38] == 1.0
    assert t[0x39] == 1.125
    assert t[0x7E] == 448.0 and t[0xFE] == -448.0
    assert np.isnan(t[0x7F]) and np.isnan(t[0xFF])
    assert np.sum(np.isnan(t)) == 2


def test_e4m3_table_is_monotone_with_expected_spacing():
    pos = g.E4M3_TABLE[:0x7F]
    gaps = np.diff(pos)
    assert np.all(gaps > 0)
    # Exponent field E >= 1 spaces its binade by 2^(E-7-3); subnormals (E = 0) step by 2^-9.
    for code in range(1, 0x7F):
        if code & 7:  # inside a binade (a binade's first code steps by the previous binade's spacing)
            assert gaps[code - 1] == 2.0 ** (max(code >> 3, 1) - 10)
    np.testing.assert_array_equal(g.E4M3_TABLE[0x80:0xFF], -pos)


def test_e4m3_round_fixed_points_and_ties():
    finite = g.E4M3_TABLE[np.isfinite(g.E4M3_TABLE)]
    np.testing.assert_array_equal(g.e4m3_round(finite), finite)
    pos = g.E4M3_TABLE[:0x7F]
    for code in range(0x7E):
        lo, hi = pos[code], pos[code + 1]
        mid = (lo + hi) / 2
        even = lo if code % 2 == 0 else hi  # ties go to the even code
        assert g.e4m3_round(np.array([mid]))[0] == even, (code, mid)
        assert g.e4m3_round(np.array([-mid]))[0] == -even
        assert g.e4m3_round(np.array([np.nextafter(mid, hi)]))[0] == hi
        assert g.e4m3_round(np.array([np.nextafter(mid, lo)]))[0] == lo


def test_e4m3_round_saturates_and_underflows():
    r = g.e4m3_round(np.array([448.0, 463.9, 464.0, 1e6, -1e6, 2.0**-10, np.nextafter(2.0**-10, 1), 1e-12, -0.0]))
    assert list(r[:5]) == [448.0, 448.0, 448.0, 448.0, -448.0]
    assert r[5] == 0.0  # half of the smallest subnormal ties to even (zero)
    assert r[6] == 2.0**-9
    assert r[7] == 0.0
    assert r[8] == 0.0 and np.signbit(r[8])


# ---------------------------------------------------------------- other formats


def test_e2m1_bf16_decode():
    np.testing.assert_array_equal(g.e2m1_decode(np.arange(16)),
                                  [0, 0.5, 1, 1.5, 2, 3, 4, 6, -0.0, -0.5, -1, -1.5, -2, -3, -4, -6])
    bits = np.array([0x3F80, 0xC000, 0x0000, 0x8000, 0x7F80, 0x3F81], dtype=np.uint16)
    vals = g.bf16_decode(bits)
    assert list(vals[:5]) == [1.0, -2.0, 0.0, 0.0, np.inf]
    assert np.signbit(vals[3])
    assert vals[5] == 1.0 + 2.0**-7


def test_round_up_pow2():
    s = np.array([1.0, np.nextafter(np.float32(1), np.float32(2)), 0.75, 3.0, 2.0**-149, 1.5e-40, 0.5, 1e-4 / 448],
                 dtype=np.float32)
    out = g.round_up_pow2_f32(s)
    assert out.dtype == np.float32
    expected = [1.0, 2.0, 1.0, 4.0, 2.0**-149, 2.0**-132, 0.5, 2.0**-22]
    np.testing.assert_array_equal(out, np.array(expected, dtype=np.float32))


def test_quantize_fp8_ue8m0_hand_cases():
    x = np.zeros(128)
    x[0], x[1], x[2] = 1.0, -0.5, 0.3
    codes, s = g.quantize_fp8_ue8m0(x)
    # amax 1 -> 1 * fp32(1/448) = 0.00223 -> 2^-8
    assert s == np.float32(2.0**-8)
    assert codes[0] == 256.0 and codes[1] == -128.0
    assert codes[2] == 80.0  # 0.3 * 256 = 76.8 (fp32 0.3 -> 76.80000305); binade [64,128) steps 8 -> 80
    zeros_codes, zs = g.quantize_fp8_ue8m0(np.zeros((3, 128)))
    assert zs.shape == (3,) and np.all(zs == np.float32(2.0**-22))  # amax floor 1e-4
    assert np.all(zeros_codes == 0)
    # amax exactly 448 * 2^k: the fp32 product 448 * fp32(1/448) decides the power of two
    y = np.full(128, 448.0)
    c448, s448 = g.quantize_fp8_ue8m0(y)
    prod = np.float32(448.0) * (np.float32(1) / np.float32(448))
    assert s448 == (np.float32(1.0) if prod <= 1 else np.float32(2.0))
    assert np.all(np.abs(c448) <= 448)


# ---------------------------------------------------------------- Hadamard


@pytest.mark.parametrize("n", [1, 2, 4, 8, 64, 128])
def test_hadamard_orthogonal(n):
    h = g.hadamard_matrix(n)
    np.testing.assert_array_equal(h @ h.T, n * np.eye(n))
    assert np.all(h[0] == 1) and np.all(h[:, 0] == 1)
    i, j = np.meshgrid(np.arange(n), np.arange(n), indexing="ij")
    popcount = np.vectorize(lambda v: bin(v).count("1"))(i & j)
    np.testing.assert_array_equal(h, (-1.0) ** popcount)
    rng = np.random.default_rng(n)
    a, b = rng.standard_normal(n), rng.standard_normal(n)
    assert abs(g.hadamard_rotate(a) @ g.hadamard_rotate(b) - a @ b) < 1e-12 * n


# ---------------------------------------------------------------- safetensors


def _write_safetensors(path, tensors):
    header, blobs, off = {}, [], 0
    for name, (dtype, arr) in tensors.items():
        data = np.ascontiguousarray(arr).tobytes()
        header[name] = {"dtype": dtype, "shape": list(arr.shape), "data_offsets": [off, off + len(data)]}
        blobs.append(data)
        off += len(data)
    h = json.dumps(header).encode()
    h += b" " * (-len(h) % 8)
    with open(path, "wb") as f:
        f.write(len(h).to_bytes(8, "little") + h + b"".join(blobs))


def test_checkpoint_reader_formats(tmp_path):
    rng = np.random.default_rng(0)
    f32 = rng.standard_normal((3, 4)).astype(np.float32)
    bf16_bits = np.array([[0x3F80, 0xBF00]], dtype=np.uint16)  # 1.0, -0.5
    # FP8 weight 130 x 200 -> scale blocks [2, 2]
    codes = rng.integers(0, 256, size=(130, 200), dtype=np.uint8)
    codes[(codes & 0x7F) == 0x7F] = 0x38  # no NaN codes
    scale = np.array([[0.5, 3.0], [0.1, 2.0**-7]], dtype=np.float32)
    # MXFP4 weight [2, 64]: scales [2, 2]
    packed = rng.integers(0, 256, size=(2, 32), dtype=np.uint8)
    mx_scale = np.array([[127, 130], [120, 127]], dtype=np.uint8)
    _write_safetensors(tmp_path / "model-00001-of-00002.safetensors",
                       {"a.weight": ("F32", f32), "b.weight": ("BF16", bf16_bits)})
    _write_safetensors(tmp_path / "model-00002-of-00002.safetensors",
                       {"c.weight": ("F8_E4M3", codes), "c.weight_scale_inv": ("F32", scale),
                        "d.weight_packed": ("U8", packed), "d.weight_scale": ("U8", mx_scale)})
    index = {"weight_map": {"a.weight": "model-00001-of-00002.safetensors",
                            "b.weight": "model-00001-of-00002.safetensors",
                            "c.weight": "model-00002-of-00002.safetensors",
                            "c.weight_scale_inv": "model-00002-of-00002.safetensors",
                            "d.weight_packed": "model-00002-of-00002.safetensors",
                            "d.weight_scale": "model-00002-of-00002.safetensors"}}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    ck = g.Checkpoint(str(tmp_path))
    np.testing.assert_array_equal(ck.weight("a"), f32.astype(np.float64))
    np.testing.assert_array_equal(ck.weight("b"), [[1.0, -0.5]])
    c = ck.weight("c")
    assert c.shape == (130, 200)
    for (r, col) in [(0, 0), (5, 127), (5, 128), (129, 199), (128, 3)]:
        expect = np.float32(g.E4M3_TABLE[codes[r, col]]) * scale[r // 128, col // 128]
        assert c[r, col] == expect
    d = ck.weight("d")
    assert d.shape == (2, 64)
    for r in range(2):
        for col in range(64):
            byte = packed[r, col // 2]
            code = byte & 0xF if col % 2 == 0 else byte >> 4
            assert d[r, col] == g.e2m1_decode(np.array([code]))[0] * 2.0 ** (int(mx_scale[r, col // 32]) - 127)


# ---------------------------------------------------------------- RoPE / YaRN, softmax scale


def _v32_cfg():
    cfg = {"model_type": "deepseek_v32", "hidden_size": 7168, "num_hidden_layers": 1, "vocab_size": 10,
           "rms_norm_eps": 1e-6, "num_attention_heads": 128, "q_lora_rank": 1536, "kv_lora_rank": 512,
           "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128, "rope_theta": 10000,
           "rope_scaling": {"type": "yarn", "factor": 40, "original_max_position_embeddings": 4096,
                            "beta_fast": 32, "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0},
           "index_n_heads": 64, "index_head_dim": 128, "index_topk": 2048, "n_routed_experts": 256,
           "num_experts_per_tok": 8, "n_group": 8, "topk_group": 4, "routed_scaling_factor": 2.5}
    return g.Config(cfg)


def test_yarn_table_matches_spec_numbers():
    cfg = _v32_cfg()
    f = g.rope_frequencies(cfg)
    plain = 10000.0 ** (-np.arange(32) * 2 / 64)
    for i in range(32):
        r = min(max((i - 10) / 13, 0.0), 1.0)  # correction range [10, 23] derived in dsa_mla.md 1.4
        assert f[i] == pytest.approx(plain[i] * ((1 - r) + r / 40), rel=1e-14)
    assert cfg.softmax_scale == pytest.approx(0.1352338, abs=5e-8)


def test_rope_layouts():
    freqs = np.array([0.5, 0.25])
    pos = np.array([0.0, 3.0])
    x = np.array([[1.0, 2.0, 3.0, 4.0]] * 2)
    inter = g.rope_interleaved(x, pos, freqs)
    neox = g.rope_neox(x, pos, freqs)
    np.testing.assert_array_equal(inter[0], x[0])
    np.testing.assert_array_equal(neox[0], x[0])
    a0, a1 = 3 * 0.5, 3 * 0.25
    np.testing.assert_allclose(inter[1], [math.cos(a0) - 2 * math.sin(a0), math.sin(a0) + 2 * math.cos(a0),
                                          3 * math.cos(a1) - 4 * math.sin(a1), 3 * math.sin(a1) + 4 * math.cos(a1)])
    np.testing.assert_allclose(neox[1], [math.cos(a0) - 3 * math.sin(a0), 2 * math.cos(a1) - 4 * math.sin(a1),
                                         math.sin(a0) + 3 * math.cos(a0), 2 * math.sin(a1) + 4 * math.cos(a1)])


# ---------------------------------------------------------------- indexer scores and top-k


def test_topk_tie_rule():
    s = np.array([0.0, 1.0, -0.0, 0.0, 1.0, -2.0], dtype=np.float32)
    assert list(g.topk_rank(s, 4)) == [1, 4, 0, 2]
    assert list(g.topk_rank(s, 6)) == [1, 4, 0, 2, 3, 5]


def test_indexer_scores_match_formula_and_zero_rows():
    rng = np.random.default_rng(3)
    T, H, D = 5, 4, 128
    q_codes, q_scale = g.quantize_fp8_ue8m0(rng.standard_normal((T, H, D)))
    k_codes, k_scale = g.quantize_fp8_ue8m0(rng.standard_normal((T, D)) * 3)
    gate = rng.standard_normal((T, H))
    got = g.indexer_scores(q_codes, q_scale, k_codes, k_scale, gate)
    assert got.dtype == np.float32
    dots = np.einsum("tjd,sd->tjs", q_codes * q_scale[..., None], k_codes * k_scale[:, None])
    ref = np.einsum("tj,tjs->ts", gate, np.maximum(dots, 0)) / math.sqrt(H) / math.sqrt(D)
    np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-6 * np.abs(ref).max())
    # A key whose dot with every head is <= 0 scores exactly +-0.
    k_neg = -np.abs(k_codes[:1])
    q_pos = np.abs(q_codes)
    z = g.indexer_scores(q_pos, q_scale, k_neg, k_scale[:1], gate)
    assert np.all(z == 0)


# ---------------------------------------------------------------- MoE routing


def _router_cfg(**kw):
    base = dict(top_k=2, n_group=1, topk_group=1, renormalize=True, routed_scale=2.5)
    base.update(kw)
    return types.SimpleNamespace(**base)


def test_route_bias_selects_only():
    logits = np.array([[2.0, 1.0, 0.0, -1.0]])
    bias = np.array([0.0, 0.0, 0.0, 1.0])  # lifts expert 3 into the selection
    ids, w = g.route(_router_cfg(), logits, bias)
    assert list(ids[0]) == [3, 0]
    s = 1 / (1 + np.exp(-logits[0]))
    np.testing.assert_allclose(w[0], np.array([s[3], s[0]]) / (s[3] + s[0]) * 2.5, rtol=1e-15)


def test_route_grouped_top2_sum_and_ties():
    # 4 groups of 2. Group scores (top-2 sums of s): g0 = s0+s1, ... Keep 2 groups.
    logits = np.array([[3.0, -5.0, 1.0, 1.0, 2.5, 2.5, -9.0, 4.0]])
    ids, _ = g.route(_router_cfg(n_group=4, topk_group=2, top_k=3), logits, None)
    # group sums: g0 ~ 0.959, g1 ~ 1.462, g2 ~ 1.848, g3 ~ 0.982 -> keep g2, g1; best 3 experts there: 4, 5, 2
    assert list(ids[0]) == [4, 5, 2]
    # exact ties between experts resolve to the lower id
    ids, _ = g.route(_router_cfg(top_k=2), np.zeros((1, 4)), None)
    assert list(ids[0]) == [0, 1]


# ---------------------------------------------------------------- KDA recurrence and conv


def test_kda_recurrence_no_decay_orthonormal_keys_is_linear_attention():
    rng = np.random.default_rng(5)
    T, H, d = 4, 2, 8
    basis = np.linalg.qr(rng.standard_normal((d, d)))[0]
    k = np.stack([basis[:, :T].T] * H, axis=1)  # [T, H, d], orthonormal over t
    q = rng.standard_normal((T, H, d))
    v = rng.standard_normal((T, H, d))
    o = g.kda_recurrence(q, k, v, np.zeros((T, H, d)), np.ones((T, H)))
    for t in range(T):
        expect = np.einsum("hk,shk,shv->hv", q[t], k[: t + 1], v[: t + 1])
        np.testing.assert_allclose(o[t], expect, atol=1e-12)


def test_kda_recurrence_decay_then_delta_overwrite():
    # Same key twice: decay applies before the read, beta scales the correction.
    k = np.array([[[1.0, 0.0]], [[1.0, 0.0]]])
    v = np.array([[[2.0, -1.0]], [[4.0, 3.0]]])
    gate = np.log(np.array([[[1.0, 1.0]], [[0.5, 1.0]]]))
    beta = np.array([[1.0], [0.5]])
    q = np.array([[[1.0, 0.0]], [[1.0, 1.0]]])
    o = g.kda_recurrence(q, k, v, gate, beta)
    np.testing.assert_allclose(o[0, 0], [2.0, -1.0])
    s_row0 = 0.5 * np.array([2.0, -1.0])  # decayed
    s_row0 = s_row0 + 0.5 * (np.array([4.0, 3.0]) - s_row0)
    np.testing.assert_allclose(o[1, 0], s_row0, atol=1e-15)


def test_causal_conv_taps():
    z = np.array([[1.0], [2.0], [3.0]])
    w = np.array([[[10.0, 100.0, 1.0]]])  # last tap on the current token
    pre = np.array([1.0, 2 + 100, 3 + 200 + 10])
    np.testing.assert_allclose(g.causal_depthwise_conv_silu(z, w)[:, 0], pre / (1 + np.exp(-pre)))


# ---------------------------------------------------------------- MLA: non-absorbed equals absorbed


def test_mla_mha_form_equals_absorbed_form():
    rng = np.random.default_rng(7)
    T, H, dn, dr, dv, C = 6, 3, 8, 4, 5, 16
    q_nope, q_pe = rng.standard_normal((T, H, dn)), rng.standard_normal((T, H, dr))
    c, k_pe = rng.standard_normal((T, C)), rng.standard_normal((T, dr))
    w_kvb = rng.standard_normal((H * (dn + dv), C)) / 4
    allowed = np.tril(np.ones((T, T), dtype=bool))
    allowed[5, 2] = False  # a sparse row
    scale = 0.3
    o = g.mla_attention_mha(q_nope, q_pe, c, k_pe, w_kvb, allowed, scale)
    w = w_kvb.reshape(H, dn + dv, C)
    w_uk, w_uv = w[:, :dn], w[:, dn:]
    for t in range(T):
        for h in range(H):
            q_abs = w_uk[h].T @ q_nope[t, h]  # [C]
            sc = (c @ q_abs + k_pe @ q_pe[t, h]) * scale
            sc = np.where(allowed[t], sc, -np.inf)
            p = np.exp(sc - sc.max())
            p /= p.sum()
            np.testing.assert_allclose(o[t, h], w_uv[h] @ (p @ c), rtol=1e-12, atol=1e-12)


# ---------------------------------------------------------------- whole forward pass on synthetic checkpoints


def _synthetic_checkpoint(path, arch, rng):
    """A small random checkpoint of each architecture, mixing F32, BF16, FP8 (block-scaled) and MXFP4 weights."""
    D, H, dn, dr, dv, C, V = 64, 2, 16, 8, 16, 32, 50
    cfg = {"model_type": arch, "hidden_size": D, "vocab_size": V, "rms_norm_eps": 1e-5,
           "num_attention_heads": H, "kv_lora_rank": C, "qk_nope_head_dim": dn, "qk_rope_head_dim": dr,
           "v_head_dim": dv, "intermediate_size": 48, "moe_intermediate_size": 24, "first_k_dense_replace": 1,
           "moe_layer_freq": 1, "routed_scaling_factor": 2.0, "tie_word_embeddings": False}
    if arch == "deepseek_v32":
        cfg.update({"num_hidden_layers": 3, "q_lora_rank": 24, "rope_theta": 10000.0,
                    "rope_scaling": {"type": "yarn", "factor": 4, "original_max_position_embeddings": 16,
                                     "beta_fast": 32, "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0},
                    "n_routed_experts": 8, "num_experts_per_tok": 2, "n_shared_experts": 1, "n_group": 4,
                    "topk_group": 2, "norm_topk_prob": True, "scoring_func": "sigmoid"})
        kinds = ["mla"] * 3
    else:
        cfg.update({"num_hidden_layers": 4, "q_lora_rank": None,
                    "linear_attn_config": {"kda_layers": [1, 2, 4], "full_attn_layers": [3], "num_heads": 2,
                                           "head_dim": 16, "short_conv_kernel_size": 4},
                    "num_experts": 8, "num_experts_per_token": 2, "num_shared_experts": 1, "num_expert_group": 1,
                    "topk_group": 1, "moe_renormalize": True, "moe_router_activation_func": "sigmoid"})
        kinds = ["kda", "kda", "mla", "kda"]
        if arch == "kimi_k3":
            cfg["kda_gate_lower_bound"] = -5.0
    if arch != "kimi_linear":
        cfg.update({"index_n_heads": 4, "index_head_dim": 32, "index_topk": 4})
    tensors = {}

    def dense(name, out_dim, in_dim, kind="f32"):
        w = rng.standard_normal((out_dim, in_dim)) / np.sqrt(in_dim)
        if kind == "bf16":
            bits = (w.astype(np.float32).view(np.uint32) >> 16).astype(np.uint16)
            tensors[name + ".weight"] = ("BF16", bits)
        elif kind == "fp8":
            codes = np.empty(w.shape, dtype=np.uint8)
            scale = np.full((-(-out_dim // 128), -(-in_dim // 128)), 0.01, dtype=np.float32)
            q = g.e4m3_round(w / 0.01)
            lookup = {v: c for c, v in enumerate(g.E4M3_TABLE) if np.isfinite(v) and not (v == 0 and c)}
            codes[...] = np.vectorize(lambda v: lookup[v])(q)
            tensors[name + ".weight"] = ("F8_E4M3", codes)
            tensors[name + ".weight_scale_inv"] = ("F32", scale)
        elif kind == "mxfp4":
            packed = rng.integers(0, 256, size=(out_dim, in_dim // 2), dtype=np.uint8)
            tensors[name + ".weight_packed"] = ("U8", packed)
            tensors[name + ".weight_scale"] = ("U8", np.full((out_dim, in_dim // 32), 124, dtype=np.uint8))
        else:
            tensors[name + ".weight"] = ("F32", w.astype(np.float32))

    def vec(name, n, base=1.0, spread=0.1):
        tensors[name] = ("F32", (base + spread * rng.standard_normal(n)).astype(np.float32))

    dense("model.embed_tokens", V, D, "bf16")
    dense("lm_head", V, D)
    vec("model.norm.weight", D)
    for i, kind in enumerate(kinds):
        p = f"model.layers.{i}."
        vec(p + "input_layernorm.weight", D)
        vec(p + "post_attention_layernorm.weight", D)
        a = p + "self_attn."
        if kind == "kda":
            P = 2 * 16
            for n in ("q", "k", "v"):
                dense(a + n + "_proj", P, D, "fp8")
                tensors[a + n + "_conv1d.weight"] = ("F32", (0.5 * rng.standard_normal((P, 1, 4))).astype(np.float32))
            dense(a + "f_a_proj", 8, D)
            dense(a + "f_b_proj", P, 8)
            vec(a + "dt_bias", P, 0.0, 1.0)
            tensors[a + "A_log"] = ("F32", rng.standard_normal((1, 1, 2, 1)).astype(np.float32))
            dense(a + "b_proj", 2, D)
            dense(a + "g_a_proj", 8, D)
            dense(a + "g_b_proj", P, 8)
            vec(a + "o_norm.weight", 16)
            dense(a + "o_proj", D, P)
        else:
            if cfg["q_lora_rank"]:
                dense(a + "q_a_proj", 24, D, "fp8")
                vec(a + "q_a_layernorm.weight", 24)
                dense(a + "q_b_proj", H * (dn + dr), 24)
            else:
                dense(a + "q_proj", H * (dn + dr), D)
            dense(a + "kv_a_proj_with_mqa", C + dr, D)
            vec(a + "kv_a_layernorm.weight", C)
            dense(a + "kv_b_proj", H * (dn + dv), C, "fp8")
            dense(a + "o_proj", D, H * dv)
            if "index_topk" in cfg:
                dense(a + "indexer.wq_b", 4 * 32, 24 if cfg["q_lora_rank"] else D)
                dense(a + "indexer.wk", 32, D)
                vec(a + "indexer.k_norm.weight", 32)
                vec(a + "indexer.k_norm.bias", 32, 0.0)
                dense(a + "indexer.weights_proj", 4, D, "bf16")
        if i == 0:
            dense(p + "mlp.gate_proj", 48, D)
            dense(p + "mlp.up_proj", 48, D)
            dense(p + "mlp.down_proj", D, 48)
        else:
            m = p + ("mlp." if arch == "deepseek_v32" else "block_sparse_moe.")
            dense(m + "gate", 8, D)
            vec(m + "gate.e_score_correction_bias", 8, 0.0, 0.05)
            names = ("gate_proj", "up_proj", "down_proj") if arch == "deepseek_v32" else ("w1", "w3", "w2")
            fmt = "mxfp4" if arch == "kimi_k3" else "f32"
            for e in range(8):
                dense(f"{m}experts.{e}.{names[0]}", 32, D, fmt)
                dense(f"{m}experts.{e}.{names[1]}", 32, D, fmt)
                dense(f"{m}experts.{e}.{names[2]}", D, 32, fmt)
            dense(m + "shared_experts.gate_proj", 24, D)
            dense(m + "shared_experts.up_proj", 24, D)
            dense(m + "shared_experts.down_proj", D, 24)
    path.mkdir()
    (path / "config.json").write_text(json.dumps(cfg))
    _write_safetensors(path / "model.safetensors", tensors)
    return cfg


@pytest.mark.parametrize("arch", ["kimi_k3", "kimi_linear", "deepseek_v32"])
def test_forward_is_causal_and_finite(tmp_path, arch):
    rng = np.random.default_rng(11)
    cfg = _synthetic_checkpoint(tmp_path / arch, arch, rng)
    model = g.load_model(str(tmp_path / arch))
    ids = rng.integers(0, cfg["vocab_size"], size=20)
    full = model.forward(ids)
    assert full.shape == (20, cfg["vocab_size"]) and np.all(np.isfinite(full))
    # Each position depends only on its prefix (the indexer's top-k included); appending tokens changes nothing.
    for n in (1, 5, 13):
        np.testing.assert_allclose(model.forward(ids[:n]), full[:n], rtol=1e-12, atol=1e-12)
    # ...and a changed earlier token does change later positions.
    other = ids.copy()
    other[2] = (other[2] + 1) % cfg["vocab_size"]
    assert np.max(np.abs(model.forward(other)[3:] - full[3:])) > 1e-6


# ---------------------------------------------------------------- conditioning audit


def test_fp8_code_range_near_a_midpoint():
    x = np.zeros(32)
    x[0] = 448.0 * 2.0**-8  # amax 1.75 -> 1.75 * fp32(1/448) = 2^-8 exactly -> a block scale at a power of two
    x[1] = 136.0 * 2.0**-8 + 1e-7  # just above the midpoint of the codes 128 and 144
    x[2] = 98.0 * 2.0**-8  # between the codes 96 and 104, 2 away from their midpoint 100
    codes, scale = g.quantize_fp8_ue8m0(x)
    lo, hi, scale_fragile = g.fp8_code_range(x, scale, 1e-5)
    assert codes[1] == 144.0 and lo[1] == 128.0 and hi[1] == 144.0
    assert lo[2] == hi[2] == codes[2] == 96.0
    lo0, hi0, _ = g.fp8_code_range(x, scale, 0.0)
    np.testing.assert_array_equal(lo0, codes)
    np.testing.assert_array_equal(hi0, codes)
    assert scale_fragile  # amax / 448 sits exactly on a power of two


def test_audit_ranking_threshold():
    audit = g.Audit(1e-3)
    audit_vals = np.array([1.0, 0.9995, 0.5])
    g.audit_ranking(audit, "moe-expert", 3, audit_vals, 1)
    g.audit_ranking(audit, "moe-expert", 4, audit_vals, 2)
    assert [e[2] for e in audit.events] == [3]


@pytest.mark.parametrize("arch", ["kimi_k3", "deepseek_v32"])
def test_audit_flags_only_with_a_margin(tmp_path, arch):
    rng = np.random.default_rng(12)
    cfg = _synthetic_checkpoint(tmp_path / arch, arch, rng)
    model = g.load_model(str(tmp_path / arch))
    ids = rng.integers(0, cfg["vocab_size"], size=24)
    plain = model.forward(ids)
    exact = g.Audit(0.0)
    np.testing.assert_array_equal(model.forward(ids, exact), plain)  # auditing does not change the result
    assert exact.events == []
    loose = g.Audit(0.01)
    model.forward(ids, loose)
    kinds = {e[1] for e in loose.events}
    assert kinds & {"indexer-q-code", "indexer-k-code", "indexer-topk"}
    assert all(e[2] >= cfg["index_topk"] for e in loose.events if e[1].startswith("indexer-") and "scale" not in e[1])
