"""`tensorfold generate`: complete prompts offline, through the lanes."""

from __future__ import annotations

import argparse
import base64
import json
import mimetypes
import sys
from pathlib import Path
from typing import Any

from tensorfold.config.settings import Settings


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from tensorfold.cli.commands import (
        add_engine_arguments,
        add_family_arguments,
        add_reasoning_argument,
    )

    add_family_arguments(parser)
    add_engine_arguments(parser)
    add_reasoning_argument(parser)
    parser.add_argument("prompts", nargs="+", metavar="PROMPT", help="prompt texts")
    parser.add_argument(
        "--max-tokens",
        type=int,
        default=32,
        metavar="N",
        help="most tokens generated for each prompt",
    )
    parser.add_argument(
        "--temperature",
        type=float,
        default=0.0,
        metavar="T",
        help="sampling temperature; 0 is greedy: the likeliest token each step",
    )
    parser.add_argument(
        "--top-p",
        type=float,
        default=1.0,
        metavar="P",
        help="sample from the likeliest tokens whose probabilities sum to P (1: all of them)",
    )
    parser.add_argument(
        "--top-k",
        type=int,
        default=0,
        metavar="K",
        help="sample from the K likeliest tokens only (0: no limit)",
    )
    parser.add_argument(
        "--seed",
        type=int,
        default=None,
        metavar="N",
        help="seed of the sampling draws; the same seed gives the same tokens, "
        "alone or batched (default: a fresh seed, printed with each completion)",
    )
    parser.add_argument(
        "--n",
        type=int,
        default=1,
        metavar="N",
        help="choices of each prompt (choice i seeded --seed + i; at most the lanes, --parallel)",
    )
    parser.add_argument("--chat", action="store_true", help="render each prompt as a user turn")
    parser.add_argument(
        "--image",
        action="append",
        default=[],
        dest="images",
        metavar="PATH",
        help="an image file (PNG, JPEG, WebP, GIF), or an http(s) URL of a host "
        "--allowed-media-domains lists, before each prompt's text in its user turn (implies "
        "--chat; repeat for more; the family must take images)",
    )
    parser.add_argument(
        "--allowed-media-domains",
        metavar="HOSTS",
        help="hosts whose http(s) image URLs a chat may name (TF_ALLOWED_MEDIA_DOMAINS; "
        "default: none)",
    )
    parser.add_argument("--json", action="store_true", help="one JSON object per completion")


def run(args: argparse.Namespace, settings: Settings) -> int:
    from tensorfold.cli.commands import CommandError
    from tensorfold.engine.requests import RequestRefused
    from tensorfold.engine.sampling import SamplingParams, SamplingParamsError
    from tensorfold.family.media import MediaRefused
    from tensorfold.llm import LLM

    if args.n < 1:
        raise CommandError(f"--n must be >= 1, got {args.n}")
    try:
        params = SamplingParams(
            temperature=args.temperature,
            top_p=args.top_p,
            top_k=args.top_k,
            seed=args.seed,
            max_tokens=args.max_tokens,
        )
    except SamplingParamsError as exc:
        raise CommandError(str(exc)) from None
    images = [image_part(path) for path in args.images]
    chat = args.chat or bool(images)
    llm = LLM.from_settings(settings, args.family, args.model)
    try:
        try:
            if chat:
                if llm.tokenizer.chat_template is None:
                    raise CommandError("the checkpoint has no chat template; drop --chat")
                turns = [[user_turn(p, images)] for p in args.prompts]
                completions = llm.chat(turns, params, n=args.n)
            else:
                completions = llm.generate(list(args.prompts), params, n=args.n)
        except (RequestRefused, MediaRefused) as exc:
            raise CommandError(str(exc)) from None
        for k, c in enumerate(completions):
            prompt = args.prompts[k // args.n]
            if args.json:
                print(
                    json.dumps(
                        {
                            "prompt": prompt,
                            "index": c.index,
                            "text": c.text,
                            **(
                                {"content": c.content, "reasoning_content": c.reasoning_content}
                                if chat
                                else {}
                            ),
                            "token_ids": c.token_ids,
                            "finish_reason": c.finish_reason,
                            "seed": c.seed,
                        }
                    )
                )
            else:
                choice = f" [{c.index}]" if args.n > 1 else ""
                text = c.content if chat and c.content is not None else c.text
                thought = f" thinks {c.reasoning_content!r}," if c.reasoning_content else ""
                end = f"({c.finish_reason}, seed {c.seed})"
                print(f"{prompt!r}{choice} ->{thought} {text!r} {end}")
        sys.stdout.flush()
        return 0 if all(c.error is None for c in completions) else 1
    finally:
        llm.close()


def image_part(path: str) -> dict[str, Any]:
    """An image file as a chat image_url part (a data: URL; the bytes are checked where the
    prompt is made); an http(s): or data: URL as it is."""
    from tensorfold.cli.commands import CommandError

    if path.split(":", 1)[0].lower() in ("http", "https", "data"):
        return {"type": "image_url", "image_url": {"url": path}}
    try:
        data = Path(path).expanduser().read_bytes()
    except OSError as exc:
        raise CommandError(f"--image {path}: {exc.strerror or exc}") from None
    kind = mimetypes.guess_type(path)[0] or "application/octet-stream"
    url = f"data:{kind};base64,{base64.b64encode(data).decode()}"
    return {"type": "image_url", "image_url": {"url": url}}


def user_turn(prompt: str, images: list[dict[str, Any]]) -> dict[str, Any]:
    """A user message: the prompt alone, or the images then the prompt as parts."""
    if not images:
        return {"role": "user", "content": prompt}
    return {"role": "user", "content": [*images, {"type": "text", "text": prompt}]}
