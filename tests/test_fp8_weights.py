"""fp8 weights (docs/fp8.md): Fp8Weight's exact cuts and joins, quantize_blocks, the checkpoint's
two FP8 formats (their refusals at open, a tensor-parallel cut), and the ops that take them."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from tensorfold.family import COLUMN, ROW, Shard, ShardPlan, Split, StateLayout
from tensorfold.family.checkpoint import Checkpoint, CheckpointError, TensorReader
from tensorfold.ops import fp8, moe
from tensorfold.ops.fp8 import FP8_MAX, Fp8Weight, cat_rows, fp8_bytes, quantize_blocks
from tensorfold.ops.linear import linear
from tensorfold.testing import fp8_quantization_config


def weight(*shape: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def test_quantize_blocks_scales_each_block_to_its_amax() -> None:
    w = weight(300, 200)
    f = quantize_blocks(w)
    assert f.block == (128, 128) and f.scale.shape == (3, 2) and f.q.dtype == torch.float8_e4m3fn
    assert torch.equal(f.scale[2, 1], w[256:, 128:].abs().max() / FP8_MAX)
    assert (f.q.float().abs().amax() == FP8_MAX).item()  # each block's amax lands on 448
    assert ((f.dequantize() - w).abs() <= w.abs() / 16 + 1e-3).all()  # 3 mantissa bits
    assert torch.equal(quantize_blocks(torch.zeros(4, 4)).dequantize(), torch.zeros(4, 4))
    stack = torch.stack([w, 2 * w])
    assert torch.equal(
        quantize_blocks(stack)[1].q.view(torch.uint8), quantize_blocks(2 * w).q.view(torch.uint8)
    )
    assert f.nbytes == fp8_bytes((300, 200)) == 300 * 200 + 6 * 4


@pytest.mark.parametrize("block", [(128, 128), (1, 200), (300, 200), (64, 32)])
def test_cuts_and_joins_keep_every_value(block: tuple[int, int]) -> None:
    f = quantize_blocks(weight(300, 200), block)
    d = f.dequantize()
    for a, b in [(0, 128), (10, 250), (128, 300), (5, 6), (0, 300)]:
        assert torch.equal(f.narrow(0, a, b - a).dequantize(), d[a:b])
        assert torch.equal(f[a:b].dequantize(), d[a:b])
        c = min(b, 200)
        assert torch.equal(f.narrow(1, a, c - a).dequantize(), d[:, a:c])
    for cuts in ([100, 150, 50], [128, 172], [300]):
        joined = cat_rows(f.split(cuts))
        assert isinstance(joined, Fp8Weight) and torch.equal(joined.dequantize(), d)
    if block == (128, 128):  # parts on block edges keep their blocks
        assert cat_rows(f.split([128, 172])).block == (128, 128)
    stack = quantize_blocks(torch.stack([weight(300, 200), weight(300, 200, seed=1)]), block)
    assert torch.equal(stack[:, 10:250].dequantize(), stack.dequantize()[:, 10:250])


@pytest.mark.parametrize("shape", [(2, 272, 256), (3, 1408, 96)])
def test_a_row_cut_inside_a_block_is_a_view_with_its_blocks_scales(shape: tuple) -> None:
    """A fused gate/up [E, 2I, H] in 128-row blocks cut at I (136: the up half 8 rows into
    block 1; 704, Gemma-4-26B-A4B's experts: 64 rows into block 5): each half is a view of the
    codes and of the scales of its blocks, with row0 where it starts inside one, and
    dequantizes to the whole's rows; so does a cut of a cut, an expert of it and its refined
    or rejoined form."""
    f = quantize_blocks(weight(*shape), (128, 128))
    d = f.dequantize()
    i = shape[1] // 2
    gate, up = f[:, :i], f[:, i:]
    assert (gate.row0, up.row0) == (0, i % 128) and gate.block == up.block == (128, 128)
    assert up.scale.shape == (shape[0], -(-(i % 128 + i) // 128), f.scale.shape[2])
    for half, rows in ((gate, slice(0, i)), (up, slice(i, 2 * i))):
        assert half.q.data_ptr() == f.q[:, rows].data_ptr()
        assert half.scale.untyped_storage().data_ptr() == f.scale.untyped_storage().data_ptr()
        assert torch.equal(half.dequantize(), d[:, rows])
        assert torch.equal(half[1].dequantize(), d[1, rows])
        assert torch.equal(half.refine(0).dequantize(), d[:, rows])
    inner = up.narrow(0, 100, 30)  # rows i + 100 .. i + 130 of the whole
    assert inner.row0 == (i % 128 + 100) % 128
    assert torch.equal(inner.dequantize(), d[:, i + 100 : i + 130])
    assert torch.equal(up.narrow(1, 0, 64).dequantize(), d[:, i:, :64])
    two = f[1]
    joined = cat_rows([two.narrow(0, 0, i), two.narrow(0, i, i)])  # refined: i ends mid-block
    assert isinstance(joined, Fp8Weight) and torch.equal(joined.dequantize(), d[1])
    tail = cat_rows([two.narrow(0, 5, 123), two.narrow(0, 128, 2 * i - 128)])  # blocks kept
    assert isinstance(tail, Fp8Weight) and (tail.block, tail.row0) == ((128, 128), 5)
    assert torch.equal(tail.dequantize(), d[1, 5:])


def test_row0_must_lie_in_a_block_and_fit_the_scales() -> None:
    f = quantize_blocks(weight(256, 128))
    with pytest.raises(ValueError, match="row0 128 is outside a row block of 128"):
        Fp8Weight(f.q, f.scale, f.block, 128)
    with pytest.raises(ValueError, match="needs scale \\[3, 1\\]"):
        Fp8Weight(f.q, f.scale, f.block, 1)
    stack = fp8.empty_stack(f.narrow(0, 64, 128), 2)
    assert stack.row0 == 64 and stack.scale.shape == (2, 2, 1)
    with pytest.raises(ValueError, match="differ from its layer's"):
        fp8.put(stack, 0, f.narrow(0, 0, 128))


def test_a_mixed_join_is_dequantized() -> None:
    f, plain = quantize_blocks(weight(8, 16)), weight(4, 16)
    joined = cat_rows([f, plain])
    assert isinstance(joined, torch.Tensor) and torch.equal(joined[:8], f.dequantize())


def test_ops_take_fp8_weights_as_their_dequantized_weights() -> None:
    x = weight(5, 64)
    w = quantize_blocks(weight(48, 64, seed=1), (16, 32))
    assert torch.equal(linear(x, w), linear(x, w.dequantize()))
    assert torch.equal(linear(x.bfloat16(), w), linear(x.bfloat16(), w.dequantize(torch.bfloat16)))
    e, i, h = 4, 24, 64
    w1, w3 = (quantize_blocks(weight(e, i, h, seed=s)) for s in (2, 3))
    w2 = quantize_blocks(weight(e, h, i, seed=4))
    gates, experts = torch.rand(5, 2), torch.tensor([[0, 3], [1, 3], [3, 0], [2, 1], [0, 2]])
    ours = moe.moe(x, gates, experts, w1, w3, w2)
    plain = moe.moe(x, gates, experts, *(t.dequantize() for t in (w1, w3, w2)))
    assert isinstance(ours, torch.Tensor) and torch.equal(ours, plain)


def test_the_kernels_take_fp8_weights_whose_column_blocks_they_read() -> None:
    """fp8.kernels_take: all plain or all fp8 of column blocks a multiple of 128 or all of K
    (the releases' blocks, per channel, per tensor, a tiny K inside one block; a row cut
    inside a block and a join refined to (1, bk) too); a mix and a column cut off the blocks
    (bn, 1) not. kernels_take_ffn: and w1 and w3 of one block."""
    plain = weight(300, 300)
    blocks, channel = quantize_blocks(plain), quantize_blocks(plain, (1, 300))
    tensor, tiny = quantize_blocks(plain, (300, 300)), quantize_blocks(weight(48, 64))
    rows = blocks.narrow(0, 5, 20)
    assert rows.block == (128, 128) and rows.row0 == 5
    refined = cat_rows([rows, blocks.narrow(0, 30, 10)])
    assert isinstance(refined, Fp8Weight) and refined.block == (1, 128)
    for w in (blocks, channel, tensor, tiny, rows, refined):
        assert fp8.kernel_reads(w) and fp8.kernels_take(w)
    columns = blocks.narrow(1, 64, 200)  # a cut of K off the 128 edges
    assert columns.block == (128, 1) and not fp8.kernel_reads(columns)
    assert not fp8.kernel_reads(quantize_blocks(plain, (128, 64)))
    assert fp8.kernels_take_ffn(plain, plain, plain) and fp8.kernels_take([plain], plain)
    assert fp8.kernels_take_ffn(blocks, blocks, channel)
    assert fp8.kernels_take_ffn([blocks], [blocks], blocks)
    assert fp8.kernels_take(blocks, channel, blocks)
    assert not fp8.kernels_take_ffn(blocks, channel, blocks)  # w1 and w3 of two block shapes
    assert not fp8.kernels_take(blocks, plain, blocks) and not fp8.kernels_take(columns)


def write(folder: Path, tensors: dict[str, torch.Tensor], quantization: object = None) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    config = {} if quantization is None else {"quantization_config": quantization}
    (folder / "config.json").write_text(json.dumps(config))
    save_file(tensors, str(folder / "model.safetensors"))
    return folder


def fp8_tensors(fmt: str, w: torch.Tensor) -> dict[str, torch.Tensor]:
    n, k = w.shape
    block = {"block": (128, 128), "channel": (1, k), "tensor": (n, k)}[fmt]
    f = quantize_blocks(w, block)
    suffix = "weight_scale_inv" if fmt == "block" else "weight_scale"
    scale = f.scale.reshape(1) if fmt == "tensor" else f.scale
    return {"p.weight": f.q, f"p.{suffix}": scale.contiguous(), "norm.weight": torch.ones(k)}


@pytest.mark.parametrize("fmt", ["block", "channel", "tensor"])
def test_each_format_loads_as_the_weight_it_stores(fmt: str, tmp_path: Path) -> None:
    w = weight(200, 160)
    ckpt = Checkpoint.open(write(tmp_path, fp8_tensors(fmt, w), fp8_quantization_config(fmt)))
    read = TensorReader(ckpt, "cpu", torch.float32)
    f = read.linear("p.weight", 200, 160)
    assert isinstance(f, Fp8Weight) and ckpt.quantized == ["p.weight"]
    assert f.block == {"block": (128, 128), "channel": (1, 160), "tensor": (200, 160)}[fmt]
    assert torch.equal(read("p.weight", 200, 160), f.dequantize())  # a plain read dequantizes
    assert not isinstance(read.linear("norm.weight", 160), Fp8Weight)


def test_a_tensor_parallel_cut_reads_its_scales(tmp_path: Path) -> None:
    w = weight(256, 192)
    ckpt = Checkpoint.open(
        write(tmp_path, fp8_tensors("block", w), fp8_quantization_config("block"))
    )
    whole = ckpt.load_fp8("p.weight").dequantize()
    layout = StateLayout(paged=(), fixed=())
    for split, dim in ((COLUMN, 0), (ROW, 1), (Split(dim=0, groups=2), 0)):
        for rank in range(2):
            ckpt.set_shard(Shard(rank, 2, ShardPlan(((r"p\.weight", split),), layout)))
            ranges = split.pieces(whole.shape[dim], rank, 2)
            want = torch.cat([whole.narrow(dim, a, b - a) for a, b in ranges], dim)
            assert torch.equal(ckpt.load_fp8("p.weight").dequantize(), want)


@pytest.mark.parametrize(
    "config, match",
    [
        ({"quant_method": "awq"}, "quant_method 'awq'"),
        ({"quant_method": "fp8", "fmt": "e5m2"}, "e4m3 only"),
        ({"quant_method": "fp8", "weight_block_size": [128]}, "weight_block_size"),
        (
            {
                "quant_method": "compressed-tensors",
                "config_groups": {"g": {"format": "pack-quantized", "weights": {}}},
            },
            "'pack-quantized'",
        ),
        (
            {
                "quant_method": "compressed-tensors",
                "format": "float-quantized",
                "config_groups": {
                    "g": {"weights": {"num_bits": 4, "type": "int", "strategy": "group"}}
                },
            },
            "4-bit 'int'",
        ),
        (
            {
                "quant_method": "compressed-tensors",
                "format": "float-quantized",
                "config_groups": {
                    "g": {
                        "weights": {
                            "num_bits": 8,
                            "type": "float",
                            "strategy": "token",
                            "dynamic": True,
                        }
                    }
                },
            },
            "dynamic",
        ),
    ],
)
def test_an_unsupported_format_is_refused_at_open(config: dict, match: str, tmp_path: Path) -> None:
    folder = write(tmp_path, {"p.weight": weight(4, 4)}, config)
    with pytest.raises(CheckpointError, match=match):
        Checkpoint.open(folder, weights=False)


def test_fp8_without_its_format_or_scale_is_refused(tmp_path: Path) -> None:
    tensors = fp8_tensors("block", weight(8, 8))
    with pytest.raises(CheckpointError, match="no quantization_config"):
        Checkpoint.open(write(tmp_path / "a", tensors))
    del tensors["p.weight_scale_inv"]
    ckpt = Checkpoint.open(write(tmp_path / "b", tensors, fp8_quantization_config("block")))
    with pytest.raises(CheckpointError, match="no scale 'p.weight_scale_inv'"):
        ckpt.load_fp8("p.weight")
    bad = {**fp8_tensors("channel", weight(8, 8)), "p.weight_scale": torch.ones(3)}
    ckpt = Checkpoint.open(write(tmp_path / "c", bad, fp8_quantization_config("channel")))
    with pytest.raises(CheckpointError, match="fit neither"):
        ckpt.load_fp8("p.weight")


def test_quantize_at_load_counts_and_reads_what_the_pattern_names(tmp_path: Path) -> None:
    tensors = {"a.weight": weight(256, 128).bfloat16(), "norm.weight": torch.ones(128).bfloat16()}
    ckpt = Checkpoint.open(write(tmp_path, tensors))
    assert ckpt.local_bytes() == 256 * 128 * 2 + 256
    ckpt.set_quantization(r"^a\.weight$")
    assert ckpt.local_bytes() == fp8_bytes((256, 128)) + 256
    assert ckpt.local_bytes(as_stored=True) == 256 * 128 * 2 + 256
    read = TensorReader(ckpt, "cpu", torch.float32)
    with pytest.raises(CheckpointError, match="TensorReader.linear"):
        read("a.weight", 256, 128)
    f = read.linear("a.weight", 256, 128)
    assert isinstance(f, Fp8Weight)
    assert torch.equal(
        f.q.view(torch.uint8), quantize_blocks(tensors["a.weight"]).q.view(torch.uint8)
    )


def test_the_plan_counts_an_fp8_tensor_read_plain_as_dequantized(tmp_path: Path) -> None:
    tensors = {**fp8_tensors("block", weight(256, 128)), "r.weight": weight(16, 128).bfloat16()}
    f = quantize_blocks(weight(16, 128))
    tensors.update({"r.weight": f.q, "r.weight_scale_inv": f.scale})  # a router shipped in fp8
    ckpt = Checkpoint.open(write(tmp_path, tensors, fp8_quantization_config("block")))
    as_stored = ckpt.local_bytes()
    ckpt.set_quantization(r"^p\.weight$", at_load=False)
    assert ckpt.local_bytes() == as_stored + 16 * 128  # r: 2 bytes a value once dequantized
    assert not ckpt.quantizes_at_load("p.weight")  # stored in fp8 already


def test_quantized_at_load_under_tp_is_the_fp8_checkpoints_cut(tmp_path: Path) -> None:
    """A rank quantizes the whole tensor and keeps its cut (only its bytes), so its values are
    those a block-scaled FP8 checkpoint of the same weights gives it."""
    w = weight(256, 384).bfloat16()
    f = quantize_blocks(w)
    plain = write(tmp_path / "bf16", {"p.weight": w})
    fp8 = write(
        tmp_path / "fp8",
        {"p.weight": f.q, "p.weight_scale_inv": f.scale},
        fp8_quantization_config("block"),
    )
    layout = StateLayout(paged=(), fixed=())
    for split in (COLUMN, ROW):
        for rank in range(2):
            a, b = Checkpoint.open(plain), Checkpoint.open(fp8)
            a.set_quantization(r"^p\.weight$")
            for ckpt in (a, b):
                ckpt.set_shard(Shard(rank, 2, ShardPlan(((r"p\.weight", split),), layout)))
            mine, theirs = a.load_fp8("p.weight"), b.load_fp8("p.weight")
            assert torch.equal(mine.q.view(torch.uint8), theirs.q.view(torch.uint8))
            assert torch.equal(mine.scale, theirs.scale) and mine.block == theirs.block
            assert mine.q.untyped_storage().nbytes() == mine.q.numel()  # not a view of the whole
