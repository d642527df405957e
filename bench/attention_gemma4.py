"""gemma4's attention kernels on the GPU at Gemma-4-26B-A4B's shapes: the paged kernel of the full
layers (16 query heads, 2 KV heads x 512, G=8) and the ring kernel of the sliding layers (16
query heads, 8 KV heads x 256, G=2, window 1024), for decode batches 1, 8 and 64 at contexts 8k
and 32k and a 2048-row prompt pass; error against the torch reference; batch invariance (stream
0's bits alone == among 8); a decode step (ring attention + ring advance) replayed from a CUDA
graph == eager.

    python -m bench.attention_gemma4            # on the GPU, prints a JSON dict
    TRITON_INTERPRET=1 python -m bench.attention_gemma4 --smoke   # tiny sizes on the CPU
"""

from __future__ import annotations

import json
import sys
import time
from typing import Any, Callable

import torch

from tensorfold.family.forward_pass import ForwardPass, StreamRows
from tensorfold.ops import attention as paged_ops
from tensorfold.ops import gpu
from tensorfold.ops import window_attention as ring_ops
from tensorfold.ops.pass_meta import PassMeta, pass_meta

BF16 = torch.bfloat16
FULL = dict(hq=16, hkv=2, d=512)
SLIDING = dict(hq=16, hkv=8, d=256, window=1024)
REAL = dict(batches=(1, 8, 64), contexts=(8192, 32768), prompt=2048, page_rows=512)
SMOKE = dict(batches=(1, 2), contexts=(40, 70), prompt=32, page_rows=16, window=20)


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def timed(fn: Callable[[], Any], device: str) -> float:
    """Median milliseconds a call."""
    if device == "cuda":
        import triton.testing

        return float(triton.testing.do_bench(fn, warmup=5, rep=30, return_mode="median"))
    t = time.perf_counter()  # the interpreter: one call is enough to see that it runs
    fn()
    return (time.perf_counter() - t) * 1e3


def _pass(
    streams: int, start: int, rows: int, pages_each: int, page_rows: int, device: str
) -> ForwardPass:
    """`streams` streams of `rows` rows from `start`, stream i on pages [i*pages_each, ...)."""
    return ForwardPass(
        [
            StreamRows(
                i, start, [0] * rows, list(range(i * pages_each, (i + 1) * pages_each)), "last"
            )
            for i in range(streams)
        ],
        page_rows,
        device,
    )


def _randn(*shape: int, device: str) -> torch.Tensor:
    return torch.randn(*shape, device=device).to(BF16)


def _reference(fn: Callable[[], torch.Tensor]) -> torch.Tensor:
    on_cpu = gpu._on_cpu
    gpu.set_triton(False)
    try:
        return fn()
    finally:
        gpu.set_triton(True, on_cpu=on_cpu)


def paged_case(streams: int, context: int, rows: int, sizes: dict, device: str) -> dict:
    """The full layers' paged kernel: `streams` streams whose runs of `rows` end at `context`."""
    pr = sizes["page_rows"]
    pages_each = -(-context // pr)
    fp = _pass(streams, context - rows, rows, pages_each, pr, device)
    k = _randn(streams * pages_each * pr, FULL["hkv"], FULL["d"], device=device)
    v = _randn(streams * pages_each * pr, FULL["hkv"], FULL["d"], device=device)
    q = _randn(fp.num_rows, FULL["hq"], FULL["d"], device=device)

    def call(f: ForwardPass = fp, qq: torch.Tensor = q) -> torch.Tensor:
        return paged_ops.paged_attention(qq, k, v, f, scale=1.0)

    ms = timed(call, device)
    kv_bytes = streams * context * FULL["hkv"] * FULL["d"] * 2 * 2
    return {"ms": ms, "kv_gb_per_s": kv_bytes / ms / 1e6}


def ring_case(streams: int, context: int, rows: int, sizes: dict, device: str) -> dict:
    """The sliding layers' ring kernel and the rings' advance, runs of `rows` ending at
    `context`."""
    window = sizes.get("window", SLIDING["window"])
    fp = _pass(streams, context - rows, rows, 1, 1 << 30, device)
    hkv, d = SLIDING["hkv"], SLIDING["d"]
    ring_k = _randn(streams, window - 1, hkv, d, device=device)
    ring_v = _randn(streams, window - 1, hkv, d, device=device)
    k, v = (_randn(fp.num_rows, hkv, d, device=device) for _ in "kv")
    q = _randn(fp.num_rows, SLIDING["hq"], d, device=device)
    ms = timed(
        lambda: ring_ops.ring_attention(q, k, v, ring_k, ring_v, fp, scale=1.0, window=window),
        device,
    )
    advance_ms = timed(lambda: ring_ops.advance_rings(ring_k, k, fp), device)
    seen = min(window - 1, context - rows) + rows
    kv_bytes = streams * seen * hkv * d * 2 * 2
    return {"ms": ms, "kv_gb_per_s": kv_bytes / ms / 1e6, "advance_ms": advance_ms}


def errors_and_invariance(sizes: dict, device: str) -> dict:
    """Both kernels against the torch reference (8 decode streams and a prompt), and stream 0's
    decode row alone == among 8."""
    out: dict[str, Any] = {}
    pr, window = sizes["page_rows"], sizes.get("window", SLIDING["window"])
    context = sizes["contexts"][0]
    pages_each = -(-context // pr)
    k = _randn(8 * pages_each * pr, FULL["hkv"], FULL["d"], device=device)
    v = _randn(8 * pages_each * pr, FULL["hkv"], FULL["d"], device=device)
    batch = _pass(8, context - 1, 1, pages_each, pr, device)
    alone = _pass(1, context - 1, 1, pages_each, pr, device)
    q = _randn(8, FULL["hq"], FULL["d"], device=device)
    got = paged_ops.paged_attention(q, k, v, batch, scale=1.0)
    want = _reference(lambda: paged_ops.paged_attention(q, k, v, batch, scale=1.0))
    out["paged_rel_err"] = rel(got, want)
    out["paged_alone_equal"] = bool(
        torch.equal(paged_ops.paged_attention(q[:1].clone(), k, v, alone, scale=1.0), got[:1])
    )

    hkv, d = SLIDING["hkv"], SLIDING["d"]
    ring_k = _randn(8, window - 1, hkv, d, device=device)
    ring_v = _randn(8, window - 1, hkv, d, device=device)
    nk, nv = (_randn(8, hkv, d, device=device) for _ in "kv")
    qs = _randn(8, SLIDING["hq"], d, device=device)

    def ring(f: ForwardPass, n: int) -> torch.Tensor:
        return ring_ops.ring_attention(
            qs[:n].clone(),
            nk[:n].clone(),
            nv[:n].clone(),
            ring_k,
            ring_v,
            f,
            scale=1.0,
            window=window,
        )

    got = ring(batch, 8)
    out["ring_rel_err"] = rel(got, _reference(lambda: ring(batch, 8)))
    out["ring_alone_equal"] = bool(torch.equal(ring(alone, 1), got[:1]))
    prompt = _pass(2, context, sizes["prompt"] // 2, pages_each * 2, pr, device)
    pk, pv = (_randn(prompt.num_rows, hkv, d, device=device) for _ in "kv")
    pq = _randn(prompt.num_rows, SLIDING["hq"], d, device=device)
    got = ring_ops.ring_attention(pq, pk, pv, ring_k, ring_v, prompt, scale=1.0, window=window)
    want = _reference(
        lambda: ring_ops.ring_attention(
            pq, pk, pv, ring_k, ring_v, prompt, scale=1.0, window=window
        )
    )
    out["ring_prompt_rel_err"] = rel(got, want)
    advanced = ring_k.clone()
    ring_ops.advance_rings(advanced, pk, prompt)
    torch_advanced = ring_k.clone()
    _reference(lambda: ring_ops.advance_rings(torch_advanced, pk, prompt))
    out["advance_equal"] = bool(torch.equal(advanced, torch_advanced))
    return out


def graph_replay(sizes: dict) -> dict:
    """A decode step of 8 streams (ring attention, then the advance) captured in a CUDA graph
    with the graph runner's kind of PassMeta (int64 views of one static buffer) and replayed ==
    the same step run eagerly."""
    window, hkv, d = sizes.get("window", SLIDING["window"]), SLIDING["hkv"], SLIDING["d"]
    start = sizes["contexts"][0]
    fp = _pass(8, start, 1, 1, 1 << 30, "cuda")
    static = torch.tensor([[start + i for i in range(8)], list(range(8))], device="cuda")
    ar = torch.arange(8, device="cuda")
    ones = torch.ones(8, dtype=torch.int64, device="cuda")
    fp.positions = static[0]
    fp.device_meta = PassMeta(  # type: ignore[attr-defined]
        8,
        8,
        8,
        ar,
        ar,
        ones,
        static[0],
        static[1],
        torch.zeros(8, 1, dtype=torch.int64, device="cuda"),
        ar,
        ar,
        ones,
    )
    ring_k = _randn(8, window - 1, hkv, d, device="cuda")
    k = _randn(8, hkv, d, device="cuda")
    q = _randn(8, SLIDING["hq"], d, device="cuda")
    eager_ring = ring_k.clone()
    eager = ring_ops.ring_attention(q, k, k, eager_ring, eager_ring, fp, scale=1.0, window=window)
    ring_ops.advance_rings(eager_ring, k, fp)
    ring = ring_k.clone()
    for _ in range(2):  # compile before the capture
        ring_ops.ring_attention(q, k, k, ring, ring, fp, scale=1.0, window=window)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        o = ring_ops.ring_attention(q, k, k, ring, ring, fp, scale=1.0, window=window)
        ring_ops.advance_rings(ring, k, fp)
    ring.copy_(ring_k)
    graph.replay()
    torch.cuda.synchronize()
    return {
        "graph_equal": bool(torch.equal(o, eager) and torch.equal(ring, eager_ring)),
        "pass_meta_used": pass_meta(fp) is fp.device_meta,
    }


def run(device: str = "cuda", smoke: bool = False) -> dict:
    """Times and checks as the module says; smoke: tiny sizes (on the CPU under
    TRITON_INTERPRET=1, the kernels interpreted)."""
    sizes = dict(SMOKE if smoke else REAL)
    if device != "cuda":
        gpu.set_triton(True, on_cpu=True)
    torch.manual_seed(0)
    out: dict[str, Any] = {"device": torch.cuda.get_device_name() if device == "cuda" else device}
    try:
        with torch.inference_mode():
            out["checks"] = errors_and_invariance(sizes, device)
            for ctx in sizes["contexts"]:
                for b in sizes["batches"]:
                    out[f"paged_decode_b{b}_ctx{ctx}"] = paged_case(b, ctx, 1, sizes, device)
                    out[f"ring_decode_b{b}_ctx{ctx}"] = ring_case(b, ctx, 1, sizes, device)
            p = sizes["prompt"]
            out[f"paged_prompt_{p}"] = paged_case(1, p, p, sizes, device)
            out[f"ring_prompt_{p}"] = ring_case(1, p, p, sizes, device)
            out[f"ring_prompt_{p}_resumed"] = ring_case(
                1, sizes["contexts"][0] + p, p, sizes, device
            )
        if device == "cuda":
            out["checks"].update(graph_replay(sizes))
    finally:
        gpu.set_triton(True)
    return out


if __name__ == "__main__":
    smoke = "--smoke" in sys.argv
    result = run("cpu" if smoke else "cuda", smoke=smoke)
    print(json.dumps(result, indent=1))
