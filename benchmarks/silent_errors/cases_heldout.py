"""A held-out set of silent training errors, written blind: each case is our own reconstruction
(toy scale, CPU) of a public bug report or widely reported pitfall, in its buggy and its fixed
form, written without running the recorder and without changing it. ``CASES[name]`` is a
``cases.Case``; ``CAUSES`` maps each cause to the finding kind that would name it, decided before
any score was seen, or to None where no existing kind could name it (such a case counts as cause
not named whatever is found). Most classes are not in cases.py / cases_invariants.py; the ones
that are variants of a class there say so in their comment.

Scored with ``score.py --set heldout``; this registry is separate from ``cases.CASES``, so the
design and scored halves score as before."""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from cases import Case
from harness import STEPS, batch, mlp
from torch import nn

# The cause a report established -> the finding kind that names it (None: no existing kind can).
CAUSES: dict[str, Optional[str]] = {
    "grad_mask_hook": "zero_gradient",  # a gradient hook whose mask is all zero for a whole layer
    "param_rewrapped": "stale_optimizer_param",  # a new nn.Parameter put in after the optimizer was built
    "unregistered_layers": "not_in_optimizer",  # layers kept in a Python list: not the model's parameters
    "unregistered_tensor": "not_in_optimizer",  # a tensor meant to train kept as a plain attribute
    "double_softmax": "tiny_gradient",  # softmax before cross_entropy: attenuated gradients
    "clip_scaled_grads": "grad_modified",  # clipping the loss-scaled gradients: every update shrunk by the scale
    "empty_mask_nan": "nonfinite_gradient",  # a masked mean over an empty mask: 0/0 in the loss
    "target_broadcast": None,  # (N,1) against (N,): the loss broadcasts to NxN and trains toward the mean
    "optimizer_recreated": None,  # a fresh Adam every step: its moments never build up
    "clip_exhausted_iterator": None,  # clip_grad_norm_ given a used-up filter(): no clipping at all
    "warmup_int_division": "lr_zero",  # a warm-up ratio in integer arithmetic: lr 0 for the whole warm-up
    "step_before_backward": "grad_reset_in_step",  # optimizer.step() before loss.backward(): the step never sees it
    "tying_broken": None,  # output layer tied by a copy: two tensors that train apart
    "no_grad_forward": "no_gradient",  # a block's forward under torch.no_grad(): no gradient below it
}

CASES: dict[str, Case] = {}


def case(cause: str, url: str, report: str):
    assert cause in CAUSES, cause

    def register(fn):
        CASES[fn.__name__] = Case(fn, cause, url, report)
        return fn
    return register


def _train(model, opt, record, make=batch, loss_fn=F.cross_entropy, steps=STEPS, **options):
    record(model, opt, **options)
    for _ in range(steps):
        x, y = make()
        opt.zero_grad()
        loss_fn(model(x), y).backward()
        opt.step()


def _stack() -> nn.Sequential:
    return nn.Sequential(nn.Linear(10, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 3))


# -- a gradient hook that zeroes a whole layer -------------------------------------------------
@case("grad_mask_hook", "https://github.com/Eric-mingjie/rethinking-network-pruning/issues/18",
      "a global pruning threshold masked every unit of one layer, which then blocks its updates")
def global_prune_mask_hook_zeroes_layer(buggy, record):
    model = _stack()
    with torch.no_grad():
        model[2].weight.mul_(0.05)  # a layer initialised at a smaller scale than the others
    weights = [model[0].weight, model[2].weight, model[4].weight]
    prune = 0.8
    if buggy:  # one threshold over all layers: the small layer falls wholly below it
        thr = torch.quantile(torch.cat([w.detach().abs().flatten() for w in weights]), prune)
        masks = [(w.detach().abs() > thr).float() for w in weights]
    else:  # the fix: a threshold per layer
        masks = [(w.detach().abs() > torch.quantile(w.detach().abs().flatten(), prune)).float() for w in weights]
    for w, m in zip(weights, masks):
        w.register_hook(lambda g, m=m: g * m)  # keep pruned weights where they are
    _train(model, torch.optim.SGD(model.parameters(), lr=0.1), record)
    return 0


# -- a parameter re-wrapped after the optimizer was built --------------------------------------
class _BagClassifier(nn.Module):
    def __init__(self, vocab: int = 20) -> None:
        super().__init__()
        self.embed, self.head = nn.Embedding(vocab, 16), nn.Linear(16, 2)

    def forward(self, tokens):
        return self.head(self.embed(tokens).mean(1))


def _tokens(vocab: int = 24):
    t = torch.randint(0, vocab, (16, 6))
    return t, (t >= 20).any(1).long()  # the label needs the new tokens


@case("param_rewrapped", "https://github.com/huggingface/transformers/pull/3532",
      "the embedding matrix was resized for new tokens after the parameters were passed to the optimizer")
def embedding_resized_after_optimizer(buggy, record):
    model = _BagClassifier(20)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    old = model.embed.weight.detach()
    grown = torch.cat([old, 0.02 * torch.randn(4, old.shape[1])])
    model.embed.weight = nn.Parameter(grown)  # the resize: a new Parameter on the same module
    model.embed.num_embeddings = 24
    if not buggy:
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    _train(model, opt, record, make=_tokens)
    return 0


# -- layers and tensors the model does not register --------------------------------------------
class _ListNet(nn.Module):
    def __init__(self, registered: bool) -> None:
        super().__init__()
        self.inp, self.out = nn.Linear(10, 32), nn.Linear(32, 3)
        hidden = [nn.Linear(32, 32) for _ in range(2)]
        self.hidden = nn.ModuleList(hidden) if registered else hidden

    def forward(self, x):
        h = F.relu(self.inp(x))
        for layer in self.hidden:
            h = F.relu(layer(h))
        return self.out(h)


@case("unregistered_layers", "https://github.com/pytorch/pytorch/issues/59925",
      "layers kept in a Python list are not registered: the optimizer silently never updates them")
def hidden_layers_in_python_list(buggy, record):
    model = _ListNet(registered=not buggy)
    _train(model, torch.optim.Adam(model.parameters(), lr=1e-3), record)
    return 0


class _MemoryHead(nn.Module):
    """Attention over a learned memory of keys and values (a memory bank of normal patterns)."""

    def __init__(self, registered: bool, slots: int = 8, dim: int = 16) -> None:
        super().__init__()
        self.enc, self.out = nn.Linear(10, dim), nn.Linear(dim, 3)
        keys, values = torch.randn(slots, dim), torch.randn(slots, dim)
        if registered:
            self.keys, self.values = nn.Parameter(keys), nn.Parameter(values)
        else:  # plain tensors: not in parameters(), never given to the optimizer
            self.keys, self.values = keys, values

    def forward(self, x):
        h = self.enc(x)
        read = torch.softmax(h @ self.keys.t(), -1) @ self.values
        return self.out(h + read)


@case("unregistered_tensor", "https://github.com/SimonThomine/RememberingNormality/issues/7",
      "memory keys and values created as plain tensors, not nn.Parameter: they stay at their random init")
def memory_tensors_not_parameters(buggy, record):
    model = _MemoryHead(registered=not buggy)
    _train(model, torch.optim.Adam(model.parameters(), lr=1e-3), record)
    return 0


# -- a loss that attenuates or breaks the gradient ---------------------------------------------
@case("double_softmax", "https://github.com/bowang-lab/Transformer-GCN-QA/pull/32",
      "a softmax at the model's output before CrossEntropyLoss (which applies its own): a lesser gradient signal")
def softmax_before_cross_entropy(buggy, record):
    net = mlp(10, 32, 3)
    model = nn.Sequential(net, nn.Softmax(-1)) if buggy else net
    _train(model, torch.optim.SGD(model.parameters(), lr=0.1), record)
    return 0


@case("empty_mask_nan", "https://github.com/NVIDIA-NeMo/Automodel/issues/3796",
      "a batch with no supervised tokens divides a masked sum by a count of 0: NaN reaches every parameter")
def masked_loss_empty_batch(buggy, record):
    model = mlp(10, 32, 3)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    record(model, opt)
    empty_at = 13
    for step in range(STEPS):
        x, y = batch()
        keep = (torch.rand(32) > 0.3).float() if step != empty_at else torch.zeros(32)  # every example masked out
        per_example = F.cross_entropy(model(x), y, reduction="none")
        count = keep.sum() if buggy else keep.sum().clamp_min(1.0)
        opt.zero_grad()
        ((per_example * keep).sum() / count).backward()
        opt.step()
    return empty_at


@case("target_broadcast", "https://github.com/deepset-ai/FARM/issues/229",
      "regression logits squeezed to (N,) against labels of shape (N,1): the MSE broadcasts to NxN")
def regression_target_broadcast(buggy, record):
    model = mlp(10, 32, 1)
    w = torch.randn(10)

    def make():
        x = torch.randn(32, 10)
        return x, (x @ w).unsqueeze(1)  # labels (N, 1)

    def loss_fn(out, y):  # the head squeezes its output to (N,)
        return F.mse_loss(out.squeeze(1), y if buggy else y.squeeze(1))

    _train(model, torch.optim.SGD(model.parameters(), lr=0.02), record, make=make, loss_fn=loss_fn)
    return 0


# -- the optimizer's own state and the step's order --------------------------------------------
@case("optimizer_recreated", "https://github.com/Wangyixinxin/ACN/issues/9",
      "the optimizer was instantiated inside the batch loop: a new Adam each iteration resets its moments")
def adam_recreated_every_batch(buggy, record):
    model = mlp(10, 32, 3)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    record(model, opt)
    for _ in range(STEPS):
        if buggy:
            opt = torch.optim.Adam(model.parameters(), lr=1e-3)
        x, y = batch()
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        opt.step()
    return 1  # step 0 is the same either way; from step 1 the moments are lost


@case("step_before_backward", "https://theneuralbase.com/pytorch/learn/beginner/forward-pass-loss-backward-step/",
      "the order zero_grad, forward, loss, backward, step breaks if reordered, especially with step before backward")
def step_called_before_backward(buggy, record):
    model = mlp(10, 32, 3)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    record(model, opt)
    for _ in range(STEPS):
        x, y = batch()
        opt.zero_grad()
        loss = F.cross_entropy(model(x), y)
        if buggy:
            opt.step()
            loss.backward()
        else:
            loss.backward()
            opt.step()
    return 0


@case("warmup_int_division", "https://github.com/facebookresearch/maskrcnn-benchmark/issues/335",
      "the linear warm-up's ratio step/warmup_iters was an integer division, so the warm-up never ramped")
def warmup_ratio_integer_division(buggy, record):
    model = mlp(10, 32, 3)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    warmup, start = 16, 0.0  # a warm-up from a factor of 0

    def factor(step):
        if step >= warmup:
            return 1.0
        alpha = step // warmup if buggy else step / warmup
        return start * (1 - alpha) + alpha

    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: factor(s + 1))  # the first step is already warming
    record(model, opt)
    for _ in range(STEPS):
        x, y = batch()
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        opt.step()
        sched.step()
    return 0


# -- clipping that does nothing, or too much ---------------------------------------------------
@case("clip_scaled_grads", "https://github.com/victorchall/EveryDream2trainer/pull/175",
      "with AMP the clip was applied to the scaled gradients: max norm 1.0 effectively halted training")
def clip_before_unscale(buggy, record):
    model = mlp(10, 32, 3)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 16)
    record(model, opt, scaler=scaler)
    for _ in range(STEPS):
        x, y = batch()
        opt.zero_grad()
        scaler.scale(F.cross_entropy(model(x), y)).backward()
        if not buggy:
            scaler.unscale_(opt)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        scaler.step(opt)
        scaler.update()
    return 0


@case("clip_exhausted_iterator", "https://github.com/PixArt-alpha/PixArt-alpha/pull/160",
      "params_to_clip was a filter() already consumed by the optimizer: clip_grad_norm_ got nothing to clip")
def clip_on_consumed_filter(buggy, record):
    model = mlp(10, 32, 1)
    params = filter(lambda p: p.requires_grad, model.parameters())
    if not buggy:
        params = list(params)
    opt = torch.optim.SGD(params, lr=0.05)
    record(model, opt)
    w = torch.randn(10)
    for step in range(STEPS):
        x = torch.randn(32, 10) * (30.0 if step % 7 == 3 else 1.0)  # now and then a batch of outliers
        opt.zero_grad()
        F.mse_loss(model(x).squeeze(1), x @ w).backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
    return 0


# -- tying broken, and a block under no_grad ---------------------------------------------------
class _TiedLM(nn.Module):
    def __init__(self, tied: bool, vocab: int = 30, dim: int = 16) -> None:
        super().__init__()
        self.embed, self.mix = nn.Embedding(vocab, dim), nn.Linear(dim, dim)
        self.out = nn.Linear(dim, vocab, bias=False)
        if tied:
            self.out.weight = self.embed.weight
        else:  # "tied" by copying the values: two tensors from here on
            self.out.weight = nn.Parameter(self.embed.weight.detach().clone())

    def forward(self, tokens):
        return self.out(torch.tanh(self.mix(self.embed(tokens))))


@case("tying_broken", "https://github.com/huggingface/sentence-transformers/pull/3781",
      "the decoder's weights were not tied to the encoder's after a library change: they train separately")
def output_tied_by_copy(buggy, record):
    model = _TiedLM(tied=not buggy)

    def make():
        t = torch.randint(0, 30, (8, 7))
        return t[:, :-1], t[:, 1:]

    def loss_fn(logits, y):
        return F.cross_entropy(logits.reshape(-1, 30), y.reshape(-1))

    _train(model, torch.optim.SGD(model.parameters(), lr=0.5), record, make=make, loss_fn=loss_fn)
    return 0


class _DropUnits(nn.Module):
    """Drops random units in training; ``no_grad_forward`` puts the whole forward under no_grad."""

    def __init__(self, p: float, no_grad_forward: bool) -> None:
        super().__init__()
        self.p, self.no_grad_forward = p, no_grad_forward

    def _mask(self, x):
        return (torch.rand_like(x) > self.p).to(x.dtype) / (1 - self.p)

    def forward(self, x):
        if not self.training:
            return x
        if self.no_grad_forward:
            with torch.no_grad():  # "it does not need gradients": the output is cut from the graph
                return x * self._mask(x)
        with torch.no_grad():
            mask = self._mask(x)  # only the mask is made without gradients
        return x * mask


@case("no_grad_forward", "https://github.com/miguelvr/dropblock/issues/41",
      "asked to wrap the drop block's forward in torch.no_grad during training: it breaks the graph below it")
def drop_block_forward_under_no_grad(buggy, record):
    model = nn.Sequential(nn.Linear(10, 32), nn.ReLU(), _DropUnits(0.1, no_grad_forward=buggy), nn.Linear(32, 3))
    _train(model, torch.optim.SGD(model.parameters(), lr=0.1), record)
    return 0
