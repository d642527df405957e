"""Compile the paged attention kernel for sm_90 without a GPU and print, per variant, what the
compiler made of its key and value loads: async copies (cp.async, software-pipelined), plain
global loads by width, registers and spills (ptxas), shared memory, loops.

    python3 bench/attention_ptx.py [--warps 4,8] [--stages 2] [--dump DIR]

Not a test. Needs the Triton the GPU machine runs (3.6: `pip install --no-deps --target
/tmp/t36 triton==3.6.0`, then PYTHONPATH=/tmp/t36) and its bundled ptxas. Arguments get the
16-divisibility a real launch gives them (pointers, page_rows, the q/k/v/o strides): without
it every address looks unaligned, loads become 2-byte scalars and none is pipelined, which
session 7 once took for the real kernel's code (docs/perf.md, session 8).
"""

from __future__ import annotations

import argparse
import collections
import re
import subprocess
import tempfile
from pathlib import Path

import triton
from triton.backends.compiler import GPUTarget

from tensorfold.ops import triton_attention

ALIGNED = {
    "page_rows",
    "stride_qn",
    "stride_qh",
    "stride_kr",
    "stride_kh",
    "stride_vr",
    "stride_vh",
    "stride_on",
    "stride_oh",
}
SHAPES = {"lfm2 (32/8 x 64)": (4, 64), "gemma4 global (16/2 x 512)": (8, 512)}  # (group, d)


def compile_one(group: int, d: int, fp8: bool, split: bool, warps: int, stages: int):
    fn = triton_attention._attention_kernel
    qb, dc, bdv = triton_attention.tiles(d, d, group, fp8)
    kv = "*fp8e4nv" if fp8 else "*bf16"
    types = {
        "q_ptr": "*bf16",
        "k_ptr": kv,
        "v_ptr": kv,
        "ks_ptr": "*fp32" if fp8 else kv,
        "vs_ptr": "*fp32" if fp8 else kv,
        "o_ptr": "*bf16",
        "scale": "fp32",
        "ws_ptr": "*fp32",
        "ml_ptr": "*fp32",
    }
    for a in (
        "pos_ptr",
        "block_stream",
        "block_row0",
        "block_len",
        "stream_start",
        "stream_len",
        "table_ptr",
    ):
        types[a] = "*i32"
    constexprs = dict(
        G=group,
        GP=triton.next_power_of_2(group),
        QB=qb,
        NSUB=16 // qb,
        D=d,
        DC=dc,
        BDV=bdv,
        KT=triton_attention.KEY_TILE,
        HAS_WINDOW=False,
        SCALED=fp8,
        IEEE=False,
        INTERP=False,
        DVB=d // bdv,
        SEG=256,
        SPLIT=split,
        PDL=True,
    )
    if split:
        constexprs |= {"HQ": group * 8, "NSEG": 64}
    else:
        constexprs |= {"ws_ptr": None, "ml_ptr": None}
    signature = {a: "constexpr" if a in constexprs else types.get(a, "i32") for a in fn.arg_names}
    attrs = {
        (i,): [["tt.divisibility", 16]]
        for i, a in enumerate(fn.arg_names)
        if a not in constexprs and (a in ALIGNED or signature[a].startswith("*"))
    }
    src = triton.compiler.ASTSource(fn=fn, signature=signature, constexprs=constexprs, attrs=attrs)
    return triton.compile(
        src, target=GPUTarget("cuda", 90, 32), options={"num_warps": warps, "num_stages": stages}
    )


def ptxas_usage(ptx: str) -> str:
    tool = Path(triton.__file__).parent / "backends/nvidia/bin/ptxas"
    with tempfile.NamedTemporaryFile(suffix=".ptx", mode="w") as f:
        f.write(ptx)
        f.flush()
        r = subprocess.run(
            [str(tool), "-v", "--gpu-name", "sm_90a", f.name, "-o", "/dev/null"],
            capture_output=True,
            text=True,
        )
    regs = re.search(r"Used (\d+) registers", r.stderr)
    spill = re.search(r"(\d+) bytes spill stores", r.stderr)
    return f"regs {regs.group(1) if regs else '?'} spill {spill.group(1) if spill else '?'}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--warps", default="4")
    ap.add_argument("--stages", default="2")
    ap.add_argument("--dump", type=Path, help="write each variant's TTGIR and PTX here")
    args = ap.parse_args()
    for name, (group, d) in SHAPES.items():
        for fp8 in (False, True):
            for split in (False, True):
                for warps in map(int, args.warps.split(",")):
                    for stages in map(int, args.stages.split(",")):
                        k = compile_one(group, d, fp8, split, warps, stages)
                        ttgir, ptx = k.asm["ttgir"], k.asm["ptx"]
                        loads = collections.Counter(re.findall(r"ld\.global[.a-z0-9]*", ptx))
                        tag = (
                            f"{name} {'fp8' if fp8 else 'bf16'} "
                            f"{'split' if split else 'walk'} w{warps} s{stages}"
                        )
                        print(
                            f"{tag:<46} async copies "
                            f"{ttgir.count('async_copy_global_to_local'):>2}  "
                            f"{ptxas_usage(ptx)}  smem {k.metadata.shared}  "
                            f"loops {ttgir.count('scf.for')}  {dict(loads)}",
                            flush=True,
                        )
                        if args.dump:
                            args.dump.mkdir(parents=True, exist_ok=True)
                            stem = re.sub(r"[^a-z0-9]+", "_", tag.lower())
                            (args.dump / f"{stem}.ttgir").write_text(ttgir)
                            (args.dump / f"{stem}.ptx").write_text(ptx)


if __name__ == "__main__":
    main()
