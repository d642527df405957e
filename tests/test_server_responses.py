"""/v1/responses against a real `tensorfold serve` of the demo (lfm2_moe), with the official
openai client's `client.responses` calls: a text reply, streamed events in OpenAI's order equal
to the whole reply, a two-turn conversation through previous_response_id that resumes cached
pages, instructions, function calls and their outputs, text.format json_schema, retrieval,
input items, delete, named 400s and 404s, and a store that stays bounded. Without a server:
the store's LRU, the translation to a chat request, and the stream of a reply that thought
(the chat reply's reasoning_content, as a reasoning family writes it) and called."""

from __future__ import annotations

import json
import urllib.request
from collections.abc import Iterator
from typing import Any

import jsonschema
import openai
import pytest
from test_server import ServedDemo, served

from tensorfold.server.openai_api import ApiError
from tensorfold.server.openai_replies import sse
from tensorfold.server.responses_api import parse_responses
from tensorfold.server.responses_replies import ResponseShape, ResponseStream, assistant_turn
from tensorfold.server.responses_routes import _prior
from tensorfold.server.responses_store import ResponsesStore, StoredResponse

MODEL = "lfm2_moe-demo"
KEPT = 4  # TF_RESPONSES_STORE of the module's server
SEEDED: dict[str, Any] = {"temperature": 0.8, "extra_body": {"seed": 5}}
CITY = {
    "type": "object",
    "properties": {"city": {"enum": ["Paris", "Rome", "Oslo"]}},
    "required": ["city"],
    "additionalProperties": False,
}
WEATHER = {
    "type": "function",
    "name": "get_weather",
    "description": "The weather in a city.",
    "parameters": CITY,
}


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServedDemo]:
    env = {"TF_RESPONSES_STORE": str(KEPT)}
    # thinking off: these tests are about the API's shapes, and a demo's reply that thought is
    # tests/test_server_thinking_demos.py's
    flags = ("--parallel", "2", "--reasoning", "off")
    yield from served(tmp_path_factory, "responses", *flags, env=env)


def create(server: ServedDemo, **kw: Any) -> Any:
    kw = {"model": MODEL, "input": "Tell me about rivers.", "max_output_tokens": 12, **kw}
    return server.client().responses.create(**kw)


def test_text_reply(server: ServedDemo) -> None:
    r = create(server, **SEEDED)
    assert r.id.startswith("resp_") and r.object == "response" and r.model == MODEL
    assert r.status in ("completed", "incomplete")
    if r.status == "incomplete":
        assert r.incomplete_details is not None
        assert r.incomplete_details.reason == "max_output_tokens"
    (message,) = r.output
    assert message.type == "message" and message.role == "assistant"
    assert message.content[0].type == "output_text" and message.content[0].annotations == []
    assert r.output_text and r.output_text == message.content[0].text
    u = r.usage
    assert u is not None and 0 < u.output_tokens <= 12 and u.input_tokens > 0
    assert u.total_tokens == u.input_tokens + u.output_tokens
    assert u.output_tokens_details.reasoning_tokens >= 0
    assert server.client().responses.retrieve(r.id).output_text == r.output_text


def test_stream_events_in_order_and_equal_to_the_whole_reply(server: ServedDemo) -> None:
    whole = create(server, **SEEDED)
    events = list(create(server, stream=True, **SEEDED))
    kinds = [e.type for e in events]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    deltas = kinds.count("response.output_text.delta")
    ending = "response.completed" if whole.status == "completed" else "response.incomplete"
    assert kinds == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
        *["response.output_text.delta"] * deltas,
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        ending,
    ]
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text == whole.output_text
    item_id = events[2].item.id
    assert all(e.item_id == item_id for e in events if hasattr(e, "item_id"))
    assert events[-4].text == text and events[-1].response.output_text == text
    assert events[-1].response.usage.output_tokens == whole.usage.output_tokens
    stored = server.client().responses.retrieve(events[-1].response.id)
    assert stored.output_text == text


def test_stream_is_server_sent_events_with_event_lines(server: ServedDemo) -> None:
    body = {"model": MODEL, "input": "Hi", "max_output_tokens": 4, "stream": True}
    request = urllib.request.Request(
        server.url + "/responses",
        json.dumps(body).encode(),
        {"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(request, timeout=60) as r:
        assert r.headers["Content-Type"].startswith("text/event-stream")
        blocks = r.read().decode().strip().split("\n\n")
    for block in blocks:
        event, data = block.split("\n")
        assert event.removeprefix("event: ") == json.loads(data.removeprefix("data: "))["type"]


def test_two_turns_through_previous_response_id_resume_cached_pages(server: ServedDemo) -> None:
    first = create(server, instructions="Answer briefly.", input="Tell me about lakes.")
    with server.client().responses.stream(
        model=MODEL,
        instructions="Answer briefly.",
        input="And rivers?",
        previous_response_id=first.id,
        max_output_tokens=12,
    ) as stream:
        events = list(stream)
    # the last event carries the response: response.completed, or response.incomplete when
    # the unseeded reply reaches max_output_tokens (the client's get_final_response takes only
    # the first)
    assert events[-1].type in ("response.completed", "response.incomplete")
    second = events[-1].response
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert second.output_text == text
    assert second.previous_response_id == first.id
    assert second.usage.input_tokens > first.usage.input_tokens + first.usage.output_tokens
    assert second.usage.input_tokens_details.cached_tokens > 0
    items = server.client().responses.input_items.list(second.id, order="asc")
    assert [i.content[0].text for i in items.data] == ["And rivers?"]


def test_instructions_reach_the_prompt(server: ServedDemo) -> None:
    instructions, ask = "You are a poet.", "Tell me about rivers."
    r = create(server, instructions=instructions, input=ask, max_output_tokens=2)
    chat = server.client().chat.completions.create(
        model=MODEL,
        messages=[{"role": "system", "content": instructions}, {"role": "user", "content": ask}],
        max_tokens=2,
    )
    assert chat.usage is not None and r.usage.input_tokens == chat.usage.prompt_tokens
    assert r.instructions == instructions
    plain = create(server, input=ask, max_output_tokens=2)
    assert plain.usage.input_tokens < r.usage.input_tokens


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_function_call_and_its_output(server: ServedDemo, stream: bool) -> None:
    kw: dict[str, Any] = {
        "input": "What is the weather in Paris?",
        "tools": [WEATHER],
        "tool_choice": {"type": "function", "name": "get_weather"},
        "max_output_tokens": 120,
    }
    if stream:
        events = list(create(server, stream=True, **kw))
        kinds = [e.type for e in events]
        assert "response.function_call_arguments.delta" in kinds
        done = next(e for e in events if e.type == "response.function_call_arguments.done")
        r = events[-1].response
        assert r.output[-1].arguments == done.arguments
    else:
        r = create(server, **kw)
    calls = [item for item in r.output if item.type == "function_call"]
    assert r.status == "completed" and len(calls) == 1
    call = calls[0]
    assert call.name == "get_weather" and call.id.startswith("fc_")
    assert call.call_id.startswith("call_")
    jsonschema.validate(json.loads(call.arguments), CITY)
    answer = {"type": "function_call_output", "call_id": call.call_id, "output": "sunny, 21C"}
    follow = create(server, input=[answer], previous_response_id=r.id, tools=[WEATHER])
    assert follow.status in ("completed", "incomplete")
    assert follow.usage.input_tokens_details.cached_tokens > 0


def test_a_whole_conversation_as_input_items(server: ServedDemo) -> None:
    items: list[Any] = [
        {"role": "user", "content": [{"type": "input_text", "text": "Weather in Rome?"}]},
        {"type": "reasoning", "summary": [], "content": [{"type": "reasoning_text", "text": "."}]},
        {
            "type": "function_call",
            "call_id": "call_1",
            "name": "get_weather",
            "arguments": '{"city": "Rome"}',
        },
        {"type": "function_call_output", "call_id": "call_1", "output": "rain"},
        {"role": "assistant", "content": [{"type": "output_text", "text": "It rains."}]},
        {"role": "user", "content": "Thanks"},
    ]
    r = create(server, input=items, tools=[WEATHER], max_output_tokens=4)
    listed = server.client().responses.input_items.list(r.id, order="asc", limit=2)
    assert [i.type for i in listed.data] == ["message", "function_call"] and listed.has_more


def test_text_format_json_schema(server: ServedDemo) -> None:
    fmt = {"type": "json_schema", "name": "city", "schema": CITY, "strict": True}
    r = create(server, input="Name a city.", text={"format": fmt}, max_output_tokens=40)
    assert r.status == "completed"
    jsonschema.validate(json.loads(r.output_text), CITY)
    assert r.text is not None and r.text.format.type == "json_schema"


@pytest.mark.parametrize(
    "fields, param, words",
    [
        ({"background": True}, "background", "background is not supported"),
        ({"tools": [{"type": "web_search"}]}, "tools", 'tools[0].type must be "function"'),
        ({"include": ["reasoning.encrypted_content"]}, "include", "include is not supported"),
        ({"truncation": "auto"}, "truncation", "disabled"),
        (
            {"input": [{"role": "user", "content": [{"type": "input_file", "file_id": "x"}]}]},
            "input",
            "input[0].content[0] must be a text part",
        ),
        (  # the demo's family has no vision tower
            {"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
            "input",
            "the lfm2_moe family takes no images",
        ),
        ({"input": [{"type": "item_reference", "id": "x"}]}, "input", "item_reference"),
        ({"text": {"format": {"type": "yaml"}}}, "text", "text.format.type"),
        ({"max_output_tokens": 0}, "max_output_tokens", "max_output_tokens"),
        ({"tool_choice": "sometimes", "tools": [WEATHER]}, "tool_choice", '"required"'),
        ({"metadata": {"k": 1}}, "metadata", "metadata"),
    ],
)
def test_unsupported_fields_are_400_naming_them(
    server: ServedDemo, fields: dict[str, Any], param: str, words: str
) -> None:
    body = {"model": MODEL, "input": "Hi", "max_output_tokens": 2, **fields}
    with pytest.raises(openai.BadRequestError) as caught:
        server.client().responses.create(**body)
    error = caught.value.body
    assert isinstance(error, dict) and error["param"] == param and words in error["message"]


def test_unknown_ids_are_404(server: ServedDemo) -> None:
    client = server.client()
    with pytest.raises(openai.NotFoundError) as caught:
        create(server, previous_response_id="resp_nope")
    assert isinstance(caught.value.body, dict)
    assert caught.value.body["param"] == "previous_response_id"
    assert caught.value.body["code"] == "previous_response_not_found"
    for call in (client.responses.retrieve, client.responses.delete):
        with pytest.raises(openai.NotFoundError):
            call("resp_nope")


def test_delete_then_retrieve_is_404(server: ServedDemo) -> None:
    client = server.client()
    r = create(server, max_output_tokens=2)
    client.responses.delete(r.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(r.id)
    unstored = create(server, max_output_tokens=2, store=False)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(unstored.id)


def test_the_store_stays_bounded(server: ServedDemo) -> None:
    ids = [create(server, max_output_tokens=1).id for _ in range(KEPT + 1)]
    client = server.client()
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(ids[0])
    assert [client.responses.retrieve(i).id for i in ids[1:]] == ids[1:]
    assert create(server, max_output_tokens=1).status in ("completed", "incomplete")
    server.wait_even()


def test_store_lru_and_off() -> None:
    store = ResponsesStore(2)
    for name in "abc":
        store.put(StoredResponse({"id": name}, []))
        if name == "b":
            assert store.get("a") is not None  # a is now the most recent
    assert len(store) == 2 and store.get("b") is None and store.get("a") is not None
    off = ResponsesStore(0)
    off.put(StoredResponse({"id": "a"}, []))
    assert len(off) == 0
    with pytest.raises(ApiError) as caught:
        _prior(off, {"previous_response_id": "a"})
    assert caught.value.status == 400 and "TF_RESPONSES_STORE=0" in caught.value.message


def test_translation_to_a_chat_request() -> None:
    prior = [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]
    body = {
        "instructions": "be brief",
        "input": "c",
        "tools": [WEATHER],
        "tool_choice": {"type": "function", "name": "get_weather"},
        "text": {"format": {"type": "json_object"}},
        "max_output_tokens": 9,
        "reasoning": {"effort": "low"},
    }
    chat = parse_responses(body, prior).chat
    assert chat["messages"] == [
        {"role": "system", "content": "be brief"},
        *prior,
        {"role": "user", "content": "c"},
    ]
    assert chat["tools"] == [
        {
            "type": "function",
            "function": {k: WEATHER[k] for k in ("name", "description", "parameters")},
        }
    ]
    assert chat["tool_choice"] == {"type": "function", "function": {"name": "get_weather"}}
    assert chat["response_format"] == {"type": "json_object"}
    assert chat["max_completion_tokens"] == 9 and chat["reasoning_effort"] == "low"


def chat_chunk(delta: dict[str, Any], finish: str | None = None) -> bytes:
    return sse({"choices": [{"index": 0, "delta": delta, "finish_reason": finish}]})


def test_a_reply_that_thought_and_called_streams_each_item_in_order() -> None:
    """Chat stream chunks as a reasoning family's reply gives them (delta.reasoning_content
    first) -> the reasoning item, the message, the call, each opened and closed in turn."""
    shape = ResponseShape(parse_responses({"input": "hi"}, []), MODEL)
    stream = ResponseStream(shape)
    call = {"index": 0, "id": "call_1", "type": "function", "function": {"name": "f"}}
    data = stream.start()
    data += stream.feed(chat_chunk({"reasoning_content": "let me "}))
    data += stream.feed(chat_chunk({"reasoning_content": "see"}))
    data += stream.feed(chat_chunk({"content": "Calling."}))
    data += stream.feed(chat_chunk({"tool_calls": [{**call, "function": {"name": "f"}}]}))
    data += stream.feed(chat_chunk({"tool_calls": [{"index": 0, "function": {"arguments": "{}"}}]}))
    data += stream.feed(chat_chunk({}, "tool_calls"))
    chat_usage = {
        "prompt_tokens": 5,
        "completion_tokens": 7,
        "total_tokens": 12,
        "prompt_tokens_details": {"cached_tokens": 2},
        "completion_tokens_details": {"reasoning_tokens": 3},
    }
    end, response = stream.end(chat_usage)
    events = [json.loads(b.split(b"\ndata: ")[1]) for b in (data + end).strip().split(b"\n\n")]
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    assert [e["type"].removeprefix("response.") for e in events] == [
        "created",
        "in_progress",
        "output_item.added",
        "content_part.added",
        "reasoning_text.delta",
        "reasoning_text.delta",
        "reasoning_text.done",
        "content_part.done",
        "output_item.done",
        "output_item.added",
        "content_part.added",
        "output_text.delta",
        "output_text.done",
        "content_part.done",
        "output_item.done",
        "output_item.added",
        "function_call_arguments.delta",
        "function_call_arguments.done",
        "output_item.done",
        "completed",
    ]
    assert [e.get("output_index") for e in events[2:-1]] == [0] * 7 + [1] * 6 + [2] * 4
    reasoning, message, function_call = response["output"]
    assert reasoning["content"] == [{"type": "reasoning_text", "text": "let me see"}]
    assert message["content"][0]["text"] == "Calling." and function_call["arguments"] == "{}"
    assert function_call["call_id"] == "call_1" and function_call["name"] == "f"
    assert response["status"] == "completed" and events[-1]["response"] == response
    assert response["usage"]["output_tokens_details"] == {"reasoning_tokens": 3}
    assert response["usage"]["input_tokens_details"] == {"cached_tokens": 2}
    turn = assistant_turn(response["output"])
    assert turn["reasoning_content"] == "let me see" and turn["content"] == "Calling."
    assert turn["tool_calls"] == [
        {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": "{}"}}
    ]


def test_a_whole_reply_that_thought_gives_a_reasoning_item_first() -> None:
    shape = ResponseShape(parse_responses({"input": "hi"}, []), MODEL)
    message = {"role": "assistant", "content": "Hello", "reasoning_content": "greet"}
    chat = {"choices": [{"index": 0, "message": message, "finish_reason": "length"}]}
    response = shape.whole({**chat, "usage": None})
    assert [item["type"] for item in response["output"]] == ["reasoning", "message"]
    assert response["status"] == "incomplete"
    assert response["incomplete_details"] == {"reason": "max_output_tokens"}
