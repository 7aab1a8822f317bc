"""The first hour: ``--help`` short and without torch or Hydra imported, groups spelt as they
are chosen; ``compare`` on one run prints its row with the paper's words from their start; a
launcher whose plugin package is absent is one line."""

from __future__ import annotations

import subprocess
import sys

import pytest
from conftest import ROOT, assert_clean_error, run_module

from gradrepro.analysis import compare as compare_cli
from gradrepro.analysis.fit_width import MAX_CELL, markdown_within
from gradrepro.cli import preflight
from gradrepro.config.short_help import OVERRIDES, groups_in
from gradrepro.errors import UserError

HELP_PROBE = ("import atexit, runpy, sys\n"
              "atexit.register(lambda: print('HEAVY:', sorted(m for m in ('torch', 'hydra', 'omegaconf', 'pandas')"
              " if m in sys.modules)))\n"
              "sys.argv = ['gradrepro', '--help']\n"
              "runpy.run_module('gradrepro', run_name='__main__')\n")


def test_help_alone_imports_nothing_heavy_and_is_short():
    proc = subprocess.run([sys.executable, "-c", HELP_PROBE], cwd=ROOT, capture_output=True, text=True,
                          timeout=120, env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"})
    assert proc.returncode == 0, proc.stderr
    text, heavy = proc.stdout.rsplit("HEAVY:", 1)
    assert heavy.strip() == "[]", heavy
    lines = text.splitlines()
    assert len(lines) <= 60 and max(map(len, lines)) <= 100
    assert "missing_grad/detached" in text and "experiment/missing_grad:" not in text
    assert all(override in text for override, _ in OVERRIDES) and len(OVERRIDES) <= 12
    assert "--cfg job" in text and "Override anything" in text


def test_help_with_overrides_lists_the_same_groups_through_hydra():
    proc = run_module("gradrepro", "--help", "scale=tiny", timeout=600)
    assert proc.returncode == 0, proc.stderr
    for group, choices in groups_in().items():
        assert f"{group}: {choices[0]}" in proc.stdout
    assert "missing_grad/detached" in proc.stdout and "experiment/missing_grad:" not in proc.stdout


def test_a_subfolder_spelt_as_a_group_gets_the_right_spelling():
    proc = run_module("gradrepro", "experiment/missing_grad=detached", timeout=600)
    assert_clean_error(proc.returncode, proc.stderr, "experiment=missing_grad/detached")


def test_unfilled_placeholders_never_reach_a_message():
    with pytest.raises(UserError) as refused:
        preflight.check(["experiment=simsiam_nostopgrad", "scale=tiny", "optim.lr=${oc.env:HOME}"])
    assert "$VALUE" not in str(refused.value) and "str" in str(refused.value)


def test_a_launcher_whose_plugin_package_is_absent_is_one_line(monkeypatch):
    monkeypatch.setitem(preflight._LAUNCHER_PLUGINS, "joblib", ("gradrepro_absent_plugins.joblib", "sweep"))
    with pytest.raises(UserError, match="hydra/launcher=joblib needs"):
        preflight.check_launcher(["-m", "hydra/launcher=joblib"])


def test_prose_keeps_its_start_and_a_path_its_end():
    import pandas as pd

    prose, path = "linear top-1 0.1 without stop-gradient: 'chance' (Sec. 4.1)", "/a/b/" + "x" * 50 + "/seed=1"
    text = markdown_within(pd.DataFrame({"paper": [prose], "run": [path]}))
    assert prose[:MAX_CELL - 1] + "…" in text and "…" + path[-(MAX_CELL - 1):] in text


def test_compare_on_one_run_prints_its_row(tmp_path, capsys):
    from conftest import compose_config
    from test_nothing_overwritten import TINY

    from gradrepro.train import pipeline as runner

    runner.run(compose_config(TINY), tmp_path / "run", TINY)
    assert compare_cli.main([str(tmp_path / "run")]) == 0
    out = capsys.readouterr().out
    assert "linear top-1 0.1 without" in out and "Margins" not in out and "Groups" not in out
    assert len(out.splitlines()) <= 25


def test_the_run_figure_keeps_threshold_labels_off_the_curves_and_titles():
    import pandas as pd

    from gradrepro.records.figure import signals_figure

    scalars = pd.DataFrame({"step": [0, 1, 2], "loss": [0.0, -0.5, -0.9], "z_std": [0.1, 0.05, 0.06],
                            "knn_acc": [0.3, 0.2, 0.21], "linear_acc": [0.1, 0.2, 0.22]})
    fig = signals_figure(scalars, pd.DataFrame(), "t", "z_std",
                         {"z_std": [0.0625], "knn_acc": [0.213], "linear_acc": [0.213]})
    axes = fig.get_axes()
    assert not [t.get_text() for ax in axes for t in ax.texts]  # nothing written inside a panel
    titles = [ax.get_title() for ax in axes]
    assert "loss and z_std (dashed: z_std threshold 0.0625)" in titles
    assert "knn_acc threshold 0.213 (dashed)" in titles
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    canvas = FigureCanvasAgg(fig)  # drawn as saved: a panel's tick labels never reach a title
    canvas.draw()
    renderer = canvas.get_renderer()
    titles = [ax.title.get_window_extent(renderer) for ax in axes if ax.get_title()]
    ticks = [t.get_window_extent(renderer) for ax in axes for t in ax.get_xticklabels()
             if t.get_visible() and t.get_text()]
    assert titles and ticks
    assert not [(a, b) for a in titles for b in ticks if a.overlaps(b)]
    inside = fig.bbox  # and every title is whole, inside the figure
    assert all(inside.x0 <= t.x0 and t.x1 <= inside.x1 for t in titles)
