"""What a logged step costs with and without the cap on the activation statistics' values
(``gradrepro.record(act_values=...)``): the plain loop of a GPT-2 built from its config (the
model of ``trainer_overhead.py``: 4 layers, hidden 128, 64 tokens, batch 8), AdamW, every step
logged (``every=1``), one torch thread. Four arms, each on a fresh model per round, in an order
shuffled per round: the bare loop, ``act_values=0`` (every value of the 8 examples),
the default cap, and ``activations=False``. Per step the training thread's CPU time
(``time.thread_time``); the first 4 steps of each arm's round are dropped (warm-up); medians per
arm over every round's steps, and the median of the per-round differences from the bare arm.

    python benchmarks/act_values_cost.py [--rounds 9] [--steps 20] [--layers 4] [--hidden 128] [--length 64]
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def main() -> None:
    import gradrepro
    from transformers import GPT2Config, GPT2LMHeadModel

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--length", type=int, default=64)
    args = parser.parse_args()
    torch.set_num_threads(1)
    tokens = torch.randint(0, 1024, (8, args.length), generator=torch.Generator().manual_seed(1))
    arms = {"bare": None, "act_values=0": dict(act_values=0), "default cap": {},
            "activations=False": dict(activations=False)}
    per_step = {k: [] for k in arms}
    per_round = {k: [] for k in arms}
    folder = Path(tempfile.mkdtemp())
    order = random.Random(0)
    for r in range(args.rounds):
        names = list(arms)
        order.shuffle(names)
        for name in names:
            torch.manual_seed(0)
            model = GPT2LMHeadModel(GPT2Config(vocab_size=1024, n_positions=args.length, n_embd=args.hidden,
                                               n_layer=args.layers, n_head=4,
                                               bos_token_id=0, eos_token_id=0))
            opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
            opts = arms[name]
            rec = None if opts is None else gradrepro.record(model, opt, folder / f"{r}_{len(per_round[name])}_{name}",
                                                             every=1, on_finding="log", **opts)
            times = []
            for step in range(args.steps):
                start = time.thread_time()
                opt.zero_grad()
                model(input_ids=tokens, labels=tokens).loss.backward()
                opt.step()
                if step >= 4:
                    times.append(time.thread_time() - start)
            if rec is not None:
                rec.close()
            per_step[name] += times
            per_round[name].append(statistics.median(times))
    bare = per_round["bare"]
    print(f"GPT-2 {args.layers} layers, hidden {args.hidden}, {args.length} tokens x batch 8, every=1, {args.rounds} rounds x {args.steps - 4} "
          f"timed steps, torch {torch.__version__}")
    for name in arms:
        added = [m - b for m, b in zip(per_round[name], bare)]
        print(f"{name:18s} median step {1000 * statistics.median(per_step[name]):7.1f} ms   added (median of rounds) "
              f"{1000 * statistics.median(added):6.1f} ms   rounds {min(added) * 1000:.1f} to {max(added) * 1000:.1f}")


if __name__ == "__main__":
    main()
