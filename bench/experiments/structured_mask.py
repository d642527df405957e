"""The per-step cost of structured output's token mask at 64 streams: a decode round of 64 free
rows against one of 64 constrained rows (each masked by its own llguidance matcher), and the
masks alone. Prints a JSON dict.

    python -m bench.experiments.structured_mask            # docs/serving.md quotes its figures

by default on the lfm2_moe demo (CPU, fp32, its 1024-token vocabulary). On the GPU, at
LFM2-8B-A1B's shape with dummy weights in bf16 and a 65536-token tokenizer
(bench/experiments/big_tokenizer.py, built at the start, about 20 s):

    python bench/experiments/structured_mask.py --device cuda --folder /tmp/lfm2-8b-65k [--out DIR]

--folder DIR is used as it is when it holds a config.json; otherwise it is made first
(bench/experiments/big_tokenizer.py, then bench/dummy_folder.py at --shape). A CPU smoke test
of the same path: --device cpu --folder /tmp/smoke65k --shape demo --rounds 4 --repeats 1.

Rounds are timed as (64 streams x (1 + ROUNDS) tokens) less (64 streams x 1 token), so the
prompt pass is not counted. The masks alone: 64 matchers' masks computed together and applied to a
[64, V] logits batch on the device (`structured.mask_rows`, as core/lanes.py does it), and
llguidance's bitmasks alone, one row after another (the CPU part of it, unthreaded); `*_masks_pct_of_free_round` is the masks' share of a free round (target on the
GPU: under 5%). Every constrained row must reach its max_tokens (else a round would hold fewer
rows): `*_short_rows` counts those that did not.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from tensorfold.engine.sampling import SamplingParams  # noqa: E402
from tensorfold.engine.structured import json_schema, mask_rows, regex  # noqa: E402
from tensorfold.testing import close_even, open_llm  # noqa: E402

STREAMS = 64
ROUNDS = 32
REPEATS = 3


def _round_ms(
    llm, prompts, named: dict[str, SamplingParams], rounds: int, repeats: int, sync
) -> tuple[dict[str, float], dict[str, int]]:
    """Each setting's decode round in ms; the settings take turns (other load on the machine
    falls on each alike), after one warm-up run each. Also each setting's rows that stopped
    before 1 + rounds tokens (in the timed runs)."""
    short = {name: 0 for name in named}

    def run(name: str, params: SamplingParams, tokens: int) -> float:
        sync()
        start = time.perf_counter()
        done = llm.generate(prompts, replace(params, max_tokens=tokens))
        sync()
        short[name] += sum(len(c.token_ids) < tokens for c in done)
        return time.perf_counter() - start

    for name, params in named.items():
        run(name, params, 1 + rounds)
    short = {name: 0 for name in named}
    spans: dict[str, list[float]] = {name: [] for name in named}
    for _ in range(repeats):
        for name, params in named.items():
            spans[name].append(run(name, params, 1 + rounds) - run(name, params, 1))
    return {name: statistics.median(s) / rounds * 1e3 for name, s in spans.items()}, short


def _open(args: argparse.Namespace):
    if args.folder is None:
        if args.device != "cpu":
            sys.exit("--device cuda needs --folder (a dummy-weight folder, made if absent)")
        demo = tempfile.mkdtemp(prefix="tf-structured-bench-")
        return open_llm("lfm2_moe", None, parallel=STREAMS, context=args.context, demo_cache=demo)
    folder = Path(args.folder)
    if not (folder / "config.json").is_file():
        from bench import dummy_folder
        from bench.experiments import big_tokenizer

        big_tokenizer.main(folder, args.vocab)
        dummy_folder.main(folder, args.shape, tokenizer=folder)
    flags = dict(parallel=STREAMS, context=args.context, load_format="dummy")
    if args.device == "cpu":
        return open_llm("lfm2_moe", folder, memory_limit_gib=1.0, **flags)
    # open_llm's CPU defaults with the device's own: its 0.25 GiB cap would not hold the KV
    # pages of 64 streams at LFM2-8B's shape; 8 GiB does, many times over
    return open_llm(
        "lfm2_moe", folder, device=args.device, dtype="bfloat16", memory_limit_gib=8.0, **flags
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    ap.add_argument("--folder", help="a dummy-weight lfm2_moe folder (made if it has no config)")
    ap.add_argument(
        "--shape",
        default="LFM2-8B-A1B",
        help="the folder's shape when it is made (LFM2-8B-A1B, LFM2-24B-A2B, demo)",
    )
    ap.add_argument("--vocab", type=int, default=65536, help="the made tokenizer's vocabulary")
    ap.add_argument("--rounds", type=int, default=ROUNDS)
    ap.add_argument("--repeats", type=int, default=REPEATS)
    ap.add_argument("--context", type=int, default=512)
    ap.add_argument(
        "--length",
        type=int,
        default=2000,
        help="the constrained text's length (regex and schema): past what ROUNDS "
        "tokens can write, so no constrained row ends early",
    )
    ap.add_argument("--out", help="also write the JSON dict to OUT/structured_mask.json")
    args = ap.parse_args()

    cuda = args.device == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    t0 = time.perf_counter()
    llm = _open(args)
    opened_s = time.perf_counter() - t0
    try:
        tok = llm.tokenizer
        vocab = (
            json.loads((Path(args.folder) / "config.json").read_text())["vocab_size"]
            if args.folder is not None
            else tok.vocab_size
        )
        prompts = [f"Story {i}: the little engine" for i in range(STREAMS)]
        free = SamplingParams(temperature=1.0, seed=1, ignore_eos=True)
        n = args.length
        constraints = {
            "regex": regex(f"[a-z ]{{{n}}}", tok),
            "json_schema": json_schema(
                {
                    "type": "object",
                    "properties": {"text": {"type": "string", "minLength": n}},
                    "required": ["text"],
                },
                tok,
            ),
        }
        out: dict[str, object] = {
            "streams": STREAMS,
            "vocab": tok.vocab_size,
            "device": args.device,
            "threads": torch.get_num_threads(),
        }
        if args.folder is not None:
            out["folder"] = args.folder
            out["rounds"] = args.rounds
            out["open_s"] = round(opened_s, 1)
        if cuda:
            out["gpu"] = torch.cuda.get_device_name()
        named = {
            name: replace(free, ignore_eos=False, constraint=c) for name, c in constraints.items()
        }
        t1 = time.perf_counter()
        rounds, short = _round_ms(
            llm, prompts, {"free": free, **named}, args.rounds, args.repeats, sync
        )
        base = rounds["free"]
        out["free_round_ms"] = round(base, 3)
        for name, constraint in constraints.items():
            ms = rounds[name]
            out[f"{name}_round_ms"] = round(ms, 3)
            out[f"{name}_overhead_pct"] = round(100 * (ms - base) / base, 1)
            if args.folder is not None:
                out[f"{name}_short_rows"] = short[name]
            # the masks alone: 64 matchers, one mask each per step applied to a [64, V] fp32
            # logits batch on the device (as core/lanes.py does it: structured.mask_rows), and
            # llguidance's bitmasks alone (one row after another, on twin matchers) for scale
            matchers = [constraint.start() for _ in range(STREAMS)]
            twins = [constraint.start() for _ in range(STREAMS)]
            rows = torch.zeros(STREAMS, vocab, device=args.device)
            steps, bits = [], []
            for _ in range(args.rounds):
                sync()
                start = time.perf_counter()
                masked = rows.clone()
                mask_rows(masked, list(enumerate(matchers)))
                sync()
                steps.append(time.perf_counter() - start)
                start = time.perf_counter()
                for m in twins:
                    m.matcher.compute_bitmask()
                bits.append(time.perf_counter() - start)
                for m, twin, token in zip(matchers, twins, torch.argmax(masked, 1).tolist()):
                    m.accept(token)
                    twin.accept(token)
            masks_ms = statistics.median(steps) * 1e3
            out[f"{name}_masks_ms_per_step"] = round(masks_ms, 3)
            if args.folder is not None:
                out[f"{name}_bitmasks_ms_per_step"] = round(statistics.median(bits) * 1e3, 3)
                out[f"{name}_masks_pct_of_free_round"] = round(100 * masks_ms / base, 1)
        if args.folder is not None:
            out["timed_s"] = round(time.perf_counter() - t1, 1)
        text = json.dumps(out, indent=1)
        print(text)
        if args.out:
            Path(args.out).mkdir(parents=True, exist_ok=True)
            (Path(args.out) / "structured_mask.json").write_text(text + "\n")
    finally:
        close_even(llm)


if __name__ == "__main__":
    main()
