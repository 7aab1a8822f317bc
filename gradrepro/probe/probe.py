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

On steps that are not logged nothing runs but the schedule's test. On a logged step the work
does not grow operation by operation with the number of tensors: the hooks copy their samples
into a window-sized buffer, reduced a window at a time as they arrive (probe/stash.py);
gradients, parameters and updates pass through another with multi-tensor copies; each window
is reduced a block at a time in a fixed number of operations (probe/blocks.py), and the
per-block results reach the host in one transfer, where float64 sums by tensor finish them
(probe/columns.py). Gradient states (probe/states.py):
``none``, ``zero``, ``tiny``, ``finite``, ``nonfinite``.
"""

from __future__ import annotations

import math
from typing import Dict, List, Optional, Sequence

import numpy as np
import torch
from torch import nn

from gradrepro.probe.blocks import (
    BLOCK,
    COUNT_ROWS,
    LEVEL_ROWS,
    MOMENT_ROWS,
    SQUARE_ROWS,
    Buffer,
    Layout,
    Stats,
    Windows,
    bf16_lost_,
    level_sums_,
    moments_,
    release_,
    squares,
    zero_pads_,
)
from gradrepro.probe.columns import activation_columns, gradient_columns
from gradrepro.probe.extras import contribution_norms, optional_parts, step_residuals
from gradrepro.probe.kernels import log2_histogram, per_example_stats, to_host
from gradrepro.probe.shards import local, sharded_setup
from gradrepro.probe.stash import SAMPLE_WINDOW_BLOCKS, Stash
from gradrepro.probe.states import module_kind
from gradrepro.probe.step import ProbeStep

# Per block of the parameter layout: the gradient's moments and levels, this step's own
# gradient (when .grad carried a sum in), the parameters before the step and the update.
PARAM_ROWS = (tuple("g_" + r for r in MOMENT_ROWS + LEVEL_ROWS)
              + tuple(p + r for p in ("f_", "p_", "u_") for r in SQUARE_ROWS) + ("b_lost",))


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
        # A complex tensor is summarised as its real and imaginary parts (twice the entries).
        # A DTensor (FSDP2) as the shard this process holds: the buffers take the local
        # shapes, the columns the full tensor's entries (probe/shards.py combines the parts).
        self.shapes = [_real(p).shape for p in self.params]
        self.numel = np.array([math.prod(p.shape) * (2 if p.is_complex() else 1) for p in self.params],
                              dtype=np.float64)
        self.local_numel = [math.prod(s) for s in self.shapes]
        self._complex = any(p.is_complex() for p in self.params)
        self._sharded = sharded_setup(self.params) is not None
        # Set by the recorder when the process group has more than one process: the one
        # collective of a logged step (shards.Combiner), and per tensor whether this
        # process's part counts toward the full tensor and whether it is a plain replica.
        self.combiner = None
        self.counted: Optional[np.ndarray] = None
        self.plain: Optional[np.ndarray] = None
        self.collective_device = torch.device("cpu")
        # Per module, the updates bf16 weights round away (frac_bf16_update_lost): measured
        # when the recorder sees bf16 weights or bf16 autocast; two buffer passes more.
        self.bf16 = False
        # Gradients pass through fixed-size windows (blocks.Windows) a window at a time; the
        # parameters before the step (then the update) and what .grad carried in are each a
        # block buffer of the same layout, held from the step's collect (or first forward
        # pass) to its end. All are made at the first logged step and their memory is handed
        # back at the end of every logged step (blocks.release_): none is held in between.
        self.layout: Optional[Layout] = None
        self.stats: Optional[Stats] = None
        self.window_blocks: Optional[int] = None  # blocks.WINDOW_BLOCKS unless set
        self._windows: Optional[Windows] = None
        self._dtype = torch.float32
        self._before: Optional[Buffer] = None
        # probe.before_on: the pre-step copy in host memory, brought back through a window-
        # sized device buffer (``_staging``) a window at a time after the step.
        self._host_before = False
        self._staging: Optional[Windows] = None
        self._carried: Optional[Buffer] = None
        self._carrying = False
        # The output gradients' fp16-flush count: a float16 copy of a window, and its count row.
        self._half: Optional[torch.Tensor] = None
        self._half_views: Dict[int, tuple] = {}
        # The hooks' samples, reduced a window at a time as they arrive (probe/stash.py).
        window = lambda: self.window_blocks or SAMPLE_WINDOW_BLOCKS  # noqa: E731
        self.acts = Stash(MOMENT_ROWS, self._reduce_act_window, window)  # module outputs, first call of the step
        # The output gradients' window is half the outputs': it is held through backward, where
        # the training's own memory is highest (benchmarks/README.md, memory).
        grad_window = lambda: self.window_blocks or SAMPLE_WINDOW_BLOCKS // 2  # noqa: E731
        self.act_grads = Stash(MOMENT_ROWS + COUNT_ROWS, self._reduce_act_grad_window, grad_window)  # at module outputs
        self._handles: list = []
        self._hook_fns: Dict[str, object] = {}
        self._act_grad_hist: Dict[str, torch.Tensor] = {}
        self._contrib: Dict[str, tuple] = {}  # term -> (tensors it reaches, their norm rows)
        self._pending: Optional[dict] = None
        self._inputs: Dict[str, torch.Tensor] = {}
        self._per_example: Dict[str, torch.Tensor] = {}
        self.loss_scale = 1.0  # of the current step (the hooks unscale their std with it)
        self.lr = math.nan  # of the current step (update / lr reads as a gradient)
        # The probe's own running sum of fresh gradients over the first running_sum_steps steps.
        self._running: Optional[List[torch.Tensor]] = None
        self._summing = False
        # True where the loop is not gradrepro's (the recorder): the carried part of .grad is
        # read when backward reaches each parameter, not at the step's first forward pass.
        self.carry_at_backward = False

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
        self.acts.begin()
        self.act_grads.begin()
        for stats in (self._act_grad_hist, self._contrib, self._inputs, self._per_example):
            stats.clear()
        if hooks and self.cfg.activations:
            # The same hook functions on every logged step: torch.compile guards on a module's
            # hooks, so new ones would compile the model anew each logged step.
            if not self._hook_fns:
                self._hook_fns = {name: self._forward_hook(name) for name in self.hooked}
            for name, module in self.hooked.items():
                self._handles.append(module.register_forward_hook(self._hook_fns[name]))
        self._summing = step < self.cfg.running_sum_steps
        if self.carry_at_backward and hooks:
            self._carry_when_backward_arrives()
            return
        carried = [i for i, p in enumerate(self.params) if p.grad is not None]
        self._carrying = bool(carried)
        if carried:
            with torch.no_grad():
                self._carry_buffer()
                _copy_([self._carried.views[i] for i in carried], [_real(self.params[i].grad) for i in carried])

    def _carry_buffer(self) -> None:
        self._ensure_layout()
        if self._carried is None:
            self._carried = self.layout.buffer(self.shapes, self._dtype)
        self._carried.regrow()
        self._carried.flat.zero_()

    def _carry_when_backward_arrives(self) -> None:
        """The carried part is what ``.grad`` holds when this step's first backward reaches each
        parameter (a tensor hook runs before the gradient is accumulated into ``.grad``), not
        what it held at the forward pass: a loop may call ``zero_grad()`` between the two."""
        self._carrying = False
        reached: set = set()

        def hook_for(i: int):
            def hook(grad: torch.Tensor) -> None:
                param = self.params[i]
                if i in reached or param.grad is None:
                    reached.add(i)
                    return
                reached.add(i)
                with torch.no_grad():
                    if not self._carrying:
                        self._carry_buffer()
                        self._carrying = True
                    self._carried.views[i].copy_(_real(param.grad))
            return hook

        for i, param in enumerate(self.params):
            if param.requires_grad:
                self._handles.append(param.register_hook(hook_for(i)))

    def _disarm(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()

    # -- forward/backward hooks (armed on logged steps only): one copy each ---------------
    def _forward_hook(self, name: str):
        n = self.cfg.act_sample

        def hook(module, inputs, output):
            # Inside a compiled graph torch.compile would trace the hook's bookkeeping (and break
            # the graph at the tensor hook below): a compiled module's activations are left out.
            if _compiling():
                return
            out = output[0] if isinstance(output, (tuple, list)) else output
            # A module called twice in one step (SimSiam's two views) is recorded once: the first call.
            if (name in self.acts or not torch.is_tensor(out) or not out.is_floating_point()
                    or out.dim() == 0):
                return
            with torch.no_grad():
                self.acts.put(name, out[:n] if out.shape[0] > n else out)
            if (self.cfg.per_example and isinstance(module, nn.Linear)
                    and inputs and torch.is_tensor(inputs[0]) and inputs[0].dim() == 2):
                self._inputs[name] = inputs[0].detach()[:n].float()
            if out.requires_grad:
                out.register_hook(self._grad_hook(name))

        return hook

    def _grad_hook(self, name: str):
        n = self.cfg.act_sample

        def hook(grad: torch.Tensor) -> None:
            if name in self.act_grads:  # only the main backward, not task-contribution passes
                return
            if not self.acts.closed:  # backward has begun: the outputs' samples are complete
                with torch.no_grad():
                    self._reduce_acts()
            # std is reported without the loss scale; the zero/flush counts are of the
            # values backward actually carried (scaled), which is what fp16 has to hold.
            with torch.no_grad():
                g = grad[:n] if grad.shape[0] > n else grad
                self.act_grads.put(name, g, self.loss_scale)
                if self.cfg.act_grad_hist:
                    self._act_grad_hist[name] = log2_histogram(g)
                if name in self._inputs:
                    self._per_example[name] = per_example_stats(
                        g.float() * (grad.shape[0] / self.loss_scale), self._inputs.pop(name))

        return hook

    # -- task contribution ----------------------------------------------------------------
    def _contribution(self, terms: Dict[str, torch.Tensor]) -> None:
        for term_name, term in terms.items():
            self._contrib[term_name] = contribution_norms(self.params, term)

    # -- gradients (after backward, before the optimizer step) ----------------------------
    def _ensure_layout(self) -> None:
        device = self.params[0].device
        wide = any(p.dtype in (torch.float64, torch.complex128) for p in self.params)
        dtype = torch.float64 if wide else torch.float32
        if self.layout is not None and self.layout.device == device and self._dtype == dtype:
            return
        shapes = self.shapes
        self.layout = Layout(self.local_numel, device)
        self._dtype = dtype
        self._windows = self.layout.windows(shapes, dtype, self.window_blocks)
        self._host_before = self._before_on_host()
        self._before = self.layout.buffer(shapes, dtype, zeros=False,
                                          device="cpu" if self._host_before else None)
        self._staging = self.layout.windows(shapes, dtype, self.window_blocks) if self._host_before else None
        self._carried = None
        self.stats = self.layout.stats(PARAM_ROWS, dtype)
        # No memory until each is needed (regrow_): the stashes are reduced and handed back first.
        # The host copy is the exception: pinned memory is allocated once and kept (freed, it
        # would stay in PyTorch's pinned-memory cache anyway), off the device.
        for buf in self._device_buffers():
            buf.release()

    def _device_buffers(self) -> list:
        kept = [self._windows, self._staging, self._carried, self.stats]
        if not self._host_before:
            kept.append(self._before)
        return [buf for buf in kept if buf is not None]

    def _before_on_host(self) -> bool:
        """probe.before_on: whether the pre-step copy of the parameters lives in host memory."""
        # The running-sum check's residuals read the whole update per tensor on the device.
        return getattr(self.cfg, "before_on", "device") == "host" and self.cfg.running_sum_steps == 0

    def _collect(self) -> None:
        device = self.params[0].device
        with torch.no_grad():
            self._reduce_stashes()  # first: their windows are handed back before any buffer below grows
            self._ensure_layout()
            have = [i for i, p in enumerate(self.params) if p.grad is not None]
            grads = [_real(self.params[i].grad) for i in have]
            windows, stats = self._windows, self.stats
            windows.regrow()
            stats.regrow()
            grad_of = dict(zip(have, grads))
            carried = windows.rows(self._carried) if self._carrying else None
            for w, (part, rows) in enumerate(zip(windows.parts, windows.rows(stats))):
                targets, sources = windows.pieces(part, grad_of)
                if not targets:  # no gradient in this window: its rows stay zero (never read)
                    continue
                work = part.work
                work.flat.zero_()  # the pads, and the segments without a gradient
                _copy_(targets, sources)
                work.flat.abs_()
                level_sums_(work.grid, rows, "g_", nan=False)
                _copy_(targets, sources)
                if carried is not None:  # this step's own gradient: .grad minus what it carried in
                    torch.sub(work.flat, carried[w].flat, out=carried[w].flat)
                moments_(work, part, rows, "g_")
                if carried is not None:
                    squares(carried[w].grid, rows, "f_", work=work.grid)
            fresh = grads if not self._carrying else [self._carried.views[i] for i in have]
            if self._summing:
                if self._running is None:
                    self._running = [torch.zeros(s, dtype=torch.float64, device=device) for s in self.shapes]
                for i, f in zip(have, fresh):
                    self._running[i] += f.double()
            before = self._before
            if self._host_before:  # a window at a time through the work buffer, then to the host
                before.regrow()
                param_of = dict(enumerate(self._real_params()))
                for part, rows, h in zip(windows.parts, windows.rows(stats), windows.rows(before)):
                    targets, sources = windows.pieces(part, param_of)
                    work = part.work
                    work.flat.zero_()  # the pads
                    _copy_(targets, sources)
                    h.flat.copy_(work.flat, non_blocking=True)  # ordered before the next pass
                    squares(work.grid, rows, "p_", work=work.grid)
            else:
                # The windows go before the copy comes, so that the copy alone is held beside the
                # gradients: its norms' scaled pass runs in place, and a second copy (the
                # parameters are as they were) puts its values back.
                windows.release()
                before.regrow()
                params = self._real_params()
                _copy_(before.views, params)
                zero_pads_(before, self.layout)
                for rows, b in zip(windows.rows(stats), windows.rows(before)):
                    squares(b.grid, rows, "p_", work=b.grid)
                _copy_(before.views, params)
        # The windows hold nothing across the optimizer's step (their next use writes them
        # first): handed back, so that the step's memory is the copy's alone beside the training's.
        windows.release()
        self._pending = {"have": have, "grads": grads, "carried": self._carrying,
                         "fresh": fresh if self._summing else None}

    def _real_params(self) -> List[torch.Tensor]:
        return [_real(p) for p in self.params] if self._complex or self._sharded else self.params

    def _reduce_acts(self) -> None:
        """The outputs' last window reduced and the window handed back as soon as backward
        begins, so that it and the output gradients' window are not held together."""
        self.acts.settle()
        self.acts.release_buffer()

    def _reduce_stashes(self) -> None:
        """The hooks' samples: the outputs' (if backward did not already begin:
        ``_reduce_acts``), then their gradients' last window; their windows handed back
        before the gradients' passes."""
        if not self.acts.closed:
            self._reduce_acts()
        self.act_grads.settle()
        self.act_grads.release_buffer()

    @staticmethod
    def _reduce_act_window(work, window, rows) -> None:
        moments_(work, window, rows, "")

    def _reduce_act_grad_window(self, work, window, rows) -> None:
        """The zero and fp16-flush counts, then the moments in place. Per block, the entries
        that are not zero (a norm of order 0: NaN and inf count) and those a float16 copy keeps
        non-zero (|x| > FP16_FLUSH = 2^-25, NaN and inf: rounding to nearest even takes exactly
        the others to zero), through a float16 copy of the window (half its bytes, handed back
        at once), so that the window itself stays as the moments need it."""
        grid = work.grid
        half, kept = self._half_for(grid.shape[0], grid.device)
        torch.linalg.vector_norm(grid, 0, dim=1, out=rows.row["nonzero"])
        half.copy_(grid)
        torch.linalg.vector_norm(half, 0, dim=1, out=kept)  # exact: at most BLOCK
        rows.row["kept"].copy_(kept)
        release_(half)
        moments_(work, window, rows, "")

    def _half_for(self, rows: int, device: torch.device):
        """A ``rows x BLOCK`` float16 grid and a count row of ``rows`` after it, in one buffer
        whose storage holds those alone (grown here, handed back after each use)."""
        need = rows * (BLOCK + 1)
        if self._half is None or self._half.numel() < need or self._half.device != device:
            self._half = torch.empty(need, dtype=torch.float16, device=device)
            self._half_views = {}
        storage = self._half.untyped_storage()
        if storage.nbytes() < 2 * need:
            storage.resize_(2 * need)
        views = self._half_views.get(rows)
        if views is None:
            views = self._half_views[rows] = (self._half.narrow(0, 0, rows * BLOCK).view(rows, BLOCK),
                                              self._half.narrow(0, rows * BLOCK, rows))
        return views

    # -- after the optimizer step: update norms and the one host transfer -----------------
    def _after_step(self, step: int) -> Dict[str, np.ndarray]:
        pending = self._pending
        self._pending = None
        windows, before = self._windows, self._before
        residuals = self._summing and pending.get("fresh") is not None and self.lr > 0
        # Where nothing reads the update after its norms (no bf16 count, no running-sum
        # residuals), its scaled pass overwrites it and the windows stay handed back.
        spare = self.bf16 or self._host_before or residuals
        with torch.no_grad():
            if spare:
                windows.regrow()
            params = self._real_params()
            if self._host_before:  # the update a window at a time, bf16's count with it
                self._host_updates(params, pending)
            else:
                torch._foreach_sub_(before.views, params)  # before - after
                for part, rows, b in zip(windows.parts, windows.rows(self.stats), windows.rows(before)):
                    squares(b.grid, rows, "u_", work=part.work.grid if spare else b.grid)
                if not spare:
                    before.release()  # spent: its memory back before the transfer's
            parts = {"params": self.stats.data}
            if self.acts.seen:
                parts["acts"] = self.acts.result()
            if self.act_grads.seen:
                parts["act_grads"] = self.act_grads.result()
            if residuals:
                parts["residuals"] = step_residuals(
                    self._before.views, pending["have"], pending["fresh"], self._running, self.lr)
            parts.update(optional_parts(self.module_of, self._per_example, self._act_grad_hist,
                                        self._contrib))
            if self.bf16 and not self._host_before:  # last: it spends the update buffer
                grad_of = dict(zip(pending["have"], pending["grads"]))
                param_of = dict(enumerate(params))
                for part, rows, b in zip(windows.parts, windows.rows(self.stats), windows.rows(before)):
                    bf16_lost_(b, part.work, windows.pieces(part, grad_of), windows.pieces(part, param_of),
                               rows.row["b_lost"])
            host = to_host(parts)  # the one transfer
        self._release()
        columns = gradient_columns(self, step, host, pending)
        columns.update(activation_columns(self, host))
        self._contrib.clear()
        return columns

    def _host_updates(self, params: List[torch.Tensor], pending: dict) -> None:
        """The update ``before - after`` of each window in the staging buffer, from the host
        copy: the same entries, so the same per-block values as the whole-layout path."""
        windows, staging = self._windows, self._staging
        staging.regrow()
        param_of = dict(enumerate(params))
        grad_of = dict(zip(pending["have"], pending["grads"]))
        for part, stage, rows, h in zip(windows.parts, staging.parts, windows.rows(self.stats),
                                        windows.rows(self._before)):
            b = stage.work
            b.flat.copy_(h.flat, non_blocking=True)
            targets, sources = staging.pieces(stage, param_of)
            if targets:
                torch._foreach_sub_(targets, sources)
            squares(b.grid, rows, "u_", work=part.work.grid)
            if self.bf16:  # it spends both windows
                bf16_lost_(b, part.work, windows.pieces(part, grad_of), windows.pieces(part, param_of),
                           rows.row["b_lost"])

    def _release(self) -> None:
        """Hand back the memory of every buffer of the step (their views stay valid objects,
        blocks.release_) and drop what the hooks kept: between logged steps the probe holds
        only its layouts' few bytes per block and per tensor."""
        for buf in self._device_buffers():
            buf.release()
        self.acts.release()
        self.act_grads.release()
        if self._half is not None:
            release_(self._half)
        for kept in (self._act_grad_hist, self._inputs, self._per_example):
            kept.clear()
        self._pending = None  # it refers to the step's gradients


def _compiling() -> bool:
    is_compiling = getattr(getattr(torch, "compiler", None), "is_compiling", None)  # torch >= 2.3
    return bool(is_compiling()) if is_compiling is not None else False


def _real(t: torch.Tensor) -> torch.Tensor:
    """What the probe summarises of a tensor: a DTensor's local shard, a sparse gradient (``nn.Embedding(sparse=True)``)
    as the dense tensor it stands for, a complex one as its real and imaginary parts (a view:
    the same norm, the update's norm included; zeros counted per part). Called under no_grad:
    no detach (it would be one more operation per tensor on every logged step)."""
    t = local(t)
    if t.is_sparse:
        t = t.to_dense()
    return torch.view_as_real(t) if t.is_complex() else t


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


def _copy_(targets: Sequence[torch.Tensor], sources: Sequence[torch.Tensor]) -> None:
    """``targets[i].copy_(sources[i])`` for all i, in one multi-tensor copy (torch >= 2.1;
    on CUDA one fused kernel where dtypes and layouts allow, else a copy per tensor)."""
    torch._foreach_copy_(list(targets), list(sources))
