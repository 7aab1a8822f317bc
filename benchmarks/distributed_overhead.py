"""What ``gradrepro.record`` costs under DDP: two processes on CPU (gloo), each training two
DDP copies of one model, one bare and one recorded, interleaved in blocks of ``every`` steps;
per step the wall clock and the training thread's CPU time, medians over the rounds after a
warm-up round; logged and unlogged steps apart, and over the schedule.

    python benchmarks/distributed_overhead.py [MODEL] [BATCH] [--every 1 16] [--rounds R]

The loop is the README's (zero_grad, forward, loss, backward, step, ``rec.log(loss=loss)``) on
each process's half of the batch. Rank 0 prints one row per ``every``.
"""

from __future__ import annotations

import argparse
import copy
import datetime
import json
import os
import socket
import statistics
import sys
import tempfile
from pathlib import Path

import torch
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from overhead import MODELS, make_batch  # noqa: E402
from record_overhead import timed_step  # noqa: E402

import gradrepro  # noqa: E402

WORLD = 2


def worker(rank: int, port: int, args, out: str) -> None:
    torch.set_num_threads(1)
    torch.distributed.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                                         world_size=WORLD, timeout=datetime.timedelta(seconds=300))
    builder, shape, default_batch, _ = MODELS[args.model]
    torch.manual_seed(0)
    base = builder()
    x, y = make_batch(shape, args.batch or default_batch)
    loss_fn = torch.nn.CrossEntropyLoss()
    rows = []
    for every in args.every:
        nets = [torch.nn.parallel.DistributedDataParallel(copy.deepcopy(base)) for _ in range(2)]
        opts = [torch.optim.SGD(n.parameters(), lr=0.01, momentum=0.9) for n in nets]
        with tempfile.TemporaryDirectory() as folder:
            rec = gradrepro.record(nets[1], opts[1], Path(folder) / "run", every=every)
            bare, unlogged, logged = [], [], []
            block = max(every, 4)
            for r in range(args.rounds + 1):  # round 0 is the warm-up
                times = [timed_step(nets[0], opts[0], loss_fn, x, y) for _ in range(block)]
                mine = [(rec.step, timed_step(nets[1], opts[1], loss_fn, x, y, rec)) for _ in range(block)]
                if r:
                    bare += times
                    for step, t in mine:
                        (logged if step % every == 0 else unlogged).append(t)
            rec.close()
        rows.append(summarise(every, bare, unlogged, logged))
    if rank == 0:
        Path(out).write_text(json.dumps(rows))
    torch.distributed.destroy_process_group()


def summarise(every, bare, unlogged, logged):
    row = {"every": every}
    for i, clock in enumerate(("wall", "cpu")):
        b = statistics.median(t[i] for t in bare)
        lg = statistics.median(t[i] for t in logged)
        un = statistics.median(t[i] for t in unlogged) if unlogged else lg  # every=1: no unlogged step
        row[clock] = {"bare_ms": 1e3 * b, "unlogged": un / b if unlogged else None, "logged": lg / b,
                      "schedule": (lg + (every - 1) * un) / every / b}
    return row


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("model", nargs="?", default="cifar10_3c3d", choices=list(MODELS))
    p.add_argument("batch", type=int, nargs="?", help="per process")
    p.add_argument("--every", type=int, nargs="+", default=[1, 16])
    p.add_argument("--rounds", type=int, default=4)
    args = p.parse_args()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with tempfile.TemporaryDirectory() as folder:
        out = os.path.join(folder, "rows.json")
        ctx = mp.start_processes(worker, args=(port, args, out), nprocs=WORLD, join=False, start_method="spawn")
        try:
            while not ctx.join():
                pass
        finally:
            for proc in ctx.processes:
                if proc.is_alive():
                    proc.terminate()
                proc.join(5)
        rows = json.loads(Path(out).read_text())
    print(f"{args.model}, batch {args.batch or MODELS[args.model][2]} per process, {WORLD} processes (gloo), "
          f"{args.rounds} rounds, load average {os.getloadavg()[0]:.1f}")
    print("| every | clock | bare ms/step | unlogged | logged | over the schedule |")
    print("|------:|:------|-------------:|---------:|-------:|------------------:|")
    for row in rows:
        for clock in ("wall", "cpu"):
            c = row[clock]
            unlogged = "-" if c["unlogged"] is None else f"{c['unlogged']:.3f}x"
            print(f"| {row['every']} | {clock} | {c['bare_ms']:.1f} | {unlogged} | {c['logged']:.3f}x "
                  f"| {c['schedule']:.3f}x |")


if __name__ == "__main__":
    main()
