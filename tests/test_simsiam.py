"""SimSiam at the paper's protocol (Chen & He 2021): the paper's heads, the predictor's lr not
decayed, the linear probe, and each signature against its control (experiments/simsiam.md)."""

from __future__ import annotations

import contextlib
import io
import math

import pandas as pd
import pytest
import torch
from conftest import compose_config, read_tables
from omegaconf import OmegaConf
from torch import nn

from gradrepro.objectives.base import linear_probe_accuracy
from gradrepro.recipe.build import build_training
from gradrepro.records.run import RunRecords
from gradrepro.signature import evaluate
from gradrepro.train.pipeline import run

FAILURES = ("simsiam_nostopgrad", "simsiam_nopredictor", "simsiam_frozen_predictor")


def run_experiment(tmp_path, name, *overrides):
    cfg = compose_config([f"experiment={name}", *overrides])
    folder = tmp_path / f"{name}_{'_'.join(overrides)}".replace("/", "_").replace("=", "-")
    with contextlib.redirect_stdout(io.StringIO()):
        run(cfg, folder)
    summary, scalars, modules = read_tables(folder)
    return cfg, summary, RunRecords(scalars, modules, summary["constants"])


def test_heads_are_the_papers_bn_on_every_projector_fc_and_on_the_predictor_bottleneck():
    cfg = compose_config(["experiment=simsiam_baseline", "scale=tiny"])
    net = build_training(cfg, torch.device("cpu")).net
    kinds = [type(m) for m in net.projector]
    assert kinds == [nn.Linear, nn.BatchNorm1d, nn.ReLU, nn.Linear, nn.BatchNorm1d]  # App. D: 2 layers
    assert net.projector[-1].affine is False  # the output BN of builder.py: no learned scale or shift
    assert [type(m) for m in net.predictor] == [nn.Linear, nn.BatchNorm1d, nn.ReLU, nn.Linear]
    assert net.predictor[0].out_features == cfg.objective.dim // 4  # the d/4 bottleneck (Sec. 3)


def test_the_predictors_lr_is_not_decayed_while_the_rest_follows_the_cosine():
    cfg = compose_config(["experiment=simsiam_baseline", "scale=tiny"])
    t = build_training(cfg, torch.device("cpu"))
    groups = t.optimizer.param_groups
    predictor = {id(p) for p in t.net.predictor.parameters()}
    assert {id(p) for p in groups[1]["params"]} == predictor
    assert predictor.isdisjoint(id(p) for p in groups[0]["params"])
    # Sec. 4: the paper's rule, 0.05 x B / 256, at the default scale's batch
    default = compose_config(["experiment=simsiam_baseline"])
    assert default.optim.lr == pytest.approx(0.05 * default.data.batch_size / 256)
    for _ in range(cfg.train.steps // 2):
        t.optimizer.step()
        t.scheduler.step()
    assert groups[0]["lr"] == pytest.approx(cfg.optim.lr / 2)  # half-way down the cosine
    assert groups[1]["lr"] == cfg.optim.lr


@pytest.mark.parametrize("name", ("simsiam_baseline",) + FAILURES)
def test_the_simsiam_experiments_use_two_threads_where_the_machine_has_them(name, monkeypatch):
    # The main job's time on a 2-core machine (experiments/simsiam.md, "Threads"); never more
    # threads than the cores the process may use, which validation would refuse.
    from gradrepro.config import resolvers

    for cores, expected in ((1, 1), (2, 2), (16, 2)):
        monkeypatch.setattr(resolvers, "usable_cores", lambda cores=cores: cores)
        assert compose_config([f"experiment={name}"]).threads == expected


def test_linear_probe_reads_class_information_at_any_scale_and_gives_chance_without_it():
    g = torch.Generator().manual_seed(0)
    k, n = 10, 2000
    y = torch.randint(0, k, (n,), generator=g)
    centres = torch.randn(k, 16, generator=g)
    informative = centres[y] + 0.3 * torch.randn(n, 16, generator=g)
    bank, query = slice(0, 1000), slice(1000, n)
    acc = linear_probe_accuracy(informative[bank], y[bank], informative[query], y[query])
    assert acc > 0.95
    # The features are standardised with the bank's statistics: a scale does not change it.
    small = informative * 1e-4
    assert linear_probe_accuracy(small[bank], y[bank], small[query], y[query]) == pytest.approx(acc, abs=0.01)
    noise = torch.randn(n, 16, generator=g)  # independent of the label: chance, 1/K
    chance_bound = 1 / k + 3 * math.sqrt((1 / k) * (1 - 1 / k) / 1000)
    assert linear_probe_accuracy(noise[bank], y[bank], noise[query], y[query]) <= chance_bound


def synthetic(linear_acc: tuple, z_std: float, loss: tuple) -> RunRecords:
    """A run's records with the given linear accuracy at init and at the end, a flat z_std and
    a loss going from the first to the second value (not a measurement: a fixture)."""
    rows = [{"step": s, "loss": loss[0] + (loss[1] - loss[0]) * s / 40, "z_std": z_std,
             "linear_acc": linear_acc[0] if s == 0 else linear_acc[1] if s == 40 else None,
             "knn_acc": linear_acc[0] if s == 0 else linear_acc[1] if s == 40 else None}
            for s in range(0, 41, 10)]
    return RunRecords(pd.DataFrame(rows), pd.DataFrame(), {})


HEALTHY = synthetic((0.2, 0.6), 1 / 8, (0.0, -0.8))
COLLAPSED = synthetic((0.2, 0.1), 0.01, (0.0, -1.0))
STUCK = synthetic((0.2, 0.1), 1 / 8, (0.0, -0.3))


@pytest.mark.parametrize("name,failure", [("simsiam_nostopgrad", COLLAPSED), ("simsiam_nopredictor", COLLAPSED),
                                          ("simsiam_frozen_predictor", STUCK)])
def test_each_signature_tells_its_failure_from_a_healthy_run(name, failure):
    signature = compose_config([f"experiment={name}"]).signature
    control = compose_config(["experiment=simsiam_baseline"]).signature
    assert evaluate(signature, failure).reproduced and not evaluate(signature, HEALTHY).reproduced
    assert evaluate(control, HEALTHY).reproduced and not evaluate(control, failure).reproduced
    # Every evidence check fails on the healthy run by itself, not just the verdict.
    assert not any(c.ok for c in evaluate(signature, HEALTHY).checks if c.role == "evidence")


def test_a_tiny_run_records_linear_and_knn_accuracy_with_their_values_at_init(tmp_path):
    _, summary, records = run_experiment(tmp_path, "simsiam_nostopgrad", "scale=tiny", "threads=1")
    assert {"linear_acc", "knn_acc", "z_std"} <= set(records.scalars.columns)
    assert {"linear_acc_init", "knn_acc_init"} <= set(summary["constants"])
    assert records.scalars["linear_acc"].notna().sum() == 3  # before step 0, at step 3, at the end


# The verdicts measured on held-out seeds (no knob was chosen on them), as the page's table
# records them (experiments/simsiam.md, "Held-out seeds 6000-6009", two threads, an AMD EPYC
# CPU): a regression pin, not a claim; another CPU may round differently and carry it elsewhere
# over 1,563 steps. The pair does not reproduce on every seed (the control is stuck on 6000, the
# ablation learns an invariant solution on 6002), and the pin says so.
MEASURED_VERDICTS = {
    ("simsiam_baseline", 6000): False, ("simsiam_baseline", 6002): True,
    ("simsiam_nostopgrad", 6000): True, ("simsiam_nostopgrad", 6002): False,
}


@pytest.mark.slow
@pytest.mark.parametrize("name,seed", list(MEASURED_VERDICTS))
def test_default_scale_verdicts_on_held_out_seeds_are_the_pages(tmp_path, name, seed):
    cfg, summary, records = run_experiment(tmp_path, name, f"seed={seed}")
    shown = OmegaConf.to_yaml(cfg.signature) + str(summary["checks"])
    assert summary["reproduced"] is MEASURED_VERDICTS[name, seed], shown
    if name == "simsiam_baseline" and summary["reproduced"]:
        # Where the control learned, every evidence check of each failure fails on its records.
        for failure in FAILURES:
            checks = evaluate(compose_config([f"experiment={failure}"]).signature, records).checks
            assert not any(c.ok for c in checks if c.role == "evidence"), failure
