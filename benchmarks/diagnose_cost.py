"""What one ``gradrepro.diagnose`` call costs against one training step of the same model, and
where its time and memory go, on torchvision classifiers at batch 2 on one thread:

    nice -n 10 python benchmarks/diagnose_cost.py resnet50 convnext_tiny vit_b_16 densenet121 \\
        [--size 32] [--steps 3] [--optimizer sgd|adamw] [--json OUT.json]

Each model runs in its own process (the peak resident memory is per process): one warm-up
training step (zero_grad, forward, backward, step; ``SGD(lr=0.01)``, or ``AdamW(lr=1e-3,
weight_decay=0.05)`` with ``--optimizer adamw``), ``--steps`` timed steps, then one
diagnose call. Times are CPU seconds of the process (``time.process_time``, one thread: the
machine's other load does not enter) and wall seconds. ``diagnose / step`` is the call's CPU
time over one step's; of the call's CPU time, the system's share and the page faults (the
kernel's time to back memory the process touches for the first time). Memory: the peak
resident set after the call minus the peak after the training steps, as a multiple of the
parameters' bytes (the call's extra copies). Phases: the transition's named steps
(``gradrepro.diagnose.transition``), timed by wrapping them, and the peak resident memory
when each ended (the same multiple): where the call's extra copies are first reached.
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time
from pathlib import Path

import torch
import torchvision
from torch import nn

import gradrepro.diagnose as diagnose_mod
from gradrepro.diagnose import causes, transition

PHASES = ("_fresh_loss", "_backward", "_classify", "_explain", "_step_and_predict")


def _model(name: str, size: int) -> nn.Module:
    extra = {"image_size": size} if name.startswith("vit_") else {}
    return torchvision.models.get_model(name, weights=None, num_classes=10, **extra).train()


def _peak_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux: KiB


OPTIMIZERS = {"sgd": lambda ps: torch.optim.SGD(ps, lr=0.01),
              "adamw": lambda ps: torch.optim.AdamW(ps, lr=1e-3, weight_decay=0.05)}


def one(name: str, size: int, steps: int, optimizer: str = "sgd") -> dict:
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = _model(name, size)
    opt = OPTIMIZERS[optimizer](model.parameters())
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(2, 3, size, size, generator=g), torch.randint(0, 10, (2,), generator=g)

    def loss_of() -> torch.Tensor:
        return nn.functional.cross_entropy(model(x), y)

    def train_step() -> None:
        opt.zero_grad()
        loss_of().backward()
        opt.step()

    train_step()  # warm-up: the optimizer's state, the allocator's caches
    cpu, wall = time.process_time(), time.perf_counter()
    for _ in range(steps):
        train_step()
    step_cpu, step_wall = (time.process_time() - cpu) / steps, (time.perf_counter() - wall) / steps
    peak_train = _peak_mb()
    spent: dict = {}
    peaks: dict = {}  # phase -> the process's peak resident memory when it ended, MB above peak_train
    closures = [0]

    def timed(module, attr):
        fn = getattr(module, attr)

        def wrapper(*a, **k):
            t0 = time.process_time()
            try:
                return fn(*a, **k)
            finally:
                spent[attr] = spent.get(attr, 0.0) + time.process_time() - t0
                peaks[attr] = max(_peak_mb() - peak_train, 0.0)
        setattr(module, attr, wrapper)

    for phase in PHASES:
        timed(transition, phase)
    timed(causes, "loss_depends")
    timed(diagnose_mod, "findings_of")

    def counted() -> torch.Tensor:
        closures[0] += 1
        return loss_of()

    cpu, wall, use = time.process_time(), time.perf_counter(), resource.getrusage(resource.RUSAGE_SELF)
    report = diagnose_mod.diagnose(model, opt, counted)
    diag_cpu, diag_wall = time.process_time() - cpu, time.perf_counter() - wall
    used = resource.getrusage(resource.RUSAGE_SELF)
    param_mb = sum(p.numel() * p.element_size() for p in model.parameters()) / 2**20
    extra_mb = max(_peak_mb() - peak_train, 0.0)
    return {"model": name, "optimizer": optimizer, "size": size, "batch": 2, "threads": 1,
            "params_M": round(sum(p.numel() for p in model.parameters()) / 1e6, 2),
            "step_cpu_s": round(step_cpu, 3), "step_wall_s": round(step_wall, 3),
            "diagnose_cpu_s": round(diag_cpu, 3), "diagnose_wall_s": round(diag_wall, 3),
            "ratio_cpu": round(diag_cpu / step_cpu, 2), "closure_calls": closures[0],
            "diagnose_sys_s": round(used.ru_stime - use.ru_stime, 3),
            "diagnose_page_faults": used.ru_minflt - use.ru_minflt,
            "param_MB": round(param_mb, 1), "extra_peak_MB": round(extra_mb, 1),
            "extra_copies": round(extra_mb / param_mb, 2),
            "phases_cpu_s": {k: round(v, 3) for k, v in spent.items()},
            "phases_peak_copies": {k: round(v / param_mb, 2) for k, v in peaks.items()},
            "findings": len(report.findings)}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("models", nargs="+")
    p.add_argument("--size", type=int, default=32)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--optimizer", choices=sorted(OPTIMIZERS), default="sgd")
    p.add_argument("--json", type=Path)
    p.add_argument("--one", action="store_true", help=argparse.SUPPRESS)  # the per-model process
    args = p.parse_args(argv)
    if args.one:
        print(json.dumps(one(args.models[0], args.size, args.steps, args.optimizer)))
        return 0
    rows = []
    for name in args.models:
        out = subprocess.run([sys.executable, __file__, name, "--one", "--size", str(args.size),
                              "--steps", str(args.steps), "--optimizer", args.optimizer],
                             capture_output=True, text=True)
        if out.returncode != 0:
            print(f"{name}: failed: {out.stderr.strip().splitlines()[-1:]}", file=sys.stderr)
            continue
        row = json.loads(out.stdout.strip().splitlines()[-1])
        rows.append(row)
        print(json.dumps(row), flush=True)
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
