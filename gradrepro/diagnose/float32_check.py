"""Norms and the SGD update check of float32 tensors in float32, with a bound on the float32
arithmetic's own rounding, where a float64 copy of each tensor cost more than the model's passes.
An answer is taken only where that bound cannot change it; elsewhere the caller widens to
float64 as before (``transition``).

The bounds (Higham, *Accuracy and Stability of Numerical Algorithms*, 2nd ed., sec. 2.2 and 4.2):
a float32 operation returns its exact result times (1 + d) with |d| <= u = 2^-24, plus an
absolute error below ``TINY`` (the smallest normal float32; flush-to-zero included) where the
result underflows. gamma_k = k u / (1 - k u).

- Norms (``norm_bounds``): the entries in rows of ``ROW``; each row's 2-norm in float32, the
  rows' squares summed in float64. A sum of m non-negative terms, in any order, is within
  gamma_{m-1} of its value relative (sec. 4.2), so a row's sum of its m rounded squares is within
  gamma_m; the row norm's square root and its squaring in float64 add 2u; the float64 sum over
  the rows adds at most rows x 2^-53 (below 1e-9 for 10^7 rows). The squares of entries below
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


def _gamma(k: int) -> float:
    return k * U / (1 - k * U)


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
    """Two float32 buffers of the largest tensor's size, reused by every tensor's check, so
    that the check allocates (and the system zeroes) no new memory per tensor."""

    def __init__(self, numel: int, device: torch.device) -> None:
        self.bufs = [torch.empty(numel, dtype=torch.float32, device=device) for _ in range(2)]

    def holds(self, t: torch.Tensor) -> bool:
        return t.numel() <= self.bufs[0].numel() and t.device == self.bufs[0].device

    def take(self, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.bufs[0][:n], self.bufs[1][:n]


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
    d, e = scratch.take(n)
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
    err_lo, err_hi = max(resid.lo - off, 0.0), resid.hi + off
    verdict = None
    if start_norm is not None:  # ||after|| within ||start|| -+ ||after - start||: no pass over after
        start_b, step_hi = known(start_norm), moved.hi * (1 + 2 * U) + under
        final = Norm(start_b.value, max(start_b.lo - step_hi, 0.0), start_b.hi + step_hi)
        verdict = _decide(rtol, expected, e_off, err_lo, err_hi, final, moved, resid)
    final = norm_bounds(a) if verdict is None else None
    if final is not None:
        verdict = _decide(rtol, expected, e_off, err_lo, err_hi, final, moved, resid)
    return verdict


def _decide(rtol: float, expected: Norm, e_off: float, err_lo: float, err_hi: float, final: Norm, moved: Norm,
            resid: Norm) -> Optional[Verdict]:
    """The check ||r|| <= rtol ||Delta|| + 2 eps ||after|| where the intervals settle it, else None."""
    floor = 2 * torch.finfo(torch.float32).eps
    if err_hi <= rtol * max(expected.lo - e_off, 0.0) + floor * final.lo:
        return Verdict(moved.value, expected.value, resid.value, True)
    if err_lo > rtol * (expected.hi + e_off) + floor * final.hi:
        return Verdict(moved.value, expected.value, resid.value, False)
    return None
