"""What live checking costs at a logging interval, with its spread: torchvision's ResNet-18
(weights=None) on 32x32 inputs, batch 16, SGD with momentum, the README's loop; each round runs
the bare loop, recording without live checks and recording with them, one block of ``--steps``
steps each, in a rotated order, each on its own copy of the model; CPU time of the training
thread (``time.thread_time``, robust to other processes' load). Prints per round the ratios to
the bare loop of the same round, then their median, minimum and maximum.

    python benchmarks/live_overhead.py [--every 16] [--rounds 7] [--steps 48] [--json OUT.json]
    python benchmarks/live_overhead.py --unlogged [--steps 200]

``--unlogged``: the live checks' own work on a step that is not logged (the fingerprints:
``Watch.each_begin``, ``each_before_step``, ``each_after_step``), timed alone on the same
model against the bare step, median of ``--steps`` repetitions (CPU time of the thread).

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


def unlogged(steps: int, data) -> dict:
    from torchvision.models import resnet18
    torch.manual_seed(0)
    model = resnet18(weights=None, num_classes=10)
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    bare = []
    for i in range(20):
        x, y = data[i % len(data)]
        start = time.thread_time()
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
        bare.append(time.thread_time() - start)
    with tempfile.TemporaryDirectory() as tmp:
        rec = gradrepro.record(model, opt, f"{tmp}/run", every=10**6, on_finding="log", activations=False, hooks=False)
        live, checks = rec.watch, []
        for step in range(1, steps + 1):
            start = time.thread_time_ns()
            live.each_begin(step, False)
            live.each_before_step()
            live.each_after_step(step, False)
            checks.append((time.thread_time_ns() - start) / 1e9)
        # What the invariants add on a logged step (the gradients of the last bare step in place):
        # the backward trail's two reads and the update rule's prediction and comparison.
        # As in the README's loop: zero_grad() set the gradients to None before the backward, and
        # the gradients' norms at its end are the live checks' own (read before this change too).
        live.rule.enabled, logged = True, []
        params = live.probe.params
        grads = [p.grad for p in params]
        idx = [i for i, g in enumerate(grads) if g is not None]
        end = (idx, list(torch._foreach_norm([grads[i] for i in idx])))
        for step in range(1, 21):
            for p in params:
                p.grad = None
            start = time.thread_time_ns()
            live.trail.reset_step()
            live.trail.begins()
            spent = time.thread_time_ns() - start
            for p, g in zip(params, grads):
                p.grad = g
            start = time.thread_time_ns()
            live.trail.ends(end)
            live.trail.stop()
            live.rule.predict()
            live.rule.compare(step)
            logged.append((time.thread_time_ns() - start + spent) / 1e9)
        rec.close()
    b, c, lg = statistics.median(bare), statistics.median(checks), statistics.median(logged)
    print(f"bare step {b * 1e3:.2f} ms (CPU); live checks on an unlogged step {c * 1e6:.1f} us (CPU, median of "
          f"{steps}): {c / b:.5f} of the step; the invariants' extra work on a logged step {lg * 1e3:.2f} ms "
          f"({lg / b:.4f} of a step); {len(live.invariants.prints.params)} tensors")
    return {"bare_step_s": b, "unlogged_checks_s": c, "ratio": c / b, "logged_extra_s": lg}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--every", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--steps", type=int, default=48)
    ap.add_argument("--json")
    ap.add_argument("--unlogged", action="store_true")
    args = ap.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    data = [(torch.randn(16, 3, 32, 32), torch.randint(0, 10, (16,))) for _ in range(4)]
    if args.unlogged:
        unlogged(args.steps, data)
        return
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
