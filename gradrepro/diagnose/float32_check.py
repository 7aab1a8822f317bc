"""Norms and the SGD, Adam and AdamW update checks of float32 tensors in float32, with a bound
on the float32 arithmetic's own rounding, where a float64 copy of each tensor cost more than the
model's passes. An answer is taken only where that bound cannot change it; elsewhere the caller
widens to float64 as before (``transition``).

The bounds (Higham, *Accuracy and Stability of Numerical Algorithms*, 2nd ed., sec. 2.2 and 4.2):
a float32 operation returns its exact result times (1 + d) with |d| <= u = 2^-24, plus an
absolute error below ``TINY`` (the smallest normal float32; flush-to-zero included) where the
result underflows. gamma_k = k u / (1 - k u).

- Norms (``norm_bounds``): the entries in rows of ``ROW``; each row's 2-norm in float32, the
  rows' squares summed in float64. A sum of m non-negative terms, in any order, is within
  gamma_{m-1} of its value relative (sec. 4.2), so a row's sum of its m rounded squares is within
  gamma_m; the row norm's square root and its squaring in float64 add 2u; the float64 sum over
  the rows adds at most rows x 2^-53 (below 1e-9 up to 9 million rows). The squares of entries below
  sqrt(TINY) may underflow: at most 2 TINY absolute per entry on the sum of squares.
- SGD (``sgd_check``): the documented rule (``update_rule``) changes a parameter by
  Delta = c_g g + c_p p + c_b buf, with c_g = -lr a s, c_p = -lr a wd, c_b = -lr b, s = -1 under
  maximize, and (a, b) = (1, 0) without momentum or on the buffer's first step (a = 1 + mu
  with nesterov there), (1 - dampening, mu) after it, (1 + mu (1 - dampening), mu^2) with
  nesterov. Computed in float32 as e = fl(c_g g) + fl(c_p p) + fl(c_b buf), each coefficient
  rounded once to float32: an entry is off by at most gamma_4 A with A = |c_g g| + |c_p p| +
  |c_b buf| (rounded coefficient, product, two additions); ``GAMMA_STEP`` takes gamma_6.
  The residual r = (after - start) - Delta is computed as fl(fl(after - start) - e), off by
  u |after - start| + gamma_6 A + u |r| per entry, so in norm by at most
  u ||after - start|| + gamma_6 ||A|| + u ||r|| (+ 8 sqrt(n) TINY), with ||A|| <= |c_g| ||g|| +
  |c_p| ||p|| + |c_b| ||buf||. Without weight decay and momentum (Delta = c_g g) e is not
  formed: r = fl(fl(after - start) - fl(c_g) g) in one operation, within the same bound with
  ||A|| = ||Delta|| = |c_g| ||g||, taken from g's norm interval (``known``: a norm already taken).
  ||after|| is first bounded by ||start|| -+ ||after - start|| (triangle inequality), and taken
  from after itself only where that leaves the check open.
- Adam and AdamW (``adam_check``; not amsgrad, not Adam's weight decay added to the gradient):
  Delta = c m' / den - lr wd p with c = -lr / (1 - beta1^t), m' = beta1 m + (1 - beta1) g,
  den = sqrt(beta2 v + (1 - beta2) g^2) / sqrt(1 - beta2^t) + eps (decoupled decay wd, AdamW's).
  The denominator, built from non-negative terms, is within gamma_8 of itself relative (the
  underflow of g^2 and v adds at most sqrt(4 TINY / (1 - beta2^t)) / eps, taken only below
  1e-6); m' within gamma_4 of its terms' magnitudes; the quotient and the products with the
  rounded constants a few u more: e is within gamma_16 of A = |c| (beta1 |m| +
  (1 - beta1) |g|) / den + |lr wd| |p| per entry, ||A|| computed in float32 (a pass of its own)
  and enlarged by the same factor; r = fl(fl(after - start) - e) as for SGD.

The check is the float64 one: ||r|| <= rtol ||Delta|| + 2 eps ||after||, eps = 2u. It is decided
here when the interval holding ||r|| lies wholly at or below the lower end of the interval
holding the right-hand side, or wholly above its upper end; otherwise it is inconclusive (None).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Optional

import torch

U = 2.0 ** -24  # float32 unit roundoff
TINY = torch.finfo(torch.float32).tiny
ROW = 1024
RHO = (ROW + 2) * U / (1 - (ROW + 2) * U) + 1e-9  # relative error bound of a sum of squares (module docstring)
GAMMA_STEP = 6 * U / (1 - 6 * U)
SMALL = 4 * ROW  # tensors below this size are widened to float64 (cheap, and exact as before)


@dataclass(frozen=True)
class Norm:
    """A float32 tensor's 2-norm: the float32 estimate and an interval certain to hold the exact value."""

    value: float
    lo: float
    hi: float


def fits(t: Optional[torch.Tensor]) -> bool:
    """A dense real float32 tensor large enough for the float32 path."""
    return (t is not None and t.dtype == torch.float32 and t.layout == torch.strided
            and t.numel() >= SMALL)


def norm_bounds(t: torch.Tensor) -> Optional[Norm]:
    """The 2-norm of a dense float32 tensor with its bounds (module docstring), or None where
    float32 overflows or a NaN is present."""
    flat = t.detach().reshape(-1)
    n = flat.numel()
    k = n // ROW * ROW
    s = float(torch.linalg.vector_norm(flat[:k].view(-1, ROW), dim=1).double().square().sum()) if k else 0.0
    if k < n:
        s += float(flat[k:].double().square().sum())
    if not math.isfinite(s):
        return None
    under = 2 * n * TINY
    return Norm(math.sqrt(s), math.sqrt(max(s * (1 - RHO) - under, 0.0)), math.sqrt(s * (1 + RHO) + under))


def norm(t: torch.Tensor, rel: float = 1e-6) -> Optional[float]:
    """The float32 estimate of a float32 tensor's 2-norm where its certified interval is within
    ``rel`` of it beyond the sum's rounding (no overflow, no underflow that matters), else None."""
    b = norm_bounds(t)
    if b is None:
        return None
    under = 2 * t.numel() * TINY
    return b.value if under <= rel * b.value * b.value else None


def known(value: float) -> Norm:
    """The interval of a norm ``norm`` returned (or a float64 norm): within RHO + 1e-6 relative."""
    slack = RHO + 2e-6
    return Norm(value, value * (1 - slack), value * (1 + slack))


class Scratch:
    """Float32 buffers of the largest tensor's size (two, more on demand), reused by every
    tensor's check, so that the check allocates (and the system zeroes) no new memory per tensor."""

    def __init__(self, numel: int, device: torch.device) -> None:
        self.numel, self.device = numel, torch.device(device)
        self.bufs = [torch.empty(numel, dtype=torch.float32, device=device) for _ in range(2)]

    def holds(self, t: torch.Tensor) -> bool:
        return t.numel() <= self.numel and t.device == self.device

    def take(self, n: int, count: int = 2) -> tuple[torch.Tensor, ...]:
        while len(self.bufs) < count:
            self.bufs.append(torch.empty(self.numel, dtype=torch.float32, device=self.device))
        return tuple(b[:n] for b in self.bufs[:count])


def _scalar(value: Any) -> float:
    return float(value.item()) if torch.is_tensor(value) else float(value)


def sgd_coefficients(group: dict[str, Any], has_buffer: bool) -> tuple[float, float, float]:
    """(c_g, c_p, c_b) of the SGD change (module docstring)."""
    lr, wd = _scalar(group["lr"]), _scalar(group.get("weight_decay", 0.0))
    mu, damp = _scalar(group.get("momentum", 0.0)), _scalar(group.get("dampening", 0.0))
    nesterov, s = group.get("nesterov", False), (-1.0 if group.get("maximize", False) else 1.0)
    if mu == 0:
        a, b = 1.0, 0.0
    elif not has_buffer:
        a, b = (1.0 + mu if nesterov else 1.0), 0.0
    else:
        a, b = ((1.0 + mu * (1.0 - damp), mu * mu) if nesterov else (1.0 - damp, mu))
    return -lr * a * s, -lr * a * wd, -lr * b


@dataclass(frozen=True)
class Verdict:
    update_norm: float  # ||after - start||
    expected: float  # ||Delta||
    err: float  # ||after - start - Delta||
    matches: bool


def sgd_check(after: torch.Tensor, start: torch.Tensor, grad: torch.Tensor, state: dict[str, Any],
              group: dict[str, Any], rtol: float, scratch: Scratch, grad_norm: Optional[float] = None,
              start_norm: Optional[float] = None) -> Optional[Verdict]:
    """The float64 update check of one SGD step decided in float32 (module docstring), or None
    where this path does not apply or the bound leaves the answer open. ``grad_norm``,
    ``start_norm``: the gradient's and the start's norms where already taken (``known``)."""
    mu = _scalar(group.get("momentum", 0.0))
    buf = state.get("momentum_buffer") if mu != 0 else None
    if not (fits(after) and fits(start) and fits(grad) and (buf is None or fits(buf))):
        return None
    n = after.numel()
    if not (start.numel() == n and grad.numel() == n and (buf is None or buf.numel() == n) and scratch.holds(after)
            and all(x.device == after.device for x in (start, grad) + (() if buf is None else (buf,)))):
        return None
    c_g, c_p, c_b = sgd_coefficients(group, buf is not None)
    a, s, g = after.detach().reshape(-1), start.reshape(-1), grad.detach().reshape(-1)
    d, e = scratch.take(n, 2)
    moved = norm_bounds(torch.sub(a, s, out=d))
    if moved is None:
        return None
    under = 8 * math.sqrt(n) * TINY
    if c_p == 0 and (buf is None or c_b == 0):  # Delta = c_g g: ||Delta|| = |c_g| ||g||, no buffer for it
        g_norm = known(grad_norm) if grad_norm is not None else norm_bounds(g)
        if g_norm is None:
            return None
        expected = Norm(abs(c_g) * g_norm.value, abs(c_g) * g_norm.lo, abs(c_g) * g_norm.hi)
        d.sub_(g, alpha=c_g)  # the residual r, in one rounding of d - fl(c_g) g
        size, e_off = expected.hi, 0.0  # ||A|| = ||Delta||; the interval holds ||Delta|| itself
    else:
        torch.mul(g, c_g, out=e)
        if c_p != 0:
            e.add_(s, alpha=c_p)
        if buf is not None and c_b != 0:
            e.add_(buf.reshape(-1), alpha=c_b)
        expected = norm_bounds(e)
        parts = [(abs(c_g), g), (abs(c_p), s), (abs(c_b), None if buf is None else buf.reshape(-1))]
        bounds = [(c, norm_bounds(x)) for c, x in parts if c != 0 and x is not None]
        if expected is None or any(b is None for _, b in bounds):
            return None
        size = sum(c * b.hi for c, b in bounds)
        e_off = GAMMA_STEP * size + under  # ||e - Delta||
        d.sub_(e)  # the residual r
    resid = norm_bounds(d)
    if resid is None:
        return None
    off = (1 + 4 * U) * (U * moved.hi + GAMMA_STEP * size + U * resid.hi) + under  # ||r_hat - r||
    return _conclude(rtol, expected, e_off, off, resid, moved, start_norm, a, under)


def _conclude(rtol: float, expected: Norm, e_off: float, off: float, resid: Norm, moved: Norm,
              start_norm: Optional[float], a: torch.Tensor, under: float) -> Optional[bool]:
    """The check's answer from the residual's interval (``resid`` widened by ``off``, the
    arithmetic's own error): first with ||after|| bounded by ||start|| -+ ||after - start||
    (no pass over ``a``), then, where that leaves it open, with ||after|| read from ``a``."""
    err_lo, err_hi = max(resid.lo - off, 0.0), resid.hi + off
    if start_norm is not None:
        start_b, step_hi = known(start_norm), moved.hi * (1 + 2 * U) + under
        final = Norm(start_b.value, max(start_b.lo - step_hi, 0.0), start_b.hi + step_hi)
        verdict = _decide(rtol, expected, e_off, err_lo, err_hi, final, moved, resid)
        if verdict is not None:
            return verdict
    final = norm_bounds(a)
    return None if final is None else _decide(rtol, expected, e_off, err_lo, err_hi, final, moved, resid)


def _decide(rtol: float, expected: Norm, e_off: float, err_lo: float, err_hi: float, final: Norm, moved: Norm,
            resid: Norm) -> Optional[Verdict]:
    """The check ||r|| <= rtol ||Delta|| + 2 eps ||after|| where the intervals settle it, else None."""
    floor = 2 * torch.finfo(torch.float32).eps
    if err_hi <= rtol * max(expected.lo - e_off, 0.0) + floor * final.lo:
        return Verdict(moved.value, expected.value, resid.value, True)
    if err_lo > rtol * (expected.hi + e_off) + floor * final.hi:
        return Verdict(moved.value, expected.value, resid.value, False)
    return None


GAMMA_ADAM = 16 * U / (1 - 16 * U)


def adam_check(after: torch.Tensor, start: torch.Tensor, grad: torch.Tensor, state: dict[str, Any],
               group: dict[str, Any], decoupled: bool, rtol: float, scratch: Scratch,
               start_norm: Optional[float] = None) -> Optional[Verdict]:
    """The float64 update check of one Adam or AdamW step decided in float32 (module
    docstring), or None: amsgrad, weight decay added to the gradient (Adam's, not AdamW's),
    eps = 0 and states that are not float32 take the float64 path."""
    lr, wd = _scalar(group["lr"]), _scalar(group.get("weight_decay", 0.0))
    beta1, beta2 = (_scalar(b) for b in group["betas"])
    eps = _scalar(group["eps"])
    m, v = state.get("exp_avg"), state.get("exp_avg_sq")
    n = after.numel()
    tensors = [after, start, grad] + [x for x in (m, v) if x is not None]
    if (group.get("amsgrad", False) or (wd != 0 and not decoupled) or not eps > 0 or (m is None) != (v is None)
            or not all(fits(x) and x.numel() == n and x.device == after.device for x in tensors)
            or not scratch.holds(after)):
        return None
    step = _scalar(state.get("step", 0.0)) + 1
    bias1, bias2 = 1 - beta1**step, 1 - beta2**step
    c = -lr / bias1
    sign = -1.0 if group.get("maximize", False) else 1.0
    if not (bias1 > 0 and bias2 > 0):
        return None
    # Underflow of g^2 and v (at most TINY each) moves the denominator, which is at least eps,
    # by at most sqrt(4 TINY / bias2) relative to eps: taken only where that is negligible.
    den_under = math.sqrt(4 * TINY / bias2) / eps
    if den_under > 1e-6:
        return None
    a, s, g = after.detach().reshape(-1), start.reshape(-1), grad.detach().reshape(-1)
    d, e, den, mag = scratch.take(n, 4)
    torch.mul(g, g, out=den).mul_(1 - beta2)  # v' = beta2 v + (1 - beta2) g^2
    if v is not None:
        den.add_(v.reshape(-1), alpha=beta2)
    den.sqrt_().div_(math.sqrt(bias2)).add_(eps)  # the denominator, at least eps
    torch.abs(g, out=mag).mul_(1 - beta1)  # A: the magnitudes of m's terms ...
    torch.mul(g, (1 - beta1) * sign, out=e)  # m' = beta1 m + (1 - beta1) g
    if m is not None:
        mag.add_(torch.abs(m.reshape(-1), out=d), alpha=beta1)
        e.add_(m.reshape(-1), alpha=beta1)
    size_b = norm_bounds(mag.div_(den))  # ... over the denominator
    e.div_(den).mul_(c)  # Delta without the decoupled decay
    if wd != 0:
        e.add_(s, alpha=-lr * wd)
    expected = norm_bounds(e)
    p_size = norm_bounds(s) if wd != 0 else None
    moved = norm_bounds(torch.sub(a, s, out=d))
    if size_b is None or expected is None or moved is None or (wd != 0 and p_size is None):
        return None
    # Each float32 operation is off by at most u of its result: the denominator (a sum of
    # non-negative terms, a square root, two constants) within gamma_8 relative, plus den_under;
    # m' within gamma_4 of its terms' magnitudes; the quotient and the products with the rounded
    # constants a few u more: within gamma_16 of A = |c| (beta1 |m| + (1 - beta1) |g|) / den +
    # |lr wd| |p|, whose float32 value is itself within that of the exact one; m' may underflow.
    size = abs(c) * size_b.hi * (1 + GAMMA_ADAM + den_under) + (abs(lr * wd) * p_size.hi if p_size else 0.0)
    under = 8 * math.sqrt(n) * TINY * (1 + abs(c) / eps)
    e_off = (GAMMA_ADAM + den_under) * size + under  # ||e - Delta||
    d.sub_(e)  # the residual r
    resid = norm_bounds(d)
    if resid is None:
        return None
    off = (1 + 4 * U) * (U * moved.hi + U * resid.hi) + e_off + under  # ||r_hat - r||
    return _conclude(rtol, expected, e_off, off, resid, moved, start_norm, a, under)
