"""Decode rounds sent ahead (`Lanes.ahead`: the next round fed on the device by this round's
draws before the host reads them; on by default on a GPU) change no token: the gates hold with
it on the CPU, and give what the same engines give with it off, while it was used for most
decode rounds. A stream that ends while a round it fed is in flight keeps its rows and state
as fed (resumed == fresh); cancelled streams, n choices and structured output go through it."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import pytest
import torch

from tensorfold import testing
from tensorfold.engine import lanes as lanes_module
from tensorfold.engine.requests import Finished, TokenOut
from tensorfold.engine.sampling import SamplingParams
from tensorfold_lfm2_moe.demo import build_demo

GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
SAMPLED = SamplingParams(temperature=0.8, seed=5, max_tokens=8, ignore_eos=True)


@pytest.fixture(scope="module")
def demo(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_demo(tmp_path_factory.mktemp("demo"))


# each family's demo, and its prompts' token range
FAMILIES = {"lfm2_moe": (5, 700), "gemma4": (13, 700), "glm5_next": (20, 800)}


@pytest.mark.parametrize("family", FAMILIES)
def test_gates_hold_with_rounds_sent_ahead_and_equal_them_without(
    family: str, tmp_path_factory: pytest.TempPathFactory
) -> None:
    """Concurrent == solo, pages == windows with poisoned pages, resumed == fresh (a stream's
    end kept with a round in flight: its rows and fixed state as fed), with and without."""
    lo, hi = FAMILIES[family]
    g = torch.Generator().manual_seed(11)
    prompts = [torch.randint(lo, hi, (n,), generator=g).tolist() for n in (9, 130, 300)]
    chats = [testing.chat_turns(c, turns=2, first=150, later=20) for c in range(3)]
    testing.assert_gates_sent_ahead_equal_plain(
        family,
        None,
        prompts,
        chats,
        GREEDY,
        SAMPLED,
        min_cached=100,
        context=4096,
        parallel=4,
        demo_cache=tmp_path_factory.mktemp(family),
    )


class _CancelAt:
    """A sink that cancels its request once it has `at` tokens (in the engine's thread)."""

    def __init__(self, engine: Any, at: int) -> None:
        self.engine, self.at = engine, at
        self.tokens: list[int] = []
        self.req: Any = None
        self.ready, self.done = threading.Event(), threading.Event()
        self.finished: Any = None

    def __call__(self, event: Any) -> None:
        if isinstance(event, TokenOut):
            self.tokens.append(event.token)
            if len(self.tokens) == self.at:
                self.ready.wait(10)  # submit has returned the request
                self.engine.cancel(self.req)
        elif isinstance(event, Finished):
            self.finished = event
            self.done.set()


def test_cancelled_streams_choices_and_grammars_with_rounds_sent_ahead(
    demo: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Among streams sent ahead: one cancelled mid-reply, n choices of a prompt, a JSON-schema
    reply; each gives what it gives with rounds sent ahead off, and the census is even."""
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    json_format = {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}
    long = SamplingParams(temperature=0, max_tokens=200, ignore_eos=True)
    runs = {}
    for ahead in (False, True):
        monkeypatch.setattr(lanes_module, "DECODE_AHEAD", ahead)
        llm = testing.open_llm("lfm2_moe", demo, parallel=4)
        try:
            lanes = llm.served.engine.lanes
            assert lanes.ahead == ahead
            sink = _CancelAt(llm.served.engine, 5)
            sink.req = llm.served.engine.submit([5, 6, 7, 8], long, sink)
            sink.ready.set()
            free = llm.generate([[9, 10, 11]], SAMPLED)
            shaped = llm.generate(
                ["Tell me"],
                SamplingParams(temperature=0.7, seed=3, max_tokens=24),
                response_format=json_format,
            )
            assert sink.done.wait(60)
            n = llm.generate(
                ["Seven purple violins"],
                SamplingParams(temperature=0.9, seed=11, max_tokens=8),
                n=3,
            )
            runs[ahead] = (
                sink.tokens,
                sink.finished.reason,
                [c.token_ids for c in free + shaped + n],
            )
            sent = lanes.sent_ahead
        finally:
            testing.close_even(llm)
        assert (sent > 0) == ahead
    assert runs[True] == runs[False]
    assert len(runs[True][0]) == 5 and runs[True][1] == "cancelled"


def test_states_kept_with_a_round_in_flight_resume_from_the_host_tier_as_fresh(
    demo: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Chats whose turns end with a round in flight (kept as fed, one row past the last
    token), evicted to the host tier and resumed from it: the replies of fresh runs, in fp8
    rows as in the model's dtype."""
    monkeypatch.setattr(lanes_module, "DECODE_AHEAD", True)
    chats = [testing.chat_turns(c, turns=3, first=60, later=20) for c in range(6)]
    for kv_dtype in ("auto", "fp8"):
        testing.assert_host_tier_resumes_as_fresh(
            "lfm2_moe", demo, chats, SAMPLED, kv_dtype=kv_dtype, context=4096
        )
