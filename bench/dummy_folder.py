"""A checkpoint folder with no weights for `--load-format dummy`: a config.json at one of
tensorfold_lfm2_moe.dummy.SHAPES (LFM2-8B-A1B or LFM2-24B-A2B, from their model cards) and the
demo's tokenizer files (ids past its vocabulary decode to nothing; the bench compares token ids).
python bench/dummy_folder.py OUT_DIR [SHAPE] [--tokenizer DIR]   (default LFM2-8B-A1B)

SHAPE `demo` keeps the demo's small shape (a CPU smoke test of a benchmark), its vocabulary the
tokenizer's. --tokenizer DIR takes tokenizer.json from DIR (e.g.
bench/experiments/big_tokenizer.py's, at LFM2's 65536 tokens) instead of the demo's 1024-token
one; the chat template stays the demo's. bench/serve_dummy.sh and llama.cpp's peer run
(docs/performance.md) serve from such a folder."""

import json
import shutil
import sys
import tempfile
from pathlib import Path

from tensorfold_lfm2_moe.demo import build_demo
from tensorfold_lfm2_moe.dummy import SHAPES


def main(out: Path, shape: str = "LFM2-8B-A1B", tokenizer: Path | None = None) -> None:
    demo = build_demo(Path(tempfile.mkdtemp()))
    out.mkdir(parents=True, exist_ok=True)
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        source = tokenizer if tokenizer is not None and name == "tokenizer.json" else demo
        if (source / name).resolve() != (out / name).resolve():
            shutil.copy(source / name, out / name)
    config = json.loads((demo / "config.json").read_text())
    if shape == "demo":
        vocab = json.loads((out / "tokenizer.json").read_text())["model"]["vocab"]
        config.update(vocab_size=max(config["vocab_size"], len(vocab)), dtype="float32")
    else:
        cfg = SHAPES[shape]
        config.update(
            vocab_size=cfg.vocab_size,
            hidden_size=cfg.hidden_size,
            intermediate_size=cfg.intermediate_size,
            moe_intermediate_size=cfg.moe_intermediate_size,
            num_hidden_layers=cfg.num_hidden_layers,
            num_attention_heads=cfg.num_attention_heads,
            num_key_value_heads=cfg.num_key_value_heads,
            layer_types=list(cfg.layer_types),
            num_dense_layers=cfg.num_dense_layers,
            num_experts=cfg.num_experts,
            num_experts_per_tok=cfg.num_experts_per_tok,
            max_position_embeddings=32768,
            routed_scaling_factor=cfg.routed_scaling_factor,
            dtype="bfloat16",
        )
    (out / "config.json").write_text(json.dumps(config, indent=2))


if __name__ == "__main__":
    args = sys.argv[1:]
    tok = None
    if "--tokenizer" in args:
        i = args.index("--tokenizer")
        tok = Path(args[i + 1])
        del args[i : i + 2]
    main(Path(args[0]), *args[1:2], tokenizer=tok)
