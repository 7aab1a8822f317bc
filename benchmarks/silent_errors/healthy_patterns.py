"""More healthy loops, in the patterns real code uses on purpose and that a check of a training
step must not mistake for bugs: routing that leaves experts without tokens, an EMA teacher, a
GAN toggling requires_grad on its discriminator, gradient checkpointing, bf16 autocast, a param
group held at lr 0 for a while, a conv bias before BatchNorm, LoRA from step 0, a small vision
transformer, progressive unfreezing, sharpness-aware minimisation (two backward passes per step),
a GPT-style LM with no-decay groups, accumulation under a GradScaler, SimSiam's two views and
torchvision's MobileNetV3. Registered into ``healthy.HEALTHY`` (imported at the end of healthy.py)."""

from __future__ import annotations

import copy

import torch
import torch.nn.functional as F
from cases import LoRALinear
from harness import STEPS, batch, mlp
from healthy import healthy
from torch import nn
from torch.utils.checkpoint import checkpoint


def _loop(model, opt, record, make=batch, steps=STEPS, loss_fn=F.cross_entropy, after=None, **options):
    record(model, opt, **options)
    for step in range(steps):
        x, y = make()
        opt.zero_grad()
        loss_fn(model(x), y).backward()
        opt.step()
        if after is not None:
            after(step)
    return -1


class TopOneMoE(nn.Module):
    """Switch-style top-1 routing over 4 experts (Fedus et al. 2021); with 6 tokens a step some
    experts get none, so their weights have no gradient on that step."""

    def __init__(self, dim: int = 10, experts: int = 4) -> None:
        super().__init__()
        self.router = nn.Linear(dim, experts)
        self.experts = nn.ModuleList(nn.Sequential(nn.Linear(dim, 16), nn.ReLU(), nn.Linear(16, dim))
                                     for _ in range(experts))
        self.head = nn.Linear(dim, 3)

    def forward(self, x):
        gate = self.router(x).softmax(-1)
        top, idx = gate.max(-1)
        out = torch.zeros_like(x)
        for e, expert in enumerate(self.experts):
            sel = idx == e
            if sel.any():
                out[sel] = expert(x[sel]) * top[sel, None]
        return self.head(x + out)


@healthy
def moe_top1_routing(_, record):
    model = TopOneMoE()
    return _loop(model, torch.optim.AdamW(model.parameters(), lr=1e-3), record, make=lambda: batch(6))


@healthy
def mean_teacher_ema(_, record):
    """Mean teacher (Tarvainen & Valpola 2017): the teacher is an EMA of the student, updated after
    every step; the student is recorded."""
    student = mlp(dropout=0.1)
    teacher = copy.deepcopy(student).requires_grad_(False)
    opt = torch.optim.SGD(student.parameters(), lr=0.05, momentum=0.9)
    record(student, opt)
    for _ in range(STEPS):
        x, y = batch()
        opt.zero_grad()
        out = student(x)
        with torch.no_grad():
            target = teacher(x + 0.05 * torch.randn_like(x)).softmax(-1)
        (F.cross_entropy(out, y) + F.mse_loss(out.softmax(-1), target)).backward()
        opt.step()
        with torch.no_grad():
            for t, s in zip(teacher.parameters(), student.parameters()):
                t.mul_(0.99).add_(s, alpha=0.01)
    return -1


@healthy
def gan_requires_grad_toggle(_, record):
    """CycleGAN/pix2pix's set_requires_grad(D, False) during the generator's step; D recorded."""
    gen, disc = mlp(4, 16, 8), nn.Sequential(nn.Linear(8, 16), nn.LeakyReLU(0.2), nn.Linear(16, 1))
    opt_g, opt_d = torch.optim.Adam(gen.parameters(), 2e-4), torch.optim.Adam(disc.parameters(), 2e-4)
    record(disc, opt_d)
    ones, zeros = torch.ones(16, 1), torch.zeros(16, 1)
    for _ in range(STEPS):
        real, z = torch.randn(16, 8) + 2, torch.randn(16, 4)
        fake = gen(z)
        disc.requires_grad_(False)
        opt_g.zero_grad()
        F.binary_cross_entropy_with_logits(disc(fake), ones).backward()
        opt_g.step()
        disc.requires_grad_(True)
        opt_d.zero_grad()
        (F.binary_cross_entropy_with_logits(disc(real), ones)
         + F.binary_cross_entropy_with_logits(disc(fake.detach()), zeros)).backward()
        opt_d.step()
    return -1


class CheckpointedMLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp, self.out = nn.Linear(10, 32), nn.Linear(32, 3)
        self.blocks = nn.ModuleList(nn.Sequential(nn.LayerNorm(32), nn.Linear(32, 32), nn.GELU()) for _ in range(3))

    def forward(self, x):
        h = self.inp(x)
        for block in self.blocks:
            h = h + checkpoint(block, h, use_reentrant=False)
        return self.out(h)


@healthy
def gradient_checkpointing(_, record):
    model = CheckpointedMLP()
    return _loop(model, torch.optim.AdamW(model.parameters(), lr=1e-3), record)


@healthy
def bf16_autocast_cpu(_, record):
    """bf16 autocast on CPU around the forward pass, fp32 weights, AdamW."""
    model = mlp(hidden=64)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    record(model, opt)
    for _ in range(STEPS):
        x, y = batch()
        opt.zero_grad()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = F.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
    return -1


@healthy
def param_group_lr0_warmup(_, record):
    """The head trains alone for 16 steps while the body's group is held at lr 0, then both."""
    model = mlp()
    opt = torch.optim.SGD([{"params": model[0].parameters(), "lr": 0.0}, {"params": model[2].parameters()}],
                          lr=0.05, momentum=0.9)

    def after(step):
        if step == 15:
            opt.param_groups[0]["lr"] = 0.05
    return _loop(model, opt, record, after=after)


@healthy
def conv_bias_before_batchnorm(_, record):
    """Conv2d with its default bias in front of a train-mode BatchNorm (the bias's gradient is zero
    by the normalisation's algebra), SGD with momentum."""
    model = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(),
                          nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, 3))

    def make():
        x = torch.randn(16, 3, 8, 8)
        return x, x.mean((2, 3)).argmax(1)
    return _loop(model, torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9), record, make=make)


class LoRAAttention(nn.Module):
    """A frozen attention block with LoRA on the query and value projections (Hu et al. 2021)."""

    def __init__(self, dim: int = 16) -> None:
        super().__init__()
        self.q, self.v = LoRALinear(dim), LoRALinear(dim)
        self.k, self.o = nn.Linear(dim, dim).requires_grad_(False), nn.Linear(dim, dim).requires_grad_(False)
        self.head = nn.Linear(dim, 3)

    def forward(self, x):  # NxTxD -> Nx3
        att = (self.q(x) @ self.k(x).transpose(1, 2) / 4).softmax(-1)
        return self.head(self.o(att @ self.v(x)).mean(1))


@healthy
def lora_attention_from_step_0(_, record):
    model = LoRAAttention()
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)

    def make():
        x = torch.randn(8, 5, 16)
        return x, x[:, 0, :3].argmax(1)
    return _loop(model, opt, record, make=make)


@healthy
def vision_transformer_tiny(_, record):
    """torchvision's VisionTransformer at a tiny size (2 layers, 16x16 images, patches of 4)."""
    from torchvision.models.vision_transformer import VisionTransformer
    model = VisionTransformer(image_size=16, patch_size=4, num_layers=2, num_heads=2, hidden_dim=32,
                              mlp_dim=64, num_classes=4, dropout=0.1)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.05)
    return _loop(model, opt, record, make=lambda: (torch.randn(8, 3, 16, 16), torch.randint(0, 4, (8,))),
                 steps=STEPS // 2)


@healthy
def progressive_unfreezing(_, record):
    """ULMFiT's gradual unfreezing (Howard & Ruder 2018): the body starts frozen and is unfrozen
    a layer at a time; the optimizer holds every tensor from the start."""
    model = nn.Sequential(nn.Linear(10, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 3))
    model[:4].requires_grad_(False)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01)

    def after(step):
        if step == 12:
            model[2].requires_grad_(True)
        if step == 24:
            model[0].requires_grad_(True)
    return _loop(model, opt, record, after=after)


@healthy
def sharpness_aware_minimisation(_, record):
    """SAM (Foret et al. 2021): a first backward, an ascent step of the weights, zero_grad, a second
    backward at the perturbed weights, the weights restored and the base optimizer's step."""
    model = mlp()
    base = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    record(model, base)
    rho = 0.05
    for _ in range(STEPS):
        x, y = batch()
        base.zero_grad()
        F.cross_entropy(model(x), y).backward()
        params = [p for p in model.parameters() if p.grad is not None]
        with torch.no_grad():
            norm = torch.norm(torch.stack([p.grad.norm() for p in params]))
            eps = [p.grad * (rho / (norm + 1e-12)) for p in params]
            for p, e in zip(params, eps):
                p.add_(e)
        base.zero_grad()
        F.cross_entropy(model(x), y).backward()
        with torch.no_grad():
            for p, e in zip(params, eps):
                p.sub_(e)
        base.step()
    return -1


class TinyGPT(nn.Module):
    """A GPT-style decoder (nanoGPT's shape at toy size): tied embeddings, pre-norm blocks."""

    def __init__(self, vocab: int = 32, dim: int = 32, layers: int = 2) -> None:
        super().__init__()
        self.tok, self.pos = nn.Embedding(vocab, dim), nn.Embedding(16, dim)
        layer = nn.TransformerEncoderLayer(dim, 4, 4 * dim, dropout=0.1, batch_first=True, norm_first=True)
        self.blocks = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.norm, self.lm_head = nn.LayerNorm(dim), nn.Linear(dim, vocab, bias=False)
        self.lm_head.weight = self.tok.weight

    def forward(self, idx):  # NxT -> NxTxV
        t = idx.shape[1]
        mask = nn.Transformer.generate_square_subsequent_mask(t)
        h = self.blocks(self.tok(idx) + self.pos(torch.arange(t)), mask=mask, is_causal=True)
        return self.lm_head(self.norm(h))


@healthy
def gpt_tiny_decay_groups(_, record):
    """AdamW with weight decay on matrices only (nanoGPT's groups), warm-up then cosine, clipping."""
    model = TinyGPT()
    decay = [p for p in model.parameters() if p.dim() >= 2]
    rest = [p for p in model.parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0.0}],
                            lr=1e-3, betas=(0.9, 0.95))
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 8))
    record(model, opt)
    for _ in range(STEPS):
        idx = torch.randint(0, 32, (4, 12))
        opt.zero_grad(set_to_none=True)
        logits = model(idx[:, :-1])
        F.cross_entropy(logits.reshape(-1, 32), idx[:, 1:].reshape(-1)).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
    return -1


@healthy
def accumulation_with_grad_scaler(_, record):
    """Four micro-batches a step under a GradScaler, unscale_ then clip before the step."""
    model = mlp(dropout=0.1)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    scaler = torch.amp.GradScaler("cpu")
    record(model, opt, scaler=scaler)
    for i in range(STEPS * 4):
        x, y = batch(8)
        scaler.scale(F.cross_entropy(model(x), y) / 4).backward()
        if i % 4 == 3:
            scaler.unscale_(opt)
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            scaler.step(opt)
            scaler.update()
            opt.zero_grad(set_to_none=True)
    return -1


@healthy
def simsiam_two_views(_, record):
    """SimSiam (Chen & He 2021): two augmented views, a predictor, stop-gradient on the targets."""
    encoder = nn.Sequential(nn.Linear(10, 32), nn.BatchNorm1d(32), nn.ReLU(), nn.Linear(32, 16))
    predictor = nn.Sequential(nn.Linear(16, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, 16))
    model = nn.ModuleDict({"encoder": encoder, "predictor": predictor})
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9, weight_decay=1e-4)
    rec = record(model, opt, hooks=False)  # the loop calls the parts, not the ModuleDict: steps by hand
    for _ in range(STEPS):
        x = torch.randn(16, 10)
        v1, v2 = x + 0.1 * torch.randn_like(x), x + 0.1 * torch.randn_like(x)
        rec.begin()
        z1, z2 = encoder(v1), encoder(v2)
        p1, p2 = predictor(z1), predictor(z2)
        loss = -(F.cosine_similarity(p1, z2.detach()).mean() + F.cosine_similarity(p2, z1.detach()).mean()) / 2
        opt.zero_grad()
        loss.backward()
        rec.before_step()
        opt.step()
        rec.after_step()
    return -1


@healthy
def mobilenet_v3_small(_, record):
    """torchvision's MobileNetV3-Small (weights=None: hardswish, squeeze-excitation, BatchNorm,
    dropout in the classifier) on 32x32 inputs, RMSprop as in its reference recipe."""
    from torchvision.models import mobilenet_v3_small as build
    model = build(weights=None, num_classes=4)
    opt = torch.optim.RMSprop(model.parameters(), lr=1e-3, alpha=0.9, eps=0.0316, weight_decay=1e-5)
    return _loop(model, opt, record, make=lambda: (torch.randn(8, 3, 32, 32), torch.randint(0, 4, (8,))),
                 steps=STEPS // 2)
