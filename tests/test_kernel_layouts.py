"""What the compiler makes of two launches that must reduce a row in the same order, checked on
the CPU by compiling both for an H200 (sm_90) to Triton's GPU IR: the interpreter sums with
numpy, so only the layout of the reduced tile says whether two kernels add a row's elements in
the same order (the same blocked layout and the same ops give the same tree).

Each check runs in a fresh process without TRITON_INTERPRET (other test modules set it, and an
interpreted kernel cannot be compiled): `python tests/test_kernel_layouts.py CHECK`."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

SKIP = 77  # a check's exit status when this Triton cannot compile for sm_90


def _in_fresh_process(check: str) -> None:
    pytest.importorskip("triton")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run(
        [sys.executable, __file__, check], env=env, capture_output=True, text=True, timeout=600
    )
    if done.returncode == SKIP:
        pytest.skip(done.stdout.strip()[-200:])
    assert done.returncode == 0, (done.stdout + done.stderr)[-3000:]


def test_norm_in_the_routers_launch_reduces_a_row_as_the_norm_kernel():
    """triton_route's norm of one row (NORM_IN) and triton_norms' kernel sum a 2048-wide row's
    squares on the same [2, 2048] tile in the same layout (lfm2 8B's width)."""
    _in_fresh_process("norm_in_router")


def test_route_of_one_row_on_its_own_tile_reduces_a_row_as_the_rows_tile():
    """triton_route's _route_kernel for one row on a [1, 128] tile in one warp
    reduces each row (the softmax's sum among them) in the layout of the [16, 128] tile in four
    warps along the row: 4 columns a thread, 32 threads, one warp (gemma4's 128 experts)."""
    _in_fresh_process("route_one_row")


def test_route_aligning_a_few_rows_keeps_its_reductions():
    """triton_route's _route_kernel aligning a pass of 8 rows (32 pairs, 32 experts:
    aligns_in_route) compiles for sm_90 and reduces its rows in the layouts of the route
    without the alignment."""
    _in_fresh_process("route_few_rows")


def test_qkv_norm_rope_write_reduces_its_heads_as_norm_ropes_launches():
    """triton_rope's one launch for lfm2's q/k norm + rope and K/V writes sums each q and k
    head's squares on the tiles of norm_rope's launch for q and for k, in the same layouts
    (LFM2-8B-A1B's 32 q and 8 KV heads of 64)."""
    _in_fresh_process("qkv_norm_rope_write")


def test_qkv_heads_reduce_q_and_k_as_norm_ropes_launches():
    """triton_rope's one launch for gemma4's q/k/v heads sums each q and k head's squares on the
    tiles of norm_rope's launches for q and for k, in the same layouts, where those launches
    take the same warps (Gemma-4-26B-A4B's sliding layers: 16 q and 8 KV heads of 256)."""
    _in_fresh_process("qkv_heads")


def test_dense_walk_tiles_keep_a_split_prompt_pass_in_registers():
    """The dense FFN's walk tiles (DENSE_TILES, a prompt pass with its K split: two
    accumulators a product) compile for sm_90 with no spill, gemma4's and lfm2's gate/up and
    down alike (the prompt tiles' 128 x 128 spilled, and took the pass 174 -> 673 µs)."""
    _in_fresh_process("dense_walk_tiles")


def test_fp8_kernels_compile_for_sm90_without_spills():
    """The fp8 weights' kernels (triton_fp8) on the prompt tiles, the dense walk's and a few
    rows' compile for sm_90 (e4m3 converted in registers) and spill nothing; on the few rows'
    16-row tiles their MMAs take the bf16 kernels' k order (kWidth 2: triton_util.
    dot_operand_barrier), which the 64- and 128-row tiles' MMAs sum alike."""
    _in_fresh_process("fp8_tiles")


def _compile(
    fn, constexprs: dict, types: dict, divisible: set[str], num_warps: int = 4, num_stages: int = 3
):
    """fn for sm_90 as a launch specialises it: pointers and the named ints 16-divisible."""
    sig = {a: "constexpr" if a in constexprs else types.get(a, "i32") for a in fn.arg_names}
    attrs = {
        (i,): [["tt.divisibility", 16]]
        for i, a in enumerate(fn.arg_names)
        if a not in constexprs and (sig[a].startswith("*") or a in divisible)
    }
    src = triton.compiler.ASTSource(fn=fn, signature=sig, constexprs=constexprs, attrs=attrs)
    if "nvidia" not in triton.backends.backends:
        print("cannot compile for sm_90 here: this Triton build has no CUDA backend")
        sys.exit(SKIP)
    # any other error is the check's failure (a kernel's new argument, say), not a skip
    return triton.compile(
        src,
        target=GPUTarget("cuda", 90, 32),
        options={"num_warps": num_warps, "num_stages": num_stages, "launch_pdl": True},
    )


def _spill_stores(kernel) -> int:
    """Bytes of spill stores ptxas reports for a kernel's PTX (sm_90a)."""
    import tempfile

    ptxas = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")
    if not os.path.exists(ptxas):
        print(f"no ptxas at {ptxas}")
        sys.exit(SKIP)
    with tempfile.NamedTemporaryFile("w", suffix=".ptx") as f:
        f.write(kernel.asm["ptx"])
        f.flush()
        done = subprocess.run(
            [ptxas, "-v", "--gpu-name", "sm_90a", f.name, "-o", os.devnull],
            capture_output=True,
            text=True,
            check=True,
        )
    return sum(int(b) for b in re.findall(r"(\d+) bytes spill stores", done.stderr))


def _row_sum_layouts(kernel, shape: str) -> list[str]:
    """The blocked layouts of every reduce of an fp32 `shape` tile to its rows."""
    ir = kernel.asm["ttgir"]
    layouts = dict(re.findall(r"^(#blocked\d*) = (#ttg\.blocked<[^>]*>)", ir, re.M))
    return [
        layouts[m]
        for m in re.findall(rf"\(tensor<{shape}xf32, (#blocked\d*)>\) -> tensor<\d+xf32", ir)
    ]


_ROUTE_TYPES = {
    "part_ptr": "*fp32",
    "bias_ptr": "*fp32",
    "scale_ptr": "*fp32",
    "lt_ptr": "*bf16",
    "e_ptr": "*i64",
    "scaling": "fp32",
    "norm_eps": "fp32",
    "sorted_ptr": "*i32",
    "block_ptr": "*i32",
}


def _one_group_choice(topk: int, experts: int, softmax: bool, has_bias: bool) -> dict:
    """A route's constexprs for `topk` of `experts` in one group, the weights normalised, with a
    bias (no scale) or a scale (no bias), its logits in the splits of a 2048-wide router."""
    from tensorfold.ops import triton_route

    return dict(
        S=-(-2048 // triton_route.ROUTER_SPLIT),
        TOPK=topk,
        KB=topk,
        EB=experts,
        SOFTMAX=softmax,
        HAS_BIAS=has_bias,
        HAS_SCALE=not has_bias,
        NORM=True,
        GROUPS=1,
        EPG=experts,
        KEEP_GROUPS=1,
        GB=2,
        BY_EXPERT=False,
    )


def _route_row_sums(
    choice: dict, w_type: str, rows: int, align: bool, pb: int, warps: int = 4
) -> list[str]:
    """The row-sum layouts of triton_route's _route_kernel on a `rows` x experts tile."""
    from tensorfold.ops import triton_route

    kernel = _compile(
        triton_route._route_kernel,
        dict(choice, ROWS=rows, ALIGN=align, BM=16, PB=pb, PDL=True),
        {**_ROUTE_TYPES, "w_ptr": w_type},
        set(),
        num_warps=warps,
    )
    return _row_sum_layouts(kernel, f"{rows}x{choice['EB']}")


def check_norm_in_router() -> None:
    from tensorfold.ops import triton_norms, triton_route

    rows, block_d = triton_norms.rows_per_program(2048)
    bf16 = {
        a: "*bf16"
        for a in ("x_ptr", "g_ptr", "lt_ptr", "w_ptr", "y_ptr", "r_ptr", "nw_ptr", "h_ptr", "o_ptr")
    }
    route = _compile(
        triton_route._router_route_kernel,
        dict(
            F32=False,
            IEEE=False,
            INTERP=False,
            PBM=64,
            EBLK=32,
            KS=triton_route.ROUTER_SPLIT,
            BK=128,
            **_one_group_choice(4, 32, softmax=False, has_bias=True),
            ROWS=16,
            BM=16,
            NORM_IN=True,
            NROWS=rows,
            BLOCK_D=block_d,
            PDL=True,
        ),
        {**_ROUTE_TYPES, **bf16, "cnt_ptr": "*i32", "in_eps": "fp32"},
        {"K", "stride_xm"},
    )
    norm = _compile(
        triton_norms._rms_norm_kernel,
        dict(HAS_RES=True, ROWS=rows, BLOCK_D=block_d, SLOTS=1, PDL=True),
        {**bf16, "eps": "fp32"},
        {"D"},
    )
    want = _row_sum_layouts(norm, f"{rows}x{block_d}")
    assert len(want) == 1
    assert _row_sum_layouts(route, f"{rows}x{block_d}") == want


def _along_rows(layout: str) -> tuple[str, ...]:
    """A 2-D blocked layout's spread along dim 1 (a row): per thread, threads, warps; and order."""
    f = {k: (a, b) for k, a, b in re.findall(r"(\w+) = \[(\d+), (\d+)\]", layout)}
    return f["sizePerThread"][1], f["threadsPerWarp"][1], f["warpsPerCTA"][1], *f["order"]


def check_route_one_row() -> None:
    from tensorfold.ops import triton_route

    choice = _one_group_choice(8, 128, softmax=True, has_bias=False)
    many = _route_row_sums(choice, "*fp32", triton_route.ROUTE_ROWS, True, 8, warps=4)
    one = _route_row_sums(choice, "*fp32", 1, True, 8, warps=1)
    assert many and len(many) == len(one)
    assert [_along_rows(a) for a in one] == [_along_rows(a) for a in many]


def check_route_few_rows() -> None:
    choice = _one_group_choice(4, 32, softmax=False, has_bias=True)
    plain = _route_row_sums(choice, "*bf16", 16, False, 32)
    assert plain and _route_row_sums(choice, "*bf16", 16, True, 32) == plain


def _rope_choice(half: int, norm: int, **heads: int) -> dict:
    """A rope launch's constexprs: heads of 2 * half, normed as `norm`, and the head counts."""
    return dict(HALF=half, **heads, NORM=norm, PDL=True)


def _rope_row_sums(
    heads: int, half: int, norm: int, w_type: str, divisible: set[str], warps: int
) -> list[str]:
    """The row-sum layouts of triton_rope's _rope_kernel (the q/k norm's weight `w_type`) on
    its heads x half tile."""
    from tensorfold.ops import triton_rope

    alone = _compile(
        triton_rope._rope_kernel,
        _rope_choice(half, norm, HEADS=heads),
        {a: "*bf16" for a in ("x_ptr", "c_ptr", "s_ptr", "o_ptr")}
        | {"w_ptr": w_type, "eps": "fp32"},
        divisible,
        num_warps=warps,
    )
    return _row_sum_layouts(alone, f"{heads}x{half}")


def check_qkv_norm_rope_write() -> None:
    from tensorfold.ops import triton_rope

    hq, hkv, half, norm = 32, 8, 32, triton_rope.NORM_ROUNDED
    strides = {"stride_xn", "stride_xh", "stride_cn"}
    fused = _compile(
        triton_rope._qkv_kernel,
        _rope_choice(half, norm, Q_HEADS=hq, KV_HEADS=hkv),
        {
            a: "*bf16"
            for a in ("x_ptr", "wq_ptr", "wk_ptr", "c_ptr", "s_ptr", "q_ptr", "k_ptr", "v_ptr")
        }
        | {"index_ptr": "*i64", "eps": "fp32"},
        strides | {"q_heads", "stride_kn", "stride_kh", "stride_vn", "stride_vh"},
        num_warps=triton_rope._warps(max(hq, hkv), 2 * half, norm),
    )
    for heads in (hq, hkv):
        want = _rope_row_sums(
            heads,
            half,
            norm,
            "*bf16",
            strides | ({"heads"} if heads % 16 == 0 else set()),
            triton_rope._warps(heads, 2 * half, norm),
        )
        assert len(want) == 2  # a head's two halves
        assert _row_sum_layouts(fused, f"{heads}x{half}") == want


def check_qkv_heads() -> None:
    from tensorfold.ops import triton_rope

    hq, hkv, half, norm = 16, 8, 128, triton_rope.NORM_FP32
    warps = triton_rope._warps(max(hq, hkv), 2 * half, norm)
    strides = {"stride_xn", "stride_xh", "stride_cn"}
    fused = _compile(
        triton_rope._heads_kernel,
        _rope_choice(half, norm, Q_HEADS=hq, KV_HEADS=hkv),
        {a: "*bf16" for a in ("x_ptr", "c_ptr", "s_ptr", "q_ptr", "k_ptr", "v_ptr")}
        | {"wq_ptr": "*fp32", "wk_ptr": "*fp32", "eps": "fp32"},
        strides | {"q_heads", "kv_heads", "v_first"},
        num_warps=warps,
    )
    for heads in (hq, hkv):
        assert triton_rope._warps(heads, 2 * half, norm) == warps
        want = _rope_row_sums(heads, half, norm, "*fp32", strides | {"heads"}, warps)
        assert len(want) == 2  # a head's two halves
        got = _row_sum_layouts(fused, f"{heads}x{half}")
        assert got[:2] == want  # k's heads: then v's, without a weight, on the same tile
        assert all(layout == want[0] for layout in got[2:])


def check_dense_walk_tiles() -> None:
    from tensorfold.ops import triton_moe

    ptrs = {
        a: "*bf16" for a in ("x_ptr", "w1_ptr", "w3_ptr", "g_ptr", "w2_ptr", "rw_ptr", "out_ptr")
    }
    ptrs.update({a: "*i32" for a in ("ex_ptr", "sorted_ptr", "block_ptr")}, limit="fp32")
    divisible = {
        "K",
        "I",
        "H",
        "CHUNK",
        "stride_xm",
        "stride_1e",
        "stride_1n",
        "stride_3e",
        "stride_3n",
        "stride_2e",
        "stride_2n",
        "stride_om",
    }
    walks = {key: v for key, v in triton_moe.DENSE_TILES.items() if key[2] == "walk"}
    assert walks
    for (i, h, _), (bm, sw, dn) in walks.items():
        splits = (triton_moe.dense_splits(i, h), triton_moe.dense_splits(h, i))
        assert min(splits) > 1, (i, h, splits)
        common = dict(
            IEEE=False,
            INTERP=False,
            BM=bm,
            PDL=True,
            PREFETCH_K=0,
            SPLIT_GRID=False,
            ws_ptr=None,
            cnt_ptr=None,
            ws_rows=0,
            FP8=False,
            SBK=0,
        )
        for fn, t, extra in (
            (
                triton_moe._swiglu_kernel,
                sw,
                dict(TOPK=1, ACT=2, SPLITS=splits[0], s1_ptr=None, s3_ptr=None),
            ),
            (triton_moe._down_kernel, dn, dict(HAS_WEIGHT=False, SPLITS=splits[1], s2_ptr=None)),
        ):
            kernel = _compile(
                fn,
                dict(common, BN=t.block_n, BK=t.block_k, **extra),
                ptrs,
                divisible,
                t.warps,
                t.stages,
            )
            spills = _spill_stores(kernel)
            print(fn.__name__, (i, h), t, "spill stores", spills)
            assert spills == 0, (fn.__name__, (i, h), t, spills)


def check_fp8_tiles() -> None:
    """The fp8 weights' kernels (e4m3 codes dequantized in registers) on the prompt tiles, the
    dense walk's and a few rows': each compiles for sm_90, spilling nothing."""
    from tensorfold.ops import triton_linear, triton_moe

    divisible = {"K", "N", "I", "H", "CHUNK", "stride_xm", "stride_wn", "stride_om"}
    divisible |= {f"stride_{w}{a}" for w in "123" for a in "en"} | {"stride_sn"}
    fp8 = dict(FP8=True, SBK=128, IEEE=False, INTERP=False, PDL=True, PREFETCH_K=0)
    ptrs = {a: "*bf16" for a in ("x_ptr", "b_ptr", "o_ptr", "g_ptr", "rw_ptr", "out_ptr")}
    ptrs |= {a: "*fp8e4nv" for a in ("w_ptr", "w1_ptr", "w3_ptr", "w2_ptr")}
    ptrs |= {a: "*fp32" for a in ("s_ptr", "s1_ptr", "s3_ptr", "s2_ptr", "ws_ptr")}
    ptrs |= {a: "*i32" for a in ("cnt_ptr", "ex_ptr", "sorted_ptr", "block_ptr")}
    ptrs["limit"] = "fp32"
    kernels = []
    for rows in (1, 2048):
        bm, t = triton_linear.pick(rows, 2048, 2048)
        linear = dict(HAS_BIAS=False, SPLITS=1, SPLIT_GRID=False, GROUPS=1, BLOCK_M=bm)
        kernels.append((triton_linear._linear_kernel, t, dict(linear, BLOCK_N=t.block_n)))
    walk = next(v for key, v in triton_moe.DENSE_TILES.items() if key[2] == "walk")
    moe = [(triton_moe.BLOCK_M, triton_moe.SWIGLU_TILES, triton_moe.DOWN_TILES, 1)]
    moe += [(walk[0], walk[1], walk[2], 2), (16, *triton_moe.pick(1, 2048)[1:], 1)]
    for bm, sw, dn, splits in moe:
        common = dict(BM=bm, SPLITS=splits, SPLIT_GRID=False, ws_ptr=None, cnt_ptr=None)
        kernels.append((triton_moe._swiglu_kernel, sw, dict(common, TOPK=1, ACT=0, BN=sw.block_n)))
        kernels.append((triton_moe._down_kernel, dn, dict(common, HAS_WEIGHT=True, BN=dn.block_n)))
    for fn, t, constexprs in kernels:
        block_k = {"BLOCK_K" if fn is triton_linear._linear_kernel else "BK": t.block_k}
        kernel = _compile(
            fn, dict(fp8, **constexprs, **block_k), ptrs, divisible, t.warps, t.stages
        )
        assert "e4m3" in kernel.asm["ptx"], fn.__name__  # the codes converted in registers
        # a 16-bit MMA's k order: the bf16 kernels' 2 k values a thread on the 16-row tiles
        widths = set(re.findall(r"kWidth = (\d+)", kernel.asm["ttgir"]))
        assert widths <= {"2"}, (fn.__name__, t, widths)
        spills = _spill_stores(kernel)
        print(fn.__name__, t, "spill stores", spills)
        assert spills == 0, (fn.__name__, t, spills)


if __name__ == "__main__":
    import triton  # noqa: F401
    from triton.backends.compiler import GPUTarget

    {
        "norm_in_router": check_norm_in_router,
        "route_one_row": check_route_one_row,
        "qkv_norm_rope_write": check_qkv_norm_rope_write,
        "qkv_heads": check_qkv_heads,
        "route_few_rows": check_route_few_rows,
        "dense_walk_tiles": check_dense_walk_tiles,
        "fp8_tiles": check_fp8_tiles,
    }[sys.argv[1]]()
