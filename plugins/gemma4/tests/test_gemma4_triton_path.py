"""gemma4's GPU path on the CPU (tensorfold.ops.gpu.set_triton(True, on_cpu=True), Triton under
TRITON_INTERPRET=1): its kernels (triton_ops.py) against the torch references of ops.py, row by
row invariant; the whole tiny model against its CPU path; and concurrent == solo, bit for bit, on
that path, with decode rounds through a GraphRunner's static pass (PassMeta, as under graphs)."""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

pytest.importorskip("triton", reason="the Triton kernels need triton")

from tensorfold import testing  # noqa: E402
from tensorfold.engine.cuda_graphs import GraphRunner  # noqa: E402
from tensorfold.engine.runner import ModelRunner  # noqa: E402
from tensorfold.family.forward_pass import StreamRows  # noqa: E402
from tensorfold.ops import gpu  # noqa: E402
from tensorfold_gemma4 import ops, triton_ops  # noqa: E402
from tensorfold_gemma4.config import FULL, SLIDING, Gemma4Config  # noqa: E402
from tensorfold_gemma4.dummy import CONFIGS, build_dummy  # noqa: E402

S, F = SLIDING, FULL
TINY = {  # the 26B's layout at toy widths: k_eq_v, the MoE beside the MLP, window 16
    **CONFIGS["Gemma-4-26B-A4B"],
    "vocab_size": 384,
    "hidden_size": 64,
    "intermediate_size": 96,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "global_head_dim": 32,
    "num_global_key_value_heads": 1,
    "layer_types": [S, S, F, S],
    "sliding_window": 16,
    "num_experts": 8,
    "top_k_experts": 2,
    "moe_intermediate_size": 32,
}
E_STYLE = {  # per-layer inputs, KV sharing with the double-wide MLP, no MoE
    **TINY,
    "layer_types": [S, F, S, F],
    "enable_moe_block": False,
    "num_kv_shared_layers": 2,
    "use_double_wide_mlp": True,
    "hidden_size_per_layer_input": 8,
    "vocab_size_per_layer_input": 384,
}
SHAPES = {"a26b_style": TINY, "e_style": E_STYLE}


@pytest.fixture(autouse=True, scope="module")
def _gpu_path_on_cpu():
    """The GPU path on CPU tensors, and the GPU's bf16 rounding (round to nearest even) in the
    interpreter, which otherwise truncates (as tests/test_triton_kernels.py does)."""
    torch_threads = torch.get_num_threads()
    torch.set_num_threads(1)
    with testing.interpreter_rounds_like_the_gpu():
        yield
    torch.set_num_threads(torch_threads)
    gpu.set_triton(True, on_cpu=False)


def randn(*shape: int, seed: int, dtype: torch.dtype, scale: float = 1.0) -> torch.Tensor:
    return (torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * scale).to(dtype)


def close(got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype) -> None:
    """fp32: within a few ulps; bf16: within one bf16 step (rsqrt and tanh differ in the last
    fp32 bit from torch's, which may move a bf16 rounding)."""
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    err = (got.double() - want.double()).abs() / want.double().abs().clamp_min(1.0)
    assert err.max() <= tol, float(err.max())


def row_invariant(fn, *inputs: torch.Tensor) -> None:
    """Row 3 alone gives the bits it gives among all rows."""
    full = fn(*inputs)
    alone = fn(*(t[3:4] for t in inputs))
    for f, a in zip(
        full if isinstance(full, tuple) else (full,),
        alone if isinstance(alone, tuple) else (alone,),
    ):
        if f is not None:
            assert torch.equal(f[3:4], a)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_norms_match_reference_and_are_row_invariant(dtype: torch.dtype) -> None:
    x = randn(9, 3, 48, seed=1, dtype=dtype, scale=3.0)  # per head: [N, heads, D]
    w = randn(48, seed=2, dtype=dtype).float() * 0.3 + 1.0
    for weight in (w, None):
        gpu.set_triton(False)
        want = ops.rms_norm(x, weight, 1e-6)
        gpu.set_triton(True, on_cpu=True)
        got = ops.rms_norm(x, weight, 1e-6)
        assert got.dtype == dtype and got.shape == x.shape
        close(got, want, dtype)
        row_invariant(lambda t, weight=weight: triton_ops.rms_norm(t, weight, 1e-6), x)
        wide = randn(9, 7, 48, seed=3, dtype=dtype, scale=3.0)  # heads 2..4 of wider rows, in place
        assert torch.equal(
            triton_ops.rms_norm(wide[:, 2:5], weight, 1e-6),
            triton_ops.rms_norm(wide[:, 2:5].contiguous(), weight, 1e-6),
        )


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_residuals_match_the_layer_steps(dtype: torch.dtype) -> None:
    h, a, e = (randn(7, 40, seed=s, dtype=dtype, scale=2.0) for s in (3, 4, 5))
    wa, we, wp, wn = (randn(40, seed=s, dtype=torch.float32) * 0.2 + 1.0 for s in (6, 7, 8, 9))
    scale = torch.tensor([0.75]).to(dtype)
    cases = [  # post-attention; post-FFN with the MoE; without; the per-layer input's add
        dict(wa=wa, wnext=wn),
        dict(wa=wa, e=e, we=we, wpost=wp, scale=scale, wnext=wn),
        dict(wa=wa, scale=scale),
        dict(scale=scale, wnext=wn),
        dict(wa=wa, e=e, we=we, wpost=wp),
    ]
    for kw in cases:
        gpu.set_triton(False)
        want = ops.residual(h, a, 1e-6, **kw)
        gpu.set_triton(True, on_cpu=True)
        got = ops.residual(h, a, 1e-6, **kw)
        for g, w_ in zip(got, want):
            assert (g is None) == (w_ is None)
            if g is not None:
                close(g, w_, dtype)
        kw_e = {k: v for k, v in kw.items() if k != "e"}
        if "e" in kw:
            row_invariant(
                lambda h_, a_, e_: triton_ops.residual(h_, a_, 1e-6, e=e_, **kw_e), h, a, e
            )
        else:
            row_invariant(lambda h_, a_: triton_ops.residual(h_, a_, 1e-6, **kw_e), h, a)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_residual_with_the_router_inputs_matches_the_steps_and_router_input(dtype) -> None:
    """The post-attention residual with the MoE's router and experts' inputs in its launch: the
    torch steps within rounding, the residual's own outputs' bits, triton_route.router_input's
    z and xe from h' within rounding, and a row alone as among others."""
    from tensorfold.ops import triton_route

    h, a = (randn(7, 40, seed=s, dtype=dtype, scale=2.0) for s in (13, 14))
    wa, wn, pre = (randn(40, seed=s, dtype=torch.float32) * 0.2 + 1.0 for s in (15, 16, 17))
    rs = (randn(40, seed=18, dtype=torch.float32) * 0.2 + 1.0).to(dtype)
    kw = dict(wa=wa, wnext=wn, router_scale=rs, const=40**-0.5, pre_norm=pre)
    gpu.set_triton(False)
    want = ops.residual_router(h, a, 1e-6, **kw)
    gpu.set_triton(True, on_cpu=True)
    got = ops.residual_router(h, a, 1e-6, **kw)
    for g, w_ in zip(got, want):
        close(g, w_, dtype)
    plain = triton_ops.residual(h, a, 1e-6, wa=wa, wnext=wn)
    assert torch.equal(got[0], plain[0]) and torch.equal(got[1], plain[1])
    for g, w_ in zip(got[2:], triton_route.router_input(got[0], 1e-6, rs, 40**-0.5, pre)):
        close(g, w_, dtype)
    row_invariant(lambda h_, a_: triton_ops.residual_router(h_, a_, 1e-6, **kw), h, a)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gelu_and_softcap_match_reference(dtype: torch.dtype) -> None:
    a, b = randn(5, 300, seed=10, dtype=dtype, scale=4.0), randn(5, 300, seed=11, dtype=dtype)
    logits = randn(3, 1000, seed=12, dtype=dtype, scale=40.0)
    gpu.set_triton(False)
    want = ops.gelu_tanh(a), ops.gelu_mul(a, b), ops.softcap_float(logits, 30.0)
    gpu.set_triton(True, on_cpu=True)
    got = ops.gelu_tanh(a), ops.gelu_mul(a, b), ops.softcap_float(logits, 30.0)
    for g, w in zip(got, want):
        assert g.dtype == w.dtype
        close(g, w, dtype)
    assert got[2].dtype == torch.float32 and got[2].abs().max() <= 30.0
    row_invariant(triton_ops.gelu_mul, a, b)


def tiny_model(name: str, dtype: torch.dtype):
    return build_dummy(Gemma4Config.from_dict(SHAPES[name]), "cpu", dtype, seed=3, std=0.1)


def prompt(n: int, seed: int) -> list[int]:
    return torch.randint(3, 384, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def run_path(model, tokens: list[int], steps: list[int], *, triton: bool) -> torch.Tensor:
    """Logits of every prompt row, then of each decode step's row: [len + steps, V]."""
    gpu.set_triton(triton, on_cpu=triton)
    runner = ModelRunner(model, num_pages=2, num_slots=1, page_rows=512)
    (first,) = runner.run([StreamRows(0, 0, tokens, [0], "all")])
    rows = [first]
    for i, t in enumerate(steps):
        rows += runner.run([StreamRows(0, len(tokens) + i, [t], [0], "last")])
    gpu.set_triton(True, on_cpu=True)
    return torch.cat(rows)


@pytest.mark.parametrize(
    "name, dtype",
    [("a26b_style", torch.float32), ("a26b_style", torch.bfloat16), ("e_style", torch.float32)],
)
def test_gpu_path_matches_the_cpu_path(name: str, dtype: torch.dtype) -> None:
    """fp32: every row within 1e-4. bf16: the two paths round in different places (fused
    kernels, fp32 accumulators), and a rounding that flips a router's close top-k choice moves
    that row further, so the median row within 4e-2 and every row within 0.3."""
    model = tiny_model(name, dtype)
    tokens, steps = prompt(24, 1), prompt(2, 2)  # past the window of 16
    cpu = run_path(model, tokens, steps, triton=False)
    got = run_path(model, tokens, steps, triton=True)
    assert torch.isfinite(got).all()
    err = (got - cpu).norm(dim=-1) / cpu.norm(dim=-1)
    if dtype == torch.float32:
        assert err.max() < 1e-4, float(err.max())
        assert torch.equal(got.argmax(-1), cpu.argmax(-1))
    else:
        assert err.median() < 4e-2 and err.max() < 0.3, err


def test_concurrent_equals_solo_on_the_gpu_path() -> None:
    """bf16 on the GPU path: three streams prefilled apart, then decoding together through a
    GraphRunner's static pass (its per-stream layout from PassMeta only; three streams in the
    bucket of four, one padded), give the bits each gives decoding alone; a prompt pass beside a
    decode row changes neither."""
    gpu.set_triton(True, on_cpu=True)
    model = tiny_model("a26b_style", torch.bfloat16)
    prompts = [prompt(n, 10 + n) for n in (5, 18, 20)]  # inside, past and past the window of 16

    def decode(together: list[int], steps: int = 2) -> dict[int, list[torch.Tensor]]:
        runner = GraphRunner(model, num_pages=3, num_slots=4, page_rows=512, capture=False)
        nxt = {}
        for i in together:
            (logits,) = runner.run([StreamRows(i, 0, prompts[i], [i], "last")])
            nxt[i] = int(logits[-1].argmax())
        out: dict[int, list[torch.Tensor]] = {i: [] for i in together}
        for s in range(steps):
            rows = [StreamRows(i, len(prompts[i]) + s, [nxt[i]], [i], "last") for i in together]
            for i, logits in zip(together, runner.run(rows)):
                out[i].append(logits)
                nxt[i] = int(logits[-1].argmax())
        assert runner.replays == steps
        return out

    joint = decode([0, 1, 2])
    for i in range(3):
        alone = decode([i])[i]
        assert all(torch.equal(a, b) for a, b in zip(joint[i], alone)), f"stream {i}"
    # a decode row beside a prompt pass (eager, the prompt path's kernels)
    runner = ModelRunner(model, num_pages=3, num_slots=3, page_rows=512)
    runner.run([StreamRows(0, 0, prompts[2], [0], "last")])
    end = len(prompts[2])
    mixed = runner.run(
        [StreamRows(0, end, [7], [0], "last"), StreamRows(1, 0, prompts[1], [1], "all")]
    )
    solo = ModelRunner(model, num_pages=3, num_slots=3, page_rows=512)
    solo.run([StreamRows(0, 0, prompts[2], [0], "last")])
    (alone_row,) = solo.run([StreamRows(0, end, [7], [0], "last")])
    (alone_prompt,) = solo.run([StreamRows(1, 0, prompts[1], [1], "all")])
    assert torch.equal(mixed[0], alone_row) and torch.equal(mixed[1], alone_prompt)


@pytest.mark.parametrize(
    "name, dtype", [("a26b_style", torch.bfloat16), ("e_style", torch.float32)]
)
def test_fp8_rows_through_the_quantize_kernel_give_the_torch_quantizations_bits(
    name: str, dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch
) -> None:
    """TF_KV_DTYPE=fp8 on the GPU path: the full layers' page rows and the sliding layers' new
    ring rows quantized by the kernel (triton_kv_quant, K and V in one launch) give the logits
    they give quantized by the torch reference, bit for bit, past the window and decoding."""
    from tensorfold.ops import kv_quant, triton_kv_quant

    model = tiny_model(name, dtype)
    tokens, steps = prompt(24, 5), prompt(2, 6)

    def run() -> torch.Tensor:
        runner = ModelRunner(model, num_pages=2, num_slots=1, page_rows=512, kv_dtype="fp8")
        (first,) = runner.run([StreamRows(0, 0, tokens, [0], "all")])
        rows = [first]
        for i, t in enumerate(steps):
            rows += runner.run([StreamRows(0, len(tokens) + i, [t], [0], "last")])
        return torch.cat(rows)

    gpu.set_triton(True, on_cpu=True)
    launches = []
    real = triton_kv_quant.quantize_scatter
    monkeypatch.setattr(
        triton_kv_quant, "quantize_scatter", lambda *a: (launches.append(len(a[1])), real(*a))
    )
    got = run()
    owners = sum(1 for layer in Gemma4Config.from_dict(SHAPES[name]).layers if not layer.reuses_kv)
    assert launches == [2] * owners * (1 + len(steps))  # K and V together, one launch a layer
    monkeypatch.setattr(kv_quant, "use_triton", lambda t: False)  # the torch quantization
    want = run()
    assert torch.isfinite(got).all()
    assert torch.equal(got, want)
