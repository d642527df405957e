from __future__ import annotations

import math
import random
from collections import Counter

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tensorfold.engine.sampling import (
    RowHistory,
    SamplingParams,
    SamplingParamsError,
    apply_penalties,
    philox4x32,
    sample_row,
    sample_rows,
    uniform,
)

# Random123 tests/kat_vectors, the three "philox4x32 10" lines: counter[4], key[2] -> result[4].
PHILOX_KAT = [
    ((0, 0, 0, 0), (0, 0), (0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8)),
    ((0xFFFFFFFF,) * 4, (0xFFFFFFFF,) * 2, (0x408F276D, 0x41C83B0E, 0xA20BC7C6, 0x6D5451FD)),
    (
        (0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344),
        (0xA4093822, 0x299F31D0),
        (0xD16CFE09, 0x94FDCCEB, 0x5001E420, 0x24126EA1),
    ),
]


@pytest.mark.parametrize("counter, key, expected", PHILOX_KAT)
def test_philox_known_answers(counter, key, expected) -> None:
    assert philox4x32(counter, key) == expected


def test_uniform_known_values() -> None:
    # uniform(seed 0, t 0) is built from the first KAT vector's first two words.
    assert uniform(0, 0) == ((0x6627E8D5 >> 5) * 2**26 + (0xE169C58D >> 6)) / 2**53
    assert uniform(0, 0) == 0.39904647231489565
    assert uniform(0, 1) == 0.9722412032044762
    assert uniform(1, 0) == 0.8902591757080309
    assert uniform(42, 7) == 0.3583605096346558
    assert uniform(2**64 - 1, 2**40 + 3) == 0.6770620289724423
    assert uniform(-1, 5) == uniform(2**64 - 1, 5)


def test_uniform_is_uniform() -> None:
    for draws in ([uniform(s, 0) for s in range(5000)], [uniform(7, t) for t in range(5000)]):
        assert all(0.0 <= u < 1.0 for u in draws)
        bins = Counter(int(u * 10) for u in draws)
        chi2 = sum((bins[b] - 500) ** 2 / 500 for b in range(10))
        assert chi2 < 33.7  # df 9, p = 1e-4


def test_uniform_rejects_bad_position() -> None:
    with pytest.raises(ValueError, match="output position"):
        uniform(0, -1)


# --- alone == batched -------------------------------------------------------------------------

params_st = st.builds(
    SamplingParams,
    temperature=st.sampled_from([0.0, 0.3, 1.0, 1.7]),
    top_k=st.sampled_from([0, -1, 1, 3, 10]),
    top_p=st.sampled_from([1.0, 0.9, 0.5, 0.05]),
    min_p=st.sampled_from([0.0, 0.05, 0.3]),
    presence_penalty=st.sampled_from([0.0, 0.5, -1.0]),
    frequency_penalty=st.sampled_from([0.0, 0.3, 2.0]),
    repetition_penalty=st.sampled_from([1.0, 1.3, 0.8]),
    seed=st.integers(0, 2**64 - 1),
    logprobs=st.just(True),
    top_logprobs=st.integers(0, 5),
    logit_bias=st.dictionaries(
        st.integers(0, 1), st.sampled_from([-100.0, -2.5, 0.0, 3.0, 100.0]), max_size=2
    ),
)


def _history(rng: random.Random, vocab: int) -> RowHistory:
    prompt = [rng.randrange(vocab) for _ in range(rng.randrange(6))]
    return RowHistory(prompt, [rng.randrange(vocab) for _ in range(rng.randrange(6))])


@settings(max_examples=60, deadline=None)
@given(
    vocab=st.integers(2, 40),
    row_params=st.lists(params_st, min_size=1, max_size=6),
    data_seed=st.integers(0, 2**32 - 1),
    ties=st.booleans(),
)
def test_alone_equals_batched(vocab, row_params, data_seed, ties) -> None:
    rng = random.Random(data_seed)
    gen = torch.Generator().manual_seed(data_seed)
    logits = torch.randn(len(row_params), vocab, generator=gen) * 3
    if ties:  # coarse values make equal logits common
        logits = logits.round()
    rows = [(p, rng.randrange(1000), _history(rng, vocab)) for p in row_params]
    alone = [sample_row(logits[i].clone(), *rows[i]) for i in range(len(rows))]

    perm = list(range(len(rows)))
    rng.shuffle(perm)
    batched = sample_rows(logits[perm], [rows[i] for i in perm])
    for j, i in enumerate(perm):
        assert batched[j].token == alone[i].token
        assert _bits(batched[j].logprob) == _bits(alone[i].logprob)
        assert batched[j].top_logprobs == alone[i].top_logprobs


def _bits(x: float) -> bytes:
    return torch.tensor(x, dtype=torch.float64).numpy().tobytes()


def test_row_result_ignores_neighbours() -> None:
    gen = torch.Generator().manual_seed(0)
    mine = torch.randn(50, generator=gen)
    params = SamplingParams(temperature=0.9, top_p=0.95, seed=1234)
    expected = [sample_row(mine, params, t, RowHistory()).token for t in range(20)]
    for batch in (2, 5, 9):
        for t in range(20):
            logits = torch.randn(batch, 50, generator=gen)
            logits[batch // 2] = mine
            others = [(SamplingParams(seed=t + b), t, RowHistory()) for b in range(batch)]
            others[batch // 2] = (params, t, RowHistory())
            assert sample_rows(logits, others)[batch // 2].token == expected[t]


def test_different_seeds_differ() -> None:
    logits = torch.zeros(16)
    tokens = [sample_row(logits, SamplingParams(seed=s), 0, RowHistory()).token for s in range(64)]
    assert len(set(tokens)) >= 12
    runs = {
        tuple(sample_row(logits, SamplingParams(seed=s), t, RowHistory()).token for t in range(8))
        for s in range(32)
    }
    assert len(runs) == 32


def test_unseeded_sampling_is_refused() -> None:
    with pytest.raises(ValueError, match="with_seed"):
        sample_row(torch.zeros(4), SamplingParams(), 0, RowHistory())


def test_with_seed() -> None:
    drawn = SamplingParams().with_seed()
    assert drawn.seed is not None and 0 <= drawn.seed < 2**63
    assert SamplingParams().with_seed().seed != drawn.seed
    fixed = SamplingParams(seed=5)
    assert fixed.with_seed() is fixed


# --- greedy -----------------------------------------------------------------------------------


def test_greedy_ties_go_to_lowest_id() -> None:
    logits = torch.tensor([1.0, 3.0, 2.0, 3.0, 3.0])
    result = sample_row(logits, SamplingParams(temperature=0), 0, RowHistory())
    assert result.token == 1
    assert result.logprob == pytest.approx(float(torch.log_softmax(logits, 0)[1]))


@settings(max_examples=50, deadline=None)
@given(data_seed=st.integers(0, 2**32 - 1), vocab=st.integers(1, 30), t=st.integers(0, 99))
def test_top_k_1_equals_greedy(data_seed, vocab, t) -> None:
    logits = torch.randn(vocab, generator=torch.Generator().manual_seed(data_seed)).round()
    history = RowHistory([0], [vocab - 1])
    pen = dict(repetition_penalty=1.2, frequency_penalty=0.5)
    greedy = sample_row(logits, SamplingParams(temperature=0, **pen), t, history)
    top1 = sample_row(logits, SamplingParams(top_k=1, seed=data_seed, **pen), t, history)
    assert top1 == greedy


# --- filtering --------------------------------------------------------------------------------


def _frequencies(probs: list[float], params: SamplingParams, n: int = 4000) -> Counter[int]:
    logits = torch.tensor(probs).log()
    return Counter(
        sample_row(logits, SamplingParams(**{**vars(params), "seed": s}), 0, RowHistory()).token
        for s in range(n)
    )


def _chi2(counts: Counter[int], expected: dict[int, float], n: int) -> float:
    assert set(counts) <= set(expected)
    return sum((counts[i] - n * p) ** 2 / (n * p) for i, p in expected.items())


PROBS = [0.05, 0.4, 0.1, 0.25, 0.2]  # by token id; descending order is 1, 3, 4, 2, 0


@pytest.mark.parametrize(
    "params, kept",
    [
        (SamplingParams(), [0, 1, 2, 3, 4]),
        (SamplingParams(top_k=2), [1, 3]),
        (SamplingParams(top_k=3), [1, 3, 4]),
        (SamplingParams(top_p=0.39), [1]),
        (SamplingParams(top_p=0.41), [1, 3]),
        (SamplingParams(top_p=0.7), [1, 3, 4]),
        (SamplingParams(min_p=0.49), [1, 3, 4]),  # p >= 0.196
        (SamplingParams(min_p=0.51), [1, 3]),
        # top_p sees top_k's renormalised mass: 3 and 4 reach 0.684 (not 0.65) of it
        (SamplingParams(top_k=4, top_p=0.67), [1, 3]),
        (SamplingParams(top_k=3, min_p=0.55), [1, 3]),
        (SamplingParams(temperature=0.5, top_p=0.75), [1, 3]),  # p ~ 0.6, 0.23, 0.15, ..
    ],
)
def test_filtering_keeps_exactly_the_expected_tokens(params, kept) -> None:
    n = 4000
    counts = _frequencies(PROBS, params, n)
    weights = {i: PROBS[i] ** (1 / params.temperature) for i in kept}
    total = sum(weights.values())
    assert set(counts) == set(kept)
    assert _chi2(counts, {i: w / total for i, w in weights.items()}, n) < 23.5  # df <= 4, 1e-4


def test_sampled_frequencies_match_distribution() -> None:
    probs = [0.02, 0.5, 0.08, 0.15, 0.25]
    n = 5000
    counts = _frequencies(probs, SamplingParams(temperature=1.0), n)
    assert _chi2(counts, dict(enumerate(probs)), n) < 23.5


def test_zero_probability_tokens_are_never_drawn() -> None:
    logits = torch.tensor([0.0, float("-inf"), 0.0, float("-inf")])
    drawn = {sample_row(logits, SamplingParams(seed=s), 0, RowHistory()).token for s in range(300)}
    assert drawn == {0, 2}


# --- penalties and logprobs -------------------------------------------------------------------


def test_penalties_match_hand_computed_values() -> None:
    logits = torch.tensor([2.0, -2.0, 1.0, -1.0, 0.5, 3.0])
    history = RowHistory(prompt_ids=[0, 1], output_ids=[2, 3, 2, 5])
    rep = apply_penalties(logits, SamplingParams(repetition_penalty=2.0), history)
    assert rep.tolist() == [1.0, -4.0, 0.5, -2.0, 0.5, 1.5]
    freq = apply_penalties(
        logits, SamplingParams(frequency_penalty=0.5, presence_penalty=0.25), history
    )  # counts: 2 -> 2, 3 -> 1, 5 -> 1
    assert freq.tolist() == [2.0, -2.0, 1.0 - 1.0 - 0.25, -1.0 - 0.5 - 0.25, 0.5, 3.0 - 0.75]
    both = apply_penalties(
        logits, SamplingParams(repetition_penalty=2.0, frequency_penalty=-1.0), history
    )  # repetition first, then frequency
    assert both.tolist() == [1.0, -4.0, 2.5, -1.0, 0.5, 2.5]
    assert apply_penalties(logits, SamplingParams(), history) is logits


def test_history_counts_incrementally() -> None:
    history = RowHistory(prompt_ids=[1, 1, 4])
    seen, counts = history.dense(6, torch.device("cpu"))
    assert seen.tolist() == [False, True, False, False, True, False]
    for token in (2, 2, 5):
        history.append(token)
    seen, counts = history.dense(6, torch.device("cpu"))
    assert history.counts == {2: 2, 5: 1}
    assert counts.tolist() == [0, 0, 2, 0, 0, 1]
    assert seen.tolist() == [False, True, True, False, True, True]
    fresh = RowHistory([1, 1, 4], [2, 2, 5]).dense(6, torch.device("cpu"))
    assert torch.equal(fresh[0], seen) and torch.equal(fresh[1], counts)


def test_greedy_still_applies_penalties() -> None:
    logits = torch.tensor([1.0, 1.5, 0.0])
    history = RowHistory(output_ids=[1])
    assert sample_row(logits, SamplingParams(temperature=0), 0, history).token == 1
    params = SamplingParams(temperature=0, presence_penalty=1.0)
    assert sample_row(logits, params, 0, history).token == 0


def test_logprobs_are_before_temperature_and_filtering() -> None:
    logits = torch.tensor([0.5, 2.0, 1.0, 2.0, -1.0])
    params = SamplingParams(temperature=0.3, top_k=2, seed=3, logprobs=True, top_logprobs=3)
    result = sample_row(logits, params, 0, RowHistory())
    raw = torch.log_softmax(logits, 0)
    assert result.token in (1, 3)
    assert result.logprob == float(raw[result.token])
    assert result.top_logprobs == [(1, float(raw[1])), (3, float(raw[3])), (2, float(raw[2]))]
    assert sample_row(logits, SamplingParams(seed=3), 0, RowHistory()).top_logprobs == []


# --- validation -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "field, value",
    [
        ("temperature", -0.1),
        ("temperature", float("nan")),
        ("temperature", "hot"),
        ("top_k", -2),
        ("top_k", 1.5),
        ("top_p", 0.0),
        ("top_p", 1.01),
        ("min_p", -0.01),
        ("min_p", 1.5),
        ("presence_penalty", 2.5),
        ("frequency_penalty", -2.01),
        ("repetition_penalty", 0.0),
        ("seed", 2**64),
        ("seed", 1.0),
        ("max_tokens", 0),
        ("max_tokens", True),
        ("stop", [""]),
        ("stop", [str(i) for i in range(17)]),
        ("stop", [1]),
        ("stop_token_ids", [-1]),
        ("stop_token_ids", 5),
        ("ignore_eos", 1),
        ("logprobs", "yes"),
        ("top_logprobs", 21),
        ("logit_bias", [1, 2]),
        ("logit_bias", {"x": 1}),
        ("logit_bias", {"-1": 1}),
        ("logit_bias", {True: 1}),
        ("logit_bias", {"5": "high"}),
        ("logit_bias", {"5": float("nan")}),
        ("logit_bias", {"5": True}),
    ],
)
def test_validation_names_field(field, value) -> None:
    kwargs = {field: value}
    if field == "top_logprobs":
        kwargs["logprobs"] = True
    with pytest.raises(SamplingParamsError) as err:
        SamplingParams(**kwargs)
    assert err.value.field == field
    assert str(err.value).startswith(field)
    assert isinstance(err.value, ValueError)


def test_top_logprobs_needs_logprobs() -> None:
    with pytest.raises(SamplingParamsError, match="top_logprobs needs logprobs"):
        SamplingParams(top_logprobs=2)


def test_params_are_normalised_and_frozen() -> None:
    params = SamplingParams(top_k=-1, stop="###", stop_token_ids=[7, 8], seed=-5)
    assert params.top_k == 0 and params.stop == ("###",) and params.stop_token_ids == (7, 8)
    assert params.seed == -5 and uniform(params.seed, 0) == uniform(2**64 - 5, 0)
    with pytest.raises(AttributeError):
        params.temperature = 0.5  # type: ignore[misc]
    assert not math.isnan(SamplingParams(temperature=0).temperature)


def test_batched_greedy_rows_equal_sample_row_alone():
    """A round's rows are sampled together (sample_rows); greedy rows among sampled ones, with
    ties, penalties and top_logprobs, each get sample_row's token and logprob alone, ties going
    to the lowest id."""
    x = torch.randn(6, 500, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16).float()
    x[2, 40] = x[2, 7] = x[2].max() + 1  # a tie: the lowest id wins
    plain = SamplingParams(temperature=0)
    params = [plain] * 3 + [
        SamplingParams(temperature=0.8, seed=5, top_p=0.9),
        SamplingParams(temperature=0, logprobs=True, top_logprobs=2),
        SamplingParams(temperature=0, repetition_penalty=1.3),
    ]
    rows = [(p, 3, RowHistory([1, 2])) for p in params]
    got = sample_rows(x, rows)
    for i, (p, t, h) in enumerate(rows):
        assert got[i] == sample_row(x[i], p, t, h)
    assert got[2].token == 7
    assert len(got[4].top_logprobs) == 2 and got[4].top_logprobs[0][0] == got[4].token


def test_draw_weights_are_integers_exact_in_any_order():
    """The draw's prefix sums are integers: the same for a row alone, in a batch, reversed."""
    from tensorfold.engine.sampling import _draw_rows

    g = torch.Generator().manual_seed(2)
    x = torch.randn(5, 3000, generator=g) * 4
    order = torch.sort(x, dim=1, descending=True, stable=True).indices
    rows = [(SamplingParams(temperature=1.3, seed=s, top_p=0.97, min_p=0.01), s) for s in range(5)]
    together = _draw_rows(x, order, rows)
    for i in range(5):
        alone = _draw_rows(x[i : i + 1], order[i : i + 1], rows[i : i + 1])
        assert int(alone[0]) == int(together[i])


def test_logit_bias_is_normalised_and_clamped() -> None:
    params = SamplingParams(logit_bias={"7": 250, 3: -1e9, "12": 0.5})
    assert params.logit_bias == ((3, -100.0), (7, 100.0), (12, 0.5))
    assert SamplingParams(logit_bias={}).logit_bias == ()


def test_logit_bias_moves_the_draw_of_its_row_only() -> None:
    x = torch.randn(3, 64, generator=torch.Generator().manual_seed(3))
    top = int(torch.argmax(x[1]))
    favour = (top + 5) % 64
    plain = SamplingParams(temperature=0)
    biased = SamplingParams(temperature=0, logit_bias={favour: 100})
    banned = SamplingParams(temperature=0, logit_bias={top: -100})
    assert sample_row(x[1], plain, 0, RowHistory()).token == top
    assert sample_row(x[1], biased, 0, RowHistory()).token == favour
    assert sample_row(x[1], banned, 0, RowHistory()).token != top
    hot = SamplingParams(temperature=1.0, seed=9, logit_bias={favour: 100})
    assert {sample_row(x[1], hot, t, RowHistory()).token for t in range(20)} == {favour}
    rows = [(plain, 0, RowHistory()), (biased, 0, RowHistory()), (plain, 0, RowHistory())]
    together = sample_rows(x, rows)
    assert [r.token for r in together] == [
        sample_row(x[i], p, 0, h).token for i, (p, _, h) in enumerate(rows)
    ]
    with pytest.raises(ValueError, match="outside the 64-token vocabulary"):
        sample_row(x[0], SamplingParams(temperature=0, logit_bias={64: 1}), 0, RowHistory())
