"""What ``gradrepro.record`` costs in a user's own loop, in CPU time of the one training thread
(robust to a busy machine, unlike wall clock): a plain loop against the same loop recorded,
each on its own copy of the model, interleaved, medians; unlogged and logged steps apart.

    python benchmarks/record_overhead.py [MODEL] [BATCH] [--every E] [--rounds R]

The loop is the README's: zero_grad, forward, loss, backward, step, then ``rec.log(loss=loss)``.
"""

from __future__ import annotations

import argparse
import copy
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from overhead import MODELS, make_batch  # noqa: E402

import gradrepro  # noqa: E402


def timed_step(net, opt, loss_fn, x, y, rec=None) -> tuple:
    """One step of the README's loop (recorded when ``rec`` is given): (wall, CPU) seconds,
    the CPU time of the training thread alone."""
    wall, cpu = time.perf_counter(), time.thread_time()
    opt.zero_grad(set_to_none=True)
    loss = loss_fn(net(x), y)
    loss.backward()
    opt.step()
    if rec is not None:
        rec.log(loss=loss)
    return time.perf_counter() - wall, time.thread_time() - cpu


def loop_step(net, opt, loss_fn, x, y, rec=None) -> float:
    return timed_step(net, opt, loss_fn, x, y, rec)[1]


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("model", nargs="?", default="cifar10_3c3d", choices=list(MODELS))
    p.add_argument("batch", type=int, nargs="?")
    p.add_argument("--every", type=int, default=16)
    p.add_argument("--rounds", type=int, default=6)
    args = p.parse_args()
    torch.set_num_threads(1)
    builder, shape, default_batch, _ = MODELS[args.model]
    torch.manual_seed(0)
    base = builder()
    x, y = make_batch(shape, args.batch or default_batch)
    loss_fn = torch.nn.CrossEntropyLoss()
    nets = [copy.deepcopy(base), copy.deepcopy(base)]
    opts = [torch.optim.SGD(n.parameters(), lr=0.01, momentum=0.9) for n in nets]
    with tempfile.TemporaryDirectory() as folder:
        rec = gradrepro.record(nets[1], opts[1], Path(folder) / "run", every=args.every)
        bare, unlogged, logged = [], [], []
        for r in range(args.rounds + 1):  # round 0 is the warm-up
            times = [loop_step(nets[0], opts[0], loss_fn, x, y) for _ in range(args.every)]
            mine = [(rec.step, loop_step(nets[1], opts[1], loss_fn, x, y, rec)) for _ in range(args.every)]
            if r:
                bare += times
                unlogged += [t for s, t in mine if s % args.every]
                logged += [t for s, t in mine if s % args.every == 0]
        rec.close()
    b, u, lg = (statistics.median(v) for v in (bare, unlogged, logged))
    print(f"{args.model} batch {args.batch or default_batch}, every {args.every}: bare {1e3 * b:.2f} ms/step; "
          f"recorded, unlogged {1e3 * u:.2f} ms ({u / b:.3f}x), logged {1e3 * lg:.2f} ms ({lg / b:.3f}x); "
          f"per step over the schedule {((args.every - 1) * u + lg) / args.every / b:.3f}x")


if __name__ == "__main__":
    main()
