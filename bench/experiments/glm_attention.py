"""glm5_next's MLA layer with the DSA indexer on the GPU at GLM-5.3-Flash's shape (64 heads,
latent 512, indexer 32 x 128, 16-row pools, top 2048 keys): time per layer call, eager and as a
captured CUDA graph (a capture fails on a host sync), for decode batches 1, 8 and 64 at contexts
8k and 32k and a 2k-row prompt pass ending there; the selection and the attention kernels
alone; stream 0's bits alone == in a batch of 8; the error against the torch path on the same GPU.

Latent and indexer rows are random bf16 rows in a real PagedRows, each stream on its own pages;
every complete pool's cached key (`L0.pool_key`) is computed from them by
triton_indexer.write_pool_keys (on the GPU path), so the scoring reads cached keys as in serving.

    python bench/experiments/glm_attention.py                 # on the GPU; prints JSON
    python bench/experiments/glm_attention.py --smoke         # on the CPU, tiny, Triton interpreted
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any, Callable

if "--smoke" in sys.argv:
    os.environ.setdefault("TRITON_INTERPRET", "1")

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from bench.sections import captured  # noqa: E402
from tensorfold.adapters.paged_kv import PagedRows  # noqa: E402
from tensorfold.family import RowSpec  # noqa: E402
from tensorfold.family.forward_pass import ForwardPass, StreamRows  # noqa: E402
from tensorfold.ops import gpu  # noqa: E402
from tensorfold.ops.pass_meta import pass_meta  # noqa: E402
from tensorfold_glm import indexer, triton_indexer, triton_mla  # noqa: E402
from tensorfold_glm.config import GlmConfig  # noqa: E402
from tensorfold_glm.mla import mla  # noqa: E402
from tensorfold_glm.ops import head_linear  # noqa: E402
from tensorfold_glm.weights import IndexerWeights, MlaWeights  # noqa: E402

BF16 = torch.bfloat16
REAL = GlmConfig()  # GLM-5.3-Flash (the class defaults)
TINY = GlmConfig(
    hidden_size=32,
    num_attention_heads=4,
    num_key_value_heads=4,
    q_lora_rank=24,
    qk_nope_head_dim=16,
    v_head_dim=16,
    kv_lora_rank=32,
    index_head_dim=16,
    index_n_heads=16,
    index_kpool=4,
    index_topk=8,
)
SIZES = {  # (contexts, decode batches, prompt rows, page rows)
    "real": ((8192, 32768), (1, 8, 64), 2048, 512),
    "smoke": ((40, 70), (1, 2, 8), 24, 16),
}


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


class Layer:
    """One MLA layer with its own indexer, random weights, and rows for `streams` streams of
    `pages_each` pages, filled with random rows."""

    def __init__(self, cfg: GlmConfig, device: str, streams: int, pages_each: int, page_rows: int):
        self.cfg, self.device, self.page_rows, self.pages_each = cfg, device, page_rows, pages_each
        g = torch.Generator(device=device).manual_seed(0)

        def w(*shape: int, base: float = 0.0) -> torch.Tensor:
            scale = shape[-1] ** -0.5 if base == 0.0 else 0.05
            return (base + torch.randn(*shape, device=device, generator=g) * scale).to(BF16)

        c, h, heads = cfg, cfg.hidden_size, cfg.num_attention_heads
        qr, r, dn, di, ni = (
            c.q_lora_rank,
            c.kv_lora_rank,
            c.qk_nope_head_dim,
            c.index_head_dim,
            c.index_n_heads,
        )
        self.w = MlaWeights(
            q_a=w(qr, h),
            q_a_bias=None,
            q_a_norm=w(qr, base=1.0),
            q_b=w(heads * dn, qr),
            kv_a=w(r, h),
            kv_a_bias=None,
            kv_a_norm=w(r, base=1.0),
            w_uk=w(heads, r, dn),
            w_uv=w(heads, c.v_head_dim, r),
            o=w(h, heads * c.v_head_dim),
            o_bias=None,
            indexer=IndexerWeights(
                wq_b=w(ni * di, qr),
                wk=w(di, h),
                k_norm=w(di, base=1.0),
                k_bias=w(di, base=0.0),
                weights_proj=w(ni, h),
                ape=w(c.index_kpool, di),
                gate=w(di, h),
            ),
        )
        specs = [
            RowSpec(f"L0.{n}", (width,), "bfloat16")
            for n, width in [("latent", r), ("index_k", di), ("index_gate", di), ("pool_key", di)]
        ]
        self.rows = PagedRows(specs, streams * pages_each, page_rows, device)
        for buf in self.rows.buffers.values():
            buf.copy_(torch.randn(buf.shape, device=device, generator=g).to(BF16))
        self.fill_pool_keys(streams)
        self.x = torch.randn(4096, h, device=device, generator=g).to(BF16)

    def fill_pool_keys(self, streams: int) -> None:
        """Every complete pool's key from the random indexer rows, as the passes that wrote them
        would have cached it (one pass over all the rows of every stream's pages)."""
        fp = self.pass_(list(range(streams)), 0, self.pages_each * self.page_rows)
        self.write_pool_keys(fp, pass_meta(fp))

    def write_pool_keys(self, fp: ForwardPass, meta: Any) -> None:
        """triton_indexer.write_pool_keys: the keys of the pools fp's rows complete, from this
        layer's indexer rows."""
        rows = self.rows
        triton_indexer.write_pool_keys(
            rows.flat("L0.index_k"),
            rows.flat("L0.index_gate"),
            self.w.indexer.ape,
            rows.flat("L0.pool_key"),
            fp.positions,
            fp.write_index,
            meta,
            fp.page_rows,
        )

    def pass_(self, streams: list[int], start: int, rows: int) -> ForwardPass:
        pe = self.pages_each
        specs = [
            StreamRows(i, start, [1] * rows, list(range(i * pe, (i + 1) * pe)), "last")
            for i in streams
        ]
        return ForwardPass(specs, self.page_rows, self.device)

    def call(self, fp: ForwardPass) -> tuple[torch.Tensor, Any]:
        return mla(self.cfg, "L0", self.w, self.x[: fp.num_rows], fp, self.rows, None)


class Clock:
    def __init__(self, device: str):
        self.device = device

    def __call__(self, fn: Callable[[], Any]) -> float:
        """Median milliseconds a call."""
        if self.device != "cuda":
            t = time.perf_counter()
            fn()
            return (time.perf_counter() - t) * 1e3
        import triton.testing

        return float(triton.testing.do_bench(fn, warmup=5, rep=30, return_mode="median"))

    def graphed(self, fn: Callable[[], Any]) -> tuple[float | None, str | None]:
        """Milliseconds a replay of fn captured as a CUDA graph (None, why: when it fails)."""
        if self.device != "cuda":
            return None, "no CUDA"
        try:
            return self(captured(fn).replay), None
        except Exception as exc:  # noqa: BLE001 - reported, not raised
            torch.cuda.synchronize()
            return None, f"{type(exc).__name__}: {exc}"


def parts(layer: Layer, fp: ForwardPass, clock: Clock) -> dict[str, float]:
    """The selection's kernels (caching the pass's pool keys, scoring, top-k) and the attention
    kernels alone, on this pass's inputs."""
    cfg, rows, n = layer.cfg, layer.rows, fp.num_rows
    ni, di, kp = cfg.index_n_heads, cfg.index_head_dim, cfg.index_kpool
    g = torch.Generator(device=layer.device).manual_seed(1)
    q = torch.randn(n, ni, di, device=layer.device, generator=g).to(BF16)
    wts = torch.randn(n, ni, device=layer.device, generator=g)
    q_lat = torch.randn(
        n, cfg.num_attention_heads, cfg.kv_lora_rank, device=layer.device, generator=g
    ).to(BF16)
    meta, pools = pass_meta(fp), indexer.pool_columns(fp, kp)
    args = (q, wts, rows.flat("L0.pool_key"), kp, fp.positions, meta, fp.page_rows, pools)
    keys = triton_indexer.pool_key_scores(*args, di**-0.5)
    sel = triton_indexer.top_pools(keys, cfg.select_pools)
    qk = torch.randn(
        n, cfg.num_attention_heads, cfg.qk_nope_head_dim, device=layer.device, generator=g
    ).to(BF16)
    return {
        "pool_key_ms": clock(lambda: layer.write_pool_keys(fp, meta)),
        "score_ms": clock(lambda: triton_indexer.pool_key_scores(*args, di**-0.5)),
        "topk_ms": clock(lambda: triton_indexer.top_pools(keys, cfg.select_pools)),
        "attend_ms": clock(
            lambda: triton_mla.sparse_mla(
                q_lat,
                rows.flat("L0.latent"),
                sel,
                fp.positions,
                meta,
                fp.page_rows,
                kp,
                cfg.qk_nope_head_dim**-0.5,
            )
        ),
        "head_linears_ms": clock(lambda: head_linear(head_linear(qk, layer.w.w_uk), layer.w.w_uv)),
    }


def run(device: str = "cuda", smoke: bool = False) -> dict[str, Any]:
    """Times and checks (see the module docstring); smoke: tiny sizes (any device)."""
    cfg = TINY if smoke else REAL
    contexts, batches, prompt, page_rows = SIZES["smoke" if smoke else "real"]
    clock = Clock(device)
    out: dict[str, Any] = {"shape": "tiny" if smoke else "GLM-5.3-Flash", "device": device}
    if device == "cuda":
        out["gpu"] = torch.cuda.get_device_name()
    for ctx in contexts:
        pages_each = -(-(ctx + 1) // page_rows)
        layer = Layer(cfg, device, max(batches), pages_each, page_rows)
        for b in batches:
            fp = layer.pass_(list(range(b)), ctx, 1)
            row = {"eager_ms": clock(lambda: layer.call(fp))}
            row["graph_ms"], row["graph_error"] = clock.graphed(lambda: layer.call(fp))
            row.update(parts(layer, fp, clock))
            out[f"decode_ctx{ctx}_b{b}"] = row
        fp = layer.pass_([0], ctx - prompt, prompt)
        row = {"eager_ms": clock(lambda: layer.call(fp)), **parts(layer, fp, clock)}
        row["rows_per_s"] = prompt / row["eager_ms"] * 1e3
        out[f"prompt{prompt}_ctx{ctx}"] = row
        out[f"gates_ctx{ctx}"] = gates(layer, ctx)
        layer = None  # its rows are freed before the next context's are made
    return out


def gates(layer: Layer, ctx: int) -> dict[str, Any]:
    """Stream 0's decode row alone == in a batch of 8 (bits and chosen pools), and the error
    against the torch path (kernels off) on the same device."""
    y8, sel8 = layer.call(layer.pass_(list(range(8)), ctx, 1))
    y1, sel1 = layer.call(layer.pass_([0], ctx, 1))
    same_pools = set(sel1[0].tolist()) - {-1} == set(sel8[0].tolist()) - {-1}
    on_cpu = layer.device == "cpu"
    gpu.set_triton(False)  # the torch path
    try:
        want, masks = layer.call(layer.pass_([0], ctx, 1))
    finally:
        gpu.set_triton(True, on_cpu=on_cpu)
    chosen = masks[0][0, : ctx // layer.cfg.index_kpool * layer.cfg.index_kpool]
    torch_pools = set(chosen.view(-1, layer.cfg.index_kpool).any(-1).nonzero().flatten().tolist())
    return {
        "alone_equals_batch8": bool(torch.equal(y1[0], y8[0])) and same_pools,
        "rel_err_vs_torch": rel(y1, want),
        "pools_equal_torch": torch_pools == set(sel1[0].tolist()) - {-1},
        "pools_selected": len(torch_pools),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--smoke", action="store_true", help="tiny, on the CPU, Triton interpreted")
    args = ap.parse_args()
    if args.smoke:
        gpu.set_triton(True, on_cpu=True)
    result = run("cpu" if args.smoke else "cuda", smoke=args.smoke)
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
