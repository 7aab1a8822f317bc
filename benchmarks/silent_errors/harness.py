"""What every case and healthy model of the silent-error benchmark shares: the recorder it is
scored with, small synthetic data, and small models. A case is a function
``case(buggy: bool, record) -> int`` that trains with ``record(model, optimizer, **options)``
as its recorder and returns the first step at which its bug acts."""

from __future__ import annotations

import logging
import tempfile
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch import nn

import gradrepro
from gradrepro.errors import UserError
from gradrepro.watch.watcher import LiveFinding

EVERY = 8  # the recorder logs every 8th step: a detection "in time" is at the first logged step after the bug acts
STEPS = 40


@dataclass
class Outcome:
    """What the recorder found on one run of a case or a healthy model."""

    bug_step: int
    findings: list = field(default_factory=list)  # LiveFinding
    error: str = ""


class Recording:
    """Makes the case's recorder (findings logged, not warned) and keeps it for scoring."""

    def __init__(self, every: int = EVERY, live: bool = True) -> None:
        self.every, self.watch, self.recorders, self.refused = every, live, [], []
        self._dir = tempfile.TemporaryDirectory(prefix="silent-errors-")

    def __call__(self, model: nn.Module, optimizer: Any, **options: Any):
        run_dir = f"{self._dir.name}/{len(self.recorders) + len(self.refused)}"
        try:
            rec = gradrepro.record(model, optimizer, run_dir, every=self.every, live=self.watch, on_finding="log",
                                   activations=False, **options)
        except UserError as exc:  # a setup the recorder refuses, naming the cause: found before step 0
            kind = getattr(exc, "kind", None)
            if kind is None:
                raise
            self.refused.append(LiveFinding(kind, "<setup>", str(exc), "error", step=0))
            return _Refused()
        self.recorders.append(rec)
        return rec

    def findings(self) -> list:
        return self.refused + [f for rec in self.recorders if rec.watch is not None for f in rec.watch.found]

    def close(self) -> None:
        for rec in self.recorders:
            rec.close()
        self._dir.cleanup()


class _Refused:
    """What a case gets in place of a recorder the setup refused: its calls do nothing."""

    def __getattr__(self, name: str):
        return lambda *args, **kwargs: None


def run_case(case: Callable[[bool, Callable], int], buggy: bool, every: int = EVERY) -> Outcome:
    logging.getLogger("gradrepro.watch.watcher").setLevel(logging.ERROR)
    torch.manual_seed(0)
    recording = Recording(every)
    try:
        bug_step = case(buggy, recording)
        return Outcome(bug_step, recording.findings())
    except Exception as exc:  # noqa: BLE001 - a case that fails is scored as failed, with its error
        return Outcome(-1, recording.findings(), f"{type(exc).__name__}: {exc}")
    finally:
        recording.close()


# -- data and models --------------------------------------------------------------------------
def batch(n: int = 32, dim: int = 10, classes: int = 3) -> tuple[torch.Tensor, torch.Tensor]:
    x = torch.randn(n, dim)
    return x, (x[:, :classes].argmax(1))  # a learnable rule


def mlp(dim: int = 10, hidden: int = 32, classes: int = 3, dropout: float = 0.0, bn: bool = False) -> nn.Sequential:
    layers: list[nn.Module] = [nn.Linear(dim, hidden)]
    if bn:
        layers.append(nn.BatchNorm1d(hidden))
    layers.append(nn.ReLU())
    if dropout:
        layers.append(nn.Dropout(dropout))
    return nn.Sequential(*layers, nn.Linear(hidden, classes))


class SmallCNN(nn.Module):
    """Conv-BN-ReLU backbone and a linear head: the shape fine-tuning cases freeze."""

    def __init__(self, classes: int = 3) -> None:
        super().__init__()
        self.backbone = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(),
                                      nn.Conv2d(8, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(),
                                      nn.AdaptiveAvgPool2d(1), nn.Flatten())
        self.head = nn.Linear(8, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # Nx3xHxW -> Nxclasses
        return self.head(self.backbone(x))


def images(n: int = 16, classes: int = 3) -> tuple[torch.Tensor, torch.Tensor]:
    x = torch.randn(n, 3, 8, 8)
    return x, x.mean((2, 3)).argmax(1) % classes


def sgd_steps(model: nn.Module, opt: torch.optim.Optimizer, steps: int = STEPS, make=batch,
              loss_fn=F.cross_entropy, each: Callable[[int], None] | None = None) -> None:
    """The textbook loop: zero_grad, forward, loss, backward, step (``each(step)`` first)."""
    for step in range(steps):
        if each is not None:
            each(step)
        x, y = make()
        opt.zero_grad()
        loss_fn(model(x), y).backward()
        opt.step()
