"""``python -m gradrepro.compare PATH... [--by KEY ...] [--table T] [--signatures S] [--format F]
[--out F] [--plot F.png] [--wide]``

Reads any mix of run and sweep folders (recursively) and prints the comparison tables of
``analysis/tables.py``: runs, groups over seeds by the scientific knob, each ablation beside
its control, and each ablation's checks on it and on its control (``--table checks``, per
seed; ``--table margins``, over seeds). ``--signatures current`` evaluates the package's
current signatures on runs recorded before they changed.

Run folders are read as untrusted data (``records/reader.py``): a folder that cannot be used
is skipped with one warning line, and the tables still come out; the exit code is 1 only when
nothing was readable, 2 when ``--out`` or ``--plot`` names something that cannot be written
(a device, a folder, a read-only file). ``--format csv`` writes one table per file, so each
is what ``pandas.read_csv`` reads. After a multirun, :class:`SweepTableCallback` writes the
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

from gradrepro.analysis.checks import SIGNATURE_SOURCES
from gradrepro.analysis.compare_figure import metric_columns, plot_runs
from gradrepro.analysis.fit_width import WIDTH
from gradrepro.analysis.tables import TABLES, build_tables, render
from gradrepro.errors import UserError, exit_on_user_error
from gradrepro.records.claim import refuse_inside_records
from gradrepro.records.files import atomic_write, check_output_file, check_path_length, write_output
from gradrepro.records.reader import Run, load_runs

log = logging.getLogger(__name__)

FORMATS = ("markdown", "csv", "latex", "json")
TABLE_FILE = "comparison.md"  # written into a sweep folder by the callback
EXIT_NOTHING_READABLE = 1


def compare(
    paths: Sequence[Path], by: Optional[Sequence[str]] = None, signatures: str = "recorded"
) -> Tuple[Dict[str, pd.DataFrame], List[Run], List[str]]:
    """Load ``paths`` and build the tables: ``(tables, runs, warnings)``; ``{}`` if no runs."""
    runs, warnings = load_runs(paths)
    tables = build_tables(runs, by, warnings, signatures) if runs else {}
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
        "--wide",
        action="store_true",
        help="markdown: each table in one piece with whole cells (default: blocks of columns that "
        "fit 120 characters, long cells shortened to their end; csv always holds everything)",
    )
    parser.add_argument(
        "--table",
        choices=("all", *TABLES),
        default="all",
        help="which table to print (default: all)",
    )
    parser.add_argument(
        "--signatures",
        choices=SIGNATURE_SOURCES,
        default="recorded",
        help="the signatures the pairs, checks and margins tables evaluate: the ones the runs "
        "recorded (default), or the package's current configs composed with each run's overrides",
    )
    parser.add_argument(
        "--out",
        type=Path,
        help="write the table(s) here instead of stdout; with --format csv each table gets its "
        "own file: OUT, then OUT's name with .groups, .pairs, ... before the suffix",
    )
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
    return exit_on_user_error("gradrepro.compare", _compare_main, args)  # an unwritable output: one line


def _compare_main(args: argparse.Namespace) -> int:
    for path in args.paths:  # a name the file system cannot hold: one line, not a stat traceback
        check_path_length(path, "PATH")
    out = check_output_file(args.out, "--out") if args.out else None
    plot = check_output_file(args.plot, "--plot") if args.plot else None
    for given, what in ((args.out, "--out"), (args.plot, "--plot")):
        if given is not None:  # never over a run, a sweep or anything this command reads
            refuse_inside_records(given, args.paths, what)
    try:
        tables, runs, warnings = compare(args.paths, args.by, args.signatures)
    except KeyError as exc:
        raise UserError(exc.args[0]) from None
    for line in warnings:
        print(f"gradrepro.compare: warning: {line}", file=sys.stderr)
    if not runs:
        print(
            "gradrepro.compare: error: nothing readable under " + ", ".join(map(str, args.paths)),
            file=sys.stderr,
        )
        return EXIT_NOTHING_READABLE
    if plot:  # an unknown --metric would draw nothing: one line, before anything is written
        known = metric_columns(runs)
        if known and args.metric not in known:
            raise UserError(f"--metric {args.metric!r} is not recorded by these runs: choose from "
                            f"{', '.join(known)}")
    which = [t for t in (TABLES if args.table == "all" else (args.table,)) if not tables[t].empty]
    skipped = [t for t in (TABLES if args.table == "all" else (args.table,)) if tables[t].empty]
    if len(runs) == 1 and args.table == "all" and args.format != "csv":
        # One run: the groups repeat its row, and the checks and margins set it beside a control
        # that is not there. Its row holds every check; --table NAME prints another.
        which, skipped = [t for t in which if t == "runs"], []
    one_run = len(runs) == 1 and args.table == "all" and args.format != "csv"
    if args.format == "csv":  # one table per file: each one pandas.read_csv reads
        _write_csv(tables, which, out, len(runs), args.paths)
    else:
        text = render(tables, args.format, which, width=None if args.wide else WIDTH)
        if out:
            write_output(out, lambda tmp: Path(tmp).write_text(text), "--out")
            print(f"wrote {out} ({len(runs)} runs)", file=sys.stderr)
        else:
            sys.stdout.write(text)
    for name in skipped:
        print(f"gradrepro.compare: note: the {name} table is empty ({EMPTY[name]}): not written", file=sys.stderr)
    if one_run:  # after the output: an output that cannot be written stays one line
        print("gradrepro.compare: note: one run: its row only (the other tables compare runs: seeds, "
              "its control); --table NAME for one of them", file=sys.stderr)
    if plot:
        not_drawn: List[str] = []
        drawn = plot_runs(runs, plot, metric=args.metric, warnings=not_drawn)
        for line in not_drawn:
            print(f"gradrepro.compare: warning: {line}", file=sys.stderr)
        print(f"wrote {plot} ({drawn} runs drawn)", file=sys.stderr)
    return 0


# Why a table can be empty (said when it is, instead of writing an empty file).
EMPTY = {"runs": "no runs", "groups": "no complete runs", "pairs": "no ablation beside its control",
         "checks": "no ablation with a signature", "margins": "no ablation with a signature"}


def csv_paths(out: Path, names: Sequence[str]) -> Dict[str, Path]:
    """Where ``--format csv --out OUT`` writes each table: the first at OUT, every other one
    beside it as OUT's name with the table's (``cmp.csv``, ``cmp.groups.csv``, ...)."""
    return {name: out if i == 0 else out.with_name(f"{out.stem}.{name}{out.suffix or '.csv'}")
            for i, name in enumerate(names)}


def _write_csv(tables: Dict[str, pd.DataFrame], which: Sequence[str], out: Optional[Path], n_runs: int,
               inputs: Sequence[Path] = ()) -> None:
    if not which:
        return
    if out is None:  # stdout holds one file: the first table; the others need --table or --out
        sys.stdout.write(render(tables, "csv", which[:1]))
        if len(which) > 1:
            print(f"gradrepro.compare: note: csv on stdout is one table ({which[0]}); --table "
                  f"{'|'.join(which[1:])} for another, or --out FILE.csv for each in its own file", file=sys.stderr)
        return
    paths = {name: check_output_file(path, "--out") for name, path in csv_paths(out, which).items()}
    for path in paths.values():
        refuse_inside_records(path, inputs, "--out")
    for name, path in paths.items():
        text = render(tables, "csv", (name,))
        write_output(path, lambda tmp, t=text: Path(tmp).write_text(t), "--out")
    listing = ", ".join(f"{path} ({name})" for name, path in paths.items())
    print(f"wrote {listing} from {n_runs} runs", file=sys.stderr)


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
