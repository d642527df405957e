"""A tiny Gemma 4 checkpoint that takes images, for tests and end-to-end runs on a CPU.

`write_vision_demo(folder)` writes the demo checkpoint (demo.py: its trained text weights, its
tokenizer and chat template) with a random vision tower beside it, as transformers 5.23.0 saves
a `Gemma4ForConditionalGeneration` with a `vision_config`:
- config.json: the demo's, with a small `vision_config` (patch 16, 3 x 3 pooling), the text
  config's `use_bidirectional_attention: "vision"`, and the image token ids;
- model.safetensors: the demo's text weights and `model.vision_tower.*`, `model.embed_vision.*`
  drawn from a fixed seed (the tower is untrained: its images mean nothing to the text model);
- tokenizer.json: the demo's, with its three image specials named as Gemma 4's tokenizer names
  them (`<|image>`, `<|image|>`, `<image|>`: the same ids, so the trained weights still fit);
- the chat template renders a message's `{"type": "image"}` items as `<|image|>`;
- preprocessor_config.json: Gemma4ImageProcessor's settings at `max_soft_tokens` (70: an image
  fills at most 70 rows).
With `audio=True` it also has a random audio tower (audio_demo.py: `audio_config`,
`model.audio_tower.*`, `model.embed_audio.*`), the audio specials named as Gemma 4 names them
(`<|audio>`, `<|audio|>`, `<audio|>`), and the template renders `{"type": "audio"}` items as
`<|audio|>`; the feature extractor's defaults apply (no processor_config.json).
`tensorfold serve --family gemma4 --model DIR` serves it. Same bytes on every build.
`python -m tensorfold_gemma4.vision_demo DIR [--audio]` writes one.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tensorfold.family import demo_build

from . import demo
from .audio_demo import AUDIO_TOKENS, audio_config, audio_weights
from .demo_template import CHAT_TEMPLATE

if TYPE_CHECKING:
    import torch

SEED = 20261206
# the demo tokenizer's names -> Gemma 4's (boi, the image token, eoi)
IMAGE_TOKENS = {
    "<start_of_image>": "<|image>",
    "<image_soft_token>": "<|image|>",
    "<end_of_image>": "<image|>",
}
VISION: dict[str, Any] = dict(
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=2,
    num_key_value_heads=2,
    head_dim=16,
    patch_size=16,
    pooling_kernel_size=3,
    position_embedding_size=256,  # past the longest side's 210 patches at 70 soft tokens
    standardize=True,
    use_clipped_linears=False,
)
# a message's content as text, or as a list of items: text items trimmed, images as the token
CONTENT = (
    "{%- macro content(value) -%}"
    "{%- if value is string -%}{{- value | trim -}}"
    "{%- else -%}{%- for item in value or [] -%}"
    "{%- if item['type'] in ('image', 'image_url') -%}{{- '<|image|>' -}}"
    "{%- elif item['type'] == 'audio' -%}{{- '<|audio|>' -}}"
    "{%- elif item['type'] == 'text' -%}{{- item['text'] | trim -}}"
    "{%- endif -%}{%- endfor -%}{%- endif -%}"
    "{%- endmacro -%}"
)
USER_CONTENT = "{{- (message.get('content') or '') | trim -}}"
VISION_TEMPLATE = CONTENT + CHAT_TEMPLATE.replace(
    USER_CONTENT, "{{- content(message['content']) -}}"
)


def vision_config() -> dict[str, Any]:
    """config.json's vision_config, as Gemma4VisionConfig writes it."""
    return {
        **VISION,
        "model_type": "gemma4_vision",
        "hidden_activation": "gelu_pytorch_tanh",
        "rms_norm_eps": 1e-06,
        "attention_bias": False,
        "attention_dropout": 0.0,
        "initializer_range": 0.02,
        "max_position_embeddings": 131072,
        "rope_parameters": {"rope_type": "axial", "rope_theta": 100.0},
    }


def preprocessor_config(max_soft_tokens: int) -> dict[str, Any]:
    """preprocessor_config.json as Gemma4ImageProcessor's defaults, at `max_soft_tokens`."""
    return {
        "image_processor_type": "Gemma4ImageProcessor",
        "processor_class": "Gemma4Processor",
        "patch_size": VISION["patch_size"],
        "pooling_kernel_size": VISION["pooling_kernel_size"],
        "max_soft_tokens": max_soft_tokens,
        "do_convert_rgb": True,
        "do_resize": True,
        "resample": 3,
        "do_rescale": True,
        "rescale_factor": 1 / 255,
        "do_normalize": False,
        "image_mean": [0.0, 0.0, 0.0],
        "image_std": [1.0, 1.0, 1.0],
    }


def vision_weights(text_hidden: int) -> dict[str, "torch.Tensor"]:
    """The tower's and its embedder's tensors under their on-disk names, from a fixed seed."""
    import torch

    gen = torch.Generator().manual_seed(SEED)
    hv, d, inner = VISION["hidden_size"], VISION["head_dim"], VISION["intermediate_size"]
    q, kv = VISION["num_attention_heads"] * d, VISION["num_key_value_heads"] * d
    width = 3 * VISION["patch_size"] ** 2

    def normal(*shape: int, std: float = 0.1) -> torch.Tensor:
        return torch.randn(shape, generator=gen, dtype=torch.float32) * std

    def near_one(*shape: int) -> torch.Tensor:
        return 1.0 + normal(*shape, std=0.1)

    t = "model.vision_tower"
    w = {
        f"{t}.patch_embedder.input_proj.weight": normal(hv, width, std=0.05),
        f"{t}.patch_embedder.position_embedding_table": normal(
            2, VISION["position_embedding_size"], hv
        ),
    }
    for i in range(VISION["num_hidden_layers"]):
        p = f"{t}.encoder.layers.{i}"
        for name, shape in (
            ("self_attn.q_proj", (q, hv)),
            ("self_attn.k_proj", (kv, hv)),
            ("self_attn.v_proj", (kv, hv)),
            ("self_attn.o_proj", (hv, q)),
            ("mlp.gate_proj", (inner, hv)),
            ("mlp.up_proj", (inner, hv)),
            ("mlp.down_proj", (hv, inner)),
        ):
            w[f"{p}.{name}.linear.weight"] = normal(*shape)
        w[f"{p}.self_attn.q_norm.weight"] = near_one(d)
        w[f"{p}.self_attn.k_norm.weight"] = near_one(d)
        for norm in (
            "input_layernorm",
            "post_attention_layernorm",
            "pre_feedforward_layernorm",
            "post_feedforward_layernorm",
        ):
            w[f"{p}.{norm}.weight"] = near_one(hv)
    w[f"{t}.std_bias"] = normal(hv)
    w[f"{t}.std_scale"] = near_one(hv)
    w["model.embed_vision.embedding_projection.weight"] = normal(text_hidden, hv)
    return w


def write_vision_demo(folder: Path, max_soft_tokens: int = 70, audio: bool = False) -> Path:
    """Write the image-taking demo checkpoint into `folder` (made if missing), with an audio
    tower when `audio`; returns it."""
    from tokenizers import Tokenizer

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    tok = demo.build_tokenizer()
    ids = {t: tok.token_to_id(t) for t in demo.SPECIAL_TOKENS}
    cfg = demo.config_dict(tok.get_vocab_size(), ids)
    weights = demo.build_weights(cfg)  # checked against the tokenizer they were trained with
    text_hidden = cfg["text_config"]["hidden_size"]
    cfg["text_config"]["use_bidirectional_attention"] = "vision"
    cfg["vision_config"] = vision_config()
    weights.update(vision_weights(text_hidden))
    names = dict(IMAGE_TOKENS)
    if audio:
        cfg["audio_config"] = audio_config()
        weights.update(audio_weights(text_hidden))
        names.update(AUDIO_TOKENS)
    renamed = json.loads(tok.to_str())
    for added in renamed["added_tokens"]:
        added["content"] = names.get(added["content"], added["content"])
    vocab = renamed["model"]["vocab"]
    renamed["model"]["vocab"] = {names.get(k, k): v for k, v in vocab.items()}
    generation = {
        "bos_token_id": ids[demo.BOS],
        "eos_token_id": [ids[demo.EOS], ids[demo.END_OF_TURN]],
        "pad_token_id": ids[demo.PAD],
        "transformers_version": "5.23.0",
    }
    tokenizer = demo_build.tokenizer_config(
        demo.EOS,
        demo.PAD,
        demo.TEXT["max_position_embeddings"],
        bos=demo.BOS,
        unk_token="<unk>",
        chat_template=VISION_TEMPLATE,
    )
    demo_build.write_checkpoint(
        folder, Tokenizer.from_str(json.dumps(renamed)), weights, cfg, generation, tokenizer
    )
    demo_build.write_json(folder / "preprocessor_config.json", preprocessor_config(max_soft_tokens))
    return folder


if __name__ == "__main__":  # pragma: no cover - a tool
    if len(sys.argv) not in (2, 3) or sys.argv[2:] not in ([], ["--audio"]):
        sys.exit("usage: python -m tensorfold_gemma4.vision_demo DIR [--audio]")
    print(write_vision_demo(Path(sys.argv[1]), audio=sys.argv[2:] == ["--audio"]))
