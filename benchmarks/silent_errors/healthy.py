"""Healthy real-code models, trained correctly, for the benchmark's false positives: any live
finding on one of them is a false alarm. Each is ``fn(ok, record) -> -1`` like a case (``ok``
is ignored: there is no buggy form)."""

from __future__ import annotations

import os
import tempfile
import time
from queue import Empty

import torch
import torch.multiprocessing as mp
import torch.nn.functional as F
from cases import LoRALinear
from harness import STEPS, Recording, batch, mlp
from torch import nn

HEALTHY: dict[str, object] = {}


def healthy(fn):
    HEALTHY[fn.__name__] = fn
    return fn


@healthy
def resnet18(_, record):
    """torchvision's ResNet-18 (weights=None), 16x16 inputs, SGD with momentum and weight decay."""
    from torchvision.models import resnet18 as build
    model = build(weights=None, num_classes=4)
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9, weight_decay=5e-4)
    record(model, opt)
    for _ in range(STEPS // 2):
        x, y = torch.randn(8, 3, 16, 16), torch.randint(0, 4, (8,))
        opt.zero_grad(set_to_none=True)
        F.cross_entropy(model(x), y).backward()
        opt.step()
    return -1


@healthy
def transformer_encoder(_, record):
    """nn.TransformerEncoder with dropout, AdamW, linear warm-up from 0, gradient clipping."""
    class Classifier(nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = nn.Embedding(50, 32)
            layer = nn.TransformerEncoderLayer(32, 4, 64, dropout=0.1, batch_first=True)
            self.encoder = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
            self.head = nn.Linear(32, 2)

        def forward(self, tokens):
            return self.head(self.encoder(self.embed(tokens)).mean(1))

    model = Classifier()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, s / 10))  # lr 0 at step 0 by design
    record(model, opt)
    for _ in range(STEPS):
        tokens = torch.randint(0, 50, (8, 12))
        opt.zero_grad()
        F.cross_entropy(model(tokens), (tokens[:, 0] % 2)).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
    return -1


@healthy
def tied_lstm_lm(_, record):
    """A word-level LSTM language model with tied input and output embeddings (Press & Wolf
    2017), truncated BPTT with detached hidden state, as in PyTorch's word_language_model."""
    class LM(nn.Module):
        def __init__(self, vocab=40, dim=24):
            super().__init__()
            self.embed, self.drop = nn.Embedding(vocab, dim), nn.Dropout(0.2)
            self.lstm, self.out = nn.LSTM(dim, dim, batch_first=True), nn.Linear(dim, vocab)
            self.out.weight = self.embed.weight

        def forward(self, tokens, state=None):
            h, state = self.lstm(self.drop(self.embed(tokens)), state)
            return self.out(self.drop(h)), state

    model = LM()
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    record(model, opt)
    state = None
    for _ in range(STEPS):
        tokens = torch.randint(0, 40, (4, 11))
        opt.zero_grad()
        if state is not None:
            state = tuple(s.detach() for s in state)
        logits, state = model(tokens[:, :-1], state)
        F.cross_entropy(logits.reshape(-1, 40), tokens[:, 1:].reshape(-1)).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 0.25)
        opt.step()
    return -1


@healthy
def lora_adapters(_, record):
    """Two LoRA-adapted layers over a frozen base (B initialised to zero), AdamW on the adapters."""
    model = nn.Sequential(LoRALinear(), nn.GELU(), LoRALinear())
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    record(model, opt)
    for _ in range(STEPS):
        x = torch.randn(8, 16)
        opt.zero_grad()
        F.mse_loss(model(x), x.roll(1, 1)).backward()
        opt.step()
    return -1


@healthy
def gan_two_optimizers(_, record):
    """A GAN in the DCGAN training order, recording the discriminator (its optimizer only)."""
    gen, disc = mlp(4, 16, 8), nn.Sequential(nn.Linear(8, 16), nn.LeakyReLU(0.2), nn.Dropout(0.1), nn.Linear(16, 1))
    opt_g, opt_d = torch.optim.Adam(gen.parameters(), 2e-4), torch.optim.Adam(disc.parameters(), 2e-4)
    record(disc, opt_d)
    for _ in range(STEPS):
        real, z = torch.randn(16, 8) + 2, torch.randn(16, 4)
        fake = gen(z)
        ones, zeros = torch.ones(16, 1), torch.zeros(16, 1)
        opt_d.zero_grad()
        (F.binary_cross_entropy_with_logits(disc(real), ones)
         + F.binary_cross_entropy_with_logits(disc(fake.detach()), zeros)).backward()
        opt_d.step()
        opt_g.zero_grad()
        F.binary_cross_entropy_with_logits(disc(fake), ones).backward()
        opt_g.step()
    return -1


@healthy
def gradient_accumulation(_, record):
    """Four micro-batches per optimizer step, zero_grad after each step (the documented way)."""
    model = mlp(dropout=0.1, bn=True)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    record(model, opt)
    for step in range(STEPS * 4):
        x, y = batch(8)
        (F.cross_entropy(model(x), y) / 4).backward()
        if step % 4 == 3:
            opt.step()
            opt.zero_grad()
    return -1


def _ddp_worker(rank: int, world: int, init: str, queue) -> None:
    torch.manual_seed(rank)
    torch.distributed.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    try:
        model = torch.nn.parallel.DistributedDataParallel(mlp(dropout=0.1))
        opt = torch.optim.SGD(model.parameters(), lr=0.05)
        recording = Recording()
        # Every process creates its recorder, as gradrepro.record asks under torch.distributed (the
        # first logged step waits for all of them; rank 0 writes the folder). A recorder on rank 0
        # alone waits out its timeout and names rank 1 as missing.
        record_ = recording(model, opt)
        for _ in range(STEPS // 2):
            x, y = batch(16)
            opt.zero_grad()
            F.cross_entropy(model(x), y).backward()
            opt.step()
        queue.put((rank, [f.row() for f in record_.watch.found]))
        recording.close()
    finally:
        torch.distributed.destroy_process_group()


@healthy
def ddp_two_processes(_, record):
    """An MLP under DistributedDataParallel, 2 gloo processes on CPU; each records, rank 0 writes."""
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    with tempfile.TemporaryDirectory() as tmp:
        init = f"file://{os.path.join(tmp, 'rendezvous')}"
        procs = [ctx.Process(target=_ddp_worker, args=(r, 2, init, queue)) for r in range(2)]
        rows: dict = {}
        try:
            for p in procs:
                p.start()
            # Two spawned interpreters importing torch: minutes on a loaded 2-core machine. Wait
            # while both live; a process that ended without its findings is a failure at once.
            deadline = time.monotonic() + 600
            while len(rows) < len(procs) and time.monotonic() < deadline:
                try:
                    rank, found = queue.get(timeout=5)
                    rows[rank] = found
                except Empty:
                    dead = [r for r, p in enumerate(procs) if r not in rows and p.exitcode not in (None, 0)]
                    if dead:
                        raise AssertionError(f"DDP rank(s) {dead} exited with code(s) "
                                             f"{[procs[r].exitcode for r in dead]} before reporting") from None
            if len(rows) < len(procs):
                raise AssertionError(f"DDP ranks {sorted(set(range(len(procs))) - set(rows))} did not report in 600 s")
        finally:
            for p in procs:
                p.join(timeout=30)
                if p.is_alive():
                    p.kill()
                    p.join()
    found = [row for rank in sorted(rows) for row in rows[rank]]
    if found:
        raise AssertionError(f"findings on the healthy DDP model: {found}")
    return -1


import healthy_patterns  # noqa: E402,F401  - registers the patterns' healthy loops
