"""Held-out healthy loops: unusual but correct patterns users write, written blind (without
running the recorder) for ``score.py --set heldout``. Any finding on one of them is a false
alarm. Each is ``fn(ok, record) -> -1`` like healthy.py's; this registry is separate from
``healthy.HEALTHY``."""

from __future__ import annotations

import copy

import torch
import torch.nn.functional as F
from harness import STEPS, batch, mlp
from torch import nn
from torch.nn.utils import parametrizations

HEALTHY: dict[str, object] = {}


def healthy(fn):
    HEALTHY[fn.__name__] = fn
    return fn


@healthy
def accumulation_keeping_grad_buffers(_, record):
    """Two micro-batches per step, zero_grad(set_to_none=False) after each step (buffers kept)."""
    model = mlp(dropout=0.1)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    record(model, opt)
    for i in range(STEPS * 2):
        x, y = batch(16)
        (F.cross_entropy(model(x), y) / 2).backward()
        if i % 2 == 1:
            opt.step()
            opt.zero_grad(set_to_none=False)
    return -1


@healthy
def backbone_frozen_then_unfrozen(_, record):
    """The backbone is frozen (requires_grad False, .grad None) for 12 steps, then unfrozen; one
    Adam over everything from the start, as fine-tuning recipes do."""
    model = nn.Sequential(mlp(10, 32, 16), nn.ReLU(), nn.Linear(16, 3))
    backbone = model[0]
    backbone.requires_grad_(False)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    record(model, opt)
    for step in range(STEPS):
        if step == 12:
            backbone.requires_grad_(True)
        x, y = batch()
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        opt.step()
    return -1


@healthy
def two_optimizers_two_parts(_, record):
    """An encoder under SGD and a head under Adam, each recorded with its own optimizer."""
    encoder, head = nn.Sequential(nn.Linear(10, 32), nn.ReLU()), nn.Linear(32, 3)
    opt_enc = torch.optim.SGD(encoder.parameters(), lr=0.05, momentum=0.9)
    opt_head = torch.optim.Adam(head.parameters(), lr=1e-3)
    record(encoder, opt_enc)
    record(head, opt_head)
    for _ in range(STEPS):
        x, y = batch()
        opt_enc.zero_grad()
        opt_head.zero_grad()
        F.cross_entropy(head(encoder(x)), y).backward()
        opt_enc.step()
        opt_head.step()
    return -1


@healthy
def lazy_layers_materialised(_, record):
    """nn.LazyLinear layers materialised by one dry forward before the optimizer is built."""
    model = nn.Sequential(nn.LazyLinear(32), nn.ReLU(), nn.LazyLinear(3))
    model(batch()[0])
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    record(model, opt)
    for _ in range(STEPS):
        x, y = batch()
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        opt.step()
    return -1


class _ReverseGrad(torch.autograd.Function):
    """Identity forward, gradient times -lambda backward (Ganin & Lempitsky 2015)."""

    @staticmethod
    def forward(ctx, x, lam):
        ctx.lam = lam
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return -ctx.lam * grad, None


@healthy
def domain_adversarial_gradient_reversal(_, record):
    """A feature extractor, a label head and a domain head behind a gradient-reversal Function."""
    feat, label_head, domain_head = nn.Sequential(nn.Linear(10, 32), nn.ReLU()), nn.Linear(32, 3), nn.Linear(32, 2)
    model = nn.ModuleDict({"feat": feat, "label": label_head, "domain": domain_head})
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    record(model, opt)
    for step in range(STEPS):
        x, y = batch()
        domain = torch.randint(0, 2, (32,))
        x = x + domain[:, None].float() * 0.5
        opt.zero_grad()
        h = feat(x)
        lam = 2.0 / (1.0 + torch.exp(torch.tensor(-10.0 * step / STEPS)).item()) - 1.0
        loss = F.cross_entropy(label_head(h), y) + F.cross_entropy(domain_head(_ReverseGrad.apply(h, lam)), domain)
        loss.backward()
        opt.step()
    return -1


@healthy
def alternating_task_heads(_, record):
    """Two task heads on a shared trunk, one task per step in turn (each head idle every other step)."""
    trunk, heads = nn.Sequential(nn.Linear(10, 32), nn.ReLU()), nn.ModuleList([nn.Linear(32, 3), nn.Linear(32, 2)])
    model = nn.ModuleDict({"trunk": trunk, "heads": heads})
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    record(model, opt)
    for step in range(STEPS):
        x, y = batch()
        task = step % 2
        target = y if task == 0 else (x[:, 0] > 0).long()
        opt.zero_grad()
        F.cross_entropy(heads[task](trunk(x)), target).backward()
        opt.step()
    return -1


@healthy
def wgan_gp_gradient_penalty(_, record):
    """WGAN-GP's critic (Gulrajani et al. 2017): a gradient penalty through create_graph=True."""
    gen, critic = mlp(4, 16, 8), nn.Sequential(nn.Linear(8, 32), nn.LeakyReLU(0.2), nn.Linear(32, 1))
    opt_c = torch.optim.Adam(critic.parameters(), lr=1e-4, betas=(0.5, 0.9))
    opt_g = torch.optim.Adam(gen.parameters(), lr=1e-4, betas=(0.5, 0.9))
    record(critic, opt_c)
    for step in range(STEPS):
        real = torch.randn(16, 8) + 1.0
        fake = gen(torch.randn(16, 4)).detach()
        eps = torch.rand(16, 1)
        mid = (eps * real + (1 - eps) * fake).requires_grad_(True)
        grad = torch.autograd.grad(critic(mid).sum(), mid, create_graph=True)[0]
        penalty = ((grad.norm(dim=1) - 1) ** 2).mean()
        opt_c.zero_grad()
        (critic(fake).mean() - critic(real).mean() + 10 * penalty).backward()
        opt_c.step()
        if step % 5 == 4:
            opt_g.zero_grad()
            (-critic(gen(torch.randn(16, 4))).mean()).backward()
            opt_g.step()
    return -1


@healthy
def weight_norm_parametrization(_, record):
    """Linear layers under torch.nn.utils.parametrizations.weight_norm (original0/original1)."""
    model = nn.Sequential(parametrizations.weight_norm(nn.Linear(10, 32)), nn.ReLU(),
                          parametrizations.weight_norm(nn.Linear(32, 3)))
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    record(model, opt)
    for _ in range(STEPS):
        x, y = batch()
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        opt.step()
    return -1


@healthy
def grads_from_autograd_grad(_, record):
    """Gradients computed with torch.autograd.grad and assigned to .grad by hand, then the step."""
    model = mlp(dropout=0.1)
    params = list(model.parameters())
    opt = torch.optim.SGD(params, lr=0.05, momentum=0.9)
    record(model, opt)
    for _ in range(STEPS):
        x, y = batch()
        opt.zero_grad()
        grads = torch.autograd.grad(F.cross_entropy(model(x), y), params)
        for p, g in zip(params, grads):
            p.grad = g
        opt.step()
    return -1


@healthy
def wgan_weight_clipping(_, record):
    """The original WGAN critic (Arjovsky et al. 2017): RMSprop, weights clamped to [-0.01, 0.01]
    after every critic step (an intended edit of the weights outside the optimizer)."""
    gen, critic = mlp(4, 16, 8), nn.Sequential(nn.Linear(8, 32), nn.LeakyReLU(0.2), nn.Linear(32, 1))
    opt_c, opt_g = torch.optim.RMSprop(critic.parameters(), lr=5e-5), torch.optim.RMSprop(gen.parameters(), lr=5e-5)
    record(critic, opt_c)
    for step in range(STEPS):
        real, fake = torch.randn(16, 8) + 1.0, gen(torch.randn(16, 4)).detach()
        opt_c.zero_grad()
        (critic(fake).mean() - critic(real).mean()).backward()
        opt_c.step()
        with torch.no_grad():
            for p in critic.parameters():
                p.clamp_(-0.01, 0.01)
        if step % 5 == 4:
            opt_g.zero_grad()
            (-critic(gen(torch.randn(16, 4))).mean()).backward()
            opt_g.step()
    return -1


@healthy
def lbfgs_with_closure(_, record):
    """Full-batch L-BFGS with a closure (several forward/backward passes per step)."""
    model = nn.Sequential(nn.Linear(10, 16), nn.Tanh(), nn.Linear(16, 1))
    opt = torch.optim.LBFGS(model.parameters(), lr=0.5, max_iter=4, history_size=5)
    record(model, opt)
    x = torch.randn(64, 10)
    y = (x[:, :3].sum(1, keepdim=True)).tanh()

    def closure():
        opt.zero_grad()
        loss = F.mse_loss(model(x), y)
        loss.backward()
        return loss

    for _ in range(STEPS // 2):
        opt.step(closure)
    return -1


@healthy
def onecycle_per_batch(_, record):
    """OneCycleLR stepped once per batch as documented, with an EMA copy kept in a separate model."""
    model = mlp(dropout=0.1)
    ema = copy.deepcopy(model).requires_grad_(False)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=0.1, total_steps=STEPS)
    record(model, opt)
    for _ in range(STEPS):
        x, y = batch()
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        opt.step()
        sched.step()
        with torch.no_grad():
            for e, p in zip(ema.parameters(), model.parameters()):
                e.lerp_(p, 0.05)
    return -1
