"""The GPU suite's engine gates (`pytest -m gpu`, on a CUDA machine): each family's demo
checkpoint in bf16 on the GPU, through the lanes, its Triton kernels compiled for the device and
decode rounds replayed as CUDA graphs:

- concurrent == solo at 1, 8 and 64 streams, greedy and seeded;
- graph replay == eager (TF_CUDA_GRAPHS=0);
- pages == windows with freed pages poisoned;
- resumed == fresh: chats whose later turns come from the prompt store give a fresh run's replies;
- prompt logprobs (`echo` with `logprobs`) the same alone and in a list, scored as decoding drew;
- the same gates with fp8 KV pages (--kv-dtype fp8);
- at --tp 2, where two GPUs are there, the same gates against one rank.
Every engine's census must be even when it closes.
"""

from __future__ import annotations

import dataclasses
import importlib
import json
from pathlib import Path

import pytest
import torch

from tensorfold import testing
from tensorfold.engine.sampling import SamplingParams
from tensorfold.llm import LLM
from tensorfold.testing import close_even, run_chats, tokens

pytestmark = pytest.mark.gpu

FAMILIES = {
    "lfm2_moe": "tensorfold_lfm2_moe",
    "gemma4": "tensorfold_gemma4",
    "glm5_next": "tensorfold_glm",
}
CONTEXT = 4096
LENGTHS = [5, 17, 64, 200, 700, 1500, 2100, 2500]  # two longer than a 2048-row pass
MAX_TOKENS = 8
GREEDY = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
SAMPLED = SamplingParams(temperature=0.8, seed=1234, max_tokens=MAX_TOKENS, ignore_eos=True)
GPU_FLAGS = {
    "device": "cuda",
    "dtype": "bfloat16",
    "memory_limit_gib": 4,
    "context": CONTEXT,
    "prompt_cache_gib": 0,
    "kv_share": 0,
    "kv_host_gib": 0,
}


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def family(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory):
    """(family name, its demo checkpoint folder)."""
    demo = importlib.import_module(f"{FAMILIES[request.param]}.demo")
    return request.param, demo.build_demo(tmp_path_factory.mktemp(request.param))


def open_llm(family: tuple[str, Path], **flags) -> LLM:
    name, folder = family
    return LLM(family=name, model=folder, **{**GPU_FLAGS, **flags})


def draw_prompts(vocab: int, lengths: list[int], seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(5, min(vocab, 700), (n,), generator=g).tolist() for n in lengths]


@pytest.fixture(scope="module")
def runs(family):
    """The prompts, their tokens alone (greedy and seeded), and 64 short prompts alone."""
    llm = open_llm(family, parallel=1)
    try:
        vocab = llm.served.engine.lanes.runner.model.vocab_size
        prompts = draw_prompts(vocab, LENGTHS, 7)
        many = draw_prompts(vocab, [5 + (37 * i) % 300 for i in range(64)], 8)
        alone = testing.tokens_alone(llm, prompts, {"greedy": GREEDY, "sampled": SAMPLED})
        many_alone = testing.tokens_alone(llm, many, {"sampled": SAMPLED})["sampled"]
    finally:
        close_even(llm)
    return prompts, alone, many, many_alone


@pytest.mark.parametrize("params_name", ["greedy", "sampled"])
def test_concurrent_equals_solo_at_1_and_8(family, runs, params_name):
    prompts, alone, _, _ = runs
    params = {"greedy": GREEDY, "sampled": SAMPLED}[params_name]
    llm = open_llm(family, parallel=8)
    try:
        testing.assert_concurrent_equals_solo(
            llm, prompts, params, alone[params_name], levels=(1, 8)
        )
    finally:
        close_even(llm)


def test_concurrent_equals_solo_at_64(family, runs):
    _, _, many, many_alone = runs
    llm = open_llm(family, parallel=64)
    try:
        assert tokens(llm, many, SAMPLED) == many_alone
    finally:
        close_even(llm)


def test_graph_replay_equals_eager(family, runs):
    prompts, alone, _, _ = runs
    llm = open_llm(family, parallel=8, cuda_graphs=False)
    try:
        assert type(llm.served.engine.lanes.runner).__name__ == "ModelRunner"
        assert tokens(llm, prompts, SAMPLED) == alone["sampled"]
    finally:
        close_even(llm)


def test_pages_equal_windows_with_poisoned_pages(family, runs):
    prompts, alone, _, _ = runs
    for flags in ({"kv_pages": "off"}, {"kv_poison": True}):
        llm = open_llm(family, parallel=8, **flags)
        try:
            assert tokens(llm, prompts, SAMPLED) == alone["sampled"], flags
        finally:
            close_even(llm)


def test_prompt_logprobs_equal_alone_and_in_a_list(family, runs):
    """The echo gate (`echo` with `logprobs`) on the GPU: prompts of 5 to 200 rows and one of
    2100 (cut into 128-row chunks), alone and as one request's list with n = 2: the same prompt
    logprobs, the plain request's tokens, and a prompt ending with a run's tokens scored as the
    run drew them (testing.assert_prompt_logprobs_exact)."""
    prompts, _, _, _ = runs
    llm = open_llm(family, parallel=8)
    try:
        params = dataclasses.replace(SAMPLED, logprobs=True, top_logprobs=2)
        testing.assert_prompt_logprobs_exact(llm, [*prompts[:4], prompts[6]], params)
    finally:
        close_even(llm)


def test_resumed_equals_fresh(family):
    chats = [testing.chat_turns(c, 3, 300, 12) for c in range(4)]
    fresh_llm = open_llm(family, parallel=4)
    try:
        fresh, _ = run_chats(fresh_llm, chats, GREEDY)
    finally:
        close_even(fresh_llm)
    llm = open_llm(family, parallel=4, kv_share=16, prompt_cache_gib=0.5, kv_poison=True)
    try:
        replies, cached = run_chats(llm, chats, GREEDY)
    finally:
        close_even(llm)
    assert replies == fresh
    assert all(c > 100 for c in cached[1]), cached  # the second turns resumed


def test_gates_within_fp8_kv(family, runs):
    """--kv-dtype fp8: the gates again, through the kernels' fp8 read paths and graph replays."""
    name, folder = family
    prompts, _, _, _ = runs
    chats = [testing.chat_turns(c, 2, 300, 12) for c in range(3)]
    flags = {k: v for k, v in GPU_FLAGS.items() if k not in ("prompt_cache_gib", "kv_share")}
    testing.assert_engine_gates(
        name, folder, prompts[:6], chats, GREEDY, SAMPLED, kv_dtype="fp8", parallel=4, **flags
    )


def test_fp8_kv_agreement_with_bf16_kv(family, record_property):
    """fp8 pages against bf16 pages on the GPU (not exact: another cache): each trained demo's
    prompts decoded greedily for 16 steps on both; the figures go to the JUnit report
    (`kv_agreement` property) for docs/performance.md. Loose bounds only: the first token of most
    prompts agrees and no logit moves by a fifth of the largest."""
    name, folder = family
    llm = open_llm(family, parallel=1)
    try:
        tok, model = llm.tokenizer, llm.served.engine.lanes.runner.model
        prompts = [tok.encode(t) for t in testing.DEMO_COMPLETIONS + testing.DEMO_CHATS]
    finally:
        close_even(llm)
    agreement = testing.kv_agreement(model, prompts, steps=16)
    record_property("kv_agreement", json.dumps({"family": name, **dataclasses.asdict(agreement)}))
    assert agreement.top1 >= 0.75 and agreement.logit_error < 0.2, agreement


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="--tp 2 needs two GPUs")
def test_gates_at_tp_2(family):
    name, folder = family
    config = json.loads((folder / "config.json").read_text())
    vocab = config.get("vocab_size") or config["text_config"]["vocab_size"]
    prompts = draw_prompts(vocab, LENGTHS, 7)  # runs' prompts, without its one-GPU runs
    chats = [testing.chat_turns(c, 2, 300, 12) for c in range(3)]
    flags = {k: v for k, v in GPU_FLAGS.items() if k not in ("prompt_cache_gib", "kv_share")}
    testing.assert_engine_gates_at_tp(
        name, folder, prompts[:6], chats, GREEDY, SAMPLED, tp=2, match_one_rank=False, **flags
    )
