"""The symmetric-memory sum over two GPUs (`pytest -m gpu`, two CUDA devices; ranks run as
subprocesses of this file, NCCL between them):

- symmetric == the NCCL path (all_gather, then rank_order_sum) bit for bit, for bf16 and fp32
  partials into bf16 and fp32, at 1, 7, 64 and 300 rows (300 crosses the test's 1 MiB bound,
  so the same call goes through NCCL: the switch changes no bits), and equal on both ranks;
- the same inside a captured CUDA graph (three sums, an odd count, so a replay starts on the
  other slot than the eager calls before it), replayed 20 times with new inputs and eager passes
  between the replays;
- no race: 300 back-to-back sums of changing sizes, one rank held back on the GPU at random,
  each result checked afterwards;
- the engine: lfm2_moe's demo at --tp 2 in bf16 gives the same tokens with TF_TP_REDUCE=
  symmetric as with nccl (decode rounds under CUDA graphs), and rank 0 holds the symmetric sum;
- `tensorfold serve --tp 2` on the GPUs stops on SIGINT within --shutdown-timeout plus the
  ranks' teardown, its follower gone and its census printed.
"""

from __future__ import annotations

import signal
import sys
from pathlib import Path

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(torch.cuda.device_count() < 2, reason="two ranks need two GPUs"),
]

H = 2816
ROWS = (1, 7, 64, 300)
TEST_SLOT_BYTES = 1 << 20  # 64 rows of fp32 at H fit, 300 rows do not
CASES = [
    (torch.bfloat16, torch.bfloat16),
    (torch.float32, torch.bfloat16),
    (torch.float32, torch.float32),
    (torch.bfloat16, torch.float32),
]
SHUTDOWN_S = 5.0
TEARDOWN_S = 20.0  # after the drain: engine stop, graphs dropped, NCCL left, follower reaped


# -- ranks ------------------------------------------------------------------------------------


def join(rank: int, port: int):
    """Join NCCL as `rank` of 2 and set up the symmetric sum (the test's bound); returns it."""
    import torch.distributed as dist

    from tensorfold.ops import parallel
    from tensorfold.ops.symmetric_reduce import open_symmetric

    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    device = torch.device("cuda", rank)
    reduce = open_symmetric(
        dist.group.WORLD, rank, 2, device, timeout_s=60, slot_bytes=TEST_SLOT_BYTES
    )
    parallel.set_group(parallel.Group(rank, 2, None, reduce))
    return reduce


def nccl_sum(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The path the symmetric sum replaces: all_gather, then the rank-order fp32 sum."""
    from tensorfold.ops import parallel

    return parallel.rank_order_sum(parallel._gather(x, parallel.current()), dtype)


def partial(rank: int, seed: int, rows: int, dtype: torch.dtype) -> torch.Tensor:
    g = torch.Generator(device="cuda").manual_seed(1000 * seed + rank)
    scale = 10.0 ** (rank - 1)  # the ranks' magnitudes apart: the order shows in the rounding
    return (torch.randn(rows, H, generator=g, device="cuda") * scale).to(dtype)


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    ints = {2: torch.int16, 4: torch.int32}[a.element_size()]
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.view(ints), b.view(ints))


def equal_on_both_ranks(t: torch.Tensor) -> bool:
    from tensorfold.ops import parallel

    both = parallel._gather(t, parallel.current())
    return same_bits(both[0], both[1])


def check_eager(rank: int) -> None:
    from tensorfold.ops import parallel

    reduce = parallel.current().reduce
    took = []
    for i, (dtype, out) in enumerate(CASES):
        for rows in ROWS:
            x = partial(rank, 10 * i + rows, rows, dtype)
            parallel.begin_pass()
            got = parallel.sum_partials(x, out)
            want = nccl_sum(x, out)
            assert same_bits(got, want), (dtype, out, rows)
            assert equal_on_both_ranks(got), (dtype, out, rows)
            took.append(reduce.takes(x, out))
    assert any(took) and not all(took)  # both paths ran


def check_graph(rank: int) -> None:
    from tensorfold.ops import parallel

    static = [
        partial(rank, 0, 64, torch.bfloat16),
        partial(rank, 1, 8, torch.float32),
        partial(rank, 2, 1, torch.bfloat16),
    ]
    outs = [torch.bfloat16, torch.bfloat16, torch.float32]

    def forward() -> list[torch.Tensor]:
        parallel.begin_pass()
        return [parallel.sum_partials(x, d) for x, d in zip(static, outs)]

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        forward()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        results = forward()
    for step in range(20):
        for j, x in enumerate(static):
            x.copy_(partial(rank, 100 + 3 * step + j, x.shape[0], x.dtype))
        graph.replay()
        for x, d, got in zip(static, outs, results):
            assert same_bits(got, nccl_sum(x, d)), (step, x.shape, d)
        parallel.begin_pass()  # an eager pass between replays, an odd number of sums
        for k in range(step % 3 * 2 + 1):
            x = partial(rank, 5000 + 10 * step + k, 1 + 20 * k, torch.bfloat16)
            assert same_bits(parallel.sum_partials(x), nccl_sum(x, torch.bfloat16))


def check_race(rank: int) -> None:
    from tensorfold.ops import parallel

    g = torch.Generator().manual_seed(7)  # the same sizes and stalls on both ranks' hosts
    calls = []
    parallel.begin_pass()
    for i in range(300):
        rows = int(torch.randint(1, 65, (1,), generator=g))
        stall = int(torch.randint(0, 4, (1,), generator=g))
        if stall == 0 and rank == i % 2:
            torch.cuda._sleep(200_000)  # this rank falls behind the other for a while
        x = partial(rank, 20000 + i, rows, torch.bfloat16 if i % 3 else torch.float32)
        calls.append((x, parallel.sum_partials(x, torch.bfloat16)))
        if i % 50 == 49:
            parallel.begin_pass()
    torch.cuda.synchronize()
    for i, (x, got) in enumerate(calls):
        assert same_bits(got, nccl_sum(x, torch.bfloat16)), i


def rank_main(rank: int, port: int, check: str) -> None:
    import torch.distributed as dist

    from tensorfold.ops import parallel

    join(rank, port)
    {"eager": check_eager, "graph": check_graph, "race": check_race}[check](rank)
    torch.cuda.synchronize()
    parallel.set_group(None)
    dist.destroy_process_group()


def run_two(check: str) -> None:
    from tensorfold import testing

    testing.run_ranks(__file__, check, timeout_s=300)


# -- the tests --------------------------------------------------------------------------------


def test_symmetric_sum_equals_the_nccl_path_bit_for_bit():
    run_two("eager")


def test_symmetric_sum_in_a_replayed_cuda_graph():
    run_two("graph")


def test_back_to_back_sums_never_race():
    run_two("race")


def test_engine_tokens_equal_with_either_reduce(tmp_path: Path):
    from tensorfold.engine.sampling import SamplingParams
    from tensorfold.llm import LLM
    from tensorfold.ops import parallel
    from tensorfold.testing import close_even, tokens
    from tensorfold_lfm2_moe.demo import build_demo

    demo = build_demo(tmp_path)
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(5, 700, (n,), generator=g).tolist() for n in (5, 40, 300, 900)]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    got = {}
    for reduce in ("nccl", "symmetric"):
        llm = LLM(
            family="lfm2_moe",
            model=demo,
            tp=2,
            tp_reduce=reduce,
            device="cuda",
            dtype="bfloat16",
            context=2048,
            parallel=4,
            memory_limit_gib=4,
            prompt_cache_gib=0,
            kv_share=0,
        )
        try:
            assert (parallel.current().reduce is not None) == (reduce == "symmetric")
            got[reduce] = tokens(llm, prompts, params)
            assert [tokens(llm, [p], params)[0] for p in prompts] == got[reduce]
        finally:
            close_even(llm)
    assert got["symmetric"] == got["nccl"]


def test_serve_tp_2_on_gpus_stops_on_sigint_within_the_drain_timeout(tmp_path: Path):
    from tensorfold import testing
    from tensorfold_lfm2_moe.demo import build_demo

    demo = build_demo(tmp_path / "demo")
    log_path = tmp_path / "serve.log"
    with open(log_path, "w") as log:
        proc, url = testing.start_serve_tp_2(
            demo,
            log,
            "--shutdown-timeout",
            str(SHUTDOWN_S),
            device="cuda",
            TF_DTYPE="bfloat16",
            TF_MEMORY_LIMIT_GIB="4",
        )
        try:
            took = testing.assert_signal_drains_tp_2(
                proc, url, log_path, signal.SIGINT, wait_s=SHUTDOWN_S + TEARDOWN_S
            )
            print(
                f"sigint stop: --tp 2 on GPUs exited in {took:.1f} s "
                f"(--shutdown-timeout {SHUTDOWN_S:g})"
            )
        finally:
            if proc.poll() is None:
                proc.kill()


if __name__ == "__main__":
    rank_main(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3])
