"""What live checking costs at a logging interval, with its spread: torchvision's ResNet-18
(weights=None) on 32x32 inputs, batch 16, SGD with momentum, the README's loop; each round runs
the bare loop, recording without live checks and recording with them, one block of ``--steps``
steps each, in a rotated order, each on its own copy of the model; CPU time of the training
thread (``time.thread_time``, robust to other processes' load). Prints per round the ratios to
the bare loop of the same round, then their median, minimum and maximum.

    python benchmarks/live_overhead.py [--every 16] [--rounds 7] [--steps 48] [--json OUT.json]

Run it on two checkouts (PYTHONPATH set to each) to compare before and after a change.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time

import torch

import gradrepro


def block(name: str, every: int, steps: int, data, folder: str) -> float:
    from torchvision.models import resnet18
    torch.manual_seed(0)
    model = resnet18(weights=None, num_classes=10)
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    rec = None if name == "bare" else gradrepro.record(model, opt, folder, every=every, live=name == "live",
                                                       on_finding="log", activations=False)
    start = time.thread_time()
    for i in range(steps):
        x, y = data[i % len(data)]
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
    spent = (time.thread_time() - start) / steps
    if rec is not None:
        rec.close()
    return spent


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--every", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--steps", type=int, default=48)
    ap.add_argument("--json")
    args = ap.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    data = [(torch.randn(16, 3, 32, 32), torch.randint(0, 10, (16,))) for _ in range(4)]
    names = ["bare", "record", "live"]
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        block("bare", args.every, 4, data, f"{tmp}/warm")  # warm-up, discarded
        for r in range(args.rounds):
            order = names[r % 3:] + names[:r % 3]
            times = {n: block(n, args.every, args.steps, data, f"{tmp}/{n}{r}") for n in order}
            rows.append(times)
            print(f"round {r}: bare {times['bare']:.4f} s/step; record {times['record'] / times['bare']:.4f}; "
                  f"live {times['live'] / times['bare']:.4f}; live/record {times['live'] / times['record']:.4f}",
                  flush=True)
    out = {"every": args.every, "steps": args.steps, "rounds": rows, "gradrepro": gradrepro.__file__}
    for what, num, den in (("record_vs_bare", "record", "bare"), ("live_vs_bare", "live", "bare"),
                           ("live_vs_record", "live", "record")):
        ratios = [row[num] / row[den] for row in rows]
        out[what] = {"median": statistics.median(ratios), "min": min(ratios), "max": max(ratios)}
        print(f"{what}: median {out[what]['median']:.4f}, min {out[what]['min']:.4f}, max {out[what]['max']:.4f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
