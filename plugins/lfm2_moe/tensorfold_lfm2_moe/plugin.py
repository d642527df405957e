"""The lfm2_moe plugin's hook implementations (cheap to import: no torch)."""

from __future__ import annotations

from typing import Callable

from tensorfold import hookimpl
from tensorfold.family import FamilySpec

LFM2_MOE = FamilySpec(
    name="lfm2_moe",
    load="tensorfold_lfm2_moe.model:load",
    build_demo="tensorfold_lfm2_moe.demo:build_demo",
    shape="tensorfold_lfm2_moe.model:shape",
    dummy="tensorfold_lfm2_moe.dummy:load_dummy",
    serves=("lfm2_moe", "Lfm2MoeForCausalLM"),  # config.json's model_type / architectures
    hooks="tensorfold_lfm2_moe.hooks:HOOKS",
    demo_rank=0,
    # attention, the convolutions' in/out projections, dense FFNs and experts (weights.py)
    fp8_linears=r"\.(self_attn\.(q|k|v|out)_proj|conv\.(in|out)_proj|feed_forward\."
    r"(experts\.\d+\.)?w[123])\.weight$",  # the default family when several are installed: its demo is the quickest
    description="LFM2 / LFM2.5 MoE (Liquid AI): gated short convolutions and GQA attention, "
    "sigmoid-routed top-k experts",
)


@hookimpl
def register_families(register: Callable[[FamilySpec], None]) -> None:
    register(LFM2_MOE)


@hookimpl
def profile_rows(register: Callable[..., None]) -> None:
    """lfm2_moe reads no TF_* setting of its own: no rows."""
