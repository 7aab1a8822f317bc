"""The autograd graph as ``diagnose`` reads it: the leaf tensors a tensor was computed from,
the place in the user's code an operation was called from, and gradients as plain dense
tensors (sparse gradients densified, complex ones as their real and imaginary parts)."""

from __future__ import annotations

import os
import sys
from collections.abc import Iterable

import torch

# Nodes visited per walk: bounds the cost on a very large graph (a walk that stops early
# reports fewer leaves, never wrong ones).
_WALK_LIMIT = 200_000
_TORCH_DIR = os.path.dirname(torch.__file__)
_DIAGNOSE_DIR = os.path.dirname(os.path.abspath(__file__))


def leaves_of(tensors: Iterable[torch.Tensor]) -> dict[int, torch.Tensor]:
    """id -> tensor of every leaf that requires grad and that ``tensors`` were computed from:
    the ``variable`` of each ``AccumulateGrad`` node reached through ``next_functions``."""
    found: dict[int, torch.Tensor] = {}
    stack = []
    for t in tensors:
        if t.grad_fn is not None:
            stack.append(t.grad_fn)
        elif t.requires_grad:
            found[id(t)] = t
    seen: set = set()
    while stack and len(seen) < _WALK_LIMIT:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        leaf = getattr(node, "variable", None)
        if isinstance(leaf, torch.Tensor):
            found[id(leaf)] = leaf
            continue
        stack.extend(child for child, _ in node.next_functions)
    return found


def call_site() -> str:
    """``file.py:line`` of the innermost frame outside torch and this package: where the
    user's code made the call being looked at (``?`` when there is none)."""
    frame = sys._getframe(1)
    while frame is not None:
        path = os.path.abspath(frame.f_code.co_filename)
        if not path.startswith((_TORCH_DIR, _DIAGNOSE_DIR)) and "contextlib" not in path:
            return f"{os.path.basename(path)}:{frame.f_lineno}"
        frame = frame.f_back
    return "?"


def dense(g: torch.Tensor) -> torch.Tensor:
    """A gradient as a dense tensor (a sparse one, from ``nn.Embedding(sparse=True)``, summed
    over repeated indices)."""
    return g.detach().to_dense() if g.is_sparse else g.detach()


def wide(t: torch.Tensor) -> torch.Tensor:
    """Dense, in float64 (complex128 for complex tensors): where predictions and norms are computed."""
    t = dense(t)
    return t.to(torch.complex128) if t.is_complex() else t.to(torch.float64)


def real_flat(t: torch.Tensor) -> torch.Tensor:
    """Dense float64 entries as one vector, a complex entry as its two real parts (inner
    products and cosines of complex tensors are those of their real views)."""
    t = wide(t)
    return (torch.view_as_real(t) if t.is_complex() else t).reshape(-1)
