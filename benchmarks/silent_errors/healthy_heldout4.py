"""Fourth held-out set of healthy loops: unusual but correct patterns real users write, written
blind (without reading how the recorder works and without running it on them) for
``score.py --set heldout4``. Any finding at warning or error level on one of them is a false
alarm. Each is ``fn(ok, record) -> -1`` like healthy.py's; this registry is separate from the
other sets'. None repeats a pattern of healthy.py, healthy_patterns.py or healthy_heldout*.py."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from harness import STEPS, batch, images, mlp
from torch import nn

HEALTHY: dict[str, object] = {}


def healthy(fn):
    HEALTHY[fn.__name__] = fn
    return fn


def _loop(model, opt, record, make=batch, loss_fn=F.cross_entropy, before_step=None, after=None, **options):
    record(model, opt, **options)
    for step in range(STEPS):
        x, y = make()
        opt.zero_grad()
        loss_fn(model(x), y).backward()
        if before_step is not None:
            before_step(step)
        opt.step()
        if after is not None:
            after(step)
    return -1


@healthy
def annealed_gradient_noise(_, record):
    """Gaussian noise added to every gradient between backward and step, its scale annealed."""
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)

    def noise(step):
        sigma = (0.01 / (1 + step) ** 0.55) ** 0.5
        for p in model.parameters():
            p.grad.add_(torch.randn_like(p.grad) * sigma)

    return _loop(model, opt, record, before_step=noise)


@healthy
def lookahead_slow_weights(_, record):
    """Lookahead by hand: every 5 steps the slow weights move halfway to the fast ones and the fast
    weights are reset to them."""
    model = mlp()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    slow = [p.detach().clone() for p in model.parameters()]

    def sync(step):
        if step % 5 == 4:
            with torch.no_grad():
                for s, p in zip(slow, model.parameters()):
                    s.add_(p - s, alpha=0.5)
                    p.copy_(s)

    return _loop(model, opt, record, after=sync)


class GumbelRouter(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.gate = nn.Linear(10, 2)
        self.experts = nn.ModuleList([mlp(hidden=16), mlp(hidden=16)])

    def forward(self, x):
        outs = torch.stack([e(x) for e in self.experts], 1)
        w = F.gumbel_softmax(self.gate(x), tau=1.0, hard=True) if self.training else F.softmax(self.gate(x), 1)
        return (w.unsqueeze(2) * outs).sum(1)


@healthy
def gumbel_straight_through_routing(_, record):
    """Hard one-expert routing by straight-through Gumbel-softmax: one expert per sample, gradient to the gate."""
    model = GumbelRouter()
    return _loop(model, torch.optim.Adam(model.parameters(), lr=1e-2), record)


@healthy
def sequential_warmup_then_cosine(_, record):
    """SequentialLR: a LinearLR warm-up from a tenth of the lr, then cosine annealing, stepped per batch."""
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    warm = torch.optim.lr_scheduler.LinearLR(opt, start_factor=0.1, total_iters=8)
    cos = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=STEPS - 8)
    sched = torch.optim.lr_scheduler.SequentialLR(opt, [warm, cos], milestones=[8])
    return _loop(model, opt, record, after=lambda step: sched.step())


def _focal(logits, y, gamma=2.0):
    logp = F.log_softmax(logits, 1).gather(1, y[:, None]).squeeze(1)
    return (-(1 - logp.exp()) ** gamma * logp).mean()


@healthy
def focal_loss(_, record):
    """A focal loss written by hand: easy samples' loss down-weighted by (1 - p)^gamma."""
    model = mlp()
    return _loop(model, torch.optim.Adam(model.parameters(), lr=1e-2), record, loss_fn=_focal)


class WSConv(nn.Conv2d):
    def forward(self, x):
        w = self.weight
        w = (w - w.mean((1, 2, 3), keepdim=True)) / (w.std((1, 2, 3), keepdim=True) + 1e-5)
        return F.conv2d(x, w, self.bias, self.stride, self.padding)


@healthy
def weight_standardised_groupnorm_cnn(_, record):
    """Weight-standardised convolutions (the standardisation in forward) with GroupNorm, batches of 2."""
    model = nn.Sequential(WSConv(3, 8, 3, padding=1), nn.GroupNorm(2, 8), nn.ReLU(),
                          WSConv(8, 8, 3, padding=1), nn.GroupNorm(2, 8), nn.ReLU(),
                          nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, 3))
    return _loop(model, torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9), record,
                 make=lambda: images(2))


@healthy
def frozen_random_features_readout(_, record):
    """Random features: a wide random first layer frozen by requires_grad=False from the start, only
    the readout in the optimizer."""
    model = nn.Sequential(nn.Linear(10, 128), nn.ReLU(), nn.Linear(128, 3))
    model[0].requires_grad_(False)
    return _loop(model, torch.optim.Adam(model[2].parameters(), lr=1e-2), record)


@healthy
def adam_maximize_negative_loss(_, record):
    """Adam with maximize=True on the negated loss (an objective written as a reward), amsgrad on."""
    model = mlp()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2, maximize=True, amsgrad=True)
    return _loop(model, opt, record, loss_fn=lambda out, y: -F.cross_entropy(out, y))


@healthy
def orthogonal_parametrized_layer(_, record):
    """A hidden layer kept orthogonal by torch.nn.utils.parametrizations.orthogonal."""
    model = nn.Sequential(nn.Linear(10, 16), nn.ReLU(),
                          torch.nn.utils.parametrizations.orthogonal(nn.Linear(16, 16)), nn.ReLU(),
                          nn.Linear(16, 3))
    return _loop(model, torch.optim.Adam(model.parameters(), lr=1e-2), record)
