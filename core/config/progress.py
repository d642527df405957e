"""Progress on long work (weights loading, `tensorfold bench`): a tqdm bar on stderr when it is
a terminal; otherwise a few plain log lines (the start, a tenth done at most every `interval`
seconds, the end), so that a log file or a CI job still shows how far long work got without a
line per step, and short work says only its start and end."""

from __future__ import annotations

import sys
import time
from typing import Any

from tensorfold.config.logs import get_logger

log = get_logger("tensorfold.progress")


class Progress:
    """`update(n)` as work gets done, `close()` at the end (or use it as a context manager).

    total: the work in `unit`s (bytes when `unit` is "B": shown as KiB, MiB, GiB).
    show: True draws the bar, False logs lines, None draws it when stderr is a terminal.
    note(text): a short status beside the bar, and in the log lines (e.g. "3/40 tensors").
    """

    def __init__(
        self,
        what: str,
        total: int,
        unit: str = "",
        show: bool | None = None,
        file: Any = None,
        interval: float = 5.0,
    ) -> None:
        self.what, self.total, self.unit, self.interval = what, total, unit, interval
        self._said = time.monotonic()
        self.done = 0
        self.status = ""
        self._tenths = 0
        self._closed = False
        out = file if file is not None else sys.stderr
        bar = out.isatty() if show is None else show
        self._bar = None
        if bar:
            from tqdm import tqdm

            self._bar = tqdm(
                total=total,
                desc=what,
                unit=unit or "it",
                unit_scale=unit == "B",
                unit_divisor=1024,
                file=out,
                dynamic_ncols=True,
                leave=True,
            )
        else:
            log.info(self._line())

    @staticmethod
    def _amount(n: int) -> str:
        for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
            if n >= size:
                return f"{n / size:.2f} {unit}"
        return f"{n} B"

    def note(self, text: str) -> None:
        self.status = text
        if self._bar is not None:
            self._bar.set_postfix_str(text, refresh=False)

    def update(self, n: int = 1) -> None:
        self.done += n
        if self._bar is not None:
            self._bar.update(n)
            return
        tenths = 10 * self.done // self.total if self.total else 10
        if self._tenths < tenths < 10 and time.monotonic() - self._said >= self.interval:
            self._tenths = tenths
            self._said = time.monotonic()
            log.info(self._line())

    def _line(self) -> str:
        if self.unit == "B":
            line = f"{self.what}: {self._amount(self.done)} of {self._amount(self.total)}"
        else:
            line = f"{self.what}: {self.done}/{self.total} {self.unit}".rstrip()
        return f"{line}, {self.status}" if self.status else line

    def close(self, finished: bool = False) -> None:
        """finished: the work is done though less than `total` was needed (the rest was left
        on purpose), so the end is not said as stopped."""
        if self._closed:
            return
        self._closed = True
        if finished:
            self.total = self.done
        if self._bar is not None:
            self._bar.close()
        else:
            log.info(self._line() + ("" if self.done >= self.total else " (stopped)"))

    def __enter__(self) -> Progress:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
