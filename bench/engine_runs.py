"""Driving the lanes and a runner directly (no engine thread, no server), with timings."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Sequence

import torch

from tensorfold.engine.lanes import Lanes
from tensorfold.engine.requests import Finished, Request, TokenOut
from tensorfold.engine.runner import ModelRunner
from tensorfold.engine.sampling import SamplingParams

GREEDY = dict(temperature=0, ignore_eos=True)


@dataclass
class Outcome:
    tokens: list[int] = field(default_factory=list)
    submitted: float = 0.0
    first: float | None = None
    done: float | None = None

    def sink(self, event) -> None:
        now = time.perf_counter()
        if isinstance(event, TokenOut):
            if self.first is None:
                self.first = now
            self.tokens.append(event.token)
        elif isinstance(event, Finished):
            self.done = now


@dataclass
class Run:
    outcomes: list[Outcome]
    decode_rounds: int = 0
    decode_tokens: int = 0
    decode_s: float = 0.0
    total_s: float = 0.0

    @property
    def decode_tokens_per_s(self) -> float:
        return self.decode_tokens / self.decode_s if self.decode_s else 0.0


def run_requests(
    runner: ModelRunner,
    prompts: Sequence[Sequence[int]],
    max_tokens: int,
    *,
    lanes: int,
    window: int,
    full: bool = False,
) -> Run:
    """All prompts submitted at once, greedy, stepped to the end. A round counts as decode
    when every live stream is decoding (full: and every prompt's stream is live, so the rounds
    while streams finish one by one do not count)."""
    ln = Lanes(runner, lanes=lanes, window=window)
    outcomes = [Outcome() for _ in prompts]
    params = SamplingParams(max_tokens=max_tokens, **GREEDY).with_seed()
    t0 = time.perf_counter()
    for p, o in zip(prompts, outcomes):
        o.submitted = time.perf_counter()
        ln.add(Request(list(p), params, o.sink))
    run = Run(outcomes)
    while True:
        decoding = (
            bool(ln.live)
            and not ln.waiting
            and all(not s.prefilling and s.next_token is not None for s in ln.live)
        )
        n = len(ln.live)
        decoding = decoding and (not full or n == len(prompts))
        a = time.perf_counter()
        if not ln.step():
            break
        if decoding:
            run.decode_rounds += 1
            run.decode_tokens += n
            run.decode_s += time.perf_counter() - a
    if runner.model.device.type == "cuda":
        torch.cuda.synchronize()
    run.total_s = time.perf_counter() - t0
    assert ln.uneven == 0 and ln.pool.census().idle_even, ln.pool.census().line()
    return run


def random_prompts(n: int, lengths: Sequence[int] | int, vocab: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    if isinstance(lengths, int):
        lengths = [lengths] * n
    return [torch.randint(10, vocab, (int(m),), generator=g).tolist() for m in lengths[:n]]
