"""What a one-stream decode round's launch structure costs on this GPU with perfect kernels.

Each product of the round (a linear, the dense FFN's or the experts' gate/up and down, lm_head)
becomes a kernel that does nothing but stream that product's weight bytes from HBM, on the tile
and grid that read a buffer of that size fastest; each other launch of the round (norms, the
route, attention, conv, rope, copies: their count from the census, `--launches`) becomes an empty
kernel; all of them in one CUDA graph under dependent launch, as the engine replays a round.
The chain's time is a floor for any round made of that many launches of those sizes: what the
kernels' arithmetic, their tails and the small launches' own work add comes on top. Beside it:
every byte read by one launch (the limit at the copy rate), and the bare read rate by size.
`--persistent` adds the round as one persistent kernel (_phases_kernel): a phase a product (and
one a small launch, reading nothing), a grid-wide barrier after each, as a kernel whose every
product waits on the one before; with and without each phase asking L2, as it starts, for the
next product's first bytes (weights do not wait on activations), and the barriers alone.

    python3 bench/experiments/read_chain.py --launches lfm2=194,gemma4=476 [--persistent] [--out DIR]

The sizes come from the shapes' configs (`lfm2_plan`, `gemma4_plan`); tests/test_bench_read_chain.py
checks them against the weights of models built from those configs.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from tensorfold.ops.triton_util import after_prior, prefetch_l2  # noqa: E402

MB = 1 << 20


@dataclass
class Plan:
    """A one-stream round's products (name, weight bytes), in launch order. The other launches
    read norm weights, routers and conv taps: under 1% of the bytes, left out."""

    shape: str
    products: list[tuple[str, int]] = field(default_factory=list)

    @property
    def product_bytes(self) -> int:
        return sum(b for _, b in self.products)


def lfm2_plan(shape: str, cfg: Any, el: int = 2) -> Plan:
    h, p = cfg.hidden_size, Plan(shape)
    for i, kind in enumerate(cfg.layer_types):
        if kind == "full_attention":
            q, kv = cfg.num_attention_heads * cfg.head_dim, cfg.num_key_value_heads * cfg.head_dim
            p.products += [("qkv", (q + 2 * kv) * h * el), ("o_proj", h * q * el)]
        else:
            p.products += [("in_proj", 3 * h * h * el), ("out_proj", h * h * el)]
        if cfg.is_dense(i):
            n = cfg.intermediate_size
            p.products += [("dense_gate_up", 2 * n * h * el), ("dense_down", h * n * el)]
        else:
            n, k = cfg.moe_intermediate_size, cfg.num_experts_per_tok
            p.products += [
                ("experts_gate_up", k * 2 * n * h * el),
                ("experts_down", k * h * n * el),
            ]
    p.products.append(("lm_head", cfg.vocab_size * h * el))
    return p


def gemma4_plan(shape: str, cfg: Any, el: int = 2) -> Plan:
    h, p = cfg.hidden_size, Plan(shape)
    for layer in cfg.layers:
        d, own = layer.head_dim, not layer.reuses_kv
        q = cfg.num_attention_heads * d
        kv = layer.kv_heads * d if own else 0
        v = kv if own and not layer.k_eq_v else 0
        p.products += [
            ("qkv", (q + kv + v) * h * el),
            ("o_proj", h * q * el),
            ("dense_gate_up", 2 * layer.mlp_size * h * el),
            ("dense_down", h * layer.mlp_size * el),
        ]
        if cfg.enable_moe_block:
            n, k = cfg.moe_intermediate_size, cfg.top_k_experts
            p.products += [
                ("experts_gate_up", k * 2 * n * h * el),
                ("experts_down", k * h * n * el),
            ]
    p.products.append(("lm_head", cfg.vocab_size * h * el))
    return p


def plans() -> dict[str, Plan]:
    from tensorfold_gemma4.dummy import SHAPES as GEMMA4
    from tensorfold_lfm2_moe.dummy import SHAPES as LFM2

    out = {name: lfm2_plan(name, cfg) for name, cfg in LFM2.items()}
    out["Gemma-4-26B-A4B"] = gemma4_plan("Gemma-4-26B-A4B", GEMMA4["Gemma-4-26B-A4B"])
    return out


def interleave(products: int, small: int) -> list[int]:
    """Launch order of a chain: product indices (>= 0) with `small` empty launches (-1) spread
    evenly between them, as a round interleaves its small launches with its products."""
    order: list[int] = []
    for i in range(products):
        order += [-1] * ((i + 1) * small // products - i * small // products)
        order.append(i)
    return order


@dataclass
class Phases:
    """A persistent kernel's phases, in elements of one buffer holding every product (each at
    a 128-element boundary): phase i reads length[i] at offset[i]; it prefetches the next
    phase that reads anything (pf_offset, pf_length; 0 after the last)."""

    offset: list[int]
    length: list[int]
    pf_offset: list[int]
    pf_length: list[int]
    elements: int


def phases_of(plan: Plan, small: int, el: int = 2) -> Phases:
    """The round's products as phases, `small` empty phases spread between them (interleave)."""
    starts, at = [], 0
    for _, b in plan.products:
        starts.append(at)
        at += -(-(b // el) // 128) * 128
    off, length = [], []
    for i in interleave(len(plan.products), small):
        off.append(starts[i] if i >= 0 else 0)
        length.append(plan.products[i][1] // el if i >= 0 else 0)
    pf_off, pf_len = [0] * len(off), [0] * len(off)
    nxt = (0, 0)
    for i in range(len(off) - 1, -1, -1):
        pf_off[i], pf_len[i] = nxt
        if length[i]:
            nxt = (off[i], length[i])
    return Phases(off, length, pf_off, pf_len, at)


# --- the GPU side ----------------------------------------------------------------------------


@triton.jit
def _read_kernel(x_ptr, out_ptr, n, BLOCK: tl.constexpr, PDL: tl.constexpr):
    # a grid-stride walk over n bf16 values, summed so the loads stay live
    after_prior(PDL)
    pid, g = tl.program_id(0), tl.num_programs(0)
    acc = tl.zeros([BLOCK], tl.float32)
    for start in range(pid * BLOCK, n, g * BLOCK):
        offs = start + tl.arange(0, BLOCK)
        acc += tl.load(x_ptr + offs, mask=offs < n, other=0.0).to(tl.float32)
    tl.store(out_ptr + pid, tl.sum(acc, axis=0))


@triton.jit
def _empty_kernel(out_ptr, PDL: tl.constexpr):
    after_prior(PDL)
    tl.store(out_ptr + tl.program_id(0), 0.0)


@triton.jit
def _phases_kernel(
    x_ptr,
    off_ptr,
    len_ptr,
    pf_off_ptr,
    pf_len_ptr,
    cnt_ptr,
    out_ptr,
    spin_ptr,
    phases,
    BLOCK: tl.constexpr,
    MAX_SPIN: tl.constexpr,
    PREFETCH: tl.constexpr,
    PF_LANES: tl.constexpr,
    PF_BYTES: tl.constexpr = 0,
):
    # One persistent grid: phase i reads len[i] bf16 values at off[i] (0 for a small launch's
    # place), stores its sums, then a grid-wide barrier (every program counts in and waits for
    # cnt to reach (i + 1) * programs), as a kernel whose phase i + 1 needs phase i's output.
    # PREFETCH: as a phase starts, each program asks L2 for its share of the first PF_BYTES
    # (0: all) of the phase whose bytes come next (pf_*: weights do not wait on activations),
    # PF_LANES spans of a program, one bulk prefetch each.
    pid, g = tl.program_id(0), tl.num_programs(0)
    spins = 0
    for i in range(phases):
        off, n = tl.load(off_ptr + i), tl.load(len_ptr + i)
        if PREFETCH:
            pf_off, pf_n = tl.load(pf_off_ptr + i), tl.load(pf_len_ptr + i)
            total = pf_n * 2
            if PF_BYTES > 0:
                total = tl.minimum(total, PF_BYTES)
            span = tl.cdiv(total, g * PF_LANES * 16) * 16
            at = (pid * PF_LANES + tl.arange(0, PF_LANES)).to(tl.int64) * span
            left = tl.maximum(tl.minimum(total - at, span), 0)
            prefetch_l2(x_ptr + pf_off + at // 2, (left // 16 * 16).to(tl.int32), True)
        acc = tl.zeros([BLOCK], tl.float32)
        for start in range(pid * BLOCK, n, g * BLOCK):
            offs = start + tl.arange(0, BLOCK)
            acc += tl.load(x_ptr + off + offs, mask=offs < n, other=0.0).to(tl.float32)
        tl.store(out_ptr + i * g + pid, tl.sum(acc, axis=0))
        tl.debug_barrier()  # the whole program's reads summed before it counts in
        tl.atomic_add(cnt_ptr, 1, sem="release", scope="gpu")
        target = (i + 1) * g
        seen = tl.atomic_add(cnt_ptr, 0, sem="acquire", scope="gpu")
        while (seen < target) & (spins < MAX_SPIN):
            seen = tl.atomic_add(cnt_ptr, 0, sem="acquire", scope="gpu")
            spins += 1
    tl.store(spin_ptr + pid, spins)


@dataclass(frozen=True)
class ReadTile:
    block: int
    warps: int
    per_sm: int  # programs an SM, capped by the buffer's blocks


TILES = [ReadTile(b, w, s) for b in (2048, 4096, 8192) for w in (4, 8) for s in (2, 4, 8)]


class Chains:
    def __init__(self, pdl: bool = True):
        import torch

        self.torch = torch
        self.read, self.empty = _read_kernel, _empty_kernel
        self.sms = torch.cuda.get_device_properties(0).multi_processor_count
        self.scratch = torch.zeros(self.sms * 64, device="cuda", dtype=torch.float32)
        self.pdl = pdl

    def _opts(self) -> dict[str, Any]:
        return {"PDL": True, "launch_pdl": True} if self.pdl else {"PDL": False}

    def launch(self, buf, tile: ReadTile) -> None:
        n = buf.numel()
        grid = max(1, min(self.sms * tile.per_sm, -(-n // tile.block)))
        self.read[(grid,)](
            buf, self.scratch, n, BLOCK=tile.block, num_warps=tile.warps, **self._opts()
        )

    def launch_empty(self) -> None:
        self.empty[(1,)](self.scratch, num_warps=1, **self._opts())

    def time_us(self, step, reps: int = 20) -> float:
        """Median µs of one replay of a CUDA graph of step()."""
        torch = self.torch
        for _ in range(2):
            step()
        torch.cuda.synchronize()
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            step()
        g.replay()
        torch.cuda.synchronize()
        times = []
        for _ in range(reps):
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            g.replay()
            b.record()
            b.synchronize()
            times.append(a.elapsed_time(b) * 1e3)
        del g
        times.sort()
        return times[len(times) // 2]

    def buffers(self, sizes: list[int]):
        torch = self.torch
        return [torch.randn(max(1, s // 2), device="cuda", dtype=torch.bfloat16) for s in sizes]

    def best_tile(self, nbytes: int, copies: int) -> tuple[ReadTile, float]:
        """The tile that reads `copies` distinct buffers of nbytes back to back fastest, and
        its µs a buffer (copies large enough that the set does not fit in L2)."""
        bufs = self.buffers([nbytes] * copies)
        best: tuple[ReadTile, float] | None = None
        for tile in TILES:
            us = self.time_us(lambda: [self.launch(b, tile) for b in bufs]) / copies
            if best is None or us < best[1]:
                best = (tile, us)
        assert best is not None  # TILES is not empty
        return best

    def empty_us(self, count: int = 256) -> float:
        return self.time_us(lambda: [self.launch_empty() for _ in range(count)]) / count


def _copies(nbytes: int) -> int:
    """Buffers a timing walks: 256 MB or more in all (an H200's L2 holds 50 MB), 4 at least."""
    return max(4, min(2048, -(-256 * MB // max(nbytes, 1))))


def by_size(ch: Chains, sizes_mb: list[float]) -> list[dict[str, Any]]:
    rows = []
    for mb in sizes_mb:
        nbytes = int(mb * MB)
        tile, us = ch.best_tile(nbytes, _copies(nbytes))
        rows.append(
            {
                "mb": mb,
                "us": round(us, 2),
                "tb_per_s": round(nbytes / us / 1e6, 3),
                "tile": vars(tile),
            }
        )
    return rows


def round_chain(ch: Chains, plan: Plan, launches: int | None, tiles: dict[int, ReadTile]) -> dict:
    sizes = [b for _, b in plan.products]
    for s in set(sizes):
        if s not in tiles:
            tiles[s] = ch.best_tile(s, _copies(s))[0]
    res: dict[str, Any] = {"products": len(sizes), "product_bytes": plan.product_bytes}
    res.update(_chain_us(ch, sizes, launches, tiles))
    res["one_launch_us"] = _one_launch_us(ch, plan.product_bytes)
    for k in ("products_us", "chain_us", "one_launch_us"):
        if k in res:
            res[k.replace("_us", "_tok_s")] = round(1e6 / res[k], 1)
    res["one_launch_tb_per_s"] = round(plan.product_bytes / res["one_launch_us"] / 1e6, 3)
    return res


def _chain_us(
    ch: Chains, sizes: list[int], launches: int | None, tiles: dict[int, ReadTile]
) -> dict[str, Any]:
    """µs of the products back to back and, given the round's launch count, of the whole chain
    with the empty launches between them; the buffers live until this returns."""
    bufs = ch.buffers(sizes)
    res: dict[str, Any] = {}

    def products():
        for b, s in zip(bufs, sizes):
            ch.launch(b, tiles[s])

    res["products_us"] = round(ch.time_us(products), 1)
    if launches is not None:
        small = launches - len(sizes)
        order = interleave(len(sizes), small)

        def whole():
            for i in order:
                if i < 0:
                    ch.launch_empty()
                else:
                    ch.launch(bufs[i], tiles[sizes[i]])

        res["launches"], res["empty_launches"] = launches, small
        res["chain_us"] = round(ch.time_us(whole), 1)
    return res


def _one_launch_us(ch: Chains, nbytes: int) -> float:
    """µs of one launch reading all nbytes (the limit at the copy rate)."""
    one = ch.buffers([nbytes])[0]
    tile = ch.best_tile(min(nbytes, 512 * MB), 2)[0]
    return round(ch.time_us(lambda: ch.launch(one, tile), reps=10), 1)


PHASE_TILES = [
    ReadTile(4096, 8, 2),
    ReadTile(4096, 4, 4),
    ReadTile(2048, 8, 4),
    ReadTile(2048, 4, 8),
    ReadTile(1024, 4, 8),
]
PF_MB = (4, 16, 0)  # next-phase prefetch budgets (0: the whole next product)
MAX_SPIN = 1 << 18  # polls of a barrier, all phases together: ~0.1 s, far past any phase


def persistent(ch: Chains, plan: Plan, small: int) -> dict[str, Any]:
    """The round as one persistent kernel (_phases_kernel) on each of PHASE_TILES, with and
    without the next phase's prefetch: the best µs of each, and the grid-wide barrier's own
    cost (as many phases reading nothing). Programs a tile are capped by what an SM holds at
    once (registers, warps): a barrier needs every program resident."""
    torch = ch.torch
    ph = phases_of(plan, small)
    dev = dict(device="cuda", dtype=torch.int64)
    off, ln = torch.tensor(ph.offset, **dev), torch.tensor(ph.length, **dev)
    pf_off, pf_len = torch.tensor(ph.pf_offset, **dev), torch.tensor(ph.pf_length, **dev)
    zero = torch.zeros_like(ln)
    buf = torch.randn(ph.elements, device="cuda", dtype=torch.bfloat16)
    cnt = torch.zeros(1, device="cuda", dtype=torch.int32)
    one = torch.zeros(1, device="cuda", dtype=torch.int32)
    res: dict[str, Any] = {"phases": len(ph.offset), "rows": []}
    for tile in PHASE_TILES:
        regs = max(
            _phases_kernel[(1,)](
                buf,
                off,
                zero,
                pf_off,
                zero,
                cnt,
                ch.scratch,
                one,
                len(ph.offset),
                BLOCK=tile.block,
                MAX_SPIN=MAX_SPIN,
                PREFETCH=pf,
                PF_LANES=128,
                PF_BYTES=MB if pf else 0,
                num_warps=tile.warps,
            ).n_regs
            for pf in (False, True)
        )
        fits = min(64 // tile.warps, 65536 // (-(-regs * 32 // 256) * 256 * tile.warps), 32)
        grid = ch.sms * max(1, min(tile.per_sm, fits))
        out = torch.zeros(len(ph.offset) * grid, device="cuda", dtype=torch.float32)
        spins = torch.zeros(grid, device="cuda", dtype=torch.int32)
        for name, lengths, pf in (
            ("barriers", zero, None),
            ("reads", ln, None),
            *((f"reads_prefetched_{mb}mb", ln, mb) for mb in PF_MB),
        ):

            def step():
                cnt.zero_()
                _phases_kernel[(grid,)](
                    buf,
                    off,
                    lengths,
                    pf_off,
                    pf_len,
                    cnt,
                    out,
                    spins,
                    len(ph.offset),
                    BLOCK=tile.block,
                    MAX_SPIN=MAX_SPIN,
                    PREFETCH=pf is not None,
                    PF_LANES=128,
                    PF_BYTES=(pf or 0) * MB,
                    num_warps=tile.warps,
                )

            us = ch.time_us(step, reps=10)
            res["rows"].append(
                {
                    "tile": vars(tile),
                    "grid": grid,
                    "regs": regs,
                    "what": name,
                    "us": round(us, 1),
                    "barrier_timeouts": int((spins >= MAX_SPIN).sum().item()),
                }
            )
    for name in ("reads", *(f"reads_prefetched_{mb}mb" for mb in PF_MB), "barriers"):
        ok = [r for r in res["rows"] if r["what"] == name and not r["barrier_timeouts"]]
        if ok:
            best = min(ok, key=lambda r: r["us"])
            res[f"{name}_us"] = best["us"]
            if name != "barriers":
                res[f"{name}_tok_s"] = round(1e6 / best["us"], 1)
    if "barriers_us" in res:
        res["barrier_us_each"] = round(res["barriers_us"] / len(ph.offset), 2)
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=os.environ.get("OUT") or "bench_out")
    ap.add_argument(
        "--launches",
        default="",
        help="shape=kernels of its one-stream round (the census), comma-separated; "
        "lfm2 and gemma4 name LFM2-8B-A1B and Gemma-4-26B-A4B",
    )
    ap.add_argument("--shapes", default="LFM2-8B-A1B,LFM2-24B-A2B,Gemma-4-26B-A4B")
    ap.add_argument(
        "--persistent",
        action="store_true",
        help="also the round as one persistent kernel, a grid-wide barrier a phase",
    )
    args = ap.parse_args()
    alias = {"lfm2": "LFM2-8B-A1B", "lfm2_24b": "LFM2-24B-A2B", "gemma4": "Gemma-4-26B-A4B"}
    launches = {}
    for item in filter(None, args.launches.split(",")):
        name, _, n = item.partition("=")
        launches[alias.get(name, name)] = int(n)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    import torch

    res: dict[str, Any] = {"gpu": torch.cuda.get_device_name(0)}
    ch = Chains(pdl=True)
    res["empty_launch_us"] = {"pdl": round(ch.empty_us(), 2)}
    res["empty_launch_us"]["no_pdl"] = round(Chains(pdl=False).empty_us(), 2)
    res["by_size"] = by_size(ch, [0.125, 0.5, 1, 2, 4, 8, 16, 32, 64, 128, 256, 1024])
    print(json.dumps(res, indent=1), flush=True)
    tiles: dict[int, ReadTile] = {}
    every = plans()
    for shape in filter(None, args.shapes.split(",")):
        res[shape] = round_chain(ch, every[shape], launches.get(shape), tiles)
        print(shape, json.dumps(res[shape]), flush=True)
        torch.cuda.empty_cache()
        if args.persistent:
            plan, n = every[shape], launches.get(shape)
            small = 0 if n is None else n - len(plan.products)
            res[shape]["persistent"] = {"products": persistent(ch, plan, 0)}
            if small:
                res[shape]["persistent"]["with_small_phases"] = persistent(ch, plan, small)
            print(shape, "persistent", json.dumps(res[shape]["persistent"]), flush=True)
            torch.cuda.empty_cache()
    (out / "read_chain.json").write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
