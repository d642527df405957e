"""fp8 weights wired into the ops' GPU path (issue 58), on the CPU under TRITON_INTERPRET=1 in
fp32 (the interpreter truncates fp32 -> bf16; the GPU suite checks bf16): ops.linear.linear,
linear_groups, ops.moe.gated_ffn and ops.moe.moe take the fp8 kernels of triton_fp8 for an
Fp8Weight (no dequantized copy made), each with the bits of the bf16 kernel over the
dequantized weight and within rounding of the dequantizing torch path; a weight whose column
blocks the kernels cannot read takes the dequantizing path; the kernels' in-register
dequantization is Fp8Weight.dequantize's, bit for bit; and lfm2_moe's model under
--quantization fp8 runs through the kernels alone and holds the pass-level gates."""

from __future__ import annotations

import os
from typing import Any, Iterator

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

pytest.importorskip("triton", reason="the Triton kernels need triton")

from tensorfold import testing  # noqa: E402
from tensorfold.ops import gpu, moe, triton_fp8, triton_linear, triton_moe  # noqa: E402
from tensorfold.ops.fp8 import Fp8Weight, quantize_blocks  # noqa: E402
from tensorfold.ops.linear import linear, linear_groups  # noqa: E402

F32 = torch.float32
TOL = 1e-5


def randn(*shape: int, seed: int, scale: float = 1.0) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * scale


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


@pytest.fixture
def kernels() -> Iterator[dict[str, int]]:
    """The ops take their Triton kernels for CPU tensors; counts of each fp8 kernel's launches
    and of Fp8Weight.dequantize's calls (the dequantizing path)."""
    with testing.fp8_kernel_counts(
        "linear_fp8", "linear_groups_fp8", "gated_ffn_fp8", "moe_fp8"
    ) as calls:
        yield calls


def torch_path(fn: Any, *args: Any, **kw: Any) -> Any:
    """fn on the CPU's torch path (the dequantizing reference), the kernels off meanwhile."""
    gpu.set_triton(False)
    try:
        return fn(*args, **kw)
    finally:
        gpu.set_triton(True, on_cpu=True)


def test_the_kernels_dequantize_in_registers_as_fp8weight_does() -> None:
    """The one dequantization: linear_fp8 of the identity is the weight the kernel multiplied
    by, Fp8Weight.dequantize's bits, in fp32 and (rounded as the GPU rounds) in bf16; and
    quantize_blocks on a stack is each matrix's."""
    w = randn(2, 136, 256, seed=0, scale=3.0)
    for block in ((128, 128), (1, 256), (136, 256)):
        f = quantize_blocks(w, block)
        one = quantize_blocks(w[1], block)
        assert torch.equal(f.q[1].view(torch.uint8), one.q.view(torch.uint8))
        assert torch.equal(f.scale[1], one.scale)
        for dtype in (F32, torch.bfloat16):
            eye = torch.eye(256, dtype=dtype)
            with testing.interpreter_rounds_like_the_gpu():
                got = triton_fp8.linear_fp8(eye, *triton_fp8.parts(one))
            assert torch.equal(got.t(), one.dequantize(dtype)), (block, dtype)


def test_linear_takes_the_fp8_kernel_with_the_bf16_kernels_bits(kernels) -> None:
    x = randn(9, 320, seed=1)
    w = quantize_blocks(randn(72, 320, seed=2, scale=0.1))
    b = randn(72, seed=3)
    got = linear(x, w, b)
    assert kernels["linear_fp8"] == 1 and kernels["dequantize"] == 0
    want = triton_linear.linear(x, Fp8Weight.dequantize(w, F32), b)
    assert torch.equal(got, want)
    assert rel(got, torch_path(linear, x, w, b)) < TOL
    assert torch.equal(linear(x[3:4].clone(), w, b), got[3:4])


def test_a_column_cut_off_the_blocks_dequantizes_and_gives_the_same_product(kernels) -> None:
    """A tensor-parallel cut of K off the 128 edges (scales (128, 1)): the kernels cannot read
    it, so the product dequantizes and runs the bf16 kernel: the same bits as the fp8 kernel
    on the whole weight's columns would give over the same values."""
    x = randn(5, 200, seed=4)
    w = quantize_blocks(randn(40, 264, seed=5, scale=0.1)).narrow(1, 64, 200)
    assert w.block == (128, 1)
    got = linear(x, w)
    assert kernels["linear_fp8"] == 0 and kernels["dequantize"] == 1
    assert torch.equal(got, triton_linear.linear(x, w.dequantize(F32)))


def test_linear_groups_take_the_fp8_launch(kernels) -> None:
    x = randn(6, 2 * 64, seed=6)
    w = quantize_blocks(randn(256, 64, seed=7, scale=0.1))
    got = linear_groups(x, w, 2)
    assert kernels["linear_groups_fp8"] == 1 and kernels["dequantize"] == 0
    assert torch.equal(got, triton_linear.linear_groups(x, Fp8Weight.dequantize(w, F32), 2))
    assert rel(got, torch_path(linear_groups, x, w, 2)) < TOL


def test_gated_ffn_takes_the_fp8_kernel(kernels) -> None:
    x = randn(7, 256, seed=8)
    gate_up = quantize_blocks(randn(2 * 136, 256, seed=9, scale=0.2))
    gate, up = triton_fp8.gate_and_up(gate_up, 136)  # up: views, 8 rows into row block 1
    assert gate.block == up.block == (128, 128) and (gate.row0, up.row0) == (0, 8)
    assert up.scale.data_ptr() == gate_up.scale[1].data_ptr()
    down = quantize_blocks(randn(256, 136, seed=10, scale=0.2))
    got = moe.gated_ffn(x, gate, up, down, act="silu_clamp", limit=0.5)
    assert kernels["gated_ffn_fp8"] == 1 and kernels["dequantize"] == 0
    plain = [Fp8Weight.dequantize(w, F32) for w in (gate, up, down)]
    assert torch.equal(got, triton_moe.gated_ffn(x, *plain, act="silu_clamp", limit=0.5))
    ref = torch_path(moe.gated_ffn, x, gate, up, down, act="silu_clamp", limit=0.5)
    assert rel(got, ref) < TOL


def test_fp8_products_launch_in_stream_order_and_bf16_ones_dependent(monkeypatch) -> None:
    """Launched with PDL, the products over fp8 weights ran slower (docs/performance.md,
    "FP8_DEPENDENT_LAUNCH"): the linear, the gated FFN and the experts ask launch_options for
    no dependent launch over fp8 weights, and for it over bf16 ones; and no fp8 weight is
    prefetched before a wait it does not have."""
    asked: list[tuple[str, bool]] = []

    def recorded(module: str) -> Any:
        def launch_options(t: torch.Tensor, dependent: bool = True) -> dict[str, bool]:
            asked.append((module, dependent))
            return gpu.launch_options(t, dependent)

        return launch_options

    monkeypatch.setattr(triton_linear, "launch_options", recorded("linear"))
    monkeypatch.setattr(triton_moe, "launch_options", recorded("moe"))
    x = randn(3, 256, seed=20)
    gate_up = quantize_blocks(randn(2 * 128, 256, seed=21, scale=0.2))
    gate, up = triton_fp8.gate_and_up(gate_up, 128)
    down = quantize_blocks(randn(256, 128, seed=22, scale=0.2))
    with testing.fp8_kernel_counts("linear_fp8", "gated_ffn_fp8"):
        linear(x, gate)
        moe.gated_ffn(x, gate, up, down)
        assert asked == [("linear", False), ("moe", False), ("moe", False)]
        asked.clear()
        plain = [Fp8Weight.dequantize(w, F32) for w in (gate, up, down)]
        linear(x, plain[0])
        moe.gated_ffn(x, *plain)
    assert asked == [("linear", True), ("moe", True), ("moe", True)]
    monkeypatch.setattr(gpu, "_prefetch_weights", True)
    monkeypatch.setattr(gpu, "launch_options", lambda t, dependent=True: {"PDL": dependent})
    assert gpu.prefetch_k(gate.q, 8) == 0
    assert gpu.prefetch_k(plain[0].bfloat16(), 8) > 0


@pytest.mark.parametrize("as_list", [False, True])
def test_moe_takes_the_fp8_kernel_on_stacks_and_sequences(kernels, as_list) -> None:
    """Expert stacks (lfm2_moe, gemma4) or sequences of an fp8 stack's experts (glm5_next's
    views): the bits of triton_moe.moe over the dequantized experts, slots summed or not."""
    e, i, h = 4, 136, 256
    w1, w3 = (quantize_blocks(randn(e, i, h, seed=s, scale=0.2)) for s in (11, 12))
    w2 = quantize_blocks(randn(e, h, i, seed=13, scale=0.2))
    x = randn(10, h, seed=14)
    weights, experts = torch_path(moe.route, x, randn(e, h, seed=15), None, 2, norm_topk_prob=True)
    ws: list[Any] = [[w[j] for j in range(e)] if as_list else w for w in (w1, w3, w2)]
    got = moe.moe(x, weights, experts, *ws)
    slots = moe.moe(x, weights, experts, *ws, sum_slots=False)
    assert kernels["moe_fp8"] == 2 and kernels["dequantize"] == 0
    plain = [Fp8Weight.dequantize(w, F32) for w in (w1, w3, w2)]
    assert torch.equal(got, triton_moe.moe(x, weights, experts, *plain))
    assert isinstance(slots, moe.SlotSum)
    assert torch.equal(slots.slots, triton_moe.moe(x, weights, experts, *plain, sum_slots=False))
    assert rel(got, torch_path(moe.moe, x, weights, experts, w1, w3, w2)) < TOL


# --- a family through the kernels under fp8: lfm2_moe at a tiny shape ---


def _tiny_fp8() -> Any:
    from dataclasses import replace

    dummy = pytest.importorskip("tensorfold_lfm2_moe.dummy")
    cfg = replace(
        dummy.SHAPES["LFM2-8B-A1B"],
        num_hidden_layers=2,
        layer_types=("conv", "full_attention"),
        vocab_size=256,
        hidden_size=64,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        intermediate_size=96,
        moe_intermediate_size=32,
        num_experts=4,
        num_dense_layers=1,
    )
    return dummy.build_dummy(cfg, "cpu", F32, seed=0, std=0.1, quantization="fp8")


def test_lfm2_under_fp8_runs_through_the_kernels_and_holds_the_gates(kernels) -> None:
    """Every fp8 product of a pass in the fp8 kernels (no weight dequantized), logits within
    rounding of the torch path's, and the pass-level gates at small sizes: streams decoding
    and prefilling together == alone, 16-row pages shuffled == one window, and pages another
    stream freed, NaN-poisoned, change nothing."""
    from tensorfold.engine.runner import ModelRunner, open_stream

    model = _tiny_fp8()
    assert sum(isinstance(w, Fp8Weight) for w in testing.weight_leaves(model.weights).values())
    tokens = [(7 * j) % 120 + 3 for j in range(48)]

    def runner(poison: bool = False, pages: int = 6) -> ModelRunner:
        return ModelRunner(model, num_pages=pages, num_slots=2, page_rows=16, poison=poison)

    def prompt_logits(r: ModelRunner) -> torch.Tensor:
        stream = open_stream(r, 0, 48)
        return r.run([stream.rows(tokens[:30], logits="all")])[0]

    got = prompt_logits(runner())
    assert kernels["dequantize"] == 0
    assert kernels["linear_fp8"] and kernels["gated_ffn_fp8"] and kernels["moe_fp8"]
    assert rel(got, torch_path(prompt_logits, runner())) < 5 * TOL
    kernels["dequantize"] = 0

    # concurrent == solo: stream 0 decodes a row, stream 1 prefills, in one pass and alone
    def together(joint: bool) -> list[torch.Tensor]:
        r = runner()
        a, b = open_stream(r, 0, 48), open_stream(r, 1, 48)
        r.run([a.rows(tokens[:20])])
        rows = [a.rows([tokens[20]], logits="all"), b.rows(tokens[5:30], logits="all")]
        return r.run(rows) if joint else [r.run([x])[0] for x in rows]

    assert all(torch.equal(j, s) for j, s in zip(together(True), together(False)))
    # pages == windows: the stream on shuffled 16-row pages, fed in three runs
    testing.assert_shuffled_pages_change_nothing(model, tokens, [0, 30, 31, 48], rows=16)

    # poisoned pages: a stream's freed pages NaN-filled change nothing for the next
    def after_another(poison: bool) -> torch.Tensor:
        r = runner(poison, pages=4)  # the next stream's 3 pages are mostly the freed ones
        gone = open_stream(r, 1, 48)
        r.run([gone.rows(list(range(3, 50)))])
        gone.lease.release()
        return prompt_logits(r)

    poisoned = after_another(True)
    assert torch.isfinite(poisoned).all() and torch.equal(poisoned, after_another(False))
    assert torch.equal(poisoned, got) and kernels["dequantize"] == 0
