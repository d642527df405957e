"""fp8 KV rows (TF_KV_DTYPE=fp8): a row's stored bits depend on that row alone, the pool's copies,
poison and host tier carry the scales, the plan counts the real bytes (about twice the tokens in
the same room), and a bad value is refused naming what is accepted."""

from __future__ import annotations

import pytest
import torch

from tensorfold.adapters.paged_kv import PagedRows
from tensorfold.adapters.snapshots import SnapshotArena
from tensorfold.config.settings import Settings, SettingsError
from tensorfold.family import RowSpec, StateLayout, StateSpec
from tensorfold.memory.host_tier import HostTier
from tensorfold.memory.kv_dtype import KVDtypeRefused, kv_label, kv_layout
from tensorfold.memory.kv_plan import GiB, plan
from tensorfold.ops.kv_quant import FP8_DTYPE, FP8_MAX, dequantize_rows, quantize_rows

# LFM2-24B-A2B's attention rows: 10 layers of K and V [8 heads, 64] in bf16, 20 KiB a token
LFM2_24B = StateLayout(
    paged=tuple(
        RowSpec(f"L{i}.{n}", (8, 64), "bfloat16", fp8=True) for i in range(10) for n in "kv"
    )
)


def rows(seed: int, n: int = 40, scale: float = 1.0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, 4, 16, generator=g) * scale * torch.rand(n, 4, 1, generator=g)


def test_a_rows_bits_depend_on_that_row_alone() -> None:
    x = rows(1)
    q, s = quantize_rows(x)
    for i in (0, 17, 39):
        qi, si = quantize_rows(x[i : i + 1])
        assert torch.equal(qi.view(torch.uint8), q[i : i + 1].view(torch.uint8))
        assert torch.equal(si, s[i : i + 1])
    # and not on a far larger row beside it (a per-page or per-tensor scale would)
    x2 = x.clone()
    x2[5] *= 1000
    q2, s2 = quantize_rows(x2)
    keep = torch.arange(40) != 5
    assert torch.equal(q2[keep].view(torch.uint8), q[keep].view(torch.uint8))


def test_quantized_rows_come_back_within_e4m3s_precision() -> None:
    x = rows(2, scale=30.0)
    q, s = quantize_rows(x)
    assert q.dtype == FP8_DTYPE and s.shape == (40, 4, 1) and s.dtype == torch.float32
    back = dequantize_rows(q, s)
    amax = x.abs().amax(-1, keepdim=True)
    # e4m3 keeps 3 mantissa bits: half an ulp is 1/16 of the value, at worst of the row's amax
    assert ((back - x).abs() <= amax / 16 + 1e-12).all()
    assert (q.float().abs().amax(-1) == FP8_MAX).all()  # each row uses the whole range
    zero, zs = quantize_rows(torch.zeros(2, 3))
    assert torch.equal(zs, torch.ones(2, 1)) and not zero.float().any()


def test_paged_rows_store_fp8_with_scales_poison_and_copy_them() -> None:
    layout = kv_layout(
        StateLayout(paged=(RowSpec("k", (4, 16), fp8=True), RowSpec("g", (16,)))), "fp8"
    )
    paged = PagedRows(layout.paged, num_pages=4, page_rows=8)
    assert paged.flat("k").dtype == FP8_DTYPE and paged.scales("g") is None
    assert paged.scales("k").shape == (32, 4, 1)
    x = rows(3, n=5)
    index = torch.tensor([8, 9, 10, 11, 30])
    paged.write("k", index, x)
    q, s = quantize_rows(x)
    assert torch.equal(paged.flat("k")[index].view(torch.uint8), q.view(torch.uint8))
    assert torch.equal(paged.scales("k")[index], s)
    paged.copy_rows(1, 2, 4)  # rows 8..11 -> 16..19, scales with them
    assert torch.equal(
        dequantize_rows(paged.flat("k")[16:20], paged.scales("k")[16:20]),
        dequantize_rows(q[:4], s[:4]),
    )
    paged.poison([3])
    assert paged.flat("k")[24:].float().isnan().all() and paged.scales("k")[24:].isnan().all()


def test_the_host_tier_keeps_fp8_pages_and_scales_bit_for_bit() -> None:
    layout = kv_layout(StateLayout(paged=(RowSpec("k", (4, 16), fp8=True),)), "fp8")
    paged = PagedRows(layout.paged, num_pages=4, page_rows=8)
    paged.write("k", torch.arange(32), rows(4, n=32))
    before = {n: b.clone() for n, b in paged.buffers.items()}
    arena = SnapshotArena([StateSpec("s", (2,))], 1)
    tier = HostTier(paged, arena, num_pages=2, num_slots=1, device="cpu", poison=True)
    snapshot = arena.lease()
    copy = tier.page_out(paged, arena, [1, 3], snapshot)
    paged.poison([1, 3])
    tier.page_in(copy, paged, arena, [1, 3], snapshot)
    for name, buf in paged.buffers.items():
        assert torch.equal(buf.view(torch.uint8), before[name].view(torch.uint8)), name


def test_fp8_pages_are_about_half_the_bytes_and_the_plan_fits_twice_the_tokens() -> None:
    fp8 = kv_layout(LFM2_24B, "fp8")
    assert LFM2_24B.row_bytes == 20 * 1024
    assert fp8.row_bytes == 20 * (8 * 64 + 8 * 4)  # e4m3 rows and a float32 scale a head
    assert LFM2_24B.row_bytes / fp8.row_bytes > 1.88

    def streams(layout: StateLayout) -> int:
        return plan(
            room=40 * GiB,
            page_rows=512,
            page_bytes=layout.page_bytes(512),
            fixed_bytes=240 * 1024,
            window=131072,
            lanes="auto",
            cache_budget=0,
            paging="on",
        ).lanes

    assert streams(LFM2_24B) == 15 and streams(fp8) == 30


def test_the_plan_line_says_how_rows_are_stored() -> None:
    mixed = StateLayout(
        paged=(RowSpec("lat", (16,), "bfloat16", fp8=True), RowSpec("idx", (8,), "bfloat16"))
    )
    assert kv_label(mixed) == "bfloat16"
    assert kv_label(kv_layout(LFM2_24B, "fp8")) == "fp8 e4m3 + scales"
    assert kv_label(kv_layout(mixed, "fp8")) == "fp8 e4m3 + scales, 1 of 2 buffers bfloat16"
    from dataclasses import replace

    p = plan(
        room=GiB,
        page_rows=512,
        page_bytes=kv_layout(LFM2_24B, "fp8").page_bytes(512),
        fixed_bytes=0,
        window=4096,
        lanes=2,
        cache_budget=0,
        paging="on",
    )
    line = replace(p, kv_label="fp8 e4m3 + scales").startup_line()
    assert line.startswith("kv plan: 2 streams taking") and "rows in fp8 e4m3 + scales" in line


def test_fp8_fixed_state_gets_its_scales_and_the_rest_is_left_alone() -> None:
    layout = StateLayout(
        paged=(RowSpec("k", (2, 8), fp8=True),),
        fixed=(
            StateSpec("ring", (7, 2, 8), "bfloat16", fp8=True),
            StateSpec("conv", (16, 2), "bfloat16"),
        ),
    )
    stored = kv_layout(layout, "fp8")
    assert [(s.name, s.shape, s.dtype) for s in stored.fixed] == [
        ("ring", (7, 2, 8), "float8_e4m3fn"),
        ("ring.scale", (7, 2, 1), "float32"),
        ("conv", (16, 2), "bfloat16"),
    ]
    assert stored.fixed_bytes == 7 * 2 * (8 + 4) + 16 * 2 * 2
    assert kv_layout(StateLayout(fixed=layout.fixed), "fp8").fixed == stored.fixed


def test_a_family_with_no_fp8_rows_is_refused_by_name() -> None:
    plain = StateLayout(paged=(RowSpec("k", (2, 8)),))
    with pytest.raises(KVDtypeRefused, match="fakefam stores none of its KV rows in fp8"):
        kv_layout(plain, "fp8", "fakefam")
    assert kv_layout(plain, "auto") is plain


def test_a_bad_kv_dtype_names_what_is_accepted(monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(
        SettingsError,
        match=r"--kv-dtype=int3 is not valid; accepted values: "
        r"auto, fp8",
    ):
        Settings().with_overrides(kv_dtype="int3")
    monkeypatch.setenv("TF_KV_DTYPE", "e5m2")
    with pytest.raises(
        SettingsError, match="TF_KV_DTYPE=e5m2 is not valid; accepted values: auto, fp8"
    ):
        Settings()
    with pytest.raises(KVDtypeRefused, match="accepted values are auto, fp8"):
        kv_layout(LFM2_24B, "int3")
