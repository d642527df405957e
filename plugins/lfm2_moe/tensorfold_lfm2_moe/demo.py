"""A small LFM2-MoE checkpoint that writes words, built locally (no download, no transformers).

`build_demo(cache_dir)` writes `cache_dir / DEMO_NAME` as transformers 5.23.0 would save an
`Lfm2MoeForCausalLM`: config.json, generation_config.json, model.safetensors with the on-disk
names of real checkpoints (per-expert w1/w2/w3, no lm_head), and a byte-level BPE tokenizer with
LFM2's ChatML special tokens, learnt from tensorfold.family.demo_text. Same bytes on every build.

The weights ship with the plugin (demo_weights.safetensors, float16, about 3 MB): trained on
tensorfold.family.demo_text by `python -m tensorfold_lfm2_moe.demo_train` (needs transformers), which
starts from `random_weights` and is deterministic on the CPU. The demo knows a few stories,
facts and answers; it is a smoke test that writes words, not a useful model.
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

DEMO_NAME = "lfm2_moe-demo-v4"
WEIGHTS = Path(__file__).with_name("demo_weights.safetensors")
RETRAIN = "python -m tensorfold_lfm2_moe.demo_train"
FILES = (
    "config.json",
    "generation_config.json",
    "model.safetensors",
    "tokenizer.json",
    "tokenizer_config.json",
)
SEED = 20250101

SPECIAL_TOKENS = (
    "<|pad|>",
    "<|startoftext|>",
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<think>",
    "</think>",
)
PAD, BOS, EOS = "<|pad|>", "<|startoftext|>", "<|im_end|>"
VOCAB_TARGET = 1024

LAYER_TYPES = ["conv", "conv", "full_attention", "conv", "conv", "full_attention"]
SHAPE: dict[str, Any] = dict(
    hidden_size=128,
    intermediate_size=256,
    moe_intermediate_size=64,
    num_hidden_layers=len(LAYER_TYPES),
    num_attention_heads=4,
    num_key_value_heads=2,
    num_dense_layers=2,
    num_experts=8,
    num_experts_per_tok=2,
    conv_L_cache=3,
    max_position_embeddings=32768,
)


# The tokenizer learns the demo's text (tensorfold.family.demo_text) and a line of digits and symbols.
CORPUS = plain_text() + (
    "0 1 2 3 4 5 6 7 8 9 10 100 1000 2025. Symbols: + - * / = ( ) [ ] { } < > , . ; : ! ? \" ' #\n"
)


def config_dict(vocab_size: int, ids: dict[str, int]) -> dict[str, Any]:
    """config.json with the keys and values `Lfm2MoeConfig(...).save_pretrained` writes (5.23.0)."""
    return {
        "architectures": ["Lfm2MoeForCausalLM"],
        "model_type": "lfm2_moe",
        "transformers_version": "5.23.0",
        **SHAPE,
        "vocab_size": vocab_size,
        "layer_types": LAYER_TYPES,
        "bos_token_id": ids[BOS],
        "eos_token_id": ids[EOS],
        "pad_token_id": ids[PAD],
        "conv_bias": False,
        "dtype": "float32",
        "initializer_range": 0.1,
        "norm_eps": 1e-05,
        "norm_topk_prob": True,
        "output_router_logits": False,
        "routed_scaling_factor": 1.0,
        "rope_parameters": {"rope_theta": 1000000.0, "rope_type": "default"},
        "tie_word_embeddings": True,
        "use_cache": True,
        "use_expert_bias": True,
    }


def build_tokenizer() -> Tokenizer:
    """Byte-level BPE trained on CORPUS; specials take ids 0..6. Like LFM2's own tokenizer, plain
    encoding starts with <|startoftext|>."""
    return demo_build.with_bos(demo_build.train_byte_bpe(CORPUS, VOCAB_TARGET, SPECIAL_TOKENS), BOS)


def build_weights(cfg: dict[str, Any]) -> dict[str, torch.Tensor]:
    """The shipped trained weights in float32, checked against `random_weights(cfg)`'s names and
    shapes and the tokenizer they were trained with."""
    return demo_build.load_trained(
        WEIGHTS, demo_build.shapes_of(random_weights(cfg)), build_tokenizer(), RETRAIN
    )


def random_weights(cfg: dict[str, Any]) -> dict[str, torch.Tensor]:
    """Every tensor under its on-disk name, drawn in a fixed order from a local generator (the
    start of the demo's training)."""
    import torch

    gen = torch.Generator().manual_seed(SEED)
    h, inter, moe = cfg["hidden_size"], cfg["intermediate_size"], cfg["moe_intermediate_size"]
    head_dim = h // cfg["num_attention_heads"]
    kv = cfg["num_key_value_heads"] * head_dim

    def normal(*shape: int, std: float = 0.1) -> torch.Tensor:
        return torch.randn(shape, generator=gen, dtype=torch.float32) * std

    def norm(n: int) -> torch.Tensor:
        return 1.0 + normal(n, std=0.1)

    def ffn(prefix: str, width: int) -> dict[str, torch.Tensor]:
        return {
            f"{prefix}.w1.weight": normal(width, h),
            f"{prefix}.w3.weight": normal(width, h),
            f"{prefix}.w2.weight": normal(h, width),
        }

    w: dict[str, torch.Tensor] = {"model.embed_tokens.weight": normal(cfg["vocab_size"], h)}
    for i, kind in enumerate(cfg["layer_types"]):
        p = f"model.layers.{i}"
        w[f"{p}.operator_norm.weight"] = norm(h)
        w[f"{p}.ffn_norm.weight"] = norm(h)
        if kind == "conv":
            w[f"{p}.conv.in_proj.weight"] = normal(3 * h, h)
            w[f"{p}.conv.conv.weight"] = normal(h, 1, cfg["conv_L_cache"])
            w[f"{p}.conv.out_proj.weight"] = normal(h, h)
        else:
            w[f"{p}.self_attn.q_proj.weight"] = normal(h, h)
            w[f"{p}.self_attn.k_proj.weight"] = normal(kv, h)
            w[f"{p}.self_attn.v_proj.weight"] = normal(kv, h)
            w[f"{p}.self_attn.out_proj.weight"] = normal(h, h)
            w[f"{p}.self_attn.q_layernorm.weight"] = norm(head_dim)
            w[f"{p}.self_attn.k_layernorm.weight"] = norm(head_dim)
        if i < cfg["num_dense_layers"]:
            w.update(ffn(f"{p}.feed_forward", inter))
        else:
            w[f"{p}.feed_forward.gate.weight"] = normal(cfg["num_experts"], h)
            w[f"{p}.feed_forward.expert_bias"] = normal(cfg["num_experts"])
            for e in range(cfg["num_experts"]):
                w.update(ffn(f"{p}.feed_forward.experts.{e}", moe))
    w["model.embedding_norm.weight"] = norm(h)
    return w


def write_demo(folder: Path) -> None:
    """Write every file of the demo checkpoint into an existing empty folder."""
    tok = build_tokenizer()
    ids = {t: tok.token_to_id(t) for t in SPECIAL_TOKENS}
    cfg = config_dict(tok.get_vocab_size(), ids)
    generation = {
        "_from_model_config": True,
        "bos_token_id": ids[BOS],
        "eos_token_id": ids[EOS],
        "pad_token_id": ids[PAD],
        "output_attentions": False,
        "output_hidden_states": False,
        "transformers_version": "5.23.0",
        "use_cache": True,
    }
    tokenizer = demo_build.tokenizer_config(
        EOS, PAD, SHAPE["max_position_embeddings"], bos=BOS, chat_template=CHAT_TEMPLATE
    )
    demo_build.write_checkpoint(folder, tok, build_weights(cfg), cfg, generation, tokenizer)


def build_demo(cache_dir: Path) -> Path:
    """Return `cache_dir / DEMO_NAME`, built first (atomically) unless a complete one is there."""
    return demo_build.build_atomically(cache_dir, DEMO_NAME, FILES, write_demo)
