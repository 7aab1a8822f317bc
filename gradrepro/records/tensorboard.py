"""``logger=tensorboard``: the run's records also go to a TensorBoard event folder inside the
run folder, so a run opens in the viewer users already have (``tensorboard --logdir RUN``).

The runner keeps one place where records are added; with a logger, the records object is
:class:`TensorBoardRecords`, which writes each row to TensorBoard as it is added:

- every scalar of ``scalars.parquet`` under its own name (``loss``, ``z_std``, ``knn_acc``, ...);
- per module, on every logged step: ``grad_norm/<module>`` (its tensors combined, L2) and a
  histogram ``grad_abs/<module>`` of the gradient's element magnitudes; and a histogram
  ``grad_norm_per_tensor`` across the model's tensors.

TensorBoard cannot show NaN or infinity in a histogram, and a NaN scalar is easy to miss.
Non-finite values are never dropped silently: each one is counted, and the running counts
are written as scalars under ``nonfinite/...`` (``nonfinite/<scalar>``,
``nonfinite/grad_elements/<module>``), alongside the finite values.
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path
from typing import Dict

import numpy as np
import torch
from torch import nn

from gradrepro.records.writer import Records


class TensorBoardRecords(Records):
    """Records that also write each added row to a TensorBoard event folder."""

    def __init__(
        self, run_dir: Path, net: nn.Module, folder: Path, histograms: bool = True
    ) -> None:
        from torch.utils.tensorboard import SummaryWriter

        super().__init__(run_dir)
        self.writer = SummaryWriter(log_dir=str(folder))
        self.histograms = histograms
        self.nonfinite: Counter = Counter()
        self.params_by_module: Dict[str, list] = {}
        seen = set()
        for mod_name, module in net.named_modules():  # the probe's module names
            for _, p in module.named_parameters(recurse=False):
                if id(p) not in seen:
                    seen.add(id(p))
                    self.params_by_module.setdefault(mod_name or "<root>", []).append(p)

    def _count(self, tag: str, n: int, step: int) -> None:
        self.nonfinite[tag] += n
        self.writer.add_scalar(f"nonfinite/{tag}", self.nonfinite[tag], step)

    def add_scalars(self, row: Dict[str, float]) -> None:
        super().add_scalars(row)
        step = int(row["step"])
        for key, value in row.items():
            if key == "step" or value is None:
                continue
            value = float(value)
            if np.isfinite(value):
                self.writer.add_scalar(key, value, step)
            else:
                self._count(key, 1, step)

    def add_modules(self, columns: Dict[str, np.ndarray]) -> None:
        super().add_modules(columns)
        step = int(columns["step"][0])
        norms = np.asarray(columns["grad_norm"], dtype=float)
        modules = np.asarray(columns["module"], dtype=object)
        finite_norms = norms[np.isfinite(norms)]
        if finite_norms.size:
            self.writer.add_histogram("grad_norm_per_tensor", finite_norms, step)
        for module in dict.fromkeys(modules):
            own = norms[modules == module]
            own = own[~np.isnan(own)]  # NaN here: no gradient (state none), not a bad value
            if not own.size:
                continue
            total = float(np.sqrt(np.sum(own**2)))
            if np.isfinite(total):
                self.writer.add_scalar(f"grad_norm/{module}", total, step)
            else:
                self._count(f"grad_norm/{module}", 1, step)
        if self.histograms:
            self._grad_histograms(step)

    @torch.no_grad()
    def _grad_histograms(self, step: int) -> None:
        for module, params in self.params_by_module.items():
            grads = [p.grad.detach().reshape(-1) for p in params if p.grad is not None]
            if not grads:
                continue
            magnitude = torch.cat(grads).abs().float()
            finite = torch.isfinite(magnitude)
            bad = int((~finite).sum())
            if bad:
                self._count(f"grad_elements/{module}", bad, step)
            values = magnitude[finite].cpu().numpy()
            if values.size:
                self.writer.add_histogram(f"grad_abs/{module}", values, step)

    def flush(self) -> None:
        super().flush()
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()
