"""The probe: per-parameter and per-module gradient-signal metrics on logged steps.

One protocol, a context manager around the part of a training step the probe watches::

    with probe.step(step, lr=lr, loss_scale=scale) as p:   # hooks armed on logged steps
        out = objective(net, batch)
        if not finite(out.loss): p.log_anyway()            # record a step the schedule skipped
        backward(out.loss); p.contribution(out.terms)      # per loss term (optional)
        unscale(optimizer)
        p.collect()                                        # gradients, before clipping/step
        optimizer.step()
    columns = p.columns                                    # modules.parquet rows, or None

On steps that are not logged nothing runs but the schedule's test. On a logged step every
statistic is computed on the device (probe/kernels.py) and moved to the host in one transfer.
Gradient states (probe/states.py): ``none``, ``zero``, ``tiny``, ``finite``, ``nonfinite``.
"""

from __future__ import annotations

import math
from typing import Dict, List, Optional

import numpy as np
import torch
from torch import nn

from gradrepro.probe.kernels import (
    HIST_COLUMNS,
    _grad_sums,
    _level_sum_pair,
    _norms,
    _stat_rows,
    _std,
    as_real32,
    counts_from_level_sums,
    dense,
    grad_std_from_sums,
    level_sums,
    log2_histogram,
    mean_ssd,
    mean_ssd_host,
    per_example_stats,
    to_host,
)
from gradrepro.probe.states import FP16_FLUSH, grad_states, module_kind


class ProbeStep:
    """The probe's part of one training step (``Probe.step``); ``columns`` after the block."""

    def __init__(self, probe: "Probe", step: int, lr: float, loss_scale: float, logged: bool) -> None:
        self.probe, self.step, self.logged = probe, step, logged
        self.columns: Optional[Dict[str, np.ndarray]] = None
        probe.lr, probe.loss_scale = lr, loss_scale

    def __enter__(self) -> "ProbeStep":
        if self.logged:
            self.probe._start(self.step, hooks=True)
        return self

    def log_anyway(self) -> None:
        """Record this step although the schedule skips it (called after the forward pass,
        before backward: a non-finite loss). Its activation statistics are not recorded."""
        if not self.logged:
            self.logged = True
            self.probe._start(self.step, hooks=False)

    def contribution(self, terms: Dict[str, torch.Tensor]) -> None:
        if self.logged:
            self.probe._contribution(terms)

    def collect(self) -> None:
        """Read the gradients: after backward (and unscaling), before clipping and the step."""
        if self.logged:
            self.probe._collect()

    def __exit__(self, exc_type, exc, tb) -> None:
        self.probe._disarm()
        if self.logged and exc_type is None and self.probe._pending is not None:
            self.columns = self.probe._after_step(self.step)


class Probe:
    """Collects the metrics of ``modules.parquet`` for one network."""

    def __init__(self, net: nn.Module, cfg, total_steps: Optional[int], weight_decay: float = 0.0) -> None:
        self.cfg = cfg
        self.total_steps = total_steps  # None: not known in advance (a user's own loop)
        # The optimizer's weight decay: grad_to_decay = ||grad of the loss|| / ||wd * w||
        # (He et al. 2015, footnote 2); 0 leaves the column NaN.
        self.weight_decay = weight_decay
        self.names: List[str] = []
        self.params: List[torch.Tensor] = []
        self.module_of: List[str] = []
        self.param_of: List[str] = []
        self.kind_of: List[str] = []
        self.hooked: Dict[str, nn.Module] = {}
        for mod_name, module in net.named_modules():
            if any(True for _ in module.named_parameters(recurse=False)):
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
        self._act: Dict[str, object] = {}
        self._act_grad: Dict[str, object] = {}
        self._act_grad_hist: Dict[str, torch.Tensor] = {}
        self._act_numel: Dict[str, int] = {}
        self._act_grad_meta: Dict[str, tuple] = {}  # numel, loss scale
        self._contrib: Dict[str, List[torch.Tensor]] = {}
        self._pending: Optional[dict] = None
        self._inputs: Dict[str, torch.Tensor] = {}
        self._per_example: Dict[str, torch.Tensor] = {}
        self.loss_scale = 1.0  # of the current step (the hooks unscale their std with it)
        self.lr = math.nan  # of the current step (update / lr reads as a gradient)
        # What .grad held before this step's backward (None: nothing), and the probe's own
        # running sum of fresh gradients over the first ``running_sum_steps`` steps.
        self._carried: Optional[List[Optional[torch.Tensor]]] = None
        self._running: Optional[List[torch.Tensor]] = None
        self._summing = False

    # -- the protocol ---------------------------------------------------------------------
    def logs(self, step: int) -> bool:
        """Every ``probe.every`` steps, the last step, and the running-sum window."""
        return (step % self.cfg.every == 0 or step == (self.total_steps or 0) - 1
                or step < self.cfg.running_sum_steps)

    def step(self, step: int, lr: float = math.nan, loss_scale: float = 1.0) -> ProbeStep:
        """The context manager for one training step (see the module docstring)."""
        return ProbeStep(self, step, lr, loss_scale, self.logs(step))

    def _start(self, step: int, hooks: bool) -> None:
        """A logged step begins: forget the last one's statistics, arm the hooks, and keep
        what ``.grad`` holds before this step's backward (a running sum when nothing zeroed
        it), so that ``_collect`` can tell the fresh gradient from the carried part."""
        for stats in (self._act, self._act_grad, self._act_grad_hist, self._act_numel,
                      self._act_grad_meta, self._contrib, self._inputs, self._per_example):
            stats.clear()
        if hooks and self.cfg.activations:
            for name, module in self.hooked.items():
                self._handles.append(module.register_forward_hook(self._forward_hook(name)))
        carried = [None if p.grad is None else p.grad.detach().clone() for p in self.params]
        self._carried = carried if any(c is not None for c in carried) else None
        self._summing = step < self.cfg.running_sum_steps

    def _disarm(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()

    # -- forward/backward hooks (armed on logged steps only) ------------------------------
    def _scratch_for(self, numel: int, device) -> torch.Tensor:
        """A float32 work buffer of ``numel`` entries for the hooks' element-wise passes and
        ``_collect``'s gradient chunks: one per probe, as large as the largest use (it does
        not grow with steps), reused so that nothing allocates (fresh allocations page-fault
        on CPU)."""
        buf = self._scratch
        if buf is None or buf.numel() < numel or buf.device != torch.device(device):
            buf = self._scratch = torch.empty(numel, device=device, dtype=torch.float32)
        return buf[:numel]

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
            if (self.cfg.per_example and isinstance(module, nn.Linear)
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
            if self.cfg.act_grad_hist:
                self._act_grad_hist[name] = log2_histogram(g)
            if name in self._inputs:
                self._per_example[name] = per_example_stats(
                    g * (grad.shape[0] / self.loss_scale), self._inputs.pop(name))

        return hook

    # -- task contribution ----------------------------------------------------------------
    def _contribution(self, terms: Dict[str, torch.Tensor]) -> None:
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

    # -- gradients (after backward, before the optimizer step) ----------------------------
    def _collect(self) -> None:
        grads = [p.grad for p in self.params]
        have = [i for i, g in enumerate(grads) if g is not None]
        gs = [dense(grads[i].detach()) for i in have]
        gs_f32 = [as_real32(g) for g in gs]  # a copy only for half-precision gradients: made once
        device = self.params[0].device
        g_norm = _norms(gs_f32)
        # This step's own gradient: .grad minus what it carried in (all of .grad after zero_grad).
        carried = self._carried
        self._carried = None
        fresh = gs if carried is None else [
            g if carried[i] is None else g - carried[i] for i, g in zip(have, gs)]
        fresh_norm = g_norm if carried is None else _norms([as_real32(f) for f in fresh])
        if self._summing:
            if self._running is None:
                self._running = [torch.zeros_like(p, dtype=torch.float64) for p in self.params]
            for i, f in zip(have, fresh):
                self._running[i] += f.double()
        sums = _grad_sums(gs_f32, lambda n: self._scratch_for(n, device))
        params = [p.detach() for p in self.params]
        p_norm = _norms([as_real32(p) for p in params])
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
        self._pending = {"have": have, "per_grad": per_grad, "p_norm": torch.stack(p_norm).double(),
                         "grads": gs, "fresh": fresh if self._summing else None}

    # -- after the optimizer step: update ratios and the one host transfer ----------------
    def _after_step(self, step: int) -> Dict[str, np.ndarray]:
        pending = self._pending
        self._pending = None
        params = [p.detach() for p in self.params]
        if hasattr(torch, "_foreach_sub_"):
            torch._foreach_sub_(self._buffer, params)  # before - after
        else:
            for b, p in zip(self._buffer, params):
                b.sub_(p)
        u_norm = torch.stack(_norms([as_real32(b) for b in self._buffer])).double()
        device = u_norm.device
        mods = self.module_of
        nan2 = torch.full((2,), float("nan"), device=device)
        parts = {
            "per_grad": pending["per_grad"],  # 5 x (tensors with a gradient)
            "param_norm": pending["p_norm"],
            "update_norm": u_norm,
            "act": _stat_rows([self._act.get(m) for m in mods], 2, device),  # mean, ssd
            "act_grad": _stat_rows([self._act_grad.get(m) for m in mods], 3, device),  # ssd, s1, s2
            "residuals": self._step_residuals(pending),  # 2 x n
            "per_example": torch.stack([self._per_example.get(m, nan2) for m in mods]),
        }
        if self._act_grad_hist:  # optional: one row of HIST_COLUMNS counts per module
            nan_h = torch.full((len(HIST_COLUMNS),), float("nan"), device=device)
            parts["hist"] = torch.stack([self._act_grad_hist.get(m, nan_h) for m in mods])
        for name, values in self._contrib.items():
            parts[f"contrib_{name}"] = torch.stack(values)
        host = to_host(parts)  # the one transfer
        columns = self._gradient_columns(step, host, pending)
        columns.update(self._activation_columns(host))
        for name in self._contrib:
            columns[f"contrib_{name}"] = host[f"contrib_{name}"]
        return columns

    def _gradient_columns(self, step: int, host: Dict[str, np.ndarray], pending: dict) -> Dict[str, np.ndarray]:
        n = len(self.params)
        per_grad, p_norm = host["per_grad"], host["param_norm"]
        have_idx = np.asarray(pending["have"], dtype=np.int64)
        have = np.zeros(n, dtype=bool)
        have[have_idx] = True
        g_norm, fresh_norm = np.full(n, np.nan), np.full(n, np.nan)
        nonzero, small = np.zeros(n), np.zeros(n)
        g_norm[have], fresh_norm[have] = per_grad[0], per_grad[4]
        zeros, small[have] = counts_from_level_sums(self.numel[have], per_grad[2], per_grad[3])
        nonzero[have] = self.numel[have] - zeros
        g_std = np.full(n, np.nan)
        g_std[have] = grad_std_from_sums(per_grad[0], per_grad[1], self.numel[have], zeros)
        for j in np.flatnonzero(np.isnan(g_std[have_idx]) & (self.numel[have_idx] > 1)):
            g_std[have_idx[j]] = float(as_real32(pending["grads"][j]).std())  # rare: two passes, one sync
        nonfinite = np.zeros(n)
        for j in np.flatnonzero(~np.isfinite(g_norm[have_idx])):  # rare: count exactly, one extra sync
            i, g = have_idx[j], pending["grads"][j]
            nonfinite[i] = float((~torch.isfinite(g)).sum())
            nonzero[i] = float(torch.count_nonzero(g))
            small[i] = float((as_real32(g).abs() <= FP16_FLUSH).sum())
        numel = np.maximum(self.numel, 1)
        with np.errstate(divide="ignore", invalid="ignore"):
            # A zero-initialised tensor (a bias, BN's beta) has no meaningful ratio: NaN.
            safe_p = np.where(p_norm > 0, p_norm, np.nan)
            g_to_p = g_norm / safe_p
            u_to_p = host["update_norm"] / safe_p
            g_to_decay = g_to_p / self.weight_decay if self.weight_decay > 0 else np.full(n, np.nan)
            flush = np.where(nonzero > 0, (small - (self.numel - nonzero)) / nonzero, np.nan)
        resid = host["residuals"]
        return {
            "step": np.full(n, step, dtype=np.int64),
            "module": np.array(self.module_of, dtype=object),
            "param": np.array(self.param_of, dtype=object),
            "param_type": np.array(self.kind_of, dtype=object),
            "numel": self.numel.astype(np.int64),
            "grad_state": grad_states(have, nonfinite, nonzero, g_to_p, p_norm, self.cfg.tiny_factor),
            "grad_norm": g_norm,
            # This step's backward alone; equals grad_norm unless .grad carried a sum in.
            "fresh_grad_norm": fresh_norm,
            # Over the first probe.running_sum_steps steps (NaN after): the step taken, read as
            # a gradient (update / lr), against the fresh gradient and against the probe's own
            # running sum of fresh gradients; ||a - b|| / ||b||. Plain SGD (no momentum or weight
            # decay) steps with the fresh gradient when zero_grad runs, with the sum when it does not.
            "step_vs_fresh": resid[0],
            "step_vs_running_sum": resid[1],
            "grad_std": g_std,
            "param_norm": p_norm,
            "grad_to_param": g_to_p,
            "update_to_param": u_to_p,
            "grad_to_decay": g_to_decay,
            "frac_none": (~have).astype(np.float64),
            "frac_zero": np.where(have, (self.numel - nonzero) / numel, np.nan),
            "frac_nonfinite": np.where(have, nonfinite / numel, np.nan),
            "frac_fp16_underflow": flush,
        }

    def _activation_columns(self, host: Dict[str, np.ndarray]) -> Dict[str, np.ndarray]:
        mods = self.module_of
        act = host["act"].copy()
        act_numel = np.array([self._act_numel.get(m, np.nan) for m in mods], dtype=float)
        act[:, 1] = _std(act[:, 1], act_numel)
        raw = host["act_grad"]  # ssd, level sums s1, s2
        meta = np.array([self._act_grad_meta.get(m, (np.nan, np.nan)) for m in mods],
                        dtype=float).reshape(len(mods), 2)  # numel, loss scale
        zeros, small = counts_from_level_sums(meta[:, 0], raw[:, 1], raw[:, 2])
        flushing, nonzero = small - zeros, meta[:, 0] - zeros
        with np.errstate(divide="ignore", invalid="ignore"):
            columns = {
                "act_mean": act[:, 0],
                "act_std": act[:, 1],
                "act_grad_std": _std(raw[:, 0], meta[:, 0]) / meta[:, 1],
                "act_grad_frac_zero": zeros / (zeros + nonzero),
                "act_grad_frac_fp16_underflow": np.where(nonzero > 0, flushing / nonzero, np.nan),
            }
        if "hist" in host:
            columns.update({col: host["hist"][:, j] for j, col in enumerate(HIST_COLUMNS)})
        if self.cfg.per_example:
            columns["pe_act_grad_var"] = host["per_example"][:, 0]
            columns["pe_grad_var"] = host["per_example"][:, 1]
        return columns

    def _step_residuals(self, pending: dict) -> torch.Tensor:
        """2 x n: relative distance of (update / lr) from the fresh gradient and from the
        running sum, per tensor; NaN outside the running-sum window. Uses ``self._buffer``,
        which ``_after_step`` has just turned into (before - after) = lr x the stepped gradient."""
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


def total_grad_norm(columns: Dict[str, np.ndarray]) -> float:
    """The whole model's gradient norm: tensors without a gradient (``none``) are left out,
    a non-finite one makes the total non-finite (it is recorded, never dropped)."""
    has_grad = columns["grad_state"] != "none"
    return float(np.sqrt(np.sum(np.asarray(columns["grad_norm"], dtype=float)[has_grad] ** 2)))


def step_norms(columns: Dict[str, np.ndarray]) -> Dict[str, float]:
    """One logged step's whole-model gradient norms, as ``scalars.parquet`` records them:
    ``grad_norm`` (what ``.grad`` held) and ``fresh_grad_norm`` (this step's backward alone)."""
    return {"grad_norm": total_grad_norm(columns),
            "fresh_grad_norm": float(np.sqrt(np.nansum(np.asarray(columns["fresh_grad_norm"], dtype=float) ** 2)))}
