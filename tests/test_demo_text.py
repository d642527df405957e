"""The demo text and the check that tells a demo's words from noise."""

from tensorfold.family.demo_text import QA, THOUGHTS, known_share, paragraphs, plain_text, words


def test_noise_is_not_words() -> None:
    # What the demo wrote with random weights (issue 22): a check at 80% refuses it.
    assert (
        known_share("\ufffd Fr con\ufffd\u001c\ufffdPar light3 se\ufffd 5 fromcacheU\u001e al6")
        < 0.8
    )
    assert known_share("Paris is the capital of France.") == 1.0
    assert known_share("") == 0.0


def test_the_text_holds_every_paragraph_and_answer() -> None:
    text = plain_text()
    assert all(" ".join(p.split()) in " ".join(text.split()) for p in paragraphs())
    assert all(f"{q} {a}" in text for q, a in QA)
    assert {"paris", "engine", "fox", "once"} <= words()


def test_every_question_has_a_short_thought_in_the_text() -> None:
    assert list(THOUGHTS) == [q for q, _ in QA]
    assert all(2 <= len(t.split()) <= 10 and t in plain_text() for t in THOUGHTS.values())
    assert all(known_share(t) == 1.0 for t in THOUGHTS.values())
