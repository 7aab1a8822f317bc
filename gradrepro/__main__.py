"""``python -m gradrepro experiment=NAME [key=value ...]`` and the ``gradrepro`` script: one run
(or ``-m``, a sweep).

torch and Hydra take seconds to import; a Ctrl-C, SIGTERM or SIGHUP in that time is one line and the
shell's exit code (128 + the signal's number), not a traceback: nothing has been written yet.
"""

import signal
import sys

from gradrepro.errors import RAISED_SIGNALS, exit_code_of_signal, interrupt_on_stop_signals, signal_of

# SIGINT, SIGTERM, SIGHUP: KeyboardInterrupt while the imports run. SIGINT too: a command started
# in the background by a non-interactive shell inherits SIGINT ignored, and Python then keeps
# it ignored, so a Ctrl-C sent during start-up would be lost until the run's own handler.
interrupt_on_stop_signals(sigint=True)
if sys.argv[1:] in (["--help"], ["-h"]) and __name__ == "__main__":  # no import of torch or Hydra to say it
    from gradrepro.config.short_help import short_help

    print(short_help())
    sys.exit(0)
try:
    from gradrepro.cli import main as _cli_main

    if RAISED_SIGNALS:  # raised, but an import caught it: the start-up was interrupted all the same
        _cli_main, _signum = None, RAISED_SIGNALS[0]
except KeyboardInterrupt as _stopped:
    _cli_main, _signum = None, signal_of(_stopped)


def main() -> None:
    """Run the command line; a signal during start-up ends it with one line."""
    if _cli_main is None:
        print(f"gradrepro: interrupted ({signal.Signals(_signum).name}) while starting; nothing was run "
              "or written", file=sys.stderr)
        sys.exit(exit_code_of_signal(_signum))
    _cli_main()


if __name__ == "__main__":
    main()
