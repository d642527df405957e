"""The pieces of verify rounds that need no model: a prediction's drafts kept in step with the
output (tensorfold.engine.drafts), the policy that sizes k, the drafted history's penalties
(bit for bit plain's), and a lease giving back rejected rows' pages (census even)."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tensorfold.engine.drafts import DraftPolicy, DraftSettings, PredictionDrafter, StreamDrafts
from tensorfold.engine.sampling import RowHistory, SamplingParams, apply_penalties
from tensorfold.memory.kv_pool import KVPool


def test_a_prediction_the_output_repeats_is_drafted_in_step() -> None:
    p = PredictionDrafter([1, 2, 3, 4, 5, 6])
    assert p.propose(3) == [1, 2, 3]
    for t in (1, 2):
        p.append(t)
    assert p.propose(3) == [3, 4, 5]
    for t in (3, 4, 5, 6):
        p.append(t)
    assert p.propose(3) == []  # past its end


def test_after_a_substituted_token_the_drafts_go_on_from_the_next_position() -> None:
    p = PredictionDrafter([1, 2, 3, 4, 5, 6, 7])
    for t in (1, 2, 9):  # 9 where the prediction said 3
        p.append(t)
    assert p.propose(2) == [4, 5]


def test_after_an_insertion_the_drafts_resync_where_the_output_rejoins() -> None:
    p = PredictionDrafter([10, 11, 12, 13, 14, 15, 16])
    for t in (10, 11, 99, 98, 12, 13):  # two tokens inserted, then the prediction again
        p.append(t)
    assert p.propose(3) == [14, 15, 16]


def test_after_a_deletion_the_drafts_resync_ahead() -> None:
    p = PredictionDrafter([10, 11, 12, 13, 14, 15, 16, 17])
    for t in (10, 11, 14, 15):  # 12 and 13 left out
        p.append(t)
    assert p.propose(2) == [16, 17]


def test_rejected_prediction_tokens_count_each_position_once() -> None:
    d = StreamDrafts(DraftSettings(adaptive=False), [0], [7, 7, 7, 7, 7, 7])
    for _ in range(3):  # each round proposes the next 4 positions, keeps none
        assert len(d.propose(4)) == 4
        d.settle()
        d.append(1)
    assert d.prediction_accepted == 0
    assert d.prediction_rejected == 6  # positions 0..5, not 12 proposals
    assert d.drafted == 12


def test_the_policy_stops_drafting_what_is_never_accepted_and_probes_again() -> None:
    policy = DraftPolicy(DraftSettings(tokens=4))
    ks = []
    for _ in range(60):
        k = policy.k()
        ks.append(k)
        policy.settle(k, 0)
    assert ks[0] > 0
    assert sum(ks[30:]) <= 2  # paused: at most a probe now and then
    assert any(k == 1 for k in ks[10:])  # a pause ends with one probing draft


def test_the_policy_drafts_more_while_drafts_are_accepted() -> None:
    policy = DraftPolicy(DraftSettings(tokens=8))
    for _ in range(20):
        k = policy.k()
        policy.settle(k, k)
    assert policy.k() == 8
    low = DraftPolicy(DraftSettings(tokens=8))
    for _ in range(20):
        low.k()
        low.settle(4, 2)  # half the drafts kept
    assert 0 < low.k() < 8


def test_draft_settings_refuse_what_cannot_run() -> None:
    with pytest.raises(ValueError, match="1..16"):
        DraftSettings(tokens=0)
    with pytest.raises(ValueError, match="off, ngram"):
        DraftSettings(source="eagle")  # type: ignore[arg-type]


@settings(max_examples=40, deadline=None)
@given(
    prompt=st.lists(st.integers(0, 31), min_size=1, max_size=12),
    output=st.lists(st.integers(0, 31), max_size=12),
    drafts=st.lists(st.integers(0, 31), min_size=1, max_size=6),
)
def test_a_drafted_history_penalises_as_plain_does_once_the_drafts_are_its_output(
    prompt: list[int], output: list[int], drafts: list[int]
) -> None:
    params = SamplingParams(
        temperature=0.8, presence_penalty=0.7, frequency_penalty=0.4, repetition_penalty=1.3
    )
    logits = torch.randn(32, generator=torch.Generator().manual_seed(len(prompt)))
    base = RowHistory(prompt, output)
    base.dense(32, logits.device)  # its cache built before the drafts, as in a stream
    for j in range(len(drafts) + 1):
        plain = RowHistory(prompt, output + drafts[:j])
        view = base.with_draft(drafts[:j])
        assert torch.equal(
            apply_penalties(logits, params, view), apply_penalties(logits, params, plain)
        )
    assert base.output_ids == output  # the stream's own history is untouched
    seen, counts = base.dense(32, logits.device)
    assert torch.equal(counts, RowHistory(prompt, output).dense(32, logits.device)[1])


def test_a_lease_gives_back_rejected_rows_pages_into_its_promise() -> None:
    pool = KVPool(8, 4)
    lease = pool.lease(20)  # 5 pages promised
    lease.cover(14)  # a verify round's rows: 4 pages
    assert (len(lease.pages), lease.promised) == (4, 1)
    lease.trim(6)  # kept rows [0, 6): 2 pages
    assert (len(lease.pages), lease.promised) == (2, 3)
    assert pool.census().live == 2
    lease.cover(20)
    lease.release()
    assert pool.census().idle_even


def test_a_verify_pass_dearer_than_plain_needs_drafts_kept_often_to_draft() -> None:
    """pass_cost: on a GPU whose verify passes run eagerly beside graphed decode rounds."""
    dear = DraftPolicy(DraftSettings(tokens=16, pass_cost=10.0))
    assert (dear.k(), dear.wants()) == (0, False)  # the prior acceptance does not pay
    dear.acceptance = 1.0
    assert dear.best_k() == 16 and dear.wants()  # 17 tokens a pass of ~11.6 plain ones
    cheap = DraftPolicy(DraftSettings(tokens=16))
    assert cheap.best_k() > 0 and cheap.wants()


def test_the_acceptance_is_a_drafts_chance_once_those_before_it_were() -> None:
    """Two of four kept: three judged (the second refused, the last two never looked at)."""
    policy = DraftPolicy(DraftSettings(tokens=4))
    for _ in range(40):
        policy.settle(4, 2)
    assert policy.acceptance == pytest.approx(2 / 3)
    for _ in range(40):
        policy.settle(4, 4)  # every draft kept: none refused
    assert policy.acceptance == pytest.approx(1.0, abs=1e-5)


def test_measured_verify_costs_price_a_pass_at_the_rows_it_is_padded_to() -> None:
    table = ((2, 1.5), (3, 1.8), (5, 2.4), (9, 3.0))
    s = DraftSettings(tokens=16, verify_costs=table)
    assert [s.verify_cost(r) for r in (2, 3, 4, 5, 9)] == [1.5, 1.8, 2.4, 2.4, 3.0]
    assert s.verify_cost(17) == pytest.approx(s.pass_cost + s.row_cost * 16)  # not measured
    policy = DraftPolicy(replace(s, tokens=8))
    policy.acceptance = 0.8
    # k = 8: 4.33 / 3.0 = 1.44 beats k = 4: 3.36 / 2.4 = 1.40 (k = 3 costs k = 4's: 1.23)
    assert policy.best_k() == 8
    policy.acceptance = 0.3
    assert policy.best_k() == 0  # 1.3 / 1.5: no k pays
