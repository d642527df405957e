"""The glm5_next demo checkpoint: deterministic, atomic, complete, and what transformers 5.23.0
computes from it."""

from __future__ import annotations

from pathlib import Path

import torch

from tensorfold import conformance
from tensorfold.engine.runner import ModelRunner, open_stream
from tensorfold.family.chat_template import render_chat
from tensorfold.family.checkpoint import Checkpoint
from tensorfold.family.tokenizer import Tokenizer
from tensorfold_glm import demo
from tensorfold_glm.model import load


class TestDemoCheckpoint(conformance.DemoCheckpoint):
    demo_module = demo

    def test_tokenizer_and_glm_chat_template(self, ckpt: Path) -> None:
        tok = Tokenizer.from_checkpoint(Checkpoint.open(ckpt))
        names = ("[gMASK]", "<sop>", "<|user|>", "<|assistant|>", "<think>", "</think>")
        ids = {t: tok.token_to_id(t) for t in names}
        assert tok.eos_token_ids == {tok.token_to_id(t) for t in demo.EOS}
        assert tok.encode("Hello", add_special_tokens=True)[:2] == [ids["[gMASK]"], ids["<sop>"]]
        chat = render_chat(tok.chat_template, [{"role": "user", "content": "Hi there"}])
        assert chat.text == "[gMASK]<sop><|user|>\nHi there<|assistant|><think>"  # thinking on
        encoded = tok.encode(chat.text)
        assert encoded[:3] == [ids["[gMASK]"], ids["<sop>"], ids["<|user|>"]]
        assert encoded[-2:] == [ids["<|assistant|>"], ids["<think>"]]
        off = render_chat(
            tok.chat_template, [{"role": "user", "content": "Hi there"}], enable_thinking=False
        )
        assert off.text == "[gMASK]<sop><|user|>\nHi there<|assistant|></think>"
        assert tok.encode(off.text)[-1] == ids["</think>"]

    def test_transformers_loads_every_tensor_and_computes_our_logits(self, ckpt: Path) -> None:
        from transformers import Glm5NextForConditionalGeneration

        ref, info = Glm5NextForConditionalGeneration.from_pretrained(
            ckpt, dtype=torch.float32, output_loading_info=True
        )
        # the MTP layer (layers.6, tensorfold_glm.mtp): transformers drops it, as it drops a
        # real checkpoint's layer 45
        mtp = f"model.language_model.layers.{demo.TEXT_SHAPE['num_hidden_layers']}."
        unexpected = [k for k in info["unexpected_keys"] if not k.startswith(mtp)]
        assert info["unexpected_keys"] and not info["missing_keys"] and not unexpected, info
        model = load(Checkpoint.open(ckpt), "cpu", "float32")
        gen = torch.Generator().manual_seed(7)
        prompt = torch.randint(20, model.vocab_size, (200,), generator=gen).tolist()
        with torch.no_grad():
            want = ref.eval()(input_ids=torch.tensor([prompt])).logits[0]
        runner = ModelRunner(model, num_pages=1, num_slots=1, page_rows=512)
        stream = open_stream(runner, 0, len(prompt))
        got = torch.cat(
            [
                runner.run([stream.rows(prompt[a:b], logits="all")])[0]
                for a, b in ((0, 90), (90, 200))
            ]
        )
        assert ((got - want).abs().max() / want.abs().max()) < 1e-4
