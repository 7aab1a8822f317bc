"""What a check compares, as the name a table prints: the metric, qualified by the params that
make it another quantity. ``linear_acc`` with ``reduce: change`` is a gain over the first
logged value (``linear_acc gain``), not an accuracy; with ``relative_to: fp32`` it is a ratio
to the reference run's (``loss / loss[fp32]``). Two checks read the same quantity exactly when
they get the same name (``window`` only smooths one quantity, so it is left out).

How ``observe`` reads a check, and so its name, in order: ``transform`` applies to the
reference comparison, which compares two reductions of one recorded column (or a registered
metric, whose params are its own and are shown in brackets as they are written).
"""

from __future__ import annotations

from typing import Any, Dict, Mapping, Optional

from gradrepro.signature.registry import METRICS

# params.reduce on a recorded column, as words after its name (``last``, the default, is the
# column itself). ``change`` is last minus first: a gain, negative where the value fell.
REDUCE_WORDS = {"last": "", "change": "gain", "first": "first", "min": "min", "max": "max"}
# params.how against a reference run, given the own and the reference names.
HOW_FORMS = {
    "ratio": "{own} / {ref}",
    "difference": "{own} - {ref}",
    "abs_difference": "|{own} - {ref}|",
    "relative_difference": "|{own} - {ref}| / |{ref}|",
}
TRANSFORM_FORMS = {"abs_log2": "|log2({inner})|"}
# Smoothing only: the mean of the last N values of the same quantity.
SMOOTHING = ("window",)


def _short(value: Any) -> str:
    return f"{value:.4g}" if isinstance(value, float) else str(value)


def _bracket(name: str, params: Mapping[str, Any]) -> str:
    shown = sorted((str(k), v) for k, v in params.items())
    return f"{name}[{','.join(f'{k}={_short(v)}' for k, v in shown)}]" if shown else name


def _reduced(metric: str, params: Dict[str, Any]) -> str:
    """The name of one run's value: a recorded column reduced (``reduce``) or a registered
    metric with its own params; params with no word are kept in brackets."""
    if metric in METRICS:
        return _bracket(metric, params)
    reduce = params.pop("reduce", "last")
    word = REDUCE_WORDS.get(reduce) if isinstance(reduce, str) else None
    if word is None:  # an unknown reduce: shown as written, never silently merged
        params["reduce"] = reduce
        word = ""
    name = _bracket(metric, params)
    return f"{name} {word}" if word else name


def quantity(metric: str, params: Optional[Mapping[str, Any]] = None) -> str:
    """The name of what a check with ``metric`` and ``params`` compares with its threshold."""
    rest = {str(k): v for k, v in (params or {}).items() if k not in SMOOTHING} if isinstance(params, Mapping) else {}
    transform = rest.pop("transform", None)
    if transform is not None and transform not in TRANSFORM_FORMS:
        rest["transform"], transform = transform, None
    reference = rest.pop("relative_to", None)
    how = rest.pop("how", "ratio") if reference is not None else None
    name = _reduced(str(metric), rest)
    if reference is not None:
        ref = f"{name}[{_short(reference)}]"
        if isinstance(how, str) and how in HOW_FORMS:
            name = HOW_FORMS[how].format(own=name, ref=ref)
        else:  # an unknown comparison: shown as written, never silently merged
            name = f"{name} vs {ref} (how={_short(how)})"
    if transform is not None:
        name = TRANSFORM_FORMS[transform].format(inner=name)
    return name
