"""The torch-reference ops (norms, rope, conv, moe) against straightforward formulas in fp64, and
their batch invariance: a row's bits never depend on the other rows of the call."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tensorfold.family.rope_config import RopeRefused, rope_parameters
from tensorfold.ops import conv, moe, rope
from tensorfold.ops.norms import rms_norm


def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def close(a: torch.Tensor, b: torch.Tensor, tol: float) -> bool:
    return bool(((a.double() - b.double()).abs().max() / b.double().abs().max()) < tol)


# --- rms_norm ---


@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-6), (torch.bfloat16, 1e-2)])
def test_rms_norm_matches_formula(dtype: torch.dtype, tol: float) -> None:
    x = torch.randn(37, 3, 64, generator=gen(0)).to(dtype)
    w = (1 + 0.1 * torch.randn(64, generator=gen(1))).to(dtype)
    xd = x.double()
    want = w.double() * xd / torch.sqrt(xd.pow(2).mean(-1, keepdim=True) + 1e-5)
    got = rms_norm(x, w, 1e-5)
    assert got.dtype == dtype and got.shape == x.shape
    assert close(got, want, tol)


def test_rms_norm_rounds_before_the_weight() -> None:
    """bf16: weight · bf16(normalised fp32), as the reference (not bf16(weight · normalised))."""
    x = torch.randn(16, 64, generator=gen(2)).to(torch.bfloat16)
    w = (1 + 0.1 * torch.randn(64, generator=gen(3))).to(torch.bfloat16)
    xf = x.float()
    normed = (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-5)).to(torch.bfloat16)
    assert torch.equal(rms_norm(x, w, 1e-5), w * normed)


def test_rms_norm_with_an_fp32_weight_rounds_once() -> None:
    """fp32_weight: bf16(w_fp32 · normalised fp32), Olmo2RMSNorm's order, bit for bit."""
    x = torch.randn(16, 72, generator=gen(2)).to(torch.bfloat16)
    w = (1 + 0.1 * torch.randn(72, generator=gen(3))).to(torch.bfloat16)
    got = rms_norm(x, w, 1e-5, fp32_weight=True)
    assert got.dtype == torch.bfloat16
    assert torch.equal(got, rms_norm(x.float(), w.float(), 1e-5).to(torch.bfloat16))
    assert not torch.equal(got, rms_norm(x, w, 1e-5))  # not w · bf16(normalised)
    olmo2 = pytest.importorskip("transformers.models.olmo2.modeling_olmo2")
    ref = olmo2.Olmo2RMSNorm(72, eps=1e-5).to(torch.bfloat16)
    ref.weight.data.copy_(w)
    assert torch.equal(got, ref(x))


def test_rms_norm_is_row_invariant() -> None:
    x = torch.randn(301, 96, generator=gen(4))
    w = torch.randn(96, generator=gen(5))
    full = rms_norm(x, w, 1e-5)
    for a, b in [(0, 1), (5, 22), (100, 301), (300, 301)]:
        assert torch.equal(rms_norm(x[a:b].clone(), w, 1e-5), full[a:b])


# --- rope ---


def test_inv_freq_matches_formula() -> None:
    want = torch.tensor([1e6 ** (-2 * i / 64) for i in range(32)], dtype=torch.float64)
    assert close(rope.inv_freq(64, 1e6), want, 1e-6)


@pytest.mark.parametrize("head_dim", [16, 64])
def test_apply_rope_rotates_half_pairs(head_dim: int) -> None:
    """NeoX rotate-half: dims i and i + D/2 form the pair rotated by position · inv_freq[i]."""
    positions = torch.tensor([0, 1, 7, 511, 512, 4095])
    x = torch.randn(len(positions), 3, head_dim, generator=gen(6))
    freqs = rope.inv_freq(head_dim, 10000.0)
    cos, sin = rope.cos_sin(positions, freqs, torch.float32)
    got = rope.apply_rope(x, cos, sin)
    half = head_dim // 2
    # the angle is an fp32 product, as in the reference; at position 4095 its rounding is ~1e-4
    angle = (positions.float()[:, None] * freqs[None, :]).double()[:, None, :]  # [N, 1, D/2]
    lo, hi = x[..., :half].double(), x[..., half:].double()
    want = torch.cat((lo * angle.cos() - hi * angle.sin(), hi * angle.cos() + lo * angle.sin()), -1)
    assert close(got, want, 1e-5)


def test_cos_sin_are_cast_to_the_model_dtype_and_row_invariant() -> None:
    positions = torch.arange(1000, 1300)
    freqs = rope.inv_freq(64, 1e6)
    cos, sin = rope.cos_sin(positions, freqs, torch.bfloat16)
    assert cos.dtype == sin.dtype == torch.bfloat16 and cos.shape == (300, 64)
    full_cos, full_sin = rope.cos_sin(positions, freqs, torch.float32)
    for a, b in [(0, 1), (3, 20), (299, 300)]:
        c, s = rope.cos_sin(positions[a:b].clone(), freqs, torch.float32)
        assert torch.equal(c, full_cos[a:b]) and torch.equal(s, full_sin[a:b])


LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0}


@pytest.mark.parametrize(
    "scaling",
    [None, {"type": "linear", "factor": 4.0}, LLAMA3],
    ids=["default", "linear", "llama3"],
)
def test_scaled_inv_freq_is_transformers_bit_for_bit(scaling: dict | None) -> None:
    """A transformers 4.x config.json (`rope_scaling`, `type` or `rope_type`, a top-level
    rope_theta), read as transformers 5.23.0 reads it, gives its inverse frequencies exactly."""
    transformers = pytest.importorskip("transformers")
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    config = {"rope_theta": 500000.0, "max_position_embeddings": 512, "rope_scaling": scaling}
    params = rope_parameters(config)
    ref_cfg = transformers.LlamaConfig(hidden_size=64, num_attention_heads=2, head_dim=32, **config)
    kind = ref_cfg.rope_parameters["rope_type"]
    assert params["rope_type"] == kind
    if kind == "default":
        want = rope.inv_freq(32, 500000.0)
    else:
        want, scale = ROPE_INIT_FUNCTIONS[kind](ref_cfg, "cpu")
        assert scale == 1.0  # cos and sin are not rescaled
    got = rope.scaled_inv_freq(32, params)
    assert torch.equal(got, want)
    assert kind == "default" or not torch.equal(got, rope.inv_freq(32, 500000.0))


def test_rope_scaling_wins_and_an_unimplemented_type_is_refused() -> None:
    both = {"rope_parameters": {"rope_type": "default"}, "rope_scaling": {"rope_type": "yarn"}}
    with pytest.raises(RopeRefused, match="'yarn'.*accepted: 'default', 'linear', 'llama3'"):
        rope_parameters({**both, "rope_theta": 1e4})
    with pytest.raises(RopeRefused, match="'linear'.*accepted: 'default'$"):
        rope_parameters({"rope_scaling": {"type": "linear", "factor": 2}}, ("default",))
    with pytest.raises(RopeRefused, match="needs low_freq_factor"):
        rope_parameters({"rope_scaling": {"rope_type": "llama3", "factor": 8.0}})
    assert rope_parameters({"rope_theta": 5.0, "rope_scaling": None}) == {
        "rope_type": "default",
        "rope_theta": 5.0,
    }


# --- conv ---


def conv_formula(u: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """Depthwise causal conv over a whole sequence from zeros: u [n, C], weight [C, K]."""
    c, k = weight.shape
    out = F.conv1d(
        u.double().t()[None],
        weight.double()[:, None, :],
        None if bias is None else bias.double(),
        padding=k - 1,
        groups=c,
    )
    return out[0, :, : u.shape[0]].t()


@pytest.mark.parametrize("with_bias", [False, True])
@pytest.mark.parametrize("k", [2, 3, 4])
def test_causal_conv_matches_conv1d(k: int, with_bias: bool) -> None:
    u = torch.randn(50, 24, generator=gen(7))
    w = torch.randn(24, k, generator=gen(8))
    b = torch.randn(24, generator=gen(9)) if with_bias else None
    out, tail = conv.causal_conv(u, torch.zeros(24, k - 1), w, b)
    assert close(out, conv_formula(u, w, b), 1e-6)
    assert torch.equal(tail, u[-(k - 1) :].t())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_causal_conv_carried_tail_equals_one_run(dtype: torch.dtype) -> None:
    u = torch.randn(60, 16, generator=gen(10)).to(dtype)
    w = torch.randn(16, 3, generator=gen(11)).to(dtype)
    whole, whole_tail = conv.causal_conv(u, torch.zeros(16, 2, dtype=dtype), w)
    tail = torch.zeros(16, 2, dtype=dtype)
    parts = []
    for a, b in [(0, 1), (1, 2), (2, 3), (3, 40), (40, 41), (41, 60)]:  # runs shorter than K-1 too
        out, tail = conv.causal_conv(u[a:b], tail, w)
        parts.append(out)
    assert torch.equal(torch.cat(parts), whole)
    assert torch.equal(tail, whole_tail)


def test_tails_at_positions_inside_a_run() -> None:
    u = torch.randn(20, 8, generator=gen(12))
    w = torch.randn(8, 3, generator=gen(13))
    start = torch.randn(8, 2, generator=gen(14))
    counts = [1, 2, 7, 20]
    taps = conv.tails_at(u, start, counts, 3)
    assert taps.shape == (4, 8, 2)
    for a, tap in zip(counts, taps):
        _, tail = conv.causal_conv(u[:a], start, w)
        assert torch.equal(tap, tail)
    _, last = conv.causal_conv(u, start, w)
    assert torch.equal(taps[-1], last)
    with pytest.raises(ValueError):
        conv.tails_at(u, start, [21], 3)


# --- moe ---


@pytest.mark.parametrize("fn, ref", [(moe.silu, F.silu), (moe.sigmoid, torch.sigmoid)])
def test_activations_match_torch_and_are_position_invariant(fn, ref) -> None:
    x = torch.randn(4099, generator=gen(15)) * 6
    full = fn(x)
    assert close(full, ref(x.double()), 1e-6)
    for a, b in [(0, 1), (1, 18), (17, 50), (4090, 4099), (100, 3333)]:
        assert torch.equal(fn(x[a:b].clone()), full[a:b])
    xb = x.to(torch.bfloat16)
    assert fn(xb).dtype == torch.bfloat16 and close(fn(xb), ref(xb.double()), 1e-2)


def experts_weights(e: int, h: int, i: int, seed: int) -> tuple[list, list, list]:
    g = gen(seed)
    return (
        [torch.randn(i, h, generator=g) * 0.2 for _ in range(e)],
        [torch.randn(i, h, generator=g) * 0.2 for _ in range(e)],
        [torch.randn(h, i, generator=g) * 0.2 for _ in range(e)],
    )


def route_formula(x, gate, bias, k, norm, scaling):
    """modeling_lfm2_moe.py Lfm2MoeTopKRouter.forward, in fp64."""
    s = torch.sigmoid(x.double() @ gate.double().t())
    chosen = s + bias.double() if bias is not None else s
    idx = torch.topk(chosen, k, dim=-1).indices
    w = s.gather(1, idx)
    if norm:
        w = w / (w.sum(-1, keepdim=True) + 1e-6)
    return w * scaling, idx


@pytest.mark.parametrize("use_bias, norm, scaling", [(True, True, 1.0), (False, False, 2.5)])
def test_route_matches_formula(use_bias: bool, norm: bool, scaling: float) -> None:
    x = torch.randn(200, 32, generator=gen(16))
    gate = torch.randn(8, 32, generator=gen(17)) * 0.3
    bias = torch.randn(8, generator=gen(18)) * 0.1 if use_bias else None
    w, idx = moe.route(x, gate, bias, 3, norm_topk_prob=norm, scaling=scaling)
    want_w, want_idx = route_formula(x, gate, bias, 3, norm, scaling)
    assert torch.equal(idx, want_idx)
    assert w.dtype == torch.float32 and close(w, want_w, 1e-6)


def test_route_keeps_bias_fp32_and_weights_in_model_dtype() -> None:
    x = torch.randn(64, 32, generator=gen(19)).to(torch.bfloat16)
    gate = (torch.randn(8, 32, generator=gen(20)) * 0.3).to(torch.bfloat16)
    bias = torch.randn(8, generator=gen(21)) * 0.1
    w, idx = moe.route(x, gate, bias, 2, norm_topk_prob=True)
    assert w.dtype == torch.bfloat16
    scores = moe.sigmoid(x @ gate.t())  # the same bf16 scores, compared in fp32 after the bias
    assert torch.equal(idx, torch.topk(scores.float() + bias, 2, dim=-1).indices)


def test_moe_matches_per_row_formula() -> None:
    n, h, i, e, k = 90, 32, 16, 6, 3
    x = torch.randn(n, h, generator=gen(22))
    w1, w3, w2 = experts_weights(e, h, i, 23)
    weights, idx = moe.route(x, torch.randn(e, h, generator=gen(24)), None, k, norm_topk_prob=True)
    got = moe.moe(x, weights, idx, w1, w3, w2)
    want = torch.zeros(n, h, dtype=torch.float64)
    for r in range(n):
        for j in range(k):
            ex = int(idx[r, j])
            xr = x[r].double()
            act = F.silu(w1[ex].double() @ xr) * (w3[ex].double() @ xr)
            want[r] += weights[r, j].double() * (w2[ex].double() @ act)
    assert close(got, want, 1e-6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_moe_row_never_depends_on_other_rows(dtype: torch.dtype) -> None:
    n, h, i, e, k = 133, 48, 40, 5, 2
    x = torch.randn(n, h, generator=gen(25)).to(dtype)
    w1, w3, w2 = ([t.to(dtype) for t in ts] for ts in experts_weights(e, h, i, 26))
    weights, idx = moe.route(
        x, torch.randn(e, h, generator=gen(27)).to(dtype), None, k, norm_topk_prob=True
    )
    full = moe.moe(x, weights, idx, w1, w3, w2)
    for a, b in [(0, 1), (7, 8), (3, 40), (40, 133)]:
        part = moe.moe(x[a:b].clone(), weights[a:b].clone(), idx[a:b].clone(), w1, w3, w2)
        assert torch.equal(part, full[a:b])
    crowd = idx.clone()
    crowd[1:] = idx[0]  # every other row now shares row 0's experts
    alone = moe.moe(x[:1], weights[:1], idx[:1], w1, w3, w2)
    assert torch.equal(moe.moe(x, weights, crowd, w1, w3, w2)[:1], alone)


def test_gated_ffn_matches_formula() -> None:
    x = torch.randn(21, 32, generator=gen(28))
    (w1,), (w3,), (w2,) = experts_weights(1, 32, 64, 29)
    xd = x.double()
    want = (F.silu(xd @ w1.double().t()) * (xd @ w3.double().t())) @ w2.double().t()
    assert close(moe.gated_ffn(x, w1, w3, w2), want, 1e-6)
