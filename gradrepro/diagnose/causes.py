"""Known causes behind a missing or an exactly zero gradient, each established on the model
itself rather than guessed from names:

- **a zero-initialised weight downstream** (a classifier head initialised to zero, the second
  matrix of a low-rank adapter, a residual branch's zero gain): every gradient behind it is
  exactly zero until it moves, which its own non-zero gradient makes it do at the first step.
  Checked by counterfactual: with the zero-valued trainable tensors set to small random
  values (then put back exactly), the tensors behind them receive a non-zero gradient; the
  ones named are those the revived gradients depend on to first order (a double backward),
  so a zero bias beside a zero gain is not blamed. Three passes, whatever the model.
- **an operation that cuts or flattens the path**: one whose output carries no gradient
  (argmax, a comparison, an integer cast, ``.item()``/``.tolist()``, ``detach()``, anything under
  ``torch.no_grad()``) or whose derivative is zero everywhere (round, floor, ceil, trunc,
  sign). Recorded during one more forward pass under a ``TorchFunctionMode``, each with the
  line of the user's code that called it; the tensors upstream of it are found by walking
  the autograd graph (``graph.leaves_of``).

- **a selection that took none of its entries on this batch**: the loss reads the tensor's
  output only through entries chosen by an index or a mask computed at run time (the anchors a
  box matched, the positive locations of a detector). Checked by counterfactual: with every
  selection passing a gradient to all of its input's entries (where any gradient reaches it),
  the tensor's gradient is not zero. One more backward pass.

And for a tiny gradient, whether the gradient reaching the operation the tensor enters is
attenuated (a vanishing gradient attenuates every tensor behind that operation too) or not
(``ordinary_behind``: the tensor's small gradient is its own role there), and whether a
gradient of the same size reaching that operation in a random direction would still leave it
tiny (``unaligned_gradients``: if not, the gradient is small by its alignment, not attenuated).
And for a tensor
with no gradient at all, whether the loss depends on it (``loss_depends``:
nudged, does the loss move?), which tells a severed path from an unused one.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_flatten

from gradrepro.diagnose.graph import (
    all_finite,
    call_site,
    dense,
    leaves_behind_inputs,
    leaves_of,
    nodes_of,
    operations_and_chains,
    operations_entered,
    wide,
)

# torch.round/floor/ceil/trunc/sign are step functions: autograd defines their derivative as 0.
ZERO_DERIVATIVE = frozenset({"round", "round_", "floor", "floor_", "ceil", "ceil_", "trunc", "trunc_", "fix",
                             "sign", "sign_"})
# Calls that turn a tensor into a Python value: the graph ends there.
TO_PYTHON = frozenset({"item", "tolist", "numpy", "__float__", "__int__", "__index__"})
# Calls whose gradient-free output is not the tensor's value (shapes, fresh tensors of a shape):
# never a cut of the path.
_NOT_CUTS = frozenset({"__get__", "__set__", "size", "dim", "numel", "stride", "data_ptr", "element_size",
                       "is_floating_point", "is_complex", "zeros_like", "ones_like", "empty_like", "full_like",
                       "rand_like", "randn_like", "randint_like", "new_zeros", "new_ones", "new_empty",
                       "new_full", "new_tensor", "_set_grad_enabled"})
# What a cutting call is, for the report's wording.
_LABELS = (
    (frozenset({"gt", "lt", "ge", "le", "eq", "ne", "greater", "less", "greater_equal", "less_equal", "equal",
                "not_equal", "isclose", "isfinite", "isnan", "isinf"}), "a comparison"),
    (frozenset({"argmax", "argmin", "argsort", "argwhere", "nonzero", "topk", "sort", "searchsorted",
                "bucketize", "multinomial"}), "an index"),
    (frozenset({"long", "int", "short", "bool", "byte", "char"}), "an integer cast"),
)
_MAX_CUTS = 200  # recorded calls per forward pass
_PERTURB = 0.01  # scale of the random values a zero-initialised weight takes in the counterfactual


@dataclass(frozen=True)
class Cut:
    op: str
    kind: str  # zero_derivative | no_gradient | detach | python | no_grad
    site: str
    leaves: frozenset  # ids of the leaf tensors upstream of the call

    def describe(self) -> str:
        what = next((f"{label}, " for names, label in _LABELS if self.op.strip("_") in names), "")
        how = {
            "zero_derivative": "a non-differentiable step function: autograd takes its derivative as zero everywhere",
            "no_gradient": "a non-differentiable operation: its output carries no gradient",
            "detach": "which cuts the graph on purpose",
            "python": "which turns the tensor into a Python value, outside the graph",
            "no_grad": "computed under torch.no_grad(): nothing after it is recorded",
        }[self.kind]
        return f"{self.op} at {self.site} ({what}{how})"


class _CutRecorder(TorchFunctionMode):
    def __init__(self) -> None:
        super().__init__()
        self.cuts: list[Cut] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        name = getattr(func, "__name__", "")
        if name in _NOT_CUTS or len(self.cuts) >= _MAX_CUTS:
            return out
        inputs = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor) and t.requires_grad]
        if not inputs:
            return out
        outs = [t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor)]
        if name in ZERO_DERIVATIVE:
            kind = "zero_derivative"
        elif not torch.is_grad_enabled():
            kind = "no_grad"
        elif name in TO_PYTHON:
            kind = "python"
        elif outs and not any(t.requires_grad for t in outs):
            kind = "detach" if name in ("detach", "detach_") else "no_gradient"
        else:
            return out
        self.cuts.append(Cut(name, kind, call_site(), frozenset(leaves_of(inputs))))
        return out


def record_cuts(closure: Callable[[], Any], seed: int = 0) -> list[Cut]:
    """The calls that cut or flatten a gradient path during one forward pass of ``closure``."""
    recorder = _CutRecorder()
    with torch.random.fork_rng(), torch.enable_grad():
        torch.manual_seed(seed)
        with recorder:
            closure()
    return recorder.cuts


def cuts_by_tensor(cuts: list[Cut], tensors: list[torch.Tensor], which: list[int],
                   limit: int = 3) -> dict[int, list[str]]:
    """For each index in ``which``: the cuts its tensor lies upstream of (distinct calls, at most ``limit``)."""
    out: dict[int, list[str]] = {}
    for i in which:
        found = list(dict.fromkeys(c.describe() for c in cuts if id(tensors[i]) in c.leaves))
        if found:
            out[i] = found[:limit]
    return out


def zero_init_causes(closure: Callable[[], Any], tensors: list[torch.Tensor], zero: list[int],
                     candidates: list[int], seed: int = 0) -> dict[int, tuple[int, ...]]:
    """Index of a zero-gradient tensor -> the zero-valued candidates in front of it: with the
    candidates set to small random values its gradient is no longer zero (the counterfactual),
    and those named are the ones its gradient depends on to first order (one double backward;
    every candidate when the graph has no double backward)."""
    if not zero or not candidates:
        return {}
    revived = _revived(closure, tensors, zero, candidates, seed)
    if not revived:
        return {}
    try:
        named = _first_order(closure, tensors, revived, candidates, seed)
    except RuntimeError:  # an operation without a double backward
        named = []
    cause = tuple(named or candidates)
    return {i: cause for i in revived}


def _loss(closure: Callable[[], Any], seed: int, states: list | None = None) -> torch.Tensor:
    """The closure's output under ``seed``; ``states``, where given, receives the random
    generators' states as the closure starts (``random_states``)."""
    torch.manual_seed(seed)
    if states is not None:
        states.extend(random_states())
    return closure()


def _revived(closure: Callable[[], Any], tensors: list[torch.Tensor], zero: list[int], candidates: list[int],
             seed: int) -> list[int]:
    """The zero-gradient tensors whose gradient is not zero once the candidates are small
    random values; the candidates are put back exactly."""
    generator = torch.Generator().manual_seed(seed)
    saved = [tensors[j].detach().clone() for j in candidates]
    try:
        with torch.no_grad():
            for j in candidates:
                t = tensors[j]
                noise = torch.randn(t.shape, generator=generator, dtype=torch.float64) * _PERTURB
                t.copy_(noise.to(t.real.dtype if t.is_complex() else t.dtype))
        with torch.random.fork_rng(), torch.enable_grad():
            grads = torch.autograd.grad(_loss(closure, seed), [tensors[i] for i in zero], allow_unused=True)
    finally:
        with torch.no_grad():
            for j, value in zip(candidates, saved):
                tensors[j].copy_(value)
    return [i for i, g in zip(zero, grads) if g is not None and all_finite(g) and bool(g.any())]


def _first_order(closure: Callable[[], Any], tensors: list[torch.Tensor], revived: list[int],
                 candidates: list[int], seed: int) -> list[int]:
    """The candidates c with d<g, v>/dc != 0 for the revived tensors' gradients g and a random v:
    those a gradient behind them depends on (a zero bias beside a zero gain is not one)."""
    generator = torch.Generator().manual_seed(seed)
    with torch.random.fork_rng(), torch.enable_grad():
        grads = torch.autograd.grad(_loss(closure, seed), [tensors[i] for i in revived], create_graph=True,
                                    allow_unused=True)
        probe = []
        for g in grads:
            if g is not None and g.requires_grad:
                real = torch.view_as_real(g) if g.is_complex() else g
                v = torch.randn(real.shape, generator=generator, dtype=torch.float64).to(real.dtype)
                probe.append((real * v.to(real.device)).sum())
        if not probe:
            return []
        slopes = torch.autograd.grad(torch.stack(probe).sum(), [tensors[j] for j in candidates], allow_unused=True)
    return [j for j, d in zip(candidates, slopes) if d is not None and bool(d.any())]


def _loss_value(closure: Callable[[], Any], seed: int) -> float:
    out = _loss(closure, seed)
    return float(out.detach().double()) if isinstance(out, torch.Tensor) and out.numel() == 1 else math.nan


def loss_depends(closure: Callable[[], Any], tensor: torch.Tensor, seed: int = 0) -> bool | None:
    """Does the loss change when ``tensor`` is nudged? None when the closure is not
    deterministic under a fixed seed. The tensor is restored bit for bit."""
    saved = tensor.detach().clone()
    with torch.no_grad(), torch.random.fork_rng():
        base = _loss_value(closure, seed)
        if base != _loss_value(closure, seed):  # NaN or a closure that draws new data
            return None
        rms = float(wide(saved).abs().pow(2).mean().sqrt()) if saved.numel() else 0.0
        direction = torch.randn(saved.shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
        try:
            tensor.add_((0.01 * (rms if rms > 0 else 1.0) * direction).to(tensor.dtype).to(tensor.device))
            moved = _loss_value(closure, seed)
        finally:
            tensor.copy_(saved)
    return moved != base


def random_states() -> list[torch.Tensor]:
    """The states of torch's CPU generator and of every initialised CUDA generator: unchanged
    across a run of the closure, the run drew no random numbers from them."""
    states = [torch.get_rng_state()]
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        states += list(torch.cuda.get_rng_state_all())
    return states


def same_states(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b))


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Two losses equal bit for bit (NaN never equal)."""
    return a.shape == b.shape and a.dtype == b.dtype and a.device == b.device and torch.equal(a.detach(), b.detach())


# Other draws of the model's randomness (dropout, stochastic depth) tried for a zero or missing
# gradient: a block stochastic depth drops for a whole batch of B samples at rate p is dropped on
# a draw with probability p^B, so two more draws find it kept unless p^B is large.
_DRAWS = (1, 2)


def drawn_zeros(closure: Callable[[], Any], tensors: list[torch.Tensor], which: list[int],
                same_as: torch.Tensor | None = None) -> set[int]:
    """The indices in ``which`` whose gradient is non-zero under another random seed: their zero
    (or missing) gradient is a draw of the model's randomness, not its structure. ``same_as``:
    the loss of the run whose gradients are zero or missing there, where that run drew no random
    numbers and no tensor hook can change its gradients. A draw that draws no random numbers
    either and gives that loss bit for bit is that run again (the same graph, so the same zero
    and missing gradients): its backward pass is not made."""
    found: set[int] = set()
    for seed in _DRAWS:
        left = [i for i in which if i not in found]
        if not left:
            break
        with torch.random.fork_rng(), torch.enable_grad():
            states: list = []
            loss = _loss(closure, seed, states)
            if not isinstance(loss, torch.Tensor) or not loss.requires_grad:
                return found
            if same_as is not None and same_bits(loss, same_as) and same_states(states, random_states()):
                continue
            grads = torch.autograd.grad(loss, [tensors[i] for i in left], allow_unused=True)
        found |= {i for i, g in zip(left, grads) if g is not None and bool(g.any())}
    return found


# Backward nodes of the operations that read some entries of a tensor, chosen by an index or a
# mask (x[idx], x[mask], gather, index_select, masked_select, take): the entries they leave
# out get a zero gradient.
SELECTIONS = {"IndexBackward": "indexing by a tensor (x[idx] or x[mask])", "IndexSelectBackward": "index_select",
              "GatherBackward": "gather", "MaskedSelectBackward": "masked_select", "TakeBackward": "take"}


def _select_all(grad_inputs: tuple, grad_outputs: tuple) -> tuple | None:
    """A selection's backward as if it had selected every entry: ones for its input wherever a
    non-zero gradient reaches it (none where nothing does: a zero made after it stays)."""
    if not any(g is not None and bool(g.any()) for g in grad_outputs):
        return None
    return tuple(None if g is None else torch.ones_like(g) for g in grad_inputs)


def selected_out(closure: Callable[[], Any], tensors: list[torch.Tensor], zero: list[int],
                 seed: int = 0) -> dict[int, str]:
    """Index of a zero-gradient tensor -> the selections (``SELECTIONS``) that left all of its
    entries out: with every selection passing a gradient to all of its input's entries, its
    gradient is not zero. Which entries a selection takes is the batch's (anchors matched,
    positives found): another batch fills the zero."""
    if not zero:
        return {}
    with torch.random.fork_rng(), torch.enable_grad():
        loss = _loss(closure, seed)
        if not isinstance(loss, torch.Tensor) or loss.grad_fn is None:
            return {}
        chosen = [(n, words) for n in nodes_of(loss.grad_fn)
                  for key, words in SELECTIONS.items() if type(n).__name__.startswith(key)]
        if not chosen:
            return {}
        handles = [n.register_hook(_select_all) for n, _ in chosen]
        try:
            grads = torch.autograd.grad(loss, [tensors[i] for i in zero], allow_unused=True)
        finally:
            for h in handles:
                h.remove()
    how = ", ".join(sorted({words for _, words in chosen}))
    return {i: how for i, g in zip(zero, grads) if g is not None and bool(torch.isfinite(g).all()) and bool(g.any())}


# ReLU-like gates: an entry whose input is below the threshold passes nothing, forward or back.
GATES = {"relu": "ReLU", "relu_": "ReLU", "relu6": "ReLU6", "hardtanh": "hardtanh (ReLU6)",
         "hardtanh_": "hardtanh (ReLU6)", "threshold": "threshold", "threshold_": "threshold"}


class _OpenGates(TorchFunctionMode):
    """Every ReLU-like gate (``GATES``) passes its input unchanged, in the forward pass and so in
    the backward: the network as if each gate were open on every entry of the batch."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: set[str] = set()

    def __torch_function__(self, func, types, args=(), kwargs=None):
        name = getattr(func, "__name__", "")
        if name in GATES and args and isinstance(args[0], torch.Tensor):
            self.seen.add(GATES[name])
            return args[0]
        return func(*args, **(kwargs or {}))


def gated_out(closure: Callable[[], Any], tensors: list[torch.Tensor], zero: list[int],
              seed: int = 0) -> dict[int, str]:
    """Index of a zero-gradient tensor -> the gates that closed its path on this batch: rerun
    with every ReLU-like gate open (``_OpenGates``), its gradient is not zero. A gate off for
    every example of one batch (a squeeze-excitation block's few hidden units, a ReLU on a
    regression output) is the batch's doing, which another batch can change; a zero made
    elsewhere (a product with zero, a zero weight in front, a step function) is not revived.
    A unit dead on every batch is not told apart here: the recorder's rule over logged steps is."""
    if not zero:
        return {}
    gates = _OpenGates()
    with torch.random.fork_rng(), torch.enable_grad():
        with gates:
            loss = _loss(closure, seed)
        if not isinstance(loss, torch.Tensor) or loss.grad_fn is None or not gates.seen:
            return {}
        grads = torch.autograd.grad(loss, [tensors[i] for i in zero], allow_unused=True)
    how = ", ".join(sorted(gates.seen))
    return {i: how for i, g in zip(zero, grads)
            if g is not None and all_finite(dense(g)) and bool(dense(g).any())}


def ordinary_behind(closure: Callable[[], Any], tensors: list[torch.Tensor], tiny: list[int], ordinary: set[int],
                    seed: int = 0) -> dict[int, int]:
    """Index of a tiny-gradient tensor -> the index of a tensor behind the computed inputs of
    the operation it enters, reached by the loss only through that operation, whose gradient is
    ``ordinary`` (judged and not tiny). A vanishing gradient is attenuated before it reaches that
    operation, so it is attenuated for every tensor whose gradient comes only through it; one of
    them with an ordinary gradient shows that the gradient reaching the operation is not, and
    that the tensor's small gradient is its own role there (a gain that a normalisation after it
    mostly cancels, a small input). A tensor also reached by another path (a residual
    connection around the operation) is no evidence. One forward pass, no backward."""
    if not tiny or not ordinary:
        return {}
    index = {id(t): k for k, t in enumerate(tensors)}
    accepted = {id(tensors[k]) for k in ordinary}
    with torch.random.fork_rng(), torch.enable_grad():
        loss = _loss(closure, seed)
        if not isinstance(loss, torch.Tensor) or loss.grad_fn is None:
            return {}
        found = leaves_behind_inputs(loss.grad_fn, {id(tensors[i]) for i in tiny}, accepted.__contains__)
    return {index[leaf]: index[behind] for leaf, behind in found.items()}


def unaligned_gradients(closure: Callable[[], Any], tensors: list[torch.Tensor], tiny: list[int],
                        seed: int = 0, graph: ReadGraph | None = None) -> dict[int, float]:
    """Index of a tiny-gradient tensor -> the norm of the gradient it gets when the gradient
    reaching each operation it enters keeps its norm but takes a random direction. A vanishing
    gradient (attenuated through depth, a scaled-down branch) or a small input to the operation
    keeps it small, for it is small in every direction; a gradient much larger than the real one
    says that the gradient reaching the operation is not attenuated and the tensor's own is
    small because that gradient is nearly orthogonal to what the tensor changes (a gain whose
    scale a normalisation after it cancels, a sum over positions whose terms cancel).

    One backward pass reads the norms of the gradients reaching the operations; the random
    gradients then go through those operations and the one-input nodes below them alone
    (``_local``), where the whole-model form (a second backward pass with each operation's
    gradient replaced) computed the same numbers through the whole graph. ``graph``: the
    closure's graph and the norms an earlier backward read from it (``watch_operations``), used
    in place of a forward and a backward of our own where the caller established that a rerun
    under ``seed`` gives that same graph. Where the local form cannot run (a path it cannot
    follow, an operation it cannot call), the second backward pass does."""
    if not tiny:
        return {}
    if graph is not None:
        found = _local(graph.root, graph.read, tensors, tiny, seed)
        if found is not None:
            return found
    with torch.random.fork_rng(), torch.enable_grad():
        loss = _loss(closure, seed)
        if not isinstance(loss, torch.Tensor) or loss.grad_fn is None:
            return {}
        entered = operations_entered(loss.grad_fn, {id(tensors[i]) for i in tiny})
        ops = list(dict.fromkeys(op for found in entered.values() for op in found))
        wanted = [i for i in tiny if id(tensors[i]) in entered]
        if not ops or not wanted:
            return {}
        read: dict = {}
        _grad_with_hooks(loss, [tensors[i] for i in wanted], ops, lambda op: _reading(op, read), retain=True)
        found = _local(loss.grad_fn, read, tensors, tiny, seed)
        if found is not None:
            return found
        generator = torch.Generator().manual_seed(seed)
        grads = _grad_with_hooks(loss, [tensors[i] for i in wanted], ops,
                                 lambda op: _randomising(read.get(op), generator), retain=False)
    return {i: float(torch.linalg.vector_norm(dense(g))) for i, g in zip(wanted, grads)
            if g is not None and all_finite(dense(g))}


@dataclass
class ReadGraph:
    """A loss's graph kept after its backward (``retain_graph``), with what the backward's
    reading hooks saw at each operation (``_reading``)."""

    root: object
    read: dict


def watch_operations(root: object, leaf_ids: set[int]) -> tuple[ReadGraph, list]:
    """Reading hooks (``_reading``) on the operations the leaves enter, for the backward pass
    that follows: (the graph with what they will read, the hooks' handles to remove)."""
    entered = operations_entered(root, leaf_ids)
    ops = list(dict.fromkeys(op for found in entered.values() for op in found))
    graph = ReadGraph(root, {})
    return graph, [op.register_prehook(_reading(op, graph.read)) for op in ops]


def _local(root: object, read: dict, tensors: list[torch.Tensor], tiny: list[int], seed: int) -> dict | None:
    """``unaligned_gradients``'s second pass through the operations and the one-input nodes
    below them alone, calling their backward functions on the saved graph, or None where that
    is not the same computation. The whole-model pass replaces the gradient reaching every
    operation (so nothing above them enters the tensors' gradients) and the engine runs nodes
    in decreasing sequence number, so the random gradients are drawn here in that order from
    the same generator, of the same shapes and dtypes, and the gradients reaching a node are
    summed in the same order: the same numbers. Not where a node is not torch's own (a Python
    autograd Function, which may hold hooks), a path leaves the chain, a norm was not finite or
    a gradient sparse (the whole-model pass keeps the gradient flowing there), or a call fails."""
    entered, accumulate, chain, complete = operations_and_chains(root, {id(tensors[i]) for i in tiny})
    if not complete:
        return None
    ops = list(dict.fromkeys(op for found in entered.values() for op in found))
    wanted = [i for i in tiny if id(tensors[i]) in entered]
    if not ops or not wanted:
        return {}
    opset, sinks = set(ops), {node: leaf for leaf, node in accumulate.items()}
    nodes = list(opset | chain)
    if any(not _torch_node(n) for n in nodes):
        return None
    generator = torch.Generator().manual_seed(seed)
    arrived: dict = {}  # node -> {output slot: gradient summed so far}
    # A leaf's gradient is complete once every edge into it has been seen: its norm is taken
    # then and the gradient let go, so that the leaves' gradients are not all held at once.
    pending: dict = {}
    for node in nodes:
        for child, _ in node.next_functions:
            if child in sinks:
                pending[child] = pending.get(child, 0) + 1
    found: dict[int, float] = {}
    index = {id(tensors[i]): i for i in wanted}
    try:
        nodes.sort(key=lambda n: n._sequence_nr(), reverse=True)
        with torch.no_grad():
            for node in nodes:
                if node in opset:
                    seen = read.get(node)
                    if seen is None:
                        return None
                    incoming = []
                    for entry in seen:
                        if entry is None:
                            incoming.append(None)
                            continue
                        norm, shape, dtype, device = entry
                        if norm is None or not math.isfinite(norm):
                            return None
                        incoming.append(_random_of(norm, shape, dtype, device, generator))
                    arrived.pop(node, None)
                    outs = _operation_backward(node, incoming, entered, chain, sinks)
                else:
                    slots = arrived.pop(node, {})
                    out = node(*[slots.get(k) for k in range(len(node._input_metadata))])
                    outs = out if isinstance(out, tuple) else (out,)
                for k, (child, slot) in enumerate(node.next_functions):
                    g = outs[k] if k < len(outs) else None
                    if child is None or (child not in chain and child not in sinks):
                        continue
                    if g is not None:
                        g = _as_engine_passes(g, child._input_metadata[slot])
                        slots = arrived.setdefault(child, {})
                        slots[slot] = g if slot not in slots else slots[slot] + g
                    if child in sinks:
                        pending[child] -= 1
                        if pending[child] == 0:
                            leaf = arrived.pop(child, {}).get(0)
                            i = index.get(sinks[child])
                            if i is not None and leaf is not None and all_finite(dense(leaf)):
                                found[i] = float(torch.linalg.vector_norm(dense(leaf)))
    except Exception:  # noqa: BLE001 - a node that cannot be called alone: the whole-model pass
        return None
    return {i: found[i] for i in wanted if i in found}


def _operation_backward(node: Any, incoming: list, entered: dict, chain: set, sinks: dict) -> tuple:
    """An operation's backward from the gradients reaching it, per edge of ``next_functions``,
    on the edges into the chains below it (None elsewhere). Where each leaf below those edges
    enters this operation alone, by the engine (``autograd.grad`` from the node to those edges),
    which computes only the outputs asked for (a convolution's weight gradient where its bias's
    alone is asked is not computed); the gradient arriving at an edge is then the same as the
    node's own. Elsewhere (a leaf that enters another operation too, which a path from this one
    may reach), the node called on its own, all of its outputs."""
    targets = list(dict.fromkeys((child, slot) for child, slot in node.next_functions
                                 if child is not None and (child in chain or child in sinks)))
    alone = all(entered.get(_leaf_below(child, sinks)) == [node] for child, _ in targets)
    edge = getattr(torch.autograd.graph, "GradientEdge", None)
    roots = [(edge(node, k), g) for k, g in enumerate(incoming) if g is not None] if edge is not None else []
    if not alone or not roots or not targets:
        out = node(*incoming)
        return out if isinstance(out, tuple) else (out,)
    got = torch.autograd.grad([e for e, _ in roots], [edge(child, slot) for child, slot in targets],
                              grad_outputs=[g for _, g in roots], retain_graph=True, allow_unused=True)
    at = dict(zip(targets, got))
    outs, taken = [], set()
    for pair in node.next_functions:  # a repeated edge (x * x) takes the sum once
        outs.append(at.get(pair) if pair in at and pair not in taken else None)
        taken.add(pair)
    return tuple(outs)


def _leaf_below(node: Any, sinks: dict) -> int | None:
    """id of the leaf a chain of one-input nodes ends at (``sinks``: AccumulateGrad -> id)."""
    for _ in range(64):
        if node in sinks:
            return sinks[node]
        children = [c for c, _ in node.next_functions if c is not None]
        if len(children) != 1:
            return None
        node = children[0]
    return None


def _as_engine_passes(g: torch.Tensor, meta: Any) -> torch.Tensor:
    """A node's output as the engine hands it to the next node (its ``validate_outputs``):
    summed to the shape that node expects (a broadcast bias), then in its dtype and device."""
    if meta.is_nested_tensor:
        raise ValueError("nested tensor")
    if tuple(g.shape) != tuple(meta.shape):
        g = g.sum_to_size(meta.shape)
    if g.dtype != meta.dtype:
        g = g.to(meta.dtype)
    if g.device != meta.device:
        g = g.to(meta.device)
    return g


def _torch_node(node: object) -> bool:
    """A backward node of torch's own operations (C++), not a Python autograd Function's."""
    return type(node).__module__ == "builtins" and not hasattr(node, "_forward_cls")


def _grad_with_hooks(loss: torch.Tensor, inputs: list[torch.Tensor], ops: list, hook_of: Callable,
                     retain: bool) -> tuple:
    handles = [op.register_prehook(hook_of(op)) for op in ops]
    try:
        return torch.autograd.grad(loss, inputs, retain_graph=retain, allow_unused=True)
    finally:
        for h in handles:
            h.remove()


def _reading(op: object, read: dict) -> Callable:
    # The norms in the gradient's own dtype: they only set the random gradients' sizes, which
    # are compared with a reference tiny_factor (1e4) away; float32's rounding does not move that.
    # With each norm, the shape, dtype and device its random gradient takes.
    def hook(grad_outputs: tuple) -> None:
        read[op] = [None if g is None else
                    (None if g.is_sparse else float(torch.linalg.vector_norm(g.detach())), g.shape, g.dtype, g.device)
                    for g in grad_outputs]
    return hook


def _random_of(norm: float, shape: torch.Size, dtype: torch.dtype, device: torch.device,
               generator: torch.Generator) -> torch.Tensor:
    """A random gradient of this norm: drawn on the CPU generator in float32 (in the gradient's
    complex dtype for a complex one, float64 for a float64 one), scaled once."""
    r = torch.randn(shape, generator=generator,
                    dtype=dtype if dtype.is_complex or dtype == torch.float64 else torch.float32)
    size = float(torch.linalg.vector_norm(r))
    return r.mul_(norm / size if size > 0 else 0.0).to(dtype=dtype, device=device)


def _randomising(read: list | None, generator: torch.Generator) -> Callable:
    def hook(grad_outputs: tuple) -> tuple | None:
        if read is None:
            return None
        out = []
        for g, entry in zip(grad_outputs, read):
            norm = None if entry is None else entry[0]
            if g is None or norm is None or g.is_sparse or not math.isfinite(norm):
                out.append(g)
                continue
            out.append(_random_of(norm, g.shape, g.dtype, g.device, generator))
        return tuple(out)
    return hook
