"""Fifth held-out set of healthy loops: unusual but correct patterns real users write, written
blind (without reading how the recorder works and without running it on them) for
``score.py --set heldout5``. Any finding at warning or error level on one of them is a false
alarm. Each is ``fn(ok, record) -> -1`` like healthy.py's; this registry is separate from the
other sets'. None repeats a pattern of healthy.py, healthy_patterns.py or healthy_heldout*.py."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from harness import STEPS, batch, mlp
from torch import nn

HEALTHY: dict[str, object] = {}


def healthy(fn):
    HEALTHY[fn.__name__] = fn
    return fn


def _loop(model, opt, record, make=batch, loss_fn=F.cross_entropy, before=None, before_step=None, **options):
    record(model, opt, **options)
    for step in range(STEPS):
        if before is not None:
            before(step)
        x, y = make()
        opt.zero_grad()
        loss_fn(model(x), y).backward()
        if before_step is not None:
            before_step(step)
        opt.step()
    return -1


class _SwishFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return x * torch.sigmoid(x)

    @staticmethod
    def backward(ctx, g):
        (x,) = ctx.saved_tensors
        s = torch.sigmoid(x)
        return g * s * (1 + x * (1 - s))


class Swish(nn.Module):
    def forward(self, x):
        return _SwishFn.apply(x)


@healthy
def custom_function_swish(_, record):
    """A memory-saving Swish written as a custom autograd.Function with its own backward."""
    model = nn.Sequential(nn.Linear(10, 32), Swish(), nn.Linear(32, 32), Swish(), nn.Linear(32, 3))
    return _loop(model, torch.optim.Adam(model.parameters(), lr=1e-2), record)


class PromptTuned(nn.Module):
    """A frozen "pretrained" encoder layer; only a soft prompt prepended to the tokens and the head train."""

    def __init__(self, prompt_len=4, dim=8) -> None:
        super().__init__()
        self.encoder = nn.TransformerEncoderLayer(dim, 2, dim_feedforward=16, dropout=0.0, batch_first=True)
        self.encoder.requires_grad_(False)
        self.prompt = nn.Parameter(torch.randn(prompt_len, dim) * 0.1)
        self.head = nn.Linear(dim, 3)

    def forward(self, x):  # N x L x dim
        h = self.encoder(torch.cat([self.prompt.expand(len(x), -1, -1), x], 1))
        return self.head(h[:, 0])  # read out at the first prompt position


def _tokens(n=32):
    x = torch.randn(n, 6, 8)
    return x, x.mean(1)[:, :3].argmax(1)


@healthy
def soft_prompt_tuning(_, record):
    """Prompt tuning: the encoder frozen by requires_grad=False, a learned prompt and a head in the optimizer."""
    model = PromptTuned()
    params = [model.prompt, *model.head.parameters()]
    return _loop(model, torch.optim.Adam(params, lr=3e-2), record, make=_tokens)


@healthy
def bitfit_bias_only(_, record):
    """BitFit: every weight matrix frozen at its (pretrained) value, only the biases train."""
    model = mlp(hidden=64)
    for name, p in model.named_parameters():
        p.requires_grad_(name.endswith("bias"))
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=5e-2, weight_decay=0.0)
    return _loop(model, opt, record)


@healthy
def gradient_centralisation(_, record):
    """Gradient centralisation: each weight matrix's gradient made zero-mean per output row before the step."""
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)

    def centralise(step):
        for p in model.parameters():
            if p.grad is not None and p.dim() > 1:
                p.grad.sub_(p.grad.mean(dim=tuple(range(1, p.dim())), keepdim=True))

    return _loop(model, opt, record, before_step=centralise)


@healthy
def noam_schedule_by_hand(_, record):
    """The Transformer's inverse-square-root schedule written by hand into every param group each step."""
    model = mlp()
    opt = torch.optim.Adam(model.parameters(), lr=0.0, betas=(0.9, 0.98), eps=1e-9)
    warmup, scale = 8, 0.05

    def noam(step):
        n = step + 1
        for group in opt.param_groups:
            group["lr"] = scale * min(n ** -0.5, n * warmup ** -1.5)

    return _loop(model, opt, record, before=noam)


@healthy
def rmsprop_centered_momentum(_, record):
    """RMSprop, centred, with momentum and a little weight decay: the A3C-era optimiser."""
    model = mlp()
    opt = torch.optim.RMSprop(model.parameters(), lr=3e-3, alpha=0.99, momentum=0.9, centered=True,
                              weight_decay=1e-4)
    return _loop(model, opt, record)


@healthy
def static_loss_scale_by_hand(_, record):
    """Static loss scaling by hand around bf16 autocast: the loss times 1024 backward, the gradients
    divided by 1024 before the step."""
    model, scale = mlp(), 1024.0
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)

    def forward(x):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return model(x).float()

    record(model, opt)
    for _ in range(STEPS):
        x, y = batch()
        opt.zero_grad()
        (F.cross_entropy(forward(x), y) * scale).backward()
        for p in model.parameters():
            p.grad.div_(scale)
        opt.step()
    return -1


class StochasticDepth(nn.Module):
    """Residual blocks each skipped with probability p in training (whole batch), all used in eval."""

    def __init__(self, p=0.3) -> None:
        super().__init__()
        self.p = p
        self.inp, self.out = nn.Linear(10, 32), nn.Linear(32, 3)
        self.blocks = nn.ModuleList([nn.Sequential(nn.Linear(32, 32), nn.ReLU()) for _ in range(3)])

    def forward(self, x):
        h = F.relu(self.inp(x))
        for block in self.blocks:
            if not self.training:
                h = h + (1 - self.p) * block(h)
            elif torch.rand(()) >= self.p:
                h = h + block(h)
        return self.out(h)


@healthy
def stochastic_depth_blocks(_, record):
    """Stochastic depth: a dropped block gets no gradient that step; it trains on the others."""
    model = StochasticDepth()
    return _loop(model, torch.optim.Adam(model.parameters(), lr=1e-2), record)


class HyperMLP(nn.Module):
    """A hypernetwork: the main network's weights are generated from learned layer codes, not parameters."""

    def __init__(self, code=4) -> None:
        super().__init__()
        self.shapes = [(32, 10), (3, 32)]
        self.codes = nn.Parameter(torch.randn(len(self.shapes), code))
        self.gen = nn.ModuleList([nn.Linear(code, o * i + o) for o, i in self.shapes])
        with torch.no_grad():
            for g, (_, i) in zip(self.gen, self.shapes):
                g.weight.mul_(0.1)
                g.bias.mul_(i ** -0.5 / g.bias.std())

    def forward(self, x):
        for k, (g, (o, i)) in enumerate(zip(self.gen, self.shapes)):
            flat = g(self.codes[k])
            x = F.linear(x, flat[: o * i].view(o, i), flat[o * i:])
            if k < len(self.shapes) - 1:
                x = F.relu(x)
        return x


@healthy
def hypernetwork_generated_weights(_, record):
    """A main network whose weights come out of a hypernetwork each forward pass; the hypernetwork trains."""
    model = HyperMLP()
    return _loop(model, torch.optim.Adam(model.parameters(), lr=1e-2), record)


_W_R = torch.linspace(-1, 1, 10)


def _td_batch(n=32):
    s = torch.randn(n, 10)
    s2 = 0.5 * s + 0.5 * torch.randn(n, 10)
    return s, s2, s @ _W_R


@healthy
def semi_gradient_td_target(_, record):
    """Semi-gradient TD(0): the bootstrap target r + gamma V(s') from the same network, detached."""
    model = mlp(classes=1)
    opt = torch.optim.SGD(model.parameters(), lr=0.02)
    record(model, opt)
    for _ in range(STEPS):
        s, s2, r = _td_batch()
        target = r + 0.9 * model(s2).squeeze(1).detach()
        opt.zero_grad()
        F.mse_loss(model(s).squeeze(1), target).backward()
        opt.step()
    return -1
