"""A request's heavy CPU step, bounded: chat marks at a cost linear in the chat, prompts too big
for the window refused before the tokenizer runs, and the prompt worker processes (the event
loop runs while a worker tokenizes; a job whose caller leaves or runs late is stopped)."""

from __future__ import annotations

import asyncio
import pickle
import threading

import pytest
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import decoders, models, pre_tokenizers, trainers

from tensorfold.family import chat_template
from tensorfold.family.chat_template import MARKED_TAIL, render_chat
from tensorfold.family.tokenizer import Tokenizer
from tensorfold.server.prompt_work import (
    Prompt,
    PromptJob,
    PromptTooLong,
    longest_token_bytes,
    make_prompt,
    max_prompt_bytes,
)
from tensorfold.server.prompt_workers import JobTimedOut, PromptWorkers, WorkersBusy
from tensorfold.server.request_limits import DaemonThreads

CHATML = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
# Renders forever (the sandbox allows ranges of 100,000) when the last message says "spin".
SPIN = (
    "{% if messages[-1]['content'] == 'spin' %}{% for i in range(100000) %}"
    "{% for j in range(100000) %}{% endfor %}{% endfor %}{% endif %}" + CHATML
)
WINDOW = 1 << 20


@pytest.fixture(scope="module")
def tok(tmp_path_factory: pytest.TempPathFactory) -> Tokenizer:
    hf = HFTokenizer(models.BPE())
    hf.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    hf.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400, show_progress=False, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    hf.train_from_iterator(["hello world, the lazy fox", "user assistant system"] * 8, trainer)
    path = tmp_path_factory.mktemp("tok") / "tokenizer.json"
    hf.save(str(path))
    return Tokenizer(
        HFTokenizer.from_file(str(path)),
        bos_token="<s>",
        eos_token="</s>",
        chat_templates={"default": SPIN},
    )


def chat(n: int) -> list[dict[str, str]]:
    return [{"role": "user" if i % 2 == 0 else "assistant", "content": "a"} for i in range(n)]


def test_marks_cost_a_fixed_number_of_renders(monkeypatch: pytest.MonkeyPatch) -> None:
    renders = 0
    real = chat_template._render

    def counted(*args: object) -> str:
        nonlocal renders
        renders += 1
        return real(*args)  # type: ignore[arg-type]

    monkeypatch.setattr(chat_template, "_render", counted)
    long = render_chat(CHATML, chat(500))
    assert renders == MARKED_TAIL + 1  # was 501: one per message
    assert len(long.marks) == MARKED_TAIL
    assert long.marks[-1] == len(long.text) - len("<|im_start|>assistant\n")
    for mark in long.marks:
        assert long.text[:mark].endswith("a<|im_end|>\n")
    renders = 0
    short = render_chat(CHATML, chat(MARKED_TAIL))  # a short chat keeps a mark per message
    assert renders == MARKED_TAIL + 1 and len(short.marks) == MARKED_TAIL


def test_a_prompt_past_the_window_is_not_tokenized(
    tok: Tokenizer, monkeypatch: pytest.MonkeyPatch
) -> None:
    limit = max_prompt_bytes(tok, 8)
    assert limit == 8 * longest_token_bytes(tok)
    for token in tok.hf.get_vocab():  # no token covers more bytes of text than the bound
        assert len(tok.decode([tok.token_to_id(token)], False).encode()) <= longest_token_bytes(tok)

    def no_tokenizer(*args: object, **kw: object) -> list[int]:
        raise AssertionError("tokenized")

    monkeypatch.setattr(tok, "encode", no_tokenizer)
    with pytest.raises(PromptTooLong) as caught:
        make_prompt(tok, PromptJob(8, limit, chat=[{"role": "user", "content": "x" * limit}]))
    assert caught.value.size > limit
    copy = pickle.loads(pickle.dumps(caught.value))  # a worker sends it back whole
    assert (copy.size, copy.limit) == (caught.value.size, limit)


def test_a_prompt_of_the_window_or_more_comes_back_as_its_length(tok: Tokenizer) -> None:
    text = "hello world " * 20
    ids = tok.encode(text, add_special_tokens=True)
    job = PromptJob(len(ids), 10**6, text=text)
    assert make_prompt(tok, job) == Prompt(len(ids), [])
    fits = make_prompt(tok, PromptJob(len(ids) + 1, 10**6, text=text))
    assert fits == Prompt(len(ids), ids)


def run(coro: object) -> object:
    return asyncio.run(coro)  # type: ignore[arg-type]


def test_the_loop_runs_while_a_worker_tokenizes(tok: Tokenizer) -> None:
    """The tokenizer holds the GIL while it encodes: in a thread it stops the loop for the whole
    of a big prompt; in a worker process the loop keeps ticking."""
    workers = PromptWorkers(tok, 1)
    workers.start()
    text = "hello world, the lazy fox. " * 80_000  # 2 MB

    async def ticks_during_job() -> tuple[Prompt, int]:
        loop = asyncio.get_running_loop()
        await workers.run(PromptJob(WINDOW, 10**9, text="warm"), loop.time() + 120)
        ticks = 0
        job = asyncio.ensure_future(
            workers.run(PromptJob(1000, 10**9, text=text), loop.time() + 120)
        )
        while not job.done() and ticks < 100_000:
            await asyncio.sleep(0.001)
            ticks += 1
        return await job, ticks

    try:
        prompt, ticks = run(ticks_during_job())  # type: ignore[misc]
    finally:
        workers.close()
    assert prompt.tokens > 100_000 and prompt.ids == []  # past the window: the length only
    assert ticks >= 20  # the loop woke every millisecond or so while the worker encoded


def test_a_job_whose_caller_leaves_is_killed_and_replaced(tok: Tokenizer) -> None:
    workers = PromptWorkers(tok, 1)
    workers.start()
    spin = PromptJob(WINDOW, 10**9, chat=[{"role": "user", "content": "spin"}])
    hello = PromptJob(WINDOW, 10**9, chat=[{"role": "user", "content": "hello"}])

    async def scenario() -> Prompt:
        loop = asyncio.get_running_loop()
        first = workers._all[0].proc
        job = asyncio.ensure_future(workers.run(spin, loop.time() + 600))
        await asyncio.sleep(0.5)  # the worker has it
        job.cancel()  # the client left
        with pytest.raises(asyncio.CancelledError):
            await job
        first.join(10)  # killed
        assert first.exitcode is not None
        return await workers.run(hello, loop.time() + 120)

    try:
        prompt = run(scenario())
        assert isinstance(prompt, Prompt) and prompt.tokens > 0
        assert workers.started == 2 and workers.alive == 1  # replaced, no leak
    finally:
        workers.close()


def test_deadlines_stop_a_job_and_a_wait(tok: Tokenizer) -> None:
    workers = PromptWorkers(tok, 1)
    workers.start()
    spin = PromptJob(WINDOW, 10**9, chat=[{"role": "user", "content": "spin"}])

    async def scenario() -> None:
        loop = asyncio.get_running_loop()
        late = asyncio.ensure_future(workers.run(spin, loop.time() + 1.0))
        await asyncio.sleep(0.2)
        with pytest.raises(WorkersBusy):  # the one worker is busy past this one's deadline
            await workers.run(spin, loop.time() + 0.2)
        with pytest.raises(JobTimedOut):
            await late
        ok = await workers.run(PromptJob(WINDOW, 10**9, text="hello"), loop.time() + 120)
        assert ok.tokens > 0

    try:
        run(scenario())
        assert workers.started == 2 and workers.alive == 1
    finally:
        workers.close()


def test_close_kills_a_busy_worker(tok: Tokenizer) -> None:
    workers = PromptWorkers(tok, 2)
    workers.start()
    procs = [w.proc for w in workers._all]
    spin = PromptJob(WINDOW, 10**9, chat=[{"role": "user", "content": "spin"}])

    async def scenario() -> None:
        loop = asyncio.get_running_loop()
        job = asyncio.ensure_future(workers.run(spin, loop.time() + 600))
        await asyncio.sleep(0.5)
        workers.close()  # as serve does when it stops, whatever the workers are doing
        job.cancel()
        with pytest.raises((asyncio.CancelledError, Exception)):
            await job

    run(scenario())
    assert all(p.exitcode is not None for p in procs)


def test_request_threads_do_not_hold_up_exit() -> None:
    pool = DaemonThreads(2, "tf-test")
    assert pool.submit(sum, [1, 2]).result(timeout=10) == 3
    mine = [t for t in threading.enumerate() if t.name.startswith("tf-test")]
    assert len(mine) == 2 and all(t.daemon for t in mine)
