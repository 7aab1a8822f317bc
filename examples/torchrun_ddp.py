"""gradrepro.record under DistributedDataParallel, launched by torchrun.

    torchrun --nproc_per_node=2 examples/torchrun_ddp.py runs/ddp [--steps 200]

CPU (gloo) as written; on GPUs use the nccl backend and move the model and batches to
``cuda:LOCAL_RANK``. Every process creates the recorder after wrapping the model; rank 0 writes
the run folder, whose per-module statistics are those of the full, synchronised gradients.
"""

from __future__ import annotations

import argparse

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

import gradrepro


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("run_dir")
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--every", type=int, default=16)
    args = parser.parse_args()
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = nn.parallel.DistributedDataParallel(nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 3)))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    with gradrepro.record(model, optimizer, args.run_dir, every=args.every, steps=args.steps) as rec:
        for step in range(args.steps):
            g = torch.Generator().manual_seed(step)  # the global batch of 32; each rank takes its share
            x, y = torch.randn(32, 6, generator=g), torch.randint(0, 3, (32,), generator=g)
            share = 32 // world
            x, y = x[rank * share:(rank + 1) * share], y[rank * share:(rank + 1) * share]
            optimizer.zero_grad()
            loss = F.cross_entropy(model(x), y)
            loss.backward()
            optimizer.step()
            rec.log(loss=loss)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
