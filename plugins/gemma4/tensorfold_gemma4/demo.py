"""A small Gemma 4 checkpoint that writes words, built locally (no download, no transformers).

`build_demo(cache_dir)` writes `cache_dir / DEMO_NAME` as transformers 5.23.0 saves a
text-only `Gemma4ForConditionalGeneration` (no vision or audio tower): config.json with the text
model under `text_config`, generation_config.json, model.safetensors with the on-disk names of real
checkpoints (`model.language_model.*`, fused experts, no lm_head), and a byte-level BPE tokenizer
with Gemma's special tokens and a Gemma-style chat template (`<start_of_turn>user ...
<end_of_turn>`), learnt from tensorfold.family.demo_text. Its six layers cover the family: sliding
(window 128) and full layers, k_eq_v, the dense GeGLU beside 8 experts, per-layer embeddings, and
two KV-sharing layers with the double-wide MLP. Same bytes on every build.

The weights ship with the plugin (demo_weights.safetensors, float16): trained on
tensorfold.family.demo_text from `random_weights` by `python -m tensorfold_gemma4.demo_train` (needs
transformers). The demo knows a few stories, facts and answers, nothing else.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from tensorfold.family import demo_build
from tensorfold.family.demo_text import plain_text

from .demo_template import CHAT_TEMPLATE

if TYPE_CHECKING:
    import torch
    from tokenizers import Tokenizer

DEMO_NAME = "gemma4-demo-v4"
WEIGHTS = Path(__file__).with_name("demo_weights.safetensors")
RETRAIN = "python -m tensorfold_gemma4.demo_train"
FILES = (
    "config.json",
    "generation_config.json",
    "model.safetensors",
    "tokenizer.json",
    "tokenizer_config.json",
)
SEED = 20260401

# Gemma's own ids for the first four (pad 0, eos 1, bos 2, unk 3).
SPECIAL_TOKENS = (
    "<pad>",
    "<eos>",
    "<bos>",
    "<unk>",
    "<start_of_turn>",
    "<end_of_turn>",
    "<start_of_image>",
    "<end_of_image>",
    "<image_soft_token>",
    "<video_soft_token>",
    "<audio_soft_token>",
    "<start_of_audio>",
    "<end_of_audio>",
    "<|think|>",
    "<|channel>",
    "<channel|>",
)
PAD, EOS, BOS, END_OF_TURN = "<pad>", "<eos>", "<bos>", "<end_of_turn>"
VOCAB_TARGET = 1024

SLIDING, FULL = "sliding_attention", "full_attention"
LAYER_TYPES = [SLIDING, SLIDING, FULL, SLIDING, SLIDING, FULL]
TEXT: dict[str, Any] = dict(
    hidden_size=128,
    intermediate_size=256,
    num_hidden_layers=len(LAYER_TYPES),
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=32,
    sliding_window=128,
    enable_moe_block=True,
    num_experts=8,
    top_k_experts=2,
    moe_intermediate_size=64,
    hidden_size_per_layer_input=16,
    num_kv_shared_layers=2,
    use_double_wide_mlp=True,
    attention_k_eq_v=True,
    final_logit_softcapping=30.0,
    max_position_embeddings=32768,
)
GLOBAL_HEAD_DIM, GLOBAL_KV_HEADS = 64, 1  # the full layers' per_layer_config


# The tokenizer learns the demo's text (tensorfold.family.demo_text) and a line of digits and symbols.
CORPUS = plain_text() + (
    "7 8 9 11 12 13 20 30 64 512 2026. Symbols: + - * / = ( ) [ ] { } < > , . ; : ! ? \" ' #\n"
)


def config_dict(vocab_size: int, ids: dict[str, int]) -> dict[str, Any]:
    """config.json as `Gemma4ForConditionalGeneration.save_pretrained` writes it (5.23.0)."""
    per_layer = {
        str(i): {"head_dim": GLOBAL_HEAD_DIM, "num_key_value_heads": GLOBAL_KV_HEADS}
        for i, kind in enumerate(LAYER_TYPES)
        if kind == FULL
    }
    text = {
        **TEXT,
        "attention_bias": False,
        "attention_dropout": 0.0,
        "bos_token_id": ids[BOS],
        "eos_token_id": ids[EOS],
        "pad_token_id": ids[PAD],
        "hidden_activation": "gelu_pytorch_tanh",
        "initializer_range": 0.02,
        "layer_types": LAYER_TYPES,
        "model_type": "gemma4_text",
        "per_layer_config": per_layer,
        "rms_norm_eps": 1e-06,
        "rope_parameters": {
            FULL: {
                "partial_rotary_factor": 0.25,
                "rope_theta": 1000000.0,
                "rope_type": "proportional",
            },
            SLIDING: {"rope_theta": 10000.0, "rope_type": "default"},
        },
        "tie_word_embeddings": True,
        "use_bidirectional_attention": None,
        "use_cache": True,
        "vocab_size": vocab_size,
        "vocab_size_per_layer_input": vocab_size,
    }
    return {
        "architectures": ["Gemma4ForConditionalGeneration"],
        "audio_config": None,
        "audio_token_id": ids["<audio_soft_token>"],
        "boa_token_id": ids["<start_of_audio>"],
        "boi_token_id": ids["<start_of_image>"],
        "dtype": "float32",
        "eoa_token_index": ids["<end_of_audio>"],
        "eoi_token_id": ids["<end_of_image>"],
        "image_token_id": ids["<image_soft_token>"],
        "initializer_range": 0.02,
        "model_type": "gemma4",
        "text_config": text,
        "tie_word_embeddings": True,
        "transformers_version": "5.23.0",
        "video_token_id": ids["<video_soft_token>"],
        "vision_config": None,
    }


def build_tokenizer() -> Tokenizer:
    """Byte-level BPE trained on CORPUS; the specials take ids 0..15. Like Gemma's own tokenizer,
    plain encoding starts with <bos>."""
    return demo_build.with_bos(demo_build.train_byte_bpe(CORPUS, VOCAB_TARGET, SPECIAL_TOKENS), BOS)


def build_weights(cfg: dict[str, Any]) -> dict[str, torch.Tensor]:
    """The shipped trained weights in float32, checked against `random_weights(cfg)`'s names and
    shapes and the tokenizer they were trained with."""
    return demo_build.load_trained(
        WEIGHTS, demo_build.shapes_of(random_weights(cfg)), build_tokenizer(), RETRAIN
    )


def random_weights(cfg: dict[str, Any]) -> dict[str, torch.Tensor]:
    """Every tensor under its on-disk name, drawn in a fixed order from a local generator (where
    the demo's training starts)."""
    import torch

    gen = torch.Generator().manual_seed(SEED)
    t = cfg["text_config"]
    h, v, n = t["hidden_size"], t["vocab_size"], t["num_hidden_layers"]
    ple, heads = t["hidden_size_per_layer_input"], t["num_attention_heads"]
    experts, moe = t["num_experts"], t["moe_intermediate_size"]
    first_reuse = n - t["num_kv_shared_layers"]

    def normal(*shape: int, std: float = 0.1) -> torch.Tensor:
        return torch.randn(shape, generator=gen, dtype=torch.float32) * std

    def near_one(*shape: int) -> torch.Tensor:
        return 1.0 + normal(*shape, std=0.1)

    p = "model.language_model"
    w: dict[str, torch.Tensor] = {
        f"{p}.embed_tokens.weight": normal(v, h),
        f"{p}.embed_tokens_per_layer.weight": normal(v, n * ple),
        f"{p}.per_layer_model_projection.weight": normal(n * ple, h),
        f"{p}.per_layer_projection_norm.weight": near_one(ple),
    }
    for i, kind in enumerate(t["layer_types"]):
        full = kind == FULL
        d = GLOBAL_HEAD_DIM if full else t["head_dim"]
        kv = (GLOBAL_KV_HEADS if full else t["num_key_value_heads"]) * d
        width = t["intermediate_size"] * (2 if i >= first_reuse else 1)
        a, m, pl = f"{p}.layers.{i}.self_attn", f"{p}.layers.{i}.mlp", f"{p}.layers.{i}"
        w[f"{a}.q_proj.weight"] = normal(heads * d, h)
        w[f"{a}.q_norm.weight"] = near_one(d)
        if i < first_reuse:
            w[f"{a}.k_proj.weight"] = normal(kv, h)
            w[f"{a}.k_norm.weight"] = near_one(d)
            if not full:  # full layers share k_proj for V (attention_k_eq_v)
                w[f"{a}.v_proj.weight"] = normal(kv, h)
        w[f"{a}.o_proj.weight"] = normal(h, heads * d)
        w[f"{m}.gate_proj.weight"] = normal(width, h)
        w[f"{m}.up_proj.weight"] = normal(width, h)
        w[f"{m}.down_proj.weight"] = normal(h, width)
        w[f"{pl}.router.proj.weight"] = normal(experts, h, std=1.0)  # decisive routes
        w[f"{pl}.router.scale"] = near_one(h)
        w[f"{pl}.router.per_expert_scale"] = near_one(experts)
        w[f"{pl}.experts.gate_up_proj"] = normal(experts, 2 * moe, h)
        w[f"{pl}.experts.down_proj"] = normal(experts, h, moe)
        w[f"{pl}.per_layer_input_gate.weight"] = normal(ple, h)
        w[f"{pl}.per_layer_projection.weight"] = normal(h, ple)
        for norm in (
            "input_layernorm",
            "post_attention_layernorm",
            "pre_feedforward_layernorm",
            "post_feedforward_layernorm",
            "post_feedforward_layernorm_1",
            "post_feedforward_layernorm_2",
            "pre_feedforward_layernorm_2",
            "post_per_layer_input_norm",
        ):
            w[f"{pl}.{norm}.weight"] = near_one(h)
        w[f"{pl}.layer_scalar"] = 0.8 + normal(1, std=0.05)
    w[f"{p}.norm.weight"] = near_one(h)
    return w


def write_demo(folder: Path) -> None:
    """Write every file of the demo checkpoint into an existing empty folder."""
    tok = build_tokenizer()
    ids = {t: tok.token_to_id(t) for t in SPECIAL_TOKENS}
    cfg = config_dict(tok.get_vocab_size(), ids)
    generation = {
        "bos_token_id": ids[BOS],
        "eos_token_id": [ids[EOS], ids[END_OF_TURN]],
        "pad_token_id": ids[PAD],
        "transformers_version": "5.23.0",
    }
    tokenizer = demo_build.tokenizer_config(
        EOS,
        PAD,
        TEXT["max_position_embeddings"],
        bos=BOS,
        unk_token="<unk>",
        chat_template=CHAT_TEMPLATE,
    )
    demo_build.write_checkpoint(folder, tok, build_weights(cfg), cfg, generation, tokenizer)


def build_demo(cache_dir: Path) -> Path:
    """Return `cache_dir / DEMO_NAME`, built first (atomically) unless a complete one is there."""
    return demo_build.build_atomically(cache_dir, DEMO_NAME, FILES, write_demo)
