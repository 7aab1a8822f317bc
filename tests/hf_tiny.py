"""Tiny Hugging Face models built from configs (nothing downloaded), their data, and a plain
loop that does what ``transformers.Trainer`` does with them: the helpers of the Trainer,
Accelerate and torchrun tests (imported by scripts those tests launch, too)."""

from __future__ import annotations

import itertools
from pathlib import Path
from typing import Any, Callable, Optional

import torch

import gradrepro

VOCAB, LENGTH, ITEMS = 64, 8, 32
KINDS = ("causal_lm", "classifier")


def build(kind: str) -> torch.nn.Module:
    """A 2-layer, hidden-32 model, seeded, without dropout (so that two runs are the same run)."""
    from transformers import BertConfig, BertForSequenceClassification, GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    if kind == "causal_lm":
        return GPT2LMHeadModel(GPT2Config(vocab_size=VOCAB, n_positions=16, n_embd=32, n_layer=2, n_head=2,
                                          resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                                          bos_token_id=0, eos_token_id=0))
    if kind == "classifier":
        return BertForSequenceClassification(BertConfig(
            vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64,
            max_position_embeddings=16, num_labels=3, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0))
    raise ValueError(kind)


class Tokens(torch.utils.data.Dataset):
    """``ITEMS`` random sequences; labels: the tokens (causal LM) or one of 3 classes."""

    def __init__(self, kind: str, items: int = ITEMS) -> None:
        g = torch.Generator().manual_seed(1)
        self.kind = kind
        self.x = torch.randint(1, VOCAB, (items, LENGTH), generator=g)
        self.y = torch.randint(0, 3, (items,), generator=g)
        if kind == "causal_lm":  # some positions ignored, as padding is: the item count is not the token count
            self.labels = self.x.clone()
            self.labels[::3, -2:] = -100

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> dict:
        labels = self.labels[i] if self.kind == "causal_lm" else self.y[i]
        return {"input_ids": self.x[i], "labels": labels}


def trainer_args(out: Path | str, steps: int = 8, batch: int = 4, accumulate: int = 2, **kw: Any) -> Any:
    from transformers import TrainingArguments

    return TrainingArguments(str(out), max_steps=steps, per_device_train_batch_size=batch,
                             gradient_accumulation_steps=accumulate, learning_rate=1e-3, report_to=[],
                             use_cpu=True, logging_steps=2, save_strategy="no", disable_tqdm=True,
                             train_sampling_strategy="sequential", **kw)


def adamw_and_schedule(model: torch.nn.Module, total: int) -> tuple:
    """What the Trainer builds by default (adamw_torch, no weight decay, linear decay to 0 over
    ``total`` steps); ``total`` smaller than the run's steps is the schedule that reaches 0 early."""
    from transformers import get_linear_schedule_with_warmup

    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.0)
    return opt, get_linear_schedule_with_warmup(opt, 0, total)


def plain_loop(kind: str, run_dir: Path | str, steps: int = 8, batch: int = 4, accumulate: int = 2,
               max_grad_norm: float = 1.0, schedule_total: Optional[int] = None,
               model_fn: Callable[[str], torch.nn.Module] = build, dataset: Any = None) -> Any:
    """The Trainer's loop, written out, under ``gradrepro.record``: sequential micro-batches,
    ``num_items_in_batch`` (the labels counted over the step's micro-batches, shifted by one where
    the Trainer knows the model's loss shifts them: ``loss_type``) passed to the model, so the
    micro-batch losses add up to the step's loss; the gradients clipped to ``max_grad_norm``; the
    schedule stepped after the optimizer; the gradients set to None. ``dataset``: ``Tokens(kind)``
    unless given.

    The Trainer on P processes with A micro-batches of B per process is this loop with
    ``accumulate=P*A``, ``batch=B``: the item count is summed over the processes
    (``average_tokens_across_devices``), each process's loss is multiplied by P where the model
    takes loss kwargs, and DDP averages the gradients over the P processes, so the P*A micro-batch
    losses add up (a model that ignores ``num_items_in_batch`` and returns a mean then gets P times
    the gradient it gets on one process)."""
    from transformers.loss.loss_utils import LOSS_MAPPING, ForCausalLMLoss

    model = model_fn(kind)
    model.train()
    shifts = LOSS_MAPPING.get(getattr(model, "loss_type", None)) is ForCausalLMLoss
    opt, sched = adamw_and_schedule(model, schedule_total or steps)
    data = Tokens(kind) if dataset is None else dataset
    loader = itertools.cycle(torch.utils.data.DataLoader(data, batch_size=batch))
    with gradrepro.record(model, opt, run_dir, every=1, steps=steps) as rec:
        for _ in range(steps):
            micro = [next(loader) for _ in range(accumulate)]
            counted = [b["labels"][..., 1:] if shifts else b["labels"] for b in micro]
            items = sum(c.ne(-100).sum() for c in counted)
            total = 0.0
            for b in micro:
                loss = model(**b, num_items_in_batch=items).loss
                loss.backward()
                total += loss.detach()
            if max_grad_norm > 0:
                torch.nn.utils.clip_grad_norm_(model.parameters(), max_grad_norm)
            opt.step()
            sched.step()
            model.zero_grad()
            rec.log(loss=total)
    return rec


def mean_loop(kind: str, run_dir: Path | str, steps: int = 8, batch: int = 4, accumulate: int = 2,
              model_fn: Callable[[str], torch.nn.Module] = build, dataset: Any = None) -> Any:
    """The Accelerate example's loop in plain torch under ``gradrepro.record``: each micro-batch's
    mean loss divided by ``accumulate`` (``accelerator.backward``), the gradients clipped to 1 after
    the last backward, AdamW with weight decay 0.1, a linear schedule over ``steps``. On P
    processes with micro-batches of B the example is this loop with micro-batches of P*B: DDP
    averages the P means of equal-sized halves."""
    from transformers import get_linear_schedule_with_warmup

    model = model_fn(kind)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1)
    sched = get_linear_schedule_with_warmup(opt, 0, steps)
    data = Tokens(kind) if dataset is None else dataset
    micro = itertools.cycle(torch.utils.data.DataLoader(data, batch_size=batch))
    with gradrepro.record(model, opt, run_dir, every=1, steps=steps) as rec:
        for _ in range(steps):
            for _ in range(accumulate):
                (model(**next(micro)).loss / accumulate).backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            sched.step()
            opt.zero_grad()
    return rec
