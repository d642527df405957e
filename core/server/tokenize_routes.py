"""`POST /tokenize` and `POST /detokenize`, as vLLM shapes them.

/tokenize takes a `prompt` (encoded as /v1/completions encodes it, with the tokenizer's special
tokens unless add_special_tokens is false) or `messages` (checked and rendered with the chat
template as /v1/chat/completions renders them: the same checks, the same prompt workers) and
answers `{"count", "max_model_len", "tokens", "token_strs"}`; a prompt that fills the window is a
400, as it is for a generation. /detokenize takes `tokens` and answers `{"prompt"}`, special
tokens written out.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

from aiohttp import web

from ..family.chat_template import ChatTemplateError
from .openai_api import (
    ApiError,
    _byte_limit,
    _get,
    bad,
    check_model,
    parse_chat,
    parse_json,
    too_long,
)
from .openai_replies import dumps
from .prompt_work import PromptJob, PromptTooLong
from .request_checks import check_messages, check_roles, check_text
from .request_limits import LIMITS, read_body
from .request_prepare import off_loop, prompt_of

if TYPE_CHECKING:
    from ..engine.start import Served

# The fields of a /tokenize body that parse_chat reads, as a chat request's.
CHAT_FIELDS = ("model", "messages", "tools", "chat_template_kwargs")


@dataclass(frozen=True)
class TokenizeAsk:
    """A checked /tokenize body: the prompt job, the field it came from, what to send back."""

    job: PromptJob
    param: str  # "prompt" or "messages"
    token_strs: bool


def parse_tokenize(body: dict[str, Any], served: Served) -> TokenizeAsk:
    check_model(body, served.model_name)
    prompt = _get(body, "prompt", "str")
    messages = _get(body, "messages", "list")
    if (prompt is None) == (messages is None):
        raise bad("send either prompt (a string) or messages (a chat), one of them", "prompt")
    strs = bool(_get(body, "return_token_strs", "bool"))
    special = _get(body, "add_special_tokens", "bool")
    generation = _get(body, "add_generation_prompt", "bool")
    if _get(body, "continue_final_message", "bool"):
        raise bad(
            "continue_final_message is not supported: send false, or leave it out",
            "continue_final_message",
        )
    if prompt is not None:
        if not prompt:
            raise bad("prompt must not be empty", "prompt")
        limit = _byte_limit([prompt], served, "prompt")
        job = PromptJob(served.window, limit, text=prompt, add_special_tokens=special is not False)
        return TokenizeAsk(job, "prompt", strs)
    if special:
        raise bad(
            "add_special_tokens must be false with messages: the chat template writes the "
            "special tokens",
            "add_special_tokens",
        )
    chat = parse_chat({k: body[k] for k in CHAT_FIELDS if k in body}, served)
    assert chat.job is not None
    if chat.images or chat.audio:
        raise bad(
            "/tokenize takes no images or audio: send the chat's text parts only (a chat "
            "request's usage.prompt_tokens counts its media's rows)",
            "messages",
        )
    job = replace(chat.job, add_generation_prompt=generation is not False)
    return TokenizeAsk(job, "messages", strs)


def _tokenize_request(raw: bytes, served: Served, max_messages: int) -> TokenizeAsk:
    """The body's bytes -> a checked /tokenize request, with a chat request's checks."""
    body = parse_json(raw)
    check_messages(body, max_messages)
    check_text(body)
    check_roles(body)
    return parse_tokenize(body, served)


def parse_detokenize(body: dict[str, Any], served: Served) -> list[int]:
    check_model(body, served.model_name)
    tokens = _get(body, "tokens", "list")
    if not tokens:
        raise bad("tokens must be a non-empty array of token ids", "tokens")
    vocab = served.tokenizer.vocab_size
    for i, t in enumerate(tokens):
        if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < vocab:
            raise bad(
                f"tokens[{i}] must be a token id, an integer in 0..{vocab - 1}, got {t!r}", "tokens"
            )
    return tokens


def _detokenize_request(raw: bytes, served: Served) -> str:
    ids = parse_detokenize(parse_json(raw), served)
    return served.tokenizer.decode(ids, skip_special_tokens=False)


def _refusal(exc: Exception, param: str, served: Served) -> ApiError | None:
    if isinstance(exc, ChatTemplateError):
        return bad(str(exc), "messages")
    if isinstance(exc, PromptTooLong):
        return too_long(exc.size, exc.limit, served, param)
    return None


def _json(body: Any) -> web.Response:
    return web.Response(body=dumps(body), content_type="application/json")


def install(app: web.Application, served: Served) -> None:
    async def tokenize(request: web.Request) -> web.StreamResponse:
        limits = request.app[LIMITS]
        raw = await read_body(request)
        deadline = asyncio.get_running_loop().time() + limits.prepare_timeout_s
        asked = await off_loop(
            limits, deadline, "prompt", _tokenize_request, raw, served, limits.max_messages
        )
        prompt = await prompt_of(
            limits,
            asked.job,
            deadline,
            served,
            asked.param,
            lambda exc: _refusal(exc, asked.param, served),
        )
        if prompt.tokens >= served.window:
            raise bad(
                f"the {asked.param} make {prompt.tokens} tokens, filling the "
                f"{served.window}-token window",
                asked.param,
                "context_length_exceeded",
            )
        strs = (
            [served.tokenizer.hf.id_to_token(i) for i in prompt.ids] if asked.token_strs else None
        )
        return _json(
            {
                "count": prompt.tokens,
                "max_model_len": served.window,
                "tokens": prompt.ids,
                "token_strs": strs,
            }
        )

    async def detokenize(request: web.Request) -> web.StreamResponse:
        limits = request.app[LIMITS]
        raw = await read_body(request)
        deadline = asyncio.get_running_loop().time() + limits.prepare_timeout_s
        text = await off_loop(limits, deadline, "tokens", _detokenize_request, raw, served)
        return _json({"prompt": text})

    app.router.add_post("/tokenize", tokenize)
    app.router.add_post("/detokenize", detokenize)
