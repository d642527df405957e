"""Helpers for families' tests (ours and third parties'): an engine on a checkpoint on the CPU
in fp32, closed with the census checked, and the gates' common moves."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Sequence

from .llm import LLM
from .sampling import SamplingParams

CPU_DEFAULTS: dict[str, Any] = {
    "device": "cpu", "dtype": "float32", "memory_limit_gib": 0.25, "prompt_cache_gib": 0,
}


def open_llm(family: str, model: Path, **flags: Any) -> LLM:
    """An engine on the CPU in fp32, with a small memory budget; flags override."""
    return LLM(family=family, model=model, **{**CPU_DEFAULTS, **flags})


def close_even(llm: LLM) -> None:
    """Stop the engine; the census must be even once idle, and nothing ever logged UNEVEN."""
    lanes = llm.served.engine.lanes
    llm.close()
    census = lanes.pool.census()
    assert lanes.uneven == 0, f"{lanes.uneven} uneven censuses"
    assert census.idle_even, census.line()


def tokens(llm: LLM, prompts: Sequence[Any], params: SamplingParams) -> list[list[int]]:
    return [c.token_ids for c in llm.generate(prompts, params)]


def run_chats(
    llm: LLM, users: Sequence[Sequence[str]], params: SamplingParams
) -> tuple[list[list[list[int]]], list[list[int]]]:
    """Chats turn by turn, each turn's requests at once; users[c][t] is chat c's turn t.
    Returns each turn's replies (token ids) and cached prompt tokens, by chat."""
    histories: list[list[dict]] = [[] for _ in users]
    replies, cached = [], []
    for t in range(len(users[0])):
        for c, turns in enumerate(users):
            histories[c].append({"role": "user", "content": turns[t]})
        done = llm.chat(histories, params)
        replies.append([d.token_ids for d in done])
        cached.append([d.cached_tokens for d in done])
        for c, d in enumerate(done):
            histories[c].append({"role": "assistant", "content": d.text})
    return replies, cached
