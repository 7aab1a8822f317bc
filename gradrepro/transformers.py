"""``gradrepro.transformers.Record``: the probe inside the Hugging Face ``Trainer``, writing the
same run folder as ``gradrepro.record`` (``pip install 'gradrepro[transformers]'``).

    trainer = transformers.Trainer(model, args, train_dataset=data, callbacks=[Record("runs/mine", every=10)])
    trainer.train()
    # python -m gradrepro.compare runs/mine

A step of the record is one of the Trainer's optimizer steps (``state.global_step``): its
``gradient_accumulation_steps`` micro-batches are one step. The callback uses the Trainer's own
events for the step's bounds: the step begins at ``on_step_begin`` (before the first
micro-batch's forward pass, so that a logged step's activations are recorded), the gradients are
read at ``on_pre_optimizer_step`` (after every micro-batch's backward, the gradient sync of the
last one, the scaler's unscale and the Trainer's ``max_grad_norm`` clipping: what the optimizer
uses, as ``grad_norm`` is defined), and the step ends at ``on_optimizer_step``. The loss scale is
the Accelerate optimizer's scaler's (fp16), read where the step begins.

The loss column is the step's loss as the Trainer optimises it on this process: the sum of the
model's micro-batch losses where the Trainer passed ``num_items_in_batch`` to the model (the model
then divides by the step's item count), their mean otherwise. A run that raises inside
``train()`` leaves its folder at the last flush with status ``running`` (the Trainer has no
callback event for an exception).

Findings are also written into the Trainer's log (``on_log``): ``gradrepro/findings`` (how many
warnings and errors so far) and one ``gradrepro/<kind>/<name>`` per finding, valued at the step it
appeared (-1 where it is a summary over the steps). The Trainer hands one ``logs`` dict to its
callbacks in list order and lists the ``report_to`` integrations before the user's callbacks, so
TensorBoard, W&B, ... send these keys on only from a callback ahead of them:
``record.put_first(trainer)`` moves the callback to the front of ``trainer.callback_handler``'s
list (a callback is not handed the Trainer, so it cannot do this itself); where ``report_to``
names integrations and it was not called, ``train()`` warns once.

Every process records (the statistics of a replicated tensor are of the full, synchronised
tensor, from every process); rank 0 writes the run folder. DeepSpeed (its engine owns the
gradients and the step) and FSDP, either version, are refused in one line: Accelerate runs FSDP
on GPUs only (on CPU, gloo, the Trainer given ``fsdp`` runs DDP), so it is untested here.
"""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any, Optional

import torch

from gradrepro.diagnose.report import INFO
from gradrepro.errors import UserError
from gradrepro.record import Recorder
from gradrepro.records.claim import refuse_taken

try:
    from transformers import TrainerCallback
except ImportError:  # pragma: no cover - depends on what is installed
    raise ImportError("gradrepro.transformers needs transformers: pip install 'gradrepro[transformers]'") from None


class Record(TrainerCallback):
    """Record the Trainer's model's gradient signals into ``run_dir`` every ``every`` optimizer steps.

    Args:
        run_dir: the run folder (refused if it already holds a run).
        every: log the probe's columns every this many optimizer steps (the last step is logged too).
        log_findings: pass the findings into the Trainer's log at each ``on_log``.
        options: as for ``gradrepro.record`` (``name``, ``activations``, ``act_sample``, ``on_finding``,
            ``silence``, ...).
    """

    def __init__(self, run_dir: str | Path, every: int = 10, log_findings: bool = True, **options: Any) -> None:
        super().__init__()
        self.run_dir, self.every, self.log_findings, self.options = Path(run_dir).expanduser(), every, \
            log_findings, options
        refuse_taken(self.run_dir)  # refused here, in one line, before any training
        self.recorder: Optional[Recorder] = None
        self._losses: list[torch.Tensor] = []
        self._sums = False  # the Trainer passed num_items_in_batch: the micro-batch losses add up
        self._handle: Any = None
        self._first = False  # put_first was called: the report_to integrations see the findings

    # -- set-up: refused in one line, before any step -------------------------------------------
    def on_init_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        _check_strategy(args)

    def put_first(self, trainer: Any) -> "Record":
        """Move this callback to the front of ``trainer``'s callback list, ahead of the ``report_to``
        integrations, so that the findings it adds to the Trainer's log are in the ``logs`` they send.

        Args:
            trainer: the ``transformers.Trainer`` this callback was given to (``callbacks=[...]`` or
                ``trainer.add_callback``).
        """
        callbacks = trainer.callback_handler.callbacks
        if self not in callbacks:
            raise UserError("gradrepro.transformers.Record.put_first: this callback is not in the Trainer's "
                            "callbacks: pass it in Trainer(callbacks=[...]) or trainer.add_callback first")
        callbacks.remove(self)
        callbacks.insert(0, self)
        self._first = True
        return self

    def on_train_begin(self, args: Any, state: Any, control: Any, model: Any = None, optimizer: Any = None,
                       **kwargs: Any) -> None:
        _check_strategy(args)
        if model is None:
            raise UserError("gradrepro.transformers.Record: the Trainer has no model (pass model= or model_init= "
                            "to the Trainer): nothing to record")
        _check_model(model)
        if self.recorder is not None:  # a second train() on the same callback: a new folder is needed
            raise UserError(f"gradrepro.transformers.Record({str(self.run_dir)!r}) already recorded a train() "
                            "call: give each train() its own Record and run folder")
        inner = getattr(optimizer, "optimizer", optimizer)  # Accelerate's AcceleratedOptimizer wraps the torch one
        options = {"steps": state.max_steps if state.max_steps and state.max_steps > 0 else None, **self.options}
        if args.bf16:
            options.setdefault("bf16", True)
        self.recorder = Recorder(model, inner, self.run_dir, every=self.every,
                                 scaler=getattr(optimizer, "scaler", None), hooks=False, **options)
        self.recorder.step = state.global_step  # a resumed run goes on counting
        integrations = [name for name in (getattr(args, "report_to", None) or []) if name != "none"]
        if self.log_findings and integrations and not self._first and getattr(state, "is_world_process_zero", True):
            warnings.warn(f"gradrepro.transformers.Record: the report_to integrations ({', '.join(integrations)}) "
                          "run before this callback and will not send its findings: call record.put_first(trainer) "
                          "after building the Trainer (or pass log_findings=False)", UserWarning, stacklevel=2)
        self._handle = model.register_forward_hook(self._keep_loss, with_kwargs=True)

    # -- the step: begin, gradients read after clipping, end -------------------------------------
    def on_step_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self.recorder is not None:
            self.recorder.begin()

    def on_pre_optimizer_step(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self.recorder is not None:
            self.recorder.before_step()

    def on_optimizer_step(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        rec = self.recorder
        if rec is None:
            return
        if self._losses:
            loss = torch.stack(self._losses).float().sum()
            rec.log(loss=loss if self._sums else loss / len(self._losses))  # read only if the step is logged
        self._losses = []
        rec.after_step()

    def _keep_loss(self, module: Any, args: Any, kwargs: dict, output: Any) -> None:
        if not torch.is_grad_enabled():  # evaluation passes are not training steps
            return
        loss = output.get("loss") if isinstance(output, dict) else getattr(output, "loss", None)
        if torch.is_tensor(loss) and loss.numel() == 1:
            self._losses.append(loss.detach().clone())  # the Trainer may scale it in place afterwards
            self._sums = kwargs.get("num_items_in_batch") is not None

    # -- findings into the Trainer's log (report_to sends them on) -------------------------------
    def on_log(self, args: Any, state: Any, control: Any, logs: Optional[dict] = None, **kwargs: Any) -> None:
        if self.recorder is None or not self.log_findings or logs is None or self.recorder.status is not None:
            return
        found = [f for f in self.recorder.findings() if f.severity != INFO]
        logs["gradrepro/findings"] = len(found)
        for f in found:
            logs[f"gradrepro/{f.kind}/{f.name}"] = int(getattr(f, "step", -1))

    # -- the end ---------------------------------------------------------------------------------
    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self._close("completed")

    def _close(self, status: str, error: Optional[BaseException] = None) -> None:
        if self._handle is not None:
            self._handle.remove()
            self._handle = None
        if self.recorder is not None:
            self.recorder.close(status, error)


SUPPORTED = "supported: one process and DDP (torchrun, accelerate launch)"


def _check_strategy(args: Any) -> None:
    """DeepSpeed owns the gradients and the step, FSDP (either version) shards them: refused in one line.
    FSDP2 under the Trainer is refused too: Accelerate runs FSDP on GPUs only, so it is untested
    here (on CPU the Trainer silently runs DDP instead); ``gradrepro.record`` records a loop of
    your own after ``fully_shard`` (docs/torchrun.md)."""
    if getattr(args, "deepspeed", None):
        raise UserError("gradrepro.transformers.Record does not support DeepSpeed (its engine owns the gradients "
                        f"and the optimizer step); {SUPPORTED}")
    if getattr(args, "fsdp", None):
        version = int((getattr(args, "fsdp_config", None) or {}).get("fsdp_version", 1) or 1)
        raise UserError(f"gradrepro.transformers.Record does not support FSDP (fsdp_version={version}) under the "
                        f"Trainer; {SUPPORTED}; for FSDP2 use gradrepro.record in your own loop after fully_shard")


def _check_model(model: Any) -> None:
    """A model sharded or wrapped by a strategy the arguments did not name (an Accelerate config's
    FSDP or DeepSpeed, a tensor-parallel plan): its parameters are DTensors or flat shards."""
    names = {type(m).__name__ for m in model.modules()} | {type(model).__name__}
    kinds = {type(p).__name__ for p in model.parameters()}
    found = (names & {"FullyShardedDataParallel", "DeepSpeedEngine"}) or (kinds & {"DTensor", "FlatParameter"})
    if found:
        raise UserError(f"gradrepro.transformers.Record does not support a model whose parameters are sharded or "
                        f"owned by another engine ({', '.join(sorted(found))}); {SUPPORTED}")
