"""Seventh held-out set of healthy loops: unusual but correct patterns real users write, written
blind (without reading how the recorder works and without running it on them) for
``score.py --set heldout7``. Any finding at warning or error level on one of them is a false
alarm. Each is ``fn(ok, record) -> -1`` like healthy.py's; this registry is separate from the
other sets'. None repeats a pattern of healthy.py, healthy_patterns.py or healthy_heldout*.py."""

from __future__ import annotations

import copy
import io
import warnings

import torch
import torch.nn.functional as F
from harness import STEPS, batch, images, mlp
from torch import nn
from torch.nn.utils.rnn import pack_padded_sequence

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


_BUDGET = 96  # target tokens per optimizer step


def _sequences(n, length):
    x = torch.randint(0, 12, (n, length))
    return x, (2 * x + 1) % 12


class _TokenModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb, self.out = nn.Embedding(12, 16), nn.Linear(16, 12)

    def forward(self, tokens):
        return self.out(torch.tanh(self.emb(tokens)))


@healthy
def token_budget_accumulation(_, record):
    """Dynamic gradient accumulation: micro-batches of random length are accumulated (summed token losses) until a
    token budget is reached, a variable number of backward passes per step; the summed gradients are divided by
    the step's token count by hand just before the step."""
    model = _TokenModel()
    opt = torch.optim.Adam(model.parameters(), lr=2e-2)
    record(model, opt)
    for _ in range(STEPS):
        opt.zero_grad()
        tokens = 0
        while tokens < _BUDGET:
            x, y = _sequences(2, int(torch.randint(4, 24, (1,))))
            F.cross_entropy(model(x).reshape(-1, 12), y.reshape(-1), reduction="sum").backward()
            tokens += y.numel()
        with torch.no_grad():
            for p in model.parameters():
                p.grad.div_(tokens)
        opt.step()
    return -1


class _TwoTask(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.trunk = nn.Sequential(nn.Linear(10, 32), nn.ReLU())
        self.reg, self.cls = nn.Linear(32, 2), nn.Linear(32, 3)
        self.log_var = nn.Parameter(torch.zeros(2))  # Kendall et al. 2018: one learnable log-variance per task

    def forward(self, x):
        h = self.trunk(x)
        return self.reg(h), self.cls(h)

    def loss(self, x, reg_target, y):
        reg, cls = self(x)
        losses = torch.stack([F.mse_loss(reg, reg_target), F.cross_entropy(cls, y)])
        return (torch.exp(-self.log_var) * losses + self.log_var).sum()


@healthy
def uncertainty_weighted_multitask(_, record):
    """Multi-task loss weighted by learnable homoscedastic uncertainty: the log-variances sit in their own param
    group (no weight decay, larger lr), go negative, and the total loss goes below zero, by design."""
    model = _TwoTask()
    others = [p for n, p in model.named_parameters() if n != "log_var"]
    opt = torch.optim.AdamW([{"params": others, "weight_decay": 1e-2},
                             {"params": [model.log_var], "weight_decay": 0.0, "lr": 5e-2}], lr=1e-2)
    record(model, opt)
    for _ in range(STEPS):
        x, y = batch()
        opt.zero_grad()
        model.loss(x, 0.1 * x[:, 3:5], y).backward()
        opt.step()
    return -1


class _QuantMLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.quant, self.dequant = torch.ao.quantization.QuantStub(), torch.ao.quantization.DeQuantStub()
        self.fc1, self.relu, self.fc2 = nn.Linear(10, 32), nn.ReLU(), nn.Linear(32, 3)

    def forward(self, x):
        return self.dequant(self.fc2(self.relu(self.fc1(self.quant(x)))))


@healthy
def eager_qat_prepared_before_optimizer(_, record):
    """PyTorch's eager-mode quantisation-aware training: prepare_qat(inplace=True) swaps in QAT Linear modules with
    weight fake-quantisers and observers (buffers updated by every training forward pass), then the optimizer."""
    model = _QuantMLP().train()
    model.qconfig = torch.ao.quantization.get_default_qat_qconfig("x86")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.ao.quantization.prepare_qat(model, inplace=True)
    return _loop(model, torch.optim.Adam(model.parameters(), lr=1e-2), record)


class _DQNAgent(nn.Module):
    """Online Q-network and its target copy in one module; the target is frozen and overwritten every 10 steps."""

    def __init__(self) -> None:
        super().__init__()
        self.online = mlp(dim=6, hidden=32, classes=2)
        self.target = copy.deepcopy(self.online).requires_grad_(False)

    def forward(self, s):
        return self.online(s)


def _chain():
    s = torch.arange(5).repeat_interleave(2)
    a = torch.arange(2).repeat(5)
    s2 = torch.where(a == 1, s + 1, (s - 1).clamp(min=0))
    done = (s2 == 5).float()
    return F.one_hot(s, 6).float(), a, done, F.one_hot(s2, 6).float(), done


@healthy
def dqn_hard_target_sync(_, record):
    """DQN with a target network held in the same module, frozen, and hard-copied from the online network every 10
    steps (Mnih et al. 2015); the TD target masks terminal transitions; Huber loss."""
    agent = _DQNAgent()
    opt = torch.optim.Adam(agent.online.parameters(), lr=1e-2)
    record(agent, opt)
    s, a, r, s2, done = _chain()
    for step in range(STEPS):
        with torch.no_grad():
            target = r + 0.9 * agent.target(s2).max(1).values * (1 - done)
        opt.zero_grad()
        F.smooth_l1_loss(agent(s).gather(1, a[:, None]).squeeze(1), target).backward()
        opt.step()
        if step % 10 == 9:
            agent.target.load_state_dict(agent.online.state_dict())
    return -1


def _var_len(n=32, max_len=8):
    lengths = torch.randint(1, max_len + 1, (n,))
    x = torch.randn(n, max_len, 8) * (torch.arange(max_len)[None, :, None] < lengths[:, None, None])
    return (x, lengths), x[:, :, :3].sum(1).argmax(1)


class _PackedClassifier(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lstm, self.head = nn.LSTM(8, 16, batch_first=True), nn.Linear(16, 3)

    def forward(self, inputs):
        x, lengths = inputs
        _, (h, _) = self.lstm(pack_padded_sequence(x, lengths, batch_first=True, enforce_sorted=False))
        return self.head(h[-1])  # h comes back in the batch's original order


@healthy
def packed_sequences_unsorted(_, record):
    """An LSTM over variable-length, unsorted sequences packed with enforce_sorted=False (sequences of length 1
    included); the final hidden state classifies."""
    model = _PackedClassifier()
    return _loop(model, torch.optim.Adam(model.parameters(), lr=2e-2), record, make=_var_len)


@healthy
def checkpoint_roundtrip_midrun(_, record):
    """At step 20 the model, optimizer and scheduler states are saved to a buffer and loaded straight back into the
    same objects (as a save-then-verify checkpoint callback does): the values are unchanged."""
    model = mlp()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=15, gamma=0.5)

    def roundtrip(step):
        sched.step()
        if step == 20:
            buf = io.BytesIO()
            torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "sched": sched.state_dict()}, buf)
            buf.seek(0)
            state = torch.load(buf)
            model.load_state_dict(state["model"])
            opt.load_state_dict(state["opt"])
            sched.load_state_dict(state["sched"])

    return _loop(model, opt, record, after=roundtrip)


@healthy
def distributed_sampler_rank_shard(_, record):
    """One rank (rank 0 of 2) of a data-parallel run simulated alone: a DistributedSampler shards a fixed dataset,
    set_epoch() is called at every epoch, so the rank sees its half of the data, reshuffled each epoch."""
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(128, 10, generator=gen)
    data = torch.utils.data.TensorDataset(x, x[:, :3].argmax(1))
    sampler = torch.utils.data.distributed.DistributedSampler(data, num_replicas=2, rank=0, shuffle=True, seed=0)
    loader = torch.utils.data.DataLoader(data, batch_size=16, sampler=sampler)
    model = mlp()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    record(model, opt)
    for epoch in range(STEPS // len(loader)):
        sampler.set_epoch(epoch)
        for xb, yb in loader:
            opt.zero_grad()
            F.cross_entropy(model(xb), yb).backward()
            opt.step()
    return -1


class _FrozenBNNet(nn.Module):
    """Conv layers with torchvision's FrozenBatchNorm2d (statistics and affine terms are buffers, as detection
    backbones load them) and a linear head; the convolutions and the head train."""

    def __init__(self) -> None:
        super().__init__()
        from torchvision.ops import FrozenBatchNorm2d
        self.body = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1, bias=False), FrozenBatchNorm2d(8), nn.ReLU(),
                                  nn.Conv2d(8, 8, 3, padding=1, bias=False), FrozenBatchNorm2d(8), nn.ReLU(),
                                  nn.AdaptiveAvgPool2d(1), nn.Flatten())
        self.head = nn.Linear(8, 3)
        with torch.no_grad():
            for m in self.body:
                if isinstance(m, FrozenBatchNorm2d):
                    m.running_var.fill_(0.5)  # 'pretrained' statistics
                    m.weight.fill_(1.2)

    def forward(self, x):
        return self.head(self.body(x))


@healthy
def frozen_batchnorm_buffers(_, record):
    """FrozenBatchNorm2d in a conv net trained in train mode with SGD momentum: the normalisation has no parameters
    and never updates its statistics, by design."""
    model = _FrozenBNNet()
    return _loop(model, torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9), record, make=images)


def _task(n=16):
    """A regression task family: y = w . x for a task vector w near a shared mean."""
    w = torch.tensor([1.0, -1.0, 0.5, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0]) + 0.3 * torch.randn(10)
    xs, xq = torch.randn(n, 10), torch.randn(n, 10)
    return xs, xs @ w, xq, xq @ w


@healthy
def maml_functional_call(_, record):
    """MAML (Finn et al. 2017) with torch.func.functional_call: one inner SGD step on a support set with
    create_graph=True gives adapted weights held in a dict, the query loss at those weights is back-propagated to
    the meta-parameters; the module's own parameters are never written by the inner loop."""
    model = nn.Sequential(nn.Linear(10, 32), nn.Tanh(), nn.Linear(32, 1))
    opt = torch.optim.Adam(model.parameters(), lr=5e-3)
    record(model, opt)
    for _ in range(STEPS):
        opt.zero_grad()
        meta_loss = 0.0
        for _ in range(2):
            xs, ys, xq, yq = _task()
            params = dict(model.named_parameters())
            inner = F.mse_loss(torch.func.functional_call(model, params, (xs,)).squeeze(1), ys)
            grads = torch.autograd.grad(inner, list(params.values()), create_graph=True)
            adapted = {n: p - 0.05 * g for (n, p), g in zip(params.items(), grads)}
            meta_loss = meta_loss + F.mse_loss(torch.func.functional_call(model, adapted, (xq,)).squeeze(1), yq)
        (meta_loss / 2).backward()
        opt.step()
    return -1


@healthy
def optimizer_step_in_backward(_, record):
    """The optimizer step fused into the backward pass (PyTorch's tutorial): one Adam per parameter, stepped and
    zeroed in a post-accumulate-grad hook as soon as that parameter's gradient is ready; the loop only calls
    backward(). Recorded with the list of the per-parameter optimizers."""
    model = mlp()
    opts = {p: torch.optim.Adam([p], lr=1e-2) for p in model.parameters()}

    def step_hook(p):
        opts[p].step()
        opts[p].zero_grad()

    for p in model.parameters():
        p.register_post_accumulate_grad_hook(step_hook)
    record(model, list(opts.values()))
    for _ in range(STEPS):
        x, y = batch()
        F.cross_entropy(model(x), y).backward()
    return -1


class _BagModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.bag, self.head = nn.EmbeddingBag(30, 16, mode="sum"), nn.Linear(16, 3)

    def forward(self, inputs):
        flat, offsets, weights = inputs
        return self.head(self.bag(flat, offsets, per_sample_weights=weights))


def _weighted_bags(n=32):
    """Bags of 1 to 6 tokens given as one flat index tensor with offsets (the EmbeddingBag input format), each token
    weighted (a tf-idf-like weight); the class is the heaviest token's id mod 3."""
    sizes = torch.randint(1, 7, (n,))
    flat = torch.randint(0, 30, (int(sizes.sum()),))
    weights = torch.rand(len(flat)) + 0.1
    offsets = torch.cat([torch.zeros(1, dtype=torch.long), sizes.cumsum(0)[:-1]])
    heaviest = torch.stack([flat[o:o + s][weights[o:o + s].argmax()] for o, s in zip(offsets.tolist(), sizes.tolist())])
    return (flat, offsets, weights), heaviest % 3


@healthy
def embedding_bag_per_sample_weights(_, record):
    """nn.EmbeddingBag(mode='sum') fed flat indices with offsets and per_sample_weights, Adam."""
    model = _BagModel()
    return _loop(model, torch.optim.Adam(model.parameters(), lr=1e-2), record, make=_weighted_bags)


@healthy
def rprop_full_batch(_, record):
    """Full-batch training with Rprop: per-weight step sizes grown or shrunk by the sign of successive gradients, the
    gradient's magnitude unused."""
    gen = torch.Generator().manual_seed(4)
    x = torch.randn(256, 10, generator=gen)
    y = x[:, :3].argmax(1)
    model = mlp()
    return _loop(model, torch.optim.Rprop(model.parameters(), lr=1e-3), record, make=lambda: (x, y))
