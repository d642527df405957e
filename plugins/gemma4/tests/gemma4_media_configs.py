"""What the media tests' tiny Gemma 4 checkpoints share (transformers 5.23.0's Gemma4Config):
the two-layer text config each starts from, and the special tokens' ids inside its 256-token
vocabulary."""

from __future__ import annotations

from typing import Any

TINY_TEXT: dict[str, Any] = dict(
    vocab_size=256,
    vocab_size_per_layer_input=256,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    global_head_dim=32,
    sliding_window=8,
    layer_types=["sliding_attention", "full_attention"],
    hidden_size_per_layer_input=0,
)
MEDIA_IDS = dict(
    image_token_id=250,
    video_token_id=251,
    audio_token_id=252,
    boi_token_id=253,
    eoi_token_id=254,
    boa_token_id=255,
    eoa_token_index=249,
)
