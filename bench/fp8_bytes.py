"""Weight bytes in bf16 and under `--quantization fp8` at each family's real shapes (the plugins'
dummy.SHAPES), for docs/fp8.md: each family's own loader runs against a checkpoint of shapes
only (meta tensors: nothing is allocated), and every tensor it reads is counted as it would load,
the linears its FamilySpec.fp8_linears names in fp8 with their 128 x 128 scales. With `world` > 1
the loader runs as rank 0 of that many tensor-parallel ranks (the family's shard plan cuts each
tensor as the checkpoint would), so the count is one rank's (bench/kv_capacity.py --tp).

python bench/fp8_bytes.py          # a markdown table
"""

from __future__ import annotations

import re
from typing import Any, Callable, Sequence

import torch

from tensorfold.family import Shard, ShardPlan
from tensorfold.family.checkpoint import shard_pieces
from tensorfold.family.fp8_weights import RELEASE_BLOCK, Fp8Weight, fp8_bytes

GB = 1e9


class ShapesOnly:
    """What a family's loader asks of a Checkpoint, answered with meta tensors of the shapes it
    asks for; `read` records (name, shape, fp8) of each tensor loaded."""

    def __init__(
        self, fp8_linears: str, absent: Callable[[str], bool], shard: Shard | None = None
    ) -> None:
        self.pattern = re.compile(fp8_linears)
        self.absent = absent
        self.shard = shard or Shard()
        self.quantized: list[str] = []
        self.read: dict[str, tuple[tuple[int, ...], bool]] = {}

    def has(self, name: str) -> bool:
        return not self.absent(name)

    def stored_fp8(self, name: str) -> bool:
        return False

    def quantizes_at_load(self, name: str) -> bool:
        return self.pattern.search(name) is not None

    def local(self, name: str, shape: Sequence[int]) -> tuple[int, ...]:
        """This rank's slice of a tensor of `shape` on disk, as a Checkpoint cuts it."""
        out, pieces = list(shape), shard_pieces(self.shard, name, shape)
        if pieces is not None:
            dim, ranges = pieces
            out[dim] = sum(b - a for a, b in ranges)
        return tuple(out)

    def load(self, name: str, *, device: str, dtype: Any, shape: Sequence[int]) -> torch.Tensor:
        shape = self.local(name, shape)
        self.read[name] = (shape, False)
        return torch.empty(*shape, device="meta", dtype=dtype or torch.bfloat16)

    def load_fp8(self, name: str, *, device: str, shape: Sequence[int]) -> Fp8Weight:
        shape = self.local(name, shape)
        self.read[name] = (shape, True)
        *lead, n, k = shape
        bn, bk = RELEASE_BLOCK
        q = torch.empty(*shape, device="meta", dtype=torch.float8_e4m3fn)
        scale = torch.empty(*lead, -(-n // bn), -(-k // bk), device="meta")
        return Fp8Weight(q, scale, RELEASE_BLOCK)


def counted(ckpt: ShapesOnly) -> dict[str, int]:
    bf16 = fp8 = linears = 0
    for shape, quantized in ckpt.read.values():
        n = 1
        for d in shape:
            n *= d
        bf16 += 2 * n
        if quantized:
            linears += 2 * n
            fp8 += fp8_bytes(shape)
        else:
            fp8 += 2 * n
    return {"bf16": bf16, "fp8": fp8, "linears_bf16": linears}


def rank_zero(plan: Callable[[Any, str, int], ShardPlan], cfg: Any, world: int) -> Shard:
    """Rank 0 of `world` ranks as the family's shard plan cuts `cfg` (no cut at world 1)."""
    return Shard(0, world, plan(cfg, "bfloat16", world)) if world > 1 else Shard()


def lfm2(shape: str, world: int = 1) -> dict[str, int]:
    from tensorfold_lfm2_moe import shards
    from tensorfold_lfm2_moe.dummy import SHAPES
    from tensorfold_lfm2_moe.plugin import LFM2_MOE
    from tensorfold_lfm2_moe.weights import load_weights

    shard = rank_zero(shards.plan, SHAPES[shape], world)
    ckpt = ShapesOnly(LFM2_MOE.fp8_linears, lambda n: n == "lm_head.weight", shard)
    load_weights(ckpt, SHAPES[shape], "meta", torch.bfloat16)  # type: ignore[arg-type]
    return counted(ckpt)


def gemma4(shape: str, world: int = 1) -> dict[str, int]:
    from tensorfold_gemma4 import shards
    from tensorfold_gemma4.dummy import SHAPES
    from tensorfold_gemma4.plugin import GEMMA4
    from tensorfold_gemma4.weights import load_weights

    shard = rank_zero(shards.plan, SHAPES[shape], world)
    ckpt = ShapesOnly(GEMMA4.fp8_linears, lambda n: n == "lm_head.weight", shard)
    load_weights(ckpt, SHAPES[shape], "meta", torch.bfloat16)  # type: ignore[arg-type]
    return counted(ckpt)


def glm(shape: str, world: int = 1, mtp: bool = True) -> dict[str, int]:
    from tensorfold_glm import shards
    from tensorfold_glm.dummy import SHAPES
    from tensorfold_glm.plugin import GLM5_NEXT
    from tensorfold_glm.weights import load_weights

    # the MTP layer loads too at one rank (as --draft mtp reads it; mtp=False: as a start
    # without it), with the trunk's embeddings and head
    def absent(n: str) -> bool:
        if not mtp and n.endswith(f"layers.{cfg.num_hidden_layers}.eh_proj.weight"):
            return True  # has_mtp looks for it
        return n.endswith(
            ("shared_head.head.weight", f"{cfg.num_hidden_layers}.embed_tokens.weight")
        )

    cfg = SHAPES[shape]
    ckpt = ShapesOnly(GLM5_NEXT.fp8_linears, absent, rank_zero(shards.plan, cfg, world))
    load_weights(ckpt, cfg, "meta", torch.bfloat16)  # type: ignore[arg-type]
    return counted(ckpt)


def main() -> None:
    rows = [
        ("lfm2_moe", "LFM2-8B-A1B", lfm2),
        ("lfm2_moe", "LFM2-24B-A2B", lfm2),
        ("gemma4", "Gemma-4-26B-A4B", gemma4),
        ("glm5_next", "GLM-5.3-Flash", glm),
        ("glm5_next", "GLM-5.3-Flash-8L", glm),
    ]
    print("| family | shape | bf16 | fp8 | fp8 / bf16 | linears (bf16) | kept in bf16 |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for family, shape, count in rows:
        b = count(shape)
        kept = b["bf16"] - b["linears_bf16"]
        print(
            f"| {family} | {shape} | {b['bf16'] / GB:.2f} GB | {b['fp8'] / GB:.2f} GB | "
            f"{b['fp8'] / b['bf16']:.3f} | {b['linears_bf16'] / GB:.2f} GB | {kept / GB:.2f} GB |"
        )


if __name__ == "__main__":
    main()
