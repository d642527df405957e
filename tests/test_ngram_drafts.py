"""Prompt-lookup drafts (tensorfold.engine.ngram_drafts): a draft is always what followed an
earlier occurrence of the history's suffix; none without a match; the longest suffix wins, the
most recent occurrence among equals; the scan and the incremental index agree."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tensorfold.engine.ngram_drafts import MAX_N, MIN_N, NgramDrafter, propose_ngram

# a small alphabet, so that histories repeat themselves and matches of every length occur
histories = st.lists(st.integers(0, 3), max_size=60)
sizes = st.integers(1, 6).flatmap(lambda hi: st.tuples(st.integers(1, hi), st.just(hi)))


def brute(history: list[int], k: int, max_n: int, min_n: int) -> list[int]:
    """The definition, spelled out: n from max_n down, the most recent earlier occurrence."""
    size = len(history)
    for n in range(min(max_n, size), min_n - 1, -1):
        suffix = history[size - n :]
        for e in range(size - 1, n - 1, -1):  # occurrence [e - n, e), a token after it
            if history[e - n : e] == suffix:
                return history[e : e + k] if k else []
    return []


@settings(max_examples=300, deadline=None)
@given(histories, st.integers(0, 8), sizes)
def test_the_scan_and_the_index_give_the_definition(history, k, n_range) -> None:
    min_n, max_n = n_range
    want = brute(history, k, max_n, min_n)
    assert propose_ngram(history, k, max_n, min_n) == want
    assert NgramDrafter(history, max_n, min_n).propose(k) == want


@settings(max_examples=200, deadline=None)
@given(histories, st.integers(1, 8), sizes)
def test_a_draft_followed_an_occurrence_of_the_matched_suffix(history, k, n_range) -> None:
    min_n, max_n = n_range
    draft = propose_ngram(history, k, max_n, min_n)
    assert len(draft) <= k
    if not draft:
        return
    size = len(history)
    # some n in min_n..max_n and an earlier end e: the suffix occurred at [e - n, e) and the
    # draft is what came after it there, up to k tokens or the history's end
    assert any(
        history[e - n : e] == history[size - n :] and history[e : e + k] == draft
        for n in range(min_n, min(max_n, size) + 1)
        for e in range(n, size)
    )


@settings(max_examples=200, deadline=None)
@given(histories, st.integers(1, 8), sizes)
def test_no_draft_means_no_earlier_occurrence(history, k, n_range) -> None:
    min_n, max_n = n_range
    if propose_ngram(history, k, max_n, min_n):
        return
    size = len(history)
    suffix = history[size - min_n :]
    assert size < min_n or all(history[e - min_n : e] != suffix for e in range(min_n, size))


@settings(max_examples=100, deadline=None)
@given(histories, histories, st.integers(0, 8))
def test_appending_piece_by_piece_is_building_at_once(first, then, k) -> None:
    drafter = NgramDrafter(first)
    for token in then:
        drafter.append(token)
        assert drafter.propose(k) == propose_ngram(drafter.history, k)
    assert len(drafter) == len(first) + len(then)
    assert drafter.propose(k) == NgramDrafter(first + then).propose(k)


def test_the_longest_suffix_wins_over_a_more_recent_shorter_one() -> None:
    #          0  1  2  3  4  5  6  7  8  9
    history = [1, 2, 3, 7, 9, 3, 8, 1, 2, 3]
    # suffix 1 2 3 occurred at [0, 3) (then 7 9); 3 alone more recently at 5 (then 8 1)
    assert propose_ngram(history, 2) == [7, 9]
    assert propose_ngram(history, 2, max_n=1) == [8, 1]
    assert NgramDrafter(history).propose(2) == [7, 9]


def test_the_most_recent_among_equal_lengths_wins() -> None:
    history = [5, 6, 1, 5, 6, 2, 5, 6]
    assert propose_ngram(history, 3) == [2, 5, 6]
    assert NgramDrafter(history).propose(1) == [2]


def test_nothing_matches_nothing_is_drafted() -> None:
    assert propose_ngram([], 4) == []
    assert propose_ngram([1], 4) == []
    assert propose_ngram([1, 2, 3, 4], 4) == []
    assert propose_ngram([1, 2, 1, 3], 4, min_n=2) == []  # 1 3 never occurred before
    assert NgramDrafter([1, 2, 3, 4]).propose(4) == []
    assert propose_ngram([1, 2, 1, 2], 0) == []


def test_a_draft_stops_at_the_history_end() -> None:
    # a period-2 tail: "1 2 1 2" last occurred at [0, 4), and two tokens follow it
    assert propose_ngram([1, 2, 1, 2, 1, 2], 8) == [1, 2]
    assert propose_ngram([4, 4, 4], 5) == [4]  # "4 4" at [0, 2), then the last 4


def test_the_defaults_and_bad_sizes() -> None:
    assert (MIN_N, MAX_N) == (1, 4)
    with pytest.raises(ValueError, match="min_n"):
        propose_ngram([1, 2], 1, max_n=1, min_n=2)
    with pytest.raises(ValueError, match="min_n"):
        NgramDrafter([], min_n=0)
    with pytest.raises(ValueError, match="k must be"):
        propose_ngram([1, 2], -1)
