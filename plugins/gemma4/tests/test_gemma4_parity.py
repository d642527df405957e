"""gemma4 against transformers 5.23.0 (fp32 logits within 1e-4, greedy tokens equal)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from tensorfold.engine.runner import open_stream
from tensorfold.family.checkpoint import Checkpoint
from tensorfold.testing import rel_err
from tensorfold_gemma4.model import load

if TYPE_CHECKING:
    from conftest import Tiny

TOL = 1e-4
PROMPT_LEN = 600


def whole_prompt(tiny: "Tiny") -> torch.Tensor:
    runner = tiny.runner()
    stream = open_stream(runner, 0, PROMPT_LEN)
    (logits,) = runner.run([stream.rows(tiny.prompt, logits="all")])
    assert len(stream.lease.pages) == 2  # the prompt crosses a 512-row page
    return logits


def test_whole_prompt_matches_reference(tiny: "Tiny") -> None:
    windows = [layer.window or 0 for layer in tiny.model.cfg.layers]
    assert len(tiny.prompt) == PROMPT_LEN > max(windows)
    logits = whole_prompt(tiny)
    assert logits.shape == (PROMPT_LEN, tiny.model.vocab_size) and logits.dtype == torch.float32
    assert rel_err(logits, tiny.ref_logits()) < TOL


def test_chunked_prompt_matches_reference_at_every_row(tiny: "Tiny") -> None:
    # chunks shorter and longer than the windows
    chunked = tiny.prompt_logits([0, 1, 7, 107, 338, PROMPT_LEN])
    assert rel_err(chunked, tiny.ref_logits()) < TOL
    assert torch.equal(chunked, whole_prompt(tiny))  # where a pass cuts the prompt changes no bit


def test_greedy_decode_matches_generate(tiny: "Tiny") -> None:
    tiny.assert_decode_matches_generate(32, cut=300, tol=TOL)


def test_bfloat16_runs_as_close_to_fp32_as_the_reference_does(tiny: "Tiny") -> None:
    """bf16 cannot be held to 1e-4: the reference disagrees with itself there (teacher-
    forced, a 20-token prefill and 11 decode steps against a 13 + 19 chunked prefill, its bf16
    logits differ by up to 1.1, against 1.5e-5 in fp32; these random tiny models flip experts
    and softcapped logits easily). Ours in bf16 must stand about as close to the fp32 reference
    as the reference's own bf16 run does."""
    model = load(Checkpoint.open(tiny.path), "cpu", "bfloat16")
    assert model.dtype == torch.bfloat16
    assert {r.dtype for r in model.layout.paged} == {"bfloat16"}
    logits = tiny.prompt_logits(model=model)
    assert logits.dtype == torch.float32 and torch.isfinite(logits).all()
    ref16 = type(tiny.ref).from_pretrained(tiny.path, dtype=torch.bfloat16).eval()
    with torch.no_grad():
        theirs = ref16(input_ids=torch.tensor([tiny.prompt])).logits[0].float()
    ref = tiny.ref_logits()

    def agree(x: torch.Tensor) -> float:
        return (x.argmax(-1) == ref.argmax(-1)).float().mean().item()

    def typical(x: torch.Tensor) -> float:
        return ((x - ref).abs().median() / ref.abs().max()).item()

    assert agree(logits) > agree(theirs) - 0.1
    assert typical(logits) < 1.5 * typical(theirs)
    assert torch.equal(logits[0], theirs[0])  # one row, no attention mixing: the same bits


def test_causal_lm_checkpoint_matches_reference(causal: "Tiny") -> None:
    """Gemma4ForCausalLM: weights under `model.`, an untied lm_head, v_proj on full layers,
    no MoE, no softcap, half-width proportional RoPE; whole and chunked."""
    ckpt = Checkpoint.open(causal.path)
    assert ckpt.has("model.embed_tokens.weight") and ckpt.has("lm_head.weight")
    assert ckpt.has("model.layers.1.self_attn.v_proj.weight")
    assert not torch.equal(causal.model.weights.lm_head, causal.model.weights.embed)
    logits = causal.prompt_logits([0, 20, 513, PROMPT_LEN])
    assert rel_err(logits, causal.ref_logits()) < TOL
