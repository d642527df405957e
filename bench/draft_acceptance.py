"""n-gram drafts' acceptance on a family's trained demo, on the CPU (issue 57): the demo's own
questions and story openings, greedy, with `--draft ngram` at k = 4 drafting on every round a
match proposes (the policy off, so every proposal is judged). Prints, a family a line, the
drafts proposed and kept, the tokens a verify round gave, and whether every reply equals the
undrafted one. No timing: the CPU's are not the GPU's.

    python bench/draft_acceptance.py [--family lfm2_moe] [--tokens 64]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

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


def acceptance(family: str, tokens: int, k: int) -> str:
    llm = testing.open_llm(family, None, parallel=len(CHATS) + len(COMPLETIONS), context=1024)
    try:
        params = SamplingParams(temperature=0, max_tokens=tokens)
        chats = [[{"role": "user", "content": c}] for c in CHATS]
        with testing.drafting(llm, "off"):
            plain = llm.chat(chats, params) + llm.generate(list(COMPLETIONS), params)
        lanes = llm.served.engine.lanes
        drafted, kept, rounds = lanes.tokens_drafted, lanes.drafts_accepted, lanes.verify_rounds
        with testing.drafting(llm, "ngram", k):
            got = llm.chat(chats, params) + llm.generate(list(COMPLETIONS), params)
        drafted = lanes.tokens_drafted - drafted
        kept = lanes.drafts_accepted - kept
        rounds = lanes.verify_rounds - rounds
        same = testing.outputs(got) == testing.outputs(plain)
        out = sum(len(c.token_ids) for c in got)
        return (
            f"{family}: {len(got)} replies, {out} tokens; n-gram (k={k}) proposed {drafted}, "
            f"kept {kept} ({100 * kept / max(drafted, 1):.0f}%) in {rounds} passes with drafts; "
            f"equal to plain: {same}"
        )
    finally:
        testing.close_even(llm)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--family", default="all", choices=("all", *FAMILIES))
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--k", type=int, default=4)
    args = ap.parse_args()
    for family in FAMILIES if args.family == "all" else (args.family,):
        print(acceptance(family, args.tokens, args.k), flush=True)


if __name__ == "__main__":
    main()
