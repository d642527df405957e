"""OpenAI's Responses API, the request side: a /v1/responses body (and the conversation its
previous_response_id ended) -> the chat request the server already runs (openai_api.parse_chat).

- `instructions` -> a system message first (not kept in the conversation: as OpenAI does, a
  follow-up's instructions replace the earlier ones);
- `input`: a string (one user message) or items: messages with input_text / output_text parts
  (input_image parts -> chat's image_url parts, input_audio parts -> chat's, as they are),
  function_call items (-> the assistant's tool_calls), function_call_output items (-> tool
  messages), reasoning items (-> the next assistant message's reasoning_content);
- function `tools` (the flat Responses shape) and `tool_choice` -> chat's;
- `text.format` (text / json_object / json_schema) -> response_format;
- `max_output_tokens`, `temperature`, `top_p`, `reasoning.effort` -> reasoning_effort, and the
  tensorfold extensions `seed`, `top_k`, `min_p`, `repetition_penalty`, `presence_penalty`,
  `frequency_penalty`, `chat_template_kwargs`.

Anything else (built-in tools, `background`, `include`, files...) is refused with a
400 naming the field. A chat field's refusal is renamed to the Responses field it came from
(`responses_error`).
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field
from typing import Any

from .openai_api import ApiError, _get, bad
from .request_checks import check_text

ACCEPTED = (
    "model",
    "input",
    "instructions",
    "previous_response_id",
    "tools",
    "tool_choice",
    "parallel_tool_calls",
    "text",
    "max_output_tokens",
    "temperature",
    "top_p",
    "reasoning",
    "stream",
    "store",
    "metadata",
    "user",
    "safety_identifier",
    "prompt_cache_key",
    "truncation",
    "service_tier",
    # tensorfold's (as on /v1/chat/completions)
    "seed",
    "top_k",
    "min_p",
    "repetition_penalty",
    "presence_penalty",
    "frequency_penalty",
    "chat_template_kwargs",
)
_PASSED = {  # Responses field -> chat field, passed as they are (parse_chat checks them)
    "model": "model",
    "temperature": "temperature",
    "top_p": "top_p",
    "max_output_tokens": "max_completion_tokens",
    "parallel_tool_calls": "parallel_tool_calls",
    "seed": "seed",
    "top_k": "top_k",
    "min_p": "min_p",
    "repetition_penalty": "repetition_penalty",
    "presence_penalty": "presence_penalty",
    "frequency_penalty": "frequency_penalty",
    "chat_template_kwargs": "chat_template_kwargs",
    "user": "user",
}
_CHAT_PARAMS = {  # a chat field named in a refusal -> the Responses field it came from
    "messages": "input",
    "max_tokens": "max_output_tokens",
    "max_completion_tokens": "max_output_tokens",
    "response_format": "text",
    "reasoning_effort": "reasoning",
}
_ROLES = ("user", "system", "developer", "assistant")
_FORMATS = ("text", "json_object", "json_schema")
_FUNCTION_SHAPE = '{"type": "function", "name": ..., "parameters": {...}}'
_CHOICE_SHAPE = '"none", "auto", "required" or {"type": "function", "name": ...}'


def new_id(prefix: str) -> str:
    """An id as OpenAI writes them: resp_..., msg_..., fc_..., rs_..."""
    return f"{prefix}_{uuid.uuid4().hex}"


@dataclass
class ResponsesRequest:
    """A /v1/responses body, translated: `chat` is the chat body to run, `conversation` the
    messages it renders after the instructions (what a follow-up resumes), `echo` the request's
    fields as the response object repeats them, `input_items` its input as stored items."""

    chat: dict[str, Any]
    conversation: list[dict[str, Any]]
    echo: dict[str, Any]
    input_items: list[dict[str, Any]] = field(default_factory=list)
    stream: bool = False
    store: bool = True


def responses_error(exc: ApiError) -> ApiError:
    """A refusal of the chat request, naming the Responses field it came from."""
    param = _CHAT_PARAMS.get(exc.param or "", exc.param)
    message = exc.message
    for chat_name in ("max_completion_tokens", "response_format", "reasoning_effort"):
        message = message.replace(chat_name, _CHAT_PARAMS[chat_name])
    return ApiError(exc.status, message, param=param, code=exc.code, headers=exc.headers)


def unsupported(body: dict[str, Any]) -> None:
    """Refuse the fields this server does not serve, naming the first."""
    for name, value in body.items():
        if name in ACCEPTED:
            continue
        if name == "background" and value is not True:
            continue
        if name == "include" and not value:
            continue
        if value is None:
            continue
        raise bad(
            f"{name} is not supported by /v1/responses on this server; accepted fields: "
            f"{', '.join(ACCEPTED)}",
            name,
        )
    if body.get("truncation") not in (None, "disabled"):
        raise bad(
            'truncation must be "disabled": the conversation is never cut to fit the window',
            "truncation",
        )


def _text(content: Any, where: str, kinds: tuple[str, ...]) -> str:
    """A message's content (a string or text parts) as one string."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise bad(f"{where}.content must be a string or an array of text parts", "input")
    texts = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in kinds or not isinstance(part.get("text"), str):
            raise bad(
                f"{where}.content[{j}] must be a text part ({' or '.join(kinds)} with a text "
                f"string); got type {json.dumps(kind)}",
                "input",
            )
        texts.append(part["text"])
    return "\n".join(texts)


_MEDIA_PARTS = ("input_image", "input_audio")


def _input_content(content: Any, where: str) -> str | list[dict[str, Any]]:
    """A user's (system's, developer's) content: one string when it holds only text (as
    _text), else chat parts, each input_image an image_url part (its image_url a data: or
    http(s): URL, as chat takes them) and each input_audio chat's input_audio part as it is
    ({"data": base64, "format": "wav" | "mp3"}, checked where chat's are)."""
    if not isinstance(content, list) or not any(
        isinstance(part, dict) and part.get("type") in _MEDIA_PARTS for part in content
    ):
        return _text(content, where, ("input_text",))
    parts: list[dict[str, Any]] = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind == "input_image":
            url = part.get("image_url")
            if not isinstance(url, str):
                raise bad(
                    f"{where}.content[{j}].image_url must be a string, a data: or http(s): URL "
                    "(file_id is not supported)",
                    "input",
                )
            detail = part.get("detail")
            image = {"url": url, **({"detail": detail} if detail is not None else {})}
            parts.append({"type": "image_url", "image_url": image})
        elif kind == "input_audio":
            parts.append({"type": "input_audio", "input_audio": part.get("input_audio")})
        elif kind == "input_text" and isinstance(part.get("text"), str):
            parts.append({"type": "text", "text": part["text"]})
        else:
            raise bad(
                f"{where}.content[{j}] must be a text part (input_text with a text string), "
                f"an input_image or an input_audio; got type {json.dumps(kind)}",
                "input",
            )
    return parts


def _str(item: dict[str, Any], name: str, where: str) -> str:
    value = item.get(name)
    if not isinstance(value, str):
        raise bad(f"{where}.{name} must be a string", "input")
    return value


_ITEM_IDS = {"message": "msg", "function_call": "fc", "function_call_output": "fco"}


def _stored(item: dict[str, Any], kind: str) -> dict[str, Any]:
    """An input item as GET .../input_items lists it: typed, with an id and a status, a
    message's content as parts."""
    out = {**item, "type": kind, "id": item.get("id") or new_id(_ITEM_IDS[kind])}
    out["status"] = item.get("status") or "completed"
    if kind == "message" and isinstance(item.get("content"), str):
        part = "output_text" if item.get("role") == "assistant" else "input_text"
        out["content"] = [{"type": part, "text": item["content"]}]
    return out


class _Conversation:
    """Input items folded into chat messages: consecutive function calls join the assistant
    message before them, a reasoning item goes to the assistant turn after it."""

    def __init__(self, messages: list[dict[str, Any]]) -> None:
        self.messages = messages
        self.reasoning: str | None = None
        self.calling = False  # the last message is an assistant turn that function calls join

    def add(self, message: dict[str, Any]) -> None:
        if message["role"] == "assistant" and self.reasoning is not None:
            message["reasoning_content"] = self.reasoning
        self.reasoning = None
        self.calling = message["role"] == "assistant"
        self.messages.append(message)

    def call(self, call: dict[str, Any]) -> None:
        if not self.calling or self.reasoning is not None:
            self.add({"role": "assistant", "content": None})
        self.messages[-1].setdefault("tool_calls", []).append(call)


def input_messages(value: Any) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """`input` -> (chat messages, the input as stored items with ids)."""
    if isinstance(value, str):
        item = _stored({"role": "user", "content": value}, "message")
        return [{"role": "user", "content": value}], [item]
    if not isinstance(value, list) or not value:
        raise bad("input must be a string or a non-empty array of input items", "input")
    out = _Conversation([])
    items = []
    for i, item in enumerate(value):
        where = f"input[{i}]"
        if not isinstance(item, dict):
            raise bad(f"{where} must be an object", "input")
        kind = item.get("type", "message")
        if kind == "message":
            role = item.get("role")
            if role not in _ROLES:
                raise bad(f"{where}.role must be one of {', '.join(_ROLES)}", "input")
            content = item.get("content")
            if role == "assistant":
                content = _text(content, where, ("output_text", "refusal"))
            else:
                content = _input_content(content, where)
            out.add({"role": role, "content": content})
            items.append(_stored(item, kind))
        elif kind == "function_call":
            call_id, name = _str(item, "call_id", where), _str(item, "name", where)
            arguments = _str(item, "arguments", where)
            function = {"name": name, "arguments": arguments}
            out.call({"id": call_id, "type": "function", "function": function})
            items.append(_stored(item, kind))
        elif kind == "function_call_output":
            output = item.get("output")
            text = _text(output, where, ("input_text",)) if isinstance(output, list) else output
            if not isinstance(text, str):
                raise bad(f"{where}.output must be a string or text parts", "input")
            out.add({"role": "tool", "tool_call_id": _str(item, "call_id", where), "content": text})
            items.append(_stored(item, kind))
        elif kind == "reasoning":
            parts = item.get("content") or []
            out.reasoning = _text(parts, where, ("reasoning_text",))
        else:
            raise bad(
                f"{where}.type {json.dumps(kind)[:40]} is not served; accepted: message, "
                "function_call, function_call_output, reasoning",
                "input",
            )
    return out.messages, items


def _tools(body: dict[str, Any]) -> list[dict[str, Any]] | None:
    tools = _get(body, "tools", "list")
    if tools is None:
        return None
    out = []
    for i, tool in enumerate(tools):
        kind = tool.get("type") if isinstance(tool, dict) else None
        if kind != "function":
            raise bad(
                f'tools[{i}].type must be "function" (the only tool type served, as '
                f"{_FUNCTION_SHAPE}); got {json.dumps(kind)[:40]}",
                "tools",
            )
        function = {
            k: tool[k] for k in ("name", "description", "parameters", "strict") if k in tool
        }
        if function.get("parameters") is None:
            function.pop("parameters", None)
        if function.get("strict") is None:
            function.pop("strict", None)
        out.append({"type": "function", "function": function})
    return out


def _tool_choice(value: Any) -> Any:
    if value is None or isinstance(value, str):
        return value  # parse_chat names what is accepted
    kind = value.get("type") if isinstance(value, dict) else None
    if kind == "function" and isinstance(value.get("name"), str):
        return {"type": "function", "function": {"name": value["name"]}}
    raise bad(f"tool_choice must be {_CHOICE_SHAPE}", "tool_choice")


def _response_format(text: dict[str, Any] | None) -> dict[str, Any] | None:
    if not text:
        return None
    for key in text:
        if key != "format" and text[key] is not None:
            raise bad(f"text.{key} is not supported; text takes format", "text")
    fmt = text.get("format")
    if fmt is None:
        return None
    kind = fmt.get("type") if isinstance(fmt, dict) else None
    if kind not in _FORMATS:
        raise bad(f"text.format.type must be one of {', '.join(_FORMATS)}", "text")
    if kind == "text":
        return None
    if kind == "json_object":
        return {"type": "json_object"}
    schema = {k: fmt[k] for k in ("name", "schema", "strict", "description") if k in fmt}
    return {"type": "json_schema", "json_schema": schema}


def _metadata(body: dict[str, Any]) -> dict[str, str] | None:
    metadata = _get(body, "metadata", "object")
    if metadata is None:
        return None
    if len(metadata) > 16 or not all(
        isinstance(k, str) and len(k) <= 64 and isinstance(v, str) and len(v) <= 512
        for k, v in metadata.items()
    ):
        raise bad(
            "metadata must map at most 16 keys (64 characters each) to strings (512 at most)",
            "metadata",
        )
    return metadata


def _reasoning(body: dict[str, Any]) -> dict[str, Any] | None:
    reasoning = _get(body, "reasoning", "object")
    if reasoning is None:
        return None
    effort = reasoning.get("effort")
    if effort is not None and not isinstance(effort, str):
        raise bad("reasoning.effort must be a string such as low, medium or high", "reasoning")
    return {"effort": effort, "summary": reasoning.get("summary")}


def parse_responses(body: dict[str, Any], prior: list[dict[str, Any]]) -> ResponsesRequest:
    """The body, checked and translated; `prior` is the conversation its previous_response_id
    ended ([] without one)."""
    check_text(body)
    unsupported(body)
    for name in ("safety_identifier", "prompt_cache_key", "service_tier"):
        _get(body, name, "str")
    instructions = _get(body, "instructions", "str")
    messages, items = input_messages(body.get("input"))
    conversation = [*prior, *messages]
    chat: dict[str, Any] = {
        "messages": ([{"role": "system", "content": instructions}] if instructions else [])
        + conversation
    }
    for name, chat_name in _PASSED.items():
        if body.get(name) is not None:
            chat[chat_name] = body[name]
    tools = _tools(body)
    if tools:
        chat["tools"] = tools
    if (choice := _tool_choice(body.get("tool_choice"))) is not None:
        chat["tool_choice"] = choice
    text = _get(body, "text", "object")
    if (response_format := _response_format(text)) is not None:
        chat["response_format"] = response_format
    reasoning = _reasoning(body)
    if reasoning is not None and reasoning["effort"] is not None:
        chat["reasoning_effort"] = reasoning["effort"]
    stream = bool(_get(body, "stream", "bool"))
    store = _get(body, "store", "bool")
    chat["stream"] = stream
    echo = {
        "instructions": instructions,
        "metadata": _metadata(body) or {},
        "parallel_tool_calls": body.get("parallel_tool_calls") is not False,
        "temperature": body.get("temperature"),
        "top_p": body.get("top_p"),
        "tool_choice": body.get("tool_choice") or ("auto" if tools else "none"),
        "tools": body.get("tools") or [],
        "max_output_tokens": body.get("max_output_tokens"),
        "previous_response_id": _get(body, "previous_response_id", "str"),
        "reasoning": reasoning,
        "text": {"format": (text or {}).get("format") or {"type": "text"}},
        "truncation": "disabled",
        "user": _get(body, "user", "str"),
        "store": store is not False,
        "background": False,
    }
    return ResponsesRequest(chat, conversation, echo, items, stream, store is not False)
