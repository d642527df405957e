"""Helpers for families' tests (ours and third parties'): an engine on a checkpoint on the CPU
in fp32, closed with the census checked, and the gates' common moves. docs/reference.md lists
them; docs/plugins.md uses them on a complete family."""

from __future__ import annotations

import contextlib
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator, Sequence

import torch

from .engine.runner import ModelRunner, Stream, open_stream
from .engine.sampling import SamplingParams
from .family.checkpoint import Checkpoint
from .family.forward_pass import StreamRows, Tapped
from .llm import LLM

# The prompt store is on by default when serving; tests turn it on where they mean to (with a
# budget of their own), so that a run without it is the fresh run the gates compare against.
CPU_DEFAULTS: dict[str, Any] = {
    "device": "cpu",
    "dtype": "float32",
    "memory_limit_gib": 0.25,
    "prompt_cache_gib": 0,
    "kv_share": 0,
    "kv_host_gib": 0,
}


def open_llm(family: str, model: Path | None, **flags: Any) -> LLM:
    """An engine on the CPU in fp32, with a small memory budget; flags override."""
    return LLM(family=family, model=model, **{**CPU_DEFAULTS, **flags})


def close_even(llm: LLM) -> None:
    """Stop the engine; the census must be even once idle, and nothing ever logged UNEVEN."""
    lanes = llm.served.engine.lanes
    llm.close()
    census = lanes.pool.census()
    assert lanes.uneven == 0, f"{lanes.uneven} uneven censuses"
    assert census.idle_even, census.line()


def tokens(llm: LLM, prompts: Sequence[Any], params: SamplingParams) -> list[list[int]]:
    return [c.token_ids for c in llm.generate(prompts, params)]


def tokens_alone(
    llm: LLM, prompts: Sequence[Any], params: dict[str, SamplingParams]
) -> dict[str, list[list[int]]]:
    """Each prompt run by itself, for each named sampling: {name: [tokens of prompt i]}."""
    return {name: [tokens(llm, [p], ps)[0] for p in prompts] for name, ps in params.items()}


def assert_concurrent_equals_solo(
    llm: LLM,
    prompts: Sequence[Any],
    params: SamplingParams,
    alone: list[list[int]],
    levels: Sequence[int],
) -> None:
    """The prompts submitted `level` at a time give the tokens each gave alone."""
    for level in levels:
        got: list[list[int]] = []
        for i in range(0, len(prompts), level):
            got += tokens(llm, prompts[i : i + level], params)
        assert got == alone, f"level {level}"


def submit_with_marks(
    llm: LLM,
    ids: Sequence[int],
    marks: Sequence[int],
    params: SamplingParams,
    timeout_s: float = 120,
) -> tuple[list[int], int]:
    """One request straight to the engine with explicit prompt-store marks: its tokens and how
    many prompt rows it resumed. A request that fails or takes over timeout_s raises."""
    import threading

    from .engine.requests import Finished, TokenOut

    out: list[int] = []
    ended: list[Finished] = []
    done = threading.Event()

    def sink(event: Any) -> None:
        if isinstance(event, TokenOut):
            out.append(event.token)
        elif isinstance(event, Finished):
            ended.append(event)
            done.set()

    llm.served.engine.submit(list(ids), params.with_seed(), sink, list(marks))
    if not done.wait(timeout_s):
        raise TimeoutError(f"the request did not finish in {timeout_s} s")
    if ended[0].error is not None:
        raise RuntimeError(ended[0].error)
    return out, ended[0].cached_tokens


CHAT_WORDS = "river stone light garden window paper cloud music winter morning bread".split()


def chat_turns(
    chat: int, turns: int, first: int, later: int, words: Sequence[str] = CHAT_WORDS
) -> list[str]:
    """Chat `chat`'s user turns, drawn from a generator seeded by it: the first turn `first`
    random words long, the later ones `later` (for run_chats)."""
    import random

    rng = random.Random(chat)
    return [
        " ".join(rng.choice(words) for _ in range(first if t == 0 else later)) for t in range(turns)
    ]


def run_chats(
    llm: LLM, users: Sequence[Sequence[str]], params: SamplingParams
) -> tuple[list[list[list[int]]], list[list[int]]]:
    """Chats turn by turn, each turn's requests at once; users[c][t] is chat c's turn t.
    Returns each turn's replies (token ids) and cached prompt tokens, by chat."""
    histories: list[list[dict]] = [[] for _ in users]
    replies, cached = [], []
    for t in range(len(users[0])):
        for c, turns in enumerate(users):
            histories[c].append({"role": "user", "content": turns[t]})
        done = llm.chat(histories, params)
        replies.append([d.token_ids for d in done])
        cached.append([d.cached_tokens for d in done])
        for c, d in enumerate(done):
            histories[c].append({"role": "assistant", "content": d.text})
    return replies, cached


def assert_host_tier_served(llm: LLM, cached: Sequence[Sequence[int]]) -> None:
    """After chats on an engine with a small device store and a host tier: the store evicted to
    the host and resumed from it, and the census line counts the host pages."""
    sharing = llm.served.engine.lanes.sharing
    assert sharing is not None
    assert sharing.evictions > 0 and sharing.host_hits > 0, cached
    assert "; host free " in llm.served.engine.lanes.pool.census().line()


def assert_host_tier_resumes_as_fresh(
    family: str, model: Path, chats: Sequence[Any], params: SamplingParams, **flags: Any
) -> None:
    """Chats turn by turn on an engine opened with `flags` (e.g. kv_dtype="fp8"), fresh (no
    store), then on one whose small device store evicts to a host tier, with freed pages
    poisoned: the same replies, and the host tier served (assert_host_tier_served)."""
    llm = open_llm(family, model, parallel=3, **flags)
    try:
        fresh, _ = run_chats(llm, chats, params)
    finally:
        close_even(llm)
    llm = open_llm(
        family,
        model,
        parallel=3,
        kv_share=2,
        prompt_cache_gib=0.05,
        kv_host_gib=0.1,
        kv_poison=True,
        **flags,
    )
    try:
        replies, cached = run_chats(llm, chats, params)
        assert replies == fresh
        assert_host_tier_served(llm, cached)
    finally:
        close_even(llm)


def assert_demo_agrees_in_kv_dtype(
    family: str, demo: Path, kv_dtype: str, max_logit_error: float, min_agreed: float = 0.75
) -> KVAgreement:
    """A trained demo with its pages in `kv_dtype`: it still writes words
    (assert_demo_writes_words), and greedy decoding of the demo's prompts agrees with pages in
    the model's dtype (kv_agreement): every first token, at least `min_agreed` of the tokens,
    and a logit error above 0 (the pages do differ) and under `max_logit_error`."""
    llm = open_llm(family, demo, kv_dtype=kv_dtype, context=1024, parallel=2)
    try:
        assert_demo_writes_words(llm)
        tok, model = llm.tokenizer, llm.served.engine.lanes.runner.model
        prompts = [tok.encode(t) for t in DEMO_COMPLETIONS + DEMO_CHATS]
    finally:
        close_even(llm)
    agreement = kv_agreement(model, prompts, steps=16, kv_dtype=kv_dtype)
    assert agreement.top1 == 1.0 and agreement.agreed >= min_agreed * agreement.tokens, agreement
    assert 0 < agreement.logit_error < max_logit_error, agreement
    return agreement


# -- pass-level checks, on a family's model through a ModelRunner -------------------------------
# make_runner(model=None, num_pages=, num_slots=, page_rows=512, poison=False) -> ModelRunner


def assert_streams_together_equal_alone(
    make_runner: Callable[..., ModelRunner],
    model: Any,
    prompts: Sequence[list[int]],
    together: Sequence[int],
    *,
    num_pages: int,
    max_rows: int,
) -> None:
    """Three streams: 0 prefilled (next: a decode row), 1 part-way (next: a chunk), 2 fresh (next:
    a whole prompt). Those in `together` share one pass and must give the bits they give alone."""

    def prepare(runner: ModelRunner) -> tuple[list[Stream], list]:
        streams = [open_stream(runner, slot, max_rows) for slot in range(3)]
        (logits,) = runner.run([streams[0].rows(prompts[0])])
        runner.run([streams[1].rows(prompts[1][:100])])
        decode = int(logits[-1].argmax())
        return streams, [([decode], "all"), (prompts[1][100:], "all"), (prompts[2], "all")]

    solo = make_runner(model=model, num_pages=num_pages, num_slots=3)
    streams, nexts = prepare(solo)
    alone = {i: solo.run([streams[i].rows(*nexts[i])])[0] for i in together}
    joint = make_runner(model=model, num_pages=num_pages, num_slots=3)
    streams, nexts = prepare(joint)
    outs = joint.run([streams[i].rows(*nexts[i]) for i in together])
    for i, logits in zip(together, outs):
        assert torch.equal(logits, alone[i]), f"stream {i} changed beside streams {together}"


def run_on_pages(
    model: Any, tokens: list[int], pages: list[int], page_rows: int, cuts: Sequence[int]
) -> torch.Tensor:
    """One stream's logits for every row, fed in the runs cuts[k]:cuts[k+1] over `pages`."""
    runner = ModelRunner(model, num_pages=max(pages) + 1, num_slots=1, page_rows=page_rows)
    return torch.cat(
        [
            runner.run([StreamRows(0, a, tokens[a:b], pages, "all")])[0]
            for a, b in zip(cuts, cuts[1:])
        ]
    )


def assert_shuffled_pages_change_nothing(
    model: Any, tokens: list[int], cuts: Sequence[int], *, pool: int = 64, rows: int = 32
) -> None:
    contiguous = run_on_pages(model, tokens, list(range(-(-len(tokens) // 512))), 512, cuts)
    perm = torch.randperm(pool, generator=torch.Generator().manual_seed(5))
    table = perm[: -(-len(tokens) // rows)].tolist()
    assert table != sorted(table)
    assert torch.equal(run_on_pages(model, tokens, table, rows, cuts), contiguous)


def assert_reused_slot_starts_clean(make_runner: Callable[..., ModelRunner], prompt: list[int]):
    """A slot another stream left its fixed state in gives a new stream the bits of a fresh one."""
    runner = make_runner(num_slots=1)
    other = open_stream(runner, 0, 100)
    runner.run([other.rows(list(range(3, 90)))])
    other.lease.release()
    stream = open_stream(runner, 0, 100)
    (reused,) = runner.run([stream.rows(prompt[:64], logits="all")])
    fresh_runner = make_runner(num_slots=1)
    fresh = open_stream(fresh_runner, 0, 100)
    (clean,) = fresh_runner.run([fresh.rows(prompt[:64], logits="all")])
    assert torch.equal(reused, clean)


def assert_poisoned_pages_change_nothing(
    make_runner: Callable[..., ModelRunner], prompt: list[int]
) -> None:
    """Pages freed by one stream and NaN-filled change nothing for the next (prompt >= 151)."""

    def run(poison: bool) -> torch.Tensor:
        runner = make_runner(num_pages=4, num_slots=2, page_rows=64, poison=poison)
        gone = open_stream(runner, 1, 256)
        runner.run([gone.rows(list(range(3, 200)))])
        gone.lease.release()
        stream = open_stream(runner, 0, 256)
        (a,) = runner.run([stream.rows(prompt[:150], logits="all")])
        (b,) = runner.run([stream.rows(prompt[150:151], logits="all")])
        return torch.cat([a, b])

    poisoned = run(True)
    assert torch.isfinite(poisoned).all()
    assert torch.equal(poisoned, run(False))


# -- tensor parallel on the CPU: ranks as subprocesses, joined over gloo ------------------------


def assert_a_mark_inside_a_pass_resumes_there(
    open_engine: Callable[..., LLM],
    user: str,
    reply: str,
    params: SamplingParams,
    *,
    past: int = 0,
) -> None:
    """A chat (user, assistant `reply`, a short user turn), then the same chat with another last
    turn, on one lane without the prompt store and with it (`open_engine(parallel=1,
    kv_share=N)`). With the store the second resumes exactly at the assistant turn's end (past
    `past` rows), a mark inside the first request's only prompt pass, whose state was tapped
    there: the same replies and the same number of passes as without it."""
    from .family.chat_template import marks_to_token_positions, render_chat

    first = [
        {"role": "user", "content": user},
        {"role": "assistant", "content": reply},
        {"role": "user", "content": "river stone"},
    ]
    second = first[:2] + [{"role": "user", "content": "winter morning light"}]
    passes, replies = {}, {}
    for share in (0, 16):
        llm = open_engine(parallel=1, kv_share=share)
        try:
            tok = llm.tokenizer
            assert tok.chat_template is not None
            chat = render_chat(
                tok.chat_template, second, bos_token=tok.bos_token, eos_token=tok.eos_token
            )
            turn_ends = marks_to_token_positions(tok, chat.text, chat.marks)
            done = [llm.chat([first], params)[0], llm.chat([second], params)[0]]
            replies[share] = [c.token_ids for c in done]
            passes[share] = llm.served.engine.lanes.passes
            if share:
                assert past < turn_ends[1] < len(done[0].prompt_token_ids) <= 2048
                assert done[1].cached_tokens == turn_ends[1]
        finally:
            close_even(llm)
    assert replies[16] == replies[0]
    assert passes[16] == passes[0]


def assert_choices_equal_single_twins(
    llm: LLM, prompts: Sequence[Any], params: SamplingParams, n: int = 3
) -> None:
    """n choices of each prompt, the prompts submitted together: each prompt is computed once,
    and choice i of a prompt gives the tokens of that prompt alone seeded
    choice_seed(seed, i) (its forked pages and fixed state are exact)."""
    from dataclasses import replace

    from .engine.choices import choice_seed

    assert params.seed is not None, "seed the params, so the twins can be named"
    lanes = llm.served.engine.lanes
    before = lanes.rows_computed + lanes.rows_cached
    got = llm.generate(list(prompts), params, n=n)
    assert lanes.rows_computed + lanes.rows_cached - before == sum(
        len(c.prompt_token_ids) for c in got[::n]
    )
    for k, prompt in enumerate(prompts):
        for i in range(n):
            twin = tokens(llm, [prompt], replace(params, seed=choice_seed(params.seed, i)))[0]
            assert got[k * n + i].token_ids == twin, f"prompt {k}, choice {i}"


def prompts_with_logprobs(
    llm: LLM,
    prompts: Sequence[list[int]],
    params: SamplingParams,
    n: int = 1,
    top: int | None = 3,
    timeout_s: float = 120,
) -> list[dict[str, Any]]:
    """The prompts submitted together as one request's list (Engine.submit_prompts), n choices
    each, their prompt logprobs asked with `top` top ones (None: not asked): for each choice, in
    order (prompt i's choice j at i * n + j), {"prompt": its PromptOut's logprobs or None,
    "tokens": its tokens, "logprobs": each token's (logprob, top logprobs)}."""
    import threading

    from .engine.choices import choice_params
    from .engine.requests import Finished, PromptOut, TokenOut

    got: list[dict[str, Any]] = [
        {"prompt": None, "tokens": [], "logprobs": []} for _ in range(len(prompts) * n)
    ]
    left = [len(got)]
    done = threading.Event()

    def sink(i: int) -> Callable[[Any], None]:
        def take(event: Any) -> None:
            if isinstance(event, PromptOut):
                got[i]["prompt"] = event.logprobs
            elif isinstance(event, TokenOut):
                got[i]["tokens"].append(event.token)
                got[i]["logprobs"].append((event.logprob, event.top_logprobs))
            elif isinstance(event, Finished):
                assert event.error is None, event.error
                left[0] -= 1
                if not left[0]:
                    done.set()

        return take

    llm.served.engine.submit_prompts(
        [list(p) for p in prompts],
        [choice_params(params, n) for _ in prompts],
        [sink(i) for i in range(len(got))],
        prompt_logprobs=top,
    )
    if not done.wait(timeout_s):
        raise TimeoutError(f"the prompts did not finish in {timeout_s} s")
    return got


def assert_prompt_logprobs_exact(
    llm: LLM, prompts: Sequence[list[int]], params: SamplingParams, n: int = 2
) -> None:
    """The echo gate: each prompt's own logprobs (OpenAI's `echo` with `logprobs`, computed in
    the prompt pass) are the same alone and in a list of the prompts with n choices each
    (every choice gets them), and a request that asks for them completes as one that does not
    (its rows' logits kept, its prompt cut into smaller chunks). Without penalties or biases,
    the prompt pass scores a prompt that ends with a run's own tokens as that run's draws
    did."""
    assert params.seed is not None and params.logprobs, "seeded params, with logprobs"
    top = params.top_logprobs
    alone = [prompts_with_logprobs(llm, [p], params, top=top)[0] for p in prompts]
    plain = [prompts_with_logprobs(llm, [p], params, top=None)[0] for p in prompts]
    listed = prompts_with_logprobs(llm, prompts, params, n, top=top)
    for k, prompt in enumerate(prompts):
        one = alone[k]
        assert one["prompt"] is not None and len(one["prompt"]) == len(prompt) - 1
        assert plain[k]["prompt"] is None
        assert (one["tokens"], one["logprobs"]) == (plain[k]["tokens"], plain[k]["logprobs"])
        for j in range(n):
            assert listed[k * n + j]["prompt"] == one["prompt"], f"prompt {k}, choice {j}"
        assert listed[k * n]["tokens"] == one["tokens"], f"prompt {k}"
        if params.has_penalties or params.logit_bias or not one["tokens"]:
            continue
        ran = list(prompt) + one["tokens"][:-1]
        forced = prompts_with_logprobs(llm, [ran], params, top=top)[0]
        assert forced["prompt"][len(prompt) - 1 :] == one["logprobs"][:-1], f"prompt {k}"


def assert_engine_gates_at_tp(
    family: str,
    model: Path,
    prompts: Sequence[list[int]],
    chats: Sequence[Sequence[str]],
    greedy: SamplingParams,
    sampled: SamplingParams,
    *,
    tp: int = 2,
    min_cached: int = 100,
    match_one_rank: bool = True,
    **flags: Any,
) -> None:
    """An engine at `tp` ranks (rank 0 here, the followers it starts) against one at one rank:
    greedy tokens equal when match_one_rank (they may differ between TP sizes in general, as
    in bf16 on GPUs, where sums run in another order; not on these models in fp32), and
    assert_engine_gates at `tp`, the first engine also drafted == plain (its verify rounds'
    rewinds repeated on every rank)."""
    if match_one_rank:
        one = open_llm(family, model, **flags)
        try:
            one_rank = tokens(one, prompts, greedy)
        finally:
            close_even(one)

    drafted: list[bool] = []

    def at_tp(llm: LLM) -> None:
        assert llm.served.plan.ranks == tp
        if not drafted:  # once: verify rounds, their rewinds repeated on the other ranks
            with drafting(llm, "off"):
                plain = llm.generate(prompts[:2], greedy)
            vocab = llm.served.engine.lanes.runner.model.vocab_size
            wrong = [
                [t if i % 3 else (t + 1) % vocab for i, t in enumerate(c.token_ids)] for c in plain
            ]
            assert_drafted_equals_plain(
                llm, prompts[:2], greedy, source="ngram", predictions=wrong, plain=plain
            )
            drafted.append(True)

    alone = assert_engine_gates(
        family,
        model,
        prompts,
        chats,
        greedy,
        sampled,
        min_cached=min_cached,
        opened=at_tp,
        tp=tp,
        **flags,
    )
    if match_one_rank:
        assert alone == one_rank


def assert_engine_gates(
    family: str,
    model: Path | None,
    prompts: Sequence[list[int]],
    chats: Sequence[Sequence[str]],
    greedy: SamplingParams,
    sampled: SamplingParams,
    *,
    min_cached: int = 100,
    opened: Callable[[LLM], None] | None = None,
    **flags: Any,
) -> list[list[int]]:
    """The gates on engines opened with `flags` (tp=2, kv_dtype="fp8", ...): concurrent ==
    solo (greedy and sampled); then windows, poisoned pages and the prompt store at once:
    pages == windows, and each chat's later turns resume (more than `min_cached` tokens from
    the store) with the replies of a fresh run. `opened(llm)` checks each engine opened; with
    kv_dtype="fp8" each engine's plan must say its rows are in fp8. Returns the prompts' greedy
    tokens alone."""
    both = (("greedy", greedy), ("sampled", sampled))

    def check(llm: LLM) -> None:
        if flags.get("kv_dtype") == "fp8":
            assert "rows in fp8 e4m3 + scales" in llm.served.plan.startup_line()
        if opened is not None:
            opened(llm)

    llm = open_llm(family, model, **flags)
    try:
        check(llm)
        alone = {name: [tokens(llm, [p], params)[0] for p in prompts] for name, params in both}
        for name, params in both:
            assert tokens(llm, prompts, params) == alone[name]  # concurrent == solo
        fresh, _ = run_chats(llm, chats, greedy)
    finally:
        close_even(llm)
    stored = open_llm(
        family,
        model,
        **{"kv_pages": "off", "kv_poison": True, "kv_share": 16, "prompt_cache_gib": 0.05, **flags},
    )
    try:
        check(stored)
        assert stored.served.plan.mode == "windows"
        for name, params in both:
            assert tokens(stored, prompts, params) == alone[name]  # pages == windows
        replies, cached = run_chats(stored, chats, greedy)
        assert replies == fresh  # resumed == fresh
        assert all(c > min_cached for c in cached[1]), cached
    finally:
        close_even(stored)
    return alone["greedy"]


def assert_gates_sent_ahead_equal_plain(
    family: str,
    model: Path | None,
    prompts: Sequence[list[int]],
    chats: Sequence[Sequence[str]],
    greedy: SamplingParams,
    sampled: SamplingParams,
    **flags: Any,
) -> None:
    """`assert_engine_gates` with decode rounds sent ahead (lanes.DECODE_AHEAD, on the CPU
    too), then without: the gates hold in both, the tokens are the same, and the lanes sent
    most of their rounds ahead in the first."""
    from .engine import lanes as lanes_module

    got, used = {}, {}
    was = lanes_module.DECODE_AHEAD
    try:
        for ahead in (True, False):
            lanes_module.DECODE_AHEAD = ahead
            opened: list[LLM] = []
            got[ahead] = assert_engine_gates(
                family, model, prompts, chats, greedy, sampled, opened=opened.append, **flags
            )
            used[ahead] = [
                (ln.sent_ahead, ln.passes) for ln in (llm.served.engine.lanes for llm in opened)
            ]
    finally:
        lanes_module.DECODE_AHEAD = was
    assert got[True] == got[False]
    assert all(sent > passes // 2 for sent, passes in used[True]), used[True]
    assert all(sent == 0 for sent, _ in used[False]), used[False]


@contextlib.contextmanager
def drafting(llm: LLM, source: str = "off", k: int = 4, adaptive: bool = False) -> Iterator[None]:
    """Requests submitted inside draft with `source` ("off": only their predictions), k drafts a
    round; adaptive False (the gates): every stream drafts k whenever a source proposes, so the
    verify path runs on every round it can."""
    from .engine.drafts import DraftSettings

    lanes = llm.served.engine.lanes
    was = lanes.drafting
    lanes.drafting = DraftSettings(source, k, adaptive)  # type: ignore[arg-type]
    try:
        yield
    finally:
        lanes.drafting = was


def outputs(completions: Sequence[Any]) -> list[tuple]:
    """What drafting must not change: each completion's tokens, text, logprobs, top logprobs
    and finish reason."""
    return [
        (c.token_ids, c.text, c.logprobs, c.top_logprobs, c.finish_reason, c.error)
        for c in completions
    ]


def assert_drafted_equals_plain(
    llm: LLM,
    prompts: Sequence[Any],
    params: SamplingParams | Sequence[SamplingParams],
    *,
    source: str = "ngram",
    predictions: Sequence[Any] | None = None,
    k: int = 4,
    n: int = 1,
    plain: Sequence[Any] | None = None,
) -> list[Any]:
    """Drafted == plain: the prompts run together with drafts (`source`, and `predictions`,
    one a prompt or None) give the completions of a run without any (`plain`, else run here),
    token for token with the same text, logprobs and finish reasons; the lanes verified drafts
    on the way. Returns the drafted completions."""
    lanes = llm.served.engine.lanes
    if plain is None:
        with drafting(llm, "off"):
            plain = llm.generate(prompts, params, n)
    before = lanes.tokens_drafted
    with drafting(llm, source, k):
        got = llm.generate(prompts, params, n, predictions=predictions)
    assert outputs(got) == outputs(plain)
    assert lanes.tokens_drafted > before, "no draft was verified"
    return got


@dataclass(frozen=True)
class KVAgreement:
    """A model's greedy decoding with one KV dtype against the model's own (kv_agreement)."""

    tokens: int  # greedy tokens in all
    agreed: int  # of them, those before each prompt's first difference
    top1: float  # share of the prompts whose first generated token is the same
    logit_error: float  # max |logit difference| over every prompt row, over max |logit|


def kv_agreement(
    model: Any, prompts: Sequence[list[int]], steps: int, kv_dtype: str = "fp8"
) -> KVAgreement:
    """Each prompt (with `steps`, at most 2048 rows) decoded greedily by `model` on a runner
    whose pages keep the model's dtype and on one whose pages are `kv_dtype` (see greedy)."""
    runs = {}
    for kv in ("auto", kv_dtype):
        runner = ModelRunner(model, num_pages=4, num_slots=1, kv_dtype=kv)
        runs[kv] = [greedy(runner, p, steps) for p in prompts]
    agreed, error, first = 0, 0.0, 0
    for (want_logits, want), (got_logits, got) in zip(runs["auto"], runs[kv_dtype]):
        agreed += next((i for i, (a, b) in enumerate(zip(want, got)) if a != b), len(want))
        first += want[0] == got[0]
        error = max(error, float((got_logits - want_logits).abs().max() / want_logits.abs().max()))
    return KVAgreement(steps * len(prompts), agreed, first / len(prompts), error)


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def clean_env(**extra: str) -> dict[str, str]:
    """This process's environment without TF_* settings or torchrun's variables, plus `extra`."""
    import os

    env = {k: v for k, v in os.environ.items() if not k.startswith("TF_")}
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(name, None)
    return {**env, **extra}


def run_ranks(
    script: str,
    *args: str,
    world: int = 2,
    timeout_s: float = 120,
    env: dict[str, str] | None = None,
) -> None:
    """`python script RANK PORT *args` for each rank of `world`, on a free port, with `env`
    added to a clean environment; each must exit 0 (their stderr is shown when one does not)."""
    import subprocess
    import sys

    port = str(free_port())
    procs = [
        subprocess.Popen(
            [sys.executable, script, str(r), port, *args],
            env=clean_env(**(env or {})),
            stderr=subprocess.PIPE,
            text=True,
        )
        for r in range(world)
    ]
    errors = [p.communicate(timeout=timeout_s)[1] for p in procs]
    assert [p.returncode for p in procs] == [0] * world, errors


def open_shard(
    path: str | Path, rank: int, hooks: Any, load: Callable[..., Any], world: int = 2
) -> Any:
    """Rank `rank` of `world`'s shard of the checkpoint at `path`, cut as the family's hook
    object (`FamilySpec.hooks`) plans it and loaded by the family's `load` on the CPU in fp32;
    its state layout must be the plan's."""
    from .family import Shard

    ckpt = Checkpoint.open(path)
    plan = hooks.shard_plan(ckpt.config, "float32", world)
    ckpt.set_shard(Shard(rank, world, plan))
    model = load(ckpt, "cpu", "float32")
    assert model.layout == plan.layout
    return model


def runner_factory(model: Any) -> Callable[..., ModelRunner]:
    """A make_runner for the pass-level gates on `model` (a rank's shard, say): its arguments
    `model`, `num_pages=8`, `num_slots=4`, `page_rows=512` and `poison=False`, as
    ReferenceCase.runner's."""

    def make_runner(
        model: Any = model,
        num_pages: int = 8,
        num_slots: int = 4,
        page_rows: int = 512,
        poison: bool = False,
    ) -> ModelRunner:
        return ModelRunner(
            model, num_pages=num_pages, num_slots=num_slots, page_rows=page_rows, poison=poison
        )

    return make_runner


def join_gloo(rank: int, port: int, world: int = 2) -> None:
    """In a rank run_ranks started: join the gloo group and hand it to the forward's collectives
    (tensorfold.ops.parallel), one intra-op thread a rank."""
    import torch.distributed as dist

    from .ops import parallel

    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world
    )
    parallel.set_group(parallel.Group(rank, world))


def greedy(runner: ModelRunner, prompt: list[int], steps: int) -> tuple[torch.Tensor, list[int]]:
    """Every prompt row's logits [P, V] in one pass (stream 0, slot 0), then `steps` greedy
    decode rows; returns the logits and the tokens. The stream leases the pages its P + steps
    rows need from the runner's pool (on a fresh runner pages 0, 1, ...) and gives them back;
    a pool too small for them raises ValueError saying how many pages it needs."""
    need = runner.pool.pages_for(len(prompt) + steps)
    if not runner.pool.can_promise(need):
        raise ValueError(
            f"testing.greedy: a prompt of {len(prompt)} tokens and {steps} steps need {need} "
            f"pages of {runner.pool.page_rows} rows; the runner can lease "
            f"{runner.pool.available} of its {runner.pool.num_pages}: give it more pages "
            "(num_pages=) or longer ones (page_rows=)"
        )
    stream = open_stream(runner, 0, len(prompt) + steps)
    (logits,) = runner.run([stream.rows(prompt, "all")])
    tokens = [int(logits[-1].argmax())]
    for _ in range(steps - 1):
        (row,) = runner.run([stream.rows(tokens[-1:])])
        tokens.append(int(row[-1].argmax()))
    stream.lease.release()
    return logits, tokens


@contextlib.contextmanager
def interpreter_rounds_like_the_gpu() -> Iterator[None]:
    """Triton's interpreter truncates fp32 -> bf16, where the GPU (and torch) round to nearest
    even: give it the GPU's rounding while inside, so interpreted bf16 kernels compare bit for
    bit with their torch references."""
    import numpy as np
    from triton.runtime import interpreter

    original = interpreter._convert_float

    def convert(data, src, dst, rounding_mode):
        if (
            src.primitive_bitwidth == 32
            and dst.primitive_bitwidth == 16
            and dst.fp_mantissa_width == 7
        ):
            bits = np.frombuffer(data.tobytes(), dtype=np.uint32).astype(np.uint64)
            rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
            nan = (bits & 0x7FFFFFFF) > 0x7F800000
            out = np.where(nan, (bits >> 16) | 0x40, rounded).astype(np.uint16)
            return out.reshape(data.shape)
        return original(data, src, dst, rounding_mode)

    interpreter._convert_float = convert
    try:
        yield
    finally:
        interpreter._convert_float = original


# -- parity with transformers: tiny checkpoints it saved, and our model on them --------------------


def rel_err(ours: torch.Tensor, ref: torch.Tensor) -> float:
    """max |ours - ref| / max |ref|, in fp32."""
    return ((ours.float() - ref.float()).abs().max() / ref.float().abs().max()).item()


def save_references(
    root: Path, names: Sequence[str], build: Callable[[str], Any]
) -> dict[str, Path]:
    """For each name, the transformers model build(name) saved under root/name -> {name: folder}."""
    paths = {}
    for name in names:
        paths[name] = root / name
        build(name).save_pretrained(paths[name])
    return paths


def reference_folders(
    tmp_path_factory: Any, folder: str, names: Sequence[str], build: Callable[[str], Any]
) -> dict[str, Path]:
    """`save_references` into a new pytest temporary folder named `folder`, for a session
    fixture; skips the test where transformers (the parity reference) is not installed."""
    import pytest

    pytest.importorskip("transformers", reason="transformers 5.23.0 is the parity reference")
    return save_references(tmp_path_factory.mktemp(folder), names, build)


def assert_missing_and_misshapen_named(
    src: Path, work: Path, load: Callable[..., Any], missing: Sequence[str], misshapen: str
) -> None:
    """Copies of the checkpoint at `src` (into `work`) without each tensor of `missing`, and with
    `misshapen` one row short: `load(Checkpoint, "cpu", "float32")` refuses each, naming the
    tensor (and what shape it expected)."""
    import shutil

    import pytest
    from safetensors.torch import load_file, save_file

    from .family.checkpoint import CheckpointError

    tensors = load_file(str(src / "model.safetensors"))
    for name in missing:
        folder = work / name
        shutil.copytree(src, folder)
        save_file(
            {k: v for k, v in tensors.items() if k != name}, str(folder / "model.safetensors")
        )
        with pytest.raises(CheckpointError, match=name.replace(".", r"\.")):
            load(Checkpoint.open(folder), "cpu", "float32")

    folder = work / "misshapen"
    shutil.copytree(src, folder)
    save_file(
        {**tensors, misshapen: tensors[misshapen][:-1].contiguous()},
        str(folder / "model.safetensors"),
    )
    with pytest.raises(CheckpointError, match=misshapen.replace(".", r"\.") + ".*expected"):
        load(Checkpoint.open(folder), "cpu", "float32")


@dataclass
class ReferenceCase:
    """One tiny checkpoint: its folder, the transformers reference loaded back from it (fp32),
    our model on it (fp32) and a prompt; the reference's outputs are computed once."""

    name: str
    path: Path
    ref: Any
    model: Any  # the family's FamilyModel
    prompt: list[int]
    _cache: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def open(
        cls,
        name: str,
        path: Path,
        ref_class: Any,
        load: Callable[..., Any],
        *,
        vocab: int,
        prompt_len: int,
        seed: int = 1234,
    ) -> "ReferenceCase":
        """ref_class.from_pretrained(path) and load(Checkpoint, "cpu", "float32"), with a prompt
        of prompt_len ids in [3, vocab) from `seed`."""
        ref = ref_class.from_pretrained(path, dtype=torch.float32).eval()
        gen = torch.Generator().manual_seed(seed)
        prompt = torch.randint(3, vocab, (prompt_len,), generator=gen).tolist()
        return cls(name, path, ref, load(Checkpoint.open(path), "cpu", "float32"), prompt)

    def runner(
        self,
        *,
        num_pages: int = 8,
        num_slots: int = 4,
        page_rows: int = 512,
        model: Any = None,
        poison: bool = False,
    ) -> ModelRunner:
        return ModelRunner(
            model or self.model,
            num_pages=num_pages,
            num_slots=num_slots,
            page_rows=page_rows,
            poison=poison,
        )

    def prompt_logits(self, cuts: Sequence[int] | None = None, model: Any = None) -> torch.Tensor:
        """Ours (or `model`) on a fresh runner: every prompt row's logits [P, V], the prompt fed
        in the runs cuts[k]:cuts[k+1] (default: one pass)."""
        runner = self.runner(model=model)
        stream = open_stream(runner, 0, len(self.prompt))
        cuts = cuts or [0, len(self.prompt)]
        return torch.cat(
            [
                runner.run([stream.rows(self.prompt[a:b], logits="all")])[0]
                for a, b in zip(cuts, cuts[1:])
            ]
        )

    def decode_greedily(self, steps: int, cut: int) -> tuple[list[int], torch.Tensor]:
        """Ours on a fresh runner: the prompt in two passes (cut at row `cut`), then `steps`
        greedy decode rows; the tokens and their step logits [steps, V] (as ref_generate)."""
        runner = self.runner()
        stream = open_stream(runner, 0, len(self.prompt) + steps)
        runner.run([stream.rows(self.prompt[:cut])])
        (logits,) = runner.run([stream.rows(self.prompt[cut:])])
        tokens, step_logits = [], []
        for _ in range(steps):
            step_logits.append(logits[-1])
            tokens.append(int(logits[-1].argmax()))
            (logits,) = runner.run([stream.rows([tokens[-1]])])
        return tokens, torch.stack(step_logits)

    def assert_decode_matches_generate(self, steps: int, cut: int, tol: float) -> None:
        """decode_greedily(steps, cut) gives ref_generate's tokens, its step logits within
        `tol` of the reference's (rel_err)."""
        ref_tokens, ref_logits = self.ref_generate(steps)
        tokens, step_logits = self.decode_greedily(steps, cut)
        assert tokens == ref_tokens
        assert rel_err(step_logits, ref_logits) < tol

    def ref_logits(self) -> torch.Tensor:
        """The reference's logits for every row of the prompt, [len(prompt), V] fp32."""
        if "logits" not in self._cache:
            with torch.no_grad():
                out = self.ref(input_ids=torch.tensor([self.prompt])).logits[0]
            self._cache["logits"] = out.float()
        return self._cache["logits"]

    def ref_generate(self, steps: int) -> tuple[list[int], torch.Tensor]:
        """Greedy tokens after the prompt and their step logits [steps, V], via generate()."""
        key = f"generate{steps}"
        if key not in self._cache:
            self.ref.generation_config.eos_token_id = None  # run all steps
            out = self.ref.generate(
                torch.tensor([self.prompt]),
                max_new_tokens=steps,
                do_sample=False,
                output_logits=True,
                return_dict_in_generate=True,
            )
            tokens = out.sequences[0, len(self.prompt) :].tolist()
            self._cache[key] = tokens, torch.cat([s.float() for s in out.logits])
        return self._cache[key]


# -- the demos: they write words ----------------------------------------------------------------

DEMO_CHATS = ("What is the capital of France?", "Tell me a story.", "Hello!", "Who are you?")
DEMO_COMPLETIONS = ("Once upon a time", "The little engine")


def assert_demo_writes_words(llm: LLM) -> None:
    """A trained demo's greedy replies to fixed chats end their turn and are readable words, at
    least 80% of them from its training text (tensorfold.family.demo_text), with no U+FFFD or control
    bytes; it knows France's capital; its completions of fixed openings are words too."""
    import re

    from .family.demo_text import known_share

    replies = llm.chat(
        [[{"role": "user", "content": p}] for p in DEMO_CHATS],
        SamplingParams(temperature=0.0, max_tokens=40),
    )
    for prompt, reply in zip(DEMO_CHATS, replies):
        text = reply.text
        assert reply.finish_reason == "stop", (prompt, text)  # it ends its turn
        assert len(re.findall(r"[A-Za-z]+", text)) >= 3, (prompt, text)
        assert known_share(text) >= 0.8, (prompt, text)
        assert not re.search(r"[\ufffd\x00-\x08\x0b-\x1f]", text), (prompt, text)
    assert "Paris" in replies[0].text, replies[0].text
    completions = llm.generate(
        list(DEMO_COMPLETIONS), SamplingParams(temperature=0.0, max_tokens=24)
    )
    for prompt, reply in zip(DEMO_COMPLETIONS, completions):
        assert len(re.findall(r"[A-Za-z]+", reply.text)) >= 8, (prompt, reply.text)
        assert known_share(reply.text) >= 0.8, (prompt, reply.text)


# Questions the demos learnt to think about (tensorfold.family.demo_text.THOUGHTS).
DEMO_THINKING_CHATS = ("What is the capital of France?", "What color is grass?", "Hello!")


def assert_demo_thinks(llm: LLM, on_by_default: bool) -> dict[str, str]:
    """A trained demo thinks as its chat template asks, in its family's markup (the
    `reasoning_format` hook's), greedily, on `DEMO_THINKING_CHATS`: with enable_thinking true
    its reply opens with the start marker (unless the prompt already ends inside it), then a
    thought in words of its training text, the end marker and the answer; false, its reply holds
    no marker and is the answer; with no knob, the template does as `on_by_default` says. Every
    reply ends its turn; France's names Paris. Returns each reply's text (markers kept) by
    "question / on|off"."""
    import re

    from .family.chat_template import render_chat
    from .family.demo_text import known_share

    fmt = llm.served.reasoning_format
    assert fmt is not None, f"{llm.served.spec.name} names no reasoning_format"
    start, end = fmt.start, fmt.end
    tok = llm.tokenizer
    template = tok.chat_template
    assert template is not None
    markers = tok.marker_ids((start, end))
    assert markers, (start, end)

    def prompt(question: str, knob: dict[str, Any]) -> str:
        chat = [{"role": "user", "content": question}]
        bos, eos = tok.bos_token, tok.eos_token
        return render_chat(template, chat, bos_token=bos, eos_token=eos, **knob).text

    prompts = {}
    for question in DEMO_THINKING_CHATS:
        on = prompt(question, {"enable_thinking": True})
        off = prompt(question, {"enable_thinking": False})
        assert prompt(question, {}) == (on if on_by_default else off), question
        prompts[f"{question} / on"], prompts[f"{question} / off"] = on, off
    params = SamplingParams(temperature=0.0, max_tokens=48, keep_special_ids=tuple(sorted(markers)))
    replies = llm.generate([tok.encode(p) for p in prompts.values()], params)
    texts = {}
    for (name, sent), reply in zip(prompts.items(), replies):
        texts[name] = got = reply.text
        assert reply.finish_reason == "stop", (name, got)
        if name.endswith(" / on"):
            if not fmt.opens_in(sent):  # the model opens its thinking itself
                assert got.startswith(start), (name, got)
                got = got[len(start) :]
            thought, closed, answer = got.partition(end)
            assert closed and start not in answer and end not in answer, (name, reply.text)
            assert len(re.findall(r"[A-Za-z]+", thought)) >= 2, (name, reply.text)
            assert known_share(thought) >= 0.8, (name, reply.text)
        else:
            assert not markers & set(reply.token_ids), (name, got)
            answer = got
        assert len(re.findall(r"[A-Za-z]+", answer)) >= 2 and known_share(answer) >= 0.8, (
            name,
            reply.text,
        )
        if name.startswith("What is the capital of France?"):
            assert "Paris" in answer, (name, reply.text)
    return texts


# -- tensorfold serve --tp 2 in a subprocess -------------------------------------------------

SERVE_LAUNCH = "import sys; from tensorfold.cli.commands import main; sys.exit(main())"


def start_serve_tp_2(
    model: Path, log: Any, *flags: str, device: str = "cpu", wait_s: float = 120, **env: str
) -> tuple[Any, str]:
    """`tensorfold serve --family lfm2_moe --tp 2` of `model` (gloo on the CPU, NCCL on CUDA),
    its log to the open file `log`: the process and its API's URL once it says it is serving.
    `env`: extra TF_* settings (the CPU defaults to a 0.25 GiB cap)."""
    import subprocess
    import sys
    import time

    base = dict(TF_DEVICE=device, TF_TP_TIMEOUT_S="20" if device == "cpu" else "60")
    if device == "cpu":
        base["TF_MEMORY_LIMIT_GIB"] = "0.25"
    proc = subprocess.Popen(
        [
            sys.executable,
            "-c",
            SERVE_LAUNCH,
            "serve",
            "--family",
            "lfm2_moe",
            "--model",
            str(model),
            "--port",
            "0",
            "--context",
            "4096",
            "--parallel",
            "2",
            "--tp",
            "2",
            "--served-model-name",
            "demo",
            *flags,
        ],
        stdout=subprocess.PIPE,
        stderr=log,
        text=True,
        env=clean_env(**{**base, **env}),
    )
    printed: list[str] = []
    assert proc.stdout is not None
    deadline = time.monotonic() + wait_s
    while not printed or not printed[-1].startswith("serving "):
        line = proc.stdout.readline()
        assert line and time.monotonic() < deadline, (printed, Path(log.name).read_text())
        printed.append(line.strip())
    assert any(p.startswith("kv plan per rank (tp 2): 2 streams") for p in printed), printed
    return proc, printed[-1].split(" at ")[-1]


def assert_signal_drains_tp_2(
    proc: Any, url: str, log_path: Path, sig: int, wait_s: float = 60
) -> float:
    """With a stream open on `url`, send `sig` to a `--tp 2` server (start_serve_tp_2): it
    exits 0 within `wait_s`, the stream ends with "abort" and [DONE], the follower rank has
    exited, and the shutdown census (all pages back) is its last line. Returns the seconds from
    the signal to the exit."""
    import json
    import os
    import re
    import threading
    import time
    import urllib.request

    # stdlib HTTP, not the openai client: the GPU machine's image has no openai package
    body = json.dumps(
        {
            "model": "demo",
            "prompt": "Once upon a time",
            "max_tokens": 3000,
            "stream": True,
            "ignore_eos": True,
        }
    ).encode()
    request = urllib.request.Request(
        f"{url}/completions", data=body, headers={"Content-Type": "application/json"}
    )
    reasons: list[str | None] = []
    events: list[str] = []
    first = threading.Event()

    def stream() -> None:
        with urllib.request.urlopen(request, timeout=wait_s + 60) as response:
            for raw in response:
                line = raw.decode().strip()
                if not line.startswith("data: "):
                    continue
                events.append(line[6:])
                if line[6:] == "[DONE]":
                    break
                choices = json.loads(line[6:]).get("choices") or [{}]
                reasons.append(choices[0].get("finish_reason"))
                first.set()

    reader = threading.Thread(target=stream)
    reader.start()
    assert first.wait(wait_s), log_path.read_text()
    found = re.search(r"started follower rank 1 \(pid (\d+)\)", log_path.read_text())
    assert found, log_path.read_text()
    follower = int(found.group(1))
    sent = time.monotonic()
    proc.send_signal(sig)
    assert proc.wait(timeout=wait_s) == 0, log_path.read_text()
    took = time.monotonic() - sent
    reader.join(30)
    assert not reader.is_alive() and reasons[-1] == "abort", reasons[-3:]
    assert events[-1] == "[DONE]", events[-3:]
    for _ in range(100):  # the follower has exited (and been reaped)
        try:
            os.kill(follower, 0)
        except ProcessLookupError:
            break
        time.sleep(0.1)
    else:
        raise AssertionError(f"follower rank 1 (pid {follower}) still runs after the server")
    assert proc.stdout is not None
    census = proc.stdout.read().strip().splitlines()[-1]  # printed at exit
    assert census.startswith("kv pool idle: promised 0"), census
    return took


# -- verify runs: a stream's token and its drafts as one run of k + 1 rows ---------------------


@dataclass
class PlainRows:
    """A stream decoded one row a pass (plain_rows): each decode row's logits and the slot's
    every fixed-state buffer as it stood after each row, by position."""

    start: int  # the first decode row's position (the prompt's length)
    logits: torch.Tensor  # [len(tokens), V]: row j's, at position start + j
    states: dict[int, dict[str, torch.Tensor]]  # p -> {name: slot state after row p - 1}


def plain_rows(
    make_runner: Callable[..., ModelRunner],
    prompt: Sequence[int],
    tokens: Sequence[int],
    *,
    page_rows: int = 512,
) -> PlainRows:
    """The prompt in one pass, then `tokens` one decode row a pass (logits "last"), on a fresh
    runner in slot 0, the slot copied after each row."""
    rows = len(prompt) + len(tokens)
    runner = make_runner(num_pages=-(-rows // page_rows), num_slots=1, page_rows=page_rows)
    stream = open_stream(runner, 0, rows)
    runner.run([stream.rows(prompt)])
    states = {stream.pos: _slot_state(runner, 0)}
    logits = []
    for token in tokens:
        logits.append(runner.run([stream.rows([token])])[0][-1].clone())  # a graph reuses it
        states[stream.pos] = _slot_state(runner, 0)
    return PlainRows(len(prompt), torch.stack(logits), states)


def _slot_state(runner: ModelRunner, slot: int) -> dict[str, torch.Tensor]:
    return {name: buf[slot].clone() for name, buf in runner.slots.buffers.items()}


def _tapped_state(tapped: Tapped, after: torch.Tensor) -> torch.Tensor:
    """A tap as a state: a tensor as it is, a SlotRestore restored into a copy of `after` (the
    slot's buffer right after the pass)."""
    if isinstance(tapped, torch.Tensor):
        return tapped
    state = after.clone()
    tapped.restore_into(state)
    return state


def assert_verify_rows_match(
    make_runner: Callable[..., ModelRunner],
    prompt: Sequence[int],
    tokens: Sequence[int],
    k: int,
    *,
    page_rows: int = 512,
    accepted: Sequence[int] | None = None,
    beside: bool = True,
    plain: PlainRows | None = None,
    rewind: bool = False,
) -> int:
    """A verify run's promise (docs/architecture.md, "Exactness rules"): a stream's token and k
    drafts fed as one run of k + 1 rows (logits "all", taps at every draft row) give each row
    the logits plain one-row decoding gives it, and tap at each draft row the slot state plain
    decoding leaves there, bit for bit, for every fixed-state buffer (`runner.slots.buffers`).

    Runner A (`plain_rows`, or `plain` computed by it for the same arguments) prefills the
    prompt and decodes `tokens` one row a pass. Runner B prefills the same prompt, then feeds
    `tokens` as rounds of k + 1 rows from position pos: `StreamRows(slot, pos, tokens[j : j +
    k + 1], pages, "all", taps=range(pos + 1, pos + k + 1))` (the last round shorter where the
    tokens end). A round "accepts" `accepted[r % len]` drafts (default: all k, then none, then
    k // 2, in turn): when fewer than its rows - 1, its tapped states at the accepted row are
    put into the slot (`runner.rewind_slot`) and the next round starts right after it
    (rewriting the rejected rows), as the lanes roll back a rejection. With `beside`, each
    round shares its pass with another stream's one-row decode and a third's 5-row prompt
    chunk. After each round, and after each rollback, the slot equals plain's state there,
    every buffer bit for bit. Both runners are fresh (a ring row no stream wrote yet is zeros
    in both). `rewind`: the runs are marked rewind, as the lanes' are (a tap may be a
    SlotRestore, checked as restored into a copy of the slot after the pass). Returns the
    rounds run."""
    prompt, tokens = list(prompt), list(tokens)
    if accepted is None:
        accepted = (k, 0, k // 2)
    if plain is None:
        plain = plain_rows(make_runner, prompt, tokens, page_rows=page_rows)
    start = len(prompt)
    assert plain.start == start and plain.logits.shape[0] == len(tokens)
    rows = start + len(tokens)
    chunk = 5
    other = [prompt[(7 * i + 1) % len(prompt)] for i in range(chunk * len(tokens) + 1)]
    need = [rows, start + len(tokens) + 1, len(other)] if beside else [rows]
    runner = make_runner(
        num_pages=sum(-(-n // page_rows) for n in need),
        num_slots=len(need),
        page_rows=page_rows,
    )
    streams = [open_stream(runner, slot, n) for slot, n in enumerate(need)]
    verify = streams[0]
    passes = [[verify.rows(prompt)]]
    if beside:
        passes[0].append(streams[1].rows(prompt[:9][::-1]))
    runner.run(passes[0])
    names = set(runner.slots.buffers)
    j, rounds = 0, 0
    while j < len(tokens):
        n = min(k + 1, len(tokens) - j)
        pos = start + j
        pages = list(verify.lease.cover(pos + n))
        taps = tuple(range(pos + 1, pos + n))
        run = StreamRows(0, pos, tokens[j : j + n], pages, "all", taps, rewind=rewind)
        batch = [run]
        if beside:  # a decode row before the run, a prompt chunk after it
            decode = streams[1].rows([tokens[-1 - rounds % len(tokens)]])
            batch = [decode, run, streams[2].rows(other[rounds * chunk : (rounds + 1) * chunk])]
        at = batch.index(run)
        logits = runner.run(batch)[at]
        fp = runner.last_pass
        for r in range(n):
            assert torch.equal(logits[r], plain.logits[j + r]), (
                f"k={k}: row {r} of the run at {pos} (position {pos + r}) is not plain's"
            )
        after = _slot_state(runner, 0)
        for p in run.taps:
            got = (fp.taps_at(at, p) if fp is not None else None) or {}
            assert set(got) == names, f"k={k}: the tap at {p} holds {sorted(got)}"
            for name in names:
                assert torch.equal(_tapped_state(got[name], after[name]), plain.states[p][name]), (
                    f"k={k}: {name} tapped at {p} (run at {pos}) is not plain's state there"
                )
        for name in names:
            assert torch.equal(runner.slots.get(name)[0], plain.states[pos + n][name]), (
                f"k={k}: {name} after the run at {pos} is not plain's state at {pos + n}"
            )
        a = min(accepted[rounds % len(accepted)], n - 1)
        if a < n - 1:  # roll back to the state after the accepted row
            runner.rewind_slot(0, (at, pos + a + 1))
            for name in names:
                assert torch.equal(runner.slots.get(name)[0], plain.states[pos + a + 1][name]), (
                    f"k={k}: {name} rewound to {pos + a + 1} (run at {pos}) is not plain's there"
                )
        j += a + 1
        rounds += 1
    return rounds


# -- fp8 weights: FP8 checkpoints written from a model-dtype one (docs/fp8.md) -------------------

FP8_FORMATS = ("block", "channel", "tensor")  # fp8 128 x 128; compressed-tensors channel, tensor


def fp8_quantization_config(fmt: str) -> dict[str, Any]:
    """config.json's quantization_config of an FP8 checkpoint in `fmt` (FP8_FORMATS)."""
    if fmt == "block":
        return {
            "quant_method": "fp8",
            "activation_scheme": "dynamic",
            "fmt": "e4m3",
            "weight_block_size": [128, 128],
        }
    return {
        "quant_method": "compressed-tensors",
        "format": "float-quantized",
        "quantization_status": "compressed",
        "config_groups": {
            "group_0": {
                "targets": ["Linear"],
                "weights": {
                    "num_bits": 8,
                    "type": "float",
                    "strategy": fmt,
                    "symmetric": True,
                    "dynamic": False,
                },
                "input_activations": {
                    "num_bits": 8,
                    "type": "float",
                    "strategy": "token",
                    "symmetric": True,
                    "dynamic": True,
                },
            }
        },
        "ignore": ["lm_head"],
    }


def write_fp8_checkpoints(
    src: Path, root: Path, fp8_linears: str, fmt: str = "block"
) -> tuple[Path, Path]:
    """From the single-file checkpoint at `src`: (root/fmt, root/fmt-dequantized): the tensors
    the regular expression `fp8_linears` finds stored in FP8 format `fmt` (values and scales as
    quantize_blocks makes them, at the format's block), and the same weights dequantized to fp32
    for the reference to load."""
    import re
    import shutil

    from safetensors.torch import load_file, save_file

    from .family.fp8_formats import fp8_format
    from .family.fp8_weights import quantize_blocks

    config = fp8_quantization_config(fmt)
    naming = fp8_format({"quantization_config": config})
    assert naming is not None
    pattern = re.compile(fp8_linears)
    fp8, dequantized = root / fmt, root / f"{fmt}-dequantized"
    stored: dict[str, torch.Tensor] = {}
    plain: dict[str, torch.Tensor] = {}
    for name, t in load_file(str(src / "model.safetensors")).items():
        if not pattern.search(name):
            stored[name] = plain[name] = t
            continue
        n, k = t.shape[-2:]
        block = {"block": (128, 128), "channel": (1, k), "tensor": (n, k)}[fmt]
        w = quantize_blocks(t, block)
        scale = w.scale.reshape(*t.shape[:-2], 1) if fmt == "tensor" else w.scale
        stored[name], stored[naming.scale_name(name)] = w.q, scale.contiguous()
        plain[name] = w.dequantize(torch.float32)
    for folder, tensors in ((fp8, stored), (dequantized, plain)):
        shutil.copytree(src, folder)
        save_file(tensors, str(folder / "model.safetensors"))
    cfg = json.loads((src / "config.json").read_text())
    (fp8 / "config.json").write_text(json.dumps({**cfg, "quantization_config": config}))
    return fp8, dequantized


def write_bf16_checkpoint(src: Path, dst: Path) -> Path:
    """A copy of the single-file checkpoint at `src` with every float tensor in bfloat16."""
    import shutil

    from safetensors.torch import load_file, save_file

    shutil.copytree(src, dst)
    tensors = load_file(str(src / "model.safetensors"))
    save_file(
        {n: t.bfloat16() if t.is_floating_point() else t for n, t in tensors.items()},
        str(dst / "model.safetensors"),
    )
    cfg = json.loads((src / "config.json").read_text())
    (dst / "config.json").write_text(json.dumps({**cfg, "dtype": "bfloat16"}))
    return dst


def load_quantized(
    load: Callable[..., Any], folder: Path, fp8_linears: str, dtype: str = "float32"
) -> tuple[Any, Checkpoint]:
    """The family's model on `folder` with `--quantization fp8` (its `fp8_linears` quantized
    as they load), and the checkpoint (its `quantized` names the tensors that came as fp8)."""
    ckpt = Checkpoint.open(folder)
    ckpt.set_quantization(fp8_linears)
    return load(ckpt, "cpu", dtype), ckpt


def assert_quantizes_what_it_declares(ckpt: Checkpoint, fp8_linears: str) -> None:
    """The tensors a load read as fp8 are exactly those `fp8_linears` names (so the memory plan,
    which counts by the pattern, counts what loads)."""
    import re

    pattern = re.compile(fp8_linears)
    declared = {n for n in ckpt.tensor_names() if pattern.search(n)}
    assert set(ckpt.quantized) == declared, (
        f"read as fp8 but not declared: {sorted(set(ckpt.quantized) - declared)}; declared "
        f"but read plain: {sorted(declared - set(ckpt.quantized))}"
    )


def _fp8_prompt_logits(model: Any, prompt: list[int]) -> torch.Tensor:
    return ReferenceCase("fp8", Path("."), None, model, prompt).prompt_logits()


def fp8_parity(
    src: Path,
    work: Path,
    fp8_linears: str,
    fmt: str,
    ref_class: Any,
    load: Callable[..., Any],
    prompt: list[int],
) -> tuple[Any, float]:
    """The checkpoint at `src` written as an FP8 checkpoint in `fmt` (write_fp8_checkpoints,
    under `work`): (our fp32 model loaded from it, rel_err of our prompt logits against the
    reference `ref_class` in fp32 on the same weights dequantized)."""
    fp8, dequantized = write_fp8_checkpoints(src, work, fp8_linears, fmt)
    model = load(Checkpoint.open(fp8), "cpu", "float32")
    ref = ref_class.from_pretrained(dequantized, dtype=torch.float32).eval()
    with torch.no_grad():
        want = ref(input_ids=torch.tensor([prompt])).logits[0].float()
    return model, rel_err(_fp8_prompt_logits(model, prompt), want)


def assert_quantized_at_load_equals_fp8_checkpoint(
    src: Path, work: Path, fp8_linears: str, load: Callable[..., Any], prompt: list[int]
) -> tuple[Any, Any]:
    """`--quantization fp8` of a bf16 copy of `src` against the same bf16 weights written as a
    block-scaled FP8 checkpoint: the same tensors read as fp8 (exactly those `fp8_linears`
    names), and the same prompt logits, bit for bit. Returns (quantized, stored) models."""
    bf16 = write_bf16_checkpoint(src, work / "bf16")
    fp8, _ = write_fp8_checkpoints(bf16, work, fp8_linears, "block")
    quantized, ckpt = load_quantized(load, bf16, fp8_linears)
    assert_quantizes_what_it_declares(ckpt, fp8_linears)
    stored_ckpt = Checkpoint.open(fp8)
    stored = load(stored_ckpt, "cpu", "float32")
    assert stored_ckpt.quantized == ckpt.quantized
    assert torch.equal(_fp8_prompt_logits(quantized, prompt), _fp8_prompt_logits(stored, prompt))
    return quantized, stored


def weight_leaves(obj: Any, path: str = "") -> dict[str, Any]:
    """Every tensor and Fp8Weight of a weights dataclass tree, by its dotted path."""
    import dataclasses

    from .family.fp8_weights import Fp8Weight

    if isinstance(obj, (torch.Tensor, Fp8Weight)):
        return {path: obj}
    out: dict[str, Any] = {}
    if isinstance(obj, (list, tuple)):
        for i, x in enumerate(obj):
            out.update(weight_leaves(x, f"{path}.{i}"))
    elif dataclasses.is_dataclass(obj):
        for f in dataclasses.fields(obj):
            out.update(weight_leaves(getattr(obj, f.name), f"{path}.{f.name}"))
    return out


def assert_dummy_quantizes_as_loaded(
    load: Callable[..., Any], load_dummy: Callable[..., Any], folder: Path, fp8_linears: str
) -> None:
    """The family's dummy weights under quantization="fp8" (`load_dummy(config, "cpu",
    "float32", quantization="fp8")`) hold fp8 exactly where `--quantization fp8` of the
    checkpoint at `folder` does, in the same shapes, and give finite logits."""
    from .family.fp8_weights import Fp8Weight

    loaded, _ = load_quantized(load, folder, fp8_linears)
    dummy = load_dummy(Checkpoint.open(folder).config, "cpu", "float32", quantization="fp8")
    want, got = weight_leaves(loaded.weights), weight_leaves(dummy.weights)
    assert got.keys() == want.keys()
    for path, w in want.items():
        assert isinstance(got[path], Fp8Weight) == isinstance(w, Fp8Weight), path
        assert tuple(got[path].shape) == tuple(w.shape), path
    assert sum(isinstance(w, Fp8Weight) for w in got.values()) > 0
    prompt = list(range(3, 20))
    assert torch.isfinite(_fp8_prompt_logits(dummy, prompt)).all()


def assert_quantized_as_drawn(
    dummy_weights: Callable[..., Any], quantize_layer: Callable[[Any], Any]
) -> None:
    """A family's dummy weights quantized a layer at a time as they are drawn
    (`dummy_weights(fp8=True)`, whose peak holds one layer in bf16) are, bit for bit, those drawn
    whole in bf16 (`dummy_weights(fp8=False)`) and quantized after by `quantize_layer`."""
    from .family.fp8_weights import Fp8Weight

    streamed = dummy_weights(fp8=True)
    after = dummy_weights(fp8=False)
    after.layers = [quantize_layer(layer) for layer in after.layers]
    got, want = weight_leaves(streamed), weight_leaves(after)
    assert got.keys() == want.keys()
    assert sum(isinstance(w, Fp8Weight) for w in got.values()) > 0
    for path, w in want.items():
        g = got[path]
        if isinstance(w, Fp8Weight):
            assert isinstance(g, Fp8Weight) and (g.block, g.row0) == (w.block, w.row0), path
            assert torch.equal(g.q.view(torch.uint8), w.q.view(torch.uint8)), path
            assert torch.equal(g.scale, w.scale), path
        else:
            assert isinstance(g, torch.Tensor) and g.dtype == w.dtype, path
            assert torch.equal(g, w), path


@contextlib.contextmanager
def fp8_kernel_counts(*kernels: str) -> Iterator[dict[str, int]]:
    """The ops' Triton path taken for CPU tensors too (run it under TRITON_INTERPRET=1), with
    the launches of each named `tensorfold.ops.triton_fp8` kernel (e.g. "linear_fp8",
    "moe_fp8") and the calls of `Fp8Weight.dequantize` (the dequantizing path) counted:
    {name: launches, "dequantize": calls}. Puts the kernels, dequantize and the CPU's torch path
    back on exit."""
    from .family.fp8_weights import Fp8Weight
    from .ops import gpu, triton_fp8

    counts = dict.fromkeys((*kernels, "dequantize"), 0)
    originals = {name: getattr(triton_fp8, name) for name in kernels}
    dequantize = Fp8Weight.dequantize

    def counted(name: str) -> Callable[..., Any]:
        def launch(*args: Any, **kw: Any) -> Any:
            counts[name] += 1
            return originals[name](*args, **kw)

        return launch

    def counted_dequantize(self: Fp8Weight, *args: Any, **kw: Any) -> torch.Tensor:
        counts["dequantize"] += 1
        return dequantize(self, *args, **kw)

    for name in kernels:
        setattr(triton_fp8, name, counted(name))
    Fp8Weight.dequantize = counted_dequantize  # type: ignore[method-assign]
    gpu.set_triton(True, on_cpu=True)
    try:
        yield counts
    finally:
        gpu.set_triton(True)
        Fp8Weight.dequantize = dequantize  # type: ignore[method-assign]
        for name, kernel in originals.items():
            setattr(triton_fp8, name, kernel)


def image_data_url(image: Any) -> str:
    """A PIL image as a `data:image/png;base64,...` URL, for an `image_url` part."""
    import base64
    import io

    out = io.BytesIO()
    image.save(out, "PNG")
    return "data:image/png;base64," + base64.b64encode(out.getvalue()).decode()


def image_chat(image: Any, text: str) -> list[dict[str, Any]]:
    """One user message: the image, then the text."""
    parts = [{"type": "image_url", "image_url": {"url": image_data_url(image)}}]
    return [{"role": "user", "content": [*parts, {"type": "text", "text": text}]}]


def assert_image_chat_gates(
    family: str,
    folder: Path,
    images: tuple[Any, Any],
    params: SamplingParams,
    question: str,
    kept_rows: int,
    **flags: Any,
) -> list[list[int]]:
    """The gates with images, on a checkpoint with a vision tower (`flags` for `open_llm`):
    concurrent == solo with two image chats among a text chat; the image is read (another
    image changes the tokens); drafted (n-gram) == plain; resumed == fresh with the first image
    in the kept prefix (at least `kept_rows` rows resumed; `question` must reach past the
    family's marks), and the same words about the other image resumed only before it; the
    census even after each engine. Returns the together run's tokens."""
    first, second = images
    chats = [
        image_chat(first, question),
        [{"role": "user", "content": "Tell me a story."}],
        image_chat(second, "And this one?"),
    ]

    def run(llm: LLM, batch: list) -> list[list[int]]:
        return [c.token_ids for c in llm.chat(batch, params)]

    llm = open_llm(family, folder, parallel=3, **flags)
    try:
        together = run(llm, chats)
        assert together == [run(llm, [c])[0] for c in chats]
        assert together[0] != run(llm, [image_chat(second, question)])[0], "the image is unread"
        before = llm.served.engine.lanes.tokens_drafted
        with drafting(llm, "ngram"):
            assert run(llm, chats) == together
        assert llm.served.engine.lanes.tokens_drafted > before, "no draft was verified"
    finally:
        close_even(llm)

    def second_turn(llm: LLM) -> tuple[list[int], int]:
        chat = image_chat(first, question)
        reply = llm.chat([chat], params)[0]
        turn = chat + [
            {"role": "assistant", "content": reply.text},
            {"role": "user", "content": "More?"},
        ]
        done = llm.chat([turn], params)[0]
        return done.token_ids, done.cached_tokens

    fresh = open_llm(family, folder, **flags)
    try:
        want, cached = second_turn(fresh)
        assert cached == 0
    finally:
        close_even(fresh)
    kept = open_llm(family, folder, **{"kv_share": 16, "prompt_cache_gib": 0.05, **flags})
    try:
        got, cached = second_turn(kept)
        assert got == want and cached >= kept_rows, (cached, kept_rows)
        other = kept.chat([image_chat(second, question)], params)[0]
        assert other.cached_tokens < kept_rows, "another image resumed as the first"
    finally:
        close_even(kept)
    return together
