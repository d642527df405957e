"""glm5_next's own Triton kernels (triton_kda.py, triton_mhc.py) against the torch references
(kda.py, mhc.py), on the CPU under TRITON_INTERPRET=1 at tiny sizes, and their batch invariance:
a row's bits never depend on the other rows of the pass. Then a KDA-only model through the
kernels: against the torch path, concurrent == solo, and decode rounds through the graph runner's
static pass (layout from PassMeta only) equal to plain passes."""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest
import torch

pytest.importorskip("triton", reason="the Triton kernels need triton")

from tensorfold import testing  # noqa: E402
from tensorfold.family.forward_pass import ForwardPass, StreamRows  # noqa: E402
from tensorfold.ops import switches  # noqa: E402
from tensorfold.ops.conv import causal_conv  # noqa: E402
from tensorfold.ops.norms import rms_norm  # noqa: E402
from tensorfold.ops.pass_meta import build_meta  # noqa: E402
from tensorfold_glm import kda as ref_kda  # noqa: E402
from tensorfold_glm import mhc as ref_mhc  # noqa: E402
from tensorfold_glm import triton_kda, triton_mhc  # noqa: E402
from tensorfold_glm.config import GlmConfig  # noqa: E402
from tensorfold_glm.ops import sigmoid, silu  # noqa: E402
from tensorfold_glm.weights import HcWeights  # noqa: E402

DTYPES = [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)]


@pytest.fixture(autouse=True, scope="module")
def _round_to_nearest_even():
    """The interpreter truncates fp32 -> bf16; give it the GPU's round-to-nearest-even (as
    tests/test_triton_kernels.py does), so bf16 results compare with the references."""
    with testing.interpreter_rounds_like_the_gpu():
        yield


def randn(*shape: int, seed: int, dtype=torch.float32, scale: float = 1.0) -> torch.Tensor:
    return (torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * scale).to(dtype)


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def a_pass(*streams: tuple[int, int, int]) -> ForwardPass:
    """Streams as (slot, start, rows)."""
    return ForwardPass([StreamRows(s, a, [1] * n, [0, 1], "all") for s, a, n in streams], 512)


# --- KDA: the short conv with SiLU, its tails, fresh states, the gated norm ---


@pytest.mark.parametrize("dtype, tol", DTYPES)
def test_conv_silu_matches_the_reference_and_a_stream_alone(dtype, tol):
    d, k, slots = 32, 4, 4
    fp = a_pass((0, 0, 7), (2, 5, 3), (1, 9, 1))
    qkv = randn(fp.num_rows, 3 * d, seed=1, dtype=dtype)
    tails = randn(slots, 3 * d, k - 1, seed=2, dtype=dtype)
    w = randn(3 * d, k, seed=3, scale=0.5)
    want, want_tails = [], tails.clone()
    for s, (lo, hi) in zip(fp.streams, fp.spans):
        tail = torch.zeros_like(tails[s.slot]) if s.start == 0 else tails[s.slot]
        mixed, new = causal_conv(qkv[lo:hi].float(), tail.float(), w)
        want.append(silu(mixed).to(dtype))
        want_tails[s.slot] = new.to(dtype)
    got_tails = tails.clone()
    got = triton_kda.conv_silu(qkv, got_tails, build_meta(fp), w, d)  # [3, N, D]
    assert rel(got.permute(1, 0, 2).reshape(fp.num_rows, -1), torch.cat(want)) < tol
    assert torch.equal(got_tails, want_tails)
    alone = a_pass((2, 5, 3))
    one = triton_kda.conv_silu(qkv[7:10].clone(), tails.clone(), build_meta(alone), w, d)
    assert torch.equal(one, got[:, 7:10])


@pytest.mark.parametrize("k", [4, 2])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_decode_pass_moves_its_tails_on_in_the_convs_own_launch(k, dtype, monkeypatch):
    """KDA_TAIL_IN_PLACE, both values: a pass of one row a stream (one fresh, two resumed, a slot in
    no stream) gives the outputs and leaves the tails of the conv then tail_kernel, bit for bit."""
    d, slots = 32, 4
    fp = a_pass((0, 0, 1), (2, 5, 1), (3, 9, 1))
    qkv = randn(fp.num_rows, 3 * d, seed=11, dtype=dtype)
    tails = randn(slots, 3 * d, k - 1, seed=12, dtype=dtype)
    w = randn(3 * d, k, seed=13, scale=0.5)

    def run(in_place: bool) -> tuple[torch.Tensor, torch.Tensor]:
        launches = Launches(triton_kda.tail_kernel)
        monkeypatch.setattr(triton_kda, "tail_kernel", launches)
        got_tails = tails.clone()
        with switches.switched(switches.KDA_TAIL_IN_PLACE, in_place):
            out = triton_kda.conv_silu(qkv, got_tails, build_meta(fp), w, d, one_row_each=True)
        assert len(launches.grids) == (0 if in_place else 1)
        return out, got_tails

    (out, moved), (want, want_tails) = run(True), run(False)
    assert torch.equal(out, want) and torch.equal(moved, want_tails)
    assert torch.equal(moved[1], tails[1])


def test_zero_fresh_zeroes_only_the_slots_of_streams_starting_at_row_0():
    states = torch.full((4, 2, 3, 3), float("nan"))
    triton_kda.zero_fresh(states, build_meta(a_pass((3, 0, 2), (1, 4, 1))))
    assert torch.equal(states[3], torch.zeros(2, 3, 3))
    assert states[[0, 1, 2]].isnan().all()


@pytest.mark.parametrize("dtype, tol", DTYPES)
def test_gated_norm_matches_the_reference_and_is_row_invariant(dtype, tol):
    o = randn(9, 2, 16, seed=4, dtype=dtype)
    gate = randn(9, 2, 16, seed=5, dtype=dtype)
    w = randn(16, seed=6, dtype=dtype, scale=0.3) + 1
    got = triton_kda.gated_norm(o, gate, w, 1e-5)
    assert rel(got, ref_kda.gated_norm(o, gate, w, 1e-5)) < tol
    assert torch.equal(triton_kda.gated_norm(o[4:5], gate[4:5], w, 1e-5), got[4:5])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_sigmoid_of_a_strided_slice_matches_the_reference_and_is_row_invariant(dtype):
    wide = randn(9, 40, seed=7, dtype=dtype, scale=4.0)
    b = wide[:, 32:]  # beta's columns of the joint product: rows strided by 40
    got = triton_kda.sigmoid(b)
    assert got.dtype == dtype and got.is_contiguous() and got.shape == (9, 8)
    assert rel(got, sigmoid(b)) < (1e-6 if dtype == torch.float32 else 1e-2)
    assert torch.equal(triton_kda.sigmoid(b[4:5].clone()), got[4:5])


class _Gates:
    """The weights the recurrent rows read: a_log (decay its exp), dt_bias, b's heads."""

    def __init__(self, heads: int, dk: int, seed: int):
        g = torch.Generator().manual_seed(seed)
        self.a_log = torch.randn(heads, generator=g) * 0.5
        self.decay = torch.exp(self.a_log)
        self.dt_bias = torch.randn(heads * dk, generator=g)
        self.b = torch.zeros(heads, 1)


def _recurrent_inputs(n: int, heads: int, dk: int, dtype: torch.dtype, seed: int):
    g = torch.Generator().manual_seed(seed)
    q, k, v, pre = (torch.randn(n, heads * dk, generator=g).to(dtype) for _ in range(4))
    b = torch.randn(n, heads + 3, generator=g).to(dtype)[:, 1 : heads + 1]  # strided, as maps'
    return q, k, v, pre, b


def _runs(*runs):
    """(first row, rows, position, slot) each -> the four int32 columns recurrent takes."""
    return [torch.tensor(col, dtype=torch.int32) for col in zip(*runs)]


@pytest.mark.parametrize("lower_bound", [-5.0, None])
@pytest.mark.parametrize("dtype, tol", DTYPES)
def test_the_recurrent_rows_match_the_delta_rule(lower_bound, dtype, tol):
    """Runs of 4 resumed rows (slot 2), 3 fresh rows (slot 0, its old state ignored) and 1 row
    (slot 3), in one launch: each run's outputs and the state it leaves against kda.delta_rule
    on the reference's inputs (the packed stand-in); slot 1, in no run, untouched."""
    from tensorfold_glm.kda_launches import TorchKernels

    heads, dk, n = 2, 16, 8
    cfg = GlmConfig.from_dict(
        {"linear_num_heads": heads, "linear_head_dim": dk, "linear_lower_bound": lower_bound},
        "test",
    )
    w = _Gates(heads, dk, seed=1)
    q, k, v, pre, b = _recurrent_inputs(n, heads, dk, dtype, seed=2)
    states = torch.randn(4, heads, dk, dk, generator=torch.Generator().manual_seed(3))
    before = states.clone()
    out = torch.full((n, heads, dk), float("nan"), dtype=dtype)
    triton_kda.recurrent(
        q,
        k,
        v,
        pre,
        b,
        w.a_log,
        w.dt_bias,
        lower_bound,
        states,
        *_runs((0, 4, 70, 2), (4, 3, 0, 0), (7, 1, 5, 3)),
        out,
    )
    init = torch.stack([before[2], torch.zeros_like(before[0]), before[3]])
    want, final = TorchKernels(cfg, w, heads).packed(
        q, k, v, pre, sigmoid(b), init, torch.tensor([0, 4, 7, 8])
    )
    assert rel(out.float(), want.float()) < tol
    for j, slot in enumerate((2, 0, 3)):
        assert rel(states[slot], final[j]) < tol
    assert torch.equal(states[1], before[1])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_recurrent_rows_alone_equal_their_runs_in_one_launch(dtype):
    """A run's bits do not depend on the runs launched with it, nor on where its rows are cut:
    6 rows in one launch == 2 then 4 continuing from the state left; each run alone == all
    three runs in one launch."""
    heads, dk, n = 2, 16, 9
    w = _Gates(heads, dk, seed=4)
    q, k, v, pre, b = _recurrent_inputs(n, heads, dk, dtype, seed=5)
    start = torch.randn(3, heads, dk, dk, generator=torch.Generator().manual_seed(6))

    def run(*runs):
        states, out = start.clone(), torch.zeros(n, heads, dk, dtype=dtype)
        for r in runs:
            triton_kda.recurrent(q, k, v, pre, b, w.a_log, w.dt_bias, -5.0, states, *_runs(*r), out)
        return out, states

    together = run([(0, 6, 64, 0), (6, 2, 0, 1), (8, 1, 9, 2)])
    alone = run([(0, 6, 64, 0)], [(6, 2, 0, 1)], [(8, 1, 9, 2)])
    cut = run([(0, 2, 64, 0)], [(2, 4, 66, 0)], [(6, 2, 0, 1)], [(8, 1, 9, 2)])
    for got in (alone, cut):
        assert torch.equal(got[0], together[0]) and torch.equal(got[1], together[1])


def test_kda_model_with_the_recurrent_kernel_matches_fla_cores_stand_in(kernels_on_cpu, kda_model):
    """OWN_RECURRENT, both values, in the fp32 model through the kernels: prompts (their rows
    outside whole chunks), then decode rounds, against the same passes with the packed stand-in that
    takes fla-core's place when it is off."""
    from tensorfold.engine.runner import ModelRunner

    model = kda_model(torch.float32)
    with switches.switched(switches.OWN_RECURRENT, True):
        own = _passes(ModelRunner(model, num_pages=16, num_slots=3, page_rows=16), PROMPTS, 3)
    with switches.switched(switches.OWN_RECURRENT, False):
        stand_in = _passes(ModelRunner(model, num_pages=16, num_slots=3, page_rows=16), PROMPTS, 3)
    for o, s in zip(own, stand_in):
        assert rel(o, s) < 1e-5


def test_the_kda_maps_of_x_are_one_weight_viewed_by_name(kda_model):
    w = kda_model(torch.float32).weights.layers[0].mixer
    assert torch.equal(w.x_maps, torch.cat([w.f_a, w.g_a, w.b]))
    assert w.f_a.data_ptr() == w.x_maps.data_ptr() and w.b.is_contiguous()
    assert w.b.data_ptr() == w.x_maps[-w.b.shape[0] :].data_ptr()


# --- mHC: the collapse fused with its norm, and the expand ---


def hc_weights(hc: int, h: int, seed: int) -> HcWeights:
    width = (2 + hc) * hc
    return HcWeights(
        fn=randn(width, hc * h, seed=seed, scale=0.5 / (hc * h) ** 0.5),
        base=randn(width, seed=seed + 1, scale=0.5),
        scale=randn(3, seed=seed + 2) * 0.2 + 1,
    )


@pytest.mark.parametrize("hc", [4, 2])
@pytest.mark.parametrize("dtype, tol", DTYPES)
def test_collapse_norm_matches_the_reference_and_is_row_invariant(hc, dtype, tol):
    h, n = 48, 21
    cfg = GlmConfig.from_dict({"hidden_size": h, "hc_mult": hc}, "test")
    w = hc_weights(hc, h, seed=7)
    streams = randn(n, hc, h, seed=10, dtype=dtype)
    norm_w = randn(h, seed=11, dtype=dtype, scale=0.2) + 1
    post, comb, x = triton_mhc.collapse_norm(
        streams,
        w.fn,
        w.base,
        w.scale,
        norm_w,
        iters=cfg.hc_sinkhorn_iters,
        rms_eps=cfg.rms_norm_eps,
        hc_eps=cfg.hc_eps,
        norm_eps=cfg.rms_norm_eps,
    )
    want_post, want_comb, want_x = ref_mhc.collapse(cfg, w, streams)
    assert rel(post, want_post) < 1e-5 and rel(comb, want_comb) < 1e-5
    assert rel(x, rms_norm(want_x, norm_w, cfg.rms_norm_eps)) < tol
    assert torch.allclose(comb.sum(1), torch.ones(n, hc), atol=1e-3)  # columns sum to 1
    picked = [3, 17, 18]
    one = triton_mhc.collapse_norm(
        streams[picked].clone(),
        w.fn,
        w.base,
        w.scale,
        norm_w,
        iters=cfg.hc_sinkhorn_iters,
        rms_eps=cfg.rms_norm_eps,
        hc_eps=cfg.hc_eps,
        norm_eps=cfg.rms_norm_eps,
    )
    for a, b in zip(one, (post, comb, x)):
        assert torch.equal(a, b[picked])


def test_the_projection_splits_by_width_alone():
    assert triton_mhc.split_for(4 * 4096) == (64, 256)
    assert triton_mhc.split_for(192) == (1, 192)


@pytest.mark.parametrize("dtype, tol", DTYPES)
def test_expand_matches_the_reference_and_is_row_invariant(dtype, tol):
    n, hc, h = 11, 4, 40
    post = torch.rand(n, hc, generator=torch.Generator().manual_seed(1)) * 2
    comb = torch.softmax(randn(n, hc, hc, seed=2), -1)
    y = randn(n, h, seed=3, dtype=dtype)
    res = randn(n, hc, h, seed=4, dtype=dtype)
    got = triton_mhc.expand(post, comb, y, res)
    assert rel(got, ref_mhc.expand(post, comb, y, res)) < tol
    assert torch.equal(triton_mhc.expand(post[5:6], comb[5:6], y[5:6], res[5:6]), got[5:6])


@pytest.mark.parametrize("hc, h", [(4, 128), (2, 256), (4, 48)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_expand_then_collapse_in_one_launch_gives_the_two_steps_bits(hc, h, dtype, monkeypatch):
    """FUSED_EXPAND_COLLAPSE, on: a decode-sized pass's expand and the next collapse in one launch
    (its pieces arriving, the last collapsing the row) give expand's and collapse_norm's bits,
    and a row in it equals the row in a larger pass of the two steps."""
    n = 11
    cfg = GlmConfig.from_dict({"hidden_size": h, "hc_mult": hc}, "test")
    w = hc_weights(hc, h, seed=21)
    post = torch.rand(n, hc, generator=torch.Generator().manual_seed(22)) * 2
    comb = torch.softmax(randn(n, hc, hc, seed=23), -1)
    y = randn(n, h, seed=24, dtype=dtype)
    res = randn(n, hc, h, seed=25, dtype=dtype)
    norm_w = randn(h, seed=26, dtype=dtype, scale=0.2) + 1
    kw = dict(
        iters=cfg.hc_sinkhorn_iters,
        rms_eps=cfg.rms_norm_eps,
        hc_eps=cfg.hc_eps,
        norm_eps=cfg.rms_norm_eps,
    )

    def both(rows: list[int]) -> tuple[torch.Tensor, ...]:
        return triton_mhc.expand_collapse_norm(
            post[rows], comb[rows], y[rows], res[rows], w.fn, w.base, w.scale, norm_w, **kw
        )

    streams = triton_mhc.expand(post, comb, y, res)
    two_steps = (streams, *triton_mhc.collapse_norm(streams, w.fn, w.base, w.scale, norm_w, **kw))
    assert switches.FUSED_EXPAND_COLLAPSE.on()
    monkeypatch.setattr(triton_mhc, "FUSED_MAX_ROWS", 3)
    assert triton_mhc.split_for(hc * h)[0] == (2 if h >= 128 else 1)
    for rows in ([4], [0, 9, 10]):  # one launch each
        for got, want in zip(both(rows), two_steps):
            assert torch.equal(got, want[rows])
    for got, want in zip(both(list(range(n))), two_steps):  # 11 rows: the two steps
        assert torch.equal(got, want)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_streams_in_and_the_head_of_the_logit_rows_give_the_references_bits(dtype):
    """streams_in (the embedding rows hc times) and head_of_rows (the logit rows' stream mean),
    one launch each: the torch path's bits (a copy; fp32 adds in stream order, an IEEE divide,
    one rounding)."""
    embed = randn(50, 40, seed=5, dtype=dtype)
    tokens = torch.tensor([3, 49, 3, 0, 17])
    streams = triton_mhc.streams_in(embed, tokens, 4)
    assert torch.equal(streams, embed[tokens][:, None, :].expand(-1, 4, -1))
    res = randn(7, 4, 40, seed=6, dtype=dtype)
    rows = torch.tensor([6, 2, 3])
    assert torch.equal(triton_mhc.head(res, rows), ref_mhc.head(res.index_select(0, rows)))
    three = randn(2, 3, 40, seed=7, dtype=dtype)  # a stream count that is not a power of two
    one = torch.tensor([1])
    assert torch.equal(triton_mhc.head(three, one), ref_mhc.head(three[1:]))


# --- a KDA-only model through the kernels ---


def _passes(runner, prompts, rounds):
    from tensorfold.engine.runner import open_stream

    streams = [open_stream(runner, i, 64) for i in range(len(prompts))]
    out = runner.run([s.rows(p) for s, p in zip(streams, prompts)])
    logits = [torch.cat(out)]
    for _ in range(rounds):
        out = runner.run([s.rows([int(o[-1].argmax())]) for s, o in zip(streams, out)])
        logits.append(torch.cat(out))
    return logits


PROMPTS = [list(range(3, 15)), [7, 9, 11], list(range(40, 49))]


@pytest.mark.parametrize("dtype, tol", DTYPES)
def test_kda_model_through_the_kernels_matches_the_torch_path(
    dtype, tol, kernels_on_cpu, kda_model
):
    from tensorfold.engine.runner import ModelRunner
    from tensorfold.ops import gpu

    model = kda_model(dtype)
    got = _passes(ModelRunner(model, num_pages=16, num_slots=3, page_rows=16), PROMPTS, 2)
    gpu.set_triton(False)
    want = _passes(ModelRunner(model, num_pages=16, num_slots=3, page_rows=16), PROMPTS, 2)
    for g, w in zip(got, want):
        assert torch.isfinite(g).all()
        assert rel(g, w) < 5 * tol


class Launches:
    """A Triton kernel that keeps the grid of each launch."""

    def __init__(self, kernel):
        self.kernel, self.grids = kernel, []

    def __getitem__(self, grid):
        self.grids.append(grid)
        return self.kernel[grid]


def test_kda_model_with_its_tails_moved_on_in_the_convs_launch_gives_the_same_bits(
    kernels_on_cpu, kda_model, monkeypatch
):
    """KDA_TAIL_IN_PLACE, both values, in the model: its decode rounds' logits and the tails they
    leave, as with the tails' own launch."""
    from tensorfold.engine.runner import ModelRunner

    model = kda_model(torch.bfloat16)
    out, plain = {}, triton_kda.tail_kernel
    for on in (False, True):
        launches = Launches(plain)
        monkeypatch.setattr(triton_kda, "tail_kernel", launches)
        runner = ModelRunner(model, num_pages=16, num_slots=3, page_rows=16)
        with switches.switched(switches.KDA_TAIL_IN_PLACE, on):
            out[on] = (_passes(runner, PROMPTS, 3), runner.slots.get("L0.conv").clone())
        assert len(launches.grids) == (1 if on else 4)  # the prompt pass's; and 3 decode rounds
    assert all(torch.equal(a, b) for a, b in zip(out[True][0], out[False][0]))
    assert torch.equal(out[True][1], out[False][1])


def test_kda_model_with_expand_and_collapse_in_one_launch_gives_the_same_logits(
    kernels_on_cpu, kda_model, monkeypatch
):
    """FUSED_EXPAND_COLLAPSE, both values, in the model: on, its decode rounds (3 rows) take
    the one launch, its prompt pass the two steps; every logit as with the switch off (no
    launch of it), bit for bit."""
    from tensorfold.engine.runner import ModelRunner

    model = kda_model(torch.bfloat16)
    monkeypatch.setattr(triton_mhc, "FUSED_MAX_ROWS", 3)
    counted = Launches(triton_mhc._expand_collapse_kernel)
    monkeypatch.setattr(triton_mhc, "_expand_collapse_kernel", counted)
    with switches.switched(switches.FUSED_EXPAND_COLLAPSE, False):
        plain = _passes(ModelRunner(model, num_pages=16, num_slots=3, page_rows=16), PROMPTS, 2)
    assert counted.grids == []
    with switches.switched(switches.FUSED_EXPAND_COLLAPSE, True):
        fused = _passes(ModelRunner(model, num_pages=16, num_slots=3, page_rows=16), PROMPTS, 2)
    layers = len(model.weights.layers)  # 2 rounds, each 2 a layer but the last layer's 1
    assert counted.grids == [(3, 1)] * 2 * (2 * layers - 1)
    for f, p in zip(fused, plain):
        assert torch.equal(f, p)


@pytest.mark.parametrize("joint", [True, False])
def test_kda_gates_maps_in_one_launch_match_the_torch_path_and_a_stream_alone(
    joint, kernels_on_cpu, kda_model, monkeypatch
):
    """GATE_MAPS_IN_ONE_LAUNCH, both values. Heads of 64 (D = 128, as GLM-5.3-Flash's multiple
    of 128): f_b and g_b take one launch (linear_groups), or two linears; the logits match the
    torch path's, and each stream's in the pass equal its own."""
    from tensorfold.engine.runner import ModelRunner
    from tensorfold.ops import gpu, triton_linear

    model = kda_model(torch.float32, head_dim=64)
    calls = []
    one_launch = triton_linear.linear_groups
    monkeypatch.setattr(
        triton_linear, "linear_groups", lambda *a: calls.append(a[1].shape) or one_launch(*a)
    )
    with switches.switched(switches.GATE_MAPS_IN_ONE_LAUNCH, joint):
        together = _passes(ModelRunner(model, num_pages=16, num_slots=3, page_rows=16), PROMPTS, 1)
        assert calls == [(256, 64)] * 2 * joint  # the prompt pass, the decode round
        for i, prompt in enumerate(PROMPTS):
            runner = ModelRunner(model, num_pages=16, num_slots=3, page_rows=16)
            for a, t in zip(_passes(runner, [prompt], 1), together):
                assert torch.equal(a[0], t[i])
    gpu.set_triton(False)
    want = _passes(ModelRunner(model, num_pages=16, num_slots=3, page_rows=16), PROMPTS, 1)
    for g, w in zip(together, want):
        assert rel(g, w) < 5e-5


LONG = [(7 * i + 3) % 90 + 3 for i in range(316)]


@pytest.mark.parametrize(
    "firsts, nexts, rows",
    [
        (
            [[5, 6, 7, 8, 9, 10, 11], [20, 21, 22, 23, 24], []],
            [[12], [25, 26, 27, 28, 29, 30], [40, 41, 42, 43, 44, 45, 46, 47, 48]],
            32,
        ),
        # whole 64-row KDA chunks (kda_launches.py): a decode row after a chunk, a prompt resumed
        # at 64 crossing the boundary at 128, and a fresh prompt of a chunk and 2 rows (2 rows
        # past a boundary make a recurrent run of several rows, as more would)
        ([LONG[:66], LONG[100:164], []], [[12], LONG[164:230], LONG[250:316]], 256),
    ],
    ids=["short", "chunks"],
)
def test_kda_model_through_the_kernels_together_equals_alone(
    firsts, nexts, rows, kernels_on_cpu, kda_model, own_recurrent
):
    """A decode row, a prompt's next rows and a fresh prompt: in one pass as alone."""
    from tensorfold.engine.runner import ModelRunner, open_stream

    model = kda_model(torch.bfloat16)

    def run(together: bool) -> list[torch.Tensor]:
        runners = [ModelRunner(model, num_pages=3 * rows // 16, num_slots=3, page_rows=16)]
        if not together:
            runners *= 3
        streams = [open_stream(runners[0], i, rows) for i in range(3)]
        for s, first in zip(streams, firsts):
            if first:
                runners[0].run([s.rows(first)])
        if together:
            return runners[0].run([s.rows(n, "all") for s, n in zip(streams, nexts)])
        return [runners[0].run([s.rows(n, "all")])[0] for s, n in zip(streams, nexts)]

    for joint, alone in zip(run(True), run(False)):
        assert torch.equal(joint, alone)


def test_graph_runner_decode_rounds_equal_plain_passes(kernels_on_cpu, kda_model, own_recurrent):
    from tensorfold.engine.cuda_graphs import GraphRunner
    from tensorfold.engine.runner import ModelRunner

    model = kda_model(torch.bfloat16)
    plain = _passes(ModelRunner(model, num_pages=16, num_slots=3, page_rows=16), PROMPTS, 2)
    runner = GraphRunner(model, num_pages=16, num_slots=4, page_rows=16, max_pages=4)
    graphed = _passes(runner, PROMPTS, 2)
    assert runner.replays == 2 and list(runner.graphs) == [(4, 1)]  # 3 streams in the bucket of 4
    for g, p in zip(graphed, plain):
        assert torch.equal(g, p)
