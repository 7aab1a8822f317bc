"""What surrounds the training loop: the device, seeding, the thread count, signals, the
progress bar, the flush period and the versions a run records."""

from __future__ import annotations

import logging
import random
import signal
import sys
from typing import Any, Dict, Optional

import numpy as np
import torch
from tqdm.auto import tqdm

from gradrepro.errors import stop_signals
from gradrepro.train.progress_lines import ProgressLines

log = logging.getLogger(__name__)

def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def seed_everything(seed: int, device: torch.device) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    if device.type == "cpu":
        # Bit-identical records for the same config and seed on CPU.
        torch.use_deterministic_algorithms(True, warn_only=True)


class StopRequest:
    """SIGINT/SIGTERM set a flag; the loop finishes its step, records, and stops. A second
    signal raises KeyboardInterrupt (stop now; the records are still written). Nested (a
    reference run inside a run): a signal is also passed to the enclosing request, so the
    run that asked for the reference stops too instead of starting the next one."""

    def __init__(self) -> None:
        self.signal: Optional[int] = None
        self._previous: Dict[int, Any] = {}
        self.parent: Optional["StopRequest"] = None

    def __enter__(self) -> "StopRequest":
        for sig in stop_signals():
            try:
                self._previous[sig] = signal.signal(sig, self._handle)
            except ValueError:  # not the main thread (some launchers): leave signals alone
                pass
        owners = [getattr(h, "__self__", None) for h in self._previous.values()]
        self.parent = next((o for o in owners if isinstance(o, StopRequest)), None)
        return self

    def _handle(self, signum, frame) -> None:
        request: Optional[StopRequest] = self.parent
        while request is not None:  # every enclosing run stops as well
            request.signal = request.signal or signum
            request = request.parent
        if self.signal is not None:  # a second signal: stop now (the records are still written)
            raise KeyboardInterrupt
        self.signal = signum

    @property
    def name(self) -> str | None:
        return signal.Signals(self.signal).name if self.signal is not None else None

    def __exit__(self, *exc) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)


def progress(total: int, desc: str) -> Any:
    """A bar on a terminal; where standard error is not one (CI, pipes, logs, Hydra multirun),
    a plain line at a fixed interval instead (``train/progress_lines.py``)."""
    if not sys.stderr.isatty():
        return ProgressLines(total, desc)
    return tqdm(total=total, desc=desc, leave=False, dynamic_ncols=True)


class SafeBar:
    """The progress bar, where a failure of the bar (a closed terminal, a formatting error)
    switches the bar off with a warning and never stops training or costs records."""

    def __init__(self, total: int, desc: str) -> None:
        self._bar = None
        self._call(lambda: setattr(self, "_bar", progress(total, desc)))

    def _call(self, fn) -> None:
        try:
            fn()
        except Exception as exc:  # noqa: BLE001 - the bar must never stop a run
            log.warning("progress bar switched off: %s", exc)
            self._bar = None

    def set_postfix(self, **kwargs: Any) -> None:
        if self._bar is not None:
            self._call(lambda: self._bar.set_postfix(**kwargs))

    def update(self, n: int = 1) -> None:
        if self._bar is not None:
            self._call(lambda: self._bar.update(n))

    def close(self) -> None:
        if self._bar is not None:
            self._call(lambda: self._bar.close())
