"""The conformance suite a family's tests opt into: the gates every family must pass (engine,
prompt store, fp8 KV, demo checkpoint, dummy weights, passes), as pytest classes. A family's test
file subclasses one (its name starting with `Test`), sets the class attributes that describe it
(the family's name, its demo builder, the sizes its demo wants) and inherits the tests; its own
tests sit beside them as methods using the same fixtures. docs/plugins.md shows one opting in.

Sizes a test parametrises over are class attributes too (read by `pytest_generate_tests`).
Needs pytest (the test extra): only tests import it."""

from __future__ import annotations

import hashlib
import json
import shutil
from dataclasses import replace
from pathlib import Path
from types import ModuleType
from typing import Any, Callable, ClassVar, Iterator, Sequence

import pytest
import torch

from . import testing
from .engine.sampling import SamplingParams
from .family.checkpoint import Checkpoint, CheckpointError
from .llm import LLM
from .testing import close_even, tokens


def greedy(max_tokens: int) -> SamplingParams:
    """Greedy sampling of max_tokens tokens, past any end of sequence."""
    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)


def seeded(seed: int, max_tokens: int) -> SamplingParams:
    """Sampling at temperature 0.8 seeded `seed`, max_tokens tokens past any end of sequence."""
    return SamplingParams(temperature=0.8, seed=seed, max_tokens=max_tokens, ignore_eos=True)


def digests(folder: Path) -> dict[str, str]:
    """Each file of `folder` by name: its sha256."""
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(folder.iterdir())}


def random_prompts(seed: int, low: int, high: int, lengths: Sequence[int]) -> list[list[int]]:
    """Prompts of the given lengths, ids in [low, high) from a generator seeded `seed`."""
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(low, high, (n,), generator=g).tolist() for n in lengths]


class Parametrised:
    """Tests parametrised by class attributes: `params` maps argument names ("a" or "a, b", as
    pytest.mark.parametrize takes them) to the class attribute that lists their values."""

    params: ClassVar[dict[str, str]] = {}

    def pytest_generate_tests(self, metafunc: pytest.Metafunc) -> None:
        for names, attribute in self.params.items():
            if all(n.strip() in metafunc.fixturenames for n in names.split(",")):
                metafunc.parametrize(names, getattr(self, attribute))


class FamilyCase:
    """What every suite needs: the family's registered name and its demo builder (cache folder
    -> checkpoint folder)."""

    family: ClassVar[str]
    build_demo: ClassVar[Callable[[Path], Path]]

    @pytest.fixture(scope="class")
    def demo(self, tmp_path_factory: pytest.TempPathFactory) -> Path:
        return type(self).build_demo(tmp_path_factory.mktemp("demo"))


class EngineGates(FamilyCase, Parametrised):
    """The exactness gates through the lanes and the engine thread, on the demo checkpoint
    (fp32): concurrent == solo at `levels` (greedy and seeded), pages == windows and poisoned ==
    clean (`page_flags`). Every engine's census must be even when it goes idle."""

    context: ClassVar[int] = 4096
    lengths: ClassVar[Sequence[int]]  # the prompts' lengths
    ids: ClassVar[tuple[int, int]]  # the prompts' ids are in [low, high)
    max_tokens: ClassVar[int] = 8
    parallel: ClassVar[int] = 5
    levels: ClassVar[Sequence[int]] = (2, 5)
    page_flags: ClassVar[Sequence[dict[str, Any]]] = ({"kv_pages": "off"}, {"kv_poison": True})
    params = {"params_name": "sampling_names", "flags": "page_flags"}
    sampling_names = ("greedy", "sampled")

    def sampling(self, name: str) -> SamplingParams:
        return greedy(self.max_tokens) if name == "greedy" else seeded(1234, self.max_tokens)

    def open_llm(self, demo: Path, **flags: Any) -> LLM:
        return testing.open_llm(self.family, demo, **{"context": self.context, **flags})

    @pytest.fixture(scope="class")
    def prompts(self) -> list[list[int]]:
        return random_prompts(7, *self.ids, self.lengths)

    @pytest.fixture(scope="class")
    def alone(self, demo: Path, prompts: list[list[int]]) -> dict[str, list[list[int]]]:
        """Each prompt run by itself, greedy and seeded."""
        llm = self.open_llm(demo, parallel=1)
        try:
            params = {name: self.sampling(name) for name in self.sampling_names}
            return testing.tokens_alone(llm, prompts, params)
        finally:
            close_even(llm)

    def test_concurrent_equals_solo(
        self, demo: Path, prompts: list[list[int]], alone: dict, params_name: str
    ) -> None:
        llm = self.open_llm(demo, parallel=self.parallel)
        try:
            testing.assert_concurrent_equals_solo(
                llm, prompts, self.sampling(params_name), alone[params_name], self.levels
            )
        finally:
            close_even(llm)

    def test_pages_equal_windows_and_poisoned_equals_clean(
        self, demo: Path, prompts: list[list[int]], alone: dict, flags: dict[str, Any]
    ) -> None:
        llm = self.open_llm(demo, parallel=self.parallel, **flags)
        try:
            if flags.get("kv_pages") in ("off", "0"):
                assert llm.served.plan.mode == "windows"
            assert tokens(llm, prompts, self.sampling("sampled")) == alone["sampled"]
        finally:
            close_even(llm)


class ChoicesGate(EngineGates):
    """EngineGates, and n = 3 choices equal to their single twins."""

    def test_n_choices_equal_their_single_twins(self, demo: Path, prompts: list[list[int]]) -> None:
        """n = 3 choices fork from one prompt pass (pages shared, fixed state copied); poisoned
        freed pages, so a choice reading a page its prompt's stream gave back would change."""
        llm = self.open_llm(demo, parallel=4, kv_poison=True)
        try:
            params = self.sampling("sampled")
            testing.assert_choices_equal_single_twins(llm, prompts[2:4], params, n=3)
        finally:
            close_even(llm)

    def test_prompt_logprobs_equal_alone_and_in_a_list(
        self, demo: Path, prompts: list[list[int]]
    ) -> None:
        """The echo gate (`echo` with `logprobs`): a prompt's logprobs from its prompt pass, the
        same alone and in a list with n = 2, its completion the plain request's; one prompt of
        300 rows, cut into chunks of at most 128."""
        llm = self.open_llm(demo, parallel=4)
        try:
            long = (prompts[0] * (1 + 300 // len(prompts[0])))[:300]
            params = replace(self.sampling("sampled"), logprobs=True, top_logprobs=2)
            testing.assert_prompt_logprobs_exact(llm, [prompts[2], long], params)
        finally:
            close_even(llm)


class PromptStoreGates(FamilyCase):
    """The prompt store on the demo checkpoint (fp32): multi-turn chats, turn by turn and all
    chats at once, resumed from the store give the replies of a fresh run; the census even
    after each. `first_turn` words make chat 0's first turn (the others' `first_turns`), the
    later turns `later_turn`; `words` is the family's vocabulary for them."""

    context: ClassVar[int] = 4096
    words: ClassVar[Sequence[str]]
    max_tokens: ClassVar[int]
    chats: ClassVar[int]
    turns: ClassVar[int]
    first_turn: ClassVar[int]
    first_turns: ClassVar[int]
    later_turn: ClassVar[int]
    parallel: ClassVar[int] = 4
    fresh_sampling: ClassVar[Sequence[str]] = ("greedy", "sampled")
    host_kept: ClassVar[int] = 4  # states the store keeps on the device in the host-tier test

    def sampling(self, name: str) -> SamplingParams:
        """Greedy, or seeded 99 at temperature 0.8; `max_tokens` each, ending at an end of
        sequence."""
        if name == "greedy":
            return SamplingParams(temperature=0, max_tokens=self.max_tokens)
        return SamplingParams(temperature=0.8, seed=99, max_tokens=self.max_tokens)

    def open_llm(self, demo: Path, **flags: Any) -> LLM:
        flags = {"context": self.context, "prompt_cache_gib": 0.05, **flags}
        return testing.open_llm(self.family, demo, **flags)

    def user_turns(self, chat: int) -> list[str]:
        first = self.first_turn if chat == 0 else self.first_turns
        return testing.chat_turns(chat, self.turns, first, self.later_turn, self.words)

    def run_chats(self, llm: LLM, params: SamplingParams) -> tuple[list, list]:
        """Turn by turn, all chats at once; returns each turn's replies and cached token counts."""
        return testing.run_chats(llm, [self.user_turns(c) for c in range(self.chats)], params)

    @pytest.fixture(scope="class")
    def fresh(self, demo: Path) -> dict[str, list]:
        llm = self.open_llm(demo, parallel=self.parallel)
        try:
            return {n: self.run_chats(llm, self.sampling(n))[0] for n in self.fresh_sampling}
        finally:
            close_even(llm)

    def check_resumed(self, cached: list[list[int]]) -> None:
        """What the host-tier test asks of the cached counts: every later turn resumed."""
        assert all(n > 0 for turn in cached[1:] for n in turn), cached

    def test_states_resumed_from_the_host_tier_give_the_same_replies(
        self, demo: Path, fresh: dict[str, list]
    ) -> None:
        """`host_kept` states on the device: the store evicts to the host tier, and later
        turns copy their states back from it (poisoned pages: a stale row shows). The census
        counts the host pages too."""
        flags = dict(kv_share=self.host_kept, kv_host_gib=0.1, kv_poison=True)
        llm = self.open_llm(demo, parallel=self.parallel, **flags)
        try:
            replies, cached = self.run_chats(llm, self.sampling("sampled"))
            assert replies == fresh["sampled"]
            testing.assert_host_tier_served(llm, cached)
            self.check_resumed(cached)
        finally:
            close_even(llm)


class PromptStoreResumes(PromptStoreGates):
    """PromptStoreGates, and: resumed == fresh greedy and seeded, poisoned pages with the store
    on, and a mark inside a prompt pass (past `mark_past` rows) resumed with no extra pass."""

    mark_past: ClassVar[int] = 0
    mark_repeats: ClassVar[int] = 2  # the first user turn: the words this many times

    def check_resumed_chats(self, cached: list[list[int]]) -> None:
        """Further checks of the cached counts of resumed chats (none by default)."""

    @pytest.mark.parametrize("name", ["greedy", "sampled"])
    def test_resumed_equals_fresh_over_chats(
        self, demo: Path, fresh: dict[str, list], name: str
    ) -> None:
        llm = self.open_llm(demo, parallel=self.parallel, kv_share=64)
        try:
            replies, cached = self.run_chats(llm, self.sampling(name))
            assert replies == fresh[name]
            assert all(n == 0 for n in cached[0])
            for turn in cached[1:]:
                assert all(n > 0 for n in turn), cached
            self.check_resumed_chats(cached)
            assert llm.served.engine.lanes.rows_cached > 0
        finally:
            close_even(llm)

    def test_poisoned_pages_with_the_store_on_give_the_same_replies(
        self, demo: Path, fresh: dict[str, list]
    ) -> None:
        llm = self.open_llm(demo, parallel=self.parallel, kv_share=64, kv_poison=True)
        try:
            assert self.run_chats(llm, self.sampling("sampled"))[0] == fresh["sampled"]
        finally:
            close_even(llm)

    def test_a_mark_inside_a_pass_resumes_there_with_no_extra_pass(self, demo: Path) -> None:
        testing.assert_a_mark_inside_a_pass_resumes_there(
            lambda **flags: self.open_llm(demo, **flags),
            " ".join(list(self.words) * self.mark_repeats),
            " ".join(reversed(self.words)),
            self.sampling("greedy"),
            past=self.mark_past,
        )


class GateRun(FamilyCase):
    """What testing.assert_engine_gates takes, from class attributes: prompts of `lengths` with
    ids in `ids` (seeded 11), chats of two turns (`first_turn`, then `later_turn` words) that
    must resume past `min_cached` tokens, and greedy and seeded (5) samplings of `max_tokens`."""

    ids: ClassVar[tuple[int, int]]
    lengths: ClassVar[Sequence[int]]
    max_tokens: ClassVar[int] = 6
    first_turn: ClassVar[int] = 150
    later_turn: ClassVar[int] = 20
    min_cached: ClassVar[int] = 150

    def gate_args(self, chats: int) -> tuple[list, list, SamplingParams, SamplingParams]:
        """(prompts, `chats` chats, greedy, sampled), in assert_engine_gates' order."""
        users = [
            testing.chat_turns(c, turns=2, first=self.first_turn, later=self.later_turn)
            for c in range(chats)
        ]
        prompts = random_prompts(11, *self.ids, self.lengths)
        return prompts, users, greedy(self.max_tokens), seeded(5, self.max_tokens)


class KVFp8Gates(GateRun):
    """The family with fp8 KV (TF_KV_DTYPE=fp8) on the demo checkpoint (fp32): every gate holds
    bit for bit within fp8 (testing.assert_engine_gates on three chats: concurrent == solo,
    pages == windows with poisoned freed pages, resumed == fresh), from the device store and
    from the host tier, and fp8 stays within `max_logit_error` of fp32 KV."""

    max_logit_error: ClassVar[float] = 0.05

    def test_gates_hold_within_fp8_kv(self, demo: Path) -> None:
        testing.assert_engine_gates(
            self.family,
            demo,
            *self.gate_args(chats=3),
            min_cached=self.min_cached,
            kv_dtype="fp8",
            context=4096,
            parallel=4,
        )

    def test_fp8_states_resumed_from_the_host_tier_give_the_fresh_replies(self, demo: Path) -> None:
        chats = [testing.chat_turns(c, turns=3, first=60, later=20) for c in range(6)]
        testing.assert_host_tier_resumes_as_fresh(
            self.family, demo, chats, seeded(5, self.max_tokens), kv_dtype="fp8", context=4096
        )

    def test_fp8_kv_agrees_with_fp32_kv_and_the_demo_still_writes_words(self, demo: Path) -> None:
        print(
            testing.assert_demo_agrees_in_kv_dtype(self.family, demo, "fp8", self.max_logit_error)
        )


class Fp8WeightGates(GateRun):
    """The family under `--quantization fp8` (its linears quantized at load) on the demo
    checkpoint: the gates hold bit for bit within fp8 weights (testing.assert_engine_gates on
    two chats: concurrent == solo, pages == windows with poisoned freed pages, resumed ==
    fresh), drafted == plain (n-gram drafts, greedy and seeded), and the plan's start line
    counts the weights in fp8."""

    def test_gates_hold_within_fp8_weights(self, demo: Path) -> None:
        def fp8_plan(llm: Any) -> None:
            assert "(fp8 linears)" in llm.served.plan.startup_line()

        testing.assert_engine_gates(
            self.family,
            demo,
            *self.gate_args(chats=2),
            min_cached=self.min_cached,
            opened=fp8_plan,
            quantization="fp8",
            context=4096,
            parallel=4,
        )

    def test_drafted_equals_plain_within_fp8_weights(self, demo: Path) -> None:
        llm = testing.open_llm(self.family, demo, quantization="fp8", context=1024, parallel=4)
        prompts = ["one two three one two three one two", "a b c d a b c d a b"]
        try:
            for params in (greedy(12), seeded(7, 12)):
                testing.assert_drafted_equals_plain(llm, prompts, params, source="ngram")
        finally:
            close_even(llm)


class EngineGatesAtTp(GateRun):
    """testing.assert_engine_gates_at_tp on the demo at --tp 2 (rank 0 here, a follower it
    starts) on two chats: the gates through the lanes and the prompt store, and greedy tokens
    equal to one rank's; `context` and `parallel` for the engines."""

    context: ClassVar[int] = 4096
    parallel: ClassVar[int] = 4

    def test_engine_gates_at_tp_2_and_tokens_equal_one_ranks(self, demo: Path) -> None:
        testing.assert_engine_gates_at_tp(
            self.family,
            demo,
            *self.gate_args(chats=2),
            min_cached=self.min_cached,
            context=self.context,
            parallel=self.parallel,
        )


class DemoCheckpoint:
    """The family's demo checkpoint (its `demo` module: DEMO_NAME, FILES, build_demo and
    build_weights): a folder of that name with every file, the same bytes on every build
    with the global RNG untouched, and a crashed build leaves nothing."""

    demo_module: ClassVar[ModuleType]

    @pytest.fixture(scope="class")
    def ckpt(self, tmp_path_factory: pytest.TempPathFactory) -> Path:
        return self.demo_module.build_demo(tmp_path_factory.mktemp("cache"))

    def test_builds_named_folder_with_all_files(self, ckpt: Path) -> None:
        name = self.demo_module.DEMO_NAME
        assert ckpt.name == name
        assert sorted(p.name for p in ckpt.iterdir()) == sorted(self.demo_module.FILES)
        assert [p.name for p in ckpt.parent.iterdir()] == [name]  # no temp folder left behind

    def test_two_builds_are_byte_identical(self, ckpt: Path, tmp_path: Path) -> None:
        state = torch.random.get_rng_state()
        again = self.demo_module.build_demo(tmp_path)
        assert torch.equal(torch.random.get_rng_state(), state)  # the global RNG is untouched
        assert digests(again) == digests(ckpt)

    def test_crashed_build_leaves_nothing(
        self, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        def boom(cfg: dict[str, object]) -> dict[str, torch.Tensor]:
            raise RuntimeError("crash while writing weights")

        monkeypatch.setattr(self.demo_module, "build_weights", boom)
        with pytest.raises(RuntimeError, match="crash"):
            self.demo_module.build_demo(tmp_path)
        assert list(tmp_path.iterdir()) == []


class DemoReplies(FamilyCase):
    """The family's trained demo answers in words of its training text
    (testing.assert_demo_writes_words) and thinks as its chat template asks, in the markup of
    its `reasoning_format` hook (testing.assert_demo_thinks): `thinking_by_default` says what
    the template does when a chat sets no `enable_thinking`."""

    thinking_by_default: ClassVar[bool]

    @pytest.fixture(scope="class")
    def llm(self, demo: Path) -> Iterator[LLM]:
        with LLM(family=self.family, model=demo, context=1024, parallel=2) as llm:
            yield llm

    def test_greedy_replies_are_words(self, llm: LLM) -> None:
        testing.assert_demo_writes_words(llm)

    def test_greedy_replies_think_when_asked(self, llm: LLM) -> None:
        testing.assert_demo_thinks(llm, self.thinking_by_default)


SAMPLINGS = ("greedy", "seeded")


class DraftGates(FamilyCase):
    """drafted == plain (verify rounds, issue 57) on the demo checkpoint (fp32), with poisoned
    freed pages throughout: the server's drafts (`source`: n-gram, or a family's own drafter
    the engines open with, `draft_flags`) and predictions (perfect, corrupted, wrong, longer
    than max_tokens, none beside some), greedy and seeded with penalties, with logprobs, at
    `parallel` streams and alone; a stop string inside an accepted run; n choices; pages ==
    windows and resumed == fresh after drafted turns. Every engine's census even when idle."""

    source: ClassVar[str] = "ngram"  # the server's draft source the gates draft with
    draft_flags: ClassVar[dict[str, Any]] = {}  # what the drafting engines open with
    context: ClassVar[int] = 1024
    parallel: ClassVar[int] = 8
    max_tokens: ClassVar[int] = 20
    prompts_text: ClassVar[Sequence[str]] = (
        "Once upon a time there was a",
        "The river runs past the stone and the river runs past the",
        "What is the capital of Japan?",
        "one two three one two three one two",
        "Tell me a story about a cat.",
        "The garden in the morning light",
        "a b c d a b c d a b",
        "Winter bread, winter music, winter",
        # past a sliding window of 128 rows: a rejected draft's rows land on ring rows read later
        " ".join(["the river and the stone, the light and the garden"] * 24),
    )
    chat_words: ClassVar[Sequence[str]] = testing.CHAT_WORDS
    chat_turn_words: ClassVar[tuple[int, int]] = (12, 6)  # the first user turn's, the later's

    def sampling(self, name: str, max_tokens: int | None = None) -> SamplingParams:
        """Greedy or seeded (temperature 0.8, top_p 0.9, every penalty on), with logprobs and
        the top 3, past any end of sequence."""
        common: dict[str, Any] = dict(
            max_tokens=max_tokens or self.max_tokens, ignore_eos=True, logprobs=True, top_logprobs=3
        )
        if name == "greedy":
            return SamplingParams(temperature=0, **common)
        return SamplingParams(
            temperature=0.8,
            top_p=0.9,
            seed=7,
            presence_penalty=0.5,
            frequency_penalty=0.3,
            repetition_penalty=1.1,
            **common,
        )

    @pytest.fixture(scope="class")
    def llm(self, demo: Path) -> Iterator[LLM]:
        flags = dict(context=self.context, parallel=self.parallel, kv_poison=True)
        llm = testing.open_llm(self.family, demo, **flags, **self.draft_flags)
        yield llm
        close_even(llm)

    @property
    def proposes_always(self) -> bool:
        """The source proposes every round (a drafter), not only where a match is (n-gram)."""
        return self.source != "ngram"

    @pytest.fixture(scope="class")
    def plain(self, llm: LLM) -> dict[str, list]:
        with testing.drafting(llm, "off"):
            return {n: llm.generate(self.prompts_text, self.sampling(n)) for n in SAMPLINGS}

    @pytest.mark.parametrize("name", SAMPLINGS)
    def test_server_drafts_equal_plain_together_and_alone(
        self, llm: LLM, plain: dict[str, list], name: str
    ) -> None:
        params, source = self.sampling(name), self.source
        testing.assert_drafted_equals_plain(
            llm, self.prompts_text, params, source=source, plain=plain[name]
        )
        for i in (0, 3):  # one stream
            prompt = self.prompts_text[i]
            testing.assert_drafted_equals_plain(
                llm, [prompt], params, source=source, plain=[plain[name][i]]
            )

    @pytest.mark.parametrize("name", SAMPLINGS)
    def test_predictions_equal_plain(self, llm: LLM, plain: dict[str, list], name: str) -> None:
        """Perfect, every third token wrong, a token dropped, all wrong, longer than max_tokens,
        and no prediction, in one batch; the usage counts say what was kept."""
        outs = [c.token_ids for c in plain[name]]
        vocab = llm.served.engine.lanes.runner.model.vocab_size
        g = torch.Generator().manual_seed(3)
        wrong = torch.randint(0, vocab, (self.max_tokens,), generator=g).tolist()
        predictions = [
            outs[0],
            [t if i % 3 else (t + 1) % vocab for i, t in enumerate(outs[1])],
            outs[2][:5] + outs[2][6:],
            wrong,
            outs[4] + outs[0],
            None,
            outs[6],
            None,
            outs[8],
        ]
        got = testing.assert_drafted_equals_plain(
            llm,
            self.prompts_text,
            self.sampling(name),
            source="off",
            predictions=predictions,
            plain=plain[name],
        )
        perfect = got[0]
        assert perfect.rejected_prediction_tokens == 0
        assert perfect.accepted_prediction_tokens >= self.max_tokens // 2
        assert got[1].rejected_prediction_tokens > 0 and got[1].accepted_prediction_tokens > 0
        assert got[2].accepted_prediction_tokens > 5  # re-synced past the dropped token
        assert got[4].accepted_prediction_tokens >= self.max_tokens // 2
        for c in (got[5], got[7]):
            assert (c.drafted_tokens, c.accepted_prediction_tokens) == (0, 0)
        for c, p in zip(got, predictions):
            assert c.accepted_prediction_tokens + c.rejected_prediction_tokens <= len(p or [])

    def test_a_stop_string_inside_an_accepted_run(self, llm: LLM) -> None:
        """The prediction is the whole answer, so the stop falls inside a run of accepted
        drafts: the reply ends where plain's does, the text held back as plain holds it. A
        source that proposes every round drafts the same replies too, keeping drafts."""
        params = self.sampling("greedy", max_tokens=32)
        with testing.drafting(llm, "off"):
            full = llm.generate(self.prompts_text[:4], params)
        stops = [c.text[len(c.text) // 2 : len(c.text) // 2 + 2] for c in full]
        kept = 0
        for c, stop in zip(full, stops):
            if not stop.strip():
                continue
            stopped = replace(params, stop=(stop,))
            with testing.drafting(llm, "off"):
                plain = llm.generate([c.prompt_token_ids], stopped)
            assert plain[0].finish_reason == "stop"
            testing.assert_drafted_equals_plain(
                llm,
                [c.prompt_token_ids],
                stopped,
                source="off",
                predictions=[c.token_ids],
                plain=plain,
            )
            if self.proposes_always:  # its own drafts, kept in runs where they are good
                got = testing.assert_drafted_equals_plain(
                    llm, [c.prompt_token_ids], stopped, source=self.source, plain=plain
                )
                kept += got[0].accepted_tokens
        assert kept > 0 or not self.proposes_always

    @pytest.mark.parametrize("name", SAMPLINGS)
    def test_structured_output_and_forced_tool_calls_with_drafts_equal_plain(
        self, llm: LLM, name: str
    ) -> None:
        """A JSON schema and a forced tool call: each row masked as the grammar stands after
        the drafts before it; a draft the grammar refuses is cut, never an error."""
        params = replace(self.sampling(name), ignore_eos=False, max_tokens=24)
        schema = {
            "type": "json_schema",
            "json_schema": {
                "name": "city",
                "schema": {
                    "type": "object",
                    "properties": {"name": {"type": "string"}, "size": {"type": "integer"}},
                    "required": ["name", "size"],
                },
            },
        }
        prompts = self.prompts_text[:4]
        with testing.drafting(llm, "off"):
            plain = llm.generate(prompts, params, response_format=schema)
        for predictions in ([c.token_ids for c in plain], [c.token_ids[::-1] for c in plain]):
            with testing.drafting(llm, self.source):
                got = llm.generate(prompts, params, response_format=schema, predictions=predictions)
            assert testing.outputs(got) == testing.outputs(plain)
        assert got[0].drafted_tokens > 0
        tool = {
            "type": "function",
            "function": {
                "name": "weather",
                "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
            },
        }
        chats = [[{"role": "user", "content": p}] for p in prompts[:2]]
        ask = dict(tools=[tool], tool_choice="required")
        with testing.drafting(llm, "off"):
            called = llm.chat(chats, params, **ask)  # type: ignore[arg-type]
        with testing.drafting(llm, self.source):
            drafted = llm.chat(
                chats,
                params,
                predictions=[c.token_ids for c in called],
                **ask,  # type: ignore[arg-type]
            )
        assert testing.outputs(drafted) == testing.outputs(called)
        assert [c.tool_calls for c in drafted] == [c.tool_calls for c in called]
        assert all(c.accepted_prediction_tokens > 0 for c in drafted)

    def test_n_choices_with_drafts_equal_plain(self, llm: LLM) -> None:
        testing.assert_drafted_equals_plain(
            llm, self.prompts_text[:2], self.sampling("seeded"), source=self.source, n=3
        )

    def test_windows_and_resumed_chats_with_drafts_equal_plain(self, demo: Path) -> None:
        """Chats of three turns on windows with the prompt store on, each turn drafted (its
        fresh reply as the prediction, every fourth token wrong, and n-gram; a drafter that
        proposes every round drafts alone): each turn resumes where the drafted turn before
        ended, with the replies of plain fresh runs."""
        users = [testing.chat_turns(c, 3, *self.chat_turn_words, self.chat_words) for c in range(3)]
        params = SamplingParams(temperature=0, max_tokens=16)
        fresh_llm = testing.open_llm(self.family, demo, context=self.context, parallel=3)
        try:
            fresh, _ = testing.run_chats(fresh_llm, users, params)
        finally:
            close_even(fresh_llm)
        flags = dict(kv_pages="off", kv_poison=True, kv_share=16, prompt_cache_gib=0.05)
        flags.update(self.draft_flags)
        llm = testing.open_llm(self.family, demo, context=self.context, parallel=3, **flags)
        try:
            histories: list[list[dict]] = [[] for _ in users]
            for t, replies in enumerate(fresh):
                for c, turns in enumerate(users):
                    histories[c].append({"role": "user", "content": turns[t]})
                predictions = [[x if i % 4 else x + 1 for i, x in enumerate(r)] for r in replies]
                with testing.drafting(llm, self.source):
                    done = llm.chat(
                        histories, params, predictions=None if self.proposes_always else predictions
                    )
                assert [d.token_ids for d in done] == replies
                assert t == 0 or all(d.cached_tokens > 0 for d in done)
                if self.proposes_always:
                    assert all(d.drafted_tokens > 0 for d in done)
                else:
                    assert all(d.accepted_prediction_tokens > 0 for d in done)
                for c, d in enumerate(done):
                    histories[c].append({"role": "assistant", "content": d.text})
        finally:
            close_even(llm)


def configs_only(demo: Path, to: Path) -> Path:
    """A copy of the checkpoint folder `demo` at `to` without its weights."""
    to.mkdir()
    for f in demo.iterdir():
        if f.suffix != ".safetensors":
            shutil.copy(f, to / f.name)
    return to


class DummyWeights(FamilyCase):
    """TF_LOAD_FORMAT=dummy: a checkpoint folder with no weights serves the config's shape
    with random weights from a fixed seed (for benchmarks), through the same lanes: the same
    tokens twice (`dummy_prompt` rows and a short prompt, `dummy_sampling`)."""

    dummy_context: ClassVar[int] = 2048
    dummy_prompt: ClassVar[int] = 30
    dummy_sampling: ClassVar[SamplingParams] = SamplingParams(temperature=0, max_tokens=6)
    dummy_tokens_vary: ClassVar[bool] = False  # the tokens are not one token repeated

    def test_dummy_weights_serve_a_folder_without_weights(self, tmp_path: Path) -> None:
        folder = configs_only(type(self).build_demo(tmp_path / "demo"), tmp_path / "configs")
        flags: dict[str, Any] = dict(device="cpu", dtype="float32", memory_limit_gib=0.25)
        with pytest.raises(CheckpointError):
            LLM(family=self.family, model=folder, **flags)
        flags.update(load_format="dummy", context=self.dummy_context, parallel=2)
        outputs = []
        for _ in range(2):  # the same seed twice: the same weights, the same tokens
            llm = LLM(family=self.family, model=folder, **flags)
            try:
                assert llm.served.model_name == str(folder)
                prompts = [[5, 6, 7, 8], [9] * self.dummy_prompt]
                done = llm.generate(prompts, self.dummy_sampling)
                outputs.append([c.token_ids for c in done])
                assert all(len(c.token_ids) == 6 for c in done)
            finally:
                close_even(llm)
        assert outputs[0] == outputs[1]
        if self.dummy_tokens_vary:
            assert len({t for toks in outputs[0] for t in toks}) > 1
        assert json.loads((folder / "config.json").read_text())["model_type"] == self.family


class PassGates(Parametrised):
    """Exactness across passes on the family's tiny checkpoints (the `tiny` fixture, a
    testing.ReferenceCase, which the family's conftest provides): a stream's logits are the same
    bits whether it runs alone or beside other streams (`together_grid`: dtype and the streams
    run together, on prompts of `pass_lengths`), on contiguous or shuffled pages (cut at
    `shuffle_cuts` of the prompt's first `shuffle_rows`), in a fresh slot or a reused one, with
    freed pages poisoned or not."""

    load: ClassVar[Callable[..., Any]]  # the family's load(checkpoint, device, dtype)
    together_grid: ClassVar[Sequence[tuple[str, tuple[int, ...]]]] = [
        (dtype, together)
        for together in ((0, 1), (1, 2), (0, 1, 2))
        for dtype in ("float32", "bfloat16")
    ]
    pass_lengths: ClassVar[Sequence[int]] = (200, 250, 37)
    pass_ids_high: ClassVar[int | None] = None  # the prompts' ids are below it (the vocabulary)
    pass_pages: ClassVar[tuple[int, int]] = (6, 600)  # num_pages, max_rows
    shuffle_rows: ClassVar[int | None] = None  # None: the whole prompt
    shuffle_cut: ClassVar[int] = 300  # where the prompt's first chunk ends
    shuffle_pool: ClassVar[int] = 64
    params = {"dtype, together": "together_grid"}

    def test_streams_in_one_pass_equal_streams_alone(
        self, tiny: testing.ReferenceCase, dtype: str, together: Sequence[int]
    ) -> None:
        model = tiny.model
        if dtype != "float32":
            model = type(self).load(Checkpoint.open(tiny.path), "cpu", dtype)
        high = self.pass_ids_high or model.vocab_size
        prompts = random_prompts(99, 3, high, self.pass_lengths)
        num_pages, max_rows = self.pass_pages
        testing.assert_streams_together_equal_alone(
            tiny.runner, model, prompts, together, num_pages=num_pages, max_rows=max_rows
        )

    def test_shuffled_page_table_gives_identical_logits(self, tiny: testing.ReferenceCase) -> None:
        prompt = tiny.prompt[: self.shuffle_rows]
        tokens = prompt + [5, 9, 11]
        n = len(tokens)
        cuts = [0, self.shuffle_cut, len(prompt), n - 2, n - 1, n]  # two chunks, then decodes
        testing.assert_shuffled_pages_change_nothing(
            tiny.model, tokens, cuts, pool=self.shuffle_pool
        )

    def test_poisoned_free_pages_change_nothing(self, tiny: testing.ReferenceCase) -> None:
        testing.assert_poisoned_pages_change_nothing(tiny.runner, tiny.prompt)


class SlotPassGates(PassGates):
    """PassGates, and a reused fixed-state slot starts from a fresh one's state."""

    def test_reused_slot_starts_from_zero_state(self, tiny: testing.ReferenceCase) -> None:
        testing.assert_reused_slot_starts_clean(tiny.runner, tiny.prompt)


class VerifyRowsGate(Parametrised):
    """A verify run's promise on the family's tiny checkpoints (the `tiny` fixture), fp32:
    testing.assert_verify_rows_match for each k of `verify_ks`: the prompt's first
    `verify_prompt` rows, then `verify_tokens` more of the prompt's ids fed one row a pass and
    as runs of k + 1 rows (beside a decode row and a prompt chunk, on `verify_page_rows`-row
    pages, rounds rejecting drafts in turn). The defaults put runs across a page boundary and
    glm5_next's 64-row KDA chunk boundary."""

    verify_ks: ClassVar[Sequence[int]] = (1, 3, 7)
    verify_prompt: ClassVar[int] = 58
    verify_tokens: ClassVar[int] = 20
    verify_page_rows: ClassVar[int] = 24
    params = {"k": "verify_ks"}

    def verify_rows(self, tiny: testing.ReferenceCase) -> tuple[list[int], list[int]]:
        """(prompt, tokens) from the tiny case's prompt."""
        end = self.verify_prompt + self.verify_tokens
        return tiny.prompt[: self.verify_prompt], tiny.prompt[self.verify_prompt : end]

    def test_verify_run_rows_and_taps_equal_plain_decoding(
        self, tiny: testing.ReferenceCase, k: int
    ) -> None:
        prompt, tokens = self.verify_rows(tiny)
        testing.assert_verify_rows_match(
            tiny.runner, prompt, tokens, k, page_rows=self.verify_page_rows
        )

    def test_verify_run_rows_and_taps_equal_plain_decoding_with_fp8_kv(
        self, tiny: testing.ReferenceCase
    ) -> None:
        """The same with pages (and fixed states that have an fp8 form, e.g. rings) in fp8
        e4m3 with their scales, k = 3."""
        from .engine.runner import ModelRunner

        def make_runner(**sizes: Any) -> ModelRunner:
            return ModelRunner(tiny.model, kv_dtype="fp8", **sizes)

        prompt, tokens = self.verify_rows(tiny)
        testing.assert_verify_rows_match(
            make_runner, prompt, tokens, 3, page_rows=self.verify_page_rows
        )
