"""The hooks' samples of one logged step, reduced a fixed-size window at a time as the hooks
deliver them: a hook costs one copy (and the slice that takes ``act_sample`` examples) into
the window buffer, and a window is reduced as soon as the samples have moved past it, so the
step holds at most one window of samples (``SAMPLE_WINDOW_BLOCKS`` blocks, 32 MiB in float32),
not a copy of every hooked output, whatever the model.

The window's memory is what has arrived: its storage starts empty in each window and grows
(doubling, up to the blocks the last step's samples took there) as the samples come, so what
it holds at the training's peak (early in backward, where the output gradients are the first
few) is those samples, not the window's size. Growing keeps the views (the storage is resized,
as ``blocks.release_`` shrinks it), so a hook still costs one copy; the pads of a window's
partial blocks are zeroed when it is reduced.

The samples are laid out in the order the hooks deliver them, each from a block boundary, as
one layout of blocks (``blocks.Layout``): the per-block rows are those a whole-layout buffer
would give (the same entries in the same blocks), and the host sums them by segment as before.
Where a step delivers the same modules with the same shapes in the same order as the last one
(the usual case), every target view and every window's pads are the last step's; from the
first sample that differs (another batch size, a module seen for the first time, another
order) the rest of the step is laid out anew.
"""

from __future__ import annotations

import math
from types import SimpleNamespace
from typing import Callable, Dict, List, Optional, Tuple

import numpy as np
import torch

from gradrepro.probe.blocks import BLOCK, Layout, Rows, StatRows, Stats, pad_index, regrow_, release_, zero_pads_

Reduce = Callable[[Rows, object, StatRows], None]

# Blocks of the samples' window: 8 Mi entries, 32 MiB in float32, whatever the model (the output
# gradients' stash takes half: probe.py). Larger than the gradients' window (blocks.WINDOW_BLOCKS)
# because every window costs the same fixed passes and a logged step must dispatch no more
# operations than the bare step: at 8 MiB resnet18's samples at a batch of 9 took 5 windows per
# stash and 547 operations against the bare step's 480; at 32 MiB, 2 windows and 451; with the
# output gradients' at 16 MiB, 3 of those and 467 (tests/test_benchmark.py).
SAMPLE_WINDOW_BLOCKS = 4096


class _Segment:
    """One sample of the step: where its entries go (``pieces``: per window it reaches, the
    target view, its first entry in the sample and its length, whether it is the whole, and
    the window's entries up to the end of its last block)."""

    def __init__(self, name: str, shape: Tuple[int, ...], first: int, pieces: list) -> None:
        self.name, self.shape, self.first, self.pieces = name, shape, first, pieces
        self.numel = math.prod(shape)
        self.blocks = -(-self.numel // BLOCK)
        self.real = _block_entries(self.numel)  # entries of each of its blocks


class _Window:
    """What ``blocks.moments_`` reads of a window's blocks: entries per block and the pads."""

    def __init__(self, real: np.ndarray, arange: torch.Tensor) -> None:
        self.real = real
        self.real_t = torch.tensor(real, dtype=torch.float32, device=arange.device)
        # arange: the stash's one row 0..BLOCK-1
        self.partial, self.tail, self.arange = pad_index(real, np.flatnonzero(real < BLOCK), BLOCK,
                                                         arange.device, arange)


class Stash:
    """Per module name, one float32 sample a hook saw this step, and a value beside it;
    reduced by ``reduce(work, window, rows)`` a window at a time."""

    def __init__(self, rows, reduce: Reduce, window_blocks: Callable[[], int], grow_at_once: bool = False) -> None:
        self.rows = rows  # the per-block statistics the probe reduces this stash to
        # True: a window whose size the last step gave grows to it with its first sample, not by
        # doubling (each doubling copies what the window holds): for samples taken where the
        # training's memory is still growing toward its peak anyway (the forward pass).
        self._grow_at_once = grow_at_once
        self._known = False  # the open window's size is the last step's
        self._reduce = reduce
        self._window_blocks = window_blocks
        self.layout: Optional[Layout] = None  # the settled step's, for the host's sums
        self.index: Dict[str, int] = {}  # module name -> segment of the layout
        self.seen: Dict[str, float] = {}  # modules recorded this step, with their value
        self.closed = True  # reduced (or no logged step begun): no sample is taken
        self.stats: Optional[Stats] = None  # rows x capacity blocks; a step uses the first ``blocks``
        self.blocks = 0
        self._segments: List[_Segment] = []  # the last step's, reused while this one matches
        self._cursor = 0
        # At most one window of blocks x BLOCK, float32: its storage holds the open window's
        # samples so far (``_hold``), and no bytes between windows and between logged steps.
        self._buffer: Optional[torch.Tensor] = None
        self._window_size = 0
        self._open = -1  # the window the samples are filling
        self._cap = 0  # bytes the open window's storage grows to by doubling: its blocks in the last step
        self._windows: Dict[int, _Window] = {}
        self._real: List[np.ndarray] = []  # per segment, its blocks' entries (this step)
        self._work: Dict[int, Rows] = {}  # the first n rows of the buffer, per n
        self._rows_of: Dict[Tuple[int, int], StatRows] = {}
        self._last_blocks = 0  # the last step's: this step's rows are made that size
        self._take: Dict[int, torch.Tensor] = {}  # the first n examples' indices, per n

    # -- the step ---------------------------------------------------------------------------
    def begin(self) -> None:
        self.seen.clear()
        self.index = {}
        self.closed = False
        self._cursor, self.blocks, self._open = 0, 0, -1
        self._real = []
        if self.stats is not None:
            if self.stats.data.shape[1] != self._last_blocks:  # as many rows as the last step's blocks
                self._new_stats(self._last_blocks, self.stats.data.device)
            regrow_(self.stats.data)  # every row of every block a step reaches is written by its reduction

    def __contains__(self, name: str) -> bool:
        return name in self.seen

    def put(self, name: str, tensor: torch.Tensor, value: float = math.nan, take: Optional[int] = None) -> None:
        """Copy the sample, ``tensor`` or its first ``take`` examples, into the window buffer
        (one operation; a piece per window where it spans several), reducing the windows it
        moves past. Nothing once the stash is reduced (a forward pass that backward reruns:
        activation checkpointing)."""
        if self.closed:
            return
        if take is not None and tensor.dim() and tensor.shape[0] > take:
            shape = (take,) + tuple(tensor.shape[1:])
        else:
            take, shape = None, tuple(tensor.shape)
        segment = self._segment_for(name, shape, tensor.device)
        self.index[name] = self._cursor
        self.seen[name] = value
        self._cursor += 1
        self.blocks = segment.first + segment.blocks
        self._real.append(segment.real)
        sample = None
        for window, target, begin, length, whole, end in segment.pieces:
            if window != self._open:
                self._flush()
                self._enter(window)
            self._hold(end)
            if take is not None and whole and tensor.dtype == target.dtype and tensor.device == target.device:
                # The first examples gathered straight into the window: one operation, not a
                # slice and a copy (the same values: a gather of whole examples is a copy).
                torch.index_select(tensor, 0, self._first(take), out=target)
                continue
            if sample is None:
                sample = tensor[:take] if take is not None else tensor
            target.copy_(sample if whole else sample.reshape(-1).narrow(0, begin, length))

    def _first(self, take: int) -> torch.Tensor:
        """The indices 0 .. take - 1 on the window's device (made once per size)."""
        index = self._take.get(take)
        if index is None or index.device != self._buffer.device:
            index = self._take[take] = torch.arange(take, device=self._buffer.device)
        return index

    def settle(self) -> bool:
        """After the last sample: the open window reduced and the step's layout for the host.
        False when there is none."""
        self.closed = True
        if not self.seen:
            return False
        self._flush()
        self._last_blocks = self.blocks
        del self._segments[self._cursor:]
        numels = [s.numel for s in self._segments]
        if self.layout is None or list(self.layout.numel) != numels:
            self.layout = Layout(numels, None)  # host arrays only (segment, real, sums)
        return True

    def result(self) -> torch.Tensor:
        """The step's per-block rows (the device side of the one transfer)."""
        data = self.stats.data
        return data if data.shape[1] == self.blocks else data[:, : self.blocks]

    def part(self):
        """``result`` as a part of the one transfer (``kernels.to_host``): the rows' flat view
        made once, where the step filled them all (the usual case: no view on each step)."""
        return self.stats.part() if self.stats.data.shape[1] == self.blocks else self.result()

    def release_buffer(self) -> None:
        """The samples are reduced: hand back the window's memory."""
        self.closed = True
        if self._buffer is not None:
            release_(self._buffer)

    def release(self) -> None:
        self.release_buffer()
        if self.stats is not None:
            self.stats.release()

    # -- laying the samples out -------------------------------------------------------------
    def _segment_for(self, name: str, shape: Tuple[int, ...], device: torch.device) -> _Segment:
        i = self._cursor
        if i == 0:  # the window on the first sample's device (a later one on another is copied across)
            size = self._window_blocks()
            if self._buffer is None or self._buffer.device != device or self._window_size != size:
                self._new_buffer(size, device)
                self.stats = None
        device = self._buffer.device
        if i < len(self._segments) and self._segments[i].name == name and self._segments[i].shape == shape:
            return self._segments[i]
        del self._segments[i:]  # the last step's layout holds no longer from here
        first = self.blocks
        segment = _Segment(name, shape, first, self._pieces(first, shape))
        self._segments.append(segment)
        self._ensure_capacity(first + segment.blocks, device)
        return segment

    def _new_buffer(self, size: int, device: torch.device) -> None:
        self._buffer = torch.empty(0, dtype=torch.float32, device=device)  # no bytes until samples arrive
        self._arange = torch.arange(BLOCK, dtype=torch.float32, device=device).view(1, BLOCK)
        self._window_size, self._segments, self._windows, self._work = size, [], {}, {}

    def _hold(self, entries: int) -> None:
        """The storage grown to hold the open window's first ``entries`` (doubling up to the
        window's blocks in the last step, ``_cap``): resized in place, so every view stays."""
        storage = self._buffer.untyped_storage()
        need, have = entries * self._buffer.element_size(), storage.nbytes()
        if have < need:
            storage.resize_(max(need, self._cap if self._grow_at_once and self._known else min(self._cap, 2 * have)))

    def _base(self, entries: int) -> torch.Tensor:
        """The buffer as a tensor of at least ``entries``, to make views of (a view is checked
        against the storage when it is made, not when the storage is resized later)."""
        self._hold(entries)
        storage = self._buffer.untyped_storage()
        if self._buffer.numel() < entries:
            self._buffer.set_(storage, 0, (storage.nbytes() // self._buffer.element_size(),), (1,))
        return self._buffer

    def _pieces(self, first: int, shape: Tuple[int, ...]) -> list:
        numel, size = math.prod(shape), self._window_size
        count = -(-numel // BLOCK)
        pieces = []
        for window in range(first // size, (first + count - 1) // size + 1 if count else first // size):
            lo, hi = max(first, window * size), min(first + count, (window + 1) * size)
            begin = (lo - first) * BLOCK
            length = min(numel - begin, (hi - lo) * BLOCK)
            whole = begin == 0 and length == numel
            end = (hi - window * size) * BLOCK
            target = self._base(end).narrow(0, (lo - window * size) * BLOCK, length)
            pieces.append((window, target.view(shape) if whole else target, begin, length, whole, end))
        return pieces

    def _ensure_capacity(self, blocks: int, device: torch.device) -> None:
        old = self.stats
        if old is not None and old.data.shape[1] >= blocks:
            return
        self._new_stats(max(blocks, 2 * (old.data.shape[1] if old is not None else 0)), device)
        if old is not None and self.blocks:
            self.stats.data[:, : self.blocks].copy_(old.data[:, : self.blocks])  # the windows already reduced

    def _new_stats(self, blocks: int, device: torch.device) -> None:
        self.stats = Stats(SimpleNamespace(blocks=blocks, device=device), self.rows, torch.float32)
        self._rows_of = {}

    # -- reducing a window ------------------------------------------------------------------
    def _enter(self, w: int) -> None:
        """The samples move on to window ``w``: the last window's samples are reduced, so its
        storage goes, and this one's grows as they come, up to its blocks in the last step."""
        release_(self._buffer)
        self._open = w
        known = self._windows.get(w)
        self._known = known is not None
        rows = len(known.real) if known is not None else self._window_size
        self._cap = rows * BLOCK * self._buffer.element_size()

    def _work_rows(self, rows: int) -> Rows:
        work = self._work.get(rows)
        if work is None:
            work = self._work[rows] = Rows(self._base(rows * BLOCK).narrow(0, 0, rows * BLOCK).view(rows, BLOCK))
        return work

    def _flush(self) -> None:
        """Reduce the open window: its blocks are those laid out so far past its start."""
        w = self._open
        if w < 0:
            return
        self._open = -1
        size = self._window_size
        start, stop = w * size, min((w + 1) * size, self.blocks)
        real = np.concatenate(self._real)[start:stop] if len(self._real) > 1 else self._real[0][start:stop]
        window = self._windows.get(w)
        work = self._work_rows(stop - start)
        if window is None or not np.array_equal(window.real, real):
            window = self._windows[w] = _Window(real, self._arange)
        zero_pads_(work, window)  # the pads of its partial blocks: never written, in memory just grown
        self._reduce(work, window, self._rows(start, stop))

    def _rows(self, start: int, stop: int) -> StatRows:
        key = (start, stop)
        rows = self._rows_of.get(key)
        if rows is None:
            rows = self._rows_of[key] = StatRows(self.stats, start, stop)
        return rows


def _block_entries(numel: int) -> np.ndarray:
    count = -(-numel // BLOCK)
    real = np.full(count, float(BLOCK))
    if count:
        real[-1] = numel - (count - 1) * BLOCK
    return real
