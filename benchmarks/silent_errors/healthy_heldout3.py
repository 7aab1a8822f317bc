"""Third held-out set of healthy loops: unusual but correct patterns real users write, written
blind (without reading how the recorder works and without running it on them) for
``score.py --set heldout3``. Any finding at warning or error level on one of them is a false
alarm. Each is ``fn(ok, record) -> -1`` like healthy.py's; this registry is separate from the
other sets'. None repeats a pattern of healthy.py, healthy_patterns.py, healthy_heldout.py or
healthy_heldout2.py."""

from __future__ import annotations

import copy

import torch
import torch.nn.functional as F
from harness import STEPS, batch, mlp
from torch import nn
from torch.nn.utils.parametrizations import spectral_norm

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


@healthy
def foreach_or_fused_adamw(_, record):
    """AdamW with fused=True where this torch supports it on CPU, else foreach=True."""
    model = mlp()
    try:
        opt = torch.optim.AdamW(model.parameters(), lr=0.01, weight_decay=0.01, fused=True)
    except (RuntimeError, ValueError, TypeError):
        opt = torch.optim.AdamW(model.parameters(), lr=0.01, weight_decay=0.01, foreach=True)
    return _loop(model, opt, record)


@healthy
def layerwise_lr_decay(_, record):
    """Layer-wise lr decay (as in BEiT/ELECTRA fine-tuning): each deeper layer's group gets a larger
    lr, the first layer 0.75**3 of the head's."""
    model = nn.Sequential(nn.Linear(10, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(),
                          nn.Linear(32, 3))
    layers = [model[0], model[2], model[4], model[6]]
    groups = [{"params": list(m.parameters()), "lr": 0.05 * 0.75 ** (len(layers) - 1 - i)}
              for i, m in enumerate(layers)]
    return _loop(model, torch.optim.AdamW(groups, lr=0.05), record)


@healthy
def spectral_norm_critic(_, record):
    """A classifier whose linear layers are under parametrizations.spectral_norm (power iteration
    buffers updated in every training forward)."""
    model = nn.Sequential(spectral_norm(nn.Linear(10, 32)), nn.LeakyReLU(0.2), spectral_norm(nn.Linear(32, 3)))
    return _loop(model, torch.optim.Adam(model.parameters(), lr=0.01, betas=(0.5, 0.999)), record)


class _Tagger(nn.Module):
    def __init__(self):
        super().__init__()
        self.rnn = nn.LSTM(4, 16, batch_first=True)
        self.out = nn.Linear(16, 3)

    def forward(self, x, state=None):
        h, state = self.rnn(x, state)
        return self.out(h), state


@healthy
def truncated_bptt_lstm(_, record):
    """Truncated BPTT: one long sequence cut into chunks of 5; the hidden state is carried over and
    detached between chunks; one step per chunk."""
    model = _Tagger()
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    record(model, opt)
    seq = torch.randn(8, 5 * STEPS, 4)
    target = (seq.cumsum(1)[..., 0] > 0).long() + (seq[..., 1] > 1).long()
    state = None
    for step in range(STEPS):
        x, y = seq[:, 5 * step:5 * step + 5], target[:, 5 * step:5 * step + 5]
        if state is not None:
            state = tuple(s.detach() for s in state)
        opt.zero_grad()
        logits, state = model(x, state)
        F.cross_entropy(logits.reshape(-1, 3), y.reshape(-1)).backward()
        opt.step()
    return -1


@healthy
def moco_queue_contrastive(_, record):
    """MoCo (He et al. 2020): a key encoder moved by momentum, a queue of past keys kept as a buffer
    and updated after every step; InfoNCE against the positive key and the queue."""
    query = nn.Sequential(nn.Linear(10, 32), nn.ReLU(), nn.Linear(32, 16))
    key = copy.deepcopy(query).requires_grad_(False)
    queue = F.normalize(torch.randn(64, 16), dim=1)
    opt = torch.optim.SGD(query.parameters(), lr=0.05, momentum=0.9)
    record(query, opt)
    for _step in range(STEPS):
        x = torch.randn(16, 10)
        v1, v2 = x + 0.1 * torch.randn_like(x), x + 0.1 * torch.randn_like(x)
        q = F.normalize(query(v1), dim=1)
        with torch.no_grad():
            k = F.normalize(key(v2), dim=1)
        logits = torch.cat([(q * k).sum(1, keepdim=True), q @ queue.t()], 1) / 0.2
        opt.zero_grad()
        F.cross_entropy(logits, torch.zeros(16, dtype=torch.long)).backward()
        opt.step()
        with torch.no_grad():
            for pk, pq in zip(key.parameters(), query.parameters()):
                pk.mul_(0.99).add_(pq.detach(), alpha=0.01)
            queue = torch.cat([k, queue[:-16]])
    return -1


class _RunningNormaliser(nn.Module):
    """Normalises inputs by running mean/variance buffers it updates itself in training forwards
    (as RL observation normalisers do)."""

    def __init__(self, dim):
        super().__init__()
        self.register_buffer("mean", torch.zeros(dim))
        self.register_buffer("var", torch.ones(dim))
        self.register_buffer("count", torch.tensor(1e-4))

    def forward(self, x):
        if self.training:
            with torch.no_grad():
                n = x.shape[0]
                delta = x.mean(0) - self.mean
                total = self.count + n
                self.mean += delta * n / total
                self.var.copy_((self.var * self.count + x.var(0, unbiased=False) * n
                                + delta.pow(2) * self.count * n / total) / total)
                self.count.fill_(float(total))
        return (x - self.mean) / (self.var + 1e-8).sqrt()


@healthy
def running_mean_input_normaliser(_, record):
    """An MLP behind an input normaliser whose running statistics are buffers updated in forward."""
    model = nn.Sequential(_RunningNormaliser(10), mlp())
    return _loop(model, torch.optim.Adam(model.parameters(), lr=0.01), record,
                 make=lambda: (lambda x, y: (3 * x + 2, y))(*batch()))


@healthy
def mixup_training(_, record):
    """mixup (Zhang et al. 2018): inputs and one-hot targets mixed with a Beta(0.4, 0.4) weight."""
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    record(model, opt)
    beta = torch.distributions.Beta(0.4, 0.4)
    for _step in range(STEPS):
        x, y = batch()
        lam = float(beta.sample())
        perm = torch.randperm(x.shape[0])
        out = model(lam * x + (1 - lam) * x[perm])
        loss = lam * F.cross_entropy(out, y) + (1 - lam) * F.cross_entropy(out, y[perm])
        opt.zero_grad()
        loss.backward()
        opt.step()
    return -1


class _FakeQuant(torch.autograd.Function):
    """Quantisation-aware training's fake quantiser: round to 4 bits forward, identity backward
    (the straight-through estimator, Bengio et al. 2013)."""

    @staticmethod
    def forward(ctx, x):
        scale = x.detach().abs().max().clamp_min(1e-8) / 7
        return torch.round(x / scale).clamp(-8, 7) * scale

    @staticmethod
    def backward(ctx, grad):
        return grad


class _QLinear(nn.Linear):
    def forward(self, x):
        return F.linear(x, _FakeQuant.apply(self.weight), self.bias)


@healthy
def quantisation_aware_ste(_, record):
    """Linear layers whose weights are fake-quantised to 4 bits with a straight-through estimator."""
    model = nn.Sequential(_QLinear(10, 32), nn.ReLU(), _QLinear(32, 3))
    return _loop(model, torch.optim.Adam(model.parameters(), lr=0.01), record)


@healthy
def per_sample_gradient_clipping(_, record):
    """DP-SGD's clipping without torch.func: each sample's gradient computed by its own backward,
    clipped to norm 1, summed and averaged into .grad by hand (no noise), then the step."""
    model = mlp(hidden=16)
    opt = torch.optim.SGD(model.parameters(), lr=0.2)
    record(model, opt)
    params = list(model.parameters())
    for _step in range(STEPS):
        x, y = batch(8)
        total = [torch.zeros_like(p) for p in params]
        for i in range(x.shape[0]):
            g = torch.autograd.grad(F.cross_entropy(model(x[i:i + 1]), y[i:i + 1]), params)
            norm = torch.sqrt(sum(t.pow(2).sum() for t in g))
            factor = min(1.0, 1.0 / (float(norm) + 1e-6))
            for acc, t in zip(total, g):
                acc.add_(t, alpha=factor)
        opt.zero_grad()
        for p, acc in zip(params, total):
            p.grad = acc / x.shape[0]
        opt.step()
    return -1


@healthy
def gan_samples_from_eval_generator(_, record):
    """A GAN whose discriminator is trained on samples drawn from the generator in eval mode under
    no_grad (as in replay buffers); the generator then trains in train mode. Both recorded."""
    gen = nn.Sequential(nn.Linear(4, 32), nn.BatchNorm1d(32), nn.ReLU(), nn.Dropout(0.1), nn.Linear(32, 10))
    disc = nn.Sequential(nn.Linear(10, 32), nn.LeakyReLU(0.2), nn.Linear(32, 1))
    opt_g = torch.optim.Adam(gen.parameters(), lr=0.002, betas=(0.5, 0.999))
    opt_d = torch.optim.Adam(disc.parameters(), lr=0.002, betas=(0.5, 0.999))
    record(disc, opt_d)
    record(gen, opt_g)
    ones, zeros = torch.ones(16, 1), torch.zeros(16, 1)
    for _step in range(STEPS):
        real = torch.randn(16, 10) * 0.5 + 1
        gen.eval()
        with torch.no_grad():
            fake = gen(torch.randn(16, 4))
        gen.train()
        opt_d.zero_grad()
        (F.binary_cross_entropy_with_logits(disc(real), ones)
         + F.binary_cross_entropy_with_logits(disc(fake), zeros)).backward()
        opt_d.step()
        opt_g.zero_grad()
        F.binary_cross_entropy_with_logits(disc(gen(torch.randn(16, 4))), ones).backward()
        opt_g.step()
    return -1


@healthy
def reduce_lr_on_plateau(_, record):
    """ReduceLROnPlateau on a noisy validation loss, patience 2, factor 0.5, stepped every 4 steps."""
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    sched = torch.optim.lr_scheduler.ReduceLROnPlateau(opt, factor=0.5, patience=2)
    xv, yv = batch(64)

    def after(step):
        if step % 4 == 3:
            with torch.no_grad():
                sched.step(float(F.cross_entropy(model(xv), yv)))
    return _loop(model, opt, record, after=after)


class _TiedAutoencoder(nn.Module):
    """An autoencoder whose decoder is the encoder's weight transposed (F.linear with weight.t())."""

    def __init__(self):
        super().__init__()
        self.enc = nn.Linear(10, 4)
        self.dec_bias = nn.Parameter(torch.zeros(10))

    def forward(self, x):
        return F.linear(torch.tanh(self.enc(x)), self.enc.weight.t(), self.dec_bias)


@healthy
def tied_autoencoder_transpose(_, record):
    """A tied-weight autoencoder trained on reconstruction (MSE) with Adam."""
    model = _TiedAutoencoder()
    mix = torch.randn(4, 10)
    return _loop(model, torch.optim.Adam(model.parameters(), lr=0.01), record,
                 make=lambda: (lambda z: (z @ mix, z @ mix))(torch.randn(32, 4)), loss_fn=F.mse_loss)
