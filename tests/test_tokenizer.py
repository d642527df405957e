import json
from pathlib import Path

import pytest
from safetensors.torch import save_file
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import decoders, models, pre_tokenizers, processors, trainers

from tensorfold.family.checkpoint import Checkpoint, CheckpointError
from tensorfold.family.tokenizer import Tokenizer

SPECIALS = ["<s>", "</s>", "<|im_start|>", "<|im_end|>"]
SENTENCES = [
    "the quick brown fox jumps over the lazy dog",
    "hello world, hello tensorfold",
    "a small model serves many streams",
    "the cache keeps the prompt between turns",
] * 4


def byte_level_bpe(sentences: list[str] = SENTENCES) -> HFTokenizer:
    """A byte-level BPE of 400 tokens with SPECIALS, learnt from `sentences`."""
    tok = HFTokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=True)
    trainer = trainers.BpeTrainer(
        vocab_size=400,
        special_tokens=SPECIALS,
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(sentences, trainer)
    return tok


def metaspace_bpe() -> HFTokenizer:
    tok = HFTokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    tok.decoder = decoders.Metaspace()
    trainer = trainers.BpeTrainer(
        vocab_size=200, special_tokens=["<unk>", *SPECIALS], show_progress=False
    )
    tok.train_from_iterator(SENTENCES, trainer)
    return tok


def make_checkpoint(
    root: Path,
    tok: HFTokenizer | None = None,
    *,
    config: dict | None = None,
    generation_config: dict | None = None,
    tokenizer_config: dict | None = None,
) -> Checkpoint:
    import torch

    root.mkdir(parents=True, exist_ok=True)
    (root / "config.json").write_text(json.dumps(config or {}))
    if generation_config is not None:
        (root / "generation_config.json").write_text(json.dumps(generation_config))
    if tokenizer_config is not None:
        (root / "tokenizer_config.json").write_text(json.dumps(tokenizer_config))
    save_file({"w": torch.zeros(1)}, str(root / "model.safetensors"))
    (tok or byte_level_bpe()).save(str(root / "tokenizer.json"))
    return Checkpoint.open(root)


@pytest.fixture
def tok(tmp_path: Path) -> Tokenizer:
    ckpt = make_checkpoint(
        tmp_path,
        config={"eos_token_id": 5, "bos_token_id": 0},
        generation_config={"eos_token_id": [6, 7]},
        tokenizer_config={"bos_token": {"content": "<s>", "special": True}, "eos_token": "</s>"},
    )
    return Tokenizer.from_checkpoint(ckpt)


def test_round_trip(tok: Tokenizer) -> None:
    text = "hello world, the lazy fox serves naïve streams ☕ 😀"
    ids = tok.encode(text)
    assert ids and all(isinstance(i, int) for i in ids)
    assert tok.decode(ids) == text
    assert tok.vocab_size == tok.hf.get_vocab_size(with_added_tokens=True)


def test_special_tokens(tok: Tokenizer) -> None:
    assert tok.bos_token == "<s>" and tok.eos_token == "</s>"
    assert tok.bos_token_id == tok.token_to_id("<s>") == 0
    ids = tok.encode("<|im_start|>hello<|im_end|>")
    assert ids[0] == tok.token_to_id("<|im_start|>") and ids[-1] == tok.token_to_id("<|im_end|>")
    assert tok.decode(ids) == "hello"
    assert tok.decode(ids, skip_special_tokens=False) == "<|im_start|>hello<|im_end|>"


def test_eos_ids_from_all_three_sources(tok: Tokenizer) -> None:
    assert tok.eos_token_ids == {tok.token_to_id("</s>"), 5, 6, 7}


def test_eos_ids_int_generation_config_and_text_config(tmp_path: Path) -> None:
    ckpt = make_checkpoint(
        tmp_path,
        config={"text_config": {"eos_token_id": [9]}},
        generation_config={"eos_token_id": 8},
    )
    t = Tokenizer.from_checkpoint(ckpt)
    assert t.eos_token_ids == {8, 9} and t.eos_token is None and t.bos_token_id is None


def test_missing_tokenizer_json(tmp_path: Path) -> None:
    ckpt = make_checkpoint(tmp_path)
    (tmp_path / "tokenizer.json").unlink()
    with pytest.raises(CheckpointError, match=r"tokenizer\.json not found"):
        Tokenizer.from_checkpoint(ckpt)


def test_corrupt_tokenizer_json(tmp_path: Path) -> None:
    ckpt = make_checkpoint(tmp_path)
    (tmp_path / "tokenizer.json").write_text("{}")
    with pytest.raises(CheckpointError, match=r"tokenizer\.json cannot be read"):
        Tokenizer.from_checkpoint(ckpt)


def test_chat_template_sources(tmp_path: Path) -> None:
    assert Tokenizer.from_checkpoint(make_checkpoint(tmp_path / "none")).chat_template is None
    cfg = {"chat_template": "{{ messages }}"}
    t = Tokenizer.from_checkpoint(make_checkpoint(tmp_path / "cfg", tokenizer_config=cfg))
    assert t.chat_template == "{{ messages }}"
    templates = [{"name": "default", "template": "D"}, {"name": "tool_use", "template": "T"}]
    listed = {"chat_template": templates}
    t = Tokenizer.from_checkpoint(make_checkpoint(tmp_path / "list", tokenizer_config=listed))
    assert t.chat_template == "D" and t.chat_templates["tool_use"] == "T"
    (tmp_path / "file").mkdir()
    (tmp_path / "file" / "chat_template.jinja").write_text("from file")
    t = Tokenizer.from_checkpoint(make_checkpoint(tmp_path / "file", tokenizer_config=cfg))
    assert t.chat_template == "from file"


def stream(tok: Tokenizer, ids: list[int]) -> list[str]:
    dec = tok.incremental_decoder()
    pieces = [dec.step([i]) for i in ids]
    pieces.append(dec.flush())
    assert dec.text == "".join(pieces)
    return pieces


def test_incremental_decoder_holds_split_characters(tok: Tokenizer) -> None:
    text = "hello 😀 café ☕ world"
    ids = tok.encode(text)
    emoji_ids = tok.encode("😀")
    assert len(emoji_ids) > 1  # one character over several byte-level tokens
    pieces = stream(tok, ids)
    assert "".join(pieces) == tok.decode(ids) == text
    assert not any("\ufffd" in p for p in pieces)
    assert "😀" in pieces[ids.index(emoji_ids[-1])]
    assert pieces[ids.index(emoji_ids[0])] == ""


def test_incremental_decoder_flushes_incomplete_character(tok: Tokenizer) -> None:
    partial = tok.encode("😀")[:-1]
    dec = tok.incremental_decoder()
    assert dec.step(tok.encode("hello")) == "hello"
    assert dec.step(partial) == ""
    assert dec.flush().endswith("\ufffd")


def test_incremental_decoder_skips_special_tokens(tok: Tokenizer) -> None:
    ids = tok.encode("hello<|im_end|> world")
    assert "".join(stream(tok, ids)) == "hello world"


def test_incremental_decoder_keeps_metaspace_spaces(tmp_path: Path) -> None:
    t = Tokenizer.from_checkpoint(make_checkpoint(tmp_path, metaspace_bpe()))
    ids = t.encode("the quick brown fox serves many streams")
    pieces = stream(t, ids)
    assert "".join(pieces) == t.decode(ids) == "the quick brown fox serves many streams"


def test_offsets_are_characters_and_untrimmed(tok: Tokenizer) -> None:
    text = "café hello"
    ids, offsets = tok.encode_with_offsets(text)
    assert ids == tok.encode(text)
    assert offsets[-1][1] == len(text)
    spans = list(dict.fromkeys(offsets))  # "é" is two byte-level tokens with one span
    assert "".join(text[s:e] for s, e in spans) == text  # the space is covered by a token


def metaspace_first_bpe() -> HFTokenizer:
    """Metaspace with prepend_scheme "first" (as Llama-style conversions): "▁" only before the
    text's first piece, not after a special token."""
    tok = HFTokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(prepend_scheme="first", split=False)
    tok.decoder = decoders.Metaspace(prepend_scheme="first", split=False)
    trainer = trainers.BpeTrainer(
        vocab_size=200, special_tokens=["<unk>", *SPECIALS], show_progress=False
    )
    tok.train_from_iterator(SENTENCES, trainer)
    return tok


TOKENIZERS = {
    "byte-level": byte_level_bpe,
    "metaspace": metaspace_bpe,
    "metaspace-first": metaspace_first_bpe,
}
CHATML = (
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def _tokenizer(tmp_path: Path, kind: str) -> Tokenizer:
    return Tokenizer.from_checkpoint(make_checkpoint(tmp_path, TOKENIZERS[kind]()))


@pytest.mark.parametrize("kind", sorted(TOKENIZERS))
def test_encode_chat_without_literal_spans_is_encode_and_marks(tmp_path: Path, kind: str) -> None:
    from tensorfold.family.chat_template import marks_to_token_positions, render_chat

    t = _tokenizer(tmp_path, kind)
    chat = [
        {"role": "user", "content": "hello world"},
        {"role": "assistant", "content": "the fox"},
        {"role": "user", "content": " the  lazy dog "},
    ]
    rendered = render_chat(CHATML, chat, protect=t.special_tokens())
    assert rendered.literal == ()
    ids, marks = t.encode_chat(rendered)
    assert ids == t.encode(rendered.text)
    assert marks == marks_to_token_positions(t, rendered.text, rendered.marks)
    assert len(marks) == 3


@pytest.mark.parametrize("kind", sorted(TOKENIZERS))
def test_encode_chat_reads_literal_spans_as_text(tmp_path: Path, kind: str) -> None:
    from tensorfold.family.chat_template import RenderedChat

    t = _tokenizer(tmp_path, kind)
    head, typed, tail = "<|im_start|>user\nhello ", "<|im_end|>\n<|im_start|>", " world<|im_end|>"
    text = head + typed + tail + "\n<|im_start|>assistant\n"
    start = len(head)
    literal = ((start, start + len("<|im_end|>")), (start + 11, start + 11 + len("<|im_start|>")))
    marks = (len(head + typed + tail) + 1,)
    ids, positions = t.encode_chat(RenderedChat(text, marks, literal))
    im_start, im_end = t.token_to_id("<|im_start|>"), t.token_to_id("<|im_end|>")
    assert ids.count(im_start) == 2 and ids.count(im_end) == 1  # the template's, not the user's
    assert ids[0] == im_start
    if kind == "byte-level":
        assert t.decode(ids, skip_special_tokens=False) == text  # no space gained or lost
    # the piece starts as it does in the text without the typed strings (with Metaspace
    # "first": no "▁" before it, as it does not start the text)
    assert ids[1] == t.encode(head + tail)[1]
    if kind != "metaspace-first":
        # the stretch between the template's specials is one piece read as text, as the
        # tokenizer reads it with encode_special_tokens
        as_text = HFTokenizer.from_str(t.hf.to_str())
        as_text.encode_special_tokens = True
        piece = as_text.encode("user\nhello " + typed + " world", add_special_tokens=False).ids
        assert ids[1 : 1 + len(piece)] == piece
    # the mark after the user's turn: before the generation prompt's <|im_start|>
    assert positions == [len(ids) - 1 - ids[::-1].index(im_start)]
