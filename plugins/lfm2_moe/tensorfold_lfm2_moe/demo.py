"""A small deterministic LFM2-MoE checkpoint, built locally (no download, no transformers).

`build_demo(cache_dir)` writes `cache_dir / "lfm2_moe-demo-v2"` as transformers 5.23.0 would save
an `Lfm2MoeForCausalLM`: config.json, generation_config.json, model.safetensors with the on-disk
names of real checkpoints (per-expert w1/w2/w3, no lm_head), and a byte-level BPE tokenizer with
LFM2's ChatML special tokens. Same bytes on every build.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from tensorfold.demo_build import build_atomically, train_byte_bpe, write_json

from .demo_template import CHAT_TEMPLATE

if TYPE_CHECKING:
    import torch
    from tokenizers import Tokenizer

DEMO_NAME = "lfm2_moe-demo-v2"
FILES = (
    "config.json", "generation_config.json", "model.safetensors", "tokenizer.json",
    "tokenizer_config.json",
)
SEED = 20250101

SPECIAL_TOKENS = ("<|pad|>", "<|startoftext|>", "<|endoftext|>", "<|im_start|>", "<|im_end|>")
PAD, BOS, EOS = "<|pad|>", "<|startoftext|>", "<|im_end|>"
VOCAB_TARGET = 768

LAYER_TYPES = ["conv", "conv", "full_attention", "conv", "conv", "full_attention"]
SHAPE: dict[str, Any] = dict(
    hidden_size=128, intermediate_size=256, moe_intermediate_size=64,
    num_hidden_layers=len(LAYER_TYPES), num_attention_heads=4, num_key_value_heads=2,
    num_dense_layers=2, num_experts=8, num_experts_per_tok=2, conv_L_cache=3,
    max_position_embeddings=32768,
)


CORPUS = """\
The little engine woke before dawn and listened to the rain on the roof of the station. It had
carried coal and letters and children across the valley for many years, and it knew every bridge
by the sound its wheels made. When the signal turned green, it gave a short whistle and rolled out
into the grey light. A language model reads text one token at a time. Each token looks back at the
tokens before it, and the model keeps what it has seen in a cache, so that the next word can be
computed without reading the whole story again. When many people talk to the same server, their
caches share one pool of memory pages.
In the spring the river rises, and the farmers along its banks move their sheep to the higher
fields.
The water is cold and fast, brown with soil from the mountains. By summer it is clear again, and
the children swim in the slow pools below the old mill, where the trout hide under the stones.
Good software is easy to read and easy to change. Small functions with clear names, tests that run
in seconds, and a short note where the code cannot explain itself: these are worth more than
clever tricks.
When something breaks, a good test tells you where, and a good log line tells you why.
She opened the window and looked at the garden. The roses were red and white, the apple tree was
full of birds, and the cat was asleep on the warm wall. "What a beautiful morning," she said, and
went down to make tea. Her brother was already in the kitchen, reading the newspaper and eating
bread with honey.
How many tokens can a model remember? The answer depends on the size of its window and on the
memory of the machine. A short conversation needs only a few pages; a long document may need
thousands. The server plans its memory at start, and it refuses a request it cannot serve instead
of failing halfway through.
Questions and answers: What is the capital of France? Paris is the capital of France. What color
is the sky? The sky is blue on a clear day. How many days are in a week? There are seven days in a
week.
Can you help me write a letter? Yes, of course. Tell me who the letter is for and what you want to
say.
Numbers: one, two, three, four, five, six, seven, eight, nine, ten. 0 1 2 3 4 5 6 7 8 9 10 100
1000 2025.
"""


def config_dict(vocab_size: int, ids: dict[str, int]) -> dict[str, Any]:
    """config.json with the keys and values `Lfm2MoeConfig(...).save_pretrained` writes (5.23.0)."""
    return {
        "architectures": ["Lfm2MoeForCausalLM"], "model_type": "lfm2_moe",
        "transformers_version": "5.23.0",
        **SHAPE, "vocab_size": vocab_size, "layer_types": LAYER_TYPES,
        "bos_token_id": ids[BOS], "eos_token_id": ids[EOS], "pad_token_id": ids[PAD],
        "conv_bias": False, "dtype": "float32", "initializer_range": 0.1, "norm_eps": 1e-05,
        "norm_topk_prob": True, "output_router_logits": False, "routed_scaling_factor": 1.0,
        "rope_parameters": {"rope_theta": 1000000.0, "rope_type": "default"},
        "tie_word_embeddings": True, "use_cache": True, "use_expert_bias": True,
    }


def build_tokenizer() -> Tokenizer:
    """Byte-level BPE trained on CORPUS; specials take ids 0..4."""
    from tokenizers import processors

    tok = train_byte_bpe(CORPUS, VOCAB_TARGET, SPECIAL_TOKENS)
    # Like LFM2's own tokenizer: plain encoding starts with <|startoftext|>.
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B", special_tokens=[(BOS, tok.token_to_id(BOS))]
    )
    return tok


def build_weights(cfg: dict[str, Any]) -> dict[str, torch.Tensor]:
    """Every tensor under its on-disk name, drawn in a fixed order from a local generator."""
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
        return {f"{prefix}.w1.weight": normal(width, h), f"{prefix}.w3.weight": normal(width, h),
                f"{prefix}.w2.weight": normal(h, width)}

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
    from safetensors.torch import save_file

    tok = build_tokenizer()
    tok.save(str(folder / "tokenizer.json"))
    ids = {t: tok.token_to_id(t) for t in SPECIAL_TOKENS}
    cfg = config_dict(tok.get_vocab_size(), ids)
    write_json(folder / "config.json", cfg)
    write_json(folder / "generation_config.json", {
        "_from_model_config": True, "bos_token_id": ids[BOS], "eos_token_id": ids[EOS],
        "pad_token_id": ids[PAD], "output_attentions": False, "output_hidden_states": False,
        "transformers_version": "5.23.0", "use_cache": True,
    })
    write_json(folder / "tokenizer_config.json", {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": BOS, "eos_token": EOS, "pad_token": PAD,
        "add_bos_token": True, "add_eos_token": False, "clean_up_tokenization_spaces": False,
        "model_max_length": SHAPE["max_position_embeddings"], "chat_template": CHAT_TEMPLATE,
    })
    save_file(build_weights(cfg), str(folder / "model.safetensors"), metadata={"format": "pt"})



def build_demo(cache_dir: Path) -> Path:
    """Return `cache_dir / DEMO_NAME`, built first (atomically) unless a complete one is there."""
    return build_atomically(cache_dir, DEMO_NAME, FILES, write_demo)
