"""`tensorfold bench cache`: cold and warm time to first token for the same long prompt."""

from __future__ import annotations

import argparse
import json
import random

WORDS = (
    "amber basin cedar delta ember fjord grove heron inlet juniper kestrel lagoon mesa nectar "
    "oasis pine quarry reef sierra tundra upland valley willow yarrow zephyr"
).split()


def long_prompt(words: int, seed: int) -> str:
    rng = random.Random(seed)
    return " ".join(rng.choice(WORDS) for _ in range(words))


def add_arguments(cache: argparse.ArgumentParser) -> None:
    cache.add_argument("--words", type=int, default=6000, help="prompt length in words")
    cache.add_argument("--seed", type=int, default=0, help="which prompt (a fixed text per seed)")
    cache.add_argument("--max-tokens", type=int, default=8, help="tokens each reply generates")
    cache.add_argument(
        "--warm-runs", type=int, default=2, help="times the same prompt is sent again, warm"
    )
    cache.add_argument(
        "--require-cold",
        action="store_true",
        help="fail if the first run already hit the prompt store",
    )


async def bench_cache(args: argparse.Namespace) -> int:
    from tensorfold.cli.bench_client import Case, Client

    case = Case(
        "cache",
        "/completions",
        {
            "prompt": long_prompt(args.words, args.seed),
            "max_tokens": args.max_tokens,
            "temperature": 0,
            "logprobs": 0,
            "ignore_eos": True,
        },
    )
    async with Client(args.url, args.api_key) as client:
        client.expect("bench cache", 1 + args.warm_runs)
        replies = [await client.run(case) for _ in range(1 + args.warm_runs)]
    failed = [r.error for r in replies if r.error]
    if failed:
        print(f"failed: {failed[0]}")
        return 1
    rows = []
    for i, r in enumerate(replies):
        usage = r.usage or {}
        cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
        rows.append(
            {
                "run": "cold" if i == 0 else f"warm{i}",
                "ttft_s": r.ttft,
                "prompt_tokens": usage.get("prompt_tokens"),
                "cached_tokens": cached,
            }
        )
    same = all(r.token_ids == replies[0].token_ids for r in replies)
    for row in rows:
        print(
            f"{row['run']:6} ttft {row['ttft_s']:.4f} s  prompt {row['prompt_tokens']} "
            f"cached {row['cached_tokens']}"
        )
    print(f"replies equal: {same}")
    if args.json:
        print(json.dumps({"rows": rows, "equal": same}))
    if args.require_cold and rows[0]["cached_tokens"]:
        print(f"the first run was not cold: {rows[0]['cached_tokens']} tokens came from the store")
        return 1
    return 0 if same else 1
