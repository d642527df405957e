"""The glm plugin's hook implementations (cheap to import: no torch)."""

from __future__ import annotations

from typing import Callable

from tensorfold import hookimpl
from tensorfold.family import FamilySpec
from tensorfold.family.profiles import ProfileRow

GLM5_NEXT = FamilySpec(
    name="glm5_next",
    load="tensorfold_glm.model:load",
    build_demo="tensorfold_glm.demo:build_demo",
    shape="tensorfold_glm.layout:shape",
    dummy="tensorfold_glm.dummy:load_dummy",
    serves=("glm5_next", "glm5_next_text", "Glm5NextForConditionalGeneration"),
    hooks="tensorfold_glm.hooks:HOOKS",
    # KDA's and MLA's projections, dense FFNs, routed and shared experts, and the MTP layer's
    # (weights.py); kv_b_proj (absorbed per head), the indexer, routers and mHC stay
    fp8_linears=r"^model\.(language_model\.)?layers\.\d+\.(self_attn\.([qkvob]|f_a|f_b|g_a|"
    r"g_b|q_a|q_b|kv_a)(_proj|_proj_with_mqa)\.weight|mlp\.(experts\.\d+\.|shared_experts\.)?"
    r"(gate|up|down)_proj\.weight|eh_proj\.weight)$",
    description="GLM-5.3-Flash (Z.ai) text model: KDA linear attention, MLA with the DSA "
    "k-pool indexer, 4-stream mHC residual, sigmoid-routed MoE with a shared expert",
)

RETIRED_KV_SHARE = ProfileRow(
    setting="TF_GLM_KV_SHARE",
    values="0 or empty (anything else refuses the start)",
    default="unset",
    families=("glm5_next",),
    meaning="GLM's own prompt-store switch, now the core's prompt store for every family. "
    "0 and empty start as if unset.",
    replaced_by="TF_KV_SHARE",
)


@hookimpl
def register_families(register: Callable[[FamilySpec], None]) -> None:
    register(GLM5_NEXT)


@hookimpl
def profile_rows(register: Callable[[ProfileRow], None]) -> None:
    register(RETIRED_KV_SHARE)
