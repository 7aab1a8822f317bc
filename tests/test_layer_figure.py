"""The comparison figures read run folders and draw without error (loss + heat maps; layer
profiles), blanking zero statistics instead of failing on log10(0)."""

from __future__ import annotations

import numpy as np
import pandas as pd

from gradrepro.analysis.layer_figure import layer_table, plot_inits, plot_layer_profiles
from gradrepro.records import files as store


def fake_run(folder, name, scale):
    folder.mkdir()
    store.write_json(folder / store.SUMMARY, {"experiment": name, "seed": 0, "overrides": ["seed=0"]})
    steps = [0, 10, 20]
    pd.DataFrame({"step": steps, "loss": [2.3, 2.0 * scale, 1.0 * scale]}).to_parquet(folder / store.SCALARS)
    rows = []
    for step in steps:
        for i, kind in enumerate(["conv", "conv", "linear", "linear", "linear"]):
            for param in ("weight", "bias"):
                value = scale * 10.0 ** (i - 4)
                rows.append({"step": step, "module": f"m{i}", "param": param, "param_type": kind,
                             "act_grad_std": 0.0 if (i == 0 and scale < 1) else value,
                             "pe_act_grad_var": value, "pe_grad_var": 1.0})
    pd.DataFrame(rows).to_parquet(folder / store.MODULES)
    return folder


def test_layer_table_keeps_network_order(tmp_path):
    run = fake_run(tmp_path / "a", "a", 1.0)
    table = layer_table(pd.read_parquet(run / store.MODULES), "act_grad_std")
    assert list(table.index) == ["m0", "m1", "m2", "m3", "m4"]
    assert list(table.columns) == [0, 10, 20]
    assert np.isclose(table.loc["m4", 0], 1.0)


def test_figures_draw_from_run_folders(tmp_path):
    runs = [fake_run(tmp_path / n, n, s) for n, s in (("k", 1.0), ("x", 0.5))]
    plot_inits(runs, tmp_path / "inits.png")
    plot_layer_profiles(runs, tmp_path / "profiles.png", steps=[0, 20])
    assert (tmp_path / "inits.png").stat().st_size > 10_000
    assert (tmp_path / "profiles.png").stat().st_size > 10_000
