"""``python -m gradrepro.compare PATH... [--by KEY ...] [--format F] [--out F] [--plot F.png]``

Reads any mix of run and sweep folders (recursively) and prints the comparison tables of
``analysis/tables.py``: runs, groups over seeds by the scientific knob, and each ablation
beside its control.

Unreadable folders are skipped with one warning line each; the exit code is non-zero
only when nothing was readable. After a multirun, :class:`SweepTableCallback` writes the
same tables into the sweep folder.
"""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Tuple

import pandas as pd
from hydra.experimental.callback import Callback

from gradrepro.analysis.compare_figure import plot_runs
from gradrepro.analysis.tables import TABLES, build_tables, render
from gradrepro.records.files import atomic_write
from gradrepro.records.reader import Run, load_runs

log = logging.getLogger(__name__)

FORMATS = ("markdown", "csv", "latex", "json")
TABLE_FILE = "comparison.md"  # written into a sweep folder by the callback
EXIT_NOTHING_READABLE = 1


def compare(
    paths: Sequence[Path], by: Optional[Sequence[str]] = None
) -> Tuple[Dict[str, pd.DataFrame], List[Run], List[str]]:
    """Load ``paths`` and build the tables: ``(tables, runs, warnings)``; ``{}`` if no runs."""
    runs, warnings = load_runs(paths)
    tables = build_tables(runs, by, warnings) if runs else {}
    return tables, runs, warnings


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m gradrepro.compare", description=__doc__.split("\n\n")[0].strip("`")
    )
    parser.add_argument(
        "paths",
        nargs="+",
        type=Path,
        metavar="PATH",
        help="run folders and/or sweep folders (searched recursively)",
    )
    parser.add_argument(
        "--by",
        nargs="+",
        action="extend",
        metavar="KEY",
        help="group by these columns (default: experiment and the differing overrides)",
    )
    parser.add_argument("--format", choices=FORMATS, default="markdown")
    parser.add_argument(
        "--table",
        choices=("all", *TABLES),
        default="all",
        help="which table to print (default: all; 'runs' gives one plain CSV)",
    )
    parser.add_argument("--out", type=Path, help="write the table(s) here instead of stdout")
    parser.add_argument(
        "--plot",
        type=Path,
        metavar="FILE.png",
        help="loss curves beside a per-module panel of --metric, one line per run",
    )
    parser.add_argument(
        "--metric",
        default="grad_norm",
        help="modules.parquet column for the per-module panel (default: grad_norm)",
    )
    args = parser.parse_args(argv)

    try:
        tables, runs, warnings = compare(args.paths, args.by)
    except KeyError as exc:
        parser.error(exc.args[0])
    for line in warnings:
        print(f"gradrepro.compare: warning: {line}", file=sys.stderr)
    if not runs:
        print(
            "gradrepro.compare: error: nothing readable under " + ", ".join(map(str, args.paths)),
            file=sys.stderr,
        )
        return EXIT_NOTHING_READABLE
    text = render(tables, args.format, TABLES if args.table == "all" else (args.table,))
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        atomic_write(args.out, lambda tmp: Path(tmp).write_text(text))
        print(f"wrote {args.out} ({len(runs)} runs)", file=sys.stderr)
    else:
        sys.stdout.write(text)
    if args.plot:
        skipped: List[str] = []
        lines = plot_runs(runs, args.plot, metric=args.metric, warnings=skipped)
        for line in skipped:
            print(f"gradrepro.compare: warning: {line}", file=sys.stderr)
        print(f"wrote {args.plot} ({lines} runs drawn)", file=sys.stderr)
    return 0


class SweepTableCallback(Callback):
    """After a multirun, write the sweep's comparison (markdown) into the sweep folder."""

    def __init__(self, filename: str = TABLE_FILE) -> None:
        self.filename = filename

    def on_multirun_end(self, config: Any, **kwargs: Any) -> None:
        sweep_dir = Path(config.hydra.sweep.dir)
        try:  # a table never costs the sweep its runs
            tables, runs, warnings = compare([sweep_dir])
            if not runs:
                log.warning("no readable runs in %s: no comparison written", sweep_dir)
                return
            text = render(tables, "markdown")
            if warnings:
                text += "\nWarnings:\n\n" + "\n".join(f"- {w}" for w in warnings) + "\n"
            atomic_write(sweep_dir / self.filename, lambda tmp: Path(tmp).write_text(text))
            log.info("comparison of %d runs: %s", len(runs), sweep_dir / self.filename)
        except Exception as exc:
            log.warning(
                "could not write %s: %s: %s", sweep_dir / self.filename, type(exc).__name__, exc
            )


if __name__ == "__main__":
    sys.exit(main())
