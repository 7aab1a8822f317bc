"""A fifth held-out set of silent training errors, written blind: each case is our own toy
reconstruction (CPU, well under a second) of a public report, in its buggy and its fixed form,
written without reading how the recorder works and without running it on any case here.
``CASES[name]`` is a ``cases.Case``; ``CAUSES`` maps each cause to the finding kind that would name
it (the kinds table of docs/record.md), decided before anything ran and not changed since, or to
None where no existing kind names it (such a case counts as cause not named whatever is found).
Every mechanism differs from those of cases.py, cases_invariants.py and cases_heldout*.py.

Scored with ``score.py --set heldout5``; this registry is separate from the other sets'."""

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
    "custom_backward_returns_none": "no_gradient",  # a custom autograd.Function hands back None for its weight
    "step_outside_accumulation_block": "stale_gradient",  # step every micro-batch, zero_grad every k: grads reused
    "warmup_scheduler_never_stepped": "lr_zero",  # a warm-up from 0 whose scheduler.step() is never called
    "max_norm_renorms_frozen_embedding": "frozen_moved",  # Embedding(max_norm=...) rescales frozen rows in place
    "param_groups_by_layer_type": "not_in_optimizer",  # groups built by isinstance: an unlisted layer type left out
    "parameter_listed_twice": "update_mismatch",  # a shared trunk in the params list twice: stepped twice
    "weight_noise_not_removed": "changed_between_steps",  # weight noise added in place and never taken off
    "rnn_batch_first_missing": None,  # (N, L, C) fed to an LSTM expecting (L, N, C): samples become time steps
    "from_pretrained_freezes_by_default": None,  # Embedding.from_pretrained freezes unless freeze=False
    "kl_div_input_not_log": None,  # F.kl_div given probabilities where it expects log-probabilities
    "lr_set_as_attribute": None,  # optimizer.lr = ... sets an attribute; the param groups keep their lr
    "clip_before_backward": None,  # clip_grad_norm_ called before backward: it clips nothing
    "target_network_aliased": None,  # target_net = q_net: the "frozen" target is the online network
    "functional_dropout_in_eval": None,  # F.dropout without training=self.training: dropout on at evaluation
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


# -- gradients that never arrive ----------------------------------------------------------------
class _LinearFn(torch.autograd.Function):
    buggy = False

    @staticmethod
    def forward(ctx, x, w, b):
        ctx.save_for_backward(x, w)
        return x @ w.t() + b

    @staticmethod
    def backward(ctx, g):
        x, w = ctx.saved_tensors
        return g @ w, None if _LinearFn.buggy else g.t() @ x, g.sum(0)


class CustomLinear(nn.Linear):
    def forward(self, x):
        return _LinearFn.apply(x, self.weight, self.bias)


@case("custom_backward_returns_none", "https://github.com/pytorch/pytorch/issues/45405",
      "a layer written as a custom autograd.Function whose backward hands back None as the weight's "
      "gradient: the weight's .grad stays None, the optimizer skips it, only the bias trains")
def custom_function_drops_weight_grad(buggy, record):
    _LinearFn.buggy = buggy
    model = nn.Sequential(nn.Linear(10, 32), nn.ReLU(), CustomLinear(32, 3))
    _train(model, torch.optim.Adam(model.parameters(), lr=1e-2), record)
    return 0


_VOCAB = 50


def _vocab_task():
    """Pretrained vectors and a class per token that the vectors do not encode."""
    gen = torch.Generator().manual_seed(3)
    return torch.randn(_VOCAB, 8, generator=gen), torch.randint(0, 3, (_VOCAB,), generator=gen)


def _token_batch(table, n=32):
    idx = torch.randint(0, _VOCAB, (n, 1))
    return idx, table[idx[:, 0]]


@case("from_pretrained_freezes_by_default", "https://github.com/RUCAIBox/RecBole/issues/2046",
      "pretrained embeddings loaded with nn.Embedding.from_pretrained to be fine-tuned: its freeze "
      "argument defaults to True, the vectors never train and results equal those without fine-tuning")
def from_pretrained_frozen_default(buggy, record):
    vectors, table = _vocab_task()
    emb = nn.Embedding.from_pretrained(vectors) if buggy else nn.Embedding.from_pretrained(vectors, freeze=False)
    model = nn.Sequential(emb, nn.Flatten(), nn.Linear(8, 3))
    _train(model, torch.optim.Adam(model.parameters(), lr=5e-2), record, make=lambda: _token_batch(table))
    return 0


# -- accumulation, schedules, optimizer set-up --------------------------------------------------
@case("step_outside_accumulation_block", "https://github.com/dice-group/dice-embeddings/issues/432",
      "gradient accumulation with zero_grad() every k micro-batches but optimizer.step() on every one: "
      "each step re-applies the gradients already used by the steps before it in the window")
def step_every_batch_in_accumulation(buggy, record):
    k = 4
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    record(model, opt)
    for i in range(STEPS):
        if buggy and i % k == 0:
            opt.zero_grad()
        x, y = batch(8)
        (F.cross_entropy(model(x), y) / k).backward()
        if buggy or (i + 1) % k == 0:
            opt.step()
            if not buggy:
                opt.zero_grad()
    return 1


@case("warmup_scheduler_never_stepped", "https://github.com/huggingface/transformers/issues/2331",
      "a linear warm-up from 0 (as get_linear_schedule_with_warmup makes) whose scheduler.step() the "
      "loop never reaches: the learning rate stays at the warm-up's starting value 0")
def warmup_scheduler_never_stepped(buggy, record):
    model = mlp()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, s / 8))
    _train(model, opt, record, after=None if buggy else (lambda step: sched.step()))
    return 1


class NormedMLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.norm, self.fc2 = nn.Linear(10, 32), nn.LayerNorm(32), nn.Linear(32, 3)

    def forward(self, x):
        return self.fc2(F.relu(self.norm(self.fc1(x))))


def _groups_by_type(model, norms):
    decay, no_decay = [], []
    for m in model.modules():
        if isinstance(m, nn.Linear):
            decay.append(m.weight)
            no_decay.append(m.bias)
        elif isinstance(m, norms):
            no_decay += [m.weight, m.bias]
    return [{"params": decay}, {"params": no_decay, "weight_decay": 0.0}]


@case("param_groups_by_layer_type", "https://github.com/pytorch/pytorch/issues/1402",
      "weight-decay groups built by walking modules and picking Linear/Conv/BatchNorm by isinstance: "
      "the parameters of a layer type the helper does not list (here LayerNorm) land in no group")
def param_groups_by_layer_type(buggy, record):
    model = NormedMLP()
    norms = nn.BatchNorm1d if buggy else (nn.BatchNorm1d, nn.LayerNorm)
    opt = torch.optim.AdamW(_groups_by_type(model, norms), lr=1e-2, weight_decay=0.01)
    _train(model, opt, record)
    return 0


class ActorCritic(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.trunk = nn.Sequential(nn.Linear(10, 32), nn.ReLU())
        self.actor = nn.Sequential(self.trunk, nn.Linear(32, 3))
        self.critic = nn.Sequential(self.trunk, nn.Linear(32, 1))

    def forward(self, x):
        return torch.cat([self.actor(x), self.critic(x)], 1)


def _actor_critic_loss(out, y):
    return F.cross_entropy(out[:, :3], y) + F.mse_loss(out[:, 3], y.float())


@case("parameter_listed_twice", "https://github.com/thu-ml/tianshou/issues/395",
      "actor and critic share a trunk and the optimizer is given list(actor.parameters()) + "
      "list(critic.parameters()): the trunk's tensors are in the group twice and stepped twice")
def shared_trunk_listed_twice(buggy, record):
    model = ActorCritic()
    params = list(model.actor.parameters()) + list(model.critic.parameters()) if buggy else model.parameters()
    _train(model, torch.optim.SGD(params, lr=0.05), record, loss_fn=_actor_critic_loss)
    return 0


@case("lr_set_as_attribute", "https://github.com/V2AI/Det3D/issues/109",
      "a hand-written schedule assigns optimizer.lr = new_lr: that creates an attribute nobody reads, the "
      "param groups keep their first learning rate and the decay never happens")
def lr_set_as_attribute(buggy, record):
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.2, momentum=0.9)

    def schedule(step):
        lr = 0.2 * 0.5 ** (step // 8)
        if buggy:
            opt.lr = lr
        else:
            for group in opt.param_groups:
                group["lr"] = lr

    _train(model, opt, record, before=schedule)
    return 8


# -- weights and gradients edited --------------------------------------------------------------
class FrozenBag(nn.Module):
    def __init__(self, vectors, buggy: bool) -> None:
        super().__init__()
        self.buggy = buggy
        self.emb = nn.Embedding(_VOCAB, 8, max_norm=1.0 if buggy else None)
        with torch.no_grad():
            self.emb.weight.copy_(vectors)
        self.emb.weight.requires_grad_(False)  # the pretrained vectors are meant to stay as they are
        self.head = nn.Linear(8, 3)

    def forward(self, idx):
        v = self.emb(idx)
        if not self.buggy:  # the same max-norm constraint, applied to the looked-up copies
            v = v / v.norm(dim=-1, keepdim=True).clamp(min=1.0)
        return self.head(v.mean(1))


@case("max_norm_renorms_frozen_embedding", "https://github.com/pytorch/pytorch/issues/26596",
      "nn.Embedding with max_norm renormalises the rows it looks up in place, in the weight itself: "
      "pretrained vectors frozen with requires_grad=False are rewritten by the forward pass")
def frozen_embedding_renormed_by_max_norm(buggy, record):
    vectors = torch.randn(_VOCAB, 8) * 2  # norms around 5.6, above max_norm

    def make(n=32):
        idx = torch.randint(0, _VOCAB, (n, 5))
        return idx, vectors[idx].mean(1)[:, :3].argmax(1)

    model = FrozenBag(vectors, buggy)
    _train(model, torch.optim.Adam(model.head.parameters(), lr=1e-2), record, make=make)
    return 0


@case("weight_noise_not_removed", "https://github.com/NVIDIA-NeMo/Speech/issues/3831",
      "weight noise as a regulariser implemented by adding noise to the weights in place before each "
      "forward pass and never subtracting it: the noise accumulates into a random walk of the weights")
def weight_noise_added_in_place(buggy, record):
    model, sigma = mlp(), 0.05
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)

    def noisy_in_place(step):
        with torch.no_grad():
            for p in model.parameters():
                p.add_(torch.randn_like(p) * sigma)

    def noisy_forward(x):  # the fix: the forward pass sees w + noise, w itself is left alone
        params = {n: p + torch.randn_like(p) * sigma for n, p in model.named_parameters()}
        return torch.func.functional_call(model, params, (x,))

    _train(model, opt, record, before=noisy_in_place if buggy else None, forward=None if buggy else noisy_forward)
    return 0


def _regression(n=32):
    x = torch.randn(n, 10)
    return x, 20 * x[:, :3]  # large targets: large gradients early on


@case("clip_before_backward", "https://github.com/Cranial-XIX/FAMO/issues/4",
      "clip_grad_norm_ called before loss.backward(): it clips the gradients of the previous step (None "
      "after zero_grad) and the step uses the new, unclipped ones")
def clip_before_backward(buggy, record):
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    record(model, opt)
    for _ in range(STEPS):
        x, y = _regression()
        opt.zero_grad()
        loss = F.mse_loss(model(x), y)
        if buggy:
            nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        loss.backward()
        if not buggy:
            nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
    return 0


# -- data, loss and model wiring ----------------------------------------------------------------
class SeqClassifier(nn.Module):
    def __init__(self, buggy: bool) -> None:
        super().__init__()
        self.lstm = nn.LSTM(8, 16, batch_first=not buggy)
        self.head = nn.Linear(16, 3)

    def forward(self, x):  # x: N x L x C
        out, _ = self.lstm(x)
        return self.head(out[:, -1])


def _sequences(n=32):
    x = torch.randn(n, 6, 8)
    return x, x.sum(1)[:, :3].argmax(1)


@case("rnn_batch_first_missing", "https://github.com/salesforce/cove/issues/10",
      "an LSTM left at batch_first=False fed (batch, seq, feature) tensors: it runs over the batch as if it "
      "were time, mixing samples, and out[:, -1] picks the last position's states, not each sample's last")
def lstm_without_batch_first(buggy, record):
    model = SeqClassifier(buggy)
    _train(model, torch.optim.Adam(model.parameters(), lr=1e-2), record, make=_sequences)
    return 0


_TEACHER_SEED = 7


def _teacher():
    gen = torch.Generator().manual_seed(_TEACHER_SEED)
    w1, w2 = torch.randn(10, 32, generator=gen), torch.randn(32, 3, generator=gen)
    return lambda x: (torch.tanh(x @ w1) @ w2) / 4  # soft targets: a flat-ish distribution


def kd_loss(buggy):
    def loss(student_logits, teacher_logits):
        s = F.softmax(student_logits, 1) if buggy else F.log_softmax(student_logits, 1)
        return F.kl_div(s, F.softmax(teacher_logits, 1), reduction="batchmean")
    return loss


@case("kl_div_input_not_log", "https://github.com/microsoft/ProDA/issues/20",
      "distillation with F.kl_div(student_probs, teacher_probs): kl_div expects log-probabilities as its "
      "input, so the loss is not the KL divergence and the student is not pulled to the teacher")
def kl_div_given_probabilities(buggy, record):
    teacher, model = _teacher(), mlp()

    def make():
        x = torch.randn(32, 10)
        return x, teacher(x)

    _train(model, torch.optim.Adam(model.parameters(), lr=1e-2), record, make=make, loss_fn=kd_loss(buggy))
    return 0


class Agent(nn.Module):
    """An online Q-network and its target network, held together as many RL codebases do."""

    def __init__(self, buggy: bool) -> None:
        super().__init__()
        self.online = mlp(classes=2)
        self.target = self.online if buggy else copy.deepcopy(self.online).requires_grad_(False)

    def forward(self, x):
        return self.online(x)


def _transitions(n=32):
    s, s2 = torch.randn(n, 10), torch.randn(n, 10)
    a = torch.randint(0, 2, (n,))
    return s, s2, a, s[:, 0] * (2 * a - 1).float()  # reward: +s0 for action 1, -s0 for action 0


@case("target_network_aliased", "https://github.com/andri27-ts/Reinforcement-Learning/issues/14",
      "the target network assigned as a reference to the online network: the periodic hard update copies the "
      "network onto itself and the bootstrap target moves with every gradient step")
def target_network_aliased(buggy, record):
    agent = Agent(buggy)
    opt = torch.optim.Adam(agent.online.parameters(), lr=1e-2)
    record(agent, opt)
    for step in range(STEPS):
        s, s2, a, r = _transitions()
        with torch.no_grad():
            target = r + 0.9 * agent.target(s2).max(1).values
        opt.zero_grad()
        F.mse_loss(agent(s).gather(1, a[:, None]).squeeze(1), target).backward()
        opt.step()
        if step % 16 == 15:  # the hard update
            agent.target.load_state_dict(agent.online.state_dict())
    return 1


class DropoutMLP(nn.Module):
    def __init__(self, buggy: bool) -> None:
        super().__init__()
        self.buggy = buggy
        self.fc1, self.fc2 = nn.Linear(10, 64), nn.Linear(64, 3)

    def forward(self, x):
        h = F.relu(self.fc1(x))
        h = F.dropout(h, 0.5) if self.buggy else F.dropout(h, 0.5, training=self.training)
        return self.fc2(h)


@case("functional_dropout_in_eval", "https://github.com/rixwew/pytorch-fm/issues/21",
      "F.dropout called without training=self.training: its default is training=True, so model.eval() does "
      "not turn it off and every validation pass is made with half the units dropped")
def functional_dropout_in_eval(buggy, record):
    model = DropoutMLP(buggy)
    xv, yv = batch(256)

    def validate(step):
        if step % 8 == 7:
            model.eval()
            with torch.no_grad():
                F.cross_entropy(model(xv), yv)
            model.train()

    _train(model, torch.optim.Adam(model.parameters(), lr=1e-2), record, after=validate)
    return 7
