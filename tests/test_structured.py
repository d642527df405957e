"""Structured output on the demo checkpoint (lfm2_moe, random weights): the grammar alone must
make every reply valid. JSON schemas of a varied set validate (jsonschema), json_object parses,
regex and choice match, tool_choice required / named give calls whose arguments validate; a
constrained row alone equals it among others, n constrained choices equal their single twins,
resumed equals fresh with constraints on; malformed schemas, regexes and grammars are refused
before any pass; the census is even after."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from dataclasses import replace
from typing import Any

import jsonschema
import pytest

from tensorfold.engine import structured
from tensorfold.engine.choices import choice_seed
from tensorfold.engine.sampling import SamplingParams, SamplingParamsError
from tensorfold.engine.structured import StructuredError

MAX_TOKENS = 160
GREEDY = SamplingParams(temperature=0, max_tokens=MAX_TOKENS)
SAMPLED = SamplingParams(temperature=1.0, seed=22, max_tokens=MAX_TOKENS)
NAME = {"type": "string", "maxLength": 12}
SCHEMAS: dict[str, dict[str, Any]] = {
    "flat": {
        "type": "object",
        "properties": {"name": NAME, "age": {"type": "integer", "minimum": 0, "maximum": 120}},
        "required": ["name", "age"],
        "additionalProperties": False,
    },
    "nested": {
        "type": "object",
        "properties": {
            "user": {
                "type": "object",
                "properties": {
                    "id": {"type": "integer", "minimum": 1, "maximum": 9999},
                    "name": NAME,
                },
                "required": ["id"],
                "additionalProperties": False,
            },
            "active": {"type": "boolean"},
        },
        "required": ["user", "active"],
        "additionalProperties": False,
    },
    "array_enum": {
        "type": "object",
        "properties": {
            "colour": {"enum": ["red", "green", "blue"]},
            "tags": {"type": "array", "items": NAME, "minItems": 1, "maxItems": 3},
        },
        "required": ["colour", "tags"],
        "additionalProperties": False,
    },
    "numbers_optional": {
        "type": "object",
        "properties": {
            "x": {"type": "number", "minimum": -10, "maximum": 10},
            "unit": {"type": "string", "enum": ["m", "km"]},
            "note": NAME,
        },
        "required": ["x"],
        "additionalProperties": False,
    },
    "array_of_objects": {
        "type": "array",
        "minItems": 1,
        "maxItems": 2,
        "items": {
            "type": "object",
            "properties": {
                "k": {"type": "string", "maxLength": 4},
                "v": {"type": ["integer", "null"], "minimum": 0, "maximum": 50},
            },
            "required": ["k", "v"],
            "additionalProperties": False,
        },
    },
}
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {
            "type": "object",
            "properties": {"city": NAME, "days": {"type": "integer", "minimum": 1, "maximum": 7}},
            "required": ["city"],
            "additionalProperties": False,
        },
    },
}
TIME = {
    "type": "function",
    "function": {
        "name": "get_time",
        "parameters": {
            "type": "object",
            "properties": {"zone": {"enum": ["CET", "UTC"]}},
            "required": ["zone"],
            "additionalProperties": False,
        },
    },
}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


def schema_format(schema: dict[str, Any]) -> dict[str, Any]:
    return {"type": "json_schema", "json_schema": {"name": "t", "schema": schema, "strict": True}}


@pytest.fixture(scope="module")
def llm(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    from tensorfold.testing import close_even, open_llm

    # random weights drawn in place (the demo's trained ones write its stories): the grammar,
    # not the model, must make the output valid
    engine = open_llm(
        "lfm2_moe",
        None,
        parallel=4,
        kv_poison=True,
        load_format="dummy",
        demo_cache=tmp_path_factory.mktemp("structured-demo"),
    )
    yield engine
    close_even(engine)


@pytest.mark.parametrize("params", [GREEDY, SAMPLED], ids=["greedy", "sampled"])
@pytest.mark.parametrize("name", sorted(SCHEMAS))
def test_replies_validate_against_each_schema(llm: Any, name: str, params: SamplingParams) -> None:
    schema = SCHEMAS[name]
    out = llm.generate(
        ["Tell me about the little engine."], params, response_format=schema_format(schema)
    )[0]
    assert out.finish_reason == "stop", out.text
    jsonschema.validate(json.loads(out.text), schema)


def test_the_grammar_changes_what_the_model_writes(llm: Any) -> None:
    free = llm.generate(["Tell me"], GREEDY)[0].text
    with pytest.raises(ValueError):
        json.loads(free)  # the random demo writes no JSON unless the grammar makes it


@pytest.mark.parametrize("params", [GREEDY, SAMPLED], ids=["greedy", "sampled"])
def test_json_object_regex_and_choice(llm: Any, params: SamplingParams) -> None:
    prompts = ["Once upon a time", "One, two,"]
    # json_object bounds no string, so a random model may write one past max_tokens: a reply
    # cut by the length is still a prefix the grammar allows; every finished one parses
    any_object = structured.json_object(llm.tokenizer)
    replies = llm.generate([*prompts, "Tell me"], params, response_format={"type": "json_object"})
    assert any(c.finish_reason == "stop" for c in replies)
    for c in replies:
        if c.finish_reason == "stop":
            assert isinstance(json.loads(c.text), dict), c.text
        else:
            matcher = any_object.start()
            assert c.text.startswith("{") and all(matcher.accept(t) is None for t in c.token_ids)
    pattern = r"[a-z]{3}-[0-9]{2,4}"
    for c in llm.generate(prompts, params, response_format={"guided_regex": pattern}):
        assert c.finish_reason == "stop" and re.fullmatch(pattern, c.text), c.text
    outputs = {"structured_outputs": {"choice": ["yes", "no", "maybe"]}}
    for c in llm.generate(prompts, params, response_format=outputs):
        assert c.text in ("yes", "no", "maybe")
    lark = {"guided_grammar": 'start: "(" num ("+" num)* ")"\nnum: /[0-9]{1,3}/'}
    for c in llm.generate(prompts, params, response_format=lark):
        assert re.fullmatch(r"\([0-9]{1,3}(\+[0-9]{1,3})*\)", c.text), c.text
    gbnf = {"guided_grammar": 'root ::= "x" [0-9] [0-9]?'}
    for c in llm.generate(prompts, params, response_format=gbnf):
        assert re.fullmatch(r"x[0-9][0-9]?", c.text), c.text


@pytest.mark.parametrize(
    "choice",
    ["required", {"type": "function", "function": {"name": "get_time"}}],
    ids=["required", "named"],
)
def test_constrained_tool_calls_parse_and_validate(llm: Any, choice: Any) -> None:
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in (WEATHER, TIME)}
    for params in (GREEDY, SAMPLED, replace(SAMPLED, seed=5)):
        # greedy, the random weights repeat calls to the end of max_tokens: one call
        parallel = params is not GREEDY
        out = llm.chat(
            [ASK], params, tools=[WEATHER, TIME], tool_choice=choice, parallel_tool_calls=parallel
        )[0]
        assert out.finish_reason == "tool_calls" and out.content is None, out.text
        assert out.tool_calls
        for call in out.tool_calls:
            if isinstance(choice, dict):
                assert call.name == "get_time"
            jsonschema.validate(json.loads(call.arguments), schemas[call.name])
    one = llm.chat(
        [ASK], SAMPLED, tools=[WEATHER, TIME], tool_choice="required", parallel_tool_calls=False
    )[0]
    assert len(one.tool_calls) == 1


def test_a_constrained_row_alone_equals_it_among_others(llm: Any) -> None:
    fmt = schema_format(SCHEMAS["nested"])
    for params in (GREEDY, SAMPLED):
        alone = llm.generate(["Once upon a time"], params, response_format=fmt)[0]
        constrained = replace(
            params, constraint=structured.json_schema(SCHEMAS["nested"], llm.tokenizer)
        )
        others = [replace(params, seed=7), constrained, GREEDY, replace(constrained, seed=99)]
        got = llm.generate(["One, two,", "Once upon a time", "Tell me", "Once upon a time"], others)
        assert got[1].token_ids == alone.token_ids and got[1].text == alone.text
        assert got[3].finish_reason == "stop"
        jsonschema.validate(json.loads(got[3].text), SCHEMAS["nested"])


def test_constrained_choices_equal_their_single_twins(llm: Any) -> None:
    fmt = schema_format(SCHEMAS["array_enum"])
    choices = llm.generate(["The little engine"], SAMPLED, n=3, response_format=fmt)
    assert len({c.text for c in choices}) > 1  # sampled apart
    for i, c in enumerate(choices):
        twin = llm.generate(
            ["The little engine"],
            replace(SAMPLED, seed=choice_seed(SAMPLED.seed, i)),
            response_format=fmt,
        )[0]
        assert (c.token_ids, c.text, c.logprobs) == (twin.token_ids, twin.text, twin.logprobs)
        jsonschema.validate(json.loads(c.text), SCHEMAS["array_enum"])


def test_resumed_equals_fresh_with_constraints(tmp_path_factory: pytest.TempPathFactory) -> None:
    from tensorfold.testing import close_even, open_llm

    demo = tmp_path_factory.mktemp("structured-store")
    chat = [{"role": "user", "content": "The little engine woke before dawn. " * 40}]
    fmt = schema_format(SCHEMAS["flat"])
    fresh_llm = open_llm("lfm2_moe", None, parallel=2, demo_cache=demo)
    try:
        fresh = fresh_llm.chat([chat], SAMPLED, response_format=fmt)[0]
    finally:
        close_even(fresh_llm)
    kept = open_llm(
        "lfm2_moe", None, parallel=2, demo_cache=demo, kv_share=8, prompt_cache_gib=0.05
    )
    try:
        kept.chat([chat], GREEDY, response_format=fmt)  # keeps the prompt's state
        resumed = kept.chat([chat], SAMPLED, response_format=fmt)[0]
    finally:
        close_even(kept)
    assert resumed.cached_tokens > 0
    assert (resumed.token_ids, resumed.text) == (fresh.token_ids, fresh.text)


@pytest.mark.parametrize(
    "fields, param, words",
    [
        (
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"schema": {"type": "objekt"}},
                }
            },
            "response_format",
            "objekt",
        ),
        (
            {"response_format": {"type": "json_schema", "json_schema": {"schema": "{nope"}}},
            "response_format",
            "not valid JSON",
        ),
        ({"response_format": {"type": "xml"}}, "response_format", "json_schema"),
        ({"response_format": {"type": "json_schema"}}, "response_format", "json_schema must be"),
        ({"guided_regex": "a(b"}, "guided_regex", "unclosed group"),
        ({"guided_grammar": "start: foo"}, "guided_grammar", "foo"),
        ({"guided_choice": []}, "guided_choice", "non-empty"),
        ({"structured_outputs": {"regex": "a", "json": {}}}, "structured_outputs", "exactly one"),
        ({"structured_outputs": {"xml": 1}}, "structured_outputs", "xml"),
        (
            {"guided_regex": "a", "response_format": {"type": "json_object"}},
            "guided_regex",
            "send one",
        ),
    ],
)
def test_malformed_constraints_are_refused_naming_the_problem(
    llm: Any, fields: dict[str, Any], param: str, words: str
) -> None:
    with pytest.raises(StructuredError) as caught:
        structured.from_body(fields, llm.tokenizer)
    assert caught.value.param == param and words in str(caught.value), str(caught.value)


def test_text_format_is_no_constraint_and_ignore_eos_is_refused(llm: Any) -> None:
    assert structured.from_body({"response_format": {"type": "text"}}, llm.tokenizer) is None
    constraint = structured.json_object(llm.tokenizer)
    with pytest.raises(SamplingParamsError, match="ignore_eos"):
        SamplingParams(ignore_eos=True, constraint=constraint)
    with pytest.raises(SamplingParamsError, match="constraint"):
        SamplingParams(constraint="json")


def test_a_finished_stream_drops_its_matcher(llm: Any) -> None:
    lanes = llm.served.engine.lanes
    taken = []
    real = lanes._take

    def spy(s: Any, t: int, result: Any, refused: str | None = None) -> None:
        taken.append(s)
        real(s, t, result, refused)

    lanes._take = spy
    try:
        llm.generate(["Tell me"], GREEDY, response_format={"type": "json_object"})
    finally:
        del lanes._take
    assert taken and all(s.matcher is None for s in taken)


def test_a_cancelled_stream_drops_its_matcher_and_the_lane_serves_on(llm: Any) -> None:
    import threading

    from tensorfold.engine.requests import Finished, TokenOut

    engine = llm.served.engine
    live: list[Any] = []
    first, ended = threading.Event(), threading.Event()
    events: list[Any] = []

    def sink(event: Any) -> None:
        events.append(event)
        if isinstance(event, TokenOut):
            live.extend(s for s in engine.lanes.live if s.req.id == event.request_id)
            first.set()
        elif isinstance(event, Finished):
            ended.set()

    params = replace(
        SAMPLED, max_tokens=400, constraint=structured.regex("[a-z ]{2000}", llm.tokenizer)
    )
    req = engine.submit(llm.encode("Tell me"), params, sink)
    assert first.wait(60)
    assert live and live[0].matcher is not None
    engine.cancel(req)
    assert ended.wait(60) and events[-1].reason == "cancelled"
    assert live[0].matcher is None
    out = llm.generate(["Tell me"], GREEDY, response_format={"guided_regex": "[0-9]{3}"})[0]
    assert re.fullmatch("[0-9]{3}", out.text)


def test_masks_of_a_batch_are_each_rows_own_bitmask(llm: Any) -> None:
    """mask_rows fills the rows' bitmasks together (llguidance's thread pool) and applies them
    in one fill: each row gets exactly the tokens its own matcher allows (as llguidance's
    bitmask says, bit j of word i for token 32 i + j), ids past the tokenizer's never; rows
    without a matcher are untouched."""
    import numpy as np
    import torch

    tok = llm.tokenizer
    constraint = structured.json_schema(
        {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}, tok
    )
    matchers = [constraint.start() for _ in range(3)]
    for token in tok.encode('{"a":1')[:3]:
        matchers[1].accept(token)
    vocab = tok.vocab_size + 7
    x = torch.randn(4, vocab, generator=torch.Generator().manual_seed(0))
    out = x.clone()
    structured.mask_rows(out, [(0, matchers[0]), (1, matchers[1]), (3, matchers[2])])
    assert torch.equal(out[2], x[2])
    for row, m in ((0, matchers[0]), (1, matchers[1]), (3, matchers[2])):
        bits = np.unpackbits(
            np.frombuffer(m.matcher.compute_bitmask(), dtype=np.uint8), bitorder="little"
        )[: tok.vocab_size].astype(bool)
        allowed = torch.zeros(vocab, dtype=torch.bool)
        allowed[: tok.vocab_size] = torch.from_numpy(bits)
        assert torch.equal(out[row], x[row].masked_fill(~allowed, float("-inf")))
        assert 0 < int(allowed.sum()) < tok.vocab_size
    assert not torch.equal(out[0].isinf(), out[1].isinf())  # the rows' own states, not one mask
    every = x[[0, 1, 3]].clone()  # every row constrained: the one-fill path
    structured.mask_rows(every, list(enumerate(matchers)))
    assert torch.equal(every, out[[0, 1, 3]])


def test_accept_rows_advances_each_matcher_and_names_a_refusal(llm: Any) -> None:
    tok = llm.tokenizer
    constraint = structured.regex("ab+", tok)
    good, bad = constraint.start(), constraint.start()
    a, b = tok.encode("a")[-1], tok.encode("b")[-1]
    got = structured.accept_rows([(good, a), (bad, b)])
    assert got[0] is None and isinstance(got[1], str) and got[1]
    assert bad.matcher.is_error() and not good.matcher.is_error()
    assert structured.accept_rows([(good, b)]) == [None]
