"""A grammar's work is bounded and its failures are the request's: compiled eagerly (first mask
and a few tokens walked) while the request is parsed, within a GrammarBudget; one past it is a
StructuredError naming its field, with none of llguidance's internal state; one that still fails
mid-generation ends its own row with a clean message while the others go on, census even."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import replace
from typing import Any

import pytest

from tensorfold.engine import structured
from tensorfold.engine.sampling import SamplingParams
from tensorfold.engine.structured import Constraint, GrammarBudget, StructuredError

HOSTILE_REGEX = "((a{100}){100}){100}"  # a million a's: llguidance's lexer runs out of fuel
INTERNALS = ("<state>", "Tokens:", "grm_prefix", "non-verbose", "lexer_cost")
SMALL = GrammarBudget(lexer_fuel=100_000)


@pytest.fixture(scope="module")
def llm(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    from tensorfold.testing import close_even, open_llm

    engine = open_llm(
        "lfm2_moe",
        None,
        parallel=2,
        load_format="dummy",
        demo_cache=tmp_path_factory.mktemp("grammar-demo"),
    )
    yield engine
    close_even(engine)


def clean(message: str) -> bool:
    return not any(word in message for word in INTERNALS) and "\n" not in message


@pytest.mark.parametrize("budget", [None, SMALL], ids=["default", "small"])
def test_a_regex_past_the_lexer_budget_is_refused_when_parsed(llm: Any, budget: Any) -> None:
    with pytest.raises(StructuredError) as caught:
        structured.regex(HOSTILE_REGEX, llm.tokenizer, budget=budget)
    assert caught.value.param == "guided_regex"
    assert "budget" in str(caught.value) and clean(str(caught.value)), str(caught.value)


def test_a_grammar_past_its_size_is_refused_naming_the_field(llm: Any) -> None:
    schema = {"type": "object", "properties": {f"p{i}": {"type": "string"} for i in range(50)}}
    with pytest.raises(StructuredError) as caught:
        structured.json_schema(
            schema, llm.tokenizer, "response_format", budget=GrammarBudget(max_size=50)
        )
    assert caught.value.param == "response_format" and clean(str(caught.value))


def test_the_row_matcher_starts_from_the_warmed_one(llm: Any) -> None:
    constraint = structured.regex("[0-9]{3}", llm.tokenizer)
    assert constraint.param == "guided_regex" and constraint.matcher is not None
    row = constraint.start()
    assert row.matcher is not constraint.matcher
    token = llm.tokenizer.encode("1")[-1]
    assert row.accept(token) is None
    assert not constraint.matcher.is_error()  # the shared one never advances


def test_llguidance_messages_lose_their_internals() -> None:
    raw = "lexer error: too many expressions constructed\n<state>\nTokens: ⟦a⟧\n</state>"
    assert structured.llg_message(raw) == "lexer error: too many expressions constructed"
    assert structured.llg_message("x\n<non-verbose/>") == "x"
    assert len(structured.llg_message("y" * 5000)) == 400


def test_a_grammar_failing_mid_generation_stops_its_row_alone(llm: Any) -> None:
    """A matcher past its budget at its first token (the compile-time walk skipped, as if the
    budget ran out later): that row ends with an error naming its field, no internals; the
    row beside it finishes as usual and the census is even (the fixture's close)."""
    llg = structured._llg()
    lltok = structured.ll_tokenizer(llm.tokenizer)
    grammar = llg.LLMatcher.grammar_from_regex(HOSTILE_REGEX)
    unwalked = llg.LLMatcher(lltok, grammar, log_level=0, limits=SMALL.limits())
    failing = Constraint("regex", grammar, lltok, "guided_regex", unwalked)
    plain = SamplingParams(temperature=0, max_tokens=12)
    bad, good = llm.generate(["Tell me", "Once upon"], [replace(plain, constraint=failing), plain])
    assert bad.finish_reason == "error" and bad.error is not None
    assert bad.error.startswith(structured.STOPPED) and "guided_regex" in bad.error
    assert clean(bad.error), bad.error
    assert good.finish_reason == "length" and len(good.token_ids) == 12


def test_a_stopped_grammar_is_a_400_type_error_streamed_and_whole() -> None:
    import json
    from types import SimpleNamespace

    from tensorfold.engine.requests import Finished
    from tensorfold.server.openai_api import Parsed
    from tensorfold.server.openai_replies import Choices, TokenTexts

    parsed = Parsed("chat", [1, 2], SamplingParams(max_tokens=8))
    texts = TokenTexts(SimpleNamespace(hf=SimpleNamespace(decoder=None)))  # type: ignore[arg-type]
    reply = Choices(parsed, "demo", 1, texts)
    message = f"{structured.STOPPED}: guided_regex: the grammar failed after 3 tokens (x)"
    reply[0].add(Finished("r", "error", "", 2, 3, 0, 1, message))
    status, body = reply.error_response()
    assert status == 400 and body["error"]["type"] == "invalid_request_error"
    streamed = json.loads(reply[0].finish().removeprefix(b"data: "))
    assert streamed == body and body["error"]["message"] == message
