"""The gemma4 and glm5_next feed-forward blocks through the shared MoE kernels (core/ops/
triton_moe.py, triton_route.py) against each family's torch code (the CPU path), on the CPU
under TRITON_INTERPRET=1 at small sizes, and their batch invariance: a row's bits never depend
on the other rows of the pass."""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

from types import SimpleNamespace  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore:overflow encountered in exp")  # gelu's exp(-2u)

pytest.importorskip("triton", reason="the Triton kernels need triton")
gemma_layers = pytest.importorskip("tensorfold_gemma4.layers")
glm_moe = pytest.importorskip("tensorfold_glm.moe")

from tensorfold import testing  # noqa: E402
from tensorfold.ops import (  # noqa: E402
    gpu,  # noqa: E402
    triton_moe,
    triton_route,
)
from tensorfold.ops import moe as ref_moe  # noqa: E402
from tensorfold_gemma4.weights import MlpWeights  # noqa: E402
from tensorfold_gemma4.weights import MoeWeights as GemmaMoe  # noqa: E402
from tensorfold_glm import triton_ffn  # noqa: E402
from tensorfold_glm.weights import DenseWeights  # noqa: E402
from tensorfold_glm.weights import MoeWeights as GlmMoe  # noqa: E402


@pytest.fixture(autouse=True, scope="module")
def _round_to_nearest_even():
    """The interpreter truncates fp32 -> bf16 (the GPU rounds to nearest even, as torch does):
    give it the GPU's rounding, so bf16 results compare bit for bit with the references."""
    with testing.interpreter_rounds_like_the_gpu():
        yield


@pytest.fixture
def on_kernels():
    """Run the families' GPU paths on CPU tensors (interpreted); `off()` for the torch path."""
    gpu.set_triton(True, on_cpu=True)
    yield lambda on: gpu.set_triton(True, on_cpu=on)
    gpu.set_triton(True)


DTYPES = [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)]
SPANS = [(0, 1), (9, 10), (3, 31)]  # a row alone, another, a slice of rows


def randn(*shape: int, seed: int, dtype=torch.float32, scale: float = 1.0) -> torch.Tensor:
    return (torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * scale).to(dtype)


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def rows_alone_equal(fn, n: int, got: torch.Tensor) -> None:
    for a, z in SPANS:
        assert torch.equal(fn(a, z), got[a:z]), (a, z)


# --- the gated FFN's activations ---


@pytest.mark.parametrize("dtype, tol", DTYPES)
@pytest.mark.parametrize("act", ["silu_clamp", "gelu_tanh"])
def test_gated_ffn_activation_matches_reference(dtype, tol, act):
    """Fused [2I, H] gate_up read as strided views; the clamp at 1.5 cuts many entries."""
    x = randn(40, 32, seed=1, dtype=dtype)
    gate_up = randn(96, 32, seed=2, dtype=dtype, scale=0.5)
    w1, w3 = gate_up[:48], gate_up[48:]
    w2 = randn(32, 48, seed=3, dtype=dtype, scale=0.2)
    got = triton_moe.gated_ffn(x, w1, w3, w2, act=act, limit=1.5)
    want = ref_moe.gated_ffn(x, w1, w3, w2, act=act, limit=1.5)
    assert got.dtype == dtype and rel(got, want) < tol
    if act == "silu_clamp":
        assert (ref_moe.linear(x, w3).abs() > 1.5).float().mean() > 0.1  # the clamp matters
    rows_alone_equal(
        lambda a, z: triton_moe.gated_ffn(x[a:z].clone(), w1, w3, w2, act=act, limit=1.5), 40, got
    )


@pytest.mark.parametrize("dtype, tol", DTYPES)
def test_gemma4_mlp_matches_the_cpu_path(dtype, tol, on_kernels):
    x = randn(20, 32, seed=4, dtype=dtype)
    w = MlpWeights(
        randn(40, 32, seed=5, dtype=dtype, scale=0.3),
        randn(40, 32, seed=6, dtype=dtype, scale=0.3),
        randn(32, 40, seed=7, dtype=dtype, scale=0.3),
    )
    got = gemma_layers.mlp(w, x)
    on_kernels(False)
    assert rel(got, gemma_layers.mlp(w, x)) < tol


@pytest.mark.parametrize("dtype, tol", DTYPES)
def test_glm_swiglu_matches_the_cpu_path(dtype, tol, on_kernels):
    x = randn(20, 32, seed=8, dtype=dtype, scale=4.0)  # products past the ±10 clamp
    w = DenseWeights(
        randn(80, 32, seed=9, dtype=dtype, scale=0.5),
        randn(32, 40, seed=10, dtype=dtype, scale=0.3),
    )
    got = glm_moe.swiglu(x, w, 10.0)
    on_kernels(False)
    assert rel(got, glm_moe.swiglu(x, w, 10.0)) < tol


# --- gemma4: softmax router, per-expert scale, fp32 slot products ---

GEMMA = SimpleNamespace(rms_norm_eps=1e-6, hidden_size=32, top_k_experts=3)


def gemma_moe(dtype: torch.dtype, e: int = 6, i: int = 24, h: int = 32) -> GemmaMoe:
    return GemmaMoe(
        router=randn(e, h, seed=11, dtype=dtype, scale=2.0),  # wide: no near-tie choices
        router_scale=(1 + randn(h, seed=12, scale=0.2)).to(dtype),
        per_expert_scale=(1 + randn(e, seed=13, scale=0.3)).to(dtype),
        gate_up=randn(e, 2 * i, h, seed=14, dtype=dtype, scale=0.3),
        down=randn(e, h, i, seed=15, dtype=dtype, scale=0.3),
        pre_norm=1 + randn(h, seed=16, scale=0.2),
        post_norm_mlp=torch.ones(h),
        post_norm_experts=torch.ones(h),
    )


@pytest.mark.parametrize("dtype, tol", DTYPES)
def test_gemma4_experts_ffn_matches_the_cpu_path(dtype, tol, on_kernels):
    n, k = 50, 3  # 150 pairs
    w = gemma_moe(dtype)
    x = randn(n, 32, seed=17, dtype=dtype)
    experts = torch.stack(
        [torch.randperm(6, generator=torch.Generator().manual_seed(r))[:k] for r in range(n)]
    )
    weights = randn(n, k, seed=18).abs() + 0.1  # fp32, as the router gives them
    got = gemma_layers.experts_ffn(x, weights, experts, w.gate_up, w.down)
    assert got.dtype == dtype
    on_kernels(False)
    want = gemma_layers.experts_ffn(x, weights, experts, w.gate_up, w.down)
    assert rel(got, want) < tol
    if dtype == torch.float32:  # the fp32 products (not rounded per slot) reach the sum
        rounded = ref_moe.moe(
            x,
            weights,
            experts,
            list(w.gate_up[:, :24]),
            list(w.gate_up[:, 24:]),
            list(w.down),
            act="gelu_tanh",
            fp32_slots=True,
        )
        assert rel(got, rounded) < tol


@pytest.mark.parametrize("dtype, tol", DTYPES)
def test_gemma4_moe_matches_the_cpu_path_and_is_row_invariant(dtype, tol, on_kernels):
    n = 90  # 270 pairs: aligned by chunks; a row alone in one program
    w = gemma_moe(dtype)
    r = randn(n, 32, seed=19, dtype=dtype)
    got = gemma_layers.moe(GEMMA, w, r)
    rows_alone_equal(lambda a, z: gemma_layers.moe(GEMMA, w, r[a:z].clone()), n, got)
    z, xe = triton_route.router_input(r, 1e-6, w.router_scale, 32**-0.5, w.pre_norm)
    weights, experts = triton_route.softmax_route(z, w.router, 3, w.per_expert_scale)
    on_kernels(False)
    want = gemma_layers.moe(GEMMA, w, r)
    # the router against the CPU code's steps
    want_z = gemma_layers.rms_norm(r, None, 1e-6) * w.router_scale * 32**-0.5
    assert rel(z, want_z) < tol / 10
    assert rel(xe, gemma_layers.rms_norm(r, w.pre_norm, 1e-6)) < tol / 10
    probs = torch.softmax(ref_moe.linear(want_z, w.router), dim=-1, dtype=torch.float32)
    want_w, want_e = torch.topk(probs, 3, dim=-1)
    want_w = want_w / want_w.sum(-1, keepdim=True) * w.per_expert_scale[want_e]
    assert weights.dtype == torch.float32
    # bf16 logits tie now and then; the kernel gives a tie to the lower expert, torch.topk
    # to either: elsewhere the same choice
    assert (probs.gather(1, experts) - probs.gather(1, want_e)).abs().max() < 1e-6
    same = (experts == want_e).all(-1)
    assert same.float().mean() > 0.95
    assert rel(weights[same], want_w[same]) < tol / 10
    assert rel(got[same], want[same]) < tol


# --- glm5_next: fp32 sigmoid router with groups, slots in expert order, rounded sums ---


def glm_cfg(groups: int, keep: int, norm: bool = True) -> SimpleNamespace:
    return SimpleNamespace(
        n_routed_experts=8,
        num_experts_per_tok=3,
        n_group=groups,
        topk_group=keep,
        norm_topk_prob=norm,
        routed_scaling_factor=2.5,
        swiglu_limit=10.0,
    )


def glm_weights(dtype: torch.dtype, e: int = 8, i: int = 24, h: int = 32) -> GlmMoe:
    gate_up = randn(e, 2 * i, h, seed=20, dtype=dtype, scale=0.6)
    down = randn(e, h, i, seed=21, dtype=dtype, scale=0.3)
    experts = [DenseWeights(gate_up[j].clone(), down[j].clone()) for j in range(e)]  # apart
    return GlmMoe(
        router=randn(e, h, seed=22, scale=0.5),
        bias=randn(e, seed=23, scale=0.3),
        experts=experts,
        shared=DenseWeights(
            randn(2 * i, h, seed=24, dtype=dtype, scale=0.6),
            randn(h, i, seed=25, dtype=dtype, scale=0.3),
        ),
    )


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("groups, keep, norm", [(1, 1, True), (4, 2, True), (2, 1, False)])
def test_glm_route_matches_the_cpu_router(dtype, groups, keep, norm):
    cfg, w = glm_cfg(groups, keep, norm), glm_weights(dtype)
    x = randn(45, 32, seed=26, dtype=dtype, scale=3.0)
    want_w, want_e = glm_moe.route(cfg, x, w)
    got_w, got_e = triton_ffn.route(cfg, x, w)
    assert got_w.dtype == torch.float32 and got_e.dtype == torch.long
    order = torch.argsort(want_e, dim=1)  # the kernel gives each row's slots in expert order
    want_e, want_w = want_e.gather(1, order), want_w.gather(1, order)
    assert (got_e.diff(dim=1) > 0).all()
    # fp32 logits summed in another order: a choice may flip only at a near tie
    same = (got_e == want_e).all(-1)
    assert same.float().mean() > 0.95
    assert rel(got_w[same], want_w[same]) < 1e-6
    for a, z in SPANS:
        sw, se = triton_ffn.route(cfg, x[a:z].clone(), w)
        assert torch.equal(se, got_e[a:z]) and torch.equal(sw, got_w[a:z])


@pytest.mark.parametrize("dtype, tol", DTYPES)
def test_glm_moe_matches_the_cpu_path_and_is_row_invariant(dtype, tol, on_kernels):
    cfg, w = glm_cfg(4, 2), glm_weights(dtype)
    values = [(e.gate_up.clone(), e.down.clone()) for e in w.experts]
    n = 90  # 270 pairs
    x = randn(n, 32, seed=27, dtype=dtype, scale=3.0)
    got = glm_moe.moe(cfg, x, w)
    rows_alone_equal(lambda a, z: glm_moe.moe(cfg, x[a:z].clone(), w), n, got)
    # the separate experts were stacked once; each now views its slice, with the same values
    gate_up, down = triton_ffn.experts_stacked(w)
    for j, e in enumerate(w.experts):
        assert e.gate_up.data_ptr() == gate_up[j].data_ptr()
        assert e.down.data_ptr() == down[j].data_ptr()
        assert torch.equal(e.gate_up, values[j][0]) and torch.equal(e.down, values[j][1])
    assert triton_ffn.experts_stacked(w)[0] is gate_up
    weights, chosen = triton_ffn.route(cfg, x, w)
    on_kernels(False)
    want = glm_moe.moe(cfg, x, w)
    want_w, want_e = glm_moe.route(cfg, x, w)
    same = (chosen == want_e.sort(dim=1).values).all(-1)
    assert same.float().mean() > 0.95
    assert rel(got[same], want[same]) < tol


def test_glm_moe_sums_slots_rounded_in_expert_order():
    """The slot sum to the bit: glm5_next's (each add rounded to bf16, in slot order, then the
    shared expert) and lfm2's / gemma4's (in fp32, rounded once)."""
    dtype = torch.bfloat16
    n, k, h = 12, 3, 32
    slots = randn(n * k, h, seed=28, dtype=dtype)
    plus = randn(n, h, seed=29, dtype=dtype)
    out = torch.empty(n, h, dtype=dtype)
    triton_moe._slot_sum_kernel[(n, 1)](
        slots, plus, out, h, TOPK=k, CH=64, ROUND_EACH=True, HAS_PLUS=True
    )
    per = slots.view(n, k, h)
    want = per[:, 0]
    for j in range(1, k):
        want = want + per[:, j]
    assert torch.equal(out, want + plus)
    triton_moe._slot_sum_kernel[(n, 1)](
        slots, plus, out, h, TOPK=k, CH=64, ROUND_EACH=False, HAS_PLUS=False
    )
    acc = per[:, 0].float()
    for j in range(1, k):
        acc = acc + per[:, j].float()
    assert torch.equal(out, acc.to(dtype))


@pytest.mark.parametrize("act", ["silu_clamp", "gelu_tanh"])
def test_tile_choice_by_row_count_changes_no_bits(act, monkeypatch: pytest.MonkeyPatch):
    """Decode tiles and prompt tiles give a row the same bits for the new activations too."""
    dtype = torch.bfloat16
    x = randn(30, 32, seed=30, dtype=dtype)
    gate_up = randn(6, 48, 32, seed=31, dtype=dtype, scale=0.5)
    down = randn(6, 32, 24, seed=32, dtype=dtype, scale=0.3)
    experts = torch.stack(
        [torch.randperm(6, generator=torch.Generator().manual_seed(r))[:2] for r in range(30)]
    )
    weights = randn(30, 2, seed=33).abs()
    got = []
    for rows in (1 << 30, -1):
        monkeypatch.setattr(triton_moe, "SMALL_ROWS", rows)
        got.append(
            triton_moe.moe(
                x,
                weights,
                experts,
                gate_up[:, :24],
                gate_up[:, 24:],
                down,
                act=act,
                limit=1.0,
                slot_dtype=torch.float32,
            )
        )
    assert torch.equal(got[0], got[1])


def test_the_kernels_keep_no_reference_to_a_models_experts():
    """Experts passed as views of one stack are read through a view made per call: once the
    model lets go of its stack, nothing in the kernels' module holds it (a cache there kept a
    freed model's experts on the GPU)."""
    import gc
    import weakref

    e, i, h, n = 4, 16, 32, 6
    gate_up = randn(e, 2 * i, h, seed=41, scale=0.2)
    down = randn(e, h, i, seed=42, scale=0.2)
    alive = weakref.ref(gate_up)
    w1, w3, w2 = (
        list(gate_up[:, :i].unbind(0)),
        list(gate_up[:, i:].unbind(0)),
        list(down.unbind(0)),
    )
    x = randn(n, h, seed=43)
    experts = torch.tensor([[0, 1]] * 3 + [[2, 3]] * 3)
    weights = torch.full((n, 2), 0.5)
    triton_moe.moe(x, weights, experts, w1, w3, w2)
    del gate_up, w1, w3
    gc.collect()
    assert alive() is None
