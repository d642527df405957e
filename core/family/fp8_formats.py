"""A checkpoint's `quantization_config`: which FP8 format its weights are stored in, or a refusal.

Two formats load (docs/fp8.md):
- "fp8" (DeepSeek, Qwen, GLM FP8 releases; transformers' FineGrainedFP8): e4m3 `weight` and a
  float32 `weight_scale_inv` of one scale a `weight_block_size` block ([128, 128]); without
  `weight_block_size`, one `weight_scale` for the tensor.
- "compressed-tensors" in its "float-quantized" format (llm-compressor's FP8 / FP8_DYNAMIC /
  FP8_BLOCK schemes): e4m3 `weight` and `weight_scale` per channel ([N, 1]), per tensor ([1])
  or per block (strategy "block", `block_structure`).
Activation schemes (static `input_scale`s, dynamic per-token scales) do not change what a weight
is; tensorfold multiplies in the model's dtype and reads no activation scale. Anything else
(int weights, packed 4-bit formats, other bit widths, dynamic weights, output activations) is
refused by name, at open, before any weight loads.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


class QuantizationRefused(Exception):
    """config.json's quantization_config names a format tensorfold does not load (the
    checkpoint raises it as a CheckpointError naming its folder)."""


@dataclass(frozen=True)
class Fp8Format:
    """How a checkpoint stores its fp8 weights. scale_suffix replaces a tensor's last name part
    `weight` ("q_proj.weight" -> "q_proj.weight_scale_inv"); a fused expert stack not named
    `weight` takes it after "_" ("gate_up_proj" -> "gate_up_proj_scale_inv"). block: the
    declared (bn, bk), or None: each scale's shape says (per tensor, per channel)."""

    method: str
    scale_suffix: str
    block: tuple[int, int] | None

    def scale_name(self, name: str) -> str:
        if name.endswith("weight"):
            return name[: -len("weight")] + self.scale_suffix
        return name + self.scale_suffix[len("weight") :]


def fp8_format(config: dict[str, Any]) -> Fp8Format | None:
    """The format config.json's `quantization_config` declares; None without one. Raises
    QuantizationRefused for a format (or a part of one) that does not load."""
    qc = config.get("quantization_config")
    if qc is None:
        return None
    if not isinstance(qc, dict):
        raise QuantizationRefused("config.json's quantization_config must be a JSON object")
    method = qc.get("quant_method")
    if method == "fp8":
        return _fine_grained(qc)
    if method == "compressed-tensors":
        return _compressed_tensors(qc)
    raise QuantizationRefused(
        f"config.json's quantization_config has quant_method {method!r}; tensorfold loads "
        "'fp8' (block-scaled e4m3) and 'compressed-tensors' FP8 ('float-quantized') checkpoints, "
        "or quantizes a bf16 checkpoint itself (--quantization fp8)"
    )


def _fine_grained(qc: dict[str, Any]) -> Fp8Format:
    fmt = qc.get("fmt", "e4m3")
    if fmt != "e4m3":
        raise QuantizationRefused(
            f"quantization_config fmt {fmt!r}: tensorfold loads fp8 weights in e4m3 only"
        )
    size = qc.get("weight_block_size")
    if size is None:
        return Fp8Format("fp8", "weight_scale", None)
    if (
        not isinstance(size, list)
        or len(size) != 2
        or not all(isinstance(b, int) and b > 0 for b in size)
    ):
        raise QuantizationRefused(
            f"quantization_config weight_block_size {size!r} must be two positive ints [bn, bk]"
        )
    return Fp8Format("fp8", "weight_scale_inv", (size[0], size[1]))


def _compressed_tensors(qc: dict[str, Any]) -> Fp8Format:
    where = "quantization_config (compressed-tensors)"
    status = qc.get("quantization_status", "compressed")
    if status != "compressed":
        raise QuantizationRefused(
            f"{where} has quantization_status {status!r}: only 'compressed' checkpoints "
            "(weights stored in fp8) load"
        )
    groups = qc.get("config_groups")
    if not isinstance(groups, dict) or not groups:
        raise QuantizationRefused(f"{where} has no config_groups")
    blocks: set[tuple[int, int] | None] = set()
    for name, group in groups.items():
        here = f"{where} group {name!r}"
        if not isinstance(group, dict):
            raise QuantizationRefused(f"{here} must be a JSON object")
        fmt = group.get("format") or qc.get("format")
        if fmt != "float-quantized":
            raise QuantizationRefused(
                f"{here} has format {fmt!r}; tensorfold loads 'float-quantized' (FP8) only"
            )
        w = group.get("weights")
        if not isinstance(w, dict):
            raise QuantizationRefused(f"{here} quantizes no weights")
        if w.get("num_bits") != 8 or w.get("type") != "float":
            raise QuantizationRefused(
                f"{here} has {w.get('num_bits')}-bit {w.get('type')!r} weights; only 8-bit "
                "'float' (e4m3) loads"
            )
        if w.get("dynamic") or not w.get("symmetric", True):
            raise QuantizationRefused(
                f"{here}: dynamic or asymmetric weight scales do not load (a weight's stored "
                "scale must be its whole meaning)"
            )
        if group.get("output_activations"):
            raise QuantizationRefused(f"{here} quantizes output activations, which do not load")
        strategy = w.get("strategy")
        if strategy in ("tensor", "channel"):
            blocks.add(None)
        elif strategy == "block":
            size = w.get("block_structure")
            if (
                not isinstance(size, list)
                or len(size) != 2
                or not all(isinstance(b, int) and b > 0 for b in size)
            ):
                raise QuantizationRefused(f"{here} block_structure {size!r} is not [bn, bk]")
            blocks.add((size[0], size[1]))
        else:
            raise QuantizationRefused(
                f"{here} has weight strategy {strategy!r}; 'tensor', 'channel' and 'block' load"
            )
    if len(blocks) != 1:
        raise QuantizationRefused(f"{where} mixes block and per-channel/tensor groups")
    return Fp8Format("compressed-tensors", "weight_scale", blocks.pop())
