"""The described API: the field table against what the parsers read, /openapi.json (validated,
its paths the router's), /docs, /tokenize and /detokenize, and the access log. One demo model
opened in-process for the module; the app runs on aiohttp's test server."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Callable

import pytest
from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer
from openapi_spec_validator import validate
from structlog.testing import capture_logs

from tensorfold.cli.commands import build_parser, settings_from_args
from tensorfold.config.settings import Settings
from tensorfold.engine.start import Served, open_served
from tensorfold.server import api_fields
from tensorfold.server.api_fields import TABLE, UnknownField, route_fields
from tensorfold.server.app import create_app
from tensorfold.server.openai_api import ApiError, _get, parse_chat, parse_completion
from tensorfold.server.openapi import build_document
from tensorfold.server.responses_api import parse_responses
from tensorfold.server.tokenize_routes import parse_detokenize, parse_tokenize

MODEL = "lfm2_moe-demo"
PARSERS: dict[str, Callable[[dict[str, Any], Served], Any]] = {
    api_fields.COMPLETIONS: parse_completion,
    api_fields.CHAT: parse_chat,
    api_fields.TOKENIZE: parse_tokenize,
    api_fields.DETOKENIZE: parse_detokenize,
    api_fields.RESPONSES: lambda body, served: parse_responses(body, []),
}
CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}]
TOOL = {
    "type": "function",
    "function": {"name": "f", "parameters": {"type": "object", "properties": {}}},
}
SAMPLING = {
    "model": MODEL,
    "n": 1,
    "best_of": 1,
    "temperature": 0.5,
    "top_p": 0.9,
    "top_k": 5,
    "min_p": 0.1,
    "presence_penalty": 0.1,
    "frequency_penalty": 0.1,
    "repetition_penalty": 1.1,
    "seed": 1,
    "stop": ["zz"],
    "stop_token_ids": [1],
    "ignore_eos": False,
    "logit_bias": {"1": 1},
    "user": "u",
    "return_tokens_as_token_ids": True,
    "stream": True,
    "stream_options": {"include_usage": True},
}
# Rich bodies of each route: together they read every field a parser may read.
BODIES: dict[str, list[dict[str, Any]]] = {
    api_fields.COMPLETIONS: [
        {**SAMPLING, "prompt": "hi", "max_tokens": 2, "logprobs": 2, "echo": False, "suffix": ""},
        {
            "prompt": [1, 2],
            "max_completion_tokens": 2,
            "guided_regex": "a+",
            "prediction": {"type": "content", "content": "hi there"},
        },
    ],
    api_fields.CHAT: [
        {
            **SAMPLING,
            "messages": CHAT,
            "max_tokens": 2,
            "logprobs": True,
            "top_logprobs": 2,
            "tools": [TOOL],
            "tool_choice": "auto",
            "parallel_tool_calls": False,
        },
        {
            "messages": CHAT,
            "max_completion_tokens": 2,
            "response_format": {"type": "json_object"},
            "chat_template_kwargs": {"enable_thinking": False},
            "reasoning_effort": "low",
            "prediction": {"type": "content", "content": [{"type": "text", "text": "hi"}]},
        },
    ],
    api_fields.TOKENIZE: [
        {"model": MODEL, "prompt": "hi", "add_special_tokens": False, "return_token_strs": True},
        {
            "model": MODEL,
            "messages": CHAT,
            "add_generation_prompt": False,
            "continue_final_message": False,
            "tools": [TOOL],
            "chat_template_kwargs": {},
        },
    ],
    api_fields.DETOKENIZE: [{"model": MODEL, "tokens": [1, 2]}],
    api_fields.RESPONSES: [
        {
            **{k: SAMPLING[k] for k in ("model", "seed", "top_k", "min_p", "user", "top_p")},
            **{k: SAMPLING[k] for k in ("temperature", "presence_penalty", "frequency_penalty")},
            "repetition_penalty": 1.1,
            "input": "hi",
            "instructions": "Be brief.",
            "previous_response_id": "resp_1",
            "tools": [{"type": "function", "name": "f", "parameters": {"type": "object"}}],
            "tool_choice": "auto",
            "parallel_tool_calls": False,
            "text": {"format": {"type": "json_object"}},
            "max_output_tokens": 4,
            "reasoning": {"effort": "low"},
            "stream": True,
            "store": False,
            "metadata": {"k": "v"},
            "safety_identifier": "s",
            "prompt_cache_key": "p",
            "service_tier": "auto",
            "truncation": "disabled",
            "chat_template_kwargs": {},
        }
    ],
}


class Reads(dict):  # type: ignore[type-arg]
    """A body that records the names read from it."""

    def __init__(self, body: dict[str, Any]) -> None:
        super().__init__(body)
        self.names: set[str] = set()

    def get(self, name: str, default: Any = None) -> Any:
        self.names.add(name)
        return super().get(name, default)

    def __getitem__(self, name: str) -> Any:
        self.names.add(name)
        return super().__getitem__(name)

    def __contains__(self, name: object) -> bool:
        self.names.add(str(name))
        return super().__contains__(name)


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    cache = tmp_path_factory.mktemp("openapi") / "demo"
    settings = Settings(demo_cache=Path(cache), memory_limit_gib=1, context=4096)
    s = open_served(settings, "lfm2_moe")
    yield s
    s.close()


def call(
    app: web.Application, method: str, path: str, body: Any = None, logs: bool = False
) -> tuple[int, Any, list[dict[str, Any]]]:
    """One request to `app` on a test server: the status, the body (JSON where it is), and the
    access log's lines."""

    async def go() -> tuple[int, Any]:
        async with TestClient(TestServer(app)) as client:
            resp = await client.request(method, path, json=body)
            kind = resp.headers.get("Content-Type", "")
            return resp.status, await (resp.json() if "json" in kind else resp.text())

    with capture_logs() as captured:
        status, answer = asyncio.run(go())
    return status, answer, [c for c in captured if "duration_s" in c]


# --- the table against the parsers ---


def test_each_route_reads_exactly_its_rows(served: Served) -> None:
    assert set(PARSERS) == set(TABLE.by_route)  # a route with rows has a parser here
    for route, parse in PARSERS.items():
        read: set[str] = set()
        for body in BODIES[route]:
            recorder = Reads(body)
            parse(recorder, served)  # the bodies are good: nothing is refused
            read |= recorder.names
        rows = set(route_fields(route))
        assert read - rows == set(), f"{route} reads fields without a row"
        assert rows - read == set(), f"{route} has rows its parser never reads"


def test_get_takes_the_kind_from_the_table() -> None:
    assert _get({"n": 2}, "n") == 2
    assert _get({"logprobs": 3}, "logprobs", "int") == 3  # two rows: the kind says which
    with pytest.raises(ApiError) as refused:
        _get({"n": "2"}, "n")
    assert refused.value.param == "n" and "an integer" in refused.value.message
    with pytest.raises(UnknownField):
        _get({}, "no_such_field", "str")
    with pytest.raises(UnknownField):
        _get({}, "n", "str")  # the table says int
    with pytest.raises(UnknownField):
        _get({}, "logprobs")  # int in one route, bool in another: name the kind


def test_a_route_has_one_row_per_field() -> None:
    with pytest.raises(ValueError, match="two rows"):
        api_fields.FieldTable((*api_fields.FIELDS, api_fields.FIELDS[0]))


# --- the document ---


def test_document_is_valid_and_its_paths_are_the_routers(served: Served) -> None:
    app = create_app(served)
    doc = build_document(app)
    validate(doc)  # OpenAPI 3.1, by openapi-spec-validator
    routes: dict[str, set[str]] = {}
    for route in app.router.routes():
        routes.setdefault(route.resource.canonical, set()).add(route.method.lower())
    assert {p: set(ops) for p, ops in doc["paths"].items()} == routes
    for path, fields in TABLE.by_route.items():
        schema = doc["paths"][path]["post"]["requestBody"]["content"]["application/json"]
        assert set(schema["schema"]["properties"]) == set(fields)
    chat = doc["paths"]["/v1/chat/completions"]["post"]
    props = chat["requestBody"]["content"]["application/json"]["schema"]["properties"]
    assert props["top_p"]["maximum"] == 1 and props["n"]["default"] == 1
    assert chat["security"] == [{}, {"bearer": []}]
    assert "$ref" in str(chat["responses"]["default"])


def test_openapi_json_and_docs_are_served(served: Served) -> None:
    app = create_app(served)
    status, doc, _ = call(app, "GET", "/openapi.json")
    assert status == 200 and doc["openapi"] == "3.1.0" and "/tokenize" in doc["paths"]
    status, page, _ = call(create_app(served), "GET", "/docs")
    assert status == 200 and "POST /v1/chat/completions" in page and "max_tokens" in page


# --- tokenize and detokenize ---


def test_tokenize_a_prompt_and_back(served: Served) -> None:
    app = create_app(served)
    text = "The little cat"
    status, out, _ = call(app, "POST", "/tokenize", {"prompt": text, "return_token_strs": True})
    assert status == 200, out
    assert out["tokens"] == served.tokenizer.encode(text, add_special_tokens=True)
    assert out["count"] == len(out["tokens"]) and out["max_model_len"] == served.window
    assert len(out["token_strs"]) == out["count"]
    bare = {"prompt": text, "add_special_tokens": False}
    status, plain, _ = call(create_app(served), "POST", "/tokenize", bare)
    assert plain["tokens"] == served.tokenizer.encode(text) and plain["token_strs"] is None
    status, back, _ = call(create_app(served), "POST", "/detokenize", {"tokens": plain["tokens"]})
    assert status == 200 and back == {"prompt": text}


def test_tokenize_messages_as_a_chat_request_renders_them(served: Served) -> None:
    app = create_app(served)
    status, out, _ = call(app, "POST", "/tokenize", {"model": MODEL, "messages": CHAT})
    assert status == 200, out
    chat = {"messages": CHAT, "max_tokens": 1, "temperature": 0}
    status, reply, _ = call(create_app(served), "POST", "/v1/chat/completions", chat)
    assert status == 200 and reply["usage"]["prompt_tokens"] == out["count"]
    open_turn = {"messages": CHAT, "add_generation_prompt": False}
    status, shorter, _ = call(create_app(served), "POST", "/tokenize", open_turn)
    assert status == 200 and shorter["count"] < out["count"]
    assert out["tokens"][: shorter["count"]] == shorter["tokens"]


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        ("/tokenize", {}, "prompt"),
        ("/tokenize", {"prompt": "a", "messages": CHAT}, "prompt"),
        ("/tokenize", {"prompt": ""}, "prompt"),
        ("/tokenize", {"prompt": 3}, "prompt"),
        ("/tokenize", {"messages": []}, "messages"),
        ("/tokenize", {"messages": CHAT, "add_special_tokens": True}, "add_special_tokens"),
        ("/tokenize", {"prompt": "a", "model": "other"}, "model"),
        ("/tokenize", {"messages": CHAT, "continue_final_message": True}, "continue_final_message"),
        ("/detokenize", {"tokens": []}, "tokens"),
        ("/detokenize", {"tokens": [1, -1]}, "tokens"),
        ("/detokenize", {"tokens": [10**9]}, "tokens"),
        ("/detokenize", {"tokens": "1 2"}, "tokens"),
    ],
)
def test_bad_tokenize_bodies_name_the_field(
    served: Served, path: str, body: dict[str, Any], param: str
) -> None:
    status, out, _ = call(create_app(served), "POST", path, body)
    assert status in (400, 404) and out["error"]["param"] == param, out


# --- the access log ---


def test_the_access_log_has_a_line_a_request(served: Served) -> None:
    body = {"prompt": "The little", "max_tokens": 2, "temperature": 0}
    status, _, lines = call(create_app(served), "POST", "/v1/completions", body)
    assert status == 200 and len(lines) == 1
    line = lines[0]
    assert line["log_level"] == "info" and line["event"] == "POST /v1/completions 200"
    assert (line["method"], line["route"], line["status"]) == ("POST", "/v1/completions", 200)
    assert line["prompt_tokens"] > 0 and line["completion_tokens"] == 2
    assert line["cached_tokens"] >= 0 and {"ttft_s", "duration_s"} <= set(line)
    streamed = {**body, "stream": True}
    status, events, lines = call(create_app(served), "POST", "/v1/completions", streamed)
    assert status == 200 and events.endswith("data: [DONE]\n\n") and len(lines) == 1
    assert lines[0]["completion_tokens"] == 2 and "ttft_s" in lines[0]
    status, _, lines = call(create_app(served), "POST", "/v1/completions", {"prompt": ""})
    assert status == 400 and [(x["status"], x["route"]) for x in lines] == [
        (400, "/v1/completions")
    ]
    status, _, lines = call(create_app(served), "GET", "/v1/models/nope")
    assert status == 404 and lines[0]["route"] == "/v1/models/{name}"


def test_probes_are_quiet_and_the_flag_turns_the_log_off(served: Served) -> None:
    for path in ("/health", "/metrics"):
        status, _, lines = call(create_app(served), "GET", path)
        assert status == 200 and lines == []
    quiet = create_app(served, access_log=False)
    status, _, lines = call(quiet, "POST", "/tokenize", {"prompt": "hi"})
    assert status == 200 and lines == []


def test_no_access_log_flag_and_setting(tf_env: pytest.MonkeyPatch) -> None:
    args = build_parser().parse_args(["serve", "--no-access-log"])
    assert settings_from_args(args).access_log is False
    assert settings_from_args(build_parser().parse_args(["serve"])).access_log is True
    tf_env.setenv("TF_ACCESS_LOG", "0")
    assert Settings().access_log is False
