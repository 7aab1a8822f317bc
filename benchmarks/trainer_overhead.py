"""What ``gradrepro.transformers.Record`` costs inside the Hugging Face Trainer: ``train()`` of a
GPT-2 built from its config, with and without the callback, each round on a fresh copy of the
same model and data, interleaved (plain, recorded, plain, ...), in CPU time of the process (one
torch thread; robust to a busy machine, unlike wall clock); medians and the ratio.

    python benchmarks/trainer_overhead.py [--every 16] [--steps 64] [--rounds 5] [--layers 4] [--hidden 128]
                                          [--no-activations]

The Trainer logs every ``--every`` steps too (``logging_steps``), so the callback's findings go
into the log as often as its probe records. The callback's set-up (building the probe, reading
the model's classes) and its end (the last write, the figure) are inside the timed ``train()``.
A timing callback listed before the Record also reads the CPU clock at the first step's
``on_step_begin`` and at ``on_train_end`` (before the Record's own): the steps alone, so the
per-step cost and the once-per-run cost (``train()`` less the steps) are told apart.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def run(recorded: bool, args: argparse.Namespace, folder: Path, round_: int) -> tuple[float, float]:
    """One ``train()``: its process CPU seconds, and those from the first step to the end of training."""
    from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainerCallback, TrainingArguments

    from gradrepro.transformers import Record

    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(vocab_size=1024, n_positions=args.length, n_embd=args.hidden,
                                       n_layer=args.layers, n_head=4, bos_token_id=0, eos_token_id=0))
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, 1024, (args.batch * 2 * args.steps, args.length), generator=g)
    data = [{"input_ids": t, "labels": t} for t in tokens]
    training = TrainingArguments(str(folder / f"out{round_}"), max_steps=args.steps,
                                 per_device_train_batch_size=args.batch, gradient_accumulation_steps=2,
                                 report_to=[], use_cpu=True, logging_steps=args.every, save_strategy="no",
                                 disable_tqdm=True, train_sampling_strategy="sequential")
    class Steps(TrainerCallback):  # listed first: its events run before the Record's
        begin = end = 0.0

        def on_step_begin(self, *a, **k):
            self.begin = self.begin or time.process_time()

        def on_train_end(self, *a, **k):
            self.end = time.process_time()

    steps = Steps()
    record = Record(folder / f"run{round_}", every=args.every, activations=args.activations) if recorded else None
    callbacks = [steps] + ([record] if recorded else [])
    trainer = Trainer(model=model, args=training, train_dataset=data, callbacks=callbacks)
    start = time.process_time()
    trainer.train()
    return time.process_time() - start, steps.end - steps.begin


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--every", type=int, default=16)
    parser.add_argument("--steps", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--length", type=int, default=64)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--no-activations", dest="activations", action="store_false",
                        help="Record(activations=False): no activation statistics (the default records them)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    import transformers

    transformers.logging.set_verbosity_error()
    times: dict[bool, list[float]] = {False: [], True: []}
    spans: dict[bool, list[float]] = {False: [], True: []}
    with tempfile.TemporaryDirectory() as tmp:
        run(False, args, Path(tmp), -1)  # warm-up: imports, allocator
        for r in range(args.rounds):
            for recorded in (False, True):
                total, span = run(recorded, args, Path(tmp), 2 * r + recorded)
                times[recorded].append(total)
                spans[recorded].append(span)
    plain, rec = statistics.median(times[False]), statistics.median(times[True])
    plain_steps, rec_steps = statistics.median(spans[False]), statistics.median(spans[True])
    once = statistics.median([(t - s) for t, s in zip(times[True], spans[True])]) - \
        statistics.median([(t - s) for t, s in zip(times[False], spans[False])])
    load = os.getloadavg()
    print(f"GPT-2 {args.layers} layers, hidden {args.hidden}, {args.length} tokens x batch {args.batch} x "
          f"accumulation 2, {args.steps} steps, every={args.every}, activations={args.activations}, "
          f"{args.rounds} interleaved rounds, "
          f"torch {torch.__version__}, transformers {transformers.__version__}")
    print(f"train() CPU s, median: without {plain:.3f}, with the callback {rec:.3f}; ratio {rec / plain:.4f}")
    print(f"the steps alone (first step to on_train_end), median: without {plain_steps:.3f}, with "
          f"{rec_steps:.3f}; ratio {rec_steps / plain_steps:.4f}")
    print(f"once per run (train() less the steps), median with less median without: {once:.3f} s")
    print("rounds without:", " ".join(f"{t:.3f}/{s:.3f}" for t, s in zip(times[False], spans[False])))
    print("rounds with:   ", " ".join(f"{t:.3f}/{s:.3f}" for t, s in zip(times[True], spans[True])))
    print(f"load average (1, 5, 15 min) at the end: {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}")


if __name__ == "__main__":
    main()
