"""glm5_next's verify passes as a CUDA graph replays them (GlmModel.verify_graphs): a uniform
verify pass (ForwardPass.rows_each) through the GraphRunner's static pass, whose host streams
are placeholders, run from the device meta alone; every fixed state tapped by row
(ForwardPass.tap_rows: the KDA states from the recurrent kernel's per-row taps, the conv tails,
the MTP carry), each row's logits and each tap plain one-row decoding's, bit for bit.

On the CPU under the Triton interpreter the GraphRunner runs its static pass eagerly (nothing is
captured), in fp32 (the interpreter rounds fp32 -> bf16 by truncation, the GPU to nearest); the
GPU test (`pytest -m gpu`) captures the graphs at the GLM-5.3-Flash-8L bench shape in bf16."""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

from typing import Any, Callable, Iterator

import pytest
import torch

pytest.importorskip("triton", reason="the Triton kernels need triton")

from tensorfold import testing  # noqa: E402
from tensorfold.engine.cuda_graphs import GraphRunner  # noqa: E402
from tensorfold.engine.runner import ModelRunner  # noqa: E402
from tensorfold_glm import config, triton_kda  # noqa: E402
from tensorfold_glm.config import GlmConfig  # noqa: E402
from tensorfold_glm.dummy import build_dummy  # noqa: E402

TOKENS = [(7 * i + 3) % 90 + 3 for i in range(80)]


def _model(dtype: torch.dtype, device: str = "cpu") -> Any:
    """A KDA layer then an MLA one with its own indexer (4-row pools, 2 chosen: the selection is
    sparse past 12 rows), dense FFNs, and an MLA MTP layer declared: the layout keeps its carry
    (the trunk taps it; the MTP weights are not run here)."""
    was = config.serve_mtp(True)
    try:
        cfg = GlmConfig.from_dict(
            {
                "vocab_size": 96,
                "hidden_size": 32,
                "intermediate_size": 48,
                "num_hidden_layers": 2,
                "layer_types": ["linear_attention", "indexed_attention"],
                "mlp_layer_types": ["dense", "dense"],
                "linear_num_heads": 2,
                "linear_head_dim": 16,
                "num_attention_heads": 2,
                "num_key_value_heads": 2,
                "q_lora_rank": 16,
                "kv_lora_rank": 16,
                "qk_nope_head_dim": 16,
                "v_head_dim": 16,
                "index_head_dim": 16,
                "index_n_heads": 4,
                "index_topk": 8,
                "index_kpool": 4,
                "hc_sinkhorn_iters": 3,
                "num_nextn_predict_layers": 1,
            },
            "test",
        )
    finally:
        config.serve_mtp(was)
    return build_dummy(cfg, device, dtype, seed=0, std=0.2)


@pytest.fixture(scope="module")
def model() -> Any:
    return _model(torch.float32)


@pytest.fixture
def kernels_on_cpu() -> Iterator[None]:
    from tensorfold.ops import gpu

    gpu.set_triton(True, on_cpu=True)
    yield
    gpu.set_triton(True)


def graph_runners(model: Any, made: list[GraphRunner]) -> Callable[..., ModelRunner]:
    def make(**kw: Any) -> ModelRunner:
        made.append(GraphRunner(model, max_pages=6, **kw))
        return made[-1]

    return make


def check_graphed_verify(model: Any, made: list[GraphRunner], k: int) -> None:
    """The verify runner (the checker's last) ran its rounds of k + 1 rows through the static
    pass of (1, k + 1), tapping by row only, every fixed state."""
    runner = made[-1]
    g = runner.graphs[(1, k + 1)]
    assert g.fp.rows_each == k + 1 and not g.fp.tapped
    assert set(g.fp.row_taps) == set(runner.slots.buffers)
    assert {"L0.kda", "L0.conv", f"L{model.cfg.mtp_layer}.carry"} == set(runner.slots.buffers)
    marked = {s.name for s in runner.layout.fixed if s.arena_taps}  # what the plan counts
    assert marked == set(runner.tap_arena()) == {"L0.kda"}


@pytest.mark.parametrize("k, prompt, tokens", [(1, 14, 4), (4, 62, 7)])
def test_graphed_verify_rounds_equal_plain_decoding(k, prompt, tokens, model, kernels_on_cpu):
    """Runs of k + 1 rows, rounds rejecting drafts in turn and rolled back from their by-row
    taps; k = 4 from row 62: its first run crosses the 64-row KDA chunk boundary."""
    made: list[GraphRunner] = []
    testing.assert_verify_rows_match(
        graph_runners(model, made),
        TOKENS[:prompt],
        TOKENS[prompt : prompt + tokens],
        k,
        page_rows=16,
        beside=False,
        rewind=True,
    )
    check_graphed_verify(model, made, k)
    assert made[-1].replays >= 2


def test_graphed_verify_with_fla_cores_recurrent_kernel(model, kernels_on_cpu):
    """switches.OWN_RECURRENT off: a launch a row through fla-core's kernel (its CPU stand-in)."""
    from tensorfold.ops import switches

    made: list[GraphRunner] = []
    with switches.switched(switches.OWN_RECURRENT, False):
        testing.assert_verify_rows_match(
            graph_runners(model, made),
            TOKENS[:14],
            TOKENS[14:18],
            2,
            page_rows=16,
            beside=False,
            rewind=True,
        )
    check_graphed_verify(model, made, 2)


def test_a_bucket_of_verify_runs_beside_padding_equals_plain_decoding(model, kernels_on_cpu):
    check_bucket(model, TOKENS, 3)


def check_bucket(model: Any, tokens: list[int], r: int) -> None:
    """Three streams' runs of r rows in one pass (the graph of bucket 4: a padding stream on the
    scratch slot and page): each row's logits, each tap and the states left are those of the
    same tokens decoded one row a pass (the decode graph of bucket 4), the three streams
    together."""
    from dataclasses import replace

    from tensorfold.engine.runner import open_stream

    prompts = [tokens[:5], tokens[10:19], tokens[20:33]]
    drafts = [tokens[40 : 40 + r], tokens[50 : 50 + r], tokens[60 : 60 + r]]

    def prefilled() -> tuple[GraphRunner, list[Any]]:
        runner = GraphRunner(model, num_pages=9, num_slots=4, page_rows=16, max_pages=3)
        streams = [open_stream(runner, i, 48) for i in range(3)]
        runner.run([s.rows(p) for s, p in zip(streams, prompts)])
        return runner, streams

    plain, streams = prefilled()
    logits, states = [], []
    for j in range(r):
        out = plain.run([s.rows([d[j]]) for s, d in zip(streams, drafts)])
        logits.append([o[-1].clone() for o in out])  # a graph reuses its output
        states.append({n: plain.slots.get(n)[:3].clone() for n in plain.slots.buffers})
    assert list(plain.graphs) == [(4, 1)]
    runner, streams = prefilled()
    runs = [s.rows(d, "all") for s, d in zip(streams, drafts)]
    runs = [replace(x, taps=tuple(range(x.start + 1, x.end)), rewind=True) for x in runs]
    got = runner.run(runs)
    assert list(runner.graphs) == [(4, r)] and runner.replays == 1
    assert runner.graphs[(4, r)].graph is not None or not runner.capture, runner.capture_error
    fp = runner.last_pass
    assert fp is not None and not fp.tapped
    for i, run in enumerate(runs):
        for j in range(r):
            assert torch.equal(got[i][j], logits[j][i]), (i, j)
        for j in range(1, r):
            taps = fp.taps_at(i, run.start + j)
            assert taps is not None and set(taps) == set(runner.slots.buffers)
            for name, state in taps.items():
                assert torch.equal(state, states[j - 1][name][i]), (i, j, name)
    for name in runner.slots.buffers:
        assert torch.equal(runner.slots.get(name)[:3], states[r - 1][name]), name


@pytest.mark.parametrize("lower_bound", [-5.0, None])
def test_the_recurrent_kernels_taps_are_the_states_after_each_row(lower_bound):
    """triton_kda.recurrent with taps: runs of 4 rows (resumed, slot 2), 3 (fresh, slot 0) and
    1 (slot 3) in one launch; tap a - 1 of a run is kda.delta_rule's state after its first a
    rows (the reference), and the bits of the same run launched a rows long; outputs and final
    states as without taps."""
    from tensorfold_glm.kda import delta_rule, l2norm, log_decay
    from tensorfold_glm.ops import sigmoid

    heads, dk, n = 2, 16, 8
    cfg = GlmConfig.from_dict(
        {"linear_num_heads": heads, "linear_head_dim": dk, "linear_lower_bound": lower_bound},
        "test",
    )
    gen = torch.Generator().manual_seed(1)
    a_log = torch.randn(heads, generator=gen) * 0.5
    dt_bias = torch.randn(heads * dk, generator=gen)
    w = type("Gates", (), dict(decay=torch.exp(a_log), dt_bias=dt_bias, b=torch.zeros(heads, 1)))
    q, k, v, pre = (torch.randn(n, heads * dk, generator=gen) for _ in range(4))
    b = torch.randn(n, heads + 3, generator=gen)[:, 1 : heads + 1]
    start = torch.randn(4, heads, dk, dk, generator=gen)
    runs = [(0, 4, 70, 2), (4, 3, 0, 0), (7, 1, 5, 3)]  # first row, rows, position, slot

    def launch(rs, taps=None):
        states, out = start.clone(), torch.zeros(n, heads, dk)
        cols = [torch.tensor(c, dtype=torch.int32) for c in zip(*rs)]
        triton_kda.recurrent(q, k, v, pre, b, a_log, dt_bias, lower_bound, states, *cols, out, taps)
        return out, states

    taps = torch.full((3, 3, heads, dk, dk), float("nan"))
    out, states = launch(runs, taps)
    plain = launch(runs)
    assert torch.equal(out, plain[0]) and torch.equal(states, plain[1])
    for j, (row0, rows, pos, slot) in enumerate(runs):
        for a in range(1, rows):
            short = launch([(row0, a, pos, slot)])[1][slot]
            assert torch.equal(taps[j, a - 1], short), (j, a)
        assert taps[j, rows - 1 :].isnan().all()  # the run's end is the slot's, not a tap
        at = slice(row0, row0 + rows)
        init = torch.zeros_like(start[slot]) if pos == 0 else start[slot]
        qs, ks, vs = (t[at].view(rows, heads, dk) for t in (q, k, v))
        _, _, want = delta_rule(
            l2norm(qs) * dk**-0.5,
            l2norm(ks),
            vs,
            log_decay(cfg, w, pre[at]),
            sigmoid(b[at]).float(),
            init,
            range(1, rows),
        )
        for a, state in enumerate(want, start=1):
            assert (taps[j, a - 1] - state).abs().max() < 1e-5, (j, a)


# --- on the GPU ---------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def bench_model() -> Any:
    """GLM-5.3-Flash-8L (the bench shape: dummy weights, bf16, ~76 GB) on the GPU."""
    from tensorfold_glm.dummy import SHAPES

    return build_dummy(SHAPES["GLM-5.3-Flash-8L"], "cuda", torch.bfloat16, seed=0)


@pytest.mark.gpu
@pytest.mark.parametrize("k", [1, 4, 8, 16])
def test_gpu_captured_verify_rounds_equal_plain_decoding(k, bench_model):
    """Verify rounds of k + 1 rows replayed from captured (1, k + 1) graphs equal plain decoding
    (itself replayed from (1, 1) graphs) bit for bit, row by row and tap by tap, from row 60
    (across the 64-row KDA chunk boundary and a 48-row page's), rounds rolled back from their
    by-row taps."""
    made: list[GraphRunner] = []
    gen = torch.Generator().manual_seed(k)
    ids = torch.randint(5, 5000, (60 + 3 * (k + 1),), generator=gen).tolist()
    testing.assert_verify_rows_match(
        graph_runners(bench_model, made),
        ids[:60],
        ids[60:],
        k,
        page_rows=48,
        beside=False,
        rewind=True,
    )
    runner = made[-1]
    g = runner.graphs[(1, k + 1)]
    assert g.graph is not None, runner.capture_error  # captured, not refused
    assert not g.fp.tapped and set(g.fp.row_taps) == set(runner.slots.buffers)
    assert runner.replays >= 2


@pytest.mark.gpu
@pytest.mark.parametrize("r", [2, 5])
def test_gpu_a_captured_bucket_of_verify_runs_equals_plain_decoding(r, bench_model):
    gen = torch.Generator().manual_seed(r)
    check_bucket(bench_model, torch.randint(5, 5000, (80,), generator=gen).tolist(), r)
