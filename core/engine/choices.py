"""n choices of one prompt (OpenAI's `n`): each choice's seed.

Choice i samples as a single request seeded with `choice_seed(seed, i)` would: the request's
seed plus i, wrapping from 2**64 - 1 to 0 (vLLM derives its n choices' seeds the same way).
Choice 0 keeps the request's seed, so n = 1 is a plain request; when the request gives no seed,
one is drawn and reported, and it reproduces every choice. The lanes compute the prompt once and
fork the other choices from it (`tensorfold.engine.lanes`).
"""

from __future__ import annotations

from dataclasses import replace

from .sampling import SamplingParams

_WRAP = 2**64


def choice_seed(seed: int, i: int) -> int:
    """Choice i's seed: seed + i, kept in the seeds' range (-2**63..2**64-1) by wrapping."""
    derived = seed + i
    return derived - _WRAP if derived >= _WRAP else derived


def choice_params(params: SamplingParams, n: int) -> list[SamplingParams]:
    """The n choices' params: `params` seeded (a seed drawn if it has none), then choice i with
    choice_seed(seed, i)."""
    if n < 1:
        raise ValueError(f"n must be >= 1, got {n}")
    seeded = params.with_seed()
    assert seeded.seed is not None
    return [replace(seeded, seed=choice_seed(seeded.seed, i)) for i in range(n)]
