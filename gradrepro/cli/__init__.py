"""The command line: ``python -m gradrepro experiment=NAME [key=value ...]`` (``-m``: a sweep).

Config errors are one line and exit code 2, before Hydra prints its multi-line report: the
preflight (``cli/preflight.py``) composes every combination a sweep names, one value at a
time, and validates it; only a config that composes and validates reaches ``hydra.main``.
``HYDRA_FULL_ERROR=1`` skips the translation and shows Hydra's own report, as Hydra users
expect. Hydra's own flags (``--help``, ``--cfg job``, ``--info``, ...) go to Hydra, once their
overrides compose; ``--config-name``, ``--config-dir`` and ``hydra.searchpath`` are honoured
by the preflight too.

The run (or sweep) folder is claimed before Hydra writes into it (``records/claim.py``): a
default name that exists already gets a suffix, a named folder that holds another run is
refused. The preflight claims it; the ``ClaimFolder`` callback (``cli/folder_claim.py``)
claims it again on every path, ``HYDRA_FULL_ERROR=1`` included, and points Hydra at the
folder claimed. A signal (Ctrl-C, SIGTERM, SIGHUP) at any moment is one line and exit code 128 + its number;
once the run folder exists, its summary.json says ``interrupted``.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import threading
import time
import traceback
from pathlib import Path
from typing import Optional, Sequence

import hydra
from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from omegaconf import DictConfig

from gradrepro.cli import preflight
from gradrepro.cli.folder_claim import release_claimed
from gradrepro.cli.sweep_names import exclude_fixed_knobs
from gradrepro.config.compose import CONFIG_DIR
from gradrepro.config.schema import register_configs
from gradrepro.errors import (
    EXIT_FAILED,
    EXIT_USER_ERROR,
    UserError,
    exit_code_of_signal,
    interrupt_on_stop_signals,
    signal_of,
)
from gradrepro.records.claim import claimed_here, release
from gradrepro.records.files import SUMMARY, ensure_writable_dir
from gradrepro.records.reader import load_runs
from gradrepro.train.finish import RecordsIncomplete, stub_summary, write_summary
from gradrepro.train.pipeline import run

# Flags after which Hydra prints something instead of running: these reach Hydra untouched.
_HYDRA_ONLY = ("help", "hydra_help", "cfg", "info", "shell_completion", "experimental_rerun")
# Of those, the ones for which Hydra composes the config from the overrides first.
_COMPOSING = ("help", "cfg", "info")

register_configs()


@hydra.main(version_base="1.3", config_path=str(CONFIG_DIR), config_name="config")
def hydra_app(cfg: DictConfig) -> None:
    """One job: the run, into the folder Hydra made for it.

    In a sweep (-m), a job that fails (bad input found only by the run, records that could not
    be written, a bug) says so in its summary.json and on one line, and the sweep goes on: the
    others run and the sweep's comparison table is still written. ``main`` then exits non-zero.
    """
    hc = HydraConfig.get()
    sweep = hc.mode == RunMode.MULTIRUN
    run_dir = Path(hc.runtime.output_dir)
    where = f" ({run_dir})" if sweep else ""
    try:
        summary = run(cfg, run_dir, overrides=list(hc.overrides.task))
    except UserError as exc:
        _fail(f"{exc}{where}", EXIT_USER_ERROR, sweep)
        return
    except RecordsIncomplete as exc:
        _fail(str(exc), EXIT_FAILED, sweep)
        return
    except Exception:  # noqa: BLE001 - a bug; in a sweep the other jobs still run
        if not sweep:
            raise
        traceback.print_exc()
        _fail(f"the job failed with the error above; its summary.json says so{where}", EXIT_FAILED, sweep)
        return
    if summary["status"] == "interrupted":
        # The shell's convention (128 + signal number): scripts and sweeps stop here too.
        sys.exit(exit_code_of_signal(signal.Signals[summary.get("signal") or "SIGINT"]))
    if summary["status"] == "failed":  # a reference run that failed
        _fail(f"{summary.get('error')}{where}", EXIT_FAILED, sweep)
    elif summary.get("missing"):  # a full disk at the end: what was kept is listed in the summary
        _fail(f"the records in {str(run_dir)!r} are incomplete: {'; '.join(summary['missing'])}",
              EXIT_FAILED, sweep)


_LOG_FAILURES: list = []  # log files a write to failed (a full or read-only disk): said once, at the end


def _quiet_log_errors(handler: logging.Handler, record: logging.LogRecord) -> None:
    """A log file that cannot be written: remembered, instead of logging's "--- Logging error ---"
    and a traceback for every record. The run's own ending says a full disk in one line."""
    exc = sys.exc_info()[1]
    where = getattr(handler, "baseFilename", None) or type(handler).__name__
    if where not in (w for w, _ in _LOG_FAILURES):
        _LOG_FAILURES.append((where, getattr(exc, "strerror", None) or str(exc) or type(exc).__name__))


def _say_log_failures() -> None:
    if _LOG_FAILURES:
        where, why = _LOG_FAILURES[0]
        print(f"gradrepro: warning: the log {where} is incomplete ({why}); the records are as the "
              "run says", file=sys.stderr)


def _fail(message: str, code: int, sweep: bool) -> None:
    print(f"gradrepro: error: {message}", file=sys.stderr)
    if not sweep:
        sys.exit(code)


def main(argv: Optional[Sequence[str]] = None) -> None:
    """The console script ``gradrepro`` and ``python -m gradrepro``."""
    argv = list(sys.argv[1:] if argv is None else argv)
    main_thread = threading.current_thread() is threading.main_thread()
    previous = interrupt_on_stop_signals() if main_thread else {}  # until a run takes them over
    folder: Optional[preflight.Checked] = None
    handle_error, logging.Handler.handleError = logging.Handler.handleError, _quiet_log_errors  # every handler
    try:
        folder = _prepare(argv)
        hydra_app()
        if folder is not None and folder.sweep:
            _report_failed_jobs(folder.path)
        _say_log_failures()  # only where nothing else was said: a failed run's line says more
    except UserError as exc:
        print(f"gradrepro: error: {exc}", file=sys.stderr)
        sys.exit(EXIT_USER_ERROR)
    except KeyboardInterrupt as exc:
        signum = signal_of(exc)
        where = _record_interruption(folder, signum)
        print(f"gradrepro: interrupted ({signal.Signals(signum).name}) {where}", file=sys.stderr)
        sys.exit(exit_code_of_signal(signum))
    finally:
        logging.Handler.handleError = handle_error
        _LOG_FAILURES.clear()
        if folder is not None and folder.path is not None:
            release(folder.path)
        release_claimed()
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def _prepare(argv: list) -> Optional[preflight.Checked]:
    """Check the command line and claim the output folder, before Hydra writes anything.
    Returns what was checked and claimed (None where Hydra alone answers)."""
    expanded = preflight.expand_globs(argv)
    preflight.check_launcher(expanded)
    if expanded != argv:  # hydra.main reads sys.argv
        argv = sys.argv[1:] = expanded
    args = preflight.parse_argv(argv)
    if args is None:
        return None
    if any(getattr(args, flag, None) for flag in _HYDRA_ONLY):
        if any(getattr(args, flag, None) for flag in _COMPOSING):
            preflight.check(argv, compose_only=True)  # a misspelt override: one line, not Hydra's report
        return None
    if os.environ.get("HYDRA_FULL_ERROR"):
        return None
    checked = preflight.check(argv)
    if checked.forced:  # what Hydra's primary compose of a sweep needs (preflight.forced_for_sweep)
        argv = sys.argv[1:] = [checked.forced.get(arg, arg) for arg in argv]
    if checked.path is not None:
        claimed = preflight.claim_output(checked)
        try:
            ensure_writable_dir(claimed)  # a full or read-only disk: one line, before Hydra writes
        except UserError:
            release(claimed)
            raise
        # Hydra must use the folder that was claimed: a fresh name, and any default name (Hydra
        # resolves ${now:...} again, maybe a second later, which is another run's folder).
        if claimed != checked.path or not checked.explicit:
            sys.argv[1:] = [*argv, f"{checked.key}={claimed}"]
        checked.path = claimed
    if checked.sweep:  # job folders named by what varied, not by every override
        exclude = exclude_fixed_knobs(checked.overrides)
        if exclude is not None:
            sys.argv[1:] = [*sys.argv[1:], exclude]
    return checked


def _record_interruption(checked: Optional[preflight.Checked], signum: int) -> str:
    """A signal before the run began: a claimed run folder gets a summary saying so."""
    if checked is None or checked.path is None or checked.sweep or not claimed_here(checked.path):
        return "before the run started; nothing was recorded"
    if (Path(checked.path) / SUMMARY).exists():
        return f"after the run; run folder: {checked.path}"
    try:
        write_summary(checked.path, stub_summary(checked.cfg, checked.overrides, "interrupted",
                                                 time.perf_counter(), signum=signum))
    except RecordsIncomplete as exc:
        return f"before training started; {exc}"
    return f"before training started; run folder: {checked.path} (its summary.json says so)"


def _report_failed_jobs(sweep_dir: Optional[Path]) -> None:
    """After a sweep: exit non-zero, in one line, if some of its jobs failed."""
    if sweep_dir is None:
        return
    runs, _ = load_runs([sweep_dir])
    failed = [r for r in runs if r.summary.get("status") == "failed" or r.summary.get("missing")]
    if failed:
        names = ", ".join(str(r.path.relative_to(sweep_dir)) for r in failed[:5])
        more = f" and {len(failed) - 5} more" if len(failed) > 5 else ""
        print(f"gradrepro: error: {len(failed)} of {len(runs)} jobs failed or lost records "
              f"({names}{more}); their summary.json says why", file=sys.stderr)
        sys.exit(EXIT_FAILED)
