"""Drafting end to end on one GPU (issue 57): verify rounds fed oracle drafts against plain
decoding, through the lanes and a graph runner, for one family's speed shape (dummy bf16
weights, bench/verify_rows.py's `build`).

Oracle drafts are the tokens of a recorded plain run, each replaced by another token with
probability 1 - p (seeded), proposed by position (a stream that has generated t tokens is offered
the corrupted run's tokens t, t + 1, ...), through the lanes' draft-model path (`OracleDrafter`):
a request's prediction would re-sync by content after each rejection, which on a dummy model's
repetitive output can land on the wrong place and measure the re-sync rather than p. For p in {1, 0.8, 0.5, 0} at k = 4 with the
per-stream policy on, p = 0 with it off (what the policy saves), p = 1 at k = 2, 8 and 16, and
n-gram drafts: decode tokens/s against plain, the drafts kept, and whether every run's tokens
equal plain's (greedy, and seeded at temperature 0.8 with top_p and every penalty on), at one
stream and at eight (all predicted, and half of them); with --sweep, plain and p = 0.8 at each
stream count it names (where drafting stops paying as the batch grows). Prints a table and
writes results.json.

    python bench/draft_speed.py --out $OUT --family lfm2_moe --commit $(git rev-parse --short HEAD)
    python bench/draft_speed.py --out $OUT --family lfm2_moe --sweep 1,2,4,8,16,32
    python bench/draft_speed.py --smoke    # each family's smoke shape on the CPU
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Sequence

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.verify_rows import FAMILIES, SHAPE_NAMES, build, run_families  # noqa: E402
from tensorfold.engine.drafts import DraftSettings  # noqa: E402
from tensorfold.engine.lanes import Lanes  # noqa: E402
from tensorfold.engine.requests import Finished, Request, TokenOut  # noqa: E402
from tensorfold.engine.runner import ModelRunner  # noqa: E402
from tensorfold.engine.sampling import SamplingParams  # noqa: E402
from tensorfold.family.drafter import DraftAsk  # noqa: E402

PAGE_ROWS = 512
GREEDY = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
SEEDED = SamplingParams(
    temperature=0.8,
    top_p=0.9,
    seed=11,
    presence_penalty=0.5,
    frequency_penalty=0.3,
    repetition_penalty=1.1,
    max_tokens=16,
    ignore_eos=True,
)


@dataclass
class Stream:
    tokens: list[int] = field(default_factory=list)
    first: float | None = None
    done: float | None = None
    end: Finished | None = None

    def sink(self, event: Any) -> None:
        now = time.perf_counter()
        if isinstance(event, TokenOut):
            self.first = self.first or now
            self.tokens.append(event.token)
        elif isinstance(event, Finished):
            self.done, self.end = now, event


@dataclass
class Outcome:
    tokens: list[list[int]]
    decode_tok_s: float  # tokens after each stream's first, over the time they took together
    drafted: int
    accepted: int
    passes: int


class OracleDrafter:
    """Drafts by position from each request's oracle run (a ModelDrafter): the stream whose
    next token is its t-th output token is offered oracle[t + 1 : t + 1 + k]."""

    def __init__(self, oracles: dict[int, Sequence[int]]) -> None:
        self.oracles = oracles  # id(request) -> its corrupted run
        self.lanes: Lanes | None = None

    def propose(self, asks: Sequence[DraftAsk], k: int) -> list[list[int]]:
        assert self.lanes is not None
        by_slot = {s.slot: s for s in self.lanes.live}
        out = []
        for ask in asks:
            live = by_slot[ask.slot]
            t = len(live.generated)  # the next token fed is output token t - 1
            out.append(list(self.oracles.get(id(live.req), ())[t : t + k]))
        return out


def run(
    runner: ModelRunner,
    prompts: Sequence[list[int]],
    params: SamplingParams,
    predictions: Sequence[Sequence[int]] | None,
    drafts: DraftSettings,
    oracle: bool = False,
) -> Outcome:
    """Plain or drafted decoding of `prompts`; predictions: each request's prediction, or with
    `oracle` its oracle run (drafted by position, `drafts.source` set to "model")."""
    drafter = OracleDrafter({}) if oracle else None
    if drafter is not None:
        drafts = replace(drafts, source="model")
    lanes = Lanes(runner, lanes=len(prompts), window=8192, drafts=drafts, model_drafter=drafter)
    streams = [Stream() for _ in prompts]
    for i, (prompt, s) in enumerate(zip(prompts, streams)):
        given = tuple(predictions[i]) if predictions and predictions[i] else ()
        req = Request(list(prompt), params, s.sink, prediction=() if drafter else given)
        if drafter is not None:
            drafter.oracles[id(req)], drafter.lanes = given, lanes
        lanes.add(req)
    passes = lanes.passes
    while lanes.step():
        pass
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    assert lanes.uneven == 0 and lanes.pool.census().idle_even, lanes.pool.census().line()
    first = min(s.first for s in streams if s.first is not None)
    last = max(s.done for s in streams if s.done is not None)
    after_first = sum(len(s.tokens) - 1 for s in streams)
    return Outcome(
        [s.tokens for s in streams],
        after_first / max(last - first, 1e-9),
        lanes.tokens_drafted,
        lanes.drafts_accepted,
        lanes.passes - passes,
    )


def corrupt(tokens: list[int], p: float, vocab: int, seed: int) -> list[int]:
    """Each token kept with probability p, else replaced by another id."""
    rng = random.Random(seed)
    return [t if rng.random() < p else (t + 1 + rng.randrange(vocab - 1)) % vocab for t in tokens]


def measure(family: str, args: argparse.Namespace, device: str) -> dict[str, Any]:
    from tensorfold.engine.cuda_graphs import GraphRunner

    model = build(family, args.smoke, device, args.quantization)
    vocab = model.vocab_size
    rows = args.context + args.tokens + 32
    streams = max([8, *args.sweep])
    pages = streams * -(-rows // PAGE_ROWS) + 2
    runner_cls = GraphRunner if device == "cuda" else ModelRunner
    runner = runner_cls(model, num_pages=pages, num_slots=streams, page_rows=PAGE_ROWS)
    g = torch.Generator().manual_seed(1)
    prompts = [
        torch.randint(5, min(vocab, 5000), (args.context,), generator=g).tolist()
        for _ in range(streams)
    ]
    greedy = replace(GREEDY, max_tokens=args.tokens)
    seeded = replace(SEEDED, max_tokens=args.tokens)
    off = DraftSettings()

    def best_of_two(*a: Any) -> Outcome:
        """The second of two identical runs (the first compiles and captures)."""
        run(runner, *a)
        return run(runner, *a)

    res: dict[str, Any] = {"shape": "smoke" if args.smoke else SHAPE_NAMES[family]}
    rows_out = []
    plain1 = best_of_two(prompts[:1], greedy, None, off)
    answer = plain1.tokens[0]

    def row(name: str, out: Outcome, plain: Outcome, streams_n: int) -> None:
        rows_out.append(
            dict(
                name=name,
                streams=streams_n,
                tok_s=out.decode_tok_s,
                speedup=out.decode_tok_s / plain.decode_tok_s,
                drafted=out.drafted,
                accepted=out.accepted,
                passes=out.passes,
                equal=out.tokens == plain.tokens,
            )
        )

    row("plain", plain1, plain1, 1)
    # the verify path itself: every stream drafts k whenever its prediction proposes
    for p in (1.0, 0.8, 0.5, 0.0):
        prediction = corrupt(answer, p, vocab, seed=int(p * 100))
        out = best_of_two(
            prompts[:1], greedy, [prediction], DraftSettings(tokens=4, adaptive=False), True
        )
        row(f"forced, oracle p={p} k=4", out, plain1, 1)
    for k in (8, 16):
        out = best_of_two(prompts[:1], greedy, [answer], DraftSettings(tokens=k, adaptive=False))
        row(f"forced, prediction = answer, k={k}", out, plain1, 1)
    # the policy, priced as serve prices it (warm_up.price_verify_passes)
    prices = getattr(runner, "pass_prices", lambda k: None)(16) or (1.0, ())
    res["pass_cost"], res["verify_costs"] = prices
    priced: dict[str, Any] = dict(pass_cost=prices[0], verify_costs=prices[1])
    for p in (1.0, 0.8, 0.0):
        prediction = corrupt(answer, p, vocab, seed=int(p * 100))
        out = best_of_two(
            prompts[:1], greedy, [prediction], DraftSettings(tokens=4, **priced), True
        )
        row(f"policy, oracle p={p} k=4", out, plain1, 1)
    out = best_of_two(prompts[:1], greedy, [answer], DraftSettings(tokens=16, **priced))
    row("policy, prediction = answer, k=16", out, plain1, 1)
    out = best_of_two(prompts[:1], greedy, None, DraftSettings("ngram", 4, adaptive=False))
    row("forced, ngram k=4", out, plain1, 1)
    plain_s = best_of_two(prompts[:1], seeded, None, off)
    for p in (1.0, 0.8):
        prediction = corrupt(plain_s.tokens[0], p, vocab, seed=7)
        settings = DraftSettings(tokens=4, adaptive=False)
        out = best_of_two(prompts[:1], seeded, [prediction], settings, True)
        row(f"forced, seeded, oracle p={p} k=4", out, plain_s, 1)
    every, prompts = prompts, prompts[:8]
    plain8 = best_of_two(prompts, greedy, None, off)
    row("plain", plain8, plain8, len(prompts))
    oracle = [corrupt(t, 0.8, vocab, seed=i) for i, t in enumerate(plain8.tokens)]
    forced = DraftSettings(tokens=4, adaptive=False)
    out = best_of_two(prompts, greedy, oracle, forced, True)
    row("forced, oracle p=0.8 k=4", out, plain8, len(prompts))
    half = [o if i % 2 else [] for i, o in enumerate(oracle)]
    out = best_of_two(prompts, greedy, half, forced, True)
    row("forced, oracle p=0.8 k=4, half the streams", out, plain8, len(prompts))
    out = best_of_two(prompts, greedy, oracle, DraftSettings(tokens=4, **priced), True)
    row("policy, oracle p=0.8 k=4", out, plain8, len(prompts))
    for b in args.sweep:  # where drafting stops paying as the batch grows (p = 0.8, k = 4)
        plain_b = best_of_two(every[:b], greedy, None, off)
        row("sweep: plain", plain_b, plain_b, b)
        oracle = [corrupt(t, 0.8, vocab, seed=i) for i, t in enumerate(plain_b.tokens)]
        out = best_of_two(every[:b], greedy, oracle, forced, True)
        row("sweep: forced, oracle p=0.8 k=4", out, plain_b, b)
        out = best_of_two(every[:b], greedy, oracle, DraftSettings(tokens=4, **priced), True)
        row("sweep: policy, oracle p=0.8 k=4", out, plain_b, b)
    res["rows"] = rows_out
    res["context"], res["tokens"] = args.context, args.tokens
    return res


def table(family: str, res: dict[str, Any]) -> str:
    lines = [
        f"{family} ({res['shape']}, prompts of {res['context']}, {res['tokens']} tokens each)",
        f"{'run':<38} {'streams':>7} {'tok/s':>9} {'x plain':>8} {'kept/drafted':>13} "
        f"{'passes':>7} {'== plain':>9}",
    ]
    for r in res["rows"]:
        kept = f"{r['accepted']}/{r['drafted']}"
        lines.append(
            f"{r['name']:<38} {r['streams']:>7} {r['tok_s']:>9.1f} {r['speedup']:>8.2f} "
            f"{kept:>13} {r['passes']:>7} {str(r['equal']):>9}"
        )
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=None)
    ap.add_argument("--commit", default="unknown")
    ap.add_argument("--family", default="all", choices=("all", *FAMILIES))
    ap.add_argument("--context", type=int, default=None, help="each prompt's tokens")
    ap.add_argument("--tokens", type=int, default=None, help="tokens each stream decodes")
    ap.add_argument(
        "--sweep", default="", help="stream counts to run plain and p = 0.8 at, e.g. 1,4,16,32"
    )
    ap.add_argument("--smoke", action="store_true", help="smoke shapes on the CPU, torch ops")
    ap.add_argument(
        "--quantization",
        default="auto",
        choices=("auto", "fp8"),
        help="fp8: the linears in fp8 with 128 x 128 block scales (as --quantization fp8)",
    )
    args = ap.parse_args()
    args.sweep = [int(b) for b in args.sweep.split(",") if b]
    device = "cpu" if args.smoke else "cuda"
    if args.smoke:
        torch.set_num_threads(1)
    args.context = args.context or (24 if args.smoke else 512)
    args.tokens = args.tokens or (12 if args.smoke else 256)
    run_families(args, device, measure, table)


if __name__ == "__main__":
    main()
