"""The autograd graph as ``diagnose`` reads it: the leaf tensors a tensor was computed from,
the place in the user's code an operation was called from, and gradients as plain dense
tensors (sparse gradients densified, complex ones as their real and imaginary parts)."""

from __future__ import annotations

import math
import os
import sys
from collections.abc import Callable, Iterable

import numpy
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


def nodes_of(root: object, blocked: frozenset | set = frozenset()) -> list:
    """Every node of the autograd graph behind ``root`` (at most ``_WALK_LIMIT``), not walking
    into or past the ``blocked`` nodes."""
    stack, seen, out = [root], set(), []
    while stack and len(seen) < _WALK_LIMIT:
        node = stack.pop()
        if node is None or node in seen or node in blocked:
            continue
        seen.add(node)
        out.append(node)
        stack.extend(child for child, _ in getattr(node, "next_functions", ()))
    return out


def _leaf_of_chain(node: object) -> torch.Tensor | None:
    """The leaf a chain of one-input nodes ends at (a weight read through ``.t()`` or a view),
    or None where the chain meets an operation of several inputs."""
    for _ in range(8):
        leaf = getattr(node, "variable", None)
        if isinstance(leaf, torch.Tensor):
            return leaf
        children = [c for c, _ in getattr(node, "next_functions", ()) if c is not None]
        if len(children) != 1:
            return None
        node = children[0]
    return None


def leaves_behind_inputs(root: object, leaf_ids: set[int], accept: Callable[[int], bool]) -> dict[int, int]:
    """id(leaf) -> id of a leaf found by ``accept`` that lies behind the computed inputs of the
    operation the leaf enters and that the loss reaches only through that operation (every path
    from ``root`` to it passes there), for each leaf of ``leaf_ids`` that has one; the operation's
    other leaves, its siblings, are not looked at. The operation is the first node above the leaf
    that takes more than one input. At most ``_BEHIND_LIMIT`` leaves are looked at (a full walk
    of the graph each)."""
    parents: dict = {}
    accumulate: dict[int, object] = {}
    for node in nodes_of(root):
        leaf = getattr(node, "variable", None)
        if isinstance(leaf, torch.Tensor):
            accumulate[id(leaf)] = node
        for child, _ in getattr(node, "next_functions", ()):
            if child is not None:
                parents.setdefault(child, []).append(node)
    found: dict[int, int] = {}
    for target in list(leaf_ids)[:_BEHIND_LIMIT]:
        start = accumulate.get(target)
        if start is None:
            continue
        ops = _operations_above(start, parents)
        elsewhere = set(nodes_of(root, blocked={op for op, _ in ops}))  # reached without passing them
        hit = _first_accepted([c for op, came_from in ops for c, _ in op.next_functions
                               if c is not None and c is not came_from and _leaf_of_chain(c) is None],
                              lambda node, leaf, elsewhere=elsewhere: node not in elsewhere and accept(id(leaf)))
        if hit is not None:
            found[target] = hit
    return found


_BEHIND_LIMIT = 64


def operations_entered(root: object, leaf_ids: set[int]) -> dict[int, list]:
    """id(leaf) -> the operations it enters in the graph behind ``root``: the first nodes above
    its ``AccumulateGrad`` that take more than one input (through a view or ``.t()`` of the leaf
    alone), one per use of the leaf."""
    parents, accumulate = _parents_and_leaves(nodes_of(root), leaf_ids)
    return {leaf: list(dict.fromkeys(op for op, _ in _operations_above(start, parents)))
            for leaf, start in accumulate.items()}


def _parents_and_leaves(nodes: list, leaf_ids: set[int]) -> tuple[dict, dict[int, object]]:
    """Each node's parents (the nodes whose inputs it feeds), and id(leaf) -> its
    ``AccumulateGrad`` for the leaves in ``leaf_ids``."""
    parents: dict = {}
    accumulate: dict[int, object] = {}
    for node in nodes:
        leaf = getattr(node, "variable", None)
        if isinstance(leaf, torch.Tensor) and id(leaf) in leaf_ids:
            accumulate[id(leaf)] = node
        for child, _ in getattr(node, "next_functions", ()):
            if child is not None:
                parents.setdefault(child, []).append(node)
    return parents, accumulate


def _operations_above(start: object, parents: dict, chain: set | None = None) -> list:
    """(operation, the child it was reached from): the first nodes above ``start`` with more
    than one input, climbing through one-input nodes (a view or ``.t()`` of the leaf alone).
    ``chain``, where given, receives those one-input nodes, and None when the climb stopped at
    its limit of 64 operations before it had seen every path."""
    frontier, ops = [(p, start) for p in parents.get(start, [])], []
    while frontier and len(ops) < 64:
        node, came_from = frontier.pop()
        if len([c for c, _ in node.next_functions if c is not None]) == 1:
            frontier.extend((p, node) for p in parents.get(node, []))
            if chain is not None:
                chain.add(node)
        else:
            ops.append((node, came_from))
    if frontier and chain is not None:
        chain.add(None)  # incomplete: a path above was not followed
    return ops


def operations_and_chains(root: object, leaf_ids: set[int]) -> tuple[dict[int, list], dict[int, object], set, bool]:
    """What the random-direction test computes a leaf's gradient from, locally: (the operations
    each leaf enters, as ``operations_entered`` finds them; id(leaf) -> its ``AccumulateGrad``;
    the one-input nodes between those operations and the leaves; whether that is every path
    from the operations to the leaves: no climb stopped at its limit and the walk of the graph
    did not stop at ``_WALK_LIMIT``). Every node above a leaf's chain is then one of its
    operations, so the leaf's gradient is a function of the gradients reaching them alone."""
    nodes = nodes_of(root)
    parents, accumulate = _parents_and_leaves(nodes, leaf_ids)
    chain: set = set()
    entered = {leaf: list(dict.fromkeys(op for op, _ in _operations_above(start, parents, chain)))
               for leaf, start in accumulate.items()}
    complete = None not in chain and len(nodes) < _WALK_LIMIT
    chain.discard(None)
    return entered, accumulate, chain, complete


def _first_accepted(starts: list, accept: Callable[[object, torch.Tensor], bool]) -> int | None:
    stack, seen = list(starts), set()
    while stack and len(seen) < _WALK_LIMIT:
        node = stack.pop()
        if node in seen:
            continue
        seen.add(node)
        leaf = getattr(node, "variable", None)
        if isinstance(leaf, torch.Tensor):
            if accept(node, leaf):
                return id(leaf)
            continue
        stack.extend(child for child, _ in node.next_functions if child is not None)
    return None


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


def all_finite(t: torch.Tensor) -> bool:
    """Whether every entry is finite, from the smallest and largest entries in one pass (a NaN
    reaches both, an infinity is one of them), where ``isfinite(t).all()`` makes a mask in
    several passes (eleven times slower on CPU). Sparse, complex, empty and integer tensors
    take ``isfinite``."""
    if t.is_sparse or t.is_complex() or not t.is_floating_point() or t.numel() == 0:
        return bool(torch.isfinite(t).all())
    lo, hi = torch.aminmax(t)
    return math.isfinite(float(lo)) and math.isfinite(float(hi))


def same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """``torch.equal`` (NaN unequal, -0 equal to 0); on the CPU through numpy's vectorised
    array_equal (timed against torch.equal in benchmarks/README.md, ``diagnose_cost.py``)."""
    if (a.device.type == "cpu" and b.device.type == "cpu" and a.dtype == b.dtype and a.shape == b.shape
            and a.dtype in (torch.float32, torch.float64, torch.float16) and a.layout == torch.strided
            and b.layout == torch.strided and not (a.is_conj() or b.is_conj() or a.is_neg() or b.is_neg())):
        return bool(numpy.array_equal(a.detach().numpy(), b.detach().numpy()))
    return torch.equal(a, b)


def wide(t: torch.Tensor) -> torch.Tensor:
    """Dense, in float64 (complex128 for complex tensors): where predictions and norms are computed."""
    t = dense(t)
    return t.to(torch.complex128) if t.is_complex() else t.to(torch.float64)


def real_flat(t: torch.Tensor) -> torch.Tensor:
    """Dense float64 entries as one vector, a complex entry as its two real parts (inner
    products and cosines of complex tensors are those of their real views)."""
    t = wide(t)
    return (torch.view_as_real(t) if t.is_complex() else t).reshape(-1)


# Operations whose output is invariant to a constant shift of (part of) their input, by their
# algebra: batch and instance normalisation subtract the per-channel mean over the batch (and
# positions); softmax over keys, alone or inside scaled dot-product attention, is unchanged by a
# score added to every key of one query (softmax(z + c) = softmax(z)), which is what a key bias
# adds (q . b_k is the same for every key). Node names are those of torch's autograd functions.
NORMALISERS = (
    ("BatchNorm", "a batch normalisation in train mode (it subtracts the per-channel batch mean)"),
    ("InstanceNorm", "an instance normalisation (it subtracts the per-channel mean)"),
    ("NativeGroupNorm", "a group normalisation (it subtracts the per-group mean)"),
    ("NativeLayerNorm", "a layer normalisation (it subtracts the mean over features)"),
    ("ScaledDotProduct", "the softmax of an attention (it is unchanged by a score added to every key)"),
    ("Softmax", "a softmax (it is unchanged by a constant added to all its inputs)"),
)
# Operations between a parameter's op and the normalisation that keep the structure: shapes,
# copies, sums with other terms and the linear maps that hold the parameter, and the gathers of
# a table's entries by index (a relative-position bias table, read into the attention's scores).
_PASS = ("View", "Reshape", "Transpose", "Permute", "Expand", "Clone", "Contiguous", "Unsqueeze", "Squeeze",
         "Split", "Chunk", "Slice", "Select", "Unbind", "Cat", "Stack", "UnsafeView", "ToCopy", "Add", "Sub",
         "Addmm", "Mm", "Bmm", "Matmul", "Linear", "Convolution", "Mul", "Div", "Alias", "As", "Index", "Gather")
_DEPTH = 12  # nodes walked back from a normalisation (a linear map, a reshape and a transpose or two)


def feeds_normaliser(root: object) -> dict[int, str]:
    """id(leaf) -> the normalisation or softmax a leaf's operation feeds (``NORMALISERS``),
    reached from the loss's ``grad_fn`` through shape and linear operations only."""
    found: dict[int, str] = {}
    stack, seen = [root], set()
    while stack and len(seen) < _WALK_LIMIT:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        name = type(node).__name__
        label = next((words for key, words in NORMALISERS if key in name), None)
        if label is not None:
            _leaves_near(node, label, found)
        stack.extend(child for child, _ in getattr(node, "next_functions", ()))
    return found


def _leaves_near(start: object, label: str, found: dict[int, str]) -> None:
    frontier, seen = [(child, 1) for child, _ in start.next_functions], set()
    while frontier:
        node, depth = frontier.pop()
        if node is None or node in seen or depth > _DEPTH:
            continue
        seen.add(node)
        leaf = getattr(node, "variable", None)
        if isinstance(leaf, torch.Tensor):
            found.setdefault(id(leaf), label)
            continue
        if any(key in type(node).__name__ for key in _PASS):
            frontier.extend((child, depth + 1) for child, _ in node.next_functions)
