"""glm5_next's mHC collapse (triton_mhc.collapse_norm: the fp32 projection, the Sinkhorn, the
collapse and the block's norm) alone at GLM-5.3-Flash's width (4 streams × 4096): the time of a
call at 1, 8, 64 and 2048 rows (a CUDA graph for the small ones), row 0 alone == in the batch,
and the error against the torch reference (mhc.py) in bf16. `--module` names the kernels'
module, so an earlier version laid beside it can be timed in the same call.

    python bench/glm_mhc.py [--module tensorfold_glm.triton_mhc]     # on the GPU; prints JSON
"""

from __future__ import annotations

import argparse
import importlib
import json
import sys
import time
from pathlib import Path
from typing import Any, Callable

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tensorfold_glm import mhc as ref_mhc  # noqa: E402
from tensorfold_glm.config import GlmConfig  # noqa: E402
from tensorfold_glm.weights import HcWeights  # noqa: E402

ROWS = (1, 8, 64, 2048)


def timed(fn: Callable[[], Any], graph: bool) -> float:
    """ms a call: 20 replays of a captured graph, or 20 eager calls."""
    fn()
    torch.cuda.synchronize()
    if graph:
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            fn()
        run = g.replay
    else:
        run = fn
    run()
    torch.cuda.synchronize()
    a = time.perf_counter()
    for _ in range(20):
        run()
    torch.cuda.synchronize()
    return (time.perf_counter() - a) / 20 * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--module", default="tensorfold_glm.triton_mhc")
    args = ap.parse_args()
    kernels = importlib.import_module(args.module)
    cfg = GlmConfig.from_dict({}, "GLM-5.3-Flash")
    hc, h = cfg.hc_mult, cfg.hidden_size
    g = torch.Generator(device="cuda").manual_seed(0)
    r = lambda *s, scale=1.0: torch.randn(*s, device="cuda", generator=g) * scale  # noqa: E731
    width = (2 + hc) * hc
    w = HcWeights(
        fn=r(width, hc * h, scale=0.5 / (hc * h) ** 0.5),
        base=r(width, scale=0.5),
        scale=r(3, scale=0.2) + 1,
    )
    norm_w = (r(h, scale=0.2) + 1).to(torch.bfloat16)
    streams = r(max(ROWS), hc, h).to(torch.bfloat16)

    def call(x: torch.Tensor):
        return kernels.collapse_norm(
            x,
            w.fn,
            w.base,
            w.scale,
            norm_w,
            iters=cfg.hc_sinkhorn_iters,
            rms_eps=cfg.rms_norm_eps,
            hc_eps=cfg.hc_eps,
            norm_eps=cfg.rms_norm_eps,
        )

    out: dict[str, Any] = {"module": args.module, "gpu": torch.cuda.get_device_name()}
    for n in ROWS:
        x = streams[:n].clone()
        out[f"rows{n}_ms"] = timed(lambda: call(x), graph=n <= 64)
    post, comb, y = call(streams[:64].clone())
    alone = call(streams[:1].clone())
    out["row0_alone_equal"] = all(torch.equal(a, b[:1]) for a, b in zip(alone, (post, comb, y)))
    want_post, want_comb, want_x = ref_mhc.collapse(cfg, w, streams[:64])
    rel = lambda a, b: float((a.float() - b.float()).norm() / b.float().norm())  # noqa: E731
    out["post_rel_err"] = rel(post, want_post)
    out["comb_rel_err"] = rel(comb, want_comb)
    from tensorfold.ops.norms import rms_norm

    out["x_rel_err"] = rel(y, rms_norm(want_x, norm_w, cfg.rms_norm_eps))
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
