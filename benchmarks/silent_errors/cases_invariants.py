"""More silent training errors, in forms of our own modelled on the kinds of public report each
comment names (no report's code is copied): weights changed outside the optimizer, frozen
tensors that move, gradients reset inside an accumulated step, training flags off where no
Dropout or BatchNorm module exists, and gradients zeroed or clipped away before the step.
Registered into ``cases.CASES`` (imported at the end of cases.py)."""

from __future__ import annotations

import copy

import torch
import torch.nn.functional as F
from cases import case
from harness import STEPS, batch, mlp
from torch import nn

NO_URL = ""  # our own reconstruction of a kind of report, not one report


def _textbook(model, opt, record, each=None, steps=STEPS, make=batch, **options):
    record(model, opt, **options)
    for step in range(steps):
        if each is not None:
            each(step)
        x, y = make()
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        opt.step()


# -- weights swapped for a copy and not swapped back -------------------------------------------
# PyTorch forum, "EMA weights swapped in for evaluation and never restored": the EMA's values are
# copied into the model to validate, and training continues from them.
@case("weights_swapped", NO_URL, "EMA weights copied into the model for validation and never copied back")
def ema_weights_swapped_for_eval_not_restored(buggy, record):
    model = mlp(dropout=0.1)
    ema = copy.deepcopy(model).requires_grad_(False)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)

    def each(step):
        if step and step % 12 == 0:
            backup = [p.detach().clone() for p in model.parameters()]
            with torch.no_grad():
                for p, e in zip(model.parameters(), ema.parameters()):
                    p.copy_(e)
                model.eval()
                model(batch()[0])
                model.train()
                if not buggy:
                    for p, b in zip(model.parameters(), backup):
                        p.copy_(b)
        with torch.no_grad():
            for p, e in zip(model.parameters(), ema.parameters()):
                e.mul_(0.9).add_(p, alpha=0.1)
    _textbook(model, opt, record, each)
    return 12


# Lightning / torchvision reference-script reports, "validation with the averaged (SWA) weights
# loaded by load_state_dict; the training weights were never reloaded".
@case("weights_swapped", NO_URL, "the averaged model's state_dict was loaded into the training model to validate")
def swa_state_loaded_for_validation(buggy, record):
    model = mlp()
    swa = torch.optim.swa_utils.AveragedModel(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)

    def each(step):
        if step >= 4:
            swa.update_parameters(model)
        if step == 16:
            kept = copy.deepcopy(model.state_dict())
            model.load_state_dict(swa.module.state_dict())
            with torch.no_grad():
                model(batch()[0])
            if not buggy:
                model.load_state_dict(kept)
    _textbook(model, opt, record, each)
    return 16


# GitHub issue in a semi-supervised learning codebase, "param.data = ema_param.data swaps the EMA in
# for evaluation; the swap back was missing" (the model then also shares the EMA's storage).
@case("weights_swapped", NO_URL, "evaluation swapped the EMA tensors in with .data = and never swapped back")
def ema_swap_by_data_assignment(buggy, record):
    model = mlp()
    ema = copy.deepcopy(model).requires_grad_(False)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)

    def each(step):
        with torch.no_grad():
            for p, e in zip(model.parameters(), ema.parameters()):
                e.mul_(0.95).add_(p, alpha=0.05)
        if step == 20:
            saved = [p.data for p in model.parameters()]
            for p, e in zip(model.parameters(), ema.parameters()):
                p.data = e.data.clone()
            with torch.no_grad():
                model(batch()[0])
            if not buggy:
                for p, s in zip(model.parameters(), saved):
                    p.data = s
    _textbook(model, opt, record, each)
    return 20


# -- weights edited in place outside the optimizer ---------------------------------------------
class ConvBN(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv, self.bn = nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8)
        self.head = nn.Linear(8, 3)

    def forward(self, x):  # Nx3xHxW -> Nx3
        return self.head(F.relu(self.bn(self.conv(x))).mean((2, 3)))


def fuse_(m: ConvBN) -> None:
    """Fold the BatchNorm into the convolution in place (what an export's fuse() does)."""
    with torch.no_grad():
        bn = m.bn
        scale = bn.weight / torch.sqrt(bn.running_var + bn.eps)
        m.conv.weight.mul_(scale.view(-1, 1, 1, 1))
        m.conv.bias.sub_(bn.running_mean).mul_(scale).add_(bn.bias)
        bn.running_mean.zero_()
        bn.running_var.fill_(1 - bn.eps)
        bn.weight.fill_(1.0)
        bn.bias.zero_()


# YOLOv5-style GitHub issue, "model.fuse() for a speed test during training folded BatchNorm into
# the training model's convolutions".
@case("weights_edited", NO_URL, "an export/speed-test helper fused BatchNorm into the training model in place")
def bn_fused_into_conv_for_validation(buggy, record):
    model = ConvBN()
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)

    def each(step):
        if step == 16:
            fused = model if buggy else copy.deepcopy(model)
            fused.eval()
            fuse_(fused)
            with torch.no_grad():
                fused(torch.randn(2, 3, 8, 8))
            model.train()
    _textbook(model, opt, record, each, make=lambda: _images())
    return 16


def _images():
    x = torch.randn(16, 3, 8, 8)
    return x, x.mean((2, 3)).argmax(1)


# PyTorch forum, "copy.copy(model) shares the parameters: rounding the copy's weights for a
# quantised export changed the model being trained".
@case("weights_edited", NO_URL, "weights of a shallow copy rounded in place for export: the same tensors")
def shallow_copy_rounded_for_export(buggy, record):
    model = mlp()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)

    def each(step):
        if step == 10:
            export = copy.copy(model) if buggy else copy.deepcopy(model)
            with torch.no_grad():
                for p in export.parameters():
                    p.mul_(16).round_().div_(16)
    _textbook(model, opt, record, each)
    return 10


# PyTorch forum, "my evaluation changes the weights": cosine-classifier scores computed by
# normalising the head's weight rows in place.
@case("weights_edited", NO_URL, "evaluation normalised the classifier's weight rows in place")
def head_normalised_in_place_in_eval(buggy, record):
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)

    def each(step):
        if step == 8:
            with torch.no_grad():
                w = model[-1].weight
                w_hat = w.div_(w.norm(dim=1, keepdim=True)) if buggy else F.normalize(w, dim=1)
                (batch()[0] @ model[0].weight.t()).relu() @ w_hat.t()
    _textbook(model, opt, record, each)
    return 8


# -- frozen tensors that move ---------------------------------------------------------------------
def _stack() -> nn.Sequential:
    return nn.Sequential(nn.Linear(10, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 3))


# PyTorch forum, "layers frozen with requires_grad=False part-way through training still change":
# SGD momentum acts on the zero (not None) gradients zero_grad(set_to_none=False) leaves.
@case("frozen_moving", NO_URL, "layers frozen mid-training kept moving under SGD momentum (zero, not None, grads)")
def frozen_midway_momentum_moves(buggy, record):
    model = _stack()
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    record(model, opt)
    for step in range(STEPS):
        if step == 10:
            model[:4].requires_grad_(False)
            if not buggy:
                for p in model[:4].parameters():
                    p.grad = None
        x, y = batch()
        opt.zero_grad(set_to_none=False)
        F.cross_entropy(model(x), y).backward()
        opt.step()
    return 10


# Hugging Face forum, "frozen embeddings still change during fine-tuning": AdamW's decoupled weight
# decay and its moments act on a frozen tensor whose .grad is a zero tensor.
@case("frozen_moving", NO_URL, "embeddings frozen after a warm-up still moved: AdamW decay on zero grads")
def adamw_moves_frozen_embeddings(buggy, record):
    class Bag(nn.Module):
        def __init__(self):
            super().__init__()
            self.embed, self.head = nn.EmbeddingBag(40, 16), nn.Linear(16, 2)

        def forward(self, tokens):
            return self.head(self.embed(tokens))

    model = Bag()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1)
    record(model, opt)
    for step in range(STEPS):
        if step == 6:
            model.embed.requires_grad_(False)
            if not buggy:
                model.embed.weight.grad = None
        tokens = torch.randint(0, 40, (8, 5))
        opt.zero_grad(set_to_none=False)
        F.cross_entropy(model(tokens), tokens[:, 0] % 2).backward()
        opt.step()
    return 6


# PyTorch forum, "frozen parameters change when weight_decay > 0": gradient buffers preallocated for
# every parameter (p.grad = zeros) give the frozen ones a gradient the optimizer acts on.
@case("frozen_moving", NO_URL, "preallocated zero grads on frozen layers: SGD weight decay shrank them")
def preallocated_grads_decay_frozen(buggy, record):
    model = _stack()
    model[0].requires_grad_(False)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, weight_decay=1e-2)
    for p in model.parameters():
        if buggy or p.requires_grad:
            p.grad = torch.zeros_like(p)
    record(model, opt)
    for _ in range(STEPS):
        x, y = batch()
        opt.zero_grad(set_to_none=False)  # the preallocated buffers are kept
        F.cross_entropy(model(x), y).backward()
        opt.step()
    return 0


# -- gradients reset inside an accumulated step -------------------------------------------------------
def _accumulated(buggy: bool, record, reset, k: int = 4) -> int:
    model = mlp(dropout=0.1)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    record(model, opt)
    opt.zero_grad()
    for i in range(STEPS * k):
        x, y = batch(8)
        if buggy:
            reset(model, opt, "before")
        (F.cross_entropy(model(x), y) / k).backward()
        if buggy:
            reset(model, opt, "after")
        if i % k == k - 1:
            opt.step()
            opt.zero_grad()
    return 0


# PyTorch forum, "gradient accumulation gives the same result as no accumulation":
# optimizer.zero_grad() inside the micro-batch loop.
@case("accumulation_reset", NO_URL, "zero_grad() before every micro-batch: only the last one reaches the step")
def zero_grad_every_microbatch(buggy, record):
    return _accumulated(buggy, record, lambda m, o, when: o.zero_grad() if when == "before" else None)


# A trainer's GitHub issue, "a per-batch callback called model.zero_grad() while the optimizer
# stepped every accumulate_grad_batches batches".
@case("accumulation_reset", NO_URL, "a per-batch callback's model.zero_grad() reset the accumulated gradients")
def callback_zero_grad_per_batch(buggy, record):
    return _accumulated(buggy, record, lambda m, o, when: m.zero_grad() if when == "before" else None, k=2)


# PyTorch forum, "zero_grad right after loss.backward() in an accumulation loop".
@case("accumulation_reset", NO_URL, "zero_grad() right after every micro-batch's backward")
def zero_grad_after_each_backward(buggy, record):
    return _accumulated(buggy, record, lambda m, o, when: o.zero_grad() if when == "after" else None, k=3)


# -- training flags off where no Dropout or BatchNorm module exists -------------------------------------
class FunctionalDropoutNet(nn.Module):
    """Dropout as a function of the module's training flag (no nn.Dropout instance)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(10, 64), nn.Linear(64, 3)

    def forward(self, x):
        return self.fc2(F.dropout(F.relu(self.fc1(x)), 0.3, training=self.training))


def _eval_left_on(buggy: bool, record, model: nn.Module, at: int, make=batch) -> int:
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    record(model, opt)
    model.train()
    for step in range(STEPS):
        if step == at:
            model.eval()
            with torch.no_grad():
                model(make()[0])
            if not buggy:
                model.train()
        x, y = make()
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        opt.step()
    return at


# PyTorch forum, "F.dropout(..., training=self.training): after validation the model stays in eval".
@case("eval_mode_functional", NO_URL, "functional dropout off after validation left model.eval() on")
def functional_dropout_left_in_eval(buggy, record):
    return _eval_left_on(buggy, record, FunctionalDropoutNet(), 10)


class DropPath(nn.Module):
    """Stochastic depth (Huang et al. 2016): drop a residual branch per example in training."""

    def __init__(self, p: float) -> None:
        super().__init__()
        self.p = p

    def forward(self, x):
        if not self.training or self.p == 0:
            return x
        keep = (torch.rand(x.shape[0], 1) > self.p).to(x.dtype) / (1 - self.p)
        return x * keep


class ResidualMLP(nn.Module):
    def __init__(self, depth: int = 3) -> None:
        super().__init__()
        self.inp = nn.Linear(10, 32)
        self.blocks = nn.ModuleList(nn.Sequential(nn.LayerNorm(32), nn.Linear(32, 32), nn.GELU()) for _ in range(depth))
        self.drops = nn.ModuleList(DropPath(0.2) for _ in range(depth))
        self.out = nn.Linear(32, 3)

    def forward(self, x):
        h = self.inp(x)
        for block, drop in zip(self.blocks, self.drops):
            h = h + drop(block(h))
        return self.out(h)


# timm discussion, "stochastic depth never active: a checkpoint-loading helper called model.eval()
# and the training loop never called model.train()".
@case("eval_mode_functional", NO_URL, "a loading helper's eval() left stochastic depth off for all of training")
def drop_path_off_after_loading_helper(buggy, record):
    model = ResidualMLP()
    model.eval()  # the helper
    if not buggy:
        model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    _textbook(model, opt, record)
    return 0


class TinyAttention(nn.Module):
    """Self-attention with attention dropout passed to scaled_dot_product_attention."""

    def __init__(self, dim: int = 16, heads: int = 2, p: float = 0.2) -> None:
        super().__init__()
        self.qkv, self.proj, self.heads, self.p = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim), heads, p
        self.head = nn.Linear(dim, 3)

    def forward(self, x):  # NxTxD -> Nx3
        n, t, d = x.shape
        q, k, v = self.qkv(x).view(n, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        h = F.scaled_dot_product_attention(q, k, v, dropout_p=self.p if self.training else 0.0)
        return self.head(self.proj(h.transpose(1, 2).reshape(n, t, d)).mean(1))


# Hugging Face forum, "after sampling inside the training loop model.eval() stays on: attention
# dropout (dropout_p=... if self.training else 0.0) is off for the rest of training".
@case("eval_mode_functional", NO_URL, "sampling mid-training left eval() on: attention dropout off afterwards")
def attention_dropout_off_after_sampling(buggy, record):
    def make():
        x = torch.randn(8, 5, 16)
        return x, x[:, 0, :3].argmax(1)
    return _eval_left_on(buggy, record, TinyAttention(), 14, make)


# -- gradients zeroed or clipped away between backward and the step --------------------------------------
# PyTorch forum, "loss does not decrease": optimizer.zero_grad() between loss.backward() and step().
@case("zero_grad_misplaced", NO_URL, "zero_grad() between backward() and step(): every step uses no gradient")
def zero_grad_between_backward_and_step(buggy, record):
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    record(model, opt)
    for _ in range(STEPS):
        x, y = batch()
        if not buggy:
            opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        if buggy:
            opt.zero_grad()
        opt.step()
    return 0


# GitHub issue, "max_grad_norm read as 0 from the config: clip_grad_norm_(params, 0) scales every
# gradient to zero and nothing trains".
@case("zero_grad_misplaced", NO_URL, "clip_grad_norm_ with max_norm 0 (a config default) zeroed every gradient")
def clip_max_norm_zero(buggy, record):
    model = mlp()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    record(model, opt)
    max_norm = 0.0 if buggy else 1.0
    for _ in range(STEPS):
        x, y = batch()
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
        opt.step()
    return 0
