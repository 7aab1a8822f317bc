"""Sweeps on real Hydra launchers (joblib, submitit_local; ray when installed), the sweep
folders they leave, the table the callback writes, and ``gradrepro.compare`` on them.

Each launcher runs one tiny sweep (shared fixtures); the compare tests reuse them."""

from __future__ import annotations

import json
import math
import re
import shutil
from pathlib import Path

import pandas as pd
import pytest
from conftest import SWEEP, experiment_names, multirun, run_module

# Submitit's local executor adds process start-up and polling (about 50 s on a loaded
# 2-core machine): slow. The joblib sweep is shared by most tests here, so it stays fast.
LAUNCHERS = ["joblib", pytest.param("submitit", marks=pytest.mark.slow)]


@pytest.fixture(scope="module")
def submitit_sweep(tmp_path_factory) -> Path:
    """2 experiments x 1 seed through Submitit's local executor (SLURM's pickling path)."""
    sweep = tmp_path_factory.mktemp("submitit") / "sweep"
    multirun(sweep, *SWEEP, "hydra/launcher=submitit_local")
    return sweep


def summaries(sweep: Path) -> dict:
    return {
        p.parent.relative_to(sweep).as_posix(): json.loads(p.read_text())
        for p in sweep.rglob("summary.json")
    }


def compare_tables(*paths: Path, by=None):
    from gradrepro.analysis.compare import compare

    tables, runs, warnings = compare(list(paths), by)
    return tables, runs, warnings


# --- sweep folders and the callback's table ----------------------------------------------


@pytest.mark.parametrize("launcher", LAUNCHERS)
def test_sweep_folders_are_named_by_overrides_with_seed_folders_inside(launcher, request):
    sweep = request.getfixturevalue(f"{launcher}_sweep")
    found = summaries(sweep)
    seeds = {"joblib": ["0", "1"], "submitit": ["0"]}[launcher]
    expected = {
        f"experiment={e}/seed={s}"  # scale=tiny and threads=1 did not vary: not in the names
        for e in ("simsiam_baseline", "simsiam_nostopgrad")
        for s in seeds
    }
    assert set(found) == expected
    for folder, summary in found.items():
        assert summary["status"] == "completed"
        assert folder.endswith(f"seed={summary['seed']}")
        assert summary["experiment"] in folder


@pytest.mark.parametrize("launcher", LAUNCHERS)
def test_callback_writes_the_sweep_table_into_the_sweep_folder(launcher, request):
    sweep = request.getfixturevalue(f"{launcher}_sweep")
    text = (sweep / "comparison.md").read_text()
    assert "## Runs" in text and "## Ablation vs control" in text
    n_runs = len(summaries(sweep))
    runs_section = text.split("## Groups")[0]
    # each run once per block of columns (the table fits 120 columns): every run is listed
    assert len(set(re.findall(r"\| (experiment=simsiam_\S+)", runs_section))) == n_runs


@pytest.mark.slow  # one tiny run per experiment: grows with the experiment count
def test_glob_runs_every_experiment(tmp_path):
    sweep = tmp_path / "sweep"
    multirun(
        sweep, "experiment=glob(*)", "scale=tiny", "threads=1", "train.steps=1", "eval.every=0"
    )
    ran = {s["experiment"] for s in summaries(sweep).values()}
    from conftest import compose_config

    assert ran == {compose_config([f"experiment={n}"]).name for n in experiment_names()}


def test_glob_expansion_recurses_into_subfolders_and_honours_exclude(tmp_path):
    from functools import partial

    from gradrepro.cli import preflight
    from gradrepro.errors import UserError

    configs = tmp_path / "configs"
    for name in ("a", "b", "sub/c", "sub/d"):
        (configs / "experiment" / name).parent.mkdir(parents=True, exist_ok=True)
        (configs / "experiment" / f"{name}.yaml").write_text("# @package _global_\n")
    expand_globs = partial(preflight.expand_globs, config_dir=configs)
    assert expand_globs(["-m", "experiment=glob(*)", "seed=0,1"]) == [
        "-m",
        "experiment=a,b,sub/c,sub/d",
        "seed=0,1",
    ]
    assert expand_globs(["experiment=glob(*,exclude=sub/*)"]) == ["experiment=a,b"]
    assert expand_globs(["experiment=glob(sub/*)"]) == ["experiment=sub/c,sub/d"]
    assert expand_globs(["seed=0,1", "hydra/launcher=joblib"]) == [
        "seed=0,1",
        "hydra/launcher=joblib",
    ]
    with pytest.raises(UserError, match="matches no experiment"):
        expand_globs(["experiment=glob(zzz*)"])


def test_slurm_launcher_config_takes_partition_time_cpus_gpus_memory_overrides():
    from gradrepro.config.compose import composer

    wanted = {
        "partition": "gpu",
        "timeout_min": 30,
        "cpus_per_task": 4,
        "gpus_per_node": 1,
        "mem_gb": 16,
    }
    for launcher in ("slurm", "submitit_slurm"):
        with composer() as compose:
            cfg = compose(
                [
                    f"hydra/launcher={launcher}",
                    "experiment=simsiam_baseline",
                    *(f"hydra.launcher.{k}={v}" for k, v in wanted.items()),
                ],
                return_hydra_config=True,
            )
        assert cfg.hydra.launcher._target_.endswith("submitit_launcher.SlurmLauncher")
        assert {k: cfg.hydra.launcher[k] for k in wanted} == wanted


def test_ray_launcher_sweep(tmp_path):
    pytest.importorskip(
        "hydra_plugins.hydra_ray_launcher",
        reason="hydra-ray-launcher is an optional extra: pip install -e '.[ray]'",
    )
    sweep = tmp_path / "sweep"
    multirun(sweep, *SWEEP, "hydra/launcher=ray", "hydra.launcher.ray.init.num_cpus=2")
    assert len(summaries(sweep)) == 2


# --- compare on the sweeps ------------------------------------------------------------------


@pytest.mark.parametrize("launcher", LAUNCHERS)
def test_compare_rows_groups_and_paired_columns(launcher, request):
    sweep = request.getfixturevalue(f"{launcher}_sweep")
    n_seeds = {"joblib": 2, "submitit": 1}[launcher]
    tables, runs, warnings = compare_tables(sweep)
    assert warnings == []
    runs_df, groups, pairs = tables["runs"], tables["groups"], tables["pairs"]
    assert len(runs_df) == 2 * n_seeds
    assert sorted(runs_df["seed"].unique()) == list(range(n_seeds))
    for col in (
        "experiment",
        "control",
        "status",
        "reproduced",
        "z_std",
        "z_std thr",
        "z_std paper",
        "final_loss",
        "steps",
        "wall_s",
    ):
        assert col in runs_df
    # Only the experiment differs between the runs: one group per experiment, n = seeds.
    assert groups.attrs["by"] == ["experiment"]
    assert dict(zip(groups["experiment"], groups["n"])) == {
        "simsiam_baseline": n_seeds,
        "simsiam_nostopgrad": n_seeds,
    }
    assert set(groups["reproduced"]) <= {f"{k}/{n_seeds}" for k in range(n_seeds + 1)}
    mine = runs_df[runs_df["experiment"] == "simsiam_nostopgrad"]["z_std"]
    row = groups.set_index("experiment").loc["simsiam_nostopgrad"]
    assert row["z_std mean"] == pytest.approx(mine.mean())
    # The ablation beside its control, both measured by the ablation's own checks.
    assert len(pairs) == 1
    pair = pairs.iloc[0]
    assert (pair["experiment"], pair["control"], pair["control n"]) == (
        "simsiam_nostopgrad",
        "simsiam_baseline",
        n_seeds,
    )
    for key in ("loss", "z_std", "knn_acc"):
        assert {f"{key} mean", f"{key} control mean", f"{key} thr"} <= set(pairs.columns)
    from gradrepro.records.reader import signature_of
    from gradrepro.records.run import RunRecords
    from gradrepro.signature import evaluate

    ablation = next(r for r in runs if r.experiment == "simsiam_nostopgrad")
    controls = [r for r in runs if r.experiment == "simsiam_baseline"]
    signature = signature_of(ablation)
    loss = [c["metric"] for c in signature["checks"]].index("loss")
    by_hand = [
        evaluate(signature, RunRecords(r.scalars(), r.modules(), r.summary["constants"])).checks[loss].observed
        for r in controls
    ]
    assert pair["loss control mean"] == pytest.approx(sum(by_hand) / len(by_hand))


def test_compare_groups_by_a_swept_knob_other_than_seed(joblib_sweep, tmp_path):
    # A run that differs in optim.lr (its summary says so, as a sweep over optim.lr would
    # write it): the knob becomes a column and a grouping key.
    source = next(p.parent for p in joblib_sweep.rglob("summary.json"))
    other = tmp_path / "lr" / "optim.lr=0.1" / "seed=0"
    shutil.copytree(source, other)
    summary = json.loads((other / "summary.json").read_text())
    summary["overrides"] += ["optim.lr=0.1"]
    (other / "summary.json").write_text(json.dumps(summary))
    tables, _, _ = compare_tables(joblib_sweep, other)
    assert tables["runs"]["optim.lr"].isna().sum() == 4  # the sweep's runs did not set it
    assert tables["groups"].attrs["by"] == ["experiment", "optim.lr"]
    assert len(tables["groups"]) == 3
    by_lr = compare_tables(joblib_sweep, other, by=["optim.lr"])[0]["groups"]
    assert sorted(by_lr["n"]) == [1, 4]


def test_compare_cli_formats(joblib_sweep, tmp_path):
    proc = run_module(
        "gradrepro.compare",
        joblib_sweep,
        "--format",
        "csv",
        "--table",
        "runs",
        "--out",
        tmp_path / "runs.csv",
    )
    assert proc.returncode == 0, proc.stderr
    assert len(pd.read_csv(tmp_path / "runs.csv")) == 4
    proc = run_module("gradrepro.compare", joblib_sweep, "--format", "json")
    assert {k: len(v) for k, v in json.loads(proc.stdout).items()} == {
        "runs": 4,
        "groups": 2,
        "pairs": 1,
        "checks": 8,  # the ablation's 4 checks on each of 2 seeds
        "margins": 4,
    }
    proc = run_module("gradrepro.compare", joblib_sweep, "--format", "latex", "--table", "groups")
    assert "\\begin{tabular}" in proc.stdout and "simsiam\\_nostopgrad" in proc.stdout
    proc = run_module("gradrepro.compare", joblib_sweep, "--by", "no_such_key")
    assert proc.returncode == 2 and "no_such_key: no such column" in proc.stderr


# --- bad input ------------------------------------------------------------------------------


def test_compare_with_corrupt_truncated_and_killed_runs(joblib_sweep, tmp_path):
    sweep = tmp_path / "sweep"
    shutil.copytree(joblib_sweep, sweep)
    runs = sorted(p.parent for p in sweep.rglob("summary.json"))
    corrupt, truncated, killed, interrupted = runs
    (corrupt / "summary.json").write_text('{"experiment": "simsiam_baseline", "chec')
    data = (truncated / "scalars.parquet").read_bytes()
    (truncated / "scalars.parquet").write_bytes(data[: len(data) // 2])
    (killed / "summary.json").unlink()
    summary = json.loads((interrupted / "summary.json").read_text())
    (interrupted / "summary.json").write_text(json.dumps({**summary, "status": "interrupted"}))
    (sweep / "empty").mkdir()

    proc = run_module(
        "gradrepro.compare",
        sweep,
        sweep / "empty",
        "--format",
        "csv",
        "--table",
        "runs",
        "--out",
        tmp_path / "t.csv",
    )
    assert proc.returncode == 0, proc.stderr
    warnings = [line for line in proc.stderr.splitlines() if "warning" in line]
    assert any(str(corrupt) in w and "summary.json is unreadable" in w for w in warnings)
    assert any(str(truncated) in w and "scalars.parquet is unreadable" in w for w in warnings)
    assert any(str(killed) in w and "listed as incomplete" in w for w in warnings)
    assert any(str(sweep / "empty") in w and "no runs found" in w for w in warnings)
    table = pd.read_csv(tmp_path / "t.csv")
    assert len(table) == 3  # everything but the corrupt summary
    table = table.set_index("run")
    label = lambda p: f"{p.parent.name}/{p.name}"  # noqa: E731  (relative to the sweep folder)
    assert table.loc[label(killed), "status"] == "incomplete (no summary.json)"
    assert table.loc[label(interrupted), "status"] == "incomplete (interrupted)"
    assert table.loc[label(truncated), "status"] == "completed"
    assert math.isnan(table.loc[label(truncated), "final_loss"])  # its scalars were unreadable
    tables, _, _ = compare_tables(sweep)
    groups = tables["groups"].set_index("experiment")
    assert groups["n"].sum() + groups["incomplete"].sum() == 3
    assert groups["incomplete"].sum() == 2


def test_compare_exits_non_zero_only_when_nothing_is_readable(tmp_path):
    (tmp_path / "broken").mkdir()
    (tmp_path / "broken" / "summary.json").write_text("not json")
    proc = run_module("gradrepro.compare", tmp_path / "broken", tmp_path / "missing")
    assert proc.returncode == 1
    assert "nothing readable" in proc.stderr
    assert "summary.json is unreadable" in proc.stderr and "does not exist" in proc.stderr


# --- plot -----------------------------------------------------------------------------------


def test_plot_has_one_loss_line_and_one_module_line_per_run(joblib_sweep, tmp_path):
    import matplotlib.pyplot as plt

    from gradrepro.analysis.compare_figure import figure_runs
    from gradrepro.records.reader import load_runs

    runs, _ = load_runs([joblib_sweep])
    fig = figure_runs(runs)
    loss_ax, module_ax = fig.axes[:2]
    assert len(loss_ax.get_lines()) == len(runs) == 4
    assert len(module_ax.get_lines()) == 4
    assert len(fig.legends) == 1 and len(fig.legends[0].get_texts()) == 4
    modules = {t.get_text() for t in module_ax.get_xticklabels()}
    assert {"backbone.features.0", "predictor.3"} <= modules
    plt.close(fig)
    proc = run_module(
        "gradrepro.compare",
        joblib_sweep,
        "--plot",
        tmp_path / "cmp.png",
        "--out",
        tmp_path / "t.md",
    )
    assert proc.returncode == 0, proc.stderr
    assert (tmp_path / "cmp.png").read_bytes()[:4] == b"\x89PNG"
    assert "4 runs drawn" in proc.stderr


def test_missing_launcher_plugin_is_one_line_naming_the_extra(tmp_path):
    import importlib.util

    if importlib.util.find_spec("hydra_plugins.hydra_ray_launcher") is not None:
        pytest.skip("hydra-ray-launcher is installed here")
    proc = run_module(
        "gradrepro", "-m", *SWEEP, "hydra/launcher=ray", f"hydra.sweep.dir={tmp_path}"
    )
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [
        "gradrepro: error: hydra/launcher=ray needs hydra_ray_launcher: pip install -e '.[ray]'"
    ]


def test_a_key_only_the_swept_experiments_have_is_forced_for_hydras_primary_compose():
    """``experiment=a,b data.background_std=3``: Hydra composes the sweep once without its
    swept values (default data, no such key) before any job; the preflight forces the plain
    override with ``++`` (every job composed with it) and leaves the others as typed."""
    from gradrepro.cli import preflight

    argv = ["-m", "experiment=simsiam_baseline,simsiam_nostopgrad", "scale=tiny",
            "data.background_std=3.0", "seed=1"]
    checked = preflight.check(argv)
    assert checked.forced == {"data.background_std=3.0": "++data.background_std=3.0"}
    assert checked.cfg.data.background_std == 3.0
    # a key every config has needs nothing; one no job has is still one line
    assert preflight.check(["-m", "experiment=simsiam_baseline,simsiam_nostopgrad", "seed=1"]).forced == {}
    with pytest.raises(preflight.UserError, match="data.no_such_key"):
        preflight.check(["-m", "experiment=simsiam_baseline,simsiam_nostopgrad", "data.no_such_key=1"])
