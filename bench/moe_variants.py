"""The gemma4 and glm5_next feed-forward blocks on the GPU through the shared MoE kernels.

At Gemma-4-26B-A4B's shape (H 2816, 128 experts top-8 of width 704, dense GeGLU 2112) and
GLM-5.3-Flash's (H 4096, 288 experts top-8 of width 2048, shared expert 2048, dense SwiGLU
12288), random bf16 weights: the time of the dense FFN, the router, and the whole MoE block at
1, 8 and 64 decode rows (eager and replayed from a CUDA graph, which also checks that a decode
pass makes no host sync) and at a 2048-row pass; the error against the torch path (kernels off)
at 64 rows; and whether row 0's bits are the same alone and among 64 rows.

    python bench/moe_variants.py --out $OUT          (on the GPU; bench/device_run.sh runs it
                                                      with plugins/gemma4 plugins/glm)
    python bench/moe_variants.py --smoke             (the CPU, tiny sizes, Triton interpreted)
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Callable

if "--smoke" in sys.argv:
    os.environ.setdefault("TRITON_INTERPRET", "1")

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

BF16 = torch.bfloat16
ROWS = (1, 8, 64, 2048)
SMOKE_ROWS = (1, 8, 64, 96)
GEMMA4 = dict(h=2816, experts=128, top_k=8, width=704, dense=2112)
GLM = dict(h=4096, experts=288, top_k=8, width=2048, shared=2048, dense=12288, groups=1, keep=1)
SMOKE_GEMMA4 = dict(h=64, experts=8, top_k=2, width=32, dense=48)
SMOKE_GLM = dict(h=64, experts=12, top_k=4, width=32, shared=32, dense=96, groups=2, keep=1)


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def timed(fn: Callable[[], Any], device: str) -> float:
    """Median milliseconds of fn."""
    if device == "cpu":
        fn()
        t = time.perf_counter()
        fn()
        return (time.perf_counter() - t) * 1e3
    import triton.testing

    return float(triton.testing.do_bench(fn, warmup=10, rep=50, return_mode="median"))


def graph_timed(fn: Callable[[], torch.Tensor]) -> tuple[float, torch.Tensor]:
    """fn captured in a CUDA graph (fails if it syncs with the host): (replay ms, its output)."""
    import triton.testing

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
        fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fn()
    graph.replay()
    torch.cuda.synchronize()
    ms = triton.testing.do_bench(graph.replay, warmup=10, rep=50, return_mode="median")
    return float(ms), out


def _randn(*shape: int, device: str, scale: float = 1.0, dtype=BF16) -> torch.Tensor:
    return (torch.randn(*shape, device=device) * scale).to(dtype)


def gemma4_block(s: dict[str, int], device: str):
    """(cfg, dense weights, MoE weights, fn(x) -> the dense FFN + MoE outputs, router fn)."""
    from tensorfold_gemma4 import layers
    from tensorfold_gemma4.weights import MlpWeights, MoeWeights

    h, e, i, d = s["h"], s["experts"], s["width"], s["dense"]
    cfg = SimpleNamespace(rms_norm_eps=1e-6, hidden_size=h, top_k_experts=s["top_k"])
    dense = MlpWeights(
        _randn(d, h, device=device, scale=h**-0.5),
        _randn(d, h, device=device, scale=h**-0.5),
        _randn(h, d, device=device, scale=d**-0.5),
    )
    moe = MoeWeights(
        router=_randn(e, h, device=device, scale=h**-0.5 * 4),
        router_scale=(1 + _randn(h, device=device, scale=0.1, dtype=torch.float32)).to(BF16),
        per_expert_scale=(1 + _randn(e, device=device, scale=0.1, dtype=torch.float32)).to(BF16),
        gate_up=_randn(e, 2 * i, h, device=device, scale=h**-0.5),
        down=_randn(e, h, i, device=device, scale=i**-0.5),
        pre_norm=1 + _randn(h, device=device, scale=0.1, dtype=torch.float32),
        post_norm_mlp=torch.ones(h, device=device),
        post_norm_experts=torch.ones(h, device=device),
    )

    def router(x: torch.Tensor):
        from tensorfold.ops import triton_route

        z, _ = triton_route.router_input(x, 1e-6, moe.router_scale, h**-0.5, moe.pre_norm)
        return triton_route.softmax_route(z, moe.router, s["top_k"], moe.per_expert_scale)

    return {
        "dense": lambda x: layers.mlp(dense, x),
        "moe": lambda x: layers.moe(cfg, moe, x),
        "router": router,
    }


def glm_block(s: dict[str, int], device: str):
    from tensorfold_glm import moe as glm_moe
    from tensorfold_glm import triton_ffn
    from tensorfold_glm.weights import DenseWeights, MoeWeights

    h, e, i = s["h"], s["experts"], s["width"]
    cfg = SimpleNamespace(
        n_routed_experts=e,
        num_experts_per_tok=s["top_k"],
        n_group=s["groups"],
        topk_group=s["keep"],
        norm_topk_prob=True,
        routed_scaling_factor=2.5,
        swiglu_limit=10.0,
    )
    gate_up = _randn(e, 2 * i, h, device=device, scale=h**-0.5 * 3)  # some past the clamp
    down = _randn(e, h, i, device=device, scale=i**-0.5)
    moe = MoeWeights(
        router=_randn(e, h, device=device, scale=h**-0.5 * 4, dtype=torch.float32),
        bias=_randn(e, device=device, scale=0.1, dtype=torch.float32),
        experts=[DenseWeights(gate_up[j], down[j]) for j in range(e)],  # views of one stack
        shared=DenseWeights(
            _randn(2 * s["shared"], h, device=device, scale=h**-0.5 * 3),
            _randn(h, s["shared"], device=device, scale=s["shared"] ** -0.5),
        ),
    )
    dense = DenseWeights(
        _randn(2 * s["dense"], h, device=device, scale=h**-0.5 * 3),
        _randn(h, s["dense"], device=device, scale=s["dense"] ** -0.5),
    )
    return {
        "dense": lambda x: glm_moe.swiglu(x, dense, 10.0),
        "moe": lambda x: glm_moe.moe(cfg, x, moe),
        "router": lambda x: triton_ffn.route(cfg, x, moe),
    }


def measure(fns: dict[str, Callable], h: int, rows: tuple[int, ...], device: str) -> dict[str, Any]:
    from tensorfold.ops import gpu

    out: dict[str, Any] = {}
    x = _randn(max(rows), h, device=device)
    for m in rows:
        xm = x[:m].contiguous()
        row: dict[str, Any] = {}
        for name, fn in fns.items():
            row[f"{name}_ms"] = timed(lambda: fn(xm), device)
            if device != "cpu" and m <= 64:
                try:
                    row[f"{name}_graph_ms"] = graph_timed(lambda: fn(xm))[0]
                except Exception as err:  # a host sync in the decode path
                    row[f"{name}_graph_error"] = f"{type(err).__name__}: {err}"[:300]
        out[f"rows_{m}"] = row
    batch = x[:64].contiguous()
    check: dict[str, Any] = {}
    for name in ("dense", "moe"):
        got = fns[name](batch)
        alone = fns[name](batch[:1].clone())
        check[f"{name}_row0_alone_equal"] = bool(torch.equal(alone, got[:1]))
        gpu.set_triton(False)
        try:
            check[f"{name}_rel_err_vs_torch"] = rel(got, fns[name](batch))
        finally:
            gpu.set_triton(True, on_cpu=device == "cpu")
    w, e = fns["router"](batch)
    w1, e1 = fns["router"](batch[:1].clone())
    check["router_row0_alone_equal"] = bool(torch.equal(w1, w[:1]) and torch.equal(e1, e[:1]))
    out["checks"] = check
    return out


def run(device: str = "cuda", smoke: bool = False) -> dict[str, Any]:
    """Times and checks both families' FFN blocks; smoke: tiny shapes (the CPU, interpreted)."""
    from tensorfold.ops import gpu

    if device == "cpu":  # the GPU's bf16 rounding in the interpreter, for the rest of the run
        from tensorfold import testing

        testing.interpreter_rounds_like_the_gpu().__enter__()
    gpu.set_triton(True, on_cpu=device == "cpu")
    torch.manual_seed(0)
    rows = SMOKE_ROWS if smoke else ROWS
    g, m = (SMOKE_GEMMA4, SMOKE_GLM) if smoke else (GEMMA4, GLM)
    result: dict[str, Any] = {
        "device": torch.cuda.get_device_name() if device != "cpu" else "cpu",
        "gemma4_shape": g,
        "glm5_next_shape": m,
    }
    result["gemma4"] = measure(gemma4_block(g, device), g["h"], rows, device)
    if device != "cpu":
        torch.cuda.empty_cache()
    result["glm5_next"] = measure(glm_block(m, device), m["h"], rows, device)
    return result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=None, help="folder for results.json")
    ap.add_argument("--smoke", action="store_true", help="the CPU, tiny shapes, interpreted")
    ap.add_argument("--commit", default="")
    args = ap.parse_args()
    result = run("cpu" if args.smoke else "cuda", smoke=args.smoke)
    result["commit"] = args.commit
    text = json.dumps(result, indent=1)
    print(text)
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "results.json").write_text(text)
    bad = [
        f"{fam}.{k}"
        for fam in ("gemma4", "glm5_next")
        for k, v in result[fam]["checks"].items()
        if v is False
    ]
    bad += [
        f"{fam}.{r}.{k}"
        for fam in ("gemma4", "glm5_next")
        for r, row in result[fam].items()
        if r.startswith("rows_")
        for k in row
        if k.endswith("_error")
    ]
    if bad:
        print("FAILED: " + ", ".join(bad))
        sys.exit(1)


if __name__ == "__main__":
    main()
