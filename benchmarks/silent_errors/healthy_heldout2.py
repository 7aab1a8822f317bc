"""Second held-out set of healthy loops: unusual but correct patterns real users write, written
blind (without reading how the recorder works and without running it on them) for
``score.py --set heldout2``. Any finding at warning or error level on one of them is a false
alarm. Each is ``fn(ok, record) -> -1`` like healthy.py's; this registry is separate from the
other sets'. None repeats a pattern of healthy.py, healthy_patterns.py or healthy_heldout.py."""

from __future__ import annotations

import copy
import math

import torch
import torch.nn.functional as F
from harness import STEPS, SmallCNN, batch, images, mlp
from torch import nn
from torch.optim.swa_utils import SWALR, AveragedModel, update_bn

HEALTHY: dict[str, object] = {}


def healthy(fn):
    HEALTHY[fn.__name__] = fn
    return fn


def _loop(model, opt, record, make=batch, loss_fn=F.cross_entropy, before_step=None, after_step=None, **options):
    record(model, opt, **options)
    for step in range(STEPS):
        x, y = make()
        opt.zero_grad()
        loss_fn(model(x), y).backward()
        if before_step is not None:
            before_step(step)
        opt.step()
        if after_step is not None:
            after_step(step)
    return -1


# -- a second network moved by momentum -------------------------------------------------------
class _Online(nn.Module):
    """BYOL's online branch (Grill et al. 2020): encoder, projector and a predictor."""

    def __init__(self) -> None:
        super().__init__()
        self.encoder = nn.Sequential(nn.Linear(10, 32), nn.ReLU(), nn.Linear(32, 16))
        self.projector = nn.Sequential(nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 8))
        self.predictor = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 8))

    def project(self, x):
        return self.projector(self.encoder(x))

    def forward(self, x):
        return self.predictor(self.project(x))


@healthy
def byol_momentum_target(_, record):
    """BYOL: the target network (encoder and projector) is a momentum copy of the online one,
    updated after every step; the online network and its predictor are recorded."""
    online = _Online()
    target_enc = copy.deepcopy(online.encoder).requires_grad_(False)
    target_proj = copy.deepcopy(online.projector).requires_grad_(False)
    opt = torch.optim.AdamW(online.parameters(), lr=1e-3)
    record(online, opt)
    tau = 0.99
    for _ in range(STEPS):
        x = torch.randn(32, 10)
        v1, v2 = x + 0.1 * torch.randn_like(x), x + 0.1 * torch.randn_like(x)
        with torch.no_grad():
            z1, z2 = target_proj(target_enc(v1)), target_proj(target_enc(v2))
        loss = (2 - 2 * F.cosine_similarity(online(v1), z2, dim=-1)).mean() \
            + (2 - 2 * F.cosine_similarity(online(v2), z1, dim=-1)).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        with torch.no_grad():
            for t, o in zip(list(target_enc.parameters()) + list(target_proj.parameters()),
                            list(online.encoder.parameters()) + list(online.projector.parameters())):
                t.lerp_(o, 1 - tau)
    return -1


@healthy
def stochastic_weight_averaging(_, record):
    """SWA (Izmailov et al. 2018): from step 20 an AveragedModel takes the weights after every
    step under SWALR; BatchNorm statistics of the average recomputed at the end."""
    model = mlp(bn=True)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    swa_model, swa_start = AveragedModel(model), 20
    swa_sched = SWALR(opt, swa_lr=0.05, anneal_epochs=5)
    record(model, opt)
    for step in range(STEPS):
        x, y = batch()
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        opt.step()
        if step >= swa_start:
            swa_model.update_parameters(model)
            swa_sched.step()
    update_bn([batch()[0] for _ in range(4)], swa_model)
    return -1


# -- two optimizers stepping after one backward ------------------------------------------------
class _SparseBag(nn.Module):
    def __init__(self, vocab: int = 50, dim: int = 16) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim, sparse=True)
        self.head = nn.Sequential(nn.Linear(dim, 32), nn.ReLU(), nn.Linear(32, 2))

    def forward(self, tokens):  # NxT -> Nx2
        return self.head(self.embed(tokens).mean(1))


def _bag_of_tokens():
    t = torch.randint(0, 50, (16, 6))
    return t, (t < 10).any(1).long()


@healthy
def sparse_embedding_two_optimizers(_, record):
    """A sparse embedding under SparseAdam and the dense layers under AdamW, both stepping after
    one backward; recorded as one model with the list of its optimizers."""
    model = _SparseBag()
    opt_sparse = torch.optim.SparseAdam([model.embed.weight], lr=1e-2)
    opt_dense = torch.optim.AdamW(model.head.parameters(), lr=1e-3)
    record(model, [opt_sparse, opt_dense])
    for _ in range(STEPS):
        tokens, y = _bag_of_tokens()
        opt_sparse.zero_grad()
        opt_dense.zero_grad()
        F.cross_entropy(model(tokens), y).backward()
        opt_sparse.step()
        opt_dense.step()
    return -1


# -- constraints and clipping -----------------------------------------------------------------
@healthy
def max_norm_constraint_renorm(_, record):
    """Dropout with a max-norm constraint (Srivastava et al. 2014, Sec. 5.1): after every step
    each hidden unit's incoming weight vector is rescaled to norm <= 0.6 by torch.renorm."""
    model = mlp(dropout=0.3)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)

    def constrain(_step):
        with torch.no_grad():
            w = model[0].weight  # rows: one per hidden unit
            w.copy_(torch.renorm(w, p=2, dim=0, maxnorm=0.6))

    return _loop(model, opt, record, after_step=constrain)


@healthy
def clip_grad_by_value(_, record):
    """Every gradient entry clipped to [-0.05, 0.05] (clip_grad_value_) before an SGD step."""
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    return _loop(model, opt, record,
                 before_step=lambda _s: torch.nn.utils.clip_grad_value_(model.parameters(), 0.05))


# -- a learnable temperature, routing, distillation --------------------------------------------
class _DualEncoder(nn.Module):
    """CLIP's contrastive pair (Radford et al. 2021) at toy size: two encoders and a learnable
    logit scale, initialised at log(1/0.07) and clamped to at most log(100) after each step."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Sequential(nn.Linear(10, 32), nn.ReLU(), nn.Linear(32, 8))
        self.b = nn.Sequential(nn.Linear(6, 32), nn.ReLU(), nn.Linear(32, 8))
        self.logit_scale = nn.Parameter(torch.tensor(math.log(1 / 0.07)))

    def forward(self, pair):  # (Nx10, Nx6) -> NxN similarity logits
        za, zb = F.normalize(self.a(pair[0]), dim=-1), F.normalize(self.b(pair[1]), dim=-1)
        return self.logit_scale.exp() * za @ zb.t()


def _paired_views():
    x = torch.randn(16, 10)
    return (x, x[:, :6] + 0.1 * torch.randn(16, 6)), torch.arange(16)


@healthy
def contrastive_learnable_temperature(_, record):
    """A symmetric contrastive loss with a learnable temperature as an nn.Parameter."""
    model = _DualEncoder()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.0)

    def loss_fn(logits, y):
        return (F.cross_entropy(logits, y) + F.cross_entropy(logits.t(), y)) / 2

    def clamp_scale(_step):
        with torch.no_grad():
            model.logit_scale.clamp_(0, math.log(100))

    return _loop(model, opt, record, make=_paired_views, loss_fn=loss_fn, after_step=clamp_scale)


class _TopTwoMoE(nn.Module):
    """Four experts, top-2 routing with renormalised gates (Shazeer et al. 2017) and the Switch
    load-balancing loss (Fedus et al. 2021, Eq. 4) kept for the training loop to add."""

    def __init__(self, dim: int = 10, experts: int = 4) -> None:
        super().__init__()
        self.router = nn.Linear(dim, experts)
        self.experts = nn.ModuleList([nn.Sequential(nn.Linear(dim, 16), nn.ReLU(), nn.Linear(16, 16))
                                      for _ in range(experts)])
        self.head = nn.Linear(16, 3)
        self.balance = torch.zeros(())

    def forward(self, x):  # Nxdim -> Nx3
        probs = F.softmax(self.router(x), -1)
        gate, idx = probs.topk(2, dim=-1)
        gate = gate / gate.sum(-1, keepdim=True)
        out = torch.zeros(x.shape[0], 16)
        for e, expert in enumerate(self.experts):
            rows, slot = (idx == e).nonzero(as_tuple=True)
            if rows.numel():
                out = out.index_add(0, rows, gate[rows, slot, None] * expert(x[rows]))
        share = F.one_hot(idx[:, 0], len(self.experts)).float().mean(0)  # tokens whose first choice is e
        self.balance = len(self.experts) * (share * probs.mean(0)).sum()
        return self.head(out)


@healthy
def moe_top2_load_balancing(_, record):
    """Top-2 mixture of experts with the load-balancing loss added (weight 0.01)."""
    model = _TopTwoMoE()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    return _loop(model, opt, record, loss_fn=lambda out, y: F.cross_entropy(out, y) + 0.01 * model.balance)


class _Distiller(nn.Module):
    """A student and, as a submodule, a frozen teacher in eval mode (with dropout) whose logits are
    computed under no_grad, as distillation trainers hold it."""

    def __init__(self) -> None:
        super().__init__()
        self.teacher = mlp(10, 64, 3, dropout=0.2).eval().requires_grad_(False)
        self.student = mlp(10, 16, 3)

    def train(self, mode: bool = True):
        super().train(mode)
        self.teacher.eval()  # the teacher always predicts in eval mode
        return self

    def forward(self, x):
        with torch.no_grad():
            soft = self.teacher(x)
        return self.student(x), soft


@healthy
def distillation_frozen_teacher(_, record):
    """Knowledge distillation (Hinton et al. 2015): KL to the teacher's softened outputs at T=4,
    scaled by T^2, plus cross-entropy; only the student is in the optimizer."""
    model = _Distiller().train()
    opt = torch.optim.SGD(model.student.parameters(), lr=0.05, momentum=0.9)
    temperature, alpha = 4.0, 0.7

    def loss_fn(outputs, y):
        student, teacher = outputs
        kl = F.kl_div(F.log_softmax(student / temperature, -1), F.log_softmax(teacher / temperature, -1),
                      reduction="batchmean", log_target=True)
        return alpha * temperature ** 2 * kl + (1 - alpha) * F.cross_entropy(student, y)

    return _loop(model, opt, record, loss_fn=loss_fn)


# -- fine-tuning and layout -------------------------------------------------------------------
@healthy
def frozen_backbone_bn_in_eval(_, record):
    """Fine-tuning a head on a frozen convolutional backbone done right: the backbone's parameters
    frozen and its BatchNorm layers put back in eval mode after every model.train()."""
    model = SmallCNN()
    model.backbone.requires_grad_(False)
    opt = torch.optim.SGD(model.head.parameters(), lr=0.05, momentum=0.9)
    record(model, opt)
    for step in range(STEPS):
        if step % 10 == 0:  # a new epoch: the trainer calls model.train()
            model.train()
            for m in model.backbone.modules():
                if isinstance(m, nn.BatchNorm2d):
                    m.eval()
        x, y = images()
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        opt.step()
    return -1


@healthy
def label_smoothing_channels_last(_, record):
    """A small CNN in channels_last memory format, cross-entropy with label smoothing 0.1, SGD
    with Nesterov momentum."""
    model = SmallCNN().to(memory_format=torch.channels_last)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9, nesterov=True)

    def make():
        x, y = images()
        return x.contiguous(memory_format=torch.channels_last), y

    return _loop(model, opt, record, make=make, loss_fn=lambda out, y: F.cross_entropy(out, y, label_smoothing=0.1))


@healthy
def cosine_warm_restarts(_, record):
    """AdamW under CosineAnnealingWarmRestarts (Loshchilov & Hutter 2017), cycles of 10 steps
    down to eta_min 0, stepped per batch."""
    model = mlp()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    sched = torch.optim.lr_scheduler.CosineAnnealingWarmRestarts(opt, T_0=10, eta_min=0.0)
    return _loop(model, opt, record, after_step=lambda _s: sched.step())


@healthy
def freeze_and_unfreeze_midway(_, record):
    """The middle layer frozen from step 12 to step 28 (requires_grad False; zero_grad sets .grad
    to None, so SGD's momentum and weight decay skip it) and then trained again."""
    model = nn.Sequential(nn.Linear(10, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 3))
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9, weight_decay=1e-4)
    record(model, opt)
    for step in range(STEPS):
        if step in (12, 28):
            model[2].requires_grad_(step == 28)
        x, y = batch()
        opt.zero_grad(set_to_none=True)
        F.cross_entropy(model(x), y).backward()
        opt.step()
    return -1


@healthy
def two_losses_two_backwards(_, record):
    """Two task losses on a shared trunk, each with its own backward (the first retaining the
    graph), accumulating into one step."""
    trunk = nn.Sequential(nn.Linear(10, 32), nn.ReLU())
    heads = nn.ModuleList([nn.Linear(32, 3), nn.Linear(32, 1)])
    model = nn.ModuleDict({"trunk": trunk, "heads": heads})
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    record(model, opt)
    for _ in range(STEPS):
        x, y = batch()
        opt.zero_grad()
        h = trunk(x)
        F.cross_entropy(heads[0](h), y).backward(retain_graph=True)
        F.mse_loss(heads[1](h).squeeze(1), x.sum(1)).backward()
        opt.step()
    return -1
