"""gradrepro.transformers.Record inside the Hugging Face Trainer, on tiny models built from configs
(a GPT-2 causal LM and a BERT sequence classifier, tests/hf_tiny.py): one row per optimizer step
with gradient accumulation, the same per-module gradient norms as a plain loop that does what the
Trainer does, no warning on healthy runs, the finding at the step a bug acts, the findings in the
Trainer's log, and a wrong setup refused in one line."""

from __future__ import annotations

import json
import types
import warnings

import numpy as np
import pandas as pd
import pytest
import torch

pytest.importorskip("transformers")

import hf_tiny  # noqa: E402 - after the skip
from transformers import Trainer, TrainerCallback  # noqa: E402

from gradrepro.analysis.compare import compare  # noqa: E402
from gradrepro.diagnose.report import INFO  # noqa: E402
from gradrepro.errors import UserError  # noqa: E402
from gradrepro.transformers import Record  # noqa: E402

torch.set_num_threads(1)
COLUMNS = ("grad_norm", "param_norm", "update_to_param", "grad_state")


class Integration(TrainerCallback):
    """Stands for a ``report_to`` integration: listed before the user's callbacks, it keeps the
    logs it is handed."""

    def __init__(self) -> None:
        self.logs = []

    def on_log(self, args, state, control, logs=None, **kwargs):
        self.logs.append(dict(logs))


def train(kind, run_dir, tmp_path, steps=8, callbacks=(), optimizers=(None, None), model=None, **kw):
    """A Trainer run of ``kind`` with the callback: (callback, trainer, the warnings it gave);
    ``trainer.integration.logs``: what an integration listed before the callback was handed."""
    callback = Record(run_dir, every=1)
    integration = Integration()
    model = model if model is not None else hf_tiny.build(kind)
    trainer = Trainer(model=model, args=hf_tiny.trainer_args(tmp_path / "out", steps=steps, **kw),
                      train_dataset=hf_tiny.Tokens(kind), callbacks=[integration, callback, *callbacks],
                      optimizers=optimizers)
    trainer.integration = integration
    callback.put_first(trainer)  # ahead of the integration, as of the report_to ones
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.train()
    return callback, trainer, [w for w in caught if type(w.message).__name__ == "TrainingFinding"]


def serious(callback):
    return [f for f in callback.recorder.findings() if f.severity != INFO]


@pytest.mark.parametrize("kind", hf_tiny.KINDS)
def test_healthy_trainer_run_writes_one_row_per_optimizer_step_and_no_warning(kind, tmp_path):
    callback, trainer, found = train(kind, tmp_path / "runs" / kind, tmp_path)
    run_dir = tmp_path / "runs" / kind
    summary = json.loads((run_dir / "summary.json").read_text())
    scalars = pd.read_parquet(run_dir / "scalars.parquet")
    assert summary["status"] == "completed" and summary["steps"] == trainer.state.global_step == 8
    assert list(scalars["step"]) == list(range(8))  # 16 micro-batches, 8 optimizer steps
    assert (run_dir / "signals.png").exists()
    assert not found and not serious(callback), [str(f) for f in serious(callback)]
    # the logs an integration listed before the callback is handed carry the findings' count
    logged = [h for h in trainer.integration.logs if "loss" in h]
    assert len(logged) == 4 and all(h["gradrepro/findings"] == 0 for h in logged)
    tables, runs, warned = compare([tmp_path / "runs"])
    assert not warned and tables["runs"].iloc[0]["status"] == "completed"


@pytest.mark.parametrize("kind,clip", [("causal_lm", 1.0), ("causal_lm", 0.0), ("classifier", 1.0)])
def test_trainer_records_the_per_module_gradients_of_the_plain_loop_it_runs(kind, clip, tmp_path):
    """The Trainer (accumulation 2, ``num_items_in_batch``, clipping after backward, linear
    schedule) against its loop written out (hf_tiny.plain_loop) under gradrepro.record."""
    train(kind, tmp_path / "trainer", tmp_path, max_grad_norm=clip)
    hf_tiny.plain_loop(kind, tmp_path / "plain", max_grad_norm=clip)
    ours, plain = (pd.read_parquet(tmp_path / n / "modules.parquet") for n in ("trainer", "plain"))
    assert list(ours["step"]) == list(plain["step"]) and list(ours["module"]) == list(plain["module"])
    assert ours["step"].nunique() == 8
    assert list(ours["grad_state"]) == list(plain["grad_state"])
    # An attention key bias gets a gradient that is 0 in exact arithmetic (softmax is invariant
    # to a shift of the keys): float32 leaves ~1e-12, different in each loop (hence atol), and
    # AdamW turns that noise into full-size updates of either sign: BERT's separate key biases
    # are left out of the update and parameter columns.
    np.testing.assert_allclose(ours["grad_norm"], plain["grad_norm"], rtol=1e-5, atol=1e-8)
    moved = ~(ours["module"].str.endswith("attention.self.key") & (ours["param"] == "bias"))
    for column in ("param_norm", "update_to_param"):
        np.testing.assert_allclose(ours[column][moved], plain[column][moved], rtol=1e-5, atol=1e-8, err_msg=column)
    losses = [pd.read_parquet(tmp_path / n / "scalars.parquet")["loss"] for n in ("trainer", "plain")]
    np.testing.assert_allclose(losses[0], losses[1], rtol=1e-5)


@pytest.mark.parametrize("kind", hf_tiny.KINDS)
def test_a_schedule_that_reaches_zero_is_found_at_the_step_it_does(kind, tmp_path):
    model = hf_tiny.build(kind)
    opt, sched = hf_tiny.adamw_and_schedule(model, total=4)  # the run takes 8 steps: lr 0 from step 4
    callback, integration = Record(tmp_path / "lr0", every=1), Integration()
    trainer = Trainer(model=model, args=hf_tiny.trainer_args(tmp_path / "out"), train_dataset=hf_tiny.Tokens(kind),
                      callbacks=[integration, callback], optimizers=(opt, sched))
    callback.put_first(trainer)
    with pytest.warns(UserWarning, match="step 4: lr_zero"):
        trainer.train()
    found = [f for f in serious(callback) if f.kind == "lr_zero"]
    assert found and {f.step for f in found} == {4}
    # in the Trainer's log from the first log after step 4 (logging_steps=2: the log at global step 6)
    named = [[k for k, v in h.items() if k.startswith("gradrepro/lr_zero/") and v == 4] for h in integration.logs]
    assert not any(named[:2]) and all(named[2:]) and integration.logs[2]["gradrepro/findings"] >= 1


@pytest.mark.parametrize("first", [True, False])
def test_findings_reach_a_report_to_integration_when_the_callback_is_put_first(first, tmp_path):
    """TensorBoard through ``report_to``: the Trainer lists it before the user's callbacks, so the
    findings' keys are in its event file after ``put_first`` and absent (with a warning) without."""
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    model = hf_tiny.build("classifier")
    opt, sched = hf_tiny.adamw_and_schedule(model, total=4)  # lr 0 from step 4 of 8
    args = hf_tiny.trainer_args(tmp_path / "out")
    args.report_to = ["tensorboard"]
    callback = Record(tmp_path / "run", every=1)
    trainer = Trainer(model=model, args=args, train_dataset=hf_tiny.Tokens("classifier"), callbacks=[callback],
                      optimizers=(opt, sched))
    if first:
        callback.put_first(trainer)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.train()
    told = [str(w.message) for w in caught if "put_first" in str(w.message)]
    assert bool(told) is not first, told
    (events,) = {p.parent for p in (tmp_path / "out").rglob("events.out.tfevents*")}
    acc = EventAccumulator(str(events))
    acc.Reload()
    tags = acc.Tags()["scalars"]
    assert any(t.endswith("loss") for t in tags)  # the integration wrote the Trainer's log
    lr_zero = [t for t in tags if t.startswith("train/gradrepro/lr_zero/")]  # TensorBoard adds "train/"
    assert bool(lr_zero) is first and ("train/gradrepro/findings" in tags) is first, tags
    for tag in lr_zero:
        assert {e.value for e in acc.Scalars(tag)} == {4.0}  # the step the rate reached 0


def test_put_first_on_a_trainer_without_the_callback_is_one_line(tmp_path):
    trainer = Trainer(model=hf_tiny.build("classifier"), args=hf_tiny.trainer_args(tmp_path / "out"),
                      train_dataset=hf_tiny.Tokens("classifier"))
    with pytest.raises(UserError, match="not in the Trainer's callbacks"):
        Record(tmp_path / "r").put_first(trainer)


class FreezeAt(TrainerCallback):
    """Freezes the first block's MLP at a step, leaving it in the optimizer."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_step_begin(self, args, state, control, model=None, **kwargs):
        if state.global_step == self.step:
            model.transformer.h[0].mlp.requires_grad_(False)


def test_a_layer_frozen_in_the_optimizer_is_named_and_the_trainer_keeps_it_still(tmp_path):
    """The Trainer sets the gradients to None after each step (model.zero_grad()), so AdamW
    skips a tensor frozen mid-run and its weight decay cannot move it (the bug acts where the
    gradients are zeroed instead: the Accelerate test). Named as frozen, not warned about."""
    model = hf_tiny.build("causal_lm")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1)
    callback, _, found = train("causal_lm", tmp_path / "frozen", tmp_path, callbacks=[FreezeAt(4)],
                               optimizers=(opt, None), model=model)
    kinds = {(f.kind, f.name) for f in callback.recorder.findings()}
    assert ("frozen", "transformer.h.0.mlp.c_fc.weight") in kinds and not found
    modules = pd.read_parquet(tmp_path / "frozen" / "modules.parquet")
    frozen = modules[modules["module"] == "transformer.h.0.mlp.c_fc"]
    assert (frozen[frozen["step"] >= 4]["update_to_param"] == 0).all()
    # before: every weight moves (a bias starts at 0, where update over weight is undefined)
    assert (frozen[(frozen["step"] < 4) & (frozen["param"] == "weight")]["update_to_param"] > 0).all()


def test_a_second_train_call_on_the_same_callback_is_one_line(tmp_path):
    callback, trainer, _ = train("classifier", tmp_path / "once", tmp_path, steps=1)
    with pytest.raises(UserError, match="already recorded a train"):
        trainer.train()


def test_an_unsupported_strategy_or_no_model_is_one_line(tmp_path):
    callback = Record(tmp_path / "r")
    with pytest.raises(UserError, match="does not support DeepSpeed"):
        callback.on_init_end(types.SimpleNamespace(deepspeed="ds.json", fsdp=None), None, None)
    for config in ({}, {"fsdp_version": 2}):  # FSDP2 too: Accelerate runs FSDP on GPUs only, untested here
        with pytest.raises(UserError, match=r"does not support FSDP .*supported: one process and DDP"):
            callback.on_init_end(types.SimpleNamespace(deepspeed=None, fsdp="full_shard", fsdp_config=config),
                                 None, None)
    args = hf_tiny.trainer_args(tmp_path / "out")
    state = types.SimpleNamespace(max_steps=8, global_step=0)
    with pytest.raises(UserError, match="the Trainer has no model"):
        callback.on_train_begin(args, state, None, model=None, optimizer=None)
    assert not (tmp_path / "r").exists()  # refused before anything is written


def test_a_model_sharded_by_fully_shard_is_refused_in_one_line(tmp_path):
    """FSDP2 set up outside the Trainer's arguments (an Accelerate config): DTensor parameters."""
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        model = torch.nn.Sequential(torch.nn.Linear(4, 4))
        fully_shard(model)
        state = types.SimpleNamespace(max_steps=8, global_step=0)
        with pytest.raises(UserError, match=r"sharded or owned .*\(DTensor\); supported: one process and DDP"):
            Record(tmp_path / "r").on_train_begin(hf_tiny.trainer_args(tmp_path / "out"), state, None, model=model)
    finally:
        dist.destroy_process_group()
    assert not (tmp_path / "r").exists()


def test_a_folder_that_holds_a_run_is_refused_when_the_callback_is_made(tmp_path):
    train("classifier", tmp_path / "taken", tmp_path, steps=1)
    with pytest.raises(UserError, match="already holds a run"):
        Record(tmp_path / "taken")
