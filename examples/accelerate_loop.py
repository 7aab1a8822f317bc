"""gradrepro.record in a Hugging Face Accelerate loop: ``accelerator.accumulate()``,
``accelerator.backward`` and ``accelerator.clip_grad_norm_``, one process or several.

    python examples/accelerate_loop.py runs/accelerate [--model causal_lm|classifier] [--steps 8]
    torchrun --nproc_per_node=2 examples/accelerate_loop.py runs/accelerate2   (CPU: gloo)

The two lines a loop adds are marked ``# gradrepro``. Record the optimizer Accelerate wraps
(``optimizer.optimizer``): its ``step()`` runs once per ``gradient_accumulation_steps``
micro-batches, after the gradient sync and the clipping, so one step of the record is one
optimizer step. ``--bug`` injects a bug for the tests: ``lr_zero`` (the schedule's total steps
half the run's: the rate is 0 from the middle on) or ``frozen`` (a layer frozen at the middle
step and left in the optimizer, while the loop zeroes gradients with ``set_to_none=False``:
AdamW's weight decay goes on moving it).
"""

from __future__ import annotations

import argparse
import itertools

import torch

import gradrepro


def build(kind: str) -> torch.nn.Module:
    """A 2-layer, hidden-32 Hugging Face model from its config (nothing downloaded), no dropout."""
    from transformers import BertConfig, BertForSequenceClassification, GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    if kind == "causal_lm":
        return GPT2LMHeadModel(GPT2Config(vocab_size=64, n_positions=16, n_embd=32, n_layer=2, n_head=2,
                                          resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                                          bos_token_id=0, eos_token_id=0))
    return BertForSequenceClassification(BertConfig(
        vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64,
        max_position_embeddings=16, num_labels=3, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0))


def batches(kind: str, items: int = 64) -> list[dict]:
    g = torch.Generator().manual_seed(1)
    x = torch.randint(1, 64, (items, 8), generator=g)
    y = torch.randint(0, 3, (items,), generator=g)
    return [{"input_ids": x[i], "labels": x[i] if kind == "causal_lm" else y[i]} for i in range(items)]


def first_block(model: torch.nn.Module) -> torch.nn.Module:
    return model.transformer.h[0].mlp if hasattr(model, "transformer") else model.bert.encoder.layer[0].intermediate


def main() -> None:
    from accelerate import Accelerator
    from transformers import get_linear_schedule_with_warmup

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("run_dir")
    parser.add_argument("--model", choices=("causal_lm", "classifier"), default="causal_lm")
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--batch", type=int, default=4, help="per process and micro-batch")
    parser.add_argument("--accumulate", type=int, default=2)
    parser.add_argument("--every", type=int, default=1)
    parser.add_argument("--bug", choices=("none", "lr_zero", "frozen"), default="none")
    args = parser.parse_args()

    accelerator = Accelerator(gradient_accumulation_steps=args.accumulate, cpu=True)
    model = build(args.model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1)
    # A prepared scheduler steps once per process per optimizer step (Accelerate's default).
    total = args.steps * accelerator.num_processes // (2 if args.bug == "lr_zero" else 1)
    scheduler = get_linear_schedule_with_warmup(optimizer, 0, total)
    loader = torch.utils.data.DataLoader(batches(args.model), batch_size=args.batch)
    model, optimizer, loader, scheduler = accelerator.prepare(model, optimizer, loader, scheduler)

    rec = gradrepro.record(model, optimizer.optimizer, args.run_dir, every=args.every,  # gradrepro
                           steps=args.steps)
    with rec:
        micro = itertools.cycle(loader)
        for step in range(args.steps):
            if args.bug == "frozen" and step == args.steps // 2:
                first_block(accelerator.unwrap_model(model)).requires_grad_(False)
            losses = []
            for _ in range(args.accumulate):
                with accelerator.accumulate(model):
                    loss = model(**next(micro)).loss
                    accelerator.backward(loss)  # divides by gradient_accumulation_steps
                    if accelerator.sync_gradients:
                        accelerator.clip_grad_norm_(model.parameters(), 1.0)
                    optimizer.step()  # a no-op until the last micro-batch
                    scheduler.step()
                    optimizer.zero_grad(set_to_none=args.bug != "frozen")
                    losses.append(loss.detach())
            rec.log(loss=torch.stack(losses).mean())  # gradrepro (optional): the step's loss
    if accelerator.is_main_process:
        for finding in rec.findings():
            print(finding)


if __name__ == "__main__":
    main()
