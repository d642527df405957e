"""Every request field the server reads, one row each: the table the field checks take their
kinds from (`openai_api._get`) and `/openapi.json` is written from (openapi.py), so that the
two cannot drift.

A row is one field of one or more routes' JSON bodies: its kind (how `_get` checks it), a
description, and where known its enum, bounds and default. A field whose accepted shapes are
more than one kind (`prompt`, `stop`, `tool_choice`...) is of kind "any": its parser checks it,
and `schema` says its shapes for the document. A field that means one thing on one route and
another elsewhere (`logprobs`) has a row for each.

Adding a field is adding one row; a name that the parsers read and no row lists fails the tests
(tests/test_openapi.py), and `_get` refuses a name no row lists.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

Kind = Literal["int", "number", "bool", "str", "list", "object", "any"]

COMPLETIONS = "/v1/completions"
CHAT = "/v1/chat/completions"
TOKENIZE = "/tokenize"
DETOKENIZE = "/detokenize"
RESPONSES = "/v1/responses"
GENERATE = (COMPLETIONS, CHAT)
SAMPLED = (*GENERATE, RESPONSES)  # the sampling fields /v1/responses passes to the chat
_NO_DEFAULT = object()

_JSON_TYPES: dict[str, str] = {
    "int": "integer",
    "number": "number",
    "bool": "boolean",
    "str": "string",
    "list": "array",
    "object": "object",
}
_IDS = {"type": "array", "items": {"type": "integer", "minimum": 0}}
_STRINGS = {"type": "array", "items": {"type": "string"}}
_PROMPT = {"oneOf": [{"type": "string", "minLength": 1}, {**_IDS, "minItems": 1}]}
_MESSAGE = {
    "type": "object",
    "required": ["role"],
    "properties": {
        "role": {"enum": ["system", "developer", "user", "assistant", "tool"]},
        "content": {
            "oneOf": [
                {"type": "string"},
                {"type": "null"},
                {
                    "type": "array",
                    "items": {
                        "oneOf": [
                            {
                                "type": "object",
                                "required": ["type", "text"],
                                "properties": {
                                    "type": {"const": "text"},
                                    "text": {"type": "string"},
                                },
                            },
                            {
                                "type": "object",
                                "required": ["type", "image_url"],
                                "properties": {
                                    "type": {"const": "image_url"},
                                    "image_url": {
                                        "type": "object",
                                        "required": ["url"],
                                        "properties": {
                                            "url": {"type": "string"},
                                            "detail": {"enum": ["auto", "low", "high"]},
                                        },
                                    },
                                },
                            },
                        ]
                    },
                },
            ]
        },
        "name": {"type": "string"},
        "tool_calls": {"type": "array", "items": {"type": "object"}},
        "tool_call_id": {"type": "string"},
    },
}
_TOOL = {
    "type": "object",
    "required": ["type", "function"],
    "properties": {
        "type": {"const": "function"},
        "function": {
            "type": "object",
            "required": ["name"],
            "properties": {
                "name": {"type": "string", "pattern": "^[A-Za-z0-9_.\\-]{1,64}$"},
                "description": {"type": "string"},
                "parameters": {"type": "object"},
                "strict": {"type": "boolean"},
            },
        },
    },
}
_TOOL_CHOICE = {
    "oneOf": [
        {"enum": ["none", "auto", "required"]},
        {
            "type": "object",
            "required": ["type", "function"],
            "properties": {
                "type": {"const": "function"},
                "function": {
                    "type": "object",
                    "required": ["name"],
                    "properties": {"name": {"type": "string"}},
                },
            },
        },
    ]
}
_RESPONSE_FORMAT = {
    "type": "object",
    "required": ["type"],
    "properties": {
        "type": {"enum": ["text", "json_object", "json_schema"]},
        "json_schema": {
            "type": "object",
            "properties": {
                "name": {"type": "string"},
                "schema": {"type": "object"},
                "strict": {"type": "boolean"},
            },
        },
    },
}


@dataclass(frozen=True)
class ApiField:
    """One field of the JSON bodies of `routes`."""

    name: str
    kind: Kind
    routes: tuple[str, ...]
    description: str
    enum: tuple[Any, ...] = ()
    minimum: float | None = None
    maximum: float | None = None
    default: Any = _NO_DEFAULT
    schema: Mapping[str, Any] | None = None  # the accepted shapes, where the kind does not say
    required: bool = False

    def json_schema(self) -> dict[str, Any]:
        """The field's JSON schema (OpenAPI 3.1's dialect, JSON Schema 2020-12)."""
        out: dict[str, Any] = dict(self.schema or {})
        if self.kind != "any" and "type" not in out:
            out["type"] = _JSON_TYPES[self.kind]
        if self.enum:
            out["enum"] = list(self.enum)
        if self.minimum is not None:
            out["minimum"] = self.minimum
        if self.maximum is not None:
            out["maximum"] = self.maximum
        if self.default is not _NO_DEFAULT:
            out["default"] = self.default
        out["description"] = self.description
        return out


F = ApiField
FIELDS: tuple[ApiField, ...] = (
    # which model, and the prompt
    F(
        "model",
        "str",
        (*SAMPLED, TOKENIZE, DETOKENIZE),
        "The served model's name (GET /v1/models); another name is a 404. Optional.",
    ),
    F(
        "prompt",
        "any",
        (COMPLETIONS,),
        "The prompt: a string or its token ids; or a list of up to 2048 prompts (strings or "
        "token-id lists), each with its n choices, at index prompt * n + choice.",
        required=True,
        schema={
            "oneOf": [
                {"type": "string", "minLength": 1},
                {**_IDS, "minItems": 1},
                {"type": "array", "minItems": 1, "maxItems": 2048, "items": _PROMPT},
            ]
        },
    ),
    F(
        "messages",
        "list",
        (CHAT,),
        "The chat, rendered with the model's chat template (at most TF_MAX_MESSAGES messages); "
        "image_url parts (data: URLs, or http(s) URLs of hosts --allowed-media-domains lists) "
        "for a model that takes images.",
        required=True,
        schema={"type": "array", "minItems": 1, "items": _MESSAGE},
    ),
    F(
        "echo",
        "bool",
        (COMPLETIONS,),
        "The reply's text starts with the prompt; with logprobs, so do its logprobs (the "
        "prompt's first token's is null).",
        default=False,
    ),
    F(
        "use_beam_search",
        "bool",
        (COMPLETIONS,),
        "vLLM's: the n choices are the n best beams of a beam search (end tokens end a beam; "
        "stop strings are not looked for), given when it ends.",
        default=False,
    ),
    F(
        "length_penalty",
        "number",
        (COMPLETIONS,),
        "vLLM's, with use_beam_search: beams rank by their logprob / length ** length_penalty.",
        default=1.0,
    ),
    F(
        "suffix",
        "str",
        (COMPLETIONS,),
        "Not supported: only an empty string is accepted.",
        enum=("",),
    ),
    # how many tokens, and how they are drawn
    F(
        "max_tokens",
        "int",
        GENERATE,
        "The most tokens to generate (default: 16 for completions, the rest of the window for "
        "chat); 0 only with echo: the prompt alone, its logprobs when asked.",
        minimum=0,
    ),
    F(
        "max_completion_tokens",
        "int",
        GENERATE,
        "OpenAI's newer name for max_tokens; wins over it (0 only with echo, as max_tokens).",
        minimum=0,
    ),
    F(
        "n",
        "int",
        GENERATE,
        "Choices to generate for the prompt, each seeded from seed.",
        minimum=1,
        default=1,
    ),
    F("best_of", "int", GENERATE, "Only 1 is accepted.", enum=(1,)),
    F(
        "temperature",
        "number",
        SAMPLED,
        "Sampling temperature; 0 is greedy (default: the checkpoint's generation_config, else 1).",
        minimum=0,
    ),
    F("top_p", "number", SAMPLED, "Nucleus sampling: in (0, 1].", minimum=0, maximum=1),
    F("top_k", "int", SAMPLED, "Sample from the k likeliest tokens; 0 or -1: off.", minimum=-1),
    F(
        "min_p",
        "number",
        SAMPLED,
        "Drop tokens below min_p times the likeliest one's probability.",
        minimum=0,
        maximum=1,
    ),
    F(
        "presence_penalty",
        "number",
        SAMPLED,
        "Penalty on tokens already generated.",
        minimum=-2,
        maximum=2,
    ),
    F(
        "frequency_penalty",
        "number",
        SAMPLED,
        "Penalty on tokens by how often they were generated.",
        minimum=-2,
        maximum=2,
    ),
    F(
        "repetition_penalty",
        "number",
        SAMPLED,
        "vLLM's multiplicative penalty over prompt and generated tokens; 1 is off.",
        minimum=0,
    ),
    F(
        "seed",
        "int",
        SAMPLED,
        "The draws' seed (the reply's system_fingerprint and choices repeat with it); absent: a random one.",
        minimum=-(2**63),
        maximum=2**64 - 1,
    ),
    F(
        "stop",
        "any",
        GENERATE,
        "Up to 16 strings that end the generation (not included in the text).",
        schema={"oneOf": [{"type": "string"}, {**_STRINGS, "maxItems": 16}, {"type": "null"}]},
    ),
    F("stop_token_ids", "list", GENERATE, "Token ids that end the generation.", schema=_IDS),
    F(
        "ignore_eos",
        "bool",
        GENERATE,
        "Generate past the end-of-sequence token, to max_tokens.",
        default=False,
    ),
    F(
        "logit_bias",
        "object",
        GENERATE,
        "Token id (as a string) -> a bias in [-100, 100] added to its logit.",
        schema={"additionalProperties": {"type": "number", "minimum": -100, "maximum": 100}},
    ),
    F("user", "str", SAMPLED, "The end user's id; accepted and not used."),
    F(
        "prediction",
        "object",
        GENERATE,
        "Predicted Outputs: text the reply is expected to repeat (code edits), drafted and "
        "verified, so the reply's tokens are those it would have without it; usage's "
        "completion_tokens_details counts accepted_prediction_tokens and "
        "rejected_prediction_tokens.",
        schema={
            "type": "object",
            "required": ["type", "content"],
            "properties": {
                "type": {"const": "content"},
                "content": {
                    "oneOf": [
                        {"type": "string"},
                        {
                            "type": "array",
                            "items": {
                                "type": "object",
                                "required": ["type", "text"],
                                "properties": {
                                    "type": {"const": "text"},
                                    "text": {"type": "string"},
                                },
                            },
                        },
                    ]
                },
            },
        },
    ),
    # what comes back
    F(
        "logprobs",
        "int",
        (COMPLETIONS,),
        "Log-probabilities of the chosen token and of this many likeliest ones.",
        minimum=0,
        maximum=20,
    ),
    F("logprobs", "bool", (CHAT,), "Return the chosen tokens' log-probabilities.", default=False),
    F(
        "top_logprobs",
        "int",
        (CHAT,),
        "With logprobs: the likeliest tokens listed at each position.",
        minimum=0,
        maximum=20,
    ),
    F(
        "return_tokens_as_token_ids",
        "bool",
        GENERATE,
        "vLLM's: logprobs name each token as token_id:N.",
        default=False,
    ),
    F(
        "stream",
        "bool",
        GENERATE,
        "Send the reply as server-sent events, ending with data: [DONE].",
        default=False,
    ),
    F(
        "stream_options",
        "object",
        GENERATE,
        "With stream: include_usage sends a last chunk with the usage.",
        schema={"properties": {"include_usage": {"type": "boolean"}}},
    ),
    # tools
    F(
        "tools",
        "list",
        (CHAT, TOKENIZE),
        "Function tools offered to the model (given to the chat template).",
        schema={"type": "array", "items": _TOOL},
    ),
    F(
        "tool_choice",
        "any",
        (CHAT,),
        '"none", "auto" (the default with tools), "required", or a named function.',
        schema=_TOOL_CHOICE,
    ),
    F(
        "parallel_tool_calls",
        "bool",
        (CHAT, RESPONSES),
        "false: only the first call is returned.",
        default=True,
    ),
    # structured output: one of these at most
    F(
        "response_format",
        "object",
        GENERATE,
        "OpenAI's: text, json_object, or json_schema.",
        schema=_RESPONSE_FORMAT,
    ),
    F(
        "guided_json",
        "any",
        GENERATE,
        "vLLM's: a JSON schema (object or its text) the reply follows.",
        schema={"type": ["object", "string"]},
    ),
    F("guided_regex", "str", GENERATE, "vLLM's: a regular expression the reply matches."),
    F("guided_grammar", "str", GENERATE, "vLLM's: a Lark grammar the reply follows."),
    F(
        "guided_choice",
        "list",
        GENERATE,
        "vLLM's: the reply is one of these strings.",
        schema=_STRINGS,
    ),
    F(
        "structured_outputs",
        "object",
        GENERATE,
        "vLLM's: exactly one of json, json_object, regex, grammar, choice.",
        schema={
            "properties": {k: {} for k in ("json", "json_object", "regex", "grammar", "choice")},
            "additionalProperties": False,
        },
    ),
    # /v1/responses (OpenAI's Responses API; run as a chat)
    F(
        "input",
        "any",
        (RESPONSES,),
        "The turn's input: a string (one user message) or items (messages, function_call, function_call_output, reasoning).",
        schema={"type": ["string", "array"]},
    ),
    F(
        "instructions",
        "str",
        (RESPONSES,),
        "A system message put before the conversation (not kept for a follow-up).",
    ),
    F(
        "previous_response_id",
        "str",
        (RESPONSES,),
        "A stored response whose conversation this turn continues (its prompt resumed from the prompt store).",
    ),
    F(
        "tools",
        "list",
        (RESPONSES,),
        "Function tools, as the Responses API writes them: {type: function, name, parameters}.",
        schema={
            "type": "array",
            "items": {
                "type": "object",
                "required": ["type", "name"],
                "properties": {
                    "type": {"const": "function"},
                    "name": {"type": "string"},
                    "description": {"type": "string"},
                    "parameters": {"type": "object"},
                    "strict": {"type": ["boolean", "null"]},
                },
            },
        },
    ),
    F(
        "tool_choice",
        "any",
        (RESPONSES,),
        '"none", "auto", "required", or {type: function, name}.',
        schema={
            "oneOf": [
                {"enum": ["none", "auto", "required"]},
                {
                    "type": "object",
                    "required": ["type", "name"],
                    "properties": {"type": {"const": "function"}, "name": {"type": "string"}},
                },
            ]
        },
    ),
    F(
        "text",
        "object",
        (RESPONSES,),
        "text.format: text, json_object, or json_schema (name, schema, strict): structured output.",
        schema={"properties": {"format": {"type": "object"}}},
    ),
    F(
        "max_output_tokens",
        "int",
        (RESPONSES,),
        "The most tokens to generate (default: the rest of the window).",
        minimum=1,
    ),
    F(
        "reasoning",
        "object",
        (RESPONSES,),
        "reasoning.effort, passed to the chat as reasoning_effort.",
        schema={"properties": {"effort": {"type": "string"}, "summary": {}}},
    ),
    F(
        "stream",
        "bool",
        (RESPONSES,),
        "Send the response as server-sent events named as OpenAI names them.",
        default=False,
    ),
    F(
        "store",
        "bool",
        (RESPONSES,),
        "Keep the response for retrieval and follow-ups (TF_RESPONSES_STORE of them at most).",
        default=True,
    ),
    F(
        "metadata",
        "object",
        (RESPONSES,),
        "Up to 16 string keys (64 characters) to strings (512), echoed back.",
        schema={"additionalProperties": {"type": "string"}},
    ),
    F("safety_identifier", "str", (RESPONSES,), "Accepted and not used."),
    F(
        "prompt_cache_key",
        "str",
        (RESPONSES,),
        "Accepted and not used (the prompt store needs no key).",
    ),
    F("service_tier", "str", (RESPONSES,), "Accepted and not used."),
    F(
        "truncation",
        "any",
        (RESPONSES,),
        "Only disabled: the conversation is never cut to fit the window.",
        enum=("disabled", None),
    ),
    # tokenize and detokenize (vLLM's shapes)
    F(
        "prompt",
        "str",
        (TOKENIZE,),
        "Text to tokenize (or send messages instead).",
        schema={"minLength": 1},
    ),
    F(
        "messages",
        "list",
        (TOKENIZE,),
        "A chat to render with the chat template and tokenize, as a chat request would be (or send prompt instead).",
        schema={"type": "array", "minItems": 1, "items": _MESSAGE},
    ),
    F(
        "add_special_tokens",
        "bool",
        (TOKENIZE,),
        "With prompt: add the tokenizer's special tokens (BOS), as completions do. With messages the template writes them: only false.",
        default=True,
    ),
    F(
        "add_generation_prompt",
        "bool",
        (TOKENIZE,),
        "With messages: end with the assistant turn's opening, as chat requests do.",
        default=True,
    ),
    F(
        "continue_final_message",
        "bool",
        (TOKENIZE,),
        "vLLM's: leave the last message open. Not supported: only false.",
        enum=(False,),
    ),
    F(
        "return_token_strs",
        "bool",
        (TOKENIZE,),
        "Also return each token's vocabulary entry.",
        default=False,
    ),
    F(
        "chat_template_kwargs",
        "object",
        (CHAT, TOKENIZE, RESPONSES),
        "Extra variables for the chat template (enable_thinking first of all); the template's "
        "own variables (messages, tools, add_generation_prompt, ...) are refused.",
    ),
    F(
        "reasoning_effort",
        "str",
        (CHAT,),
        "Passed to the chat template as reasoning_effort; none also sets enable_thinking false "
        "unless chat_template_kwargs sets it.",
        enum=("none", "minimal", "low", "medium", "high", "xhigh"),
    ),
    F(
        "tokens",
        "list",
        (DETOKENIZE,),
        "Token ids to turn back into text.",
        required=True,
        schema={**_IDS, "minItems": 1},
    ),
)
del F


@dataclass(frozen=True)
class FieldTable:
    """FIELDS by route and by name, checked once: one row per (route, name)."""

    rows: tuple[ApiField, ...]
    by_route: dict[str, dict[str, ApiField]] = field(default_factory=dict)
    kinds: dict[str, frozenset[str]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        for row in self.rows:
            for route in row.routes:
                fields = self.by_route.setdefault(route, {})
                if row.name in fields:
                    raise ValueError(f"api_fields: {route} has two rows for {row.name!r}")
                fields[row.name] = row
            self.kinds[row.name] = self.kinds.get(row.name, frozenset()) | {row.kind}


TABLE = FieldTable(FIELDS)


class UnknownField(LookupError):
    """A parser read a field that no row of the table lists: add its row to api_fields.FIELDS."""


def field_kind(name: str, kind: str | None = None) -> str:
    """The kind the table gives the field `name` (`kind`, when given, must be one of its rows').
    Raises UnknownField for a name no row lists."""
    kinds = TABLE.kinds.get(name)
    if kinds is None:
        raise UnknownField(f"{name!r} is read from a request but has no row in api_fields.FIELDS")
    if kind is not None:
        if kind not in kinds:
            raise UnknownField(f"{name!r} is read as {kind!r}; api_fields.FIELDS says {kinds}")
        return kind
    if len(kinds) > 1:
        raise UnknownField(f"{name!r} has rows of kinds {sorted(kinds)}: name the kind")
    return next(iter(kinds))


def route_fields(route: str) -> dict[str, ApiField]:
    """The fields of `route`'s body by name (empty for a route without a JSON body)."""
    return TABLE.by_route.get(route, {})
