"""A second held-out set of silent training errors, written blind: each case is our own toy
reconstruction (CPU, well under a second) of a public bug report or widely reported pitfall, in
its buggy and its fixed form, written without reading how the recorder works and without running
it on any case here. ``CASES[name]`` is a ``cases.Case``; ``CAUSES`` maps each cause to the finding
kind that would name it (the kinds table of docs/record.md), decided before anything ran, or to
None where no existing kind names it (such a case counts as cause not named whatever is found).
Every mechanism differs from those of cases.py, cases_invariants.py and cases_heldout.py.

Scored with ``score.py --set heldout2``; this registry is separate from the other sets'."""

from __future__ import annotations

import copy
from typing import Optional

import torch
import torch.nn.functional as F
from cases import Case
from harness import STEPS, batch, mlp
from torch import nn

# The cause a report established -> the finding kind that names it (None: no existing kind can).
CAUSES: dict[str, Optional[str]] = {
    "scheduler_stale_optimizer": None,  # the scheduler drives an optimizer the loop no longer uses
    "resumed_lr_zero": "lr_zero",  # an optimizer state loaded from the end of a schedule: lr 0
    "shared_by_repetition": None,  # [block] * n: one block's weights used n times, not n blocks
    "freeze_through_tie": None,  # unfreezing a tied head also trains the embedding meant frozen
    "round_no_straight_through": "zero_gradient",  # torch.round's derivative is 0: nothing below learns
    "bf16_update_rounded": "not_updated",  # bf16 weights without an fp32 copy: small updates round away
    "scaler_bypassed": None,  # optimizer.step() on gradients still multiplied by the loss scale
    "accumulation_not_averaged": None,  # micro-batch losses summed, not averaged: k times the step
    "bn_stats_from_validation": None,  # validation in train mode: BatchNorm statistics absorb it
    "sync_sum_not_mean": None,  # replicas' gradients summed, not averaged: world-size times the step
    "replicas_unsynced_init": None,  # replicas never given the same initial weights: they stay apart
    "freeze_attribute_noop": None,  # module.requires_grad = False sets an attribute, freezes nothing
    "aux_loss_constant": "no_gradient",  # the auxiliary loss replaced by a constant 0: its head gets nothing
    "mask_inverted": None,  # a keep-mask passed where PyTorch expects an ignore-mask
    "ema_direction_swapped": None,  # the momentum update writes the student's buffers, not the teacher's
    "clip_result_discarded": None,  # grad.clamp(...) out of place: the clipped tensor is thrown away
    "log_softmax_underflow": "nonfinite_gradient",  # log(softmax(x)): a probability that underflows to 0
    "eval_to_freeze_bn": "eval_mode",  # model.eval() for the whole fine-tuning: dropout is off too
}

CASES: dict[str, Case] = {}


def case(cause: str, url: str, report: str):
    assert cause in CAUSES, cause

    def register(fn):
        CASES[fn.__name__] = Case(fn, cause, url, report)
        return fn
    return register


def _train(model, opt, record, make=batch, loss_fn=F.cross_entropy, steps=STEPS, each=None, **options):
    record(model, opt, **options)
    for step in range(steps):
        x, y = make()
        opt.zero_grad()
        loss_fn(model(x), y).backward()
        opt.step()
        if each is not None:
            each(step)


# -- optimizer and scheduler ------------------------------------------------------------------
@case("scheduler_stale_optimizer", "https://github.com/ildoonet/pytorch-gradual-warmup-lr/issues/27",
      "after a resume the scheduler still held the optimizer it was built with: the lr in use stayed static")
def scheduler_left_on_replaced_optimizer(buggy, record):
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=16, gamma=0.1)
    saved = opt.state_dict()  # the checkpoint
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)  # the resume path builds a new optimizer
    opt.load_state_dict(saved)
    if not buggy:  # the fix: the scheduler is built on (or re-pointed at) the optimizer in use
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=16, gamma=0.1)
    _train(model, opt, record, each=lambda step: sched.step())
    return 16  # the first step whose lr should have been decayed


@case("resumed_lr_zero", "https://github.com/facebookresearch/ParlAI/issues/3116",
      "loading the optimizer's state dict ignored the learning rate asked for and restored the saved one")
def finetune_loads_finished_schedule_state(buggy, record):
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    sched = torch.optim.lr_scheduler.LinearLR(opt, start_factor=1.0, end_factor=0.0, total_iters=10)
    for _ in range(10):  # pre-training, decayed linearly to 0 (not recorded)
        x, y = batch()
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        opt.step()
        sched.step()
    saved = opt.state_dict()
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)  # fine-tuning asks for lr 0.05
    opt.load_state_dict(saved)  # ... and gets the finished schedule's lr back
    if not buggy:
        for group in opt.param_groups:
            group["lr"] = 0.05
    _train(model, opt, record)
    return 0


# -- registration and sharing -----------------------------------------------------------------
class _Residual(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.fc = nn.Linear(dim, dim)

    def forward(self, h):
        return h + self.fc(F.relu(h))


class _ResidualStack(nn.Module):
    def __init__(self, repeated: bool, depth: int = 3, dim: int = 32) -> None:
        super().__init__()
        self.inp, self.out = nn.Linear(10, dim), nn.Linear(dim, 3)
        if repeated:  # list multiplication: one block object listed depth times
            self.blocks = nn.ModuleList([_Residual(dim)] * depth)
        else:
            self.blocks = nn.ModuleList([_Residual(dim) for _ in range(depth)])

    def forward(self, x):
        h = self.inp(x)
        for block in self.blocks:
            h = block(h)
        return self.out(h)


@case("shared_by_repetition", "https://github.com/zalandoresearch/pytorch-vq-vae/issues/2",
      "nn.ModuleList([Residual(...)] * n) duplicates a reference to one block: the layers share weights")
def residual_blocks_by_list_multiplication(buggy, record):
    model = _ResidualStack(repeated=buggy)
    _train(model, torch.optim.Adam(model.parameters(), lr=1e-3), record)
    return 0


class _TiedLM(nn.Module):
    def __init__(self, vocab: int = 30, dim: int = 16) -> None:
        super().__init__()
        self.embed, self.mix = nn.Embedding(vocab, dim), nn.Linear(dim, dim)
        self.head = nn.Linear(dim, vocab, bias=False)
        self.head.weight = self.embed.weight  # tied input and output embeddings

    def forward(self, tokens):  # NxT -> NxTxvocab
        return self.head(torch.tanh(self.mix(self.embed(tokens))))


def _next_tokens(vocab: int = 30):
    t = torch.randint(0, vocab, (8, 7))
    return t[:, :-1], t[:, 1:]


def _lm_loss(logits, y):
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))


@case("freeze_through_tie", "https://github.com/huggingface/transformers/issues/11903",
      "freezing all of GPT-2 but the LM head: the head is tied to the input embeddings, which then train too")
def lm_head_only_finetune_with_tied_embedding(buggy, record):
    model = _TiedLM()
    if not buggy:  # the fix: untie first, so the head has weights of its own
        model.head.weight = nn.Parameter(model.embed.weight.detach().clone())
    model.requires_grad_(False)
    model.head.weight.requires_grad_(True)  # "train the LM head only"
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.5)
    _train(model, opt, record, make=_next_tokens, loss_fn=_lm_loss)
    return 0


# -- gradient flow ----------------------------------------------------------------------------
class _QuantisedCode(nn.Module):
    """An encoder whose code is rounded to a grid of 1/4 before the decoder (a compression model)."""

    def __init__(self, straight_through: bool) -> None:
        super().__init__()
        self.enc, self.dec = nn.Linear(10, 16), nn.Sequential(nn.ReLU(), nn.Linear(16, 3))
        self.straight_through = straight_through

    def forward(self, x):
        h = 4 * torch.tanh(self.enc(x))
        q = torch.round(h)
        if self.straight_through:  # identity gradient through the rounding
            q = h + (q - h).detach()
        return self.dec(q / 4)


@case("round_no_straight_through", "https://github.com/Justin-Tan/generative-compression/issues/27",
      "the quantiser's round() passes no gradient: the encoder below it is never updated")
def rounding_quantiser_without_ste(buggy, record):
    model = _QuantisedCode(straight_through=not buggy)
    _train(model, torch.optim.SGD(model.parameters(), lr=0.1), record)
    return 0


# -- precision and loss scaling ---------------------------------------------------------------
@case("bf16_update_rounded", "https://github.com/vllm-project/speculators/pull/765",
      "fully bf16 training: norm weights that start at 1.0 never move, the update is below bf16's step at 1.0")
def bf16_weights_without_fp32_master(buggy, record):
    model = nn.Sequential(nn.Linear(10, 32), nn.LayerNorm(32), nn.ReLU(), nn.Linear(32, 3))
    if buggy:  # weights stored and updated in bf16
        model = model.to(torch.bfloat16)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    record(model, opt)
    for _ in range(STEPS):
        x, y = batch()
        opt.zero_grad()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=not buggy):  # the fix: fp32 weights, bf16 compute
            out = model(x.to(model[0].weight.dtype))
        F.cross_entropy(out.float(), y).backward()
        opt.step()
    return 0


@case("scaler_bypassed", "https://github.com/nerfstudio-project/nerfacc/issues/307",
      "the example scales the loss with GradScaler but steps the optimizer directly: gradients stay multiplied")
def scaled_loss_stepped_without_scaler(buggy, record):
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    record(model, opt, scaler=scaler)
    for _ in range(STEPS):
        x, y = batch()
        opt.zero_grad()
        scaler.scale(F.cross_entropy(model(x), y)).backward()
        if buggy:
            opt.step()
        else:
            scaler.step(opt)
            scaler.update()
    return 0


# -- accumulation -----------------------------------------------------------------------------
@case("accumulation_not_averaged", "https://github.com/facebookresearch/ParlAI/pull/1833",
      "accumulated micro-batch gradients were summed: the update grows with the number of micro-batches")
def accumulated_losses_not_divided(buggy, record):
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    record(model, opt)
    k = 4
    for _ in range(STEPS):
        opt.zero_grad()
        for _ in range(k):
            x, y = batch(8)
            loss = F.cross_entropy(model(x), y)
            (loss if buggy else loss / k).backward()
        opt.step()
    return 0


# -- train and eval modes ---------------------------------------------------------------------
@case("bn_stats_from_validation", "https://github.com/princeton-vl/pytorch_stacked_hourglass/issues/44",
      "model.train() in both the training and the validation phase: BatchNorm running stats take in validation data")
def validation_pass_in_train_mode(buggy, record):
    model = mlp(bn=True)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    record(model, opt)
    validate_at = 16
    for step in range(STEPS):
        x, y = batch()
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        opt.step()
        if step == validate_at:
            if not buggy:
                model.eval()
            with torch.no_grad():
                for _ in range(5):  # a validation set that differs from the training data
                    model(3.0 * torch.randn(32, 10) + 2.0)
            model.train()
    return validate_at + 1


@case("eval_to_freeze_bn", "https://github.com/isht7/pytorch-deeplab-resnet/issues/39",
      "model.eval() during training to keep BatchNorm statistics fixed: it switches every dropout layer off as well")
def finetune_in_eval_mode_for_batchnorm(buggy, record):
    model = nn.Sequential(nn.Linear(10, 32), nn.BatchNorm1d(32), nn.ReLU(), nn.Dropout(0.3), nn.Linear(32, 3))
    model[1].requires_grad_(False)  # the pretrained BatchNorm stays as it is
    opt = torch.optim.Adam([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    if buggy:
        model.eval()
    else:  # the fix: train mode, BatchNorm alone in eval
        model.train()
        model[1].eval()
    _train(model, opt, record)
    return 0


# -- replicas (data parallelism without processes) --------------------------------------------
def _replicated_steps(workers, opts, record, reduce) -> None:
    """Each replica takes half the batch; ``reduce`` turns their gradients into the one each steps with.
    Every replica is recorded, as each process of a data-parallel run records its own."""
    for w, opt in zip(workers, opts):
        record(w, opt)
    for _ in range(STEPS):
        x, y = batch(64)
        for w, opt, xs, ys in zip(workers, opts, x.chunk(len(workers)), y.chunk(len(workers))):
            opt.zero_grad()
            F.cross_entropy(w(xs), ys).backward()
        with torch.no_grad():  # the all-reduce
            for params in zip(*(w.parameters() for w in workers)):
                g = reduce(torch.stack([p.grad for p in params]))
                for p in params:
                    p.grad.copy_(g)
        for opt in opts:
            opt.step()


@case("sync_sum_not_mean", "https://github.com/TianhongDai/hindsight-experience-replay/issues/4",
      "sync_grads sums the workers' gradients instead of averaging them: the step grows with the number of processes")
def replica_gradients_summed(buggy, record):
    workers = [mlp(), mlp()]
    workers[1].load_state_dict(workers[0].state_dict())
    opts = [torch.optim.SGD(w.parameters(), lr=0.05) for w in workers]
    _replicated_steps(workers, opts, record, (lambda g: g.sum(0)) if buggy else (lambda g: g.mean(0)))
    return 0


@case("replicas_unsynced_init", "https://github.com/horovod/horovod/issues/672",
      "gradients were averaged but the replicas' random initial weights were never broadcast: their parameters differ")
def replicas_initial_weights_not_broadcast(buggy, record):
    workers = [mlp(), mlp()]  # two processes initialise independently
    if not buggy:  # the fix: broadcast rank 0's weights before training
        workers[1].load_state_dict(workers[0].state_dict())
    opts = [torch.optim.SGD(w.parameters(), lr=0.05, momentum=0.9) for w in workers]
    _replicated_steps(workers, opts, record, lambda g: g.mean(0))
    return 0


# -- freezing ---------------------------------------------------------------------------------
class _SourceModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.features = nn.Sequential(nn.Linear(10, 32), nn.ReLU(), nn.Linear(32, 16), nn.ReLU())
        self.outc = nn.Linear(16, 3)

    def forward(self, x):
        return self.outc(self.features(x))


def _entropy(logits, _):  # source-free adaptation: no labels, the predictions' entropy is minimised
    p = F.softmax(logits, 1)
    return -(p * F.log_softmax(logits, 1)).sum(1).mean()


@case("freeze_attribute_noop", "https://github.com/CSCYQJ/MICCAI23-ProtoContra-SFDA/issues/18",
      "self.model.outc.requires_grad = False on an nn.Module does not freeze its parameters: the last layer trains")
def classifier_frozen_by_module_attribute(buggy, record):
    model = _SourceModel()
    if buggy:
        model.outc.requires_grad = False  # a new attribute of the module; its parameters still require grad
    else:
        model.outc.requires_grad_(False)
    opt = torch.optim.Adam([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    _train(model, opt, record, loss_fn=_entropy)
    return 0


# -- the loss side ----------------------------------------------------------------------------
class _AuxNet(nn.Module):
    """A main head on the last features and an auxiliary head on intermediate ones (PSPNet's shape)."""

    def __init__(self) -> None:
        super().__init__()
        self.stage1 = nn.Sequential(nn.Linear(10, 32), nn.ReLU())
        self.stage2 = nn.Sequential(nn.Linear(32, 32), nn.ReLU())
        self.head, self.aux = nn.Linear(32, 3), nn.Linear(32, 3)

    def forward(self, x):
        h1 = self.stage1(x)
        return self.head(self.stage2(h1)), self.aux(h1)


@case("aux_loss_constant", "https://github.com/mseg-dataset/mseg-semantic/issues/16",
      "the auxiliary loss is always 0: it is set to zero in the model, so the auxiliary head never trains")
def auxiliary_loss_returned_as_zero(buggy, record):
    model = _AuxNet()
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)

    def loss_fn(outputs, y):
        main, aux = outputs
        aux_loss = torch.zeros(()) if buggy else F.cross_entropy(aux, y)  # the model's placeholder
        return F.cross_entropy(main, y) + 0.4 * aux_loss

    _train(model, opt, record, loss_fn=loss_fn)
    return 0


class _PooledAttention(nn.Module):
    """Token embeddings, one self-attention layer, mean over the real tokens, a linear classifier."""

    def __init__(self, vocab: int = 12, dim: int = 16) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.attn = nn.MultiheadAttention(dim, 2, batch_first=True)
        self.out = nn.Linear(dim, 2)

    def forward(self, tokens, key_padding_mask):  # NxT, NxT (True: ignore that key)
        e = self.embed(tokens)
        h, _ = self.attn(e, e, e, key_padding_mask=key_padding_mask)
        real = (tokens != 0).unsqueeze(-1).float()
        return self.out((h * real).sum(1) / real.sum(1))


def _padded_tokens(n: int = 32, length: int = 8):
    t = torch.randint(1, 12, (n, length))
    lengths = torch.randint(3, 7, (n,))  # every sequence has 2 to 5 padding tokens (id 0) at its end
    t[torch.arange(length)[None, :] >= lengths[:, None]] = 0
    return t, (t == 1).any(1).long()  # the label needs the real tokens


@case("mask_inverted", "https://github.com/facebookresearch/detr/issues/96",
      "key_padding_mask True means 'ignore this key': a mask that is True on the real tokens masks them and "
      "the network does not train")
def attention_mask_passed_as_padding_mask(buggy, record):
    model = _PooledAttention()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    record(model, opt)
    for _ in range(STEPS):
        tokens, y = _padded_tokens()
        keep = tokens != 0  # the "attention mask" convention: True where to attend
        opt.zero_grad()
        F.cross_entropy(model(tokens, keep if buggy else ~keep), y).backward()
        opt.step()
    return 0


@case("log_softmax_underflow", "https://github.com/pytorch/pytorch/issues/1620",
      "torch.log(softmax(x)) differs from log_softmax(x): a probability that underflows gives a NaN gradient")
def log_of_softmax_with_outlier(buggy, record):
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    record(model, opt)
    outlier_at = 13
    for step in range(STEPS):
        x, y = batch()
        if step == outlier_at:  # one mislabelled outlier in the batch
            x[0] *= 300.0
            with torch.no_grad():
                y[0] = model(x[:1]).argmin(1)[0]
        opt.zero_grad()
        out = model(x)
        loss = F.nll_loss(torch.log(F.softmax(out, 1)), y) if buggy else F.cross_entropy(out, y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
    return outlier_at


# -- edits outside the optimizer --------------------------------------------------------------
@case("ema_direction_swapped", "https://github.com/saltoricristiano/cosmix-uda/issues/21",
      "the momentum update of the buffers writes into the online network from the momentum one, not the reverse")
def ema_buffer_update_into_student(buggy, record):
    student = mlp(bn=True)
    teacher = copy.deepcopy(student).requires_grad_(False)
    opt = torch.optim.SGD(student.parameters(), lr=0.05, momentum=0.9)
    tau = 0.99

    def momentum_update(_step):
        with torch.no_grad():
            for t, s in zip(teacher.parameters(), student.parameters()):
                t.mul_(tau).add_(s, alpha=1 - tau)
            for t, s in zip(teacher.buffers(), student.buffers()):
                if not t.is_floating_point():
                    continue
                if buggy:  # online <- momentum: the student's statistics pulled back, the teacher's never updated
                    s.mul_(tau).add_(t, alpha=1 - tau)
                else:
                    t.mul_(tau).add_(s, alpha=1 - tau)

    _train(student, opt, record, each=momentum_update)
    return 1  # the first edit lands between step 0 and step 1


@case("clip_result_discarded", "https://github.com/pytorch/tutorials/pull/30",
      "param.grad.data.clamp(-1, 1) is out of place and its result unused: the gradients are never clipped")
def grad_clamp_not_in_place(buggy, record):
    model = mlp(10, 32, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    record(model, opt)
    w = torch.randn(10)
    for step in range(STEPS):
        x = torch.randn(32, 10)
        target = x @ w + (25.0 * torch.randn(32) if step % 6 == 2 else 0.0)  # now and then outlier targets
        opt.zero_grad()
        F.smooth_l1_loss(model(x).squeeze(1), target).backward()
        for p in model.parameters():
            if buggy:
                p.grad.data.clamp(-0.1, 0.1)
            else:
                p.grad.data.clamp_(-0.1, 0.1)
        opt.step()
    return 0
