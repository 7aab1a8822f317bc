"""``python -m gradrepro.report``: the reference reproduction table in ``results/README.md``.

Runs every experiment (the list comes from ``gradrepro/configs/experiment/**.yaml``) at its default
scale on seeds no knob was chosen on, as Hydra multiruns on the joblib launcher (one per seed
set), then writes:

- ``results/README.md``: what the verdicts prove (claim kinds; every failure's checks against
  its control over the seeds, the margins table; ``analysis/evidence_report.py``), under the
  hash of the configs and signature code that judged the runs; one row per published claim
  (each signature check of each experiment, with the paper's reference beside it): the paper
  value, the measured value (mean ± std over seeds), how many seeds passed the check, the
  experiment's verdict, and the command that reproduces it; the claims and sources of each
  experiment; the measured time;
- ``results/figures/<experiment>.png``: the experiment's runs beside its control's runs
  (loss curves and per-module gradient norm; gradrepro.compare's ``--plot``).

Everything the report shows comes from each experiment's config (``claim``, ``control``,
``signature.checks[].paper``, ``paper``), so a new experiment needs no change here.
Seeds, by claim kind (``SEEDS_BY_KIND``): an empirical claim (a paper's measurement, measured
again) could come out either way, so it and its control run on 5 report seeds; a mechanism's
symptom follows from its config, so 2 do. A control runs on the seeds of every experiment it
controls. No report seed is a development seed: each page names the seeds its knobs were chosen
on (0 to 9 at most). ``--seeds`` gives every experiment the same seeds; ``--seeds-KIND`` (e.g.
``--seeds-empirical``) changes one kind's.

``--experiments`` restricts the set (fnmatch patterns, controls are added); ``--quick``
runs ``scale=tiny`` to check the pipeline in seconds (not a reference result);
``--from-sweep DIR`` rewrites the report from an existing sweep without running.
"""

from __future__ import annotations

import argparse
import fnmatch
import os
import platform
import subprocess
import sys
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Dict, List, Mapping, Optional, Sequence, Tuple

import pandas as pd

import gradrepro
from gradrepro.analysis.compare import compare
from gradrepro.analysis.compare_figure import plot_runs
from gradrepro.analysis.evidence_report import evidence_section, recorded_hash, stale_notice
from gradrepro.analysis.fit_width import markdown
from gradrepro.analysis.report_header import (
    claim_sentence,
    commits_sentence,
    control_sentence,
    here_sentence,
    runs_sentence,
    scale_of,
)
from gradrepro.analysis.tables import check_keys, for_reading
from gradrepro.config.compose import compose, group_options_recursive
from gradrepro.errors import UserError, exit_on_user_error
from gradrepro.records.claim import refuse_inside_records
from gradrepro.records.files import check_output_file, check_path_length, write_output
from gradrepro.records.provenance import source_hash
from gradrepro.records.reader import Run

# The folder that holds the gradrepro package: the sweep's processes import the same code.
PACKAGE_PARENT = Path(gradrepro.__file__).resolve().parent.parent
EXIT_FAILED = 1
# Seeds no knob of any experiment was chosen on (the pages list the seeds each was chosen on:
# 0 to 9 at most), by claim kind: an empirical verdict is a measurement that could have come out
# either way, so it is counted over 5 seeds; a mechanism's symptom follows from its config, and
# 2 seeds show that it does not depend on one draw.
SEEDS_BY_KIND: Dict[str, Tuple[int, ...]] = {"empirical": (100, 101, 102, 103, 104), "mechanism": (100, 101)}
# The seeds of a kind not listed (the strictest: an empirical claim's).
DEFAULT_SEEDS = SEEDS_BY_KIND["empirical"]


def select_experiments(patterns: Optional[Sequence[str]]) -> List[str]:
    """Experiment names matching ``patterns`` (all when none), each one's control added."""
    names = group_options_recursive("experiment")
    if not patterns:
        return names
    chosen = [n for n in names if any(fnmatch.fnmatch(n, p) for p in patterns)]
    if not chosen:
        raise SystemExit(
            f"gradrepro.report: error: no experiment matches {' '.join(patterns)}; "
            f"choose from: {', '.join(names)}"
        )
    for name in list(chosen):  # an ablation's row needs its control beside it
        control = _control_of(name)
        if control and control in names and control not in chosen:
            chosen.append(control)
    return sorted(chosen)


def _control_of(name: str) -> Optional[str]:
    """The experiment's ``control``, from its composed config."""
    return compose([f"experiment={name}"]).control


def _kind_of(name: str) -> Optional[str]:
    return compose([f"experiment={name}"]).claim_kind


def seeds_of(experiments: Sequence[str], by_kind: Mapping[str, Sequence[int]],
             kind_of=_kind_of, control_of=_control_of) -> Dict[str, Tuple[int, ...]]:
    """Each experiment's report seeds: its claim kind's (``by_kind``; a kind not listed gets
    ``DEFAULT_SEEDS``), and a control also every seed of the experiments it controls, so that
    each failure has its control's run of the same seed beside it."""
    def kind_seeds(name: str) -> set:
        return set(by_kind.get(kind_of(name) or "empirical", DEFAULT_SEEDS))

    seeds = {name: kind_seeds(name) for name in experiments}
    for name in experiments:
        control = control_of(name)
        if control in seeds:
            seeds[control] |= kind_seeds(name)
    return {name: tuple(sorted(s)) for name, s in seeds.items()}


def seed_groups(seeds: Mapping[str, Sequence[int]]) -> List[Tuple[Tuple[int, ...], List[str]]]:
    """The experiments grouped by their seeds: one multirun per group."""
    groups: Dict[Tuple[int, ...], List[str]] = {}
    for name, own in seeds.items():
        groups.setdefault(tuple(own), []).append(name)
    return sorted((key, sorted(names)) for key, names in groups.items())


def sweep_command(
    experiments: Sequence[str], seeds: Sequence[int], jobs: int, sweep_dir: Path, extra: Sequence[str] = ()
) -> List[str]:
    """The one multirun that produces every run of the report."""
    return [
        sys.executable,
        "-m",
        "gradrepro",
        "-m",
        f"experiment={','.join(experiments)}",
        f"seed={','.join(str(s) for s in seeds)}",
        "hydra/launcher=joblib",
        f"hydra.launcher.n_jobs={jobs}",
        f"hydra.sweep.dir={sweep_dir}",
        *extra,
    ]


def _mean_std(values: pd.Series) -> str:
    values = values.dropna()
    if values.empty:
        return "n/a"
    if len(values) == 1:
        return f"{values.iloc[0]:.4g}"
    return f"{values.mean():.4g} ± {values.std():.2g}"


def claims_table(
    runs: Sequence[Run], runs_df: pd.DataFrame, extra: Sequence[str] = ()
) -> pd.DataFrame:
    """One row per (experiment, signature check)."""
    rows = []
    suffix = "".join(f" {o}" for o in extra)
    for experiment, group in runs_df.groupby("experiment", sort=True):
        done = group[group["complete"].astype(bool)]
        run = runs[group.index[0]]
        checks = run.summary.get("checks") or []
        kind = run.summary.get("claim_kind") or ""
        verdict = f"{int(done['reproduced'].astype(bool).sum())}/{len(done)} seeds"
        if len(done) < len(group):
            verdict += f" ({len(group) - len(done)} incomplete)"
        passed = pd.DataFrame(
            [  # seeds x checks: did each check hold?
                dict(
                    zip(
                        check_keys(runs[i].summary.get("checks") or []),
                        (bool(c.get("ok")) for c in runs[i].summary.get("checks") or []),
                    )
                )
                for i in done.index
            ]
        )
        for key, check in zip(check_keys(checks), checks):
            ok = int(passed[key].fillna(False).astype(bool).sum()) if key in passed else 0
            rows.append(
                {
                    "experiment": experiment,
                    "claim": kind,
                    "role": check.get("role") or "evidence",
                    "check": f"{key} {check.get('op')} "
                    f"{float(check.get('threshold')):.4g}",
                    "paper": check.get("paper") or "",
                    "measured (mean ± std)": _mean_std(done[key]) if key in done else "n/a",
                    "check passed": f"{ok}/{len(done)}",
                    "signature held": verdict,
                    "command": "" if run.summary.get("recorded_by") else "`python -m gradrepro experiment="
                    f"{run.overrides.get('experiment', experiment)}"
                    f"{suffix}`",
                }
            )
    return pd.DataFrame(rows)


def _figures(runs: Sequence[Run], out_dir: Path, warnings: List[str]) -> Dict[str, Path]:
    by_name: Dict[str, List[Run]] = {}
    for run in runs:
        by_name.setdefault(run.experiment, []).append(run)
    paths = {}
    for name, own in sorted(by_name.items()):
        control = own[0].control
        shown = own + (by_name.get(control, []) if control else [])
        path = out_dir / "figures" / f"{name.replace('/', '__')}.png"
        plot_runs(shown, path, warnings=warnings)
        paths[name] = path
    return paths


def write_report(
    runs: Sequence[Run],
    tables: Dict[str, pd.DataFrame],
    out_dir: Path,
    header: str,
    extra: Sequence[str] = (),
    warnings: Optional[List[str]] = None,
) -> Path:
    """``out_dir/README.md`` and ``out_dir/figures/*.png`` from the loaded runs and their tables."""
    warnings = warnings if warnings is not None else []
    runs_df = tables["runs"]
    figures = _figures(runs, out_dir, warnings)
    table = claims_table(runs, runs_df, extra)
    lines = [header, "", *evidence_section(runs, tables, source_hash()), "## Every check, over the seeds", "",
             markdown(table), "", "## Experiments", ""]
    for name in sorted(figures):
        run = next(r for r in runs if r.experiment == name)
        paper = run.summary.get("paper") or {}
        here = here_sentence(name, runs, runs_df)  # beside the claim: what its signature did here
        lines += [f"### {name}", "", f"{claim_sentence(run)} {control_sentence(name, runs)} {here}".rstrip(), ""]
        lines += [f"- {k}: {v}" for k, v in paper.items()] + [""]
        lines += [f"![{name}](figures/{figures[name].name})", ""]
    lines += [
        "## Per-experiment means",
        "",
        markdown(for_reading(_group_means(runs_df))),
        "",
    ]
    if warnings:
        lines += ["## Warnings", ""] + [f"- {w}" for w in warnings] + [""]
    path = out_dir / "README.md"
    write_output(path, lambda tmp: Path(tmp).write_text("\n".join(lines)), "the report")
    return path


def _group_means(runs_df: pd.DataFrame) -> pd.DataFrame:
    done = runs_df[runs_df["complete"].astype(bool)]
    stats = done.groupby("experiment")[["final_loss", "steps", "wall_s"]].agg(["mean", "std"])
    stats.columns = [f"{c} {s}" for c, s in stats.columns]
    return stats.reset_index()


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m gradrepro.report", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument(
        "--experiments",
        nargs="+",
        metavar="PATTERN",
        help="only these experiments (fnmatch patterns; their controls are added)",
    )
    parser.add_argument(
        "--seeds", type=int, nargs="+", metavar="SEED",
        help="the seeds of every experiment, whatever its claim kind (default: by kind, below)",
    )
    for kind, seeds in SEEDS_BY_KIND.items():
        parser.add_argument(
            f"--seeds-{kind}", type=int, nargs="+", default=list(seeds), metavar="SEED",
            help=f"the seeds of an experiment whose claim kind is {kind}, and of its control (default "
            f"{' '.join(map(str, seeds))}: seeds no knob was chosen on)",
        )
    parser.add_argument(
        "--jobs",
        type=int,
        default=os.cpu_count() or 1,
        help="parallel joblib jobs (default: the number of CPU cores)",
    )
    parser.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch threads per run (default 1: jobs x threads should not exceed the cores; "
        "parallel runs use small models better than parallel kernels)",
    )
    parser.add_argument(
        "--quick",
        action="store_true",
        help="scale=tiny: checks the pipeline in seconds; NOT a reference result",
    )
    parser.add_argument(
        "--out", type=Path, default=Path("results"), help="report folder (default results/)"
    )
    parser.add_argument(
        "--sweep-dir", type=Path, help="where the runs go (default results/sweeps/report-TIME)"
    )
    parser.add_argument(
        "--from-sweep", type=Path, help="write the report from this sweep; run nothing"
    )
    parser.add_argument(
        "--mark-stale", metavar="WHAT_CHANGED",
        help="run nothing: put a notice at the top of OUT/README.md that its tables are older than "
        "the package's configs and signature code, saying what changed (replaced by the next report)",
    )
    parser.add_argument(
        "overrides", nargs="*", help="extra overrides for every run (e.g. threads=1)"
    )
    args = parser.parse_args(argv)
    if args.mark_stale is not None:
        return exit_on_user_error("gradrepro.report", _mark_stale, Path(args.out) / "README.md", args.mark_stale)
    args.seeds_by_kind = {kind: args.seeds or getattr(args, f"seeds_{kind}") for kind in SEEDS_BY_KIND}
    if min(args.jobs, args.threads) < 1 or any(
            min(s) < 0 or len(set(s)) < len(s) for s in args.seeds_by_kind.values()):
        parser.error("--jobs and --threads must be >= 1, and --seeds distinct numbers >= 0")
    return exit_on_user_error("gradrepro.report", _report_main, args)  # an unwritable output: one line


def _mark_stale(report: Path, why: str) -> int:
    """The stale notice written into an existing report (``evidence_report.stale_notice``)."""
    if not why.strip():
        raise UserError("--mark-stale needs a sentence saying what changed since the tables were made")
    text = report.read_text() if report.is_file() else ""
    if recorded_hash(text) is None:
        raise UserError(f"{report} is not a report made by python -m gradrepro.report (no source hash in it)")
    if recorded_hash(text) == source_hash():
        raise UserError(f"{report} was made by the package's current configs and signature code: it is not stale")
    marked = stale_notice(text, source_hash(), why)
    write_output(report, lambda tmp: Path(tmp).write_text(marked), "the report")
    print(f"gradrepro.report: {report} marked as older than the code with source hash {source_hash()}")
    return 0


def _report_main(args: argparse.Namespace) -> int:
    check_output_file(Path(args.out) / "README.md", "--out")
    # The report and its figures never land in a run or sweep folder, nor in the sweep it reads.
    refuse_inside_records(Path(args.out) / "README.md", [p for p in (args.from_sweep, args.sweep_dir) if p], "--out")
    extra = (["scale=tiny"] if args.quick else []) + list(args.overrides)
    # Threads change speed, not the experiment: in the sweep, not in the reproduce command.
    speed = [] if any(o.startswith("threads=") for o in extra) else [f"threads={args.threads}"]

    started = time.perf_counter()
    if args.from_sweep:
        check_path_length(args.from_sweep, "--from-sweep")
        sweep_dir, experiments = args.from_sweep, None
    else:
        experiments = select_experiments(args.experiments)
        stamp = datetime.now().strftime("%Y-%m-%d_%H-%M-%S")
        sweep_dir = args.sweep_dir or Path("results") / "sweeps" / f"report-{stamp}"
        groups = seed_groups(seeds_of(experiments, args.seeds_by_kind))
        env = {
            **os.environ,
            "PYTHONPATH": os.pathsep.join(filter(None, [str(PACKAGE_PARENT), os.environ.get("PYTHONPATH")])),
        }
        for seeds, names in groups:  # one multirun per seed set, each in its own folder
            folder = sweep_dir / ("seeds-" + "-".join(map(str, seeds))) if len(groups) > 1 else sweep_dir
            command = sweep_command(names, seeds, args.jobs, folder, extra + speed)
            print("gradrepro.report: running " + " ".join(command[1:]), file=sys.stderr)
            proc = subprocess.run(command, env=env)
            if proc.returncode != 0:
                print(
                    f"gradrepro.report: the sweep exited with {proc.returncode}; "
                    "writing the report from what it left",
                    file=sys.stderr,
                )
    tables, runs, warnings = compare([sweep_dir])
    if not runs:
        print(f"gradrepro.report: error: no readable runs in {sweep_dir}", file=sys.stderr)
        return EXIT_FAILED
    minutes = (time.perf_counter() - started) / 60
    # Every sentence below is computed from the runs read (or from the sweep this command ran).
    how = (f"run now as one multirun on the joblib launcher with {args.jobs} jobs on {os.cpu_count()} CPU cores "
           f"({platform.processor() or platform.machine()}); total time {minutes:.1f} min."
           if not args.from_sweep else f"read from the runs in {sweep_dir}.")
    tiny = scale_of(runs) == "tiny"
    header = "\n".join(
        [
            "# Reference results"
            + (" (QUICK: scale=tiny, a pipeline check, not a reproduction)" if tiny else ""),
            "",
            f"Generated by `python -m gradrepro.report{' --quick' if args.quick else ''}` on "
            f"{datetime.now(timezone.utc):%Y-%m-%d %H:%M} UTC: {runs_sentence(runs, tables['runs'])}; {how} "
            f"{commits_sentence(runs)}",
            "",
            "Measured values are the mean ± std over seeds of each check's observed value; "
            "'check passed' counts the seeds where that check held; 'signature held' counts "
            "the seeds where every evidence check of the experiment held (REPRODUCED for an empirical "
            "claim, DEMONSTRATED for a mechanism, OBSERVED for an observation of ours). Paper values are references "
            "from the cited papers (often at a far larger scale), never measured here."
            if any(run.summary.get("checks") for run in runs)
            else "No run read has a signature (checks): there is no table of claims.",
        ]
    )
    path = write_report(runs, tables, Path(args.out), header, extra, warnings)
    for line in warnings:
        print(f"gradrepro.report: warning: {line}", file=sys.stderr)
    print(f"gradrepro.report: wrote {path} ({len(runs)} runs, {minutes:.1f} min)", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
