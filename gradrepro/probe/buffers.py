"""The buffers that hold a logged step's blocks (probe/blocks.py): the parameters before the
step (then the update; the gradients' passes run in it first), fixed-size windows (for a copy
in host memory, and for an update that is read again after its norms), what ``.grad`` carried
in, the per-block rows of the one transfer, and the hooks' two stashes (probe/stash.py).

All are made at the first logged step and their memory is handed back at the end of every
logged step (``blocks.release_``): none is held in between. The probe's running sum of fresh
gradients (``probe.running_sum_steps``) is the exception: it lasts the window it sums over.
"""

from __future__ import annotations

from typing import Callable, List, Optional, Sequence

import torch

from gradrepro.probe.blocks import (
    COUNT_ROWS,
    LEVEL_ROWS,
    MOMENT_ROWS,
    SQUARE_ROWS,
    Buffer,
    Layout,
    Stats,
    Windows,
)
from gradrepro.probe.stash import SAMPLE_WINDOW_BLOCKS, Reduce, Stash
from gradrepro.probe.tensors import ProbedTensors

# Per block of the parameter layout: the gradient's moments and levels, this step's own
# gradient (when .grad carried a sum in), the parameters before the step and the update.
PARAM_ROWS = (tuple("g_" + r for r in MOMENT_ROWS + LEVEL_ROWS)
              + tuple(p + r for p in ("f_", "p_", "u_") for r in SQUARE_ROWS) + ("b_lost",))


class StepBuffers:
    """One logged step's block buffers for ``tensors``; ``reduce_acts`` and
    ``reduce_act_grads`` reduce a window of the hooks' samples (the reducer's)."""

    def __init__(self, tensors: ProbedTensors, host_before: Callable[[], bool],
                 reduce_acts: Reduce, reduce_act_grads: Reduce) -> None:
        self.tensors = tensors
        self._wants_host_before = host_before
        self.window_blocks: Optional[int] = None  # blocks.WINDOW_BLOCKS unless set
        self.layout: Optional[Layout] = None
        self.stats: Optional[Stats] = None
        self.windows: Optional[Windows] = None
        self.dtype = torch.float32
        self.before: Optional[Buffer] = None
        # probe.before_on: the pre-step copy in host memory, brought back through a window-
        # sized device buffer (``staging``) a window at a time after the step.
        self.host_before = False
        self.staging: Optional[Windows] = None
        self.carried: Optional[Buffer] = None
        self.carrying = False
        self.running: Optional[List[torch.Tensor]] = None
        window = lambda: self.window_blocks or SAMPLE_WINDOW_BLOCKS  # noqa: E731
        self.acts = Stash(MOMENT_ROWS, reduce_acts, window, grow_at_once=True)  # module outputs, first call of the step
        # The output gradients' window is half the outputs': it is held through backward, where
        # the training's own memory is highest (benchmarks/README.md, memory).
        grad_window = lambda: self.window_blocks or SAMPLE_WINDOW_BLOCKS // 2  # noqa: E731
        self.act_grads = Stash(MOMENT_ROWS + COUNT_ROWS, reduce_act_grads, grad_window)  # at module outputs

    # -- the layout ---------------------------------------------------------------------------
    def ensure_layout(self) -> None:
        """Lay the buffers out for the tensors' device and dtype (again only if they changed)."""
        device = self.tensors.device
        dtype = torch.float64 if self.tensors.wide() else torch.float32
        if self.layout is not None and self.layout.device == device and self.dtype == dtype:
            return
        shapes = self.tensors.shapes
        self.layout = Layout(self.tensors.local_numel, device)
        self.dtype = dtype
        self.windows = self.layout.windows(shapes, dtype, self.window_blocks)
        self.host_before = self._wants_host_before()
        self.before = self.layout.buffer(shapes, dtype, zeros=False,
                                         device="cpu" if self.host_before else None)
        self.staging = self.layout.windows(shapes, dtype, self.window_blocks) if self.host_before else None
        self.carried = None
        self.stats = self.layout.stats(PARAM_ROWS, dtype)
        # No memory until each is needed (regrow): the stashes are reduced and handed back first.
        # The host copy is the exception: pinned memory is allocated once and kept (freed, it
        # would stay in PyTorch's pinned-memory cache anyway), off the device.
        for buf in self.device_buffers():
            buf.release()

    def device_buffers(self) -> list:
        kept = [self.windows, self.staging, self.carried, self.stats]
        if not self.host_before:
            kept.append(self.before)
        return [buf for buf in kept if buf is not None]

    # -- a logged step ------------------------------------------------------------------------
    def begin(self) -> None:
        """Forget the last step's samples; no carried part yet."""
        self.acts.begin()
        self.act_grads.begin()
        self.carrying = False

    def carry(self, indices: Sequence[int], grads: Sequence[torch.Tensor]) -> None:
        """Keep what ``.grad`` holds before this step's backward (``grads``, of the tensors
        ``indices``) in the carried buffer: one multi-tensor copy."""
        if not indices:
            return
        with torch.no_grad():
            if not self.carrying:
                self._carry_buffer()
                self.carrying = True
            torch._foreach_copy_([self.carried.views[i] for i in indices], list(grads))

    def carry_one(self, i: int, grad: torch.Tensor) -> None:
        """Keep what ``.grad`` of tensor ``i`` holds when this step's backward first reaches it."""
        if not self.carrying:
            self._carry_buffer()
            self.carrying = True
        self.carried.views[i].copy_(grad)

    def _carry_buffer(self) -> None:
        self.ensure_layout()
        if self.carried is None:
            self.carried = self.layout.buffer(self.tensors.shapes, self.dtype)
        self.carried.regrow()
        self.carried.flat.zero_()

    def carried_views(self, have: Sequence[int]) -> List[torch.Tensor]:
        return [self.carried.views[i] for i in have]

    def add_to_running_sum(self, have: Sequence[int], fresh: Sequence[torch.Tensor]) -> List[torch.Tensor]:
        """The probe's own float64 running sum of fresh gradients, with this step's added."""
        if self.running is None:
            self.running = [torch.zeros(s, dtype=torch.float64, device=self.tensors.device)
                            for s in self.tensors.shapes]
        for i, f in zip(have, fresh):
            self.running[i] += f.double()
        return self.running

    def close_acts(self) -> None:
        """The outputs' last window reduced and the window handed back as soon as backward
        begins, so that it and the output gradients' window are not held together."""
        self.acts.settle()
        self.acts.release_buffer()

    def close_stashes(self) -> None:
        """The hooks' samples: the outputs' (if backward did not already begin), then their
        gradients' last window; their windows handed back before the gradients' passes."""
        if not self.acts.closed:
            self.close_acts()
        self.act_grads.settle()
        self.act_grads.release_buffer()

    def release(self) -> None:
        """Hand back the memory of every buffer of the step (their views stay valid objects,
        blocks.release_): between logged steps only the layouts' few bytes are held."""
        for buf in self.device_buffers():
            buf.release()
        self.acts.release()
        self.act_grads.release()
