"""gemma4's verify passes through a GraphRunner's static pass, on the GPU path on the CPU
(tensorfold.ops.gpu.set_triton(True, on_cpu=True), Triton under TRITON_INTERPRET=1): a uniform
verify pass (ForwardPass.rows_each) runs from the device meta alone, the static pass's host
streams being placeholders, and its rings tap by row (ring_taps.py); its rows and taps equal
plain decoding's bit for bit, rolled back through its taps. fp32: the interpreter's bf16
rounding is not the GPU's."""

from __future__ import annotations

import os
from typing import Callable, Sequence

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

pytest.importorskip("triton", reason="the Triton kernels need triton")

from tensorfold import testing  # noqa: E402
from tensorfold.engine.cuda_graphs import GraphRunner  # noqa: E402
from tensorfold.engine.runner import ModelRunner, open_stream  # noqa: E402
from tensorfold.family.forward_pass import StreamRows  # noqa: E402
from tensorfold.ops import gpu  # noqa: E402
from tensorfold_gemma4.config import FULL, SLIDING, Gemma4Config  # noqa: E402
from tensorfold_gemma4.dummy import CONFIGS, build_dummy  # noqa: E402
from tensorfold_gemma4.ring_taps import RingRowTaps  # noqa: E402

S, F = SLIDING, FULL
TINY = {  # the 26B's layout at toy widths: k_eq_v, the MoE beside the MLP
    **CONFIGS["Gemma-4-26B-A4B"],
    "vocab_size": 384,
    "hidden_size": 64,
    "intermediate_size": 96,
    "num_hidden_layers": 3,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "global_head_dim": 32,
    "num_global_key_value_heads": 1,
    "layer_types": [S, F, S],
    "num_experts": 8,
    "top_k_experts": 2,
    "moe_intermediate_size": 32,
}
E_STYLE = {  # per-layer inputs, KV sharing (a store layer's deferred advance), no MoE
    **TINY,
    "num_hidden_layers": 4,
    "layer_types": [S, F, S, F],
    "enable_moe_block": False,
    "num_kv_shared_layers": 2,
    "hidden_size_per_layer_input": 8,
    "vocab_size_per_layer_input": 384,
}


def slot_state(runner: ModelRunner, slot: int) -> dict[str, torch.Tensor]:
    return {name: buf[slot].clone() for name, buf in runner.slots.buffers.items()}


def restored(tapped: object, after: torch.Tensor) -> torch.Tensor:
    """A tap as a state: a tensor as it is, a SlotRestore put into a copy of `after`."""
    if isinstance(tapped, torch.Tensor):
        return tapped
    state = after.clone()
    tapped.restore_into(state)  # type: ignore[attr-defined]
    return state


def assert_uniform_rounds_match(
    make_runner: Callable[..., ModelRunner],
    prompts: Sequence[Sequence[int]],
    tokens: Sequence[Sequence[int]],
    k: int,
    rounds: int,
    *,
    page_rows: int,
) -> ModelRunner:
    """Streams prefilled apart, then `rounds` passes in which every stream runs k + 1 of its
    tokens as a rewind run tapped at each draft row (a uniform verify pass: ForwardPass.
    rows_each), stream i of round r accepting (r + i) % (k + 1) drafts and rolled back through
    its taps (runner.rewind_slot). Each row's logits, each tap and each rolled-back slot equal
    plain one-row decoding's (testing.plain_rows), bit for bit. Returns the runner."""
    r = k + 1
    assert all(len(t) >= rounds * r for t in tokens)
    plain = [
        testing.plain_rows(make_runner, p, t, page_rows=page_rows) for p, t in zip(prompts, tokens)
    ]
    need = [len(p) + len(t) for p, t in zip(prompts, tokens)]
    runner = make_runner(
        num_pages=sum(-(-n // page_rows) for n in need), num_slots=len(need), page_rows=page_rows
    )
    streams = [open_stream(runner, slot, n) for slot, n in enumerate(need)]
    for stream, prompt in zip(streams, prompts):
        runner.run([stream.rows(list(prompt))])
    done = [0] * len(streams)  # tokens fed and kept, a stream
    for round_ in range(rounds):
        runs = []
        for i, stream in enumerate(streams):
            pos = len(prompts[i]) + done[i]
            pages = list(stream.lease.cover(pos + r))
            run = tokens[i][done[i] : done[i] + r]
            taps = tuple(range(pos + 1, pos + r))
            runs.append(StreamRows(i, pos, list(run), pages, "all", taps, rewind=True))
        logits = runner.run(runs)
        fp = runner.last_pass
        assert fp is not None and fp.rows_each == r
        for i, run in enumerate(runs):
            j = done[i]
            assert torch.equal(logits[i], plain[i].logits[j : j + r]), f"round {round_} stream {i}"
            after = slot_state(runner, i)
            for p in run.taps:
                got = fp.taps_at(i, p) or {}
                assert set(got) == set(after), f"stream {i}: the tap at {p} holds {sorted(got)}"
                for name, state in got.items():
                    assert torch.equal(restored(state, after[name]), plain[i].states[p][name]), (
                        f"round {round_}: stream {i}'s {name} tapped at {p}"
                    )
        for i, run in enumerate(runs):  # every stream's taps read before any is rolled back
            a = (round_ + i) % r
            if a < r - 1:
                runner.rewind_slot(i, (i, run.start + a + 1))
            for name, state in slot_state(runner, i).items():
                assert torch.equal(state, plain[i].states[run.start + a + 1][name]), (
                    f"round {round_}: stream {i}'s {name} after accepting {a}"
                )
            done[i] += a + 1
    return runner


@pytest.fixture(autouse=True)
def _gpu_path_on_cpu():
    torch_threads = torch.get_num_threads()
    torch.set_num_threads(1)
    gpu.set_triton(True, on_cpu=True)
    yield
    gpu.set_triton(True, on_cpu=False)
    torch.set_num_threads(torch_threads)


def tiny_model(shape: dict, window: int):
    cfg = Gemma4Config.from_dict({**shape, "sliding_window": window})
    return build_dummy(cfg, "cpu", torch.float32, seed=3, std=0.1)


def ids(n: int, seed: int) -> list[int]:
    return torch.randint(3, 384, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.mark.parametrize(
    "shape, window, ks, kv_dtype",
    [(TINY, 7, (1, 4), "auto"), (E_STYLE, 4, (4,), "fp8")],
    ids=["a26b_style-ring-6", "e_style-ring-3-fp8"],
)
def test_verify_rounds_through_a_graph_runner_equal_plain_decoding(
    shape: dict, window: int, ks: tuple[int, ...], kv_dtype: str
) -> None:
    """Rounds of k + 1 rows replayed through the GraphRunner's (1, k + 1) static
    pass give plain decoding's rows, tap at each draft row the rings plain decoding leaves and
    roll back to them, with rings of 6 rows (wrapped by the runs) and of 3 in fp8 with their
    scales (shorter than a run of 5: the taps keep the pass's rows too)."""
    model = tiny_model(shape, window)
    assert model.verify_graphs
    runners: list[ModelRunner] = []

    def make_runner(**sizes: int) -> ModelRunner:
        runners.append(GraphRunner(model, max_pages=3, kv_dtype=kv_dtype, **sizes))
        return runners[-1]

    prompt, tokens = ids(10, 1), ids(7, 2)
    plain = testing.plain_rows(make_runner, prompt, tokens, page_rows=16)
    for k in ks:
        testing.assert_verify_rows_match(
            make_runner, prompt, tokens, k, page_rows=16, beside=False, rewind=True, plain=plain
        )
        runner = runners[-1]
        assert (1, k + 1) in runner.graphs
        fp = runner.graphs[(1, k + 1)].fp
        assert not fp.tapped and set(fp.row_taps) == set(runner.slots.buffers)
        assert all(isinstance(t, RingRowTaps) for t in fp.row_taps.values())


def test_streams_verified_together_through_a_padded_graph_equal_plain_decoding() -> None:
    """Three streams (inside and past a 6-row ring) verified together, accepting 0, 1 and 2
    drafts: the (4, 3) static pass (one stream of padding on the scratch slot) gives every
    stream plain decoding's rows and taps, and each rolls back through its own."""
    model = tiny_model({**TINY, "enable_moe_block": False}, 7)  # the MoE: interpreter time

    def make_runner(num_slots: int, **sizes: int) -> ModelRunner:  # a bucket of 4 for 3
        return GraphRunner(model, max_pages=3, num_slots=max(num_slots, 4), **sizes)

    prompts = [ids(n, 20 + n) for n in (3, 10, 13)]
    tokens = [ids(3, 30 + i) for i in range(3)]
    runner = assert_uniform_rounds_match(make_runner, prompts, tokens, 2, 1, page_rows=16)
    assert list(runner.graphs) == [(4, 3)] and runner.replays == 1


BENCH = {  # the Gemma-4-26B-A4B bench shape (bench/gemma4_speed.py) at six layers, one full
    **CONFIGS["Gemma-4-26B-A4B"],
    "num_hidden_layers": 6,
    "layer_types": [S] * 5 + [F],
}


@pytest.fixture(scope="module")
def bench_model():
    """BENCH in bf16 on CUDA, dummy weights (the GPU tests')."""
    return build_dummy(Gemma4Config.from_dict(BENCH), "cuda", torch.bfloat16, seed=0)


@pytest.mark.gpu
@pytest.mark.parametrize("kv_dtype", ["auto", "fp8"])
def test_captured_verify_graphs_equal_plain_decoding_at_the_bench_shape(
    bench_model, kv_dtype: str
) -> None:
    """bf16 on CUDA, graphs captured: one stream's verify rounds of k + 1 rows for each k of
    VERIFY_ROWS replayed from (1, k + 1) graphs, its 1023-row rings wrapped, and three streams
    verified together through the (4, 5) graph, give plain decoding's rows and taps bit for bit
    and roll back to them."""
    from tensorfold.engine.cuda_graphs import VERIFY_ROWS

    model = bench_model
    runners: list[GraphRunner] = []

    def make_runner(num_slots: int, **sizes: int) -> ModelRunner:  # a bucket of 4 for 3
        slots = max(num_slots, 4)
        runners.append(GraphRunner(model, max_pages=4, kv_dtype=kv_dtype, num_slots=slots, **sizes))
        return runners[-1]

    prompt, tokens = ids(1012, 1), ids(40, 2)  # positions 1012 .. 1051: past the ring's 1023
    plain = testing.plain_rows(make_runner, prompt, tokens, page_rows=512)
    for r in VERIFY_ROWS:
        testing.assert_verify_rows_match(
            make_runner,
            prompt,
            tokens,
            r - 1,
            page_rows=512,
            beside=False,
            rewind=True,
            plain=plain,
        )
        runner = runners[-1]
        assert runner.capture_error is None, runner.capture_error
        assert runner.graphs[(1, r)].graph is not None
    prompts = [ids(n, n) for n in (300, 1020, 1100)]
    tokens_each = [ids(20, 7 + i) for i in range(3)]
    runner = assert_uniform_rounds_match(make_runner, prompts, tokens_each, 4, 4, page_rows=512)
    assert runner.capture_error is None and runner.graphs[(4, 5)].graph is not None


def hidden_of_rounds(runner: ModelRunner, prompts: list[list[int]]) -> list[torch.Tensor]:
    """Two streams prefilled, then decode rounds of both, stream 0 alone, both: the hidden rows
    (Gemma4Model.pass_hidden) of each round's pass, as the runner's last_pass holds them."""
    model = runner.model
    streams = [open_stream(runner, i, 128) for i in range(len(prompts))]
    for stream, p in zip(streams, prompts):
        runner.run([stream.rows(p)])
    out = []
    for group in ([0, 1], [0], [0, 1]):
        runner.run([streams[i].rows([5 + i]) for i in group])
        assert runner.last_pass is not None
        hidden = model.pass_hidden(runner.last_pass)  # type: ignore[attr-defined]
        assert hidden is not None
        out.append(hidden[: len(group)].clone())
    return out


@pytest.mark.gpu
def test_a_replayed_graphs_hidden_rows_are_its_own(bench_model) -> None:
    """Decode rounds through captured graphs, (2, 1) then (1, 1) then (2, 1) again: the last
    replay's hidden rows (what the assistant drafter reads, through the runner's last_pass)
    are the (2, 1) graph's own output, the eager runner's bits, while the model's last_hidden
    is the tensor of the graph captured last, (1, 1)'s."""
    prompts = [ids(40, 3), ids(70, 4)]
    want = hidden_of_rounds(ModelRunner(bench_model, num_pages=2, num_slots=2), prompts)
    runner = GraphRunner(bench_model, num_pages=2, num_slots=2, max_pages=1)
    got = hidden_of_rounds(runner, prompts)
    assert set(runner.graphs) == {(1, 1), (2, 1)} and runner.capture_error is None
    assert runner.last_pass is runner.graphs[(2, 1)].fp
    assert bench_model.last_hidden is not bench_model.pass_hidden(runner.last_pass)
    for g, w in zip(got, want):
        assert torch.equal(g, w)
