"""A third held-out set of silent training errors, written blind: each case is our own toy
reconstruction (CPU, well under a second) of a public bug report or widely reported pitfall, in
its buggy and its fixed form, written without reading how the recorder works and without running
it on any case here. ``CASES[name]`` is a ``cases.Case``; ``CAUSES`` maps each cause to the finding
kind that would name it (the kinds table of docs/record.md), decided before anything ran, or to
None where no existing kind names it (such a case counts as cause not named whatever is found).
Every mechanism differs from those of cases.py, cases_invariants.py, cases_heldout.py and
cases_heldout2.py.

Scored with ``score.py --set heldout3``; this registry is separate from the other sets'."""

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
    "group_filtered_while_frozen": "not_in_optimizer",  # a group built from requires_grad while frozen: empty
    "warmup_per_epoch_counter": "lr_zero",  # warm-up driven by the step within the epoch: lr 0 each epoch
    "no_decay_name_mismatch": None,  # a no-decay filter by name that misses the model's norm layers
    "dropout_flag_as_rate": None,  # a boolean flag passed as dropout's p: p=1, everything dropped
    "bn_momentum_convention": None,  # TensorFlow's BatchNorm momentum given to PyTorch: stats = last batch
    "penalty_without_create_graph": None,  # a gradient penalty without create_graph: a constant in the loss
    "checkpoint_silently_skipped": None,  # load_state_dict(strict=False) with prefixed keys: nothing loaded
    "lr_adjust_flattens_groups": None,  # a hand-written lr schedule gives every group the same lr
    "freeze_undone": None,  # a later loop sets requires_grad=True on every parameter, frozen ones too
    "fp16_loss_overflow": "nonfinite_gradient",  # a hand-written softmax in float16 overflows: NaN
    "warmup_stepped_per_epoch": None,  # a warm-up in steps stepped once per epoch: lr stays a fraction
    "class_weight_zero": None,  # a class weight computed as 0: that class gets no loss of its own
    "norm_over_batch_axis": None,  # layer normalisation statistics over the batch axis
    "layer_output_discarded": "no_gradient",  # a block's second layer reads the block input: the first is unused
    "tokens_all_padding": None,  # every token looked up as unknown = the padding index: a zero, frozen embedding
    "hook_detached_features": "no_gradient",  # features taken by a hook that detaches them: the encoder gets nothing
    "replica_grads_unreduced": None,  # replicas that never average their gradients: the copies drift apart
}

CASES: dict[str, Case] = {}


def case(cause: str, url: str, report: str):
    assert cause in CAUSES, cause

    def register(fn):
        CASES[fn.__name__] = Case(fn, cause, url, report)
        return fn
    return register


def _train(model, opt, record, make=batch, loss_fn=F.cross_entropy, steps=STEPS, before=None, after=None, **options):
    record(model, opt, **options)
    for step in range(steps):
        if before is not None:
            before(step)
        x, y = make()
        opt.zero_grad()
        loss_fn(model(x), y).backward()
        opt.step()
        if after is not None:
            after(step)


# -- optimizer and parameter groups --------------------------------------------------------------
@case("group_filtered_while_frozen", "https://github.com/ohhhyeahhh/SiamCAR/issues/18",
      "the backbone's group was built with filter(requires_grad) while the backbone was frozen: it is empty")
def backbone_group_filtered_while_frozen(buggy, record):
    model = mlp()
    body, head = model[0], model[2]
    body.requires_grad_(False)  # frozen for a head warm-up, unfrozen at step 8
    body_params = [p for p in body.parameters() if p.requires_grad] if buggy else list(body.parameters())
    opt = torch.optim.SGD([{"params": body_params, "lr": 0.05}, {"params": list(head.parameters())}], lr=0.1)

    def before(step):
        if step == 8:
            body.requires_grad_(True)
    _train(model, opt, record, before=before)
    return 8


@case("no_decay_name_mismatch", "https://github.com/huggingface/transformers/issues/16908",
      "no_decay = ['bias', 'LayerNorm.weight'] while the module is named layer_norm: its weight is decayed")
def no_decay_names_miss_layer_norm(buggy, record):
    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.dense = nn.Linear(10, 32)
            self.layer_norm = nn.LayerNorm(32)
            self.decoder = nn.Linear(32, 3)

        def forward(self, x):
            return self.decoder(self.layer_norm(F.gelu(self.dense(x))))
    model = Net()
    no_decay = ["bias", "LayerNorm.weight"] if buggy else ["bias", "layer_norm.weight"]
    named = list(model.named_parameters())
    opt = torch.optim.AdamW([
        {"params": [p for n, p in named if not any(nd in n for nd in no_decay)], "weight_decay": 0.5},
        {"params": [p for n, p in named if any(nd in n for nd in no_decay)], "weight_decay": 0.0}], lr=0.01)
    _train(model, opt, record)
    return 0


@case("lr_adjust_flattens_groups", "https://github.com/JUGGHM/PENet_ICRA2021/issues/29",
      "adjust_learning_rate writes one lr into every param group: the backbone's lower lr is lost")
def lr_adjust_overwrites_group_lrs(buggy, record):
    model = mlp()
    base = 0.1
    opt = torch.optim.SGD([{"params": list(model[0].parameters()), "lr": base / 10},
                           {"params": list(model[2].parameters()), "lr": base}], lr=base)
    scale = [g["lr"] / base for g in opt.param_groups]

    def before(step):
        lr = base * 0.95 ** step
        for g, s in zip(opt.param_groups, scale):
            g["lr"] = lr if buggy else lr * s
    _train(model, opt, record, before=before)
    return 0


@case("freeze_undone", "https://github.com/ultralytics/yolov5/issues/1213",
      "layers frozen with requires_grad=False, then a later loop sets requires_grad=True on every parameter")
def freeze_undone_by_later_loop(buggy, record):
    model = mlp()
    freeze = ["0."]
    for name, p in model.named_parameters():
        if any(name.startswith(f) for f in freeze):
            p.requires_grad = False
    for name, p in model.named_parameters():  # the later setup loop
        if buggy or not any(name.startswith(f) for f in freeze):
            p.requires_grad = True
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1, momentum=0.9)
    _train(model, opt, record)
    return 0


# -- schedules -------------------------------------------------------------------------------------
EPOCH = 8  # steps per epoch in the schedule cases


@case("warmup_per_epoch_counter", "https://github.com/Vision-CAIR/MiniGPT-4/pull/263",
      "the warm-up lr is computed from the step within the epoch: it restarts from 0 every epoch")
def warmup_restarts_every_epoch(buggy, record):
    model = mlp()
    base, warm = 0.1, 8
    opt = torch.optim.SGD(model.parameters(), lr=base)

    def before(step):
        i = step % EPOCH if buggy else step
        for g in opt.param_groups:
            g["lr"] = base * min(1.0, i / warm)
    _train(model, opt, record, before=before)
    return EPOCH  # the first epoch is the same in both forms


@case("warmup_stepped_per_epoch", "https://github.com/ace-step/ACE-Step/pull/198",
      "a warm-up counted in steps whose scheduler is stepped once per epoch: the warm-up takes epochs")
def warmup_scheduler_stepped_per_epoch(buggy, record):
    model = mlp()
    warm = 32
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / warm))

    def after(step):
        if not buggy or (step + 1) % EPOCH == 0:
            sched.step()
    _train(model, opt, record, after=after)
    return 1


# -- regularisation and normalisation --------------------------------------------------------------
@case("dropout_flag_as_rate", "https://github.com/diegoantognini/pyGAT/issues/55",
      "a dropout flag True passed where F.dropout takes the rate: p=1 zeroes every activation")
def dropout_flag_passed_as_rate(buggy, record):
    class Net(nn.Module):
        def __init__(self, dropout):
            super().__init__()
            self.fc1, self.fc2 = nn.Linear(10, 32), nn.Linear(32, 3)
            self.dropout = dropout

        def forward(self, x):
            return self.fc2(F.dropout(F.relu(self.fc1(x)), self.dropout, training=self.training))
    model = Net(True if buggy else 0.2)
    _train(model, torch.optim.SGD(model.parameters(), lr=0.1), record)
    return 0


@case("bn_momentum_convention", "https://github.com/kazuto1011/deeplab-pytorch/issues/79",
      "BatchNorm momentum 0.99 in TensorFlow's sense given to PyTorch: running stats are about the last batch")
def bn_momentum_tensorflow_convention(buggy, record):
    model = mlp(bn=True)
    model[1].momentum = 0.99 if buggy else 0.01
    model[1].register_forward_pre_hook(lambda m, a: setattr(m, "last_batch_mean", a[0].detach().mean(0)))
    _train(model, torch.optim.SGD(model.parameters(), lr=0.05), record)
    return 0


@case("norm_over_batch_axis", "https://github.com/GokuMohandas/fast-weights/issues/9",
      "a hand-written layer norm takes its mean and deviation over the batch axis, not the features")
def layer_norm_over_batch_axis(buggy, record):
    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc1, self.fc2 = nn.Linear(10, 32), nn.Linear(32, 3)
            self.gain, self.bias = nn.Parameter(torch.ones(32)), nn.Parameter(torch.zeros(32))

        def forward(self, x):
            h = self.fc1(x)
            dim = 0 if buggy else -1
            h = (h - h.mean(dim, keepdim=True)) / (h.var(dim, keepdim=True, unbiased=False) + 1e-5).sqrt()
            return self.fc2(F.relu(h * self.gain + self.bias))
    model = Net()
    _train(model, torch.optim.SGD(model.parameters(), lr=0.1), record)
    return 0


# -- gradient flow ----------------------------------------------------------------------------------
_PENALTY = 1.0  # the penalty's weight (check_heldout3.py compares with 0)


@case("penalty_without_create_graph", "https://github.com/facebookresearch/DomainBed/issues/50",
      "a penalty on per-environment gradients from autograd.grad without create_graph: it trains nothing")
def penalty_gradient_without_create_graph(buggy, record):
    model = mlp(hidden=16)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    record(model, opt)
    params = list(model.parameters())
    for _ in range(STEPS):
        envs = [batch(16), batch(16)]
        losses = [F.cross_entropy(model(x), y) for x, y in envs]
        grads = [torch.autograd.grad(loss, params, retain_graph=True, create_graph=not buggy) for loss in losses]
        mean = sum(losses) / 2
        penalty = sum((a - b).pow(2).sum() for a, b in zip(*grads))
        opt.zero_grad()
        (mean + _PENALTY * penalty).backward()
        opt.step()
    return 0


class _Block(nn.Module):
    def __init__(self, buggy):
        super().__init__()
        self.res1, self.res2, self.buggy = nn.Linear(32, 32), nn.Linear(32, 32), buggy

    def forward(self, x):
        h = F.leaky_relu(self.res1(x))
        h = self.res2(x if self.buggy else h)  # the second layer should read h
        return F.leaky_relu(h + x)


@case("layer_output_discarded", "https://github.com/shaohua0116/Multiview2Novelview/issues/11",
      "a residual block's second convolution reads the block input, so the first one's output is thrown away")
def residual_layer_reads_block_input(buggy, record):
    model = nn.Sequential(nn.Linear(10, 32), _Block(buggy), nn.Linear(32, 3))
    _train(model, torch.optim.SGD(model.parameters(), lr=0.1), record)
    return 0


@case("hook_detached_features", "https://github.com/lucidrains/CoCa-pytorch/issues/6",
      "an extractor's forward hook keeps a detached clone of the encoder output: no gradient reaches the encoder")
def feature_hook_detaches_encoder(buggy, record):
    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.encoder = nn.Sequential(nn.Linear(10, 32), nn.ReLU(), nn.Linear(32, 16))
            self.head = nn.Linear(16, 3)
            self.captured = None
            self.encoder.register_forward_hook(self._keep)

        def _keep(self, module, args, out):
            self.captured = out.clone().detach() if buggy else out

        def forward(self, x):
            self.encoder(x)
            return self.head(self.captured)
    model = Net()
    _train(model, torch.optim.SGD(model.parameters(), lr=0.1), record)
    return 0


_WORDS = [f"w{i}" for i in range(40)]


def _sentences(n: int = 32, length: int = 6):
    ids = torch.randint(0, len(_WORDS), (n, length))
    return [[_WORDS[i].upper() for i in row] for row in ids.tolist()], ids[:, 0] % 3  # raw text is upper case


@case("tokens_all_padding", "https://github.com/pytorch/text/issues/165",
      "unknown words and padding share index 0 and every word misses the vocabulary: all inputs are padding")
def unknown_tokens_mapped_to_padding_index(buggy, record):
    vocab = {w: i + 1 for i, w in enumerate(_WORDS)}  # 0 is <pad> and, through .get, <unk>

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = nn.Embedding(len(_WORDS) + 1, 16, padding_idx=0)
            self.head = nn.Linear(16 * 6, 3)

        def forward(self, ids):
            return self.head(self.embed(ids).flatten(1))
    model = Net()

    def make():
        words, y = _sentences()
        ids = [[vocab.get(w if buggy else w.lower(), 0) for w in row] for row in words]
        return torch.tensor(ids), y
    _train(model, torch.optim.SGD(model.parameters(), lr=0.5), record, make=make)
    return 0


# -- mixed precision ----------------------------------------------------------------------------------
@case("fp16_loss_overflow", "https://github.com/pytorch/pytorch/issues/29429",
      "a loss computed in float16 overflows its range (65504): NaN loss and gradients")
def half_precision_softmax_overflow(buggy, record):
    model = mlp().half()
    temperature = 0.05

    def loss_fn(logits, y):
        z = logits / temperature
        if buggy:  # a hand-written softmax cross-entropy, kept in float16
            p = z.exp()
            return -(p.gather(1, y[:, None]).squeeze(1) / p.sum(1)).log().mean()
        return F.cross_entropy(z.float(), y)
    _train(model, torch.optim.SGD(model.parameters(), lr=0.01), record,
           make=lambda: (lambda x, y: (x.half(), y))(*batch()), loss_fn=loss_fn)
    return 0


# -- loss side ---------------------------------------------------------------------------------------
@case("class_weight_zero", "https://github.com/longcw/faster_rcnn_pytorch/issues/53",
      "a class weight computed as a ratio of counts comes out 0: the background class gets no loss")
def background_class_weight_zero(buggy, record):
    model = mlp()
    x0, y0 = batch(256)
    counted = y0 == (3 if buggy else 0)  # buggy: counts a label id the data never uses
    weight = torch.ones(3)
    weight[0] = float(counted.sum()) / float((y0 != 0).sum()) * 2
    _train(model, torch.optim.SGD(model.parameters(), lr=0.1), record,
           loss_fn=lambda out, y: F.cross_entropy(out, y, weight=weight))
    return 0


# -- loading -----------------------------------------------------------------------------------------
def pretrained_state() -> dict:
    """The checkpoint the fine-tuning cases load: a Lightning-style wrapper's state, keys 'model.'."""
    with torch.random.fork_rng():
        torch.manual_seed(123)
        wrapper = nn.Module()
        wrapper.model = mlp()
        return copy.deepcopy(wrapper.state_dict())


@case("checkpoint_silently_skipped", "https://github.com/pytorch/examples/issues/1029",
      "load_state_dict(strict=False) with keys carrying a 'model.' prefix: no weight loaded, no error")
def checkpoint_prefix_strict_false(buggy, record):
    model = mlp()
    state = pretrained_state()
    if not buggy:
        state = {k.removeprefix("model."): v for k, v in state.items()}
    model.load_state_dict(state, strict=False)
    _train(model, torch.optim.SGD(model.parameters(), lr=0.05), record)
    return 0


# -- data parallel without processes -----------------------------------------------------------------
@case("replica_grads_unreduced", "https://github.com/pytorch/examples/issues/483",
      "replicas that start equal but never average their gradients: each trains on its shard and they drift")
def replicas_gradients_never_reduced(buggy, record):
    replicas = [mlp()]
    replicas.append(copy.deepcopy(replicas[0]))
    opts = [torch.optim.SGD(r.parameters(), lr=0.1) for r in replicas]
    for r, o in zip(replicas, opts):
        record(r, o)
    for _ in range(STEPS):
        x, y = batch(32)
        for k, (r, o) in enumerate(zip(replicas, opts)):
            o.zero_grad()
            F.cross_entropy(r(x[k::2]), y[k::2]).backward()
        if not buggy:
            with torch.no_grad():
                for ps in zip(*(r.parameters() for r in replicas)):
                    mean = sum(p.grad for p in ps) / len(ps)
                    for p in ps:
                        p.grad.copy_(mean)
        for o in opts:
            o.step()
    return 0
