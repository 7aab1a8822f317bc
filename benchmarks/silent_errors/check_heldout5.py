"""Checks that the fifth held-out set's cases hold their bugs, without the recorder:

    python benchmarks/silent_errors/check_heldout5.py

Every case (cases_heldout5.py) runs in both forms, and every healthy loop (healthy_heldout5.py)
once, with the stand-in recorder of stub_check.py, which keeps references to the model and
optimizers and each step's largest gradient entry, whether it is finite and the lrs; it records
nothing and checks nothing of gradrepro's. Per case, a line says whether the buggy form shows its
bug and the fixed form does not, with the numbers; a healthy loop must run, stay finite and train.
Exit status 1 if any check fails."""

import copy
import sys
import warnings
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
import cases_heldout5 as c5  # noqa: E402
import healthy_heldout5 as h5  # noqa: E402
from cases_heldout5 import CASES  # noqa: E402
from harness import batch  # noqa: E402
from healthy_heldout5 import HEALTHY  # noqa: E402
from stub_check import CHECKS, check_all, check_of, dist, moved, trained_on_held_aside  # noqa: E402

# shared_trunk_listed_twice's buggy form makes PyTorch warn once; the check reads the numbers instead.
warnings.filterwarnings("ignore", message="optimizer contains a parameter group with duplicate parameters")


def _eval_loss(model, make=None, loss_fn=F.cross_entropy):
    torch.manual_seed(123)
    x, y = (make or (lambda: batch(512)))()
    model.eval()
    with torch.no_grad():
        return float(loss_fn(model(x), y))


def _in_groups(opt, p):
    return any(q is p for g in opt.param_groups for q in g["params"])


@check_of("custom_function_drops_weight_grad")
def _custom_fn(b, f):
    gb = b[0].model[2].weight.grad is None
    mb, mf = moved(b[0], "2.weight"), moved(f[0], "2.weight")
    bias_b = moved(b[0], "2.bias")
    c5._LinearFn.buggy = False  # the fixed backward against autograd's own derivative of x @ w.T + b
    x, w, bias = (torch.randn(4, 5, dtype=torch.double, requires_grad=True),
                  torch.randn(3, 5, dtype=torch.double, requires_grad=True),
                  torch.randn(3, dtype=torch.double, requires_grad=True))
    exact = torch.autograd.gradcheck(c5._LinearFn.apply, (x, w, bias))
    return gb and mb == 0 and bias_b > 0 and mf > 0 and exact, \
        f"custom layer weight: buggy .grad None {gb}, moved {mb:.3g} (bias moved {bias_b:.3g}); fixed moved " \
        f"{mf:.3g}, fixed backward passes gradcheck {exact}"


@check_of("from_pretrained_frozen_default")
def _from_pretrained(b, f):
    rb, rf = b[0].model[0].weight.requires_grad, f[0].model[0].weight.requires_grad
    mb, mf = moved(b[0], "0.weight"), moved(f[0], "0.weight")
    _, table = c5._vocab_task()
    idx = torch.arange(c5._VOCAB)[:, None]

    def acc(e):  # accuracy over the whole vocabulary
        with torch.no_grad():
            return float((e.model(idx).argmax(1) == table).float().mean())
    ab, af = acc(b[0]), acc(f[0])
    return not rb and rf and mb == 0 and mf > 0 and af > ab + 0.1, \
        f"embedding requires_grad: buggy {rb}, fixed {rf}; moved {mb:.3g} / {mf:.3g}; vocabulary accuracy " \
        f"{ab:.2f} / {af:.2f}"


@check_of("step_every_batch_in_accumulation")
def _accumulation(b, f):
    nb, nf = len(b[0].steps), len(f[0].steps)
    g = [s["gmax"] for s in b[0].steps]
    first, last = sum(g[0::4]) / len(g[0::4]), sum(g[3::4]) / len(g[3::4])
    return nb == 4 * nf and last > 2 * first, \
        f"steps per 40 micro-batches: buggy {nb}, fixed {nf}; buggy mean |grad| max at the window's first " \
        f"step {first:.3g}, at its fourth {last:.3g} (the window's gradients re-applied)"


@check_of("warmup_scheduler_never_stepped")
def _warmup(b, f):
    lb, lf = [s["lrs"][0] for s in b[0].steps], [s["lrs"][0] for s in f[0].steps]
    mb, mf = moved(b[0], "0.weight"), moved(f[0], "0.weight")
    return max(lb) == 0 and lf[0] == 0 and lf[1] > 0 and lf[-1] == 1e-2 and mb == 0 and mf > 0, \
        f"lr at steps 0/1/39: buggy {lb[0]:.3g}/{lb[1]:.3g}/{lb[-1]:.3g}, fixed {lf[0]:.3g}/{lf[1]:.3g}/" \
        f"{lf[-1]:.3g}; moved {mb:.3g} / {mf:.3g}"


@check_of("param_groups_by_layer_type")
def _groups(b, f):
    nb = b[0].model.norm.weight
    inb, inf = _in_groups(b[0].opts[0], nb), _in_groups(f[0].opts[0], f[0].model.norm.weight)
    gb = nb.grad is not None and float(nb.grad.abs().max()) > 0
    mb, mf = moved(b[0], "norm.weight"), moved(f[0], "norm.weight")
    return not inb and inf and gb and mb == 0 and mf > 0, \
        f"LayerNorm weight in a param group: buggy {inb}, fixed {inf}; buggy has a gradient {gb}; moved " \
        f"{mb:.3g} / {mf:.3g}"


def _update_ratio(e):
    """One more plain step, every gradient 1, on a copy of the trained model with its optimizer's params
    list rebuilt the same way: the trunk's and the head's change over lr."""
    model = copy.deepcopy(e.model)
    group = e.opts[0].param_groups[0]["params"]
    twice = len(group) > len(set(map(id, group)))
    params = list(model.actor.parameters()) + list(model.critic.parameters()) if twice else model.parameters()
    opt = torch.optim.SGD(params, lr=0.05)
    for p in model.parameters():
        p.grad = torch.ones_like(p)
    trunk, head = model.trunk[0].weight, model.actor[1].weight
    before = trunk.detach().clone(), head.detach().clone()
    opt.step()
    return tuple(float((b - a.detach()).mean()) / 0.05 for b, a in zip(before, (trunk, head)))


@check_of("shared_trunk_listed_twice")
def _listed_twice(b, f):
    pb, pf = b[0].opts[0].param_groups[0]["params"], f[0].opts[0].param_groups[0]["params"]
    db, df = len(pb) - len(set(map(id, pb))), len(pf) - len(set(map(id, pf)))
    (tb, hb), (tf, _) = _update_ratio(b[0]), _update_ratio(f[0])
    return db == 2 and df == 0 and abs(tb - 2) < 1e-3 and abs(hb - 1) < 1e-3 and abs(tf - 1) < 1e-3, \
        f"duplicate tensors in the group: buggy {db}, fixed {df}; change / (lr * grad) of the trunk: buggy " \
        f"{tb:.3f} (head {hb:.3f}), fixed {tf:.3f}"


@check_of("lr_set_as_attribute")
def _lr_attr(b, f):
    lb, lf = [s["lrs"][0] for s in b[0].steps], [s["lrs"][0] for s in f[0].steps]
    first = next((i for i, (u, v) in enumerate(zip(lb, lf)) if u != v), None)
    return len(set(lb)) == 1 and lf[-1] < lb[-1] / 10 and first == 8 and hasattr(b[0].opts[0], "lr"), \
        f"group lr at step 39: buggy {lb[-1]:.3g} (optimizer.lr attribute {b[0].opts[0].lr:.3g}), fixed " \
        f"{lf[-1]:.3g}; first differs at step {first}"


@check_of("frozen_embedding_renormed_by_max_norm")
def _max_norm(b, f):
    rb = b[0].model.emb.weight.requires_grad
    mb, mf = moved(b[0], "emb.weight"), moved(f[0], "emb.weight")
    nb = float(b[0].model.emb.weight.norm(dim=1).max())
    nf = float(f[0].model.emb.weight.norm(dim=1).max())
    return not rb and mb > 1 and mf == 0, \
        f"frozen embedding (requires_grad {rb}) moved: buggy {mb:.3g}, fixed {mf:.3g}; largest row norm at the " \
        f"end {nb:.3g} / {nf:.3g}"


@check_of("weight_noise_added_in_place")
def _weight_noise(b, f):
    lb, lf = _eval_loss(b[0].model), _eval_loss(f[0].model)
    db, df = dist(b[0]), dist(f[0])
    return db > 1.5 * df and lb > lf + 0.1, \
        f"distance from the first weights: buggy {db:.3g}, fixed {df:.3g}; held-aside loss {lb:.3f} / {lf:.3f}"


@check_of("clip_before_backward")
def _clip(b, f):
    gb, gf = max(s["gmax"] for s in b[0].steps), max(s["gmax"] for s in f[0].steps)
    over = sum(s["gmax"] > 1.0 for s in b[0].steps)
    return gb > 1.0 and gf <= 1.0 + 1e-6 and over >= 10, \
        f"largest gradient entry at a step (clip norm 1): buggy {gb:.3g} ({over} steps over 1), fixed {gf:.3g}"


@check_of("lstm_without_batch_first")
def _batch_first(b, f):
    def leak(e):  # change sample 0 only: how much does sample 5's output move?
        torch.manual_seed(4)
        x, _ = c5._sequences(32)
        x2 = x.clone()
        x2[0] += 3.0
        e.model.eval()
        with torch.no_grad():
            return float((e.model(x)[5] - e.model(x2)[5]).abs().max())
    kb, kf = leak(b[0]), leak(f[0])
    lb, lf = _eval_loss(b[0].model, lambda: c5._sequences(512)), _eval_loss(f[0].model, lambda: c5._sequences(512))
    return kb > 1e-3 and kf == 0 and lb > lf + 0.1, \
        f"sample 5's output moved by changing sample 0: buggy {kb:.3g}, fixed {kf:.3g}; held-aside loss " \
        f"{lb:.3f} / {lf:.3f}"


@check_of("kl_div_given_probabilities")
def _kl(b, f):
    teacher = c5._teacher()

    def true_kl(e):
        def make():
            x = torch.randn(512, 10)
            return x, teacher(x)
        return _eval_loss(e.model, make, c5.kd_loss(False))
    kb, kf = true_kl(b[0]), true_kl(f[0])
    torch.manual_seed(1)
    x = torch.randn(512, 10)
    with torch.no_grad():
        lb = float(c5.kd_loss(True)(b[0].model(x), teacher(x)))
    return kb > 2 * kf and lb < 0, \
        f"true KL(teacher || student) on held-aside inputs: buggy {kb:.3f}, fixed {kf:.3f}; the buggy loss " \
        f"value {lb:.3f} (a KL divergence is never negative)"


@check_of("target_network_aliased")
def _target(b, f):
    ab = b[0].model.target is b[0].model.online
    af = f[0].model.target is f[0].model.online
    gap_f = max(float((p - q).detach().abs().max()) for p, q in
                zip(f[0].model.target.parameters(), f[0].model.online.parameters()))
    return ab and not af and gap_f > 0, \
        f"target is the online network: buggy {ab}, fixed {af}; fixed target lags the online net by {gap_f:.3g}"


@check_of("functional_dropout_in_eval")
def _dropout(b, f):
    def spread(e):
        x, _ = batch(64)
        e.model.eval()
        with torch.no_grad():
            return float((e.model(x) - e.model(x)).abs().max())
    sb, sf = spread(b[0]), spread(f[0])
    lb, lf = _eval_loss(b[0].model), _eval_loss(f[0].model)
    return sb > 0 and sf == 0 and lb > lf, \
        f"two eval passes on one batch differ by: buggy {sb:.3g}, fixed {sf:.3g}; eval loss {lb:.3f} / {lf:.3f}"


# Healthy loops whose model maps harness.batch()'s inputs (N x 10) to 3 logits: their loss on a
# fixed held-aside batch must fall from the initial weights to the final ones. The prompt-tuned
# encoder and the TD value network are checked on their own held-aside data.
CLASSIFIERS = {"custom_function_swish", "bitfit_bias_only", "gradient_centralisation", "noam_schedule_by_hand",
               "rmsprop_centered_momentum", "static_loss_scale_by_hand", "stochastic_depth_blocks",
               "hypernetwork_generated_weights"}


def _own_loss(e, make, loss_fn):
    start = copy.deepcopy(e.model)
    with torch.no_grad():
        for n, p in start.named_parameters():
            p.copy_(e.init[n])
    return _eval_loss(start, make, loss_fn), _eval_loss(e.model, make, loss_fn)


def trained(name, entries):
    e = entries[0]
    if name == "soft_prompt_tuning":
        before, after = _own_loss(e, lambda: h5._tokens(512), F.cross_entropy)
    elif name == "semi_gradient_td_target":  # the true value of this linear chain is s . w_r / (1 - 0.9 * 0.5)
        def make():
            s, _, _ = h5._td_batch(512)
            return s, (s @ h5._W_R / 0.55)[:, None]
        before, after = _own_loss(e, make, F.mse_loss)
    else:
        return trained_on_held_aside(dict.fromkeys(CLASSIFIERS))(name, entries)
    return after < before, f" held-aside loss {before:.3f} -> {after:.3f}"


def main():
    return check_all(CASES, HEALTHY, CHECKS, trained)


if __name__ == "__main__":
    sys.exit(main())
