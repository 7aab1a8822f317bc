"""Checks that the eighth held-out set's cases hold their bugs, without the recorder:

    python benchmarks/silent_errors/check_heldout8.py

Every case (cases_heldout8.py) runs in both forms, and every healthy loop (healthy_heldout8.py)
once, with the stand-in recorder of stub_check.py, which keeps references to the model and
optimizers and each step's largest gradient entry, whether it is finite and the lrs; it records
nothing and checks nothing of gradrepro's. Per case, a line says whether the buggy form shows its
bug and the fixed form does not, with the numbers; a healthy loop must run, stay finite, move and
train (its mean loss over the last 5 steps below that over the first 5). Exit status 1 if any
check fails."""

import sys
import warnings
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
import cases_heldout8 as c8  # noqa: E402
from cases_heldout8 import CASES, SIDE  # noqa: E402
from healthy_heldout8 import HEALTHY, LOSSES  # noqa: E402
from stub_check import CHECKS, check_all, check_of, moved  # noqa: E402

warnings.filterwarnings("ignore")  # std() with one degree of freedom, duplicate parameters in a group


def first_nonfinite(e):
    return next((i for i, s in enumerate(e.steps) if not s["finite"]), -1)


def cosine(a, b):
    return float(F.cosine_similarity(a.flatten(), b.flatten(), dim=0))


# -- GANs ---------------------------------------------------------------------------------------------
@check_of("generator_adversarial_term_detached")
def _detached_fake(b, f):
    ab, af = SIDE["adversarial_term_on_detached_fake", True], SIDE["adversarial_term_on_detached_fake", False]
    mb, mf = moved(b[0], "0.weight"), moved(f[0], "0.weight")
    return max(ab) == 0 and min(af) > 0 and mb > 0 and mf > 0, \
        f"adversarial gradient norm reaching G: buggy max {max(ab):.3g}, fixed min {min(af):.3g}; G moved " \
        f"{mb:.3g} / {mf:.3g} (the L1 term trains it in both)"


@check_of("second_discriminator_not_optimized")
def _sub_disc(b, f):
    pb = max(moved(b[0], n) for n in ("mpd.0.weight", "mpd.2.weight"))
    pf = max(moved(f[0], n) for n in ("mpd.0.weight", "mpd.2.weight"))
    rb, rf = moved(b[0], "mrd.0.weight"), moved(f[0], "mrd.0.weight")
    gb = all(p.grad is not None for p in b[0].model.mpd.parameters())
    held = {id(p) for g in b[0].opts[0].param_groups for p in g["params"]}
    left = not any(id(p) in held for p in b[0].model.mpd.parameters())
    return pb == 0 and gb and left and pf > 0 and rb > 0 and rf > 0, \
        f"mpd moved: buggy {pb:.3g} (has grads {gb}, in no group {left}), fixed {pf:.3g}; mrd moved {rb:.3g} / {rf:.3g}"


# -- non-finite -----------------------------------------------------------------------------------------
@check_of("ctc_without_zero_infinity")
def _ctc(b, f):
    sb, sf = first_nonfinite(b[0]), first_nonfinite(f[0])
    nanw = not all(bool(torch.isfinite(p).all()) for p in b[0].model.parameters())
    return sb == 0 and sf == -1 and nanw, \
        f"first step with a non-finite gradient: buggy {sb}, fixed {sf}; buggy weights non-finite at the end {nanw}"


@check_of("last_batch_of_one_standardised")
def _std(b, f):
    sb, sf = first_nonfinite(b[0]), first_nonfinite(f[0])
    return sb == 3 and sf == -1, f"first step with a non-finite gradient: buggy {sb} (the batch of one), fixed {sf}"


# -- adapters and norms -----------------------------------------------------------------------------------
@check_of("lora_evaluation_merges_twice")
def _merge(b, f):
    def base_drift(buggy):
        model, base0 = SIDE["adapter_merge_not_idempotent", buggy]
        return max(float((m.base.weight - w).abs().max()) for m, w in zip(model.adapters(), base0)), model
    (db, mb), (df, _) = base_drift(True), base_drift(False)
    delta = max(float(m.delta().abs().max()) for m in mb.adapters())
    return db > 1e-3 and df < 1e-6 and not any(m.merged for m in mb.adapters()), \
        f"frozen base weights moved: buggy {db:.3g} (adapter delta now {delta:.3g}), fixed {df:.2g}"


@check_of("frozen_norms_reenabled_by_conversion")
def _norms(b, f):
    def drift(e):
        return max(float((buf - e.buffers0[n]).abs().max()) for n, buf in e.model.named_buffers()
                   if n.endswith("running_mean"))
    tb = [m.training for m in b[0].model.modules() if isinstance(m, torch.nn.BatchNorm2d)]
    db, df = drift(b[0]), drift(f[0])
    return db > 1e-2 and df == 0 and all(tb), \
        f"frozen backbone running_mean moved: buggy {db:.3g} (norms in train mode {tb}), fixed {df:.3g}"


# -- labels and data --------------------------------------------------------------------------------------
@check_of("causal_lm_labels_shifted_twice")
def _shift(b, f):
    torch.manual_seed(9)
    x = c8.lm_sequences(256)

    def acc(e, k):
        with torch.no_grad():
            pred = e.model(x).argmax(2)
        return float((pred[:, :-k] == x[:, k:]).float().mean())
    nb, nf, n2 = acc(b[0], 1), acc(f[0], 1), acc(b[0], 2)
    return nf > 0.9 and nb < 0.3 and n2 > 0.9, \
        f"next-token accuracy: buggy {nb:.2f}, fixed {nf:.2f}; buggy next-next-token accuracy {n2:.2f}"


@check_of("label_maps_resized_bilinear")
def _bilinear(b, f):
    torch.manual_seed(4)
    x, y = c8.label_maps(64)
    xb, yb = c8.resize_pair(x, y, True)
    _, yf = c8.resize_pair(x, y, False)
    invented = int((yb == 2).sum())
    with torch.no_grad():
        pb, pf = (e[0].model(xb).argmax(1) for e in (b, f))
    false2b, false2f = int((pb == 2).sum()), int((pf == 2).sum())
    return invented > 0 and int((yf == 2).sum()) == 0 and false2b > false2f, \
        f"class-2 pixels in resized labels: buggy {invented}, fixed {int((yf == 2).sum())}; pixels predicted as " \
        f"class 2 (no such object): buggy {false2b}, fixed {false2f}"


@check_of("sampling_reseeds_training_rng")
def _seed(b, f):
    def repeats(drawn):
        return [s for s in range(8, len(drawn)) if any(torch.equal(drawn[s], drawn[r]) for r in range(s))]
    rb, rf = repeats(SIDE["global_seed_reset_by_sampling", True]), repeats(SIDE["global_seed_reset_by_sampling", False])
    return len(rb) > 0 and rb[0] == 16 and rf == [], \
        f"steps whose batch repeats an earlier one: buggy {len(rb)} (first {rb[0] if rb else None}), fixed {len(rf)}"


# -- RL -------------------------------------------------------------------------------------------------
@check_of("ddpg_actor_minimises_q")
def _actor(b, f):
    rb, rf = SIDE["actor_loss_sign_missing", True], SIDE["actor_loss_sign_missing", False]
    return rb[-1] < rb[0] and rf[-1] > rf[0], \
        f"actor's reward: buggy {rb[0]:.3f} -> {rb[-1]:.3f}, fixed {rf[0]:.3f} -> {rf[-1]:.3f}"


@check_of("reinforce_with_mean_log_prob")
def _reinforce(b, f):
    ub, pb = SIDE["episode_mean_log_prob", True]
    uf, pf = SIDE["episode_mean_log_prob", False]
    cb, cf = cosine(ub, pb), cosine(uf, pf)
    return cb < 0.95 and cf > 0.9999, \
        f"cosine of the gradient used with the per-action policy gradient at step 0: buggy {cb:.3f}, fixed {cf:.4f}"


# -- checkpointing, sharding, reward models ----------------------------------------------------------------
@check_of("checkpoint_without_rng_state")
def _ckpt(b, f):
    tb, ub = SIDE["checkpoint_rng_not_preserved", True]
    tf, uf = SIDE["checkpoint_rng_not_preserved", False]
    eb, ef = float((tb - ub).abs().max()), float((tf - uf).abs().max())
    return eb > 1e-3 and ef < 1e-6, \
        f"gradient vs the gradient of the loss computed (max abs diff): buggy {eb:.3g} (cosine {cosine(tb, ub):.3f})" \
        f", fixed {ef:.2g}"


@check_of("gradient_clipped_per_shard")
def _clip(b, f):
    cb, cf = SIDE["clip_norm_per_shard", True], SIDE["clip_norm_per_shard", False]
    rb = max(max(c) / min(c) for c in cb)
    rf = max(max(c) / min(c) for c in cf)
    active = sum(min(c) < 1 for c in cf)
    return rb > 1.2 and rf == 1.0 and cb[0][0] != cb[0][1], \
        f"largest ratio of the two shards' clip coefficients: buggy {rb:.2f} (step 0: {cb[0][0]:.3f} / " \
        f"{cb[0][1]:.3f}), fixed {rf:.2f}; fixed clipping active on {active} of {len(cf)} steps"


@check_of("reward_model_sigmoid_loss")
def _rank(b, f):
    torch.manual_seed(6)
    c, r = c8.preference_pairs(1024)

    def acc(e):
        with torch.no_grad():
            return float((e.model(c) > e.model(r)).float().mean())
    a0 = acc(type("E", (), {"model": _start(b[0])}))
    ab, af = acc(b[0]), acc(f[0])
    return af > ab + 0.05 and af > a0, f"pairwise accuracy: start {a0:.3f}, buggy {ab:.3f}, fixed {af:.3f}"


def _start(e):
    import copy
    m = copy.deepcopy(e.model)
    with torch.no_grad():
        for n, p in m.named_parameters():
            p.copy_(e.init[n])
    return m


def trained(name, entries):
    losses = LOSSES.get(name, [])
    if len(losses) < 10:
        return False, " no losses logged"
    first, last = sum(losses[:5]) / 5, sum(losses[-5:]) / 5
    return last < first, f" loss (first 5 -> last 5) {first:.3f} -> {last:.3f}"


def main():
    return check_all(CASES, HEALTHY, CHECKS, trained)


if __name__ == "__main__":
    sys.exit(main())
