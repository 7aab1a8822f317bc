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

Another optimizer's step (a hook on every optimizer's ``step()``, this one's and any wrapper's
around it or inside it left out) shows two more ways a step uses a gradient that is not its own:

- it steps tensors this one steps, with the very gradient this one's step used or will use
  (the same ``.grad``, no backward since): one gradient applied twice per iteration, a module's
  parameters held by two optimizers (``changed_between_steps``: the other optimizer moves them
  between this one's steps);
- a backward reached a tensor of this one, the other optimizer stepped, and a later backward
  added onto that ``.grad`` before this one's step: this step applies the other loss's gradient
  summed into its own (``stale_gradient``; a GAN whose generator pass fills the discriminator's
  ``.grad`` with no ``zero_grad()`` before the discriminator's own backward). A healthy loop
  resets between the two (``zero_grad()`` before each model's own backward) or keeps the other
  loss from reaching the tensors (``requires_grad_(False)``, ``.detach()``).

Cost: at most ``SAMPLED`` hooks; a healthy loop that sets ``.grad`` to None (``zero_grad()``'s
default) pays one attribute read per hook and backward. The non-zero test (a few entries) runs
only where ``.grad`` is unchanged; on an accelerator its result stays on the device until the
next logged step. Every optimizer's step runs the two global hooks: a list push and pop, and for
another optimizer a look at the watched tensors' ``.grad`` (their membership in it cached).
"""

from __future__ import annotations

import weakref
from typing import Optional, Sequence

import numpy as np
import torch
import torch.optim.optimizer as torch_optimizer

from gradrepro.probe.shards import DTensor
from gradrepro.watch.invariants import Hit, recorder_error_hit

_GLOBAL_HOOKS = (getattr(torch_optimizer, "register_optimizer_step_pre_hook", None),
                 getattr(torch_optimizer, "register_optimizer_step_post_hook", None))
# One pair of global hooks for every live check, held weakly: a recorder never closed and no
# longer reachable stops being called once collected (a hook of its own would keep it alive,
# and be called at every optimizer step of the process, for good), and the pair is removed when
# the last check closes or is collected.
_LISTENING: "weakref.WeakSet" = weakref.WeakSet()
_GLOBAL_HANDLES: list = []
_LIVE = [0]  # checks listening: each one's finalizer takes itself off once, at close or at collection


def _to_each(event: str):
    def hook(optimizer, args, kwargs) -> None:
        for check in list(_LISTENING):
            getattr(check, event)(optimizer)
    return hook


def _release() -> None:
    _LIVE[0] -= 1
    if _LIVE[0] == 0:
        for handle in _GLOBAL_HANDLES:
            handle.remove()
        _GLOBAL_HANDLES.clear()


def _listen(check: "CarriedGradients") -> None:
    if not _GLOBAL_HANDLES:
        pre, post = _GLOBAL_HOOKS
        _GLOBAL_HANDLES.extend([pre(_to_each("_step_begins")), post(_to_each("_step_ends"))])
    _LISTENING.add(check)
    _LIVE[0] += 1
    check._release = weakref.finalize(check, _release)


def _stop_listening(check: "CarriedGradients") -> None:
    _LISTENING.discard(check)
    check._release()  # a finalizer runs at most once


def own_global_hooks() -> set:
    """The ids of the global optimizer-step hooks the live checks hold (they read, never write)."""
    return {handle.id for handle in _GLOBAL_HANDLES}


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
        # Other optimizers' steps (the module docstring's second part)
        # this one's optimizers (an OptimizerSet's members: watch.optimizers), by identity
        self._ours = weakref.WeakSet(getattr(optimizer, "members", (optimizer,)) if optimizer is not None else ())
        self._shared: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()  # other -> sampled tensors it holds
        self._running: list[list] = []  # steps in progress, outermost first: [optimizer, nested with this one's]
        self._touched: set[int] = set()  # sampled tensors a backward reached since this one's last step
        self._across: dict[int, tuple] = {}  # tensor -> (.grad, version, other's class) when another optimizer stepped
        self._foreign: dict[int, tuple] = {}  # tensor -> (non-zero test, other's class): added onto such a .grad
        self._before: dict[int, tuple] = {}  # shared tensor -> (.grad, other's class): another stepped on it first
        self._step_begins = self._guarded(self._any_step_begins)
        self._step_ends = self._guarded(self._any_step_ends)
        self._listening = optimizer is not None and bool(self.sampled) and all(_GLOBAL_HOOKS)
        if self._listening:
            _listen(self)

    def _hook(self, i: int):
        return self._guarded(lambda grad: self._reached(i))  # returns None: the gradient is left as it is

    def _guarded(self, fn):
        """``fn`` run inside autograd or an optimizer's step: a failure is reported, never raised."""
        def run(*args):
            if self._failed is None:
                try:
                    fn(*args)
                except Exception as exc:  # noqa: BLE001
                    kind, name, _, evidence = recorder_error_hit(exc, "the carried-gradient hook")
                    self._failed = (self._step, (kind, name, (
                        f"the per-step stale-gradient check failed in its hook ({evidence['error']}); that "
                        "check stops, the recording and the training go on"), evidence))
            return None
        return run

    def forward(self, first: bool) -> None:
        """A training forward pass: the step's first (``first``) or another before its step."""
        self._passes = 1 if first else self._passes + 1

    def _reached(self, i: int) -> None:
        """A backward reached tensor ``i``; autograd has not yet added to its ``.grad``."""
        self._touched.add(i)
        self._before.pop(i, None)
        g = self.params[i].grad
        if i in self._foreign:  # still the same sum (autograd adds in place, one version a backward)?
            test, other, ref, version = self._foreign[i]
            # another in-place write (an autograd.grad pass reaches the hook and adds nothing): a reset
            # only if it left zeros (zero_grad(set_to_none=False)); off the host, any write counts as one
            if g is None or ref() is not g or (g._version != version and (
                    not self.eager or not bool(_entries(g).ne(0).any()))):
                del self._foreign[i]
            else:
                self._foreign[i] = (test, other, ref, g._version + 1)
        if i in self._across:
            ref, version, other = self._across.pop(i)
            if g is not None and ref() is g and g._version == version and i not in self._foreign:
                nonzero = _entries(g).ne(0).any()
                self._foreign[i] = (bool(nonzero) if self.eager else nonzero, other, ref, version + 1)
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
        foreign = [i for i in self.sampled if i in self._foreign and self._foreign[i][2]() is self.params[i].grad]
        if foreign:
            self._pending.append((step, "foreign", foreign, [self._foreign[i][0] for i in foreign],
                                  (self._foreign[foreign[0]][1],)))
        twice = [i for i, (ref, _) in self._before.items() if ref() is not None and ref() is self.params[i].grad]
        if twice:
            self._twice(step, twice, self._before[twice[0]][1], "before")
        self._touched, self._across, self._foreign, self._before = set(), {}, {}, {}
        self._most = max(self._most, self._passes)
        self._passes, self._poisoned = 0, False
        self._state, self._expect, self._nonzero = {}, {}, {}
        self._marks = {}
        for i in self.sampled:
            g = self.params[i].grad
            if g is not None:
                self._marks[i] = (weakref.ref(g), g._version)
        self._stepped, self._step = True, step + 1

    # -- other optimizers' steps ---------------------------------------------------------------
    def _any_step_begins(self, optimizer) -> None:
        at = next((k for k, e in enumerate(self._running) if e[0] is optimizer), None)
        if at is not None:  # its last step raised before its end: what it left open is closed
            del self._running[at:]
        ours = optimizer in self._ours
        if ours:
            for entry in self._running:  # a wrapper whose step runs this one's: not another optimizer
                entry[1] = True
        self._running.append([optimizer, ours or any(e[0] in self._ours for e in self._running)])

    def _any_step_ends(self, optimizer) -> None:
        at = next((k for k in range(len(self._running) - 1, -1, -1) if self._running[k][0] is optimizer), None)
        if at is None:
            return
        _, nested = self._running.pop(at)
        if nested:
            return
        shared = self._shared.get(optimizer)
        if shared is None:
            held = {id(p) for g in optimizer.param_groups for p in g["params"]}
            shared = self._shared[optimizer] = [i for i in self.sampled if id(self.params[i]) in held]
        other = type(optimizer).__name__
        # A gradient this one's last step used, no backward since: the other applied it again.
        again = [i for i in shared if i not in self._touched and i in self._marks
                 and self._marks[i][0]() is not None and self._marks[i][0]() is self.params[i].grad]
        if again and self._stepped:
            self._twice(self._step - 1, again, other, "after")
        for i in shared:  # this one may step next on the gradient the other just used
            g = self.params[i].grad
            if g is not None and i not in again:
                self._before[i] = (weakref.ref(g), other)
        for i in self._touched.difference(shared):  # a later backward may add onto what this one's tensors hold
            g = self.params[i].grad
            if g is not None:
                self._across.setdefault(i, (weakref.ref(g), g._version, other))

    def _twice(self, step: int, tensors: list[int], other: str, order: str) -> None:
        tests = [_entries(self.params[i].grad).ne(0).any() for i in tensors]
        self._pending.append((step, "twice", tensors, [bool(t) if self.eager else t for t in tests], (other, order)))

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
                judge = {"carried": self._stale, "nonfinite": self._skipped, "foreign": self._foreign_hit,
                         "twice": self._twice_hit}[what]
                found.append((step, judge(step, hit, *counts)))
        return found

    def _foreign_hit(self, step: int, hit: list[int], other: str) -> Hit:
        return ("stale_gradient", self.names[hit[0]], (
            f"a backward pass added onto {self.names[hit[0]]}'s .grad (and {len(hit) - 1} more of the "
            f"{len(self.sampled)} tensors watched) while it still held the gradient of an earlier backward that "
            f"another optimizer ({other}) had already stepped on: step {step} applies that other loss's gradient "
            "summed into this model's own (no zero_grad() before this model's own backward, as in a GAN whose "
            "generator pass also fills the discriminator's .grad)"),
            {"tensors_carrying": len(hit), "tensors_watched": len(self.sampled), "other_optimizer": other})

    def _twice_hit(self, step: int, hit: list[int], other: str, order: str) -> Hit:
        return ("changed_between_steps", self.names[hit[0]], (
            f"another optimizer ({other}) stepped {self.names[hit[0]]} (and {len(hit) - 1} more of the "
            f"{len(self.sampled)} tensors watched) with the very gradient this optimizer's step {step} used, "
            f"{order} it, no backward between: one gradient is applied twice per iteration, and the other "
            "optimizer moves the tensors between this one's steps (a module whose parameters are held by two "
            "optimizers)"),
            {"tensors_shared": len(hit), "tensors_watched": len(self.sampled), "other_optimizer": other})

    def _skipped(self, step: int, hit: list[int], passes: int, most: int) -> Hit:
        i = hit[0]
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
        if self._listening:
            _stop_listening(self)
            self._listening = False
