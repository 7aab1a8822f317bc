"""Healthy real architectures (``tests/zoo.py``: torchvision, one model per timm family,
Hugging Face from tiny configs; nothing downloaded), each trained a few correct steps under
``gradrepro.record(every=1)`` and given to ``gradrepro.diagnose``: no warning, no error, no
crash. A few in the default run; the whole zoo under ``-m slow``
(``benchmarks/zoo_score.py`` counts the same per half)."""

from __future__ import annotations

import pytest
import torch
import zoo

# One of each kind the default run can afford: a BatchNorm CNN, a depthwise CNN with
# LayerScale, a causal LM, an encoder with a pooler, a mixture of experts, an encoder-decoder.
QUICK = ("tv/resnet18", "timm/convnext_atto", "hf/gpt2", "hf/bert_cls", "hf/mixtral", "hf/t5")
ENTRIES = zoo.entries()


@pytest.fixture(autouse=True)
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def check(name: str) -> None:
    out = zoo.run(ENTRIES[name])
    if out.unfit:
        pytest.skip(f"{name} does not run at this size without gradrepro either: {out.unfit}")
    assert not out.crash, out.crash
    assert not out.flagged, "\n".join(f"[{s}] {src} {k} {t}: {d}" for src, s, k, t, d in out.flagged)


@pytest.mark.parametrize("name", QUICK)
def test_healthy_model_gets_no_warning(name):
    check(name)


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(set(ENTRIES) - set(QUICK)))
def test_healthy_zoo_model_gets_no_warning(name):
    check(name)


def test_the_halves_split_the_zoo_by_name_alone():
    halves = {name: zoo.half(name) for name in ENTRIES}
    assert set(halves.values()) == {"design", "scored"}
    assert halves == {name: zoo.half(name) for name in sorted(ENTRIES)}  # no dependence on order
