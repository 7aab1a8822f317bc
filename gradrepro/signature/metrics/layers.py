"""Per-layer signature metrics: a layer's statistic, ratios between layers, a layer against
the init reference measured in the same run (measure/init_reference.py), and the shape of a series of
layers (falls monotonically, stays flat). Each is a pure function of the run's records.

Layers are named by module (``features.0``) or by a selector over the network's weight
layers in order: ``conv[0]`` (first conv), ``conv[-1]`` (last conv), ``linear[:-1]`` (every
linear layer but the output layer). Statistics are read from the layer's ``weight`` row.
"""

from __future__ import annotations

import math
import re
from typing import Any, List, Sequence, Union

import numpy as np
import pandas as pd

from gradrepro.numerics import ratio
from gradrepro.records.run import RunRecords, reference_constant
from gradrepro.signature import derivation
from gradrepro.signature.registry import metric

_SELECTOR = re.compile(r"^(conv|linear|any)\[(-?\d*)(:?)(-?\d*)\]$")


def weight_layers(modules: pd.DataFrame, kind: str = "any") -> List[str]:
    """Module names that own a weight, in network order, optionally of one kind."""
    rows = modules[modules["param"] == "weight"]
    if kind != "any":
        rows = rows[rows["param_type"] == kind]
    return list(dict.fromkeys(rows["module"]))


def select(modules: pd.DataFrame, spec: str) -> Union[str, List[str]]:
    """One module name (a name or ``kind[i]``) or a list of them (``kind[a:b]``)."""
    match = _SELECTOR.match(spec.replace(" ", ""))
    if not match:
        return spec
    kind, start, colon, stop = match.groups()
    layers = weight_layers(modules, kind)
    if colon:
        return layers[slice(int(start) if start else None, int(stop) if stop else None)]
    if not layers or not start:
        raise KeyError(f"no layer matches {spec!r}")
    return layers[int(start)]


def _at_step(modules: pd.DataFrame, step: Any) -> pd.DataFrame:
    steps = modules["step"]
    if step == "last":
        step = steps.max()
    elif step == "first":
        step = steps.min()
    return modules[(steps == int(step)) & (modules["param"] == "weight")]


def layer_value(records: RunRecords, module: str, column: str, step: Any = 0) -> float:
    name = select(records.modules, module)
    rows = _at_step(records.modules, step)
    values = rows.loc[rows["module"] == name, column]
    return float(values.iloc[0]) if len(values) else math.nan


def layer_series(records: RunRecords, modules: Any, column: str, step: Any = 0) -> np.ndarray:
    names = select(records.modules, modules) if isinstance(modules, str) else list(modules)
    if isinstance(names, str):
        names = [names]
    rows = _at_step(records.modules, step).set_index("module")
    return np.array([float(rows.at[n, column]) if n in rows.index else math.nan for n in names])


def reference_value(records: RunRecords, module: str, column: str) -> float:
    name = select(records.modules, module)
    return float(records.constants.get(reference_constant(f"{name}.weight", column), math.nan))


@metric("layer_stat")
def layer_stat(records: RunRecords, window: int, module: str, column: str, step: Any = 0) -> float:
    """One layer's statistic at one logged step (0: at init)."""
    return layer_value(records, module, column, step)


@metric("reference_stat")
def reference_stat(records: RunRecords, window: int, module: str, column: str) -> float:
    """The same statistic of the reference network at init (a constant of this run)."""
    return reference_value(records, module, column)


@metric("times_below_reference")
def times_below_reference(records: RunRecords, window: int, module: str, column: str) -> float:
    """reference / own at init: how many times smaller this run's statistic is."""
    return ratio(reference_value(records, module, column), layer_value(records, module, column, 0))


@metric("layer_ratio")
def layer_ratio(records: RunRecords, window: int, numerator: str, denominator: str,
                column: str = "act_grad_std", step: Any = 0) -> float:
    """own[numerator] / own[denominator] at one step, e.g. the back-propagated gradient's std
    at the first conv's output over that at the last conv's output."""
    return ratio(layer_value(records, numerator, column, step),
                 layer_value(records, denominator, column, step))


@metric("attenuation_vs_reference")
def attenuation_vs_reference(records: RunRecords, window: int, numerator: str, denominator: str,
                             column: str = "act_grad_std") -> float:
    """(ref[num] / ref[den]) / (own[num] / own[den]) at init: how many times more the
    gradient is attenuated between two layers in this run than in the reference network."""
    ref = ratio(reference_value(records, numerator, column), reference_value(records, denominator, column))
    return ratio(ref, layer_ratio(records, window, numerator, denominator, column, 0))


@metric("backprop_ratio_over_derived")
def backprop_ratio_over_derived(records: RunRecords, window: int, numerator: str,
                                denominator: str, filters: Sequence[int], in_channels: int,
                                scheme: str, kernel: int = 3, std: float = 0.01,
                                mode: str = "fan_in", first: int = 2) -> float:
    """The measured std ratio of the back-propagated gradient (numerator layer's output over
    denominator layer's output, at init) divided by He et al.'s Eq. 14 for the same shapes
    and init (signature/derivation.py): 1 when the derivation holds."""
    stds = derivation.layer_stds(scheme, list(filters), int(in_channels), int(kernel), float(std), mode)
    derived = derivation.backward_std_ratio(list(filters), stds, int(kernel), int(first))
    return layer_ratio(records, window, numerator, denominator, "act_grad_std", 0) / derived


@metric("grad_attenuation_over_derived", needs=("reference/*", "init/*"))
def grad_attenuation_over_derived(records: RunRecords, window: int, module: str,
                                  column: str = "grad_std") -> float:
    """``times_below_reference`` of one layer's weight gradient over what Eq. 14 derives for the
    layers above it (``derivation.weight_grad_attenuation``): the product, over every weight
    layer above, of the init reference's std over the run's own, both as the run recorded them
    (``reference/<weight>/init_std`` and ``init/<weight>/std``). 1 when the derivation holds.
    Read from the weight gradient, recorded down to float32's smallest values (the std-0.01
    net's first conv: ~1e-29); NaN where a layer's init std was not recorded."""
    names = weight_layers(records.modules)
    layer = names.index(select(records.modules, module))
    own = [records.constants.get(f"init/{n}.weight/std", math.nan) for n in names]
    ref = [records.constants.get(reference_constant(f"{n}.weight", "init_std"), math.nan) for n in names]
    derived = derivation.weight_grad_attenuation(own, ref, layer)
    return ratio(times_below_reference(records, window, module, column), derived)


@metric("layer_fall")
def layer_fall(records: RunRecords, window: int, modules: str, column: str, step: Any = 0) -> float:
    """series[-1] / series[0]: how many times larger the statistic is at the last layer of
    ``modules`` than at the first (> 1: it falls toward the input)."""
    series = layer_series(records, modules, column, step)
    return ratio(float(series[-1]), float(series[0]))


@metric("layer_max_rise_toward_input")
def layer_max_rise_toward_input(records: RunRecords, window: int, modules: str, column: str,
                                step: Any = 0) -> float:
    """max_i series[i] / series[i+1]: <= 1 when the statistic falls monotonically from each
    layer to the one below it."""
    series = layer_series(records, modules, column, step)
    return max(ratio(float(a), float(b)) for a, b in zip(series[:-1], series[1:]))


@metric("layer_spread")
def layer_spread(records: RunRecords, window: int, modules: str, column: str, step: Any = 0) -> float:
    """max / min of the statistic over the layers: 1 when perfectly flat."""
    series = layer_series(records, modules, column, step)
    return ratio(float(np.max(series)), float(np.min(series)))


@metric("max_deviation")
def max_deviation(records: RunRecords, window: int, column: str, target: float) -> float:
    """The largest |value - target| over every logged value of a scalar (e.g. loss vs ln 10)."""
    values = records.scalars[column].dropna()
    return float((values - float(target)).abs().max()) if len(values) else math.nan
