"""gradrepro.record on a torch.compile'd model: the gradients, parameters and updates recorded
equal an eager run's, and recording causes no graph break (the compiler's own counters), with
the backends that run on CPU without a C++ toolchain ("eager", "aot_eager")."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest
import torch
import torch.nn.functional as F
from torch import nn

import gradrepro

torch.set_num_threads(1)
COMPARED = ("grad_norm", "param_norm", "update_to_param", "grad_std", "frac_zero")


def run(tmp_path, name, compile_backend=None, **options):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3))
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    net = torch.compile(model, backend=compile_backend) if compile_backend else model
    g = torch.Generator().manual_seed(1)
    with gradrepro.record(net, opt, tmp_path / name, every=2, **options):
        for _ in range(5):
            x, y = torch.randn(16, 6, generator=g), torch.randint(0, 3, (16,), generator=g)
            opt.zero_grad()
            F.cross_entropy(net(x), y).backward()
            opt.step()
    return pd.read_parquet(tmp_path / name / "modules.parquet")


@pytest.mark.parametrize("backend", ["eager", "aot_eager"])
def test_a_compiled_model_records_what_eager_records_without_a_graph_break(tmp_path, backend):
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    eager = run(tmp_path, "eager")
    compiled = run(tmp_path, "compiled", backend)
    assert not counters["graph_break"], dict(counters["graph_break"])
    assert counters["stats"]["unique_graphs"] <= 2  # with the logged step's hooks and without: no recompiles after
    assert list(compiled["module"]) == list(eager["module"])  # the model's own names, not _orig_mod.*
    for column in COMPARED:
        np.testing.assert_allclose(compiled[column], eager[column], rtol=1e-5, atol=1e-8, err_msg=column)
    assert eager["act_std"].notna().all()
    # Hooks inside a compiled graph are left out rather than traced (they would break it).
    assert compiled["act_std"].isna().all()


@pytest.mark.skipif(not hasattr(torch.compiler, "set_stance"), reason="torch.compiler.set_stance: torch >= 2.6")
def test_eager_logged_steps_record_a_compiled_models_activations_too(tmp_path):
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    eager = run(tmp_path, "eager")
    compiled = run(tmp_path, "compiled", "aot_eager", eager_logged_steps=True)
    assert not counters["graph_break"], dict(counters["graph_break"])
    for column in COMPARED + ("act_mean", "act_std", "act_grad_std"):
        np.testing.assert_allclose(compiled[column], eager[column], rtol=1e-5, atol=1e-8, err_msg=column)
    assert compiled["act_grad_std"].notna().all()
