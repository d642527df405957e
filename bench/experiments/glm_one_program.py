"""glm5_next's one-program launches at one row (session 21's census in docs/journal/sessions.md):
the fp32 router's route (its gate row- or column-major), mHC's collapse, its expand, the expand and the
next collapse in one launch, the indexer's pooled keys and its top pools, the KDA delta rule's
decode rows (ours against fla-core's), each timed alone (a
CUDA graph of REPS calls) with its module's switches set each way. Checks in the same run: each
way's pool keys against the first way's, bit for bit, and its routes' experts; every way's row
alone == in a batch; the collapse's error against the first way's; the one-launch expand and
collapse against the two steps; the top pools one way == the other.

    python bench/experiments/glm_one_program.py                 # on the GPU; prints JSON
    python bench/experiments/glm_one_program.py --smoke         # on the CPU, tiny, Triton interpreted
    python bench/experiments/glm_one_program.py --sections collapse,expand   # some of the sections
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Callable, Iterator

if "--smoke" in sys.argv:
    os.environ.setdefault("TRITON_INTERPRET", "1")

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from bench.experiments.glm_attention import REAL, TINY, Layer  # noqa: E402
from bench.sections import captured  # noqa: E402
from tensorfold.ops import gpu, switches, triton_route  # noqa: E402
from tensorfold.ops.pass_meta import pass_meta  # noqa: E402
from tensorfold_glm import triton_indexer, triton_mhc  # noqa: E402

REPS = 20
ROUTE_WAYS = {  # (the gate's layout, triton_route's switches); "tiled": sessions 23 - 24
    "tiled_64": ("rows", dict(FP32_EXPERT_BLOCK=64)),
    # the FMA chain, its 64 chunks added by the route kernel (session 25's census: 6.5 + 14.7 us)
    "chain_64x64_route_sums": (
        "columns",
        dict(FP32_CHAIN_SPLIT=64, FP32_CHAIN_EXPERTS=64, FP32_CHAIN_SUMS=False),
    ),
    # ... by the chain's last program of each expert block instead (the route adds one)
    "chain_64x64": ("columns", dict(FP32_CHAIN_SPLIT=64, FP32_CHAIN_EXPERTS=64)),
    "chain_64x32": ("columns", dict(FP32_CHAIN_SPLIT=64, FP32_CHAIN_EXPERTS=32)),
    "chain_64x128": ("columns", dict(FP32_CHAIN_SPLIT=64, FP32_CHAIN_EXPERTS=128)),
    "chain_32x64": ("columns", dict(FP32_CHAIN_SPLIT=32, FP32_CHAIN_EXPERTS=64)),
    "chain_128x64": ("columns", dict(FP32_CHAIN_SPLIT=128, FP32_CHAIN_EXPERTS=64)),
    "chain_128x32": ("columns", dict(FP32_CHAIN_SPLIT=128, FP32_CHAIN_EXPERTS=32)),
    "chain_256x16": ("columns", dict(FP32_CHAIN_SPLIT=256, FP32_CHAIN_EXPERTS=16)),
}
TOP_POOL_WIDTHS = (64, 256, 1024, 2048)  # pools a row: top_pools in one launch against torch's
COLLAPSE_WAYS = {  # session 23's first; then the collapse's warps, the projection's pieces
    "whole_4warps": dict(WHOLE_ROW_WARPS=4),
    "whole_2warps": dict(WHOLE_ROW_WARPS=2),
    "whole_1warp": dict(WHOLE_ROW_WARPS=1),
    "pieces_128": dict(WHOLE_ROW_WARPS=4, MAX_SPLIT=128, PIECE=128),
    "pieces_32": dict(WHOLE_ROW_WARPS=4, MAX_SPLIT=32, PIECE=512),
}
EXPAND_WAYS = {
    "block_512": dict(EXPAND_BLOCK_H=512),
    "block_256": dict(EXPAND_BLOCK_H=256),
    "block_128": dict(EXPAND_BLOCK_H=128),
    "block_64": dict(EXPAND_BLOCK_H=64),
}
RECURRENT_WAYS = {  # triton_kda.recurrent's tile: V columns a program, its warps
    "v32_4warps": dict(VALUE_BLOCK=32, RECURRENT_WARPS=4),
    "v16_4warps": dict(VALUE_BLOCK=16, RECURRENT_WARPS=4),
    "v16_2warps": dict(VALUE_BLOCK=16, RECURRENT_WARPS=2),
    "v64_4warps": dict(VALUE_BLOCK=64, RECURRENT_WARPS=4),
    "v64_8warps": dict(VALUE_BLOCK=64, RECURRENT_WARPS=8),
    "v128_8warps": dict(VALUE_BLOCK=128, RECURRENT_WARPS=8),
}
POOL_KEY_WAYS = {"main": {}}  # triton_indexer: one way (session 24: early exit, one-row tile)


@contextmanager
def switched(module: Any, values: dict[str, Any]) -> Iterator[None]:
    """module's attributes set to values inside the block (a name of tensorfold.ops.switches'
    registry set there instead), restored after it."""

    def get(k: str) -> Any:
        return switches.SWITCHES[k].on() if k in switches.SWITCHES else getattr(module, k)

    def put(k: str, v: Any) -> None:
        if k in switches.SWITCHES:
            switches.set_value(k, v)
        else:
            setattr(module, k, v)

    old = {k: get(k) for k in values}
    for k, v in values.items():
        put(k, v)
    try:
        yield
    finally:
        for k, v in old.items():
            put(k, v)


def us_a_call(fn: Callable[[], Any], device: str) -> float | None:
    """µs a call: REPS calls captured in one CUDA graph, the median of 10 replays (None on the
    CPU: interpreted times say nothing)."""
    if device != "cuda":
        fn()
        return None

    def calls() -> None:
        for _ in range(REPS):
            fn()

    graph = captured(calls, warm=fn)
    graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(10):
        a = time.perf_counter()
        graph.replay()
        torch.cuda.synchronize()
        times.append((time.perf_counter() - a) / REPS * 1e6)
    return sorted(times)[len(times) // 2]


def route_outputs(
    cfg: Any, x: torch.Tensor, gate: torch.Tensor, bias: torch.Tensor
) -> dict[str, torch.Tensor]:
    """bare_route's weights and experts, and what it wrote of its alignment."""
    w, e = bare_route(cfg, x, gate, bias)
    out = {"weights": w, "experts": e}
    aligned = getattr(e, "tf_aligned", None)
    if aligned is not None:  # the written part: blocks of an expert, their pairs
        used = int((aligned.block_expert < gate.shape[0]).sum())
        out["block_expert"] = aligned.block_expert.clone()
        out["sorted_pairs"] = aligned.sorted_pairs[: used * aligned.block_m].clone()
    return out


def bare_route(cfg: Any, x: torch.Tensor, gate: torch.Tensor, bias: torch.Tensor) -> Any:
    """cfg's route of x (GLM's: fp32, grouped, aligned by expert)."""
    return triton_route.route(
        x,
        gate,
        bias,
        cfg.num_experts_per_tok,
        norm_topk_prob=True,
        scaling=cfg.routed_scaling_factor,
        fp32=True,
        norm_eps=1e-20,
        groups=cfg.n_group,
        keep_groups=cfg.topk_group,
        by_expert=True,
    )


def same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def route_section(cfg: Any, device: str) -> dict[str, Any]:
    """Each way: µs a call at 1, 8 and 64 rows; row 0 alone == in the batch; the share of rows
    whose experts are the first way's (another split sums in another order)."""
    g = torch.Generator(device=device).manual_seed(0)
    h, e = cfg.hidden_size, cfg.n_routed_experts
    x = torch.randn(64, h, device=device, generator=g).to(torch.bfloat16)
    rows_major = (torch.randn(e, h, device=device, generator=g) * h**-0.5).to(torch.bfloat16)
    rows_major = rows_major.float()
    gates = {"rows": rows_major, "columns": triton_route.columns_major(rows_major)}
    bias = torch.randn(e, device=device, generator=g) * 0.01
    out: dict[str, Any] = {}
    first: dict[int, dict[str, torch.Tensor]] = {}
    for name, (layout, values) in ROUTE_WAYS.items():
        gate = gates[layout]
        with switched(triton_route, values):
            row: dict[str, Any] = {}
            alone = route_outputs(cfg, x[:1], gate, bias)
            for n in (1, 8, 64):
                got = route_outputs(cfg, x[:n], gate, bias)
                first.setdefault(n, got)
                row[f"experts_of_first_way_{n}"] = float(
                    (got["experts"] == first[n]["experts"]).all(-1).float().mean()
                )
                row[f"row0_equals_alone_{n}"] = bool(
                    torch.equal(got["weights"][0], alone["weights"][0])
                    and torch.equal(got["experts"][0], alone["experts"][0])
                )
                row[f"us_{n}"] = us_a_call(lambda n=n: bare_route(cfg, x[:n], gate, bias), device)
            out[name] = row
    return out


def top_pools_section(cfg: Any, device: str) -> dict[str, Any]:
    """top_pools of one row (and 8) over W pools: in one launch (ONE_LAUNCH_MAX_POOLS) against
    torch's top k then the sort's launch; the same pools both ways."""
    g = torch.Generator(device=device).manual_seed(2)
    out: dict[str, Any] = {}
    for width in TOP_POOL_WIDTHS if device == "cuda" else (40,):
        keys = torch.randint(-(2**62), 2**62, (8, width), device=device, generator=g)
        keys = keys // 2**32 * 2**32 + (triton_indexer.LOW - torch.arange(width, device=device))
        keys[:, width - width // 4 :] = triton_indexer.NO_POOL  # the last quarter not yet complete
        row: dict[str, Any] = {}
        got = {}
        for way, most in (("one_launch", 1 << 30), ("torch_topk", 0)):
            with switched(triton_indexer, {"ONE_LAUNCH_MAX_POOLS": most}):
                got[way] = triton_indexer.top_pools(keys, cfg.select_pools)
                for n in (1, 8):
                    row[f"{way}_us_{n}"] = us_a_call(
                        lambda n=n: triton_indexer.top_pools(keys[:n], cfg.select_pools), device
                    )
        row["same_pools"] = bool(torch.equal(got["one_launch"], got["torch_topk"]))
        out[f"pools_{width}"] = row
    return out


def mhc_settings(cfg: Any) -> dict[str, Any]:
    """cfg's keywords for triton_mhc's collapse: Sinkhorn's iterations and the epsilons."""
    return dict(
        iters=cfg.hc_sinkhorn_iters,
        rms_eps=cfg.rms_norm_eps,
        hc_eps=cfg.hc_eps,
        norm_eps=cfg.rms_norm_eps,
    )


def collapse_weights(cfg: Any, device: str, g: torch.Generator) -> tuple[torch.Tensor, ...]:
    """A collapse's fn, base, scale and norm weight at cfg's width, drawn from g: its logits
    O(1) as the dummy checkpoint's."""
    hc, h = cfg.hc_mult, cfg.hidden_size
    width = (2 + hc) * hc
    fn = torch.randn(width, hc * h, device=device, generator=g) * 0.5 / (hc * h) ** 0.5
    base = torch.randn(width, device=device, generator=g) * 0.5
    scale = torch.rand(3, device=device, generator=g) + 0.5
    norm_w = (1 + 0.1 * torch.randn(h, device=device, generator=g)).to(torch.bfloat16)
    return fn, base, scale, norm_w


def collapse_section(cfg: Any, device: str) -> dict[str, Any]:
    g = torch.Generator(device=device).manual_seed(1)
    hc, h = cfg.hc_mult, cfg.hidden_size
    rows = (1, 8, 64, 2048) if device == "cuda" else (1, 3, 8)
    streams = torch.randn(max(rows), hc, h, device=device, generator=g).to(torch.bfloat16)
    fn, base, scale, norm_w = collapse_weights(cfg, device, g)

    def call(n: int) -> tuple[torch.Tensor, ...]:
        return triton_mhc.collapse_norm(
            streams[:n],
            fn,
            base,
            scale,
            norm_w,
            **mhc_settings(cfg),
        )

    out: dict[str, Any] = {}
    first = None
    for name, values in COLLAPSE_WAYS.items():
        with switched(triton_mhc, values):
            alone, batch = call(1), call(max(rows))
            first = first or batch
            row: dict[str, Any] = {
                "row0_equals_alone": all(torch.equal(a[0], b[0]) for a, b in zip(alone, batch)),
                "max_abs_diff_vs_first_way": [
                    float((a.float() - b.float()).abs().max()) for a, b in zip(batch, first)
                ],
            }
            for n in rows:
                row[f"us_{n}"] = us_a_call(lambda n=n: call(n), device)
            out[name] = row
    return out


def expand_section(cfg: Any, device: str) -> dict[str, Any]:
    """mHC's expand each way: µs a call; the same bits as the first way (each column is its
    own)."""
    g = torch.Generator(device=device).manual_seed(3)
    hc, h = cfg.hc_mult, cfg.hidden_size
    rows = (1, 8, 64) if device == "cuda" else (1, 3)
    n = max(rows)
    res = torch.randn(n, hc, h, device=device, generator=g).to(torch.bfloat16)
    y = torch.randn(n, h, device=device, generator=g).to(torch.bfloat16)
    post = torch.rand(n, hc, device=device, generator=g) * 2
    comb = torch.rand(n, hc, hc, device=device, generator=g)
    out: dict[str, Any] = {}
    first = None
    for name, values in EXPAND_WAYS.items():
        with switched(triton_mhc, values):
            got = triton_mhc.expand(post, comb, y, res)
            first = got if first is None else first
            row: dict[str, Any] = {"equals_first_way": bool(torch.equal(got, first))}
            for m in rows:
                row[f"us_{m}"] = us_a_call(
                    lambda m=m: triton_mhc.expand(post[:m], comb[:m], y[:m], res[:m]), device
                )
            out[name] = row
    return out


def expand_collapse_section(cfg: Any, device: str) -> dict[str, Any]:
    """A sublayer's expand and the next collapse: the two steps (three launches) against one
    launch (FUSED_EXPAND_COLLAPSE) at 1 to 8 rows, µs a call; the one launch's bits == the two
    steps' over 64 rows."""
    g = torch.Generator(device=device).manual_seed(5)
    hc, h = cfg.hc_mult, cfg.hidden_size
    rows = (1, 2, 4, 8) if device == "cuda" else (1, 3)
    n = 64 if device == "cuda" else 8
    res = torch.randn(n, hc, h, device=device, generator=g).to(torch.bfloat16)
    y = torch.randn(n, h, device=device, generator=g).to(torch.bfloat16)
    post = torch.rand(n, hc, device=device, generator=g) * 2
    comb = torch.softmax(torch.randn(n, hc, hc, device=device, generator=g), -1)
    fn, base, scale, norm_w = collapse_weights(cfg, device, g)

    def call(m: int) -> tuple[torch.Tensor, ...]:
        return triton_mhc.expand_collapse_norm(
            post[:m],
            comb[:m],
            y[:m],
            res[:m],
            fn,
            base,
            scale,
            norm_w,
            **mhc_settings(cfg),
        )

    two_steps = call(n)
    out: dict[str, Any] = {}
    for name, on in (("two_steps", False), ("one_launch", True)):
        with switched(triton_mhc, dict(FUSED_EXPAND_COLLAPSE=on)):
            row: dict[str, Any] = {
                "rows_equal_the_two_steps_of_all": all(
                    torch.equal(a, b[:m]) for m in rows for a, b in zip(call(m), two_steps)
                )
            }
            for m in rows:
                row[f"us_{m}"] = us_a_call(lambda m=m: call(m), device)
            out[name] = row
    return out


def recurrent_section(cfg: Any, device: str) -> dict[str, Any]:
    """The KDA delta rule's decode rows: triton_kda.recurrent's ways at 1, 8 and 64 rows (each
    its stream's slot), µs a call, against fla-core's fused_recurrent_kda on the GPU (what it
    replaced, with the sigmoid of beta and the zeroing of fresh slots it needed, not timed here);
    each way's row alone == in 64; its bits against the first way's; its error against fla's."""
    from tensorfold_glm import triton_kda

    g = torch.Generator(device=device).manual_seed(9)
    heads, dk = cfg.linear_num_heads, cfg.linear_head_dim
    n = 64 if device == "cuda" else 4
    rows = (1, 8, 64) if device == "cuda" else (1, 4)
    q, k, v, pre = (
        torch.randn(n, heads * dk, device=device, generator=g).to(torch.bfloat16) for _ in range(4)
    )
    b = torch.randn(n, heads, device=device, generator=g).to(torch.bfloat16)
    a_log = torch.rand(heads, device=device, generator=g) * 2.7
    dt_bias = torch.randn(heads * dk, device=device, generator=g) * 0.5
    start = torch.randn(n, heads, dk, dk, device=device, generator=g) * 0.1
    ids = torch.arange(n, dtype=torch.int32, device=device)
    pos = ids + 100
    states, out = start.clone(), torch.zeros(n, heads, dk, dtype=torch.bfloat16, device=device)

    def call(m: int, first: int = 0) -> None:
        triton_kda.recurrent(
            q,
            k,
            v,
            pre,
            b,
            a_log,
            dt_bias,
            cfg.linear_lower_bound,
            states,
            ids[first : first + m],
            torch.ones_like(ids[:m]),
            pos[first : first + m],
            ids[first : first + m],
            out,
        )

    def fresh_run(m: int, first: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        states.copy_(start)
        out.zero_()
        call(m, first)
        return out.clone(), states.clone()

    res: dict[str, Any] = {}
    fla_out = None
    if device == "cuda":
        from fla.ops.kda.fused_recurrent import fused_recurrent_kda_fwd

        beta = torch.sigmoid(b.float()).to(torch.bfloat16)
        fla_states = start.clone()
        o = torch.empty(n, 1, heads, dk, dtype=torch.bfloat16, device=device)

        def fla(m: int) -> None:
            fused_recurrent_kda_fwd(
                q=q[:m].view(m, 1, heads, dk),
                k=k[:m].view(m, 1, heads, dk),
                v=v[:m].view(m, 1, heads, dk),
                g=pre[:m].view(m, 1, heads, dk),
                beta=beta[:m].view(m, 1, heads),
                initial_state=fla_states,
                inplace_final_state=True,
                ssm_state_indices=ids[:m],
                out=o[:m],
                A_log=a_log,
                dt_bias=dt_bias,
                scale=dk**-0.5,
                use_qk_l2norm_in_kernel=True,
                use_gate_in_kernel=True,
                lower_bound=cfg.linear_lower_bound,
            )

        fla(n)
        fla_out = o.view(n, heads, dk).float()
        res["fla"] = {f"us_{m}": us_a_call(lambda m=m: fla(m), device) for m in rows}
    first_way = None
    for name, values in RECURRENT_WAYS.items():
        with switched(triton_kda, values):
            many = fresh_run(n)
            first_way = first_way or many
            row: dict[str, Any] = {
                "row_alone_equals_batch": all(
                    torch.equal(fresh_run(1, r)[0][r], many[0][r]) for r in (0, n - 1)
                ),
                "equals_first_way": bool(
                    torch.equal(many[0], first_way[0]) and torch.equal(many[1], first_way[1])
                ),
            }
            if fla_out is not None:
                row["rel_err_vs_fla"] = float((many[0].float() - fla_out).norm() / fla_out.norm())
            for m in rows:
                row[f"us_{m}"] = us_a_call(lambda m=m: call(m), device)
            res[name] = row
    return res


def pool_key_section(cfg: Any, device: str) -> dict[str, Any]:
    page_rows = 512 if device == "cuda" else 16
    ctx = 4 * page_rows
    kp = cfg.index_kpool
    layer = Layer(cfg, device, 1, ctx // page_rows + 1, page_rows)
    rows = layer.rows
    cases = {
        "pool_end": layer.pass_([0], 3 * kp - 1, 1),
        "mid_pool": layer.pass_([0], 3 * kp, 1),
        "prompt": layer.pass_([0], 0, ctx),
    }

    def call(fp: Any) -> None:
        layer.write_pool_keys(fp, pass_meta(fp))

    keys = rows.buffers["L0.pool_key"]
    out: dict[str, Any] = {}
    first: dict[str, torch.Tensor] = {}
    for name, values in POOL_KEY_WAYS.items():
        with switched(triton_indexer, values):
            row: dict[str, Any] = {}
            for case, fp in cases.items():
                keys.fill_(float("nan"))
                call(fp)
                got = keys.clone()
                first.setdefault(case, got)
                row[f"equals_first_way_{case}"] = bool(
                    torch.equal(got.nan_to_num(7.0), first[case].nan_to_num(7.0))
                )
                row[f"us_{case}"] = us_a_call(lambda fp=fp: call(fp), device)
            out[name] = row
    return out


SECTIONS = {
    "route": route_section,
    "collapse": collapse_section,
    "expand": expand_section,
    "expand_collapse": expand_collapse_section,
    "pool_keys": pool_key_section,
    "top_pools": top_pools_section,
    "recurrent": recurrent_section,
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--smoke", action="store_true", help="tiny, on the CPU, Triton interpreted")
    ap.add_argument(
        "--sections",
        default=",".join(SECTIONS),
        help=f"comma-separated, of {', '.join(SECTIONS)} (default: all)",
    )
    args = ap.parse_args()
    names = [n for n in args.sections.split(",") if n]
    unknown = [n for n in names if n not in SECTIONS]
    if unknown:
        ap.error(f"unknown sections {unknown}; known: {', '.join(SECTIONS)}")
    device = "cpu" if args.smoke else "cuda"
    if args.smoke:
        gpu.set_triton(True, on_cpu=True)
    cfg = TINY if args.smoke else REAL
    result: dict[str, Any] = {"shape": "tiny" if args.smoke else "GLM-5.3-Flash"}
    if device == "cuda":
        result["gpu"] = torch.cuda.get_device_name()
    for name in names:  # each section on stderr when done: a run stopped by its limit keeps them
        result[name] = SECTIONS[name](cfg, device)
        print(f"[{name}] {json.dumps(result[name])}", file=sys.stderr, flush=True)
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
