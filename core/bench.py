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
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from tensorfold.settings import Settings

if TYPE_CHECKING:
    from tensorfold.progress import Progress

DEFAULT_URL = "http://127.0.0.1:8000/v1"
PROMPTS = (
    "The little engine woke before dawn and",
    "Questions and answers: What is the capital of France?",
    "Good software is easy to read and easy to change. Small functions with clear names,",
    "Numbers: one, two, three,",
)


@dataclass
class Case:
    name: str
    path: str  # "/completions" or "/chat/completions"
    payload: dict[str, Any]


@dataclass
class Reply:
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: str | None = None
    usage: dict[str, Any] | None = None
    ttft: float | None = None  # seconds from sending to the first token
    decode_s: float = 0.0  # from the first token to the last
    error: str | None = None

    def same(self, other: Reply) -> bool:
        return (self.token_ids, self.text, self.finish_reason) == (
            other.token_ids,
            other.text,
            other.finish_reason,
        )


def cases(max_tokens: int, seed: int = 1234) -> list[Case]:
    """Every prompt as a completion, greedy and seeded; and as a chat turn, seeded."""
    out = []
    for i, prompt in enumerate(PROMPTS):
        base = {"max_tokens": max_tokens, "logprobs": 0}
        out.append(
            Case(f"p{i}-greedy", "/completions", {**base, "prompt": prompt, "temperature": 0})
        )
        out.append(
            Case(
                f"p{i}-seeded",
                "/completions",
                {**base, "prompt": prompt, "temperature": 0.8, "top_p": 0.95, "seed": seed + i},
            )
        )
        out.append(
            Case(
                f"p{i}-chat",
                "/chat/completions",
                {
                    "messages": [{"role": "user", "content": prompt}],
                    "max_tokens": max_tokens,
                    "temperature": 0.8,
                    "seed": seed + i,
                    "logprobs": True,
                },
            )
        )
    return out


def _token_ids(chunk: dict[str, Any]) -> list[int]:
    logprobs = (chunk.get("choices") or [{}])[0].get("logprobs") or {}
    tokens = logprobs.get("tokens") or [e["token"] for e in logprobs.get("content") or []]
    return [int(t.removeprefix("token_id:")) for t in tokens]


class Client:
    """One aiohttp session to a server's /v1."""

    def __init__(self, url: str, api_key: str | None = None, timeout: float = 600) -> None:
        import aiohttp

        self.url = url.rstrip("/")
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.session = aiohttp.ClientSession(
            headers=headers,
            timeout=aiohttp.ClientTimeout(total=timeout),
            connector=aiohttp.TCPConnector(limit=0),
        )
        self.model: str | None = None
        self.progress: Progress | None = None  # counts replies while a bench runs

    def expect(self, what: str, requests: int) -> None:
        """Show progress over the next `requests` replies (see tensorfold.progress)."""
        from tensorfold.progress import Progress

        if self.progress is not None:
            self.progress.close()
        self.progress = Progress(what, requests, "requests")

    async def __aenter__(self) -> Client:
        try:
            async with self.session.get(self.url + "/models") as r:
                r.raise_for_status()
                self.model = (await r.json())["data"][0]["id"]
        except BaseException:
            await self.session.close()
            raise
        return self

    async def __aexit__(self, *exc: object) -> None:
        if self.progress is not None:
            self.progress.close()
        await self.session.close()

    async def run(self, case: Case) -> Reply:
        """Send a case as a stream; a failure is a Reply with .error, never an exception."""
        reply = await self._run(case)
        if self.progress is not None:
            self.progress.update()
        return reply

    async def _run(self, case: Case) -> Reply:
        payload = {
            "model": self.model,
            **case.payload,
            "stream": True,
            "stream_options": {"include_usage": True},
            "return_tokens_as_token_ids": True,
        }
        reply = Reply()
        start = time.perf_counter()
        first = last = start
        try:
            async with self.session.post(self.url + case.path, json=payload) as r:
                if r.status != 200:
                    reply.error = f"HTTP {r.status}: {(await r.text())[:300]}"
                    return reply
                async for raw in r.content:
                    line = raw.decode().strip()
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    chunk = json.loads(line[6:])
                    if "error" in chunk:
                        reply.error = chunk["error"].get("message", "error")
                        return reply
                    if chunk.get("usage"):
                        reply.usage = chunk["usage"]
                    if not chunk.get("choices"):
                        continue
                    choice = chunk["choices"][0]
                    piece = choice.get("text") or (choice.get("delta") or {}).get("content") or ""
                    ids = _token_ids(chunk)
                    if ids:
                        last = time.perf_counter()
                        if reply.ttft is None:
                            reply.ttft, first = last - start, last
                    reply.token_ids += ids
                    reply.text += piece
                    reply.finish_reason = choice.get("finish_reason") or reply.finish_reason
        except Exception as exc:  # a client tool reports failures, it does not stop on them
            reply.error = f"{type(exc).__name__}: {exc}"
            return reply
        reply.decode_s = last - first
        if reply.finish_reason not in ("stop", "length"):
            reply.error = f"finish_reason {reply.finish_reason!r}"
        return reply


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="bench", metavar="BENCH", required=True)
    openai = sub.add_parser("openai", help="decode tokens/s and time to first token")
    concurrent = sub.add_parser("concurrent", help="replies at each level equal alone")
    cache = sub.add_parser("cache", help="cold and warm time to first token, one long prompt")
    from tensorfold.bench_cache import add_arguments as add_cache_arguments

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
    from tensorfold.cli import CommandError

    if args.max_tokens < 1 or getattr(args, "repeats", 1) < 1:
        raise CommandError("--max-tokens and --repeats must be >= 1")
    import aiohttp

    from tensorfold.bench_cache import bench_cache

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
    from tensorfold.cli import CommandError

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
