"""gemma4's verify passes through a GraphRunner's static pass, on the GPU path on the CPU
(tensorfold.ops.gpu.set_triton(True, on_cpu=True), Triton under TRITON_INTERPRET=1): a uniform
verify pass (ForwardPass.rows_each) runs from the device meta alone, the static pass's host
streams being placeholders, and its rings tap by row (ring_taps.py); its rows and taps equal
plain decoding's bit for bit, rolled back through its taps. fp32: the interpreter's bf16
rounding is not the GPU's."""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

pytest.importorskip("triton", reason="the Triton kernels need triton")

from tensorfold import testing  # noqa: E402
from tensorfold.engine.cuda_graphs import GraphRunner  # noqa: E402
from tensorfold.engine.runner import ModelRunner  # noqa: E402
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
