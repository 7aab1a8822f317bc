"""The reducer that turns a logged step's blocks into ``modules.parquet``'s columns: the
block passes over the buffers (probe/blocks.py) in a fixed number of operations per pass
(over the whole layout where the parameters' copy is on the device, else per window),
the one transfer to the host, and the host's float64 sums (probe/columns.py), with the one
collective of a distributed run (probe/shards.py) inside."""

from __future__ import annotations

from typing import Dict, List, Optional

import numpy as np
import torch

from gradrepro.probe.blocks import (
    bf16_lost_,
    host_path,
    level_sums_,
    moments_,
    regrow_,
    release_,
    squares,
    zero_pads_,
)
from gradrepro.probe.buffers import StepBuffers
from gradrepro.probe.columns import activation_columns, gradient_columns
from gradrepro.probe.extras import optional_parts, step_residuals
from gradrepro.probe.hooks import Hooks
from gradrepro.probe.kernels import to_host
from gradrepro.probe.states import FP16_FLUSH
from gradrepro.probe.tensors import ProbedTensors


def _gradient_pass(work, part, rows, targets: List[torch.Tensor], sources: List[torch.Tensor],
                   missing: List[torch.Tensor], carried) -> None:
    """The gradients' passes over one buffer (``work``: a window, or the whole layout), whose
    blocks ``part`` lays out: the level sums of |g|, then the moments of g, and, where the
    gradient carried a previous step's in (``carried``), this step's own part's squares.
    ``missing``: the buffer's views of the segments without a gradient."""
    # The pads and the segments without a gradient must read as zero. On the host, only they
    # are zeroed: a pass fewer over memory that is usually just grown (fresh pages, each
    # faulted in); on a device, one pass over the whole buffer is one operation.
    if host_path(work.flat):
        zero_pads_(work, part)
        if missing:
            torch._foreach_zero_(missing)
    else:
        work.flat.zero_()
    torch._foreach_copy_(targets, sources)
    work.flat.abs_()
    level_sums_(work.grid, rows, "g_", nan=False)
    torch._foreach_copy_(targets, sources)
    if carried is not None:  # this step's own gradient: .grad minus what it carried in
        torch.sub(work.flat, carried.flat, out=carried.flat)
    moments_(work, part, rows, "g_")
    if carried is not None:
        squares(carried.grid, rows, "f_", work=work.grid)

class Reducer:
    """Block passes and columns for ``tensors``; ``weight_decay`` is the optimizer's
    (grad_to_decay = ||grad of the loss|| / ||wd * w||, He et al. 2015, footnote 2; 0 leaves
    the column NaN)."""

    def __init__(self, tensors: ProbedTensors, cfg, weight_decay: float = 0.0) -> None:
        self.tensors, self.cfg, self.weight_decay = tensors, cfg, weight_decay
        # Per module, the updates bf16 weights round away (frac_bf16_update_lost): measured
        # when the recorder sees bf16 weights or bf16 autocast; two buffer passes more.
        self.bf16 = False
        # Set by ``distribute`` when the process group has more than one process: the one
        # collective of a logged step (shards.Combiner), and per tensor whether this
        # process's part counts toward the full tensor and whether it is a plain replica.
        self.combiner = None
        self.counted: Optional[np.ndarray] = None
        self.plain: Optional[np.ndarray] = None
        self.collective_device = torch.device("cpu")
        # The output gradients' counts: a window's masks (act_grad_window).
        self._scratch: Optional[torch.Tensor] = None
        self._scratch_views: Dict[tuple, torch.Tensor] = {}

    def distribute(self, combiner, counted: np.ndarray, plain: np.ndarray, device: torch.device) -> None:
        """The statistics of the full tensors, from every process's part (probe/ranks.py)."""
        self.combiner, self.counted, self.plain, self.collective_device = combiner, counted, plain, device

    # -- the hooks' samples, a window at a time -----------------------------------------------
    @staticmethod
    def act_window(work, window, rows) -> None:
        moments_(work, window, rows, "")

    def act_grad_window(self, work, window, rows) -> None:
        """The zero and fp16-flush counts, then the moments in place. Per block, the entries
        that are not zero (NaN and inf count) and those a float16 copy would hold as zero
        (|x| <= FP16_FLUSH = 2^-25, the pads included: rounding to nearest even takes exactly
        these to zero, and keeps NaN and inf), each a 0/1 mask written into a scratch window
        (its memory handed back at once) and summed in float32 (exact: at most BLOCK per
        row), so that the window itself stays as the moments need it. On a CPU a norm of
        order 0 took ten times a mask and its sum (benchmarks/README.md)."""
        grid = work.grid
        scratch = self._scratch_for(grid)
        torch.ne(grid, 0, out=scratch)
        torch.sum(scratch, 1, out=rows.row["nonzero"])
        torch.abs(grid, out=scratch)
        scratch.le_(FP16_FLUSH)  # NaN compares false: not flushed
        torch.sum(scratch, 1, out=rows.row["flushed"])
        release_(scratch)
        moments_(work, window, rows, "")

    def _scratch_for(self, grid: torch.Tensor) -> torch.Tensor:
        """A buffer of ``grid``'s shape, dtype and device (grown here, handed back after each use)."""
        need = grid.numel()
        scratch = self._scratch
        if scratch is None or scratch.numel() < need or scratch.device != grid.device or scratch.dtype != grid.dtype:
            scratch = self._scratch = torch.empty(need, dtype=grid.dtype, device=grid.device)
            self._scratch_views = {}
        regrow_(scratch)
        view = self._scratch_views.get(grid.shape)
        if view is None:
            view = self._scratch_views[grid.shape] = scratch.narrow(0, 0, need).view(grid.shape)
        return view

    def release(self) -> None:
        if self._scratch is not None:
            release_(self._scratch)

    # -- gradients (after backward, before the optimizer step) --------------------------------
    def collect(self, buffers: StepBuffers, summing: bool) -> dict:
        """The gradients' and the parameters' passes; what ``finish`` needs after the step."""
        with torch.no_grad():
            buffers.close_stashes()  # first: their windows are handed back before any buffer below grows
            buffers.ensure_layout()
            have, grads = self.tensors.grads()
            buffers.stats.regrow()
            if buffers.host_before:
                self._gradient_windows(buffers, have, grads)
                pads_zero = False
            else:
                pads_zero = self._gradient_passes(buffers, have, grads)
            fresh = grads if not buffers.carrying else buffers.carried_views(have)
            if summing:
                buffers.add_to_running_sum(have, fresh)
            self._before_passes(buffers, pads_zero)
        # The windows hold nothing across the optimizer's step (their next use writes them
        # first): handed back, so that the step's memory is the copy's alone beside the training's.
        buffers.windows.release()
        return {"have": have, "grads": grads, "carried": buffers.carrying, "fresh": fresh if summing else None}

    def _gradient_passes(self, buffers: StepBuffers, have: List[int], grads: List[torch.Tensor]) -> bool:
        """The gradients' passes over the whole layout at once, in the buffer that holds the
        parameters' copy next (it is held from here to the step's end in any case): a fixed
        number of operations whatever the model's size. The same passes on the same blocks as
        the windows' (``_gradient_windows``), so the same per-block values. True when they
        ran: the buffer's pads are then zero (the copy that follows writes the segments only)."""
        if not have:
            return False
        stats, before, layout = buffers.stats, buffers.before, buffers.layout
        before.regrow()
        carried = buffers.carried if buffers.carrying else None
        got = set(have)
        missing = [v for i, v in enumerate(before.views) if i not in got]
        _gradient_pass(before, layout, stats, [before.views[i] for i in have], grads, missing, carried)
        return True

    def _gradient_windows(self, buffers: StepBuffers, have: List[int], grads: List[torch.Tensor]) -> None:
        """The gradients' passes a window at a time (the parameters' copy is in host memory:
        the device holds a window, not a copy of the model)."""
        windows, stats = buffers.windows, buffers.stats
        windows.regrow()
        grad_of = dict(zip(have, grads))
        carried = windows.rows(buffers.carried) if buffers.carrying else None
        for w, (part, rows) in enumerate(zip(windows.parts, windows.rows(stats))):
            targets, sources = windows.pieces(part, grad_of)
            if not targets:  # no gradient in this window: its rows stay zero (never read)
                continue
            missing = [piece[3] for piece in part.pieces if piece[0] not in grad_of]
            _gradient_pass(part.work, part, rows, targets, sources, missing,
                           carried[w] if carried is not None else None)

    def _before_passes(self, buffers: StepBuffers, pads_zero: bool) -> None:
        """The parameters before the step: copied into ``buffers.before`` and their norms.
        ``pads_zero``: the gradients' passes left the buffer's pads zero."""
        windows, stats, before, layout = buffers.windows, buffers.stats, buffers.before, buffers.layout
        if buffers.host_before:  # a window at a time through the work buffer, then to the host
            before.regrow()
            param_of = dict(enumerate(self.tensors.values()))
            for part, rows, h in zip(windows.parts, windows.rows(stats), windows.rows(before)):
                targets, sources = windows.pieces(part, param_of)
                work = part.work
                work.flat.zero_()  # the pads
                torch._foreach_copy_(targets, sources)
                h.flat.copy_(work.flat, non_blocking=True)  # ordered before the next pass
                squares(work.grid, rows, "p_", work=work.grid)
            return
        # The copy alone is held beside the gradients: its norms' scaled pass, where it runs
        # (blocks.squares), runs in place over the whole layout, and a second copy (the
        # parameters are as they were) puts its values back.
        before.regrow()
        params = self.tensors.values()
        torch._foreach_copy_(list(before.views), list(params))
        if not pads_zero:
            zero_pads_(before, layout)
        if squares(before.grid, stats, "p_", work=before.grid):
            torch._foreach_copy_(list(before.views), list(params))

    # -- after the optimizer step: update norms, the one host transfer, the columns -----------
    def finish(self, buffers: StepBuffers, hooks: Hooks, step: int, pending: dict,
               lr: float, summing: bool) -> Dict[str, np.ndarray]:
        windows, before, stats = buffers.windows, buffers.before, buffers.stats
        residuals = summing and pending.get("fresh") is not None and lr > 0
        # Where nothing reads the update after its norms (no bf16 count, no running-sum
        # residuals), its scaled pass overwrites it and the windows stay handed back.
        spare = self.bf16 or buffers.host_before or residuals
        with torch.no_grad():
            if spare:
                windows.regrow()
            params = self.tensors.values()
            if buffers.host_before:  # the update a window at a time, bf16's count with it
                self._host_updates(buffers, params, pending)
            else:
                torch._foreach_sub_(before.views, params)  # before - after
                if spare:  # the update is read again: its scaled pass goes to a window at a time
                    for part, rows, b in zip(windows.parts, windows.rows(stats), windows.rows(before)):
                        squares(b.grid, rows, "u_", work=part.work.grid)
                else:  # in place, the whole layout at once
                    squares(before.grid, stats, "u_", work=before.grid)
                    before.release()  # spent: its memory back before the transfer's
            parts = {"params": stats.part()}
            if buffers.acts.seen:
                parts["acts"] = buffers.acts.part()
            if buffers.act_grads.seen:
                parts["act_grads"] = buffers.act_grads.part()
            if residuals:
                parts["residuals"] = step_residuals(before.views, pending["have"], pending["fresh"],
                                                    buffers.running, lr)
            parts.update(optional_parts(self.tensors.module_of, hooks.per_example, hooks.act_grad_hist,
                                        hooks.contributions))
            if self.bf16 and not buffers.host_before:  # last: it spends the update buffer
                grad_of = dict(zip(pending["have"], pending["grads"]))
                param_of = dict(enumerate(params))
                for part, rows, b in zip(windows.parts, windows.rows(stats), windows.rows(before)):
                    bf16_lost_(b, part.work, windows.pieces(part, grad_of), windows.pieces(part, param_of),
                               rows.row["b_lost"])
            host = to_host(parts)  # the one transfer
        buffers.release()
        self.release()
        hooks.clear()
        columns = gradient_columns(self, buffers, step, host, pending)
        columns.update(activation_columns(self.tensors, self.cfg, buffers, hooks.contributions, host))
        hooks.contributions.clear()
        return columns

    def _host_updates(self, buffers: StepBuffers, params: List[torch.Tensor], pending: dict) -> None:
        """The update ``before - after`` of each window in the staging buffer, from the host
        copy: the same entries, so the same per-block values as the whole-layout path."""
        windows, staging = buffers.windows, buffers.staging
        staging.regrow()
        param_of = dict(enumerate(params))
        grad_of = dict(zip(pending["have"], pending["grads"]))
        for part, stage, rows, h in zip(windows.parts, staging.parts, windows.rows(buffers.stats),
                                        windows.rows(buffers.before)):
            b = stage.work
            b.flat.copy_(h.flat, non_blocking=True)
            targets, sources = staging.pieces(stage, param_of)
            if targets:
                torch._foreach_sub_(targets, sources)
            squares(b.grid, rows, "u_", work=part.work.grid)
            if self.bf16:  # it spends both windows
                bf16_lost_(b, part.work, windows.pieces(part, grad_of), windows.pieces(part, param_of),
                           rows.row["b_lost"])


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

