"""gradrepro.transformers.Record in the Hugging Face Trainer, one process or several.

    python examples/trainer.py runs/trainer [--model causal_lm|classifier] [--steps 8]
    torchrun --nproc_per_node=2 examples/trainer.py runs/trainer2 --batch 2   (CPU: gloo)

The line a Trainer script adds is marked ``# gradrepro``. With two processes and ``--batch 2``
each optimizer step sees the same global batches as one process with ``--batch 4`` (the
Trainer's sequential sampler, Accelerate's batch sharding). The causal LM's run folders then
hold the same per-module numbers; the classifier's gradients on two processes are twice those
on one: its loss is a mean that ignores ``num_items_in_batch``, and the Trainer multiplies each
process's loss by the number of processes (``average_tokens_across_devices``) before DDP
averages them. The record shows the gradients the Trainer makes.
"""

from __future__ import annotations

import argparse

import torch
from accelerate_loop import batches, build  # the tiny models and data of the Accelerate example
from transformers import Trainer, TrainingArguments

from gradrepro.transformers import Record


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("run_dir")
    parser.add_argument("--model", choices=("causal_lm", "classifier"), default="causal_lm")
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--batch", type=int, default=4, help="per process and micro-batch")
    parser.add_argument("--accumulate", type=int, default=2)
    parser.add_argument("--every", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(1)
    training = TrainingArguments(
        args.run_dir + "-trainer", max_steps=args.steps, per_device_train_batch_size=args.batch,
        gradient_accumulation_steps=args.accumulate, learning_rate=1e-3, report_to=[], use_cpu=True,
        ddp_backend="gloo", logging_steps=2, save_strategy="no", disable_tqdm=True,
        train_sampling_strategy="sequential")
    trainer = Trainer(model=build(args.model), args=training, train_dataset=batches(args.model),
                      callbacks=[Record(args.run_dir, every=args.every)])  # gradrepro
    trainer.train()


if __name__ == "__main__":
    main()
