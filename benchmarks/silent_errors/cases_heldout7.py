"""A seventh held-out set of silent training errors, written blind: each case is our own toy
reconstruction (CPU, well under a second) of a public report, in its buggy and its fixed form,
written without reading how the recorder works and without running it on any case here.
``CASES[name]`` is a ``cases.Case``; ``CAUSES`` maps each cause to the finding kind that would name
it (the kinds table of docs/record.md), decided before anything ran and not changed since, or to
None where no existing kind names it (such a case counts as cause not named whatever is found).
Every mechanism differs from those of cases.py, cases_invariants.py and cases_heldout*.py.

Scored with ``score.py --set heldout7``; this registry is separate from the other sets'."""

from __future__ import annotations

import copy
import math
from bisect import bisect_right
from typing import Optional

import torch
import torch.nn.functional as F
from cases import Case
from harness import STEPS, batch, mlp
from torch import nn
from torch.nn.utils.rnn import pack_padded_sequence
from torch.utils.checkpoint import checkpoint

# The cause a report established -> the finding kind that names it (None: no existing kind can).
CAUSES: dict[str, Optional[str]] = {
    "reentrant_checkpoint_frozen_input": "no_gradient",  # reentrant checkpoint, no input needs grad
    "shared_teacher_eval_switches_student": "eval_mode",  # teacher is the student: its eval() stops dropout
    "fully_masked_attention_row": "nonfinite_gradient",  # a query row with every key masked: softmax 0/0, NaN gradients
    "loss_parameters_not_in_optimizer": "not_in_optimizer",  # the loss module's learnable weights left out
    "optimizer_instance_bound_to_other_network": "stale_optimizer_param",  # made before fit() builds the net
    "weights_quantized_in_place": "changed_between_steps",  # QAT rounding the weights themselves after every step
    "unclamped_cosine_at_one": "nonfinite_gradient",  # sqrt(1 - cos^2) of an unclamped cosine of identical embeddings
    "accumulation_mean_per_microbatch": None,  # per-micro-batch token means averaged: short micro-batches over-weighted
    "paired_augmentation_unsynced": None,  # image and mask flipped by independent random draws: targets misaligned
    "terminal_transition_bootstrapped": None,  # TD target without (1 - done)
    "init_after_checkpoint_load": None,  # weights initialised after load_state_dict: the checkpoint is overwritten
    "custom_backward_ignores_grad_output": None,  # a custom Function's backward returns ones, not grad_output
    "pruning_mask_applied_once": None,  # weights zeroed once before fine-tuning: the pruned weights grow back
    "length_sort_not_undone": None,  # batch sorted by length for packing, outputs never unsorted: labels misaligned
    "ema_decay_overwritten": None,  # the warm-up decay written over self.decay
    "gradients_unscaled_twice": None,  # prepare_grads() called by the loop and again inside step(): grads / scale^2
    "warmup_on_chainable_lr": None,  # warm-up factor on the current lr: lr compounds to ~0
    "discriminator_step_includes_generator_loss": None,  # D stepped with the G loss's gradient still in its .grad
}

CASES: dict[str, Case] = {}

# Objects and numbers the loops make besides the recorded model (an EMA, a gradient, ...), kept for check_heldout7.py.
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


# -- freezing, checkpointing, teachers -------------------------------------------------------------
_VOCAB = 20


def token_batch(n=32, length=4):
    x = torch.randint(0, _VOCAB, (n, length))
    return x, x[:, 0] % 3


class CheckpointedEncoder(nn.Module):
    """A frozen (pretrained) token embedding, two residual blocks run under activation checkpointing
    (as gradient_checkpointing_enable() does), and a trainable head."""

    def __init__(self, reentrant: bool) -> None:
        super().__init__()
        self.reentrant = reentrant
        self.emb = nn.Embedding(_VOCAB, 16)
        self.emb.requires_grad_(False)
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(16, 16), nn.Tanh()) for _ in range(2))
        self.head = nn.Linear(16, 3)

    def forward(self, tokens):
        h = self.emb(tokens)
        for block in self.blocks:
            h = h + checkpoint(block, h, use_reentrant=self.reentrant)
        return self.head(h[:, 0])


@case("reentrant_checkpoint_frozen_input", "https://github.com/huggingface/transformers/issues/21381",
      "with the embeddings frozen and gradient checkpointing on, the reentrant checkpoint sees no input that "
      "requires grad: its output does not require grad and the checkpointed blocks get no gradient (the fix: "
      "use_reentrant=False)")
def reentrant_checkpoint_on_frozen_embeddings(buggy, record):
    model = CheckpointedEncoder(reentrant=buggy)
    _train(model, torch.optim.Adam(model.parameters(), lr=1e-2), record, make=token_batch)
    return 0


def distillation_loss(student_logits, teacher_logits, y, temperature=2.0):
    kl = F.kl_div(F.log_softmax(student_logits / temperature, 1), F.softmax(teacher_logits / temperature, 1),
                  reduction="batchmean")
    return F.cross_entropy(student_logits, y) + temperature ** 2 * kl


@case("shared_teacher_eval_switches_student", "https://github.com/huggingface/trl/pull/5862",
      "self-distillation whose teacher is the student model itself (PEFT 'live' teacher): teacher.eval() before "
      "the teacher pass also puts the student in eval mode, and model.train() is only called before it, so the "
      "student's forward pass runs without dropout on every step")
def self_distillation_teacher_eval(buggy, record):
    model = mlp(hidden=64, dropout=0.5)
    teacher = model  # the 'live' teacher: the same module object
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    record(model, opt)
    for _ in range(STEPS):
        model.train()  # Trainer.training_step
        x, y = batch()
        teacher.eval()
        with torch.no_grad():
            t_logits = teacher(x)  # the teacher sees the clean input (its privileged context)
        if not buggy:
            model.train()  # the fix: restore the student's mode after the teacher pass
        s_logits = model(x + 0.5 * torch.randn_like(x))
        opt.zero_grad()
        distillation_loss(s_logits, t_logits, y).backward()
        opt.step()
    return 0


# -- attention and metric losses --------------------------------------------------------------------
_ATT_VOCAB, _ATT_LEN = 8, 6


def padded_tokens(n=16):
    """Sequences of 2 to 3 real tokens padded to 6 (id 0); each position's label is the sum of its token and
    the previous one, mod 3."""
    x = torch.randint(1, _ATT_VOCAB, (n, _ATT_LEN))
    lengths = torch.randint(2, _ATT_LEN - 2, (n,))
    pad = torch.arange(_ATT_LEN)[None] >= lengths[:, None]
    y = (x + torch.cat([torch.zeros(n, 1, dtype=torch.long), x[:, :-1]], 1)) % 3
    return x.masked_fill(pad, 0), y, pad


class WindowAttention(nn.Module):
    """Local (bucketed) self-attention: each position sees itself and the previous position; padded keys masked."""

    def __init__(self, need_weights: bool) -> None:
        super().__init__()
        self.need_weights = need_weights
        self.emb, self.pos = nn.Embedding(_ATT_VOCAB, 16), nn.Parameter(0.1 * torch.randn(_ATT_LEN, 16))
        self.attn = nn.MultiheadAttention(16, 2, batch_first=True)
        self.head = nn.Linear(16, 3)

    def forward(self, x, pad):
        i = torch.arange(x.shape[1])
        window = ~((i[None] <= i[:, None]) & (i[None] >= i[:, None] - 1))  # True: not allowed
        h = self.emb(x) + self.pos[: x.shape[1]]
        out, _ = self.attn(h, h, h, key_padding_mask=pad, attn_mask=window, need_weights=self.need_weights)
        return self.head(out)


@case("fully_masked_attention_row", "https://github.com/pytorch/pytorch/issues/41508",
      "nn.MultiheadAttention with attn_mask and key_padding_mask (bucketed attention over padded sequences): a "
      "padded query whose every key is masked gets softmax over all -inf, NaN; the padded outputs are left out of "
      "the loss, but the NaN reaches every gradient through the shared projections")
def local_attention_fully_masked_rows(buggy, record):
    model = WindowAttention(need_weights=buggy)  # need_weights=True is the default; False takes the safe softmax path
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    record(model, opt)
    for _ in range(STEPS):
        x, y, pad = padded_tokens()
        opt.zero_grad()
        logits = model(x, pad)
        F.cross_entropy(logits[~pad], y[~pad]).backward()  # padded positions are not scored
        opt.step()
    return 0


def two_views(n=32):
    """A batch and a second view of it: half the samples augmented with a little noise, half left identical."""
    x, y = batch(n)
    augmented = torch.rand(n) < 0.5
    return x, torch.where(augmented[:, None], x + 0.1 * torch.randn_like(x), x), y


class EmbedClassifier(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(10, 32), nn.ReLU(), nn.Linear(32, 16))
        self.head = nn.Linear(16, 3)

    def forward(self, x):
        return self.head(self.body(x))


def margin_cosine(z1, z2, buggy, m=0.5):
    """cos(theta + m) of the angle between two embeddings, computed as ArcMarginProduct does: from the cosine and
    sine = sqrt(1 - cosine^2). The fix of the report clamps the cosine to [-1 + eps, 1 - eps] first."""
    cosine = F.cosine_similarity(z1, z2)
    if not buggy:
        cosine = cosine.clamp(-1 + 1e-7, 1 - 1e-7)
    sine = torch.sqrt(1.0 - torch.pow(cosine, 2))
    return cosine * math.cos(m) - sine * math.sin(m)


@case("unclamped_cosine_at_one", "https://github.com/ronghuaiyang/arcface-pytorch/issues/68",
      "an additive angular margin computes sine = sqrt(1 - cosine^2) from an unclamped cosine: where the cosine is "
      "1 (here: the two views of a sample are identical) the derivative is infinite, where rounding puts it above 1 "
      "the value is NaN, and the model's gradients are NaN; the fix clamps the cosine to [-1 + eps, 1 - eps]")
def arc_margin_identical_views(buggy, record):
    model = EmbedClassifier()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    record(model, opt)
    for _ in range(STEPS):
        x1, x2, y = two_views()
        opt.zero_grad()
        z1, z2 = model.body(x1), model.body(x2)
        (F.cross_entropy(model.head(z1), y) + 0.1 * (1 - margin_cosine(z1, z2, buggy)).mean()).backward()
        opt.step()
    return 0


# -- optimizers and their parameters ------------------------------------------------------------------
class TwoTaskNet(nn.Module):
    """A shared trunk with a box-regression head and an identity-classification head (FairMOT's two tasks)."""

    def __init__(self) -> None:
        super().__init__()
        self.trunk = nn.Sequential(nn.Linear(10, 32), nn.ReLU())
        self.det, self.ident = nn.Linear(32, 2), nn.Linear(32, 3)

    def forward(self, x):
        h = self.trunk(x)
        return self.det(h), self.ident(h)


class UncertaintyLoss(nn.Module):
    """Kendall et al.'s task weighting with learnable log-variances s_det and s_id (FairMOT's MotLoss)."""

    def __init__(self) -> None:
        super().__init__()
        self.s_det, self.s_id = nn.Parameter(-1.85 * torch.ones(1)), nn.Parameter(-1.05 * torch.ones(1))

    def forward(self, det, ident, det_target, y):
        l_det, l_id = F.mse_loss(det, det_target), F.cross_entropy(ident, y)
        return 0.5 * (torch.exp(-self.s_det) * l_det + torch.exp(-self.s_id) * l_id + self.s_det + self.s_id).sum()


class ModelWithLoss(nn.Module):
    def __init__(self, model, loss) -> None:
        super().__init__()
        self.model, self.loss = model, loss

    def forward(self, x, det_target, y):
        return self.loss(*self.model(x), det_target, y)


def two_task_batch(n=32):
    x, y = batch(n)
    return x, x[:, 3:5] * 2.0, y


@case("loss_parameters_not_in_optimizer", "https://github.com/ifzhang/FairMOT/issues/19",
      "the uncertainty weights s_det and s_id are nn.Parameters of the loss module (held by ModleWithLoss), but the "
      "optimizer is built from model.parameters() only: they get gradients and never change (fixed by adding them "
      "to the optimizer)")
def uncertainty_weights_left_out(buggy, record):
    net, loss = TwoTaskNet(), UncertaintyLoss()
    wrapped = ModelWithLoss(net, loss)
    groups = [{"params": net.parameters()}] + ([] if buggy else [{"params": loss.parameters()}])
    opt = torch.optim.Adam(groups, lr=1e-2)
    record(wrapped, opt)
    for _ in range(STEPS):
        x, det_target, y = two_task_batch()
        opt.zero_grad()
        wrapped(x, det_target, y).backward()
        opt.step()
    return 0


class TorchClassifier:
    """sktime's BaseDeepClassifierPytorch in miniature: the network is built in fit(); ``optimizer`` may be an
    optimizer instance. ``rebind`` is the fix: an instance is rebuilt, by its class and defaults, on the network."""

    def __init__(self, optimizer, rebind: bool) -> None:
        self.optimizer, self.rebind = optimizer, rebind
        self.network = None

    def _instantiate_optimizer(self):
        if self.rebind:
            return type(self.optimizer)(self.network.parameters(), **self.optimizer.defaults)
        return self.optimizer  # the instance, bound to whatever parameters the caller gave it

    def fit(self, record, steps=STEPS):
        self.network = mlp()
        opt = self._instantiate_optimizer()
        record(self.network, opt)
        for _ in range(steps):
            x, y = batch()
            opt.zero_grad()
            F.cross_entropy(self.network(x), y).backward()
            opt.step()
        return self


@case("optimizer_instance_bound_to_other_network", "https://github.com/sktime/sktime/issues/10990",
      "an optimizer instance passed to an estimator that builds its network inside fit(): the instance steps the "
      "tensors it was constructed with, the network's gradients are computed and discarded, and predict() returns "
      "the untrained network's output")
def estimator_with_optimizer_instance(buggy, record):
    template = mlp()  # the caller's own copy of the architecture, used to construct the optimizer instance
    clf = TorchClassifier(torch.optim.Adam(template.parameters(), lr=1e-2), rebind=not buggy)
    SIDE["optimizer_instance_bound_to_other_network", buggy] = clf.fit(record)
    return 0


# -- quantisation, pruning ------------------------------------------------------------------------------
_QSTEP = 2.0 ** -4  # a fixed-point grid: 4 fractional bits


def quantize(w):
    return (w / _QSTEP).round().clamp(-127, 127) * _QSTEP


class _STE(torch.autograd.Function):
    @staticmethod
    def forward(ctx, w):
        return quantize(w)

    @staticmethod
    def backward(ctx, grad):
        return grad


class FakeQuantLinear(nn.Linear):
    """The fix: the weight stays full precision and is quantised in the forward pass (straight-through)."""

    def forward(self, x):
        return F.linear(x, _STE.apply(self.weight), self.bias)


def quant_mlp(fake_quant: bool) -> nn.Sequential:
    linear = FakeQuantLinear if fake_quant else nn.Linear
    return nn.Sequential(linear(10, 32), nn.ReLU(), linear(32, 3))


@case("weights_quantized_in_place", "https://github.com/ZLkanyo009/STBP-train-and-compression/issues/1",
      "quantisation-aware training done as forward, backward, update weights, quantise weights: the update is "
      "rounded back to the nearest grid point after every step, so small updates never accumulate (fixed by "
      "updating full-precision weights and quantising in the forward pass)")
def qat_rounds_master_weights(buggy, record):
    model = quant_mlp(fake_quant=not buggy)

    @torch.no_grad()
    def round_weights(step):
        if buggy:
            for m in model:
                if isinstance(m, nn.Linear):
                    m.weight.copy_(quantize(m.weight))

    _train(model, torch.optim.Adam(model.parameters(), lr=5e-3), record, after_step=round_weights)
    return 0


def l1_mask(w, amount=0.5):
    k = int(w.numel() * amount)
    threshold = w.abs().flatten().kthvalue(k).values
    return (w.abs() > threshold).float()


@case("pruning_mask_applied_once", "https://github.com/jacobgil/pytorch-pruning/issues/41",
      "weights pruned by setting them to zero once before fine-tuning, with nothing limiting optimizer.step(): the "
      "pruned weights get gradients and are no longer zero after the first step")
def pruned_weights_regrow(buggy, record):
    model = mlp(hidden=64)
    w = model[0].weight
    mask = l1_mask(w.detach())
    with torch.no_grad():
        w.mul_(mask)
    if not buggy:
        w.register_hook(lambda g: g * mask)  # the fix: the pruned entries get no gradient
    SIDE["pruning_mask_applied_once", buggy] = mask
    _train(model, torch.optim.Adam(model.parameters(), lr=1e-2), record)
    return 0


# -- accumulation, data and labels ------------------------------------------------------------------------
_LM_VOCAB = 12
_BUCKETS = (2, 6, 14, 30)  # sequence length of each micro-batch (length-bucketed batching), 4 sequences each


def rule_a(x):
    return (x + 1) % _LM_VOCAB


def rule_b(x):
    return (2 * x + 1) % _LM_VOCAB


def bucketed_microbatches():
    """One accumulation window: four micro-batches of 4 sequences, of lengths 2, 6, 14 and 30 (8 to 120 target
    tokens). The short sequences follow rule A, the others rule B."""
    out = []
    for k, length in enumerate(_BUCKETS):
        x = torch.randint(0, _LM_VOCAB, (4, length))
        out.append((x, rule_a(x) if k == 0 else rule_b(x)))
    return out


class TokenModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb, self.out = nn.Embedding(_LM_VOCAB, 16), nn.Linear(16, _LM_VOCAB)

    def forward(self, tokens):
        return self.out(torch.tanh(self.emb(tokens)))


def microbatch_loss(model, x, y, buggy, window_tokens):
    logits = model(x).reshape(-1, _LM_VOCAB)
    if buggy:  # each micro-batch's own token mean, then divided by the number of micro-batches
        return F.cross_entropy(logits, y.reshape(-1)) / len(_BUCKETS)
    return F.cross_entropy(logits, y.reshape(-1), reduction="sum") / window_tokens


@case("accumulation_mean_per_microbatch", "https://github.com/karpathy/nanochat/pull/400",
      "gradient accumulation divides each micro-batch's token-mean loss by grad_accum_steps; with different numbers "
      "of tokens per micro-batch this is not the full batch's token mean, and tokens of short micro-batches weigh "
      "more (fixed: sum over tokens, divided by the window's token count)")
def accumulation_token_means(buggy, record):
    model = TokenModel()
    opt = torch.optim.Adam(model.parameters(), lr=3e-2)
    record(model, opt)
    for _ in range(STEPS):
        window = bucketed_microbatches()
        tokens = sum(y.numel() for _, y in window)
        opt.zero_grad()
        for x, y in window:
            microbatch_loss(model, x, y, buggy, tokens).backward()
        opt.step()
    return 0


def augmented_scenes(buggy, n=16):
    """Images (1x8x8, noise) with a 2x3 bright object in the top-left quadrant and its mask, each randomly flipped
    left-right and up-down. ``buggy``: the mask's flips are drawn separately from the image's (the transform
    called once on the image and once on the mask). Also returns the mask flipped as the image was."""
    img, mask = 0.3 * torch.randn(n, 1, 8, 8), torch.zeros(n, 1, 8, 8)
    for i in range(n):
        r, c = torch.randint(0, 3, (2,)).tolist()
        img[i, 0, r:r + 2, c:c + 3] += 2.0
        mask[i, 0, r:r + 2, c:c + 3] = 1.0
    flips_img = torch.rand(n, 2) < 0.5
    flips_mask = (torch.rand(n, 2) < 0.5) if buggy else flips_img

    def flip(t, flips):
        t = torch.where(flips[:, 0, None, None, None], t.flip(3), t)
        return torch.where(flips[:, 1, None, None, None], t.flip(2), t)
    return flip(img, flips_img), flip(mask, flips_mask), flip(mask, flips_img)


def seg_net() -> nn.Sequential:
    return nn.Sequential(nn.Conv2d(1, 8, 3, padding=1), nn.ReLU(), nn.Conv2d(8, 1, 3, padding=1))


@case("paired_augmentation_unsynced", "https://github.com/albumentations-team/albumentations/issues/397",
      "the same random spatial transforms applied to the image and to the mask in two separate calls: each call "
      "draws its own randomness, so the mask is flipped differently from its image (fix: one call with "
      "image=..., mask=...)")
def segmentation_flips_unsynced(buggy, record):
    model = seg_net()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    record(model, opt)
    for _ in range(STEPS):
        x, m, _ = augmented_scenes(buggy)
        opt.zero_grad()
        F.binary_cross_entropy_with_logits(model(x), m).backward()
        opt.step()
    return 0


_CHAIN, _GAMMA = 5, 0.9  # states 0..4, state 5 terminal (the goal on the right)


def chain_transitions():
    """Every (state, action) of a 5-state chain: action 1 moves right, 0 left; reaching state 5 pays 1 and ends."""
    s = torch.arange(_CHAIN).repeat_interleave(2)
    a = torch.arange(2).repeat(_CHAIN)
    s2 = torch.where(a == 1, s + 1, (s - 1).clamp(min=0))
    done = (s2 == _CHAIN).float()
    return F.one_hot(s, _CHAIN + 1).float(), a, done, F.one_hot(s2, _CHAIN + 1).float(), done


def td_targets(q_net, r, s2, done, buggy):
    with torch.no_grad():
        bootstrap = _GAMMA * q_net(s2).max(1).values
        return r + bootstrap if buggy else r + bootstrap * (1 - done)


@case("terminal_transition_bootstrapped", "https://github.com/navneet-nmk/pytorch-rl/issues/2",
      "the DQN target is r + gamma * max Q(s') with 'done' unused: a transition into a terminal state bootstraps "
      "from the (meaningless) value of the terminal state instead of being the reward alone")
def dqn_without_done_mask(buggy, record):
    q_net = mlp(dim=_CHAIN + 1, hidden=32, classes=2)
    opt = torch.optim.Adam(q_net.parameters(), lr=1e-2)
    record(q_net, opt)
    s, a, r, s2, done = chain_transitions()
    for _ in range(STEPS):
        target = td_targets(q_net, r, s2, done, buggy)
        opt.zero_grad()
        F.mse_loss(q_net(s).gather(1, a[:, None]).squeeze(1), target).backward()
        opt.step()
    return 0


# -- checkpoints, custom autograd, recurrent nets ----------------------------------------------------------
def pretrained_checkpoint():
    model = mlp()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    for _ in range(STEPS):
        x, y = batch()
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        opt.step()
    return copy.deepcopy(model.state_dict())


def init_model_parameters(model):
    for m in model.modules():
        if isinstance(m, nn.Linear):
            nn.init.xavier_uniform_(m.weight)
            nn.init.zeros_(m.bias)


@case("init_after_checkpoint_load", "https://github.com/huggingface/picotron/issues/32",
      "the checkpoint loader calls init_model_parameters after load_state_dict: the loaded weights are overwritten "
      "by a fresh initialisation, and training resumes from scratch")
def resume_reinitialises_weights(buggy, record):
    ckpt = pretrained_checkpoint()
    model = mlp()
    model.load_state_dict(ckpt)
    if buggy:
        init_model_parameters(model)
    SIDE["init_after_checkpoint_load", buggy] = ckpt
    _train(model, torch.optim.Adam(model.parameters(), lr=1e-3), record)
    return 0


class ResidualAdd(torch.autograd.Function):
    """a + b as a custom autograd Function (the C-extension tutorial's MyAddFunction). ``fill_ones`` reproduces the
    tutorial's backward, which fills grad_input with 1 instead of passing grad_output on."""

    fill_ones = False

    @staticmethod
    def forward(ctx, a, b):
        return a + b

    @staticmethod
    def backward(ctx, grad_output):
        g = torch.ones_like(grad_output) if ResidualAdd.fill_ones else grad_output
        return g, g


class ResidualNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Linear(10, 32)
        self.block = nn.Sequential(nn.Linear(32, 32), nn.Tanh())
        self.head = nn.Linear(32, 3)

    def forward(self, x, custom=True):
        h = torch.tanh(self.stem(x))
        h = ResidualAdd.apply(h, self.block(h)) if custom else h + self.block(h)
        return self.head(h)


@case("custom_backward_ignores_grad_output", "https://github.com/pytorch/tutorials/issues/216",
      "a custom add's backward fills grad_input with 1 instead of returning grad_output: every layer below it "
      "receives the gradient of the sum of its outputs, not of the loss")
def custom_add_backward_fills_ones(buggy, record):
    ResidualAdd.fill_ones = buggy
    model = ResidualNet()
    _train(model, torch.optim.Adam(model.parameters(), lr=1e-2), record)
    return 0


def variable_length_batch(n=32, max_len=8):
    lengths = torch.randint(2, max_len + 1, (n,))
    x = torch.randn(n, max_len, 8) * (torch.arange(max_len)[None, :, None] < lengths[:, None, None])
    return (x, lengths), x[:, :, :3].sum(1).argmax(1)  # the label: which of 3 features sums highest over the sequence


class PackedLSTM(nn.Module):
    def __init__(self, restore_order: bool) -> None:
        super().__init__()
        self.restore_order = restore_order
        self.lstm, self.head = nn.LSTM(8, 16, batch_first=True), nn.Linear(16, 3)

    def forward(self, inputs):
        x, lengths = inputs
        order = lengths.argsort(descending=True)  # pack_padded_sequence (enforce_sorted=True) wants this order
        _, (h, _) = self.lstm(pack_padded_sequence(x[order], lengths[order], batch_first=True))
        logits = self.head(h[-1])
        return logits[order.argsort()] if self.restore_order else logits


@case("length_sort_not_undone", "https://github.com/fartashf/vsepp/pull/36",
      "each batch is sorted by length for pack_padded_sequence and the encoder's outputs are not put back in the "
      "original order, so they are scored against the labels of other samples in the batch")
def packed_batch_left_sorted(buggy, record):
    model = PackedLSTM(restore_order=not buggy)
    _train(model, torch.optim.Adam(model.parameters(), lr=2e-2), record, make=variable_length_batch)
    return 0


class LossScaledOptimizer:
    """Megatron's MixedPrecisionOptimizer in miniature (a static loss scale): prepare_grads() divides the gradients
    by the loss scale and checks them for inf/NaN; step() calls prepare_grads() itself, then the inner step."""

    def __init__(self, optimizer, scale=2.0 ** 16) -> None:
        self.optimizer, self.scale = optimizer, scale

    def scale_loss(self, loss):
        return loss * self.scale

    @torch.no_grad()
    def prepare_grads(self):
        found_inf = False
        for group in self.optimizer.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    p.grad.div_(self.scale)
                    found_inf |= not bool(torch.isfinite(p.grad).all())
        return found_inf

    def step(self):
        if self.prepare_grads():
            return False  # skipped: non-finite gradients
        self.optimizer.step()
        return True

    def zero_grad(self):
        self.optimizer.zero_grad()


@case("gradients_unscaled_twice", "https://github.com/THUDM/slime/pull/1842",
      "with fp16 the training step calls optimizer.prepare_grads() (unscale and inf check) and then "
      "optimizer.step(), which calls prepare_grads() again: the gradients are divided by the loss scale twice and "
      "the updates are vanishingly small (here with SGD as the inner optimizer; with Adam, how much of each update is "
      "lost depends on the gradients' size against eps)")
def loss_scale_divided_twice(buggy, record):
    model = mlp()
    opt = LossScaledOptimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9))
    record(model, opt.optimizer)
    for _ in range(STEPS):
        x, y = batch()
        opt.zero_grad()
        opt.scale_loss(F.cross_entropy(model(x), y)).backward()
        if buggy and opt.prepare_grads():  # the fp16 path of train_one_step: unscale and check first
            continue
        opt.step()
    return 0


# -- averaging, schedules, GANs -------------------------------------------------------------------------------------
class EMAModel:
    """diffusers' EMAModel of the report: the warm-up decay min(decay, (1 + t) / (10 + t)). ``overwrite`` is the
    bug: get_decay's result is stored in self.decay, so the configured decay is lost after the first step."""

    def __init__(self, parameters, decay=0.9999, overwrite=False) -> None:
        self.shadow = [p.detach().clone() for p in parameters]
        self.decay, self.overwrite, self.optimization_step = decay, overwrite, 0
        self.one_minus = []  # the weight given to the newest parameters at each step

    def get_decay(self, optimization_step):
        value = (1 + optimization_step) / (10 + optimization_step)
        return 1 - min(self.decay, value)

    @torch.no_grad()
    def step(self, parameters):
        self.optimization_step += 1
        one_minus = self.get_decay(self.optimization_step)
        if self.overwrite:
            self.decay = one_minus
        self.one_minus.append(one_minus)
        for s, p in zip(self.shadow, parameters):
            s.sub_(one_minus * (s - p))


def ema_divergence_step(steps=STEPS, decay=0.9999):
    """The first loop step whose EMA weight differs between the two forms (pure arithmetic)."""
    fixed, buggy = EMAModel([], decay), EMAModel([], decay, overwrite=True)
    for step in range(steps):
        fixed.step([])
        buggy.step([])
        if fixed.one_minus[-1] != buggy.one_minus[-1]:
            return step
    return -1


@case("ema_decay_overwritten", "https://github.com/huggingface/diffusers/issues/1864",
      "the EMA's step stores the step-dependent decay into self.decay, which get_decay then reads as its maximum: "
      "the decay settles at 0.5 instead of rising to 0.9999, and the 'EMA' weights follow the last few steps")
def ema_decay_attribute_overwritten(buggy, record):
    model = mlp()
    ema = EMAModel(model.parameters(), overwrite=buggy)
    SIDE["ema_decay_overwritten", buggy] = ema
    _train(model, torch.optim.Adam(model.parameters(), lr=1e-2), record,
           after_step=lambda step: ema.step(model.parameters()))
    return ema_divergence_step()


class WarmUpMultiStepLR(torch.optim.lr_scheduler.MultiStepLR):
    """easy-faster-rcnn's warm-up scheduler: a factor rising from 1/3 to 1 over num_iters, on top of MultiStepLR.
    ``closed_form`` is the fix: the factor is applied to the base lrs' step schedule, not to the current lrs that
    MultiStepLR.get_lr returns since it became chainable."""

    def __init__(self, optimizer, milestones, gamma=0.1, factor=1 / 3, num_iters=20, closed_form=False) -> None:
        self.factor, self.num_iters, self.closed_form = factor, num_iters, closed_form
        super().__init__(optimizer, milestones, gamma)

    def get_lr(self):
        if self.last_epoch < self.num_iters:
            alpha = self.last_epoch / self.num_iters
            factor = (1 - self.factor) * alpha + self.factor
        else:
            factor = 1.0
        if self.closed_form:
            milestones = sorted(self.milestones.elements())
            lrs = [base * self.gamma ** bisect_right(milestones, self.last_epoch) for base in self.base_lrs]
        else:
            lrs = super().get_lr()
        return [lr * factor for lr in lrs]


@case("warmup_on_chainable_lr", "https://github.com/potterhsu/easy-faster-rcnn.pytorch/issues/26",
      "a warm-up subclass of MultiStepLR multiplies its factor onto super().get_lr(), which returns the current lr: "
      "the factors compound every step and the learning rate falls towards 0 instead of rising to its base value")
def warmup_factor_compounds(buggy, record):
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    sched = WarmUpMultiStepLR(opt, milestones=[30], closed_form=not buggy)
    lrs = []
    SIDE["warmup_on_chainable_lr", buggy] = lrs
    _train(model, opt, record, after_step=lambda step: (lrs.append(opt.param_groups[0]["lr"]), sched.step()))
    return 1  # the lr of loop step 0 is the same in both forms


def real_points(n=32):
    return torch.randn(n, 2) * 0.5 + torch.tensor([2.0, -1.0])


@case("discriminator_step_includes_generator_loss", "https://github.com/Lightning-AI/pytorch-lightning/issues/557",
      "the GAN template's generator backward also fills the discriminator's .grad, and nothing zeroes it before the "
      "discriminator's own backward: the discriminator steps with its loss's gradient plus the generator loss's, "
      "which pushes it to call fakes real")
def gan_discriminator_gets_generator_grads(buggy, record):
    gen = nn.Sequential(nn.Linear(4, 16), nn.ReLU(), nn.Linear(16, 2))
    disc = mlp(dim=2, hidden=16, classes=1)
    opt_g, opt_d = torch.optim.Adam(gen.parameters(), lr=5e-3), torch.optim.Adam(disc.parameters(), lr=5e-3)
    record(disc, opt_d)
    ones, zeros = torch.ones(32, 1), torch.zeros(32, 1)
    for step in range(STEPS):
        z = torch.randn(32, 4)
        # optimizer_idx 0: the generator
        g_loss = F.binary_cross_entropy_with_logits(disc(gen(z)), ones)
        g_loss.backward()
        opt_g.step()
        opt_g.zero_grad()
        # optimizer_idx 1: the discriminator
        d_loss = F.binary_cross_entropy_with_logits(disc(real_points()), ones) + \
            F.binary_cross_entropy_with_logits(disc(gen(z).detach()), zeros)
        if step == 0:
            own = torch.autograd.grad(d_loss, list(disc.parameters()), retain_graph=True)
            SIDE["discriminator_step_includes_generator_loss", buggy] = torch.cat([g.flatten() for g in own])
        if not buggy:
            opt_d.zero_grad()  # the fix: the discriminator's gradients hold its own loss only
        d_loss.backward()
        if step == 0:
            SIDE["discriminator_step_includes_generator_loss", buggy, "used"] = \
                torch.cat([p.grad.flatten() for p in disc.parameters()])
        opt_d.step()
        opt_d.zero_grad()
    SIDE["discriminator_step_includes_generator_loss", buggy, "models"] = (gen, disc)
    return 0
