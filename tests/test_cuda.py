"""On a CUDA GPU (``pytest -m cuda``; skipped without one, and left out of the default run):
every experiment with device=cuda gives the verdict it gives on the CPU at seed 0, the fp16
failures reproduce under real CUDA autocast, and the SimSiam pair holds at CIFAR scale
(scale=cifar: ResNet-18, batch 512, SimSiam's CIFAR-10 recipe) on the shipped synthetic data."""

from __future__ import annotations

import pytest
import torch
from conftest import composed, experiment_names

pytestmark = [pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

# Unregistered tensors stay on the CPU when .to("cuda") moves the parameters: on a GPU these
# cases end at the first forward pass with a device mismatch, recorded as their result.
DEVICE_MISMATCH = {"missing_grad/unregistered_list", "missing_grad/tensor_attribute"}


def assert_reproduced_on_cuda(result, status: str = "completed") -> None:
    assert result.returncode == 0, result.stderr[-3000:]
    summary = result.summary
    assert summary["device"].startswith("cuda"), summary["device"]
    assert summary["status"] == status, summary.get("error")
    assert summary["reproduced"], summary["checks"]


@pytest.mark.parametrize("name", experiment_names())
def test_every_experiment_gives_its_cpu_verdict_on_cuda(cli, name):
    processes = composed(name).distributed.processes
    if processes > torch.cuda.device_count():  # NCCL: one GPU per process
        pytest.skip(f"{name} runs {processes} processes: needs {processes} GPUs")
    result = cli(f"experiment={name}", "device=cuda", "seed=0", timeout=3600)
    assert_reproduced_on_cuda(result, "device_mismatch" if name in DEVICE_MISMATCH else "completed")


@pytest.mark.parametrize("name", ["precision_fp16_noscale", "precision_fp16_scale8", "precision_fp16_dynamic"])
def test_the_fp16_failures_reproduce_under_real_cuda_autocast(cli, name):
    result = cli(f"experiment={name}", "device=cuda", "precision.mode=fp16", timeout=1800)
    assert_reproduced_on_cuda(result)
    for reference in result.summary["references"].values():  # the fp32 reference stays fp32
        assert "precision.mode=fp16" not in reference["overrides"]


@pytest.mark.parametrize("name", ["simsiam_baseline", "simsiam_nostopgrad"])
def test_the_simsiam_pair_holds_at_cifar_scale(cli, name):
    result = cli(f"experiment={name}", "scale=cifar", "device=cuda", timeout=3600)
    assert_reproduced_on_cuda(result)
    print(f"{name} at scale=cifar: wall_s {result.summary['wall_s']}")
