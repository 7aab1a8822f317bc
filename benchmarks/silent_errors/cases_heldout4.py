"""A fourth held-out set of silent training errors, written blind: each case is our own toy
reconstruction (CPU, well under a second) of a public report or widely reported pitfall, in its
buggy and its fixed form, written without reading how the recorder works and without running it
on any case here. ``CASES[name]`` is a ``cases.Case``; ``CAUSES`` maps each cause to the finding
kind that would name it (the kinds table of docs/record.md), decided before anything ran, or to
None where no existing kind names it (such a case counts as cause not named whatever is found).
Every mechanism differs from those of cases.py, cases_invariants.py and cases_heldout*.py.

Scored with ``score.py --set heldout4``; this registry is separate from the other sets'."""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from cases import Case
from harness import STEPS, batch, mlp
from torch import nn

# The cause a report established -> the finding kind that names it (None: no existing kind can).
CAUSES: dict[str, Optional[str]] = {
    "parameter_unwrapped_by_data": None,  # nn.Parameter(t).data: a plain tensor, never trained
    "default_argument_module_shared": None,  # a layer as a default argument: every instance shares it
    "plateau_mode_min_on_accuracy": None,  # ReduceLROnPlateau in 'min' mode fed a rising accuracy
    "lambda_returns_absolute_lr": None,  # LambdaLR's function returns an lr, taken as a factor
    "argmax_gate": "no_gradient",  # experts picked by argmax: the gate gets no gradient
    "freeze_by_comparison": None,  # `p.requires_grad == False`: a comparison, nothing frozen
    "keep_prob_as_rate": None,  # TensorFlow's keep probability given as PyTorch's drop rate
    "batchnorm_over_positions": None,  # BatchNorm1d on (N, L, C): normalises positions, not channels
    "fp16_gradient_underflow": None,  # pure float16 weights, no loss scaling: small gradients flush to 0
    "zero_grad_on_submodule": "stale_gradient",  # zero_grad on the head only: the body's grads pile up
    "reinitialised_every_step": "changed_between_steps",  # model.apply(init) inside the loop
    "soft_targets_cast_to_long": None,  # probabilities cast to integers: every target 0
}

CASES: dict[str, Case] = {}


def case(cause: str, url: str, report: str):
    assert cause in CAUSES, cause

    def register(fn):
        CASES[fn.__name__] = Case(fn, cause, url, report)
        return fn
    return register


def _train(model, opt, record, make=batch, loss_fn=F.cross_entropy, steps=STEPS, before=None, after=None,
           forward=None, **options):
    record(model, opt, **options)
    for step in range(steps):
        if before is not None:
            before(step)
        x, y = make()
        opt.zero_grad()
        out = model(x) if forward is None else forward(x)
        loss_fn(out, y).backward()
        opt.step()
        if after is not None:
            after(step)


class ScaledHead(nn.Module):
    def __init__(self, buggy: bool) -> None:
        super().__init__()
        self.fc = nn.Linear(10, 3)
        if buggy:
            self.scale = nn.Parameter(torch.full((3,), 2.0)).data  # .data: a plain tensor, not registered
        else:
            self.scale = nn.Parameter(torch.full((3,), 2.0))

    def forward(self, x):
        return self.fc(x) * self.scale


@case("parameter_unwrapped_by_data", "https://openillumi.com/?p=120695",
      "a learnable per-class scale assigned as nn.Parameter(...).data is a plain tensor: not in "
      "parameters(), the optimizer never sees it, it stays at its initial value")
def parameter_unwrapped_by_data(buggy, record):
    model = ScaledHead(buggy)
    _train(model, torch.optim.SGD(model.parameters(), lr=0.1), record)
    return 0


def _two_task_batch(n=32):
    x = torch.randn(n, 10)
    return x, torch.stack([x[:, :3].argmax(1), x[:, 3:6].argmax(1)], 1)


@case("default_argument_module_shared", "https://github.com/nerfstudio-project/nerfstudio/pull/2197",
      "a task head whose projection is a default argument (evaluated once, at definition): both task "
      "heads hold the same layer, which is pulled toward two different tasks")
def default_argument_module_shared(buggy, record):
    class Head(nn.Module):
        def __init__(self, proj=nn.Linear(16, 3)) -> None:  # noqa: B008 - the bug reconstructed
            super().__init__()
            self.proj = proj

        def forward(self, h):
            return self.proj(h)

    class TwoTasks(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.body = nn.Sequential(nn.Linear(10, 16), nn.ReLU())
            self.head_a = Head() if buggy else Head(nn.Linear(16, 3))
            self.head_b = Head() if buggy else Head(nn.Linear(16, 3))

        def forward(self, x):
            h = self.body(x)
            return torch.stack([self.head_a(h), self.head_b(h)], 1)  # N x 2 x 3

    def loss(out, y):
        return F.cross_entropy(out[:, 0], y[:, 0]) + F.cross_entropy(out[:, 1], y[:, 1])

    model = TwoTasks()
    _train(model, torch.optim.Adam(model.parameters(), lr=1e-2), record, make=_two_task_batch, loss_fn=loss)
    return 0


def _eval_batch():
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(512, 10, generator=gen)
    return x, x[:, :3].argmax(1)


@case("plateau_mode_min_on_accuracy", "https://hasty.ai/docs/mp-wiki/scheduler/reducelronplateau",
      "ReduceLROnPlateau left at its default mode 'min' while stepped with validation accuracy: every "
      "rise counts as no improvement, the lr is cut after every epoch")
def plateau_mode_min_on_accuracy(buggy, record):
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    sched = torch.optim.lr_scheduler.ReduceLROnPlateau(opt, mode="min" if buggy else "max", factor=0.3, patience=0)
    xv, yv = _eval_batch()

    def after(step):
        if step % 4 == 3:  # an "epoch" of 4 batches, then validation
            with torch.no_grad():
                acc = float((model(xv).argmax(1) == yv).float().mean())
            sched.step(acc)

    _train(model, opt, record, after=after)
    return 8


@case("lambda_returns_absolute_lr",
      "https://runebook.dev/en/docs/pytorch/generated/torch.optim.lr_scheduler.lambdalr",
      "LambdaLR's function written to return the wanted learning rate; LambdaLR multiplies the base lr by "
      "it, so the lr is the product of the two, a thousand times too small")
def lambda_returns_absolute_lr(buggy, record):
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    fn = (lambda s: 1e-3 * 0.99 ** s) if buggy else (lambda s: 0.99 ** s)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, fn)
    _train(model, opt, record, after=lambda step: sched.step())
    return 0


class ArgmaxMoE(nn.Module):
    def __init__(self, buggy: bool) -> None:
        super().__init__()
        self.buggy = buggy
        self.gate = nn.Linear(10, 2)
        self.experts = nn.ModuleList([mlp(hidden=16), mlp(hidden=16)])

    def forward(self, x):
        outs = torch.stack([e(x) for e in self.experts], 1)  # N x 2 x 3
        if self.buggy:
            pick = self.gate(x).argmax(1)  # an index: no gradient reaches the gate
            return outs[torch.arange(len(x)), pick]
        w = F.softmax(self.gate(x), 1)
        return (w.unsqueeze(2) * outs).sum(1)


@case("argmax_gate", "https://www.geeksforgeeks.org/how-does-pytorch-backprop-through-argmax/",
      "a mixture whose gate picks its expert by argmax: argmax is not differentiable, the gate's weights "
      "get no gradient and keep their initial routing")
def argmax_gate(buggy, record):
    model = ArgmaxMoE(buggy)
    _train(model, torch.optim.Adam(model.parameters(), lr=1e-2), record)
    return 0


@case("freeze_by_comparison", "https://theneuralbase.com/pytorch/learn/intermediate/freezing-base-model-weights/",
      "freezing the pretrained first layer written with == in place of =: the statement compares and "
      "discards, the layer trains with the head")
def freeze_by_comparison(buggy, record):
    model = mlp()
    for p in model[0].parameters():
        if buggy:
            p.requires_grad == False  # noqa: B015, E712 - the bug reconstructed: a comparison
        else:
            p.requires_grad = False
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1)
    _train(model, opt, record)
    return 0


@case("keep_prob_as_rate", "https://discuss.pytorch.org/t/the-p-in-dropout/10698",
      "a model ported from TensorFlow keeps keep_prob=0.9 and passes it as nn.Dropout's p, the probability "
      "of dropping: nine units in ten are zeroed at every training step")
def keep_prob_as_rate(buggy, record):
    keep_prob = 0.9
    model = mlp(dropout=keep_prob if buggy else 1 - keep_prob)
    _train(model, torch.optim.Adam(model.parameters(), lr=1e-2), record)
    return 0


def _sequences(n=32):
    x = torch.randn(n, 8, 8)  # N x L x C
    return x, x.mean(1)[:, :3].argmax(1)


class SeqModel(nn.Module):
    def __init__(self, buggy: bool) -> None:
        super().__init__()
        self.buggy = buggy
        self.proj = nn.Linear(8, 8)
        self.norm = nn.BatchNorm1d(8)  # meant for the 8 channels; L is also 8, so no shape error
        self.head = nn.Linear(8, 3)

    def normed(self, x):
        h = self.proj(x)
        return self.norm(h) if self.buggy else self.norm(h.transpose(1, 2)).transpose(1, 2)

    def forward(self, x):
        return self.head(F.relu(self.normed(x)).mean(1))


@case("batchnorm_over_positions",
      "https://github.com/xieyulai/LSTM-for-Human-Activity-Recognition-using-2D-Pose_Pytorch/issues/2",
      "BatchNorm1d expects (N, C, L); a sequence model hands it (N, L, C) with L equal to C, so it runs and "
      "normalises each position over batch and channels instead of each channel")
def batchnorm_over_positions(buggy, record):
    model = SeqModel(buggy)
    _train(model, torch.optim.Adam(model.parameters(), lr=1e-2), record, make=_sequences)
    return 0


def _deep(dtype):
    torch.manual_seed(0)
    layers = []
    for _ in range(6):
        lin = nn.Linear(10, 10)
        with torch.no_grad():
            lin.weight.mul_(0.1)
        layers += [lin, nn.Tanh()]
    return nn.Sequential(*layers, nn.Linear(10, 3)).to(dtype)


@case("fp16_gradient_underflow",
      "https://www.workatafrontierlab.com/lessons/foundations/numerical-stability",
      "a deep narrow network cast to float16 with .half() and trained without loss scaling: the early "
      "layers' gradients fall below float16's smallest subnormal and are exactly zero")
def fp16_gradient_underflow(buggy, record):
    dtype = torch.float16 if buggy else torch.float32
    model = _deep(dtype)

    def make():
        x, y = batch()
        return x.to(dtype), y

    _train(model, torch.optim.SGD(model.parameters(), lr=0.5), record, make=make,
           loss_fn=lambda out, y: F.cross_entropy(out.float(), y))
    return 0


@case("zero_grad_on_submodule", "https://discuss.pytorch.org/t/best-practice-for-freezing-layers/58156",
      "gradients cleared on one submodule (the head) while the optimizer steps the whole model: the "
      "body's gradients are never cleared and add up from step to step")
def zero_grad_on_submodule(buggy, record):
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    record(model, opt)
    for _ in range(STEPS):
        x, y = batch()
        if buggy:
            model[-1].zero_grad()
        else:
            opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        opt.step()
    return 1


def _init(m):
    if isinstance(m, nn.Linear):
        nn.init.xavier_uniform_(m.weight)
        nn.init.zeros_(m.bias)


@case("reinitialised_every_step", "https://github.com/flairNLP/flair/issues/1899",
      "the weight-initialisation call model.apply(init) placed inside the training loop: every step "
      "starts from fresh random weights, nothing learned survives")
def reinitialised_every_step(buggy, record):
    model = mlp()
    model.apply(_init)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    _train(model, opt, record, before=(lambda step: model.apply(_init)) if buggy else None)
    return 0


_W = torch.tensor([1.0, -1.0, 0.5, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0])


def _soft_targets(n=32, buggy=False):
    x = torch.randn(n, 10)
    y = torch.sigmoid(x @ _W).unsqueeze(1)  # a probability per sample
    return x, (y.long().float() if buggy else y)


@case("soft_targets_cast_to_long", "https://openillumi.com/pytorch-float-long-cast-error-fix",
      "soft targets (probabilities) cast to an integer type to satisfy a dtype error, then back to float: "
      "every target truncates to 0 and the model learns to predict 0 whatever the input")
def soft_targets_cast_to_long(buggy, record):
    model = mlp(classes=1)
    _train(model, torch.optim.Adam(model.parameters(), lr=1e-2), record,
           make=lambda: _soft_targets(buggy=buggy), loss_fn=F.binary_cross_entropy_with_logits)
    return 0
