"""The gemma4 plugin's hook implementations (cheap to import: no torch)."""

from __future__ import annotations

from typing import Callable

from tensorfold import hookimpl
from tensorfold.family import FamilySpec

GEMMA4 = FamilySpec(
    name="gemma4",
    load="tensorfold_gemma4.model:load",
    build_demo="tensorfold_gemma4.demo:build_demo",
    shape="tensorfold_gemma4.model:shape",
    dummy="tensorfold_gemma4.dummy:load_dummy",
    serves=("gemma4", "gemma4_text", "Gemma4ForConditionalGeneration", "Gemma4ForCausalLM"),
    hooks="tensorfold_gemma4.hooks:HOOKS",
    # attention, the dense MLP and the fused experts of the text layers (weights.py); the
    # per-layer-embedding maps, the router and the towers stay
    fp8_linears=r"^model\.(language_model\.)?layers\.\d+\.(self_attn\.[qkvo]_proj\.weight|"
    r"mlp\.(gate|up|down)_proj\.weight|experts\.(gate_up|down)_proj)$",
    description="Gemma 4 (Google) text models: sliding-window and full attention, a dense GeGLU "
    "beside softmax-routed experts, per-layer embeddings and KV sharing; images through the vision "
    "tower (audio not served yet)",
)


@hookimpl
def register_families(register: Callable[[FamilySpec], None]) -> None:
    register(GEMMA4)


@hookimpl
def profile_rows(register: Callable[..., None]) -> None:
    """gemma4 reads no TF_* setting of its own: no rows."""
