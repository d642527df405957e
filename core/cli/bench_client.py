"""The benches' side of a server: an aiohttp client of its /v1 that times each streamed reply
(`Client`), and the cases `tensorfold bench` and `tensorfold exact` send (`cases`)."""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from tensorfold.config.progress import Progress

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
        """Show progress over the next `requests` replies (see tensorfold.config.progress)."""
        from tensorfold.config.progress import Progress

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
