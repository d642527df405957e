"""Progress on long work: a tqdm bar on a terminal, else a few log lines."""

from __future__ import annotations

import io

from structlog.testing import capture_logs

from tensorfold.config.progress import Progress


class Tty(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_a_terminal_gets_a_bar_and_no_log_lines() -> None:
    out = Tty()
    with capture_logs() as logs, Progress("loading weights", 3 * 2**20, "B", file=out) as p:
        for k in range(3):
            p.note(f"{k + 1}/3 tensors")
            p.update(2**20)
    text = out.getvalue()
    assert "loading weights: 100%" in text and "3.00M/3.00M" in text and "3/3 tensors" in text
    assert logs == []


def test_elsewhere_a_line_at_the_start_each_tenth_and_the_end() -> None:
    out = io.StringIO()  # not a terminal
    with (
        capture_logs() as logs,
        Progress("bench openai", 40, "requests", file=out, interval=0) as p,
    ):
        for _ in range(40):
            p.update()
    assert out.getvalue() == ""
    lines = [e["event"] for e in logs]
    assert lines == [
        f"bench openai: {n}/40 requests" for n in [0, 4, 8, 12, 16, 20, 24, 28, 32, 36, 40]
    ]


def test_a_stop_before_the_end_is_said() -> None:
    with capture_logs() as logs, Progress("loading weights", 3 * 2**30, "B", show=False) as p:
        p.update(2**30)
    assert logs[-1]["event"] == "loading weights: 1.00 GiB of 3.00 GiB (stopped)"
