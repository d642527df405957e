"""Drafts' acceptance on a family's trained demo, on the CPU (issue 57): the demo's own
questions and story openings, greedy, drafted at k a round on every round a source proposes
(the policy off, so every proposal is judged): `--source ngram` (every family) or `--source
mtp` (glm5_next: its demo's MTP layer, served as `--draft mtp`). Prints, a family a line, the
drafts proposed and kept, the decode passes the replies took drafted against plain (each
request alone), and whether every reply equals the undrafted one. No timing: the CPU's are
not the GPU's.

    python bench/draft_acceptance.py [--family lfm2_moe] [--tokens 64] [--k 4]
    python bench/draft_acceptance.py --family glm5_next --source mtp [--k 1] [--gpu]

`--gpu`: the demo in bf16 on CUDA (its Triton kernels, decode rounds replayed from graphs).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tensorfold import testing  # noqa: E402
from tensorfold.engine.sampling import SamplingParams  # noqa: E402

CHATS = (
    "What is the capital of France?",
    "What is the capital of Japan?",
    "Tell me a story.",
    "Tell me a story about a cat.",
    "Hello!",
    "Who are you?",
)
COMPLETIONS = ("Once upon a time", "The little engine", "The river runs past the stone and")
FAMILIES = ("lfm2_moe", "glm5_next", "gemma4")


GPU = {"device": "cuda", "dtype": "bfloat16", "memory_limit_gib": 4}


def acceptance(family: str, tokens: int, k: int, source: str, gpu: bool = False) -> str:
    flags: dict[str, Any] = dict(GPU) if gpu else {}
    if source == "mtp":
        flags["draft"] = "mtp"  # the MTP's rows run from the start
    llm = testing.open_llm(
        family, None, parallel=len(CHATS) + len(COMPLETIONS), context=1024, **flags
    )
    try:
        params = SamplingParams(temperature=0, max_tokens=tokens)
        chats = [[{"role": "user", "content": c}] for c in CHATS]
        with testing.drafting(llm, "off"):
            plain = llm.chat(chats, params) + llm.generate(list(COMPLETIONS), params)
        lanes = llm.served.engine.lanes
        drafted, kept, rounds = lanes.tokens_drafted, lanes.drafts_accepted, lanes.verify_rounds
        with testing.drafting(llm, source, k):
            got = llm.chat(chats, params) + llm.generate(list(COMPLETIONS), params)
        drafted = lanes.tokens_drafted - drafted
        kept = lanes.drafts_accepted - kept
        rounds = lanes.verify_rounds - rounds
        same = testing.outputs(got) == testing.outputs(plain)
        out = sum(len(c.token_ids) for c in got)
        passes = {s: decode_passes(llm, chats, params, s, k) for s in ("off", source)}
        return (
            f"{family}: {len(got)} replies, {out} tokens; {source} (k={k}) proposed {drafted}, "
            f"kept {kept} ({100 * kept / max(drafted, 1):.1f}%) in {rounds} passes with drafts; "
            f"alone, {passes['off']} decode passes plain, {passes[source]} drafted "
            f"({passes['off'] / max(passes[source], 1):.2f} tokens a pass); "
            f"equal to plain: {same}"
        )
    finally:
        testing.close_even(llm)


def decode_passes(llm: Any, chats: list, params: SamplingParams, source: str, k: int) -> int:
    """The passes after each prompt's (its first token's) that the replies take, each request
    alone with drafts from `source`."""
    lanes = llm.served.engine.lanes
    passes = 0
    with testing.drafting(llm, source, k):
        for ask in [lambda c=c: llm.chat([c], params) for c in chats] + [
            lambda p=p: llm.generate([p], params) for p in COMPLETIONS
        ]:
            before = lanes.passes
            ask()
            passes += lanes.passes - before - 1
    return passes


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--family", default="all", choices=("all", *FAMILIES))
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--source", default="ngram", choices=("ngram", "mtp"))
    ap.add_argument("--gpu", action="store_true", help="bf16 on CUDA")
    args = ap.parse_args()
    families = FAMILIES if args.family == "all" else (args.family,)
    if args.source == "mtp":
        families = ("glm5_next",)  # the only demo with an MTP layer
    for family in families:
        print(acceptance(family, args.tokens, args.k, args.source, args.gpu), flush=True)


if __name__ == "__main__":
    main()
