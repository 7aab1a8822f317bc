"""``gradrepro.lightning.Record``: the probe inside Lightning's ``Trainer.fit``, writing the same
run folder as ``gradrepro.record`` (``pip install 'gradrepro[lightning]'``).

    trainer = lightning.pytorch.Trainer(max_steps=1000, callbacks=[Record("runs/mine", every=10)])
    trainer.fit(model, loader)
    # python -m gradrepro.compare runs/mine

Lightning runs the forward and backward passes inside ``optimizer.step(closure)``, so the
optimizer's step pre-hook fires before the gradients exist. The callback uses Lightning's hooks
for the step's bounds: a step begins at ``on_train_batch_start`` (the first micro-batch after a
step) and ends at the ``on_train_batch_end`` where ``trainer.global_step`` has moved. The
gradients are read where the optimizer uses them: after the closure Lightning hands to
``optimizer.step`` has run (the recorder's step pre-hook wraps it), or at the step itself
where AMP's scaler runs the closure first; so after backward, accumulation, AMP unscaling and
``gradient_clip_val``, as ``grad_norm`` is defined. The loss is the mean of the step's
micro-batch losses as ``training_step`` returned them (Lightning hands the callback each one
divided by ``accumulate_grad_batches``). Every process records (the statistics of a sharded or
replicated tensor are of the full tensor, from every process's part); the global-zero process
writes the run folder.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Optional

import torch

from gradrepro.record import Recorder
from gradrepro.records.claim import refuse_taken

try:  # the unified package first; the standalone one where only it is installed
    from lightning.pytorch.callbacks import Callback
except ImportError:  # pragma: no cover - depends on what is installed
    try:
        from pytorch_lightning.callbacks import Callback
    except ImportError:
        raise ImportError("gradrepro.lightning needs Lightning: pip install 'gradrepro[lightning]'") from None


class Record(Callback):
    """Record the LightningModule's gradient signals into ``run_dir`` every ``every`` optimizer
    steps; ``options`` as for ``gradrepro.record`` (``name``, ``activations``, ``act_sample``)."""

    def __init__(self, run_dir: str | Path, every: int = 10, **options: Any) -> None:
        super().__init__()
        self.run_dir, self.every, self.options = Path(run_dir).expanduser(), every, options
        refuse_taken(self.run_dir)  # refused here, in one line, before any training
        self.recorder: Optional[Recorder] = None
        self._losses: list[torch.Tensor] = []
        self._reads_at_step = False  # the gradients read at the optimizer's step (after any clipping)

    def on_fit_start(self, trainer: Any, pl_module: Any) -> None:
        optimizer = trainer.optimizers[0] if trainer.optimizers else None
        scaler = getattr(getattr(trainer, "precision_plugin", None), "scaler", None)
        options = {"steps": _planned_steps(trainer), **self.options}  # the last step logged, as built-in runs do
        if "bf16" in str(getattr(trainer, "precision", "")):  # bf16-mixed, bf16-true: count what bf16 rounds away
            options.setdefault("bf16", True)
        self.recorder = Recorder(pl_module, optimizer, self.run_dir, every=self.every, scaler=scaler, hooks=False,
                                 **options)
        self.recorder.step = trainer.global_step  # a resumed fit goes on counting
        if optimizer is not None and hasattr(optimizer, "register_step_pre_hook"):
            # on_before_optimizer_step comes before Lightning clips: the gradients are read later
            self.recorder._handles.append(optimizer.register_step_pre_hook(self.recorder._pre_step))
            self._reads_at_step = True

    def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
        if self.recorder is not None:
            self.recorder.begin()

    def on_before_optimizer_step(self, trainer: Any, pl_module: Any, optimizer: Any) -> None:
        if self.recorder is not None and not self._reads_at_step:  # an optimizer without step hooks
            self.recorder.before_step()

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        rec = self.recorder
        if rec is None:
            return
        loss = outputs.get("loss") if isinstance(outputs, dict) else outputs
        if torch.is_tensor(loss):
            self._losses.append(loss.detach())
        if trainer.global_step > rec.step:  # the optimizer stepped in this batch
            if self._losses:  # each was divided by accumulate_grad_batches: back to the mean of the returned losses
                scale = trainer.accumulate_grad_batches / len(self._losses)
                rec.log(loss=torch.stack(self._losses).float().sum() * scale)  # read only if the step is logged
            self._losses = []
            rec.after_step()

    def on_fit_end(self, trainer: Any, pl_module: Any) -> None:
        if self.recorder is not None:
            self.recorder.close("completed")

    def on_exception(self, trainer: Any, pl_module: Any, exception: BaseException) -> None:
        if self.recorder is not None:
            status = "interrupted" if isinstance(exception, KeyboardInterrupt) else "failed"
            self.recorder.close(status, exception)


def _planned_steps(trainer: Any) -> Optional[int]:
    """How many optimizer steps ``fit`` will take, where Lightning knows (None where it does not)."""
    try:
        steps = trainer.estimated_stepping_batches
    except Exception:  # noqa: BLE001 - a loader without a length: the last step is not known
        return None
    return int(steps) if isinstance(steps, (int, float)) and 0 < steps < float("inf") else None
