"""Sixth held-out set of healthy loops: unusual but correct patterns real users write, written
blind (without reading how the recorder works and without running it on them) for
``score.py --set heldout6``. Any finding at warning or error level on one of them is a false
alarm. Each is ``fn(ok, record) -> -1`` like healthy.py's; this registry is separate from the
other sets'. None repeats a pattern of healthy.py, healthy_patterns.py or healthy_heldout*.py."""

from __future__ import annotations

import copy

import torch
import torch.nn.functional as F
from harness import STEPS, batch, mlp
from torch import nn
from torch.nn.utils import prune

HEALTHY: dict[str, object] = {}


def healthy(fn):
    HEALTHY[fn.__name__] = fn
    return fn


def _loop(model, opt, record, make=batch, loss_fn=F.cross_entropy, before=None, after=None, **options):
    record(model, opt, **options)
    for step in range(STEPS):
        if before is not None:
            before(step)
        x, y = make()
        opt.zero_grad()
        loss_fn(model(x), y).backward()
        opt.step()
        if after is not None:
            after(step)
    return -1


class SharedLayerNet(nn.Module):
    """ALBERT-style cross-layer sharing: one block's weights applied at every depth, in a Python loop."""

    def __init__(self, depth=4) -> None:
        super().__init__()
        self.depth = depth
        self.embed, self.block, self.head = nn.Linear(10, 32), nn.Linear(32, 32), nn.Linear(32, 3)

    def forward(self, x):
        h = torch.tanh(self.embed(x))
        for _ in range(self.depth):
            h = h + torch.tanh(self.block(h))
        return self.head(h)


@healthy
def albert_cross_layer_sharing(_, record):
    """One block applied four times per forward pass (ALBERT's cross-layer parameter sharing); Adam."""
    model = SharedLayerNet()
    return _loop(model, torch.optim.Adam(model.parameters(), lr=5e-3), record)


class Lion(torch.optim.Optimizer):
    """Lion (Chen et al. 2023), written as a torch.optim.Optimizer subclass: the update is the sign of an
    interpolation of momentum and gradient, with decoupled weight decay."""

    def __init__(self, params, lr=3e-3, betas=(0.9, 0.99), weight_decay=0.01) -> None:
        super().__init__(params, dict(lr=lr, betas=betas, weight_decay=weight_decay))

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                m = self.state[p].setdefault("exp_avg", torch.zeros_like(p))
                p.mul_(1 - group["lr"] * group["weight_decay"])
                p.add_(torch.sign(m.lerp(p.grad, 1 - beta1)), alpha=-group["lr"])
                m.lerp_(p.grad, 1 - beta2)


@healthy
def lion_optimizer_subclass(_, record):
    """A custom optimizer (Lion's sign update) subclassing torch.optim.Optimizer, no torch rule to compare with."""
    model = mlp()
    return _loop(model, Lion(model.parameters()), record)


@healthy
def magnitude_pruning_midway(_, record):
    """torch.nn.utils.prune set up at amount 0 before training (weight_orig, weight_mask), then half of the
    first layer's weights pruned by magnitude at step 20: the masked entries' gradients are zero from there on."""
    model = mlp()
    prune.l1_unstructured(model[0], "weight", amount=0.0)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)

    def prune_half(step):
        if step == 20:
            prune.l1_unstructured(model[0], "weight", amount=0.5)

    return _loop(model, opt, record, before=prune_half)


class GrowingNet(nn.Module):
    """Progressive growing (ProGAN-style): a new block is faded in from step 16 with weight alpha; before that
    forward does not call it."""

    def __init__(self) -> None:
        super().__init__()
        self.stem, self.head = nn.Sequential(nn.Linear(10, 32), nn.ReLU()), nn.Linear(32, 3)
        self.new_block = nn.Sequential(nn.Linear(32, 32), nn.ReLU())
        self.alpha = 0.0

    def forward(self, x):
        h = self.stem(x)
        if self.alpha > 0:
            h = (1 - self.alpha) * h + self.alpha * self.new_block(h)
        return self.head(h)


@healthy
def progressive_growing_fade_in(_, record):
    """A block in the optimizer from the start but unused until step 16, then faded in over 16 steps."""
    model = GrowingNet()

    def fade(step):
        model.alpha = min(1.0, max(0.0, (step - 15) / 16))

    return _loop(model, torch.optim.Adam(model.parameters(), lr=1e-2), record, before=fade)


@healthy
def simulated_allreduce_two_replicas(_, record):
    """Data parallelism simulated in one process: two identical replicas, each on half the batch, their
    gradients averaged by hand before each replica's own SGD step; replica 0 recorded."""
    replicas = [mlp()]
    replicas.append(copy.deepcopy(replicas[0]))
    opts = [torch.optim.SGD(r.parameters(), lr=0.1, momentum=0.9) for r in replicas]
    record(replicas[0], opts[0])
    for _ in range(STEPS):
        x, y = batch(64)
        for k, (r, o) in enumerate(zip(replicas, opts)):
            o.zero_grad()
            F.cross_entropy(r(x[k::2]), y[k::2]).backward()
        with torch.no_grad():
            for ps in zip(*(r.parameters() for r in replicas)):
                mean = sum(p.grad for p in ps) / len(ps)
                for p in ps:
                    p.grad.copy_(mean)
        for o in opts:
            o.step()
    return -1


_PAD, _VOCAB = 0, 30


def _bags(n=32, length=6):
    """Token bags padded with 0; the class is the most frequent token's value mod 3."""
    x = torch.randint(1, _VOCAB, (n, length))
    lengths = torch.randint(2, length + 1, (n, 1))
    x[torch.arange(length)[None] >= lengths] = _PAD
    return x, x[:, 0] % 3


class BagClassifier(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb, self.head = nn.Embedding(_VOCAB, 16, padding_idx=_PAD), nn.Linear(16, 3)

    def forward(self, x):
        mask = (x != _PAD).float().unsqueeze(-1)
        return self.head((self.emb(x) * mask).sum(1) / mask.sum(1))


@healthy
def embedding_padding_idx(_, record):
    """nn.Embedding(padding_idx=0): the padding row gets no gradient and never moves, by design; Adam."""
    model = BagClassifier()
    return _loop(model, torch.optim.Adam(model.parameters(), lr=1e-2), record, make=_bags)


def _real(n=32):
    return torch.randn(n, 2) * 0.5 + torch.tensor([2.0, -1.0])


@healthy
def discriminator_paused_when_ahead(_, record):
    """A GAN whose discriminator steps only while its loss is above 1.3 (a common balancing heuristic): on the
    other iterations D does no backward and no step; the generator steps every iteration. D recorded."""
    gen, disc = nn.Sequential(nn.Linear(4, 16), nn.ReLU(), nn.Linear(16, 2)), mlp(dim=2, hidden=16, classes=1)
    opt_g = torch.optim.Adam(gen.parameters(), lr=5e-3)
    opt_d = torch.optim.Adam(disc.parameters(), lr=5e-3)
    record(disc, opt_d)
    ones, zeros = torch.ones(32, 1), torch.zeros(32, 1)
    for _ in range(STEPS):
        fake = gen(torch.randn(32, 4))
        d_loss = F.binary_cross_entropy_with_logits(disc(_real()), ones) + \
            F.binary_cross_entropy_with_logits(disc(fake.detach()), zeros)
        if d_loss.item() > 1.3:
            opt_d.zero_grad()
            d_loss.backward()
            opt_d.step()
        opt_g.zero_grad()
        F.binary_cross_entropy_with_logits(disc(fake), ones).backward()
        opt_g.step()
    return -1


def _r_drop_loss(model, x, y):
    a, b = model(x), model(x)  # two passes, two dropout masks
    kl = F.kl_div(F.log_softmax(a, 1), F.log_softmax(b, 1), reduction="batchmean", log_target=True) + \
        F.kl_div(F.log_softmax(b, 1), F.log_softmax(a, 1), reduction="batchmean", log_target=True)
    return F.cross_entropy(a, y) + F.cross_entropy(b, y) + 0.5 * kl


@healthy
def r_drop_two_passes(_, record):
    """R-Drop (Liang et al. 2021): two forward passes per step through dropout, cross-entropy on both plus a
    symmetric KL between them; one backward, one step."""
    model = mlp(dropout=0.3)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    record(model, opt)
    for _ in range(STEPS):
        x, y = batch()
        opt.zero_grad()
        _r_drop_loss(model, x, y).backward()
        opt.step()
    return -1


@healthy
def ema_swapped_in_and_restored(_, record):
    """An EMA of the weights kept outside the model, swapped into it every 10 steps to validate and swapped
    back (the training weights restored exactly) before the next training step."""
    model = mlp()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    ema = [p.detach().clone() for p in model.parameters()]
    xv, yv = batch(128)

    def after(step):
        with torch.no_grad():
            for e, p in zip(ema, model.parameters()):
                e.lerp_(p, 0.1)
            if step % 10 == 9:
                backup = [p.detach().clone() for p in model.parameters()]
                for p, e in zip(model.parameters(), ema):
                    p.copy_(e)
                model.eval()
                F.cross_entropy(model(xv), yv)
                model.train()
                for p, b in zip(model.parameters(), backup):
                    p.copy_(b)

    return _loop(model, opt, record, after=after)


class ZeroGammaResNet(nn.Module):
    """Residual MLP blocks whose last BatchNorm starts with weight 0 (Goyal et al. 2017's zero-gamma init):
    every block starts as the identity and its inner layers get no gradient until gamma moves."""

    def __init__(self, blocks=2) -> None:
        super().__init__()
        self.stem, self.head = nn.Linear(10, 32), nn.Linear(32, 3)
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.Linear(32, 32), nn.BatchNorm1d(32), nn.ReLU(), nn.Linear(32, 32), nn.BatchNorm1d(32))
            for _ in range(blocks))
        for b in self.blocks:
            nn.init.zeros_(b[4].weight)

    def forward(self, x):
        h = F.relu(self.stem(x))
        for b in self.blocks:
            h = F.relu(h + b(h))
        return self.head(h)


@healthy
def zero_gamma_residual_init(_, record):
    """Zero-initialised last-BN gamma in each residual block, SGD with momentum and weight decay."""
    model = ZeroGammaResNet()
    return _loop(model, torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9, weight_decay=1e-4), record)


@healthy
def adagrad_lr_decay(_, record):
    """Adagrad with lr_decay, an initial accumulator value and weight decay."""
    model = mlp()
    opt = torch.optim.Adagrad(model.parameters(), lr=0.1, lr_decay=0.01, initial_accumulator_value=0.1,
                              weight_decay=1e-4)
    return _loop(model, opt, record)
