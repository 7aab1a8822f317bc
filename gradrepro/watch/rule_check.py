"""``update_mismatch``, live: on a logged step, every parameter's change across
``optimizer.step()`` is what its optimizer's documented rule (``update_rule.predict``) makes of
its gradient and its state. The rules of SGD, Adam and AdamW act entry by entry, so the check
needs no copy of the model: the same few fixed entries of each tensor as its fingerprint
(``invariants.Fingerprints``) are predicted in float64 from the gradient and the optimizer's
state before the step, and compared with the entries after it.

Tolerance: the predicted change within a relative 1e-3 (the float32 arithmetic of the
optimizer's own kernels against float64), plus four units in the last place of the entry's
value in the parameter's dtype (the rounding of the stored result).

The rule also advances Adam's per-tensor ``step`` by one: a step count the step left where it
found it (a hand-written step that reads the count for its bias corrections and never increments
it) makes every later update use the first step's corrections, though each update matches the
rule for the state it found.
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch

from gradrepro.diagnose.update_rule import predict, rule_name
from gradrepro.watch.invariants import SAMPLES, Fingerprints, Hit, _flat
from gradrepro.watch.optimizers import member_groups

RTOL = 1e-3
ULPS = 4.0


def _pick(t: torch.Tensor, k: int) -> Optional[torch.Tensor]:
    """``k`` entries of ``t`` evenly spaced over its memory, as a view: entries
    ``stride // 2 + i * stride`` of its flat order, ``stride = numel // k``."""
    if type(t) in _PLAIN and not t.is_complex() and t.is_contiguous() and 0 < k <= t.numel():
        # One view operation where the general path takes four (detach, view, two slices):
        # this runs for every tensor, three times, on each logged step.
        stride = t.numel() // k
        return t.as_strided((k,), (stride,), t.storage_offset() + stride // 2)
    flat = _flat(t)
    if flat is None or flat.numel() < k or k == 0:
        return None
    stride = flat.numel() // k
    return flat[stride // 2::stride][:k]


_PLAIN = (torch.Tensor, torch.nn.Parameter)


class UpdateRuleCheck:
    """``predict`` at the optimizer's step pre-hook of a logged step, ``compare`` after it."""

    def __init__(self, names: Sequence[str], params: Sequence[torch.Tensor], prints: Fingerprints,
                 optimizer: Optional[torch.optim.Optimizer]) -> None:
        self.names, self.params, self.optimizer = list(names), list(params), optimizer
        # Several optimizers (watch.optimizers): each group is predicted by its own optimizer's rule.
        self.enabled = (optimizer is not None and prints.enabled
                        and any(rule_name(m) in ("sgd", "adam") for m, _ in member_groups(optimizer)))
        self._expected: list[tuple] = []  # per group: (its optimizer, tensor indices, entries each, before, predicted)
        self._counts: list[tuple] = []  # (optimizer, tensor indices, Adam's step count they had before the step)
        self._index = {id(p): i for i, p in enumerate(self.params)}

    def predict(self) -> None:
        """Per param group, the sampled entries of every tensor with a gradient, concatenated and
        predicted by one call of the rule (the rules act entry by entry; a group's tensors share
        its hyperparameters). Tensors whose scalar state differs from the group's first (Adam's
        ``step``) are predicted alone."""
        self._expected, self._counts = [], []
        if not self.enabled:
            return
        with torch.no_grad():
            for member, group in member_groups(self.optimizer):
                if rule_name(member) not in ("sgd", "adam"):
                    continue
                batches: dict = {}
                for p in group["params"]:
                    picked = self._picked(p, member.state)
                    if picked is not None:
                        batches.setdefault(picked[3], []).append(picked)
                for (_, scalars), members in ((key, m) for key, m in batches.items()):
                    index = [m[0] for m in members]
                    p_s = torch.cat([m[1] for m in members]).double()
                    g_s = torch.cat([m[2] for m in members]).double()
                    keys = members[0][4]
                    state = dict(scalars)
                    for key in keys:
                        state[key] = torch.cat([m[5][key] for m in members]).double()
                    predicted = predict(member, group, p_s, g_s, state)
                    if predicted is not None:
                        sizes = [m[1].numel() for m in members]
                        self._expected.append((member, index, sizes, p_s.clone(), predicted))
                        count = state.get("step")
                        if (rule_name(member) == "adam" and isinstance(count, (int, float))
                                and not isinstance(count, bool)):
                            self._counts.append((member, index, count))

    def _picked(self, p: torch.Tensor, states: dict):
        """(index, sampled entries of p and of its gradient, a key of its state's scalars and
        tensor names, those names, the state's sampled tensors), or None."""
        i = self._index.get(id(p))
        if (i is None or p.dim() == 0 or p.grad is None or p.grad.is_sparse
                or not (p.is_floating_point() or p.is_complex())):
            return None
        k = min(SAMPLES, p.numel() * (2 if p.is_complex() else 1))
        p_s, g_s = _pick(p, k), _pick(p.grad, k)
        if p_s is None or g_s is None:
            return None
        tensors, scalars = {}, []
        for key, value in states.get(p, {}).items():
            if torch.is_tensor(value) and value.shape == p.shape:
                value = _pick(value, k)
                if value is None:
                    return None
                tensors[key] = value
            else:
                scalars.append((key, float(value) if torch.is_tensor(value) and value.numel() == 1 else value))
        names = tuple(sorted(tensors))
        try:
            key = (names, tuple(scalars))
            hash(key)
        except TypeError:
            return None
        return i, p_s, g_s, key, names, tensors

    def _frozen_counts(self, counts: list[tuple]) -> list[Hit]:
        """Tensors whose Adam step count the step did not advance by one."""
        bad = []
        for member, index, before in counts:
            for i in index:
                now = member.state.get(self.params[i], {}).get("step")
                if now is not None and float(now) != before + 1:
                    bad.append((i, float(now), before))
        if not bad:
            return []
        i, now, before = bad[0]
        shown = ", ".join(self.names[b[0]] for b in bad[:6]) + (" ..." if len(bad) > 6 else "")
        return [("update_mismatch", self.names[i], (
            f"{len(bad)} tensor(s) ({shown}) left optimizer.step() with the Adam step count at {now:g}, where "
            f"the step found {before:g} and Adam's rule advances it by one: the bias corrections stay those of "
            "one step, an effective learning rate the schedule does not set (a hand-written step that reads the "
            "count and never increments it)"),
            {"tensors_mismatched": len(bad), "step_count_before": before, "step_count_after": now})]

    def compare(self, step: int) -> list[Hit]:
        counts, self._counts = self._counts, []
        expected, self._expected = self._expected, []
        if not expected:
            return []
        frozen = self._frozen_counts(counts)
        if frozen:
            return frozen
        bad = []
        with torch.no_grad():
            for member, index, sizes, before, predicted in expected:
                now = torch.cat([_pick(self.params[i], n) for i, n in zip(index, sizes)]).double()
                ulp = torch.tensor([torch.finfo(self.params[i].dtype if self.params[i].is_floating_point()
                                                else torch.float32).eps for i, n in zip(index, sizes)
                                    for _ in range(n)], dtype=torch.float64, device=now.device)
                allowed = RTOL * (predicted - before).abs() + ULPS * ulp * torch.maximum(now.abs(), predicted.abs())
                err = (now - predicted).abs()
                over = (err > allowed).cpu().numpy()
                if not over.any():
                    continue
                start = 0
                for i, n in zip(index, sizes):
                    part = over[start:start + n]
                    if part.any():
                        j = start + int(part.argmax())
                        bad.append((i, float((now - before)[j]), float((predicted - before)[j]), member))
                    start += n
        if not bad:
            return []
        i, moved, wanted, member = bad[0]
        shown = ", ".join(self.names[b[0]] for b in bad[:6]) + (" ..." if len(bad) > 6 else "")
        rule = rule_name(member)
        return [("update_mismatch", self.names[i], (
            f"{len(bad)} tensor(s) ({shown}) changed otherwise than the {type(member).__name__} rule makes "
            f"of the gradient and state the step found (an entry moved by {moved:.4g}; the {rule} rule predicts "
            f"{wanted:.4g}): something else wrote the weights or the gradient during optimizer.step()"),
            {"tensors_mismatched": len(bad), "moved": moved, "predicted": wanted})]
