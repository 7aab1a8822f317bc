"""``stale_gradient`` on every step, logged or not: a backward that accumulates onto the very
gradient the last ``optimizer.step()`` used.

The logged-step check (``invariants.BackwardTrail``) reads every tensor's gradient norm when a
backward begins, which a loop pays for only on logged steps. A loop whose reset is periodic
(``zero_grad()`` every k micro-batches while ``optimizer.step()`` runs on every one) can have
every logged step fall right after a reset, and the carried sums go unseen. So a few tensors
carry a gradient hook on every step, which reads, as a backward reaches the tensor and before
autograd adds to ``.grad``, whether ``.grad`` is still the tensor the last step left, at the
same in-place version (nothing set it to None, zeroed it or wrote it since) and not zero (an
old-style ``p.grad.data.zero_()`` writes without moving the version). A tensor every one of
whose backward passes since the last step started so is stale at this step: the step uses the
previous step's gradient again, summed into its own. One backward that started fresh clears it
(a GAN's generator pass may write the discriminator's ``.grad`` before the discriminator's
``zero_grad()``; its own backward then starts fresh).

A step skipped by the loop (``continue`` past ``optimizer.step()`` when the gradient is not
finite) has no boundary to judge at; what shows it is a backward adding onto a ``.grad`` that is
already not finite, in a step that has run more training forward passes than any step before
it did. A healthy loop resets there (``zero_grad()`` on the skip path, as ``GradScaler``'s
loops do), and within its usual number of passes (an accumulated step whose first micro-batch
overflowed) the carried infinity is what mixed precision expects.

Cost: at most ``SAMPLED`` hooks; a healthy loop that sets ``.grad`` to None (``zero_grad()``'s
default) pays one attribute read per hook and backward. The non-zero test (a few entries) runs
only where ``.grad`` is unchanged; on an accelerator its result stays on the device until the
next logged step.
"""

from __future__ import annotations

import weakref
from typing import Optional, Sequence

import numpy as np
import torch

from gradrepro.probe.shards import DTensor
from gradrepro.watch.invariants import Hit, recorder_error_hit

SAMPLED = 8  # tensors with a hook: spread over the optimizer's list, so a reset of one part only shows
ENTRIES = 16  # entries of .grad read for the non-zero test


def _entries(g: torch.Tensor) -> torch.Tensor:
    """Up to ``ENTRIES`` of a gradient's stored values, evenly spaced (a sparse gradient's values)."""
    flat = (g._values() if g.is_sparse else g).detach().reshape(-1)
    return flat[:: max(1, flat.numel() // ENTRIES)][:ENTRIES]


def _spread(candidates: Sequence[int], k: int) -> list[int]:
    """``k`` of ``candidates`` at even spacing, the first and the last included."""
    if len(candidates) <= k:
        return list(candidates)
    at = np.linspace(0, len(candidates) - 1, k).round().astype(int)
    return [candidates[i] for i in sorted(set(at.tolist()))]


class CarriedGradients:
    """The module docstring's check. The recorder calls ``step_taken`` after every
    ``optimizer.step()``; ``hits`` hands over what was found, on CPU at once and elsewhere at
    the next logged step; ``close`` removes the hooks."""

    def __init__(self, names: Sequence[str], params: Sequence[torch.Tensor],
                 optimizer: Optional[torch.optim.Optimizer]) -> None:
        self.names, self.params = list(names), list(params)
        held = {id(p) for g in optimizer.param_groups for p in g["params"]} if optimizer is not None else set()
        dense = [i for i, p in enumerate(self.params)
                 if p.requires_grad and id(p) in held and not p.is_meta
                 and not (DTensor is not None and isinstance(p, DTensor))]  # a sharded tensor's .grad is set whole
        self.sampled = _spread(dense, SAMPLED)
        self.eager = bool(self.params) and self.params[0].device.type == "cpu"
        self._marks: dict[int, tuple] = {}  # tensor -> (weak ref to .grad, version) after the last step
        self._state: dict[int, str] = {}  # tensor -> "fresh" or "carried" since the last step
        self._expect: dict[int, tuple] = {}  # a carried tensor -> (.grad, version) its next backward finds
        self._nonzero: dict[int, object] = {}  # a carried tensor -> whether .grad held anything (bool or tensor)
        self._pending: list[tuple[int, str, list[int], list, tuple]] = []  # (step, what, tensors, tests, counts)
        self._passes, self._most = 0, 0  # forward passes in the step in progress; the most a taken step had
        self._poisoned = False  # a non-finite .grad carried into a backward was seen in this step
        self._failed: Optional[tuple[int, Hit]] = None  # the hook's own failure: it stops, the loop goes on
        self._step = 0  # the step in progress
        self._stepped = False
        self._handles = [self.params[i].register_hook(self._hook(i)) for i in self.sampled]

    def _hook(self, i: int):
        def hook(grad: torch.Tensor) -> None:
            if self._failed is None:
                try:
                    self._reached(i)
                except Exception as exc:  # noqa: BLE001 - inside autograd: reported, never raised
                    kind, name, _, evidence = recorder_error_hit(exc, "the carried-gradient hook")
                    self._failed = (self._step, (kind, name, (
                        f"the per-step stale-gradient check failed in its gradient hook ({evidence['error']}); that "
                        "check stops, the recording and the training go on"), evidence))
            return None
        return hook

    def forward(self, first: bool) -> None:
        """A training forward pass: the step's first (``first``) or another before its step."""
        self._passes = 1 if first else self._passes + 1

    def _reached(self, i: int) -> None:
        """A backward reached tensor ``i``; autograd has not yet added to its ``.grad``."""
        if self._stepped and self._passes > self._most and not self._poisoned:
            self._carried_nonfinite(i)
        state = self._state.get(i)
        if state == "fresh" or not self._stepped:
            return
        g = self.params[i].grad
        ref, version = self._expect[i] if state == "carried" else self._marks.get(i, (None, None))
        if g is None or ref is None or ref() is not g or g._version != version:
            self._state[i] = "fresh"
            return
        if state is None:  # the first backward since the step: is there anything carried?
            nonzero = _entries(g).ne(0).any()
            self._nonzero[i] = bool(nonzero) if self.eager else nonzero
            self._state[i] = "carried"
        # autograd adds in place (one version); an out-of-place sum makes a new tensor, read as fresh
        self._expect[i] = (ref, version + 1)

    def _carried_nonfinite(self, i: int) -> None:
        """More forward passes than any taken step had: is the .grad this backward adds to
        already not finite (a skipped step's, never reset)?"""
        g = self.params[i].grad
        if g is None:
            return
        bad = _entries(g).isfinite().logical_not().any()
        if self.eager and not bool(bad):
            return
        self._poisoned = True
        self._pending.append((self._step, "nonfinite", [i], [bad], (self._passes, self._most)))

    def step_taken(self, step: int) -> None:
        """``optimizer.step()`` of ``step`` has run: the backward passes since the last step are
        judged, and what each sampled ``.grad`` is now is marked for the next ones."""
        carried = [i for i in self.sampled if self._state.get(i) == "carried"]
        if carried:
            self._pending.append((step, "carried", carried, [self._nonzero[i] for i in carried], ()))
        self._most = max(self._most, self._passes)
        self._passes, self._poisoned = 0, False
        self._state, self._expect, self._nonzero = {}, {}, {}
        self._marks = {}
        for i in self.sampled:
            g = self.params[i].grad
            if g is not None:
                self._marks[i] = (weakref.ref(g), g._version)
        self._stepped, self._step = True, step + 1

    def hits(self, logged: bool) -> list[tuple[int, Hit]]:
        """What was found, as (step, hit); on an accelerator only when ``logged``."""
        found: list[tuple[int, Hit]] = []
        if self._failed is not None:
            found.append(self._failed)
            self._failed = None
        if not self._pending or not (self.eager or logged):
            return found
        pending, self._pending = self._pending, []
        for step, what, tensors, tests, counts in pending:
            hit = [i for i, t in zip(tensors, tests) if bool(t)]
            if hit:
                found.append((step, self._stale(step, hit) if what == "carried" else
                              self._skipped(step, hit[0], *counts)))
        return found

    def _skipped(self, step: int, i: int, passes: int, most: int) -> Hit:
        return ("stale_gradient", "<model>", (
            f"a backward pass added onto {self.names[i]}'s .grad while it already held NaN or Inf, after {passes} "
            f"training forward passes since step {step - 1}'s optimizer.step() (no step before had more than "
            f"{most}): steps are skipped and nothing resets the non-finite gradient, so every later backward adds to "
            "it and no later step can use it (zero_grad() missing on the skip path)"),
            {"forward_passes": passes, "most_passes_of_a_step": most})

    def _stale(self, step: int, stale: list[int]) -> Hit:
        shown = ", ".join(self.names[i] for i in stale[:4]) + (" ..." if len(stale) > 4 else "")
        return ("stale_gradient", "<model>", (
            f"{len(stale)} of the {len(self.sampled)} tensors watched on every step ({shown}) began each backward "
            f"pass before step {step}'s optimizer.step() on the very gradient the previous optimizer.step() had used, "
            "unchanged: nothing reset .grad between the two steps, so this step applies the previous step's "
            "gradient again, summed into its own (zero_grad() missing, or called less often than step())"),
            {"tensors_carrying": len(stale), "tensors_watched": len(self.sampled)})

    def close(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []
