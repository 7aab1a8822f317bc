"""A model whose unregistered layer or tensor stays behind when ``.to(device)`` moves its
parameters fails at the first forward pass on a GPU. That device mismatch is the bug's symptom
there, so the run records it as its result (status device_mismatch) with diagnose's
``unregistered`` finding on the right name, and the verdict reproduces as on the CPU. Tested
on the CPU with a second device type, ``meta``, for the parameters (the GPU run is in
tests/test_cuda.py)."""

from __future__ import annotations

import contextlib
import io

import pytest
import torch
from conftest import compose_config, read_tables

import gradrepro.train.pipeline as loop
from gradrepro.diagnose.placement import device_mismatch_at_first_forward, unmoved_tensors
from gradrepro.models.missing_grad import MissingGradCase, MissingGradConfig

CASES = {"unregistered_list": "blocks.0", "tensor_attribute": "scale"}


@pytest.mark.parametrize("cause, name", CASES.items())
def test_to_leaves_the_unregistered_tensor_behind_and_the_forward_fails(cause, name):
    for repaired in (False, True):
        net = MissingGradCase(MissingGradConfig(cause=cause, repaired=repaired, in_dim=64, num_classes=10))
        net.to("meta")
        unmoved = unmoved_tensors(net)
        assert unmoved == ({} if repaired else {name: torch.device("cpu")})

        def forward(net=net):
            net(torch.zeros(2, 64, device="meta"))

        mismatch = device_mismatch_at_first_forward(net, forward)
        assert (mismatch is None) is repaired
        if mismatch is not None:
            assert mismatch.tensors == [name] and mismatch.device == "meta" and mismatch.error


def test_other_forward_failures_are_not_taken_for_a_mismatch():
    net = MissingGradCase(MissingGradConfig(cause="healthy", in_dim=64, num_classes=10))

    def forward():
        raise RuntimeError("mat1 and mat2 shapes cannot be multiplied")

    with pytest.raises(RuntimeError, match="shapes"):
        device_mismatch_at_first_forward(net, forward)


@pytest.mark.parametrize("cause, name", CASES.items())
def test_a_device_mismatch_is_a_recorded_result_and_the_verdict_reproduces(cause, name, tmp_path, monkeypatch):
    # The data and the registered parameters go to "meta"; what .to() does not move stays on the CPU.
    monkeypatch.setattr(loop, "resolve_device", lambda name: torch.device("meta"))
    cfg = compose_config([f"experiment=missing_grad/{cause}", "scale=tiny"])
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        loop.run(cfg, tmp_path / "run")
    summary, scalars, _ = read_tables(tmp_path / "run")
    assert summary["status"] == "device_mismatch" and summary["steps"] == 0
    assert summary["constants"]["device_mismatch"] == 1.0
    assert summary["device_mismatch"]["tensors"] == [name]
    assert summary["device_mismatch"]["held_on"] == ["cpu"] and summary["device_mismatch"]["device"] == "meta"
    assert summary["reproduced"], summary["checks"]
    assert scalars["expected_found"].iloc[-1] == 1 and scalars["unexpected_findings"].iloc[-1] == 0
    assert f"device mismatch at the first forward pass: {name} stayed on cpu" in out.getvalue()
