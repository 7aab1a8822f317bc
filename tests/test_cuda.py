"""On a CUDA GPU (``pytest -m cuda``; skipped without one, and left out of the default run):
every experiment with device=cuda gives the verdict the same experiment gives on the CPU at
the same seed (both runs made by the test), the fp16 experiments under real CUDA autocast give
their emulated path's verdict, the SimSiam pair at CIFAR scale (scale=cifar: ResNet-18, batch
512, SimSiam's CIFAR-10 recipe) on the shipped synthetic data, and the probe's pre-step copy in
pinned host memory: the same records, and the device's peak without a copy of the model.
``benchmarks/cuda_checks.sh`` runs this file and the GPU benchmark in one go."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from conftest import composed, experiment_names

pytestmark = [pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

# Unregistered tensors stay on the CPU when .to("cuda") moves the parameters: on a GPU these
# cases end at the first forward pass with a device mismatch, recorded as their result.
DEVICE_MISMATCH = {"missing_grad/unregistered_list", "missing_grad/tensor_attribute"}


def verdict(result, device: str, status: str = "completed") -> bool:
    assert result.returncode == 0, result.stderr[-3000:]
    summary = result.summary
    assert summary["device"].startswith(device), summary["device"]
    assert summary["status"] == status, summary.get("error")
    return summary["reproduced"]


def checks_shown(result) -> str:
    return "; ".join(f"{c['metric']} {c['observed']:.4g} ({c['role']}, {'ok' if c['ok'] else 'NO'})"
                     for c in result.summary["checks"])


@pytest.mark.parametrize("name", experiment_names())
def test_every_experiment_gives_its_cpu_verdict_on_cuda(cli, name):
    """Not that every experiment reproduces (several empirical ones do not on every seed:
    results/README.md): that the device does not decide it. A mechanism's demonstration must
    hold on both; an empirical verdict that differs between the devices is a finding to read
    (cuDNN's kernels are not bit-reproducible, so a borderline measurement can move)."""
    processes = composed(name).distributed.processes
    if processes > torch.cuda.device_count():  # NCCL: one GPU per process
        pytest.skip(f"{name} runs {processes} processes: needs {processes} GPUs")
    on_cuda = cli(f"experiment={name}", "device=cuda", "seed=0", timeout=3600)
    on_cpu = cli(f"experiment={name}", "device=cpu", "seed=0", timeout=3600)
    cuda_verdict = verdict(on_cuda, "cuda", "device_mismatch" if name in DEVICE_MISMATCH else "completed")
    cpu_verdict = verdict(on_cpu, "cpu")
    print(f"{name}: cpu {cpu_verdict}, cuda {cuda_verdict}; cuda checks: {checks_shown(on_cuda)}")
    if on_cuda.summary["claim_kind"] == "mechanism":
        assert cuda_verdict, checks_shown(on_cuda)
    assert cuda_verdict == cpu_verdict, f"cpu: {checks_shown(on_cpu)} | cuda: {checks_shown(on_cuda)}"


@pytest.mark.parametrize("name", ["precision_fp32", "precision_fp16_noscale", "precision_fp16_scale8",
                                  "precision_fp16_dynamic"])
def test_real_cuda_autocast_gives_the_emulated_verdict(cli, name):
    """The emulation rounds outputs' and weights' gradients to fp16 in an fp32 computation;
    real autocast also runs the forward pass in fp16. Whether the two paths agree is measured."""
    real = cli(f"experiment={name}", "device=cuda", "precision.mode=fp16", "seed=0", timeout=1800)
    emulated = cli(f"experiment={name}", "device=cuda", "seed=0", timeout=1800)
    for reference in real.summary["references"].values():  # the fp32 reference stays fp32
        assert "precision.mode=fp16" not in reference["overrides"]
    print(f"{name}: real autocast {checks_shown(real)} | emulated {checks_shown(emulated)}")
    assert verdict(real, "cuda") == verdict(emulated, "cuda")


# Measured on an H200 (torch 2.11, seed 0, two runs): at the App. D recipe the baseline's linear
# probe stays at chance on the synthetic 32x32 views after 800 steps (gain over its init -0.003
# and +0.005, where >= 0.067 is required), so the pair does not separate at this scale
# (experiments/simsiam.md). Strict: a baseline that learns here is news for the page.
BASELINE_AT_CHANCE = pytest.mark.xfail(strict=True, reason="measured: the baseline does not learn at scale=cifar "
                                       "on the synthetic views in 800 steps (linear-probe gain -0.003, +0.005)")


@pytest.mark.parametrize("name", [pytest.param("simsiam_baseline", marks=BASELINE_AT_CHANCE), "simsiam_nostopgrad"])
def test_the_simsiam_pair_holds_at_cifar_scale(cli, name):
    result = cli(f"experiment={name}", "scale=cifar", "device=cuda", timeout=3600)
    print(f"{name} at scale=cifar: wall_s {result.summary['wall_s']}; {checks_shown(result)}")
    assert verdict(result, "cuda"), checks_shown(result)


def test_the_pre_step_copy_in_host_memory_gives_the_same_records_on_cuda():
    sys.path.insert(0, str(Path(__file__).parent))
    from test_probe_memory import _columns_of_a_run, assert_same_columns

    for bf16 in (False, True):
        assert_same_columns(_columns_of_a_run("host", bf16, "cuda"), _columns_of_a_run("device", bf16, "cuda"))


def test_the_pre_step_copy_in_host_memory_leaves_the_device_without_a_copy_of_the_model():
    """A logged step's peak above the bare step's: at least the parameters' bytes with the copy
    on the device (the update needs every entry of before and after across the optimizer's one
    call); with it in host memory, at most the fixed-size windows (2 x 8 MiB) and the
    per-block rows, whatever the model."""
    from gradrepro.probe import Probe
    from gradrepro.probe.blocks import BLOCK, WINDOW_BLOCKS
    from gradrepro.probe.config import ProbeConfig

    def added_peak(before_on):
        torch.manual_seed(0)
        net = torch.nn.Sequential(*[torch.nn.Linear(4096, 4096) for _ in range(4)]).cuda()  # 67 M entries
        opt = torch.optim.SGD(net.parameters(), lr=1e-3, momentum=0.9)
        x = torch.randn(8, 4096, device="cuda")
        probe = None if before_on is None else Probe(net, ProbeConfig(every=1, activations=False,
                                                                      task_contribution=False, before_on=before_on), 10)
        peaks = []
        for step in range(3):
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
            opt.zero_grad(set_to_none=True)
            if probe is None:
                net(x).square().mean().backward()
                opt.step()
            else:
                with probe.step(step, lr=1e-3) as p:
                    net(x).square().mean().backward()
                    p.collect()
                    opt.step()
            torch.cuda.synchronize()
            peaks.append(torch.cuda.max_memory_allocated() - base)
        return max(peaks[1:])  # after the optimizer made its momentum buffers

    param_bytes = 4 * 4 * (4096 * 4096 + 4096)
    bare, on_device, on_host = added_peak(None), added_peak("device"), added_peak("host")
    print(f"added peak: bare {bare / 2**20:.1f} MiB, copy on device {on_device / 2**20:.1f}, on host "
          f"{on_host / 2**20:.1f} (parameters {param_bytes / 2**20:.1f} MiB)")
    assert on_device - bare >= param_bytes
    windows = 2 * WINDOW_BLOCKS * BLOCK * 4
    assert on_host - bare <= windows + 2**20 * 8  # + the per-block rows and kernels' slack
