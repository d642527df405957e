"""The glm5_next demo checkpoint: deterministic, atomic, complete, and what transformers 5.23.0
computes from it."""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest
import torch

from tensorfold.engine.runner import ModelRunner, open_stream
from tensorfold.family.chat_template import render_chat
from tensorfold.family.checkpoint import Checkpoint
from tensorfold.family.tokenizer import Tokenizer
from tensorfold_glm import demo
from tensorfold_glm.demo import DEMO_NAME, FILES, build_demo
from tensorfold_glm.model import load


def digests(folder: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(folder.iterdir())}


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_demo(tmp_path_factory.mktemp("cache"))


def test_builds_named_folder_with_all_files(ckpt: Path) -> None:
    assert ckpt.name == DEMO_NAME
    assert sorted(p.name for p in ckpt.iterdir()) == sorted(FILES)
    assert [p.name for p in ckpt.parent.iterdir()] == [DEMO_NAME]  # no temp folder left behind


def test_two_builds_are_byte_identical(ckpt: Path, tmp_path: Path) -> None:
    state = torch.random.get_rng_state()
    again = build_demo(tmp_path)
    assert torch.equal(torch.random.get_rng_state(), state)  # the global RNG is untouched
    assert digests(again) == digests(ckpt)


def test_crashed_build_leaves_nothing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def boom(cfg: dict[str, object]) -> dict[str, torch.Tensor]:
        raise RuntimeError("crash while writing weights")

    monkeypatch.setattr(demo, "build_weights", boom)
    with pytest.raises(RuntimeError, match="crash"):
        build_demo(tmp_path)
    assert list(tmp_path.iterdir()) == []


def test_tokenizer_and_glm_chat_template(ckpt: Path) -> None:
    tok = Tokenizer.from_checkpoint(Checkpoint.open(ckpt))
    ids = {t: tok.token_to_id(t) for t in ("[gMASK]", "<sop>", "<|user|>", "<|assistant|>")}
    assert tok.eos_token_ids == {tok.token_to_id(t) for t in demo.EOS}
    assert tok.encode("Hello", add_special_tokens=True)[:2] == [ids["[gMASK]"], ids["<sop>"]]
    chat = render_chat(tok.chat_template, [{"role": "user", "content": "Hi there"}])
    assert chat.text == "[gMASK]<sop><|user|>\nHi there<|assistant|>\n"
    encoded = tok.encode(chat.text)
    assert encoded[:3] == [ids["[gMASK]"], ids["<sop>"], ids["<|user|>"]]
    assert encoded[-2] == ids["<|assistant|>"]


def test_transformers_loads_every_tensor_and_computes_our_logits(ckpt: Path) -> None:
    from transformers import Glm5NextForConditionalGeneration

    ref, info = Glm5NextForConditionalGeneration.from_pretrained(
        ckpt, dtype=torch.float32, output_loading_info=True
    )
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    model = load(Checkpoint.open(ckpt), "cpu", "float32")
    gen = torch.Generator().manual_seed(7)
    prompt = torch.randint(20, model.vocab_size, (200,), generator=gen).tolist()
    with torch.no_grad():
        want = ref.eval()(input_ids=torch.tensor([prompt])).logits[0]
    runner = ModelRunner(model, num_pages=1, num_slots=1, page_rows=512)
    stream = open_stream(runner, 0, len(prompt))
    got = torch.cat(
        [runner.run([stream.rows(prompt[a:b], logits="all")])[0] for a, b in ((0, 90), (90, 200))]
    )
    assert ((got - want).abs().max() / want.abs().max()) < 1e-4
