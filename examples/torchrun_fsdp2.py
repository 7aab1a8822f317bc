"""gradrepro.record under FSDP2 (``fully_shard``), launched by torchrun.

    torchrun --nproc_per_node=2 examples/torchrun_fsdp2.py runs/fsdp2 [--steps 200] [--bf16]

CPU (gloo) as written; on GPUs use the nccl backend and ``init_device_mesh("cuda", ...)``.
Each process holds half of every tensor; the recorder, created after sharding, records the full
tensors' statistics (one all-reduce of a few numbers per tensor per logged step); rank 0 writes.
"""

from __future__ import annotations

import argparse
import contextlib

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

import gradrepro


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("run_dir")
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--every", type=int, default=16)
    parser.add_argument("--bf16", action="store_true", help="bf16 autocast")
    args = parser.parse_args()
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 3))
    mesh = init_device_mesh("cpu", (world,))
    for layer in (model[0], model[2]):
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    autocast = (lambda: torch.autocast("cpu", dtype=torch.bfloat16)) if args.bf16 else contextlib.nullcontext
    with gradrepro.record(model, optimizer, args.run_dir, every=args.every, steps=args.steps) as rec:
        for step in range(args.steps):
            g = torch.Generator().manual_seed(step)  # the global batch of 32; each rank takes its share
            x, y = torch.randn(32, 6, generator=g), torch.randint(0, 3, (32,), generator=g)
            share = 32 // world
            x, y = x[rank * share:(rank + 1) * share], y[rank * share:(rank + 1) * share]
            optimizer.zero_grad()
            with autocast():
                loss = F.cross_entropy(model(x).float(), y)
            loss.backward()
            optimizer.step()
            rec.log(loss=loss)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
