"""Host work per decode round, on the CPU: everything a round does except the model's forward.

The lfm2_moe demo model is served as on a GPU, through `GraphRunner` (decode rounds fill the
graph's static input buffer), but its forward is replaced by a near-free stub that hands back
logits rows from a fixed random bank (so the tokens vary, greedy, ignore_eos). What is left of a
round is the host's: the lanes' bookkeeping, the graph's input fill, sampling, reading the token
back, detokenizing, stop checks, the event's way to the server and the server's chunk and write.

Three measures, at 1 and 8 streams:
- lanes:  `Lanes.step()` driven directly, µs a decode round (the stub's time taken out);
- engine: through the engine thread, a sink per request, µs a round as the sinks see it;
- server: `tensorfold serve`'s app in this process (aiohttp), streaming /v1/completions to a
  real aiohttp client in another process, µs a round as the client sees it (tokens / streams).

    python -m bench.experiments.host_round                 # 1 and 8 streams, 400 tokens each
    python -m bench.experiments.host_round --profile       # and cProfile's top functions (lanes, server loop)
    python -m bench.experiments.host_round --smoke         # a few tokens, to see that it runs

A benchmark, not a test: nothing here asserts a time.
"""

from __future__ import annotations

import argparse
import asyncio
import cProfile
import io
import json
import os
import pstats
import subprocess
import sys
import threading
import time
from typing import Any

import torch

PROMPT = [11, 12, 13, 14, 15, 16, 17, 18]


# -- the served model with a stub forward -----------------------------------------------------


def open_stub_served(lanes: int, window: int) -> Any:
    """The demo lfm2_moe served on the CPU, its runner swapped for a GraphRunner (no capture)
    whose forward is a stub: decode rounds take the graph path as they would on a GPU."""
    from tensorfold.config.settings import Settings
    from tensorfold.engine import cuda_graphs
    from tensorfold.engine.start import open_served

    settings = Settings(device="cpu", parallel=lanes, context=window, log_level="warning")
    served = open_served(settings, "lfm2_moe")
    engine = served.engine
    engine.stop()  # swap the runner while no thread runs
    ln = engine.lanes
    old = ln.runner
    runner = cuda_graphs.GraphRunner(
        old.model,
        num_pages=old.pool.num_pages,
        num_slots=lanes,
        page_rows=old.pool.page_rows,
        capture=False,
    )
    cuda_graphs.use_triton = lambda t: True  # the graph path on the CPU (no capture: eager)
    stub = StubForward(old.model.vocab_size)
    runner.forward = stub  # type: ignore[method-assign]
    ln.runner, ln.pool = runner, runner.pool
    ln.sharing = None  # the prompt store kept the old runner's pages: off here
    from tensorfold.engine.engine import Engine

    served.engine = Engine(ln).start()
    served.stub = stub
    return served


class StubForward:
    """A near-free forward: [rows wanting logits, V] rows of a fixed random bank, in turn."""

    def __init__(self, vocab: int, bank: int = 61, width: int = 256) -> None:
        g = torch.Generator().manual_seed(0)
        self.bank = torch.randn(bank, width, vocab, generator=g)
        self.calls = 0
        self.seconds = 0.0
        self.outs: dict[int, torch.Tensor] = {}

    def __call__(self, fp: Any) -> torch.Tensor:
        t = time.perf_counter()
        n = fp.logit_rows.numel()
        out = self.outs.get(n)  # one output tensor a row count, as a graph's output is static
        with torch.inference_mode():  # eager passes run under it, graph rounds do not
            if out is None:
                out = self.outs[n] = torch.empty(n, self.bank.shape[2])
            out.copy_(self.bank[self.calls % self.bank.shape[0], :n])
        self.calls += 1
        self.seconds += time.perf_counter() - t
        return out


# -- lanes and engine ---------------------------------------------------------------------------


def params(tokens: int) -> Any:
    from tensorfold.engine.sampling import SamplingParams

    return SamplingParams(temperature=0, ignore_eos=True, max_tokens=tokens, seed=1)


def lanes_rounds(
    served: Any, streams: int, tokens: int, profile: bool, timed: bool = False
) -> dict[str, Any]:
    """Lanes.step() on this thread (the engine thread stopped): µs a decode round, less the
    stub; timed: with manual timers on the round's parts (which cost a little themselves)."""
    from tensorfold.engine.requests import Request

    engine = served.engine
    engine.stop()
    ln, stub = engine.lanes, served.stub
    done = []
    for i in range(streams):
        ln.add(Request(PROMPT + [20 + i], params(tokens), done.append))
    while any(s.prefilling or s.next_token is None for s in ln.live) or ln.waiting:
        ln.step()
    timers = Timers(ln, ln.runner, stub) if timed else None
    prof = cProfile.Profile() if profile else None
    stub.seconds, rounds = 0.0, 0
    t0, c0 = time.perf_counter(), time.thread_time()
    if prof:
        prof.enable()
    while ln.live:
        ln.step()
        rounds += 1
    if prof:
        prof.disable()
    wall, cpu = time.perf_counter() - t0, time.thread_time() - c0
    host = wall - stub.seconds
    res = {
        "rounds": rounds,
        "us_per_round": round(1e6 * host / rounds, 1),
        "cpu_us_per_round": round(1e6 * (cpu - stub.seconds) / rounds, 1),
        "stub_us_per_round": round(1e6 * stub.seconds / rounds, 1),
    }
    if timers is not None:
        timers.remove()
        res["parts_us_per_round"] = timers.per_round(rounds)
    if prof:
        res["profile"] = top(prof, 25)
    from tensorfold.engine.engine import Engine

    served.engine = Engine(ln).start()
    return res


class Timers:
    """Wall time in a few of a round's parts (wrapped methods; the wrapping costs ~1 µs each)."""

    def __init__(self, ln: Any, runner: Any, stub: Any) -> None:
        from tensorfold.engine import lanes as lanes_mod

        self.s: dict[str, float] = {}
        self.undo: list[Any] = []
        self.wrap(ln, "_plan_pass", "plan_pass")
        self.wrap(runner, "run", "runner.run (less the stub)", minus=stub)
        self.wrap(lanes_mod, "mask_rows", "mask_rows (structured output)")
        self.wrap(lanes_mod, "launch_rows", "launch_rows (the round's draws)")
        self.wrap(lanes_mod, "read_rows", "read_rows (their read-back)")
        self.wrap(ln, "_take", "take (decode, stops, sink)")

    def wrap(self, obj: Any, name: str, label: str, minus: Any = None) -> None:
        fn = getattr(obj, name)
        s = self.s
        s[label] = 0.0

        def timed(*a: Any, **k: Any) -> Any:
            before = minus.seconds if minus is not None else 0.0
            t = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                dt = time.perf_counter() - t
                s[label] += dt - ((minus.seconds - before) if minus is not None else 0.0)

        setattr(obj, name, timed)
        had = name in vars(obj)
        self.undo.append((obj, name, fn, had))

    def remove(self) -> None:
        for obj, name, fn, had in reversed(self.undo):
            if had and not isinstance(obj, type(sys)):
                setattr(obj, name, fn)
            elif isinstance(obj, type(sys)):
                setattr(obj, name, fn)
            else:
                delattr(obj, name)

    def per_round(self, rounds: int) -> dict[str, float]:
        return {k: round(1e6 * v / rounds, 1) for k, v in self.s.items()}


def engine_rounds(served: Any, streams: int, tokens: int) -> dict[str, Any]:
    """Through the engine thread: from each stream's first token to the last one's end."""
    engine, stub = served.engine, served.stub
    from tensorfold.engine.requests import Finished, TokenOut

    firsts: list[float] = []
    ends: list[float] = []
    left = threading.Semaphore(0)

    def sink(event: Any) -> None:
        if isinstance(event, TokenOut) and event.index == 0:
            firsts.append(time.perf_counter())
        elif isinstance(event, Finished):
            ends.append(time.perf_counter())
            left.release()

    for i in range(streams):
        engine.submit(PROMPT + [20 + i], params(tokens), sink)
    calls0 = stub.calls
    stub_s0 = stub.seconds
    for _ in range(streams):
        left.acquire()
    wall = max(ends) - max(firsts)
    rounds = tokens - 1
    stub_s = (stub.seconds - stub_s0) * (tokens - 1) / max(stub.calls - calls0, 1)
    return {"us_per_round": round(1e6 * (wall - stub_s) / rounds, 1)}


# -- the server -------------------------------------------------------------------------------


async def _client(url: str, streams: int, tokens: int) -> dict[str, Any]:
    import aiohttp

    body = {
        "model": "lfm2_moe-demo",
        "max_tokens": tokens,
        "temperature": 0,
        "seed": 1,
        "ignore_eos": True,
        "stream": True,
    }

    async def one(i: int, session: aiohttp.ClientSession) -> tuple[float, float, int]:
        """Counts token chunks as they arrive without parsing them (a JSON parse a chunk
        would make this client, on the same cores, the slowest part of what is measured)."""
        first = last = 0.0
        n, carry = 0, b""
        mark = b'"finish_reason":null'
        async with session.post(url, json={**body, "prompt": PROMPT + [20 + i]}) as resp:
            async for blob in resp.content.iter_any():
                blob = carry + blob
                got = blob.count(mark)
                carry = blob[-(len(mark) - 1) :]
                if got:
                    n += got
                    last = time.perf_counter()
                    if n == got:
                        first = last
        return first, last, n

    async with aiohttp.ClientSession() as session:
        await one(0, session)  # warm: connection, graphs bucket, caches
        got = await asyncio.gather(*(one(i, session) for i in range(streams)))
    wall = max(g[1] for g in got) - max(g[0] for g in got)
    return {"wall_s": wall, "chunks": [g[2] for g in got]}


def client_main(url: str, streams: int, tokens: int) -> None:
    print(json.dumps(asyncio.run(_client(url, streams, tokens))), flush=True)


async def _serve_and_measure(
    served: Any, streams: int, tokens: int, profile: bool
) -> dict[str, Any]:
    from aiohttp import web

    from tensorfold.server.app import create_app

    app = create_app(served)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    url = f"http://127.0.0.1:{port}/v1/completions"
    stub = served.stub
    prof = cProfile.Profile() if profile else None
    if prof:
        prof.enable()
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "bench.experiments.host_round",
        "--client",
        url,
        "--streams",
        str(streams),
        "--tokens",
        str(tokens),
        stdout=subprocess.PIPE,
        cwd=os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
    )
    out, _ = await proc.communicate()
    if prof:
        prof.disable()
    await runner.cleanup()
    got = json.loads(out.decode().strip().splitlines()[-1])
    rounds = tokens - 1
    stub_s = stub.seconds / max(stub.calls, 1) * rounds  # about: the stub costs a few µs
    res = {
        "us_per_round": round(1e6 * (got["wall_s"] - stub_s) / rounds, 1),
        "chunks": got["chunks"],
    }
    if prof:
        res["profile_loop_thread"] = top(prof, 25)
    return res


def server_rounds(served: Any, streams: int, tokens: int, profile: bool) -> dict[str, Any]:
    return asyncio.run(_serve_and_measure(served, streams, tokens, profile))


def top(prof: cProfile.Profile, n: int) -> str:
    s = io.StringIO()
    pstats.Stats(prof, stream=s).sort_stats("tottime").print_stats(n)
    return s.getvalue()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--streams", type=int, nargs="*", default=[1, 8])
    ap.add_argument("--tokens", type=int, default=400)
    ap.add_argument("--repeats", type=int, default=5, help="each measure's best of")
    ap.add_argument("--profile", action="store_true")
    ap.add_argument("--smoke", action="store_true", help="a few tokens, once")
    ap.add_argument("--client", help=argparse.SUPPRESS)
    ap.add_argument("--json", help="write the results here")
    args = ap.parse_args()
    if args.client:
        return client_main(args.client, args.streams[0], args.tokens)
    if args.smoke:
        args.tokens, args.repeats = 8, 1
    torch.set_num_threads(1)
    lanes = max(args.streams)
    served = open_stub_served(lanes, window=max(1024, args.tokens + 64))
    results: dict[str, Any] = {}
    try:
        for n in args.streams:
            best: dict[str, Any] = {}
            for kind, fn in (
                ("lanes", lambda: lanes_rounds(served, n, args.tokens, False)),
                ("engine", lambda: engine_rounds(served, n, args.tokens)),
                ("server", lambda: server_rounds(served, n, args.tokens, False)),
            ):
                runs = [fn() for _ in range(args.repeats)]
                best[kind] = min(runs, key=lambda r: r["us_per_round"])
            best["lanes_parts"] = lanes_rounds(served, n, args.tokens, False, timed=True)
            if args.profile:
                best["lanes_profile"] = lanes_rounds(served, n, args.tokens, True)["profile"]
                best["server_profile"] = server_rounds(served, n, args.tokens, True)[
                    "profile_loop_thread"
                ]
            results[f"streams_{n}"] = best
            lr, er, sr = (best[k]["us_per_round"] for k in ("lanes", "engine", "server"))
            print(
                f"{n} stream(s): lanes {lr:.1f} µs/round (thread CPU "
                f"{best['lanes']['cpu_us_per_round']:.1f}), engine {er:.1f}, server {sr:.1f} "
                f"(server adds {sr - lr:.1f} µs over the lanes)",
                flush=True,
            )
            parts = best["lanes_parts"]
            print(
                f"  lanes, timed in parts: {parts['us_per_round']:.1f} µs/round, of which",
                flush=True,
            )
            for part, us in parts["parts_us_per_round"].items():
                print(f"    {part:36s} {us:8.1f} µs/round", flush=True)
            print(
                f"    {'(stub forward, taken out)':36s} {parts['stub_us_per_round']:8.1f} µs/round",
                flush=True,
            )
            if args.profile:
                print(best["lanes_profile"])
                print("server event loop thread:")
                print(best["server_profile"])
    finally:
        served.engine.stop(10)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
