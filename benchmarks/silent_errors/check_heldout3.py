"""Checks that the third held-out set's cases hold their bugs, without the recorder:

    python benchmarks/silent_errors/check_heldout3.py

Every case (cases_heldout3.py) runs in both forms, and every healthy loop (healthy_heldout3.py)
once, with a stand-in recorder that keeps references to the model and optimizers and, through a
step pre-hook, each step's largest gradient entry, whether it is finite and the lrs; it records
nothing and checks nothing of gradrepro's. Per case, a line says whether the buggy form shows its
bug and the fixed form does not, with the numbers; a healthy loop must run, stay finite and train.
Exit status 1 if any check fails."""

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from cases_heldout3 import CASES  # noqa: E402
from harness import batch  # noqa: E402
from healthy_heldout3 import HEALTHY  # noqa: E402
from stub_check import CHECKS, check_all, check_of, dist, finite_params, moved, run, same_params, trained_on_held_aside  # noqa: E402


@check_of("backbone_group_filtered_while_frozen")
def _backbone_group(b, f):
    mb, mf = moved(b[0], "0.weight"), moved(f[0], "0.weight")
    nb = len(b[0].opts[0].param_groups[0]["params"])
    return mb == 0 and mf > 0 and nb == 0, f"body moved: buggy {mb:.3g}, fixed {mf:.3g}; buggy body group size {nb}"


@check_of("no_decay_names_miss_layer_norm")
def _no_decay(b, f):
    def decay_of(e):
        w = e.model.layer_norm.weight
        return [g["weight_decay"] for g in e.opts[0].param_groups if any(p is w for p in g["params"])][0]
    db, df = decay_of(b[0]), decay_of(f[0])
    wb, wf = float(b[0].model.layer_norm.weight.detach().mean()), float(f[0].model.layer_norm.weight.detach().mean())
    return db > 0 and df == 0 and wb < wf, \
        f"layer_norm.weight decay: buggy {db}, fixed {df}; its mean at the end buggy {wb:.4f}, fixed {wf:.4f}"


@check_of("lr_adjust_overwrites_group_lrs")
def _lr_adjust(b, f):
    lb, lf = b[0].steps[10]["lrs"], f[0].steps[10]["lrs"]
    return lb[0] == lb[1] and abs(lf[0] * 10 - lf[1]) < 1e-12, f"group lrs at step 10: buggy {lb}, fixed {lf}"


@check_of("freeze_undone_by_later_loop")
def _freeze_undone(b, f):
    mb, mf = moved(b[0], "0.weight"), moved(f[0], "0.weight")
    return mb > 0 and mf == 0, f"frozen layer moved: buggy {mb:.3g}, fixed {mf:.3g}"


@check_of("warmup_restarts_every_epoch")
def _warmup_restarts(b, f):
    lb, lf = [s["lrs"][0] for s in b[0].steps], [s["lrs"][0] for s in f[0].steps]
    zb = [i for i, v in enumerate(lb) if v == 0]
    zf = [i for i, v in enumerate(lf) if v == 0]
    return zb == [0, 8, 16, 24, 32] and zf == [0] and lb[:8] == lf[:8], f"steps with lr 0: buggy {zb}, fixed {zf}"


@check_of("warmup_scheduler_stepped_per_epoch")
def _warmup_per_epoch(b, f):
    mb, mf = max(s["lrs"][0] for s in b[0].steps), max(s["lrs"][0] for s in f[0].steps)
    return mb <= 0.01 * 5 / 32 + 1e-12 and abs(mf - 0.01) < 1e-12, f"largest lr: buggy {mb:.3g}, fixed {mf:.3g}"


@check_of("dropout_flag_passed_as_rate")
def _dropout_flag(b, f):
    mb, mf = moved(b[0], "fc1.weight"), moved(f[0], "fc1.weight")
    return mb == 0 and mf > 0, f"fc1.weight moved: buggy {mb:.3g}, fixed {mf:.3g} (buggy p={b[0].model.dropout})"


@check_of("bn_momentum_tensorflow_convention")
def _bn_momentum(b, f):
    def gap(e):
        bn = e.model[1]
        return float((bn.running_mean - bn.last_batch_mean).abs().max())
    gb, gf = gap(b[0]), gap(f[0])
    return gb < 0.2 * gf, f"max |running_mean - last batch mean|: buggy {gb:.3g}, fixed {gf:.3g}"


@check_of("layer_norm_over_batch_axis")
def _ln_batch(b, f):
    def leak(e):
        x = torch.randn(16, 10)
        with torch.no_grad():
            return float((e.model(x)[:4] - e.model(x[:4])).abs().max())
    lb, lf = leak(b[0]), leak(f[0])
    return lb > 1e-3 and lf < 1e-5, f"max |out(batch of 16)[:4] - out(first 4)|: buggy {lb:.3g}, fixed {lf:.3g}"


@check_of("penalty_gradient_without_create_graph")
def _penalty(b, f):
    import cases_heldout3 as mod
    mod._PENALTY = 0.0
    try:
        _, z, _ = run(mod.CASES["penalty_gradient_without_create_graph"].run, True)
    finally:
        mod._PENALTY = 1.0
    sb, sf = same_params(b[0], z[0]), same_params(f[0], z[0])
    return sb and not sf, f"weights equal to the run with penalty weight 0: buggy {sb}, fixed {sf}"


@check_of("residual_layer_reads_block_input")
def _discarded(b, f):
    mb, mf = moved(b[0], "1.res1.weight"), moved(f[0], "1.res1.weight")
    gnone = b[0].model[1].res1.weight.grad is None
    return mb == 0 and mf > 0 and gnone, f"res1.weight moved: buggy {mb:.3g}, fixed {mf:.3g}; buggy .grad None: {gnone}"


@check_of("feature_hook_detaches_encoder")
def _hook_detach(b, f):
    mb, mf = moved(b[0], "encoder.0.weight"), moved(f[0], "encoder.0.weight")
    gnone = b[0].model.encoder[0].weight.grad is None
    return mb == 0 and mf > 0 and gnone, \
        f"encoder.0.weight moved: buggy {mb:.3g}, fixed {mf:.3g}; buggy .grad None: {gnone}"


@check_of("unknown_tokens_mapped_to_padding_index")
def _all_padding(b, f):
    mb, mf = moved(b[0], "embed.weight"), moved(f[0], "embed.weight")
    zb = float(b[0].model.embed.weight[0].detach().abs().max())
    return mb == 0 and mf > 0 and zb == 0, f"embedding moved: buggy {mb:.3g}, fixed {mf:.3g}; pad row max |.| {zb}"


@check_of("half_precision_softmax_overflow")
def _fp16(b, f):
    nb = [i for i, s in enumerate(b[0].steps) if not s["finite"]]
    nf = [i for i, s in enumerate(f[0].steps) if not s["finite"]]
    return nb[:1] == [0] and not nf and finite_params(f[0]), \
        f"steps with a non-finite gradient: buggy {nb[:3]}... ({len(nb)}), fixed {nf}; " \
        f"fixed params finite: {finite_params(f[0])}, moved {dist(f[0]):.3g}"


@check_of("background_class_weight_zero")
def _class_weight(b, f):
    def share0(e):
        torch.manual_seed(7)
        x, y = batch(512)
        with torch.no_grad():
            return float((e.model(x).argmax(1) == 0).float().mean()), float((y == 0).float().mean())
    (pb, t), (pf, _) = share0(b[0]), share0(f[0])
    return pb < 0.5 * pf, f"share predicted class 0: buggy {pb:.3f}, fixed {pf:.3f} (true share {t:.3f})"


@check_of("checkpoint_prefix_strict_false")
def _checkpoint(b, f):
    from cases_heldout3 import pretrained_state
    w = pretrained_state()["model.0.weight"]
    eb, ef = torch.equal(b[0].init["0.weight"], w), torch.equal(f[0].init["0.weight"], w)
    return not eb and ef, f"weights at the start equal the checkpoint's: buggy {eb}, fixed {ef}"


@check_of("replicas_gradients_never_reduced")
def _replicas(b, f):
    def gap(es):
        pairs = zip(es[0].model.parameters(), es[1].model.parameters())
        return max(float((p - q).detach().abs().max()) for p, q in pairs)
    gb, gf = gap(b), gap(f)
    return gb > 0 and gf == 0, f"max |replica0 - replica1| at the end: buggy {gb:.3g}, fixed {gf:.3g}"


# Healthy loops whose model maps harness.batch()'s inputs (N x 10) to 3 logits: their loss on a
# fixed held-aside batch must fall from the initial weights to the final ones (the input transform
# each loop applies, if any). The others (LSTM, MoCo, GAN, autoencoder) are checked to move and stay finite.
CLASSIFIERS = {"foreach_or_fused_adamw": None, "layerwise_lr_decay": None, "spectral_norm_critic": None,
               "running_mean_input_normaliser": lambda x: 3 * x + 2, "mixup_training": None,
               "quantisation_aware_ste": None, "per_sample_gradient_clipping": None, "reduce_lr_on_plateau": None}


def main():
    return check_all(CASES, HEALTHY, CHECKS, trained_on_held_aside(CLASSIFIERS))


if __name__ == "__main__":
    sys.exit(main())
