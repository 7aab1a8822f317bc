"""He et al.'s derivation (derivation.py) gives the paper's numbers for VGG model B, and the
init schemes (init.py) draw the variances the papers state."""

from __future__ import annotations

import math

import pytest
import torch

from gradrepro.recipe.init import INIT_SCHEMES, init_weight, scheme_std
from gradrepro.signature.derivation import (
    MODEL_B_FILTERS,
    attenuation,
    backward_std_ratio,
    he_std,
    layer_factor,
    layer_stds,
)


def test_he_std_gives_the_papers_stds_for_model_b():
    # He et al. 2015, Sec. 2.2: "std 0.059, 0.042, 0.029, 0.021 when the filter numbers
    # are 64, 128, 256, 512" (3x3 filters, n^ = k^2 d).
    assert [round(he_std(9 * d), 3) for d in (64, 128, 256, 512)] == [0.059, 0.042, 0.029, 0.021]


def test_he_init_makes_every_layer_factor_one():
    for n in (9, 576, 4608):
        assert layer_factor(n, he_std(n)) == pytest.approx(1.0)
    stds = layer_stds("kaiming", MODEL_B_FILTERS, 3, mode="fan_out")
    assert backward_std_ratio(MODEL_B_FILTERS, stds) == pytest.approx(1.0)


def test_std_001_attenuates_model_b_by_the_papers_factor():
    # "the std of the gradient propagated from conv10 to conv2 is 1/(1.7 x 10^4) of our
    # derived value": layers 2..10, factors (1/2) 9 d 1e-4.
    value = attenuation(MODEL_B_FILTERS, 3, "normal", "kaiming", std=0.01, mode="fan_out")
    assert round(value, -3) == 17000
    by_hand = math.prod(0.5 * 9 * d * 1e-4 for d in MODEL_B_FILTERS[1:]) ** -0.5
    assert value == pytest.approx(by_hand)


def test_xavier_is_one_over_sqrt2_per_layer_below_he():
    # He et al. 2015, Sec. 2.2: Xavier's std is 1/sqrt(2)^L of theirs after L layers.
    filters = [32] * 27
    value = attenuation(filters, 1, "xavier", "kaiming", first=1)
    assert value == pytest.approx(math.sqrt(2) ** 27)


@pytest.mark.parametrize("scheme", [s for s in INIT_SCHEMES if s != "default"])
@pytest.mark.parametrize("mode", ["fan_in", "fan_out"])
def test_init_schemes_draw_the_stated_variance(scheme, mode):
    torch.manual_seed(0)
    weight = torch.empty(256, 128, 3, 3)
    init_weight(weight, scheme, std=0.01, mode=mode)
    fan_in, fan_out = 128 * 9, 256 * 9
    assert weight.std().item() == pytest.approx(scheme_std(scheme, fan_in, fan_out, 0.01, mode), rel=0.01)
    assert abs(weight.mean().item()) < 0.01 * weight.std().item() + 1e-6


def test_glorot_bounds_are_the_papers():
    torch.manual_seed(0)
    w = torch.empty(1000, 500)
    init_weight(w, "glorot_standard", 0.0)
    assert w.abs().max().item() <= 1 / math.sqrt(500)  # Eq. 1: U[-1/sqrt(n), 1/sqrt(n)]
    assert w.abs().max().item() > 0.99 / math.sqrt(500)
    # n Var[W] = 1/3 (Sec. 4.2.1)
    assert 500 * w.var().item() == pytest.approx(1 / 3, rel=0.01)
    init_weight(w, "glorot_normalized", 0.0)
    bound = math.sqrt(6) / math.sqrt(500 + 1000)  # Eq. 16
    assert bound * 0.99 < w.abs().max().item() <= bound
