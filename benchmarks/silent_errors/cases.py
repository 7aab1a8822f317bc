"""Silent training errors from public bug reports, each reconstructed (our own code, at toy
scale, on CPU) in its buggy and its fixed form. ``CASES[name]`` is a ``Case``: the function
(``case(buggy, record) -> the first step the bug acts``), the cause the report established,
and the report's address. The loops are the reports' loops cut down to what the bug needs."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F
from harness import STEPS, SmallCNN, batch, images, mlp, sgd_steps
from torch import nn

# The cause a report established -> the finding kind that names it.
CAUSES = {
    "accumulation": "stale_gradient",  # .grad never zeroed: steps use the running sum
    "optimizer_membership": "not_in_optimizer",  # a trainable tensor the optimizer never got
    "stale_optimizer": "stale_optimizer_param",  # modules replaced after the optimizer was built
    "lr_zero": "lr_zero",  # a schedule that brings the rate to 0 while training goes on
    "eval_mode": "eval_mode",  # dropout/BatchNorm left in eval mode during training
    "frozen_bn": "frozen_norm_drift",  # requires_grad=False does not freeze BatchNorm statistics
    "loss_scale": "loss_scale_backoff",  # a non-finite loss the GradScaler keeps skipping
    "nonfinite": "nonfinite_gradient",  # an operation whose derivative is NaN at the point used
    "graph_cut": "no_gradient",  # the loss reaches a network through .item()/.detach()
    "unused": "no_gradient",  # a layer built in __init__ that forward never calls
    "weights_swapped": "changed_between_steps",  # an EMA/averaged copy loaded and not restored
    "weights_edited": "changed_between_steps",  # an evaluation or export helper that edits weights in place
    "frozen_moving": "frozen_moved",  # momentum or weight decay on a frozen tensor with a zero .grad
    "accumulation_reset": "grad_reset_in_step",  # zero_grad inside the micro-batch loop of an accumulated step
    "eval_mode_functional": "eval_mode",  # eval() left on where dropout is functional (no nn.Dropout)
    "zero_grad_misplaced": "grad_modified",  # gradients zeroed or clipped to zero between backward and step
}


@dataclass(frozen=True)
class Case:
    run: Callable[[bool, Callable], int]
    cause: str
    url: str
    report: str  # what the report established, in a line


CASES: dict[str, Case] = {}


def case(cause: str, url: str, report: str):
    def register(fn):
        CASES[fn.__name__] = Case(fn, cause, url, report)
        return fn
    return register


# -- accumulation ----------------------------------------------------------------------------
@case("accumulation", "https://github.com/IBM/aihwkit/issues/446",
      "the examples never call opt.zero_grad(): the loss falls, then rises again")
def aihwkit_missing_zero_grad(buggy, record):
    model = nn.Linear(4, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    record(model, opt)
    target = torch.randn(4, 2)
    for _ in range(STEPS):
        x = torch.randn(8, 4)
        if not buggy:
            opt.zero_grad()
        F.mse_loss(model(x), x @ target).backward()
        opt.step()
    return 1  # step 1 is the first to carry step 0's gradient


class LoRALinear(nn.Module):
    """A frozen linear layer plus a trainable low-rank update B @ A, B initialised to zero
    (Hu et al. 2021, Sec. 4.1)."""

    def __init__(self, dim: int = 16, rank: int = 4) -> None:
        super().__init__()
        self.base = nn.Linear(dim, dim).requires_grad_(False)
        self.lora_a, self.lora_b = nn.Linear(dim, rank, bias=False), nn.Linear(rank, dim, bias=False)
        nn.init.zeros_(self.lora_b.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.base(x) + self.lora_b(self.lora_a(x))


@case("accumulation", "https://github.com/tenstorrent/tt-blacksmith/pull/711",
      "the LoRA trainer forgot optimizer.zero_grad() after each optimizer step")
def lora_trainer_missing_zero_grad(buggy, record):
    model = LoRALinear()
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    record(model, opt)
    for _ in range(STEPS):
        x = torch.randn(8, 16)
        F.mse_loss(model(x), x.flip(1)).backward()
        opt.step()
        if not buggy:
            opt.zero_grad()
    return 1


@case("accumulation", "https://github.com/greebear/pytorch-learning/issues/1",
      "the hand-written SGD update never zeroes w.grad and b.grad, so the loss does not decrease")
def manual_sgd_grad_not_zeroed(buggy, record):
    model = nn.Linear(3, 1)
    rec = record(model, None, hooks=False)
    w_true = torch.randn(3, 1)
    for _ in range(STEPS):
        x = torch.randn(16, 3)
        rec.begin()
        F.mse_loss(model(x), x @ w_true).backward()
        rec.before_step()
        with torch.no_grad():
            for p in model.parameters():
                p -= 0.05 * p.grad
                if not buggy:
                    p.grad.zero_()
        rec.after_step()
    return 1


@case("accumulation", "https://github.com/Hsintien-Ng/idinvert_pytorch-reproduced/issues/1",
      "optimizer_D.zero_grad() was missing before the discriminator's backward")
def gan_discriminator_missing_zero_grad(buggy, record):
    gen, disc = mlp(4, 16, 8), mlp(8, 16, 1)
    opt_g, opt_d = torch.optim.Adam(gen.parameters(), 1e-3), torch.optim.Adam(disc.parameters(), 1e-3)
    record(disc, opt_d)
    for _ in range(STEPS):
        real, z = torch.randn(16, 8) + 2, torch.randn(16, 4)
        fake = gen(z)
        if not buggy:
            opt_d.zero_grad()
        ones, zeros = torch.ones(16, 1), torch.zeros(16, 1)
        d_loss = (F.binary_cross_entropy_with_logits(disc(real), ones)
                  + F.binary_cross_entropy_with_logits(disc(fake.detach()), zeros))
        d_loss.backward()
        opt_d.step()
        opt_g.zero_grad()
        F.binary_cross_entropy_with_logits(disc(fake), ones).backward()
        opt_g.step()
    return 1


# -- optimizer membership and stale optimizers ------------------------------------------------
@case("optimizer_membership", "https://github.com/ifzhang/FairMOT/issues/125",
      "the re-ID classifier's parameters were never given to the optimizer, so it was not optimized")
def classifier_left_out_of_optimizer(buggy, record):
    class ReID(nn.Module):
        def __init__(self):
            super().__init__()
            self.backbone, self.classifier = mlp(10, 32, 16), nn.Linear(16, 3)

        def forward(self, x):
            return self.classifier(F.relu(self.backbone(x)))

    model = ReID()
    params = model.backbone.parameters() if buggy else model.parameters()
    opt = torch.optim.SGD(params, lr=0.1)
    record(model, opt)
    sgd_steps(model, opt)
    return 0


@case("stale_optimizer", "https://github.com/microsoft/nni/issues/4521",
      "speedup replaced the pruned layers with smaller ones; the optimizer still held the old parameters")
def pruned_layers_replaced_after_optimizer(buggy, record):
    model = mlp(10, 32)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    small = mlp(10, 24)  # the "speedup": layers 0 and 2 replaced by smaller ones
    model[0], model[2] = small[0], small[2]
    if not buggy:
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    record(model, opt)
    sgd_steps(model, opt)
    return 0


@case("stale_optimizer", "https://github.com/pytorch/pytorch/issues/54765",
      "the network was rebuilt (net1 = Net2()) without re-creating the optimizer")
def network_rebuilt_optimizer_kept(buggy, record):
    net = mlp(10, 32)
    opt = torch.optim.Adam(net.parameters(), lr=1e-3)
    net = mlp(10, 48)
    if not buggy:
        opt = torch.optim.Adam(net.parameters(), lr=1e-3)
    record(net, opt)
    for _ in range(STEPS):  # the optimizer's own zero_grad no longer reaches the new net
        x, y = batch()
        opt.zero_grad()
        net.zero_grad()
        F.cross_entropy(net(x), y).backward()
        opt.step()
    return 0


# -- learning rates that reach 0 --------------------------------------------------------------
@case("lr_zero", "https://github.com/deepset-ai/FARM/issues/46",
      "the schedule's total steps were computed too small: the learning-rate multiplier is 0 for the last steps")
def linear_schedule_total_too_small(buggy, record):
    model = mlp()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    total = 20 if buggy else STEPS  # 'steps per epoch' rounded down, times too few epochs
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: max(0.0, 1 - s / total))
    record(model, opt)
    sgd_steps(model, opt, each=lambda s: sched.step() if s else None)
    return total if buggy else -1


@case("lr_zero", "https://github.com/ivadomed/ivadomed/pull/55",
      "a per-epoch scheduler was stepped in the batch loop: it ran its whole course within the first epochs")
def epoch_scheduler_stepped_per_batch(buggy, record):
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    epochs, batches = 10, 4
    sched = torch.optim.lr_scheduler.PolynomialLR(opt, total_iters=epochs, power=1.0)
    record(model, opt)
    for _epoch in range(epochs):
        for _ in range(batches):
            x, y = batch()
            opt.zero_grad()
            F.cross_entropy(model(x), y).backward()
            opt.step()
            if buggy:
                sched.step()
        if not buggy:
            sched.step()
    return epochs  # the rate is 0 from step `epochs` on


# -- modes ----------------------------------------------------------------------------------
def _train_with_validation(buggy: bool, record, validate_at: int, model: nn.Module, restore) -> int:
    """Train; validate once at step ``validate_at`` (model.eval() under no_grad); the fixed
    loop calls ``restore(model)`` afterwards, the buggy one does not."""
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    record(model, opt)
    model.train()
    for step in range(STEPS):
        if step == validate_at:
            model.eval()
            with torch.no_grad():
                model(batch()[0])
            if not buggy:
                restore(model)
        x, y = batch()
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        opt.step()
    return validate_at


@case("eval_mode", "https://github.com/shubhamagarwal92/mmd/issues/14",
      "evaluate() sets model.eval() and nothing sets model.train() again: dropout is off from then on")
def evaluate_never_restores_train(buggy, record):
    return _train_with_validation(buggy, record, 10, mlp(dropout=0.3), lambda m: m.train())


@case("eval_mode", "https://github.com/fartashf/vsepp/issues/4",
      "validate() stops BatchNorm and dropout and train_start() is only called at the next epoch")
def validation_mid_epoch_leaves_eval(buggy, record):
    return _train_with_validation(buggy, record, 20, mlp(dropout=0.2, bn=True), lambda m: m.train())


@case("eval_mode", "https://github.com/wkentaro/pytorch-fcn/issues/57",
      "the trainer validates inside train_epoch and does not set self.model.train() again afterwards")
def trainer_validate_inside_epoch(buggy, record):
    class Encoder(nn.Module):  # only the encoder's submodule is put in eval by the validation hook
        def __init__(self):
            super().__init__()
            self.features, self.drop, self.out = nn.Linear(10, 32), nn.Dropout(0.3), nn.Linear(32, 3)

        def forward(self, x):
            return self.out(self.drop(F.relu(self.features(x))))

    model = Encoder()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    record(model, opt)
    for step in range(STEPS):
        if step == 12:
            model.drop.eval()  # the validation helper switches the module it runs
            if not buggy:
                model.drop.train()
        x, y = batch()
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        opt.step()
    return 12


# -- frozen BatchNorm whose statistics still move ----------------------------------------------
def _finetune_frozen_backbone(buggy: bool, record) -> int:
    model = SmallCNN()
    model.backbone.requires_grad_(False)  # "frozen" by requires_grad alone
    opt = torch.optim.SGD(model.head.parameters(), lr=0.05)
    record(model, opt)
    for _ in range(STEPS):
        model.train()
        if not buggy:  # what the fixes do: frozen BatchNorm layers in eval mode
            for m in model.backbone.modules():
                if isinstance(m, nn.BatchNorm2d):
                    m.eval()
        x, y = images()
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        opt.step()
    return 0


@case("frozen_bn", "https://github.com/Lightning-AI/pytorch-lightning/issues/15062",
      "BaseFinetuning.freeze(train_bn=False) froze BatchNorm weights but running_mean/var kept changing")
def lightning_freeze_bn_stats_drift(buggy, record):
    return _finetune_frozen_backbone(buggy, record)


@case("frozen_bn", "https://github.com/chemprop/chemprop/pull/952",
      "BatchNorm was frozen by gradients alone, which does not freeze its running statistics; fixed with bn.eval()")
def chemprop_bn_frozen_by_grad_only(buggy, record):
    model = nn.Sequential(nn.Linear(10, 32), nn.BatchNorm1d(32), nn.ReLU(), nn.Linear(32, 3))
    model[1].requires_grad_(False)
    opt = torch.optim.Adam([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    record(model, opt)
    for _ in range(STEPS):
        model.train()
        if not buggy:
            model[1].eval()
        x, y = batch()
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        opt.step()
    return 0


@case("frozen_bn", "https://discuss.pytorch.org/t/what-does-requires-grad-false-on-batchnorm2d-perform/137904",
      "only the last layer was fine-tuned (requires_grad=False elsewhere), yet BatchNorm outputs changed: "
      "running stats update in train mode")
def forum_finetune_last_layer_bn_changes(buggy, record):
    return _finetune_frozen_backbone(buggy, record)


# -- a loss scale that backs off for ever ------------------------------------------------------
def _scaled_training(buggy: bool, record, loss_of) -> int:
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    scaler = torch.amp.GradScaler("cpu")
    record(model, opt, scaler=scaler)
    for _ in range(STEPS):
        x, y = batch()
        opt.zero_grad()
        scaler.scale(loss_of(model(x), y, buggy)).backward()
        scaler.step(opt)
        scaler.update()
    return 0


@case("loss_scale", "https://github.com/lucidrains/stylegan2-pytorch/issues/100",
      "with amp the loss scale is reduced on every step (Gradient overflow, skipping step) down to tiny values")
def amp_scale_reduced_every_step(buggy, record):
    def loss_of(out, y, buggy):  # a penalty on an exp of unbounded logits: it overflows to inf
        penalty = (out.abs().sum(1) * 100).exp().mean() * 1e-30 if buggy else out.pow(2).mean() * 1e-3
        return F.cross_entropy(out, y) + penalty
    return _scaled_training(buggy, record, loss_of)


@case("loss_scale", "https://github.com/dbolya/yolact/issues/359",
      "'Moving average ignored a value of inf', then 'Gradient overflow. Skipping step' with the loss scale "
      "falling to 1e-5: an infinite loss term")
def inf_loss_term_scale_collapses(buggy, record):
    def loss_of(out, y, buggy):  # log of a probability that is exactly 0 for one class
        probs = F.softmax(out, 1) * torch.tensor([1.0, 1.0, 0.0]) if buggy else F.softmax(out, 1)
        return F.nll_loss(torch.log(probs + (0.0 if buggy else 1e-8)), y)
    return _scaled_training(buggy, record, loss_of)


# -- non-finite gradients -----------------------------------------------------------------------
def _embedding_loss(buggy: bool, record, penalty) -> int:
    model = mlp(10, 32, 8)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    record(model, opt)
    for _ in range(STEPS):
        x, y = batch()
        opt.zero_grad()
        emb = model(x)
        loss = F.cross_entropy(emb[:, :3], y) + 0.01 * penalty(emb, buggy)
        loss.backward()
        opt.step()
    return 0


@case("nonfinite", "https://github.com/pytorch/pytorch/issues/2421",
      "the gradient of a norm at zero is NaN, which propagates into every update")
def norm_at_zero_nan_gradient(buggy, record):
    def penalty(emb, buggy):  # the distance of each embedding to itself after a no-op: zero
        diff = emb - emb.detach().clone() * (1.0 if buggy else 0.0)
        return (diff.pow(2).sum(1).sqrt() if buggy else diff.norm(dim=1)).mean()
    return _embedding_loss(buggy, record, penalty)


@case("nonfinite", "https://github.com/pytorch/pytorch/issues/52248",
      "torch.where does not shield the gradient from its unselected branch: 0 x inf there is NaN")
def where_unselected_branch_nan(buggy, record):
    def penalty(emb, buggy):  # a 'safe' sqrt that is only selected where its argument is positive
        safe = emb if buggy else emb.clamp_min(1e-6)
        return torch.where(emb > 0, safe.sqrt(), torch.zeros_like(emb)).mean()
    return _embedding_loss(buggy, record, penalty)


@case("nonfinite", "https://github.com/richzhang/PerceptualSimilarity/issues/69",
      "Function 'SqrtBackward' returned nan values: sqrt of a sum of squares that is 0 for some features")
def sqrt_of_zero_feature_norm(buggy, record):
    def penalty(emb, buggy):  # normalise features by their norm; a ReLU'd feature map can be all zero
        feat = emb * 0.0  # an all-zero feature map (a dead channel)
        norm = torch.sqrt((feat ** 2).sum(1, keepdim=True) + (0.0 if buggy else 1e-10))
        return (feat / (norm + 1e-10)).sum()
    return _embedding_loss(buggy, record, penalty)


# -- graph cuts and unused layers ----------------------------------------------------------------
@case("graph_cut", "https://github.com/isayev/ReLeaSE/issues/39",
      "log_probs[...].item() in the policy loss detached it from the graph: the generator's grads are None")
def policy_loss_from_item(buggy, record):
    policy, value = mlp(10, 32, 4), nn.Linear(10, 1)
    model = nn.ModuleDict({"policy": policy, "value": value})
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    rec = record(model, opt, hooks=False)
    for _ in range(STEPS):
        x = torch.randn(16, 10)
        rec.begin()
        log_probs = F.log_softmax(policy(x), 1)
        actions = log_probs.argmax(1)
        reward = torch.randn(16)
        chosen = log_probs[torch.arange(16), actions]
        baseline = value(x).squeeze(1)
        if buggy:
            chosen = torch.tensor([c.item() for c in chosen])  # the report's .item() rebuild
        loss = -(chosen * (reward - baseline.detach())).mean() + F.mse_loss(baseline, reward)
        opt.zero_grad()
        loss.backward()
        rec.before_step()
        opt.step()
        rec.after_step()
    return 0


class _Segmenter(nn.Module):
    def __init__(self, use_all: bool) -> None:
        super().__init__()
        self.use_all = use_all
        self.encoder, self.skip = nn.Linear(10, 32), nn.Linear(10, 32)  # skip: built, then forgotten
        self.decoder = nn.Linear(32, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = F.relu(self.encoder(x))
        if self.use_all:
            h = h + self.skip(x)
        return self.decoder(h)


@case("unused", "https://github.com/ImprintLab/MedSegDiff/issues/27",
      "a parameterised layer defined in __init__ but not used in forward (DDP: parameters not used in producing loss)")
def layer_defined_not_used(buggy, record):
    model = _Segmenter(use_all=not buggy)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    record(model, opt)
    sgd_steps(model, opt)
    return 0


@case("unused", "https://github.com/megvii-research/AnchorDETR/issues/6",
      "the transformer built layers whose outputs never reach the loss; deleting them fixed the unused parameters")
def transformer_unused_projection(buggy, record):
    class Decoder(nn.Module):
        def __init__(self):
            super().__init__()
            self.layer = nn.TransformerEncoderLayer(16, 2, 32, dropout=0.0, batch_first=True)
            self.ref_point = nn.Linear(16, 2) if buggy else None  # its output is computed and dropped
            self.head = nn.Linear(16, 3)

        def forward(self, x):
            h = self.layer(x)
            if self.ref_point is not None:
                self.ref_point(h)
            return self.head(h.mean(1))  # the fix deletes the layer

    model = Decoder()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    record(model, opt)
    sgd_steps(model, opt, make=lambda: (torch.randn(8, 5, 16), torch.randint(0, 3, (8,))))
    return 0


import cases_invariants  # noqa: E402,F401  - registers the invariants' cases
