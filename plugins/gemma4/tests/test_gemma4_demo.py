"""The gemma4 demo checkpoint: deterministic, atomic, what transformers 5.23.0 saves and loads, and
served exactly as the reference computes it."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from tensorfold import conformance
from tensorfold.engine.runner import ModelRunner, open_stream
from tensorfold.family.checkpoint import Checkpoint
from tensorfold_gemma4 import demo
from tensorfold_gemma4.demo import build_demo
from tensorfold_gemma4.model import load


def on_disk(path: Path) -> dict[str, tuple[list[int], str]]:
    with safe_open(str(path), "pt") as f:
        return {k: (f.get_slice(k).get_shape(), f.get_slice(k).get_dtype()) for k in f.keys()}


class TestDemoCheckpoint(conformance.DemoCheckpoint):
    demo_module = demo

    def test_second_call_reuses_and_a_crash_leaves_nothing(
        self, ckpt: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        before = {p.name: p.stat().st_mtime_ns for p in ckpt.iterdir()}

        def boom(*args: object) -> None:
            raise RuntimeError("crash while writing weights")

        monkeypatch.setattr(demo, "write_demo", boom)
        assert build_demo(ckpt.parent) == ckpt
        assert {p.name: p.stat().st_mtime_ns for p in ckpt.iterdir()} == before
        with pytest.raises(RuntimeError, match="crash"):
            build_demo(tmp_path)
        assert list(tmp_path.iterdir()) == []

    def test_module_does_not_import_transformers(self, tmp_path: Path) -> None:
        code = (
            "import sys; from pathlib import Path; from tensorfold_gemma4.demo import build_demo;"
            "from tensorfold.family.checkpoint import Checkpoint; from tensorfold_gemma4.model import load;"
            f"load(Checkpoint.open(build_demo(Path({str(tmp_path)!r}))), 'cpu', 'float32');"
            "assert 'transformers' not in sys.modules"
        )
        subprocess.run([sys.executable, "-c", code], check=True)

    def test_config_and_tensors_are_what_transformers_writes(
        self, ckpt: Path, tmp_path: Path
    ) -> None:
        from transformers import AutoConfig, Gemma4ForConditionalGeneration

        cfg = AutoConfig.from_pretrained(ckpt)
        assert cfg.model_type == "gemma4" and cfg.architectures == [
            "Gemma4ForConditionalGeneration"
        ]
        assert cfg.vision_config is None and cfg.audio_config is None
        text = cfg.text_config
        assert text.kv_sharing_modes == [None, None, "store", "store", "reuse", "reuse"]
        assert text.per_layer_config[2].head_dim == 64 and text.per_layer_config[0].head_dim == 32
        Gemma4ForConditionalGeneration(cfg).save_pretrained(tmp_path)
        assert (tmp_path / "config.json").read_bytes() == (ckpt / "config.json").read_bytes()
        ours = on_disk(ckpt / "model.safetensors")
        assert ours == on_disk(tmp_path / "model.safetensors")
        assert "model.language_model.layers.5.experts.gate_up_proj" in ours
        assert "model.language_model.layers.2.self_attn.v_proj.weight" not in ours  # k_eq_v
        assert "lm_head.weight" not in ours

    def test_transformers_loads_it_and_we_serve_it_as_it_computes(self, ckpt: Path) -> None:
        from transformers import AutoModelForImageTextToText

        ref, info = AutoModelForImageTextToText.from_pretrained(
            ckpt, dtype=torch.float32, output_loading_info=True
        )
        assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys"))
        model = load(Checkpoint.open(ckpt), "cpu", "float32")
        gen = torch.Generator().manual_seed(11)
        prompt = torch.randint(16, model.vocab_size, (200,), generator=gen).tolist()
        prompt[50] = json.loads((ckpt / "config.json").read_text())["image_token_id"]  # as pad
        with torch.no_grad():
            want = ref.eval()(input_ids=torch.tensor([prompt])).logits[0]
        runner = ModelRunner(model, num_pages=1, num_slots=1, page_rows=512)
        stream = open_stream(runner, 0, len(prompt))
        (a,) = runner.run([stream.rows(prompt[:130], logits="all")])
        (b,) = runner.run([stream.rows(prompt[130:], logits="all")])
        got = torch.cat([a, b])
        assert ((got - want).abs().max() / want.abs().max()).item() < 1e-4

    def test_tokenizer_loads_round_trips_and_chats(self, ckpt: Path) -> None:
        from transformers import AutoTokenizer

        text_cfg = json.loads((ckpt / "config.json").read_text())["text_config"]
        tok = AutoTokenizer.from_pretrained(ckpt)
        assert len(tok) == text_cfg["vocab_size"]
        assert (tok.pad_token_id, tok.eos_token_id, tok.bos_token_id) == (0, 1, 2)
        ids = (text_cfg["pad_token_id"], text_cfg["eos_token_id"], text_cfg["bos_token_id"])
        assert ids == (0, 1, 2)
        for text in ("The lighthouse keeper climbed the stairs.", "  Unseen wörds, 東京 & 🚂!\n"):
            ids = tok(text).input_ids
            assert ids[0] == 2 and tok.decode(ids, skip_special_tokens=True) == text
        chat = [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": "Hi!"},
            {"role": "assistant", "content": "Hello."},
            {"role": "user", "content": "Bye"},
        ]
        text = tok.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
        assert text == (  # thinking off by default: the model's turn opens an empty channel
            "<bos><start_of_turn>user\nBe brief.\n\nHi!<end_of_turn>\n"
            "<start_of_turn>model\nHello.<end_of_turn>\n"
            "<start_of_turn>user\nBye<end_of_turn>\n<start_of_turn>model\n"
            "<|channel>thought\n<channel|>"
        )
        thinking = tok.apply_chat_template(
            chat, tokenize=False, add_generation_prompt=True, enable_thinking=True
        )
        assert thinking == (
            "<bos><start_of_turn>system\n<|think|>\nBe brief.<end_of_turn>\n"
            "<start_of_turn>user\nHi!<end_of_turn>\n"
            "<start_of_turn>model\nHello.<end_of_turn>\n"
            "<start_of_turn>user\nBye<end_of_turn>\n<start_of_turn>model\n"
        )
        marks = [tok.convert_tokens_to_ids(t) for t in ("<|think|>", "<|channel>", "<channel|>")]
        assert all(tok.added_tokens_decoder[i].special for i in marks)  # one token each
        ids = tok.apply_chat_template(chat, add_generation_prompt=True, return_dict=True)[
            "input_ids"
        ]
        assert ids[0] == 2 and ids[1] == tok.convert_tokens_to_ids("<start_of_turn>")
        generation = json.loads((ckpt / "generation_config.json").read_text())
        assert generation["eos_token_id"] == [1, tok.convert_tokens_to_ids("<end_of_turn>")]
