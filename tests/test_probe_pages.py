"""Huge pages for the probe's fresh host buffers (probe/pages.py): asked for only on a host
storage of at least MIN_BYTES, only on its own whole 2 MiB pages, and a buffer grown again
(blocks.regrow_) keeps its values' meaning: writes and reads are those of any tensor."""

from __future__ import annotations

import sys

import pytest
import torch

from gradrepro.probe import blocks, pages


def test_small_storages_are_left_alone():
    assert pages.advise_huge_pages(torch.empty(1000).untyped_storage()) is False


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="madvise is Linux's")
def test_a_large_host_storage_is_advised_and_still_holds_what_is_written():
    t = torch.empty(pages.MIN_BYTES // 4 + 12345)
    assert pages.advise_huge_pages(t.untyped_storage()) is True
    t.copy_(torch.arange(t.numel(), dtype=torch.float32))
    assert t[-1].item() == t.numel() - 1 and t[0].item() == 0


def test_a_regrown_buffer_is_advised_and_written_like_any_other(monkeypatch):
    seen = []
    monkeypatch.setattr(blocks, "advise_huge_pages", lambda s: seen.append(s.nbytes()) or True)
    t = torch.ones(pages.MIN_BYTES // 4)
    blocks.release_(t)
    blocks.regrow_(t)  # fresh memory: advised once
    blocks.regrow_(t)  # already grown: nothing to advise
    assert seen == [pages.MIN_BYTES]
    t.fill_(2.0)
    assert float(t.sum()) == 2.0 * t.numel()
