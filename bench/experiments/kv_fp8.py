"""fp8 KV pages against bf16 on one GPU, in one run of about 6 minutes (issue 19; --budget-s 520).

At Gemma-4-26B-A4B's and LFM2-24B-A2B's shapes with dummy bf16 weights:
- capacity: streams at a 131072-token window the memory plan fits in the device's memory with
  bf16 and with fp8 pages (bench/kv_capacity.py; the weights at their real bytes);
- decode tokens/s at 1 and 64 streams (2048-token prompts, CUDA graphs), bf16 and fp8 pages,
  and at 1 stream after a 32k-token prompt (decode_long);
- the kernels of one decode round at 2k and 32k rows of context (profile);
- the gates within fp8 through the lanes: concurrent == solo, pages == windows on a tight
  pool whose freed pages are poisoned;
- a 32k-token chat's next turn, time to first token: fresh (no store), resumed from the GPU
  store, resumed from the host tier (its state evicted there by another chat), in fp8 (and in
  bf16 while the budget lasts); the resumed replies must equal the fresh ones. Each resumed
  turn is traced (bench/experiments/turn_trace.py: Triton compiles while it ran, seconds in the
  store's steps), with a short chat's first resume and a second device-store turn beside them.
Prints a table at the end; writes results.json, log.txt and summary.txt to --out ($OUT).

    python bench/experiments/kv_fp8.py --commit $(git rev-parse --short HEAD)
    python bench/experiments/kv_fp8.py --smoke   # every section on the CPU, tiny shapes, torch references
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from bench import engine_runs, kv_capacity  # noqa: E402
from bench.experiments.turn_trace import TurnTrace  # noqa: E402
from bench.sections import Sections, kernel_table, sync  # noqa: E402
from tensorfold.engine.cuda_graphs import GraphRunner  # noqa: E402

PAGE_ROWS = 512
KV = {"bf16": "auto", "fp8": "fp8"}
# (prompt rows, new tokens, streams, chat tokens, gate prompts, gate top) at full size / smoke
FULL = dict(prompt=2048, new=64, streams=(1, 64), chat=32000, gate_prompts=16, gate_top=3000)
SMOKE = dict(prompt=64, new=6, streams=(1, 3), chat=300, gate_prompts=3, gate_top=120)


def smoke_model(family: str) -> Any:
    """A tiny model of the family's layout on the CPU (fp32 would hide bf16 issues: bf16)."""
    if family == "gemma4":
        from bench.gemma4_speed import SMOKE as CONFIG
        from tensorfold_gemma4.config import Gemma4Config
        from tensorfold_gemma4.dummy import build_dummy

        return build_dummy(Gemma4Config.from_dict(CONFIG, "kv_fp8"), "cpu", torch.bfloat16, seed=0)
    from bench.lfm2_speed import smoke_config
    from tensorfold_lfm2_moe.dummy import SHAPES, build_dummy

    cfg = smoke_config(SHAPES["LFM2-24B-A2B"], num_dense_layers=2)
    return build_dummy(cfg, "cpu", torch.bfloat16, seed=0)


def first_token(llm: Any, ids: list[int], params: Any) -> tuple[float, list[int], int]:
    """One request straight to the engine: seconds from submission to its first token, its
    tokens, and how many prompt tokens it resumed from the store."""
    import threading

    from tensorfold.engine.requests import Finished, TokenOut

    tokens: list[int] = []
    first: list[float] = []
    ended: list[Any] = []
    done = threading.Event()

    def sink(event: Any) -> None:
        if isinstance(event, TokenOut):
            if not first:
                first.append(time.perf_counter())
            tokens.append(event.token)
        elif isinstance(event, Finished):
            ended.append(event)
            done.set()

    start = time.perf_counter()
    llm.served.engine.submit(list(ids), params.with_seed(), sink, [])
    if not done.wait(600):
        raise TimeoutError("the request did not finish in 600 s")
    if ended[0].error is not None:
        raise RuntimeError(ended[0].error)
    return first[0] - start, tokens, ended[0].cached_tokens


def dummy_folder(family: str, model: Any, context: int, smoke: bool) -> Path:
    """A checkpoint folder for --load-format dummy at the model's config (the smoke's or the
    real shape's): the family demo's config.json and tokenizer files with that config over."""
    import dataclasses

    demo_module = {"gemma4": "tensorfold_gemma4.demo", "lfm2_moe": "tensorfold_lfm2_moe.demo"}
    demo = __import__(demo_module[family], fromlist=["build_demo"]).build_demo(
        Path(tempfile.mkdtemp())
    )
    folder = Path(tempfile.mkdtemp())
    for f in demo.iterdir():
        if f.suffix != ".safetensors":
            shutil.copy(f, folder / f.name)
    config = json.loads((demo / "config.json").read_text())
    if family == "gemma4":
        from bench.gemma4_speed import SMOKE as SMOKE_CONFIG
        from tensorfold_gemma4.dummy import CONFIGS

        raw = SMOKE_CONFIG if smoke else CONFIGS["Gemma-4-26B-A4B"]
        config["text_config"] = {
            **raw,
            "model_type": config["text_config"]["model_type"],
            "max_position_embeddings": max(context, 4096),
        }
    else:
        cfg = {f.name: getattr(model.cfg, f.name) for f in dataclasses.fields(model.cfg)}
        config.update(
            {
                k: list(v) if isinstance(v, tuple) else v
                for k, v in cfg.items()
                if k in config or k in ("layer_types", "num_dense_layers")
            },
            max_position_embeddings=context,
        )
    config["dtype"] = "bfloat16"
    (folder / "config.json").write_text(json.dumps(config, indent=1))
    shutil.rmtree(demo, ignore_errors=True)
    return folder


class KVBench(Sections):
    def __init__(self, args: argparse.Namespace):
        super().__init__(args)
        self.sizes = SMOKE if args.smoke else FULL
        self.model: Any = None
        self.shape = ""

    # -- capacity, from the plan ----------------------------------------------------------------

    def capacity(self) -> dict[str, Any]:
        if self.device == "cuda":
            memory = torch.cuda.get_device_properties(0).total_memory
        else:
            memory = int(self.args.memory_gib * kv_capacity.GiB)
        return {s: kv_capacity.shape_capacity(s, memory, 131072) for s in kv_capacity.SHAPES}

    # -- one shape's model through the lanes ----------------------------------------------------

    def build(self, shape: str) -> dict[str, Any]:
        family, build = kv_capacity.SHAPES[shape]
        a = time.perf_counter()
        self.model = smoke_model(family) if self.args.smoke else build("cuda")
        sync(self.device)
        return {"family": family, "build_s": time.perf_counter() - a}

    def runner(
        self, streams: int, kv: str, window: int, *, pages: int | None = None, poison: bool = False
    ) -> GraphRunner:
        per = -(-window // PAGE_ROWS)
        return GraphRunner(
            self.model,
            num_pages=pages or streams * per,
            num_slots=streams,
            page_rows=PAGE_ROWS,
            poison=poison,
            kv_dtype=KV[kv],
            max_pages=per,
            capture=self.device == "cuda",
        )

    def decode(
        self,
        prompt: int | None = None,
        streams: tuple[int, ...] | None = None,
        new: int | None = None,
    ) -> dict[str, Any]:
        """Each stream a `prompt`-row prompt, then `new` tokens (n more at n streams); a round
        counts when every stream decodes. Prompts are prefilled one a pass (2048 rows), so the
        first stream has decoded n-1 tokens when the last starts: n more tokens make `new`
        rounds of all n streams (before, the figure was the tail where streams finish one by
        one, 32 streams a round on average)."""
        z, res = self.sizes, {}
        prompt, new = prompt or z["prompt"], new or z["new"]
        for n in streams or z["streams"]:
            prompts = engine_runs.random_prompts(n, prompt, self.model.vocab_size, seed=n)
            steps = new + (n if n > 1 else 0)
            window = prompt + steps + PAGE_ROWS
            for kv in KV:
                runner = self.runner(n, kv, window)
                # capture and compile: a few rounds of all n streams too, so the timed run
                # meets no kernel variant or graph size for the first time (the 64-stream bf16
                # figure, first of its size in the process, paid Triton's compiles before)
                engine_runs.run_requests(runner, prompts, steps - new + 4, lanes=n, window=window)
                retries = self.alloc_retries()
                run = engine_runs.run_requests(
                    runner, prompts, steps, lanes=n, window=window, full=True
                )
                res[f"{kv}_streams{n}"] = {
                    "tokens_per_s": run.decode_tokens_per_s,
                    "ms_per_round": 1e3 * run.decode_s / max(run.decode_rounds, 1),
                    "tokens_per_round": run.decode_tokens / max(run.decode_rounds, 1),
                    "graph_replays": runner.replays,
                    "capture_error": runner.capture_error,
                    # the 64-stream bf16 figure varies 6x between runs of one tree: the
                    # allocator's retries (cudaFree and again) during the timed run, if any
                    "alloc_retries": self.alloc_retries() - retries,
                    "reserved_gib": (
                        torch.cuda.memory_reserved() / 2**30 if self.device == "cuda" else 0.0
                    ),
                }
                del runner
        return res

    def decode_long(self) -> dict[str, Any]:
        """decode's figures for one stream after a 32k-token prompt (a 300-token one in the
        smoke), where the KV rows are a real part of what a round reads."""
        return self.decode(300 if self.args.smoke else 32768, (1,), 32)

    def profile(self) -> dict[str, Any]:
        """Kernel times of one eager decode round of one stream at 2k and 32k rows of context,
        bf16 against fp8 pages (the rows hold whatever the pool held: timing only). Writes
        kernels_SHAPE_KV_CONTEXT.tsv (µs a round, calls a round, name)."""
        from torch.profiler import ProfilerActivity, profile

        from tensorfold.family.forward_pass import StreamRows

        res: dict[str, Any] = {}
        contexts = (64, 200) if self.args.smoke else (2048, 32768)
        n = self.args.profile_streams
        for context in contexts:
            window = context + PAGE_ROWS
            per = -(-window // PAGE_ROWS)
            for kv in KV:
                runner = GraphRunner(
                    self.model,
                    num_pages=n * per,
                    num_slots=n,
                    page_rows=PAGE_ROWS,
                    kv_dtype=KV[kv],
                    max_pages=per,
                    capture=False,
                )
                rows = [
                    StreamRows(s, context, [11], list(range(s * per, (s + 1) * per)))
                    for s in range(n)
                ]
                runner.run(rows)
                sync(self.device)
                with profile(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU]) as prof:
                    for _ in range(3):
                        runner.run(rows)
                    sync(self.device)
                name = f"{self.shape}_{kv}_{context}" + (f"_{n}" if n > 1 else "")
                kern = kernel_table(prof, 3, self.out / f"kernels_{name}.tsv")
                res[f"{kv}_{context}"] = {
                    "gpu_us_per_round": round(
                        sum(k[1] for k in kern if not k[0].startswith("cuda")), 1
                    ),
                    "top": [(k[0][:50], round(k[1], 1), round(k[2], 1)) for k in kern[:8]],
                }
                del runner
        return res

    def alloc_retries(self) -> int:
        if self.device != "cuda":
            return 0
        return int(torch.cuda.memory_stats().get("num_alloc_retries", 0))

    def gates(self) -> dict[str, Any]:
        """In fp8: the prompts alone, then all at once, then on a tight pool of poisoned pages."""
        z = self.sizes
        count, new = z["gate_prompts"], 8 if not self.args.smoke else 4
        g = torch.Generator().manual_seed(3)
        lengths = torch.randint(5, z["gate_top"], (count,), generator=g).tolist()
        prompts = engine_runs.random_prompts(count, lengths, self.model.vocab_size, seed=11)
        window = z["gate_top"] + new + PAGE_ROWS
        solo = self.runner(1, "fp8", window)
        alone = [
            engine_runs.run_requests(solo, [p], new, lanes=1, window=window).outcomes[0].tokens
            for p in prompts
        ]
        del solo
        wide = self.runner(count, "fp8", window)
        together = engine_runs.run_requests(wide, prompts, new, lanes=count, window=window)
        del wide
        per = -(-(max(lengths) + new) // PAGE_ROWS)
        tight = self.runner(count, "fp8", window, pages=per * 2, poison=True)
        pressed = engine_runs.run_requests(tight, prompts, new, lanes=count, window=window)
        return {
            "prompts": count,
            "lengths": [min(lengths), max(lengths)],
            "concurrent_equals_solo": [o.tokens for o in together.outcomes] == alone,
            "pages_equal_windows_poisoned": [o.tokens for o in pressed.outcomes] == alone,
            "distinct_tokens": len({t for toks in alone for t in toks}),
        }

    # -- a long chat's next turn, through the engine ----------------------------------------------

    def next_turn(self, shape: str) -> dict[str, Any]:
        """A chat of `chat` tokens and its reply, then its next turn: fresh on an engine without
        the store; resumed from the device store right after the first turn; resumed from the
        host tier after another chat's keeps pushed its states there (a short chat and its turn
        before these, untimed, so no figure pays a first resume's compiles). fp8, then bf16
        while at least a minute of the budget is left."""
        family = kv_capacity.SHAPES[shape][0]
        z = self.sizes
        context = z["chat"] + 2048
        folder = dummy_folder(family, self.model, context, self.args.smoke)
        vocab = self.model.vocab_size
        self.model = None  # the engines load their own copy
        gc.collect()
        if self.device == "cuda":
            torch.cuda.empty_cache()
        res: dict[str, Any] = {}
        try:
            for kv in ("fp8", "bf16"):
                if kv == "bf16" and self.left() < 60:
                    res[kv] = {"skipped": f"{self.left():.0f} s left"}
                    continue
                res[kv] = self._turns(family, folder, KV[kv], vocab, context)
        finally:
            shutil.rmtree(folder, ignore_errors=True)
        return res

    def _turns(
        self, family: str, folder: Path, kv: str, vocab: int, context: int
    ) -> dict[str, Any]:
        from tensorfold import testing
        from tensorfold.engine.sampling import SamplingParams
        from tensorfold.llm import LLM

        n = self.sizes["chat"]
        chats = engine_runs.random_prompts(4, n, vocab, seed=21)  # A, B, C that evicts B, D
        follow = engine_runs.random_prompts(2, 32, vocab, seed=22)
        params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
        states = len(range(2048, n + 1, 2048)) + 1  # the keeps of one chat: its grid, its end
        flags = dict(
            device=self.device,
            dtype="bfloat16",
            load_format="dummy",
            parallel=2,
            context=context,
            kv_dtype=kv,
            prompt_cache_gib=4 if not self.args.smoke else 0.05,
        )
        if self.args.smoke:
            flags.update(memory_limit_gib=0.5)

        trace = TurnTrace.install()

        def timed(llm: LLM, ids: list[int]) -> tuple[float, list[int], int]:
            """(seconds to the first token, the tokens, prompt tokens resumed)."""
            return first_token(llm, ids, params)

        def traced(llm: LLM, ids: list[int]) -> dict[str, Any]:
            """A timed turn with its trace: what compiled while it ran, and where it waited."""
            with trace.window() as w:
                r = dict(zip(("ttft_s", "tokens", "cached"), timed(llm, ids)))
            return {**r, "trace": w.result()}

        out: dict[str, Any] = {}
        llm = LLM(
            family=family,
            model=folder,
            kv_share=states,
            kv_host_gib=8 if not self.args.smoke else 0.05,
            **flags,
        )
        try:
            sharing = llm.served.engine.lanes.sharing
            # a short chat and its next turn first, apart from the figures: the first resume
            # of a process, traced to show whether it compiled anything the warm-up did not
            # (in session 10 a split pass's new table width did, and pass_meta's views at new
            # alignments, 0.6-2.3 s)
            x = engine_runs.random_prompts(1, min(n, 2100), vocab, seed=23)[0]
            _, reply_x, _ = timed(llm, x)
            out["first_resume"] = traced(llm, x + reply_x + follow[0])  # what it compiled
            _, reply_a, _ = timed(llm, chats[0])
            turn_a = chats[0] + reply_a + follow[0]
            out["gpu_store"] = traced(llm, turn_a)
            _, reply_b, _ = timed(llm, chats[1])
            timed(llm, chats[2])  # its keeps evict B's states to the host tier
            turn_b = chats[1] + reply_b + follow[1]
            hits = sharing.host_hits
            out["host_tier"] = traced(llm, turn_b)
            out["host_tier"]["host_hit"] = sharing.host_hits > hits
            # the device store again, on a chat of the same length after all the above: a
            # second figure for what the first resume of a shape pays
            _, reply_d, _ = timed(llm, chats[3])
            out["gpu_store_again"] = traced(llm, chats[3] + reply_d + follow[0])
            out["plan"] = llm.served.plan.startup_line()
        finally:
            testing.close_even(llm)
            del llm
            self._free()
        fresh = LLM(family=family, model=folder, kv_share=0, kv_host_gib=0, **flags)
        try:
            for name, ids in (("fresh", turn_a), ("fresh_b", turn_b)):
                out[name] = dict(zip(("ttft_s", "tokens", "cached"), timed(fresh, ids)))
        finally:
            testing.close_even(fresh)
            del fresh
            self._free()
        out["resumed_equals_fresh"] = (
            out["gpu_store"]["tokens"] == out["fresh"]["tokens"]
            and out["host_tier"]["tokens"] == out["fresh_b"]["tokens"]
        )
        for v in out.values():
            if isinstance(v, dict):
                v.pop("tokens", None)
        return out

    def _free(self) -> None:
        gc.collect()
        if self.device == "cuda":
            torch.cuda.empty_cache()


def table(r: dict[str, Any], streams: int) -> str:
    """The short table printed at the end (and saved as summary.txt); `streams`: the larger
    decode level."""

    def num(x: Any, fmt: str) -> str:
        return format(x, fmt) if isinstance(x, (int, float)) else "-"

    lines = [
        kv_capacity.table(r["capacity"])
        if "streams" in str(r.get("capacity"))
        else f"capacity: {r.get('capacity')}",
        "",
    ]
    lines.append(
        f"{'shape':<17} {'KV':<5} {'tok/s 1':>9} {f'tok/s {streams}':>9} "
        f"{'1 long':>9} {'fresh s':>8} {'gpu s':>7} {'host s':>7}  gates"
    )
    for shape in kv_capacity.SHAPES:
        s = r.get(shape, {})
        dec, turns, gates = s.get("decode", {}), s.get("next_turn", {}), s.get("gates", {})
        long = s.get("decode_long", {})
        n = streams
        for kv in KV:
            t = turns.get(kv, {}) if isinstance(turns, dict) else {}
            line = (
                f"{shape:<17} {kv:<5} "
                f"{num(dec.get(f'{kv}_streams1', {}).get('tokens_per_s'), '9.1f')} "
                f"{num(dec.get(f'{kv}_streams{n}', {}).get('tokens_per_s'), '9.1f')} "
                f"{num(long.get(f'{kv}_streams1', {}).get('tokens_per_s'), '9.1f')} "
                f"{num(t.get('fresh', {}).get('ttft_s'), '8.2f')} "
                f"{num(t.get('gpu_store', {}).get('ttft_s'), '7.2f')} "
                f"{num(t.get('host_tier', {}).get('ttft_s'), '7.2f')}"
            )
            if kv == "fp8":
                flags = [
                    gates.get("concurrent_equals_solo"),
                    gates.get("pages_equal_windows_poisoned"),
                    t.get("resumed_equals_fresh"),
                    t.get("host_tier", {}).get("host_hit"),
                ]
                line += (
                    "  concurrent==solo {} pages==windows {} resumed==fresh {} host hit {}".format(
                        *flags
                    )
                )
            lines.append(line)
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=os.environ.get("OUT") or "bench_out")
    ap.add_argument("--commit", default="unknown")
    ap.add_argument("--budget-s", type=float, default=240.0)
    ap.add_argument(
        "--memory-gib",
        type=float,
        default=kv_capacity.H200_GIB,
        help="the device memory the capacity section plans for on the CPU",
    )
    ap.add_argument("--smoke", action="store_true")
    ap.add_argument("--shapes", default=",".join(kv_capacity.SHAPES))
    ap.add_argument("--profile-streams", type=int, default=1)
    ap.add_argument(
        "--walk",
        action="store_true",
        help="attention's key segments always walked by one program (no split)",
    )
    ap.add_argument(
        "--sections",
        default="build,decode,decode_long,gates,next_turn",
        help="of each shape, in this order (capacity always runs)",
    )
    args = ap.parse_args()
    if args.walk:
        from tensorfold.ops import triton_key_split

        triton_key_split.TARGET_PROGRAMS = 0
    b = KVBench(args)
    b.results["env"] = {
        "torch": torch.__version__,
        "commit": args.commit,
        "gpu": torch.cuda.get_device_name(0) if b.device == "cuda" else None,
    }
    b.section("capacity", b.capacity)
    for shape in args.shapes.split(","):
        b.shape = shape
        shape_results: dict[str, Any] = {}
        for name, fn, need in (
            ("build", lambda: b.build(shape), 10),
            ("decode", b.decode, 30),
            ("gates", b.gates, 20),
            ("profile", b.profile, 20),
            ("decode_long", b.decode_long, 30),
            ("next_turn", lambda: b.next_turn(shape), 40),
        ):
            if name not in args.sections.split(","):
                continue
            b.section(f"{shape}.{name}", fn, need)
            shape_results[name] = b.results.pop(f"{shape}.{name}")
            b.results[shape] = shape_results
            if name == "build" and "error" in shape_results[name]:
                break
        b.model = None
        b._free()
        b.save()
    text = table(b.results, b.sizes["streams"][-1])
    (b.out / "summary.txt").write_text(text + "\n")
    print(text)


if __name__ == "__main__":
    main()
