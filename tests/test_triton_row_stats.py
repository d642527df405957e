"""The sampler's row kernel (ops/triton_row_stats.py) against its torch reference and torch's
log_softmax / argmax, under TRITON_INTERPRET=1 on the CPU; and the sampler through it: greedy
tokens as the torch path gives them, logprobs within rounding, each row as it is alone."""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest
import torch

pytest.importorskip("triton", reason="the Triton kernels need triton")

from tensorfold.engine import sampling  # noqa: E402
from tensorfold.engine.sampling import RowHistory, SamplingParams  # noqa: E402
from tensorfold.ops import gpu, triton_row_stats  # noqa: E402
from tensorfold.ops.triton_row_stats import BLOCK, row_stats, row_stats_reference  # noqa: E402


def logits(b: int, v: int, seed: int, dtype=torch.float32) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(b, v, generator=g) * 4).to(dtype)


@pytest.fixture
def triton_on_cpu():
    gpu.set_triton(True, on_cpu=True)
    yield
    gpu.set_triton(True, on_cpu=False)


@pytest.fixture(params=[None, 2 * BLOCK], ids=["one_program_a_row", "rows_in_chunks"])
def chunk(request, monkeypatch):
    """Rows in one program (CHUNK as shipped), or in chunks of 2 * BLOCK ids folded by the
    row's last program."""
    if request.param:
        monkeypatch.setattr(triton_row_stats, "CHUNK", request.param)
    return triton_row_stats.CHUNK


@pytest.mark.parametrize("v", [7, BLOCK, 3 * BLOCK + 5, 8 * BLOCK])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_row_stats_match_the_reference_and_log_softmax(v: int, dtype: torch.dtype, chunk) -> None:
    x = logits(3, v, seed=v, dtype=dtype)
    tok, both, top, log_sum = row_stats(x)
    rtok, rboth, rtop, rlog = row_stats_reference(x)
    xf = x.float()
    assert torch.equal(tok, rtok) and torch.equal(tok, xf.argmax(1))
    assert torch.equal(top, rtop) and torch.equal(top, xf.max(1).values)
    assert torch.allclose(log_sum, rlog, rtol=0, atol=1e-5)
    lsm = torch.log_softmax(xf, 1)
    assert torch.equal(both[:, 0], tok.double())
    assert torch.allclose(both[:, 1], lsm.gather(1, tok[:, None])[:, 0].double(), atol=1e-5)
    assert torch.allclose((xf - top[:, None]) - log_sum[:, None], lsm, atol=1e-5)


def test_row_stats_ties_go_to_the_lowest_id_across_lanes_and_steps(chunk) -> None:
    v = 2 * BLOCK + 9
    x = torch.zeros(4, v)
    x[0, [5, BLOCK + 5, 2 * BLOCK + 1]] = 3.0  # one lane, three steps: its first
    x[1, [BLOCK + 2, 7]] = 3.0  # two lanes: the lower id wins, though its lane is the higher
    x[2, :] = -1.0  # all equal: id 0
    x[3, [v - 1, v - 2]] = 9.0  # in the last, partial step
    tok, _, _, _ = row_stats(x)
    assert tok.tolist() == [5, 7, 0, v - 2] == x.argmax(1).tolist()


def test_a_row_alone_equals_the_row_in_a_batch(chunk) -> None:
    x = logits(5, 2 * BLOCK + 3, seed=11, dtype=torch.bfloat16)
    batch = row_stats(x)
    for i in range(5):
        alone = row_stats(x[i : i + 1].clone())
        for a, b in zip(alone, batch):
            assert torch.equal(a[0], b[i])


def _rows(params: list[SamplingParams]) -> list[tuple[SamplingParams, int, RowHistory]]:
    return [(p, 3, RowHistory([1, 2], [4])) for p in params]


def test_greedy_sampler_through_the_kernel_gives_the_torch_paths_tokens(triton_on_cpu) -> None:
    x = logits(4, 3 * BLOCK + 1, seed=3, dtype=torch.bfloat16)
    greedy = [SamplingParams(temperature=0)] * 4
    fast = sampling.read_rows(sampling.launch_rows(x, _rows(greedy)))
    gpu.set_triton(False)
    plain = sampling.read_rows(sampling.launch_rows(x, _rows(greedy)))
    assert [r.token for r in fast] == [r.token for r in plain]
    assert [r.logprob for r in fast] == pytest.approx([r.logprob for r in plain], abs=1e-5)


def test_mixed_rounds_give_each_row_what_it_gets_alone(triton_on_cpu) -> None:
    """A greedy row beside drawn, biased and top-logprob rows: its token and logprob bit for
    bit as alone (where the sampler takes the one-launch path), and every row's as alone."""
    x = logits(4, 2 * BLOCK + 7, seed=5, dtype=torch.bfloat16)
    params = [
        SamplingParams(temperature=0),
        SamplingParams(temperature=0.8, top_p=0.9).with_seed(),
        SamplingParams(temperature=0, logit_bias={3: 5.0}, logprobs=True, top_logprobs=3),
        SamplingParams(temperature=0, repetition_penalty=1.3),
    ]
    batch = sampling.read_rows(sampling.launch_rows(x, _rows(params)))
    for i, p in enumerate(params):
        alone = sampling.read_rows(sampling.launch_rows(x[i : i + 1].clone(), _rows([p])))[0]
        assert alone == batch[i]
    gpu.set_triton(False)
    plain = sampling.read_rows(sampling.launch_rows(x, _rows(params)))
    assert [r.token for r in batch] == [r.token for r in plain]
    for a, b in zip(batch, plain):
        assert a.logprob == pytest.approx(b.logprob, abs=1e-5)
        assert [t for t, _ in a.top_logprobs] == [t for t, _ in b.top_logprobs]
        assert [lp for _, lp in a.top_logprobs] == pytest.approx(
            [lp for _, lp in b.top_logprobs], abs=1e-5
        )


def test_the_kernel_path_takes_rows_of_any_stride(triton_on_cpu) -> None:
    """Logits whose ids are not unit-stride (a transposed view) sample as their copy does."""
    x = logits(3 * BLOCK + 1, 4, seed=9, dtype=torch.bfloat16).t()  # [4, V], stride (1, 4)
    for params in (
        [SamplingParams(temperature=0)] * 4,
        [SamplingParams(temperature=0, repetition_penalty=1.2)] * 4,
    ):
        strided = sampling.read_rows(sampling.launch_rows(x, _rows(params)))
        copied = sampling.read_rows(sampling.launch_rows(x.contiguous(), _rows(params)))
        assert strided == copied
