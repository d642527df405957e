"""The lfm2_moe demo checkpoint: deterministic, atomic, and loadable by transformers 5.23.0."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from tensorfold import conformance
from tensorfold_lfm2_moe import demo
from tensorfold_lfm2_moe.demo import DEMO_NAME, build_demo


def on_disk(path: Path) -> dict[str, tuple[list[int], str]]:
    with safe_open(str(path), "pt") as f:
        return {k: (f.get_slice(k).get_shape(), f.get_slice(k).get_dtype()) for k in f.keys()}


class TestDemoCheckpoint(conformance.DemoCheckpoint):
    demo_module = demo

    def test_second_call_reuses_the_folder(
        self, ckpt: Path, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        before = {p.name: p.stat().st_mtime_ns for p in ckpt.iterdir()}
        monkeypatch.setattr(
            demo, "write_demo", lambda folder: pytest.fail("rebuilt a complete demo")
        )
        assert build_demo(ckpt.parent) == ckpt
        assert {p.name: p.stat().st_mtime_ns for p in ckpt.iterdir()} == before

    def test_incomplete_folder_is_rebuilt(self, ckpt: Path, tmp_path: Path) -> None:
        partial = tmp_path / DEMO_NAME
        partial.mkdir()
        (partial / "config.json").write_text("{}")
        assert conformance.digests(build_demo(tmp_path)) == conformance.digests(ckpt)

    def test_module_does_not_import_transformers(self, tmp_path: Path) -> None:
        code = (
            "import sys; from pathlib import Path; from tensorfold_lfm2_moe.demo import build_demo;"
            f"build_demo(Path({str(tmp_path)!r})); assert 'transformers' not in sys.modules"
        )
        subprocess.run([sys.executable, "-c", code], check=True)

    def test_config_is_what_transformers_writes(self, ckpt: Path, tmp_path: Path) -> None:
        from transformers import AutoConfig, GenerationConfig

        cfg = AutoConfig.from_pretrained(ckpt)
        cfg.save_pretrained(tmp_path)
        assert (tmp_path / "config.json").read_bytes() == (ckpt / "config.json").read_bytes()
        assert cfg.model_type == "lfm2_moe" and cfg.architectures == ["Lfm2MoeForCausalLM"]
        assert cfg.layer_types.count("full_attention") == 2 and cfg.num_dense_layers == 2
        assert cfg.tie_word_embeddings and cfg.max_position_embeddings >= 4096

        GenerationConfig.from_model_config(cfg).save_pretrained(tmp_path)
        theirs = (tmp_path / "generation_config.json").read_bytes()
        assert (ckpt / "generation_config.json").read_bytes() == theirs

    def test_tensor_names_match_transformers_save(self, ckpt: Path, tmp_path: Path) -> None:
        from transformers import AutoConfig, Lfm2MoeForCausalLM

        Lfm2MoeForCausalLM(AutoConfig.from_pretrained(ckpt)).save_pretrained(tmp_path)
        ours = on_disk(ckpt / "model.safetensors")
        assert ours == on_disk(tmp_path / "model.safetensors")
        assert "model.layers.3.feed_forward.experts.7.w2.weight" in ours
        assert "lm_head.weight" not in ours

    def test_transformers_loads_and_generates(self, ckpt: Path) -> None:
        from transformers import AutoModelForCausalLM

        model, info = AutoModelForCausalLM.from_pretrained(ckpt, output_loading_info=True)
        assert not info["missing_keys"] and not info["unexpected_keys"]
        assert not info["mismatched_keys"] and not info["error_msgs"]
        assert model.model.layers[2].feed_forward.expert_bias.abs().sum() > 0
        ids = torch.tensor([[1, 3, 40, 50, 60, 70, 80, 4]])
        out = model.eval().generate(  # past its end of turn: the demo may close this one early
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=16,
            min_new_tokens=16,
            do_sample=False,
        )
        new = out[0, ids.shape[1] :].tolist()
        assert len(new) == 16 and len(set(new)) > 3

    def test_tokenizer_loads_round_trips_and_chats(self, ckpt: Path) -> None:
        from transformers import AutoTokenizer

        cfg = json.loads((ckpt / "config.json").read_text())
        tok = AutoTokenizer.from_pretrained(ckpt)
        assert len(tok) == cfg["vocab_size"]
        assert (tok.bos_token_id, tok.eos_token_id, tok.pad_token_id) == (
            cfg["bos_token_id"],
            cfg["eos_token_id"],
            cfg["pad_token_id"],
        )
        assert tok.convert_ids_to_tokens([cfg["bos_token_id"], cfg["eos_token_id"]]) == [
            "<|startoftext|>",
            "<|im_end|>",
        ]

        for text in ("The little engine woke before dawn.", "  Unseen wörds, 東京 & emoji 🚂!\n"):
            ids = tok(text).input_ids
            assert ids[0] == cfg["bos_token_id"]
            assert tok.decode(ids, skip_special_tokens=True) == text

        chat = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi!"}]
        text = tok.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
        assert text == (
            "<|startoftext|><|im_start|>system\nBe brief.<|im_end|>\n"
            "<|im_start|>user\nHi!<|im_end|>\n<|im_start|>assistant\n"
        )
        ids = tok.apply_chat_template(chat, add_generation_prompt=True, return_dict=True)[
            "input_ids"
        ]
        assert ids[0] == cfg["bos_token_id"] and ids[1] != cfg["bos_token_id"]
        closed = tok.apply_chat_template(chat, tokenize=False)
        assert closed.endswith("<|im_start|>user\nHi!<|im_end|>\n")
        off = tok.apply_chat_template(
            chat, tokenize=False, add_generation_prompt=True, enable_thinking=False
        )
        assert off == text + "<think></think>"
        think, end = tok.convert_tokens_to_ids(["<think>", "</think>"])
        assert tok(off).input_ids[-2:] == [think, end]  # one special token each

    def test_tokenizer_json_loads_with_tokenizers_alone(self, ckpt: Path) -> None:
        from tokenizers import Tokenizer

        tok = Tokenizer.from_file(str(ckpt / "tokenizer.json"))
        enc = tok.encode("Paris is the capital of France.")
        assert tok.decode(enc.ids) == "Paris is the capital of France."
        assert len(enc.ids) < len("Paris is the capital of France.") // 2  # merges were learnt
