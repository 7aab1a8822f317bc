"""The exception types that reach users as a single line, and the exit codes that go with them."""

from __future__ import annotations

import contextlib
import signal
import sys
import warnings
from typing import Any, Callable, Iterator


class UserError(Exception):
    """Bad input from the user: a config value, a path, a device. Printed as one line."""


class Interrupted(KeyboardInterrupt):
    """A SIGINT or SIGTERM that arrived where no run was there to record it (start-up)."""

    def __init__(self, signum: int = signal.SIGINT) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


def stop_signals() -> list:
    """The signals that stop a run with its records: SIGINT (Ctrl-C), SIGTERM (kill, schedulers),
    and SIGHUP (the terminal closed) unless the run was started to ignore it (``nohup``)."""
    found = [signal.SIGINT, signal.SIGTERM]
    hangup = getattr(signal, "SIGHUP", None)
    if hangup is not None and signal.getsignal(hangup) is not signal.SIG_IGN:
        found.append(hangup)
    return found


# The signals ``raise_interrupted`` turned into KeyboardInterrupt, in order: an import that
# catches every exception (a library's optional-dependency probe, say) can swallow one, and the
# start-up then asks here whether a signal came although no KeyboardInterrupt reached it.
RAISED_SIGNALS: list = []


def raise_interrupted(signum: int, frame: Any) -> None:
    """A signal handler: SIGTERM is handled like Ctrl-C (KeyboardInterrupt), with its name kept."""
    RAISED_SIGNALS.append(int(signum))
    raise Interrupted(signum)


def signal_of(exc: BaseException) -> int:
    """The signal behind a KeyboardInterrupt (SIGINT unless it says otherwise)."""
    return int(getattr(exc, "signum", signal.SIGINT))


def first_line(exc: Any) -> str:
    """The first line of an exception's message (its type's name when it has none)."""
    return (str(exc).strip().splitlines() or [type(exc).__name__])[0]


@contextlib.contextmanager
def quiet_unless_it_fails() -> Iterator[None]:
    """Hold back the warnings of the block (torch's, say) and show them only if it succeeds:
    a refusal is one line, not warnings followed by the line."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        yield
    for w in caught:
        warnings.warn_explicit(w.message, w.category, w.filename, w.lineno)


EXIT_USER_ERROR = 2
EXIT_FAILED = 1  # a run that failed, or whose records could not all be written


def exit_code_of_signal(signum: int) -> int:
    """The shell's convention for a process ended by a signal: 128 + its number."""
    return 128 + int(signum)


def exit_on_user_error(prog: str, main: Callable[..., int], *args: Any) -> int:
    """``main(*args)``; a UserError becomes ``PROG: error: ...`` on one line and exit code 2."""
    try:
        return main(*args)
    except UserError as exc:
        print(f"{prog}: error: {exc}", file=sys.stderr)
        return EXIT_USER_ERROR


def interrupt_on_stop_signals(sigint: bool = False) -> dict:
    """Until a run installs its own handlers: SIGTERM and SIGHUP (and SIGINT where asked, which
    Python's own handler already turns into KeyboardInterrupt, but without noting it in
    ``RAISED_SIGNALS``) end the process like Ctrl-C (KeyboardInterrupt, with the signal's name),
    so start-up is interrupted cleanly too. Returns the handlers it replaced."""
    return {sig: signal.signal(sig, raise_interrupted) for sig in stop_signals()[0 if sigint else 1:]}
