"""Gradient accumulation (train.accumulate, train.accumulate_norm): normalised by the batch's total
token count the accumulated gradient is the full batch's to float rounding, averaged per
micro-batch it is not (unless every micro-batch holds as many tokens); the measurement and the
experiments' evidence say so on runs."""

from __future__ import annotations

import contextlib
import io

import pytest
import torch
from conftest import compose_config

from gradrepro.config.validate import validate
from gradrepro.data import Batch, split_batch
from gradrepro.data.token_sequences import IGNORE, markov_sequences, next_token_targets
from gradrepro.errors import UserError
from gradrepro.measure.full_batch_gradient import compare_with_full_batch
from gradrepro.measure.reference_runs import REFERENCE_MARK
from gradrepro.models.causal_rows import CausalRows, CausalRowsConfig
from gradrepro.objectives import micro_batch_weights
from gradrepro.objectives.next_token import NextToken, NextTokenConfig
from gradrepro.records import read_run
from gradrepro.signature import METRICS, evaluate
from gradrepro.train.pipeline import run

torch.set_num_threads(1)


def setup(n: int = 16, seed: int = 0):
    torch.manual_seed(seed)
    objective = NextToken(NextTokenConfig())
    net = objective.wrap(CausalRows(CausalRowsConfig(row_dim=16, width=32, num_classes=16)))
    x, topic = markov_sequences(n, 16, 4, 2, 0.1, process_seed=0, sample_seed=seed)
    return objective, net, Batch(x, topic)


def accumulated(objective, net, batch, parts: int, norm: str) -> list:
    """What the loop's micro-batch loop leaves in .grad."""
    net.zero_grad(set_to_none=True)
    micro = split_batch(batch, parts)
    weights, _ = micro_batch_weights(objective, micro, norm)
    for part, weight in zip(micro, weights):
        (objective(net, part).loss * weight).backward()
    return [p.grad.clone() for p in net.parameters()]


def rel_err(a, b) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm())


def test_targets_are_the_next_row_and_padding_is_ignored():
    x, _ = markov_sequences(64, 16, 4, 2, 0.1, process_seed=0, sample_seed=0)
    targets = next_token_targets(x)
    lengths = (x[:, 0].sum(-1) > 0).sum(1)
    assert ((targets != IGNORE).sum(1) == lengths - 1).all()  # every real token but the last has one
    n, t = 3, 0
    assert targets[n, t] == x[n, 0, t + 1].argmax()
    with pytest.raises(ValueError, match="one-hot"):
        next_token_targets(torch.randn(4, 1, 8, 8))


def test_total_tokens_is_the_full_batch_gradient_to_rounding_and_per_micro_batch_mean_is_not():
    objective, net, batch = setup()
    full = torch.autograd.grad(objective(net, batch).loss, list(net.parameters()))
    tokens = accumulated(objective, net, batch, 16, "total_tokens")
    means = accumulated(objective, net, batch, 16, "per_micro_batch_mean")
    counts = [objective.items(p) for p in split_batch(batch, 16)]
    assert len(set(counts)) > 1  # unequal token counts: the case where the two differ
    for g_tok, g_mean, g_full in zip(tokens, means, full):
        assert rel_err(g_tok, g_full) < 2.0**-16  # fp32 rounding (2^-24 per operation)
        assert rel_err(g_mean, g_full) > 2.0**-4  # arithmetic: another weighting of the tokens
    # The failure, derived: the mean of the micro-batch means is sum_k (1/K) S_k / n_k, where S_k
    # is micro-batch k's summed token gradient; the full batch's is sum_k S_k / N.
    sums = []
    for part, n in zip(split_batch(batch, 16), counts):
        net.zero_grad(set_to_none=True)
        (objective(net, part).loss * n).backward()
        sums.append([p.grad.double().clone() for p in net.parameters()])
    for i, g_mean in enumerate(means):
        derived = sum(s[i] / n for s, n in zip(sums, counts)) / 16
        assert rel_err(g_mean, derived) < 2.0**-16


def test_equal_token_counts_make_the_two_normalisations_agree():
    objective, net, batch = setup()
    # Classification averages over examples: equal micro-batches hold equal counts.
    weights_mean, shares = micro_batch_weights(type("PerExample", (), {})(), split_batch(batch, 4),
                                               "per_micro_batch_mean")
    assert weights_mean == shares == [0.25] * 4
    with pytest.raises(ValueError, match="per_micro_batch_mean, total_tokens"):
        micro_batch_weights(objective, split_batch(batch, 4), "mean")


def test_the_measurement_bounds_rounding_and_tells_the_two_apart():
    objective, net, batch = setup()
    for norm, within in (("total_tokens", True), ("per_micro_batch_mean", False)):
        accumulated(objective, net, batch, 16, norm)
        values = compare_with_full_batch(objective, net, batch, contextlib.nullcontext)
        assert len(values) == len(list(net.parameters()))
        for rel, bound in values.values():
            assert 0 < bound < 2.0**-8  # gamma_2R of R = 256 rows, times the sum of |terms| / |sum|
            assert (rel <= bound) == within, (norm, rel, bound)
        assert all(p.grad is not None for p in net.parameters())  # .grad left as the loop had it


def run_tiny(tmp_path, name: str):
    folder, overrides = tmp_path / name, [f"experiment={name}", "scale=tiny"]
    with contextlib.redirect_stdout(io.StringIO()):
        run(compose_config(overrides), folder, [*overrides, f"{REFERENCE_MARK}=test"])
    return read_run(folder).records()


def test_tiny_runs_the_failures_evidence_holds_and_the_controls_does_not(tmp_path):
    failure, control = run_tiny(tmp_path, "accum_micro_mean"), run_tiny(tmp_path, "accum_total_tokens")
    assert METRICS["accum_grad_over_rounding"](failure, 1, reduce="min") > 1
    assert METRICS["accum_grad_over_rounding"](control, 1, reduce="max") <= 1
    f_cfg = compose_config(["experiment=accum_micro_mean"])
    assert evaluate(f_cfg.signature, failure).reproduced  # its only evidence check is the gradient's
    on_control = evaluate(f_cfg.signature, control).checks
    assert [c.ok for c in on_control if c.role == "evidence"] == [False]


def test_accumulation_must_split_the_batch_evenly_and_name_its_normalisation():
    with pytest.raises(UserError, match=r"train.accumulate=5 must divide data.batch_size=16.*accumulate=4"):
        validate(compose_config(["experiment=accum_total_tokens", "train.accumulate=5"]))
    with pytest.raises(UserError, match="train.accumulate=0 must be a whole number >= 1"):
        validate(compose_config(["experiment=accum_total_tokens", "train.accumulate=0"]))
    with pytest.raises(UserError, match="choose one of: per_micro_batch_mean, total_tokens"):
        validate(compose_config(["experiment=accum_total_tokens", "train.accumulate_norm=mean"]))
