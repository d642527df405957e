"""`tensorfold bench openai|concurrent`: clients of a running OpenAI-compatible server.

- openai: decode tokens/s and time to first token, the median over prompts and repeats.
- concurrent: the concurrency gate through the server. A fixed set of cases (prompts, greedy
  and seeded sampling) is sent at each level (that many requests at once); every reply must
  equal the same case's reply alone (--alone: each case sent by itself first; else the first
  level's). --serial sends every case once more, one after another, after the levels.

Replies are compared by token ids (vLLM's return_tokens_as_token_ids), text and finish reason.
Uses aiohttp's client.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
from typing import Any

from tensorfold.cli.bench_client import DEFAULT_URL, PROMPTS, Case, Client, Reply, cases
from tensorfold.config.settings import Settings


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="bench", metavar="BENCH", required=True)
    openai = sub.add_parser("openai", help="decode tokens/s and time to first token")
    concurrent = sub.add_parser("concurrent", help="replies at each level equal alone")
    cache = sub.add_parser("cache", help="cold and warm time to first token, one long prompt")
    from tensorfold.cli.bench_cache import add_arguments as add_cache_arguments

    add_cache_arguments(cache)
    for p in (openai, concurrent, cache):
        p.add_argument("--url", default=DEFAULT_URL, help="the server's /v1")
        p.add_argument("--api-key", metavar="KEY", help="sent as Authorization: Bearer KEY")
        p.add_argument("--json", action="store_true", help="also print the results as JSON")
    openai.add_argument(
        "--prompts",
        nargs="+",
        default=list(PROMPTS[:2]),
        metavar="TEXT",
        help="prompts to time, each sent --repeats times",
    )
    openai.add_argument("--max-tokens", type=int, default=256, help="tokens each reply generates")
    openai.add_argument(
        "--repeats", type=int, default=3, help="times each prompt is sent; the median is reported"
    )
    openai.add_argument("--temperature", type=float, default=0.0, help="sampling temperature")
    concurrent.add_argument("--levels", default="1,2,4,8", help="requests at once, e.g. 1,2,4,8")
    concurrent.add_argument(
        "--alone",
        action="store_true",
        help="compare with each case sent alone (else the first level)",
    )
    concurrent.add_argument(
        "--serial", action="store_true", help="also send every case once more, one after another"
    )
    concurrent.add_argument(
        "--max-tokens", type=int, default=32, help="tokens each reply generates"
    )


def run(args: argparse.Namespace, settings: Settings) -> int:
    from tensorfold.cli.commands import CommandError

    if args.max_tokens < 1 or getattr(args, "repeats", 1) < 1:
        raise CommandError("--max-tokens and --repeats must be >= 1")
    import aiohttp

    from tensorfold.cli.bench_cache import bench_cache

    bench = {"openai": bench_openai, "concurrent": bench_concurrent, "cache": bench_cache}[
        args.bench
    ]
    try:
        return asyncio.run(bench(args))
    except (OSError, aiohttp.ClientError) as exc:
        raise CommandError(f"cannot use {args.url}: {exc}") from None


async def bench_openai(args: argparse.Namespace) -> int:
    rows, failed = [], 0
    async with Client(args.url, args.api_key) as client:
        client.expect("bench openai", len(args.prompts) * args.repeats)
        for i, prompt in enumerate(args.prompts):
            case = Case(
                f"prompt{i}",
                "/completions",
                {
                    "prompt": prompt,
                    "max_tokens": args.max_tokens,
                    "logprobs": 0,
                    "temperature": args.temperature,
                    "seed": 0,
                    "ignore_eos": True,
                },
            )
            replies = [await client.run(case) for _ in range(args.repeats)]
            good = [r for r in replies if r.error is None and r.ttft is not None]
            failed += len(replies) - len(good)
            rates = [(len(r.token_ids) - 1) / r.decode_s for r in good if r.decode_s > 0]
            rows.append(
                {
                    "prompt": prompt[:40],
                    "ttft_s": _median([r.ttft for r in good]),
                    "decode_tok_s": _median(rates),
                    "tokens": args.max_tokens,
                }
            )
    print(f"{'prompt':42} {'ttft s':>8} {'decode tok/s':>13}")
    for row in rows:
        print(
            f"{row['prompt']!r:42} {_fmt(row['ttft_s'], 4):>8} {_fmt(row['decode_tok_s'], 2):>13}"
        )
    print(
        f"median over {args.repeats} repeats, {args.max_tokens} tokens, temperature "
        f"{args.temperature}; failed {failed}"
    )
    if args.json:
        print(json.dumps({"rows": rows, "failed": failed}))
    return 1 if failed else 0


def _median(values: list[Any]) -> float | None:
    return statistics.median(values) if values else None


def _fmt(value: float | None, digits: int) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


async def bench_concurrent(args: argparse.Namespace) -> int:
    from tensorfold.cli.commands import CommandError

    try:
        levels = [int(x) for x in args.levels.split(",")]
    except ValueError:
        levels = []
    if not levels or min(levels) < 1:
        raise CommandError(f"--levels must be positive integers like 1,2,4,8, not {args.levels}")
    todo = cases(args.max_tokens)
    runs: dict[str, list[tuple[Case, Reply]]] = {}
    async with Client(args.url, args.api_key) as client:
        sends = sum(max(level, len(todo)) for level in levels)
        client.expect("bench concurrent", sends + len(todo) * (args.alone + args.serial))
        if args.alone:
            runs["alone"] = [(c, await client.run(c)) for c in todo]
        for level in levels:
            batch = [todo[i % len(todo)] for i in range(max(level, len(todo)))]
            done: list[tuple[Case, Reply]] = []
            for at in range(0, len(batch), level):
                group = batch[at : at + level]
                done += zip(group, await asyncio.gather(*(client.run(c) for c in group)))
            runs[f"level {level}"] = done
        if args.serial:
            runs["serial"] = [(c, await client.run(c)) for c in todo]
    summary = report(runs)
    if args.json:
        print(json.dumps(summary))
    total = summary["total"]
    return 1 if total["unequal"] or total["failed"] else 0


def report(runs: dict[str, list[tuple[Case, Reply]]]) -> dict[str, dict[str, int]]:
    """Compare every run with the first (the reference); print and return the counts."""
    names = list(runs)
    reference = {c.name: r for c, r in runs[names[0]] if r.error is None}
    summary = {}
    for name in names:
        ok = bad = lost = 0
        for case, reply in runs[name]:
            ref = reference.get(case.name)
            if reply.error is not None or ref is None:
                lost += 1
                print(f"{name}: {case.name} failed: {reply.error or 'no reference reply'}")
            elif reply.same(ref):
                ok += 1
            else:
                bad += 1
                at = next(
                    (i for i, (a, b) in enumerate(zip(reply.token_ids, ref.token_ids)) if a != b),
                    min(len(reply.token_ids), len(ref.token_ids)),
                )
                print(
                    f"{name}: {case.name} UNEQUAL from token {at}: {reply.text[:60]!r} vs "
                    f"{ref.text[:60]!r}"
                )
        if name == names[0]:
            summary[name] = {"equal": 0, "unequal": 0, "failed": lost}
            print(f"{name}: {len(runs[name]) - lost} replies, the reference")
        else:
            summary[name] = {"equal": ok, "unequal": bad, "failed": lost}
            print(f"{name}: {ok}/{len(runs[name])} equal")
    total = {k: sum(row[k] for row in summary.values()) for k in ("equal", "unequal", "failed")}
    print(f"equal {total['equal']}, unequal {total['unequal']}, failed {total['failed']}")
    return {**summary, "total": total}
