"""A cold server's first prompt against a warm one's (issue 15: no more than 2 s apart).

Each run is a fresh process with an empty Triton cache (TRITON_CACHE_DIR, a new folder), so
every kernel compiles and fla-core autotunes as on a new machine: the engine opens (with the
warm-up at start, TF_WARM_UP, or without), then three prompts of --prompt tokens are sent one
after another and each one's time to its first token is taken. Prints a JSON dict per run and a
summary; writes cold_start.json to --out.

    python bench/experiments/cold_start.py --family glm5_next --out $OUT          # GLM-5.3-Flash, 8 layers
    python bench/experiments/cold_start.py --smoke                                 # the lfm2 demo, CPU
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

GLM_SHAPE = "GLM-5.3-Flash-8L"


def glm_folder(context: int) -> Path:
    """The glm demo's config and tokenizer files with GLM-5.3-Flash's widths at 8 layers over,
    for --load-format dummy."""
    from tensorfold_glm.demo import build_demo

    demo = build_demo(Path(tempfile.mkdtemp()))
    folder = Path(tempfile.mkdtemp(prefix="tf-cold-glm-"))
    for f in demo.iterdir():
        if f.suffix != ".safetensors" and f.is_file():
            (folder / f.name).write_bytes(f.read_bytes())
    config = json.loads((demo / "config.json").read_text())
    # the text config's defaults are GLM-5.3-Flash's (tensorfold_glm.dummy.SHAPES): the demo's
    # small widths dropped, 8 layers kept
    config["text_config"] = {
        "model_type": config["text_config"]["model_type"],
        "num_hidden_layers": 8,
        "max_position_embeddings": context,
    }
    config["dtype"] = "bfloat16"
    (folder / "config.json").write_text(json.dumps(config, indent=1))
    return folder


def child(args: argparse.Namespace) -> None:
    import torch

    from bench.engine_runs import random_prompts
    from bench.experiments.kv_fp8 import first_token
    from tensorfold.engine.sampling import SamplingParams
    from tensorfold.llm import LLM

    flags: dict[str, Any] = dict(parallel=2, context=args.context, warm_up=args.warm_up == "1")
    if args.smoke:
        flags.update(device="cpu", memory_limit_gib=0.5)
        model = None
    else:
        flags.update(device="cuda", dtype="bfloat16", load_format="dummy")
        model = args.folder
    started = time.perf_counter()
    llm = LLM(family=args.family, model=model, **flags)
    opened = time.perf_counter() - started
    try:
        vocab = llm.served.engine.lanes.runner.model.vocab_size
        params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
        ttft = [
            first_token(llm, p, params)[0] for p in random_prompts(3, args.prompt, vocab, seed=5)
        ]
    finally:
        llm.close()
    print(
        json.dumps(
            {
                "warm_up": args.warm_up == "1",
                "open_s": round(opened, 2),
                "ttft_s": [round(t, 3) for t in ttft],
                "first_minus_warm_s": round(ttft[0] - min(ttft[1:]), 3),
                "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
            }
        )
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--family", default="glm5_next")
    ap.add_argument("--prompt", type=int, default=2048)
    ap.add_argument("--context", type=int, default=8192)
    ap.add_argument("--out", default=os.environ.get("OUT") or "bench_out")
    ap.add_argument("--smoke", action="store_true", help="the family's demo on the CPU")
    ap.add_argument("--runs", default="0,1", help="TF_WARM_UP of each run, in order")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--warm-up", default="1", help=argparse.SUPPRESS)
    ap.add_argument("--folder", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        child(args)
        return
    if args.smoke:
        args.family, args.prompt, args.context = "lfm2_moe", 200, 2048
    folder = None if args.smoke or args.family != "glm5_next" else glm_folder(args.context)
    if folder is None and not args.smoke:
        sys.exit("--family glm5_next only (its dummy folder is made here), or --smoke")
    results = []
    for warm in args.runs.split(","):
        env = {**os.environ, "TRITON_CACHE_DIR": tempfile.mkdtemp(prefix="tf-cold-triton-")}
        cmd = [
            sys.executable,
            __file__,
            "--child",
            "--family",
            args.family,
            "--warm-up",
            warm,
            "--prompt",
            str(args.prompt),
            "--context",
            str(args.context),
        ]
        cmd += ["--smoke"] if args.smoke else ["--folder", str(folder)]
        started = time.perf_counter()
        done = subprocess.run(cmd, env=env, capture_output=True, text=True)
        if done.returncode != 0:
            print(done.stderr[-3000:], file=sys.stderr)
            results.append({"warm_up": warm == "1", "error": done.stderr[-500:]})
            continue
        line = json.loads(done.stdout.strip().splitlines()[-1])
        line["process_s"] = round(time.perf_counter() - started, 1)
        results.append(line)
        print(json.dumps(line), flush=True)
    Path(args.out).mkdir(parents=True, exist_ok=True)
    (Path(args.out) / "cold_start.json").write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
