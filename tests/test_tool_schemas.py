"""Tool schemas as users write them, the same answer in every family and every tool_choice: a
schema is compiled when the request is parsed (an invalid one is refused naming
tools[i].function.parameters, with tool_choice auto as with required); the `$defs` / `$ref`,
`anyOf` and nested objects Pydantic writes are taken, and each family's grammar holds a call's
arguments to them on its demo (random weights: the grammar alone makes them valid); `strict`
gives every object additionalProperties false, as OpenAI's strict mode does."""

from __future__ import annotations

import json
from typing import Annotated, Any

import jsonschema
import pytest
from pydantic import BaseModel, Field

from tensorfold.engine import structured
from tensorfold.engine.sampling import SamplingParams
from tensorfold.engine.tool_schemas import SchemaRefError, resolve, strict, with_defs
from tensorfold.server.tool_request import ToolRequestError, parse_tool_request
from tensorfold_gemma4.tool_calls import FORMAT as GEMMA4
from tensorfold_glm.tool_calls import FORMAT as GLM
from tensorfold_lfm2_moe.tool_calls import FORMAT as LFM2

FORMATS = {"lfm2_moe": LFM2, "glm5_next": GLM, "gemma4": GEMMA4}


class Address(BaseModel):
    city: str = Field(max_length=10)
    zip: str | None = Field(default=None, max_length=5)


class Person(BaseModel):
    name: str = Field(max_length=8)
    age: int = Field(ge=0, le=99)
    home: Address
    tags: list[Annotated[str, Field(max_length=6)]] = Field(max_length=2)


class Node(BaseModel):
    value: int = Field(ge=0, le=9)
    children: list[Node] = Field(default_factory=list, max_length=2)


PERSON = Person.model_json_schema()
NODE = Node.model_json_schema()  # a $ref at its root, and a recursive one
ASK = [[{"role": "user", "content": "Who is there?"}]]


def tool(name: str, parameters: Any, **function: Any) -> dict[str, Any]:
    return {"type": "function", "function": {"name": name, "parameters": parameters, **function}}


def test_pydantic_writes_refs_and_any_of() -> None:
    assert "$defs" in PERSON and PERSON["properties"]["home"] == {"$ref": "#/$defs/Address"}
    assert "anyOf" in PERSON["$defs"]["Address"]["properties"]["zip"]
    assert NODE["$ref"] == "#/$defs/Node"


def test_refs_resolve_within_their_root() -> None:
    home = resolve(PERSON["properties"]["home"], PERSON)
    assert home["properties"]["city"]["maxLength"] == 10
    assert resolve(NODE, NODE)["properties"]["value"]["type"] == "integer"
    assert with_defs({"$ref": "#/$defs/Address"}, PERSON)["$defs"] == PERSON["$defs"]
    with pytest.raises(SchemaRefError, match="does not resolve"):
        resolve({"$ref": "#/$defs/Nope"}, PERSON)
    with pytest.raises(SchemaRefError, match="cycle"):
        resolve({"$ref": "#/$defs/a"}, {"$defs": {"a": {"$ref": "#/$defs/a"}}})


def test_strict_closes_every_object_and_leaves_the_schema_as_it_was() -> None:
    before = json.dumps(PERSON, sort_keys=True)
    closed = strict(PERSON)
    assert json.dumps(PERSON, sort_keys=True) == before
    assert closed["additionalProperties"] is False
    assert closed["$defs"]["Address"]["additionalProperties"] is False
    nested = strict(
        {
            "type": "array",
            "items": {
                "anyOf": [
                    {"type": "object", "properties": {"a": {"type": "object"}}},
                    {"type": "null"},
                ]
            },
        }
    )
    branch = nested["items"]["anyOf"][0]
    assert branch["additionalProperties"] is False
    assert branch["properties"]["a"]["additionalProperties"] is False
    assert "additionalProperties" not in nested["items"]["anyOf"][1]


@pytest.mark.parametrize("family", sorted(FORMATS))
@pytest.mark.parametrize("choice", [None, "auto", "required", "none", "named"])
@pytest.mark.parametrize(
    "parameters, words",
    [
        ({"type": "objekt"}, "objekt"),
        ({"type": "object", "properties": {"x": {"$ref": "#/$defs/missing"}}}, "missing"),
        ({"type": "object", "required": "x"}, "required"),
        ({"type": "object", "properties": {"x": {"type": "string", "pattern": "("}}}, "regex"),
    ],
)
def test_an_invalid_schema_is_refused_in_every_family_and_tool_choice(
    family: str, choice: Any, parameters: dict[str, Any], words: str
) -> None:
    body: dict[str, Any] = {"tools": [tool("ok", {"type": "object"}), tool("f", parameters)]}
    if choice is not None:
        body["tool_choice"] = (
            {"type": "function", "function": {"name": "f"}} if choice == "named" else choice
        )
    with pytest.raises(ToolRequestError) as caught:
        parse_tool_request(body, family, FORMATS[family])
    assert caught.value.param == "tools[1].function.parameters"
    assert words in str(caught.value) and "<state>" not in str(caught.value)


@pytest.mark.parametrize("family", sorted(FORMATS))
@pytest.mark.parametrize("schema", [PERSON, NODE], ids=["person", "node"])
def test_each_family_compiles_the_ref_schemas(family: str, schema: dict[str, Any]) -> None:
    tools = [tool("f", schema), tool("g", schema, strict=True)]
    request = parse_tool_request(
        {"tools": tools, "tool_choice": "required"}, family, FORMATS[family]
    )
    assert request is not None
    offered = [structured.strict_tool(t) for t in request.tools]
    lark = FORMATS[family].grammar(offered, True, json.dumps)
    llg = structured._llg()
    assert llg.LLMatcher.validate_grammar(llg.LLMatcher.grammar_from_lark(lark)) == ""


@pytest.mark.parametrize("family", sorted(FORMATS))
def test_each_family_holds_a_call_to_the_pydantic_schema(
    family: str, tmp_path_factory: pytest.TempPathFactory
) -> None:
    """tool_choice required on the family's demo, random weights: the one call's arguments
    validate against the $ref / anyOf schema, closed by hand or by `strict` (an open object
    lets a random model add properties until max_tokens)."""
    from tensorfold.testing import close_even, open_llm

    llm = open_llm(
        family,
        None,
        parallel=2,
        load_format="dummy",
        demo_cache=tmp_path_factory.mktemp(f"schemas-{family}"),
    )
    try:
        for strictly, seed in ((False, 3), (True, 5)):
            tools = [tool("register", PERSON if strictly else strict(PERSON), strict=strictly)]
            out = llm.chat(
                ASK,
                SamplingParams(temperature=1.0, seed=seed, max_tokens=300),
                tools=tools,
                tool_choice="required",
                parallel_tool_calls=False,
            )[0]
            assert out.finish_reason == "tool_calls", out.text
            (call,) = out.tool_calls
            jsonschema.validate(json.loads(call.arguments), strict(PERSON))
    finally:
        close_even(llm)


def test_strict_response_format_refuses_other_properties(tmp_path_factory: Any) -> None:
    from tensorfold.testing import close_even, open_llm

    llm = open_llm(
        "lfm2_moe",
        None,
        parallel=1,
        load_format="dummy",
        demo_cache=tmp_path_factory.mktemp("schemas-strict"),
    )
    try:
        schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
        ids = llm.tokenizer.encode('{"a":1,"b":2}')
        taken = {}
        for strictly in (False, True):
            constraint = structured.response_format(
                {
                    "type": "json_schema",
                    "json_schema": {"name": "t", "schema": schema, "strict": strictly},
                },
                llm.tokenizer,
            )
            taken[strictly] = constraint.start().matcher.try_consume_tokens(ids)
        assert taken[False] == len(ids) and taken[True] < len(ids)
    finally:
        close_even(llm)


@pytest.mark.parametrize("depth", [450, 2000])
@pytest.mark.parametrize("strictly", [False, True])
def test_a_schema_nested_too_deeply_is_refused_not_a_crash(depth: int, strictly: bool) -> None:
    """450 objects deep still arrives in a JSON body (llguidance's own limit refuses it); 2000
    does not, but an offline caller may pass it (Python's recursion limit refuses it)."""
    schema: dict[str, Any] = {"type": "integer"}
    for _ in range(depth):
        schema = {"type": "object", "properties": {"a": schema}}
    body = {"tools": [tool("f", schema, strict=strictly)], "tool_choice": "required"}
    with pytest.raises(ToolRequestError) as caught:
        parse_tool_request(body, "lfm2_moe", LFM2)
    assert caught.value.param == "tools[0].function.parameters"
