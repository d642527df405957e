"""`tensorfold exact record|compare`: token hashes of a fixed request set, to compare servers.

record sends every case (the concurrency gate's prompts, greedy and seeded sampling, plus
penalties and top-k) to a server one at a time and writes each reply's token ids and their
sha256 to a JSON file; compare reads two such files and names every case that differs.
Exit status: 0 when identical, 1 when not.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
from pathlib import Path
from typing import Any

from tensorfold.config.settings import Settings

FORMAT = "tensorfold-exact/1"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from tensorfold.cli.bench_client import DEFAULT_URL

    sub = parser.add_subparsers(dest="exact", metavar="ACTION", required=True)
    record = sub.add_parser("record", help="record token hashes from a server")
    record.add_argument("--url", default=DEFAULT_URL, help="the server's /v1")
    record.add_argument("--api-key", metavar="KEY", help="sent as Authorization: Bearer KEY")
    record.add_argument(
        "--out",
        required=True,
        type=Path,
        metavar="FILE",
        help="where the recording is written (JSON)",
    )
    record.add_argument("--max-tokens", type=int, default=32, help="tokens each reply generates")
    compare = sub.add_parser("compare", help="compare two recordings")
    compare.add_argument("a", type=Path, metavar="A", help="a recording")
    compare.add_argument("b", type=Path, metavar="B", help="another recording")


def run(args: argparse.Namespace, settings: Settings) -> int:
    from tensorfold.cli.commands import CommandError

    if args.exact == "compare":
        problems, count = compare(load(args.a), load(args.b))
        for line in problems:
            print(line)
        verdict = "DIFFERENT" if problems else "IDENTICAL"
        print(f"{verdict} ({len(problems)} problem(s), {count} cases)")
        return 1 if problems else 0
    if args.max_tokens < 1:
        raise CommandError("--max-tokens must be >= 1")
    import aiohttp

    try:
        recording = asyncio.run(record(args.url, args.api_key, args.max_tokens))
    except (OSError, aiohttp.ClientError) as exc:
        raise CommandError(f"cannot use {args.url}: {exc}") from None
    args.out.write_text(json.dumps(recording, indent=1) + "\n")
    failed = [name for name, c in recording["cases"].items() if c.get("error")]
    print(
        f"recorded {len(recording['cases'])} cases from {recording['model']} to {args.out}"
        + (f"; {len(failed)} failed: {', '.join(failed)}" if failed else "")
    )
    return 1 if failed else 0


def exact_cases(max_tokens: int) -> list[Any]:
    from tensorfold.cli.bench_client import PROMPTS, Case, cases

    extra = [
        Case(
            "penalties",
            "/completions",
            {
                "prompt": PROMPTS[3],
                "max_tokens": max_tokens,
                "logprobs": 0,
                "temperature": 0,
                "repetition_penalty": 1.3,
                "presence_penalty": 0.5,
                "frequency_penalty": 0.5,
            },
        ),
        Case(
            "top-k",
            "/completions",
            {
                "prompt": PROMPTS[0],
                "max_tokens": max_tokens,
                "logprobs": 0,
                "temperature": 1.2,
                "top_k": 5,
                "min_p": 0.05,
                "seed": 7,
            },
        ),
    ]
    return cases(max_tokens) + extra


def digest(token_ids: list[int]) -> str:
    return hashlib.sha256(json.dumps(token_ids).encode()).hexdigest()


async def record(url: str, api_key: str | None, max_tokens: int) -> dict[str, Any]:
    from tensorfold.cli.bench_client import Client

    out: dict[str, Any] = {}
    async with Client(url, api_key) as client:
        for case in exact_cases(max_tokens):
            reply = await client.run(case)
            out[case.name] = {
                "request": case.payload,
                "sha256": digest(reply.token_ids),
                "token_ids": reply.token_ids,
                "finish_reason": reply.finish_reason,
                "text": reply.text,
                "error": reply.error,
            }
    return {"format": FORMAT, "url": url, "model": client.model, "cases": out}


def load(path: Path) -> dict[str, Any]:
    from tensorfold.cli.commands import CommandError

    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise CommandError(f"cannot read {path}: {exc}") from None
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        raise CommandError(f"{path} is not a recording made by `tensorfold exact record`")
    return data


def compare(a: dict[str, Any], b: dict[str, Any]) -> tuple[list[str], int]:
    """The problems (one line each) and the number of cases looked at."""
    problems = []
    names = sorted(set(a["cases"]) | set(b["cases"]))
    for name in names:
        ca, cb = a["cases"].get(name), b["cases"].get(name)
        if ca is None or cb is None:
            problems.append(f"{name}: only in {'B' if ca is None else 'A'}")
        elif ca.get("error") or cb.get("error"):
            problems.append(f"{name}: failed: {ca.get('error') or cb.get('error')}")
        elif ca["request"] != cb["request"]:
            problems.append(f"{name}: recorded with different requests")
        elif ca["sha256"] != cb["sha256"] or ca["finish_reason"] != cb["finish_reason"]:
            ta, tb = ca["token_ids"], cb["token_ids"]
            at = next((i for i, (x, y) in enumerate(zip(ta, tb)) if x != y), min(len(ta), len(tb)))
            problems.append(
                f"{name}: tokens differ from position {at} ({len(ta)} vs {len(tb)} "
                f"tokens, {ca['finish_reason']} vs {cb['finish_reason']})"
            )
    return problems, len(names)
