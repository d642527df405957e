"""Decode speed at --tp 2 against --tp 1, through the engine (`tensorfold.llm.LLM`: the lanes,
the engine thread, rank 0 and the follower it starts, decode rounds under CUDA graphs), with
dummy bf16 weights at LFM2-8B-A1B's, LFM2-24B-A2B's and Gemma-4-26B-A4B's shapes. Each
configuration runs in a process of its own (a fresh NCCL group; a hang costs one row).

Decode tokens/s at n streams: 64-token prompts generated to T1 and to T2 tokens (greedy, no
EOS), after one warm-up run; n·(T2 - T1) over the difference of the two runs' times, so the
prompts' prefill cancels out.

    python bench/experiments/tp_speed.py --out DIR [--configs LFM2-8B-A1B:1,LFM2-8B-A1B:2:nccl,...]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

FAMILIES = {"LFM2-8B-A1B": "lfm2_moe", "LFM2-24B-A2B": "lfm2_moe", "Gemma-4-26B-A4B": "gemma4"}
CONFIGS = (
    "LFM2-8B-A1B:1,LFM2-8B-A1B:2,Gemma-4-26B-A4B:1,Gemma-4-26B-A4B:2,LFM2-24B-A2B:1,"
    "LFM2-24B-A2B:2,LFM2-8B-A1B:2:nccl"
)
STREAMS = {1: (16, 144), 64: (8, 72)}  # streams: (T1, T2)
PROMPT = 64
CONFIG_TIMEOUT_S = 240


def dummy_folder(shape: str, to: Path) -> Path:
    """A checkpoint folder with no weights at `shape` (--load-format dummy)."""
    if FAMILIES[shape] == "lfm2_moe":
        from bench.dummy_folder import main as lfm2_folder

        lfm2_folder(to, shape)
        return to
    from tensorfold_gemma4.demo import build_demo
    from tensorfold_gemma4.dummy import CONFIGS as GEMMA4

    demo = build_demo(Path(tempfile.mkdtemp()))
    to.mkdir(parents=True, exist_ok=True)
    for f in demo.iterdir():
        if f.suffix != ".safetensors" and f.name != "config.json":
            shutil.copy(f, to / f.name)
    config = json.loads((demo / "config.json").read_text())
    config["text_config"] = dict(GEMMA4[shape])  # the whole text model, none of the demo's
    (to / "config.json").write_text(json.dumps(config, indent=2))
    return to


def one(shape: str, tp: int, reduce: str) -> dict:
    """One configuration in this process: decode tokens/s at each stream count."""
    import torch

    from tensorfold.engine.sampling import SamplingParams
    from tensorfold.llm import LLM
    from tensorfold.ops import parallel
    from tensorfold.testing import close_even

    folder = dummy_folder(shape, Path(tempfile.mkdtemp()) / shape)
    started = time.perf_counter()
    llm = LLM(
        family=FAMILIES[shape],
        model=folder,
        load_format="dummy",
        tp=tp,
        tp_reduce=reduce,
        device="cuda",
        dtype="bfloat16",
        context=1024,
        parallel=max(STREAMS),
        memory_limit_gib=24,
        prompt_cache_gib=0,
        kv_share=0,
        tp_timeout_s=60,
    )
    res: dict = {
        "shape": shape,
        "tp": tp,
        "reduce": reduce,
        "open_s": 0.0,
        "symmetric": parallel.current().reduce is not None,
    }
    res["open_s"] = time.perf_counter() - started
    try:
        vocab = llm.served.engine.lanes.runner.model.vocab_size
        g = torch.Generator().manual_seed(0)
        prompts = torch.randint(10, min(vocab, 100_000), (max(STREAMS), PROMPT), generator=g)
        for n, (t1, t2) in STREAMS.items():
            batch = prompts[:n].tolist()

            def timed(tokens: int) -> float:
                params = SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True)
                a = time.perf_counter()
                done = llm.generate(batch, params)
                assert all(len(c.token_ids) == tokens for c in done)
                return time.perf_counter() - a

            timed(t1)  # warm-up: kernels compiled, this bucket's graph captured
            dt = timed(t2) - timed(t1)
            res[f"streams{n}_tokens_per_s"] = n * (t2 - t1) / dt
    finally:
        close_even(llm)
    return res


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="")
    parser.add_argument(
        "--configs", default=CONFIGS, help="SHAPE:TP[:REDUCE],... (REDUCE symmetric by default)"
    )
    parser.add_argument(
        "--budget-s",
        type=float,
        default=3600.0,
        help="skip the configurations that would start past this many seconds",
    )
    parser.add_argument("--one", default="", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one:  # a configuration the parent started: one JSON line
        shape, tp, reduce = args.one.split(":")
        print("RESULT " + json.dumps(one(shape, int(tp), reduce)), flush=True)
        return
    deadline = time.monotonic() + args.budget_s
    rows = []
    for spec in args.configs.split(","):
        shape, tp, *rest = spec.split(":")
        reduce = rest[0] if rest else "symmetric"
        row = {"shape": shape, "tp": int(tp), "reduce": reduce}
        left = min(CONFIG_TIMEOUT_S, deadline - time.monotonic())
        if left < 30:
            row["error"] = "skipped: the budget is spent"
        else:
            cmd = [sys.executable, __file__, "--one", f"{shape}:{tp}:{reduce}"]
            # a session of its own: a timeout ends rank 0 and the follower it started
            proc = subprocess.Popen(
                cmd,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
                start_new_session=True,
            )
            try:
                stdout, stderr = proc.communicate(timeout=left)
                found = [ln for ln in stdout.splitlines() if ln.startswith("RESULT ")]
                if found:
                    row = json.loads(found[-1][7:])
                else:
                    row["error"] = f"exit {proc.returncode}: {stderr[-600:]}"
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.communicate()
                row["error"] = f"timed out after {left:.0f} s"
        rows.append(row)
        print(json.dumps(row), flush=True)
        if args.out:  # after every row: a later timeout leaves what was measured
            Path(args.out).mkdir(parents=True, exist_ok=True)
            (Path(args.out) / "tp_speed.json").write_text(json.dumps(rows, indent=1))
            (Path(args.out) / "tp_speed.txt").write_text(table(rows) + "\n")
    print(table(rows))


def table(rows: list[dict]) -> str:
    """Decode tokens/s and, at --tp 2, the ratio to the same shape's --tp 1."""
    one_rank = {r["shape"]: r for r in rows if r["tp"] == 1 and "error" not in r}
    lines = [
        "decode tokens/s (dummy bf16 weights, 64-token prompts, CUDA graphs)",
        f"{'shape':<16} {'tp':>2} {'reduce':<9} {'1 stream':>9} {'x tp1':>6} "
        f"{'64 streams':>10} {'x tp1':>6}",
    ]
    for r in rows:
        if "error" in r:
            lines.append(f"{r['shape']:<16} {r['tp']:>2} {r['reduce']:<9} {r['error'][:60]}")
            continue
        base = one_rank.get(r["shape"])
        cells = []
        for n in STREAMS:
            v = r[f"streams{n}_tokens_per_s"]
            x = v / base[f"streams{n}_tokens_per_s"] if base and r["tp"] > 1 else None
            cells.append(f"{v:>9.0f} {(f'{x:.2f}' if x else ''):>6}")
        reduce = (
            r["reduce"]
            if r["tp"] > 1 and r["symmetric"] == (r["reduce"] == "symmetric")
            else ("-" if r["tp"] == 1 else "nccl(fb)")
        )
        lines.append(f"{r['shape']:<16} {r['tp']:>2} {reduce:<9} {cells[0]} {cells[1]:>17}")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
