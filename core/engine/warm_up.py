"""A warm-up before the first request: a few prompts and decode rounds through the lanes at start,
so that the first user's request does not wait for what a cold process does once: Triton
compiling each kernel for the device, fla-core autotuning its KDA kernels (glm5_next), the
decode rounds' CUDA graphs being captured.

It covers each row-count class the kernels pick tiles by (a few rows, a decode-sized pass, a
prompt pass of more than 256 rows, a whole pass of TF_PASS_ROWS), row counts that are and are
not multiples of 16 (Triton compiles those apart), prompts one at a time and packed, decode
rounds at two streams and at one, and a short prompt alone (its attention splits its keys). It
leaves nothing behind: the requests' tokens go nowhere, the prompt store is cleared (its pages
back in the pool: the census is checked), and the lanes' and the store's counters start from
zero, so /metrics and the status page count only real requests.
"""

from __future__ import annotations

import time
from dataclasses import replace
from typing import Any

import torch

from ..config.logs import get_logger
from .requests import Event, Finished, Request
from .sampling import SamplingParams

log = get_logger("tensorfold.warm_up")

# prompt lengths: one prompt of a full pass and 300 rows more (a whole pass, then a prompt pass
# of more than 256 rows whose length is no multiple of 16), then two packed (a decode-sized
# pass); then decode rounds at two streams and at one (the shorter reply ends first); then a
# short prompt alone: a pass of so few attention programs that they share its keys' segments
# (triton_key_split), as a chat's next turn after a long kept prefix does (without it, fp8
# rows of narrow heads would first compile that kernel mid-serving)
PAST_A_PASS = 300
PACKED = (40, 7)
ALONE = (3,)
REPLY = (6, 3)


def warm_up(lanes: Any, vocab: int) -> float:
    """Run the warm-up requests to the end on `lanes` (its engine thread not started yet);
    returns the seconds it took. Raises what a pass raises: a model that cannot run a pass
    should not start serving."""
    started = time.perf_counter()
    g = torch.Generator().manual_seed(0)
    events: list[Event] = []
    top = max(2, min(vocab, 1000))
    groups = ((lanes.pass_rows + PAST_A_PASS,), PACKED, ALONE)
    for group, lengths in enumerate(groups):
        for i, n in enumerate(lengths):
            n = max(1, min(n, lanes.window - REPLY[0] - 2))
            prompt = torch.randint(1, top, (n,), generator=g).tolist()
            params = SamplingParams(
                temperature=0, max_tokens=REPLY[i % len(REPLY)], ignore_eos=True
            )
            lanes.add(Request(prompt, params, events.append, id=f"warm-up-{group}-{i}"))
        while lanes.step():
            pass
    errors = [e.error for e in events if isinstance(e, Finished) and e.error]
    if errors:
        raise RuntimeError(f"the warm-up's passes failed: {errors[0]}")
    if lanes.sharing is not None:  # it kept states at the prompts' marks
        lanes.sharing.clear()
    lanes.passes = lanes.rows_cached = lanes.rows_computed = lanes.tokens_out = 0
    lanes.tokens_drafted = lanes.drafts_accepted = lanes.verify_rounds = 0
    if not lanes.census():
        raise RuntimeError("the warm-up left the pool uneven: " + lanes.pool.census().line())
    price_verify_passes(lanes)
    took = time.perf_counter() - started
    log.info(f"warm-up: kernels compiled and decode graphs captured in {took:.1f} s")
    return took


def price_verify_passes(lanes: Any) -> None:
    """The draft policy's prices where decode rounds replay CUDA graphs (GraphRunner.
    pass_prices): each replayed verify pass's cost over a decode round's, or the eager one's."""
    measure = getattr(lanes.runner, "pass_prices", None)
    prices = measure(lanes.max_drafts) if measure is not None else None
    if prices is None:
        return
    pass_cost, table = prices
    lanes.drafting = replace(lanes.drafting, pass_cost=max(1.0, pass_cost), verify_costs=table)
    if not table:
        log.info(
            f"verify passes run eagerly: {pass_cost:.1f} times a graphed decode pass; streams "
            "draft only where their drafts are kept often enough to pay for that"
        )
        return
    costs = ", ".join(f"{r} rows {c:.2f}" for r, c in table)
    log.info(f"verify passes replay graphs; their cost over a decode round: {costs}")
