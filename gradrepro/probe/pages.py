"""Fresh host memory in huge pages. A probe buffer grown again on a logged step
(``blocks.regrow_``) is memory the process has not touched since it handed it back, and on
Linux its first touch faults one 4 KiB page at a time, each zeroed by the kernel: on the
2-core benchmark machine that cost more than the pass that touched it (benchmarks/README.md,
"Fewer passes on a logged step"). Asking for transparent huge pages on the buffer
(``madvise(MADV_HUGEPAGE)``, what PyTorch itself does for every CPU tensor under
``THP_MEM_ALLOC_ENABLE=1``) faults 2 MiB at a time. Only the buffer's own whole 2 MiB pages
are advised; nothing is done off Linux, where the call is missing, or where the kernel's
setting is ``never`` (the call then changes nothing)."""

from __future__ import annotations

import ctypes
import sys
from typing import Callable, Optional

import torch

HUGE_PAGE = 1 << 21  # 2 MiB, x86-64's and arm64's (4 KiB base pages) transparent huge page
MADV_HUGEPAGE = 14  # linux/mman.h
MIN_BYTES = 4 * HUGE_PAGE  # smaller buffers fault few pages: not worth a system call


def _madvise() -> Optional[Callable[[int, int, int], int]]:
    if not sys.platform.startswith("linux"):
        return None
    try:
        fn = ctypes.CDLL(None, use_errno=True).madvise
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    fn.restype = ctypes.c_int
    return fn


_MADVISE = _madvise()


def advise_huge_pages(storage: torch.UntypedStorage) -> bool:
    """Ask for huge pages on a host storage's whole 2 MiB pages, before anything touches
    them; True when the kernel accepted the request (it may still use small pages)."""
    if _MADVISE is None or storage.device.type != "cpu" or storage.nbytes() < MIN_BYTES:
        return False
    start = storage.data_ptr()
    first = (start + HUGE_PAGE - 1) & ~(HUGE_PAGE - 1)
    end = (start + storage.nbytes()) & ~(HUGE_PAGE - 1)
    return end > first and _MADVISE(first, end - first, MADV_HUGEPAGE) == 0
