"""The GPU suite's sampler checks (`pytest -m gpu`): on the device, a row sampled in a batch of 64
at a 65536-token vocabulary gets the token, logprob and top logprobs it gets alone, whatever its
neighbours ask for (greedy, temperature, top_k, top_p, min_p, penalties, bias); structured
output's masks applied to a batch give each row what its mask gives it alone."""

from __future__ import annotations

import random

import pytest
import torch

from tensorfold.engine.sampling import RowHistory, SamplingParams, sample_rows

pytestmark = pytest.mark.gpu

V = 65536


def _params(rng: random.Random) -> SamplingParams:
    return SamplingParams(
        temperature=rng.choice([0.0, 0.2, 0.7, 1.0, 1.5]),
        top_k=rng.choice([0, 1, 40, 1000]),
        top_p=rng.choice([1.0, 0.95, 0.5]),
        min_p=rng.choice([0.0, 0.02]),
        presence_penalty=rng.choice([0.0, 0.5]),
        repetition_penalty=rng.choice([1.0, 1.2]),
        logit_bias=rng.choice([{}, {7: 3.0}]),
        seed=rng.randrange(2**63),
        logprobs=True,
        top_logprobs=rng.choice([0, 3]),
    )


def test_a_row_samples_alike_alone_and_in_a_batch_of_64() -> None:
    rng = random.Random(0)
    g = torch.Generator().manual_seed(0)
    for trial in range(4):
        x = (torch.randn(64, V, generator=g) * rng.choice([1.0, 4.0])).to("cuda", torch.bfloat16)
        rows = [
            (
                _params(rng),
                rng.randrange(500),
                RowHistory(
                    [rng.randrange(V) for _ in range(9)], [rng.randrange(V) for _ in range(5)]
                ),
            )
            for _ in range(64)
        ]
        together = sample_rows(x, rows)
        for i in range(64):
            alone = sample_rows(x[i : i + 1], rows[i : i + 1])[0]
            assert alone == together[i], (trial, i, rows[i][0])
        pairs = sample_rows(x[10:12], rows[10:12])
        assert pairs == together[10:12]


def test_masks_apply_alike_alone_and_batched() -> None:
    from tensorfold.engine.structured import _unpack

    g = torch.Generator().manual_seed(1)
    words = torch.randint(-(2**31), 2**31 - 1, (8, V // 32), generator=g, dtype=torch.int64)
    words = words.to(torch.int32)
    on_gpu = _unpack(words.cuda(), V + 100, V - 5)
    on_cpu = _unpack(words, V + 100, V - 5)
    assert torch.equal(on_gpu.cpu(), on_cpu)
    assert not on_cpu[:, V - 5 :].any()
