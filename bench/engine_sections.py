"""The sections the families' speed scripts share (bench/lfm2_speed.py, gemma4_speed.py,
glm_speed.py), each through the lanes on a runner over `self.model` (which a subclass's build
section sets): decode at 1, 8 and 64 streams with the forward alone, prefill at 2k, 8k and 32k,
and the gates (concurrent == solo at each level, pages == windows with freed pages poisoned).
`SMOKE` holds the sizes of a --smoke run on the CPU; a family may shrink them."""

from __future__ import annotations

import argparse
import time
from typing import Any

import torch

from bench import engine_runs
from bench.sections import Sections, kernel_table, sync
from tensorfold.engine.cuda_graphs import GraphRunner
from tensorfold.engine.runner import ModelRunner

PAGE_ROWS = 512


def gpu_busy_us(prof) -> float:
    """The device time of a torch profile's kernels and copies (each counted once, where
    key_averages also lists a Triton kernel's launch with the kernel's time)."""
    from torch.autograd import DeviceType

    return sum(e.device_time for e in prof.events() if e.device_type == DeviceType.CUDA)


class EngineSections(Sections):
    SMOKE: dict[str, Any] = dict(
        new=8,
        prompt=64,
        streams=(1, 4),
        prefill=(100, 300),
        gate_top=150,
        gate_new=4,
        levels=(1, 2, 4),
    )

    def __init__(self, args: argparse.Namespace):
        super().__init__(args)
        self.model: Any = None
        self.window = 33 * 1024 if not args.smoke else 2048

    def runner(
        self,
        streams: int,
        *,
        graphs: bool = True,
        pages: int | None = None,
        poison: bool = False,
        window: int | None = None,
    ) -> ModelRunner:
        per = -(-(window or self.window) // PAGE_ROWS)
        pages = pages or streams * per
        if graphs:
            return GraphRunner(
                self.model,
                num_pages=pages,
                num_slots=streams,
                page_rows=PAGE_ROWS,
                poison=poison,
                max_pages=per,
                capture=not self.args.smoke and not self.args.no_graphs,
            )
        return ModelRunner(
            self.model, num_pages=pages, num_slots=streams, page_rows=PAGE_ROWS, poison=poison
        )

    def decode(self) -> dict[str, Any]:
        """64-row prompts, then 128 new tokens a stream; a round counts when every stream
        decodes. One stream again without graphs, for the launch overhead graphs remove."""
        smoke = self.args.smoke
        res: dict[str, Any] = {}
        vocab = self.model.vocab_size
        new = self.SMOKE["new"] if smoke else 128
        plen = self.SMOKE["prompt"] if smoke else 64
        win = 1024
        for n in self.SMOKE["streams"] if smoke else (1, 8, 64):
            runner = self.runner(n, window=win)
            prompts = engine_runs.random_prompts(n, plen, vocab, seed=n)
            engine_runs.run_requests(runner, prompts, 4, lanes=n, window=win)  # capture
            run = engine_runs.run_requests(runner, prompts, new, lanes=n, window=win)
            res[f"streams{n}"] = {
                "tokens_per_s": run.decode_tokens_per_s,
                "rounds": run.decode_rounds,
                "ms_per_round": 1e3 * run.decode_s / max(run.decode_rounds, 1),
                "graph_replays": getattr(runner, "replays", 0),
                "capture_error": getattr(runner, "capture_error", None),
            }
            fwd = self.forward_ms(runner, n)
            res[f"streams{n}"].update(forward_ms=fwd, forward_tokens_per_s=1e3 * n / fwd)
            del runner
        runner = self.runner(1, graphs=False, window=win)
        prompts = engine_runs.random_prompts(1, plen, vocab, seed=1)
        run = engine_runs.run_requests(runner, prompts, max(new // 2, 2), lanes=1, window=win)
        res["streams1_eager"] = {"tokens_per_s": run.decode_tokens_per_s}
        return res

    def forward_ms(self, runner: ModelRunner, n: int) -> float:
        """One decode round's forward alone for n streams (graph replay or eager), in ms: the
        rest of a round is the scheduler and the sampler."""
        from tensorfold.family.forward_pass import StreamRows

        g = torch.Generator().manual_seed(n)
        toks = torch.randint(10, self.model.vocab_size, (n,), generator=g).tolist()
        streams = [StreamRows(s, 100, [toks[s]], [s]) for s in range(n)]
        for _ in range(3):
            runner.run(streams)
        sync(self.device)
        reps = 1 if self.args.smoke else 20
        a = time.perf_counter()
        for _ in range(reps):
            runner.run(streams)
        sync(self.device)
        return 1e3 * (time.perf_counter() - a) / reps

    def prefill(self) -> dict[str, Any]:
        """Time to the first token of one prompt alone: each length run once, then its median
        TTFT of three; a length is skipped when under a minute of the budget is left."""
        smoke = self.args.smoke
        res: dict[str, Any] = {}
        runner = self.runner(1)
        vocab = self.model.vocab_size
        for n in self.SMOKE["prefill"] if smoke else (2048, 8192, 32768):
            if self.left() < 60 and not smoke:
                res[f"prompt{n}"] = {"skipped": "budget"}
                continue
            prompts = engine_runs.random_prompts(1, n, vocab, seed=n)
            engine_runs.run_requests(runner, prompts, 1, lanes=1, window=self.window)  # warm
            ttfts = []
            for _ in range(1 if smoke else 3):  # a single shot after an idle GPU varies ±30%
                o = engine_runs.run_requests(
                    runner, prompts, 1, lanes=1, window=self.window
                ).outcomes[0]
                ttfts.append(o.first - o.submitted)
            ttft = sorted(ttfts)[len(ttfts) // 2]
            res[f"prompt{n}"] = {"ttft_s": ttft, "tokens_per_s": n / ttft, "ttfts_s": ttfts}
        return res

    def prefill_probe(self) -> dict[str, Any]:
        """Where a prompt's time to first token goes: three TTFTs through the lanes against
        three bare passes of the same rows (runner.run, synced), and one TTFT under the torch
        profiler (the kernels' device time against the wall)."""
        from torch.profiler import ProfilerActivity, profile

        from tensorfold.family.forward_pass import StreamRows

        smoke = self.args.smoke
        res: dict[str, Any] = {}
        runner = self.runner(1)
        vocab = self.model.vocab_size
        for n in self.SMOKE["prefill"] if smoke else (2048, 8192):
            prompts = engine_runs.random_prompts(1, n, vocab, seed=n)
            engine_runs.run_requests(runner, prompts, 1, lanes=1, window=self.window)  # warm
            ttfts = []
            for _ in range(3):
                o = engine_runs.run_requests(
                    runner, prompts, 1, lanes=1, window=self.window
                ).outcomes[0]
                ttfts.append(o.first - o.submitted)
            pages = list(range(-(-n // PAGE_ROWS)))
            passes, returns = [], []
            for _ in range(4):
                sync(self.device)
                a = time.perf_counter()
                runner.run([StreamRows(0, 0, prompts[0], pages)])
                returns.append(time.perf_counter() - a)  # the host's launches (no sync in run)
                sync(self.device)
                passes.append(time.perf_counter() - a)
            res[f"prompt{n}"] = {
                "ttft_s": ttfts,
                "pass_s": passes[1:],
                "host_s": returns[1:],
                "tokens_per_s_best": n / min(ttfts),
            }
            if n == 2048 and not smoke:
                with profile(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU]) as prof:
                    a = time.perf_counter()
                    engine_runs.run_requests(runner, prompts, 1, lanes=1, window=self.window)
                    wall = time.perf_counter() - a
                kern = kernel_table(prof, 1, self.out / f"kernels_prefill_ttft{n}.tsv")
                (self.out / f"profile_prefill_ttft{n}.txt").write_text(
                    prof.key_averages().table(sort_by="cpu_time_total", row_limit=30)
                )
                res[f"prompt{n}"]["profiled"] = {
                    "wall_s": wall,
                    "gpu_us": gpu_busy_us(prof),
                    "kernels": sum(k[2] for k in kern if not k[0].startswith("cuda")),
                    "top": [(k[0][:60], round(k[1], 1), round(k[2], 1)) for k in kern[:10]],
                }
        return res

    def rounds(self) -> dict[str, Any]:
        """Whole decode rounds through the lanes at one stream (graph replay, the sampler, the
        host): the wall time of a round against the forward alone, and the round's kernels
        under the torch profiler (µs and calls a round; a kernel launched with PDL counts its
        wait on the one before, so the table shows which launches a round makes, not its
        time)."""
        from torch.profiler import ProfilerActivity, profile

        res: dict[str, Any] = {}
        win, new = 1024, 4 if self.args.smoke else 64
        runner = self.runner(1, window=win)
        prompts = engine_runs.random_prompts(1, 64, self.model.vocab_size, seed=1)
        engine_runs.run_requests(runner, prompts, 4, lanes=1, window=win)  # capture
        plain = engine_runs.run_requests(runner, prompts, new, lanes=1, window=win)
        with profile(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU]) as prof:
            run = engine_runs.run_requests(runner, prompts, new, lanes=1, window=win)
        kern = kernel_table(prof, max(run.decode_rounds, 1), self.out / "kernels_rounds1.tsv")
        res["wall_ms_per_round"] = 1e3 * plain.decode_s / max(plain.decode_rounds, 1)
        res["forward_ms"] = self.forward_ms(runner, 1)
        res["top"] = [(k[0][:60], round(k[1], 1), round(k[2], 1)) for k in kern[:40]]
        return res

    def gates(self) -> dict[str, Any]:
        """64 prompts of 5 to 3000 tokens, 16 new tokens each: alone, then batched at each
        level on one runner, then on a pool of a few pages where streams wait for pages and
        take freed (poisoned) ones."""
        smoke = self.args.smoke
        vocab = self.model.vocab_size
        count = 64 if not smoke else 4
        g = torch.Generator().manual_seed(3)
        top = 3000 if not smoke else self.SMOKE["gate_top"]
        lengths = torch.randint(5, top, (count,), generator=g).tolist()
        prompts = engine_runs.random_prompts(count, lengths, vocab, seed=11)
        new = 16 if not smoke else self.SMOKE["gate_new"]
        res: dict[str, Any] = {"prompts": count, "lengths": [min(lengths), max(lengths)]}
        win = top + new + PAGE_ROWS
        solo = self.runner(1, window=win)
        alone = [
            engine_runs.run_requests(solo, [p], new, lanes=1, window=win).outcomes[0].tokens
            for p in prompts
        ]
        del solo
        levels = self.SMOKE["levels"] if smoke else (1, 8, 64)
        wide = self.runner(levels[-1], window=win)
        for level in levels:
            got = []
            for i in range(0, count, level):
                run = engine_runs.run_requests(
                    wide, prompts[i : i + level], new, lanes=level, window=win
                )
                got += [o.tokens for o in run.outcomes]
            res[f"concurrent_equals_solo_at_{level}"] = got == alone
        res["graph_replays"] = getattr(wide, "replays", 0)
        del wide
        per = -(-(max(lengths) + new) // PAGE_ROWS)
        tight = self.runner(levels[-1], pages=per * 4, poison=True, window=win)
        got = [
            o.tokens
            for o in engine_runs.run_requests(
                tight, prompts, new, lanes=levels[-1], window=win
            ).outcomes
        ]
        res["pages_equal_windows_poisoned"] = got == alone
        res["distinct_tokens"] = len({t for toks in alone for t in toks})
        return res
