"""Progress where standard error is not a terminal (a log file, CI, ``nohup``): a bar redrawn
in place would be noise there, and silence for a run of many minutes looks like a hang. So a
plain line at a fixed interval, as training tools do in logs (Lightning's and Keras' progress
every N steps, tqdm's ``mininterval``):

    gradrepro: simsiam_baseline: step 1200/3000 (40%), 2m00s elapsed, ~3m00s left, loss=0.4321

every ``GRADREPRO_PROGRESS_SECONDS`` (default 30 s; 0: every step)."""

from __future__ import annotations

import os
import sys
import time
from typing import Any, Callable, Optional, TextIO

from gradrepro.errors import UserError

PROGRESS_SECONDS = 30.0


def progress_seconds() -> float:
    value = os.environ.get("GRADREPRO_PROGRESS_SECONDS", str(PROGRESS_SECONDS))
    try:
        seconds = float(value)
    except ValueError:
        seconds = -1.0
    if not seconds >= 0:
        raise UserError(f"GRADREPRO_PROGRESS_SECONDS={value!r} must be a number of seconds >= 0")
    return seconds


def _duration(seconds: float) -> str:
    seconds = int(round(seconds))
    if seconds >= 3600:
        return f"{seconds // 3600}h{seconds % 3600 // 60:02d}m"
    return f"{seconds // 60}m{seconds % 60:02d}s"


class ProgressLines:
    """The bar's interface (``update``, ``set_postfix``, ``close``), printing a line at most
    every ``every_s`` seconds."""

    def __init__(self, total: int, desc: str, every_s: Optional[float] = None, stream: Optional[TextIO] = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.total, self.desc, self.n = total, desc, 0
        self.every_s = progress_seconds() if every_s is None else every_s
        self.stream, self.clock = stream, clock
        self._start = self._last = clock()
        self._postfix: dict[str, Any] = {}

    def set_postfix(self, **kwargs: Any) -> None:
        self._postfix = kwargs

    def update(self, n: int = 1) -> None:
        self.n += n
        now = self.clock()
        if now - self._last >= self.every_s:
            self._last = now
            self._write(self.line(now))

    def line(self, now: float) -> str:
        elapsed = now - self._start
        share = self.n / self.total if self.total else 1.0
        left = f", ~{_duration(elapsed / share - elapsed)} left" if 0 < share < 1 else ""
        extra = "".join(f", {k}={v}" for k, v in self._postfix.items())
        return (f"gradrepro: {self.desc}: step {self.n}/{self.total} ({100 * share:.0f}%), "
                f"{_duration(elapsed)} elapsed{left}{extra}")

    def _write(self, line: str) -> None:
        stream = self.stream or sys.stderr
        stream.write(line + "\n")
        stream.flush()

    def close(self) -> None:
        pass
