"""OpenAI's request shapes: a JSON body in, the engine's request out (the replies are in
openai_replies.py).

Every refusal is an ApiError, which the server answers as OpenAI does:
`{"error": {"message", "type", "param", "code"}}` with the status it carries.

Defaults follow vLLM: max_tokens is 16 for /v1/completions and the rest of the window for chat;
temperature, top_p, top_k, min_p and repetition_penalty come from the checkpoint's
generation_config.json when the request leaves them out, else OpenAI's defaults.
"""

from __future__ import annotations

import functools
import json
import numbers
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any, Callable, Literal

from ..engine.sampling import SamplingParams, SamplingParamsError
from ..engine.structured import StructuredError
from ..engine.structured import from_body as constraint_from_body
from ..family.chat_template import ChatTemplateError
from ..family.media import MediaPiece, MediaRefused
from ..family.reasoning import ReasoningFormat
from .api_fields import field_kind
from .image_parts import AudioRef, ImageRef, chat_content, holds_parts
from .prompt_work import Prompt, PromptJob, PromptTooLong, max_prompt_bytes, utf8_bytes
from .tool_request import ToolRequest, ToolRequestError, parse_tool_request, tool_history

if TYPE_CHECKING:
    from ..engine.start import Served

COMPLETION_DEFAULT_MAX_TOKENS = 16
MAX_PROMPTS = 2048  # prompts a /v1/completions request may list (OpenAI's bound)
_PENDING_MAX = 1  # max_tokens until the prompt's length gives the default (with_prompt)
_ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "invalid_request_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
    500: "server_error",
    503: "service_unavailable_error",
}
_REAL_FIELDS = (
    "temperature",
    "top_p",
    "min_p",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
)
_GENERATION_DEFAULTS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")
REASONING_EFFORTS = ("none", "minimal", "low", "medium", "high", "xhigh")
REASONING_FIELDS = ("reasoning_content", "reasoning", "thinking")  # on a prior assistant turn
# the chat template's own variables (and its globals): chat_template_kwargs may not set them
TEMPLATE_OWN = (
    "messages",
    "tools",
    "add_generation_prompt",
    "bos_token",
    "eos_token",
    "protect",
    "with_marks",
    "template",
    "raise_exception",
    "strftime_now",
    "namespace",
    "dict",
)


class ApiError(Exception):
    def __init__(
        self,
        status: int,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        return error_body(self.status, self.message, self.param, self.code)


def error_body(
    status: int, message: str, param: str | None = None, code: str | None = None
) -> dict[str, Any]:
    kind = _ERROR_TYPES.get(status, "server_error" if status >= 500 else "invalid_request_error")
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def bad(message: str, param: str | None = None, code: str | None = None) -> ApiError:
    return ApiError(400, message, param=param, code=code)


@dataclass
class Parsed:
    """A validated request, ready for engine.submit."""

    kind: Literal["chat", "completion"]
    prompt_ids: list[int]
    params: SamplingParams
    marks: tuple[int, ...] = ()
    stream: bool = False
    include_usage: bool = False
    max_tokens_param: str = "max_tokens"  # the field the user set, for error messages
    token_ids: bool = False  # vLLM's return_tokens_as_token_ids: logprobs say "token_id:N"
    n: int = 1  # choices of the prompt (tensorfold.engine.choices); bounded by the lanes at submit
    tools: ToolRequest | None = None  # the reply is parsed for tool calls
    job: PromptJob | None = None  # the prompt still to make (prompt_ids empty until then)
    max_tokens_set: bool = True  # False: max_tokens is the default, set by with_prompt
    reasoning: ReasoningFormat | None = None  # chat: the reply's thinking is split out
    thinking: bool = False  # the prompt ends inside thinking: the reply starts there
    prediction_job: PromptJob | None = None  # Predicted Outputs: the text to tokenize
    prediction: tuple[int, ...] = ()  # ... its tokens, the stream's drafts
    predicted: bool = False  # the request sent a prediction (usage reports what was kept)
    # A list of prompts: prompts 1.. of the list, each parsed as its own request would be (this
    # one is prompt 0); their replies follow this one's, n choices a prompt.
    more: tuple[Parsed, ...] = ()
    echo: bool = False  # the reply's text (and its logprobs) start with the prompt's
    prompt_text: str | None = None  # the prompt as sent, when text (echo); None: token ids
    echo_only: bool = False  # echo with max_tokens 0: the prompt alone (one token is drawn
    # and dropped: the prompt's logprobs come with its pass)
    beam_search: bool = False  # vLLM's use_beam_search: the n choices are the n best beams
    length_penalty: float = 1.0  # ... ranked by logprob / length ** length_penalty
    images: tuple[ImageRef, ...] = ()  # chat: the image_url parts, in order, to load (job
    # then takes their bytes: request_prepare)
    audio: tuple[AudioRef, ...] = ()  # chat: the input_audio parts, in order (likewise)
    media: tuple[MediaPiece, ...] = ()  # the images' rows in prompt_ids (with_prompt)

    @property
    def prompts(self) -> list[Parsed]:
        """Each prompt's own request, in the list's order (one for most requests)."""
        return [self, *self.more]


def parse_json(raw: bytes) -> dict[str, Any]:
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise bad(f"the request body is not valid UTF-8 (byte {exc.start})") from None
    try:
        body = json.loads(text)
    except (ValueError, RecursionError) as exc:  # also too deep, or an integer too long
        raise bad(f"the request body is not valid JSON: {exc}") from None
    if not isinstance(body, dict):
        raise bad(f"the request body must be a JSON object, got {type(body).__name__}")
    return body


_KINDS: dict[str, tuple[Callable[[Any], bool], str]] = {
    "int": (lambda v: isinstance(v, int) and not isinstance(v, bool), "an integer"),
    "number": (lambda v: isinstance(v, numbers.Real) and not isinstance(v, bool), "a number"),
    "bool": (lambda v: isinstance(v, bool), "a boolean"),
    "str": (lambda v: isinstance(v, str), "a string"),
    "list": (lambda v: isinstance(v, list), "an array"),
    "object": (lambda v: isinstance(v, dict), "an object"),
    "any": (lambda v: True, "any value"),  # its parser checks it
}


def _get(body: dict[str, Any], name: str, kind: str | None = None) -> Any:
    """The field, or None when absent or null; a wrong type is a 400 naming the field. The kind
    is the field's row in api_fields.FIELDS (`kind`, when given, must be one of its rows'); a
    name without a row raises UnknownField."""
    value = body.get(name)
    ok, words = _KINDS[field_kind(name, kind)]
    if value is not None and not ok(value):
        raise bad(f"{name} must be {words}, got {json.dumps(value)[:80]}", name)
    return value


def check_model(body: dict[str, Any], served_name: str) -> None:
    model = _get(body, "model", "str")
    if model is not None and model != served_name:
        raise ApiError(
            404,
            f"the model {model!r} does not exist; this server serves {served_name!r}",
            param="model",
            code="model_not_found",
        )


def _sampling(
    body: dict[str, Any],
    default_max: Callable[[], int],
    generation: dict[str, Any],
    logprobs: bool,
    top_logprobs: int,
) -> tuple[SamplingParams, str]:
    best_of = _get(body, "best_of", "int")
    if best_of is not None and best_of != 1:
        raise bad(f"best_of must be 1, got {best_of}", "best_of")
    _get(body, "user", "str")
    max_param = (
        "max_completion_tokens" if body.get("max_completion_tokens") is not None else ("max_tokens")
    )
    max_tokens = _get(body, max_param, "int")
    kwargs: dict[str, Any] = {
        "max_tokens": max_tokens if max_tokens is not None else default_max(),
        "logprobs": logprobs,
        "top_logprobs": top_logprobs,
    }
    for name in _GENERATION_DEFAULTS:
        value = generation.get(name)
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            kwargs[name] = value
    for name in _REAL_FIELDS:
        if (value := _get(body, name, "number")) is not None:
            kwargs[name] = value
    for name in ("top_k", "seed"):
        if (value := _get(body, name, "int")) is not None:
            kwargs[name] = value
    stop = body.get("stop")
    if stop is not None:
        if isinstance(stop, list) and not stop:
            stop = None
        elif not isinstance(stop, str) and not (
            isinstance(stop, list) and all(isinstance(s, str) for s in stop)
        ):
            raise bad("stop must be a string or an array of strings", "stop")
        kwargs["stop"] = stop if stop is not None else ()
    if (ids := _get(body, "stop_token_ids", "list")) is not None:
        kwargs["stop_token_ids"] = ids
    if (ignore := _get(body, "ignore_eos", "bool")) is not None:
        kwargs["ignore_eos"] = ignore
    if (bias := _get(body, "logit_bias", "object")) is not None:
        kwargs["logit_bias"] = bias
    try:
        params = SamplingParams(**kwargs)
    except SamplingParamsError as exc:
        param = max_param if exc.field == "max_tokens" else exc.field
        message = str(exc).replace("max_tokens", max_param, 1) if param != exc.field else str(exc)
        raise bad(message, param) from None
    return params, max_param


def _constrained(
    body: dict[str, Any], served: Served, params: SamplingParams, tools: ToolRequest | None = None
) -> SamplingParams:
    """params with the request's structured-output constraint, compiled and checked now, before
    any pass (a malformed schema, regex or grammar is a 400 naming it)."""
    try:
        constraint = constraint_from_body(body, served.tokenizer, tools)
        return params if constraint is None else replace(params, constraint=constraint)
    except StructuredError as exc:
        raise bad(str(exc), exc.param) from None
    except SamplingParamsError as exc:
        raise bad(str(exc), exc.field) from None


def _choices(body: dict[str, Any]) -> int:
    n = _get(body, "n", "int")
    if n is not None and n < 1:
        raise bad(f"n must be an integer >= 1 (the number of choices), got {n}", "n")
    return 1 if n is None else n


def _stream_flags(body: dict[str, Any]) -> tuple[bool, bool]:
    stream = bool(_get(body, "stream", "bool"))
    options = _get(body, "stream_options", "object")
    if options is None:
        return stream, False
    if not stream:
        raise bad("stream_options can only be set when stream is true", "stream_options")
    include = options.get("include_usage")
    if include is not None and not isinstance(include, bool):
        raise bad("stream_options.include_usage must be a boolean", "stream_options")
    return stream, bool(include)


def _default_max(served: Served, prompt_len: int, default: int | None) -> int:
    room = served.window - prompt_len
    if room < 1:
        raise bad(
            f"the prompt's {prompt_len} tokens fill the {served.window}-token window, leaving "
            "no room for a completion",
            "messages" if default is None else "prompt",
            "context_length_exceeded",
        )
    return room if default is None else min(default, room)


def too_long(size: int, limit: int, served: Served, param: str, where: str = "") -> ApiError:
    """A prompt of more bytes than the window's worst case (max_prompt_bytes): it cannot fit."""
    verb = "hold" if param == "messages" else "holds"
    return bad(
        f"the {where.strip() or param} {verb} {size} bytes of text, more than the {served.window}-token "
        f"window can hold ({limit} bytes at most); send a shorter prompt",
        param,
        "context_length_exceeded",
    )


def _prediction(body: dict[str, Any], served: Served) -> PromptJob | None:
    """OpenAI's Predicted Outputs: {"type": "content", "content": text or text parts}, what the
    reply is expected to repeat; tokenized by a prompt worker, cut to the window."""
    prediction = _get(body, "prediction", "object")
    if prediction is None:
        return None
    if prediction.get("type") != "content":
        raise bad(
            f'prediction.type must be "content", got {prediction.get("type")!r}', "prediction"
        )
    content = prediction.get("content")
    if isinstance(content, list):
        parts = []
        for i, part in enumerate(content):
            if not (
                isinstance(part, dict)
                and part.get("type") == "text"
                and isinstance(part.get("text"), str)
            ):
                raise bad(
                    f'prediction.content[{i}] must be {{"type": "text", "text": string}}',
                    "prediction",
                )
            parts.append(part["text"])
        content = "".join(parts)
    if not isinstance(content, str):
        raise bad("prediction.content must be a string or an array of text parts", "prediction")
    if not content:
        return None
    limit = max_prompt_bytes(served.tokenizer, served.window)
    text = content.encode("utf-8", "surrogatepass")[:limit].decode("utf-8", "ignore")
    return PromptJob(served.window, limit, text=text, add_special_tokens=False, cut=True)


def _byte_limit(texts: list[str], served: Served, param: str, where: str = "") -> int:
    """The prompt's bytes limit (max_prompt_bytes); texts that the prompt will hold and that
    pass it are refused at once, before any render or tokenizer work. `where`: the prompt's
    place in a list, for the message ("prompt[3] ")."""
    limit = max_prompt_bytes(served.tokenizer, served.window)
    if (size := sum(map(utf8_bytes, texts))) > limit:
        raise too_long(size, limit, served, param, where)
    return limit


def with_prompt(parsed: Parsed, prompt: Prompt, served: Served) -> Parsed:
    """`parsed` with the prompt its job made: the ids, the marks, the default max_tokens."""
    param = "messages" if parsed.kind == "chat" else "prompt"
    if prompt.tokens == 0:
        raise bad(
            "the messages render to an empty prompt"
            if param == "messages"
            else "the prompt encodes to no tokens",
            param,
        )
    default = None if parsed.kind == "chat" else COMPLETION_DEFAULT_MAX_TOKENS
    most = _default_max(served, prompt.tokens, default)  # refuses a prompt that fills the window
    params = parsed.params if parsed.max_tokens_set else replace(parsed.params, max_tokens=most)
    return replace(
        parsed,
        prompt_ids=prompt.ids,
        marks=prompt.marks,
        params=params,
        job=None,
        max_tokens_set=True,
        thinking=prompt.thinking,
        media=prompt.media,
    )


def at_prompt(exc: ApiError, i: int, prompts: int) -> ApiError:
    """`exc` about the request's prompt i of `prompts`: its message names the prompt when the
    request lists more than one, and `param` is "prompt"."""
    if exc.param != "prompt" or prompts < 2:
        return exc
    return ApiError(exc.status, f"prompt[{i}]: {exc.message}", param=exc.param, code=exc.code)


def prompt_refusal(exc: Exception, parsed: Parsed, served: Served) -> ApiError | None:
    """The 400 for what a prompt job raised (a template's refusal, a prompt too long), or None
    for a failure of the server's own."""
    param = "messages" if parsed.kind == "chat" else "prompt"
    if isinstance(exc, ChatTemplateError):
        return bad(str(exc), "messages")
    if isinstance(exc, PromptTooLong):
        return too_long(exc.size, exc.limit, served, param)
    if isinstance(exc, MediaRefused):
        return bad(str(exc), exc.param)
    return None


def _prompt_ids(prompt: Any, served: Served, where: str = "") -> list[int] | PromptJob:
    """One prompt: a string (a job for a prompt worker) or its token ids, checked; `where`
    names its place in a list ("prompt[3] ")."""
    param = where.strip() or "prompt"
    if isinstance(prompt, str):
        if not prompt:
            raise bad(f"{param} must not be empty", "prompt")
        limit = _byte_limit([prompt], served, "prompt", where)
        return PromptJob(served.window, limit, text=prompt)  # tokenized by a prompt worker
    if not isinstance(prompt, list) or not prompt:
        raise bad(f"{param} must be a non-empty string or array of token ids", "prompt")
    vocab = served.tokenizer.vocab_size
    for t in prompt:
        if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < vocab:
            raise bad(f"{param} token ids must be integers in 0..{vocab - 1}, got {t!r}", "prompt")
    return list(prompt)


def _prompt_list(body: dict[str, Any]) -> list[Any]:
    """The request's prompts: a list of strings or of token-id lists is that many prompts (at
    most MAX_PROMPTS); anything else (a string, one list of token ids) is one."""
    prompt = body.get("prompt")
    if not (isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list))):
        return [prompt]
    if len(prompt) > MAX_PROMPTS:
        raise bad(
            f"prompt holds {len(prompt)} prompts; a request may hold at most {MAX_PROMPTS}",
            "prompt",
        )
    for i, item in enumerate(prompt):
        if not isinstance(item, (str, list)):
            raise bad(
                f"prompt[{i}] must be a string or an array of token ids, got "
                f"{json.dumps(item)[:80]}",
                "prompt",
            )
    return prompt


def parse_completion(body: dict[str, Any], served: Served) -> Parsed:
    check_model(body, served.model_name)
    if _get(body, "suffix", "str"):
        raise bad("suffix is not supported", "suffix")
    body, extras = _completion_extras(body)
    if holds_parts(body.get("prompt")):
        raise bad(
            "/v1/completions takes no images or content parts: prompt is a string, an array of "
            "token ids, or an array of those; send images as image_url parts of "
            "/v1/chat/completions messages",
            "prompt",
        )
    items = _prompt_list(body)
    listed = items is body.get("prompt")  # a list of prompts (of one, even): named by index
    prompts = [
        _prompt_ids(item, served, f"prompt[{i}] " if listed else "") for i, item in enumerate(items)
    ]
    logprobs = _get(body, "logprobs", "int")
    if logprobs is not None and not 0 <= logprobs <= 20:
        raise bad(f"logprobs must be in 0..20, got {logprobs}", "logprobs")
    stream, usage = _stream_flags(body)
    token_ids = bool(_get(body, "return_tokens_as_token_ids", "bool"))
    n = _choices(body)
    prediction = _prediction(body, served)
    each: list[Parsed] = []
    for item, prompt in zip(items, prompts):  # each prompt as its own request would be
        ids, job = ([], prompt) if isinstance(prompt, PromptJob) else (prompt, None)
        try:
            params, max_param = _sampling(
                body,
                functools.partial(_completion_max, served, len(ids), job is not None),
                served.checkpoint.generation_config,
                logprobs is not None,
                logprobs or 0,
            )
        except ApiError as exc:  # a prompt that fills the window: which one
            raise at_prompt(exc, len(each), len(items) if listed else 1) from None
        if each:  # the constraint compiled once, for every prompt
            params = replace(params, constraint=each[0].params.constraint)
        else:
            params = _constrained(body, served, params)
        each.append(
            Parsed(
                "completion",
                ids,
                params,
                (),
                stream,
                usage,
                max_param,
                token_ids,
                n,
                job=job,
                max_tokens_set=body.get(max_param) is not None,
                prediction_job=prediction,
                predicted="prediction" in body,
                prompt_text=item if isinstance(item, str) else None,
                **extras,
            )
        )
    if extras["beam_search"] and each[0].params.constraint is not None:
        raise bad("structured output is not supported with use_beam_search", "use_beam_search")
    return replace(each[0], more=tuple(each[1:]))


def _completion_extras(body: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """What /v1/completions has beyond the sampling fields, as Parsed's fields: echo (with
    max_tokens 0, the prompt alone: the body is run with 1, and the reply drops that token),
    and vLLM's beam search. Returns the body to parse the rest from, and those fields."""
    echo = bool(_get(body, "echo", "bool"))
    beams = bool(_get(body, "use_beam_search", "bool"))
    length_penalty = _get(body, "length_penalty", "number")
    if beams and echo and body.get("logprobs") is not None:
        raise bad("echo with logprobs is not supported with use_beam_search", "use_beam_search")
    most = body.get("max_completion_tokens")  # it wins over max_tokens when set (_sampling)
    max_param = "max_tokens" if most is None else "max_completion_tokens"
    most = body.get(max_param)
    echo_only = echo and most == 0 and not isinstance(most, bool)
    if echo_only:  # as OpenAI's legacy API and vLLM give it
        body = {**body, max_param: 1}
    return body, {
        "echo": echo,
        "echo_only": echo_only,
        "beam_search": beams,
        "length_penalty": 1.0 if length_penalty is None else float(length_penalty),
    }


def _completion_max(served: Served, prompt_len: int, pending: bool) -> int:
    """A completion's default max_tokens: 16 within the window, or a placeholder until the
    prompt's text is tokenized (with_prompt)."""
    if pending:
        return _PENDING_MAX
    return _default_max(served, prompt_len, COMPLETION_DEFAULT_MAX_TOKENS)


def parse_chat(body: dict[str, Any], served: Served) -> Parsed:
    check_model(body, served.model_name)
    messages = _get(body, "messages", "list")
    if not messages:
        raise bad("messages must be a non-empty array", "messages")
    chat = []
    texts = []  # the contents: the rendered prompt holds them (and the template's own text)
    images: list[ImageRef] = []
    audio: list[AudioRef] = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise bad(f"messages[{i}] must be an object with a string role", "messages")
        try:
            content = chat_content(m.get("content"), f"messages[{i}]", images, audio)
        except MediaRefused as exc:
            raise bad(str(exc), exc.param) from None
        chat.append({**m, "content": content})
        texts += [content] if isinstance(content, str) else _part_texts(content)
        for name in REASONING_FIELDS:  # a prior turn's thinking, for the template
            if m.get(name) is not None and not isinstance(m[name], str):
                raise bad(f"messages[{i}].{name} must be a string", "messages")
    try:
        tools = parse_tool_request(body, served.spec.name, served.tool_format)
        chat = tool_history(chat)
    except ToolRequestError as exc:
        raise bad(str(exc), exc.param) from None
    logprobs = bool(_get(body, "logprobs", "bool"))
    top = _get(body, "top_logprobs", "int") or 0
    stream, usage = _stream_flags(body)
    tok = served.tokenizer
    if tok.chat_template is None:
        raise bad("the model has no chat template; use /v1/completions", "messages")
    # rendered and tokenized by a prompt worker (prompt_work.make_prompt)
    reasoning: ReasoningFormat | None = served.reasoning_format
    job = PromptJob(
        served.window,
        _byte_limit(texts, served, "messages"),
        chat,
        tools.tools if tools else None,
        protect=() if served.content_specials else tok.special_tokens(),
        template_kwargs=template_kwargs(body, served.enable_thinking),
        reasoning=reasoning,
    )
    params, max_param = _sampling(
        body,
        lambda: _PENDING_MAX,
        served.checkpoint.generation_config,
        logprobs,
        top,
    )
    token_ids = bool(_get(body, "return_tokens_as_token_ids", "bool"))
    keep: frozenset[int] = frozenset()  # markers that are special tokens must reach the parsers
    if tools is not None:
        keep |= tok.special_ids(tools.format.markers)
    if reasoning is not None:
        keep |= tok.marker_ids((reasoning.start, reasoning.end))
    if keep:
        params = replace(params, keep_special_ids=tuple(sorted(keep)))
    params = _constrained(body, served, params, tools)
    return Parsed(
        "chat",
        [],
        params,
        (),
        stream,
        usage,
        max_param,
        token_ids,
        _choices(body),
        tools,
        job,
        max_tokens_set=body.get(max_param) is not None,
        reasoning=reasoning,
        prediction_job=_prediction(body, served),
        predicted="prediction" in body,
        images=tuple(images),
        audio=tuple(audio),
    )


def _part_texts(content: list[dict[str, Any]] | None) -> list[str]:
    return [item["text"] for item in content or () if item["type"] == "text"]


def template_kwargs(body: dict[str, Any], enable_thinking: bool | None) -> dict[str, Any] | None:
    """The chat template's extra variables: `chat_template_kwargs` as sent, `reasoning_effort`
    (whose "none" turns thinking off), and the server's `enable_thinking` (TF_REASONING) where
    the request sets neither; None when there are none."""
    extra = dict(_get(body, "chat_template_kwargs", "object") or {})
    if own := sorted(set(extra) & set(TEMPLATE_OWN)):
        raise bad(
            f"chat_template_kwargs may not set {', '.join(own)}: the server sets the template's "
            "own variables (send messages and tools as fields of the request)",
            "chat_template_kwargs",
        )
    effort = _get(body, "reasoning_effort", "str")
    if effort is not None and effort not in REASONING_EFFORTS:
        raise bad(
            f"reasoning_effort must be one of {', '.join(REASONING_EFFORTS)}, got "
            f"{json.dumps(effort)[:80]}",
            "reasoning_effort",
        )
    if effort is not None:
        extra.setdefault("reasoning_effort", effort)
        if effort == "none":
            extra.setdefault("enable_thinking", False)
    if enable_thinking is not None:
        extra.setdefault("enable_thinking", enable_thinking)
    return extra or None
