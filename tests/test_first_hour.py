"""What a newcomer meets in the first hour: progress where standard error is not a terminal,
``--help`` without internal schemas, sweep folders named by what varied, and a run figure
whose every mark is labelled in one font size."""

from __future__ import annotations

import io

import pandas as pd
from conftest import compose_config
from hypothesis import given, settings
from hypothesis import strategies as st
from matplotlib.text import Text

from gradrepro.cli.sweep_names import EXCLUDE_KEY, exclude_fixed_knobs
from gradrepro.config.compose import composer
from gradrepro.config.help_groups import help_groups
from gradrepro.records.figure import FONT_SIZE, checked_scalars, signals_figure
from gradrepro.train.progress_lines import ProgressLines


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


@settings(max_examples=30, deadline=None)
@given(total=st.integers(1, 500), every=st.floats(1, 120), step_s=st.floats(0.01, 30))
def test_a_progress_line_at_a_fixed_interval(total, every, step_s):
    clock, out = Clock(), io.StringIO()
    bar = ProgressLines(total, "exp", every_s=every, stream=out, clock=clock)
    printed_at = []
    for _ in range(total):
        clock.now += step_s
        before = out.getvalue().count("\n")
        bar.set_postfix(loss="0.5")
        bar.update(1)
        if out.getvalue().count("\n") > before:
            printed_at.append(clock.now)
    lines = out.getvalue().splitlines()
    assert len(lines) == len(printed_at)
    assert all(b - a >= every - 1e-9 for a, b in zip([0.0, *printed_at], printed_at))  # never more often
    if total * step_s >= every + step_s:  # a run longer than the interval is never silent
        assert lines and all(line.startswith("gradrepro: exp: step ") and "loss=0.5" in line for line in lines)


def test_help_lists_choices_without_internal_schemas():
    with composer():
        listing = help_groups()
    assert "model: " in listing and "experiment: " in listing
    assert "_schema" not in listing


overrides = st.lists(st.sampled_from(["scale=tiny", "threads=1", "train.steps=5", "seed=0,1", "seed=3",
                                      "experiment=bn_none,bn_speedup", "optim.lr=0.1,0.2", "+optim.foo=1"]),
                     max_size=5, unique=True)


@settings(max_examples=40, deadline=None)
@given(given_overrides=overrides)
def test_sweep_folder_names_leave_out_what_did_not_vary(given_overrides):
    exclude = exclude_fixed_knobs(given_overrides)
    assert exclude is not None and exclude.startswith(EXCLUDE_KEY + "=[")
    listed = exclude.split("=", 1)[1]
    for o in given_overrides:
        key, value = o.lstrip("+").split("=", 1)
        assert (repr(key) in listed) == ("," not in value or key == "seed")  # fixed knobs and the seed only
    assert exclude_fixed_knobs([*given_overrides, f"{EXCLUDE_KEY}=[seed]"]) is None  # the user's choice stands


def test_the_run_figure_labels_every_mark_in_one_font_size():
    checks = [dict(c) for c in compose_config(["experiment=simsiam_nostopgrad", "scale=tiny"]).signature.checks]
    scalars = pd.DataFrame({"step": [0, 1, 2], "loss": [0.0, -0.5, -0.9], "z_std": [0.1, 0.05, 0.01],
                            "knn_acc": [0.3, None, 0.1]})
    modules = pd.DataFrame({"step": [0, 0, 1, 1], "module": ["a", "b", "a", "b"], "grad_norm": [1.0, 0.1, 0.5, 0.0]})
    shown = checked_scalars(checks, list(scalars.columns))
    fig = signals_figure(scalars, modules, "t", "z_std", shown)
    texts = [t for t in fig.findobj(Text) if t.get_text().strip()]
    assert {t.get_fontsize() for t in texts} == {FONT_SIZE}
    labels = {t.get_text() for t in texts}
    for name, thresholds in shown.items():  # every threshold drawn is labelled (in its panel's title), the key
        for threshold in thresholds:        # scalar's included
            assert any(f"{name} threshold {threshold:.3g}" in label for label in labels)
    assert shown["z_std"], "z_std's check compares the column directly: its threshold is drawn"
    colorbar = [ax for ax in fig.axes if ax.get_label() == "<colorbar>"]
    assert colorbar and colorbar[0].get_ylabel().startswith("log10 gradient norm")
