"""The hooks' samples of one logged step, copied into one block buffer and reduced together
after backward: a hook costs one copy (and the slice that takes ``act_sample`` examples),
whatever it will be reduced to.

A module's slot is a view of the buffer shaped like its sample. The first logged step (or a
step whose shapes changed: another batch size, a module seen for the first time) lays the
buffer out anew from what the hooks saw; every later step copies straight into the slots.
The buffer's memory is held from the start of a logged step until its samples are reduced
(``release_buffer``), not in between: the slots stay valid views (blocks.release_).
"""

from __future__ import annotations

import math
from typing import Dict, Optional

import torch

from gradrepro.probe.blocks import Buffer, Layout, Stats, regrow_, release_, zero_pads_


class Stash:
    """Per module name, one float32 sample a hook saw this step, and a value beside it."""

    def __init__(self, rows) -> None:
        self.rows = rows  # the per-block statistics the probe reduces this stash to
        self.layout: Optional[Layout] = None
        self.buffer: Optional[Buffer] = None
        self.stats: Optional[Stats] = None
        self.index: Dict[str, int] = {}  # module name -> segment of the layout
        self._slots: Dict[str, torch.Tensor] = {}
        self.seen: Dict[str, float] = {}  # modules recorded this step, with their value
        self.closed = True  # reduced (or no logged step begun): no sample is taken
        self._loose: Dict[str, torch.Tensor] = {}

    def begin(self) -> None:
        """A logged step starts: the buffer's memory back, zeroed (its pads must be)."""
        self.seen.clear()
        self._loose.clear()
        self.closed = False
        if self.buffer is not None:
            self.buffer.regrow()
            self.buffer.flat.zero_()

    def release_buffer(self) -> None:
        """The samples are reduced: hand back the buffer's memory (the statistics' rows go
        with ``release``, after the step's transfer)."""
        self.closed = True
        if self.buffer is not None:
            self.buffer.release()

    def release(self) -> None:
        self.release_buffer()
        if self.stats is not None:
            release_(self.stats.data)

    def __contains__(self, name: str) -> bool:
        return name in self.seen

    def put(self, name: str, sample: torch.Tensor, value: float = math.nan) -> None:
        """Copy ``sample`` into the module's slot (one operation), or keep a float32 copy
        aside until ``settle`` lays out a buffer that has a slot for it. Nothing once the
        stash is reduced (a forward pass that backward reruns: activation checkpointing)."""
        if self.closed:
            return
        slot = self._slots.get(name)
        if slot is not None and slot.shape == sample.shape and slot.device == sample.device:
            slot.copy_(sample)
        else:
            self._loose[name] = sample.to(torch.float32, copy=True)
        self.seen[name] = value

    def settle(self, like: Optional["Stash"] = None) -> bool:
        """After backward: every sample of this step in the buffer. False when there is none.
        ``like``: a stash whose layout this one takes where both hold the same modules with
        the same shapes (the gradients at module outputs have the outputs' shapes), so that
        the two buffers are interchangeable (``Probe`` lends one to the other as work space)."""
        if not self.seen:
            return False
        if self._loose or (like is not None and self.layout is not like.layout and self._fits(like)):
            self._lay_out(like if like is not None and self._fits(like) else None)
        regrow_(self.stats.data)  # every row of every block is written by the reduction
        return True

    def _samples(self) -> Dict[str, torch.Tensor]:
        return {name: self._loose.get(name, self._slots.get(name)) for name in self.seen}

    def _fits(self, like: "Stash") -> bool:
        if like.layout is None or set(self.seen) != set(like.index):
            return False
        return all(tuple(s.shape) == tuple(like._slots[name].shape) for name, s in self._samples().items())

    def _lay_out(self, like: Optional["Stash"]) -> None:
        samples = self._samples()
        if like is not None:  # the same layout object, in the other stash's order
            samples = {name: samples[name] for name in like.index}
            self.layout = like.layout
        else:
            shapes = [tuple(s.shape) for s in samples.values()]
            device = next(iter(samples.values())).device
            self.layout = Layout([math.prod(shape) for shape in shapes], device)
        # Not zeroed first: each sample is copied in and its loose copy dropped at once, so the
        # pages of the new buffer fill as the loose copies' go (no second copy of every sample
        # at once), and the pads are zeroed after.
        self.buffer = self.layout.buffer([tuple(s.shape) for s in samples.values()], zeros=False)
        self.stats = self.layout.stats(self.rows)
        self.index = {name: i for i, name in enumerate(samples)}
        self._slots = dict(zip(samples, self.buffer.views))
        for name in list(samples):
            self._slots[name].copy_(samples.pop(name))
            self._loose.pop(name, None)
        zero_pads_(self.buffer, self.layout)
