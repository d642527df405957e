"""The partial sum over two GPUs, per call: NCCL's all_gather then the rank-order fp32 sum (the
path TF_TP_REDUCE=nccl keeps) against the one-shot sum over symmetric memory (the default), at
1, 8 and 64 rows of H 2048 (LFM2) and 2816 (Gemma 4), bf16 partials into bf16 (a row-parallel
linear) and fp32 partials into bf16 (the experts' sum), eager and replayed in a CUDA graph.
A decode pass makes two such calls a layer. Rank 0 prints the table and writes it as JSON.

    python bench/experiments/tp_reduce.py [--out DIR]        (two GPUs; starts both ranks itself)
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

import torch

ROWS = (1, 8, 64)
WIDTHS = (2048, 2816)
CASES = (("bf16", torch.bfloat16, torch.bfloat16), ("fp32>bf16", torch.float32, torch.bfloat16))
CALLS = 100  # calls a timing (a graph holds as many)
REPEATS = 5


def nccl_path(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    from tensorfold.ops import parallel

    return parallel.rank_order_sum(parallel._gather(x, parallel.current()), dtype)


def symmetric_path(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    from tensorfold.ops import parallel

    return parallel.current().reduce.sum(x, dtype)


def timed_us(fn, graphed: bool) -> float:
    """Microseconds a call: CALLS calls in a row (with a pass fence first, as a pass has),
    eager or as one graph replay; the best of REPEATS."""
    import torch.distributed as dist

    from tensorfold.ops import parallel

    def calls() -> None:
        parallel.begin_pass()
        for _ in range(CALLS):
            fn()

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        calls()
    torch.cuda.current_stream().wait_stream(side)
    run = calls
    if graphed:
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            calls()
        run = graph.replay
    best = float("inf")
    for _ in range(REPEATS):
        torch.cuda.synchronize()
        dist.barrier()  # both ranks start together
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        run()
        end.record()
        end.synchronize()
        best = min(best, 1e3 * start.elapsed_time(end) / CALLS)
    return best


def rank_main(rank: int, port: int, out: str) -> None:
    import torch.distributed as dist

    from tensorfold.ops import parallel
    from tensorfold.ops.symmetric_reduce import open_symmetric

    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    reduce = open_symmetric(dist.group.WORLD, rank, 2, torch.device("cuda", rank), 60.0)
    parallel.set_group(parallel.Group(rank, 2, None, reduce))
    table = []
    for width in WIDTHS:
        for rows in ROWS:
            for name, dtype, out_dtype in CASES:
                x = torch.randn(rows, width, device="cuda").to(dtype)
                row = {"rows": rows, "H": width, "partial": name}
                for path, fn in (("nccl", nccl_path), ("symmetric", symmetric_path)):
                    for graphed in (False, True):
                        key = f"{path}_{'graph' if graphed else 'eager'}_us"
                        try:
                            row[key] = timed_us(lambda fn=fn: fn(x, out_dtype), graphed)
                        except Exception as exc:  # e.g. a capture this torch refuses
                            row[key] = float("nan")
                            row[key.replace("_us", "_error")] = f"{type(exc).__name__}: {exc}"
                            torch.cuda.synchronize()
                table.append(row)
    if rank == 0:
        lines = [
            f"{'rows':>4} {'H':>5} {'partial':>9} | {'nccl eager':>10} {'symm eager':>10} | "
            f"{'nccl graph':>10} {'symm graph':>10} {'x':>5}"
        ]
        for r in table:
            lines.append(
                f"{r['rows']:>4} {r['H']:>5} {r['partial']:>9} | {r['nccl_eager_us']:>10.1f} "
                f"{r['symmetric_eager_us']:>10.1f} | {r['nccl_graph_us']:>10.1f} "
                f"{r['symmetric_graph_us']:>10.1f} "
                f"{r['nccl_graph_us'] / r['symmetric_graph_us']:>5.1f}"
            )
        text = "per-call microseconds, two ranks (x: nccl graph / symmetric graph)\n"
        text += "\n".join(lines)
        print(text)
        if out:
            Path(out).mkdir(parents=True, exist_ok=True)
            (Path(out) / "tp_reduce.json").write_text(json.dumps(table, indent=1))
            (Path(out) / "tp_reduce.txt").write_text(text + "\n")
    torch.cuda.synchronize()
    parallel.set_group(None)
    dist.destroy_process_group()


def main() -> None:
    from tensorfold import testing

    if len(sys.argv) > 1 and sys.argv[1].isdigit():  # a rank this script started
        rank_main(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3])
        return
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="")
    args = parser.parse_args()
    port = str(testing.free_port())
    procs = [
        subprocess.Popen(
            [sys.executable, __file__, str(r), port, args.out], env=testing.clean_env()
        )
        for r in range(2)
    ]
    codes = [p.wait(timeout=540) for p in procs]
    if codes != [0, 0]:
        sys.exit(f"tp_reduce: ranks exited {codes}")


if __name__ == "__main__":
    main()
