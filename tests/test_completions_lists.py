"""/v1/completions as OpenAI defines it: a list of prompts in one request, and `echo`.

Each prompt of a list runs as its own request would (its choices at index prompt * n + j,
seeded as that request's), so every choice equals its single request token for token; usage
sums the prompts. `echo` puts the prompt before the completion, and with logprobs the prompt's
tokens carry theirs, computed in the prompt pass: the same bits alone or in a list, and the
same as decoding's logprobs for the same tokens. vLLM's own tests of both features
(tests/entrypoints/openai/completion/test_completion.py) run here too, their assertions as
they are, with the official async client.
"""

from __future__ import annotations

import asyncio
import re
from collections.abc import Iterator
from typing import Any

import openai
import pytest
from openai import BadRequestError
from test_n_choices import LONG, completion, stream_lines, token_ids
from test_server import ServedDemo, served
from test_server_bad_input import Http, check_error

MODEL = "lfm2_moe-demo"
LANES = 2


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServedDemo]:
    # the prompt store on: a prompt's echo logprobs are computed even where the store holds it
    yield from served(
        tmp_path_factory, "lists", "--parallel", str(LANES), env={"TF_KV_SHARE": "16"}
    )


def prompt_ids(choice: dict[str, Any], prompt: list[int]) -> list[int]:
    """An echoed choice's logprob tokens (token_id:N) less its prompt's."""
    ids = token_ids(choice)
    assert ids[: len(prompt)] == prompt
    return ids[len(prompt) :]


def test_each_choice_of_a_list_equals_its_single_request(server: ServedDemo) -> None:
    """Three prompts (text, a long text, token ids) of n = 2 on two lanes: they take turns."""
    http = Http(server.base)
    prompts: list[Any] = ["Seven purple violins", LONG, [5, 6, 7, 8, 9]]
    many = completion(http, prompt=prompts, n=2, temperature=0.9, seed=41)
    assert many["seed"] == 41 and [c["index"] for c in many["choices"]] == list(range(6))
    singles = [
        [completion(http, prompt=p, temperature=0.9, seed=41 + j) for j in range(2)]
        for p in prompts
    ]
    for i in range(len(prompts)):
        for j in range(2):
            choice, single = many["choices"][2 * i + j], singles[i][j]["choices"][0]
            assert token_ids(choice) == token_ids(single), (i, j)
            assert (choice["text"], choice["finish_reason"]) == (
                single["text"],
                single["finish_reason"],
            )
    usage = many["usage"]
    assert usage["prompt_tokens"] == sum(s[0]["usage"]["prompt_tokens"] for s in singles)
    assert usage["completion_tokens"] == sum(
        s["usage"]["completion_tokens"] for pair in singles for s in pair
    )
    assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]
    # no seed: one is drawn for the request, and each prompt's choice 0 has it
    drawn = completion(http, prompt=["Once upon", "One, two,"], temperature=1.0)
    twin = completion(http, prompt="One, two,", temperature=1.0, seed=drawn["seed"])
    assert token_ids(drawn["choices"][1]) == token_ids(twin["choices"][0])
    server.wait_even()


def test_a_streamed_list_names_each_choice(server: ServedDemo) -> None:
    http = Http(server.base)
    body: dict[str, Any] = {
        "model": MODEL,
        "prompt": ["The little", [5, 6, 7]],
        "n": 2,
        "max_tokens": 6,
        "temperature": 0.8,
        "seed": 3,
    }
    whole = http.post("/v1/completions", json=body).json()
    chunks = stream_lines(
        http, "/v1/completions", {**body, "stream": True, "stream_options": {"include_usage": True}}
    )
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"] == whole["usage"]
    texts, finishes = dict.fromkeys(range(4), ""), {}
    for ch in chunks[:-1]:
        assert len(ch["choices"]) == 1
        i = ch["choices"][0]["index"]
        assert i not in finishes
        texts[i] += ch["choices"][0]["text"]
        if ch["choices"][0]["finish_reason"] is not None:
            finishes[i] = ch["choices"][0]["finish_reason"]
    assert [(texts[i], finishes[i]) for i in range(4)] == [
        (c["text"], c["finish_reason"]) for c in whole["choices"]
    ]


def test_echo_puts_the_prompt_first_streamed_or_not(server: ServedDemo) -> None:
    http = Http(server.base)
    ask = {"prompt": ["The little", "Once upon"], "temperature": 0.7, "seed": 9, "max_tokens": 5}
    plain = completion(http, **ask)
    echoed = completion(http, **ask, echo=True, logprobs=None)
    for p, a, b in zip(ask["prompt"], plain["choices"], echoed["choices"]):
        assert b["text"] == p + a["text"] and b["logprobs"] is None
    body = {"model": MODEL, **ask, "echo": True, "stream": True}
    texts = ["", ""]
    for ch in stream_lines(http, "/v1/completions", body):
        texts[ch["choices"][0]["index"]] += ch["choices"][0]["text"]
    assert texts == [c["text"] for c in echoed["choices"]]
    ids = completion(
        http, prompt=[5, 6, 7], max_tokens=2, echo=True, return_tokens_as_token_ids=False
    )
    assert ids["choices"][0]["text"].startswith(server_text(http, [5, 6, 7]))


def server_text(http: Http, ids: list[int]) -> str:
    r = http.post("/detokenize", json={"model": MODEL, "tokens": ids})
    assert r.status_code == 200, r.text
    return str(r.json()["prompt"])


def test_echo_logprobs_are_the_prompt_pass_s_and_equal_alone_or_in_a_list(
    server: ServedDemo,
) -> None:
    """A prompt's echoed logprobs alone, again (the store holds it by then), and in a list
    beside a long prompt (its rows cut into chunks) with n = 2: the same bits, every time. And
    the prompt pass's logprobs of tokens a greedy run generated are that run's logprobs."""
    http = Http(server.base)
    prompt = [5, 6, 7, 8, 9, 10]
    greedy = completion(http, prompt=prompt, temperature=0, max_tokens=4, logprobs=3)
    ask = dict(temperature=0, max_tokens=4, logprobs=3, echo=True)
    alone = [completion(http, prompt=prompt, **ask) for _ in range(2)]
    listed = completion(http, prompt=[LONG, prompt], n=2, **ask)
    assert alone[1]["usage"]["prompt_tokens_details"]["cached_tokens"] == 0  # no store hit
    echoed = alone[0]["choices"][0]
    lp = echoed["logprobs"]
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    assert len(lp["tokens"]) == len(prompt) + 4
    assert all(1 <= len(top) <= 4 for top in lp["top_logprobs"][1:])
    for again in (alone[1]["choices"][0], listed["choices"][2], listed["choices"][3]):
        assert again["logprobs"] == lp and again["text"] == echoed["text"]
    assert prompt_ids(echoed, prompt) == token_ids(greedy["choices"][0])
    assert lp["token_logprobs"][len(prompt) :] == greedy["choices"][0]["logprobs"]["token_logprobs"]
    # teacher-forced: the prompt pass scores the greedy tokens as decoding did
    forced = completion(http, prompt=prompt + token_ids(greedy["choices"][0]), **ask)
    flp = forced["choices"][0]["logprobs"]
    assert (
        flp["token_logprobs"][len(prompt) : len(prompt) + 4] == lp["token_logprobs"][len(prompt) :]
    )
    assert flp["top_logprobs"][len(prompt) : len(prompt) + 4] == lp["top_logprobs"][len(prompt) :]
    # the long prompt's rows came in chunks: the same as the long prompt alone
    long_alone = completion(http, prompt=LONG, **ask)["choices"][0]
    assert listed["choices"][0]["logprobs"] == long_alone["logprobs"]
    assert listed["choices"][1]["logprobs"] == long_alone["logprobs"]
    # ... and its completion is the plain request's, whose prompt was one chunk
    plain = completion(http, prompt=LONG, temperature=0, max_tokens=4, logprobs=3)
    head = {name: values for name, values in plain["choices"][0]["logprobs"].items()}
    made = len(head["tokens"])  # it may stop before max_tokens
    tail = {name: values[-made:] for name, values in long_alone["logprobs"].items()}
    assert {k: v for k, v in tail.items() if k != "text_offset"} == {
        k: v for k, v in head.items() if k != "text_offset"
    }
    server.wait_even()


def test_echo_with_max_tokens_0_is_the_prompt_alone(server: ServedDemo) -> None:
    """As OpenAI's legacy API and vLLM: the prompt scored, nothing generated."""
    http = Http(server.base)
    prompt = [5, 6, 7, 8, 9]
    scored = completion(http, prompt=prompt, max_tokens=0, echo=True, logprobs=2)
    longer = completion(http, prompt=prompt, max_tokens=3, echo=True, logprobs=2)
    choice, lp = scored["choices"][0], scored["choices"][0]["logprobs"]
    assert choice["finish_reason"] == "length" and scored["usage"]["completion_tokens"] == 0
    assert token_ids(choice) == prompt and choice["text"] == server_text(http, prompt)
    assert lp == {k: v[: len(prompt)] for k, v in longer["choices"][0]["logprobs"].items()}
    body = {"model": MODEL, "prompt": "The little", "max_tokens": 0, "echo": True, "stream": True}
    chunks = stream_lines(
        http, "/v1/completions", {**body, "stream_options": {"include_usage": True}}
    )
    assert "".join(c["choices"][0]["text"] for c in chunks[:-1]) == "The little"
    assert chunks[-1]["usage"]["completion_tokens"] == 0
    check_error(http.post("/v1/completions", json={**body, "echo": False}), 400, "max_tokens")
    server.wait_even()


def test_streamed_echo_logprobs_equal_the_whole(server: ServedDemo) -> None:
    http = Http(server.base)
    body = {
        "model": MODEL,
        "prompt": ["The little", [5, 6, 7]],
        "n": 2,
        "max_tokens": 3,
        "temperature": 0,
        "echo": True,
        "logprobs": 1,
    }
    whole = http.post("/v1/completions", json=body).json()
    got: dict[int, dict[str, list[Any]]] = {}
    texts = dict.fromkeys(range(4), "")
    for ch in stream_lines(http, "/v1/completions", {**body, "stream": True}):
        choice = ch["choices"][0]
        texts[choice["index"]] += choice["text"]
        if choice["logprobs"] is not None:
            mine = got.setdefault(choice["index"], {})
            for name, values in choice["logprobs"].items():
                mine.setdefault(name, []).extend(values)
    for i, choice in enumerate(whole["choices"]):
        assert texts[i] == choice["text"] and got[i] == choice["logprobs"]


@pytest.mark.parametrize(
    "prompt,max_tokens,param,says",
    [
        (["one", 5], 2, "prompt", "prompt[1] must be"),
        (["one", ""], 2, "prompt", "prompt[1] must not be empty"),
        ([[1, 2], [1, 10**6]], 2, "prompt", "prompt[1] token ids"),
        (["one", "x" * 10**6], 2, "prompt", "prompt[1] holds"),  # refused before the tokenizer
        (["one", [1] * 5000], 2, "max_tokens", "prompt[1]: the prompt's 5000 tokens"),
        (["one", [1] * 5000], None, "prompt", "prompt[1]: the prompt's 5000 tokens fill"),
        (["x"] * 2049, 2, "prompt", "at most 2048"),
    ],
)
def test_a_bad_item_is_a_400_naming_it(
    server: ServedDemo, prompt: list[Any], max_tokens: int | None, param: str, says: str
) -> None:
    http = Http(server.base)
    body = {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens}
    error = check_error(http.post("/v1/completions", json=body), 400, param)
    assert says in error["message"], error


def test_beam_search_ranks_its_beams_and_equals_alone_in_a_list(server: ServedDemo) -> None:
    """vLLM's use_beam_search: n beams a prompt, best first by logprob / length; a prompt's
    beams alone and in a list (streamed too) are the same."""
    http = Http(server.base)
    ask = dict(use_beam_search=True, n=3, temperature=0, max_tokens=5, logprobs=1)
    prompt = [5, 6, 7, 8]
    alone = completion(http, prompt=prompt, **ask)
    listed = completion(http, prompt=["Once upon", prompt], **ask)
    assert [c["index"] for c in listed["choices"]] == list(range(6))
    scores = []
    for mine, again in zip(alone["choices"], listed["choices"][3:]):
        assert token_ids(mine) == token_ids(again) and mine["text"] == again["text"]
        lp = mine["logprobs"]["token_logprobs"]
        ended = mine["finish_reason"] == "stop"
        scores.append(sum(lp) / (len(prompt) + len(lp) - ended))
    assert len({tuple(token_ids(c)) for c in alone["choices"]}) == 3
    assert scores == sorted(scores, reverse=True)
    body = {"model": MODEL, "prompt": ["Once upon", prompt], **ask, "stream": True}
    texts = dict.fromkeys(range(6), "")
    for ch in stream_lines(http, "/v1/completions", body):
        texts[ch["choices"][0]["index"]] += ch["choices"][0]["text"]
    assert list(texts.values()) == [c["text"] for c in listed["choices"]]
    server.wait_even()


def test_a_client_leaving_a_beam_search_cancels_it(server: ServedDemo) -> None:
    http = Http(server.base)
    key = "tensorfold_requests_total{endpoint=completion,reason=cancelled}"
    before = server.metrics().get(key, 0)
    body = {
        "model": MODEL,
        "prompt": ["The little", "Once upon"],
        "n": 2,
        "max_tokens": 3000,
        "ignore_eos": True,
        "use_beam_search": True,
    }
    with pytest.raises(TimeoutError):  # the client gives up mid-search
        http.request("POST", "/v1/completions", json_body=body, timeout=1)
    m = server.wait_even(timeout=60)  # its rounds' requests ended: lanes and pages came back
    assert m[key] == before + 1


@pytest.mark.parametrize(
    "fields,param",
    [
        ({"echo": True, "logprobs": 1}, "use_beam_search"),
        ({"response_format": {"type": "json_object"}}, "use_beam_search"),
        ({"length_penalty": "long"}, "length_penalty"),
        ({"use_beam_search": "yes"}, "use_beam_search"),
    ],
)
def test_what_beam_search_refuses(server: ServedDemo, fields: dict[str, Any], param: str) -> None:
    body = {"model": MODEL, "prompt": "x", "max_tokens": 2, "n": 2, "use_beam_search": True}
    check_error(Http(server.base).post("/v1/completions", json={**body, **fields}), 400, param)


def test_the_echo_gate_offline(tmp_path_factory: pytest.TempPathFactory) -> None:
    """testing.assert_prompt_logprobs_exact on lfm2_moe (glm5_next and gemma4 run it in their
    conformance.ChoicesGate): a prompt of 300 rows and a short one."""
    from tensorfold import testing
    from tensorfold.engine.sampling import SamplingParams

    llm = testing.open_llm("lfm2_moe", None, parallel=4, demo_cache=tmp_path_factory.mktemp("d"))
    try:
        short = [5, 6, 7, 8, 9, 10, 11]
        long = [20 + i % 97 for i in range(300)]
        params = SamplingParams(
            temperature=0.8, seed=3, max_tokens=4, logprobs=True, top_logprobs=2
        )
        testing.assert_prompt_logprobs_exact(llm, [short, long], params)
    finally:
        testing.close_even(llm)


# -- vLLM's tests (tests/entrypoints/openai/completion/test_completion.py), against the demo ---
# Their bodies as vLLM wrote them, each run with asyncio.run (this suite has no pytest-asyncio);
# vLLM's `get_tokenizer` is transformers' AutoTokenizer of the served checkpoint.


def async_client(server: ServedDemo) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=server.url, api_key="none", max_retries=0, timeout=60)


async def batch_completions(client: openai.AsyncOpenAI, model_name: str) -> None:
    # test both text and token IDs
    for prompts in (["Hello, my name is"] * 2, [[0, 0, 0, 0, 0]] * 2):
        # test simple list
        batch = await client.completions.create(
            model=model_name,
            prompt=prompts,
            max_tokens=5,
            temperature=0.0,
        )
        assert len(batch.choices) == 2
        assert batch.choices[0].text == batch.choices[1].text

        # test n = 2
        batch = await client.completions.create(
            model=model_name,
            prompt=prompts,
            n=2,
            max_tokens=5,
            temperature=0.0,
            extra_body=dict(
                # NOTE: this has to be true for n > 1 in vLLM, but
                # not necessary for official client.
                use_beam_search=True
            ),
        )
        assert len(batch.choices) == 4
        assert batch.choices[0].text != batch.choices[1].text, "beam search should be different"
        assert batch.choices[0].text == batch.choices[2].text, (
            "two copies of the same prompt should be the same"
        )
        assert batch.choices[1].text == batch.choices[3].text, (
            "two copies of the same prompt should be the same"
        )

        # test streaming
        batch = await client.completions.create(
            model=model_name,
            prompt=prompts,
            max_tokens=5,
            temperature=0.0,
            stream=True,
        )
        texts = [""] * 2
        async for chunk in batch:
            assert len(chunk.choices) == 1
            choice = chunk.choices[0]
            texts[choice.index] += choice.text
        assert texts[0] == texts[1]


async def prompt_logprobs_completion(
    client: openai.AsyncOpenAI, model_name: str, prompt_logprobs: int | None
) -> None:
    params: dict = {
        "prompt": ["A robot may not injure another robot", "My name is"],
        "model": model_name,
    }
    if prompt_logprobs is not None:
        params["extra_body"] = {"prompt_logprobs": prompt_logprobs}

    if prompt_logprobs is not None and prompt_logprobs < 0:
        with pytest.raises(BadRequestError):
            await client.completions.create(**params)
    else:
        completion = await client.completions.create(**params)
        if prompt_logprobs is not None:
            assert completion.choices[0].prompt_logprobs is not None
            assert len(completion.choices[0].prompt_logprobs) > 0

            assert completion.choices[1].prompt_logprobs is not None
            assert len(completion.choices[1].prompt_logprobs) > 0

        else:
            assert completion.choices[0].prompt_logprobs is None


async def echo_logprob_completion(
    client: openai.AsyncOpenAI, model_name: str, logprobs_arg: int, tokenizer: Any
) -> None:
    # test using text and token IDs
    for prompt in ("Hello, my name is", [0, 0, 0, 0, 0]):
        completion = await client.completions.create(
            model=model_name,
            prompt=prompt,
            max_tokens=5,
            temperature=0.0,
            echo=True,
            logprobs=logprobs_arg,
        )

        prompt_text = tokenizer.decode(prompt) if isinstance(prompt, list) else prompt
        assert re.search(r"^" + prompt_text, completion.choices[0].text)
        logprobs = completion.choices[0].logprobs
        assert logprobs is not None
        assert len(logprobs.text_offset) > 5
        assert len(logprobs.token_logprobs) > 5 and logprobs.token_logprobs[0] is None
        assert len(logprobs.top_logprobs) > 5 and logprobs.top_logprobs[0] is None
        for top_logprobs in logprobs.top_logprobs[1:]:
            assert max(logprobs_arg, 1) <= len(top_logprobs) <= logprobs_arg + 1
        assert len(logprobs.tokens) > 5


async def with_client(server: ServedDemo, test: Any, *args: Any) -> None:
    async with async_client(server) as client:
        await test(client, MODEL, *args)


def test_vllm_batch_completions(server: ServedDemo) -> None:
    asyncio.run(with_client(server, batch_completions))


def test_vllm_prompt_logprobs_completion_none(server: ServedDemo) -> None:
    asyncio.run(with_client(server, prompt_logprobs_completion, None))


@pytest.mark.parametrize("logprobs_arg", [1, 0])
def test_vllm_echo_logprob_completion(server: ServedDemo, logprobs_arg: int) -> None:
    from transformers import AutoTokenizer

    demo = next((server.tmp / "demo").glob("lfm2_moe-demo*"))
    tokenizer = AutoTokenizer.from_pretrained(demo)
    asyncio.run(with_client(server, echo_logprob_completion, logprobs_arg, tokenizer))
    server.wait_even()
