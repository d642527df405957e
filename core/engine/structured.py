"""Structured output: a request's constraint (`response_format`, a regex, a grammar, or the tool
calls that `tool_choice` "required" / named demands) compiled into a grammar for llguidance, and
the per-row matcher that masks the lanes' logits.

The grammar engine is llguidance (see docs/serving.md, "Structured output", for why): it builds
its tokenizer from our `tokenizers` JSON, compiles JSON schemas, regexes and Lark grammars, and
computes a token mask per step. Its lexer is built lazily, so a grammar's expensive work would
land at its first masks, on the engine's thread; instead each constraint is compiled eagerly while
the request is parsed (a request worker, the GIL let go): its first mask computed and a few
tokens walked, within a GrammarBudget (llguidance's fuel and size limits, TF_GRAMMAR_*). A
grammar that fails or runs out of budget there is a 400 naming its field; every row's matcher is
a copy of that warmed one, so the engine's thread starts where the parse left off.

Exactness: a row's mask depends only on the row's own generated tokens, and the mask is applied
to the row's own logits before its seeded draw (lanes.py), so concurrent == solo and resumed ==
fresh hold with constraints on; each of n choices has its own matcher. The mask lets the end of
text (EOS) through only where the grammar accepts, and only EOS once the grammar is complete.

Everything a request can get wrong is a StructuredError naming the field and the problem; it is
raised while the request is parsed, before any pass. llguidance's messages go without its
parser state (llg_message). A grammar that still fails mid-generation (a step past its
budget) ends its row with a STOPPED message naming the field (lanes.py; a 400-type error).
"""

from __future__ import annotations

import functools
import json
import weakref
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Mapping

import torch

from .tool_schemas import strict as strict_schema
from .tool_schemas import strict_tool

if TYPE_CHECKING:
    from ..config.settings import Settings
    from ..family.tokenizer import Tokenizer
    from ..server.tool_request import ToolRequest

# compact JSON: a model cannot wander off into whitespace; escapes that JSON and Python read alike
JSON_OPTIONS: dict[str, Any] = {"whitespace_flexible": False, "json_allowed_escapes": 'nrbtf\\"u'}
FIELDS = (
    "response_format",
    "guided_json",
    "guided_regex",
    "guided_grammar",
    "guided_choice",
    "structured_outputs",
)
_FORMAT_SHAPE = (
    '{"type": "text"}, {"type": "json_object"} or {"type": "json_schema", '
    '"json_schema": {"name": ..., "schema": {...}, "strict": true}}'
)
_OUTPUTS_KEYS = ("json", "json_object", "regex", "grammar", "choice")
PROBE_TOKENS = 4  # tokens walked at compile time, past the first mask
STOPPED = "structured output stopped"  # how a row's grammar failure mid-generation begins


class StructuredError(ValueError):
    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param


def _llg() -> Any:
    import llguidance

    return llguidance


@dataclass(frozen=True)
class GrammarBudget:
    """What one grammar may cost, as llguidance's LLParserLimits: `lexer_fuel` bounds building
    the lexer (the work of the first masks), `step_fuel` and `step_items` one token's mask,
    `max_size` the grammar itself. Within them a mask is milliseconds; past them the grammar
    fails, at compile time a 400, mid-generation its row's stop."""

    lexer_fuel: int = 1_000_000
    step_fuel: int = 200_000
    step_items: int = 50_000
    max_size: int = 500_000

    @classmethod
    def from_settings(cls, settings: Settings) -> GrammarBudget:
        return cls(
            settings.grammar_lexer_fuel,
            settings.grammar_step_fuel,
            settings.grammar_step_items,
            settings.grammar_max_size,
        )

    def limits(self) -> Any:
        return _llg().LLParserLimits(
            initial_lexer_fuel=self.lexer_fuel,
            step_lexer_fuel=self.step_fuel,
            step_max_items=self.step_items,
            max_grammar_size=self.max_size,
            verbose_errors=False,
        )


@functools.cache
def default_budget() -> GrammarBudget:
    """The budget the TF_GRAMMAR_* settings give (read once)."""
    from ..config.settings import Settings

    return GrammarBudget.from_settings(Settings())


def llg_message(error: str) -> str:
    """llguidance's error without its internals (its parser state, from `<state>` or
    `<non-verbose/>` on, cut), on one line, at most 400 characters."""
    for marker in ("<state>", "<non-verbose/>"):
        error = error.split(marker, 1)[0]
    line = " ".join(error.split()) or "the grammar failed"
    return line if len(line) <= 400 else line[:397] + "..."


_TOKENIZERS: "weakref.WeakKeyDictionary[Tokenizer, Any]" = weakref.WeakKeyDictionary()


def ll_tokenizer(tok: Tokenizer) -> Any:
    """llguidance's view of our tokenizer (built once per tokenizer): the same tokenizer.json,
    its EOS tokens the ones that end a stream."""
    if (found := _TOKENIZERS.get(tok)) is None:
        eos = sorted(tok.eos_token_ids)
        found = _llg().LLTokenizer(tok.hf.to_str(), n_vocab=tok.vocab_size, eos_token=eos or None)
        _TOKENIZERS[tok] = found
    return found


@dataclass(frozen=True)
class Constraint:
    """A compiled constraint: `kind` says what asked for it, `grammar` is llguidance's grammar
    text, `param` the request field it came from. Shared by every choice of a request and never
    advanced itself: `start()` gives a row its own matcher, a copy of the warmed `matcher` (its
    first mask already computed, so the lexer's first work is not redone)."""

    kind: str  # "json_object", "json_schema", "regex", "grammar", "choice", "tool_calls"
    grammar: str
    tokenizer: Any = field(compare=False, repr=False)
    param: str = field(default="", compare=False)
    matcher: Any = field(default=None, compare=False, repr=False)

    def start(self) -> RowMatcher:
        return RowMatcher(self.tokenizer, self.grammar, self.matcher)

    def stopped(self, error: str, generated: int) -> str:
        """The message a row ends with when this grammar fails mid-generation."""
        return (
            f"{STOPPED}: {self.param or self.kind}: the grammar failed after {generated} "
            f"tokens ({llg_message(error)}); simplify it (less nesting or recursion) or "
            "raise its budget (TF_GRAMMAR_STEP_FUEL, TF_GRAMMAR_STEP_ITEMS)"
        )


class RowMatcher:
    """One row's grammar state (masks: mask_rows; the sampled tokens: accept_rows or `accept`).
    Dropped (and its memory freed) when the row's stream ends."""

    def __init__(self, tokenizer: Any, grammar: str, warmed: Any = None) -> None:
        self.matcher = (
            warmed.deep_copy()
            if warmed is not None
            else _llg().LLMatcher(tokenizer, grammar, log_level=0, limits=default_budget().limits())
        )
        self.vocab = tokenizer.vocab_size

    def accept(self, token: int) -> str | None:
        """Advance by the sampled token; an error message if the grammar refused it."""
        self.matcher.consume_token(token)
        return self.matcher.get_error() if self.matcher.is_error() else None

    def valid_drafts(self, drafts: list[int]) -> list[int]:
        """The drafts up to the first the grammar refuses where it stands (plain's masked row
        could never draw that one, nor a row after it follow), and none after the grammar ends."""
        if not drafts or self.matcher.is_stopped():
            return []
        drafts = drafts[: self.matcher.validate_tokens(drafts)]
        taken = 0
        for token in drafts:  # a draft that completes the grammar ends the drafts
            self.matcher.consume_token(token)
            taken += 1
            if self.matcher.is_stopped():
                break
        self.matcher.rollback(taken)
        return drafts[:taken]


_EXECUTOR: list[Any] = []


def _unpack(words: torch.Tensor, vocab: int, known: int) -> torch.Tensor:
    """words [R, W] int32 bitmasks (bit j of word i: token 32 i + j) -> [R, vocab] bool, ids at
    or past `known` (the tokenizer's vocabulary) never allowed. Unpacked byte by byte (both
    sides little-endian): 8 bits a byte, no [R, vocab] int32 in between."""
    rows = words.shape[0]
    lim = min(vocab, known, 32 * words.shape[1])
    shifts = torch.arange(8, dtype=torch.uint8, device=words.device)
    bits = (words.contiguous().view(torch.uint8).unsqueeze(-1) >> shifts) & 1  # [R, 4W, 8]
    out = torch.zeros(rows, vocab, dtype=torch.bool, device=words.device)
    out[:, :lim] = bits.view(rows, -1)[:, :lim].bool()
    return out


def _executor() -> Any:
    if not _EXECUTOR:
        _EXECUTOR.append(_llg().LLExecutor())
    return _EXECUTOR[0]


def accept_rows(rows: list[tuple[RowMatcher, int]]) -> list[str | None]:
    """Advance each matcher by its row's sampled token, together on llguidance's thread pool;
    for each, an error message if its grammar refused the token (else None)."""
    if not rows:
        return []
    ok = _executor().consume_token_par([(m.matcher, token) for m, token in rows])
    return [
        None if fine else (m.matcher.get_error() or f"token {token} refused")
        for (m, token), fine in zip(rows, ok)
    ]


def mask_rows(
    logits: torch.Tensor,
    rows: list[tuple[int, RowMatcher]],
    drafts: list[list[int]] | None = None,
) -> None:
    """logits [B, V], in place: each (i, matcher) sets row i's tokens that its grammar forbids
    next to -inf. The bitmasks are computed together on llguidance's thread pool (the GIL let
    go, so a pass already launched on the GPU runs on meanwhile), copied to the device once and
    applied in one masked fill. A row's mask depends on its own matcher alone.

    drafts (a verify round): a list a matcher, its stream's drafts d1..dk (RowMatcher.
    valid_drafts), whose rows i + 1 .. i + k follow row i: row i + j is masked as the grammar
    stands after d1..dj (llguidance consumes them, computes each mask, and rolls back)."""
    if not rows:
        return
    if drafts is not None and any(drafts):
        spread = []
        for (i, m), d in zip(rows, drafts):
            spread += [(i + j, m) for j in range(len(d) + 1)]
        rows = spread
    known = rows[0][1].vocab
    words_per_row = (known + 31) // 32
    cuda = logits.device.type == "cuda"
    words = torch.empty(len(rows), words_per_row, dtype=torch.int32, pin_memory=cuda)
    if drafts is not None and any(drafts):
        words.fill_(-1)  # a row past a draft that ended the grammar is never taken: left open
        plain: list[tuple[Any, int, list[int]]] = []
        drafted: list[tuple[Any, int, list[int]]] = []
        first = 0
        for (_, m), d in zip(_firsts(rows, drafts), drafts):
            (drafted if d else plain).append((m.matcher, first, list(d)))
            first += len(d) + 1
        if plain:
            _executor().unsafe_compute_mask_ptr(
                [(m, j) for m, j, _ in plain], words.data_ptr(), words_per_row * 4, len(rows)
            )
        _executor().unsafe_compute_mask_ptr_with_draft_token(
            drafted, words.data_ptr(), words_per_row * 4, len(rows)
        )
    else:
        _executor().unsafe_compute_mask_ptr(
            [(m.matcher, j) for j, (_, m) in enumerate(rows)],
            words.data_ptr(),
            words_per_row * 4,
            len(rows),
        )
    allowed = _unpack(words.to(logits.device, non_blocking=True), logits.shape[1], known)
    if len(rows) == logits.shape[0] and all(i == j for j, (i, _) in enumerate(rows)):
        logits.masked_fill_(~allowed, float("-inf"))  # every row constrained: one fill
        return
    index = torch.tensor([i for i, _ in rows], device=logits.device)
    logits[index] = logits[index].masked_fill(~allowed, float("-inf"))


def _firsts(
    spread: list[tuple[int, RowMatcher]], drafts: list[list[int]]
) -> list[tuple[int, RowMatcher]]:
    """Each stream's first row of `spread` (its rows laid out one after another)."""
    out, at = [], 0
    for d in drafts:
        out.append(spread[at])
        at += len(d) + 1
    return out


def _first_allowed(matcher: Any, skip: frozenset[int]) -> int | None:
    """The lowest token id the matcher allows next, other than `skip` (the EOS tokens)."""
    bias = matcher.compute_logit_bias()
    at = bias.find(200)
    while at >= 0 and at in skip:
        at = bias.find(200, at + 1)
    return None if at < 0 else at


def _validated(
    kind: str, grammar: str, tok: Tokenizer, param: str, budget: GrammarBudget | None = None
) -> Constraint:
    """The grammar compiled now, within the budget: checked, its first mask computed and
    PROBE_TOKENS tokens walked on a copy (where llguidance builds the lexer, the expensive part
    of a hostile regex); any failure a StructuredError naming `param`."""
    llg = _llg()
    lltok = ll_tokenizer(tok)
    limits = (budget or default_budget()).limits()
    what = kind.replace("_", " ")
    error = llg.LLMatcher.validate_grammar(grammar, lltok, limits=limits)
    if error:
        raise StructuredError(f"{param}: the {what} does not compile: {llg_message(error)}", param)
    warmed = llg.LLMatcher(lltok, grammar, log_level=0, limits=limits)
    probe, eos = warmed, frozenset(tok.eos_token_ids)
    for step in range(PROBE_TOKENS + 1):
        token = _first_allowed(probe, eos)  # the mask: where the lexer's work is done
        if probe.is_error():
            raise StructuredError(
                f"{param}: the {what} is beyond the grammar engine's budget "
                f"({llg_message(probe.get_error())}); simplify it (TF_GRAMMAR_* set the budget)",
                param,
            )
        if token is None or step == PROBE_TOKENS:
            break
        if probe is warmed:
            probe = warmed.deep_copy()
        probe.consume_token(token)
    return Constraint(kind, grammar, lltok, param, warmed)


def _schema_text(schema: Any, param: str) -> dict[str, Any]:
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except ValueError as exc:
            raise StructuredError(f"{param} is not valid JSON: {exc}", param) from None
    if isinstance(schema, bool):
        schema = {} if schema else {"not": {}}
    if not isinstance(schema, dict):
        raise StructuredError(
            f"{param} must be a JSON schema (an object), got {json.dumps(schema)[:80]}", param
        )
    return schema


def json_schema_grammar(schema: Mapping[str, Any], param: str) -> str:
    llg = _llg()
    try:
        return llg.LLMatcher.grammar_from_json_schema(dict(schema), defaults=JSON_OPTIONS)
    except (ValueError, TypeError) as exc:
        raise StructuredError(
            f"{param}: the JSON schema is malformed: {llg_message(str(exc))}", param
        ) from None


def json_schema(
    schema: Any,
    tok: Tokenizer,
    param: str = "response_format",
    *,
    budget: GrammarBudget | None = None,
) -> Constraint:
    return _validated(
        "json_schema", json_schema_grammar(_schema_text(schema, param), param), tok, param, budget
    )


def json_object(tok: Tokenizer, param: str = "response_format") -> Constraint:
    return _validated("json_object", json_schema_grammar({"type": "object"}, param), tok, param)


def regex(
    pattern: Any,
    tok: Tokenizer,
    param: str = "guided_regex",
    *,
    budget: GrammarBudget | None = None,
) -> Constraint:
    if not isinstance(pattern, str) or not pattern:
        raise StructuredError(f"{param} must be a non-empty regular expression string", param)
    return _validated("regex", _llg().LLMatcher.grammar_from_regex(pattern), tok, param, budget)


def grammar(text: Any, tok: Tokenizer, param: str = "guided_grammar") -> Constraint:
    """A Lark grammar in llguidance's dialect, or a GBNF one (llama.cpp's, as vLLM takes it),
    which is converted to Lark."""
    if not isinstance(text, str) or not text.strip():
        raise StructuredError(f"{param} must be a non-empty grammar string (Lark or GBNF)", param)
    from llguidance.gbnf_to_lark import any_to_lark

    try:
        lark = any_to_lark(text)
    except Exception as exc:  # the converter raises plain exceptions for GBNF it cannot read
        raise StructuredError(f"{param}: the GBNF grammar does not parse: {exc}", param) from None
    return _validated("grammar", _llg().LLMatcher.grammar_from_lark(lark), tok, param)


def choice(options: Any, tok: Tokenizer, param: str = "guided_choice") -> Constraint:
    if (
        not isinstance(options, list)
        or not options
        or not all(isinstance(o, str) and o for o in options)
    ):
        raise StructuredError(f"{param} must be a non-empty array of non-empty strings", param)
    lark = "start: " + " | ".join(json.dumps(o) for o in options)
    return _validated("choice", _llg().LLMatcher.grammar_from_lark(lark), tok, param)


def response_format(value: Any, tok: Tokenizer) -> Constraint | None:
    """OpenAI's response_format: text (no constraint), json_object or json_schema."""
    param = "response_format"
    if not isinstance(value, dict) or not isinstance(value.get("type"), str):
        raise StructuredError(f"response_format must be {_FORMAT_SHAPE}", param)
    kind = value["type"]
    if kind == "text":
        return None
    if kind == "json_object":
        return json_object(tok)
    if kind != "json_schema":
        raise StructuredError(
            f'response_format.type must be "text", "json_object" or '
            f'"json_schema", got {json.dumps(kind)[:60]}',
            param,
        )
    spec = value.get("json_schema")
    if not isinstance(spec, dict):
        raise StructuredError(
            f"response_format.json_schema must be an object; "
            f"response_format must be {_FORMAT_SHAPE}",
            param,
        )
    name = spec.get("name")
    if name is not None and not isinstance(name, str):
        raise StructuredError("response_format.json_schema.name must be a string", param)
    strict = spec.get("strict")
    if strict is not None and not isinstance(strict, bool):
        raise StructuredError("response_format.json_schema.strict must be a boolean", param)
    if "schema" not in spec:  # OpenAI's default: any JSON object
        return json_object(tok)
    schema = _schema_text(spec["schema"], param)
    try:
        return json_schema(strict_schema(schema) if strict else schema, tok)
    except RecursionError:
        raise StructuredError(f"{param}: the JSON schema is nested too deeply", param) from None


def _structured_outputs(value: Any, tok: Tokenizer) -> Constraint | None:
    """vLLM's structured_outputs: {"json" | "json_object" | "regex" | "grammar" | "choice"}."""
    param = "structured_outputs"
    if not isinstance(value, dict):
        raise StructuredError(
            f"{param} must be an object with one of {', '.join(_OUTPUTS_KEYS)}", param
        )
    given = [k for k in _OUTPUTS_KEYS if value.get(k) not in (None, False)]
    unknown = sorted(set(value) - set(_OUTPUTS_KEYS))
    if unknown:
        raise StructuredError(
            f"{param} does not take {', '.join(unknown)}; it takes one of "
            f"{', '.join(_OUTPUTS_KEYS)}",
            param,
        )
    if len(given) != 1:
        raise StructuredError(
            f"{param} needs exactly one of {', '.join(_OUTPUTS_KEYS)}, got {len(given)}", param
        )
    key, item = given[0], value[given[0]]
    if key == "json":
        return json_schema(item, tok, param)
    if key == "json_object":
        return json_object(tok, param)
    makers: dict[str, Callable[[Any, Tokenizer, str], Constraint]] = {
        "regex": regex,
        "grammar": grammar,
        "choice": choice,
    }
    return makers[key](item, tok, param)


def from_body(
    body: Mapping[str, Any], tok: Tokenizer, tools: ToolRequest | None = None
) -> Constraint | None:
    """The request's constraint, from whichever one field asks for it; None when none does.
    tool_choice "required" or named, where the family's format can be constrained, is one too."""
    asked = [name for name in FIELDS if body.get(name) is not None]
    if tools is not None and tools.choice in ("required", "named") and tools.format.grammar:
        asked.append("tool_choice")
    if len(asked) > 1:
        raise StructuredError(f"{' and '.join(asked)} each constrain the reply; send one", asked[1])
    if not asked:
        return None
    name = asked[0]
    value = body.get(name)
    if name == "response_format":
        return response_format(value, tok)
    if name == "guided_json":
        return json_schema(value, tok, name)
    if name == "guided_regex":
        return regex(value, tok, name)
    if name == "guided_grammar":
        return grammar(value, tok, name)
    if name == "guided_choice":
        return choice(value, tok, name)
    if name == "structured_outputs":
        return _structured_outputs(value, tok)
    assert tools is not None
    return tool_calls(tools, tok)


def _literal(tok: Tokenizer, text: str) -> str:
    """A piece of markup as a Lark term: a special token by its id, other text quoted."""
    ids = tok.special_ids([text])
    return f"<[{next(iter(ids))}]>" if ids else json.dumps(text)


def tool_calls(tools: ToolRequest, tok: Tokenizer) -> Constraint:
    """A reply that is only calls, in the family's markup, to the offered tools, each call's
    arguments valid against its tool's parameters. tool_choice "named" offers one tool and is
    called once (OpenAI's forced function; a grammar allowing more lets a model repeat it until
    max_tokens)."""
    build = tools.format.grammar
    assert build is not None
    parallel = tools.parallel and tools.choice != "named"
    try:
        offered = [strict_tool(tool) for tool in tools.tools]
        lark = build(offered, parallel, lambda text: _literal(tok, text))
    except (ValueError, RecursionError) as exc:  # a schema the markup cannot be held to
        raise StructuredError(f"tools: {exc}", "tools") from None
    return _validated("tool_calls", _llg().LLMatcher.grammar_from_lark(lark), tok, "tools")


def check_tool_parameters(
    tool: Mapping[str, Any], i: int, budget: GrammarBudget | None = None
) -> None:
    """tools[i]'s parameters compiled as the schema of its arguments (strict mode applied when
    the tool asks for it), whatever the family and tool_choice: a schema that does not compile
    is a StructuredError naming tools[i].function.parameters."""
    param = f"tools[{i}].function.parameters"
    try:
        parameters = strict_tool(tool)["function"].get("parameters")
        text = json.dumps(arguments_schema(parameters), sort_keys=True)
    except RecursionError:
        raise StructuredError(f"{param}: the JSON schema is nested too deeply", param) from None
    except (TypeError, ValueError) as exc:  # not JSON (NaN) or not a tree: cannot be a schema
        raise StructuredError(f"{param}: the JSON schema is malformed: {exc}", param) from None
    error = _schema_error(text, budget or default_budget())
    if error:
        raise StructuredError(f"{param}: {error}", param)


@functools.lru_cache(maxsize=256)
def _schema_error(text: str, budget: GrammarBudget) -> str:
    """Why the schema (JSON text) does not compile, or "": cached, as a client sends the same
    tools with every turn of a conversation."""
    try:
        grammar = json_schema_grammar(json.loads(text), "parameters")
    except StructuredError as exc:
        return str(exc).removeprefix("parameters: ")
    error = _llg().LLMatcher.validate_grammar(grammar, limits=budget.limits())
    return f"the JSON schema does not compile: {llg_message(error)}" if error else ""


def arguments_schema(parameters: Mapping[str, Any] | None) -> dict[str, Any]:
    """A tool's `parameters` as the schema of its arguments object, compact JSON, for a
    format's grammar (`%json{...}` in Lark)."""
    schema = dict(parameters or {})
    schema.setdefault("type", "object")
    schema["x-guidance"] = {**JSON_OPTIONS, **(schema.get("x-guidance") or {})}
    return schema
