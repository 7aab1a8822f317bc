"""Many tensors as one flat buffer of fixed-size blocks, reduced a block at a time.

Each tensor (a *segment*) starts at a block boundary and the rest of its last block is zero
padding, so the buffer is a ``(blocks, BLOCK)`` matrix: one reduction along its rows gives a
statistic for every block of every tensor at once, and a per-block value broadcasts back
with a ``(blocks, 1)`` column. A logged step therefore costs a fixed number of operations
whatever the number of tensors (``torch.sum(dim=1)``, ``linalg.vector_norm(dim=1)``,
in-place element-wise passes), all on the device. The per-block rows go to the host in the
probe's one transfer, where float64 sums by segment (``np.bincount``) finish the statistics.

Numerics (tested in tests/test_probe_kernels.py):
- Sums of squares are kept twice per block, of ``x`` and of ``x`` times 2^100 (or 2^-100),
  and the host picks one per block (``kernels.squares_from_norms``): gradients of 1e-30 get
  their true norm on any device, also beside entries of 1 in the same tensor.
- Spreads are two-pass: each block is centred on its own float32 mean ``c`` and keeps
  ``sum(x - c)`` beside ``sum((x - c)^2)``; the host combines blocks with the pairwise
  (Chan et al. 1979) update, so a large mean over a tiny spread (a collapsed layer) is exact.
- Zero and fp16-flush counts come from levels 0/1/2 (``kernels.levels_``): per block the sum
  of levels and their norm are integers below 2^13 and 2^15, exact in float32.
"""

from __future__ import annotations

from typing import Dict, List, Optional, Sequence, Tuple

import numpy as np
import torch

from gradrepro.probe.kernels import (
    SCALE_DOWN,
    SCALE_UP,
    counts_from_level_sums,
    hi_usable,
    levels_,
    lo_scale,
    squares_from_norms,
)

BLOCK = 2048

MOMENT_ROWS = ("sum", "centre", "dsum", "hi", "lo")  # per block: sum, c, sum(x - c), |x - c| twice
SQUARE_ROWS = ("hi", "lo")  # per block: |x|, |x * 2^100|
LEVEL_ROWS = ("l1", "l2")  # per block: sum of levels, norm of levels
COUNT_ROWS = ("nonzero", "flushed")  # per block: entries not zero, entries fp16 holds as zero (pads included)


class Layout:
    """Where each segment's entries sit in a block buffer; host arrays for the float64 sums."""

    def __init__(self, numels: Sequence[int], device: Optional[torch.device], block: Optional[int] = None) -> None:
        """``device`` None: the host arrays alone (a stash's layout, whose windows have their own)."""
        block = block or BLOCK
        self.block, self.device = block, torch.device(device) if device is not None else None
        self.numel = np.asarray(numels, dtype=np.int64).reshape(-1)
        count = -(-self.numel // block)  # blocks per segment (0 for an empty tensor)
        self.first = np.concatenate([[0], np.cumsum(count)[:-1]]).astype(np.int64)
        self.blocks = int(count.sum())
        self.segment = np.repeat(np.arange(len(self.numel)), count)  # segment of each block
        real = np.full(self.blocks, float(block))
        last = (self.first + count - 1)[count > 0]
        real[last] = (self.numel - (count - 1) * block)[count > 0]
        self.real = real  # entries of each block that belong to its segment
        if device is not None:
            self.real_t = torch.tensor(real, dtype=torch.float32, device=self.device)
            self.partial, self.tail, self.arange = pad_index(real, last[real[last] < block], block, self.device)

    def windows(self, shapes, dtype=torch.float32, blocks: Optional[int] = None) -> "Windows":
        return Windows(self, shapes, dtype, blocks or WINDOW_BLOCKS)

    def buffer(self, shapes: Sequence[Tuple[int, ...]], dtype=torch.float32, zeros: bool = True,
               device: Optional[torch.device] = None) -> "Buffer":
        return Buffer(self, shapes, dtype, zeros, device)

    def stats(self, rows: Sequence[str], dtype=torch.float32) -> "Stats":
        return Stats(self, rows, dtype)

    def segment_sum(self, per_block: np.ndarray) -> np.ndarray:
        """float64 sums of per-block values by segment (an empty segment sums to 0)."""
        return np.bincount(self.segment, weights=per_block, minlength=len(self.numel))


class Buffer:
    """One flat zero-padded buffer of a layout: ``grid`` (blocks x BLOCK) and, per segment, a
    view of the given shape (the copy target for that tensor)."""

    def __init__(self, layout: Layout, shapes: Sequence[Tuple[int, ...]], dtype, zeros: bool = True,
                 device: Optional[torch.device] = None) -> None:
        make = torch.zeros if zeros else torch.empty  # empty: the caller writes every entry and pad
        # ``device``: the host, for a layout on a GPU, pinned (its copies run asynchronously,
        # in order with the device's work on the current stream).
        device = torch.device(device) if device is not None else layout.device
        pin = device.type == "cpu" and layout.device.type == "cuda"
        self.flat = make(layout.blocks * layout.block, dtype=dtype, device=device, pin_memory=pin)
        self.grid = self.flat.view(layout.blocks, layout.block)
        self.views: List[torch.Tensor] = [
            self.flat.narrow(0, int(f) * layout.block, int(n)).view(shape)
            for f, n, shape in zip(layout.first, layout.numel, shapes)]


    def release(self) -> None:
        release_(self.flat)

    def regrow(self) -> None:
        """The memory back (its contents undefined: pads included); the views hold again."""
        regrow_(self.flat)


class Stats:
    """Named per-block rows of one tensor (the device side of the one transfer)."""

    def __init__(self, layout: Layout, rows: Sequence[str], dtype) -> None:
        self.data = torch.zeros(len(rows), layout.blocks, dtype=dtype, device=layout.device)
        self.flat = self.data.view(-1)  # made once: the transfer takes it without a view per step
        self.row: Dict[str, torch.Tensor] = {name: self.data[i] for i, name in enumerate(rows)}
        self.column = {name: r.view(-1, 1) for name, r in self.row.items()}  # broadcast views
        self.names = tuple(rows)
        self.scales = tuple(torch.tensor(s, dtype=dtype, device=layout.device)
                            for s in (SCALE_UP, SCALE_DOWN))

    def part(self) -> tuple:
        """The rows as a part of the one transfer (``kernels.to_host``)."""
        return self.flat, tuple(self.data.shape)

    def release(self) -> None:
        release_(self.data)

    def regrow(self) -> None:
        """The memory back, zeroed (rows of segments a step does not reach read as zeros)."""
        regrow_(self.data)
        self.data.zero_()


# -- memory between logged steps: none ----------------------------------------------------
#
# A buffer's memory is handed back after each logged step by shrinking its storage to 0 bytes
# and grown again on the next (``untyped_storage().resize_``, as FSDP2 frees unsharded
# parameters): the views into it stay valid objects, so no view is made anew on a logged step
# (each would be one more operation) and nothing of the buffer is held in between.


def release_(t: torch.Tensor) -> None:
    storage = t.untyped_storage()
    if storage.nbytes():
        storage.resize_(0)


def regrow_(t: torch.Tensor) -> None:
    storage = t.untyped_storage()
    need = (t.storage_offset() + t.numel()) * t.element_size()
    if storage.nbytes() < need:
        storage.resize_(need)


def pad_index(real: np.ndarray, partial: np.ndarray, block: int, device: torch.device,
          arange: Optional[torch.Tensor] = None):
    """The blocks with padding (each segment's last, unless it is full) as a device index, and
    per such block its entries as a column: ``arange < tail`` is its mask (made on use, so
    that a layout keeps a few bytes per segment, not a row of BLOCK per segment). ``arange``:
    a row 0..block-1 to share (one per stash, not one per window)."""
    if arange is None:
        arange = torch.arange(block, dtype=torch.float32, device=device).view(1, block)
    if not len(partial):
        return None, None, arange
    tail = torch.tensor(real[partial], dtype=torch.float32, device=device).view(-1, 1)
    return torch.tensor(partial, dtype=torch.int64, device=device), tail, arange


# -- fixed-size windows: a layout's blocks reduced a window at a time ------------------------

# Blocks of a window: 2 Mi entries, 8 MiB in float32 (16 MiB in float64), whatever the model.
WINDOW_BLOCKS = 1024


class Rows:
    """Rows ``[start, stop)`` of a buffer (or of a window's buffer): ``flat`` and ``grid``."""

    def __init__(self, grid: torch.Tensor) -> None:
        self.grid = grid
        self.flat = grid.view(-1)


class Part:
    """One window: its blocks of the layout, where each segment's piece of it sits in the
    window's buffer, and what ``moments_`` and ``zero_pads_`` need of the layout there."""

    def __init__(self, layout: Layout, shapes, start: int, stop: int, buffer: torch.Tensor) -> None:
        block = layout.block
        self.start, self.stop = start, stop
        self.work = Rows(buffer.view(-1, block)[: stop - start])
        self.real_t = layout.real_t[start:stop]
        last = layout.first + np.maximum(-(-layout.numel // block), 1) - 1
        partial = np.flatnonzero(layout.real[start:stop] < block)
        self.partial, self.tail, _ = pad_index(layout.real[start:stop], partial, block, layout.device)
        self.arange = layout.arange
        self.pieces: List[Tuple[int, int, int, torch.Tensor, bool]] = []
        for i, (first, numel) in enumerate(zip(layout.first, layout.numel)):
            lo, hi = max(int(first), start), min(int(last[i]) + 1, stop)
            if numel == 0 or lo >= hi:
                continue
            begin = (lo - int(first)) * block
            length = min(int(numel) - begin, (hi - lo) * block)
            whole = begin == 0 and length == numel
            target = self.work.flat.narrow(0, (lo - start) * block, length)
            self.pieces.append((i, begin, length, target.view(shapes[i]) if whole else target, whole))


class Windows:
    """A layout reduced ``blocks`` blocks at a time in one buffer of that size: the copies in
    and the block passes of ``moments_``, ``squares`` and ``level_sums_`` run per window, and
    each window's per-block rows land in the layout's ``Stats`` rows of its blocks. The same
    passes on the same blocks give the same per-block values as one whole-layout buffer."""

    def __init__(self, layout: Layout, shapes, dtype, blocks: int) -> None:
        self.layout = layout
        rows = min(blocks, layout.blocks)
        self.buffer = torch.empty(rows * layout.block, dtype=dtype, device=layout.device)
        spans = [(b, min(b + blocks, layout.blocks)) for b in range(0, layout.blocks, blocks)] or [(0, 0)]
        self.parts = [Part(layout, shapes, a, b, self.buffer) for a, b in spans]
        self._rows: Dict[int, tuple] = {}

    def release(self) -> None:
        release_(self.buffer)

    def regrow(self) -> None:
        regrow_(self.buffer)

    def pieces(self, part: Part, tensors: Dict[int, torch.Tensor]):
        """(targets, sources) of one window for the segments in ``tensors`` (segment -> tensor):
        a tensor whose blocks all lie in the window is copied whole, else its piece."""
        targets, sources = [], []
        for i, begin, length, target, whole in part.pieces:
            t = tensors.get(i)
            if t is not None:
                targets.append(target)
                sources.append(t if whole else t.reshape(-1).narrow(0, begin, length))
        return targets, sources

    def rows(self, of) -> list:
        """Per window, the views of ``of`` (a whole-layout ``Buffer`` or ``Stats``) at its
        blocks, made once (views of a released buffer stay valid)."""
        cached = self._rows.get(id(of))
        if cached is None or cached[0] is not of:
            if isinstance(of, Stats):
                views = [StatRows(of, p.start, p.stop) for p in self.parts]
            else:
                views = [Rows(of.grid[p.start:p.stop]) for p in self.parts]
            cached = self._rows[id(of)] = (of, views)
        return cached[1]


class StatRows:
    """Rows of a ``Stats`` at blocks ``[start, stop)``, used as a ``Stats`` by the passes."""

    def __init__(self, stats: Stats, start: int, stop: int) -> None:
        self.row = {name: r[start:stop] for name, r in stats.row.items()}
        self.column = {name: r.view(-1, 1) for name, r in self.row.items()}
        self.names, self.scales = stats.names, stats.scales


# -- device passes (a fixed number of operations each, whatever the number of segments) ----


def moments_(buf: Buffer, layout: Layout, stats: Stats, prefix: str) -> None:
    """Per block: sum, centre ``c``, ``sum(x - c)`` and the two norms of ``x - c`` into
    ``stats`` rows ``prefix + MOMENT_ROWS``. Leaves ``x - c`` scaled by 2^100 in ``buf``
    (pads back to zero)."""
    row, grid = stats.row, buf.grid
    torch.sum(grid, 1, out=row[prefix + "sum"])
    torch.div(row[prefix + "sum"], layout.real_t, out=row[prefix + "centre"])
    grid.sub_(stats.column[prefix + "centre"])
    zero_pads_(buf, layout)
    torch.sum(grid, 1, out=row[prefix + "dsum"])
    squares(grid, stats, prefix, work=grid)


def zero_pads_(buf: Buffer, layout: Layout) -> None:
    """Zero the padding of the blocks that have some: whole rows, which copy as a unit (an
    index per padding entry is several passes' worth on CPU), filled with 0 past their
    entries (a fill, not a product: a pad of memory just grown may hold NaN)."""
    if layout.partial is not None:
        grid = buf.grid
        rows = grid.index_select(0, layout.partial).masked_fill_(layout.arange >= layout.tail, 0.0)
        grid.index_copy_(0, layout.partial, rows)


def squares(grid: torch.Tensor, stats: Stats, prefix: str, work: torch.Tensor) -> bool:
    """Per block, the norms of ``x`` and of ``x * kernels.lo_scale(that norm)`` into rows
    ``prefix + "hi"``, ``"lo"``. On a GPU the scaled copy goes to ``work`` (which may be
    ``grid`` itself) for every block: no host wait. On the CPU the host reads ``hi`` at no
    cost, so only the blocks whose sum of squares the host takes from ``lo``
    (``kernels.squares_from_norms``) are scaled, in a copy of their rows; the others' ``lo``
    is 0 (never read) and ``work`` is left as it was: two passes over the buffer fewer, the
    same values where ``lo`` is read. True when ``work`` was written."""
    hi, lo = stats.row[prefix + "hi"], stats.row[prefix + "lo"]
    torch.linalg.vector_norm(grid, dim=1, out=hi)
    if not host_path(grid) or grid.dtype not in _NUMPY_DTYPE:
        torch.mul(grid, lo_scale(stats.column[prefix + "hi"], *stats.scales), out=work)
        torch.linalg.vector_norm(work, dim=1, out=lo)
        return True
    lo.zero_()
    # tolist, not numpy(): a storage numpy has seen can no longer be handed back (release_).
    host_hi = np.asarray(hi.tolist(), dtype=np.float64)
    need = lo_needed(host_hi, grid.shape[1])
    if need.size:  # the scale as the device path takes it (exact powers of two), made on the host
        scale = torch.from_numpy(lo_scale(host_hi[need]).astype(_NUMPY_DTYPE[grid.dtype]).reshape(-1, 1))
        index = torch.from_numpy(need)
        rows = grid.index_select(0, index).mul_(scale)
        lo.index_copy_(0, index, torch.linalg.vector_norm(rows, dim=1))
    return False


_NUMPY_DTYPE = {torch.float32: np.float32, torch.float64: np.float64}

# The host's own passes, where they differ from a device's: sums of squares whose plain norms
# the host reads (``squares``), and fresh buffers zeroed only where no copy writes
# (reducer._gradient_pass). False: the CPU takes the device's passes
# (benchmarks/overhead.py --ops --device-path counts on the CPU the operations a GPU runs).
HOST_SHORTCUTS = True


def host_path(t: torch.Tensor) -> bool:
    return HOST_SHORTCUTS and t.device.type == "cpu"


def lo_needed(hi: np.ndarray, entries: int) -> np.ndarray:
    """The blocks (of at most ``entries`` entries each) whose sum of squares
    ``squares_from_norms`` may take from the scaled norm: it takes ``hi^2`` where
    ``hi^2 >= numel 2^-100`` and ``hi < 2^60``, the same float64 comparison on the same
    values, and ``numel <= entries`` (a ``hi`` of 0 may be squares that underflowed)."""
    return np.flatnonzero(~hi_usable(hi, entries))


# bf16 keeps 8 significant bits: half a unit in the last place of w is 2^(floor(log2|w|) - 8).
_BF16_HALF_ULP = 2.0**-8
# 2^floor(log2|w|) is w's exponent bits alone (0 for 0 and subnormals): IEEE 754 layouts.
_EXPONENT_BITS = {torch.float32: (torch.int32, 0x7F800000), torch.float64: (torch.int64, 0x7FF0000000000000)}


def bf16_lost_(update: "Rows", work: "Rows", grads: tuple, params: tuple, out: torch.Tensor) -> None:
    """Per block into ``out``: the entries whose gradient is not zero and whose update (in
    ``update``: before - after) is smaller than half a bf16 unit in the last place of the
    weight after the step (bf16 weights keep such an update as zero; where it was applied
    the weight is unchanged, so after is before). ``grads`` and ``params``: (targets in
    ``work``, sources) of the blocks' segments (``Windows.pieces``). A fixed number of passes
    plus two multi-tensor copies; spends both buffers (their contents are left undefined)."""
    flat, w = update.flat, work.flat
    bits, mask = _EXPONENT_BITS[w.dtype]
    huge = torch.finfo(w.dtype).max / 2  # above every threshold: an entry without gradient never counts
    w.zero_()
    if grads[0]:
        torch._foreach_copy_(list(grads[0]), list(grads[1]))
    w.eq_(0).mul_(huge)
    flat.abs_().add_(w)  # |u|, or huge where the gradient is zero (pads included)
    if params[0]:
        torch._foreach_copy_(list(params[0]), list(params[1]))
    w_bits = w.view(bits)
    torch.bitwise_and(w_bits, mask, out=w_bits)  # 2^floor(log2|w|); pads keep huge's
    w.mul_(_BF16_HALF_ULP).sub_(flat).clamp_(min=0).sign_()  # 1 where |u| < half an ulp
    torch.sum(work.grid, 1, out=out)


def level_sums_(grid: torch.Tensor, stats: Stats, prefix: str, nan: bool = True) -> None:
    """Per block, the sum and the norm of the levels of ``|grid|`` (``kernels.levels_``, in
    place: ``grid`` must already hold absolute values) into ``prefix + LEVEL_ROWS``."""
    levels_(grid, nan=nan)
    torch.sum(grid, 1, out=stats.row[prefix + "l1"])
    torch.linalg.vector_norm(grid, dim=1, out=stats.row[prefix + "l2"])


# -- the host side: float64 sums by segment --------------------------------------------


def segment_squares(layout: Layout, rows: Dict[str, np.ndarray], prefix: str) -> np.ndarray:
    """Per segment, the sum of squares of its entries (rows of ``squares``)."""
    return layout.segment_sum(squares_from_norms(rows[prefix + "hi"], rows[prefix + "lo"], layout.real))


def segment_moments(layout: Layout, rows: Dict[str, np.ndarray], prefix: str):
    """Per segment: mean, sum of squared deviations from it, and sum of squares (rows of
    ``moments_``); NaN where a block held NaN or inf."""
    n_b, c, d = layout.real, rows[prefix + "centre"], rows[prefix + "dsum"]
    q = squares_from_norms(rows[prefix + "hi"], rows[prefix + "lo"], n_b)
    with np.errstate(invalid="ignore", divide="ignore", over="ignore"):
        mean_b = c + d / n_b
        ssd_b = np.maximum(q - d * d / n_b, 0.0)
        n = layout.segment_sum(n_b)
        mean = layout.segment_sum(n_b * mean_b) / n
        spread = n_b * (mean_b - mean[layout.segment]) ** 2
        ssd = layout.segment_sum(ssd_b) + layout.segment_sum(spread)
        return mean, ssd, ssd + np.where(n > 0, n * mean * mean, 0.0)  # empty: 0, as a norm


def segment_nonzero_counts(layout: Layout, rows: Dict[str, np.ndarray], prefix: str):
    """Per segment: zero entries, and entries with |x| <= FP16_FLUSH (zeros included), from
    ``COUNT_ROWS`` (the same per-block integers as ``segment_counts`` gives from levels; a
    block's pads are zeros that its flushed count includes)."""
    real = layout.real
    pads = layout.block - real
    return layout.segment_sum(real - rows[prefix + "nonzero"]), layout.segment_sum(rows[prefix + "flushed"] - pads)


def segment_counts(layout: Layout, rows: Dict[str, np.ndarray], prefix: str):
    """Per segment: zero entries, and entries with |x| <= FP16_FLUSH (zeros included)."""
    s1, norm = rows[prefix + "l1"], rows[prefix + "l2"]
    # Pads are zeros of level 0: counting against the block's real entries leaves them out.
    zeros, small = counts_from_level_sums(layout.real, s1, np.rint(norm * norm))
    return layout.segment_sum(zeros), layout.segment_sum(small)
