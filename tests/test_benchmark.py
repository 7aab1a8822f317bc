"""benchmarks/overhead.py runs end to end at a tiny size and writes the documented JSON.
No timing assertions: timings belong to the benchmark, not to tests."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]


def test_overhead_benchmark_quick_run_writes_rows(tmp_path):
    out = tmp_path / "overhead.json"
    cmd = [sys.executable, str(ROOT / "benchmarks" / "overhead.py"), "--quick",
           "--models", "plain30", "--every", "1", "4", "--batch", "4", "--rounds", "1",
           "--threads", "1", "--mem-steps", "2", "--tools", "bare", "gradrepro",
           "--json", str(out)]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-2000:]
    rows = json.loads(out.read_text())["rows"]
    keys = {"model", "tool", "every", "step_s", "ratio", "mem_ratio"}
    assert all(keys <= set(r) for r in rows)
    got = {(r["tool"], r["every"]) for r in rows}
    assert got == {("bare", 1), ("gradrepro", 1), ("gradrepro", 4)}
    for r in rows:
        assert r["model"] == "plain30"
        assert r["step_s"] > 0 and math.isfinite(r["ratio"])
    bare = next(r for r in rows if r["tool"] == "bare")
    assert bare["ratio"] == 1.0 and bare["mem_ratio"] == 1.0 and bare["tensor_mem_ratio"] == 1.0
    # Each memory process runs through the second logged step: step 0 runs before the optimizer
    # has state. The probe only adds to the same training, so its tensor peak is not below.
    assert {(r["every"], r["mem_steps"]) for r in rows} == {(1, 3), (4, 6)}  # every + 2
    assert all(r["tensor_mem_ratio"] >= 1.0 for r in rows if r["tool"] == "gradrepro")
    # every 4 has steps without probe code: its schedule is also paired with those
    every4 = next(r for r in rows if r["every"] == 4)
    assert every4["own_ratio"] == pytest.approx(every4["step_s"] / every4["unlogged_s"])
    assert "own_ratio" not in next(r for r in rows if r["tool"] == "gradrepro" and r["every"] == 1)
    assert "| plain30 | gradrepro | 4 |" in proc.stdout  # the printed table


def test_the_tensor_peak_counts_what_is_allocated_and_not_yet_freed():
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from memory import tensor_peak_bytes

    kept = torch.empty(1 << 18)  # before: freed inside, it counts nothing

    def run() -> None:
        nonlocal kept
        a = torch.empty(1 << 20)  # 4 MiB
        b = torch.empty(1 << 19)  # 2 MiB, beside a: the peak
        del a, kept
        c = torch.empty(1 << 20)  # 4 MiB beside b: 6 MiB again, not more
        del b, c

    assert tensor_peak_bytes(run) == 6 << 20


def test_op_counter_sees_host_waits_and_nothing_else():
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from op_count import OpCounter

    x = torch.ones(3)
    with OpCounter() as c:
        y = x + 1
        y.sum().item()  # a scalar read
        y.to("cpu", copy=True)  # an explicit copy to the host
        torch.cat([y, y])
    assert (c.ops, c.syncs) == (5, 2)


def test_probe_adds_fewer_operations_per_logged_step_than_the_bare_step(tmp_path):
    # The target of the probe's design (benchmarks/README.md): on a GPU every operation is a
    # kernel launch, so a logged step may add at most the bare step's own count, and the
    # host waits for the device once (the one transfer).
    out = tmp_path / "ops.json"
    cmd = [sys.executable, str(ROOT / "benchmarks" / "overhead.py"), "--ops-only",
           "--batch", "9", "--threads", "1", "--json", str(out)]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-2000:]
    rows = json.loads(out.read_text())["rows"]
    assert {r["model"] for r in rows} == {"cifar10_3c3d", "resnet18", "plain30"}
    for r in rows:
        assert 0 < r["probe_ops"] <= r["bare_ops"], r
        assert r["probe_syncs"] == 1, r  # the one transfer, and it is seen


def test_the_gradients_passes_cost_the_same_operations_whatever_the_models_size(monkeypatch):
    """The gradients', parameters' and update's passes of a logged step run over the whole
    layout at once: a net of the same tensors 4096 times larger (its first weight 6.2 M
    entries, three 8 MiB windows) dispatches the same operations, and the host waits once.
    Counted on the device's passes (a GPU's): the CPU's own sums of squares scale only the
    blocks the host reads scaled, a few operations more where there are any."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from op_count import OpCounter

    from gradrepro.probe import Probe, blocks
    from gradrepro.probe.blocks import WINDOW_BLOCKS
    from gradrepro.probe.config import ProbeConfig

    monkeypatch.setattr(blocks, "HOST_SHORTCUTS", False)

    def counts(width: int) -> tuple:
        torch.manual_seed(0)
        net = torch.nn.Sequential(torch.nn.Linear(width, width), torch.nn.Tanh(), torch.nn.Linear(width, 10))
        probe = Probe(net, ProbeConfig(every=1, activations=False), total_steps=10)
        opt = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)
        x, y = torch.randn(4, width), torch.randint(0, 10, (4,))
        for step in range(3):  # the last one counted: the buffers are laid out by then
            opt.zero_grad(set_to_none=True)
            ctx = probe.step(step, lr=0.1)
            p = ctx.__enter__()
            torch.nn.functional.cross_entropy(net(x), y).backward()
            with OpCounter() as collect:
                p.collect()
            opt.step()
            with OpCounter() as finish:
                ctx.__exit__(None, None, None)
        assert probe.buffers.layout.blocks > (2 * WINDOW_BLOCKS if width > 1000 else 0)
        return collect.ops + finish.ops, collect.syncs + finish.syncs

    small, large = counts(39), counts(39 * 64)
    assert small == large and small[1] == 1, (small, large)
