"""Gradient-norm clipping, and the two ways it goes wrong that the clipping experiments show.

``train.grad_clip`` = c rescales the gradients so that their norm is at most c, as
``torch.nn.utils.clip_grad_norm_`` does (coefficient c / (norm + 1e-6), capped at 1). Two
knobs say which norm, and when:

- ``train.clip_order``: ``after_unscale`` (PyTorch's AMP examples, "Working with Unscaled
  Gradients": ``scaler.unscale_(optimizer)``, then clip) or ``before_unscale`` (the mistake:
  the gradients still carry the loss scale S, so the clip leaves them at norm c and the
  optimizer steps with c / S; https://pytorch.org/docs/stable/notes/amp_examples.html).
- ``train.clip_norm_from``: ``full_tensor`` (the norm of the whole gradient; a DTensor's
  norm is the full tensor's) or ``local_shard`` (the mistake under FSDP2: each process
  clips by the norm of the shard it holds, which reads about 1/sqrt(shards) of the full
  norm, pytorch/pytorch#170862, pytorch/torchtitan#766; every process then scales its shard
  to norm c, so the clipped gradient has norm c sqrt(shards)).

What a clip did is recorded on every logged step (``CLIP_SCALARS``): the norm it divided by
(``clip_norm``, on the first process), the full gradient's norm at that moment
(``clip_full_norm``: the same tensors, always of the whole gradient) and the coefficient it
applied (``clip_coef``).
"""

from __future__ import annotations

from typing import Any, Dict, List, Sequence

import torch

from gradrepro.probe.shards import is_dtensor, local

CLIP_ORDERS = ("after_unscale", "before_unscale")
NORM_SOURCES = ("full_tensor", "local_shard")
CLIP_SCALARS = ("clip_norm", "clip_full_norm", "clip_coef")
EPS = 1e-6  # clip_grad_norm_'s: c / (norm + 1e-6)


def _norm_of(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """The 2-norm of the concatenation of ``tensors`` (a DTensor's is the full tensor's), as a
    plain tensor: a DTensor result is made whole (its one collective)."""
    total = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(t) for t in tensors]))
    return total.full_tensor() if is_dtensor(total) else total


def gradient_norm(grads: Sequence[torch.Tensor], source: str = "full_tensor") -> torch.Tensor:
    """The norm a clip divides by: of the full gradients, or of what this process holds."""
    if source == "local_shard":
        return _norm_of([local(g) for g in grads])
    return _norm_of(list(grads))


def clip_gradients_(params: Sequence[torch.Tensor], max_norm: float,
                    source: str = "full_tensor") -> Dict[str, torch.Tensor]:
    """Scale every gradient in place by min(1, max_norm / (norm + 1e-6)), the norm taken from
    ``source``; returns ``CLIP_SCALARS`` of this process as 0-d tensors (read on logged steps
    only: no host synchronisation on the others). Each process scales the part of a gradient
    it holds (a shard of a DTensor, or the whole tensor)."""
    grads: List[torch.Tensor] = [p.grad for p in params if p.grad is not None]
    if not grads:
        return {}
    with torch.no_grad():
        used = gradient_norm(grads, source)
        full = used if source == "full_tensor" or not any(is_dtensor(g) for g in grads) else gradient_norm(grads)
        coef = torch.clamp(max_norm / (used + EPS), max=1.0)
        torch._foreach_mul_([local(g) for g in grads], coef.to(local(grads[0]).device))
        return {"clip_norm": used, "clip_full_norm": full, "clip_coef": coef}


def clip_at(cfg_train: Any, params: Sequence[torch.Tensor], moment: str) -> Dict[str, torch.Tensor]:
    """The clip of ``train.grad_clip`` if ``moment`` (``before_unscale`` or ``after_unscale``) is
    the one ``train.clip_order`` names; {} otherwise (or without a clip)."""
    if not cfg_train.grad_clip or moment != cfg_train.clip_order:
        return {}
    return clip_gradients_(list(params), float(cfg_train.grad_clip), cfg_train.clip_norm_from)
