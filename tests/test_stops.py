from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tensorfold.engine.sampling import SamplingParams
from tensorfold.engine.stops import StopChecker, StopStep

EOS = 2


def run(checker: StopChecker, pieces: list[str], token_ids: list[int] | None = None) -> list:
    ids = token_ids or [100 + i for i in range(len(pieces))]
    steps = []
    for token, piece in zip(ids, pieces):
        steps.append(checker.feed(token, piece))
        if steps[-1].finish_reason:
            break
    return steps


def test_stop_string_split_across_pieces_is_trimmed() -> None:
    steps = run(StopChecker(["</end>"]), ["Hello <", "/e", "nd> world"])
    assert [s.text for s in steps] == ["Hello ", "", ""]
    assert steps[-1] == StopStep("", "stop", "</end>")


def test_text_before_stop_string_in_same_piece_is_released() -> None:
    steps = run(StopChecker(["STOP"]), ["ab", "cdSTOPef"])
    assert steps == [StopStep("ab", None), StopStep("cd", "stop", "STOP")]


def test_held_text_released_when_it_cannot_become_a_stop() -> None:
    steps = run(StopChecker(["abc"]), ["xa", "b", "d", "e"])
    assert [s.text for s in steps] == ["x", "", "abd", "e"]
    assert all(s.finish_reason is None for s in steps)


def test_held_text_released_at_length() -> None:
    steps = run(StopChecker(["abc"], max_tokens=2), ["x", "ab", "c"])
    assert steps == [StopStep("x", None), StopStep("ab", "length")]


def test_held_text_released_at_eos_without_eos_text() -> None:
    checker = StopChecker(["abc"], eos_token_ids=[EOS])
    steps = run(checker, ["x", "ab", "</s>"], [10, 11, EOS])
    assert steps == [StopStep("x", None), StopStep("", None), StopStep("ab", "stop", None)]


def test_earliest_stop_string_wins() -> None:
    steps = run(StopChecker(["world", "lo w"]), ["hello world"])
    assert steps == [StopStep("hel", "stop", "lo w")]


@pytest.mark.parametrize("pieces", [["abc"], ["ab", "c"], ["a", "b", "c"]])
def test_stop_that_ends_first_wins_however_cut(pieces) -> None:
    steps = run(StopChecker(["abc", "b"]), pieces)
    assert "".join(s.text for s in steps) == "a"
    assert steps[-1].stop_reason == "b"


def test_overlapping_stop_prefixes_are_held() -> None:
    # "aab": after "aa" the suffix "aa" is a prefix of "aab"; "a" + "ab" completes it.
    steps = run(StopChecker(["aab"]), ["a", "a", "a", "b!"])
    assert [s.text for s in steps] == ["", "", "a", ""]
    assert steps[-1].finish_reason == "stop"


def test_stop_token_ids_stop_and_are_not_emitted() -> None:
    checker = StopChecker(stop_token_ids=[7])
    steps = run(checker, ["a", "<|im_end|>", "b"], [5, 7, 6])
    assert steps == [StopStep("a", None), StopStep("", "stop", 7)]


def test_ignore_eos_emits_eos_and_goes_on() -> None:
    checker = StopChecker(eos_token_ids=[EOS], ignore_eos=True, max_tokens=3)
    steps = run(checker, ["a", "</s>", "b"], [5, EOS, 6])
    assert steps == [StopStep("a", None), StopStep("</s>", None), StopStep("b", "length")]


def test_stop_token_beats_ignore_eos() -> None:
    checker = StopChecker(stop_token_ids=[EOS], eos_token_ids=[EOS], ignore_eos=True)
    assert checker.feed(EOS, "</s>") == StopStep("", "stop", EOS)


def test_max_tokens_gives_length() -> None:
    checker = StopChecker(max_tokens=3)
    steps = run(checker, ["a", "b", "c", "d"])
    assert steps[-1] == StopStep("c", "length")
    assert checker.num_tokens == 3 and checker.finish_reason == "length"


def test_stop_string_on_last_token_is_stop_not_length() -> None:
    steps = run(StopChecker(["c"], max_tokens=3), ["a", "b", "xc"])
    assert steps[-1] == StopStep("x", "stop", "c")


def test_feed_after_finish_is_refused() -> None:
    checker = StopChecker(max_tokens=1)
    checker.feed(1, "a")
    with pytest.raises(RuntimeError, match="already finished"):
        checker.feed(2, "b")


def test_flush_releases_held_text() -> None:
    checker = StopChecker(["###"])
    assert checker.feed(1, "ok#") == StopStep("ok", None)
    assert checker.held == "#"
    assert checker.flush() == "#" and checker.held == ""


def test_for_params() -> None:
    params = SamplingParams(stop=["\n\n"], stop_token_ids=[9], max_tokens=4, ignore_eos=True)
    checker = StopChecker.for_params(params, eos_token_ids=[EOS])
    assert checker.stop_strings == ("\n\n",) and checker.stop_token_ids == {9}
    assert checker.ignore_eos and checker.max_tokens == 4 and checker.eos_token_ids == {EOS}


def test_bad_arguments() -> None:
    with pytest.raises(ValueError, match="empty"):
        StopChecker([""])
    with pytest.raises(ValueError, match="max_tokens"):
        StopChecker(max_tokens=0)


@settings(max_examples=200, deadline=None)
@given(
    text=st.text(alphabet="abc#", max_size=30),
    stops=st.lists(st.text(alphabet="abc#", min_size=1, max_size=4), max_size=3),
    cuts=st.lists(st.integers(0, 30), max_size=10),
)
def test_any_split_gives_the_unsplit_answer(text, stops, cuts) -> None:
    """However the text is cut into pieces, the released text is the text up to the stop string
    that ends first (the longest on a tie), or all of it."""
    bounds = sorted({0, len(text), *(c for c in cuts if c <= len(text))})
    pieces = [text[a:b] for a, b in zip(bounds, bounds[1:])]
    checker = StopChecker(stops)
    released = "".join(s.text for s in run(checker, pieces))
    if checker.finish_reason is None:
        released += checker.flush()
    hits = [(i + len(s), i) for s in stops if (i := text.find(s)) >= 0]
    assert released == (text[: min(hits)[1]] if hits else text)
    assert checker.finish_reason == ("stop" if hits else None)
