"""A small deterministic GLM-5.3-Flash-shaped checkpoint, built locally (no download, no
transformers).

`build_demo(cache_dir)` writes `cache_dir / DEMO_NAME` as transformers 5.23.0 saves a
`Glm5NextForConditionalGeneration`: config.json (text_config + a one-block vision_config),
generation_config.json, model.safetensors under the on-disk names of real checkpoints (per-expert
projections, q/k/v_conv1d, hc_* names, a vision tower), a byte-level BPE tokenizer with GLM's
special tokens, a GLM-style chat template that places images as GLM-4.xV's do, and the image
processor's preprocessor_config.json (at most MAX_IMAGE_TOKENS rows an image, so an image prompt
stays short on a laptop). Same bytes on every build.

The vision tower's weights are random (demo_weights.py): the demo takes images end to end, the
tower's rows written over the image placeholders, but the text model never learned to read them.

The weights ship with the plugin (demo_weights.safetensors, float16): trained on
tensorfold.family.demo_text from demo_weights' random ones by `python -m tensorfold_glm.demo_train`
(needs transformers). The demo knows a few stories, facts and answers, nothing else.

config.json declares one MTP layer (num_nextn_predict_layers; layer 6, MLA with its own indexer
and MoE, tensorfold_glm.mtp), trained after the trunk with the trunk frozen
(`python -m tensorfold_glm.demo_train mtp` retrains it alone); transformers drops it on load, as
it drops a real checkpoint's layer 45.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from tensorfold.family import demo_build

from .demo_text import CHAT_TEMPLATE, CORPUS
from .demo_weights import build_weights as random_weights

if TYPE_CHECKING:
    from tokenizers import Tokenizer

DEMO_NAME = "glm5_next-demo-v6"
WEIGHTS = Path(__file__).with_name("demo_weights.safetensors")
RETRAIN = "python -m tensorfold_glm.demo_train"
FILES = (
    "chat_template.jinja",
    "config.json",
    "generation_config.json",
    "model.safetensors",
    "preprocessor_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
)
MAX_IMAGE_TOKENS = 1024
VOCAB_TARGET = 1024
ENDOFTEXT, GMASK, SOP = "<|endoftext|>", "[gMASK]", "<sop>"
SPECIAL_TOKENS = (
    ENDOFTEXT,
    "[MASK]",
    GMASK,
    "[sMASK]",
    SOP,
    "<eop>",
    "<|system|>",
    "<|user|>",
    "<|assistant|>",
    "<|observation|>",
    "<|begin_of_image|>",
    "<|end_of_image|>",
    "<|begin_of_video|>",
    "<|end_of_video|>",
    "<|image|>",
    "<|video|>",
    "<think>",
    "</think>",
)
EOS = (ENDOFTEXT, "<|user|>", "<|observation|>")  # GLM stops at these

LAYER_TYPES = [
    "linear_attention",
    "linear_attention",
    "indexed_attention",
    "linear_attention",
    "indexed_attention",
    "indexed_attention",
]
TEXT_SHAPE: dict[str, Any] = dict(
    hidden_size=128,
    intermediate_size=256,
    moe_intermediate_size=64,
    num_hidden_layers=len(LAYER_TYPES),
    num_attention_heads=4,
    num_key_value_heads=4,
    q_lora_rank=64,
    kv_lora_rank=32,
    qk_nope_head_dim=32,
    qk_rope_head_dim=0,
    v_head_dim=32,
    n_routed_experts=8,
    n_shared_experts=1,
    num_experts_per_tok=2,
    n_group=2,
    topk_group=1,
    routed_scaling_factor=2.5,
    norm_topk_prob=True,
    layer_types=LAYER_TYPES,
    indexer_types=["full", "full", "full", "full", "full", "shared"],
    mlp_layer_types=["dense", "dense", "sparse", "sparse", "sparse", "sparse"],
    index_topk=64,
    index_head_dim=32,
    index_n_heads=16,
    index_kpool=16,
    index_kpool_always_select_tail=True,
    linear_num_heads=2,
    linear_head_dim=32,
    linear_conv_kernel_dim=4,
    linear_lower_bound=-5.0,
    hc_mult=4,
    hc_eps=1e-6,
    hc_sinkhorn_iters=20,
    swiglu_limit=10.0,
    rms_norm_eps=1e-5,
    max_position_embeddings=32768,
    num_nextn_predict_layers=1,  # layer 6: the MTP layer (MLA with its own indexer + MoE)
)
VISION_SHAPE: dict[str, Any] = dict(
    depth=1,
    hidden_size=32,
    num_heads=2,
    intermediate_size=64,
    out_hidden_size=128,
    projection_intermediate_size=64,
    patch_size=14,
    spatial_merge_size=2,
    temporal_patch_size=2,
    in_channels=3,
)


def config_dict(vocab_size: int, ids: dict[str, int]) -> dict[str, Any]:
    """config.json with the keys `Glm5NextConfig(...).save_pretrained` writes (5.23.0)."""
    eos = [ids[t] for t in EOS]
    text = {
        **TEXT_SHAPE,
        "model_type": "glm5_next_text",
        "vocab_size": vocab_size,
        "attention_bias": False,
        "attention_dropout": 0.0,
        "hidden_act": "silu",
        "head_dim": 0,
        "initializer_range": 0.02,
        "output_router_logits": False,
        "router_aux_loss_coef": 0.001,
        "qk_head_dim": TEXT_SHAPE["qk_nope_head_dim"],
        "tie_word_embeddings": False,
        "use_cache": True,
        "bos_token_id": None,
        "eos_token_id": eos,
        "pad_token_id": ids[ENDOFTEXT],
    }
    vision = {
        **VISION_SHAPE,
        "model_type": "glm5_next_vision",
        "attention_bias": True,
        "attention_dropout": 0.0,
        "hidden_act": "silu",
        "image_size": 336,
        "initializer_range": 0.02,
        "rms_norm_eps": 1e-05,
        "swiglu_limit": 10.0,
        "rope_parameters": {"rope_theta": 10000.0, "rope_type": "axial"},
    }
    return {
        "architectures": ["Glm5NextForConditionalGeneration"],
        "model_type": "glm5_next",
        "transformers_version": "5.23.0",
        "dtype": "float32",
        "tie_word_embeddings": False,
        "text_config": text,
        "vision_config": vision,
        "image_token_id": ids["<|image|>"],
        "video_token_id": ids["<|video|>"],
        "image_start_token_id": ids["<|begin_of_image|>"],
        "image_end_token_id": ids["<|end_of_image|>"],
        "video_start_token_id": ids["<|begin_of_video|>"],
        "video_end_token_id": ids["<|end_of_video|>"],
    }


def preprocessor_dict() -> dict[str, Any]:
    """preprocessor_config.json as `Glm5NextImageProcessorPil(max_image_tokens=...)` saves it."""
    return {
        "max_image_tokens": MAX_IMAGE_TOKENS,
        "do_convert_rgb": True,
        "do_resize": True,
        "resample": 3,
        "do_rescale": True,
        "rescale_factor": 1 / 255,
        "do_normalize": True,
        "patch_size": VISION_SHAPE["patch_size"],
        "temporal_patch_size": VISION_SHAPE["temporal_patch_size"],
        "merge_size": VISION_SHAPE["spatial_merge_size"],
        "patch_expand_factor": 1,
        "min_image_tokens": 16,
        "size": {"longest_edge": 1},
        "image_mean": [0.48145466, 0.4578275, 0.40821073],
        "image_std": [0.26862954, 0.26130258, 0.27577711],
        "image_processor_type": "Glm5NextImageProcessor",
    }


def build_tokenizer() -> Tokenizer:
    """Byte-level BPE trained on CORPUS; specials take ids 0..17. Plain encoding starts with
    [gMASK]<sop>, as GLM's tokenizer does."""
    from tokenizers import processors

    tok = demo_build.train_byte_bpe(CORPUS, VOCAB_TARGET, SPECIAL_TOKENS)
    tok.post_processor = processors.TemplateProcessing(
        single=f"{GMASK} {SOP} $A",
        pair=f"{GMASK} {SOP} $A $B",
        special_tokens=[(GMASK, tok.token_to_id(GMASK)), (SOP, tok.token_to_id(SOP))],
    )
    return tok


def build_weights(cfg: dict[str, Any]) -> dict[str, Any]:
    """The shipped trained weights in float32, checked against `random_weights(cfg)`'s names and
    shapes and the tokenizer they were trained with."""
    return demo_build.load_trained(
        WEIGHTS, demo_build.shapes_of(random_weights(cfg)), build_tokenizer(), RETRAIN
    )


def write_demo(folder: Path) -> None:
    """Write every file of the demo checkpoint into an existing empty folder."""
    tok = build_tokenizer()
    ids = {t: tok.token_to_id(t) for t in SPECIAL_TOKENS}
    cfg = config_dict(tok.get_vocab_size(), ids)
    generation = {
        "_from_model_config": True,
        "eos_token_id": [ids[t] for t in EOS],
        "pad_token_id": ids[ENDOFTEXT],
        "output_attentions": False,
        "output_hidden_states": False,
        "transformers_version": "5.23.0",
        "use_cache": True,
    }
    tokenizer = demo_build.tokenizer_config(
        ENDOFTEXT,
        ENDOFTEXT,
        TEXT_SHAPE["max_position_embeddings"],
        do_lower_case=False,
        padding_side="left",
        additional_special_tokens=[t for t in SPECIAL_TOKENS if t != ENDOFTEXT],
    )
    (folder / "chat_template.jinja").write_text(CHAT_TEMPLATE, encoding="utf-8")
    demo_build.write_json(folder / "preprocessor_config.json", preprocessor_dict())
    demo_build.write_checkpoint(folder, tok, build_weights(cfg), cfg, generation, tokenizer)


def build_demo(cache_dir: Path) -> Path:
    """Return `cache_dir / DEMO_NAME`, built first (atomically) unless a complete one is there."""
    return demo_build.build_atomically(cache_dir, DEMO_NAME, FILES, write_demo)
