"""``update_mismatch``, live: on a logged step, every parameter's change across
``optimizer.step()`` is what its optimizer's documented rule (``update_rule.predict``) makes of
its gradient and its state. The rules of SGD, Adam and AdamW act entry by entry, so the check
needs no copy of the model: the same few fixed entries of each tensor as its fingerprint
(``invariants.Fingerprints``) are predicted in float64 from the gradient and the optimizer's
state before the step, and compared with the entries after it.

Tolerance: the predicted change within a relative 1e-3 (the float32 arithmetic of the
optimizer's own kernels against float64), plus four units in the last place of the entry's
value in the parameter's dtype (the rounding of the stored result).
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch

from gradrepro.diagnose.invariants import SAMPLES, Fingerprints, Hit, _flat
from gradrepro.diagnose.update_rule import predict, rule_name

RTOL = 1e-3
ULPS = 4.0


def _pick(t: torch.Tensor, k: int) -> Optional[torch.Tensor]:
    flat = _flat(t)
    if flat is None or flat.numel() < k or k == 0:
        return None
    stride = flat.numel() // k
    return flat[stride // 2::stride][:k]


class UpdateRuleCheck:
    """``predict`` at the optimizer's step pre-hook of a logged step, ``compare`` after it."""

    def __init__(self, names: Sequence[str], params: Sequence[torch.Tensor], prints: Fingerprints,
                 optimizer: Optional[torch.optim.Optimizer]) -> None:
        self.names, self.params, self.optimizer = list(names), list(params), optimizer
        self.enabled = (optimizer is not None and prints.enabled and rule_name(optimizer) in ("sgd", "adam"))
        self._expected: list[tuple[int, torch.Tensor, torch.Tensor]] = []  # (index, before, predicted)

    def predict(self) -> None:
        self._expected = []
        if not self.enabled:
            return
        group_of = {id(p): g for g in self.optimizer.param_groups for p in g["params"]}
        with torch.no_grad():
            for i, p in enumerate(self.params):
                group = group_of.get(id(p))
                if group is None or p.grad is None or p.grad.is_sparse or not (p.is_floating_point() or p.is_complex()):
                    continue
                k = min(SAMPLES, p.numel() * (2 if p.is_complex() else 1))
                p_s, g_s = _pick(p, k), _pick(p.grad, k)
                if p_s is None or g_s is None:
                    continue
                state = {}
                for key, value in self.optimizer.state.get(p, {}).items():
                    if torch.is_tensor(value) and value.shape == p.shape:
                        value = _pick(value, k)
                        if value is None:
                            break
                        state[key] = value.double()
                    else:
                        state[key] = value
                else:
                    predicted = predict(self.optimizer, group, p_s.double(), g_s.double(), state)
                    if predicted is not None:
                        self._expected.append((i, p_s.double().clone(), predicted))

    def compare(self, step: int) -> list[Hit]:
        expected, self._expected = self._expected, []
        if not expected:
            return []
        bad = []
        with torch.no_grad():
            for i, before, predicted in expected:
                p = self.params[i]
                now = _pick(p, before.numel())
                if now is None:
                    continue
                now = now.double()
                ulp = torch.finfo(p.dtype if p.is_floating_point() else torch.float32).eps
                allowed = RTOL * (predicted - before).abs() + ULPS * ulp * torch.maximum(now.abs(), predicted.abs())
                err = (now - predicted).abs()
                if bool((err > allowed).any()):
                    j = int((err - allowed).argmax())
                    bad.append((i, float((now - before)[j]), float((predicted - before)[j])))
        if not bad:
            return []
        i, moved, wanted = bad[0]
        shown = ", ".join(self.names[b[0]] for b in bad[:6]) + (" ..." if len(bad) > 6 else "")
        rule = rule_name(self.optimizer)
        return [("update_mismatch", self.names[i], (
            f"{len(bad)} tensor(s) ({shown}) changed otherwise than the {type(self.optimizer).__name__} rule makes "
            f"of the gradient and state the step found (an entry moved by {moved:.4g}; the {rule} rule predicts "
            f"{wanted:.4g}): something else wrote the weights or the gradient during optimizer.step()"),
            {"tensors_mismatched": len(bad), "moved": moved, "predicted": wanted})]
