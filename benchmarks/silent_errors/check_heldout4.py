"""Checks that the fourth held-out set's cases hold their bugs, without the recorder:

    python benchmarks/silent_errors/check_heldout4.py

Every case (cases_heldout4.py) runs in both forms, and every healthy loop (healthy_heldout4.py)
once, with the stand-in recorder of stub_check.py, which keeps references to the model and
optimizers and each step's largest gradient entry, whether it is finite and the lrs; it records
nothing and checks nothing of gradrepro's. Per case, a line says whether the buggy form shows its
bug and the fixed form does not, with the numbers; a healthy loop must run, stay finite and train.
Exit status 1 if any check fails."""

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from cases_heldout4 import CASES  # noqa: E402
from harness import batch  # noqa: E402
from healthy_heldout4 import HEALTHY  # noqa: E402
from stub_check import CHECKS, check_all, check_of, moved, trained_on_held_aside  # noqa: E402


def _eval_loss(model, make=None, loss_fn=torch.nn.functional.cross_entropy):
    torch.manual_seed(123)
    x, y = (make or (lambda: batch(512)))()
    model.eval()
    with torch.no_grad():
        return float(loss_fn(model(x), y))


@check_of("parameter_unwrapped_by_data")
def _scaled(b, f):
    rb = "scale" in dict(b[0].model.named_parameters())
    sb = float((b[0].model.scale.detach() - 2).abs().max())
    mf = moved(f[0], "scale")
    return not rb and sb == 0 and mf > 0, \
        f"scale registered: buggy {rb}; scale moved: buggy {sb:.3g}, fixed {mf:.3g}"


@check_of("default_argument_module_shared")
def _shared(b, f):
    shb = b[0].model.head_a.proj is b[0].model.head_b.proj
    shf = f[0].model.head_a.proj is f[0].model.head_b.proj
    from cases_heldout4 import _two_task_batch

    def loss(out, y):
        ce = torch.nn.functional.cross_entropy
        return ce(out[:, 0], y[:, 0]) + ce(out[:, 1], y[:, 1])
    lb = _eval_loss(b[0].model, lambda: _two_task_batch(512), loss)
    lf = _eval_loss(f[0].model, lambda: _two_task_batch(512), loss)
    return shb and not shf and lb > lf, \
        f"heads share a layer: buggy {shb}, fixed {shf}; loss buggy {lb:.3f}, fixed {lf:.3f}"


@check_of("plateau_mode_min_on_accuracy")
def _plateau(b, f):
    lb, lf = [s["lrs"][0] for s in b[0].steps], [s["lrs"][0] for s in f[0].steps]
    first = next((i for i, v in enumerate(lb) if v != lb[0]), None)
    return lb[-1] < lf[-1] / 8 and first == 8, \
        f"final lr: buggy {lb[-1]:.3g}, fixed {lf[-1]:.3g}; buggy lr first cut at step {first}"


@check_of("lambda_returns_absolute_lr")
def _lambda(b, f):
    lb, lf = b[0].steps[0]["lrs"][0], f[0].steps[0]["lrs"][0]
    mb, mf = moved(b[0], "0.weight"), moved(f[0], "0.weight")
    return lb < lf / 100 and mb < mf / 10, f"lr at step 0: buggy {lb:.3g}, fixed {lf:.3g}; moved {mb:.3g} / {mf:.3g}"


@check_of("argmax_gate")
def _argmax(b, f):
    mb, mf = moved(b[0], "gate.weight"), moved(f[0], "gate.weight")
    gnone = b[0].model.gate.weight.grad is None
    return mb == 0 and mf > 0 and gnone, f"gate.weight moved: buggy {mb:.3g}, fixed {mf:.3g}; buggy .grad None: {gnone}"


@check_of("freeze_by_comparison")
def _freeze(b, f):
    mb, mf = moved(b[0], "0.weight"), moved(f[0], "0.weight")
    return mb > 0 and mf == 0, f"layer meant frozen moved: buggy {mb:.3g}, fixed {mf:.3g}"


@check_of("keep_prob_as_rate")
def _keep_prob(b, f):
    pb, pf = b[0].model[2].p, f[0].model[2].p
    lb, lf = _eval_loss(b[0].model), _eval_loss(f[0].model)
    return pb == 0.9 and abs(pf - 0.1) < 1e-9 and lb > lf, \
        f"dropout p: buggy {pb}, fixed {pf:.2g}; loss {lb:.3f} / {lf:.3f}"


@check_of("batchnorm_over_positions")
def _bn_positions(b, f):
    def channel_mean(e, buggy):
        from cases_heldout4 import _sequences
        torch.manual_seed(9)
        x, _ = _sequences(64)
        m = e.model
        m.train()
        with torch.no_grad():
            out = m.normed(x)  # N x L x C; undo the affine part along the axis the norm treated as channels
            w, bias = (m.norm.weight[None, :, None], m.norm.bias[None, :, None]) if buggy else \
                (m.norm.weight, m.norm.bias)
            return float(((out - bias) / w).mean((0, 1)).abs().max())
    cb, cf = channel_mean(b[0], True), channel_mean(f[0], False)
    return cb > 1e-2 and cf < 1e-4, f"max |per-channel mean after the normalisation|: buggy {cb:.3g}, fixed {cf:.3g}"


@check_of("fp16_gradient_underflow")
def _fp16(b, f):
    mb, mf = moved(b[0], "0.weight"), moved(f[0], "0.weight")
    gb = float(b[0].model[0].weight.grad.float().abs().max())
    gf = float(f[0].model[0].weight.grad.abs().max())
    mhb = moved(b[0], "12.weight")
    return mb == 0 and gb == 0 and gf > 0 and mf > 0 and mhb > 0, \
        f"first layer |grad| max at the end: buggy {gb:.3g}, fixed {gf:.3g}; moved: buggy {mb:.3g}, " \
        f"fixed {mf:.3g}; buggy last layer moved {mhb:.3g}"


@check_of("zero_grad_on_submodule")
def _zero_sub(b, f):
    gb, gf = float(b[0].model[0].weight.grad.norm()), float(f[0].model[0].weight.grad.norm())
    hb, hf = float(b[0].model[-1].weight.grad.norm()), float(f[0].model[-1].weight.grad.norm())
    return gb > 3 * gf and hb < 3 * hf, \
        f"body grad norm at the end: buggy {gb:.3g}, fixed {gf:.3g}; head {hb:.3g} / {hf:.3g}"


@check_of("reinitialised_every_step")
def _reinit(b, f):
    lb, lf = _eval_loss(b[0].model), _eval_loss(f[0].model)
    return lb > lf + 0.2, f"held-aside loss at the end: buggy {lb:.3f}, fixed {lf:.3f}"


@check_of("soft_targets_cast_to_long")
def _soft(b, f):
    from cases_heldout4 import _soft_targets
    torch.manual_seed(3)
    _, yb = _soft_targets(512, buggy=True)
    torch.manual_seed(3)
    x, yf = _soft_targets(512, buggy=False)
    with torch.no_grad():
        pb, pf = float(torch.sigmoid(b[0].model(x)).mean()), float(torch.sigmoid(f[0].model(x)).mean())
    return float(yb.sum()) == 0 and pb < 0.2 and pf > 0.3, \
        f"buggy targets sum {float(yb.sum())} (true mean {float(yf.mean()):.3f}); mean prediction buggy" \
        f" {pb:.3f}, fixed {pf:.3f}"


# Healthy loops whose model maps harness.batch()'s inputs (N x 10) to 3 logits: their loss on a
# fixed held-aside batch must fall from the initial weights to the final ones. The CNN is checked
# to move and stay finite.
CLASSIFIERS = {"annealed_gradient_noise", "lookahead_slow_weights", "gumbel_straight_through_routing",
               "sequential_warmup_then_cosine", "focal_loss", "frozen_random_features_readout",
               "adam_maximize_negative_loss", "orthogonal_parametrized_layer"}


def main():
    return check_all(CASES, HEALTHY, CHECKS, trained_on_held_aside(dict.fromkeys(CLASSIFIERS)))


if __name__ == "__main__":
    sys.exit(main())
