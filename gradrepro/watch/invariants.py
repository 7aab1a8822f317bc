"""Invariants of a training step that ``gradrepro.record`` checks live, from what its hooks see
(``watch.watcher`` wires them in). Each is a property every correct loop keeps, so a
contradiction is reported at once, with the tensors and the likely cause:

- ``changed_between_steps``: no parameter changes between one ``optimizer.step()`` and the
  next training forward pass. Checked on every step from a fingerprint of each tensor (a few
  fixed entries, read bit for bit with one ``torch.cat``; no copy of the model): an averaged or
  EMA copy swapped in for evaluation and never swapped back, weights folded or normalised in
  place by an evaluation or export helper, a shallow copy edited in place. Two changes made on
  purpose are told apart on the host and said at info: a projection onto a constraint
  (``projected_between_steps``: WGAN's clipping, a max-norm) and a pull part of the way back
  toward the last synced weights (``interpolated_between_steps``: Lookahead, Reptile). A change
  within the rounding of a round trip (``rounded_between_steps``: a delta added and removed again,
  as an adapter merged into its base weights for evaluation and unmerged) is said at info too.
- ``frozen_moved``: a tensor that does not train (``requires_grad=False``, or in no param
  group) keeps its value, across the optimizer's step, inside the step (from its first forward
  pass to the optimizer's step) and between steps: momentum or weight decay applied to a frozen
  tensor whose ``.grad`` is a zero tensor, a hand-written decay over every parameter,
  ``nn.Embedding(max_norm=...)`` renormalising a frozen table in its forward pass.
  One change of frozen tensors is told apart on the host and said at info: each
  moved onto the segment toward a trainable tensor of the same shape (``target_network_update``:
  a momentum target or teacher held in the recorded module, BYOL's or MoCo's, or a target
  network's periodic copy, DQN's).
- ``grad_reset_in_step``: the step consumes what the backward passes since the last step
  produced. A backward that started from a reset gradient, whose gradient was reset again
  before the next backward of the same step while the weights stayed as they were, was
  thrown away (``zero_grad()`` inside the micro-batch loop of an accumulated step). A loop
  that moves the weights with the first gradient before the next backward (sharpness-aware
  minimisation) has consumed it; one whose first backward starts from the last step's sum (a
  GAN's generator pass writing the discriminator's ``.grad``) is the carried-sum case,
  ``stale_gradient``'s. Checked on logged steps.
- ``eval_mode`` (with ``checks.mode_hits``): the modules whose forward reads their
  ``training`` flag are found from their code (``training_readers``), not only Dropout and
  BatchNorm instances: functional dropout, stochastic depth, attention dropout.
- ``recorder_error``: the recorder itself failed; recording stops and the loop goes on.

Cost: on every step two ``torch.cat`` of a few entries per tensor (before and after the
optimizer's step) and one more with a bitwise comparison when the next step begins; on CPU the
comparison is read at once, on an accelerator it is kept on the device until the next logged
step (no host wait on unlogged steps).
"""

from __future__ import annotations

import inspect
import math
import re
import weakref
from typing import Optional, Sequence

import numpy as np
import torch
from torch import nn

from gradrepro.diagnose.report import INFO, WARNING
from gradrepro.probe.shards import DTensor, local

Hit = tuple[str, str, str, dict]  # kind, name, detail, evidence (as checks.Hit)

KINDS: dict[str, str] = {"changed_between_steps": WARNING, "frozen_moved": WARNING,
                         "grad_reset_in_step": WARNING, "recorder_error": WARNING, "projected_between_steps": INFO,
                         "interpolated_between_steps": INFO, "target_network_update": INFO,
                         "changed_without_step": WARNING, "rounded_between_steps": INFO}
NEXT_CHECK: dict[str, str] = {
    "target_network_update": "nothing, if the frozen tensors are a target or teacher network kept as a moving average "
    "or a periodic copy of the trained one (BYOL, MoCo, mean teacher, DQN); silence='target_network_update' hides it",
    "interpolated_between_steps": "nothing, if the loop pulls the weights toward a slow copy on purpose (Lookahead, "
    "Reptile's or local SGD's outer step); otherwise find what writes them between steps; "
    "silence='interpolated_between_steps' hides it",
    "changed_without_step": "give record() the optimizer that steps, built once before the loop (an optimizer made "
    "anew every batch also loses its state: Adam's moments, momentum); a list if several step",
    "rounded_between_steps": "nothing, if the loop adds something to the weights and takes it away again between "
    "steps (an adapter merged for evaluation and unmerged, a scale applied and undone): floating point leaves this "
    "much; silence='rounded_between_steps' hides it",
    "projected_between_steps": "nothing, if the constraint is on purpose (WGAN's weight clipping, a non-negativity "
    "or max-norm constraint); silence='projected_between_steps' hides it",
    "changed_between_steps": "find what writes the weights after optimizer.step(): an EMA/averaged copy loaded for "
    "evaluation and not restored (keep a backup and copy it back), load_state_dict inside the loop, an export or "
    "evaluation helper that folds or normalises weights in place (run it on copy.deepcopy(model)), a shallow "
    "copy.copy(model) edited in place; silence this kind if the edit is intended (weight clipping, pruning masks)",
    "frozen_moved": "a tensor that does not train moved: its .grad is a zero tensor rather than None "
    "(zero_grad(set_to_none=False), or frozen after the optimizer was built) and the optimizer applies momentum or "
    "weight decay to it; set p.grad = None when freezing, or take it out of the optimizer; or a hand-written decay "
    "loop that covers every parameter",
    "grad_reset_in_step": "a backward's gradient was reset before the optimizer used it: in an accumulated step "
    "call zero_grad() only after optimizer.step(), not before every micro-batch",
    "recorder_error": "the detail says what stopped (the recording, or one check); training went on; please report "
    "it with the detail above, or pass live=False / hooks=False to work around it",
}

SAMPLES = 4  # entries per tensor in its fingerprint: enough for a swap or an edit of the whole tensor
_INT_OF_SIZE = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _flat(p: torch.Tensor) -> Optional[torch.Tensor]:
    """A 1-d view of every entry of a dense tensor (None where no such view exists)."""
    t = local(p.detach())
    if t.is_complex():
        t = torch.view_as_real(t)
    if t.is_contiguous():
        return t.view(-1)
    for fmt in (torch.channels_last, torch.channels_last_3d):
        try:
            if t.is_contiguous(memory_format=fmt):
                return t.as_strided((t.numel(),), (1,), t.storage_offset())
        except RuntimeError:
            continue
    return None


# Fingerprints.interpolation: the tolerance in epsilons of |anchor| + |before| + |after| (three
# roundings of the pull, half an epsilon each, and as much again for the fitted alpha: 3; 8 leaves
# more than twice that), the sampled entries that must have moved, and the open range of alpha
# (1 is the anchor loaded itself).
INTERPOLATION_ULPS = 8.0
INTERPOLATION_MIN_ENTRIES = 4
# A round trip w -> fl(fl(w + d) - d) rounds twice, each within half an epsilon of its result:
# |error| <= eps/2 (|w + d| + |w|) <= 1.5 eps max|W| where |d| <= max|W|; 2 leaves room for |d|
# up to 2 max|W| (Higham, Accuracy and Stability of Numerical Algorithms, 2nd ed., Sec. 2.2).
ROUND_TRIP_ULPS = 2.0
INTERPOLATION_ALPHA = (2.0**-10, 1.0 - 2.0**-10)

# A slice that ``torch.renorm`` scaled down has the ball's radius as its norm up to the float32
# rounding of its norm and scale (about sqrt(n) x 6e-8 for n entries, 6e-6 at 10^4) and renorm's
# 1e-7 added to the norm; 1e-4 bounds both for slices of up to 10^6 entries of norm >= 0.01.
BALL_RTOL = 1e-4


def _on_ball(p: torch.Tensor, was: torch.Tensor, now: torch.Tensor, moved: torch.Tensor, k: int) -> bool:
    """Whether the sampled entries that changed (``moved``, of the ``k`` taken as the
    fingerprint takes them) were each scaled toward zero, their slice along dimension 0 or 1
    now at the largest slice norm of the tensor, which at least two slices share: a projection
    onto a norm ball per slice."""
    if p.dim() < 2 or not bool(moved.any()):
        return False
    shrank = (now.abs() < was.abs()) & (torch.sign(now) == torch.sign(was))
    if not bool(shrank[moved].all()):
        return False
    t = local(p.detach()).float()
    n = t.numel()
    stride = n // k
    index = torch.arange(k, device=t.device)[moved.to(t.device)] * stride + stride // 2
    inner = n // (t.shape[0] * t.shape[1])
    slices = [(0, index // (n // t.shape[0]))]  # dimension 0 is outermost in every layout _flat reads
    if p.is_contiguous():
        slices.append((1, (index // inner) % t.shape[1]))
    for dim, of_entry in slices:
        norms = torch.linalg.vector_norm(t.transpose(0, dim).reshape(t.shape[dim], -1), dim=1)
        on = (norms.max() - norms) <= BALL_RTOL * norms.max()
        # at least two slices on the ball: one slice at the largest norm is every tensor's case
        if int(on.sum()) >= 2 and bool(on[of_entry].all()):
            return True
    return False


class Fingerprints:
    """A few fixed entries of every parameter, read together (``sample``) and compared bit for
    bit; ``changes`` says which tensors differ. The views follow a tensor whose storage was
    replaced (``p.data = ...``): they are rebuilt when a data pointer moves."""

    def __init__(self, names: Sequence[str], params: Sequence[torch.Tensor]) -> None:
        self.names, self.params = list(names), list(params)
        self.enabled = bool(self.params) and not any(
            p.is_meta or (DTensor is not None and isinstance(p, DTensor)) for p in self.params)
        self.views: list[torch.Tensor] = []
        self.bounds = np.zeros(len(self.params) + 1, dtype=np.int64)
        self._ptrs: list[int] = []
        if self.enabled:
            self._build()

    def _build(self) -> None:
        views, counts = [], []
        for p in self.params:
            flat = _flat(p) if p.is_floating_point() or p.is_complex() else None
            n = 0 if flat is None else flat.numel()
            k = min(SAMPLES, n)
            if k:
                stride = n // k
                views.append(flat[stride // 2::stride][:k])
            counts.append(k)
        self.views = views
        self.bounds = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)
        self._ptrs = [p.data_ptr() for p in self.params]
        self.enabled = bool(views)

    def sample(self) -> Optional[torch.Tensor]:
        if not self.enabled:
            return None
        if [p.data_ptr() for p in self.params] != self._ptrs:
            self._build()
            if not self.enabled:
                return None
        with torch.no_grad():
            s = torch.cat(self.views) if len({v.dtype for v in self.views}) == 1 else torch.cat(
                [v.double() for v in self.views])
            self.dtype = s.dtype
            return s.view(_INT_OF_SIZE[s.element_size()])  # bits: NaN equals NaN, -0 differs from 0

    def projected(self, before: torch.Tensor, after: torch.Tensor, changed: Sequence[int]) -> set:
        """Of the tensors ``changed`` between two samples, those whose change is an in-place
        projection onto a constraint set: onto a box (``clamp_(lo, hi)``, ``clamp_(min=0)``),
        where every sampled entry that changed moved from outside exactly onto the tensor's
        present minimum or maximum; or onto a norm ball per slice (a max-norm constraint,
        ``torch.renorm``), where every sampled entry that changed shrank toward zero and its
        slice's norm is now the largest slice norm (``_on_ball``). An edit of another kind (a
        copy loaded, a rescaling of the whole tensor) leaves changed entries inside the range
        or their slices below the largest."""
        b, a = before.view(self.dtype), after.view(self.dtype)
        out = set()
        with torch.no_grad():
            for i in changed:
                flat = _flat(self.params[i])
                if flat is None or flat.is_complex() or not flat.numel():
                    continue
                lo, hi = self.bounds[i], self.bounds[i + 1]
                was, now = b[lo:hi], a[lo:hi]
                moved = was != now
                low, high = flat.min().to(now.dtype), flat.max().to(now.dtype)
                onto = ((now == high) & (was > now)) | ((now == low) & (was < now))
                # a constant fill of many entries is no box's projection (one entry cannot tell them apart)
                box = (flat.numel() == 1 or bool(low < high)) and bool(onto[moved].all())
                if box or _on_ball(self.params[i], was, now, moved, hi - lo):
                    out.add(i)
        return out

    def rounded(self, before: torch.Tensor, after: torch.Tensor, changed: Sequence[int]) -> set:
        """Of the tensors ``changed`` between two samples, those where every sampled entry moved by
        at most ``ROUND_TRIP_ULPS`` times the dtype's epsilon times the tensor's largest magnitude:
        the rounding a delta added and removed again leaves (an adapter merged for evaluation and
        unmerged), not a change a step or a copy makes."""
        if not self.dtype.is_floating_point:
            return set()
        b, a = before.view(self.dtype), after.view(self.dtype)
        out = set()
        with torch.no_grad():
            for i in changed:
                flat = _flat(self.params[i])
                if flat is None or flat.is_complex() or not flat.numel() or not flat.is_floating_point():
                    continue
                lo, hi = self.bounds[i], self.bounds[i + 1]
                was, now = b[lo:hi].double(), a[lo:hi].double()
                if not bool(torch.isfinite(was).all() and torch.isfinite(now).all()):
                    continue
                tol = ROUND_TRIP_ULPS * torch.finfo(flat.dtype).eps * float(flat.abs().max())
                if bool(((now - was).abs() <= tol).all()):
                    out.add(i)
        return out

    def interpolation(self, anchor: Optional[torch.Tensor], before: torch.Tensor, after: torch.Tensor,
                      changed: Sequence[int]) -> Optional[float]:
        """The one ``alpha`` with ``after = before + alpha (anchor - before)`` on every sampled entry
        of the tensors ``changed`` between two samples, where ``anchor`` is the sample after the
        last change between steps (or the first): the weights pulled part of the way back toward
        an earlier copy of themselves, as Lookahead's sync to its slow weights (Zhang et al. 2019),
        Reptile's outer step (Nichol et al. 2018) or local SGD's average do. None where no such
        ``alpha`` in (0, 1) fits: a copy loaded (an EMA or averaged model, a checkpoint: not on
        that segment, or the anchor itself, alpha 1), a re-initialisation, a rescaling.

        Each sampled entry must fit within ``INTERPOLATION_ULPS`` units of its dtype's epsilon
        times ``|anchor| + |before| + |after|``: the pull computed in the weights' dtype rounds at
        most three times (the difference, the scaled step, the sum), each within half an epsilon
        of its result, and the least-squares ``alpha`` adds as much again; at least
        ``INTERPOLATION_MIN_ENTRIES`` sampled entries must have moved, so that ``alpha`` is
        over-determined."""
        if anchor is None or not changed or anchor.shape != before.shape or not self.dtype.is_floating_point:
            return None
        idx = np.concatenate([np.arange(self.bounds[i], self.bounds[i + 1]) for i in changed])
        index = torch.from_numpy(idx).to(before.device)
        s, b, a = (t.view(self.dtype).index_select(0, index).double() for t in (anchor, before, after))
        d, c = s - b, a - b
        dd = float((d * d).sum())
        if not (dd > 0 and int((c != 0).sum()) >= INTERPOLATION_MIN_ENTRIES):
            return None
        alpha = float((c * d).sum()) / dd
        if not INTERPOLATION_ALPHA[0] < alpha < INTERPOLATION_ALPHA[1]:
            return None
        tol = INTERPOLATION_ULPS * torch.finfo(self.dtype).eps * (s.abs() + b.abs() + a.abs())
        return alpha if bool(((c - alpha * d).abs() <= tol).all()) else None

    def toward(self, before: torch.Tensor, after: torch.Tensor, moved: Sequence[int],
               trained: Sequence[int]) -> Optional[tuple[list[int], list[float]]]:
        """Whether every tensor of ``moved`` (frozen tensors that changed between two samples) moved
        onto the segment toward a tensor of ``trained`` with as many entries, as it is now: ``after
        = before + alpha (x - before)`` on every sampled entry, 0 < alpha <= 1, within the rounding
        ``interpolation`` allows (the same entries are sampled from tensors of one size, so the
        samples pair up). A momentum target's update (Polyak averaging: BYOL, MoCo, a mean
        teacher) or a copy of the trained tensor (alpha 1: DQN's target network). The tensors and
        their alphas (NaN where the two were equal, so that the average only rounds); None unless
        every moved tensor has such a partner."""
        if not moved or not trained or not self.dtype.is_floating_point:
            return None
        b, a = before.view(self.dtype).double().cpu().numpy(), after.view(self.dtype).double().cpu().numpy()
        sizes = np.diff(self.bounds)
        numel = [p.numel() for p in self.params]
        eps = float(torch.finfo(self.dtype).eps)
        alphas = []
        for i in moved:
            lo, hi = self.bounds[i], self.bounds[i + 1]
            was, now = b[lo:hi], a[lo:hi]
            fit = None
            for j in trained:
                if numel[j] != numel[i] or sizes[j] != sizes[i] or self.params[j].dtype != self.params[i].dtype:
                    continue
                x = a[self.bounds[j]:self.bounds[j + 1]]
                d, c = x - was, now - was
                tol = INTERPOLATION_ULPS * eps * (np.abs(x) + np.abs(was) + np.abs(now))
                dd = float(d @ d)
                if not dd > 0:  # equal to the trained tensor already: an average of the two only rounds
                    if bool((np.abs(c) <= tol).all()):
                        fit = math.nan
                        break
                    continue
                alpha = float(c @ d) / dd
                if 0.0 < alpha <= 1.0 + INTERPOLATION_ULPS * eps and bool((np.abs(c - alpha * d) <= tol).all()):
                    fit = min(alpha, 1.0)
                    break
            if fit is None:
                return None
            alphas.append(fit)
        return list(moved), alphas

    @staticmethod
    def differ(a: Optional[torch.Tensor], b: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
        """Entry by entry, where two samples differ (a device tensor; None when not comparable)."""
        if a is None or b is None or a.shape != b.shape or a.dtype != b.dtype:
            return None
        return a != b

    def changes(self, mask: torch.Tensor) -> list[int]:
        """The tensors with a differing entry, from ``differ``'s mask (one host read)."""
        m = mask.cpu().numpy()
        if not m.any():
            return []
        summed = np.concatenate([[0], np.cumsum(m.astype(np.int64))])
        counts = summed[self.bounds[1:]] - summed[self.bounds[:-1]]
        sizes = np.diff(self.bounds)
        return [i for i in range(len(self.params)) if sizes[i] and counts[i] > 0]


def _shown(names: Sequence[str], indices: Sequence[int]) -> str:
    """The first six tensors' names, for a finding's text."""
    return ", ".join(names[i] for i in indices[:6]) + (" ..." if len(indices) > 6 else "")


_WHEN = {"between": "between the last optimizer.step() and this step's forward pass",
         "during": "during optimizer.step()",
         "inside": "inside the step, between its first forward pass and optimizer.step()"}


class StepInvariants:
    """``changed_between_steps`` and ``frozen_moved`` on every step (module docstring). The
    recorder calls ``step_begins``, ``before_step`` and ``after_step``; ``hits`` hands over what
    was found, read at once on CPU and at the next logged step elsewhere."""

    def __init__(self, names: Sequence[str], params: Sequence[torch.Tensor],
                 optimizer: Optional[torch.optim.Optimizer]) -> None:
        self.prints = Fingerprints(names, params)
        self.optimizer = optimizer
        self.eager = bool(params) and params[0].device.type == "cpu"
        self._after: Optional[torch.Tensor] = None  # the fingerprint after the last step
        self._anchor: Optional[torch.Tensor] = None  # at the first step, then after each change between steps
        self._before: Optional[torch.Tensor] = None  # at this step's optimizer.step(), before it
        # (step, where, mask, tensors projected, the pull toward the anchor: (tensors, alpha) or None,
        # frozen tensors moved toward trainable ones: (tensors, alphas) or None)
        # (the last: tensors whose change is a round trip's rounding)
        self._pending: list[tuple[int, str, torch.Tensor, set, Optional[tuple], Optional[tuple], set]] = []
        self._extra: list[tuple[int, Hit]] = []  # found whole (changed_without_step)
        self._last_forward: Optional[torch.Tensor] = None  # the fingerprint at the step's last forward pass
        self._first: Optional[torch.Tensor] = None  # at the step's first forward pass
        self._passes, self._changed = 0, None  # forward passes in this step; of them, after a change
        self._reported_unstepped = False
        self._frozen: list[int] = []
        self._signature: Optional[tuple] = None
        self.refresh()

    def refresh(self) -> None:
        """Which tensors do not train, as the optimizer's step finds them: requires_grad=False, or
        in no param group. Read again when a flag or the groups' sizes changed (a freeze or an
        unfreeze between two steps, ``add_param_group``): a few attribute reads a step."""
        groups = self.optimizer.param_groups if self.optimizer is not None else []
        signature = (tuple(p.requires_grad for p in self.prints.params), tuple(len(g["params"]) for g in groups))
        if signature == self._signature:
            return
        self._signature = signature
        held = {id(p) for g in groups for p in g["params"]} if self.optimizer is not None else None
        self._frozen = [i for i, p in enumerate(self.prints.params)
                        if not p.requires_grad or (held is not None and id(p) not in held)]
        self._frozen_mask = None
        if self._frozen and self.prints.enabled:
            keep = np.zeros(int(self.prints.bounds[-1]), dtype=bool)
            for i in self._frozen:
                keep[self.prints.bounds[i]:self.prints.bounds[i + 1]] = True
            self._frozen_mask = torch.from_numpy(keep).to(self.prints.views[0].device) if keep.any() else None

    def _differ(self, a: Optional[torch.Tensor], b: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
        """``Fingerprints.differ``, or None at once where the two are equal (on CPU: one call)."""
        if self.eager and a is not None and b is not None and a.shape == b.shape and torch.equal(a, b):
            return None
        return Fingerprints.differ(a, b)

    def forward_again(self, step: int, limit: int) -> None:
        """A training forward pass inside the step in progress: the next micro-batch of an
        accumulated step (the weights have not changed), SAM's perturbed pass (they changed once,
        and are restored before its step; Foret et al. 2021), or, where the optimizer given to the
        recorder never steps, every pass. Weights that changed before each of ``limit`` passes in
        a row with no step between are updated by something else (``changed_without_step``):
        ``limit`` is the logging period (at least 2, for SAM), since had the recorded optimizer
        made those changes, one of its steps would have been logged. On an accelerator the count
        stays on the device and is read once every ``limit`` passes."""
        if self._reported_unstepped or not self.prints.enabled:
            return
        now = self.prints.sample()
        last, self._last_forward = self._last_forward, now
        self._passes += 1
        mask = self._differ(last, now)
        if mask is not None:
            changed = mask.any()
            self._changed = changed.to(torch.int64) + self._changed if self._changed is not None else \
                changed.to(torch.int64)
        if self._passes % limit or self._changed is None:
            return
        if int(self._changed) >= limit:
            self._reported_unstepped = True
            self._extra.append((step, ("changed_without_step", "<model>", (
                f"the weights changed before each of {int(self._changed)} training forward passes in a row with no "
                "step of the optimizer given to record() between them: another optimizer updates them (a new one "
                "made every batch, or not the one given to record()) or a hand-written update; nothing of it is "
                "recorded"), {"passes": self._passes, "passes_after_a_change": int(self._changed)})))

    def step_begins(self, step: int) -> None:
        self._passes, self._changed = 1, None
        now = self._last_forward = self._first = self.prints.sample()
        if self._anchor is None:
            self._anchor = now
        if self._after is not None:
            mask = self._differ(self._after, now)
            if mask is not None:
                # On the host the change is read at once, so a clamp or a pull toward the anchor can be
                # told from an edit while the tensors are as it left them (on an accelerator the mask is
                # read at a later logged step).
                clamped, pulled, synced, rounded = set(), None, None, set()
                if self.eager:
                    changed = self.prints.changes(mask)
                    synced = self._toward(self._after, now, changed)
                    if synced is not None:
                        changed = [i for i in changed if i not in synced[0]]
                    clamped = self.prints.projected(self._after, now, changed)
                    rest = [i for i in changed if i not in clamped]
                    rounded = self.prints.rounded(self._after, now, rest)
                    rest = [i for i in rest if i not in rounded]
                    alpha = self.prints.interpolation(self._anchor, self._after, now, rest)
                    pulled = (rest, alpha) if alpha is not None else None
                self._pending.append((step, "between", mask, clamped, pulled, synced, rounded))
                self._anchor = now
            self._after = None

    def before_step(self) -> None:
        self.refresh()
        self._before = self.prints.sample() if self._frozen_mask is not None else None

    def after_step(self, step: int) -> None:
        self._after = self.prints.sample()
        if self._before is not None:
            mask = self._differ(self._before, self._after)
            if mask is not None and mask.shape == self._frozen_mask.shape:
                self._pending.append((step, "during", mask & self._frozen_mask, set(), None, None, set()))
            # Inside the step, from its first forward pass to optimizer.step(): frozen tensors written
            # by the forward pass itself (nn.Embedding's max_norm renormalises the rows it looks up;
            # MoCo updates its key encoder there).
            mask = self._differ(self._first, self._before)
            if mask is not None and mask.shape == self._frozen_mask.shape:
                mask = mask & self._frozen_mask
                synced = self._toward(self._first, self._before, self.prints.changes(mask)) if self.eager else None
                self._pending.append((step, "inside", mask, set(), None, synced, set()))
        self._before = self._first = None

    def _toward(self, before: torch.Tensor, after: torch.Tensor, changed: Sequence[int]) -> Optional[tuple]:
        """``Fingerprints.toward`` for the frozen tensors among ``changed``, against the others."""
        frozen = set(self._frozen)
        moved = [i for i in changed if i in frozen]
        if not moved:
            return None
        trained = [i for i in range(len(self.prints.params)) if i not in frozen]
        return self.prints.toward(before, after, moved, trained)

    def hits(self, logged: bool) -> list[tuple[int, Hit]]:
        """What the comparisons so far found, as (step, hit); on an accelerator only when
        ``logged`` (one host read then)."""
        found, self._extra = self._extra, []
        if not self._pending or not (self.eager or logged):
            return found
        pending, self._pending = self._pending, []
        frozen = set(self._frozen)
        for step, where, mask, clamped, pulled, synced, rounded in pending:
            explained = set(clamped) | rounded
            if synced is not None:
                found.append((step, self._target_update(where, *synced)))
                explained.update(synced[0])
            changed = [i for i in self.prints.changes(mask) if i not in explained]
            if pulled is not None and not frozen.intersection(pulled[0]):
                found.append((step, self._interpolated(pulled[0], pulled[1])))
            elif changed:
                found += [(step, h) for h in self._describe(step, where, changed, frozen)]
            if clamped:
                found.append((step, self._projected(sorted(clamped))))
            if rounded:
                found.append((step, self._rounded(sorted(rounded))))
        return found

    def _rounded(self, rounded: list[int]) -> Hit:
        names = self.prints.names
        shown = _shown(names, rounded)
        return ("rounded_between_steps", names[rounded[0]], (
            f"{len(rounded)} tensor(s) changed between the last optimizer.step() and this step's forward pass "
            f"({shown}) by no more than {ROUND_TRIP_ULPS:g} epsilons of their largest magnitude at every sampled "
            "entry: the rounding a change added and taken away again leaves (an adapter merged for evaluation and "
            "unmerged), not an edit"), {"tensors_rounded": len(rounded)})

    def _projected(self, projected: list[int]) -> Hit:
        names = self.prints.names
        shown = _shown(names, projected)
        return ("projected_between_steps", names[projected[0]], (
            f"{len(projected)} tensor(s) projected in place onto a constraint between the last optimizer.step() and "
            f"this step's forward pass ({shown}): every sampled entry that changed moved onto the tensor's bound (a "
            "clamp: WGAN's weight clipping, a non-negativity constraint) or shrank with its slice onto the largest "
            "slice norm (a max-norm constraint, torch.renorm)"), {"tensors_projected": len(projected)})

    def _interpolated(self, pulled: list[int], alpha: float) -> Hit:
        names = self.prints.names
        shown = _shown(names, pulled)
        return ("interpolated_between_steps", names[pulled[0]], (
            f"{len(pulled)} tensor(s) moved between the last optimizer.step() and this step's forward pass ({shown}) "
            f"onto the segment toward their values after the previous such change (or the first step), a fraction "
            f"{alpha:.4g} of the way, every sampled entry alike: a pull toward a slow copy (Lookahead, Reptile's or "
            "local SGD's outer step), not a copy loaded"), {"tensors_pulled": len(pulled), "alpha": alpha})

    def _target_update(self, where: str, moved: list[int], alphas: list[float]) -> Hit:
        names = self.prints.names
        shown = _shown(names, moved)
        known = [a for a in alphas if not math.isnan(a)]
        low, high = (min(known), max(known)) if known else (math.nan, math.nan)
        part = ("an unknown fraction (each equalled its trained tensor: the average only rounded)" if not known else
                f"{low:.4g}" if high - low <= 1e-3 * high else f"{low:.4g} to {high:.4g}")
        return ("target_network_update", names[moved[0]], (
            f"{len(moved)} tensor(s) that do not train moved {_WHEN[where]} ({shown}), each onto the segment toward a "
            f"trainable tensor of the same shape, {'' if not known else 'a fraction '}{part} of "
            "the way (1: a copy): a target or teacher network kept as a moving average of the trained one (BYOL, "
            "MoCo, mean teacher) or copied from it now and then (DQN's target network)"),
            {"tensors_moved": len(moved), "alpha_min": low if known else None, "alpha_max": high if known else None})

    def _describe(self, step: int, where: str, changed: list[int], frozen: set) -> list[Hit]:
        names = self.prints.names
        moved = [i for i in changed if i in frozen]
        edited = [i for i in changed if i not in frozen]
        hits: list[Hit] = []
        when = _WHEN[where]
        if edited:
            shown = _shown(names, edited)
            share = len(edited) / max(1, len(self.prints.params) - len(frozen))
            what = ("nearly every trainable tensor: a copy of the weights was loaded (an EMA or averaged "
                    "model swapped in, load_state_dict) and not restored" if share > 0.5 else
                    "an edit in place outside the optimizer (an evaluation or export helper, weight "
                    "normalisation, a shallow copy edited)")
            hits.append(("changed_between_steps", names[edited[0]], (
                f"{len(edited)} tensor(s) changed {when} ({shown}): {what}; training goes on from weights the "
                "optimizer did not produce"), {"tensors_changed": len(edited), "share_of_trainable": share}))
        if moved:
            shown = _shown(names, moved)
            why = {"during": "the optimizer moved them: a zero .grad (not None) lets momentum and weight decay act",
                   "inside": "the forward or backward pass wrote them (nn.Embedding's max_norm renormalises the rows "
                   "it looks up in place, frozen or not; a hook or a forward that updates weights in place)",
                   "between": "something outside the optimizer wrote them (a hand-written decay or update over every "
                   "parameter?)"}[where]
            hits.append(("frozen_moved", names[moved[0]], (
                f"{len(moved)} tensor(s) that do not train (requires_grad=False or in no param group) changed "
                f"{when} ({shown}): {why}"), {"tensors_moved": len(moved)}))
        return hits


class BackwardTrail:
    """``grad_reset_in_step`` on a logged step (module docstring): per backward, whether it
    started from a reset gradient (every .grad None or zero), whether it left one, and the
    weights' fingerprint at its end; the next backward of the same step compares."""

    def __init__(self, names: Sequence[str], params: Sequence[torch.Tensor], prints: Fingerprints) -> None:
        self.names, self.params, self.prints = list(names), list(params), prints
        self.reset_step()

    def reset_step(self) -> None:
        self._last: Optional[dict] = None  # the last backward of this step: fresh, marks, fingerprint
        self._fresh = False
        self._stopped = False
        self._passes, self._any_fresh, self._carried = 0, False, 0.0  # carried: the first pass's start
        self._upstream = False  # the pass in progress flows on into the model's inputs
        self.found: list[Hit] = []

    def halt(self) -> None:
        """Nothing more is judged this step (the trail itself failed)."""
        self._stopped = True

    def stop(self, carried_used: bool = True) -> None:
        """optimizer.step() began: backward passes inside it (a closure) are the optimizer's. A
        step none of whose backward passes started from a reset gradient sums the last step's
        into its own (however other losses wrote .grad in between: a GAN's generator pass),
        unless the step does not use the tensors carried in (``carried_used`` False: .grad was
        replaced after the backward passes)."""
        if carried_used and not self._stopped and self._passes and not self._any_fresh and self._carried > 0:
            self.found.append(("stale_gradient", "<model>", (
                f"none of this step's {self._passes} backward pass(es) started from a reset gradient: the first "
                f"began on .grad holding {self._carried:.4g} (norm over the model) from before the step, so the step "
                "uses the previous step's gradient summed into its own (no zero_grad() at the step boundary)"),
                {"backward_passes": self._passes, "carried_norm": self._carried}))
        self._stopped = True

    def _norms(self) -> tuple[list[int], np.ndarray]:
        idx = [i for i, p in enumerate(self.params) if p.grad is not None]
        if not idx:
            return idx, np.zeros(0)
        with torch.no_grad():
            norms = torch._foreach_norm([_dense(self.params[i].grad) for i in idx])
            return idx, torch.stack([n.float() for n in norms]).cpu().numpy()

    def begins(self, upstream: bool = False) -> None:
        """A backward began; ``upstream``: it also flows into the recorded model's inputs."""
        if self._stopped:
            return
        idx, norms = self._norms()
        self._fresh = not np.any(norms != 0)
        self._upstream = upstream
        if not self._passes:
            self._carried = float(np.sqrt(np.sum(np.nan_to_num(norms.astype(np.float64), nan=1.0) ** 2)))
        self._passes += 1
        self._any_fresh |= self._fresh
        last = self._last
        # A pass that flowed on into the model's inputs may serve the network upstream (a GAN's
        # generator pass through the discriminator): its gradient on the model is a by-product the
        # loop is right to reset before the model's own backward.
        if last is None or not last["fresh"] or not self._fresh or not last["left"] or last["upstream"]:
            return
        mask = Fingerprints.differ(last["print"], self.prints.sample())
        if mask is None or mask.any():  # the weights moved: the first gradient was consumed (SAM)
            return
        reset = [i for i in last["left"] if self.params[i].grad is None
                 or last["marks"][i][0]() is not self.params[i].grad
                 or self.params[i].grad._version != last["marks"][i][1]]
        if reset:
            shown = ", ".join(self.names[i] for i in reset[:6]) + (" ..." if len(reset) > 6 else "")
            self.found.append(("grad_reset_in_step", "<model>", (
                f"a backward pass's gradient was reset before the optimizer used it: {len(reset)} tensor(s) "
                f"({shown}) held it when the next backward of the same step began, from zero again, with the "
                "weights unchanged; the step uses the last micro-batch's gradient alone"),
                {"tensors_reset": len(reset)}))

    def ends(self, end: Optional[tuple] = None) -> None:
        """A backward ended; ``end``: (indices, their gradients' norms) where the caller has them."""
        if self._stopped:
            return
        if end is None:
            idx, norms = self._norms()
        else:
            idx = end[0]
            norms = torch.stack([n.float() for n in end[1]]).cpu().numpy() if idx else np.zeros(0)
        # A non-finite gradient is one no step can use (a GradScaler skips the step): dropping it
        # before the next backward is what the loop must do.
        left = [i for i, n in zip(idx, norms) if n != 0] if np.all(np.isfinite(norms)) else []
        self._last = {"fresh": self._fresh, "left": left, "upstream": self._upstream,
                      "marks": {i: (weakref.ref(self.params[i].grad), self.params[i].grad._version) for i in left},
                      "print": self.prints.sample()}


def _dense(g: torch.Tensor) -> torch.Tensor:
    g = local(g)
    if g.is_sparse:
        g = g.to_dense()
    return torch.view_as_real(g) if g.is_complex() else g


# -- modules whose forward reads their training flag ----------------------------------------------
_READS_TRAINING = re.compile(r"\bself\.training\b|\btraining\s*=\s*self\.training\b")
_SOURCE_CACHE: dict[type, bool] = {}


def _class_reads_training(cls: type) -> bool:
    """Whether a module class's own code (its MRO below nn.Module, torch.nn's classes left to
    ``checks.mode_sensitive``) reads ``self.training``."""
    if cls in _SOURCE_CACHE:
        return _SOURCE_CACHE[cls]
    found = False
    for klass in cls.__mro__:
        if klass is nn.Module or not issubclass(klass, nn.Module):
            break
        if klass.__module__.startswith("torch.nn."):
            continue
        try:
            found = bool(_READS_TRAINING.search(inspect.getsource(klass)))
        except (OSError, TypeError):
            found = False
        if found:
            break
    _SOURCE_CACHE[cls] = found
    return found


def training_readers(model: nn.Module, known: Sequence[tuple[str, nn.Module]] = ()) -> list[tuple[str, nn.Module]]:
    """Modules, beside ``known``, whose forward changes with ``training``: those whose code reads
    ``self.training`` (functional dropout, stochastic depth, attention dropout), torch's RReLU,
    and torch's attention and recurrent layers with dropout > 0. A module whose every parameter
    is frozen is left out (eval mode is how a frozen part is meant to run)."""
    seen = {id(m) for _, m in known}
    found = []
    for name, m in model.named_modules():
        if id(m) in seen:
            continue
        params = list(m.parameters())
        if params and not any(p.requires_grad for p in params):
            continue
        if isinstance(m, nn.RReLU) or (isinstance(m, (nn.MultiheadAttention, nn.RNNBase))
                                       and float(getattr(m, "dropout", 0.0) or 0.0) > 0):
            found.append((name or "<root>", m))
        elif _class_reads_training(type(m)):
            found.append((name or "<root>", m))
    return found


def recorder_error_hit(exc: BaseException, where: str) -> Hit:
    cause = f"{type(exc).__name__}: {str(exc).strip().splitlines()[0] if str(exc).strip() else ''}".rstrip(": ")
    return ("recorder_error", "<recorder>", (
        f"the recorder failed in {where} ({cause}); it stopped recording and the training goes on "
        "(what was recorded before stays in the run folder)"), {"error": cause})


