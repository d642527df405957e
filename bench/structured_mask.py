"""The per-step cost of structured output's token mask at 64 streams, on the lfm2_moe demo (CPU,
fp32, a 768-token vocabulary): a decode round of 64 free rows against one of 64 constrained rows
(each masked by its own llguidance matcher), and the masks alone. Prints a JSON dict.

    python -m bench.structured_mask            # docs/serving.md quotes its figures

Rounds are timed as (64 streams x (1 + ROUNDS) tokens) less (64 streams x 1 token), so the
prompt pass is not counted. CPU figures only: the GPU figure needs a device run.
"""

from __future__ import annotations

import json
import statistics
import tempfile
import time
from dataclasses import replace

import torch

from tensorfold.sampling import SamplingParams
from tensorfold.structured import json_schema, regex
from tensorfold.testing import close_even, open_llm

STREAMS = 64
ROUNDS = 32
REPEATS = 3


def _round_ms(llm, prompts, named: dict[str, SamplingParams]) -> dict[str, float]:
    """Each setting's decode round in ms; the settings take turns (other load on the machine
    falls on each alike), after one warm-up run each."""
    def run(params: SamplingParams, tokens: int) -> float:
        start = time.perf_counter()
        llm.generate(prompts, replace(params, max_tokens=tokens))
        return time.perf_counter() - start

    for params in named.values():
        run(params, 1 + ROUNDS)
    spans: dict[str, list[float]] = {name: [] for name in named}
    for _ in range(REPEATS):
        for name, params in named.items():
            spans[name].append(run(params, 1 + ROUNDS) - run(params, 1))
    return {name: statistics.median(s) / ROUNDS * 1e3 for name, s in spans.items()}


def main() -> None:
    demo = tempfile.mkdtemp(prefix="tf-structured-bench-")
    llm = open_llm("lfm2_moe", None, parallel=STREAMS, context=512, demo_cache=demo)
    try:
        tok = llm.tokenizer
        prompts = [f"Story {i}: the little engine" for i in range(STREAMS)]
        free = SamplingParams(temperature=1.0, seed=1, ignore_eos=True)
        constraints = {
            "regex": regex("[a-z ]{2000}", tok),
            "json_schema": json_schema({"type": "object", "properties": {"text": {
                "type": "string", "minLength": 2000}}, "required": ["text"]}, tok),
        }
        out: dict[str, object] = {"streams": STREAMS, "vocab": tok.vocab_size,
                                  "threads": torch.get_num_threads()}
        named = {name: replace(free, ignore_eos=False, constraint=c)
                 for name, c in constraints.items()}
        rounds = _round_ms(llm, prompts, {"free": free, **named})
        base = rounds["free"]
        out["free_round_ms"] = round(base, 3)
        for name, constraint in constraints.items():
            ms = rounds[name]
            out[f"{name}_round_ms"] = round(ms, 3)
            out[f"{name}_overhead_pct"] = round(100 * (ms - base) / base, 1)
            # the masks alone: 64 matchers, one mask each per step
            matchers = [constraint.start() for _ in range(STREAMS)]
            row = torch.zeros(tok.vocab_size)
            steps = []
            for _ in range(ROUNDS):
                start = time.perf_counter()
                masked = [m.mask(row) for m in matchers]
                steps.append(time.perf_counter() - start)
                for m, x in zip(matchers, masked):
                    m.accept(int(torch.argmax(x)))
            out[f"{name}_masks_ms_per_step"] = round(statistics.median(steps) * 1e3, 3)
        print(json.dumps(out, indent=1))
    finally:
        close_even(llm)


if __name__ == "__main__":
    main()
