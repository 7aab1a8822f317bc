"""Where the probe's time goes, in CPU time of the one training thread (robust to a busy
machine, unlike wall clock): the probe at every step against the bare loop, per segment of
the runner's step, interleaved, medians.

    python benchmarks/probe_segments.py MODEL [BATCH] [--rounds R]
"""

from __future__ import annotations

import argparse
import copy
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from tools import MODELS, Bare, ProbeTool, make_batch  # noqa: E402

SEGMENTS = ("arm", "forward", "backward", "collect", "opt", "after_step")


def timed_step(tool: Bare, probe: bool) -> dict:
    clock = time.thread_time
    seg, last = {}, clock()

    def mark(name: str) -> None:
        nonlocal last
        now = clock()
        seg[name], last = now - last, now

    recorder = tool.probe.step(0, lr=tool.opt.param_groups[0]["lr"]) if probe else None
    tool.opt.zero_grad(set_to_none=True)
    if probe:
        recorder.__enter__()  # arms the hooks, keeps what .grad carries in
    mark("arm")
    loss = tool.loss_fn(tool.net(tool.x), tool.y)
    float(loss.detach())
    mark("forward")
    loss.backward()
    mark("backward")
    if probe:
        recorder.collect()
    mark("collect")
    tool.opt.step()
    mark("opt")
    if probe:
        recorder.__exit__(None, None, None)  # disarms; update ratios and the one transfer
    mark("after_step")
    return seg


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("model", choices=list(MODELS))
    p.add_argument("batch", type=int, nargs="?")
    p.add_argument("--rounds", type=int, default=8)
    args = p.parse_args()
    torch.set_num_threads(1)
    builder, shape, default_batch, _ = MODELS[args.model]
    batch = args.batch or default_batch
    torch.manual_seed(0)
    base = builder()
    data = make_batch(shape, batch)
    tools = [(Bare(copy.deepcopy(base), data), False),
             (ProbeTool(copy.deepcopy(base), data, every=1), True)]
    res: list = [[], []]
    for r in range(args.rounds + 1):  # round 0 is the warm-up
        for i, (tool, probe) in enumerate(tools):
            for _ in range(2):
                seg = timed_step(tool, probe)
                if r:
                    res[i].append(seg)
    med = [{k: statistics.median(s[k] for s in runs) for k in SEGMENTS} for runs in res]
    for k in SEGMENTS:
        print(f"{k:10s} bare {1e3 * med[0][k]:8.2f} ms  probe {1e3 * med[1][k]:8.2f} ms  "
              f"added {1e3 * (med[1][k] - med[0][k]):7.2f} ms")
    tb, tp = sum(med[0].values()), sum(med[1].values())
    print(f"TOTAL {args.model} batch {batch}: bare {1e3 * tb:.1f} ms  probe {1e3 * tp:.1f} ms  "
          f"added {1e3 * (tp - tb):.1f} ms  ratio {tp / tb:.3f}")


if __name__ == "__main__":
    main()
