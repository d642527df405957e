"""Compile the GEMV kernels for sm_90 with PDL and weight prefetch on, without a GPU, and check
that their PTX issues the L2 prefetches (triton_util.prefetch_l2) before griddepcontrol.wait.

    python3 bench/prefetch_ptx.py [--dump DIR]

Not a test: it needs ptxas (Triton's bundled one serves) and a few seconds a kernel; where
Triton's nvdisasm is there, the SASS order is checked too. Exit status 1 when a kernel's PTX lacks the prefetch or has it after the wait.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
from pathlib import Path

import triton
from triton.backends.compiler import GPUTarget

from tensorfold.ops.triton_linear import _linear_kernel
from tensorfold.ops.triton_moe import _down_kernel, _swiglu_kernel

PREFETCH = "cp.async.bulk.prefetch.L2.global"
WAIT = "griddepcontrol.wait"


def signature(fn, types: dict[str, str], constexprs: dict[str, object]) -> dict[str, str]:
    return {a: "constexpr" if a in constexprs else types.get(a, "i32") for a in fn.arg_names}


BF16 = {
    "x_ptr",
    "w_ptr",
    "b_ptr",
    "o_ptr",
    "w1_ptr",
    "w3_ptr",
    "g_ptr",
    "w2_ptr",
    "rw_ptr",
    "out_ptr",
}
PTRS = {a: "*bf16" for a in BF16} | {
    "ex_ptr": "*i64",
    "sorted_ptr": "*i32",
    "block_ptr": "*i32",
    "limit": "fp32",
}
EXPERTS = {
    "IEEE": False,
    "INTERP": False,
    "BM": 16,
    "BN": 32,
    "BK": 64,
    "PDL": True,
    "PREFETCH_K": 512,
}
TINY = {"num_warps": 2, "num_stages": 5}  # triton_moe.TINY_*_TILES
CASES = {  # name: (kernel, argument types but i32, constexprs, options)
    # a decode GEMV of 2048x2048 bf16 weights, K split across programs
    "linear_split": (
        _linear_kernel,
        PTRS | {"ws_ptr": "*fp32", "cnt_ptr": "*i32"},
        {
            "HAS_BIAS": False,
            "IEEE": False,
            "INTERP": False,
            "SPLITS": 4,
            "SPLIT_GRID": True,
            "BLOCK_M": 16,
            "BLOCK_N": 64,
            "BLOCK_K": 128,
            "PDL": True,
            "PREFETCH_K": 512,
        },
        {"num_warps": 4, "num_stages": 3},
    ),
    # the lm_head's shape class: one chunk, a line (64 elements) a row
    "linear_whole": (
        _linear_kernel,
        PTRS | {"ws_ptr": "*bf16", "cnt_ptr": "*bf16"},
        {
            "HAS_BIAS": False,
            "IEEE": False,
            "INTERP": False,
            "SPLITS": 1,
            "SPLIT_GRID": False,
            "BLOCK_M": 16,
            "BLOCK_N": 128,
            "BLOCK_K": 64,
            "PDL": True,
            "PREFETCH_K": 64,
        },
        {"num_warps": 4, "num_stages": 4},
    ),
    "swiglu": (_swiglu_kernel, PTRS, {"TOPK": 4, "ACT": 0} | EXPERTS, TINY),
    "down": (_down_kernel, PTRS, {"HAS_WEIGHT": True} | EXPERTS, TINY),
}


def check(name: str, dump: Path | None) -> bool:
    fn, types, constexprs, options = CASES[name]
    src = triton.compiler.ASTSource(
        fn=fn, signature=signature(fn, types, constexprs), constexprs=constexprs
    )
    target = GPUTarget("cuda", 90, 32)
    asm = triton.compile(src, target=target, options={**options, "launch_pdl": True}).asm
    ptx = asm["ptx"]
    if dump:
        dump.mkdir(parents=True, exist_ok=True)
        (dump / f"{name}.ptx").write_text(ptx)
    lines = ptx.splitlines()
    pre = [i for i, s in enumerate(lines) if PREFETCH in s]
    wait = [i for i, s in enumerate(lines) if WAIT in s]
    ok = bool(pre) and bool(wait) and max(pre) < min(wait)
    print(
        f"{name}: compiled to cubin; {len(pre)} prefetch instruction(s) at PTX lines "
        f"{pre[:4]}{'...' if len(pre) > 4 else ''}, {WAIT} at {wait}: "
        f"{'prefetch before the wait' if ok else 'FAIL'}"
    )
    if ok:
        print("    " + lines[pre[0]].strip())
    sass = disassemble(asm["cubin"])
    if sass:  # ptxas keeps the order: UBLKPF (the bulk prefetch) before ACQBULK (the wait)
        pf = [i for i, s in enumerate(sass) if "UBLKPF" in s]
        acq = [i for i, s in enumerate(sass) if "ACQBULK" in s]
        sass_ok = bool(pf) and bool(acq) and max(pf) < min(acq)
        print(f"    SASS: UBLKPF at {pf}, ACQBULK at {acq}: {'ok' if sass_ok else 'FAIL'}")
        ok = ok and sass_ok
    return ok


def disassemble(cubin: bytes) -> list[str]:
    """The cubin's instructions, one a line, by Triton's bundled nvdisasm ([] without it)."""
    tool = Path(triton.__file__).parent / "backends/nvidia/bin/nvdisasm"
    if not tool.exists():
        return []
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        out = subprocess.run([str(tool), "-c", f.name], capture_output=True, text=True, check=True)
    return [s for s in out.stdout.splitlines() if s.strip().startswith("/*") and ";" in s]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dump", type=Path, help="write each kernel's PTX here")
    ap.add_argument("cases", nargs="*", default=list(CASES))
    args = ap.parse_args()
    bad = [c for c in args.cases if not check(c, args.dump)]
    if bad:
        print("FAILED:", ", ".join(bad))
        sys.exit(1)


if __name__ == "__main__":
    main()
