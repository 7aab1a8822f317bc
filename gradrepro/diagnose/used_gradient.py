"""The gradient the optimizer used, against the gradient of the loss.

Between backward and the update something may rewrite ``.grad``: a hook on the tensor
(``Tensor.register_hook`` during backward, ``register_post_accumulate_grad_hook`` right after
it), an optimizer step pre-hook, clipping, a loss scaler's unscale, an optimizer's own step.
``diagnose`` keeps the loss's gradient (computed with the tensors' own hooks suspended when
there are any; otherwise a copy of ``.grad`` right after backward), reads ``.grad`` as the
optimizer used it, and says how the two differ (``compare``):

- ``same``; ``scaled`` by c > 0 (clipping, unscaling: the direction is kept);
- ``zeroed``, ``sign_flipped`` (scaled by c < 0: the step goes uphill), ``nonfinite``,
  ``removed`` (set to None: the optimizer skips the tensor), ``added`` (a gradient where
  backward produced none);
- ``changed`` otherwise, with the cosine between them: to first order a step along -u changes
  the loss by -lr <g, u>, so a cosine <= 0 no longer descends.
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass
from typing import Iterator, Optional

import torch

from gradrepro.diagnose.graph import all_finite, dense, real_flat, same

# Kinds that make the step wrong (an error); ``changed`` is an error only when it no longer descends.
WRONG = ("zeroed", "sign_flipped", "nonfinite", "added")


@dataclass(frozen=True)
class Change:
    kind: str = "same"  # same | scaled | zeroed | sign_flipped | nonfinite | removed | added | changed
    factor: float = math.nan  # c, where the used gradient is c times the loss's
    cosine: float = math.nan
    norm_ratio: float = math.nan  # ||used|| / ||loss gradient||
    during_backward: bool = False  # a hook on the tensor did it, inside backward


def has_tensor_hooks(t: torch.Tensor) -> bool:
    """Hooks registered on the tensor itself (``register_hook``, ``register_post_accumulate_grad_hook``)."""
    return bool(getattr(t, "_backward_hooks", None)) or bool(getattr(t, "_post_accumulate_grad_hooks", None))


@contextlib.contextmanager
def _hooks_suspended(tensors: list[torch.Tensor]) -> Iterator[None]:
    """``Tensor.register_hook`` keeps a tensor's hooks in the dict ``_backward_hooks``, which
    autograd reads when it runs them: emptied for the block, then refilled in the same order."""
    saved = [(t._backward_hooks, list(t._backward_hooks.items())) for t in tensors if t._backward_hooks]
    for hooks, _ in saved:
        hooks.clear()
    try:
        yield
    finally:
        for hooks, items in saved:
            hooks.update(items)


def loss_gradients(loss: torch.Tensor, tensors: list[torch.Tensor]) -> Optional[list]:
    """The loss's gradient of every tensor with its own hooks suspended (the graph is kept
    for the backward that follows), or None when no tensor has a hook: then ``.grad`` right
    after backward is the loss's gradient."""
    if not any(has_tensor_hooks(t) for t in tensors):
        return None
    wanted = [i for i, t in enumerate(tensors) if t.requires_grad]
    with _hooks_suspended([tensors[i] for i in wanted]):
        grads = torch.autograd.grad(loss, [tensors[i] for i in wanted], retain_graph=True, allow_unused=True)
    out: list = [None] * len(tensors)
    for i, g in zip(wanted, grads):
        out[i] = g
    return out


def compare(loss_grad: Optional[torch.Tensor], used: Optional[torch.Tensor], rtol: float,
            during_backward: bool = False) -> Change:
    """How ``used`` differs from ``loss_grad``. ``rtol``: a residual ||used - c g|| up to
    ``rtol`` ||used|| still counts as a multiple c of g."""
    if loss_grad is None or used is None:
        kind = "same" if loss_grad is None and used is None else ("removed" if used is None else "added")
        return Change(kind, during_backward=during_backward)
    if loss_grad is used or (loss_grad.dtype == used.dtype and loss_grad.shape == used.shape
                             and same(dense(loss_grad), dense(used))):
        return Change()  # equal in their own dtype: equal in float64, without the two float64 copies
    g, u = real_flat(loss_grad), real_flat(used)
    if torch.equal(g, u) or not all_finite(g):  # the same, or already broken at backward
        return Change()
    if not all_finite(u):
        return Change("nonfinite", during_backward=during_backward)
    gg, uu, gu = float(g @ g), float(u @ u), float(g @ u)
    if gg == 0:
        return Change("changed", norm_ratio=math.inf, during_backward=during_backward)
    ratio = math.sqrt(uu / gg)
    if uu == 0:
        return Change("zeroed", 0.0, norm_ratio=0.0, during_backward=during_backward)
    c = gu / gg
    cosine = gu / math.sqrt(gg * uu)
    residual = float(torch.linalg.vector_norm(u - c * g))
    if residual <= rtol * math.sqrt(uu):
        return Change("scaled" if c > 0 else "sign_flipped", c, cosine, ratio, during_backward)
    return Change("changed", math.nan, cosine, ratio, during_backward)


def severity_of(change: Change) -> Optional[str]:
    """``error``, ``warning``, ``info``, or None (nothing to say)."""
    if change.kind in ("same", "removed"):  # a removed gradient is the not_updated finding's
        return None
    if change.kind == "scaled":
        return "info"
    if change.kind in WRONG or change.cosine <= 0 or math.isnan(change.cosine):
        return "error"
    return "warning"


def describe(change: Change) -> str:
    """One phrase: what happened to the gradient, and where."""
    where = ("by a hook on the tensor, during backward" if change.during_backward else
             "between backward and the step (a step pre-hook, clipping, an unscale, or the optimizer's own step)")
    what = {
        "scaled": f"scaled by {change.factor:.4g}",
        "zeroed": "set to zero: the optimizer saw only zeros",
        "sign_flipped": f"multiplied by {change.factor:.4g}: the step goes uphill",
        "nonfinite": "made non-finite (NaN or Inf) although backward's was finite",
        "added": "written where backward produced none",
        "changed": (f"changed: cosine {change.cosine:.3g} with the loss's gradient, norm ratio {change.norm_ratio:.3g}"
                    + ("; to first order the step no longer descends" if not change.cosine > 0 else "")),
    }[change.kind]
    return f"the gradient the optimizer used was {what}, {where}"
