"""`n` choices of one prompt, through the server and the offline API: the prompt is computed
once, choice i equals the single request seeded with choice_seed(seed, i) token for token,
usage counts the prompt once, streamed chunks carry their choice's index, n past the lanes is
a 400 naming the bound, and the census is even after."""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import replace
from typing import Any

import pytest
from test_server import ServedDemo, served
from test_server_bad_input import Http, check_error

from tensorfold.engine.choices import choice_params, choice_seed
from tensorfold.engine.requests import RequestRefused
from tensorfold.engine.sampling import SamplingParams

MODEL = "lfm2_moe-demo"
LANES = 4
LONG = "The little engine woke before dawn and climbed the hill. " * 50  # > one 512-row page
MESSAGES = [{"role": "user", "content": "Tell me about the little engine."}]


def test_choice_seeds() -> None:
    assert [choice_seed(7, i) for i in range(3)] == [7, 8, 9]
    assert choice_seed(2**64 - 1, 1) == 0 and choice_seed(-(2**63), 2) == -(2**63) + 2
    seeded = choice_params(SamplingParams(temperature=1.0), 3)
    assert seeded[0].seed is not None
    assert [p.seed for p in seeded] == [choice_seed(seeded[0].seed, i) for i in range(3)]
    with pytest.raises(ValueError):
        choice_params(SamplingParams(), 0)


# -- the offline API ------------------------------------------------------------------------


@pytest.fixture(scope="module")
def llm(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    from tensorfold.testing import close_even, open_llm

    demo = tmp_path_factory.mktemp("n-demo")
    # poisoned freed pages: a choice that read a page its prompt's stream gave back would change
    engine = open_llm("lfm2_moe", None, parallel=LANES, kv_poison=True, demo_cache=demo)
    yield engine
    close_even(engine)


# a prompt the trained demo was not taught: its sampled choices differ
@pytest.mark.parametrize("prompt", ["Seven purple violins", LONG], ids=["short", "long"])
@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=0.9, seed=11, max_tokens=8, repetition_penalty=1.2),
        SamplingParams(temperature=0.7, top_k=20, max_tokens=8, logprobs=True, top_logprobs=2),
    ],
    ids=["seeded", "drawn"],
)
def test_offline_choices_equal_their_single_twins(
    llm: Any, prompt: str, params: SamplingParams
) -> None:
    lanes = llm.served.engine.lanes
    before = lanes.rows_computed + lanes.rows_cached
    choices = llm.generate([prompt], params, n=3)
    ids = choices[0].prompt_token_ids
    assert lanes.rows_computed + lanes.rows_cached - before == len(ids)  # the prompt once
    assert [c.index for c in choices] == [0, 1, 2]
    seed = choices[0].seed
    assert seed is not None and [c.seed for c in choices] == [
        choice_seed(seed, i) for i in range(3)
    ]
    if params.seed is not None:  # a drawn seed may, now and then, sample three alike
        assert len({tuple(c.token_ids) for c in choices}) > 1  # sampled apart
    for i, c in enumerate(choices):
        twin = llm.generate([prompt], replace(params, seed=choice_seed(seed, i)))[0]
        assert (c.token_ids, c.text, c.logprobs, c.top_logprobs, c.finish_reason) == (
            twin.token_ids,
            twin.text,
            twin.logprobs,
            twin.top_logprobs,
            twin.finish_reason,
        )


def test_offline_choices_among_other_prompts_and_chats(llm: Any) -> None:
    params = SamplingParams(temperature=1.0, seed=3, max_tokens=6)
    prompts = ["One, two,", LONG, "Once upon a time"]
    together = llm.generate(prompts, params, n=2)
    assert [
        (c.prompt_token_ids == together[2 * (k // 2)].prompt_token_ids, c.index)
        for k, c in enumerate(together)
    ] == [(True, k % 2) for k in range(6)]
    for k, c in enumerate(together):
        twin = llm.generate([prompts[k // 2]], replace(params, seed=3 + k % 2))[0]
        assert c.token_ids == twin.token_ids
    chats = llm.chat([MESSAGES], params, n=2)
    assert [c.index for c in chats] == [0, 1]
    for i, c in enumerate(chats):
        assert c.token_ids == llm.chat([MESSAGES], replace(params, seed=3 + i))[0].token_ids
    greedy = llm.generate(["The little"], SamplingParams(temperature=0, max_tokens=6), n=2)
    assert greedy[0].token_ids == greedy[1].token_ids


def test_offline_chat_choices_split_their_reasoning_and_take_template_kwargs(llm: Any) -> None:
    """LLM.chat passes chat_template_kwargs to the template and splits each choice's thinking
    (the lfm2_moe family's <think> markup) out of its content."""
    from tensorfold.family.reasoning import split_reasoning

    params = SamplingParams(temperature=1.0, seed=5, max_tokens=6)
    chats = llm.chat([MESSAGES], params, n=2, chat_template_kwargs={"enable_thinking": False})
    fmt = llm.served.reasoning_format
    for c in chats:
        thought, content = split_reasoning(fmt, c.text)
        assert (c.reasoning_content, c.content) == (thought or None, content)
    with pytest.raises(ValueError, match="chat_template_kwargs may not set messages"):
        llm.chat([MESSAGES], params, chat_template_kwargs={"messages": []})


def test_offline_choices_on_windows_with_the_prompt_store(
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    """Every lane owning a window, and the first choice resuming its prompt from the store."""
    from tensorfold.testing import assert_choices_equal_single_twins, close_even, open_llm

    engine = open_llm(
        "lfm2_moe",
        None,
        parallel=3,
        kv_pages="off",
        kv_share=16,
        prompt_cache_gib=0.05,
        demo_cache=tmp_path_factory.mktemp("n-win"),
    )
    try:
        assert engine.served.plan.mode == "windows"
        params = SamplingParams(temperature=0.8, seed=9, max_tokens=6)
        ids = engine.encode(LONG)
        engine.generate([ids], params)  # its prompt is kept: the choices below resume it
        assert engine.generate([ids + ids[:30]], params, n=2)[0].cached_tokens > 0
        assert_choices_equal_single_twins(engine, [ids + ids[:40]], params, n=3)
    finally:
        close_even(engine)


def test_offline_n_past_the_lanes_is_refused(llm: Any) -> None:
    with pytest.raises(RequestRefused) as refused:
        llm.generate(["x"], SamplingParams(max_tokens=2), n=LANES + 1)
    assert refused.value.param == "n" and f"n <= {LANES}" in str(refused.value)


def test_tensorfold_generate_n(tmp_path_factory: pytest.TempPathFactory) -> None:
    import os
    import subprocess
    import sys

    from test_server import LAUNCH

    env = {k: v for k, v in os.environ.items() if not k.startswith("TF_")}
    env.update(TF_DEMO_CACHE=str(tmp_path_factory.mktemp("n-cli")), TF_MEMORY_LIMIT_GIB="1")
    base = [
        sys.executable,
        "-c",
        LAUNCH,
        "generate",
        "--family",
        "lfm2_moe",
        "--context",
        "1024",
        "--parallel",
        "2",
        "--max-tokens",
        "4",
        "--temperature",
        "0.9",
    ]
    done = subprocess.run(
        [*base, "--seed", "8", "--n", "2", "--json", "One", "Two"],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    rows = [json.loads(line) for line in done.stdout.splitlines()]
    assert [(r["prompt"], r["index"], r["seed"]) for r in rows] == [
        ("One", 0, 8),
        ("One", 1, 9),
        ("Two", 0, 8),
        ("Two", 1, 9),
    ]
    twin = subprocess.run(
        [*base, "--seed", "9", "--json", "Two"],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert json.loads(twin.stdout)["token_ids"] == rows[3]["token_ids"]
    refused = subprocess.run(
        [*base, "--n", "3", "One"], env=env, capture_output=True, text=True, timeout=120
    )
    assert refused.returncode == 2 and "n <= 2" in refused.stderr, refused.stderr


# -- the lanes: how forks end ----------------------------------------------------------------


def count_lanes(pass_rows: int = 32) -> Any:
    """Two lanes over a 16-page pool of 16-row pages (test_tensor_parallel's count model)."""
    from test_tensor_parallel import _rank

    from tensorfold.adapters.snapshots import SnapshotArena
    from tensorfold.engine.lanes import Lanes

    return Lanes(_rank(SnapshotArena, True).runner, lanes=2, window=256, pass_rows=pass_rows)


def group(done: list, prompt: list[int], max_tokens: int = 4) -> Any:
    from tensorfold.engine.requests import Request

    params = choice_params(
        SamplingParams(temperature=0.9, seed=1, max_tokens=max_tokens, ignore_eos=True), 2
    )
    req = Request(prompt, params[0], done.append)
    req.forks = [Request(prompt, params[1], done.append)]
    return req


def run_idle(lanes: Any) -> None:
    while lanes.step():
        pass
    assert lanes.idle and len(lanes.free_slots) == 2 and lanes.uneven == 0
    assert lanes.pool.census().idle_even


@pytest.mark.parametrize("when", ["waiting", "prefilling"])
def test_choices_end_with_their_prompts_stream(when: str) -> None:
    """Cancelled before its prompt is computed (waiting, or between two passes of its prompt),
    the request's other choices end with it, never admitted or forked, and everything comes
    back."""
    from tensorfold.engine.requests import Finished

    lanes, done = count_lanes(), []
    req = group(done, list(range(1, 16)) * 3)  # 45 rows: two passes of 32
    lanes.add(req)
    if when == "prefilling":
        lanes.step()
        assert lanes.live and lanes.live[0].prefilling and len(lanes.free_slots) == 0
    req.cancelled = True
    run_idle(lanes)
    assert [(e.request_id, e.reason, e.completion_tokens) for e in done] == [
        (r.id, "cancelled", 0) for r in (*req.forks, req)
    ]
    assert all(isinstance(e, Finished) for e in done)


def test_a_cancelled_choice_does_not_fork() -> None:
    from tensorfold.engine.requests import Finished

    lanes, done = count_lanes(), []
    req = group(done, [3, 4, 5] * 10)
    req.forks[0].cancelled = True
    lanes.add(req)
    run_idle(lanes)
    ends = {e.request_id: e for e in done if isinstance(e, Finished)}
    assert ends[req.forks[0].id].reason == "cancelled"
    assert ends[req.forks[0].id].completion_tokens == 0
    assert ends[req.id].reason == "length" and ends[req.id].completion_tokens == 4


def test_choices_wait_for_their_lanes_and_pages() -> None:
    """A pair of choices waits while a lane is busy, then runs; n past the lanes, or n
    choices past the pool, is refused naming n."""
    from tensorfold.engine.requests import Finished, Request

    lanes, done = count_lanes(), []
    lanes.add(
        Request([1, 2, 3], SamplingParams(max_tokens=6, ignore_eos=True).with_seed(), done.append)
    )
    lanes.step()
    pair = group(done, [5, 6, 7] * 7)
    lanes.add(pair)
    lanes.step()
    assert lanes.waiting and lanes.waiting[0] is pair  # one lane free: the pair waits
    run_idle(lanes)
    assert sum(isinstance(e, Finished) and e.reason == "length" for e in done) == 3
    three = group(done, [1, 2])
    three.forks.append(Request([1, 2], three.params, done.append))
    too_long = group(done, [1] * 40, max_tokens=150)  # 12 pages alone, 22 for two
    for req in (three, too_long):
        with pytest.raises(RequestRefused) as refused:
            lanes.check(req)
        assert refused.value.param == "n"
    lanes.check(too_long.forks[0])  # alone it fits


# -- the server -----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServedDemo]:
    yield from served(
        tmp_path_factory, "n-serve", "--parallel", str(LANES), env={"TF_KV_SHARE": "16"}
    )


def token_ids(choice: Any) -> list[int]:
    return [int(t.removeprefix("token_id:")) for t in choice["logprobs"]["tokens"]]


def completion(http: Http, **fields: Any) -> dict[str, Any]:
    body = {
        "model": MODEL,
        "max_tokens": 8,
        "logprobs": 0,
        "return_tokens_as_token_ids": True,
        **fields,
    }
    r = http.post("/v1/completions", json=body)
    assert r.status_code == 200, r.text
    return r.json()


# a prompt the trained demo was not taught: its sampled choices differ
@pytest.mark.parametrize("prompt", ["Seven purple violins", LONG], ids=["short", "long"])
def test_completion_choices_equal_their_single_twins(server: ServedDemo, prompt: str) -> None:
    http = Http(server.base)
    many = completion(http, prompt=prompt, n=3, temperature=0.9, seed=41)
    assert many["seed"] == 41 and [c["index"] for c in many["choices"]] == [0, 1, 2]
    singles = [completion(http, prompt=prompt, temperature=0.9, seed=41 + i) for i in range(3)]
    for choice, single in zip(many["choices"], singles):
        assert token_ids(choice) == token_ids(single["choices"][0])
        assert choice["text"] == single["choices"][0]["text"]
        assert choice["finish_reason"] == single["choices"][0]["finish_reason"]
    usage, one = many["usage"], singles[0]["usage"]
    assert usage["prompt_tokens"] == one["prompt_tokens"]  # the prompt counted once
    assert usage["completion_tokens"] == sum(s["usage"]["completion_tokens"] for s in singles)
    assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]
    server.wait_even()


def test_chat_choices_with_the_openai_client(server: ServedDemo) -> None:
    c = server.client()
    kw: dict[str, Any] = dict(model=MODEL, messages=MESSAGES, max_tokens=10, temperature=1.0)
    many = c.chat.completions.create(n=2, **kw)  # no seed: one is drawn and reported
    seed = many.model_extra and many.model_extra["seed"]
    assert isinstance(seed, int) and [ch.index for ch in many.choices] == [0, 1]
    for i, ch in enumerate(many.choices):
        single = c.chat.completions.create(seed=choice_seed(seed, i), **kw)
        assert ch.message.content == single.choices[0].message.content
        assert ch.finish_reason == single.choices[0].finish_reason
    server.wait_even()


def stream_lines(http: Http, path: str, body: dict[str, Any]) -> list[dict[str, Any]]:
    with http.stream(path, body) as (status, lines):
        assert status == 200
        data = [line.removeprefix("data: ") for line in lines if line.startswith("data: ")]
    assert data[-1] == "[DONE]"
    return [json.loads(d) for d in data[:-1]]


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_streamed_choices_carry_their_index(server: ServedDemo, path: str) -> None:
    http = Http(server.base)
    body: dict[str, Any] = {"model": MODEL, "max_tokens": 12, "temperature": 0.8, "seed": 5, "n": 3}
    body.update({"messages": MESSAGES} if "chat" in path else {"prompt": LONG})
    whole = http.post(path, json=body).json()
    chunks = stream_lines(
        http, path, {**body, "stream": True, "stream_options": {"include_usage": True}}
    )
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"] == whole["usage"]
    texts, finishes = {0: "", 1: "", 2: ""}, {}
    for ch in chunks[:-1]:
        assert len(ch["choices"]) == 1 and ch["id"] == chunks[0]["id"] and ch["usage"] is None
        choice = ch["choices"][0]
        i = choice["index"]
        assert i not in finishes  # nothing after a choice's finish
        if choice["finish_reason"] is not None:
            finishes[i] = choice["finish_reason"]
        texts[i] += choice["delta"].get("content") or "" if "chat" in path else choice["text"]
    for i, choice in enumerate(whole["choices"]):
        content = choice["message"]["content"] if "chat" in path else choice["text"]
        assert (texts[i], finishes[i]) == (content, choice["finish_reason"])
    if "chat" in path:
        roles = [
            ch["choices"][0]["index"]
            for ch in chunks[:3]
            if ch["choices"][0]["delta"].get("role") == "assistant"
        ]
        assert roles == [0, 1, 2]
    server.wait_even()


def test_concurrent_groups_equal_their_twins(server: ServedDemo) -> None:
    """Two requests of n = 3 at once on 4 lanes (one waits for its 3 lanes) and a single one."""
    from concurrent.futures import ThreadPoolExecutor

    http = Http(server.base)
    asks = [
        dict(prompt=LONG, n=3, seed=100),
        dict(prompt="Once upon a time", n=3, seed=200),
        dict(prompt="One, two,", seed=300),
    ]
    with ThreadPoolExecutor(len(asks)) as pool:
        got = list(pool.map(lambda a: completion(http, temperature=1.0, **a), asks))
    for ask, reply in zip(asks, got):
        for choice in reply["choices"]:
            twin = completion(
                http, temperature=1.0, prompt=ask["prompt"], seed=ask["seed"] + choice["index"]
            )
            assert token_ids(choice) == token_ids(twin["choices"][0])
    server.wait_even()


def test_a_disconnect_cancels_every_choice(server: ServedDemo) -> None:
    http = Http(server.base)
    before = server.metrics().get(
        "tensorfold_requests_total{endpoint=completion,reason=cancelled}", 0
    )
    body = {
        "model": MODEL,
        "prompt": "The little",
        "max_tokens": 4000,
        "n": 3,
        "stream": True,
        "ignore_eos": True,
    }
    with http.stream("/v1/completions", body) as (status, lines):
        assert status == 200
        next(lines)
    m = server.wait_even(timeout=60)  # leaving closed the connection: every choice ends
    assert m["tensorfold_requests_total{endpoint=completion,reason=cancelled}"] == before + 1


@pytest.mark.parametrize("n,says", [(LANES + 1, f"n <= {LANES}"), (0, ">= 1"), ("2", "integer")])
def test_bad_n_is_a_400_naming_the_bound(server: ServedDemo, n: Any, says: str) -> None:
    http = Http(server.base)
    for body in (
        {"model": MODEL, "prompt": "x", "max_tokens": 2, "n": n},
        {"model": MODEL, "messages": MESSAGES, "max_tokens": 2, "n": n},
    ):
        path = "/v1/completions" if "prompt" in body else "/v1/chat/completions"
        error = check_error(http.post(path, json=body), 400, "n")
        assert says in error["message"], error
    assert completion(http, prompt="x", n=2, max_tokens=2)["choices"][1]["index"] == 1


def test_census_even_after(server: ServedDemo) -> None:
    m = server.wait_even()
    assert m["tensorfold_uneven_total"] == 0
    assert m["tensorfold_lanes{state=free}"] == LANES
