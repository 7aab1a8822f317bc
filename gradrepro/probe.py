"""The probe: per-parameter and per-module gradient-signal metrics on logged steps.

Called by the shared runner around backward and the optimizer step on every
``probe.every``-th step (and the last); on other steps nothing of it runs. Everything is
computed on the device with fused/foreach operations and moved to the host once per logged
step (the one exception: counting non-finite entries, which runs only for tensors whose
norm is already non-finite).

Gradient states (DESIGN.md): ``none`` (no graph path: ``.grad`` is None), ``zero`` (exact
zeros), ``tiny`` (finite, non-zero, grad/param ratio at least ``tiny_factor`` below the
model's median), ``finite``, ``nonfinite``. Three different causes; never merged.
"""

from __future__ import annotations

import math
from typing import Dict, List, Optional, Tuple

import numpy as np
import torch
from torch import nn

# fp16's smallest subnormal is 2^-24; round-to-nearest-even sends |x| <= 2^-25 to zero
# (Micikevicius et al. 2018, Sec. 3.2; IEEE 754 binary16).
FP16_FLUSH = 2.0**-25

GRAD_STATES = ("none", "zero", "tiny", "finite", "nonfinite")

# Activation-gradient histogram (probe.act_grad_hist): octaves [2^k, 2^(k+1)) for k = -40..-1,
# plus an exact-zero bin, a bin below 2^-40 and one at or above 2^0 (inf included). SSD's
# band [2^-27, 2^-24) is bins -27..-25 (Micikevicius et al. 2018, Fig. 3).
HIST_EDGES = list(range(-40, 1))  # bin boundaries in log2 units
HIST_COLUMNS = (
    ["act_grad_hist_zero", "act_grad_hist_below"]
    + [f"act_grad_hist_{k}" for k in HIST_EDGES[:-1]]
    + ["act_grad_hist_above"]
)


def log2_histogram(g: torch.Tensor) -> torch.Tensor:
    """Counts of |g| per HIST_COLUMNS bin, in one bucketize and one bincount (no host sync)."""
    a = g.detach().abs().float().reshape(-1)
    edges = torch.tensor(HIST_EDGES, dtype=torch.float32, device=a.device)
    # right=True: index i holds edges[i-1] <= log2|g| < edges[i]; 0 is below 2^-40 (and zero).
    idx = torch.bucketize(torch.log2(a), edges, right=True) + 1
    idx = torch.where(a == 0, torch.zeros_like(idx), idx)  # the exact-zero bin
    idx = torch.where(torch.isnan(a), torch.full_like(idx, len(HIST_COLUMNS) - 1), idx)
    return torch.bincount(idx, minlength=len(HIST_COLUMNS)).float()

_KINDS = (
    (nn.modules.conv._ConvNd, "conv"),
    (nn.Linear, "linear"),
    (nn.modules.batchnorm._NormBase, "norm"),
    (nn.LayerNorm, "norm"),
    (nn.GroupNorm, "norm"),
    (nn.Embedding, "embedding"),
)


def module_kind(module: nn.Module) -> str:
    for cls, kind in _KINDS:
        if isinstance(module, cls):
            return kind
    return "other"


def _norms(tensors: List[torch.Tensor]) -> List[torch.Tensor]:
    if not tensors:
        return []
    if hasattr(torch, "_foreach_norm"):
        return list(torch._foreach_norm(tensors))
    return [torch.linalg.vector_norm(t) for t in tensors]


# |x| <= FP16_FLUSH  <=>  |x| * _FLUSH_SCALE <= 1, exactly: scaling by a power of 2 is exact.
_FLUSH_SCALE = 2.0**25
# Above this many entries, sums of levels (values 0..4 each) could pass 2^24, where float32
# stops counting exactly: such tensors are summed in float64.
_EXACT_F32 = 2**22


def _levels_(v: torch.Tensor, nan: bool = True) -> torch.Tensor:
    """In place on ``v = |x|``: 0 where x == 0, 1 where 0 < |x| <= FP16_FLUSH, 2 elsewhere
    (NaN and inf included, as ``count_nonzero`` and ``abs() <= FP16_FLUSH`` count them).
    ``clamp_`` then ``nan_to_num_`` rather than one ``fmin``: on CPU ``fmin`` is not
    vectorised and cost 30x more (benchmarks/README.md, "Where the probe's time goes").
    ``nan=False`` leaves NaN as NaN (one pass less), for callers that recount a tensor
    whose norm is not finite."""
    v.mul_(_FLUSH_SCALE)
    v.clamp_(max=2.0)  # inf -> 2; NaN stays NaN ...
    if nan:
        torch.nan_to_num_(v, nan=2.0)  # ... and becomes 2 here
    return v.ceil_()


def level_sums(x: torch.Tensor, scratch: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``[sum(l), sum(l^2)]`` of the levels ``l`` of x (see ``_levels_``); ``counts_from_
    level_sums`` turns them into zero and flush counts on the host. Two sums of one
    element-wise result replace ``count_nonzero`` and a boolean mask sum, which on CPU
    are not vectorised and cost several times more. Exact: integer sums below 2^24.
    ``scratch``: a float32 buffer of ``x.numel()`` entries to work in (no allocation)."""
    return torch.stack(_level_sum_pair(x, scratch))


def _level_sum_pair(x: torch.Tensor, scratch: Optional[torch.Tensor], finite: bool = False):
    """The two sums of ``level_sums``, unstacked; ``finite``: the caller knows x holds no
    NaN (the NaN pass is skipped)."""
    v = torch.abs(x.reshape(-1), out=scratch) if scratch is not None else x.reshape(-1).abs()
    v = _levels_(v, nan=not finite)
    if v.numel() <= _EXACT_F32:
        return v.sum(), torch.dot(v, v)
    return v.sum(dtype=torch.float64), v.square_().sum(dtype=torch.float64)


def counts_from_level_sums(numel, s1, s2):
    """Zero entries and entries with |x| <= FP16_FLUSH (zeros included), from
    ``s1 = n1 + 2 n2`` and ``s2 = n1 + 4 n2`` (n1: non-zero flushing, n2: the rest)."""
    n2 = (s2 - s1) / 2
    n1 = s1 - 2 * n2
    return numel - n1 - n2, numel - n2


def _grad_sums(grads: List[torch.Tensor], scratch_for=None) -> torch.Tensor:
    """3 x len(grads), float64: per float32 tensor its plain sum (``collect`` finishes the
    std from it and the norm) and the two ``level_sums`` of its levels, levelled together
    in chunks of about ``_EXACT_F32`` entries. ``scratch_for(n)`` gives a reused float32
    buffer of n entries for the chunk (fresh 16 MB tensors page-fault on CPU: 14 ms against
    3 ms for resnet18's 11 M gradient entries). NaN stays NaN in the level sums: the host
    recounts every tensor whose norm is not finite."""
    device = grads[0].device if grads else None
    out = torch.empty(3, len(grads), dtype=torch.float64, device=device)
    chunk: List[int] = []

    def flush_chunk(size: int) -> None:
        # One flat copy of the chunk: per tensor a plain sum, then levelled in place, with a
        # sum and a dot per tensor (``_foreach_norm(v, 1)`` and ``_foreach_abs``'s fresh
        # allocations cost several times more on CPU).
        parts = [grads[i].reshape(-1) for i in chunk]
        flat = torch.cat(parts) if scratch_for is None else torch.cat(parts, out=scratch_for(size))
        views = flat.split([grads[i].numel() for i in chunk])
        plain = torch.stack([v.sum() for v in views])
        _levels_(flat.abs_(), nan=False)
        rows = [plain, torch.stack([v.sum() for v in views]), torch.stack([torch.dot(v, v) for v in views])]
        out[:, chunk] = torch.stack(rows).double()
        chunk.clear()

    size = 0
    for i, g in enumerate(grads):
        if g.numel() > _EXACT_F32:
            out[0, i] = g.sum()
            out[1:, i] = level_sums(g)
            continue
        if size + g.numel() > _EXACT_F32:
            flush_chunk(size)
            size = 0
        chunk.append(i)
        size += g.numel()
    if chunk:
        flush_chunk(size)
    return out


# One-pass sums of squares are kept only where the mean square is this far inside float32's
# normal range (smallest normal 1.2e-38): squares that underflow then cost < 1e-8 relative.
_ONE_PASS_MIN_MEAN_SQUARE = 1e-30


def _one_pass_accurate(n, mean, square, ssd):
    """Where ``ssd = square - n mean^2`` (``square``: the sum of squares) is accurate: more
    than one entry, mean^2 <= var (the cancellation then costs ~1e-5 relative at most) and
    squares far from underflow; NaN and inf fail every comparison. The one rule for the
    hooks' floats and ``collect``'s arrays alike (``&`` works on both)."""
    return (n > 1) & (ssd < math.inf) & (ssd >= mean * mean * (n - 1)) & (square >= n * _ONE_PASS_MIN_MEAN_SQUARE)


def mean_ssd(x: torch.Tensor, scratch: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``[mean, sum of squared deviations from the mean]`` on the device; the host finishes
    the unbiased std. Two passes (mean, then the deviations' dot) stay accurate for a large
    mean and a small spread (a collapsed layer), where the one-pass ``dot(x, x) - n mean^2``
    cancels; ``torch.var_mean`` gives the same numbers but is an order of magnitude slower on
    CPU. ``scratch`` as in ``level_sums``. On CPU the hooks use ``mean_ssd_host``."""
    flat = x.reshape(-1)
    mean = flat.mean()
    dev = torch.sub(flat, mean, out=scratch) if scratch is not None else flat - mean
    return torch.stack([mean, torch.dot(dev, dev)])  # one read, where square_ + sum take two


def mean_ssd_host(x: torch.Tensor, scratch: Optional[torch.Tensor] = None) -> Tuple[float, float]:
    """``mean_ssd`` for a CPU tensor, as two floats: reading a scalar costs nothing there, so
    the one pass ``dot(x, x) - n mean^2`` (one read, no write) is tried first and kept where
    ``mean^2 <= var`` and the mean square is far from underflow: there its error (1e-5
    relative at 2 M entries) is below the two-pass float32 dot's own (3e-4;
    tests/test_probe_kernels.py). Elsewhere (a collapsed layer, NaN) the two passes. It saves
    the write of the deviations, the hooks' largest cost, and the host floats save the small
    tensors a hook would otherwise build (``mean`` and ``torch.tensor`` cost 15-20 us each)."""
    flat = x.reshape(-1)
    n = flat.numel()
    if n == 0:
        return math.nan, math.nan
    m = float(flat.sum()) / n
    square = float(torch.dot(flat, flat))
    ssd = square - n * m * m
    if _one_pass_accurate(n, m, square, ssd):
        return m, ssd
    dev = torch.sub(flat, m, out=scratch) if scratch is not None else flat - m
    return m, float(torch.dot(dev, dev))


def _std(ssd: np.ndarray, numel: np.ndarray) -> np.ndarray:
    with np.errstate(divide="ignore", invalid="ignore"):
        return np.sqrt(ssd / (numel - 1))


def _stat_rows(values: list, width: int, device) -> torch.Tensor:
    """len(values) x width, float64, on ``device``: the hooks' results, host tuples (CPU) or
    device tensors; None (no hook result for that module) is NaN."""
    if not any(torch.is_tensor(v) for v in values):  # one tensor from host floats
        nan = (math.nan,) * width
        return torch.tensor([nan if v is None else v for v in values], dtype=torch.float64,
                            device=device).reshape(len(values), width)
    nan_t = torch.full((width,), math.nan, dtype=torch.float64, device=device)
    return torch.stack([nan_t if v is None else torch.as_tensor(v, device=device).double()
                        for v in values])


def grad_std_from_sums(norm: np.ndarray, total: np.ndarray, numel: np.ndarray,
                       zeros: np.ndarray) -> np.ndarray:
    """Each gradient's std over its entries from its norm and plain sum, ``(|g|^2 - n mean^2)
    / (n - 1)``, where that is accurate: where ``|mean| <= std`` the cancellation costs at
    most about 2 x 1e-6 relative (float32 norm and sum; tests/test_probe_kernels.py). NaN
    elsewhere (a large mean over a small spread, a non-finite norm, entries so small that
    their squares leave float32's normal range, one entry), for ``after_step`` to recount
    with the two-pass ``std``; an all-zero tensor is 0. Gradients are centred near zero, so
    the recount is rare; it replaces a two-pass ``std`` per tensor, 6.6 of resnet18's 22 ms
    in ``collect``."""
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        mean = total / numel
        ssd = norm**2 - numel * mean**2
        accurate = _one_pass_accurate(numel, mean, norm**2, ssd)
        out = np.where(accurate, np.sqrt(np.where(accurate, ssd, 0.0) / (numel - 1)), np.nan)
    return np.where((zeros == numel) & (numel > 1), 0.0, out)


def grad_states(
    has_grad: np.ndarray,
    nonfinite: np.ndarray,
    nonzero: np.ndarray,
    grad_to_param: np.ndarray,
    param_norm: np.ndarray,
    tiny_factor: float,
) -> np.ndarray:
    """Classify each parameter's gradient. ``tiny`` is judged against the median ratio of
    the judgeable tensors (finite, non-zero grad, non-zero parameter): healthy networks
    span orders of magnitude between layers, so the maximum would raise false alarms."""
    judgeable = has_grad & (nonfinite == 0) & (nonzero > 0) & (param_norm > 0)
    judgeable &= np.isfinite(grad_to_param)
    median = np.median(grad_to_param[judgeable]) if judgeable.any() else np.nan
    tiny = judgeable & (grad_to_param < median / tiny_factor)
    state = np.full(len(has_grad), "finite", dtype=object)
    state[tiny] = "tiny"
    state[has_grad & (nonzero == 0)] = "zero"
    state[has_grad & (nonfinite > 0)] = "nonfinite"
    state[~has_grad] = "none"
    return state


class Probe:
    """Collects the metrics of ``modules.parquet`` for one network."""

    def __init__(self, net: nn.Module, cfg, total_steps: int) -> None:
        self.cfg = cfg
        self.total_steps = total_steps
        self.names: List[str] = []
        self.params: List[torch.Tensor] = []
        self.module_of: List[str] = []
        self.param_of: List[str] = []
        self.kind_of: List[str] = []
        self.hooked: Dict[str, nn.Module] = {}
        for mod_name, module in net.named_modules():
            own = list(module.named_parameters(recurse=False))
            if own:
                self.hooked[mod_name] = module
        seen = set()
        for mod_name, module in net.named_modules():
            for p_name, p in module.named_parameters(recurse=False):
                if id(p) in seen:  # a tied weight is one tensor: record it once
                    continue
                seen.add(id(p))
                self.names.append(f"{mod_name}.{p_name}" if mod_name else p_name)
                self.params.append(p)
                self.module_of.append(mod_name or "<root>")
                self.param_of.append(p_name)
                self.kind_of.append(module_kind(module))
        self.numel = np.array([p.numel() for p in self.params], dtype=np.float64)
        self._buffer: Optional[List[torch.Tensor]] = None
        self._scratch: Optional[torch.Tensor] = None
        self._handles: list = []
        self._act: Dict[str, torch.Tensor] = {}
        self._act_grad: Dict[str, torch.Tensor] = {}
        self._act_grad_hist: Dict[str, torch.Tensor] = {}
        self._act_numel: Dict[str, int] = {}
        self._act_grad_meta: Dict[str, tuple] = {}  # numel, loss scale
        self._contrib: Dict[str, List[torch.Tensor]] = {}
        self._pending: Optional[dict] = None
        self._inputs: Dict[str, torch.Tensor] = {}
        self._per_example: Dict[str, torch.Tensor] = {}
        self.loss_scale = 1.0
        self.lr = math.nan  # the learning rate of the coming step, set by the runner
        # What .grad held before this step's backward (None: nothing), and the probe's own
        # running sum of fresh gradients over the first ``running_sum_steps`` steps.
        self._carried: Optional[List[Optional[torch.Tensor]]] = None
        self._running: Optional[List[torch.Tensor]] = None
        self._summing = False
        # The optimizer's weight decay: grad_to_decay = ||grad of the loss|| / ||wd * w||
        # (He et al. 2015, footnote 2). Set by the runner; 0 leaves the column NaN.
        self.weight_decay = 0.0

    # -- scheduling -------------------------------------------------------------------
    def logs(self, step: int) -> bool:
        return (step % self.cfg.every == 0 or step == self.total_steps - 1
                or step < self.cfg.running_sum_steps)

    # -- forward/backward hooks (armed on logged steps only) ---------------------------
    def arm(self) -> None:
        self._act.clear()
        self._act_grad.clear()
        self._act_grad_hist.clear()
        self._act_numel.clear()
        self._act_grad_meta.clear()
        self._contrib.clear()
        self._inputs.clear()
        self._per_example.clear()
        if not self.cfg.activations:
            return
        for name, module in self.hooked.items():
            self._handles.append(module.register_forward_hook(self._forward_hook(name)))

    def _scratch_for(self, numel: int, device) -> torch.Tensor:
        """A float32 work buffer of ``numel`` entries for the hooks' element-wise passes and
        ``collect``'s gradient chunks: one per probe, as large as the largest use (at most
        the largest activation sample or ``_EXACT_F32`` gradient entries, so it does not grow
        with steps), reused so that nothing allocates (fresh allocations page-fault on CPU)."""
        buf = self._scratch
        if buf is None or buf.numel() < numel or buf.device != torch.device(device):
            buf = self._scratch = torch.empty(numel, device=device, dtype=torch.float32)
        return buf[:numel]

    def disarm(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()

    def _forward_hook(self, name: str):
        n = self.cfg.act_sample

        def hook(module, inputs, output):
            out = output[0] if isinstance(output, (tuple, list)) else output
            # A module called twice in one step (SimSiam's two views) is recorded once: the first call.
            if name in self._act or not torch.is_tensor(out) or not out.is_floating_point():
                return
            sample = out.detach()[:n].float()
            scratch = self._scratch_for(sample.numel(), sample.device)
            on_cpu = sample.device.type == "cpu"
            self._act[name] = mean_ssd_host(sample, scratch) if on_cpu else mean_ssd(sample, scratch)
            self._act_numel[name] = sample.numel()
            if (getattr(self.cfg, "per_example", False) and isinstance(module, nn.Linear)
                    and inputs and torch.is_tensor(inputs[0]) and inputs[0].dim() == 2):
                self._inputs[name] = inputs[0].detach()[:n].float()
            if out.requires_grad:
                out.register_hook(self._grad_hook(name))

        return hook

    def _grad_hook(self, name: str):
        n = self.cfg.act_sample

        def hook(grad: torch.Tensor) -> None:
            if name in self._act_grad:  # only the main backward, not task-contribution passes
                return
            g = grad.detach()[:n].float()
            # std is reported without the loss scale; the zero/flush counts are of the
            # values backward actually carried (scaled), which is what fp16 has to hold.
            scratch = self._scratch_for(g.numel(), g.device)
            if g.device.type == "cpu":  # host floats (see mean_ssd_host)
                mean, ssd = mean_ssd_host(g, scratch)
                # A finite mean means no NaN (nor inf) in the sample: the levels skip the NaN pass.
                s1, s2 = _level_sum_pair(g, scratch, finite=math.isfinite(mean))
                self._act_grad[name] = (ssd, float(s1), float(s2))
            else:
                self._act_grad[name] = torch.cat([mean_ssd(g, scratch)[1:], level_sums(g, scratch)]).double()
            self._act_grad_meta[name] = (g.numel(), self.loss_scale)
            if getattr(self.cfg, "act_grad_hist", False):
                self._act_grad_hist[name] = log2_histogram(g)
            if name in self._inputs:
                self._per_example[name] = per_example_stats(
                    g * (grad.shape[0] / self.loss_scale), self._inputs.pop(name))

        return hook

    # -- task contribution -------------------------------------------------------------
    def contribution(self, terms: Dict[str, torch.Tensor]) -> None:
        """Per loss term, the gradient norm that term alone sends to each parameter.
        Runs after the main backward, which kept the graph (``retain_graph``) for it."""
        trainable = [i for i, p in enumerate(self.params) if p.requires_grad]
        for term_name, term in terms.items():
            grads = torch.autograd.grad(
                term, [self.params[i] for i in trainable], retain_graph=True, allow_unused=True
            )
            values = [torch.full((), float("nan"), device=term.device)] * len(self.params)
            present = [(i, g) for i, g in zip(trainable, grads) if g is not None]
            for (i, _), norm in zip(present, _norms([g.float() for _, g in present])):
                values[i] = norm
            self._contrib[term_name] = values

    # -- before backward: what .grad already holds ---------------------------------------
    def before_backward(self, step: int) -> None:
        """Keep what ``.grad`` holds before this step's backward (a running sum when nothing
        zeroed it), so that ``collect`` can tell the fresh gradient from the carried part."""
        carried = [None if p.grad is None else p.grad.detach().clone() for p in self.params]
        self._carried = carried if any(c is not None for c in carried) else None
        self._summing = step < self.cfg.running_sum_steps

    # -- gradients (after backward, before the optimizer step) ---------------------------
    def collect(self) -> None:
        grads = [p.grad for p in self.params]
        have = [i for i, g in enumerate(grads) if g is not None]
        gs = [grads[i].detach() for i in have]
        gs_f32 = [g.float() for g in gs]  # a copy only for half-precision gradients: made once
        device = self.params[0].device
        g_norm = _norms(gs_f32)
        # This step's own gradient: .grad minus what it carried in (all of .grad after zero_grad).
        carried = self._carried
        self._carried = None
        fresh = gs if carried is None else [
            g if carried[i] is None else g - carried[i] for i, g in zip(have, gs)]
        fresh_norm = g_norm if carried is None else _norms([f.float() for f in fresh])
        if self._summing:
            if self._running is None:
                self._running = [torch.zeros_like(p, dtype=torch.float64) for p in self.params]
            for i, f in zip(have, fresh):
                self._running[i] += f.double()
        sums = _grad_sums(gs_f32, lambda n: self._scratch_for(n, device))
        params = [p.detach() for p in self.params]
        p_norm = _norms([p.float() for p in params])
        # One copy of the parameters (kept between logged steps) for update/param ratios.
        if self._buffer is None:
            self._buffer = [p.clone() for p in params]
        elif hasattr(torch, "_foreach_copy_"):
            torch._foreach_copy_(self._buffer, params)
        else:
            for b, p in zip(self._buffer, params):
                b.copy_(p)
        if gs:
            # rows: grad norm, the plain sum and the two level sums (std, zero and flush
            # counts on the host), the norm of this step's own gradient
            per_grad = torch.cat([torch.stack(g_norm).double()[None], sums,
                                  torch.stack(fresh_norm).double()[None]])
        else:
            per_grad = torch.zeros(5, 0, dtype=torch.float64, device=device)
        self._pending = {"have": have, "per_grad": per_grad, "p_norm": torch.stack(p_norm).double(), "grads": gs,
                         "fresh": fresh if self._summing else None}

    # -- after the optimizer step: update ratios and the one host transfer ---------------
    def after_step(self, step: int) -> Dict[str, np.ndarray]:
        pending = self._pending
        self._pending = None
        params = [p.detach() for p in self.params]
        if hasattr(torch, "_foreach_sub_"):
            torch._foreach_sub_(self._buffer, params)  # before - after
        else:
            for b, p in zip(self._buffer, params):
                b.sub_(p)
        u_norm = torch.stack(_norms([b.float() for b in self._buffer])).double()
        residuals = self._step_residuals(pending)
        act_names = [m for m in self.module_of]
        act = [self._act.get(m) for m in act_names]
        act_grad = [self._act_grad.get(m) for m in act_names]
        nan2 = torch.full((2,), float("nan"), device=u_norm.device)
        pe = [self._per_example.get(m) for m in act_names]
        parts = [
            pending["per_grad"].reshape(-1),
            pending["p_norm"],
            u_norm,
            _stat_rows(act, 2, u_norm.device).reshape(-1),
            _stat_rows(act_grad, 3, u_norm.device).reshape(-1),
            residuals.reshape(-1),
            torch.stack([a if a is not None else nan2 for a in pe]).double().reshape(-1),
        ]
        hist = None
        if self._act_grad_hist:  # optional: one row of HIST_COLUMNS counts per module
            nan_h = torch.full((len(HIST_COLUMNS),), float("nan"), device=u_norm.device)
            hist = [self._act_grad_hist.get(m, nan_h) for m in act_names]
            parts.append(torch.stack(hist).double().reshape(-1))
        contrib_names = list(self._contrib)
        for name in contrib_names:
            parts.append(torch.stack(self._contrib[name]).double())
        flat = torch.cat([p.to(u_norm.device) for p in parts]).cpu().numpy()  # the one transfer

        n, h = len(self.params), len(pending["have"])
        offset = 0

        def take(size: int) -> np.ndarray:
            nonlocal offset
            out = flat[offset : offset + size]
            offset += size
            return out

        per_grad = take(5 * h).reshape(5, h)
        p_norm, u_norm_h = take(n), take(n)
        act_h = take(2 * n).reshape(n, 2).copy()
        act_numel = np.array([self._act_numel.get(m, np.nan) for m in act_names], dtype=float)
        act_h[:, 1] = _std(act_h[:, 1], act_numel)
        # act_grad_h columns: std (unscaled), zeros, non-zero flushing, non-zero
        raw = take(3 * n).reshape(n, 3)
        meta = np.array([self._act_grad_meta.get(m, (np.nan, np.nan)) for m in act_names],
                        dtype=float).reshape(n, 2)
        ag_zeros, ag_small = counts_from_level_sums(meta[:, 0], raw[:, 1], raw[:, 2])
        act_grad_h = np.stack([_std(raw[:, 0], meta[:, 0]) / meta[:, 1], ag_zeros,
                               ag_small - ag_zeros, meta[:, 0] - ag_zeros], axis=1)
        resid_h = take(2 * n).reshape(2, n)
        pe_h = take(2 * n).reshape(n, 2)
        hist_h = take(len(HIST_COLUMNS) * n).reshape(n, -1) if hist is not None else None
        contrib = {name: take(n) for name in contrib_names}

        have = np.zeros(n, dtype=bool)
        have[pending["have"]] = True
        g_norm = np.full(n, np.nan)
        nonzero = np.zeros(n)
        small = np.zeros(n)
        fresh_norm = np.full(n, np.nan)
        g_norm[have], fresh_norm[have] = per_grad[0], per_grad[4]
        zeros, small[have] = counts_from_level_sums(self.numel[have], per_grad[2], per_grad[3])
        nonzero[have] = self.numel[have] - zeros
        g_std = np.full(n, np.nan)
        g_std[have] = grad_std_from_sums(per_grad[0], per_grad[1], self.numel[have], zeros)
        have_idx = np.asarray(pending["have"], dtype=np.int64)
        for j in np.flatnonzero(np.isnan(g_std[have_idx]) & (self.numel[have_idx] > 1)):
            g_std[have_idx[j]] = float(pending["grads"][j].float().std())  # rare: two passes, one sync
        nonfinite = np.zeros(n)
        for j in np.flatnonzero(~np.isfinite(g_norm[have_idx])):  # rare: count exactly, one extra sync
            i, g = have_idx[j], pending["grads"][j]
            nonfinite[i] = float((~torch.isfinite(g)).sum())
            nonzero[i] = float(torch.count_nonzero(g))
            small[i] = float((g.float().abs() <= FP16_FLUSH).sum())
        numel = np.maximum(self.numel, 1)
        with np.errstate(divide="ignore", invalid="ignore"):
            # A zero-initialised tensor (a bias, BN's beta) has no meaningful ratio: NaN.
            safe_p = np.where(p_norm > 0, p_norm, np.nan)
            g_to_p = g_norm / safe_p
            u_to_p = u_norm_h / safe_p
            g_to_decay = g_to_p / self.weight_decay if self.weight_decay > 0 else np.full(n, np.nan)
            flush = np.where(nonzero > 0, (small - (self.numel - nonzero)) / nonzero, np.nan)
            ag_zero = act_grad_h[:, 1] / (act_grad_h[:, 1] + act_grad_h[:, 3])
            ag_flush = np.where(act_grad_h[:, 3] > 0, act_grad_h[:, 2] / act_grad_h[:, 3], np.nan)
        state = grad_states(have, nonfinite, nonzero, g_to_p, p_norm, self.cfg.tiny_factor)
        columns: Dict[str, np.ndarray] = {
            "step": np.full(n, step, dtype=np.int64),
            "module": np.array(self.module_of, dtype=object),
            "param": np.array(self.param_of, dtype=object),
            "param_type": np.array(self.kind_of, dtype=object),
            "numel": self.numel.astype(np.int64),
            "grad_state": state,
            "grad_norm": g_norm,
            # This step's backward alone; equals grad_norm unless .grad carried a sum in.
            "fresh_grad_norm": fresh_norm,
            # Over the first probe.running_sum_steps steps (NaN after): the step taken, read as
            # a gradient (update / lr), against the fresh gradient and against the probe's own
            # running sum of fresh gradients; ||a - b|| / ||b||. Plain SGD (no momentum or weight
            # decay) steps with the fresh gradient when zero_grad runs, with the sum when it does not.
            "step_vs_fresh": resid_h[0],
            "step_vs_running_sum": resid_h[1],
            "grad_std": g_std,
            "param_norm": p_norm,
            "grad_to_param": g_to_p,
            "update_to_param": u_to_p,
            "grad_to_decay": g_to_decay,
            "frac_none": (~have).astype(np.float64),
            "frac_zero": np.where(have, (self.numel - nonzero) / numel, np.nan),
            "frac_nonfinite": np.where(have, nonfinite / numel, np.nan),
            "frac_fp16_underflow": flush,
            "act_mean": act_h[:, 0],
            "act_std": act_h[:, 1],
            "act_grad_std": act_grad_h[:, 0],
            "act_grad_frac_zero": ag_zero,
            "act_grad_frac_fp16_underflow": ag_flush,
        }
        if hist_h is not None:
            columns.update({col: hist_h[:, j] for j, col in enumerate(HIST_COLUMNS)})
        if getattr(self.cfg, "per_example", False):
            columns["pe_act_grad_var"] = pe_h[:, 0]
            columns["pe_grad_var"] = pe_h[:, 1]
        for name, values in contrib.items():
            columns[f"contrib_{name}"] = values
        return columns

    def _step_residuals(self, pending: dict) -> torch.Tensor:
        """2 x n: relative distance of (update / lr) from the fresh gradient and from the
        running sum, per tensor; NaN outside the running-sum window. Uses ``self._buffer``,
        which ``after_step`` has just turned into (before - after) = lr x the stepped gradient."""
        n = len(self.params)
        device = self._buffer[0].device
        out = torch.full((2, n), float("nan"), dtype=torch.float64, device=device)
        fresh = pending.get("fresh")
        if fresh is None or not self._summing or not (self.lr > 0):
            return out
        for j, i in enumerate(pending["have"]):
            stepped = self._buffer[i].double() / self.lr
            for row, target in ((0, fresh[j].double()), (1, self._running[i])):
                denom = torch.linalg.vector_norm(target)
                out[row, i] = torch.linalg.vector_norm(stepped - target) / denom
        return out


def per_example_stats(delta: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """Variances of one linear layer's per-example gradients, pooled over examples and entries.

    ``delta`` (NxJ): each example's gradient of its own loss at the layer's output s = Wx + b
    (Glorot & Bengio's back-propagated gradient dCost/ds); ``x`` (NxK): the layer's input.
    The per-example weight gradient is the outer product delta_i x_i^T, so its pooled second
    moment is mean_i(|delta_i|^2 |x_i|^2) / (J K) and its mean is sum(delta^T x) / (N J K):
    no N x J x K tensor is formed. Returns [Var(delta), Var(dloss_i/dW)].
    """
    n, j = delta.shape
    k = x.shape[1]
    count = float(n * j * k)
    second = (delta.pow(2).sum(1) * x.pow(2).sum(1)).sum() / count
    mean = (delta.t() @ x).sum() / count
    return torch.stack([delta.var(unbiased=False), second - mean**2])
