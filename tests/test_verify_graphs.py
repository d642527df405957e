"""Verify passes a CUDA graph can replay (issue 57): the lanes pad a verify pass's runs to one
row count R (filler drafts), and the graph runner replays (bucket, R) graphs whose static pass
reads the device meta alone. drafted == plain through both, on lfm2_moe's dummy in fp32: the
torch path for the lanes' padding, the Triton kernels under the interpreter for the graphs
(fp32: the interpreter rounds to bf16 by truncation, so only the GPU suite checks bf16)."""

from __future__ import annotations

import os
from dataclasses import replace
from typing import Any, Sequence

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402
from test_triton_kernels import _tiny  # noqa: E402  (lfm2_moe's dummy, 3 layers)

from tensorfold import testing  # noqa: E402
from tensorfold.engine.drafts import DraftSettings  # noqa: E402
from tensorfold.engine.lanes import Lanes  # noqa: E402
from tensorfold.engine.requests import Request, TokenOut  # noqa: E402
from tensorfold.engine.runner import ModelRunner  # noqa: E402
from tensorfold.engine.sampling import SamplingParams  # noqa: E402
from tensorfold.family.forward_pass import ForwardPass  # noqa: E402

PAGE_ROWS = 16
GREEDY = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
SEEDED = SamplingParams(
    temperature=0.8,
    top_p=0.9,
    seed=5,
    presence_penalty=0.5,
    frequency_penalty=0.3,
    repetition_penalty=1.1,
    max_tokens=10,
    ignore_eos=True,
)


class PaddingRunner(ModelRunner):
    """A runner that asks the lanes for uniform verify passes (as a GraphRunner does), and
    records each pass's rows a stream."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.shapes: list[tuple[int, int | None]] = []  # (streams, rows_each)
        self.mixed = 0  # passes of several rows a stream, not all alike: no graph replays them

    def verify_row_counts(self, streams: int) -> tuple[int, ...]:
        return (2, 3, 5, 9, 17)

    def _run(self, fp: ForwardPass) -> list[torch.Tensor]:
        self.shapes.append((len(fp.streams), fp.rows_each))
        self.mixed += fp.rows_each is None and fp.num_rows > len(fp.streams)
        return super()._run(fp)


def run_lanes(
    runner: ModelRunner,
    prompts: Sequence[list[int]],
    params: SamplingParams,
    predictions: Sequence[Sequence[int]] | None,
    drafts: DraftSettings,
) -> tuple[list[list[int]], Lanes]:
    lanes = Lanes(runner, lanes=len(prompts), window=128, drafts=drafts, pass_rows=64)
    outs: list[list[int]] = [[] for _ in prompts]
    for i, prompt in enumerate(prompts):
        prediction = tuple(predictions[i]) if predictions and predictions[i] else ()

        def sink(event: Any, out: list[int] = outs[i]) -> None:
            if isinstance(event, TokenOut):
                out.append(event.token)

        lanes.add(Request(list(prompt), params, sink, prediction=prediction))
    for _ in range(400):
        if not lanes.step():
            break
    assert lanes.idle and lanes.uneven == 0 and lanes.pool.census().idle_even
    return outs, lanes


PROMPTS = [list(range(3, 30)), [7, 9, 11, 7, 9], list(range(50, 71))]


@pytest.fixture(scope="module")
def model() -> Any:
    return _tiny(torch.float32)


def make(cls: type, model: Any, **kw: Any) -> ModelRunner:
    return cls(model, num_pages=12, num_slots=3, page_rows=PAGE_ROWS, poison=True, **kw)


@pytest.mark.parametrize("params", [GREEDY, SEEDED], ids=["greedy", "seeded"])
def test_padded_verify_passes_equal_plain(model: Any, params: SamplingParams) -> None:
    """One stream predicted perfectly, one wrongly, one not at all: every verify pass is padded
    to one row count a stream (fillers for the short ones), and every stream's tokens are
    plain's; fillers count as neither drafted nor accepted."""
    plain, _ = run_lanes(make(ModelRunner, model), PROMPTS, params, None, DraftSettings())
    wrong = [(t + 1) % 128 for t in plain[1]]
    runner = make(PaddingRunner, model)
    forced = DraftSettings(tokens=4, adaptive=False)
    got, lanes = run_lanes(runner, PROMPTS, params, [plain[0], wrong, []], forced)
    assert got == plain
    verify = [r for _, r in runner.shapes if r]
    assert verify and set(verify) <= {2, 3, 5}, runner.shapes
    assert runner.mixed == 1, runner.shapes  # the prompts' pass only: every round is uniform
    assert lanes.drafts_accepted >= len(plain[0]) - 6  # the perfect prediction's, most of them
    assert lanes.drafts_accepted <= lanes.tokens_drafted


def test_a_stream_at_its_last_token_drafts_no_one_that_round(model: Any) -> None:
    """max_tokens 3 beside 10: once a stream can take no draft, no stream drafts that round
    (the pass stays one a graph replays), and the tokens are plain's."""
    params = [replace(GREEDY, max_tokens=3), GREEDY]
    plain = [
        run_lanes(make(ModelRunner, model), [p], q, None, DraftSettings())[0][0]
        for p, q in zip(PROMPTS, params)
    ]
    runner = make(PaddingRunner, model)
    lanes = Lanes(runner, lanes=2, window=128, drafts=DraftSettings(tokens=4, adaptive=False))
    outs: list[list[int]] = [[], []]
    for i, (p, q) in enumerate(zip(PROMPTS, params)):
        lanes.add(
            Request(
                p,
                q,
                lambda e, o=outs[i]: o.append(e.token) if isinstance(e, TokenOut) else None,
                prediction=tuple(plain[i]),
            )
        )
    while lanes.step():
        pass
    assert outs == plain and lanes.pool.census().idle_even
    assert all(r is None or r in (2, 3, 5) for _, r in runner.shapes)


@pytest.fixture
def kernels_on_cpu() -> Any:
    from tensorfold.ops import gpu

    gpu.set_triton(True, on_cpu=True)
    yield
    gpu.set_triton(True)


def test_verify_graphs_equal_plain_rows_and_taps(model: Any, kernels_on_cpu: Any) -> None:
    """A GraphRunner's (1, R) verify graph (its static pass run eagerly on the CPU: placeholder
    streams, the device meta real) gives plain decoding's logits and taps, bit for bit, and a
    rewind to any draft row leaves plain's state."""
    from tensorfold.engine.cuda_graphs import GraphRunner

    def graphed(**kw: Any) -> ModelRunner:
        return GraphRunner(model, max_pages=4, **kw)

    def eager(**kw: Any) -> ModelRunner:
        return ModelRunner(model, **kw)

    prompt, tokens = list(range(3, 30)), list(range(40, 52))
    plain = testing.plain_rows(eager, prompt, tokens, page_rows=PAGE_ROWS)
    for k in (1, 4):
        runners: list[Any] = []

        def keep(**kw: Any) -> ModelRunner:
            runners.append(graphed(**kw))
            return runners[-1]

        testing.assert_verify_rows_match(
            keep, prompt, tokens, k, page_rows=PAGE_ROWS, beside=False, rewind=True, plain=plain
        )
        assert (1, k + 1) in runners[0].graphs
        assert runners[0].tap_arena() == {}  # lfm2's conv tails are its own: no arena room


def test_a_graph_tapping_an_unmarked_state_in_the_arena_is_refused(model: Any) -> None:
    """The serving plan counts the tap arena from the states marked StateSpec.arena_taps: a
    verify graph that tapped another state there is refused (it then runs eagerly)."""
    from types import SimpleNamespace

    from tensorfold.engine.cuda_graphs import GraphRunner

    runner = GraphRunner(model, num_pages=4, num_slots=2, page_rows=PAGE_ROWS)
    names = set(runner.slots.buffers)
    fp = SimpleNamespace(rows_each=3, tapped={}, row_taps=dict.fromkeys(names), tap_arena={})
    runner._check_taps(fp)  # type: ignore[arg-type]
    fp.tap_arena = {"L0.conv": torch.zeros(1)}
    with pytest.raises(RuntimeError, match="arena_taps=True"):
        runner._check_taps(fp)  # type: ignore[arg-type]


def test_lanes_through_verify_graphs_equal_plain(model: Any, kernels_on_cpu: Any) -> None:
    """The lanes over a GraphRunner: verify rounds replay (bucket, R) graphs, tokens plain's."""
    from tensorfold.engine.cuda_graphs import GraphRunner

    prompts, params = PROMPTS[:2], replace(GREEDY, max_tokens=6)
    plain, _ = run_lanes(
        make(
            ModelRunner,
            model,
        ),
        prompts,
        params,
        None,
        DraftSettings(),
    )
    runner = make(GraphRunner, model, max_pages=4)
    forced = DraftSettings(tokens=2, adaptive=False)
    got, _ = run_lanes(runner, prompts, params, [plain[0], []], forced)
    assert got == plain
    assert any(r > 1 for _, r in runner.graphs), list(runner.graphs)


@pytest.mark.parametrize("cost, drafts", [(1.0, True), (2.35, False)])
def test_a_padded_pass_drafts_only_where_it_pays(model: Any, cost: float, drafts: bool) -> None:
    """One stream of three predicted, at the prior acceptance (0.6): its ~2.3 tokens a round
    and the others' one against three streams' verify passes. Cheap (cost 1): it drafts; at
    2.35 a pass (LFM2-8B-A1B's five rows on an H100) the fillers would cost more than the
    drafts yield, so no round drafts. The tokens are plain's either way."""
    plain, _ = run_lanes(make(ModelRunner, model), PROMPTS, GREEDY, None, DraftSettings())
    costs = tuple((r, cost) for r in (2, 3, 5))
    runner = make(PaddingRunner, model)
    got, lanes = run_lanes(
        runner, PROMPTS, GREEDY, [plain[0], [], []], DraftSettings(tokens=4, verify_costs=costs)
    )
    assert got == plain
    assert (lanes.tokens_drafted > 0) == drafts


def test_a_paused_stream_still_probes_when_padded_passes_are_priced(model: Any) -> None:
    """A prediction never right, priced as LFM2-8B-A1B's verify passes on an H100: the stream
    drafts, is paused, and its probes still run (one draft after 8 rounds, after 16 more)."""
    params = replace(GREEDY, max_tokens=40)
    plain, _ = run_lanes(make(ModelRunner, model), PROMPTS[:1], params, None, DraftSettings())
    wrong = [(t + 1) % 128 for t in plain[0]]
    costs = ((2, 1.53), (3, 1.83), (5, 2.35))
    runner = make(PaddingRunner, model)
    got, lanes = run_lanes(
        runner, PROMPTS[:1], params, [wrong], DraftSettings(tokens=4, verify_costs=costs)
    )
    assert got == plain
    assert lanes.drafts_accepted == 0 and lanes.tokens_drafted >= 4  # the first round, 2 probes
