"""A sixth held-out set of silent training errors, written blind: each case is our own toy
reconstruction (CPU, well under a second) of a public report, in its buggy and its fixed form,
written without reading how the recorder works and without running it on any case here.
``CASES[name]`` is a ``cases.Case``; ``CAUSES`` maps each cause to the finding kind that would name
it (the kinds table of docs/record.md), decided before anything ran and not changed since, or to
None where no existing kind names it (such a case counts as cause not named whatever is found).
Every mechanism differs from those of cases.py, cases_invariants.py and cases_heldout*.py.

Scored with ``score.py --set heldout6``; this registry is separate from the other sets'."""

from __future__ import annotations

import copy
from typing import Optional

import numpy as np
import torch
import torch.nn.functional as F
from cases import Case
from harness import STEPS, batch, mlp
from torch import nn

# The cause a report established -> the finding kind that names it (None: no existing kind can).
CAUSES: dict[str, Optional[str]] = {
    "module_in_two_optimizers": "changed_between_steps",  # a second optimizer also steps the encoder after the step
    "skipped_step_keeps_gradients": "stale_gradient",  # a step skipped on a non-finite norm without zero_grad()
    "decay_before_grad_check": "frozen_moved",  # a hand-written optimizer decays tensors whose .grad is None
    "gem_pool_without_clamp": "nonfinite_gradient",  # GeM pooling over an all-zero map: 0 ** (1/p) has no derivative
    "adam_step_count_frozen": "update_mismatch",  # a hand-written AdamW never increments its step: bias correction off
    "requires_grad_forced_on_loss": "no_gradient",  # loss.requires_grad = True silences a cut graph: nothing trains
    "local_gradients_wiped_by_trainer": "grad_reset_in_step",  # local losses' backward in forward, then zero_grad()
    "causal_mask_missing": None,  # a decoder trained without its causal mask: each position reads its own label
    "bidirectional_last_step_readout": None,  # out[:, -1] of a BiLSTM: the backward half has seen one token
    "log_softmax_over_batch": None,  # log_softmax(dim=0) before nll_loss: normalised over the batch, not classes
    "worker_rng_duplicated": None,  # numpy RNG copied into every loader worker: workers yield the same batches
    "sampler_weights_per_class": None,  # WeightedRandomSampler given one weight per class: samples 0..C-1 only
    "advantage_not_detached": None,  # policy loss's advantage keeps the critic's graph: the critic is pushed by it
    "best_state_aliased": None,  # best = model.state_dict() without a copy: the "best" weights are the last ones
    "ema_skips_buffers": None,  # the EMA model averages parameters only: its BatchNorm statistics stay at init
    "padding_targets_not_ignored": None,  # padded targets (pad id 0) left in cross_entropy (ignore_index -100)
}

CASES: dict[str, Case] = {}

# Objects the loops make besides the recorded model (an EMA copy, ...), kept for check_heldout6.py.
SIDE: dict[tuple, object] = {}


def case(cause: str, url: str, report: str):
    assert cause in CAUSES, cause

    def register(fn):
        CASES[fn.__name__] = Case(fn, cause, url, report)
        return fn
    return register


def _train(model, opt, record, make=batch, loss_fn=F.cross_entropy, steps=STEPS, after_step=None, **options):
    record(model, opt, **options)
    for step in range(steps):
        x, y = make()
        opt.zero_grad()
        loss_fn(model(x), y).backward()
        opt.step()
        if after_step is not None:
            after_step(step)


# -- optimizers and the step ----------------------------------------------------------------------
class EncoderHead(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.encoder = nn.Sequential(nn.Linear(10, 32), nn.ReLU())
        self.head = nn.Linear(32, 3)

    def forward(self, x):
        return self.head(self.encoder(x))


@case("module_in_two_optimizers", "https://github.com/MishaLaskin/curl/issues/28",
      "the encoder's parameters are held by the main optimizer and by a separate encoder optimizer, and both "
      "step after the same backward: the encoder is updated twice with one gradient on every iteration")
def encoder_stepped_by_two_optimizers(buggy, record):
    model = EncoderHead()
    opt = torch.optim.Adam(model.parameters(), lr=5e-3)
    encoder_opt = torch.optim.Adam(model.encoder.parameters(), lr=5e-3)
    record(model, opt)
    for _ in range(STEPS):
        x, y = batch()
        opt.zero_grad()
        encoder_opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        opt.step()
        if buggy:
            encoder_opt.step()
    return 0


_BAD_STEP = 6


@case("skipped_step_keeps_gradients", "https://github.com/espnet/espnet/pull/3283",
      "a step whose gradient norm is not finite is skipped, but on that path optimizer.zero_grad() is never "
      "called: the NaN gradients stay in .grad, every later backward adds to them, and every later step is skipped")
def nan_step_skipped_without_zero_grad(buggy, record):
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    record(model, opt)
    for step in range(STEPS):
        x, y = batch()
        if step == _BAD_STEP:
            x[0, 0] = float("nan")  # one corrupt sample
        F.cross_entropy(model(x), y).backward()
        norm = nn.utils.clip_grad_norm_(model.parameters(), 5.0)
        if not torch.isfinite(norm):
            if not buggy:
                opt.zero_grad()
            continue
        opt.step()
        opt.zero_grad()
    return _BAD_STEP + 1


class DecoupledSGD(torch.optim.Optimizer):
    """SGD with momentum and decoupled weight decay, written by hand as Muon's reference code is."""

    decay_first = False

    def __init__(self, params, lr=0.05, momentum=0.9, weight_decay=0.1) -> None:
        super().__init__(params, dict(lr=lr, momentum=momentum, weight_decay=weight_decay))

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                if DecoupledSGD.decay_first:
                    p.mul_(1 - group["lr"] * group["weight_decay"])
                if p.grad is None:
                    continue
                if not DecoupledSGD.decay_first:
                    p.mul_(1 - group["lr"] * group["weight_decay"])
                buf = self.state[p].setdefault("momentum_buffer", torch.zeros_like(p))
                buf.mul_(group["momentum"]).add_(p.grad)
                p.add_(buf, alpha=-group["lr"])


class FrozenFeatures(nn.Module):
    """A pretrained feature layer kept frozen (requires_grad=False) under a trainable head."""

    def __init__(self) -> None:
        super().__init__()
        self.features = nn.Linear(10, 32)
        self.features.requires_grad_(False)
        self.head = nn.Linear(32, 3)

    def forward(self, x):
        return self.head(torch.tanh(self.features(x)))


@case("decay_before_grad_check", "https://github.com/KellerJordan/Muon/issues/54",
      "a hand-written optimizer applies its decoupled weight decay before it skips parameters whose gradient is "
      "None: tensors frozen with requires_grad=False but passed in model.parameters() shrink on every step")
def custom_optimizer_decays_gradless(buggy, record):
    DecoupledSGD.decay_first = buggy
    model = FrozenFeatures()
    _train(model, DecoupledSGD(model.parameters()), record)
    return 0


class GeM(nn.Module):
    """Generalised-mean pooling with a learnable exponent p (Radenovic et al.)."""

    def __init__(self, eps: Optional[float]) -> None:
        super().__init__()
        self.p, self.eps = nn.Parameter(torch.tensor(3.0)), eps

    def forward(self, x):  # N x C x H x W -> N x C
        if self.eps is not None:
            x = x.clamp(min=self.eps)
        return x.pow(self.p).mean((2, 3)).pow(1.0 / self.p)


def _frames(n=16):
    """Small images, a quarter of them blank (all zero): frames with nothing in them."""
    x = torch.randn(n, 3, 6, 6)
    x[: n // 4] = 0.0
    return x, (x.mean((2, 3)).argmax(1) + (x.abs().sum((1, 2, 3)) == 0).long()) % 3


@case("gem_pool_without_clamp", "https://github.com/facebookresearch/multigrain/issues/5",
      "GeM pooling written as x.pow(p).mean().pow(1/p) without the x.clamp(min=eps) of the reference code: a "
      "ReLU map that is all zero (a blank frame) pools to 0, whose 1/p-th power has an infinite derivative")
def gem_pooling_without_clamp(buggy, record):
    model = nn.Sequential(nn.Conv2d(3, 16, 3, padding=1), nn.ReLU(), GeM(None if buggy else 1e-6), nn.Linear(16, 3))
    _train(model, torch.optim.Adam(model.parameters(), lr=1e-2), record, make=_frames)
    return 0


class HandAdamW(torch.optim.AdamW):
    """AdamW's update written out by hand (as a skip-step variant needs); ``count_steps`` False reproduces the
    bug: the step counter is read for the bias corrections but never incremented."""

    count_steps = True

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if not state:
                    state["step"] = torch.tensor(0.0)
                    state["exp_avg"] = torch.zeros_like(p)
                    state["exp_avg_sq"] = torch.zeros_like(p)
                if HandAdamW.count_steps:
                    state["step"] += 1
                t = float(state["step"]) if HandAdamW.count_steps else float(state["step"]) + 1
                p.mul_(1 - group["lr"] * group["weight_decay"])
                state["exp_avg"].lerp_(p.grad, 1 - beta1)
                state["exp_avg_sq"].mul_(beta2).addcmul_(p.grad, p.grad, value=1 - beta2)
                denom = (state["exp_avg_sq"].sqrt() / (1 - beta2 ** t) ** 0.5).add_(group["eps"])
                p.addcdiv_(state["exp_avg"], denom, value=-group["lr"] / (1 - beta1 ** t))


@case("adam_step_count_frozen", "https://github.com/allenai/OLMo-core/pull/317",
      "a hand-written AdamW step (SkipStepAdamW) computed its bias corrections from a step counter it never "
      "incremented: every update used the first step's corrections, a different effective learning rate")
def adamw_step_counter_not_incremented(buggy, record):
    HandAdamW.count_steps = not buggy
    model = mlp()
    _train(model, HandAdamW(model.parameters(), lr=1e-2, weight_decay=0.01), record)
    return 1  # the first step is the same either way: (step + 1) = 1 there


_CLASS_W = np.array([1.0, 2.0, 2.0], dtype=np.float32)


def balanced_ce(buggy):
    """Class-weighted cross-entropy; the buggy form computes it in numpy and forces requires_grad on the result
    to get past "element 0 of tensors does not require grad and does not have a grad_fn"."""
    def loss(logits, y):
        if not buggy:
            w = torch.from_numpy(_CLASS_W)[y]
            return (F.cross_entropy(logits, y, reduction="none") * w).mean()
        p = F.softmax(logits, 1).detach().numpy()
        yy = y.numpy()
        value = torch.tensor(float((-np.log(p[np.arange(len(yy)), yy]) * _CLASS_W[yy]).mean()))
        value.requires_grad = True
        return value
    return loss


@case("requires_grad_forced_on_loss", "https://github.com/ronghuaiyang/arcface-pytorch/issues/56",
      "loss.backward() raised 'element 0 of tensors does not require grad'; the user set loss.requires_grad = True "
      "and training ran, with the loss never falling: the graph was cut and nothing reached the model")
def loss_requires_grad_forced(buggy, record):
    model = mlp()
    _train(model, torch.optim.Adam(model.parameters(), lr=1e-2), record, loss_fn=balanced_ce(buggy))
    return 0


class LocallyTrained(nn.Module):
    """Two stages, each with its own auxiliary head (InfoPro-style local learning): in training the forward
    pass back-propagates stage 1's local loss itself and hands stage 2 a detached input."""

    def __init__(self) -> None:
        super().__init__()
        self.stage1, self.aux1 = nn.Sequential(nn.Linear(10, 32), nn.ReLU()), nn.Linear(32, 3)
        self.stage2, self.head = nn.Sequential(nn.Linear(32, 32), nn.ReLU()), nn.Linear(32, 3)
        self.target = None

    def forward(self, x):
        h = self.stage1(x)
        if self.training and self.target is not None:
            F.cross_entropy(self.aux1(h), self.target).backward()
            h = h.detach()
        return self.head(self.stage2(h))


@case("local_gradients_wiped_by_trainer", "https://github.com/blackfeather-wang/InfoPro-Pytorch/issues/1",
      "local learning back-propagates each stage's loss inside forward(); a trainer that calls "
      "optimizer.zero_grad() after forward (mmcv's after_train_iter) deletes those gradients and only the "
      "last stage trains")
def local_losses_wiped_by_zero_grad(buggy, record):
    model = LocallyTrained()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    record(model, opt)
    for _ in range(STEPS):
        x, y = batch()
        model.target = y
        if not buggy:
            opt.zero_grad()  # the fix: zero before the forward pass (before_train_iter)
        out = model(x)
        if buggy:
            opt.zero_grad()  # the trainer's hook, after the forward pass
        F.cross_entropy(out, y).backward()
        opt.step()
    return 0


# -- sequences and attention ----------------------------------------------------------------------
_VOCAB, _LEN = 10, 8


def _token_walks(n=32):
    """Sequences from a noisy walk: each next token is the last one plus 1, 2 or 3 (mod 10)."""
    steps = torch.randint(1, 4, (n, _LEN))
    x = torch.cumsum(steps, 1) % _VOCAB
    return x[:, :-1], x[:, 1:]


class TinyDecoder(nn.Module):
    def __init__(self, causal: bool) -> None:
        super().__init__()
        self.causal = causal
        self.emb, self.pos = nn.Embedding(_VOCAB, 16), nn.Parameter(torch.randn(_LEN, 16) * 0.1)
        self.block = nn.TransformerEncoderLayer(16, 2, dim_feedforward=32, dropout=0.0, batch_first=True)
        self.out = nn.Linear(16, _VOCAB)

    def forward(self, tokens):  # N x L -> N x L x vocab
        n = tokens.shape[1]
        mask = nn.Transformer.generate_square_subsequent_mask(n) if self.causal else None
        return self.out(self.block(self.emb(tokens) + self.pos[:n], src_mask=mask, is_causal=self.causal))


def _lm_loss(logits, targets):
    return F.cross_entropy(logits.reshape(-1, _VOCAB), targets.reshape(-1))


@case("causal_mask_missing", "https://github.com/alex-matton/causal-transformer-decoder/issues/1",
      "a transformer decoder trained on whole sequences without the causal target mask: each position attends to "
      "the next token, which is its own label, so training learns to copy and fails at autoregressive decoding")
def decoder_without_causal_mask(buggy, record):
    model = TinyDecoder(causal=not buggy)

    def make():
        inp, tgt = _token_walks()
        return (torch.cat([inp, tgt[:, -1:]], 1), tgt)  # the whole sequence goes in, as in the report

    def forward_loss(logits, tgt):
        return _lm_loss(logits[:, :-1], tgt)

    _train(model, torch.optim.Adam(model.parameters(), lr=1e-2), record, make=make, loss_fn=forward_loss)
    return 0


class BiLSTMClassifier(nn.Module):
    def __init__(self, buggy: bool) -> None:
        super().__init__()
        self.buggy = buggy
        self.lstm = nn.LSTM(8, 16, batch_first=True, bidirectional=True)
        self.head = nn.Linear(32, 3)

    def features(self, x):
        out, (h, _) = self.lstm(x)
        if self.buggy:
            return out[:, -1]  # forward state after the last step, backward state after only the last step
        return torch.cat([h[-2], h[-1]], 1)  # forward final state, backward final state (after the first step)

    def forward(self, x):
        return self.head(self.features(x))


def _first_token_task(n=32, length=12):
    x = torch.randn(n, length, 8)
    return x, x[:, 0, :3].argmax(1)  # the label is written in the first time step


@case("bidirectional_last_step_readout", "https://github.com/yunjey/pytorch-tutorial/issues/149",
      "a bidirectional LSTM read out at out[:, -1]: the backward direction's state there has seen only the last "
      "input, so half of the features carry no information about the rest of the sequence")
def bilstm_last_step_readout(buggy, record):
    model = BiLSTMClassifier(buggy)
    _train(model, torch.optim.Adam(model.parameters(), lr=1e-2), record, make=_first_token_task)
    return 0


class LogSoftmaxNet(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.dim, self.net = dim, mlp()

    def forward(self, x):
        return F.log_softmax(self.net(x), dim=self.dim)


@case("log_softmax_over_batch", "https://github.com/fxia22/pointnet.pytorch/issues/27",
      "the classifier returns F.log_softmax(x, dim=0) for F.nll_loss: the normalisation runs over the batch "
      "axis, not the classes, so the loss is not the cross-entropy of any class distribution")
def log_softmax_over_batch_axis(buggy, record):
    model = LogSoftmaxNet(0 if buggy else 1)
    _train(model, torch.optim.Adam(model.parameters(), lr=1e-2), record, loss_fn=F.nll_loss)
    return 0


# -- data pipelines ----------------------------------------------------------------------------------
def _pool(n=1000, seed=5):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 10, generator=gen)
    return x, x[:, :3].argmax(1)


_WORKERS = 4


def worker_batches(buggy, steps=STEPS, n=32):
    """What a 4-worker DataLoader over an infinite, randomly sampled and augmented dataset yields. Each worker
    makes whole batches in turn and draws with np.random; fork copies the parent's numpy state into every
    worker unless a worker_init_fn reseeds it."""
    x, y = _pool()
    parent = np.random.RandomState(0)
    if buggy:
        rngs = [copy.deepcopy(parent) for _ in range(_WORKERS)]
    else:  # worker_init_fn: np.random.seed(base_seed + worker_id)
        rngs = [np.random.RandomState(1000 + w) for w in range(_WORKERS)]
    out = []
    for i in range(steps):
        rng = rngs[i % _WORKERS]
        idx = torch.from_numpy(rng.randint(0, len(x), n))
        noise = torch.from_numpy(rng.normal(0.0, 0.3, (n, 10)).astype(np.float32))
        out.append((x[idx] + noise, y[idx]))
    return out


@case("worker_rng_duplicated", "https://github.com/pytorch/pytorch/issues/5059",
      "np.random in a Dataset's __getitem__ with num_workers > 0: each forked worker starts from the same numpy "
      "state, so the workers draw the same samples and augmentations and batches repeat num_workers times")
def loader_workers_share_numpy_seed(buggy, record):
    batches = iter(worker_batches(buggy))
    model = mlp()
    _train(model, torch.optim.Adam(model.parameters(), lr=1e-2), record, make=lambda: next(batches))
    return 1  # batch 1 (worker 1's first) repeats batch 0


def imbalanced_set():
    x, y = _pool(900, seed=6)
    keep = (y == 0) | (torch.arange(len(y)) % 6 == 0)  # class 0 common, classes 1 and 2 rare
    return x[keep], y[keep]


def sampler_indices(buggy, steps=STEPS, n=32):
    x, y = imbalanced_set()
    class_w = 1.0 / torch.bincount(y, minlength=3).double()
    weights = class_w if buggy else class_w[y]  # the fix: one weight per sample
    gen = torch.Generator().manual_seed(7)
    sampler = torch.utils.data.WeightedRandomSampler(weights, steps * n, replacement=True, generator=gen)
    return torch.tensor(list(sampler)).view(steps, n)


@case("sampler_weights_per_class", "https://github.com/deep-voice/soundbay/pull/49",
      "WeightedRandomSampler given one weight per class instead of one per sample: it draws indices from "
      "range(len(weights)), so training sees only the dataset's first C samples")
def weighted_sampler_class_weights(buggy, record):
    x, y = imbalanced_set()
    batches = iter(sampler_indices(buggy))

    def make():
        idx = next(batches)
        return x[idx], y[idx]

    model = mlp()
    _train(model, torch.optim.Adam(model.parameters(), lr=1e-2), record, make=make)
    return 0


# -- reinforcement learning, checkpoints, averaging ---------------------------------------------------
class ActorCritic(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.actor, self.critic = mlp(), mlp(classes=1)

    def forward(self, s):  # policy logits and state values
        return self.actor(s), self.critic(s).squeeze(1)


def bandit(n=64):
    s = torch.randn(n, 10)
    return s, s[:, :3].argmax(1)  # reward 1 for the best arm, 0 otherwise


def a2c_losses(model, s, best, buggy):
    logits, v = model(s)
    dist = torch.distributions.Categorical(logits=logits)
    a = dist.sample()
    r = (a == best).float()
    advantage = r - v if buggy else r - v.detach()
    return -(dist.log_prob(a) * advantage).mean(), F.mse_loss(v, r)


@case("advantage_not_detached", "https://github.com/astariul/encode-attend-navigate-pytorch/issues/2",
      "the policy loss uses (reward - critic value) without stopping the gradient: the critic is trained by "
      "the policy loss as well as by its own, and its estimates are pushed away from the expected reward")
def critic_trained_by_policy_loss(buggy, record):
    model = ActorCritic()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    record(model, opt)
    for _ in range(STEPS):
        s, best = bandit()
        policy, value = a2c_losses(model, s, best, buggy)
        opt.zero_grad()
        (policy + 0.5 * value).backward()
        opt.step()
    return 0


def noisy_train_set():
    """24 training examples, a third of them mislabelled: a network this size overfits them."""
    gen = torch.Generator().manual_seed(8)
    x = torch.randn(24, 10, generator=gen)
    y = x[:, :3].argmax(1)
    y[::3] = (y[::3] + 1) % 3
    return x, y


def clean_val_set():
    gen = torch.Generator().manual_seed(9)
    x = torch.randn(256, 10, generator=gen)
    return x, x[:, :3].argmax(1)


def val_loss(model):
    x, y = clean_val_set()
    with torch.no_grad():
        return float(F.cross_entropy(model(x), y))


@case("best_state_aliased", "https://github.com/WenjieDu/PyPOTS/issues/667",
      "early stopping kept best = model.state_dict() without deepcopy: state_dict() returns references to the "
      "live tensors, so the 'best' weights follow training and the model restored at the end is the last one")
def best_checkpoint_aliased(buggy, record):
    model = mlp(hidden=64)
    opt = torch.optim.Adam(model.parameters(), lr=3e-2)
    x, y = noisy_train_set()
    best, best_loss, first_save = None, float("inf"), None
    record(model, opt)
    for step in range(STEPS):
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        opt.step()
        if step % 4 == 3:
            loss = val_loss(model)
            if loss < best_loss:
                best_loss = loss
                best = model.state_dict() if buggy else copy.deepcopy(model.state_dict())
                first_save = step if first_save is None else first_save
    model.load_state_dict(best)  # restore the best weights for evaluation and export
    SIDE["best_state_aliased", buggy] = best_loss
    return first_save + 1


class WeightEMA:
    """An exponential moving average of a model's weights (MixMatch's WeightEMA); ``buffers`` False
    averages the parameters only."""

    def __init__(self, model, decay=0.9, buffers=True) -> None:
        self.model, self.decay, self.buffers = model, decay, buffers
        self.ema = copy.deepcopy(model).requires_grad_(False)

    @torch.no_grad()
    def update(self):
        for e, p in zip(self.ema.parameters(), self.model.parameters()):
            e.lerp_(p, 1 - self.decay)
        if self.buffers:
            for e, b in zip(self.ema.buffers(), self.model.buffers()):
                e.copy_(b)


def shifted_batch(n=32):
    x, y = batch(n)
    return 10 * x + 20, y  # raw, unnormalised features: far from zero mean and unit variance


@case("ema_skips_buffers", "https://github.com/YU1ut/MixMatch-pytorch/issues/16",
      "the EMA model is updated from model.parameters() only: BatchNorm's running mean and variance are buffers, "
      "never copied, and the EMA model (which sees no data) evaluates with the initial statistics 0 and 1")
def ema_without_batchnorm_buffers(buggy, record):
    model = mlp(bn=True)
    ema = WeightEMA(model, buffers=not buggy)
    SIDE["ema_skips_buffers", buggy] = ema
    _train(model, torch.optim.Adam(model.parameters(), lr=1e-2), record, make=shifted_batch,
           after_step=lambda step: ema.update())
    return 0


_PAD, _TOK = 0, 12


def padded_walks(n=32, length=10):
    """Sequences of 3 to 9 real tokens (1..11, each the last times 3, plus 1, mod 11) then padding (0)."""
    start = torch.randint(1, _TOK, (n, 1))
    toks = [start]
    for _ in range(length - 1):
        toks.append(toks[-1] * 3 % 11 + 1)
    x = torch.cat(toks, 1)
    lengths = torch.randint(3, length, (n, 1))
    x[torch.arange(length)[None] >= lengths] = _PAD
    return x[:, :-1], x[:, 1:]


class BigramLM(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb, self.out = nn.Embedding(_TOK, 16), nn.Linear(16, _TOK)

    def forward(self, tokens):
        return self.out(torch.tanh(self.emb(tokens)))


def token_loss(buggy):
    def loss(logits, targets):
        flat, t = logits.reshape(-1, _TOK), targets.reshape(-1)
        return F.cross_entropy(flat, t) if buggy else F.cross_entropy(flat, t, ignore_index=_PAD)
    return loss


@case("padding_targets_not_ignored", "https://github.com/lukas-blecher/LaTeX-OCR/issues/305",
      "sequences padded with the [PAD] id 0 and cross_entropy left at its default ignore_index=-100: the padded "
      "positions are trained as targets, and the model learns to predict padding where real tokens follow")
def pad_targets_in_loss(buggy, record):
    model = BigramLM()
    _train(model, torch.optim.Adam(model.parameters(), lr=3e-2), record, make=padded_walks, loss_fn=token_loss(buggy))
    return 0
