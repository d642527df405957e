"""glm5_next against transformers 5.23.0: fp32 logits within 1e-4 (max |diff| / max |ref|) for
whole prompts, chunked passes and 32 greedy decode steps, with the sparse pool selection active
and no exact score tie deciding a selection; the KDA states left behind match the reference's
cache; bf16 runs close."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import pytest
import torch

from tensorfold.engine.runner import open_stream
from tensorfold.family.checkpoint import Checkpoint
from tensorfold.testing import rel_err
from tensorfold_glm import indexer
from tensorfold_glm.model import load

if TYPE_CHECKING:
    from conftest import Tiny

TOL = 1e-4


@pytest.fixture
def selections(monkeypatch: pytest.MonkeyPatch) -> list[tuple[torch.Tensor, torch.Tensor, int]]:
    """Every (scores, candidates, limit) the indexer ranks while the test runs."""
    seen: list[tuple[torch.Tensor, torch.Tensor, int]] = []
    choose = indexer.choose_pools

    def record(scores: torch.Tensor, candidate: torch.Tensor, limit: int) -> torch.Tensor:
        seen.append((scores.clone(), candidate.clone(), limit))
        return choose(scores, candidate, limit)

    monkeypatch.setattr(indexer, "choose_pools", record)
    return seen


def assert_sparse_without_ties(seen: list[tuple[torch.Tensor, torch.Tensor, int]]) -> None:
    """Some query had more candidate pools than it keeps, and for every such query the last kept
    score is strictly above the first dropped one (so no tie rule decided it)."""
    sparse_rows = 0
    for scores, candidate, limit in seen:
        ranked = scores.masked_fill(~candidate, float("-inf")).sort(-1, descending=True).values
        over = candidate.sum(-1) > limit
        sparse_rows += int(over.sum())
        kept, dropped = ranked[over, limit - 1], ranked[over, limit]
        assert bool((kept > dropped).all()), "an exact score tie decided a pool selection"
    assert sparse_rows > 0, "the prompt never made the pool selection sparse"


def test_whole_prompt_matches_reference(tiny: "Tiny", selections: list) -> None:
    runner = tiny.runner()
    stream = open_stream(runner, 0, len(tiny.prompt))
    (logits,) = runner.run([stream.rows(tiny.prompt, logits="all")])
    assert len(stream.lease.pages) == 2  # the prompt crosses a 512-row page
    assert logits.shape == (len(tiny.prompt), tiny.model.vocab_size)
    assert logits.dtype == torch.float32
    assert rel_err(logits, tiny.ref_logits()) < TOL
    assert_sparse_without_ties(selections)


def test_chunked_passes_match_reference_and_the_whole_pass(tiny: "Tiny") -> None:
    one_pass = tiny.prompt_logits()
    for cuts in ([0, 1, 38, 338, 600], [0, 16, 64, 65, 511, 512, 600], [0, 299, 300, 301, 600]):
        chunked = tiny.prompt_logits(cuts)
        assert rel_err(chunked, tiny.ref_logits()) < TOL
        assert torch.equal(chunked, one_pass), cuts  # where a pass cuts changes no bit


def test_32_greedy_decode_steps_match_generate(tiny: "Tiny") -> None:
    tiny.assert_decode_matches_generate(32, cut=250, tol=TOL)


def _ref_states(tiny: "Tiny", prompt: list[int]) -> Any:
    with torch.no_grad():
        return tiny.ref(input_ids=torch.tensor([prompt]), use_cache=True).past_key_values


def test_kda_state_and_conv_tail_match_the_reference_cache(tiny: "Tiny") -> None:
    prompt = tiny.prompt[:203]
    cache = _ref_states(tiny, prompt)
    runner = tiny.runner()
    runner.run([open_stream(runner, 2, len(prompt)).rows(prompt)])
    cfg = tiny.model.cfg
    for i in cfg.kda_layers:
        state = runner.slots.get(f"L{i}.kda")[2]
        ref_state = cache.layers[i].recurrent_states[0][0]
        assert state.dtype == torch.float32
        assert rel_err(state, ref_state) < TOL
        # the reference keeps K columns of pre-conv inputs; the newest K-1 are the ones read
        ref_tail = cache.layers[i].conv_states[0][0][:, 1:]
        assert rel_err(runner.slots.get(f"L{i}.conv")[2], ref_tail) < TOL


def test_bfloat16_keeps_fp32_tensors_and_runs_close(tiny: "Tiny") -> None:
    model = load(Checkpoint.open(tiny.path), "cpu", "bfloat16")
    assert model.dtype == torch.bfloat16
    assert {r.dtype for r in model.layout.paged} == {"bfloat16"}
    assert {s.dtype for s in model.layout.fixed if s.name.endswith(".kda")} == {"float32"}
    for layer in model.weights.layers:
        for hc in (layer.attn_hc, layer.ffn_hc):
            assert hc.base.dtype == hc.scale.dtype == torch.float32
        mixer = layer.mixer
        if hasattr(mixer, "conv"):
            assert mixer.conv.dtype == mixer.dt_bias.dtype == mixer.decay.dtype == torch.float32
            assert mixer.qkv.dtype == torch.bfloat16
        if hasattr(layer.ffn, "bias"):
            assert layer.ffn.bias.dtype == torch.float32
    logits = tiny.prompt_logits(model=model)
    ref = tiny.ref_logits()
    assert logits.dtype == torch.float32 and torch.isfinite(logits).all()
    # bf16 cannot be held to 1e-4: the reference disagrees with itself there (teacher-forced, a
    # 20-token prefill and 11 decode steps against a 13 + 19 chunked prefill differ by 3.9e-3 in
    # bf16, 1.8e-7 in fp32)
    assert (logits.argmax(-1) == ref.argmax(-1)).float().mean() > 0.8
    assert ((logits - ref).abs().median() / ref.abs().max()) < 0.03
